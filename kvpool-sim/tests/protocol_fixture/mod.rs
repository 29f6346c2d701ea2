//! The shared fixture of the protocol tests: pools, a scheduler and worker ranks wired as vLLM
//! wires them, each rank over a host KV cache, with helpers to build requests and steps.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use kvpool_connector::{
    BlockUpdate, ConnectorConfig, ConnectorMetadata, ConnectorScheduler, EngineRequest, LeaseTable,
    ScheduledRequest,
};
use kvpool_core::{ByteSize, CacheEngine, ChunkWindow, HostPagedKvCache, KvTransfer, PoolConfig};
use kvpool_sim::engine_side::{EngineWorker, OutputAggregator, RanksLookup, StepOutput};
use kvpool_sim::kv_model::{model_compute, model_mismatches};

pub const BLOCK: usize = 16;
pub const CHUNK: usize = 32;

pub struct Setup {
    pub runtime: Arc<tokio::runtime::Runtime>,
    /// Rank 0's pool (the only one with one rank).
    pub engine: Arc<CacheEngine>,
    pub engines: Vec<Arc<CacheEngine>>,
    pub sched: ConnectorScheduler,
    /// Rank 0.
    pub w: EngineWorker,
    /// Ranks 1 and up.
    pub others: Vec<EngineWorker>,
    pub agg: OutputAggregator,
    /// Requests finished since the last step, for the workers' `transfer_results`.
    pub finished: Vec<String>,
    /// Held requests every rank released.
    pub released: Vec<String>,
}

pub fn setup() -> Setup {
    setup_with(1, ConnectorConfig::new(BLOCK))
}

pub fn setup_with(ranks: usize, config: ConnectorConfig) -> Setup {
    setup_full(ranks, config, Duration::from_secs(60))
}

/// `ranks` worker ranks whose lookup leases live `lease_ttl`.
pub fn setup_full(ranks: usize, config: ConnectorConfig, lease_ttl: Duration) -> Setup {
    setup_pools(ranks, config, lease_ttl, &[])
}

/// One rank whose pool has a lower tier at `tier` (a URL).
pub fn setup_tiered(tier: &str) -> Setup {
    setup_tiers(&[tier])
}

/// One rank whose pool has lower tiers at `tiers` (URLs), in order.
pub fn setup_tiers(tiers: &[&str]) -> Setup {
    setup_pools(
        1,
        ConnectorConfig::new(BLOCK),
        Duration::from_secs(60),
        tiers,
    )
}

fn setup_pools(
    ranks: usize,
    config: ConnectorConfig,
    lease_ttl: Duration,
    tiers: &[&str],
) -> Setup {
    let runtime = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
    );
    let mut engines = Vec::new();
    let mut leases = Vec::new();
    for rank in 0..ranks {
        let mut pool = PoolConfig::default();
        pool.local_cpu.max_size = ByteSize::mib(64);
        pool.chunking.chunk_size = CHUNK;
        pool.layout.num_layers = 2;
        pool.layout.num_kv_heads = 2;
        pool.layout.head_size = 8;
        pool.layout.block_size = BLOCK;
        pool.model.world_size = ranks as u32;
        pool.model.rank = rank as u32;
        pool.tiers
            .extend(tiers.iter().map(|&t| kvpool_core::TierConfig::new(t)));
        let engine = runtime
            .block_on(kvpool_backends::build_pool(&pool))
            .unwrap()
            .engine;
        engines.push(engine);
        leases.push(Arc::new(LeaseTable::new(16 << 20, lease_ttl)));
    }
    let chunking = *engines[0].token_database().config();
    let sched = ConnectorScheduler::with_lookup(
        Box::new(RanksLookup {
            ranks: engines
                .iter()
                .cloned()
                .zip(leases.iter().cloned())
                .collect(),
            runtime: runtime.clone(),
        }),
        chunking.chunk_size,
        chunking.hash_algorithm,
        kvpool_connector::probe_hash(&engines[0]),
        ConnectorConfig {
            num_ranks: ranks as u32,
            ..config
        },
    );
    let mut workers: Vec<EngineWorker> = engines
        .iter()
        .zip(&leases)
        .map(|(e, l)| {
            EngineWorker::new(e.clone(), runtime.clone(), l.clone(), *e.layout(), 64).unwrap()
        })
        .collect();
    let w = workers.remove(0);
    Setup {
        runtime,
        engine: engines[0].clone(),
        engines,
        sched,
        w,
        others: workers,
        agg: OutputAggregator::new(ranks as u32),
        finished: Vec::new(),
        released: Vec::new(),
    }
}

pub fn request(id: &str, prompt: &[u32]) -> EngineRequest {
    EngineRequest {
        req_id: id.into(),
        prompt_token_ids: prompt.to_vec(),
        skip_save: false,
        extra_keys: Vec::new(),
    }
}

pub fn scheduled(id: &str, blocks: BlockUpdate, computed: usize) -> ScheduledRequest {
    ScheduledRequest {
        req_id: id.into(),
        new_token_ids: Vec::new(),
        new_tokens_start: 0,
        blocks,
        num_computed_tokens_after_step: computed,
    }
}

/// What the engine computes in a step: (tokens written as KV, blocks, positions).
pub type Compute<'a> = (&'a [u32], &'a [u32], std::ops::Range<usize>);

impl Setup {
    pub fn ranks(&mut self) -> impl Iterator<Item = &mut EngineWorker> {
        std::iter::once(&mut self.w).chain(self.others.iter_mut())
    }

    /// Computes (with the simulator's model) the KV of `tokens` into `blocks` on every rank.
    pub fn compute(&mut self, tokens: &[u32], blocks: &[u32], positions: std::ops::Range<usize>) {
        for r in self.ranks() {
            for layer in 0..2 {
                model_compute(&mut r.kv, layer, tokens, blocks, positions.clone());
            }
        }
    }

    /// Stores `tokens` in every rank's pool, as a finished request would (computed in a cache
    /// of its own, so this engine's blocks are untouched).
    pub fn seed_pool(&mut self, tokens: &[u32]) {
        let blocks: Vec<u32> = (0..tokens.len().div_ceil(BLOCK) as u32).collect();
        for engine in &self.engines {
            let mut own = HostPagedKvCache::new(*engine.layout(), blocks.len());
            for layer in 0..2 {
                model_compute(&mut own, layer, tokens, &blocks, 0..tokens.len());
            }
            let slots: Vec<i64> = (0..tokens.len() as i64).collect();
            self.runtime
                .block_on(engine.store(tokens, None, &own, &slots))
                .unwrap();
        }
    }

    /// Removes chunk `index` of `tokens` from rank `rank`'s pool (every tier).
    pub fn lose_chunk(&self, rank: usize, tokens: &[u32], index: usize) {
        let engine = &self.engines[rank];
        let spans = engine
            .token_database()
            .process_tokens(tokens, None)
            .unwrap();
        self.runtime
            .block_on(engine.storage().remove(&[spans[index].key.clone()]));
    }

    pub fn pool_hit(&self, tokens: &[u32]) -> usize {
        self.runtime.block_on(self.engine.lookup(tokens)).unwrap()
    }

    /// Runs one step on every rank (bind and loads, the engine's forward pass, saves and
    /// reports) without telling the scheduler: the outputs, one per rank.
    pub fn run_step(
        &mut self,
        meta: &ConnectorMetadata,
        compute: &[Compute<'_>],
    ) -> Vec<StepOutput> {
        let bytes = meta.encode();
        let finished = std::mem::take(&mut self.finished);
        let mut outs = Vec::new();
        for r in self.ranks() {
            r.begin_step(&bytes).unwrap();
        }
        for (tokens, blocks, range) in compute {
            self.compute(tokens, blocks, range.clone());
        }
        for r in self.ranks() {
            outs.push(r.end_step(&finished));
        }
        outs
    }

    /// Hands a step's outputs to the scheduler; returns the blocks that failed to load.
    pub fn report(&mut self, outs: &[StepOutput]) -> Vec<u32> {
        let (output, released) = self.agg.aggregate(outs);
        self.released.extend(released);
        self.sched.update_connector_output(&output);
        output.failed_block_ids
    }

    /// One step as vLLM runs it without asynchronous scheduling: run, then report.
    pub fn worker_step(&mut self, meta: &ConnectorMetadata, compute: &[Compute<'_>]) -> Vec<u32> {
        let outs = self.run_step(meta, compute);
        self.report(&outs)
    }

    /// Steps with nothing scheduled until the scheduler has nothing left to ship (commits
    /// reach the workers), as vLLM keeps stepping while `has_pending_push_work`.
    pub fn settle(&mut self) {
        for _ in 0..4 {
            let meta = self.sched.build_connector_meta(&[]);
            self.worker_step(&meta, &[]);
            if !self.sched.has_pending_work() {
                let meta = self.sched.build_connector_meta(&[]);
                self.worker_step(&meta, &[]);
                return;
            }
        }
        panic!("the scheduler still has pending work after 4 idle steps");
    }

    /// Chunks of `p` (by index) any rank's pool holds whose bytes differ from the model's.
    pub fn wrong_chunks(&self, p: &[u32]) -> Vec<(usize, usize)> {
        let mut wrong = Vec::new();
        for (rank, engine) in self.engines.iter().enumerate() {
            let spans = engine.token_database().process_tokens(p, None).unwrap();
            for (i, span) in spans.iter().enumerate() {
                let got = self
                    .runtime
                    .block_on(engine.storage().get(std::slice::from_ref(&span.key)));
                let Some(chunk) = got.first() else { continue };
                let blocks: Vec<u32> = (0..(span.end / BLOCK) as u32).collect();
                let mut check = HostPagedKvCache::new(*engine.layout(), blocks.len());
                let slots: Vec<i64> = (span.start as i64..span.end as i64).collect();
                check
                    .scatter(ChunkWindow::whole(chunk.data.as_slice(), &slots))
                    .unwrap();
                // Only the chunk's own rows are compared (the rows before it are left zero).
                let own = model_mismatches(&check, &p[..span.end], &blocks)
                    - model_mismatches(&check, &p[..span.start], &blocks);
                if own > 0 {
                    wrong.push((rank, i));
                }
            }
        }
        wrong
    }
}

pub fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt).collect()
}

/// KV computed on top of a failed load: attention read garbage, so every later row is wrong.
pub fn poisoned(p: &[u32]) -> Vec<u32> {
    p.iter().map(|t| t ^ 0x5555).collect()
}
