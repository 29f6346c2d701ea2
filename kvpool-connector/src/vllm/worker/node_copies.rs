//! Loads copied once from node memory: where a load's chunks come from (this process's memory,
//! or the node's pool daemon's shared memory where they lie), and the check of a copy made
//! straight into the engine's blocks, which the worker reads in host memory ([`HostPlanes`]).
//!
//! A chunk lent where it lies ([`SharedChunk`]) is copied by the engine side like any other,
//! then checked here on the engine's blocks, memory no other process writes: its blocks'
//! bytes, in the chunk's byte order, must hash to the checksum of the header copied before
//! the copy. A copy that fails is reported as failed blocks (vLLM recomputes them, and drops
//! what the step computed from them), never used as KV. A save copied straight into node
//! memory is sealed the same way round: its checksum is hashed from the blocks it came from.

use kvpool_core::{Chunk, ChunkMeta, ChunkSpan, KvTransfer, MemoryObj, SaveSlot, SharedChunk};

use crate::vllm::leases::LeasedChunk;

/// The engine's KV blocks in host memory, as the worker reads them to check a copy: one
/// `(address of block 0, bytes from one block to the next)` per plane, in the chunk layout's
/// plane order (every layer's planes in layer order), each block `plane_block_bytes` long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPlanes {
    planes: Vec<(usize, usize)>,
    plane_block_bytes: usize,
    num_blocks: usize,
}

impl HostPlanes {
    /// Planes at the given `(address, row stride)`, of `num_blocks` blocks of
    /// `plane_block_bytes` each; refused when a plane starts at null, its blocks overlap
    /// (a stride shorter than a block), or its last block ends past the address space.
    ///
    /// # Safety
    ///
    /// Every block of every plane must stay mapped and readable for as long as the worker it
    /// is given to lives (the engine's KV tensors, registered for the worker's lifetime).
    pub unsafe fn new(
        planes: Vec<(usize, usize)>,
        plane_block_bytes: usize,
        num_blocks: usize,
    ) -> Result<Self, crate::address_range::AddressRangeError> {
        for &(base, stride) in &planes {
            if stride < plane_block_bytes {
                return Err(crate::address_range::AddressRangeError {
                    what: "a host KV plane",
                    reason: format!(
                        "blocks of {plane_block_bytes} bytes overlap at a stride of {stride}"
                    ),
                });
            }
            crate::address_range::strided_range_end(
                "a host KV plane",
                base,
                num_blocks,
                stride,
                plane_block_bytes,
            )?;
        }
        Ok(HostPlanes {
            planes,
            plane_block_bytes,
            num_blocks,
        })
    }

    /// The planes of a [`kvpool_core::HostPagedKvCache`] (tests and the simulator).
    ///
    /// # Safety
    ///
    /// `kv` must outlive the worker the planes are given to, and not move.
    pub unsafe fn of_host_cache(kv: &kvpool_core::HostPagedKvCache) -> Self {
        let layout = kv.layout();
        let per_plane = layout.block_size * layout.bytes_per_token_per_plane();
        let planes_per_layer = layout.kind.planes();
        let num_blocks = kv.num_slots() / layout.block_size;
        let planes = (0..layout.num_layers)
            .flat_map(|l| {
                let base = kv.layer(l).as_ptr() as usize;
                (0..planes_per_layer).map(move |p| (base + p * num_blocks * per_plane, per_plane))
            })
            .collect();
        HostPlanes {
            planes,
            plane_block_bytes: per_plane,
            num_blocks,
        }
    }

    /// Bytes of one block, every plane.
    pub fn block_bytes(&self) -> usize {
        self.planes.len() * self.plane_block_bytes
    }

    /// The bytes of `blocks` (engine block ids) in a chunk's byte order: plane by plane, each
    /// plane's blocks in order. `None` if a block is out of range.
    fn chunk_pieces<'a>(&'a self, blocks: &'a [u32]) -> Option<Vec<&'a [u8]>> {
        if blocks.iter().any(|&b| b as usize >= self.num_blocks) {
            return None;
        }
        Some(
            self.planes
                .iter()
                .flat_map(|&(base, stride)| {
                    blocks.iter().map(move |&b| {
                        // SAFETY: `new`'s caller promised every block of every plane stays
                        // mapped; `b` is in range, as checked.
                        unsafe {
                            std::slice::from_raw_parts(
                                (base + b as usize * stride) as *const u8,
                                self.plane_block_bytes,
                            )
                        }
                    })
                })
                .collect(),
        )
    }

    /// Seals `slot`, into which a save copied `blocks` (in chunk order): its header says
    /// `meta`, with a checksum hashed from the blocks, memory no other process writes.
    pub(crate) fn seal(
        &self,
        slot: &mut SaveSlot,
        meta: &ChunkMeta,
        blocks: &[u32],
    ) -> Result<(), String> {
        let pieces = self.chunk_pieces(blocks).ok_or_else(|| {
            format!(
                "a block of {blocks:?} is past the engine's {}",
                self.num_blocks
            )
        })?;
        slot.seal(meta, pieces).map_err(|e| e.to_string())
    }

    /// Checks the copy of `chunk` in `blocks` (the engine blocks it was copied into, in chunk
    /// order).
    pub(crate) fn check(&self, chunk: &SharedChunk, blocks: &[u32]) -> Result<(), String> {
        let pieces = self.chunk_pieces(blocks).ok_or_else(|| {
            format!(
                "a block of {blocks:?} is past the engine's {}",
                self.num_blocks
            )
        })?;
        chunk.verify_copy(pieces).map_err(|e| e.to_string())
    }
}

/// One chunk a load copies into the engine's blocks.
#[derive(Debug)]
pub(crate) enum LoadSource {
    /// In this process's memory, checked.
    Memory(MemoryObj),
    /// Lent where it lies in node memory: the copy is checked in the engine's blocks.
    Shared(SharedChunk),
}

impl LoadSource {
    pub(crate) fn address(&self) -> usize {
        match self {
            LoadSource::Memory(m) => m.as_slice().as_ptr() as usize,
            LoadSource::Shared(c) => c.payload_ptr(),
        }
    }
}

/// What a load's fetch brought, in span order: the longest prefix of its spans it could.
#[derive(Debug, Default)]
pub(crate) struct LoadSources {
    pub(crate) chunks: Vec<LoadSource>,
    /// The tier that served each.
    pub(crate) tiers: Vec<String>,
}

impl LoadSources {
    fn push_fetched(&mut self, fetched: kvpool_core::FetchedChunks) {
        for (chunk, tier) in fetched.chunks.into_iter().zip(fetched.tiers) {
            self.chunks.push(LoadSource::Memory(chunk.data));
            self.tiers.push(tier);
        }
    }
}

/// Fetches `spans`: the lease's chunks in this process's memory first, then those it holds
/// where they lie in node memory (each still usable and of the span's size, layout and
/// dtype), then the rest from the tiers. Stops at the first chunk it cannot bring.
pub(crate) async fn fetch_load(
    engine: &kvpool_core::CacheEngine,
    spans: &[ChunkSpan],
    leased: Vec<LeasedChunk>,
) -> LoadSources {
    let mut held: Vec<Chunk> = Vec::new();
    let mut shared = Vec::new();
    for c in leased {
        match c {
            LeasedChunk::Held(c) if shared.is_empty() => held.push(c),
            LeasedChunk::Shared { chunk, tier } => shared.push((chunk, tier)),
            // The lookup leases L1's chunks, then node memory's; nothing else is expected.
            LeasedChunk::Held(_) => break,
        }
    }
    let mut out = LoadSources::default();
    if shared.is_empty() {
        out.push_fetched(engine.fetch_spans(spans, held).await);
        return out;
    }
    let in_memory = held.len().min(spans.len());
    out.push_fetched(engine.fetch_spans(&spans[..in_memory], held).await);
    if out.chunks.len() < in_memory {
        return out;
    }
    for (span, (chunk, tier)) in spans[in_memory..].iter().zip(shared) {
        if !chunk.usable() {
            tracing::debug!(key = %span.key, "a chunk lent by node memory is past its time; fetching the rest");
            break;
        }
        if let Err(e) = engine.validate_meta(span, &chunk.meta, chunk.payload_len()) {
            tracing::warn!(key = %span.key, error = %e, "rejecting a chunk lent by node memory");
            break;
        }
        out.chunks.push(LoadSource::Shared(chunk));
        out.tiers.push(tier);
    }
    let done = out.chunks.len();
    if done < spans.len() {
        out.push_fetched(engine.fetch_spans(&spans[done..], Vec::new()).await);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two planes of four blocks of 8 bytes, rows 16 bytes apart (padded, as vLLM's pages can
    /// be); block `b` of plane `p` holds the byte `p * 10 + b`.
    fn planes(memory: &mut Vec<u8>) -> HostPlanes {
        *memory = vec![0xee; 2 * 4 * 16];
        for p in 0..2 {
            for b in 0..4 {
                let at = p * 64 + b * 16;
                memory[at..at + 8].fill((p * 10 + b) as u8);
            }
        }
        let base = memory.as_ptr() as usize;
        // SAFETY: `memory` outlives the planes in each test and is not resized.
        unsafe { HostPlanes::new(vec![(base, 16), (base + 64, 16)], 8, 4) }.unwrap()
    }

    #[test]
    fn a_chunks_bytes_are_read_plane_by_plane_then_block_by_block_skipping_row_padding() {
        let mut memory = Vec::new();
        let planes = planes(&mut memory);
        assert_eq!(planes.block_bytes(), 16);
        let pieces = planes.chunk_pieces(&[3, 1]).unwrap();
        let bytes: Vec<u8> = pieces.concat();
        let expected: Vec<u8> = [3u8, 1, 13, 11]
            .iter()
            .flat_map(|&v| std::iter::repeat_n(v, 8))
            .collect();
        assert_eq!(bytes, expected);
    }

    #[test]
    fn a_block_past_the_planes_is_refused_never_read() {
        let mut memory = Vec::new();
        let planes = planes(&mut memory);
        assert!(planes.chunk_pieces(&[0, 4]).is_none());
        assert!(planes.chunk_pieces(&[u32::MAX]).is_none());
    }
}
