//! Staged saves: chunks copied out of the engine's blocks but not yet visible, held per step
//! until the scheduler commits the step (every rank ran it, and no failed load on any rank
//! touched what it computed) or cuts them (they were computed on a failed load).
//!
//! A step is stored once it is committed and none of its save copies is still in flight; cuts
//! for a step always arrive no later than its commit, and are applied when it is stored, so a
//! copy that ends after the commit is cut like the others.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use kvpool_core::telemetry;
use kvpool_core::{CacheKey, Chunk, SaveSlot};

/// How long a step's saves wait for a commit before they are dropped (the scheduler commits
/// a step one or two steps after it ran).
pub const STAGED_STEP_TTL: Duration = Duration::from_secs(120);

/// One staged chunk.
#[derive(Debug)]
pub(crate) struct StagedChunk {
    pub(crate) req_id: String,
    /// The token the chunk ends at.
    pub(crate) end: u32,
    pub(crate) key: CacheKey,
    pub(crate) value: StagedValue,
}

/// A staged chunk's bytes.
#[derive(Debug)]
pub(crate) enum StagedValue {
    /// In this process's memory, stored through L1.
    Memory(Chunk),
    /// Sealed where it will lie in node memory, committed there.
    Slot(SaveSlot),
}

impl StagedValue {
    /// Tokens the chunk holds.
    pub(crate) fn tokens(&self) -> usize {
        match self {
            StagedValue::Memory(chunk) => chunk.meta.token_count as usize,
            StagedValue::Slot(slot) => slot.sealed().map_or(0, |m| m.token_count as usize),
        }
    }

    /// Bytes staged.
    fn len(&self) -> usize {
        match self {
            StagedValue::Memory(chunk) => chunk.data.len(),
            StagedValue::Slot(slot) => slot.payload_len(),
        }
    }
}

#[derive(Debug)]
struct StagedStep {
    chunks: Vec<StagedChunk>,
    /// Save copies of the step still in flight.
    copies_in_flight: usize,
    committed: bool,
    /// `(request, keep_until)` cuts.
    cuts: HashMap<String, u32>,
    created: Instant,
}

impl StagedStep {
    fn new() -> Self {
        StagedStep {
            chunks: Vec::new(),
            copies_in_flight: 0,
            committed: false,
            cuts: HashMap::new(),
            created: Instant::now(),
        }
    }

    /// Chunks that survive the cuts.
    fn surviving(self) -> (Vec<StagedChunk>, usize) {
        let before = self.chunks.len();
        let cuts = self.cuts;
        let kept: Vec<StagedChunk> = self
            .chunks
            .into_iter()
            .filter(|c| cuts.get(&c.req_id).is_none_or(|&keep| c.end <= keep))
            .collect();
        let dropped = before - kept.len();
        (kept, dropped)
    }
}

/// The staged saves of one worker.
#[derive(Debug, Default)]
pub(crate) struct StagedSaves {
    steps: BTreeMap<u64, StagedStep>,
    bytes: usize,
    discarded: u64,
}

impl StagedSaves {
    fn step(&mut self, step: u64) -> &mut StagedStep {
        self.steps.entry(step).or_insert_with(StagedStep::new)
    }

    /// A save copy of `step` was handed to the engine.
    pub(crate) fn copy_started(&mut self, step: u64) {
        self.step(step).copies_in_flight += 1;
    }

    /// A save copy of `step` ended; `chunks` are what it copied (empty when it failed).
    pub(crate) fn copy_ended(&mut self, step: u64, chunks: Vec<StagedChunk>) {
        let s = self.step(step);
        s.copies_in_flight = s.copies_in_flight.saturating_sub(1);
        let bytes: usize = chunks.iter().map(|c| c.value.len()).sum();
        s.chunks.extend(chunks);
        self.bytes += bytes;
        self.record();
    }

    /// Cuts `req_id`'s chunks of `step` that end after `keep_until`.
    pub(crate) fn cut(&mut self, step: u64, req_id: &str, keep_until: u32) {
        let s = self.step(step);
        let keep = s.cuts.entry(req_id.to_string()).or_insert(keep_until);
        *keep = (*keep).min(keep_until);
    }

    /// The scheduler committed `step`.
    pub(crate) fn commit(&mut self, step: u64) {
        self.step(step).committed = true;
    }

    /// Steps whose save copies are all done: what the worker reports as copied.
    pub(crate) fn copies_done(&self, step: u64) -> bool {
        self.steps
            .get(&step)
            .is_none_or(|s| s.copies_in_flight == 0)
    }

    /// Removes and returns the chunks of every committed step with no copy in flight (after
    /// its cuts), and drops steps that waited longer than `ttl` for a commit.
    pub(crate) fn take_ready(&mut self, ttl: Duration) -> Vec<StagedChunk> {
        let now = Instant::now();
        let ready: Vec<u64> = self
            .steps
            .iter()
            .filter(|(_, s)| {
                s.copies_in_flight == 0 && (s.committed || now.duration_since(s.created) > ttl)
            })
            .map(|(&k, _)| k)
            .collect();
        let mut out = Vec::new();
        for k in ready {
            let s = self.steps.remove(&k).expect("listed above");
            let committed = s.committed;
            let bytes: usize = s.chunks.iter().map(|c| c.value.len()).sum();
            self.bytes -= bytes;
            let (kept, dropped) = s.surviving();
            let dropped = if committed {
                dropped
            } else {
                tracing::warn!(
                    step = k,
                    chunks = kept.len() + dropped,
                    "a step's saves were never committed; dropping them"
                );
                kept.len() + dropped
            };
            self.discarded += dropped as u64;
            metrics::counter!(telemetry::SAVES_DISCARDED).increment(dropped as u64);
            if committed {
                out.extend(kept);
            }
        }
        self.record();
        out
    }

    /// Bytes staged.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Chunks dropped before commit so far.
    pub(crate) fn discarded(&self) -> u64 {
        self.discarded
    }

    fn record(&self) {
        metrics::gauge!(telemetry::STAGED_SAVE_BYTES).set(self.bytes as f64);
    }
}
