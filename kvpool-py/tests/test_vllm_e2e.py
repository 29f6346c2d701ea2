"""kvpool inside real vLLM (CPU build): outputs, stored bytes, tiers, faults, preemption.

Every test compares an engine with kvpool to the same engine without it: greedy tokens must be
identical and logprobs within 1e-4 (identical float32 runs differ by < 1e-5). The control test
shows the comparison is sensitive: KV from another model changes the output.
"""

import os
import random
import time

import pytest

from conftest import free_port, shared_prefix_prompts

TOL = 1e-4
PREFIX = 1024


def assert_same_outputs(base, got, label=""):
    assert len(base["results"]) == len(got["results"])
    for i, (b, g) in enumerate(zip(base["results"], got["results"])):
        assert g["tokens"] == b["tokens"], f"{label} prompt {i}: tokens differ"
        worst = max(abs(x - y) for x, y in zip(b["logprobs"], g["logprobs"]))
        assert worst <= TOL, f"{label} prompt {i}: logprobs differ by {worst}"


def l1(size="256MiB", **extra):
    return {"config": {"local_cpu": {"max_size": size}, **extra}}


def metric(page, name):
    """The value of one series in a Prometheus text page: its name, with its labels as printed."""
    for line in page.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the scraped metrics")


def test_shared_prefix_identical_outputs_and_external_hits(runner, model_dir):
    """Done-when 1: a batch sharing a 1K prefix; later requests load the prefix from kvpool.
    The worker serves Prometheus metrics that count the same loads, and vLLM's own Prometheus
    metrics carry kvpool's counters (build_prom_metrics)."""
    prompts = shared_prefix_prompts(6)
    kw = {"batches": [[0], [1, 2, 3, 4, 5]], "prefix_caching": False}
    base = runner.baseline(model_dir, prompts, **kw)
    port = free_port()
    got = runner.run({"model": model_dir, "prompts": prompts, "scrape_metrics": port,
                      "vllm_metrics": True,
                      "kvpool": l1(metrics={"listen": f"127.0.0.1:{port}"}), **kw})
    assert_same_outputs(base, got)
    assert got["results"][0]["num_cached_tokens"] == 0
    for r in got["results"][1:]:
        assert r["num_cached_tokens"] >= PREFIX, r
    assert got["stats"]["loaded_tokens"] >= 5 * PREFIX
    assert got["stats"]["failed_load_blocks"] == 0
    page = got["metrics"]
    assert metric(page, "kvpool_connector_loaded_tokens_total") == got["stats"]["loaded_tokens"]
    assert metric(page, "kvpool_hit_tokens_total") >= 5 * PREFIX
    assert metric(page, "kvpool_lookup_tokens_total") >= metric(page, "kvpool_hit_tokens_total")
    assert 'kvpool_tier_op_seconds_bucket{tier="cpu",op="get"' in page
    # TP=1: the scheduler asks the worker's pool in its own process, never over the socket.
    assert metric(page, 'kvpool_scheduler_lookups_total{route="in_process"}') >= 5
    assert metric(page, 'kvpool_scheduler_lookups_total{route="socket"}') == 0
    ours = got["vllm_metrics"]
    assert ours.get("vllm:kvpool_loaded_tokens_total") == got["stats"]["loaded_tokens"], ours
    assert ours.get("vllm:kvpool_stored_tokens_total", 0) > 0, ours
    assert ours.get("vllm:kvpool_failed_load_blocks_total", 0) == 0, ours


def test_an_exact_repeat_is_served_to_its_last_whole_block(runner, model_dir):
    """Issue 26: with the default 256-token chunks, a repeated prompt's tokens past its last
    whole chunk are served too (keyed block by block): the hit is the prompt less at most one
    block (vLLM computes at least the last token), what vLLM's own prefix cache would serve."""
    p = shared_prefix_prompts(1, prefix_len=1024, suffix_len=37, seed=21)[0]
    prompts = [p, p]
    kw = {"batches": [[0], [1]], "prefix_caching": False}
    base = runner.baseline(model_dir, prompts, **kw)
    got = runner.run({"model": model_dir, "prompts": prompts, "kvpool": l1(), **kw})
    assert_same_outputs(base, got)
    assert got["results"][0]["num_cached_tokens"] == 0
    hit = got["results"][1]["num_cached_tokens"]
    assert hit == (len(p) - 1) // 32 * 32 == 1056, hit
    assert got["stats"]["failed_load_blocks"] == 0


def test_kv_events_reach_vllms_publisher_with_vllms_block_hashes(runner, model_dir, scratch):
    """Chunks entering kvpool's tiers arrive through vLLM's own KV-event publisher (ZMQ) as
    BlockStored events tagged with the tier, carrying the same block hashes as vLLM's own
    events for those blocks; so do the tail blocks past a prompt's last whole chunk, one block
    each, chained on the block before them."""
    disk = os.path.join(scratch, "disk-events")
    prompts = shared_prefix_prompts(2, seed=11)
    got = runner.run({"model": model_dir, "prompts": prompts, "batches": [[0], [1]],
                      "kvpool": l1(tier=[{"url": f"file://{disk}"}]),
                      "kv_events_port": free_port()})
    assert got["kv_events_settled"], "the engine's later steps kept publishing events"
    events = got["kv_events"]
    engine_events = [e for e in events
                     if e["type"] == "BlockStored" and e["medium"] in ("GPU", None)]
    engine = [h for e in engine_events for h in e["block_hashes"]]
    # The block before each of vLLM's blocks, as vLLM announced it.
    parent_of = {}
    for e in engine_events:
        for parent, h in zip([e["parent"], *e["block_hashes"]], e["block_hashes"]):
            parent_of[h] = parent
    assert engine, events[:5]
    # Each prompt's last whole block (1,061 tokens: 4 chunks, one more block, 5 tokens) is
    # the parent of no block.
    tails = set(engine) - set(parent_of.values())
    assert len(tails) == len(prompts), tails
    for medium in ("CPU", "DISK"):
        stored = [e for e in events if e["type"] == "BlockStored" and e["medium"] == medium]
        chunks = [e for e in stored if e["tokens"] == 256]
        tail_blocks = [e for e in stored if e["tokens"] == 32]
        assert len(chunks) + len(tail_blocks) == len(stored), stored[:2]
        hashes = [h for e in chunks for h in e["block_hashes"]]
        assert len(hashes) >= PREFIX // 32, (medium, len(hashes), events[:5])
        assert set(hashes) <= set(engine), f"{medium}: block hashes vLLM never announced"
        assert len(tail_blocks) == len(prompts), (medium, tail_blocks)
        for e in tail_blocks:
            (h,) = e["block_hashes"]
            assert h in tails, f"{medium}: {h} is not a prompt's last whole block"
            assert e["parent"] == parent_of[h], (medium, e)
@pytest.mark.parametrize("transfer", ["native", "torch"])
def test_stored_bytes_equal_the_engines_own_blocks(runner, model_dir, transfer):
    """Done-when 2: every stored chunk equals vLLM's KV blocks for its tokens, block by block,
    both for the request that computed them and for the ones that loaded them; on both
    transfer paths (the default, kvpool-cuda's host executor, and torch's ops, which run the
    worker's ``CopyJob`` objects in Python)."""
    prompts = shared_prefix_prompts(3, seed=2)
    got = runner.run({"model": model_dir, "prompts": prompts,
                      "kvpool": {**l1(), "transfer": transfer},
                      "batches": [[0], [1, 2]], "prefix_caching": False, "check_blocks": True})
    assert got["copies"] == {"native": "host", "torch": "torch"}[transfer], got.get("copies")
    assert got["stats"]["loaded_tokens"] >= 2 * PREFIX, got["stats"]
    for i, r in enumerate(got["blocks"]):
        assert r["chunks"] == PREFIX // 256, (i, r)
        assert r["blocks_compared"] == 2 * PREFIX // 32, (i, r)
        assert r["blocks_mismatched"] == 0, (i, r)


def test_kv_from_another_model_changes_the_output(runner, model_dir, other_model_dir, scratch):
    """Control: the output comparison above detects wrong KV. Another model's KV, made to
    share keys with this one (both engines given the same ``weights_id``: what an operator
    who names two different checkpoints alike gets), is served to this one and its tokens or
    logprobs change."""
    disk = os.path.join(scratch, "disk-control")
    cfg = {**l1(tier=[{"url": f"file://{disk}"}]), "weights_id": "same-weights"}
    prompts = shared_prefix_prompts(2, seed=3)
    runner.run({"model": other_model_dir, "prompts": prompts, "kvpool": cfg,
                "served_model_name": "m"})
    base = runner.baseline(model_dir, prompts)
    got = runner.run({"model": model_dir, "prompts": prompts, "kvpool": cfg,
                      "served_model_name": "m"})
    assert got["results"][0]["num_cached_tokens"] >= PREFIX
    with pytest.raises(AssertionError):
        assert_same_outputs(base, got)


def test_two_checkpoints_under_one_name_share_nothing(runner, model_dir, other_model_dir, scratch):
    """Keys are bound to the weights loaded, not the served name: two checkpoints served as
    "m" over one disk tier (the second started after the first stored its prefix) get no hit
    on each other's KV, and the second's output is its own."""
    disk = os.path.join(scratch, "disk-two-checkpoints")
    cfg = l1(tier=[{"url": f"file://{disk}"}])
    prompts = shared_prefix_prompts(2, seed=12)
    first = runner.run({"model": other_model_dir, "prompts": prompts, "kvpool": cfg,
                        "served_model_name": "m"})
    assert first["stats"]["stored_tokens"] >= PREFIX
    kw = {"batches": [[0], [1]], "prefix_caching": False}
    base = runner.baseline(model_dir, prompts, **kw)
    got = runner.run({"model": model_dir, "prompts": prompts, "kvpool": cfg,
                      "served_model_name": "m", **kw})
    assert got["results"][0]["num_cached_tokens"] == 0, "a hit on the other checkpoint's KV"
    assert got["stats"]["loaded_tokens"] >= PREFIX, "its own prefix still loads (second batch)"
    assert_same_outputs(base, got)


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in-process", "multiprocess"])
def test_async_scheduling_with_random_load_failures(runner, model_dir, redis_server, multiprocess):
    """vLLM's asynchronous scheduling (the CPU platform turns it off; the runner turns it back
    on) with half of the stored chunks corrupt, in-process and in vLLM's multi-process mode
    (scheduler in EngineCore, worker in its own process; vLLM's default on a GPU): every load
    is asynchronous, failed blocks are recomputed, and the outputs match the baseline's. In the
    multi-process run KV events are on and must cross from the worker to EngineCore's
    publisher. (vLLM's default CPU mode, multi-process with its processes spawned and synchronous
    scheduling, runs in the Redis pair of test_disaggregated_prefill.py's `vllm serve`s and in
    test_tensor_parallel.py's fresh TP=2 engine.)"""
    cfg = l1(tier=[{"url": redis_server.url}])
    prompts = shared_prefix_prompts(3, seed=13)
    base = runner.baseline(model_dir, prompts)
    runner.run({"model": model_dir, "prompts": prompts[:1], "kvpool": cfg})
    keys = redis_server.keys()
    corrupt(redis_server, random.Random(14).sample(keys, max(1, len(keys) // 2)))
    got = runner.run({"model": model_dir, "prompts": prompts, "kvpool": cfg,
                      "batches": [[0], [1, 2]], "async_scheduling": True,
                      "multiprocess": multiprocess,
                      "kv_events_port": free_port() if multiprocess else None})
    assert got["async_scheduling"], "vLLM ran without asynchronous scheduling"
    assert_same_outputs(base, got)
    # The second batch shares the first's prefix, which the first stored in L1.
    for r in got["results"][1:]:
        assert r["num_cached_tokens"] >= PREFIX, r
    if multiprocess:
        stored = [e for e in got["kv_events"]
                  if e["type"] == "BlockStored" and e["medium"] == "CPU"]
        # At least one 256-token chunk of 32-token blocks; how many more depends on which
        # half of the chunks was corrupt (a run read 27 blocks).
        assert sum(len(e["block_hashes"]) for e in stored) >= 256 // 32, got["kv_events"][:5]
    else:  # the worker's counters are readable in-process only
        assert got["stats"]["sync_loads"] == 0, got["stats"]
        assert got["stats"]["failed_load_blocks"] > 0, got["stats"]


def test_fresh_process_is_served_from_disk(runner, model_dir, scratch):
    """Done-when 3: a second vLLM process with the same disk tier loads the prefix from it."""
    disk = os.path.join(scratch, "disk-fresh")
    cfg = l1(tier=[{"url": f"file://{disk}"}])
    prompts = shared_prefix_prompts(2, seed=4)
    base = runner.baseline(model_dir, prompts)
    first = runner.run({"model": model_dir, "prompts": prompts[:1], "kvpool": cfg})
    assert first["stats"]["stored_tokens"] >= PREFIX
    second = runner.run({"model": model_dir, "prompts": prompts, "kvpool": cfg})
    assert_same_outputs(base, second)
    assert second["results"][0]["num_cached_tokens"] >= PREFIX
    assert second["stats"]["loaded_tokens"] >= PREFIX


def test_producer_and_consumer_roles_share_a_disk_tier(runner, model_dir, scratch):
    """Disaggregated prefill's roles (vLLM's ``kv_role``): a ``kv_producer`` instance saves
    what it computes and never looks a prompt up, even one the pool holds; a ``kv_consumer``
    instance loads what others stored and saves nothing, not even a prompt it computed whole.
    Outputs identical to no connector throughout."""
    disk = os.path.join(scratch, "disk-roles")
    cfg = l1(tier=[{"url": f"file://{disk}"}])
    a = shared_prefix_prompts(2, seed=12)
    b = shared_prefix_prompts(2, seed=13)
    c = shared_prefix_prompts(1, seed=14)
    prompts = a + b + c
    base = runner.baseline(model_dir, prompts)

    def only(result, indexes):
        return {"results": [result["results"][i] for i in indexes]}

    runner.run({"model": model_dir, "prompts": [a[0]], "kvpool": cfg})  # kv_both stores A
    roles = {"prefix_caching": False, "kvpool": cfg, "model": model_dir}
    producer = runner.run({"prompts": [a[0], b[0]], "kv_role": "kv_producer",
                           "batches": [[0], [1]], **roles})
    assert_same_outputs(only(base, [0, 2]), producer, "producer")
    assert [r["num_cached_tokens"] for r in producer["results"]] == [0, 0], \
        "the producer loaded A's prefix"
    assert producer["stats"]["loaded_tokens"] == 0, producer["stats"]
    assert producer["stats"]["stored_tokens"] >= PREFIX, producer["stats"]  # B's prefix
    consumer = runner.run({"prompts": [a[1], b[1], c[0]], "kv_role": "kv_consumer",
                           "batches": [[0, 1], [2]], **roles})
    assert_same_outputs(only(base, [1, 3, 4]), consumer, "consumer")
    cached = [r["num_cached_tokens"] for r in consumer["results"]]
    # A's prefix as kv_both stored it, B's as the producer did; C is computed whole.
    assert cached[0] >= PREFIX and cached[1] >= PREFIX and cached[2] == 0, cached
    assert consumer["stats"]["stored_tokens"] == 0, consumer["stats"]


def test_two_processes_share_a_redis_tier(runner, model_dir, redis_server):
    """Done-when 4: what one vLLM process stored in Redis serves another."""
    cfg = l1(tier=[{"url": redis_server.url}])
    prompts = shared_prefix_prompts(2, seed=5)
    base = runner.baseline(model_dir, prompts)
    runner.run({"model": model_dir, "prompts": prompts[:1], "kvpool": cfg})
    assert len(redis_server.keys()) >= PREFIX // 256
    got = runner.run({"model": model_dir, "prompts": prompts, "kvpool": cfg})
    assert_same_outputs(base, got)
    assert got["results"][0]["num_cached_tokens"] >= PREFIX


def test_redis_down_at_start_up_is_a_miss_and_is_used_once_it_answers(runner, model_dir, scratch):
    """vLLM starts with the Redis tier down (it failed to start before: the pool refused a
    tier it could not reach); the first prompt is served (a miss in Redis). Redis then comes
    up on that address while the engine runs: the next prompt's chunks reach it, and a fresh
    engine is served them from Redis."""
    import threading

    from redis_server import PortReservation, RedisServer

    # Held until Redis starts: a port only chosen free could be taken meanwhile by one of
    # vLLM's own sockets, and Redis would fail to start there.
    reservation = PortReservation()
    port = reservation.port
    cfg = l1(tier=[{"url": f"redis://127.0.0.1:{port}", "timeout_ms": 500}])
    first = shared_prefix_prompts(1, seed=31)
    later = shared_prefix_prompts(1, seed=32)
    prompts = first + later
    base = runner.baseline(model_dir, prompts)
    ready, go = os.path.join(scratch, "redis-ready"), os.path.join(scratch, "redis-go")
    result = {}
    run = threading.Thread(target=lambda: result.update(got=runner.run({
        "model": model_dir, "prompts": prompts, "kvpool": cfg, "batches": [[0], [1]],
        "hold_after_batch": {"0": {"ready": ready, "go": go}}})))
    run.start()
    server = None
    try:
        deadline = time.time() + 600
        while not os.path.exists(ready) and run.is_alive() and time.time() < deadline:
            time.sleep(0.1)
        assert os.path.exists(ready), "the engine did not serve its first batch"
        reservation.release()
        server = RedisServer(scratch, port=port)
        # The tier is tried again after 1, 2, 4... s (at most 30 s apart): wait until the
        # engine's kvpool has connected (a client besides redis-cli's own).
        deadline = time.time() + 60
        while len(server.cli("client", "list").splitlines()) < 2 and time.time() < deadline:
            time.sleep(0.2)
        assert len(server.cli("client", "list").splitlines()) >= 2, "kvpool never connected"
        open(go, "w").close()
        run.join(600)
        got = result["got"]
        assert_same_outputs(base, got, "Redis down, then up")
        deadline = time.time() + 30
        while len(server.keys()) < PREFIX // 256 and time.time() < deadline:
            time.sleep(0.2)
        assert len(server.keys()) >= PREFIX // 256, "nothing reached Redis once it was up"
        fresh = runner.run({"model": model_dir, "prompts": later, "kvpool": cfg})
        assert_same_outputs({"results": base["results"][1:]}, fresh, "fresh engine")
        assert fresh["results"][0]["num_cached_tokens"] >= PREFIX, fresh["results"][0]
    finally:
        reservation.release()
        if not os.path.exists(go):
            open(go, "w").close()
        run.join(600)
        if server is not None:
            server.stop()


def corrupt(redis_server, keys):
    """Overwrites 8 bytes in the middle of each value (the checksum must catch it)."""
    for k in keys:
        n = int(redis_server.cli("STRLEN", k))
        assert n > 64, (k, n)
        redis_server.cli("SETRANGE", k, str(n // 2), "KVPOOL!!")


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_corrupt_chunks_are_recomputed(runner, model_dir, redis_server, fraction):
    """Done-when 5: corrupted stored chunks (all of them, or a random half: loads failing at
    random) are rejected, reported as failed blocks, and recomputed: identical output."""
    cfg = l1(tier=[{"url": redis_server.url}])
    prompts = shared_prefix_prompts(3, seed=6)
    base = runner.baseline(model_dir, prompts)
    runner.run({"model": model_dir, "prompts": prompts[:1], "kvpool": cfg})
    keys = redis_server.keys()
    assert keys
    victims = random.Random(7).sample(keys, max(1, int(len(keys) * fraction)))
    corrupt(redis_server, victims)
    got = runner.run({"model": model_dir, "prompts": prompts, "kvpool": cfg,
                      "batches": [[0], [1, 2]]})
    assert_same_outputs(base, got)
    assert got["stats"]["failed_load_blocks"] > 0, (victims, keys, got["stats"])
    assert got["stats"]["corrupt_chunks"] > 0, got["stats"]


def test_redis_killed_mid_run(runner, model_dir, redis_server):
    """Done-when 5: Redis dies between two batches; the second batch's lookups miss and vLLM
    recomputes: identical output, no crash, no hang. A first engine stores prompts 0 and 2 in
    Redis; the second, with an empty L1, serves prompt 0 from Redis, then Redis is killed and
    prompt 2, stored there too, is recomputed."""
    cfg = l1(tier=[{"url": redis_server.url, "timeout_ms": 500}])
    prompts = shared_prefix_prompts(2, seed=8) + shared_prefix_prompts(2, seed=9)
    base = runner.baseline(model_dir, prompts)
    runner.run({"model": model_dir, "prompts": [prompts[0], prompts[2]], "kvpool": cfg})
    assert redis_server.keys()
    got = runner.run({"model": model_dir, "prompts": prompts, "kvpool": cfg,
                      "batches": [[0, 1], [2, 3]],
                      "kill_after_batch": {"0": redis_server.proc.pid}})
    assert_same_outputs(base, got)
    cached = [r["num_cached_tokens"] for r in got["results"]]
    # Before the kill: prompt 0's 1,024-token prefix came from Redis (vLLM's own prefix cache
    # was empty, and so was kvpool's L1).
    assert cached[0] >= 1024, cached
    assert got["stats"]["loaded_tokens"] >= 1024, got["stats"]
    # After it: prompt 2, stored in Redis, was not served from it (else the kill came late).
    assert cached[2] == 0, cached


def test_preemption_with_32_concurrent_requests(runner, model_dir):
    """Done-when 6: a KV cache small enough to preempt; 32 concurrent requests over four shared
    prefixes; outputs identical to the run without kvpool."""
    # 543-token prompts fill 17 blocks and cross into an 18th while decoding; without vLLM's
    # prefix cache 32 of them need 576 blocks, and there are 160.
    prompts = []
    for seed in range(4):
        prompts += shared_prefix_prompts(8, prefix_len=512, suffix_len=31, seed=20 + seed)
    kw = {"num_gpu_blocks": 160, "max_tokens": 24, "prefix_caching": False}
    base = runner.baseline(model_dir, prompts, **kw)
    got = runner.run({"model": model_dir, "prompts": prompts, "kvpool": l1(), **kw})
    assert_same_outputs(base, got)
    assert got["preempted_requests"] > 0, "the KV cache was meant to force preemption"
    assert got["stats"]["stored_tokens"] > 0
