//! Write-behind to the lower tiers: batches admitted against a tier's byte quota (never
//! blocking, duplicates of in-flight keys skipped), written in the background, and counted so
//! `flush` and `close` can wait for them.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use tokio::runtime::Handle;
use tokio::sync::Notify;
use tracing::{debug, warn};

use crate::keys::cache_key::CacheKey;
use crate::storage::backend::Chunk;
use crate::storage::tier::Tier;
use crate::storage::tier_events::{TierEventKind, TierEventLog};
use crate::storage::tier_stats::TierOp;

/// Counts spawned write-behind batches; `wait_idle` returns once none is left.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    count: AtomicUsize,
    idle: Notify,
}

impl Pending {
    /// A batch was spawned.
    pub(crate) fn start(&self) {
        self.count.fetch_add(1, Ordering::SeqCst);
        metrics::gauge!(crate::telemetry::WRITE_BEHIND_PENDING).increment(1.0);
    }
    /// A batch ended (written, failed or unwound by a panic).
    pub(crate) fn finish(&self) {
        metrics::gauge!(crate::telemetry::WRITE_BEHIND_PENDING).decrement(1.0);
        if self.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.idle.notify_waiters();
        }
    }
    /// Waits until no batch is in flight.
    pub(crate) async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.count.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// One write-behind batch in flight. Dropping it (when the write ends, or when a panicking
/// backend unwinds the task) returns the keys, the quota and the pending count, so `flush` and
/// `close` never wait for ever and the keys can be written again.
struct WriteBehindGuard {
    tier: Arc<Tier>,
    keys: Vec<CacheKey>,
    permits: u32,
    pending: Arc<Pending>,
}

impl Drop for WriteBehindGuard {
    fn drop(&mut self) {
        {
            let mut in_flight = self.tier.in_flight.lock();
            for k in &self.keys {
                in_flight.remove(k);
            }
        }
        self.tier.quota.add_permits(self.permits as usize);
        self.pending.finish();
    }
}

/// Admits what fits of `entries` into `tier`'s write-behind and writes it in the background:
/// keys already in flight are skipped (counted as deduplicated), entries beyond the quota are
/// dropped (counted), never waited for.
pub(crate) fn schedule(
    tier: &Arc<Tier>,
    entries: &[(CacheKey, Chunk)],
    pending: &Arc<Pending>,
    events: &Arc<TierEventLog>,
    runtime: &Handle,
) {
    let mut batch = Vec::new();
    let mut permits = 0u32;
    {
        let mut in_flight = tier.in_flight.lock();
        for (key, chunk) in entries {
            if in_flight.contains(key) {
                tier.counters.deduplicated_write();
                continue;
            }
            let need = u32::try_from(chunk.data.len().max(1)).unwrap_or(u32::MAX);
            match tier.quota.try_acquire_many(need) {
                Ok(p) => {
                    p.forget();
                    permits += need;
                    in_flight.insert(key.clone());
                    batch.push((key.clone(), chunk.clone()));
                }
                Err(_) => {
                    tier.counters.dropped_write();
                    debug!(tier = tier.backend.name(), key = %key, "write-behind quota full; dropping write");
                }
            }
        }
    }
    if batch.is_empty() {
        return;
    }
    pending.start();
    let guard = WriteBehindGuard {
        tier: tier.clone(),
        keys: batch.iter().map(|(k, _)| k.clone()).collect(),
        permits,
        pending: pending.clone(),
    };
    let events = events.clone();
    runtime.spawn(async move {
        let tier = guard.tier.clone();
        let bytes: u64 = batch.iter().map(|(_, c)| c.data.len() as u64).sum();
        let t0 = Instant::now();
        let result = tier.backend.put(batch).await;
        tier.counters.call(TierOp::Put, t0.elapsed());
        match result {
            Ok(_) => {
                tier.counters.written(bytes);
                events.record(tier.backend.name(), TierEventKind::Stored, &guard.keys);
            }
            Err(e) => {
                tier.counters.error();
                tier.counters.failed_writes(guard.keys.len() as u64);
                warn!(tier = tier.backend.name(), error = %e, "write-behind failed; chunks not stored in this tier");
            }
        }
        drop(guard);
    });
}
