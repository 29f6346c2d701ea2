//! The process's low-priority runtime, where write-behind to disk tiers runs
//! (`[write_behind] low_priority`, on by default): its threads run at the lowest CPU priority,
//! so that on a host whose cores run the engine's compute (vLLM's CPU build), encoding and
//! writing values to disk takes what the compute leaves instead of landing in its steps.

use std::sync::{Mutex, PoisonError};

use kvpool_core::{PoolConfig, TierConfig};
use tokio::runtime::{Handle, Runtime};
use tracing::{debug, info, warn};

/// The nice value of the runtime's threads: the lowest priority there is.
pub const BACKGROUND_NICE: i32 = 19;

/// Worker threads (encoding values) at most: one per core up to this.
const MAX_WORKER_THREADS: usize = 4;

/// Blocking threads the runtime may run at once (a tier's file writes, RocksDB).
const MAX_BLOCKING_THREADS: usize = 8;

/// The runtime, with the process that started it.
struct Background {
    pid: u32,
    runtime: Runtime,
}

static BACKGROUND: Mutex<Option<Background>> = Mutex::new(None);

/// A handle to the process's low-priority runtime, started on first use: a worker thread per
/// core (up to four) and up to eight blocking threads, each at nice [`BACKGROUND_NICE`] and
/// scheduled as batch work (not preempting a thread that was running when it wakes). Started
/// again in a process forked after it was started: a fork has none of its parent's threads.
pub fn background_runtime() -> std::io::Result<Handle> {
    let mut slot = BACKGROUND.lock().unwrap_or_else(PoisonError::into_inner);
    let pid = std::process::id();
    if let Some(background) = slot.as_ref().filter(|b| b.pid == pid) {
        return Ok(background.runtime.handle().clone());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(
            std::thread::available_parallelism().map_or(1, |n| n.get().min(MAX_WORKER_THREADS)),
        )
        .max_blocking_threads(MAX_BLOCKING_THREADS)
        .thread_name("kvpool-background")
        .on_thread_start(lower_this_threads_priority)
        .enable_all()
        .build()?;
    let handle = runtime.handle().clone();
    if let Some(parents) = slot.replace(Background { pid, runtime }) {
        // The parent process's runtime: its threads are not in this process, and dropping it
        // would wait for them for ever.
        std::mem::forget(parents);
    }
    info!(
        nice = BACKGROUND_NICE,
        "write-behind to disk runs on low-priority threads"
    );
    Ok(handle)
}

/// [`background_runtime`], or `fallback` (with a warning) where its threads cannot start:
/// writing behind at normal priority is no reason to refuse to start.
pub fn write_behind_runtime_or(fallback: &Handle) -> Handle {
    background_runtime().unwrap_or_else(|e| {
        warn!(error = %e, "cannot start the low-priority write-behind threads; writing behind on the pool's own runtime");
        fallback.clone()
    })
}

/// Where a pool's write-behind to `tier` runs when not on the pool's own runtime
/// (`pool_runtime`): the process's low-priority runtime for a disk tier (`file://`) under
/// `[write_behind] low_priority`, as its writes are the process's own CPU work (encoding,
/// files, RocksDB). Network and node-memory tiers stay on the pool's runtime: their
/// connections and sessions serve reads too, and must not be driven by threads the engine's
/// compute starves. Used by `build_pool` and by `kvpool serve` for its lower tiers.
pub fn write_behind_runtime_for(
    config: &PoolConfig,
    tier: &TierConfig,
    pool_runtime: &Handle,
) -> Option<Handle> {
    let scheme = tier.url.split_once("://").map(|(scheme, _)| scheme);
    if !config.write_behind.low_priority || scheme != Some("file") {
        return None;
    }
    Some(write_behind_runtime_or(pool_runtime))
}

/// The calling thread's nice value (its CPU priority; higher is lower), where the platform
/// has one per thread.
pub fn this_threads_nice() -> Option<i32> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: getpriority only reads a nice value; `who` 0 with PRIO_PROCESS is the
        // calling thread on Linux (not `gettid`, which glibc has only from 2.30: the wheel
        // targets 2.28). -1 is also a valid nice value: errno tells an error apart.
        unsafe {
            *libc::__errno_location() = 0;
            let nice = libc::getpriority(libc::PRIO_PROCESS, 0);
            (*libc::__errno_location() == 0).then_some(nice)
        }
    }
    #[cfg(not(target_os = "linux"))]
    None
}

/// Gives the calling thread the lowest CPU priority: nice [`BACKGROUND_NICE`] and, on Linux,
/// `SCHED_BATCH`. Linux keeps a nice value per thread; elsewhere this does nothing.
fn lower_this_threads_priority() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling thread; priority 0 is the one SCHED_BATCH takes.
        if unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) } != 0 {
            debug!(
                "a background thread keeps the default scheduling: {}",
                std::io::Error::last_os_error()
            );
        }
        // SAFETY: `who` 0 with PRIO_PROCESS is the calling thread on Linux (see
        // `this_threads_nice`); raising its own nice value (lowering its priority) needs no
        // privilege.
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, BACKGROUND_NICE) };
        if rc != 0 {
            debug!(
                "a background thread keeps its priority: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runtimes_tasks_and_blocking_calls_run_at_the_lowest_priority() {
        let handle = background_runtime().unwrap();
        let (task, blocking) = handle.block_on(async {
            let task = tokio::spawn(async { this_threads_nice() }).await.unwrap();
            let blocking = tokio::task::spawn_blocking(this_threads_nice)
                .await
                .unwrap();
            (task, blocking)
        });
        if cfg!(target_os = "linux") {
            assert_eq!(task, Some(BACKGROUND_NICE));
            assert_eq!(blocking, Some(BACKGROUND_NICE));
        }
        // One runtime per process: the same one again.
        let again = background_runtime().unwrap();
        assert_eq!(again.id(), handle.id());
    }

    #[tokio::test]
    async fn only_a_disk_tier_is_written_behind_at_low_priority_and_only_when_asked() {
        let mut config = PoolConfig::default();
        let pool_runtime = Handle::current();
        let on = |config: &PoolConfig, url: &str| {
            write_behind_runtime_for(config, &TierConfig::new(url), &pool_runtime)
                .is_some_and(|runtime| runtime.id() != pool_runtime.id())
        };
        assert!(on(&config, "file:///var/cache/kvpool"));
        for url in [
            "redis://127.0.0.1:6379",
            "s3://bucket/prefix",
            "kvpool+unix:///run/kvpool.sock",
            "memory://",
        ] {
            assert!(!on(&config, url), "{url}");
        }
        config.write_behind.low_priority = false;
        assert!(!on(&config, "file:///var/cache/kvpool"));
    }
}
