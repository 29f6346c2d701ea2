//! Test servers on 127.0.0.1 for the matrix, the soak and the backend benchmarks, started by
//! the one harness (`kvpool-testservers`) that the backend tests use too.
//!
//! Redis comes from Debian's packages; the S3-compatible server is moto, from PyPI, in a
//! virtualenv under the target directory (installed once).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

pub(crate) use kvpool_testservers::{MooncakeCluster, RedisCluster, Server, free_port};
use kvpool_testservers::{create_bucket, redis_args, self_signed_cert, start_moto};

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

/// `redis-server` on `port` with `extra` arguments, its log in `log`.
pub(crate) fn start_redis(
    name: &str,
    port: u16,
    extra: &[&str],
    log: &Path,
) -> Result<Server, String> {
    let server = Server::start(
        name,
        Command::new("redis-server").args(redis_args(port, extra)),
        port,
        Some(log),
        Duration::from_secs(15),
    )?;
    eprintln!(
        "started {name} on 127.0.0.1:{port} (pid {}, log {})",
        server.pid(),
        log.display()
    );
    Ok(server)
}

/// moto on `port` with `bucket` created, its log in `log`.
pub(crate) fn start_moto_with_bucket(
    moto_server: &Path,
    port: u16,
    bucket: &str,
    log: &Path,
) -> Result<Server, String> {
    let server = start_moto(&moto_server.display().to_string(), port, Some(log))?;
    eprintln!(
        "started moto (S3) on 127.0.0.1:{port} (pid {}, log {})",
        server.pid(),
        log.display()
    );
    create_bucket(port, bucket)?;
    Ok(server)
}

/// Everything the matrix started, and the environment the tests read.
pub(crate) struct Servers {
    _running: Vec<Server>,
    _cluster: RedisCluster,
    /// Variables the tests and benchmarks read (URLs, credentials).
    pub env: Vec<(String, String)>,
}

pub(crate) fn start_servers(dir: &Path, moto_server: &Path) -> Result<Servers, String> {
    let mut running = Vec::new();
    let mut env = Vec::new();
    let redis_server = which("redis-server")?.display().to_string();
    let redis_cli = which("redis-cli")?.display().to_string();
    env.push(("KVPOOL_TEST_REDIS_SERVER".into(), redis_server.clone()));
    env.push(("KVPOOL_TEST_REDIS_CLI".into(), redis_cli.clone()));

    // Standalone, password-protected.
    let port = free_port()?;
    running.push(start_redis(
        "redis standalone",
        port,
        &["--requirepass", "kvpool-test"],
        &dir.join("redis.log"),
    )?);
    env.push((
        "KVPOOL_TEST_REDIS_URL".into(),
        format!("redis://:kvpool-test@127.0.0.1:{port}"),
    ));

    // A 3-node cluster.
    let cluster = RedisCluster::start(&redis_server, &redis_cli, dir)?;
    eprintln!(
        "started a 3-node redis cluster on ports {:?}",
        cluster.ports
    );
    env.push(("KVPOOL_TEST_REDIS_CLUSTER_URL".into(), cluster.url()));

    // TLS with a self-signed certificate made here.
    let (cert, key) = self_signed_cert(dir)?;
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let port = free_port()?;
    let tls_port = port.to_string();
    let tls = Server::start(
        "redis tls",
        Command::new("redis-server").args(redis_args(
            0,
            &[
                "--tls-port",
                &tls_port,
                "--tls-cert-file",
                &cert,
                "--tls-key-file",
                &key,
                "--tls-ca-cert-file",
                &cert,
                "--tls-auth-clients",
                "no",
            ],
        )),
        port,
        Some(&dir.join("redis-tls.log")),
        Duration::from_secs(15),
    )?;
    eprintln!("started redis tls on 127.0.0.1:{port} (pid {})", tls.pid());
    running.push(tls);
    env.push((
        "KVPOOL_TEST_REDIS_TLS_URL".into(),
        format!("rediss://127.0.0.1:{port}/#insecure"),
    ));

    // S3: moto.
    let port = free_port()?;
    running.push(start_moto_with_bucket(
        moto_server,
        port,
        "kvpool-test",
        &dir.join("moto.log"),
    )?);
    for (k, v) in [
        ("KVPOOL_TEST_S3_URL", "s3://kvpool-test/matrix".to_string()),
        (
            "KVPOOL_TEST_S3_ENDPOINT",
            format!("http://127.0.0.1:{port}"),
        ),
        ("KVPOOL_TEST_MOTO_SERVER", moto_server.display().to_string()),
        ("AWS_ACCESS_KEY_ID", "kvpool-test".to_string()),
        ("AWS_SECRET_ACCESS_KEY", "kvpool-test".to_string()),
        ("AWS_REGION", "us-east-1".to_string()),
    ] {
        env.push((k.to_string(), v));
    }
    Ok(Servers {
        _running: running,
        _cluster: cluster,
        env,
    })
}

/// A Mooncake Store on loopback (a master and a 1 GiB segment holder), logs in `dir`.
pub(crate) fn start_mooncake(dir: &Path, venv: &Path) -> Result<MooncakeCluster, String> {
    let cluster = MooncakeCluster::start(venv, 1 << 30, Some(dir))?;
    eprintln!(
        "started a Mooncake master on {} and a segment holder",
        cluster.master_address()
    );
    Ok(cluster)
}

/// Creates `venv` (on the system's `python3`) with `requirement` installed, once, with uv
/// from the tool virtualenv (a cold install of moto's dependencies took pip about a minute).
fn ensure_venv(venv: &Path, requirement: &str, marker: &str) -> Result<(), String> {
    if venv.join(marker).exists() {
        return Ok(());
    }
    let python = which("python3")?;
    let tools = crate::python_env::ensure_tools(&crate::python_env::python312()?)?;
    let uv = tools.join("uv").display().to_string();
    let venv_str = venv.display().to_string();
    run(
        &uv,
        &[
            "venv",
            "--clear",
            "--python",
            &python.display().to_string(),
            &venv_str,
        ],
    )?;
    crate::run_with_env(
        &uv,
        &["pip", "install", "--quiet", requirement],
        &[("VIRTUAL_ENV", venv_str.as_str())],
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
