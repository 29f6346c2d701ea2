"""The connector's scheduler side, in vLLM's EngineCore process: it asks every worker rank's
pool over its Unix socket how much of a prompt it holds (loads are asynchronous unless every
rank leased every promised chunk in memory or no other request runs), builds each step's metadata (encoded bytes),
applies what the workers reported (failed blocks, ended loads, steps run), and turns the
workers' tier events into vLLM KV events."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored

from kvpool import _native
from kvpool.vllm.identity import extra_keys_of
from kvpool.vllm.reports import KvpoolKVEvents, KvpoolWorkerMeta

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvpool.vllm")

#: Block update kinds understood by ``Scheduler.build_connector_meta``.
UNCHANGED, APPEND, REPLACE = 0, 1, 2

#: Most bytes (estimated) of the chunk -> vLLM blocks map kept for KV events.
MAX_CHUNK_BLOCKS_BYTES = 64 << 20


class SchedulerSide:
    """See the module docs."""

    def __init__(self, *, socket_paths: list[str], block_size: int, save_decode_tokens: bool,
                 load_timing: str, async_scheduling: bool, timeout_ms: int, kv_events: bool,
                 group: int = 0, sliding_window: bool = False,
                 event_fields: dict[str, Any] | None = None,
                 chunk_blocks_of: "SchedulerSide | None" = None, loads: bool = True,
                 saves: bool = True):
        self.block_size = block_size
        #: Whether this side saves (false for a ``kv_consumer``): every request is then
        #: ``skip_save``. ``loads`` false (a ``kv_producer``): no prompt is looked up.
        self.saves = saves
        #: The KV cache group whose blocks this side follows (a hybrid model has several).
        self.group = group
        #: The group's blocks outside a sliding window are freed while the request runs: see
        #: ``SlidingWindowBlocks``.
        self.window_blocks = SlidingWindowBlocks() if sliding_window else None
        #: Fields of this side's KV events naming its group (a hybrid model's part).
        self.event_fields = dict(event_fields or {})
        #: The side whose chunk -> vLLM blocks map the events read (a hybrid model's parts
        #: name a chunk alike: one map serves them all); None: this side's own.
        self.chunk_blocks_of = chunk_blocks_of
        self.save_decode_tokens = save_decode_tokens
        self.native = _native.Scheduler(
            socket_paths=socket_paths,
            block_size=block_size,
            save_decode_tokens=save_decode_tokens,
            load_timing=load_timing,
            async_scheduling=async_scheduling,
            timeout_ms=timeout_ms,
            loads=loads,
        )
        self.kv_events = kv_events
        self.requests: dict[str, "Request"] = {}
        self.pending_events: KvpoolKVEvents | None = None
        # Chunk hash -> (vLLM block hashes, parent hash, token ids, LoRA name, bytes estimate).
        self.chunk_blocks: OrderedDict[bytes, tuple[list, Any, list[int], str | None, int]] = OrderedDict()
        self.chunk_blocks_bytes = 0
        logger.info("kvpool scheduler connected to %d worker rank(s), chunk size %d, loads: %s",
                    len(socket_paths), self.native.chunk_size(), load_timing)

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        prompt = request.prompt_token_ids
        if prompt is None or getattr(request, "prompt_embeds", None) is not None:
            # KV computed from embeddings is not determined by token ids: never cached.
            return 0, False
        self.requests[request.request_id] = request
        return self.native.get_num_new_matched_tokens(
            request.request_id, prompt, extra_keys_of(request), num_computed_tokens,
            skip_save=not self.saves)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()
        ids = list(block_ids[self.group]) if block_ids else []
        if self.window_blocks is not None:
            self.window_blocks.replace(request.request_id, ids, allocated_now=True)
        self.native.update_state_after_alloc(request.request_id, ids, num_external_tokens)
        if self.kv_events and self.chunk_blocks_of is None:
            self._remember_chunk_blocks(request)

    def _remember_chunk_blocks(self, request: "Request") -> None:
        """Maps each full chunk of the request, and each tail block past its last whole chunk,
        to vLLM's block hashes and token ids, for the KV events of the tiers (bounded by bytes:
        the oldest entries go first)."""
        chunk = self.native.chunk_size()
        if chunk % self.block_size:
            return
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        per_chunk = chunk // self.block_size
        block_hashes = [maybe_convert_block_hash(b)
                        for b in (getattr(request, "block_hashes", None) or [])]
        prompt = request.prompt_token_ids or []
        lora = getattr(request, "lora_request", None)
        lora_name = lora.lora_name if lora is not None else None
        hashes = self.native.chunk_hashes(request.request_id)
        # (key, first block, blocks): whole chunks, then the tail's blocks one by one.
        spans = [(h, i * per_chunk, per_chunk) for i, h in enumerate(hashes)]
        # A prompt ending on a chunk boundary keys its last chunk's blocks again one by one
        # (for a repeat that stops before its last token): the chunk's events speak for them.
        if len(prompt) % chunk:
            tail_start = len(prompt) // chunk * per_chunk
            spans += [(h, tail_start + j, 1)
                      for j, h in enumerate(self.native.tail_block_hashes(request.request_id))]
        for h, first, count in spans:
            blocks = block_hashes[first:first + count]
            if len(blocks) < count:
                break
            parent = block_hashes[first - 1] if first else None
            tokens = list(prompt[first * self.block_size:(first + count) * self.block_size])
            # Python ints in a list cost about 36 bytes each, a block hash about 80.
            cost = 200 + 36 * len(tokens) + 80 * len(blocks)
            old = self.chunk_blocks.pop(h, None)
            if old is not None:
                self.chunk_blocks_bytes -= old[4]
            self.chunk_blocks[h] = (blocks, parent, tokens, lora_name, cost)
            self.chunk_blocks_bytes += cost
        while self.chunk_blocks_bytes > MAX_CHUNK_BLOCKS_BYTES and self.chunk_blocks:
            _, evicted = self.chunk_blocks.popitem(last=False)
            self.chunk_blocks_bytes -= evicted[4]

    def build_connector_meta(self, so: "SchedulerOutput", allocated: frozenset[int] = frozenset()
                             ) -> tuple[bytes, list[str]]:
        """The step's encoded metadata, and the requests preempted in it. ``allocated``: the
        block ids the engine handed out in this step, in any group (see
        ``SlidingWindowBlocks``)."""
        g = self.group
        window = self.window_blocks
        if window is not None:
            window.forget_stale(allocated)
        scheduled = []
        new_ids = [r.req_id for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        counts = {}
        if self.save_decode_tokens:
            ids = new_ids + list(cached.req_ids)
            counts = dict(zip(ids, self.native.token_counts(ids)))

        def new_tokens(req_id: str) -> tuple[int, list[int]]:
            # From the scheduler's own count on: both sides agree on the sequence by
            # construction (docs/keys.md).
            known = counts.get(req_id)
            request = self.requests.get(req_id)
            if known is None or request is None:
                return 0, []
            return known, list(request.all_token_ids[known:])

        for r in so.scheduled_new_reqs:
            computed = r.num_computed_tokens + so.num_scheduled_tokens.get(r.req_id, 0)
            start, tokens = new_tokens(r.req_id)
            ids = list(r.block_ids[g]) if r.block_ids else []
            if window is not None:
                window.replace(r.req_id, ids)
            scheduled.append((r.req_id, start, tokens, REPLACE, ids, computed))
        for i, req_id in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            if blocks is None:
                kind, ids = UNCHANGED, []
            else:
                kind = REPLACE if req_id in cached.resumed_req_ids else APPEND
                ids = list(blocks[g])
            if window is not None:
                kind, ids = window.update(req_id, kind, ids)
            computed = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0)
            start, tokens = new_tokens(req_id)
            scheduled.append((req_id, start, tokens, kind, ids, computed))
        preempted = list(so.preempted_req_ids or ())
        return self.native.build_connector_meta(scheduled, preempted), preempted

    def update_connector_output(self, out: "KVConnectorOutput") -> None:
        meta = getattr(out, "kv_connector_worker_meta", None)
        executed, copied = [], []
        if isinstance(meta, KvpoolWorkerMeta):
            executed = sorted(meta.executed.items())
            copied = sorted(meta.copied.items())
        failed = sorted(out.invalid_block_ids or ())
        recving = sorted(out.finished_recving or ())
        if failed or recving or executed or copied:
            self.native.update_connector_output(failed, recving, executed, copied)
        events = getattr(out, "kv_cache_events", None)
        if isinstance(events, KvpoolKVEvents):
            if self.pending_events is None:
                self.pending_events = events
            else:
                self.pending_events.add_events(events.get_all_events())
                self.pending_events.increment_workers(events.get_number_of_workers())

    def take_events(self):
        """The workers' tier events as vLLM KV events."""
        pending, self.pending_events = self.pending_events, None
        if pending is None:
            return
        chunk_blocks = (self.chunk_blocks_of or self).chunk_blocks
        group = self.event_fields
        removed_group = {k: v for k, v in group.items() if k == "group_idx"}
        for tier, stored, hashes in pending.aggregate().get_all_events():
            medium = "CPU" if tier == "cpu" else tier.upper()
            for h in hashes:
                known = chunk_blocks.get(h)
                if known is None:
                    continue
                blocks, parent, tokens, lora_name, _ = known
                if stored:
                    yield BlockStored(block_hashes=blocks, parent_block_hash=parent,
                                      token_ids=tokens, block_size=self.block_size,
                                      lora_id=None, medium=medium, lora_name=lora_name,
                                      **group)
                else:
                    yield BlockRemoved(block_hashes=blocks, medium=medium, **removed_group)

    def scope_digest(self) -> str:
        """How this engine derives keys, as a digest: engines whose digests differ never share
        a key (a hand-off carries it)."""
        return self.native.scope_digest()

    def saved_prompt_tokens(self, request: "Request") -> int:
        """Tokens of the request's prompt its saves cover (asked before ``request_finished``)."""
        return self.native.saved_prompt_tokens(request.request_id)

    def request_finished(self, request: "Request") -> bool:
        """Whether vLLM must hold the request's blocks until the workers report it."""
        self.requests.pop(request.request_id, None)
        if self.window_blocks is not None:
            self.window_blocks.forget(request.request_id)
        return self.native.request_finished(request.request_id)

    def has_pending_work(self) -> bool:
        return self.native.has_pending_work()

    def reset(self) -> None:
        self.native.reset()


class SlidingWindowBlocks:
    """A sliding-window group's blocks of each request, as vLLM holds them now. vLLM frees a
    request's blocks that fell outside the window while the request runs (putting its null
    block, id 0, in their place) without telling the connector, and may hand them to another
    request in a later step. A block id the engine hands out in a step is stale wherever it
    still sits in a list known before the step: it is replaced by the null block, which the
    worker never saves from (a save stops before the chunk). A list that changed is sent whole
    (``REPLACE``) the next time its request is scheduled. vLLM's own OffloadingConnector keeps
    its sliding-window lists the same way. (Ids the step handed out include a new request's
    cached prefix blocks, which others may hold too: their saves then stop early, a miss.)"""

    def __init__(self):
        self.blocks: dict[str, list[int]] = {}
        self.changed: set[str] = set()
        #: Lists vLLM gave at allocation in this step (``update_state_after_alloc``): current.
        self.fresh: set[str] = set()

    def replace(self, req_id: str, ids: list[int], *, allocated_now: bool = False) -> None:
        self.blocks[req_id] = list(ids)
        self.changed.discard(req_id)
        if allocated_now:
            self.fresh.add(req_id)

    def forget(self, req_id: str) -> None:
        self.blocks.pop(req_id, None)
        self.changed.discard(req_id)
        self.fresh.discard(req_id)

    def forget_stale(self, allocated: frozenset[int]) -> None:
        """Replaces by the null block every id of ``allocated`` in the lists known before
        this step."""
        fresh, self.fresh = self.fresh, set()
        if not allocated:
            return
        for req_id, ids in self.blocks.items():
            # Most lists share no id with the step's (a set test, not a Python loop).
            if req_id in fresh or allocated.isdisjoint(ids):
                continue
            stale = False
            for j, b in enumerate(ids):
                if b and b in allocated:
                    ids[j] = 0
                    stale = True
            if stale:
                self.changed.add(req_id)

    def update(self, req_id: str, kind: int, ids: list[int]) -> tuple[int, list[int]]:
        """A scheduled request's block update, applied here, as it must reach the native
        scheduler: the whole list when an earlier position was replaced."""
        if kind == REPLACE:
            self.replace(req_id, ids)
            return REPLACE, list(ids)
        known = self.blocks.get(req_id)
        if known is None:
            # vLLM allocates every request's blocks through update_state_after_alloc or
            # lists them whole for a new request: not reached.
            logger.warning("kvpool: sliding-window blocks of request %s were never listed "
                           "whole; its update is passed on as it is", req_id)
            return kind, ids
        if kind == APPEND:
            known.extend(ids)
        if req_id in self.changed:
            self.changed.discard(req_id)
            return REPLACE, list(known)
        return kind, ids
