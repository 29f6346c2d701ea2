//! Test servers on 127.0.0.1 for the matrix and the backend benchmarks, stopped by PID.
//!
//! Redis comes from Debian's packages; the S3-compatible server is moto, from PyPI, in a
//! virtualenv under the target directory (installed once).

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{ensure_system_packages, run};

/// Debian packages the servers need.
/// (`libibverbs1`: Mooncake's transfer engine links it even for TCP.)
pub(crate) const SERVER_PACKAGES: &[&str] = &[
    "redis-server",
    "redis-tools",
    "openssl",
    "libibverbs1",
    "iproute2",
];

/// The S3-compatible test server, installed from PyPI into a virtualenv under `target/`.
const MOTO_REQUIREMENT: &str = "moto[server]==5.2.5";

/// Mooncake Store: `mooncake_master` and the Python client, from PyPI.
const MOONCAKE_REQUIREMENT: &str = "mooncake-transfer-engine-non-cuda==0.3.13.post1";

/// A server process, stopped by PID when dropped.
pub(crate) struct Server {
    name: String,
    child: Child,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        eprintln!("stopped {} (pid {})", self.name, self.child.id());
    }
}

pub(crate) fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port: {e}"))?;
    Ok(listener.local_addr().map_err(|e| e.to_string())?.port())
}

fn wait_for_port(port: u16, name: &str) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(15);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return Err(format!("{name} did not listen on 127.0.0.1:{port}"));
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    Ok(())
}

pub(crate) fn start(
    name: &str,
    program: &str,
    args: &[String],
    log: &Path,
    port: u16,
) -> Result<Server, String> {
    let out =
        std::fs::File::create(log).map_err(|e| format!("cannot create {}: {e}", log.display()))?;
    let child = Command::new(program)
        .args(args)
        .stdout(out.try_clone().map_err(|e| e.to_string())?)
        .stderr(out)
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {program}: {e}"))?;
    let server = Server {
        name: name.to_string(),
        child,
    };
    wait_for_port(port, name)?;
    eprintln!(
        "started {name} on 127.0.0.1:{port} (pid {}, log {})",
        server.child.id(),
        log.display()
    );
    Ok(server)
}

pub(crate) fn redis_args(port: u16, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn redis_cli(args: &[&str]) -> Result<String, String> {
    let out = Command::new("redis-cli")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run redis-cli: {e}"))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Everything the matrix started, and the environment the tests read.
pub(crate) struct Servers {
    _running: Vec<Server>,
    /// Variables the tests and benchmarks read (URLs, credentials).
    pub env: Vec<(String, String)>,
}

pub(crate) fn start_servers(dir: &Path, moto_server: &Path) -> Result<Servers, String> {
    let mut running = Vec::new();
    let mut env = vec![("KVPOOL_MATRIX".to_string(), "1".to_string())];
    let redis_server = which("redis-server")?;
    env.push((
        "KVPOOL_TEST_REDIS_SERVER".into(),
        redis_server.display().to_string(),
    ));
    env.push((
        "KVPOOL_TEST_REDIS_CLI".into(),
        which("redis-cli")?.display().to_string(),
    ));

    // Standalone, password-protected.
    let port = free_port()?;
    running.push(start(
        "redis standalone",
        "redis-server",
        &redis_args(port, &["--requirepass", "kvpool-test"]),
        &dir.join("redis.log"),
        port,
    )?);
    env.push((
        "KVPOOL_TEST_REDIS_URL".into(),
        format!("redis://:kvpool-test@127.0.0.1:{port}"),
    ));

    // A 3-node cluster.
    let mut nodes = Vec::new();
    for i in 0..3 {
        let port = free_port()?;
        let conf = dir.join(format!("nodes-{port}.conf")).display().to_string();
        let node_dir = dir.display().to_string();
        running.push(start(
            &format!("redis cluster node {i}"),
            "redis-server",
            &redis_args(
                port,
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &conf,
                    "--dir",
                    &node_dir,
                ],
            ),
            &dir.join(format!("cluster-{i}.log")),
            port,
        )?);
        nodes.push(format!("127.0.0.1:{port}"));
    }
    let mut create = vec!["--cluster", "create"];
    create.extend(nodes.iter().map(String::as_str));
    create.extend(["--cluster-replicas", "0", "--cluster-yes"]);
    redis_cli(&create)?;
    let first_port = nodes[0].rsplit(':').next().unwrap_or_default().to_string();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !redis_cli(&["-p", &first_port, "cluster", "info"])?.contains("cluster_state:ok") {
        if Instant::now() > deadline {
            return Err("the redis cluster did not reach cluster_state:ok".into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    env.push((
        "KVPOOL_TEST_REDIS_CLUSTER_URL".into(),
        format!("redis+cluster://{}", nodes.join(",")),
    ));

    // TLS with a self-signed certificate made here.
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let status = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
        ])
        .args(["-addext", "subjectAltName=IP:127.0.0.1"])
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
    let port = free_port()?;
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    running.push(start(
        "redis tls",
        "redis-server",
        &redis_args(
            0,
            &[
                "--tls-port",
                &port.to_string(),
                "--tls-cert-file",
                &cert,
                "--tls-key-file",
                &key,
                "--tls-ca-cert-file",
                &cert,
                "--tls-auth-clients",
                "no",
            ],
        ),
        &dir.join("redis-tls.log"),
        port,
    )?);
    env.push((
        "KVPOOL_TEST_REDIS_TLS_URL".into(),
        format!("rediss://127.0.0.1:{port}/#insecure"),
    ));

    // S3: moto.
    let port = free_port()?;
    let moto = moto_server.display().to_string();
    running.push(start(
        "moto (S3)",
        &moto,
        &[
            "-H".to_string(),
            "127.0.0.1".to_string(),
            "-p".to_string(),
            port.to_string(),
        ],
        &dir.join("moto.log"),
        port,
    )?);
    create_bucket(port, "kvpool-test")?;
    for (k, v) in [
        ("KVPOOL_TEST_S3_URL", "s3://kvpool-test/matrix".to_string()),
        (
            "KVPOOL_TEST_S3_ENDPOINT",
            format!("http://127.0.0.1:{port}"),
        ),
        ("KVPOOL_TEST_MOTO_SERVER", moto),
        ("AWS_ACCESS_KEY_ID", "kvpool-test".to_string()),
        ("AWS_SECRET_ACCESS_KEY", "kvpool-test".to_string()),
        ("AWS_REGION", "us-east-1".to_string()),
    ] {
        env.push((k.to_string(), v));
    }
    Ok(Servers {
        _running: running,
        env,
    })
}

/// A Mooncake Store on loopback: `mooncake_master` and a segment holder (a separate process,
/// so that values cross the TCP transport). Returns the processes and the master's address.
pub(crate) fn start_mooncake(dir: &Path, venv: &Path) -> Result<(Vec<Server>, String), String> {
    use std::io::BufRead;
    let (port, metrics_port) = (free_port()?, free_port()?);
    let master = start(
        "mooncake_master",
        &venv.join("bin/mooncake_master").display().to_string(),
        &[
            "--rpc_address=127.0.0.1".to_string(),
            format!("--rpc_port={port}"),
            "--metrics_host=127.0.0.1".to_string(),
            format!("--metrics_port={metrics_port}"),
            "--enable_http_metadata_server=false".to_string(),
        ],
        &dir.join("mooncake-master.log"),
        port,
    )?;
    let address = format!("127.0.0.1:{port}");
    let script = crate::workspace_root().join("kvpool-backends/tests/mooncake_segment_holder.py");
    let mut child = Command::new(venv.join("bin/python"))
        .arg(&script)
        .args([address.as_str(), "1073741824"])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join("mooncake-holder.log")).map_err(|e| e.to_string())?)
        .spawn()
        .map_err(|e| format!("cannot start the Mooncake segment holder: {e}"))?;
    let mut ready = String::new();
    let stdout = child.stdout.take().ok_or("no holder stdout")?;
    let _ = std::io::BufReader::new(stdout).read_line(&mut ready);
    let holder = Server {
        name: "mooncake segment holder".into(),
        child,
    };
    if ready.trim() != "ready" {
        return Err(format!(
            "the Mooncake segment holder did not mount (see {})",
            dir.join("mooncake-holder.log").display()
        ));
    }
    eprintln!(
        "started mooncake segment holder (pid {})",
        holder.child.id()
    );
    // The holder is dropped (stopped) first.
    Ok((vec![holder, master], address))
}

/// Creates `venv` with `requirement` installed, once; returns the venv path.
fn ensure_venv(venv: &Path, requirement: &str, marker: &str) -> Result<(), String> {
    if venv.join(marker).exists() {
        return Ok(());
    }
    let venv_str = venv.display().to_string();
    run("python3", &["-m", "venv", &venv_str])?;
    let pip = venv.join("bin/pip").display().to_string();
    run(
        &pip,
        &[
            "install",
            "--quiet",
            "--disable-pip-version-check",
            requirement,
        ],
    )?;
    if !venv.join(marker).exists() {
        return Err(format!("{requirement} installed no {marker} in {venv_str}"));
    }
    Ok(())
}

/// Installs moto into `target/moto-venv` once; returns the `moto_server` path.
pub(crate) fn ensure_moto(target_dir: &Path) -> Result<PathBuf, String> {
    let venv = target_dir.join("moto-venv");
    ensure_venv(&venv, MOTO_REQUIREMENT, "bin/moto_server")?;
    Ok(venv.join("bin/moto_server"))
}

/// Installs Mooncake's wheel into `target/mooncake-venv` once; returns the venv.
pub(crate) fn ensure_mooncake(target_dir: &Path) -> Result<PathBuf, String> {
    let venv = target_dir.join("mooncake-venv");
    ensure_venv(&venv, MOONCAKE_REQUIREMENT, "bin/mooncake_master")?;
    Ok(venv)
}

/// Creates a bucket on the local S3-compatible server with a plain (unsigned) HTTP PUT.
pub(crate) fn create_bucket(port: u16, bucket: &str) -> Result<(), String> {
    use std::io::{Read, Write};
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    write!(s, "PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut reply = String::new();
    s.read_to_string(&mut reply).map_err(|e| e.to_string())?;
    if reply.starts_with("HTTP/1.1 200") {
        Ok(())
    } else {
        Err(format!(
            "creating bucket {bucket} failed: {}",
            reply.lines().next().unwrap_or("")
        ))
    }
}

fn which(program: &str) -> Result<PathBuf, String> {
    let out = Command::new("which")
        .arg(program)
        .output()
        .map_err(|e| format!("cannot run which: {e}"))?;
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if path.is_empty() {
        return Err(format!("{program} not found on PATH"));
    }
    Ok(PathBuf::from(path))
}

/// What the servers are started from.
pub(crate) struct Prepared {
    /// moto's `moto_server`.
    pub moto_server: PathBuf,
    /// The virtualenv holding `mooncake_master` and the Mooncake Python client.
    pub mooncake_venv: PathBuf,
}

/// Installs what the servers need (Debian packages, moto, Mooncake).
pub(crate) fn prepare() -> Result<Prepared, String> {
    ensure_system_packages(SERVER_PACKAGES)?;
    let target_dir = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| crate::workspace_root().join("target"));
    Ok(Prepared {
        moto_server: ensure_moto(&target_dir)?,
        mooncake_venv: ensure_mooncake(&target_dir)?,
    })
}

/// A fresh scratch directory for server files and logs.
pub(crate) fn scratch_dir(purpose: &str) -> Result<PathBuf, String> {
    let dir = std::env::temp_dir().join(format!("kvpool-{purpose}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    Ok(dir)
}
