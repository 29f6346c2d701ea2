//! How the scheduler asks what the pool holds: the `PoolLookup` trait and `EngineLookup`, its
//! in-process form (the lookup socket's client is the cross-process one).

use std::sync::Arc;

use kvpool_core::{CacheEngine, ChunkHash};
use tokio::runtime::Runtime;

use crate::leases::{LeaseTable, LookupAnswer, lookup_and_lease};

/// How the scheduler learns what the pool holds: in-process, or across a process boundary.
///
/// Lookups take the chunk hashes the scheduler computed (it hashes each request's tokens once
/// and ships the hashes to the worker), not token ids, and the request's id: the pool leases
/// the chunks it holds in memory to that request until it loads them or ends.
pub trait PoolLookup: Send {
    /// What the pool holds of `chunk_hashes` (nothing on any failure). With
    /// `load_node_memory`, a hit the pool daemon completes is loaded and leased at once (see
    /// [`crate::leases::lookup_and_lease`]); the scheduler asks it only where a fully leased
    /// hit makes the load synchronous (not when every load is asynchronous or none is).
    fn lookup(
        &mut self,
        req_id: &str,
        chunk_hashes: &[ChunkHash],
        load_node_memory: bool,
    ) -> LookupAnswer;

    /// The lookup's own counters (breaker misses, ranks whose breaker is open).
    fn counters(&self) -> (u64, u32) {
        (0, 0)
    }
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
}
