//! `kvpool sim`: an engine that drives the connector the way vLLM 0.32 does, on one or more
//! tensor-parallel ranks, and checks every KV row it ends up with against recomputation.
//!
//! Like vLLM's scheduler, each step admits several waiting requests (the engine's
//! prefix-cache hits first, then the pool's), caches their prompt blocks at allocation (so
//! requests admitted in the same step share blocks still being computed), passes whole block
//! lists for new and resumed requests and only new blocks for running ones, decodes running
//! requests one token a step, preempts the newest request when a block cannot be had, parks
//! requests whose load is asynchronous until every rank reported it ended, and frees a
//! request's blocks at `request_finished` or, when the connector holds them, once every rank
//! reported it in `finished_sending`. Request ids are reused once free. With asynchronous
//! scheduling the engine schedules (and the connector builds) step N+1 before step N's
//! outcome is known, and applies it one step late, as vLLM's `AsyncScheduler` does.
//!
//! Between the scheduler's lookup and the worker's load, chunks are taken from one rank's pool
//! at random (and that rank's lease on them lapses), so loads fail the way evictions and dead
//! tiers make them fail; failed blocks are handled as vLLM does (every request holding one is
//! rewound and recomputes from it). The model's KV for a token depends on every token before
//! it, and a pass that reads a wrong row on any rank writes wrong rows (`model`), so KV
//! served under the wrong prefix, computed on a failed load, or saved before it was computed
//! shows up as a wrong row when a request finishes.

mod gpu;
mod model;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool_connector::{
    BlockUpdate, ConnectorConfig, ConnectorScheduler, EngineRequest, LeaseTable, LoadTiming,
    ScheduledRequest,
};
use kvpool_core::{ByteSize, CacheEngine, HostPagedKvCache, KvLayout, PoolConfig};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::engine_side::{EngineWorker, OutputAggregator, RanksLookup, StepOutput};
use crate::soak::{RssSampler, resident_anon_bytes};
use gpu::Gpu;
use model::{Model, SimRequest};

/// Simulation settings.
#[derive(Debug, Clone)]
pub struct SimSettings {
    /// Requests to run to completion.
    pub requests: usize,
    /// Most requests running (or waiting for their load) at once (vLLM `max_num_seqs`).
    pub max_running: usize,
    /// Distinct shared prefixes the prompts start with.
    pub prefixes: usize,
    /// Longest shared prefix, in tokens.
    pub max_prefix_tokens: usize,
    /// Longest unique suffix, in tokens.
    pub max_suffix_tokens: usize,
    /// Most tokens generated per request.
    pub max_decode_tokens: usize,
    /// Engine KV blocks (small enough to evict prefixes and preempt requests).
    pub gpu_blocks: usize,
    /// L1 size (per rank).
    pub cpu_size: ByteSize,
    /// Fraction of the chunks a step loads that vanish from one rank between lookup and load.
    pub load_failure_rate: f64,
    /// Tensor-parallel ranks, each with its own pool.
    pub tp_size: usize,
    /// Schedule step N+1 before step N's outcome is known (vLLM's `async_scheduling`).
    pub async_scheduling: bool,
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
            tp_size: 1,
            async_scheduling: false,
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
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens served by the engine's prefix cache.
    pub gpu_hit_tokens: usize,
    /// Tokens the pool promised and the engine accepted.
    pub pool_hit_tokens: usize,
    /// Loads the connector made asynchronous (the request waited for them).
    pub async_loads: usize,
    /// Requests whose blocks the connector held after they finished.
    pub held_requests: usize,
    /// Chunks removed from a rank's pool between lookup and load (injected failures).
    pub injected_failures: usize,
    /// Blocks whose synchronous load was sabotaged.
    pub sabotaged_blocks: usize,
    /// Blocks reported by the workers as failed loads.
    pub reported_failed_blocks: usize,
    /// Sabotaged blocks never reported: must be 0.
    pub unreported_failed_blocks: usize,
    /// Saved chunks the workers dropped before commit (computed on a failed load).
    pub saves_discarded: u64,
    /// Preemptions.
    pub preemptions: usize,
    /// Request ids used again after their request finished.
    pub reused_ids: usize,
    /// Tokens whose KV differs from recomputation when their request finished: must be 0.
    pub wrong_tokens: usize,
    /// Request states the scheduler, copies or staged saves the workers, or blocks the
    /// engine still held at the end: must be 0.
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

/// The simulated engine: scheduler, ranks, blocks and requests.
struct Sim {
    layout: KvLayout,
    chunk: usize,
    engines: Vec<Arc<CacheEngine>>,
    runtime: Arc<tokio::runtime::Runtime>,
    sched: ConnectorScheduler,
    ranks: Vec<EngineWorker>,
    agg: OutputAggregator,
    gpu: Gpu,
    model: Model,
    rng: SmallRng,
    failure_rate: f64,
    lag: usize,
    step: u64,
    waiting: VecDeque<SimRequest>,
    running: Vec<SimRequest>,
    remote: Vec<SimRequest>,
    ready_remote: HashSet<String>,
    held: HashMap<String, Vec<u32>>,
    finished_ids: Vec<String>,
    free_ids: Vec<String>,
    pending: VecDeque<(u64, Vec<StepOutput>)>,
    sabotaged: HashSet<u32>,
    reported: HashSet<u32>,
    r: SimReport,
}

impl Sim {
    fn bs(&self) -> usize {
        self.layout.block_size
    }

    /// One engine step: schedule, build the metadata, run every rank, apply the outcome of
    /// the step `lag` steps back.
    fn step(&mut self, max_running: usize) -> anyhow::Result<()> {
        self.step += 1;
        self.r.steps += 1;
        let bs = self.bs();
        // Loads that ended on every rank: the requests join the running ones.
        let mut i = 0;
        while i < self.remote.len() {
            if self.ready_remote.remove(&self.remote[i].id) {
                let mut q = self.remote.remove(i);
                self.gpu.cache(&q, q.computed);
                q.new_blocks = q.blocks.clone();
                q.replace_blocks = true;
                self.running.push(q);
            } else {
                i += 1;
            }
        }
        let mut scheduled: Vec<(String, usize, usize)> = Vec::new();
        let mut preempted: Vec<String> = Vec::new();
        // Running requests first (decode, or compute what is missing).
        let mut i = 0;
        while i < self.running.len() {
            let q = &mut self.running[i];
            if q.computed == q.tokens.len() {
                if q.decode_left == 0 {
                    i += 1;
                    continue;
                }
                q.decode_left -= 1;
                let t = (q.states[q.tokens.len() - 1] % 50_000) as u32;
                q.push_token(t);
            }
            let need = q.tokens.len().div_ceil(bs);
            if q.blocks.len() < need {
                match self.gpu.allocate(need - q.blocks.len()) {
                    Some(b) => {
                        let q = &mut self.running[i];
                        q.blocks.extend(&b);
                        q.new_blocks.extend(b);
                    }
                    None => {
                        // Preempt the newest request (possibly this one), as vLLM does.
                        let mut victim = self.running.pop().expect("non-empty");
                        self.gpu.release(&victim.blocks);
                        victim.blocks.clear();
                        victim.computed = 0;
                        victim.new_blocks.clear();
                        victim.replace_blocks = true;
                        preempted.push(victim.id.clone());
                        scheduled.retain(|(id, _, _)| *id != victim.id);
                        self.r.preemptions += 1;
                        self.waiting.push_front(victim);
                        continue;
                    }
                }
            }
            let q = &mut self.running[i];
            scheduled.push((q.id.clone(), q.computed, q.tokens.len()));
            q.computed = q.tokens.len();
            q.last_step = self.step;
            i += 1;
        }
        // Admit waiting requests while there is room (not in a step that preempted: vLLM
        // does not admit then).
        while preempted.is_empty()
            && self.running.len() + self.remote.len() < max_running
            && let Some(mut q) = self.waiting.pop_front()
        {
            let hits = self.gpu.lookup(&q);
            let local = hits.len() * bs;
            let engine_req = EngineRequest {
                req_id: q.id.clone(),
                prompt_token_ids: q.tokens[..q.prompt_len].to_vec(),
                skip_save: false,
                extra_keys: Vec::new(),
            };
            let (external, asynchronous) =
                self.sched.get_num_new_matched_tokens(&engine_req, local);
            let need = q.tokens.len().div_ceil(bs) - hits.len();
            let Some(fresh) = self.gpu.allocate(need) else {
                self.gpu.release(&hits);
                self.waiting.push_front(q);
                break;
            };
            q.blocks = hits.iter().chain(&fresh).copied().collect();
            self.sched
                .update_state_after_alloc(&q.id, &q.blocks, external);
            self.r.gpu_hit_tokens += local;
            self.r.pool_hit_tokens += external;
            q.computed = local + external;
            if asynchronous {
                // vLLM: WAITING_FOR_REMOTE_KVS, blocks not cached until the load ends.
                self.r.async_loads += 1;
                self.remote.push(q);
                continue;
            }
            self.gpu.cache(&q, q.prompt_len);
            q.new_blocks = q.blocks.clone();
            q.replace_blocks = true;
            scheduled.push((q.id.clone(), q.computed, q.tokens.len()));
            q.computed = q.tokens.len();
            q.last_step = self.step;
            self.running.push(q);
        }
        self.r.max_requests_per_step = self.r.max_requests_per_step.max(scheduled.len());
        for id in &preempted {
            self.sched.request_preempted(id);
        }
        let steps: Vec<ScheduledRequest> = scheduled
            .iter()
            .map(|(id, _, _)| {
                let q = self
                    .running
                    .iter_mut()
                    .find(|q| q.id == *id)
                    .expect("scheduled requests run");
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
                    new_tokens_start: 0,
                    blocks: update,
                    num_computed_tokens_after_step: q.tokens.len(),
                }
            })
            .collect();
        let meta = self.sched.build_connector_meta(&steps);
        self.sabotage(&meta);
        let bytes = meta.encode();
        for rank in &mut self.ranks {
            rank.begin_step(&bytes)?;
        }
        // The forward pass.
        for (id, from, to) in &scheduled {
            let q = self.running.iter().find(|q| q.id == *id).expect("runs");
            let mut kvs: Vec<&mut HostPagedKvCache> =
                self.ranks.iter_mut().map(|r| &mut r.kv).collect();
            self.model.compute(&mut kvs, q, *from, *to);
        }
        let finished = std::mem::take(&mut self.finished_ids);
        let outs: Vec<StepOutput> = self
            .ranks
            .iter_mut()
            .map(|r| r.end_step(&finished))
            .collect();
        self.pending.push_back((self.step, outs));
        while self.pending.len() > self.lag {
            let (step, outs) = self.pending.pop_front().expect("non-empty");
            self.apply(step, &outs);
        }
        Ok(())
    }

    /// Chunks vanish from one rank between the scheduler's lookup and the worker's load, and
    /// that rank's lease on the request lapses.
    fn sabotage(&mut self, meta: &kvpool_connector::ConnectorMetadata) {
        let (cs, bs) = (self.chunk, self.bs());
        for rm in &meta.requests {
            let Some(load) = rm.load else { continue };
            let (from, until) = (load.gpu_cached_tokens as usize, load.load_until as usize);
            let due: Vec<u32> = (from / bs..until / bs).map(|b| rm.block_ids[b]).collect();
            self.model.loads_due(&due);
            for c in from / cs..until / cs {
                if !self.rng.random_bool(self.failure_rate) {
                    continue;
                }
                let rank = self.rng.random_range(0..self.engines.len());
                let engine = &self.engines[rank];
                let key = kvpool_core::CacheKey::new(
                    engine.token_database().scope().clone(),
                    kvpool_core::ChunkHash(rm.chunk_hashes[c]),
                );
                self.runtime.block_on(engine.storage().remove(&[key]));
                self.ranks[rank].worker.leases().release(&rm.req_id);
                self.r.injected_failures += 1;
                // An asynchronous load fetches later, and another request may store the chunk
                // again meanwhile (a load that then succeeds): only a synchronous load's lost
                // blocks are certain to be reported. A lost block never reported shows up as
                // wrong rows either way.
                if !load.asynchronous {
                    for t in (c * cs).max(from)..(c + 1) * cs {
                        self.sabotaged.insert(rm.block_ids[t / bs]);
                    }
                }
            }
        }
    }

    /// The outcome of step `step` (every rank's output), as vLLM's scheduler applies it.
    fn apply(&mut self, step: u64, outs: &[StepOutput]) {
        let bs = self.bs();
        let (output, released) = self.agg.aggregate(outs);
        let failed: HashSet<u32> = output.failed_block_ids.iter().copied().collect();
        self.r.reported_failed_blocks += failed.len();
        self.reported.extend(&failed);
        // Every request holding a failed block recomputes from it; the blocks leave the
        // prefix cache.
        for q in self.running.iter_mut().chain(self.remote.iter_mut()) {
            if let Some(idx) = q.blocks.iter().position(|b| failed.contains(b)) {
                q.computed = q.computed.min(idx * bs);
            }
        }
        for &b in &failed {
            self.gpu.uncache(b);
        }
        for id in released {
            if let Some(blocks) = self.held.remove(&id) {
                self.gpu.release(&blocks);
            }
        }
        // Requests complete as of this step finish: check every row, then free.
        let mut j = 0;
        while j < self.running.len() {
            let q = &self.running[j];
            if q.computed < q.tokens.len() || q.decode_left > 0 || q.last_step > step {
                j += 1;
                continue;
            }
            let q = self.running.remove(j);
            let kvs: Vec<&HostPagedKvCache> = self.ranks.iter().map(|r| &r.kv).collect();
            self.r.wrong_tokens += self.model.wrong_positions(&kvs, &q, q.tokens.len());
            if self.sched.request_finished(&q.id, &q.blocks) {
                self.r.held_requests += 1;
                self.held.insert(q.id.clone(), q.blocks.clone());
            } else {
                self.gpu.release(&q.blocks);
            }
            self.finished_ids.push(q.id.clone());
            self.free_ids.insert(0, q.id);
            self.r.requests += 1;
        }
        // vLLM hands the connector the step's output after the requests that stopped in it
        // were finished.
        self.sched.update_connector_output(&output);
        self.ready_remote.extend(output.finished_recving);
    }

    fn busy(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// Steps with nothing new until every output is applied, every commit shipped and every
    /// held block released.
    fn drain(&mut self) -> anyhow::Result<()> {
        for _ in 0..64 {
            while let Some((step, outs)) = self.pending.pop_front() {
                self.apply(step, &outs);
            }
            if !self.sched.has_pending_work()
                && self.held.is_empty()
                && self.finished_ids.is_empty()
            {
                return Ok(());
            }
            self.step(0)?;
        }
        anyhow::bail!("the connector still had work after 64 idle steps")
    }

    fn leaks(&self) -> usize {
        let workers: usize = self
            .ranks
            .iter()
            .map(|r| {
                let (jobs, loads, staged, held) = r.worker.in_flight();
                jobs + loads + usize::from(staged > 0) + held
            })
            .sum();
        self.sched.tracked_requests() + workers + self.held.len()
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
    let ranks = s.tp_size.max(1);
    let mut engines = Vec::new();
    let mut leases = Vec::new();
    for rank in 0..ranks {
        let mut config = s.pool_config(layout, chunk_size);
        config.model.world_size = ranks as u32;
        config.model.rank = rank as u32;
        engines.push(
            runtime
                .block_on(kvpool_backends::build_pool(&config))?
                .engine,
        );
        leases.push(Arc::new(LeaseTable::new(
            (s.cpu_size.0 / 4) as usize,
            kvpool_connector::leases::DEFAULT_LEASE_TTL,
        )));
    }
    let bs = layout.block_size;
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
            load_timing: if s.async_scheduling {
                LoadTiming::Always
            } else {
                LoadTiming::Auto
            },
            async_scheduling: s.async_scheduling,
            num_ranks: ranks as u32,
            ..ConnectorConfig::new(bs)
        },
    );
    let workers = engines
        .iter()
        .zip(&leases)
        .map(|(e, l)| {
            EngineWorker::new(e.clone(), runtime.clone(), l.clone(), layout, s.gpu_blocks)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut rng = SmallRng::seed_from_u64(s.seed);
    let prefixes: Vec<Vec<u32>> = (0..s.prefixes.max(1))
        .map(|_| {
            let n = rng.random_range(chunk_size..=s.max_prefix_tokens.max(chunk_size));
            (0..n).map(|_| rng.random_range(0..50_000)).collect()
        })
        .collect();
    let mut sim = Sim {
        layout,
        chunk: chunk_size,
        engines,
        runtime: runtime.clone(),
        sched,
        ranks: workers,
        agg: OutputAggregator::new(ranks as u32),
        gpu: Gpu::new(s.gpu_blocks, bs),
        model: Model::new(layout, ranks),
        rng,
        failure_rate: s.load_failure_rate,
        lag: usize::from(s.async_scheduling),
        step: 0,
        waiting: VecDeque::new(),
        running: Vec::new(),
        remote: Vec::new(),
        ready_remote: HashSet::new(),
        held: HashMap::new(),
        finished_ids: Vec::new(),
        free_ids: (0..s.max_running * 2).map(|i| format!("req-{i}")).collect(),
        pending: VecDeque::new(),
        sabotaged: HashSet::new(),
        reported: HashSet::new(),
        r: SimReport::default(),
    };
    let mut used_ids: HashSet<String> = HashSet::new();
    let mut created = 0;
    let started = Instant::now();
    let mut rss = RssSampler::new(s.duration);
    let mut idle_steps = 0;
    loop {
        rss.tick(started.elapsed());
        // A timed run stops creating requests when its time is up and ends when the running
        // ones have finished.
        let out_of_time = s.duration.is_some_and(|d| started.elapsed() >= d);
        let target = if out_of_time { created } else { s.requests };
        if sim.r.requests >= target {
            break;
        }
        // New arrivals keep the queue full.
        while !out_of_time
            && created < s.requests
            && sim.waiting.len() + sim.running.len() + sim.remote.len() < s.max_running * 2
        {
            let Some(id) = sim.free_ids.pop() else { break };
            if !used_ids.insert(id.clone()) {
                sim.r.reused_ids += 1;
            }
            let mut q = SimRequest::new(id, sim.rng.random_range(1..=s.max_decode_tokens.max(1)));
            let prefix = sim.rng.random_range(0..prefixes.len());
            for &t in &prefixes[prefix] {
                q.push_token(t);
            }
            for _ in 0..sim.rng.random_range(1..=s.max_suffix_tokens.max(1)) {
                let t = sim.rng.random_range(0..50_000);
                q.push_token(t);
            }
            q.prompt_len = q.tokens.len();
            sim.r.prompt_tokens += q.prompt_len;
            created += 1;
            sim.waiting.push_back(q);
        }
        let before = sim.r.requests;
        sim.step(s.max_running)?;
        idle_steps = if sim.r.requests == before {
            idle_steps + 1
        } else {
            0
        };
        // Nothing finishing while nothing can run means the workload cannot fit.
        let nothing_runs = sim.running.is_empty()
            && sim.remote.is_empty()
            && sim.held.is_empty()
            && sim.pending.is_empty();
        anyhow::ensure!(
            !(nothing_runs && sim.busy() && idle_steps > 100),
            "no request fits in {} blocks of {bs} tokens; raise --gpu-blocks",
            s.gpu_blocks
        );
        anyhow::ensure!(
            idle_steps < 10_000,
            "no request finished in 10000 steps: {} running, {} waiting for a load, {} queued, {} held",
            sim.running.len(),
            sim.remote.len(),
            sim.waiting.len(),
            sim.held.len()
        );
    }
    sim.drain()?;
    sim.r.sabotaged_blocks = sim.sabotaged.len();
    sim.r.unreported_failed_blocks = sim.sabotaged.difference(&sim.reported).count();
    sim.r.saves_discarded = sim
        .ranks
        .iter()
        .map(|r| r.worker.stats().saves_discarded)
        .sum();
    sim.r.leaked_request_states = sim.leaks();
    let mut r = std::mem::take(&mut sim.r);
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
    let engines = std::mem::take(&mut sim.engines);
    drop(sim);
    for engine in engines {
        runtime
            .block_on(engine.storage().close())
            .map_err(|e| anyhow::anyhow!("closing the pool: {e}"))?;
    }
    Ok(r)
}
