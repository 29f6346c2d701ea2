//! A hybrid model's recurrent states (vLLM's Mamba / linear-attention KV cache groups) in the
//! pool: one value per state boundary, copied between the engine's state blocks and the pool.
//!
//! A recurrent state is valid at exactly one position: the state after the first `P` tokens
//! resumes the recurrence at `P` and nowhere else. Its key is therefore the chain hash that
//! names the prefix `[0, P)` (the hash of the chunk ending at `P`, which covers every token
//! before it and the request's extra keys), under the key scope of the state's KV cache group
//! (its layers, state shapes and dtypes, tensor-parallel rank). A value is the state's bytes
//! for every layer of the group, in the group's layer order: no value names a block index, so
//! a state is never loaded at another position, into another group or with another layout.
//! Lower tiers verify a value's header and checksum when read, and a read checks the length:
//! a value that does not fit is a miss.

use std::sync::Arc;

use kvpool_core::{CacheEngine, CacheKey, Chunk, ChunkHash, ChunkMeta, Dtype};
use tokio::runtime::Runtime;

use crate::host_spans::{PageSpans, gather, pages_fit, scatter};

/// Why a state could not be read into the engine's blocks (the request is then recomputed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateReadError {
    /// No tier holds the state (or its value failed a check when read).
    #[error("no tier holds the state")]
    Missing,
    /// The stored value does not fit this group's state.
    #[error(
        "the stored value has {found} bytes and layout {layout:#x}, not this group's {expected} bytes"
    )]
    DoesNotFit {
        /// Bytes of the stored value.
        found: usize,
        /// Bytes of this group's state.
        expected: usize,
        /// The stored value's layout fingerprint.
        layout: u64,
    },
    /// The engine's spans do not add up to one state.
    #[error("{0}")]
    Spans(String),
}

/// Reads and writes one KV cache group's recurrent states in a pool, by the chunk hash of the
/// prefix each follows (see the module docs).
pub struct StateValues {
    engine: Arc<CacheEngine>,
    runtime: Arc<Runtime>,
    value_bytes: usize,
    meta: ChunkMeta,
}

impl StateValues {
    /// States of `value_bytes` (every layer of the group) in `engine`'s pool and key scope,
    /// whose async calls run on `runtime`. `tokens_per_block` is the engine's block size
    /// (recorded in each value's header). Refused: an empty state, or one larger than
    /// `max_value_bytes` (what the pool's tiers were opened for).
    pub fn new(
        engine: Arc<CacheEngine>,
        runtime: Arc<Runtime>,
        value_bytes: usize,
        max_value_bytes: usize,
        tokens_per_block: u32,
    ) -> Result<Self, String> {
        if value_bytes == 0 {
            return Err("a recurrent state of 0 bytes".into());
        }
        if value_bytes > max_value_bytes {
            return Err(format!(
                "a recurrent state of {value_bytes} bytes is larger than the pool's largest \
                 value ({max_value_bytes} bytes, one chunk of the part that built it)"
            ));
        }
        let meta = ChunkMeta {
            layout_fingerprint: engine.token_database().scope().layout_fingerprint,
            dtype: Dtype::F16,
            token_count: tokens_per_block.max(1),
        };
        Ok(Self {
            engine,
            runtime,
            value_bytes,
            meta,
        })
    }

    /// Bytes of one state (every layer of the group).
    pub fn value_bytes(&self) -> usize {
        self.value_bytes
    }

    fn key(&self, prefix: ChunkHash) -> CacheKey {
        CacheKey::new(self.engine.token_database().scope().clone(), prefix)
    }

    /// Whether some tier holds the state after each prefix of `prefixes`, each on its own.
    pub fn presence(&self, prefixes: &[ChunkHash]) -> Vec<bool> {
        self.runtime
            .block_on(crate::vllm::scheduler::chunks_present(
                &self.engine,
                prefixes,
            ))
    }

    /// Stores each state (the bytes of its spans, in order) under the prefix it follows: into
    /// L1 before this returns, to the lower tiers behind. A state some tier holds already is
    /// left as it is. Returns how many were stored anew.
    ///
    /// # Safety
    ///
    /// Every span must be valid for reads of its length and not written until this returns
    /// (vLLM's worker calls it after the step's forward pass, before the next one).
    pub unsafe fn write(&self, states: &[(ChunkHash, PageSpans)]) -> Result<usize, String> {
        let spans: Vec<PageSpans> = states.iter().map(|(_, s)| s.clone()).collect();
        pages_fit(self.value_bytes, states.len(), &spans)?;
        let prefixes: Vec<ChunkHash> = states.iter().map(|(h, _)| *h).collect();
        let held = self.presence(&prefixes);
        let storage = self.engine.storage();
        let mut entries = Vec::new();
        for ((prefix, spans), held) in states.iter().zip(held) {
            if held {
                continue;
            }
            let mut buf = storage
                .allocate(self.value_bytes)
                .map_err(|e| format!("kvpool memory is full: {e}"))?;
            // SAFETY: the caller guarantees each span is valid for reads of its length and
            // unchanged until this returns; `pages_fit` checked they add up to a state.
            unsafe { gather(spans, buf.as_mut_slice()) };
            entries.push((
                self.key(*prefix),
                Chunk {
                    meta: self.meta,
                    data: buf.freeze(),
                },
            ));
        }
        let outcome = self
            .runtime
            .block_on(storage.put(entries))
            .map_err(|e| e.to_string())?;
        Ok(outcome.stored)
    }

    /// Copies the state after `prefix` into the engine's spans.
    ///
    /// # Safety
    ///
    /// Every span must be valid for writes of its length and not read or written by anyone
    /// else until this returns (the block vLLM allocated for the loaded state, before the
    /// forward pass that reads it).
    pub unsafe fn read(&self, prefix: ChunkHash, spans: &PageSpans) -> Result<(), StateReadError> {
        pages_fit(self.value_bytes, 1, std::slice::from_ref(spans))
            .map_err(StateReadError::Spans)?;
        let got = self
            .runtime
            .block_on(self.engine.storage().get(&[self.key(prefix)]));
        let Some(chunk) = got.into_iter().next() else {
            return Err(StateReadError::Missing);
        };
        if chunk.data.len() != self.value_bytes
            || chunk.meta.layout_fingerprint != self.meta.layout_fingerprint
        {
            return Err(StateReadError::DoesNotFit {
                found: chunk.data.len(),
                expected: self.value_bytes,
                layout: chunk.meta.layout_fingerprint,
            });
        }
        // SAFETY: the caller guarantees each span is valid for writes of its length and ours
        // alone for this call; `pages_fit` checked the lengths add up to the value's.
        unsafe { scatter(chunk.data.as_slice(), spans) };
        Ok(())
    }
}
