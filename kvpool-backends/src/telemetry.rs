//! The metrics only a backend records, in a catalogue of their own (kvpool-core's covers the
//! rest), listed in docs/metrics.md like core's.

use kvpool_core::telemetry::{MetricInfo, counter, describe_metrics};

/// Disk-tier writes refused because the disk or the tier's capacity is full.
pub const DISK_WRITES_REFUSED: &str = "kvpool_disk_writes_refused_total";
/// Mooncake calls failed fast after a cluster failure.
pub const MOONCAKE_FAST_FAILURES: &str = "kvpool_mooncake_fast_failures_total";

/// Every metric this crate's backends record.
pub const BACKEND_METRICS: &[MetricInfo] = &[
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
