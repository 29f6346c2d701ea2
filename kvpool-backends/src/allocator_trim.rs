//! Handing the C allocator's free pages back to the operating system now and then
//! (`[allocator] release_free_pages_secs`).
//!
//! glibc's malloc keeps memory that was freed in its arenas for reuse and returns only the top
//! of each heap to the system. Under hours of churn (chunks, RocksDB blocks, reconnects) the
//! free but resident pages scattered through the heap add up: resident memory creeps up
//! although nothing is left allocated (docs/reliability.md, chaos soak). `malloc_trim(0)`
//! returns every whole free page. It is process-wide, so one thread does it for all pools.

use std::sync::OnceLock;
use std::time::Duration;

use tracing::{debug, info};

/// Returns the pages the C allocator holds free to the operating system; `true` when some
/// memory was released. Always `false` off glibc.
pub fn release_free_pages() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only walks and trims the allocator's own free lists, under the
        // allocator's locks; it is safe to call from any thread at any time.
        unsafe { libc::malloc_trim(0) != 0 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

/// The interval of the running release thread, once one was started.
static RELEASING_EVERY: OnceLock<Duration> = OnceLock::new();

/// Starts (once per process) a thread that calls [`release_free_pages`] every `every`; a later
/// call with another interval keeps the first. Does nothing off glibc.
pub fn start_periodic_release(every: Duration) -> std::io::Result<()> {
    if !cfg!(all(target_os = "linux", target_env = "gnu")) || every.is_zero() {
        return Ok(());
    }
    let mut started = Ok(());
    let running = RELEASING_EVERY.get_or_init(|| {
        started = std::thread::Builder::new()
            .name("kvpool-release-free-pages".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(every);
                    let released = release_free_pages();
                    debug!(
                        released,
                        "handed the C allocator's free pages back to the OS"
                    );
                }
            })
            .map(|_| ());
        if started.is_ok() {
            info!(
                every_secs = every.as_secs(),
                "releasing the C allocator's free pages periodically"
            );
        }
        every
    });
    if *running != every {
        debug!(
            running_secs = running.as_secs(),
            asked_secs = every.as_secs(),
            "free-page release already runs at another interval"
        );
    }
    started
}
