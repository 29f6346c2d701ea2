"""The ``kvpool`` command the package installs (its console entry point, not the workspace's
binary): ``pip install`` gives the node's pool daemon, ``kvpool serve``, and the one-shot
commands, run by the native module. Standard library only: ``cargo xtask wheel`` runs this
file in a fresh virtualenv holding nothing but the release wheel (and pytest)."""

import json
import os
import subprocess
import sys
import time


def installed_kvpool() -> str:
    """The ``kvpool`` script pip put next to this interpreter."""
    path = os.path.join(os.path.dirname(sys.executable), "kvpool")
    assert os.path.exists(path), f"the package installed no `kvpool` command at {path}"
    return path


def test_the_installed_command_serves_the_pool_and_benches_through_it(tmp_path):
    kvpool = installed_kvpool()
    version = subprocess.run([kvpool, "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("kvpool "), version.stdout
    usage = subprocess.run([kvpool, "serve", "--no-such-flag"], capture_output=True, text=True,
                           timeout=60)
    assert usage.returncode == 2 and "--no-such-flag" in usage.stderr

    socket = tmp_path / "kvpool.sock"
    log = open(tmp_path / "serve.log", "w+")
    # A disk tier under the daemon: RocksDB as the package links it.
    disk = tmp_path / "disk"
    serve = subprocess.Popen([kvpool, "serve", "--socket", str(socket), "--cpu-size", "64MiB",
                              "--tier", f"file://{disk}"],
                             stderr=log, env={k: v for k, v in os.environ.items()
                                              if k != "KVPOOL_LOG"})
    try:
        deadline = time.monotonic() + 60
        while not socket.exists():
            assert serve.poll() is None, "kvpool serve exited"
            assert time.monotonic() < deadline, "kvpool serve never listened"
            time.sleep(0.05)
        bench = subprocess.run(
            [kvpool, "bench", "--cpu-size", "16MiB", "--tier", f"kvpool+unix://{socket}",
             "--system-prompts", "1", "--system-prompt-tokens", "512", "--sessions", "8",
             "--turns", "2", "--json"],
            capture_output=True, text=True, timeout=300)
        assert bench.returncode == 0, bench.stderr
        report = json.loads(bench.stdout)
        daemon = next(t for t in report["tiers"] if t["name"] == "daemon")
        assert daemon["hit_tokens"] > 0, report["tiers"]
    finally:
        serve.terminate()
        assert serve.wait(timeout=30) == 0, "kvpool serve did not stop cleanly on SIGTERM"
    log.seek(0)
    text = log.read()
    # `serve` logs at info without KVPOOL_LOG, as the binary does.
    assert "attached" in text, text
    assert (disk / "CURRENT").exists(), "the disk tier made no RocksDB database"
