"""A Mooncake segment holder for kvpool's tests: mounts memory into the cluster and waits.

Usage: python mooncake_segment_holder.py MASTER_HOST:PORT SEGMENT_BYTES

Runs as its own process, so the data kvpool's client writes really crosses the TCP transport.
Prints "ready" once its segment is mounted; exits on SIGTERM.
"""

import signal
import sys
import time

from mooncake.store import MooncakeDistributedStore

master, segment_bytes = sys.argv[1], int(sys.argv[2])
store = MooncakeDistributedStore()
code = store.setup("127.0.0.1", "P2PHANDSHAKE", segment_bytes, 16 << 20, "tcp", "", master)
if code != 0:
    sys.exit(f"mooncake setup failed with code {code}")
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("ready", flush=True)
while True:
    time.sleep(3600)
