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
from conftest import RedisServer
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


def _tier(url, l1=True, weights_id=None):
    l1_config = '[local_cpu]\nmax_size = "1MiB"\n' if l1 else "[local_cpu]\nenabled = false\n"
    tier = {"type": "KvpoolTier", "module_path": "kvpool.vllm.tier",
            "config": f'{l1_config}[[tier]]\nurl = "{url}"\ntimeout_ms = 1000\n'}
    return tier if weights_id is None else {**tier, "weights_id": weights_id}


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


def test_chunks_evicted_from_vllms_cpu_tier_come_back_from_disk(tmp_path):
    keys = _keys(6, salt=1)
    payloads = _payloads(keys, seed=2)
    # No kvpool L1: every chunk lives on disk only.
    engine = Engine(_tier(f"file://{tmp_path}/kvpool-tier", l1=False))
    try:
        engine.store(keys, payloads)
        others = _keys(CHUNKS, salt=2)  # fills vLLM's CPU tier: the first six are evicted
        engine.store(others, _payloads(others, seed=3))
        assert all(engine.primary.lookup(k, ReqContext(req_id="p")) is LookupResult.MISS
                   for k in keys)
        _assert_promoted_byte_exact(engine, keys, payloads)
    finally:
        engine.close()


def test_after_vllms_reset_cache_nothing_stored_before_is_found(tmp_path):
    keys = _keys(2, salt=11)
    engine = Engine(_tier(f"file://{tmp_path}/reset", l1=False))
    try:
        engine.store(keys, _payloads(keys))
        # Weights pushed into the running engine change no file: reset_cache must be enough.
        engine.manager.reset_cache()
        assert [engine.lookup(k) for k in keys] == [LookupResult.MISS] * 2
    finally:
        engine.close()


def _finished(tier, timeout=10.0):
    deadline = time.time() + timeout
    while True:
        results = list(tier.get_finished_jobs())
        if results or time.time() > deadline:
            return results
        time.sleep(0.01)


def _promotion(job_id, keys, rows):
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(rows, dtype=np.int32),
                       is_promotion=True, req_context=ReqContext(req_id=f"job-{job_id}"))


def test_a_partial_promotion_names_the_keys_that_loaded(tmp_path):
    stored = _keys(2, salt=12)
    payloads = _payloads(stored)
    missing = make_offload_key(b"\x0e" * 32, 0)
    engine = Engine(_tier(f"file://{tmp_path}/partial", l1=False))
    try:
        engine.store(stored, payloads)
        before = engine.rows[14:16].copy()
        engine.tier.submit_load(_promotion(20_000, [stored[0], missing, stored[1]], [13, 14, 15]))
        (result,) = _finished(engine.tier)
        assert not result.success
        assert list(result.successful_keys) == [stored[0]]
        assert result.transfer_bytes == ROW
        assert bytes(engine.rows[13]) == payloads[stored[0]].tobytes()
        assert (engine.rows[14:16] == before).all(), "rows after the prefix untouched"
    finally:
        engine.close()


def test_other_weights_and_corrupt_or_misplaced_values_are_misses(redis_server):
    """Weights named by the tier's ``weights_id`` option: the same name shares chunks (two
    tiers in one process would otherwise each have a process-own digest: no weight files
    here), another name shares nothing."""
    keys = _keys(3, salt=7)
    payloads = _payloads(keys)
    writer = Engine(_tier(redis_server.url, weights_id="weights-a"))
    writer.store(keys, payloads)
    writer.close()
    stored = redis_server.keys()
    assert len(stored) == 3

    def lookups(weights, check_bytes=False):
        engine = Engine(_tier(redis_server.url, weights_id=weights))
        try:
            answers = [engine.lookup(k) for k in keys]
            if check_bytes:  # whatever is found is the key's own bytes, never another's
                found = [k for k, a in zip(keys, answers) if a is LookupResult.HIT]
                for key, row in zip(found, engine.read(found)):
                    assert row == payloads[key].tobytes()
            return answers
        finally:
            engine.close()

    assert lookups("weights-b") == [LookupResult.MISS] * 3, "other weights share nothing"
    assert lookups("weights-a") == [LookupResult.HIT] * 3, "the same weights find them all"
    with pytest.raises(ValueError, match="weights_id"):
        Engine(_tier(redis_server.url, weights_id=""))
    # One value corrupted, and another's bytes copied over the third.
    redis_server.cli("SETRANGE", stored[0], "100", "garbage")
    redis_server.cli("COPY", stored[1], stored[2], "REPLACE")
    hits = lookups("weights-a", check_bytes=True)
    assert hits.count(LookupResult.HIT) == 1, hits


def test_a_dead_tier_fails_jobs_within_its_timeout_then_recovers(redis_server, scratch):
    keys = _keys(2, salt=9)
    engine = Engine(_tier(redis_server.url, l1=False))
    restarted = None
    try:
        engine.store(keys, _payloads(keys))
        redis_server.stop()
        started = time.time()
        assert engine.lookup(make_offload_key(b"\x01" * 32, 0)) is LookupResult.MISS
        engine.tier.submit_load(_promotion(10_000, keys[:1], [3]))
        results = _finished(engine.tier)
        assert [(r.job_id, r.success) for r in results] == [(10_000, False)]
        assert time.time() - started < 10, "bounded by the tier's timeout"

        # The same server back (empty): new chunks are stored and another engine loads them.
        restarted = RedisServer(scratch, port=redis_server.port)
        reader = Engine(_tier(redis_server.url, l1=False))
        try:
            deadline = time.time() + 30
            for salt in itertools.count(20):  # until the tier's client has reconnected
                fresh = _keys(2, salt=salt)
                payloads = _payloads(fresh, seed=salt)
                engine.store(fresh, payloads)
                if reader.lookup(fresh[0]) is LookupResult.HIT or time.time() > deadline:
                    break
                time.sleep(0.5)
            _assert_promoted_byte_exact(reader, fresh, payloads)
        finally:
            reader.close()
    finally:
        engine.close()
        if restarted is not None:
            restarted.stop()


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


def test_the_tiers_series_reach_vllms_metrics(tmp_path):
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    tier_config = _tier(f"file://{tmp_path}/m")
    names = TieringOffloadingSpec.build_metric_definitions({"secondary_tiers": [tier_config]})
    assert {"vllm:kvpool_tier_lookups", "vllm:kvpool_tier_jobs", "vllm:kvpool_tier_bytes"} <= set(names)
    keys = _keys(2, salt=4)
    engine = Engine(tier_config)
    try:
        engine.store(keys, _payloads(keys))
        engine.lookup(make_offload_key(b"\x03" * 32, 0))
        reduced = engine.tier.get_stats().reduce()
        assert reduced["vllm:kvpool_tier_jobs:('store', 'ok')"] == 1
        assert reduced["vllm:kvpool_tier_bytes:('store',)"] == 2 * ROW
        assert reduced["vllm:kvpool_tier_lookups:('miss',)"] == 1
        assert engine.tier.get_stats() is None, "stats are reset once taken"
    finally:
        engine.close()


def test_an_unknown_option_is_refused_naming_it():
    rows = memoryview(np.zeros((4, ROW), dtype=np.uint8))
    with pytest.raises(ValueError, match="colour"):
        SecondaryTierFactory.create_secondary_tier(
            {"type": "KvpoolTier", "module_path": "kvpool.vllm.tier", "colour": "blue"}, rows,
            _spec())
