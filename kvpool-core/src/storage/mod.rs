//! Storage: the `StorageBackend` and `RemoteConnector` traits a tier implements, and the storage
//! manager that orders tiers, looks up prefixes, promotes into L1 and writes behind, with each
//! tier's counters and KV events.

pub mod backend;
pub mod manager;
pub mod node_memory;
pub mod remote;
#[cfg(test)]
mod remote_tests;
pub mod save_slot;
mod tier;
pub mod tier_events;
mod tier_stats;
pub mod write_behind;

pub use backend::{
    BackendCounters, BackendStats, Chunk, ChunkAllocator, ChunkVisit, HeapChunkAllocator,
    NodeMemoryBackend, PutOutcome, StorageBackend,
};
pub use manager::{LentSaveSlots, ManagerStats, StorageManager, StorageManagerConfig, TierStats};
pub use node_memory::{PinnedBytes, SharedChunk};
pub use remote::{CopyIn, CopyOut, NodeMemoryConnector, RemoteBackend, RemoteConnector};
pub use save_slot::{LentBytes, SaveSlot};
