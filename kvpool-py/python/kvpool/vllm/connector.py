"""``KvpoolConnector``: kvpool as a vLLM KV connector (vLLM's ``KVConnectorBase_V1``). A thin
class: each call goes to the scheduler side (``scheduler_side``, in EngineCore) or the worker
side (``worker_side``, in each Worker), which drive kvpool's Rust halves."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvpool import _native
from kvpool.vllm.compat import check_vllm
from kvpool.vllm.hybrid import (NULL_BLOCK, AttentionGroup, HybridSchedulerSide,
                                HybridWorkerSide, served_groups)
from kvpool.vllm.state_groups import StateGroup, StateSchedulerSide, StateWorkerSide
from kvpool.vllm.identity import resolve_config
from kvpool.vllm.layouts import hybrid_groups
from kvpool.vllm.handoff import Handoffs, handoff_params
from kvpool.vllm.options import ROLES, check_options, role_actions
from kvpool.vllm.reports import KvpoolConnectorStats, KvpoolKVEvents, KvpoolPromMetrics
from kvpool.vllm.scheduler_side import SchedulerSide
from kvpool.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvpool.vllm")

def load_timing(extra: dict[str, Any], vllm_config: "VllmConfig") -> str:
    """When loads are asynchronous (``async_loads`` in ``kv_connector_extra_config``):
    ``true`` (the default: synchronous for chunks leased in memory and when no other request
    runs, else asynchronous), ``"always"``, or ``false`` (every load before the forward
    pass). Under vLLM's asynchronous scheduling every load is asynchronous (a failed
    synchronous load would already have the next step computed on it). With data parallelism
    an idle rank still steps in lockstep with the others, so only leased chunks load
    synchronously there (``"leased"``)."""
    async_scheduling = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
    value = extra.get("async_loads", True)  # checked by check_options
    if value in (False, "false", 0):
        if async_scheduling:
            raise ValueError("kvpool: \"async_loads\": false needs vLLM's async_scheduling off "
                             "(a failed synchronous load would have the next step computed on it)")
        return "never"
    if value == "always" or async_scheduling:
        return "always"
    if value in (True, "true", 1, "auto"):
        data_parallel = getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1
        return "leased" if data_parallel > 1 else "auto"
    raise ValueError(f"kvpool: async_loads must be true, false or \"always\", not {value!r}")


def stand_aside_reason(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None",
                       chunk_size: int = 256) -> str | None:
    """Why kvpool must not serve this engine (it then looks up, loads and saves nothing), as
    the warning it logs once; None when it serves. Serving where vLLM cannot resume from a
    cached prefix exactly would hand the model KV it does not compute with: a miss instead.
    ``chunk_size``: the pool config's, in tokens."""
    groups = hybrid_groups(kv_cache_config)
    if groups is not None:
        served = served_groups_of(vllm_config, kv_cache_config)
        block_size = vllm_config.cache_config.block_size
        if not isinstance(served, str) and served[1] and chunk_size % block_size:
            served = (f"its recurrent states are kept every {block_size} tokens (vLLM's block "
                      f"size for this model), which kvpool's chunk size {chunk_size} is not a "
                      f"multiple of: set \"chunking\": {{\"chunk_size\": {block_size}}} in "
                      "kvpool's config to serve it")
        if isinstance(served, str):
            return (f"this model's KV cache has {groups} (vLLM's hybrid KV cache manager), and "
                    f"{served}; kvpool stands aside for it: no lookups, loads or saves "
                    "(vLLM's own prefix cache still serves)")
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and getattr(vllm_config.model_config, "use_mla", False):
        return ("MLA on vLLM's CPU build, which turns its own prefix cache off for MLA: it does "
                "not resume MLA from a cached prefix, so kvpool stands aside (no lookups, loads "
                "or saves)")
    return None


def served_groups_of(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig"
                     ) -> tuple[list[AttentionGroup], list[StateGroup]] | str:
    """``served_groups`` with what vLLM's config says about the engine."""
    from vllm.platforms import current_platform

    return served_groups(kv_cache_config, vllm_config.cache_config.block_size,
                         speculative=getattr(vllm_config, "speculative_config", None) is not None,
                         on_cpu=current_platform.is_cpu())


@dataclass
class KvpoolConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers: kvpool's encoded metadata, and the requests preempted
    in the step (``handle_preemptions`` needs them before the metadata is bound)."""

    data: bytes = b""
    preempted: list[str] = field(default_factory=list)
    #: A hybrid model's metadata: one encoded part per KV cache group kvpool serves.
    parts: list[bytes] = field(default_factory=list)
    #: A hybrid model's requests finished in the last step whose blocks parts hold for their
    #: saves, and how many parts.
    holds: dict[str, int] = field(default_factory=dict)
    #: A hybrid model's requests given an asynchronous load since the last step.
    loads: list[str] = field(default_factory=list)


class KvpoolConnector(KVConnectorBase_V1, SupportsHMA):
    """kvpool as a vLLM KV connector: see the package docs (``kvpool.vllm``).

    It declares vLLM's ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on: hybrid
    models start (SSM / linear-attention hybrids such as Qwen3-Next do not start without it)
    and sliding-window layers hold only their window. kvpool serves a model whose groups are
    full attention, sliding-window attention and recurrent state (Mamba / linear attention,
    ``kvpool.vllm.state_groups``), one part per group (``kvpool.vllm.hybrid``); where it
    cannot serve a group exactly it stands aside (no lookup, no load, no save; one warning at
    start-up), and vLLM serves the model with its own prefix cache.

    It also stands aside for MLA on vLLM's CPU build, which turns its own prefix cache off for
    MLA ("forcing chunked prefill and prefix caching to be disabled"): that build does not
    resume MLA from a cached prefix, and a kvpool hit there (bytes equal to the engine's own
    blocks) moved logprobs by up to 0.03 against computing the prompt whole."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        check_vllm(vllm.__version__, KvpoolConnector, (KVConnectorBase_V1, SupportsHMA))
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        options = check_options(extra)
        #: Why kvpool stands aside for this engine (no lookup, load or save), or None.
        self._config_text, self._config_format = resolve_config(extra)
        chunk_size = _native.check_config(self._config_text, self._config_format)
        self._stands_aside = stand_aside_reason(vllm_config, kv_cache_config, chunk_size)
        self._block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise NotImplementedError("kvpool: pipeline parallelism is not supported yet")
        self._tp_size = parallel.tensor_parallel_size
        socket_dir = options.socket_dir
        engine_id = str(self._kv_transfer_config.engine_id)
        self._socket_path_of = lambda rank: _native.lookup_socket_path(socket_dir, engine_id, rank)
        self._save_decode_tokens = options.save_decode_tokens
        self._stage_node_memory_copies = options.stage_node_memory_copies
        self._transfer = options.transfer
        events_config = getattr(vllm_config, "kv_events_config", None)
        self._kv_events = bool(events_config and events_config.enable_kv_cache_events)
        self._sched: SchedulerSide | HybridSchedulerSide | None = None
        self._hands_off = False
        #: A consumer's waits for handed-off prompts (None: this instance never loads).
        self._handoffs: Handoffs | None = None
        #: The producer's hand-off counters (a consumer's are in ``_handoffs``).
        self._handoff_counts: Counter[str] = Counter()
        #: How this engine derives keys (``SchedulerSide.scope_digest``), named in hand-offs.
        self._scope_digest: str | None = None
        self._work: WorkerSide | HybridWorkerSide | None = None
        #: A hybrid model's attention KV cache groups, one kvpool part each (None: one group).
        self._groups: list[AttentionGroup] | None = None
        #: A hybrid model's recurrent-state groups, one kvpool part each, after the others.
        self._state_groups: list[StateGroup] = []
        self._engine_id = engine_id
        self._options = options
        if self._stands_aside is None and hybrid_groups(kv_cache_config) is not None:
            served = served_groups_of(vllm_config, kv_cache_config)
            assert not isinstance(served, str)  # stand_aside_reason said why
            groups, self._state_groups = served
            # The pool is built for the part with the most layers (its chunks are largest);
            # a full-attention part first (its counters are the connector's own).
            self._groups = sorted(groups, key=lambda g: (-len(g.layer_names),
                                                         g.sliding_window is not None, g.index))
        if self._stands_aside is not None:
            if role == KVConnectorRole.SCHEDULER:
                logger.warning("kvpool: %s", self._stands_aside)
            return
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                # vLLM reads the policy after it built this connector: a chunk kvpool cannot
                # load (a tier down, a corrupt value) must be recomputed, never fail a request.
                logger.warning(
                    "kvpool: kv_load_failure_policy %r would fail a request whenever a chunk "
                    "cannot be loaded (evicted from a lower tier, corrupt, tier down); kvpool "
                    "sets it to \"recompute\"", self._kv_transfer_config.kv_load_failure_policy)
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            timing = load_timing(extra, vllm_config)
            kv_role = self._kv_transfer_config.kv_role
            loads, saves = role_actions(kv_role, options)
            if kv_role and kv_role != "kv_both":
                logger.info("kvpool: kv_role %s: this instance %s", kv_role, ROLES[kv_role])
            #: A producer names what it saved in each finished request's kv_transfer_params.
            self._hands_off = kv_role == "kv_producer"
            self._handoffs = Handoffs(options.handoff_timeout_ms / 1000, self._block_size) \
                if loads else None
            side = dict(
                loads=loads,
                saves=saves,
                block_size=self._block_size,
                save_decode_tokens=self._save_decode_tokens,
                async_scheduling=bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)),
                timeout_ms=options.lookup_timeout_ms,
            )
            if self._groups is None:
                self._sched = SchedulerSide(
                    socket_paths=[self._socket_path_of(r) for r in range(self._tp_size)],
                    load_timing=timing, kv_events=self._kv_events, **side)
            else:
                if timing == "never":
                    raise ValueError(
                        "kvpool: \"async_loads\": false is not possible for a hybrid model: "
                        "vLLM takes its load failures per request, which only asynchronous "
                        "loads report")
                parts: list[SchedulerSide] = []
                for g in self._groups:
                    fields = {"group_idx": g.index, "kv_cache_spec_kind": g.spec_kind}
                    if g.sliding_window is not None:
                        fields["kv_cache_spec_sliding_window"] = g.sliding_window
                    parts.append(SchedulerSide(
                        socket_paths=[self._part_socket(g, r) for r in range(self._tp_size)],
                        load_timing="always", kv_events=self._kv_events, group=g.index,
                        sliding_window=g.sliding_window is not None, event_fields=fields,
                        chunk_blocks_of=parts[0] if parts else None, **side))
                states = [StateSchedulerSide(
                    group=g, socket_paths=[self._part_socket(g, r) for r in range(self._tp_size)],
                    block_size=self._block_size, keys_of=parts[0],
                    save_decode_tokens=self._save_decode_tokens,
                    timeout_ms=options.lookup_timeout_ms, loads=loads, saves=saves)
                    for g in self._state_groups]
                self._sched = HybridSchedulerSide(parts, states)
                served = [*self._groups, *self._state_groups]
                logger.info("kvpool serves this hybrid model's %d KV cache groups: %s",
                            len(served), ", ".join(g.key_format for g in served))
            self._scope_digest = self._sched.scope_digest()
            if self._handoffs is not None:
                self._handoffs.scope = self._scope_digest

    def _part_socket(self, group: AttentionGroup | StateGroup, rank: int) -> str:
        """The lookup socket of a hybrid model's part for ``group`` on ``rank``."""
        return _native.lookup_socket_path(self._options.socket_dir,
                                          f"{self._engine_id}-g{group.index}", rank)

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is a later miss, nothing else.
        return False

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._sched is None:  # kvpool stands aside (stand_aside_reason)
            return 0, False
        want = self._handoffs.expected(request) if self._handoffs is not None else None
        if want is None or want <= num_computed_tokens:
            return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)
        # A prompt a producer handed off: wait (bounded) for its saves to be found.
        if not self._handoffs.may_look_up(request.request_id):
            return None, False
        hit, asynchronous = self._sched.get_num_new_matched_tokens(request, num_computed_tokens)
        if not self._handoffs.settle(request.request_id, want, num_computed_tokens + hit):
            return None, False
        return hit, asynchronous

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int):
        if self._sched is not None:
            self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if self._sched is None:
            return KvpoolConnectorMetadata()
        if isinstance(self._sched, HybridSchedulerSide):
            parts, preempted, holds, loads = self._sched.build_connector_meta(scheduler_output)
            return KvpoolConnectorMetadata(preempted=preempted, parts=parts, holds=holds,
                                           loads=loads)
        data, preempted = self._sched.build_connector_meta(scheduler_output)
        return KvpoolConnectorMetadata(data=data, preempted=preempted)

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        if self._sched is not None:
            self._sched.update_connector_output(connector_output)

    def take_events(self):
        if self._sched is not None:
            yield from self._sched.take_events()

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._sched is None:
            return False, None
        if self._handoffs is not None:
            self._handoffs.forget(request.request_id)
        tokens = self._sched.saved_prompt_tokens(request) if self._hands_off else 0
        held = self._sched.request_finished(request)
        if not tokens:
            return held, None
        self._handoff_counts["handoffs_sent"] += 1
        return held, handoff_params(tokens, self._engine_id, self._scope_digest)

    def request_finished_all_groups(
            self, request: "Request",
            block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # vLLM's call under its hybrid KV cache manager (``SupportsHMA``): one block list per
        # KV cache group (each part knows its group's blocks already).
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_work()

    def reset_cache(self) -> bool | None:
        # vLLM resets caches after a weight update: every later key is salted anew and no
        # save computed before is ever committed, so nothing stored before (in any tier) is
        # loaded again; old chunks age out by eviction.
        if self._sched is not None:
            self._sched.reset()
        return True

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self._stands_aside is not None:
            return  # kvpool stands aside: no pool is built
        common = dict(
            config_text=self._config_text, config_format=self._config_format,
            tp_size=self._tp_size, block_size=self._block_size,
            kv_cache_config=self._kv_cache_config,
            stage_node_memory_copies=self._stage_node_memory_copies,
            transfer=self._transfer, weights_id=self._options.weights_id)
        if self._groups is None:
            self._work = WorkerSide(self._vllm_config, kv_caches,
                                    socket_path_of=self._socket_path_of,
                                    kv_events=self._kv_events, **common)
        else:
            parts: list[WorkerSide | StateWorkerSide] = []
            num_parts = len(self._groups) + len(self._state_groups)
            for g in self._groups:
                caches = {name: kv_caches[name] for name in g.layer_names if name in kv_caches}
                parts.append(WorkerSide(
                    self._vllm_config, caches,
                    socket_path_of=lambda rank, g=g: self._part_socket(g, rank),
                    kv_events=self._kv_events, group_format=g.key_format,
                    share_pool_with=parts[0] if parts else None, parts=num_parts,
                    null_block=NULL_BLOCK, **common))
            owner = parts[0]
            for g in self._state_groups:
                parts.append(StateWorkerSide(
                    self._vllm_config, kv_caches, group=g, share_pool_with=owner,
                    socket_path=self._part_socket(g, owner.tp_rank),
                    config_text=self._config_text, config_format=self._config_format,
                    tp_size=self._tp_size, tp_rank=owner.tp_rank, block_size=self._block_size,
                    parts=num_parts, num_blocks=getattr(self._kv_cache_config, "num_blocks", None),
                    weights_id=self._options.weights_id))
            self._work = HybridWorkerSide(parts)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        if self._work is not None and isinstance(kv_connector_metadata, KvpoolConnectorMetadata):
            self._work.handle_preemptions(kv_connector_metadata.preempted)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._work is not None and isinstance(connector_metadata, KvpoolConnectorMetadata):
            if isinstance(self._work, HybridWorkerSide):
                self._work.bind(connector_metadata.parts, connector_metadata.holds,
                                connector_metadata.loads)
            else:
                self._work.bind(connector_metadata.data)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._work is not None:
            self._work.clear()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        # Synchronous loads first (vLLM calls this before the forward pass in steps that
        # have one), then asynchronous loads whose chunks arrived.
        if self._work is not None:
            self._work.start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self):
        # Copies the step's new chunks out of the blocks (on CUDA, queued on the side stream)
        # and returns; kvpool commits them once every rank ran the step.
        if self._work is not None:
            self._work.save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._work is None:
            return None, None
        if isinstance(self._work, HybridWorkerSide):
            # vLLM 0.32 asks get_transfer_results; an engine asking this instead could not be
            # told of failed loads, so it is refused one rather than handed their blocks.
            results = self.get_transfer_results(finished_req_ids)
            if results.failed_recving:
                raise RuntimeError(
                    f"kvpool: loads of {sorted(results.failed_recving)} failed, and this "
                    "engine takes a hybrid model's results through get_finished, which cannot "
                    "report failures")
            return results.finished_sending or None, results.finished_recving or None
        return self._work.finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if isinstance(self._work, HybridWorkerSide):
            # vLLM takes a hybrid model's load failures per request (block ids do not name
            # one request's blocks across groups): the request is recomputed.
            sending, recving, failed = self._work.transfer_results(finished_req_ids)
            return KVConnectorTransferResults(finished_sending=sending,
                                              finished_recving=recving, failed_recving=failed)
        return super().get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._work is None or isinstance(self._work, HybridWorkerSide):
            return set()
        return self._work.failed_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return None if self._work is None else self._work.worker_meta()

    def get_kv_connector_kv_cache_events(self) -> KvpoolKVEvents | None:
        return None if self._work is None else self._work.kv_cache_events()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._work is not None:
            return self._work.stats()
        # The scheduler side's counters: hand-offs sent (producer) and received (consumer).
        counts: dict[str, Any] = dict(self._handoff_counts)
        self._handoff_counts = Counter()
        if self._handoffs is not None:
            counts.update(self._handoffs.take_counts())  # replaces: the roles count apart
        return KvpoolConnectorStats(data=dict(counts)) if counts else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvpoolConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvpoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self._work is not None:
            self._work.shutdown()
