"""Page-locking kvpool's host memory (``kvpool.transfer.HostMemoryPin``, and the pool daemon's
shared memory as a worker maps it: ``NodeMemoryPins``) without a GPU: CUDA's runtime replaced
by a fake that keeps the registered ranges as CUDA does. On an H100 the first
version never unregistered L1's arena, so the next worker in the same process got the freed
addresses and could not lock them (and copies through such a range could move the old pages);
the GPU bundle checks the real thing (``gpu_check.py``'s ``host_memory_lifetime``)."""

import gc
import os

import pytest
import torch

from kvpool import _native, transfer
from kvpool.transfer import NodeMemoryPins, pin_host_memory
from kvpool.vllm.layouts import detect

ALREADY_REGISTERED = 712
NOT_REGISTERED = 713
#: Above glibc's largest mmap threshold (32 MiB): the arena is its own mapping, gone from
#: /proc/self/maps once freed.
ARENA = "64MiB"


def mapped(ptr: int) -> bool:
    """Whether ``ptr`` lies in one of this process's mappings."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


class FakeCudart:
    """``cudaHostRegister`` / ``cudaHostUnregister`` over a table of registered ranges, refusing
    a range that overlaps one still registered; ``log`` records every call in order, and each
    unregistration whether the memory was still mapped."""

    def __init__(self):
        self.ranges: dict[int, int] = {}
        self.log: list[tuple] = []

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - CUDA's name
        if any(p < ptr + nbytes and ptr < p + n for p, n in self.ranges.items()):
            self.log.append(("refused", ptr))
            return ALREADY_REGISTERED
        self.ranges[ptr] = nbytes
        self.log.append(("register", ptr))
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.log.append(("unregister", ptr, "mapped" if mapped(ptr) else "FREED"))
        return 0 if self.ranges.pop(ptr, None) is not None else NOT_REGISTERED


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: fake.log.append(("synchronize",)))
    monkeypatch.setattr(transfer, "_consume_cuda_error", lambda: fake.log.append(("consumed",)))
    return fake


def native_worker(tmp_path, name, pool=None):
    caches = {f"model.layers.{i}.self_attn.attn":
              torch.zeros(8, 16, 2, 128, dtype=torch.bfloat16).permute(0, 2, 1, 3)
              for i in range(2)}
    layout = detect(caches, 16, use_mla=False, backend="FLASH_ATTN", layout_name="LBNHC")
    config, config_format = f'[local_cpu]\nmax_size = "{ARENA}"\n', "toml"
    if pool is not None:
        config, config_format = _native.config_with_pool(config, "toml", pool), "json"
    return _native.Worker(
        config_text=config, config_format=config_format, model="m",
        weights="w", tp_size=1, tp_rank=0, pp_rank=0, block_size=16,
        num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
        head_size=layout.head_size, dtype=str(layout.dtype), kv_format=layout.kv_format,
        kind=layout.kind, socket_path=os.path.join(str(tmp_path), f"{name}.sock"))


def test_a_worker_freed_without_shutdown_unlocks_its_memory_while_it_is_still_mapped(
        cuda, tmp_path):
    worker = native_worker(tmp_path, "a")
    ptr, nbytes = worker.host_memory()
    pin = pin_host_memory(ptr, nbytes, before_free=worker.call_before_free)
    assert pin.pinned and cuda.ranges == {ptr: nbytes}
    del worker
    gc.collect()
    # The device is waited for, then the range unlocked before the arena is freed (a
    # weak-reference finalizer ran only after pyo3 had dropped the worker: "FREED").
    assert cuda.log == [("register", ptr), ("synchronize",), ("unregister", ptr, "mapped")]
    assert cuda.ranges == {}
    assert not mapped(ptr), "the arena was not freed: this test no longer sees the order"


def test_a_shutdown_unlocks_once_and_the_next_worker_locks_again(cuda, tmp_path):
    worker = native_worker(tmp_path, "a")
    pin = pin_host_memory(*worker.host_memory(), before_free=worker.call_before_free)
    pin.release()
    pin.release()
    ptr = pin.ptr
    assert cuda.log == [("register", ptr), ("synchronize",), ("unregister", ptr, "mapped")]
    worker.shutdown()
    del worker
    gc.collect()
    assert len(cuda.log) == 3  # released already: freeing the worker unlocks nothing again
    nxt = native_worker(tmp_path, "b")
    again = pin_host_memory(*nxt.host_memory(), before_free=nxt.call_before_free)
    assert again.pinned
    again.release()


def test_a_range_locked_already_is_refused_and_its_error_consumed(cuda, tmp_path):
    worker = native_worker(tmp_path, "a")
    ptr, nbytes = worker.host_memory()
    first = pin_host_memory(ptr, nbytes, before_free=worker.call_before_free)
    with pytest.raises(RuntimeError, match="page-locked earlier in this process"):
        pin_host_memory(ptr + 4096, 4096)
    assert cuda.log[-2:] == [("refused", ptr + 4096), ("consumed",)]
    first.release()


def test_without_cuda_nothing_is_locked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pin = pin_host_memory(4096, 4096)
    assert not pin.pinned
    pin.release()  # a no-op


def test_the_daemons_memory_stays_mapped_until_it_is_unlocked(cuda, tmp_path, pool_daemon):
    """A GPU worker page-locks its mapping of the daemon's shared memory on a thread of its
    own; the pin holds the mapping (``_native.NodeMemoryRegion``), so even with the worker
    gone the range is unlocked while still mapped, and unmapped only after."""
    daemon = pool_daemon("pins", size="64MiB")
    worker = native_worker(tmp_path, "a", pool=daemon.url)
    pins = NodeMemoryPins(worker)
    pins.refresh()
    pins.wait_registered(30)
    assert pins.pinned() == [True]
    (ptr, nbytes), = pins.pins
    assert nbytes == 64 << 20 and cuda.ranges.get(ptr) == nbytes
    pins.refresh()  # the same mapping: nothing new
    assert cuda.log == [("register", ptr)]
    worker.shutdown()
    del worker
    gc.collect()
    assert mapped(ptr), "the pin keeps the daemon's memory mapped"
    pins.release()
    assert cuda.log == [("register", ptr), ("synchronize",), ("unregister", ptr, "mapped")]
    gc.collect()
    assert not mapped(ptr), "released: the mapping went with the worker's last hold"


class FakeRegion:
    def __init__(self, address, length):
        self.address, self.length = address, length


class FakeNative:
    """What ``node_memory_regions`` returns, set by the test."""

    def __init__(self):
        self.regions = []

    def node_memory_regions(self):
        return list(self.regions)


def test_a_mapping_the_worker_dropped_is_unlocked_and_a_new_one_locked(cuda):
    """The daemon restarted: the worker maps its new arena and drops the old one. The next
    refresh unlocks the old range (after the device) and locks the new one."""
    native = FakeNative()
    pins = NodeMemoryPins(native)
    pins.refresh()
    assert pins.pins == {}
    old, new = FakeRegion(1 << 30, 1 << 20), FakeRegion(2 << 30, 1 << 20)
    native.regions = [old]
    pins.refresh()
    pins.wait_registered(30)
    native.regions = [new]
    pins.refresh()
    pins.wait_registered(30)
    assert cuda.log == [("register", old.address), ("synchronize",),
                        ("unregister", old.address, "FREED"), ("register", new.address)]
    assert list(pins.pins) == [(new.address, new.length)] and pins.pinned() == [True]
    native.regions = []
    pins.refresh()
    assert pins.pins == {} and cuda.ranges == {}
