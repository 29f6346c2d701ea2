//! The pool daemon's wire protocol: one request, one reply, as postcard frames
//! ([`kvpool_core::frame`]) on a Unix socket. KV bytes never travel on the socket: replies
//! name regions of the daemon's shared arena, which the engine maps once, at attach.

use serde::{Deserialize, Serialize};

/// The protocol version an engine and the daemon must share.
/// Version 2 added `GetResident`.
pub const PROTOCOL_VERSION: u32 = 2;

/// A region of the daemon's arena lent to one session: a pinned value to read, or an
/// allocation to write and then commit. `id` names it in `Release` and `Commit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    /// The lease's id, unique within the daemon's lifetime.
    pub id: u64,
    /// Byte offset in the arena.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// What an engine asks the daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// The first request of a session. The reply is followed by the arena's memory file,
    /// passed with `SCM_RIGHTS`.
    Attach {
        /// The engine's [`PROTOCOL_VERSION`].
        version: u32,
        /// Who is attaching (for the daemon's log).
        client: String,
    },
    /// Whether the pool (shared memory or a lower tier) holds each key.
    Exists {
        /// Keys, in the engine's text form.
        keys: Vec<String>,
    },
    /// Pins each key's value for reading (promoting it from a lower tier into shared memory
    /// first when needed). The engine copies the bytes out, then releases the pins.
    Get {
        /// Keys to read.
        keys: Vec<String>,
    },
    /// `Get` of the leading run of keys shared memory holds (a miss ends it: every later key
    /// is `None`), reading no lower tier: what an engine's lookup loads, so that the load never
    /// waits on the daemon's disk or network. Answered with `Pinned`.
    GetResident {
        /// Keys to read.
        keys: Vec<String>,
    },
    /// Allocates one region per length, for the engine to write values into. An allocation
    /// is invisible to every reader until committed.
    PrepareSave {
        /// Value lengths in bytes.
        lens: Vec<u64>,
    },
    /// Publishes written allocations under their keys (replacing older values) and hands
    /// them to the daemon's lower tiers.
    Commit {
        /// (allocation id, key) pairs.
        entries: Vec<(u64, String)>,
    },
    /// Ends pins and uncommitted allocations of this session.
    Release {
        /// Region ids from `Get` or `PrepareSave`.
        ids: Vec<u64>,
    },
    /// Removes keys from shared memory only (an engine found the copy it read from there
    /// bad); the lower tiers keep their copies, which are checked when next read.
    Delete {
        /// Keys to remove.
        keys: Vec<String>,
    },
    /// The daemon's counters.
    Stats,
}

/// The bytes of a frame's start [`Request::precheck`] reads: a variant and a count (two
/// varints of at most 10 bytes each).
pub const PRECHECK_BYTES: usize = 24;

/// The longest `client` string an `Attach` may carry (it is logged).
pub const MAX_CLIENT_NAME: usize = 256;

/// Reads a postcard varint (unsigned LEB128) at the start of `bytes`: the value and the rest.
fn varint(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let mut value = 0u64;
    for (i, &b) in bytes.iter().enumerate().take(10) {
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((value, &bytes[i + 1..]));
        }
    }
    None
}

/// Why [`Request::precheck`] refused a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Precheck {
    /// Not a request at all: the session is closed.
    Garbled(String),
    /// A well-formed request past a limit: refused with this reason, the session goes on.
    TooLarge(String),
}

impl Request {
    /// The request's kind, as the `kind` label of `kvpool_daemon_request_seconds`.
    pub fn kind(&self) -> &'static str {
        match self {
            Request::Attach { .. } => "attach",
            Request::Exists { .. } => "exists",
            Request::Get { .. } => "get",
            Request::GetResident { .. } => "get_resident",
            Request::PrepareSave { .. } => "prepare_save",
            Request::Commit { .. } => "commit",
            Request::Release { .. } => "release",
            Request::Delete { .. } => "delete",
            Request::Stats => "stats",
        }
    }

    /// How many items (keys, lengths, entries, ids) the request carries: what
    /// [`Self::precheck`] bounds before decoding and the daemon checks again after.
    pub fn item_count(&self) -> usize {
        match self {
            Request::Exists { keys }
            | Request::Get { keys }
            | Request::GetResident { keys }
            | Request::Delete { keys } => keys.len(),
            Request::PrepareSave { lens } => lens.len(),
            Request::Commit { entries } => entries.len(),
            Request::Release { ids } => ids.len(),
            Request::Attach { .. } | Request::Stats => 0,
        }
    }

    /// Checks a request frame's body before it is decoded: the number of items it carries
    /// (keys, lengths, entries, ids) is at most `max_items`, and an `Attach`'s client name at
    /// most [`MAX_CLIENT_NAME`] bytes. Decoding allocates per item, so a frame of millions of
    /// empty strings would cost hundreds of MB of heap before a count check after decoding.
    pub fn precheck(body: &[u8], max_items: usize) -> Result<(), Precheck> {
        let garbled = |what: &str| Precheck::Garbled(what.to_string());
        let (variant, rest) = varint(body).ok_or_else(|| garbled("an empty or garbled request"))?;
        match variant {
            // Attach { version, client }
            0 => {
                let (_, rest) = varint(rest).ok_or_else(|| garbled("a garbled attach"))?;
                let (len, _) = varint(rest).ok_or_else(|| garbled("a garbled attach"))?;
                if len > MAX_CLIENT_NAME as u64 {
                    return Err(Precheck::TooLarge(format!(
                        "a client name of {len} bytes (at most {MAX_CLIENT_NAME})"
                    )));
                }
            }
            // Exists, Get, GetResident, PrepareSave, Commit, Release, Delete: a list first.
            1..=7 => {
                let (items, _) = varint(rest).ok_or_else(|| garbled("a garbled request"))?;
                if items > max_items as u64 {
                    return Err(Precheck::TooLarge(format!(
                        "{items} items in one request (at most {max_items})"
                    )));
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// What the daemon answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// Attached; the arena's memory file follows on the socket.
    Attached {
        /// The arena's length in bytes (the engine maps exactly this much).
        arena_len: u64,
        /// A random id of this daemon run (a restarted daemon has another one).
        daemon_id: u64,
        /// How long a pin or an uncommitted allocation lives if the engine forgets it.
        lease_ttl_ms: u64,
    },
    /// One answer per key of `Exists`.
    Exists(Vec<bool>),
    /// One answer per key of `Get` or `GetResident`: the pinned value, or `None` for a miss.
    Pinned(Vec<Option<Region>>),
    /// One answer per length of `PrepareSave`: the allocation, or `None` when no room could
    /// be made.
    Prepared(Vec<Option<Region>>),
    /// How many entries of `Commit` were published (an unknown or expired id is skipped).
    Committed(u64),
    /// How many keys `Delete` removed from shared memory.
    Deleted(u64),
    /// The daemon's counters.
    Stats(DaemonStats),
    /// `Release` done.
    Released,
    /// The request was refused; the session stays open.
    Error(String),
}

/// A snapshot of the daemon's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonStats {
    /// Engines attached now.
    pub sessions: u64,
    /// Values held in shared memory.
    pub entries: u64,
    /// Bytes of the arena in use (values, pins' values, uncommitted allocations).
    pub used_bytes: u64,
    /// The arena's size: the node's memory budget.
    pub capacity_bytes: u64,
    /// Pins held now.
    pub pins: u64,
    /// Uncommitted allocations held now.
    pub allocations: u64,
    /// Gets answered from shared memory.
    pub memory_hits: u64,
    /// Gets answered from a lower tier (and promoted).
    pub tier_hits: u64,
    /// Gets that found nothing.
    pub misses: u64,
    /// Values committed.
    pub commits: u64,
    /// Values evicted from shared memory.
    pub evictions: u64,
    /// Values written to a lower tier, one per tier that accepted it (after their commit, in
    /// the background).
    pub tier_writes: u64,
    /// Pins and allocations dropped because their session ended or their time ran out.
    pub leases_reclaimed: u64,
    /// Requests refused (bad frames close the session and count here too; an engine that
    /// closes or resets its socket does not).
    pub refused: u64,
}
