//! Background work that gives a contested CPU back: after each slice of work, a pause while
//! other tasks wait for a CPU, measured by Linux's CPU pressure (`/proc/pressure/cpu`).
//!
//! A thread's nice value orders it only against threads of the same scheduling group. Linux
//! groups threads by session (autogroup) or by cgroup (a systemd service, a container), and
//! gives each group an equal share of a contested CPU whatever its threads' nice values: a
//! nice-19 thread of `kvpool serve`, started by systemd or from another shell than the
//! engine, takes as much of a core from the engine as a thread at nice 0 would (measured:
//! docs/benchmarks.md, "the daemon's low priority does not cross its scheduling group").
//! Work that must yield to another process therefore yields by itself: a [`CpuPacer`] pauses
//! it while the CPU is contested and lets it run at full speed while there is room.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use tracing::debug;

/// How long a pause is after a contested slice, as a multiple of the slice: work that keeps
/// finding the CPU contested takes at most a fifth of the time it runs in.
const PAUSE_PER_SLICE: u32 = 4;

/// The shortest pause.
const MIN_PAUSE: Duration = Duration::from_millis(1);

/// The longest pause after one slice, however long the CPU stays contested: work paced so
/// still goes on, at a slice per this much time at the least.
const MAX_PAUSE: Duration = Duration::from_millis(100);

/// A window is contested when other tasks waited for a CPU for at least this share of it.
const CONTESTED_SHARE: f64 = 0.2;

/// The time, in microseconds since boot, that some task waited for a CPU: the `total` of
/// `/proc/pressure/cpu`'s `some` line, or `None` where it cannot be read.
pub(crate) type StalledMicros = Arc<dyn Fn() -> Option<u64> + Send + Sync>;

/// Paces background work so that it gives the CPU back while other tasks wait for one.
#[derive(Clone)]
pub(crate) struct CpuPacer {
    /// Where the time tasks waited for a CPU is read; `None`: never pauses.
    stalled: Option<StalledMicros>,
}

/// A slice of paced work under way: when it started, and the stall counter then.
pub(crate) struct Slice {
    started: Instant,
    stalled_at_start: Option<u64>,
}

impl CpuPacer {
    /// A pacer over the system's CPU pressure, or one that never pauses (logged at `debug`)
    /// where the kernel has none (not Linux, or a kernel without PSI).
    pub(crate) fn system() -> Self {
        let stalled: StalledMicros = Arc::new(system_cpu_stalled_micros);
        if stalled().is_none() {
            debug!("no CPU pressure to read (/proc/pressure/cpu); background work is not paced");
            return CpuPacer { stalled: None };
        }
        CpuPacer {
            stalled: Some(stalled),
        }
    }

    /// A pacer over `stalled` (tests).
    #[cfg(test)]
    pub(crate) fn over(stalled: StalledMicros) -> Self {
        CpuPacer {
            stalled: Some(stalled),
        }
    }

    /// Marks the start of a slice of work.
    pub(crate) fn start_slice(&self) -> Slice {
        Slice {
            started: Instant::now(),
            stalled_at_start: self.stalled.as_ref().and_then(|stalled| stalled()),
        }
    }

    /// Gives way after `slice`: when other tasks waited for a CPU for a fifth of the slice or
    /// more, pauses [`PAUSE_PER_SLICE`] times its length (at least [`MIN_PAUSE`]), and again
    /// for as long as they keep waiting through the pause, up to [`MAX_PAUSE`] in all.
    /// Returns how long it paused.
    pub(crate) async fn give_way(&self, slice: Slice) -> Duration {
        let Some(stalled) = self.stalled.as_ref() else {
            return Duration::ZERO;
        };
        let mut window_start = slice.started;
        let mut stalled_at_window_start = slice.stalled_at_start;
        let mut paused = Duration::ZERO;
        loop {
            let now = Instant::now();
            let stalled_now = stalled();
            let window = now.saturating_duration_since(window_start);
            let (Some(before), Some(after)) = (stalled_at_window_start, stalled_now) else {
                return paused;
            };
            let waited = Duration::from_micros(after.saturating_sub(before));
            if waited.as_secs_f64() < CONTESTED_SHARE * window.as_secs_f64() {
                return paused;
            }
            let pause = (window * PAUSE_PER_SLICE)
                .max(MIN_PAUSE)
                .min(MAX_PAUSE.saturating_sub(paused));
            if pause.is_zero() {
                return paused;
            }
            tokio::time::sleep(pause).await;
            paused += pause;
            window_start = now;
            stalled_at_window_start = stalled_now;
        }
    }
}

/// The `total` of the `some` line of `/proc/pressure/cpu` (microseconds in which some task
/// waited for a CPU), or `None` where it cannot be read.
fn system_cpu_stalled_micros() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/pressure/cpu").ok()?;
    some_total_micros(&text)
}

/// The `total=` of the `some` line of a pressure file's `text`.
fn some_total_micros(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix("some "))?
        .split_whitespace()
        .find_map(|field| field.strip_prefix("total="))?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    #[test]
    fn the_stall_total_is_read_from_the_some_line() {
        let text = "some avg10=4.59 avg60=13.55 avg300=7.47 total=44517608\n\
                    full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
        assert_eq!(some_total_micros(text), Some(44_517_608));
        assert_eq!(some_total_micros("full avg10=0.00 total=5\n"), None);
        assert_eq!(some_total_micros(""), None);
    }

    /// A stall counter that `advance` moves on by hand, and a pacer over it.
    fn pacer() -> (CpuPacer, Arc<AtomicU64>) {
        let counter = Arc::new(AtomicU64::new(1_000));
        let read = counter.clone();
        (
            CpuPacer::over(Arc::new(move || Some(read.load(Ordering::SeqCst)))),
            counter,
        )
    }

    /// Runs 10 ms of "work" (time moved on by hand) in which other tasks waited `waited_ms`.
    async fn slice_with(pacer: &CpuPacer, counter: &AtomicU64, waited_ms: u64) -> Slice {
        let slice = pacer.start_slice();
        tokio::time::advance(Duration::from_millis(10)).await;
        counter.fetch_add(waited_ms * 1_000, Ordering::SeqCst);
        slice
    }

    #[tokio::test(start_paused = true)]
    async fn a_slice_nobody_waited_through_goes_on_at_once() {
        let (pacer, counter) = pacer();
        let slice = slice_with(&pacer, &counter, 1).await;
        assert_eq!(pacer.give_way(slice).await, Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_contested_slice_pauses_four_times_its_length_and_no_more_once_the_cpu_is_free() {
        let (pacer, counter) = pacer();
        let slice = slice_with(&pacer, &counter, 5).await;
        // Nobody waits during the pause: one pause of 4 x 10 ms.
        assert_eq!(pacer.give_way(slice).await, Duration::from_millis(40));
    }

    #[tokio::test(start_paused = true)]
    async fn a_cpu_that_stays_contested_holds_the_work_back_at_most_the_longest_pause() {
        let (pacer, counter) = pacer();
        let slice = slice_with(&pacer, &counter, 10).await;
        // Every read finds other tasks waited a long time since the last.
        let busy = CpuPacer::over(Arc::new(move || {
            Some(counter.fetch_add(1_000_000, Ordering::SeqCst))
        }));
        let started = tokio::time::Instant::now();
        assert_eq!(busy.give_way(slice).await, MAX_PAUSE);
        assert_eq!(started.elapsed(), MAX_PAUSE);
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_pressure_reading_nothing_pauses() {
        let pacer = CpuPacer { stalled: None };
        let slice = pacer.start_slice();
        tokio::time::advance(Duration::from_millis(10)).await;
        assert_eq!(pacer.give_way(slice).await, Duration::ZERO);
        let unreadable = CpuPacer::over(Arc::new(|| None));
        let slice = unreadable.start_slice();
        assert_eq!(unreadable.give_way(slice).await, Duration::ZERO);
    }
}
