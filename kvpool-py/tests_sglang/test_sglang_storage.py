"""kvpool as SGLang's HiCache L3 storage backend, driven through SGLang's own host pools, its
backend factory and its cache controller's page functions, on CPU."""

import os
import urllib.request

import pytest
import torch
from conftest import (
    POOLS,
    Controller,
    attach,
    host_pool,
    kvpool_extra,
    make_weights,
    page_bytes,
    page_keys,
    storage_config,
)
from redis_server import free_port

import kvpool.sglang
from kvpool.sglang.storage import KvpoolStorage

NPAGES = 5


def tier_config(scratch, tier, redis_server=None, name="tier"):
    """An inline kvpool config: L1 only, disk only, or L1 over Redis."""
    if tier == "l1":
        return {"local_cpu": {"max_size": "64MiB"}}
    if tier == "disk":
        path = os.path.join(scratch, f"disk-{name}")
        return {"local_cpu": {"enabled": False},
                "tier": [{"url": f"file://{path}", "capacity": "256MiB"}]}
    return {"local_cpu": {"max_size": "64MiB"}, "tier": [{"url": redis_server.url}]}


def stored_pages(host, n=NPAGES):
    """Allocates ``n`` pages of the host pool (random KV) and returns their indices and bytes."""
    idx = host.alloc(n * host.page_size)
    return idx, [page_bytes(host, idx, p) for p in range(n)]


@pytest.mark.parametrize("zero_copy", [True, False], ids=["v1", "flat"])
@pytest.mark.parametrize("kind,layout", POOLS)
@pytest.mark.parametrize("tier", ["l1", "disk", "redis"])
def test_pages_round_trip_byte_exact_into_other_host_slots(
        scratch, weights, request, tier, kind, layout, zero_copy):
    redis_server = request.getfixturevalue("redis_server") if tier == "redis" else None
    name = f"{kind}-{layout}-{zero_copy}"
    config = tier_config(scratch, tier, redis_server, name)
    extra = kvpool_extra(config, weights, interface_v1=zero_copy)
    host = host_pool(kind, layout)
    writer = attach(host, kind, layout, extra)
    assert isinstance(writer, KvpoolStorage)
    ctrl = Controller(writer, host, zero_copy)
    keys = page_keys(NPAGES, salt=name)
    idx, want = stored_pages(host)
    assert ctrl.backup(keys, idx) is True
    if tier != "l1":
        # Another engine (a restart): its L1 is empty, the pages come from the lower tier.
        writer.close()
        host = host_pool(kind, layout)
        reader = attach(host, kind, layout, extra)
        ctrl = Controller(reader, host, zero_copy)
    assert ctrl.exists(keys) == NPAGES
    dst = host.alloc(NPAGES * host.page_size)
    assert not torch.equal(page_bytes(host, dst, 0), want[0])
    assert ctrl.prefetch(keys, dst) == NPAGES
    for p in range(NPAGES):
        assert torch.equal(page_bytes(host, dst, p), want[p]), f"page {p}"
    ctrl.ctrl.storage_backend.close()


def test_batch_exists_counts_leading_pages_and_a_read_stops_at_the_first_missing(weights):
    host = host_pool("mha", "page_first")
    backend = attach(host, "mha", "page_first", kvpool_extra({}, weights))
    ctrl = Controller(backend, host)
    keys = page_keys(4, salt="gap")
    idx, want = stored_pages(host, 4)
    page = host.page_size
    # Pages 0, 1 and 3 stored; 2 missing.
    assert ctrl.backup(keys[:2], idx[: 2 * page]) is True
    assert ctrl.backup(keys[3:], idx[3 * page:]) is True
    assert ctrl.exists(keys) == 2
    assert ctrl.exists(keys[2:]) == 0
    assert ctrl.exists(keys[3:]) == 1
    assert backend.exists(keys[0]) and not backend.exists(keys[2])
    dst = host.alloc(4 * page)
    before = page_bytes(host, dst, 3)
    assert backend.batch_get_v1(keys, dst) == [True, True, False, False]
    assert torch.equal(page_bytes(host, dst, 1), want[1])
    assert torch.equal(page_bytes(host, dst, 3), before), "nothing written past the prefix"
    backend.close()


def test_a_corrupt_page_in_redis_is_a_miss_and_never_written(scratch, weights, redis_server):
    extra = kvpool_extra(tier_config(scratch, "redis", redis_server), weights)
    host = host_pool("mha", "layer_first")
    writer = attach(host, "mha", "layer_first", extra)
    keys = page_keys(3, salt="corrupt")
    idx, want = stored_pages(host, 3)
    assert Controller(writer, host).backup(keys, idx) is True
    writer.close()
    stored = redis_server.keys()
    assert len(stored) == 3, stored
    # Flip bytes inside one page's value (past its header).
    victim = sorted(stored)[0]
    size = int(redis_server.cli("STRLEN", victim))
    redis_server.cli("SETRANGE", victim, str(size // 2), "KVPOOL!!")

    host = host_pool("mha", "layer_first")
    reader = attach(host, "mha", "layer_first", extra)
    dst = host.alloc(3 * host.page_size)
    before = [page_bytes(host, dst, p) for p in range(3)]
    got = reader.batch_get_v1(keys, dst)
    assert got.count(True) < 3, "the corrupt page was read"
    for p, ok in enumerate(got):
        if ok:
            assert torch.equal(page_bytes(host, dst, p), want[p])
        else:
            assert torch.equal(page_bytes(host, dst, p), before[p]), f"page {p} was written"
    assert reader.totals()["pages_missed"] == 3 - got.count(True)
    reader.close()


def test_mla_is_written_once_and_read_by_every_rank_while_mha_ranks_keep_their_own(
        scratch, weights, redis_server):
    keys = page_keys(3, salt="ranks")
    for kind, layout in [("mla", "page_first"), ("mha", "page_first")]:
        redis_server.cli("FLUSHALL")
        extra = kvpool_extra(tier_config(scratch, "redis", redis_server), weights)
        hosts = [host_pool(kind, layout) for _ in range(2)]
        ranks = [attach(hosts[r], kind, layout, extra, tp_rank=r, tp_size=2) for r in range(2)]
        assert [b._native.is_writer for b in ranks] == (
            [True, False] if kind == "mla" else [True, True])
        wants = []
        for r in range(2):
            idx, want = stored_pages(hosts[r], 3)
            wants.append(want)
            assert Controller(ranks[r], hosts[r]).backup(keys, idx) is True
        for b in ranks:
            b.close()
        stored = redis_server.keys()
        assert len(stored) == (3 if kind == "mla" else 6), (kind, stored)
        # Fresh engines: rank 1 reads the pages from Redis.
        host = host_pool(kind, layout)
        rank1 = attach(host, kind, layout, extra, tp_rank=1, tp_size=2)
        dst = host.alloc(3 * host.page_size)
        assert Controller(rank1, host).prefetch(keys, dst) == 3
        # MLA: rank 0's latent (the only one written); MHA: rank 1's own heads.
        want = wants[0] if kind == "mla" else wants[1]
        for p in range(3):
            assert torch.equal(page_bytes(host, dst, p), want[p]), (kind, p)
        rank1.close()


def test_other_weights_another_interface_or_another_layout_share_nothing(scratch, weights):
    disk = tier_config(scratch, "disk", name="scopes")
    keys = page_keys(2, salt="scopes")
    host = host_pool("mha", "page_first")
    writer = attach(host, "mha", "page_first", kvpool_extra(disk, weights))
    idx, _ = stored_pages(host, 2)
    assert Controller(writer, host).backup(keys, idx) is True
    writer.close()

    other_weights = make_weights(os.path.join(scratch, "weights-b"), b"weights b")
    for layout, extra, zero_copy in [
            ("page_first", kvpool_extra(disk, other_weights), True),
            ("page_first", kvpool_extra(disk, weights, interface_v1=False), False),
            ("page_first_direct", kvpool_extra(disk, weights), True)]:
        host = host_pool("mha", layout)
        reader = attach(host, "mha", layout, extra)
        assert Controller(reader, host, zero_copy).exists(keys) == 0, (layout, extra)
        reader.close()
    # The same scope again does find them (the test above is not vacuous).
    host = host_pool("mha", "page_first")
    reader = attach(host, "mha", "page_first", kvpool_extra(disk, weights))
    assert Controller(reader, host).exists(keys) == 2
    reader.close()


def test_weights_named_by_weights_id_share_pages_whatever_the_files(scratch, weights):
    """``weights_id`` names the weights instead of their files: the same name finds the pages
    written over other weight files, another name finds none, an empty name is refused."""
    disk = tier_config(scratch, "disk", name="named")
    keys = page_keys(2, salt="named")
    host = host_pool("mha", "page_first")
    writer = attach(host, "mha", "page_first", kvpool_extra(disk, weights, weights_id="m@r1"))
    idx, _ = stored_pages(host, 2)
    assert Controller(writer, host).backup(keys, idx) is True
    writer.close()
    other_files = make_weights(os.path.join(scratch, "weights-named"), b"other files")
    for name, found in [("m@r1", 2), ("m@r2", 0)]:
        host = host_pool("mha", "page_first")
        reader = attach(host, "mha", "page_first",
                        kvpool_extra(disk, other_files, weights_id=name))
        assert Controller(reader, host).exists(keys) == found, name
        reader.close()
    with pytest.raises(ValueError, match="weights_id"):
        attach(host_pool("mha", "page_first"), "mha", "page_first",
               kvpool_extra(disk, weights, weights_id=""))


def namespaced_page_keys(tokens, page_size, extra_key=None, cache_salt=None):
    """A request's page keys as SGLang 0.5.23 derives them: a chain seeded by SGLang's own
    ``storage_namespace_seed(extra_key, cache_salt)`` (the LoRA adapter and the cache salt),
    each page's hash covering the previous one. The per-page hash is a hashlib stand-in for
    SGLang's native one, which SGLang compiles at run time (it needs ninja and a compiler)."""
    import hashlib

    from sglang.srt.mem_cache.utils import storage_namespace_seed

    prior = storage_namespace_seed(extra_key, cache_salt)
    keys = []
    for start in range(0, len(tokens), page_size):
        page = tokens[start:start + page_size]
        h = hashlib.sha256(bytes.fromhex(prior) if prior else b"")
        h.update(b"".join(int(t).to_bytes(4, "little") for t in page))
        prior = h.hexdigest()
        keys.append(prior)
    return keys


def test_lora_adapters_and_cache_salts_share_no_pages(scratch, weights):
    """Two LoRA adapters, or two cache salts, over the same prompt and base weights share no
    page: SGLang seeds each request's page-hash chain with both, and kvpool stores and finds
    pages by exactly those keys (kvpool.sglang accepts only an SGLang that seeds them)."""
    # L1 only: a write is there when `backup` returns (the disk tier's is written behind).
    host = host_pool("mha", "page_first")
    backend = attach(host, "mha", "page_first", kvpool_extra(tier_config(scratch, "l1"), weights))
    ctrl = Controller(backend, host)
    tokens = list(range(100, 100 + 3 * host.page_size))
    adapter_a = namespaced_page_keys(tokens, host.page_size, extra_key="lora-a")
    idx, want = stored_pages(host, 3)
    assert ctrl.backup(adapter_a, idx) is True
    for extra_key, cache_salt in [("lora-b", None), (None, None), ("lora-a", "tenant-2"),
                                  (None, "lora-a")]:
        other = namespaced_page_keys(tokens, host.page_size, extra_key, cache_salt)
        assert ctrl.exists(other) == 0, (extra_key, cache_salt)
        assert ctrl.prefetch(other, host.alloc(3 * host.page_size)) == 0
    # The same adapter finds its own pages, byte for byte (the misses above are not vacuous).
    dst = host.alloc(3 * host.page_size)
    assert ctrl.prefetch(adapter_a, dst) == 3
    for p in range(3):
        assert torch.equal(page_bytes(host, dst, p), want[p])
    backend.close()


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_clear_forgets_what_was_stored_and_stats_are_sglangs_storage_metrics(weights):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    # The only test that serves kvpool's Prometheus metrics (one endpoint per process).
    port = free_port()
    host = host_pool("mha", "page_first")
    backend = attach(host, "mha", "page_first",
                     kvpool_extra({"metrics": {"listen": f"127.0.0.1:{port}"}}, weights))
    ctrl = Controller(backend, host)
    keys = page_keys(3, salt="clear")
    idx, _ = stored_pages(host, 3)
    assert backend.get_stats() is None
    assert ctrl.backup(keys, idx) is True
    assert ctrl.prefetch(keys, host.alloc(3 * host.page_size)) == 3
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert stats.prefetch_bandwidth[0] > 0
    assert backend.get_stats() is None, "drained"
    backend.clear()
    assert ctrl.exists(keys) == 0
    assert ctrl.prefetch(keys, host.alloc(3 * host.page_size)) == 0
    text = scrape(port)
    assert 'kvpool_sglang_pages_total{op="write",outcome="ok"} 3' in text, text
    assert 'kvpool_sglang_pages_total{op="read",outcome="ok"} 3' in text
    assert 'kvpool_sglang_pages_total{op="read",outcome="missed"} 3' in text
    backend.close()


def test_refusals_are_clear(weights):
    with pytest.raises(RuntimeError, match="SGLang 0.4.10 is not supported.*0.5.23"):
        kvpool.sglang.check_sglang_version("0.4.10")
    assert kvpool.sglang.check_sglang_version() == "0.5.23"
    host = host_pool("mha", "page_first")
    with pytest.raises(ValueError, match="unknown option.*'confg'"):
        attach(host, "mha", "page_first", {**kvpool_extra({}, weights), "confg": "x"})
    config = storage_config("mha", "page_first", kvpool_extra({}, weights))
    config.should_split_heads = True
    with pytest.raises(ValueError, match="heterogeneous TP"):
        KvpoolStorage(config, {})
    with pytest.raises(ValueError, match="max_sise"):
        attach(host, "mha", "page_first",
               kvpool_extra({"local_cpu": {"max_sise": "1GiB"}}, weights))
    backend = KvpoolStorage(storage_config("mha", "page_first", kvpool_extra({}, weights)), {})
    with pytest.raises(RuntimeError, match="no host pool registered"):
        backend.batch_exists(page_keys(1))
    # A hybrid model's other pools come after the KV pool.
    from sglang.srt.mem_cache.hicache_storage import PoolName

    early = KvpoolStorage(storage_config("mha", "page_first", kvpool_extra({}, weights)), {})
    with pytest.raises(RuntimeError, match="`mamba` host pool was registered before"):
        early.register_mem_host_pool_v2(host, PoolName.MAMBA)
    backend = attach(host, "mha", "page_first", kvpool_extra({}, weights))
    backend.close()
    assert backend.batch_exists(page_keys(1)) == 0, "a closed backend misses"
