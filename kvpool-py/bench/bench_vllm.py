"""TTFT and throughput of vLLM (CPU build) on a repeated 8K-token prefix: recompute, kvpool
(L1 only; disk only in a fresh process; and a different suffix after the prefix), vLLM's
own ExampleConnector, and the floor: vLLM's own prefix cache with the blocks still resident.
Each configuration runs in a fresh process.

    python bench_vllm.py --out results.json [--prefix 8192 --repeats 5]

With ``--hybrid`` it measures a Gemma-3-shaped model (sliding-window and full-attention
layers, window 1024) under vLLM's hybrid KV cache manager against the same with the manager
forced off (``disable_hybrid_kv_cache_manager``): KV bytes kvpool stores per 1K tokens, and the
TTFT of the repeated prefix served from disk in a fresh process, interleaved pairs.

With ``--daemon`` it measures the node's pool daemon (``kvpool serve``, the command named by
KVPOOL_BIN) instead: TTFT on the 8K prefix through the daemon against the in-process pool, and
the combined hit rate of two engine processes sharing one daemon against two private pools.

Run through `cargo xtask bench-vllm`, which builds a release wheel first.
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
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 4)))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    if spec["connector"] == "kvpool":
        extra = {"config": spec["kvpool"], **spec.get("kvpool_options", {})}
        if spec.get("pool"):
            extra["pool"] = spec["pool"]
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvpoolConnector", kv_connector_module_path="kvpool.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra)
    elif spec["connector"] == "example":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": spec["example_path"]})
    if spec.get("disable_hma"):
        kwargs["disable_hybrid_kv_cache_manager"] = True
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
              dtype="float32", block_size=32, max_model_len=spec["max_model_len"],
              # One-step prefills for every configuration (ExampleConnector saves a partial
              # prompt under the whole prompt's name when a prefill is split).
              max_num_batched_tokens=spec["max_model_len"],
              enable_prefix_caching=spec.get("prefix_caching", False),
              distributed_executor_backend="uni", seed=0,
              **kwargs)
    one = SamplingParams(temperature=0, detokenize=False, ignore_eos=True, max_tokens=1)
    many = SamplingParams(temperature=0, detokenize=False, ignore_eos=True, max_tokens=16)
    out = {"ttft_s": [], "warm": []}
    for p in spec.get("warm", []):
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)
        out["warm"].append(time.perf_counter() - t0)
    for p in spec.get("measure", []):
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)
        out["ttft_s"].append(time.perf_counter() - t0)
        out.setdefault("cached", []).append(res[0].num_cached_tokens)
    if spec.get("serve"):
        # Driven by the bench, one prompt at a time (`paired_target`): each request's TTFT
        # and cached tokens go back as soon as it finishes.
        from multiprocessing.connection import Listener

        with Listener(spec["serve"], authkey=b"kvpool-bench") as listener, \
                listener.accept() as conn:
            while (prompt := conn.recv()) is not None:
                t0 = time.perf_counter()
                res = llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
                conn.send((time.perf_counter() - t0, res[0].num_cached_tokens))
    if spec.get("throughput"):
        batch = [{"prompt_token_ids": p} for p in spec["throughput"]]
        t0 = time.perf_counter()
        llm.generate(batch, many, use_tqdm=False)
        out["throughput_rps"] = len(batch) / (time.perf_counter() - t0)
    if spec["connector"] == "kvpool":
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            ensure_kv_transfer_shutdown, get_kv_transfer_group, has_kv_transfer_group)

        work = get_kv_transfer_group()._work if has_kv_transfer_group() else None
        if work is not None:
            out["stats"] = work.native_stats() if hasattr(work, "native_stats") \
                else dict(work.native.stats())
        ensure_kv_transfer_shutdown()
    with open(out_path, "w") as f:
        json.dump(out, f)


def start_engine(spec, scratch, name):
    """Starts one engine process; returns it and where its results will be."""
    spec_path = os.path.join(scratch, f"{name}.spec.json")
    out_path = os.path.join(scratch, f"{name}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    with open(os.path.join(scratch, f"{name}.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, __file__, "--engine", spec_path, out_path],
                                stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return proc, out_path


def finish_engine(started):
    proc, out_path = started
    if proc.wait() != 0:
        raise RuntimeError(f"engine failed ({proc.returncode}); log next to {out_path}")
    with open(out_path) as f:
        return json.load(f)


def run_engine(spec, scratch, name):
    return finish_engine(start_engine(spec, scratch, name))


def print_rows(rows, reference):
    """The TTFT table, each row against the row named `reference`."""
    ref = statistics.median(rows[reference]["ttft_s"])
    print(f"\n{'configuration':44} {'TTFT median':>12} {'vs ' + reference[:20]:>24}"
          f" {'cached tokens':>14}")
    summary = {}
    for name, r in rows.items():
        med = statistics.median(r["ttft_s"])
        summary[name] = {"ttft_median_s": med, "ttft_s": r["ttft_s"], "ratio": med / ref,
                         "cached_tokens": r.get("cached")}
        cached = r.get("cached") or [None]
        print(f"{name:44} {med:11.3f}s {med / ref:23.2f}x {cached[-1]!s:>14}")
    return summary


class ServedEngine:
    """An engine process the bench drives one prompt at a time (over a local socket)."""

    def __init__(self, spec, scratch, name):
        from multiprocessing.connection import Client

        address = os.path.join(scratch, f"{name}.sock")
        self.started = start_engine({**spec, "serve": address}, scratch, name)
        deadline = time.time() + 600
        while True:
            try:
                self.conn = Client(address, authkey=b"kvpool-bench")
                return
            except (FileNotFoundError, ConnectionRefusedError):
                if self.started[0].poll() is not None or time.time() > deadline:
                    self.started[0].kill()
                    raise RuntimeError(f"engine {name} never listened; its log is in {scratch}")
                time.sleep(0.2)

    def run(self, prompt, timeout=600):
        """Sends one prompt and waits for its (TTFT in seconds, cached tokens)."""
        self.conn.send(prompt)
        if not self.conn.poll(timeout):
            raise RuntimeError(f"engine {self.started[1]} gave no answer in {timeout} s")
        return self.conn.recv()

    def stop(self):
        """Asks the engine to finish; kills it if that fails (it died, or hangs)."""
        proc = self.started[0]
        try:
            self.conn.send(None)
            self.conn.close()
            proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def paired_target(a, base, scratch, daemon, unrelated):
    """The 1.2x target side by side: three engine processes alive at once, driven one request
    at a time. For each pair a new prefix; the in-process engine computes it, then serves it
    again from its L1; engine A computes it and saves it into the daemon, then the warm engine
    B serves it from the daemon. The two measured requests run back to back, in alternating
    order, so both sides of each pair see the same machine; the target is the median of the
    pairs' ratios, over the pairs where both requests were full hits."""
    r = random.Random(1)  # its own prompts: the rows after it keep theirs
    # Three engines and a daemon at once: 1 GiB of vLLM blocks and of L1 each (an 8K prompt's
    # KV is 66 MiB here), so that they fit this machine's memory together.
    small = {"local_cpu": {"max_size": "1GiB"}}
    engines = {}
    try:
        for name, extra in [("inproc", {}), ("daemon-a", {"pool": daemon.url}),
                            ("daemon-b", {"pool": daemon.url})]:
            engines[name] = ServedEngine(
                {**base, "connector": "kvpool", "kvpool": small, **extra, "kv_cache_gib": 1,
                 "warm": [unrelated]}, scratch, f"paired-{name}")
        # B's first load from the daemon, and the in-process engine's first L1 hit, are part
        # of the warm-up (as in the rows below).
        chunks = (a.prefix + 64) // 256  # whole chunks of the connector's default 256 tokens
        first = [r.randrange(3, 999) for _ in range(a.prefix + 64)]
        before = daemon.stats().get("commits_total", 0)
        engines["daemon-a"].run(first)
        daemon.wait(lambda s: s.get("commits_total", 0) >= before + chunks,
                    "A's warm-up committed")
        engines["daemon-b"].run(first)
        engines["inproc"].run(first)
        engines["inproc"].run(first)
        pairs = []
        for i in range(a.pairs):
            prompt = [r.randrange(3, 999) for _ in range(a.prefix + 64)]
            engines["inproc"].run(prompt)
            before = daemon.stats().get("commits_total", 0)
            engines["daemon-a"].run(prompt)
            daemon.wait(lambda s: s.get("commits_total", 0) >= before + chunks,
                        f"A's prefix {i} committed")
            order = ["inproc", "daemon-b"] if i % 2 == 0 else ["daemon-b", "inproc"]
            got = {name: engines[name].run(prompt) for name in order}
            pairs.append({"l1_s": got["inproc"][0], "daemon_s": got["daemon-b"][0],
                          "l1_cached": got["inproc"][1], "daemon_cached": got["daemon-b"][1],
                          "daemon_first": order[0] == "daemon-b"})
    finally:
        for e in engines.values():
            e.stop()
    # A pair where the two requests did not hit the same tokens, every whole chunk at least
    # (the daemon's commits were counted early, say), does not measure the target: left out,
    # and counted.
    full = [p for p in pairs if p["l1_cached"] == p["daemon_cached"] >= chunks * 256]
    if not full:
        raise RuntimeError(f"no pair was a full hit on both sides: {pairs}")
    ratios = [p["daemon_s"] / p["l1_s"] for p in full]
    l1 = statistics.median(p["l1_s"] for p in full)
    via_daemon = statistics.median(p["daemon_s"] for p in full)
    result = {"pairs": pairs, "full_pairs": len(full), "ratios": ratios,
              "l1_median_s": l1, "daemon_median_s": via_daemon,
              "ratio_of_medians": via_daemon / l1, "median_ratio": statistics.median(ratios),
              "within_target": sum(x <= 1.2 for x in ratios)}
    print(f"\nside by side, {len(full)} pairs with full hits of {a.pairs} "
          f"(a new {a.prefix}-token prefix each):")
    print(f"  in-process L1 hit, same prompt            median {l1:.3f}s")
    print(f"  daemon, warm process, computed by another median {via_daemon:.3f}s")
    print(f"  ratio per pair: {', '.join(f'{x:.2f}' for x in ratios)}")
    print(f"  median of the pairs' ratios: {result['median_ratio']:.2f}x; ratio of the medians: "
          f"{result['ratio_of_medians']:.2f}x; pairs within 1.2x: {result['within_target']} "
          f"(target: within 1.2x)")
    return result


def daemon_bench(a, base, scratch, r, prefix, warm, unrelated):
    """The pool daemon against the in-process pool: TTFT on the repeated prefix (the daemon
    serving a fresh process, whose own L1 is empty), and the combined hit rate of two engine
    processes running at once on a shared-prefix workload."""
    from pool_daemon import PoolDaemon

    l1 = {"local_cpu": {"max_size": "4GiB"}}
    daemon = PoolDaemon(scratch, "paired-daemon", size="2GiB")
    try:
        paired = paired_target(a, base, scratch, daemon, unrelated)
    finally:
        daemon.stop()
    if a.paired_only:
        return {"paired": paired}
    rows = {}
    rows["in-process pool (L1), same prompt"] = run_engine(
        {**base, "connector": "kvpool", "kvpool": l1, "warm": [unrelated, warm],
         "measure": [warm] * a.repeats}, scratch, "inproc-l1")
    daemon = PoolDaemon(scratch, "daemon", size="8GiB")
    try:
        via = {**base, "connector": "kvpool", "kvpool": l1, "pool": daemon.url}
        rows["daemon, same process (its own save)"] = run_engine(
            {**via, "warm": [unrelated, warm], "measure": [warm] * a.repeats}, scratch,
            "daemon-same")
        fresh = [run_engine({**via, "warm": [unrelated], "measure": [warm]}, scratch,
                            f"daemon-fresh-{i}") for i in range(a.repeats)]
        rows["daemon, fresh process (from shared memory)"] = {
            "ttft_s": [f["ttft_s"][0] for f in fresh], "cached": [f["cached"][0] for f in fresh]}
        # A warm process loading prefixes another process computed: its first load from the
        # daemon (of another prefix) is part of the warm-up, so each measured request is a
        # daemon load and nothing else is a first.
        others = [[r.randrange(3, 999) for _ in range(a.prefix + 64)]
                  for _ in range(a.repeats + 1)]
        run_engine({**via, "measure": others}, scratch, "daemon-store-others")
        rows["daemon, warm process, computed by another"] = run_engine(
            {**via, "warm": [unrelated, others[0]], "measure": others[1:]}, scratch,
            "daemon-warm")
        disk_dir = os.path.join(scratch, "disk")
        disk = {"local_cpu": {"max_size": "512MiB"}, "tier": [{"url": f"file://{disk_dir}"}]}
        run_engine({**base, "connector": "kvpool", "kvpool": disk, "measure": [warm]}, scratch,
                   "disk-store")
        fresh = [run_engine({**base, "connector": "kvpool", "kvpool": disk,
                             "warm": [unrelated], "measure": [warm]}, scratch, f"disk-{i}")
                 for i in range(a.repeats)]
        rows["in-process pool, fresh process (from disk)"] = {
            "ttft_s": [f["ttft_s"][0] for f in fresh], "cached": [f["cached"][0] for f in fresh]}
        summary = print_rows(rows, "in-process pool (L1), same prompt")

        # Two instances at once, as behind a round-robin balancer: 5 prefixes of 2K tokens, 4
        # requests each, the i-th request to instance i % 2 (an odd number of prefixes, so
        # each instance sees every prefix twice).
        prefixes = [[r.randrange(3, 999) for _ in range(2048)] for _ in range(5)]
        requests = [p + [r.randrange(3, 999) for _ in range(64)] for _ in range(4)
                    for p in prefixes]
        halves = [requests[0::2], requests[1::2]]
        assert all(len({tuple(q[:2048]) for q in h}) == len(prefixes) for h in halves)
        hit = {}
        for label, extra in [("two private pools", {}), ("one daemon", {"pool": daemon.url})]:
            small = {"local_cpu": {"max_size": "2GiB"}}
            started = [start_engine({**base, "connector": "kvpool", "kvpool": small, **extra,
                                     "warm": [unrelated], "measure": half}, scratch,
                                    f"hit-{label.replace(' ', '-')}-{i}")
                       for i, half in enumerate(halves)]
            outs = [finish_engine(s) for s in started]
            cached = sum(sum(o["cached"]) for o in outs)
            total = sum(len(p) for p in requests)
            hit[label] = {"cached_tokens": cached, "prompt_tokens": total,
                          "hit_rate": cached / total}
        print(f"\n{'two engine processes at once':30} {'hit rate':>9} {'cached tokens':>14}")
        for label, h in hit.items():
            print(f"{label:30} {h['hit_rate']:9.3f} {h['cached_tokens']:14}")
        return {"paired": paired, "ttft": summary, "hit_rate": hit,
                "daemon_stats": daemon.stats()}
    finally:
        daemon.stop()


def hybrid_bench(a, scratch, r):
    """``--hybrid``: see the module docs."""
    from make_hybrid_model import make_gemma3_model

    model = make_gemma3_model(os.path.join(scratch, "gemma3-w1024"), sliding_window=1024)
    prefix = [r.randrange(3, 999) for _ in range(a.prefix)]
    prompt = prefix + [r.randrange(3, 999) for _ in range(64)]
    unrelated = [r.randrange(3, 999) for _ in range(512)]
    base = {"model": model, "max_model_len": a.prefix + 256}
    modes = {"HMA on": {}, "HMA off": {"disable_hma": True}}
    rows = {name: {"ttft_s": [], "cached": [], "bytes_per_1k": []} for name in modes}
    rows["recompute (HMA on, no connector)"] = {"ttft_s": [], "cached": []}
    for i in range(a.repeats):
        for name, extra in modes.items():
            disk = {"local_cpu": {"max_size": "512MiB"},
                    "tier": [{"url": f"file://{scratch}/disk-{i}-{len(extra)}"}]}
            spec = {**base, **extra, "connector": "kvpool", "kvpool": disk}
            stored = run_engine({**spec, "measure": [prompt]}, scratch, f"store-{i}-{len(extra)}")
            stats = stored["stats"]
            total = sum(v for k, v in stats.items() if k.endswith("stored_bytes"))
            rows[name]["bytes_per_1k"].append(total * 1000 / len(prompt))
            fresh = run_engine({**spec, "warm": [unrelated], "measure": [prompt]}, scratch,
                               f"fresh-{i}-{len(extra)}")
            rows[name]["ttft_s"].append(fresh["ttft_s"][0])
            rows[name]["cached"].append(fresh["cached"][0])
        rec = run_engine({**base, "connector": None, "warm": [unrelated], "measure": [prompt]},
                         scratch, f"recompute-{i}")
        rows["recompute (HMA on, no connector)"]["ttft_s"].append(rec["ttft_s"][0])
        rows["recompute (HMA on, no connector)"]["cached"].append(rec["cached"][0])
    summary = print_rows(rows, "HMA off")
    for name in modes:
        b = rows[name]["bytes_per_1k"]
        summary[name]["bytes_per_1k_tokens"] = b
        print(f"{name}: {statistics.median(b) / 2**20:.2f} MiB stored per 1K tokens")
    return {"prefix_tokens": a.prefix, "sliding_window": 1024, "rows": summary}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scratch", default=None)
    ap.add_argument("--daemon", action="store_true",
                    help="measure the pool daemon (kvpool serve) instead")
    ap.add_argument("--pairs", type=int, default=10,
                    help="with --daemon: requests per side in the side-by-side target")
    ap.add_argument("--hybrid", action="store_true",
                    help="a Gemma-3-shaped model, hybrid KV cache manager on against off")
    ap.add_argument("--paired-only", action="store_true",
                    help="with --daemon: only the side-by-side target")
    a = ap.parse_args()
    from make_model import make_model

    scratch = a.scratch or tempfile.mkdtemp(prefix="kvpool-bench-vllm-")
    if a.hybrid:
        result = hybrid_bench(a, scratch, random.Random(0))
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
        return
    model = make_model(os.path.join(scratch, "llama-512x4"), hidden=512, layers=4, heads=8,
                       kv_heads=4, intermediate=1408, seed=0)
    r = random.Random(0)
    prefix = [r.randrange(3, 999) for _ in range(a.prefix)]
    suffix = lambda: [r.randrange(3, 999) for _ in range(64)]  # noqa: E731
    warm = prefix + suffix()
    other = [prefix + suffix() for _ in range(a.repeats)]
    batch = [prefix + suffix() for _ in range(8)]
    max_len = a.prefix + 256
    base = {"model": model, "max_model_len": max_len}
    l1 = {"local_cpu": {"max_size": "4GiB"}}
    # Chunks of one vLLM block: only the tokens after the last whole block are recomputed.
    l1_small = {**l1, "chunking": {"chunk_size": 32}}
    disk_dir = os.path.join(scratch, "disk")
    disk = {"local_cpu": {"max_size": "512MiB"}, "tier": [{"url": f"file://{disk_dir}"}]}
    # A prompt that shares nothing with the measured ones: a fresh process's first request
    # pays one-off start-up costs, which it absorbs.
    unrelated = [r.randrange(3, 999) for _ in range(512)]
    if a.daemon:
        result = daemon_bench(a, base, scratch, r, prefix, warm, unrelated)
        with open(a.out, "w") as f:
            json.dump({"prefix_tokens": a.prefix, **result}, f, indent=2)
        return
    rows = {}
    # Recompute: every request pays the whole prefill.
    rows["recompute (no connector)"] = run_engine(
        {**base, "connector": None, "warm": [unrelated], "measure": [warm] * a.repeats,
         "throughput": batch},
        scratch, "recompute")
    # kvpool L1: one request stores the prefix, the same prompt again loads it.
    rows["kvpool L1, same prompt"] = run_engine(
        {**base, "connector": "kvpool", "kvpool": l1, "warm": [unrelated, warm],
         "measure": [warm] * a.repeats, "throughput": batch}, scratch, "kvpool-l1")
    rows["kvpool L1, other suffix"] = run_engine(
        {**base, "connector": "kvpool", "kvpool": l1, "warm": [unrelated, warm], "measure": other},
        scratch, "kvpool-l1-suffix")
    rows["kvpool L1 (32-token chunks), same prompt"] = run_engine(
        {**base, "connector": "kvpool", "kvpool": l1_small, "warm": [unrelated, warm],
         "measure": [warm] * a.repeats, "throughput": batch}, scratch, "kvpool-l1-32")
    # kvpool disk: a first process stores, then fresh processes (L1 empty) load from disk, one
    # request each.
    run_engine({**base, "connector": "kvpool", "kvpool": disk, "measure": [warm]}, scratch,
               "kvpool-disk-store")
    fresh = [run_engine({**base, "connector": "kvpool", "kvpool": disk, "warm": [unrelated],
                         "measure": [warm]}, scratch, f"kvpool-disk-{i}")
             for i in range(a.repeats)]
    rows["kvpool disk only, fresh process"] = {
        "ttft_s": [f["ttft_s"][0] for f in fresh], "cached": [f["cached"][0] for f in fresh]}
    # vLLM's ExampleConnector (safetensors files): exact prompt repeats only.
    ex_dir = os.path.join(scratch, "example")
    os.makedirs(ex_dir, exist_ok=True)
    rows["vLLM ExampleConnector, same prompt"] = run_engine(
        {**base, "connector": "example", "example_path": ex_dir, "warm": [unrelated, warm],
         "measure": [warm] * a.repeats, "throughput": batch}, scratch, "example")
    # The floor: vLLM's own prefix cache with the blocks still resident (no copy at all).
    rows["vLLM prefix cache, blocks resident"] = run_engine(
        {**base, "connector": None, "prefix_caching": True, "warm": [unrelated, warm],
         "measure": [warm] * a.repeats}, scratch, "prefix-cache")
    summary = {}
    rec = statistics.median(rows["recompute (no connector)"]["ttft_s"])
    print(f"\n{'configuration':40} {'TTFT median':>12} {'vs recompute':>13} {'req/s (8)':>10}"
          f" {'cached tokens':>14}")
    for name, r in rows.items():
        med = statistics.median(r["ttft_s"])
        summary[name] = {"ttft_median_s": med, "ttft_s": r["ttft_s"],
                         "speedup": rec / med, "throughput_rps": r.get("throughput_rps"),
                         "cached_tokens": r.get("cached")}
        tp = r.get("throughput_rps")
        cached = r.get("cached") or [None]
        print(f"{name:40} {med:11.3f}s {rec / med:12.1f}x {tp if tp is None else round(tp, 2)!s:>10}"
              f" {cached[-1]!s:>14}")
    with open(a.out, "w") as f:
        json.dump({"prefix_tokens": a.prefix, "rows": summary}, f, indent=2)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        engine_main(sys.argv[2], sys.argv[3])
    else:
        main()
