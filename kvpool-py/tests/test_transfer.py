"""The transfer path (kvpool.transfer.BlockMover) on CPU tensors, without an engine: saves and
loads are byte-exact whatever word the bytes are moved as (8-byte words for usual layouts,
narrower when a block length, a padded row stride or a chunk's address needs it)."""

import pytest
import torch

from kvpool.transfer import BlockMover, CopyJob, word_dtype


def test_the_word_is_the_widest_that_divides_every_value():
    assert word_dtype([16384, 20480, 4096]) == torch.int64
    assert word_dtype([16384, 12]) == torch.int32
    assert word_dtype([16384, 4096, 6]) == torch.int16
    assert word_dtype([16384, 3]) == torch.uint8


def _planes(num_planes, blocks, block_bytes, row_bytes):
    """uint8 [blocks, block_bytes] views over rows of ``row_bytes`` (vLLM pads pages), filled
    with distinct random bytes."""
    gen = torch.Generator().manual_seed(7)
    rows = [torch.randint(0, 256, (blocks, row_bytes), dtype=torch.uint8, generator=gen)
            for _ in range(num_planes)]
    return [r[:, :block_bytes] for r in rows]


def _job(job_id, is_load, block_ids, chunk_blocks, block_bytes, ptrs, skip=0, checks=()):
    return CopyJob(id=job_id, is_load=is_load, req_id="r", block_ids=block_ids,
                   skip_blocks=skip, chunk_blocks=chunk_blocks, block_bytes=block_bytes,
                   chunk_ptrs=ptrs, check_copy_ptrs=list(checks))


@pytest.mark.parametrize("block_bytes,row_bytes,host_offset,word", [
    (256, 256, 0, torch.int64),    # the usual layout: 8-byte words
    (256, 264, 0, torch.int64),    # padded rows, still 8-byte aligned
    (256, 260, 0, torch.int32),    # rows 4 bytes apart narrow the word
    (256, 256, 2, torch.int16),    # a chunk at an odd 2-byte address narrows the job's word
    (255, 255, 0, torch.uint8),    # an odd block length: bytes
])
def test_a_save_then_a_load_into_other_blocks_is_byte_exact(block_bytes, row_bytes,
                                                            host_offset, word):
    planes = _planes(3, 40, block_bytes, row_bytes)
    mover = BlockMover(planes)
    bytes_per_block = 3 * block_bytes
    chunk_blocks = [4, 4, 1]  # two whole chunks, then one tail block
    arena = torch.zeros(host_offset + sum(chunk_blocks) * bytes_per_block + 64,
                        dtype=torch.uint8)
    ptrs, at = [], arena.data_ptr() + host_offset
    for n in chunk_blocks:
        ptrs.append(at)
        at += n * bytes_per_block
    assert word_dtype([mover.word.itemsize, *ptrs]) == word

    saved = [3, 17, 4, 9, 30, 31, 0, 12, 25]  # scattered engine blocks
    mover.run(_job(1, False, saved, chunk_blocks, bytes_per_block, ptrs))
    assert mover.poll() == []  # CPU copies are done when run returns; nothing is pending
    expected = [p[saved].clone() for p in planes]
    # Each chunk holds its blocks plane by plane.
    chunk0 = arena[host_offset:host_offset + 4 * bytes_per_block].view(3, 4, block_bytes)
    assert torch.equal(chunk0[1], planes[1][saved[:4]])

    loaded = [33, 34, 35, 36, 5, 6, 7, 8, 39]
    before = [p[loaded].clone() for p in planes]
    assert not all(torch.equal(b, e) for b, e in zip(before, expected))
    mover.run(_job(2, True, loaded, chunk_blocks, bytes_per_block, ptrs))
    for p, e in zip(planes, expected):
        assert torch.equal(p[loaded], e)
    # Blocks outside the job and the rows' padding are untouched.
    untouched = [b for b in range(40) if b not in loaded]
    after = _planes(3, 40, block_bytes, row_bytes)
    for p, a in zip(planes, after):
        assert torch.equal(p[untouched], a[untouched])
        base = p.as_strided((40, row_bytes), (p.stride(0), 1))
        fresh = a.as_strided((40, row_bytes), (a.stride(0), 1))
        assert torch.equal(base[:, block_bytes:], fresh[:, block_bytes:])


def test_a_load_skips_the_blocks_the_engine_already_holds():
    planes = _planes(2, 16, 64, 64)
    mover = BlockMover(planes)
    arena = torch.arange(4 * 2 * 64, dtype=torch.int64).to(torch.uint8)
    ptr = arena.data_ptr()
    before = [p.clone() for p in planes]
    # A chunk of 4 blocks whose first 3 the engine holds: only its last block is copied.
    mover.run(_job(1, True, [9], [4], 2 * 64, [ptr], skip=3))
    chunk = arena.view(2, 4, 64)
    for i, (p, b) in enumerate(zip(planes, before)):
        assert torch.equal(p[9], chunk[i, 3])
        keep = [x for x in range(16) if x != 9]
        assert torch.equal(p[keep], b[keep])


def test_a_save_with_fewer_engine_blocks_than_its_chunks_hold_is_refused():
    """Ops that take an output resize a too-large one rather than fail: without the check, the
    chunk's last block would be left as it was (on CUDA: uninitialised staging memory) and
    stored as KV."""
    planes = _planes(2, 16, 64, 64)
    mover = BlockMover(planes)
    arena = torch.full((2 * 4 * 64,), 0xAB, dtype=torch.uint8)
    with pytest.raises(ValueError, match="3 engine blocks for chunks of 4 blocks"):
        mover.run(_job(1, False, [1, 2, 3], [4], 2 * 64, [arena.data_ptr()]))
    assert bool((arena == 0xAB).all()), "a refused save wrote into the chunk"
    with pytest.raises(ValueError, match="a save starts at a chunk's first block"):
        mover.run(_job(2, False, [9], [4], 2 * 64, [arena.data_ptr()], skip=3))


def test_a_job_whose_sizes_disagree_with_the_planes_is_refused():
    mover = BlockMover(_planes(2, 8, 64, 64))
    arena = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="chunk blocks of 64 bytes for 2 planes"):
        mover.run(_job(1, True, [0], [1], 64, [arena.data_ptr()]))


def test_a_staged_load_leaves_the_bytes_it_filled_the_blocks_with_in_the_workers_buffer():
    """A chunk of the node's pool daemon (memory other processes write) is read once: into
    the worker's buffer, the blocks filled from there (on CUDA: from the device copy read back
    into the buffer), so the worker's check of the buffer vouches for the blocks. The first
    chunk starts past blocks the engine holds: the buffer still gets the whole chunk, which
    the checksum covers."""
    planes = _planes(2, 16, 64, 64)
    mover = BlockMover(planes)
    per_block = 2 * 64
    arena = torch.randint(0, 256, (6 * per_block,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(3))
    staged = torch.zeros(4 * per_block, dtype=torch.uint8)
    ptrs = [arena.data_ptr(), arena.data_ptr() + 4 * per_block]
    # Chunk 0 (4 blocks, the first held already) is staged; chunk 1 (a tail block) is not.
    checks = [staged.data_ptr(), 0]
    before = [p.clone() for p in planes]
    mover.run(_job(1, True, [5, 6, 7, 12, 13], [4, 2], per_block, ptrs, skip=1,
                   checks=checks))
    assert torch.equal(staged, arena[:4 * per_block]), "the whole chunk, as read"
    chunk0 = arena[:4 * per_block].view(2, 4, 64)
    chunk1 = arena[4 * per_block:].view(2, 2, 64)
    for i, (p, b) in enumerate(zip(planes, before)):
        assert torch.equal(p[[5, 6, 7]], chunk0[i, 1:])
        assert torch.equal(p[[12, 13]], chunk1[i])
        assert torch.equal(p[0:5], b[0:5])


def test_a_staged_chunk_is_read_once_so_a_change_during_the_copy_cannot_reach_the_blocks_alone(
        monkeypatch):
    """Another process writes the chunk while it is copied (after the buffer was filled,
    before the blocks are): the blocks must still hold what the buffer holds, which is what
    the worker checks. Filled from the chunk itself a second time, they would hold bytes no
    check saw."""
    planes = _planes(2, 8, 64, 64)
    mover = BlockMover(planes)
    per_block = 2 * 64
    arena = torch.randint(0, 256, (4 * per_block,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(5))
    staged = torch.zeros(4 * per_block, dtype=torch.uint8)
    original = torch.Tensor.index_copy_

    def written_meanwhile(self, dim, index, source):
        arena.add_(1)  # the other process, between the read and each plane's scatter
        return original(self, dim, index, source)

    monkeypatch.setattr(torch.Tensor, "index_copy_", written_meanwhile)
    mover.run(_job(1, True, [0, 1, 2, 3], [4], per_block, [arena.data_ptr()],
                   checks=[staged.data_ptr()]))
    monkeypatch.undo()
    chunk = staged.view(2, 4, 64)
    for p, plane in enumerate(planes):
        assert torch.equal(plane[[0, 1, 2, 3]], chunk[p]), "the blocks hold what was checked"
    assert not torch.equal(staged, arena), "the chunk did change during the copy"


def test_staged_copies_are_refused_with_a_count_unlike_the_chunks():
    mover = BlockMover(_planes(2, 8, 64, 64))
    arena = torch.zeros(4 * 128, dtype=torch.uint8)
    staged = torch.zeros(4 * 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match="2 staged copies for a save of 1 chunks"):
        mover.run(_job(1, False, [0, 1, 2, 3], [4], 128, [arena.data_ptr()],
                       checks=[staged.data_ptr(), 0]))
    with pytest.raises(ValueError, match="2 staged copies for a load of 1 chunks"):
        mover.run(_job(2, True, [0, 1, 2, 3], [4], 128, [arena.data_ptr()],
                       checks=[staged.data_ptr(), 0]))
    assert bool((staged == 0).all()) and bool((arena == 0).all())


def test_a_staged_save_gathers_once_into_the_workers_buffer_and_the_place_gets_the_same_bytes():
    """A save into a place the pool daemon lends: the worker hashes its checksum from its own
    buffer, so the buffer and the place must hold the same gather (a second gather of blocks
    the engine may write meanwhile could differ)."""
    planes = _planes(2, 8, 64, 64)
    mover = BlockMover(planes)
    per_block = 2 * 64
    place = torch.zeros(4 * per_block + 2 * per_block, dtype=torch.uint8)
    staged = torch.zeros(4 * per_block, dtype=torch.uint8)
    saved = [5, 1, 7, 2, 3, 0]
    ptrs = [place.data_ptr(), place.data_ptr() + 4 * per_block]
    mover.run(_job(1, False, saved, [4, 2], per_block, ptrs, checks=[staged.data_ptr(), 0]))
    chunk0 = place[:4 * per_block].view(2, 4, 64)
    for p, plane in enumerate(planes):
        assert torch.equal(chunk0[p], plane[saved[:4]])
        assert torch.equal(place[4 * per_block:].view(2, 2, 64)[p], plane[saved[4:]])
    assert torch.equal(staged, place[:4 * per_block]), "the buffer holds what the place got"


def test_a_staged_save_is_hashed_from_its_gather_not_from_the_place(monkeypatch):
    """Another process writes the place right after the copy into it: the worker's buffer,
    which the checksum is hashed from, must still hold the gather (the place's change then
    fails every reader's check). Copied into the buffer from the place, it would vouch for
    bytes the engine never computed."""
    planes = _planes(2, 8, 64, 64)
    mover = BlockMover(planes)
    per_block = 2 * 64
    place = torch.zeros(2 * per_block, dtype=torch.uint8)
    staged = torch.zeros(2 * per_block, dtype=torch.uint8)
    lo, hi = place.data_ptr(), place.data_ptr() + place.numel()
    original = torch.Tensor.copy_

    def written_after(self, src, *args, **kwargs):
        out = original(self, src, *args, **kwargs)
        if lo <= self.data_ptr() < hi:
            place.view(-1)[3] ^= 0xFF  # the other process
        return out

    monkeypatch.setattr(torch.Tensor, "copy_", written_after)
    mover.run(_job(1, False, [4, 6], [2], per_block, [place.data_ptr()],
                   checks=[staged.data_ptr()]))
    monkeypatch.undo()
    gathered = torch.cat([plane[[4, 6]].reshape(-1) for plane in planes])
    assert torch.equal(staged, gathered), "the buffer holds the gather"
    assert not torch.equal(place, gathered), "the place did change after its copy"


def test_the_gpu_variants_still_apply_to_the_transfer_path(tmp_path):
    """``kvpool-py/gpu/variants/*.diff`` (transfer-path variants the GPU bundle's ``ab.sh``
    times) are diffs against the shipped ``kvpool/transfer.py``: a change to it must rebase
    them, or the next GPU session cannot run them."""
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("patch") is None:
        pytest.skip("no `patch` command")
    root = Path(__file__).resolve().parents[1]
    source = root / "python" / "kvpool" / "transfer.py"
    diffs = sorted((root / "gpu" / "variants").glob("*.diff"))
    assert diffs
    for diff in diffs:
        out = subprocess.run(["patch", "--dry-run", "-o", str(tmp_path / "variant.py"),
                              str(source)], stdin=diff.open(), capture_output=True, text=True)
        assert out.returncode == 0, f"{diff.name}: {out.stdout}{out.stderr}"
