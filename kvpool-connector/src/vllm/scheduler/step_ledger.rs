//! The step ledger: which saves each step staged on the workers, and when they may become
//! visible. A step's saves are committed once every rank reported running it, after the
//! failed loads of that report (and of every earlier one) have cut whatever they reached:
//! the saves, in any step not yet committed, of every request holding a failed block, from
//! the chunk of that block on. With vLLM's asynchronous scheduling the next step is already
//! running when a step's failures arrive; its saves are still uncommitted then, so they are
//! cut too. The same ledger tells `request_finished` whether a save may still be copying out
//! of a request's blocks.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use crate::vllm::metadata::SaveDiscard;

/// How long a step may wait for every rank's report before it is given up (its saves are
/// never committed, and the workers drop them).
pub const STEP_REPORT_TIMEOUT: Duration = Duration::from_secs(60);

/// A save the scheduler put in a step's metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IssuedSave {
    pub(crate) req_id: String,
    pub(crate) from: usize,
    pub(crate) until: usize,
    /// The request's blocks holding tokens `0..until` when the save was issued.
    pub(crate) blocks: Vec<u32>,
}

#[derive(Debug)]
struct OpenStep {
    saves: Vec<IssuedSave>,
    executed: u32,
    created: Instant,
}

/// Per-step bookkeeping of the scheduler (see the module docs).
#[derive(Debug)]
pub(crate) struct StepLedger {
    ranks: u32,
    open: BTreeMap<u64, OpenStep>,
    /// Steps with saves whose copies not every rank has reported done: rank reports so far.
    copying: BTreeMap<u64, u32>,
    commits: Vec<u64>,
    discards: Vec<SaveDiscard>,
    given_up: u64,
}

impl StepLedger {
    pub(crate) fn new(ranks: u32) -> Self {
        StepLedger {
            ranks: ranks.max(1),
            open: BTreeMap::new(),
            copying: BTreeMap::new(),
            commits: Vec::new(),
            discards: Vec::new(),
            given_up: 0,
        }
    }

    /// Step `step` was built with these saves.
    pub(crate) fn issued(&mut self, step: u64, saves: Vec<IssuedSave>) {
        if !saves.is_empty() {
            self.copying.insert(step, 0);
        }
        self.open.insert(
            step,
            OpenStep {
                saves,
                executed: 0,
                created: Instant::now(),
            },
        );
    }

    /// Loads of `failed` blocks failed (on some rank): cuts every uncommitted save that holds
    /// one, from the chunk of the first such block on.
    pub(crate) fn failed_blocks(&mut self, failed: &HashSet<u32>, block_size: usize, chunk: usize) {
        for (&step, open) in &mut self.open {
            for save in &mut open.saves {
                let Some(first) = save.blocks.iter().position(|b| failed.contains(b)) else {
                    continue;
                };
                let keep = (first * block_size / chunk * chunk).max(save.from);
                if keep < save.until {
                    self.discards.push(SaveDiscard {
                        step,
                        req_id: save.req_id.clone(),
                        keep_until: keep as u32,
                    });
                    save.until = keep;
                }
            }
        }
    }

    /// `ranks` more workers reported running `step` (their failed blocks were handed to
    /// [`StepLedger::failed_blocks`] first); with every rank in, the step is committed.
    pub(crate) fn executed(&mut self, step: u64, ranks: u32) {
        let Some(open) = self.open.get_mut(&step) else {
            return;
        };
        open.executed += ranks;
        if open.executed >= self.ranks {
            let had_saves = !open.saves.is_empty();
            self.open.remove(&step);
            if had_saves {
                self.commits.push(step);
            }
        }
    }

    /// `ranks` more workers reported every save copy of `step` done.
    pub(crate) fn copied(&mut self, step: u64, ranks: u32) {
        if let Some(n) = self.copying.get_mut(&step) {
            *n += ranks;
            if *n >= self.ranks {
                self.copying.remove(&step);
            }
        }
    }

    /// Whether a save issued in any of `steps` may still be copying on some rank.
    pub(crate) fn may_be_copying(&self, steps: &[u64]) -> bool {
        steps.iter().any(|s| self.copying.contains_key(s))
    }

    /// Cuts and commits decided since the last call, for the next metadata.
    pub(crate) fn take_decisions(&mut self) -> (Vec<SaveDiscard>, Vec<u64>) {
        (
            std::mem::take(&mut self.discards),
            std::mem::take(&mut self.commits),
        )
    }

    /// Gives up steps whose reports did not all arrive within `timeout` (their saves stay
    /// invisible) and forgets their copies; returns how many.
    pub(crate) fn expire(&mut self, timeout: Duration) -> usize {
        let now = Instant::now();
        let old: Vec<u64> = self
            .open
            .iter()
            .filter(|(_, o)| now.duration_since(o.created) > timeout)
            .map(|(&s, _)| s)
            .collect();
        for s in &old {
            tracing::warn!(
                step = s,
                "not every worker reported a step in time; its saves are dropped"
            );
            self.open.remove(s);
            self.copying.remove(s);
        }
        self.given_up += old.len() as u64;
        old.len()
    }

    /// Drops every uncommitted save for good (the cache was reset: they were computed by
    /// the old weights).
    pub(crate) fn discard_all(&mut self) {
        for (&step, open) in &mut self.open {
            for save in &open.saves {
                self.discards.push(SaveDiscard {
                    step,
                    req_id: save.req_id.clone(),
                    keep_until: 0,
                });
            }
            open.saves.clear();
        }
    }

    /// Whether decisions are still to come or to be shipped: steps not reported by every
    /// rank, or cuts and commits not yet in a metadata.
    pub(crate) fn has_pending_work(&self) -> bool {
        self.open.values().any(|o| !o.saves.is_empty())
            || !self.commits.is_empty()
            || !self.discards.is_empty()
    }

    /// Steps given up so far.
    pub(crate) fn given_up(&self) -> u64 {
        self.given_up
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn save(req: &str, from: usize, until: usize, blocks: std::ops::Range<u32>) -> IssuedSave {
        IssuedSave {
            req_id: req.into(),
            from,
            until,
            blocks: blocks.collect(),
        }
    }

    #[test]
    fn steps_without_saves_commit_nothing() {
        let mut l = StepLedger::new(1);
        l.issued(1, vec![]);
        l.executed(1, 1);
        assert_eq!(l.take_decisions(), (vec![], vec![]));
        assert!(!l.has_pending_work());
    }

    #[test]
    fn a_step_commits_once_every_rank_ran_it() {
        let mut l = StepLedger::new(2);
        l.issued(1, vec![save("a", 0, 32, 0..4)]);
        l.executed(1, 1);
        assert_eq!(l.take_decisions(), (vec![], vec![]));
        assert!(l.has_pending_work());
        l.executed(1, 1);
        assert_eq!(l.take_decisions(), (vec![], vec![1]));
        assert!(!l.has_pending_work());
    }

    #[test]
    fn failures_cut_every_open_step_from_the_failed_chunk_on() {
        let mut l = StepLedger::new(1);
        // Step 1 saves chunk 1 of a; step 2 (already built) saves chunks 2 and 3.
        l.issued(1, vec![save("a", 16, 32, 0..4), save("b", 0, 16, 10..12)]);
        l.issued(2, vec![save("a", 32, 64, 0..8)]);
        // Block 1 (token 8: chunk 0) of a failed in step 1.
        l.failed_blocks(&HashSet::from([1]), 8, 16);
        l.executed(1, 1);
        let (discards, commits) = l.take_decisions();
        assert_eq!(commits, vec![1]);
        assert_eq!(
            discards,
            vec![
                SaveDiscard {
                    step: 1,
                    req_id: "a".into(),
                    keep_until: 16
                },
                SaveDiscard {
                    step: 2,
                    req_id: "a".into(),
                    keep_until: 32
                },
            ]
        );
        l.executed(2, 1);
        assert_eq!(l.take_decisions(), (vec![], vec![2]));
    }

    #[test]
    fn copies_are_confirmed_by_every_rank() {
        let mut l = StepLedger::new(2);
        l.issued(4, vec![save("a", 0, 16, 0..2)]);
        assert!(l.may_be_copying(&[4]));
        l.copied(4, 1);
        assert!(l.may_be_copying(&[3, 4]));
        l.copied(4, 1);
        assert!(!l.may_be_copying(&[4]));
    }

    #[test]
    fn a_reset_discards_every_uncommitted_save_and_late_steps_are_given_up() {
        let mut l = StepLedger::new(1);
        l.issued(1, vec![save("a", 0, 16, 0..2)]);
        l.discard_all();
        l.executed(1, 1);
        let (discards, commits) = l.take_decisions();
        assert_eq!(discards.len(), 1);
        assert_eq!(discards[0].keep_until, 0);
        assert!(commits.is_empty(), "nothing is left to commit");
        l.issued(2, vec![save("a", 16, 32, 0..4)]);
        assert_eq!(l.expire(Duration::ZERO), 1);
        assert_eq!(l.given_up(), 1);
        assert!(!l.has_pending_work());
    }
}
