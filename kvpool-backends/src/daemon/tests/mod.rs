//! The daemon and its `kvpool+unix://` tier, end to end on a real socket in a temp dir.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvpool_core::frame::{read_frame, write_frame};
use kvpool_core::memory::EvictionKind;
use kvpool_core::storage::remote::{RemoteBackend, RemoteConnector};
use kvpool_core::{ChunkCodec, StorageBackend};

use super::*;
use crate::conformance::{self, Subject};
use crate::memory::InMemoryConnector;

mod bounds;
mod in_place;
mod lower_tiers;
mod request_timing;
mod sessions;
mod socket_and_arena;
mod tenants;
mod write_behind;

const MIB: usize = 1 << 20;

fn options(capacity: usize) -> DaemonOptions {
    DaemonOptions {
        tenant: "default".into(),
        capacity,
        eviction: EvictionKind::Lru,
        lease_ttl: DEFAULT_LEASE_TTL,
        write_behind_quota: 64 * MIB,
        copy_buffer_bytes: default_copy_buffer_bytes(capacity),
    }
}

pub(super) struct Running {
    pub(super) daemon: Arc<PoolDaemon>,
    pub(super) server: DaemonServer,
}

pub(super) fn start(path: &Path, capacity: usize, tiers: Vec<Arc<dyn RemoteConnector>>) -> Running {
    let daemon = Arc::new(
        PoolDaemon::with_tiers(options(capacity), tiers, tokio::runtime::Handle::current())
            .unwrap(),
    );
    let server = DaemonServer::bind(daemon.clone(), path, SocketAccess::default()).unwrap();
    Running { daemon, server }
}

pub(super) fn socket(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("kvpool.sock")
}

fn client(path: &Path) -> DaemonConnector {
    DaemonConnector::new(path, Duration::from_secs(5))
}

fn value(byte: u8, len: usize) -> Bytes {
    Bytes::from(vec![byte; len])
}

/// A raw session, attached, speaking the protocol by hand.
fn raw_session(path: &Path) -> UnixStream {
    let mut s = UnixStream::connect(path).unwrap();
    write_frame(
        &mut s,
        &Request::Attach {
            version: PROTOCOL_VERSION,
            client: "raw".into(),
        },
    )
    .unwrap();
    assert!(matches!(
        read_frame::<Reply>(&mut s).unwrap(),
        Reply::Attached { .. }
    ));
    let mut byte = [0u8; 1];
    let mut fds = [-1; 1];
    sendfd::RecvWithFd::recv_with_fd(&s, &mut byte, &mut fds).unwrap();
    // SAFETY: the descriptor was just received and is ours alone.
    drop(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fds[0]) });
    s
}

fn call(s: &mut UnixStream, request: Request) -> Reply {
    write_frame(s, &request).unwrap();
    read_frame(s).unwrap()
}

/// Waits until the daemon's counters satisfy `done` (sessions end on their own threads).
fn wait_for(daemon: &PoolDaemon, done: impl Fn(&DaemonStats) -> bool) -> DaemonStats {
    for _ in 0..500 {
        let s = daemon.stats();
        if done(&s) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("daemon never reached the state: {:?}", daemon.stats());
}

/// A chunk-format value under a real chunk key (scope `m`, layout fingerprint 7).
fn chunk_value(hash: u8, payload: &[u8]) -> (String, Bytes) {
    use kvpool_core::format::chunk_format::KeyBinding;
    let scope = Arc::new(kvpool_core::KeyScope::new("m", 1, 0, 0, 7).unwrap());
    let key = kvpool_core::CacheKey::new(scope, kvpool_core::ChunkHash([hash; 16]));
    let meta = kvpool_core::ChunkMeta {
        layout_fingerprint: 7,
        dtype: kvpool_core::Dtype::F16,
        token_count: 1,
    };
    let encoded = ChunkCodec::default().encode(&meta, &KeyBinding::of(&key), payload);
    (key.to_string(), Bytes::from(encoded))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engines_share_values_and_bytes_never_cross_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let run = start(&path, 16 * MIB, vec![]);
    let (a, b) = (client(&path), client(&path));
    a.batch_put(vec![
        ("k1".into(), value(7, MIB)),
        ("k2".into(), value(9, 1000)),
    ])
    .await
    .unwrap();
    assert_eq!(
        b.batch_exists(&["k1".into(), "k2".into(), "k3".into()])
            .await
            .unwrap(),
        vec![true, true, false]
    );
    let got = b
        .batch_get(&["k2".into(), "k3".into(), "k1".into()])
        .await
        .unwrap();
    assert_eq!(got[0].as_deref(), Some(&[9u8; 1000][..]));
    assert!(got[1].is_none());
    assert_eq!(got[2].as_deref(), Some(&vec![7u8; MIB][..]));
    let stats = b.daemon_stats().unwrap();
    assert_eq!(stats.sessions, 2);
    assert_eq!((stats.entries, stats.pins, stats.allocations), (2, 0, 0));
    assert_eq!((stats.memory_hits, stats.misses), (2, 1));
    assert_eq!(a.batch_delete(&["k1".into()]).await.unwrap(), 1);
    assert_eq!(b.batch_get(&["k1".into()]).await.unwrap(), vec![None]);
    drop(run);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_tier_passes_the_conformance_kit() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let _run = start(&path, 64 * MIB, vec![]);
    let results = conformance::run_all(&|| {
        let path = path.clone();
        async move {
            let backend = RemoteBackend::new(client(&path), ChunkCodec::default(), 32 << 20);
            // The kit's corrupted and misfiled values reach the engine's one-copy read of
            // the arena: they are rewritten through a second session, as raw bytes.
            let raw = client(&path);
            let corrupt_raw = raw.clone();
            Subject::new(Arc::new(backend) as Arc<dyn StorageBackend>, 16 << 20)
                .with_corruptor(Arc::new(move |key| {
                    let raw = corrupt_raw.clone();
                    Box::pin(async move {
                        let key = key.to_string();
                        let got = raw.batch_get(std::slice::from_ref(&key)).await.unwrap();
                        let mut bytes = got[0].clone().expect("stored").to_vec();
                        let mid = bytes.len() / 2;
                        bytes[mid] ^= 0x20;
                        raw.batch_put(vec![(key, Bytes::from(bytes))])
                            .await
                            .unwrap();
                    })
                }))
                .with_raw_copier(Arc::new(move |from, to| {
                    let raw = raw.clone();
                    Box::pin(async move {
                        let got = raw.batch_get(&[from.to_string()]).await.unwrap();
                        let bytes = got[0].clone().expect("stored");
                        raw.batch_put(vec![(to.to_string(), bytes)]).await.unwrap();
                    })
                }))
        }
    })
    .await;
    conformance::assert_all_passed("kvpool+unix", &results);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_arena_evicts_unheld_values_and_refuses_what_cannot_fit() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let run = start(&path, 4 * MIB, vec![]);
    let engine = client(&path);
    for i in 0..6u8 {
        engine
            .batch_put(vec![(format!("k{i}"), value(i, MIB))])
            .await
            .unwrap();
    }
    let stats = run.daemon.stats();
    assert!(stats.used_bytes <= 4 * MIB as u64);
    assert_eq!(stats.evictions, 2);
    assert_eq!(
        engine
            .batch_exists(&["k0".into(), "k5".into()])
            .await
            .unwrap(),
        vec![false, true]
    );
    let err = engine
        .batch_put(vec![("big".into(), value(1, 5 * MIB))])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no room"), "{err}");
}
