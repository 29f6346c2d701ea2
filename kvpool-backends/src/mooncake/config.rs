//! `MooncakeConfig`: the tier URL's query options on top of Mooncake's own JSON configuration.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;

use kvpool_core::{ByteSize, ConfigError};

/// Settings of a Mooncake Store tier. Field names follow Mooncake's own JSON configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MooncakeConfig {
    /// `host:port` of `mooncake_master`'s RPC service.
    pub master_server_address: String,
    /// The address other nodes use to reach this process's transfer engine.
    pub local_hostname: String,
    /// `P2PHANDSHAKE` (no metadata service), `etcd://host:2379` or `http://host:8080/metadata`.
    pub metadata_server: String,
    /// `tcp` or `rdma`.
    pub protocol: String,
    /// RDMA device names (`mlx5_0,mlx5_1`); empty for TCP.
    pub device_name: String,
    /// Memory this process contributes to the cluster (0: a pure client).
    pub global_segment_size: u64,
    /// Mooncake's own transfer buffer inside this process.
    pub local_buffer_size: u64,
    /// Copies of each object.
    pub replica_num: u32,
    /// kvpool's registered staging arena, which bounds the bytes in flight.
    pub staging_bytes: u64,
    /// Directories added to the embedded Python's `sys.path` (where the wheel is installed).
    pub python_path: Vec<PathBuf>,
    /// Bound on connecting (setup).
    pub connect_timeout: Duration,
    /// The deadline of every call: past it the caller gets a timeout, the connector pauses
    /// for `retry_after`, and calls fail fast until Mooncake returns from the late call. The
    /// registry sets it just inside the tier's `timeout_ms`.
    pub call_timeout: Duration,
    /// After the cluster fails a call, calls fail fast for this long.
    pub retry_after: Duration,
}

impl Default for MooncakeConfig {
    fn default() -> Self {
        MooncakeConfig {
            master_server_address: String::new(),
            local_hostname: "127.0.0.1".into(),
            metadata_server: "P2PHANDSHAKE".into(),
            protocol: "tcp".into(),
            device_name: String::new(),
            global_segment_size: 0,
            local_buffer_size: 16 << 20,
            replica_num: 1,
            staging_bytes: 256 << 20,
            python_path: Vec::new(),
            connect_timeout: Duration::from_secs(20),
            call_timeout: Duration::from_secs(5),
            retry_after: Duration::from_secs(1),
        }
    }
}

/// Mooncake's JSON configuration file (extra fields, such as SSD offload, are ignored).
#[derive(Debug, Deserialize)]
pub(super) struct MooncakeJson {
    local_hostname: Option<String>,
    metadata_server: Option<String>,
    master_server_address: Option<String>,
    protocol: Option<String>,
    device_name: Option<String>,
    global_segment_size: Option<serde_json::Value>,
    local_buffer_size: Option<serde_json::Value>,
}

pub(super) fn invalid(reason: String) -> ConfigError {
    ConfigError::Invalid {
        field: "tier.url",
        reason,
    }
}

/// A size as Mooncake writes it (an integer, `"4gb"`, `"512MB"`) or as kvpool does (`"4GiB"`).
pub(super) fn parse_size(field: &str, value: &str) -> Result<u64, ConfigError> {
    let v = value.trim().to_ascii_lowercase();
    let kvpool_form = v
        .strip_suffix("gb")
        .map(|n| format!("{n}GiB"))
        .or_else(|| v.strip_suffix("mb").map(|n| format!("{n}MiB")))
        .or_else(|| v.strip_suffix("kb").map(|n| format!("{n}KiB")))
        .unwrap_or_else(|| value.trim().to_string());
    ByteSize::from_str(&kvpool_form)
        .map(|b| b.0)
        .map_err(|e| invalid(format!("mooncake `{field}` = `{value}`: {e}")))
}

pub(super) fn json_size(field: &str, value: &serde_json::Value) -> Result<u64, ConfigError> {
    match value {
        serde_json::Value::Number(n) => n
            .as_u64()
            .ok_or_else(|| invalid(format!("mooncake `{field}` must be a non-negative size"))),
        serde_json::Value::String(s) => parse_size(field, s),
        other => Err(invalid(format!(
            "mooncake `{field}` must be a number or a size string, not {other}"
        ))),
    }
}

impl MooncakeConfig {
    /// Applies Mooncake's JSON configuration file at `path`.
    pub fn apply_json_file(&mut self, path: &std::path::Path) -> Result<(), ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| invalid(format!("cannot read {}: {e}", path.display())))?;
        let json: MooncakeJson = serde_json::from_str(&text)
            .map_err(|e| invalid(format!("{} is not Mooncake JSON: {e}", path.display())))?;
        let set = |slot: &mut String, value: Option<String>| {
            if let Some(v) = value {
                *slot = v;
            }
        };
        set(&mut self.local_hostname, json.local_hostname);
        set(&mut self.metadata_server, json.metadata_server);
        set(&mut self.master_server_address, json.master_server_address);
        set(&mut self.protocol, json.protocol);
        set(&mut self.device_name, json.device_name);
        if let Some(v) = &json.global_segment_size {
            self.global_segment_size = json_size("global_segment_size", v)?;
        }
        if let Some(v) = &json.local_buffer_size {
            self.local_buffer_size = json_size("local_buffer_size", v)?;
        }
        Ok(())
    }

    /// Reads `mooncakestore://[master-host:port][?option=value&...]`. The JSON file named by
    /// `config=` (or else by `MOONCAKE_CONFIG_PATH`) is applied first; the URL's host and
    /// options override it. Options: `local_hostname`, `metadata_server`, `protocol`,
    /// `device_name`, `global_segment_size`, `local_buffer_size`, `replica_num`,
    /// `staging_size`, `python_path` (colon-separated), `config`.
    pub fn from_url(url: &str) -> Result<Self, ConfigError> {
        let rest = url.strip_prefix("mooncakestore://").ok_or_else(|| {
            invalid(format!(
                "`{url}` is not a Mooncake URL: use mooncakestore://master-host:50051"
            ))
        })?;
        let (authority, query) = rest.split_once('?').unwrap_or((rest, ""));
        let authority = authority.trim_end_matches('/');
        let mut options: Vec<(&str, &str)> = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| invalid(format!("mooncake option `{pair}` needs a value")))?;
            options.push((k, v));
        }
        let mut config = MooncakeConfig::default();
        let file = options
            .iter()
            .find(|(k, _)| *k == "config")
            .map(|(_, v)| PathBuf::from(v))
            .or_else(|| std::env::var_os("MOONCAKE_CONFIG_PATH").map(PathBuf::from));
        if let Some(file) = file {
            config.apply_json_file(&file)?;
        }
        if !authority.is_empty() {
            config.master_server_address = authority.to_string();
        }
        for (key, value) in options {
            match key {
                "config" => {}
                "local_hostname" => config.local_hostname = value.into(),
                "metadata_server" => config.metadata_server = value.into(),
                "protocol" => config.protocol = value.to_ascii_lowercase(),
                "device_name" => config.device_name = value.into(),
                "global_segment_size" => config.global_segment_size = parse_size(key, value)?,
                "local_buffer_size" => config.local_buffer_size = parse_size(key, value)?,
                "staging_size" => config.staging_bytes = parse_size(key, value)?,
                "replica_num" => {
                    config.replica_num = value
                        .parse()
                        .ok()
                        .filter(|n| *n >= 1)
                        .ok_or_else(|| invalid(format!("replica_num `{value}` must be >= 1")))?
                }
                "python_path" => config.python_path.extend(
                    value
                        .split(':')
                        .filter(|s| !s.is_empty())
                        .map(PathBuf::from),
                ),
                other => {
                    return Err(invalid(format!(
                        "unknown mooncake option `{other}`; known: local_hostname, \
                         metadata_server, protocol, device_name, global_segment_size, \
                         local_buffer_size, replica_num, staging_size, python_path, config"
                    )));
                }
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Rejects settings Mooncake would fail on later with a less helpful message.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.master_server_address.is_empty() {
            return Err(invalid(
                "no Mooncake master: use mooncakestore://host:port or set \
                 `master_server_address` in MOONCAKE_CONFIG_PATH's JSON"
                    .into(),
            ));
        }
        if !self.master_server_address.contains(':') {
            return Err(invalid(format!(
                "Mooncake master `{}` needs a port (mooncake_master's default is 50051)",
                self.master_server_address
            )));
        }
        match self.protocol.as_str() {
            "tcp" => {}
            "rdma" if !self.device_name.is_empty() => {}
            "rdma" => {
                return Err(invalid(
                    "protocol rdma needs device_name (e.g. mlx5_0, or auto-discovery)".into(),
                ));
            }
            other => {
                return Err(invalid(format!(
                    "Mooncake protocol `{other}`: kvpool supports tcp and rdma"
                )));
            }
        }
        if self.staging_bytes < 1 << 20 {
            return Err(invalid("staging_size must be at least 1MiB".into()));
        }
        Ok(())
    }
}
