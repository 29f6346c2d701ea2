//! The host executor: runs copy plans with `memcpy` when the engine's KV is in host memory
//! (vLLM's CPU build), so the plan a GPU runs is the plan CI's real-vLLM suite runs.

use crate::plan::{CopyPlan, JobSpec, KvPlanes, PlanError, PlanStats};

/// Runs copy plans over KV planes in host memory, synchronously: a job is done when
/// [`run`](HostExecutor::run) returns.
#[derive(Debug)]
pub struct HostExecutor {
    planes: KvPlanes,
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
        HostExecutor { planes }
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
            for s in phase {
                // SAFETY: the plan put every engine-side address inside a page of the planes
                // (valid by `new`'s contract) and every host-side address inside a chunk or a
                // staged copy of the job (valid by this function's contract); lengths stay
                // inside them, and no segment's source overlaps its destination.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        s.src as usize as *const u8,
                        s.dst as usize as *mut u8,
                        s.len as usize,
                    );
                }
            }
        }
        Ok(plan.stats())
    }
}
