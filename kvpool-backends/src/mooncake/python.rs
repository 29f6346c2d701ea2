//! The Mooncake Store client over CPython: every Python detail of the `mooncake` tier lives here.
//!
//! Mooncake ships its store client as a Python extension (`mooncake.store`,
//! `MooncakeDistributedStore`) and no C library in its wheels, so kvpool embeds CPython with
//! PyO3 and drives that extension. Data never passes through Python objects: the client reads
//! and writes kvpool's registered staging memory through raw pointers (`batch_upsert_from`,
//! `batch_get_into`), and it releases the GIL while it transfers. A client over Mooncake's C API
//! (`store_c.h`) would implement the same [`MooncakeStoreClient`] trait.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyList;

use super::{MooncakeConfig, MooncakeStoreClient, RawBuffer};

/// `MooncakeDistributedStore` from the `mooncake-transfer-engine` wheel, set up and connected.
pub struct PythonStoreClient {
    store: Py<PyAny>,
    replicate_config: Py<PyAny>,
}

/// Python exceptions become strings that say where they came from.
fn describe(py: Python<'_>, what: &str, e: PyErr) -> String {
    let trace = e
        .traceback(py)
        .and_then(|t| t.format().ok())
        .unwrap_or_default();
    format!("{what}: {e}{}", if trace.is_empty() { "" } else { "\n" }) + &trace
}

/// Where the Python package is looked for: the configured directories, then
/// `KVPOOL_MOONCAKE_PYTHONPATH` (colon-separated), then an active virtualenv's site-packages.
fn site_dirs(config: &MooncakeConfig) -> Vec<PathBuf> {
    let mut dirs = config.python_path.clone();
    if let Ok(extra) = std::env::var("KVPOOL_MOONCAKE_PYTHONPATH") {
        dirs.extend(
            extra
                .split(':')
                .filter(|s| !s.is_empty())
                .map(PathBuf::from),
        );
    }
    dirs
}

impl PythonStoreClient {
    /// Starts the embedded interpreter (once per process), imports `mooncake.store` and calls
    /// `setup` with `config`. Blocks until Mooncake has connected to its master.
    pub fn setup(config: &MooncakeConfig) -> Result<Self, String> {
        Python::initialize();
        Python::attach(|py| {
            let site = py
                .import("site")
                .map_err(|e| describe(py, "import site", e))?;
            for dir in site_dirs(config) {
                site.call_method1("addsitedir", (dir.display().to_string(),))
                    .map_err(|e| describe(py, "site.addsitedir", e))?;
            }
            if let Ok(venv) = std::env::var("VIRTUAL_ENV") {
                let version = py.version_info();
                let dir = format!(
                    "{venv}/lib/python{}.{}/site-packages",
                    version.major, version.minor
                );
                site.call_method1("addsitedir", (dir,))
                    .map_err(|e| describe(py, "site.addsitedir", e))?;
            }
            let module = py.import("mooncake.store").map_err(|e| {
                format!(
                    "cannot import the Mooncake Python client ({e}); install it with `pip install \
                     mooncake-transfer-engine-non-cuda` (or the CUDA build) for Python {}.{} and \
                     point kvpool at its site-packages with KVPOOL_MOONCAKE_PYTHONPATH or the \
                     tier's `python_path`",
                    py.version_info().major,
                    py.version_info().minor
                )
            })?;
            let store = module
                .getattr("MooncakeDistributedStore")
                .and_then(|class| class.call0())
                .map_err(|e| describe(py, "MooncakeDistributedStore()", e))?;
            let code: i64 = store
                .call_method1(
                    "setup",
                    (
                        config.local_hostname.as_str(),
                        config.metadata_server.as_str(),
                        config.global_segment_size,
                        config.local_buffer_size,
                        config.protocol.as_str(),
                        config.device_name.as_str(),
                        config.master_server_address.as_str(),
                    ),
                )
                .and_then(|r| r.extract())
                .map_err(|e| describe(py, "MooncakeDistributedStore.setup", e))?;
            if code != 0 {
                return Err(format!(
                    "Mooncake setup failed with code {code} ({}): is mooncake_master running at \
                     {} and is the metadata server `{}` reachable?",
                    super::describe_code(code),
                    config.master_server_address,
                    config.metadata_server
                ));
            }
            let replicate_config = module
                .getattr("ReplicateConfig")
                .and_then(|class| class.call0())
                .and_then(|c| {
                    c.setattr("replica_num", config.replica_num)?;
                    Ok(c)
                })
                .map_err(|e| describe(py, "ReplicateConfig", e))?;
            Ok(PythonStoreClient {
                store: store.unbind(),
                replicate_config: replicate_config.unbind(),
            })
        })
    }

    /// Runs `f` on the store object with the GIL held; Python errors become strings.
    fn with_store<T>(
        &self,
        what: &str,
        f: impl for<'py> FnOnce(Python<'py>, &Bound<'py, PyAny>) -> PyResult<T>,
    ) -> Result<T, String> {
        Python::attach(|py| f(py, self.store.bind(py)).map_err(|e| describe(py, what, e)))
    }
}

fn pointers_and_sizes(buffers: &[RawBuffer]) -> (Vec<usize>, Vec<usize>) {
    buffers.iter().map(|b| (b.ptr as usize, b.len)).unzip()
}

impl MooncakeStoreClient for PythonStoreClient {
    fn name(&self) -> &str {
        "python mooncake.store"
    }

    unsafe fn register_buffer(&self, buffer: RawBuffer) -> Result<i64, String> {
        let (ptr, len) = (buffer.ptr as usize, buffer.len);
        self.with_store("register_buffer", |_, store| {
            store.call_method1("register_buffer", (ptr, len))?.extract()
        })
    }

    unsafe fn batch_upsert_from(
        &self,
        keys: &[String],
        buffers: &[RawBuffer],
    ) -> Result<Vec<i64>, String> {
        if let ([key], [buffer]) = (keys, buffers) {
            // The single-key call skips the batch machinery (measurably faster for one value).
            let (ptr, len) = (buffer.ptr as usize, buffer.len);
            let config = &self.replicate_config;
            return self.with_store("upsert_from", |py, store| {
                let code: i64 = store
                    .call_method1("upsert_from", (key, ptr, len, config.bind(py)))?
                    .extract()?;
                Ok(vec![code])
            });
        }
        let (ptrs, sizes) = pointers_and_sizes(buffers);
        let config = &self.replicate_config;
        self.with_store("batch_upsert_from", |py, store| {
            store
                .call_method1("batch_upsert_from", (keys, ptrs, sizes, config.bind(py)))?
                .extract()
        })
    }

    unsafe fn batch_get_into(
        &self,
        keys: &[String],
        buffers: &[RawBuffer],
    ) -> Result<Vec<i64>, String> {
        if let ([key], [buffer]) = (keys, buffers) {
            let (ptr, len) = (buffer.ptr as usize, buffer.len);
            return self.with_store("get_into", |_, store| {
                let code: i64 = store.call_method1("get_into", (key, ptr, len))?.extract()?;
                Ok(vec![code])
            });
        }
        let (ptrs, sizes) = pointers_and_sizes(buffers);
        self.with_store("batch_get_into", |_, store| {
            store
                .call_method1("batch_get_into", (keys, ptrs, sizes))?
                .extract()
        })
    }

    fn get_size(&self, key: &str) -> Result<i64, String> {
        self.with_store("get_size", |_, store| {
            store.call_method1("get_size", (key,))?.extract()
        })
    }

    fn batch_is_exist(&self, keys: &[String]) -> Result<Vec<i64>, String> {
        self.with_store("batch_is_exist", |py, store| {
            store
                .call_method1("batch_is_exist", (PyList::new(py, keys)?,))?
                .extract()
        })
    }

    fn batch_remove(&self, keys: &[String]) -> Result<Vec<i64>, String> {
        // `force`: a just-written object holds a lease (10 s by default) during which a plain
        // remove fails with -706; kvpool removes only what it decided to drop (corrupt or
        // evicted), so the lease must not keep it.
        self.with_store("batch_remove", |_, store| {
            store.call_method1("batch_remove", (keys, true))?.extract()
        })
    }

    fn close(&self) -> Result<i64, String> {
        self.with_store("close", |_, store| store.call_method0("close")?.extract())
    }
}
