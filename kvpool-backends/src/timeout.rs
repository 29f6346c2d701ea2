//! A RemoteConnector wrapper that bounds every call in time.

use std::future::Future;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use kvpool_core::storage::remote::{lends_node_memory_of, node_memory_mapping_of, node_memory_of};
use kvpool_core::{
    BackendError, CopyIn, CopyOut, LentBytes, NodeMemoryConnector, PinnedBytes, RemoteConnector,
};

/// The slowest write throughput a healthy tier is expected to manage (32 MiB/s).
pub const SLOWEST_WRITE_BYTES_PER_SEC: f64 = 32.0 * 1024.0 * 1024.0;

/// How many times the call limit `close` may take (it flushes what is buffered).
pub const CLOSE_LIMIT_FACTOR: u32 = 10;

/// Wraps a connector so every call, single or batch, fails with [`BackendError::Timeout`]
/// once `limit` has passed, instead of hanging on a dead server.
///
/// Writes get `limit` plus the time their bytes take at [`SLOWEST_WRITE_BYTES_PER_SEC`] (a
/// batch of large chunks to a busy disk is slow, not dead), and `close`, which flushes, gets
/// [`CLOSE_LIMIT_FACTOR`] times `limit`.
#[derive(Debug, Clone)]
pub struct TimeoutConnector<C> {
    inner: C,
    limit: Duration,
}

impl<C: RemoteConnector> TimeoutConnector<C> {
    /// Bounds each call of `inner` by `limit`.
    pub fn new(inner: C, limit: Duration) -> Self {
        TimeoutConnector { inner, limit }
    }

    /// The wrapped connector.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    async fn bounded<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T, BackendError>>,
    ) -> Result<T, BackendError> {
        self.bounded_by(op, self.limit, fut).await
    }

    /// The limit of a write of `bytes`.
    fn write_limit(&self, bytes: usize) -> Duration {
        self.limit + Duration::from_secs_f64(bytes as f64 / SLOWEST_WRITE_BYTES_PER_SEC)
    }

    async fn bounded_by<T>(
        &self,
        op: &'static str,
        limit: Duration,
        fut: impl Future<Output = Result<T, BackendError>>,
    ) -> Result<T, BackendError> {
        match tokio::time::timeout(limit, fut).await {
            Ok(r) => r,
            Err(_) => Err({
                metrics::counter!(kvpool_core::telemetry::TIMEOUTS, "tier" => self.inner.name().to_string())
                    .increment(1);
                BackendError::Timeout {
                    backend: self.inner.name().to_string(),
                    op,
                    millis: limit.as_millis() as u64,
                }
            }),
        }
    }
}

#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl<C: RemoteConnector> RemoteConnector for TimeoutConnector<C> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn set_event_log(
        &self,
        events: std::sync::Arc<kvpool_core::storage::tier_events::TierEventLog>,
    ) {
        self.inner.set_event_log(events);
    }
    fn node_memory(&self) -> Option<&dyn NodeMemoryConnector> {
        self.inner
            .node_memory()
            .map(|_| self as &dyn NodeMemoryConnector)
    }
    async fn exists(&self, key: &str) -> Result<bool, BackendError> {
        self.bounded("exists", self.inner.exists(key)).await
    }
    async fn get(&self, key: &str) -> Result<Option<Bytes>, BackendError> {
        self.bounded("get", self.inner.get(key)).await
    }
    async fn put(&self, key: &str, value: Bytes) -> Result<(), BackendError> {
        let limit = self.write_limit(value.len());
        self.bounded_by("put", limit, self.inner.put(key, value))
            .await
    }
    async fn delete(&self, key: &str) -> Result<bool, BackendError> {
        self.bounded("delete", self.inner.delete(key)).await
    }
    async fn close(&self) -> Result<(), BackendError> {
        let limit = self.limit * CLOSE_LIMIT_FACTOR;
        self.bounded_by("close", limit, self.inner.close()).await
    }
    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        self.bounded("batch_exists", self.inner.batch_exists(keys))
            .await
    }
    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        self.bounded("batch_get", self.inner.batch_get(keys)).await
    }
    async fn batch_get_each(
        &self,
        keys: &[String],
        visit: kvpool_core::CopyOut,
    ) -> Result<(), BackendError> {
        self.bounded("batch_get_each", self.inner.batch_get_each(keys, visit))
            .await
    }
    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        let limit = self.write_limit(entries.iter().map(|(_, v)| v.len()).sum());
        self.bounded_by("batch_put", limit, self.inner.batch_put(entries))
            .await
    }
    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        self.bounded("batch_delete", self.inner.batch_delete(keys))
            .await
    }
}

// Every node-memory call bounded too: the trait has no defaults to fall back on.
#[async_trait]
impl<C: RemoteConnector> NodeMemoryConnector for TimeoutConnector<C> {
    fn lends(&self) -> bool {
        lends_node_memory_of(&self.inner)
    }
    fn node_memory_mapping(&self) -> Option<std::sync::Arc<kvpool_core::memory::SharedMapping>> {
        node_memory_mapping_of(&self.inner)
    }
    async fn batch_pin(&self, keys: &[String]) -> Result<Vec<Option<PinnedBytes>>, BackendError> {
        self.bounded("batch_pin", node_memory_of(&self.inner)?.batch_pin(keys))
            .await
    }
    async fn batch_lend(&self, lens: &[usize]) -> Result<Vec<Option<LentBytes>>, BackendError> {
        self.bounded("batch_lend", node_memory_of(&self.inner)?.batch_lend(lens))
            .await
    }
    async fn batch_commit_lent(
        &self,
        entries: Vec<(String, LentBytes)>,
    ) -> Result<usize, BackendError> {
        self.bounded(
            "batch_commit_lent",
            node_memory_of(&self.inner)?.batch_commit_lent(entries),
        )
        .await
    }
    async fn batch_copy_out(
        &self,
        keys: &[String],
        resident_only: bool,
        copy_out: CopyOut,
    ) -> Result<(), BackendError> {
        self.bounded(
            "batch_copy_out",
            node_memory_of(&self.inner)?.batch_copy_out(keys, resident_only, copy_out),
        )
        .await
    }
    async fn batch_copy_in(
        &self,
        entries: Vec<(String, usize)>,
        copy_in: CopyIn,
    ) -> Result<(), BackendError> {
        let limit = self.write_limit(entries.iter().map(|(_, len)| len).sum());
        self.bounded_by(
            "batch_copy_in",
            limit,
            node_memory_of(&self.inner)?.batch_copy_in(entries, copy_in),
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::faults::ControlledFaults;
    use crate::memory::{InMemoryConnector, InMemoryNodeMemory};

    /// A connector whose calls never finish.
    fn hangs() -> ControlledFaults<InMemoryConnector> {
        hanging(InMemoryConnector::new())
    }

    /// `inner`, its calls never finishing.
    fn hanging<C: RemoteConnector>(inner: C) -> ControlledFaults<C> {
        let store = ControlledFaults::new(inner);
        store
            .switches()
            .hang
            .store(true, std::sync::atomic::Ordering::SeqCst);
        store
    }

    #[tokio::test(start_paused = true)]
    async fn hanging_calls_time_out_and_fast_ones_pass_through() {
        let slow = TimeoutConnector::new(hangs(), Duration::from_millis(250));
        let err = slow.batch_get(&["k".to_string()]).await.unwrap_err();
        assert!(
            matches!(
                err,
                BackendError::Timeout {
                    op: "batch_get",
                    millis: 250,
                    ..
                }
            ),
            "{err}"
        );
        assert!(slow.exists("k").await.is_err());
        let fast = TimeoutConnector::new(InMemoryConnector::new(), Duration::from_millis(250));
        fast.put("k", Bytes::from_static(b"v")).await.unwrap();
        assert_eq!(
            fast.get("k").await.unwrap().unwrap(),
            Bytes::from_static(b"v")
        );
    }

    /// A write's limit grows with its bytes: 64 MiB get two more seconds at 32 MiB/s, so a
    /// hung 64 MiB write fails after 2.25 s, not 0.25 s.
    #[tokio::test(start_paused = true)]
    async fn a_large_write_gets_time_for_its_bytes() {
        let slow = TimeoutConnector::new(hangs(), Duration::from_millis(250));
        let started = tokio::time::Instant::now();
        let err = slow
            .batch_put(vec![("k".into(), Bytes::from(vec![0u8; 64 << 20]))])
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                BackendError::Timeout {
                    op: "batch_put",
                    millis: 2250,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(started.elapsed(), Duration::from_millis(2250));
    }

    /// Node memory's in-place reads and writes are bounded as gets and puts are.
    #[tokio::test(start_paused = true)]
    async fn hung_in_place_reads_and_writes_time_out() {
        let slow = TimeoutConnector::new(
            hanging(InMemoryNodeMemory::default()),
            Duration::from_millis(250),
        );
        let slow = slow.node_memory().expect("its tier lies in node memory");
        let err = slow
            .batch_copy_out(&["k".to_string()], true, Arc::new(|_, _| {}))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                BackendError::Timeout {
                    op: "batch_copy_out",
                    millis: 250,
                    ..
                }
            ),
            "{err}"
        );
        let err = slow
            .batch_copy_in(vec![("k".into(), 64 << 20)], Arc::new(|_, _| {}))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                BackendError::Timeout {
                    op: "batch_copy_in",
                    millis: 2250,
                    ..
                }
            ),
            "{err}"
        );
    }
}
