//! `StatCounter`: the one lock-free counter behind every `stats()` snapshot.

use std::sync::atomic::{AtomicU64, Ordering};

/// A monotonically increasing count, updated and read without ordering other memory (a
/// statistic, never a synchronisation point).
#[derive(Debug, Default)]
pub struct StatCounter(AtomicU64);

impl StatCounter {
    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// The current count.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_from_many_threads_add_up() {
        let counter = StatCounter::default();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| (0..1000).for_each(|_| counter.add(2)));
            }
        });
        assert_eq!(counter.get(), 8000);
    }
}
