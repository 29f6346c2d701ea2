//! `kvpool._native.Worker`: the worker half inside a vLLM Worker process, the Python face of
//! `WorkerCore` (`worker_core.rs`). It owns the pool (L1 and lower tiers), answers the
//! scheduler's lookups on a Unix socket, and plans each step's block copies, which
//! kvpool-cuda's executors run (`Worker.run_copies` with a `CopyEngine`) or the Python side
//! with torch (`kvpool.transfer`).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use kvpool_connector::vllm::VllmEngineFacts;
use kvpool_connector::vllm::step_timing::StepTimer;
use kvpool_core::{Dtype, KvKind};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::py_copies::PyCopyEngine;
use crate::py_copy_job::PyCopyJob;
use crate::worker_core::{WorkerCore, WorkerSpec};

/// A tier event for Python: (tier, stored (else removed), chunk hashes).
type PyTierEvent<'py> = (String, bool, Vec<Bound<'py, PyBytes>>);

/// A mapping of the node's pool daemon's shared memory in this process, kept mapped while
/// this object lives: what a GPU engine page-locks for DMA (`kvpool.transfer.MappingPin`),
/// registered and unregistered within that life, so that no registration outlives the
/// mapping (a later mapping at the same address would then be read through stale pages).
#[pyclass(name = "NodeMemoryRegion", module = "kvpool._native", frozen)]
pub struct NodeMemoryRegion {
    mapping: Arc<kvpool_core::memory::SharedMapping>,
}

#[pymethods]
impl NodeMemoryRegion {
    /// The first byte's address.
    #[getter]
    fn address(&self) -> usize {
        self.mapping.as_ptr().as_ptr() as usize
    }

    /// Its length in bytes.
    #[getter]
    fn length(&self) -> usize {
        self.mapping.len()
    }
}

/// The worker half of the vLLM connector (one per vLLM worker process / TP rank).
#[pyclass(name = "Worker", module = "kvpool._native")]
pub struct PyWorker {
    core: Mutex<WorkerCore>,
    /// Called once when this object is dropped, before `core` (and L1's arena with it) is:
    /// where the Python side ends the arena's page-locking (`kvpool.transfer.HostMemoryPin`).
    /// A weak-reference finalizer would be too late: pyo3 drops the Rust value first.
    before_free: Mutex<Option<Py<PyAny>>>,
    /// kvpool's time in each call of vLLM's hooks, and per engine step (`kvpool::step`).
    steps: StepTimer,
}

impl Drop for PyWorker {
    fn drop(&mut self) {
        let callback = self
            .before_free
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some(callback) = callback {
            Python::attach(|py| {
                if let Err(e) = callback.call0(py) {
                    e.write_unraisable(py, None);
                }
            });
        }
        // Fields drop after this body: the arena is freed only now.
    }
}

fn runtime_err(e: impl ToString) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

pub(crate) fn core_guard(w: &PyWorker) -> PyResult<std::sync::MutexGuard<'_, WorkerCore>> {
    crate::lock(&w.core)
}

impl PyWorker {
    /// Runs `f`, one of vLLM's hooks into kvpool, with the GIL released, timed as `call` in
    /// the step's timing (`kvpool_connector_call_seconds`, the `kvpool::step` event).
    fn timed<R: Send>(
        &self,
        py: Python<'_>,
        call: &'static str,
        f: impl FnOnce() -> R + Send,
    ) -> R {
        py.detach(|| self.steps.time(call, f))
    }
}

#[pymethods]
impl PyWorker {
    /// Builds the pool for this worker and starts answering lookups on `socket_path`.
    /// `weights` is the digest of the weights loaded (bound into every key); `kind` is `"kv"`
    /// (K and V per token) or `"latent"` (MLA: one latent vector per token); `replicated`: the
    /// KV is the same on every tensor-parallel rank (MLA), so keys leave the rank out.
    #[new]
    ///
    /// With `share_pool_with`, no pool is built: this worker serves another part of the same
    /// engine's KV (one KV cache group of a hybrid model; `kv_format` names the group, so its
    /// keys are its own) over that worker's pool, one of `parts` such workers. With
    /// `null_block`, that block id is the engine's null block, never read or written (vLLM's
    /// block 0 under its hybrid KV cache manager).
    #[pyo3(signature = (*, config_text, config_format, model, weights, tp_size, tp_rank, pp_rank, block_size, num_layers, num_kv_heads, head_size, dtype, kv_format, kind="kv", replicated=false, socket_path=None, share_pool_with=None, parts=1, null_block=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        config_text: String,
        config_format: String,
        model: String,
        weights: String,
        tp_size: u32,
        tp_rank: u32,
        pp_rank: u32,
        block_size: usize,
        num_layers: usize,
        num_kv_heads: usize,
        head_size: usize,
        dtype: &str,
        kv_format: String,
        kind: &str,
        replicated: bool,
        socket_path: Option<String>,
        share_pool_with: Option<PyRef<'_, PyWorker>>,
        parts: usize,
        null_block: Option<u32>,
    ) -> PyResult<Self> {
        let dtype: Dtype = dtype
            .trim_start_matches("torch.")
            .parse()
            .map_err(|e: kvpool_core::LayoutError| PyValueError::new_err(e.to_string()))?;
        let kind = match kind {
            "kv" => KvKind::KeyValue,
            "latent" => KvKind::MlaLatent,
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown KV kind `{other}` (expected kv or latent)"
                )));
            }
        };
        let spec = WorkerSpec {
            config_text,
            config_format,
            facts: VllmEngineFacts {
                model,
                weights,
                tp_size,
                tp_rank,
                pp_rank,
                block_size,
                num_layers,
                num_kv_heads,
                head_size,
                dtype,
                kind,
                replicated,
                kv_format,
            },
            socket_path: socket_path.map(PathBuf::from),
        };
        let mut core = match share_pool_with {
            None => py.detach(|| WorkerCore::new(&spec)),
            Some(owner) => {
                let owner = core_guard(&owner)?.pool_handles();
                py.detach(|| WorkerCore::sharing_pool_of(&owner, &spec, parts))
            }
        }
        .map_err(PyValueError::new_err)?;
        core.worker.set_null_block(null_block);
        core.share_load_bound(parts);
        Ok(PyWorker {
            steps: StepTimer::new(spec.facts.kv_format.clone(), spec.facts.tp_rank),
            core: Mutex::new(core),
            before_free: Mutex::new(None),
        })
    }

    /// Binds a step's metadata (bytes from `Scheduler.build_connector_meta`): applies the
    /// scheduler's decisions, fetches the step's synchronous loads and starts its
    /// asynchronous ones.
    fn bind(&self, py: Python<'_>, meta: &[u8]) -> PyResult<()> {
        let meta = meta.to_vec();
        self.timed(py, "bind", || {
            core_guard(self)?
                .worker
                .bind_connector_metadata(&meta)
                .map_err(runtime_err)
        })
    }

    /// Unbinds the step (vLLM's last hook of each step): ends the step's timing, logged at
    /// `debug` on `kvpool::step`.
    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            let cleared = self.steps.time("clear", || -> PyResult<()> {
                core_guard(self)?.worker.clear_connector_metadata();
                Ok(())
            });
            // The step ends whether or not the clear failed: its calls are not the next's.
            self.steps.end_step();
            cleared
        })
    }

    /// Loads to copy into the engine's blocks now: the step's synchronous loads, then
    /// asynchronous loads whose chunks arrived. Each is a `CopyJob`.
    fn load_jobs(&self, py: Python<'_>) -> PyResult<Vec<PyCopyJob>> {
        self.timed(py, "load_jobs", || {
            Ok(core_guard(self)?
                .worker
                .take_load_jobs()
                .into_iter()
                .map(PyCopyJob)
                .collect())
        })
    }

    /// Saves to copy out of the engine's blocks now (after the forward pass).
    fn save_jobs(&self, py: Python<'_>) -> PyResult<Vec<PyCopyJob>> {
        // Waits for the checks of the step's loads first (the GIL released meanwhile).
        self.timed(py, "save_jobs", || {
            Ok(core_guard(self)?
                .worker
                .take_save_jobs()
                .into_iter()
                .map(PyCopyJob)
                .collect())
        })
    }

    /// Plans and starts the step's load jobs (`load`: the step's synchronous loads, then
    /// asynchronous loads whose chunks arrived) or save jobs with `engine`, their copies
    /// ordered after `stream` (the engine's compute stream, `cuda_stream`; 0 on CPU). On CPU
    /// every job is done, and reported, on return; on a GPU, `poll_copies` reports them.
    /// Returns how many jobs it started.
    fn run_copies(
        &self,
        py: Python<'_>,
        engine: Py<PyCopyEngine>,
        load: bool,
        stream: usize,
    ) -> PyResult<usize> {
        let call = if load { "run_loads" } else { "run_saves" };
        self.timed(py, call, || {
            let mut core = core_guard(self)?;
            engine.get().run_worker_jobs(&mut core.worker, load, stream)
        })
    }

    /// Reports the jobs `engine` finished since the last call (a GPU's; on CPU none pend).
    fn poll_copies(&self, py: Python<'_>, engine: Py<PyCopyEngine>) -> PyResult<()> {
        self.timed(py, "poll", || {
            engine.get().poll_into(&mut core_guard(self)?.worker)
        })
    }

    /// Waits on the host for the synchronous loads whose staged copies are in flight (a
    /// GPU's: their copies started before the forward pass) and reports them: before the
    /// step's results leave the worker, as vLLM uses their blocks in this step and a staged
    /// copy that fails its check must be reported as failed blocks of this step.
    fn settle_copies(&self, py: Python<'_>, engine: Py<PyCopyEngine>) -> PyResult<()> {
        self.timed(py, "settle", || {
            engine.get().settle_into(&mut core_guard(self)?.worker)
        })
    }

    /// Makes `stream` wait for the copies still in flight on these requests' blocks (vLLM's
    /// `handle_preemptions`, before it reuses them).
    fn order_copies_before(
        &self,
        py: Python<'_>,
        engine: Py<PyCopyEngine>,
        req_ids: Vec<String>,
        stream: usize,
    ) -> PyResult<()> {
        self.timed(py, "order_copies_before", || {
            let jobs = core_guard(self)?.worker.jobs_in_flight_for(&req_ids);
            engine.get().order_before(&jobs, stream)
        })
    }

    /// Page-locks kvpool's host memory (L1's arena) for `engine`'s DMA (a GPU's), with a
    /// guard the arena owns: it unlocks, after `engine`'s copies, when the arena is freed.
    /// Returns whether it is page-locked (false on CPU); raises if part of it is page-locked
    /// already (memory freed while registered: copies through it could move stale pages).
    fn pin_host_memory(&self, py: Python<'_>, engine: Py<PyCopyEngine>) -> PyResult<bool> {
        py.detach(|| {
            let core = core_guard(self)?;
            engine.get().pin_host_region(core.worker.engine().storage())
        })
    }

    /// Starts page-locking the node daemon's shared memory as this process maps it now (a
    /// GPU's; each new mapping once, on a thread), with guards the mappings own.
    fn pin_node_memory(&self, py: Python<'_>, engine: Py<PyCopyEngine>) -> PyResult<()> {
        self.timed(py, "pin_node_memory", || {
            let mappings = core_guard(self)?
                .worker
                .engine()
                .storage()
                .node_memory_mappings();
            engine.get().pin_node_memory(mappings)
        })
    }

    /// A copy job ended (`ok`: it copied everything; else its blocks hold nothing usable).
    fn copy_done(&self, py: Python<'_>, job_id: u64, ok: bool) -> PyResult<()> {
        self.timed(py, "copy_done", || {
            core_guard(self)?.worker.copy_done(job_id, ok);
            Ok(())
        })
    }

    /// Copy jobs still in flight on these requests' blocks (vLLM `handle_preemptions`).
    fn jobs_in_flight_for(&self, py: Python<'_>, req_ids: Vec<String>) -> PyResult<Vec<u64>> {
        self.timed(py, "jobs_in_flight_for", || {
            Ok(core_guard(self)?.worker.jobs_in_flight_for(&req_ids))
        })
    }

    /// `(finished_sending, finished_recving)` for vLLM's `get_finished`.
    fn transfer_results(
        &self,
        py: Python<'_>,
        finished_req_ids: Vec<String>,
    ) -> PyResult<(Vec<String>, Vec<String>)> {
        self.timed(py, "transfer_results", || {
            let r = core_guard(self)?.worker.transfer_results(&finished_req_ids);
            Ok((r.finished_sending, r.finished_recving))
        })
    }

    /// Engine block ids whose load failed since the last call.
    fn failed_blocks(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        self.timed(py, "failed_blocks", || {
            Ok(core_guard(self)?.worker.get_block_ids_with_load_errors())
        })
    }

    /// `(request ids, unattributed)`: requests whose load failed since the last call, and
    /// whether blocks failed that no request was named for (then every load in flight must
    /// be taken as failed). For vLLM's `failed_recving`, under its hybrid KV cache manager.
    fn failed_load_requests(&self, py: Python<'_>) -> PyResult<(Vec<String>, bool)> {
        self.timed(py, "failed_load_requests", || {
            Ok(core_guard(self)?.worker.take_failed_load_requests())
        })
    }

    /// `(executed_steps, copied_steps)` since the last call, for the scheduler.
    fn step_report(&self, py: Python<'_>) -> PyResult<(Vec<u64>, Vec<u64>)> {
        self.timed(py, "step_report", || {
            let r = core_guard(self)?.worker.step_report();
            Ok((r.executed, r.copied))
        })
    }

    /// `(address, length)` of the host memory kvpool's chunks live in (L1's arena), for the
    /// engine side to page-lock once (CUDA); `None` without an L1 pool.
    fn host_memory(&self) -> PyResult<Option<(usize, usize)>> {
        Ok(core_guard(self)?.worker.engine().storage().host_region())
    }

    /// This process's mappings of the node's pool daemon's shared memory, as mapped now (none
    /// before the worker first reached the daemon; a new one after the daemon restarted):
    /// for the engine side to page-lock for CUDA DMA, each for as long as it holds the
    /// region object, which keeps the mapping in place until then.
    fn node_memory_regions(&self) -> PyResult<Vec<NodeMemoryRegion>> {
        Ok(core_guard(self)?
            .worker
            .engine()
            .storage()
            .node_memory_mappings()
            .into_iter()
            .map(|mapping| NodeMemoryRegion { mapping })
            .collect())
    }

    /// Gives the worker the engine's KV planes in host memory (vLLM's CPU tensors): one
    /// `(address of block 0, bytes between blocks)` per plane, in the chunk layout's plane
    /// order, of `num_blocks` blocks of `plane_block_bytes`. The worker then reads a load's
    /// blocks to check the copy of a chunk it copied straight from the node's pool daemon
    /// (one copy instead of two). The caller keeps the tensors alive while it uses the worker.
    fn set_host_planes(
        &self,
        planes: Vec<(usize, usize)>,
        plane_block_bytes: usize,
        num_blocks: usize,
    ) -> PyResult<()> {
        // SAFETY: the engine side registers its KV tensors, which live as long as the engine
        // (and this worker's use); `HostPlanes::new` refuses null, overlapping and wrapping
        // planes.
        let planes =
            unsafe { kvpool_connector::HostPlanes::new(planes, plane_block_bytes, num_blocks) }
                .map_err(|e| PyValueError::new_err(format!("kvpool: {e}")))?;
        core_guard(self)?
            .worker
            .set_host_planes(planes)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Tells the worker that the engine side stages each load's chunk from the node's pool
    /// daemon in the buffer a job names for it (`check_copy_ptrs`: on a GPU, read back from
    /// the one device copy the blocks were filled from), and checks those buffers behind the
    /// forward pass: the daemon's chunks are then copied once, from its shared memory, rather
    /// than into L1 first.
    fn check_staged_copies(&self) -> PyResult<()> {
        core_guard(self)?.worker.check_staged_copies();
        Ok(())
    }

    /// Calls `callback()` once when this worker is freed, before the host memory of
    /// [`host_memory`](Self::host_memory) is (replacing an earlier callback): for the engine
    /// side to end what it set up on that memory, such as CUDA's page-locking.
    fn call_before_free(&self, callback: Py<PyAny>) -> PyResult<()> {
        *crate::lock(&self.before_free)? = Some(callback);
        Ok(())
    }

    /// `(copy jobs in flight, async loads, staged save bytes, held requests)`.
    fn in_flight(&self) -> PyResult<(usize, usize, usize, usize)> {
        Ok(core_guard(self)?.worker.in_flight())
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

    /// This worker's chunks that entered or left a tier since the last call: a list of
    /// `(tier, stored, [chunk hash bytes])`, `stored` false for a removal or eviction.
    fn take_tier_events<'py>(&self, py: Python<'py>) -> PyResult<Vec<PyTierEvent<'py>>> {
        self.steps.time("take_tier_events", || {
            let core = core_guard(self)?;
            let engine = core.worker.engine();
            // This worker's own chunks: a hybrid model's parts share the pool (and its log).
            let events = engine
                .storage()
                .tier_events()
                .drain_scope(engine.token_database().scope().digest());
            Ok(events
                .into_iter()
                .map(|e| {
                    (
                        e.tier,
                        e.kind == kvpool_core::storage::tier_events::TierEventKind::Stored,
                        e.chunk_hashes
                            .iter()
                            .map(|h| PyBytes::new(py, &h.0))
                            .collect(),
                    )
                })
                .collect())
        })
    }

    /// Counters since the worker started, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.steps.time("stats", || {
            let core = core_guard(self)?;
            let w = core.worker.stats();
            let engine = core.worker.engine().clone();
            let e = engine.stats();
            let leases = core.worker.leases().stats();
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
            d.set_item("async_loads", w.async_loads)?;
            d.set_item("sync_loads", w.sync_loads)?;
            d.set_item("failed_load_blocks", w.failed_load_blocks)?;
            d.set_item("node_memory_tokens", w.node_memory_tokens)?;
            d.set_item("node_memory_staged_tokens", w.node_memory_staged_tokens)?;
            d.set_item("node_memory_saved_tokens", w.node_memory_saved_tokens)?;
            d.set_item("saved_tokens", w.saved_tokens)?;
            d.set_item("stored_tokens", w.stored_tokens)?;
            // The KV bytes of those tokens in this worker's layout (chunk headers aside).
            d.set_item(
                "stored_bytes",
                w.stored_tokens * engine.layout().bytes_per_token() as u64,
            )?;
            d.set_item("save_errors", w.save_errors)?;
            d.set_item("saves_discarded", w.saves_discarded)?;
            d.set_item("heap_buffers", w.heap_buffers)?;
            d.set_item("lookups", e.lookups)?;
            d.set_item("rejected_chunks", e.rejected_chunks)?;
            d.set_item("corrupt_chunks", corrupt + e.rejected_chunks)?;
            d.set_item("leases_expired", leases.expired)?;
            Ok(d)
        })
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
        py.detach(|| core_guard(self)?.close().map_err(runtime_err))
    }
}
