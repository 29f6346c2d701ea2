//! The engine side of the connector for simulators and tests, in vLLM 0.32's order: one
//! worker rank ([`EngineWorker`]: a [`ConnectorWorker`] and the host KV cache whose blocks its
//! copy jobs read and write) and the aggregation of every rank's step output into what the
//! scheduler side sees ([`OutputAggregator`], as vLLM's `KVOutputAggregator`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use kvpool_connector::host_blocks::run_copy_job;
use kvpool_connector::{
    ConnectorError, ConnectorOutput, ConnectorWorker, CopyDirection, HostPlanes, LeaseTable,
    StepReport,
};
use kvpool_core::{CacheEngine, HostPagedKvCache, KvLayout};
use tokio::runtime::Runtime;

/// What one rank reported at the end of a step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepOutput {
    /// Blocks whose load failed.
    pub failed_blocks: Vec<u32>,
    /// Held requests whose copies ended.
    pub finished_sending: Vec<String>,
    /// Asynchronous loads that ended.
    pub finished_recving: Vec<String>,
    /// Steps run and copied.
    pub report: StepReport,
}

/// One worker rank of a simulated engine.
pub struct EngineWorker {
    /// The connector's worker half.
    pub worker: ConnectorWorker,
    /// The rank's KV cache (what the engine's tensors would be).
    pub kv: HostPagedKvCache,
    /// Blocks a load wrote since they were last checked (see [`EngineWorker::take_loaded_blocks`]).
    loaded: BTreeSet<u32>,
    /// Whether the worker reads the blocks (vLLM's CPU worker), else the rank stages its
    /// copies from node memory for the worker to check (a GPU worker's route).
    shows_blocks: bool,
}

impl EngineWorker {
    /// A rank over `engine` with `num_blocks` KV blocks of `layout`.
    pub fn new(
        engine: Arc<CacheEngine>,
        runtime: Arc<Runtime>,
        leases: Arc<LeaseTable>,
        layout: KvLayout,
        num_blocks: usize,
    ) -> Result<Self, ConnectorError> {
        Self::with_blocks_shown(engine, runtime, leases, layout, num_blocks, true)
    }

    /// A rank as [`EngineWorker::new`] makes, but whose blocks the worker never reads, as on
    /// a GPU: the rank stages each chunk lent by node memory in the buffer the job names for
    /// it ([`kvpool_connector::CopyJob::check_copy_ptrs`]), which the worker checks.
    pub fn new_staging(
        engine: Arc<CacheEngine>,
        runtime: Arc<Runtime>,
        leases: Arc<LeaseTable>,
        layout: KvLayout,
        num_blocks: usize,
    ) -> Result<Self, ConnectorError> {
        Self::with_blocks_shown(engine, runtime, leases, layout, num_blocks, false)
    }

    fn with_blocks_shown(
        engine: Arc<CacheEngine>,
        runtime: Arc<Runtime>,
        leases: Arc<LeaseTable>,
        layout: KvLayout,
        num_blocks: usize,
        shows_blocks: bool,
    ) -> Result<Self, ConnectorError> {
        let mut worker = ConnectorWorker::new(engine, runtime, layout.block_size, leases);
        worker.register_kv_caches(&layout)?;
        if !shows_blocks {
            worker.check_staged_copies();
        }
        let mut rank = EngineWorker {
            worker,
            kv: HostPagedKvCache::new(layout, num_blocks),
            loaded: BTreeSet::new(),
            shows_blocks,
        };
        rank.show_blocks()?;
        Ok(rank)
    }

    /// Shows the worker the KV blocks, as vLLM's CPU connector does, so that chunks of the
    /// node's pool daemon are copied once, straight into them, and checked there. Again
    /// before every batch of jobs: a test may replace `kv`.
    fn show_blocks(&mut self) -> Result<(), ConnectorError> {
        if !self.shows_blocks {
            return Ok(());
        }
        // SAFETY: `kv` outlives the worker's use of the planes: the worker reads them between
        // a job's `copy_done` (called by `run_jobs` right after this refresh) and the end of
        // its step (every check is settled by `end_step`, and by this refresh), and `kv` is
        // replaced only between steps (the refresh then follows before any job).
        let planes = unsafe { HostPlanes::of_host_cache(&self.kv) };
        self.worker.set_host_planes(planes)
    }

    fn run_jobs(&mut self, jobs: Vec<kvpool_connector::CopyJob>) {
        // `kv` was made for the layout the worker checked at `new` (a test replacing it uses
        // the engine's layout too).
        self.show_blocks()
            .expect("the KV blocks match the worker's layout");
        for job in jobs {
            if job.direction == CopyDirection::Load {
                self.loaded.extend(&job.block_ids);
            }
            // SAFETY: the job comes straight from this rank's worker, reported done below.
            let ok = unsafe { run_copy_job(&job, &mut self.kv) }.is_ok();
            self.worker.copy_done(job.id, ok);
        }
    }

    /// The start of a step, before the forward pass: binds `meta` and runs the loads (the
    /// step's synchronous ones, and asynchronous ones whose chunks arrived).
    pub fn begin_step(&mut self, meta: &[u8]) -> Result<(), ConnectorError> {
        self.worker.bind_connector_metadata(meta)?;
        let jobs = self.worker.take_load_jobs();
        self.run_jobs(jobs);
        Ok(())
    }

    /// The end of a step, after the forward pass: runs the saves, then reports (vLLM's
    /// `wait_for_save`, `get_transfer_results`, `get_block_ids_with_load_errors`,
    /// `build_connector_worker_meta`). `finished` are the requests the engine finished since
    /// the last step.
    pub fn end_step(&mut self, finished: &[String]) -> StepOutput {
        let saves = self.worker.take_save_jobs();
        self.run_jobs(saves);
        let loads = self.worker.take_load_jobs();
        self.run_jobs(loads);
        let r = self.worker.transfer_results(finished);
        let failed_blocks = self.worker.get_block_ids_with_load_errors();
        let report = self.worker.step_report();
        self.worker.clear_connector_metadata();
        StepOutput {
            failed_blocks,
            finished_sending: r.finished_sending,
            finished_recving: r.finished_recving,
            report,
        }
    }

    /// Blocks written by loads since the last call.
    pub fn take_loaded_blocks(&mut self) -> BTreeSet<u32> {
        std::mem::take(&mut self.loaded)
    }
}

/// Joins the ranks' step outputs as vLLM's `KVOutputAggregator` does: a request is finished
/// (sending or receiving) once every rank reported it, across steps; failed blocks are the
/// union; step reports are counted per step.
#[derive(Debug)]
pub struct OutputAggregator {
    ranks: u32,
    sending: HashMap<String, u32>,
    recving: HashMap<String, u32>,
}

impl OutputAggregator {
    /// An aggregator over `ranks` ranks.
    pub fn new(ranks: u32) -> Self {
        OutputAggregator {
            ranks,
            sending: HashMap::new(),
            recving: HashMap::new(),
        }
    }

    fn count(map: &mut HashMap<String, u32>, ids: &[String], ranks: u32) -> Vec<String> {
        let mut done = Vec::new();
        for id in ids {
            let n = map.entry(id.clone()).or_default();
            *n += 1;
            if *n == ranks {
                map.remove(id);
                done.push(id.clone());
            }
        }
        done.sort();
        done
    }

    /// One step's outputs, one per rank: what the scheduler sees, and the requests whose
    /// held blocks every rank released.
    pub fn aggregate(&mut self, outputs: &[StepOutput]) -> (ConnectorOutput, Vec<String>) {
        let mut failed: BTreeSet<u32> = BTreeSet::new();
        let mut executed: BTreeMap<u64, u32> = BTreeMap::new();
        let mut copied: BTreeMap<u64, u32> = BTreeMap::new();
        let mut recving = Vec::new();
        let mut sending = Vec::new();
        for o in outputs {
            failed.extend(&o.failed_blocks);
            for &s in &o.report.executed {
                *executed.entry(s).or_default() += 1;
            }
            for &s in &o.report.copied {
                *copied.entry(s).or_default() += 1;
            }
            recving.extend(Self::count(
                &mut self.recving,
                &o.finished_recving,
                self.ranks,
            ));
            sending.extend(Self::count(
                &mut self.sending,
                &o.finished_sending,
                self.ranks,
            ));
        }
        (
            ConnectorOutput {
                finished_recving: recving,
                failed_block_ids: failed.into_iter().collect(),
                executed_steps: executed.into_iter().collect(),
                copied_steps: copied.into_iter().collect(),
            },
            sending,
        )
    }
}

/// Lookups across in-process ranks, as the scheduler does over the ranks' sockets: every rank
/// is asked (and leases what it holds in memory), and the minimum answer wins.
pub struct RanksLookup {
    /// Each rank's pool and leases.
    pub ranks: Vec<(Arc<CacheEngine>, Arc<LeaseTable>)>,
    /// The runtime the lookups run on.
    pub runtime: Arc<Runtime>,
}

impl kvpool_connector::PoolLookup for RanksLookup {
    fn lookup(
        &mut self,
        req_id: &str,
        chunk_hashes: &[kvpool_core::ChunkHash],
        load_node_memory: bool,
    ) -> kvpool_connector::LookupAnswer {
        let mut best: Option<kvpool_connector::LookupAnswer> = None;
        for (engine, leases) in &self.ranks {
            let a = self
                .runtime
                .block_on(kvpool_connector::vllm::leases::lookup_and_lease(
                    engine,
                    leases,
                    req_id,
                    chunk_hashes,
                    load_node_memory,
                ));
            best = Some(best.map_or(a, |b| kvpool_connector::LookupAnswer {
                chunks: b.chunks.min(a.chunks),
                leased: b.leased.min(a.leased),
            }));
        }
        best.unwrap_or_default()
    }

    fn presence(&mut self, chunk_hashes: &[kvpool_core::ChunkHash]) -> Vec<bool> {
        let mut held = vec![!self.ranks.is_empty(); chunk_hashes.len()];
        for (engine, _) in &self.ranks {
            let flags = self
                .runtime
                .block_on(kvpool_connector::vllm::scheduler::chunks_present(
                    engine,
                    chunk_hashes,
                ));
            for (h, f) in held.iter_mut().zip(flags) {
                *h &= f;
            }
        }
        held
    }
}
