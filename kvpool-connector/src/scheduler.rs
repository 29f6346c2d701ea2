//! The scheduler side: lookups, request trackers, and building each step's metadata.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kvpool_core::{CacheEngine, ChunkHash, ChunkHasher, HashAlgorithm};
use tokio::runtime::Runtime;
use tracing::debug;

use crate::ConnectorConfig;
use crate::metadata::{ConnectorMetadata, LoadSpec, ReqMeta, SaveSpec};

/// How the scheduler learns what the pool holds: in-process, or across a process boundary.
///
/// Lookups take the chunk hashes the scheduler computed (it hashes each request's tokens once
/// and ships the hashes to the worker), not token ids.
pub trait PoolLookup: Send {
    /// How many leading chunks of `chunk_hashes` the pool can load (0 on any failure).
    fn lookup(&mut self, chunk_hashes: &[ChunkHash]) -> usize;
}

/// Lookups against a cache engine in this process.
pub struct EngineLookup {
    /// The engine.
    pub engine: Arc<CacheEngine>,
    /// The runtime its async lookups run on.
    pub runtime: Arc<Runtime>,
}

impl PoolLookup for EngineLookup {
    fn lookup(&mut self, chunk_hashes: &[ChunkHash]) -> usize {
        lookup_chunks(&self.engine, &self.runtime, chunk_hashes)
    }
}

/// How many leading chunks of `chunk_hashes` `engine`'s pool holds (any tier).
pub fn lookup_chunks(engine: &CacheEngine, runtime: &Runtime, chunk_hashes: &[ChunkHash]) -> usize {
    runtime.block_on(engine.lookup_chunk_hashes(chunk_hashes))
}

/// A request as the engine's scheduler sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineRequest {
    /// Request id.
    pub req_id: String,
    /// Prompt token ids.
    pub prompt_token_ids: Vec<u32>,
    /// Do not save this request's KV (e.g. a private prompt).
    pub skip_save: bool,
    /// What the request's KV depends on besides its token ids: LoRA adapter, multimodal input
    /// hashes, cache salt (see [`crate::extra_keys`]). Empty for a plain text request.
    pub extra_keys: Vec<u8>,
}

/// How a step changes a request's GPU block list.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum BlockUpdate {
    /// No new blocks.
    #[default]
    Unchanged,
    /// Blocks allocated this step, appended (vLLM `scheduled_cached_reqs.new_block_ids`).
    Append(Vec<u32>),
    /// The whole list (a new request, or one resumed after preemption).
    Replace(Vec<u32>),
}

/// One scheduled request of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledRequest {
    /// Request id.
    pub req_id: String,
    /// Tokens generated since the last step (joining the sequence).
    pub new_token_ids: Vec<u32>,
    /// How the request's GPU blocks changed.
    pub blocks: BlockUpdate,
    /// Tokens whose KV will be on the GPU when this step ends.
    pub num_computed_tokens_after_step: usize,
}

/// A chunk of a cached prefix whose GPU block the engine is about to reuse (lazy offload).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvictingChunk {
    /// The prefix's tokens up to the end of the chunk (a multiple of the chunk size).
    pub token_ids: Vec<u32>,
    /// The GPU blocks of those tokens. The blocks of the last chunk must still hold its KV;
    /// earlier ones are only used for their position and are never read.
    pub block_ids: Vec<u32>,
}

/// What the worker reported back for a step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnectorOutput {
    /// Requests whose (asynchronous) saves finished. Saves are synchronous in kvpool, so the
    /// worker reports none; kept for engines that pass vLLM's output through.
    pub finished_sending: Vec<String>,
    /// Requests whose (asynchronous) loads finished (none: loads are synchronous).
    pub finished_recving: Vec<String>,
    /// GPU blocks whose load failed: the engine must recompute them.
    pub failed_block_ids: Vec<u32>,
}

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
    /// GPU blocks, in order.
    pub block_ids: Vec<u32>,
    /// Tokens whose chunks were handed to a save (chunk-aligned).
    pub saved_tokens: usize,
    /// Pending load, set by `get_num_new_matched_tokens`, consumed by `build_connector_meta`.
    pub load: Option<LoadSpec>,
    /// Never save.
    pub skip_save: bool,
}

/// The scheduler side of the connector.
pub struct ConnectorScheduler {
    lookup: Box<dyn PoolLookup>,
    chunk_size: usize,
    hash_algorithm: HashAlgorithm,
    config: ConnectorConfig,
    probe_hash: [u8; 16],
    trackers: HashMap<String, RequestTracker>,
    pending_evictions: Vec<ReqMeta>,
    evictions_made: u64,
    max_tracked: usize,
    trackers_dropped: u64,
    broken_promises: u64,
    /// Set by [`ConnectorScheduler::reset`]: a random salt chained into every request's root,
    /// so nothing stored before the reset is ever found again.
    reset_salt: Option<[u8; 16]>,
}

/// Requests tracked at most (vLLM tells the connector of every finish, so this bounds state
/// only when an engine forgets to); past it, trackers without a pending load are dropped.
pub const DEFAULT_MAX_TRACKED_REQUESTS: usize = 65_536;

impl ConnectorScheduler {
    /// A scheduler over `engine` in this process; `runtime` runs its lookups (the protocol
    /// is synchronous).
    pub fn new(engine: Arc<CacheEngine>, runtime: Arc<Runtime>, config: ConnectorConfig) -> Self {
        let probe_hash = crate::probe_hash(&engine);
        let chunking = *engine.token_database().config();
        Self::with_lookup(
            Box::new(EngineLookup { engine, runtime }),
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
            pending_evictions: Vec::new(),
            evictions_made: 0,
            max_tracked: DEFAULT_MAX_TRACKED_REQUESTS,
            trackers_dropped: 0,
            broken_promises: 0,
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

    /// Chunk size of the pool.
    pub fn chunk_size(&self) -> usize {
        self.chunk_size
    }

    fn make_room(&mut self) {
        while self.trackers.len() >= self.max_tracked {
            let victim = self
                .trackers
                .iter()
                .find(|(_, t)| t.load.is_none())
                .or_else(|| self.trackers.iter().next())
                .map(|(id, _)| id.clone());
            let Some(victim) = victim else { return };
            tracing::warn!(req = %victim, max = self.max_tracked, "too many tracked requests; dropping one (its KV will not be saved)");
            self.trackers.remove(&victim);
            self.trackers_dropped += 1;
        }
    }

    /// The tracker of a request.
    pub fn tracker(&self, req_id: &str) -> Option<&RequestTracker> {
        self.trackers.get(req_id)
    }

    /// Requests with state.
    pub fn tracked_requests(&self) -> usize {
        self.trackers.len()
    }

    /// vLLM `get_num_new_matched_tokens`: tokens beyond the GPU's `num_computed_tokens` that
    /// the pool can load, and whether the load is asynchronous (never, here). The final prompt
    /// token is never loaded, as the engine must compute at least one.
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
                    skip_save: req.skip_save,
                },
            );
        }
        let hit = if n > 1 {
            let t = &self.trackers[&req.req_id];
            let hashes =
                chunk_hashes_until(t, n - 1, self.chunk_size, self.config.save_unfull_chunk);
            let chunks = self.lookup.lookup(&hashes);
            (chunks * self.chunk_size).min(n - 1)
        } else {
            0
        };
        let tracker = self
            .trackers
            .get_mut(&req.req_id)
            .expect("tracker inserted above");
        if hit <= num_computed_tokens {
            tracker.load = None;
            return (0, false);
        }
        tracker.load = Some(LoadSpec {
            gpu_cached_tokens: num_computed_tokens as u32,
            load_until: hit as u32,
        });
        debug!(req = %req.req_id, num_computed_tokens, hit, "pool hit");
        (hit - num_computed_tokens, false)
    }

    /// vLLM `update_state_after_alloc`: the GPU blocks the engine gave the request, and how
    /// many external tokens it accepted (0 cancels the load).
    pub fn update_state_after_alloc(
        &mut self,
        req_id: &str,
        block_ids: &[u32],
        num_external_tokens: usize,
    ) {
        if let Some(t) = self.trackers.get_mut(req_id) {
            t.block_ids = block_ids.to_vec();
            match &mut t.load {
                _ if num_external_tokens == 0 => t.load = None,
                Some(load) => {
                    // The engine accepted this many: load exactly that.
                    let until = load.gpu_cached_tokens as usize + num_external_tokens;
                    load.load_until = (load.load_until as usize).min(until) as u32;
                }
                None => {}
            }
        }
    }

    /// vLLM `build_connector_meta`: this step's loads and saves for the scheduled requests.
    ///
    /// A promised load whose blocks do not cover it (which vLLM never does, but an engine
    /// might) is not dropped silently: the request's blocks from the GPU-cached prefix on are
    /// listed in [`ConnectorMetadata::unloadable_blocks`], which the worker reports as load
    /// errors, so the engine recomputes them.
    pub fn build_connector_meta(&mut self, scheduled: &[ScheduledRequest]) -> ConnectorMetadata {
        let chunk = self.chunk_size;
        let block_size = self.config.block_size;
        let mut requests = Vec::new();
        let mut unloadable_blocks = Vec::new();
        for s in scheduled {
            let Some(t) = self.trackers.get_mut(&s.req_id) else {
                continue;
            };
            t.token_ids.extend_from_slice(&s.new_token_ids);
            t.hasher.extend(&s.new_token_ids);
            match &s.blocks {
                BlockUpdate::Unchanged => {}
                BlockUpdate::Append(b) => t.block_ids.extend_from_slice(b),
                BlockUpdate::Replace(b) => t.block_ids = b.clone(),
            }
            let mut load = t.load.take();
            if let Some(l) = load
                && t.block_ids.len() * block_size < l.load_until as usize
            {
                tracing::error!(req = %s.req_id, load_until = l.load_until, blocks = t.block_ids.len(), "the engine's blocks do not cover a promised load; reporting them as failed");
                let first = l.gpu_cached_tokens as usize / block_size;
                unloadable_blocks.extend(t.block_ids.iter().skip(first).copied());
                self.broken_promises += 1;
                t.saved_tokens = t
                    .saved_tokens
                    .min(l.gpu_cached_tokens as usize / chunk * chunk);
                load = None;
            }
            let computed = s.num_computed_tokens_after_step.min(t.token_ids.len());
            let savable = if self.config.save_decode_tokens {
                computed
            } else {
                computed.min(t.prompt_len)
            };
            let save_until = if self.config.save_unfull_chunk {
                savable
            } else {
                savable / chunk * chunk
            };
            let eager = self.config.offload == crate::OffloadMode::Eager;
            let save = (eager && !t.skip_save && save_until > t.saved_tokens).then_some(SaveSpec {
                save_from: t.saved_tokens as u32,
                save_until: save_until as u32,
            });
            let needed = load
                .map_or(0, |l| l.load_until as usize)
                .max(save.map_or(0, |s| s.save_until as usize));
            if needed == 0 {
                continue;
            }
            if t.block_ids.len() * block_size < needed {
                // Only a save can get here (loads were checked above): skipping it is a miss.
                tracing::warn!(req = %s.req_id, needed, blocks = t.block_ids.len(), "not enough GPU blocks for the connector's save; skipping it");
                continue;
            }
            if let Some(sv) = save {
                // Only full chunks advance the save point; a partial tail is saved again later.
                t.saved_tokens = sv.save_until as usize / chunk * chunk;
            }
            let slot_mapping = (0..needed)
                .map(|i| {
                    (t.block_ids[i / block_size] as usize * block_size + i % block_size) as i64
                })
                .collect();
            requests.push(ReqMeta {
                req_id: s.req_id.clone(),
                chunk_hashes: chunk_hashes_until(t, needed, chunk, self.config.save_unfull_chunk)
                    .iter()
                    .map(|h| h.0)
                    .collect(),
                slot_mapping,
                load,
                save,
            });
        }
        ConnectorMetadata {
            probe_hash: self.probe_hash,
            requests,
            evictions: std::mem::take(&mut self.pending_evictions),
            unloadable_blocks,
        }
    }

    /// Lazy offload: the engine is about to reuse GPU blocks of these cached chunks. Each is
    /// saved by the worker at the start of the next step (see [`ConnectorMetadata::evictions`]).
    /// Ignored in eager mode, where the chunks were saved when computed.
    pub fn on_blocks_evicting(&mut self, chunks: Vec<EvictingChunk>) {
        if self.config.offload != crate::OffloadMode::Lazy {
            return;
        }
        let chunk = self.chunk_size;
        let block_size = self.config.block_size;
        for c in chunks {
            let n = c.token_ids.len();
            if n < chunk || !n.is_multiple_of(chunk) || c.block_ids.len() * block_size < n {
                tracing::warn!(
                    tokens = n,
                    blocks = c.block_ids.len(),
                    "ignoring a malformed evicting chunk"
                );
                continue;
            }
            self.evictions_made += 1;
            let slot_mapping = (0..n)
                .map(|i| {
                    (c.block_ids[i / block_size] as usize * block_size + i % block_size) as i64
                })
                .collect();
            let mut hasher =
                ChunkHasher::new(self.hash_algorithm, chunk, self.hash_algorithm.root());
            hasher.extend(&c.token_ids);
            self.pending_evictions.push(ReqMeta {
                req_id: format!("evict-{}", self.evictions_made),
                chunk_hashes: hasher.hashes().iter().map(|h| h.0).collect(),
                slot_mapping,
                load: None,
                save: Some(SaveSpec {
                    save_from: (n - chunk) as u32,
                    save_until: n as u32,
                }),
            });
        }
    }

    /// vLLM `update_connector_output`: a failed load rewinds the save point of every request
    /// holding a failed block to that block, so the recomputed KV is saved in a later step.
    pub fn update_connector_output(&mut self, output: &ConnectorOutput) {
        if output.failed_block_ids.is_empty() {
            return;
        }
        let failed: HashSet<u32> = output.failed_block_ids.iter().copied().collect();
        let chunk = self.chunk_size;
        for t in self.trackers.values_mut() {
            if let Some(first) = t.block_ids.iter().position(|b| failed.contains(b)) {
                let token = first * self.config.block_size;
                t.saved_tokens = t.saved_tokens.min(token / chunk * chunk);
            }
        }
    }

    /// vLLM `request_finished`: the request's state is dropped. Returns whether the engine
    /// must delay freeing its blocks (never: every save completes inside the step's
    /// `wait_for_save`, and lower tiers are written from kvpool's own memory) and no transfer
    /// parameters.
    pub fn request_finished(&mut self, req_id: &str, _block_ids: &[u32]) -> (bool, Option<String>) {
        self.trackers.remove(req_id);
        (false, None)
    }

    /// vLLM preemption (`scheduler_output.preempted_req_ids`): the request's GPU blocks are
    /// gone; forget loads and save progress (the pool keeps what was saved, and the next
    /// lookup finds it).
    pub fn request_preempted(&mut self, req_id: &str) {
        if let Some(t) = self.trackers.get_mut(req_id) {
            t.block_ids.clear();
            t.load = None;
            t.saved_tokens = 0;
        }
    }

    /// vLLM `reset_cache` (called after a weight update, among others): forgets every
    /// request, and salts every later key with a fresh random value, so nothing stored before
    /// the reset (in any tier, by any process) is ever loaded by this engine again. Old chunks
    /// age out of the tiers by eviction.
    pub fn reset(&mut self) {
        self.trackers.clear();
        self.pending_evictions.clear();
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

/// The hashes of the chunks covering a tracker's tokens `0..until`: the full chunks from its
/// hasher, and, when `until` ends inside a chunk and partial chunks are kept, that chunk's
/// hash over its first tokens (the only tokens hashed again).
fn chunk_hashes_until(
    t: &RequestTracker,
    until: usize,
    chunk_size: usize,
    save_unfull_chunk: bool,
) -> Vec<ChunkHash> {
    let full = (until / chunk_size).min(t.hasher.hashes().len());
    let mut hashes = t.hasher.hashes()[..full].to_vec();
    if save_unfull_chunk && until > full * chunk_size {
        let prev = hashes.last().copied().unwrap_or_else(|| t.hasher.root());
        hashes.push(
            t.hasher
                .algorithm()
                .chain_tokens(&prev, &t.token_ids[full * chunk_size..until]),
        );
    }
    hashes
}
