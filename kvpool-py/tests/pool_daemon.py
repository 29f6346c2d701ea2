"""`kvpool serve` for tests: started on a socket in the scratch dir, stopped by PID."""

import os
import shutil
import socket
import subprocess
import time
import urllib.request

from redis_server import free_port


def kvpool_bin():
    """The `kvpool` command (`cargo xtask vllm` builds it and names it in KVPOOL_BIN)."""
    path = os.environ.get("KVPOOL_BIN") or shutil.which("kvpool")
    if not path or not os.path.exists(path):
        raise AssertionError("no `kvpool` command: run through `cargo xtask vllm` (KVPOOL_BIN)")
    return path


class PoolDaemon:
    """A `kvpool serve` process: shared memory of `size`, over the lower tiers `tiers`."""

    def __init__(self, workdir, name, size="512MiB", tiers=(), cpus=None, low_priority=True,
                 group_nice=None):
        """`cpus`: the CPUs every thread of the daemon may run on (all when None), set before
        its first thread starts; `low_priority`: its `[write_behind] low_priority`;
        `group_nice`: when set, the daemon runs in a session of its own whose scheduling
        group (Linux's autogroup) gets this nice value, every thread of it ranked so against
        other groups (as a systemd service's `CPUWeight=` does)."""
        self.cpus = cpus
        self.group_nice = group_nice
        self.dir = os.path.join(workdir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.socket = os.path.join(self.dir, "kvpool.sock")
        self.metrics_port = free_port()
        self.config = os.path.join(self.dir, "kvpool.toml")
        with open(self.config, "w") as f:
            f.write(f'[local_cpu]\nmax_size = "{size}"\n\n')
            f.write(f'[metrics]\nlisten = "127.0.0.1:{self.metrics_port}"\n')
            if not low_priority:
                f.write('\n[write_behind]\nlow_priority = false\n')
            for url in tiers:
                f.write(f'\n[[tier]]\nurl = "{url}"\n')
        self.starts = 0
        self.proc = None
        self.start()

    @property
    def url(self):
        """The connector's `pool` option."""
        return f"unix://{self.socket}"

    @property
    def pid(self):
        return self.proc.pid

    def start(self):
        self.starts += 1
        self.log = os.path.join(self.dir, f"serve-{self.starts}.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [kvpool_bin(), "serve", "--config", self.config, "--socket", self.socket],
                stdout=log, stderr=subprocess.STDOUT,
                start_new_session=self.group_nice is not None,
                preexec_fn=(lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None)
        if self.group_nice is not None:
            try:
                with open(f"/proc/{self.proc.pid}/autogroup", "w") as f:
                    f.write(str(self.group_nice))
                with open(f"/proc/{self.proc.pid}/autogroup") as f:
                    ranked = f.read().split()
                if ranked[-1] != str(self.group_nice):  # "/autogroup-N nice K"
                    raise OSError(f"autogroup reads {' '.join(ranked)}")
            except OSError as e:
                self.kill()
                raise AssertionError(f"cannot give the daemon's group nice {self.group_nice} "
                                     f"(autogroup off, or not permitted): {e}") from e
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"kvpool serve exited: {self.tail()}")
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(self.socket)
                self.scrape()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise AssertionError(f"kvpool serve did not start: {self.tail()}")

    def tail(self):
        with open(self.log) as f:
            return f.read()[-4000:]

    def scrape(self):
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as page:
            return page.read().decode()

    def stats(self):
        """The daemon's `kvpool_daemon_*` series, without the prefix (labels but `tenant` as
        `name:value`; summed over tenants)."""
        out = {}
        for line in self.scrape().splitlines():
            if not line.startswith("kvpool_daemon_"):
                continue
            series, value = line.rsplit(" ", 1)
            name = series[len("kvpool_daemon_"):]
            if "{" in name:
                base, labels = name[:-1].split("{", 1)
                pairs = [p.split("=", 1) for p in labels.split(",") if "=" in p]
                rest = [v.strip('"') for k, v in pairs if k != "tenant"]
                name = base + "".join(":" + v for v in rest)
            out[name] = out.get(name, 0.0) + float(value)
        return out

    def wait(self, done, what, timeout=30):
        """Waits until `done(stats)` (the daemon publishes its series every second)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            stats = self.stats()
            if done(stats):
                return stats
            time.sleep(0.2)
        raise AssertionError(f"the daemon never reached: {what}; stats {self.stats()}")

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def stop(self):
        """SIGTERM (drains and closes the tiers), then SIGKILL if it hangs."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
