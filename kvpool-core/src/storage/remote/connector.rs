//! `RemoteConnector`: the small surface a third-party store implements (opaque values under
//! string keys, bytes in, bytes out), with the node-memory reads and writes a tier in shared
//! memory adds.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

use crate::error::BackendError;
use crate::memory::SharedMapping;
use crate::storage::node_memory::PinnedBytes;
use crate::storage::save_slot::LentBytes;
use crate::storage::tier_events::TierEventLog;

/// What a read of node memory does with one value it found ([`RemoteConnector::batch_copy_out`]):
/// given the value's index in the batch and its bytes where they lie (which another process
/// can write), copies them into this process's memory and checks the copy. The reader keeps
/// what it copied, under that index; a tier only hands out bytes.
pub type CopyOut = Arc<dyn Fn(usize, &[u8]) + Send + Sync>;

/// What a write to node memory does with one value ([`RemoteConnector::batch_copy_in`]):
/// given the value's index in the batch and the memory the tier allocated for it, exactly as
/// long as asked, writes the value there.
pub type CopyIn = Arc<dyn Fn(usize, &mut [u8]) + Send + Sync>;

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

    /// For a tier that [reads node memory](RemoteConnector::reads_node_memory): reads the
    /// values of `keys` where that memory holds them and hands each one found, as
    /// `copy_out(i, bytes)` for `keys[i]`, to `copy_out` while the tier keeps it pinned;
    /// `copy_out` copies it into this process's memory and checks the copy (one copy, where
    /// [`RemoteConnector::batch_get`] is two). With `resident_only`, only the values that memory
    /// holds are read, and no slower storage behind it (the daemon's own lower tiers), so that
    /// a lookup's load never waits on a disk or a network.
    ///
    /// The default reads them with [`RemoteConnector::batch_get`] and copies those.
    async fn batch_copy_out(
        &self,
        keys: &[String],
        _resident_only: bool,
        copy_out: CopyOut,
    ) -> Result<(), BackendError> {
        let values = self.batch_get(keys).await?;
        for (i, value) in values.into_iter().enumerate() {
            if let Some(bytes) = value {
                copy_out(i, &bytes);
            }
        }
        Ok(())
    }

    /// Whether the tier lends values where they lie in node memory
    /// ([`RemoteConnector::batch_pin`]), so a reader can copy them once, straight to where it
    /// needs them. The default is `false`.
    fn lends_node_memory(&self) -> bool {
        false
    }

    /// For a tier that [lends node memory](RemoteConnector::lends_node_memory): this process's
    /// mapping of that memory as mapped now (`None` before the first attach), for a reader to
    /// register for DMA (CUDA's page-locking) for as long as it holds the mapping. The
    /// default is `None`.
    fn node_memory_mapping(&self) -> Option<Arc<SharedMapping>> {
        None
    }

    /// For a tier that [lends node memory](RemoteConnector::lends_node_memory): pins the
    /// values of `keys` that its memory holds (reading no slower storage behind it) and lends
    /// each where it lies until its [`PinnedBytes`] is dropped. The default lends nothing.
    async fn batch_pin(&self, keys: &[String]) -> Result<Vec<Option<PinnedBytes>>, BackendError> {
        Ok(keys.iter().map(|_| None).collect())
    }

    /// For a tier that [lends node memory](RemoteConnector::lends_node_memory): allocates a
    /// value of each length where it will lie, outside the tier's index until
    /// [committed](RemoteConnector::batch_commit_lent), and lends it to be written there
    /// (`None` where there was no room). The default lends nothing.
    async fn batch_lend(&self, lens: &[usize]) -> Result<Vec<Option<LentBytes>>, BackendError> {
        Ok(lens.iter().map(|_| None).collect())
    }

    /// Publishes values written into memory this tier [lent](RemoteConnector::batch_lend),
    /// each under its key; returns how many were stored (a loan past its time, or one the
    /// tier no longer knows, stores nothing). The default stores nothing.
    async fn batch_commit_lent(
        &self,
        entries: Vec<(String, LentBytes)>,
    ) -> Result<usize, BackendError> {
        drop(entries);
        Ok(0)
    }

    /// For a tier that [reads node memory](RemoteConnector::reads_node_memory): stores a
    /// value of each length under its key, each written by `copy_in` straight into the memory
    /// the tier allocated for it (one copy, where [`RemoteConnector::batch_put`] is two). A
    /// value becomes visible only once written.
    ///
    /// The default writes each value into a buffer and stores those with `batch_put`.
    async fn batch_copy_in(
        &self,
        entries: Vec<(String, usize)>,
        copy_in: CopyIn,
    ) -> Result<(), BackendError> {
        let values = entries
            .into_iter()
            .enumerate()
            .map(|(i, (key, len))| {
                let mut value = vec![0u8; len];
                copy_in(i, &mut value);
                (key, Bytes::from(value))
            })
            .collect();
        self.batch_put(values).await
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
#[deny(clippy::missing_trait_methods)]
impl RemoteConnector for Box<dyn RemoteConnector> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn reads_node_memory(&self) -> bool {
        (**self).reads_node_memory()
    }
    fn lends_node_memory(&self) -> bool {
        (**self).lends_node_memory()
    }
    fn node_memory_mapping(&self) -> Option<Arc<SharedMapping>> {
        (**self).node_memory_mapping()
    }
    async fn batch_pin(&self, keys: &[String]) -> Result<Vec<Option<PinnedBytes>>, BackendError> {
        (**self).batch_pin(keys).await
    }
    async fn batch_copy_out(
        &self,
        keys: &[String],
        resident_only: bool,
        copy_out: CopyOut,
    ) -> Result<(), BackendError> {
        (**self).batch_copy_out(keys, resident_only, copy_out).await
    }
    async fn batch_lend(&self, lens: &[usize]) -> Result<Vec<Option<LentBytes>>, BackendError> {
        (**self).batch_lend(lens).await
    }
    async fn batch_commit_lent(
        &self,
        entries: Vec<(String, LentBytes)>,
    ) -> Result<usize, BackendError> {
        (**self).batch_commit_lent(entries).await
    }
    async fn batch_copy_in(
        &self,
        entries: Vec<(String, usize)>,
        copy_in: CopyIn,
    ) -> Result<(), BackendError> {
        (**self).batch_copy_in(entries, copy_in).await
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
