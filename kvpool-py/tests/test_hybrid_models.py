"""Hybrid models inside real vLLM (CPU build) with kvpool configured: vLLM keeps its hybrid KV
cache manager (HMA) on, because the connector declares ``SupportsHMA``. Without it, an SSM /
linear-attention hybrid (Qwen3-Next) refused to start ("Failed to promote local KV cache specs
to one unified type") and a sliding-window model ran with every layer holding the whole context.

kvpool does not yet store a model's several KV cache groups: with more than one it stands
aside (one warning; no lookup, load or save) and vLLM's own prefix cache serves. A
sliding-window model run with ``disable_hybrid_kv_cache_manager`` has one group, which kvpool
serves, from disk in a fresh process too. Outputs are compared with the same engine without
kvpool: greedy tokens identical, logprobs within 1e-4 (fp32) or identical (bf16, same batches).
"""

import os

from conftest import shared_prefix_prompts
from make_hybrid_model import make_gemma3_model, make_qwen3_next_model
from test_vllm_e2e import PREFIX, assert_same_outputs, l1

HMA_OFF = "Turning off hybrid kv cache manager"
STANDS_ASIDE = "kvpool does not store hybrid models' groups yet and stands aside"


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


def test_a_sliding_window_model_keeps_hma_and_is_served_by_kvpool_with_hma_off(runner,
                                                                              scratch):
    """Gemma 3 shape (3 sliding-window layers, 1 global; fp32). HMA on: kvpool stands aside,
    outputs identical. HMA off (vLLM's flag): one KV cache group that kvpool stores to disk,
    and a fresh engine is served the shared prefix from there with identical outputs."""
    model = make_gemma3_model(os.path.join(scratch, "tiny-gemma3"))
    prompts = shared_prefix_prompts(3, seed=62)
    base = runner.baseline(model, prompts)

    on = runner.run({"model": model, "prompts": prompts, "kvpool": l1(),
                     "batches": [[0], [1, 2]]})
    assert_same_outputs(base, on, "HMA on")
    log = log_of(on)
    assert HMA_OFF not in log
    assert STANDS_ASIDE in log and "SlidingWindowSpec" in log, log[-3000:]

    disk = os.path.join(scratch, "gemma3-disk")
    cfg = l1(tier=[{"url": f"file://{disk}"}])
    off = {"model": model, "kvpool": cfg, "disable_hybrid_kv_cache_manager": True}
    first = runner.run({**off, "prompts": prompts[:1]})
    assert_same_outputs({"results": base["results"][:1]}, first, "HMA off, first engine")
    assert first["stats"]["stored_tokens"] >= PREFIX, first["stats"]
    fresh = runner.run({**off, "prompts": prompts, "batches": [[0], [1, 2]]})
    assert_same_outputs(base, fresh, "HMA off, fresh engine from disk")
    for i, r in enumerate(fresh["results"]):
        assert r["num_cached_tokens"] >= PREFIX, (i, r["num_cached_tokens"])
    assert fresh["stats"]["loaded_tokens"] >= PREFIX, fresh["stats"]
