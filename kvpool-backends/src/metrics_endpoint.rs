//! The Prometheus endpoint: installs `metrics-exporter-prometheus` as the process's `metrics`
//! recorder, serving the text format on `[metrics] listen` (every path answers).
//!
//! A process has one recorder, so one endpoint: a second pool may name the same address (it
//! shares the endpoint) or none; another address is an error that says which one serves. A
//! port another process holds is a warning, not a failed start: the process runs without
//! metrics (a monitoring gap, not an outage).

use std::net::SocketAddr;

use kvpool_core::ConfigError;

use crate::telemetry;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use parking_lot::Mutex;

/// Histogram buckets for every `_seconds` metric: 10 µs to 10 s.
const LATENCY_BUCKETS: &[f64] = &[
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
];

/// Where this process serves its metrics, once it does.
static SERVING: Mutex<Option<SocketAddr>> = Mutex::new(None);

fn refuse(reason: String) -> ConfigError {
    ConfigError::Invalid {
        field: "metrics.listen",
        reason,
    }
}

/// Serves Prometheus metrics on `addr` for the rest of the process (idempotent for the same
/// address). Install it before building a pool: series are registered when tiers are built.
///
/// A port that cannot be bound (taken by another process, or not permitted) is logged as a
/// warning naming the address and the reason, and the process goes on without an endpoint
/// (`Ok(false)`); `Ok(true)` once this process serves on `addr`.
pub fn serve_metrics(addr: SocketAddr) -> Result<bool, ConfigError> {
    let mut serving = SERVING.lock();
    match *serving {
        Some(current) if current == addr => return Ok(true),
        Some(current) => {
            return Err(refuse(format!(
                "this process already serves metrics on {current}; one endpoint per process"
            )));
        }
        None => {}
    }
    // Bind once ourselves first: a taken port is a warning naming it, and no endpoint.
    if let Err(e) = std::net::TcpListener::bind(addr) {
        tracing::warn!(
            %addr,
            error = %e,
            "cannot serve Prometheus metrics: the port is taken or not permitted; running \
             without a metrics endpoint (choose another `[metrics] listen`)"
        );
        return Ok(false);
    }
    let builder = PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
        .map_err(|e| refuse(e.to_string()))?;
    // Installed from a thread without a tokio runtime, the exporter runs on a thread of its
    // own: it serves whatever runtimes the caller has (or none).
    std::thread::spawn(move || builder.install())
        .join()
        .map_err(|_| refuse("the metrics exporter panicked while starting".into()))?
        .map_err(|e| refuse(format!("cannot serve metrics on {addr}: {e}")))?;
    telemetry::describe();
    *serving = Some(addr);
    tracing::info!(%addr, "serving Prometheus metrics");
    Ok(true)
}

/// The address this process serves metrics on, if any.
pub fn metrics_address() -> Option<SocketAddr> {
    *SERVING.lock()
}
