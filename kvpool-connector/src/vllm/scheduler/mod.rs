//! The scheduler side: lookups, request trackers, each step's metadata, and the step ledger
//! that decides when the workers' saves become visible (the chunk tail's keys: `chunk_tail`).

mod async_loads;
mod chunk_tail;
mod engine_io;
mod pool_lookup;
mod step_ledger;
mod step_plan;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kvpool_core::{CacheEngine, ChunkHash, ChunkHasher, HashAlgorithm};
use tokio::runtime::Runtime;
use tracing::debug;

use crate::ConnectorConfig;
use crate::vllm::leases::LeaseTable;
use crate::vllm::metadata::{ConnectorMetadata, LoadSpec, SchedulerCounters};
pub use engine_io::{BlockUpdate, ConnectorOutput, EngineRequest, ScheduledRequest};
pub use pool_lookup::{EngineLookup, LookupCounters, PoolLookup, chunks_present};
pub use step_ledger::STEP_REPORT_TIMEOUT;
use step_ledger::StepLedger;
use step_plan::StepPlanner;

/// Per-request state kept by the scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestTracker {
    /// Tokens known so far (prompt, then generated).
    pub token_ids: Vec<u32>,
    /// The request's extra keys (part of every chunk key).
    pub extra_keys: Vec<u8>,
    /// Chain hashes of the full chunks of `token_ids`, computed once as tokens arrive.
    pub hasher: ChunkHasher,
    /// Prompt length.
    pub prompt_len: usize,
    /// Engine blocks, in order.
    pub block_ids: Vec<u32>,
    /// Tokens whose chunks were handed to a save (chunk-aligned).
    pub saved_tokens: usize,
    /// Pending load, set by `get_num_new_matched_tokens`, consumed by `build_connector_meta`.
    pub load: Option<LoadSpec>,
    /// `load` was found by a lookup the engine has not yet allocated blocks for: vLLM looks a
    /// waiting request up, and when it cannot allocate its blocks, leaves it waiting without
    /// `update_state_after_alloc` and asks again in a later step. Such a load promised
    /// nothing and is dropped at the step's end.
    pub load_awaits_blocks: bool,
    /// The pending load's tail-block keys (see [`crate::vllm::metadata::ReqMeta::load_tail`]).
    pub load_tail: Vec<[u8; 16]>,
    /// The prompt's tail blocks (its whole blocks in the chunk its last token falls in, see
    /// `chunk_tail::prompt_tail_range`) were handed to a save.
    pub tail_saved: bool,
    /// An asynchronous load was issued and its end not yet reported.
    pub load_in_flight: bool,
    /// Steps whose metadata carried a save for this request.
    pub save_steps: Vec<u64>,
    /// Never save.
    pub skip_save: bool,
    /// The engine's sequence and ours diverged: no more decode tokens are saved.
    pub token_stream_broken: bool,
}

/// The scheduler side of the connector.
pub struct ConnectorScheduler {
    lookup: Box<dyn PoolLookup>,
    chunk_size: usize,
    hash_algorithm: HashAlgorithm,
    config: ConnectorConfig,
    probe_hash: [u8; 16],
    trackers: HashMap<String, RequestTracker>,
    max_tracked: usize,
    trackers_dropped: u64,
    broken_promises: u64,
    next_step: u64,
    ledger: StepLedger,
    held: Vec<String>,
    ended: Vec<String>,
    preempted: Vec<String>,
    /// The requests the engine scheduled in its last step, less those finished or preempted
    /// since: what a synchronous load would stall (see [`crate::LoadTiming::Auto`]).
    running: HashSet<String>,
    /// The request promised a synchronous load because nothing else ran, since the last
    /// step's metadata (one per step).
    idle_load: Option<String>,
    /// Set by [`ConnectorScheduler::reset`]: a random salt chained into every request's root,
    /// so nothing stored before the reset is ever found again.
    reset_salt: Option<[u8; 16]>,
}

/// Requests tracked at most (vLLM tells the connector of every finish, so this bounds state
/// only when an engine forgets to); past it, trackers without a pending load are dropped.
pub const DEFAULT_MAX_TRACKED_REQUESTS: usize = 65_536;

impl ConnectorScheduler {
    /// A scheduler over `engine` in this process (whose lookups lease into `leases`);
    /// `runtime` runs its lookups (the protocol is synchronous).
    pub fn new(
        engine: Arc<CacheEngine>,
        runtime: Arc<Runtime>,
        leases: Arc<LeaseTable>,
        config: ConnectorConfig,
    ) -> Self {
        let probe_hash = crate::probe_hash(&engine);
        let chunking = *engine.token_database().config();
        Self::with_lookup(
            Box::new(EngineLookup {
                engine,
                runtime,
                leases,
            }),
            chunking.chunk_size,
            chunking.hash_algorithm,
            probe_hash,
            config,
        )
    }

    /// A scheduler whose lookups go through `lookup` (e.g. an RPC to the worker process that
    /// owns the pool). `chunk_size`, `hash_algorithm` and `probe_hash` must be the pool's.
    pub fn with_lookup(
        lookup: Box<dyn PoolLookup>,
        chunk_size: usize,
        hash_algorithm: HashAlgorithm,
        probe_hash: [u8; 16],
        config: ConnectorConfig,
    ) -> Self {
        ConnectorScheduler {
            lookup,
            chunk_size,
            hash_algorithm,
            config,
            probe_hash,
            trackers: HashMap::new(),
            max_tracked: DEFAULT_MAX_TRACKED_REQUESTS,
            trackers_dropped: 0,
            broken_promises: 0,
            next_step: 1,
            ledger: StepLedger::new(config.num_ranks),
            held: Vec::new(),
            ended: Vec::new(),
            preempted: Vec::new(),
            running: HashSet::new(),
            idle_load: None,
            reset_salt: None,
        }
    }

    /// The root of a request's chain: its extra keys, and the reset salt if any.
    fn request_root(&self, extra_keys: &[u8]) -> ChunkHash {
        match &self.reset_salt {
            None => self.hash_algorithm.request_root(extra_keys),
            Some(salt) => {
                let mut salted = extra_keys.to_vec();
                salted.push(crate::extra_keys::TAG_RESET);
                salted.extend_from_slice(&(salt.len() as u32).to_le_bytes());
                salted.extend_from_slice(salt);
                self.hash_algorithm.request_root(&salted)
            }
        }
    }

    /// Caps the number of tracked requests (see [`DEFAULT_MAX_TRACKED_REQUESTS`]).
    pub fn set_max_tracked_requests(&mut self, max: usize) {
        self.max_tracked = max.max(1);
    }

    /// Trackers dropped because the cap was reached.
    pub fn trackers_dropped(&self) -> u64 {
        self.trackers_dropped
    }

    /// Loads promised by `get_num_new_matched_tokens` whose blocks never covered them; their
    /// blocks were reported as failed so the engine recomputes them.
    pub fn broken_promises(&self) -> u64 {
        self.broken_promises
    }

    /// Steps given up because not every worker reported them in time.
    pub fn steps_given_up(&self) -> u64 {
        self.ledger.given_up()
    }

    /// The scheduler's counters, as shipped to the workers.
    pub fn counters(&self) -> SchedulerCounters {
        let lookup = self.lookup.counters();
        SchedulerCounters {
            breaker_misses: lookup.breaker_misses,
            breakers_open: lookup.breakers_open,
            lookups_in_process: lookup.in_process,
            lookups_over_sockets: lookup.over_sockets,
            broken_promises: self.broken_promises,
            trackers_dropped: self.trackers_dropped,
        }
    }

    /// Chunk size of the pool.
    pub fn chunk_size(&self) -> usize {
        self.chunk_size
    }

    /// How this engine derives keys, as text: the pool's [`crate::probe_hash`] (model,
    /// weights, TP size, layout, chunk size, hash algorithm) in hex, then the block size (tail
    /// keys are per block). Two engines whose digests differ never share a key; equal digests
    /// share keys unless a request's own salt differs (a `reset_cache`, a cache salt).
    pub fn scope_digest(&self) -> String {
        let hex: String = self.probe_hash.iter().map(|b| format!("{b:02x}")).collect();
        format!("{hex}/b{}", self.config.block_size)
    }

    fn make_room(&mut self) {
        while self.trackers.len() >= self.max_tracked {
            let victim = self
                .trackers
                .iter()
                .find(|(_, t)| t.load.is_none() && !t.load_in_flight)
                .or_else(|| self.trackers.iter().next())
                .map(|(id, _)| id.clone());
            let Some(victim) = victim else { return };
            tracing::warn!(req = %victim, max = self.max_tracked, "too many tracked requests; dropping one (its KV will not be saved)");
            self.trackers.remove(&victim);
            self.ended.push(victim);
            self.trackers_dropped += 1;
        }
    }

    /// The tracker of a request.
    pub fn tracker(&self, req_id: &str) -> Option<&RequestTracker> {
        self.trackers.get(req_id)
    }

    /// The keys of a request's prompt tail blocks (the whole blocks of the chunk its last token
    /// falls in, that chunk's last block never), one per block in order; empty for an unknown
    /// request or a prompt with no such block.
    pub fn prompt_tail_hashes(&self, req_id: &str) -> Vec<ChunkHash> {
        self.trackers
            .get(req_id)
            .map(|t| {
                t.prompt_tail_hashes(
                    &self.hash_algorithm,
                    self.chunk_size,
                    self.config.block_size.max(1),
                )
            })
            .unwrap_or_default()
    }

    /// How many tokens of a request's sequence the scheduler knows (`None`: no tracker). The
    /// engine sends the tokens from here on with the next step.
    pub fn token_count(&self, req_id: &str) -> Option<usize> {
        self.trackers.get(req_id).map(|t| t.token_ids.len())
    }

    /// Whether `req_id` may load synchronously for want of anything to stall: no other request
    /// ran in the engine's last step (or has since finished or been preempted), no other
    /// request was promised such a load in this step, and the engine does not schedule
    /// asynchronously (a failed synchronous load would have the next step computed on it).
    fn may_load_while_idle(&self, req_id: &str) -> bool {
        !self.config.async_scheduling
            && self.idle_load.as_deref().is_none_or(|r| r == req_id)
            && self.running.iter().all(|r| r == req_id)
    }

    /// Requests with state.
    pub fn tracked_requests(&self) -> usize {
        self.trackers.len()
    }

    /// vLLM `get_num_new_matched_tokens`: tokens beyond the engine's `num_computed_tokens`
    /// that the pool can load, and whether the load is asynchronous. By default
    /// ([`crate::LoadTiming::Auto`]) it is synchronous when every rank holds every promised
    /// chunk in memory under the request's lease, or when no other request is running (a
    /// fetch before the forward pass then stalls nobody). The
    /// final prompt token is never loaded, as the engine must compute at least one.
    ///
    /// Creates the request's tracker, or replaces it when the id is reused for another prompt
    /// or other extra keys. May be called several times for one request (vLLM asks again when
    /// it could not allocate blocks); the last answer stands.
    pub fn get_num_new_matched_tokens(
        &mut self,
        req: &EngineRequest,
        num_computed_tokens: usize,
    ) -> (usize, bool) {
        let n = req.prompt_token_ids.len();
        let same_request = self.trackers.get(&req.req_id).is_some_and(|t| {
            t.prompt_len == n
                && t.token_ids[..n] == req.prompt_token_ids[..]
                && t.extra_keys == req.extra_keys
        });
        if !same_request {
            self.trackers.remove(&req.req_id);
            self.make_room();
            let mut hasher = ChunkHasher::new(
                self.hash_algorithm,
                self.chunk_size,
                self.request_root(&req.extra_keys),
            );
            hasher.extend(&req.prompt_token_ids);
            self.trackers.insert(
                req.req_id.clone(),
                RequestTracker {
                    token_ids: req.prompt_token_ids.clone(),
                    extra_keys: req.extra_keys.clone(),
                    hasher,
                    prompt_len: n,
                    block_ids: Vec::new(),
                    saved_tokens: 0,
                    load: None,
                    load_awaits_blocks: false,
                    load_tail: Vec::new(),
                    tail_saved: false,
                    load_in_flight: false,
                    save_steps: Vec::new(),
                    skip_save: req.skip_save,
                    token_stream_broken: false,
                },
            );
        }
        let (hit, leased, load_tail) = if n > 1 && self.config.loads {
            self.lookup_prompt(&req.req_id, n - 1)
        } else {
            (0, 0, Vec::new())
        };
        let may_load_while_idle = self.may_load_while_idle(&req.req_id);
        let tracker = self
            .trackers
            .get_mut(&req.req_id)
            .expect("tracker inserted above");
        if hit <= num_computed_tokens {
            tracker.load = None;
            tracker.load_tail.clear();
            return (0, false);
        }
        tracker.load_tail = load_tail;
        let asynchronous = match self.config.load_timing {
            crate::LoadTiming::Auto => {
                let idle = leased < hit && may_load_while_idle;
                if idle {
                    self.idle_load = Some(req.req_id.clone());
                }
                leased < hit && !idle
            }
            crate::LoadTiming::Leased => leased < hit,
            crate::LoadTiming::Always => true,
            crate::LoadTiming::Never => false,
        };
        tracker.load = Some(LoadSpec {
            gpu_cached_tokens: num_computed_tokens as u32,
            load_until: hit as u32,
            asynchronous,
        });
        tracker.load_awaits_blocks = true;
        debug!(req = %req.req_id, num_computed_tokens, hit, leased, asynchronous, "pool hit");
        (hit - num_computed_tokens, asynchronous)
    }

    /// vLLM `update_state_after_alloc`: the engine blocks the request holds, and how many
    /// external tokens the engine accepted (0 cancels a pending load).
    pub fn update_state_after_alloc(
        &mut self,
        req_id: &str,
        block_ids: &[u32],
        num_external_tokens: usize,
    ) {
        let (cs, bs) = (self.chunk_size, self.config.block_size.max(1));
        if let Some(t) = self.trackers.get_mut(req_id) {
            t.block_ids = block_ids.to_vec();
            t.load_awaits_blocks = false;
            match &mut t.load {
                _ if num_external_tokens == 0 => {
                    t.load = None;
                    t.load_tail.clear();
                }
                Some(load) => {
                    // The engine accepted this many: load exactly that (tail blocks past it
                    // are dropped).
                    let until = load.gpu_cached_tokens as usize + num_external_tokens;
                    let until = (load.load_until as usize).min(until);
                    let tail_start = load.load_until as usize - t.load_tail.len() * bs;
                    if until < load.load_until as usize {
                        t.load_tail.truncate(until.saturating_sub(tail_start) / bs);
                    }
                    debug_assert!(tail_start.is_multiple_of(cs));
                    load.load_until = until as u32;
                }
                None => {
                    // The engine counts on external tokens no lookup of this step offered
                    // (vLLM allocates in the step of its lookup, so it never does this).
                    tracing::error!(req = %req_id, num_external_tokens, "the engine accepted external tokens with no pending hit; nothing loads them");
                    self.broken_promises += 1;
                }
            }
        }
    }

    /// Whether every rank's pool holds each of `chunk_hashes`, each on its own (a hybrid
    /// model's recurrent states: one value per boundary, not a prefix of chunks), in one
    /// round trip to each rank ([`PoolLookup::presence`]). Nothing is leased; a rank that
    /// does not answer in time counts as holding none of them.
    pub fn chunks_present(&mut self, chunk_hashes: &[ChunkHash]) -> Vec<bool> {
        if chunk_hashes.is_empty() {
            return Vec::new();
        }
        self.lookup.presence(chunk_hashes)
    }

    /// vLLM `build_connector_meta`: this step's loads and saves, with the decisions taken on
    /// earlier steps (cuts, commits, held blocks, ended and preempted requests).
    ///
    /// Scheduled requests get their saves (and a synchronous load); an asynchronous load is
    /// shipped in the step after the engine allocated its blocks, whether or not the request
    /// is scheduled (vLLM does not schedule it until the load ends). A hit the engine found
    /// no blocks for (no `update_state_after_alloc` since its lookup: vLLM leaves the request
    /// waiting and looks it up again later) promised nothing and is dropped. A promised load
    /// whose blocks do not cover it (which vLLM never does, but an engine might) is not
    /// dropped silently: its blocks from the engine's cached prefix on are listed in
    /// [`ConnectorMetadata::unloadable_blocks`], so the engine recomputes them.
    pub fn build_connector_meta(&mut self, scheduled: &[ScheduledRequest]) -> ConnectorMetadata {
        let step = self.next_step;
        self.next_step += 1;
        self.ledger.expire(STEP_REPORT_TIMEOUT);
        let block_size = self.config.block_size;
        let planner = StepPlanner {
            step,
            chunk_size: self.chunk_size,
            block_size,
            save_decode_tokens: self.config.save_decode_tokens,
            hash_algorithm: &self.hash_algorithm,
        };
        let mut requests = Vec::new();
        let mut unloadable_blocks = Vec::new();
        let mut saves = Vec::new();
        let mut listed: HashSet<&str> = HashSet::new();
        for s in scheduled {
            let Some(t) = self.trackers.get_mut(&s.req_id) else {
                continue;
            };
            listed.insert(&s.req_id);
            t.take_scheduled(s);
            if let Some(planned) =
                planner.plan(s, t, &mut unloadable_blocks, &mut self.broken_promises)
            {
                saves.extend(planned.issued_save);
                requests.push(planned.meta);
            }
        }
        self.running.clear();
        self.running
            .extend(scheduled.iter().map(|s| s.req_id.clone()));
        self.idle_load = None;
        self.drop_hits_without_blocks(&listed);
        requests.extend(self.waiting_async_loads(&listed, &mut unloadable_blocks));
        self.ledger.issued(step, saves);
        let (discards, commit_steps) = self.ledger.take_decisions();
        ConnectorMetadata {
            probe_hash: self.probe_hash,
            step,
            block_size: block_size as u32,
            requests,
            unloadable_blocks,
            discards,
            commit_steps,
            commit_locally: self.config.num_ranks == 1 && !self.config.async_scheduling,
            held_requests: std::mem::take(&mut self.held),
            ended_requests: std::mem::take(&mut self.ended),
            preempted_requests: std::mem::take(&mut self.preempted),
            scheduler: self.counters(),
        }
    }

    /// vLLM `update_connector_output`: what the workers reported for a step. Failed loads
    /// rewind the save point of every request holding a failed block, and cut every
    /// uncommitted save reaching one; then the steps every rank ran are committed.
    pub fn update_connector_output(&mut self, output: &ConnectorOutput) {
        if !output.failed_block_ids.is_empty() {
            let failed: HashSet<u32> = output.failed_block_ids.iter().copied().collect();
            let chunk = self.chunk_size;
            let bs = self.config.block_size;
            for t in self.trackers.values_mut() {
                if let Some(first) = t.block_ids.iter().position(|b| failed.contains(b)) {
                    let token = first * bs;
                    t.saved_tokens = t.saved_tokens.min(token / chunk * chunk);
                    if token < t.prompt_len / bs * bs {
                        t.tail_saved = false;
                    }
                }
            }
            self.ledger.failed_blocks(&failed, bs, chunk);
        }
        for &(step, ranks) in &output.executed_steps {
            self.ledger.executed(step, ranks);
        }
        for &(step, ranks) in &output.copied_steps {
            self.ledger.copied(step, ranks);
        }
        for id in &output.finished_recving {
            if let Some(t) = self.trackers.get_mut(id) {
                t.load_in_flight = false;
            }
        }
    }

    /// Whether the workers still owe reports, or decisions wait to be shipped: the engine
    /// keeps stepping until they are through (vLLM `has_pending_push_work`), so the last
    /// saves of a batch become visible without waiting for the next request.
    pub fn has_pending_work(&self) -> bool {
        self.ledger.has_pending_work()
    }

    /// vLLM `request_finished`: the request's state is dropped. Returns whether the engine
    /// must hold its blocks until the workers report it in `finished_sending`: when a save
    /// issued for it may still be copying out of them on some rank. A request whose
    /// asynchronous load is still in flight is never held this way (the engine already holds
    /// its blocks until the load ends).
    pub fn request_finished(&mut self, req_id: &str, _block_ids: &[u32]) -> bool {
        self.running.remove(req_id);
        let Some(t) = self.trackers.remove(req_id) else {
            return false;
        };
        self.ended.push(req_id.to_string());
        let hold = !t.load_in_flight && self.ledger.may_be_copying(&t.save_steps);
        if hold {
            self.held.push(req_id.to_string());
        }
        hold
    }

    /// Tokens of the request's prompt that another engine's lookup of the same prompt can
    /// find once this request's saves so far are stored: the saved whole chunks, then the
    /// saved tail blocks, up to the last whole block before the prompt's last token (a lookup
    /// never covers that token; a prompt that ends on a chunk boundary is found through the
    /// tail blocks of its last chunk). 0 for a request without state. (A `kv_producer` names
    /// this in the hand-off it returns when the request finishes.)
    pub fn saved_prompt_tokens(&self, req_id: &str) -> usize {
        self.trackers.get(req_id).map_or(0, |t| {
            let (chunk, block) = (self.chunk_size.max(1), self.config.block_size.max(1));
            let limit = t.prompt_len.saturating_sub(1);
            let whole_chunks = limit / chunk * chunk;
            let chunks = t.saved_tokens.min(whole_chunks);
            // The tail blocks are keyed in the chunk the prompt's last token falls in: the one
            // a lookup limited to `limit` reaches.
            if t.tail_saved && chunks == whole_chunks {
                (limit / block * block).max(chunks)
            } else {
                chunks
            }
        })
    }

    /// vLLM preemption (`scheduler_output.preempted_req_ids`): the request's blocks are
    /// gone; forget loads and save progress (the pool keeps what was saved, and the next
    /// lookup finds it).
    pub fn request_preempted(&mut self, req_id: &str) {
        self.running.remove(req_id);
        if let Some(t) = self.trackers.get_mut(req_id) {
            if t.load.is_some() && !t.load_awaits_blocks {
                // Admitted again (with blocks and a load) after its preemption: that is the
                // state to keep.
                return;
            }
            t.block_ids.clear();
            t.load = None;
            t.load_tail.clear();
            t.saved_tokens = 0;
            t.tail_saved = false;
            self.preempted.push(req_id.to_string());
        }
    }

    /// vLLM `reset_cache` (called after a weight update, among others): forgets every
    /// request, drops every save not yet committed, and salts every later key with a fresh
    /// random value, so nothing stored before the reset (in any tier, by any process) is
    /// ever loaded by this engine again. Old chunks age out of the tiers by eviction.
    pub fn reset(&mut self) {
        // `running` stays: vLLM resets the connector with requests still running too.
        self.ended.extend(self.trackers.drain().map(|(id, _)| id));
        self.ledger.discard_all();
        // Unique, not secret: the clock, the process, and the previous salt.
        let mut seed = Vec::with_capacity(44);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        seed.extend_from_slice(&now.to_le_bytes());
        seed.extend_from_slice(&std::process::id().to_le_bytes());
        seed.extend_from_slice(&self.reset_salt.unwrap_or_default());
        self.reset_salt = Some(xxhash_rust::xxh3::xxh3_128(&seed).to_le_bytes());
    }
}
