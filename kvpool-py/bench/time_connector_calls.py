"""Where a hit's TTFT goes: the connector's calls timed inside vLLM (CPU build), an in-process
L1 hit against a hit from the pool daemon and from the disk tier in a fresh process, in one
run.

    cargo xtask bench-vllm --daemon   # once: installs the release wheel, builds `kvpool serve`
    KVPOOL_BIN=target/release/kvpool HF_HUB_OFFLINE=1 \\
        target/vllm-venv/bin/python kvpool-py/bench/time_connector_calls.py [--disk-only] [--rounds N]
    HF_HUB_OFFLINE=1 target/vllm-venv/bin/python kvpool-py/bench/time_connector_calls.py \\
        --miss [--rounds N] [--prompts N]   # what a miss costs (see ``miss_cost``)

Same model and engine settings as bench_vllm.py. Each engine process serves five 8K-token
prefixes (an L1 hit: the same prompt again; the daemon: prefixes another process computed)
and prints, per connector call, its slowest twelve durations in milliseconds (the measured
requests and the warm-up; the other calls of a process take well under a millisecond), each
call's count and total, and the CPU seconds of each of the process's threads.
"""

import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

CALLS = {
    "connector": ["get_num_new_matched_tokens", "build_connector_meta", "start_load_kv",
                  "wait_for_save"],
    "worker_side": ["bind", "start_load", "save"],
    "transfer": ["run"],
}


#: The native worker's calls timed (``native.<name>``): a load's check of chunks copied from
#: node memory starts in ``copy_done`` and is waited for in ``save_jobs``; ``run_copies``
#: runs a step's copies on the native copy path (loads before the forward pass, saves after).
TIMED_NATIVE = ("copy_done", "save_jobs", "failed_blocks", "run_copies", "poll_copies",
                "settle_copies", "transfer_results", "step_report")


def timing(f, label, times):
    """``f`` with each call's duration appended to ``times[label]``; its signature is
    ``f``'s (kvpool checks the connector's signatures against vLLM's at start-up)."""
    @functools.wraps(f)
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            times.setdefault(label, []).append(time.perf_counter() - t)
    return timed


def engine(spec_path, out_path):
    """One engine process (bench_vllm's), its connector calls timed."""
    import atexit

    import bench_vllm
    from kvpool import transfer
    from kvpool.vllm import connector, worker_side

    times = {}
    classes = {"connector": connector.KvpoolConnector, "worker_side": worker_side.WorkerSide,
               "transfer": transfer.BlockMover}
    for module, names in CALLS.items():
        cls = classes[module]
        for name in names:
            setattr(cls, name, timing(getattr(cls, name), f"{module}.{name}", times))

    class TimedNative:
        """The native worker, its calls in ``TIMED_NATIVE`` timed."""

        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            f = getattr(self._inner, name)
            if name not in TIMED_NATIVE:
                return f

            def timed(*a, **k):
                t = time.perf_counter()
                try:
                    return f(*a, **k)
                finally:
                    times.setdefault(f"native.{name}", []).append(time.perf_counter() - t)
            return timed

    init = worker_side.WorkerSide.__init__

    def timed_init(self, *a, **k):
        init(self, *a, **k)
        self.native = TimedNative(self.native)
    worker_side.WorkerSide.__init__ = timed_init
    atexit.register(lambda: print("THREADS " + json.dumps(thread_cpu_seconds())))
    atexit.register(lambda: print("SUMS " + json.dumps(
        {k: [len(v), round(sum(v) * 1e3, 1)] for k, v in times.items()})))
    atexit.register(lambda: print("TIMES " + json.dumps(
        {k: [round(x * 1e3, 2) for x in sorted(v)[-12:]] for k, v in times.items()})))
    # The loads' calls in the order they ran (the measured requests' are the last ones).
    atexit.register(lambda: print("ORDER " + json.dumps(
        {k: [round(x * 1e3, 1) for x in v if x > 1e-3][-12:] for k, v in times.items()
         if k in ("worker_side.bind", "worker_side.start_load")})))
    bench_vllm.engine_main(spec_path, out_path)


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) this process's live threads used, summed by thread name
    (``/proc/self/task/*/stat``; threads that already ended are not counted)."""
    tick = os.sysconf("SC_CLK_TCK")
    used: dict[str, float] = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        used[name] = used.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return {k: round(v, 2) for k, v in sorted(used.items(), key=lambda kv: -kv[1])}


def run(spec, scratch, name):
    spec_path = os.path.join(scratch, f"{name}.spec.json")
    out_path = os.path.join(scratch, f"{name}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    done = subprocess.run([sys.executable, __file__, "--engine", spec_path, out_path],
                          capture_output=True, text=True, check=True)
    with open(out_path) as f:
        out = json.load(f)
    print(f"{name}: TTFT {[round(x, 3) for x in out['ttft_s']]}, "
          f"median {statistics.median(out['ttft_s']):.3f} s")
    for line in done.stdout.splitlines():
        if line.startswith("TIMES "):
            for call, ms in json.loads(line[6:]).items():
                print(f"  {call:45} {ms}")
        if line.startswith("SUMS "):
            for call, (n, ms) in json.loads(line[5:]).items():
                print(f"  {call + ', calls and total ms':45} {n} {ms}")
        if line.startswith("THREADS "):
            print(f"  CPU seconds by thread: {line[8:]}")
        if line.startswith("ORDER "):
            for call, ms in json.loads(line[6:]).items():
                print(f"  {call + ', in order, over 1 ms':45} {ms}")
    return out


#: The disk rows: when a load from a lower tier runs (``async_loads``), one fresh process each.
DISK_ROWS = (
    ({"async_loads": "always"}, "every load in the background (the default until 2026-11-28)"),
    ({}, "the default (before the forward pass while nothing else runs)"),
    ({"async_loads": False}, "every load before the forward pass"),
)


def miss_cost(base, scratch, rounds, prompts_per_round):
    """``--miss``: what a miss costs. Fresh processes, one request at a time (2,048 new tokens,
    one output token: its time is the prefill and what kvpool does in the same steps), with no
    connector, kvpool's L1 and kvpool's disk tier (a fresh directory each round), the order
    reversed each round; each process's connector calls and CPU seconds by thread."""
    r = random.Random(2)
    base = {**base, "max_model_len": 4096}
    medians: dict[str, list[float]] = {}
    for round_ in range(rounds):
        warm = [[r.randrange(3, 999) for _ in range(2048)]]
        prompts = [[r.randrange(3, 999) for _ in range(2048)] for _ in range(prompts_per_round)]
        rows = [("no connector", {"connector": "none"}),
                ("kvpool L1", {"connector": "kvpool", "kvpool": {"local_cpu": {"max_size": "4GiB"}}}),
                ("kvpool disk", {"connector": "kvpool", "kvpool": {
                    "local_cpu": {"max_size": "64MiB"},
                    "tier": [{"url": f"file://{os.path.join(scratch, f'disk-{round_}')}"}]}})]
        if round_ % 2:
            rows.reverse()
        for label, spec in rows:
            out = run({**base, **spec, "warm": warm, "measure": prompts}, scratch,
                      f"miss, {label}, round {round_}")
            medians.setdefault(label, []).append(statistics.median(out["ttft_s"]))
    print("medians of each process's per-request median (range), and vs no connector:")
    ref = statistics.median(medians["no connector"])
    for label, m in medians.items():
        print(f"  {label:15} {statistics.median(m):.3f} s ({min(m):.3f}-{max(m):.3f})"
              f"  {statistics.median(m) / ref:.2f}x")


def main():
    import argparse

    import bench_vllm
    from make_model import make_model
    from pool_daemon import PoolDaemon

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--disk-only", action="store_true",
                        help="only the disk rows (no L1 or daemon rows; no KVPOOL_BIN needed)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="the disk rows (with --miss: the miss rows) this many times, their "
                             "order reversed each round")
    parser.add_argument("--miss", action="store_true",
                        help="only the cost of a miss: no connector, L1 and disk, each request new")
    parser.add_argument("--prompts", type=int, default=12, help="--miss: requests per process")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="kvpool-time-calls-")
    model = make_model(os.path.join(scratch, "llama-512x4"), hidden=512, layers=4, heads=8,
                       kv_heads=4, intermediate=1408, seed=0)
    r = random.Random(0)
    base = {"model": model, "max_model_len": 8192 + 256}
    if args.miss:
        miss_cost(base, scratch, args.rounds, args.prompts)
        return
    l1 = {"local_cpu": {"max_size": "4GiB"}}
    unrelated = [r.randrange(3, 999) for _ in range(512)]
    prompts = [[r.randrange(3, 999) for _ in range(8192 + 64)] for _ in range(11)]
    if not args.disk_only:
        run({**base, "connector": "kvpool", "kvpool": l1, "warm": [unrelated, prompts[0]],
             "measure": [prompts[0]] * 5}, scratch, "in-process L1, same prompt")
        daemon = PoolDaemon(scratch, "daemon", size="8GiB")
        try:
            via = {**base, "connector": "kvpool", "kvpool": l1, "pool": daemon.url}
            bench_vllm.run_engine({**via, "measure": prompts[:6]}, scratch, "store")
            run({**via, "warm": [unrelated, prompts[0]], "measure": prompts[1:6]}, scratch,
                "daemon, warm process, computed by another")
        finally:
            daemon.stop()
    # The disk tier read by a fresh process (its L1 empty), as bench_vllm's disk row, one
    # request at a time (so nothing else runs while a request loads); ten prompts, to see the
    # first ones' cost. A load before the forward pass has its whole fetch inside
    # worker_side.bind, so timed there.
    disk = {"local_cpu": {"max_size": "512MiB"},
            "tier": [{"url": f"file://{os.path.join(scratch, 'disk')}"}]}
    bench_vllm.run_engine({**base, "connector": "kvpool", "kvpool": disk, "measure": prompts},
                          scratch, "disk-store")
    medians = {}
    for round_ in range(args.rounds):
        rows = DISK_ROWS if round_ % 2 == 0 else DISK_ROWS[::-1]
        for options, label in rows:
            out = run({**base, "connector": "kvpool", "kvpool": disk, "kvpool_options": options,
                       "warm": [unrelated], "measure": prompts[1:]}, scratch,
                      f"disk, fresh process, {label}")
            medians.setdefault(label, []).append(statistics.median(out["ttft_s"]))
    if args.rounds > 1:
        print("medians of each process's TTFT median, over the rounds (range):")
        for label, m in medians.items():
            print(f"  {label:65} {statistics.median(m):.3f} s ({min(m):.3f}-{max(m):.3f})")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--engine":
        engine(sys.argv[2], sys.argv[3])
    else:
        main()
