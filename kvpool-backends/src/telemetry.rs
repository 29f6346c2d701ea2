//! The metrics only a backend records, in a catalogue of their own (kvpool-core's covers the
//! rest), listed in docs/metrics.md like core's.

use kvpool_core::telemetry::{MetricInfo, counter, describe_metrics, gauge, histogram};

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
/// Values the daemon wrote to a lower tier (one per tier that accepted it).
pub const DAEMON_TIER_WRITES: &str = "kvpool_daemon_tier_writes_total";
/// Pins and allocations reclaimed because their engine left or forgot them.
pub const DAEMON_LEASES_RECLAIMED: &str = "kvpool_daemon_leases_reclaimed_total";
/// Requests the daemon refused, and sessions it closed because an engine sent a bad frame.
pub const DAEMON_REQUESTS_REFUSED: &str = "kvpool_daemon_requests_refused_total";

/// The pool daemon's shared arena size.
pub const DAEMON_CAPACITY_BYTES: &str = "kvpool_daemon_capacity_bytes";
/// Bytes of committed values the daemon is writing to its lower tiers now (summed over tiers).
pub const DAEMON_WRITE_BEHIND_BYTES: &str = "kvpool_daemon_write_behind_bytes";
/// Committed values the daemon did not write to a lower tier: that tier's write-behind quota
/// was full.
pub const DAEMON_WRITE_BEHIND_DROPPED: &str = "kvpool_daemon_write_behind_dropped_total";
/// Committed values the daemon did not write to a lower tier: that tier was writing the key
/// already.
pub const DAEMON_WRITE_BEHIND_DEDUPLICATED: &str = "kvpool_daemon_write_behind_deduplicated_total";
/// Latency of the daemon's calls to its lower tiers, by tier and call.
pub const DAEMON_TIER_OP_SECONDS: &str = "kvpool_daemon_tier_op_seconds";
/// Time the daemon took to answer one engine request, by kind.
pub const DAEMON_REQUEST_SECONDS: &str = "kvpool_daemon_request_seconds";
/// Time an engine waited for the pool daemon's reply to one request, by kind (the engine's
/// side of [`DAEMON_REQUEST_SECONDS`]).
pub const DAEMON_CLIENT_CALL_SECONDS: &str = "kvpool_daemon_client_call_seconds";
/// Time the daemon took to copy and check one commit's values out of its arena for its lower
/// tiers, by the priority it ran at.
pub const DAEMON_ARENA_COPY_SECONDS: &str = "kvpool_daemon_arena_copy_seconds";
/// Each pause of the daemon's low-priority write-behind, giving a contested CPU back.
pub const DAEMON_WRITE_BEHIND_PAUSE_SECONDS: &str = "kvpool_daemon_write_behind_pause_seconds";
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
        "Values the pool daemon wrote to a lower tier (one per tier that accepted it).",
    ),
    counter(
        DAEMON_LEASES_RECLAIMED,
        &["tenant"],
        "Pins and allocations the pool daemon reclaimed because their engine left or forgot them.",
    ),
    gauge(
        DAEMON_CAPACITY_BYTES,
        &["tenant"],
        "The pool daemon's shared arena size in bytes.",
    ),
    gauge(
        DAEMON_WRITE_BEHIND_BYTES,
        &["tenant"],
        "Bytes of committed values the pool daemon is writing to its lower tiers now.",
    ),
    counter(
        DAEMON_WRITE_BEHIND_DROPPED,
        &["tenant"],
        "Committed values the pool daemon did not write to a lower tier because that tier's write-behind quota was full (one per tier).",
    ),
    counter(
        DAEMON_WRITE_BEHIND_DEDUPLICATED,
        &["tenant"],
        "Committed values the pool daemon did not write to a lower tier because that tier was writing the same key already (one per tier).",
    ),
    histogram(
        DAEMON_TIER_OP_SECONDS,
        &["tenant", "tier", "op"],
        "Latency of one call of the pool daemon to a lower tier (get, put, contains).",
    ),
    histogram(
        DAEMON_REQUEST_SECONDS,
        &["tenant", "kind"],
        "Time the pool daemon took to answer one engine request, from decoded request to reply (kind: exists, get, get_resident, prepare_save, commit, release, delete, stats; attach: a second attach, refused).",
    ),
    histogram(
        DAEMON_CLIENT_CALL_SECONDS,
        &["kind"],
        "Time an engine waited for the pool daemon's reply to one request, from the first byte sent to the reply read (kind as kvpool_daemon_request_seconds): the daemon's answer, the socket, and the time the daemon's thread waited for a CPU. Recorded in the engine's process.",
    ),
    histogram(
        DAEMON_ARENA_COPY_SECONDS,
        &["tenant", "priority"],
        "Time the pool daemon took to copy and check one commit's values out of its shared memory for its lower tiers, by priority: low (the disk tiers' low-priority threads; including its pauses for a contested CPU) or daemon (the daemon's own threads, beside the engines' requests).",
    ),
    histogram(
        DAEMON_WRITE_BEHIND_PAUSE_SECONDS,
        &["tenant"],
        "Each pause of the pool daemon's write-behind on its low-priority threads, taken because other processes waited for a CPU while it worked.",
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

    /// Every metric kvpool records: core's catalogue and the backends'.
    fn all_metrics() -> Vec<MetricInfo> {
        kvpool_core::telemetry::METRICS
            .iter()
            .chain(BACKEND_METRICS)
            .copied()
            .collect()
    }

    /// The metric names `text` mentions (`kvpool_` and what follows), with the line each is on.
    fn metric_names(text: &str) -> Vec<(String, &str)> {
        text.match_indices("kvpool_")
            .map(|(at, _)| {
                let name: String = text[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                let line_end = text[at..].find('\n').map_or(text.len(), |e| at + e);
                let line_start = text[..at].rfind('\n').map_or(0, |s| s + 1);
                (name, &text[line_start..line_end])
            })
            .collect()
    }

    /// The recorded metric `name` names (a histogram's `_bucket`/`_count`/`_sum` series too).
    fn recorded<'a>(all: &'a [MetricInfo], name: &str) -> Option<&'a MetricInfo> {
        let base = name
            .trim_end_matches("_bucket")
            .trim_end_matches("_count")
            .trim_end_matches("_sum");
        all.iter().find(|m| m.name == name || m.name == base)
    }

    /// The Grafana dashboard (docs/grafana/kvpool-dashboard.json) parses, queries only
    /// metrics kvpool records, groups by a label only the metrics that carry it, and has the
    /// daemon's panels.
    #[test]
    fn the_dashboard_queries_only_recorded_metrics_by_their_labels() {
        let dashboard = include_str!("../../docs/grafana/kvpool-dashboard.json");
        let json: serde_json::Value = serde_json::from_str(dashboard).expect("valid JSON");
        let panels = json["panels"].as_array().expect("panels");
        let mut ids = std::collections::HashSet::new();
        for p in panels {
            assert!(
                ids.insert(p["id"].as_u64().unwrap()),
                "panel ids are unique"
            );
            if p["type"] != "row" {
                assert!(
                    !p["targets"].as_array().unwrap().is_empty(),
                    "{} has queries",
                    p["title"]
                );
            }
        }
        let all = all_metrics();
        let mut used = std::collections::HashSet::new();
        for (name, line) in metric_names(dashboard) {
            let metric = recorded(&all, &name).unwrap_or_else(|| {
                panic!("the dashboard queries {name}, which kvpool does not record")
            });
            for label in ["tier", "tenant", "op"] {
                if line.contains(&format!("by ({label}")) || line.contains(&format!("{label}=~")) {
                    assert!(
                        metric.labels.contains(&label),
                        "the dashboard selects {name} by {label}, which it does not carry: {line}"
                    );
                }
            }
            used.insert(metric.name);
        }
        for m in BACKEND_METRICS
            .iter()
            .filter(|m| m.name.starts_with("kvpool_daemon_"))
        {
            assert!(used.contains(m.name), "no dashboard panel shows {}", m.name);
        }
        assert!(
            used.len() >= 25,
            "the dashboard queries {} metrics",
            used.len()
        );
    }

    /// The alert rules (deploy/prometheus/kvpool-alerts.yml) name only metrics kvpool records
    /// (promtool checks their syntax and runs their unit tests: kvpool-cli/tests/prometheus.rs).
    #[test]
    fn the_alert_rules_use_only_recorded_metrics() {
        let rules = include_str!("../../deploy/prometheus/kvpool-alerts.yml");
        let all = all_metrics();
        let mut used = 0;
        for (name, line) in metric_names(rules) {
            assert!(
                recorded(&all, &name).is_some(),
                "the alert rules query {name}, which kvpool does not record: {line}"
            );
            used += 1;
        }
        assert!(used >= 10, "the alert rules query {used} metrics");
    }

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
