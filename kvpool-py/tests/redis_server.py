"""A loopback redis-server for tests (vLLM's and SGLang's), started and stopped by PID."""

import socket
import subprocess
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortReservation:
    """A loopback port held bound (not listening: a client is refused, as by no server) until
    released, so that nothing else (vLLM's own sockets) takes it while a test waits to start
    a server there."""

    def __init__(self):
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]

    def release(self):
        self._socket.close()


class RedisServer:
    """A redis-server on 127.0.0.1, started and stopped by PID."""

    def __init__(self, workdir, port=None):
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(dir=workdir, prefix="redis-")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Started once it answers PING: a listener that is not this redis-server (another
        # process took the port, and this one exited) is not taken for it.
        deadline = time.time() + 20
        while time.time() < deadline and self.proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        exited = self.proc.poll()
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}"
                           + (f" (it exited with {exited}: the port taken?)"
                              if exited is not None else ""))

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
