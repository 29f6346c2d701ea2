//! The worker's thread that checks a load's copies from node memory (in the engine's blocks,
//! or in the engine side's staged copies) while vLLM runs the step's forward pass
//! ([`CopyChecker`]), started when the worker is shown the blocks
//! (`ConnectorWorker::set_host_planes`) or told the engine side stages its copies
//! (`ConnectorWorker::check_staged_copies`); the worker waits for its verdicts before the
//! step's results leave it (`ConnectorWorker::settle_checks`).

use std::sync::{Arc, mpsc};

use super::copy_job::JobMemory;
use super::node_copies::{HostPlanes, LoadSource};
use super::{CheckSite, ConnectorWorker, InFlight, LentChunkCheck};
use crate::ConnectorError;
use tracing::warn;

/// A load job whose chunks copied from node memory are being checked on the worker's
/// [`CopyChecker`] thread, which hands the job back with its verdict.
pub(super) struct CheckingLoad {
    pub(super) req_id: String,
    /// The job's blocks, reported failed if the thread never hands the job back.
    pub(super) blocks: Vec<u32>,
    pub(super) asynchronous: bool,
    pub(super) checked: mpsc::Receiver<CheckedLoad>,
}

/// A load job handed back by its check, with what the check found.
pub(super) struct CheckedLoad {
    pub(super) job: InFlight,
    pub(super) checks: Vec<LentChunkCheck>,
    pub(super) verdict: CheckVerdict,
}

/// What the check of a load's copies from node memory found.
#[derive(Debug)]
pub(super) enum CheckVerdict {
    /// Every copy matches its chunk's checksum.
    Verified,
    /// The copy of check `index`'s chunk does not: that chunk is deleted from the pool, and
    /// its blocks and every later block of the job are failed.
    Mismatch { index: usize, why: String },
    /// The copies could not be checked (no checker, a panic): every block from the first
    /// check's on is failed, and no chunk is blamed.
    Unchecked(String),
}

/// Checks a load's copies in order, up to the first that fails: in the engine's blocks
/// (`planes`) or in their staged copy. Staged copies of [`PARALLEL_CHECK_FROM_BYTES`] or more
/// in all are checked by several threads, a chunk each at a time (the GPU route: the host's
/// cores are otherwise idle while the device runs the forward pass); checks in the engine's
/// blocks stay on this one thread (vLLM's CPU build: the other cores run the forward pass).
fn check_copies(
    planes: Option<&HostPlanes>,
    memory: &JobMemory,
    checks: &[LentChunkCheck],
) -> CheckVerdict {
    let JobMemory::Load(chunks) = memory else {
        return CheckVerdict::Unchecked("not a load's chunks".to_string());
    };
    // What each check reads, in order, up to the first that cannot be checked.
    let mut copies = Vec::with_capacity(checks.len());
    let mut unchecked = None;
    for check in checks {
        let Some(LoadSource::Shared(chunk)) = chunks.get(check.chunk) else {
            unchecked = Some(format!("chunk {} was not lent by node memory", check.chunk));
            break;
        };
        let site = match (&check.site, planes) {
            (CheckSite::Blocks, Some(planes)) => CopySite::Blocks(planes, &check.blocks),
            (CheckSite::Blocks, None) => {
                unchecked = Some("the engine's blocks are not readable".into());
                break;
            }
            (CheckSite::Staged(copy), _) => CopySite::Staged(copy.as_slice()),
        };
        copies.push((chunk, site));
    }
    let staged_bytes: usize = copies
        .iter()
        .map(|(_, site)| match site {
            CopySite::Staged(copy) => copy.len(),
            CopySite::Blocks(..) => 0,
        })
        .sum();
    let all_staged = copies
        .iter()
        .all(|(_, site)| matches!(site, CopySite::Staged(_)));
    let threads = if all_staged && staged_bytes >= PARALLEL_CHECK_FROM_BYTES {
        std::thread::available_parallelism().map_or(1, |n| n.get().min(PARALLEL_CHECK_THREADS))
    } else {
        1
    };
    for (index, verdict) in check_each(&copies, threads, check_one)
        .into_iter()
        .enumerate()
    {
        match verdict {
            Some(Ok(())) => {}
            Some(Err(why)) => return CheckVerdict::Mismatch { index, why },
            // No verdict (its check panicked, or a helper thread is gone): nothing proven
            // against the chunk, so it is not deleted, but its blocks and every later one
            // fail. A mismatch earlier in order was returned above.
            None => return CheckVerdict::Unchecked(format!("copy {index} was not checked")),
        }
    }
    match unchecked {
        Some(why) => CheckVerdict::Unchecked(why),
        None => CheckVerdict::Verified,
    }
}

/// Staged copies at least this long in all are checked by several threads.
const PARALLEL_CHECK_FROM_BYTES: usize = 4 << 20;

/// The most threads a load's staged copies are checked with.
const PARALLEL_CHECK_THREADS: usize = 8;

/// Where one copy from node memory is checked.
enum CopySite<'a> {
    /// In the engine's blocks.
    Blocks(&'a HostPlanes, &'a [u32]),
    /// In the staged copy the blocks were filled from.
    Staged(&'a [u8]),
}

/// Checks one copy from node memory where it lies.
fn check_one((chunk, site): &(&kvpool_core::SharedChunk, CopySite<'_>)) -> Result<(), String> {
    match site {
        CopySite::Blocks(planes, blocks) => planes.check(chunk, blocks),
        CopySite::Staged(copy) => chunk.verify_copy([*copy]).map_err(|e| e.to_string()),
    }
}

/// `check`'s verdict on each of `items`, in order (`None`: not checked, or its check
/// panicked). On one thread: up to the first that fails or panics (none after it). On
/// `threads`: each thread takes the next item not yet taken, so every item gets a verdict;
/// the first failure in order is the caller's to find. A check that panics costs its own
/// item's verdict only: a mismatch found before it in order stands.
fn check_each<T: Sync>(
    items: &[T],
    threads: usize,
    check: impl Fn(&T) -> Result<(), String> + Sync,
) -> Vec<Option<Result<(), String>>> {
    let check_caught =
        |item: &T| std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(item))).ok();
    if threads <= 1 || items.len() <= 1 {
        let mut verdicts = Vec::with_capacity(items.len());
        for item in items {
            let verdict = check_caught(item);
            let failed = !matches!(verdict, Some(Ok(())));
            verdicts.push(verdict);
            if failed {
                break;
            }
        }
        return verdicts;
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let work = || {
        let mut done = Vec::new();
        loop {
            let index = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some(item) = items.get(index) else {
                return done;
            };
            done.push((index, check_caught(item)));
        }
    };
    let mut verdicts: Vec<Option<Result<(), String>>> = vec![None; items.len()];
    std::thread::scope(|scope| {
        let helpers: Vec<_> = (1..threads.min(items.len()))
            .filter_map(|_| {
                std::thread::Builder::new()
                    .name("kvpool-copy-check".into())
                    .spawn_scoped(scope, work)
                    .ok()
            })
            .collect();
        // This thread checks too (and alone, if no helper started).
        let mut done = work();
        for helper in helpers {
            // A helper that panicked outside a check leaves its items without a verdict.
            if let Ok(theirs) = helper.join() {
                done.extend(theirs);
            }
        }
        for (index, verdict) in done {
            verdicts[index] = verdict;
        }
    });
    verdicts
}

impl ConnectorWorker {
    /// Gives the worker the engine's KV blocks in host memory (vLLM's CPU tensors), which it
    /// then reads to check loads copied once, straight from node memory into the blocks: the
    /// node's pool daemon's chunks stay where they lie until that copy, instead of being
    /// copied into L1 first. Without them (blocks on a GPU) such chunks go through L1. A
    /// worker that does not read the engine's blocks never touches them.
    ///
    /// Refused when the planes do not make up this worker's block layout.
    pub fn set_host_planes(&mut self, planes: HostPlanes) -> Result<(), ConnectorError> {
        if planes.block_bytes() != self.block_bytes() {
            return Err(ConnectorError::Layout(format!(
                "host KV planes of {} bytes per block, the layout has {}",
                planes.block_bytes(),
                self.block_bytes()
            )));
        }
        // Checks still reading the planes given before end first.
        self.settle_checks();
        if self.host_planes.as_deref() == Some(&planes) {
            return Ok(());
        }
        let planes = Arc::new(planes);
        self.host_planes = Some(planes.clone());
        self.start_copy_checker(Some(planes));
        Ok(())
    }

    /// Tells the worker that the engine side stages each load's chunk from node memory in a
    /// buffer of this process it gives the job ([`super::CopyJob::check_copy_ptrs`]), which
    /// the worker then checks behind the forward pass: the route where the worker cannot read
    /// the engine's blocks (blocks on a GPU: one copy of the chunk to the device, the blocks
    /// filled from it, and that device copy read back into the buffer). Without it such
    /// chunks are copied into L1 and checked at lookup, before the copy into the blocks.
    pub fn check_staged_copies(&mut self) {
        self.settle_checks();
        self.checks_staged_copies = true;
        if self.copy_checker.is_none() {
            self.start_copy_checker(self.host_planes.clone());
        }
    }

    /// Starts the thread that checks copies (in `planes`, if given); without one, chunks from
    /// node memory go through L1.
    fn start_copy_checker(&mut self, planes: Option<Arc<HostPlanes>>) {
        match CopyChecker::start(planes) {
            Ok(checker) => {
                self.copy_checker = Some(checker);
                self.leases.set_checks_copies(true);
            }
            Err(e) => {
                // Node memory's chunks then go through L1 and are checked there: slower, as
                // correct.
                warn!(
                    "no thread to check copies from node memory ({e}); chunks from node memory go through L1"
                );
                self.host_planes = None;
                self.checks_staged_copies = false;
                self.copy_checker = None;
                self.leases.set_checks_copies(false);
            }
        }
    }
}

impl Drop for ConnectorWorker {
    /// Waits for checks still reading the engine's blocks, which must stay mapped only while
    /// the worker lives (see [`HostPlanes::new`]).
    fn drop(&mut self) {
        for c in self.checking.drain(..) {
            let _ = c.checked.recv();
        }
    }
}

/// A load job to check, and where to hand it back.
struct CheckRequest {
    job: InFlight,
    checks: Vec<LentChunkCheck>,
    reply: mpsc::SyncSender<CheckedLoad>,
}

/// The thread that checks loads copied from node memory while the engine runs the step's
/// forward pass (one per worker, started with its host planes or when the engine side stages
/// its copies, ended when the worker drops it). A thread of its own, not one spawned per job:
/// spawning one took up to 2 ms on the development VM, on the path to the forward pass.
pub(super) struct CopyChecker {
    jobs: mpsc::Sender<CheckRequest>,
    planes: Option<Arc<HostPlanes>>,
}

impl CopyChecker {
    /// Starts the thread that checks copies: in `planes` for a check in the engine's blocks,
    /// and in staged copies.
    pub(super) fn start(planes: Option<Arc<HostPlanes>>) -> std::io::Result<Self> {
        let (jobs, requests) = mpsc::channel::<CheckRequest>();
        let thread_planes = planes.clone();
        std::thread::Builder::new()
            .name("kvpool-copy-check".into())
            .spawn(move || {
                no_wakeup_preemption();
                run_on_any_allowed_cpu();
                for r in requests {
                    let CheckRequest { job, checks, reply } = r;
                    let verdict = check_catching_panics(thread_planes.as_deref(), &job, &checks);
                    // The worker may have stopped waiting (it was dropped): nothing to do.
                    let _ = reply.send(CheckedLoad {
                        job,
                        checks,
                        verdict,
                    });
                }
            })?;
        Ok(CopyChecker { jobs, planes })
    }

    /// Hands `job` to the thread: the receiver yields it back with the verdict on its
    /// `checks`. If the thread is gone, checks here, before returning.
    pub(super) fn check(
        &self,
        job: InFlight,
        checks: Vec<LentChunkCheck>,
    ) -> mpsc::Receiver<CheckedLoad> {
        let (reply, checked) = mpsc::sync_channel(1);
        let request = CheckRequest {
            job,
            checks,
            reply: reply.clone(),
        };
        if let Err(mpsc::SendError(r)) = self.jobs.send(request) {
            let verdict = check_catching_panics(self.planes.as_deref(), &r.job, &r.checks);
            let _ = reply.send(CheckedLoad {
                job: r.job,
                checks: r.checks,
                verdict,
            });
        }
        checked
    }
}

/// Lets the calling thread run on any CPU the process's cgroup allows. vLLM's CPU worker
/// binds its OpenMP threads to the cores it reserves for the forward pass (`OMP_PROC_BIND`
/// with `OMP_PLACES`, or `GOMP_CPU_AFFINITY`), and a thread inherits the binding of the
/// thread that starts it: left so, the check would share the forward pass's core instead of
/// running beside it. The kernel keeps the mask to the CPUs the cgroup allows.
fn run_on_any_allowed_cpu() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: an all-zero cpu_set_t is the empty set.
        let mut every: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for cpu in 0..libc::CPU_SETSIZE as usize {
            // SAFETY: `cpu` is below CPU_SETSIZE, within the set.
            unsafe { libc::CPU_SET(cpu, &mut every) };
        }
        // SAFETY: pid 0 is the calling thread; `every` is a valid set of its size.
        let rc =
            unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &every) };
        if rc != 0 {
            tracing::debug!(
                "the copy check thread keeps the CPUs of the thread that started it: {}",
                std::io::Error::last_os_error()
            );
        }
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

/// [`check_copies`], a panic counted as copies left unchecked.
fn check_catching_panics(
    planes: Option<&HostPlanes>,
    job: &InFlight,
    checks: &[LentChunkCheck],
) -> CheckVerdict {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        check_copies(planes, &job.memory, checks)
    }))
    .unwrap_or_else(|_| CheckVerdict::Unchecked("the check panicked".to_string()))
}

#[cfg(test)]
mod tests {
    use super::check_each;

    /// Items 0..16, those in `bad` failing; records which were checked.
    fn run(threads: usize, bad: &[usize]) -> (Vec<Option<Result<(), String>>>, Vec<usize>) {
        let checked = std::sync::Mutex::new(Vec::new());
        let items: Vec<usize> = (0..16).collect();
        let verdicts = check_each(&items, threads, |&i| {
            checked.lock().unwrap().push(i);
            if bad.contains(&i) {
                Err(format!("item {i}"))
            } else {
                Ok(())
            }
        });
        let mut checked = checked.into_inner().unwrap();
        checked.sort_unstable();
        (verdicts, checked)
    }

    fn first_failure(verdicts: &[Option<Result<(), String>>]) -> Option<(usize, String)> {
        verdicts
            .iter()
            .enumerate()
            .find_map(|(i, v)| v.clone().expect("checked").err().map(|why| (i, why)))
    }

    #[test]
    fn one_thread_checks_in_order_up_to_the_first_failure() {
        let (verdicts, checked) = run(1, &[5, 9]);
        assert_eq!(verdicts.len(), 6);
        assert_eq!(checked, (0..6).collect::<Vec<_>>());
        assert_eq!(first_failure(&verdicts), Some((5, "item 5".into())));
    }

    #[test]
    fn several_threads_check_every_item_once_and_the_first_failure_in_order_is_found() {
        for threads in [2, 4, 32] {
            for _ in 0..20 {
                let (verdicts, checked) = run(threads, &[9, 5, 12]);
                assert_eq!(checked, (0..16).collect::<Vec<_>>(), "each item once");
                assert_eq!(verdicts.len(), 16);
                assert_eq!(first_failure(&verdicts), Some((5, "item 5".into())));
                let (verdicts, _) = run(threads, &[]);
                assert!(verdicts.iter().all(|v| matches!(v, Some(Ok(())))));
            }
        }
    }

    #[test]
    fn a_check_that_panics_costs_its_own_verdict_and_a_mismatch_before_it_stands() {
        let items: Vec<usize> = (0..16).collect();
        for threads in [1, 4] {
            let verdicts = check_each(&items, threads, |&i| match i {
                3 => Err("item 3".to_string()),
                7 => panic!("check of item 7"),
                _ => Ok(()),
            });
            assert_eq!(
                first_failure_or_gap(&verdicts),
                Some((3, Some("item 3".into())))
            );
            let verdicts = check_each(&items, threads, |&i| {
                assert_ne!(i, 7, "check of item 7");
                if i == 9 {
                    Err("item 9".to_string())
                } else {
                    Ok(())
                }
            });
            // The panicked check comes first in order: no verdict there, nothing blamed.
            assert_eq!(
                first_failure_or_gap(&verdicts),
                Some((7, None)),
                "{threads} threads"
            );
        }
    }

    /// The first item, in order, that failed (`Some(why)`) or has no verdict (`None`).
    fn first_failure_or_gap(
        verdicts: &[Option<Result<(), String>>],
    ) -> Option<(usize, Option<String>)> {
        verdicts.iter().enumerate().find_map(|(i, v)| match v {
            Some(Ok(())) => None,
            Some(Err(why)) => Some((i, Some(why.clone()))),
            None => Some((i, None)),
        })
    }
}
