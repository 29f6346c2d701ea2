//! How the scheduler asks what the pool holds: the `PoolLookup` trait and `EngineLookup`, its
//! in-process form (the lookup socket's client is the cross-process one).

use std::sync::Arc;

use kvpool_core::{CacheEngine, CacheKey, ChunkHash};
use tokio::runtime::Runtime;

use crate::vllm::leases::{LeaseTable, LookupAnswer, lookup_and_lease};

/// How the scheduler learns what the pool holds: in-process, or across a process boundary.
///
/// Lookups take the chunk hashes the scheduler computed (it hashes each request's tokens once
/// and ships the hashes to the worker), not token ids, and the request's id: the pool leases
/// the chunks it holds in memory to that request until it loads them or ends.
pub trait PoolLookup: Send {
    /// What the pool holds of `chunk_hashes` (nothing on any failure). With
    /// `load_node_memory`, a hit the pool daemon completes is loaded and leased at once (see
    /// [`crate::vllm::leases::lookup_and_lease`]); the scheduler asks it only where a fully leased
    /// hit makes the load synchronous (not when every load is asynchronous or none is).
    fn lookup(
        &mut self,
        req_id: &str,
        chunk_hashes: &[ChunkHash],
        load_node_memory: bool,
    ) -> LookupAnswer;

    /// Whether the pool holds each of `chunk_hashes`, each on its own (a hybrid model's
    /// recurrent states: one value per boundary, not a prefix of chunks); nothing is leased,
    /// and every hash is a miss on any failure. Across ranks, a hash is held when every rank
    /// holds it.
    fn presence(&mut self, chunk_hashes: &[ChunkHash]) -> Vec<bool>;

    /// The lookup's own counters (zero where it keeps none).
    fn counters(&self) -> LookupCounters {
        LookupCounters::default()
    }
}

/// Counters of a [`PoolLookup`] that asks worker ranks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LookupCounters {
    /// Lookups answered as misses because a rank's circuit breaker was open.
    pub breaker_misses: u64,
    /// Ranks whose circuit breaker is open now.
    pub breakers_open: u32,
    /// Lookups (and presence checks) asked of every rank in the scheduler's own process,
    /// without a socket, answered or not.
    pub in_process: u64,
    /// Lookups (and presence checks) sent to the ranks over their lookup sockets.
    pub over_sockets: u64,
}

/// Lookups against a cache engine in this process.
pub struct EngineLookup {
    /// The engine.
    pub engine: Arc<CacheEngine>,
    /// The runtime its async lookups run on.
    pub runtime: Arc<Runtime>,
    /// The engine's lookup leases (shared with its worker).
    pub leases: Arc<LeaseTable>,
}

/// Whether some tier of `engine`'s pool holds each of `chunk_hashes` in the engine's key
/// scope, each on its own ([`PoolLookup::presence`]).
pub async fn chunks_present(engine: &CacheEngine, chunk_hashes: &[ChunkHash]) -> Vec<bool> {
    let scope = engine.token_database().scope();
    let keys: Vec<CacheKey> = chunk_hashes
        .iter()
        .map(|h| CacheKey::new(scope.clone(), *h))
        .collect();
    let storage = engine.storage();
    let lookups = keys
        .iter()
        .map(|key| storage.lookup(std::slice::from_ref(key)));
    futures::future::join_all(lookups)
        .await
        .into_iter()
        .map(|found| found.len() == 1)
        .collect()
}

impl PoolLookup for EngineLookup {
    fn lookup(
        &mut self,
        req_id: &str,
        chunk_hashes: &[ChunkHash],
        load_node_memory: bool,
    ) -> LookupAnswer {
        self.runtime.block_on(lookup_and_lease(
            &self.engine,
            &self.leases,
            req_id,
            chunk_hashes,
            load_node_memory,
        ))
    }

    fn presence(&mut self, chunk_hashes: &[ChunkHash]) -> Vec<bool> {
        self.runtime
            .block_on(chunks_present(&self.engine, chunk_hashes))
    }
}
