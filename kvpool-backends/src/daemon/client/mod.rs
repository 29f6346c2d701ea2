//! The engine's side of the pool daemon: `kvpool+unix://` tiers, a [`RemoteConnector`] whose
//! values live in the daemon's shared memory. Requests go over the socket; bytes are copied
//! between the engine's buffers and the daemon's arena, mapped once at attach: once each way
//! between the arena and L1's pool (`batch_copy_out`, `batch_copy_in`), or lent where they lie
//! (`batch_pin`) for a reader that copies them once, straight into an engine's KV blocks, and
//! allocations lent (`batch_lend`) for a writer that copies a value once, straight out of an
//! engine's KV blocks, then commits it (`batch_commit_lent`).

mod loans;
mod node_memory;
mod session;

use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use kvpool_core::memory::SharedMapping;
use kvpool_core::{BackendError, ConfigError, NodeMemoryConnector, RemoteConnector};
use parking_lot::{Mutex, MutexGuard};
use tracing::{info, warn};

use super::protocol::{DaemonStats, Reply, Request};
use crate::backend_factory::{BackendFactory, TierRequest};
use session::{Session, protocol_error};

/// The schemes of a daemon tier: `kvpool+unix:///run/kvpool/kvpool.sock`.
pub const SCHEMES: &[&str] = &["kvpool+unix"];

/// How long after a failed connection no new one is tried (calls are misses meanwhile).
pub const RECONNECT_INTERVAL: Duration = Duration::from_secs(1);

/// How often an engine looks at its idle sessions for a daemon that went away.
pub const DAEMON_WATCH_INTERVAL: Duration = Duration::from_millis(500);

/// Sessions one connector keeps open, so a long write-behind does not hold up a load (each
/// call runs on one session; copies of different calls run on different threads).
pub const SESSIONS_PER_CONNECTOR: usize = 4;

struct Inner {
    name: String,
    path: PathBuf,
    timeout: Duration,
    sessions: Vec<Mutex<Option<Session>>>,
    next: AtomicUsize,
    last_failure: Mutex<Option<Instant>>,
    /// The last daemon's arena as mapped here, shared by the sessions attached to it.
    arena: Mutex<Option<(u64, Arc<SharedMapping>)>>,
}

impl Inner {
    /// A session slot and its index: the first free one (calls one at a time use only the
    /// first), else the next in turn, waited for at most the tier's timeout.
    fn slot(&self) -> Result<(usize, MutexGuard<'_, Option<Session>>), BackendError> {
        if let Some(free) = self
            .sessions
            .iter()
            .enumerate()
            .find_map(|(i, slot)| slot.try_lock().map(|guard| (i, guard)))
        {
            return Ok(free);
        }
        let turn = self.next.fetch_add(1, Ordering::Relaxed) % self.sessions.len();
        self.sessions[turn]
            .try_lock_for(self.timeout)
            .map(|guard| (turn, guard))
            .ok_or_else(|| self.unavailable("every session stayed busy past the timeout".into()))
    }

    /// Runs `f` on a session, attaching first when the slot has none (at most once per
    /// [`RECONNECT_INTERVAL`] after a failure). Any error ends the session: the daemon then
    /// reclaims whatever it lent to it.
    fn with_session<T>(
        &self,
        f: impl FnOnce(&mut Session) -> io::Result<T>,
    ) -> Result<T, BackendError> {
        let (slot, mut guard) = self.slot()?;
        if guard.is_none() {
            if let Some(t) = *self.last_failure.lock()
                && t.elapsed() < RECONNECT_INTERVAL
            {
                return Err(self.unavailable("not attached (retrying shortly)".into()));
            }
            let known = self.arena.lock().clone();
            let known_id = known.as_ref().map(|(id, _)| *id);
            match Session::attach(&self.path, self.timeout, known, slot) {
                Ok(mut s) => {
                    let mut arena = self.arena.lock();
                    match &*arena {
                        // This daemon's arena is mapped already (another slot may have
                        // attached meanwhile): one mapping per daemon.
                        Some((id, mapped))
                            if *id == s.daemon_id && mapped.len() == s.arena.len() =>
                        {
                            s.arena = mapped.clone();
                        }
                        _ => {
                            // The daemon allocated every page at start; this fills this
                            // process's page tables only, on a thread of its own.
                            s.arena.map_all_pages_behind();
                            *arena = Some((s.daemon_id, s.arena.clone()));
                        }
                    }
                    drop(arena);
                    info!(socket = %self.path.display(), daemon = s.daemon_id, arena_bytes = s.arena.len(), "attached to the kvpool daemon");
                    if known_id.is_some_and(|id| id != s.daemon_id) {
                        self.end_stale_sessions(s.daemon_id);
                    }
                    *guard = Some(s);
                }
                Err(e) => {
                    *self.last_failure.lock() = Some(Instant::now());
                    return Err(
                        self.unavailable(format!("cannot attach to {}: {e}", self.path.display()))
                    );
                }
            }
        }
        self.run(&mut guard, f)
    }

    /// Drops this process's mapping of daemon `daemon_id`'s arena once no session but `ended`
    /// (the slot whose session just ended) may still be attached to it: a daemon that died
    /// keeps its arena's pages alive as long as an engine maps them, so a restarted daemon's
    /// new arena would double the node's memory (and overrun a `MemoryMax=`) until every engine
    /// attached again. Values lent out hold their own reference until they are let go; a busy
    /// slot counts as attached (it drops the mapping when it fails in turn).
    fn forget_arena_unless_attached(&self, daemon_id: u64, ended: usize) {
        let attached = self
            .sessions
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != ended)
            .any(|(_, slot)| {
                slot.try_lock()
                    .is_none_or(|g| g.as_ref().is_some_and(|s| s.daemon_id == daemon_id))
            });
        if attached {
            return;
        }
        let mut arena = self.arena.lock();
        if arena.as_ref().is_some_and(|(id, _)| *id == daemon_id) {
            *arena = None;
            info!(socket = %self.path.display(), daemon = daemon_id, "no session left on the daemon: its arena unmapped");
        }
    }

    /// Ends the idle sessions whose daemon went away, then unmaps its arena unless a busy
    /// session may still use it: an engine that makes no call would otherwise keep a dead
    /// daemon's whole arena alive, and a restarted daemon's new one would double the node's
    /// memory. Runs every [`DAEMON_WATCH_INTERVAL`] on the connector's watch thread.
    fn end_sessions_of_departed_daemons(&self) {
        let mut ended = Vec::new();
        for (i, slot) in self.sessions.iter().enumerate() {
            let Some(mut guard) = slot.try_lock() else {
                continue;
            };
            if guard.as_ref().is_some_and(Session::daemon_went_away)
                && let Some(session) = guard.take()
            {
                ended.push((session.daemon_id, i));
            }
        }
        for (daemon_id, slot) in ended {
            info!(socket = %self.path.display(), daemon = daemon_id, "the kvpool daemon went away: its session ended");
            self.forget_arena_unless_attached(daemon_id, slot);
        }
    }

    /// Ends the idle sessions still attached to a daemon other than `daemon_id` (one that
    /// died or was replaced): each keeps that daemon's whole arena mapped, and a slot used
    /// only when calls overlap might not fail for a long time. A busy one ends on its own at
    /// its next error.
    fn end_stale_sessions(&self, daemon_id: u64) {
        for slot in &self.sessions {
            if let Some(mut guard) = slot.try_lock()
                && guard.as_ref().is_some_and(|s| s.daemon_id != daemon_id)
            {
                *guard = None;
            }
        }
    }

    /// Runs `f` on the session in slot `slot` if one is attached there (`None` otherwise:
    /// what a session lent ends with it, so nothing attaches for it).
    fn with_attached_session<T>(
        &self,
        slot: usize,
        f: impl FnOnce(&mut Session) -> io::Result<T>,
    ) -> Result<Option<T>, BackendError> {
        let Some(slot) = self.sessions.get(slot) else {
            return Ok(None);
        };
        let mut guard = slot
            .try_lock_for(self.timeout)
            .ok_or_else(|| self.unavailable("the session stayed busy past the timeout".into()))?;
        if guard.is_none() {
            return Ok(None);
        }
        self.run(&mut guard, f).map(Some)
    }

    /// Runs `f` on the attached session in `guard`, after releasing what its holders let go
    /// of; an error ends the session.
    fn run<T>(
        &self,
        guard: &mut MutexGuard<'_, Option<Session>>,
        f: impl FnOnce(&mut Session) -> io::Result<T>,
    ) -> Result<T, BackendError> {
        let session = guard
            .as_mut()
            .expect("the caller checked a session is attached");
        let result = session.release_let_go().and_then(|()| f(session));
        let slot = session.slot;
        let daemon_id = session.daemon_id;
        if let Err(e) = &result {
            warn!(socket = %self.path.display(), "daemon session ended: {e}");
            **guard = None;
            *self.last_failure.lock() = Some(Instant::now());
            self.forget_arena_unless_attached(daemon_id, slot);
        }
        self.release_let_go_elsewhere(slot);
        result.map_err(|e| self.unavailable(e.to_string()))
    }

    /// Releases what holders let go of on the idle sessions other than `slot`'s: a slot used
    /// only when calls overlap may see no call of its own for long, and the daemon cannot
    /// evict an allocation or a pinned value until it is released.
    fn release_let_go_elsewhere(&self, slot: usize) {
        for (i, other) in self.sessions.iter().enumerate() {
            if i == slot {
                continue;
            }
            let Some(mut guard) = other.try_lock() else {
                continue;
            };
            let Some(session) = guard.as_mut() else {
                continue;
            };
            if session.unreleased.lock().is_empty() {
                continue;
            }
            if let Err(e) = session.release_let_go() {
                warn!(socket = %self.path.display(), "daemon session ended: {e}");
                *guard = None;
            }
        }
    }

    fn unavailable(&self, reason: String) -> BackendError {
        BackendError::Unavailable {
            backend: format!("{} ({})", self.name, self.path.display()),
            reason,
        }
    }

    /// Reads the values of `keys` where they lie in the arena, handing each to `copy` while
    /// the daemon keeps it pinned; with `resident_only`, only those shared memory holds (the
    /// daemon reads none of its lower tiers).
    fn read<T>(
        &self,
        keys: Vec<String>,
        resident_only: bool,
        mut copy: impl FnMut(usize, &[u8]) -> T,
    ) -> Result<Vec<Option<T>>, BackendError> {
        self.with_session(|s| {
            let n = keys.len();
            let request = if resident_only {
                Request::GetResident { keys }
            } else {
                Request::Get { keys }
            };
            let Reply::Pinned(regions) = s.call(&request)? else {
                return Err(io::Error::other("a Get answered otherwise"));
            };
            let answered = Instant::now();
            if regions.len() != n {
                return Err(io::Error::other("a Get answered the wrong number of keys"));
            }
            let mut out = Vec::with_capacity(n);
            let mut pins = Vec::new();
            for (i, region) in regions.iter().enumerate() {
                let Some(r) = region else {
                    out.push(None);
                    continue;
                };
                pins.push(r.id);
                // A region outside the arena ends the session (the daemon then reclaims the
                // pins) before anything is read.
                let ptr = s.bytes_of(r)?;
                s.still_leased(answered)?;
                // SAFETY: the region lies in the mapping and the daemon keeps it unchanged
                // while pinned (until the release below). `copy` copies what it keeps before
                // the release, and checks a chunk's checksum on its copy, which no other
                // process can change.
                let bytes = unsafe { std::slice::from_raw_parts(ptr, r.len as usize) };
                out.push(Some(copy(i, bytes)));
            }
            if !pins.is_empty() {
                s.call(&Request::Release { ids: pins })?;
            }
            Ok(out)
        })
    }

    /// Stores a value of each length under its key, each written by `fill` straight into
    /// the allocation the daemon lends for it, then committed (visible from then on).
    fn write(
        &self,
        entries: Vec<(String, usize)>,
        mut fill: impl FnMut(usize, &mut [u8]),
    ) -> Result<(), BackendError> {
        let stored = self.with_session(|s| {
            let lens = entries.iter().map(|(_, len)| *len as u64).collect();
            let Reply::Prepared(regions) = s.call(&Request::PrepareSave { lens })? else {
                return Err(io::Error::other("a PrepareSave answered otherwise"));
            };
            let answered = Instant::now();
            if regions.len() != entries.len() {
                return Err(io::Error::other("a PrepareSave answered the wrong count"));
            }
            let mut commit = Vec::new();
            for (i, ((key, len), region)) in entries.iter().zip(&regions).enumerate() {
                let Some(r) = region else { continue };
                if r.len != *len as u64 {
                    return Err(io::Error::other("an allocation of the wrong length"));
                }
                let ptr = s.bytes_of(r)?;
                s.still_leased(answered)?;
                // SAFETY: the region lies in the mapping and is this session's allocation,
                // which nobody reads until it is committed.
                let dst = unsafe { std::slice::from_raw_parts_mut(ptr, *len) };
                fill(i, dst);
                commit.push((r.id, key.clone()));
            }
            if commit.is_empty() {
                return Ok(0);
            }
            match s.call(&Request::Commit { entries: commit })? {
                Reply::Committed(n) => Ok(n as usize),
                other => Err(protocol_error(&other)),
            }
        })?;
        if stored < entries.len() {
            return Err(self.unavailable(format!(
                "the daemon had no room for {} of {} values",
                entries.len() - stored,
                entries.len()
            )));
        }
        Ok(())
    }
}

/// A tier in the node's pool daemon (`kvpool serve`), at a Unix socket.
///
/// Calls block on the socket, so each runs on tokio's blocking pool, on one of
/// [`SESSIONS_PER_CONNECTOR`] sessions; every socket read and write is bounded by the tier's
/// timeout. When the daemon
/// is down every call fails fast (a miss, or a write-behind not done) and the connector
/// attaches again once it is back.
#[derive(Clone)]
pub struct DaemonConnector {
    inner: Arc<Inner>,
}

/// The connector's watch thread: every [`DAEMON_WATCH_INTERVAL`], ends the idle sessions of
/// a daemon that went away; ends with the connector.
fn watch_for_departed_daemons(inner: Weak<Inner>) {
    loop {
        std::thread::sleep(DAEMON_WATCH_INTERVAL);
        let Some(inner) = inner.upgrade() else {
            return;
        };
        inner.end_sessions_of_departed_daemons();
    }
}

impl DaemonConnector {
    /// A connector for the daemon at `path`; nothing is connected until the first call.
    pub fn new(path: impl Into<PathBuf>, timeout: Duration) -> Self {
        let path = path.into();
        let connector = DaemonConnector {
            inner: Arc::new(Inner {
                // Metrics' `tier` label and KV events' medium (`DAEMON`); the path is logged.
                name: "daemon".into(),
                path,
                timeout,
                sessions: (0..SESSIONS_PER_CONNECTOR)
                    .map(|_| Mutex::new(None))
                    .collect(),
                next: AtomicUsize::new(0),
                last_failure: Mutex::new(None),
                arena: Mutex::new(None),
            }),
        };
        let watched = Arc::downgrade(&connector.inner);
        let spawned = std::thread::Builder::new()
            .name("kvpool-daemon-watch".into())
            .spawn(move || watch_for_departed_daemons(watched));
        if let Err(e) = spawned {
            warn!(
                "no thread to watch for a departed daemon ({e}): an idle engine notices one at its next call"
            );
        }
        connector
    }

    /// Attaches one session now (a probe); the error says why it could not.
    pub fn attach(&self) -> Result<(), BackendError> {
        self.inner.with_session(|_| Ok(()))
    }

    /// The daemon's counters.
    pub fn daemon_stats(&self) -> Result<DaemonStats, BackendError> {
        self.inner.with_session(|s| match s.call(&Request::Stats)? {
            Reply::Stats(stats) => Ok(stats),
            other => Err(protocol_error(&other)),
        })
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Result<T, BackendError> + Send + 'static,
    ) -> Result<T, BackendError> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .map_err(|e| {
                self.inner
                    .unavailable(format!("the call's thread failed: {e}"))
            })?
    }
}

#[async_trait]
impl RemoteConnector for DaemonConnector {
    fn name(&self) -> &str {
        &self.inner.name
    }

    /// Values lie in the daemon's shared arena, which this process maps: read with one copy,
    /// lent where they lie, pinned.
    fn node_memory(&self) -> Option<&dyn NodeMemoryConnector> {
        Some(self)
    }

    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        let keys = keys.to_vec();
        self.blocking(move |inner| {
            inner.with_session(|s| match s.call(&Request::Exists { keys })? {
                Reply::Exists(found) => Ok(found),
                other => Err(protocol_error(&other)),
            })
        })
        .await
    }

    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        let keys = keys.to_vec();
        self.blocking(move |inner| {
            inner.read(keys, false, |_, bytes| Bytes::copy_from_slice(bytes))
        })
        .await
    }

    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        self.blocking(move |inner| {
            let lens = entries.iter().map(|(k, v)| (k.clone(), v.len())).collect();
            inner.write(lens, |i, dst| dst.copy_from_slice(&entries[i].1))
        })
        .await
    }

    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        let keys = keys.to_vec();
        self.blocking(move |inner| {
            inner.with_session(|s| match s.call(&Request::Delete { keys })? {
                Reply::Deleted(n) => Ok(n as usize),
                other => Err(protocol_error(&other)),
            })
        })
        .await
    }

    async fn close(&self) -> Result<(), BackendError> {
        for slot in &self.inner.sessions {
            *slot.lock() = None;
        }
        *self.inner.arena.lock() = None;
        Ok(())
    }
}

/// The path of a `kvpool+unix://` URL (or of a `unix://` one, as the connector's `pool`
/// option takes it).
pub fn socket_path(url: &str) -> Result<PathBuf, ConfigError> {
    let path = url
        .strip_prefix("kvpool+unix://")
        .or_else(|| url.strip_prefix("unix://"))
        .unwrap_or(url);
    if !path.starts_with('/') {
        return Err(ConfigError::Invalid {
            field: "tier.url",
            reason: format!(
                "`{url}` does not name an absolute socket path: use kvpool+unix:///run/kvpool/kvpool.sock"
            ),
        });
    }
    Ok(PathBuf::from(path))
}

/// Opens `kvpool+unix://` tiers.
pub struct DaemonFactory;

#[async_trait]
impl BackendFactory for DaemonFactory {
    fn example(&self) -> String {
        "url = \"kvpool+unix:///run/kvpool/kvpool.sock\"  # the node's pool daemon (kvpool serve)"
            .into()
    }

    async fn open(&self, tier: &TierRequest<'_>) -> Result<Box<dyn RemoteConnector>, ConfigError> {
        tier.options().finish()?;
        let path = socket_path(tier.url())?;
        let connector = DaemonConnector::new(path, tier.timeout());
        let probe = connector.clone();
        match tokio::task::spawn_blocking(move || probe.attach()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!(
                "{e}; running with misses from this tier until the daemon answers (is `kvpool serve` running?)"
            ),
            Err(e) => warn!("attaching to the daemon failed: {e}"),
        }
        Ok(Box::new(connector))
    }
}

#[cfg(test)]
mod tests;
