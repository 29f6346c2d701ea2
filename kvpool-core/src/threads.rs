//! Where kvpool's own threads run inside an engine's process: off the cores the engine bound
//! the thread that started them to.
//!
//! vLLM's CPU worker binds its OpenMP threads, the thread that calls kvpool's hooks among
//! them, to the cores it keeps for the forward pass (`VLLM_CPU_OMP_THREADS_BIND`), and keeps
//! others free for the engine's own threads (`VLLM_CPU_NUM_OF_RESERVED_CPU`). A thread inherits
//! the binding of the thread that starts it, so left alone every kvpool thread started from a
//! hook (its runtime's workers, the lookup server, the daemon client's watch) would share the
//! forward pass's core and take it whenever it woke. [`leave_inherited_cores`] moves the calling
//! thread to one set of CPUs per process, worked out by its first caller (a thread started
//! from the engine's bound thread): the other CPUs the process's threads may use (the union
//! of every thread's CPUs, so that a `taskset` or `numactl` binding of the whole engine is
//! kept), or, when the engine bound every thread of the process to the same cores (vLLM's
//! worker with `VLLM_CPU_OMP_THREADS_BIND=auto` on a small machine), every CPU the process is
//! allowed, for the scheduler to place. A thread already on that set stays: a thread started
//! by one kvpool moved inherits it.

/// Moves the calling thread onto the process's set for kvpool's threads (see the module
/// docs), worked out once, by the first call, from the CPUs that caller inherited: when an
/// engine bound the thread that started it. Nothing moves when nothing was bound (the first
/// caller may use every CPU the process is allowed), nor a thread already on the set.
/// Never fails: a thread it cannot move stays (logged at `debug`). A no-op off Linux.
pub fn leave_inherited_cores() {
    #[cfg(target_os = "linux")]
    linux::leave_inherited_cores();
}

/// The CPUs the calling thread may run on (Linux), for tests and logs.
#[cfg(target_os = "linux")]
pub fn this_threads_cpus() -> Vec<usize> {
    linux::cpus_of(&linux::affinity())
}

/// A multi-threaded tokio runtime for kvpool's work inside an engine's process: `workers`
/// threads named `name`, timers and I/O on, each of its threads (the blocking pool's too)
/// moved off the cores the thread that builds it inherited ([`leave_inherited_cores`]).
pub fn engine_side_runtime(name: &str, workers: usize) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name(name)
        .on_thread_start(leave_inherited_cores)
        .enable_all()
        .build()
}

#[cfg(target_os = "linux")]
mod linux {
    use std::mem::{size_of, zeroed};

    /// The calling thread's CPU set.
    pub(super) fn affinity() -> libc::cpu_set_t {
        // SAFETY: an all-zero cpu_set_t is the empty set.
        let mut set: libc::cpu_set_t = unsafe { zeroed() };
        // SAFETY: pid 0 is the calling thread; `set` is a valid set of its size.
        let rc = unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) };
        if rc != 0 {
            // Unknown: take every CPU, so that nothing is excluded.
            return every_cpu();
        }
        set
    }

    pub(super) fn cpus_of(set: &libc::cpu_set_t) -> Vec<usize> {
        (0..libc::CPU_SETSIZE as usize)
            // SAFETY: `cpu` is below CPU_SETSIZE, within the set.
            .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, set) })
            .collect()
    }

    fn every_cpu() -> libc::cpu_set_t {
        // SAFETY: an all-zero cpu_set_t is the empty set.
        let mut set: libc::cpu_set_t = unsafe { zeroed() };
        for cpu in 0..libc::CPU_SETSIZE as usize {
            // SAFETY: `cpu` is below CPU_SETSIZE, within the set.
            unsafe { libc::CPU_SET(cpu, &mut set) };
        }
        set
    }

    /// The CPUs any thread of this process may run on (the union of their sets); `None` if
    /// the threads cannot be listed.
    fn process_cpus() -> Option<Vec<usize>> {
        let mut cpus = std::collections::BTreeSet::new();
        for entry in std::fs::read_dir("/proc/self/task").ok()? {
            let Some(tid) = entry
                .ok()
                .and_then(|e| e.file_name().to_str()?.parse::<libc::pid_t>().ok())
            else {
                continue;
            };
            // SAFETY: an all-zero cpu_set_t is the empty set.
            let mut set: libc::cpu_set_t = unsafe { zeroed() };
            // SAFETY: `tid` is a thread id of this process (one that ended meanwhile fails
            // the call, skipped); `set` is a valid set of its size.
            let rc =
                unsafe { libc::sched_getaffinity(tid, size_of::<libc::cpu_set_t>(), &mut set) };
            if rc == 0 {
                cpus.extend(cpus_of(&set));
            }
        }
        Some(cpus.into_iter().collect())
    }

    /// Sets the calling thread's CPUs.
    fn set_affinity(set: &libc::cpu_set_t) -> std::io::Result<()> {
        // SAFETY: pid 0 is the calling thread; `set` is a valid set of its size.
        let rc = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), set) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// Every CPU the kernel lets this process use (its cpuset), read on a thread of its own
    /// that asks for every CPU; `None` if that thread cannot be started.
    fn allowed_cpus() -> Option<Vec<usize>> {
        std::thread::Builder::new()
            .name("kvpool-cpus".into())
            .spawn(|| {
                // The kernel narrows the request to the cpuset; a refusal leaves the set.
                let _ = set_affinity(&every_cpu());
                cpus_of(&affinity())
            })
            .ok()?
            .join()
            .ok()
    }

    /// The CPUs kvpool's threads go to, from what the first caller `inherited`: `None` when
    /// nothing was bound (it may use every allowed CPU).
    fn target_for(inherited: &[usize]) -> Option<Vec<usize>> {
        let allowed = allowed_cpus()?;
        if allowed.iter().all(|cpu| inherited.contains(cpu)) {
            return None;
        }
        let others: Vec<usize> = process_cpus()
            .unwrap_or_default()
            .into_iter()
            .filter(|cpu| !inherited.contains(cpu))
            .collect();
        Some(if others.is_empty() { allowed } else { others })
    }

    /// The process's set for kvpool's threads, worked out by the first caller.
    static TARGET: std::sync::OnceLock<Option<Vec<usize>>> = std::sync::OnceLock::new();

    pub(super) fn leave_inherited_cores() {
        let current = cpus_of(&affinity());
        let Some(target) = TARGET.get_or_init(|| target_for(&current)) else {
            return;
        };
        if current == *target {
            return; // already there: started by a thread that moved
        }
        // SAFETY: an all-zero cpu_set_t is the empty set.
        let mut set: libc::cpu_set_t = unsafe { zeroed() };
        for &cpu in target {
            // SAFETY: `cpu` came from a set, below CPU_SETSIZE.
            unsafe { libc::CPU_SET(cpu, &mut set) };
        }
        if let Err(e) = set_affinity(&set) {
            tracing::debug!("a kvpool thread keeps the CPUs it inherited: {e}");
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Runs the test named `name` (this module's) in a process of its own and asserts it
    /// passed: each test here sets thread affinities, and the per-process target set is
    /// worked out once, so tests sharing a process (`cargo test`, as the sanitizer stage
    /// runs them) would see each other's. Returns `true` in that process, where the test's
    /// body runs.
    fn in_own_process(name: &str) -> bool {
        const CHILD: &str = "KVPOOL_THREADS_TEST_CHILD";
        if std::env::var_os(CHILD).is_some() {
            return true;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                &format!("threads::tests::{name}"),
                "--exact",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{name} did not pass in its own process:\n{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        false
    }

    /// Binds the calling thread to `cpu` alone.
    fn bind_to(cpu: usize) {
        // SAFETY: an all-zero cpu_set_t is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `cpu` came from a set, below CPU_SETSIZE.
        unsafe { libc::CPU_SET(cpu, &mut set) };
        // SAFETY: pid 0 is the calling thread; `set` is a valid set of its size.
        let rc =
            unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    }

    /// A runtime built by a thread bound to one CPU (as vLLM binds the thread that calls
    /// kvpool's hooks) runs its workers and blocking threads on the process's other CPUs; with
    /// one CPU allowed, on that one.
    #[test]
    fn runtime_threads_leave_the_cpu_their_builder_was_bound_to() {
        if !in_own_process("runtime_threads_leave_the_cpu_their_builder_was_bound_to") {
            return;
        }
        let allowed = std::thread::spawn(this_threads_cpus).join().unwrap();
        let engine_cpu = allowed[0];
        let (worker_cpus, blocking_cpus, from_worker_cpus) = std::thread::spawn(move || {
            bind_to(engine_cpu);
            assert_eq!(this_threads_cpus(), [engine_cpu]);
            let runtime = engine_side_runtime("kvpool-test", 1).unwrap();
            let worker = runtime
                .block_on(async { tokio::spawn(async { this_threads_cpus() }).await.unwrap() });
            let blocking = runtime
                .block_on(async { tokio::task::spawn_blocking(this_threads_cpus).await })
                .unwrap();
            // A blocking thread started by a worker (one that moved already), while the
            // first blocking thread is busy: it must not move back onto the builder's CPU.
            let from_worker = runtime.block_on(async {
                let (busy, release) = std::sync::mpsc::channel::<()>();
                let held = tokio::task::spawn_blocking(move || release.recv());
                let cpus = tokio::spawn(async {
                    tokio::task::spawn_blocking(this_threads_cpus)
                        .await
                        .unwrap()
                })
                .await
                .unwrap();
                drop(busy);
                held.await.unwrap().ok();
                cpus
            });
            (worker, blocking, from_worker)
        })
        .join()
        .unwrap();
        let expected: Vec<usize> = if allowed.len() > 1 {
            allowed
                .iter()
                .copied()
                .filter(|&c| c != engine_cpu)
                .collect()
        } else {
            allowed.clone()
        };
        assert_eq!(worker_cpus, expected, "allowed {allowed:?}");
        assert_eq!(blocking_cpus, expected, "allowed {allowed:?}");
        assert_eq!(from_worker_cpus, expected, "allowed {allowed:?}");
    }

    /// A thread that inherited every allowed CPU keeps them all.
    #[test]
    fn a_thread_nothing_bound_keeps_every_allowed_cpu() {
        if !in_own_process("a_thread_nothing_bound_keeps_every_allowed_cpu") {
            return;
        }
        let allowed = std::thread::spawn(this_threads_cpus).join().unwrap();
        let after = std::thread::spawn(|| {
            leave_inherited_cores();
            this_threads_cpus()
        })
        .join()
        .unwrap();
        assert_eq!(after, allowed);
    }
    /// Where the engine bound every thread of the process to its core (vLLM's worker on a
    /// small machine), kvpool's threads get every CPU the process is allowed, for the
    /// scheduler to place, not the engine's core alone. (It binds the whole process, its own.)
    #[test]
    fn with_every_thread_bound_to_the_engines_core_kvpool_may_use_every_allowed_cpu() {
        if !in_own_process(
            "with_every_thread_bound_to_the_engines_core_kvpool_may_use_every_allowed_cpu",
        ) {
            return;
        }
        let allowed = std::thread::spawn(this_threads_cpus).join().unwrap();
        let engine_cpu = allowed[0];
        for entry in std::fs::read_dir("/proc/self/task").unwrap() {
            let tid: libc::pid_t = entry
                .unwrap()
                .file_name()
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            // SAFETY: an all-zero cpu_set_t is the empty set.
            let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            // SAFETY: `engine_cpu` came from a set, below CPU_SETSIZE.
            unsafe { libc::CPU_SET(engine_cpu, &mut set) };
            // SAFETY: `tid` is a thread of this process; `set` is a valid set of its size.
            unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) };
        }
        let worker_cpus = std::thread::spawn(move || {
            assert_eq!(this_threads_cpus(), [engine_cpu]);
            let runtime = engine_side_runtime("kvpool-test", 1).unwrap();
            runtime.block_on(async { tokio::spawn(async { this_threads_cpus() }).await.unwrap() })
        })
        .join()
        .unwrap();
        assert_eq!(worker_cpus, allowed);
    }
}
