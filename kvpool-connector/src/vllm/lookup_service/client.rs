//! The scheduler's side: [`SocketLookup`], every worker rank asked at once under one deadline,
//! a circuit breaker per rank, over the socket or, for a rank served in this process, without it.

use std::io;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tracing::{debug, info, warn};

use super::server::LookupTarget;
use super::{
    BREAKER_FAILURES, BREAKER_PROBE_INTERVAL, LookupRequest, LookupResponse, WorkerInfo, io_err,
};
use crate::vllm::leases::LookupAnswer;
use crate::vllm::scheduler::{LookupCounters, PoolLookup};
use kvpool_core::frame::{read_frame, write_frame};

/// One rank as the scheduler sees it: its connection (locked while a call is on the wire)
/// and its circuit breaker (never locked across I/O).
struct Rank {
    /// Its lookup socket.
    path: PathBuf,
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
    /// Whether ranks served in this process are asked without the socket.
    in_process: bool,
    /// Lookups asked of every rank in this process, without the sockets.
    in_process_lookups: u64,
    /// Lookups sent to the ranks over their sockets.
    over_sockets: u64,
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
                            path: conn.path.clone(),
                            conn: Mutex::new(conn),
                            breaker: Mutex::new(Breaker::default()),
                        })
                    })
                    .collect(),
                expected: first,
                timeout,
                breaker_misses: 0,
                in_process: false,
                in_process_lookups: 0,
                over_sockets: 0,
            },
            first,
        ))
    }

    /// Asks ranks served in this process without their sockets (see the module's docs): the
    /// same answers, computed on the asking thread, the deadline a timer on the pool's runtime
    /// (effective at the lookup's await points). A rank
    /// whose server is not in this process (another worker process, or its server stopped) is
    /// asked over its socket as before.
    pub fn answer_in_process(mut self) -> Self {
        self.in_process = true;
        self
    }

    /// Lookups asked of every rank in this process, without the sockets.
    pub fn lookups_in_process(&self) -> u64 {
        self.in_process_lookups
    }

    /// Lookups sent to the ranks over their sockets (some rank's server not in this process,
    /// or [`SocketLookup::answer_in_process`] not asked for).
    pub fn lookups_over_sockets(&self) -> u64 {
        self.over_sockets
    }

    /// Asks one rank (`in_process`: without its socket if its server runs in this process
    /// and derives keys as `expected`); its answer, or `None` (a failure, an error reply or
    /// another kind of reply than `request` calls for, all logged) for a miss.
    fn ask(
        rank: &Rank,
        request: &LookupRequest,
        deadline: Instant,
        expected: &WorkerInfo,
        in_process: bool,
    ) -> Option<LookupResponse> {
        let probe = rank.breaker.lock().admits(Instant::now())?;
        let local = in_process
            .then(|| LookupTarget::in_process(&rank.path))
            .flatten()
            .filter(|target| target.info.agrees_with(expected));
        let answer = match local {
            Some(target) => {
                let reply = target.answer(request.clone(), Some(deadline));
                Self::accept(request, Ok(reply), &rank.path).0
            }
            None => {
                // A rank still busy with an earlier lookup (stuck until its deadline) did not
                // answer.
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
                let reply = conn.call(request, deadline, Some(expected));
                let (answer, reconnect) = Self::accept(request, reply, &rank.path);
                if reconnect {
                    conn.stream = None;
                }
                answer
            }
        };
        let mut breaker = rank.breaker.lock();
        match answer {
            Some(_) => breaker.succeeded(&rank.path),
            None => breaker.failed(&rank.path, Instant::now()),
        }
        answer
    }

    /// What a rank's `reply` to `request` counts as: the answer, or `None` for a miss (logged);
    /// and whether the connection must be dropped (a reply of the wrong kind: the next
    /// request must not read what follows it).
    fn accept(
        request: &LookupRequest,
        reply: io::Result<LookupResponse>,
        path: &Path,
    ) -> (Option<LookupResponse>, bool) {
        match (request, reply) {
            (LookupRequest::Lookup { .. }, Ok(reply @ LookupResponse::Chunks { .. })) => {
                (Some(reply), false)
            }
            (LookupRequest::Presence { chunk_hashes }, Ok(LookupResponse::Present(flags)))
                if flags.len() == chunk_hashes.len() =>
            {
                (Some(LookupResponse::Present(flags)), false)
            }
            (_, Ok(LookupResponse::Error(e))) => {
                warn!(path = %path.display(), error = %e, "lookup failed on a worker; treating as a miss");
                (None, false)
            }
            (_, Ok(other)) => {
                warn!(path = %path.display(), reply = ?other, "unexpected lookup reply; treating as a miss");
                (None, true)
            }
            (_, Err(e)) => {
                warn!(path = %path.display(), error = %e, "worker lookup failed; treating as a miss");
                (None, false)
            }
        }
    }

    /// Asks every rank at once, one deadline for all (a hung rank costs the timeout once, not
    /// once per rank; a rank left behind, its thread still blocked, is skipped later, its lock
    /// held, and counts as a miss, like a rank whose breaker is open): every rank's answer, or
    /// `None` when any rank did not answer.
    fn ask_every_rank(&mut self, request: LookupRequest) -> Option<Vec<LookupResponse>> {
        let deadline = Instant::now() + self.timeout;
        let expected = self.expected;
        let in_process = self.in_process;
        // The test `ask` applies to each rank: a server here that derives keys as expected.
        if in_process
            && self.ranks.iter().all(|r| {
                LookupTarget::in_process(&r.path).is_some_and(|t| t.info.agrees_with(&expected))
            })
        {
            // Every rank in this process: asked on this thread, one after the other.
            self.in_process_lookups += 1;
            let answers = self
                .ranks
                .iter()
                .map(|rank| SocketLookup::ask(rank, &request, deadline, &expected, true))
                .collect::<Option<Vec<_>>>();
            if answers.is_none() {
                self.breaker_misses += u64::from(self.open_breakers() > 0);
            }
            return answers;
        }
        self.over_sockets += 1;
        let (tx, rx) = std::sync::mpsc::channel();
        for rank in &self.ranks {
            let (rank, request, sender) = (rank.clone(), request.clone(), tx.clone());
            let spawned = std::thread::Builder::new()
                .name("kvpool-lookup-ask".into())
                .spawn(move || {
                    let answer =
                        SocketLookup::ask(&rank, &request, deadline, &expected, in_process);
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

    fn counters(&self) -> LookupCounters {
        LookupCounters {
            breaker_misses: self.breaker_misses,
            breakers_open: self.open_breakers(),
            in_process: self.in_process_lookups,
            over_sockets: self.over_sockets,
        }
    }
}
