"""What travels from kvpool's workers to vLLM's scheduler and stat loggers: per-step worker
metadata (steps run and copied, for the scheduler's commits), connector stats and their
Prometheus series, and tier events as vLLM KV events."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine


@dataclass
class KvpoolWorkerMeta(KVConnectorWorkerMetadata):
    """One step's report of every worker rank: the steps each ran, and the steps whose save
    copies ended, counted over ranks (the scheduler commits a step once every rank ran it)."""

    executed: Counter = field(default_factory=Counter)
    copied: Counter = field(default_factory=Counter)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvpoolWorkerMeta":
        if isinstance(other, KvpoolWorkerMeta):
            self.executed.update(other.executed)
            self.copied.update(other.copied)
        return self


@dataclass
class KvpoolConnectorStats(KVConnectorStats):
    """kvpool's counters for one logging interval, summed over worker ranks; a histogram's
    samples (``PROM_HISTOGRAMS``) travel as a list, joined."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            if isinstance(v, list):
                self.data[k] = [*self.data.get(k, ()), *v]
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        # vLLM's log line: the counters (a histogram's samples are counted by one of them).
        return {k: v for k, v in self.data.items() if not isinstance(v, list)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


#: kvpool's worker (and scheduler: hand-offs) counters in vLLM's own Prometheus metrics (``/metrics`` of ``vllm serve``):
#: (stats key, metric name, help). prometheus_client adds ``_total`` to each name.
PROM_COUNTERS = (
    ("load_requested_tokens", "vllm:kvpool_load_requested_tokens",
     "Tokens vLLM asked kvpool to load into its KV cache."),
    ("loaded_tokens", "vllm:kvpool_loaded_tokens",
     "Tokens whose KV kvpool loaded into vLLM's KV cache (prefill saved)."),
    ("async_loads", "vllm:kvpool_async_loads",
     "Loads kvpool ran in the background while other requests ran."),
    ("node_memory_tokens", "vllm:kvpool_node_memory_tokens",
     "Tokens kvpool copied once from the node's pool daemon into vLLM's blocks, checked there "
     "or in a staged copy."),
    ("node_memory_staged_tokens", "vllm:kvpool_node_memory_staged_tokens",
     "Of those, tokens checked in the copy the blocks were filled from (a GPU worker's route)."),
    ("node_memory_saved_tokens", "vllm:kvpool_node_memory_saved_tokens",
     "Tokens kvpool copied once from vLLM's blocks into the node's pool daemon, checksummed from the blocks."),
    ("stored_tokens", "vllm:kvpool_stored_tokens",
     "Tokens whose KV vLLM saved into kvpool (committed)."),
    ("failed_load_blocks", "vllm:kvpool_failed_load_blocks",
     "vLLM blocks kvpool promised but could not load (recomputed by vLLM)."),
    ("corrupt_chunks", "vllm:kvpool_corrupt_chunks",
     "Stored chunks kvpool rejected as corrupt or bound to another key (treated as misses)."),
    ("save_errors", "vllm:kvpool_save_errors",
     "Saves that failed (the KV was not stored; nothing else is affected)."),
    ("saves_discarded", "vllm:kvpool_saves_discarded",
     "Saved chunks dropped before commit: computed on a failed load on some rank."),
    ("handoffs_sent", "vllm:kvpool_handoffs_sent",
     "Finished requests whose saved prompt a kv_producer handed off (kv_transfer_params)."),
    ("handoffs_received", "vllm:kvpool_handoffs_received",
     "Requests a kv_consumer was handed off by a producer."),
    ("handoffs_complete", "vllm:kvpool_handoffs_complete",
     "Of those, requests whose whole hand-off was found in the pool."),
    ("handoffs_waited", "vllm:kvpool_handoffs_waited",
     "Of those, requests that waited for the producer's saves to be found."),
    ("handoffs_timed_out", "vllm:kvpool_handoffs_timed_out",
     "Of those, requests that stopped waiting (handoff_timeout_ms) and computed the rest."),
    ("handoffs_mismatched", "vllm:kvpool_handoffs_mismatched",
     "Of those, hand-offs from a producer whose keys differ from this instance's (another "
     "model, weights_id, TP size, layout, chunk or block size): not waited for."),
    ("handoff_wait_ms", "vllm:kvpool_handoff_wait_ms",
     "Milliseconds requests waited for handed-off saves, summed."),
    ("heap_buffers", "vllm:kvpool_heap_buffers",
     "Worker buffers taken from the heap because L1 had no room (a GPU copies into them "
     "synchronously)."),
)


#: kvpool's histograms in vLLM's Prometheus metrics: (stats key, metric name, help, buckets);
#: the stats key holds a list of samples.
PROM_HISTOGRAMS = (
    ("handoff_wait_seconds", "vllm:kvpool_handoff_wait_seconds",
     "Seconds each request a kv_consumer was handed off waited for the producer's saves "
     "to be found (requests that found them at once are not counted).",
     (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)),
)


class KvpoolPromMetrics(KVConnectorPromMetrics):
    """Counts kvpool's per-interval worker stats into vLLM's Prometheus registry, one series
    per engine, next to vLLM's own prefix-cache metrics."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for key, name, doc in PROM_COUNTERS
        }
        self._histograms = {
            key: create_metric_per_engine(
                self._histogram_cls(name=name, documentation=doc, labelnames=labelnames,
                                    buckets=list(buckets)),
                per_engine_labelvalues,
            )
            for key, name, doc, buckets in PROM_HISTOGRAMS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for key, per_engine in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value > 0:
                per_engine[engine_idx].inc(value)
        for key, per_engine in self._histograms.items():
            for sample in transfer_stats_data.get(key, ()):
                per_engine[engine_idx].observe(sample)


#: A tier event from a worker: (tier name, stored (else removed), chunk hashes).
TierEvent = tuple[str, bool, tuple[bytes, ...]]


class KvpoolKVEvents(KVConnectorKVEvents):
    """Tier events of one step from the worker ranks; only what every rank reported is kept
    (each rank stores its own shard of the same chunks)."""

    def __init__(self, events: list[TierEvent] | None = None, num_workers: int = 1):
        self._counts: Counter[TierEvent] = Counter(events or [])
        self._workers = num_workers

    def add_events(self, events: list[TierEvent]) -> None:
        self._counts.update(events)

    def aggregate(self) -> "KvpoolKVEvents":
        self._counts = Counter({e: 1 for e, n in self._counts.items() if n >= self._workers})
        self._workers = 1
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[TierEvent]:  # type: ignore[override]
        return list(self._counts)

    def counted_events(self) -> Counter:
        """Each event with how many workers reported it so far."""
        return Counter(self._counts)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._counts.clear()
        self._workers = 1
