//! `BlockKvCache`: a paged KV cache in memory the engine owns, moved as whole opaque blocks.
//!
//! vLLM's CPU backend keeps one contiguous tensor per layer, `[num_blocks, ...]`, whose
//! inner order (head-major, K possibly transposed) depends on the CPU's instruction set. kvpool
//! does not interpret those bytes: a chunk of `n` tokens holds, for each layer, the raw bytes of
//! its `n / block_size` blocks in token order. Store and load use the same transfer, so the
//! bytes round-trip exactly; the key scope carries a tag of the engine's layout so two
//! layouts never share chunks.

use crate::error::TransferError;
use crate::layout::KvLayout;
use crate::transfer::{KvTransfer, check_chunk_window};

/// One layer's paged KV tensor: its first byte and its length, `num_blocks * block_bytes`.
#[derive(Debug, Clone, Copy)]
struct LayerRegion {
    base: *mut u8,
    len: usize,
}

/// A paged KV cache in host memory owned by someone else (e.g. vLLM's CPU KV tensors),
/// moved one whole engine block at a time.
///
/// A block of one layer is `layout.block_size * layout.bytes_per_token_per_layer()` contiguous
/// bytes at `base + block_id * block_bytes`. Transfers must cover whole blocks: a chunk's
/// token window starts and ends on block boundaries and its slots are the slots of those
/// blocks in order (`block_id * block_size + 0, 1, ...`). Anything else is a
/// [`TransferError::NotWholeBlocks`], never a partial copy.
#[derive(Debug)]
pub struct BlockKvCache {
    layout: KvLayout,
    num_blocks: usize,
    block_bytes: usize,
    layers: Vec<LayerRegion>,
}

// SAFETY: the regions are plain bytes; the creator of the cache promised in `from_raw_parts`
// that they stay valid while it lives and that concurrent access is coordinated by the engine
// (vLLM does not touch a block while the connector moves it).
unsafe impl Send for BlockKvCache {}
// SAFETY: as above; `&self` methods only read the regions.
unsafe impl Sync for BlockKvCache {}

impl BlockKvCache {
    /// Wraps per-layer tensors, one base pointer per layer of `layout`, each
    /// `num_blocks * block_size * layout.bytes_per_token_per_layer()` bytes long.
    ///
    /// # Safety
    ///
    /// Every pointer must be valid for reads and writes of that many bytes for as long as the
    /// returned cache (or anything holding it) is used, and nothing else may write a block
    /// while this cache reads or writes it.
    pub unsafe fn from_raw_parts(
        layout: KvLayout,
        num_blocks: usize,
        layer_bases: &[*mut u8],
    ) -> Result<Self, TransferError> {
        if layer_bases.len() != layout.num_layers {
            return Err(TransferError::LayerOutOfRange {
                layer: layer_bases.len(),
                layers: layout.num_layers,
            });
        }
        let block_bytes = layout.block_size * layout.bytes_per_token_per_layer();
        let len = num_blocks
            .checked_mul(block_bytes)
            .ok_or(TransferError::BufferSize {
                actual: usize::MAX,
                expected: block_bytes,
                tokens: layout.block_size,
            })?;
        if layer_bases.iter().any(|p| p.is_null()) {
            return Err(TransferError::Device(
                "a layer's KV tensor pointer is null".into(),
            ));
        }
        Ok(BlockKvCache {
            layout,
            num_blocks,
            block_bytes,
            layers: layer_bases
                .iter()
                .map(|&base| LayerRegion { base, len })
                .collect(),
        })
    }

    /// Engine blocks per layer.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Bytes of one block of one layer.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// One block of one layer, read-only (e.g. to compare with what the pool stored).
    pub fn block(&self, layer: usize, block_id: usize) -> Option<&[u8]> {
        let region = self.layers.get(layer)?;
        if block_id >= self.num_blocks {
            return None;
        }
        // SAFETY: in bounds of a region the caller of `from_raw_parts` vouched for.
        Some(unsafe {
            std::slice::from_raw_parts(
                region.base.add(block_id * self.block_bytes),
                self.block_bytes,
            )
        })
    }

    /// The block ids of `slots` (one per token of a window starting `start` tokens into a
    /// chunk), checking they are whole blocks in order.
    fn blocks_of(&self, start: usize, slots: &[i64]) -> Result<Vec<usize>, TransferError> {
        let bs = self.layout.block_size;
        let end = start + slots.len();
        let fail = |reason: String| TransferError::NotWholeBlocks {
            start,
            end,
            block_size: bs,
            reason,
        };
        if !start.is_multiple_of(bs) || !slots.len().is_multiple_of(bs) {
            return Err(fail(
                "the window does not start and end on a block boundary".into(),
            ));
        }
        let mut blocks = Vec::with_capacity(slots.len() / bs);
        for group in slots.chunks(bs) {
            let first = group[0];
            if first < 0 || first as usize / bs >= self.num_blocks {
                return Err(TransferError::SlotOutOfRange {
                    slot: first,
                    num_slots: self.num_blocks * bs,
                });
            }
            let first = first as usize;
            if !first.is_multiple_of(bs) {
                return Err(fail(format!("slot {first} does not start a block")));
            }
            if group
                .iter()
                .enumerate()
                .any(|(i, &s)| s != (first + i) as i64)
            {
                return Err(fail(format!(
                    "the slots of block {} are not consecutive",
                    first / bs
                )));
            }
            blocks.push(first / bs);
        }
        Ok(blocks)
    }
}

impl KvTransfer for BlockKvCache {
    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn gather_layer(
        &self,
        layer: usize,
        slots: &[i64],
        chunk: &mut [u8],
    ) -> Result<(), TransferError> {
        let n = slots.len();
        check_chunk_window(&self.layout, layer, chunk.len(), n, 0, n)?;
        let blocks = self.blocks_of(0, slots)?;
        let per_layer = n * self.layout.bytes_per_token_per_layer();
        let dst = &mut chunk[layer * per_layer..(layer + 1) * per_layer];
        let region = self.layers[layer];
        for (i, b) in blocks.into_iter().enumerate() {
            debug_assert!((b + 1) * self.block_bytes <= region.len);
            // SAFETY: `b < num_blocks` (checked in `blocks_of`), so the block lies inside the
            // region; `dst` is a distinct Rust buffer.
            let src = unsafe {
                std::slice::from_raw_parts(region.base.add(b * self.block_bytes), self.block_bytes)
            };
            dst[i * self.block_bytes..(i + 1) * self.block_bytes].copy_from_slice(src);
        }
        Ok(())
    }

    fn scatter_layer(
        &mut self,
        layer: usize,
        chunk: &[u8],
        chunk_tokens: usize,
        token_offset: usize,
        slots: &[i64],
    ) -> Result<(), TransferError> {
        check_chunk_window(
            &self.layout,
            layer,
            chunk.len(),
            chunk_tokens,
            token_offset,
            slots.len(),
        )?;
        let blocks = self.blocks_of(token_offset, slots)?;
        let per_layer = chunk_tokens * self.layout.bytes_per_token_per_layer();
        let src_layer = &chunk[layer * per_layer..(layer + 1) * per_layer];
        let first_block = token_offset / self.layout.block_size;
        let region = self.layers[layer];
        for (i, b) in blocks.into_iter().enumerate() {
            let src = &src_layer
                [(first_block + i) * self.block_bytes..(first_block + i + 1) * self.block_bytes];
            // SAFETY: `b < num_blocks`, so the block lies inside the region, which the caller
            // of `from_raw_parts` vouched is writable and not aliased by `chunk`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.as_ptr(),
                    region.base.add(b * self.block_bytes),
                    self.block_bytes,
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Dtype, KvKind};

    fn layout() -> KvLayout {
        KvLayout::new(2, 2, 4, Dtype::F32, KvKind::KeyValue, 4).unwrap()
    }

    fn filled(layers: usize, bytes: usize) -> Vec<Vec<u8>> {
        (0..layers)
            .map(|l| (0..bytes).map(|i| (i * 7 + l * 131) as u8).collect())
            .collect()
    }

    fn cache(buffers: &mut [Vec<u8>], num_blocks: usize) -> BlockKvCache {
        let bases: Vec<*mut u8> = buffers.iter_mut().map(|b| b.as_mut_ptr()).collect();
        // SAFETY: the buffers outlive the cache in every test.
        unsafe { BlockKvCache::from_raw_parts(layout(), num_blocks, &bases).unwrap() }
    }

    #[test]
    fn blocks_round_trip_exactly_into_other_blocks() {
        let l = layout();
        let block_bytes = l.block_size * l.bytes_per_token_per_layer();
        let mut src = filled(2, 8 * block_bytes);
        let mut dst = vec![vec![0u8; 8 * block_bytes]; 2];
        let src_cache = cache(&mut src, 8);
        let mut dst_cache = cache(&mut dst, 8);
        // Blocks 5 and 2 (in that order) make an 8-token chunk.
        let slots: Vec<i64> = (20..24).chain(8..12).collect();
        let mut chunk = vec![0u8; l.chunk_bytes(8)];
        src_cache.gather(&slots, &mut chunk).unwrap();
        // Load the chunk's second block only, into block 7.
        let slots_out: Vec<i64> = (28..32).collect();
        dst_cache.scatter(&chunk, 8, 4, &slots_out).unwrap();
        for layer in 0..2 {
            assert_eq!(
                dst_cache.block(layer, 7).unwrap(),
                src_cache.block(layer, 2).unwrap()
            );
            assert!(dst_cache.block(layer, 5).unwrap().iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn partial_blocks_and_scrambled_slots_are_refused() {
        let l = layout();
        let block_bytes = l.block_size * l.bytes_per_token_per_layer();
        let mut src = filled(2, 4 * block_bytes);
        let mut c = cache(&mut src, 4);
        let mut chunk = vec![0u8; l.chunk_bytes(4)];
        let not_aligned: Vec<i64> = (1..5).collect();
        assert!(matches!(
            c.gather(&not_aligned, &mut chunk),
            Err(TransferError::NotWholeBlocks { .. })
        ));
        let scrambled = [4, 6, 5, 7];
        assert!(c.gather(&scrambled, &mut chunk).is_err());
        let out_of_range: Vec<i64> = (16..20).collect();
        assert!(matches!(
            c.gather(&out_of_range, &mut chunk),
            Err(TransferError::SlotOutOfRange { .. })
        ));
        let chunk8 = vec![0u8; l.chunk_bytes(8)];
        let half: Vec<i64> = (0..2).collect();
        assert!(c.scatter(&chunk8, 8, 2, &half).is_err());
    }
}
