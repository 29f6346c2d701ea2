//! The deterministic KV "model" the single-request harness and the protocol tests share:
//! every row is a hash of (token id, position, layer, plane), so a row written for another
//! token, position or layer is caught byte for byte.

use kvpool_core::{HostPagedKvCache, KvLayout};

/// The bytes the model writes for one row.
fn model_row(token: u32, pos: usize, layer: usize, plane: usize, row: &mut [u8]) {
    let mut x = xxhash_rust::xxh3::xxh3_64(
        &[
            token.to_le_bytes(),
            (pos as u32).to_le_bytes(),
            (layer as u32).to_le_bytes(),
            (plane as u32).to_le_bytes(),
        ]
        .concat(),
    ) | 1;
    for b in row.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

pub(crate) fn slot_of(layout: &KvLayout, blocks: &[u32], i: usize) -> usize {
    let bs = layout.block_size;
    blocks[i / bs] as usize * bs + i % bs
}

/// The model's forward pass for one layer: writes the KV of `positions` of `tokens` into their
/// slots (`blocks[i / block_size] * block_size + i % block_size`).
pub fn model_compute(
    kv: &mut HostPagedKvCache,
    layer: usize,
    tokens: &[u32],
    blocks: &[u32],
    positions: impl Iterator<Item = usize>,
) {
    let layout = *kvpool_core::KvTransfer::layout(kv);
    let row = layout.bytes_per_token_per_plane();
    let num_slots = kv.num_slots();
    for i in positions {
        let slot = slot_of(&layout, blocks, i);
        for plane in 0..layout.kind.planes() {
            let at = (plane * num_slots + slot) * row;
            model_row(
                tokens[i],
                i,
                layer,
                plane,
                &mut kv.layer_mut(layer)[at..at + row],
            );
        }
    }
}

/// Rows (token x layer x plane) of `tokens` whose bytes in `kv` differ from the model's.
pub fn model_mismatches(kv: &HostPagedKvCache, tokens: &[u32], blocks: &[u32]) -> usize {
    let layout = *kvpool_core::KvTransfer::layout(kv);
    let mut expected = vec![0u8; layout.bytes_per_token_per_plane()];
    let mut bad = 0;
    for layer in 0..layout.num_layers {
        for (i, &t) in tokens.iter().enumerate() {
            for plane in 0..layout.kind.planes() {
                model_row(t, i, layer, plane, &mut expected);
                if kv.row(layer, plane, slot_of(&layout, blocks, i)) != expected.as_slice() {
                    bad += 1;
                }
            }
        }
    }
    bad
}
