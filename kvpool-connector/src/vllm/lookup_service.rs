//! Pool lookups across processes: a Unix-socket server next to the worker's pool, and a
//! [`PoolLookup`] client for the scheduler process (one socket per tensor-parallel rank).
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

use std::io;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvpool_core::CacheEngine;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::runtime::Runtime;
use tracing::{debug, info, warn};

use crate::vllm::leases::{LeaseTable, LookupAnswer, lookup_and_lease};
use crate::vllm::scheduler::PoolLookup;

/// Consecutive failed lookups that open a rank's circuit breaker.
pub const BREAKER_FAILURES: u32 = 3;
/// How often an open breaker lets a probe through.
pub const BREAKER_PROBE_INTERVAL: Duration = Duration::from_secs(5);

pub use kvpool_core::frame::{MAX_FRAME_BYTES, read_frame, write_frame};

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

fn io_err(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Answers lookups against a worker's pool on a Unix socket, on its own threads, until dropped.
pub struct LookupServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    accept_thread: Option<JoinHandle<()>>,
}

impl LookupServer {
    /// Binds `path` (replacing a stale socket file) and serves lookups for `engine`, whose
    /// async calls run on `runtime`, leasing into `leases`. Each connection gets a thread;
    /// reads time out after `idle_timeout` so abandoned connections do not pin threads for
    /// ever.
    pub fn start(
        path: &Path,
        engine: Arc<CacheEngine>,
        runtime: Arc<Runtime>,
        leases: Arc<LeaseTable>,
        rank: u32,
        idle_timeout: Duration,
    ) -> io::Result<Self> {
        if path.exists() {
            std::fs::remove_file(path)?;
        }
        let listener = UnixListener::bind(path)?;
        let info = WorkerInfo {
            probe_hash: crate::probe_hash(&engine),
            chunk_size: engine.token_database().chunk_size() as u32,
            hash_algorithm: engine.token_database().config().hash_algorithm,
            rank,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let stop_accept = stop.clone();
        let accept_thread = std::thread::Builder::new()
            .name("kvpool-lookup".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop_accept.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(stream) = conn else { continue };
                    let (engine, runtime, leases) =
                        (engine.clone(), runtime.clone(), leases.clone());
                    let spawned = std::thread::Builder::new()
                        .name("kvpool-lookup-conn".into())
                        .spawn(move || {
                            serve(stream, &engine, &runtime, &leases, info, idle_timeout)
                        });
                    if let Err(e) = spawned {
                        warn!(error = %e, "cannot start a lookup connection thread");
                    }
                }
            })?;
        info!(path = %path.display(), rank, "kvpool lookup server listening");
        Ok(LookupServer {
            path: path.to_path_buf(),
            stop,
            accept_thread: Some(accept_thread),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for LookupServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so it sees the flag.
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.accept_thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve(
    mut stream: UnixStream,
    engine: &CacheEngine,
    runtime: &Runtime,
    leases: &LeaseTable,
    info: WorkerInfo,
    idle_timeout: Duration,
) {
    let _ = stream.set_read_timeout(Some(idle_timeout));
    let _ = stream.set_write_timeout(Some(idle_timeout));
    loop {
        let request: LookupRequest = match read_frame(&mut stream) {
            Ok(r) => r,
            Err(e) => {
                if e.kind() != io::ErrorKind::UnexpectedEof {
                    debug!(error = %e, "lookup connection closed");
                }
                return;
            }
        };
        let response = match request {
            LookupRequest::Hello => LookupResponse::Hello(info),
            LookupRequest::Lookup {
                req_id,
                chunk_hashes,
                load_node_memory,
            } => {
                let hashes: Vec<kvpool_core::ChunkHash> = chunk_hashes
                    .into_iter()
                    .map(kvpool_core::ChunkHash)
                    .collect();
                let answer = runtime.block_on(lookup_and_lease(
                    engine,
                    leases,
                    &req_id,
                    &hashes,
                    load_node_memory,
                ));
                LookupResponse::Chunks {
                    found: answer.chunks as u64,
                    leased: answer.leased as u64,
                }
            }
            LookupRequest::Presence { chunk_hashes } => {
                let hashes: Vec<kvpool_core::ChunkHash> = chunk_hashes
                    .into_iter()
                    .map(kvpool_core::ChunkHash)
                    .collect();
                LookupResponse::Present(
                    runtime.block_on(crate::vllm::scheduler::chunks_present(engine, &hashes)),
                )
            }
        };
        if write_frame(&mut stream, &response).is_err() {
            return;
        }
    }
}

/// One rank as the scheduler sees it: its connection (locked while a call is on the wire)
/// and its circuit breaker (never locked across I/O).
struct Rank {
    conn: Mutex<RankConnection>,
    breaker: Mutex<Breaker>,
}

#[derive(Debug, Default)]
struct Breaker {
    failures: u32,
    /// When the breaker opened or last let a probe through; `None` while closed.
    open_since: Option<Instant>,
}

impl Breaker {
    /// Whether the breaker lets this lookup through: `Some(probe)` (probe: the breaker is
    /// open and this call tests the rank on a fresh connection), `None` to skip the rank.
    fn admits(&mut self, now: Instant) -> Option<bool> {
        match self.open_since {
            None => Some(false),
            Some(since) if now.duration_since(since) >= BREAKER_PROBE_INTERVAL => {
                // One probe; if it fails the breaker stays open for another interval.
                self.open_since = Some(now);
                Some(true)
            }
            Some(_) => None,
        }
    }

    fn succeeded(&mut self, path: &Path) {
        if self.open_since.take().is_some() {
            info!(path = %path.display(), "worker lookups answer again; circuit breaker closed");
        }
        self.failures = 0;
    }

    fn failed(&mut self, path: &Path, now: Instant) {
        self.failures += 1;
        if self.failures >= BREAKER_FAILURES && self.open_since.is_none() {
            warn!(path = %path.display(), failures = self.failures, "worker lookups keep failing; circuit breaker open (misses until a probe succeeds)");
            self.open_since = Some(now);
        }
    }
}

/// The scheduler's view of the worker ranks' pools, over their lookup sockets.
pub struct SocketLookup {
    ranks: Vec<Arc<Rank>>,
    expected: WorkerInfo,
    timeout: Duration,
    breaker_misses: u64,
}

struct RankConnection {
    path: PathBuf,
    stream: Option<UnixStream>,
}

impl RankConnection {
    fn new(path: PathBuf) -> Self {
        RankConnection { path, stream: None }
    }

    /// Connects if needed; a fresh connection must pass the hello check against `expected`.
    fn connect(
        &mut self,
        deadline: Instant,
        expected: Option<&WorkerInfo>,
    ) -> io::Result<&mut UnixStream> {
        if self.stream.is_none() {
            let s = UnixStream::connect(&self.path)?;
            self.stream = Some(s);
            if let Some(expected) = expected {
                match self.exchange(&LookupRequest::Hello, deadline) {
                    Ok(LookupResponse::Hello(info)) if info.agrees_with(expected) => {}
                    Ok(LookupResponse::Hello(info)) => {
                        self.stream = None;
                        return Err(io_err(format!(
                            "the worker at {} now derives keys differently (rank {}, probe hash or chunk size changed); not asking it",
                            self.path.display(),
                            info.rank
                        )));
                    }
                    Ok(other) => {
                        self.stream = None;
                        return Err(io_err(format!("unexpected hello reply {other:?}")));
                    }
                    Err(e) => {
                        self.stream = None;
                        return Err(e);
                    }
                }
            }
        }
        Ok(self.stream.as_mut().expect("just connected"))
    }

    fn exchange(
        &mut self,
        request: &LookupRequest,
        deadline: Instant,
    ) -> io::Result<LookupResponse> {
        let left = deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| io::Error::new(io::ErrorKind::TimedOut, "lookup deadline passed"))?;
        let s = self
            .stream
            .as_mut()
            .ok_or_else(|| io_err("not connected"))?;
        s.set_read_timeout(Some(left))?;
        s.set_write_timeout(Some(left))?;
        write_frame(s, request)?;
        read_frame(s)
    }

    fn call(
        &mut self,
        request: &LookupRequest,
        deadline: Instant,
        expected: Option<&WorkerInfo>,
    ) -> io::Result<LookupResponse> {
        let result = self
            .connect(deadline, expected)
            .map(|_| ())
            .and_then(|()| self.exchange(request, deadline));
        if result.is_err() {
            // A late answer must never be read as the reply to the next request.
            self.stream = None;
        }
        result
    }
}

impl WorkerInfo {
    fn agrees_with(&self, other: &WorkerInfo) -> bool {
        self.probe_hash == other.probe_hash
            && self.chunk_size == other.chunk_size
            && self.hash_algorithm == other.hash_algorithm
    }
}

impl SocketLookup {
    /// Connects to every rank's socket (in rank order), retrying until `connect_deadline`
    /// passes (workers may still be starting), and checks that all ranks agree on the probe
    /// hash and chunk size. A lookup then takes at most `timeout`, all ranks together.
    pub fn connect(
        paths: &[PathBuf],
        timeout: Duration,
        connect_deadline: Duration,
    ) -> io::Result<(Self, WorkerInfo)> {
        if paths.is_empty() {
            return Err(io_err("no worker lookup sockets given"));
        }
        let started = Instant::now();
        let mut ranks: Vec<RankConnection> = paths
            .iter()
            .map(|p| RankConnection::new(p.clone()))
            .collect();
        let mut infos = Vec::with_capacity(ranks.len());
        for rank in &mut ranks {
            let info = loop {
                let deadline = Instant::now() + timeout;
                match rank.call(&LookupRequest::Hello, deadline, None) {
                    Ok(LookupResponse::Hello(info)) => break info,
                    Ok(other) => return Err(io_err(format!("unexpected hello reply {other:?}"))),
                    Err(e) if started.elapsed() < connect_deadline => {
                        debug!(path = %rank.path.display(), error = %e, "worker lookup socket not ready; retrying");
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    Err(e) => {
                        return Err(io::Error::new(
                            e.kind(),
                            format!(
                                "cannot reach the kvpool worker at {} within {connect_deadline:?}: {e}",
                                rank.path.display()
                            ),
                        ));
                    }
                }
            };
            infos.push(info);
        }
        let first = infos[0];
        if let Some(other) = infos.iter().find(|i| !i.agrees_with(&first)) {
            return Err(io_err(format!(
                "worker ranks {} and {} derive keys differently (probe hash or chunk size)",
                first.rank, other.rank
            )));
        }
        Ok((
            SocketLookup {
                ranks: ranks
                    .into_iter()
                    .map(|conn| {
                        Arc::new(Rank {
                            conn: Mutex::new(conn),
                            breaker: Mutex::new(Breaker::default()),
                        })
                    })
                    .collect(),
                expected: first,
                timeout,
                breaker_misses: 0,
            },
            first,
        ))
    }

    /// Asks one rank; its answer, or `None` (a failure, an error reply or another kind of
    /// reply than `request` calls for, all logged) for a miss.
    fn ask(
        rank: &Rank,
        request: &LookupRequest,
        deadline: Instant,
        expected: &WorkerInfo,
    ) -> Option<LookupResponse> {
        let probe = rank.breaker.lock().admits(Instant::now())?;
        // A rank still busy with an earlier lookup (stuck until its deadline) did not answer.
        let Some(mut conn) = rank.conn.try_lock() else {
            rank.breaker.lock().failed(
                Path::new("(a rank busy with an earlier lookup)"),
                Instant::now(),
            );
            return None;
        };
        if probe {
            conn.stream = None;
        }
        let answer = match (request, conn.call(request, deadline, Some(expected))) {
            (LookupRequest::Lookup { .. }, Ok(reply @ LookupResponse::Chunks { .. })) => {
                Some(reply)
            }
            (LookupRequest::Presence { chunk_hashes }, Ok(LookupResponse::Present(flags)))
                if flags.len() == chunk_hashes.len() =>
            {
                Some(LookupResponse::Present(flags))
            }
            (_, Ok(LookupResponse::Error(e))) => {
                warn!(path = %conn.path.display(), error = %e, "lookup failed on a worker; treating as a miss");
                None
            }
            (_, Ok(other)) => {
                warn!(path = %conn.path.display(), reply = ?other, "unexpected lookup reply; treating as a miss");
                conn.stream = None;
                None
            }
            (_, Err(e)) => {
                warn!(path = %conn.path.display(), error = %e, "worker lookup failed; treating as a miss");
                None
            }
        };
        let mut breaker = rank.breaker.lock();
        match answer {
            Some(_) => breaker.succeeded(&conn.path),
            None => breaker.failed(&conn.path, Instant::now()),
        }
        answer
    }

    /// Asks every rank at once, one deadline for all (a hung rank costs the timeout once, not
    /// once per rank; a rank left behind, its thread still blocked, is skipped later, its lock
    /// held, and counts as a miss, like a rank whose breaker is open): every rank's answer, or
    /// `None` when any rank did not answer.
    fn ask_every_rank(&mut self, request: LookupRequest) -> Option<Vec<LookupResponse>> {
        let deadline = Instant::now() + self.timeout;
        let expected = self.expected;
        let (tx, rx) = std::sync::mpsc::channel();
        for rank in &self.ranks {
            let (rank, request, sender) = (rank.clone(), request.clone(), tx.clone());
            let spawned = std::thread::Builder::new()
                .name("kvpool-lookup-ask".into())
                .spawn(move || {
                    let answer = SocketLookup::ask(&rank, &request, deadline, &expected);
                    let _ = sender.send(answer);
                });
            if spawned.is_err() {
                let _ = tx.send(None);
            }
        }
        drop(tx);
        let mut answers = Vec::with_capacity(self.ranks.len());
        while answers.len() < self.ranks.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(Some(a)) => answers.push(a),
                Ok(None) | Err(_) => {
                    self.breaker_misses += u64::from(self.open_breakers() > 0);
                    return None;
                }
            }
        }
        Some(answers)
    }

    /// Ranks whose circuit breaker is open.
    pub fn open_breakers(&self) -> u32 {
        self.ranks
            .iter()
            .filter(|r| r.breaker.lock().open_since.is_some())
            .count() as u32
    }
}

impl PoolLookup for SocketLookup {
    fn lookup(
        &mut self,
        req_id: &str,
        chunk_hashes: &[kvpool_core::ChunkHash],
        load_node_memory: bool,
    ) -> LookupAnswer {
        if chunk_hashes.is_empty() {
            return LookupAnswer::default();
        }
        let request = LookupRequest::Lookup {
            req_id: req_id.to_string(),
            chunk_hashes: chunk_hashes.iter().map(|h| h.0).collect(),
            load_node_memory,
        };
        let answers = match self.ask_every_rank(request) {
            Some(answers) if !answers.is_empty() => answers,
            _ => return LookupAnswer::default(),
        };
        // Every rank must hold a chunk for the engine to skip it: the minimum wins.
        let (mut chunks, mut leased) = (usize::MAX, usize::MAX);
        for answer in answers {
            if let LookupResponse::Chunks { found, leased: l } = answer {
                chunks = chunks.min(found as usize);
                leased = leased.min(l as usize);
            }
        }
        LookupAnswer {
            chunks,
            leased: leased.min(chunks),
        }
    }

    fn presence(&mut self, chunk_hashes: &[kvpool_core::ChunkHash]) -> Vec<bool> {
        let mut held = vec![false; chunk_hashes.len()];
        if chunk_hashes.is_empty() {
            return held;
        }
        let request = LookupRequest::Presence {
            chunk_hashes: chunk_hashes.iter().map(|h| h.0).collect(),
        };
        let answers = match self.ask_every_rank(request) {
            Some(answers) if !answers.is_empty() => answers,
            _ => return held,
        };
        held.fill(true);
        for answer in answers {
            if let LookupResponse::Present(flags) = answer {
                for (h, f) in held.iter_mut().zip(flags) {
                    *h &= f;
                }
            }
        }
        held
    }

    fn counters(&self) -> (u64, u32) {
        (self.breaker_misses, self.open_breakers())
    }
}
