"""kvpool's GPU check: the connector's GPU path with torch alone (no vLLM), on a CUDA device.

Shipped by ``cargo xtask gpu-bundle`` with a wheel (memory tier only) and ``run.sh``. It drives
kvpool's Rust scheduler and worker (the same halves the vLLM connector drives, joined by the
lookup socket) over KV caches shaped as vLLM 0.32 hands them to a connector on CUDA
(FlashAttention's ``LBNHC`` view ``[blocks, kv_heads, block_size, 2 * head_size]``,
FlashInfer's ``LBHNC`` and MLA's ``[blocks, 1, block_size, 576]``), and checks:

1. the layout is recognised and each block becomes one page;
2. kvpool's L1 memory is page-locked (``cudaHostRegister``), and unlocked before it is freed:
   a worker dropped without a shutdown, then a new one in the same process, locks again;
3. a save copies exactly the blocks the compute stream wrote just before it (the side stream
   waits for the compute stream), and a synchronous and an asynchronous load put those bytes
   into other blocks, byte for byte; no copy synchronizes with the device (torch's sync debug
   mode set to raise while the copies are queued);
4. a staged load (the route of a chunk from the node's pool daemon, whose shared memory is
   pageable here): the chunk goes to the device once, the blocks are filled from that copy,
   and it is read back into a page-locked buffer of the worker's by the time the job's event
   has passed; both the blocks and the buffer hold the chunk, byte for byte;
5. through the node's pool daemon (``kvpool serve``, the ``kvpool`` binary next to this script
   or ``KVPOOL_BIN``): engine A's chunks, saved the GPU worker's way (gathered on the device,
   copied into places the daemon lends and into A's buffers, sealed from A's buffers), are
   loaded by engine B the
   way a GPU worker loads them: pinned where they lie in the daemon's shared memory, one copy
   to the device (one DMA once B's mapping of that memory is page-locked: a load before that
   registration is done, and one after), the blocks filled from it, read back into B's buffer
   and checked; B's blocks equal A's, byte for byte; and a byte flipped in the daemon's memory
   before a third load is reported as failed blocks when vLLM would ask, in that step;
6. a hybrid model's groups (``hybrid_groups``): a full-attention and a sliding-window group,
   one kvpool part each over one pool, the window's loads starting past vLLM's null blocks;
   both groups' blocks byte for byte, the null block never written;
7. a hit's load from the daemon against an L1 hit's of the same bytes (``daemon_vs_l1``,
   timed, whole steps as the connector runs them, on the default transfer path);
8. throughput: saves and loads of 512 MiB of KV (64 MiB on CPU) against torch's own copy of the
   same bytes between contiguous device memory and page-locked host memory (medians of 5; a
   ratio of 1 means kvpool moves KV as fast as a plain DMA of one contiguous buffer), at
   256- and 1,024-token chunks, each transfer path in turn within each round.

Checks 1-6 run once per transfer path (``KVPOOL_CHECK_TRANSFERS``, default ``torch,native``):
``torch`` is ``kvpool.transfer.BlockMover``; ``native`` is kvpool-cuda's executor
(``kvpool._native.CopyEngine``: memcpy on CPU, batched CUDA copies on kvpool's stream on a
GPU, page-locking by guards the memory owns), driven as the connector drives it
(``Worker.run_copies``); its results are under ``<check>_native`` keys.

Prints a JSON report (also written to ``$OUT/gpu-check.json`` when ``OUT`` is set); exits 1 if
a check fails; without a CUDA device it says it skipped and exits 0. ``KVPOOL_CHECK_DEVICE=cpu`` runs the same checks on CPU tensors (the script's
own test, where no GPU is; page-locking is then not checked). ``KVPOOL_CHECK_THROUGHPUT_MIB``
sets the throughput check's size (under ``compute-sanitizer``, say), ``KVPOOL_CHECK_CHUNK_TOKENS``
kvpool's chunk size (default 256, kvpool's default).
"""

import contextlib
import ctypes
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from kvpool import _native
from kvpool.transfer import (BlockMover, CopyJob, NodeMemoryPins, compute_stream,
                             native_copy_engine, pin_host_memory)
from kvpool.vllm.layouts import detect

BLOCK = 16
CHUNK = int(os.environ.get("KVPOOL_CHECK_CHUNK_TOKENS", 256))
DEVICE = os.environ.get("KVPOOL_CHECK_DEVICE", "cuda")
# On a GPU the native path also runs with each way of moving pages forced (kvpool's copy
# kernel, batched DMA); on CPU it has one (memcpy).
TRANSFERS = os.environ.get(
    "KVPOOL_CHECK_TRANSFERS",
    "torch,native,native-dma,native-kernel" if DEVICE == "cuda" else "torch,native").split(",")


def suffix(transfer):
    """The report key suffix of a transfer path's results (none for torch, as before)."""
    return "" if transfer == "torch" else "_" + transfer.replace("-", "_")


def native_mode(transfer):
    """The native copy engine's mode for ``transfer`` (``native``, ``native-dma``, ...)."""
    return transfer.split("-", 1)[1] if "-" in transfer else "auto"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def fa_caches(layers, blocks, heads, head, dtype, device):
    """FlashAttention's view: logical [B, H, N, 2D] over physical [B, N, H, 2D] (LBNHC)."""
    out = {}
    for i in range(layers):
        phys = torch.randn(blocks, BLOCK, heads, 2 * head, device=device).to(dtype)
        out[f"model.layers.{i}.self_attn.attn"] = phys.permute(0, 2, 1, 3)
    return out


def flashinfer_hnd_caches(layers, blocks, heads, head, dtype, device):
    """FlashInfer's HND order on Blackwell (LBHNC): the logical view is the physical one."""
    return {f"model.layers.{i}.self_attn.attn":
            torch.randn(blocks, heads, BLOCK, 2 * head, device=device).to(dtype)
            for i in range(layers)}


def mla_caches(layers, blocks, device):
    return {f"model.layers.{i}.self_attn.attn":
            torch.randn(blocks, 1, BLOCK, 576, device=device).to(torch.bfloat16)
            for i in range(layers)}


class Engine:
    """A scheduler and a worker of kvpool around one set of KV caches."""

    def __init__(self, caches, tmp, use_mla=False, load_timing="auto", l1="2GiB", pool=None,
                 transfer="torch", chunk=None, share_pool_with=None, parts=1, null_block=None,
                 group_format=""):
        """``share_pool_with``, ``parts``, ``null_block`` and ``group_format``: one KV cache
        group of a hybrid model, as ``kvpool.vllm.hybrid`` builds it (the engine whose pool
        this one shares, the number of groups, vLLM's null block, the group's key suffix)."""
        self.caches = caches
        layout = detect(caches, BLOCK, use_mla=use_mla, backend="FLASH_ATTN" if not use_mla
                        else "FLASHMLA", layout_name="LBNHC")
        if group_format:
            layout.kv_format += "|" + group_format
        owns_pool = share_pool_with is None
        self.layout = layout
        self.transfer = transfer
        self.cuda = DEVICE == "cuda"
        self.mover = BlockMover(layout.planes) if transfer == "torch" else None
        self.copies = native_copy_engine(layout.planes, native_mode(transfer)) \
            if transfer.startswith("native") else None
        self.device = layout.planes[0].device
        sock = os.path.join(tmp, f"w{id(self)}.sock")
        self.sock = sock
        config = (f'[local_cpu]\nmax_size = "{l1}"\n[chunking]\nchunk_size = '
                  f'{chunk or CHUNK}\n')
        config_format = "toml"
        if pool is not None:
            config, config_format = _native.config_with_pool(config, "toml", pool), "json"
        self.worker = _native.Worker(
            config_text=config,
            config_format=config_format, model="gpu-check", weights="w", tp_size=1, tp_rank=0,
            pp_rank=0, block_size=BLOCK, num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads, head_size=layout.head_size,
            dtype=str(layout.dtype), kv_format=layout.kv_format, kind=layout.kind,
            socket_path=sock,
            share_pool_with=None if owns_pool else share_pool_with.worker, parts=parts,
            null_block=null_block)
        if not owns_pool:
            # The pool's memory was page-locked by the engine that built it (as in vLLM).
            self.pin = None
            self.pinned = share_pool_with.pinned
        elif self.copies is not None:
            # Page-locked by a guard L1's arena owns (GPU); nothing to release from here.
            self.pin = None
            self.pinned = self.worker.pin_host_memory(self.copies)
        else:
            self.pin = pin_host_memory(*self.worker.host_memory(),
                                       before_free=self.worker.call_before_free)
            self.pinned = self.pin.pinned
        self.sched = _native.Scheduler(socket_paths=[sock], block_size=BLOCK,
                                       load_timing=load_timing)
        # With the daemon: a GPU worker's route for its chunks (what the vLLM connector sets).
        self.node_pins = None
        if pool is not None:
            self.worker.check_staged_copies()
            if self.cuda and self.mover is not None:
                self.node_pins = NodeMemoryPins(self.worker, self.device)

    def shutdown(self):
        if self.node_pins is not None:
            self.node_pins.release()
        if self.pin is not None:
            self.pin.release()
        self.worker.shutdown()

    def refresh_node_pins(self):
        """Before a step's loads: page-locks the daemon's memory as mapped now (GPU)."""
        if self.node_pins is not None:
            self.node_pins.refresh()
        elif self.copies is not None and self.cuda:
            self.worker.pin_node_memory(self.copies)

    def wait_node_memory_pinned(self, timeout):
        if self.node_pins is not None:
            self.node_pins.wait_registered(timeout)
            return self.node_pins.pinned()
        return self.copies.wait_node_memory_pinned(timeout)

    def _no_sync(self):
        # On CUDA, any torch operation that synchronizes with the device raises meanwhile: the
        # step path must queue its copies and return. (The native path makes no torch call;
        # its driver calls are checked in kvpool-cuda's tests with a recording driver.)
        class NoSync:
            def __enter__(_):
                if DEVICE == "cuda":
                    torch.cuda.set_sync_debug_mode("error")

            def __exit__(_, *exc):
                if DEVICE == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        return NoSync()

    def load(self):
        """The step's loads, as the connector runs them."""
        if self.copies is not None:
            with self._no_sync():
                self.worker.run_copies(self.copies, True, compute_stream(self.device))
        else:
            self.run_jobs(self.worker.load_jobs())

    def save(self):
        """The step's saves, as the connector runs them."""
        if self.copies is not None:
            with self._no_sync():
                self.worker.run_copies(self.copies, False, compute_stream(self.device))
        else:
            self.run_jobs(self.worker.save_jobs())

    def run_jobs(self, jobs):
        """Runs jobs one by one (the torch path; the native path's own entry for a job the
        check changes first)."""
        with self._no_sync():
            for job in jobs:
                if self.copies is not None:
                    if self.copies.run(job, compute_stream(self.device)):
                        self.worker.copy_done(job.id, True)
                else:
                    self.mover.run(job)
        if self.mover is not None and not self.mover.cuda:
            for job in jobs:
                self.worker.copy_done(job.id, True)

    def poll(self):
        if self.copies is not None:
            self.worker.poll_copies(self.copies)
        else:
            for job in self.mover.poll():
                self.worker.copy_done(job, True)

    def drain(self, timeout=30.0):
        """Polls events until every job handed out ended."""
        deadline = time.monotonic() + timeout
        while self.worker.in_flight()[0] and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.0005)

    def settle_read_backs(self):
        """What the connector's worker side does before the step's results leave it: loads
        whose staged copies are being read back are waited for and reported done."""
        if self.copies is not None:
            self.worker.settle_copies(self.copies)
            return
        for job in self.mover.wait_for_read_backs():
            self.worker.copy_done(job, True)

    def load_step(self, req, prompt, blocks, change_chunk=None, phases=None):
        """A step that loads ``prompt``'s hit into ``blocks`` for request ``req``, in vLLM's
        order: the failed blocks are read as vLLM reads them, once the forward pass would be
        launched, with nothing else waited for. ``change_chunk``: a chunk whose first byte
        of KV another process flips in the daemon's memory before the copy. Returns the hit,
        the failed blocks as vLLM reads them, and those reported only after everything ended
        (a verdict too late for the step: none may be). ``phases``: a dict whose lists get
        each phase's host time in seconds (no synchronisation added)."""
        clock = [time.perf_counter()]

        def lap(name):
            now = time.perf_counter()
            if phases is not None:
                phases.setdefault(name, []).append(now - clock[0])
            clock[0] = now

        n = len(prompt)
        hit = self.sched.get_num_new_matched_tokens(req, prompt, b"", 0)
        self.sched.update_state_after_alloc(req, blocks, hit[0])
        lap("lookup")
        self.worker.bind(self.sched.build_connector_meta([(req, n, [], 2, blocks, n)], []))
        lap("bind")
        self.refresh_node_pins()
        lap("pin_node_memory")
        if change_chunk is not None:
            jobs = self.worker.load_jobs()
            ptr = jobs[0].chunk_ptrs[change_chunk]
            ctypes.c_uint8.from_address(ptr).value ^= 0x40
            self.run_jobs(jobs)
        else:
            self.load()
        lap("queue_copies")
        self.settle_read_backs()
        failed = self.worker.failed_blocks()
        lap("settle_checks")
        self.save()
        self.drain()
        self.worker.transfer_results([])
        late = self.worker.failed_blocks()
        self.worker.step_report()
        self.worker.clear()
        lap("finish")
        return hit, failed, late

    def step(self, scheduled, before_save=None):
        meta = self.sched.build_connector_meta(scheduled, [])
        self.worker.bind(meta)
        self.refresh_node_pins()
        self.load()
        if before_save:
            before_save()
        self.save()
        self.drain()
        sending, recving = self.worker.transfer_results([])
        self.worker.failed_blocks()
        self.worker.step_report()
        self.worker.clear()
        return recving


def blocks_equal(caches, a, b):
    return all(torch.equal(t[a], t[b]) for t in caches.values())


def correctness(report, caches, tmp, use_mla=False, transfer="torch"):
    e = Engine(caches, tmp, use_mla=use_mla, transfer=transfer)
    report["pinned"] = e.pinned
    n = 4 * 256 + 1  # 1,024 tokens to hit whatever the chunk size (256 or 1,024), then one more
    prompt = list(range(100, 100 + n))
    nblocks = (n + BLOCK - 1) // BLOCK
    # A saves from blocks in order; B loads into blocks in descending order (as vLLM's free
    # list hands out a finished request's blocks), C into shuffled ones: each page then its
    # own copy (the native path's copy kernel in its default mode, on a GPU).
    a_blocks = list(range(0, nblocks))
    b_blocks = list(range(2 * nblocks - 1, nblocks - 1, -1))
    c_blocks = list(range(2 * nblocks, 3 * nblocks))
    import random
    random.Random(3).shuffle(c_blocks)
    assert e.sched.get_num_new_matched_tokens("a", prompt, b"", 0) == (0, False)
    e.sched.update_state_after_alloc("a", a_blocks, 0)
    fresh = {k: torch.randn_like(v, dtype=torch.float32).to(v.dtype) for k, v in caches.items()}

    def write_on_compute_stream():
        # The forward pass's writes, queued on the compute stream right before the save.
        for k, t in caches.items():
            t[a_blocks[0]:a_blocks[-1] + 1].copy_(fresh[k][a_blocks[0]:a_blocks[-1] + 1])

    e.step([("a", n, [], 2, a_blocks, n)], before_save=write_on_compute_stream)
    sync()
    got = e.sched.get_num_new_matched_tokens("b", prompt, b"", 0)
    report["sync_hit"] = list(got)
    e.sched.update_state_after_alloc("b", b_blocks, got[0])
    e.step([("b", n, [], 2, b_blocks, n)])
    sync()
    loaded = got[0] // BLOCK
    report["sync_load_exact"] = loaded > 0 and all(
        blocks_equal(caches, a_blocks[i], b_blocks[i]) for i in range(loaded))
    # The same chunks loaded asynchronously (a second scheduler that makes every load so).
    asy = _native.Scheduler(socket_paths=[e.sock], block_size=BLOCK, load_timing="always")
    got = asy.get_num_new_matched_tokens("c", prompt, b"", 0)
    report["async_hit"] = list(got)
    asy.update_state_after_alloc("c", c_blocks, got[0])
    meta = asy.build_connector_meta([], [])
    e.worker.bind(meta)
    done = []
    deadline = time.monotonic() + 30
    while not done and time.monotonic() < deadline:
        e.load()
        e.poll()
        done = e.worker.transfer_results([])[1]
        time.sleep(0.001)
    e.worker.clear()
    sync()
    report["async_finished"] = done
    report["async_load_exact"] = bool(done) and all(
        blocks_equal(caches, a_blocks[i], c_blocks[i]) for i in range(got[0] // BLOCK))
    report["in_flight_after"] = list(e.worker.in_flight())
    if e.copies is not None:
        report["kernel_jobs"] = list(e.copies.kernel_jobs)
    e.shutdown()


def hybrid_groups(report, tmp, transfer="torch"):
    """A hybrid model's two KV cache groups (full attention and a sliding window), one kvpool
    part each over one shared pool, as ``kvpool.vllm.hybrid`` runs them: vLLM's hybrid
    allocator lays a layer of each group over the same memory and hands both groups block ids
    from one pool, block 0 being its null block. A request saves both groups; another loads
    them asynchronously (as hybrid loads always are), the sliding-window group into a block
    list that starts with null blocks (outside its window): the full group's blocks hold the
    saved bytes, the window's blocks too, and the null block is never written."""
    layers, nblocks_all = 2, 512
    phys = [torch.randn(nblocks_all, BLOCK, 8, 2 * 128, device=DEVICE).to(torch.bfloat16)
            for _ in range(layers)]
    full = {f"model.layers.{2 * i}.self_attn.attn": t.permute(0, 2, 1, 3)
            for i, t in enumerate(phys)}
    window = {f"model.layers.{2 * i + 1}.self_attn.attn": t.permute(0, 2, 1, 3)
              for i, t in enumerate(phys)}
    null = 0
    owner = Engine(full, tmp, transfer=transfer, load_timing="always", parts=2,
                   null_block=null, group_format="group=0/2:full")
    part = Engine(window, tmp, transfer=transfer, load_timing="always", share_pool_with=owner,
                  parts=2, null_block=null,
                  group_format="group=1/2:sliding(window=128,retained=9)")
    report["pinned"] = owner.pinned and part.pinned
    n = 4 * 256 + 1
    prompt = list(range(300, 300 + n))
    nb = (n + BLOCK - 1) // BLOCK
    # Request a: each group its own blocks from the shared pool (none of them the null block).
    a_full = list(range(1, 1 + nb))
    a_window = list(range(1 + nb, 1 + 2 * nb))
    for e, blocks in ((owner, a_full), (part, a_window)):
        assert e.sched.get_num_new_matched_tokens("a", prompt, b"", 0) == (0, False)
        e.sched.update_state_after_alloc("a", blocks, 0)
        e.step([("a", n, [], 2, blocks, n)])
    sync()
    hits = [e.sched.get_num_new_matched_tokens("b", prompt, b"", 0) for e in (owner, part)]
    report["hits"] = [list(h) for h in hits]
    hit = min(h[0] for h in hits)
    # Request b: the window's first blocks are outside it (null); its last nine are real.
    leading_null = hit // BLOCK - 8
    b_full = list(range(2 * nb + 1, 3 * nb + 1))[::-1]
    b_window = [null] * leading_null + list(range(3 * nb + 1, 4 * nb + 1 - leading_null))
    null_before = {k: t[null].clone() for k, t in window.items()}
    done = {}
    for e, blocks in ((owner, b_full), (part, b_window)):
        e.sched.update_state_after_alloc("b", blocks, hit)
        e.worker.bind(e.sched.build_connector_meta([], []))
    deadline = time.monotonic() + 30
    while len(done) < 2 and time.monotonic() < deadline:
        for i, e in enumerate((owner, part)):
            if i in done:
                continue
            e.load()
            e.poll()
            if "b" in e.worker.transfer_results([])[1]:
                done[i] = True
        time.sleep(0.001)
    for e in (owner, part):
        e.worker.clear()
    sync()
    loaded = hit // BLOCK
    report["hit"] = hit
    report["both_finished"] = len(done) == 2
    report["full_group_exact"] = loaded > 0 and all(
        blocks_equal(full, a_full[i], b_full[i]) for i in range(loaded))
    report["window_exact"] = leading_null < loaded and all(
        blocks_equal(window, a_window[i], b_window[i]) for i in range(leading_null, loaded))
    report["null_block_untouched"] = all(torch.equal(window[k][null], v)
                                         for k, v in null_before.items())
    report["in_flight_after"] = [a + b for a, b in zip(owner.worker.in_flight(),
                                                        part.worker.in_flight())]
    part.shutdown()
    owner.shutdown()


def staged_load(report, transfer="torch"):
    """A load job whose chunks come with buffers to stage them in (``check_copy_ptrs``), run
    by the transfer path alone: the source is pageable memory (as the daemon's shared memory
    is, unregistered), the buffers page-locked (as L1's are)."""
    caches = fa_caches(2, CHUNK // BLOCK + 8, 8, 128, torch.bfloat16, DEVICE)
    layout = detect(caches, BLOCK, backend="FLASH_ATTN", layout_name="LBNHC")
    if transfer == "torch":
        mover = BlockMover(layout.planes)
    else:
        copies = native_copy_engine(layout.planes, native_mode(transfer))
    plane_bytes = int(layout.planes[0].shape[1])
    per_block = len(layout.planes) * plane_bytes
    chunk_blocks = [CHUNK // BLOCK, 1]
    source = torch.randint(0, 256, (sum(chunk_blocks) * per_block,), dtype=torch.uint8)
    pinned = DEVICE == "cuda"
    buffers = [torch.zeros(n * per_block, dtype=torch.uint8, pin_memory=pinned)
               for n in chunk_blocks]
    blocks = list(range(3, 3 + sum(chunk_blocks)))
    ptrs = [source.data_ptr(), source.data_ptr() + chunk_blocks[0] * per_block]
    job = CopyJob(id=1, is_load=True, req_id="staged", block_ids=blocks, skip_blocks=0,
                  chunk_blocks=chunk_blocks, block_bytes=per_block, chunk_ptrs=ptrs,
                  check_copy_ptrs=[b.data_ptr() for b in buffers])
    if transfer == "torch":
        mover.run(job)
        poll = mover.poll
    else:
        copies.run(job, compute_stream(layout.planes[0].device))

        def poll():
            return [j for j, ok in copies.poll() if ok]
    cuda = DEVICE == "cuda"
    deadline = time.monotonic() + 30
    done = poll()
    while cuda and not done and time.monotonic() < deadline:
        time.sleep(0.0005)
        done = poll()
    # On CPU the job is done when `run` returns, and nothing is pending.
    report["job_done"] = done == ([1] if cuda else [])
    # What poll reported done is in the buffers, with nothing more synchronized.
    report["buffers_hold_the_chunks"] = all(
        torch.equal(b, source[p - ptrs[0]:p - ptrs[0] + b.numel()])
        for b, p in zip(buffers, ptrs))
    sync()
    host = [plane.cpu() for plane in layout.planes]
    whole = source.view(sum(chunk_blocks), per_block)
    exact = True
    first = 0
    for n in chunk_blocks:
        chunk = whole[first:first + n].reshape(len(host), n, plane_bytes)
        for p, plane in enumerate(host):
            exact &= torch.equal(plane[blocks[first:first + n]], chunk[p])
        first += n
    report["blocks_hold_the_chunks"] = bool(exact)


def kvpool_binary():
    """The `kvpool` command: ``KVPOOL_BIN``, else the one the bundle ships next to this script."""
    path = os.environ.get("KVPOOL_BIN") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "kvpool")
    return path if os.path.exists(path) else None


@contextlib.contextmanager
def running_daemon(binary, tmp, name, max_size="1GiB"):
    """``kvpool serve`` with a memory tier of ``max_size`` on a socket in ``tmp``; yields the
    socket's path once it accepts, stops the daemon after."""
    sock = os.path.join(tmp, f"{name}.sock")
    config = os.path.join(tmp, f"{name}.toml")
    with open(config, "w") as f:
        f.write(f'[local_cpu]\nmax_size = "{max_size}"\n')
    log = open(os.path.join(tmp, f"{name}.log"), "w")
    proc = subprocess.Popen([binary, "serve", "--config", config, "--socket", sock],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(sock)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("kvpool serve did not start")
                time.sleep(0.05)
        yield sock
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def daemon_route(report, tmp, transfer="torch"):
    """Engine A saves a prompt into places the daemon lends, the GPU worker's way; engine B,
    a fresh worker attached to the same daemon, loads it the GPU worker's way (see the module
    docs, check 5) into other blocks of the same caches."""
    binary = kvpool_binary()
    if binary is None:
        report["skipped"] = "no kvpool binary (KVPOOL_BIN, or `kvpool` next to this script)"
        return
    with running_daemon(binary, tmp, "daemon") as sock:
        caches = fa_caches(2, 4 * 65 + 4, 8, 128, torch.bfloat16, DEVICE)  # four loads' blocks
        pool = f"unix://{sock}"
        n = 4 * 256 + 1
        prompt = list(range(7, 7 + n))
        nblocks = (n + BLOCK - 1) // BLOCK
        a_blocks = list(range(nblocks))
        a = Engine(caches, tmp, pool=pool, transfer=transfer)
        assert a.sched.get_num_new_matched_tokens("a", prompt, b"", 0) == (0, False)
        a.sched.update_state_after_alloc("a", a_blocks, 0)
        a.step([("a", n, [], 2, a_blocks, n)])
        # Saved the GPU worker's way: gathered once, copied into places the daemon lent and
        # into A's buffers, sealed from A's buffers.
        report["saved_into_daemon_memory"] = dict(a.worker.stats()).get(
            "node_memory_saved_tokens", 0)
        a.shutdown()
        b = Engine(caches, tmp, pool=pool, transfer=transfer)
        per_chunk = CHUNK // BLOCK
        # The second chunk, or the only one (KVPOOL_CHECK_CHUNK_TOKENS=1024).
        changed = 1 if (n - 1) // CHUNK > 1 else 0
        loads = {}
        for req, change in (("b", None), ("c", None), ("d", changed)):
            if req == "c" and DEVICE == "cuda":
                # "b" started the registration of B's mapping of the daemon's memory; "c"
                # then copies from it page-locked: one DMA per chunk.
                report["daemon_memory_pinned"] = b.wait_node_memory_pinned(60)
            blocks = list(range((len(loads) + 1) * nblocks, (len(loads) + 2) * nblocks))
            hit, failed, late = b.load_step(req, prompt, blocks, change_chunk=change)
            sync()
            loads[req] = {"hit": list(hit), "failed": sorted(failed), "late": late, "exact": all(
                blocks_equal(caches, a_blocks[i], blocks[i])
                for i in range(hit[0] // BLOCK if change is None else change * per_chunk))}
            if change is not None:
                # Reported in the step whose forward pass used the blocks, not a step later.
                loads[req]["failed_from_the_changed_chunk"] = sorted(failed) == blocks[
                    change * per_chunk:hit[0] // BLOCK]
        report["loads"] = loads
        report["load_exact"] = all(r["exact"] and r["hit"] == [1024, False] and not r["late"]
                                   for r in loads.values())
        report["changed_chunk_failed_in_its_step"] = loads["d"]["failed_from_the_changed_chunk"]
        stats = dict(b.worker.stats())
        report["node_memory_staged_tokens"] = stats.get("node_memory_staged_tokens", 0)
        report["corrupt_chunks"] = stats.get("corrupt_chunks", 0)
        # Buffers from the heap (L1 full) would make the device's read-backs synchronous.
        report["heap_buffers"] = stats.get("heap_buffers", 0)
        report["in_flight_after"] = list(b.worker.in_flight())
        b.shutdown()


def timed_loads(report, caches, engines, prompt, tokens, src, dst, pairs, times, phases):
    """``daemon_vs_l1``'s loads: one warm-up per engine, then ``pairs`` pairs, the order within
    a pair alternating. Before each load its blocks are overwritten (outside the timed span),
    and after it they are compared with the blocks saved, byte for byte."""
    staged, exact = [], {route: [] for route in engines}
    whole = tokens // BLOCK
    for i in range(pairs + 1):
        order = list(engines) if i % 2 == 0 else list(reversed(list(engines)))
        for route in order:
            e = engines[route]
            target = torch.tensor(dst[route], device=DEVICE)
            for t in caches.values():
                t.index_fill_(0, target, -7.0)
            before = dict(e.worker.stats()).get("node_memory_staged_tokens", 0)
            sync()
            t0 = time.perf_counter()
            laps = {} if i else None
            hit, failed, late = e.load_step(f"{route}{i}", prompt, dst[route], phases=laps)
            sync()
            took = time.perf_counter() - t0
            for phase, t in (laps or {}).items():
                phases[route].setdefault(phase, []).extend(t)
            if hit[0] != tokens or failed or late:
                raise AssertionError(f"{route} load {i}: hit {hit}, failed {len(failed)}, "
                                     f"late {late}")
            exact[route].append(all(blocks_equal(caches, src[k], dst[route][k])
                                    for k in range(whole)))
            if route == "daemon":
                staged.append(dict(e.worker.stats()).get("node_memory_staged_tokens", 0)
                              - before)
            if i == 0:
                if route == "daemon" and DEVICE == "cuda":
                    report["daemon_memory_pinned"] = e.wait_node_memory_pinned(60)
                continue
            times[route].append(took)
    for route in engines:
        # Every load's blocks, each overwritten before it: byte for byte.
        report[f"{route}_exact"] = all(exact[route])
    # Every load of the daemon's engine went through the daemon (none from its own L1).
    report["daemon_staged_tokens_per_load"] = staged
    report["every_daemon_load_staged"] = all(s >= tokens for s in staged)
    report["in_flight_after"] = list(engines["daemon"].worker.in_flight())


def daemon_vs_l1(report, tmp, transfer="native"):
    """The time of a hit's load from the node's pool daemon against an L1 hit's of the same
    bytes, in one run: engine A saves a prompt into the daemon and engine L the same prompt
    into its own L1; then B (attached to the daemon, fresh) and L load it in turn, each load a
    whole step as the connector runs it (lookup, copies, checks of staged copies) until the
    blocks are on the device. One warm-up load each (B's first also starts page-locking its
    mapping of the daemon's memory), then ``KVPOOL_CHECK_DAEMON_LOADS`` timed pairs (7) of
    ``KVPOOL_CHECK_DAEMON_TOKENS`` tokens (4,096 on a GPU: 128 MiB; 1,024 on CPU)."""
    binary = kvpool_binary()
    if binary is None:
        report["skipped"] = "no kvpool binary (KVPOOL_BIN, or `kvpool` next to this script)"
        return
    # 8 layers x 8 KV heads x 128, bf16: 32 KiB per token. 128 MiB on a GPU, 32 MiB on CPU.
    tokens = int(os.environ.get("KVPOOL_CHECK_DAEMON_TOKENS", 4096 if DEVICE == "cuda" else 1024))
    pairs = int(os.environ.get("KVPOOL_CHECK_DAEMON_LOADS", 7))
    n = tokens + 1
    prompt = list(range(11, 11 + n))
    nblocks = (n + BLOCK - 1) // BLOCK
    caches = fa_caches(8, 3 * nblocks + 4, 8, 128, torch.bfloat16, DEVICE)
    src = list(range(nblocks))
    dst = {"daemon": list(range(nblocks, 2 * nblocks)),
           "l1": list(range(2 * nblocks, 3 * nblocks))}
    report["bytes"] = tokens * 8 * 8 * 2 * 128 * 2
    with running_daemon(binary, tmp, "timed-daemon", max_size="2GiB") as sock:
        pool = f"unix://{sock}"
        a = Engine(caches, tmp, pool=pool, transfer=transfer)
        local = Engine(caches, tmp, l1="2GiB", transfer=transfer)
        for e, req in ((a, "save-a"), (local, "save-l")):
            assert e.sched.get_num_new_matched_tokens(req, prompt, b"", 0) == (0, False)
            e.sched.update_state_after_alloc(req, src, 0)
            e.step([(req, n, [], 2, src, n)])
        a.shutdown()
        b = Engine(caches, tmp, pool=pool, transfer=transfer)
        times = {"daemon": [], "l1": []}
        phases = {"daemon": {}, "l1": {}}
        try:
            timed_loads(report, caches, {"daemon": b, "l1": local}, prompt, tokens, src, dst,
                        pairs, times, phases)
        finally:
            b.shutdown()
            local.shutdown()
    med = statistics.median
    for route, t in times.items():
        report[f"{route}_load_ms_median"] = med(t) * 1e3
        report[f"{route}_load_ms_range"] = [min(t) * 1e3, max(t) * 1e3]
        # Where each route's load goes (host time per phase; the device copies are waited
        # for in settle_checks on the daemon route, after the step on the L1 route).
        report[f"{route}_phases_ms_median"] = {
            phase: round(med(t) * 1e3, 3) for phase, t in phases[route].items()}
    ratios = [d / l for d, l in zip(times["daemon"], times["l1"])]
    report["daemon_vs_l1_median_of_pairs"] = med(ratios)
    report["daemon_vs_l1_range"] = [min(ratios), max(ratios)]
    report["samples"] = len(ratios)


def time_transfers(e, nblocks, layers, page, rounds_tag, scattered=False):
    """Five saves of the same blocks under five prompts (other keys: nothing is deduplicated),
    then five loads of the first prompt into other blocks, through engine ``e``'s transfer
    path as the connector runs it. ``scattered``: the engine blocks in a shuffled order (no
    two consecutive, as a busy engine's free list hands them out), else in order (the native
    path then merges a chunk's pages into one copy per plane). Returns the bytes one transfer
    moves and the host times (total, and to queue the copies) of each save and load."""
    n = nblocks * BLOCK
    prompt = list(range(7, 7 + n + 1))
    blocks = list(range(2 * nblocks + 2))
    if scattered:
        import random
        random.Random(5).shuffle(blocks)
    src = blocks[:nblocks + 1]
    dst = blocks[nblocks + 1:]
    # Every whole block of the prompt is saved (n of its n + 1 tokens).
    nbytes = nblocks * layers * page
    out = {"save": [], "save_enqueue": [], "load": [], "load_enqueue": []}
    for i in range(5):
        # Other tokens per save and per order: other keys, so nothing is deduplicated.
        tokens = [t + i * 1_000_000 + scattered * 500_000 for t in prompt]
        e.sched.get_num_new_matched_tokens(f"s{rounds_tag}{i}", tokens, b"", 0)
        e.sched.update_state_after_alloc(f"s{rounds_tag}{i}", src, 0)
        meta = e.sched.build_connector_meta([(f"s{rounds_tag}{i}", n + 1, [], 2, src, n + 1)],
                                            [])
        e.worker.bind(meta)
        sync()
        t0 = time.perf_counter()
        e.save()
        out["save_enqueue"].append(time.perf_counter() - t0)
        sync()
        out["save"].append(time.perf_counter() - t0)
        e.drain()
        e.worker.step_report()
        e.worker.clear()
    for i in range(5):
        got = e.sched.get_num_new_matched_tokens(f"l{rounds_tag}{i}", prompt, b"", 0)
        if got[0] != n:
            raise AssertionError(f"the throughput check's load hit {got[0]} of the {n} tokens "
                                 "it saved")
        e.sched.update_state_after_alloc(f"l{rounds_tag}{i}", dst, got[0])
        meta = e.sched.build_connector_meta([(f"l{rounds_tag}{i}", n + 1, [], 2, dst, n + 1)],
                                            [])
        e.worker.bind(meta)
        sync()
        t0 = time.perf_counter()
        e.load()
        out["load_enqueue"].append(time.perf_counter() - t0)
        sync()
        out["load"].append(time.perf_counter() - t0)
        e.drain()
        e.worker.transfer_results([])
        e.worker.step_report()
        e.worker.clear()
    return nbytes, out


def throughput(report, tmp):
    """Saves and loads through each transfer path at 256- and 1,024-token chunks, against
    torch's own DMA of the same bytes (contiguous device memory <-> page-locked host memory),
    all in one run: per round, every (chunk size, path) in turn, then the plain copies. Medians
    over rounds x 5, with the range."""
    # Llama-3-8B-like per layer: 8 KV heads x 128, bf16: 4 KiB per token and layer; 8 layers
    # x 16-token blocks x 2048 blocks... sized so one transfer moves 512 MiB.
    layers, heads, head, dtype = 8, 8, 128, torch.bfloat16
    page = BLOCK * heads * 2 * head * 2
    size = int(os.environ.get("KVPOOL_CHECK_THROUGHPUT_MIB",
                              512 if DEVICE == "cuda" else 64)) << 20
    rounds = int(os.environ.get("KVPOOL_CHECK_ROUNDS", 3 if DEVICE == "cuda" else 1))
    chunks = [int(c) for c in os.environ.get("KVPOOL_CHECK_THROUGHPUT_CHUNKS",
                                             "256,1024").split(",")]
    orders = [False, True]  # engine blocks in order, then shuffled
    nblocks = size // (page * layers)
    total = 2 * nblocks + 8
    caches = fa_caches(layers, total, heads, head, dtype, DEVICE)
    times = {}
    pinned = {}
    batched = {}
    nbytes = nblocks * layers * page
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
    plain = {"d2h": [], "h2d": []}
    for r in range(rounds):
        for chunk in chunks:
            for transfer in TRANSFERS:
                e = Engine(caches, tmp, l1="4GiB", transfer=transfer, chunk=chunk)
                for scattered in orders:
                    name = (transfer, chunk, scattered)
                    pinned[name] = e.pinned
                    moved, out = time_transfers(e, nblocks, layers, page,
                                                f"r{r}{scattered:d}", scattered)
                    assert moved == nbytes
                    if e.copies is not None:
                        # Still one batch per phase after the run (a refused batch falls
                        # back), and (jobs through the copy kernel, jobs).
                        batched[name] = [e.copies.batched, list(e.copies.kernel_jobs)]
                    slot = times.setdefault(name, {k: [] for k in out})
                    for k, v in out.items():
                        slot[k].extend(v)
                e.shutdown()
                del e
                gc.collect()
        # Baseline: torch's own DMA of the same bytes, contiguous device <-> pinned host.
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            host.copy_(dev, non_blocking=True)
            sync()
            plain["d2h"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            sync()
            plain["h2d"].append(time.perf_counter() - t0)
    gbps = lambda s: nbytes / s / 1e9  # noqa: E731
    med = statistics.median
    d2h, h2d = med(plain["d2h"]), med(plain["h2d"])
    paths = {}
    for (transfer, chunk, scattered), t in times.items():
        name = (transfer, chunk, scattered)
        paths[f"{transfer}_{chunk}" + ("_scattered" if scattered else "")] = {
            "transfer": transfer, "chunk_tokens": chunk, "scattered_blocks": scattered,
            "pinned": pinned[name], "batched": batched.get(name),
            "save_GBps_median": gbps(med(t["save"])),
            "save_GBps_range": [gbps(max(t["save"])), gbps(min(t["save"]))],
            "load_GBps_median": gbps(med(t["load"])),
            "load_GBps_range": [gbps(max(t["load"])), gbps(min(t["load"]))],
            "save_vs_torch": d2h / med(t["save"]),
            "load_vs_torch": h2d / med(t["load"]),
            # What the step pays: the host time to queue a save's or load's copies (on CUDA
            # the copies then run on a side stream; on CPU queueing is copying).
            "save_enqueue_ms_median": med(t["save_enqueue"]) * 1e3,
            "load_enqueue_ms_median": med(t["load_enqueue"]) * 1e3,
            "samples": len(t["save"]),
        }
    report["throughput_paths"] = paths
    report["throughput_baseline"] = {
        "bytes": nbytes, "rounds": rounds, "planes": len(caches),
        "torch_d2h_GBps": gbps(d2h), "torch_h2d_GBps": gbps(h2d),
        "torch_d2h_GBps_range": [gbps(max(plain["d2h"])), gbps(min(plain["d2h"]))],
        "torch_h2d_GBps_range": [gbps(max(plain["h2d"])), gbps(min(plain["h2d"]))],
    }
    # The torch path at the check's chunk size, as earlier reports had it (ab.sh reads it).
    torch_path = paths.get(f"torch_{CHUNK}")
    if torch_path is not None:
        report["throughput"] = {
            "bytes": nbytes, "pinned": torch_path["pinned"],
            "kvpool_save_GBps_median": torch_path["save_GBps_median"],
            "torch_d2h_GBps": gbps(d2h),
            "kvpool_load_GBps_median": torch_path["load_GBps_median"],
            "torch_h2d_GBps": gbps(h2d),
            "save_vs_torch": torch_path["save_vs_torch"],
            "load_vs_torch": torch_path["load_vs_torch"],
            "save_enqueue_ms_median": torch_path["save_enqueue_ms_median"],
            "load_enqueue_ms_median": torch_path["load_enqueue_ms_median"],
            "planes": len(caches),
        }


def host_memory_lifetime(report, tmp, transfer="torch"):
    """Workers coming and going in one process (CUDA only): two workers at once each lock their
    own memory; a worker dropped without a shutdown unlocks its memory before freeing it, so
    the next worker's memory (likely the same addresses) locks again; locking a range twice is
    refused with kvpool's error, and torch's next op still runs (the refused call's CUDA error
    does not linger)."""
    caches = fa_caches(2, 64, 8, 128, torch.bfloat16, DEVICE)
    e = Engine(caches, tmp, transfer=transfer)
    first = e.worker.host_memory()
    report["pinned_first"] = e.pinned
    other = Engine(caches, tmp, transfer=transfer)
    report["pinned_two_at_once"] = other.pinned and other.worker.host_memory() != first
    other.shutdown()
    del other
    del e
    gc.collect()
    e = Engine(caches, tmp, transfer=transfer)
    report["same_range_after_drop"] = e.worker.host_memory() == first
    report["pinned_after_drop"] = e.pinned
    try:
        if transfer == "torch":
            pin_host_memory(*e.worker.host_memory())
        else:
            e.worker.pin_host_memory(e.copies)
        report["double_pin_refused"] = False
    except RuntimeError as err:
        report["double_pin_refused"] = "page-locked earlier" in str(err)
    report["torch_runs_after_refusal"] = bool(torch.ones(4, device=DEVICE).sum().item() == 4)
    e.shutdown()


def run_check(report, failures, name, check, keys, *args, **kwargs):
    """Runs ``check(r, *args, **kwargs)`` into ``report[name]``; a key of ``keys`` that is not
    truthy afterwards, an error, or jobs left in flight fail the run."""
    r = report.setdefault(name, {})
    try:
        check(r, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported, then the run fails
        r["error"] = repr(e)
    if "skipped" in r:
        return r
    for key in keys:
        if not r.get(key):
            failures.append(f"{name}: {key} {r.get(key)!r} {r.get('error', '')}")
    if r.get("in_flight_after", [0, 0, 0, 0]) != [0, 0, 0, 0]:
        failures.append(f"{name}: left in flight {r.get('in_flight_after')}")
    return r


def main():
    report = {"torch": torch.__version__, "cuda": torch.version.cuda, "check_device": DEVICE,
              "transfers": TRANSFERS,
              "kvpool_from": os.path.dirname(os.path.dirname(os.path.abspath(_native.__file__))),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    failures = []
    if DEVICE == "cuda" and not torch.cuda.is_available():
        report["skipped"] = "SKIP: no CUDA device (KVPOOL_CHECK_DEVICE=cpu runs the checks on CPU)"
        print(json.dumps(report, indent=2))
        return
    cuda = DEVICE == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        for transfer in TRANSFERS:
            sfx = suffix(transfer)
            if transfer.startswith("native"):
                probe = native_copy_engine(
                    detect(fa_caches(1, 4, 1, 8, torch.bfloat16, DEVICE), BLOCK).planes,
                    native_mode(transfer))
                report["engine" + sfx] = {"kind": probe.kind, "batched": probe.batched,
                                          "description": probe.description}
                del probe
            for name, caches, mla in (
                    ("flash_attn", fa_caches(2, 256, 8, 128, torch.bfloat16, DEVICE), False),
                    ("flashinfer_hnd", flashinfer_hnd_caches(2, 256, 8, 128, torch.float16,
                                                             DEVICE), False),
                    ("mla", mla_caches(2, 256, DEVICE), True)):
                r = run_check(report, failures, name + sfx, correctness,
                              ("sync_load_exact", "async_load_exact")
                              + (("pinned",) if cuda else ()),
                              caches, tmp, use_mla=mla, transfer=transfer)
                if cuda and transfer in ("native", "native-kernel") \
                        and not r.get("kernel_jobs", [0])[0]:
                    # The scattered loads must have gone through the copy kernel.
                    failures.append(f"{name}{sfx}: kernel_jobs {r.get('kernel_jobs')}")
            if cuda:
                # same_range_after_drop: else the check did not see memory reused after a drop.
                run_check(report, failures, "host_memory_lifetime" + sfx, host_memory_lifetime,
                          ("pinned_first", "pinned_two_at_once", "same_range_after_drop",
                           "pinned_after_drop", "double_pin_refused",
                           "torch_runs_after_refusal"), tmp, transfer=transfer)
            run_check(report, failures, "hybrid_groups" + sfx, hybrid_groups,
                      ("both_finished", "full_group_exact", "window_exact",
                       "null_block_untouched") + (("pinned",) if cuda else ()),
                      tmp, transfer=transfer)
            run_check(report, failures, "staged_load" + sfx, staged_load,
                      ("job_done", "buffers_hold_the_chunks", "blocks_hold_the_chunks"),
                      transfer=transfer)
            r = run_check(report, failures, "daemon_route" + sfx, daemon_route,
                          ("load_exact", "node_memory_staged_tokens",
                           "changed_chunk_failed_in_its_step", "saved_into_daemon_memory"),
                          tmp, transfer=transfer)
            if "skipped" not in r:
                pinned = r.get("daemon_memory_pinned")
                if cuda and not (pinned and all(pinned)):
                    failures.append(f"daemon_route{sfx}: daemon_memory_pinned {pinned!r}")
                if r.get("heap_buffers", 0) != 0:
                    failures.append(f"daemon_route{sfx}: heap_buffers {r.get('heap_buffers')} "
                                    "(L1 had no room for the staged copies)")
        timed = "native" if "native" in TRANSFERS else TRANSFERS[0]
        r = run_check(report, failures, "daemon_vs_l1", daemon_vs_l1,
                      ("daemon_exact", "l1_exact", "every_daemon_load_staged"), tmp,
                      transfer=timed)
        r["transfer"] = timed
        if cuda and "skipped" not in r and not all(r.get("daemon_memory_pinned") or [False]):
            failures.append(f"daemon_vs_l1: daemon_memory_pinned {r.get('daemon_memory_pinned')!r}")
        try:
            throughput(report, tmp)
        except Exception as e:  # noqa: BLE001
            failures.append(f"throughput: {e!r}")
    report["failures"] = failures
    text = json.dumps(report, indent=2)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu-check.json"), "w") as f:
            f.write(text)
    summary(report)
    sys.exit(1 if failures else 0)


def summary(report):
    """A short table last (the GPU tool returns the end of the output)."""
    base = report.get("throughput_baseline")
    if base:
        print(f"plain torch copy: d2h {base['torch_d2h_GBps']:.1f} GB/s, "
              f"h2d {base['torch_h2d_GBps']:.1f} GB/s ({base['bytes'] >> 20} MiB, "
              f"{base['rounds']} rounds)")
    for key, t in sorted(report.get("throughput_paths", {}).items()):
        print(f"{key:>22}: save {t['save_GBps_median']:6.1f} GB/s ({t['save_vs_torch']:.2f}x) "
              f"load {t['load_GBps_median']:6.1f} GB/s ({t['load_vs_torch']:.2f}x) "
              f"enqueue save {t['save_enqueue_ms_median']:.2f} ms load "
              f"{t['load_enqueue_ms_median']:.2f} ms pinned {t['pinned']}")
    timed = report.get("daemon_vs_l1", {})
    if "daemon_load_ms_median" in timed:
        print(f"hit of {timed['bytes'] >> 20} MiB ({timed['transfer']}, medians of "
              f"{timed['samples']}): daemon {timed['daemon_load_ms_median']:.2f} ms "
              f"{[round(x, 2) for x in timed['daemon_load_ms_range']]}, L1 "
              f"{timed['l1_load_ms_median']:.2f} ms {[round(x, 2) for x in timed['l1_load_ms_range']]}"
              f", daemon/L1 {timed['daemon_vs_l1_median_of_pairs']:.2f}x "
              f"{[round(x, 2) for x in timed['daemon_vs_l1_range']]}")
        for route in ("daemon", "l1"):
            print(f"  {route} phases (ms):", timed[f"{route}_phases_ms_median"])
    for key in ("engine_native", "engine_native_dma", "engine_native_kernel"):
        if key in report:
            print(f"{key}:", report[key])
    print("failures:", report["failures"] or "none")


if __name__ == "__main__":
    main()
