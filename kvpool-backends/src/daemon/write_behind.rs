//! The daemon's writes of committed values to its lower tiers: each tier admitted by the
//! core's write-behind admission (its own byte quota and keys in flight), written on its own
//! runtime, counted.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvpool_core::memory::MemoryObj;
use kvpool_core::storage::remote::RemoteConnector;
use kvpool_core::storage::write_behind::{Pending, WriteBehindAdmission};
use tokio::runtime::Handle;
use tracing::{debug, warn};

use super::lower_tiers::{check_stored_value, is_kvpool_key, tier_op_seconds};

/// What the daemon's write-behind counts, per tier: a value written to two tiers counts in
/// each.
#[derive(Default)]
struct Counters {
    /// Values not written to a tier: that tier's quota was full.
    dropped: AtomicU64,
    /// Values not written to a tier: the key was being written to that tier already.
    deduplicated: AtomicU64,
    /// Values a tier accepted.
    written: AtomicU64,
}

/// One lower tier and how it is written behind: on which runtime, and what may start (its own
/// byte quota and keys in flight, as each lower tier of an engine's pool has: a slow tier
/// fills only its own quota).
struct TierWrites {
    tier: Arc<dyn RemoteConnector>,
    runtime: Handle,
    admission: Arc<WriteBehindAdmission<String>>,
}

/// The daemon's writes to its lower tiers.
pub(super) struct DaemonWriteBehind {
    tiers: Vec<TierWrites>,
    /// Batches in flight over all tiers (what `close` waits for).
    pending: Arc<Pending>,
    counters: Arc<Counters>,
    /// The daemon's runtime: committed values are copied out of the arena and checked there.
    runtime: Handle,
    /// The daemon's tenant, a label of the tier latency histogram.
    tenant: String,
}

impl DaemonWriteBehind {
    /// Writes behind to each of `tiers` on `runtime`, within `quota` bytes per tier.
    pub(super) fn new(
        tiers: &[Arc<dyn RemoteConnector>],
        quota: usize,
        runtime: Handle,
        tenant: String,
    ) -> Self {
        DaemonWriteBehind {
            tiers: tiers
                .iter()
                .map(|tier| TierWrites {
                    tier: tier.clone(),
                    runtime: runtime.clone(),
                    admission: Arc::new(WriteBehindAdmission::new(quota)),
                })
                .collect(),
            pending: Arc::default(),
            counters: Arc::default(),
            runtime,
            tenant,
        }
    }

    /// Runs the writes to tier `tier` (its position in `new`'s `tiers`) on `runtime`.
    ///
    /// # Panics
    ///
    /// If there is no tier at `tier`.
    pub(super) fn write_tier_on(&mut self, tier: usize, runtime: Handle) {
        self.tiers[tier].runtime = runtime;
    }

    /// Values not written to a tier because its quota was full (one per tier).
    pub(super) fn dropped(&self) -> u64 {
        self.counters.dropped.load(Ordering::Relaxed)
    }

    /// Values not written to a tier because their key's write to it was in flight (one per
    /// tier).
    pub(super) fn deduplicated(&self) -> u64 {
        self.counters.deduplicated.load(Ordering::Relaxed)
    }

    /// Values the tiers accepted (one per tier).
    pub(super) fn written(&self) -> u64 {
        self.counters.written.load(Ordering::Relaxed)
    }

    /// Bytes being written now (a value written to two tiers counts in each).
    pub(super) fn bytes_in_flight(&self) -> usize {
        self.tiers
            .iter()
            .map(|t| t.admission.bytes_in_flight())
            .sum()
    }

    /// Waits, at most `limit`, for every write in flight to end; warns when some did not.
    pub(super) async fn wait_idle(&self, limit: Duration) {
        let pending = &self.pending;
        if tokio::time::timeout(limit, pending.wait_idle())
            .await
            .is_err()
        {
            warn!(
                batches = pending.batches(),
                "closing with writes to lower tiers unfinished"
            );
        }
    }

    /// Hands committed values to every lower tier in the background, within each tier's quota
    /// (a value past it, or whose key that tier is writing already, is not written there:
    /// counted).
    pub(super) fn write(&self, committed: Vec<(String, MemoryObj)>) {
        if self.tiers.is_empty() || committed.is_empty() {
            return;
        }
        // A key committed twice in one request: its last value, the one shared memory keeps.
        let committed = last_value_of_each_key(committed);
        let counters = &self.counters;
        let mut wanted = vec![false; committed.len()];
        let mut writes = Vec::new();
        for how in &self.tiers {
            let admission = how.admission.admit(
                committed.iter().map(|(k, v)| (k.clone(), v.len())),
                &self.pending,
            );
            counters
                .dropped
                .fetch_add(admission.dropped, Ordering::Relaxed);
            counters
                .deduplicated
                .fetch_add(admission.deduplicated, Ordering::Relaxed);
            if admission.dropped > 0 {
                debug!(
                    tier = how.tier.name(),
                    values = admission.dropped,
                    "write-behind quota full; not written to this tier"
                );
            }
            let Some(batch) = admission.batch else {
                continue;
            };
            for &i in &admission.admitted {
                wanted[i] = true;
            }
            writes.push((
                how.tier.clone(),
                how.runtime.clone(),
                admission.admitted,
                batch,
            ));
        }
        if writes.is_empty() {
            return;
        }
        let committed: Vec<Option<(String, MemoryObj)>> = committed
            .into_iter()
            .zip(wanted)
            .map(|(value, wanted)| wanted.then_some(value))
            .collect();
        let counters = self.counters.clone();
        let tenant = self.tenant.clone();
        self.runtime.spawn(async move {
            // Copied out of the arena (which every attached engine can write) and checked on
            // that private copy: a stray write after the commit costs this value's write, never
            // a good copy a lower tier already holds.
            let values: Vec<Option<(String, Bytes)>> = committed
                .into_iter()
                .map(|value| value.and_then(|(k, v)| checked_copy(k, v)))
                .collect();
            // A task per tier, on that tier's runtime, holding that tier's admitted batch: a
            // disk tier written at low priority holds up neither another tier's writes nor
            // its quota.
            for (tier, runtime, admitted, batch) in writes {
                let entries: Vec<(String, Bytes)> =
                    admitted.iter().filter_map(|&i| values[i].clone()).collect();
                if entries.is_empty() {
                    continue; // `batch` given back here
                }
                let counters = counters.clone();
                let tenant = tenant.clone();
                runtime.spawn(async move {
                    let started = Instant::now();
                    let values = entries.len() as u64;
                    let written = tier.batch_put(entries).await;
                    tier_op_seconds(&tenant, tier.name(), "put").record(started.elapsed());
                    match written {
                        Ok(()) => {
                            counters.written.fetch_add(values, Ordering::Relaxed);
                        }
                        Err(e) => warn!(tier = tier.name(), "write-behind failed: {e}"),
                    }
                    // The tier first, then the batch (see `kvpool_core`'s write-behind).
                    drop(tier);
                    drop(batch);
                });
            }
        });
    }
}

/// `committed` with each key once, at its last value.
fn last_value_of_each_key(committed: Vec<(String, MemoryObj)>) -> Vec<(String, MemoryObj)> {
    let last: std::collections::HashMap<&str, usize> = committed
        .iter()
        .enumerate()
        .map(|(i, (k, _))| (k.as_str(), i))
        .collect();
    if last.len() == committed.len() {
        return committed;
    }
    let keep: Vec<bool> = (0..committed.len())
        .map(|i| last[committed[i].0.as_str()] == i)
        .collect();
    committed
        .into_iter()
        .zip(keep)
        .filter_map(|(value, keep)| keep.then_some(value))
        .collect()
}

/// A committed value copied out of the arena and checked on that copy, or `None` (logged)
/// when it is not a kvpool key (kept in shared memory only) or fails its check.
fn checked_copy(key: String, value: MemoryObj) -> Option<(String, Bytes)> {
    if !is_kvpool_key(&key) {
        debug!(key = %key, "not a kvpool key: kept in shared memory, not written below");
        return None;
    }
    let copy = Bytes::copy_from_slice(value.as_slice());
    drop(value);
    match check_stored_value(&key, &copy) {
        Ok(()) => Some((key, copy)),
        Err(e) => {
            warn!(key = %key, error = %e, "a committed value failed its check; not written below");
            None
        }
    }
}
