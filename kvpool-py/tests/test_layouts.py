"""vLLM 0.32's KV cache layouts (kvpool.vllm.layouts) without an engine: an unknown layout is
refused at start-up naming what it saw, and MLA's latent (the same on every TP rank) is stored
once per chunk in a shared tier, not once per rank."""

import os
import time

import pytest
import torch

from kvpool import _native
from kvpool.transfer import BlockMover
from kvpool.vllm.layouts import detect

BLOCK = 16


def test_a_layout_whose_blocks_are_not_contiguous_is_refused_naming_it():
    # LHBNC: heads outside blocks, so a block is one range per head, not one range.
    phys = torch.zeros(4, 8, BLOCK, 2 * 64)  # [H, B, N, C]
    logical = {"model.layers.0.self_attn.attn": phys.permute(1, 0, 2, 3)}
    with pytest.raises(ValueError) as e:
        detect(logical, BLOCK, backend="FLASH_ATTN", layout_name="LHBNC")
    msg = str(e.value)
    assert "FLASH_ATTN (LHBNC)" in msg and "shape (8, 4, 16, 128)" in msg and "strides" in msg


def test_layers_that_disagree_are_refused():
    caches = {"a": torch.zeros(8, 2, BLOCK, 64), "b": torch.zeros(8, 2, BLOCK, 32)}
    with pytest.raises(ValueError, match="unlike the first layer"):
        detect(caches, BLOCK)


def _mla_rank(tmp, rank, tiers, replicated):
    caches = {f"l{i}": torch.randn(64, 1, BLOCK, 576).to(torch.bfloat16) for i in range(2)}
    layout = detect(caches, BLOCK, use_mla=True, replicated=replicated, backend="FLASHMLA",
                    layout_name="LBNHC")
    sock = os.path.join(tmp, f"r{rank}-{replicated}.sock")
    worker = _native.Worker(
        config_text='[local_cpu]\nmax_size = "64MiB"\n[chunking]\nchunk_size = 64\n'
                    f'[[tier]]\nurl = "{tiers}"\n',
        config_format="toml", model="mla", weights="w", tp_size=2, tp_rank=rank, pp_rank=0,
        block_size=BLOCK, num_layers=2, num_kv_heads=1, head_size=576, dtype="bfloat16",
        kv_format=layout.kv_format, kind="latent", replicated=layout.replicated,
        socket_path=sock)
    return worker, BlockMover(layout.planes), sock


@pytest.mark.parametrize("replicated", [True, False])
def test_mla_is_stored_once_per_chunk_across_two_ranks(tmp_path, redis_server, replicated):
    ranks = [_mla_rank(str(tmp_path), r, redis_server.url, replicated) for r in range(2)]
    sched = _native.Scheduler(socket_paths=[s for _, _, s in ranks], block_size=BLOCK)
    prompt = list(range(3, 3 + 4 * 64 + 1))
    blocks = list(range(0, 17))
    sched.get_num_new_matched_tokens("a", prompt, b"", 0)
    sched.update_state_after_alloc("a", blocks, 0)
    meta = sched.build_connector_meta([("a", len(prompt), [], 2, blocks, len(prompt))], [])
    reports = []
    for worker, mover, _ in ranks:
        worker.bind(meta)
        for job in worker.save_jobs():
            mover.run(job)
            worker.copy_done(job.id, True)
        worker.transfer_results([])
        reports.append(worker.step_report())
        worker.clear()
    executed = [(s, 2) for s in reports[0][0]]
    copied = [(s, 2) for s in reports[0][1]]
    sched.update_connector_output([], [], executed, copied)
    commit = sched.build_connector_meta([], [])  # ships the commit to both ranks
    for worker, _, _ in ranks:
        worker.bind(commit)
        worker.step_report()
        worker.clear()
        worker.shutdown()  # flushes write-behind to Redis
    deadline = time.time() + 10
    while len(redis_server.keys()) < 4 and time.time() < deadline:
        time.sleep(0.05)
    keys = redis_server.keys()
    # Four 64-token chunks; without replication each rank stores its own copy.
    assert len(keys) == (4 if replicated else 8), keys
