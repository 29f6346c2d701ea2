//! A one-request-at-a-time engine simulator that drives both connector roles, and the
//! deterministic KV model the protocol regression tests share.
//!
//! It plays vLLM:
//! - a scheduler with a GPU block pool and prefix caching (blocks of cached prefixes stay
//!   reusable until evicted, least recently freed first);
//! - a worker with a host paged KV cache, whose "model" writes a deterministic function of
//!   (token id, position, layer, plane) into every slot it computes.
//!
//! Scheduler and worker meet only through encoded [`kvpool_connector::ConnectorMetadata`] bytes. After
//! every request, each of its slots is compared with what the model would have written.

use std::sync::Arc;

use kvpool_backends::{FaultInjector, InMemoryConnector, LocalCpuBackend};
use kvpool_core::{
    CacheEngine, ChunkCodec, ChunkedTokenDatabase, ChunkingConfig, Dtype, EvictionKind,
    HostPagedKvCache, KeyScope, KvKind, KvLayout, RemoteBackend, StorageBackend, StorageManager,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use thiserror::Error;
use tokio::runtime::Runtime;

use crate::gpu_blocks::{GpuBlocks, GpuFull};
pub use crate::kv_model::{model_compute, model_mismatches};
use kvpool_connector::{
    BlockUpdate, ConnectorConfig, ConnectorError, ConnectorOutput, ConnectorScheduler,
    ConnectorWorker, EngineRequest, OffloadMode, ScheduledRequest,
};

/// Simulator settings.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// KV layout of the simulated model.
    pub layout: KvLayout,
    /// Tokens per pool chunk (a multiple of the layout's block size).
    pub chunk_size: usize,
    /// GPU KV blocks.
    pub gpu_blocks: usize,
    /// L1 (CPU) pool bytes.
    pub cpu_pool_bytes: usize,
    /// Add a lower tier (`memory://`) below L1.
    pub lower_tier: bool,
    /// With the lower tier: fail every n-th batch get and corrupt every m-th stored value.
    pub inject_failures: Option<(u64, u64)>,
    /// Eager or lazy offload.
    pub offload: OffloadMode,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            layout: KvLayout::new(2, 2, 8, Dtype::F16, KvKind::KeyValue, 4).expect("valid layout"),
            chunk_size: 16,
            gpu_blocks: 64,
            cpu_pool_bytes: 16 << 20,
            lower_tier: false,
            inject_failures: None,
            offload: OffloadMode::Eager,
        }
    }
}

/// Something the simulation could not do.
#[derive(Debug, Error)]
pub enum SimError {
    /// The connector failed.
    #[error(transparent)]
    Connector(#[from] ConnectorError),
    /// The GPU pool cannot hold a request.
    #[error(transparent)]
    GpuFull(#[from] GpuFull),
    /// Setting up the pool failed.
    #[error("{0}")]
    Setup(String),
}

/// What happened to one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RequestOutcome {
    /// Request id.
    pub req_id: String,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens found in the GPU prefix cache.
    pub gpu_hit_tokens: usize,
    /// Tokens the connector promised to load.
    pub pool_hit_tokens: usize,
    /// Tokens the model computed (including recomputation after failed loads).
    pub computed_tokens: usize,
    /// GPU blocks reported as failed loads.
    pub failed_blocks: usize,
    /// GPU blocks the request used.
    pub block_ids: Vec<u32>,
    /// Slots (token x layer x plane) whose bytes differ from the model's: must be 0.
    pub mismatched_rows: usize,
}

/// The simulated engine: scheduler, worker, GPU blocks and a host KV cache, over one pool.
pub struct Simulator {
    runtime: Arc<Runtime>,
    engine: Arc<CacheEngine>,
    l1: Arc<LocalCpuBackend>,
    scheduler: ConnectorScheduler,
    worker: ConnectorWorker,
    gpu: GpuBlocks,
    kv: HostPagedKvCache,
    layout: KvLayout,
    next_id: u64,
    kv_events: Vec<kvpool_connector::KvEvent>,
}

impl Simulator {
    /// Builds the pool, both connector roles, and the engine state.
    pub fn new(config: &SimConfig) -> Result<Self, SimError> {
        let runtime = Arc::new(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .map_err(|e| SimError::Setup(e.to_string()))?,
        );
        let layout = config.layout;
        let l1 = Arc::new(
            LocalCpuBackend::new(config.cpu_pool_bytes, EvictionKind::Lru)
                .map_err(|e| SimError::Setup(e.to_string()))?,
        );
        let manager = runtime.block_on(async {
            let mut b = StorageManager::builder().primary(l1.clone(), l1.clone());
            if config.lower_tier {
                let (fail_get, corrupt_put) = config.inject_failures.unwrap_or((0, 0));
                let store = FaultInjector::new(InMemoryConnector::new(), fail_get, corrupt_put);
                let lower: Arc<dyn StorageBackend> =
                    Arc::new(RemoteBackend::new(store, ChunkCodec::default(), 64 << 20));
                b = b.lower(lower);
            }
            b.build()
        });
        let manager = manager.map_err(|e| SimError::Setup(e.to_string()))?;
        let db = ChunkedTokenDatabase::new(
            ChunkingConfig {
                chunk_size: config.chunk_size,
                ..Default::default()
            },
            KeyScope::new("kvpool-sim", 1, 0, 0, layout.fingerprint())
                .map_err(|e| SimError::Setup(e.to_string()))?,
        )
        .map_err(|e| SimError::Setup(e.to_string()))?;
        let engine = Arc::new(
            CacheEngine::new(layout, db, Arc::new(manager))
                .map_err(|e| SimError::Setup(e.to_string()))?,
        );
        let connector_config = ConnectorConfig {
            block_size: layout.block_size,
            save_unfull_chunk: false,
            save_decode_tokens: false,
            offload: config.offload,
        };
        let scheduler = ConnectorScheduler::new(engine.clone(), runtime.clone(), connector_config);
        let mut worker = ConnectorWorker::new(engine.clone(), runtime.clone(), layout.block_size);
        worker.register_kv_caches(&layout)?;
        worker.enable_kv_events();
        Ok(Simulator {
            kv: HostPagedKvCache::new(layout, config.gpu_blocks),
            gpu: GpuBlocks::new(config.gpu_blocks, layout.block_size, config.chunk_size),
            runtime,
            engine,
            l1,
            scheduler,
            worker,
            layout,
            next_id: 0,
            kv_events: Vec::new(),
        })
    }

    /// The worker's KV events so far.
    pub fn kv_events(&self) -> &[kvpool_connector::KvEvent] {
        &self.kv_events
    }

    /// The cache engine (for inspection).
    pub fn engine(&self) -> &Arc<CacheEngine> {
        &self.engine
    }

    /// GPU blocks for a new request; chunks losing their blocks go to the connector.
    fn allocate(&mut self, n: usize) -> Result<Vec<u32>, SimError> {
        let (blocks, evicting) = self.gpu.allocate(n)?;
        self.scheduler.on_blocks_evicting(evicting);
        Ok(blocks)
    }

    /// Forgets the GPU prefix cache, as if memory pressure evicted every cached block.
    pub fn evict_gpu_prefix_cache(&mut self) {
        self.gpu.evict_all();
    }

    fn compute(
        &mut self,
        layer: usize,
        tokens: &[u32],
        blocks: &[u32],
        positions: impl Iterator<Item = usize>,
    ) {
        model_compute(&mut self.kv, layer, tokens, blocks, positions);
    }

    fn mismatches(&self, tokens: &[u32], blocks: &[u32]) -> usize {
        model_mismatches(&self.kv, tokens, blocks)
    }

    /// One engine step for a request: bind the metadata bytes, load, compute `compute` (all
    /// layers), save; returns the failed blocks.
    fn step(
        &mut self,
        req_id: &str,
        tokens: &[u32],
        blocks: &[u32],
        compute: &[usize],
        computed_after_step: usize,
    ) -> Result<Vec<u32>, SimError> {
        let meta = self.scheduler.build_connector_meta(&[ScheduledRequest {
            req_id: req_id.to_string(),
            new_token_ids: Vec::new(),
            blocks: BlockUpdate::Unchanged,
            num_computed_tokens_after_step: computed_after_step,
        }]);
        self.worker.bind_connector_metadata(&meta.encode())?;
        self.worker.start_load_kv(&mut self.kv)?;
        for layer in 0..self.layout.num_layers {
            self.worker.wait_for_layer_load(layer)?;
            self.compute(layer, tokens, blocks, compute.iter().copied());
            self.worker.save_kv_layer(layer, &self.kv)?;
        }
        self.worker.wait_for_save(&self.kv)?;
        self.kv_events.extend(self.worker.take_kv_events());
        let (finished_sending, finished_recving) = self.worker.get_finished(&[]);
        let failed = self.worker.get_block_ids_with_load_errors();
        self.worker.clear_connector_metadata();
        self.scheduler.update_connector_output(&ConnectorOutput {
            finished_sending,
            finished_recving,
            failed_block_ids: failed.clone(),
        });
        Ok(failed)
    }

    /// The engine's answer to failed loads: recompute the failed blocks' tokens, then a step
    /// that saves them. Returns the tokens recomputed.
    fn recover_failed(
        &mut self,
        req_id: &str,
        prompt: &[u32],
        blocks: &[u32],
        failed: &[u32],
    ) -> Result<usize, SimError> {
        if failed.is_empty() {
            return Ok(0);
        }
        let bs = self.layout.block_size;
        let redo: Vec<usize> = (0..prompt.len())
            .filter(|&i| failed.contains(&blocks[i / bs]))
            .collect();
        for layer in 0..self.layout.num_layers {
            self.compute(layer, prompt, blocks, redo.iter().copied());
        }
        self.step(req_id, prompt, blocks, &[], prompt.len())?;
        Ok(redo.len())
    }

    /// Checks the request's KV against the model, caches its full blocks on the GPU, finishes
    /// it and frees its blocks. Returns the rows that differ from the model.
    fn finish_request(&mut self, req_id: &str, prompt: &[u32], blocks: &[u32]) -> usize {
        let mismatched_rows = self.mismatches(prompt, blocks);
        self.gpu.cache_full_blocks(prompt, blocks);
        let (delay_free, _) = self.scheduler.request_finished(req_id, blocks);
        debug_assert!(
            !delay_free,
            "saves are synchronous: frees are never delayed"
        );
        self.gpu.release(blocks);
        mismatched_rows
    }

    /// Runs one request (its prefill) through the whole protocol and checks its KV.
    pub fn run_request(&mut self, prompt: &[u32]) -> Result<RequestOutcome, SimError> {
        self.next_id += 1;
        let req_id = format!("req-{}", self.next_id);
        let n = prompt.len();
        let bs = self.layout.block_size;
        let cached = self.gpu.lookup_and_pin(prompt);
        let gpu_hit = cached.len() * bs;
        let request = EngineRequest {
            req_id: req_id.clone(),
            prompt_token_ids: prompt.to_vec(),
            skip_save: false,
            extra_keys: Vec::new(),
        };
        let (external, _is_async) = self.scheduler.get_num_new_matched_tokens(&request, gpu_hit);
        let needed = n.div_ceil(bs) - cached.len();
        let fresh = match self.gpu.allocate(needed) {
            Ok((b, evicting)) => {
                self.scheduler.on_blocks_evicting(evicting);
                b
            }
            Err(e) => {
                self.gpu.release(&cached);
                return Err(e.into());
            }
        };
        let blocks: Vec<u32> = cached.iter().chain(&fresh).copied().collect();
        self.scheduler
            .update_state_after_alloc(&req_id, &blocks, external);
        let compute: Vec<usize> = (gpu_hit + external..n).collect();
        let failed = self.step(&req_id, prompt, &blocks, &compute, n)?;
        let computed = compute.len() + self.recover_failed(&req_id, prompt, &blocks, &failed)?;
        let mismatched_rows = self.finish_request(&req_id, prompt, &blocks);
        Ok(RequestOutcome {
            req_id,
            prompt_tokens: n,
            gpu_hit_tokens: gpu_hit,
            pool_hit_tokens: external,
            computed_tokens: computed,
            failed_blocks: failed.len(),
            block_ids: blocks,
            mismatched_rows,
        })
    }

    /// A request preempted mid-prefill and resumed: step 1 computes (and saves) the first
    /// `first_step_tokens` tokens; the request is then preempted, its blocks freed and the GPU
    /// prefix cache evicted; the resumed request loads what step 1 saved from the pool and
    /// computes the rest. Returns the resumed request's outcome.
    pub fn run_preempted_request(
        &mut self,
        prompt: &[u32],
        first_step_tokens: usize,
    ) -> Result<RequestOutcome, SimError> {
        self.next_id += 1;
        let req_id = format!("req-{}", self.next_id);
        let n = prompt.len();
        let first = first_step_tokens.min(n - 1);
        let request = EngineRequest {
            req_id: req_id.clone(),
            prompt_token_ids: prompt.to_vec(),
            skip_save: false,
            extra_keys: Vec::new(),
        };
        let (external, _) = self.scheduler.get_num_new_matched_tokens(&request, 0);
        let blocks = self.allocate(n.div_ceil(self.layout.block_size))?;
        self.scheduler
            .update_state_after_alloc(&req_id, &blocks, external);
        let compute: Vec<usize> = (external.min(first)..first).collect();
        self.step(&req_id, prompt, &blocks, &compute, first)?;
        // Preempted: the GPU blocks go back to the pool and their cached prefixes are lost.
        self.scheduler.request_preempted(&req_id);
        self.gpu.release(&blocks);
        self.gpu.evict_all();
        // Resumed under the same id, from scratch on the GPU side.
        let (external, _) = self.scheduler.get_num_new_matched_tokens(&request, 0);
        let blocks = self.allocate(n.div_ceil(self.layout.block_size))?;
        self.scheduler
            .update_state_after_alloc(&req_id, &blocks, external);
        let compute: Vec<usize> = (external..n).collect();
        let failed = self.step(&req_id, prompt, &blocks, &compute, n)?;
        let recomputed = self.recover_failed(&req_id, prompt, &blocks, &failed)?;
        let mismatched_rows = self.finish_request(&req_id, prompt, &blocks);
        Ok(RequestOutcome {
            req_id,
            prompt_tokens: n,
            gpu_hit_tokens: 0,
            pool_hit_tokens: external,
            computed_tokens: compute.len() + recomputed,
            failed_blocks: failed.len(),
            block_ids: blocks,
            mismatched_rows,
        })
    }

    /// After all requests: GPU blocks not returned, requests still tracked, and CPU pool
    /// regions not owned by a stored chunk. All must be 0.
    pub fn leaks(&self) -> (usize, usize, usize) {
        let gpu = self.gpu.blocks_in_use();
        let tracked = self.scheduler.tracked_requests();
        let l1 = self.runtime.block_on(async { self.l1.stats() });
        let regions = self.l1.pool().stats().regions;
        (gpu, tracked, regions.saturating_sub(l1.entries as usize))
    }
}

/// A random shared-prefix workload.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Workload {
    /// Requests.
    pub requests: usize,
    /// Distinct shared prefixes.
    pub prefixes: usize,
    /// Longest prefix, in tokens.
    pub max_prefix_tokens: usize,
    /// Longest unique suffix, in tokens.
    pub max_suffix_tokens: usize,
    /// Seed.
    pub seed: u64,
}

/// Totals of a simulated run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SimReport {
    /// Requests run.
    pub requests: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens found in the GPU prefix cache.
    pub gpu_hit_tokens: usize,
    /// Prefill tokens loaded from the pool instead of computed.
    pub prefill_tokens_saved: usize,
    /// Tokens computed.
    pub computed_tokens: usize,
    /// Failed-load blocks reported (and recomputed).
    pub failed_blocks: usize,
    /// Rows whose final bytes differ from the model's (must be 0).
    pub mismatched_rows: usize,
    /// Leaks at the end: GPU blocks, tracked requests, CPU regions (must be 0).
    pub leaks: (usize, usize, usize),
    /// Tokens written to the pool.
    pub stored_tokens: u64,
    /// Chunks announced by the worker's KV events.
    pub stored_chunk_events: usize,
    /// One line per request.
    pub timeline: Vec<RequestOutcome>,
}

/// Runs `workload` on a fresh simulator.
pub fn run(config: &SimConfig, workload: &Workload) -> Result<SimReport, SimError> {
    let mut sim = Simulator::new(config)?;
    let mut rng = SmallRng::seed_from_u64(workload.seed);
    let prefixes: Vec<Vec<u32>> = (0..workload.prefixes.max(1))
        .map(|_| {
            let len = rng.random_range(1..=workload.max_prefix_tokens.max(1));
            (0..len).map(|_| rng.random_range(0..32_000)).collect()
        })
        .collect();
    let mut report = SimReport::default();
    for _ in 0..workload.requests {
        let mut prompt = prefixes[rng.random_range(0..prefixes.len())].clone();
        let suffix = rng.random_range(1..=workload.max_suffix_tokens.max(1));
        prompt.extend((0..suffix).map(|_| rng.random_range(0..32_000u32)));
        let o = sim.run_request(&prompt)?;
        report.requests += 1;
        report.prompt_tokens += o.prompt_tokens;
        report.gpu_hit_tokens += o.gpu_hit_tokens;
        report.prefill_tokens_saved += o
            .pool_hit_tokens
            .saturating_sub(o.failed_blocks * config.layout.block_size);
        report.computed_tokens += o.computed_tokens;
        report.failed_blocks += o.failed_blocks;
        report.mismatched_rows += o.mismatched_rows;
        report.timeline.push(o);
    }
    report.leaks = sim.leaks();
    report.stored_tokens = sim.engine().stats().stored_tokens;
    report.stored_chunk_events = sim
        .kv_events()
        .iter()
        .map(|e| match e {
            kvpool_connector::KvEvent::ChunksStored { chunk_hashes, .. } => chunk_hashes.len(),
        })
        .sum();
    Ok(report)
}
