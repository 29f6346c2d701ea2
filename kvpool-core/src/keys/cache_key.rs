//! Cache keys: model, parallel ranks, layout fingerprint and chunk hash, in text and binary form.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::error::{KeyParseError, LayoutError};
use crate::keys::chunk_hash::ChunkHash;

/// Longest model name a key can hold (the binary key form stores its length in 16 bits, and two
/// names must never share a key by being cut to the same prefix).
pub const MAX_MODEL_NAME_BYTES: usize = 4096;

/// Everything about *who* wrote a chunk: two scopes never share bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyScope {
    /// Model name (any text; may contain `@`).
    pub model: String,
    /// Tensor-parallel world size.
    pub world_size: u32,
    /// Tensor-parallel rank of the worker.
    pub rank: u32,
    /// Pipeline-parallel rank.
    pub pp_rank: u32,
    /// Fingerprint of the [`crate::KvLayout`].
    pub layout_fingerprint: u64,
}

impl KeyScope {
    /// A stable 64-bit digest of the whole scope (recorded in stored chunk headers, so a value
    /// read under another model, rank or layout is rejected): xxh3-64 of
    /// `b"kvpool.scope.v1" ‖ u32 LE model length ‖ model ‖ world, rank, pp (u32 LE) ‖
    /// fingerprint (u64 LE)`.
    pub fn digest(&self) -> u64 {
        let model = self.model.as_bytes();
        let mut buf = Vec::with_capacity(15 + 4 + model.len() + 12 + 8);
        buf.extend_from_slice(b"kvpool.scope.v1");
        buf.extend_from_slice(&(model.len() as u32).to_le_bytes());
        buf.extend_from_slice(model);
        buf.extend_from_slice(&self.world_size.to_le_bytes());
        buf.extend_from_slice(&self.rank.to_le_bytes());
        buf.extend_from_slice(&self.pp_rank.to_le_bytes());
        buf.extend_from_slice(&self.layout_fingerprint.to_le_bytes());
        xxhash_rust::xxh3::xxh3_64(&buf)
    }

    /// Builds a scope, checking `rank < world_size`.
    pub fn new(
        model: impl Into<String>,
        world_size: u32,
        rank: u32,
        pp_rank: u32,
        layout_fingerprint: u64,
    ) -> Result<Self, LayoutError> {
        if world_size == 0 || rank >= world_size {
            return Err(LayoutError::RankOutOfRange { rank, world_size });
        }
        let model = model.into();
        if model.len() > MAX_MODEL_NAME_BYTES {
            return Err(LayoutError::ModelNameTooLong {
                len: model.len(),
                max: MAX_MODEL_NAME_BYTES,
            });
        }
        Ok(KeyScope {
            model,
            world_size,
            rank,
            pp_rank,
            layout_fingerprint,
        })
    }
}

/// The storage key of one chunk.
///
/// Text form: `model@tp<world>@rank<r>@pp<p>@<fingerprint hex16>@<hash hex32>`.
///
/// ```
/// use kvpool_core::{CacheKey, ChunkHash, KeyScope};
/// let scope = KeyScope::new("llama-3-8b", 4, 1, 0, 0xabcd).unwrap();
/// let key = CacheKey::new(scope.into(), ChunkHash([7; 16]));
/// let text = key.to_string();
/// assert_eq!(text, "llama-3-8b@tp4@rank1@pp0@000000000000abcd@07070707070707070707070707070707");
/// assert_eq!(text.parse::<CacheKey>().unwrap(), key);
/// assert_eq!(CacheKey::from_bytes(&key.to_bytes()).unwrap(), key);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CacheKey {
    /// Who wrote it (shared between all keys of a pool).
    pub scope: Arc<KeyScope>,
    /// Which prefix chunk.
    pub hash: ChunkHash,
}

const BINARY_VERSION: u8 = 1;

impl CacheKey {
    /// Builds a key.
    pub fn new(scope: Arc<KeyScope>, hash: ChunkHash) -> Self {
        CacheKey { scope, hash }
    }

    /// Compact binary form: version, u16 model length, model, world, rank, pp (u32 LE each),
    /// fingerprint (u64 LE), 16 hash bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let model = self.scope.model.as_bytes();
        let mut out = Vec::with_capacity(1 + 2 + model.len() + 12 + 8 + 16);
        out.push(BINARY_VERSION);
        let len = u16::try_from(model.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&model[..len as usize]);
        out.extend_from_slice(&self.scope.world_size.to_le_bytes());
        out.extend_from_slice(&self.scope.rank.to_le_bytes());
        out.extend_from_slice(&self.scope.pp_rank.to_le_bytes());
        out.extend_from_slice(&self.scope.layout_fingerprint.to_le_bytes());
        out.extend_from_slice(&self.hash.0);
        out
    }

    /// Parses [`CacheKey::to_bytes`] output.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KeyParseError> {
        let mut rest = bytes;
        let mut take = |n: usize| -> Result<&[u8], KeyParseError> {
            if rest.len() < n {
                return Err(KeyParseError::Binary("truncated"));
            }
            let (head, tail) = rest.split_at(n);
            rest = tail;
            Ok(head)
        };
        if take(1)?[0] != BINARY_VERSION {
            return Err(KeyParseError::Binary("unknown version"));
        }
        let len = u16::from_le_bytes(take(2)?.try_into().expect("2 bytes")) as usize;
        let model = std::str::from_utf8(take(len)?)
            .map_err(|_| KeyParseError::Binary("model name is not UTF-8"))?
            .to_string();
        let u32_at = |b: &[u8]| u32::from_le_bytes(b.try_into().expect("4 bytes"));
        let world_size = u32_at(take(4)?);
        let rank = u32_at(take(4)?);
        let pp_rank = u32_at(take(4)?);
        let layout_fingerprint = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes"));
        let hash = ChunkHash(take(16)?.try_into().expect("16 bytes"));
        if !rest.is_empty() {
            return Err(KeyParseError::Binary("trailing bytes"));
        }
        Ok(CacheKey {
            scope: Arc::new(KeyScope {
                model,
                world_size,
                rank,
                pp_rank,
                layout_fingerprint,
            }),
            hash,
        })
    }
}

impl fmt::Display for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.scope;
        write!(
            f,
            "{}@tp{}@rank{}@pp{}@{:016x}@{}",
            s.model, s.world_size, s.rank, s.pp_rank, s.layout_fingerprint, self.hash
        )
    }
}

impl FromStr for CacheKey {
    type Err = KeyParseError;
    fn from_str(key: &str) -> Result<Self, Self::Err> {
        let bad = |reason| KeyParseError::Malformed {
            key: key.to_string(),
            reason,
        };
        let mut parts = key.rsplitn(6, '@');
        let hash = parts.next().ok_or_else(|| bad("missing hash"))?;
        let fp = parts.next().ok_or_else(|| bad("missing fingerprint"))?;
        let pp = parts.next().ok_or_else(|| bad("missing pp rank"))?;
        let rank = parts.next().ok_or_else(|| bad("missing rank"))?;
        let tp = parts.next().ok_or_else(|| bad("missing tp world size"))?;
        let model = parts.next().ok_or_else(|| bad("missing model"))?;
        let num = |s: &str, prefix: &str, what| -> Result<u32, KeyParseError> {
            s.strip_prefix(prefix)
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| bad(what))
        };
        let world_size = num(tp, "tp", "bad tp field")?;
        let rank = num(rank, "rank", "bad rank field")?;
        let pp_rank = num(pp, "pp", "bad pp field")?;
        if fp.len() != 16 {
            return Err(bad("fingerprint must be 16 hex digits"));
        }
        let layout_fingerprint =
            u64::from_str_radix(fp, 16).map_err(|_| bad("fingerprint is not hex"))?;
        if hash.len() != 32 {
            return Err(bad("hash must be 32 hex digits"));
        }
        let hash = u128::from_str_radix(hash, 16).map_err(|_| bad("hash is not hex"))?;
        Ok(CacheKey {
            scope: Arc::new(KeyScope {
                model: model.to_string(),
                world_size,
                rank,
                pp_rank,
                layout_fingerprint,
            }),
            hash: ChunkHash(hash.to_be_bytes()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_with_at_sign_round_trips() {
        let scope = KeyScope::new("org@model/v2", 2, 1, 3, u64::MAX).unwrap();
        let key = CacheKey::new(Arc::new(scope), ChunkHash([0xab; 16]));
        assert_eq!(key.to_string().parse::<CacheKey>().unwrap(), key);
    }

    #[test]
    fn malformed_text_keys_are_rejected() {
        for bad in [
            "",
            "m@tp4@rank1@pp0@00@0707",
            "m@tpx@rank1@pp0@000000000000abcd@07070707070707070707070707070707",
            "m@tp4@rank1@pp0@00000000000zabcd@07070707070707070707070707070707",
        ] {
            assert!(bad.parse::<CacheKey>().is_err(), "{bad}");
        }
    }

    #[test]
    fn truncated_binary_keys_are_rejected() {
        let key = CacheKey::new(
            Arc::new(KeyScope::new("m", 1, 0, 0, 1).unwrap()),
            ChunkHash([1; 16]),
        );
        let bytes = key.to_bytes();
        for cut in 0..bytes.len() {
            assert!(CacheKey::from_bytes(&bytes[..cut]).is_err());
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(CacheKey::from_bytes(&long).is_err());
    }

    #[test]
    fn model_names_too_long_for_a_key_are_refused_not_truncated() {
        let long = "m".repeat(MAX_MODEL_NAME_BYTES + 1);
        assert!(matches!(
            KeyScope::new(long, 1, 0, 0, 1),
            Err(LayoutError::ModelNameTooLong { .. })
        ));
        let longest = "m".repeat(MAX_MODEL_NAME_BYTES);
        let key = CacheKey::new(
            KeyScope::new(longest, 1, 0, 0, 1).unwrap().into(),
            ChunkHash([1; 16]),
        );
        assert_eq!(CacheKey::from_bytes(&key.to_bytes()).unwrap(), key);
    }

    #[test]
    fn rank_must_be_below_world_size() {
        assert!(KeyScope::new("m", 2, 2, 0, 0).is_err());
        assert!(KeyScope::new("m", 0, 0, 0, 0).is_err());
    }
}
