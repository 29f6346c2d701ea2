//! The local CPU backend (L1): chunks in a bounded host memory pool, evicted by policy.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use parking_lot::Mutex;
use tracing::debug;

use kvpool_core::storage::backend::BackendCounters;
use kvpool_core::storage::tier_events::{TierEventKind, TierEventLog};
use kvpool_core::telemetry;
use kvpool_core::{
    BackendError, BackendStats, CacheKey, Chunk, ChunkAllocator, EvictionKind, EvictionPolicy,
    HostAllocator, MemoryObjMut, MemoryPool, PoolError, PutOutcome, StorageBackend,
};

struct CpuState {
    entries: HashMap<CacheKey, Chunk>,
    policy: Box<dyn EvictionPolicy<CacheKey>>,
    bytes: u64,
}

/// L1: chunks held in one pre-allocated arena (pinned when a CUDA allocator supplies it).
///
/// Its byte capacity is the arena size and can never be exceeded: every chunk it holds lives in
/// the arena, and a chunk that does not fit after eviction is skipped. Entries whose memory is
/// still referenced elsewhere (an in-flight retrieve or write-behind) are not evicted, since
/// dropping them would free nothing.
///
/// It is also the [`ChunkAllocator`] for the storage manager: buffers for chunks being stored
/// come from the same arena, evicting as needed, so storing them later costs no copy.
pub struct LocalCpuBackend {
    pool: MemoryPool,
    state: Mutex<CpuState>,
    counters: BackendCounters,
    closed: AtomicBool,
    /// `kvpool_l1_used_bytes`, set after every change.
    used_bytes: metrics::Gauge,
    /// Where evictions are reported as KV events (set by the storage manager).
    events: std::sync::OnceLock<Arc<TierEventLog>>,
}

impl std::fmt::Debug for LocalCpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalCpuBackend")
            .field("pool", &self.pool)
            .finish()
    }
}

impl LocalCpuBackend {
    /// An L1 of `capacity` bytes of heap memory.
    pub fn new(capacity: usize, eviction: EvictionKind) -> Result<Self, PoolError> {
        Ok(Self::with_pool(MemoryPool::new(capacity)?, eviction))
    }

    /// An L1 whose arena comes from `allocator` (e.g. CUDA pinned memory).
    pub fn with_allocator(
        capacity: usize,
        allocator: &dyn HostAllocator,
        eviction: EvictionKind,
    ) -> Result<Self, PoolError> {
        Ok(Self::with_pool(
            MemoryPool::with_allocator(capacity, allocator)?,
            eviction,
        ))
    }

    /// An L1 over an existing pool.
    pub fn with_pool(pool: MemoryPool, eviction: EvictionKind) -> Self {
        metrics::gauge!(telemetry::L1_CAPACITY_BYTES).set(pool.capacity() as f64);
        LocalCpuBackend {
            state: Mutex::new(CpuState {
                entries: HashMap::new(),
                policy: eviction.build(pool.capacity()),
                bytes: 0,
            }),
            pool,
            counters: BackendCounters::default(),
            closed: AtomicBool::new(false),
            used_bytes: metrics::gauge!(telemetry::L1_USED_BYTES),
            events: std::sync::OnceLock::new(),
        }
    }

    /// The memory pool.
    pub fn pool(&self) -> &MemoryPool {
        &self.pool
    }

    fn ensure_open(&self) -> Result<(), BackendError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(BackendError::Closed("cpu".into()));
        }
        Ok(())
    }

    /// Evicts one entry whose memory only the index holds. Returns false if there is none.
    fn evict_one(&self, st: &mut CpuState) -> bool {
        let CpuState {
            entries, policy, ..
        } = st;
        let victim =
            policy.pop_victim(&mut |k| entries.get(k).is_some_and(|c| c.data.ref_count() == 1));
        match victim.and_then(|k| entries.remove(&k).map(|c| (k, c))) {
            Some((key, chunk)) => {
                st.bytes -= chunk.data.len() as u64;
                self.counters.evictions.add(1);
                metrics::counter!(telemetry::EVICTIONS, "tier" => "cpu").increment(1);
                if let Some(events) = self.events.get() {
                    events.record("cpu", TierEventKind::Removed, [&key]);
                }
                debug!(key = %key, bytes = chunk.data.len(), "evicted from L1");
                true
            }
            None => false,
        }
    }

    fn allocate_locked(&self, st: &mut CpuState, len: usize) -> Result<MemoryObjMut, PoolError> {
        loop {
            match self.pool.allocate(len) {
                Ok(buf) => return Ok(buf),
                Err(PoolError::OutOfMemory { .. }) if self.evict_one(st) => continue,
                Err(e) => return Err(e),
            }
        }
    }
}

impl ChunkAllocator for LocalCpuBackend {
    fn allocate(&self, len: usize) -> Result<MemoryObjMut, PoolError> {
        let mut st = self.state.lock();
        self.allocate_locked(&mut st, len)
    }

    fn host_region(&self) -> Option<(usize, usize)> {
        Some(self.pool.arena_region())
    }

    fn attach_to_host_region(
        &self,
        guard: kvpool_core::memory::MemoryGuard,
    ) -> Result<(), kvpool_core::memory::MemoryGuard> {
        self.pool.attach_to_arena(guard);
        Ok(())
    }
}

#[async_trait]
impl StorageBackend for LocalCpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }

    async fn contains(&self, keys: &[CacheKey]) -> Result<Vec<bool>, BackendError> {
        self.ensure_open()?;
        let st = self.state.lock();
        Ok(keys.iter().map(|k| st.entries.contains_key(k)).collect())
    }

    async fn get(&self, keys: &[CacheKey]) -> Result<Vec<Option<Chunk>>, BackendError> {
        self.ensure_open()?;
        let mut st = self.state.lock();
        let mut out = Vec::with_capacity(keys.len());
        let (mut hits, mut bytes) = (0u64, 0u64);
        for k in keys {
            let found = st.entries.get(k).cloned();
            if let Some(c) = &found {
                hits += 1;
                bytes += c.data.len() as u64;
                st.policy.on_access(k);
            }
            out.push(found);
        }
        drop(st);
        self.counters.hits.add(hits);
        self.counters.misses.add(keys.len() as u64 - hits);
        self.counters.bytes_read.add(bytes);
        Ok(out)
    }

    async fn put(&self, entries: Vec<(CacheKey, Chunk)>) -> Result<PutOutcome, BackendError> {
        self.ensure_open()?;
        let mut outcome = PutOutcome::default();
        let mut st = self.state.lock();
        for (key, chunk) in entries {
            if let Some(old) = st.entries.remove(&key) {
                // A put replaces: drop the old value first so its space can be reused.
                st.bytes -= old.data.len() as u64;
                st.policy.on_remove(&key);
            }
            let chunk = if self.pool.owns(&chunk.data) {
                chunk
            } else {
                match self.allocate_locked(&mut st, chunk.data.len()) {
                    Ok(mut buf) => {
                        buf.as_mut_slice().copy_from_slice(chunk.data.as_slice());
                        Chunk {
                            meta: chunk.meta,
                            data: buf.freeze(),
                        }
                    }
                    Err(e) => {
                        debug!(key = %key, error = %e, "L1 full of pinned chunks; skipping put");
                        outcome.skipped += 1;
                        continue;
                    }
                }
            };
            let len = chunk.data.len();
            st.bytes += len as u64;
            st.policy.on_insert(key.clone(), len);
            st.entries.insert(key, chunk);
            outcome.stored += 1;
            self.counters.bytes_written.add(len as u64);
        }
        self.used_bytes.set(st.bytes as f64);
        drop(st);
        self.counters.puts.add(outcome.stored as u64);
        self.counters.skipped_puts.add(outcome.skipped as u64);
        Ok(outcome)
    }

    async fn remove(&self, keys: &[CacheKey]) -> Result<usize, BackendError> {
        self.ensure_open()?;
        let mut st = self.state.lock();
        let mut n = 0;
        for k in keys {
            if let Some(c) = st.entries.remove(k) {
                st.bytes -= c.data.len() as u64;
                st.policy.on_remove(k);
                n += 1;
            }
        }
        self.used_bytes.set(st.bytes as f64);
        Ok(n)
    }

    async fn close(&self) -> Result<(), BackendError> {
        self.closed.store(true, Ordering::Release);
        let mut st = self.state.lock();
        let keys: Vec<CacheKey> = st.entries.keys().cloned().collect();
        for k in &keys {
            st.policy.on_remove(k);
        }
        st.entries.clear();
        st.bytes = 0;
        self.used_bytes.set(0.0);
        Ok(())
    }

    fn set_event_log(&self, events: Arc<TierEventLog>) {
        let _ = self.events.set(events);
    }

    fn stats(&self) -> BackendStats {
        let st = self.state.lock();
        self.counters.snapshot(
            st.entries.len() as u64,
            st.bytes,
            Some(self.pool.capacity() as u64),
        )
    }
}
