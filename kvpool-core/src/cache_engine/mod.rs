//! The cache engine: lookup / store / retrieve of token sequences, whole or one layer at a time.

use std::sync::Arc;

use tracing::warn;

use crate::error::{ConfigError, EngineError, FormatError, TransferError};
use crate::format::chunk_format::ChunkMeta;
use crate::keys::cache_key::CacheKey;
use crate::keys::chunk_hash::ChunkHash;
use crate::keys::token_database::{ChunkSpan, ChunkedTokenDatabase};
use crate::layout::KvLayout;
use crate::storage::backend::Chunk;
use crate::storage::manager::StorageManager;
use crate::telemetry;
use crate::telemetry::counter::StatCounter;
use crate::transfer::KvTransfer;

mod layerwise;

pub use layerwise::{LayerwiseRetrieve, LayerwiseStore};

/// What a store did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreReport {
    /// Chunks written (to L1, and scheduled for lower tiers).
    pub stored_chunks: usize,
    /// Tokens in those chunks.
    pub stored_tokens: usize,
    /// Chunks skipped because L1 already had them.
    pub already_present: usize,
    /// Chunks not stored for lack of memory (they and every later chunk).
    pub skipped_no_space: usize,
    /// Keys of the chunks written, in order. Empty when any write was skipped, as it is then
    /// unknown which ones went in (for event streams: a missing event beats a false one).
    pub stored_keys: Vec<crate::keys::cache_key::CacheKey>,
}

/// Counters of the engine, in tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// `lookup` calls.
    pub lookups: u64,
    /// Tokens asked about in `lookup`.
    pub lookup_tokens: u64,
    /// Tokens `lookup` reported as hits.
    pub lookup_hit_tokens: u64,
    /// Tokens asked for in `retrieve` (excluding the masked prefix).
    pub retrieve_tokens: u64,
    /// Tokens actually loaded by `retrieve`.
    pub retrieve_hit_tokens: u64,
    /// Tokens stored.
    pub stored_tokens: u64,
    /// Chunks rejected at retrieve for a layout or size mismatch.
    pub rejected_chunks: u64,
}

#[derive(Debug, Default)]
struct EngineCounters {
    lookups: StatCounter,
    lookup_tokens: StatCounter,
    lookup_hit_tokens: StatCounter,
    retrieve_tokens: StatCounter,
    retrieve_hit_tokens: StatCounter,
    stored_tokens: StatCounter,
    rejected_chunks: StatCounter,
}

fn check_slot_mapping(slot_mapping: &[i64], num_tokens: usize) -> Result<(), TransferError> {
    if slot_mapping.len() != num_tokens {
        return Err(TransferError::SlotMappingLength {
            slots: slot_mapping.len(),
            tokens: num_tokens,
        });
    }
    Ok(())
}

/// The KV cache engine for one model / rank / layout.
///
/// ```no_run
/// # async fn demo(engine: kvpool_core::CacheEngine, kv: &mut kvpool_core::HostPagedKvCache) {
/// let tokens: Vec<u32> = (0..1024).collect();
/// let slots: Vec<i64> = (0..1024).collect();
/// engine.store(&tokens, None, kv, &slots).await.unwrap();
/// let hit = engine.lookup(&tokens).await.unwrap();
/// let loaded = engine.retrieve(&tokens, None, kv, &slots).await.unwrap();
/// assert_eq!(loaded.iter().filter(|b| **b).count(), hit);
/// # }
/// ```
pub struct CacheEngine {
    layout: KvLayout,
    fingerprint: u64,
    db: ChunkedTokenDatabase,
    manager: Arc<StorageManager>,
    counters: EngineCounters,
}

impl std::fmt::Debug for CacheEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheEngine")
            .field("layout", &self.layout)
            .field("chunk_size", &self.db.chunk_size())
            .field("manager", &self.manager)
            .finish()
    }
}

impl CacheEngine {
    /// An engine over `manager`; the database's key scope must carry `layout`'s fingerprint.
    pub fn new(
        layout: KvLayout,
        db: ChunkedTokenDatabase,
        manager: Arc<StorageManager>,
    ) -> Result<Self, ConfigError> {
        layout.validate()?;
        let fingerprint = layout.fingerprint();
        if db.scope().layout_fingerprint != fingerprint {
            return Err(ConfigError::Invalid {
                field: "layout",
                reason: format!(
                    "key scope fingerprint {:016x} differs from the layout's {fingerprint:016x}",
                    db.scope().layout_fingerprint
                ),
            });
        }
        Ok(CacheEngine {
            layout,
            fingerprint,
            db,
            manager,
            counters: EngineCounters::default(),
        })
    }

    /// The KV layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The token database (chunking and keys).
    pub fn token_database(&self) -> &ChunkedTokenDatabase {
        &self.db
    }

    /// The storage manager.
    pub fn storage(&self) -> &Arc<StorageManager> {
        &self.manager
    }

    /// Engine counters.
    pub fn stats(&self) -> EngineStats {
        let l = StatCounter::get;
        let c = &self.counters;
        EngineStats {
            lookups: l(&c.lookups),
            lookup_tokens: l(&c.lookup_tokens),
            lookup_hit_tokens: l(&c.lookup_hit_tokens),
            retrieve_tokens: l(&c.retrieve_tokens),
            retrieve_hit_tokens: l(&c.retrieve_hit_tokens),
            stored_tokens: l(&c.stored_tokens),
            rejected_chunks: l(&c.rejected_chunks),
        }
    }

    /// How many leading tokens of `tokens` can be loaded (a multiple of the chunk size, or the
    /// full length when the partial chunk is stored).
    pub async fn lookup(&self, tokens: &[u32]) -> Result<usize, EngineError> {
        let spans = self.db.process_tokens(tokens, None)?;
        let hit = self.lookup_spans(&spans).await;
        self.counters.lookups.add(1);
        self.counters.lookup_tokens.add(tokens.len() as u64);
        self.counters.lookup_hit_tokens.add(hit as u64);
        Ok(hit)
    }

    /// [`CacheEngine::lookup`] over precomputed spans (e.g. from engine block hashes).
    pub async fn lookup_spans(&self, spans: &[ChunkSpan]) -> usize {
        let keys: Vec<_> = spans.iter().map(|s| s.key.clone()).collect();
        let found = self.manager.lookup(&keys).await;
        let hit = found.len().checked_sub(1).map_or(0, |last| spans[last].end);
        record_lookup(spans.last().map_or(0, |s| s.end), hit);
        hit
    }

    /// How many leading chunks of `chunk_hashes` (whole chunks of this engine's scope, e.g.
    /// shipped by a connector's scheduler) the pool holds in any tier.
    pub async fn lookup_chunk_hashes(&self, chunk_hashes: &[ChunkHash]) -> usize {
        let scope = self.db.scope();
        let keys: Vec<_> = chunk_hashes
            .iter()
            .map(|h| CacheKey::new(scope.clone(), *h))
            .collect();
        let found = self.manager.lookup(&keys).await.len();
        let chunk = self.db.chunk_size();
        record_lookup(chunk_hashes.len() * chunk, found * chunk);
        found
    }

    fn check_transfer(&self, kv: &dyn KvTransfer) -> Result<(), EngineError> {
        if kv.layout().fingerprint() != self.fingerprint {
            return Err(EngineError::Usage(format!(
                "transfer layout {:?} does not match the engine layout {:?}",
                kv.layout(),
                self.layout
            )));
        }
        Ok(())
    }

    /// Stores the KV of `tokens` (read from `kv` at `slot_mapping`, one slot per token).
    ///
    /// `mask` marks with `false` a leading run of tokens the caller does not need stored;
    /// chunks entirely inside it are skipped. Chunks already present are skipped. When memory
    /// runs out, the remaining chunks are skipped (and reported), never blocked on.
    pub async fn store(
        &self,
        tokens: &[u32],
        mask: Option<&[bool]>,
        kv: &dyn KvTransfer,
        slot_mapping: &[i64],
    ) -> Result<StoreReport, EngineError> {
        self.check_transfer(kv)?;
        let spans = self.db.process_tokens(tokens, mask)?;
        let mut store = self
            .begin_store_spans(spans, tokens.len(), slot_mapping)
            .await?;
        for layer in 0..self.layout.num_layers {
            store.save_layer(layer, kv)?;
        }
        store.finish().await
    }

    /// Starts a layer-wise store: call [`LayerwiseStore::save_layer`] for layers 0, 1, … in
    /// order (e.g. as each layer's forward pass completes), then [`LayerwiseStore::finish`].
    pub async fn begin_store_layerwise(
        &self,
        tokens: &[u32],
        mask: Option<&[bool]>,
        slot_mapping: &[i64],
    ) -> Result<LayerwiseStore<'_>, EngineError> {
        let spans = self.db.process_tokens(tokens, mask)?;
        self.begin_store_spans(spans, tokens.len(), slot_mapping)
            .await
    }

    /// Layer-wise store over precomputed spans (`slot_mapping` covers `num_tokens` tokens).
    pub async fn begin_store_spans(
        &self,
        spans: Vec<ChunkSpan>,
        num_tokens: usize,
        slot_mapping: &[i64],
    ) -> Result<LayerwiseStore<'_>, EngineError> {
        check_slot_mapping(slot_mapping, num_tokens)?;
        let keys: Vec<_> = spans.iter().map(|s| s.key.clone()).collect();
        // Only L1 is asked: a save must not wait on a remote tier, and write-behind skips
        // what is already in flight.
        let present = self.manager.l1_prefix(&keys).await;
        let mut report = StoreReport {
            already_present: present,
            ..Default::default()
        };
        let mut buffers = Vec::with_capacity(spans.len() - present);
        for (i, span) in spans.iter().enumerate().skip(present) {
            match self.manager.allocate(self.layout.chunk_bytes(span.len())) {
                Ok(buf) => buffers.push((span.clone(), buf)),
                Err(e) => {
                    report.skipped_no_space = spans.len() - i;
                    tracing::debug!(error = %e, skipped = report.skipped_no_space, "no memory for chunks; skipping the rest of this store");
                    break;
                }
            }
        }
        Ok(LayerwiseStore {
            engine: self,
            buffers,
            slot_mapping: slot_mapping.to_vec(),
            next_layer: 0,
            report,
        })
    }

    /// Loads as many leading chunks of `tokens` as the tiers have into `kv` at `slot_mapping`.
    ///
    /// Returns one bool per token: `true` where KV was written. Tokens in the masked prefix
    /// (`false` in `mask`) are never written. A chunk that is missing, unreadable or does not
    /// match the layout ends the loaded prefix; its tokens and all later ones stay `false`.
    pub async fn retrieve(
        &self,
        tokens: &[u32],
        mask: Option<&[bool]>,
        kv: &mut dyn KvTransfer,
        slot_mapping: &[i64],
    ) -> Result<Vec<bool>, EngineError> {
        self.check_transfer(kv)?;
        let mut plan = self
            .begin_retrieve_layerwise(tokens, mask, slot_mapping)
            .await?;
        plan.load_all(kv)?;
        Ok(plan.into_mask())
    }

    /// Fetches chunks for a layer-wise retrieve; then call
    /// [`LayerwiseRetrieve::load_layer`] for each layer in order.
    pub async fn begin_retrieve_layerwise(
        &self,
        tokens: &[u32],
        mask: Option<&[bool]>,
        slot_mapping: &[i64],
    ) -> Result<LayerwiseRetrieve, EngineError> {
        let skip = match mask {
            Some(m) => ChunkedTokenDatabase::masked_prefix_len(m, tokens.len())?,
            None => 0,
        };
        let spans = self.db.process_tokens(tokens, mask)?;
        self.begin_retrieve_spans(&spans, skip, tokens.len(), slot_mapping)
            .await
    }

    /// Layer-wise retrieve over precomputed spans; tokens before `skip` are not written.
    pub async fn begin_retrieve_spans(
        &self,
        spans: &[ChunkSpan],
        skip: usize,
        num_tokens: usize,
        slot_mapping: &[i64],
    ) -> Result<LayerwiseRetrieve, EngineError> {
        check_slot_mapping(slot_mapping, num_tokens)?;
        let fetched = self.fetch_spans(spans, Vec::new()).await;
        let mut loaded = Vec::with_capacity(fetched.chunks.len());
        let mut mask = vec![false; num_tokens];
        let mut tier_tokens: Vec<(String, usize)> = Vec::new();
        for ((span, chunk), tier) in spans.iter().zip(fetched.chunks).zip(&fetched.tiers) {
            // Tokens of this span before `skip` are not written (a span wholly inside the
            // skipped prefix writes nothing).
            let offset = skip.clamp(span.start, span.end) - span.start;
            mask[span.start + offset..span.end]
                .iter_mut()
                .for_each(|m| *m = true);
            add_tier_tokens(&mut tier_tokens, tier, span.end - span.start - offset);
            loaded.push((span.clone(), chunk, offset));
        }
        let wanted = num_tokens.saturating_sub(skip);
        let hit = mask.iter().filter(|m| **m).count();
        self.record_retrieve(wanted, hit);
        Ok(LayerwiseRetrieve {
            layers: self.layout.num_layers,
            fingerprint: self.fingerprint,
            chunks: loaded,
            slot_mapping: slot_mapping.to_vec(),
            mask,
            tier_tokens,
            next_layer: 0,
        })
    }

    /// Fetches and verifies the chunks of `spans`, in order, stopping at the first that is
    /// missing or fails a check (a chunk that fails is counted, and removed as below).
    /// `in_memory` are chunks already in hand for the leading spans (a lookup lease's), used
    /// as they are and checked like the rest; the other spans are read from the tiers. A chunk
    /// that fails is removed from the tier it came from and from memory (L1, node memory),
    /// never from another durable tier.
    pub async fn fetch_spans(&self, spans: &[ChunkSpan], in_memory: Vec<Chunk>) -> FetchedChunks {
        let held = in_memory.len().min(spans.len());
        let names = self.manager.tier_names();
        let l1_name = self
            .manager
            .l1_tier()
            .map_or_else(|| "memory".to_string(), |p| names[p].clone());
        let l1 = self.manager.l1_tier();
        // (tier index, if known; tier name; chunk)
        let mut candidates: Vec<(Option<usize>, String, Chunk)> = in_memory
            .into_iter()
            .take(held)
            .map(|c| (l1, l1_name.clone(), c))
            .collect();
        if held < spans.len() {
            let keys: Vec<_> = spans[held..].iter().map(|s| s.key.clone()).collect();
            candidates.extend(
                self.manager
                    .get_with_tiers(&keys)
                    .await
                    .into_iter()
                    .map(|(t, c)| (Some(t), names[t].clone(), c)),
            );
        }
        let mut out = FetchedChunks::default();
        for (span, (index, tier, chunk)) in spans.iter().zip(candidates) {
            if let Err(e) = self.validate(span, &chunk) {
                self.counters.rejected_chunks.add(1);
                warn!(key = %span.key, tier = %tier, error = %e, "rejecting chunk at retrieve; removing it from that tier and memory");
                // The copy that failed, and the memory copies it may have been read through or
                // promoted into (L1, node memory); never another durable tier's.
                let key = std::slice::from_ref(&span.key);
                if let Some(t) = index {
                    self.manager.remove_from(t, key).await;
                }
                if let Some(p) = l1.filter(|&p| Some(p) != index) {
                    self.manager.remove_from(p, key).await;
                }
                self.manager.remove_from_node_memory(key).await;
                break;
            }
            out.chunks.push(chunk);
            out.tiers.push(tier);
        }
        out
    }

    /// Counts `tokens` stored by a caller that writes chunks itself (a connector's commit).
    pub fn record_stored(&self, tokens: usize) {
        self.counters.stored_tokens.add(tokens as u64);
        metrics::counter!(telemetry::STORED_TOKENS).increment(tokens as u64);
    }

    /// Counts a retrieve of `wanted` tokens of which `hit` were loaded.
    pub fn record_retrieve(&self, wanted: usize, hit: usize) {
        self.counters.retrieve_tokens.add(wanted as u64);
        self.counters.retrieve_hit_tokens.add(hit as u64);
        metrics::counter!(telemetry::RETRIEVE_TOKENS).increment(wanted as u64);
        metrics::counter!(telemetry::RETRIEVE_HIT_TOKENS).increment(hit as u64);
    }

    fn validate(&self, span: &ChunkSpan, chunk: &Chunk) -> Result<(), FormatError> {
        self.validate_meta(span, &chunk.meta, chunk.data.len())
    }

    /// Whether a chunk described by `meta`, of `len` bytes of KV, fits `span` under this
    /// engine: its layout, dtype, token count and size.
    pub fn validate_meta(
        &self,
        span: &ChunkSpan,
        meta: &ChunkMeta,
        len: usize,
    ) -> Result<(), FormatError> {
        if meta.layout_fingerprint != self.fingerprint {
            return Err(FormatError::LayoutMismatch {
                expected: self.fingerprint,
                found: meta.layout_fingerprint,
            });
        }
        if meta.dtype != self.layout.dtype {
            return Err(FormatError::DtypeMismatch {
                expected: self.layout.dtype,
                found: meta.dtype,
            });
        }
        let expected = self.layout.chunk_bytes(span.len()) as u64;
        if meta.token_count as usize != span.len() || len as u64 != expected {
            return Err(FormatError::SizeMismatch {
                raw_len: len as u64,
                tokens: meta.token_count,
                expected,
            });
        }
        Ok(())
    }
}

/// Adds `tokens` to `tier`'s entry of a per-tier tally (kept in the order tiers first appear).
pub fn add_tier_tokens(tally: &mut Vec<(String, usize)>, tier: &str, tokens: usize) {
    match tally.iter_mut().find(|(n, _)| n == tier) {
        Some((_, n)) => *n += tokens,
        None => tally.push((tier.to_string(), tokens)),
    }
}

/// Chunks fetched for a load ([`CacheEngine::fetch_spans`]): the longest verified prefix.
#[derive(Debug, Clone, Default)]
pub struct FetchedChunks {
    /// The chunks, in span order.
    pub chunks: Vec<Chunk>,
    /// The tier that served each (`"cpu"` for L1).
    pub tiers: Vec<String>,
}

/// Counts one lookup of `asked` tokens that found `hit` of them.
pub fn record_lookup(asked: usize, hit: usize) {
    metrics::counter!(telemetry::LOOKUPS).increment(1);
    metrics::counter!(telemetry::LOOKUP_TOKENS).increment(asked as u64);
    metrics::counter!(telemetry::HIT_TOKENS).increment(hit as u64);
}
