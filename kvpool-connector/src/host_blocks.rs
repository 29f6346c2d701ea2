//! The engine side of [`CopyJob`]s for an engine whose KV lives in a [`HostPagedKvCache`]:
//! what the Python connector does with torch, done in Rust for the tests and the simulator.
//!
//! A [`HostPagedKvCache`] layer is `[planes, num_blocks, block_size, kv_heads, head_size]`, so
//! each (layer, plane) is one engine plane of `num_blocks` blocks, in the chunk order
//! [`CopyJob`] describes.

use kvpool_core::{HostPagedKvCache, KvTransfer, TransferError};

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
    let planes = layout.kind.planes();
    let bs = layout.block_size;
    let num_blocks = kv.num_slots() / bs;
    let plane_block = bs * layout.bytes_per_token_per_plane();
    let bpc = job.blocks_per_chunk;
    let expected = layout.num_layers * planes * bpc * plane_block;
    if job.chunk_bytes != expected {
        return Err(TransferError::BufferSize {
            actual: job.chunk_bytes,
            expected,
            tokens: bpc * bs,
        });
    }
    for (i, &block) in job.block_ids.iter().enumerate() {
        let e = block as usize;
        if e >= num_blocks {
            return Err(TransferError::SlotOutOfRange {
                slot: (e * bs) as i64,
                num_slots: num_blocks * bs,
            });
        }
        let cb = job.skip_blocks + i;
        let (c, b) = (cb / bpc, cb % bpc);
        let Some(&ptr) = job.chunk_ptrs.get(c) else {
            return Err(TransferError::TokenRange {
                start: cb * bs,
                end: (cb + 1) * bs,
                tokens: job.chunk_ptrs.len() * bpc * bs,
            });
        };
        for layer in 0..layout.num_layers {
            for p in 0..planes {
                let in_chunk = ((layer * planes + p) * bpc + b) * plane_block;
                let in_engine = (p * num_blocks + e) * plane_block;
                // SAFETY: the caller promised `ptr` addresses `chunk_bytes` bytes owned by the
                // worker for the job's life; `in_chunk + plane_block <= chunk_bytes` by the
                // size check above.
                let chunk = unsafe { (ptr as *mut u8).add(in_chunk) };
                let engine = &mut kv.layer_mut(layer)[in_engine..in_engine + plane_block];
                match job.direction {
                    CopyDirection::Load => {
                        // SAFETY: as above, read-only for a load.
                        let src = unsafe { std::slice::from_raw_parts(chunk, plane_block) };
                        engine.copy_from_slice(src);
                    }
                    CopyDirection::Save => {
                        // SAFETY: as above; a save's buffer is written by this job alone.
                        let dst = unsafe { std::slice::from_raw_parts_mut(chunk, plane_block) };
                        dst.copy_from_slice(engine);
                    }
                }
            }
        }
    }
    Ok(())
}
