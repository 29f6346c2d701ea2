"""Asynchronous loads inside real vLLM (CPU build): a request loading a long prefix from a slow
tier does not stall the requests already running.

Request A decodes while request B loads a 3K-token prefix from Redis behind a loopback proxy
throttled to about 3 MB/s (the load takes about a second). A's worst gap between two tokens
while B loads must stay under 40 % of B's time to its first token; with kvpool's
asynchronous loads switched off (``"async_loads": false``) the same run must break that
bound (A stops for the whole load). Tokens arrive as a streaming client would see them: the
runner steps the engine by hand and timestamps every token.
"""

import os
import socket
import threading
import time

from conftest import shared_prefix_prompts

THROTTLE_BYTES_PER_S = 3 << 20


class ThrottledProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream_port`` that sends the server's replies
    at ``rate`` bytes a second (requests pass at full speed)."""

    def __init__(self, upstream_port, rate):
        self.upstream = upstream_port
        self.rate = rate
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.running = True
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}"

    def _accept(self):
        while self.running:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.rate), daemon=True).start()

    @staticmethod
    def _pump(src, dst, rate):
        try:
            while True:
                data = src.recv(16384)
                if not data:
                    break
                dst.sendall(data)
                if rate:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self):
        self.running = False
        self.sock.close()


def run_ab(stepper, model_dir, redis_server, async_loads, abort_b_after_s=None):
    """Primes Redis with B's prefix (a first engine), then runs A and B through the proxy."""
    a, b = shared_prefix_prompts(2, prefix_len=3072, suffix_len=31, seed=40)
    a = a[-40:]  # A: a short prompt of its own
    stepper.prime(model_dir, b, {"config": {"local_cpu": {"max_size": "64MiB"},
                                            "tier": [{"url": redis_server.url}]}})
    proxy = ThrottledProxy(redis_server.port, THROTTLE_BYTES_PER_S)
    try:
        cfg = {"config": {"local_cpu": {"max_size": "64MiB"},
                          "tier": [{"url": proxy.url, "timeout_ms": 20000}]},
               "async_loads": async_loads}
        return stepper.run({"model": model_dir, "kvpool": cfg, "prompt_a": a, "a_tokens": 400,
                            "prompt_b": b, "b_after": 5, "abort_b_after_s": abort_b_after_s})
    finally:
        proxy.stop()


def worst_gap_while_loading(out):
    """A's worst gap between two tokens while B waited for its first token, and that wait."""
    b_first = out["b_times"][0]
    a = out["a_times"]
    gaps = [t1 - t0 for t0, t1 in zip(a, a[1:]) if t1 > 0 and t0 < b_first]
    return max(gaps), b_first


def test_a_slow_load_does_not_stall_running_requests(stepper, model_dir, redis_server):
    out = run_ab(stepper, model_dir, redis_server, async_loads=True)
    gap, load = worst_gap_while_loading(out)
    assert out["stats"]["async_loads"] >= 1, out["stats"]
    assert out["stats"]["loaded_tokens"] >= 3072, out["stats"]
    assert load > 0.5, f"B's load took {load:.2f} s: the throttle did not slow it"
    assert gap < 0.4 * load, f"A stopped for {gap:.3f} s while B loaded for {load:.3f} s"


def test_with_async_loads_off_a_slow_load_stalls_running_requests(stepper, model_dir, redis_server):
    """The control: the bound above is not met without asynchronous loads."""
    out = run_ab(stepper, model_dir, redis_server, async_loads=False)
    gap, load = worst_gap_while_loading(out)
    assert out["stats"]["async_loads"] == 0, out["stats"]
    assert out["stats"]["loaded_tokens"] >= 3072, out["stats"]
    assert load > 0.5, f"B's load took {load:.2f} s: the throttle did not slow it"
    assert gap >= 0.4 * load, f"A stopped only {gap:.3f} s while B loaded for {load:.3f} s"


def test_a_request_aborted_while_loading_leaves_nothing_behind(stepper, model_dir, redis_server):
    """B is aborted while its load is in flight: the engine holds its blocks until kvpool
    reports the load ended, and afterwards kvpool holds no copy, load, staged save or block."""
    out = run_ab(stepper, model_dir, redis_server, async_loads=True, abort_b_after_s=0.2)
    assert out["aborted"]
    assert out["b_times"] == [], "B was aborted before its first token"
    assert out["in_flight"] == [0, 0, 0, 0], out["in_flight"]
    assert len(out["tokens"]["A"]) == 400
