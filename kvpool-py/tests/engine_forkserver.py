"""Imports vLLM once, then forks one child per engine run, so no run pays vLLM's import again.

Importing vLLM's CPU build takes ~40 s on the CI machine, and the suite starts ~130 engines,
each in a fresh process so that no engine's state can leak into the next. A child forked from
this server is still a fresh engine process (nothing has run here but imports; no engine, no
connector, no kvpool), it only skips the import. Beyond ``vllm`` itself the server imports the
modules an engine start pulls in lazily (scheduler, CPU worker and model runner, the Llama
model, the loaders): measured on the 2-core VM, that takes an in-process engine run from ~10.9 s
to ~8.3 s. Each child runs a runner script exactly as
``python SCRIPT ARGS...`` would, with the environment the test sent, in its own process group.

Protocol, one JSON object per line. The server writes ``{"ready": true}`` once vLLM is
imported. For each request ``{"script", "args", "env", "log"}`` on stdin it writes
``{"pid": N}`` when the child is forked, then ``{"pid": N, "exit": CODE}`` when it ends (a
negative code is the signal that ended it). It stops at the end of stdin.
"""

import importlib
import json
import os
import runpy
import sys
import traceback

# What every runner script imports first: the children fork with these already loaded.
import vllm  # noqa: F401
from vllm import LLM, SamplingParams  # noqa: F401
from vllm.config import KVTransferConfig  # noqa: F401

#: Modules an engine start imports lazily (found by diffing ``sys.modules`` before and after a
#: run). Only an optimisation: a name a later vLLM drops or moves is skipped.
ENGINE_MODULES = (
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
    "vllm.model_executor.layers.quantization.online.fp8",
    "vllm.entrypoints.launchers.cli_args",
    "vllm.plugins.lora_resolvers.filesystem_resolver",
    "vllm.distributed.elastic_ep.elastic_execute",
    "torch._dynamo.backends.inductor",
    "torch._inductor.codegen.wrapper_fxir",
    "torch.export._trace",
    "torch.distributed.tensor.experimental",
    "sympy.combinatorics",
)
for _name in ENGINE_MODULES:
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - an optimisation only
        pass


def run_child(request):
    """Runs in the forked child: becomes ``python SCRIPT ARGS...`` and never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["script"], *request["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))
        runpy.run_path(request["script"], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def reply(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main():
    reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(request)
        reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        reply({"pid": pid, "exit": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
