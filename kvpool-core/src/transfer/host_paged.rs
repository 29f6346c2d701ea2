//! `HostPagedKvCache`: a paged KV cache in host memory, the [`KvTransfer`] of tests, benchmarks
//! and CPU engines.

use super::{ChunkWindow, KvTransfer, check_chunk_window};
use crate::error::TransferError;
use crate::layout::KvLayout;

/// A paged KV cache in host memory, laid out as vLLM's per-layer tensors
/// `[planes (2 for K/V, 1 for MLA), num_blocks, block_size, kv_heads, head_size]`.
///
/// Used by tests, benchmarks and CPU engines.
#[derive(Debug, Clone)]
pub struct HostPagedKvCache {
    layout: KvLayout,
    num_blocks: usize,
    layers: Vec<Vec<u8>>,
}

impl HostPagedKvCache {
    /// A zeroed cache of `num_blocks` pages.
    pub fn new(layout: KvLayout, num_blocks: usize) -> Self {
        let per_layer = layout.kind.planes()
            * num_blocks
            * layout.block_size
            * layout.bytes_per_token_per_plane();
        HostPagedKvCache {
            layout,
            num_blocks,
            layers: (0..layout.num_layers)
                .map(|_| vec![0u8; per_layer])
                .collect(),
        }
    }

    /// Total token slots.
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.layout.block_size
    }

    /// One layer's raw tensor bytes.
    pub fn layer(&self, layer: usize) -> &[u8] {
        &self.layers[layer]
    }

    /// One layer's raw tensor bytes, writable (to fill test data).
    pub fn layer_mut(&mut self, layer: usize) -> &mut [u8] {
        &mut self.layers[layer]
    }

    /// The bytes of one token row: `layer`, `plane`, `slot`.
    pub fn row(&self, layer: usize, plane: usize, slot: usize) -> &[u8] {
        let row = self.layout.bytes_per_token_per_plane();
        let at = (plane * self.num_slots() + slot) * row;
        &self.layers[layer][at..at + row]
    }

    /// One token row, writable (for engines and simulators that compute KV in place).
    pub fn row_mut(&mut self, layer: usize, plane: usize, slot: usize) -> &mut [u8] {
        let row = self.layout.bytes_per_token_per_plane();
        let at = (plane * self.num_slots() + slot) * row;
        &mut self.layers[layer][at..at + row]
    }

    fn slot_index(&self, slot: i64) -> Result<usize, TransferError> {
        let num_slots = self.num_slots();
        usize::try_from(slot)
            .ok()
            .filter(|&s| s < num_slots)
            .ok_or(TransferError::SlotOutOfRange { slot, num_slots })
    }
}

impl KvTransfer for HostPagedKvCache {
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
        let row = self.layout.bytes_per_token_per_plane();
        let planes = self.layout.kind.planes();
        let src = &self.layers[layer];
        for p in 0..planes {
            let region = (layer * planes + p) * n * row;
            let plane_base = p * self.num_slots() * row;
            for (t, &slot) in slots.iter().enumerate() {
                let s = self.slot_index(slot)?;
                let from = plane_base + s * row;
                let to = region + t * row;
                chunk[to..to + row].copy_from_slice(&src[from..from + row]);
            }
        }
        Ok(())
    }

    fn scatter_layer(
        &mut self,
        layer: usize,
        window: ChunkWindow<'_>,
    ) -> Result<(), TransferError> {
        window.check(&self.layout, layer)?;
        let ChunkWindow {
            data: chunk,
            chunk_tokens,
            token_offset,
            slots,
        } = window;
        // Validate every slot before writing anything: a failed scatter leaves the cache as it was.
        let indices: Vec<usize> = slots
            .iter()
            .map(|&s| self.slot_index(s))
            .collect::<Result<_, _>>()?;
        let row = self.layout.bytes_per_token_per_plane();
        let planes = self.layout.kind.planes();
        let num_slots = self.num_slots();
        let dst = &mut self.layers[layer];
        for p in 0..planes {
            let region = (layer * planes + p) * chunk_tokens * row;
            let plane_base = p * num_slots * row;
            for (i, &s) in indices.iter().enumerate() {
                let from = region + (token_offset + i) * row;
                let to = plane_base + s * row;
                dst[to..to + row].copy_from_slice(&chunk[from..from + row]);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Dtype, KvKind};

    fn filled(layout: KvLayout, blocks: usize, seed: u8) -> HostPagedKvCache {
        let mut c = HostPagedKvCache::new(layout, blocks);
        for l in 0..layout.num_layers {
            for (i, b) in c.layer_mut(l).iter_mut().enumerate() {
                *b = (i as u8)
                    .wrapping_mul(31)
                    .wrapping_add(seed)
                    .wrapping_add(l as u8 * 7);
            }
        }
        c
    }

    #[test]
    fn gather_then_scatter_moves_exact_rows_to_new_slots() {
        for kind in [KvKind::KeyValue, KvKind::MlaLatent] {
            let layout = KvLayout::new(3, 2, 4, Dtype::F16, kind, 4).unwrap();
            let src = filled(layout, 4, 1);
            let slots = [5i64, 0, 15, 7];
            let mut chunk = vec![0u8; layout.chunk_bytes(4)];
            src.gather(&slots, &mut chunk).unwrap();
            let mut dst = HostPagedKvCache::new(layout, 4);
            let new_slots = [1i64, 2, 3, 4];
            dst.scatter(ChunkWindow::whole(&chunk, &new_slots)).unwrap();
            for l in 0..3 {
                for p in 0..kind.planes() {
                    for (a, b) in slots.iter().zip(new_slots) {
                        assert_eq!(src.row(l, p, *a as usize), dst.row(l, p, b as usize));
                    }
                }
            }
            // Slots not written stay zero.
            assert!(dst.row(0, 0, 0).iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn partial_scatter_writes_only_the_window() {
        let layout = KvLayout::new(1, 1, 2, Dtype::F32, KvKind::KeyValue, 2).unwrap();
        let src = filled(layout, 2, 9);
        let mut chunk = vec![0u8; layout.chunk_bytes(4)];
        src.gather(&[0, 1, 2, 3], &mut chunk).unwrap();
        let mut dst = HostPagedKvCache::new(layout, 2);
        dst.scatter(ChunkWindow {
            data: &chunk,
            chunk_tokens: 4,
            token_offset: 2,
            slots: &[2, 3],
        })
        .unwrap();
        assert_eq!(dst.row(0, 1, 3), src.row(0, 1, 3));
        assert!(dst.row(0, 0, 0).iter().all(|&b| b == 0));
        assert!(dst.row(0, 1, 1).iter().all(|&b| b == 0));
    }

    #[test]
    fn bad_slots_and_sizes_are_errors_and_change_nothing() {
        let layout = KvLayout::new(1, 1, 2, Dtype::F16, KvKind::KeyValue, 2).unwrap();
        let mut c = HostPagedKvCache::new(layout, 2);
        let chunk = vec![1u8; layout.chunk_bytes(2)];
        assert!(matches!(
            c.scatter(ChunkWindow {
                data: &chunk,
                chunk_tokens: 2,
                token_offset: 0,
                slots: &[0, -1]
            }),
            Err(TransferError::SlotOutOfRange { slot: -1, .. })
        ));
        assert!(c.layer(0).iter().all(|&b| b == 0));
        assert!(matches!(
            c.scatter(ChunkWindow {
                data: &chunk,
                chunk_tokens: 2,
                token_offset: 0,
                slots: &[0, 4]
            }),
            Err(TransferError::SlotOutOfRange { .. })
        ));
        assert!(matches!(
            c.scatter(ChunkWindow {
                data: &chunk[1..],
                chunk_tokens: 2,
                token_offset: 0,
                slots: &[0, 1]
            }),
            Err(TransferError::BufferSize { .. })
        ));
        assert!(matches!(
            c.scatter(ChunkWindow {
                data: &chunk,
                chunk_tokens: 2,
                token_offset: 1,
                slots: &[0, 1]
            }),
            Err(TransferError::TokenRange { .. })
        ));
        let mut out = vec![0u8; layout.chunk_bytes(2)];
        assert!(matches!(
            c.gather_layer(1, &[0, 1], &mut out),
            Err(TransferError::LayerOutOfRange { .. })
        ));
    }
}
