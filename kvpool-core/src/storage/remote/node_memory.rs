//! `NodeMemoryConnector`: what a tier lying in memory on this node (the pool daemon) adds to
//! [`RemoteConnector`]: reads and writes with one copy, and values lent where they lie.

use std::sync::Arc;

use async_trait::async_trait;

use super::RemoteConnector;
use crate::error::BackendError;
use crate::memory::SharedMapping;
use crate::storage::node_memory::PinnedBytes;
use crate::storage::save_slot::LentBytes;

/// What a read of node memory does with one value it found
/// ([`NodeMemoryConnector::batch_copy_out`]): given the value's index in the batch and its
/// bytes where they lie (which another process can write), copies them into this process's
/// memory and checks the copy. The reader keeps what it copied, under that index; a tier only
/// hands out bytes.
pub type CopyOut = Arc<dyn Fn(usize, &[u8]) + Send + Sync>;

/// What a write to node memory does with one value ([`NodeMemoryConnector::batch_copy_in`]):
/// given the value's index in the batch and the memory the tier allocated for it, exactly as
/// long as asked, writes the value there.
pub type CopyIn = Arc<dyn Fn(usize, &mut [u8]) + Send + Sync>;

/// The extension a tier implements when its values lie in memory on this node that this
/// process maps (the node's pool daemon, `kvpool serve`), offered through
/// [`RemoteConnector::node_memory`].
///
/// A read is then a copy out of memory, with no network or disk I/O: a lookup loads such a
/// tier's chunks at once, before the request's forward pass, like an L1 hit. Every method is
/// required, so a wrapper (a timeout, a fault injector) forwards each one by construction.
#[async_trait]
pub trait NodeMemoryConnector: Send + Sync {
    /// Whether the tier lends values where they lie ([`NodeMemoryConnector::batch_pin`]) and
    /// places for values to be written where they will lie
    /// ([`NodeMemoryConnector::batch_lend`]), so a reader or a writer copies once, straight
    /// between that memory and the engine's blocks; `false` for a tier that only reads and
    /// writes in place (`batch_copy_out`, `batch_copy_in`).
    fn lends(&self) -> bool;

    /// This process's mapping of the tier's memory as mapped now (`None` before the first
    /// attach), for a reader to register for DMA (CUDA's page-locking) for as long as it holds
    /// the mapping.
    fn node_memory_mapping(&self) -> Option<Arc<SharedMapping>>;

    /// Reads the values of `keys` where that memory holds them and hands each one found, as
    /// `copy_out(i, bytes)` for `keys[i]`, to `copy_out` while the tier keeps it pinned;
    /// `copy_out` copies it into this process's memory and checks the copy (one copy, where
    /// [`RemoteConnector::batch_get`] is two). With `resident_only`, only the values that
    /// memory holds are read, and no slower storage behind it (the daemon's own lower tiers),
    /// so that a lookup's load never waits on a disk or a network.
    async fn batch_copy_out(
        &self,
        keys: &[String],
        resident_only: bool,
        copy_out: CopyOut,
    ) -> Result<(), BackendError>;

    /// Stores a value of each length under its key, each written by `copy_in` straight into
    /// the memory the tier allocated for it (one copy, where [`RemoteConnector::batch_put`] is
    /// two). A value becomes visible only once written.
    async fn batch_copy_in(
        &self,
        entries: Vec<(String, usize)>,
        copy_in: CopyIn,
    ) -> Result<(), BackendError>;

    /// Pins the values of `keys` that the tier's memory holds (reading no slower storage
    /// behind it) and lends each where it lies until its [`PinnedBytes`] is dropped.
    async fn batch_pin(&self, keys: &[String]) -> Result<Vec<Option<PinnedBytes>>, BackendError>;

    /// Allocates a value of each length where it will lie, outside the tier's index until
    /// [committed](NodeMemoryConnector::batch_commit_lent), and lends it to be written there
    /// (`None` where there was no room).
    async fn batch_lend(&self, lens: &[usize]) -> Result<Vec<Option<LentBytes>>, BackendError>;

    /// Publishes values written into memory this tier [lent](NodeMemoryConnector::batch_lend),
    /// each under its key; returns how many were stored (a loan past its time, or one the tier
    /// no longer knows, stores nothing).
    async fn batch_commit_lent(
        &self,
        entries: Vec<(String, LentBytes)>,
    ) -> Result<usize, BackendError>;
}

/// The node-memory side of `connector`, for a wrapper forwarding to the tier it wraps: an
/// error (never a panic) if that tier has none, which a wrapper that offers the side only when
/// its inner tier does never sees.
pub fn node_memory_of<C: RemoteConnector + ?Sized>(
    connector: &C,
) -> Result<&dyn NodeMemoryConnector, BackendError> {
    connector
        .node_memory()
        .ok_or_else(|| BackendError::Unavailable {
            backend: connector.name().to_string(),
            reason: "the tier does not lie in node memory".into(),
        })
}

/// Whether `connector`'s node-memory side lends ([`NodeMemoryConnector::lends`]); `false` when
/// it has none. What a wrapper's `lends` answers for the tier it wraps.
pub fn lends_node_memory_of<C: RemoteConnector + ?Sized>(connector: &C) -> bool {
    connector.node_memory().is_some_and(|tier| tier.lends())
}

/// `connector`'s node-memory mapping ([`NodeMemoryConnector::node_memory_mapping`]); `None`
/// when it has no node-memory side. What a wrapper's `node_memory_mapping` answers for the
/// tier it wraps.
pub fn node_memory_mapping_of<C: RemoteConnector + ?Sized>(
    connector: &C,
) -> Option<Arc<SharedMapping>> {
    connector
        .node_memory()
        .and_then(|tier| tier.node_memory_mapping())
}
