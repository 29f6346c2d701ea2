"""What keys are bound to: the weights digest of a checkpoint, cached per file so that a
restart does not read every weight file again, never reused for other bytes."""

import os
import shutil
import time

import pytest


@pytest.fixture
def identity(tmp_path, monkeypatch):
    """``kvpool.identity`` with its digest cache in ``tmp_path`` and empty in memory."""
    from kvpool import identity as module

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(module, "_memo", {})
    monkeypatch.setattr(module, "_adapters", {})
    return module


def test_a_same_size_file_copied_with_its_mtime_gets_a_new_digest(identity, tmp_path):
    """A fine-tune of the same size copied over the old weights with ``cp -p`` (or
    ``rsync -a``) keeps size and modification time: the cache must not hand back the old
    digest, or two checkpoints would share KV."""
    weights = tmp_path / "model" / "model.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(b"A" * 4096)
    old = identity.file_digest(str(weights))
    assert identity.file_digest(str(weights)) == old  # cached

    tuned = tmp_path / "tuned.safetensors"
    tuned.write_bytes(b"B" * 4096)
    stamp = os.stat(weights)
    os.utime(tuned, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    time.sleep(0.01)
    shutil.copy2(tuned, weights)  # cp -p: the bytes replaced in place, mtime carried over
    after = os.stat(weights)
    assert (after.st_size, after.st_mtime_ns) == (stamp.st_size, stamp.st_mtime_ns)
    assert identity.file_digest(str(weights)) != old

    # The same through the cache file, as a restarted engine reads it.
    identity._memo.clear()
    assert identity.file_digest(str(weights)) == identity._native.digest_file(str(weights))


def test_an_old_cache_file_is_ignored_not_trusted(identity, tmp_path):
    """A cache written by an earlier kvpool (path -> size, mtime, digest) is read as empty."""
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"C" * 100)
    st = os.stat(weights)
    cache = tmp_path / "cache" / "kvpool" / "file-digests.json"
    cache.parent.mkdir(parents=True)
    cache.write_text('{"%s": [%d, %d, "stale"]}' % (os.path.realpath(weights), st.st_size,
                                                    st.st_mtime_ns))
    assert identity.file_digest(str(weights)) != "stale"


def _hf_snapshot(cache_dir, repo_id, weights: bytes):
    """A Hugging Face cache in ``cache_dir`` holding one snapshot of ``repo_id`` (the layout
    ``huggingface_hub`` reads with ``local_files_only``)."""
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").write_bytes(weights)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_weights_in_the_engines_download_dir_are_the_ones_digested(identity, tmp_path,
                                                                    monkeypatch):
    """An engine started with ``--download-dir`` loads the snapshot there. The digest must
    come from that snapshot, not from an older one of the same model in the default Hugging
    Face cache: two engines with different weights would otherwise share keys."""
    default_cache, download_dir = tmp_path / "hf-default", tmp_path / "downloads"
    import huggingface_hub.constants

    # Read when huggingface_hub is imported, and again at each call: set both.
    monkeypatch.setenv("HF_HUB_CACHE", str(default_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(default_cache))
    _hf_snapshot(default_cache, "org/model", b"old weights" * 100)
    _hf_snapshot(download_dir, "org/model", b"new weights" * 100)
    from_default = identity.weights_digest("org/model")
    from_downloads = identity.weights_digest("org/model", download_dir=str(download_dir))
    assert not from_default.startswith("process-"), "the default cache's snapshot was found"
    assert from_downloads == identity.directory_digest(
        str(next((download_dir / "models--org--model" / "snapshots").iterdir())))
    assert from_downloads != from_default


def test_named_weights_are_the_name_never_a_digest_and_never_empty(identity, tmp_path):
    """``weights_id`` names the weights instead of their files: the same name whatever the
    files (an operator vouches for it), in a form no digest of files takes."""
    (tmp_path / "model.safetensors").write_bytes(b"weights" * 100)
    hashed = identity.weights_digest(str(tmp_path))
    named = identity.weights_digest(str(tmp_path), weights_id="llama-3-8b@rev7")
    assert named == identity.weights_digest("elsewhere", weights_id="llama-3-8b@rev7")
    assert named == "named:llama-3-8b@rev7" and named != hashed
    assert identity.weights_digest(str(tmp_path)) == hashed, "no name: the files are hashed"
    for bad in ("", "  ", 3):
        with pytest.raises(ValueError, match="weights_id"):
            identity.weights_digest(str(tmp_path), weights_id=bad)


@pytest.fixture
def lora_identity(identity, monkeypatch):
    """``kvpool.vllm.identity`` with no adapter seen yet, its digests computed by the fresh
    ``identity`` module."""
    from kvpool.vllm import identity as vllm_identity

    monkeypatch.setattr(vllm_identity, "_first_adapter_digests", {})
    return vllm_identity


def _adapter(tmp_path):
    adapter = tmp_path / "adapter"
    (adapter / "sub").mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"A" * 4096)
    (adapter / "sub" / "extra.safetensors").write_bytes(b"S" * 512)
    return adapter


def _counting_walks(monkeypatch):
    walks = []
    real_walk = os.walk
    monkeypatch.setattr(os, "walk",
                        lambda top, *a, **k: walks.append(top) or real_walk(top, *a, **k))
    return walks


def _replaced_in_place(path, tmp_path, byte):
    """``path``'s bytes replaced as ``cp -p`` does: same size and modification time."""
    stamp = os.stat(path)
    other = tmp_path / "other"
    other.write_bytes(byte * stamp.st_size)
    os.utime(other, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    time.sleep(0.01)
    shutil.copy2(other, path)


@pytest.mark.parametrize("changed", ["top file", "file in a subdirectory", "added file",
                                     "one-file adapter"])
def test_a_lora_adapter_is_walked_once_and_a_changed_one_is_never_shared(
        identity, lora_identity, tmp_path, monkeypatch, changed):
    """vLLM's scheduler asks for a request's extra keys at every lookup: the adapter's
    directory is walked and its files hashed once, later lookups only stat them. A file
    replaced in place (``cp -p``: same size and time) or added anywhere under the adapter
    changes its digest; as vLLM may keep the old weights loaded, the adapter's keys are then
    bound to this process, never the new digest (another engine's) nor the old one."""
    monkeypatch.setattr(identity, "_RACY_NS", 0)  # the files were just written
    from types import SimpleNamespace

    adapter = _adapter(tmp_path)
    path = adapter / "adapter_model.safetensors" if changed == "one-file adapter" else adapter
    lora = SimpleNamespace(lora_name="sql", lora_path=str(path))
    walks = _counting_walks(monkeypatch)
    first = lora_identity._lora_identity(lora)
    expected = (identity.file_digest(str(path)) if changed == "one-file adapter"
                else identity.directory_digest(str(adapter)))
    assert first == f"sql@w={expected}"
    walks.clear()
    for _ in range(100):
        assert lora_identity._lora_identity(lora) == first
    assert walks == [], "walked again though nothing changed"

    if changed == "top file" or changed == "one-file adapter":
        _replaced_in_place(adapter / "adapter_model.safetensors", tmp_path, b"B")
    elif changed == "file in a subdirectory":
        _replaced_in_place(adapter / "sub" / "extra.safetensors", tmp_path, b"T")
    else:
        (adapter / "sub" / "more.safetensors").write_bytes(b"C" * 64)
    assert identity.adapter_digest(str(path)) != expected, "the change is seen"
    process_bound = f"sql@w=process-{identity._PROCESS_NONCE}"
    assert lora_identity._lora_identity(lora) == process_bound
    assert lora_identity._lora_identity(lora) == process_bound, "and stays so"


def test_an_adapter_changed_just_now_is_not_remembered(identity, lora_identity, tmp_path,
                                                       monkeypatch):
    """Files changed within the clock's tick can change again without their size, times or
    inode changing: a snapshot so fresh is not trusted, the digest is computed at each
    lookup until it is older than that (git's racy rule). A path that holds no weights binds
    the key to this process."""
    from types import SimpleNamespace

    adapter = _adapter(tmp_path)
    walks = _counting_walks(monkeypatch)
    lora = SimpleNamespace(lora_name="sql", lora_path=str(adapter))
    first = lora_identity._lora_identity(lora)
    walks.clear()
    assert lora_identity._lora_identity(lora) == first
    assert walks, "a fresh snapshot was remembered"
    gone = SimpleNamespace(lora_name="g", lora_path=str(tmp_path / "missing"))
    assert lora_identity._lora_identity(gone) == f"g@w=process-{identity._PROCESS_NONCE}"


def test_every_integration_names_its_scope_with_the_one_scope_function():
    """``_native.engine_scope`` (Rust's ``engine_scope_model``): the interface's tag, the
    weights and a digest of the layout description; a part of a scope below it; an unknown
    interface name is refused, not guessed."""
    from kvpool import _native

    tags = {"vllm-connector": "kv", "vllm-offload": "offload", "sglang": "sglang"}
    scopes = set()
    for interface, tag in tags.items():
        scope = _native.engine_scope(interface, "m", "named:v1", "layout")
        assert scope.startswith(f"m@w=named:v1|{tag}="), scope
        assert len(scope.rsplit("=", 1)[1]) == 16
        scopes.add(scope)
        assert _native.engine_scope(interface, "m", "named:v1", "layout2") != scope
        assert _native.engine_scope(interface, "m", "named:v2", "layout") != scope
    assert len(scopes) == 3, "interfaces never share a scope"
    part = _native.part_scope(scope, "mamba", "pool layout")
    assert part.startswith(scope + "|pool=mamba:") and part != _native.part_scope(
        scope, "mamba", "other layout")
    with pytest.raises(ValueError, match="unknown engine interface"):
        _native.engine_scope("kv", "m", "w", "layout")
