//! The daemon's Unix socket: who may attach, the attach handshake (the arena's descriptor
//! passed with `SCM_RIGHTS`), one thread per attached engine, and shutdown.

use std::collections::HashMap;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvpool_core::frame::write_frame;
use parking_lot::Mutex;
use sendfd::SendWithFd;
use tracing::{debug, info, warn};

use super::pool::{
    ATTACH_TIMEOUT, MAX_ITEMS_PER_REQUEST, MAX_REQUEST_BYTES, MAX_REQUEST_BYTES_IN_FLIGHT,
    PoolDaemon, RequestBudget,
};
use super::protocol::{PRECHECK_BYTES, PROTOCOL_VERSION, Precheck, Reply, Request};
use super::store::SessionId;

/// The most engines attached at once (one thread each); a connection past it is refused.
pub const MAX_SESSIONS: usize = 1024;

/// The most sessions one process (the peer's pid, from `SO_PEERCRED`) holds at once: an engine
/// opens up to four, a tensor-parallel rank is a process of its own; one process cannot take
/// every session of [`MAX_SESSIONS`] from the others.
pub const MAX_SESSIONS_PER_PROCESS: usize = 64;

/// How long a request's body may take to arrive once its length did (an attached engine may
/// be idle between requests as long as it likes, but not stall half-way through one).
pub const FRAME_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// Who may attach: the socket's owner only (mode 0600), or also a group (mode 0660).
#[derive(Debug, Clone, Copy, Default)]
pub struct SocketAccess {
    /// The group allowed to attach, if any.
    pub group: Option<u32>,
}

impl SocketAccess {
    /// Access for the group named `name` (or a numeric id).
    pub fn group(name: &str) -> io::Result<Self> {
        if let Ok(gid) = name.parse() {
            return Ok(SocketAccess { group: Some(gid) });
        }
        let c = std::ffi::CString::new(name)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in the group"))?;
        // SAFETY: `c` is a valid C string; getgrnam's result is read before any other call.
        let entry = unsafe { libc::getgrnam(c.as_ptr()) };
        if entry.is_null() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no group named `{name}`"),
            ));
        }
        // SAFETY: non-null, as checked; getgrnam's entry is valid until the next call.
        let gid = unsafe { (*entry).gr_gid };
        Ok(SocketAccess { group: Some(gid) })
    }
}

/// The daemon's Unix socket and its threads; stops on [`DaemonServer::shutdown`] or drop.
pub struct DaemonServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    /// Written to and closed to wake the accept thread, which sleeps in `poll` until an
    /// engine connects or this end speaks (an idle daemon never wakes on a timer).
    wake_accept: Option<UnixStream>,
    accept_thread: Option<JoinHandle<()>>,
    connections: Arc<Mutex<Connections>>,
}

/// The attached engines: a clone of each socket (to disconnect it at shutdown) and its
/// thread (to wait for it).
/// Each session's socket (to shut it down), its thread, and its peer's pid.
type Connections = HashMap<SessionId, (UnixStream, Option<JoinHandle<()>>, Option<libc::pid_t>)>;

/// Ends a session however its thread ends (returning, panicking, or never starting): the
/// daemon reclaims its leases and forgets its socket.
struct SessionGuard {
    daemon: Arc<PoolDaemon>,
    connections: Arc<Mutex<Connections>>,
    session: SessionId,
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        self.daemon.end_session(self.session);
        // The thread's own handle is dropped with the entry (it is this thread).
        self.connections.lock().remove(&self.session);
    }
}

impl DaemonServer {
    /// Listens on `path` (replacing a stale socket nobody answers on; refusing one a live
    /// daemon serves), with the permissions `access` says, and serves `daemon`.
    pub fn bind(daemon: Arc<PoolDaemon>, path: &Path, access: SocketAccess) -> io::Result<Self> {
        if path.exists() {
            use std::os::unix::fs::FileTypeExt;
            // Only a socket may be replaced: a file an operator mistyped the path onto stays.
            if !std::fs::symlink_metadata(path)?.file_type().is_socket() {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!(
                        "{} exists and is not a socket; not replacing it",
                        path.display()
                    ),
                ));
            }
            match UnixStream::connect(path) {
                // Nobody listens: a socket left by a daemon that died.
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    std::fs::remove_file(path)?;
                }
                Ok(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::AddrInUse,
                        format!("a daemon already serves {}", path.display()),
                    ));
                }
                Err(e) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!(
                            "{} exists and cannot be probed ({e}); not replacing it",
                            path.display()
                        ),
                    ));
                }
            }
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        // Created owner-only, so no other user can connect between bind and chmod.
        // SAFETY: umask only changes this process's file-creation mask; restored at once.
        let old_mask = unsafe { libc::umask(0o177) };
        let bound = UnixListener::bind(path);
        // SAFETY: as above.
        unsafe { libc::umask(old_mask) };
        let listener = bound?;
        if let Some(gid) = access.group {
            std::os::unix::fs::chown(path, None, Some(gid))?;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
        }
        listener.set_nonblocking(true)?;
        info!(socket = %path.display(), arena_bytes = daemon.store.arena().len(), "kvpool daemon listening");
        let stop = Arc::new(AtomicBool::new(false));
        let connections: Arc<Mutex<Connections>> = Arc::default();
        let (woken, wake_accept) = UnixStream::pair()?;
        let accept_thread = {
            let (stop, connections) = (stop.clone(), connections.clone());
            std::thread::Builder::new()
                .name("kvpool-daemon-accept".into())
                .spawn(move || accept_loop(listener, woken, daemon, stop, connections))?
        };
        Ok(DaemonServer {
            path: path.to_path_buf(),
            stop,
            wake_accept: Some(wake_accept),
            accept_thread: Some(accept_thread),
            connections,
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops accepting, disconnects every engine (their leases end) and removes the socket.
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        self.stop.store(true, Ordering::Release);
        // A byte, then the end of the stream, for the accept thread to wake on and see
        // `stop` (the byte even if a forked child still holds this end open).
        if let Some(mut wake) = self.wake_accept.take() {
            let _ = io::Write::write_all(&mut wake, &[1]);
        }
        if let Some(t) = self.accept_thread.take() {
            let _ = t.join();
        }
        // Disconnect every engine, then wait for their threads: a request being answered
        // finishes (its tier calls are bounded by their timeouts) before the tiers close.
        let threads: Vec<JoinHandle<()>> = {
            let mut conns = self.connections.lock();
            for (conn, _, _) in conns.values() {
                let _ = conn.shutdown(std::net::Shutdown::Both);
            }
            conns
                .values_mut()
                .filter_map(|(_, t, _)| t.take())
                .collect()
        };
        for t in threads {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for DaemonServer {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// Sleeps until `listener` has an engine to accept or `woken` is readable (the server's end
/// of it written to at shutdown); `false` when only `woken` is.
fn wait_for_connection(listener: &UnixListener, woken: &UnixStream) -> bool {
    let mut fds = [
        libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: woken.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: `fds` holds two initialised pollfds on descriptors this function borrows, and
    // its length is passed with it.
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
    // On EINTR (or any failure) the caller tries a non-blocking accept and comes back.
    ready < 0 || fds[0].revents != 0
}

fn accept_loop(
    listener: UnixListener,
    woken: UnixStream,
    daemon: Arc<PoolDaemon>,
    stop: Arc<AtomicBool>,
    connections: Arc<Mutex<Connections>>,
) {
    while !stop.load(Ordering::Acquire) {
        if !wait_for_connection(&listener, &woken) {
            continue; // woken for shutdown: `stop` is set
        }
        match listener.accept() {
            Ok((mut stream, _)) => {
                let _ = stream.set_nonblocking(false);
                let pid = peer_pid(&stream);
                let full = {
                    let conns = connections.lock();
                    let of_peer = pid.map_or(0, |p| {
                        conns.values().filter(|(_, _, q)| *q == Some(p)).count()
                    });
                    if conns.len() >= MAX_SESSIONS {
                        Some(format!("{MAX_SESSIONS} engines attached already"))
                    } else if of_peer >= MAX_SESSIONS_PER_PROCESS {
                        Some(format!(
                            "process {} holds {of_peer} sessions already (at most {MAX_SESSIONS_PER_PROCESS} per process)",
                            pid.unwrap_or_default()
                        ))
                    } else {
                        None
                    }
                };
                if let Some(why) = full {
                    warn!("refusing a connection: {why}");
                    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
                    let _ = write_frame(&mut stream, &daemon.refuse(&why));
                    continue;
                }
                let session = daemon.new_session();
                let guard = SessionGuard {
                    daemon: daemon.clone(),
                    connections: connections.clone(),
                    session,
                };
                let Ok(clone) = stream.try_clone() else {
                    warn!("could not clone a session's socket; refusing it");
                    continue; // the guard ends the session
                };
                // Registered before the thread starts, so the guard's removal comes after.
                connections.lock().insert(session, (clone, None, pid));
                let daemon = daemon.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("kvpool-daemon-session-{session}"))
                    .spawn(move || {
                        let _guard = guard;
                        serve_session(&daemon, stream, session);
                    });
                match spawned {
                    Ok(handle) => {
                        if let Some(entry) = connections.lock().get_mut(&session) {
                            entry.1 = Some(handle);
                        }
                    }
                    // The closure, and the guard in it, were dropped: the session ended.
                    Err(e) => warn!("could not start a session thread: {e}"),
                }
            }
            // Another wake-up with no engine waiting (the connection went away meanwhile).
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => {
                warn!("accept failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// The pid of the process at the other end of `stream` (`SO_PEERCRED`), if the kernel says.
fn peer_pid(stream: &UnixStream) -> Option<libc::pid_t> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the descriptor is a live Unix socket this function borrows; `cred` and `len`
    // are valid for writes of `len` bytes, the size of `ucred` the kernel fills.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &raw mut len,
        )
    };
    (rc == 0 && cred.pid > 0).then_some(cred.pid)
}

/// Serves one engine until it disconnects or sends something that is not a request.
fn serve_session(daemon: &PoolDaemon, mut stream: UnixStream, session: SessionId) {
    // A connection that never attaches does not hold its thread for ever.
    if let Err(e) = stream.set_read_timeout(Some(ATTACH_TIMEOUT)) {
        warn!(session, "cannot bound the attach: {e}");
        return;
    }
    match read_request(daemon, &mut stream, false) {
        Ok(Err(why)) => {
            let _ = write_frame(&mut stream, &daemon.refuse(&why));
            return;
        }
        Ok(Ok((Request::Attach { version, client }, _))) if version == PROTOCOL_VERSION => {
            let arena = daemon.store.arena();
            let reply = Reply::Attached {
                arena_len: arena.len() as u64,
                daemon_id: daemon.daemon_id,
                lease_ttl_ms: daemon.store.lease_ttl().as_millis() as u64,
            };
            let sent = write_frame(&mut stream, &reply).and_then(|()| {
                stream
                    .send_with_fd(&[0], &[arena.fd().as_raw_fd()])
                    .map(drop)
            });
            if let Err(e) = sent {
                warn!(session, "attach failed: {e}");
                return;
            }
            info!(session, client = ?client, "engine attached");
            // Attached engines may be idle for as long as they like.
            if let Err(e) = stream.set_read_timeout(None) {
                warn!(session, "{e}");
                return;
            }
        }
        Ok(Ok((Request::Attach { version, .. }, _))) => {
            let why = format!(
                "protocol version {version} is not the daemon's {PROTOCOL_VERSION}: upgrade the engine's kvpool or the daemon"
            );
            let _ = write_frame(&mut stream, &daemon.refuse(&why));
            return;
        }
        Ok(Ok(_)) => {
            let _ = write_frame(&mut stream, &daemon.refuse("attach first"));
            return;
        }
        // A connection closed without a word (a readiness probe) is not a refusal.
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return,
        Err(e) => {
            daemon.refused.fetch_add(1, Ordering::Relaxed);
            debug!(session, "no attach: {e}");
            return;
        }
    }
    loop {
        // The request's budget is held until its reply is written.
        let (request, _budget) = match read_request(daemon, &mut stream, true) {
            Ok(Ok(r)) => r,
            Ok(Err(why)) => {
                if let Err(e) = write_frame(&mut stream, &daemon.refuse(&why)) {
                    debug!(session, "engine gone: {e}");
                    break;
                }
                continue;
            }
            // A closed socket, or one reset because its engine died with a reply unread
            // (every `kill -9` mid-call): the engine left; the caller reclaims its leases.
            Err(e) if engine_left(&e) => {
                debug!(session, "engine gone: {e}");
                break;
            }
            Err(e) => {
                daemon.refused.fetch_add(1, Ordering::Relaxed);
                warn!(session, "closing a session that sent a bad frame: {e}");
                break;
            }
        };
        let reply = daemon.handle(session, request);
        if let Err(e) = write_frame(&mut stream, &reply) {
            debug!(session, "engine gone: {e}");
            break;
        }
    }
}

/// What decoding one item may allocate beyond its bytes on the wire (a `String`'s slot).
const DECODED_BYTES_PER_ITEM: usize = 32;

/// The largest frame a connection may send before it attached (an `Attach` is small).
const MAX_ATTACH_BYTES: usize = 4 << 10;

/// A request as read, and its share of the requests-in-flight budget, held until its reply is
/// written.
type Received<'a> = (Request, Option<RequestBudget<'a>>);

/// Reads one request. Before attaching (`attached` false) the whole frame must arrive within
/// [`ATTACH_TIMEOUT`] and hold at most 4 KiB; once attached, an engine may be idle before a
/// frame as long as it likes, and the frame's body must then arrive within
/// [`FRAME_BODY_TIMEOUT`] (a deadline, not a per-read timeout). A frame above
/// [`MAX_REQUEST_BYTES`] is an error (the session closes) before anything else is read; its
/// first bytes are checked ([`Request::precheck`]) before the rest is stored: one carrying
/// more than [`MAX_ITEMS_PER_REQUEST`] items, or arriving while the daemon holds
/// [`MAX_REQUEST_BYTES_IN_FLIGHT`] of requests, is read to its end without being stored and
/// answered `Ok(Err(why))` (the session is refused that request and goes on).
fn read_request<'a>(
    daemon: &'a PoolDaemon,
    stream: &mut UnixStream,
    attached: bool,
) -> io::Result<Result<Received<'a>, String>> {
    let invalid = |msg: String| io::Error::new(io::ErrorKind::InvalidData, msg);
    let attach_by = (!attached).then(|| Instant::now() + ATTACH_TIMEOUT);
    let mut len = [0u8; 4];
    match attach_by {
        Some(deadline) => read_exact_by(stream, &mut len, deadline)?,
        None => {
            stream.set_read_timeout(None)?;
            stream.read_exact(&mut len)?;
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    let max = if attached {
        MAX_REQUEST_BYTES
    } else {
        MAX_ATTACH_BYTES
    };
    if len > max {
        return Err(invalid(format!("a frame of {len} bytes is too large")));
    }
    let deadline = attach_by.unwrap_or_else(|| Instant::now() + FRAME_BODY_TIMEOUT);
    read_body(daemon, stream, len, deadline).map_err(|e| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => invalid(format!(
            "a request did not arrive in time ({:?} for an attach, {FRAME_BODY_TIMEOUT:?} for a body)",
            ATTACH_TIMEOUT
        )),
        _ => e,
    })
}

/// `read_exact` that fails once `deadline` passes, however the bytes trickle in.
fn read_exact_by(stream: &mut UnixStream, mut buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(buf) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn read_body<'a>(
    daemon: &'a PoolDaemon,
    stream: &mut UnixStream,
    len: usize,
    deadline: Instant,
) -> io::Result<Result<Received<'a>, String>> {
    let invalid = |msg: String| io::Error::new(io::ErrorKind::InvalidData, msg);
    let mut head = [0u8; PRECHECK_BYTES];
    let head_len = len.min(PRECHECK_BYTES);
    read_exact_by(stream, &mut head[..head_len], deadline)?;
    let refuse = |stream: &mut UnixStream, why: String| {
        drain(stream, len - head_len, deadline).map(|()| Err(why))
    };
    match Request::precheck(&head[..head_len], MAX_ITEMS_PER_REQUEST) {
        Ok(()) => {}
        Err(Precheck::TooLarge(why)) => return refuse(stream, why),
        Err(Precheck::Garbled(why)) => return Err(invalid(why)),
    }
    // The frame and what decoding it allocates, and as much again for what answering it
    // copies (deduplicated keys, a tier's keys, the reply).
    let cost = 2 * (len + MAX_ITEMS_PER_REQUEST.min(len) * DECODED_BYTES_PER_ITEM);
    let Some(budget) = daemon.request_budget(cost) else {
        return refuse(
            stream,
            format!("busy: {MAX_REQUEST_BYTES_IN_FLIGHT} bytes of requests in flight"),
        );
    };
    let mut body = vec![0u8; len];
    body[..head_len].copy_from_slice(&head[..head_len]);
    read_exact_by(stream, &mut body[head_len..], deadline)?;
    let request = kvpool_core::frame::decode_body(&body)?;
    Ok(Ok((request, Some(budget))))
}

/// Reads and drops `n` bytes (a refused frame's rest) by `deadline`, through a small buffer.
fn drain(stream: &mut UnixStream, mut n: usize, deadline: Instant) -> io::Result<()> {
    let mut scratch = [0u8; 64 << 10];
    while n > 0 {
        let take = n.min(scratch.len());
        read_exact_by(stream, &mut scratch[..take], deadline)?;
        n -= take;
    }
    Ok(())
}

/// Whether a failed read means the engine closed its end (cleanly or by dying), rather than
/// that it sent something the daemon cannot read.
fn engine_left(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
    )
}
