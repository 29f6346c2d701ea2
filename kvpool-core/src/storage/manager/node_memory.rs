//! The storage manager's reads and writes of memory on this node that another process can
//! write (the pool daemon's arena): chunks read or pinned where they lie, and saves copied
//! straight into places it lends.

use std::time::Instant;

use tracing::warn;

use super::StorageManager;
use crate::error::BackendError;
use crate::keys::cache_key::CacheKey;
use crate::storage::backend::{Chunk, NodeMemoryBackend, PutOutcome, StorageBackend};
use crate::storage::node_memory::SharedChunk;
use crate::storage::save_slot::SaveSlot;
use crate::storage::tier_events::TierEventKind;
use crate::storage::tier_stats::TierOp;

/// What [`StorageManager::lend_save_slots`] answered.
#[derive(Debug, Default)]
pub struct LentSaveSlots {
    /// How many of the values asked for, from the first, the tier holds already.
    pub stored: usize,
    /// Places for the values after those, in order (a leading run of them).
    pub slots: Vec<SaveSlot>,
}

/// The node-memory side of a tier's backend, where it has one (an error otherwise: the
/// manager asks only tiers it checked, so this is a miss, never a panic).
fn node_memory_of(backend: &dyn StorageBackend) -> Result<&dyn NodeMemoryBackend, BackendError> {
    backend
        .node_memory()
        .ok_or_else(|| BackendError::Unavailable {
            backend: backend.name().to_string(),
            reason: "the tier does not lie in node memory".into(),
        })
}

impl StorageManager {
    /// Whether tier `t` (an index in [`StorageManager::tier_names`]) reads from memory on this
    /// node with no I/O (it has a [node-memory side](crate::StorageBackend::node_memory)).
    pub fn tier_reads_node_memory(&self, t: usize) -> bool {
        self.tiers
            .get(t)
            .is_some_and(|tier| tier.backend.node_memory().is_some())
    }

    /// The leading run of `keys` that tier `t`, a tier that [reads node
    /// memory](StorageManager::tier_reads_node_memory), holds in that memory, promoted into L1
    /// like any other hit (with `promote_on_hit`). Returns the chunks up to the first key it
    /// lacks, and asks no other tier, nor the storage behind it: what a lookup loads.
    pub async fn get_node_memory_prefix(&self, t: usize, keys: &[CacheKey]) -> Vec<Chunk> {
        let started = Instant::now();
        let loaded: Vec<(usize, Chunk)> = self
            .leading_run(t, keys, |b| async move {
                node_memory_of(b)?.get_node_memory(keys).await
            })
            .await
            .into_iter()
            .map(|c| (t, c))
            .collect();
        self.count_hits_and_promote(keys, &loaded).await;
        metrics::histogram!(crate::telemetry::GET_SECONDS).record(started.elapsed().as_secs_f64());
        loaded.into_iter().map(|(_, c)| c).collect()
    }

    /// This process's mappings of the node memory its tiers lend chunks from, as mapped now
    /// (see [`NodeMemoryBackend::node_memory_mapping`]): what a GPU engine page-locks for DMA.
    pub fn node_memory_mappings(&self) -> Vec<std::sync::Arc<crate::memory::SharedMapping>> {
        self.tiers
            .iter()
            .filter_map(|tier| tier.backend.node_memory())
            .filter_map(|tier| tier.node_memory_mapping())
            .collect()
    }

    /// Whether tier `t` lends chunks where they lie in node memory (see
    /// [`NodeMemoryBackend::lends_node_memory`]).
    pub fn tier_lends_node_memory(&self, t: usize) -> bool {
        self.tiers
            .get(t)
            .and_then(|tier| tier.backend.node_memory())
            .is_some_and(|tier| tier.lends_node_memory())
    }

    /// The leading run of `keys` that tier `t`, a tier that [lends node
    /// memory](StorageManager::tier_lends_node_memory), holds in that memory, pinned where it
    /// lies (nothing is copied, nor promoted into L1); the reader copies each payload once and
    /// checks its copy. Asks no other tier, nor the storage behind it.
    pub async fn pin_node_memory_prefix(&self, t: usize, keys: &[CacheKey]) -> Vec<SharedChunk> {
        let started = Instant::now();
        let pinned = self
            .leading_run(t, keys, |b| async move {
                node_memory_of(b)?.pin_node_memory(keys).await
            })
            .await;
        for c in &pinned {
            self.tiers[t]
                .counters
                .hit(u64::from(c.meta.token_count), c.payload_len() as u64);
        }
        metrics::histogram!(crate::telemetry::GET_SECONDS).record(started.elapsed().as_secs_f64());
        pinned
    }

    /// The tier a save is copied straight into, when there is one: the only tier below L1,
    /// and one that lends node memory (the pool daemon's). With other tiers below L1, saves go
    /// through L1, which writes each of them behind.
    pub fn save_slot_tier(&self) -> Option<usize> {
        let mut lower = (0..self.tiers.len()).filter(|&t| Some(t) != self.l1);
        match (lower.next(), lower.next()) {
            (Some(t), None) if self.tier_lends_node_memory(t) => Some(t),
            _ => None,
        }
    }

    /// For the values of `entries` (`(key, payload length)`), in order: how many of the first
    /// the [save slot tier](StorageManager::save_slot_tier) holds already (a save skips them,
    /// as it skips what L1 holds), then places it lends for the leading run of the rest it had
    /// room for. Nothing when there is no such tier, the manager is closed, or a call failed
    /// (logged).
    pub async fn lend_save_slots(&self, entries: &[(CacheKey, usize)]) -> LentSaveSlots {
        let Some(t) = self.save_slot_tier() else {
            return LentSaveSlots::default();
        };
        if self.ensure_open().is_err() || entries.is_empty() {
            return LentSaveSlots::default();
        }
        let tier = &self.tiers[t];
        let keys: Vec<CacheKey> = entries.iter().map(|(k, _)| k.clone()).collect();
        let started = Instant::now();
        let held = tier.backend.contains(&keys).await;
        tier.counters.call(TierOp::Contains, started.elapsed());
        let stored = match held {
            Ok(held) => held.iter().take_while(|&&h| h).count(),
            Err(e) => {
                tier.counters.error();
                warn!(tier = tier.backend.name(), error = %e, "no places lent for saves; saving through L1");
                return LentSaveSlots::default();
            }
        };
        let rest = &entries[stored..];
        if rest.is_empty() {
            return LentSaveSlots {
                stored,
                slots: Vec::new(),
            };
        }
        let lent = match node_memory_of(tier.backend.as_ref()) {
            Ok(tier) => tier.lend_save_slots(rest).await,
            Err(e) => Err(e),
        };
        match lent {
            Ok(slots) => LentSaveSlots {
                stored,
                slots: slots.into_iter().map_while(|s| s).collect(),
            },
            Err(e) => {
                tier.counters.error();
                warn!(tier = tier.backend.name(), error = %e, "no places lent for saves; saving through L1");
                LentSaveSlots {
                    stored,
                    slots: Vec::new(),
                }
            }
        }
    }

    /// Stores [sealed](SaveSlot::seal) save slots under their keys in the [save slot
    /// tier](StorageManager::save_slot_tier); a slot not sealed, or past its loan, is given
    /// back and counted as skipped. Records the tier's stored events when every slot was
    /// stored (which ones were not is unknown otherwise: no event beats a false one).
    pub async fn commit_save_slots(
        &self,
        slots: Vec<SaveSlot>,
    ) -> Result<PutOutcome, BackendError> {
        self.ensure_open()?;
        let Some(t) = self.save_slot_tier() else {
            return Ok(PutOutcome {
                stored: 0,
                skipped: slots.len(),
            });
        };
        let tier = &self.tiers[t];
        let keys: Vec<CacheKey> = slots.iter().map(|s| s.key().clone()).collect();
        let bytes: u64 = slots.iter().map(|s| s.payload_len() as u64).sum();
        let started = Instant::now();
        let result = match node_memory_of(tier.backend.as_ref()) {
            Ok(tier) => tier.commit_save_slots(slots).await,
            Err(e) => Err(e),
        };
        tier.counters.call(TierOp::Put, started.elapsed());
        metrics::histogram!(crate::telemetry::PUT_SECONDS).record(started.elapsed().as_secs_f64());
        match result {
            Ok(out) => {
                if out.skipped == 0 {
                    tier.counters.written(bytes);
                    self.events
                        .record(tier.backend.name(), TierEventKind::Stored, keys.iter());
                }
                Ok(out)
            }
            Err(e) => {
                tier.counters.error();
                Err(e)
            }
        }
    }
}
