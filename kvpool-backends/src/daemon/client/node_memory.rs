//! The daemon tier's node-memory side: values read and written where they lie in the
//! daemon's shared arena (copied out, copied in, pinned, lent, committed).

use std::sync::Arc;

use async_trait::async_trait;
use kvpool_core::memory::SharedMapping;
use kvpool_core::{BackendError, CopyIn, CopyOut, LentBytes, NodeMemoryConnector, PinnedBytes};

use super::DaemonConnector;

#[async_trait]
impl NodeMemoryConnector for DaemonConnector {
    /// Values are lent where they lie in the shared arena, pinned, and places for saves.
    fn lends(&self) -> bool {
        true
    }

    /// The arena of the daemon attached last, as mapped here.
    fn node_memory_mapping(&self) -> Option<Arc<SharedMapping>> {
        self.inner
            .arena
            .lock()
            .as_ref()
            .map(|(_, mapping)| mapping.clone())
    }

    async fn batch_pin(&self, keys: &[String]) -> Result<Vec<Option<PinnedBytes>>, BackendError> {
        let keys = keys.to_vec();
        self.blocking(move |inner| inner.pin(keys)).await
    }

    async fn batch_lend(&self, lens: &[usize]) -> Result<Vec<Option<LentBytes>>, BackendError> {
        let lens = lens.to_vec();
        self.blocking(move |inner| inner.lend(lens)).await
    }

    async fn batch_commit_lent(
        &self,
        entries: Vec<(String, LentBytes)>,
    ) -> Result<usize, BackendError> {
        self.blocking(move |inner| inner.commit_lent(entries)).await
    }

    /// Hands each value to `copy_out` where it lies in the arena, pinned: one copy, from the
    /// arena into the reader's buffer (L1's pool).
    async fn batch_copy_out(
        &self,
        keys: &[String],
        resident_only: bool,
        copy_out: CopyOut,
    ) -> Result<(), BackendError> {
        let keys = keys.to_vec();
        self.blocking(move |inner| {
            inner
                .read(keys, resident_only, |i, bytes| copy_out(i, bytes))
                .map(drop)
        })
        .await
    }

    /// Encodes each value once, from the caller's memory (L1's pool) into the arena.
    async fn batch_copy_in(
        &self,
        entries: Vec<(String, usize)>,
        copy_in: CopyIn,
    ) -> Result<(), BackendError> {
        self.blocking(move |inner| inner.write(entries, |i, dst| copy_in(i, dst)))
            .await
    }
}
