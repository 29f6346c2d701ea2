//! What the daemon may move between its shared memory and its lower tiers: kvpool keys only,
//! each value checked on the way; each call to a tier timed.

use crate::telemetry;

/// Whether `key` is a kvpool key (a [`kvpool_core::CacheKey`]'s text): only such keys reach the
/// lower tiers. Engines may name anything in shared memory, which holds only what engines
/// committed; the lower tiers may be shared with other programs (one Redis, one bucket), whose
/// keys an engine that can attach must not read, write, probe or have deleted as corrupt.
pub(super) fn is_kvpool_key(key: &str) -> bool {
    key.parse::<kvpool_core::CacheKey>().is_ok()
}

/// Checks a value under `key` before it crosses between shared memory and a lower tier: a value
/// under a chunk key of kvpool's (every key an engine's pool writes, and the only keys that
/// reach a lower tier: [`is_kvpool_key`]) must be a whole chunk in the chunk format, its
/// checksum right, bound to that key and its layout.
pub(super) fn check_stored_value(key: &str, bytes: &[u8]) -> Result<(), kvpool_core::FormatError> {
    use kvpool_core::format::chunk_format::{DecodeExpectation, decode_header};
    let Ok(parsed) = key.parse::<kvpool_core::CacheKey>() else {
        return Ok(());
    };
    decode_header(bytes, &DecodeExpectation::bound_to(&parsed, u64::MAX)).map(drop)
}

/// The daemon's latency histogram for one call kind (`contains`, `get`, `put`) to one lower
/// tier (`kvpool_daemon_tier_op_seconds`).
pub(super) fn tier_op_seconds(tenant: &str, tier: &str, op: &'static str) -> metrics::Histogram {
    metrics::histogram!(telemetry::DAEMON_TIER_OP_SECONDS, "tenant" => tenant.to_string(),
        "tier" => tier.to_string(), "op" => op)
}
