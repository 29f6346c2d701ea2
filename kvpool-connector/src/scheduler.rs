//! The scheduler side: lookups, request trackers, and building each step's metadata.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kvpool_core::CacheEngine;
use tokio::runtime::Runtime;
use tracing::debug;

use crate::ConnectorConfig;
use crate::metadata::{ConnectorMetadata, LoadSpec, ReqMeta, SaveSpec};

/// How the scheduler learns what the pool holds: in-process, or across a process boundary.
pub trait PoolLookup: Send {
    /// How many leading tokens of `tokens` the pool can load (0 on any failure).
    fn lookup(&mut self, tokens: &[u32]) -> usize;
}

/// Lookups against a cache engine in this process.
pub struct EngineLookup {
    /// The engine.
    pub engine: Arc<CacheEngine>,
    /// The runtime its async lookups run on.
    pub runtime: Arc<Runtime>,
}

impl PoolLookup for EngineLookup {
    fn lookup(&mut self, tokens: &[u32]) -> usize {
        self.runtime
            .block_on(self.engine.lookup(tokens))
            .unwrap_or(0)
    }
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
}

/// One scheduled request of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledRequest {
    /// Request id.
    pub req_id: String,
    /// Tokens generated since the last step (joining the sequence).
    pub new_token_ids: Vec<u32>,
    /// The request's GPU blocks, in order, if they changed.
    pub block_ids: Option<Vec<u32>>,
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
    /// Requests whose saves finished.
    pub finished_sending: Vec<String>,
    /// Requests whose (asynchronous) loads finished.
    pub finished_recving: Vec<String>,
    /// GPU blocks whose load failed: the engine must recompute them.
    pub failed_block_ids: Vec<u32>,
}

/// Per-request state kept by the scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestTracker {
    /// Tokens known so far (prompt, then generated).
    pub token_ids: Vec<u32>,
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
    config: ConnectorConfig,
    probe_hash: [u8; 16],
    trackers: HashMap<String, RequestTracker>,
    pending_saves: HashSet<String>,
    pending_evictions: Vec<ReqMeta>,
    evictions_made: u64,
}

impl ConnectorScheduler {
    /// A scheduler over `engine` in this process; `runtime` runs its lookups (the protocol
    /// is synchronous).
    pub fn new(engine: Arc<CacheEngine>, runtime: Arc<Runtime>, config: ConnectorConfig) -> Self {
        let probe_hash = crate::probe_hash(&engine);
        let chunk_size = engine.token_database().chunk_size();
        Self::with_lookup(
            Box::new(EngineLookup { engine, runtime }),
            chunk_size,
            probe_hash,
            config,
        )
    }

    /// A scheduler whose lookups go through `lookup` (e.g. an RPC to the worker process that
    /// owns the pool). `chunk_size` and `probe_hash` must be the pool's.
    pub fn with_lookup(
        lookup: Box<dyn PoolLookup>,
        chunk_size: usize,
        probe_hash: [u8; 16],
        config: ConnectorConfig,
    ) -> Self {
        ConnectorScheduler {
            lookup,
            chunk_size,
            config,
            probe_hash,
            trackers: HashMap::new(),
            pending_saves: HashSet::new(),
            pending_evictions: Vec::new(),
            evictions_made: 0,
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
    pub fn get_num_new_matched_tokens(
        &mut self,
        req: &EngineRequest,
        num_computed_tokens: usize,
    ) -> (usize, bool) {
        let n = req.prompt_token_ids.len();
        let hit = if n > 1 {
            self.lookup.lookup(&req.prompt_token_ids[..n - 1])
        } else {
            0
        };
        let tracker = self
            .trackers
            .entry(req.req_id.clone())
            .or_insert_with(|| RequestTracker {
                token_ids: req.prompt_token_ids.clone(),
                prompt_len: n,
                block_ids: Vec::new(),
                saved_tokens: 0,
                load: None,
                skip_save: req.skip_save,
            });
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
            if num_external_tokens == 0 {
                t.load = None;
            }
        }
    }

    /// vLLM `build_connector_meta`: this step's loads and saves for the scheduled requests.
    pub fn build_connector_meta(&mut self, scheduled: &[ScheduledRequest]) -> ConnectorMetadata {
        let chunk = self.chunk_size;
        let block_size = self.config.block_size;
        let mut requests = Vec::new();
        for s in scheduled {
            let Some(t) = self.trackers.get_mut(&s.req_id) else {
                continue;
            };
            t.token_ids.extend_from_slice(&s.new_token_ids);
            if let Some(b) = &s.block_ids {
                t.block_ids = b.clone();
            }
            let load = t.load.take();
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
                tracing::warn!(req = %s.req_id, needed, blocks = t.block_ids.len(), "not enough GPU blocks for the connector's work; skipping");
                continue;
            }
            if let Some(sv) = save {
                // Only full chunks advance the save point; a partial tail is saved again later.
                t.saved_tokens = sv.save_until as usize / chunk * chunk;
                self.pending_saves.insert(s.req_id.clone());
            }
            let slot_mapping = (0..needed)
                .map(|i| {
                    (t.block_ids[i / block_size] as usize * block_size + i % block_size) as i64
                })
                .collect();
            requests.push(ReqMeta {
                req_id: s.req_id.clone(),
                token_ids: t.token_ids[..needed].to_vec(),
                slot_mapping,
                load,
                save,
            });
        }
        ConnectorMetadata {
            probe_hash: self.probe_hash,
            requests,
            evictions: std::mem::take(&mut self.pending_evictions),
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
            self.pending_evictions.push(ReqMeta {
                req_id: format!("evict-{}", self.evictions_made),
                token_ids: c.token_ids,
                slot_mapping,
                load: None,
                save: Some(SaveSpec {
                    save_from: (n - chunk) as u32,
                    save_until: n as u32,
                }),
            });
        }
    }

    /// vLLM `update_connector_output`: finished saves release their blocks; a failed load
    /// rewinds the request's save point to the first failed block, so the recomputed KV is
    /// saved in a later step.
    pub fn update_connector_output(&mut self, output: &ConnectorOutput) {
        for r in &output.finished_sending {
            self.pending_saves.remove(r);
        }
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

    /// vLLM `request_finished`: whether the engine must delay freeing the request's blocks
    /// (a save from them is still in flight), and no extra transfer parameters.
    pub fn request_finished(&mut self, req_id: &str, _block_ids: &[u32]) -> (bool, Option<String>) {
        let delay = self.pending_saves.contains(req_id);
        if !delay {
            self.trackers.remove(req_id);
        }
        (delay, None)
    }

    /// Frees the state of a request whose delayed blocks were released.
    pub fn release(&mut self, req_id: &str) {
        self.pending_saves.remove(req_id);
        self.trackers.remove(req_id);
    }

    /// vLLM preemption: the request's GPU blocks are gone; forget loads and save progress
    /// (the pool keeps what was saved, and the next lookup finds it).
    pub fn request_preempted(&mut self, req_id: &str) {
        if let Some(t) = self.trackers.get_mut(req_id) {
            t.block_ids.clear();
            t.load = None;
            t.saved_tokens = 0;
        }
    }
}
