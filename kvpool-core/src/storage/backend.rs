//! `StorageBackend`: the async, batch-first interface the storage manager drives, its values,
//! and `NodeMemoryBackend`, the extension of a tier whose chunks lie in memory on this node.

use std::sync::Arc;

use async_trait::async_trait;

use crate::error::{BackendError, PoolError};
use crate::format::chunk_format::ChunkMeta;
use crate::keys::cache_key::CacheKey;
use crate::memory::SharedMapping;
use crate::memory::pool::{MemoryObj, MemoryObjMut, MemoryPool};
use crate::storage::node_memory::SharedChunk;
use crate::storage::save_slot::SaveSlot;
use crate::telemetry::counter::StatCounter;

/// One stored chunk: its metadata and its decoded KV bytes (layer-major, see [`crate::KvLayout`]).
#[derive(Debug, Clone)]
pub struct Chunk {
    /// What the bytes are.
    pub meta: ChunkMeta,
    /// The bytes (shared; cloning is cheap).
    pub data: MemoryObj,
}

/// What a `put` did with the entries it was given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PutOutcome {
    /// Entries now stored.
    pub stored: usize,
    /// Entries skipped (no space, too large); the tier stays consistent.
    pub skipped: usize,
}

/// A snapshot of a backend's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BackendStats {
    /// Entries held (when the backend knows).
    pub entries: u64,
    /// Bytes held (when the backend knows).
    pub bytes: u64,
    /// Byte capacity, for bounded tiers.
    pub capacity_bytes: Option<u64>,
    /// Keys found by `get`.
    pub hits: u64,
    /// Keys not found (or rejected) by `get`.
    pub misses: u64,
    /// Entries written.
    pub puts: u64,
    /// Entries not written for lack of space.
    pub skipped_puts: u64,
    /// Entries evicted to make room.
    pub evictions: u64,
    /// Values that failed validation (checksum, layout, size) and were dropped.
    pub corrupt: u64,
    /// Bytes returned by `get`.
    pub bytes_read: u64,
    /// Bytes accepted by `put`.
    pub bytes_written: u64,
}

/// Lock-free counters behind [`BackendStats`], for backend implementations.
#[derive(Debug, Default)]
pub struct BackendCounters {
    /// See [`BackendStats::hits`].
    pub hits: StatCounter,
    /// See [`BackendStats::misses`].
    pub misses: StatCounter,
    /// See [`BackendStats::puts`].
    pub puts: StatCounter,
    /// See [`BackendStats::skipped_puts`].
    pub skipped_puts: StatCounter,
    /// See [`BackendStats::evictions`].
    pub evictions: StatCounter,
    /// See [`BackendStats::corrupt`].
    pub corrupt: StatCounter,
    /// See [`BackendStats::bytes_read`].
    pub bytes_read: StatCounter,
    /// See [`BackendStats::bytes_written`].
    pub bytes_written: StatCounter,
}

impl BackendCounters {
    /// Fills the counter fields of a [`BackendStats`].
    pub fn snapshot(&self, entries: u64, bytes: u64, capacity_bytes: Option<u64>) -> BackendStats {
        let l = StatCounter::get;
        BackendStats {
            entries,
            bytes,
            capacity_bytes,
            hits: l(&self.hits),
            misses: l(&self.misses),
            puts: l(&self.puts),
            skipped_puts: l(&self.skipped_puts),
            evictions: l(&self.evictions),
            corrupt: l(&self.corrupt),
            bytes_read: l(&self.bytes_read),
            bytes_written: l(&self.bytes_written),
        }
    }
}

/// What [`StorageBackend::get_each`] hands each chunk it reads to: `(index in the keys,
/// metadata, decoded bytes)`, called while the tier still holds the bytes. It may run on a
/// thread of the tier's own, and after the call that started it was given up on (a timeout):
/// a visitor that writes into memory the caller may reuse must stop writing first.
pub type ChunkVisit = Arc<dyn Fn(usize, &ChunkMeta, &[u8]) + Send + Sync>;

/// Visits each chunk of `chunks` that is there; `true` for those.
pub(crate) fn visit_found(chunks: &[Option<Chunk>], visit: &ChunkVisit) -> Vec<bool> {
    chunks
        .iter()
        .enumerate()
        .map(|(i, chunk)| {
            chunk.as_ref().is_some_and(|c| {
                visit(i, &c.meta, c.data.as_slice());
                true
            })
        })
        .collect()
}

/// A storage tier. Async and batch-first: one call per batch of keys, results in key order.
///
/// Best effort is the contract: a key a backend cannot serve is `false`/`None`, never wrong
/// bytes. Errors are for the tier as a whole (unreachable, closed); the storage manager turns
/// them into misses.
#[async_trait]
pub trait StorageBackend: Send + Sync + 'static {
    /// Short name for logs and metrics ("cpu", "disk", "redis").
    fn name(&self) -> &str;
    /// Which keys are present.
    async fn contains(&self, keys: &[CacheKey]) -> Result<Vec<bool>, BackendError>;
    /// Loads the keys; `None` for each one that is absent or failed validation.
    async fn get(&self, keys: &[CacheKey]) -> Result<Vec<Option<Chunk>>, BackendError>;
    /// Loads the keys and hands each chunk to `visit` instead of returning it, for a caller
    /// that copies chunks into memory of its own (a tier may then skip a buffer of its own);
    /// `true` for each key visited. Only checked chunks are visited. The default visits what
    /// [`StorageBackend::get`] returns.
    async fn get_each(
        &self,
        keys: &[CacheKey],
        visit: ChunkVisit,
    ) -> Result<Vec<bool>, BackendError> {
        Ok(visit_found(&self.get(keys).await?, &visit))
    }
    /// Stores the entries (replacing existing ones).
    async fn put(&self, entries: Vec<(CacheKey, Chunk)>) -> Result<PutOutcome, BackendError>;
    /// Removes the keys; returns how many existed.
    async fn remove(&self, keys: &[CacheKey]) -> Result<usize, BackendError>;
    /// Makes accepted writes durable/visible (no-op for memory tiers).
    async fn flush(&self) -> Result<(), BackendError> {
        Ok(())
    }
    /// Releases resources; later calls may fail with [`BackendError::Closed`].
    async fn close(&self) -> Result<(), BackendError>;
    /// Counters and occupancy.
    fn stats(&self) -> BackendStats;
    /// The manager's KV-event log, for chunks that leave this tier on its own initiative
    /// (evictions). The default ignores it: writes and removals the manager makes are recorded
    /// by the manager.
    fn set_event_log(&self, _events: std::sync::Arc<crate::storage::tier_events::TierEventLog>) {}
    /// The tier's node-memory side, for a tier whose chunks lie in memory on this node (the
    /// pool daemon; see [`crate::storage::remote::NodeMemoryConnector`]). The default is
    /// `None`.
    fn node_memory(&self) -> Option<&dyn NodeMemoryBackend> {
        None
    }
}

/// The extension a [`StorageBackend`] offers through
/// [`node_memory`](StorageBackend::node_memory) when its chunks lie in memory on this
/// node (a [`RemoteBackend`](crate::RemoteBackend) over a
/// [`NodeMemoryConnector`](crate::storage::remote::NodeMemoryConnector)): a read is a copy
/// with no I/O, so a lookup loads such a tier's chunks at once; where the codec does not
/// compress, chunks are lent where they lie and saves written in place.
#[async_trait]
pub trait NodeMemoryBackend: Send + Sync {
    /// [`StorageBackend::get`] of what that memory holds, reading
    /// no slower storage behind it.
    async fn get_node_memory(&self, keys: &[CacheKey]) -> Result<Vec<Option<Chunk>>, BackendError>;

    /// Whether the tier lends chunks where they lie ([`NodeMemoryBackend::pin_node_memory`],
    /// [`NodeMemoryBackend::lend_save_slots`]); `false` where its codec compresses.
    fn lends_node_memory(&self) -> bool;

    /// This process's mapping of that memory as mapped now (see
    /// [`NodeMemoryConnector::node_memory_mapping`](crate::storage::remote::NodeMemoryConnector::node_memory_mapping)).
    fn node_memory_mapping(&self) -> Option<Arc<SharedMapping>>;

    /// The chunks of `keys` that memory holds, pinned where they lie, headers checked,
    /// payloads to be checked on the reader's copy ([`SharedChunk`]); none where the tier does
    /// not [lend](NodeMemoryBackend::lends_node_memory).
    async fn pin_node_memory(
        &self,
        keys: &[CacheKey],
    ) -> Result<Vec<Option<SharedChunk>>, BackendError>;

    /// A place in that memory for each `(key, payload length)`, for a save to be copied
    /// straight into and committed with [`NodeMemoryBackend::commit_save_slots`] (`None` where
    /// the tier had no room or does not lend).
    async fn lend_save_slots(
        &self,
        entries: &[(CacheKey, usize)],
    ) -> Result<Vec<Option<SaveSlot>>, BackendError>;

    /// Stores the [sealed](SaveSlot::seal) slots this tier lent, each under its key; any other
    /// slot is given back and counted as skipped.
    async fn commit_save_slots(&self, slots: Vec<SaveSlot>) -> Result<PutOutcome, BackendError>;
}

/// Hands out buffers for chunks being stored or loaded (the L1 pool, evicting as needed).
pub trait ChunkAllocator: Send + Sync {
    /// A writable buffer of exactly `len` bytes, or an error the caller handles (skip).
    fn allocate(&self, len: usize) -> Result<MemoryObjMut, PoolError>;

    /// The one host memory region every buffer comes from, if there is one: `(first byte,
    /// length)` (an L1 pool's arena, which a GPU engine page-locks once for DMA).
    fn host_region(&self) -> Option<(usize, usize)> {
        None
    }

    /// Attaches `guard` to the memory of [`host_region`](Self::host_region), to end when that
    /// memory is freed (before it is); hands it back when there is no such region.
    fn attach_to_host_region(
        &self,
        guard: crate::memory::MemoryGuard,
    ) -> Result<(), crate::memory::MemoryGuard> {
        Err(guard)
    }
}

/// Plain heap buffers: for setups without an L1 pool.
#[derive(Debug, Default, Clone, Copy)]
pub struct HeapChunkAllocator;

impl ChunkAllocator for HeapChunkAllocator {
    fn allocate(&self, len: usize) -> Result<MemoryObjMut, PoolError> {
        if len == 0 {
            return Err(PoolError::ZeroSize);
        }
        Ok(MemoryObjMut::heap(len))
    }
}

impl ChunkAllocator for MemoryPool {
    fn allocate(&self, len: usize) -> Result<MemoryObjMut, PoolError> {
        MemoryPool::allocate(self, len)
    }

    fn host_region(&self) -> Option<(usize, usize)> {
        Some(self.arena_region())
    }

    fn attach_to_host_region(
        &self,
        guard: crate::memory::MemoryGuard,
    ) -> Result<(), crate::memory::MemoryGuard> {
        self.attach_to_arena(guard);
        Ok(())
    }
}
