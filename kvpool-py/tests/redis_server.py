"""A loopback redis-server for tests (vLLM's and SGLang's), started and stopped by PID."""

import socket
import subprocess
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server on 127.0.0.1, started and stopped by PID."""

    def __init__(self, workdir, port=None):
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(dir=workdir, prefix="redis-")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start")

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}"

    def cli(self, *args):
        return subprocess.run(["redis-cli", "-p", str(self.port), *args], check=True,
                              capture_output=True, text=True).stdout

    def keys(self):
        return [k for k in self.cli("--scan").split("\n") if k]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
