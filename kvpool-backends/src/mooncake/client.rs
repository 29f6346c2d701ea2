//! The small client trait the Mooncake connector drives, Mooncake's status codes, and raw buffers.

/// Mooncake's success code.
pub(super) const OK: i64 = 0;
/// `INVALID_PARAMS`: also what `get_into` answers when the buffer is smaller than the object.
pub(super) const BUFFER_TOO_SMALL: i64 = -600;
/// `OBJECT_NOT_FOUND`.
pub(super) const OBJECT_NOT_FOUND: i64 = -704;
/// How often a put that raced another writer of the same key is retried.
pub(super) const PUT_RACE_RETRIES: u32 = 6;

/// What a Mooncake store error code means (codes from `mooncake-store/include/types.h`).
pub fn describe_code(code: i64) -> &'static str {
    match code {
        0 => "ok",
        -1 => "internal error",
        -10 => "buffer overflow",
        -100 => "shard index out of range",
        -101 => "segment not found",
        -102 => "segment already exists",
        -200 => "no space: no segment mounted or all segments full",
        -300 => "invalid version",
        -400 => "invalid key",
        -500 => "write failed",
        -600 => "invalid parameters (or the buffer is smaller than the object)",
        -700 => "invalid write",
        -701 => "invalid read",
        -702 => "invalid replica",
        -703 => "replica not ready",
        -704 => "object not found",
        -705 => "object already exists",
        -706 => "object has a lease",
        -800 => "transfer failed",
        -900 => "RPC to the master failed",
        c if c <= -1000 && c > -1100 => "metadata (etcd/HTTP) error",
        _ => "unknown error",
    }
}

/// Codes that mean the cluster, not the object, is in trouble: the connector stops calling
/// for [`MooncakeConfig::retry_after`] so that callers get fast misses instead of stalls.
pub(super) fn is_cluster_failure(code: i64) -> bool {
    matches!(code, -900 | -800 | -101 | -200) || (code <= -1000 && code > -1100)
}

/// A buffer handed to the client: `len` bytes at `ptr`, inside registered memory.
#[derive(Debug, Clone, Copy)]
pub struct RawBuffer {
    /// Start of the buffer.
    pub ptr: *mut u8,
    /// Its length in bytes.
    pub len: usize,
}

// SAFETY: a plain address; whoever dereferences it upholds the client's safety contract.
unsafe impl Send for RawBuffer {}

/// The operations kvpool needs from a Mooncake Store client. Calls block; return codes are
/// Mooncake's (0 or a byte count on success, negative codes per key); `Err` means the client
/// itself failed (an exception, a dead interpreter).
pub trait MooncakeStoreClient: Send + Sync + 'static {
    /// Short name for logs.
    fn name(&self) -> &str;
    /// Registers memory for zero-copy transfers.
    ///
    /// # Safety
    /// `buffer` must stay allocated for as long as the client is used.
    unsafe fn register_buffer(&self, buffer: RawBuffer) -> Result<i64, String>;
    /// Writes each buffer under its key, replacing what was there.
    ///
    /// # Safety
    /// Every buffer must be readable for its length and inside registered memory.
    unsafe fn batch_upsert_from(
        &self,
        keys: &[String],
        buffers: &[RawBuffer],
    ) -> Result<Vec<i64>, String>;
    /// Reads each key into its buffer; per key the byte count or a negative code.
    ///
    /// # Safety
    /// Every buffer must be writable for its length, unaliased, and inside registered memory.
    unsafe fn batch_get_into(
        &self,
        keys: &[String],
        buffers: &[RawBuffer],
    ) -> Result<Vec<i64>, String>;
    /// The stored size of `key`, or a negative code.
    fn get_size(&self, key: &str) -> Result<i64, String>;
    /// Per key: 1 present, 0 absent, negative on error.
    fn batch_is_exist(&self, keys: &[String]) -> Result<Vec<i64>, String>;
    /// Removes keys regardless of leases; per key 0 or a negative code.
    fn batch_remove(&self, keys: &[String]) -> Result<Vec<i64>, String>;
    /// Disconnects; later calls fail.
    fn close(&self) -> Result<i64, String>;
}
