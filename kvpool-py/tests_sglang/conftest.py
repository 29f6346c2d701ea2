"""Fixtures for kvpool as SGLang's HiCache L3 storage backend, against SGLang's own classes.

SGLang's real host memory pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) are built
on CPU over SGLang's real device pools on ``device="cpu"``, with the arguments SGLang's own
``hybrid_pool_assembler`` passes (less ``pin_memory``, which needs CUDA). Backends are created
through SGLang's ``StorageBackendFactory`` ("dynamic", by module path) and driven through the
cache controller's own page get/set functions. Run with ``cargo xtask sglang``.
"""

import os
import shutil
import sys
import tempfile
import types

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from redis_server import RedisServer  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE, DTYPE = 3, 2, 8, 4, torch.bfloat16
KV_LORA, ROPE = 16, 8
DEVICE_TOKENS = 128
HICACHE_RATIO = 2.0

#: (model kind, host pool layout) pairs every round-trip test covers.
POOLS = [("mha", "layer_first"), ("mha", "page_first"), ("mha", "page_first_direct"),
         ("mla", "layer_first"), ("mla", "page_first")]


def host_pool(kind: str, layout: str):
    """SGLang's host pool of ``kind`` ("mha" or "mla") in ``layout``, over a real device pool on
    CPU, its KV filled with random values."""
    if kind == "mha":
        dev = MHATokenToKVPool(size=DEVICE_TOKENS, page_size=PAGE, dtype=DTYPE, head_num=HEADS,
                               head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
                               enable_memory_saver=False)
        host_cls, info, kw = _mha_host_inputs(dev)
        host = host_cls(info, HICACHE_RATIO, 0, PAGE, layout, pin_memory=False, device="cpu",
                        allocator_type="default", pool_label="kv", **kw)
    else:
        dev = MLATokenToKVPool(size=DEVICE_TOKENS, page_size=PAGE, dtype=DTYPE,
                               kv_lora_rank=KV_LORA, qk_rope_head_dim=ROPE, layer_num=LAYERS,
                               device="cpu", enable_memory_saver=False)
        info = dev.get_device_pool_infos()[0].buffer_info
        host = MLATokenToKVPoolHost(
            info, HICACHE_RATIO, 0, PAGE, layout, pin_memory=False, device="cpu",
            allocator_type="default", override_kv_cache_dim=dev.kv_cache_dim,
            device_capacity_tokens=dev.size, start_layer=dev.start_layer,
            end_layer=dev.end_layer, target_layer_num=dev.layer_num, pool_label="kv")
    with torch.no_grad():
        host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(host.dtype))
    return host


def storage_config(kind: str, layout: str, extra: dict, tp_rank=0, tp_size=1,
                   model_name="tiny-model"):
    """The config SGLang's ``HiCacheController._generate_storage_config`` builds."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=(kind == "mla"), enable_storage_metrics=True,
        is_page_first_layout=(layout == "page_first"), model_name=model_name,
        tp_lcm_size=None, should_split_heads=False, dp_rank=0, extra_config=dict(extra),
        dcp_size=1, dcp_rank=0, logical_page_size=None)


def kvpool_extra(config, weights, interface_v1=True, **more):
    """The ``--hicache-storage-backend-extra-config`` that selects kvpool."""
    return {"backend_name": "kvpool", "module_path": "kvpool.sglang",
            "class_name": "KvpoolStorage", "interface_v1": 1 if interface_v1 else 0,
            "config": config, "model_path": weights, **more}


def attach(host, kind, layout, extra, **kw):
    """What SGLang's ``attach_storage_backend`` does: the factory, then the host pool."""
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(kind, layout, extra, **kw), host)
    backend.register_mem_pool_host(host)
    return backend


class Controller:
    """SGLang's ``HiCacheController`` page functions, run unbound on the fields they read (a
    whole controller needs a scheduler and torch.distributed)."""

    def __init__(self, backend, host, zero_copy=True):
        self.ctrl = types.SimpleNamespace(storage_backend=backend, storage_host_pool=host,
                                          page_size=host.page_size)
        self.host = host
        # SGLang's choice at attach: the zero-copy calls with ``interface_v1``, else the older
        # whole-page calls.
        self.zero_copy = zero_copy
        self.op = types.SimpleNamespace(request_id="test", is_terminated=lambda: False)
        self.info = HiCacheStorageExtraInfo(prefix_keys=None)

    def backup(self, keys, host_indices) -> bool:
        """The backup thread's write of ``keys`` from ``host_indices``."""
        fn = (HiCacheController._page_set_zero_copy if self.zero_copy
              else HiCacheController._generic_page_set)
        return fn(self.ctrl, keys, host_indices, self.info)

    def prefetch(self, keys, host_indices) -> int:
        """The prefetch thread's read of ``keys`` into ``host_indices``: pages read."""
        fn = (HiCacheController._page_get_zero_copy if self.zero_copy
              else HiCacheController._generic_page_get)
        return fn(self.ctrl, self.op, keys, host_indices, self.info)

    def exists(self, keys) -> int:
        return self.ctrl.storage_backend.batch_exists(keys, self.info)


def page_bytes(host, host_indices, page):
    """The bytes of page ``page`` of ``host_indices``, as SGLang's ``get_data_page`` sees them."""
    start = int(host_indices[page * host.page_size])
    return host.get_data_page(start, flat=True).view(torch.uint8).clone()


def page_keys(n, salt="p"):
    """``n`` page hashes shaped like SGLang's (64 hex digits)."""
    import hashlib

    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


@pytest.fixture(scope="session")
def scratch():
    d = tempfile.mkdtemp(prefix="kvpool-sglang-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def weights(scratch):
    """A checkpoint directory: keys are bound to its files' digest."""
    return make_weights(os.path.join(scratch, "weights-a"), b"weights a")


def make_weights(directory, content: bytes):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(content)
    with open(os.path.join(directory, "config.json"), "w") as f:
        f.write("{}")
    return directory


@pytest.fixture
def redis_server(scratch):
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (cargo xtask sglang installs it)")
    server = RedisServer(scratch)
    yield server
    server.stop()
