//! The per-step metadata from scheduler to worker: serde types and a compact, validated encoding.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Encoding version, the first byte of every encoded metadata.
pub const METADATA_VERSION: u8 = 6;

/// Tokens to load into the engine's blocks for one request: `[gpu_cached_tokens, load_until)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadSpec {
    /// Tokens the engine's own prefix cache already holds (never written; a block boundary).
    pub gpu_cached_tokens: u32,
    /// End of the range the pool holds (a block boundary, always below the prompt length):
    /// whole chunks up to the chunk boundary at or below it, then
    /// [`ReqMeta::load_tail`]'s blocks.
    pub load_until: u32,
    /// Loaded in the background while other requests run: the engine waits for the request's
    /// id in `finished_recving` (vLLM's `WAITING_FOR_REMOTE_KVS`). Otherwise the load is in
    /// place before this step's forward pass.
    pub asynchronous: bool,
}

/// Tokens to save from the engine's blocks for one request: the chunks covering
/// `[save_from, save_until)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SaveSpec {
    /// First token not saved before (a chunk boundary).
    pub save_from: u32,
    /// End of the computed tokens to save (a chunk boundary).
    pub save_until: u32,
}

/// What the worker does for one request this step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReqMeta {
    /// The engine's request id.
    pub req_id: String,
    /// Chain hashes of the chunks covering tokens `0..n`, computed once by the scheduler; with
    /// the worker's key scope they are the chunks' keys. Extra keys (LoRA, multimodal hashes,
    /// cache salt) are already part of them.
    pub chunk_hashes: Vec<[u8; 16]>,
    /// The engine's blocks holding tokens `0..n`, in order (token `t` is in block
    /// `block_ids[t / block_size]`).
    pub block_ids: Vec<u32>,
    /// Load, if any.
    pub load: Option<LoadSpec>,
    /// Save, if any.
    pub save: Option<SaveSpec>,
    /// Tail-block keys of the load: one per block from the chunk boundary at or below
    /// `load_until` up to `load_until` (a prompt's whole blocks in the chunk its last token
    /// falls in are keyed per block, see [`kvpool_core::HashAlgorithm::chain_tail_blocks`]);
    /// empty when the load ends on a chunk boundary.
    pub load_tail: Vec<[u8; 16]>,
    /// Tail-block keys to save besides the save's whole chunks: one per block from
    /// `save_tail_start` on (the prompt's whole blocks in the chunk its last token falls in,
    /// saved once the prompt is computed).
    pub save_tail: Vec<[u8; 16]>,
    /// Where `save_tail`'s blocks begin: a chunk boundary at or below `save_until`. Below it
    /// when that chunk is saved whole as well (a prompt that ends on a chunk boundary: its
    /// last chunk's blocks but the last, keyed one by one, so a repeat of the prompt, which
    /// never loads its last token, is served to its last whole block).
    pub save_tail_start: u32,
}

/// Part of a step's staged saves that must never become visible: chunks of `req_id` saved
/// in `step` from token `keep_until` on were computed on top of a failed load (on some rank).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SaveDiscard {
    /// The step whose saves are cut.
    pub step: u64,
    /// The request.
    pub req_id: String,
    /// Chunks ending at or before this token are kept; later ones are dropped.
    pub keep_until: u32,
}

/// Everything the worker must do in one engine step. Crosses a process boundary every step.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectorMetadata {
    /// The scheduler's probe hash (see [`crate::probe_hash`]): a worker that derives another
    /// one would compute different keys, so it refuses the metadata.
    pub probe_hash: [u8; 16],
    /// The scheduler's step number (increasing by one per metadata built).
    pub step: u64,
    /// The engine's block size in tokens (the worker refuses another).
    pub block_size: u32,
    /// Per-request work.
    pub requests: Vec<ReqMeta>,
    /// Engine blocks of promised loads the scheduler could not plan: the worker reports them
    /// as load errors so the engine recomputes them instead of trusting them.
    pub unloadable_blocks: Vec<u32>,
    /// Cuts applied to staged saves before any commit below.
    pub discards: Vec<SaveDiscard>,
    /// Steps whose staged saves every rank executed with no failed load touching them: the
    /// worker stores them (L1, then write-behind). Until then a save is invisible.
    pub commit_steps: Vec<u64>,
    /// The worker commits this step's saves itself at the end of the step, cut where its own
    /// failed loads reach them: set when one rank runs the engine and the engine schedules
    /// synchronously (no later report can reach a step's saves), so saves are visible at once
    /// even when the engine stops stepping after them.
    pub commit_locally: bool,
    /// Finished requests whose blocks the engine holds until this worker reports them in
    /// `finished_sending` (once no copy reading their blocks is in flight).
    pub held_requests: Vec<String>,
    /// Requests that finished or were aborted since the last step: their lookup leases end and
    /// their pending loads are cancelled.
    pub ended_requests: Vec<String>,
    /// Requests preempted this step (their blocks are free again).
    pub preempted_requests: Vec<String>,
    /// The scheduler's own counters, published by TP rank 0's worker (the scheduler process
    /// serves no metrics).
    pub scheduler: SchedulerCounters,
}

/// Counters of the scheduler side, shipped to the workers every step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulerCounters {
    /// Lookups answered as misses because a rank's circuit breaker was open.
    pub breaker_misses: u64,
    /// Ranks whose breaker is open now.
    pub breakers_open: u32,
    /// Promised loads whose blocks never covered them.
    pub broken_promises: u64,
    /// Request states dropped at the cap.
    pub trackers_dropped: u64,
    /// Lookups (and presence checks) asked of every worker rank in the scheduler's own
    /// process, without a socket.
    pub lookups_in_process: u64,
    /// Lookups (and presence checks) sent to the worker ranks over their lookup sockets.
    pub lookups_over_sockets: u64,
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

    /// Checks ranges and lengths: every load and save lies inside the request's blocks and
    /// its chunk hashes, no request is listed twice.
    pub fn validate(&self) -> Result<(), MetadataError> {
        if self.block_size == 0 {
            return Err(MetadataError::Decode("block size 0".into()));
        }
        let mut seen = HashSet::new();
        for r in &self.requests {
            let bad = |reason: String| MetadataError::Invalid {
                req_id: r.req_id.clone(),
                reason,
            };
            if !seen.insert(&r.req_id) {
                return Err(bad("listed twice".into()));
            }
            let tokens = r.block_ids.len() * self.block_size as usize;
            let mut needed = 0;
            // Tokens moved as whole chunks (the rest are tail blocks, keyed by their own list).
            let mut needed_chunks = 0;
            if let Some(l) = r.load {
                if l.gpu_cached_tokens > l.load_until {
                    return Err(bad(format!(
                        "load {}..{} is reversed",
                        l.gpu_cached_tokens, l.load_until
                    )));
                }
                if r.load_tail.len() * self.block_size as usize > l.load_until as usize {
                    return Err(bad(format!(
                        "{} tail blocks past load end {}",
                        r.load_tail.len(),
                        l.load_until
                    )));
                }
                needed = l.load_until as usize;
                needed_chunks = needed - r.load_tail.len() * self.block_size as usize;
            } else if !r.load_tail.is_empty() {
                return Err(bad("tail blocks to load without a load".into()));
            }
            if let Some(s) = r.save {
                if s.save_from > s.save_until {
                    return Err(bad(format!(
                        "save {}..{} is reversed",
                        s.save_from, s.save_until
                    )));
                }
                if !r.save_tail.is_empty() {
                    if r.save_tail_start > s.save_until
                        || !r.save_tail_start.is_multiple_of(self.block_size)
                    {
                        return Err(bad(format!(
                            "tail blocks from {} past save end {} or off a block boundary",
                            r.save_tail_start, s.save_until
                        )));
                    }
                    let tail_end =
                        r.save_tail_start as usize + r.save_tail.len() * self.block_size as usize;
                    needed = needed.max(tail_end);
                }
                needed = needed.max(s.save_until as usize);
                needed_chunks = needed_chunks.max(s.save_until as usize);
            } else if !r.save_tail.is_empty() {
                return Err(bad("tail blocks to save without a save".into()));
            }
            if needed > tokens {
                return Err(bad(format!(
                    "{needed} tokens to move but {} blocks of {} tokens",
                    r.block_ids.len(),
                    self.block_size
                )));
            }
            if needed_chunks > 0 && r.chunk_hashes.is_empty() {
                return Err(bad(format!(
                    "{needed_chunks} tokens in whole chunks without chunk hashes"
                )));
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
            step: 7,
            block_size: 4,
            requests: vec![ReqMeta {
                req_id: "req-a".into(),
                chunk_hashes: vec![[1; 16], [2; 16]],
                block_ids: vec![4, 5],
                load: Some(LoadSpec {
                    gpu_cached_tokens: 0,
                    load_until: 4,
                    asynchronous: true,
                }),
                save: Some(SaveSpec {
                    save_from: 4,
                    save_until: 4,
                }),
                load_tail: vec![],
                save_tail: vec![[9; 16]],
                save_tail_start: 4,
            }],
            unloadable_blocks: vec![7],
            discards: vec![SaveDiscard {
                step: 5,
                req_id: "req-b".into(),
                keep_until: 4,
            }],
            commit_steps: vec![4, 5],
            commit_locally: false,
            held_requests: vec!["req-c".into()],
            ended_requests: vec!["req-d".into()],
            preempted_requests: vec![],
            scheduler: SchedulerCounters::default(),
        }
    }

    #[test]
    fn round_trips() {
        let m = sample();
        assert_eq!(ConnectorMetadata::decode(&m.encode()).unwrap(), m);
    }

    /// The fuzzer's seed (`fuzz/seeds/connector_metadata/one-request`) is [`sample`] in this
    /// build's version, so the fuzzer starts inside the decoder rather than at its version check.
    /// After a version change, `KVPOOL_BLESS=1 cargo test -p kvpool-connector fuzz_seed` rewrites it.
    #[test]
    fn the_fuzz_seed_is_the_sample_in_this_version() {
        let seed = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fuzz/seeds/connector_metadata/one-request");
        let expected = sample().encode();
        if std::env::var_os("KVPOOL_BLESS").is_some() {
            std::fs::write(&seed, &expected).unwrap();
        }
        let found = std::fs::read(&seed).unwrap();
        assert_eq!(
            ConnectorMetadata::decode(&found).map(|m| m == sample()),
            Ok(true),
            "{} is not this version's sample: rerun with KVPOOL_BLESS=1",
            seed.display()
        );
    }

    #[test]
    fn a_prompt_shorter_than_a_chunk_moves_tail_blocks_without_chunk_hashes() {
        let mut m = sample();
        let r = &mut m.requests[0];
        r.chunk_hashes.clear();
        r.load = None;
        r.save = Some(SaveSpec {
            save_from: 0,
            save_until: 0,
        });
        r.save_tail = vec![[9; 16], [8; 16]];
        r.save_tail_start = 0;
        assert_eq!(ConnectorMetadata::decode(&m.encode()).unwrap(), m);
    }

    #[test]
    fn a_tail_may_repeat_the_blocks_of_a_chunk_saved_whole() {
        let mut m = sample();
        let r = &mut m.requests[0];
        r.block_ids = vec![4, 5, 6, 7];
        r.save = Some(SaveSpec {
            save_from: 0,
            save_until: 8,
        });
        r.save_tail = vec![[9; 16]];
        r.save_tail_start = 0;
        assert_eq!(ConnectorMetadata::decode(&m.encode()).unwrap(), m);
        // Never past the save's end, nor off a block boundary.
        let mut past = m.clone();
        past.requests[0].save_tail_start = 12;
        assert!(ConnectorMetadata::decode(&past.encode()).is_err());
        let mut off = m.clone();
        off.requests[0].save_tail_start = 2;
        assert!(ConnectorMetadata::decode(&off.encode()).is_err());
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
            asynchronous: false,
        });
        assert!(ConnectorMetadata::decode(&m.encode()).is_err());
        let mut m = sample();
        // A tail block past the request's blocks.
        m.requests[0].save_tail.push([8; 16]);
        assert!(ConnectorMetadata::decode(&m.encode()).is_err());
        let mut m = sample();
        m.requests[0].save = None;
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
