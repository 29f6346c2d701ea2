//! kvpool-backends: storage tiers, one cargo feature each, and the pool builder.
//!
//! | feature | module | tier |
//! |---|---|---|
//! | `cpu` (default) | [`cpu`] | L1: bounded local CPU memory with LRU / FIFO / S3-FIFO eviction |
//!
//! Lower tiers (disk, Redis, S3, Mooncake) plug in through `kvpool_core::RemoteConnector` or
//! `kvpool_core::StorageBackend`.

#![warn(missing_docs)]

#[cfg(feature = "cpu")]
pub mod cpu;
pub mod pool_builder;

#[cfg(feature = "cpu")]
pub use cpu::LocalCpuBackend;
pub use pool_builder::{Pool, build_pool, build_pool_with_allocator};
