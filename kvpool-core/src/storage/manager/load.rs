//! The storage manager's loads: the longest prefix read tier by tier, each chunk counted as
//! a hit of the tier that served it and promoted into L1.

use std::time::Instant;

use tracing::warn;

use super::StorageManager;
use crate::error::BackendError;
use crate::keys::cache_key::CacheKey;
use crate::storage::backend::{Chunk, StorageBackend};
use crate::storage::tier_stats::TierOp;

impl StorageManager {
    /// The chunks L1 holds for the leading `keys`, stopping at the first it lacks (their
    /// recency is refreshed; nothing is promoted). Empty without L1 or when it fails. Holding
    /// the returned chunks keeps their memory alive even if L1 evicts them: what a lookup
    /// lease pins.
    pub async fn l1_get_prefix(&self, keys: &[CacheKey]) -> Vec<Chunk> {
        let Some(p) = self.l1 else {
            return Vec::new();
        };
        self.leading_run(p, keys, |b| b.get(keys)).await
    }

    /// The leading run of `keys` that `read` (one read of tier `t`) answered, counted as one
    /// get of the tier; nothing when there is no tier `t`, the manager is closed, or the read
    /// failed (a miss, logged).
    pub(super) async fn leading_run<'a, T, F>(
        &'a self,
        t: usize,
        keys: &[CacheKey],
        read: impl FnOnce(&'a dyn StorageBackend) -> F,
    ) -> Vec<T>
    where
        F: std::future::Future<Output = Result<Vec<Option<T>>, BackendError>>,
    {
        let Some(tier) = self.tiers.get(t) else {
            return Vec::new();
        };
        if self.ensure_open().is_err() || keys.is_empty() {
            return Vec::new();
        }
        let started = Instant::now();
        let result = read(tier.backend.as_ref()).await;
        tier.counters.call(TierOp::Get, started.elapsed());
        match result {
            Ok(values) => values.into_iter().map_while(|v| v).collect(),
            Err(e) => {
                tier.counters.error();
                warn!(tier = tier.backend.name(), error = %e, "get failed; treating as misses");
                Vec::new()
            }
        }
    }

    /// Loads the longest available prefix of `keys`. Returns the chunks of that prefix, in
    /// order; it is shorter than `keys` from the first key that could not be loaded.
    /// Chunks found below L1 are promoted into L1.
    ///
    /// Tiers are asked in order with `get` itself, never `contains` first: a tier is asked
    /// only for keys no faster tier returned, from the end of the prefix found so far, so each
    /// tier is asked at most once per chunk and a remote hit costs one round trip.
    pub async fn get(&self, keys: &[CacheKey]) -> Vec<Chunk> {
        self.get_with_tiers(keys)
            .await
            .into_iter()
            .map(|(_, chunk)| chunk)
            .collect()
    }

    /// [`StorageManager::get`], with the index (in [`StorageManager::tier_names`]) of the tier
    /// that served each chunk.
    pub async fn get_with_tiers(&self, keys: &[CacheKey]) -> Vec<(usize, Chunk)> {
        if self.ensure_open().is_err() || keys.is_empty() {
            return Vec::new();
        }
        let started = Instant::now();
        let mut chunks: Vec<Option<(usize, Chunk)>> = vec![None; keys.len()];
        let mut prefix = 0;
        for (t, tier) in self.tiers.iter().enumerate() {
            if prefix == keys.len() {
                break;
            }
            // Only keys from the current prefix end onward can extend it.
            let idx: Vec<usize> = (prefix..keys.len())
                .filter(|&i| chunks[i].is_none())
                .collect();
            let batch: Vec<CacheKey> = idx.iter().map(|&i| keys[i].clone()).collect();
            let t0 = Instant::now();
            let result = tier.backend.get(&batch).await;
            tier.counters.call(TierOp::Get, t0.elapsed());
            match result {
                Ok(values) => {
                    for (&i, v) in idx.iter().zip(values) {
                        chunks[i] = v.map(|c| (t, c));
                    }
                }
                Err(e) => {
                    tier.counters.error();
                    warn!(tier = tier.backend.name(), error = %e, "get failed; treating as misses");
                }
            }
            while prefix < keys.len() && chunks[prefix].is_some() {
                prefix += 1;
            }
        }
        let loaded: Vec<(usize, Chunk)> = chunks
            .into_iter()
            .take(prefix)
            .map(|c| c.expect("in prefix"))
            .collect();
        self.count_hits_and_promote(keys, &loaded).await;
        self.counters.missed((keys.len() - loaded.len()) as u64);
        metrics::histogram!(crate::telemetry::GET_SECONDS).record(started.elapsed().as_secs_f64());
        loaded
    }

    /// Counts each loaded chunk as a hit of the tier that served it, and promotes those a
    /// lower tier served into L1 (when `promote_on_hit`). `loaded[i]` is the chunk of `keys[i]`.
    pub(super) async fn count_hits_and_promote(
        &self,
        keys: &[CacheKey],
        loaded: &[(usize, Chunk)],
    ) {
        let mut promote = Vec::new();
        for (key, (t, c)) in keys.iter().zip(loaded) {
            let tier = &self.tiers[*t];
            tier.counters
                .hit(u64::from(c.meta.token_count), c.data.len() as u64);
            if Some(*t) != self.l1 && self.l1.is_some() && self.config.promote_on_hit {
                promote.push((key.clone(), c.clone()));
            }
        }
        if let (Some(p), false) = (self.l1, promote.is_empty()) {
            let n = promote.len() as u64;
            let tier = &self.tiers[p];
            match tier.backend.put(promote).await {
                Ok(out) => self.counters.promoted(out.stored as u64),
                Err(e) => {
                    tier.counters.error();
                    warn!(error = %e, chunks = n, "promotion into L1 failed");
                }
            }
        }
    }
}
