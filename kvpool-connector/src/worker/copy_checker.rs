//! The worker's thread that checks a load's copies from node memory in the engine's blocks
//! while vLLM runs the step's forward pass ([`CopyChecker`]); the worker waits for its verdicts
//! before the step's results leave it (`ConnectorWorker::settle_checks`).

use std::sync::{Arc, mpsc};

use super::copy_check::{HostPlanes, LoadSource};
use super::copy_job::JobMemory;
use super::{BlockCheck, CheckedLoad, InFlight};

/// The first of a load's `checks` whose copy fails in the engine's blocks, with why; `None`
/// when every copy verifies. `memory` is the job's chunks, which the checks index.
fn first_failed_check(
    planes: &HostPlanes,
    memory: &JobMemory,
    checks: &[BlockCheck],
) -> Option<(usize, String)> {
    let JobMemory::Load(chunks) = memory else {
        return Some((0, "not a load's chunks".to_string()));
    };
    checks.iter().enumerate().find_map(|(i, check)| {
        let outcome = match chunks.get(check.chunk) {
            Some(LoadSource::Shared(chunk)) => planes.check(chunk, &check.blocks),
            _ => Err(format!("chunk {} was not lent by node memory", check.chunk)),
        };
        outcome.err().map(|e| (i, e))
    })
}

/// A load job to check, and where to hand it back.
struct CheckRequest {
    job: InFlight,
    checks: Vec<BlockCheck>,
    reply: mpsc::SyncSender<CheckedLoad>,
}

/// The thread that checks loads copied from node memory in the engine's blocks while the
/// engine runs the step's forward pass (one per worker, started with its host planes, ended
/// when the worker drops it). A thread of its own, not one spawned per job: spawning one
/// took up to 2 ms on the development VM, on the path to the forward pass.
pub(super) struct CopyChecker {
    jobs: mpsc::Sender<CheckRequest>,
    planes: Arc<HostPlanes>,
}

impl CopyChecker {
    /// Starts the thread that checks copies in `planes`.
    pub(super) fn start(planes: Arc<HostPlanes>) -> std::io::Result<Self> {
        let (jobs, requests) = mpsc::channel::<CheckRequest>();
        let thread_planes = planes.clone();
        std::thread::Builder::new()
            .name("kvpool-copy-check".into())
            .spawn(move || {
                no_wakeup_preemption();
                for r in requests {
                    let CheckRequest { job, checks, reply } = r;
                    let failed = check_catching_panics(&thread_planes, &job, &checks);
                    // The worker may have stopped waiting (it was dropped): nothing to do.
                    let _ = reply.send(CheckedLoad {
                        job,
                        checks,
                        failed,
                    });
                }
            })?;
        Ok(CopyChecker { jobs, planes })
    }

    /// Hands `job` to the thread: the receiver yields it back with the first of `checks`
    /// that failed. If the thread is gone, checks here, before returning.
    pub(super) fn check(
        &self,
        job: InFlight,
        checks: Vec<BlockCheck>,
    ) -> mpsc::Receiver<CheckedLoad> {
        let (reply, checked) = mpsc::sync_channel(1);
        let request = CheckRequest {
            job,
            checks,
            reply: reply.clone(),
        };
        if let Err(mpsc::SendError(r)) = self.jobs.send(request) {
            let failed = check_catching_panics(&self.planes, &r.job, &r.checks);
            let _ = reply.send(CheckedLoad {
                job: r.job,
                checks: r.checks,
                failed,
            });
        }
        checked
    }
}

/// Puts the calling thread in `SCHED_BATCH`, so that when woken it does not preempt the
/// thread that woke it. Without it, on a machine with few cores, a check handed over just
/// before the forward pass could take the core of the engine thread that handed it over:
/// `copy_done` then took up to 3 ms, as long as the check, on the 2-core development VM.
fn no_wakeup_preemption() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling thread; priority 0 is the one SCHED_BATCH takes.
        let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
        if rc != 0 {
            tracing::debug!(
                "the copy check thread keeps the default scheduling: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// [`first_failed_check`], a panic counted as a failure of the first check.
fn check_catching_panics(
    planes: &HostPlanes,
    job: &InFlight,
    checks: &[BlockCheck],
) -> Option<(usize, String)> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        first_failed_check(planes, &job.memory, checks)
    }))
    .unwrap_or_else(|_| Some((0, "the check panicked".to_string())))
}
