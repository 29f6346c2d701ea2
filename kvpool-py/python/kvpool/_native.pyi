"""Type stubs for ``kvpool._native``, kvpool's Rust extension (PyO3, built from kvpool-py/src/*.rs).

They describe what the native module exports, for type checkers and IDEs; nothing here runs.
kvpool-py/tests/test_native_stubs.py checks these stubs against the built module.
"""

from __future__ import annotations

import os
from typing import Any, final

__version__: str

@final
class CopyJob:
    """One job of block copies between the engine's KV blocks and kvpool's host chunks."""

    def __new__(
        cls,
        *,
        id: int,
        is_load: bool,
        req_id: str,
        block_ids: list[int],
        skip_blocks: int,
        chunk_blocks: list[int],
        block_bytes: int,
        chunk_ptrs: list[int],
        check_copy_ptrs: list[int] = ...,
        asynchronous: bool = False,
    ) -> CopyJob:
        """A job from its fields, as the worker would plan it (`check_copy_ptrs` defaults to [])."""
        ...
    @property
    def id(self) -> int:
        """The job's id, to report it done (`Worker.copy_done`)."""
        ...
    @property
    def is_load(self) -> bool:
        """Whether it copies kvpool's chunks into the engine's blocks (else the blocks out)."""
        ...
    @property
    def req_id(self) -> str:
        """The request it serves."""
        ...
    @property
    def block_ids(self) -> list[int]:
        """Engine block ids, one per chunk block from `skip_blocks` on, in chunk order."""
        ...
    @property
    def skip_blocks(self) -> int:
        """Leading blocks of the first chunk the job does not copy."""
        ...
    @property
    def chunk_blocks(self) -> list[int]:
        """Blocks in each chunk, one entry per chunk."""
        ...
    @property
    def block_bytes(self) -> int:
        """Bytes of one block of a chunk, every plane."""
        ...
    @property
    def chunk_ptrs(self) -> list[int]:
        """Address of each chunk's host buffer (read for a load, written for a save)."""
        ...
    @property
    def check_copy_ptrs(self) -> list[int]:
        """Per chunk: 0, or the worker's buffer for the chunk's staged copy; empty when none."""
        ...
    @property
    def asynchronous(self) -> bool:
        """A load the request waits for in the background."""
        ...

@final
class CopyEngine:
    """Runs the copy jobs a worker plans, on host memory (memcpy) or a CUDA device."""

    def __new__(
        cls,
        *,
        planes: list[tuple[int, int]],
        plane_block_bytes: int,
        num_blocks: int,
        device: int | None = None,
        mode: str = "auto",
    ) -> CopyEngine:
        """An engine over the KV planes: one (address of block 0, bytes between blocks) each."""
        ...
    @property
    def kind(self) -> str:
        """`"host"` or `"cuda"`."""
        ...
    @property
    def description(self) -> str:
        """The device and how it copies, for logs."""
        ...
    @property
    def kernel_jobs(self) -> tuple[int, int]:
        """(jobs whose pages went through kvpool's copy kernel, jobs queued in all) (GPU)."""
        ...
    @property
    def batched(self) -> bool:
        """Whether a job's copies go as one batch per phase (`cuMemcpyBatchAsync`)."""
        ...
    def run(self, job: CopyJob, stream: int = 0) -> bool:
        """Runs one job after `stream`'s work; returns whether it is done already."""
        ...
    def poll(self) -> list[tuple[int, bool]]:
        """(job id, ok) of each job that ended since the last call (GPU)."""
        ...
    def synchronize(self) -> None:
        """Waits on the host for every copy queued on kvpool's stream."""
        ...
    def in_flight(self) -> int:
        """Jobs queued and not yet reported."""
        ...
    def wait_node_memory_pinned(self, timeout: float) -> list[bool]:
        """Waits up to `timeout` s for the node daemon's mappings' page-locking; per mapping, whether locked."""
        ...

@final
class HiCacheStore:
    """kvpool's tiers as one SGLang HiCache storage backend: pages by key, moved by address."""

    def __new__(
        cls,
        config_text: str,
        config_format: str,
        model_scope: str,
        world_size: int,
        rank: int,
        pp_rank: int,
        page_bytes: int,
        tokens_per_page: int,
        writer: bool,
        max_page_bytes: int = 0,
    ) -> HiCacheStore:
        """Builds the pool from the user's config fitted to pages of `page_bytes` (or `max_page_bytes`)."""
        ...
    def sharing(
        self, model_scope: str, page_bytes: int, tokens_per_page: int
    ) -> HiCacheStore:
        """A store for another of SGLang's host pools over this store's tiers."""
        ...
    def presence(self, keys: list[str]) -> list[bool]:
        """Which of `keys` some tier holds, each on its own."""
        ...
    def existing_prefix(self, keys: list[str]) -> int:
        """How many leading pages of `keys` some tier holds."""
        ...
    def read_pages(
        self, keys: list[str], addrs: list[int], sizes: list[int]
    ) -> list[bool]:
        """Reads the longest stored prefix of `keys` into host memory at `addrs` (raw addresses)."""
        ...
    def write_pages(
        self, keys: list[str], addrs: list[int], sizes: list[int]
    ) -> list[bool]:
        """Stores page `i` of `keys` from host memory at `addrs` (raw addresses)."""
        ...
    def take_call_stats(
        self,
    ) -> tuple[list[tuple[int, int, float]], list[tuple[int, int, float]]]:
        """Per-call samples since the last call: (reads, writes), each (pages, bytes, seconds)."""
        ...
    def totals(self) -> tuple[int, int, int, int]:
        """Totals since start: (pages read, missed, written, refused)."""
        ...
    def clear(self) -> None:
        """Nothing stored before is found again by this store (a fresh key root)."""
        ...
    def close(self) -> None:
        """Refuses later calls, flushes write-behind and closes the tiers."""
        ...
    @property
    def page_bytes(self) -> int:
        """Bytes per page."""
        ...
    @property
    def fitted_page_bytes(self) -> int:
        """The largest page the pool was fitted to."""
        ...
    @property
    def is_writer(self) -> bool:
        """Whether this rank writes."""
        ...
    def tier_names(self) -> list[str]:
        """The pool's tiers, in lookup order."""
        ...

@final
class NodeMemoryRegion:
    """A mapping of the node's pool daemon's shared memory, kept mapped while this object lives."""

    # No constructor: only `Worker.node_memory_regions()` makes these.
    @property
    def address(self) -> int:
        """The first byte's address."""
        ...
    @property
    def length(self) -> int:
        """Its length in bytes."""
        ...

@final
class OffloadTier:
    """kvpool's tiers behind vLLM's CPU primary region: lookups, store and load jobs by row id."""

    def __new__(
        cls,
        config_text: str,
        config_format: str,
        model_scope: str,
        world_size: int,
        base: int,
        rows: int,
        row_bytes: int,
        tokens_per_row: int,
    ) -> OffloadTier:
        """Builds the pool fitted to `rows` rows of `row_bytes` at address `base` (of vLLM's memoryview)."""
        ...
    def lookup(self, key: bytes) -> int:
        """0 miss, 1 hit, 2 retry (a lower tier is being asked)."""
        ...
    def submit_store(self, job_id: int, keys: list[bytes], rows: list[int]) -> None:
        """Starts storing rows `rows[i]` under `keys[i]`; returns at once."""
        ...
    def submit_load(self, job_id: int, keys: list[bytes], rows: list[int]) -> None:
        """Starts loading `keys[i]` into rows `rows[i]`; returns at once."""
        ...
    def finished(self) -> list[tuple[int, bool, int | None, int, float]]:
        """Jobs finished since the last call: (job id, success, keys loaded or None, bytes, seconds)."""
        ...
    def in_flight(self) -> int:
        """Jobs submitted and not yet finished."""
        ...
    def drain(self) -> None:
        """Blocks until no job is in flight."""
        ...
    def reset(self) -> None:
        """vLLM's `reset_cache`: drains, then nothing stored before is found again."""
        ...
    def close(self) -> None:
        """Refuses later jobs and lookups, drains, flushes write-behind and closes the tiers."""
        ...
    def tier_names(self) -> list[str]:
        """The pool's tiers, in lookup order."""
        ...

@final
class Scheduler:
    """The scheduler half of the vLLM connector."""

    def __new__(
        cls,
        *,
        socket_paths: list[str],
        block_size: int,
        save_decode_tokens: bool = False,
        load_timing: str = "auto",
        async_scheduling: bool = False,
        timeout_ms: int = 5000,
        connect_timeout_ms: int = 120000,
        loads: bool = True,
    ) -> Scheduler:
        """Connects to every worker rank's lookup socket."""
        ...
    def chunk_size(self) -> int:
        """Tokens per chunk (from the workers)."""
        ...
    def scope_digest(self) -> str:
        """How this engine derives keys: engines whose digests differ never share a key."""
        ...
    def get_num_new_matched_tokens(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        extra_keys: bytes,
        num_computed_tokens: int,
        skip_save: bool = False,
    ) -> tuple[int, bool]:
        """vLLM `get_num_new_matched_tokens`: tokens to load, and whether the load is asynchronous."""
        ...
    def update_state_after_alloc(
        self, req_id: str, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """vLLM `update_state_after_alloc` with the request's full block list."""
        ...
    def build_connector_meta(
        self,
        scheduled: list[tuple[str, int, list[int], int, list[int], int]],
        preempted: list[str],
    ) -> bytes:
        """vLLM `build_connector_meta`: returns the encoded metadata for the workers."""
        ...
    def chunk_hashes(self, req_id: str) -> list[bytes]:
        """The chained hashes of the request's full chunks so far, 16 bytes each."""
        ...
    def tail_block_hashes(self, req_id: str) -> list[bytes]:
        """The keys of the request's prompt tail blocks, 16 bytes each."""
        ...
    def chunks_present(self, chunk_hashes: list[bytes]) -> list[bool]:
        """Whether every worker rank's pool holds each chunk hash, each on its own (a hybrid
        model's recurrent states); nothing is leased."""
        ...
    def update_connector_output(
        self,
        failed_block_ids: list[int],
        finished_recving: list[str] = ...,
        executed_steps: list[tuple[int, int]] = ...,
        copied_steps: list[tuple[int, int]] = ...,
    ) -> None:
        """vLLM `update_connector_output`: failed blocks, ended loads, executed and copied steps."""
        ...
    def token_counts(self, req_ids: list[str]) -> list[int | None]:
        """How many tokens of each request's sequence the scheduler knows (None: untracked)."""
        ...
    def has_pending_work(self) -> bool:
        """vLLM `has_pending_push_work`: step reports still owed or decisions not yet shipped."""
        ...
    def saved_prompt_tokens(self, req_id: str) -> int:
        """Tokens of the request's prompt its saves so far cover."""
        ...
    def request_finished(self, req_id: str) -> bool:
        """vLLM `request_finished`: drops the request; returns whether the engine must hold its blocks."""
        ...
    def reset(self) -> None:
        """vLLM `reset_cache`: forgets every request and makes everything stored unreachable."""
        ...
    def stats(self) -> dict[str, int]:
        """Scheduler counters as a dict."""
        ...

@final
class StateValues:
    """A hybrid model's recurrent states (one KV cache group's) in a state part's pool, read
    and written by the chunk hash of the prefix each follows."""

    def __new__(cls, worker: Worker, owner: Worker, value_bytes: int, block_size: int
                ) -> StateValues:
        """States of ``value_bytes`` (every layer) in ``worker``'s key scope over the pool
        ``owner`` built (a state may not be larger than one of its chunks)."""
        ...
    def read(self, chunk_hash: bytes, spans: list[tuple[int, int]]) -> bool:
        """Copies the state after the prefix ``chunk_hash`` names into the engine's
        ``(address, length)`` spans; False (logged) when no tier holds a value that fits."""
        ...
    def write(self, chunk_hashes: list[bytes], spans: list[list[tuple[int, int]]]) -> int:
        """Stores each block's state under its prefix's chunk hash (those held already are
        left); returns how many were stored anew."""
        ...

class Worker:
    """The worker half of the vLLM connector (one per vLLM worker process / TP rank)."""

    def __new__(
        cls,
        *,
        config_text: str,
        config_format: str,
        model: str,
        weights: str,
        tp_size: int,
        tp_rank: int,
        pp_rank: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        dtype: str,
        kv_format: str,
        kind: str = "kv",
        replicated: bool = False,
        socket_path: str | None = None,
        share_pool_with: Worker | None = None,
        parts: int = 1,
        null_block: int | None = None,
    ) -> Worker:
        """Builds the pool for this worker (or shares `share_pool_with`'s) and answers lookups."""
        ...
    def bind(self, meta: bytes) -> None:
        """Binds a step's metadata (bytes from `Scheduler.build_connector_meta`)."""
        ...
    def clear(self) -> None:
        """Unbinds the step."""
        ...
    def load_jobs(self) -> list[CopyJob]:
        """Loads to copy into the engine's blocks now."""
        ...
    def save_jobs(self) -> list[CopyJob]:
        """Saves to copy out of the engine's blocks now."""
        ...
    def run_copies(self, engine: CopyEngine, load: bool, stream: int) -> int:
        """Plans and starts the step's load or save jobs with `engine`; returns how many started."""
        ...
    def poll_copies(self, engine: CopyEngine) -> None:
        """Reports the jobs `engine` finished since the last call."""
        ...
    def settle_copies(self, engine: CopyEngine) -> None:
        """Waits for the synchronous loads whose staged copies are in flight and reports them."""
        ...
    def order_copies_before(
        self, engine: CopyEngine, req_ids: list[str], stream: int
    ) -> None:
        """Makes `stream` wait for the copies still in flight on these requests' blocks."""
        ...
    def pin_host_memory(self, engine: CopyEngine) -> bool:
        """Page-locks kvpool's host memory (L1's arena) for `engine`'s DMA; returns whether it is."""
        ...
    def pin_node_memory(self, engine: CopyEngine) -> None:
        """Starts page-locking the node daemon's shared memory as this process maps it now."""
        ...
    def copy_done(self, job_id: int, ok: bool) -> None:
        """A copy job ended (`ok`: it copied everything)."""
        ...
    def jobs_in_flight_for(self, req_ids: list[str]) -> list[int]:
        """Copy jobs still in flight on these requests' blocks."""
        ...
    def transfer_results(
        self, finished_req_ids: list[str]
    ) -> tuple[list[str], list[str]]:
        """(finished_sending, finished_recving) for vLLM's `get_finished`."""
        ...
    def failed_blocks(self) -> list[int]:
        """Engine block ids whose load failed since the last call."""
        ...
    def failed_load_requests(self) -> tuple[list[str], bool]:
        """(request ids, unattributed): requests whose load failed since the last call."""
        ...
    def step_report(self) -> tuple[list[int], list[int]]:
        """(executed_steps, copied_steps) since the last call, for the scheduler."""
        ...
    def host_memory(self) -> tuple[int, int] | None:
        """(address, length) of L1's arena, for the engine side to page-lock; None without L1."""
        ...
    def node_memory_regions(self) -> list[NodeMemoryRegion]:
        """This process's mappings of the node's pool daemon's shared memory, as mapped now."""
        ...
    def set_host_planes(
        self, planes: list[tuple[int, int]], plane_block_bytes: int, num_blocks: int
    ) -> None:
        """Gives the worker the engine's KV planes in host memory: (address of block 0, stride) each."""
        ...
    def check_staged_copies(self) -> None:
        """Tells the worker the engine side stages daemon chunks in `check_copy_ptrs` buffers."""
        ...
    def call_before_free(self, callback: Any) -> None:
        """Calls `callback()` once when this worker is freed, before its host memory is."""
        ...
    def in_flight(self) -> tuple[int, int, int, int]:
        """(copy jobs in flight, async loads, staged save bytes, held requests)."""
        ...
    def enable_tier_events(self) -> None:
        """Starts recording chunks entering and leaving each tier."""
        ...
    def take_tier_events(self) -> list[tuple[str, bool, list[bytes]]]:
        """This worker's chunks that entered or left a tier since the last call: (tier, stored, hashes)."""
        ...
    def stats(self) -> dict[str, int]:
        """Counters since the worker started, as a dict."""
        ...
    def stored_chunks(self, tokens: list[int], extra_keys: bytes = ...) -> list[bytes]:
        """The stored chunk payloads for `tokens` (inspection and tests; copies the bytes)."""
        ...
    def shutdown(self) -> None:
        """Flushes write-behind to lower tiers and closes them; the worker is unusable afterwards."""
        ...

def check_config(text: str, format: str) -> int:
    """Checks a config without building anything (raises ValueError); returns its chunk size
    in tokens."""
    ...

def config_with_pool(text: str, format: str, pool: str) -> str:
    """The config, as JSON, with the node's pool daemon at `pool` as its first lower tier."""
    ...

def digest_file(path: str | os.PathLike[str]) -> str:
    """The xxh3-128 digest (hex) of a file's bytes."""
    ...

def digest_text(text: str) -> str:
    """The xxh3-128 digest (hex) of a text."""
    ...

def engine_scope(interface: str, name: str, weights: str, layout: str) -> str:
    """The model text of a key scope for an engine's KV (``vllm-connector``, ``vllm-offload``,
    ``sglang``)."""
    ...

def part_scope(scope: str, part: str, layout: str) -> str:
    """The model text of a part of an engine's KV kept apart from the rest."""
    ...

def encode_extra_keys(
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_hashes: list[str] = ...,
) -> bytes:
    """Encodes a request's extra keys (LoRA name, cache salt, multimodal hashes)."""
    ...

def lookup_socket_path(dir: str, engine_id: str, tp_rank: int) -> str:
    """The lookup socket path of a vLLM engine's worker rank."""
    ...

def run_command_line(argv: list[str]) -> int:
    """The `kvpool` command run on `argv` (program name first); returns the exit code."""
    ...
