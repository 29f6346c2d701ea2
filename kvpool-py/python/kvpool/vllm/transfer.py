"""The one transfer path: block copies between vLLM's KV tensors and kvpool's host chunks,
with torch's own ops, the same code for CPU and CUDA tensors.

A copy job (planned by the Rust worker) names engine block ids and the addresses of kvpool's
host chunks; a chunk holds its blocks plane by plane (``[planes, blocks_per_chunk,
plane_block_bytes]``, a plane being one layer's blocks, or its K or V half). Per batch of
chunks a job takes a few ops per plane, never one per block:

- save: ``index_select`` the blocks of each plane into a stage on the engine's device, then
  one ``copy_`` per chunk into its host buffer;
- load: one ``copy_`` per chunk into a stage on the device, then ``index_copy_`` into each
  plane's blocks.

On CPU the stage is host memory and every copy completes before the call returns. On CUDA
(the only differences): the copies run on a side stream ordered after the compute stream
(saves) and waited for by it (loads), and each job records an event that ``poll`` checks; no
call synchronizes the device. kvpool's host memory is page-locked for the DMA
(``pin_host_memory``).
"""

from __future__ import annotations

import ctypes
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

#: Most bytes staged on the engine's device at once (larger jobs go in batches of chunks).
MAX_STAGE_BYTES = 256 << 20


@dataclass(frozen=True)
class CopyJob:
    """One job from ``kvpool._native.Worker.load_jobs`` / ``save_jobs``."""

    id: int
    is_load: bool
    req_id: str
    block_ids: list[int]
    skip_blocks: int
    blocks_per_chunk: int
    chunk_bytes: int
    chunk_ptrs: list[int]

    @classmethod
    def from_native(cls, t: tuple) -> "CopyJob":
        return cls(*t)


def host_tensor(ptr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of host memory at ``ptr`` (no copy; kvpool owns it)."""
    buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)


class BlockMover:
    """Runs copy jobs against one worker's KV planes (each ``[num_blocks, plane_block_bytes]``
    uint8 views of vLLM's tensors, all on one device)."""

    def __init__(self, planes: list[torch.Tensor]):
        if not planes:
            raise ValueError("kvpool: no KV planes to move")
        self.planes = planes
        self.device = planes[0].device
        self.plane_block_bytes = int(planes[0].shape[1])
        for p in planes:
            if p.dtype != torch.uint8 or p.dim() != 2 or p.shape[1] != self.plane_block_bytes \
                    or p.device != self.device or not p.is_contiguous():
                raise ValueError(f"kvpool: KV plane {tuple(p.shape)} {p.dtype} {p.device} is not "
                                 f"a contiguous uint8 [blocks, {self.plane_block_bytes}] view")
        self.cuda = self.device.type == "cuda"
        self.stream: Any = torch.cuda.Stream(self.device) if self.cuda else None
        self._pending: list[tuple[int, Any]] = []

    def _stream_ctx(self):
        return torch.cuda.stream(self.stream) if self.cuda else nullcontext()

    def run(self, job: CopyJob) -> None:
        """Starts the job's copies. On CPU they are done when this returns; on CUDA the job is
        done once ``poll`` returns its id."""
        planes = len(self.planes)
        bpc = job.blocks_per_chunk
        expected = planes * bpc * self.plane_block_bytes
        if job.chunk_bytes != expected:
            raise ValueError(f"kvpool: chunks of {job.chunk_bytes} bytes for {planes} planes of "
                             f"{bpc} blocks of {self.plane_block_bytes} bytes")
        per_batch = max(1, MAX_STAGE_BYTES // max(job.chunk_bytes, 1))
        ids = torch.tensor(job.block_ids, dtype=torch.long)
        if self.cuda:
            # The side stream starts after everything the compute stream queued (this step's
            # forward pass for a save; block zeroing for a load).
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._stream_ctx():
            ids = ids.to(self.device, non_blocking=True)
            first = 0
            for start in range(0, len(job.chunk_ptrs), per_batch):
                ptrs = job.chunk_ptrs[start:start + per_batch]
                # Chunk blocks `start * bpc + skip ..` of the job; the first batch skips.
                skip = job.skip_blocks if start == 0 else 0
                count = len(ptrs) * bpc - skip
                batch_ids = ids[first:first + count]
                first += count
                hosts = [host_tensor(p, job.chunk_bytes).view(planes, bpc, self.plane_block_bytes)
                         for p in ptrs]
                if job.is_load:
                    self._load(hosts, batch_ids, skip)
                else:
                    self._save(hosts, batch_ids)
            if self.cuda:
                event = torch.cuda.Event()
                event.record(self.stream)
                self._pending.append((job.id, event))
                if job.is_load:
                    # The engine reads loaded blocks only after the copy (a device-side wait).
                    torch.cuda.current_stream(self.device).wait_event(event)

    def _save(self, hosts: list[torch.Tensor], ids: torch.Tensor) -> None:
        n, bpc, b = len(hosts), hosts[0].shape[1], self.plane_block_bytes
        stage = torch.empty((n, len(self.planes), bpc, b), dtype=torch.uint8, device=self.device)
        for p, plane in enumerate(self.planes):
            stage[:, p] = plane.index_select(0, ids).view(n, bpc, b)
        for c, host in enumerate(hosts):
            host.copy_(stage[c], non_blocking=True)

    def _load(self, hosts: list[torch.Tensor], ids: torch.Tensor, skip: int) -> None:
        n, bpc, b = len(hosts), hosts[0].shape[1], self.plane_block_bytes
        stage = torch.empty((n, len(self.planes), bpc, b), dtype=torch.uint8, device=self.device)
        for c, host in enumerate(hosts):
            stage[c].copy_(host, non_blocking=True)
        by_plane = stage.transpose(0, 1).reshape(len(self.planes), n * bpc, b)
        for p, plane in enumerate(self.planes):
            plane.index_copy_(0, ids, by_plane[p, skip:])

    def poll(self) -> list[int]:
        """Ids of jobs whose copies ended since the last call (on CPU: every job run)."""
        done = [job for job, event in self._pending if event.query()]
        self._pending = [(j, e) for j, e in self._pending if j not in set(done)]
        return done

    def wait(self, job_ids: list[int]) -> None:
        """Makes the compute stream wait for these jobs (before vLLM reuses their blocks)."""
        wanted = set(job_ids)
        for job, event in self._pending:
            if job in wanted:
                torch.cuda.current_stream(self.device).wait_event(event)


def pin_host_memory(ptr: int, nbytes: int) -> bool:
    """Page-locks kvpool's host memory for CUDA DMA (``cudaHostRegister``); a no-op without
    CUDA. Returns whether it is pinned."""
    if not torch.cuda.is_available() or nbytes == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    return int(err) == 0
