//! Error types, one enum per concern, each message saying what went wrong and what to do.

use thiserror::Error;

/// Lives with the layout it describes; re-exported here with the other error types.
pub use crate::layout::LayoutError;

/// A cache key string or binary form could not be parsed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum KeyParseError {
    /// The string form did not have the expected `model@tpN@rankR@ppP@fp@hash` shape.
    #[error(
        "malformed cache key `{key}`: {reason} (expected `model@tp<world>@rank<r>@pp<p>@<16 hex fp>@<32 hex hash>`)"
    )]
    Malformed {
        /// The key text.
        key: String,
        /// What was wrong with it.
        reason: &'static str,
    },
    /// The binary form was truncated or had a bad version byte.
    #[error("malformed binary cache key: {0}")]
    Binary(&'static str),
}

/// Token ids or a token mask handed to the token database are unusable.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TokenError {
    /// The mask length differs from the token count.
    #[error("token mask has {mask} entries but there are {tokens} tokens; pass one bool per token")]
    MaskLength {
        /// Mask length.
        mask: usize,
        /// Token count.
        tokens: usize,
    },
    /// The mask is not a run of `false` followed by a run of `true`.
    #[error(
        "token mask must be a prefix of `false` (tokens already on the GPU) followed only by `true`; found `false` at index {index} after a `true`"
    )]
    MaskNotPrefix {
        /// First offending index.
        index: usize,
    },
    /// The chunk size is not a multiple of the engine block size.
    #[error(
        "chunk size {chunk_size} is not a multiple of the engine block size {block_size}; block hashes cannot be grouped into chunks"
    )]
    ChunkNotBlockAligned {
        /// Chunk size in tokens.
        chunk_size: usize,
        /// Engine block size in tokens.
        block_size: usize,
    },
    /// More block hashes than tokens cover.
    #[error(
        "{blocks} block hashes of {block_size} tokens cover more than the {tokens} tokens given"
    )]
    TooManyBlocks {
        /// Block hash count.
        blocks: usize,
        /// Block size.
        block_size: usize,
        /// Token count.
        tokens: usize,
    },
}

/// A stored chunk could not be decoded. Every variant means "treat as a miss".
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum FormatError {
    /// Fewer bytes than a header.
    #[error("chunk is truncated: {len} bytes, the header alone needs {needed}")]
    TruncatedHeader {
        /// Bytes present.
        len: usize,
        /// Bytes needed.
        needed: usize,
    },
    /// The magic bytes are wrong: not a kvpool chunk.
    #[error("not a kvpool chunk (bad magic {0:02x?})")]
    BadMagic([u8; 4]),
    /// The format version is not supported by this build.
    #[error("chunk format version {0} is not supported (this build reads version {1})")]
    UnsupportedVersion(u16, u16),
    /// A flag or enum value in the header is unknown.
    #[error("chunk header field `{field}` has unknown value {value}")]
    UnknownField {
        /// Field name.
        field: &'static str,
        /// Value found.
        value: u64,
    },
    /// The payload length in the header does not match the bytes present.
    #[error("chunk payload length mismatch: header says {expected} bytes, {actual} present")]
    PayloadLength {
        /// Header's length.
        expected: u64,
        /// Bytes present.
        actual: u64,
    },
    /// The decoded size exceeds what the caller allows.
    #[error("chunk decodes to {size} bytes, above the limit of {limit}")]
    TooLarge {
        /// Decoded size.
        size: u64,
        /// Limit.
        limit: u64,
    },
    /// The checksum does not match: the bytes are corrupt.
    #[error("chunk checksum mismatch (stored {stored:#x}, computed {computed:#x}): corrupt data")]
    Checksum {
        /// Stored checksum.
        stored: u64,
        /// Computed checksum.
        computed: u64,
    },
    /// The chunk was written for another KV layout.
    #[error("chunk layout fingerprint {found:016x} differs from the expected {expected:016x}")]
    LayoutMismatch {
        /// Expected fingerprint.
        expected: u64,
        /// Found fingerprint.
        found: u64,
    },
    /// The value was stored under another key (a misrouted write, a copy, a hash collision in
    /// a shared store): never data.
    #[error(
        "chunk was written for key {found_hash}/{found_scope:016x}, not {expected_hash}/{expected_scope:016x}"
    )]
    KeyMismatch {
        /// The chunk hash asked for (hex).
        expected_hash: String,
        /// The scope digest asked for.
        expected_scope: u64,
        /// The chunk hash in the header (hex).
        found_hash: String,
        /// The scope digest in the header.
        found_scope: u64,
    },
    /// The chunk's element type differs from the layout's.
    #[error("chunk dtype {found} differs from the layout's {expected}")]
    DtypeMismatch {
        /// The layout's dtype.
        expected: crate::layout::Dtype,
        /// The chunk's dtype.
        found: crate::layout::Dtype,
    },
    /// The raw payload size is inconsistent with token count and layout.
    #[error("chunk holds {raw_len} bytes for {tokens} tokens; the layout needs {expected}")]
    SizeMismatch {
        /// Raw payload size.
        raw_len: u64,
        /// Token count.
        tokens: u32,
        /// Expected size.
        expected: u64,
    },
    /// Decompression failed or produced the wrong size.
    #[error("chunk decompression failed: {0}")]
    Decompress(String),
    /// The destination buffer has the wrong size.
    #[error("destination buffer is {actual} bytes, the chunk needs {expected}")]
    Destination {
        /// Needed.
        expected: usize,
        /// Given.
        actual: usize,
    },
    /// A compressed value cannot be copied where it lies; it must be decoded into a buffer.
    #[error("a compressed chunk cannot be copied where it lies")]
    Compressed,
}

/// The host memory pool could not satisfy a request.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PoolError {
    /// Not enough free contiguous space; evict or skip.
    #[error(
        "memory pool full: requested {requested} bytes, {free} free, largest free block {largest}"
    )]
    OutOfMemory {
        /// Bytes requested.
        requested: usize,
        /// Free bytes.
        free: usize,
        /// Largest contiguous free block.
        largest: usize,
    },
    /// The request can never fit.
    #[error(
        "requested {requested} bytes but the pool holds only {capacity}; raise the pool size (e.g. `max_local_cpu_size`)"
    )]
    LargerThanPool {
        /// Bytes requested.
        requested: usize,
        /// Pool capacity.
        capacity: usize,
    },
    /// A zero-byte allocation.
    #[error("zero-byte allocation requested")]
    ZeroSize,
    /// The underlying allocator failed to provide the arena.
    #[error("could not allocate a {bytes}-byte arena: {reason}")]
    Arena {
        /// Size asked for.
        bytes: usize,
        /// Why.
        reason: String,
    },
}

/// A storage backend or remote connector failed.
#[derive(Debug, Error)]
pub enum BackendError {
    /// The store could not be reached or answered with an error.
    #[error("backend `{backend}` unavailable: {reason}")]
    Unavailable {
        /// Backend name.
        backend: String,
        /// Why.
        reason: String,
    },
    /// The operation did not finish in time.
    #[error("backend `{backend}` timed out after {millis} ms during {op}")]
    Timeout {
        /// Backend name.
        backend: String,
        /// Operation.
        op: &'static str,
        /// Elapsed limit.
        millis: u64,
    },
    /// The backend was closed.
    #[error("backend `{0}` is closed")]
    Closed(String),
    /// Memory for the value could not be had.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// Any other I/O problem.
    #[error("backend `{backend}` I/O error: {source}")]
    Io {
        /// Backend name.
        backend: String,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// Moving KV between an engine's paged cache and chunk memory failed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TransferError {
    /// A slot id is negative (padding) or beyond the cache.
    #[error("slot {slot} is outside the paged cache of {num_slots} slots")]
    SlotOutOfRange {
        /// The slot.
        slot: i64,
        /// Slots in the cache.
        num_slots: usize,
    },
    /// The chunk buffer size does not match tokens x bytes per token.
    #[error("chunk buffer is {actual} bytes, {tokens} tokens need {expected}")]
    BufferSize {
        /// Buffer size.
        actual: usize,
        /// Needed.
        expected: usize,
        /// Tokens.
        tokens: usize,
    },
    /// Layer index out of range.
    #[error("layer {layer} out of range: the layout has {layers} layers")]
    LayerOutOfRange {
        /// Layer asked for.
        layer: usize,
        /// Layers in the layout.
        layers: usize,
    },
    /// The token range does not fit within the chunk.
    #[error("token range {start}..{end} does not fit a chunk of {tokens} tokens")]
    TokenRange {
        /// Start offset.
        start: usize,
        /// End offset.
        end: usize,
        /// Tokens in the chunk.
        tokens: usize,
    },
    /// The slot mapping length does not match the tokens.
    #[error("slot mapping has {slots} entries, expected {tokens}")]
    SlotMappingLength {
        /// Entries given.
        slots: usize,
        /// Entries expected.
        tokens: usize,
    },
    /// A device-side failure (CUDA).
    #[error("device transfer failed: {0}")]
    Device(String),
    /// A whole-block transfer was asked to move part of an engine block, or slots that are
    /// not one block's slots in order.
    #[error(
        "tokens {start}..{end} are not whole engine blocks of {block_size} tokens in order: {reason}"
    )]
    NotWholeBlocks {
        /// First chunk token of the range.
        start: usize,
        /// End of the range.
        end: usize,
        /// Tokens per engine block.
        block_size: usize,
        /// What is wrong.
        reason: String,
    },
}

/// A configuration file or value is invalid.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// TOML did not parse.
    #[error("cannot parse config: {0}")]
    Parse(String),
    /// A value is out of its allowed range.
    #[error("invalid config value for `{field}`: {reason}")]
    Invalid {
        /// Field name.
        field: &'static str,
        /// What is wrong and what to do.
        reason: String,
    },
    /// A tier is configured correctly but its service cannot be reached now (a server down
    /// at start-up). The pool opens without it and keeps trying: a miss, not a failed start.
    #[error("tier `{tier}` cannot be reached: {reason}")]
    Unreachable {
        /// The tier's URL, password redacted.
        tier: String,
        /// Why.
        reason: String,
    },
    /// A tier's backend option is wrong or unknown.
    #[error("invalid option `{key}` for tier `{tier}`: {reason}")]
    TierOption {
        /// The tier's URL, password redacted.
        tier: String,
        /// The option's name.
        key: String,
        /// What is wrong and what to do.
        reason: String,
    },
    /// The file could not be read.
    #[error("cannot read config file `{path}`: {source}")]
    Io {
        /// Path.
        path: String,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The layout in the config is invalid.
    #[error(transparent)]
    Layout(#[from] LayoutError),
}

/// The cache engine could not run an operation at all (as opposed to a miss).
#[derive(Debug, Error)]
pub enum EngineError {
    /// Bad tokens or mask.
    #[error(transparent)]
    Tokens(#[from] TokenError),
    /// KV transfer failed.
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// Storage failed in a way that is not a plain miss.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The call sequence was wrong (e.g. a layer twice).
    #[error("{0}")]
    Usage(String),
}
