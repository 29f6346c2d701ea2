//! A RemoteConnector wrapper that injects failures (tests, `kvpool sim --inject-failures`).

use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use bytes::Bytes;

use kvpool_core::{BackendError, RemoteConnector};

/// Fails every `fail_get_every`-th batch get (as an unreachable server would) and corrupts
/// every `corrupt_put_every`-th value it stores (one flipped byte). Zero turns a fault off.
pub struct FaultInjector<C> {
    inner: C,
    fail_get_every: u64,
    corrupt_put_every: u64,
    gets: AtomicU64,
    puts: AtomicU64,
}

impl<C: RemoteConnector> FaultInjector<C> {
    /// Wraps `inner`.
    pub fn new(inner: C, fail_get_every: u64, corrupt_put_every: u64) -> Self {
        FaultInjector {
            inner,
            fail_get_every,
            corrupt_put_every,
            gets: AtomicU64::new(0),
            puts: AtomicU64::new(0),
        }
    }

    fn nth(counter: &AtomicU64, every: u64) -> bool {
        every > 0 && (counter.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(every)
    }
}

#[async_trait]
impl<C: RemoteConnector> RemoteConnector for FaultInjector<C> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    async fn exists(&self, key: &str) -> Result<bool, BackendError> {
        self.inner.exists(key).await
    }
    async fn get(&self, key: &str) -> Result<Option<Bytes>, BackendError> {
        Ok(self.batch_get(&[key.to_string()]).await?.pop().flatten())
    }
    async fn put(&self, key: &str, value: Bytes) -> Result<(), BackendError> {
        self.batch_put(vec![(key.to_string(), value)]).await
    }
    async fn delete(&self, key: &str) -> Result<bool, BackendError> {
        self.inner.delete(key).await
    }
    async fn close(&self) -> Result<(), BackendError> {
        self.inner.close().await
    }
    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        self.inner.batch_exists(keys).await
    }
    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        if Self::nth(&self.gets, self.fail_get_every) {
            return Err(BackendError::Unavailable {
                backend: self.inner.name().to_string(),
                reason: "injected failure".into(),
            });
        }
        self.inner.batch_get(keys).await
    }
    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        let entries = entries
            .into_iter()
            .map(|(k, v)| {
                if Self::nth(&self.puts, self.corrupt_put_every) && !v.is_empty() {
                    let mut b = v.to_vec();
                    let mid = b.len() / 2;
                    b[mid] ^= 0x5a;
                    (k, Bytes::from(b))
                } else {
                    (k, v)
                }
            })
            .collect();
        self.inner.batch_put(entries).await
    }
    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        self.inner.batch_delete(keys).await
    }
}
