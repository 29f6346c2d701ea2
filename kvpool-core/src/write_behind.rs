//! Bookkeeping of write-behind: how many batches are in flight, so `flush` and `close` can wait
//! for them.

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

/// Counts spawned write-behind batches; `wait_idle` returns once none is left.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    count: AtomicUsize,
    idle: Notify,
}

impl Pending {
    /// A batch was spawned.
    pub(crate) fn start(&self) {
        self.count.fetch_add(1, Ordering::SeqCst);
        metrics::gauge!(crate::telemetry::WRITE_BEHIND_PENDING).increment(1.0);
    }
    /// A batch ended (written, failed or unwound by a panic).
    pub(crate) fn finish(&self) {
        metrics::gauge!(crate::telemetry::WRITE_BEHIND_PENDING).decrement(1.0);
        if self.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.idle.notify_waiters();
        }
    }
    /// Waits until no batch is in flight.
    pub(crate) async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.count.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }
}
