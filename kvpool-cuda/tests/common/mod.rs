//! Helpers shared by the GPU tests and the CPU emulation of the kernels.
#![allow(dead_code)]

use kvpool_core::{Dtype, HostPagedKvCache, KvKind, KvLayout, KvTransfer};
use kvpool_cuda::{PagedGeometry, PagedOrder};
use rand::Rng;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;

/// A host cache (flash-attention order) full of random bytes (never zeros).
pub fn random_cache(layout: KvLayout, blocks: usize, rng: &mut SmallRng) -> HostPagedKvCache {
    let mut c = HostPagedKvCache::new(layout, blocks);
    for l in 0..layout.num_layers {
        rng.fill(c.layer_mut(l));
    }
    c
}

/// One layer of `host` (flash-attention order) rearranged into `order`.
pub fn layer_in_order(
    host: &HostPagedKvCache,
    layer: usize,
    order: PagedOrder,
    blocks: usize,
) -> Vec<u8> {
    let layout = *host.layout();
    let g = PagedGeometry::new(order, &layout, blocks);
    let mut out = vec![0u8; g.layer_bytes()];
    for slot in 0..g.num_slots() {
        for plane in 0..g.planes {
            let at = g.row_offset(slot, plane);
            out[at..at + g.row_bytes].copy_from_slice(host.row(layer, plane, slot));
        }
    }
    out
}

/// The tensor shape the engine reports for `order`.
pub fn shape(order: PagedOrder, layout: &KvLayout, blocks: usize) -> Vec<usize> {
    let (bs, h, d) = (layout.block_size, layout.num_kv_heads, layout.head_size);
    match order {
        PagedOrder::FlashAttention => vec![2, blocks, bs, h, d],
        PagedOrder::FlashInfer => vec![blocks, 2, bs, h, d],
        PagedOrder::Mla => vec![blocks, bs, d],
    }
}

/// Random distinct slots: scattered over blocks, partial blocks included.
pub fn random_slots(n: usize, num_slots: usize, rng: &mut SmallRng) -> Vec<i64> {
    let mut all: Vec<i64> = (0..num_slots as i64).collect();
    all.shuffle(rng);
    all.truncate(n);
    all
}

/// Layouts covering every order and access width: 16-byte rows (bf16 x 8 x 128), 6-byte rows
/// (fp8, bytes only), 20-byte rows (4-byte accesses) and MLA.
pub fn layouts() -> Vec<(KvLayout, PagedOrder)> {
    let kv =
        |dtype, heads, head| KvLayout::new(3, heads, head, dtype, KvKind::KeyValue, 16).unwrap();
    vec![
        (kv(Dtype::Bf16, 8, 128), PagedOrder::FlashAttention),
        (kv(Dtype::Bf16, 8, 128), PagedOrder::FlashInfer),
        // 2 x 3 x 1-byte rows: only the byte kernel fits.
        (kv(Dtype::Fp8E4m3, 2, 3), PagedOrder::FlashAttention),
        // 4-byte multiple but not 16.
        (kv(Dtype::F16, 1, 10), PagedOrder::FlashInfer),
        (
            KvLayout::new(3, 1, 576, Dtype::Bf16, KvKind::MlaLatent, 16).unwrap(),
            PagedOrder::Mla,
        ),
    ]
}
