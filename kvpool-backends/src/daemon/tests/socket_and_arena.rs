//! The daemon's socket and arena as the operating system sees them: who may connect, what
//! is never replaced at the socket's path, the arena's descriptor closed on exec, addresses
//! outside the arena refused by the engine, and an accept thread that sleeps while idle.

use super::*;

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

/// This process's thread named `name` (as `comm` holds it: at most 15 bytes), once it exists
/// and sleeps: its `/proc` directory.
fn sleeping_thread(name: &str) -> PathBuf {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        for task in std::fs::read_dir("/proc/self/task").unwrap() {
            let task = task.unwrap().path();
            if std::fs::read_to_string(task.join("comm"))
                .unwrap_or_default()
                .trim()
                != name
            {
                continue;
            }
            let stat = std::fs::read_to_string(task.join("stat")).unwrap_or_default();
            // The state follows the parenthesised name: `S` for a sleep it chose.
            if stat
                .rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('S'))
            {
                return task;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no sleeping thread named {name}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The context switches so far of the thread at `task` (its `/proc` directory).
fn context_switches(task: &Path) -> u64 {
    let status = std::fs::read_to_string(task.join("status")).unwrap();
    status
        .lines()
        .filter_map(|l| {
            l.strip_prefix("voluntary_ctxt_switches:")
                .or_else(|| l.strip_prefix("nonvoluntary_ctxt_switches:"))
        })
        .map(|v| v.trim().parse::<u64>().unwrap())
        .sum()
}

/// An idle daemon's accept thread sleeps until an engine connects or the server stops: it
/// does not wake on a timer (before, it polled the socket every 20 ms, 50 wake-ups a second
/// on the cores an engine computes on), and it still accepts and stops at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_daemon_does_not_wake_and_still_accepts_and_stops_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let run = start(&path, 4 * MIB, vec![]);
    let accept = sleeping_thread("kvpool-daemon-a");
    let before = context_switches(&accept);
    std::thread::sleep(Duration::from_millis(300));
    let idle = context_switches(&accept) - before;
    // Polling every 20 ms, it switched some 15 times in 300 ms.
    assert!(
        idle <= 3,
        "the idle accept thread woke {idle} times in 300 ms"
    );
    let engine = client(&path);
    engine
        .batch_put(vec![("k".into(), value(3, 1024))])
        .await
        .unwrap();
    assert_eq!(
        engine.batch_get(&["k".to_string()]).await.unwrap(),
        vec![Some(value(3, 1024))]
    );
    let stopping = std::time::Instant::now();
    run.server.shutdown();
    assert!(
        stopping.elapsed() < Duration::from_secs(5),
        "shutdown took {:?}",
        stopping.elapsed()
    );
    assert!(!path.exists(), "the socket is removed");
}
