//! Keys: chained chunk hashes, the cache key (model scope, ranks, layout, chunk hash), the
//! engines' scope text, and the chunked token database that turns a token sequence into chunk
//! spans and their keys.

pub mod cache_key;
pub mod chunk_hash;
pub mod engine_scope;
pub mod token_database;

pub use cache_key::{CacheKey, KeyScope};
pub use chunk_hash::{ChunkHash, HashAlgorithm};
pub use engine_scope::{EngineInterface, engine_scope_model, part_scope_model};
pub use token_database::{ChunkHasher, ChunkSpan, ChunkedTokenDatabase, ChunkingConfig};
