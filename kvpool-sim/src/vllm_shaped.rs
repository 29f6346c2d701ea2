//! `kvpool sim`: an engine that drives the connector exactly the way vLLM 0.32 does, and
//! checks every KV row it ends up with against recomputation.
//!
//! Like vLLM's scheduler, each step admits several waiting requests (GPU prefix-cache hits
//! first, then the pool's), caches their prompt blocks at allocation (so requests admitted in
//! the same step share blocks still being computed), passes whole block lists for new and
//! resumed requests and only new blocks for running ones, decodes running requests one token
//! a step, preempts the newest request when a block cannot be had, and frees a request's
//! blocks right after `request_finished`. Request ids are reused once free. Between the
//! scheduler's lookup and the worker's load, chunks are removed from the pool at random, so
//! loads fail the way evictions and dead tiers make them fail; failed blocks are handled as
//! vLLM does (every running request holding one is rewound and recomputes from it).
//!
//! The model's KV for a token depends on every token before it (as attention does), so KV
//! served under the wrong prefix, or a block saved before it was computed, shows up as a
//! wrong row when a request finishes.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool_connector::{
    BlockUpdate, ConnectorConfig, ConnectorOutput, ConnectorScheduler, ConnectorWorker,
    EngineRequest, ScheduledRequest,
};
use kvpool_core::{ByteSize, CacheEngine, HostPagedKvCache, KvLayout, PoolConfig};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::soak::{RssSampler, resident_anon_bytes};

/// Simulation settings.
#[derive(Debug, Clone)]
pub struct SimSettings {
    /// Requests to run to completion.
    pub requests: usize,
    /// Most requests running at once (vLLM `max_num_seqs`).
    pub max_running: usize,
    /// Distinct shared prefixes the prompts start with.
    pub prefixes: usize,
    /// Longest shared prefix, in tokens.
    pub max_prefix_tokens: usize,
    /// Longest unique suffix, in tokens.
    pub max_suffix_tokens: usize,
    /// Most tokens generated per request.
    pub max_decode_tokens: usize,
    /// GPU KV blocks (small enough to evict prefixes and preempt requests).
    pub gpu_blocks: usize,
    /// L1 size.
    pub cpu_size: ByteSize,
    /// Fraction of the chunks a step loads that vanish between lookup and load.
    pub load_failure_rate: f64,
    /// Random seed.
    pub seed: u64,
    /// The pool's configuration (lower tiers, timeouts, write-behind); L1 size, chunk size
    /// and layout are set from these settings and `run`'s arguments.
    pub pool: PoolConfig,
    /// Run until this much time has passed (then let the running requests finish) instead of
    /// stopping after `requests`; RSS is sampled after a warm-up and at the end.
    pub duration: Option<Duration>,
}

impl Default for SimSettings {
    fn default() -> Self {
        Self {
            requests: 2000,
            max_running: 16,
            prefixes: 8,
            max_prefix_tokens: 1024,
            max_suffix_tokens: 256,
            max_decode_tokens: 32,
            gpu_blocks: 384,
            cpu_size: ByteSize(16 << 20),
            load_failure_rate: 0.05,
            seed: 1,
            pool: PoolConfig::default(),
            duration: None,
        }
    }
}

impl SimSettings {
    /// The pool configuration a run uses: `pool` with L1 size, chunk size and layout set.
    pub fn pool_config(&self, layout: KvLayout, chunk_size: usize) -> PoolConfig {
        let mut config = self.pool.clone();
        config.local_cpu.max_size = self.cpu_size;
        config.chunking.chunk_size = chunk_size;
        config.layout.num_layers = layout.num_layers;
        config.layout.num_kv_heads = layout.num_kv_heads;
        config.layout.head_size = layout.head_size;
        config.layout.dtype = layout.dtype;
        config.layout.block_size = layout.block_size;
        config
    }
}

/// What the simulation saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SimReport {
    /// Requests finished.
    pub requests: usize,
    /// Engine steps.
    pub steps: usize,
    /// Most requests scheduled in one step.
    pub max_requests_per_step: usize,
    /// Requests admitted in a step that shared a block another request admitted in the same
    /// step was computing.
    pub same_step_shared_admissions: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens served by the GPU prefix cache.
    pub gpu_hit_tokens: usize,
    /// Tokens the pool promised and the engine accepted.
    pub pool_hit_tokens: usize,
    /// Chunks removed from the pool between lookup and load (injected failures).
    pub injected_failures: usize,
    /// Blocks whose load was sabotaged.
    pub sabotaged_blocks: usize,
    /// Blocks reported by the worker as failed loads.
    pub reported_failed_blocks: usize,
    /// Sabotaged blocks the worker did not report: must be 0.
    pub unreported_failed_blocks: usize,
    /// Preemptions.
    pub preemptions: usize,
    /// Request ids used again after their request finished.
    pub reused_ids: usize,
    /// Tokens whose KV differs from recomputation when their request finished: must be 0.
    pub wrong_tokens: usize,
    /// Request states the scheduler still held at the end: must be 0.
    pub leaked_request_states: usize,
    /// Seconds the run took.
    pub elapsed_seconds: f64,
    /// Anonymous resident memory (`RssAnon`) after the warm-up of a timed run (bytes): the
    /// median of the first window after it (see `RssSampler::growth_window_medians`).
    pub rss_after_warm_up_bytes: Option<u64>,
    /// Anonymous resident memory (`RssAnon`) at the end of a timed run (bytes): the median of
    /// its last window.
    pub rss_end_bytes: Option<u64>,
    /// Every 10 s of a timed run: (second, resident bytes, anonymous resident bytes, C heap
    /// bytes in use).
    pub rss_timeline: Vec<(u64, u64, u64, u64)>,
}

/// The model: a token's KV row depends on the whole prefix up to it.
fn prefix_state(prev: u64, token: u32, pos: usize) -> u64 {
    xxhash_rust::xxh3::xxh3_64(
        &[
            prev.to_le_bytes(),
            (token as u64 | (pos as u64) << 32).to_le_bytes(),
        ]
        .concat(),
    )
}

fn model_row(state: u64, layer: usize, plane: usize, row: &mut [u8]) {
    let mut x = (state ^ ((layer as u64) << 40) ^ ((plane as u64) << 48)) | 1;
    for b in row.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

struct Request {
    id: String,
    prompt_len: usize,
    tokens: Vec<u32>,
    /// `states[i]`: the model state after token `i` (KV of position `i` derives from it).
    states: Vec<u64>,
    blocks: Vec<u32>,
    computed: usize,
    decode_left: usize,
    new_blocks: Vec<u32>,
    replace_blocks: bool,
}

impl Request {
    fn push_token(&mut self, t: u32) {
        let prev = self.states.last().copied().unwrap_or(0x6b76706f6f6c);
        self.states.push(prefix_state(prev, t, self.tokens.len()));
        self.tokens.push(t);
    }
}

/// A prefix-caching GPU block pool, as vLLM's: blocks cached by their chain hash at
/// allocation, free blocks stay cached until reused (least recently freed first).
struct Gpu {
    free: VecDeque<u32>,
    refs: Vec<u32>,
    cached: HashMap<u64, u32>,
    hash_of: Vec<Option<u64>>,
    block_size: usize,
}

impl Gpu {
    fn block_hashes(&self, states: &[u64], upto: usize) -> Vec<u64> {
        (0..upto / self.block_size)
            .map(|b| states[(b + 1) * self.block_size - 1])
            .collect()
    }

    /// Cached blocks of the longest prefix of full blocks of `tokens[..n-1]`, pinned.
    fn lookup(&mut self, req: &Request) -> Vec<u32> {
        let mut hit = Vec::new();
        for h in self.block_hashes(&req.states, req.prompt_len - 1) {
            let Some(&b) = self.cached.get(&h) else { break };
            if self.refs[b as usize] == 0 {
                self.free.retain(|&f| f != b);
            }
            self.refs[b as usize] += 1;
            hit.push(b);
        }
        hit
    }

    fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        let blocks: Vec<u32> = self.free.drain(..n).collect();
        for &b in &blocks {
            if let Some(h) = self.hash_of[b as usize].take() {
                self.cached.remove(&h);
            }
            self.refs[b as usize] = 1;
        }
        Some(blocks)
    }

    /// Caches the request's full prompt blocks (vLLM does so when it allocates them).
    fn cache_prompt(&mut self, req: &Request) -> usize {
        let mut newly = 0;
        for (h, &b) in self
            .block_hashes(&req.states, req.prompt_len)
            .iter()
            .zip(&req.blocks)
        {
            if self.hash_of[b as usize].is_none() && !self.cached.contains_key(h) {
                self.cached.insert(*h, b);
                self.hash_of[b as usize] = Some(*h);
                newly += 1;
            }
        }
        newly
    }

    fn uncache(&mut self, b: u32) {
        if let Some(h) = self.hash_of[b as usize].take() {
            self.cached.remove(&h);
        }
    }

    fn release(&mut self, blocks: &[u32]) {
        for &b in blocks {
            self.refs[b as usize] -= 1;
            if self.refs[b as usize] == 0 {
                self.free.push_back(b);
            }
        }
    }
}

/// Runs the simulation.
pub fn run(s: &SimSettings, layout: KvLayout, chunk_size: usize) -> anyhow::Result<SimReport> {
    let runtime = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?,
    );
    let config = s.pool_config(layout, chunk_size);
    let engine: Arc<CacheEngine> = runtime
        .block_on(kvpool_backends::build_pool(&config))?
        .engine;
    let bs = layout.block_size;
    let mut sched = ConnectorScheduler::new(
        engine.clone(),
        runtime.clone(),
        ConnectorConfig {
            block_size: bs,
            save_unfull_chunk: false,
            save_decode_tokens: false,
            offload: Default::default(),
        },
    );
    let mut worker = ConnectorWorker::new(engine.clone(), runtime.clone(), bs);
    worker.register_kv_caches(&layout)?;
    let mut kv = HostPagedKvCache::new(layout, s.gpu_blocks);
    let mut gpu = Gpu {
        free: (0..s.gpu_blocks as u32).collect(),
        refs: vec![0; s.gpu_blocks],
        cached: HashMap::new(),
        hash_of: vec![None; s.gpu_blocks],
        block_size: bs,
    };
    let mut rng = SmallRng::seed_from_u64(s.seed);
    let prefixes: Vec<Vec<u32>> = (0..s.prefixes.max(1))
        .map(|_| {
            let n = rng.random_range(chunk_size..=s.max_prefix_tokens.max(chunk_size));
            (0..n).map(|_| rng.random_range(0..50_000)).collect()
        })
        .collect();
    let mut free_ids: Vec<String> = (0..s.max_running * 2).map(|i| format!("req-{i}")).collect();
    let mut used_ids: HashSet<String> = HashSet::new();
    let mut waiting: VecDeque<Request> = VecDeque::new();
    let mut running: Vec<Request> = Vec::new();
    let mut created = 0;
    let mut r = SimReport::default();
    let mut row = vec![0u8; layout.bytes_per_token_per_plane()];
    let mut got = vec![0u8; layout.bytes_per_token_per_plane()];

    let started = Instant::now();
    let mut rss = RssSampler::new(s.duration);
    loop {
        rss.tick(started.elapsed());
        // A timed run stops creating requests when its time is up and ends when the running
        // ones have finished.
        let out_of_time = s.duration.is_some_and(|d| started.elapsed() >= d);
        if r.requests >= if out_of_time { created } else { s.requests } {
            break;
        }
        // New arrivals keep the queue full.
        while !out_of_time
            && created < s.requests
            && waiting.len() + running.len() < s.max_running * 2
        {
            let Some(id) = free_ids.pop() else { break };
            if !used_ids.insert(id.clone()) {
                r.reused_ids += 1;
            }
            let mut req = Request {
                id,
                prompt_len: 0,
                tokens: Vec::new(),
                states: Vec::new(),
                blocks: Vec::new(),
                computed: 0,
                decode_left: rng.random_range(1..=s.max_decode_tokens.max(1)),
                new_blocks: Vec::new(),
                replace_blocks: true,
            };
            for &t in &prefixes[rng.random_range(0..prefixes.len())] {
                req.push_token(t);
            }
            for _ in 0..rng.random_range(1..=s.max_suffix_tokens.max(1)) {
                req.push_token(rng.random_range(0..50_000));
            }
            req.prompt_len = req.tokens.len();
            r.prompt_tokens += req.prompt_len;
            created += 1;
            waiting.push_back(req);
        }
        r.steps += 1;
        let mut scheduled: Vec<(usize, usize)> = Vec::new(); // (running index, compute from)
        let mut preempted: Vec<String> = Vec::new();
        // Running requests first (decode, or recompute after a failed load).
        let mut i = 0;
        while i < running.len() {
            let need = running[i].tokens.len().div_ceil(bs);
            if running[i].blocks.len() < need {
                match gpu.allocate(need - running[i].blocks.len()) {
                    Some(b) => {
                        running[i].blocks.extend(&b);
                        running[i].new_blocks.extend(b);
                    }
                    None => {
                        // Preempt the newest request (possibly this one), as vLLM does.
                        let mut victim = running.pop().expect("non-empty");
                        gpu.release(&victim.blocks);
                        victim.blocks.clear();
                        victim.computed = 0;
                        victim.new_blocks.clear();
                        victim.replace_blocks = true;
                        preempted.push(victim.id.clone());
                        r.preemptions += 1;
                        waiting.push_front(victim);
                        continue;
                    }
                }
            }
            scheduled.push((i, running[i].computed));
            i += 1;
        }
        // Admit waiting requests while there is room.
        let mut admitted_blocks: HashSet<u32> = HashSet::new();
        while running.len() < s.max_running
            && let Some(mut req) = waiting.pop_front()
        {
            let hits = gpu.lookup(&req);
            let local = hits.len() * bs;
            let engine_req = EngineRequest {
                req_id: req.id.clone(),
                prompt_token_ids: req.tokens[..req.prompt_len].to_vec(),
                skip_save: false,
                extra_keys: Vec::new(),
            };
            let (external, _) = sched.get_num_new_matched_tokens(&engine_req, local);
            let need = req.tokens.len().div_ceil(bs) - hits.len();
            let Some(fresh) = gpu.allocate(need) else {
                gpu.release(&hits);
                waiting.push_front(req);
                break;
            };
            if hits.iter().any(|b| admitted_blocks.contains(b)) {
                r.same_step_shared_admissions += 1;
            }
            req.blocks = hits.iter().chain(&fresh).copied().collect();
            admitted_blocks.extend(&fresh);
            gpu.cache_prompt(&req);
            sched.update_state_after_alloc(&req.id, &req.blocks, external);
            r.gpu_hit_tokens += local;
            r.pool_hit_tokens += external;
            req.computed = local + external;
            req.new_blocks = req.blocks.clone();
            req.replace_blocks = true;
            running.push(req);
            scheduled.push((running.len() - 1, local + external));
        }
        anyhow::ensure!(
            !scheduled.is_empty(),
            "no request fits in {} GPU blocks of {bs} tokens; raise --gpu-blocks",
            s.gpu_blocks
        );
        r.max_requests_per_step = r.max_requests_per_step.max(scheduled.len());
        for id in &preempted {
            sched.request_preempted(id);
        }
        let steps: Vec<ScheduledRequest> = scheduled
            .iter()
            .map(|&(i, _)| {
                let q = &mut running[i];
                let blocks = std::mem::take(&mut q.new_blocks);
                let update = if std::mem::take(&mut q.replace_blocks) {
                    BlockUpdate::Replace(blocks)
                } else if blocks.is_empty() {
                    BlockUpdate::Unchanged
                } else {
                    BlockUpdate::Append(blocks)
                };
                ScheduledRequest {
                    req_id: q.id.clone(),
                    new_token_ids: Vec::new(),
                    blocks: update,
                    num_computed_tokens_after_step: q.tokens.len(),
                }
            })
            .collect();
        let meta = sched.build_connector_meta(&steps);
        // Chunks vanish between the scheduler's lookup and the worker's load.
        let mut sabotaged: HashSet<u32> = HashSet::new();
        for rm in &meta.requests {
            let Some(load) = rm.load else { continue };
            let cs = chunk_size;
            for c in (load.gpu_cached_tokens as usize / cs)..(load.load_until as usize / cs) {
                if rng.random_bool(s.load_failure_rate) {
                    let key = kvpool_core::CacheKey::new(
                        engine.token_database().scope().clone(),
                        kvpool_core::ChunkHash(rm.chunk_hashes[c]),
                    );
                    runtime.block_on(engine.storage().remove(&[key]));
                    r.injected_failures += 1;
                    let from = (c * cs).max(load.gpu_cached_tokens as usize);
                    for t in from..(c + 1) * cs {
                        sabotaged.insert((rm.slot_mapping[t] as usize / bs) as u32);
                    }
                }
            }
        }
        worker.bind_connector_metadata(&meta.encode())?;
        worker.start_load_kv(&mut kv)?;
        worker.finish_loads()?;
        // The forward pass: every scheduled request computes its new positions.
        for &(i, from) in &scheduled {
            let q = &running[i];
            for pos in from..q.tokens.len() {
                let slot = q.blocks[pos / bs] as usize * bs + pos % bs;
                for layer in 0..layout.num_layers {
                    for plane in 0..layout.kind.planes() {
                        model_row(q.states[pos], layer, plane, &mut row);
                        kv.row_mut(layer, plane, slot).copy_from_slice(&row);
                    }
                }
            }
        }
        worker.wait_for_save(&kv)?;
        worker.clear_connector_metadata();
        let failed: HashSet<u32> = worker
            .get_block_ids_with_load_errors()
            .into_iter()
            .collect();
        r.sabotaged_blocks += sabotaged.len();
        r.reported_failed_blocks += failed.len();
        r.unreported_failed_blocks += sabotaged.difference(&failed).count();
        // vLLM: every running request holding a failed block recomputes from it, and the
        // failed blocks leave the prefix cache.
        for q in running.iter_mut() {
            if let Some(idx) = q.blocks.iter().position(|b| failed.contains(b)) {
                q.computed = q.computed.min(idx * bs);
            }
        }
        for &b in &failed {
            gpu.uncache(b);
        }
        sched.update_connector_output(&ConnectorOutput {
            failed_block_ids: failed.iter().copied().collect(),
            ..Default::default()
        });
        // Advance: requests whose KV is complete sample a token or finish.
        let mut j = 0;
        while j < running.len() {
            let q = &mut running[j];
            if scheduled.iter().any(|&(i, _)| i == j) && q.computed < q.tokens.len() {
                let was_rewound = failed.iter().any(|b| q.blocks.contains(b));
                if !was_rewound {
                    q.computed = q.tokens.len();
                }
            }
            if q.computed < q.tokens.len() {
                j += 1;
                continue;
            }
            if q.decode_left > 0 {
                q.decode_left -= 1;
                let t = (q.states[q.tokens.len() - 1] % 50_000) as u32;
                q.push_token(t);
                j += 1;
                continue;
            }
            // Finished: check every computed position, then free.
            let q = running.remove(j);
            for pos in 0..q.computed {
                let slot = q.blocks[pos / bs] as usize * bs + pos % bs;
                let mut wrong = false;
                for layer in 0..layout.num_layers {
                    for plane in 0..layout.kind.planes() {
                        model_row(q.states[pos], layer, plane, &mut row);
                        got.copy_from_slice(kv.row(layer, plane, slot));
                        wrong |= got != row;
                    }
                }
                r.wrong_tokens += usize::from(wrong);
            }
            let (delay, _) = sched.request_finished(&q.id, &q.blocks);
            anyhow::ensure!(!delay, "the connector asked to delay a free");
            gpu.release(&q.blocks);
            free_ids.insert(0, q.id);
            r.requests += 1;
        }
    }
    r.leaked_request_states = sched.tracked_requests();
    r.elapsed_seconds = started.elapsed().as_secs_f64();
    if s.duration.is_some() {
        match rss.growth_window_medians() {
            Some((after_warm_up, end)) => {
                r.rss_after_warm_up_bytes = Some(after_warm_up);
                r.rss_end_bytes = Some(end);
            }
            None => {
                r.rss_after_warm_up_bytes = rss.after_warm_up;
                r.rss_end_bytes = resident_anon_bytes();
            }
        }
        r.rss_timeline = std::mem::take(&mut rss.timeline);
    }
    drop((sched, worker));
    runtime
        .block_on(engine.storage().close())
        .map_err(|e| anyhow::anyhow!("closing the pool: {e}"))?;
    Ok(r)
}
