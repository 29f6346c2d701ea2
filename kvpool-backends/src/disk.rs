//! `file:///path`: the local disk tier on RocksDB, byte-bounded, surviving restarts.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use rocksdb::{
    ColumnFamilyDescriptor, DB, DBPinnableSlice, ErrorKind, IteratorMode, Options, ReadOptions,
    WriteBatch,
};
use tracing::{debug, info, warn};

use kvpool_core::eviction::OrderedPolicy;
use kvpool_core::{BackendError, EvictionPolicy, RemoteConnector};

/// Column family holding each key's stored size (small; read at open to rebuild the index).
const META_CF: &str = "meta";

/// Settings of the disk tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskConfig {
    /// Directory of the RocksDB database (created if missing).
    pub path: PathBuf,
    /// Bytes of values kept; the least recently used are evicted beyond it.
    pub capacity_bytes: u64,
    /// Write a key only the second time it is put (avoids churning the disk with chunks that
    /// are never reused; the Dynamo KV block manager's admission policy).
    pub admit_on_second_put: bool,
    /// Keys remembered for the admission filter.
    pub admission_memory: usize,
    /// RocksDB block cache: hot values are served from it without a copy.
    pub block_cache_bytes: usize,
    /// Size of one RocksDB memtable (and so of the write-ahead log before a flush).
    pub write_buffer_bytes: usize,
    /// Writes are refused (counted as failed, never attempted) when they would leave less
    /// free space than this on the filesystem. RocksDB cannot survive running out of space
    /// mid-write, and it needs room for the write-ahead log and a memtable flush.
    pub min_free_bytes: u64,
}

impl DiskConfig {
    /// Defaults: 64 GiB, no admission filter, a 256 MiB block cache, 16 MiB memtables, and
    /// 64 MiB kept free on the filesystem.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        DiskConfig {
            path: path.into(),
            capacity_bytes: 64 << 30,
            admit_on_second_put: false,
            admission_memory: 1 << 20,
            block_cache_bytes: 256 << 20,
            write_buffer_bytes: 16 << 20,
            min_free_bytes: 64 << 20,
        }
    }
}

struct Index {
    sizes: HashMap<String, u64>,
    order: OrderedPolicy<String>,
    bytes: u64,
    /// Keys put once while the admission filter is on, oldest first.
    seen: VecDeque<String>,
    seen_set: HashSet<String>,
}

/// A value pinned by RocksDB, handed out as [`Bytes`] without copying it again.
struct PinnedValue {
    // Declared first so it is dropped first: it borrows from the database `_db` keeps alive.
    slice: DBPinnableSlice<'static>,
    _db: Arc<DB>,
}

impl PinnedValue {
    fn new(slice: DBPinnableSlice<'_>, db: &Arc<DB>) -> Self {
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

/// The shared state behind a [`DiskConnector`].
struct DiskInner {
    db: Arc<DB>,
    /// Reads skip RocksDB's own block checksums: every value carries the chunk format's
    /// checksum, which `RemoteBackend` verifies end to end, so checking twice only costs time.
    read_options: ReadOptions,
    config: DiskConfig,
    index: Mutex<Index>,
    closed: AtomicBool,
}

/// Bytes available to unprivileged writers on the filesystem holding `path`.
fn available_bytes(path: &std::path::Path) -> std::io::Result<u64> {
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

fn db_error(e: rocksdb::Error) -> BackendError {
    BackendError::Unavailable {
        backend: "disk".into(),
        reason: e.into_string(),
    }
}

fn join_error(e: tokio::task::JoinError) -> BackendError {
    BackendError::Unavailable {
        backend: "disk".into(),
        reason: format!("blocking task failed: {e}"),
    }
}

impl DiskInner {
    fn open(config: DiskConfig) -> Result<Self, BackendError> {
        if config.capacity_bytes == 0 {
            return Err(BackendError::Unavailable {
                backend: "disk".into(),
                reason: "capacity must be above zero".into(),
            });
        }
        std::fs::create_dir_all(&config.path).map_err(|source| BackendError::Io {
            backend: format!("disk ({})", config.path.display()),
            source,
        })?;
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        let mut values = Options::default();
        // Values are already compressed (or not) by the chunk codec.
        values.set_compression_type(rocksdb::DBCompressionType::None);
        let block_cache =
            rocksdb::Cache::new_lru_cache(config.block_cache_bytes).map_err(db_error)?;
        let mut table = rocksdb::BlockBasedOptions::default();
        table.set_block_cache(&block_cache);
        values.set_block_based_table_factory(&table);
        values.set_write_buffer_size(config.write_buffer_bytes);
        let cfs = vec![
            ColumnFamilyDescriptor::new(rocksdb::DEFAULT_COLUMN_FAMILY_NAME, values),
            ColumnFamilyDescriptor::new(META_CF, Options::default()),
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
        let mut index = Index {
            sizes: HashMap::new(),
            order: OrderedPolicy::lru(),
            bytes: 0,
            seen: VecDeque::new(),
            seen_set: HashSet::new(),
        };
        {
            let meta = db.cf_handle(META_CF).expect("meta column family exists");
            for item in db.iterator_cf(meta, IteratorMode::Start) {
                let (k, v) = item.map_err(db_error)?;
                let (Ok(key), Ok(size)) = (String::from_utf8(k.to_vec()), <[u8; 8]>::try_from(&*v))
                else {
                    warn!(path = %config.path.display(), "skipping malformed index entry");
                    continue;
                };
                let size = u64::from_le_bytes(size);
                index.bytes += size;
                index.order.on_insert(key.clone(), size as usize);
                index.sizes.insert(key, size);
            }
        }
        info!(path = %config.path.display(), entries = index.sizes.len(), bytes = index.bytes, "opened disk tier");
        let mut read_options = ReadOptions::default();
        read_options.set_verify_checksums(false);
        let connector = DiskInner {
            db: Arc::new(db),
            read_options,
            config,
            index: Mutex::new(index),
            closed: AtomicBool::new(false),
        };
        connector.evict_to(connector.config.capacity_bytes)?;
        Ok(connector)
    }

    fn usage(&self) -> (usize, u64) {
        let idx = self.index.lock();
        (idx.sizes.len(), idx.bytes)
    }

    fn overwrite_raw(&self, key: &str, value: &[u8]) -> Result<(), BackendError> {
        self.db.put(key.as_bytes(), value).map_err(db_error)
    }

    fn check(&self) -> Result<(), BackendError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(BackendError::Closed("disk".into()));
        }
        Ok(())
    }

    /// Evicts least recently used entries until at most `limit` bytes remain.
    fn evict_to(&self, limit: u64) -> Result<(), BackendError> {
        let mut victims = Vec::new();
        {
            let mut idx = self.index.lock();
            while idx.bytes > limit {
                let Some(k) = idx.order.pop_victim(&mut |_| true) else {
                    break;
                };
                if let Some(size) = idx.sizes.remove(&k) {
                    idx.bytes -= size;
                }
                victims.push(k);
            }
        }
        if victims.is_empty() {
            return Ok(());
        }
        let meta = self
            .db
            .cf_handle(META_CF)
            .expect("meta column family exists");
        let mut batch = WriteBatch::default();
        for k in &victims {
            batch.delete(k.as_bytes());
            batch.delete_cf(meta, k.as_bytes());
        }
        metrics::counter!(kvpool_core::telemetry::EVICTIONS, "tier" => "disk")
            .increment(victims.len() as u64);
        debug!(evicted = victims.len(), "disk tier over capacity");
        self.db.write(batch).map_err(db_error)
    }

    /// Applies the admission filter: the entries to write now.
    fn admit(&self, entries: Vec<(String, Bytes)>) -> Vec<(String, Bytes)> {
        if !self.config.admit_on_second_put {
            return entries;
        }
        let mut idx = self.index.lock();
        let mut admitted = Vec::with_capacity(entries.len());
        for (k, v) in entries {
            if idx.sizes.contains_key(&k) || idx.seen_set.remove(&k) {
                admitted.push((k, v));
                continue;
            }
            idx.seen_set.insert(k.clone());
            idx.seen.push_back(k);
            while idx.seen.len() > self.config.admission_memory {
                if let Some(old) = idx.seen.pop_front() {
                    idx.seen_set.remove(&old);
                }
            }
        }
        admitted
    }

    /// Refuses a write of `bytes` that would leave less than `min_free_bytes` free.
    fn check_free_space(&self, bytes: u64) -> Result<(), BackendError> {
        let free = available_bytes(&self.config.path).map_err(|source| BackendError::Io {
            backend: "disk".into(),
            source,
        })?;
        if free < bytes.saturating_add(self.config.min_free_bytes) {
            metrics::counter!(kvpool_core::telemetry::DISK_WRITES_REFUSED).increment(1);
            return Err(BackendError::Io {
                backend: "disk".into(),
                source: std::io::Error::new(
                    std::io::ErrorKind::StorageFull,
                    format!(
                        "{} has {free} bytes free; writing {bytes} more would go below the {}-byte reserve",
                        self.config.path.display(),
                        self.config.min_free_bytes
                    ),
                ),
            });
        }
        Ok(())
    }

    fn write_entries(&self, entries: &[(String, Bytes)]) -> Result<(), BackendError> {
        self.check_free_space(entries.iter().map(|(_, v)| v.len() as u64).sum())?;
        let meta = self
            .db
            .cf_handle(META_CF)
            .expect("meta column family exists");
        let mut batch = WriteBatch::default();
        for (k, v) in entries {
            batch.put(k.as_bytes(), v);
            batch.put_cf(meta, k.as_bytes(), (v.len() as u64).to_le_bytes());
        }
        self.db.write(batch).map_err(db_error)?;
        {
            let mut idx = self.index.lock();
            for (k, v) in entries {
                let size = v.len() as u64;
                if let Some(old) = idx.sizes.insert(k.clone(), size) {
                    idx.bytes -= old;
                }
                idx.bytes += size;
                idx.order.on_insert(k.clone(), size as usize);
            }
        }
        self.evict_to(self.config.capacity_bytes)
    }

    fn delete_entries(&self, keys: &[String]) -> Result<usize, BackendError> {
        let meta = self
            .db
            .cf_handle(META_CF)
            .expect("meta column family exists");
        let mut batch = WriteBatch::default();
        let mut existed = 0;
        {
            let mut idx = self.index.lock();
            for k in keys {
                if let Some(size) = idx.sizes.remove(k) {
                    idx.bytes -= size;
                    idx.order.on_remove(k);
                    existed += 1;
                }
                batch.delete(k.as_bytes());
                batch.delete_cf(meta, k.as_bytes());
            }
        }
        self.db.write(batch).map_err(db_error)?;
        Ok(existed)
    }

    fn read_entries(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        let mut out = Vec::with_capacity(keys.len());
        let mut unreadable = Vec::new();
        for k in keys {
            if !self.index.lock().sizes.contains_key(k) {
                out.push(None);
                continue;
            }
            match self.db.get_pinned_opt(k.as_bytes(), &self.read_options) {
                Ok(Some(v)) => {
                    self.index.lock().order.on_access(k);
                    out.push(Some(Bytes::from_owner(PinnedValue::new(v, &self.db))));
                }
                Ok(None) => out.push(None),
                Err(e) if e.kind() == ErrorKind::Corruption => {
                    warn!(key = %k, error = %e, "RocksDB reports corruption; dropping the entry");
                    unreadable.push(k.clone());
                    out.push(None);
                }
                Err(e) => return Err(db_error(e)),
            }
        }
        if !unreadable.is_empty() {
            self.delete_entries(&unreadable)?;
        }
        Ok(out)
    }
}

impl DiskInner {
    async fn blocking<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&DiskInner) -> Result<T, BackendError> + Send + 'static,
    ) -> Result<T, BackendError> {
        self.check()?;
        // On a multi-threaded runtime, run RocksDB on this thread and let tokio move the
        // worker's other tasks elsewhere: hot reads take microseconds, and a hand-off to the
        // blocking pool would cost more than the read. A current-thread runtime cannot do
        // that, so it uses the blocking pool.
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if multi_thread {
            return tokio::task::block_in_place(|| f(self));
        }
        let this = self.clone();
        tokio::task::spawn_blocking(move || f(&this))
            .await
            .map_err(join_error)?
    }
}

/// A RocksDB database as a [`RemoteConnector`]; wrap it in `kvpool_core::RemoteBackend` for
/// the chunk format (checksums; corrupt values become misses and are deleted).
///
/// Values live uncompressed in the default column family behind a block cache; a hot value is
/// handed out as [`Bytes`] pinned in that cache, without a copy. Each key's size lives in a
/// small `meta` column family, from which the capacity index is rebuilt at open without
/// reading any value. After a restart the eviction order is the stored key order, as access
/// times are not persisted. Writes that would leave less than `min_free_bytes` free on the
/// filesystem are refused.
///
/// Clones share the same database. RocksDB calls run under `block_in_place` on a
/// multi-threaded runtime and on the blocking pool otherwise.
#[derive(Clone)]
pub struct DiskConnector {
    inner: Arc<DiskInner>,
}

impl DiskConnector {
    /// Opens (or creates) the database and rebuilds the capacity index.
    pub fn open(config: DiskConfig) -> Result<Self, BackendError> {
        Ok(DiskConnector {
            inner: Arc::new(DiskInner::open(config)?),
        })
    }

    /// The settings.
    pub fn config(&self) -> &DiskConfig {
        &self.inner.config
    }

    /// Entries and bytes held.
    pub fn usage(&self) -> (usize, u64) {
        self.inner.usage()
    }

    /// Replaces the stored bytes of `key` directly in RocksDB (fault injection in tests).
    pub fn overwrite_raw(&self, key: &str, value: &[u8]) -> Result<(), BackendError> {
        self.inner.overwrite_raw(key, value)
    }

    /// Flushes RocksDB's memtables, so every value so far lives in files on disk.
    pub fn persist(&self) -> Result<(), BackendError> {
        self.inner.db.flush().map_err(db_error)
    }
}

#[async_trait]
impl RemoteConnector for DiskConnector {
    fn name(&self) -> &str {
        "disk"
    }
    async fn exists(&self, key: &str) -> Result<bool, BackendError> {
        self.inner.check()?;
        Ok(self.inner.index.lock().sizes.contains_key(key))
    }
    async fn get(&self, key: &str) -> Result<Option<Bytes>, BackendError> {
        Ok(self.batch_get(&[key.to_string()]).await?.pop().flatten())
    }
    async fn put(&self, key: &str, value: Bytes) -> Result<(), BackendError> {
        self.batch_put(vec![(key.to_string(), value)]).await
    }
    async fn delete(&self, key: &str) -> Result<bool, BackendError> {
        Ok(self.batch_delete(&[key.to_string()]).await? == 1)
    }
    async fn close(&self) -> Result<(), BackendError> {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let db = self.inner.db.clone();
        tokio::task::spawn_blocking(move || db.flush().map_err(db_error))
            .await
            .map_err(join_error)?
    }
    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        self.inner.check()?;
        let idx = self.inner.index.lock();
        Ok(keys.iter().map(|k| idx.sizes.contains_key(k)).collect())
    }
    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        let keys = keys.to_vec();
        self.inner.blocking(move |d| d.read_entries(&keys)).await
    }
    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        let admitted = self.inner.admit(entries);
        if admitted.is_empty() {
            return self.inner.check();
        }
        self.inner
            .blocking(move |d| d.write_entries(&admitted))
            .await
    }
    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        let keys = keys.to_vec();
        self.inner.blocking(move |d| d.delete_entries(&keys)).await
    }
}
