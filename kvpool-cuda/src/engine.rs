//! The CUDA copy engine: runs copy plans between the engine's KV on a GPU and kvpool's host
//! chunks on kvpool's own stream, one `cuMemcpyBatchAsync` per phase of a job (per-segment
//! `cuMemcpyAsync` where the driver has no batch entry point), ordered after the engine's
//! compute stream with events, and polled for completion without synchronizing the device.
//! A job whose pages are small (scattered blocks: each page its own segment) may instead go
//! through kvpool's copy kernel, which reads and writes registered host memory in place with
//! one launch ([`CopyMode`]): a DMA engine pays per copy, the kernel per byte.
//!
//! Per job: an event recorded on the compute stream, which kvpool's stream waits for (a save
//! reads KV only once the forward pass queued before it wrote it; a load writes blocks only
//! after what the compute stream queued before, such as their zeroing); the phases' copies;
//! an event recorded after them, which [`CudaCopyEngine::poll`] queries and, for a load, the
//! compute stream waits for (the forward pass reads loaded blocks only after the copies).

use std::collections::VecDeque;
use std::sync::Arc;

use crate::driver::{CudaDriver, CudaError, RawEvent, RawStream};
use crate::plan::{CopyPlan, Direction, JobSpec, KvPlanes, PlanError, PlanStats, Segment};
use crate::registration::all_registered;

/// How the copy engine moves a job's pages (its host-to-host staging always goes as DMA).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyMode {
    /// The copy kernel for pages shorter on average than [`KERNEL_BELOW`] where it can run,
    /// else DMA.
    Auto,
    /// DMA only (batched where the driver can).
    Dma,
    /// The copy kernel wherever it can run, else DMA.
    Kernel,
}

impl std::str::FromStr for CopyMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(CopyMode::Auto),
            "dma" => Ok(CopyMode::Dma),
            "kernel" => Ok(CopyMode::Kernel),
            other => Err(format!(
                "copy mode `{other}` is not one of auto, dma, kernel"
            )),
        }
    }
}

/// The mean segment length under which [`CopyMode::Auto`] runs a job's pages with the copy
/// kernel: docs/benchmarks.md ("kvpool-cuda") has the measurements it follows.
pub const KERNEL_BELOW: u64 = 256 << 10;

/// The most threads a load's staging phase (host to host) is copied with: the host's cores
/// are otherwise idle while the device runs the forward pass.
const STAGING_THREADS: usize = 8;

/// Segments the copy tables of the jobs in flight may hold together (24 bytes each): a job
/// that finds no room goes as DMA.
const TABLE_SEGMENTS: usize = 1 << 16;

/// The copy kernel's tables: one page-locked buffer the device reads in place, used as a ring
/// by the jobs in flight (they end in stream order), each job's table freed when it ends.
struct TableRing {
    base: usize,
    capacity: usize,
    /// `(job, first segment, end)` of each table in use, oldest first.
    used: VecDeque<(u64, usize, usize)>,
}

impl TableRing {
    /// Room for `n` segments for `job`: the index of the first, or `None` (no room now).
    fn reserve(&mut self, job: u64, n: usize) -> Option<usize> {
        if n == 0 || n > self.capacity {
            return None;
        }
        let start = match (self.used.front(), self.used.back()) {
            (Some(&(_, oldest, _)), Some(&(_, _, newest_end))) => {
                if newest_end > oldest {
                    // In use: [oldest, newest_end). Free: its end to the buffer's, then the
                    // buffer's start to `oldest`.
                    if newest_end + n <= self.capacity {
                        newest_end
                    } else if n <= oldest {
                        0
                    } else {
                        return None;
                    }
                } else if newest_end + n <= oldest {
                    // Wrapped: free is [newest_end, oldest).
                    newest_end
                } else {
                    return None;
                }
            }
            _ => 0,
        };
        self.used.push_back((job, start, start + n));
        Some(start)
    }

    /// Frees `job`'s table (it ended: the kernel that read it has run).
    fn release(&mut self, job: u64) {
        self.used.retain(|&(j, _, _)| j != job);
    }

    /// The address of segment `index`.
    fn address(&self, index: usize) -> usize {
        self.base + index * std::mem::size_of::<Segment>()
    }
}

/// Why a job was not queued. Whatever of it was queued has finished when this is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    /// The job does not fit the planes.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A driver call failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A job of this id is in flight already.
    #[error("copy job {0} is in flight already")]
    DuplicateJob(u64),
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
    /// Whether each phase that went as DMA went as one batch.
    pub batched: bool,
    /// Whether its pages went through the copy kernel.
    pub kernel: bool,
}

/// How [`CudaCopyEngine::queue`] queued a job.
struct Queued {
    batched: bool,
    kernel: bool,
}

/// See the module docs.
pub struct CudaCopyEngine {
    driver: Arc<dyn CudaDriver>,
    planes: KvPlanes,
    stream: Arc<CopyStream>,
    batch: bool,
    mode: CopyMode,
    /// Threads a load's long host-to-host staging phase is copied with.
    host_threads: usize,
    /// The copy kernel's tables, allocated at its first use.
    tables: Option<TableRing>,
    spare_events: Vec<RawEvent>,
    pending: Vec<Pending>,
}

impl std::fmt::Debug for CudaCopyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCopyEngine")
            .field("driver", &self.driver.describe())
            .field("stream", &self.stream)
            .field("batch", &self.batch)
            .field("mode", &self.mode)
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
            mode: CopyMode::Auto,
            host_threads: std::thread::available_parallelism()
                .map_or(1, |n| n.get().min(STAGING_THREADS)),
            tables: None,
            spare_events: Vec::new(),
            pending: Vec::new(),
        })
    }

    /// Sets how it moves pages (default [`CopyMode::Auto`]).
    pub fn set_mode(&mut self, mode: CopyMode) {
        self.mode = mode;
    }

    /// How it moves pages.
    pub fn mode(&self) -> CopyMode {
        self.mode
    }

    /// Whether the copy kernel can run here.
    pub fn kernel_available(&self) -> bool {
        self.driver.kernel_copy_available()
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
        if self.pending.iter().any(|p| p.job == job_id) {
            // Completion, and the copy table's life, are tracked by id.
            return Err(CopyError::DuplicateJob(job_id));
        }
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
        let queued = unsafe { self.queue(job_id, &plan, start, done, compute) };
        self.spare_events.push(start);
        match queued {
            Ok(q) => {
                self.pending.push(Pending { job: job_id, done });
                Ok(Submitted {
                    plan: plan.stats(),
                    batched: q.batched,
                    kernel: q.kernel,
                })
            }
            Err(e) => {
                // Copies queued before the failure end before the caller frees their memory
                // (and before the job's copy table is reused).
                let _ = self.stream.synchronize();
                self.spare_events.push(done);
                self.release_table(job_id);
                Err(e.into())
            }
        }
    }

    /// # Safety
    /// As [`submit`](Self::submit).
    unsafe fn queue(
        &mut self,
        job_id: u64,
        plan: &CopyPlan,
        start: RawEvent,
        done: RawEvent,
        compute: RawStream,
    ) -> Result<Queued, CudaError> {
        let ours = self.stream.raw();
        self.driver.event_record(start, compute)?;
        self.driver.stream_wait_event(ours, start)?;
        let mut batched = true;
        let mut kernel = false;
        let page_phase = plan.page_phase();
        for (index, phase) in plan.phases().iter().enumerate() {
            if plan.host_phase() == Some(index) {
                // Host to host (a load's staged chunks into their buffers): done here, now,
                // before the device copies that read the buffers are queued; with several
                // threads when long (one thread moved about 5 GB/s on an H200's host).
                // SAFETY: the caller's contract: host memory of the job, valid now, the
                // chunks' places and their buffers never overlapping.
                unsafe { crate::host::copy_phase(phase, self.host_threads) };
                continue;
            }
            if let Some((pages, host_is_src)) = page_phase
                && pages == index
                && self.kernel_fits(phase, host_is_src)
            {
                // SAFETY: the caller's contract; `kernel_fits` checked alignment and that
                // every host address is registered (device-mapped) memory.
                if unsafe { self.queue_kernel(job_id, phase)? } {
                    kernel = true;
                    continue;
                }
            }
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
        Ok(Queued { batched, kernel })
    }

    /// Whether the copy kernel may run `phase` (pages; `host_is_src`: a load's), by the mode:
    /// the kernel is loaded, every address and length is a multiple of 16, and every host
    /// range lies in memory registered through kvpool-cuda (the device reads it in place).
    fn kernel_fits(&self, phase: &[Segment], host_is_src: bool) -> bool {
        if self.mode == CopyMode::Dma || phase.is_empty() || !self.driver.kernel_copy_available() {
            return false;
        }
        if self.mode == CopyMode::Auto {
            let bytes: u64 = phase.iter().map(|s| s.len).sum();
            if bytes / phase.len() as u64 >= KERNEL_BELOW {
                return false;
            }
        }
        phase.iter().all(|s| (s.src | s.dst | s.len) % 16 == 0)
            && all_registered(
                phase
                    .iter()
                    .map(|s| (if host_is_src { s.src } else { s.dst }, s.len)),
            )
    }

    /// Queues `phase` through the copy kernel with a table in the ring; `Ok(false)`: no room
    /// in the ring now (the caller copies it as DMA).
    ///
    /// # Safety
    /// As [`submit`](Self::submit), and the checks of `kernel_fits` passed.
    unsafe fn queue_kernel(&mut self, job_id: u64, phase: &[Segment]) -> Result<bool, CudaError> {
        if self.tables.is_none() {
            let bytes = TABLE_SEGMENTS * std::mem::size_of::<Segment>();
            match self.driver.host_alloc(bytes) {
                Ok(base) => {
                    self.tables = Some(TableRing {
                        base,
                        capacity: TABLE_SEGMENTS,
                        used: VecDeque::new(),
                    })
                }
                Err(e) => {
                    // No tables, no kernel: every job goes as DMA from now on.
                    tracing::warn!(
                        "kvpool-cuda: no page-locked memory for the copy kernel's tables ({e}); \
                         copying as DMA"
                    );
                    self.mode = CopyMode::Dma;
                    return Ok(false);
                }
            }
        }
        let tables = self.tables.as_mut().expect("allocated above");
        let Some(first) = tables.reserve(job_id, phase.len()) else {
            return Ok(false);
        };
        let table = tables.address(first);
        // SAFETY: `reserve` gave `phase.len()` segments of the ring to this job alone; no
        // queued kernel reads them (their last reader's job ended).
        unsafe {
            std::ptr::copy_nonoverlapping(phase.as_ptr(), table as *mut Segment, phase.len());
        }
        // SAFETY: the table holds the phase until the job ends (released then); the caller's
        // contract covers the segments.
        unsafe {
            self.driver
                .copy_kernel(table, phase.len(), self.stream.raw())?
        };
        Ok(true)
    }

    fn release_table(&mut self, job: u64) {
        if let Some(tables) = &mut self.tables {
            tables.release(job);
        }
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
        for (job, _) in &ended {
            self.release_table(*job);
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
                self.release_table(p.job);
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
        if let Some(tables) = self.tables.take() {
            self.driver.host_free(tables.base);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::TableRing;

    #[test]
    fn the_table_ring_hands_out_room_in_order_and_never_overlaps_a_table_in_use() {
        let mut ring = TableRing {
            base: 0,
            capacity: 10,
            used: Default::default(),
        };
        assert_eq!(ring.reserve(1, 4), Some(0));
        assert_eq!(ring.reserve(2, 4), Some(4));
        assert_eq!(
            ring.reserve(3, 4),
            None,
            "2 free at the end, none at the start"
        );
        ring.release(1);
        // Free: [8, 10) and [0, 4): a table of 4 wraps to the start.
        assert_eq!(ring.reserve(3, 4), Some(0));
        assert_eq!(
            ring.reserve(4, 1),
            None,
            "wrapped: the tables fill [4, 8) and [0, 4)"
        );
        ring.release(2);
        assert_eq!(ring.reserve(4, 6), Some(4));
        assert_eq!(ring.reserve(5, 1), None);
        ring.release(3);
        ring.release(4);
        assert_eq!(ring.reserve(6, 10), Some(0), "empty: the whole ring");
        assert_eq!(ring.reserve(7, 11), None, "larger than the ring");
        assert_eq!(ring.address(3), 3 * 24);
    }
}
