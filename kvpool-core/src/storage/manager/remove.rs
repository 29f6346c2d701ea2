//! The storage manager's removals: from every tier, from the one tier whose copy failed its
//! check, or from node memory only.

use tracing::warn;

use super::StorageManager;
use crate::keys::cache_key::CacheKey;
use crate::storage::tier_events::TierEventKind;

impl StorageManager {
    /// Removes keys from every tier (e.g. a chunk found corrupt). Returns how many existed.
    pub async fn remove(&self, keys: &[CacheKey]) -> usize {
        let mut n = 0;
        for tier in &self.tiers {
            match tier.backend.remove(keys).await {
                Ok(k) => {
                    if k > 0 {
                        self.events
                            .record(tier.backend.name(), TierEventKind::Removed, keys);
                    }
                    n += k;
                }
                Err(e) => {
                    tier.counters.error();
                    warn!(tier = tier.backend.name(), error = %e, "remove failed");
                }
            }
        }
        n
    }

    /// Removes `keys` from tier `t` only: where a copy read from that tier failed its check.
    /// The other tiers keep theirs (a fault in one copy never costs the others). Returns how
    /// many that tier removed.
    pub async fn remove_from(&self, t: usize, keys: &[CacheKey]) -> usize {
        let Some(tier) = self.tiers.get(t) else {
            return 0;
        };
        match tier.backend.remove(keys).await {
            Ok(k) => {
                if k > 0 {
                    self.events
                        .record(tier.backend.name(), TierEventKind::Removed, keys);
                }
                k
            }
            Err(e) => {
                tier.counters.error();
                warn!(tier = tier.backend.name(), error = %e, "remove failed");
                0
            }
        }
    }

    /// Removes `keys` from the tiers that lend node memory only (the node daemon's shared
    /// memory): where a copy out of that memory failed its check. The daemon drops its
    /// shared-memory copy and keeps its lower tiers'.
    pub async fn remove_from_node_memory(&self, keys: &[CacheKey]) -> usize {
        let mut n = 0;
        for t in 0..self.tiers.len() {
            if self.tier_lends_node_memory(t) {
                n += self.remove_from(t, keys).await;
            }
        }
        n
    }
}
