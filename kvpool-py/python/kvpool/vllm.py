"""``KvpoolConnector``: kvpool as a vLLM KV connector (vLLM's ``KVConnectorBase_V1``).

A thin layer: it turns vLLM's objects into calls on kvpool's Rust scheduler and worker.
KV bytes never become Python objects; KV tensors are passed as addresses and shapes.

- Scheduler side (vLLM's EngineCore process): asks every worker rank's pool, over a Unix
  socket, how much of a prompt it holds, and builds each step's metadata (encoded bytes).
- Worker side (each vLLM Worker process): owns the pool (CPU memory, then disk / Redis / S3
  tiers from the config), loads chunks into vLLM's KV blocks before the forward pass, and
  saves newly computed chunks after it.

Options (``kv_connector_extra_config``):

- ``config``: the pool config — a path to a TOML file, TOML text, or a JSON object (dict);
  else the ``KVPOOL_CONFIG`` environment variable (a path); else embedded defaults (2 GiB of
  CPU memory, no lower tier).
- ``save_decode_tokens`` (bool, default false): also save KV of generated tokens.
- ``socket_dir``: where the worker ranks' lookup sockets live (default: the temp dir).
- ``lookup_timeout_ms`` (default 5000): a lookup slower than this is a miss.

KV events: with vLLM's ``--kv-events-config`` (``enable_kv_cache_events``), chunks entering
and leaving each kvpool tier are published through vLLM's own event publisher as
``BlockStored`` / ``BlockRemoved`` with vLLM's block hashes and ``medium`` set to the tier
(``CPU`` for kvpool's memory tier, ``DISK``, ``REDIS``, ``S3``, ``MOONCAKESTORE`` below it).
Chunks the scheduler no longer knows the vLLM blocks of (older than its last 65,536 chunks)
are left out: no event beats one with the wrong hashes.

Metrics: ``get_kv_connector_stats`` hands kvpool's worker counters to vLLM, which logs them and,
through ``build_prom_metrics``, exports them in its own Prometheus metrics
(``vllm:kvpool_loaded_tokens_total``, ``vllm:kvpool_stored_tokens_total``, ... per engine).
kvpool's own endpoint (``[metrics] listen``) serves the pool's tier-level metrics.

Loads and saves are synchronous within the step, so ``request_finished`` never delays a
free and ``get_finished`` reports nothing. A chunk that cannot be loaded (missing, corrupt,
tier down) is reported through ``get_block_ids_with_load_errors``; set
``"kv_load_failure_policy": "recompute"`` so vLLM recomputes it instead of failing the request.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVConnectorKVEvents,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvpool import _native

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvpool.vllm")

#: Block update kinds understood by ``Scheduler.build_connector_meta``.
_UNCHANGED, _APPEND, _REPLACE = 0, 1, 2

#: Worker connectors of this process (tests inspect what the pool stored through them).
WORKERS: list["KvpoolConnector"] = []


@dataclass
class KvpoolConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers: kvpool's encoded metadata."""

    data: bytes = b""


@dataclass
class KvpoolConnectorStats(KVConnectorStats):
    """kvpool's counters for one logging interval, summed over worker ranks."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


#: kvpool's worker counters in vLLM's own Prometheus metrics (``/metrics`` of ``vllm serve``):
#: (stats key, metric name, help). prometheus_client adds ``_total`` to each name.
PROM_COUNTERS = (
    ("load_requested_tokens", "vllm:kvpool_load_requested_tokens",
     "Tokens vLLM asked kvpool to load into its KV cache."),
    ("loaded_tokens", "vllm:kvpool_loaded_tokens",
     "Tokens whose KV kvpool loaded into vLLM's KV cache (prefill saved)."),
    ("stored_tokens", "vllm:kvpool_stored_tokens",
     "Tokens whose KV vLLM saved into kvpool."),
    ("failed_load_blocks", "vllm:kvpool_failed_load_blocks",
     "vLLM blocks kvpool promised but could not load (recomputed by vLLM)."),
    ("corrupt_chunks", "vllm:kvpool_corrupt_chunks",
     "Stored chunks kvpool rejected as corrupt or bound to another key (treated as misses)."),
    ("save_errors", "vllm:kvpool_save_errors",
     "Saves that failed (the KV was not stored; nothing else is affected)."),
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

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for key, per_engine in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value > 0:
                per_engine[engine_idx].inc(value)


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

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._counts.clear()
        self._workers = 1


def resolve_config(extra: dict[str, Any]) -> tuple[str, str]:
    """The pool config as (text, format) for the Rust side; see the module docs."""
    value = extra.get("config", os.environ.get("KVPOOL_CONFIG"))
    if value is None:
        return "", "default"
    if isinstance(value, dict):
        return json.dumps(value), "json"
    if not isinstance(value, str):
        raise TypeError(f"kvpool: `config` must be a path, TOML text or a dict, not {type(value).__name__}")
    if value.lstrip().startswith("{"):
        return value, "json"
    if os.path.exists(value):
        with open(value, encoding="utf-8") as f:
            return f.read(), "toml"
    if "=" in value or "[" in value:
        return value, "toml"
    raise FileNotFoundError(f"kvpool: config file {value!r} does not exist")


def extra_keys_of(request: "Request") -> bytes:
    """What the request's KV depends on besides token ids: LoRA adapter, cache salt and
    multimodal inputs (vLLM's own block hashes include the same)."""
    lora = getattr(request, "lora_request", None)
    mm = getattr(request, "mm_features", None) or []
    return _native.encode_extra_keys(
        lora_name=lora.lora_name if lora is not None else None,
        cache_salt=getattr(request, "cache_salt", None),
        mm_hashes=[str(f.identifier) for f in mm],
    )


class KvpoolConnector(KVConnectorBase_V1):
    """kvpool as a vLLM KV connector: see the module docs."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._block_size = vllm_config.cache_config.block_size
        self._config_text, self._config_format = resolve_config(extra)
        _native.check_config(self._config_text, self._config_format)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise NotImplementedError("kvpool: pipeline parallelism is not supported yet")
        self._tp_size = parallel.tensor_parallel_size
        self._socket_dir = extra.get("socket_dir") or tempfile.gettempdir()
        self._engine_id = str(self._kv_transfer_config.engine_id)
        self._save_decode_tokens = bool(extra.get("save_decode_tokens", False))
        self._model = vllm_config.model_config.served_model_name or vllm_config.model_config.model
        if isinstance(self._model, (list, tuple)):
            self._model = self._model[0]
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning(
                "kvpool: kv_load_failure_policy is %r: a chunk that cannot be loaded (evicted, "
                "corrupt, tier down) fails its request; set it to \"recompute\" to recompute it",
                self._kv_transfer_config.kv_load_failure_policy)
        self._scheduler: _native.Scheduler | None = None
        self._worker: _native.Worker | None = None
        self._requests: dict[str, "Request"] = {}
        self._sent_tokens: dict[str, int] = {}
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._bound = False
        events_config = getattr(vllm_config, "kv_events_config", None)
        self._kv_events = bool(events_config and events_config.enable_kv_cache_events)
        # Scheduler side: tier events from the workers, and the vLLM blocks of recent chunks.
        self._pending_events: KvpoolKVEvents | None = None
        self._chunk_blocks: OrderedDict[bytes, tuple[list, Any, list[int], str | None]] = OrderedDict()
        if role == KVConnectorRole.SCHEDULER:
            paths = [_native.lookup_socket_path(self._socket_dir, self._engine_id, r)
                     for r in range(self._tp_size)]
            self._scheduler = _native.Scheduler(
                socket_paths=paths,
                block_size=self._block_size,
                save_decode_tokens=self._save_decode_tokens,
                timeout_ms=int(extra.get("lookup_timeout_ms", 5000)),
            )
            logger.info("kvpool scheduler connected to %d worker rank(s), chunk size %d",
                        len(paths), self._scheduler.chunk_size())

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        prompt = request.prompt_token_ids
        if prompt is None or getattr(request, "prompt_embeds", None) is not None:
            # KV computed from embeddings is not determined by token ids: never cached.
            return 0, False
        if self._requests.get(request.request_id) is not request:
            # A new request (or a new one under a reused id): Rust knows its prompt only.
            # A resumed request keeps its count, so no token is ever sent twice.
            self._requests[request.request_id] = request
            self._sent_tokens[request.request_id] = len(prompt)
        hit = self._scheduler.get_num_new_matched_tokens(
            request.request_id, prompt, extra_keys_of(request), num_computed_tokens)
        return hit, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int):
        assert self._scheduler is not None
        block_ids = blocks.get_block_ids()
        self._scheduler.update_state_after_alloc(
            request.request_id, list(block_ids[0]) if block_ids else [], num_external_tokens)
        if self._kv_events:
            self._remember_chunk_blocks(request)

    def _remember_chunk_blocks(self, request: "Request") -> None:
        """Maps each full chunk of the request to vLLM's block hashes and token ids, for the
        KV events of the tiers (bounded: the last 65,536 chunks)."""
        hashes = self._scheduler.chunk_hashes(request.request_id)
        block_hashes = list(getattr(request, "block_hashes", None) or [])
        chunk = self._scheduler.chunk_size()
        if not hashes or chunk % self._block_size:
            return
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        per_chunk = chunk // self._block_size
        block_hashes = [maybe_convert_block_hash(b) for b in block_hashes]
        prompt = request.prompt_token_ids or []
        lora = getattr(request, "lora_request", None)
        for i, h in enumerate(hashes):
            blocks = block_hashes[i * per_chunk:(i + 1) * per_chunk]
            if len(blocks) < per_chunk:
                break
            parent = block_hashes[i * per_chunk - 1] if i else None
            self._chunk_blocks[h] = (blocks, parent, list(prompt[i * chunk:(i + 1) * chunk]),
                                     lora.lora_name if lora is not None else None)
            self._chunk_blocks.move_to_end(h)
        while len(self._chunk_blocks) > 65536:
            self._chunk_blocks.popitem(last=False)

    def _new_tokens(self, req_id: str) -> list[int]:
        if not self._save_decode_tokens:
            return []
        request = self._requests.get(req_id)
        if request is None:
            return []
        tokens = request.all_token_ids
        sent = self._sent_tokens.get(req_id, len(tokens))
        self._sent_tokens[req_id] = len(tokens)
        return list(tokens[sent:])

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        so = scheduler_output
        scheduled = []
        for r in so.scheduled_new_reqs:
            computed = r.num_computed_tokens + so.num_scheduled_tokens.get(r.req_id, 0)
            scheduled.append((r.req_id, self._new_tokens(r.req_id), _REPLACE,
                              list(r.block_ids[0]) if r.block_ids else [], computed))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if new_blocks is None:
                kind, blocks = _UNCHANGED, []
            else:
                kind = _REPLACE if req_id in cached.resumed_req_ids else _APPEND
                blocks = list(new_blocks[0])
            computed = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0)
            scheduled.append((req_id, self._new_tokens(req_id), kind, blocks, computed))
        preempted = list(so.preempted_req_ids or ())
        return KvpoolConnectorMetadata(self._scheduler.build_connector_meta(scheduled, preempted))

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        assert self._scheduler is not None
        failed = connector_output.invalid_block_ids
        if failed:
            self._scheduler.update_connector_output(sorted(failed))
        events = getattr(connector_output, "kv_cache_events", None)
        if isinstance(events, KvpoolKVEvents):
            if self._pending_events is None:
                self._pending_events = events
            else:
                self._pending_events.add_events(events.get_all_events())
                self._pending_events.increment_workers(events.get_number_of_workers())

    def take_events(self):
        """The workers' tier events as vLLM KV events (see the module docs)."""
        pending, self._pending_events = self._pending_events, None
        if pending is None:
            return
        for tier, stored, hashes in pending.aggregate().get_all_events():
            medium = "CPU" if tier == "cpu" else tier.upper()
            for h in hashes:
                known = self._chunk_blocks.get(h)
                if known is None:
                    continue
                blocks, parent, tokens, lora_name = known
                if stored:
                    yield BlockStored(block_hashes=blocks, parent_block_hash=parent,
                                      token_ids=tokens, block_size=self._block_size,
                                      lora_id=None, medium=medium, lora_name=lora_name)
                else:
                    yield BlockRemoved(block_hashes=blocks, medium=medium)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._sent_tokens.pop(request.request_id, None)
        if self._scheduler is not None:
            self._scheduler.request_finished(request.request_id)
        return False, None

    def reset_cache(self) -> bool | None:
        # vLLM resets caches after a weight update: every later key is salted anew, so no
        # chunk stored before (in any tier) is loaded again; old chunks age out by eviction.
        if self._scheduler is not None:
            self._scheduler.reset()
        return True

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if not kv_caches:
            raise ValueError("kvpool: vLLM registered no KV caches")
        names = list(kv_caches)
        tensors = [kv_caches[n] for n in names]
        first = tensors[0]
        for n, t in zip(names, tensors):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"kvpool: layer {n} has KV cache {tuple(t.shape)} {t.dtype} "
                                 f"{t.device}, unlike {tuple(first.shape)} {first.dtype} {first.device}")
        if first.device.type != "cpu":
            raise NotImplementedError(
                f"kvpool: this version moves CPU KV caches (vLLM's CPU build); got {first.device}")
        # vLLM CPU: [num_blocks, num_kv_heads, block_size, 2 * head_size], blocks contiguous.
        if first.dim() != 4 or first.shape[2] != self._block_size or first.shape[3] % 2:
            raise ValueError(f"kvpool: unexpected CPU KV cache shape {tuple(first.shape)} "
                             f"for block size {self._block_size}")
        num_blocks, num_kv_heads, _, twice_head = first.shape
        elem = first.element_size()
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        import vllm

        tp_rank = get_tensor_model_parallel_rank()
        kv_format = (f"vllm-cpu|vllm={vllm.__version__}|isa={torch.backends.cpu.get_cpu_capability()}"
                     f"|shape={tuple(first.shape[1:])}|stride={tuple(first.stride())}|{first.dtype}")
        self._kv_caches = kv_caches
        self._worker = _native.Worker(
            config_text=self._config_text,
            config_format=self._config_format,
            model=str(self._model),
            tp_size=self._tp_size,
            tp_rank=tp_rank,
            pp_rank=0,
            block_size=self._block_size,
            num_kv_heads=int(num_kv_heads),
            head_size=int(twice_head) // 2,
            dtype=str(first.dtype),
            kv_format=kv_format,
            layer_ptrs=[t.data_ptr() for t in tensors],
            num_blocks=int(num_blocks),
            block_stride_bytes=int(first.stride(0)) * elem,
            socket_path=_native.lookup_socket_path(self._socket_dir, self._engine_id, tp_rank),
        )
        if self._kv_events:
            self._worker.enable_tier_events()
        WORKERS.append(self)
        logger.info("kvpool worker rank %d: %d layers, %d blocks, format %s",
                    tp_rank, len(tensors), num_blocks, kv_format)

    def _meta_bytes(self) -> bytes:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvpoolConnectorMetadata)
        return meta.data

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._bound = False

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self._worker is None:
            return
        # Loads every layer now: vLLM calls this before the forward pass whenever a
        # request of the step loads (SchedulerOutput.has_sync_kv_loads).
        self._worker.start_load(self._meta_bytes())
        self._bound = True

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self):
        if self._worker is None or not self.has_connector_metadata():
            return
        if not self._bound:
            self._worker.start_load(self._meta_bytes())
            self._bound = True
        self._worker.save()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        # Nothing to rescue: saves complete inside the step that computes the KV, so a
        # preempted request's blocks hold nothing unsaved. The scheduler side forgets the
        # request's blocks (SchedulerOutput.preempted_req_ids) in build_connector_meta.
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Nothing is ever asynchronous: request_finished never delays a free. The finished
        # requests' traces are logged (KVPOOL_LOG=kvpool::request=debug) and forgotten.
        if self._worker is not None and finished_req_ids:
            self._worker.finished(list(finished_req_ids))
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return set(self._worker.failed_blocks())

    def get_kv_connector_kv_cache_events(self) -> KvpoolKVEvents | None:
        if self._worker is None or not self._kv_events:
            return None
        events = [(tier, stored, tuple(hashes))
                  for tier, stored, hashes in self._worker.take_tier_events()]
        return KvpoolKVEvents(events) if events else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        now = self._worker.stats()
        last = getattr(self, "_last_stats", {})
        self._last_stats = now
        delta = {k: v - last.get(k, 0) for k, v in now.items()}
        return KvpoolConnectorStats(data=delta)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvpoolConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvpoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self._worker is not None:
            try:
                self._worker.shutdown()
            finally:
                if self in WORKERS:
                    WORKERS.remove(self)
