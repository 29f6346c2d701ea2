//! `memory://`: a process-local RemoteConnector over a HashMap (tests, demos, a reference),
//! and (the `testkit` feature) `InMemoryNodeMemory`, the same store with the node-memory side
//! the pool daemon's tier has.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::RwLock;

use kvpool_core::{BackendError, RemoteConnector};
#[cfg(feature = "testkit")]
use kvpool_core::{
    CopyIn, CopyOut, LentBytes, NodeMemoryConnector, PinnedBytes, memory::SharedMapping,
};

/// Values in a shared HashMap. Clones share the map, so a test can inspect or corrupt what
/// the pool stored.
#[derive(Clone, Default)]
pub struct InMemoryConnector {
    map: Arc<RwLock<HashMap<String, Bytes>>>,
    closed: Arc<AtomicBool>,
}

impl InMemoryConnector {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of stored values.
    pub fn len(&self) -> usize {
        self.map.read().len()
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.map.read().is_empty()
    }

    /// The raw stored value of `key` (what a test would find on the server).
    pub fn raw(&self, key: &str) -> Option<Bytes> {
        self.map.read().get(key).cloned()
    }

    /// Stores `value` under `key` directly, bypassing everything (a misrouted write in tests).
    pub fn insert_raw(&self, key: &str, value: Bytes) {
        self.map.write().insert(key.to_string(), value);
    }

    /// Every stored key, in no particular order.
    pub fn keys(&self) -> Vec<String> {
        self.map.read().keys().cloned().collect()
    }

    /// Replaces the raw stored value of `key`, if present (fault injection in tests).
    pub fn overwrite_raw(&self, key: &str, value: Bytes) -> bool {
        match self.map.write().get_mut(key) {
            Some(v) => {
                *v = value;
                true
            }
            None => false,
        }
    }

    fn check(&self) -> Result<(), BackendError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(BackendError::Closed("memory".into()));
        }
        Ok(())
    }
}

#[async_trait]
impl RemoteConnector for InMemoryConnector {
    fn name(&self) -> &str {
        "memory"
    }
    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        self.check()?;
        let map = self.map.read();
        Ok(keys.iter().map(|k| map.contains_key(k)).collect())
    }
    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        self.check()?;
        let map = self.map.read();
        Ok(keys.iter().map(|k| map.get(k).cloned()).collect())
    }
    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        self.check()?;
        self.map.write().extend(entries);
        Ok(())
    }
    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        self.check()?;
        let mut map = self.map.write();
        Ok(keys.iter().filter(|k| map.remove(*k).is_some()).count())
    }
    async fn close(&self) -> Result<(), BackendError> {
        self.closed.store(true, Ordering::Release);
        Ok(())
    }
}

/// An [`InMemoryConnector`] offering the [node-memory side](NodeMemoryConnector) of a tier in
/// shared memory: reads and writes copy the stored bytes themselves (one copy), and nothing is
/// pinned or lent. What a pool does with the pool daemon's tier, tested without a daemon.
#[cfg(feature = "testkit")]
#[derive(Clone, Default)]
pub struct InMemoryNodeMemory(pub InMemoryConnector);

#[cfg(feature = "testkit")]
#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl RemoteConnector for InMemoryNodeMemory {
    fn name(&self) -> &str {
        "memory"
    }
    fn node_memory(&self) -> Option<&dyn NodeMemoryConnector> {
        Some(self)
    }
    fn set_event_log(&self, events: Arc<kvpool_core::storage::tier_events::TierEventLog>) {
        self.0.set_event_log(events);
    }
    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        self.0.batch_exists(keys).await
    }
    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        self.0.batch_get(keys).await
    }
    async fn batch_get_each(&self, keys: &[String], visit: CopyOut) -> Result<(), BackendError> {
        self.0.batch_get_each(keys, visit).await
    }
    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        self.0.batch_put(entries).await
    }
    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        self.0.batch_delete(keys).await
    }
    async fn close(&self) -> Result<(), BackendError> {
        self.0.close().await
    }
    async fn exists(&self, key: &str) -> Result<bool, BackendError> {
        self.0.exists(key).await
    }
    async fn get(&self, key: &str) -> Result<Option<Bytes>, BackendError> {
        self.0.get(key).await
    }
    async fn put(&self, key: &str, value: Bytes) -> Result<(), BackendError> {
        self.0.put(key, value).await
    }
    async fn delete(&self, key: &str) -> Result<bool, BackendError> {
        self.0.delete(key).await
    }
}

#[cfg(feature = "testkit")]
#[async_trait]
impl NodeMemoryConnector for InMemoryNodeMemory {
    fn lends(&self) -> bool {
        false
    }
    fn node_memory_mapping(&self) -> Option<Arc<SharedMapping>> {
        None
    }
    /// Hands each stored value to `copy_out` as it lies in the map.
    async fn batch_copy_out(
        &self,
        keys: &[String],
        _resident_only: bool,
        copy_out: CopyOut,
    ) -> Result<(), BackendError> {
        self.0.check()?;
        let map = self.0.map.read();
        for (i, key) in keys.iter().enumerate() {
            if let Some(value) = map.get(key) {
                copy_out(i, value);
            }
        }
        Ok(())
    }
    /// Has `copy_in` write each value into a buffer of its length, then stores it.
    async fn batch_copy_in(
        &self,
        entries: Vec<(String, usize)>,
        copy_in: CopyIn,
    ) -> Result<(), BackendError> {
        self.0.check()?;
        let values = entries.into_iter().enumerate().map(|(i, (key, len))| {
            let mut value = vec![0u8; len];
            copy_in(i, &mut value);
            (key, Bytes::from(value))
        });
        self.0.map.write().extend(values);
        Ok(())
    }
    async fn batch_pin(&self, keys: &[String]) -> Result<Vec<Option<PinnedBytes>>, BackendError> {
        Ok(keys.iter().map(|_| None).collect())
    }
    async fn batch_lend(&self, lens: &[usize]) -> Result<Vec<Option<LentBytes>>, BackendError> {
        Ok(lens.iter().map(|_| None).collect())
    }
    async fn batch_commit_lent(
        &self,
        entries: Vec<(String, LentBytes)>,
    ) -> Result<usize, BackendError> {
        drop(entries);
        Ok(0)
    }
}
