//! How the disk tier's RocksDB database is opened and read: column families, memory bounds,
//! read options, values pinned in the block cache, free space on its filesystem.

use std::sync::Arc;

use rocksdb::{ColumnFamilyDescriptor, DB, DBPinnableSlice, Options, ReadOptions};

use kvpool_core::BackendError;

use super::config::DiskConfig;

/// Bits per key of each file's bloom filter (about 1 % false positives).
pub(super) const BLOOM_BITS_PER_KEY: f64 = 10.0;

/// Column family holding each key's stored size (small; read at open to rebuild the index).
pub(super) const META_CF: &str = "meta";

/// A value pinned by RocksDB, handed out as [`bytes::Bytes`] without copying it again.
pub(super) struct PinnedValue {
    // Declared first so it is dropped first: it borrows from the database `_db` keeps alive.
    slice: DBPinnableSlice<'static>,
    _db: Arc<DB>,
}

impl PinnedValue {
    pub(super) fn new(slice: DBPinnableSlice<'_>, db: &Arc<DB>) -> Self {
        // SAFETY: the slice only borrows the database (its lifetime is `PhantomData<&DB>`).
        // The `Arc<DB>` stored beside it keeps that database alive at least until the slice is
        // dropped, since fields drop in declaration order, so the extended lifetime never
        // outlives what it borrows.
        let slice =
            unsafe { std::mem::transmute::<DBPinnableSlice<'_>, DBPinnableSlice<'static>>(slice) };
        PinnedValue {
            slice,
            _db: db.clone(),
        }
    }
}

impl AsRef<[u8]> for PinnedValue {
    fn as_ref(&self) -> &[u8] {
        &self.slice
    }
}

/// Read options that answer from memtables and the block cache only: RocksDB returns an
/// `Incomplete` error instead of reading a file.
pub(super) fn memory_only_read_options() -> ReadOptions {
    let mut options = ReadOptions::default();
    options.set_verify_checksums(false);
    // rocksdb 0.20 has `set_read_tier` public but does not export its `ReadTier` argument;
    // the value is built from its discriminant, the type inferred from the parameter. The unit
    // test `a_hot_read_is_served_from_memory_and_a_cold_one_needs_the_blocking_pool` fails if
    // the tier set here is not the memory-only one.
    #[allow(
        clippy::missing_transmute_annotations,
        reason = "the target type is not exported, so it cannot be named"
    )]
    // SAFETY: `ReadTier` is `#[repr(i32)]` with `All = 0, BlockCache = 1` (RocksDB's
    // `kBlockCacheTier`), so 1i32 is a valid `ReadTier::BlockCache`.
    let block_cache_tier = unsafe { std::mem::transmute::<i32, _>(1) };
    options.set_read_tier(block_cache_tier);
    options
}

/// Bytes available to unprivileged writers on the filesystem holding `path`.
pub(super) fn available_bytes(path: &std::path::Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c_path` is a valid NUL-terminated string and `stat` is a writable statvfs.
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), stat.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it filled `stat`.
    let stat = unsafe { stat.assume_init() };
    // The field types differ between platforms (u32 on some 32-bit targets).
    #[allow(clippy::unnecessary_cast)]
    Ok(stat.f_bavail as u64 * stat.f_frsize as u64)
}

/// A RocksDB error as the tier's error.
pub(super) fn db_error(e: rocksdb::Error) -> BackendError {
    BackendError::Unavailable {
        backend: "disk".into(),
        reason: e.into_string(),
    }
}

/// Opens (or creates) the RocksDB database of `config`.
pub(super) fn open_database(config: &DiskConfig) -> Result<DB, BackendError> {
    let mut opts = Options::default();
    opts.create_if_missing(true);
    opts.create_missing_column_families(true);
    // RocksDB's own info log lives beside the data: on a full disk an append to it fails, and
    // the next append aborts the process in builds with assertions (Debian's librocksdb).
    // Only fatal messages are written; kvpool reports errors through tracing instead.
    opts.set_log_level(rocksdb::LogLevel::Fatal);
    opts.set_keep_log_file_num(2);
    // Memory is bounded by the config, not by how much the tier has stored: every column
    // family shares one block cache, which also holds the SST files' index and filter blocks
    // (otherwise each open file keeps its own outside any bound), and every memtable is at
    // most `write_buffer_bytes` (the meta family's default, 64 MiB, grew resident memory
    // for as long as the soak ran; it now gets an eighth of that).
    let block_cache = rocksdb::Cache::new_lru_cache(config.block_cache_bytes).map_err(db_error)?;
    let mut table = rocksdb::BlockBasedOptions::default();
    table.set_block_cache(&block_cache);
    table.set_cache_index_and_filter_blocks(true);
    table.set_pin_l0_filter_and_index_blocks_in_cache(true);
    // A bloom filter per file: keys are hashes, so nearly every file's key range covers a
    // wanted key, and without a filter a read opens the 2 MiB block where the key would be in
    // every such file before the one that holds it (a fresh engine's first 64 MiB hit took
    // twice the page faults and twice the time: docs/benchmarks.md, "first disk hits").
    table.set_bloom_filter(BLOOM_BITS_PER_KEY, false);
    opts.set_db_write_buffer_size(config.write_buffer_bytes.saturating_mul(4));
    let mut values = Options::default();
    // Values are already compressed (or not) by the chunk codec.
    values.set_compression_type(rocksdb::DBCompressionType::None);
    values.set_block_based_table_factory(&table);
    values.set_write_buffer_size(config.write_buffer_bytes);
    let mut meta = Options::default();
    meta.set_block_based_table_factory(&table);
    meta.set_write_buffer_size(meta_write_buffer_bytes(config.write_buffer_bytes));
    let cfs = vec![
        ColumnFamilyDescriptor::new(rocksdb::DEFAULT_COLUMN_FAMILY_NAME, values),
        ColumnFamilyDescriptor::new(META_CF, meta),
    ];
    let db = DB::open_cf_descriptors(&opts, &config.path, cfs).map_err(|e| {
        BackendError::Unavailable {
            backend: "disk".into(),
            reason: format!(
                "cannot open RocksDB at {}: {}",
                config.path.display(),
                e.into_string()
            ),
        }
    })?;
    Ok(db)
}

/// The meta family's memtable size: an eighth of the values' (at least 64 KiB). Its entries
/// are a key and eight bytes, so a memtable as large as the values' fills over many minutes
/// and, until its first flush, reads as a slow rise of resident memory.
pub(super) fn meta_write_buffer_bytes(write_buffer_bytes: usize) -> usize {
    (write_buffer_bytes / 8).max(64 << 10)
}
