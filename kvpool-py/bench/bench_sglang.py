"""kvpool as SGLang's HiCache L3 storage backend against SGLang's own ``file`` backend
(``HiCacheFile``), side by side in one run, on SGLang's real host memory pool (CPU).

Each configuration backs up one batch of pages from the host pool (the backup thread's call)
and prefetches them into other host slots (the prefetch thread's call), through the cache
controller's own page functions, ``--repeats`` times; the report is the median GB/s of each:

- ``sglang-file``: SGLang's built-in ``HiCacheFile`` (one file per page, its whole-page calls;
  the baseline).
- ``kvpool-disk``: kvpool's RocksDB disk tier alone (no L1), zero-copy calls; prefetches
  through a fresh backend, so every page is read from the disk tier.
- ``kvpool-l1``: kvpool's memory tier alone, zero-copy calls.
- ``memcpy``: the same page spans copied with ``ctypes.memmove`` into a buffer and back (the
  floor: what any backend must at least copy).

Both disk configurations write into the same temporary directory's filesystem, and the
operating system's page cache is left warm in both (a cold read is another question).

    python bench_sglang.py --out results.json [--pages 64 --repeats 5]
    python bench_sglang.py --out disk.json --configs kvpool-disk   # one configuration (to profile)

Run through ``cargo xtask bench-sglang``, which builds a release wheel first.
"""

import argparse
import ctypes
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests_sglang"))

import torch  # noqa: E402
from conftest import Controller, attach, kvpool_extra, make_weights, page_keys  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

CONFIGS = ("sglang-file", "kvpool-disk", "kvpool-l1", "memcpy")

# A Llama-3-8B-shaped page but 16 layers: 8 KV heads of 128, bf16, 64 tokens a page: 4 MiB.
LAYERS, HEADS, HEAD_DIM, PAGE, DTYPE = 16, 8, 128, 64, torch.bfloat16


def host_pool(pages):
    dev = MHATokenToKVPool(size=pages * PAGE, page_size=PAGE, dtype=DTYPE, head_num=HEADS,
                           head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
                           enable_memory_saver=False)
    host_cls, info, kw = _mha_host_inputs(dev)
    host = host_cls(info, 2.0, 0, PAGE, "page_first", pin_memory=False, device="cpu",
                    allocator_type="default", pool_label="kv", **kw)
    with torch.no_grad():
        host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(host.dtype))
    return host


def sglang_file(host, directory):
    from conftest import storage_config

    config = storage_config("mha", "page_first", {"file_storage_path": directory})
    backend = StorageBackendFactory.create_backend("file", config, host)
    backend.register_mem_pool_host(host)
    return backend


def measure(make_backend, fresh_reader, zero_copy, host, pages, repeats, salt):
    """(backup GB/s, prefetch GB/s) per repeat; with ``fresh_reader`` the writer is closed and
    a new backend prefetches (an engine after a restart)."""
    src = host.alloc(pages * PAGE)
    dst = host.alloc(pages * PAGE)
    nbytes = pages * host.get_size_per_token() * PAGE
    backups, prefetches = [], []
    for r in range(repeats):
        keys = page_keys(pages, salt=f"{salt}-{r}")
        writer = make_backend()
        ctrl = Controller(writer, host, zero_copy)
        t0 = time.perf_counter()
        assert ctrl.backup(keys, src)
        backups.append(nbytes / (time.perf_counter() - t0) / 1e9)
        reader = writer
        if fresh_reader:
            if hasattr(writer, "close"):
                writer.close()
            reader = make_backend()
            ctrl = Controller(reader, host, zero_copy)
        t0 = time.perf_counter()
        assert ctrl.prefetch(keys, dst) == pages
        prefetches.append(nbytes / (time.perf_counter() - t0) / 1e9)
        assert torch.equal(host.kv_buffer[:, dst[0]], host.kv_buffer[:, src[0]])
        if fresh_reader and hasattr(reader, "close"):
            reader.close()
    host.free(src)
    host.free(dst)
    return backups, prefetches


def measure_memcpy(host, pages, repeats):
    src = host.alloc(pages * PAGE)
    dst = host.alloc(pages * PAGE)
    ptrs, sizes = host.get_page_buffer_meta(src)
    back, _ = host.get_page_buffer_meta(dst)
    buf = ctypes.create_string_buffer(sum(sizes))
    base = ctypes.addressof(buf)
    nbytes = sum(sizes)
    backups, prefetches = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        off = 0
        for p, s in zip(ptrs, sizes):
            ctypes.memmove(base + off, p, s)
            off += s
        backups.append(nbytes / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        off = 0
        for p, s in zip(back, sizes):
            ctypes.memmove(p, base + off, s)
            off += s
        prefetches.append(nbytes / (time.perf_counter() - t0) / 1e9)
    host.free(src)
    host.free(dst)
    return backups, prefetches


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated configurations to run (default: all)")
    args = ap.parse_args()
    chosen = args.configs.split(",")
    unknown = sorted(set(chosen) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    scratch = tempfile.mkdtemp(prefix="kvpool-bench-sglang-")
    try:
        weights = make_weights(os.path.join(scratch, "weights"), b"bench")
        host = host_pool(args.pages)
        page_bytes = host.get_size_per_token() * PAGE
        results = {}
        if "sglang-file" in chosen:
            file_dir = os.path.join(scratch, "sglang-file")
            results["sglang-file"] = measure(lambda: sglang_file(host, file_dir), True, False,
                                             host, args.pages, args.repeats, "file")
        if "kvpool-disk" in chosen:
            disk = {"local_cpu": {"enabled": False},
                    "tier": [{"url": f"file://{scratch}/kvpool-disk", "capacity": "8GiB"}]}
            disk_extra = kvpool_extra(disk, weights)
            results["kvpool-disk"] = measure(
                lambda: attach(host, "mha", "page_first", disk_extra), True, True, host,
                args.pages, args.repeats, "disk")
        if "kvpool-l1" in chosen:
            l1 = attach(host, "mha", "page_first",
                        kvpool_extra({"local_cpu": {"max_size": "2GiB"}}, weights))
            results["kvpool-l1"] = measure(lambda: l1, False, True, host, args.pages,
                                           args.repeats, "l1")
            l1.close()
        if "memcpy" in chosen:
            results["memcpy"] = measure_memcpy(host, args.pages, args.repeats)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    # Ratios are to the baseline when it ran; alone, a configuration is its own reference.
    base_name = "sglang-file" if "sglang-file" in results else next(iter(results))
    base = results[base_name]
    vs = "vs file" if base_name == "sglang-file" else f"vs {base_name}"
    base_b = statistics.median(base[0])
    base_p = statistics.median(base[1])
    print(f"{args.pages} pages of {page_bytes / 2**20:.1f} MiB (MHA page_first, {LAYERS} layers,"
          f" {HEADS}x{HEAD_DIM} bf16, {PAGE} tokens), median of {args.repeats}; "
          f"{platform.machine()}, {os.cpu_count()} CPUs")
    print(f"{'config':<14}{'backup GB/s':>12} {vs:>10}{'prefetch GB/s':>15} {vs:>10}")
    summary = {}
    for name, (b, p) in results.items():
        mb, mp = statistics.median(b), statistics.median(p)
        summary[name] = {"backup_gbps": b, "prefetch_gbps": p, "backup_median": mb,
                         "prefetch_median": mp}
        print(f"{name:<14}{mb:>12.2f}{mb / base_b:>10.2f}x{mp:>15.2f}{mp / base_p:>10.2f}x")
    with open(args.out, "w") as f:
        json.dump({"pages": args.pages, "page_bytes": page_bytes, "results": summary}, f,
                  indent=1)


if __name__ == "__main__":
    main()
