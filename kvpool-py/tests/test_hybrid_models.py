"""Hybrid models inside real vLLM (CPU build) with kvpool configured: vLLM keeps its hybrid KV
cache manager (HMA) on, because the connector declares ``SupportsHMA``. Without it, an SSM /
linear-attention hybrid (Qwen3-Next) refused to start ("Failed to promote local KV cache specs
to one unified type") and a sliding-window model ran with every layer holding the whole context.

kvpool serves a model of full-attention and sliding-window groups (Gemma 3 shape), one part
per group; for a model with Mamba / linear-attention state groups (Qwen3-Next shape) it stands
aside (one warning; no lookup, load or save) and vLLM's own prefix cache serves. Outputs are
compared with the same engine without kvpool: greedy tokens identical, logprobs within 1e-4
(fp32) or identical (bf16, same batches).
"""

import os
import random

from conftest import free_port, shared_prefix_prompts
from make_hybrid_model import make_gemma3_model, make_qwen3_next_model
from test_vllm_e2e import PREFIX, assert_same_outputs, corrupt, l1

HMA_OFF = "Turning off hybrid kv cache manager"
STANDS_ASIDE = "kvpool stands aside for it"


def log_of(run):
    with open(run["log"]) as f:
        return f.read()


def test_a_linear_attention_hybrid_starts_with_hma_on_and_kvpool_standing_aside(runner,
                                                                                 scratch):
    """Qwen3-Next shape (Gated DeltaNet + full attention, bf16): starts and serves with kvpool
    configured, outputs identical to no connector, vLLM's prefix cache serving the repeat."""
    model = make_qwen3_next_model(os.path.join(scratch, "tiny-qwen3-next"))
    prompts = shared_prefix_prompts(2, seed=61)
    batches = [[0], [1]]
    base = runner.baseline(model, prompts, dtype="bfloat16", batches=batches)
    got = runner.run({"model": model, "prompts": prompts, "kvpool": l1(), "dtype": "bfloat16",
                      "batches": batches})
    assert_same_outputs(base, got, "Qwen3-Next shape")
    log = log_of(got)
    assert HMA_OFF not in log, "vLLM turned its hybrid KV cache manager off"
    assert STANDS_ASIDE in log and "MambaSpec" in log, log[-3000:]
    # The shared prefix of the second prompt came from vLLM's own prefix cache (mamba
    # cache mode "align"), not from kvpool.
    assert got["results"][1]["num_cached_tokens"] > 0, got["results"][1]
    assert got["stats"].get("loaded_tokens", 0) == 0, got["stats"]


def test_a_sliding_window_model_is_served_by_kvpool_with_hma_on(runner, scratch):
    """Gemma 3 shape (3 sliding-window layers of window 64, 1 global; fp32) with HMA on:
    kvpool serves its 4 KV cache groups, one part each. An engine stores the first prompt to
    disk; a fresh engine is served the shared prefix from there, every group loaded
    (the sliding-window groups only inside their window), outputs identical."""
    model = make_gemma3_model(os.path.join(scratch, "tiny-gemma3"))
    prompts = shared_prefix_prompts(3, seed=62)
    base = runner.baseline(model, prompts)

    disk = os.path.join(scratch, "gemma3-disk")
    cfg = l1(tier=[{"url": f"file://{disk}"}])
    first = runner.run({"model": model, "kvpool": cfg, "prompts": prompts[:1],
                        "kv_events_port": free_port()})
    assert_same_outputs({"results": base["results"][:1]}, first, "first engine")
    log = log_of(first)
    assert HMA_OFF not in log, "vLLM turned its hybrid KV cache manager off"
    assert STANDS_ASIDE not in log, log[-3000:]
    stats = first["stats"]
    for part in ["", "g1_", "g2_", "g3_"]:
        assert stats[part + "stored_tokens"] >= PREFIX, stats
    # KV events: each group's chunks entering each tier, named by the group, carrying block
    # hashes vLLM announced. (vLLM announces a sliding-window group's blocks inside the
    # window only; a block's hash is the same in every group.)
    events = first["kv_events"]
    engine = {}
    for e in events:
        if e["type"] == "BlockStored" and e["medium"] in ("GPU", None):
            engine.setdefault(e["group"], set()).update(e["block_hashes"])
    assert sorted(engine) == [0, 1, 2, 3], sorted(engine)
    announced = set().union(*engine.values())
    for medium in ("CPU", "DISK"):
        for group in range(4):
            stored = [h for e in events if e["type"] == "BlockStored"
                      and e["medium"] == medium and e["group"] == group
                      for h in e["block_hashes"]]
            assert len(stored) >= PREFIX // 32, (medium, group, events[:3])
            assert set(stored) <= announced, (medium, group)

    fresh = runner.run({"model": model, "kvpool": cfg, "prompts": prompts,
                        "batches": [[0], [1, 2]]})
    assert_same_outputs(base, fresh, "fresh engine from disk")
    for i, r in enumerate(fresh["results"]):
        assert r["num_cached_tokens"] >= PREFIX, (i, r["num_cached_tokens"])
    stats = fresh["stats"]
    # The full-attention group loads the whole prefix; each sliding-window group only the
    # blocks inside its window (vLLM leaves the rest null).
    assert stats["loaded_tokens"] >= PREFIX, stats
    for part in ["g1_", "g2_", "g3_"]:
        assert 0 < stats[part + "loaded_tokens"] < stats["loaded_tokens"], stats


def test_a_sliding_window_models_failed_loads_are_recomputed(runner, scratch, redis_server):
    """Half of the Gemma 3 shape's stored values (of every group) corrupted in Redis: loads
    that fail in any group are reported per request (vLLM's ``failed_recving``, the way it
    takes a hybrid model's failures) and recomputed, outputs identical."""
    model = make_gemma3_model(os.path.join(scratch, "tiny-gemma3"))
    prompts = shared_prefix_prompts(3, seed=63)
    base = runner.baseline(model, prompts)
    cfg = l1(tier=[{"url": redis_server.url}])
    runner.run({"model": model, "kvpool": cfg, "prompts": prompts[:1]})
    keys = redis_server.keys()
    assert keys
    corrupt(redis_server, random.Random(48).sample(keys, max(1, len(keys) // 2)))
    got = runner.run({"model": model, "kvpool": cfg, "prompts": prompts,
                      "batches": [[0], [1, 2]]})
    assert_same_outputs(base, got, "corrupt values")
    failed = sum(v for k, v in got["stats"].items() if k.endswith("failed_load_blocks"))
    assert failed > 0, got["stats"]


TP2 = {"tensor_parallel_size": 2, "multiprocess": True,
       "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}


def test_a_sliding_window_model_under_tp2_multiprocess_is_served_from_disk(runner, scratch):
    """The Gemma 3 shape with HMA on under TP=2 in vLLM's multi-process mode (scheduler in
    EngineCore, each rank a worker process with its own parts and pool): a fresh engine is
    served the shared prefix from disk, outputs identical to TP=2 without kvpool."""
    model = make_gemma3_model(os.path.join(scratch, "tiny-gemma3"))
    prompts = shared_prefix_prompts(3, seed=64)
    base = runner.baseline(model, prompts, **TP2)
    disk = os.path.join(scratch, "gemma3-disk-tp2")
    cfg = l1(tier=[{"url": f"file://{disk}"}])
    first = runner.run({"model": model, "kvpool": cfg, "prompts": prompts[:1], **TP2})
    assert_same_outputs({"results": base["results"][:1]}, first, "first engine")
    assert HMA_OFF not in log_of(first) and STANDS_ASIDE not in log_of(first)
    fresh = runner.run({"model": model, "kvpool": cfg, "prompts": prompts,
                        "batches": [[0], [1, 2]], **TP2})
    assert_same_outputs(base, fresh, "fresh TP=2 engine from disk")
    assert fresh["results"][0]["num_cached_tokens"] >= PREFIX, fresh["results"][0]


def test_a_sliding_window_model_is_served_through_the_pool_daemon(runner, scratch,
                                                                 pool_daemon):
    """The Gemma 3 shape's parts attached to the node's pool daemon: every group's chunks are
    committed there, and a fresh engine is served from the daemon, outputs identical."""
    model = make_gemma3_model(os.path.join(scratch, "tiny-gemma3"))
    prompts = shared_prefix_prompts(3, seed=65)
    base = runner.baseline(model, prompts)
    daemon = pool_daemon("hybrid")
    cfg = {"config": {"local_cpu": {"max_size": "256MiB"}}, "pool": daemon.url}
    first = runner.run({"model": model, "kvpool": cfg, "prompts": prompts[:1]})
    assert_same_outputs({"results": base["results"][:1]}, first, "first engine")
    # Four whole chunks of the prefix, in each of the four groups.
    daemon.wait(lambda s: s.get("commits_total", 0) >= 4 * PREFIX // 256,
                "every group's chunks committed")
    fresh = runner.run({"model": model, "kvpool": cfg, "prompts": prompts,
                        "batches": [[0], [1, 2]]})
    assert_same_outputs(base, fresh, "fresh engine through the daemon")
    assert fresh["results"][0]["num_cached_tokens"] >= PREFIX, fresh["results"][0]
    assert fresh["stats"]["loaded_tokens"] >= PREFIX, fresh["stats"]
    daemon.wait(lambda s: s["sessions"] == 0, "every part detached")
