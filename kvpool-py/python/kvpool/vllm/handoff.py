"""Disaggregated prefill's hand-off through the pool: a ``kv_producer``'s finished request names
what its saves cover in its ``kv_transfer_params``; a ``kv_consumer`` given those params on a
request waits, bounded, for that much of the prompt to be found in the pool before it answers
vLLM's lookup (vLLM asks again while kvpool answers ``None``). Past the bound it takes what is
there and computes the rest: a late hand-off is a miss, never wrong KV. A hand-off carries the
producer's scope digest: a consumer that derives other keys (another model, ``weights_id``, TP
size, layout, chunk or block size) could never find it, so it does not wait for it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

logger = logging.getLogger("kvpool.vllm")

#: The key of kvpool's hand-off in a request's ``kv_transfer_params``.
HANDOFF_KEY = "kvpool_handoff"
#: The connector stats key of the hand-off waits (a list of seconds, not a counter).
WAITS_KEY = "handoff_wait_seconds"
#: A waiting request's lookups are spaced this far apart at first, then twice as far each
#: time up to ``MAX_POLL_INTERVAL_S`` (vLLM asks every step; each lookup blocks its scheduler).
POLL_INTERVAL_S = 0.005
MAX_POLL_INTERVAL_S = 0.1


def handoff_params(tokens: int, producer: str, scope: str | None = None) -> dict[str, Any]:
    """The ``kv_transfer_params`` a producer returns for a finished request whose saves cover
    ``tokens`` tokens of its prompt, keyed in the scope whose digest is ``scope``."""
    handoff: dict[str, Any] = {"tokens": int(tokens), "producer": producer}
    if scope is not None:
        handoff["scope"] = scope
    return {HANDOFF_KEY: handoff}


class Handoffs:
    """A consumer's waits for handed-off prompts, and the hand-off counters of both roles."""

    def __init__(self, timeout_s: float, block_size: int, clock=time.monotonic,
                 scope: str | None = None):
        self.timeout_s = timeout_s
        self.block_size = max(1, block_size)
        self.clock = clock
        #: This engine's scope digest (``SchedulerSide.scope_digest``); a hand-off naming
        #: another is not waited for. None: not compared.
        self.scope = scope
        #: Waiting requests: request id -> (first lookup, last lookup, lookups), clock seconds.
        self.waiting: dict[str, tuple[float, float, int]] = {}
        #: Requests whose hand-off was settled: asked again (vLLM could not allocate their
        #: blocks, or preempted them), they are looked up as any request, not waited for.
        self.settled: set[str] = set()
        self.counts: Counter[str] = Counter()
        #: How long each request that waited for its hand-off waited, seconds, since the
        #: last ``take_counts`` (vLLM's ``vllm:kvpool_handoff_wait_seconds`` histogram).
        self.waits: list[float] = []
        #: Producer scopes already warned about (one warning each, not one per request).
        self.foreign_scopes: set[str] = set()

    def expected(self, request: Any) -> int | None:
        """The tokens of ``request``'s prompt a producer handed off that a lookup can load
        (whole blocks, the last prompt token never), or ``None`` without a hand-off."""
        params = getattr(request, "kv_transfer_params", None)
        handoff = params.get(HANDOFF_KEY) if isinstance(params, dict) else None
        if handoff is None or request.request_id in self.settled:
            return None
        tokens = handoff.get("tokens") if isinstance(handoff, dict) else None
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            logger.warning("kvpool: request %s: malformed hand-off %r ignored",
                           request.request_id, handoff)
            return None
        scope = handoff.get("scope")
        if scope is not None and self.scope is not None and scope != self.scope:
            # Its keys are not this engine's: waiting could only time out.
            self.settled.add(request.request_id)
            self.counts["handoffs_received"] += 1
            self.counts["handoffs_mismatched"] += 1
            if len(self.foreign_scopes) < 64 and str(scope) not in self.foreign_scopes:
                self.foreign_scopes.add(str(scope))
                logger.warning("kvpool: request %s: handed off by %s, whose keys differ from "
                               "this instance's (scope %s, here %s: another model, weights_id, "
                               "TP size, layout, chunk or block size); its hand-offs are not "
                               "waited for (vllm:kvpool_handoffs_mismatched_total counts them)",
                               request.request_id, handoff.get("producer"), scope, self.scope)
            return None
        prompt = len(request.prompt_token_ids or ())
        return min(tokens, max(0, prompt - 1) // self.block_size * self.block_size)

    def may_look_up(self, req_id: str) -> bool:
        """Whether a waiting request may be looked up again now (else vLLM is told to ask
        later without a lookup)."""
        since = self.waiting.get(req_id)
        if since is None:
            return True
        interval = min(MAX_POLL_INTERVAL_S, POLL_INTERVAL_S * 2 ** (since[2] - 1))
        return self.clock() - since[1] >= interval

    def settle(self, req_id: str, want: int, have: int) -> bool:
        """After a lookup found ``have`` of the ``want`` handed-off tokens: ``True`` to answer
        vLLM now (all there, or waited long enough), ``False`` to have it ask again."""
        now = self.clock()
        first, _, lookups = self.waiting.get(req_id, (now, now, 0))
        if have >= want or now - first >= self.timeout_s:
            if req_id in self.waiting:
                del self.waiting[req_id]
                self.counts["handoffs_waited"] += 1
                self.counts["handoff_wait_ms"] += int((now - first) * 1000)
                self.waits.append(now - first)
            self.settled.add(req_id)
            self.counts["handoffs_received"] += 1
            if have >= want:
                self.counts["handoffs_complete"] += 1
            else:
                self.counts["handoffs_timed_out"] += 1
                logger.warning("kvpool: request %s: %d of %d handed-off tokens found after %.1f "
                               "s; the rest is computed here", req_id, have, want, now - first)
            return True
        self.waiting[req_id] = (first, now, lookups + 1)
        return False

    def forget(self, req_id: str) -> None:
        """The request ended (finished, or aborted while waiting)."""
        self.waiting.pop(req_id, None)
        self.settled.discard(req_id)

    def take_counts(self) -> dict[str, Any]:
        """The counters since the last call, and under ``WAITS_KEY`` the waits (seconds, a
        list) of the requests that waited."""
        counts, self.counts = dict(self.counts), Counter()
        if self.waits:
            counts[WAITS_KEY], self.waits = self.waits, []
        return counts
