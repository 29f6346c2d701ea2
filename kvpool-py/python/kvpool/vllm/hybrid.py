"""Hybrid models under vLLM's hybrid KV cache manager (HMA): one kvpool *part* per KV cache
group, each with its own layers, layout and keys (the group is named in every key), all parts
sharing one pool (one L1, one set of tiers).

What kvpool serves: groups of full attention and sliding-window attention (Gemma 2/3, gpt-oss
and the like), and recurrent-state groups (Mamba, Gated DeltaNet, ...: Qwen3-Next, Granite 4,
Nemotron-H; ``kvpool.vllm.state_groups``) beside attention. Each attention part saves its
group's blocks chunk by chunk and loads them on its own; a sliding-window group loads only the
blocks vLLM keeps inside the window (vLLM puts its null block outside, which is never read or
written) and stops saving before a chunk whose blocks vLLM freed (``SlidingWindowBlocks``).
A prefix hit is the shortest of the attention parts' hits, so every group the model needs is
present for it; with state parts, it is further cut to the longest boundary at which every
state part holds the state (a state is valid at exactly one position). Not served yet (kvpool
stands aside, one warning, vLLM's own prefix cache serves): MLA, groups of another block size,
and the state cases ``state_groups`` names.

Loads of a hybrid model are asynchronous: vLLM takes a hybrid model's load failures per
request (``failed_recving``: the request is recomputed), never per block.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.vllm.reports import KvpoolConnectorStats, KvpoolKVEvents, KvpoolWorkerMeta

if TYPE_CHECKING:
    from kvpool.vllm.scheduler_side import SchedulerSide
    from kvpool.vllm.state_groups import StateGroup, StateSchedulerSide, StateWorkerSide
    from kvpool.vllm.worker_side import WorkerSide

logger = logging.getLogger("kvpool.vllm")

#: vLLM's null block (``BlockPool.null_block``, the first block of the pool).
NULL_BLOCK = 0


@dataclass(frozen=True)
class AttentionGroup:
    """One KV cache group kvpool serves as a part."""

    #: The group's index in vLLM's ``kv_cache_groups``.
    index: int
    layer_names: tuple[str, ...]
    #: The window in tokens of a sliding-window group; None for full attention.
    sliding_window: int | None
    #: What every key of the group carries: index, count and kind of the group.
    key_format: str
    #: vLLM's name for the group's kind in KV events (``KVCacheSpecKind``).
    spec_kind: str


def served_groups(kv_cache_config: Any, block_size: int, *, speculative: bool = False,
                  on_cpu: bool = True
                  ) -> tuple[list[AttentionGroup], list["StateGroup"]] | str:
    """The groups of a hybrid model as kvpool parts (attention groups, recurrent-state
    groups), or why kvpool cannot serve them. ``speculative``: the engine decodes
    speculatively; ``on_cpu``: its KV caches are in host memory (vLLM's CPU build)."""
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, MambaSpec, SlidingWindowSpec,
                                            get_kv_cache_spec_kind)

    from kvpool.vllm.state_groups import state_group

    groups = list(kv_cache_config.kv_cache_groups)
    parts, states = [], []
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec)
        if kind is FullAttentionSpec:
            window = None
            name = "full"
        elif kind is SlidingWindowSpec:
            window = int(spec.sliding_window)
            name = f"sliding(window={window},retained={int(spec.extra_retained_tokens)})"
        elif isinstance(spec, MambaSpec):
            if not on_cpu:
                return (f"group {i} is a recurrent-state group (Mamba / linear attention): "
                        "kvpool moves those states on vLLM's CPU build only (the GPU path is "
                        "not built)")
            state = state_group(i, len(groups), group.layer_names, spec, block_size,
                                speculative)
            if isinstance(state, str):
                return state
            states.append(state)
            continue
        else:
            return (f"group {i} is {kind.__name__}: kvpool stores full-attention, "
                    "sliding-window and recurrent-state groups only (not MLA or others yet)")
        if spec.block_size != block_size:
            return (f"group {i} has blocks of {spec.block_size} tokens, not the engine's "
                    f"{block_size}")
        parts.append(AttentionGroup(index=i, layer_names=tuple(group.layer_names),
                                    sliding_window=window,
                                    key_format=f"group={i}/{len(groups)}:{name}",
                                    spec_kind=str(get_kv_cache_spec_kind(spec).value)))
    if not parts:
        return "no group is an attention group (a state alone names no prefix kvpool loads)"
    return parts, states


def allocated_in_step(so: Any, since_last_step: set[int]) -> frozenset[int]:
    """Block ids vLLM handed out in a step, in any group: new requests' lists, appended
    blocks, copy destinations, and blocks of loads allocated since the last step."""
    ids = set(since_last_step)
    for r in so.scheduled_new_reqs:
        for group in r.block_ids or ():
            ids.update(group)
    for blocks in so.scheduled_cached_reqs.new_block_ids:
        for group in blocks or ():
            ids.update(group)
    for copy in getattr(so, "kv_cache_block_copies", None) or ():
        ids.add(copy.dst_block_id)
    ids.discard(NULL_BLOCK)
    return frozenset(ids)


class HybridSchedulerSide:
    """The scheduler side of every part: the attention parts, then the state parts."""

    def __init__(self, parts: list["SchedulerSide"],
                 state_parts: list["StateSchedulerSide"] | None = None):
        self.parts = parts
        self.state_parts = list(state_parts or ())
        self.allocated_since_step: set[int] = set()
        #: Requests whose blocks parts hold for their saves, and how many parts, for the
        #: next step's metadata.
        self.holds: dict[str, int] = {}
        #: Requests given an asynchronous load since the last step, for its metadata.
        self.loads: list[str] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        answers = [p.get_num_new_matched_tokens(request, num_computed_tokens)
                   for p in self.parts]
        hit = min(n for n, _ in answers)
        if self.state_parts:
            hit = self._state_hit(request, num_computed_tokens, hit)
        # Every part's load is asynchronous (see the module docs).
        return hit, hit > 0

    def _state_hit(self, request: Any, num_computed: int, attention_hit: int) -> int:
        """The longest boundary within the attention parts' hit at which every state part
        holds the state (a hit of ``boundary - num_computed`` tokens), or 0; each state part
        remembers it for the allocation."""
        from kvpool.vllm.state_groups import state_candidates

        first = self.state_parts[0]
        boundaries = state_candidates(num_computed, num_computed + attention_hit,
                                      request.num_tokens, first.chunk) \
            if attention_hit > 0 else []
        failed = set().union(*(p.excluded(request.request_id) for p in self.state_parts))
        boundaries = [b for b in boundaries if b not in failed]
        alive = [(p, k) for p, k in zip(boundaries, first.keys_at(request.request_id,
                                                                  boundaries))
                 if k is not None]
        for part in self.state_parts:
            if not alive:
                break
            held = part.present([k for _, k in alive])
            alive = [c for c, ok in zip(alive, held) if ok]
        boundary, key = alive[0] if alive else (None, None)
        for part in self.state_parts:
            part.promise(request, num_computed, boundary, key)
        return boundary - num_computed if boundary is not None else 0

    def all_parts(self) -> list[Any]:
        """Every part, in the order of the metadata (attention parts, then state parts)."""
        return [*self.parts, *self.state_parts]

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        for group in blocks.get_block_ids():
            self.allocated_since_step.update(group)
        if num_external_tokens > 0:
            self.loads.append(request.request_id)
        for p in self.all_parts():
            p.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, so: Any
                             ) -> tuple[list[bytes], list[str], dict[str, int], list[str]]:
        """Every part's encoded metadata, the requests preempted in the step, the finished
        requests parts hold (``holds``) and the requests given a load (``loads``)."""
        allocated = allocated_in_step(so, self.allocated_since_step)
        self.allocated_since_step = set()
        built = [p.build_connector_meta(so, allocated) for p in self.all_parts()]
        holds, self.holds = self.holds, {}
        loads, self.loads = self.loads, []
        return [data for data, _ in built], built[0][1], holds, loads

    def update_connector_output(self, out: Any) -> None:
        meta = getattr(out, "kv_connector_worker_meta", None)
        events = getattr(out, "kv_cache_events", None)
        by_part = _split_events(events) if isinstance(events, KvpoolKVEvents) else {}
        for i, p in enumerate(self.parts):
            p.update_connector_output(_PartOutput(out, meta, i, by_part.get(i)))
        for p in self.state_parts:
            p.update_connector_output(out)

    def scope_digest(self) -> str:
        """Every part's scope digest, in the parts' order."""
        return "+".join(p.scope_digest() for p in self.all_parts())

    def saved_prompt_tokens(self, request: Any) -> int:
        """What every part's saves cover of the prompt (a hit needs every group)."""
        return min(p.saved_prompt_tokens(request) for p in self.all_parts())

    def request_finished(self, request: Any) -> bool:
        held = sum(bool(p.request_finished(request)) for p in self.all_parts())
        if held:
            self.holds[request.request_id] = held
        return held > 0

    def has_pending_work(self) -> bool:
        return any(p.has_pending_work() for p in self.all_parts())

    def take_events(self):
        """Every part's tier events as vLLM KV events, each naming its KV cache group."""
        for p in self.parts:
            yield from p.take_events()

    def reset(self) -> None:
        for p in self.all_parts():
            p.reset()


class _PartOutput:
    """One part's view of a step's ``KVConnectorOutput``: its own step reports, the requests
    whose load ended in every part, and no failed blocks (failures are per request)."""

    def __init__(self, out: Any, meta: Any, part: int, events: "KvpoolKVEvents | None"):
        self.kv_connector_worker_meta = KvpoolWorkerMeta(
            executed=_of_part(meta.executed, part), copied=_of_part(meta.copied, part)
        ) if isinstance(meta, KvpoolWorkerMeta) else None
        self.invalid_block_ids = set()
        self.finished_recving = out.finished_recving
        self.kv_cache_events = events


def _split_events(events: KvpoolKVEvents) -> dict[int, KvpoolKVEvents]:
    """The parts' tier events, as ``HybridWorkerSide.kv_cache_events`` tagged them (every
    part names a chunk by the same hash: the tier carries the part)."""
    parts: dict[int, list] = {}
    # With each event as often as ranks reported it (``aggregate`` keeps what all did).
    for (tier, stored, hashes), n in events.counted_events().items():
        part, _, name = tier.partition(":")
        parts.setdefault(int(part), []).extend([(name, stored, hashes)] * n)
    workers = events.get_number_of_workers()
    return {i: KvpoolKVEvents(evs, num_workers=workers) for i, evs in parts.items()}


def _part_counters(per_part) -> dict[str, Any]:
    """The first part's counters as they are, every other part's under ``g<part>_`` (its
    position among the parts; the first is a full-attention group's)."""
    data: dict[str, Any] = {}
    for i, counters in enumerate(per_part):
        for k, v in counters.items():
            data[k if i == 0 else f"g{i}_{k}"] = v
    return data


def _of_part(counts: Counter, part: int) -> Counter:
    return Counter({step: n for (p, step), n in counts.items() if p == part})


class HybridWorkerSide:
    """The worker side of every part, reporting to vLLM as one connector: a request's load
    ended once every part's did (failed if any part's failed), its saves once every part
    that held it reported them."""

    def __init__(self, parts: list["WorkerSide | StateWorkerSide"]):
        #: The attention parts, then the state parts (the metadata's order).
        self.parts = parts
        self.recving: Counter = Counter()
        self.failed: set[str] = set()
        self.loading: set[str] = set()
        self.expected_sending: dict[str, int] = {}
        self.sending: Counter = Counter()

    def bind(self, datas: list[bytes], holds: dict[str, int], loads: list[str]) -> None:
        self.expected_sending.update(holds)
        self.loading.update(loads)
        for p, data in zip(self.parts, datas):
            p.bind(data)

    def handle_preemptions(self, preempted: list[str]) -> None:
        for p in self.parts:
            p.handle_preemptions(preempted)

    def start_load(self) -> None:
        for p in self.parts:
            p.start_load()

    def save(self) -> None:
        for p in self.parts:
            p.save()

    def clear(self) -> None:
        for p in self.parts:
            p.clear()

    def transfer_results(self, finished_req_ids: set[str]
                         ) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)``."""
        n = len(self.parts)
        for p in self.parts:
            sending, recving = p.finished(finished_req_ids)
            self.sending.update(sending or ())
            self.recving.update(recving or ())
            failed, unattributed = p.failed_load_requests()
            self.failed.update(failed)
            if unattributed:
                logger.error("kvpool: blocks failed with no request named; every load in "
                             "flight is recomputed")
                self.failed.update(self.loading)
        done_recving = {r for r, k in self.recving.items() if k >= n}
        for r in done_recving:
            del self.recving[r]
            self.loading.discard(r)
        failed = self.failed & done_recving
        self.failed -= failed
        done_sending = set()
        for r, k in list(self.sending.items()):
            if k >= self.expected_sending.get(r, n):
                done_sending.add(r)
                del self.sending[r]
                self.expected_sending.pop(r, None)
        return done_sending, done_recving, failed

    def worker_meta(self) -> KvpoolWorkerMeta:
        executed, copied = Counter(), Counter()
        for i, p in enumerate(self.parts):
            m = p.worker_meta()
            executed.update({(i, s): k for s, k in m.executed.items()})
            copied.update({(i, s): k for s, k in m.copied.items()})
        return KvpoolWorkerMeta(executed=executed, copied=copied)

    def kv_cache_events(self) -> KvpoolKVEvents | None:
        """Every part's tier events, each tier tagged with its part (``_split_events``)."""
        events = []
        for i, p in enumerate(self.parts):
            got = p.kv_cache_events()
            if got is not None:
                events += [(f"{i}:{tier}", stored, hashes)
                           for tier, stored, hashes in got.get_all_events()]
        return KvpoolKVEvents(events) if events else None

    def stats(self) -> KvpoolConnectorStats:
        """Every part's counters for the interval, named as ``_part_counters`` names them."""
        return KvpoolConnectorStats(data=_part_counters(p.stats().data for p in self.parts))

    def native_stats(self) -> dict[str, int]:
        """Every part's counters since it started, named as ``_part_counters`` names them."""
        return _part_counters(p.native_stats() for p in self.parts)

    def shutdown(self) -> None:
        # The pool's owner (the first part) closes it, after the others stopped.
        for p in reversed(self.parts):
            p.shutdown()
