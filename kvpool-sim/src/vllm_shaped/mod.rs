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

mod engine;
mod gpu;
mod model;
mod settings;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use kvpool_connector::{ConnectorConfig, ConnectorScheduler, LeaseTable, LoadTiming};
use kvpool_core::KvLayout;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::engine_side::{EngineWorker, OutputAggregator, RanksLookup};
use crate::soak::{RssSampler, resident_anon_bytes};
use engine::Sim;
use gpu::Gpu;
use model::{Model, SimRequest};
pub use settings::{SimReport, SimSettings};

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
            kvpool_connector::vllm::leases::DEFAULT_LEASE_TTL,
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
    let mut last_finish = Instant::now();
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
            last_finish = Instant::now();
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
        if idle_steps >= 10_000 {
            // Waits a millisecond a step from here (vLLM's idle loop), for a load on a busy
            // machine; stuck only once no request finished for `STALL_LIMIT` too.
            anyhow::ensure!(
                last_finish.elapsed() < engine::STALL_LIMIT,
                "no request finished in {idle_steps} steps and {:?}: {} running, {} waiting for a load, {} queued, {} held",
                last_finish.elapsed(),
                sim.running.len(),
                sim.remote.len(),
                sim.waiting.len(),
                sim.held.len()
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
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
