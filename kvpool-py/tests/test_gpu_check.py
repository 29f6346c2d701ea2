"""The GPU bundle's check (``kvpool-py/gpu/gpu_check.py``), run on CPU tensors so it cannot rot
between the rare sessions that have a GPU: the same layouts (FlashAttention's LBNHC view and
MLA's latent), saves and loads through kvpool's Rust halves byte for byte, synchronous and
asynchronous, nothing left in flight, and loads from the node's pool daemon the GPU worker's
way."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_gpu_check_passes_on_cpu_tensors(tmp_path):
    """Runs the source script; in CI (``KVPOOL_GPU_BUNDLE`` names the bundle ``cargo xtask ci``
    built) the bundle's own ``run.sh`` instead, with the wheel it carries, as a GPU machine
    would run it."""
    # The daemon-vs-L1 timing at 16 MiB, three pairs: the figures are a GPU's to give; here the
    # check's route and verdicts are what is tested (its staged checks still multi-threaded).
    env = {**os.environ, "KVPOOL_CHECK_DEVICE": "cpu", "OUT": str(tmp_path),
           "KVPOOL_CHECK_DAEMON_TOKENS": "512", "KVPOOL_CHECK_DAEMON_LOADS": "3"}
    bundle = os.environ.get("KVPOOL_GPU_BUNDLE")
    if bundle:
        # run.sh calls `python3`: this venv's, which has torch (a GPU machine's has it too).
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        command = ["sh", os.path.join(bundle, "run.sh")]
    else:
        command = [sys.executable, os.path.join(HERE, "..", "gpu", "gpu_check.py")]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["failures"] == []
    if bundle:
        # The kvpool under test is the bundle's unpacked wheel, not the venv's installed one.
        assert os.path.realpath(report["kvpool_from"]) == os.path.realpath(
            os.path.join(bundle, "site")), report["kvpool_from"]
    for layout in ("flash_attn", "flashinfer_hnd", "mla"):
        r = report[layout]
        assert r["sync_load_exact"] and r["async_load_exact"], r
        assert r["sync_hit"] == [1024, False] and r["async_hit"] == [1024, True], r
    # A GPU worker's loads from the pool daemon (the `kvpool` the suite built, KVPOOL_BIN):
    # staged, read back and checked; the blocks hold what the other engine saved.
    daemon = report["daemon_route"]
    assert "skipped" not in daemon, daemon
    assert daemon["load_exact"] and daemon["node_memory_staged_tokens"] >= 1024, daemon
    # A byte another process flips in the daemon's memory is reported in the load's own step.
    assert daemon["changed_chunk_failed_in_its_step"], daemon
    # Its staged copies had L1's (page-locked on a GPU) buffers, none from the heap.
    assert daemon["heap_buffers"] == 0, daemon
    assert report["staged_load"]["buffers_hold_the_chunks"], report["staged_load"]
    # A daemon hit's load timed against an L1 hit's of the same bytes: both byte for byte,
    # every daemon load through the daemon (none from the engine's own L1).
    timed = report["daemon_vs_l1"]
    assert "skipped" not in timed, timed
    assert timed["daemon_exact"] and timed["l1_exact"] and timed["every_daemon_load_staged"], timed
    assert timed["samples"] == 3 and timed["daemon_load_ms_median"] > 0, timed
    assert timed["daemon_staged_tokens_per_load"] == [512] * 4, timed
    # The throughput figures are over every byte moved: on CPU the check saves and loads
    # 128 blocks x 8 layers x 64 KiB (a first version counted one block per chunk: 4 MiB).
    assert report["throughput"]["bytes"] == 64 << 20, report["throughput"]
