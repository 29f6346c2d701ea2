//! vLLM's KVConnector V1 in Rust: the scheduler side ([`scheduler`]), the worker side
//! ([`worker`]), the per-step metadata between them ([`metadata`]), lookup leases
//! ([`leases`]), the lookup socket between processes ([`lookup_service`]), per-request traces
//! ([`request_trace`]), per-step timing ([`step_timing`]), recurrent states of hybrid models
//! ([`state_values`]) and fitting a pool to the engine ([`pool_fit`]); the Python side is
//! `kvpool.vllm` (kvpool-py).
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
//! | `has_pending_push_work()` | [`ConnectorScheduler::has_pending_work`] |
//! | `register_kv_caches(kv_caches)` | [`ConnectorWorker::register_kv_caches`] |
//! | `handle_preemptions(metadata)` | [`ConnectorWorker::jobs_in_flight_for`] (the engine side waits for them) |
//! | `bind_connector_metadata(metadata)` | [`ConnectorWorker::bind_connector_metadata`] (bytes in) |
//! | `clear_connector_metadata()` | [`ConnectorWorker::clear_connector_metadata`] |
//! | `start_load_kv(forward_context)` | [`ConnectorWorker::take_load_jobs`], run by the engine side, then [`ConnectorWorker::copy_done`] |
//! | `wait_for_save()` | [`ConnectorWorker::take_save_jobs`], run by the engine side, then [`ConnectorWorker::copy_done`] |
//! | `get_transfer_results(finished_req_ids)` | [`ConnectorWorker::transfer_results`] |
//! | `get_block_ids_with_load_errors()` | [`ConnectorWorker::get_block_ids_with_load_errors`] |
//! | `build_connector_worker_meta()` | [`ConnectorWorker::step_report`] |
//!
//! Behaviour:
//! - Loads cover only what the engine lacks and never the final prompt token. Chunks are
//!   fetched and verified whole, but only the blocks beyond the engine's prefix are written,
//!   so blocks the engine already holds (possibly shared with other requests) are never
//!   overwritten.
//! - A load is asynchronous unless every rank holds every promised chunk in memory under the
//!   request's lookup lease, or no other request is running (and the engine does not
//!   schedule asynchronously): the request
//!   waits (vLLM's `WAITING_FOR_REMOTE_KVS`) while the worker fetches on kvpool's runtime and
//!   other requests run; `get_finished` reports it in `finished_recving`. Leases keep promised
//!   chunks in memory from lookup to load, bounded in bytes and time ([`leases`]).
//! - The worker never touches the engine's memory: it hands out [`CopyJob`]s (engine block ids
//!   and kvpool host buffers) that the engine side runs: torch in the Python connector, the
//!   same code on CPU and CUDA tensors; [`host_blocks`](crate::host_blocks) in tests and the simulator.
//! - Saves skip what L1 holds. They cover complete chunks, and decode tokens only with
//!   `save_decode_tokens`. A request can opt out (`skip_save`). A save is copied out of the
//!   engine's blocks in the step that computes it and *staged*: it becomes visible only when
//!   the scheduler commits its step, after every rank reported running it with no failed
//!   load (on any rank) touching it ([`ConnectorMetadata::commit_steps`]). Failed loads cut
//!   every uncommitted save reaching a failed block, in that step and any later one already
//!   built (vLLM's asynchronous scheduling), and rewind the save point of every request
//!   holding one, so the recomputed KV is saved later and nothing computed on a failed load
//!   is ever stored.
//! - `request_finished` holds a request's blocks while a save may still be copying out of
//!   them on some rank; the workers report it in `finished_sending` once their copies ended.
//!   Lower-tier writes (write-behind) read kvpool's own memory and never hold a block.
//! - Block lists follow vLLM: the whole list for new and resumed requests, only the newly
//!   allocated blocks for running ones ([`BlockUpdate`]). A promised load the blocks cannot hold
//!   is reported as failed, never dropped. A hit the engine found no blocks for (a lookup with
//!   no `update_state_after_alloc` after it) promised nothing: it is dropped, and vLLM looks
//!   the request up again.
//! - Each request's tokens are hashed once, in the scheduler, as they arrive; lookups and the
//!   metadata carry chunk hashes, and keys include the request's extra keys (LoRA adapter,
//!   cache salt, multimodal inputs). The engine sends generated tokens from the scheduler's own
//!   count ([`ConnectorScheduler::token_count`]), so both sides agree on a sequence by
//!   construction.
//! - A preempted request (`request_preempted`) forgets its blocks and save progress; when it
//!   resumes, its next lookup finds what earlier steps saved, and it loads instead of
//!   recomputing.
//! - Every step's metadata carries the scheduler's [`probe_hash`]; a worker deriving another
//!   one (different model, world size, layout, chunk size or hash) refuses it.
//! - The scheduler asks the pool through [`PoolLookup`]: in-process ([`EngineLookup`]) or
//!   across processes ([`SocketLookup`] to each worker rank's [`LookupServer`], every rank at
//!   once, the minimum wins, the whole lookup bounded in time, a circuit breaker per rank), as
//!   the Python package does inside vLLM.

pub mod leases;
pub mod lookup_service;
pub mod metadata;
pub mod pool_fit;
pub mod request_trace;
pub mod scheduler;
pub mod state_values;
pub mod step_timing;
pub mod worker;

use kvpool_core::CacheEngine;
use thiserror::Error;

pub use leases::{LeaseTable, LeasedChunk, LookupAnswer};
pub use lookup_service::{LookupServer, SocketLookup, WorkerInfo};
pub use metadata::{
    ConnectorMetadata, LoadSpec, MetadataError, ReqMeta, SaveDiscard, SaveSpec, SchedulerCounters,
};
pub use pool_fit::{VllmEngineFacts, lookup_socket_path, pool_config_for_vllm};
pub use request_trace::RequestTrace;
pub use scheduler::{
    BlockUpdate, ConnectorOutput, ConnectorScheduler, EngineLookup, EngineRequest, LookupCounters,
    PoolLookup, RequestTracker, ScheduledRequest,
};
pub use worker::{
    ConnectorWorker, CopyDirection, CopyJob, HostPlanes, LoadLimits, StepReport, TransferResults,
    WorkerStats,
};

/// When a load is asynchronous (the request waits while other requests run) rather than done
/// before the step's forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadTiming {
    /// Synchronous when every rank holds every promised chunk in memory under the request's
    /// lease (a copy, no I/O), or when no other request ran in the engine's last step (the
    /// fetch before the forward pass stalls nobody, and the request does not wait a step for
    /// its load to be reported; one such load per step, so a burst arriving at an idle engine
    /// does not wait for all its fetches in one step); asynchronous otherwise, so a running
    /// request's next token is not held up by another's fetch. Never synchronous for an
    /// engine that schedules asynchronously ([`ConnectorConfig::async_scheduling`]) unless
    /// leased.
    #[default]
    Auto,
    /// Synchronous only when every rank holds every promised chunk in memory under the
    /// request's lease: [`LoadTiming::Auto`] without its idle rule, for an engine whose idle
    /// step is not idle (vLLM's data-parallel ranks step in lockstep, so one rank's fetch
    /// would stall the others' decodes).
    Leased,
    /// Always asynchronous. Needed when the engine schedules a step before it knows the last
    /// one's outcome (vLLM's `async_scheduling`): a synchronous load that fails would already
    /// have the next step computed on top of it.
    Always,
    /// Always synchronous: every load, from any tier, before the forward pass (the behaviour
    /// before asynchronous loads; kept for comparisons, refused with asynchronous scheduling).
    Never,
}

/// Connector settings (the pool's own settings come from its `PoolConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectorConfig {
    /// The engine's page size in tokens.
    pub block_size: usize,
    /// Save tokens generated during decode, not only the prompt.
    pub save_decode_tokens: bool,
    /// When loads are asynchronous.
    pub load_timing: LoadTiming,
    /// The engine schedules step N+1 before it knows step N's outcome (vLLM's
    /// `async_scheduling`): a step's saves then wait for the scheduler's commit even with one
    /// rank (set [`LoadTiming::Always`] too).
    pub async_scheduling: bool,
    /// Worker ranks (tensor-parallel size): a step is committed once all of them reported it.
    pub num_ranks: u32,
    /// Whether the engine loads from the pool: false for a prefill instance that only hands
    /// KV on (vLLM's `kv_producer` role), which then never looks a prompt up.
    pub loads: bool,
}

impl ConnectorConfig {
    /// Settings for an engine with `block_size`-token pages and one worker rank.
    pub fn new(block_size: usize) -> Self {
        ConnectorConfig {
            block_size,
            save_decode_tokens: false,
            load_timing: LoadTiming::Auto,
            async_scheduling: false,
            num_ranks: 1,
            loads: true,
        }
    }
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
