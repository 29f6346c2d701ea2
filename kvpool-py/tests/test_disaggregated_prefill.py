"""Disaggregated prefill through the pool, as an operator runs it: a prefill `vllm serve`
(`kv_role` `kv_producer`) and a decode `vllm serve` (`kv_consumer`) sharing a tier (the node's
pool daemon; Redis, the cross-node case, behind each instance's own L1), driven over HTTP
through `python -m kvpool.disagg_proxy`. Each request reaches the decode instance the moment
the prefill instance answers (the hand-off must be waited for, not missed); the decode instance
loads the prompt and computes at most its last block; outputs equal an engine doing both; with
the shared tier killed, requests complete by recomputation. The Redis pair starts its engine
processes as an operator's `vllm serve` does (spawned, on the CPU build); the pool-daemon pair
forks them (`vllm_cli_forked.py`, CI's time budget)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import shared_prefix_prompts
from pool_daemon import PoolDaemon
from redis_server import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))

import bench_serve  # noqa: E402

BLOCK = bench_serve.BLOCK
MAX_TOKENS = 6


#: vLLM's command line with its EngineCore and worker forked (``vllm_cli_forked.py``).
VLLM_CLI_FORKED = [sys.executable, os.path.join(HERE, "vllm_cli_forked.py")]


class Serve:
    """`vllm serve` on loopback with kvpool in `role`, pinned to one core, stopped by PID; its
    engine's processes spawned as the CPU build starts them, or forked (``forked``)."""

    def __init__(self, model, role, shared, scratch, core, forked=False):
        self.port = free_port()
        self.log = open(os.path.join(scratch, f"serve-{role}.log"), "w")
        transfer = {"kv_connector": "KvpoolConnector", "kv_connector_module_path": "kvpool.vllm",
                    "kv_role": role, "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {
                        **shared, "lookup_timeout_ms": 2000, "handoff_timeout_ms": 5000}}
        cli = VLLM_CLI_FORKED if forked else bench_serve.VLLM_CLI
        args = [*cli, "serve", model, "--host", "127.0.0.1",
                "--port", str(self.port), "--dtype", "float32", "--block-size", str(BLOCK),
                "--enforce-eager", "--seed", "0", "--max-model-len", "2048",
                "--kv-transfer-config", json.dumps(transfer)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout=600):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"vllm serve not ready after {timeout} s: {self.tail()}")

    def tail(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-6000:]

    def counter(self, name, le=None):
        """A Prometheus counter of this server, summed over its label sets (a histogram's
        bucket: those with ``le``)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            lines = r.read().decode().splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines
                   if (line.startswith(name + "{") or line.startswith(name + " "))
                   and (le is None or f'le="{le}"' in line))

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


class Proxy:
    """`python -m kvpool.disagg_proxy` between the two servers, stopped by PID."""

    def __init__(self, prefill, decode, scratch):
        self.port = free_port()
        self.log = open(os.path.join(scratch, "proxy.log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.disagg_proxy", "--prefill", prefill, "--decode",
             decode, "--port", str(self.port), "--timeout", "120"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise AssertionError("the proxy did not start")
                time.sleep(0.2)

    def complete(self, model, prompt):
        """Greedy completion of token ids `prompt`: the generated token ids."""
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                         data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:
            return json.loads(r.read())["choices"][0]["token_ids"]

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture
def pd_model(model_dir, scratch):
    """The test model with a word-level tokenizer (`vllm serve` needs one), in a copy: the
    shared model directory's weights digest stays as other tests know it."""
    path = os.path.join(scratch, "pd-model")
    if not os.path.exists(path):
        shutil.copytree(model_dir, path)
        bench_serve.make_tokenizer(path)
    return path


@pytest.fixture(params=["pool daemon", "redis"])
def shared_tier(request, scratch):
    """(the instances' shared kvpool options, the PID that kills the shared tier, whether the
    servers' engine processes are forked). With the pool daemon they are (each server starts
    ~70 s sooner: CI's time budget); with Redis they are spawned, as an operator's are."""
    l1 = {"local_cpu": {"max_size": "256MiB"}}
    if request.param == "pool daemon":
        daemon = PoolDaemon(scratch, "pd-daemon")
        yield {"pool": daemon.url, "config": l1}, daemon.pid, True
        daemon.stop()
    else:
        redis = request.getfixturevalue("redis_server")
        yield {"config": {**l1, "tier": [{"url": redis.url, "timeout_ms": 500}]}}, \
            redis.proc.pid, False


def test_prefill_and_decode_instances_hand_off_through_a_shared_tier(
        runner, pd_model, scratch, shared_tier):
    prompts = [p for seed in (41, 42) for p in shared_prefix_prompts(1, prefix_len=400,
                                                                      suffix_len=29, seed=seed)]
    # Ending on a chunk boundary (512 tokens): a lookup stops before the last token; the
    # producer keys the last chunk's blocks one by one too, so it is still served to its last
    # whole block.
    prompts += shared_prefix_prompts(1, prefix_len=500, suffix_len=12, seed=43)
    assert len(prompts[-1]) % 256 == 0
    late = shared_prefix_prompts(1, prefix_len=300, suffix_len=17, seed=44)[0]
    base = runner.baseline(pd_model, prompts + [late], max_tokens=MAX_TOKENS,
                           batches=[[0], [1], [2], [3]])
    shared, tier_pid, forked = shared_tier
    # One core each, as two hosts would have their own.
    prefill = Serve(pd_model, "kv_producer", shared, scratch, core=0, forked=forked)
    decode = Serve(pd_model, "kv_consumer", shared, scratch, core=1, forked=forked)
    proxy = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        proxy = Proxy(prefill.url, decode.url, scratch)
        for i, prompt in enumerate(prompts):
            assert proxy.complete(pd_model, prompt) == base["results"][i]["tokens"], i
        # Every request was handed off, and found whole: the decode instance loaded each
        # prompt up to its last block and computed the rest.
        assert prefill.counter("vllm:kvpool_handoffs_sent_total") == len(prompts)
        assert decode.counter("vllm:kvpool_handoffs_received_total") == len(prompts)
        assert decode.counter("vllm:kvpool_handoffs_complete_total") == len(prompts)
        loadable = sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)
        assert decode.counter("vllm:kvpool_loaded_tokens_total") == loadable
        assert decode.counter("vllm:kvpool_stored_tokens_total") == 0, "the consumer saved"
        assert decode.counter("vllm:kvpool_handoffs_timed_out_total") == 0
        assert decode.counter("vllm:kvpool_handoffs_mismatched_total") == 0, "scopes differ"
        # The shared tier dies: the producer's saves and the consumer's lookups fail; a hand-off
        # is waited for until handoff_timeout_ms, then the decode instance computes it all.
        os.kill(tier_pid, signal.SIGKILL)
        assert proxy.complete(pd_model, late) == base["results"][3]["tokens"]
        assert prefill.counter("vllm:kvpool_handoffs_sent_total") == len(prompts) + 1
        assert decode.counter("vllm:kvpool_handoffs_timed_out_total") == 1
        assert decode.counter("vllm:kvpool_handoff_wait_ms_total") >= 5000
        # Each wait is one observation of the histogram; the timed-out one past 5 s.
        waited = decode.counter("vllm:kvpool_handoffs_waited_total")
        assert waited >= 1
        assert decode.counter("vllm:kvpool_handoff_wait_seconds_count") == waited
        assert decode.counter("vllm:kvpool_handoff_wait_seconds_sum") >= 5
        assert decode.counter("vllm:kvpool_handoff_wait_seconds_bucket", le="2.0") == waited - 1
        assert decode.counter("vllm:kvpool_handoffs_complete_total") == len(prompts)
        assert decode.counter("vllm:kvpool_loaded_tokens_total") == loadable
    except AssertionError:
        print("prefill log:", prefill.tail(), "decode log:", decode.tail(), sep="\n")
        raise
    finally:
        if proxy is not None:
            proxy.stop()
        prefill.stop()
        decode.stop()
