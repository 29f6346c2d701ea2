"""The connector's worker side, in each vLLM Worker process: it owns the pool (CPU memory,
then disk / Redis / S3 tiers from the config), answers the scheduler's lookups, and runs the
copy jobs the Rust worker plans with a transfer path (``kvpool.transfer``: kvpool-cuda's
native executors, or torch's ops): synchronous loads before the forward pass, asynchronous
loads as their chunks arrive, saves after the forward pass."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kvpool import _native
from kvpool.vllm.identity import model_identity
from kvpool.vllm.layouts import detect_for
from kvpool.vllm.reports import KvpoolConnectorStats, KvpoolKVEvents, KvpoolWorkerMeta
from kvpool.transfer import (BlockMover, NodeMemoryPins, compute_stream,
                             native_copy_engine, pin_host_memory, resolve_transfer)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("kvpool.vllm")


class WorkerSide:
    """See the module docs."""

    def __init__(self, vllm_config: "VllmConfig", kv_caches: dict[str, torch.Tensor], *,
                 config_text: str, config_format: str, tp_size: int, block_size: int,
                 socket_path_of, kv_events: bool, kv_cache_config=None,
                 stage_node_memory_copies: bool = False, transfer: str = "auto",
                 group_format: str = "", share_pool_with: "WorkerSide | None" = None,
                 parts: int = 1, null_block: int | None = None,
                 weights_id: str | None = None):
        """For one KV cache group of a hybrid model (``kvpool.vllm.hybrid``): ``kv_caches``
        holds the group's layers, ``group_format`` names the group in every key,
        ``share_pool_with`` is the worker side whose pool it shares (``None`` builds the pool),
        one of ``parts``, and ``null_block`` is vLLM's null block id. ``weights_id`` is the
        operator's name for the weights (``None``: their files are hashed)."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        layout = detect_for(vllm_config, kv_caches, block_size, kv_cache_config)
        if group_format:
            layout.kv_format += "|" + group_format
        owns_pool = share_pool_with is None
        #: Whether this side built the pool (a hybrid model's other groups share it): only
        #: the owner page-locks the pool's memory.
        self.owns_pool = owns_pool
        self.tp_rank = get_tensor_model_parallel_rank()
        self.kv_caches = kv_caches
        planes = layout.planes
        self.device = planes[0].device
        self.cuda = self.device.type == "cuda"
        self.transfer = resolve_transfer(transfer, self.device)
        # Exactly one of the two runs the copies.
        self.mover = BlockMover(planes) if self.transfer == "torch" else None
        self.copies = native_copy_engine(planes) if self.transfer == "native" else None
        self.model, self.weights = model_identity(vllm_config, weights_id)
        self.native = _native.Worker(
            config_text=config_text,
            config_format=config_format,
            model=self.model,
            weights=self.weights,
            tp_size=tp_size,
            tp_rank=self.tp_rank,
            pp_rank=0,
            block_size=block_size,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_size=layout.head_size,
            dtype=str(layout.dtype),
            kv_format=layout.kv_format,
            kind=layout.kind,
            replicated=layout.replicated,
            socket_path=socket_path_of(self.tp_rank),
            share_pool_with=None if owns_pool else share_pool_with.native,
            parts=parts,
            null_block=null_block,
        )
        self.host_pin = None
        # On a GPU, the daemon's shared memory as mapped here, page-locked for one DMA per
        # chunk (from the first step after the worker reached the daemon): by the native
        # engine (guards the mappings own) or, on the torch path, from here.
        self.node_memory_pins = NodeMemoryPins(self.native, self.device) \
            if self.cuda and self.mover is not None and owns_pool else None
        if self.cuda or stage_node_memory_copies:
            # A chunk of the node's pool daemon is read once, from its shared memory: staged
            # (on a GPU: copied to the device once, the blocks filled from that copy, which is
            # read back into a buffer of the worker's) and checked behind the forward pass.
            self.native.check_staged_copies()
        else:
            # The worker reads the blocks to check a chunk copied straight from the node's
            # pool daemon into them (one copy).
            # The tensors outlive the worker's use: vLLM and self.kv_caches hold them.
            self.native.set_host_planes([(p.data_ptr(), p.stride(0)) for p in planes],
                                        int(planes[0].shape[1]),
                                        min(int(p.shape[0]) for p in planes))
        if self.cuda and owns_pool:
            # kvpool's chunks live in L1's arena, page-locked once for DMA and unlocked before
            # the arena is freed: natively by a guard the arena owns; on the torch path from
            # here (at shutdown, or by the native worker just before it frees the arena).
            if self.copies is not None:
                pinned = self.native.pin_host_memory(self.copies)
            else:
                region = self.native.host_memory()
                if region is not None:
                    self.host_pin = pin_host_memory(*region,
                                                    before_free=self.native.call_before_free,
                                                    device=self.device)
                pinned = self.host_pin is not None and self.host_pin.pinned
            if not pinned:
                logger.warning("kvpool: could not page-lock kvpool's host memory; copies to and "
                               "from the GPU go through pageable memory (slower)")
        self.kv_events = kv_events
        if kv_events:
            self.native.enable_tier_events()
        self.last_stats: dict[str, int] = {}
        logger.info("kvpool worker rank %d: %d layers, model %s, weights %s, format %s, "
                    "copies: %s", self.tp_rank, layout.num_layers, self.model, self.weights,
                    layout.kv_format, self.copies.description if self.copies is not None
                    else "torch")

    def _run(self, load: bool) -> None:
        if self.copies is not None:
            self.native.run_copies(self.copies, load, compute_stream(self.device))
            return
        jobs = self.native.load_jobs() if load else self.native.save_jobs()
        for job in jobs:
            try:
                self.mover.run(job)
            except Exception:  # noqa: BLE001 - a failed copy is reported, never raised
                logger.exception("kvpool: copy job %d (%s) failed", job.id, job.req_id)
                # Copies it queued before it failed end before its memory is freed.
                self.mover.wait_for_queued_copies()
                self.native.copy_done(job.id, False)
                continue
            if not self.mover.cuda:
                self.native.copy_done(job.id, True)

    def _poll(self) -> None:
        if self.copies is not None:
            self.native.poll_copies(self.copies)
            return
        for job_id in self.mover.poll():
            self.native.copy_done(job_id, True)

    def _settle_read_backs(self) -> None:
        """Reports done the loads whose staged copies are still being read back (CUDA), after
        waiting for those copies: vLLM asks for the step's results once the forward pass is
        launched, not finished, and a staged copy must be checked before the step's failed
        blocks are reported, in the step whose forward pass used the blocks."""
        if self.copies is not None:
            self.native.settle_copies(self.copies)
            return
        for job_id in self.mover.wait_for_read_backs():
            self.native.copy_done(job_id, True)

    def handle_preemptions(self, preempted: list[str]) -> None:
        """Before vLLM reuses a preempted request's blocks: copies still reading or writing
        them finish first."""
        if not preempted:
            return
        if self.copies is not None:
            self.native.order_copies_before(self.copies, preempted,
                                            compute_stream(self.device))
        else:
            self.mover.wait(self.native.jobs_in_flight_for(preempted))

    def bind(self, data: bytes) -> None:
        self.native.bind(data)

    def start_load(self) -> None:
        self._poll()
        if self.node_memory_pins is not None:
            self.node_memory_pins.refresh()
        elif self.cuda and self.owns_pool:
            self.native.pin_node_memory(self.copies)
        self._run(load=True)

    def save(self) -> None:
        self._settle_read_backs()
        self._run(load=False)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._poll()
        self._settle_read_backs()
        sending, recving = self.native.transfer_results(list(finished_req_ids or ()))
        return (set(sending) or None, set(recving) or None)

    def failed_blocks(self) -> set[int]:
        self._settle_read_backs()
        return set(self.native.failed_blocks())

    def failed_load_requests(self) -> tuple[list[str], bool]:
        """The requests whose loads failed since the last call, and whether blocks failed
        with no request named (a hybrid model's part: vLLM takes its failures per request,
        so the failed blocks are drained unreported)."""
        self.native.failed_blocks()
        return self.native.failed_load_requests()

    def native_stats(self) -> dict[str, int]:
        """The worker's counters since it started."""
        return dict(self.native.stats())

    def worker_meta(self) -> KvpoolWorkerMeta:
        self._settle_read_backs()
        executed, copied = self.native.step_report()
        return KvpoolWorkerMeta(executed=_count(executed), copied=_count(copied))

    def clear(self) -> None:
        self.native.clear()

    def kv_cache_events(self) -> KvpoolKVEvents | None:
        if not self.kv_events:
            return None
        events = [(tier, stored, tuple(hashes))
                  for tier, stored, hashes in self.native.take_tier_events()]
        return KvpoolKVEvents(events) if events else None

    def stats(self) -> KvpoolConnectorStats:
        now = self.native.stats()
        delta = {k: v - self.last_stats.get(k, 0) for k, v in now.items()}
        self.last_stats = now
        return KvpoolConnectorStats(data=delta)

    def shutdown(self) -> None:
        if self.copies is not None:
            # Copies still queued on kvpool's stream end before the pool frees their buffers.
            try:
                self.copies.synchronize()
                self.native.poll_copies(self.copies)
            except Exception:  # noqa: BLE001 - the pool still flushes and closes
                logger.exception("kvpool: could not wait for the copies in flight")
        if self.node_memory_pins is not None:
            try:
                self.node_memory_pins.release()
            except Exception:  # noqa: BLE001 - the pool still flushes and closes
                logger.exception("kvpool: could not unlock the pool daemon's shared memory")
        if self.host_pin is not None:
            try:
                self.host_pin.release()
            except Exception:  # noqa: BLE001 - the pool still flushes and closes
                logger.exception("kvpool: could not unlock kvpool's host memory")
        self.native.shutdown()


def _count(steps: list[int]):
    from collections import Counter

    return Counter(steps)
