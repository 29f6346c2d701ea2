//! A copy job's end: a load's blocks become the engine's (or are reported failed), a save's
//! chunks are staged until their step is committed, and committed chunks are stored.

use std::collections::HashMap;
use std::time::Instant;

use kvpool_core::telemetry;
use kvpool_core::{Chunk, ChunkMeta, SaveSlot};
use tracing::warn;

use super::copy_check_thread::{CheckVerdict, CheckingLoad};
use super::copy_job::{JobMemory, SaveDestination};
use super::planning::SAVE_SLOT_BUDGET;
use super::staged::{StagedChunk, StagedValue};
use super::{ConnectorWorker, CopyDirection, InFlight, LentChunkCheck, STAGED_STEP_TTL};

/// A request's chunks ready to store: through L1, and sealed in places node memory lent.
type ReadyToStore = (Vec<(kvpool_core::CacheKey, Chunk)>, Vec<SaveSlot>);

impl ConnectorWorker {
    /// The engine side finished job `id` (`ok`: the copy happened; else it failed and the
    /// job's blocks hold nothing usable). A load's blocks are then the engine's; a save's
    /// chunks are staged until their step is committed.
    pub fn copy_done(&mut self, id: u64, ok: bool) {
        let Some(f) = self.in_flight.remove(&id) else {
            warn!(job = id, "copy_done for an unknown job");
            return;
        };
        metrics::gauge!(telemetry::COPY_JOBS_IN_FLIGHT).set(self.in_flight.len() as f64);
        match f.direction {
            CopyDirection::Load => self.load_copied(f, ok),
            CopyDirection::Save => {
                let step = f.step;
                let chunks = if ok {
                    let chunks = self.stage_copied(f);
                    self.stats.saved_tokens +=
                        chunks.iter().map(|c| c.value.tokens() as u64).sum::<u64>();
                    chunks
                } else {
                    self.save_failed(&f.req_id, "the engine's copy failed");
                    Vec::new()
                };
                self.staged.copy_ended(step, chunks);
                self.store_ready();
            }
        }
    }

    /// The chunks a save job copied, to stage until its step is committed: a buffer as it
    /// is; a place in node memory sealed first, its checksum hashed from the engine's blocks
    /// the chunk came from, or from the chunk's staged copy. A place that cannot be sealed (its loan ran out before the copy
    /// ended, or a block is out of range) is given back, and the job's later chunks with it.
    fn stage_copied(&mut self, f: InFlight) -> Vec<StagedChunk> {
        let JobMemory::Save(destinations) = f.memory else {
            unreachable!("a save job owns save destinations")
        };
        let layout = *self.engine.layout();
        let fingerprint = layout.fingerprint();
        let mut blocks = f.blocks.as_slice();
        let mut staged = Vec::with_capacity(f.spans.len());
        for (span, destination) in f.spans.into_iter().zip(destinations) {
            let meta = ChunkMeta {
                layout_fingerprint: fingerprint,
                dtype: layout.dtype,
                token_count: span.len() as u32,
            };
            let (own, rest) = blocks.split_at((span.len() / self.block_size).min(blocks.len()));
            blocks = rest;
            let value = match destination {
                SaveDestination::Memory(buf) => StagedValue::Memory(Chunk {
                    meta,
                    data: buf.freeze(),
                }),
                SaveDestination::Slot(mut slot, staged) => {
                    let sealed = match (&staged, &self.host_planes) {
                        _ if !slot.usable() => {
                            Err("its loan ran out before the copy ended".to_string())
                        }
                        (Some(copy), _) => slot
                            .seal(&meta, [copy.as_slice()])
                            .map_err(|e| e.to_string()),
                        (None, Some(planes)) => planes.seal(&mut slot, &meta, own),
                        (None, None) => {
                            Err("the engine's blocks are not in host memory".to_string())
                        }
                    };
                    if let Err(why) = sealed {
                        warn!(req = %f.req_id, key = %span.key, "a save copied into node memory could not be sealed; dropping it and the rest of the job");
                        self.save_failed(&f.req_id, &why);
                        break;
                    }
                    StagedValue::Slot(slot)
                }
            };
            staged.push(StagedChunk {
                req_id: f.req_id.clone(),
                end: span.end as u32,
                key: span.key,
                value,
            });
        }
        staged
    }

    /// A load job's copy ended. Chunks copied straight from node memory are checked (in the
    /// engine's blocks, or in the engine side's staged copies) on the worker's
    /// [`super::copy_check_thread::CopyChecker`] thread, while the engine runs the step's forward
    /// pass; the job ends once [`ConnectorWorker::settle_checks`] has their outcome. Every
    /// other load ends now.
    fn load_copied(&mut self, mut f: InFlight, ok: bool) {
        if !ok || f.checks.is_empty() {
            return self.finish_load(f, ok, &[], CheckVerdict::Verified);
        }
        let checks = std::mem::take(&mut f.checks);
        let Some(checker) = &self.copy_checker else {
            // Never planned so (only a worker with a checker copies from node memory where it
            // lies), and never trusted unchecked.
            let unchecked = CheckVerdict::Unchecked("no thread checks copies".to_string());
            return self.finish_load(f, ok, &checks, unchecked);
        };
        let (req_id, blocks, asynchronous) = (f.req_id.clone(), f.blocks.clone(), f.asynchronous);
        let checked = checker.check(f, checks);
        self.checking.push(CheckingLoad {
            req_id,
            blocks,
            asynchronous,
            checked,
        });
    }

    /// Waits for the checks of loads copied from node memory (see
    /// [`ConnectorWorker::load_copied`]) and ends their jobs: failed blocks are then known.
    /// Every entry point vLLM calls after the forward pass runs it first, so a step's
    /// failed blocks are reported in the step that loaded them, as vLLM requires to drop
    /// what the step computed from them.
    pub(super) fn settle_checks(&mut self) {
        for c in std::mem::take(&mut self.checking) {
            match c.checked.recv() {
                Ok(c) => self.finish_load(c.job, true, &c.checks, c.verdict),
                Err(_) => {
                    // The job is lost with the thread (it could not be kept alive): its
                    // blocks were never checked, so none of them is KV.
                    warn!(req = %c.req_id, "a load's check did not end; reporting its blocks");
                    self.fail_blocks_of(&c.req_id, &c.blocks);
                    if c.asynchronous {
                        self.async_loads.finish(&c.req_id);
                        self.finished_recving.push(c.req_id);
                    }
                }
            }
        }
    }

    /// Ends a load job: its blocks are the engine's, but those the `verdict` on its `checks`
    /// (the job's chunks copied from node memory) fails, which are reported failed; or all
    /// of them if the copy itself failed (`!ok`).
    fn finish_load(
        &mut self,
        mut f: InFlight,
        ok: bool,
        checks: &[LentChunkCheck],
        verdict: CheckVerdict,
    ) {
        if ok {
            self.apply_checks(&mut f, checks, verdict);
            self.stats.loaded_tokens += f.tokens as u64;
            metrics::counter!(telemetry::CONNECTOR_LOADED_TOKENS).increment(f.tokens as u64);
            if let Some(t) = self.traces.of(&f.req_id) {
                t.loaded_tokens += f.tokens as u64;
                for (tier, tokens) in &f.tier_tokens {
                    t.add_tier_tokens(tier, *tokens as u64);
                }
            }
        } else {
            warn!(req = %f.req_id, "copying a load into the engine failed; reporting its blocks");
            self.fail_blocks_of(&f.req_id, &f.blocks);
        }
        if f.asynchronous {
            self.async_loads.finish(&f.req_id);
            self.finished_recving.push(f.req_id);
        }
    }

    /// Applies the verdict on a load's chunks lent by node memory (checked in the engine's
    /// blocks, [`super::HostPlanes`], or in staged copies): the chunks before the first that
    /// failed count as loaded from node memory; from its first block on, every block of the
    /// job is reported failed, and the job counts only what came before. A chunk whose copy did not match its checksum is
    /// deleted from the pool; copies left unchecked blame no chunk.
    fn apply_checks(&mut self, f: &mut InFlight, checks: &[LentChunkCheck], verdict: CheckVerdict) {
        let passed = match &verdict {
            CheckVerdict::Verified => checks.len(),
            CheckVerdict::Mismatch { index, .. } => *index,
            CheckVerdict::Unchecked(_) => 0,
        };
        for check in &checks[..passed.min(checks.len())] {
            let tokens = (check.blocks.len() * self.block_size) as u64;
            self.stats.node_memory_tokens += tokens;
            if matches!(check.site, super::CheckSite::Staged(_)) {
                self.stats.node_memory_staged_tokens += tokens;
            }
        }
        let failed_from = match verdict {
            CheckVerdict::Verified => return,
            CheckVerdict::Unchecked(why) => {
                warn!(req = %f.req_id, error = %why, "a load's copies from node memory could not be checked; reporting their blocks");
                checks.first()
            }
            CheckVerdict::Mismatch { index, why } => {
                let check = checks.get(index);
                let key = check.map(|c| c.key.to_string()).unwrap_or_default();
                warn!(req = %f.req_id, key = %key, error = %why, "a chunk copied from node memory failed its check; reporting its blocks and dropping node memory's copy");
                metrics::counter!(telemetry::COPY_CHECK_FAILURES).increment(1);
                if let Some(check) = check {
                    // A miss, and node memory's copy dropped (the next read promotes it again
                    // from the daemon's lower tiers, checked there). Never the lower tiers':
                    // a stray write into node memory must not cost the durable copies.
                    self.runtime.block_on(
                        self.engine
                            .storage()
                            .remove_from_node_memory(std::slice::from_ref(&check.key)),
                    );
                }
                check
            }
        };
        // From the failed chunk's first block on; every block when there is none to point at.
        let first = failed_from
            .and_then(|c| c.blocks.first())
            .and_then(|b| f.blocks.iter().position(|x| x == b));
        let failed_blocks = f.blocks.split_off(first.unwrap_or(0));
        let kept = f.blocks.len() * self.block_size;
        self.fail_blocks_of(&f.req_id, &failed_blocks);
        f.tokens = f.tokens.min(kept);
        f.tier_tokens.clear();
    }

    /// Stores the staged chunks of committed steps (L1 now, lower tiers behind).
    pub(super) fn store_ready(&mut self) {
        let ready = self.staged.take_ready(STAGED_STEP_TTL);
        self.stats.saves_discarded = self.staged.discarded();
        if ready.is_empty() {
            return;
        }
        let mut by_req: HashMap<String, ReadyToStore> = HashMap::new();
        for c in ready {
            let (memory, slots) = by_req.entry(c.req_id).or_default();
            match c.value {
                StagedValue::Memory(chunk) => memory.push((c.key, chunk)),
                StagedValue::Slot(slot) => slots.push(slot),
            }
        }
        let mut lent: Vec<SaveSlot> = Vec::new();
        let mut lent_tokens: Vec<(String, usize)> = Vec::new();
        for (req, (memory, slots)) in by_req {
            if !slots.is_empty() {
                let tokens = slots
                    .iter()
                    .filter_map(|s| s.sealed())
                    .map(|m| m.token_count as usize)
                    .sum();
                lent_tokens.push((req.clone(), tokens));
                lent.extend(slots);
            }
            if memory.is_empty() {
                continue;
            }
            let started = Instant::now();
            let tokens: usize = memory
                .iter()
                .map(|(_, c)| c.meta.token_count as usize)
                .sum();
            match self.runtime.block_on(self.engine.storage().put(memory)) {
                Ok(outcome) => {
                    let stored = if outcome.skipped == 0 { tokens } else { 0 };
                    self.count_stored(&req, stored, started);
                }
                Err(e) => self.save_failed(&req, &e.to_string()),
            }
        }
        if !lent.is_empty() {
            self.commit_lent(lent, lent_tokens);
        }
    }

    /// Commits the step's saves sealed in places node memory lent, in one call waited for at
    /// most [`SAVE_SLOT_BUDGET`] (on the step's path: a call still running then goes on
    /// behind, uncounted). `tokens` are each request's share.
    fn commit_lent(&mut self, slots: Vec<SaveSlot>, tokens: Vec<(String, usize)>) {
        let started = Instant::now();
        let storage = self.engine.storage();
        let committed = self.runtime.block_on(async {
            tokio::time::timeout(SAVE_SLOT_BUDGET, storage.commit_save_slots(slots)).await
        });
        match committed {
            Ok(Ok(outcome)) if outcome.skipped == 0 => {
                for (req, stored) in tokens {
                    self.stats.node_memory_saved_tokens += stored as u64;
                    self.count_stored(&req, stored, started);
                }
            }
            Ok(Ok(outcome)) => {
                warn!(
                    skipped = outcome.skipped,
                    stored = outcome.stored,
                    "node memory did not store every save copied into it (a loan ran out, or the daemon restarted)"
                );
                for (req, _) in tokens {
                    self.save_failed(&req, "node memory did not commit the step's saves");
                }
            }
            Ok(Err(e)) => {
                for (req, _) in tokens {
                    self.save_failed(&req, &e.to_string());
                }
            }
            Err(_) => warn!(
                "committing saves into node memory took longer than {SAVE_SLOT_BUDGET:?}; it goes on behind, uncounted"
            ),
        }
    }

    /// Counts `stored` tokens of `req` as stored into the pool.
    fn count_stored(&mut self, req: &str, stored: usize, started: Instant) {
        self.engine.record_stored(stored);
        self.stats.stored_tokens += stored as u64;
        metrics::counter!(telemetry::CONNECTOR_STORED_TOKENS).increment(stored as u64);
        if let Some(t) = self.traces.of(req) {
            t.stored_tokens += stored as u64;
            t.store_time += started.elapsed();
        }
    }

    /// Counts a save that stored nothing, for the request's trace and the logs.
    pub(super) fn save_failed(&mut self, req: &str, why: &str) {
        self.stats.save_errors += 1;
        if let Some(t) = self.traces.of(req) {
            t.save_errors += 1;
        }
        warn!(req = %req, error = %why, "save failed (the chunks will be missing from the pool)");
    }
}
