//! How long kvpool's native calls from vLLM's worker hooks take: a histogram per call
//! (`kvpool_connector_call_seconds{call}`) and, per engine step and worker, one `debug` event
//! (target `kvpool::step`) with the step's interval beside kvpool's native time in it, so
//! that a long gap between two decode steps can be put down to kvpool or cleared of it. A
//! hybrid model's attention groups each have a worker, so a step logs one event per group
//! (`part`), and each tensor-parallel rank logs its own (`rank`); the Python side's own work
//! (torch copies when no native copy engine runs, the recurrent-state parts' reads and
//! writes) is not in it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvpool_core::telemetry;

/// The per-step log target.
pub const STEP_TARGET: &str = "kvpool::step";

/// kvpool's time in each call of one step.
#[derive(Debug, Default)]
struct StepCalls {
    /// When the previous step ended (its `clear_connector_metadata`).
    previous_end: Option<Instant>,
    /// Each call's total time in this step and how often it ran, in the order first called.
    calls: Vec<(&'static str, Duration, u32)>,
}

/// What one step spent in kvpool, as [`StepTimer::end_step`] reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct StepSummary {
    /// From the previous step's end to this one's (`None` for the first step).
    pub interval: Option<Duration>,
    /// kvpool's time in all calls of the step.
    pub in_kvpool: Duration,
    /// Each call's total time and count, in the order first called.
    pub calls: Vec<(&'static str, Duration, u32)>,
}

impl StepSummary {
    /// `bind 0.12 ms, run_loads 3.40 ms ×2`: the calls as one log field.
    pub fn calls_summary(&self) -> String {
        let parts: Vec<String> = self
            .calls
            .iter()
            .map(|(call, took, n)| {
                let ms = took.as_secs_f64() * 1e3;
                if *n > 1 {
                    format!("{call} {ms:.2} ms ×{n}")
                } else {
                    format!("{call} {ms:.2} ms")
                }
            })
            .collect();
        parts.join(", ")
    }
}

/// Times a worker's calls and ends its steps. One per worker; calls from several threads are
/// counted in the step they end in.
#[derive(Debug)]
pub struct StepTimer {
    /// Which worker's steps these are (a hybrid model's KV cache group), logged with each.
    part: String,
    /// The worker's tensor-parallel rank, logged with each step.
    rank: u32,
    step: Mutex<StepCalls>,
}

impl StepTimer {
    /// A timer for the worker of `part` (its KV format, which names a hybrid model's group)
    /// at tensor-parallel rank `rank`.
    pub fn new(part: impl Into<String>, rank: u32) -> Self {
        Self {
            part: part.into(),
            rank,
            step: Mutex::default(),
        }
    }

    /// Runs `f` as the call named `call`, records its time in the histogram and in this step.
    pub fn time<T>(&self, call: &'static str, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        let took = start.elapsed();
        metrics::histogram!(telemetry::CONNECTOR_CALL_SECONDS, "call" => call)
            .record(took.as_secs_f64());
        let mut step = self.step.lock().unwrap_or_else(|e| e.into_inner());
        match step.calls.iter_mut().find(|(c, _, _)| *c == call) {
            Some((_, total, n)) => {
                *total += took;
                *n += 1;
            }
            None => step.calls.push((call, took, 1)),
        }
        out
    }

    /// Ends a step (vLLM's `clear_connector_metadata`, the last hook of each step): logs it at
    /// `debug` on [`STEP_TARGET`] and starts the next. Returns what the step spent in kvpool.
    pub fn end_step(&self) -> StepSummary {
        let now = Instant::now();
        let mut step = self.step.lock().unwrap_or_else(|e| e.into_inner());
        let interval = step.previous_end.map(|end| now - end);
        step.previous_end = Some(now);
        let calls = std::mem::take(&mut step.calls);
        drop(step);
        let summary = StepSummary {
            interval,
            in_kvpool: calls.iter().map(|(_, took, _)| *took).sum(),
            calls,
        };
        tracing::debug!(
            target: STEP_TARGET,
            rank = self.rank,
            part = %self.part,
            interval_ms = summary.interval.map(|i| i.as_secs_f64() * 1e3),
            kvpool_ms = summary.in_kvpool.as_secs_f64() * 1e3,
            calls = %summary.calls_summary(),
            "step"
        );
        summary
    }
}

#[cfg(test)]
mod tests {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    use super::*;

    #[test]
    fn a_step_sums_its_calls_and_the_histogram_records_each() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let timer = StepTimer::new("fmt|kv", 3);
        let first = metrics::with_local_recorder(&recorder, || {
            timer.time("bind", || std::thread::sleep(Duration::from_millis(2)));
            let loaded = timer.time("run_loads", || 7);
            assert_eq!(loaded, 7, "the call's result is handed back");
            timer.time("run_loads", || std::thread::sleep(Duration::from_millis(1)));
            timer.end_step()
        });
        assert_eq!(first.interval, None, "the first step has no previous end");
        let names: Vec<_> = first.calls.iter().map(|(c, _, n)| (*c, *n)).collect();
        assert_eq!(names, [("bind", 1), ("run_loads", 2)]);
        assert!(first.calls[0].1 >= Duration::from_millis(2));
        assert!(first.in_kvpool >= Duration::from_millis(3));
        assert_eq!(
            first.in_kvpool,
            first.calls.iter().map(|(_, d, _)| *d).sum::<Duration>()
        );
        assert!(first.calls_summary().contains("run_loads"));
        assert!(first.calls_summary().contains("×2"));

        let mut recorded = Vec::new();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let key = key.key();
            assert_eq!(key.name(), telemetry::CONNECTOR_CALL_SECONDS);
            let call = key
                .labels()
                .next()
                .expect("a call label")
                .value()
                .to_string();
            let DebugValue::Histogram(samples) = value else {
                panic!("{call} is not a histogram");
            };
            recorded.push((call, samples.len()));
        }
        recorded.sort();
        assert_eq!(
            recorded,
            [("bind".to_string(), 1), ("run_loads".to_string(), 2)]
        );

        // The next step starts empty and measures its interval from the first's end.
        std::thread::sleep(Duration::from_millis(2));
        let second = timer.end_step();
        assert!(second.calls.is_empty());
        assert_eq!(second.in_kvpool, Duration::ZERO);
        assert!(second.interval.expect("an interval") >= Duration::from_millis(2));
    }

    /// Each step's event names the worker's part and tensor-parallel rank beside its
    /// interval and calls, so two ranks' lines can be told apart.
    #[test]
    fn a_steps_event_names_its_part_and_rank() {
        #[derive(Clone, Default)]
        struct Lines(std::sync::Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Lines {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let timer = StepTimer::new("llama|kv=bf16", 1);
            timer.time("bind", || ());
            timer.end_step();
        });
        let logged = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        assert!(logged.contains("kvpool::step"), "{logged}");
        assert!(logged.contains("rank=1"), "{logged}");
        assert!(logged.contains("part=llama|kv=bf16"), "{logged}");
        assert!(logged.contains("calls=bind"), "{logged}");
    }
}
