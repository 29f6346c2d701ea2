//! `LayerwiseTransfer`: the one load/store path the connector's worker drives, for host and GPU
//! caches alike — submit a step's loads, wait per layer, fence before a store gathers.
//!
//! A host cache ([`HostPagedKvCache`], [`BlockKvCache`]) copies every layer when the load is
//! submitted: there is no other stream to overlap with, and the engine reads the cache only
//! after the call returns. kvpool-cuda's `GpuTransferEngine` queues every layer on its copy
//! stream and records an event per layer; waiting for a layer makes the engine's compute
//! stream wait for that event, so loading layer `l + 1` overlaps computing layer `l`.

use crate::block_transfer::BlockKvCache;
use crate::cache_engine::LayerwiseRetrieve;
use crate::error::{EngineError, TransferError};
use crate::transfer::{ChunkWindow, HostPagedKvCache, KvTransfer};

/// A paged KV cache the worker loads into layer by layer and stores from.
pub trait LayerwiseTransfer: KvTransfer {
    /// Starts writing every layer of `plan`'s chunks into the paged cache. The returned load
    /// owns the chunk memory until every copy reading it is done, so nothing it hands to a
    /// device can be freed under it (leaking the load leaks the memory; it never dangles).
    /// On an error, nothing is known about which of `plan`'s tokens were written: report all.
    fn submit_load(&mut self, plan: LayerwiseRetrieve) -> Result<Box<dyn LayerLoad>, EngineError>;

    /// Orders the gathers of a store after every write the engine queued before this call
    /// (this step's forward pass). A host cache has nothing to wait for: the engine's writes
    /// are done when it calls the connector. A GPU cache records an event on the engine's
    /// compute stream and makes its copy stream wait for it, so half-written KV is never
    /// stored under a valid checksum.
    fn fence_before_store(&self) -> Result<(), TransferError>;
}

/// A load in flight, from [`LayerwiseTransfer::submit_load`].
pub trait LayerLoad: Send {
    /// Returns once layer `layer` is in the paged cache as far as the engine can tell: a host
    /// load has already written it; a GPU load makes the engine's compute stream wait for it
    /// (the host does not block).
    fn wait_layer(&self, layer: usize) -> Result<(), TransferError>;

    /// Tokens this load writes.
    fn loaded_tokens(&self) -> usize;
}

/// A load that finished when it was submitted (every host cache's).
#[derive(Debug, Clone, Copy)]
pub struct CompletedLoad {
    layers: usize,
    tokens: usize,
}

impl LayerLoad for CompletedLoad {
    fn wait_layer(&self, layer: usize) -> Result<(), TransferError> {
        if layer >= self.layers {
            return Err(TransferError::LayerOutOfRange {
                layer,
                layers: self.layers,
            });
        }
        Ok(())
    }

    fn loaded_tokens(&self) -> usize {
        self.tokens
    }
}

/// Writes every layer of `plan` into `kv` now: the host implementation of
/// [`LayerwiseTransfer::submit_load`].
pub fn load_now(
    kv: &mut dyn KvTransfer,
    mut plan: LayerwiseRetrieve,
) -> Result<Box<dyn LayerLoad>, EngineError> {
    plan.load_all(kv)?;
    Ok(Box::new(CompletedLoad {
        layers: kv.layout().num_layers,
        tokens: plan.loaded_tokens(),
    }))
}

impl LayerwiseTransfer for HostPagedKvCache {
    fn submit_load(&mut self, plan: LayerwiseRetrieve) -> Result<Box<dyn LayerLoad>, EngineError> {
        load_now(self, plan)
    }

    fn fence_before_store(&self) -> Result<(), TransferError> {
        Ok(())
    }
}

impl LayerwiseTransfer for BlockKvCache {
    fn submit_load(&mut self, plan: LayerwiseRetrieve) -> Result<Box<dyn LayerLoad>, EngineError> {
        load_now(self, plan)
    }

    fn fence_before_store(&self) -> Result<(), TransferError> {
        Ok(())
    }
}

/// Chunks to write into a paged cache, owned by whoever holds this value: what a transfer
/// engine that queues every layer at once keeps alive until its copies are done.
pub trait ChunkWindows: Send + 'static {
    /// Every chunk with the window of it to write and where.
    fn windows(&self) -> Vec<ChunkWindow<'_>>;
}

impl ChunkWindows for LayerwiseRetrieve {
    fn windows(&self) -> Vec<ChunkWindow<'_>> {
        LayerwiseRetrieve::windows(self)
    }
}

/// One chunk window that owns its bytes and slots (for tests, benchmarks and engines that
/// build loads without the cache engine). `D` is any owned byte buffer: a `Vec<u8>`, or a
/// pool's [`crate::MemoryObj`] (pinned memory, for real overlap on a GPU).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedChunkWindow<D = Vec<u8>> {
    /// The chunk's bytes, a whole `chunk_tokens`-token chunk, layer-major.
    pub data: D,
    /// Tokens in the chunk.
    pub chunk_tokens: usize,
    /// First chunk token to write.
    pub token_offset: usize,
    /// Destination slots, one per token written.
    pub slots: Vec<i64>,
}

impl<D: AsRef<[u8]> + Send + 'static> ChunkWindows for Vec<OwnedChunkWindow<D>> {
    fn windows(&self) -> Vec<ChunkWindow<'_>> {
        self.iter()
            .map(|w| ChunkWindow {
                data: w.data.as_ref(),
                chunk_tokens: w.chunk_tokens,
                token_offset: w.token_offset,
                slots: &w.slots,
            })
            .collect()
    }
}
