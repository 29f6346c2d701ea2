//! The engine side of [`CopyJob`]s for an engine whose KV lives in a [`HostPagedKvCache`]:
//! what the Python connector does with torch, done in Rust for the tests and the simulator,
//! through kvpool-core's one host transfer ([`KvTransfer`]).
//!
//! A copy job's chunk byte order (planes, then blocks, then a block's token rows) is the chunk
//! layout [`KvTransfer`] reads and writes, and an engine block `e` is the slots
//! `e * block_size ..`, so a job is one gather (save) or scatter (load) per chunk.

use kvpool_core::{ChunkWindow, HostPagedKvCache, KvTransfer, TransferError};

use crate::vllm::worker::{CopyDirection, CopyJob};

/// Runs `job` against `kv`: a load writes the job's chunks into `kv`'s blocks, a save reads
/// `kv`'s blocks into the job's chunks.
///
/// # Safety
///
/// `job` must come from a live [`crate::ConnectorWorker`] that has not yet been told it is
/// done ([`crate::ConnectorWorker::copy_done`]): its addresses then point at chunk buffers of
/// `job.chunk_bytes(c)` bytes that the worker owns and nobody else touches (a load's chunk
/// lent by node memory may change under it: it is read once, into its staged copy,
/// [`CopyJob::check_copy_ptrs`]).
pub unsafe fn run_copy_job(job: &CopyJob, kv: &mut HostPagedKvCache) -> Result<(), TransferError> {
    let layout = *kv.layout();
    let bs = layout.block_size;
    let expected = layout.chunk_bytes(bs);
    if job.block_bytes != expected || job.chunk_blocks.len() != job.chunk_ptrs.len() {
        return Err(TransferError::BufferSize {
            actual: job.block_bytes,
            expected,
            tokens: bs,
        });
    }
    let blocks: usize = job.chunk_blocks.iter().sum();
    if job.skip_blocks + job.block_ids.len() > blocks {
        return Err(TransferError::TokenRange {
            start: job.skip_blocks * bs,
            end: (job.skip_blocks + job.block_ids.len()) * bs,
            tokens: blocks * bs,
        });
    }
    // The job's blocks before chunk `c`, counted from the first chunk's first block.
    let mut before = 0;
    for (c, (&ptr, &bpc)) in job.chunk_ptrs.iter().zip(&job.chunk_blocks).enumerate() {
        let chunk_tokens = bpc * bs;
        let chunk_bytes = job.chunk_bytes(c);
        // The chunk blocks this job copies: `first..end` of chunk `c`.
        let first = job.skip_blocks.saturating_sub(before).min(bpc);
        let end = (job.skip_blocks + job.block_ids.len())
            .saturating_sub(before)
            .min(bpc);
        let chunk_start = before;
        before += bpc;
        if first >= end {
            continue;
        }
        // `block_ids[i]` is job block `skip_blocks + i`.
        let ids_from = chunk_start + first - job.skip_blocks;
        let ids = &job.block_ids[ids_from..ids_from + (end - first)];
        let slots: Vec<i64> = ids
            .iter()
            .flat_map(|&e| (0..bs).map(move |t| (e as usize * bs + t) as i64))
            .collect();
        match job.direction {
            CopyDirection::Load => {
                // SAFETY: the caller promised `ptr` addresses `chunk_bytes` bytes owned by the
                // worker for the job's life, read-only for a load.
                let mut data = unsafe { std::slice::from_raw_parts(ptr as *const u8, chunk_bytes) };
                let staged = job.check_copy_ptrs.get(c).copied().unwrap_or(0);
                if staged != 0 {
                    // The chunk is read once, into the worker's buffer, and the blocks are
                    // filled from that copy, which the worker then checks.
                    // SAFETY: as above: the worker owns the buffer, of the chunk's length,
                    // for the job's life, and only the job writes it.
                    let copy =
                        unsafe { std::slice::from_raw_parts_mut(staged as *mut u8, chunk_bytes) };
                    copy.copy_from_slice(data);
                    data = copy;
                }
                kv.scatter(ChunkWindow {
                    data,
                    chunk_tokens,
                    token_offset: first * bs,
                    slots: &slots,
                })?;
            }
            CopyDirection::Save => {
                if first != 0 || end != bpc {
                    // A save fills whole chunks (only a load skips blocks the engine holds).
                    return Err(TransferError::TokenRange {
                        start: (chunk_start + first) * bs,
                        end: (chunk_start + end) * bs,
                        tokens: blocks * bs,
                    });
                }
                // SAFETY: as above; a save's buffer is written by this job alone.
                let data = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, chunk_bytes) };
                let staged = job.check_copy_ptrs.get(c).copied().unwrap_or(0);
                if staged == 0 {
                    kv.gather(&slots, data)?;
                } else {
                    // Gathered once, into the worker's buffer (what it hashes), then copied
                    // into the chunk's place.
                    // SAFETY: as for a load's staged copy.
                    let copy =
                        unsafe { std::slice::from_raw_parts_mut(staged as *mut u8, chunk_bytes) };
                    kv.gather(&slots, copy)?;
                    data.copy_from_slice(copy);
                }
            }
        }
    }
    Ok(())
}
