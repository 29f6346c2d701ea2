//! `file:///path`: the local disk tier on RocksDB, byte-bounded, surviving restarts.
//!
//! Its settings and `[[tier]]` options are in `config.rs`; how RocksDB is opened in
//! `database.rs`; the capacity index in `index.rs`; the read paths in `reads.rs`; large values
//! live in files of their own (`value_files.rs`).

mod config;
mod database;
mod index;
mod reads;
mod value_files;

pub use config::{DiskConfig, DiskFactory, SCHEMES};

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use rocksdb::{DB, ReadOptions, WriteBatch};
use tracing::{debug, info, warn};

use kvpool_core::storage::tier_events::{TierEventKind, TierEventLog};
use kvpool_core::{BackendError, CacheKey, CopyOut, EvictionPolicy, RemoteConnector};

use database::{META_CF, available_bytes, db_error, memory_only_read_options, open_database};
use index::{Index, load_index, meta_entry};
use value_files::ValueFiles;

fn io_error(source: std::io::Error) -> BackendError {
    BackendError::Io {
        backend: "disk".into(),
        source,
    }
}

/// The shared state behind a [`DiskConnector`].
struct DiskInner {
    /// The open database. `None` only while it is being reopened: after a write fails inside
    /// RocksDB (a full disk puts it into an error state it never leaves by itself), the next
    /// call closes it and opens it again, at most once a second, once no call still holds it.
    db: RwLock<Option<Arc<DB>>>,
    /// When the last write failed inside RocksDB (or the last reopen was tried); `None` while
    /// the database is healthy.
    broken_since: Mutex<Option<Instant>>,
    /// Held across every RocksDB write and the index change that goes with it, so that the
    /// index and the database never disagree (an eviction racing a put of the same key), and
    /// no write follows a failed one before the database is reopened.
    write_lock: Mutex<()>,
    /// Reads skip RocksDB's own block checksums: every value carries the chunk format's
    /// checksum, which `RemoteBackend` verifies end to end, so checking twice only costs time.
    read_options: ReadOptions,
    /// The same, not filling the block cache: for values read one at a time
    /// ([`DiskInner::read_each`]).
    streaming_read_options: ReadOptions,
    /// The same as `read_options`, limited to what is in memory (memtables and block cache):
    /// such a read does no I/O, so it runs on the caller's thread (see
    /// [`DiskInner::read_cached`]).
    cached_read_options: ReadOptions,
    config: DiskConfig,
    /// Values of at least `config.value_file_min_bytes`, one file each.
    files: ValueFiles,
    index: Mutex<Index>,
    closed: AtomicBool,
    /// Where capacity evictions are announced (KV events), once the manager hands it over.
    events: std::sync::OnceLock<Arc<TierEventLog>>,
    /// Bytes of writes waiting for a blocking thread or being written, at most
    /// [`QUEUED_WRITE_BYTES`]: a write holds its share from before it is queued until it
    /// ends, so writes whose caller's timeout gave up on them (they run on) stay bounded.
    queued_writes: Arc<tokio::sync::Semaphore>,
    /// Where a test pauses a reopen: after the old database is closed, before the new one
    /// opens (two waits).
    #[cfg(test)]
    reopen_pause: Mutex<Option<Arc<std::sync::Barrier>>>,
}

/// Bytes of writes queued or running at once (a larger batch waits for all of them).
/// Write-behind runs at the lowest CPU priority on an engine's host, where writes may wait
/// longer than the tier's timeout: without this bound each one given up on would leave its
/// encoded values queued while the write-behind quota admitted more.
const QUEUED_WRITE_BYTES: u32 = 1 << 30;

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
        let db = open_database(&config)?;
        let index = load_index(&db, &config)?;
        let files = ValueFiles::open(&config.path).map_err(io_error)?;
        let indexed: HashSet<String> = index
            .in_files
            .iter()
            .map(|k| ValueFiles::file_name(k))
            .collect();
        let unindexed = files.remove_unindexed(&indexed).map_err(io_error)?;
        info!(path = %config.path.display(), entries = index.sizes.len(), bytes = index.bytes, in_files = index.in_files.len(), unindexed_files_removed = unindexed, "opened disk tier");
        let mut read_options = ReadOptions::default();
        read_options.set_verify_checksums(false);
        let mut streaming_read_options = ReadOptions::default();
        streaming_read_options.set_verify_checksums(false);
        streaming_read_options.fill_cache(false);
        let connector = DiskInner {
            db: RwLock::new(Some(Arc::new(db))),
            broken_since: Mutex::new(None),
            write_lock: Mutex::new(()),
            read_options,
            streaming_read_options,
            cached_read_options: memory_only_read_options(),
            config,
            files,
            index: Mutex::new(index),
            closed: AtomicBool::new(false),
            events: std::sync::OnceLock::new(),
            queued_writes: Arc::new(tokio::sync::Semaphore::new(QUEUED_WRITE_BYTES as usize)),
            #[cfg(test)]
            reopen_pause: Mutex::new(None),
        };
        connector.serialized(|db| connector.evict_to(db, connector.config.capacity_bytes))?;
        Ok(connector)
    }

    /// The open database, or an error while it is being reopened.
    fn db(&self) -> Result<Arc<DB>, BackendError> {
        self.db
            .read()
            .clone()
            .ok_or_else(|| BackendError::Unavailable {
                backend: "disk".into(),
                reason: "reopening RocksDB after a failed write".into(),
            })
    }

    /// Runs `op` (RocksDB writes and their index changes) alone, unless an earlier write
    /// failed: RocksDB must not be written again before it is reopened (Debian's build aborts
    /// the process on the next append to a log whose last append failed).
    fn serialized<T>(
        &self,
        op: impl FnOnce(&DB) -> Result<T, BackendError>,
    ) -> Result<T, BackendError> {
        let _alone = self.write_lock.lock();
        if self.broken_since.lock().is_some() {
            return Err(BackendError::Unavailable {
                backend: "disk".into(),
                reason: "RocksDB failed a write (full disk?); it is reopened once that works"
                    .into(),
            });
        }
        op(&*self.db()?)
    }

    /// Marks the database for reopening after RocksDB failed a write.
    fn write_failed(&self, e: rocksdb::Error) -> BackendError {
        warn!(path = %self.config.path.display(), error = %e, "RocksDB failed a write; the disk tier reopens it");
        self.broken_since.lock().get_or_insert_with(Instant::now);
        db_error(e)
    }

    /// Reopens the database if a write failed at least a second ago and no call holds it
    /// (each call on the blocking pool asks first, so the call that finds it due reopens it,
    /// bounded for its caller by the tier's timeout). Writers wait for a reopen (they would
    /// fail meanwhile anyway); the new database is opened and its index loaded without
    /// holding the broken flag's lock or the database's, so another read meanwhile fails at
    /// once (the tier is unavailable: a miss) instead of waiting on the caller's thread.
    fn recover_if_broken(&self) {
        let due = |since: &Option<Instant>| {
            since.is_some_and(|since| since.elapsed() >= Duration::from_secs(1))
        };
        // A cheap check first: healthy calls must not queue behind the write lock.
        if !due(&self.broken_since.lock()) {
            return;
        }
        // Same order as writers: the write lock, then the flag.
        let _alone = self.write_lock.lock();
        {
            let mut broken = self.broken_since.lock();
            if !due(&broken) {
                return; // another call reopened it meanwhile, or tried a moment ago
            }
            *broken = Some(Instant::now());
        }
        {
            let mut slot = self.db.write();
            if slot.as_ref().is_some_and(|db| Arc::strong_count(db) > 1) {
                return; // a call in flight (or a value handed out) still uses it: try later
            }
            drop(slot.take()); // closes RocksDB and releases its lock file
        }
        #[cfg(test)]
        if let Some(pause) = self.reopen_pause.lock().clone() {
            pause.wait(); // the old database is closed
            pause.wait(); // the test lets the reopen go on
        }
        let reopened = open_database(&self.config)
            .and_then(|db| load_index(&db, &self.config).map(|index| (db, index)));
        match reopened {
            Ok((db, index)) => {
                let indexed = index
                    .in_files
                    .iter()
                    .map(|k| ValueFiles::file_name(k))
                    .collect();
                // Files published before a write RocksDB failed; temporary files of writes
                // refused meanwhile are gone with their `WrittenValue`s (or are removed here).
                if let Err(e) = self.files.remove_unindexed(&indexed) {
                    warn!(path = %self.config.path.display(), error = %e, "cannot remove unindexed value files");
                }
                info!(path = %self.config.path.display(), entries = index.sizes.len(), "reopened the disk tier");
                *self.index.lock() = index;
                *self.db.write() = Some(Arc::new(db));
                *self.broken_since.lock() = None;
            }
            Err(e) => {
                warn!(path = %self.config.path.display(), error = %e, "reopening the disk tier failed; trying again later")
            }
        }
    }

    fn usage(&self) -> (usize, u64) {
        let idx = self.index.lock();
        (idx.sizes.len(), idx.bytes)
    }

    fn overwrite_raw(&self, key: &str, value: &[u8]) -> Result<(), BackendError> {
        if self.index.lock().in_files.contains(key) {
            return self.files.overwrite(key, value).map_err(io_error);
        }
        self.serialized(|db| {
            db.put(key.as_bytes(), value)
                .map_err(|e| self.write_failed(e))
        })
    }

    fn check(&self) -> Result<(), BackendError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(BackendError::Closed("disk".into()));
        }
        Ok(())
    }

    /// Evicts least recently used entries until at most `limit` bytes remain (inside
    /// [`DiskInner::serialized`]).
    fn evict_to(&self, db: &DB, limit: u64) -> Result<(), BackendError> {
        let mut victims = Vec::new();
        let mut victim_files = Vec::new();
        {
            let mut idx = self.index.lock();
            while idx.bytes > limit {
                let Some(k) = idx.order.pop_victim(&mut |_| true) else {
                    break;
                };
                if let Some(size) = idx.sizes.remove(&k) {
                    idx.bytes -= size;
                }
                if idx.in_files.remove(&k) {
                    victim_files.push(k.clone());
                }
                victims.push(k);
            }
        }
        if victims.is_empty() {
            return Ok(());
        }
        let meta = db.cf_handle(META_CF).expect("meta column family exists");
        let mut batch = WriteBatch::default();
        for k in &victims {
            batch.delete(k.as_bytes());
            batch.delete_cf(meta, k.as_bytes());
        }
        metrics::counter!(kvpool_core::telemetry::EVICTIONS, "tier" => "disk")
            .increment(victims.len() as u64);
        debug!(evicted = victims.len(), "disk tier over capacity");
        db.write(batch).map_err(|e| self.write_failed(e))?;
        self.remove_files(&victim_files);
        if let Some(events) = self.events.get() {
            let keys: Vec<CacheKey> = victims.iter().filter_map(|k| k.parse().ok()).collect();
            events.record("disk", TierEventKind::Removed, &keys);
        }
        Ok(())
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
            metrics::counter!(crate::telemetry::DISK_WRITES_REFUSED).increment(1);
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

    /// Writes `entries`: values of at least `value_file_min_bytes` to files of their own
    /// (written before the write lock is taken, published under it), the rest into RocksDB,
    /// and every key's index entry in the same RocksDB batch.
    fn write_entries(&self, entries: &[(String, Bytes)]) -> Result<(), BackendError> {
        // A key put twice in one batch: its last value alone (the index loop below must not
        // see the key leave a file and come back in one pass).
        let last: HashMap<&str, usize> = entries
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.as_str(), i))
            .collect();
        let entries: Vec<&(String, Bytes)> = entries
            .iter()
            .enumerate()
            .filter(|(i, (k, _))| last[k.as_str()] == *i)
            .map(|(_, entry)| entry)
            .collect();
        self.check_free_space(entries.iter().map(|(_, v)| v.len() as u64).sum())?;
        // Unpublished files are deleted when `written` is dropped (on every error below).
        let mut written = Vec::new();
        for (i, (_, v)) in entries.iter().enumerate() {
            if v.len() as u64 >= self.config.value_file_min_bytes {
                written.push((i, self.files.write(v).map_err(io_error)?));
            }
        }
        self.serialized(|db| {
            let mut in_file = vec![false; entries.len()];
            for (i, file) in written {
                self.files.publish(file, &entries[i].0).map_err(io_error)?;
                in_file[i] = true;
            }
            let meta = db.cf_handle(META_CF).expect("meta column family exists");
            let mut batch = WriteBatch::default();
            for (&(k, v), &in_file) in entries.iter().zip(&in_file) {
                if in_file {
                    batch.delete(k.as_bytes()); // an earlier value of the key held in RocksDB
                } else {
                    batch.put(k.as_bytes(), v);
                }
                batch.put_cf(meta, k.as_bytes(), meta_entry(v.len() as u64, in_file));
            }
            db.write(batch).map_err(|e| self.write_failed(e))?;
            let mut replaced_files = Vec::new();
            {
                let mut idx = self.index.lock();
                for (&(k, v), &in_file) in entries.iter().zip(&in_file) {
                    let size = v.len() as u64;
                    if let Some(old) = idx.sizes.insert(k.clone(), size) {
                        idx.bytes -= old;
                    }
                    idx.bytes += size;
                    idx.order.on_insert(k.clone(), size as usize);
                    if in_file {
                        idx.in_files.insert(k.clone());
                    } else if idx.in_files.remove(k) {
                        replaced_files.push(k.clone());
                    }
                }
            }
            self.remove_files(&replaced_files);
            self.evict_to(db, self.config.capacity_bytes)
        })
    }

    /// Deletes the value files of `keys` (no longer indexed). A file that cannot be deleted
    /// is logged and left: no index entry names it, and the next open removes it.
    fn remove_files(&self, keys: &[String]) {
        for k in keys {
            if let Err(e) = self.files.remove(k) {
                warn!(key = %k, error = %e, "cannot delete a value file; it is removed at the next open");
            }
        }
    }

    fn delete_entries(&self, keys: &[String]) -> Result<usize, BackendError> {
        self.serialized(|db| self.delete_serialized(db, keys))
    }

    /// Deletes `keys` (inside [`DiskInner::serialized`]); how many were indexed.
    fn delete_serialized(&self, db: &DB, keys: &[String]) -> Result<usize, BackendError> {
        let meta = db.cf_handle(META_CF).expect("meta column family exists");
        let mut batch = WriteBatch::default();
        let mut existed = 0;
        let mut files = Vec::new();
        {
            let mut idx = self.index.lock();
            for k in keys {
                if let Some(size) = idx.sizes.remove(k) {
                    idx.bytes -= size;
                    idx.order.on_remove(k);
                    existed += 1;
                }
                if idx.in_files.remove(k) {
                    files.push(k.clone());
                }
                batch.delete(k.as_bytes());
                batch.delete_cf(meta, k.as_bytes());
            }
        }
        db.write(batch).map_err(|e| self.write_failed(e))?;
        self.remove_files(&files);
        Ok(existed)
    }
}

impl DiskInner {
    async fn blocking<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&DiskInner) -> Result<T, BackendError> + Send + 'static,
    ) -> Result<T, BackendError> {
        self.check()?;
        // Always on the blocking pool, never `block_in_place`: a call that blocks this task's
        // thread cannot be cut short, and every tier call must be bounded by its timeout. When
        // the timeout fires, the call finishes in the background and its result is dropped.
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            this.recover_if_broken();
            f(&this)
        })
        .await
        .map_err(join_error)?
    }
}

/// A RocksDB database as a [`RemoteConnector`]; wrap it in `kvpool_core::RemoteBackend` for
/// the chunk format (checksums; corrupt values become misses and are deleted).
///
/// Values of at least `value_file_min_bytes` live in files of their own, read with one copy;
/// smaller ones uncompressed in the default column family behind a block cache, a hot one
/// handed out as [`Bytes`] pinned in that cache, without a copy. Each key's size lives in a
/// small `meta` column family, from which the capacity index is rebuilt at open without
/// reading any value. After a restart the eviction order is the stored key order, as access
/// times are not persisted. Writes that would leave less than `min_free_bytes` free on the
/// filesystem are refused.
///
/// Clones share the same database. RocksDB calls that may touch a file run on tokio's
/// blocking pool, so that a tier timeout can fire while one of them is stuck; a read that
/// memory answers (memtable or block cache) runs on the caller's thread.
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

    /// Flushes RocksDB's memtables, so every value so far lives in files (value files are
    /// written by the put itself; neither is synced to the device).
    pub fn persist(&self) -> Result<(), BackendError> {
        self.inner
            .serialized(|db| db.flush().map_err(|e| self.inner.write_failed(e)))
    }
}

#[async_trait]
impl RemoteConnector for DiskConnector {
    fn name(&self) -> &str {
        "disk"
    }
    fn set_event_log(&self, events: Arc<TierEventLog>) {
        let _ = self.inner.events.set(events);
    }
    async fn exists(&self, key: &str) -> Result<bool, BackendError> {
        self.inner.check()?;
        Ok(self.inner.index.lock().sizes.contains_key(key))
    }
    async fn close(&self) -> Result<(), BackendError> {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || {
            inner.recover_if_broken();
            inner.serialized(|db| db.flush().map_err(|e| inner.write_failed(e)))
        })
        .await
        .map_err(join_error)?
    }
    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        self.inner.check()?;
        let idx = self.inner.index.lock();
        Ok(keys.iter().map(|k| idx.sizes.contains_key(k)).collect())
    }
    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        self.inner.check()?;
        if let Some(values) = self.inner.read_cached(keys) {
            return Ok(values);
        }
        let keys = keys.to_vec();
        self.inner.blocking(move |d| d.read_entries(&keys)).await
    }
    /// One value at a time, each handed to `visit` while RocksDB holds it and then let go, read
    /// without filling the block cache: one value's buffer is alive at a time and its memory
    /// is used again for the next, where a batch held every buffer at once and a block cache
    /// filling with values faulted in fresh memory for each (docs/benchmarks.md, "first disk
    /// hits"). Values already in memory (memtables, the block cache) are visited from there.
    async fn batch_get_each(&self, keys: &[String], visit: CopyOut) -> Result<(), BackendError> {
        self.inner.check()?;
        if let Some(values) = self.inner.read_cached(keys) {
            for (i, value) in values.iter().enumerate() {
                if let Some(value) = value {
                    visit(i, value);
                }
            }
            return Ok(());
        }
        let keys = keys.to_vec();
        self.inner
            .blocking(move |d| d.read_each(&keys, visit.as_ref()))
            .await
    }
    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        let admitted = self.inner.admit(entries);
        if admitted.is_empty() {
            return self.inner.check();
        }
        let bytes: usize = admitted.iter().map(|(_, v)| v.len()).sum();
        let share = u32::try_from(bytes.max(1))
            .unwrap_or(u32::MAX)
            .min(QUEUED_WRITE_BYTES);
        // Waited for here, where the caller's timeout can still cut the wait short; held by
        // the write itself until it ends.
        let room = self
            .inner
            .queued_writes
            .clone()
            .acquire_many_owned(share)
            .await
            .map_err(|_| BackendError::Closed("disk".into()))?;
        self.inner
            .blocking(move |d| {
                let _room = room;
                d.write_entries(&admitted)
            })
            .await
    }
    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        let keys = keys.to_vec();
        self.inner.blocking(move |d| d.delete_entries(&keys)).await
    }
}

#[cfg(test)]
mod tests;
