"""Fixtures for kvpool's end-to-end tests against real vLLM (CPU build).

Each engine runs in a fresh process (``vllm_runner.py``), forked by ``engine_forkserver.py``
with vLLM already imported. Set ``KVPOOL_E2E_KEEP=1`` to keep the scratch directory.
"""

import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from make_model import make_mla_model, make_model  # noqa: E402
from pool_daemon import PoolDaemon  # noqa: E402
from redis_server import RedisServer, free_port  # noqa: E402,F401 - tests import free_port


@pytest.fixture(scope="session")
def scratch():
    d = tempfile.mkdtemp(prefix="kvpool-e2e-")
    yield d
    if not os.environ.get("KVPOOL_E2E_KEEP"):
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def model_dir(scratch):
    return make_model(os.path.join(scratch, "tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def mla_model_dir(scratch):
    """A DeepSeek-V2-shaped model (MLA: one latent per token, the same on every TP rank)."""
    return make_mla_model(os.path.join(scratch, "tiny-deepseek-mla"), seed=0)


@pytest.fixture(scope="session")
def other_model_dir(scratch):
    """Same architecture, other random weights: its KV is wrong for ``model_dir``."""
    return make_model(os.path.join(scratch, "tiny-llama-other"), seed=1)


def shared_prefix_prompts(n, prefix_len=1024, suffix_len=37, seed=1):
    """``n`` prompts: one random prefix, then different random suffixes."""
    r = random.Random(seed)
    prefix = [r.randrange(3, 999) for _ in range(prefix_len)]
    return [prefix + [r.randrange(3, 999) for _ in range(suffix_len)] for _ in range(n)]


class ForkServer:
    """Client of ``engine_forkserver.py``: runs scripts in children forked with vLLM imported.

    vLLM's import costs ~40 s per process on the CI machine; the server pays it once.
    """

    def __init__(self, scratch):
        self.log_path = os.path.join(scratch, "forkserver.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "engine_forkserver.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, bufsize=0,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        self.pending = b""
        if self._read(timeout=600) is None:
            self.proc.kill()
            raise AssertionError(f"the engine fork server did not start (log: {self.log_path})")

    def _read(self, timeout):
        """The server's next reply, or None when ``timeout`` seconds pass without one."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                with open(self.log_path) as f:
                    tail = f.read()[-6000:]
                raise AssertionError(
                    f"the engine fork server exited ({self.proc.wait()}):\n{tail}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, script, args, log_path, timeout):
        """Runs ``python script args...`` (output to ``log_path``); returns its exit code.

        A run past ``timeout`` seconds is killed with its whole process group and fails.
        """
        request = {"script": script, "args": args, "log": log_path,
                   "env": {**os.environ, "HF_HUB_OFFLINE": "1"}}
        data = (json.dumps(request) + "\n").encode()
        while data:
            data = data[self.proc.stdin.write(data):]
        pid = self._read(timeout=60)["pid"]
        done = self._read(timeout=timeout)
        if done is None:
            os.killpg(pid, signal.SIGKILL)
            self._read(timeout=60)
            raise AssertionError(f"{os.path.basename(script)} ran past {timeout} s (log: {log_path})")
        return done["exit"]

    def stop(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


class Runner:
    """Runs vLLM engines, each in a fresh process, and caches the no-kvpool baselines."""

    def __init__(self, scratch, forkserver):
        self.scratch = scratch
        self.forkserver = forkserver
        self.count = 0
        self.baselines = {}

    def run(self, spec, timeout=600, script="vllm_runner.py", expect_exit=0):
        """Runs one engine; its output, or None when it exited with ``expect_exit`` != 0 (a
        run that kills itself)."""
        self.count += 1
        spec_path = os.path.join(self.scratch, f"spec-{self.count}.json")
        out_path = os.path.join(self.scratch, f"out-{self.count}.json")
        log_path = os.path.join(self.scratch, f"run-{self.count}.log")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        started = time.time()
        returncode = self.forkserver.run(os.path.join(HERE, script), [spec_path, out_path],
                                         log_path, timeout)
        if returncode == expect_exit != 0:
            return None
        if returncode != 0:
            with open(log_path) as f:
                tail = f.read()[-6000:]
            raise AssertionError(f"vLLM run {self.count} failed ({returncode}):\n{tail}")
        with open(out_path) as f:
            out = json.load(f)
        out["wall_s"] = time.time() - started
        out["log"] = log_path
        return out

    def baseline(self, model, prompts, **kw):
        key = json.dumps([model, prompts, sorted(kw.items())])
        if key not in self.baselines:
            spec = {"model": model, "prompts": prompts, "kvpool": None, **kw}
            self.baselines[key] = self.run(spec)
        return self.baselines[key]


@pytest.fixture(scope="session")
def runner(scratch):
    server = ForkServer(scratch)
    yield Runner(scratch, server)
    server.stop()


class Stepper:
    """Runs ``stepping_runner.py`` (tokens timestamped as they arrive) through a Runner."""

    def __init__(self, runner):
        self.runner = runner

    def prime(self, model, prompt, kvpool):
        """Stores ``prompt``'s chunks through kvpool (an engine of its own)."""
        return self.runner.run({"model": model, "prompts": [prompt], "kvpool": kvpool,
                                "max_tokens": 1})

    def run(self, spec, timeout=600):
        return self.runner.run(spec, timeout=timeout, script="stepping_runner.py")


@pytest.fixture(scope="session")
def stepper(runner):
    return Stepper(runner)


@pytest.fixture
def redis_server(scratch):
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (cargo xtask vllm installs it)")
    server = RedisServer(scratch)
    yield server
    server.stop()


@pytest.fixture
def pool_daemon(scratch):
    """Starts `kvpool serve` daemons (``pool_daemon(name, tiers=[...])``); stops them after."""
    started = []

    def start(name="daemon", **kw):
        daemon = PoolDaemon(scratch, name, **kw)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
