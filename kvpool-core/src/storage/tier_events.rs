//! Chunks entering and leaving each tier, for an engine's KV-event stream (vLLM's
//! `BlockStored` / `BlockRemoved`, which cache-aware routers consume): a bounded log that the
//! connector drains each step. Off until a consumer enables it; then recording is a short
//! mutex-guarded push.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::keys::cache_key::CacheKey;
use crate::keys::chunk_hash::ChunkHash;

/// What happened to the chunks of a [`TierEvent`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TierEventKind {
    /// The tier accepted the chunks (L1: stored; lower tiers: write-behind succeeded).
    Stored,
    /// The chunks left the tier (evicted from L1, or removed from every tier).
    Removed,
}

/// Chunks that entered or left one tier.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TierEvent {
    /// The tier's name ("cpu" for L1, "disk", "redis", "s3", ...).
    pub tier: String,
    /// Stored or removed.
    pub kind: TierEventKind,
    /// The chunks' chained hashes, in the order they were written or removed.
    pub chunk_hashes: Vec<ChunkHash>,
    /// [`crate::KeyScope::digest`] of the chunks' scope: one pool may hold chunks of several
    /// scopes under the same hashes (a hybrid model's KV cache groups), each drained by its
    /// own consumer ([`TierEventLog::drain_scope`]).
    pub scope_digest: u64,
}

/// A bounded queue of [`TierEvent`]s. Recording does nothing until [`TierEventLog::enable`];
/// beyond `capacity` queued hashes the oldest events are dropped (and counted), so an engine
/// that never drains it costs bounded memory.
#[derive(Debug)]
pub struct TierEventLog {
    enabled: AtomicBool,
    queue: Mutex<Queue>,
    capacity: usize,
    dropped: AtomicU64,
}

#[derive(Debug, Default)]
struct Queue {
    events: VecDeque<TierEvent>,
    hashes: usize,
}

impl Default for TierEventLog {
    fn default() -> Self {
        Self::new(1 << 18)
    }
}

impl TierEventLog {
    /// A disabled log holding at most `capacity` chunk hashes once enabled.
    pub fn new(capacity: usize) -> Self {
        TierEventLog {
            enabled: AtomicBool::new(false),
            queue: Mutex::new(Queue::default()),
            capacity: capacity.max(1),
            dropped: AtomicU64::new(0),
        }
    }

    /// Starts recording (an engine asked for KV events).
    pub fn enable(&self) {
        self.enabled.store(true, Ordering::Release);
    }

    /// Whether events are being recorded.
    pub fn is_enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// Records that `keys` entered or left `tier` (nothing when disabled or empty).
    pub fn record<'a>(
        &self,
        tier: &str,
        kind: TierEventKind,
        keys: impl IntoIterator<Item = &'a CacheKey>,
    ) {
        if !self.is_enabled() {
            return;
        }
        // One event per run of keys of one scope.
        let mut events: Vec<TierEvent> = Vec::new();
        let mut run_scope: Option<&CacheKey> = None;
        for k in keys {
            let same = run_scope
                .is_some_and(|r| std::sync::Arc::ptr_eq(&r.scope, &k.scope) || r.scope == k.scope);
            if !same {
                events.push(TierEvent {
                    tier: tier.to_string(),
                    kind,
                    chunk_hashes: Vec::new(),
                    scope_digest: k.scope.digest(),
                });
                run_scope = Some(k);
            }
            if let Some(e) = events.last_mut() {
                e.chunk_hashes.push(k.hash);
            }
        }
        if events.is_empty() {
            return;
        }
        let mut q = self.queue.lock();
        for e in events {
            q.hashes += e.chunk_hashes.len();
            q.events.push_back(e);
        }
        while q.hashes > self.capacity {
            let Some(old) = q.events.pop_front() else {
                break;
            };
            q.hashes -= old.chunk_hashes.len();
            self.dropped.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(crate::telemetry::TIER_EVENTS_DROPPED).increment(1);
        }
    }

    /// Everything recorded since the last call, oldest first.
    pub fn drain(&self) -> Vec<TierEvent> {
        let mut q = self.queue.lock();
        q.hashes = 0;
        q.events.drain(..).collect()
    }

    /// Everything recorded for chunks of the scope whose [`crate::KeyScope::digest`] is
    /// `scope_digest` since it was last drained, oldest first; other scopes' events stay.
    pub fn drain_scope(&self, scope_digest: u64) -> Vec<TierEvent> {
        let mut q = self.queue.lock();
        let (mine, others): (VecDeque<TierEvent>, VecDeque<TierEvent>) = q
            .events
            .drain(..)
            .partition(|e| e.scope_digest == scope_digest);
        q.hashes = others.iter().map(|e| e.chunk_hashes.len()).sum();
        q.events = others;
        mine.into_iter().collect()
    }

    /// Events dropped because nobody drained the log in time.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::keys::cache_key::KeyScope;

    fn key(i: u8) -> CacheKey {
        CacheKey::new(
            Arc::new(KeyScope::new("m", 1, 0, 0, 1).unwrap()),
            ChunkHash([i; 16]),
        )
    }

    #[test]
    fn nothing_is_recorded_until_enabled_then_events_drain_in_order() {
        let log = TierEventLog::new(16);
        log.record("cpu", TierEventKind::Stored, &[key(1)]);
        assert!(log.drain().is_empty());
        log.enable();
        log.record("cpu", TierEventKind::Stored, &[key(1), key(2)]);
        log.record("disk", TierEventKind::Stored, &[key(1)]);
        log.record("cpu", TierEventKind::Removed, &[key(2)]);
        log.record("cpu", TierEventKind::Removed, &[]);
        let got = log.drain();
        assert_eq!(got.len(), 3);
        assert_eq!(
            got[0].chunk_hashes,
            vec![ChunkHash([1; 16]), ChunkHash([2; 16])]
        );
        assert_eq!(
            (got[1].tier.as_str(), got[1].kind),
            ("disk", TierEventKind::Stored)
        );
        assert_eq!(
            (got[2].tier.as_str(), got[2].kind),
            ("cpu", TierEventKind::Removed)
        );
        assert!(log.drain().is_empty());
    }

    #[test]
    fn an_undrained_log_keeps_the_newest_events_within_its_capacity() {
        let log = TierEventLog::new(4);
        log.enable();
        for i in 0..10 {
            log.record("cpu", TierEventKind::Stored, &[key(i), key(i)]);
        }
        let got = log.drain();
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].chunk_hashes[0], ChunkHash([9; 16]));
        assert_eq!(log.dropped(), 8);
    }

    #[test]
    fn each_scope_drains_its_own_events_though_the_hashes_are_the_same() {
        let log = TierEventLog::new(16);
        log.enable();
        let a = Arc::new(KeyScope::new("m|group=0", 1, 0, 0, 1).unwrap());
        let b = Arc::new(KeyScope::new("m|group=1", 1, 0, 0, 1).unwrap());
        let of = |scope: &Arc<KeyScope>, i: u8| CacheKey::new(scope.clone(), ChunkHash([i; 16]));
        log.record(
            "cpu",
            TierEventKind::Stored,
            &[of(&a, 1), of(&b, 1), of(&b, 2)],
        );
        log.record("disk", TierEventKind::Stored, &[of(&a, 1)]);
        let got_b = log.drain_scope(b.digest());
        assert_eq!(got_b.len(), 1);
        assert_eq!(
            got_b[0].chunk_hashes,
            vec![ChunkHash([1; 16]), ChunkHash([2; 16])]
        );
        let got_a = log.drain_scope(a.digest());
        assert_eq!(
            got_a.iter().map(|e| e.tier.as_str()).collect::<Vec<_>>(),
            ["cpu", "disk"]
        );
        assert!(log.drain().is_empty());
    }
}
