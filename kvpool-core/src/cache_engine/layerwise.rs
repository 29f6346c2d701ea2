//! Stores and retrieves one layer at a time: [`LayerwiseStore`] fills a store's chunks layer by
//! layer, [`LayerwiseRetrieve`] writes a retrieve's fetched chunks into the engine layer by layer.

use super::{CacheEngine, StoreReport};
use crate::error::EngineError;
use crate::format::chunk_format::ChunkMeta;
use crate::keys::token_database::ChunkSpan;
use crate::memory::pool::MemoryObjMut;
use crate::storage::backend::Chunk;
use crate::telemetry;
use crate::transfer::{ChunkWindow, KvTransfer};

/// A store in progress, filled one layer at a time.
pub struct LayerwiseStore<'e> {
    pub(super) engine: &'e CacheEngine,
    pub(super) buffers: Vec<(ChunkSpan, MemoryObjMut)>,
    pub(super) slot_mapping: Vec<i64>,
    pub(super) next_layer: usize,
    pub(super) report: StoreReport,
}

impl LayerwiseStore<'_> {
    /// Chunks that will be written.
    pub fn chunk_count(&self) -> usize {
        self.buffers.len()
    }

    /// Copies layer `layer` of every pending chunk out of `kv`. Layers go in order, once each.
    pub fn save_layer(&mut self, layer: usize, kv: &dyn KvTransfer) -> Result<(), EngineError> {
        if layer != self.next_layer {
            return Err(EngineError::Usage(format!(
                "layer-wise store expected layer {} next, got {layer}",
                self.next_layer
            )));
        }
        self.engine.check_transfer(kv)?;
        for (span, buf) in &mut self.buffers {
            kv.gather_layer(
                layer,
                &self.slot_mapping[span.start..span.end],
                buf.as_mut_slice(),
            )?;
        }
        self.next_layer += 1;
        Ok(())
    }

    /// Writes the filled chunks; every layer must have been saved.
    pub async fn finish(self) -> Result<StoreReport, EngineError> {
        let layers = self.engine.layout.num_layers;
        if self.next_layer != layers {
            return Err(EngineError::Usage(format!(
                "layer-wise store finished after {} of {layers} layers; nothing was stored",
                self.next_layer
            )));
        }
        let mut report = self.report;
        let layout = &self.engine.layout;
        let entries: Vec<_> = self
            .buffers
            .into_iter()
            .map(|(span, buf)| {
                let chunk = Chunk {
                    meta: ChunkMeta {
                        layout_fingerprint: self.engine.fingerprint,
                        dtype: layout.dtype,
                        token_count: span.len() as u32,
                    },
                    data: buf.freeze(),
                };
                (span.key, chunk)
            })
            .collect();
        let tokens: usize = entries
            .iter()
            .map(|(_, c)| c.meta.token_count as usize)
            .sum();
        let keys: Vec<_> = entries.iter().map(|(k, _)| k.clone()).collect();
        let outcome = self.engine.manager.put(entries).await?;
        report.stored_chunks = outcome.stored;
        if outcome.skipped == 0 {
            report.stored_keys = keys;
        }
        report.stored_tokens = if outcome.skipped == 0 { tokens } else { 0 };
        report.skipped_no_space += outcome.skipped;
        self.engine
            .counters
            .stored_tokens
            .add(report.stored_tokens as u64);
        metrics::counter!(telemetry::STORED_TOKENS).increment(report.stored_tokens as u64);
        Ok(report)
    }
}

/// Chunks fetched for a retrieve, written into the paged cache one layer at a time.
pub struct LayerwiseRetrieve {
    pub(super) layers: usize,
    pub(super) fingerprint: u64,
    pub(super) chunks: Vec<(ChunkSpan, Chunk, usize)>,
    pub(super) slot_mapping: Vec<i64>,
    pub(super) mask: Vec<bool>,
    /// Tokens this plan writes, per tier that served them, in the order first served.
    pub(super) tier_tokens: Vec<(String, usize)>,
    pub(super) next_layer: usize,
}

impl LayerwiseRetrieve {
    /// Tokens this plan writes, per tier that served them (`"cpu"` for L1, then the lower
    /// tiers' names), for per-request traces.
    pub fn tier_tokens(&self) -> &[(String, usize)] {
        &self.tier_tokens
    }

    /// One bool per token: `true` where KV will be (or was) written.
    pub fn loaded_mask(&self) -> &[bool] {
        &self.mask
    }

    /// Number of tokens that will be written.
    pub fn loaded_tokens(&self) -> usize {
        self.mask.iter().filter(|m| **m).count()
    }

    /// The slots of the tokens this plan writes (to report them if a write fails).
    pub fn slot_mapping_of_loaded(&self) -> Vec<i64> {
        self.slot_mapping
            .iter()
            .zip(&self.mask)
            .filter(|(_, m)| **m)
            .map(|(s, _)| *s)
            .collect()
    }

    /// Consumes the plan, returning the loaded mask.
    pub fn into_mask(self) -> Vec<bool> {
        self.mask
    }

    fn check(&self, kv: &dyn KvTransfer) -> Result<(), EngineError> {
        if kv.layout().fingerprint() != self.fingerprint {
            return Err(EngineError::Usage(
                "transfer layout does not match the engine layout".into(),
            ));
        }
        Ok(())
    }

    /// Every fetched chunk with the window of it to write and where: what
    /// [`LayerwiseRetrieve::load_layer`] writes, for a transfer engine that queues all layers
    /// at once and signals each.
    /// Using them does not advance this plan's layer-by-layer state.
    pub fn windows(&self) -> Vec<ChunkWindow<'_>> {
        self.chunks
            .iter()
            .map(|(span, chunk, offset)| ChunkWindow {
                data: chunk.data.as_slice(),
                chunk_tokens: span.len(),
                token_offset: *offset,
                slots: &self.slot_mapping[span.start + offset..span.end],
            })
            .collect()
    }

    /// Writes layer `layer` of every fetched chunk into `kv`. Layers go in order, once each.
    pub fn load_layer(&mut self, layer: usize, kv: &mut dyn KvTransfer) -> Result<(), EngineError> {
        if layer != self.next_layer || layer >= self.layers {
            return Err(EngineError::Usage(format!(
                "layer-wise retrieve expected layer {} next, got {layer}",
                self.next_layer
            )));
        }
        self.check(kv)?;
        for w in self.windows() {
            kv.scatter_layer(layer, w)?;
        }
        self.next_layer += 1;
        Ok(())
    }

    /// Writes every remaining layer.
    pub fn load_all(&mut self, kv: &mut dyn KvTransfer) -> Result<(), EngineError> {
        while self.next_layer < self.layers {
            self.load_layer(self.next_layer, kv)?;
        }
        Ok(())
    }
}
