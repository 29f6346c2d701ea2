"""kvpool as a secondary tier of vLLM's native offloading, driven through the installed vLLM's
own classes on CPU: its tier factory loads ``kvpool.vllm.tier.KvpoolTier`` by ``module_path``
exactly as a user configures it, and its ``TieringOffloadingManager`` over a CPU primary region
cascades stored chunks into kvpool and promotes them back. No engine and no GPU are needed:
this is the scheduler side of vLLM's offloading, where secondary tiers live."""

import itertools
import time
import types
import uuid

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

ROW = 8192
CHUNKS = 16
_ids = itertools.count()


def _spec(events=False):
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=ROW,
        enable_kv_cache_events=events,
        extra_config={},
        engine_id="test",
        model=OffloadingModelConfig(name="test-model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False),
    )
    events_config = types.SimpleNamespace(enable_kv_cache_events=events)
    return types.SimpleNamespace(config=config, kv_events_config=events_config)


class Engine:
    """vLLM's tiering manager over a fresh CPU primary region, with kvpool as its one
    secondary tier (what an engine's scheduler builds from the connector's extra config)."""

    def __init__(self, tier_config, events=False):
        self.region = SharedOffloadRegion(engine_id=f"kvpool-test-{uuid.uuid4().hex}",
                                          num_chunks=CHUNKS, rank=None, kv_bytes_per_chunk=ROW,
                                          cpu_page_size=ROW)
        self.primary = CPUPrimaryTierOffloadingManager(num_chunks=CHUNKS, mmap_region=self.region)
        self.tier = SecondaryTierFactory.create_secondary_tier(
            tier_config, self.primary.get_kv_memoryview(), _spec(events))
        self.manager = TieringOffloadingManager(self.primary, [self.tier])
        self.rows = np.asarray(self.primary.get_kv_memoryview())

    def step(self):
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self, timeout=10.0):
        deadline = time.time() + timeout
        self.step()
        while self.manager.has_pending_work():
            assert time.time() < deadline, "jobs never finished"
            time.sleep(0.01)
            self.step()

    def store(self, keys, payloads):
        """What the offloading connector does for a request whose blocks were computed: a
        GPU->CPU copy into the primary rows, then completion, which cascades into kvpool."""
        ctx = ReqContext(req_id=f"store-{next(_ids)}")
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(keys, ctx)
        for key, row in zip(out.keys_to_store, out.store_spec.chunk_ids):
            self.rows[row] = payloads[key]
        self.manager.complete_store(keys, ctx)
        self.manager.on_request_finished(ctx)
        self.settle()

    def lookup(self, key, timeout=10.0):
        """Looks a key up until it is ready in the primary tier or missing everywhere."""
        ctx = ReqContext(req_id=f"lookup-{next(_ids)}")
        self.manager.on_new_request(ctx)
        deadline = time.time() + timeout
        try:
            while True:
                result = self.manager.lookup(key, ctx)
                if result in (LookupResult.HIT, LookupResult.MISS) or time.time() > deadline:
                    return result
                self.step()
                time.sleep(0.01)
        finally:
            self.manager.on_request_finished(ctx)
            self.settle()

    def read(self, keys):
        ctx = ReqContext(req_id=f"load-{next(_ids)}")
        spec = self.manager.prepare_load(keys, ctx)
        rows = [bytes(self.rows[r]) for r in spec.chunk_ids]
        self.manager.complete_load(keys, ctx)
        return rows

    def close(self):
        self.manager.shutdown()


def _keys(n, salt=0):
    return [make_offload_key(bytes([salt, i]) * 16, 0) for i in range(n)]


def _payloads(keys, seed=1):
    rng = np.random.default_rng(seed)
    return {k: rng.integers(0, 256, ROW, dtype=np.uint8) for k in keys}


def _tier(url, l1=True):
    l1_config = '[local_cpu]\nmax_size = "1MiB"\n' if l1 else "[local_cpu]\nenabled = false\n"
    return {"type": "KvpoolTier", "module_path": "kvpool.vllm.tier",
            "config": f'{l1_config}[[tier]]\nurl = "{url}"\ntimeout_ms = 1000\n'}


def _assert_promoted_byte_exact(engine, keys, payloads):
    assert engine.lookup(make_offload_key(b"\xff" * 32, 0)) is LookupResult.MISS
    for key in keys:
        assert engine.lookup(key) is LookupResult.HIT
    for key, row in zip(keys, engine.read(keys)):
        assert row == payloads[key].tobytes()


def test_chunks_cascaded_into_redis_are_promoted_byte_exact_in_another_engine(redis_server):
    keys = _keys(6)
    payloads = _payloads(keys)
    writer = Engine(_tier(redis_server.url))
    writer.store(keys, payloads)
    writer.close()  # flushes kvpool's write-behind and closes its tiers
    reader = Engine(_tier(redis_server.url))
    try:
        _assert_promoted_byte_exact(reader, keys, payloads)
    finally:
        reader.close()


def test_chunks_on_disk_come_back_after_the_primary_tier_was_reset(tmp_path):
    keys = _keys(6, salt=1)
    payloads = _payloads(keys, seed=2)
    # No kvpool L1: every chunk lives on disk only.
    engine = Engine(_tier(f"file://{tmp_path}/kvpool-tier", l1=False))
    try:
        engine.store(keys, payloads)
        engine.manager.reset_cache()  # vLLM's CPU tier forgets everything (drains our jobs first)
        engine.rows[:] = 0
        _assert_promoted_byte_exact(engine, keys, payloads)
    finally:
        engine.close()


def test_other_weights_and_corrupt_or_misplaced_values_are_misses(redis_server, monkeypatch):
    keys = _keys(3, salt=7)
    monkeypatch.setenv("KVPOOL_TEST_WEIGHTS_DIGEST", "weights-a")
    writer = Engine(_tier(redis_server.url))
    writer.store(keys, _payloads(keys))
    writer.close()
    stored = redis_server.keys()
    assert len(stored) == 3

    monkeypatch.setenv("KVPOOL_TEST_WEIGHTS_DIGEST", "weights-b")
    other = Engine(_tier(redis_server.url))
    try:
        assert all(other.lookup(k) is LookupResult.MISS for k in keys)
    finally:
        other.close()

    # Same weights again, but one value corrupted and another's bytes copied over the third.
    monkeypatch.setenv("KVPOOL_TEST_WEIGHTS_DIGEST", "weights-a")
    reader = Engine(_tier(redis_server.url))
    try:
        # Find which stored Redis key holds which offload key by loading them first.
        assert all(reader.lookup(k) is LookupResult.HIT for k in keys)
    finally:
        reader.close()
    redis_server.cli("SETRANGE", stored[0], "100", "garbage")
    redis_server.cli("COPY", stored[1], stored[2], "REPLACE")
    reader = Engine(_tier(redis_server.url))
    try:
        hits = [reader.lookup(k) for k in keys]
        assert hits.count(LookupResult.HIT) == 1, hits
    finally:
        reader.close()


def test_a_dead_tier_fails_jobs_within_its_timeout_never_hangs(redis_server):
    keys = _keys(2, salt=9)
    engine = Engine(_tier(redis_server.url))
    try:
        engine.store(keys, _payloads(keys))
        redis_server.stop()
        started = time.time()
        assert engine.lookup(make_offload_key(b"\x01" * 32, 0)) is LookupResult.MISS
        tier = engine.tier
        tier.submit_load(TransferJob(job_id=10_000, keys=[make_offload_key(b"\x02" * 32, 0)],
                                     chunk_ids=np.array([3], dtype=np.int32), is_promotion=True,
                                     req_context=ReqContext(req_id="x")))
        tier.drain_jobs()
        results = list(tier.get_finished_jobs())
        assert [(r.job_id, r.success) for r in results] == [(10_000, False)]
        assert time.time() - started < 10
    finally:
        engine.close()


def test_stored_chunks_are_reported_as_events_of_the_tier(tmp_path):
    keys = _keys(2, salt=3)
    engine = Engine(_tier(f"file://{tmp_path}/ev"), events=True)
    try:
        engine.store(keys, _payloads(keys))
        events = [e for e in engine.manager.take_events() if e.ownership == "KvpoolTier"]
        assert [sorted(e.keys) for e in events] == [sorted(keys)]
        assert not events[0].removed
    finally:
        engine.close()


def test_an_unknown_option_is_refused_naming_it():
    rows = memoryview(np.zeros((4, ROW), dtype=np.uint8))
    with pytest.raises(ValueError, match="colour"):
        SecondaryTierFactory.create_secondary_tier(
            {"type": "KvpoolTier", "module_path": "kvpool.vllm.tier", "colour": "blue"}, rows,
            _spec())
