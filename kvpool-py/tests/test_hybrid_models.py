"""Hybrid models inside real vLLM (CPU build) with kvpool configured: vLLM keeps its hybrid KV
cache manager (HMA) on, because the connector declares ``SupportsHMA``. Without it, an SSM /
linear-attention hybrid (Qwen3-Next) refused to start ("Failed to promote local KV cache specs
to one unified type") and a sliding-window model ran with every layer holding the whole context.

kvpool serves a model of full-attention and sliding-window groups (Gemma 3 shape) and a model
of linear-attention state and full-attention groups (Qwen3-Next shape, its chunk set to vLLM's
block), one part per group. Outputs are compared with the same engine without kvpool: greedy
tokens identical, logprobs within 1e-4 (fp32); for bf16, against the run that makes the same
computation (vLLM's own prefix cache resuming from the same boundary, or computing the prompt
whole), same batches.
"""

import os
import random
import re

from conftest import free_port, shared_prefix_prompts
from make_hybrid_model import make_gemma3_model, make_qwen3_next_model
from test_vllm_e2e import PREFIX, assert_same_outputs, corrupt, l1

HMA_OFF = "Turning off hybrid kv cache manager"
STANDS_ASIDE = "kvpool stands aside for it"


def log_of(run):
    with open(run["log"]) as f:
        return f.read()


BLOCK_SIZE_SET = re.compile(r"Setting attention block size to (\d+) tokens")


def hybrid_block_size(run):
    """The block size vLLM chose for a hybrid model (attention pages as large as a state)."""
    found = BLOCK_SIZE_SET.findall(log_of(run))
    assert found, "vLLM did not log the block size it chose for the hybrid model"
    return int(found[-1])


def qwen3_next(scratch):
    """The Qwen3-Next shape, and three prompts sharing a 1K prefix, the first of them the
    prefix alone. vLLM keeps a linear-attention model's state where a prompt's prefill ends
    (its last block boundary), and at every block boundary only on CPUs whose GDN prefill
    kernel checkpoints inside a chunk (an AVX512-BF16/AMX host did; an AVX2-only EPYC does
    not): with the prefix alone first, vLLM's own prefix cache, and so kvpool, resumes the
    other two from its state on any CPU."""
    prompts = shared_prefix_prompts(3, seed=61)
    prompts[0] = prompts[0][:PREFIX]
    return make_qwen3_next_model(os.path.join(scratch, "tiny-qwen3-next")), prompts


def counter(stats, name):
    """A counter summed over a hybrid model's parts (``g<i>_<name>``)."""
    return sum(v for k, v in stats.items() if k == name or k.endswith("_" + name))


def test_a_linear_attention_hybrid_is_served_by_kvpool_with_hma_on(runner, scratch):
    """Qwen3-Next shape (3 Gated DeltaNet layers + 1 full attention, bf16) with HMA on and
    kvpool's chunk = vLLM's block: the first engine saves the prompt's attention KV and its
    recurrent states (at the boundaries vLLM keeps) to disk; a fresh engine is served the
    shared prefix from there, every group (the attention KV up to the boundary, each state
    group's state at exactly that boundary), as far as vLLM's own prefix cache serves it
    within one engine, outputs identical to that own-cache run (same computation from the
    same KV and state). With the default chunk size kvpool stands aside and says what to set."""
    model, prompts = qwen3_next(scratch)
    batches = [[0], [1], [2]]
    base = runner.baseline(model, prompts, dtype="bfloat16", batches=batches)
    bs = hybrid_block_size(base)
    own_hit = base["results"][1]["num_cached_tokens"]
    # vLLM's own prefix cache (mamba cache mode "align") resumed prompt 1 from prompt 0's
    # state at a block boundary inside the shared prefix.
    assert base["results"][0]["num_cached_tokens"] == 0
    assert 0 < own_hit <= PREFIX and own_hit % bs == 0, (own_hit, bs)

    aside = runner.run({"model": model, "prompts": prompts[:1], "kvpool": l1(),
                        "dtype": "bfloat16"})
    assert_same_outputs({"results": base["results"][:1]}, aside, "standing aside")
    log = log_of(aside)
    assert HMA_OFF not in log, "vLLM turned its hybrid KV cache manager off"
    assert STANDS_ASIDE in log and f'"chunk_size": {bs}' in log, log[-3000:]

    disk = os.path.join(scratch, "qwen3-next-disk")
    cfg = l1(tier=[{"url": f"file://{disk}"}], chunking={"chunk_size": bs})
    first = runner.run({"model": model, "kvpool": cfg, "prompts": prompts[:1],
                        "dtype": "bfloat16"})
    # Nothing to load in the first engine: the same computation as without kvpool.
    assert_same_outputs({"results": base["results"][:1]}, first, "first engine")
    log = log_of(first)
    assert HMA_OFF not in log and STANDS_ASIDE not in log, log[-3000:]
    # Three state groups (one Gated DeltaNet layer each) saved the state vLLM kept.
    assert counter(first["stats"], "state_saves") >= 3, first["stats"]

    fresh = runner.run({"model": model, "kvpool": cfg, "prompts": prompts[1:],
                        "batches": [[0], [1]], "dtype": "bfloat16"})
    assert_same_outputs({"results": base["results"][1:]}, fresh, "fresh engine from disk")
    assert fresh["results"][0]["num_cached_tokens"] >= own_hit, fresh["results"][0]
    stats = fresh["stats"]
    assert stats["loaded_tokens"] >= own_hit, stats
    assert counter(stats, "state_loads") >= 3, stats
    assert counter(stats, "state_load_failures") == 0, stats


def test_a_linear_attention_hybrids_failed_state_loads_are_recomputed(runner, scratch,
                                                                     redis_server):
    """The Qwen3-Next shape's recurrent states corrupted in Redis, its attention KV intact: a
    state that fails its check is never loaded; the request's load fails (vLLM's
    ``failed_recving``: the attention KV loaded alone is not used) and it is recomputed from
    the start, outputs identical to an engine that computed it without kvpool."""
    model, prompts = qwen3_next(scratch)
    base = runner.baseline(model, prompts[1:2], dtype="bfloat16")
    bs = hybrid_block_size(base)
    cfg = l1(tier=[{"url": redis_server.url}], chunking={"chunk_size": bs})
    runner.run({"model": model, "kvpool": cfg, "prompts": prompts[:1], "dtype": "bfloat16"})
    sizes = {k: int(redis_server.cli("STRLEN", k)) for k in redis_server.keys()}
    # An attention chunk is a block's page; a state is smaller (vLLM pads it to the page).
    states = [k for k, n in sizes.items() if n < max(sizes.values())]
    assert states and len(states) < len(sizes), sizes
    corrupt(redis_server, states)
    got = runner.run({"model": model, "kvpool": cfg, "prompts": prompts[1:2],
                      "dtype": "bfloat16"})
    assert_same_outputs(base, got, "corrupt states")
    stats = got["stats"]
    assert counter(stats, "state_load_failures") > 0, stats
    assert counter(stats, "state_loads") == 0, stats
    # The attention KV was loaded, and not used: the request was recomputed.
    assert stats["loaded_tokens"] > 0 and got["results"][0]["num_cached_tokens"] == 0, \
        (stats, got["results"][0])


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


#: TP=2 with the EngineCore and the ranks forked rather than spawned (see test_tensor_parallel:
#: the spawned start, as the CPU build does it, is tested there once).
TP2 = {"tensor_parallel_size": 2, "multiprocess": True, "rank_start": "fork",
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


def test_a_linear_attention_hybrid_under_tp2_multiprocess_is_served_from_disk(runner,
                                                                              scratch):
    """The Qwen3-Next shape under TP=2 in vLLM's multi-process mode (each rank holds its shard
    of every state, keyed by its rank; a state hit needs every rank's): a fresh engine is
    served the shared prefix from disk, outputs identical to TP=2 without kvpool serving it
    from its own prefix cache."""
    model, prompts = qwen3_next(scratch)
    base = runner.baseline(model, prompts, dtype="bfloat16", batches=[[0], [1], [2]], **TP2)
    bs = hybrid_block_size(base)
    own_hit = base["results"][1]["num_cached_tokens"]
    assert own_hit > 0, base["results"]
    disk = os.path.join(scratch, "qwen3-next-disk-tp2")
    cfg = l1(tier=[{"url": f"file://{disk}"}], chunking={"chunk_size": bs})
    first = runner.run({"model": model, "kvpool": cfg, "prompts": prompts[:1],
                        "dtype": "bfloat16", **TP2})
    assert_same_outputs({"results": base["results"][:1]}, first, "first TP=2 engine")
    assert STANDS_ASIDE not in log_of(first)
    fresh = runner.run({"model": model, "kvpool": cfg, "prompts": prompts[1:],
                        "batches": [[0], [1]], "dtype": "bfloat16", **TP2})
    assert_same_outputs({"results": base["results"][1:]}, fresh, "fresh TP=2 engine from disk")
    assert fresh["results"][0]["num_cached_tokens"] >= own_hit, fresh["results"][0]


def test_a_linear_attention_hybrid_is_served_through_the_pool_daemon(runner, scratch,
                                                                    pool_daemon):
    """The Qwen3-Next shape's parts attached to the node's pool daemon: the attention KV and
    the recurrent states reach it, and a fresh engine (an empty L1 of its own) is served the
    shared prefix from the daemon, every group, outputs identical to vLLM's own prefix cache
    resuming from the same boundary."""
    model, prompts = qwen3_next(scratch)
    base = runner.baseline(model, prompts, dtype="bfloat16", batches=[[0], [1], [2]])
    bs = hybrid_block_size(base)
    own_hit = base["results"][1]["num_cached_tokens"]
    daemon = pool_daemon("hybrid-states")
    cfg = {"config": {"local_cpu": {"max_size": "256MiB"}, "chunking": {"chunk_size": bs}},
           "pool": daemon.url}
    first = runner.run({"model": model, "kvpool": cfg, "prompts": prompts[:1],
                        "dtype": "bfloat16"})
    assert counter(first["stats"], "state_saves") >= 3, first["stats"]
    fresh = runner.run({"model": model, "kvpool": cfg, "prompts": prompts[1:],
                        "batches": [[0], [1]], "dtype": "bfloat16"})
    assert_same_outputs({"results": base["results"][1:]}, fresh, "fresh engine through the daemon")
    assert fresh["results"][0]["num_cached_tokens"] >= own_hit, fresh["results"][0]
    assert counter(fresh["stats"], "state_loads") >= 3, fresh["stats"]
    daemon.wait(lambda s: s["sessions"] == 0, "every part detached")
