//! `mooncakestore://master:port`: Mooncake Store as a remote tier, behind a small client trait.
//!
//! The connector owns a staging arena registered with Mooncake's transfer engine: values are
//! copied into it once before `batch_upsert_from`, and `batch_get_into` lands values in it
//! directly, where they are handed out as [`Bytes`] without another copy. The client itself is a
//! [`MooncakeStoreClient`]; today that is [`PythonStoreClient`](crate::mooncake_python::PythonStoreClient)
//! (the Python extension from Mooncake's wheel, embedded), and a client over Mooncake's C API
//! can take its place without touching this module.
//!
//! Configuration comes from the tier URL, optionally on top of the JSON file Mooncake users
//! already keep (`MOONCAKE_CONFIG_PATH`, or `config=` in the URL):
//!
//! ```text
//! mooncakestore://10.0.0.5:50051?metadata_server=P2PHANDSHAKE&protocol=tcp&local_hostname=10.0.0.7
//! mooncakestore://10.0.0.5:50051?protocol=rdma&device_name=mlx5_0,mlx5_1&replica_num=2
//! mooncakestore://?config=/etc/mooncake.json
//! ```

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use serde::Deserialize;
use tracing::{debug, warn};

use crate::registry::{BackendFactory, TierRequest};
use kvpool_core::{
    BackendError, ByteSize, ConfigError, HeapAllocator, HostAllocator, HostArena, MemoryObjMut,
    MemoryPool, PoolError, RemoteConnector,
};

/// Mooncake's success code.
const OK: i64 = 0;
/// `INVALID_PARAMS`: also what `get_into` answers when the buffer is smaller than the object.
const BUFFER_TOO_SMALL: i64 = -600;
/// `OBJECT_NOT_FOUND`.
const OBJECT_NOT_FOUND: i64 = -704;
/// How often a put that raced another writer of the same key is retried.
const PUT_RACE_RETRIES: u32 = 6;

/// What a Mooncake store error code means (codes from `mooncake-store/include/types.h`).
pub fn describe_code(code: i64) -> &'static str {
    match code {
        0 => "ok",
        -1 => "internal error",
        -10 => "buffer overflow",
        -100 => "shard index out of range",
        -101 => "segment not found",
        -102 => "segment already exists",
        -200 => "no space: no segment mounted or all segments full",
        -300 => "invalid version",
        -400 => "invalid key",
        -500 => "write failed",
        -600 => "invalid parameters (or the buffer is smaller than the object)",
        -700 => "invalid write",
        -701 => "invalid read",
        -702 => "invalid replica",
        -703 => "replica not ready",
        -704 => "object not found",
        -705 => "object already exists",
        -706 => "object has a lease",
        -800 => "transfer failed",
        -900 => "RPC to the master failed",
        c if c <= -1000 && c > -1100 => "metadata (etcd/HTTP) error",
        _ => "unknown error",
    }
}

/// Codes that mean the cluster, not the object, is in trouble: the connector stops calling
/// for [`MooncakeConfig::retry_after`] so that callers get fast misses instead of stalls.
fn is_cluster_failure(code: i64) -> bool {
    matches!(code, -900 | -800 | -101 | -200) || (code <= -1000 && code > -1100)
}

/// A buffer handed to the client: `len` bytes at `ptr`, inside registered memory.
#[derive(Debug, Clone, Copy)]
pub struct RawBuffer {
    /// Start of the buffer.
    pub ptr: *mut u8,
    /// Its length in bytes.
    pub len: usize,
}

// SAFETY: a plain address; whoever dereferences it upholds the client's safety contract.
unsafe impl Send for RawBuffer {}

/// The operations kvpool needs from a Mooncake Store client. Calls block; return codes are
/// Mooncake's (0 or a byte count on success, negative codes per key); `Err` means the client
/// itself failed (an exception, a dead interpreter).
pub trait MooncakeStoreClient: Send + Sync + 'static {
    /// Short name for logs.
    fn name(&self) -> &str;
    /// Registers memory for zero-copy transfers.
    ///
    /// # Safety
    /// `buffer` must stay allocated for as long as the client is used.
    unsafe fn register_buffer(&self, buffer: RawBuffer) -> Result<i64, String>;
    /// Writes each buffer under its key, replacing what was there.
    ///
    /// # Safety
    /// Every buffer must be readable for its length and inside registered memory.
    unsafe fn batch_upsert_from(
        &self,
        keys: &[String],
        buffers: &[RawBuffer],
    ) -> Result<Vec<i64>, String>;
    /// Reads each key into its buffer; per key the byte count or a negative code.
    ///
    /// # Safety
    /// Every buffer must be writable for its length, unaliased, and inside registered memory.
    unsafe fn batch_get_into(
        &self,
        keys: &[String],
        buffers: &[RawBuffer],
    ) -> Result<Vec<i64>, String>;
    /// The stored size of `key`, or a negative code.
    fn get_size(&self, key: &str) -> Result<i64, String>;
    /// Per key: 1 present, 0 absent, negative on error.
    fn batch_is_exist(&self, keys: &[String]) -> Result<Vec<i64>, String>;
    /// Removes keys regardless of leases; per key 0 or a negative code.
    fn batch_remove(&self, keys: &[String]) -> Result<Vec<i64>, String>;
    /// Disconnects; later calls fail.
    fn close(&self) -> Result<i64, String>;
}

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
            retry_after: Duration::from_secs(1),
        }
    }
}

/// Mooncake's JSON configuration file (extra fields, such as SSD offload, are ignored).
#[derive(Debug, Deserialize)]
struct MooncakeJson {
    local_hostname: Option<String>,
    metadata_server: Option<String>,
    master_server_address: Option<String>,
    protocol: Option<String>,
    device_name: Option<String>,
    global_segment_size: Option<serde_json::Value>,
    local_buffer_size: Option<serde_json::Value>,
}

fn invalid(reason: String) -> ConfigError {
    ConfigError::Invalid {
        field: "tier.url",
        reason,
    }
}

/// A size as Mooncake writes it (an integer, `"4gb"`, `"512MB"`) or as kvpool does (`"4GiB"`).
fn parse_size(field: &str, value: &str) -> Result<u64, ConfigError> {
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

fn json_size(field: &str, value: &serde_json::Value) -> Result<u64, ConfigError> {
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

/// Heap arenas registered with the client as they are made, so every staging buffer is
/// transferable.
struct RegisteringAllocator {
    client: Arc<dyn MooncakeStoreClient>,
}

impl HostAllocator for RegisteringAllocator {
    fn name(&self) -> &str {
        "mooncake-registered"
    }

    fn allocate_arena(&self, bytes: usize) -> Result<Box<dyn HostArena>, PoolError> {
        let arena = HeapAllocator.allocate_arena(bytes)?;
        let buffer = RawBuffer {
            ptr: arena.as_ptr().as_ptr(),
            len: bytes,
        };
        // SAFETY: the arena lives as long as the pool, which the connector keeps as long as
        // the client.
        let code = unsafe { self.client.register_buffer(buffer) };
        match code {
            Ok(OK) => Ok(arena),
            other => {
                warn!(result = ?other, "Mooncake refused to register the staging arena");
                Err(PoolError::OutOfMemory {
                    requested: bytes,
                    free: 0,
                    largest: 0,
                })
            }
        }
    }
}

struct Inner {
    // Field order matters: the client (and its registrations) goes before the staging memory.
    client: Arc<dyn MooncakeStoreClient>,
    staging: MemoryPool,
    /// Largest value seen, so that gets usually need no size lookup first.
    size_hint: AtomicUsize,
    /// While set and in the future, calls fail fast (the cluster just failed one).
    paused_until: Mutex<Option<Instant>>,
    retry_after: Duration,
    closed: AtomicBool,
    name: String,
}

/// A Mooncake Store [`RemoteConnector`]. Clones share one client and staging arena.
#[derive(Clone)]
pub struct MooncakeConnector {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MooncakeConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MooncakeConnector")
            .field("name", &self.inner.name)
            .field("client", &self.inner.client.name())
            .finish()
    }
}

fn unavailable(name: &str, reason: impl Into<String>) -> BackendError {
    BackendError::Unavailable {
        backend: name.to_string(),
        reason: reason.into(),
    }
}

/// A staging buffer holding a value: zero-copy into [`Bytes`].
fn staged_bytes(slot: MemoryObjMut, len: usize) -> Bytes {
    Bytes::from_owner(slot.freeze()).slice(..len)
}

impl MooncakeConnector {
    /// Connects through the embedded Python client (see [`crate::mooncake_python`]).
    pub async fn connect(config: &MooncakeConfig) -> Result<Self, BackendError> {
        config
            .validate()
            .map_err(|e| unavailable("mooncake", e.to_string()))?;
        probe_master(config).await?;
        let setup_config = config.clone();
        // A detached thread, not the runtime's blocking pool: Mooncake's setup retries an
        // unreachable master for minutes, and a runtime waits for its blocking tasks on drop.
        let (done, setup) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("mooncake-setup".into())
            .spawn(move || {
                let _ = done.send(crate::mooncake_python::PythonStoreClient::setup(
                    &setup_config,
                ));
            })
            .map_err(|e| unavailable("mooncake", format!("cannot start setup thread: {e}")))?;
        let client = match tokio::time::timeout(config.connect_timeout, setup).await {
            Err(_) => {
                return Err(BackendError::Timeout {
                    backend: "mooncake".into(),
                    op: "setup",
                    millis: config.connect_timeout.as_millis() as u64,
                });
            }
            Ok(Err(_)) => return Err(unavailable("mooncake", "the setup thread died")),
            Ok(Ok(Err(reason))) => return Err(unavailable("mooncake", reason)),
            Ok(Ok(Ok(client))) => client,
        };
        Self::with_client(Arc::new(client), config)
    }

    /// Wraps an already set-up client (any implementation of the trait).
    pub fn with_client(
        client: Arc<dyn MooncakeStoreClient>,
        config: &MooncakeConfig,
    ) -> Result<Self, BackendError> {
        let staging = MemoryPool::with_allocator(
            config.staging_bytes as usize,
            &RegisteringAllocator {
                client: client.clone(),
            },
        )
        .map_err(|e| unavailable("mooncake", format!("staging arena: {e}")))?;
        Ok(MooncakeConnector {
            inner: Arc::new(Inner {
                client,
                staging,
                size_hint: AtomicUsize::new(0),
                paused_until: Mutex::new(None),
                retry_after: config.retry_after,
                closed: AtomicBool::new(false),
                name: format!("mooncake({})", config.master_server_address),
            }),
        })
    }

    /// Runs the blocking `f` unless the connector is closed or paused; a cluster failure
    /// pauses it for `retry_after`.
    async fn call<T: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce(&Inner) -> Result<T, CallError> + Send + 'static,
    ) -> Result<T, BackendError> {
        let inner = &self.inner;
        if inner.closed.load(Ordering::Acquire) {
            return Err(BackendError::Closed(inner.name.clone()));
        }
        if let Some(until) = *inner.paused_until.lock()
            && Instant::now() < until
        {
            metrics::counter!(kvpool_core::telemetry::MOONCAKE_FAST_FAILURES).increment(1);
            return Err(unavailable(
                &inner.name,
                format!("{op} skipped: the cluster failed a call moments ago"),
            ));
        }
        let shared = inner.clone();
        // On a multi-threaded runtime the call runs on this worker (`block_in_place`): handing
        // it to the blocking pool and back cost ~30 µs per 1 MiB operation, 8% of a get
        // (docs/benchmarks.md). The price: a `tokio::time::timeout` around the call cannot cut
        // it short; Mooncake bounds its own RPCs (about 4 s with the master gone), and after
        // one cluster failure calls fail fast for `retry_after`.
        let result = if tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::MultiThread
        {
            tokio::task::block_in_place(move || f(&shared))
        } else {
            tokio::task::spawn_blocking(move || f(&shared))
                .await
                .map_err(|e| unavailable(&inner.name, format!("{op}: {e}")))?
        };
        match result {
            Ok(v) => Ok(v),
            Err(CallError::Client(reason)) => Err(unavailable(&inner.name, reason)),
            Err(CallError::Code(code)) => {
                if is_cluster_failure(code) {
                    *inner.paused_until.lock() = Some(Instant::now() + inner.retry_after);
                }
                Err(unavailable(
                    &inner.name,
                    format!("{op} failed with code {code} ({})", describe_code(code)),
                ))
            }
            Err(CallError::Pool(e)) => Err(BackendError::Pool(e)),
        }
    }
}

/// Fails fast, with a clear error, when nothing accepts connections at the master's address:
/// Mooncake's `setup` would otherwise retry for about a minute and a half while holding the
/// embedded interpreter's lock, stalling every other Mooncake client in the process.
async fn probe_master(config: &MooncakeConfig) -> Result<(), BackendError> {
    use std::net::{TcpStream, ToSocketAddrs};
    let address = config.master_server_address.clone();
    let limit = config.connect_timeout.min(Duration::from_secs(3));
    let target = address.clone();
    // Plain std sockets on a blocking thread: works on any runtime (no IO driver needed).
    let probe = tokio::task::spawn_blocking(move || -> Result<(), String> {
        let addrs: Vec<_> = target
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve: {e}"))?
            .collect();
        let mut last = "no address".to_string();
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, limit) {
                Ok(_) => return Ok(()),
                Err(e) => last = e.to_string(),
            }
        }
        Err(last)
    })
    .await
    .map_err(|e| unavailable("mooncake", e.to_string()))?;
    probe.map_err(|reason| {
        unavailable(
            "mooncake",
            format!("cannot reach mooncake_master at {address}: {reason}"),
        )
    })
}

/// Why a blocking call failed.
enum CallError {
    /// The client raised.
    Client(String),
    /// Mooncake answered with a negative code.
    Code(i64),
    /// The staging arena could not hold a value.
    Pool(PoolError),
}

impl From<String> for CallError {
    fn from(reason: String) -> Self {
        CallError::Client(reason)
    }
}

impl Inner {
    /// Allocates staging for `len` bytes; a value larger than the whole arena is an error.
    fn stage(&self, len: usize) -> Result<Option<MemoryObjMut>, CallError> {
        match self.staging.allocate(len.max(1)) {
            Ok(slot) => Ok(Some(slot)),
            Err(PoolError::OutOfMemory { .. }) => Ok(None),
            Err(e) => Err(CallError::Pool(e)),
        }
    }

    /// Puts every entry, in rounds that fit the staging arena.
    fn put_all(&self, entries: &[(String, Bytes)]) -> Result<(), CallError> {
        let mut next = 0;
        while next < entries.len() {
            let mut keys = Vec::new();
            let mut slots = Vec::new();
            while next < entries.len() {
                let value = &entries[next].1;
                let Some(mut slot) = self.stage(value.len())? else {
                    break;
                };
                slot.as_mut_slice()[..value.len()].copy_from_slice(value);
                keys.push(entries[next].0.clone());
                slots.push(slot);
                next += 1;
            }
            if slots.is_empty() {
                // The arena is full of values still held elsewhere (gets in flight).
                return Err(CallError::Pool(PoolError::OutOfMemory {
                    requested: entries[next].1.len(),
                    free: self.staging.stats().capacity - self.staging.stats().used,
                    largest: self.staging.stats().largest_free,
                }));
            }
            let buffers: Vec<RawBuffer> = slots
                .iter_mut()
                .zip(&entries[next - keys.len()..next])
                .map(|(slot, (_, value))| RawBuffer {
                    ptr: slot.as_mut_slice().as_mut_ptr(),
                    len: value.len(),
                })
                .collect();
            self.upsert_with_retries(&keys, &buffers)?;
        }
        if let Some(max) = entries.iter().map(|(_, v)| v.len()).max() {
            self.size_hint.fetch_max(max, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Upserts, retrying keys that lost a race with another writer of the same key (Mooncake
    /// answers such a loser with "not found", "already exists", "not ready" or "has a lease").
    fn upsert_with_retries(&self, keys: &[String], buffers: &[RawBuffer]) -> Result<(), CallError> {
        let (mut keys, mut buffers) = (keys.to_vec(), buffers.to_vec());
        for attempt in 0.. {
            // SAFETY: the buffers are registered staging slots the caller keeps alive.
            let codes = unsafe { self.client.batch_upsert_from(&keys, &buffers)? };
            let mut retry_keys = Vec::new();
            let mut retry_buffers = Vec::new();
            for ((key, buffer), code) in keys.iter().zip(&buffers).zip(codes) {
                match code {
                    OK => {}
                    -706..=-703 if attempt < PUT_RACE_RETRIES => {
                        retry_keys.push(key.clone());
                        retry_buffers.push(*buffer);
                    }
                    code => {
                        warn!(backend = %self.name, %key, code, meaning = describe_code(code), "Mooncake put failed");
                        return Err(CallError::Code(code));
                    }
                }
            }
            if retry_keys.is_empty() {
                break;
            }
            debug!(backend = %self.name, keys = retry_keys.len(), attempt, "retrying puts that raced another writer");
            std::thread::sleep(Duration::from_millis(1 << attempt));
            (keys, buffers) = (retry_keys, retry_buffers);
        }
        Ok(())
    }

    /// Gets every key, in rounds that fit the staging arena. Values stay in staging (no copy)
    /// unless a later round needs the room or staging would stay more than half full.
    fn get_all(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, CallError> {
        let mut out: Vec<Option<Bytes>> = vec![None; keys.len()];
        let mut too_small = Vec::new();
        let mut next = 0;
        while next < keys.len() {
            let hint = self.size_hint.load(Ordering::Relaxed);
            let mut round: Vec<(usize, MemoryObjMut, usize)> = Vec::new();
            while next < keys.len() {
                let size = if hint > 0 {
                    hint
                } else {
                    match self.client.get_size(&keys[next])? {
                        OBJECT_NOT_FOUND => {
                            next += 1;
                            continue;
                        }
                        code if code < OK => return Err(CallError::Code(code)),
                        size => size as usize,
                    }
                };
                let Some(slot) = self.stage(size)? else {
                    break;
                };
                round.push((next, slot, size));
                next += 1;
            }
            if round.is_empty() {
                if next < keys.len() {
                    // Staging is taken by earlier results: move them to the heap and retry.
                    if !spill_to_heap(&mut out) {
                        return Err(CallError::Pool(PoolError::OutOfMemory {
                            requested: hint,
                            free: self.staging.stats().capacity - self.staging.stats().used,
                            largest: self.staging.stats().largest_free,
                        }));
                    }
                }
                continue;
            }
            self.get_round(keys, round, &mut out, &mut too_small)?;
        }
        // Values larger than the hint: their exact size, one by one.
        for index in too_small {
            let size = match self.client.get_size(&keys[index])? {
                OBJECT_NOT_FOUND => continue,
                code if code < OK => return Err(CallError::Code(code)),
                size => size as usize,
            };
            let slot = match self.stage(size)? {
                Some(slot) => slot,
                None if spill_to_heap(&mut out) => match self.stage(size)? {
                    Some(slot) => slot,
                    None => continue,
                },
                None => continue,
            };
            let mut missed = Vec::new();
            self.get_round(keys, vec![(index, slot, size)], &mut out, &mut missed)?;
        }
        // Callers may hold values for a while: staging stays at most half pinned by them, so
        // later calls always find room.
        let stats = self.staging.stats();
        if stats.used > stats.capacity / 2 {
            spill_to_heap(&mut out);
        }
        Ok(out)
    }

    fn get_round(
        &self,
        keys: &[String],
        mut round: Vec<(usize, MemoryObjMut, usize)>,
        out: &mut [Option<Bytes>],
        too_small: &mut Vec<usize>,
    ) -> Result<(), CallError> {
        let names: Vec<String> = round.iter().map(|(i, _, _)| keys[*i].clone()).collect();
        let buffers: Vec<RawBuffer> = round
            .iter_mut()
            .map(|(_, slot, size)| RawBuffer {
                ptr: slot.as_mut_slice().as_mut_ptr(),
                len: *size,
            })
            .collect();
        // SAFETY: each slot is registered staging memory of at least `size` bytes, owned here
        // and not aliased, alive until after the call.
        let codes = unsafe { self.client.batch_get_into(&names, &buffers)? };
        if codes.len() != round.len() {
            return Err(CallError::Client(format!(
                "batch_get_into answered {} results for {} keys",
                codes.len(),
                round.len()
            )));
        }
        let mut cluster_failure = None;
        for ((index, slot, size), code) in round.into_iter().zip(codes) {
            match code {
                OBJECT_NOT_FOUND => {}
                BUFFER_TOO_SMALL => too_small.push(index),
                n if n >= OK && (n as usize) <= size => {
                    self.size_hint.fetch_max(n as usize, Ordering::Relaxed);
                    out[index] = Some(staged_bytes(slot, n as usize));
                }
                n if n >= OK => {
                    return Err(CallError::Client(format!(
                        "get_into reported {n} bytes into a {size}-byte buffer"
                    )));
                }
                code if is_cluster_failure(code) => cluster_failure = Some(code),
                code => {
                    debug!(backend = %self.name, key = %keys[index], code, meaning = describe_code(code), "Mooncake get failed; a miss");
                }
            }
        }
        match cluster_failure {
            Some(code) => Err(CallError::Code(code)),
            None => Ok(()),
        }
    }
}

/// Copies staged results to the heap, freeing their staging; false if there was none.
fn spill_to_heap(out: &mut [Option<Bytes>]) -> bool {
    let mut freed = false;
    for value in out.iter_mut().flatten() {
        *value = Bytes::copy_from_slice(value);
        freed = true;
    }
    freed
}

fn codes_to_bools(codes: Vec<i64>, expected: usize) -> Result<Vec<bool>, CallError> {
    if codes.len() != expected {
        return Err(CallError::Client(format!(
            "batch_is_exist answered {} results for {expected} keys",
            codes.len()
        )));
    }
    codes
        .into_iter()
        .map(|c| match c {
            1 => Ok(true),
            0 => Ok(false),
            code => Err(CallError::Code(code)),
        })
        .collect()
}

#[async_trait]
impl RemoteConnector for MooncakeConnector {
    fn name(&self) -> &str {
        &self.inner.name
    }

    async fn exists(&self, key: &str) -> Result<bool, BackendError> {
        Ok(self.batch_exists(&[key.to_string()]).await?[0])
    }

    async fn get(&self, key: &str) -> Result<Option<Bytes>, BackendError> {
        Ok(self.batch_get(&[key.to_string()]).await?.remove(0))
    }

    async fn put(&self, key: &str, value: Bytes) -> Result<(), BackendError> {
        self.batch_put(vec![(key.to_string(), value)]).await
    }

    async fn delete(&self, key: &str) -> Result<bool, BackendError> {
        Ok(self.batch_delete(&[key.to_string()]).await? == 1)
    }

    async fn close(&self) -> Result<(), BackendError> {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let inner = self.inner.clone();
        let closed = tokio::task::spawn_blocking(move || inner.client.close())
            .await
            .map_err(|e| unavailable(&self.inner.name, e.to_string()))?;
        if let Err(reason) = closed {
            warn!(backend = %self.inner.name, %reason, "Mooncake close failed");
        }
        Ok(())
    }

    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let keys = keys.to_vec();
        self.call("batch_is_exist", move |inner| {
            let n = keys.len();
            codes_to_bools(inner.client.batch_is_exist(&keys)?, n)
        })
        .await
    }

    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let keys = keys.to_vec();
        self.call("batch_get_into", move |inner| inner.get_all(&keys))
            .await
    }

    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        if entries.is_empty() {
            return Ok(());
        }
        self.call("batch_upsert_from", move |inner| inner.put_all(&entries))
            .await
    }

    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        if keys.is_empty() {
            return Ok(0);
        }
        let keys = keys.to_vec();
        self.call("batch_remove", move |inner| {
            let codes = inner.client.batch_remove(&keys)?;
            let mut removed = 0;
            for code in codes {
                match code {
                    OK => removed += 1,
                    OBJECT_NOT_FOUND => {}
                    code => return Err(CallError::Code(code)),
                }
            }
            Ok(removed)
        })
        .await
    }
}

/// The URL schemes the Mooncake tier opens.
pub const SCHEMES: &[&str] = &["mooncakestore"];

/// Registers [`SCHEMES`] with the scheme registry. Mooncake's options travel in the URL's
/// query (`?protocol=rdma&device_name=mlx5_0`), named as in Mooncake's own JSON config.
pub struct MooncakeFactory;

#[async_trait]
impl BackendFactory for MooncakeFactory {
    fn example(&self) -> String {
        "url = \"mooncakestore://127.0.0.1:50051?protocol=tcp&global_segment_size=1GiB\"  # options in the query: config, local_hostname, metadata_server, protocol, device_name, global_segment_size, local_buffer_size, staging_size, replica_num, python_path".into()
    }

    async fn open(&self, tier: &TierRequest<'_>) -> Result<Box<dyn RemoteConnector>, ConfigError> {
        tier.options().finish()?;
        let mut config = MooncakeConfig::from_url(tier.url())?;
        // Room for a few values of the largest chunk the pool stores.
        let needed = (tier.max_chunk_bytes + 4096).saturating_mul(4);
        config.staging_bytes = config.staging_bytes.max(needed);
        let connector = MooncakeConnector::connect(&config)
            .await
            .map_err(|e| invalid(e.to_string()))?;
        Ok(Box::new(connector))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// An in-process stand-in for Mooncake: checks that every buffer it is handed lies inside
    /// registered memory, and can be told to fail like a cluster without a master.
    #[derive(Default)]
    struct FakeStore {
        objects: Mutex<HashMap<String, Vec<u8>>>,
        registered: Mutex<Vec<(usize, usize)>>,
        calls: AtomicUsize,
        master_down: AtomicBool,
        /// Puts of these keys fail once with "object not found" (a lost race).
        race_once: Mutex<Vec<String>>,
    }

    impl FakeStore {
        fn check_registered(&self, b: &RawBuffer) {
            let start = b.ptr as usize;
            assert!(
                self.registered
                    .lock()
                    .iter()
                    .any(|(s, l)| start >= *s && start + b.len <= s + l),
                "a buffer outside registered memory was handed to Mooncake"
            );
        }

        fn enter(&self) -> Option<i64> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.master_down.load(Ordering::SeqCst).then_some(-900)
        }
    }

    impl MooncakeStoreClient for FakeStore {
        fn name(&self) -> &str {
            "fake"
        }
        unsafe fn register_buffer(&self, b: RawBuffer) -> Result<i64, String> {
            self.registered.lock().push((b.ptr as usize, b.len));
            Ok(0)
        }
        unsafe fn batch_upsert_from(
            &self,
            keys: &[String],
            buffers: &[RawBuffer],
        ) -> Result<Vec<i64>, String> {
            if let Some(code) = self.enter() {
                return Ok(vec![code; keys.len()]);
            }
            Ok(keys
                .iter()
                .zip(buffers)
                .map(|(k, b)| {
                    self.check_registered(b);
                    let mut race = self.race_once.lock();
                    if let Some(i) = race.iter().position(|r| r == k) {
                        race.remove(i);
                        return OBJECT_NOT_FOUND;
                    }
                    // SAFETY: the connector promises readable registered buffers.
                    let bytes = unsafe { std::slice::from_raw_parts(b.ptr, b.len) };
                    self.objects.lock().insert(k.clone(), bytes.to_vec());
                    OK
                })
                .collect())
        }
        unsafe fn batch_get_into(
            &self,
            keys: &[String],
            buffers: &[RawBuffer],
        ) -> Result<Vec<i64>, String> {
            if let Some(code) = self.enter() {
                return Ok(vec![code; keys.len()]);
            }
            Ok(keys
                .iter()
                .zip(buffers)
                .map(|(k, b)| {
                    self.check_registered(b);
                    match self.objects.lock().get(k) {
                        None => OBJECT_NOT_FOUND,
                        Some(v) if v.len() > b.len => BUFFER_TOO_SMALL,
                        Some(v) => {
                            // SAFETY: the connector promises writable registered buffers.
                            unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), b.ptr, v.len()) };
                            v.len() as i64
                        }
                    }
                })
                .collect())
        }
        fn get_size(&self, key: &str) -> Result<i64, String> {
            if let Some(code) = self.enter() {
                return Ok(code);
            }
            Ok(self
                .objects
                .lock()
                .get(key)
                .map_or(OBJECT_NOT_FOUND, |v| v.len() as i64))
        }
        fn batch_is_exist(&self, keys: &[String]) -> Result<Vec<i64>, String> {
            if let Some(code) = self.enter() {
                return Ok(vec![code; keys.len()]);
            }
            let objects = self.objects.lock();
            Ok(keys
                .iter()
                .map(|k| i64::from(objects.contains_key(k)))
                .collect())
        }
        fn batch_remove(&self, keys: &[String]) -> Result<Vec<i64>, String> {
            if let Some(code) = self.enter() {
                return Ok(vec![code; keys.len()]);
            }
            let mut objects = self.objects.lock();
            Ok(keys
                .iter()
                .map(|k| objects.remove(k).map_or(OBJECT_NOT_FOUND, |_| OK))
                .collect())
        }
        fn close(&self) -> Result<i64, String> {
            Ok(0)
        }
    }

    fn connector(staging: u64) -> (Arc<FakeStore>, MooncakeConnector) {
        let fake = Arc::new(FakeStore::default());
        let config = MooncakeConfig {
            master_server_address: "fake:1".into(),
            staging_bytes: staging,
            retry_after: Duration::from_millis(200),
            ..MooncakeConfig::default()
        };
        let c = MooncakeConnector::with_client(fake.clone(), &config).unwrap();
        (fake, c)
    }

    fn value(i: usize, len: usize) -> Bytes {
        (0..len)
            .map(|j| (j.wrapping_mul(31) ^ i) as u8)
            .collect::<Vec<u8>>()
            .into()
    }

    #[tokio::test]
    async fn batches_larger_than_staging_go_in_rounds_and_round_trip() {
        let (fake, c) = connector(2 << 20);
        let entries: Vec<(String, Bytes)> = (0..10)
            .map(|i| (format!("k{i}"), value(i, 700 << 10)))
            .collect();
        c.batch_put(entries.clone()).await.unwrap();
        assert!(
            fake.calls.load(Ordering::SeqCst) >= 4,
            "10 x 700 KiB in 2 MiB"
        );
        let mut keys: Vec<String> = entries.iter().map(|(k, _)| k.clone()).collect();
        keys.push("absent".into());
        let got = c.batch_get(&keys).await.unwrap();
        for ((_, want), got) in entries.iter().zip(&got) {
            assert_eq!(got.as_ref(), Some(want));
        }
        assert_eq!(got[10], None);
        assert_eq!(
            c.batch_exists(&keys).await.unwrap(),
            [vec![true; 10], vec![false]].concat()
        );
        assert_eq!(c.batch_delete(&keys).await.unwrap(), 10);
    }

    #[tokio::test]
    async fn values_larger_than_the_size_hint_are_read_whole() {
        let (fake, c) = connector(8 << 20);
        c.put("small", value(1, 1000)).await.unwrap();
        assert_eq!(c.get("small").await.unwrap(), Some(value(1, 1000)));
        // Written by another client: larger than anything this connector has seen.
        fake.objects
            .lock()
            .insert("large".into(), value(2, 3 << 20).to_vec());
        assert_eq!(c.get("large").await.unwrap(), Some(value(2, 3 << 20)));
        let got = c
            .batch_get(&["small".into(), "large".into(), "absent".into()])
            .await
            .unwrap();
        assert_eq!(
            got,
            vec![Some(value(1, 1000)), Some(value(2, 3 << 20)), None]
        );
    }

    #[tokio::test]
    async fn held_results_are_moved_out_of_staging_when_it_runs_out() {
        let (_fake, c) = connector(2 << 20);
        let entries: Vec<(String, Bytes)> = (0..6)
            .map(|i| (format!("k{i}"), value(i, 900 << 10)))
            .collect();
        c.batch_put(entries.clone()).await.unwrap();
        let keys: Vec<String> = entries.iter().map(|(k, _)| k.clone()).collect();
        // 6 x 900 KiB cannot all stay in a 2 MiB arena at once.
        let got = c.batch_get(&keys).await.unwrap();
        for ((_, want), got) in entries.iter().zip(&got) {
            assert_eq!(got.as_ref(), Some(want));
        }
        // Results held by the caller never block later calls for good.
        let held = got;
        assert_eq!(c.get("k0").await.unwrap().as_ref(), held[0].as_ref());
    }

    #[tokio::test]
    async fn a_put_that_lost_a_race_is_retried() {
        let (fake, c) = connector(4 << 20);
        fake.race_once.lock().push("contended".into());
        c.put("contended", value(3, 4096)).await.unwrap();
        assert_eq!(c.get("contended").await.unwrap(), Some(value(3, 4096)));
    }

    #[tokio::test]
    async fn a_failed_cluster_pauses_calls_then_they_resume() {
        let (fake, c) = connector(4 << 20);
        c.put("k", value(4, 100)).await.unwrap();
        fake.master_down.store(true, Ordering::SeqCst);
        let err = c.get("k").await.unwrap_err().to_string();
        assert!(err.contains("-900"), "{err}");
        let calls = fake.calls.load(Ordering::SeqCst);
        for _ in 0..5 {
            let err = c.exists("k").await.unwrap_err().to_string();
            assert!(err.contains("failed a call moments ago"), "{err}");
        }
        assert_eq!(
            fake.calls.load(Ordering::SeqCst),
            calls,
            "paused calls do not reach the client"
        );
        fake.master_down.store(false, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(c.get("k").await.unwrap(), Some(value(4, 100)));
    }

    #[tokio::test]
    async fn close_makes_every_call_an_error() {
        let (_fake, c) = connector(4 << 20);
        c.close().await.unwrap();
        assert!(matches!(
            c.get("k").await.unwrap_err(),
            BackendError::Closed(_)
        ));
        assert!(matches!(
            c.put("k", value(0, 1)).await.unwrap_err(),
            BackendError::Closed(_)
        ));
    }

    #[test]
    fn urls_and_mooncake_json_combine() {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("mooncake.json");
        std::fs::write(
            &json,
            r#"{"local_hostname": "node7", "metadata_server": "etcd://10.0.0.2:2379",
                "master_server_address": "10.0.0.5:50051", "protocol": "rdma",
                "device_name": "mlx5_0", "global_segment_size": "4gb",
                "local_buffer_size": 1073741824, "enable_ssd_offload": false}"#,
        )
        .unwrap();
        let c = MooncakeConfig::from_url(&format!("mooncakestore://?config={}", json.display()))
            .unwrap();
        assert_eq!(c.master_server_address, "10.0.0.5:50051");
        assert_eq!(c.local_hostname, "node7");
        assert_eq!(c.metadata_server, "etcd://10.0.0.2:2379");
        assert_eq!(
            (c.protocol.as_str(), c.device_name.as_str()),
            ("rdma", "mlx5_0")
        );
        assert_eq!(c.global_segment_size, 4 << 30);
        assert_eq!(c.local_buffer_size, 1 << 30);
        // The URL overrides the file.
        let c = MooncakeConfig::from_url(&format!(
            "mooncakestore://10.0.0.9:6000?config={}&protocol=tcp&replica_num=2&staging_size=64MiB&global_segment_size=512MB",
            json.display()
        ))
        .unwrap();
        assert_eq!(c.master_server_address, "10.0.0.9:6000");
        assert_eq!(c.protocol, "tcp");
        assert_eq!(c.replica_num, 2);
        assert_eq!(c.staging_bytes, 64 << 20);
        assert_eq!(c.global_segment_size, 512 << 20);
        // Defaults.
        let c = MooncakeConfig::from_url("mooncakestore://m:50051").unwrap();
        assert_eq!(c.metadata_server, "P2PHANDSHAKE");
        assert_eq!((c.protocol.as_str(), c.global_segment_size), ("tcp", 0));
    }

    #[test]
    fn bad_mooncake_configuration_says_what_to_fix() {
        let dir = tempfile::tempdir().unwrap();
        let broken = dir.path().join("broken.json");
        std::fs::write(&broken, "{not json").unwrap();
        for (url, needle) in [
            ("redis://h:1".to_string(), "not a Mooncake URL"),
            (
                "mooncakestore://h:1?staging_size=12parsecs".into(),
                "staging_size",
            ),
            ("mooncakestore://h:1?protocol".into(), "needs a value"),
            (
                format!("mooncakestore://h:1?config={}", broken.display()),
                "not Mooncake JSON",
            ),
            (
                "mooncakestore://h:1?config=/nonexistent.json".into(),
                "cannot read",
            ),
            (
                "mooncakestore://h:1?staging_size=4KiB".into(),
                "at least 1MiB",
            ),
        ] {
            let err = MooncakeConfig::from_url(&url).unwrap_err().to_string();
            assert!(err.contains(needle), "{url}: {err}");
        }
    }

    #[test]
    fn codes_have_meanings() {
        assert_eq!(describe_code(-704), "object not found");
        assert!(is_cluster_failure(-900));
        assert!(!is_cluster_failure(OBJECT_NOT_FOUND));
    }
}
