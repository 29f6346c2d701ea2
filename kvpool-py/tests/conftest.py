"""Fixtures for kvpool's end-to-end tests against real vLLM (CPU build).

Each engine runs in a fresh subprocess (``vllm_runner.py``). Set ``KVPOOL_E2E_KEEP=1`` to
keep the scratch directory.
"""

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from make_model import make_model  # noqa: E402
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
def other_model_dir(scratch):
    """Same architecture, other random weights: its KV is wrong for ``model_dir``."""
    return make_model(os.path.join(scratch, "tiny-llama-other"), seed=1)


def shared_prefix_prompts(n, prefix_len=1024, suffix_len=37, seed=1):
    """``n`` prompts: one random prefix, then different random suffixes."""
    r = random.Random(seed)
    prefix = [r.randrange(3, 999) for _ in range(prefix_len)]
    return [prefix + [r.randrange(3, 999) for _ in range(suffix_len)] for _ in range(n)]


class Runner:
    """Runs vLLM engines in subprocesses and caches the no-kvpool baselines."""

    def __init__(self, scratch):
        self.scratch = scratch
        self.count = 0
        self.baselines = {}

    def run(self, spec, timeout=600, script="vllm_runner.py"):
        self.count += 1
        spec_path = os.path.join(self.scratch, f"spec-{self.count}.json")
        out_path = os.path.join(self.scratch, f"out-{self.count}.json")
        log_path = os.path.join(self.scratch, f"run-{self.count}.log")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        started = time.time()
        with open(log_path, "w") as log:
            proc = subprocess.run(
                [sys.executable, os.path.join(HERE, script), spec_path, out_path],
                stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
        if proc.returncode != 0:
            with open(log_path) as f:
                tail = f.read()[-6000:]
            raise AssertionError(f"vLLM run {self.count} failed ({proc.returncode}):\n{tail}")
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
    return Runner(scratch)


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
