//! The per-step metadata from scheduler to worker: serde types and a compact, validated encoding.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Encoding version, the first byte of every encoded metadata.
pub const METADATA_VERSION: u8 = 2;

/// Tokens to load into the GPU for one request: `[gpu_cached_tokens, load_until)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadSpec {
    /// Tokens the GPU prefix cache already holds (never written).
    pub gpu_cached_tokens: u32,
    /// End of the range the pool holds (a chunk boundary; always below the prompt length).
    pub load_until: u32,
}

/// Tokens to save from the GPU for one request: the chunks covering `[save_from, save_until)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SaveSpec {
    /// First token not saved before (a chunk boundary).
    pub save_from: u32,
    /// End of the computed tokens to save.
    pub save_until: u32,
}

/// What the worker does for one request this step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReqMeta {
    /// The engine's request id.
    pub req_id: String,
    /// Chain hashes of the chunks covering tokens `0..n` (the last may be partial), computed
    /// once by the scheduler; with the worker's key scope they are the chunks' keys. Extra
    /// keys (LoRA, multimodal hashes, cache salt) are already part of them.
    pub chunk_hashes: Vec<[u8; 16]>,
    /// The GPU slot of each token `0..n` the load and save below need
    /// (`block_id * block_size + offset`).
    pub slot_mapping: Vec<i64>,
    /// Load, if any.
    pub load: Option<LoadSpec>,
    /// Save, if any.
    pub save: Option<SaveSpec>,
}

/// Everything the worker must do in one engine step. Crosses a process boundary every step.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectorMetadata {
    /// The scheduler's probe hash (see [`crate::probe_hash`]): a worker that derives another
    /// one would compute different keys, so it refuses the metadata.
    pub probe_hash: [u8; 16],
    /// Per-request work.
    pub requests: Vec<ReqMeta>,
    /// Lazy offload: chunks of cached prefixes whose GPU blocks are about to be reused. Saved
    /// at the start of the step, before any load or compute writes those blocks.
    pub evictions: Vec<ReqMeta>,
    /// GPU blocks of promised loads the scheduler could not plan: the worker reports them as
    /// load errors so the engine recomputes them instead of trusting them.
    pub unloadable_blocks: Vec<u32>,
}

/// Metadata that cannot be used.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum MetadataError {
    /// Empty input.
    #[error("connector metadata is empty")]
    Empty,
    /// Another encoding version.
    #[error(
        "connector metadata version {0} is not supported (this build reads {METADATA_VERSION})"
    )]
    Version(u8),
    /// The bytes do not decode (truncated or corrupt).
    #[error("connector metadata does not decode: {0}")]
    Decode(String),
    /// Decoded, but inconsistent.
    #[error("connector metadata for request `{req_id}` is inconsistent: {reason}")]
    Invalid {
        /// The request.
        req_id: String,
        /// What is wrong.
        reason: String,
    },
    /// Scheduler and worker derive different keys.
    #[error(
        "scheduler and worker disagree on key derivation (probe hash {scheduler} vs {worker}): check model name, TP world size/rank, layout, chunk size and hash algorithm on every process"
    )]
    ProbeMismatch {
        /// Scheduler's probe hash (hex).
        scheduler: String,
        /// Worker's probe hash (hex).
        worker: String,
    },
}

impl ConnectorMetadata {
    /// Version byte followed by the postcard encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![METADATA_VERSION];
        out.extend(postcard::to_stdvec(self).expect("metadata serialises"));
        out
    }

    /// Decodes and validates; never panics on untrusted or truncated input.
    pub fn decode(bytes: &[u8]) -> Result<Self, MetadataError> {
        let (&version, body) = bytes.split_first().ok_or(MetadataError::Empty)?;
        if version != METADATA_VERSION {
            return Err(MetadataError::Version(version));
        }
        let (meta, rest): (ConnectorMetadata, &[u8]) =
            postcard::take_from_bytes(body).map_err(|e| MetadataError::Decode(e.to_string()))?;
        if !rest.is_empty() {
            return Err(MetadataError::Decode(format!(
                "{} trailing bytes",
                rest.len()
            )));
        }
        meta.validate()?;
        Ok(meta)
    }

    /// Checks ranges and lengths.
    pub fn validate(&self) -> Result<(), MetadataError> {
        let mut seen = HashSet::new();
        if let Some(r) = self
            .evictions
            .iter()
            .find(|r| r.load.is_some() || r.save.is_none())
        {
            return Err(MetadataError::Invalid {
                req_id: r.req_id.clone(),
                reason: "an eviction must be a save and nothing else".into(),
            });
        }
        for r in self.requests.iter().chain(&self.evictions) {
            let bad = |reason: String| MetadataError::Invalid {
                req_id: r.req_id.clone(),
                reason,
            };
            if !seen.insert(&r.req_id) {
                return Err(bad("listed twice".into()));
            }
            let n = r.slot_mapping.len();
            if n > 0 && r.chunk_hashes.is_empty() {
                return Err(bad(format!("{n} tokens without chunk hashes")));
            }
            if let Some(l) = r.load
                && (l.gpu_cached_tokens > l.load_until || l.load_until as usize > n)
            {
                return Err(bad(format!(
                    "load {}..{} outside {n} tokens",
                    l.gpu_cached_tokens, l.load_until
                )));
            }
            if let Some(s) = r.save
                && (s.save_from > s.save_until || s.save_until as usize > n)
            {
                return Err(bad(format!(
                    "save {}..{} outside {n} tokens",
                    s.save_from, s.save_until
                )));
            }
            if r.slot_mapping.iter().any(|&s| s < 0) {
                return Err(bad("negative slot".into()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> ConnectorMetadata {
        ConnectorMetadata {
            probe_hash: [3; 16],
            requests: vec![ReqMeta {
                req_id: "req-a".into(),
                chunk_hashes: vec![[1; 16], [2; 16]],
                slot_mapping: (16..24).collect(),
                load: Some(LoadSpec {
                    gpu_cached_tokens: 0,
                    load_until: 4,
                }),
                save: Some(SaveSpec {
                    save_from: 4,
                    save_until: 8,
                }),
            }],
            evictions: vec![],
            unloadable_blocks: vec![7],
        }
    }

    #[test]
    fn round_trips() {
        let m = sample();
        assert_eq!(ConnectorMetadata::decode(&m.encode()).unwrap(), m);
    }

    #[test]
    fn inconsistent_metadata_is_rejected() {
        let mut m = sample();
        m.requests[0].chunk_hashes.clear();
        assert!(matches!(
            ConnectorMetadata::decode(&m.encode()),
            Err(MetadataError::Invalid { .. })
        ));
        let mut m = sample();
        m.requests[0].load = Some(LoadSpec {
            gpu_cached_tokens: 0,
            load_until: 9,
        });
        assert!(ConnectorMetadata::decode(&m.encode()).is_err());
        let mut m = sample();
        m.requests.push(m.requests[0].clone());
        assert!(ConnectorMetadata::decode(&m.encode()).is_err());
        assert_eq!(ConnectorMetadata::decode(&[]), Err(MetadataError::Empty));
        assert_eq!(
            ConnectorMetadata::decode(&[9, 0]),
            Err(MetadataError::Version(9))
        );
    }

    proptest! {
        #[test]
        fn truncation_is_an_error(cut in 0usize..64) {
            let bytes = sample().encode();
            let cut = cut.min(bytes.len() - 1);
            prop_assert!(ConnectorMetadata::decode(&bytes[..cut]).is_err());
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = ConnectorMetadata::decode(&bytes);
        }
    }
}
