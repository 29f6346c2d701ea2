//! `kvpool._native.Worker`: the worker half inside a vLLM Worker process. It owns the pool
//! (L1 and lower tiers), moves whole KV blocks between vLLM's tensors and the pool, and
//! answers the scheduler's lookups on a Unix socket.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvpool_connector::vllm::{VllmEngineFacts, pool_config_for_vllm};
use kvpool_connector::{ConnectorWorker, LookupServer};
use kvpool_core::{BlockKvCache, Dtype, KvKind, KvLayout};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::sync::Mutex;

/// Everything a worker needs, as the Python connector gathers it from vLLM.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    /// The pool config text and its format (see [`crate::parse_pool_config`]).
    pub config_text: String,
    /// `toml`, `json` or `default`.
    pub config_format: String,
    /// The engine facts (model, ranks, layout, block format).
    pub facts: VllmEngineFacts,
    /// Base address of each layer's KV tensor, in layer order.
    pub layer_ptrs: Vec<usize>,
    /// Blocks per layer tensor.
    pub num_blocks: usize,
    /// Bytes between two blocks of a layer tensor (its first stride times the element size).
    pub block_stride_bytes: usize,
    /// Where to answer the scheduler's lookups (`None`: no lookup server, e.g. in tests).
    pub socket_path: Option<PathBuf>,
}

/// The worker without Python: pool, connector worker, the engine's KV tensors, lookup server.
pub struct WorkerCore {
    worker: ConnectorWorker,
    kv: BlockKvCache,
    runtime: Arc<tokio::runtime::Runtime>,
    _server: Option<LookupServer>,
}

impl WorkerCore {
    /// Builds the pool and wraps the tensors.
    ///
    /// # Safety
    ///
    /// `spec.layer_ptrs` must each address `num_blocks * block_stride_bytes` bytes of memory
    /// that stays valid (and is not freed or moved) while the worker lives; vLLM's KV tensors
    /// live as long as the engine.
    pub unsafe fn new(spec: &WorkerSpec) -> Result<Self, String> {
        let base = crate::parse_pool_config(&spec.config_text, &spec.config_format)?;
        let config = pool_config_for_vllm(&base, &spec.facts).map_err(|e| e.to_string())?;
        let f = &spec.facts;
        let layout = KvLayout::new(
            f.num_layers,
            f.num_kv_heads,
            f.head_size,
            f.dtype,
            KvKind::KeyValue,
            f.block_size,
        )
        .map_err(|e| e.to_string())?;
        let block_bytes = layout.block_size * layout.bytes_per_token_per_layer();
        if spec.block_stride_bytes != block_bytes {
            return Err(format!(
                "vLLM's KV blocks are {} bytes apart but {} bytes long ({} tokens x {} KV heads x 2 x {} x {}): only contiguous blocks are supported",
                spec.block_stride_bytes,
                block_bytes,
                f.block_size,
                f.num_kv_heads,
                f.head_size,
                f.dtype
            ));
        }
        let runtime = Arc::new(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("kvpool-worker")
                .enable_all()
                .build()
                .map_err(|e| format!("cannot start kvpool's runtime: {e}"))?,
        );
        let pool = runtime
            .block_on(kvpool_backends::build_pool(&config))
            .map_err(|e| e.to_string())?;
        let mut worker = ConnectorWorker::new(pool.engine.clone(), runtime.clone(), f.block_size);
        worker
            .register_kv_caches(&layout)
            .map_err(|e| e.to_string())?;
        let bases: Vec<*mut u8> = spec.layer_ptrs.iter().map(|&p| p as *mut u8).collect();
        // SAFETY: forwarded from this function's contract.
        let kv = unsafe { BlockKvCache::from_raw_parts(layout, spec.num_blocks, &bases) }
            .map_err(|e| e.to_string())?;
        let server = match &spec.socket_path {
            Some(path) => Some(
                LookupServer::start(
                    path,
                    pool.engine.clone(),
                    runtime.clone(),
                    f.tp_rank,
                    Duration::from_secs(3600),
                )
                .map_err(|e| format!("cannot listen on {}: {e}", path.display()))?,
            ),
            None => None,
        };
        tracing::info!(model = %config.model.name, tiers = ?pool.engine.storage().tier_names(), "kvpool worker ready");
        Ok(WorkerCore {
            worker,
            kv,
            runtime,
            _server: server,
        })
    }

    /// Binds a step's metadata and performs its loads (all layers). Errors are about the
    /// metadata; load failures are reported through [`WorkerCore::failed_blocks`].
    pub fn start_load(&mut self, meta: &[u8]) -> Result<(), String> {
        self.worker
            .bind_connector_metadata(meta)
            .map_err(|e| e.to_string())?;
        self.worker
            .start_load_kv(&mut self.kv)
            .map_err(|e| e.to_string())?;
        self.worker.finish_loads().map_err(|e| e.to_string())
    }

    /// Saves the step's computed chunks and clears the metadata.
    pub fn save(&mut self) -> Result<(), String> {
        let result = self
            .worker
            .wait_for_save(&self.kv)
            .map_err(|e| e.to_string());
        self.worker.clear_connector_metadata();
        result
    }

    /// Blocks whose load failed since the last call.
    pub fn failed_blocks(&mut self) -> Vec<u32> {
        self.worker.get_block_ids_with_load_errors()
    }

    /// vLLM says these requests finished: their traces are logged and forgotten.
    pub fn finished(&mut self, req_ids: &[String]) {
        self.worker.get_finished(req_ids);
    }

    /// The chunk payloads the pool holds for `tokens` (whole chunks, in order, stopping at
    /// the first missing one): an inspection helper, not the data path.
    pub fn stored_chunks(&self, tokens: &[u32], extra_keys: &[u8]) -> Result<Vec<Vec<u8>>, String> {
        let engine = self.worker.engine();
        let spans = engine
            .token_database()
            .process_tokens_with_extra(tokens, None, extra_keys)
            .map_err(|e| e.to_string())?;
        let keys: Vec<_> = spans.iter().map(|s| s.key.clone()).collect();
        let chunks = self.runtime.block_on(engine.storage().get(&keys));
        Ok(chunks.iter().map(|c| c.data.as_slice().to_vec()).collect())
    }
}

/// A tier event for Python: (tier, stored (else removed), chunk hashes).
type PyTierEvent<'py> = (String, bool, Vec<Bound<'py, PyBytes>>);

/// The worker half of the vLLM connector (one per vLLM worker process / TP rank).
#[pyclass(name = "Worker", module = "kvpool._native")]
pub struct PyWorker {
    core: Mutex<WorkerCore>,
}

fn runtime_err(e: String) -> PyErr {
    PyRuntimeError::new_err(e)
}

fn core_guard(w: &PyWorker) -> PyResult<std::sync::MutexGuard<'_, WorkerCore>> {
    crate::lock(&w.core)
}

#[pymethods]
impl PyWorker {
    /// Builds the pool for this worker and starts answering lookups on `socket_path`.
    ///
    /// The KV tensors (`layer_ptrs`, one per layer) must stay alive as long as this object.
    #[new]
    #[pyo3(signature = (*, config_text, config_format, model, tp_size, tp_rank, pp_rank, block_size, num_kv_heads, head_size, dtype, kv_format, layer_ptrs, num_blocks, block_stride_bytes, socket_path=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        config_text: String,
        config_format: String,
        model: String,
        tp_size: u32,
        tp_rank: u32,
        pp_rank: u32,
        block_size: usize,
        num_kv_heads: usize,
        head_size: usize,
        dtype: &str,
        kv_format: String,
        layer_ptrs: Vec<usize>,
        num_blocks: usize,
        block_stride_bytes: usize,
        socket_path: Option<String>,
    ) -> PyResult<Self> {
        let dtype: Dtype = dtype
            .trim_start_matches("torch.")
            .parse()
            .map_err(|e: kvpool_core::LayoutError| PyValueError::new_err(e.to_string()))?;
        let spec = WorkerSpec {
            config_text,
            config_format,
            facts: VllmEngineFacts {
                model,
                tp_size,
                tp_rank,
                pp_rank,
                block_size,
                num_layers: layer_ptrs.len(),
                num_kv_heads,
                head_size,
                dtype,
                kv_format,
            },
            layer_ptrs,
            num_blocks,
            block_stride_bytes,
            socket_path: socket_path.map(PathBuf::from),
        };
        // SAFETY: the Python connector passes the data pointers of vLLM's KV tensors, which it
        // keeps referenced for the engine's life (documented above).
        let core = py
            .detach(|| unsafe { WorkerCore::new(&spec) })
            .map_err(PyValueError::new_err)?;
        Ok(PyWorker {
            core: Mutex::new(core),
        })
    }

    /// Binds the step's metadata (bytes from `Scheduler.build_connector_meta`) and loads what
    /// it asks for into the KV tensors, every layer, before the forward pass.
    fn start_load(&self, py: Python<'_>, meta: &[u8]) -> PyResult<()> {
        let meta = meta.to_vec();
        py.detach(|| core_guard(self)?.start_load(&meta).map_err(runtime_err))
    }

    /// Saves the step's newly computed chunks (after the forward pass) and unbinds the step.
    fn save(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| core_guard(self)?.save().map_err(runtime_err))
    }

    /// GPU block ids whose load failed since the last call.
    fn failed_blocks(&self) -> PyResult<Vec<u32>> {
        Ok(core_guard(self)?.failed_blocks())
    }

    /// vLLM's `finished_req_ids` of a step: each request's trace is logged (at debug level,
    /// target `kvpool::request`) and forgotten.
    fn finished(&self, req_ids: Vec<String>) -> PyResult<()> {
        core_guard(self)?.finished(&req_ids);
        Ok(())
    }

    /// Starts recording chunks entering and leaving each tier (vLLM's KV events are on).
    fn enable_tier_events(&self) -> PyResult<()> {
        core_guard(self)?
            .worker
            .engine()
            .storage()
            .tier_events()
            .enable();
        Ok(())
    }

    /// Chunks that entered or left a tier since the last call: a list of
    /// `(tier, stored, [chunk hash bytes])`, `stored` false for a removal or eviction.
    fn take_tier_events<'py>(&self, py: Python<'py>) -> PyResult<Vec<PyTierEvent<'py>>> {
        let events = core_guard(self)?
            .worker
            .engine()
            .storage()
            .tier_events()
            .drain();
        Ok(events
            .into_iter()
            .map(|e| {
                (
                    e.tier,
                    e.kind == kvpool_core::tier_events::TierEventKind::Stored,
                    e.chunk_hashes
                        .iter()
                        .map(|h| PyBytes::new(py, &h.0))
                        .collect(),
                )
            })
            .collect())
    }

    /// Counters since the worker started, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let core = core_guard(self)?;
        let w = core.worker.stats();
        let engine = core.worker.engine().clone();
        let e = engine.stats();
        let corrupt: u64 = engine
            .storage()
            .backend_stats()
            .iter()
            .map(|t| t.corrupt)
            .sum();
        let d = PyDict::new(py);
        d.set_item("steps", w.steps)?;
        d.set_item("load_requested_tokens", w.load_requested_tokens)?;
        d.set_item("loaded_tokens", w.loaded_tokens)?;
        d.set_item("failed_load_blocks", w.failed_load_blocks)?;
        d.set_item("stored_tokens", w.stored_tokens)?;
        d.set_item("save_errors", w.save_errors)?;
        d.set_item("saves_cut_by_failed_loads", w.saves_cut_by_failed_loads)?;
        d.set_item("lookups", e.lookups)?;
        d.set_item("rejected_chunks", e.rejected_chunks)?;
        d.set_item("corrupt_chunks", corrupt + e.rejected_chunks)?;
        Ok(d)
    }

    /// The stored chunk payloads for `tokens` (inspection and tests; copies the bytes).
    #[pyo3(signature = (tokens, extra_keys=Vec::new()))]
    fn stored_chunks<'py>(
        &self,
        py: Python<'py>,
        tokens: Vec<u32>,
        extra_keys: Vec<u8>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let chunks = py.detach(|| {
            core_guard(self)?
                .stored_chunks(&tokens, &extra_keys)
                .map_err(runtime_err)
        })?;
        Ok(chunks.iter().map(|c| PyBytes::new(py, c)).collect())
    }

    /// Flushes write-behind to lower tiers and closes them; the worker is unusable afterwards.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            let core = core_guard(self)?;
            let engine = core.worker.engine().clone();
            core.runtime
                .block_on(engine.storage().close())
                .map_err(|e| runtime_err(e.to_string()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_starts_empty_and_refuses_blocks_that_are_not_contiguous() {
        let facts = VllmEngineFacts {
            model: "tiny".into(),
            tp_size: 1,
            tp_rank: 0,
            pp_rank: 0,
            block_size: 4,
            num_layers: 2,
            num_kv_heads: 1,
            head_size: 2,
            dtype: Dtype::F32,
            kv_format: "test".into(),
        };
        let block_bytes = 4 * 2 * 2 * 4;
        let mut layers: Vec<Vec<u8>> = (0..2)
            .map(|l| (0..16 * block_bytes).map(|i| (i + l * 7) as u8).collect())
            .collect();
        let spec = WorkerSpec {
            config_text: "[chunking]\nchunk_size = 8\n[local_cpu]\nmax_size = \"1MiB\"\n".into(),
            config_format: "toml".into(),
            facts,
            layer_ptrs: layers.iter_mut().map(|l| l.as_mut_ptr() as usize).collect(),
            num_blocks: 16,
            block_stride_bytes: block_bytes,
            socket_path: None,
        };
        // SAFETY: `layers` outlives `core`.
        let mut core = unsafe { WorkerCore::new(&spec) }.unwrap();
        let chunks = core
            .stored_chunks(&(0..8).collect::<Vec<_>>(), &[])
            .unwrap();
        assert!(chunks.is_empty());
        let mut bad = spec.clone();
        bad.block_stride_bytes += 4;
        // SAFETY: as above.
        let err = unsafe { WorkerCore::new(&bad) }.err().unwrap();
        assert!(err.contains("only contiguous blocks"), "{err}");
        drop(core.failed_blocks());
    }
}
