//! The shared fixture of the protocol tests: a pool, a scheduler and a worker wired as vLLM
//! wires them, over a host KV cache, with helpers to build requests and steps.
#![allow(dead_code)]

use std::sync::Arc;

use kvpool_connector::{
    BlockUpdate, ConnectorConfig, ConnectorScheduler, ConnectorWorker, EngineRequest,
    ScheduledRequest,
};
use kvpool_core::{ByteSize, CacheEngine, HostPagedKvCache, PoolConfig};
use kvpool_sim::single_request::model_compute;

pub const BLOCK: usize = 16;
pub const CHUNK: usize = 32;

pub struct Setup {
    pub runtime: Arc<tokio::runtime::Runtime>,
    pub engine: Arc<CacheEngine>,
    pub sched: ConnectorScheduler,
    pub worker: ConnectorWorker,
    pub kv: HostPagedKvCache,
}

pub fn setup() -> Setup {
    let runtime = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
    );
    let mut config = PoolConfig::default();
    config.local_cpu.max_size = ByteSize::mib(64);
    config.chunking.chunk_size = CHUNK;
    config.layout.num_layers = 2;
    config.layout.num_kv_heads = 2;
    config.layout.head_size = 8;
    config.layout.block_size = BLOCK;
    let engine = runtime
        .block_on(kvpool_backends::build_pool(&config))
        .unwrap()
        .engine;
    let sched = ConnectorScheduler::new(
        engine.clone(),
        runtime.clone(),
        ConnectorConfig {
            block_size: BLOCK,
            save_unfull_chunk: false,
            save_decode_tokens: false,
            offload: Default::default(),
        },
    );
    let mut worker = ConnectorWorker::new(engine.clone(), runtime.clone(), BLOCK);
    worker.register_kv_caches(engine.layout()).unwrap();
    let kv = HostPagedKvCache::new(*engine.layout(), 64);
    Setup {
        runtime,
        engine,
        sched,
        worker,
        kv,
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
        blocks,
        num_computed_tokens_after_step: computed,
    }
}

impl Setup {
    /// Computes (with the simulator's model) the KV of `tokens` into `blocks`.
    pub fn compute(&mut self, tokens: &[u32], blocks: &[u32], positions: std::ops::Range<usize>) {
        for layer in 0..2 {
            model_compute(&mut self.kv, layer, tokens, blocks, positions.clone());
        }
    }

    /// Stores `tokens` in the pool, as a finished request would (computed in a cache of its
    /// own, so this engine's blocks are untouched).
    pub fn seed_pool(&mut self, tokens: &[u32]) {
        let blocks: Vec<u32> = (0..tokens.len().div_ceil(BLOCK) as u32).collect();
        let mut own = HostPagedKvCache::new(*self.engine.layout(), blocks.len());
        for layer in 0..2 {
            model_compute(&mut own, layer, tokens, &blocks, 0..tokens.len());
        }
        let slots: Vec<i64> = (0..tokens.len() as i64).collect();
        self.runtime
            .block_on(self.engine.store(tokens, None, &own, &slots))
            .unwrap();
    }

    pub fn pool_hit(&self, tokens: &[u32]) -> usize {
        self.runtime.block_on(self.engine.lookup(tokens)).unwrap()
    }

    /// One worker step: bind, load (all layers), the engine computes `compute`, save.
    pub fn worker_step(
        &mut self,
        meta: &[u8],
        compute: &[(&[u32], &[u32], std::ops::Range<usize>)],
    ) {
        self.worker.bind_connector_metadata(meta).unwrap();
        self.worker.start_load_kv(&mut self.kv).unwrap();
        self.worker.finish_loads().unwrap();
        for (tokens, blocks, range) in compute {
            self.compute(tokens, blocks, range.clone());
        }
        self.worker.wait_for_save(&self.kv).unwrap();
        self.worker.clear_connector_metadata();
    }
}

pub fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt).collect()
}
