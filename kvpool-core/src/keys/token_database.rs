//! The chunked token database: token ids (or engine block hashes) -> chunk spans and cache keys.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::TokenError;
use crate::keys::cache_key::{CacheKey, KeyScope};
use crate::keys::chunk_hash::{ChunkHash, HashAlgorithm};

/// Default tokens per chunk (as in LMCache).
pub const DEFAULT_CHUNK_SIZE: usize = 256;

/// How tokens are cut into chunks and hashed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ChunkingConfig {
    /// Tokens per chunk.
    pub chunk_size: usize,
    /// Chain hash function.
    pub hash_algorithm: HashAlgorithm,
    /// Whether the trailing partial chunk is stored and looked up.
    pub save_unfull_chunk: bool,
}

impl Default for ChunkingConfig {
    fn default() -> Self {
        ChunkingConfig {
            chunk_size: DEFAULT_CHUNK_SIZE,
            hash_algorithm: HashAlgorithm::Xxh3_128,
            save_unfull_chunk: false,
        }
    }
}

/// One chunk of a token sequence: tokens `start..end` and the key that stores them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkSpan {
    /// First token (inclusive).
    pub start: usize,
    /// Last token (exclusive).
    pub end: usize,
    /// The storage key (prefix-chained).
    pub key: CacheKey,
}

impl ChunkSpan {
    /// Tokens in the chunk.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Whether the span is empty (never true for spans this crate produces).
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// Chain hashes of one request's tokens, computed incrementally: each full chunk is hashed
/// once, when its last token arrives. A scheduler keeps one per request and ships the hashes,
/// so no process hashes the request's tokens again.
///
/// ```
/// use kvpool_core::{ChunkedTokenDatabase, ChunkingConfig, KeyScope};
/// let db = ChunkedTokenDatabase::new(
///     ChunkingConfig { chunk_size: 4, ..Default::default() },
///     KeyScope::new("demo", 1, 0, 0, 42).unwrap(),
/// ).unwrap();
/// let tokens: Vec<u32> = (0..10).collect();
/// let mut hasher = db.hasher(b"");
/// hasher.extend(&tokens[..3]);
/// hasher.extend(&tokens[3..]);
/// let spans = db.process_tokens(&tokens, None).unwrap();
/// assert_eq!(hasher.hashes(), [spans[0].key.hash, spans[1].key.hash]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkHasher {
    algorithm: HashAlgorithm,
    chunk_size: usize,
    root: ChunkHash,
    prev: ChunkHash,
    hashes: Vec<ChunkHash>,
    pending: Vec<u32>,
}

impl ChunkHasher {
    /// A hasher whose first chunk chains onto `root` (see [`ChunkedTokenDatabase::root_for`]).
    pub fn new(algorithm: HashAlgorithm, chunk_size: usize, root: ChunkHash) -> Self {
        ChunkHasher {
            algorithm,
            chunk_size: chunk_size.max(1),
            root,
            prev: root,
            hashes: Vec::new(),
            pending: Vec::new(),
        }
    }

    /// Appends tokens, hashing every chunk they complete.
    pub fn extend(&mut self, tokens: &[u32]) {
        let mut rest = tokens;
        while !rest.is_empty() {
            let take = (self.chunk_size - self.pending.len()).min(rest.len());
            self.pending.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if self.pending.len() == self.chunk_size {
                self.prev = self.algorithm.chain_tokens(&self.prev, &self.pending);
                self.hashes.push(self.prev);
                self.pending.clear();
            }
        }
    }

    /// The hash the first chunk chains onto.
    pub fn root(&self) -> ChunkHash {
        self.root
    }

    /// The hash algorithm.
    pub fn algorithm(&self) -> HashAlgorithm {
        self.algorithm
    }

    /// Hashes of the full chunks so far, in order.
    pub fn hashes(&self) -> &[ChunkHash] {
        &self.hashes
    }

    /// Tokens appended so far.
    pub fn num_tokens(&self) -> usize {
        self.hashes.len() * self.chunk_size + self.pending.len()
    }
}

/// Turns token sequences into prefix-chained chunk keys.
///
/// Deterministic across processes and machines: the hash has no seed and a fixed root.
///
/// ```
/// use kvpool_core::{ChunkedTokenDatabase, ChunkingConfig, KeyScope};
/// let scope = KeyScope::new("demo", 1, 0, 0, 42).unwrap();
/// let config = ChunkingConfig { chunk_size: 4, ..Default::default() };
/// let db = ChunkedTokenDatabase::new(config, scope).unwrap();
/// let tokens: Vec<u32> = (0..10).collect();
/// // Two full chunks; the partial tail (2 tokens) is skipped unless save_unfull_chunk.
/// let spans = db.process_tokens(&tokens, None).unwrap();
/// assert_eq!(spans.iter().map(|s| (s.start, s.end)).collect::<Vec<_>>(), [(0, 4), (4, 8)]);
/// ```
#[derive(Debug, Clone)]
pub struct ChunkedTokenDatabase {
    config: ChunkingConfig,
    scope: Arc<KeyScope>,
    root: ChunkHash,
}

impl ChunkedTokenDatabase {
    /// Builds a database for one model/rank/layout scope.
    pub fn new(config: ChunkingConfig, scope: KeyScope) -> Result<Self, crate::ConfigError> {
        if config.chunk_size == 0 {
            return Err(crate::ConfigError::Invalid {
                field: "chunk_size",
                reason: "must be at least 1 token (256 is typical)".into(),
            });
        }
        Ok(ChunkedTokenDatabase {
            root: config.hash_algorithm.root(),
            config,
            scope: Arc::new(scope),
        })
    }

    /// The chunking configuration.
    pub fn config(&self) -> &ChunkingConfig {
        &self.config
    }

    /// The key scope shared by every key this database makes.
    pub fn scope(&self) -> &Arc<KeyScope> {
        &self.scope
    }

    /// Tokens per chunk.
    pub fn chunk_size(&self) -> usize {
        self.config.chunk_size
    }

    /// Number of leading `false` entries of a mask, checking its shape.
    ///
    /// A mask marks with `false` the leading tokens the caller already has (e.g. on the GPU);
    /// only a run of `false` followed by a run of `true` is meaningful for prefix caching.
    pub fn masked_prefix_len(mask: &[bool], num_tokens: usize) -> Result<usize, TokenError> {
        if mask.len() != num_tokens {
            return Err(TokenError::MaskLength {
                mask: mask.len(),
                tokens: num_tokens,
            });
        }
        let skip = mask.iter().take_while(|m| !**m).count();
        if let Some(pos) = mask[skip..].iter().position(|m| !*m) {
            return Err(TokenError::MaskNotPrefix { index: skip + pos });
        }
        Ok(skip)
    }

    /// Chunk spans of `tokens`, in order.
    ///
    /// Chunks that lie entirely inside the masked prefix are omitted; a chunk that straddles
    /// it is returned whole (its hash covers all its tokens), and the caller moves only the
    /// unmasked part. The trailing partial chunk is returned only with `save_unfull_chunk`.
    pub fn process_tokens(
        &self,
        tokens: &[u32],
        mask: Option<&[bool]>,
    ) -> Result<Vec<ChunkSpan>, TokenError> {
        self.process_tokens_with_extra(tokens, mask, &[])
    }

    /// The hash that precedes a request's first chunk: the fixed root, or, when the request
    /// has extra keys (LoRA adapter, multimodal input hashes, cache salt), the root chained
    /// with them, so requests that differ only in those never share a chunk.
    pub fn root_for(&self, extra_keys: &[u8]) -> ChunkHash {
        if extra_keys.is_empty() {
            self.root
        } else {
            self.config
                .hash_algorithm
                .chain_extra(&self.root, extra_keys)
        }
    }

    /// An incremental hasher for a request with `extra_keys`.
    pub fn hasher(&self, extra_keys: &[u8]) -> ChunkHasher {
        ChunkHasher::new(
            self.config.hash_algorithm,
            self.config.chunk_size,
            self.root_for(extra_keys),
        )
    }

    /// Spans of chunks whose hashes a scheduler already computed (chunk `i` covers tokens
    /// `i * chunk_size..` up to `num_tokens`; the last one may be partial). Chunks ending at or
    /// before `skip_tokens` are omitted. No token is hashed.
    pub fn spans_from_hashes(
        &self,
        hashes: &[ChunkHash],
        skip_tokens: usize,
        num_tokens: usize,
    ) -> Vec<ChunkSpan> {
        let cs = self.config.chunk_size;
        hashes
            .iter()
            .enumerate()
            .map(|(i, h)| (i * cs, ((i + 1) * cs).min(num_tokens), h))
            .take_while(|(start, _, _)| *start < num_tokens)
            .filter(|(_, end, _)| *end > skip_tokens)
            .map(|(start, end, h)| ChunkSpan {
                start,
                end,
                key: CacheKey::new(self.scope.clone(), *h),
            })
            .collect()
    }

    /// [`ChunkedTokenDatabase::process_tokens`] for a request with extra keys (see
    /// [`ChunkedTokenDatabase::root_for`]); empty `extra_keys` give the same keys as
    /// `process_tokens`.
    pub fn process_tokens_with_extra(
        &self,
        tokens: &[u32],
        mask: Option<&[bool]>,
        extra_keys: &[u8],
    ) -> Result<Vec<ChunkSpan>, TokenError> {
        let skip = match mask {
            Some(m) => Self::masked_prefix_len(m, tokens.len())?,
            None => 0,
        };
        let algo = self.config.hash_algorithm;
        let cs = self.config.chunk_size;
        let mut spans = Vec::with_capacity(tokens.len() / cs + 1);
        let mut prev = self.root_for(extra_keys);
        for (i, chunk) in tokens.chunks(cs).enumerate() {
            if chunk.len() < cs && !self.config.save_unfull_chunk {
                break;
            }
            prev = algo.chain_tokens(&prev, chunk);
            let start = i * cs;
            let end = start + chunk.len();
            if end <= skip {
                continue;
            }
            spans.push(ChunkSpan {
                start,
                end,
                key: CacheKey::new(self.scope.clone(), prev),
            });
        }
        Ok(spans)
    }

    /// Chunk spans from block hashes the engine already computed (one per full engine block of
    /// `block_size` tokens, in order), instead of re-hashing token ids.
    ///
    /// `chunk_size` must be a multiple of `block_size`; each chunk chains the hashes of its
    /// blocks. Chunks ending at or before `skip_tokens` are omitted. A trailing group with fewer
    /// blocks than a chunk is a partial chunk, returned only with `save_unfull_chunk`.
    pub fn process_block_hashes<B: AsRef<[u8]>>(
        &self,
        block_hashes: &[B],
        block_size: usize,
        skip_tokens: usize,
    ) -> Result<Vec<ChunkSpan>, TokenError> {
        let cs = self.config.chunk_size;
        if block_size == 0 || !cs.is_multiple_of(block_size) {
            return Err(TokenError::ChunkNotBlockAligned {
                chunk_size: cs,
                block_size,
            });
        }
        let per_chunk = cs / block_size;
        let algo = self.config.hash_algorithm;
        let mut spans = Vec::with_capacity(block_hashes.len() / per_chunk + 1);
        let mut prev = self.root;
        for (i, group) in block_hashes.chunks(per_chunk).enumerate() {
            if group.len() < per_chunk && !self.config.save_unfull_chunk {
                break;
            }
            prev = algo.chain_blocks(&prev, group);
            let start = i * cs;
            let end = start + group.len() * block_size;
            if end <= skip_tokens {
                continue;
            }
            spans.push(ChunkSpan {
                start,
                end,
                key: CacheKey::new(self.scope.clone(), prev),
            });
        }
        Ok(spans)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db(chunk_size: usize, save_unfull_chunk: bool) -> ChunkedTokenDatabase {
        let config = ChunkingConfig {
            chunk_size,
            save_unfull_chunk,
            ..Default::default()
        };
        ChunkedTokenDatabase::new(config, KeyScope::new("m", 1, 0, 0, 7).unwrap()).unwrap()
    }

    fn ranges(spans: &[ChunkSpan]) -> Vec<(usize, usize)> {
        spans.iter().map(|s| (s.start, s.end)).collect()
    }

    #[test]
    fn partial_chunk_only_with_save_unfull() {
        let tokens: Vec<u32> = (0..10).collect();
        assert_eq!(
            ranges(&db(4, false).process_tokens(&tokens, None).unwrap()),
            [(0, 4), (4, 8)]
        );
        assert_eq!(
            ranges(&db(4, true).process_tokens(&tokens, None).unwrap()),
            [(0, 4), (4, 8), (8, 10)]
        );
    }

    #[test]
    fn prefix_keys_are_shared_and_diverge_after_a_difference() {
        let d = db(4, false);
        let a: Vec<u32> = (0..12).collect();
        let mut b = a.clone();
        b[5] = 999;
        let ka = d.process_tokens(&a, None).unwrap();
        let kb = d.process_tokens(&b, None).unwrap();
        assert_eq!(ka[0].key, kb[0].key);
        assert_ne!(ka[1].key, kb[1].key);
        // The chain makes the third chunk differ although its own tokens are equal.
        assert_ne!(ka[2].key, kb[2].key);
    }

    #[test]
    fn extra_keys_separate_every_chunk_and_empty_extra_keys_change_nothing() {
        let d = db(4, false);
        let tokens: Vec<u32> = (0..8).collect();
        let plain = d.process_tokens(&tokens, None).unwrap();
        assert_eq!(
            d.process_tokens_with_extra(&tokens, None, b"").unwrap(),
            plain
        );
        let lora = d
            .process_tokens_with_extra(&tokens, None, b"lora:7")
            .unwrap();
        let salt = d
            .process_tokens_with_extra(&tokens, None, b"salt:x")
            .unwrap();
        for i in 0..2 {
            assert_ne!(lora[i].key, plain[i].key);
            assert_ne!(lora[i].key, salt[i].key);
        }
    }

    #[test]
    fn mask_skips_whole_chunks_in_the_prefix_and_keeps_straddling_ones() {
        let d = db(4, false);
        let tokens: Vec<u32> = (0..12).collect();
        let all = d.process_tokens(&tokens, None).unwrap();
        let mut mask = vec![true; 12];
        mask[..6].iter_mut().for_each(|m| *m = false);
        let masked = d.process_tokens(&tokens, Some(&mask)).unwrap();
        assert_eq!(ranges(&masked), [(4, 8), (8, 12)]);
        assert_eq!(masked[0].key, all[1].key, "keys do not depend on the mask");
    }

    #[test]
    fn bad_masks_are_rejected() {
        let d = db(4, false);
        let tokens: Vec<u32> = (0..8).collect();
        assert!(matches!(
            d.process_tokens(&tokens, Some(&[true; 7])),
            Err(TokenError::MaskLength { mask: 7, tokens: 8 })
        ));
        let mut mask = vec![true; 8];
        mask[3] = false;
        assert!(matches!(
            d.process_tokens(&tokens, Some(&mask)),
            Err(TokenError::MaskNotPrefix { index: 3 })
        ));
    }

    #[test]
    fn block_hash_entry_point_groups_blocks() {
        let d = db(4, false);
        let blocks: Vec<[u8; 8]> = (0..5u64).map(|i| i.to_le_bytes()).collect();
        let spans = d.process_block_hashes(&blocks, 2, 0).unwrap();
        assert_eq!(ranges(&spans), [(0, 4), (4, 8)]);
        let with_tail = db(4, true).process_block_hashes(&blocks, 2, 0).unwrap();
        assert_eq!(ranges(&with_tail), [(0, 4), (4, 8), (8, 10)]);
        assert_eq!(
            ranges(&d.process_block_hashes(&blocks, 2, 4).unwrap()),
            [(4, 8)]
        );
        assert!(d.process_block_hashes(&blocks, 3, 0).is_err());
    }

    #[test]
    fn zero_chunk_size_is_a_config_error() {
        let config = ChunkingConfig {
            chunk_size: 0,
            ..Default::default()
        };
        assert!(
            ChunkedTokenDatabase::new(config, KeyScope::new("m", 1, 0, 0, 0).unwrap()).is_err()
        );
    }
}
