//! The demo the binary runs and the tests check: KV stored through one pool comes back,
//! byte for byte, through a second pool built from the same config (a fresh process, empty L1),
//! so it can only have come from the lower tiers.

use kvpool_core::{HostPagedKvCache, PoolConfig};

/// What one store-then-reload round did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemoReport {
    /// Tokens stored and asked for again.
    pub tokens: usize,
    /// Chunks the first pool stored.
    pub stored_chunks: usize,
    /// Tokens the second pool loaded.
    pub loaded_tokens: usize,
    /// Chunks each tier of the second pool served, in lookup order.
    pub served_by: Vec<(String, u64)>,
    /// Whether every loaded byte equals the stored one.
    pub bytes_match: bool,
}

/// A recognisable byte for (layer, offset): wrong or shifted bytes show up.
fn pattern(layer: usize, offset: usize) -> u8 {
    (layer.wrapping_mul(131) ^ offset.wrapping_mul(7) ^ (offset >> 8)) as u8
}

/// Stores `tokens` tokens of patterned KV through a pool built from `config`, closes it, then
/// loads them through a second pool built from the same config and compares the bytes.
pub async fn store_then_reload(
    config: &PoolConfig,
    tokens: usize,
) -> Result<DemoReport, Box<dyn std::error::Error + Send + Sync>> {
    let layout = config.layout()?;
    let ids: Vec<u32> = (0..tokens as u32)
        .map(|t| t.wrapping_mul(7919) + 1)
        .collect();
    let slots: Vec<i64> = (0..tokens as i64).collect();
    let blocks = tokens.div_ceil(layout.block_size);

    let mut source = HostPagedKvCache::new(layout, blocks);
    for layer in 0..layout.num_layers {
        for (offset, byte) in source.layer_mut(layer).iter_mut().enumerate() {
            *byte = pattern(layer, offset);
        }
    }
    let first = kvpool_backends::build_pool(config).await?;
    let report = first.engine.store(&ids, None, &source, &slots).await?;
    // Closing waits for write-behind: every chunk is in the lower tiers afterwards.
    first.engine.storage().close().await?;
    drop(first);

    let second = kvpool_backends::build_pool(config).await?;
    let mut target = HostPagedKvCache::new(layout, blocks);
    let mask = second
        .engine
        .retrieve(&ids, None, &mut target, &slots)
        .await?;
    let loaded_tokens = mask.iter().take_while(|&&m| m).count();
    let planes = layout.kind.planes();
    let bytes_match = (0..layout.num_layers).all(|layer| {
        (0..planes).all(|plane| {
            (0..loaded_tokens)
                .all(|slot| source.row(layer, plane, slot) == target.row(layer, plane, slot))
        })
    });
    let served_by = second
        .engine
        .storage()
        .stats()
        .tiers
        .into_iter()
        .map(|t| (t.name, t.hit_chunks))
        .collect();
    second.engine.storage().close().await?;
    Ok(DemoReport {
        tokens,
        stored_chunks: report.stored_chunks,
        loaded_tokens,
        served_by,
        bytes_match,
    })
}
