//! The CUDA copy engine: runs copy plans between the engine's KV on a GPU and kvpool's host
//! chunks on kvpool's own stream, one `cuMemcpyBatchAsync` per phase of a job (per-segment
//! `cuMemcpyAsync` where the driver has no batch entry point), ordered after the engine's
//! compute stream with events, and polled for completion without synchronizing the device.
//!
//! Per job: an event recorded on the compute stream, which kvpool's stream waits for (a save
//! reads KV only once the forward pass queued before it wrote it; a load writes blocks only
//! after what the compute stream queued before, such as their zeroing); the phases' copies;
//! an event recorded after them, which [`CudaCopyEngine::poll`] queries and, for a load, the
//! compute stream waits for (the forward pass reads loaded blocks only after the copies).

use std::sync::Arc;

use crate::driver::{CudaDriver, CudaError, RawEvent, RawStream};
use crate::plan::{CopyPlan, Direction, JobSpec, KvPlanes, PlanError, PlanStats};

/// Why a job was not queued. Whatever of it was queued has finished when this is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    /// The job does not fit the planes.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A driver call failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
}

/// kvpool's own stream, destroyed (after its copies finished) when the last holder drops it:
/// the copy engine and every page-lock guard whose memory the stream's copies use.
pub struct CopyStream {
    driver: Arc<dyn CudaDriver>,
    raw: RawStream,
}

impl std::fmt::Debug for CopyStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CopyStream({:#x})", self.raw.0)
    }
}

impl CopyStream {
    /// A new stream on `driver`'s device.
    pub fn new(driver: Arc<dyn CudaDriver>) -> Result<Self, CudaError> {
        let raw = driver.stream_create()?;
        Ok(CopyStream { driver, raw })
    }

    /// The stream's handle.
    pub fn raw(&self) -> RawStream {
        self.raw
    }

    /// Waits on the host for everything queued on the stream (this stream only: never the
    /// whole device).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.driver.stream_synchronize(self.raw)
    }
}

impl Drop for CopyStream {
    fn drop(&mut self) {
        if let Err(e) = self.synchronize() {
            tracing::warn!("kvpool-cuda: waiting for {self:?} before destroying it: {e}");
        }
        self.driver.stream_destroy(self.raw);
    }
}

/// A job queued and not yet reported.
#[derive(Debug)]
struct Pending {
    job: u64,
    /// Recorded after the job's copies.
    done: RawEvent,
}

/// How a job was queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Submitted {
    /// What the plan moves.
    pub plan: PlanStats,
    /// Whether each phase went as one batch.
    pub batched: bool,
}

/// See the module docs.
pub struct CudaCopyEngine {
    driver: Arc<dyn CudaDriver>,
    planes: KvPlanes,
    stream: Arc<CopyStream>,
    batch: bool,
    spare_events: Vec<RawEvent>,
    pending: Vec<Pending>,
}

impl std::fmt::Debug for CudaCopyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCopyEngine")
            .field("driver", &self.driver.describe())
            .field("stream", &self.stream)
            .field("batch", &self.batch)
            .field("pending", &self.pending.len())
            .finish()
    }
}

impl CudaCopyEngine {
    /// An engine over `planes` (the engine's KV on `driver`'s device), with a stream of its
    /// own.
    ///
    /// # Safety
    /// Every page of `planes` is device memory (or host memory the device can address) that
    /// stays allocated while this engine has jobs in flight.
    pub unsafe fn new(driver: Arc<dyn CudaDriver>, planes: KvPlanes) -> Result<Self, CudaError> {
        let stream = Arc::new(CopyStream::new(driver.clone())?);
        let batch = driver.batch_copy_available();
        Ok(CudaCopyEngine {
            driver,
            planes,
            stream,
            batch,
            spare_events: Vec::new(),
            pending: Vec::new(),
        })
    }

    /// The driver it runs on.
    pub fn driver(&self) -> &Arc<dyn CudaDriver> {
        &self.driver
    }

    /// Its stream, for the page-lock guards of the memory its copies use.
    pub fn copy_stream(&self) -> Arc<CopyStream> {
        self.stream.clone()
    }

    /// The planes it copies to and from.
    pub fn planes(&self) -> &KvPlanes {
        &self.planes
    }

    /// Whether it queues each phase as one batch (`cuMemcpyBatchAsync`).
    pub fn batched(&self) -> bool {
        self.batch
    }

    /// Jobs queued and not yet reported by [`poll`](Self::poll) or [`wait`](Self::wait).
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    fn event(&mut self) -> Result<RawEvent, CudaError> {
        match self.spare_events.pop() {
            Some(e) => Ok(e),
            None => self.driver.event_create(),
        }
    }

    /// Plans `job` (see [`CopyPlan::build`]) and queues its copies on kvpool's stream after
    /// the work queued so far on `compute`; a load's completion is queued before whatever
    /// `compute` gets next. Returns at once: the job is done once [`poll`](Self::poll) or
    /// [`wait`](Self::wait) reports it. On an error, nothing of the job is still queued.
    ///
    /// # Safety
    /// Each of the job's chunk addresses and staged copies is host memory of the chunk's
    /// length, valid for reads and writes until the job is reported done (or this call
    /// failed), not overlapping the planes or one another; `compute` is a live stream of the
    /// driver's context.
    pub unsafe fn submit(
        &mut self,
        job_id: u64,
        job: &JobSpec<'_>,
        compute: RawStream,
    ) -> Result<Submitted, CopyError> {
        let plan = CopyPlan::build(&self.planes, job)?;
        let start = self.event()?;
        let done = match self.event() {
            Ok(e) => e,
            Err(e) => {
                self.spare_events.push(start);
                return Err(e.into());
            }
        };
        // SAFETY: the caller's contract covers the plan's host addresses; `new`'s the planes.
        let queued = unsafe { self.queue(&plan, start, done, compute) };
        self.spare_events.push(start);
        match queued {
            Ok(batched) => {
                self.pending.push(Pending { job: job_id, done });
                Ok(Submitted {
                    plan: plan.stats(),
                    batched,
                })
            }
            Err(e) => {
                // Copies queued before the failure end before the caller frees their memory.
                let _ = self.stream.synchronize();
                self.spare_events.push(done);
                Err(e.into())
            }
        }
    }

    /// # Safety
    /// As [`submit`](Self::submit).
    unsafe fn queue(
        &mut self,
        plan: &CopyPlan,
        start: RawEvent,
        done: RawEvent,
        compute: RawStream,
    ) -> Result<bool, CudaError> {
        let ours = self.stream.raw();
        self.driver.event_record(start, compute)?;
        self.driver.stream_wait_event(ours, start)?;
        let mut batched = true;
        for phase in plan.phases() {
            let mut one_by_one = !self.batch;
            if self.batch {
                // SAFETY: the caller's contract; segments of one phase never overlap.
                if let Err(e) = unsafe { self.driver.copy_batch(phase, ours) } {
                    // The driver has the entry point but refuses the batch: every later job
                    // goes one segment at a time. What the failed call may have queued is
                    // waited for, then the whole phase is copied again (the same bytes).
                    tracing::warn!(
                        "kvpool-cuda: a batched copy failed ({e}); copying one segment at a \
                         time from now on"
                    );
                    self.batch = false;
                    self.stream.synchronize()?;
                    one_by_one = true;
                }
            }
            if one_by_one {
                batched = false;
                for &segment in phase {
                    // SAFETY: as above.
                    unsafe { self.driver.copy_async(segment, ours)? };
                }
            }
        }
        self.driver.event_record(done, ours)?;
        if plan.direction() == Direction::Load {
            self.driver.stream_wait_event(compute, done)?;
        }
        Ok(batched)
    }

    /// Jobs whose copies ended since the last call, each with its outcome (an error: the
    /// device reported one; the job's blocks hold nothing usable).
    pub fn poll(&mut self) -> Vec<(u64, Result<(), CudaError>)> {
        let mut ended = Vec::new();
        let mut still = Vec::with_capacity(self.pending.len());
        for p in std::mem::take(&mut self.pending) {
            match self.driver.event_query(p.done) {
                Ok(false) => still.push(p),
                Ok(true) => {
                    self.spare_events.push(p.done);
                    ended.push((p.job, Ok(())));
                }
                Err(e) => {
                    self.spare_events.push(p.done);
                    ended.push((p.job, Err(e)));
                }
            }
        }
        self.pending = still;
        ended
    }

    /// Waits on the host for these jobs (those still pending), and reports them ended, each
    /// with its outcome. Waits for the jobs' events only, never the whole device.
    pub fn wait(&mut self, jobs: &[u64]) -> Vec<(u64, Result<(), CudaError>)> {
        let mut ended = Vec::new();
        let mut still = Vec::with_capacity(self.pending.len());
        for p in std::mem::take(&mut self.pending) {
            if jobs.contains(&p.job) {
                let outcome = self.driver.event_synchronize(p.done);
                self.spare_events.push(p.done);
                ended.push((p.job, outcome));
            } else {
                still.push(p);
            }
        }
        self.pending = still;
        ended
    }

    /// Makes `stream` wait (on the device) for these jobs' copies: before the engine reuses
    /// their blocks (a preempted request's).
    pub fn order_before(&self, jobs: &[u64], stream: RawStream) -> Result<(), CudaError> {
        for p in self.pending.iter().filter(|p| jobs.contains(&p.job)) {
            self.driver.stream_wait_event(stream, p.done)?;
        }
        Ok(())
    }

    /// Waits on the host for every copy queued on kvpool's stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize()
    }
}

impl Drop for CudaCopyEngine {
    fn drop(&mut self) {
        if let Err(e) = self.stream.synchronize() {
            tracing::warn!("kvpool-cuda: waiting for copies at shutdown: {e}");
        }
        for p in std::mem::take(&mut self.pending) {
            self.driver.event_destroy(p.done);
        }
        for e in std::mem::take(&mut self.spare_events) {
            self.driver.event_destroy(e);
        }
    }
}
