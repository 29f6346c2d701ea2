//! The stored-chunk format: a versioned, checksummed header bound to its key, then the
//! (optionally compressed) payload.

pub mod chunk_format;

pub use chunk_format::{ChecksumAlgorithm, ChunkCodec, ChunkMeta, Compression};
