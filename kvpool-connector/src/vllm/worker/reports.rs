//! What a worker reports: its counters, the end of transfers to the engine side, and each
//! step's report to the scheduler.

#[cfg(doc)]
use super::ConnectorWorker;

/// Counters of a worker since it started (vLLM's connector stats read them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Steps bound.
    pub steps: u64,
    /// Tokens the scheduler asked to load.
    pub load_requested_tokens: u64,
    /// Tokens loaded into the engine's cache.
    pub loaded_tokens: u64,
    /// Loads done in the background (the request waited in `WAITING_FOR_REMOTE_KVS`).
    pub async_loads: u64,
    /// Loads done before the step's forward pass.
    pub sync_loads: u64,
    /// Engine blocks reported as failed loads.
    pub failed_load_blocks: u64,
    /// Tokens loaded with one copy from the node's pool daemon's shared memory into the
    /// engine's blocks, and checked there (part of `loaded_tokens`).
    pub node_memory_tokens: u64,
    /// Of `node_memory_tokens`, those checked in a copy the engine side staged for the worker
    /// (the route of an engine whose blocks the worker cannot read, such as a GPU's), not in
    /// the blocks.
    pub node_memory_staged_tokens: u64,
    /// Tokens saved with one copy from the engine's blocks into the node's pool daemon's
    /// shared memory, sealed with a checksum hashed from the blocks (part of `saved_tokens`).
    pub node_memory_saved_tokens: u64,
    /// Tokens copied out of the engine for saving (visible once their step is committed).
    pub saved_tokens: u64,
    /// Tokens stored into the pool (committed).
    pub stored_tokens: u64,
    /// Saves that failed (a miss later, nothing else).
    pub save_errors: u64,
    /// Saved chunks dropped before commit: computed on a failed load on some rank, or never
    /// committed.
    pub saves_discarded: u64,
    /// Buffers of this process taken from the heap because L1's pool had no room: for staged
    /// loads from and saves into node memory, and for chunks copied into this process to be
    /// checked there. Correct; but where the engine side stages its copies on a device (a GPU
    /// worker), a copy into or out of heap memory (not page-locked) is synchronous.
    pub heap_buffers: u64,
}

/// What the engine side learns at the end of a step ([`ConnectorWorker::transfer_results`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TransferResults {
    /// Finished requests whose held blocks no copy reads any more.
    pub finished_sending: Vec<String>,
    /// Requests whose asynchronous load ended (loaded, failed or cancelled); failed blocks
    /// are reported through [`ConnectorWorker::get_block_ids_with_load_errors`] no later.
    pub finished_recving: Vec<String>,
}

/// What a worker tells the scheduler after each step (vLLM's `KVConnectorWorkerMetadata`):
/// the steps it ran and the steps whose save copies are done. The scheduler commits a step's
/// saves once every rank ran it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Steps bound and run since the last report.
    pub executed: Vec<u64>,
    /// Steps whose save copies all ended since the last report.
    pub copied: Vec<u64>,
}
