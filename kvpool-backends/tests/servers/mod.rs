//! Test-server plumbing shared by the tests that need a real server.
#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The value of `var`, or `None` after printing why the test is skipped. Under
/// `cargo xtask matrix` (`KVPOOL_MATRIX=1`) a missing server is a failure, not a skip.
pub fn server_url(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ => {
            assert!(
                std::env::var("KVPOOL_MATRIX").is_err(),
                "{var} must be set under `cargo xtask matrix`"
            );
            println!(
                "SKIP: {var} is not set; run `cargo xtask matrix` to test against a real server"
            );
            None
        }
    }
}

/// Waits until something accepts connections on 127.0.0.1:`port`; panics after `limit`.
pub fn wait_for_port(port: u16, what: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{what} did not listen on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A test server child process on 127.0.0.1, killed (by PID) on drop.
pub struct ServerProcess {
    pub port: u16,
    child: Child,
}

impl ServerProcess {
    fn spawn(command: &mut Command, port: u16, what: &str, limit: Duration) -> Self {
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{what} does not start: {e}"));
        let server = ServerProcess { port, child };
        wait_for_port(port, what, limit);
        server
    }

    /// redis-server `binary` on `port`, persistence off.
    pub fn redis(binary: &str, port: u16) -> Self {
        let mut cmd = Command::new(binary);
        cmd.args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]);
        Self::spawn(&mut cmd, port, "redis-server", Duration::from_secs(10))
    }

    /// moto_server `binary` (an S3-compatible server) on `port`, with `bucket` created.
    pub fn moto(binary: &str, port: u16, bucket: &str) -> Self {
        let mut cmd = Command::new(binary);
        cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()]);
        let server = Self::spawn(&mut cmd, port, "moto_server", Duration::from_secs(30));
        create_bucket(port, bucket);
        server
    }

    /// Kills the server and waits for it to exit.
    pub fn kill(self) {
        drop(self);
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Creates a bucket on a local S3-compatible server with a plain (unsigned) HTTP PUT.
pub fn create_bucket(port: u16, bucket: &str) {
    use std::io::{Read, Write};
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let attempt = (|| -> std::io::Result<String> {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
            write!(
                s,
                "PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )?;
            let mut reply = String::new();
            s.read_to_string(&mut reply)?;
            Ok(reply)
        })();
        match attempt {
            Ok(reply) if reply.starts_with("HTTP/1.1 200") || reply.starts_with("HTTP/1.0 200") => {
                return;
            }
            other => assert!(
                Instant::now() < deadline,
                "cannot create bucket {bucket}: {other:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A 3-node Redis cluster of child processes (no replicas), each killed by PID on drop.
pub struct RedisCluster {
    binary: String,
    dir: std::path::PathBuf,
    pub ports: Vec<u16>,
    nodes: Vec<Option<Child>>,
}

impl RedisCluster {
    /// Starts three nodes in `dir` and joins them with `redis-cli --cluster create`.
    pub fn start(binary: &str, cli: &str, dir: &std::path::Path) -> Self {
        let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let mut cluster = RedisCluster {
            binary: binary.to_string(),
            dir: dir.to_path_buf(),
            ports: ports.clone(),
            nodes: Vec::new(),
        };
        for i in 0..3 {
            let child = cluster.spawn_node(i);
            cluster.nodes.push(Some(child));
        }
        let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let status = Command::new(cli)
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli runs");
        assert!(status.success(), "redis-cli --cluster create failed");
        cluster.wait_ok(cli);
        cluster
    }

    fn spawn_node(&self, i: usize) -> Child {
        let port = self.ports[i];
        let conf = self.dir.join(format!("nodes-{port}.conf"));
        let child = Command::new(&self.binary)
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
            .arg("--cluster-config-file")
            .arg(&conf)
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        wait_for_port(port, "cluster node", Duration::from_secs(10));
        child
    }

    /// Waits until every node reports `cluster_state:ok`.
    pub fn wait_ok(&self, cli: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let all_ok = self.ports.iter().all(|p| {
                Command::new(cli)
                    .args(["-p", &p.to_string(), "cluster", "info"])
                    .output()
                    .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("cluster_state:ok"))
            });
            if all_ok {
                return;
            }
            assert!(Instant::now() < deadline, "cluster did not become ok");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The `redis+cluster://` URL of all nodes.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+cluster://{}", nodes.join(","))
    }

    /// Kills node `i`.
    pub fn kill_node(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Restarts node `i` on its port with its saved cluster config (it rejoins).
    pub fn restart_node(&mut self, i: usize) {
        let child = self.spawn_node(i);
        self.nodes[i] = Some(child);
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for c in self.nodes.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A small tmpfs mounted for one test (needs root), unmounted on drop.
pub struct TmpfsMount {
    pub path: std::path::PathBuf,
}

impl TmpfsMount {
    /// Mounts a tmpfs of `size` (e.g. "8m") at a fresh directory; `None` (with the reason
    /// printed) where mounting is not permitted. Under the matrix it must work.
    pub fn new(size: &str) -> Option<Self> {
        let path = std::env::temp_dir().join(format!(
            "kvpool-tmpfs-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&path).ok()?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&path)
            .output();
        match out {
            Ok(o) if o.status.success() => Some(TmpfsMount { path }),
            other => {
                let _ = std::fs::remove_dir(&path);
                let why = match other {
                    Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
                    Err(e) => e.to_string(),
                };
                assert!(
                    std::env::var("KVPOOL_MATRIX").is_err(),
                    "cannot mount a tmpfs under the matrix: {why}"
                );
                println!("SKIP: cannot mount a small tmpfs to fill ({why}); needs root");
                None
            }
        }
    }
}

impl Drop for TmpfsMount {
    /// Unmounts, retrying while the mount is briefly busy, then detaching it lazily (it is
    /// freed when its last user goes) so no mount outlives the test.
    fn drop(&mut self) {
        let unmounted = (0..20).any(|_| {
            let ok = Command::new("umount")
                .arg(&self.path)
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                std::thread::sleep(Duration::from_millis(50));
            }
            ok
        });
        if !unmounted {
            eprintln!("tmpfs {} busy; detaching it lazily", self.path.display());
            let _ = Command::new("umount").arg("-l").arg(&self.path).status();
        }
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// A Mooncake Store on 127.0.0.1 for tests: `mooncake_master` plus a segment-holder process
/// (so that values cross the TCP transport between processes), both killed by PID on drop.
/// `venv` holds the `mooncake-transfer-engine-non-cuda` wheel (`cargo xtask matrix` makes it).
pub struct MooncakeCluster {
    venv: std::path::PathBuf,
    pub master_port: u16,
    metrics_port: u16,
    master: Option<Child>,
    holder: Option<Child>,
}

impl MooncakeCluster {
    /// Starts a master and a holder contributing `segment_bytes`.
    pub fn start(venv: &str, segment_bytes: u64) -> Self {
        let mut cluster = MooncakeCluster {
            venv: venv.into(),
            master_port: free_port(),
            metrics_port: free_port(),
            master: None,
            holder: None,
        };
        cluster.start_master();
        let holder_script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/mooncake_segment_holder.py"
        );
        let mut holder = Command::new(cluster.venv.join("bin/python"))
            .args([
                holder_script,
                &cluster.master_address(),
                &segment_bytes.to_string(),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("the segment holder starts");
        let mut ready = String::new();
        use std::io::BufRead;
        std::io::BufReader::new(holder.stdout.take().unwrap())
            .read_line(&mut ready)
            .unwrap();
        assert_eq!(ready.trim(), "ready", "the segment holder did not mount");
        cluster.holder = Some(holder);
        cluster
    }

    /// `127.0.0.1:port` of the master.
    pub fn master_address(&self) -> String {
        format!("127.0.0.1:{}", self.master_port)
    }

    /// The wheel's site-packages, for the embedded client's `python_path`.
    pub fn site_packages(&self) -> std::path::PathBuf {
        Self::site_packages_of(&self.venv.display().to_string())
    }

    /// `venv`'s site-packages directory.
    pub fn site_packages_of(venv: &str) -> std::path::PathBuf {
        std::fs::read_dir(std::path::Path::new(venv).join("lib"))
            .unwrap()
            .map(|e| e.unwrap().path().join("site-packages"))
            .find(|p| p.is_dir())
            .expect("a site-packages directory in the venv")
    }

    /// Starts (or restarts) the master on the same ports; every address is loopback.
    pub fn start_master(&mut self) {
        let child = Command::new(self.venv.join("bin/mooncake_master"))
            .args([
                "--rpc_address=127.0.0.1".to_string(),
                format!("--rpc_port={}", self.master_port),
                "--metrics_host=127.0.0.1".to_string(),
                format!("--metrics_port={}", self.metrics_port),
                "--enable_http_metadata_server=false".to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mooncake_master starts");
        self.master = Some(child);
        wait_for_port(self.master_port, "mooncake_master", Duration::from_secs(20));
    }

    /// Kills the master (SIGKILL) and waits for it to exit.
    pub fn kill_master(&mut self) {
        if let Some(mut m) = self.master.take() {
            let _ = m.kill();
            let _ = m.wait();
        }
    }
}

impl Drop for MooncakeCluster {
    fn drop(&mut self) {
        for child in [self.holder.take(), self.master.take()]
            .into_iter()
            .flatten()
        {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
