"""A hybrid model's recurrent-state groups (vLLM's ``MambaSpec``: Mamba, Mamba2, Gated
DeltaNet, short conv) as kvpool parts: the state after the first ``P`` tokens, saved where
vLLM hands it over and loaded so that a hit resumes the recurrence at exactly ``P``.

vLLM keeps these states only in its prefix-caching ``align`` mode, at block boundaries: the
state after each scheduler step that ends on a boundary, and the prompt's last boundary before
its final token. Each time it commits one, it offers the block holding it to the connector
(``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``: request, group, block,
boundary); kvpool stores the block's state bytes, every layer of the group, under the chain
hash that names the prefix ``[0, P)`` (the hash of the chunk ending at ``P``) in the group's
key scope. A state's key never names a block or a chunk index: a state is never loaded at
another position.

A hit is the longest prefix ``P`` that every attention part can load and for which every
state part (and every tensor-parallel rank) holds the state at exactly ``P``: a state hit is
not closed downward, so every state part is asked about the candidates (each a boundary of a
whole chunk, at most ``MAX_STATE_CANDIDATES`` of them, longest first) in one round trip to
each rank, and the longest held by every part wins. A boundary whose load failed for a
request is not offered to it again. The state is loaded into the block vLLM
allocated for it (``block_ids[group][P // block_size - 1]``, the slot its worker reads the
initial state from). When vLLM accepts another hit than the one promised, or the block list
is not the one expected, the request's load fails and vLLM recomputes it: attention alone is
never served.

What this version serves (otherwise kvpool stands aside, one warning, and vLLM's own prefix
cache serves the model): ``mamba_cache_mode`` ``align`` (prefix caching on), state groups of
the engine's block size, no speculative decoding, state tensors in host memory (vLLM's CPU
build: the GPU path is not built), and a chunk size that is a multiple of the block size
(equal to it, so every boundary vLLM keeps can be named, is recommended).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvpool import _native
from kvpool.vllm.identity import model_identity
from kvpool.vllm.reports import KvpoolConnectorStats, KvpoolWorkerMeta

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

    from kvpool.vllm.scheduler_side import SchedulerSide
    from kvpool.vllm.worker_side import WorkerSide

logger = logging.getLogger("kvpool.vllm")

#: Most candidate boundaries a lookup asks the state parts about: the longest ones, where a
#: repeated prompt's or an earlier turn's state is.
MAX_STATE_CANDIDATES = 16


@dataclass(frozen=True)
class StateGroup:
    """One recurrent-state KV cache group kvpool serves as a part."""

    #: The group's index in vLLM's ``kv_cache_groups``.
    index: int
    layer_names: tuple[str, ...]
    #: Bytes of one layer's state (vLLM's ``state_content_size_bytes``: conv then ssm /
    #: temporal state, packed; the block's padding is not stored).
    content_bytes: int
    #: What every key of the group carries: index, count, kind, state shapes and dtypes.
    key_format: str


def state_group(index: int, num_groups: int, layer_names: Any, spec: Any, block_size: int,
                speculative: bool) -> StateGroup | str:
    """A ``MambaSpec`` group as a kvpool part, or why kvpool cannot serve it."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        return (f"group {index} is a recurrent-state group in mamba_cache_mode {mode!r}: vLLM "
                "keeps no state per position unless prefix caching is on (mode \"align\")")
    if spec.block_size != block_size:
        return (f"group {index} keeps a state every {spec.block_size} tokens, not every block "
                f"of the engine's {block_size}")
    if speculative or getattr(spec, "num_speculative_blocks", 0):
        return (f"group {index} is a recurrent-state group under speculative decoding, whose "
                "draft states kvpool does not follow")
    if getattr(spec, "num_heads", 1) != 1 or getattr(spec, "tokens_per_state", -1) > 0:
        return (f"group {index} keeps its state in {spec.num_heads} heads or several states per "
                "block, a layout kvpool does not move yet")
    shapes = ";".join("x".join(str(d) for d in s) for s in spec.shapes)
    dtypes = ";".join(str(d).removeprefix("torch.") for d in spec.dtypes)
    mamba_type = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    content = int(spec.state_content_size_bytes)
    # The group's layers, by name, in order: a state is loaded only into the layers it was
    # saved from.
    layers = hashlib.sha256(",".join(layer_names).encode()).hexdigest()[:16]
    return StateGroup(
        index=index, layer_names=tuple(layer_names), content_bytes=content,
        key_format=(f"group={index}/{num_groups}:state({mamba_type},shapes={shapes},"
                    f"dtypes={dtypes},bytes={content},layers={layers})"))


def state_candidates(num_computed: int, loadable_end: int, num_tokens: int, chunk: int
                     ) -> list[int]:
    """The boundaries a state hit may end on, longest first: whole chunks past the tokens vLLM
    computed, within what the attention parts can load, short of the prompt's last token (vLLM
    computes at least one), at most ``MAX_STATE_CANDIDATES``."""
    end = min(loadable_end, num_tokens - 1) // chunk * chunk
    out = []
    p = end
    while p > num_computed and len(out) < MAX_STATE_CANDIDATES:
        out.append(p)
        p -= chunk
    return out


class StateSchedulerSide:
    """The scheduler side of one state part: finds states for the hybrid side's lookups,
    turns vLLM's allocation into the state's load, and its boundary offers into saves."""

    def __init__(self, *, group: StateGroup, socket_paths: list[str], block_size: int,
                 keys_of: "SchedulerSide", save_decode_tokens: bool, timeout_ms: int,
                 loads: bool, saves: bool, native: Any = None):
        """``native``: the presence lookups' client (tests pass a stand-in); by default a
        ``kvpool._native.Scheduler`` connected to ``socket_paths``."""
        self.group = group
        self.block_size = block_size
        #: The part whose tracker hashes each request's chunks (the state key of a boundary is
        #: the hash of the chunk ending there).
        self.keys_of = keys_of
        self.save_decode_tokens = save_decode_tokens
        self.saves = saves
        # Connects to the group's workers (their hello check: same chunking and hash); only
        # its presence lookups are used.
        self.native = native if native is not None else _native.Scheduler(
            socket_paths=socket_paths, block_size=block_size, load_timing="always",
            timeout_ms=timeout_ms, loads=loads)
        self.chunk = self.native.chunk_size()
        #: Request -> (tokens vLLM computed, boundary promised, its key), from the last lookup.
        self.promised: dict[str, tuple[int, int, bytes]] = {}
        #: Request -> prompt length, for saves of prompt boundaries only.
        self.prompt_lens: dict[str, int] = {}
        #: Request -> the longest prompt boundary offered for a save (hand-offs).
        self.saved: dict[str, int] = {}
        self.loads: list[tuple[str, str, int]] = []
        #: Requests whose load cannot be made as promised: failed, so recomputed.
        self.refused: list[str] = []
        #: Request -> the boundary of its load in flight (promised to vLLM).
        self.loading: dict[str, int] = {}
        #: Request -> boundaries whose load failed: not offered to it again (vLLM looks a
        #: request up again after a failed load; a state that keeps failing is not retried).
        self.failed_at: dict[str, set[int]] = {}

    def keys_at(self, req_id: str, boundaries: list[int]) -> list[bytes | None]:
        """The state key of each boundary (None past the chunks the tracker hashed)."""
        hashes = self.keys_of.native.chunk_hashes(req_id)
        return [hashes[p // self.chunk - 1] if 0 < p and p % self.chunk == 0
                and p // self.chunk <= len(hashes) else None for p in boundaries]

    def present(self, keys: list[bytes]) -> list[bool]:
        """Whether every rank's pool holds each state (one round trip to each rank)."""
        return self.native.chunks_present(keys)

    def promise(self, request: "Request", num_computed: int, boundary: int | None,
                key: bytes | None) -> None:
        """Remembers the lookup's answer for the allocation that follows."""
        self.prompt_lens[request.request_id] = len(request.prompt_token_ids or ())
        if boundary is None or key is None:
            self.promised.pop(request.request_id, None)
        else:
            self.promised[request.request_id] = (num_computed, boundary, key)

    def update_state_after_alloc(self, request: "Request", blocks: Any,
                                 num_external_tokens: int) -> None:
        req_id = request.request_id
        promised = self.promised.pop(req_id, None)
        if num_external_tokens == 0:
            return
        if promised is None:
            logger.error("kvpool: request %s was given %d tokens to load that kvpool did not "
                         "promise; its load fails and it is recomputed", req_id,
                         num_external_tokens)
            self.refused.append(req_id)
            return
        computed, boundary, key = promised
        self.loading[req_id] = boundary
        if computed + num_external_tokens != boundary:
            logger.warning("kvpool: vLLM accepted %d + %d tokens of request %s, not the %d whose "
                           "state kvpool holds; its load fails and it is recomputed", computed,
                           num_external_tokens, req_id, boundary)
            self.refused.append(req_id)
            return
        ids = blocks.get_block_ids()[self.group.index]
        slot = boundary // self.block_size - 1
        first_new = -(-computed // self.block_size)
        if len(ids) <= slot or ids[slot] == 0 or any(ids[first_new:slot]):
            logger.warning("kvpool: request %s's state blocks %s are not laid out as vLLM's "
                           "align mode lays them out for a hit at %d; its load fails and it "
                           "is recomputed", req_id, list(ids[:slot + 1]), boundary)
            self.refused.append(req_id)
            return
        self.loads.append((req_id, key.hex(), int(ids[slot])))

    def build_connector_meta(self, so: Any, allocated: frozenset[int] = frozenset()
                             ) -> tuple[bytes, list[str]]:
        """The part's metadata for the workers: the step's loads, refused loads and saves."""
        saves = []
        state = getattr(so, "kv_connector_block_state", None)
        offers = getattr(state, "boundary_state_offloads", None) or {}
        for req_id, offered in offers.items():
            if not self.saves:
                break
            mine = [(block, p) for g, block, p in offered
                    if g == self.group.index and block and p % self.chunk == 0]
            if not mine:
                continue
            prompt_len = self.prompt_lens.get(req_id)
            if not self.save_decode_tokens:
                mine = [(b, p) for b, p in mine if prompt_len is not None and p <= prompt_len]
            keys = self.keys_at(req_id, [p for _, p in mine])
            for (block, p), key in zip(mine, keys):
                if key is None:
                    continue
                saves.append((key.hex(), int(block)))
                if prompt_len is not None and p <= prompt_len:
                    self.saved[req_id] = max(self.saved.get(req_id, 0), p)
        data = {"loads": self.loads, "refused": self.refused, "saves": saves}
        self.loads, self.refused = [], []
        return json.dumps(data).encode(), list(so.preempted_req_ids or ())

    def excluded(self, req_id: str) -> set[int]:
        """The boundaries whose load failed for the request (not offered again)."""
        return self.failed_at.get(req_id, set())

    def update_connector_output(self, out: Any) -> None:
        """Remembers the boundary of each load that failed (in any part: the request's
        whole load failed)."""
        for req_id in getattr(out, "failed_recving", None) or ():
            boundary = self.loading.pop(req_id, None)
            if boundary is not None:
                self.failed_at.setdefault(req_id, set()).add(boundary)
        for req_id in getattr(out, "finished_recving", None) or ():
            self.loading.pop(req_id, None)

    def take_events(self):
        # States are not blocks vLLM's KV events describe: none are announced.
        return iter(())

    def scope_digest(self) -> str:
        return self.native.scope_digest()

    def saved_prompt_tokens(self, request: "Request") -> int:
        return self.saved.get(request.request_id, 0)

    def request_finished(self, request: "Request") -> bool:
        # Saves are copied in the step that offered them: no block is held after a finish.
        for table in (self.promised, self.prompt_lens, self.saved, self.loading,
                      self.failed_at):
            table.pop(request.request_id, None)
        return False

    def has_pending_work(self) -> bool:
        return False

    def reset(self) -> None:
        # Keys come from the attention part's tracker, which the reset salts anew.
        self.promised.clear()


def state_planes(kv_caches: dict[str, torch.Tensor], group: StateGroup, num_blocks: int | None
                 ) -> list[tuple[int, int]]:
    """Each layer's ``(address of block 0, bytes between blocks)``, in the group's layer
    order: vLLM 0.32 hands a state layer one int8 ``[blocks, 1, 1, state bytes]`` view whose
    first stride is the (padded) block stride. Anything else is refused with what it saw."""
    planes = []
    for name in group.layer_names:
        t = kv_caches.get(name)
        if t is None:
            raise ValueError(f"kvpool: vLLM registered no cache for state layer {name}")
        if t.device.type != "cpu":
            raise ValueError(f"kvpool: state layer {name} lives on {t.device}; kvpool moves "
                             "recurrent states from host memory only (vLLM's CPU build)")
        if (t.dim() != 4 or tuple(t.shape[1:3]) != (1, 1) or t.shape[3] != group.content_bytes
                or t.element_size() != 1 or t.stride(3) != 1
                or (num_blocks is not None and t.shape[0] != num_blocks)):
            raise ValueError(
                f"kvpool: state layer {name} has a cache of shape {tuple(t.shape)}, strides "
                f"{tuple(t.stride())}, {t.dtype}: not the [blocks, 1, 1, "
                f"{group.content_bytes}] byte view kvpool knows")
        planes.append((t.data_ptr(), t.stride(0)))
    return planes


class StateWorkerSide:
    """The worker side of one state part: copies states between vLLM's state blocks and the
    pool it shares with the attention parts, in the step the metadata names."""

    def __init__(self, vllm_config: "VllmConfig", kv_caches: dict[str, torch.Tensor], *,
                 group: StateGroup, share_pool_with: "WorkerSide", socket_path: str,
                 config_text: str, config_format: str, tp_size: int, tp_rank: int,
                 block_size: int, parts: int, num_blocks: int | None,
                 weights_id: str | None = None):
        import vllm

        self.group = group
        self.kv_caches = kv_caches  # vLLM holds them too; kept for the addresses' lifetime
        self.planes = state_planes(kv_caches, group, num_blocks)
        model, weights = model_identity(vllm_config, weights_id)
        isa = torch.backends.cpu.get_cpu_capability()
        # The worker's lookup server answers the scheduler's presence lookups in the group's
        # key scope. A state is no per-token KV: its layout is one byte per token of the
        # group's layers (a key ingredient); its real format is in ``kv_format``.
        self.native = _native.Worker(
            config_text=config_text, config_format=config_format, model=model,
            weights=weights, tp_size=tp_size, tp_rank=tp_rank, pp_rank=0,
            block_size=block_size, num_layers=len(self.planes), num_kv_heads=1, head_size=1,
            dtype="fp8_e4m3", kind="latent",
            kv_format=f"vllm={vllm.__version__}|isa={isa}|{group.key_format}",
            socket_path=socket_path, share_pool_with=share_pool_with.native, parts=parts)
        self.values = _native.StateValues(self.native, share_pool_with.native,
                                          len(self.planes) * group.content_bytes, block_size)
        self.step: dict[str, list] = {"loads": [], "refused": [], "saves": []}
        self.recving: set[str] = set()
        self.failed: set[str] = set()
        self.counts: Counter[str] = Counter()
        self.last_counts: Counter[str] = Counter()
        logger.info("kvpool worker rank %d: recurrent-state group %s, %d layers, %d bytes a "
                    "state", tp_rank, group.key_format, len(self.planes),
                    len(self.planes) * group.content_bytes)

    def spans(self, block: int) -> list[tuple[int, int]]:
        return [(base + block * stride, self.group.content_bytes) for base, stride in self.planes]

    def bind(self, data: bytes) -> None:
        self.step = json.loads(data) if data else {"loads": [], "refused": [], "saves": []}

    def handle_preemptions(self, preempted: list[str]) -> None:
        return  # every copy ends within the call that makes it

    def start_load(self) -> None:
        for req_id in self.step["refused"]:
            self.recving.add(req_id)
            self.failed.add(req_id)
            self.counts["state_loads_refused"] += 1
        for req_id, key, block in self.step["loads"]:
            self.recving.add(req_id)
            ok = self.values.read(bytes.fromhex(key), self.spans(block))
            if ok:
                self.counts["state_loads"] += 1
            else:
                self.failed.add(req_id)
                self.counts["state_load_failures"] += 1
        self.step["loads"], self.step["refused"] = [], []

    def save(self) -> None:
        saves = self.step["saves"]
        if not saves:
            return
        self.step["saves"] = []
        stored = self.values.write([bytes.fromhex(k) for k, _ in saves],
                                   [self.spans(block) for _, block in saves])
        self.counts["state_saves"] += stored

    def clear(self) -> None:
        return

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving, self.recving = self.recving, set()
        return None, recving or None

    def failed_load_requests(self) -> tuple[list[str], bool]:
        failed, self.failed = self.failed, set()
        return sorted(failed), False

    def worker_meta(self) -> KvpoolWorkerMeta:
        return KvpoolWorkerMeta(executed=Counter(), copied=Counter())

    def kv_cache_events(self):
        return None

    def native_stats(self) -> dict[str, int]:
        return dict(self.counts)

    def stats(self) -> KvpoolConnectorStats:
        delta = {k: v - self.last_counts.get(k, 0) for k, v in self.counts.items()}
        self.last_counts = Counter(self.counts)
        return KvpoolConnectorStats(data=delta)

    def shutdown(self) -> None:
        self.native.shutdown()
