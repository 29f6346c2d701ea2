//! Values a tier handed out that failed their checks, and their deletion from that tier only
//! while it still holds the very bytes that were read.

use std::sync::Arc;

use parking_lot::Mutex;
use tracing::{debug, warn};
use xxhash_rust::xxh3::xxh3_128;

use super::{CopyOut, RemoteConnector};

/// A value a tier handed out that failed its checks (a checksum, a header, a key binding, a
/// tenant's MAC): its key in the tier and a digest of the bytes read, which
/// [`delete_rejected`] compares with what the tier holds when it deletes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RejectedValue {
    /// The value's key in the tier.
    pub key: String,
    digest: u128,
}

impl RejectedValue {
    /// The value read under `key` as `bytes`.
    pub fn new(key: String, bytes: &[u8]) -> Self {
        RejectedValue {
            key,
            digest: xxh3_128(bytes),
        }
    }
}

/// What every reader of a tier does first with a value it rejects (a checksum, a header, a key
/// binding, a tenant's MAC: `why`): logs it at `warn` and counts it in
/// `kvpool_corrupt_values_total{tier}`. The value is a miss; [`delete_rejected`] then deletes
/// it from `tier` only.
pub fn record_rejected(tier: &str, key: &str, why: &dyn std::fmt::Display) {
    warn!(tier, key, error = %why, "a tier's value failed its checks: a miss, deleted from that tier if it still holds those bytes");
    metrics::counter!(crate::telemetry::CORRUPT_VALUES, "tier" => tier.to_string()).increment(1);
}

/// Deletes each rejected value from `tier`, but only where the tier still holds the bytes
/// that were read: a good value written under the key since the read (a save's write, a
/// write-behind landing) stays, so a bad read never deletes it. Deleting the bad value means
/// lookups stop promising it and a later save stores it again.
///
/// The tier is read again for this: a tier in node memory through
/// [`crate::NodeMemoryConnector::batch_copy_out`] of what it holds there (never the storage behind
/// it), any other through [`RemoteConnector::batch_get_each`] (where the tier reads one value
/// at a time, each visited where it lies; otherwise a whole `batch_get`, so a bad value costs
/// a second read of it, which only a bad value pays). A value the tier no longer holds, or
/// one that differs, is left alone, and a failed re-read deletes nothing.
///
/// A value in node memory is digested where it lies just after its check failed on a copy
/// (the check never reads the shared bytes); a byte changed during that copy and changed back
/// before the digest leaves a good value deleted, which costs a recompute, never wrong bytes.
/// A write landing between the re-read and the delete is still lost, as it would be to any
/// delete without a compare-and-swap that not every tier offers. Returns how many values
/// were deleted.
pub async fn delete_rejected<C: RemoteConnector + ?Sized>(
    tier: &C,
    rejected: Vec<RejectedValue>,
) -> usize {
    if rejected.is_empty() {
        return 0;
    }
    let keys: Vec<String> = rejected.iter().map(|value| value.key.clone()).collect();
    let digests_now: Arc<Mutex<Vec<Option<u128>>>> = Arc::new(Mutex::new(vec![None; keys.len()]));
    let visit: CopyOut = {
        let digests_now = digests_now.clone();
        Arc::new(move |i, bytes| {
            if let Some(slot) = digests_now.lock().get_mut(i) {
                *slot = Some(xxh3_128(bytes));
            }
        })
    };
    let reread = match tier.node_memory() {
        // What node memory holds now, never the storage behind it: the read that rejected
        // the value may be a lookup's, which waits on no disk and no network.
        Some(node_memory) => node_memory.batch_copy_out(&keys, true, visit).await,
        None => tier.batch_get_each(&keys, visit).await,
    };
    if let Err(e) = reread {
        debug!(
            tier = tier.name(),
            "could not re-read rejected values; none deleted: {e}"
        );
        return 0;
    }
    let digests_now = std::mem::take(&mut *digests_now.lock());
    let unchanged: Vec<String> = rejected
        .into_iter()
        .zip(digests_now)
        .filter(|(was, now)| *now == Some(was.digest))
        .map(|(was, _)| was.key)
        .collect();
    if unchanged.is_empty() {
        return 0;
    }
    match tier.batch_delete(&unchanged).await {
        Ok(deleted) => deleted,
        Err(e) => {
            warn!(tier = tier.name(), "could not delete rejected values: {e}");
            0
        }
    }
}
