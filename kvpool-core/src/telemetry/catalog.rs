//! Every Prometheus metric kvpool records: its name, kind, labels and help text in one catalogue
//! ([`METRICS`], which docs/metrics.md lists and a test keeps in step), and [`describe`], which
//! hands the help texts to whichever `metrics` recorder is installed.
//!
//! Metrics are recorded through the `metrics` facade: with no recorder installed (the default)
//! every call is a no-op. kvpool-backends' `build_pool` installs the Prometheus exporter when
//! the config asks for one (`[metrics] listen = "127.0.0.1:9464"`).

/// What kind of series a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Only goes up (`_total`).
    Counter,
    /// Goes up and down.
    Gauge,
    /// A distribution (`_seconds`), exported as a Prometheus histogram.
    Histogram,
}

/// One metric kvpool records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricInfo {
    /// The Prometheus name.
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: MetricKind,
    /// Label names, if any.
    pub labels: &'static [&'static str],
    /// What it counts.
    pub help: &'static str,
}

/// A counter's catalogue entry.
pub const fn counter(
    name: &'static str,
    labels: &'static [&'static str],
    help: &'static str,
) -> MetricInfo {
    MetricInfo {
        name,
        kind: MetricKind::Counter,
        labels,
        help,
    }
}

/// A gauge's catalogue entry.
pub const fn gauge(
    name: &'static str,
    labels: &'static [&'static str],
    help: &'static str,
) -> MetricInfo {
    MetricInfo {
        name,
        kind: MetricKind::Gauge,
        labels,
        help,
    }
}

/// A histogram's catalogue entry (in seconds).
pub const fn histogram(
    name: &'static str,
    labels: &'static [&'static str],
    help: &'static str,
) -> MetricInfo {
    MetricInfo {
        name,
        kind: MetricKind::Histogram,
        labels,
        help,
    }
}

/// Tokens the engine was asked to look up (the hit-rate denominator).
pub const LOOKUP_TOKENS: &str = "kvpool_lookup_tokens_total";
/// Tokens a lookup found (a whole-chunk prefix).
pub const HIT_TOKENS: &str = "kvpool_hit_tokens_total";
/// Lookups.
pub const LOOKUPS: &str = "kvpool_lookups_total";
/// Tokens a retrieve was asked to write.
pub const RETRIEVE_TOKENS: &str = "kvpool_retrieve_tokens_total";
/// Tokens a retrieve wrote.
pub const RETRIEVE_HIT_TOKENS: &str = "kvpool_retrieve_hit_tokens_total";
/// Tokens stored.
pub const STORED_TOKENS: &str = "kvpool_stored_tokens_total";
/// Chunks a tier served.
pub const TIER_HIT_CHUNKS: &str = "kvpool_tier_hit_chunks_total";
/// Tokens in the chunks a tier served.
pub const TIER_HIT_TOKENS: &str = "kvpool_tier_hit_tokens_total";
/// Chunks no tier served (or cut by an earlier miss).
pub const MISS_CHUNKS: &str = "kvpool_miss_chunks_total";
/// Bytes read from a tier.
pub const TIER_READ_BYTES: &str = "kvpool_tier_read_bytes_total";
/// Bytes written to a tier.
pub const TIER_WRITTEN_BYTES: &str = "kvpool_tier_written_bytes_total";
/// Tier errors turned into misses or skipped writes.
pub const TIER_ERRORS: &str = "kvpool_tier_errors_total";
/// Latency of one tier call.
pub const TIER_OP_SECONDS: &str = "kvpool_tier_op_seconds";
/// Chunks copied into L1 from a lower tier.
pub const PROMOTIONS: &str = "kvpool_promotions_total";
/// Write-behind entries dropped because the tier's in-flight quota was full.
pub const WRITE_BEHIND_DROPPED: &str = "kvpool_write_behind_dropped_total";
/// Write-behind entries lost because the tier's put failed.
pub const WRITE_BEHIND_FAILED: &str = "kvpool_write_behind_failed_total";
/// Write-behind entries skipped because the key was already in flight.
pub const WRITE_BEHIND_DEDUPLICATED: &str = "kvpool_write_behind_deduplicated_total";
/// Write-behind batches in flight.
pub const WRITE_BEHIND_PENDING: &str = "kvpool_write_behind_pending_batches";
/// Latency of a whole `get` across tiers.
pub const GET_SECONDS: &str = "kvpool_get_seconds";
/// Latency of a whole `put` (L1 plus scheduling write-behind).
pub const PUT_SECONDS: &str = "kvpool_put_seconds";
/// Stored values rejected by a check (checksum, layout, key binding, size).
pub const CORRUPT_VALUES: &str = "kvpool_corrupt_values_total";
/// Tier calls that hit their deadline.
pub const TIMEOUTS: &str = "kvpool_timeouts_total";
/// Entries evicted from a tier.
pub const EVICTIONS: &str = "kvpool_evictions_total";
/// Bytes of L1 memory holding chunks.
pub const L1_USED_BYTES: &str = "kvpool_l1_used_bytes";
/// Bytes of L1 memory in all.
pub const L1_CAPACITY_BYTES: &str = "kvpool_l1_capacity_bytes";
/// Chunks lent by node memory (the pool daemon) whose copy failed its checksum: not loaded.
pub const COPY_CHECK_FAILURES: &str = "kvpool_copy_check_failures_total";
/// Engine blocks reported to the engine as failed loads.
pub const LOAD_ERROR_BLOCKS: &str = "kvpool_load_error_blocks_total";
/// Tokens the connector loaded into the engine's cache.
pub const CONNECTOR_LOADED_TOKENS: &str = "kvpool_connector_loaded_tokens_total";
/// Tokens the connector stored from the engine's cache.
pub const CONNECTOR_STORED_TOKENS: &str = "kvpool_connector_stored_tokens_total";
/// Time of one call of the vLLM connector's worker into kvpool, by `call`.
pub const CONNECTOR_CALL_SECONDS: &str = "kvpool_connector_call_seconds";
/// KV events dropped because the engine did not drain them in time.
pub const TIER_EVENTS_DROPPED: &str = "kvpool_tier_events_dropped_total";
/// Bytes of L1 chunks held under lookup leases (promised, not yet loaded).
pub const LEASED_BYTES: &str = "kvpool_leased_bytes";
/// Lookup leases dropped because no load took them in time.
pub const LEASES_EXPIRED: &str = "kvpool_leases_expired_total";
/// Asynchronous loads being fetched or copied.
pub const ASYNC_LOADS_IN_FLIGHT: &str = "kvpool_async_loads_in_flight";
/// Bytes of chunks held by asynchronous loads in flight.
pub const ASYNC_LOAD_BYTES_IN_FLIGHT: &str = "kvpool_async_load_bytes_in_flight";
/// Copies between the engine's blocks and kvpool's memory handed to the engine and not yet
/// reported done.
pub const COPY_JOBS_IN_FLIGHT: &str = "kvpool_copy_jobs_in_flight";
/// Bytes of saved chunks waiting for their step to be committed.
pub const STAGED_SAVE_BYTES: &str = "kvpool_staged_save_bytes";
/// Saved chunks dropped before commit: computed on top of a failed load (on some rank) or
/// never committed in time.
pub const SAVES_DISCARDED: &str = "kvpool_saves_discarded_chunks_total";
/// Finished requests whose blocks the engine holds until their copies are done.
pub const HELD_REQUESTS: &str = "kvpool_held_requests";
/// Lookups the scheduler answered as misses because a rank's circuit breaker was open
/// (reported by TP rank 0's worker).
pub const LOOKUP_BREAKER_MISSES: &str = "kvpool_lookup_breaker_misses_total";
/// Worker ranks whose lookup circuit breaker is open in the scheduler (reported by TP rank 0).
pub const LOOKUP_BREAKERS_OPEN: &str = "kvpool_lookup_breakers_open";
/// Promised loads whose blocks never covered them (reported by TP rank 0's worker).
pub const BROKEN_PROMISES: &str = "kvpool_broken_promises_total";
/// Scheduler request states dropped at the cap (reported by TP rank 0's worker).
pub const TRACKERS_DROPPED: &str = "kvpool_trackers_dropped_total";
/// The scheduler's lookups of the worker ranks by `route`: `in_process` (every rank's server in
/// the scheduler's process, asked on its thread) or `socket` (reported by TP rank 0's worker).
pub const SCHEDULER_LOOKUPS: &str = "kvpool_scheduler_lookups_total";
/// SGLang storage backend pages by `op` (read, write) and `outcome` (ok, missed, refused).
pub const SGLANG_PAGES: &str = "kvpool_sglang_pages_total";

/// Every metric kvpool-core records (backends keep catalogues of their own).
pub const METRICS: &[MetricInfo] = &[
    gauge(
        LEASED_BYTES,
        &[],
        "Bytes of L1 chunks held under lookup leases between the scheduler's lookup and the load.",
    ),
    counter(
        LEASES_EXPIRED,
        &[],
        "Lookup leases dropped because no load took them within their time to live.",
    ),
    gauge(
        ASYNC_LOADS_IN_FLIGHT,
        &[],
        "Asynchronous loads being fetched from the tiers or copied into the engine's blocks.",
    ),
    gauge(
        ASYNC_LOAD_BYTES_IN_FLIGHT,
        &[],
        "Bytes of chunks held by asynchronous loads in flight.",
    ),
    gauge(
        COPY_JOBS_IN_FLIGHT,
        &[],
        "Block copies handed to the engine (loads and saves) not yet reported done.",
    ),
    gauge(
        STAGED_SAVE_BYTES,
        &[],
        "Bytes of saved chunks waiting for the scheduler to commit their step.",
    ),
    counter(
        SAVES_DISCARDED,
        &[],
        "Saved chunks dropped before commit: computed on a failed load, or never committed.",
    ),
    gauge(
        HELD_REQUESTS,
        &[],
        "Finished requests whose blocks the engine holds until kvpool's copies out of them end.",
    ),
    counter(
        LOOKUP_BREAKER_MISSES,
        &[],
        "Lookups answered as misses because a worker rank's circuit breaker was open.",
    ),
    gauge(
        LOOKUP_BREAKERS_OPEN,
        &[],
        "Worker ranks whose lookup circuit breaker is open in the scheduler.",
    ),
    counter(
        BROKEN_PROMISES,
        &[],
        "Promised loads whose engine blocks never covered them (reported as failed blocks).",
    ),
    counter(
        TRACKERS_DROPPED,
        &[],
        "Scheduler request states dropped because too many requests were tracked.",
    ),
    counter(
        SCHEDULER_LOOKUPS,
        &["route"],
        "Lookups (and presence checks) the scheduler asked of the worker ranks, by route: in_process (every rank served in the scheduler's own process, no socket) or socket.",
    ),
    counter(
        SGLANG_PAGES,
        &["op", "outcome"],
        "Pages SGLang's HiCache asked kvpool to read (prefetch) or write (backup), by outcome: ok, missed (absent or failing a check), refused (bad spans, memory full, a tier refused).",
    ),
    counter(LOOKUPS, &[], "Prefix lookups by the cache engine."),
    counter(
        LOOKUP_TOKENS,
        &[],
        "Tokens asked about in lookups: the hit-rate denominator.",
    ),
    counter(
        HIT_TOKENS,
        &[],
        "Tokens lookups found in the pool (whole chunks, a prefix).",
    ),
    counter(
        RETRIEVE_TOKENS,
        &[],
        "Tokens retrieves were asked to write.",
    ),
    counter(RETRIEVE_HIT_TOKENS, &[], "Tokens retrieves wrote."),
    counter(STORED_TOKENS, &[], "Tokens stored into the pool."),
    counter(TIER_HIT_CHUNKS, &["tier"], "Chunks a tier served to a get."),
    counter(
        TIER_HIT_TOKENS,
        &["tier"],
        "Tokens in the chunks a tier served.",
    ),
    counter(
        MISS_CHUNKS,
        &[],
        "Chunks a get wanted that no tier served (or that an earlier miss cut off).",
    ),
    counter(TIER_READ_BYTES, &["tier"], "Bytes read from a tier."),
    counter(TIER_WRITTEN_BYTES, &["tier"], "Bytes written to a tier."),
    counter(
        TIER_ERRORS,
        &["tier"],
        "Tier errors, each turned into misses or a skipped write.",
    ),
    histogram(
        TIER_OP_SECONDS,
        &["tier", "op"],
        "Latency of one tier call (op: get, put, contains).",
    ),
    counter(PROMOTIONS, &[], "Chunks copied into L1 from a lower tier."),
    counter(
        WRITE_BEHIND_DROPPED,
        &["tier"],
        "Write-behind entries dropped because the tier's in-flight quota was full.",
    ),
    counter(
        WRITE_BEHIND_FAILED,
        &["tier"],
        "Write-behind entries lost because the tier's put failed.",
    ),
    counter(
        WRITE_BEHIND_DEDUPLICATED,
        &["tier"],
        "Write-behind entries skipped because the same key was already in flight.",
    ),
    gauge(
        WRITE_BEHIND_PENDING,
        &[],
        "Write-behind batches in flight (the queue depth).",
    ),
    histogram(GET_SECONDS, &[], "Latency of a whole get across the tiers."),
    histogram(
        PUT_SECONDS,
        &[],
        "Latency of a whole put (L1, and scheduling write-behind).",
    ),
    counter(
        CORRUPT_VALUES,
        &["tier"],
        "Stored values rejected by a check (checksum, layout, key binding, size): misses, and deleted.",
    ),
    counter(TIMEOUTS, &["tier"], "Tier calls that hit their deadline."),
    counter(EVICTIONS, &["tier"], "Entries evicted from a tier."),
    gauge(L1_USED_BYTES, &[], "Bytes of L1 memory holding chunks."),
    gauge(L1_CAPACITY_BYTES, &[], "Bytes of L1 memory in all."),
    counter(
        COPY_CHECK_FAILURES,
        &[],
        "Chunks lent by the node's pool daemon whose copy (in the engine's blocks or a buffer) failed its checksum: reported as failed loads, recomputed.",
    ),
    counter(
        LOAD_ERROR_BLOCKS,
        &[],
        "Engine blocks the connector reported as failed loads (recomputed by the engine).",
    ),
    counter(
        CONNECTOR_LOADED_TOKENS,
        &[],
        "Tokens the connector loaded into the engine's KV cache.",
    ),
    counter(
        CONNECTOR_STORED_TOKENS,
        &[],
        "Tokens the connector stored from the engine's KV cache.",
    ),
    histogram(
        CONNECTOR_CALL_SECONDS,
        &["call"],
        "Time of one native call of vLLM's worker hooks into kvpool (call: bind, run_loads, run_saves, load_jobs, save_jobs, copy_done, poll, settle, order_copies_before, jobs_in_flight_for, pin_node_memory, transfer_results, failed_blocks, failed_load_requests, step_report, take_tier_events, stats, clear): kvpool's share of each engine step.",
    ),
    counter(
        TIER_EVENTS_DROPPED,
        &[],
        "KV events (chunks entering or leaving a tier) dropped: the engine did not drain them in time.",
    ),
];

/// Hands every metric's help text to the installed recorder (call once, after installing it).
/// Backends describe their own metrics the same way with [`describe_metrics`].
pub fn describe() {
    describe_metrics(METRICS);
}

/// Hands the help texts of `catalogue` to the installed recorder.
pub fn describe_metrics(catalogue: &[MetricInfo]) {
    for m in catalogue {
        match m.kind {
            MetricKind::Counter => metrics::describe_counter!(m.name, m.help),
            MetricKind::Gauge => metrics::describe_gauge!(m.name, m.help),
            MetricKind::Histogram => {
                metrics::describe_histogram!(m.name, metrics::Unit::Seconds, m.help)
            }
        }
    }
}

/// Checks a catalogue against Prometheus conventions: unique names, a `kvpool_` prefix,
/// counters ending in `_total`, histograms in `_seconds`, gauges not in `_total`.
pub fn check_catalogue(catalogue: &[MetricInfo]) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    for m in catalogue {
        let fits = match m.kind {
            MetricKind::Counter => m.name.ends_with("_total"),
            MetricKind::Histogram => m.name.ends_with("_seconds"),
            MetricKind::Gauge => !m.name.ends_with("_total"),
        };
        if !seen.insert(m.name) {
            return Err(format!("{} listed twice", m.name));
        }
        if !m.name.starts_with("kvpool_") || !fits {
            return Err(format!(
                "{} breaks the naming conventions for a {:?}",
                m.name, m.kind
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_prometheus_conventions_and_are_unique() {
        check_catalogue(METRICS).unwrap();
        assert!(check_catalogue(&[counter("kvpool_things", &[], "no _total")]).is_err());
    }

    /// docs/metrics.md lists every metric of core's catalogue.
    #[test]
    fn docs_list_every_metric() {
        let doc = include_str!("../../../docs/metrics.md");
        for m in METRICS {
            assert!(
                doc.contains(&format!("`{}`", m.name)),
                "docs/metrics.md does not list {}",
                m.name
            );
        }
        // That it lists nothing else is checked in kvpool-backends, which sees every catalogue.
    }
}
