//! Publishing the scheduler's counters, shipped in each step's metadata, as metrics of the
//! worker's process (the scheduler process serves none).
//!
//! Each worker adds what the counters grew by since it last saw them, so the parts of a hybrid
//! model (one scheduler and one worker each, all in the same process) sum into one series
//! rather than overwrite one another's totals.

use kvpool_core::telemetry;

use crate::vllm::metadata::SchedulerCounters;

/// The scheduler's counters as one worker last published them.
#[derive(Debug, Default)]
pub(super) struct PublishedSchedulerCounters {
    seen: SchedulerCounters,
}

impl PublishedSchedulerCounters {
    /// Publishes `now`, the scheduler's counters at this step: counters grow by what they grew
    /// since the last call, the gauge of open breakers moves by this worker's change.
    pub(super) fn publish(&mut self, now: &SchedulerCounters) {
        let seen = &self.seen;
        metrics::counter!(telemetry::LOOKUP_BREAKER_MISSES)
            .increment(growth(now.breaker_misses, seen.breaker_misses));
        metrics::counter!(telemetry::BROKEN_PROMISES)
            .increment(growth(now.broken_promises, seen.broken_promises));
        metrics::counter!(telemetry::TRACKERS_DROPPED)
            .increment(growth(now.trackers_dropped, seen.trackers_dropped));
        metrics::counter!(telemetry::SCHEDULER_LOOKUPS, "route" => "in_process")
            .increment(growth(now.lookups_in_process, seen.lookups_in_process));
        metrics::counter!(telemetry::SCHEDULER_LOOKUPS, "route" => "socket")
            .increment(growth(now.lookups_over_sockets, seen.lookups_over_sockets));
        metrics::gauge!(telemetry::LOOKUP_BREAKERS_OPEN)
            .increment(f64::from(now.breakers_open) - f64::from(seen.breakers_open));
        self.seen = *now;
    }
}

impl Drop for PublishedSchedulerCounters {
    /// A worker that ends takes its open breakers out of the gauge (its counts stay counted).
    fn drop(&mut self) {
        metrics::gauge!(telemetry::LOOKUP_BREAKERS_OPEN)
            .decrement(f64::from(self.seen.breakers_open));
    }
}

/// What a counter grew by from `seen` to `now`; a count below the last one seen belongs to a
/// scheduler that started again from zero, so all of it is new.
fn growth(now: u64, seen: u64) -> u64 {
    if now >= seen { now - seen } else { now }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

    use super::*;

    /// The metrics' values by name and labels (`name{k=v}`), summed over snapshots (the
    /// debugging recorder's snapshot hands what each value moved by since the last one).
    struct Readings {
        snapshotter: Snapshotter,
        values: HashMap<String, f64>,
    }

    impl Readings {
        fn read(&mut self) -> &HashMap<String, f64> {
            for (key, _, _, value) in self.snapshotter.snapshot().into_vec() {
                let key = key.key();
                let labels: Vec<String> = key
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect();
                let name = format!("{}{{{}}}", key.name(), labels.join(","));
                let moved = match value {
                    DebugValue::Counter(v) => v as f64,
                    DebugValue::Gauge(v) => v.into_inner(),
                    DebugValue::Histogram(_) => continue,
                };
                *self.values.entry(name).or_default() += moved;
            }
            &self.values
        }
    }

    fn counters(in_process: u64, socket: u64, breakers_open: u32) -> SchedulerCounters {
        SchedulerCounters {
            lookups_in_process: in_process,
            lookups_over_sockets: socket,
            breakers_open,
            breaker_misses: in_process / 2,
            ..SchedulerCounters::default()
        }
    }

    #[test]
    fn the_parts_of_a_hybrid_model_sum_into_one_series() {
        let recorder = DebuggingRecorder::new();
        let mut readings = Readings {
            snapshotter: recorder.snapshotter(),
            values: HashMap::new(),
        };
        let in_process = format!("{}{{route=in_process}}", telemetry::SCHEDULER_LOOKUPS);
        let socket = format!("{}{{route=socket}}", telemetry::SCHEDULER_LOOKUPS);
        let misses = format!("{}{{}}", telemetry::LOOKUP_BREAKER_MISSES);
        let open = format!("{}{{}}", telemetry::LOOKUP_BREAKERS_OPEN);
        metrics::with_local_recorder(&recorder, || {
            // Two parts (one scheduler, one worker each) step by step.
            let (mut full, mut sliding) = (
                PublishedSchedulerCounters::default(),
                PublishedSchedulerCounters::default(),
            );
            full.publish(&counters(5, 1, 1));
            sliding.publish(&counters(3, 0, 1));
            full.publish(&counters(7, 2, 0));
            sliding.publish(&counters(4, 0, 1));
            let values = readings.read();
            assert_eq!(values[&in_process], 11.0, "{values:?}");
            assert_eq!(values[&socket], 2.0, "{values:?}");
            assert_eq!(values[&misses], 5.0, "{values:?}");
            assert_eq!(values[&open], 1.0, "{values:?}");
            drop(sliding);
            assert_eq!(readings.read()[&open], 0.0);
            // A scheduler that started again counts from zero: all of it is new.
            full.publish(&counters(2, 0, 0));
            assert_eq!(readings.read()[&in_process], 13.0);
        });
    }
}
