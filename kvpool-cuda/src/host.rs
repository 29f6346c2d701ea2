//! The host executor: runs copy plans with `memcpy` when the engine's KV is in host memory
//! (vLLM's CPU build), so the plan a GPU runs is the plan CI's real-vLLM suite runs.

use crate::plan::{CopyPlan, JobSpec, KvPlanes, PlanError, PlanStats, Segment};

/// Runs copy plans over KV planes in host memory, synchronously: a job is done when
/// [`run`](HostExecutor::run) returns.
#[derive(Debug)]
pub struct HostExecutor {
    planes: KvPlanes,
    /// Threads a long phase is copied with.
    threads: usize,
}

impl HostExecutor {
    /// An executor over `planes`.
    ///
    /// # Safety
    /// Every page of `planes` is host memory, readable and writable, that stays allocated for
    /// as long as this executor runs jobs (the engine's KV tensors, which the engine keeps),
    /// and that nothing else writes while a job that names it runs (the engine's protocol:
    /// blocks being loaded or saved are not in use).
    pub unsafe fn new(planes: KvPlanes) -> Self {
        HostExecutor {
            planes,
            threads: default_copy_threads(),
        }
    }

    /// Copies a long phase (4 MiB or more) with up to `threads` threads (default: the
    /// machine's cores, at most 4).
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }

    /// The planes it copies to and from.
    pub fn planes(&self) -> &KvPlanes {
        &self.planes
    }

    /// Plans `job` (see [`CopyPlan::build`]) and runs it: every copy is done on return.
    ///
    /// # Safety
    /// Each of the job's chunk addresses, and each of its staged copies', is host memory of
    /// the chunk's length (`chunk_blocks[c] * block_bytes`), valid for reads and writes during
    /// the call, not overlapping the engine's planes or one another.
    pub unsafe fn run(&self, job: &JobSpec<'_>) -> Result<PlanStats, PlanError> {
        let plan = CopyPlan::build(&self.planes, job)?;
        for phase in plan.phases() {
            // SAFETY: this function's contract (see `copy_phase`).
            unsafe { copy_phase(phase, self.threads) };
        }
        Ok(plan.stats())
    }
}

/// The threads a long host-to-host phase is copied with by default: the machine's cores, at
/// most 4.
pub(crate) fn default_copy_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(4))
}

/// Copies `phase` with `memcpy`: with up to `threads` threads when it is long (at least
/// [`PARALLEL_FROM_BYTES`]), else on this thread. Every copy is done on return.
///
/// # Safety
/// As [`copy_segments`], for every segment of `phase`.
pub(crate) unsafe fn copy_phase(phase: &[Segment], threads: usize) {
    let bytes: u64 = phase.iter().map(|s| s.len).sum();
    if threads <= 1 || bytes < PARALLEL_FROM_BYTES {
        // SAFETY: this function's contract.
        unsafe { copy_segments(phase) };
        return;
    }
    let shares = split_by_bytes(phase, threads);
    std::thread::scope(|scope| {
        for share in &shares[1..] {
            // Addresses cross the thread as integers; the scope ends before this function
            // returns, so every copy is done by then.
            let spawned = std::thread::Builder::new()
                .name("kvpool-host-copy".into())
                .spawn_scoped(scope, move || {
                    // SAFETY: as below; the shares of a phase never overlap.
                    unsafe { copy_segments(share) }
                });
            if spawned.is_err() {
                // No thread: this one copies that share too.
                // SAFETY: this function's contract (see `copy_segments`).
                unsafe { copy_segments(share) };
            }
        }
        // SAFETY: this function's contract (see `copy_segments`).
        unsafe { copy_segments(&shares[0]) };
    });
}

/// A phase at least this long is copied by several threads (the engine's own copies, torch's
/// ops, use its thread pool too; docs/benchmarks.md has the measurement).
const PARALLEL_FROM_BYTES: u64 = 4 << 20;

/// Copies `segments` one after the other.
///
/// # Safety
/// The plan put every engine-side address inside a page of the planes (valid by
/// [`HostExecutor::new`]'s contract) and every host-side address inside a chunk or a staged
/// copy of the job (valid by [`HostExecutor::run`]'s contract); lengths stay inside them, and
/// no segment's source overlaps its destination or another segment's destination.
unsafe fn copy_segments(segments: &[Segment]) {
    for s in segments {
        // SAFETY: the function's contract.
        unsafe {
            std::ptr::copy_nonoverlapping(
                s.src as usize as *const u8,
                s.dst as usize as *mut u8,
                s.len as usize,
            );
        }
    }
}

/// `phase` cut into at most `parts` runs of about equal bytes, a segment split where a run
/// ends inside it.
fn split_by_bytes(phase: &[Segment], parts: usize) -> Vec<Vec<Segment>> {
    let total: u64 = phase.iter().map(|s| s.len).sum();
    let per = total.div_ceil(parts.max(1) as u64).max(1);
    let mut out = vec![Vec::new()];
    let mut room = per;
    for &s in phase {
        let mut s = s;
        while s.len > 0 {
            if room == 0 {
                out.push(Vec::new());
                room = per;
            }
            let take = s.len.min(room);
            out.last_mut().expect("one run at least").push(Segment {
                src: s.src,
                dst: s.dst,
                len: take,
            });
            s = Segment {
                src: s.src + take,
                dst: s.dst + take,
                len: s.len - take,
            };
            room -= take;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_phase_splits_into_runs_of_equal_bytes_covering_every_byte_once() {
        let phase = [
            Segment {
                src: 0,
                dst: 1000,
                len: 10,
            },
            Segment {
                src: 100,
                dst: 2000,
                len: 3,
            },
            Segment {
                src: 200,
                dst: 3000,
                len: 7,
            },
        ];
        let runs = split_by_bytes(&phase, 3);
        assert_eq!(runs.len(), 3);
        for run in &runs {
            assert!(run.iter().map(|s| s.len).sum::<u64>() <= 7);
        }
        let flat: Vec<Segment> = runs.concat();
        assert_eq!(flat.iter().map(|s| s.len).sum::<u64>(), 20);
        assert_eq!(
            flat[0],
            Segment {
                src: 0,
                dst: 1000,
                len: 7
            }
        );
        assert_eq!(
            flat[1],
            Segment {
                src: 7,
                dst: 1007,
                len: 3
            }
        );
        assert_eq!(split_by_bytes(&phase, 1), vec![phase.to_vec()]);
    }
}
