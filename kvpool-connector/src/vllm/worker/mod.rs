//! The worker side: binds each step's metadata, plans loads and saves as [`CopyJob`]s for the
//! engine to execute, fetches asynchronous loads in the background, stages saves until their
//! step is committed, and reports what finished.
//!
//! The worker never touches the engine's KV memory itself: the engine side runs the copy jobs
//! (torch in the Python connector, the same code on CPU and CUDA tensors) and reports each one
//! done with [`ConnectorWorker::copy_done`]. Until then the job's host memory stays owned here.

mod completion;
mod copy_check_thread;
mod copy_job;
mod loads;
mod node_copies;
mod planning;
mod reports;
mod scheduler_counters;
mod staged;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use kvpool_core::telemetry;
use kvpool_core::{CacheEngine, ChunkSpan, KvLayout};
use tokio::runtime::Runtime;
use tracing::warn;

pub use copy_job::{CopyDirection, CopyJob};
pub use loads::LoadLimits;
pub use node_copies::HostPlanes;
pub use reports::{StepReport, TransferResults, WorkerStats};
pub use staged::STAGED_STEP_TTL;

use crate::ConnectorError;
use crate::vllm::leases::LeaseTable;
use crate::vllm::metadata::{ConnectorMetadata, MetadataError, ReqMeta};
use crate::vllm::request_trace::{RequestTrace, RequestTraces};
use copy_check_thread::CheckingLoad;
use copy_job::JobMemory;
use loads::AsyncLoads;
use scheduler_counters::PublishedSchedulerCounters;
use staged::StagedSaves;

struct InFlight {
    direction: CopyDirection,
    req_id: String,
    step: u64,
    memory: JobMemory,
    /// Save: the spans of the chunks, in order. Load: the tokens written.
    spans: Vec<ChunkSpan>,
    tokens: usize,
    asynchronous: bool,
    tier_tokens: Vec<(String, usize)>,
    /// The engine blocks the job writes (a load's, to report them if it fails).
    blocks: Vec<u32>,
    /// A load's chunks lent by node memory, to check once copied.
    checks: Vec<LentChunkCheck>,
}

/// A chunk lent by node memory that a load copies straight from where it lies, to check
/// once copied, in memory no other process writes.
struct LentChunkCheck {
    /// Its index in the job.
    chunk: usize,
    /// Its key (deleted from the pool if the copy fails its check).
    key: kvpool_core::CacheKey,
    /// The engine blocks the job copies it into, in chunk order (those of its blocks the
    /// engine did not hold already).
    blocks: Vec<u32>,
    /// Where its copy is checked.
    site: CheckSite,
}

/// Where the copy of a chunk lent by node memory is checked.
enum CheckSite {
    /// In the engine's blocks, which the worker reads ([`HostPlanes`]): the job copies the
    /// whole chunk there.
    Blocks,
    /// In a buffer of this process the engine side fills with the bytes it copied into the
    /// blocks, exactly as it copied them (see [`CopyJob::check_copy_ptrs`]): on a GPU, read
    /// back from the one device copy of the chunk the blocks were filled from.
    Staged(kvpool_core::MemoryObjMut),
}

/// The worker side of the connector (one per engine worker / TP rank).
pub struct ConnectorWorker {
    engine: Arc<CacheEngine>,
    runtime: Arc<Runtime>,
    leases: Arc<LeaseTable>,
    block_size: usize,
    probe_hash: [u8; 16],
    registered: bool,
    meta: Option<ConnectorMetadata>,
    next_job: u64,
    /// Jobs planned at bind, not yet taken by the engine side.
    planned_loads: Vec<(CopyJob, InFlight)>,
    planned_saves: Vec<(CopyJob, InFlight)>,
    in_flight: HashMap<u64, InFlight>,
    async_loads: AsyncLoads,
    limits: LoadLimits,
    staged: StagedSaves,
    held: HashSet<String>,
    finished_seen: HashSet<String>,
    finished_recving: Vec<String>,
    load_errors: BTreeSet<u32>,
    /// Blocks whose load failed in the bound step.
    step_failed: BTreeSet<u32>,
    executed: Vec<u64>,
    awaiting_copies: Vec<u64>,
    copied: Vec<u64>,
    traces: RequestTraces,
    stats: WorkerStats,
    /// The engine's KV blocks, where they are in host memory and the worker may read them to
    /// check a load's copy (see [`ConnectorWorker::set_host_planes`]).
    host_planes: Option<Arc<HostPlanes>>,
    /// Whether the engine side stages a load's chunks from node memory in a buffer the
    /// worker checks (see [`ConnectorWorker::check_staged_copies`]).
    checks_staged_copies: bool,
    /// Buffers taken from the heap because L1's pool had no room (see
    /// [`WorkerStats::heap_buffers`]); counted where the worker is only borrowed.
    heap_buffers: std::sync::atomic::AtomicU64,
    /// The thread that checks loads copied from node memory.
    copy_checker: Option<copy_check_thread::CopyChecker>,
    /// Load jobs whose copies from node memory are being checked behind the forward pass
    /// (settled by [`ConnectorWorker::settle_checks`]).
    checking: Vec<CheckingLoad>,
    /// Keys of the chunks this step's loads copy straight from node memory: in the pool
    /// already, so the step's saves skip them as they skip L1's.
    loaded_from_node_memory: HashSet<kvpool_core::CacheKey>,
    /// Until when this step's saves may wait for node memory ([`planning::SAVE_SLOT_BUDGET`]).
    save_slot_deadline: std::time::Instant,
    /// The engine's null block (see [`ConnectorWorker::set_null_block`]).
    null_block: Option<u32>,
    /// Requests with a failed load since [`ConnectorWorker::take_failed_load_requests`].
    failed_load_requests: BTreeSet<String>,
    /// Blocks failed with no request named since that call.
    unattributed_load_errors: bool,
    /// The scheduler's counters as this worker last published them (TP rank 0's).
    scheduler_counters: PublishedSchedulerCounters,
}

impl ConnectorWorker {
    /// A worker over `engine`; `block_size` is the engine's page size in tokens; `leases` are
    /// the lookup leases its pool's lookups grant (shared with the lookup server).
    pub fn new(
        engine: Arc<CacheEngine>,
        runtime: Arc<Runtime>,
        block_size: usize,
        leases: Arc<LeaseTable>,
    ) -> Self {
        let probe_hash = crate::probe_hash(&engine);
        ConnectorWorker {
            engine,
            runtime,
            leases,
            block_size,
            probe_hash,
            registered: false,
            meta: None,
            next_job: 1,
            planned_loads: Vec::new(),
            planned_saves: Vec::new(),
            in_flight: HashMap::new(),
            async_loads: AsyncLoads::default(),
            limits: LoadLimits::default(),
            staged: StagedSaves::default(),
            held: HashSet::new(),
            finished_seen: HashSet::new(),
            finished_recving: Vec::new(),
            load_errors: BTreeSet::new(),
            step_failed: BTreeSet::new(),
            executed: Vec::new(),
            awaiting_copies: Vec::new(),
            copied: Vec::new(),
            traces: RequestTraces::default(),
            stats: WorkerStats::default(),
            host_planes: None,
            checks_staged_copies: false,
            heap_buffers: Default::default(),
            copy_checker: None,
            checking: Vec::new(),
            loaded_from_node_memory: HashSet::new(),
            save_slot_deadline: std::time::Instant::now(),
            null_block: None,
            failed_load_requests: BTreeSet::new(),
            unattributed_load_errors: false,
            scheduler_counters: PublishedSchedulerCounters::default(),
        }
    }

    /// The block id the engine puts where a request holds no block (vLLM's null block, id 0,
    /// under its hybrid KV cache manager: a sliding-window layer's blocks outside its window).
    /// Such a block is never read or written: a load starts past the leading run of them (the
    /// engine does not need those tokens' KV), and a save stops before the first chunk with
    /// one (its bytes are not the request's).
    pub fn set_null_block(&mut self, block: Option<u32>) {
        self.null_block = block;
    }

    /// Tokens of `block_ids`' leading run of null blocks (0 without a null block).
    pub(super) fn leading_null_tokens(&self, block_ids: &[u32]) -> usize {
        self.null_block.map_or(0, |null| {
            block_ids.iter().take_while(|&&b| b == null).count() * self.block_size
        })
    }

    /// Whether `blocks` holds the engine's null block.
    pub(super) fn holds_null_block(&self, blocks: &[u32]) -> bool {
        self.null_block.is_some_and(|null| blocks.contains(&null))
    }

    /// Requests whose load failed (some of their blocks were reported by
    /// [`ConnectorWorker::get_block_ids_with_load_errors`]) since the last call, and whether
    /// blocks failed that no request was named for (the scheduler's `unloadable_blocks`,
    /// which vLLM never causes): for an engine that takes failures per request (vLLM's
    /// `failed_recving` under its hybrid KV cache manager, where a block id does not name one
    /// request's block), which must then fail every load it has in flight.
    pub fn take_failed_load_requests(&mut self) -> (Vec<String>, bool) {
        self.settle_checks();
        let requests = std::mem::take(&mut self.failed_load_requests);
        let unattributed = std::mem::take(&mut self.unattributed_load_errors);
        (requests.into_iter().collect(), unattributed)
    }

    /// The pool this worker loads from and saves to.
    pub fn engine(&self) -> &Arc<CacheEngine> {
        &self.engine
    }

    /// The lookup leases of this worker's pool.
    pub fn leases(&self) -> &Arc<LeaseTable> {
        &self.leases
    }

    /// Counters since the worker started (loads whose checks are still running behind the
    /// forward pass count once settled, by the step's end).
    pub fn stats(&self) -> WorkerStats {
        WorkerStats {
            heap_buffers: self.heap_buffers.load(std::sync::atomic::Ordering::Relaxed),
            ..self.stats
        }
    }

    /// Bounds asynchronous loads in flight.
    pub fn set_load_limits(&mut self, limits: LoadLimits) {
        self.limits = limits;
    }

    /// Copy jobs handed to the engine and not reported done or still being checked,
    /// asynchronous loads in flight, staged save bytes and requests whose blocks the engine
    /// holds for this worker: all zero once everything settled (tests check it after a run).
    pub fn in_flight(&self) -> (usize, usize, usize, usize) {
        (
            self.in_flight.len() + self.checking.len(),
            self.async_loads.len(),
            self.staged.bytes(),
            self.held.len(),
        )
    }

    fn chunk_size(&self) -> usize {
        self.engine.token_database().chunk_size()
    }

    /// vLLM `register_kv_caches`: checks the engine's KV layout matches the pool's.
    pub fn register_kv_caches(&mut self, layout: &KvLayout) -> Result<(), ConnectorError> {
        let ours = self.engine.layout();
        if layout.fingerprint() != ours.fingerprint() || layout.block_size != self.block_size {
            return Err(ConnectorError::Layout(format!(
                "engine KV cache {layout:?} does not match the pool's {ours:?} with block size {}",
                self.block_size
            )));
        }
        if !self.chunk_size().is_multiple_of(self.block_size) {
            return Err(ConnectorError::Layout(format!(
                "chunk size {} is not a whole number of {}-token blocks",
                self.chunk_size(),
                self.block_size
            )));
        }
        self.registered = true;
        Ok(())
    }

    /// vLLM `bind_connector_metadata`: decodes (never panics), checks key agreement, applies
    /// the scheduler's decisions on earlier steps (cuts, commits, held blocks, ended requests)
    /// and plans this step's loads and saves. Synchronous loads are fetched now; asynchronous
    /// ones start fetching in the background.
    pub fn bind_connector_metadata(&mut self, bytes: &[u8]) -> Result<(), ConnectorError> {
        self.settle_checks();
        if !self.registered {
            return Err(ConnectorError::Usage(
                "register_kv_caches must come before bind_connector_metadata".into(),
            ));
        }
        let meta = ConnectorMetadata::decode(bytes)?;
        if meta.probe_hash != self.probe_hash {
            return Err(MetadataError::ProbeMismatch {
                scheduler: hex(&meta.probe_hash),
                worker: hex(&self.probe_hash),
            }
            .into());
        }
        if meta.block_size as usize != self.block_size {
            return Err(ConnectorError::Usage(format!(
                "the scheduler's block size {} is not this worker's {}",
                meta.block_size, self.block_size
            )));
        }
        self.drop_untaken_jobs();
        self.step_failed.clear();
        self.loaded_from_node_memory.clear();
        self.stats.steps += 1;
        for d in &meta.discards {
            self.staged.cut(d.step, &d.req_id, d.keep_until);
        }
        for &s in &meta.commit_steps {
            self.staged.commit(s);
        }
        self.store_ready();
        for id in &meta.ended_requests {
            self.leases.release(id);
            if self.async_loads.cancellable(id) {
                self.async_loads.finish(id);
                self.finished_recving.push(id.clone());
            }
        }
        self.held.extend(meta.held_requests.iter().cloned());
        metrics::gauge!(telemetry::HELD_REQUESTS).set(self.held.len() as f64);
        for &block in &meta.unloadable_blocks {
            self.fail_block(block);
            self.unattributed_load_errors = true;
        }
        if self.engine.token_database().scope().rank == 0 {
            self.scheduler_counters.publish(&meta.scheduler);
        }
        for r in &meta.requests {
            if let Some(load) = r.load {
                // Blocks the engine left null hold tokens it does not need (outside a
                // sliding window): the load starts past them.
                let from =
                    (load.gpu_cached_tokens as usize).max(self.leading_null_tokens(&r.block_ids));
                let until = load.load_until as usize;
                if from >= until && from > load.gpu_cached_tokens as usize {
                    if load.asynchronous {
                        self.finished_recving.push(r.req_id.clone());
                    }
                    continue;
                }
                self.plan_load(r, from, until, load.asynchronous);
            }
        }
        self.save_slot_deadline = std::time::Instant::now() + planning::SAVE_SLOT_BUDGET;
        for r in &meta.requests {
            if let Some(save) = r.save {
                self.plan_save(
                    r,
                    meta.step,
                    save.save_from as usize,
                    save.save_until as usize,
                );
            }
        }
        self.executed.push(meta.step);
        self.awaiting_copies.push(meta.step);
        self.meta = Some(meta);
        Ok(())
    }

    /// vLLM `clear_connector_metadata`.
    pub fn clear_connector_metadata(&mut self) {
        self.settle_checks();
        self.meta = None;
    }

    fn next_job_id(&mut self) -> u64 {
        let id = self.next_job;
        self.next_job += 1;
        id
    }

    /// A step's jobs planned but never taken were never handed to the engine: drop them (their
    /// loads are reported failed). Asynchronous loads wait for the next step's
    /// [`ConnectorWorker::take_load_jobs`].
    fn drop_untaken_jobs(&mut self) {
        let (kept, dropped): (Vec<_>, Vec<_>) = std::mem::take(&mut self.planned_loads)
            .into_iter()
            .partition(|(_, f)| f.asynchronous);
        self.planned_loads = kept;
        for (_, f) in dropped {
            warn!(req = %f.req_id, "a planned load was never run; reporting its blocks");
            self.fail_blocks_of(&f.req_id, &f.blocks);
        }
        for (_, f) in std::mem::take(&mut self.planned_saves) {
            self.save_failed(&f.req_id, "the engine never ran the save's copy");
        }
    }

    /// vLLM `start_load_kv`: the loads to copy now. This step's synchronous loads (the engine
    /// must have them in place before its forward pass), then asynchronous loads whose fetch
    /// ended. Queued asynchronous loads start fetching as room frees up.
    pub fn take_load_jobs(&mut self) -> Vec<CopyJob> {
        self.settle_checks();
        self.poll_async_loads();
        let jobs: Vec<_> = std::mem::take(&mut self.planned_loads);
        jobs.into_iter()
            .map(|(job, f)| self.hand_out(job, f))
            .collect()
    }

    /// vLLM `wait_for_save`: the saves to copy now, once the step's forward pass wrote the
    /// engine's blocks.
    pub fn take_save_jobs(&mut self) -> Vec<CopyJob> {
        self.settle_checks();
        let jobs: Vec<_> = std::mem::take(&mut self.planned_saves);
        let mut out = Vec::with_capacity(jobs.len());
        for (job, f) in jobs {
            // A place node memory lent may have been reclaimed since (the step stalled for
            // half the daemon's lease): no copy may write there. The save is dropped.
            if !f.memory.lent_memory_usable() {
                self.save_failed(
                    &f.req_id,
                    "node memory's loan ran out before the save's copy",
                );
                continue;
            }
            self.staged.copy_started(f.step);
            out.push(self.hand_out(job, f));
        }
        out
    }

    fn hand_out(&mut self, job: CopyJob, f: InFlight) -> CopyJob {
        self.in_flight.insert(job.id, f);
        metrics::gauge!(telemetry::COPY_JOBS_IN_FLIGHT).set(self.in_flight.len() as f64);
        job
    }

    fn poll_async_loads(&mut self) {
        for (load, fetched) in self.async_loads.take_fetched(&self.runtime) {
            let id = load.req_id.clone();
            match self.load_job(load, fetched, true) {
                Some(job) => self.planned_loads.push(job),
                None => {
                    self.async_loads.finish(&id);
                    self.finished_recving.push(id);
                }
            }
        }
        self.async_loads
            .start_queued(self.limits, &self.engine, &self.runtime);
    }

    /// vLLM `handle_preemptions`: the copy jobs still in flight on these requests' blocks;
    /// the engine must wait for them before it reuses the blocks.
    pub fn jobs_in_flight_for(&mut self, req_ids: &[String]) -> Vec<u64> {
        // A check still reading their blocks ends first (none is pending between steps).
        self.settle_checks();
        let ids: HashSet<&str> = req_ids.iter().map(String::as_str).collect();
        let mut jobs: Vec<u64> = self
            .in_flight
            .iter()
            .filter(|(_, f)| ids.contains(f.req_id.as_str()))
            .map(|(&id, _)| id)
            .collect();
        jobs.sort_unstable();
        jobs
    }

    /// vLLM `get_finished` / `get_transfer_results`: asynchronous loads that ended, and held
    /// requests (finished, in `finished_req_ids` now or before) that no copy reads any more.
    /// Each request is reported once. Finished requests' traces are logged and forgotten.
    pub fn transfer_results(&mut self, finished_req_ids: &[String]) -> TransferResults {
        self.settle_checks();
        self.poll_async_loads();
        for req in finished_req_ids {
            self.traces.finish(req);
            if self.held.contains(req) {
                self.finished_seen.insert(req.clone());
            }
        }
        let busy: HashSet<&str> = self.in_flight.values().map(|f| f.req_id.as_str()).collect();
        let done: Vec<String> = self
            .finished_seen
            .iter()
            .filter(|r| !busy.contains(r.as_str()))
            .cloned()
            .collect();
        for r in &done {
            self.finished_seen.remove(r);
            self.held.remove(r);
        }
        metrics::gauge!(telemetry::HELD_REQUESTS).set(self.held.len() as f64);
        TransferResults {
            finished_sending: done,
            finished_recving: std::mem::take(&mut self.finished_recving),
        }
    }

    /// vLLM `build_connector_worker_meta`: the steps run, and the steps whose save copies all
    /// ended, since the last call.
    pub fn step_report(&mut self) -> StepReport {
        self.settle_checks();
        if let Some(meta) = self.meta.as_ref().filter(|m| m.commit_locally) {
            self.commit_locally(meta.step, meta.requests.clone());
        }
        let staged = &self.staged;
        let untaken: HashSet<u64> = self.planned_saves.iter().map(|(_, f)| f.step).collect();
        let (copied, waiting): (Vec<u64>, Vec<u64>) = self
            .awaiting_copies
            .iter()
            .partition(|&&s| staged.copies_done(s) && !untaken.contains(&s));
        self.awaiting_copies = waiting;
        self.copied.extend(copied);
        StepReport {
            executed: std::mem::take(&mut self.executed),
            copied: std::mem::take(&mut self.copied),
        }
    }

    /// Commits `step`'s saves, cut (as the scheduler's ledger would) where this step's failed
    /// loads reach them.
    fn commit_locally(&mut self, step: u64, requests: Vec<ReqMeta>) {
        let (bs, cs) = (self.block_size, self.chunk_size());
        for r in requests {
            let Some(save) = r.save else { continue };
            let (mut from, mut until) = (save.save_from as usize, save.save_until as usize);
            if !r.save_tail.is_empty() {
                let tail_start = r.save_tail_start as usize;
                from = from.min(tail_start);
                until = until.max(tail_start + r.save_tail.len() * bs);
            }
            let held = r.block_ids.iter().take(until.div_ceil(bs));
            if let Some(first) = held.clone().position(|b| self.step_failed.contains(b)) {
                let keep = (first * bs / cs * cs).max(from);
                if keep < until {
                    self.staged.cut(step, &r.req_id, keep as u32);
                }
            }
        }
        self.staged.commit(step);
        self.store_ready();
    }

    fn fail_block(&mut self, block: u32) {
        self.step_failed.insert(block);
        if self.load_errors.insert(block) {
            self.stats.failed_load_blocks += 1;
            metrics::counter!(telemetry::LOAD_ERROR_BLOCKS).increment(1);
        }
    }

    fn fail_blocks_of(&mut self, req: &str, blocks: &[u32]) {
        if !blocks.is_empty() {
            self.failed_load_requests.insert(req.to_string());
        }
        if let Some(t) = self.traces.of(req) {
            t.failed_tokens += (blocks.len() * self.block_size) as u64;
        }
        for &b in blocks {
            self.fail_block(b);
        }
    }

    /// Marks the blocks of tokens `from..until` as failed loads.
    fn fail_tokens(&mut self, req: &str, block_ids: &[u32], from: usize, until: usize) {
        let bs = self.block_size;
        let end = until.div_ceil(bs).min(block_ids.len());
        let blocks: Vec<u32> = block_ids[(from / bs).min(end)..end].to_vec();
        self.fail_blocks_of(req, &blocks);
    }

    /// What this worker did for a request still live (see [`RequestTrace`]).
    pub fn request_trace(&self, req: &str) -> Option<&RequestTrace> {
        self.traces.get(req)
    }

    /// Requests being traced, and requests not traced because too many were live.
    pub fn traced_requests(&self) -> (usize, u64) {
        (self.traces.len(), self.traces.untraced())
    }

    /// vLLM `get_block_ids_with_load_errors`: engine blocks whose load failed since the last
    /// call.
    pub fn get_block_ids_with_load_errors(&mut self) -> Vec<u32> {
        self.settle_checks();
        std::mem::take(&mut self.load_errors).into_iter().collect()
    }
}

fn hex(b: &[u8; 16]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
