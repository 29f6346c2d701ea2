"""Imports vLLM once, then forks one child per engine run, so no run pays vLLM's import again.

Importing vLLM's CPU build takes ~40 s on the CI machine, and the suite starts ~50 engines,
each in a fresh process so that no engine's state can leak into the next. A child forked from
this server is still a fresh engine process (nothing has run here but imports; no engine, no
connector, no kvpool), it only skips the import. Each child runs a runner script exactly as
``python SCRIPT ARGS...`` would, with the environment the test sent, in its own process group.

Protocol, one JSON object per line. The server writes ``{"ready": true}`` once vLLM is
imported. For each request ``{"script", "args", "env", "log"}`` on stdin it writes
``{"pid": N}`` when the child is forked, then ``{"pid": N, "exit": CODE}`` when it ends (a
negative code is the signal that ended it). It stops at the end of stdin.
"""

import json
import os
import runpy
import sys
import traceback

# What every runner script imports first: the children fork with these already loaded.
import vllm  # noqa: F401
from vllm import LLM, SamplingParams  # noqa: F401
from vllm.config import KVTransferConfig  # noqa: F401


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
