//! Planning: which chunks and tail blocks a step's load or save covers (from the hashes the
//! scheduler shipped), and the copy jobs and in-flight records that move them.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvpool_core::{
    CacheKey, ChunkHash, ChunkSpan, LentSaveSlots, MemoryObj, MemoryObjMut, SharedChunk,
};
use tracing::warn;

use super::copy_job::{JobMemory, SaveDestination};
use super::loads::PlannedLoad;
use super::node_copies::{LoadSource, LoadSources, fetch_load};
use super::{CheckSite, ConnectorWorker, CopyDirection, CopyJob, InFlight, LentChunkCheck};
use crate::vllm::leases::LeasedChunk;
use crate::vllm::metadata::ReqMeta;

/// How long a step's saves wait for node memory in all, to learn what it holds and to lend
/// places for their chunks (round trips to the pool daemon, on the step's path), before they
/// go through L1 instead; and how long a step waits for node memory to commit what was copied
/// into its places.
pub(crate) const SAVE_SLOT_BUDGET: Duration = Duration::from_millis(100);

impl ConnectorWorker {
    /// The spans of `r` covering tokens `from..until` (from the hashes the scheduler shipped;
    /// no token is hashed here): its whole chunks up to `until - tail.len() * block_size` (a
    /// chunk boundary), then one span per tail block. Spans ending at or before `from` are
    /// left out; the first may start before it (a load skips the blocks the engine holds).
    pub(super) fn spans(
        &self,
        r: &ReqMeta,
        from: usize,
        until: usize,
        tail: &[[u8; 16]],
    ) -> Result<Vec<ChunkSpan>, String> {
        let (cs, bs) = (self.chunk_size(), self.block_size);
        let tail_tokens = tail.len() * bs;
        let bad = || {
            format!(
                "{} chunk hashes and {} tail blocks do not cover tokens {from}..{until} in whole chunks and blocks",
                r.chunk_hashes.len(),
                tail.len()
            )
        };
        let Some(tail_start) = until
            .checked_sub(tail_tokens)
            .filter(|t| t.is_multiple_of(cs))
        else {
            return Err(bad());
        };
        let hashes: Vec<ChunkHash> = r.chunk_hashes.iter().map(|h| ChunkHash(*h)).collect();
        let db = self.engine.token_database();
        let mut spans = if from < tail_start {
            db.spans_from_hashes(&hashes, from, tail_start)
        } else {
            Vec::new()
        };
        if spans.iter().any(|s| s.len() != cs) {
            return Err(bad());
        }
        spans.extend(self.tail_spans(tail_start, tail).filter(|s| s.end > from));
        let contiguous = spans.windows(2).all(|w| w[0].end == w[1].start);
        let covered = spans.last().map_or(from, |s| s.end);
        if !contiguous || covered != until || spans.first().is_some_and(|s| s.start > from) {
            return Err(bad());
        }
        Ok(spans)
    }

    /// One span per tail-block key, the first starting at token `start`.
    fn tail_spans<'a>(
        &self,
        start: usize,
        tail: &'a [[u8; 16]],
    ) -> impl Iterator<Item = ChunkSpan> + 'a {
        let bs = self.block_size;
        let scope = self.engine.token_database().scope().clone();
        tail.iter().enumerate().map(move |(j, h)| ChunkSpan {
            start: start + j * bs,
            end: start + (j + 1) * bs,
            key: CacheKey::new(scope.clone(), ChunkHash(*h)),
        })
    }

    /// Bytes of one block of a chunk (every plane).
    pub(super) fn block_bytes(&self) -> usize {
        self.engine.layout().chunk_bytes(self.block_size)
    }

    pub(super) fn plan_load(&mut self, r: &ReqMeta, from: usize, until: usize, asynchronous: bool) {
        if until <= from {
            return;
        }
        self.stats.load_requested_tokens += (until - from) as u64;
        if let Some(t) = self.traces.of(&r.req_id) {
            t.load_requested_tokens += (until - from) as u64;
        }
        let spans = match self.spans(r, from, until, &r.load_tail) {
            Ok(spans) => spans,
            Err(e) => {
                warn!(req = %r.req_id, error = %e, "cannot plan a load; reporting its blocks");
                self.fail_tokens(&r.req_id, &r.block_ids, from, until);
                if asynchronous {
                    self.finished_recving.push(r.req_id.clone());
                }
                return;
            }
        };
        // The lease holds chunks from chunk 0, then the tail blocks; keep those of the
        // spans, matched by hash.
        let cs = self.chunk_size();
        let first = if spans[0].len() == cs {
            spans[0].start / cs
        } else {
            // The load starts among the tail blocks.
            spans[0].start / cs + (spans[0].start % cs) / self.block_size
        };
        let leased: Vec<LeasedChunk> = self
            .leases
            .take(&r.req_id)
            .map(|lease| {
                lease
                    .chunks
                    .into_iter()
                    .skip(first)
                    .zip(&spans)
                    .take_while(|((h, _), span)| *h == span.key.hash)
                    .map(|((_, c), _)| c)
                    .collect()
            })
            .unwrap_or_default();
        let load = PlannedLoad {
            req_id: r.req_id.clone(),
            block_ids: r.block_ids.clone(),
            gpu_cached_tokens: from,
            load_until: until,
            spans,
            leased,
        };
        if asynchronous {
            self.stats.async_loads += 1;
            let bytes = load.bytes(self.engine.layout().bytes_per_token());
            self.async_loads.push(load, bytes);
            self.async_loads
                .start_queued(self.limits, &self.engine, &self.runtime);
        } else {
            self.stats.sync_loads += 1;
            let started = Instant::now();
            let mut load = load;
            let leased = std::mem::take(&mut load.leased);
            let fetched = self
                .runtime
                .block_on(fetch_load(&self.engine, &load.spans, leased));
            if let Some(t) = self.traces.of(&r.req_id) {
                t.load_time += started.elapsed();
            }
            if let Some(job) = self.load_job(load, fetched, false) {
                self.planned_loads.push(job);
            }
        }
    }

    /// A chunk lent by node memory, copied into a buffer of this process (L1's pool, else
    /// the heap) and checked there: for a copy the worker cannot check in the engine's blocks.
    fn copy_into_memory(&self, chunk: &SharedChunk) -> Option<MemoryObj> {
        let mut buf = self.private_buffer(chunk.payload_len());
        match chunk.copy_into(buf.as_mut_slice()) {
            Ok(()) => Some(buf.freeze()),
            Err(e) => {
                warn!(error = %e, "a chunk lent by node memory failed its check; not loading it");
                metrics::counter!(kvpool_core::telemetry::COPY_CHECK_FAILURES).increment(1);
                None
            }
        }
    }

    /// The chunks of a load as the job copies them, and where each chunk lent by node memory
    /// is checked once copied. Such a chunk is copied once, from where it lies: checked in
    /// the engine's blocks where the worker reads them ([`super::HostPlanes`]) and the job
    /// copies the whole chunk (`whole(c)`; the first chunk may start past blocks the engine
    /// holds, whose bytes the check needs); else, where the engine side stages its copies
    /// ([`ConnectorWorker::check_staged_copies`]), in the staged copy, a buffer of this
    /// process's memory; otherwise it is copied into a buffer of this process first and
    /// checked there. Stops at the first chunk that fails.
    fn load_sources(
        &self,
        mut fetched: LoadSources,
        whole: impl Fn(usize) -> bool,
    ) -> (LoadSources, Vec<(usize, CheckSite)>) {
        let mut checked = Vec::new();
        for (c, source) in fetched.chunks.iter_mut().enumerate() {
            let LoadSource::Shared(chunk) = source else {
                continue;
            };
            if self.host_planes.is_some() && whole(c) {
                checked.push((c, CheckSite::Blocks));
                continue;
            }
            if self.checks_staged_copies {
                checked.push((
                    c,
                    CheckSite::Staged(self.private_buffer(chunk.payload_len())),
                ));
                continue;
            }
            match self.copy_into_memory(chunk) {
                Some(memory) => *source = LoadSource::Memory(memory),
                None => {
                    fetched.chunks.truncate(c);
                    fetched.tiers.truncate(c);
                    break;
                }
            }
        }
        (fetched, checked)
    }

    /// A buffer of `len` bytes of this process: from L1's pool (page-locked on a GPU), else
    /// the heap (counted in [`super::WorkerStats::heap_buffers`]; where the engine side stages
    /// its copies, said once per worker: a device's copy into heap memory waits for the device).
    fn private_buffer(&self, len: usize) -> MemoryObjMut {
        match self.engine.storage().allocate(len) {
            Ok(buf) => buf,
            Err(e) => {
                let before = self.heap_buffers.fetch_add(1, Ordering::Relaxed);
                if before == 0 && self.checks_staged_copies {
                    warn!(error = %e, len, "L1's pool has no room for a buffer of the worker's; \
                        taking it from the heap (correct, but a GPU copies into heap memory \
                        synchronously: give L1 more room than the step's loads and saves); \
                        counted in heap_buffers, said once");
                }
                MemoryObjMut::heap(len)
            }
        }
    }

    /// The copy job for what a fetch brought; reports the blocks it could not bring.
    pub(super) fn load_job(
        &mut self,
        load: PlannedLoad,
        fetched: LoadSources,
        asynchronous: bool,
    ) -> Option<(CopyJob, InFlight)> {
        let bs = self.block_size;
        let first_token = load.spans[0].start;
        let wanted = load.gpu_cached_tokens.max(first_token);
        let spans = &load.spans;
        let (fetched, checked) = self.load_sources(fetched, |c| {
            spans[c].start >= wanted && spans[c].end <= load.load_until
        });
        let fetched_spans = &load.spans[..fetched.chunks.len().min(load.spans.len())];
        let loaded_until = fetched_spans.last().map_or(first_token, |s| s.end);
        if loaded_until < load.load_until {
            warn!(req = %load.req_id, expected = load.load_until - wanted, loaded = loaded_until.saturating_sub(wanted), "load incomplete; reporting failed blocks");
            let from = loaded_until.max(wanted);
            self.fail_tokens(&load.req_id, &load.block_ids, from, load.load_until);
        }
        let end = loaded_until.min(load.load_until);
        if end <= wanted {
            return None;
        }
        let skip_blocks = (wanted - first_token) / bs;
        let blocks: Vec<u32> = load.block_ids[wanted / bs..end / bs].to_vec();
        let mut tier_tokens: Vec<(String, usize)> = Vec::new();
        for (span, tier) in fetched_spans.iter().zip(&fetched.tiers) {
            let start = span.start.max(wanted);
            kvpool_core::cache_engine::add_tier_tokens(&mut tier_tokens, tier, span.end - start);
        }
        let chunk_blocks: Vec<usize> = fetched_spans.iter().map(|s| s.len() / bs).collect();
        self.engine
            .record_retrieve(load.load_until - wanted, end - wanted);
        // The engine blocks the job copies each checked chunk into (all of the chunk's for a
        // check in the blocks: `load_sources` checked that the job copies all of it).
        let mut check_copy_ptrs = vec![0; fetched_spans.len()];
        let checks: Vec<LentChunkCheck> = checked
            .into_iter()
            .filter(|(c, _)| *c < fetched_spans.len())
            .map(|(c, mut site)| {
                let span = &fetched_spans[c];
                if let CheckSite::Staged(buf) = &mut site {
                    check_copy_ptrs[c] = buf.as_mut_slice().as_mut_ptr() as usize;
                }
                let (from, to) = (span.start.max(wanted) / bs, span.end.min(end) / bs);
                LentChunkCheck {
                    chunk: c,
                    key: span.key.clone(),
                    blocks: load.block_ids[from..to.max(from)].to_vec(),
                    site,
                }
            })
            .collect();
        self.loaded_from_node_memory
            .extend(checks.iter().map(|c| c.key.clone()));
        let mut chunks = fetched.chunks;
        chunks.truncate(fetched_spans.len());
        let mut memory = JobMemory::Load(chunks);
        let job = CopyJob {
            id: self.next_job_id(),
            direction: CopyDirection::Load,
            req_id: load.req_id.clone(),
            block_ids: blocks.clone(),
            skip_blocks,
            chunk_blocks,
            block_bytes: self.block_bytes(),
            chunk_ptrs: memory.pointers(),
            check_copy_ptrs,
            asynchronous,
        };
        Some((
            job,
            InFlight {
                direction: CopyDirection::Load,
                req_id: load.req_id,
                step: 0,
                memory,
                spans: Vec::new(),
                tokens: end - wanted,
                asynchronous,
                tier_tokens,
                blocks,
                checks,
            },
        ))
    }

    /// Plans a save of `r`'s whole chunks over tokens `from..until` (chunk boundaries), then
    /// of its tail blocks from `r.save_tail_start`, all of them (they may repeat the blocks of
    /// a chunk saved whole; see [`ReqMeta::save_tail_start`]).
    pub(super) fn plan_save(&mut self, r: &ReqMeta, step: u64, from: usize, until: usize) {
        let (cs, bs) = (self.chunk_size(), self.block_size);
        let tail_start = r.save_tail_start as usize;
        let mut spans = if from < until {
            match self.spans(r, from, until, &[]) {
                Ok(spans) => spans,
                Err(e) => {
                    self.save_failed(&r.req_id, &e);
                    return;
                }
            }
        } else {
            Vec::new()
        };
        if !r.save_tail.is_empty() {
            if !tail_start.is_multiple_of(cs) || tail_start > until {
                self.save_failed(
                    &r.req_id,
                    &format!("tail blocks from token {tail_start} are not in the saved chunks' last chunk"),
                );
                return;
            }
            spans.extend(self.tail_spans(tail_start, &r.save_tail));
        }
        if spans.is_empty() {
            return;
        }
        // A chunk with a null block (outside a sliding window) holds bytes that are not the
        // request's: the save stops before it.
        if let Some(first_null) = spans.iter().position(|s| {
            self.null_block.is_some()
                && r.block_ids
                    .get(s.start / bs..s.end / bs)
                    .is_none_or(|blocks| self.holds_null_block(blocks))
        }) {
            spans.truncate(first_null);
            if spans.is_empty() {
                return;
            }
        }
        let keys: Vec<_> = spans.iter().map(|s| s.key.clone()).collect();
        // Chunks L1 already holds were committed (nothing unverified is ever stored), and so
        // were those this step loads straight from node memory (if one's copy fails its
        // check, it is deleted, and its blocks recomputed and saved by a later step).
        let in_l1 = self
            .runtime
            .block_on(self.engine.storage().l1_prefix(&keys));
        let present = in_l1
            + keys[in_l1..]
                .iter()
                .take_while(|k| self.loaded_from_node_memory.contains(k))
                .count();
        let spans: Vec<ChunkSpan> = spans.into_iter().skip(present).collect();
        // In node memory already (a save through it skips those too), then places lent there.
        let lent = self.lend_save_slots(&spans);
        let mut slots = lent.slots.into_iter();
        let mut destinations: Vec<SaveDestination> = Vec::new();
        let mut kept = Vec::new();
        for span in spans.into_iter().skip(lent.stored) {
            if let Some(slot) = slots.next() {
                // Without the blocks to hash, the engine side stages the chunk in a buffer
                // of this process, and the checksum is hashed from there.
                let staged = self
                    .host_planes
                    .is_none()
                    .then(|| self.private_buffer(slot.payload_len()));
                destinations.push(SaveDestination::Slot(slot, staged));
                kept.push(span);
                continue;
            }
            match self
                .engine
                .storage()
                .allocate(self.engine.layout().chunk_bytes(span.len()))
            {
                Ok(buf) => {
                    destinations.push(SaveDestination::Memory(buf));
                    kept.push(span);
                }
                Err(e) => {
                    tracing::debug!(req = %r.req_id, error = %e, "no memory for a save; skipping the rest of it");
                    break;
                }
            }
        }
        if kept.is_empty() {
            return;
        }
        let blocks: Vec<u32> = kept
            .iter()
            .flat_map(|s| r.block_ids[s.start / bs..s.end / bs].iter().copied())
            .collect();
        let mut memory = JobMemory::Save(destinations);
        let job = CopyJob {
            id: self.next_job_id(),
            direction: CopyDirection::Save,
            req_id: r.req_id.clone(),
            block_ids: blocks.clone(),
            skip_blocks: 0,
            chunk_blocks: kept.iter().map(|s| s.len() / bs).collect(),
            block_bytes: self.block_bytes(),
            chunk_ptrs: memory.pointers(),
            check_copy_ptrs: memory.staged_save_pointers(),
            asynchronous: false,
        };
        let tokens = kept.iter().map(ChunkSpan::len).sum();
        self.planned_saves.push((
            job,
            InFlight {
                direction: CopyDirection::Save,
                req_id: r.req_id.clone(),
                step,
                memory,
                spans: kept,
                tokens,
                asynchronous: false,
                tier_tokens: Vec::new(),
                blocks,
                checks: Vec::new(),
            },
        ));
    }

    /// What node memory holds of the leading run of `spans` already, and places it lends for
    /// the save's copy of the rest to go straight there (one copy, where L1 then write-behind
    /// is two): only when the worker sees the engine's blocks in host memory, or the engine
    /// side stages its copies (see [`ConnectorWorker::check_staged_copies`]), to hash each
    /// chunk's checksum from memory no other process writes, and the pool has a [save slot
    /// tier](kvpool_core::StorageManager::save_slot_tier). The step's saves wait for node
    /// memory at most [`SAVE_SLOT_BUDGET`] in all (this runs on the step's path); what gets no
    /// place goes through L1.
    fn lend_save_slots(&self, spans: &[ChunkSpan]) -> LentSaveSlots {
        let storage = self.engine.storage();
        let left = self
            .save_slot_deadline
            .saturating_duration_since(Instant::now());
        if (self.host_planes.is_none() && !self.checks_staged_copies)
            || spans.is_empty()
            || left.is_zero()
            || storage.save_slot_tier().is_none()
        {
            return LentSaveSlots::default();
        }
        let wanted: Vec<(CacheKey, usize)> = spans
            .iter()
            .map(|s| (s.key.clone(), self.engine.layout().chunk_bytes(s.len())))
            .collect();
        let lent = self
            .runtime
            .block_on(async { tokio::time::timeout(left, storage.lend_save_slots(&wanted)).await });
        lent.unwrap_or_else(|_| {
            tracing::debug!("node memory lent no places for a save in time; saving through L1");
            LentSaveSlots::default()
        })
    }
}
