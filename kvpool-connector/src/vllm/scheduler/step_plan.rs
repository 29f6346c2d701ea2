//! One scheduled request's part of a step: the engine's new tokens and blocks taken in, its
//! pending load checked against its blocks, the chunks and tail blocks it saves, and the
//! [`ReqMeta`] the workers get.

use kvpool_core::HashAlgorithm;

use super::RequestTracker;
use super::chunk_tail::prompt_tail_range;
use super::engine_io::{BlockUpdate, ScheduledRequest};
use super::step_ledger::IssuedSave;
use crate::vllm::metadata::{LoadSpec, ReqMeta, SaveSpec};

/// The facts a step's plan needs from the scheduler (so a tracker can be borrowed mutably
/// beside them).
pub(super) struct StepPlanner<'a> {
    /// The step being planned.
    pub step: u64,
    /// Tokens per chunk.
    pub chunk_size: usize,
    /// Tokens per engine block.
    pub block_size: usize,
    /// Save decode tokens too, not only the prompt.
    pub save_decode_tokens: bool,
    /// The chain hash (for tail-block keys).
    pub hash_algorithm: &'a HashAlgorithm,
}

/// One request's part of a step's metadata, and the save it issues (for the step ledger).
pub(super) struct PlannedRequest {
    /// What the workers move for the request.
    pub meta: ReqMeta,
    /// The save the step issued, if any.
    pub issued_save: Option<IssuedSave>,
}

/// What a step saves of one request: the whole chunks, the prompt's tail blocks, and where
/// they start and end.
struct PlannedSave {
    spec: Option<SaveSpec>,
    tail: Vec<[u8; 16]>,
    tail_start: usize,
    /// The end of everything saved (chunks and tail), in tokens; 0 when nothing is.
    end: usize,
}

impl RequestTracker {
    /// Takes in what the engine scheduled for the request: its new tokens (unless they do
    /// not join ours, which stops saving decode tokens) and its block list's change.
    pub(super) fn take_scheduled(&mut self, s: &ScheduledRequest) {
        if !s.new_token_ids.is_empty() && !self.token_stream_broken {
            if s.new_tokens_start == self.token_ids.len() {
                self.token_ids.extend_from_slice(&s.new_token_ids);
                self.hasher.extend(&s.new_token_ids);
            } else {
                tracing::warn!(req = %s.req_id, ours = self.token_ids.len(), engine = s.new_tokens_start, "the engine's token sequence and ours diverged; no more decode tokens of this request are saved");
                self.token_stream_broken = true;
            }
        }
        match &s.blocks {
            BlockUpdate::Unchanged => {}
            BlockUpdate::Append(b) => self.block_ids.extend_from_slice(b),
            BlockUpdate::Replace(b) => self.block_ids = b.clone(),
        }
    }

    /// The hashes of the whole chunks covering tokens `0..until` (rounded up to a whole chunk
    /// when the tracker has its hash).
    pub(super) fn chunk_hashes_until(&self, until: usize, chunk_size: usize) -> Vec<[u8; 16]> {
        let n = until.div_ceil(chunk_size).min(self.hasher.hashes().len());
        self.hasher.hashes()[..n].iter().map(|h| h.0).collect()
    }
}

impl StepPlanner<'_> {
    /// Plans the step for one scheduled request whose tracker took in `s` already: `None`
    /// when nothing moves. A promised load the blocks do not cover is dropped, its blocks
    /// listed in `unloadable_blocks`, and counted in `broken_promises`.
    pub(super) fn plan(
        &self,
        s: &ScheduledRequest,
        t: &mut RequestTracker,
        unloadable_blocks: &mut Vec<u32>,
        broken_promises: &mut u64,
    ) -> Option<PlannedRequest> {
        let (load, load_tail) = self.take_load(s, t, unloadable_blocks, broken_promises);
        let computed = s.num_computed_tokens_after_step.min(t.token_ids.len());
        let save = self.plan_save(t, computed);
        let needed = load.map_or(0, |l| l.load_until as usize).max(save.end);
        if needed == 0 {
            return None;
        }
        let block_size = self.block_size;
        if t.block_ids.len() * block_size < needed {
            // Only a save can get here (loads were checked above): skipping it is a miss.
            tracing::warn!(req = %s.req_id, needed, blocks = t.block_ids.len(), "not enough blocks for the connector's save; skipping it");
            return None;
        }
        let blocks: Vec<u32> = t.block_ids[..needed.div_ceil(block_size)].to_vec();
        let issued_save = save.spec.map(|sv| {
            t.saved_tokens = sv.save_until as usize;
            t.tail_saved |= !save.tail.is_empty();
            t.save_steps.push(self.step);
            let from = if save.tail.is_empty() {
                sv.save_from as usize
            } else {
                (sv.save_from as usize).min(save.tail_start)
            };
            IssuedSave {
                req_id: s.req_id.clone(),
                from,
                until: save.end,
                blocks: blocks.clone(),
            }
        });
        let save_tail_start = if save.tail.is_empty() {
            save.spec.map_or(0, |s| s.save_until)
        } else {
            save.tail_start as u32
        };
        Some(PlannedRequest {
            meta: ReqMeta {
                req_id: s.req_id.clone(),
                chunk_hashes: t.chunk_hashes_until(needed, self.chunk_size),
                block_ids: blocks,
                load,
                save: save.spec,
                load_tail,
                save_tail_start,
                save_tail: save.tail,
            },
            issued_save,
        })
    }

    /// The request's pending load and its tail keys, taken from the tracker: dropped (and its
    /// blocks made unloadable) when the blocks do not cover it; made synchronous when the
    /// engine scheduled a request with an asynchronous load.
    fn take_load(
        &self,
        s: &ScheduledRequest,
        t: &mut RequestTracker,
        unloadable_blocks: &mut Vec<u32>,
        broken_promises: &mut u64,
    ) -> (Option<LoadSpec>, Vec<[u8; 16]>) {
        let Some(mut load) = t.load.take() else {
            return (None, Vec::new());
        };
        if !t.blocks_cover(&load, self.block_size) {
            t.fail_uncovered_load(&s.req_id, &load, self.block_size, unloadable_blocks);
            *broken_promises += 1;
            let cached_chunks = load.gpu_cached_tokens as usize / self.chunk_size;
            t.saved_tokens = t.saved_tokens.min(cached_chunks * self.chunk_size);
            t.tail_saved = false;
            return (None, Vec::new());
        }
        if load.asynchronous {
            // vLLM schedules a request only once its asynchronous load ended.
            tracing::warn!(req = %s.req_id, "a request with an asynchronous load was scheduled; loading it before the forward pass");
            load.asynchronous = false;
        }
        (Some(load), std::mem::take(&mut t.load_tail))
    }

    /// What this step saves of the request, `computed` tokens of it being computed by the
    /// step's end: the whole chunks since the last save (decode tokens only when asked and
    /// the token stream is whole), and the prompt's tail blocks once they are computed.
    fn plan_save(&self, t: &RequestTracker, computed: usize) -> PlannedSave {
        let chunk = self.chunk_size;
        let savable = if self.save_decode_tokens && !t.token_stream_broken {
            computed
        } else {
            computed.min(t.prompt_len)
        };
        let save_until = savable / chunk * chunk;
        let mut spec = (!t.skip_save && save_until > t.saved_tokens).then_some(SaveSpec {
            save_from: t.saved_tokens as u32,
            save_until: save_until as u32,
        });
        let saved_after = spec.map_or(t.saved_tokens, |s| s.save_until as usize);
        let tail = t.tail_to_save(
            self.hash_algorithm,
            chunk,
            self.block_size,
            saved_after,
            computed,
        );
        let tail_start = prompt_tail_range(t.prompt_len, chunk, self.block_size).0;
        if !tail.is_empty() {
            // The tail alone: an empty chunk range where the saved chunks end.
            spec.get_or_insert(SaveSpec {
                save_from: saved_after as u32,
                save_until: saved_after as u32,
            });
        }
        let chunks_end = spec.map_or(0, |s| s.save_until as usize);
        let end = if tail.is_empty() {
            chunks_end
        } else {
            chunks_end.max(tail_start + tail.len() * self.block_size)
        };
        PlannedSave {
            spec,
            tail,
            tail_start,
            end,
        }
    }
}
