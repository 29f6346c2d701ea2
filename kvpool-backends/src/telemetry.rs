//! The metrics only a backend records, in a catalogue of their own (kvpool-core's covers the
//! rest), listed in docs/metrics.md like core's.

use kvpool_core::telemetry::{MetricInfo, counter, describe_metrics, gauge};

/// Disk-tier writes refused because the disk or the tier's capacity is full.
pub const DISK_WRITES_REFUSED: &str = "kvpool_disk_writes_refused_total";
/// Mooncake calls failed fast after a cluster failure.
pub const MOONCAKE_FAST_FAILURES: &str = "kvpool_mooncake_fast_failures_total";
/// Mooncake gets of one key that failed with a code other than "not found" (each a miss).
pub const MOONCAKE_GET_ERRORS: &str = "kvpool_mooncake_get_errors_total";

/// 1 once a tier that could not be reached at start-up is reached, 0 until then (per tier).
pub const TIER_REACHABLE: &str = "kvpool_tier_reachable";

/// Engines attached to the pool daemon.
pub const DAEMON_SESSIONS: &str = "kvpool_daemon_sessions";
/// Bytes of the daemon's shared arena in use.
pub const DAEMON_USED_BYTES: &str = "kvpool_daemon_used_bytes";
/// Values in the daemon's shared memory.
pub const DAEMON_ENTRIES: &str = "kvpool_daemon_entries";
/// Pins and uncommitted allocations the daemon has lent to engines.
pub const DAEMON_LEASES: &str = "kvpool_daemon_leases";
/// Gets the daemon answered, by result (memory, tier, miss).
pub const DAEMON_GETS: &str = "kvpool_daemon_gets_total";
/// Values engines committed to the daemon.
pub const DAEMON_COMMITS: &str = "kvpool_daemon_commits_total";
/// Values evicted from the daemon's shared memory.
pub const DAEMON_EVICTIONS: &str = "kvpool_daemon_evictions_total";
/// Values the daemon wrote to every lower tier.
pub const DAEMON_TIER_WRITES: &str = "kvpool_daemon_tier_writes_total";
/// Pins and allocations reclaimed because their engine left or forgot them.
pub const DAEMON_LEASES_RECLAIMED: &str = "kvpool_daemon_leases_reclaimed_total";
/// Requests the daemon refused, and sessions it closed because an engine sent a bad frame.
pub const DAEMON_REQUESTS_REFUSED: &str = "kvpool_daemon_requests_refused_total";

/// Every metric this crate's backends record.
pub const BACKEND_METRICS: &[MetricInfo] = &[
    gauge(
        TIER_REACHABLE,
        &["tier"],
        "0 while a tier that could not be reached at start-up is down (its calls miss), 1 once it is reached.",
    ),
    counter(
        DISK_WRITES_REFUSED,
        &[],
        "Disk-tier writes refused because the disk or the tier's capacity is full.",
    ),
    counter(
        MOONCAKE_FAST_FAILURES,
        &[],
        "Mooncake calls failed fast after a cluster failure.",
    ),
    counter(
        MOONCAKE_GET_ERRORS,
        &[],
        "Mooncake gets of one key that failed with a code other than not found (each a miss).",
    ),
    gauge(
        DAEMON_SESSIONS,
        &["tenant"],
        "Engines attached to the pool daemon.",
    ),
    gauge(
        DAEMON_USED_BYTES,
        &["tenant"],
        "Bytes of the pool daemon's shared arena in use.",
    ),
    gauge(
        DAEMON_ENTRIES,
        &["tenant"],
        "Values in the pool daemon's shared memory.",
    ),
    gauge(
        DAEMON_LEASES,
        &["tenant"],
        "Pins and uncommitted allocations the pool daemon has lent to engines.",
    ),
    counter(
        DAEMON_GETS,
        &["tenant", "result"],
        "Gets the pool daemon answered, by result (memory, tier, miss).",
    ),
    counter(
        DAEMON_COMMITS,
        &["tenant"],
        "Values engines committed to the pool daemon.",
    ),
    counter(
        DAEMON_EVICTIONS,
        &["tenant"],
        "Values evicted from the pool daemon's shared memory.",
    ),
    counter(
        DAEMON_TIER_WRITES,
        &["tenant"],
        "Values the pool daemon wrote to every lower tier.",
    ),
    counter(
        DAEMON_LEASES_RECLAIMED,
        &["tenant"],
        "Pins and allocations the pool daemon reclaimed because their engine left or forgot them.",
    ),
    counter(
        DAEMON_REQUESTS_REFUSED,
        &["tenant"],
        "Requests the pool daemon refused, and sessions it closed because an engine sent a bad frame.",
    ),
];

/// Hands the help texts of core's metrics and the backends' to the installed recorder.
pub fn describe() {
    kvpool_core::telemetry::describe();
    describe_metrics(BACKEND_METRICS);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_metrics_follow_the_conventions_and_docs_list_exactly_the_recorded_metrics() {
        kvpool_core::telemetry::check_catalogue(BACKEND_METRICS).unwrap();
        let all: Vec<MetricInfo> = kvpool_core::telemetry::METRICS
            .iter()
            .chain(BACKEND_METRICS)
            .copied()
            .collect();
        kvpool_core::telemetry::check_catalogue(&all).unwrap();
        let doc = include_str!("../../docs/metrics.md");
        for m in BACKEND_METRICS {
            assert!(
                doc.contains(&format!("`{}`", m.name)),
                "docs/metrics.md lacks {}",
                m.name
            );
        }
        // And it lists nothing that no catalogue has.
        for word in doc.split('`').skip(1).step_by(2) {
            if word.starts_with("kvpool_") && !word.contains('{') && !word.contains(' ') {
                let base = word
                    .trim_end_matches("_bucket")
                    .trim_end_matches("_count")
                    .trim_end_matches("_sum");
                assert!(
                    all.iter().any(|m| m.name == word || m.name == base),
                    "docs/metrics.md lists {word}, which kvpool does not record"
                );
            }
        }
    }
}
