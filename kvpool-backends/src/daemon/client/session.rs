//! One attached session with the pool daemon: its socket, the daemon's arena as this process
//! maps it (received over the socket at attach), and the loans it has to release.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool_core::frame::{read_frame, write_frame};
use kvpool_core::memory::SharedMapping;
use parking_lot::Mutex;

use crate::daemon::protocol::{PROTOCOL_VERSION, Region, Reply, Request};
use crate::telemetry;

/// One attached session: the socket and the daemon's arena as this process maps it.
pub(super) struct Session {
    /// The socket, shared with every loan made on it: the daemon reclaims what a session
    /// lent only once its socket closes, so the socket stays open, even after the session
    /// ends on an error, until no loan of it is left that a copy may still write or read.
    pub(super) stream: Arc<UnixStream>,
    pub(super) arena: Arc<SharedMapping>,
    pub(super) daemon_id: u64,
    /// How long the daemon keeps what it lends this session.
    pub(super) lease_ttl: Duration,
    /// The connector's session slot it occupies.
    pub(super) slot: usize,
    /// Pins and allocations lent out of this session (`super::loans`) whose holders let go,
    /// to release on the session's next call (the daemon reclaims them anyway when the
    /// session ends).
    pub(super) unreleased: Arc<Mutex<Vec<u64>>>,
}

impl Session {
    /// Attaches; maps the arena unless `known` is this daemon's (one mapping per process and
    /// daemon, however many sessions). A new mapping is not yet mapped ahead: the caller keeps
    /// one mapping per daemon and maps that one ahead.
    pub(super) fn attach(
        path: &Path,
        timeout: Duration,
        known: Option<(u64, Arc<SharedMapping>)>,
        slot: usize,
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
            _ => Arc::new(SharedMapping::map(fd, arena_len as usize)?),
        };
        Ok(Session {
            stream: Arc::new(stream),
            arena,
            daemon_id,
            lease_ttl,
            slot,
            unreleased: Arc::default(),
        })
    }

    /// Whether the daemon closed its end of this idle session (it exited or was killed):
    /// looks at the socket without reading from it or waiting. The protocol is request and
    /// reply, so an idle session's socket holds nothing to read but the end of the stream.
    pub(super) fn daemon_went_away(&self) -> bool {
        let mut byte = 0u8;
        // SAFETY: peeks at most one byte into `byte` (left in the socket), without blocking.
        let n = unsafe {
            libc::recv(
                self.stream.as_raw_fd(),
                (&raw mut byte).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => true,
            n if n > 0 => false,
            _ => !matches!(
                io::Error::last_os_error().kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ),
        }
    }

    /// Releases the pins lent out of this session that their holders let go of.
    pub(super) fn release_let_go(&mut self) -> io::Result<()> {
        let ids = std::mem::take(&mut *self.unreleased.lock());
        if ids.is_empty() {
            return Ok(());
        }
        self.call(&Request::Release { ids }).map(drop)
    }

    /// Sends `request` and waits for its reply, timed from the first byte sent to the reply
    /// read (`kvpool_daemon_client_call_seconds`, by kind): what this engine waited for, the
    /// daemon's answer (`kvpool_daemon_request_seconds`) plus the socket and the time the
    /// daemon's thread waited for a CPU. A call the daemon refuses is timed; one that fails on
    /// the socket is not.
    pub(super) fn call(&mut self, request: &Request) -> io::Result<Reply> {
        let started = Instant::now();
        let mut stream: &UnixStream = &self.stream;
        write_frame(&mut stream, request)?;
        let reply = read_frame::<Reply>(&mut stream)?;
        metrics::histogram!(telemetry::DAEMON_CLIENT_CALL_SECONDS, "kind" => request.kind())
            .record(started.elapsed());
        match reply {
            Reply::Error(why) => Err(io::Error::other(format!("the daemon refused: {why}"))),
            reply => Ok(reply),
        }
    }

    /// Fails when the daemon may already have reclaimed what it lent at `answered` (this
    /// process stalled for half the lease's time to live): the caller then touches nothing.
    pub(super) fn still_leased(&self, answered: Instant) -> io::Result<()> {
        if answered.elapsed() > self.lease_ttl / 2 {
            return Err(io::Error::other(
                "stalled for half a lease's time to live; not touching the arena",
            ));
        }
        Ok(())
    }

    /// The arena bytes of `region`, checked to lie inside the mapping.
    pub(super) fn bytes_of(&self, region: &Region) -> io::Result<*mut u8> {
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

pub(super) fn protocol_error(reply: &Reply) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("unexpected reply from the daemon: {reply:?}"),
    )
}
