//! `Tier`: one tier of the storage manager with its counters and write-behind state.

use std::collections::HashSet;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Semaphore;

use crate::keys::cache_key::CacheKey;
use crate::storage::backend::StorageBackend;
use crate::storage::tier_stats::TierCounters;

/// One tier as the storage manager drives it: the backend, its counters, and its write-behind
/// state (keys in flight, byte quota).
pub(crate) struct Tier {
    pub(crate) backend: Arc<dyn StorageBackend>,
    pub(crate) counters: TierCounters,
    /// Keys whose write-behind to this tier is in flight.
    pub(crate) in_flight: Mutex<HashSet<CacheKey>>,
    /// Write-behind byte quota.
    pub(crate) quota: Arc<Semaphore>,
}

impl Tier {
    /// `backend` with `quota_bytes` of write-behind in flight at most.
    pub(crate) fn new(backend: Arc<dyn StorageBackend>, quota_bytes: usize) -> Self {
        Tier {
            counters: TierCounters::new(backend.name()),
            backend,
            in_flight: Mutex::new(HashSet::new()),
            quota: Arc::new(Semaphore::new(quota_bytes)),
        }
    }
}
