//! The worker's side: [`LookupServer`] answering lookups on its Unix socket, and the
//! registry of this process's servers that [`super::SocketLookup::answer_in_process`] reads.

use std::collections::HashMap;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvpool_core::CacheEngine;
use parking_lot::Mutex;
use tokio::runtime::Runtime;
use tracing::{debug, info, warn};

use super::{LookupRequest, LookupResponse, WorkerInfo};
use crate::vllm::leases::{LeaseTable, lookup_and_lease};
use kvpool_core::frame::{read_frame, write_frame};

/// Answers lookups against a worker's pool on a Unix socket, on its own threads, until dropped.
pub struct LookupServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    accept_thread: Option<JoinHandle<()>>,
    /// What answers (shared with the connection threads, and registered for schedulers in
    /// this process).
    target: Arc<LookupTarget>,
    /// The listening socket (a second handle): shut down to wake the accept loop, which works
    /// even when another server has taken `path` over since.
    listener: UnixListener,
    /// The socket file this server bound (device, inode): removed at the end only if `path`
    /// still names it.
    bound_file: Option<(u64, u64)>,
}

/// What a lookup server answers from: a worker's pool, its runtime and its leases.
pub(super) struct LookupTarget {
    engine: Arc<CacheEngine>,
    runtime: Arc<Runtime>,
    leases: Arc<LeaseTable>,
    pub(super) info: WorkerInfo,
}

/// The lookup servers started in this process, by socket path, for a scheduler in the same
/// process to ask without the socket ([`SocketLookup::answer_in_process`]). An entry lives
/// as long as its server.
static IN_PROCESS_SERVERS: LazyLock<Mutex<HashMap<PathBuf, Weak<LookupTarget>>>> =
    LazyLock::new(Default::default);

impl LookupTarget {
    /// The answer to `request`, as the socket sends it; an error reply once `deadline`
    /// passes (none: as long as the pool takes).
    pub(super) fn answer(
        &self,
        request: LookupRequest,
        deadline: Option<Instant>,
    ) -> LookupResponse {
        let Some(deadline) = deadline else {
            return self.runtime.block_on(self.answer_now(request));
        };
        let left = deadline.saturating_duration_since(Instant::now());
        // The timer is made inside the runtime (it needs the runtime's clock).
        self.runtime
            .block_on(async { tokio::time::timeout(left, self.answer_now(request)).await })
            .unwrap_or_else(|_| LookupResponse::Error("lookup deadline passed".into()))
    }

    async fn answer_now(&self, request: LookupRequest) -> LookupResponse {
        match request {
            LookupRequest::Hello => LookupResponse::Hello(self.info),
            LookupRequest::Lookup {
                req_id,
                chunk_hashes,
                load_node_memory,
            } => {
                let hashes: Vec<kvpool_core::ChunkHash> = chunk_hashes
                    .into_iter()
                    .map(kvpool_core::ChunkHash)
                    .collect();
                let answer = lookup_and_lease(
                    &self.engine,
                    &self.leases,
                    &req_id,
                    &hashes,
                    load_node_memory,
                )
                .await;
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
                    crate::vllm::scheduler::chunks_present(&self.engine, &hashes).await,
                )
            }
        }
    }

    /// The server at `path` in this process, if one runs there now.
    pub(super) fn in_process(path: &Path) -> Option<Arc<LookupTarget>> {
        IN_PROCESS_SERVERS.lock().get(path).and_then(Weak::upgrade)
    }
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
        let bound_file = socket_file_id(path);
        let waker = listener.try_clone()?;
        let info = WorkerInfo {
            probe_hash: crate::probe_hash(&engine),
            chunk_size: engine.token_database().chunk_size() as u32,
            hash_algorithm: engine.token_database().config().hash_algorithm,
            rank,
        };
        let target = Arc::new(LookupTarget {
            engine,
            runtime,
            leases,
            info,
        });
        let stop = Arc::new(AtomicBool::new(false));
        let stop_accept = stop.clone();
        let serving = target.clone();
        let accept_thread = std::thread::Builder::new()
            .name("kvpool-lookup".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop_accept.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(stream) = conn else { continue };
                    let target = serving.clone();
                    let spawned = std::thread::Builder::new()
                        .name("kvpool-lookup-conn".into())
                        .spawn(move || serve(stream, &target, idle_timeout));
                    if let Err(e) = spawned {
                        warn!(error = %e, "cannot start a lookup connection thread");
                    }
                }
            })?;
        IN_PROCESS_SERVERS
            .lock()
            .insert(path.to_path_buf(), Arc::downgrade(&target));
        info!(path = %path.display(), rank, "kvpool lookup server listening");
        Ok(LookupServer {
            path: path.to_path_buf(),
            stop,
            accept_thread: Some(accept_thread),
            target,
            listener: waker,
            bound_file,
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for LookupServer {
    fn drop(&mut self) {
        {
            // Unregistered only if no later server took the path over.
            let mut servers = IN_PROCESS_SERVERS.lock();
            if servers
                .get(&self.path)
                .is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&self.target)))
            {
                servers.remove(&self.path);
            }
        }
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so it sees the flag: shutting the listening socket down makes
        // a blocked `accept` return; a connection through the path also wakes it, but only
        // while the path is still this server's (another server may have bound it since).
        // SAFETY: `shutdown` on a descriptor this server owns for as long as `self` lives.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        let still_ours = self.bound_file.is_some() && socket_file_id(&self.path) == self.bound_file;
        if still_ours {
            let _ = UnixStream::connect(&self.path);
        }
        if let Some(t) = self.accept_thread.take() {
            let _ = t.join();
        }
        if still_ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The (device, inode) of the file at `path`, if there is one.
fn socket_file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;

    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

fn serve(mut stream: UnixStream, target: &LookupTarget, idle_timeout: Duration) {
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
        if write_frame(&mut stream, &target.answer(request, None)).is_err() {
            return;
        }
    }
}
