//! The worker side: binds each step's metadata, loads layer by layer, saves, reports failures.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use kvpool_core::telemetry;
use kvpool_core::{
    CacheEngine, ChunkHash, ChunkSpan, KvLayout, KvTransfer, LayerLoad, LayerwiseTransfer,
};
use tokio::runtime::Runtime;
use tracing::warn;

use crate::ConnectorError;
use crate::metadata::{ConnectorMetadata, MetadataError, ReqMeta};
use crate::request_trace::{RequestTrace, RequestTraces};

/// A load in flight: the load, its slots, its request and the tokens each tier served.
type SubmittedLoad = (Box<dyn LayerLoad>, Vec<i64>, String, Vec<(String, usize)>);

/// The worker side of the connector (one per GPU worker / TP rank).
pub struct ConnectorWorker {
    engine: Arc<CacheEngine>,
    runtime: Arc<Runtime>,
    block_size: usize,
    probe_hash: [u8; 16],
    registered: bool,
    meta: Option<ConnectorMetadata>,
    /// This step's loads in flight, each with the slots it writes (to report them if it
    /// fails) and its request.
    loads: Vec<SubmittedLoad>,
    traces: RequestTraces,
    /// GPU blocks whose load failed in this step, whichever request loaded them: no request
    /// saves a chunk that touches one (they hold neither loaded nor computed KV, and KV
    /// computed after them attended to them).
    failed_blocks: BTreeSet<u32>,
    saved_layers: usize,
    load_errors: BTreeSet<u32>,
    /// Saves recorded for [`ConnectorWorker::take_kv_events`]; `None` until enabled, and
    /// bounded: an engine that never drains it must not grow it for ever.
    kv_events: Option<VecDeque<KvEvent>>,
    stats: WorkerStats,
}

/// Most [`KvEvent`]s kept between two drains; older ones are dropped.
pub const MAX_PENDING_KV_EVENTS: usize = 4096;

/// Counters of a worker since it started (vLLM's connector stats read them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Steps bound.
    pub steps: u64,
    /// Tokens the scheduler asked to load.
    pub load_requested_tokens: u64,
    /// Tokens loaded into the engine's cache.
    pub loaded_tokens: u64,
    /// GPU blocks reported as failed loads.
    pub failed_load_blocks: u64,
    /// Tokens stored into the pool.
    pub stored_tokens: u64,
    /// Saves that failed (a miss later, nothing else).
    pub save_errors: u64,
    /// Chunks a save skipped because they touch a block that failed to load in the step.
    pub saves_cut_by_failed_loads: u64,
}

/// An event for the engine's KV-event stream (vLLM `get_kv_connector_kv_cache_events`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum KvEvent {
    /// Chunks the pool stored in this step, exactly those written.
    ChunksStored {
        /// The request, or `evict-N` for a lazy-offload eviction.
        req_id: String,
        /// Their chained chunk hashes, in order.
        chunk_hashes: Vec<[u8; 16]>,
    },
}

impl ConnectorWorker {
    /// A worker over `engine`; `block_size` is the engine's page size in tokens.
    pub fn new(engine: Arc<CacheEngine>, runtime: Arc<Runtime>, block_size: usize) -> Self {
        let probe_hash = crate::probe_hash(&engine);
        ConnectorWorker {
            engine,
            runtime,
            block_size,
            probe_hash,
            registered: false,
            meta: None,
            loads: Vec::new(),
            failed_blocks: BTreeSet::new(),
            saved_layers: 0,
            load_errors: BTreeSet::new(),
            kv_events: None,
            stats: WorkerStats::default(),
            traces: RequestTraces::default(),
        }
    }

    /// The pool this worker loads from and saves to.
    pub fn engine(&self) -> &Arc<CacheEngine> {
        &self.engine
    }

    /// Counters since the worker started.
    pub fn stats(&self) -> WorkerStats {
        self.stats
    }

    /// vLLM `register_kv_caches`: checks the engine's paged KV layout matches the pool's.
    pub fn register_kv_caches(&mut self, layout: &KvLayout) -> Result<(), ConnectorError> {
        let ours = self.engine.layout();
        if layout.fingerprint() != ours.fingerprint() || layout.block_size != self.block_size {
            return Err(ConnectorError::Layout(format!(
                "engine KV cache {layout:?} does not match the pool's {ours:?} with block size {}",
                self.block_size
            )));
        }
        self.registered = true;
        Ok(())
    }

    /// vLLM `bind_connector_metadata`: decodes (never panics) and checks key agreement.
    pub fn bind_connector_metadata(&mut self, bytes: &[u8]) -> Result<(), ConnectorError> {
        if !self.registered {
            return Err(ConnectorError::Usage(
                "register_kv_caches must come before bind_connector_metadata".into(),
            ));
        }
        let meta = ConnectorMetadata::decode(bytes)?;
        if meta.probe_hash != self.probe_hash {
            return Err(MetadataError::ProbeMismatch {
                scheduler: hex(&meta.probe_hash),
                worker: hex(&self.probe_hash),
            }
            .into());
        }
        self.meta = Some(meta);
        self.loads.clear();
        self.failed_blocks.clear();
        self.saved_layers = 0;
        self.stats.steps += 1;
        Ok(())
    }

    /// vLLM `clear_connector_metadata`.
    pub fn clear_connector_metadata(&mut self) {
        self.meta = None;
        self.loads.clear();
    }

    fn meta(&self) -> Result<&ConnectorMetadata, ConnectorError> {
        self.meta.as_ref().ok_or_else(|| {
            ConnectorError::Usage("no connector metadata bound for this step".into())
        })
    }

    /// The spans of `r`'s chunks covering tokens `from..until`, from the hashes the scheduler
    /// shipped (no token is hashed here).
    fn spans(
        &self,
        r: &ReqMeta,
        from: usize,
        until: usize,
    ) -> Result<Vec<ChunkSpan>, ConnectorError> {
        let hashes: Vec<ChunkHash> = r.chunk_hashes.iter().map(|h| ChunkHash(*h)).collect();
        let spans = self
            .engine
            .token_database()
            .spans_from_hashes(&hashes, from, until);
        let covered = spans.last().map_or(from, |s| s.end);
        let cs = self.engine.token_database().chunk_size();
        // A partial last chunk's hash covers exactly the request's tokens `0..n`.
        let partial_mismatch = !covered.is_multiple_of(cs) && covered != r.slot_mapping.len();
        if covered != until || partial_mismatch || spans.first().is_some_and(|s| s.start > from) {
            return Err(ConnectorError::Usage(format!(
                "request {}: {} chunk hashes do not cover tokens {from}..{until}",
                r.req_id,
                r.chunk_hashes.len()
            )));
        }
        Ok(spans)
    }

    /// Marks the blocks of tokens `from..until` of `r` as failed loads.
    fn fail_tokens(&mut self, r: &ReqMeta, from: usize, until: usize) {
        if let Some(t) = self.traces.of(&r.req_id) {
            t.failed_tokens += (until - from) as u64;
        }
        for i in from..until {
            self.fail_block((r.slot_mapping[i] as usize / self.block_size) as u32);
        }
    }

    /// vLLM `start_load_kv`: fetches and verifies every chunk to load this step and submits
    /// each request's load to `kv` ([`LayerwiseTransfer::submit_load`]: a host cache is
    /// written now, a GPU cache layer by layer on its copy stream). Tokens that will not
    /// arrive are recorded now, by GPU block, for
    /// [`ConnectorWorker::get_block_ids_with_load_errors`]; one request's failure never stops
    /// another's load.
    ///
    /// Lazy-offload evictions are saved first, from `kv`, before any load writes their blocks.
    pub fn start_load_kv(&mut self, kv: &mut dyn LayerwiseTransfer) -> Result<(), ConnectorError> {
        let meta = self.meta()?.clone();
        for &block in &meta.unloadable_blocks {
            self.fail_block(block);
        }
        if meta.evictions.iter().any(|r| r.save.is_some()) {
            match kv.fence_before_store() {
                Ok(()) => {
                    for r in &meta.evictions {
                        if let Some(save) = r.save {
                            let (from, until) = (save.save_from as usize, save.save_until as usize);
                            self.save_best_effort(r, from, until, kv);
                        }
                    }
                }
                Err(e) => {
                    self.stats.save_errors += 1;
                    warn!(error = %e, "waiting for the engine's writes failed; evictions not saved");
                }
            }
        }
        for r in &meta.requests {
            let Some(load) = r.load else { continue };
            let (from, until) = (load.gpu_cached_tokens as usize, load.load_until as usize);
            self.stats.load_requested_tokens += (until - from) as u64;
            let started = Instant::now();
            if let Some(t) = self.traces.of(&r.req_id) {
                t.load_requested_tokens += (until - from) as u64;
            }
            let plan = self.spans(r, from, until).and_then(|spans| {
                Ok(self.runtime.block_on(self.engine.begin_retrieve_spans(
                    &spans,
                    from,
                    until,
                    &r.slot_mapping[..until],
                ))?)
            });
            let plan = match plan {
                Ok(plan) => plan,
                Err(e) => {
                    warn!(req = %r.req_id, error = %e, "load failed; reporting its blocks");
                    self.fail_tokens(r, from, until);
                    continue;
                }
            };
            let loaded = plan.loaded_mask();
            if let Some(first) = (from..until).find(|&i| !loaded[i]) {
                warn!(req = %r.req_id, expected = until - from, loaded = plan.loaded_tokens(), "load incomplete; reporting failed blocks");
                self.fail_tokens(r, first, until);
            }
            let slots = plan.slot_mapping_of_loaded();
            let tier_tokens = plan.tier_tokens().to_vec();
            let submitted = kv.submit_load(plan);
            if let Some(t) = self.traces.of(&r.req_id) {
                t.load_time += started.elapsed();
            }
            match submitted {
                Ok(load) => self
                    .loads
                    .push((load, slots, r.req_id.clone(), tier_tokens)),
                Err(e) => {
                    warn!(req = %r.req_id, error = %e, "writing the load failed; reporting its blocks");
                    self.fail_slots(&slots);
                    if let Some(t) = self.traces.of(&r.req_id) {
                        t.failed_tokens += slots.len() as u64;
                    }
                }
            }
        }
        Ok(())
    }

    fn fail_block(&mut self, block: u32) {
        if self.load_errors.insert(block) {
            self.stats.failed_load_blocks += 1;
            metrics::counter!(telemetry::LOAD_ERROR_BLOCKS).increment(1);
        }
        self.failed_blocks.insert(block);
    }

    fn fail_slots(&mut self, slots: &[i64]) {
        for &s in slots {
            self.fail_block((s as usize / self.block_size) as u32);
        }
    }

    /// vLLM `wait_for_layer_load`: layer `layer` of every submitted load is in the paged cache
    /// before the engine reads it (a GPU load makes the compute stream wait). A load whose
    /// layer fails is reported (all its blocks) and dropped; the others go on.
    pub fn wait_for_layer_load(&mut self, layer: usize) -> Result<(), ConnectorError> {
        let mut failed = Vec::new();
        for (i, (load, _, _, _)) in self.loads.iter().enumerate() {
            if let Err(e) = load.wait_layer(layer) {
                warn!(layer, error = %e, "a loaded layer failed; reporting the load's blocks");
                failed.push(i);
            }
        }
        for i in failed.into_iter().rev() {
            let (_, slots, req, _) = self.loads.remove(i);
            self.fail_slots(&slots);
            if let Some(t) = self.traces.of(&req) {
                t.failed_tokens += slots.len() as u64;
            }
        }
        // After the last layer, release the fetched chunks so L1 can evict them again.
        if layer + 1 == self.engine.layout().num_layers {
            for (load, _, req, tier_tokens) in std::mem::take(&mut self.loads) {
                self.stats.loaded_tokens += load.loaded_tokens() as u64;
                if let Some(t) = self.traces.of(&req) {
                    t.loaded_tokens += load.loaded_tokens() as u64;
                    for (tier, tokens) in &tier_tokens {
                        t.add_tier_tokens(tier, *tokens as u64);
                    }
                }
                metrics::counter!(telemetry::CONNECTOR_LOADED_TOKENS)
                    .increment(load.loaded_tokens() as u64);
            }
        }
        Ok(())
    }

    /// Waits for every layer of every submitted load (for engines that load before the
    /// forward pass rather than layer by layer, such as vLLM on CPU).
    pub fn finish_loads(&mut self) -> Result<(), ConnectorError> {
        for layer in 0..self.engine.layout().num_layers {
            self.wait_for_layer_load(layer)?;
        }
        Ok(())
    }

    /// vLLM `save_kv_layer`: layer `layer` of this step is computed. Layers go in order; the
    /// copy out of the paged cache happens in [`ConnectorWorker::wait_for_save`].
    pub fn save_kv_layer(
        &mut self,
        layer: usize,
        _kv: &dyn KvTransfer,
    ) -> Result<(), ConnectorError> {
        if layer != self.saved_layers {
            return Err(ConnectorError::Usage(format!(
                "save_kv_layer expected layer {}, got {layer}",
                self.saved_layers
            )));
        }
        self.saved_layers += 1;
        Ok(())
    }

    /// vLLM `wait_for_save`: stores every request's new chunks, all layers, from `kv`; call it
    /// once the step's forward pass is queued. The gathers wait for the engine's writes first
    /// ([`LayerwiseTransfer::fence_before_store`]). A chunk touching a block whose load failed
    /// in this step (whichever request loaded it) is not saved, nor anything after it. A
    /// failing save is logged and counted; it never stops the others.
    pub fn wait_for_save(&mut self, kv: &dyn LayerwiseTransfer) -> Result<(), ConnectorError> {
        let meta = self.meta()?.clone();
        let wanted_layers = self.engine.layout().num_layers;
        if self.saved_layers != 0 && self.saved_layers != wanted_layers {
            return Err(ConnectorError::Usage(format!(
                "wait_for_save after {} of {wanted_layers} save_kv_layer calls",
                self.saved_layers
            )));
        }
        if !meta.requests.iter().any(|r| r.save.is_some()) {
            return Ok(());
        }
        if let Err(e) = kv.fence_before_store() {
            // Nothing is stored from a cache whose writes may be unfinished.
            self.stats.save_errors += 1;
            warn!(error = %e, "waiting for the engine's writes failed; this step saves nothing");
            return Ok(());
        }
        let chunk = self.engine.token_database().chunk_size();
        for r in &meta.requests {
            let Some(save) = r.save else { continue };
            let from = save.save_from as usize;
            let mut until = save.save_until as usize;
            // Only steps with a failed load pay for the scan.
            if !self.failed_blocks.is_empty()
                && let Some(bad) = (0..until).find(|&i| {
                    self.failed_blocks
                        .contains(&((r.slot_mapping[i] as usize / self.block_size) as u32))
                })
            {
                let cut = (bad / chunk * chunk).max(from).min(until);
                if cut < until {
                    self.stats.saves_cut_by_failed_loads += 1;
                }
                until = cut;
            }
            self.save_best_effort(r, from, until, kv);
        }
        Ok(())
    }

    fn save_best_effort(&mut self, r: &ReqMeta, from: usize, until: usize, kv: &dyn KvTransfer) {
        if let Err(e) = self.store_range(r, from, until, kv) {
            self.stats.save_errors += 1;
            if let Some(t) = self.traces.of(&r.req_id) {
                t.save_errors += 1;
            }
            warn!(req = %r.req_id, error = %e, "save failed (the chunks will be missing from the pool)");
        }
    }

    /// Stores the chunks of `r` covering tokens `from..until`, read from `kv`.
    fn store_range(
        &mut self,
        r: &ReqMeta,
        from: usize,
        until: usize,
        kv: &dyn KvTransfer,
    ) -> Result<(), ConnectorError> {
        if until <= from {
            return Ok(());
        }
        let spans = self.spans(r, from, until)?;
        let started = Instant::now();
        let report = self.runtime.block_on(async {
            let mut store = self
                .engine
                .begin_store_spans(spans, until, &r.slot_mapping[..until])
                .await?;
            for layer in 0..self.engine.layout().num_layers {
                store.save_layer(layer, kv)?;
            }
            store.finish().await
        })?;
        self.stats.stored_tokens += report.stored_tokens as u64;
        if let Some(t) = self.traces.of(&r.req_id) {
            t.stored_tokens += report.stored_tokens as u64;
            t.store_time += started.elapsed();
        }
        metrics::counter!(telemetry::CONNECTOR_STORED_TOKENS)
            .increment(report.stored_tokens as u64);
        if let Some(events) = self.kv_events.as_mut()
            && !report.stored_keys.is_empty()
        {
            if events.len() == MAX_PENDING_KV_EVENTS {
                events.pop_front();
            }
            events.push_back(KvEvent::ChunksStored {
                req_id: r.req_id.clone(),
                chunk_hashes: report.stored_keys.iter().map(|k| k.hash.0).collect(),
            });
        }
        Ok(())
    }

    /// vLLM `get_finished`: requests whose asynchronous saves and loads completed. Both are
    /// synchronous here (done when `wait_for_save` / `start_load_kv` return), and
    /// `request_finished` never delays a free, so there is never anything to report: a
    /// request id vLLM did not hand over as finished is never returned.
    ///
    /// Each of `finished_req_ids` gets its trace logged (`debug`, target `kvpool::request`)
    /// and forgotten.
    pub fn get_finished(&mut self, finished_req_ids: &[String]) -> (Vec<String>, Vec<String>) {
        for req in finished_req_ids {
            self.traces.finish(req);
        }
        (Vec::new(), Vec::new())
    }

    /// What this worker did for a request still live (see [`RequestTrace`]).
    pub fn request_trace(&self, req: &str) -> Option<&RequestTrace> {
        self.traces.get(req)
    }

    /// Requests being traced, and requests not traced because too many were live.
    pub fn traced_requests(&self) -> (usize, u64) {
        (self.traces.len(), self.traces.untraced())
    }

    /// vLLM `get_kv_connector_kv_cache_events`: what the pool stored since the last call.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.kv_events
            .as_mut()
            .map(|events| events.drain(..).collect())
            .unwrap_or_default()
    }

    /// Starts recording saves for [`ConnectorWorker::take_kv_events`] (off by default: the
    /// soak found that an engine that never drains them grew this list by one event per
    /// save, for ever).
    pub fn enable_kv_events(&mut self) {
        self.kv_events.get_or_insert_with(VecDeque::new);
    }

    /// vLLM `get_block_ids_with_load_errors`: GPU blocks whose load failed since the last call.
    pub fn get_block_ids_with_load_errors(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.load_errors).into_iter().collect()
    }
}

fn hex(b: &[u8; 16]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
