//! Write-behind admission: what a write to a lower tier may start (a byte quota, never waited
//! for, and the keys in flight, not written twice at once), and the batches in flight counted
//! so `flush` and `close` can wait for them. The storage manager (`manager/write_behind.rs`)
//! and the pool daemon admit their writes below with it.

use std::collections::HashSet;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use tokio::sync::{Notify, Semaphore};

/// Counts write-behind batches in flight (each [`AdmittedBatch`] from admission until it is
/// dropped); [`Pending::wait_idle`] returns once none is left. Shared by every tier a pool
/// writes behind to, and published as `kvpool_write_behind_pending_batches`.
#[derive(Debug, Default)]
pub struct Pending {
    count: AtomicUsize,
    idle: Notify,
}

impl Pending {
    /// A batch was admitted.
    fn start(&self) {
        self.count.fetch_add(1, Ordering::SeqCst);
        metrics::gauge!(crate::telemetry::WRITE_BEHIND_PENDING).increment(1.0);
    }
    /// A batch ended (written, failed, or unwound by a panic).
    fn finish(&self) {
        metrics::gauge!(crate::telemetry::WRITE_BEHIND_PENDING).decrement(1.0);
        if self.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.idle.notify_waiters();
        }
    }
    /// Batches in flight now.
    pub fn batches(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
    /// Waits until no batch is in flight.
    pub async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.count.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// What a write-behind may start: bytes in flight up to a quota (an entry past it is dropped,
/// never waited for: the engine's step must not wait on a slow tier), and the keys in flight
/// (an entry whose key is being written already is skipped).
#[derive(Debug)]
pub struct WriteBehindAdmission<K> {
    in_flight: Mutex<HashSet<K>>,
    quota: Semaphore,
    quota_bytes: usize,
}

/// What [`WriteBehindAdmission::admit`] made of the entries offered.
#[derive(Debug)]
pub struct Admission<K: Hash + Eq> {
    /// Positions, in the order offered, of the entries admitted.
    pub admitted: Vec<usize>,
    /// Entries skipped as their key was in flight (or offered twice).
    pub deduplicated: u64,
    /// Entries dropped as the quota was spent.
    pub dropped: u64,
    /// Holds the admitted entries' keys and bytes until dropped; `None` when none was admitted.
    pub batch: Option<AdmittedBatch<K>>,
}

/// One admitted batch in flight. Dropping it (when its writes end, or when a panicking tier
/// unwinds the task holding it) returns its keys and bytes and ends its count in [`Pending`],
/// so a `flush` or `close` never waits for ever and the keys can be written again.
#[derive(Debug)]
pub struct AdmittedBatch<K: Hash + Eq> {
    admission: Arc<WriteBehindAdmission<K>>,
    keys: Vec<K>,
    permits: usize,
    pending: Arc<Pending>,
}

impl<K: Hash + Eq> AdmittedBatch<K> {
    /// The keys admitted, in the order offered.
    pub fn keys(&self) -> &[K] {
        &self.keys
    }
}

impl<K: Hash + Eq> Drop for AdmittedBatch<K> {
    fn drop(&mut self) {
        {
            let mut in_flight = self.admission.in_flight.lock();
            for k in &self.keys {
                in_flight.remove(k);
            }
        }
        self.admission.quota.add_permits(self.permits);
        self.pending.finish();
    }
}

impl<K: Hash + Eq + Clone> WriteBehindAdmission<K> {
    /// Admission with `quota_bytes` in flight at most (at most [`Semaphore::MAX_PERMITS`]).
    pub fn new(quota_bytes: usize) -> Self {
        let quota_bytes = quota_bytes.min(Semaphore::MAX_PERMITS);
        WriteBehindAdmission {
            in_flight: Mutex::new(HashSet::new()),
            quota: Semaphore::new(quota_bytes),
            quota_bytes,
        }
    }

    /// Bytes of admitted entries whose batch is still in flight.
    pub fn bytes_in_flight(&self) -> usize {
        self.quota_bytes - self.quota.available_permits()
    }

    /// Admits each of `offered` (a key and its value's length) whose key is not in flight and
    /// whose bytes fit in what is left of the quota; the batch admitted counts in `pending`
    /// until it is dropped.
    pub fn admit(
        self: &Arc<Self>,
        offered: impl IntoIterator<Item = (K, usize)>,
        pending: &Arc<Pending>,
    ) -> Admission<K> {
        let mut admission = Admission {
            admitted: Vec::new(),
            deduplicated: 0,
            dropped: 0,
            batch: None,
        };
        let mut keys = Vec::new();
        let mut permits = 0usize;
        {
            let mut in_flight = self.in_flight.lock();
            for (i, (key, len)) in offered.into_iter().enumerate() {
                if in_flight.contains(&key) {
                    admission.deduplicated += 1;
                    continue;
                }
                let need = u32::try_from(len.max(1)).unwrap_or(u32::MAX);
                match self.quota.try_acquire_many(need) {
                    Ok(p) => {
                        p.forget();
                        permits += need as usize;
                        in_flight.insert(key.clone());
                        keys.push(key);
                        admission.admitted.push(i);
                    }
                    Err(_) => admission.dropped += 1,
                }
            }
        }
        if !keys.is_empty() {
            pending.start();
            admission.batch = Some(AdmittedBatch {
                admission: self.clone(),
                keys,
                permits,
                pending: pending.clone(),
            });
        }
        admission
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_skips_keys_in_flight_and_drops_past_the_quota_until_the_batch_ends() {
        let admission = Arc::new(WriteBehindAdmission::<&str>::new(100));
        let pending = Arc::new(Pending::default());
        let first = admission.admit([("a", 40), ("b", 40), ("c", 40)], &pending);
        assert_eq!(first.admitted, vec![0, 1]);
        assert_eq!((first.deduplicated, first.dropped), (0, 1));
        assert_eq!(admission.bytes_in_flight(), 80);
        assert_eq!(pending.batches(), 1);
        // "a" is in flight; "d" fits in the 20 bytes left, "e" does not.
        let second = admission.admit([("a", 10), ("d", 20), ("e", 1)], &pending);
        assert_eq!(second.admitted, vec![1]);
        assert_eq!((second.deduplicated, second.dropped), (1, 1));
        assert_eq!(pending.batches(), 2);
        drop(first.batch);
        assert_eq!(admission.bytes_in_flight(), 20);
        let third = admission.admit([("a", 10), ("d", 10)], &pending);
        assert_eq!(third.admitted, vec![0]);
        assert_eq!(third.deduplicated, 1);
        drop((second.batch, third.batch));
        assert_eq!((admission.bytes_in_flight(), pending.batches()), (0, 0));
        let none = admission.admit([("x", 200)], &pending);
        assert!(none.batch.is_none());
        assert_eq!((none.dropped, pending.batches()), (1, 0));
    }
}
