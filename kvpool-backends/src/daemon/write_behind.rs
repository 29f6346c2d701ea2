//! The daemon's writes of committed values to its lower tiers: each value copied out of the
//! arena and checked (on the low-priority threads when every tier writing it is written there,
//! holding at most a quarter of the arena), each tier admitted by the core's write-behind
//! admission (its own byte quota and keys in flight), written on its own runtime, counted.
//! Work on the low-priority threads also gives the CPU back while other processes wait for
//! one ([`CpuPacer`]): their nice value does not hold against an engine in another scheduling
//! group.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvpool_core::memory::MemoryObj;
use kvpool_core::storage::remote::RemoteConnector;
use kvpool_core::storage::write_behind::{Pending, WriteBehindAdmission};
use tokio::runtime::Handle;
use tracing::{debug, warn};

use super::copy_buffers::CopyBuffers;
use super::lower_tiers::{check_stored_value, is_kvpool_key, tier_op_seconds};
use crate::cpu_pressure::CpuPacer;
use crate::telemetry;

/// The work between two checks of the CPU pressure, in bytes copied or written, on the
/// low-priority threads (a few milliseconds of a core).
const PACED_SLICE_BYTES: usize = 2 << 20;

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
    /// Microseconds the low-priority work paused to give a contested CPU back.
    paused_micros: AtomicU64,
}

impl Counters {
    /// Counts a pause of the low-priority work (and records it), unless it is none.
    fn paused(&self, pause: Duration, tenant: &str) {
        if pause.is_zero() {
            return;
        }
        self.paused_micros.fetch_add(
            u64::try_from(pause.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        metrics::histogram!(telemetry::DAEMON_WRITE_BEHIND_PAUSE_SECONDS,
            "tenant" => tenant.to_string())
        .record(pause);
    }
}

/// One lower tier and how it is written behind: on which runtime, and what may start (its own
/// byte quota and keys in flight, as each lower tier of an engine's pool has: a slow tier
/// fills only its own quota).
struct TierWrites {
    tier: Arc<dyn RemoteConnector>,
    /// The runtime the tier is written on: its own (the low-priority threads) or, when
    /// `None`, the daemon's.
    own_runtime: Option<Handle>,
    admission: Arc<WriteBehindAdmission<String>>,
}

/// Arena memory held by committed values waiting to be copied on low-priority threads, which
/// the engines' steps may starve: at most a share of the arena, so that the values waiting
/// never hold the room the engines' next saves need.
struct ArenaHeldForCopies {
    bytes: Arc<AtomicUsize>,
    limit: usize,
}

impl ArenaHeldForCopies {
    /// A quarter of an arena of `capacity` bytes.
    fn new(capacity: usize) -> Self {
        ArenaHeldForCopies {
            bytes: Arc::default(),
            limit: capacity / 4,
        }
    }

    /// Holds `bytes` more, or `None` when that would pass the limit.
    fn hold(&self, bytes: usize) -> Option<HeldForCopy> {
        self.bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|&sum| sum <= self.limit)
            })
            .ok()?;
        Some(HeldForCopy {
            bytes,
            held: self.bytes.clone(),
        })
    }
}

/// Bytes counted in [`ArenaHeldForCopies`] until dropped (once their values are copied).
struct HeldForCopy {
    bytes: usize,
    held: Arc<AtomicUsize>,
}

impl Drop for HeldForCopy {
    fn drop(&mut self) {
        self.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// The daemon's writes to its lower tiers.
pub(super) struct DaemonWriteBehind {
    tiers: Vec<TierWrites>,
    /// Batches in flight over all tiers (what `close` waits for).
    pending: Arc<Pending>,
    counters: Arc<Counters>,
    /// The daemon's runtime: where tiers without a runtime of their own are written, and where
    /// committed values are copied out of the arena and checked unless every tier writing
    /// them has one.
    runtime: Handle,
    /// The daemon's tenant, a label of the tier latency histogram.
    tenant: String,
    /// Arena memory held by values waiting for a low-priority copy, bounded.
    held_for_copies: ArenaHeldForCopies,
    /// Buffers the copies out of the arena reuse.
    copy_buffers: CopyBuffers,
    /// What paces the work on the low-priority threads.
    pacer: CpuPacer,
    /// The nice value of each thread that copied committed values out of the arena, for tests
    /// of where that work runs.
    #[cfg(test)]
    pub(super) copying_thread_nices: Arc<std::sync::Mutex<Vec<Option<i32>>>>,
}

impl DaemonWriteBehind {
    /// Writes behind to each of `tiers` on `runtime`, within `quota` bytes per tier, out of an
    /// arena of `arena_capacity` bytes, keeping `copy_buffer_bytes` of buffers between copies.
    pub(super) fn new(
        tiers: &[Arc<dyn RemoteConnector>],
        quota: usize,
        arena_capacity: usize,
        copy_buffer_bytes: usize,
        runtime: Handle,
        tenant: String,
    ) -> Self {
        DaemonWriteBehind {
            tiers: tiers
                .iter()
                .map(|tier| TierWrites {
                    tier: tier.clone(),
                    own_runtime: None,
                    admission: Arc::new(WriteBehindAdmission::new(quota)),
                })
                .collect(),
            pending: Arc::default(),
            counters: Arc::default(),
            runtime,
            tenant,
            held_for_copies: ArenaHeldForCopies::new(arena_capacity),
            copy_buffers: CopyBuffers::new(copy_buffer_bytes),
            pacer: CpuPacer::system(),
            #[cfg(test)]
            copying_thread_nices: Arc::default(),
        }
    }

    /// Runs the writes to tier `tier` (its position in `new`'s `tiers`) on `runtime`.
    ///
    /// # Panics
    ///
    /// If there is no tier at `tier`.
    pub(super) fn write_tier_on(&mut self, tier: usize, runtime: Handle) {
        self.tiers[tier].own_runtime = Some(runtime);
    }

    /// Paces the work on the low-priority threads by `pacer` instead of the system's CPU
    /// pressure.
    #[cfg(test)]
    pub(super) fn pace_with(&mut self, pacer: CpuPacer) {
        self.pacer = pacer;
    }

    /// How long the work on the low-priority threads has paused to give a contested CPU back.
    #[cfg(test)]
    pub(super) fn paused(&self) -> Duration {
        Duration::from_micros(self.counters.paused_micros.load(Ordering::Relaxed))
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
                how.own_runtime.clone(),
                admission.admitted,
                batch,
            ));
        }
        if writes.is_empty() {
            return;
        }
        let daemon_runtime = self.runtime.clone();
        let committed: Vec<Option<(String, MemoryObj)>> = committed
            .into_iter()
            .zip(wanted)
            .map(|(value, wanted)| wanted.then_some(value))
            .collect();
        // The copy and check (a full pass over each value, CPU the engines' steps want) run
        // where the writes do when every tier writing them has a runtime of its own (a disk
        // tier on the low-priority threads): nothing of a write behind to such tiers then runs
        // at the daemon's priority beside the engines. Otherwise they run on the daemon's
        // runtime at once: when some tier is written there (not to hold it behind
        // low-priority threads), and when values waiting for such threads, which may wait
        // long, would hold more than a quarter of the arena (each holds its arena memory until
        // copied).
        let low_priority = writes
            .iter()
            .map(|(_, own_runtime, _, _)| own_runtime.clone())
            .collect::<Option<Vec<Handle>>>()
            .and_then(|own_runtimes| own_runtimes.into_iter().next());
        let wanted_bytes = committed.iter().flatten().map(|(_, v)| v.len()).sum();
        let copy_at_low_priority =
            low_priority.and_then(|runtime| match self.held_for_copies.hold(wanted_bytes) {
                Some(held) => Some((runtime, held)),
                None => {
                    debug!(
                        bytes = wanted_bytes,
                        "arena held for low-priority copies at its limit; copied at once"
                    );
                    None
                }
            });
        let (copy_runtime, held_for_copy) = match copy_at_low_priority {
            Some((runtime, held)) => (runtime, Some(held)),
            None => (self.runtime.clone(), None),
        };
        let counters = self.counters.clone();
        let tenant = self.tenant.clone();
        let copy_buffers = self.copy_buffers.clone();
        let pacer = self.pacer.clone();
        #[cfg(test)]
        let copying_thread_nices = self.copying_thread_nices.clone();
        copy_runtime.spawn(async move {
            #[cfg(test)]
            copying_thread_nices
                .lock()
                .unwrap()
                .push(crate::background::this_threads_nice());
            // Copied out of the arena (which every attached engine can write) and checked on
            // that private copy: a stray write after the commit costs this value's write, never
            // a good copy a lower tier already holds. Paced on the low-priority threads; at
            // once on the daemon's, where the arena memory they hold is wanted back.
            let started = Instant::now();
            let priority = if held_for_copy.is_some() {
                "low"
            } else {
                "daemon"
            };
            let paced = held_for_copy.map(|held| PacedCopy {
                pacer: &pacer,
                counters: &counters,
                tenant: &tenant,
                held,
            });
            let values = copied_and_checked(&copy_buffers, committed, paced).await;
            metrics::histogram!(telemetry::DAEMON_ARENA_COPY_SECONDS,
                "tenant" => tenant.clone(), "priority" => priority)
            .record(started.elapsed());
            // A task per tier, on that tier's runtime, holding that tier's admitted batch: a
            // disk tier written at low priority holds up neither another tier's writes nor
            // its quota.
            for (tier, own_runtime, admitted, batch) in writes {
                let entries: Vec<(String, Bytes)> =
                    admitted.iter().filter_map(|&i| values[i].clone()).collect();
                if entries.is_empty() {
                    continue; // `batch` given back here
                }
                let counters = counters.clone();
                let tenant = tenant.clone();
                // A tier on the low-priority threads is written a slice at a time, giving the
                // CPU back between slices while other processes wait for it.
                let pacer = own_runtime.as_ref().map(|_| pacer.clone());
                own_runtime
                    .as_ref()
                    .unwrap_or(&daemon_runtime)
                    .spawn(async move {
                        let slice_bytes = if pacer.is_some() {
                            PACED_SLICE_BYTES
                        } else {
                            usize::MAX
                        };
                        for part in slices_of(entries, slice_bytes) {
                            let slice = pacer.as_ref().map(CpuPacer::start_slice);
                            let started = Instant::now();
                            let values = part.len() as u64;
                            let written = tier.batch_put(part).await;
                            tier_op_seconds(&tenant, tier.name(), "put").record(started.elapsed());
                            match written {
                                Ok(()) => {
                                    counters.written.fetch_add(values, Ordering::Relaxed);
                                }
                                Err(e) => {
                                    warn!(tier = tier.name(), "write-behind failed: {e}");
                                    break;
                                }
                            }
                            if let (Some(pacer), Some(slice)) = (&pacer, slice) {
                                counters.paused(pacer.give_way(slice).await, &tenant);
                            }
                        }
                        // The tier first, then the batch (see `kvpool_core`'s write-behind).
                        drop(tier);
                        drop(batch);
                    });
            }
        });
    }
}

/// How the copy out of the arena runs on the low-priority threads: paced by `pacer` (its
/// pauses counted in `counters` under `tenant`), holding `held` of the arena until the last
/// value is copied.
struct PacedCopy<'a> {
    pacer: &'a CpuPacer,
    counters: &'a Counters,
    tenant: &'a str,
    held: HeldForCopy,
}

/// Each wanted value of `committed` copied out of the arena and checked ([`checked_copy`]);
/// with `paced`, giving the CPU back after each [`PACED_SLICE_BYTES`] copied and after the
/// last value, and giving the arena memory held for the copy back as soon as the last value
/// is copied (before that pause: the values no longer hold it).
async fn copied_and_checked(
    buffers: &CopyBuffers,
    committed: Vec<Option<(String, MemoryObj)>>,
    paced: Option<PacedCopy<'_>>,
) -> Vec<Option<(String, Bytes)>> {
    let mut values = Vec::with_capacity(committed.len());
    let (mut held, pacing) = match paced {
        Some(PacedCopy {
            pacer,
            counters,
            tenant,
            held,
        }) => (Some(held), Some((pacer, counters, tenant))),
        None => (None, None),
    };
    let mut slice = pacing.map(|(pacer, _, _)| pacer.start_slice());
    let mut slice_bytes = 0;
    let count = committed.len();
    for (i, value) in committed.into_iter().enumerate() {
        slice_bytes += value.as_ref().map_or(0, |(_, v)| v.len());
        values.push(value.and_then(|(k, v)| checked_copy(buffers, k, v)));
        let last = i + 1 == count;
        if last {
            drop(held.take());
        }
        if let Some((pacer, counters, tenant)) = pacing
            && slice_bytes > 0
            && (slice_bytes >= PACED_SLICE_BYTES || last)
            && let Some(done) = slice.take()
        {
            counters.paused(pacer.give_way(done).await, tenant);
            slice = Some(pacer.start_slice());
            slice_bytes = 0;
        }
    }
    values
}

/// `entries` in order, in parts of at least `bytes` (the last may be smaller), each ending
/// at the value that reaches it.
fn slices_of(entries: Vec<(String, Bytes)>, bytes: usize) -> Vec<Vec<(String, Bytes)>> {
    let mut parts = Vec::new();
    let mut part = Vec::new();
    let mut part_bytes = 0usize;
    for (key, value) in entries {
        part_bytes = part_bytes.saturating_add(value.len());
        part.push((key, value));
        if part_bytes >= bytes {
            parts.push(std::mem::take(&mut part));
            part_bytes = 0;
        }
    }
    if !part.is_empty() {
        parts.push(part);
    }
    parts
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

/// A committed value copied out of the arena (into one of `buffers`) and checked on that copy,
/// or `None` (logged) when it is not a kvpool key (kept in shared memory only) or fails its
/// check.
fn checked_copy(buffers: &CopyBuffers, key: String, value: MemoryObj) -> Option<(String, Bytes)> {
    if !is_kvpool_key(&key) {
        debug!(key = %key, "not a kvpool key: kept in shared memory, not written below");
        return None;
    }
    let copy = buffers.copy_of(value.as_slice());
    drop(value);
    match check_stored_value(&key, &copy) {
        Ok(()) => Some((key, copy)),
        Err(e) => {
            warn!(key = %key, error = %e, "a committed value failed its check; not written below");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(len: usize) -> (String, Bytes) {
        (format!("k{len}"), Bytes::from(vec![0u8; len]))
    }

    /// The arena memory held for a low-priority copy is given back once the last value is
    /// copied, not after the pause that follows it (up to 100 ms while the CPU is contested,
    /// during which the engines' next saves could not have that room). Before, it was given
    /// back after the pause.
    #[tokio::test(start_paused = true)]
    async fn the_arena_held_for_a_copy_is_given_back_before_the_pause_after_the_last_value() {
        use std::future::Future;
        use std::task::{Context, Waker};

        const MIB: usize = 1 << 20;
        let arena = ArenaHeldForCopies::new(16 * MIB);
        let stalled = Arc::new(AtomicU64::new(0));
        let always_contested = CpuPacer::over(Arc::new(move || {
            Some(stalled.fetch_add(1_000_000, Ordering::SeqCst))
        }));
        let counters = Counters::default();
        let buffers = CopyBuffers::new(4 * MIB);
        let committed = vec![Some(("k".to_string(), MemoryObj::from_vec(vec![1; MIB])))];
        let copy = copied_and_checked(
            &buffers,
            committed,
            Some(PacedCopy {
                pacer: &always_contested,
                counters: &counters,
                tenant: "t",
                held: arena.hold(MIB).unwrap(),
            }),
        );
        let mut copy = std::pin::pin!(copy);
        let mut cx = Context::from_waker(Waker::noop());
        assert!(
            copy.as_mut().poll(&mut cx).is_pending(),
            "pausing after the value"
        );
        assert_eq!(
            arena.bytes.load(Ordering::Acquire),
            0,
            "held through the pause"
        );
        let values = copy.await;
        assert_eq!(values.len(), 1);
        assert!(counters.paused_micros.load(Ordering::Relaxed) > 0);
    }

    #[test]
    fn writes_are_sliced_at_the_value_that_reaches_the_slice() {
        let lens = |parts: Vec<Vec<(String, Bytes)>>| -> Vec<Vec<usize>> {
            parts
                .iter()
                .map(|p| p.iter().map(|(_, v)| v.len()).collect())
                .collect()
        };
        let entries = vec![entry(1), entry(2), entry(3), entry(4), entry(1)];
        assert_eq!(
            lens(slices_of(entries.clone(), 3)),
            vec![vec![1, 2], vec![3], vec![4], vec![1]]
        );
        assert_eq!(
            lens(slices_of(entries, usize::MAX)),
            vec![vec![1, 2, 3, 4, 1]]
        );
        assert!(slices_of(Vec::new(), 3).is_empty());
    }
}
