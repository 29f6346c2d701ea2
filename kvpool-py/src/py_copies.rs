//! `kvpool._native.CopyEngine`: kvpool-cuda's executors for the engine side. The Python side
//! hands it the engine's KV planes (addresses and strides) once; the worker then plans and
//! runs each step's copies in Rust (`Worker.run_copies`), on CPU tensors with the host
//! executor (memcpy), on a GPU with kvpool-cuda's batched copies on its own stream, and pages
//! kvpool's host memory in for DMA with guards owned by that memory.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvpool_connector::{ConnectorWorker, CopyDirection, CopyJob};
use kvpool_core::memory::SharedMapping;
use kvpool_cuda::{
    CopyMode, CudaCopyEngine, CudaDriver, CudarcDriver, Direction, HostExecutor, HostRegistration,
    JobSpec, KvPlanes, Plane, RawStream, RegisterError,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::py_copy_job::PyCopyJob;

/// Where the engine's KV is, and so which executor runs the plans.
enum Executor {
    /// Host memory (vLLM's CPU build): memcpy, done when `run` returns.
    Host(HostExecutor),
    /// A GPU: batched copies on kvpool's stream, done once polled.
    Cuda(CudaCopyEngine),
}

/// A mapping of the node daemon's arena being (or done being) page-locked.
struct NodePin {
    mapping: Weak<SharedMapping>,
    registering: Option<JoinHandle<()>>,
}

/// The state behind [`PyCopyEngine`].
pub(crate) struct Copies {
    executor: Executor,
    /// Synchronous loads with staged copies still in flight (GPU): waited for before the
    /// step's results leave the worker, since the forward pass reads their blocks.
    staged_loads: HashSet<u64>,
    node_pins: Vec<NodePin>,
    /// Jobs queued on a GPU, and those whose pages went through the copy kernel.
    jobs: u64,
    kernel_jobs: u64,
}

/// Runs the copy jobs a worker plans: see the module docs. One per engine (vLLM worker).
#[pyclass(name = "CopyEngine", module = "kvpool._native", frozen)]
pub struct PyCopyEngine {
    pub(crate) copies: Mutex<Copies>,
    kind: &'static str,
    describe: String,
}

fn direction(job: &CopyJob) -> Direction {
    match job.direction {
        CopyDirection::Load => Direction::Load,
        CopyDirection::Save => Direction::Save,
    }
}

/// A job's addresses as the plan builder takes them.
struct Addresses {
    chunks: Vec<u64>,
    staged: Vec<u64>,
}

impl Addresses {
    fn of(job: &CopyJob) -> Self {
        Addresses {
            chunks: job.chunk_ptrs.iter().map(|&p| p as u64).collect(),
            staged: job.check_copy_ptrs.iter().map(|&p| p as u64).collect(),
        }
    }

    fn spec<'a>(&'a self, job: &'a CopyJob) -> JobSpec<'a> {
        JobSpec {
            direction: direction(job),
            block_ids: &job.block_ids,
            skip_blocks: job.skip_blocks,
            chunk_blocks: &job.chunk_blocks,
            block_bytes: job.block_bytes as u64,
            chunk_ptrs: &self.chunks,
            check_copy_ptrs: &self.staged,
        }
    }
}

impl Copies {
    /// Starts `job`'s copies. `Ok(true)`: done already (host); `Ok(false)`: queued (GPU, to
    /// be polled); an error: nothing of it is in flight.
    ///
    /// # Safety
    /// The job's chunk and staged-copy addresses are host memory of their chunks' lengths
    /// that stay valid until the job is reported done (the worker's buffers and leases).
    unsafe fn start(&mut self, job: &CopyJob, compute: RawStream) -> Result<bool, String> {
        let addresses = Addresses::of(job);
        let spec = addresses.spec(job);
        match &mut self.executor {
            // SAFETY: the caller's contract.
            Executor::Host(host) => unsafe { host.run(&spec) }
                .map(|_| true)
                .map_err(|e| e.to_string()),
            Executor::Cuda(engine) => {
                // SAFETY: the caller's contract; `compute` is the engine's stream.
                let submitted =
                    unsafe { engine.submit(job.id, &spec, compute) }.map_err(|e| e.to_string())?;
                self.jobs += 1;
                self.kernel_jobs += u64::from(submitted.kernel);
                if job.direction == CopyDirection::Load
                    && !job.asynchronous
                    && job.check_copy_ptrs.iter().any(|&p| p != 0)
                {
                    self.staged_loads.insert(job.id);
                }
                Ok(false)
            }
        }
    }

    /// Jobs that ended since the last call, with their outcome.
    fn poll(&mut self) -> Vec<(u64, bool)> {
        let Executor::Cuda(engine) = &mut self.executor else {
            return Vec::new();
        };
        let ended = report(engine.poll());
        for (job, _) in &ended {
            self.staged_loads.remove(job);
        }
        ended
    }

    /// Waits for the synchronous loads whose staged copies are in flight; returns them ended.
    fn settle_staged_loads(&mut self) -> Vec<(u64, bool)> {
        let Executor::Cuda(engine) = &mut self.executor else {
            return Vec::new();
        };
        let jobs: Vec<u64> = self.staged_loads.drain().collect();
        if jobs.is_empty() {
            return Vec::new();
        }
        report(engine.wait(&jobs))
    }
}

fn report(ended: Vec<(u64, Result<(), kvpool_cuda::CudaError>)>) -> Vec<(u64, bool)> {
    ended
        .into_iter()
        .map(|(job, outcome)| {
            if let Err(e) = &outcome {
                tracing::error!("kvpool: copy job {job} failed on the device: {e}");
            }
            (job, outcome.is_ok())
        })
        .collect()
}

fn lock(copies: &Mutex<Copies>) -> PyResult<std::sync::MutexGuard<'_, Copies>> {
    crate::lock(copies)
}

impl PyCopyEngine {
    /// Takes the worker's load (`load`) or save jobs and starts them; reports to the worker
    /// what ended already (all of them on CPU) and what failed. Returns how many it started.
    pub(crate) fn run_worker_jobs(
        &self,
        worker: &mut ConnectorWorker,
        load: bool,
        compute: usize,
    ) -> PyResult<usize> {
        // Locked before the jobs are taken: a job taken and never started would stay in
        // flight for ever.
        let mut copies = lock(&self.copies)?;
        let jobs = if load {
            worker.take_load_jobs()
        } else {
            worker.take_save_jobs()
        };
        for job in &jobs {
            // SAFETY: the worker keeps each job's buffers (and the leases of what it loads)
            // until the job is reported done, which happens below or once polled.
            match unsafe { copies.start(job, RawStream(compute)) } {
                Ok(true) => worker.copy_done(job.id, true),
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(
                        "kvpool: copy job {} ({}) failed: {e}; its blocks are recomputed",
                        job.id,
                        job.req_id
                    );
                    worker.copy_done(job.id, false);
                }
            }
        }
        Ok(jobs.len())
    }

    /// Reports to the worker the jobs that ended since the last call.
    pub(crate) fn poll_into(&self, worker: &mut ConnectorWorker) -> PyResult<()> {
        for (job, ok) in lock(&self.copies)?.poll() {
            worker.copy_done(job, ok);
        }
        Ok(())
    }

    /// Waits for the synchronous loads whose staged copies are in flight and reports them.
    pub(crate) fn settle_into(&self, worker: &mut ConnectorWorker) -> PyResult<()> {
        for (job, ok) in lock(&self.copies)?.settle_staged_loads() {
            worker.copy_done(job, ok);
        }
        Ok(())
    }

    /// Makes `stream` wait for these jobs' copies (GPU; on CPU they are done).
    pub(crate) fn order_before(&self, jobs: &[u64], stream: usize) -> PyResult<()> {
        if let Executor::Cuda(engine) = &lock(&self.copies)?.executor {
            engine
                .order_before(jobs, RawStream(stream))
                .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        }
        Ok(())
    }

    /// Page-locks L1's arena for DMA (GPU), the guard attached to the arena itself. Returns
    /// whether it is page-locked; refuses memory page-locked already.
    pub(crate) fn pin_host_region(&self, storage: &kvpool_core::StorageManager) -> PyResult<bool> {
        let Executor::Cuda(engine) = &lock(&self.copies)?.executor else {
            return Ok(false);
        };
        let Some((ptr, len)) = storage.host_region() else {
            return Ok(false);
        };
        // SAFETY: the guard goes to the arena's own guards, which end before it is freed.
        let guard = unsafe {
            HostRegistration::register(
                engine.driver().clone(),
                ptr,
                len,
                vec![engine.copy_stream()],
            )
        };
        match guard {
            Ok(guard) => match storage.attach_to_host_region(Box::new(guard)) {
                Ok(()) => Ok(true),
                // The memory cannot hold the guard: it unlocks as it drops here.
                Err(_guard) => {
                    tracing::warn!(
                        "kvpool: kvpool's host memory cannot hold its page-locking; copies \
                         to and from the GPU go through pageable memory (slower)"
                    );
                    Ok(false)
                }
            },
            Err(e @ RegisterError::AlreadyRegistered { .. }) => {
                Err(PyRuntimeError::new_err(format!("kvpool: {e}")))
            }
            Err(e) => {
                tracing::warn!(
                    "kvpool: could not page-lock kvpool's host memory ({len} bytes): {e}; \
                     copies to and from the GPU go through pageable memory (slower)"
                );
                Ok(false)
            }
        }
    }

    /// Starts page-locking (GPU) each mapping of the node daemon's arena not seen before, on
    /// a thread of its own (a large arena takes a while); the guard goes to the mapping, so it
    /// ends before the mapping is unmapped. Until then, copies read pageable memory: slower,
    /// as correct.
    pub(crate) fn pin_node_memory(&self, mappings: Vec<Arc<SharedMapping>>) -> PyResult<()> {
        let mut copies = lock(&self.copies)?;
        let Executor::Cuda(engine) = &copies.executor else {
            return Ok(());
        };
        let driver = engine.driver().clone();
        let stream = engine.copy_stream();
        copies.node_pins.retain(|p| p.mapping.strong_count() > 0);
        for mapping in mappings {
            let known = copies.node_pins.iter().any(|p| {
                p.mapping
                    .upgrade()
                    .is_some_and(|m| Arc::ptr_eq(&m, &mapping))
            });
            if known {
                continue;
            }
            let weak = Arc::downgrade(&mapping);
            let driver: Arc<dyn CudaDriver> = driver.clone();
            let stream = stream.clone();
            let registering = std::thread::Builder::new()
                .name("kvpool-pin-node-memory".into())
                .spawn(move || {
                    let (ptr, len) = (mapping.as_ptr().as_ptr() as usize, mapping.len());
                    // SAFETY: the guard goes to the mapping's own guards, which end before it
                    // is unmapped; this thread holds the mapping meanwhile.
                    match unsafe { HostRegistration::register(driver, ptr, len, vec![stream]) } {
                        Ok(guard) => mapping.attach(Box::new(guard)),
                        Err(e) => tracing::warn!(
                            "kvpool: could not page-lock the pool daemon's shared memory ({len} \
                             bytes): {e}; copies from it go through pageable memory (slower)"
                        ),
                    }
                })
                .map_err(|e| PyRuntimeError::new_err(format!("kvpool: no thread: {e}")))?;
            copies.node_pins.push(NodePin {
                mapping: weak,
                registering: Some(registering),
            });
        }
        Ok(())
    }
}

#[pymethods]
impl PyCopyEngine {
    /// An engine over the engine's KV planes: one `(address of block 0, bytes between
    /// blocks)` per plane, in the chunk layout's plane order, each `num_blocks` pages of
    /// `plane_block_bytes`. `device`: `None` for host memory (CPU tensors), else the CUDA
    /// device's ordinal; `mode` (CUDA): how pages move, `auto` (default: kvpool's copy
    /// kernel for small scattered pages, else batched DMA), `dma` or `kernel`. The caller
    /// keeps the tensors alive while the engine is used.
    #[new]
    #[pyo3(signature = (*, planes, plane_block_bytes, num_blocks, device=None, mode="auto"))]
    fn new(
        planes: Vec<(usize, usize)>,
        plane_block_bytes: usize,
        num_blocks: usize,
        device: Option<i32>,
        mode: &str,
    ) -> PyResult<Self> {
        let mode: CopyMode = mode
            .parse()
            .map_err(|e: String| PyValueError::new_err(format!("kvpool: {e}")))?;
        let planes = KvPlanes::new(
            planes
                .into_iter()
                .map(|(base, stride)| Plane {
                    base: base as u64,
                    row_stride: stride as u64,
                })
                .collect(),
            plane_block_bytes as u64,
            num_blocks as u64,
        )
        .map_err(|e| PyValueError::new_err(format!("kvpool: {e}")))?;
        let (executor, kind, describe) = match device {
            None => (
                // SAFETY: the caller keeps the tensors (host memory) alive while it uses the
                // engine; blocks being copied are not in use by the engine (its protocol).
                Executor::Host(unsafe { HostExecutor::new(planes) }),
                "host",
                "host memory (memcpy)".to_string(),
            ),
            Some(ordinal) => {
                let driver = CudarcDriver::new(ordinal)
                    .map_err(|e| PyRuntimeError::new_err(format!("kvpool: {e}")))?;
                let describe = driver.describe();
                let driver: Arc<dyn CudaDriver> = Arc::new(driver);
                // SAFETY: the caller keeps the tensors (device memory) alive.
                let mut engine = unsafe { CudaCopyEngine::new(driver, planes) }
                    .map_err(|e| PyRuntimeError::new_err(format!("kvpool: {e}")))?;
                engine.set_mode(mode);
                (
                    Executor::Cuda(engine),
                    "cuda",
                    format!("{describe}, pages by {mode:?}"),
                )
            }
        };
        Ok(PyCopyEngine {
            copies: Mutex::new(Copies {
                executor,
                staged_loads: HashSet::new(),
                node_pins: Vec::new(),
                jobs: 0,
                kernel_jobs: 0,
            }),
            kind,
            describe,
        })
    }

    /// `"host"` or `"cuda"`.
    #[getter]
    fn kind(&self) -> &'static str {
        self.kind
    }

    /// The device and how it copies, for logs.
    #[getter]
    fn description(&self) -> String {
        self.describe.clone()
    }

    /// Jobs whose pages went through kvpool's copy kernel, and jobs queued in all (GPU).
    #[getter]
    fn kernel_jobs(&self) -> PyResult<(u64, u64)> {
        let copies = lock(&self.copies)?;
        Ok((copies.kernel_jobs, copies.jobs))
    }

    /// Whether a job's copies go as one batch per phase (`cuMemcpyBatchAsync`).
    #[getter]
    fn batched(&self) -> PyResult<bool> {
        Ok(match &lock(&self.copies)?.executor {
            Executor::Host(_) => false,
            Executor::Cuda(engine) => engine.batched(),
        })
    }

    /// Runs one job (`Worker.load_jobs` / `save_jobs`), its copies ordered after `stream`'s
    /// work (GPU). Returns whether it is done already (host memory); otherwise `poll`
    /// reports it. For tests and the GPU check: the connector runs its jobs with
    /// `Worker.run_copies`.
    ///
    /// The caller keeps the job's buffers valid until it is reported done (a worker's jobs:
    /// until `Worker.copy_done`).
    #[pyo3(signature = (job, stream=0))]
    fn run(&self, py: Python<'_>, job: Py<PyCopyJob>, stream: usize) -> PyResult<bool> {
        py.detach(|| {
            let mut copies = lock(&self.copies)?;
            // SAFETY: the caller's contract (above).
            unsafe { copies.start(&job.get().0, RawStream(stream)) }
                .map_err(|e| PyValueError::new_err(format!("kvpool: {e}")))
        })
    }

    /// `(job id, ok)` of each job that ended since the last call (GPU; on CPU jobs are done
    /// when run).
    fn poll(&self, py: Python<'_>) -> PyResult<Vec<(u64, bool)>> {
        py.detach(|| Ok(lock(&self.copies)?.poll()))
    }

    /// Waits on the host for every copy queued on kvpool's stream (not the device).
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            if let Executor::Cuda(engine) = &lock(&self.copies)?.executor {
                engine
                    .synchronize()
                    .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
            }
            Ok(())
        })
    }

    /// Jobs queued and not yet reported.
    fn in_flight(&self) -> PyResult<usize> {
        Ok(match &lock(&self.copies)?.executor {
            Executor::Host(_) => 0,
            Executor::Cuda(engine) => engine.in_flight(),
        })
    }

    /// Waits up to `timeout` seconds for the page-locking of the node daemon's mappings
    /// started so far; returns, per mapping still held, whether it is page-locked.
    fn wait_node_memory_pinned(&self, py: Python<'_>, timeout: f64) -> PyResult<Vec<bool>> {
        py.detach(|| {
            let wait =
                Duration::try_from_secs_f64(timeout.clamp(0.0, 3600.0)).unwrap_or(Duration::ZERO);
            let deadline = Instant::now() + wait;
            // Polled with the lock let go in between: the step's copies go on meanwhile.
            loop {
                let busy = lock(&self.copies)?
                    .node_pins
                    .iter()
                    .any(|p| p.registering.as_ref().is_some_and(|h| !h.is_finished()));
                if !busy || Instant::now() >= deadline {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let mut copies = lock(&self.copies)?;
            for pin in &mut copies.node_pins {
                if pin.registering.as_ref().is_some_and(|h| h.is_finished())
                    && let Some(handle) = pin.registering.take()
                {
                    let _ = handle.join();
                }
            }
            Ok(copies
                .node_pins
                .iter()
                .filter_map(|p| p.mapping.upgrade())
                .map(|m| m.guards() > 0)
                .collect())
        })
    }
}
