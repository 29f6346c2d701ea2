//! `redis-server` on 127.0.0.1: standalone (optionally with a password or TLS) and a 3-node
//! cluster whose nodes can be killed and restarted.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::process::{Server, free_port};

/// Arguments for `redis-server` on `port` bound to 127.0.0.1, persistence off, plus `extra`.
pub fn redis_args(port: u16, extra: &[&str]) -> Vec<String> {
    let port = port.to_string();
    let base = [
        "--port",
        port.as_str(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ];
    base.iter().chain(extra).map(|s| s.to_string()).collect()
}

/// Runs `cli` (a `redis-cli`) with `args`; its standard output.
pub fn redis_cli(cli: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(cli)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {cli}: {e}"))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A self-signed certificate for 127.0.0.1 made with `openssl` in `dir`: (certificate, key).
pub fn self_signed_cert(dir: &Path) -> Result<(PathBuf, PathBuf), String> {
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let status = Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args([
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run openssl: {e}"))?;
    if !status.success() {
        return Err("openssl could not make a test certificate".into());
    }
    Ok((cert, key))
}

/// A Redis cluster of three nodes (no replicas) on 127.0.0.1, each killed by PID on drop.
pub struct RedisCluster {
    binary: String,
    dir: PathBuf,
    /// The nodes' ports.
    pub ports: Vec<u16>,
    nodes: Vec<Option<Server>>,
}

impl RedisCluster {
    /// Starts three nodes of `binary` (`redis-server`) with their files and logs in `dir`,
    /// joins them with `cli --cluster create`, and waits for `cluster_state:ok`.
    pub fn start(binary: &str, cli: &str, dir: &Path) -> Result<Self, String> {
        let ports = (0..3).map(|_| free_port()).collect::<Result<Vec<_>, _>>()?;
        let mut cluster = RedisCluster {
            binary: binary.to_string(),
            dir: dir.to_path_buf(),
            ports,
            nodes: Vec::new(),
        };
        for i in 0..3 {
            let node = cluster.spawn_node(i)?;
            cluster.nodes.push(Some(node));
        }
        let mut create = vec!["--cluster", "create"];
        let addrs = cluster.addresses();
        create.extend(addrs.iter().map(String::as_str));
        create.extend(["--cluster-replicas", "0", "--cluster-yes"]);
        redis_cli(cli, &create)?;
        cluster.wait_ok(cli)?;
        Ok(cluster)
    }

    fn addresses(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect()
    }

    fn spawn_node(&self, i: usize) -> Result<Server, String> {
        let port = self.ports[i];
        let conf = self.dir.join(format!("nodes-{port}.conf"));
        let dir = self.dir.display().to_string();
        let conf = conf.display().to_string();
        let args = redis_args(
            port,
            &[
                "--cluster-enabled",
                "yes",
                "--cluster-node-timeout",
                "1000",
                "--cluster-config-file",
                &conf,
                "--dir",
                &dir,
            ],
        );
        Server::start(
            &format!("redis cluster node {i}"),
            Command::new(&self.binary).args(&args),
            port,
            Some(&self.dir.join(format!("cluster-{i}.log"))),
            Duration::from_secs(10),
        )
    }

    /// Waits (30 s at most) until every node reports `cluster_state:ok`.
    pub fn wait_ok(&self, cli: &str) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let all_ok = self.ports.iter().all(|p| {
                redis_cli(cli, &["-p", &p.to_string(), "cluster", "info"])
                    .is_ok_and(|out| out.contains("cluster_state:ok"))
            });
            if all_ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err("the Redis cluster did not reach cluster_state:ok".into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The `redis+cluster://` URL of all nodes.
    pub fn url(&self) -> String {
        format!("redis+cluster://{}", self.addresses().join(","))
    }

    /// Kills node `i`.
    pub fn kill_node(&mut self, i: usize) {
        self.nodes[i] = None;
    }

    /// Restarts node `i` on its port with its saved cluster config (it rejoins).
    pub fn restart_node(&mut self, i: usize) -> Result<(), String> {
        self.nodes[i] = Some(self.spawn_node(i)?);
        Ok(())
    }
}
