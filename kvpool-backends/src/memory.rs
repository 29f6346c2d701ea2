//! `memory://`: a process-local RemoteConnector over a HashMap (tests, demos, a reference).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::RwLock;

use kvpool_core::{BackendError, RemoteConnector};

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
