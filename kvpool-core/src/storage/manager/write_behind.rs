//! The storage manager's write-behind: a tier's admitted batch written in the background.

use std::sync::Arc;
use std::time::Instant;

use tokio::runtime::Handle;
use tracing::{debug, warn};

use crate::keys::cache_key::CacheKey;
use crate::storage::backend::Chunk;
use crate::storage::tier::Tier;
use crate::storage::tier_events::{TierEventKind, TierEventLog};
use crate::storage::tier_stats::TierOp;
use crate::storage::write_behind::Pending;

/// Admits what fits of `entries` into `tier`'s write-behind and writes it in the background on
/// `runtime`: keys already in flight are skipped (counted as deduplicated), entries beyond the
/// quota are dropped (counted), never waited for.
pub(super) fn schedule(
    tier: &Arc<Tier>,
    entries: &[(CacheKey, Chunk)],
    pending: &Arc<Pending>,
    events: &Arc<TierEventLog>,
    runtime: &Handle,
) {
    let admission = tier.write_behind.admit(
        entries.iter().map(|(k, c)| (k.clone(), c.data.len())),
        pending,
    );
    tier.counters.deduplicated_writes(admission.deduplicated);
    if admission.dropped > 0 {
        tier.counters.dropped_writes(admission.dropped);
        debug!(
            tier = tier.backend.name(),
            dropped = admission.dropped,
            "write-behind quota full; dropping writes"
        );
    }
    let Some(guard) = admission.batch else {
        return;
    };
    let batch: Vec<(CacheKey, Chunk)> = admission
        .admitted
        .iter()
        .map(|&i| entries[i].clone())
        .collect();
    let events = events.clone();
    let tier = tier.clone();
    runtime.spawn(async move {
        let bytes: u64 = batch.iter().map(|(_, c)| c.data.len() as u64).sum();
        let t0 = Instant::now();
        let result = tier.backend.put(batch).await;
        tier.counters.call(TierOp::Put, t0.elapsed());
        match result {
            Ok(_) => {
                tier.counters.written(bytes);
                events.record(tier.backend.name(), TierEventKind::Stored, guard.keys());
            }
            Err(e) => {
                tier.counters.error();
                tier.counters.failed_writes(guard.keys().len() as u64);
                warn!(tier = tier.backend.name(), error = %e, "write-behind failed; chunks not stored in this tier");
            }
        }
        // The tier first, then the batch: once `flush` or `close` sees no batch in flight, no
        // task holds a tier (a closed disk tier's database is released with its last holder).
        drop(tier);
        drop(guard);
    });
}
