"""The transfer paths: block copies between vLLM's KV tensors and kvpool's host chunks.

Two paths run the same jobs (planned by the Rust worker) and are selected in the connector's
options (``transfer``; docs/benchmarks.md has the measurements each default follows):

- ``native``: kvpool-cuda's executors (``kvpool._native.CopyEngine``, made by
  :func:`native_copy_engine`). The Python side hands over the planes' addresses once and the
  compute stream's handle per call; the worker builds each job's copy plan in Rust and runs it
  with memcpy on CPU tensors, or with one ``cuMemcpyBatchAsync`` per phase on kvpool's own
  stream on a GPU, page-locking kvpool's host memory with guards that memory owns.
- ``torch``: :class:`BlockMover` below, with torch's own ops, the same code for CPU and CUDA
  tensors; the rest of this docstring describes it.

A copy job (planned by the Rust worker) names engine block ids and the addresses of kvpool's
host chunks; a chunk holds its blocks plane by plane (``[planes, chunk_blocks[c],
plane_block_bytes]``, a plane being one layer's pages; a job's chunks are whole chunks, then a
prompt's tail blocks, one block each). Per chunk a job takes one op per plane and one copy
of the whole chunk, never one per block:

- save: ``index_select`` each plane's blocks of the chunk into the chunk's layout (on CPU
  straight into the chunk's host buffer; on CUDA into a device buffer shaped like the chunk,
  so a chunk's worth of device memory for staging), then, on CUDA, one ``copy_`` of it to
  the host (and, for a place in the pool daemon's memory, a second into the worker's buffer,
  which the worker hashes the checksum from; on CPU the gather goes into that buffer, then
  into the place);
- load: ``to`` the engine's device (a no-op on CPU: the chunk itself), then ``index_copy_``
  each plane's part into the plane.

A load's chunk that lies in memory other processes can write (the node's pool daemon's shared
memory) comes with a buffer of the worker's (``check_copy_ptrs``) and is read exactly once:
on CPU copied into that buffer, the planes then filled from it; on CUDA copied to the device
once, the planes filled from that device copy, which is then copied back into the buffer on a
read-back stream of its own (neither the forward pass nor the next job's copies wait for it).
The buffer then holds the bytes the blocks received, and the worker checks it against the
chunk's checksum while the forward pass runs. The engine side must report such a job done
before the step's results leave the worker (``wait_for_read_backs``), so that a copy that
fails its check is reported as failed blocks in the step that used them.

On an H100 one DMA per chunk instead of one per chunk and plane took loads from 0.49× to 0.73×
and saves from 0.45× to 0.56× of torch's copy of the same bytes as one contiguous buffer
(with 1,024-token chunks: 0.86-0.88× both ways; docs/benchmarks.md, with a two-stream variant
not adopted yet).

Both ops see the bytes as the widest integer word (8, 4 or 2 bytes) that divides the block
length, the planes' row strides and every address: torch's ``index_copy_`` moves one element at
a time on CPU, so a load of 8-byte words is about seven times faster than one of bytes
(docs/benchmarks.md).

On CPU every copy is done when the call returns, and each byte is copied once. (A first
version staged a whole batch on the device and regrouped it with one op per plane: ten times
slower on CPU, where the regrouping copies are not free; measured in docs/benchmarks.md.) On
CUDA (the only differences): a save gathers into a device buffer rather than the chunk itself,
then copies it out; the copies run on a side stream ordered after the compute stream
(saves) and waited for by it (loads), and each job records an event that ``poll`` checks;
nothing synchronizes the device. kvpool's host memory is page-locked for the DMA
(``pin_host_memory``) and unlocked before it is freed (``HostMemoryPin``).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from contextlib import nullcontext
from typing import Any

import torch

# One job from ``Worker.load_jobs`` / ``save_jobs``: named, read-only fields (kvpool-connector's
# ``CopyJob``), the same object ``CopyEngine.run`` takes.
from kvpool._native import CopyJob

logger = logging.getLogger("kvpool.transfer")


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


def check_planes(planes: list[torch.Tensor]) -> int:
    """Checks that ``planes`` are ``[num_blocks, plane_block_bytes]`` uint8 views, all on one
    device, each block's bytes contiguous (rows may be further apart than their length: vLLM
    pads pages); returns ``plane_block_bytes``."""
    if not planes:
        raise ValueError("kvpool: no KV planes to move")
    device = planes[0].device
    plane_block_bytes = int(planes[0].shape[1])
    for p in planes:
        if p.dtype != torch.uint8 or p.dim() != 2 or p.shape[1] != plane_block_bytes \
                or p.device != device or p.stride(1) != 1 or p.stride(0) < plane_block_bytes:
            raise ValueError(f"kvpool: KV plane {tuple(p.shape)} {p.stride()} {p.dtype} "
                             f"{p.device} is not a uint8 [blocks, {plane_block_bytes}] "
                             "view with each block's bytes contiguous")
    return plane_block_bytes


def native_copy_engine(planes: list[torch.Tensor], mode: str = "auto") -> Any:
    """kvpool-cuda's executor (``kvpool._native.CopyEngine``) over the engine's planes (the
    views :class:`BlockMover` takes): memcpy for CPU tensors; for a GPU's, batched DMA or
    kvpool's copy kernel for small scattered pages (``mode``: ``auto``, ``dma``, ``kernel``).
    The caller keeps the tensors alive while the engine is used."""
    from kvpool import _native

    plane_block_bytes = check_planes(planes)
    device = planes[0].device
    ordinal = None
    if device.type == "cuda":
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
    elif device.type != "cpu":
        raise ValueError(f"kvpool: no native copies for KV on {device}")
    return _native.CopyEngine(planes=[(p.data_ptr(), p.stride(0)) for p in planes],
                              plane_block_bytes=plane_block_bytes,
                              num_blocks=min(int(p.shape[0]) for p in planes), device=ordinal,
                              mode=mode)


#: The paths a user may name (the connector's ``transfer`` option).
TRANSFERS = ("auto", "native", "torch")

#: What ``"auto"`` picks per device type: the path measured faster side by side
#: (docs/benchmarks.md, "kvpool-cuda against the torch path").
DEFAULT_TRANSFER = {"cpu": "native", "cuda": "native"}


def resolve_transfer(choice: str, device: Any) -> str:
    """The transfer path (``"native"`` or ``"torch"``) for ``choice`` on ``device``."""
    if choice not in TRANSFERS:
        raise ValueError(f"kvpool: transfer {choice!r} is not one of {', '.join(TRANSFERS)}")
    if choice == "auto":
        return DEFAULT_TRANSFER.get(getattr(device, "type", "cpu"), "torch")
    return choice


def compute_stream(device: Any) -> int:
    """The handle of the stream the engine computes on (``cuda_stream``; 0 for CPU tensors):
    native copies are ordered after the work queued on it."""
    if getattr(device, "type", None) == "cuda":
        return int(torch.cuda.current_stream(device).cuda_stream)
    return 0


class BlockMover:
    """Runs copy jobs against one worker's KV planes (see :func:`check_planes`) with torch's
    ops: the ``torch`` transfer path."""

    def __init__(self, planes: list[torch.Tensor]):
        self.plane_block_bytes = check_planes(planes)
        self.planes = planes
        self.device = planes[0].device
        # The word the planes allow; a job narrows it further if a chunk's address needs it.
        self.word = word_dtype([self.plane_block_bytes]
                               + [v for p in planes for v in (p.stride(0), p.data_ptr())])
        self.cuda = self.device.type == "cuda"
        self.stream: Any = torch.cuda.Stream(self.device) if self.cuda else None
        # Staged copies go back to the worker's buffers on a stream of their own, so that
        # neither the forward pass nor the next job's copies wait for them.
        self.read_back_stream: Any = torch.cuda.Stream(self.device) if self.cuda else None
        self._pending: list[tuple[int, Any]] = []
        #: Jobs in `_pending` with staged copies read back: checked before the step reports.
        self._read_back: set[int] = set()

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
        # Every block of the job's chunks, but the first chunk's leading `skip_blocks`, has an
        # engine block: a save with fewer would leave part of a chunk unwritten (ops that take
        # an output resize it rather than fail), and that chunk would be stored as KV.
        if len(job.block_ids) != sum(job.chunk_blocks) - job.skip_blocks:
            raise ValueError(f"kvpool: {len(job.block_ids)} engine blocks for chunks of "
                             f"{sum(job.chunk_blocks)} blocks less {job.skip_blocks} held")
        if job.skip_blocks and not job.is_load:
            raise ValueError("kvpool: a save starts at a chunk's first block")
        if job.check_copy_ptrs and len(job.check_copy_ptrs) != len(job.chunk_ptrs):
            raise ValueError(f"kvpool: {len(job.check_copy_ptrs)} staged copies for a "
                             f"{'load' if job.is_load else 'save'} of {len(job.chunk_ptrs)} chunks")
        checks = list(job.check_copy_ptrs) or [0] * len(job.chunk_ptrs)
        ids = torch.tensor(job.block_ids, dtype=torch.long)
        word = word_dtype([self.word.itemsize, *job.chunk_ptrs, *checks])
        words = self.plane_block_bytes // word.itemsize
        engine = [p.view(word) for p in self.planes]
        if self.cuda:
            # The side stream starts after everything the compute stream queued (this step's
            # forward pass for a save; block zeroing for a load).
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

        def chunk_view(address: int, bpc: int) -> torch.Tensor:
            return host_tensor(address, bpc * job.block_bytes).view(word).view(planes, bpc, words)

        read_back = False
        with self._stream_ctx():
            ids = ids.to(self.device, non_blocking=True)
            first = 0
            for c, (ptr, bpc) in enumerate(zip(job.chunk_ptrs, job.chunk_blocks)):
                host = chunk_view(ptr, bpc)
                # The first chunk may start part-way (blocks the engine already holds).
                skip = job.skip_blocks if c == 0 else 0
                chunk_ids = ids[first:first + bpc - skip]
                first += bpc - skip
                if job.is_load:
                    check = chunk_view(checks[c], bpc) if checks[c] else None
                    staged = self._load_chunk(engine, host, skip, chunk_ids, check)
                    if check is not None and self.cuda:
                        self._read_back_chunk(check, staged)
                        read_back = True
                else:
                    staged_copy = chunk_view(checks[c], bpc) if checks[c] else None
                    self._save_chunk(engine, host, chunk_ids, staged_copy)
            if self.cuda:
                event = torch.cuda.Event()
                event.record(self.stream)
                if job.is_load:
                    # The engine reads loaded blocks only after the copy (a device-side wait).
                    torch.cuda.current_stream(self.device).wait_event(event)
                if read_back:
                    # The job is done once its copies and its read-backs are.
                    self.read_back_stream.wait_event(event)
                    event = torch.cuda.Event()
                    event.record(self.read_back_stream)
                    if not job.asynchronous:
                        # The step's forward pass reads its blocks: checked before the step
                        # reports. (An asynchronous load's request waits for its verdict.)
                        self._read_back.add(job.id)
                self._pending.append((job.id, event))

    def _read_back_chunk(self, check: torch.Tensor, staged: torch.Tensor) -> None:
        # CUDA: once the planes were filled from the device copy (an event on the side
        # stream), the read-back stream copies it into the worker's buffer. The caching
        # allocator must not hand the device copy out again before that copy ran.
        scattered = torch.cuda.Event()
        scattered.record(self.stream)
        self.read_back_stream.wait_event(scattered)
        with torch.cuda.stream(self.read_back_stream):
            check.copy_(staged, non_blocking=True)
        staged.record_stream(self.read_back_stream)

    def _load_chunk(self, engine: list[torch.Tensor], host: torch.Tensor, skip: int,
                    ids: torch.Tensor, check: torch.Tensor | None) -> torch.Tensor:
        # The whole chunk in one host-to-device copy (on CPU ``to`` is a no-op: the chunk
        # itself), then one scatter per plane. A chunk to check is read once: on CPU into the
        # worker's buffer, the planes filled from it; on CUDA the device copy is read back
        # into the buffer afterwards (``run``). Returns the copy the planes were filled from.
        if check is not None and not self.cuda:
            staged = check.copy_(host)
        else:
            staged = host.to(self.device, non_blocking=True)
        for p, plane in enumerate(engine):
            plane.index_copy_(0, ids, staged[p, skip:])
        return staged

    def _save_chunk(self, engine: list[torch.Tensor], host: torch.Tensor,
                    ids: torch.Tensor, staged_copy: torch.Tensor | None = None) -> None:
        # One gather per plane straight into the chunk's layout: on CPU into the chunk itself;
        # on CUDA into a device buffer shaped like it (torch's caching allocator hands the same
        # memory to the next chunk, in stream order), then one device-to-host copy. A chunk
        # whose place other processes can write (node memory) is gathered once and also left
        # in the worker's buffer, which the worker hashes: on CPU gathered into that buffer
        # and copied into the place; on CUDA copied from the device buffer into both.
        if self.cuda:
            staged = torch.empty_like(host, device=self.device)
        else:
            staged = host if staged_copy is None else staged_copy
        for p, plane in enumerate(engine):
            torch.index_select(plane, 0, ids, out=staged[p])
        if self.cuda:
            host.copy_(staged, non_blocking=True)
            if staged_copy is not None:
                staged_copy.copy_(staged, non_blocking=True)
        elif staged_copy is not None:
            host.copy_(staged_copy)

    def poll(self) -> list[int]:
        """Ids of jobs whose copies ended since the last call (on CPU: every job run)."""
        done = [job for job, event in self._pending if event.query()]
        self._end(done)
        return done

    def wait_for_read_backs(self) -> list[int]:
        """Waits on the host for every synchronous load whose staged copies are being read
        back (CUDA; started before the forward pass, so the wait is for those copies, not for
        the forward pass) and returns their ids, ended. The engine side reports them done before the step's
        results leave the worker: the worker must check a staged copy before it reports the
        step's failed blocks, as vLLM uses the blocks in that step (on CPU: none pending)."""
        done = [job for job, _ in self._pending if job in self._read_back]
        for job, event in self._pending:
            if job in self._read_back:
                event.synchronize()
        self._end(done)
        return done

    def _end(self, jobs: list[int]) -> None:
        ended = set(jobs)
        self._pending = [(j, e) for j, e in self._pending if j not in ended]
        self._read_back -= ended

    def wait_for_queued_copies(self) -> None:
        """Waits on the host for every copy queued on this mover's streams (CUDA): before a
        job that failed part-way is reported, so that no copy still queued writes into
        memory the worker frees and hands out again."""
        if self.cuda:
            self.stream.synchronize()
            self.read_back_stream.synchronize()

    def wait(self, job_ids: list[int]) -> None:
        """Makes the compute stream wait for these jobs (before vLLM reuses their blocks)."""
        wanted = set(job_ids)
        for job, event in self._pending:
            if job in wanted:
                torch.cuda.current_stream(self.device).wait_event(event)


#: ``cudaErrorHostMemoryAlreadyRegistered``: part of the range is page-locked already.
_ALREADY_REGISTERED = 712


class HostMemoryPin:
    """kvpool's host memory (L1's arena), page-locked for CUDA DMA (``cudaHostRegister``) for
    as long as the memory lives.

    A registration must end before its memory is freed: CUDA keeps the old pages locked under
    the address range, and once the allocator hands that range out again (the next worker in
    the same process), copies through it could move the old pages, not the new ones: wrong KV
    with no error. (A first version never unregistered; on an H100 the next worker's
    registration then failed with ``cudaErrorHostMemoryAlreadyRegistered``.) So the memory is
    unregistered by :meth:`release` (a worker's shutdown) or, if the worker is freed first, by
    a callback that the owner of the memory runs before freeing it: ``before_free`` registers
    that callback (the native worker's ``call_before_free``; a weak-reference finalizer would
    run too late, after pyo3 has dropped the worker). Both first wait for ``device``, so no
    copy is in flight when the pages unlock.

    Without CUDA (or for an empty range) nothing is registered and ``pinned`` is false.
    """

    def __init__(self, ptr: int, nbytes: int, before_free: Any = None, device: Any = None):
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device
        self.pinned = False
        if not torch.cuda.is_available() or nbytes == 0:
            return
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
        if err != 0:
            _consume_cuda_error()
            if err == _ALREADY_REGISTERED:
                raise RuntimeError(
                    f"kvpool: its host memory ({nbytes} bytes at {ptr:#x}) overlaps memory "
                    "page-locked earlier in this process and never unregistered (memory freed "
                    "while registered); CUDA copies through it could move stale pages, so "
                    "kvpool refuses to run on it")
            return
        self.pinned = True
        if before_free is not None:
            # The owner holds this bound method, not the other way round: no reference cycle.
            before_free(self.release)

    def release(self) -> None:
        """Waits for the device, then unregisters the memory (idempotent). Call before the
        memory is freed."""
        if not self.pinned:
            return
        self.pinned = False
        # Copies to or from the pages may still be queued: they end before the pages unlock.
        torch.cuda.synchronize(self.device)
        if int(torch.cuda.cudart().cudaHostUnregister(self.ptr)) != 0:
            _consume_cuda_error()


class MappingPin:
    """A mapping of the node's pool daemon's shared memory (``_native.NodeMemoryRegion``),
    page-locked for CUDA DMA while this object holds the region, which keeps it mapped:
    :meth:`release` (or this object's collection) unregisters first, and only then lets the
    region go, so no registration outlives its mapping (see :class:`HostMemoryPin`).
    Registering a large arena takes a while, so it runs on a thread of its own (torch's
    binding releases the GIL); until it is done the copies read pageable memory, which CUDA
    stages itself: slower, as correct."""

    def __init__(self, region: Any, device: Any = None):
        self.region = region
        self.device = device
        self.pin: HostMemoryPin | None = None
        self._thread = threading.Thread(target=self._register, name="kvpool-pin-node-memory",
                                        daemon=True)
        self._thread.start()

    def _register(self) -> None:
        try:
            if self.device is not None and getattr(self.device, "type", None) == "cuda":
                torch.cuda.set_device(self.device)
            self.pin = HostMemoryPin(self.region.address, self.region.length,
                                     device=self.device)
        except Exception:  # noqa: BLE001 - copies still run, through pageable memory
            logger.exception("kvpool: could not page-lock the pool daemon's shared memory "
                             "(%d bytes); copies from it go through pageable memory (slower)",
                             self.region.length)
            return
        if not self.pin.pinned:
            logger.warning("kvpool: the pool daemon's shared memory (%d bytes) is not "
                           "page-locked; copies from it go through pageable memory (slower)",
                           self.region.length)

    def wait_registered(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for the registration running behind."""
        self._thread.join(timeout)

    @property
    def pinned(self) -> bool:
        """Whether the registration is done and succeeded."""
        return not self._thread.is_alive() and self.pin is not None and self.pin.pinned

    def release(self) -> None:
        """Waits for the registration, then for the device, unregisters and lets the region go
        (idempotent)."""
        if self.region is None:
            return
        # The registration thread may drop the last reference itself (it holds this object
        # while it runs): it is done registering by then.
        if self._thread is not threading.current_thread():
            self._thread.join()
        if self.pin is not None:
            self.pin.release()
        self.region = None

    def __del__(self) -> None:
        self.release()


class NodeMemoryPins:
    """Keeps the node's pool daemon's shared memory, as this process maps it, page-locked for
    CUDA DMA: a load then copies a chunk from the daemon's memory to the device with one DMA.
    :meth:`refresh` (before each step's loads) pins a mapping that appeared (the worker reached
    the daemon, or a restarted one) and releases one the worker dropped."""

    def __init__(self, native: Any, device: Any = None):
        self.native = native
        self.device = device
        self.pins: dict[tuple[int, int], MappingPin] = {}

    def refresh(self) -> None:
        regions = {(r.address, r.length): r for r in self.native.node_memory_regions()}
        for key in [k for k in self.pins if k not in regions]:
            self.pins.pop(key).release()
        for key, region in regions.items():
            if key not in self.pins:
                self.pins[key] = MappingPin(region, self.device)

    def pinned(self) -> list[bool]:
        """Whether each mapping held is page-locked yet."""
        return [p.pinned for p in self.pins.values()]

    def wait_registered(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for each registration running behind."""
        for pin in self.pins.values():
            pin.wait_registered(timeout)

    def release(self) -> None:
        for pin in self.pins.values():
            pin.release()
        self.pins.clear()


def _consume_cuda_error() -> None:
    """A failed CUDA runtime call leaves its error as the thread's last error, and torch's next
    kernel launch raises it (``cudaGetLastError`` is not bound in torch): one small launch here
    reads and clears it, so a refused registration does not fail an unrelated op later. (An
    error already pending from something else is cleared with it.)"""
    try:
        torch.empty(1, device="cuda").fill_(0)
    except RuntimeError:
        pass


def pin_host_memory(ptr: int, nbytes: int, before_free: Any = None,
                    device: Any = None) -> HostMemoryPin:
    """Page-locks kvpool's host memory for CUDA DMA until it is released or its owner frees it;
    see :class:`HostMemoryPin`. Its ``pinned`` says whether it is page-locked (false without
    CUDA)."""
    return HostMemoryPin(ptr, nbytes, before_free, device)
