"""``KvpoolStorage``: kvpool's tiers as an SGLang HiCache L3 storage backend.

SGLang's cache controller calls a storage backend from its prefetch and backup threads; every
call here blocks that thread (never the scheduler) until kvpool's tiers answered, each tier
call bounded by its timeout. Pages move between SGLang's host memory pool and kvpool by
address (``get_page_buffer_meta`` for the zero-copy ``batch_get_v1`` / ``batch_set_v1``, the
page tensor's own address for the older ``get`` / ``set`` / ``batch_get`` / ``batch_set``):
no KV byte becomes a Python object.

A page's key chains SGLang's page hash (already chained over the prefix) from a root in a
scope bound to the served model and the weights loaded, the TP / PP / context-parallel rank
where pages are sharded, the host pool's page layout, the interface (the zero-copy page and
the older flat page order their bytes differently) and the SGLang version. Pages stored by
SGLang are never offered to vLLM, nor the reverse: their scopes differ.
"""

from __future__ import annotations

import json
import logging
import platform
from typing import TYPE_CHECKING, Any, List, Optional

import torch

from kvpool import _native
from kvpool.identity import WEIGHTS_ID_OPTION, named_weights, resolve_config, weights_digest
from kvpool.sglang import check_sglang_version

# Refuse an SGLang whose storage interface this backend does not know, before importing it.
SGLANG_VERSION = check_sglang_version()

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402 - after the version check
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

if TYPE_CHECKING:
    from sglang.srt.mem_cache.pool_host import HostKVCache

logger = logging.getLogger("kvpool.sglang")

#: Options of ours in ``--hicache-storage-backend-extra-config``, besides SGLang's own.
OPTIONS = ("config", "model_path", "pool", "weights_id")

#: Keys SGLang itself reads from the extra config (the dynamic backend's and the
#: controller's); passed through unchecked.
SGLANG_OPTIONS = (
    "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "file_storage_path",
)


def _weights_path(config: HiCacheStorageConfig, extra: dict[str, Any]) -> str:
    """Where the served model's weights are: ``model_path`` in the extra config, else the
    running server's ``--model-path``, else the served name (a path or a cached hub id)."""
    if extra.get("model_path"):
        return str(extra["model_path"])
    try:
        from sglang.srt.runtime_context import get_server_args

        path = getattr(get_server_args(), "model_path", None)
        if path:
            return str(path)
    except Exception:  # noqa: BLE001 - not inside a server (tests, tools): use the name
        pass
    return str(config.model_name or "")


def _page_layout(pool: "HostKVCache", config: HiCacheStorageConfig, zero_copy: bool,
                 segment_sizes: list[int], page_bytes: int, version: str) -> dict[str, Any]:
    """Everything that decides a page's bytes, for the key scope."""
    attrs = ("layout", "page_size", "layer_num", "head_num", "head_dim", "v_head_dim",
             "kv_lora_rank", "qk_rope_head_dim", "start_layer", "end_layer",
             "storage_format_tag", "stores_page_envelope", "dcp_size", "dcp_rank")
    return {
        "kind": "sglang-hicache-page",
        "interface": "v1" if zero_copy else "flat",
        "pool": type(pool).__name__,
        "dtype": str(getattr(pool, "dtype", None)),
        **{a: _plain(getattr(pool, a, None)) for a in attrs},
        "segment_sizes": segment_sizes,
        "page_bytes": page_bytes,
        # The TP rank (MHA) or DCP rank (MLA) is the key scope's rank; MLA's latent is the same
        # on every TP rank and for every TP size, so it leaves TP out.
        "parallel": {
            "tp_size": None if config.is_mla_model else config.tp_size,
            "pp": [config.pp_rank, config.pp_size],
            "attn_cp": [config.attn_cp_rank, config.attn_cp_size],
            "dcp_size": config.dcp_size, "mla": config.is_mla_model,
        },
        "sglang": version,
        "machine": platform.machine(),
    }


def _side_pool_layout(pool: "HostKVCache", name: str, config: HiCacheStorageConfig,
                      page_bytes: int, version: str) -> dict[str, Any]:
    """Everything that decides a page's bytes in one of a hybrid model's other host pools (a
    Mamba state, sliding-window KV), for its key scope (besides the KV pages' scope, which it
    extends). Mamba states are each TP rank's own shard, whatever the model's attention; other
    pools are sharded as the KV pages are (per TP rank, except with MLA, where SGLang's
    storage writer writes them once for every rank)."""
    per_rank = str(name) == str(PoolName.MAMBA) or not config.is_mla_model
    attrs = ("layout", "page_size", "layer_num", "head_num", "head_dim", "v_head_dim",
             "start_layer", "end_layer", "size_per_token")
    return {
        "kind": "sglang-hicache-pool-page",
        "pool_name": str(name),
        "interface": "flat",
        "pool": type(pool).__name__,
        "dtype": str(getattr(pool, "dtype", None)),
        **{a: _plain(getattr(pool, a, None)) for a in attrs},
        "page_bytes": page_bytes,
        "parallel": {"tp": [config.tp_rank, config.tp_size] if per_rank else None,
                     "pp": [config.pp_rank, config.pp_size],
                     "attn_cp": [config.attn_cp_rank, config.attn_cp_size],
                     "dcp": [config.dcp_rank, config.dcp_size]},
        "sglang": version,
        "machine": platform.machine(),
    }


def _flat_page_bytes(pool: "HostKVCache") -> int:
    """Bytes of one flat page of ``pool`` (``get_dummy_flat_data_page``)."""
    page = pool.get_dummy_flat_data_page()
    return int(page.numel() * page.element_size())


def _plain(value: Any) -> Any:
    return value if isinstance(value, (type(None), bool, int, float, str)) else str(value)


class KvpoolStorage(HiCacheStorage):
    """kvpool's L1, RocksDB disk, Redis, S3 or Mooncake Store as SGLang's HiCache L3 (see the
    module docs). Selected with ``--hicache-storage-backend dynamic`` and the extra config
    ``{"backend_name": "kvpool", "module_path": "kvpool.sglang", "class_name":
    "KvpoolStorage", "interface_v1": 1, "config": "kvpool.toml"}``."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self._version = SGLANG_VERSION
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(set(extra) - set(OPTIONS) - set(SGLANG_OPTIONS))
        if unknown:
            raise ValueError(
                f"kvpool.sglang: unknown option(s) {unknown} in the storage extra config; kvpool "
                f"takes {list(OPTIONS)} besides SGLang's own {list(SGLANG_OPTIONS)}"
            )
        if extra.get(WEIGHTS_ID_OPTION) is not None:
            named_weights(extra[WEIGHTS_ID_OPTION])  # refuses an empty or non-string name
        if storage_config.should_split_heads:
            raise ValueError(
                "kvpool.sglang: heterogeneous TP (`tp_lcm_size` with split heads) is not "
                "supported: pages are stored per rank; drop `tp_lcm_size`"
            )
        self._config = storage_config
        self._extra = extra
        self._zero_copy = bool(extra.get("interface_v1", 0))
        # Read now; parsed and checked in `register_mem_pool_host`, still at SGLang's start-up
        # (the pool is fitted to the host pool's pages there).
        self._config_text, self._config_format = resolve_config(extra)
        self._native: Any = None
        self._closed = False
        self._page_size = 0
        #: The KV pool's native store's arguments, to rebuild it fitted to a larger page.
        self._build_args: tuple | None = None
        #: A hybrid model's other host pools (SGLang's ``*_v2`` calls): name -> (host pool,
        #: flat page bytes), and their native stores over the KV store's tiers.
        self._side_pools: dict[str, tuple[Any, int]] = {}
        self._side: dict[str, Any] = {}
        self._unsupported_policies: set[str] = set()
        #: While the pool is refitted (closed, then built again): every call misses.
        self._refitting = False
        #: Whether ``clear`` was called: a refitted pool's keys chain from a fresh root too.
        self._cleared = False

    # -- set-up -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: "HostKVCache") -> None:
        """SGLang hands over its host pool once the backend is built: the page geometry (and
        so the key scope) comes from it, and the pool is built here."""
        super().register_mem_pool_host(mem_pool_host)
        if self._native is not None or self._closed:
            return
        pool = mem_pool_host
        page_size = int(pool.page_size)
        if self._zero_copy:
            _, sizes = pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
            segment_sizes = [int(s) for s in sizes]
        else:
            flat = pool.get_dummy_flat_data_page()
            segment_sizes = [int(flat.numel() * flat.element_size())]
        page_bytes = sum(segment_sizes)
        config = self._config
        layout = _page_layout(pool, config, self._zero_copy, segment_sizes, page_bytes,
                              self._version)
        name = str(config.model_name or "unnamed-model")
        weights = weights_digest(_weights_path(config, self._extra),
                                 weights_id=self._extra.get(WEIGHTS_ID_OPTION))
        scope = _native.engine_scope("sglang", name, weights, json.dumps(layout, sort_keys=True))
        if config.is_mla_model:
            # Every rank of a DCP shard holds the same latent: one scope, one writer.
            world, rank = max(1, config.dcp_size), config.dcp_rank
        else:
            world, rank = max(1, config.tp_size), config.tp_rank
        self._scope = scope
        self._build_args = (self._config_text, self._config_format, scope, world, rank,
                            config.pp_rank, page_bytes, page_size,
                            bool(config.is_storage_writer))
        self._native = _native.HiCacheStore(*self._build_args)
        self._page_size = page_size
        logger.info(
            "kvpool.sglang: %s pages of %d bytes (%d segments), tiers %s, scope %s, %s",
            "zero-copy" if self._zero_copy else "flat", page_bytes, len(segment_sizes),
            self._native.tier_names(), scope,
            "writer" if config.is_storage_writer else "reader (another rank writes)",
        )

    def register_mem_host_pool_v2(self, host_pool: "HostKVCache", host_pool_name) -> None:
        """SGLang registers every pool of its host pool group after the KV pool: a hybrid
        model's other pools (Mamba states, sliding-window KV, ...) get a store each over the
        KV store's tiers, under a key scope of their own (the pool's name and page layout).
        The pool is refitted when such a pool's page is larger than the KV pool's."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == "kv" or self._closed:
            return
        if self._native is None:
            raise RuntimeError(
                f"kvpool.sglang: SGLang's `{name}` host pool was registered before the KV pool "
                "(register_mem_pool_host)"
            )
        page_bytes = _flat_page_bytes(host_pool)
        self._side_pools[name] = (host_pool, page_bytes)
        largest = max(b for _, b in self._side_pools.values())
        if largest > self._native.fitted_page_bytes:
            # At attach nothing is stored yet. A pool registered later (a dynamic sidecar)
            # finds L1 emptied (what it held is written to the lower tiers first, where the
            # pages keep their keys: a page's scope depends on its own size only).
            logger.info("kvpool.sglang: refitting the pool to pages of %d bytes (SGLang's `%s` "
                        "pool)", largest, name)
            self._refitting = True
            try:
                self._close_stores()
                self._native = _native.HiCacheStore(*self._build_args, max_page_bytes=largest)
                if self._cleared:
                    self._native.clear()
            except Exception:
                self._closed = True  # every later call misses
                raise
            finally:
                self._refitting = False
        for pool_name, (pool, nbytes) in self._side_pools.items():
            if pool_name not in self._side:
                store = self._side_store(pool_name, pool, nbytes)
                if self._cleared:
                    store.clear()
                self._side[pool_name] = store

    def _side_store(self, name: str, pool: "HostKVCache", page_bytes: int):
        layout = _side_pool_layout(pool, name, self._config, page_bytes, self._version)
        scope = _native.part_scope(self._scope, name, json.dumps(layout, sort_keys=True))
        store = self._native.sharing(scope, page_bytes, int(getattr(pool, "page_size", 1) or 1))
        logger.info("kvpool.sglang: SGLang's `%s` host pool: flat pages of %d bytes, scope %s",
                    name, page_bytes, scope)
        return store

    def _store(self):
        """The native store; ``None`` once closed or while refitted (every call misses)."""
        if self._closed or self._refitting:
            return None
        if self._native is None:
            raise RuntimeError(
                "kvpool.sglang: no host pool registered yet (SGLang calls "
                "register_mem_pool_host right after building the backend)"
            )
        return self._native

    # -- the zero-copy interface (``interface_v1``) ---------------------------------------

    def _spans(self, keys: List[str], host_indices: torch.Tensor) -> tuple[list[int], list[int]]:
        if len(host_indices) != len(keys) * self._page_size:
            raise ValueError(
                f"kvpool.sglang: {len(keys)} pages need {len(keys) * self._page_size} host "
                f"indices, not {len(host_indices)}"
            )
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        return [int(p) for p in ptrs], [int(s) for s in sizes]

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        store = self._store()
        if store is None or not keys:
            return [False] * len(keys)
        ptrs, sizes = self._spans(keys, host_indices)
        return store.read_pages(list(keys), ptrs, sizes)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        store = self._store()
        if store is None or not keys:
            return [False] * len(keys)
        ptrs, sizes = self._spans(keys, host_indices)
        return store.write_pages(list(keys), ptrs, sizes)

    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        store = self._store()
        if store is None or not keys:
            return 0
        return store.existing_prefix(list(keys))

    # -- a hybrid model's other host pools (SGLang's ``*_v2`` calls) ------------------------

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None
                        ) -> PoolTransferResult:
        """The longest prefix of ``keys`` whose KV pages and every other pool's pages its hit
        policy needs are stored (``ALL_PAGES``: each page of the prefix; ``TRAILING_PAGES``:
        the last ``len(transfer.keys)`` pages), with every such prefix length, as SGLang's
        ``HiCacheFile`` answers. A pool kvpool does not hold, or a policy it does not know,
        makes every prefix a miss."""
        kv_pages = self.batch_exists(keys, extra_info)
        hit_count: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = str(transfer.name)
            store = self._side.get(name)
            if store is None or self._closed or self._refitting:
                restorable = set()
                break
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = store.existing_prefix(list(keys[:kv_pages]))
                pool_restorable = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                present = store.presence(list(keys[:kv_pages]))
                pool_restorable = {length for length in range(1, kv_pages + 1)
                                   if all(present[max(0, length - trailing):length])}
                boundary = max(pool_restorable, default=0)
            else:
                policy = str(transfer.hit_policy)
                if policy not in self._unsupported_policies:
                    self._unsupported_policies.add(policy)
                    logger.warning("kvpool.sglang: hit policy %s (pool `%s`) is not supported: "
                                   "such prefixes miss", policy, name)
                restorable = set()
                break
            if boundary:
                hit_count[transfer.name] = boundary
            restorable &= pool_restorable
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hit_count, ordered)

    def _side_pages(self, transfer: PoolTransfer):
        """(store, host pool, the host slot of each key) of one transfer, or None when it
        cannot move (a pool kvpool does not hold, or host indices that do not fit the keys)."""
        name = str(transfer.name)
        store = None if self._closed or self._refitting else self._side.get(name)
        keys = transfer.keys or []
        if store is None:
            return None
        pool = self._side_pools[name][0]
        page_size = int(getattr(pool, "page_size", 1) or 1)
        indices = transfer.host_indices
        if indices is None or indices.numel() != len(keys) * page_size:
            logger.warning("kvpool.sglang: pool `%s`: %d pages need %d host indices, not %s",
                           name, len(keys), len(keys) * page_size,
                           None if indices is None else indices.numel())
            return None
        return store, pool, [int(indices[i * page_size]) for i in range(len(keys))]

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> dict[str, List[bool]]:
        """Reads each transfer's pages into its host pool's slots (the longest stored prefix
        of its keys); per pool, which pages were read."""
        results: dict[str, List[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            moved = self._side_pages(transfer)
            if moved is None or not keys:
                results[transfer.name] = [False] * len(keys)
                continue
            store, pool, slots = moved
            pages = [pool.get_dummy_flat_data_page() for _ in keys]
            ptrs, sizes = self._tensor_spans(pages)
            done = store.read_pages(keys, ptrs, sizes)
            for slot, page, ok in zip(slots, pages, done):
                if ok:
                    pool.set_from_flat_data_page(slot, page)
            results[transfer.name] = done
        return results

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> dict[str, List[bool]]:
        """Stores each transfer's pages from its host pool's slots; per pool, which pages
        were stored."""
        results: dict[str, List[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            moved = self._side_pages(transfer)
            if moved is None or not keys:
                results[transfer.name] = [False] * len(keys)
                continue
            store, pool, slots = moved
            pages = [pool.get_data_page(slot, flat=True).contiguous() for slot in slots]
            ptrs, sizes = self._tensor_spans(pages)
            results[transfer.name] = store.write_pages(keys, ptrs, sizes)
        return results

    # -- the older interface: whole flat page tensors ---------------------------------------

    def _tensor_spans(self, tensors: List[torch.Tensor]) -> tuple[list[int], list[int]]:
        ptrs, sizes = [], []
        for t in tensors:
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(
                    "kvpool.sglang: pages must be contiguous CPU tensors (SGLang's flat host "
                    f"pages), not {t.device} with strides {tuple(t.stride())}"
                )
            ptrs.append(int(t.data_ptr()))
            sizes.append(int(t.numel() * t.element_size()))
        return ptrs, sizes

    def _flat_page(self, target: Optional[torch.Tensor]) -> torch.Tensor:
        return target if target is not None else self.mem_pool_host.get_dummy_flat_data_page()

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        store = self._store()
        if store is None or not keys:
            return [None] * len(keys)
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        pages = [self._flat_page(t) for t in targets]
        ptrs, sizes = self._tensor_spans(pages)
        done = store.read_pages(list(keys), ptrs, sizes)
        return [page if ok else None for page, ok in zip(pages, done)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        store = self._store()
        if store is None:
            return False
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            raise ValueError("kvpool.sglang: batch_set needs one page tensor per key")
        ptrs, sizes = self._tensor_spans(list(values))
        return all(store.write_pages(list(keys), ptrs, sizes))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the rest -----------------------------------------------------------------------

    def clear(self) -> None:
        """Nothing stored before is found again by this engine (later keys chain from a fresh
        root); other engines sharing the tiers keep their pages, and the old values leave the
        tiers by their own eviction."""
        self._cleared = True
        if self._native is not None and not self._closed:
            self._native.clear()
            for store in self._side.values():
                store.clear()

    def get_stats(self):
        """SGLang's ``StorageMetrics`` for the calls since the last one (pages per call and
        GB/s), or ``None`` before the first."""
        if self._native is None or self._closed:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        reads, writes = self._native.take_call_stats()
        if not reads and not writes:
            return None
        metrics = StorageMetrics()
        for pages, nbytes, seconds in reads:
            metrics.prefetch_pgs.append(pages)
            metrics.prefetch_bandwidth.append(nbytes / 1e9 / max(seconds, 1e-9))
        for pages, nbytes, seconds in writes:
            metrics.backup_pgs.append(pages)
            metrics.backup_bandwidth.append(nbytes / 1e9 / max(seconds, 1e-9))
        return metrics

    def totals(self) -> dict[str, int]:
        """Pages read, missed, written and refused since start."""
        if self._native is None:
            return {"pages_read": 0, "pages_missed": 0, "pages_written": 0, "pages_refused": 0}
        read, missed, written, refused = self._native.totals()
        return {"pages_read": read, "pages_missed": missed, "pages_written": written,
                "pages_refused": refused}

    def close(self) -> None:
        """Flushes write-behind, closes the tiers and lets them go (a disk tier's files are
        free for the backend SGLang may attach next); later calls miss."""
        self._closed = True
        self._close_stores()

    def _close_stores(self) -> None:
        """Closes the other pools' stores, then the KV store and its tiers, and lets every
        one go (a disk tier's files are free once the last reference is gone)."""
        side, self._side = self._side, {}
        for store in side.values():
            store.close()
        side.clear()
        native, self._native = self._native, None
        if native is not None:
            native.close()
