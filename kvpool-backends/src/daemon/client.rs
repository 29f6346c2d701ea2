//! The engine's side of the pool daemon: `kvpool+unix://` tiers, a [`RemoteConnector`] whose
//! values live in the daemon's shared memory. Requests go over the socket; bytes are copied
//! between the engine's buffers and the daemon's arena, mapped once at attach: once each way
//! between the arena and L1's pool (`batch_copy_out`, `batch_copy_in`), or lent where they lie
//! (`batch_pin`) for a reader that copies them once, straight into an engine's KV blocks.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use kvpool_core::frame::{read_frame, write_frame};
use kvpool_core::memory::SharedMapping;
use kvpool_core::{BackendError, ConfigError, CopyIn, CopyOut, PinnedBytes, RemoteConnector};
use parking_lot::{Mutex, MutexGuard};
use tracing::{info, warn};

use super::protocol::{DaemonStats, PROTOCOL_VERSION, Region, Reply, Request};
use crate::backend_factory::{BackendFactory, TierRequest};

/// The schemes of a daemon tier: `kvpool+unix:///run/kvpool/kvpool.sock`.
pub const SCHEMES: &[&str] = &["kvpool+unix"];

/// How long after a failed connection no new one is tried (calls are misses meanwhile).
pub const RECONNECT_INTERVAL: Duration = Duration::from_secs(1);

/// Sessions one connector keeps open, so a long write-behind does not hold up a load (each
/// call runs on one session; copies of different calls run on different threads).
pub const SESSIONS_PER_CONNECTOR: usize = 4;

/// One attached session: the socket and the daemon's arena as this process maps it.
struct Session {
    stream: UnixStream,
    arena: Arc<SharedMapping>,
    daemon_id: u64,
    /// How long the daemon keeps what it lends this session.
    lease_ttl: Duration,
    /// Pins lent out of this session ([`Inner::pin`]) whose holders let go, to release on
    /// the session's next call (the daemon reclaims them anyway when the session ends).
    unreleased: Arc<Mutex<Vec<u64>>>,
}

impl Session {
    /// Attaches; maps the arena unless `known` is this daemon's (one mapping per process and
    /// daemon, however many sessions).
    fn attach(
        path: &Path,
        timeout: Duration,
        known: Option<(u64, Arc<SharedMapping>)>,
    ) -> io::Result<Self> {
        let mut stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let client = format!("pid {}", std::process::id());
        write_frame(
            &mut stream,
            &Request::Attach {
                version: PROTOCOL_VERSION,
                client,
            },
        )?;
        let (arena_len, daemon_id, lease_ttl) = match read_frame::<Reply>(&mut stream)? {
            Reply::Attached {
                arena_len,
                daemon_id,
                lease_ttl_ms,
            } => (arena_len, daemon_id, Duration::from_millis(lease_ttl_ms)),
            Reply::Error(why) => return Err(io::Error::other(format!("refused: {why}"))),
            other => return Err(protocol_error(&other)),
        };
        let fd = recv_fd(&stream)?;
        let arena = match known {
            Some((id, arena)) if id == daemon_id && arena.len() as u64 == arena_len => arena,
            _ => {
                let arena = Arc::new(SharedMapping::map(fd, arena_len as usize)?);
                // The daemon allocated every page at start; this fills page tables only.
                arena.map_all_pages_behind();
                arena
            }
        };
        Ok(Session {
            stream,
            arena,
            daemon_id,
            lease_ttl,
            unreleased: Arc::default(),
        })
    }

    /// Releases the pins lent out of this session that their holders let go of.
    fn release_let_go(&mut self) -> io::Result<()> {
        let ids = std::mem::take(&mut *self.unreleased.lock());
        if ids.is_empty() {
            return Ok(());
        }
        self.call(&Request::Release { ids }).map(drop)
    }

    fn call(&mut self, request: &Request) -> io::Result<Reply> {
        write_frame(&mut self.stream, request)?;
        match read_frame::<Reply>(&mut self.stream)? {
            Reply::Error(why) => Err(io::Error::other(format!("the daemon refused: {why}"))),
            reply => Ok(reply),
        }
    }

    /// Fails when the daemon may already have reclaimed what it lent at `answered` (this
    /// process stalled for half the lease's time to live): the caller then touches nothing.
    fn still_leased(&self, answered: Instant) -> io::Result<()> {
        if answered.elapsed() > self.lease_ttl / 2 {
            return Err(io::Error::other(
                "stalled for half a lease's time to live; not touching the arena",
            ));
        }
        Ok(())
    }

    /// The arena bytes of `region`, checked to lie inside the mapping.
    fn bytes_of(&self, region: &Region) -> io::Result<*mut u8> {
        let end = region.offset.checked_add(region.len);
        if end.is_none_or(|e| e > self.arena.len() as u64) {
            return Err(io::Error::other(format!(
                "the daemon named bytes {}+{} outside its {}-byte arena",
                region.offset,
                region.len,
                self.arena.len()
            )));
        }
        // SAFETY: offset + len lies inside the mapping, as checked.
        Ok(unsafe { self.arena.as_ptr().as_ptr().add(region.offset as usize) })
    }
}

/// Receives the one descriptor the daemon passes with a one-byte message, close-on-exec from
/// the start (`MSG_CMSG_CLOEXEC`): a child the engine starts never inherits the arena, which
/// would otherwise keep a dead daemon's memory alive.
fn recv_fd(stream: &UnixStream) -> io::Result<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: byte.len(),
    };
    // Room for one descriptor's control message, aligned as cmsghdr requires.
    let mut control = [0u64; 8];
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    assert!(space <= std::mem::size_of_val(&control));
    // SAFETY: zeroed msghdr is a valid empty header; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at live buffers of the stated sizes for the duration of the call.
    let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::other(
            "the daemon's control message was truncated",
        ));
    }
    // SAFETY: `msg` was filled by recvmsg; CMSG_FIRSTHDR reads within msg_control.
    let cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    // SAFETY: a non-null cmsg points into `control`, which recvmsg filled.
    let passed = !cmsg.is_null()
        && unsafe {
            (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS
        };
    if !passed {
        return Err(io::Error::other("the daemon sent no arena descriptor"));
    }
    // SAFETY: an SCM_RIGHTS message's data holds at least one descriptor.
    let raw = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>()) };
    if raw < 0 {
        return Err(io::Error::other("the daemon sent an invalid descriptor"));
    }
    // SAFETY: recvmsg just installed this descriptor in our table; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

fn protocol_error(reply: &Reply) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("unexpected reply from the daemon: {reply:?}"),
    )
}

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
    /// A session slot: the first free one (calls one at a time use only the first), else
    /// the next in turn, waited for at most the tier's timeout.
    fn slot(&self) -> Result<MutexGuard<'_, Option<Session>>, BackendError> {
        if let Some(free) = self.sessions.iter().find_map(|slot| slot.try_lock()) {
            return Ok(free);
        }
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        self.sessions[turn % self.sessions.len()]
            .try_lock_for(self.timeout)
            .ok_or_else(|| self.unavailable("every session stayed busy past the timeout".into()))
    }

    /// Runs `f` on a session, attaching first when the slot has none (at most once per
    /// [`RECONNECT_INTERVAL`] after a failure). Any error ends the session: the daemon then
    /// reclaims whatever it lent to it.
    fn with_session<T>(
        &self,
        f: impl FnOnce(&mut Session) -> io::Result<T>,
    ) -> Result<T, BackendError> {
        let mut guard = self.slot()?;
        if guard.is_none() {
            if let Some(t) = *self.last_failure.lock()
                && t.elapsed() < RECONNECT_INTERVAL
            {
                return Err(self.unavailable("not attached (retrying shortly)".into()));
            }
            let known = self.arena.lock().clone();
            match Session::attach(&self.path, self.timeout, known) {
                Ok(s) => {
                    *self.arena.lock() = Some((s.daemon_id, s.arena.clone()));
                    info!(socket = %self.path.display(), daemon = s.daemon_id, arena_bytes = s.arena.len(), "attached to the kvpool daemon");
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
        let session = guard.as_mut().expect("attached above");
        match session.release_let_go().and_then(|()| f(session)) {
            Ok(v) => Ok(v),
            Err(e) => {
                warn!(socket = %self.path.display(), "daemon session ended: {e}");
                *guard = None;
                *self.last_failure.lock() = Some(Instant::now());
                Err(self.unavailable(e.to_string()))
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

    /// Pins the values of `keys` that shared memory holds and lends each where it lies, until
    /// its [`PinnedBytes`] is dropped (then released on the session's next call), and no
    /// longer than half the daemon's lease time to live from its answer.
    fn pin(&self, keys: Vec<String>) -> Result<Vec<Option<PinnedBytes>>, BackendError> {
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
                let pin = LentPin {
                    id: r.id,
                    unreleased: s.unreleased.clone(),
                    _arena: s.arena.clone(),
                };
                // SAFETY: the region lies in the mapping, which `pin` keeps mapped.
                out.push(Some(unsafe {
                    PinnedBytes::new(ptr, r.len as usize, usable_until, Box::new(pin))
                }));
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

/// One pin a session lent out: keeps the arena mapped, and queues the pin's release on the
/// session that holds it when dropped.
struct LentPin {
    id: u64,
    unreleased: Arc<Mutex<Vec<u64>>>,
    _arena: Arc<SharedMapping>,
}

impl Drop for LentPin {
    fn drop(&mut self) {
        self.unreleased.lock().push(self.id);
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

impl DaemonConnector {
    /// A connector for the daemon at `path`; nothing is connected until the first call.
    pub fn new(path: impl Into<PathBuf>, timeout: Duration) -> Self {
        let path = path.into();
        DaemonConnector {
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
        }
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

    /// A read copies a value out of the daemon's shared arena.
    fn reads_node_memory(&self) -> bool {
        true
    }

    /// Values are lent where they lie in the shared arena, pinned.
    fn lends_node_memory(&self) -> bool {
        true
    }

    async fn batch_pin(&self, keys: &[String]) -> Result<Vec<Option<PinnedBytes>>, BackendError> {
        let keys = keys.to_vec();
        self.blocking(move |inner| inner.pin(keys)).await
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

    /// Hands each value to `copy_out` where it lies in the arena, pinned: one copy, from the
    /// arena into the reader's buffer (L1's pool).
    async fn batch_copy_out(
        &self,
        keys: &[String],
        resident_only: bool,
        copy_out: CopyOut,
    ) -> Result<(), BackendError> {
        let keys = keys.to_vec();
        self.blocking(move |inner| {
            inner
                .read(keys, resident_only, |i, bytes| copy_out(i, bytes))
                .map(drop)
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

    /// Encodes each value once, from the caller's memory (L1's pool) into the arena.
    async fn batch_copy_in(
        &self,
        entries: Vec<(String, usize)>,
        copy_in: CopyIn,
    ) -> Result<(), BackendError> {
        self.blocking(move |inner| inner.write(entries, |i, dst| copy_in(i, dst)))
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
