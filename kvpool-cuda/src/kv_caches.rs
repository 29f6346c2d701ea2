//! Registration of an engine's paged KV caches: per-layer device pointers, validated against a
//! [`KvLayout`], and the address arithmetic the kernels share with their CPU mirror.

use kvpool_core::{Dtype, KvKind, KvLayout};

use crate::error::CudaError;

/// How an engine orders one layer's paged KV tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PagedOrder {
    /// vLLM's flash-attention backend: `[2, num_blocks, block_size, kv_heads, head_size]`.
    FlashAttention,
    /// FlashInfer: `[num_blocks, 2, block_size, kv_heads, head_size]`.
    FlashInfer,
    /// Multi-head latent attention: `[num_blocks, block_size, latent_dim]`.
    Mla,
}

/// One layer's KV tensor on the device, as the engine reports it (e.g. from a PyTorch tensor's
/// `data_ptr()`, `shape` and `dtype`). The tensor must be contiguous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceLayer {
    /// Device address of element 0.
    pub ptr: u64,
    /// The tensor's shape.
    pub shape: Vec<usize>,
    /// The element type.
    pub dtype: Dtype,
}

/// Where a token row lives in one layer's tensor, in units of rows of
/// `kv_heads * head_size` elements: `block * block_stride + plane * plane_stride + offset`.
/// The gather/scatter kernels compute exactly this; [`PagedGeometry::row_offset`] is their CPU
/// mirror.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedGeometry {
    /// Bytes of one row.
    pub row_bytes: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Rows between consecutive blocks.
    pub block_stride_rows: usize,
    /// Rows between the K and V planes (0 for MLA).
    pub plane_stride_rows: usize,
    /// 2 (K, V) or 1 (MLA latent).
    pub planes: usize,
    /// Blocks in each layer.
    pub num_blocks: usize,
}

impl PagedGeometry {
    /// The geometry of `order` for `layout` with `num_blocks` blocks.
    pub fn new(order: PagedOrder, layout: &KvLayout, num_blocks: usize) -> Self {
        let bs = layout.block_size;
        let (block_stride_rows, plane_stride_rows) = match order {
            PagedOrder::FlashAttention => (bs, num_blocks * bs),
            PagedOrder::FlashInfer => (2 * bs, bs),
            PagedOrder::Mla => (bs, 0),
        };
        PagedGeometry {
            row_bytes: layout.bytes_per_token_per_plane(),
            block_size: bs,
            block_stride_rows,
            plane_stride_rows,
            planes: layout.kind.planes(),
            num_blocks,
        }
    }

    /// Token slots in each layer.
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Byte offset of `slot`'s row in `plane` from the start of a layer's tensor.
    pub fn row_offset(&self, slot: usize, plane: usize) -> usize {
        let (block, offset) = (slot / self.block_size, slot % self.block_size);
        (block * self.block_stride_rows + plane * self.plane_stride_rows + offset) * self.row_bytes
    }

    /// Bytes of one layer's tensor.
    pub fn layer_bytes(&self) -> usize {
        self.num_slots() * self.planes * self.row_bytes
    }
}

/// An engine's KV caches, checked against the layout kvpool stores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredKvCaches {
    layout: KvLayout,
    order: PagedOrder,
    geometry: PagedGeometry,
    layer_ptrs: Vec<u64>,
}

fn reject(reason: String) -> CudaError {
    CudaError::Registration(reason)
}

impl RegisteredKvCaches {
    /// Validates `layers` (one per model layer, in order) against `layout` and `order`. A shape
    /// that contradicts the layout is rejected, never guessed around.
    pub fn new(
        layout: KvLayout,
        order: PagedOrder,
        layers: &[DeviceLayer],
    ) -> Result<Self, CudaError> {
        layout
            .validate()
            .map_err(|e| reject(format!("invalid layout: {e}")))?;
        if layers.len() != layout.num_layers {
            return Err(reject(format!(
                "{} layer tensors for a layout of {} layers",
                layers.len(),
                layout.num_layers
            )));
        }
        match (order, layout.kind) {
            (PagedOrder::Mla, KvKind::KeyValue) => {
                return Err(reject(
                    "MLA tensors registered for a key/value layout".into(),
                ));
            }
            (PagedOrder::FlashAttention | PagedOrder::FlashInfer, KvKind::MlaLatent) => {
                return Err(reject(format!(
                    "{order:?} (key/value) tensors registered for an MLA layout"
                )));
            }
            _ => {}
        }
        let (bs, heads, head) = (layout.block_size, layout.num_kv_heads, layout.head_size);
        let mut num_blocks = None;
        for (i, layer) in layers.iter().enumerate() {
            if layer.ptr == 0 {
                return Err(reject(format!("layer {i}: null device pointer")));
            }
            if layer.dtype != layout.dtype {
                return Err(reject(format!(
                    "layer {i}: dtype {:?}, the layout says {:?}",
                    layer.dtype, layout.dtype
                )));
            }
            let shape = layer.shape.as_slice();
            let blocks = match (order, shape) {
                (PagedOrder::FlashAttention, [2, nb, b, h, d])
                    if (*b, *h, *d) == (bs, heads, head) =>
                {
                    *nb
                }
                (PagedOrder::FlashInfer, [nb, 2, b, h, d]) if (*b, *h, *d) == (bs, heads, head) => {
                    *nb
                }
                (PagedOrder::Mla, [nb, b, d]) if (*b, *d) == (bs, head) && heads == 1 => *nb,
                _ => {
                    let expected = match order {
                        PagedOrder::FlashAttention => {
                            format!("[2, num_blocks, {bs}, {heads}, {head}]")
                        }
                        PagedOrder::FlashInfer => format!("[num_blocks, 2, {bs}, {heads}, {head}]"),
                        PagedOrder::Mla if heads != 1 => {
                            "an MLA layout with num_kv_heads = 1".to_string()
                        }
                        PagedOrder::Mla => format!("[num_blocks, {bs}, {head}]"),
                    };
                    return Err(reject(format!(
                        "layer {i}: shape {shape:?} does not match {order:?} for this layout, \
                         expected {expected}"
                    )));
                }
            };
            if blocks == 0 {
                return Err(reject(format!("layer {i}: zero blocks")));
            }
            match num_blocks {
                None => num_blocks = Some(blocks),
                Some(n) if n != blocks => {
                    return Err(reject(format!(
                        "layer {i} has {blocks} blocks, layer 0 has {n}"
                    )));
                }
                Some(_) => {}
            }
        }
        let num_blocks = num_blocks.unwrap_or(0);
        Ok(RegisteredKvCaches {
            layout,
            order,
            geometry: PagedGeometry::new(order, &layout, num_blocks),
            layer_ptrs: layers.iter().map(|l| l.ptr).collect(),
        })
    }

    /// The layout kvpool stores.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The engine's tensor order.
    pub fn order(&self) -> PagedOrder {
        self.order
    }

    /// Row addressing inside each layer.
    pub fn geometry(&self) -> &PagedGeometry {
        &self.geometry
    }

    /// Device address of each layer's tensor.
    pub fn layer_ptrs(&self) -> &[u64] {
        &self.layer_ptrs
    }

    /// Whether every row can move in 16-byte accesses (rows a multiple of 16 bytes and every
    /// layer 16-byte aligned).
    pub fn rows_are_16_byte_aligned(&self) -> bool {
        self.geometry.row_bytes.is_multiple_of(16) && self.layer_ptrs.iter().all(|p| p % 16 == 0)
    }
}

#[cfg(test)]
mod tests {
    use kvpool_core::{HostPagedKvCache, KvTransfer};

    use super::*;

    fn kv_layout() -> KvLayout {
        KvLayout::new(2, 4, 8, Dtype::Bf16, KvKind::KeyValue, 16).unwrap()
    }

    fn mla_layout() -> KvLayout {
        KvLayout::new(2, 1, 64, Dtype::Bf16, KvKind::MlaLatent, 16).unwrap()
    }

    fn layers(shape: &[usize], n: usize) -> Vec<DeviceLayer> {
        (0..n)
            .map(|i| DeviceLayer {
                ptr: 0x7f00_0000_0000 + (i as u64) * (1 << 30),
                shape: shape.to_vec(),
                dtype: Dtype::Bf16,
            })
            .collect()
    }

    #[test]
    fn the_three_engine_orders_register() {
        let fa = RegisteredKvCaches::new(
            kv_layout(),
            PagedOrder::FlashAttention,
            &layers(&[2, 10, 16, 4, 8], 2),
        )
        .unwrap();
        assert_eq!(fa.geometry().num_blocks, 10);
        assert!(fa.rows_are_16_byte_aligned());
        let fi = RegisteredKvCaches::new(
            kv_layout(),
            PagedOrder::FlashInfer,
            &layers(&[10, 2, 16, 4, 8], 2),
        )
        .unwrap();
        assert_eq!(fi.geometry().layer_bytes(), fa.geometry().layer_bytes());
        let mla = RegisteredKvCaches::new(mla_layout(), PagedOrder::Mla, &layers(&[7, 16, 64], 2))
            .unwrap();
        assert_eq!(mla.geometry().num_slots(), 7 * 16);
        assert_eq!(mla.geometry().planes, 1);
    }

    #[test]
    fn shapes_that_contradict_the_layout_are_rejected() {
        let cases: Vec<(KvLayout, PagedOrder, Vec<DeviceLayer>, &str)> = vec![
            (
                kv_layout(),
                PagedOrder::FlashAttention,
                layers(&[2, 10, 16, 4, 8], 3),
                "3 layer tensors",
            ),
            (
                kv_layout(),
                PagedOrder::FlashAttention,
                layers(&[10, 2, 16, 4, 8], 2),
                "does not match",
            ),
            (
                kv_layout(),
                PagedOrder::FlashInfer,
                layers(&[2, 10, 16, 4, 8], 2),
                "does not match",
            ),
            (
                kv_layout(),
                PagedOrder::FlashAttention,
                layers(&[2, 10, 32, 4, 8], 2),
                "expected [2, num_blocks, 16, 4, 8]",
            ),
            (
                kv_layout(),
                PagedOrder::FlashAttention,
                layers(&[2, 10, 16, 8, 4], 2),
                "does not match",
            ),
            (
                kv_layout(),
                PagedOrder::FlashAttention,
                layers(&[2, 0, 16, 4, 8], 2),
                "zero blocks",
            ),
            (
                kv_layout(),
                PagedOrder::Mla,
                layers(&[10, 16, 8], 2),
                "MLA tensors registered for a key/value layout",
            ),
            (
                mla_layout(),
                PagedOrder::FlashAttention,
                layers(&[2, 10, 16, 1, 64], 2),
                "for an MLA layout",
            ),
            (
                mla_layout(),
                PagedOrder::Mla,
                layers(&[10, 16, 32], 2),
                "expected [num_blocks, 16, 64]",
            ),
        ];
        for (layout, order, layers, needle) in cases {
            let err = RegisteredKvCaches::new(layout, order, &layers)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(needle),
                "{order:?} {:?}: {err}",
                layers[0].shape
            );
        }
        let mut mixed = layers(&[2, 10, 16, 4, 8], 2);
        mixed[1].shape[1] = 11;
        let err = RegisteredKvCaches::new(kv_layout(), PagedOrder::FlashAttention, &mixed)
            .unwrap_err()
            .to_string();
        assert!(err.contains("layer 1 has 11 blocks"), "{err}");
        let mut wrong_dtype = layers(&[2, 10, 16, 4, 8], 2);
        wrong_dtype[0].dtype = Dtype::F16;
        assert!(
            RegisteredKvCaches::new(kv_layout(), PagedOrder::FlashAttention, &wrong_dtype)
                .unwrap_err()
                .to_string()
                .contains("dtype")
        );
        let mut null = layers(&[2, 10, 16, 4, 8], 2);
        null[1].ptr = 0;
        assert!(
            RegisteredKvCaches::new(kv_layout(), PagedOrder::FlashAttention, &null)
                .unwrap_err()
                .to_string()
                .contains("null")
        );
    }

    /// The kernels' address arithmetic, mirrored on the CPU, agrees with the foundation's host
    /// cache (the oracle) for the flash-attention order.
    #[test]
    fn flash_attention_geometry_matches_the_host_cache() {
        let layout = kv_layout();
        let blocks = 10;
        let mut host = HostPagedKvCache::new(layout, blocks);
        for (i, b) in host.layer_mut(1).iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
        let geometry = PagedGeometry::new(PagedOrder::FlashAttention, &layout, blocks);
        assert_eq!(geometry.layer_bytes(), host.layer(1).len());
        for slot in [0usize, 1, 15, 16, 17, 159] {
            for plane in 0..2 {
                let at = geometry.row_offset(slot, plane);
                assert_eq!(
                    &host.layer(1)[at..at + geometry.row_bytes],
                    host.row(1, plane, slot),
                    "slot {slot} plane {plane}"
                );
            }
        }
        assert_eq!(KvTransfer::layout(&host), &layout);
    }

    #[test]
    fn flashinfer_and_mla_geometry_by_hand() {
        let g = PagedGeometry::new(PagedOrder::FlashInfer, &kv_layout(), 10);
        let row = 4 * 8 * 2;
        // Block 1, V plane, offset 3: rows before it are block 0 (2 x 16) + block 1's K (16).
        assert_eq!(g.row_offset(19, 1), (2 * 16 + 16 + 3) * row);
        assert_eq!(g.row_offset(19, 0), (2 * 16 + 3) * row);
        let g = PagedGeometry::new(PagedOrder::Mla, &mla_layout(), 7);
        assert_eq!(g.row_offset(19, 0), 19 * 64 * 2);
        assert_eq!(g.layer_bytes(), 7 * 16 * 64 * 2);
    }
}
