//! `RemoteConnector` (bytes in, bytes out) and the adapter that makes it a `StorageBackend`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use tracing::warn;

use crate::error::{BackendError, FormatError};
use crate::format::chunk_format::{
    ChunkCodec, DecodeExpectation, KeyBinding, decode_header, decode_payload_into,
};
use crate::keys::cache_key::CacheKey;
use crate::memory::pool::MemoryObjMut;
use crate::storage::backend::{
    BackendCounters, BackendStats, Chunk, ChunkAllocator, HeapChunkAllocator, PutOutcome,
    StorageBackend,
};
use crate::storage::tier_events::TierEventLog;

/// The small surface a third-party store implements: opaque values under string keys.
///
/// Batch-first: a store implements the four batch methods (with its real batch commands where
/// it has them: MGET, pipelines, concurrent requests) and `close`; the single-key methods are
/// one-item batches unless a store overrides them. Every call must be bounded in time: wrap
/// slow stores with a timeout rather than letting a call hang.
#[async_trait]
pub trait RemoteConnector: Send + Sync + 'static {
    /// Short name for logs and metrics.
    fn name(&self) -> &str;
    /// Whether each of `keys` exists, in order.
    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError>;
    /// The value of each of `keys` (`None`: absent), in order.
    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError>;
    /// Stores every entry.
    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError>;
    /// Deletes `keys`; returns how many existed.
    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError>;
    /// Closes connections; afterwards every call fails.
    async fn close(&self) -> Result<(), BackendError>;

    /// The manager's KV-event log, for values that leave the store on its own initiative
    /// (capacity evictions, expiry). The default ignores it.
    fn set_event_log(&self, _events: Arc<TierEventLog>) {}

    /// Whether a read is a copy out of memory on this node, with no network or disk I/O (the
    /// node's pool daemon). A lookup then loads this tier's chunks at once, so the request
    /// loads them before its forward pass like an L1 hit instead of waiting a step for an
    /// asynchronous load. The default is `false`.
    fn reads_node_memory(&self) -> bool {
        false
    }

    /// For a tier that [reads node memory](RemoteConnector::reads_node_memory): the values of
    /// `keys` held in that memory, reading no slower storage behind it (the daemon's own lower
    /// tiers), so that a lookup's load never waits on a disk or a network. The default is
    /// [`RemoteConnector::batch_get`].
    async fn batch_get_node_memory(
        &self,
        keys: &[String],
    ) -> Result<Vec<Option<Bytes>>, BackendError> {
        self.batch_get(keys).await
    }

    /// Whether `key` exists.
    async fn exists(&self, key: &str) -> Result<bool, BackendError> {
        let answers = self.batch_exists(&[key.to_string()]).await?;
        one_answer(self.name(), answers)
    }
    /// The value of `key`, if any.
    async fn get(&self, key: &str) -> Result<Option<Bytes>, BackendError> {
        let answers = self.batch_get(&[key.to_string()]).await?;
        one_answer(self.name(), answers)
    }
    /// Stores `value` under `key`.
    async fn put(&self, key: &str, value: Bytes) -> Result<(), BackendError> {
        self.batch_put(vec![(key.to_string(), value)]).await
    }
    /// Deletes `key`; returns whether it existed.
    async fn delete(&self, key: &str) -> Result<bool, BackendError> {
        Ok(self.batch_delete(&[key.to_string()]).await? > 0)
    }
}

/// The only answer of a one-key batch; a store that answers otherwise is in error.
fn one_answer<T>(backend: &str, answers: Vec<T>) -> Result<T, BackendError> {
    let count = answers.len();
    let mut answers = answers.into_iter();
    match (answers.next(), count) {
        (Some(answer), 1) => Ok(answer),
        _ => Err(BackendError::Unavailable {
            backend: backend.to_string(),
            reason: format!("answered {count} results for one key"),
        }),
    }
}

/// A boxed connector is a connector (what a registered backend factory returns).
#[async_trait]
impl RemoteConnector for Box<dyn RemoteConnector> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn reads_node_memory(&self) -> bool {
        (**self).reads_node_memory()
    }
    async fn batch_get_node_memory(
        &self,
        keys: &[String],
    ) -> Result<Vec<Option<Bytes>>, BackendError> {
        (**self).batch_get_node_memory(keys).await
    }
    async fn exists(&self, key: &str) -> Result<bool, BackendError> {
        (**self).exists(key).await
    }
    async fn get(&self, key: &str) -> Result<Option<Bytes>, BackendError> {
        (**self).get(key).await
    }
    async fn put(&self, key: &str, value: Bytes) -> Result<(), BackendError> {
        (**self).put(key, value).await
    }
    async fn delete(&self, key: &str) -> Result<bool, BackendError> {
        (**self).delete(key).await
    }
    async fn close(&self) -> Result<(), BackendError> {
        (**self).close().await
    }
    fn set_event_log(&self, events: Arc<TierEventLog>) {
        (**self).set_event_log(events)
    }
    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        (**self).batch_exists(keys).await
    }
    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        (**self).batch_get(keys).await
    }
    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        (**self).batch_put(entries).await
    }
    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        (**self).batch_delete(keys).await
    }
}

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

    fn decode(&self, key: &CacheKey, bytes: &[u8]) -> Result<Chunk, FormatError> {
        let expect = DecodeExpectation {
            max_raw_len: self.max_chunk_bytes,
            layout_fingerprint: Some(key.scope.layout_fingerprint),
            bytes_per_token: None,
            key: Some(KeyBinding::of(key)),
        };
        let header = decode_header(bytes, &expect)?;
        let len = header.raw_len as usize;
        let mut buf = if len == 0 {
            MemoryObjMut::heap(0)
        } else {
            self.allocator
                .allocate(len)
                .unwrap_or_else(|_| MemoryObjMut::heap(len))
        };
        decode_payload_into(bytes, &header, buf.as_mut_slice())?;
        Ok(Chunk {
            meta: header.meta,
            data: buf.freeze(),
        })
    }

    /// Decodes the values a batch get answered for `keys` (`names`: their strings), counting
    /// hits and misses; a value that fails its checks is a miss and is deleted from the store.
    async fn decode_values(
        &self,
        keys: &[CacheKey],
        names: &[String],
        values: Vec<Option<Bytes>>,
    ) -> Result<Vec<Option<Chunk>>, BackendError> {
        let mut out = Vec::with_capacity(keys.len());
        let mut corrupt = Vec::new();
        for ((key, name), value) in keys.iter().zip(names).zip(values) {
            let Some(bytes) = value else {
                self.counters.misses.add(1);
                out.push(None);
                continue;
            };
            match self.decode(key, &bytes) {
                Ok(chunk) => {
                    self.counters.hits.add(1);
                    self.counters.bytes_read.add(chunk.data.len() as u64);
                    out.push(Some(chunk));
                }
                Err(e) => {
                    warn!(backend = self.name(), key = %name, error = %e, "rejecting stored chunk");
                    self.counters.corrupt.add(1);
                    self.counters.misses.add(1);
                    metrics::counter!(crate::telemetry::CORRUPT_VALUES, "tier" => self.name().to_string())
                        .increment(1);
                    corrupt.push(name.clone());
                    out.push(None);
                }
            }
        }
        if !corrupt.is_empty()
            && let Err(e) = self.connector.batch_delete(&corrupt).await
        {
            warn!(backend = self.name(), error = %e, "could not delete corrupt chunks");
        }
        Ok(out)
    }
}

fn key_strings(keys: &[CacheKey]) -> Vec<String> {
    keys.iter().map(ToString::to_string).collect()
}

#[async_trait]
impl<C: RemoteConnector> StorageBackend for RemoteBackend<C> {
    fn name(&self) -> &str {
        self.connector.name()
    }

    fn reads_node_memory(&self) -> bool {
        self.connector.reads_node_memory()
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
        let names = key_strings(keys);
        let values = self.connector.batch_get(&names).await?;
        self.decode_values(keys, &names, values).await
    }

    async fn get_node_memory(&self, keys: &[CacheKey]) -> Result<Vec<Option<Chunk>>, BackendError> {
        self.ensure_open()?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let names = key_strings(keys);
        let values = self.connector.batch_get_node_memory(&names).await?;
        self.decode_values(keys, &names, values).await
    }

    async fn put(&self, entries: Vec<(CacheKey, Chunk)>) -> Result<PutOutcome, BackendError> {
        self.ensure_open()?;
        if entries.is_empty() {
            return Ok(PutOutcome::default());
        }
        let n = entries.len();
        let mut bytes_in = 0u64;
        let encoded: Vec<(String, Bytes)> = entries
            .into_iter()
            .map(|(k, c)| {
                bytes_in += c.data.len() as u64;
                (
                    k.to_string(),
                    Bytes::from(
                        self.codec
                            .encode(&c.meta, &KeyBinding::of(&k), c.data.as_slice()),
                    ),
                )
            })
            .collect();
        self.connector.batch_put(encoded).await?;
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
