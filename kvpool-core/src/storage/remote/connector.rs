//! `RemoteConnector`: the small surface a third-party store implements (opaque values under
//! string keys, bytes in, bytes out).

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

use super::{CopyOut, NodeMemoryConnector};
use crate::error::BackendError;
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

    /// The tier's node-memory side, for a tier whose values lie in memory on this node that
    /// this process maps (the node's pool daemon): reads and writes with one copy, values lent
    /// where they lie. The default is `None`: bytes in, bytes out.
    fn node_memory(&self) -> Option<&dyn NodeMemoryConnector> {
        None
    }

    /// Reads `keys` and hands each value found to `visit(index, bytes)` while the tier holds
    /// it, one value at a time (an absent key is not visited). The default reads the whole
    /// batch with [`RemoteConnector::batch_get`], then visits each value. A tier that reads
    /// into buffers of its own overrides it so that one value's buffer is alive at a time and
    /// its memory is used again for the next (the disk tier: a fresh engine's first loads no
    /// longer fault in a buffer per value).
    ///
    /// The bytes handed to `visit` must not change until it returns: the pool checks a value
    /// where it lies and then copies it on ([`crate::StorageBackend::get_each`]). Memory
    /// another process can write (a shared mapping) is read through
    /// [`NodeMemoryConnector::batch_copy_out`] instead, whose copy is checked.
    async fn batch_get_each(&self, keys: &[String], visit: CopyOut) -> Result<(), BackendError> {
        visit_each(self.batch_get(keys).await?, visit);
        Ok(())
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

/// Hands each value of a batch read to `visit(index, bytes)`, skipping the absent ones: the
/// default [`RemoteConnector::batch_get_each`], for a wrapper that must read through its own
/// `batch_get` (a check or a transform of each value) rather than forward.
pub fn visit_each(values: Vec<Option<Bytes>>, visit: CopyOut) {
    for (i, value) in values.into_iter().enumerate() {
        if let Some(value) = value {
            visit(i, &value);
        }
    }
}

/// The only answer of a one-key batch (how the single-key calls read a one-item batch's
/// answer); a store that answers otherwise is in error.
pub fn one_answer<T>(backend: &str, answers: Vec<T>) -> Result<T, BackendError> {
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
    fn node_memory(&self) -> Option<&dyn NodeMemoryConnector> {
        (**self).node_memory()
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
    async fn batch_get_each(&self, keys: &[String], visit: CopyOut) -> Result<(), BackendError> {
        (**self).batch_get_each(keys, visit).await
    }
    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        (**self).batch_put(entries).await
    }
    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        (**self).batch_delete(keys).await
    }
}
