//! `RemoteConnector` (bytes in, bytes out) and the adapter that makes it a `StorageBackend`.

mod connector;
mod node_memory;
mod rejected;

pub use connector::{RemoteConnector, one_answer, visit_each};
pub use node_memory::{
    CopyIn, CopyOut, NodeMemoryConnector, lends_node_memory_of, node_memory_mapping_of,
    node_memory_of,
};
pub use rejected::{RejectedValue, delete_rejected, record_rejected};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;

use crate::error::{BackendError, FormatError};
use crate::format::chunk_format::{
    ChunkCodec, DecodeExpectation, HEADER_LEN, KeyBinding, decode_copied, decode_header,
    decode_payload_into,
};
use crate::keys::cache_key::CacheKey;
use crate::memory::pool::MemoryObjMut;
use crate::storage::backend::{
    BackendCounters, BackendStats, Chunk, ChunkAllocator, ChunkVisit, HeapChunkAllocator,
    NodeMemoryBackend, PutOutcome, StorageBackend, visit_found,
};
use crate::storage::node_memory::{SharedChunk, shared_chunk};
use crate::storage::save_slot::{LentBytes, SaveSlot};
use crate::storage::tier_events::TierEventLog;

/// Turns any [`RemoteConnector`] into a [`StorageBackend`] by applying the chunk format:
/// values are encoded with a checksummed header on `put` and fully validated on `get` (magic,
/// version, checksum, layout fingerprint of the key, size). A value that fails validation is
/// a miss and is deleted from the store, so the next store rewrites it.
pub struct RemoteBackend<C> {
    connector: C,
    codec: ChunkCodec,
    max_chunk_bytes: u64,
    allocator: Arc<dyn ChunkAllocator>,
    counters: BackendCounters,
    closed: AtomicBool,
}

impl<C: RemoteConnector> RemoteBackend<C> {
    /// Wraps `connector`; decoded values larger than `max_chunk_bytes` are rejected unread.
    pub fn new(connector: C, codec: ChunkCodec, max_chunk_bytes: u64) -> Self {
        RemoteBackend {
            connector,
            codec,
            max_chunk_bytes,
            allocator: Arc::new(HeapChunkAllocator),
            counters: BackendCounters::default(),
            closed: AtomicBool::new(false),
        }
    }

    /// Decodes loaded values into buffers from `allocator` (e.g. the L1 pool, so promotion
    /// needs no copy). Falls back to the heap when it is full.
    pub fn with_allocator(mut self, allocator: Arc<dyn ChunkAllocator>) -> Self {
        self.allocator = allocator;
        self
    }

    /// The wrapped connector.
    pub fn connector(&self) -> &C {
        &self.connector
    }

    fn ensure_open(&self) -> Result<(), BackendError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(BackendError::Closed(self.connector.name().to_string()));
        }
        Ok(())
    }

    /// Reads `keys` from node memory with one copy ([`NodeMemoryConnector::batch_copy_out`]),
    /// decoded and counted as [`RemoteBackend::decode_visited`] does.
    async fn copy_out_values(
        &self,
        keys: &[CacheKey],
        resident_only: bool,
    ) -> Result<Vec<Option<Chunk>>, BackendError> {
        let names = key_strings(keys);
        let tier = node_memory_of(&self.connector)?;
        self.decode_visited(keys, &names, |visit| {
            tier.batch_copy_out(&names, resident_only, visit)
        })
        .await
    }

    /// Reads `keys` with `read`, which hands each value to the visitor it is given while the
    /// tier holds it ([`RemoteConnector::batch_get_each`], or a copy out of node memory),
    /// counting and dropping what fails its checks as [`RemoteBackend::tally`] does.
    ///
    /// Each value is decoded by [`decode_copied`] into a buffer from this backend's allocator
    /// (L1's pool), checked against the key of the index the tier names, and kept in that
    /// index's slot, which this backend owns: a tier cannot hand back a chunk of its own or
    /// file one under another key.
    async fn decode_visited<F, Fut>(
        &self,
        keys: &[CacheKey],
        names: &[String],
        read: F,
    ) -> Result<Vec<Option<Chunk>>, BackendError>
    where
        F: FnOnce(CopyOut) -> Fut,
        Fut: std::future::Future<Output = Result<(), BackendError>>,
    {
        type Slots = Vec<Option<Checked<Chunk>>>;
        let slots: Arc<Mutex<Slots>> =
            Arc::new(Mutex::new((0..keys.len()).map(|_| None).collect()));
        let visit: CopyOut = {
            let keys = keys.to_vec();
            let slots = slots.clone();
            let allocator = self.allocator.clone();
            let max_chunk_bytes = self.max_chunk_bytes;
            Arc::new(move |i, bytes| {
                let Some(key) = keys.get(i) else { return };
                let expect = DecodeExpectation::bound_to(key, max_chunk_bytes);
                let decoded =
                    decode_copied(bytes, &expect, |len| allocate(allocator.as_ref(), len))
                        .map(|(header, buf)| Chunk {
                            meta: header.meta,
                            data: buf.freeze(),
                        })
                        .map_err(|error| Rejected::new(error, key, bytes));
                if let Some(slot) = slots.lock().get_mut(i) {
                    *slot = Some(decoded);
                }
            })
        };
        read(visit).await?;
        let decoded = std::mem::take(&mut *slots.lock());
        self.tally(names, decoded).await
    }

    /// Stores `entries` encoded in buffers of their own (two copies into the store).
    async fn encode_and_put(&self, entries: Vec<(CacheKey, Chunk)>) -> Result<(), BackendError> {
        let encoded: Vec<(String, Bytes)> = entries
            .into_iter()
            .map(|(k, c)| {
                let value = self
                    .codec
                    .encode(&c.meta, &KeyBinding::of(&k), c.data.as_slice());
                (k.to_string(), Bytes::from(value))
            })
            .collect();
        self.connector.batch_put(encoded).await
    }

    /// Stores `entries` in node memory, each encoded straight into the memory the tier lends
    /// ([`NodeMemoryConnector::batch_copy_in`]: one copy). Only for a codec that does not
    /// compress.
    async fn copy_in(&self, entries: Vec<(CacheKey, Chunk)>) -> Result<(), BackendError> {
        let codec = self.codec;
        let mut lens = Vec::with_capacity(entries.len());
        let mut values = Vec::with_capacity(entries.len());
        for (key, chunk) in entries {
            let len = codec
                .stored_len_uncompressed(chunk.data.len())
                .expect("checked: the codec does not compress");
            lens.push((key.to_string(), len));
            values.push((KeyBinding::of(&key), chunk));
        }
        let copy_in: CopyIn = Arc::new(move |i, dst| {
            let written = values.get(i).map(|(key, chunk)| {
                codec.encode_uncompressed_into(&chunk.meta, key, chunk.data.as_slice(), dst)
            });
            // Only an index or a destination the tier got wrong fails: zeroed, the value
            // is not a chunk, a miss when read.
            if !matches!(written, Some(Ok(()))) {
                dst.fill(0);
            }
        });
        node_memory_of(&self.connector)?
            .batch_copy_in(lens, copy_in)
            .await
    }

    /// Counts hits and misses of decoded values (`names`: their keys' strings); a value that
    /// failed its checks is a miss and is deleted from the store ([`delete_rejected`]: unless
    /// a good value was written under its key since).
    async fn tally(
        &self,
        names: &[String],
        decoded: Vec<Option<Checked<Chunk>>>,
    ) -> Result<Vec<Option<Chunk>>, BackendError> {
        self.tally_by(names, decoded, |c| c.data.len()).await
    }

    /// [`RemoteBackend::tally`] of values of any kind, `len` giving each one's bytes.
    async fn tally_by<T>(
        &self,
        names: &[String],
        decoded: Vec<Option<Checked<T>>>,
        len: impl Fn(&T) -> usize,
    ) -> Result<Vec<Option<T>>, BackendError> {
        let mut out = Vec::with_capacity(decoded.len());
        let mut corrupt = Vec::new();
        for (name, value) in names.iter().zip(decoded) {
            match value {
                None => {
                    self.counters.misses.add(1);
                    out.push(None);
                }
                Some(Ok(chunk)) => {
                    self.counters.hits.add(1);
                    self.counters.bytes_read.add(len(&chunk) as u64);
                    out.push(Some(chunk));
                }
                Some(Err(Rejected { error, value })) => {
                    record_rejected(self.name(), name, &error);
                    self.counters.corrupt.add(1);
                    self.counters.misses.add(1);
                    corrupt.extend(value);
                    out.push(None);
                }
            }
        }
        delete_rejected(&self.connector, corrupt).await;
        Ok(out)
    }
}

/// A value read, or what failed in it and what was read.
type Checked<T> = Result<T, Rejected>;

/// A value that failed its checks: why, and what was read (for [`delete_rejected`]; `None`
/// where the bytes could no longer be read, and nothing is deleted).
struct Rejected {
    error: FormatError,
    value: Option<RejectedValue>,
}

impl Rejected {
    fn new(error: FormatError, key: &CacheKey, bytes: &[u8]) -> Self {
        Rejected {
            error,
            value: Some(RejectedValue::new(key.to_string(), bytes)),
        }
    }
}

/// A buffer of `len` bytes from `allocator`, or from the heap when it has none.
fn allocate(allocator: &dyn ChunkAllocator, len: usize) -> MemoryObjMut {
    if len == 0 {
        return MemoryObjMut::heap(0);
    }
    allocator
        .allocate(len)
        .unwrap_or_else(|_| MemoryObjMut::heap(len))
}

fn key_strings(keys: &[CacheKey]) -> Vec<String> {
    keys.iter().map(ToString::to_string).collect()
}

#[async_trait]
impl<C: RemoteConnector> StorageBackend for RemoteBackend<C> {
    fn name(&self) -> &str {
        self.connector.name()
    }

    fn node_memory(&self) -> Option<&dyn NodeMemoryBackend> {
        self.connector
            .node_memory()
            .map(|_| self as &dyn NodeMemoryBackend)
    }

    async fn contains(&self, keys: &[CacheKey]) -> Result<Vec<bool>, BackendError> {
        self.ensure_open()?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        self.connector.batch_exists(&key_strings(keys)).await
    }

    async fn get(&self, keys: &[CacheKey]) -> Result<Vec<Option<Chunk>>, BackendError> {
        self.ensure_open()?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        if self.connector.node_memory().is_some() {
            return self.copy_out_values(keys, false).await;
        }
        // One value at a time, decoded while the tier holds it.
        let names = key_strings(keys);
        self.decode_visited(keys, &names, |visit| {
            self.connector.batch_get_each(&names, visit)
        })
        .await
    }

    /// Each value checked where the tier holds it (header, key, layout, checksum) and visited
    /// there, with no buffer of kvpool's own unless it is compressed: one copy fewer than
    /// [`StorageBackend::get`] for a caller that copies the chunk on. A value that fails a
    /// check is a miss and is deleted, as in `get`. Node memory is read as `get` reads it.
    async fn get_each(
        &self,
        keys: &[CacheKey],
        visit: ChunkVisit,
    ) -> Result<Vec<bool>, BackendError> {
        self.ensure_open()?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        if self.connector.node_memory().is_some() {
            let chunks = self.copy_out_values(keys, false).await?;
            return Ok(visit_found(&chunks, &visit));
        }
        type Outcomes = Vec<Option<Checked<usize>>>;
        let outcomes: Arc<Mutex<Outcomes>> =
            Arc::new(Mutex::new((0..keys.len()).map(|_| None).collect()));
        let check_and_visit: CopyOut = {
            let keys = keys.to_vec();
            let outcomes = outcomes.clone();
            let max_chunk_bytes = self.max_chunk_bytes;
            Arc::new(move |i, bytes| {
                let Some(key) = keys.get(i) else { return };
                let outcome =
                    decode_header(bytes, &DecodeExpectation::bound_to(key, max_chunk_bytes))
                        .and_then(|header| {
                            if header.compressed {
                                let mut data = vec![0; header.raw_len as usize];
                                decode_payload_into(bytes, &header, &mut data)?;
                                visit(i, &header.meta, &data);
                            } else {
                                visit(i, &header.meta, &bytes[HEADER_LEN..]);
                            }
                            Ok(header.raw_len as usize)
                        })
                        .map_err(|error| Rejected::new(error, key, bytes));
                if let Some(slot) = outcomes.lock().get_mut(i) {
                    *slot = Some(outcome);
                }
            })
        };
        let names = key_strings(keys);
        self.connector
            .batch_get_each(&names, check_and_visit)
            .await?;
        let outcomes = std::mem::take(&mut *outcomes.lock());
        let visited = self.tally_by(&names, outcomes, |len| *len).await?;
        Ok(visited.iter().map(Option::is_some).collect())
    }

    async fn put(&self, entries: Vec<(CacheKey, Chunk)>) -> Result<PutOutcome, BackendError> {
        self.ensure_open()?;
        if entries.is_empty() {
            return Ok(PutOutcome::default());
        }
        let n = entries.len();
        let bytes_in: u64 = entries.iter().map(|(_, c)| c.data.len() as u64).sum();
        let in_place = self.connector.node_memory().is_some() && !self.codec.compresses();
        if in_place {
            self.copy_in(entries).await?;
        } else {
            self.encode_and_put(entries).await?;
        }
        self.counters.puts.add(n as u64);
        self.counters.bytes_written.add(bytes_in);
        Ok(PutOutcome {
            stored: n,
            skipped: 0,
        })
    }

    async fn remove(&self, keys: &[CacheKey]) -> Result<usize, BackendError> {
        self.ensure_open()?;
        if keys.is_empty() {
            return Ok(0);
        }
        self.connector.batch_delete(&key_strings(keys)).await
    }

    async fn close(&self) -> Result<(), BackendError> {
        self.closed.store(true, Ordering::Release);
        self.connector.close().await
    }

    fn set_event_log(&self, events: Arc<TierEventLog>) {
        self.connector.set_event_log(events);
    }

    fn stats(&self) -> BackendStats {
        self.counters.snapshot(0, 0, None)
    }
}

/// A `RemoteBackend` over a tier in node memory: the chunk format applied to reads and writes
/// in place, and to chunks lent where they lie.
#[async_trait]
impl<C: RemoteConnector> NodeMemoryBackend for RemoteBackend<C> {
    async fn get_node_memory(&self, keys: &[CacheKey]) -> Result<Vec<Option<Chunk>>, BackendError> {
        self.ensure_open()?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        self.copy_out_values(keys, true).await
    }

    fn lends_node_memory(&self) -> bool {
        lends_node_memory_of(&self.connector) && !self.codec.compresses()
    }

    fn node_memory_mapping(&self) -> Option<Arc<crate::memory::SharedMapping>> {
        node_memory_mapping_of(&self.connector)
    }

    /// Pins the values node memory holds and checks each one's header where it lies
    /// ([`crate::format::chunk_format::check_before_copy`]); the payload's checksum is the reader's to
    /// check on its copy. A value whose header fails is a miss and is deleted, as in `get`.
    async fn pin_node_memory(
        &self,
        keys: &[CacheKey],
    ) -> Result<Vec<Option<SharedChunk>>, BackendError> {
        self.ensure_open()?;
        if keys.is_empty() || !self.lends_node_memory() {
            return Ok(keys.iter().map(|_| None).collect());
        }
        let names = key_strings(keys);
        let lent = node_memory_of(&self.connector)?.batch_pin(&names).await?;
        let checked = keys
            .iter()
            .zip(lent)
            .map(|(key, bytes)| {
                bytes.map(|b| {
                    shared_chunk(b, &DecodeExpectation::bound_to(key, self.max_chunk_bytes))
                        .map_err(|(error, b)| {
                            if b.usable() {
                                Rejected::new(error, key, b.bytes())
                            } else {
                                // Past its time the memory may hold another value by now:
                                // nothing to compare, so nothing deleted.
                                Rejected { error, value: None }
                            }
                        })
                })
            })
            .collect();
        self.tally_by(&names, checked, SharedChunk::payload_len)
            .await
    }

    /// Lends each value's place in node memory: its header, then a payload of the given
    /// length, encoded by this tier's codec (which does not compress, or the tier would not
    /// lend node memory).
    async fn lend_save_slots(
        &self,
        entries: &[(CacheKey, usize)],
    ) -> Result<Vec<Option<SaveSlot>>, BackendError> {
        self.ensure_open()?;
        if entries.is_empty() || !self.lends_node_memory() {
            return Ok(entries.iter().map(|_| None).collect());
        }
        let lens: Vec<usize> = entries.iter().map(|(_, len)| HEADER_LEN + len).collect();
        let lent = node_memory_of(&self.connector)?.batch_lend(&lens).await?;
        if lent.len() != entries.len() {
            return Err(BackendError::Unavailable {
                backend: self.connector.name().to_string(),
                reason: format!("lent {} places for {} values", lent.len(), entries.len()),
            });
        }
        Ok(entries
            .iter()
            .zip(lent)
            .zip(&lens)
            .map(|(((key, _), bytes), &len)| {
                bytes
                    .filter(|b| b.len() == len)
                    .map(|b| SaveSlot::new(b, key.clone(), self.codec))
            })
            .collect())
    }

    /// Commits the sealed slots; one not sealed, or no longer usable, is dropped (given
    /// back) and counted as skipped.
    async fn commit_save_slots(&self, slots: Vec<SaveSlot>) -> Result<PutOutcome, BackendError> {
        self.ensure_open()?;
        let n = slots.len();
        let entries: Vec<(String, LentBytes)> = slots
            .into_iter()
            .filter(|s| s.sealed().is_some() && s.usable())
            .map(|s| {
                let (key, bytes) = s.into_parts();
                (key.to_string(), bytes)
            })
            .collect();
        let stored = if entries.is_empty() {
            0
        } else {
            node_memory_of(&self.connector)?
                .batch_commit_lent(entries)
                .await?
                .min(n)
        };
        Ok(PutOutcome {
            stored,
            skipped: n - stored,
        })
    }
}
