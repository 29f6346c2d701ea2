//! `kvpool serve` restarted inside a memory cgroup of 1.5 times its arena while an engine is
//! attached: the new daemon must start and serve, not be killed for the old arena the engine
//! still maps. Needs root and a writable memory cgroup (v1 or v2): `#[ignore]`d, run by
//! `cargo xtask ci`, and failing where it has neither.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvpool_backends::daemon::DaemonConnector;
use kvpool_core::{NodeMemoryConnector, RemoteConnector};

const ARENA: u64 = 256 << 20;
const LIMIT: u64 = ARENA * 3 / 2;

/// A memory cgroup of its own, removed on drop (its processes killed first).
struct MemoryCgroup {
    dir: PathBuf,
}

impl MemoryCgroup {
    /// A cgroup limited to `limit` bytes of memory and no swap, or `None` where this machine
    /// gives us none (not root, no memory controller).
    fn create(limit: u64) -> Option<Self> {
        let name = format!("kvpool-test-{}", std::process::id());
        let v1 = Path::new("/sys/fs/cgroup/memory");
        let v2 = Path::new("/sys/fs/cgroup");
        let (dir, files): (PathBuf, [&str; 2]) = if v1.join("memory.limit_in_bytes").exists() {
            (
                v1.join(&name),
                ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"],
            )
        } else if std::fs::read_to_string(v2.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|c| c == "memory"))
        {
            let _ = std::fs::write(v2.join("cgroup.subtree_control"), "+memory");
            (v2.join(&name), ["memory.max", "memory.swap.max"])
        } else {
            return None;
        };
        std::fs::create_dir(&dir).ok()?;
        let cgroup = MemoryCgroup { dir };
        std::fs::write(cgroup.dir.join(files[0]), limit.to_string()).ok()?;
        // No swap to spill into: over the limit is a kill, as under systemd's MemoryMax=.
        let swap = if files[1] == "memory.swap.max" {
            0
        } else {
            limit
        };
        if cgroup.dir.join(files[1]).exists() {
            std::fs::write(cgroup.dir.join(files[1]), swap.to_string()).ok()?;
        }
        Some(cgroup)
    }

    /// `kvpool serve` on `socket` with an arena of [`ARENA`], started inside this cgroup.
    fn spawn_serve(&self, socket: &Path) -> Child {
        Command::new("sh")
            .arg("-c")
            .arg(r#"echo $$ > "$0/cgroup.procs" && exec "$@""#)
            .arg(&self.dir)
            .arg(env!("CARGO_BIN_EXE_kvpool"))
            .args(["serve", "--cpu-size", &format!("{}MiB", ARENA >> 20)])
            .arg("--socket")
            .arg(socket)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    fn read(&self, file: &str) -> String {
        std::fs::read_to_string(self.dir.join(file)).unwrap_or_default()
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        for pid in self.read("cgroup.procs").lines() {
            if let Ok(pid) = pid.trim().parse::<i32>() {
                // SAFETY: kills a process this test started in its own cgroup.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Waits until `socket` accepts connections (the daemon committed its arena and listens), or
/// the daemon exits.
fn wait_listening(serve: &mut Child, socket: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::os::unix::net::UnixStream::connect(socket).is_err() {
        if let Some(status) = serve.try_wait().unwrap() {
            panic!("the daemon exited before listening: {status}");
        }
        assert!(Instant::now() < deadline, "the daemon never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn value(i: usize) -> Bytes {
    Bytes::from(vec![i as u8; 1 << 20])
}

#[test]
#[ignore = "needs root and a memory cgroup; `cargo xtask ci` runs it"]
fn a_daemon_restarts_in_a_cgroup_of_one_and_a_half_arenas_while_an_engine_maps_the_old_one() {
    let cgroup = MemoryCgroup::create(LIMIT).expect(
        "no writable memory cgroup: this test needs root and cgroup v1 or v2's memory controller",
    );
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvpool.sock");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();

    let mut first = cgroup.spawn_serve(&socket);
    wait_listening(&mut first, &socket);
    let engine = DaemonConnector::new(&socket, Duration::from_secs(5));
    // The engine is reading a value out of the arena when the daemon dies: its pin keeps
    // the old arena mapped, and so charged to the daemon's cgroup, across the restart.
    let pinned = runtime.block_on(async {
        engine
            .batch_put(vec![("k".into(), value(1))])
            .await
            .unwrap();
        engine.batch_pin(&["k".to_string()]).await.unwrap()
    });
    assert!(pinned[0].is_some());

    first.kill().unwrap();
    first.wait().unwrap();
    let mut second = cgroup.spawn_serve(&socket);
    wait_listening(&mut second, &socket);
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        second.try_wait().unwrap().is_none(),
        "the restarted daemon was killed (memory.failcnt {}): it took a whole arena while the \
         old one was still charged to its cgroup",
        cgroup.read("memory.failcnt").trim()
    );

    // The engine lets the old arena go, then fills the new one to the brim through the new
    // daemon: the pages it did not commit at start are taken now, within the limit.
    drop(pinned);
    runtime.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(15);
        while engine
            .batch_put(vec![("k".into(), value(2))])
            .await
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "the engine never reached the new daemon"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for i in 0..(ARENA >> 20) as usize {
            engine
                .batch_put(vec![(format!("fill-{i}"), value(i))])
                .await
                .unwrap();
        }
        let latest = format!("fill-{}", (ARENA >> 20) - 2);
        let got = engine
            .batch_get(std::slice::from_ref(&latest))
            .await
            .unwrap();
        assert_eq!(
            got[0].as_deref(),
            Some(&value((ARENA >> 20) as usize - 2)[..])
        );
    });
    assert!(
        second.try_wait().unwrap().is_none(),
        "the restarted daemon was killed filling its arena (memory.failcnt {})",
        cgroup.read("memory.failcnt").trim()
    );
    second.kill().unwrap();
    let out = second.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        log.contains("committed only part of the pool's shared memory at start"),
        "{log}"
    );
}
