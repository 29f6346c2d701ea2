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
mod request_timing;
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
async fn an_engine_killed_holding_leases_leaks_nothing_and_its_half_written_value_stays_invisible()
{
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let run = start(&path, 16 * MIB, vec![]);
    let other = client(&path);
    other
        .batch_put(vec![("held".into(), value(1, MIB))])
        .await
        .unwrap();
    let baseline = run.daemon.stats().used_bytes;

    let mut engine = raw_session(&path);
    let Reply::Pinned(pins) = call(
        &mut engine,
        Request::Get {
            keys: vec!["held".into()],
        },
    ) else {
        panic!("no pins")
    };
    assert!(pins[0].is_some());
    let Reply::Prepared(allocs) = call(
        &mut engine,
        Request::PrepareSave {
            lens: vec![MIB as u64; 3],
        },
    ) else {
        panic!("no allocations")
    };
    assert!(allocs.iter().all(Option::is_some));
    // Written (or not: the daemon cannot tell) but never committed: nobody sees it.
    assert_eq!(
        other.batch_exists(&["half".into()]).await.unwrap(),
        vec![false]
    );
    let held = run.daemon.stats();
    assert_eq!((held.pins, held.allocations), (1, 3));
    assert_eq!(held.used_bytes, baseline + 3 * MIB as u64);

    drop(engine); // the process dies: its socket closes
    let after = wait_for(&run.daemon, |s| s.sessions == 1);
    assert_eq!((after.pins, after.allocations), (0, 0));
    assert_eq!(
        after.used_bytes, baseline,
        "the allocations' memory came back"
    );
    assert_eq!(after.leases_reclaimed, 4);
    assert_eq!(
        other
            .batch_get(&["held".into(), "half".into()])
            .await
            .unwrap()[1],
        None
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_from_one_engine_closes_only_its_session() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let run = start(&path, 16 * MIB, vec![]);
    let good = client(&path);
    good.batch_put(vec![("k".into(), value(3, 4096))])
        .await
        .unwrap();

    let mut bad = raw_session(&path);
    bad.write_all(&[5, 0, 0, 0, 0xff, 0xfe, 0xfd, 0xfc, 0xfb])
        .unwrap();
    wait_for(&run.daemon, |s| s.refused == 1 && s.sessions == 1);
    // A request before attaching, and an old protocol version, are refused with a reason.
    let mut early = UnixStream::connect(&path).unwrap();
    let reply = call(&mut early, Request::Stats);
    assert!(
        matches!(reply, Reply::Error(ref why) if why.contains("attach first")),
        "{reply:?}"
    );
    let mut old = UnixStream::connect(&path).unwrap();
    let reply = call(
        &mut old,
        Request::Attach {
            version: PROTOCOL_VERSION + 1,
            client: "future".into(),
        },
    );
    assert!(
        matches!(reply, Reply::Error(ref why) if why.contains("protocol version")),
        "{reply:?}"
    );

    let got = good.batch_get(&["k".into()]).await.unwrap();
    assert_eq!(got[0].as_deref(), Some(&[3u8; 4096][..]));
}

/// An engine killed with a reply still unread resets its socket: that is an engine leaving,
/// as every `kill -9` of an engine mid-call does, not garbage to count and warn about.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_dies_with_a_reply_unread_leaves_without_a_refusal() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let run = start(&path, 16 * MIB, vec![]);
    let mut dying = raw_session(&path);
    wait_for(&run.daemon, |s| s.sessions == 1);
    write_frame(&mut dying, &Request::Stats).unwrap();
    // The reply lands in the socket's buffer and is never read: closing it now resets the
    // connection (ECONNRESET on the daemon's next read) rather than ending it cleanly.
    std::thread::sleep(Duration::from_millis(200));
    drop(dying);
    let after = wait_for(&run.daemon, |s| s.sessions == 0);
    assert_eq!(after.refused, 0, "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_go_to_the_lower_tier_and_come_back_after_a_daemon_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let disk: Arc<dyn RemoteConnector> = Arc::new(InMemoryConnector::new());
    let run = start(&path, 16 * MIB, vec![disk.clone()]);
    let engine = client(&path);
    let (k, v) = chunk_value(4, &[4u8; 64 << 10]);
    engine
        .batch_put(vec![(k.clone(), v.clone())])
        .await
        .unwrap();
    for _ in 0..500 {
        if disk.exists(&k).await.unwrap() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        disk.exists(&k).await.unwrap(),
        "write-behind never reached the tier"
    );

    // The daemon dies: the engine's calls fail (misses), nothing panics.
    run.server.shutdown();
    drop(run.daemon);
    assert!(engine.batch_get(std::slice::from_ref(&k)).await.is_err());
    assert!(!path.exists(), "shutdown removes the socket");

    // A new daemon over the same lower tier: the engine attaches again by itself.
    let run = start(&path, 16 * MIB, vec![disk.clone()]);
    tokio::time::sleep(RECONNECT_INTERVAL + Duration::from_millis(100)).await;
    let got = engine.batch_get(std::slice::from_ref(&k)).await.unwrap();
    assert_eq!(got[0].as_deref(), Some(&v[..]));
    let stats = run.daemon.stats();
    assert_eq!(
        (stats.tier_hits, stats.memory_hits, stats.entries),
        (1, 0, 1),
        "promoted into memory, counted once"
    );
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_socket_is_owner_only_and_a_live_daemon_is_not_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let _run = start(&path, MIB, vec![]);
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let second = Arc::new(
        PoolDaemon::with_tiers(options(MIB), vec![], tokio::runtime::Handle::current()).unwrap(),
    );
    let err = DaemonServer::bind(second, &path, SocketAccess::default())
        .err()
        .unwrap();
    assert!(err.to_string().contains("already serves"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_started_before_the_daemon_attaches_once_it_runs() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let tier = kvpool_core::TierConfig::new(format!("kvpool+unix://{}", path.display()));
    // Opening succeeds (with a warning): the engine serves with misses meanwhile.
    let request = crate::backend_factory::TierRequest {
        tier: &tier,
        max_chunk_bytes: 1 << 20,
    };
    let engine = crate::backend_factory::BackendFactory::open(&DaemonFactory, &request)
        .await
        .unwrap();
    assert!(
        engine.batch_get(&["k".into()]).await.is_err(),
        "no daemon yet"
    );
    let _run = start(&path, MIB, vec![]);
    tokio::time::sleep(RECONNECT_INTERVAL + Duration::from_millis(100)).await;
    let direct = client(&path);
    direct.attach().unwrap();
    assert_eq!(
        socket_path("unix:///run/kvpool/kvpool.sock").unwrap(),
        PathBuf::from("/run/kvpool/kvpool.sock")
    );
    assert!(socket_path("kvpool+unix://relative.sock").is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_calls_of_one_engine_share_a_few_sessions_and_all_succeed() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let run = start(&path, 64 * MIB, vec![]);
    let engine = client(&path);
    let tasks: Vec<_> = (0..32u8)
        .map(|i| {
            let engine = engine.clone();
            tokio::spawn(async move {
                let key = format!("k{i}");
                engine
                    .batch_put(vec![(key.clone(), value(i, 256 << 10))])
                    .await
                    .unwrap();
                let got = engine.batch_get(&[key]).await.unwrap();
                assert_eq!(got[0].as_deref(), Some(&vec![i; 256 << 10][..]));
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let s = run.daemon.stats();
    assert!(
        (1..=SESSIONS_PER_CONNECTOR as u64).contains(&s.sessions),
        "{s:?}"
    );
    assert_eq!((s.entries, s.pins, s.allocations), (32, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_naming_bytes_outside_its_arena_is_refused_before_anything_is_read() {
    use std::os::fd::AsRawFd;

    use kvpool_core::memory::SharedMapping;
    use sendfd::SendWithFd;

    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let _: Request = read_frame(&mut s).unwrap();
        let arena = SharedMapping::create("fake-daemon", 4096).unwrap();
        write_frame(
            &mut s,
            &Reply::Attached {
                arena_len: 4096,
                daemon_id: 1,
                lease_ttl_ms: 1000,
            },
        )
        .unwrap();
        s.send_with_fd(&[0], &[arena.fd().as_raw_fd()]).unwrap();
        let _: Request = read_frame(&mut s).unwrap();
        let beyond = Region {
            id: 1,
            offset: 4000,
            len: 200,
        };
        write_frame(&mut s, &Reply::Pinned(vec![Some(beyond)])).unwrap();
        // The engine hangs up rather than asking anything more.
        read_frame::<Request>(&mut s).is_err()
    });
    let engine = client(&path);
    let err = engine.batch_get(&["k".into()]).await.unwrap_err();
    assert!(err.to_string().contains("outside"), "{err}");
    assert!(fake.join().unwrap(), "the engine kept the session");
}

#[test]
fn a_daemon_refuses_another_daemon_as_its_lower_tier() {
    let mut config = kvpool_core::PoolConfig::default();
    config.tiers.push(kvpool_core::TierConfig::new(
        "kvpool+unix:///run/kvpool/kvpool.sock",
    ));
    let err = DaemonOptions::from_config(&config).err().unwrap();
    assert!(err.to_string().contains("is a pool daemon"), "{err}");
    config.tiers[0] = kvpool_core::TierConfig::new("memory://");
    assert!(DaemonOptions::from_config(&config).is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_arena_descriptor_an_engine_receives_is_closed_on_exec() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let _run = start(&path, MIB, vec![]);
    let engine = client(&path);
    engine.attach().unwrap();
    let mut arenas = 0;
    for entry in std::fs::read_dir("/proc/self/fd").unwrap() {
        let entry = entry.unwrap();
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if !target.to_string_lossy().starts_with("/memfd:kvpool-l1") {
            continue;
        }
        let fd: i32 = entry.file_name().to_string_lossy().parse().unwrap();
        // SAFETY: F_GETFD only reads the descriptor's flags.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        if flags >= 0 {
            arenas += 1;
            assert_ne!(
                flags & libc::FD_CLOEXEC,
                0,
                "fd {fd} ({target:?}) survives exec"
            );
        }
    }
    // The daemon's own descriptor, and the engine's.
    assert!(arenas >= 2, "{arenas} arena descriptors found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_too_many_items_is_refused_and_the_session_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let _run = start(&path, MIB, vec![]);
    let mut engine = raw_session(&path);
    let keys = vec![String::new(); MAX_ITEMS_PER_REQUEST + 1];
    let reply = call(&mut engine, Request::Exists { keys });
    assert!(
        matches!(reply, Reply::Error(ref why) if why.contains("items")),
        "{reply:?}"
    );
    let reply = call(
        &mut engine,
        Request::Exists {
            keys: vec!["k".into()],
        },
    );
    assert_eq!(reply, Reply::Exists(vec![false]));
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

/// An engine that found shared memory's copy bad deletes it: only that copy goes. Before,
/// the daemon's `Delete` also removed the value from every lower tier, so a stray write or a
/// late DMA into the arena cost the durable copies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_delete_drops_shared_memorys_copy_and_the_lower_tier_keeps_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let disk: Arc<dyn RemoteConnector> = Arc::new(InMemoryConnector::new());
    let run = start(&path, 16 * MIB, vec![disk.clone()]);
    let engine = client(&path);
    let (key, bytes) = chunk_value(1, &[5u8; 4096]);
    engine
        .batch_put(vec![(key.clone(), bytes.clone())])
        .await
        .unwrap();
    for _ in 0..500 {
        if disk.exists(&key).await.unwrap() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(disk.exists(&key).await.unwrap());
    assert_eq!(
        engine
            .batch_delete(std::slice::from_ref(&key))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        run.daemon.stats().entries,
        0,
        "shared memory's copy is gone"
    );
    assert!(
        disk.exists(&key).await.unwrap(),
        "the lower tier keeps its copy"
    );
    // The next read promotes the lower tier's (good) copy again.
    let got = engine.batch_get(std::slice::from_ref(&key)).await.unwrap();
    assert_eq!(got[0].as_deref(), Some(&bytes[..]));
}

/// A lower tier's value that fails its check (a flipped byte on disk) is a miss, is not
/// promoted, and is deleted from that tier only; a good value beside it is promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_lower_tier_copy_is_a_miss_and_is_deleted_from_that_tier_only() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let first: Arc<dyn RemoteConnector> = Arc::new(InMemoryConnector::new());
    let second: Arc<dyn RemoteConnector> = Arc::new(InMemoryConnector::new());
    let (good_key, good) = chunk_value(2, &[6u8; 4096]);
    let (bad_key, bad) = chunk_value(3, &[7u8; 4096]);
    let mut flipped = bad.to_vec();
    *flipped.last_mut().unwrap() ^= 0x10;
    first
        .batch_put(vec![
            (good_key.clone(), good.clone()),
            (bad_key.clone(), Bytes::from(flipped)),
        ])
        .await
        .unwrap();
    second
        .batch_put(vec![(bad_key.clone(), bad.clone())])
        .await
        .unwrap();
    let run = start(&path, 16 * MIB, vec![first.clone(), second.clone()]);
    let engine = client(&path);
    let got = engine
        .batch_get(&[good_key.clone(), bad_key.clone()])
        .await
        .unwrap();
    assert_eq!(got[0].as_deref(), Some(&good[..]));
    // The first tier's copy failed: the second tier's good copy is what the engine gets.
    assert_eq!(got[1].as_deref(), Some(&bad[..]));
    assert!(
        !first.exists(&bad_key).await.unwrap(),
        "the bad copy is deleted"
    );
    assert!(
        second.exists(&bad_key).await.unwrap(),
        "the good copy stays"
    );
    assert!(first.exists(&good_key).await.unwrap());
    assert_eq!(run.daemon.stats().entries, 2);
}

/// A path that holds something other than a socket is never replaced (before, a stale-socket
/// check removed whatever was there when nothing answered on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_at_the_socket_path_is_not_removed() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    std::fs::write(&path, b"an operator's file").unwrap();
    let daemon = Arc::new(
        PoolDaemon::with_tiers(options(MIB), vec![], tokio::runtime::Handle::current()).unwrap(),
    );
    let err = DaemonServer::bind(daemon, &path, SocketAccess::default())
        .err()
        .expect("refused");
    assert!(err.to_string().contains("not a socket"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"an operator's file");
}
