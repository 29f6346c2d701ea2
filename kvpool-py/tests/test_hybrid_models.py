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

from conftest import shared_prefix_prompts
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
    first = runner.run({"model": model, "kvpool": cfg, "prompts": prompts[:1]})
    assert_same_outputs({"results": base["results"][:1]}, first, "first engine")
    log = log_of(first)
    assert HMA_OFF not in log, "vLLM turned its hybrid KV cache manager off"
    assert STANDS_ASIDE not in log, log[-3000:]
    stats = first["stats"]
    for part in ["", "g1_", "g2_", "g3_"]:
        assert stats[part + "stored_tokens"] >= PREFIX, stats

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
