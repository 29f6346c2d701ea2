//! kvpool-connector: the vLLM KVConnector V1 protocol in Rust (its engine simulators live in
//! kvpool-sim).
//!
//! The protocol has two roles in different processes. The scheduler decides, per step, what
//! to load from the pool and what to save; the worker moves the bytes. They talk only through
//! [`ConnectorMetadata`], which is serialised every step.
//!
//! | vLLM KVConnector V1 call | kvpool |
//! |---|---|
//! | `get_num_new_matched_tokens(request, num_computed_tokens)` | [`ConnectorScheduler::get_num_new_matched_tokens`] |
//! | `update_state_after_alloc(request, blocks, num_external_tokens)` | [`ConnectorScheduler::update_state_after_alloc`] |
//! | `build_connector_meta(scheduler_output)` | [`ConnectorScheduler::build_connector_meta`], then [`ConnectorMetadata::encode`] |
//! | `update_connector_output(connector_output)` | [`ConnectorScheduler::update_connector_output`] |
//! | `request_finished(request, block_ids)` | [`ConnectorScheduler::request_finished`] |
//! | `register_kv_caches(kv_caches)` | [`ConnectorWorker::register_kv_caches`] |
//! | `bind_connector_metadata(metadata)` | [`ConnectorWorker::bind_connector_metadata`] (bytes in) |
//! | `clear_connector_metadata()` | [`ConnectorWorker::clear_connector_metadata`] |
//! | `start_load_kv(forward_context)` | [`ConnectorWorker::start_load_kv`] |
//! | `wait_for_layer_load(layer_name)` | [`ConnectorWorker::wait_for_layer_load`] |
//! | `save_kv_layer(layer_name, kv_layer, attn_metadata)` | [`ConnectorWorker::save_kv_layer`] |
//! | `wait_for_save()` | [`ConnectorWorker::wait_for_save`] |
//! | `get_finished(finished_req_ids)` | [`ConnectorWorker::get_finished`] |
//! | `get_block_ids_with_load_errors()` | [`ConnectorWorker::get_block_ids_with_load_errors`] |
//! | `get_kv_connector_kv_cache_events()` | [`ConnectorWorker::take_kv_events`] |
//!
//! Behaviour:
//! - Loads cover only what the GPU lacks and never the final prompt token. Chunks are fetched
//!   and verified whole, but only the tokens beyond the GPU's prefix are written, so blocks the
//!   GPU already holds (possibly shared with other requests) are never overwritten. LMCache
//!   instead aligns the GPU count down to a chunk and re-writes those tokens with identical bytes.
//! - Saves skip what was saved before. They cover complete chunks unless `save_unfull_chunk`,
//!   and decode tokens only with `save_decode_tokens`. A request can opt out (`skip_save`).
//!   Offload is eager: each newly computed chunk is saved in the step that computes it. (Lazy
//!   offload, through `on_blocks_evicting`, has no vLLM hook and is not offered to users; the
//!   connector keeps it for engines with an eviction hook.)
//! - A chunk that fails to load (missing, corrupt, backend down) is reported by exact GPU block
//!   id. In that step no request saves a chunk touching a failed block (requests share blocks
//!   through vLLM's prefix cache), and the scheduler rewinds the save point of every request
//!   holding one, so the recomputed KV is saved later and nothing unverified is ever stored.
//!   One request's failure never hides another's result.
//! - Saves finish inside the step, so `request_finished` never delays a free and `get_finished`
//!   reports nothing. The request's state is dropped at `request_finished`; a request id that
//!   comes back with another prompt starts over.
//! - Block lists follow vLLM: the whole list for new and resumed requests, only the newly
//!   allocated blocks for running ones ([`BlockUpdate`]). A promised load the blocks cannot hold
//!   is reported as failed, never dropped.
//! - Each request's tokens are hashed once, in the scheduler, as they arrive; lookups and the
//!   metadata carry chunk hashes, and keys include the request's extra keys (LoRA adapter,
//!   cache salt, multimodal inputs).
//! - A preempted request (`request_preempted`) forgets its GPU blocks and save progress; when it
//!   resumes, its next lookup finds what earlier steps saved, and it loads instead of recomputing.
//! - Every step's metadata carries the scheduler's [`probe_hash`]; a worker deriving another
//!   one (different model, world size, layout, chunk size or hash) refuses it. Hash mismatches
//!   across processes otherwise show up only as silent zero hit rates.
//!
//! - The worker's KV events list exactly the chunks the pool stored (by chained hash).
//!
//! - The scheduler asks the pool through [`PoolLookup`]: in-process ([`EngineLookup`]) or
//!   across processes ([`SocketLookup`] to each worker rank's [`LookupServer`], the minimum over
//!   ranks wins), as the Python package does inside vLLM.
//!
//! Loads never outlive the step: `get_num_new_matched_tokens` always answers `is_async =
//! false`, and loaded KV is in place (or, on a GPU, the compute stream waits for it) once
//! `wait_for_layer_load` returns. The worker moves bytes through kvpool-core's
//! [`kvpool_core::LayerwiseTransfer`]: host caches (vLLM's CPU build) copy at submit; with the
//! `cuda` feature, [`cuda`] registers CUDA KV tensors with kvpool-cuda's `GpuTransferEngine`,
//! which loads layer by layer on its copy stream and fences stores after the compute stream.

#![warn(missing_docs)]

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod engine_kv;
mod engine_tensor;
pub mod extra_keys;
pub mod lookup_service;
pub mod metadata;
pub mod request_trace;
pub mod scheduler;
pub mod vllm;
pub mod worker;

use kvpool_core::CacheEngine;
use thiserror::Error;

pub use engine_kv::{EngineKvCaches, EngineKvTensor, KvDevice};
pub use lookup_service::{LookupServer, SocketLookup, WorkerInfo};
pub use metadata::{ConnectorMetadata, LoadSpec, MetadataError, ReqMeta, SaveSpec};
pub use request_trace::RequestTrace;
pub use scheduler::{
    BlockUpdate, ConnectorOutput, ConnectorScheduler, EngineLookup, EngineRequest, EvictingChunk,
    PoolLookup, RequestTracker, ScheduledRequest,
};
pub use worker::{ConnectorWorker, KvEvent, WorkerStats};

/// When computed KV is saved to the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OffloadMode {
    /// Every newly computed complete chunk is saved in the step that computes it.
    #[default]
    Eager,
    /// A chunk is saved only when the GPU is about to reuse one of its blocks
    /// ([`ConnectorScheduler::on_blocks_evicting`]): less traffic, and only for KV the GPU
    /// prefix cache is about to lose.
    Lazy,
}

/// Connector settings (the pool's own settings come from its `PoolConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectorConfig {
    /// The engine's page size in tokens.
    pub block_size: usize,
    /// Save the trailing partial chunk too.
    pub save_unfull_chunk: bool,
    /// Save tokens generated during decode, not only the prompt.
    pub save_decode_tokens: bool,
    /// Eager or lazy offload.
    pub offload: OffloadMode,
}

/// A connector call that could not be carried out.
#[derive(Debug, Error)]
pub enum ConnectorError {
    /// Bad metadata.
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    /// The engine failed (a transfer error, not a miss).
    #[error(transparent)]
    Engine(#[from] kvpool_core::EngineError),
    /// The engine's KV cache does not match the pool.
    #[error("{0}")]
    Layout(String),
    /// Calls in the wrong order.
    #[error("{0}")]
    Usage(String),
}

/// A digest of how this process derives keys: model, TP world size, layout fingerprint, and
/// the chunk hash of a fixed probe sequence. The TP rank is left out, so every rank agrees.
pub fn probe_hash(engine: &CacheEngine) -> [u8; 16] {
    probe_hash_of(engine.token_database())
}

/// [`probe_hash`] from a token database alone (for a scheduler process without a pool).
pub fn probe_hash_of(db: &kvpool_core::ChunkedTokenDatabase) -> [u8; 16] {
    let probe: Vec<u32> = (1..=db.chunk_size() as u32).collect();
    let spans = db
        .process_tokens(&probe, None)
        .expect("probe tokens are valid");
    let scope = db.scope();
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(scope.model.as_bytes());
    h.update(&scope.world_size.to_le_bytes());
    h.update(&scope.layout_fingerprint.to_le_bytes());
    h.update(&(db.chunk_size() as u64).to_le_bytes());
    if let Some(first) = spans.first() {
        h.update(&first.key.hash.0);
    }
    h.digest128().to_be_bytes()
}
