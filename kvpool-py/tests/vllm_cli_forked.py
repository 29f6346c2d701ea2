"""vLLM's command line (as ``bench_serve.py --vllm-cli`` runs it) with the EngineCore and its
worker forked from the process that starts them (vLLM's default off the CPU build) rather than
spawned (what the CPU build forces): a `vllm serve` then imports vLLM once instead of three
times, ~70 s sooner on the CI machine. For tests whose subject does not depend on how vLLM's
processes start; the spawned servers are the Redis pair of test_disaggregated_prefill.py.

    python vllm_cli_forked.py serve MODEL ...
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))

import bench_serve  # noqa: E402


def fork_engine_processes():
    """After the CPU platform's config check (which sets the start method to ``spawn``), puts
    ``fork`` back."""
    from vllm.platforms import cpu as cpu_platform

    check = cpu_platform.CpuPlatform.check_and_update_config.__func__

    def check_then_fork(cls, vllm_config):
        check(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    cpu_platform.CpuPlatform.check_and_update_config = classmethod(check_then_fork)


if __name__ == "__main__":
    bench_serve.stand_in_for_vllm_version()
    fork_engine_processes()
    bench_serve.vllm_cli(sys.argv[1:])
