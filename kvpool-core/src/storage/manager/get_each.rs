//! The storage manager's reads for a caller that copies each chunk into memory of its own
//! (SGLang's host pool): chunks handed to a visitor where a tier holds them, none kept.

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use tracing::warn;

use super::StorageManager;
use crate::keys::cache_key::CacheKey;
use crate::storage::backend::ChunkVisit;
use crate::storage::tier_stats::TierOp;

/// Which tier served a key in [`StorageManager::get_each`], and what: counted as its hit.
#[derive(Clone, Copy)]
struct Served {
    tier: usize,
    tokens: u64,
    bytes: u64,
}

impl StorageManager {
    /// Reads the longest available prefix of `keys`, as [`StorageManager::get`] does, but
    /// hands each chunk to `visit(index in keys, meta, bytes)` instead of returning it: a
    /// lower tier then checks each value where it holds it and needs no buffer of kvpool's
    /// own ([`crate::StorageBackend::get_each`]). Returns the prefix's length. A chunk found
    /// past the first key no tier holds may be visited too (its index is at or past the
    /// length returned), and so may a chunk of a tier whose call then failed: the caller must
    /// not use what it copied for an index at or past the length returned. No chunk is
    /// visited after this returns.
    ///
    /// When hits are promoted into L1 (an L1 with `promote_on_hit`), this is `get` followed
    /// by a visit of each chunk of the prefix: the promoted chunk needs a buffer anyway.
    pub async fn get_each(&self, keys: &[CacheKey], visit: ChunkVisit) -> usize {
        if self.ensure_open().is_err() || keys.is_empty() {
            return 0;
        }
        if self.l1.is_some() && self.config.promote_on_hit {
            let chunks = self.get(keys).await;
            for (i, chunk) in chunks.iter().enumerate() {
                visit(i, &chunk.meta, chunk.data.as_slice());
            }
            return chunks.len();
        }
        let started = Instant::now();
        let served: Arc<Mutex<Vec<Option<Served>>>> = Arc::new(Mutex::new(vec![None; keys.len()]));
        let mut prefix = 0;
        for (t, tier) in self.tiers.iter().enumerate() {
            if prefix == keys.len() {
                break;
            }
            let idx: Arc<Vec<usize>> = Arc::new({
                let served = served.lock();
                (prefix..keys.len())
                    .filter(|&i| served[i].is_none())
                    .collect()
            });
            let batch: Vec<CacheKey> = idx.iter().map(|&i| keys[i].clone()).collect();
            // Visits count only while this tier's call runs: one that failed, or a visit that
            // comes after its timeout gave up on it, serves nothing (as `get` drops a failed
            // tier's answer). Held across each visit, so none is under way once it is closed.
            let accepting = Arc::new(Mutex::new(true));
            let in_batch: ChunkVisit = {
                let (idx, served, visit) = (idx.clone(), served.clone(), visit.clone());
                let accepting = accepting.clone();
                Arc::new(move |j, meta, bytes| {
                    let accepting = accepting.lock();
                    let Some(&i) = idx.get(j) else { return };
                    if !*accepting {
                        return;
                    }
                    visit(i, meta, bytes);
                    served.lock()[i] = Some(Served {
                        tier: t,
                        tokens: u64::from(meta.token_count),
                        bytes: bytes.len() as u64,
                    });
                })
            };
            let t0 = Instant::now();
            let result = tier.backend.get_each(&batch, in_batch).await;
            *accepting.lock() = false;
            tier.counters.call(TierOp::Get, t0.elapsed());
            let mut served = served.lock();
            if let Err(e) = result {
                tier.counters.error();
                warn!(tier = tier.backend.name(), error = %e, "get failed; treating as misses");
                for &i in idx.iter() {
                    served[i] = None;
                }
            }
            while prefix < keys.len() && served[prefix].is_some() {
                prefix += 1;
            }
        }
        for served in served.lock()[..prefix].iter().flatten() {
            self.tiers[served.tier]
                .counters
                .hit(served.tokens, served.bytes);
        }
        self.counters.missed((keys.len() - prefix) as u64);
        metrics::histogram!(crate::telemetry::GET_SECONDS).record(started.elapsed().as_secs_f64());
        prefix
    }
}
