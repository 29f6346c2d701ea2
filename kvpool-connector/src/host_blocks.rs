//! The engine side of [`CopyJob`]s for an engine whose KV lives in a [`HostPagedKvCache`]:
//! what the Python connector does with torch, done in Rust for the tests and the simulator,
//! through kvpool-core's one host transfer ([`KvTransfer`]).
//!
//! A copy job's chunk byte order (planes, then blocks, then a block's token rows) is the chunk
//! layout [`KvTransfer`] reads and writes, and an engine block `e` is the slots
//! `e * block_size ..`, so a job is one gather (save) or scatter (load) per chunk.

use kvpool_core::{ChunkWindow, HostPagedKvCache, KvTransfer, TransferError};

use crate::worker::{CopyDirection, CopyJob};

/// Runs `job` against `kv`: a load writes the job's chunks into `kv`'s blocks, a save reads
/// `kv`'s blocks into the job's chunks.
///
/// # Safety
///
/// `job` must come from a live [`crate::ConnectorWorker`] that has not yet been told it is
/// done ([`crate::ConnectorWorker::copy_done`]): its addresses then point at chunk buffers of
/// `job.chunk_bytes` bytes that the worker owns and nobody else touches.
pub unsafe fn run_copy_job(job: &CopyJob, kv: &mut HostPagedKvCache) -> Result<(), TransferError> {
    let layout = *kv.layout();
    let bs = layout.block_size;
    let bpc = job.blocks_per_chunk;
    let chunk_tokens = bpc * bs;
    let expected = layout.chunk_bytes(chunk_tokens);
    if job.chunk_bytes != expected {
        return Err(TransferError::BufferSize {
            actual: job.chunk_bytes,
            expected,
            tokens: chunk_tokens,
        });
    }
    let chunks = job.chunk_ptrs.len();
    if job.skip_blocks + job.block_ids.len() > chunks * bpc {
        return Err(TransferError::TokenRange {
            start: job.skip_blocks * bs,
            end: (job.skip_blocks + job.block_ids.len()) * bs,
            tokens: chunks * chunk_tokens,
        });
    }
    for (c, &ptr) in job.chunk_ptrs.iter().enumerate() {
        // The chunk blocks this job copies: `first..end` of chunk `c`.
        let first = job.skip_blocks.saturating_sub(c * bpc).min(bpc);
        let end = (job.skip_blocks + job.block_ids.len())
            .saturating_sub(c * bpc)
            .min(bpc);
        if first >= end {
            continue;
        }
        let ids =
            &job.block_ids[c * bpc + first - job.skip_blocks..c * bpc + end - job.skip_blocks];
        let slots: Vec<i64> = ids
            .iter()
            .flat_map(|&e| (0..bs).map(move |t| (e as usize * bs + t) as i64))
            .collect();
        match job.direction {
            CopyDirection::Load => {
                // SAFETY: the caller promised `ptr` addresses `chunk_bytes` bytes owned by the
                // worker for the job's life, read-only for a load.
                let data = unsafe { std::slice::from_raw_parts(ptr as *const u8, job.chunk_bytes) };
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
                        start: (c * bpc + first) * bs,
                        end: (c * bpc + end) * bs,
                        tokens: chunks * chunk_tokens,
                    });
                }
                // SAFETY: as above; a save's buffer is written by this job alone.
                let data =
                    unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, job.chunk_bytes) };
                kv.gather(&slots, data)?;
            }
        }
    }
    Ok(())
}
