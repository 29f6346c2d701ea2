//! The simulated engine: its scheduler, ranks, blocks and requests, and one step of it as
//! vLLM takes one (schedule, build the connector's metadata, run every rank, apply outcomes).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool_connector::{BlockUpdate, ConnectorScheduler, EngineRequest, ScheduledRequest};
use kvpool_core::{CacheEngine, HostPagedKvCache, KvLayout};
use rand::Rng;
use rand::rngs::SmallRng;

use super::SimReport;
use super::gpu::Gpu;
use super::model::{Model, SimRequest};
use crate::engine_side::{EngineWorker, OutputAggregator, StepOutput};

/// How long the engine may go without a request finishing (or, draining, without the
/// connector's work ending) before the run fails as stuck: long enough for a load on a
/// machine busy with other work, as the step counts alone were not.
pub(super) const STALL_LIMIT: Duration = Duration::from_secs(30);

/// The simulated engine: scheduler, ranks, blocks and requests.
pub(super) struct Sim {
    pub(super) layout: KvLayout,
    pub(super) chunk: usize,
    pub(super) engines: Vec<Arc<CacheEngine>>,
    pub(super) runtime: Arc<tokio::runtime::Runtime>,
    pub(super) sched: ConnectorScheduler,
    pub(super) ranks: Vec<EngineWorker>,
    pub(super) agg: OutputAggregator,
    pub(super) gpu: Gpu,
    pub(super) model: Model,
    pub(super) rng: SmallRng,
    pub(super) failure_rate: f64,
    pub(super) lag: usize,
    pub(super) step: u64,
    pub(super) waiting: VecDeque<SimRequest>,
    pub(super) running: Vec<SimRequest>,
    pub(super) remote: Vec<SimRequest>,
    pub(super) ready_remote: HashSet<String>,
    pub(super) held: HashMap<String, Vec<u32>>,
    pub(super) finished_ids: Vec<String>,
    pub(super) free_ids: Vec<String>,
    pub(super) pending: VecDeque<(u64, Vec<StepOutput>)>,
    pub(super) sabotaged: HashSet<u32>,
    pub(super) reported: HashSet<u32>,
    pub(super) r: SimReport,
}

impl Sim {
    fn bs(&self) -> usize {
        self.layout.block_size
    }

    /// One engine step: schedule, build the metadata, run every rank, apply the outcome of
    /// the step `lag` steps back.
    pub(super) fn step(&mut self, max_running: usize) -> anyhow::Result<()> {
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
                self.runtime
                    .block_on(engine.storage().remove(std::slice::from_ref(&key)));
                self.ranks[rank].worker.leases().release(&rm.req_id);
                self.r.injected_failures += 1;
                // A tier may keep its copy: the pool daemon's `Delete` drops shared memory's
                // copy only, never its lower tiers' (durable) ones, and the load then finds
                // the chunk there.
                let still_held = !self
                    .runtime
                    .block_on(engine.storage().lookup(std::slice::from_ref(&key)))
                    .is_empty();
                // An asynchronous load fetches later, and another request may store the chunk
                // again meanwhile (a load that then succeeds): only a synchronous load's lost
                // blocks are certain to be reported. A lost block never reported shows up as
                // wrong rows either way.
                if !load.asynchronous && !still_held {
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

    pub(super) fn busy(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// Steps with nothing new until every output is applied, every commit shipped and every
    /// held block released. Past 64 steps it waits a millisecond a step (as vLLM's idle loop
    /// does), so a load still running on a busy machine can end; it gives up after
    /// [`STALL_LIMIT`] without that.
    pub(super) fn drain(&mut self) -> anyhow::Result<()> {
        let started = Instant::now();
        for steps in 0.. {
            while let Some((step, outs)) = self.pending.pop_front() {
                self.apply(step, &outs);
            }
            if !self.sched.has_pending_work()
                && self.held.is_empty()
                && self.finished_ids.is_empty()
            {
                return Ok(());
            }
            if steps >= 64 {
                anyhow::ensure!(
                    started.elapsed() < STALL_LIMIT,
                    "the connector still had work after {steps} idle steps in {:?}",
                    started.elapsed()
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            self.step(0)?;
        }
        unreachable!("the loop returns or fails")
    }

    pub(super) fn leaks(&self) -> usize {
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
