//! Fault behaviour as one wrapper around any `RemoteConnector`, never a second store (the
//! `testkit` feature: for tests, not for production): [`ControlledFaults`] fails and corrupts
//! at fixed rates ([`ControlledFaults::at_rates`]) and has switches a test flips at run time
//! (a dead server, slow writes, a panicking backend), and counts what was asked.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use kvpool_core::storage::remote::{lends_node_memory_of, node_memory_mapping_of, node_memory_of};
use kvpool_core::{
    BackendError, CopyIn, CopyOut, LentBytes, NodeMemoryConnector, PinnedBytes, RemoteConnector,
};

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

/// `inner` behind run-time [`FaultSwitches`] and fixed fault rates. Clones share the switches
/// and the rates' counts (the n-th value is counted over every clone) and, when `C`'s clones
/// share their store (as [`crate::InMemoryConnector`]'s do), the store too.
#[derive(Clone, Default)]
pub struct ControlledFaults<C> {
    inner: C,
    switches: FaultSwitches,
    rates: Arc<FaultRates>,
}

/// Faults at fixed rates, fixed when the wrapper is made: every n-th get fails, every n-th
/// value written is corrupted. Zero turns a fault off.
#[derive(Default)]
struct FaultRates {
    fail_get_every: u64,
    corrupt_put_every: u64,
    gets: AtomicU64,
    values: AtomicU64,
}

impl FaultRates {
    fn nth(counter: &AtomicU64, every: u64) -> bool {
        every > 0 && (counter.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(every)
    }

    /// Whether this get call is one that fails.
    fn fails_this_get(&self) -> bool {
        Self::nth(&self.gets, self.fail_get_every)
    }

    /// Whether the next value written (of `len` bytes) is one that is corrupted; an empty
    /// value is counted but has no byte to flip.
    fn corrupts_next_value(&self, len: usize) -> bool {
        Self::nth(&self.values, self.corrupt_put_every) && len > 0
    }

    /// `value`, with its middle byte flipped when it is one to corrupt.
    fn maybe_corrupt(&self, value: Bytes) -> Bytes {
        if !self.corrupts_next_value(value.len()) {
            return value;
        }
        let mut bytes = value.to_vec();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x5a;
        Bytes::from(bytes)
    }
}

impl<C: RemoteConnector> ControlledFaults<C> {
    /// Wraps `inner` with every switch off.
    pub fn new(inner: C) -> Self {
        Self::at_rates(inner, 0, 0)
    }

    /// Wraps `inner` with every switch off, failing every `fail_get_every`-th get call (a
    /// `get`, batch get, pin or copy out, as an unreachable server would) and corrupting every
    /// `corrupt_put_every`-th value written (one flipped byte, whether put, written in place or
    /// committed from a loan). Zero turns a fault off.
    pub fn at_rates(inner: C, fail_get_every: u64, corrupt_put_every: u64) -> Self {
        ControlledFaults {
            inner,
            switches: FaultSwitches::default(),
            rates: Arc::new(FaultRates {
                fail_get_every,
                corrupt_put_every,
                ..FaultRates::default()
            }),
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

    /// An ask that reads values: fails as well when it is the get the rate picks.
    async fn ask_to_read(&self, keys: usize) -> Result<(), BackendError> {
        self.ask(keys).await?;
        if self.rates.fails_this_get() {
            return Err(BackendError::Unavailable {
                backend: self.inner.name().to_string(),
                reason: "injected failure".into(),
            });
        }
        Ok(())
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

// Every method, forwarded or faulted, by construction: a wrapper that left one to the trait's
// default would silently change what the wrapped tier does (before, this one left the
// node-memory methods to the defaults, so a daemon tier wrapped in it stopped lending).
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
        self.ask_to_read(1).await?;
        self.inner.get(key).await
    }
    async fn put(&self, key: &str, value: Bytes) -> Result<(), BackendError> {
        self.before_put(1).await?;
        self.inner.put(key, self.rates.maybe_corrupt(value)).await
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
        self.ask_to_read(keys.len()).await?;
        self.inner.batch_get(keys).await
    }
    async fn batch_get_each(&self, keys: &[String], visit: CopyOut) -> Result<(), BackendError> {
        self.ask_to_read(keys.len()).await?;
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
        let entries = entries
            .into_iter()
            .map(|(key, value)| (key, self.rates.maybe_corrupt(value)))
            .collect();
        self.inner.batch_put(entries).await
    }
    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        self.check().await?;
        self.inner.batch_delete(keys).await
    }
}

// The node-memory side behind the same switches and rates: pins and copies out are reads,
// loans and writes in place are puts, and values written in place or committed from a loan
// are corrupted as puts are.
#[async_trait]
impl<C: RemoteConnector> NodeMemoryConnector for ControlledFaults<C> {
    fn lends(&self) -> bool {
        lends_node_memory_of(&self.inner)
    }
    fn node_memory_mapping(&self) -> Option<std::sync::Arc<kvpool_core::memory::SharedMapping>> {
        node_memory_mapping_of(&self.inner)
    }
    async fn batch_pin(&self, keys: &[String]) -> Result<Vec<Option<PinnedBytes>>, BackendError> {
        self.ask_to_read(keys.len()).await?;
        node_memory_of(&self.inner)?.batch_pin(keys).await
    }
    async fn batch_lend(&self, lens: &[usize]) -> Result<Vec<Option<LentBytes>>, BackendError> {
        self.before_put(lens.len()).await?;
        node_memory_of(&self.inner)?.batch_lend(lens).await
    }
    /// Corrupts the values the rate picks where they lie before committing them, as
    /// `batch_copy_in` does to what it writes.
    async fn batch_commit_lent(
        &self,
        entries: Vec<(String, LentBytes)>,
    ) -> Result<usize, BackendError> {
        for (_, bytes) in &entries {
            if bytes.usable() && self.rates.corrupts_next_value(bytes.len()) {
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
        self.ask_to_read(keys.len()).await?;
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
        let corrupt: Vec<bool> = entries
            .iter()
            .map(|(_, len)| self.rates.corrupts_next_value(*len))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{InMemoryConnector, InMemoryNodeMemory};

    /// In-place writes are corrupted at the same rate as buffered ones: here every second
    /// value, one byte flipped after it was written.
    #[tokio::test]
    async fn in_place_writes_are_corrupted_like_puts() {
        let store = ControlledFaults::at_rates(InMemoryNodeMemory::default(), 0, 2);
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

    /// Reads fail at the rate asked, counted over every kind of read call (get, batch get,
    /// pin, copy out) and shared by clones; `exists` is no read and never fails so.
    #[tokio::test]
    async fn every_nth_read_call_fails_whatever_its_kind() {
        let store = ControlledFaults::at_rates(InMemoryNodeMemory::default(), 2, 0);
        let clone = store.clone();
        let keys = vec!["k".to_string()];
        let node_memory = store.node_memory().expect("a node-memory tier");
        let failed = [
            store.get("k").await.is_err(),
            clone.batch_get(&keys).await.is_err(),
            node_memory.batch_pin(&keys).await.is_err(),
            store.exists("k").await.is_err(),
            clone.get("k").await.is_err(),
        ];
        assert_eq!(failed, [false, true, false, false, true]);
    }

    /// Each wrapper offers its tier's node-memory side exactly when the tier has one: a
    /// wrapped daemon tier keeps lending, a wrapped store of bytes does not start to.
    #[test]
    fn wrappers_offer_node_memory_exactly_when_their_tier_does() {
        let limit = std::time::Duration::from_secs(1);
        let bytes_only: [Box<dyn RemoteConnector>; 2] = [
            Box::new(ControlledFaults::new(InMemoryConnector::new())),
            Box::new(crate::TimeoutConnector::new(
                InMemoryConnector::new(),
                limit,
            )),
        ];
        assert!(bytes_only.iter().all(|c| c.node_memory().is_none()));
        let node_memory: [Box<dyn RemoteConnector>; 2] = [
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
