//! Moving KV between an engine's paged cache and chunk memory by slot mapping: the
//! [`KvTransfer`] trait that [`crate::CacheEngine`]'s store / retrieve drive, and its host (CPU)
//! implementation [`HostPagedKvCache`] over a vLLM-style paged layout.
//!
//! The vLLM connector moves whole engine blocks instead: its copy jobs
//! (`kvpool_connector::vllm::worker::copy_job`) are executed by the engine-side mover in torch
//! (`kvpool/transfer.py`, CPU and CUDA alike) or, for Rust test engines, over a
//! [`HostPagedKvCache`] (`kvpool_connector::host_blocks`).

mod host_paged;

pub use host_paged::HostPagedKvCache;

use crate::error::TransferError;
use crate::layout::KvLayout;

/// Moves KV between an engine's paged cache and contiguous chunk buffers.
///
/// A token's place in the paged cache is its *slot*: `block_id * block_size + offset`. Chunk
/// buffers are layer-major (see [`KvLayout`]): for layer `l` and plane `p` of an `n`-token
/// chunk, token `t`'s row starts at `((l * planes + p) * n + t) * row_bytes`.
pub trait KvTransfer: Send + Sync {
    /// The layout of the paged cache.
    fn layout(&self) -> &KvLayout;

    /// Copies layer `layer` of the tokens at `slots` (one per chunk token, in order) into
    /// that layer's region of `chunk`, a buffer of `slots.len()` tokens.
    fn gather_layer(
        &self,
        layer: usize,
        slots: &[i64],
        chunk: &mut [u8],
    ) -> Result<(), TransferError>;

    /// Copies layer `layer` of `window`'s tokens from its chunk into the paged cache at its
    /// slots.
    fn scatter_layer(&mut self, layer: usize, window: ChunkWindow<'_>)
    -> Result<(), TransferError>;

    /// All layers of [`KvTransfer::gather_layer`].
    fn gather(&self, slots: &[i64], chunk: &mut [u8]) -> Result<(), TransferError> {
        for layer in 0..self.layout().num_layers {
            self.gather_layer(layer, slots, chunk)?;
        }
        Ok(())
    }

    /// All layers of [`KvTransfer::scatter_layer`].
    fn scatter(&mut self, window: ChunkWindow<'_>) -> Result<(), TransferError> {
        for layer in 0..self.layout().num_layers {
            self.scatter_layer(layer, window)?;
        }
        Ok(())
    }
}

/// Checks a chunk buffer and token window against a layout and layer; shared by implementations.
pub fn check_chunk_window(
    layout: &KvLayout,
    layer: usize,
    chunk_len: usize,
    chunk_tokens: usize,
    token_offset: usize,
    count: usize,
) -> Result<(), TransferError> {
    if layer >= layout.num_layers {
        return Err(TransferError::LayerOutOfRange {
            layer,
            layers: layout.num_layers,
        });
    }
    let expected = layout.chunk_bytes(chunk_tokens);
    if chunk_len != expected {
        return Err(TransferError::BufferSize {
            actual: chunk_len,
            expected,
            tokens: chunk_tokens,
        });
    }
    if token_offset + count > chunk_tokens {
        return Err(TransferError::TokenRange {
            start: token_offset,
            end: token_offset + count,
            tokens: chunk_tokens,
        });
    }
    Ok(())
}

/// One chunk to write into a paged cache: its bytes (a whole `chunk_tokens`-token chunk,
/// layer-major) and the slots of its tokens `token_offset..token_offset + slots.len()`.
/// [`KvTransfer::scatter`] takes one; [`crate::LayerwiseRetrieve::windows`] makes them.
#[derive(Debug, Clone, Copy)]
pub struct ChunkWindow<'a> {
    /// The chunk's bytes.
    pub data: &'a [u8],
    /// Tokens in the chunk.
    pub chunk_tokens: usize,
    /// First chunk token to write.
    pub token_offset: usize,
    /// Destination slots, one per token written.
    pub slots: &'a [i64],
}

impl<'a> ChunkWindow<'a> {
    /// A window over all of `data`, a chunk of `slots.len()` tokens.
    pub fn whole(data: &'a [u8], slots: &'a [i64]) -> Self {
        Self {
            data,
            chunk_tokens: slots.len(),
            token_offset: 0,
            slots,
        }
    }

    /// Checks this window against `layout` and `layer` (see [`check_chunk_window`]).
    pub fn check(&self, layout: &KvLayout, layer: usize) -> Result<(), TransferError> {
        check_chunk_window(
            layout,
            layer,
            self.data.len(),
            self.chunk_tokens,
            self.token_offset,
            self.slots.len(),
        )
    }
}
