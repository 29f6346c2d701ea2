//! The storage manager's lookups: which tier holds each key of the longest prefix, and how
//! much of it L1 holds.

use std::time::Instant;

use futures::stream::{FuturesUnordered, StreamExt};
use tracing::warn;

use super::StorageManager;
use crate::keys::cache_key::CacheKey;
use crate::storage::tier::Tier;
use crate::storage::tier_stats::TierOp;

/// Longest prefix of keys present in some tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixLookup {
    /// For each key of the prefix, a tier that has it: the first in tier order among those
    /// that had answered when the prefix was complete.
    pub tiers: Vec<usize>,
}

impl PrefixLookup {
    /// Number of leading keys present.
    pub fn len(&self) -> usize {
        self.tiers.len()
    }

    /// Whether the first key already missed.
    pub fn is_empty(&self) -> bool {
        self.tiers.is_empty()
    }
}

impl StorageManager {
    /// Longest prefix of `keys` present in some tier, stopping at the first key none has.
    ///
    /// The first tier (L1) is asked first; the tiers below it are then asked at the same
    /// time, each for the keys past the prefix L1 holds, and the answer is ready as soon as
    /// the prefix covers every key: a slow or hung lower tier costs nothing when faster ones
    /// hold the prefix, and otherwise costs the slowest tier's time, not the sum. A tier that
    /// fails counts as having nothing.
    pub async fn lookup(&self, keys: &[CacheKey]) -> PrefixLookup {
        let mut location: Vec<Option<usize>> = vec![None; keys.len()];
        let mut prefix = 0;
        let Some((first, lower)) = self.tiers.split_first() else {
            return PrefixLookup { tiers: Vec::new() };
        };
        let record =
            |location: &mut Vec<Option<usize>>, t: usize, asked: &[usize], found: Vec<bool>| {
                for (&i, present) in asked.iter().zip(found) {
                    if present && location[i].is_none_or(|l| t < l) {
                        location[i] = Some(t);
                    }
                }
            };
        let all: Vec<usize> = (0..keys.len()).collect();
        if let Some(found) = self.contains_in(first, keys).await {
            record(&mut location, 0, &all, found);
        }
        while prefix < keys.len() && location[prefix].is_some() {
            prefix += 1;
        }
        if prefix < keys.len() && !lower.is_empty() {
            let unknown: Vec<usize> = (prefix..keys.len())
                .filter(|&i| location[i].is_none())
                .collect();
            let batch: Vec<CacheKey> = unknown.iter().map(|&i| keys[i].clone()).collect();
            let mut answers: FuturesUnordered<_> = lower
                .iter()
                .enumerate()
                .map(|(t, tier)| {
                    let batch = &batch;
                    async move { (t + 1, self.contains_in(tier, batch).await) }
                })
                .collect();
            while let Some((t, found)) = answers.next().await {
                if let Some(found) = found {
                    record(&mut location, t, &unknown, found);
                }
                while prefix < keys.len() && location[prefix].is_some() {
                    prefix += 1;
                }
                if prefix == keys.len() {
                    break;
                }
            }
        }
        let tiers = location[..prefix]
            .iter()
            .map(|l| l.expect("in prefix"))
            .collect();
        PrefixLookup { tiers }
    }

    /// Which of `keys` `tier` holds; `None` (logged, counted) when it fails.
    async fn contains_in(&self, tier: &Tier, keys: &[CacheKey]) -> Option<Vec<bool>> {
        let t0 = Instant::now();
        let result = tier.backend.contains(keys).await;
        tier.counters.call(TierOp::Contains, t0.elapsed());
        match result {
            Ok(found) => Some(found),
            Err(e) => {
                tier.counters.error();
                warn!(tier = tier.backend.name(), error = %e, "lookup failed; treating tier as empty");
                None
            }
        }
    }

    /// How many leading `keys` L1 holds: what a store checks before writing,
    /// so a save never waits on a remote tier. Without L1, every tier is asked.
    pub async fn l1_prefix(&self, keys: &[CacheKey]) -> usize {
        let Some(p) = self.l1 else {
            return self.lookup(keys).await.len();
        };
        let tier = &self.tiers[p];
        match tier.backend.contains(keys).await {
            Ok(present) => present.iter().take_while(|p| **p).count(),
            Err(e) => {
                tier.counters.error();
                warn!(tier = tier.backend.name(), error = %e, "lookup failed; treating tier as empty");
                0
            }
        }
    }
}
