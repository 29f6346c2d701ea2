//! Pool lookups across processes: the protocol; a Unix-socket server next to the worker's pool
//! (`server.rs`), and a [`PoolLookup`](crate::vllm::scheduler::PoolLookup) client for the
//! scheduler process (`client.rs`, one socket per tensor-parallel rank).
//!
//! vLLM runs the scheduler half of a connector in the EngineCore process and the worker half
//! in each Worker process. The pool (L1 and the lower tiers) lives in the worker, so the
//! scheduler asks every worker rank over its socket how much of a prompt it can load and takes
//! the minimum: every rank must be able to load a chunk for the engine to skip it. Lookups
//! carry the chunk hashes the scheduler computed (16 bytes per chunk), never token ids.
//!
//! Wire format: frames of a little-endian `u32` length followed by a postcard-encoded
//! [`LookupRequest`] or [`LookupResponse`]. Every rank is asked at once and the whole lookup
//! is bounded by one deadline: a rank that does not answer in time counts as a miss. A rank
//! that fails [`BREAKER_FAILURES`] lookups in a row has its circuit breaker opened: lookups
//! count it as a miss without asking, until a probe (a fresh connection and the hello check,
//! at most once per [`BREAKER_PROBE_INTERVAL`]) succeeds. Every reconnection re-runs the hello
//! check, so a worker restarted with other keys is never asked.
//!
//! A scheduler in the same process as its workers (vLLM's EngineCore with its one in-process
//! worker, `tensor_parallel_size` 1) may ask them without the socket
//! ([`SocketLookup::answer_in_process`]): the same answer, computed on the asking thread, with
//! no handoff to the server's threads (on a CPU host whose cores the engine's compute threads
//! keep busy, each handoff can wait milliseconds for a core; a tier that reads on a blocking
//! pool, such as the disk tier, still hands its read over). Its deadline is a timer on the
//! pool's runtime: it ends the lookup at its next await point, where the socket route's
//! scheduler stopped waiting at once.

use std::io;
use std::time::Duration;

use serde::{Deserialize, Serialize};

mod client;
mod server;

pub use client::SocketLookup;
pub use server::LookupServer;

/// Consecutive failed lookups that open a rank's circuit breaker.
pub const BREAKER_FAILURES: u32 = 3;
/// How often an open breaker lets a probe through.
pub const BREAKER_PROBE_INTERVAL: Duration = Duration::from_secs(5);

/// What the scheduler asks a worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LookupRequest {
    /// Who are you: the worker's key derivation and chunking.
    Hello,
    /// How many leading chunks of these (scheduler-computed chain hashes) the pool holds;
    /// the ones in memory are leased to the request until it loads them or ends.
    Lookup {
        /// The request (empty: no lease).
        req_id: String,
        /// Chunk hashes, in order.
        chunk_hashes: Vec<[u8; 16]>,
        /// Load and lease a hit the pool daemon completes (see
        /// [`crate::vllm::leases::lookup_and_lease`]).
        load_node_memory: bool,
    },
    /// Which of these chunk hashes the pool holds, each on its own (a hybrid model's
    /// recurrent states); nothing is leased.
    Presence {
        /// Chunk hashes, in any order.
        chunk_hashes: Vec<[u8; 16]>,
    },
}

/// A worker's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LookupResponse {
    /// Answer to [`LookupRequest::Hello`].
    Hello(WorkerInfo),
    /// Leading chunks the pool holds, and how many of them are leased in memory.
    Chunks {
        /// Leading chunks some tier holds.
        found: u64,
        /// Leading chunks leased in memory to the request.
        leased: u64,
    },
    /// Answer to [`LookupRequest::Presence`]: one flag per hash asked, in order.
    Present(Vec<bool>),
    /// The lookup failed (reported as a miss by the client).
    Error(String),
}

/// What a worker tells the scheduler when it connects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// The worker's probe hash (see [`crate::probe_hash`]).
    pub probe_hash: [u8; 16],
    /// Tokens per chunk.
    pub chunk_size: u32,
    /// The chain hash function.
    pub hash_algorithm: kvpool_core::HashAlgorithm,
    /// The worker's tensor-parallel rank.
    pub rank: u32,
}

/// An `InvalidData` error with `msg`.
fn io_err(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}
