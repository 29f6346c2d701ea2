//! What the storage manager counts per tier and in all: atomic counters for `stats()`
//! snapshots, mirrored into the Prometheus metrics of [`crate::telemetry`] through handles
//! registered once per tier.

use std::time::Duration;

use metrics::{Counter, Histogram};

use crate::storage::backend::{BackendStats, StorageBackend};
use crate::telemetry as t;
use crate::telemetry::counter::StatCounter;

/// A tier call, for its latency histogram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TierOp {
    Get,
    Put,
    Contains,
}

/// The Prometheus series of one tier, registered when the manager is built (with no
/// recorder installed they are no-ops).
#[derive(Debug)]
struct TierMetrics {
    hit_chunks: Counter,
    hit_tokens: Counter,
    read_bytes: Counter,
    written_bytes: Counter,
    errors: Counter,
    dropped: Counter,
    failed: Counter,
    deduplicated: Counter,
    get_seconds: Histogram,
    put_seconds: Histogram,
    contains_seconds: Histogram,
}

impl TierMetrics {
    fn new(tier: &str) -> Self {
        let tier = tier.to_string();
        let op = |op: &'static str| metrics::histogram!(t::TIER_OP_SECONDS, "tier" => tier.clone(), "op" => op);
        TierMetrics {
            hit_chunks: metrics::counter!(t::TIER_HIT_CHUNKS, "tier" => tier.clone()),
            hit_tokens: metrics::counter!(t::TIER_HIT_TOKENS, "tier" => tier.clone()),
            read_bytes: metrics::counter!(t::TIER_READ_BYTES, "tier" => tier.clone()),
            written_bytes: metrics::counter!(t::TIER_WRITTEN_BYTES, "tier" => tier.clone()),
            errors: metrics::counter!(t::TIER_ERRORS, "tier" => tier.clone()),
            dropped: metrics::counter!(t::WRITE_BEHIND_DROPPED, "tier" => tier.clone()),
            failed: metrics::counter!(t::WRITE_BEHIND_FAILED, "tier" => tier.clone()),
            deduplicated: metrics::counter!(t::WRITE_BEHIND_DEDUPLICATED, "tier" => tier.clone()),
            get_seconds: op("get"),
            put_seconds: op("put"),
            contains_seconds: op("contains"),
        }
    }
}

/// Per-tier counters kept by the manager.
#[derive(Debug)]
pub(crate) struct TierCounters {
    hit_chunks: StatCounter,
    hit_tokens: StatCounter,
    bytes_read: StatCounter,
    bytes_written: StatCounter,
    read_nanos: StatCounter,
    write_nanos: StatCounter,
    dropped_writes: StatCounter,
    failed_writes: StatCounter,
    deduplicated_writes: StatCounter,
    errors: StatCounter,
    metrics: TierMetrics,
}

impl TierCounters {
    /// Counters for the tier named `tier`.
    pub(crate) fn new(tier: &str) -> Self {
        TierCounters {
            hit_chunks: StatCounter::default(),
            hit_tokens: StatCounter::default(),
            bytes_read: StatCounter::default(),
            bytes_written: StatCounter::default(),
            read_nanos: StatCounter::default(),
            write_nanos: StatCounter::default(),
            dropped_writes: StatCounter::default(),
            failed_writes: StatCounter::default(),
            deduplicated_writes: StatCounter::default(),
            errors: StatCounter::default(),
            metrics: TierMetrics::new(tier),
        }
    }

    /// A call to the tier took `elapsed`.
    pub(crate) fn call(&self, op: TierOp, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        match op {
            TierOp::Get => {
                self.read_nanos.add(elapsed.as_nanos() as u64);
                self.metrics.get_seconds.record(secs);
            }
            TierOp::Put => {
                self.write_nanos.add(elapsed.as_nanos() as u64);
                self.metrics.put_seconds.record(secs);
            }
            TierOp::Contains => self.metrics.contains_seconds.record(secs),
        }
    }

    /// The tier served a chunk of `tokens` tokens and `bytes` bytes.
    pub(crate) fn hit(&self, tokens: u64, bytes: u64) {
        self.hit_chunks.add(1);
        self.hit_tokens.add(tokens);
        self.bytes_read.add(bytes);
        self.metrics.hit_chunks.increment(1);
        self.metrics.hit_tokens.increment(tokens);
        self.metrics.read_bytes.increment(bytes);
    }

    /// `bytes` were written to the tier.
    pub(crate) fn written(&self, bytes: u64) {
        self.bytes_written.add(bytes);
        self.metrics.written_bytes.increment(bytes);
    }

    /// A tier call failed (turned into misses or a skipped write).
    pub(crate) fn error(&self) {
        self.errors.add(1);
        self.metrics.errors.increment(1);
    }

    /// `n` write-behind entries were dropped: the in-flight quota was full.
    pub(crate) fn dropped_writes(&self, n: u64) {
        self.dropped_writes.add(n);
        self.metrics.dropped.increment(n);
    }

    /// `n` write-behind entries were lost to a failed put.
    pub(crate) fn failed_writes(&self, n: u64) {
        self.failed_writes.add(n);
        self.metrics.failed.increment(n);
    }

    /// `n` write-behind entries were skipped: the same key was already in flight.
    pub(crate) fn deduplicated_writes(&self, n: u64) {
        self.deduplicated_writes.add(n);
        self.metrics.deduplicated.increment(n);
    }

    /// A snapshot, with the backend's own counters.
    pub(crate) fn snapshot(&self, backend: &dyn StorageBackend) -> TierStats {
        TierStats {
            name: backend.name().to_string(),
            hit_chunks: self.hit_chunks.get(),
            hit_tokens: self.hit_tokens.get(),
            bytes_read: self.bytes_read.get(),
            bytes_written: self.bytes_written.get(),
            read_seconds: self.read_nanos.get() as f64 * 1e-9,
            write_seconds: self.write_nanos.get() as f64 * 1e-9,
            dropped_writes: self.dropped_writes.get(),
            failed_writes: self.failed_writes.get(),
            deduplicated_writes: self.deduplicated_writes.get(),
            errors: self.errors.get(),
            backend: backend.stats(),
        }
    }
}

/// Manager-wide counters (misses, promotions) with their Prometheus series.
#[derive(Debug)]
pub(crate) struct ManagerCounters {
    miss_chunks: StatCounter,
    promotions: StatCounter,
    miss_metric: Counter,
    promotion_metric: Counter,
}

impl Default for ManagerCounters {
    fn default() -> Self {
        ManagerCounters {
            miss_chunks: StatCounter::default(),
            promotions: StatCounter::default(),
            miss_metric: metrics::counter!(t::MISS_CHUNKS),
            promotion_metric: metrics::counter!(t::PROMOTIONS),
        }
    }
}

impl ManagerCounters {
    /// `n` chunks a get wanted were not served.
    pub(crate) fn missed(&self, n: u64) {
        self.miss_chunks.add(n);
        self.miss_metric.increment(n);
    }

    /// `n` chunks were promoted into L1.
    pub(crate) fn promoted(&self, n: u64) {
        self.promotions.add(n);
        self.promotion_metric.increment(n);
    }

    /// A snapshot with the tiers'.
    pub(crate) fn snapshot(&self, tiers: Vec<TierStats>) -> ManagerStats {
        ManagerStats {
            tiers,
            miss_chunks: self.miss_chunks.get(),
            promotions: self.promotions.get(),
        }
    }
}

/// A snapshot of one tier as seen by the manager, plus the backend's own stats.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TierStats {
    /// Backend name.
    pub name: String,
    /// Chunks served by this tier in `get`.
    pub hit_chunks: u64,
    /// Tokens in those chunks.
    pub hit_tokens: u64,
    /// Bytes read from the tier.
    pub bytes_read: u64,
    /// Bytes written to the tier.
    pub bytes_written: u64,
    /// Time spent in the tier's `get` calls (seconds).
    pub read_seconds: f64,
    /// Time spent in the tier's `put` calls (seconds).
    pub write_seconds: f64,
    /// Write-behind entries dropped because the in-flight quota was full.
    pub dropped_writes: u64,
    /// Write-behind entries lost because the tier's put failed (server down, disk full).
    pub failed_writes: u64,
    /// Write-behind entries skipped because the same key was already in flight.
    pub deduplicated_writes: u64,
    /// Tier errors turned into misses or skipped writes.
    pub errors: u64,
    /// The backend's own counters.
    pub backend: BackendStats,
}

/// Manager-wide counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ManagerStats {
    /// Tiers in lookup order (L1 first).
    pub tiers: Vec<TierStats>,
    /// Keys asked for in `get` that were not served by any tier (or cut by an earlier miss).
    pub miss_chunks: u64,
    /// Chunks copied from a lower tier into L1.
    pub promotions: u64,
}
