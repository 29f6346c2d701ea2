"""What a key is bound to besides token ids, for every engine: the weights actually loaded, and
the pool config the engine hands kvpool.

The model identity is the served name plus a digest of the checkpoint's files (every weight
file, its index and config, read whole), so two checkpoints served under one name, or a
redeploy after fine-tuning, never share a chunk. Digests are cached per file by path, size
and modification time (``$XDG_CACHE_HOME/kvpool/file-digests.json``), so a restart with the
same files hashes nothing. Weights that are not files (``load_format="dummy"``, random
weights) get a digest unique to the process: such a model shares nothing.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
import uuid
from typing import Any

from kvpool import _native

logger = logging.getLogger("kvpool")

#: Checkpoint files whose bytes decide the KV (weights, their indexes, the model config).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
CONFIG_FILES = ("config.json", "params.json", "adapter_config.json")

_lock = threading.Lock()
#: Path -> (the file's identity: size, mtime, ctime, inode, device; its digest).
_memo: dict[str, tuple[tuple[int, ...], str]] = {}


def _cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvpool", "file-digests.json")


def _load_cache() -> None:
    if _memo:
        return
    try:
        with open(_cache_path(), encoding="utf-8") as f:
            for path, (identity, digest) in json.load(f).items():
                _memo[path] = (tuple(int(v) for v in identity), str(digest))
    except (OSError, ValueError, TypeError):
        pass


def _save_cache() -> None:
    path = _cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".digests-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({p: [list(identity), digest] for p, (identity, digest) in _memo.items()}, f)
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("kvpool: cannot write the digest cache %s: %s", path, e)


def _file_identity(st: os.stat_result) -> tuple[int, ...]:
    """What says a file's bytes are unchanged without reading them: size and modification
    time, which ``cp -p`` and ``rsync -a`` carry over to a different file, and the
    inode-change time, inode and device, which no copy can set (writing the bytes, or putting
    another file at the path, changes them)."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def file_digest(path: str) -> str:
    """The digest of one file's bytes, cached by path and the file's identity (above)."""
    real = os.path.realpath(path)
    identity = _file_identity(os.stat(real))
    with _lock:
        _load_cache()
        known = _memo.get(real)
        if known and known[0] == identity:
            return known[1]
    digest = _native.digest_file(real)
    with _lock:
        _memo[real] = (identity, digest)
        _save_cache()
    return digest


def _checkpoint_files(directory: str) -> tuple[list[str], list[str]]:
    """(every directory walked, every weight, index and config file found) below
    ``directory``."""
    directories, files = [], []
    for root, _, names in os.walk(directory):
        directories.append(root)
        for n in names:
            if n.endswith(WEIGHT_SUFFIXES) or n.endswith(".index.json") or n in CONFIG_FILES:
                files.append(os.path.join(root, n))
    return directories, files


def _digest_of_files(directory: str, files: list[str]) -> str | None:
    if not any(f.endswith(WEIGHT_SUFFIXES) for f in files):
        return None
    parts = [f"{os.path.relpath(f, directory)}={file_digest(f)}" for f in sorted(files)]
    return _native.digest_text("\n".join(parts))


def directory_digest(directory: str) -> str | None:
    """One digest over a checkpoint directory's weight and config files (names and bytes),
    or ``None`` when it holds no weight file."""
    return _digest_of_files(directory, _checkpoint_files(directory)[1])


#: What an adapter's digest was computed from: the identity of each directory walked and
#: file read, as ``(path, identity)``, or ``None`` for a path that no longer stats.
_Snapshot = tuple[tuple[str, "tuple[int, ...] | None"], ...]
#: Adapter path -> (its snapshot, its digest).
_adapters: dict[str, tuple[_Snapshot, str | None]] = {}


def _snapshot(paths: list[str]) -> _Snapshot:
    def identity(path: str) -> tuple[int, ...] | None:
        try:
            return _file_identity(os.stat(path))
        except OSError:
            return None

    return tuple((p, identity(p)) for p in paths)


#: A snapshot taken within this many nanoseconds of a file's or directory's last change is
#: not remembered: a change in the same clock tick keeps size, times and inode (git's "racy"
#: rule), so only a snapshot older than the tick can vouch for what it saw.
_RACY_NS = 2_000_000_000


def _racy(seen: _Snapshot, now_ns: int) -> bool:
    """Whether some entry of ``seen`` changed within ``_RACY_NS`` of ``now_ns`` (or could not
    be read, or nothing was seen at all)."""
    if not seen:
        return True
    for _, identity in seen:
        if identity is None:
            continue
        _, mtime_ns, ctime_ns, _, _ = identity
        if now_ns - max(mtime_ns, ctime_ns) < _RACY_NS:
            return True
    return False


def adapter_digest(path: str) -> str | None:
    """The digest of an adapter's weights (a checkpoint directory or one weight file), or
    ``None`` when ``path`` holds none. Computed once per adapter: a later call only stats
    ``path`` and the directories and files the digest was computed from, and computes it
    again when one of them changed, appeared or went (a directory's identity changes when an
    entry is added or removed). The stats are taken before the files are read, so a file
    changed while it was read is seen at the next call; a snapshot of files changed in the
    last two seconds is not remembered (``_RACY_NS``)."""
    with _lock:
        known = _adapters.get(path)
    if known is not None and _snapshot([p for p, _ in known[0]]) == known[0]:
        return known[1]
    now_ns = time.time_ns()
    if os.path.isdir(path):
        listed = _checkpoint_files(path)
        seen = _snapshot([path] + listed[0] + listed[1])
        digest = _digest_of_files(path, listed[1])
        if _checkpoint_files(path) != listed:
            # An entry came or went between the walk and the snapshot, which would then
            # vouch for a listing it did not see: not remembered, computed again next time.
            return digest
    elif os.path.isfile(path):
        seen = _snapshot([path])
        digest = file_digest(path)
    else:
        return None
    if not _racy(seen, now_ns):
        with _lock:
            _adapters[path] = (seen, digest)
    return digest


def _local_checkpoint(model: str, revision: str | None, download_dir: str | None) -> str | None:
    """Where the engine loads ``model``'s files from: a local directory as given, else the
    Hugging Face snapshot in ``download_dir`` (the engine's own download cache, as vLLM's
    ``--download-dir``) or, without one, the default Hugging Face cache."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True,
                                 cache_dir=download_dir or None)
    except Exception:  # noqa: BLE001 - any failure means: no local files to hash
        return None


#: Random digest of this process, for weights that are not files.
_PROCESS_NONCE = uuid.uuid4().hex


#: The option that names the weights instead of hashing their files (``weights_id``).
WEIGHTS_ID_OPTION = "weights_id"


def named_weights(weights_id: Any) -> str:
    """The weights scope of an operator's ``weights_id``: never equal to a digest of files."""
    if not isinstance(weights_id, str) or not weights_id.strip():
        raise ValueError(f"kvpool: option {WEIGHTS_ID_OPTION!r} must be a non-empty string "
                         f"naming the weights, not {weights_id!r}")
    return f"named:{weights_id.strip()}"


def weights_digest(model: str, revision: str | None = None, load_format: str = "auto",
                   download_dir: str | None = None, weights_id: str | None = None) -> str:
    """The digest of the weights a model path or Hugging Face id loads from its local files
    (in ``download_dir`` when the engine downloads there), or a digest unique to this
    process when there are none (random weights, nothing local). ``weights_id`` (the
    operator's ``weights_id`` option) names the weights instead: engines with the same served
    name and the same ``weights_id`` share chunks whatever they loaded, so it must change
    whenever the weights do."""
    if weights_id is not None:
        named = named_weights(weights_id)
        if "dummy" in load_format:
            logger.warning("kvpool: load_format=%s gives random weights, yet %s=%r makes this "
                           "engine share chunks with every engine so named: only correct if "
                           "their random weights are identical", load_format,
                           WEIGHTS_ID_OPTION, weights_id)
        logger.info("kvpool: weights named %r by the %s option (not hashed from files)",
                    named, WEIGHTS_ID_OPTION)
        return named
    if "dummy" in load_format:
        logger.warning("kvpool: load_format=%s gives random weights; this engine shares no "
                       "chunk with any other process", load_format)
        return f"process-{_PROCESS_NONCE}"
    directory = _local_checkpoint(model, revision, download_dir)
    digest = directory_digest(directory) if directory else None
    if digest is None:
        logger.warning("kvpool: no local weight files found for %s; keys are bound to this "
                       "process only (nothing is shared across restarts)", model)
        return f"process-{_PROCESS_NONCE}"
    return digest


def resolve_config(extra: dict[str, Any]) -> tuple[str, str]:
    """The pool config as (text, format) for the Rust side: ``config`` from
    the engine's options (a path, TOML text or a dict), else ``KVPOOL_CONFIG`` (a
    path), else embedded defaults; with ``pool`` (the node's daemon, ``unix:///path``)
    added as the first lower tier."""
    text, fmt = _resolve_config_file(extra)
    pool = extra.get("pool")
    if pool:
        return _native.config_with_pool(text, fmt, str(pool)), "json"
    return text, fmt


def _resolve_config_file(extra: dict[str, Any]) -> tuple[str, str]:
    value = extra.get("config", os.environ.get("KVPOOL_CONFIG"))
    if value is None:
        return "", "default"
    if isinstance(value, dict):
        return json.dumps(value), "json"
    if not isinstance(value, str):
        raise TypeError(f"kvpool: `config` must be a path, TOML text or a dict, not {type(value).__name__}")
    if value.lstrip().startswith("{"):
        return value, "json"
    if os.path.exists(value):
        with open(value, encoding="utf-8") as f:
            return f.read(), "toml"
    if "=" in value or "[" in value:
        return value, "toml"
    raise FileNotFoundError(f"kvpool: config file {value!r} does not exist")
