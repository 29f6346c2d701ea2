"""Disaggregated prefill through the pool against one server doing both, side by side:
TTFT and ITL of `vllm serve` (CPU build) driven by vLLM's own client (`vllm bench serve`).

Two set-ups on the same two cores, all started once and driven in turn (rounds interleaved,
the order swapped each round, each round's prompts new to both):

- **one server**: one `vllm serve` without a connector, its model on both cores;
- **1P1D**: a `kv_producer` `vllm serve` on core 0 and a `kv_consumer` on core 1 sharing the
  node's pool daemon (`kvpool serve`), behind `python -m kvpool.disagg_proxy`.

Per run: TTFT, ITL and end-to-end latency percentiles, output tokens/s, and where TTFT goes
(the client's mean TTFT next to each server's own, from vLLM's TTFT histogram: for 1P1D the
prefill instance's one-token request, the decode instance's request, and the remainder, per
round); the decode instance's prompt tokens and those it loaded; per set-up the
median over rounds and the range; the per-round ratio 1P1D / one server and its median; and the
consumer's hand-off counters (every request should be handed off and found whole).

    python bench_disagg.py --out results.json [--rounds 5] [--prompts 16] [--input-len 1000]

Run through `cargo xtask bench-disagg` (release wheel; `KVPOOL_BIN` names `kvpool`).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import bench_serve  # noqa: E402
from bench_serve import Server, run_client  # noqa: E402

#: What each run reports: (key in the summary, key in `vllm bench serve`'s result).
FIGURES = (
    ("ttft_p50_ms", "p50_ttft_ms"), ("ttft_p99_ms", "p99_ttft_ms"),
    ("itl_p50_ms", "p50_itl_ms"), ("itl_p99_ms", "p99_itl_ms"),
    ("e2el_p50_ms", "p50_e2el_ms"), ("output_tok_s", "output_throughput"),
)
#: The consumer's hand-off counters read after each 1P1D run.
HANDOFF_COUNTERS = ("received", "complete", "waited", "timed_out")


def kvpool_transfer(role, pool):
    """`--kv-transfer-config` of a 1P1D instance in `role` over the pool daemon at `pool`."""
    return ["--kv-transfer-config", json.dumps({
        "kv_connector": "KvpoolConnector", "kv_connector_module_path": "kvpool.vllm",
        "kv_role": role, "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"pool": pool, "config": {
            "local_cpu": {"max_size": "512MiB"}}}})]


def cores(spec):
    """Environment of a server whose model threads run on cores `spec` ("0", "0-1")."""
    return {"VLLM_CPU_OMP_THREADS_BIND": spec, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1"}


class Proxy:
    """`python -m kvpool.disagg_proxy` in front of the two instances, stopped by PID."""

    def __init__(self, prefill_port, decode_port, port, log_path):
        self.port = port
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.disagg_proxy",
             "--prefill", f"http://127.0.0.1:{prefill_port}",
             "--decode", f"http://127.0.0.1:{decode_port}", "--port", str(port)],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"the proxy did not start (log: {log_path})")
                time.sleep(0.2)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def server_ttft(server):
    """(sum of seconds, count) of a server's own TTFT histogram so far."""
    return (server.metric("vllm:time_to_first_token_seconds_sum"),
            server.metric("vllm:time_to_first_token_seconds_count"))


def mean_ms(before, after):
    """The mean TTFT in ms between two `server_ttft` readings."""
    n = after[1] - before[1]
    return (after[0] - before[0]) / n * 1000 if n else None


def spread(values):
    """Median and range of `values`, for the table."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    # Not a multiple of kvpool's 256-token chunk (before 2026-11-28's tail for such prompts, a
    # prompt ending on a chunk boundary was handed off to the chunk before its last).
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson)")
    ap.add_argument("--scratch", default=None)
    a = ap.parse_args()
    from make_model import make_model
    from pool_daemon import PoolDaemon

    scratch = a.scratch or tempfile.mkdtemp(prefix="kvpool-bench-disagg-")
    model = make_model(os.path.join(scratch, "llama-512x4"), hidden=512, layers=4, heads=8,
                       kv_heads=4, intermediate=1408, seed=0)
    bench_serve.make_tokenizer(model)
    env = {"MAX_LEN": 4096}
    base_port = 19000 + os.getpid() % 500
    daemon = PoolDaemon(scratch, "pool", size="2GiB")
    started = []
    try:
        one = Server(model, base_port, os.path.join(scratch, "one.server.log"), [], env,
                     cores("0-1"))
        started.append(one)
        prefill = Server(model, base_port + 1, os.path.join(scratch, "prefill.server.log"),
                         kvpool_transfer("kv_producer", daemon.url), env, cores("0"))
        started.append(prefill)
        decode = Server(model, base_port + 2, os.path.join(scratch, "decode.server.log"),
                        kvpool_transfer("kv_consumer", daemon.url), env, cores("1"))
        started.append(decode)
        for server in started:
            server.wait_ready()
        proxy = Proxy(prefill.port, decode.port, base_port + 3,
                      os.path.join(scratch, "proxy.log"))
        targets = {"one server": one.port, "1P1D": proxy.port}
        results_dir = os.path.join(scratch, "results")
        os.makedirs(results_dir, exist_ok=True)
        runs = {name: [] for name in targets}
        handoffs = []
        try:
            for rnd in range(a.rounds):
                order = list(targets) if rnd % 2 == 0 else list(reversed(targets))
                dataset = ["--dataset-name", "random", "--num-prompts", str(a.prompts),
                           "--random-input-len", str(a.input_len),
                           "--random-output-len", str(a.output_len),
                           "--request-rate", str(a.rate), "--seed", str(100 + rnd)]
                for name in order:
                    before = {c: decode.metric(f"vllm:kvpool_handoffs_{c}_total")
                              for c in HANDOFF_COUNTERS}
                    before["loaded"] = decode.metric("vllm:kvpool_loaded_tokens_total")
                    before["prompt"] = decode.metric("vllm:prompt_tokens_total")
                    before["cached"] = one.metric("vllm:prefix_cache_hits_total")
                    before["queried"] = one.metric("vllm:prefix_cache_queries_total")
                    ttfts = {s: server_ttft(s) for s in started}
                    r = run_client(model, targets[name], dataset, results_dir,
                                   f"{name.replace(' ', '-')}-{rnd}", "ttft,itl,e2el")
                    if r.get("completed") != a.prompts:
                        raise RuntimeError(f"{name} round {rnd}: {r.get('completed')} of "
                                           f"{a.prompts} requests completed")
                    row = {key: r.get(src) for key, src in FIGURES}
                    # Where TTFT goes: each server's own mean TTFT over the run (vLLM's
                    # histogram), next to the client's mean.
                    row["client_ttft_mean_ms"] = r.get("mean_ttft_ms")
                    for s, label in ((one, "one_server"), (prefill, "prefill"),
                                     (decode, "decode")):
                        if (s is one) == (name == "one server"):
                            row[f"{label}_ttft_mean_ms"] = mean_ms(ttfts[s], server_ttft(s))
                    if name == "1P1D":
                        row["handoffs"] = {
                            c: int(decode.metric(f"vllm:kvpool_handoffs_{c}_total") - before[c])
                            for c in HANDOFF_COUNTERS}
                        # Of the decode instance's prompt tokens, those loaded from the pool.
                        row["handoffs"]["prompt_tokens"] = int(
                            decode.metric("vllm:prompt_tokens_total") - before["prompt"])
                        row["handoffs"]["loaded_tokens"] = int(
                            decode.metric("vllm:kvpool_loaded_tokens_total") - before["loaded"])
                        handoffs.append(row["handoffs"])
                        # What neither instance's own TTFT holds: the proxy's hops, HTTP.
                        row["remainder_ttft_mean_ms"] = row["client_ttft_mean_ms"] - \
                            row["prefill_ttft_mean_ms"] - row["decode_ttft_mean_ms"]
                    else:
                        # Prompts new to the server: its own prefix cache should find nothing
                        # of what it was asked (the queries show the counters are read).
                        row["prefix_cache_hit_tokens"] = int(
                            one.metric("vllm:prefix_cache_hits_total") - before["cached"])
                        row["prefix_cache_queried_tokens"] = int(
                            one.metric("vllm:prefix_cache_queries_total") - before["queried"])
                    runs[name].append(row)
                    print(f"round {rnd} {name}: {json.dumps(row)}", flush=True)
        finally:
            proxy.stop()
    finally:
        for server in started:
            server.stop()
        daemon.stop()
    summary = {name: {key: spread([r[key] for r in rows]) for key, _ in FIGURES}
               for name, rows in runs.items()}
    ratios = {key: spread([p[key] / o[key] for p, o in zip(runs["1P1D"], runs["one server"])])
              for key, _ in FIGURES}
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "runs": runs, "summary": summary,
                   "ratio_1p1d_to_one_server": ratios}, f, indent=2)
    print(f"\n{a.rounds} rounds of {a.prompts} prompts of {a.input_len} tokens, "
          f"{a.output_len} out, {a.rate} req/s; median (min-max) over rounds")
    print(f"{'figure':14} {'one server':>24} {'1P1D':>24} {'1P1D / one':>22}")
    for key, _ in FIGURES:
        cells = [summary["one server"][key], summary["1P1D"][key], ratios[key]]
        print(f"{key:14} " + " ".join(
            f"{c['median']:>9.2f} ({c['min']:.2f}-{c['max']:.2f})".rjust(24) for c in cells))
    for name, rows in runs.items():
        parts = {k: spread([r[k] for r in rows]) for k in rows[0]
                 if k.endswith("_ttft_mean_ms")}
        print(f"{name}: mean TTFT, median over rounds: " + ", ".join(
            f"{k.removesuffix('_ttft_mean_ms')} {v['median']:.0f} ms ({v['min']:.0f}-{v['max']:.0f})"
            for k, v in parts.items()))
    print("one server's own prefix cache per round (hit / queried tokens):",
          [(r["prefix_cache_hit_tokens"], r["prefix_cache_queried_tokens"])
           for r in runs["one server"]])
    print("consumer hand-offs per round:", handoffs)


if __name__ == "__main__":
    main()
