"""How much of one contested CPU a nice-19 process takes from a nice-0 one, in the same
scheduling group and in another (its own session, so its own autogroup; a systemd service's
cgroup acts the same way): why `kvpool serve`'s low-priority write-behind paces itself.

    python3 kvpool-py/bench/nice_across_groups.py [--seconds 3] [--runs 5] [--cpu 0]

Two busy loops, both bound to one CPU, run side by side: an "engine" at nice 0 and a
"background" at nice 19. Prints, per run and as medians, the background's share of the
loop iterations. Linux only (`os.sched_setaffinity`); `/proc/sys/kernel/sched_autogroup_enabled`
says whether sessions are groups here.
"""

import argparse
import os
import statistics
import subprocess
import sys

SPIN = """
import os, sys, time
os.sched_setaffinity(0, {%d})
os.setpriority(os.PRIO_PROCESS, 0, %d)
end = time.monotonic() + %f
n = 0
while time.monotonic() < end:
    n += 1
print(n)
"""


def share(cpu, seconds, engine_apart):
    """The nice-19 loop's share of both loops' iterations; with `engine_apart`, the nice-0
    loop in a session of its own (as `vllm serve` in bench_serve.py) and the nice-19 one in
    this script's (as its `kvpool serve`), else both in this script's session."""
    engine = subprocess.Popen([sys.executable, "-c", SPIN % (cpu, 0, seconds)],
                              stdout=subprocess.PIPE, start_new_session=engine_apart)
    background = subprocess.Popen([sys.executable, "-c", SPIN % (cpu, 19, seconds)],
                                  stdout=subprocess.PIPE)
    e = int(engine.communicate()[0])
    b = int(background.communicate()[0])
    return b / (e + b)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cpu", type=int, default=0)
    a = ap.parse_args()
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            print("sched_autogroup_enabled:", f.read().strip())
    except OSError:
        print("sched_autogroup_enabled: (not readable)")
    results = {"one session": [], "two sessions": []}
    for _ in range(a.runs):  # interleaved
        results["one session"].append(share(a.cpu, a.seconds, engine_apart=False))
        results["two sessions"].append(share(a.cpu, a.seconds, engine_apart=True))
    for name, shares in results.items():
        runs = " ".join(f"{s:.1%}" for s in shares)
        print(f"nice-19 loop's share of CPU {a.cpu} against a nice-0 loop, {name}: median "
              f"{statistics.median(shares):.1%} [{min(shares):.1%}-{max(shares):.1%}] ({runs})")


if __name__ == "__main__":
    main()
