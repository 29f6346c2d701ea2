//! `Tier`: one tier of the storage manager with its counters and write-behind state.

use std::sync::Arc;

use tokio::runtime::Handle;

use crate::keys::cache_key::CacheKey;
use crate::storage::backend::StorageBackend;
use crate::storage::tier_stats::TierCounters;
use crate::storage::write_behind::WriteBehindAdmission;

/// One tier as the storage manager drives it: the backend, its counters, and its write-behind
/// state (keys in flight, byte quota).
pub(crate) struct Tier {
    pub(crate) backend: Arc<dyn StorageBackend>,
    pub(crate) counters: TierCounters,
    /// Which write-behind may start: the byte quota and the keys in flight.
    pub(crate) write_behind: Arc<WriteBehindAdmission<CacheKey>>,
    /// Where this tier's write-behind runs (`None`: the manager's runtime).
    pub(crate) write_behind_runtime: Option<Handle>,
}

impl Tier {
    /// `backend` with `quota_bytes` of write-behind in flight at most, written behind on
    /// `write_behind_runtime` (`None`: the manager's runtime).
    pub(crate) fn new(
        backend: Arc<dyn StorageBackend>,
        quota_bytes: usize,
        write_behind_runtime: Option<Handle>,
    ) -> Self {
        Tier {
            counters: TierCounters::new(backend.name()),
            backend,
            write_behind: Arc::new(WriteBehindAdmission::new(quota_bytes)),
            write_behind_runtime,
        }
    }
}
