//! Where kvpool's own threads run inside an engine's process: off the cores the engine bound
//! its forward pass to.
//!
//! vLLM's CPU worker binds its OpenMP threads, the thread that calls kvpool's hooks among
//! them, to the cores it keeps for the forward pass (`VLLM_CPU_OMP_THREADS_BIND`), and keeps
//! others free for the engine's own threads (`VLLM_CPU_NUM_OF_RESERVED_CPU`). A thread inherits
//! the binding of the thread that starts it, so left alone every kvpool thread started from a
//! hook (its runtime's workers, the lookup server, the daemon client's watch) would share the
//! forward pass's core and take it whenever it woke. [`leave_inherited_cores`] moves the calling
//! thread to the other CPUs the process's threads may use: the union of every thread's CPUs,
//! so that a `taskset` or `numactl` binding of the whole engine is kept.

/// Moves the calling thread off the CPUs it inherited, onto the others the process's threads
/// may use (the union of every thread's CPUs), when there are others: an engine bound the
/// thread that started this one to its cores. Otherwise (nothing was bound, or the process
/// has no other CPU) the thread stays where it is. Never fails: a thread it cannot move stays
/// (logged at `debug`). A no-op off Linux.
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

    pub(super) fn leave_inherited_cores() {
        let inherited = cpus_of(&affinity());
        let Some(process) = process_cpus() else {
            return;
        };
        let others: Vec<usize> = process
            .into_iter()
            .filter(|cpu| !inherited.contains(cpu))
            .collect();
        if others.is_empty() {
            return;
        }
        // SAFETY: an all-zero cpu_set_t is the empty set.
        let mut set: libc::cpu_set_t = unsafe { zeroed() };
        for &cpu in &others {
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
        let allowed = std::thread::spawn(this_threads_cpus).join().unwrap();
        let engine_cpu = allowed[0];
        let (worker_cpus, blocking_cpus) = std::thread::spawn(move || {
            bind_to(engine_cpu);
            assert_eq!(this_threads_cpus(), [engine_cpu]);
            let runtime = engine_side_runtime("kvpool-test", 1).unwrap();
            let worker = runtime
                .block_on(async { tokio::spawn(async { this_threads_cpus() }).await.unwrap() });
            let blocking = runtime
                .block_on(async { tokio::task::spawn_blocking(this_threads_cpus).await })
                .unwrap();
            (worker, blocking)
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
    }

    /// A thread that inherited every allowed CPU keeps them all.
    #[test]
    fn a_thread_nothing_bound_keeps_every_allowed_cpu() {
        let allowed = std::thread::spawn(this_threads_cpus).join().unwrap();
        let after = std::thread::spawn(|| {
            leave_inherited_cores();
            this_threads_cpus()
        })
        .join()
        .unwrap();
        assert_eq!(after, allowed);
    }
}
