//! Fault behaviour as wrappers around any `RemoteConnector`, never a second store (the
//! `testkit` feature: for tests, not for production): [`FaultInjector`] fails and corrupts at
//! fixed rates;
//! [`ControlledFaults`] has switches a test flips at run time (a dead server, slow writes, a
//! panicking backend) and counts what was asked.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use kvpool_core::storage::remote::{lends_node_memory_of, node_memory_mapping_of, node_memory_of};
use kvpool_core::{
    BackendError, CopyIn, CopyOut, LentBytes, NodeMemoryConnector, PinnedBytes, RemoteConnector,
};

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

    /// Fails every `fail_get_every`-th get.
    fn injected_get_failure(&self) -> Result<(), BackendError> {
        if Self::nth(&self.gets, self.fail_get_every) {
            return Err(BackendError::Unavailable {
                backend: self.inner.name().to_string(),
                reason: "injected failure".into(),
            });
        }
        Ok(())
    }
}

// Every method, forwarded or faulted, by construction: a wrapper that left one to the
// trait's default would silently change what the wrapped tier does (a daemon tier that stops
// lending node memory).
#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl<C: RemoteConnector> RemoteConnector for FaultInjector<C> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn node_memory(&self) -> Option<&dyn NodeMemoryConnector> {
        self.inner
            .node_memory()
            .map(|_| self as &dyn NodeMemoryConnector)
    }
    async fn get(&self, key: &str) -> Result<Option<Bytes>, BackendError> {
        self.injected_get_failure()?;
        self.inner.get(key).await
    }
    async fn put(&self, key: &str, value: Bytes) -> Result<(), BackendError> {
        // Through `batch_put`, which corrupts.
        self.batch_put(vec![(key.to_string(), value)]).await
    }
    fn set_event_log(
        &self,
        events: std::sync::Arc<kvpool_core::storage::tier_events::TierEventLog>,
    ) {
        self.inner.set_event_log(events);
    }
    async fn exists(&self, key: &str) -> Result<bool, BackendError> {
        self.inner.exists(key).await
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
        self.injected_get_failure()?;
        self.inner.batch_get(keys).await
    }
    async fn batch_get_each(&self, keys: &[String], visit: CopyOut) -> Result<(), BackendError> {
        self.injected_get_failure()?;
        self.inner.batch_get_each(keys, visit).await
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

// The node-memory side faulted like the rest: pins and copies out fail as gets do, values
// written in place or lent are corrupted as puts are.
#[async_trait]
impl<C: RemoteConnector> NodeMemoryConnector for FaultInjector<C> {
    fn lends(&self) -> bool {
        lends_node_memory_of(&self.inner)
    }
    fn node_memory_mapping(&self) -> Option<std::sync::Arc<kvpool_core::memory::SharedMapping>> {
        node_memory_mapping_of(&self.inner)
    }
    async fn batch_pin(&self, keys: &[String]) -> Result<Vec<Option<PinnedBytes>>, BackendError> {
        self.injected_get_failure()?;
        node_memory_of(&self.inner)?.batch_pin(keys).await
    }
    async fn batch_lend(&self, lens: &[usize]) -> Result<Vec<Option<LentBytes>>, BackendError> {
        node_memory_of(&self.inner)?.batch_lend(lens).await
    }
    /// Corrupts every `corrupt_put_every`-th value where it lies before committing it, as
    /// `batch_copy_in` does to what it writes.
    async fn batch_commit_lent(
        &self,
        entries: Vec<(String, LentBytes)>,
    ) -> Result<usize, BackendError> {
        for (_, bytes) in &entries {
            if bytes.usable() && Self::nth(&self.puts, self.corrupt_put_every) && !bytes.is_empty()
            {
                // SAFETY: a byte inside the lent memory, which the loan keeps mapped and
                // writable, and no reader sees before the commit below.
                unsafe { *((bytes.ptr() + bytes.len() / 2) as *mut u8) ^= 0xff };
            }
        }
        node_memory_of(&self.inner)?
            .batch_commit_lent(entries)
            .await
    }
    async fn batch_copy_out(
        &self,
        keys: &[String],
        resident_only: bool,
        copy_out: CopyOut,
    ) -> Result<(), BackendError> {
        self.injected_get_failure()?;
        node_memory_of(&self.inner)?
            .batch_copy_out(keys, resident_only, copy_out)
            .await
    }
    async fn batch_copy_in(
        &self,
        entries: Vec<(String, usize)>,
        copy_in: CopyIn,
    ) -> Result<(), BackendError> {
        let corrupt: Vec<bool> = entries
            .iter()
            .map(|(_, len)| Self::nth(&self.puts, self.corrupt_put_every) && *len > 0)
            .collect();
        let copy_in: CopyIn = Arc::new(move |i, dst| {
            copy_in(i, dst);
            if corrupt.get(i) == Some(&true) {
                let mid = dst.len() / 2;
                dst[mid] ^= 0x5a;
            }
        });
        node_memory_of(&self.inner)?
            .batch_copy_in(entries, copy_in)
            .await
    }
}

/// Switches shared by every clone of a [`ControlledFaults`] wrapper.
#[derive(Clone, Default, Debug)]
pub struct FaultSwitches {
    /// While set, every call fails as an unreachable server would.
    pub down: Arc<AtomicBool>,
    /// While set, every call (but `close`) never returns, as on a hung server without a timeout.
    pub hang: Arc<AtomicBool>,
    /// Each put (or batch put) first sleeps this many milliseconds.
    pub put_delay_ms: Arc<AtomicU64>,
    /// When above zero, `batch_get_each` reads the values, then visits them from a thread of
    /// its own after this many milliseconds while the call waits for it: a read that a
    /// timeout gives up on still visits, later (a tier's blocking read finishing in the
    /// background).
    pub late_visit_ms: Arc<AtomicU64>,
    /// While set, a put panics (a buggy third-party backend).
    pub panic_on_put: Arc<AtomicBool>,
    /// Values written.
    pub puts: Arc<AtomicU64>,
    /// Keys asked about (`exists` or `get`, per key), to count round trips per chunk.
    pub asks: Arc<AtomicU64>,
}

/// `inner` behind run-time [`FaultSwitches`]. Clones share the switches and, when `C`'s clones
/// share their store (as [`crate::InMemoryConnector`]'s do), the store too.
#[derive(Clone, Default)]
pub struct ControlledFaults<C> {
    inner: C,
    switches: FaultSwitches,
}

impl<C: RemoteConnector> ControlledFaults<C> {
    /// Wraps `inner` with every switch off.
    pub fn new(inner: C) -> Self {
        ControlledFaults {
            inner,
            switches: FaultSwitches::default(),
        }
    }

    /// The switches (shared with every clone).
    pub fn switches(&self) -> &FaultSwitches {
        &self.switches
    }

    /// The wrapped connector.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    async fn check(&self) -> Result<(), BackendError> {
        if self.switches.hang.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        if self.switches.down.load(Ordering::SeqCst) {
            return Err(BackendError::Unavailable {
                backend: self.inner.name().to_string(),
                reason: "connection refused (switched off)".into(),
            });
        }
        Ok(())
    }

    async fn ask(&self, keys: usize) -> Result<(), BackendError> {
        self.switches.asks.fetch_add(keys as u64, Ordering::SeqCst);
        self.check().await
    }

    async fn before_put(&self, values: usize) -> Result<(), BackendError> {
        let delay = self.switches.put_delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        self.check().await?;
        assert!(
            !self.switches.panic_on_put.load(Ordering::SeqCst),
            "ControlledFaults told to panic in put"
        );
        self.switches
            .puts
            .fetch_add(values as u64, Ordering::SeqCst);
        Ok(())
    }
}

// Every method, forwarded or faulted, by construction (see `FaultInjector`'s impl). Before,
// this one left the node-memory methods to the trait's defaults, so a daemon tier wrapped in
// it silently stopped lending.
#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl<C: RemoteConnector> RemoteConnector for ControlledFaults<C> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn node_memory(&self) -> Option<&dyn NodeMemoryConnector> {
        self.inner
            .node_memory()
            .map(|_| self as &dyn NodeMemoryConnector)
    }
    fn set_event_log(
        &self,
        events: std::sync::Arc<kvpool_core::storage::tier_events::TierEventLog>,
    ) {
        self.inner.set_event_log(events);
    }
    async fn exists(&self, key: &str) -> Result<bool, BackendError> {
        self.ask(1).await?;
        self.inner.exists(key).await
    }
    async fn get(&self, key: &str) -> Result<Option<Bytes>, BackendError> {
        self.ask(1).await?;
        self.inner.get(key).await
    }
    async fn put(&self, key: &str, value: Bytes) -> Result<(), BackendError> {
        self.before_put(1).await?;
        self.inner.put(key, value).await
    }
    async fn delete(&self, key: &str) -> Result<bool, BackendError> {
        self.check().await?;
        self.inner.delete(key).await
    }
    async fn close(&self) -> Result<(), BackendError> {
        self.inner.close().await
    }
    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        self.ask(keys.len()).await?;
        self.inner.batch_exists(keys).await
    }
    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        self.ask(keys.len()).await?;
        self.inner.batch_get(keys).await
    }
    async fn batch_get_each(&self, keys: &[String], visit: CopyOut) -> Result<(), BackendError> {
        self.ask(keys.len()).await?;
        let late = self.switches.late_visit_ms.load(Ordering::SeqCst);
        if late == 0 {
            return self.inner.batch_get_each(keys, visit).await;
        }
        let values = self.inner.batch_get(keys).await?;
        let visiting = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(late));
            for (i, value) in values.iter().enumerate() {
                if let Some(value) = value {
                    visit(i, value);
                }
            }
        });
        tokio::task::spawn_blocking(move || visiting.join())
            .await
            .map_err(|e| BackendError::Unavailable {
                backend: self.inner.name().to_string(),
                reason: e.to_string(),
            })?
            .map_err(|_| BackendError::Unavailable {
                backend: self.inner.name().to_string(),
                reason: "the visiting thread panicked".into(),
            })
    }
    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        self.before_put(entries.len()).await?;
        self.inner.batch_put(entries).await
    }
    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        self.check().await?;
        self.inner.batch_delete(keys).await
    }
}

// The node-memory side behind the same switches: pins and copies out are asks, loans and
// writes in place are puts.
#[async_trait]
impl<C: RemoteConnector> NodeMemoryConnector for ControlledFaults<C> {
    fn lends(&self) -> bool {
        lends_node_memory_of(&self.inner)
    }
    fn node_memory_mapping(&self) -> Option<std::sync::Arc<kvpool_core::memory::SharedMapping>> {
        node_memory_mapping_of(&self.inner)
    }
    async fn batch_pin(&self, keys: &[String]) -> Result<Vec<Option<PinnedBytes>>, BackendError> {
        self.ask(keys.len()).await?;
        node_memory_of(&self.inner)?.batch_pin(keys).await
    }
    async fn batch_lend(&self, lens: &[usize]) -> Result<Vec<Option<LentBytes>>, BackendError> {
        self.before_put(lens.len()).await?;
        node_memory_of(&self.inner)?.batch_lend(lens).await
    }
    async fn batch_commit_lent(
        &self,
        entries: Vec<(String, LentBytes)>,
    ) -> Result<usize, BackendError> {
        node_memory_of(&self.inner)?
            .batch_commit_lent(entries)
            .await
    }
    async fn batch_copy_out(
        &self,
        keys: &[String],
        resident_only: bool,
        copy_out: CopyOut,
    ) -> Result<(), BackendError> {
        self.ask(keys.len()).await?;
        node_memory_of(&self.inner)?
            .batch_copy_out(keys, resident_only, copy_out)
            .await
    }
    async fn batch_copy_in(
        &self,
        entries: Vec<(String, usize)>,
        copy_in: CopyIn,
    ) -> Result<(), BackendError> {
        self.before_put(entries.len()).await?;
        node_memory_of(&self.inner)?
            .batch_copy_in(entries, copy_in)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{InMemoryConnector, InMemoryNodeMemory};

    /// In-place writes are corrupted at the same rate as buffered ones: here every second
    /// value, one byte flipped after it was written.
    #[tokio::test]
    async fn in_place_writes_are_corrupted_like_puts() {
        let store = FaultInjector::new(InMemoryNodeMemory::default(), 0, 2);
        let entries = (0..4).map(|i| (format!("k{i}"), 64)).collect();
        store
            .node_memory()
            .expect("the wrapper offers its tier's node memory")
            .batch_copy_in(entries, Arc::new(|_, dst: &mut [u8]| dst.fill(7)))
            .await
            .unwrap();
        let keys: Vec<String> = (0..4).map(|i| format!("k{i}")).collect();
        let got = store.batch_get(&keys).await.unwrap();
        let intact: Vec<bool> = got
            .iter()
            .map(|v| v.as_deref() == Some(&[7u8; 64][..]))
            .collect();
        assert_eq!(intact, [true, false, true, false]);
    }

    /// Each wrapper offers its tier's node-memory side exactly when the tier has one: a
    /// wrapped daemon tier keeps lending, a wrapped store of bytes does not start to.
    #[test]
    fn wrappers_offer_node_memory_exactly_when_their_tier_does() {
        let limit = std::time::Duration::from_secs(1);
        let bytes_only: [Box<dyn RemoteConnector>; 3] = [
            Box::new(FaultInjector::new(InMemoryConnector::new(), 0, 0)),
            Box::new(ControlledFaults::new(InMemoryConnector::new())),
            Box::new(crate::TimeoutConnector::new(
                InMemoryConnector::new(),
                limit,
            )),
        ];
        assert!(bytes_only.iter().all(|c| c.node_memory().is_none()));
        let node_memory: [Box<dyn RemoteConnector>; 3] = [
            Box::new(FaultInjector::new(InMemoryNodeMemory::default(), 0, 0)),
            Box::new(ControlledFaults::new(InMemoryNodeMemory::default())),
            Box::new(crate::TimeoutConnector::new(
                InMemoryNodeMemory::default(),
                limit,
            )),
        ];
        // ... and lends exactly when it does (this store does not).
        assert!(
            node_memory
                .iter()
                .all(|c| c.node_memory().is_some_and(|tier| !tier.lends()))
        );
    }
}
