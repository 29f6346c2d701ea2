//! The storage manager's stores: into L1 at once, then behind to each lower tier.

use std::sync::Arc;
use std::time::Instant;

use tracing::warn;

use super::{StorageManager, write_behind};
use crate::error::BackendError;
use crate::keys::cache_key::CacheKey;
use crate::storage::backend::{Chunk, PutOutcome};
use crate::storage::tier::Tier;
use crate::storage::tier_events::TierEventKind;
use crate::storage::tier_stats::TierOp;

impl StorageManager {
    /// Stores entries: synchronously into L1, then schedules write-behind to each lower tier.
    ///
    /// Write-behind never blocks: an entry that does not fit the tier's in-flight quota is
    /// dropped and counted, and an entry whose key is already in flight is skipped.
    pub async fn put(&self, entries: Vec<(CacheKey, Chunk)>) -> Result<PutOutcome, BackendError> {
        self.ensure_open()?;
        if entries.is_empty() {
            return Ok(PutOutcome::default());
        }
        let started = Instant::now();
        let mut outcome = PutOutcome {
            stored: entries.len(),
            skipped: 0,
        };
        if let Some(p) = self.l1 {
            let tier = &self.tiers[p];
            let bytes: u64 = entries.iter().map(|(_, c)| c.data.len() as u64).sum();
            let t0 = Instant::now();
            let result = tier.backend.put(entries.clone()).await;
            tier.counters.call(TierOp::Put, t0.elapsed());
            match result {
                Ok(out) => {
                    tier.counters.written(bytes);
                    if out.skipped == 0 {
                        // Which ones were skipped is unknown otherwise: no event beats a
                        // false one.
                        self.events.record(
                            tier.backend.name(),
                            TierEventKind::Stored,
                            entries.iter().map(|(k, _)| k),
                        );
                    }
                    outcome = out;
                }
                Err(e) => {
                    tier.counters.error();
                    warn!(tier = tier.backend.name(), error = %e, "L1 put failed");
                    outcome = PutOutcome {
                        stored: 0,
                        skipped: entries.len(),
                    };
                }
            }
        }
        for (t, tier) in self.tiers.iter().enumerate() {
            if Some(t) != self.l1 {
                self.schedule_write_behind(tier, &entries);
            }
        }
        metrics::histogram!(crate::telemetry::PUT_SECONDS).record(started.elapsed().as_secs_f64());
        Ok(outcome)
    }

    fn schedule_write_behind(&self, tier: &Arc<Tier>, entries: &[(CacheKey, Chunk)]) {
        let runtime = tier.write_behind_runtime.as_ref().unwrap_or(&self.runtime);
        write_behind::schedule(tier, entries, &self.pending, &self.events, runtime);
    }
}
