"""Synchronous vs asynchronous loads inside vLLM (CPU build), side by side in one run:

1. TTFT of a repeated 8K-token prefix loaded from L1 (same process), disk and Redis (fresh
   processes), with loads before the forward pass (``"async_loads": false``) and in the
   background (the default; ``"always"`` for L1, whose leased hits are otherwise
   synchronous).
2. A's inter-token gaps while B loads an 8K-token prefix from each tier, sync vs async, against
   A alone: the engine is stepped by hand and every token timestamped, as a streaming client
   sees it. The Redis tier is also measured behind a loopback proxy throttled to 32 MB/s (a
   remote store across a slow link), where a load takes seconds.

    python bench_async.py --out results.json [--prefix 8192 --repeats 5]

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

    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
              dtype="float32", block_size=32, max_model_len=spec["max_model_len"],
              max_num_batched_tokens=spec["max_model_len"], enable_prefix_caching=False,
              distributed_executor_backend="uni", seed=0,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KvpoolConnector", kv_connector_module_path="kvpool.vllm",
                  kv_role="kv_both", kv_load_failure_policy="recompute",
                  kv_connector_extra_config={"config": spec["kvpool"],
                                             "async_loads": spec["async_loads"]}))

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
    ap.add_argument("--scratch", default=None)
    a = ap.parse_args()
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
    for mode, flag in modes.items():
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
    itl = {}
    alone = run_engine({**base, "kvpool": l1, "async_loads": True, "warm": [unrelated],
                        "prompt_a": prompt_a, "a_tokens": 120, "b_after": 10}, scratch, "a-alone")
    for mode, flag in modes.items():
        for tier, cfg, warm in (("L1", l1, [unrelated, prompt]), ("disk", disk, [unrelated]),
                                ("Redis", redis, [unrelated]),
                                ("Redis at 32 MB/s", slow, [unrelated])):
            timing = ("always" if flag else False) if tier == "L1" else flag
            itl[(tier, mode)] = run_engine(
                {**base, "kvpool": cfg, "async_loads": timing, "warm": warm,
                 "prompt_a": prompt_a, "a_tokens": 120, "prompt_b": prompt, "b_after": 10},
                scratch, f"itl-{tier.split()[0]}-{mode}-{len(itl)}")
    proxy.stop()

    rows = []
    print(f"\nTTFT of the repeated {a.prefix}-token prefix (median of {a.repeats})")
    print(f"{'tier':10} {'sync':>8} {'async':>8}")
    for tier in ("L1", "disk", "Redis"):
        s, asy = (statistics.median(ttft[(tier, m)]) for m in modes)
        print(f"{tier:10} {s:7.3f}s {asy:7.3f}s")
        rows.append({"tier": tier, "ttft_sync_s": ttft[(tier, "sync")],
                     "ttft_async_s": ttft[(tier, "async")]})
    print(f"\nA alone: median gap {alone['a_median_gap_s']:.4f}s, worst {alone['a_worst_gap_s']:.4f}s")
    print(f"{'B loads from':18} {'mode':6} {'B TTFT':>8} {'A median':>9} {'A worst':>8} {'vs alone':>9}")
    itl_rows = []
    for (tier, mode), res in itl.items():
        ratio = res["a_worst_gap_during_b_s"] / alone["a_worst_gap_s"]
        print(f"{tier:18} {mode:6} {res['b_ttft_s']:7.3f}s {res['a_median_gap_s']:8.4f}s "
              f"{res['a_worst_gap_during_b_s']:7.3f}s {ratio:8.1f}x")
        itl_rows.append({"tier": tier, "mode": mode, "b_ttft_s": res["b_ttft_s"],
                         "a_median_gap_s": res["a_median_gap_s"],
                         "a_worst_gap_during_b_s": res["a_worst_gap_during_b_s"],
                         "worst_vs_alone": ratio, "stats": res["stats"]})
    with open(a.out, "w") as f:
        json.dump({"prefix_tokens": a.prefix, "ttft": rows, "a_alone": alone, "itl": itl_rows},
                  f, indent=2)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        engine_main(sys.argv[2], sys.argv[3])
    else:
        main()
