//! A Mooncake Store on 127.0.0.1: `mooncake_master` plus a segment-holder process (so values
//! cross the TCP transport between processes), from a virtualenv holding Mooncake's wheel.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::process::{Server, free_port};

/// The Python script that mounts a segment and holds it until killed.
const SEGMENT_HOLDER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/mooncake_segment_holder.py");

/// A master and a segment holder, both killed by PID on drop (the holder first).
pub struct MooncakeCluster {
    venv: PathBuf,
    logs: Option<PathBuf>,
    /// The master's RPC port.
    pub master_port: u16,
    metrics_port: u16,
    holder: Option<Server>,
    master: Option<Server>,
}

impl MooncakeCluster {
    /// Starts a master and a holder contributing `segment_bytes`, from `venv` (which holds
    /// the `mooncake-transfer-engine-non-cuda` wheel). Logs go to `logs` when given.
    pub fn start(venv: &Path, segment_bytes: u64, logs: Option<&Path>) -> Result<Self, String> {
        let mut cluster = MooncakeCluster {
            venv: venv.to_path_buf(),
            logs: logs.map(Path::to_path_buf),
            master_port: free_port()?,
            metrics_port: free_port()?,
            holder: None,
            master: None,
        };
        cluster.start_master()?;
        let stderr = match &cluster.logs {
            Some(dir) => Stdio::from(
                std::fs::File::create(dir.join("mooncake-holder.log"))
                    .map_err(|e| e.to_string())?,
            ),
            None => Stdio::null(),
        };
        let mut child = Command::new(cluster.venv.join("bin/python"))
            .arg(SEGMENT_HOLDER)
            .args([cluster.master_address(), segment_bytes.to_string()])
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("cannot start the Mooncake segment holder: {e}"))?;
        let stdout = child.stdout.take().ok_or("no segment holder stdout")?;
        let holder = Server::adopt("mooncake segment holder", 0, child);
        let mut ready = String::new();
        let _ = std::io::BufReader::new(stdout).read_line(&mut ready);
        if ready.trim() != "ready" {
            return Err("the Mooncake segment holder did not mount its segment".into());
        }
        cluster.holder = Some(holder);
        Ok(cluster)
    }

    /// `127.0.0.1:port` of the master.
    pub fn master_address(&self) -> String {
        format!("127.0.0.1:{}", self.master_port)
    }

    /// The wheel's site-packages, for the embedded client's `python_path`.
    pub fn site_packages(&self) -> Result<PathBuf, String> {
        Self::site_packages_of(&self.venv)
    }

    /// `venv`'s site-packages directory.
    pub fn site_packages_of(venv: &Path) -> Result<PathBuf, String> {
        std::fs::read_dir(venv.join("lib"))
            .map_err(|e| format!("{}: {e}", venv.display()))?
            .filter_map(Result::ok)
            .map(|e| e.path().join("site-packages"))
            .find(|p| p.is_dir())
            .ok_or_else(|| format!("no site-packages in {}", venv.display()))
    }

    /// Starts (or restarts) the master on the same ports; every address is loopback.
    pub fn start_master(&mut self) -> Result<(), String> {
        let log = self.logs.as_ref().map(|d| d.join("mooncake-master.log"));
        let master = Server::start(
            "mooncake_master",
            Command::new(self.venv.join("bin/mooncake_master")).args([
                "--rpc_address=127.0.0.1".to_string(),
                format!("--rpc_port={}", self.master_port),
                "--metrics_host=127.0.0.1".to_string(),
                format!("--metrics_port={}", self.metrics_port),
                "--enable_http_metadata_server=false".to_string(),
            ]),
            self.master_port,
            log.as_deref(),
            Duration::from_secs(20),
        )?;
        self.master = Some(master);
        Ok(())
    }

    /// Kills the master (SIGKILL) and waits for it to exit.
    pub fn kill_master(&mut self) {
        self.master = None;
    }
}

impl Drop for MooncakeCluster {
    fn drop(&mut self) {
        self.holder = None;
        self.master = None;
    }
}
