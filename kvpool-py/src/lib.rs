//! kvpool's Python extension (`kvpool._native`): the connector's scheduler and worker for
//! `kvpool.vllm.KvpoolConnector`, the secondary tier for vLLM's native offloading
//! (`kvpool.vllm.tier.KvpoolTier`) and SGLang's HiCache storage backend
//! (`kvpool.sglang.KvpoolStorage`). No KV bytes become Python objects: the worker hands out copy
//! jobs (engine block ids and the addresses of kvpool's host chunks) that the Python side runs
//! with torch, and the metadata between the two halves is kvpool's own encoded bytes.

#![warn(missing_docs)]

mod py_copies;
mod py_copy_job;
mod py_scheduler;
mod py_sglang;
mod py_state_values;
mod py_tier;
mod py_worker;
mod worker_core;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

pub use py_copies::PyCopyEngine;
pub use py_scheduler::PyScheduler;
pub use py_sglang::PyHiCacheStore;
pub use py_tier::PyOffloadTier;
pub use py_worker::PyWorker;
pub use worker_core::WorkerSpec;

/// Parses the user's pool config: `format` is `"toml"` (text of a TOML file), `"json"` (a
/// JSON object, as vLLM's `kv_connector_extra_config` gives it) or `"default"` (embedded
/// defaults: 2 GiB of CPU memory, no lower tier).
pub fn parse_pool_config(text: &str, format: &str) -> Result<kvpool_core::PoolConfig, String> {
    let config = parse_pool_config_unchecked(text, format)?;
    config.validate().map_err(|e| e.to_string())?;
    Ok(config)
}

/// [`parse_pool_config`] without validation, for a config the caller fits to the engine (its
/// layout and chunking) and validates afterwards.
pub fn parse_pool_config_unchecked(
    text: &str,
    format: &str,
) -> Result<kvpool_core::PoolConfig, String> {
    match format {
        "toml" => kvpool_core::PoolConfig::parse_toml(text).map_err(|e| e.to_string()),
        "json" => serde_json::from_str(text)
            .map_err(|e| format!("cannot parse the kvpool config (JSON): {e}")),
        "default" => Ok(kvpool_core::PoolConfig::default()),
        other => Err(format!(
            "unknown config format `{other}` (expected toml, json or default)"
        )),
    }
}

/// A pool fitted to an engine's fixed-size values (vLLM's offloading rows, SGLang's pages),
/// running on a runtime of its own.
pub(crate) struct ValuePool {
    /// The fitted config.
    pub config: kvpool_core::PoolConfig,
    /// The key scope of every value.
    pub scope: kvpool_core::KeyScope,
    /// The tiers.
    pub storage: std::sync::Arc<kvpool_core::StorageManager>,
    /// Where tier calls run.
    pub runtime: std::sync::Arc<tokio::runtime::Runtime>,
}

impl ValuePool {
    /// Parses the user's config, fits it to values of `value_bytes` under `scope`
    /// ([`kvpool_connector::opaque_values::pool_config_for_values`]; `what` names the values
    /// in errors), starts a runtime with threads named `thread_name` and builds the tiers.
    pub(crate) fn build(
        config_text: &str,
        config_format: &str,
        scope: kvpool_connector::opaque_values::ValueScope<'_>,
        value_bytes: usize,
        what: &str,
        thread_name: &str,
    ) -> PyResult<Self> {
        use pyo3::exceptions::PyRuntimeError;
        let base = parse_pool_config_unchecked(config_text, config_format)
            .map_err(PyValueError::new_err)?;
        let config = kvpool_connector::opaque_values::pool_config_for_values(
            &base,
            scope,
            value_bytes,
            what,
        )
        .map_err(|e| PyValueError::new_err(format!("kvpool: {e}")))?;
        let runtime = std::sync::Arc::new(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name(thread_name)
                .enable_all()
                .build()
                .map_err(|e| {
                    PyRuntimeError::new_err(format!("cannot start kvpool's runtime: {e}"))
                })?,
        );
        let pool = runtime
            .block_on(kvpool_backends::build_pool(&config))
            .map_err(|e| PyRuntimeError::new_err(format!("kvpool: {e}")))?;
        let scope = config
            .key_scope()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let storage = pool.engine.storage().clone();
        Ok(ValuePool {
            config,
            scope,
            storage,
            runtime,
        })
    }
}

/// Locks the state behind a Python object; a lock poisoned by an earlier panic is a clear
/// Python error, not another panic.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> PyResult<std::sync::MutexGuard<'_, T>> {
    m.lock().map_err(|_| {
        pyo3::exceptions::PyRuntimeError::new_err(
            "a previous kvpool call panicked; restart the engine",
        )
    })
}

/// A 16-byte chunk hash from Python bytes (a key the scheduler or a tracker handed out).
pub(crate) fn chunk_hash_of(bytes: &[u8]) -> PyResult<kvpool_core::ChunkHash> {
    let raw: [u8; 16] = bytes.try_into().map_err(|_| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "a chunk hash has 16 bytes, not {}",
            bytes.len()
        ))
    })?;
    Ok(kvpool_core::ChunkHash(raw))
}

/// Logs from Rust go to stderr through `tracing`, filtered by `KVPOOL_LOG` (default `warn`;
/// e.g. `KVPOOL_LOG=kvpool_connector=debug`, or `KVPOOL_LOG=kvpool::request=debug` for one
/// line per finished request), colored only on a terminal.
fn init_logging() {
    use std::io::IsTerminal;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVPOOL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    let installed = tracing_subscriber::registry()
        .with(filter)
        .with(
            tracing_subscriber::fmt::layer()
                .with_ansi(std::io::stderr().is_terminal())
                .with_writer(std::io::stderr),
        )
        .try_init();
    if installed.is_ok() {
        let _ = LOG_FILTER.set(handle);
    }
}

/// The log filter [`init_logging`] installed, so that the `kvpool` command can set its own
/// default level (its `serve` logs at `info`).
static LOG_FILTER: std::sync::OnceLock<
    tracing_subscriber::reload::Handle<tracing_subscriber::EnvFilter, tracing_subscriber::Registry>,
> = std::sync::OnceLock::new();

/// The `kvpool` command (`serve`, `bench`, `replay`, `config`, …) run on `argv` (the
/// program name first), for the package's `kvpool` entry point (`kvpool._cli`): returns the
/// exit code. The calling process becomes the command: SIGINT is given back its default
/// action (Python's handler would only set a flag nobody reads while the command runs), and
/// the interpreter's lock is released until the command ends.
#[pyfunction]
fn run_command_line(py: Python<'_>, argv: Vec<String>) -> i32 {
    if std::env::var_os("KVPOOL_LOG").is_none()
        && let Some(handle) = LOG_FILTER.get()
    {
        let serve = argv.get(1).is_some_and(|c| c == "serve");
        let level = kvpool_cli::default_log_level(serve);
        let _ = handle.reload(tracing_subscriber::EnvFilter::new(level));
    }
    // SAFETY: restores the default action of one signal; no handler of ours is replaced.
    unsafe { libc::signal(libc::SIGINT, libc::SIG_DFL) };
    py.detach(|| kvpool_cli::run_command_line(argv))
}

/// Encodes a request's extra keys (LoRA name, cache salt, multimodal hashes) the way every
/// kvpool process does; see docs/keys.md.
#[pyfunction]
#[pyo3(signature = (lora_name=None, cache_salt=None, mm_hashes=Vec::new()))]
fn encode_extra_keys(
    lora_name: Option<String>,
    cache_salt: Option<String>,
    mm_hashes: Vec<String>,
) -> Vec<u8> {
    kvpool_connector::extra_keys::ExtraKeys {
        lora_name,
        cache_salt,
        mm_hashes,
    }
    .encode()
}

/// The lookup socket path of a vLLM engine's worker rank.
#[pyfunction]
fn lookup_socket_path(dir: &str, engine_id: &str, tp_rank: u32) -> String {
    kvpool_connector::vllm::lookup_socket_path(std::path::Path::new(dir), engine_id, tp_rank)
        .display()
        .to_string()
}

/// The xxh3-128 digest (hex) of a file's bytes, read in 8 MiB pieces (a checkpoint's
/// weights: what keys are bound to, see docs/keys.md).
#[pyfunction]
fn digest_file(py: Python<'_>, path: std::path::PathBuf) -> PyResult<String> {
    py.detach(|| {
        use std::io::Read;
        let mut f = std::fs::File::open(&path).map_err(|e| {
            pyo3::exceptions::PyOSError::new_err(format!("{}: {e}", path.display()))
        })?;
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        let mut buf = vec![0u8; 8 << 20];
        loop {
            let n = f.read(&mut buf).map_err(|e| {
                pyo3::exceptions::PyOSError::new_err(format!("{}: {e}", path.display()))
            })?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        Ok(format!("{:032x}", h.digest128()))
    })
}

/// The model text of a key scope for an engine's KV (`kvpool_core::keys::engine_scope`):
/// `interface` is `vllm-connector`, `vllm-offload` or `sglang`; `layout` describes every fact
/// that decides the stored bytes.
#[pyfunction]
fn engine_scope(interface: &str, name: &str, weights: &str, layout: &str) -> PyResult<String> {
    let interface: kvpool_core::keys::EngineInterface = interface
        .parse()
        .map_err(|e| PyValueError::new_err(format!("kvpool: {e}")))?;
    Ok(kvpool_core::keys::engine_scope_model(
        interface, name, weights, layout,
    ))
}

/// The model text of a part of an engine's KV kept apart from the rest (one of SGLang's side
/// host pools), below the engine's scope `scope`.
#[pyfunction]
fn part_scope(scope: &str, part: &str, layout: &str) -> String {
    kvpool_core::keys::part_scope_model(scope, part, layout)
}

/// The xxh3-128 digest (hex) of a text.
#[pyfunction]
fn digest_text(text: &str) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(text.as_bytes()))
}

/// Checks a config without building anything (for a clear error at engine start); returns
/// its chunk size in tokens.
#[pyfunction]
fn check_config(text: &str, format: &str) -> PyResult<usize> {
    parse_pool_config(text, format)
        .map(|config| config.chunking.chunk_size)
        .map_err(PyValueError::new_err)
}

/// The config with the node's pool daemon at `pool` (`unix:///path`, `kvpool+unix:///path` or
/// an absolute path) as its first lower tier, as JSON: the connector's `pool` option.
#[pyfunction]
fn config_with_pool(text: &str, format: &str, pool: &str) -> PyResult<String> {
    let mut config = parse_pool_config(text, format).map_err(PyValueError::new_err)?;
    let path = kvpool_backends::daemon::socket_path(pool)
        .map_err(|e| PyValueError::new_err(format!("kvpool: `pool` option: {e}")))?;
    let url = format!("kvpool+unix://{}", path.display());
    if !config.tiers.iter().any(|t| t.url == url) {
        config.tiers.insert(0, kvpool_core::TierConfig::new(url));
    }
    serde_json::to_string(&config).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// The `kvpool._native` module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyWorker>()?;
    m.add_class::<py_state_values::PyStateValues>()?;
    m.add_class::<PyCopyEngine>()?;
    m.add_class::<py_copy_job::PyCopyJob>()?;
    m.add_class::<py_worker::NodeMemoryRegion>()?;
    m.add_class::<PyOffloadTier>()?;
    m.add_class::<PyHiCacheStore>()?;
    m.add_function(wrap_pyfunction!(encode_extra_keys, m)?)?;
    m.add_function(wrap_pyfunction!(lookup_socket_path, m)?)?;
    m.add_function(wrap_pyfunction!(check_config, m)?)?;
    m.add_function(wrap_pyfunction!(config_with_pool, m)?)?;
    m.add_function(wrap_pyfunction!(digest_file, m)?)?;
    m.add_function(wrap_pyfunction!(digest_text, m)?)?;
    m.add_function(wrap_pyfunction!(engine_scope, m)?)?;
    m.add_function(wrap_pyfunction!(part_scope, m)?)?;
    m.add_function(wrap_pyfunction!(run_command_line, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_parse_from_toml_json_and_defaults() {
        let toml = parse_pool_config("[local_cpu]\nmax_size = \"64MiB\"\n", "toml").unwrap();
        assert_eq!(toml.local_cpu.max_size.0, 64 << 20);
        let json = parse_pool_config(
            r#"{"local_cpu": {"max_size": "64MiB"}, "tier": [{"url": "memory://"}]}"#,
            "json",
        )
        .unwrap();
        assert_eq!(json.local_cpu.max_size.0, 64 << 20);
        assert_eq!(json.tiers.len(), 1);
        assert!(parse_pool_config("", "default").is_ok());
        let err = parse_pool_config(r#"{"local_cpu": {"max_sise": 1}}"#, "json").unwrap_err();
        assert!(err.contains("max_sise"), "{err}");
        assert!(parse_pool_config("", "yaml").is_err());
    }

    #[test]
    fn the_pool_option_puts_the_daemon_first_and_keeps_the_rest_of_the_config() {
        let toml =
            "[local_cpu]\nmax_size = \"64MiB\"\n[[tier]]\nurl = \"memory://\"\ntimeout_ms = 250\n";
        let json = config_with_pool(toml, "toml", "unix:///run/kvpool/kvpool.sock").unwrap();
        let cfg = parse_pool_config(&json, "json").unwrap();
        let urls: Vec<&str> = cfg.tiers.iter().map(|t| t.url.as_str()).collect();
        assert_eq!(urls, ["kvpool+unix:///run/kvpool/kvpool.sock", "memory://"]);
        assert_eq!(cfg.tiers[1].timeout_ms, 250);
        assert_eq!(cfg.local_cpu.max_size.0, 64 << 20);
        // Given twice (option and config), the daemon is one tier.
        let again = config_with_pool(&json, "json", "/run/kvpool/kvpool.sock").unwrap();
        assert_eq!(parse_pool_config(&again, "json").unwrap().tiers.len(), 2);
        Python::initialize();
        let err = config_with_pool("", "default", "relative.sock").unwrap_err();
        assert!(err.to_string().contains("absolute socket path"), "{err}");
    }
}
