"""kvpool-cuda's host executor (``kvpool._native.CopyEngine`` on CPU tensors, the copy plan a GPU
runs) against the torch path (``kvpool.transfer.BlockMover``) on the same jobs, byte for byte,
in every layout kvpool accepts: saves, loads, loads that skip held blocks, staged chunks
(the node daemon's route), padded rows; and refusals that write nothing."""

import pytest
import torch

from kvpool.transfer import BlockMover, CopyJob, native_copy_engine, resolve_transfer
from kvpool.vllm.layouts import detect

BLOCK = 16


def _fa(layers, blocks, heads, head, dtype):
    """FlashAttention's view: logical [B, H, N, 2D] over physical [B, N, H, 2D] (LBNHC)."""
    return {f"l{i}": torch.randn(blocks, BLOCK, heads, 2 * head).to(dtype).permute(0, 2, 1, 3)
            for i in range(layers)}


def _hnd(layers, blocks, heads, head, dtype):
    """FlashInfer's HND order (LBHNC): the logical view is the physical one."""
    return {f"l{i}": torch.randn(blocks, heads, BLOCK, 2 * head).to(dtype)
            for i in range(layers)}


def _mla(layers, blocks):
    return {f"l{i}": torch.randn(blocks, 1, BLOCK, 576).to(torch.bfloat16)
            for i in range(layers)}


def _padded(layers, blocks, heads, head, dtype):
    """Pages padded past their bytes (rows further apart than a page, as vLLM pads them)."""
    out = {}
    for i in range(layers):
        rows = torch.randn(blocks, heads * BLOCK * 2 * head + 24).to(dtype)
        out[f"l{i}"] = rows[:, :heads * BLOCK * 2 * head].view(blocks, heads, BLOCK, 2 * head)
    return out


LAYOUTS = {
    "flash_attn": lambda: (_fa(3, 40, 2, 64, torch.bfloat16), False),
    "flashinfer_hnd": lambda: (_hnd(3, 40, 2, 64, torch.float16), False),
    "mla": lambda: (_mla(2, 40), True),
    "padded": lambda: (_padded(2, 40, 2, 32, torch.float32), False),
    "fp8": lambda: ({k: v.to(torch.float8_e4m3fn) for k, v in _hnd(2, 40, 2, 64,
                                                                   torch.float32).items()},
                    False),
}


def _twin_planes(layout_name):
    """Two identical copies of one layout's KV caches, as planes: one for each path."""
    caches, mla = LAYOUTS[layout_name]()
    twin = {k: v.clone() if v.is_contiguous() else _clone_strided(v) for k, v in caches.items()}
    a = detect(caches, BLOCK, use_mla=mla).planes
    b = detect(twin, BLOCK, use_mla=mla).planes
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    return (caches, a), (twin, b)


def _clone_strided(t):
    """A copy of ``t`` with the same strides (and so the same physical layout)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    out.copy_(t)
    return out


def _run_native(engine, job):
    assert engine.run(job) is True


def _host(nbytes, seed):
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("staged", [False, True])
def test_the_host_executor_moves_the_bytes_the_torch_path_moves(layout, staged):
    (_, torch_planes), (_, native_planes) = _twin_planes(layout)
    mover = BlockMover(torch_planes)
    engine = native_copy_engine(native_planes)
    assert engine.kind == "host"
    per_block = len(torch_planes) * int(torch_planes[0].shape[1])
    chunk_blocks = [4, 4, 1]  # two whole chunks, then a tail block
    n = sum(chunk_blocks)
    # Save: scattered engine blocks into chunks (each path into its own host memory).
    saved = [3, 17, 4, 9, 30, 31, 0, 12, 25]
    hosts, checks = {}, {}
    for name in ("torch", "native"):
        hosts[name] = torch.zeros(n * per_block, dtype=torch.uint8)
        checks[name] = torch.zeros(4 * per_block, dtype=torch.uint8)
    for name, run in (("torch", mover.run), ("native", lambda j: _run_native(engine, j))):
        base = hosts[name].data_ptr()
        ptrs = [base, base + 4 * per_block, base + 8 * per_block]
        job = CopyJob(id=1, is_load=False, req_id="s", block_ids=saved, skip_blocks=0,
                      chunk_blocks=chunk_blocks, block_bytes=per_block, chunk_ptrs=ptrs,
                      check_copy_ptrs=[checks[name].data_ptr(), 0, 0] if staged else [])
        run(job)
    assert torch.equal(hosts["torch"], hosts["native"])
    assert torch.equal(checks["torch"], checks["native"])
    if staged:
        assert torch.equal(checks["native"], hosts["native"][:4 * per_block])
    # Load: chunks of other bytes into other blocks, the first chunk's first block held.
    source = _host(n * per_block, 11)
    loaded = [33, 34, 35, 5, 6, 7, 8, 39]
    for name, run, planes in (("torch", mover.run, torch_planes),
                              ("native", lambda j: _run_native(engine, j), native_planes)):
        stage = torch.zeros(4 * per_block, dtype=torch.uint8)
        base = source.data_ptr()
        job = CopyJob(id=2, is_load=True, req_id="l", block_ids=loaded, skip_blocks=1,
                      chunk_blocks=chunk_blocks, block_bytes=per_block,
                      chunk_ptrs=[base, base + 4 * per_block, base + 8 * per_block],
                      check_copy_ptrs=[stage.data_ptr(), 0, 0] if staged else [])
        run(job)
        if staged:
            assert torch.equal(stage, source[:4 * per_block]), name
    for p, q in zip(torch_planes, native_planes):
        assert torch.equal(p, q)
    # And the loaded blocks hold the chunks (not just the same wrong bytes on both paths).
    plane_bytes = int(native_planes[0].shape[1])
    chunk1 = source[4 * per_block:8 * per_block].view(len(native_planes), 4, plane_bytes)
    for i, plane in enumerate(native_planes):
        assert torch.equal(plane[[5, 6, 7, 8]], chunk1[i])


def test_a_refused_job_writes_nothing():
    (_, _), (_, planes) = _twin_planes("flash_attn")
    engine = native_copy_engine(planes)
    per_block = len(planes) * int(planes[0].shape[1])
    host = torch.full((4 * per_block,), 0xAB, dtype=torch.uint8)
    before = [p.clone() for p in planes]
    ptrs = [host.data_ptr()]
    bad = [
        # a save with fewer engine blocks than its chunk holds
        CopyJob(id=1, is_load=False, req_id="r", block_ids=[1, 2, 3], skip_blocks=0,
                chunk_blocks=[4], block_bytes=per_block, chunk_ptrs=ptrs),
        # a block past the cache
        CopyJob(id=2, is_load=True, req_id="r", block_ids=[1, 2, 3, 400], skip_blocks=0,
                chunk_blocks=[4], block_bytes=per_block, chunk_ptrs=ptrs),
        # one block twice in a load
        CopyJob(id=3, is_load=True, req_id="r", block_ids=[1, 2, 2, 3], skip_blocks=0,
                chunk_blocks=[4], block_bytes=per_block, chunk_ptrs=ptrs),
        # a block length that is not the planes'
        CopyJob(id=4, is_load=True, req_id="r", block_ids=[1, 2, 3, 4], skip_blocks=0,
                chunk_blocks=[4], block_bytes=per_block - 1, chunk_ptrs=ptrs),
    ]
    for job in bad:
        with pytest.raises(ValueError):
            engine.run(job)
    assert bool((host == 0xAB).all())
    for p, b in zip(planes, before):
        assert torch.equal(p, b)


def test_the_transfer_option_resolves_per_device():
    assert resolve_transfer("auto", torch.device("cpu")) == "native"
    assert resolve_transfer("auto", torch.device("cuda")) == "native"
    assert resolve_transfer("torch", torch.device("cuda")) == "torch"
    assert resolve_transfer("torch", torch.device("cpu")) == "torch"
    assert resolve_transfer("native", torch.device("cpu")) == "native"
    with pytest.raises(ValueError, match="not one of"):
        resolve_transfer("fast", torch.device("cpu"))
