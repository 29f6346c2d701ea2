"""A hybrid model's other host pools through SGLang's ``*_v2`` storage calls: SGLang's own
``MambaPoolHost`` (one recurrent state per page, stored at the pages a radix node ends on) and
its sliding-window KV pool (``MHATokenToKVPoolHost`` over ``SWAKVPool``'s window layers), built
on CPU, driven as SGLang's ``HybridCacheController`` drives a backend, and checked against
SGLang's own ``HiCacheFile`` where the answer is a policy (which prefixes are restorable)."""

import os

import torch
from conftest import (
    Controller,
    attach,
    host_pool,
    kvpool_extra,
    page_keys,
    storage_config,
)
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

TRAILING = PoolHitPolicy.TRAILING_PAGES
MAMBA_SLOTS = 8


def mamba_host():
    """SGLang's Mamba host pool (page size 1: a state per slot), its states random. A state
    (3 layers of a 4x8x8 fp32 temporal state and a 6x3 bf16 conv state) is larger than a KV
    page, so attaching it refits kvpool's pool."""
    info = MambaStateBufferInfo(
        temporal=torch.zeros(3, MAMBA_SLOTS, 4, 8, 8, dtype=torch.float32),
        conv=(torch.zeros(3, MAMBA_SLOTS, 6, 3, dtype=torch.bfloat16),),
    )
    host = MambaPoolHost(info, 2.0, 0, device_capacity=MAMBA_SLOTS, pin_memory=False,
                         device="cpu", layout="page_first")
    with torch.no_grad():
        host.temporal_buffer.copy_(torch.randn(host.temporal_buffer.shape))
        for conv in host.conv_buffer:
            conv.copy_(torch.randn(conv.shape).to(conv.dtype))
    return host


def swa_host(page):
    """SGLang's sliding-window KV host pool over ``SWAKVPool``'s window layers."""
    kv = SWAKVPool(size=64, size_swa=64, page_size=page, dtype=torch.bfloat16, head_num=2,
                   head_dim=8, swa_attention_layer_ids=[0, 1, 2], full_attention_layer_ids=[3],
                   device="cpu")
    cls, info, kw = _mha_host_inputs(kv.swa_kv_pool)
    host = MHATokenToKVPoolHost(info, 2.0, 0, page, "page_first", pin_memory=False,
                                device="cpu", pool_label="swa", **kw)
    with torch.no_grad():
        host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(host.dtype))
    return host


def attach_hybrid(config, weights, tp_rank=0, tp_size=1):
    """SGLang's attach for a hybrid host pool group: the KV pool, then every entry through
    ``register_mem_host_pool_v2`` (the KV pool too), then ``on_host_pools_registered``."""
    kv = host_pool("mha", "page_first")
    backend = attach(kv, "mha", "page_first", kvpool_extra(config, weights),
                     tp_rank=tp_rank, tp_size=tp_size)
    mamba, swa = mamba_host(), swa_host(kv.page_size)
    for pool, name in ((kv, PoolName.KV), (mamba, PoolName.MAMBA), (swa, PoolName.SWA)):
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend, kv, mamba, swa


def state_bytes(host, slot):
    return host.get_data_page(slot, flat=True).view(torch.uint8).clone()


def mamba_set(backend, key, slot):
    return backend.batch_set_v2([PoolTransfer(
        name=PoolName.MAMBA, host_indices=torch.tensor([slot]), keys=[key],
        hit_policy=TRAILING)])[PoolName.MAMBA]


def test_mamba_states_and_window_pages_round_trip_byte_exact_over_a_disk_tier(scratch, weights):
    config = {"local_cpu": {"max_size": "64MiB"},
              "tier": [{"url": f"file://{os.path.join(scratch, 'hybrid-disk')}"}]}
    backend, kv, mamba, swa = attach_hybrid(config, weights)
    keys = page_keys(4, salt="rt")
    src = mamba.alloc(1)
    assert mamba_set(backend, keys[3], int(src[0])) == [True]
    window = swa.alloc(2 * swa.page_size)
    done = backend.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=window,
                                              keys=keys[2:4], hit_policy=TRAILING)])
    assert done == {PoolName.SWA: [True, True]}
    # Read back into other slots, as a prefetch does.
    dst = mamba.alloc(1)
    window_dst = swa.alloc(2 * swa.page_size)
    got = backend.batch_get_v2([
        PoolTransfer(name=PoolName.MAMBA, host_indices=dst, keys=keys[3:4], hit_policy=TRAILING),
        PoolTransfer(name=PoolName.SWA, host_indices=window_dst, keys=keys[2:4],
                     hit_policy=TRAILING)])
    assert got == {PoolName.MAMBA: [True], PoolName.SWA: [True, True]}
    assert torch.equal(state_bytes(mamba, int(dst[0])), state_bytes(mamba, int(src[0])))
    for page in range(2):
        a = int(window[page * swa.page_size])
        b = int(window_dst[page * swa.page_size])
        assert torch.equal(state_bytes(swa, b), state_bytes(swa, a))
    backend.close()
    # A fresh backend over the same disk tier (the pool refitted again at attach) reads them.
    again, _, mamba2, _ = attach_hybrid(config, weights)
    slot = mamba2.alloc(1)
    assert mamba_set(again, page_keys(1, salt="other")[0], int(slot[0])) == [True]
    fresh = mamba2.alloc(1)
    got = again.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=fresh,
                                           keys=keys[3:4], hit_policy=TRAILING)])
    assert got == {PoolName.MAMBA: [True]}
    assert torch.equal(state_bytes(mamba2, int(fresh[0])), state_bytes(mamba, int(src[0])))
    again.close()


def test_restorable_prefixes_are_those_sglangs_own_file_backend_reports(scratch, weights):
    """KV pages 0-4 stored, Mamba states at pages 1 and 3 only, window pages at 0-3: the
    prefixes each hit policy allows, as ``HiCacheFile`` computes them."""
    backend, kv, mamba, swa = attach_hybrid({"local_cpu": {"max_size": "64MiB"}}, weights)
    file_cfg = storage_config("mha", "page_first",
                              {"file_storage_path": os.path.join(scratch, "hicache-file")})
    reference = HiCacheFile(file_cfg)
    reference.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    reference.register_mem_host_pool_v2(swa, PoolName.SWA)
    keys = page_keys(6, salt="policy")
    kv_slots = kv.alloc(5 * kv.page_size)
    assert Controller(backend, kv).backup(keys[:5], kv_slots)
    for k in keys[:5]:
        reference.set(k, kv.get_data_page(int(kv_slots[0]), flat=True))
    slot = mamba.alloc(1)
    window = swa.alloc(4 * swa.page_size)
    for store in (backend, reference):
        for i in (1, 3):
            assert store.batch_set_v2([PoolTransfer(
                name=PoolName.MAMBA, host_indices=slot, keys=[keys[i]],
                hit_policy=TRAILING)])[PoolName.MAMBA] == [True]
        assert store.batch_set_v2([PoolTransfer(
            name=PoolName.SWA, host_indices=window, keys=keys[:4],
            hit_policy=TRAILING)])[PoolName.SWA] == [True] * 4
    cases = [
        [PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAILING)],
        [PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"] * 2, hit_policy=TRAILING)],
        [PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAILING),
         PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"] * 2, hit_policy=TRAILING)],
        [PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"] * 2,
                      hit_policy=PoolHitPolicy.ALL_PAGES)],
    ]
    for transfers in cases:
        ours = backend.batch_exists_v2(keys, transfers)
        theirs = reference.batch_exists_v2(keys, transfers)
        assert (ours.kv_hit_pages, ours.restorable_prefix_pages, ours.extra_pool_hit_pages) == \
            (theirs.kv_hit_pages, theirs.restorable_prefix_pages,
             theirs.extra_pool_hit_pages), transfers
    mamba_only = backend.batch_exists_v2(keys, cases[0])
    assert (mamba_only.kv_hit_pages, mamba_only.restorable_prefix_pages) == (4, [2, 4])
    backend.close()


def test_missing_states_other_ranks_and_unknown_pools_are_misses_never_data(weights):
    backend, kv, mamba, swa = attach_hybrid({"local_cpu": {"max_size": "64MiB"}}, weights,
                                            tp_rank=0, tp_size=2)
    keys = page_keys(2, salt="miss")
    kv_slots = kv.alloc(2 * kv.page_size)
    assert Controller(backend, kv).backup(keys, kv_slots)
    src = mamba.alloc(1)
    assert mamba_set(backend, keys[1], int(src[0])) == [True]
    # The KV pages of the same hashes are not states: page 0 holds none.
    dst = mamba.alloc(1)
    before = state_bytes(mamba, int(dst[0]))
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=dst,
                                             keys=keys[:1], hit_policy=TRAILING)])
    assert got == {PoolName.MAMBA: [False]}
    assert torch.equal(state_bytes(mamba, int(dst[0])), before), "a missed slot was written"
    # Another TP rank's states are its own shard: a miss there.
    other, kv1, _, _ = attach_hybrid({"local_cpu": {"max_size": "64MiB"}}, weights,
                                     tp_rank=1, tp_size=2)
    assert Controller(other, kv1).backup(keys, kv1.alloc(2 * kv1.page_size))
    res = other.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA,
                                                    keys=["__placeholder__"],
                                                    hit_policy=TRAILING)])
    assert (res.kv_hit_pages, res.restorable_prefix_pages) == (0, []), "rank 0's state hit"
    other.close()
    # A pool kvpool was never given, and a hit policy it does not know, miss whole.
    for transfer in (PoolTransfer(name=PoolName.INDEXER, keys=["x"]),
                     PoolTransfer(name=PoolName.SWA, keys=["x"],
                                  hit_policy=PoolHitPolicy.BLOCK_GROUPS)):
        res = backend.batch_exists_v2(keys, [transfer])
        assert (res.kv_hit_pages, res.restorable_prefix_pages) == (0, []), transfer
    bad = backend.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=swa.alloc(swa.page_size),
                                             keys=keys, hit_policy=TRAILING)])
    assert bad == {PoolName.SWA: [False, False]}, "host indices that do not fit the keys"
    backend.close()
    assert backend.batch_exists_v2(keys, []).kv_hit_pages == 0, "a closed backend misses"


def test_clear_forgets_every_pools_pages(weights):
    backend, kv, mamba, swa = attach_hybrid({"local_cpu": {"max_size": "64MiB"}}, weights)
    keys = page_keys(1, salt="clear")
    assert Controller(backend, kv).backup(keys, kv.alloc(kv.page_size))
    assert mamba_set(backend, keys[0], int(mamba.alloc(1)[0])) == [True]
    transfers = [PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"],
                              hit_policy=TRAILING)]
    assert backend.batch_exists_v2(keys, transfers).kv_hit_pages == 1
    backend.clear()
    # KV pages stored again after the clear: the states from before it are gone.
    assert Controller(backend, kv).backup(keys, kv.alloc(kv.page_size))
    assert backend.batch_exists_v2(keys, transfers).kv_hit_pages == 0
    backend.close()


def test_a_refit_for_a_larger_pool_keeps_the_kv_pages_keys(scratch, weights):
    """A pool registered after KV pages were stored (a dynamic sidecar) whose pages are larger
    refits the pool: the KV pages stored before are still found in the lower tier."""
    config = {"local_cpu": {"max_size": "64MiB"},
              "tier": [{"url": f"file://{os.path.join(scratch, 'refit-disk')}"}]}
    kv = host_pool("mha", "page_first")
    backend = attach(kv, "mha", "page_first", kvpool_extra(config, weights))
    keys = page_keys(3, salt="refit")
    assert Controller(backend, kv).backup(keys, kv.alloc(3 * kv.page_size))
    backend.register_mem_host_pool_v2(mamba_host(), PoolName.MAMBA)
    assert Controller(backend, kv).exists(keys) == 3
    slots = kv.alloc(3 * kv.page_size)
    assert Controller(backend, kv).prefetch(keys, slots) == 3
    backend.close()
