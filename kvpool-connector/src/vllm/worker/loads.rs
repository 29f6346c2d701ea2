//! Loads: fetching a request's chunks (from its lookup lease, then the tiers) and turning what
//! arrived into a [`CopyJob`]. Synchronous loads fetch at bind; asynchronous ones fetch on
//! kvpool's runtime while the engine runs other requests, bounded in bytes and in number.

use std::collections::HashMap;
use std::sync::Arc;

use kvpool_core::telemetry;
use kvpool_core::{CacheEngine, ChunkSpan};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use super::node_copies::{LoadSources, fetch_load};
use crate::vllm::leases::LeasedChunk;

/// Limits on asynchronous loads in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadLimits {
    /// Most chunk bytes held by asynchronous loads at once; a load past it waits its turn
    /// (one load always runs, whatever its size).
    pub max_bytes: usize,
    /// Most asynchronous loads fetching at once.
    pub max_loads: usize,
}

impl Default for LoadLimits {
    fn default() -> Self {
        LoadLimits {
            max_bytes: 1 << 30,
            max_loads: 64,
        }
    }
}

/// A load to perform: what to fetch and which engine blocks receive it.
#[derive(Debug)]
pub(crate) struct PlannedLoad {
    pub(crate) req_id: String,
    /// The request's engine blocks from token 0.
    pub(crate) block_ids: Vec<u32>,
    /// Tokens the engine already holds (not written).
    pub(crate) gpu_cached_tokens: usize,
    /// End of the load.
    pub(crate) load_until: usize,
    /// The spans covering `gpu_cached_tokens..load_until`, whole: chunks, then tail blocks.
    pub(crate) spans: Vec<ChunkSpan>,
    /// Chunks in hand for the leading spans (the lookup lease's), taken by the fetch.
    pub(crate) leased: Vec<LeasedChunk>,
}

impl PlannedLoad {
    /// Bytes of the spans' values (`token_bytes` per token).
    pub(crate) fn bytes(&self, token_bytes: usize) -> usize {
        self.spans.iter().map(|s| s.len() * token_bytes).sum()
    }
}

/// Where an asynchronous load is.
pub(crate) enum AsyncState {
    /// Waiting for room under the limits.
    Queued(PlannedLoad),
    /// Reading the tiers.
    Fetching(PlannedLoad, JoinHandle<LoadSources>),
    /// Its copy job is with the engine.
    Copying,
}

/// The asynchronous loads of one worker, by request.
#[derive(Default)]
pub(crate) struct AsyncLoads {
    pub(crate) loads: HashMap<String, (AsyncState, usize)>,
    /// Order of arrival, for fairness when starting queued loads.
    pub(crate) order: Vec<String>,
    pub(crate) fetching: usize,
    pub(crate) bytes: usize,
}

impl AsyncLoads {
    /// Queues a load (`bytes`: what it will hold).
    pub(crate) fn push(&mut self, load: PlannedLoad, bytes: usize) {
        self.order.push(load.req_id.clone());
        self.loads
            .insert(load.req_id.clone(), (AsyncState::Queued(load), bytes));
    }

    /// Starts queued loads, in arrival order, while they fit the limits.
    pub(crate) fn start_queued(
        &mut self,
        limits: LoadLimits,
        engine: &Arc<CacheEngine>,
        runtime: &Runtime,
    ) {
        let order = self.order.clone();
        for id in order {
            let Some((state, bytes)) = self.loads.get(&id) else {
                continue;
            };
            if !matches!(state, AsyncState::Queued(_)) {
                continue;
            }
            let busy = self.fetching > 0;
            if busy && (self.fetching >= limits.max_loads || self.bytes + bytes > limits.max_bytes)
            {
                break;
            }
            let bytes = *bytes;
            let Some((AsyncState::Queued(mut load), _)) = self.loads.remove(&id) else {
                unreachable!("checked above")
            };
            let engine = engine.clone();
            let spans = load.spans.clone();
            let leased = std::mem::take(&mut load.leased);
            let handle = runtime.spawn(async move { fetch_load(&engine, &spans, leased).await });
            self.fetching += 1;
            self.bytes += bytes;
            self.loads
                .insert(id, (AsyncState::Fetching(load, handle), bytes));
        }
        self.record();
    }

    /// Loads whose fetch ended, with what arrived (a fetch that panicked brought nothing).
    pub(crate) fn take_fetched(&mut self, runtime: &Runtime) -> Vec<(PlannedLoad, LoadSources)> {
        let done: Vec<String> = self
            .loads
            .iter()
            .filter(|(_, (s, _))| matches!(s, AsyncState::Fetching(_, h) if h.is_finished()))
            .map(|(id, _)| id.clone())
            .collect();
        let mut out = Vec::new();
        for id in done {
            let Some((AsyncState::Fetching(load, handle), bytes)) = self.loads.remove(&id) else {
                continue;
            };
            self.fetching -= 1;
            let fetched = runtime.block_on(handle).unwrap_or_else(|e| {
                tracing::error!(req = %id, error = %e, "a load's fetch task failed");
                LoadSources::default()
            });
            self.loads.insert(id, (AsyncState::Copying, bytes));
            out.push((load, fetched));
        }
        self.record();
        out
    }

    /// The load of `req_id` ended (copied, failed or cancelled): frees its budget.
    pub(crate) fn finish(&mut self, req_id: &str) {
        if let Some((state, bytes)) = self.loads.remove(req_id) {
            match state {
                AsyncState::Queued(_) => {}
                AsyncState::Fetching(_, handle) => {
                    handle.abort();
                    self.fetching -= 1;
                    self.bytes -= bytes;
                }
                AsyncState::Copying => self.bytes -= bytes,
            }
        }
        self.order.retain(|id| id != req_id);
        self.record();
    }

    /// Whether `req_id`'s load has not been handed to the engine yet (it can be cancelled
    /// without touching the engine's blocks).
    pub(crate) fn cancellable(&self, req_id: &str) -> bool {
        matches!(
            self.loads.get(req_id),
            Some((AsyncState::Queued(_) | AsyncState::Fetching(..), _))
        )
    }

    pub(crate) fn len(&self) -> usize {
        self.loads.len()
    }

    fn record(&self) {
        metrics::gauge!(telemetry::ASYNC_LOADS_IN_FLIGHT).set(self.loads.len() as f64);
        metrics::gauge!(telemetry::ASYNC_LOAD_BYTES_IN_FLIGHT).set(self.bytes as f64);
    }
}
