//! kvpool-core: the pieces every kvpool deployment shares, one folder per concept.
//!
//! - [`keys`]: chained chunk hashes, cache keys and the chunked token database (token ids or
//!   engine block hashes to chunk spans and keys);
//! - [`format`](mod@format): the checksummed, versioned stored-chunk encoding, bound to its key;
//! - [`frame`]: the length-prefixed postcard frames of kvpool's Unix-socket protocols;
//! - [`layout`]: the KV layout of a model and its fingerprint;
//! - [`memory`]: the bounded host memory pool with ref-counted chunk memory, and the eviction
//!   policies (LRU, FIFO, S3-FIFO);
//! - [`storage`]: the `StorageBackend` and `RemoteConnector` traits, and the storage manager
//!   (ordered tiers, prefix lookup, promotion, write-behind, per-tier counters and KV events);
//! - [`transfer`]: moving KV between a paged cache and chunk memory by slot mapping (the
//!   library's store / retrieve; the vLLM connector moves whole blocks with copy jobs instead);
//! - [`cache_engine`]: lookup / store / retrieve of token sequences over all of the above;
//! - [`telemetry`]: every Prometheus metric kvpool records, and the counters behind `stats()`;
//! - [`config`]: the TOML configuration, sizes such as `"2GiB"`, a tier's backend-owned options;
//! - [`error`]: the error types.

#![warn(missing_docs)]

pub mod cache_engine;
pub mod config;
pub mod error;
pub mod format;
pub mod frame;
pub mod keys;
pub mod layout;
pub mod memory;
pub mod storage;
pub mod telemetry;
pub mod transfer;

pub use cache_engine::{
    CacheEngine, EngineStats, FetchedChunks, LayerwiseRetrieve, LayerwiseStore, StoreReport,
};
pub use config::tier_options::{TierOptionValue, TierOptions, TierOptionsReader};
pub use config::{
    AllocatorConfig, ByteSize, MetricsConfig, PoolConfig, TenantConfig, TierConfig, redact_url,
};
pub use error::{
    BackendError, ConfigError, EngineError, FormatError, KeyParseError, LayoutError, PoolError,
    TokenError, TransferError,
};
pub use format::{ChecksumAlgorithm, ChunkCodec, ChunkMeta, Compression};
pub use keys::{
    CacheKey, ChunkHash, ChunkHasher, ChunkSpan, ChunkedTokenDatabase, ChunkingConfig,
    HashAlgorithm, KeyScope,
};
pub use layout::{Dtype, KvKind, KvLayout};
pub use memory::{
    EvictionKind, EvictionPolicy, HeapAllocator, HostAllocator, HostArena, MemoryObj, MemoryObjMut,
    MemoryPool,
};
pub use storage::{
    BackendCounters, BackendStats, Chunk, ChunkAllocator, ChunkVisit, CopyIn, CopyOut,
    HeapChunkAllocator, LentBytes, LentSaveSlots, ManagerStats, NodeMemoryBackend,
    NodeMemoryConnector, PinnedBytes, PutOutcome, RemoteBackend, RemoteConnector, SaveSlot,
    SharedChunk, StorageBackend, StorageManager, StorageManagerConfig, TierStats,
};
pub use telemetry::StatCounter;
pub use transfer::{ChunkWindow, HostPagedKvCache, KvTransfer};
