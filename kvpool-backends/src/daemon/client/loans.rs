//! What a session lends out of the daemon's arena: values pinned where they lie for a reader
//! to copy once, and allocations for a writer to copy a value into where it will lie, then
//! commit. Each loan keeps the arena mapped, and is released on its session's next call once
//! its holder lets go (the daemon reclaims it anyway when the session ends, or after its time
//! to live).

use std::collections::BTreeMap;
use std::io;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Instant;

use kvpool_core::memory::SharedMapping;
use kvpool_core::{BackendError, LentBytes, PinnedBytes};
use parking_lot::Mutex;

use super::Inner;
use super::session::{Session, protocol_error};
use crate::daemon::protocol::{Reply, Request};

impl Inner {
    /// Pins the values of `keys` that shared memory holds and lends each where it lies, until
    /// its [`PinnedBytes`] is dropped (then released on the session's next call), and no
    /// longer than half the daemon's lease time to live from its answer.
    pub(super) fn pin(&self, keys: Vec<String>) -> Result<Vec<Option<PinnedBytes>>, BackendError> {
        self.with_session(|s| {
            let n = keys.len();
            let Reply::Pinned(regions) = s.call(&Request::GetResident { keys })? else {
                return Err(io::Error::other("a Get answered otherwise"));
            };
            let usable_until = Instant::now() + s.lease_ttl / 2;
            if regions.len() != n {
                return Err(io::Error::other("a Get answered the wrong number of keys"));
            }
            let mut out = Vec::with_capacity(n);
            for region in &regions {
                let Some(r) = region else {
                    out.push(None);
                    continue;
                };
                // A region outside the arena ends the session (the daemon then reclaims the
                // pins) before anything is lent.
                let ptr = s.bytes_of(r)?;
                let pin = Loan::of(s, r.id);
                // SAFETY: the region lies in the mapping, which `pin` keeps mapped.
                out.push(Some(unsafe {
                    PinnedBytes::new(ptr, r.len as usize, usable_until, Box::new(pin))
                }));
            }
            Ok(out)
        })
    }

    /// Allocates a value of each length in the arena and lends each allocation to be written
    /// where it lies (`None` where the daemon had no room), until committed
    /// ([`Inner::commit_lent`]) or dropped, and no longer than half the daemon's lease time to
    /// live from its answer. Nobody reads an allocation before it is committed.
    pub(super) fn lend(&self, lens: Vec<usize>) -> Result<Vec<Option<LentBytes>>, BackendError> {
        self.with_session(|s| {
            let request = Request::PrepareSave {
                lens: lens.iter().map(|&len| len as u64).collect(),
            };
            let Reply::Prepared(regions) = s.call(&request)? else {
                return Err(io::Error::other("a PrepareSave answered otherwise"));
            };
            let usable_until = Instant::now() + s.lease_ttl / 2;
            if regions.len() != lens.len() {
                return Err(io::Error::other("a PrepareSave answered the wrong count"));
            }
            let mut out = Vec::with_capacity(lens.len());
            for (region, &len) in regions.iter().zip(&lens) {
                let Some(r) = region else {
                    out.push(None);
                    continue;
                };
                // Checked before anything is lent: a wrong answer ends the session, and the
                // daemon then reclaims every allocation it made.
                if r.len != len as u64 {
                    return Err(io::Error::other("an allocation of the wrong length"));
                }
                let ptr = s.bytes_of(r)?;
                let loan = Loan::of(s, r.id);
                // SAFETY: the region lies in the mapping, which `loan` keeps mapped; it is
                // this session's allocation, outside the daemon's index until committed.
                out.push(Some(unsafe {
                    LentBytes::new(ptr, len, usable_until, Box::new(loan))
                }));
            }
            Ok(out)
        })
    }

    /// Commits allocations lent by [`Inner::lend`] under their keys, each on the session that
    /// lent it; returns how many the daemon stored. A loan past its time, another tier's, or
    /// one whose session has since ended (the daemon reclaimed it) stores nothing.
    pub(super) fn commit_lent(
        &self,
        entries: Vec<(String, LentBytes)>,
    ) -> Result<usize, BackendError> {
        let mut by_slot: BTreeMap<usize, Vec<(String, Box<Loan>)>> = BTreeMap::new();
        for (key, bytes) in entries {
            if !bytes.usable() {
                continue;
            }
            if let Ok(loan) = bytes.into_handle().downcast::<Loan>() {
                by_slot.entry(loan.slot).or_default().push((key, loan));
            }
        }
        let mut stored = 0;
        for (slot, mut loans) in by_slot {
            // A session that fails ends (the daemon reclaims its loans); the others go on.
            stored += self
                .with_attached_session(slot, |s| {
                    loans.retain(|(_, loan)| loan.lent_by(s));
                    if loans.is_empty() {
                        return Ok(0);
                    }
                    let entries = loans.iter().map(|(key, l)| (l.id, key.clone())).collect();
                    let committed = match s.call(&Request::Commit { entries })? {
                        Reply::Committed(n) => n as usize,
                        other => return Err(protocol_error(&other)),
                    };
                    if committed == loans.len() {
                        // Every one is a value now: nothing to release.
                        loans.iter_mut().for_each(|(_, l)| l.settled = true);
                    }
                    Ok(committed)
                })
                .ok()
                .flatten()
                .unwrap_or(0);
        }
        Ok(stored)
    }
}

/// One pin or allocation a session lent out: keeps the arena mapped, and queues its release
/// on the session that lent it when dropped (unless committed: then it is a value).
pub(super) struct Loan {
    id: u64,
    /// The session slot that lent it.
    slot: usize,
    unreleased: Arc<Mutex<Vec<u64>>>,
    settled: bool,
    _arena: Arc<SharedMapping>,
    /// The session's socket, kept open while the loan lives: the daemon reclaims the loan
    /// (and may reuse its memory) only once the socket closes, or after its time to live,
    /// which [`LentBytes::usable`] and [`PinnedBytes::usable`] stop short of.
    _socket: Arc<UnixStream>,
}

impl Loan {
    fn of(s: &Session, id: u64) -> Self {
        Loan {
            id,
            slot: s.slot,
            unreleased: s.unreleased.clone(),
            settled: false,
            _arena: s.arena.clone(),
            _socket: s.stream.clone(),
        }
    }

    /// Whether `s` is the session that lent it (not a later one in the same slot).
    fn lent_by(&self, s: &Session) -> bool {
        Arc::ptr_eq(&self.unreleased, &s.unreleased)
    }
}

impl Drop for Loan {
    fn drop(&mut self) {
        if !self.settled {
            self.unreleased.lock().push(self.id);
        }
    }
}
