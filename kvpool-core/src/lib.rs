//! kvpool-core: the pieces every kvpool deployment shares.
//!
//! - [`layout`]: the KV layout of a model and its fingerprint;
//! - [`key`] and [`chunk_hash`]: chained chunk hashes and storage keys;
//! - [`token_database`]: token ids (or engine block hashes) to chunk spans and keys;
//! - [`backend`] and [`remote`]: the `StorageBackend` and `RemoteConnector` traits and the
//!   adapter between them;
//! - [`chunk_format`]: the checksummed, versioned stored-chunk encoding;
//! - [`memory_pool`]: the bounded host memory pool and ref-counted chunk memory;
//! - [`eviction`]: LRU, FIFO and S3-FIFO;
//! - [`storage_manager`]: ordered tiers, prefix lookup, promotion and write-behind (each tier
//!   in `tier.rs`, its counters in `tier_stats.rs`, write-behind in `write_behind.rs`);
//! - [`counter`]: `StatCounter`, the lock-free counter behind every `stats()` snapshot;
//! - [`telemetry`]: every Prometheus metric kvpool records, with help texts;
//! - [`tier_events`]: chunks entering and leaving each tier, for an engine's KV-event stream;
//! - [`cache_engine`]: lookup / store / retrieve of token sequences;
//! - [`transfer`]: moving KV between a paged cache and chunk memory by slot mapping (the
//!   library's store / retrieve; the vLLM connector moves whole blocks with copy jobs instead);
//! - [`config`]: the TOML configuration ([`byte_size`]: sizes such as `"2GiB"`);
//! - [`tier_options`]: a tier's backend-owned options, read with typed getters.

#![warn(missing_docs)]

pub mod backend;
pub mod byte_size;
pub mod cache_engine;
pub mod chunk_format;
pub mod chunk_hash;
pub mod config;
pub mod counter;
pub mod error;
pub mod eviction;
pub mod key;
pub mod layout;
pub mod memory_pool;
pub mod remote;
pub mod storage_manager;
pub mod telemetry;
mod tier;
pub mod tier_events;
pub mod tier_options;
mod tier_stats;
pub mod token_database;
pub mod transfer;
mod write_behind;

pub use backend::{
    BackendCounters, BackendStats, Chunk, ChunkAllocator, HeapChunkAllocator, PutOutcome,
    StorageBackend,
};
pub use cache_engine::{
    CacheEngine, EngineStats, FetchedChunks, LayerwiseRetrieve, LayerwiseStore, StoreReport,
};
pub use chunk_format::{ChecksumAlgorithm, ChunkCodec, ChunkMeta, Compression};
pub use chunk_hash::{ChunkHash, HashAlgorithm};
pub use config::{AllocatorConfig, ByteSize, MetricsConfig, PoolConfig, TierConfig, redact_url};
pub use counter::StatCounter;
pub use error::{
    BackendError, ConfigError, EngineError, FormatError, KeyParseError, LayoutError, PoolError,
    TokenError, TransferError,
};
pub use eviction::{EvictionKind, EvictionPolicy};
pub use key::{CacheKey, KeyScope};
pub use layout::{Dtype, KvKind, KvLayout};
pub use memory_pool::{
    HeapAllocator, HostAllocator, HostArena, MemoryObj, MemoryObjMut, MemoryPool,
};
pub use remote::{RemoteBackend, RemoteConnector};
pub use storage_manager::{ManagerStats, StorageManager, StorageManagerConfig, TierStats};
pub use tier_options::{TierOptionValue, TierOptions, TierOptionsReader};
pub use token_database::{ChunkHasher, ChunkSpan, ChunkedTokenDatabase, ChunkingConfig};
pub use transfer::{ChunkWindow, HostPagedKvCache, KvTransfer};
