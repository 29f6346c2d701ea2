"""The baseline for `benches/mooncake.rs`: 1 MiB put/get driven directly from Mooncake's
Python client, timed the way criterion times kvpool (median over samples of several ops).

Usage: python mooncake_direct.py MASTER_HOST:PORT
Prints one JSON object: median microseconds per operation for each operation.
"""

import ctypes
import json
import os
import statistics
import sys
import time

from mooncake.store import MooncakeDistributedStore

MIB = 1 << 20
SAMPLES, OPS_PER_SAMPLE, WARMUP = 30, 10, 20

store = MooncakeDistributedStore()
code = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", sys.argv[1])
if code != 0:
    sys.exit(f"mooncake setup failed with code {code}")
buffer = ctypes.create_string_buffer(2 * MIB)
src, dst = ctypes.addressof(buffer), ctypes.addressof(buffer) + MIB
assert store.register_buffer(src, 2 * MIB) == 0
ctypes.memmove(src, os.urandom(MIB), MIB)


def median_us(op):
    for _ in range(WARMUP):
        op()
    means = []
    for _ in range(SAMPLES):
        start = time.perf_counter()
        for _ in range(OPS_PER_SAMPLE):
            op()
        means.append((time.perf_counter() - start) / OPS_PER_SAMPLE)
    return statistics.median(means) * 1e6


def check(code):
    if code < 0:
        sys.exit(f"mooncake call failed with code {code}")


results = {
    "upsert_from": median_us(lambda: check(store.upsert_from("direct-1mib", src, MIB))),
    "get_into": median_us(lambda: check(store.get_into("direct-1mib", dst, MIB))),
    "put_from": median_us(lambda: check(store.put_from("direct-1mib", src, MIB))),
}
assert ctypes.string_at(src, MIB) == ctypes.string_at(dst, MIB)
print(json.dumps(results))
store.close()
