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

/// Deletes each rejected value from `tier`, but only where the tier still holds the bytes
/// that were read: a good value written under the key since the read (a save's write, a
/// write-behind landing) stays, so a bad read never deletes it. Deleting the bad value means
/// lookups stop promising it and a later save stores it again.
///
/// The tier is read again for this ([`RemoteConnector::batch_get_each`]: where the tier reads
/// one value at a time, each visited where it lies; otherwise a whole `batch_get`, so a bad
/// value costs a second read of it, which only a bad value pays); a value the tier no longer
/// holds, or one that differs, is left alone, and a failed re-read deletes nothing.
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
    if let Err(e) = tier.batch_get_each(&keys, visit).await {
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
