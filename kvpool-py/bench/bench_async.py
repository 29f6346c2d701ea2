"""Synchronous vs asynchronous loads inside vLLM (CPU build), side by side in one run:

1. TTFT of a repeated 8K-token prefix loaded from L1 (same process), disk and Redis (fresh
   processes), with loads before the forward pass (``"async_loads": false``) and in the
   background (the default; ``"always"`` for L1, whose leased hits are otherwise
   synchronous).
2. A's inter-token gaps while B loads an 8K-token prefix from each tier, against the same run
   with B's prefix served by vLLM's own prefix cache (the floor: B's prefill of its tail lands
   in A's steps with any cache), and against A alone: the engine is stepped by hand and every
   token timestamped, as a streaming client sees it. ``--itl-repeats`` rounds, each running
   the floor and every tier (asynchronous loads) in turn; ratios are per round, then the
   median. Synchronous loads run once each (``--itl-sync``). The Redis tier is also measured
   behind a loopback proxy throttled to 32 MB/s (a remote store across a slow link), where a
   load takes seconds.

    python bench_async.py --out results.json [--prefix 8192 --repeats 5 --itl-repeats 5]
        [--skip-ttft] [--itl-sync]

Run through `cargo xtask bench-async`, which builds a release wheel first and starts Redis.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def engine_main(spec_path, out_path):
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kvpool = spec["kvpool"] is not None
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
              dtype="float32", block_size=32, max_model_len=spec["max_model_len"],
              max_num_batched_tokens=spec["max_model_len"],
              enable_prefix_caching=spec.get("prefix_caching", False),
              distributed_executor_backend="uni", seed=0,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KvpoolConnector", kv_connector_module_path="kvpool.vllm",
                  kv_role="kv_both", kv_load_failure_policy="recompute",
                  kv_connector_extra_config={"config": spec["kvpool"],
                                             "async_loads": spec["async_loads"]})
              if kvpool else None)

    def params(n):
        return SamplingParams(temperature=0, detokenize=False, ignore_eos=True, max_tokens=n)

    out = {"ttft_s": []}
    for p in spec.get("warm", []):
        llm.generate([{"prompt_token_ids": p}], params(1), use_tqdm=False)
    for p in spec.get("measure", []):
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p}], params(1), use_tqdm=False)
        out["ttft_s"].append(time.perf_counter() - t0)
        out.setdefault("cached", []).append(res[0].num_cached_tokens)
    if spec.get("prompt_a"):
        b_cached = []
        engine = llm.llm_engine
        engine.add_request("A", {"prompt_token_ids": spec["prompt_a"]}, params(spec["a_tokens"]))
        times = {"A": [], "B": []}
        b_at = None
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                while len(times[o.request_id]) < len(o.outputs[0].token_ids):
                    times[o.request_id].append(now)
                if o.request_id == "B" and o.finished:
                    b_cached.append(o.num_cached_tokens)
            if spec.get("prompt_b") and b_at is None and len(times["A"]) >= spec["b_after"]:
                engine.add_request("B", {"prompt_token_ids": spec["prompt_b"]}, params(1))
                b_at = time.perf_counter()
        a = times["A"]
        gaps = [t1 - t0 for t0, t1 in zip(a, a[1:])]
        out["a_median_gap_s"] = statistics.median(gaps)
        out["a_worst_gap_s"] = max(gaps[spec["b_after"]:])
        if b_at is not None:
            b_first = times["B"][0]
            out["b_ttft_s"] = b_first - b_at
            during = [t1 - t0 for t0, t1 in zip(a, a[1:]) if t1 > b_at and t0 < b_first]
            out["a_worst_gap_during_b_s"] = max(during) if during else 0.0
            # B's tokens served from a cache (vLLM's own or kvpool's): the load happened.
            out["b_cached_tokens"] = b_cached[0] if b_cached else None
    if kvpool:
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            ensure_kv_transfer_shutdown, get_kv_transfer_group)

        out["stats"] = dict(get_kv_transfer_group()._work.native.stats())
        ensure_kv_transfer_shutdown()
    with open(out_path, "w") as f:
        json.dump(out, f)


def run_engine(spec, scratch, name):
    spec_path = os.path.join(scratch, f"{name}.spec.json")
    out_path = os.path.join(scratch, f"{name}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    with open(os.path.join(scratch, f"{name}.log"), "w") as log:
        subprocess.run([sys.executable, __file__, "--engine", spec_path, out_path],
                       stdout=log, stderr=subprocess.STDOUT, check=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    with open(out_path) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--redis-port", type=int, required=True)
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--itl-repeats", type=int, default=5,
                    help="rounds of the gap runs (the floor, then each tier)")
    ap.add_argument("--skip-ttft", action="store_true", help="only the gap runs")
    ap.add_argument("--itl-sync", action="store_true",
                    help="also synchronous loads in the gap runs (once each)")
    ap.add_argument("--scratch", default=None)
    a = ap.parse_args()
    if a.itl_repeats < 1:
        ap.error("--itl-repeats must be at least 1")
    from make_model import make_model
    from test_asynchrony import ThrottledProxy

    scratch = a.scratch or tempfile.mkdtemp(prefix="kvpool-bench-async-")
    model = make_model(os.path.join(scratch, "llama-512x4"), hidden=512, layers=4, heads=8,
                       kv_heads=4, intermediate=1408, seed=0)
    r = random.Random(0)
    prefix = [r.randrange(3, 999) for _ in range(a.prefix)]
    prompt = prefix + [r.randrange(3, 999) for _ in range(64)]
    prompt_a = [r.randrange(3, 999) for _ in range(64)]
    unrelated = [r.randrange(3, 999) for _ in range(512)]
    base = {"model": model, "max_model_len": a.prefix + 256}
    l1 = {"local_cpu": {"max_size": "2GiB"}}

    def lower(url, name):
        # Each tier gets its own Redis database / directory, primed by a first process.
        return {"local_cpu": {"max_size": "2GiB"},
                "tier": [{"url": url, "timeout_ms": 60000}]}

    disk = lower(f"file://{os.path.join(scratch, 'disk')}", "disk")
    redis_url = f"redis://127.0.0.1:{a.redis_port}"
    redis = lower(redis_url, "redis")
    for name, cfg in (("disk", disk), ("redis", redis)):
        run_engine({**base, "kvpool": cfg, "async_loads": True, "measure": [prompt]}, scratch,
                   f"prime-{name}")
    proxy = ThrottledProxy(a.redis_port, 32 << 20)
    slow = lower(proxy.url, "slow-redis")
    modes = {"sync": False, "async": True}
    ttft = {}
    for mode, flag in ({} if a.skip_ttft else modes).items():
        res = run_engine({**base, "kvpool": l1, "async_loads": "always" if flag else False,
                          "warm": [unrelated, prompt], "measure": [prompt] * a.repeats},
                         scratch, f"ttft-l1-{mode}")
        ttft[("L1", mode)] = res["ttft_s"]
        for tier, cfg in (("disk", disk), ("Redis", redis)):
            runs = [run_engine({**base, "kvpool": cfg, "async_loads": flag,
                                "warm": [unrelated], "measure": [prompt]},
                               scratch, f"ttft-{tier}-{mode}-{i}")["ttft_s"][0]
                    for i in range(a.repeats)]
            ttft[(tier, mode)] = runs
    gap = {"prompt_a": prompt_a, "a_tokens": 120, "b_after": 10}
    tiers = (("L1", l1, [unrelated, prompt]), ("disk", disk, [unrelated]),
             ("Redis", redis, [unrelated]), ("Redis at 32 MB/s", slow, [unrelated]))
    # The floor: no connector, B's prompt resident in vLLM's own prefix cache (warmed with
    # it, as L1 is): vLLM then serves the same 8,224 tokens (whole blocks) that kvpool
    # serves, and B computes the same 32-token tail.
    floor_spec = {**base, "kvpool": None, "prefix_caching": True, "async_loads": True,
                  "warm": [unrelated, prompt], **gap, "prompt_b": prompt}
    alone = [run_engine({**base, "kvpool": l1, "async_loads": True, "warm": [unrelated], **gap},
                        scratch, "a-alone")]
    floor, itl = [], {}
    for i in range(a.itl_repeats):
        floor.append(run_engine(floor_spec, scratch, f"floor-{i}"))
        for tier, cfg, warm in tiers:
            timing = "always" if tier == "L1" else True
            itl.setdefault((tier, "async"), []).append(run_engine(
                {**base, "kvpool": cfg, "async_loads": timing, "warm": warm, **gap,
                 "prompt_b": prompt}, scratch, f"itl-{tier.split()[0]}-async-{i}"))
    if a.itl_sync:
        for tier, cfg, warm in tiers:
            itl[(tier, "sync")] = [run_engine(
                {**base, "kvpool": cfg, "async_loads": False, "warm": warm, **gap,
                 "prompt_b": prompt}, scratch, f"itl-{tier.split()[0]}-sync")]
    proxy.stop()

    # The raw results first: a failure while printing loses nothing.
    with open(a.out, "w") as f:
        json.dump({"prefix_tokens": a.prefix,
                   "ttft": [{"tier": t, "mode": m, "ttft_s": v} for (t, m), v in ttft.items()],
                   "a_alone": alone, "floor": floor,
                   "itl_raw": [{"tier": t, "mode": m, "runs": v} for (t, m), v in itl.items()]},
                  f, indent=2)
    med = statistics.median
    rows = []
    if ttft:
        print(f"\nTTFT of the repeated {a.prefix}-token prefix (median of {a.repeats})")
        print(f"{'tier':10} {'sync':>8} {'async':>8}")
        for tier in ("L1", "disk", "Redis"):
            s, asy = (med(ttft[(tier, m)]) for m in modes)
            print(f"{tier:10} {s:7.3f}s {asy:7.3f}s")
            rows.append({"tier": tier, "ttft_sync_s": ttft[(tier, "sync")],
                         "ttft_async_s": ttft[(tier, "async")]})

    def spread(xs):
        return f"{med(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"

    floor_worst = [f["a_worst_gap_during_b_s"] for f in floor]
    floor_median = [f["a_median_gap_s"] for f in floor]
    alone_worst = [r["a_worst_gap_s"] for r in alone]
    print(f"\nA's gaps while B's 8K prefix loads; {a.itl_repeats} rounds, medians [range]")
    print(f"A alone (one run): median gap {med([r['a_median_gap_s'] for r in alone]) * 1e3:.1f} ms, "
          f"worst {med(alone_worst) * 1e3:.1f} ms")
    print(f"floor (B's prefix in vLLM's own prefix cache): A's worst gap during B "
          f"{med(floor_worst) * 1e3:.1f} ms, B's TTFT "
          f"{med([f['b_ttft_s'] for f in floor]) * 1e3:.0f} ms, B cached "
          f"{[f.get('b_cached_tokens') for f in floor]}")
    print(f"{'B loads from':18} {'mode':6} {'B TTFT ms':>10} {'A worst ms':>11} "
          f"{'worst vs floor':>22} {'median gap vs floor':>22} {'worst vs alone':>16}")
    itl_rows = []
    for (tier, mode), runs in itl.items():
        n = len(runs)
        worst = [r["a_worst_gap_during_b_s"] for r in runs]
        # Paired with the floor of the same round; the synchronous rows (run once, after the
        # rounds) have no floor of their own: no ratio.
        paired = mode == "async"
        vs_floor = [w / f for w, f in zip(worst, floor_worst[:n])] if paired else []
        median_vs_floor = ([r["a_median_gap_s"] / f for r, f in zip(runs, floor_median[:n])]
                           if paired else [])
        vs_alone = [w / alone_worst[0] for w in worst]
        print(f"{tier:18} {mode:6} {med([r['b_ttft_s'] for r in runs]) * 1e3:10.0f} "
              f"{med(worst) * 1e3:11.1f} {spread(vs_floor) if paired else '-':>22} "
              f"{spread(median_vs_floor) if paired else '-':>22} {med(vs_alone):15.1f}x")
        itl_rows.append({"tier": tier, "mode": mode,
                         "b_ttft_s": [r["b_ttft_s"] for r in runs],
                         "b_cached_tokens": [r.get("b_cached_tokens") for r in runs],
                         "a_median_gap_s": [r["a_median_gap_s"] for r in runs],
                         "a_worst_gap_during_b_s": worst,
                         "worst_vs_floor": vs_floor, "median_gap_vs_floor": median_vs_floor,
                         "worst_vs_alone": vs_alone, "stats": runs[-1].get("stats")})
    with open(a.out, "w") as f:
        json.dump({"prefix_tokens": a.prefix, "ttft": rows, "a_alone": alone, "floor": floor,
                   "itl": itl_rows}, f, indent=2)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        engine_main(sys.argv[2], sys.argv[3])
    else:
        main()
