"""The node's pool daemon (`kvpool serve`) under real vLLM (CPU build): engines in separate
processes attach with the connector's `pool` option and share one pool that outlives them.

Outputs are compared with the same engine without kvpool, as in test_vllm_e2e.py.
"""

import os

import pytest

from conftest import shared_prefix_prompts
from test_vllm_e2e import PREFIX, assert_same_outputs

#: Tokens per chunk in the default config.
CHUNK = 256

#: vLLM's multi-process mode with the EngineCore and its worker forked (vLLM's default off the
#: CPU build), not spawned as the CPU build forces: each engine starts ~70 s sooner here (CI's
#: time budget). The worker still builds its own kvpool worker, pool and session with the
#: daemon after the fork: nothing of kvpool's but its imported module exists in the runner
#: then (see ``vllm_runner.py``'s ``rank_start``). Spawned multi-process engines are
#: test_tensor_parallel's fresh TP=2 engine, test_vllm_e2e's multi-process run and the Redis
#: pair of test_disaggregated_prefill.
MULTIPROCESS_FORKED = {"multiprocess": True, "rank_start": "fork"}


def pick(run, indexes):
    """The results of `run` for the prompts at `indexes` (one baseline run serves every
    comparison of a test: greedy outputs do not depend on what else was batched)."""
    return {"results": [run["results"][i] for i in indexes]}


def attach(daemon, size="256MiB"):
    """The connector's options: a private L1 of `size`, and the daemon as the first tier."""
    return {"config": {"local_cpu": {"max_size": size}}, "pool": daemon.url}


def test_two_engines_share_the_daemon_and_an_engine_killed_leaks_nothing(
        runner, model_dir, pool_daemon):
    """Engine A computes a prompt, saved with one copy into the daemon's shared memory;
    engine B (another process, another engine id, vLLM's multi-process mode) is
    served every prompt sharing it from the daemon. Then A is killed with SIGKILL right after
    a batch (places the daemon lent it may be uncommitted): the daemon ends A's session and
    reclaims what it held; A restarted is served its
    first repeated prompt from the daemon, loaded synchronously (before its forward pass)."""
    daemon = pool_daemon("shared")
    cfg = attach(daemon)
    prompts = shared_prefix_prompts(3, seed=40)
    base = runner.baseline(model_dir, prompts)

    a = runner.run({"model": model_dir, "prompts": prompts[:1], "kvpool": cfg})
    assert a["stats"]["stored_tokens"] >= PREFIX
    # Copied once, from vLLM's blocks straight into the daemon's shared memory (its checksum
    # hashed from the blocks), not through A's L1.
    assert a["stats"]["node_memory_saved_tokens"] >= PREFIX, a["stats"]
    daemon.wait(lambda s: s.get("commits_total", 0) >= PREFIX // CHUNK, "A's chunks committed")

    b = runner.run({"model": model_dir, "prompts": prompts, "kvpool": cfg,
                    "vllm_metrics": True, **MULTIPROCESS_FORKED})
    assert_same_outputs(base, b, "B")
    for i, r in enumerate(b["results"]):
        assert r["num_cached_tokens"] >= PREFIX, (i, r["num_cached_tokens"])
    daemon.wait(lambda s: s.get("gets_total:memory", 0) >= PREFIX // CHUNK,
                "B's loads answered from shared memory")
    # Copied once, from the daemon's shared memory straight into vLLM's blocks, and checked
    # there (vLLM's CPU blocks are host memory the worker reads).
    ours = b["vllm_metrics"]
    assert ours.get("vllm:kvpool_node_memory_tokens_total", 0) >= PREFIX, ours
    assert ours.get("vllm:kvpool_node_memory_staged_tokens_total", 0) == 0, ours
    assert ours.get("vllm:kvpool_corrupt_chunks_total", 0) == 0, ours
    assert ours.get("vllm:kvpool_failed_load_blocks_total", 0) == 0, ours

    killed = runner.run({"model": model_dir, "prompts": prompts, "kvpool": cfg,
                         "batches": [[1], [2]], "kill_after_batch": {"0": "self"}},
                        expect_exit=-9)
    assert killed is None
    after = daemon.wait(lambda s: s["sessions"] == 0, "every engine detached")
    assert after["leases"] == 0, after
    # An engine killed mid-call left; it sent nothing the daemon had to refuse.
    assert after["requests_refused_total"] == 0, after

    again = runner.run({"model": model_dir, "prompts": prompts[:1], "kvpool": cfg})
    assert_same_outputs(pick(base, [0]), again, "A restarted")
    assert again["results"][0]["num_cached_tokens"] >= PREFIX
    assert again["stats"]["loaded_tokens"] >= PREFIX
    # Read from the daemon's shared memory at lookup: loaded before the forward pass, as an
    # L1 hit is, not a step later.
    assert again["stats"]["async_loads"] == 0, again["stats"]
    assert again["stats"]["sync_loads"] >= 1, again["stats"]
    assert again["stats"]["node_memory_tokens"] >= PREFIX, again["stats"]


def test_the_gpu_route_on_cpu_tensors_reads_the_daemons_chunks_once_and_checks_the_staged_copy(
        runner, model_dir, pool_daemon):
    """The route a GPU worker takes (it cannot read vLLM's blocks), run on CPU tensors with
    ``stage_node_memory_copies``. A's save gathers each chunk once into a buffer of the
    worker's, copied from there into a place the daemon lends and sealed with a checksum
    hashed from the buffer (on a GPU: gathered on the device, copied into both). B's lookups
    pin the daemon's chunks where they lie, the transfer path reads each once from the
    daemon's shared memory into a buffer of the worker's and fills vLLM's blocks from it (on a
    GPU: one copy to the device, read back into the buffer), and the worker checks the buffer
    behind the forward pass. B runs in vLLM's multi-process mode, as GPU serving does."""
    daemon = pool_daemon("staged")
    prompts = shared_prefix_prompts(3, seed=40)
    base = runner.baseline(model_dir, prompts)
    cfg = {**attach(daemon), "stage_node_memory_copies": True}
    a = runner.run({"model": model_dir, "prompts": prompts[:1], "kvpool": cfg})
    assert a["stats"]["node_memory_saved_tokens"] >= PREFIX, a["stats"]
    daemon.wait(lambda s: s.get("commits_total", 0) >= PREFIX // CHUNK, "A's chunks committed")

    b = runner.run({"model": model_dir, "prompts": prompts, "kvpool": cfg,
                    "vllm_metrics": True, **MULTIPROCESS_FORKED})
    assert_same_outputs(base, b, "B, staged")
    for i, r in enumerate(b["results"]):
        assert r["num_cached_tokens"] >= PREFIX, (i, r["num_cached_tokens"])
    ours = b["vllm_metrics"]
    # Loaded from where the chunks lie (pinned at lookup), not promoted into L1 first, and
    # checked in the staged copy, not in vLLM's blocks.
    assert ours.get("vllm:kvpool_node_memory_tokens_total", 0) >= PREFIX, ours
    assert ours.get("vllm:kvpool_node_memory_staged_tokens_total", 0) >= PREFIX, ours
    assert ours.get("vllm:kvpool_corrupt_chunks_total", 0) == 0, ours
    assert ours.get("vllm:kvpool_failed_load_blocks_total", 0) == 0, ours
    after = daemon.wait(lambda s: s["sessions"] == 0, "B detached")
    assert after["leases"] == 0, after


def test_the_daemon_killed_mid_run_costs_only_recomputes_and_its_disk_serves_after_a_restart(
        runner, model_dir, pool_daemon, scratch):
    """The daemon dies (SIGKILL) between two batches of one engine: the second batch misses
    and is recomputed (identical outputs, no hang). A restarted daemon over the same disk tier
    serves a fresh engine what was written there (its shared memory died with it)."""
    disk = os.path.join(scratch, "daemon-disk")
    daemon = pool_daemon("with-disk", tiers=[f"file://{disk}"])
    cfg = attach(daemon)
    first, second = shared_prefix_prompts(2, seed=41), shared_prefix_prompts(2, seed=42)
    base = runner.baseline(model_dir, [first[1], second[1], second[0]])

    runner.run({"model": model_dir, "prompts": [first[0], second[0]], "kvpool": cfg})
    written = daemon.wait(lambda s: s.get("tier_writes_total", 0) >= 2 * PREFIX // CHUNK,
                          "both prefixes written to the disk tier")
    # What the dashboard and the alert rules read (docs/metrics.md).
    assert written["capacity_bytes"] == 512 << 20, written
    assert written["write_behind_dropped_total"] == 0, written
    puts = {k: v for k, v in written.items()
            if k.startswith("tier_op_seconds_count:") and k.endswith(":put")}
    assert puts and all(v >= 1 for v in puts.values()), written

    got = runner.run({"model": model_dir, "prompts": [first[1], second[1]], "kvpool": cfg,
                      "batches": [[0], [1]], "kill_after_batch": {"0": daemon.pid}})
    assert_same_outputs(pick(base, [0, 1]), got, "daemon killed")
    assert got["results"][0]["num_cached_tokens"] >= PREFIX, "served before the kill"
    assert got["results"][1]["num_cached_tokens"] < PREFIX, "the dead daemon served nothing"

    daemon.proc.wait()
    daemon.start()
    fresh = runner.run({"model": model_dir, "prompts": [second[0]], "kvpool": cfg})
    assert_same_outputs(pick(base, [2]), fresh, "after the restart")
    assert fresh["results"][0]["num_cached_tokens"] >= PREFIX
    daemon.wait(lambda s: s.get("gets_total:tier", 0) >= PREFIX // CHUNK,
                "the fresh engine's loads answered from the disk tier")


def test_a_relative_pool_path_is_refused_at_engine_start():
    from kvpool.identity import resolve_config

    with pytest.raises(ValueError, match="absolute socket path"):
        resolve_config({"pool": "unix://kvpool.sock"})
