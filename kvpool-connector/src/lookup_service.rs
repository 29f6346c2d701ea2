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
//! [`LookupRequest`] or [`LookupResponse`]. Every read and write has a timeout; a rank that
//! does not answer in time counts as a miss, and the next lookup reconnects.

use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvpool_core::CacheEngine;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::runtime::Runtime;
use tracing::{debug, info, warn};

use crate::scheduler::PoolLookup;

/// Largest frame either side accepts.
pub const MAX_FRAME_BYTES: usize = 64 << 20;

/// What the scheduler asks a worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LookupRequest {
    /// Who are you: the worker's key derivation and chunking.
    Hello,
    /// How many leading chunks of these (scheduler-computed chain hashes) the pool holds.
    Lookup {
        /// Chunk hashes, in order.
        chunk_hashes: Vec<[u8; 16]>,
    },
}

/// A worker's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LookupResponse {
    /// Answer to [`LookupRequest::Hello`].
    Hello(WorkerInfo),
    /// Leading chunks the pool holds.
    Chunks(u64),
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

/// Writes one frame.
pub fn write_frame<T: Serialize>(stream: &mut UnixStream, message: &T) -> io::Result<()> {
    let body = postcard::to_stdvec(message).map_err(|e| io_err(e.to_string()))?;
    if body.len() > MAX_FRAME_BYTES {
        return Err(io_err(format!(
            "frame of {} bytes is too large",
            body.len()
        )));
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    stream.write_all(&frame)
}

/// Reads one frame; a frame above [`MAX_FRAME_BYTES`] or one that does not decode is an error.
pub fn read_frame<T: DeserializeOwned>(stream: &mut UnixStream) -> io::Result<T> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(io_err(format!("frame of {len} bytes is too large")));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body)?;
    postcard::from_bytes(&body).map_err(|e| io_err(e.to_string()))
}

/// Answers lookups against a worker's pool on a Unix socket, on its own threads, until dropped.
pub struct LookupServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    accept_thread: Option<JoinHandle<()>>,
}

impl LookupServer {
    /// Binds `path` (replacing a stale socket file) and serves lookups for `engine`, whose
    /// async calls run on `runtime`. Each connection gets a thread; reads time out after
    /// `idle_timeout` so abandoned connections do not pin threads for ever.
    pub fn start(
        path: &Path,
        engine: Arc<CacheEngine>,
        runtime: Arc<Runtime>,
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
                    let (engine, runtime) = (engine.clone(), runtime.clone());
                    let spawned = std::thread::Builder::new()
                        .name("kvpool-lookup-conn".into())
                        .spawn(move || serve(stream, &engine, &runtime, info, idle_timeout));
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
            LookupRequest::Lookup { chunk_hashes } => {
                let hashes: Vec<kvpool_core::ChunkHash> = chunk_hashes
                    .into_iter()
                    .map(kvpool_core::ChunkHash)
                    .collect();
                LookupResponse::Chunks(
                    crate::scheduler::lookup_chunks(engine, runtime, &hashes) as u64
                )
            }
        };
        if write_frame(&mut stream, &response).is_err() {
            return;
        }
    }
}

/// The scheduler's view of the worker ranks' pools, over their lookup sockets.
pub struct SocketLookup {
    ranks: Vec<RankConnection>,
    timeout: Duration,
}

struct RankConnection {
    path: PathBuf,
    stream: Option<UnixStream>,
}

impl RankConnection {
    fn connect(&mut self, timeout: Duration) -> io::Result<&mut UnixStream> {
        if self.stream.is_none() {
            let s = UnixStream::connect(&self.path)?;
            s.set_read_timeout(Some(timeout))?;
            s.set_write_timeout(Some(timeout))?;
            self.stream = Some(s);
        }
        Ok(self.stream.as_mut().expect("just connected"))
    }

    fn call(&mut self, request: &LookupRequest, timeout: Duration) -> io::Result<LookupResponse> {
        let result = self.connect(timeout).and_then(|s| {
            write_frame(s, request)?;
            read_frame(s)
        });
        if result.is_err() {
            // A late answer must never be read as the reply to the next request.
            self.stream = None;
        }
        result
    }
}

impl SocketLookup {
    /// Connects to every rank's socket (in rank order), retrying until `connect_deadline`
    /// passes (workers may still be starting), and checks that all ranks agree on the probe
    /// hash and chunk size. Calls then time out after `timeout`.
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
            .map(|p| RankConnection {
                path: p.clone(),
                stream: None,
            })
            .collect();
        let mut infos = Vec::with_capacity(ranks.len());
        for rank in &mut ranks {
            let info = loop {
                match rank.call(&LookupRequest::Hello, timeout) {
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
        if let Some(other) = infos.iter().find(|i| {
            i.probe_hash != first.probe_hash
                || i.chunk_size != first.chunk_size
                || i.hash_algorithm != first.hash_algorithm
        }) {
            return Err(io_err(format!(
                "worker ranks {} and {} derive keys differently (probe hash or chunk size)",
                first.rank, other.rank
            )));
        }
        Ok((SocketLookup { ranks, timeout }, first))
    }
}

impl PoolLookup for SocketLookup {
    fn lookup(&mut self, chunk_hashes: &[kvpool_core::ChunkHash]) -> usize {
        if chunk_hashes.is_empty() {
            return 0;
        }
        let request = LookupRequest::Lookup {
            chunk_hashes: chunk_hashes.iter().map(|h| h.0).collect(),
        };
        let mut hit = usize::MAX;
        for rank in &mut self.ranks {
            let answer = match rank.call(&request, self.timeout) {
                Ok(LookupResponse::Chunks(n)) => n as usize,
                Ok(LookupResponse::Error(e)) => {
                    warn!(path = %rank.path.display(), error = %e, "lookup failed on a worker; treating as a miss");
                    0
                }
                Ok(other) => {
                    warn!(path = %rank.path.display(), reply = ?other, "unexpected lookup reply; treating as a miss");
                    rank.stream = None;
                    0
                }
                Err(e) => {
                    warn!(path = %rank.path.display(), error = %e, "worker lookup socket failed; treating as a miss");
                    0
                }
            };
            hit = hit.min(answer);
            if hit == 0 {
                break;
            }
        }
        hit
    }
}
