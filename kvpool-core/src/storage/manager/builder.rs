//! Building a storage manager: L1, the lower tiers in lookup order, and where each lower
//! tier is written behind.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use tokio::runtime::Handle;
use tokio::sync::Semaphore;

use super::{StorageManager, StorageManagerConfig};
use crate::error::ConfigError;
use crate::storage::backend::{ChunkAllocator, HeapChunkAllocator, StorageBackend};
use crate::storage::tier::Tier;
use crate::storage::tier_events::TierEventLog;
use crate::storage::tier_stats::ManagerCounters;
use crate::storage::write_behind::Pending;

/// Builds a [`StorageManager`].
pub struct StorageManagerBuilder {
    l1: Option<(Arc<dyn StorageBackend>, Arc<dyn ChunkAllocator>)>,
    lower: Vec<(Arc<dyn StorageBackend>, Option<Handle>)>,
    config: StorageManagerConfig,
}

impl StorageManagerBuilder {
    /// The L1 tier, written synchronously, and the allocator that hands out its buffers.
    pub fn l1(
        mut self,
        backend: Arc<dyn StorageBackend>,
        allocator: Arc<dyn ChunkAllocator>,
    ) -> Self {
        self.l1 = Some((backend, allocator));
        self
    }

    /// A lower tier (disk, remote), written behind; tiers are looked up in the order added.
    pub fn lower(mut self, backend: Arc<dyn StorageBackend>) -> Self {
        self.lower.push((backend, None));
        self
    }

    /// A lower tier as [`StorageManagerBuilder::lower`] adds, whose write-behind runs on
    /// `runtime` (a runtime of low-priority threads, say) instead of the manager's.
    pub fn lower_written_behind_on(
        mut self,
        backend: Arc<dyn StorageBackend>,
        runtime: Handle,
    ) -> Self {
        self.lower.push((backend, Some(runtime)));
        self
    }

    /// Manager knobs.
    pub fn config(mut self, config: StorageManagerConfig) -> Self {
        self.config = config;
        self
    }

    /// Builds the manager; must run inside a tokio runtime (write-behind to a tier added
    /// without a runtime of its own spawns on it).
    pub fn build(self) -> Result<StorageManager, ConfigError> {
        let runtime = Handle::try_current().map_err(|_| ConfigError::Invalid {
            field: "runtime",
            reason: "the storage manager must be built inside a tokio runtime".into(),
        })?;
        if self.l1.is_none() && self.lower.is_empty() {
            return Err(ConfigError::Invalid {
                field: "tiers",
                reason: "no storage tier configured: enable local_cpu or add a lower tier".into(),
            });
        }
        let quota = self
            .config
            .write_behind_quota_bytes
            .min(Semaphore::MAX_PERMITS);
        let mk = |backend: Arc<dyn StorageBackend>, write_behind_runtime: Option<Handle>| {
            Arc::new(Tier::new(backend, quota, write_behind_runtime))
        };
        let mut tiers = Vec::new();
        let (l1, allocator): (Option<usize>, Arc<dyn ChunkAllocator>) = match self.l1 {
            Some((backend, allocator)) => {
                tiers.push(mk(backend, None));
                (Some(0), allocator)
            }
            None => (None, Arc::new(HeapChunkAllocator)),
        };
        tiers.extend(
            self.lower
                .into_iter()
                .map(|(backend, runtime)| mk(backend, runtime)),
        );
        let events = Arc::new(TierEventLog::default());
        for tier in &tiers {
            tier.backend.set_event_log(events.clone());
        }
        Ok(StorageManager {
            l1,
            tiers,
            allocator,
            config: self.config,
            runtime,
            pending: Arc::new(Pending::default()),
            counters: ManagerCounters::default(),
            closed: AtomicBool::new(false),
            events,
        })
    }
}

impl StorageManager {
    /// Starts building a manager.
    pub fn builder() -> StorageManagerBuilder {
        StorageManagerBuilder {
            l1: None,
            lower: Vec::new(),
            config: StorageManagerConfig::default(),
        }
    }
}
