//! The storage manager: ordered tiers, prefix lookup, promotion into L1, bounded write-behind.

mod builder;
mod get_each;
mod load;
mod lookup;
mod node_memory;
mod remove;
mod store;
mod write_behind;

pub use builder::StorageManagerBuilder;
pub use lookup::PrefixLookup;
pub use node_memory::LentSaveSlots;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::runtime::Handle;
use tracing::warn;

use crate::error::{BackendError, PoolError};
use crate::memory::pool::MemoryObjMut;
use crate::storage::backend::ChunkAllocator;
use crate::storage::tier::Tier;
use crate::storage::tier_events::TierEventLog;
use crate::storage::tier_stats::ManagerCounters;
pub use crate::storage::tier_stats::{ManagerStats, TierStats};
use crate::storage::write_behind::Pending;

/// Knobs of the storage manager.
#[derive(Debug, Clone, Copy)]
pub struct StorageManagerConfig {
    /// Bytes of write-behind data allowed in flight to each lower tier; beyond it writes are
    /// dropped (and counted), never queued behind the caller.
    pub write_behind_quota_bytes: usize,
    /// Copy chunks found in a lower tier into L1.
    pub promote_on_hit: bool,
}

impl Default for StorageManagerConfig {
    fn default() -> Self {
        StorageManagerConfig {
            write_behind_quota_bytes: 1 << 30,
            promote_on_hit: true,
        }
    }
}

/// Drives an ordered list of tiers: L1 (written synchronously and the target of
/// promotion) and lower tiers (written behind, in the background).
///
/// Lookups stop at the first key no tier has: chunk keys are prefix-chained, so every later
/// chunk is unusable anyway.
pub struct StorageManager {
    l1: Option<usize>,
    tiers: Vec<Arc<Tier>>,
    allocator: Arc<dyn ChunkAllocator>,
    config: StorageManagerConfig,
    /// Where write-behind runs, unless a tier names its own runtime.
    runtime: Handle,
    pending: Arc<Pending>,
    counters: ManagerCounters,
    closed: AtomicBool,
    events: Arc<TierEventLog>,
}

impl std::fmt::Debug for StorageManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.tiers.iter().map(|t| t.backend.name()).collect();
        f.debug_struct("StorageManager")
            .field("tiers", &names)
            .field("has_l1", &self.l1.is_some())
            .finish()
    }
}

impl StorageManager {
    /// A buffer for a chunk about to be stored (from L1, evicting as needed).
    pub fn allocate(&self, len: usize) -> Result<MemoryObjMut, PoolError> {
        self.allocator.allocate(len)
    }

    /// The host memory region every buffer comes from (L1's arena), if there is one.
    pub fn host_region(&self) -> Option<(usize, usize)> {
        self.allocator.host_region()
    }

    /// Attaches `guard` to the memory of [`host_region`](Self::host_region) (a device's
    /// page-locking of L1's arena), to end when that memory is freed; hands it back when there
    /// is no such region.
    pub fn attach_to_host_region(
        &self,
        guard: crate::memory::MemoryGuard,
    ) -> Result<(), crate::memory::MemoryGuard> {
        self.allocator.attach_to_host_region(guard)
    }

    /// Number of tiers.
    pub fn tier_count(&self) -> usize {
        self.tiers.len()
    }

    /// Backend names in lookup order.
    pub fn tier_names(&self) -> Vec<String> {
        self.tiers
            .iter()
            .map(|t| t.backend.name().to_string())
            .collect()
    }

    /// Each tier's own counters (hits, bytes, errors, corrupt values), in lookup order.
    pub fn backend_stats(&self) -> Vec<crate::storage::backend::BackendStats> {
        self.tiers.iter().map(|t| t.backend.stats()).collect()
    }

    fn ensure_open(&self) -> Result<(), BackendError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(BackendError::Closed("storage manager".into()));
        }
        Ok(())
    }

    /// Index of L1 in [`StorageManager::tier_names`], if there is one.
    pub fn l1_tier(&self) -> Option<usize> {
        self.l1
    }

    /// Waits for every scheduled write-behind, then flushes each tier.
    pub async fn flush(&self) -> Result<(), BackendError> {
        self.pending.wait_idle().await;
        for tier in &self.tiers {
            tier.backend.flush().await?;
        }
        Ok(())
    }

    /// Flushes, then closes every tier. Later puts fail and gets miss.
    pub async fn close(&self) -> Result<(), BackendError> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.pending.wait_idle().await;
        let mut first_err = None;
        for tier in &self.tiers {
            if let Err(e) = tier.backend.flush().await.and(tier.backend.close().await) {
                warn!(tier = tier.backend.name(), error = %e, "close failed");
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Chunks entering and leaving each tier, for an engine's KV-event stream (disabled until
    /// [`TierEventLog::enable`]).
    pub fn tier_events(&self) -> &Arc<TierEventLog> {
        &self.events
    }

    /// Counters of every tier.
    pub fn stats(&self) -> ManagerStats {
        self.counters.snapshot(
            self.tiers
                .iter()
                .map(|t| t.counters.snapshot(t.backend.as_ref()))
                .collect(),
        )
    }
}
