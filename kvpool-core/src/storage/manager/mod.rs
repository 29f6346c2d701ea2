//! The storage manager: ordered tiers, prefix lookup, promotion into L1, bounded write-behind.

mod get_each;
mod node_memory;
mod write_behind;

pub use node_memory::LentSaveSlots;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::runtime::Handle;
use tokio::sync::Semaphore;
use tracing::warn;

use crate::error::{BackendError, ConfigError, PoolError};
use crate::keys::cache_key::CacheKey;
use crate::memory::pool::MemoryObjMut;
use crate::storage::backend::{
    Chunk, ChunkAllocator, HeapChunkAllocator, PutOutcome, StorageBackend,
};
use crate::storage::tier::Tier;
use crate::storage::tier_events::{TierEventKind, TierEventLog};
use crate::storage::tier_stats::{ManagerCounters, TierOp};
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

    /// Index of L1 in [`StorageManager::tier_names`], if there is one.
    pub fn l1_tier(&self) -> Option<usize> {
        self.l1
    }

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
    async fn leading_run<'a, T, F>(
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
    async fn count_hits_and_promote(&self, keys: &[CacheKey], loaded: &[(usize, Chunk)]) {
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
