"""kvpool as a secondary tier under vLLM's native offloading (``TieringOffloadingSpec``).

vLLM's offloading connector keeps a CPU primary tier that it fills from the GPU with its own
copy kernels; below it, *secondary tiers* receive chunks from that CPU region ("cascade") and
give them back ("promotion"). ``KvpoolTier`` is such a tier: kvpool's L1, RocksDB disk, Redis,
S3 or Mooncake Store, with its integrity checks and timeouts. No code of kvpool's touches GPU
memory on this route. Select it in the offloading connector's extra config::

    "kv_connector": "OffloadingConnector",
    "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [
            {"type": "KvpoolTier", "module_path": "kvpool.vllm.tier",
             "config": "/etc/kvpool/kvpool.toml"}
        ]
    }

``config`` is what the connector takes (a path, TOML text or a dict; else ``KVPOOL_CONFIG``;
else embedded defaults). Every method returns at once: jobs run on kvpool's runtime and are
collected in ``get_finished_jobs``; a lookup that must ask a lower tier answers ``RETRY`` until
it has the answer (the chunk is then already verified and in kvpool's L1). A value stored under
another model, weights, TP size or row layout, or one that fails its checksum, is a ``MISS``.
vLLM's ``reset_cache`` (sleep, resume, weights pushed into the running engine) makes everything
stored before it a ``MISS`` too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvpool import _native
from kvpool.vllm.compat import check_vllm
from kvpool.identity import named_weights
from kvpool.vllm.identity import model_identity, resolve_config, weights_digest

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger("kvpool.vllm")

_LOOKUP = {0: LookupResult.MISS, 1: LookupResult.HIT, 2: LookupResult.RETRY}
_LOOKUP_LABEL = {0: "miss", 1: "hit", 2: "retry"}

#: The tier's series in vLLM's Prometheus metrics (kvpool's own come from ``[metrics] listen``).
LOOKUPS_METRIC = "vllm:kvpool_tier_lookups"
JOBS_METRIC = "vllm:kvpool_tier_jobs"
BYTES_METRIC = "vllm:kvpool_tier_bytes"

#: At most this many stored-chunk events wait for ``take_events`` (older ones are dropped).
MAX_PENDING_EVENTS = 65_536


def _scope_of(spec: "OffloadingSpec", row_bytes: int,
              weights_id: str | None = None) -> tuple[str, int, int]:
    """(model scope, world size, tokens per row): the served model bound to its weights (or
    the operator's ``weights_id``) and to everything that decides a row's bytes (vLLM's
    offloading layout, dtype, parallelism)."""
    config = spec.config
    vllm_config = _current_vllm_config()
    if vllm_config is not None:
        name, weights = model_identity(vllm_config, weights_id)
    else:
        name, weights = config.model.name, weights_digest(config.model.name,
                                                          weights_id=weights_id)
    parallel = config.parallel
    layout = {
        "kind": "vllm-offload-row",
        "row_bytes": row_bytes,
        "groups": [(g.tokens_per_block, list(g.layer_names), g.group_id) for g in config.groups],
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "dtype": config.model.dtype,
        "cache": dataclasses.asdict(config.cache),
        "parallel": [parallel.world_size, parallel.tp_size, parallel.pp_size, parallel.pcp_size,
                     parallel.dcp_size],
        "replicated_layout": config.replicated_layout,
        "canonical_layout": config.canonical_layout,
        "kv_cache_layout": config.kv_cache_layout,
        "vllm": _vllm_version(),
        "machine": platform.machine(),
    }
    scope = _native.engine_scope("vllm-offload", name, weights, json.dumps(layout, sort_keys=True))
    tokens = max((g.tokens_per_block for g in config.groups), default=1) * config.cache.blocks_per_chunk
    return scope, max(1, parallel.world_size), tokens


def _current_vllm_config():
    try:
        from vllm.config import get_current_vllm_config

        current = get_current_vllm_config()
    except Exception:  # noqa: BLE001 - no current config: fall back to the model path
        return None
    return current if getattr(current, "model_config", None) is not None else None


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001
        return "unknown"


class KvpoolTier(SecondaryTierManager):
    """kvpool's tiers as one secondary tier of vLLM's offloading (see the module docs)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: "OffloadingSpec",
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: "BackpressureDetector | None" = None,
        config: Any = None,
        locality: Any = None,
        weights_id: Any = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ValueError(
                f"kvpool tier: unknown option(s) {sorted(unknown)}; it takes `config` (a path, "
                "TOML text or a dict) and `weights_id` (a name for the weights, instead of a "
                "digest of their files) besides vLLM's own `type`, `module_path`, `locality` "
                "and `backpressure`"
            )
        if weights_id is not None:
            named_weights(weights_id)  # refuses an empty or non-string name
        check_vllm(vllm.__version__, KvpoolTier, (SecondaryTierManager,))
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        rows = np.asarray(primary_kv_view)
        if rows.ndim != 2 or not rows.flags.c_contiguous or not rows.flags.writeable:
            raise ValueError(
                "kvpool tier: vLLM's primary view must be a writable C-contiguous "
                f"(chunks, bytes) array, not shape {rows.shape} flags {rows.flags}"
            )
        # The tier keeps the array (and through it vLLM's memoryview) alive: Rust holds its
        # address.
        self._rows = rows
        row_bytes = int(rows.shape[1]) * rows.itemsize
        text, fmt = resolve_config({} if config is None else {"config": config})
        scope, world, tokens = _scope_of(offloading_spec, row_bytes, weights_id)
        self._native = _native.OffloadTier(
            text, fmt, scope, world, int(rows.ctypes.data), int(rows.shape[0]), row_bytes, tokens
        )
        self._jobs: dict[int, list[OffloadKey]] = {}
        self._stored_jobs: set[int] = set()
        events_config = getattr(offloading_spec, "kv_events_config", None)
        self._events_enabled = bool(getattr(events_config, "enable_kv_cache_events", False))
        self._events: list[OffloadingEvent] = []
        self._stats = OffloadingConnectorStats()
        logger.info("kvpool tier: %d rows of %d bytes, tiers %s, scope %s", rows.shape[0],
                    row_bytes, self._native.tier_names(), scope)

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]
                                 ) -> dict[str, OffloadingMetricMetadata]:
        return {
            LOOKUPS_METRIC: OffloadingCounterMetadata(
                documentation="Lookups kvpool's tier answered, by answer (hit, miss, retry: a "
                              "lower tier is being read).",
                labelnames=("result",)),
            JOBS_METRIC: OffloadingCounterMetadata(
                documentation="Jobs kvpool's tier finished, by kind (store, load) and outcome "
                              "(ok, failed).",
                labelnames=("kind", "outcome")),
            BYTES_METRIC: OffloadingCounterMetadata(
                documentation="Bytes kvpool's tier moved out of (store) or into (load) vLLM's "
                              "CPU region.",
                labelnames=("kind",)),
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, OffloadingConnectorStats()
        return stats

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        answer = self._native.lookup(bytes(key))
        self._stats.increase_counter(LOOKUPS_METRIC, 1, (_LOOKUP_LABEL[answer],))
        return _LOOKUP[answer]

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._jobs[job_metadata.job_id] = keys
        self._stored_jobs.add(job_metadata.job_id)
        self._native.submit_store(job_metadata.job_id, [bytes(k) for k in keys],
                                  [int(c) for c in job_metadata.chunk_ids])

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._jobs[job_metadata.job_id] = keys
        self._native.submit_load(job_metadata.job_id, [bytes(k) for k in keys],
                                 [int(c) for c in job_metadata.chunk_ids])

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for job_id, success, loaded, nbytes, seconds in self._native.finished():
            keys = self._jobs.pop(job_id, [])
            is_store = job_id in self._stored_jobs
            self._stored_jobs.discard(job_id)
            successful = None
            if not is_store and not success and loaded:
                successful = keys[:loaded]
            if is_store and success and self._events_enabled and keys:
                self._record_event(keys)
            kind = "store" if is_store else "load"
            self._stats.increase_counter(JOBS_METRIC, 1, (kind, "ok" if success else "failed"))
            self._stats.increase_counter(BYTES_METRIC, nbytes, (kind,))
            results.append(JobResult(job_id=job_id, success=success, successful_keys=successful,
                                     transfer_time=seconds, transfer_bytes=nbytes))
        return results

    def _record_event(self, keys: list[OffloadKey]) -> None:
        self._events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=False,
                                            locality=self.locality, ownership=self.tier_type))
        if len(self._events) > MAX_PENDING_EVENTS:
            del self._events[: len(self._events) - MAX_PENDING_EVENTS]

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def has_pending_work(self) -> bool:
        return self._native.in_flight() > 0

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        # vLLM calls this from reset_cache (sleep, resume, or new weights pushed into the
        # running engine, which change no file and so no key scope): after the drain, nothing
        # stored before is found again.
        self._native.reset()

    def shutdown(self) -> None:
        self._native.close()
        self._rows = None  # no more reads or writes of vLLM's region: release our view of it
