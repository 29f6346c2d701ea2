//! `KeyClaims`: one write of a key in flight per connector (one Mooncake client).
//!
//! Every call of a connector reaches Mooncake as one client (one `MooncakeDistributedStore`),
//! and, as we read its master's source (`UpsertStart` on a key in progress; not reproduced
//! here), a second upsert of a key still being written takes the first one's place, after
//! which the first upsert's end can publish, and a reader's removal free, memory the second
//! is still writing: a value torn or lost (the chunk format turns a torn value into a miss).
//! The `concurrent_access` conformance check failed once against Mooncake with its own key
//! lost, which this would explain. Writers of one key through two connectors are two clients
//! and race as Mooncake intends (the connector retries the loser).

use std::collections::HashSet;

use parking_lot::{Condvar, Mutex};

/// The keys a connector's calls are writing now.
#[derive(Default)]
pub(super) struct KeyClaims {
    writing: Mutex<HashSet<String>>,
    /// Signalled when keys leave `writing`.
    released: Condvar,
}

impl KeyClaims {
    /// Waits until no other call is writing any of `keys`, then marks them written by this
    /// one until the returned claim drops. A call claims all its keys at once, so no two
    /// calls can wait for each other.
    pub(super) fn claim(&self, keys: &[String]) -> KeyClaim<'_> {
        let mut writing = self.writing.lock();
        while keys.iter().any(|k| writing.contains(k)) {
            self.released.wait(&mut writing);
        }
        writing.extend(keys.iter().cloned());
        KeyClaim {
            claims: self,
            keys: keys.to_vec(),
        }
    }
}

/// Keys one call is writing ([`KeyClaims::claim`]); released on drop, even when the call
/// fails.
pub(super) struct KeyClaim<'a> {
    claims: &'a KeyClaims,
    keys: Vec<String>,
}

impl Drop for KeyClaim<'_> {
    fn drop(&mut self) {
        let mut writing = self.claims.writing.lock();
        for key in &self.keys {
            writing.remove(key);
        }
        self.claims.released.notify_all();
    }
}
