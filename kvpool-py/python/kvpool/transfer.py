"""The one transfer path: block copies between vLLM's KV tensors and kvpool's host chunks,
with torch's own ops, the same code for CPU and CUDA tensors.

A copy job (planned by the Rust worker) names engine block ids and the addresses of kvpool's
host chunks; a chunk holds its blocks plane by plane (``[planes, chunk_blocks[c],
plane_block_bytes]``, a plane being one layer's pages; a job's chunks are whole chunks, then a
prompt's tail blocks, one block each). Per chunk and plane a job takes two
ops, never one per block:

- save: ``index_select`` the chunk's blocks of the plane on the engine's device, then
  ``copy_`` them into the chunk's host buffer;
- load: ``to`` the engine's device (a no-op on CPU), then ``index_copy_`` into the plane.

Both ops see the bytes as the widest integer word (8, 4 or 2 bytes) that divides the block
length, the planes' row strides and every address: torch's ``index_copy_`` moves one element at
a time on CPU, so a load of 8-byte words is about seven times faster than one of bytes
(docs/benchmarks.md).

On CPU every copy is done when the call returns, and each byte is copied once. (A first
version staged a whole batch on the device and regrouped it with one op per plane: ten times
slower on CPU, where the regrouping copies are not free; measured in docs/benchmarks.md.) On
CUDA (the only differences): the copies run on a side stream ordered after the compute stream
(saves) and waited for by it (loads), and each job records an event that ``poll`` checks;
nothing synchronizes the device. kvpool's host memory is page-locked for the DMA
(``pin_host_memory``).
"""

from __future__ import annotations

import ctypes
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

@dataclass(frozen=True)
class CopyJob:
    """One job from ``kvpool._native.Worker.load_jobs`` / ``save_jobs``."""

    id: int
    is_load: bool
    req_id: str
    block_ids: list[int]
    skip_blocks: int
    chunk_blocks: list[int]
    block_bytes: int
    chunk_ptrs: list[int]

    @classmethod
    def from_native(cls, t: tuple) -> "CopyJob":
        return cls(*t)


def host_tensor(ptr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of host memory at ``ptr`` (no copy; kvpool owns it)."""
    buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)


_WORDS = (torch.int64, torch.int32, torch.int16)


def word_dtype(values: list[int]) -> torch.dtype:
    """The widest integer dtype whose size divides every one of ``values`` (byte lengths,
    strides, addresses); ``uint8`` when none does."""
    for dtype in _WORDS:
        if all(v % dtype.itemsize == 0 for v in values):
            return dtype
    return torch.uint8


class BlockMover:
    """Runs copy jobs against one worker's KV planes: ``[num_blocks, plane_block_bytes]`` uint8
    views of the engine's tensors, all on one device, each block's bytes contiguous (rows may
    be further apart than their length: vLLM pads pages)."""

    def __init__(self, planes: list[torch.Tensor]):
        if not planes:
            raise ValueError("kvpool: no KV planes to move")
        self.planes = planes
        self.device = planes[0].device
        self.plane_block_bytes = int(planes[0].shape[1])
        for p in planes:
            if p.dtype != torch.uint8 or p.dim() != 2 or p.shape[1] != self.plane_block_bytes \
                    or p.device != self.device or p.stride(1) != 1 \
                    or p.stride(0) < self.plane_block_bytes:
                raise ValueError(f"kvpool: KV plane {tuple(p.shape)} {p.stride()} {p.dtype} "
                                 f"{p.device} is not a uint8 [blocks, {self.plane_block_bytes}] "
                                 "view with each block's bytes contiguous")
        # The word the planes allow; a job narrows it further if a chunk's address needs it.
        self.word = word_dtype([self.plane_block_bytes]
                               + [v for p in planes for v in (p.stride(0), p.data_ptr())])
        self.cuda = self.device.type == "cuda"
        self.stream: Any = torch.cuda.Stream(self.device) if self.cuda else None
        self._pending: list[tuple[int, Any]] = []

    def _stream_ctx(self):
        return torch.cuda.stream(self.stream) if self.cuda else nullcontext()

    def run(self, job: CopyJob) -> None:
        """Starts the job's copies. On CPU they are done when this returns; on CUDA the job is
        done once ``poll`` returns its id."""
        planes = len(self.planes)
        expected = planes * self.plane_block_bytes
        if job.block_bytes != expected or len(job.chunk_blocks) != len(job.chunk_ptrs):
            raise ValueError(f"kvpool: chunk blocks of {job.block_bytes} bytes for {planes} "
                             f"planes of {self.plane_block_bytes} bytes "
                             f"({len(job.chunk_blocks)} block counts, {len(job.chunk_ptrs)} chunks)")
        ids = torch.tensor(job.block_ids, dtype=torch.long)
        word = word_dtype([self.word.itemsize, *job.chunk_ptrs])
        words = self.plane_block_bytes // word.itemsize
        engine = [p.view(word) for p in self.planes]
        if self.cuda:
            # The side stream starts after everything the compute stream queued (this step's
            # forward pass for a save; block zeroing for a load).
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._stream_ctx():
            ids = ids.to(self.device, non_blocking=True)
            first = 0
            for c, (ptr, bpc) in enumerate(zip(job.chunk_ptrs, job.chunk_blocks)):
                host = host_tensor(ptr, bpc * job.block_bytes).view(word).view(planes, bpc, words)
                # The first chunk may start part-way (blocks the engine already holds).
                skip = job.skip_blocks if c == 0 else 0
                chunk_ids = ids[first:first + bpc - skip]
                first += bpc - skip
                for p, plane in enumerate(engine):
                    if job.is_load:
                        plane.index_copy_(0, chunk_ids, host[p, skip:].to(self.device,
                                                                          non_blocking=True))
                    else:
                        host[p, skip:].copy_(plane.index_select(0, chunk_ids), non_blocking=True)
            if self.cuda:
                event = torch.cuda.Event()
                event.record(self.stream)
                self._pending.append((job.id, event))
                if job.is_load:
                    # The engine reads loaded blocks only after the copy (a device-side wait).
                    torch.cuda.current_stream(self.device).wait_event(event)

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
