//! The disk tier's reads: from value files and RocksDB, one value at a time or as a batch, and
//! on the caller's thread when memory answers.

use bytes::Bytes;
use rocksdb::{DB, DBPinnableSlice, ErrorKind, ReadOptions};
use tracing::warn;

use kvpool_core::{BackendError, EvictionPolicy};

use super::database::{PinnedValue, db_error};
use super::value_files::FileRead;
use super::{DiskInner, io_error};

/// The most a blocking thread's [`READ_BUFFER`] keeps between reads (a larger one is freed).
const KEPT_READ_BUFFER_BYTES: usize = 64 << 20;

thread_local! {
    /// The buffer a value file is read into by [`DiskInner::read_each`], kept by each thread
    /// of the blocking pool so that its pages are faulted in once, not once per value.
    static READ_BUFFER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A value found by [`DiskInner::read_indexed`].
enum Found<'b, 'db> {
    /// Held by RocksDB.
    Pinned(DBPinnableSlice<'db>),
    /// Read from its value file into the reader's buffer (the caller may take it).
    InBuffer(&'b mut Vec<u8>),
}

impl Found<'_, '_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Found::Pinned(slice) => slice,
            Found::InBuffer(buffer) => buffer,
        }
    }
}

impl DiskInner {
    /// Reads each indexed key of `keys` (from its value file into `buffer`, or from `db`
    /// with `options`) and hands `(i, value)` to `found`, counting it as accessed. A key that
    /// is not indexed or not stored is skipped (a miss); a value RocksDB reports corrupt, or
    /// whose file is gone or of the wrong length, is dropped from the tier (a miss too) once
    /// the batch is read; any other error ends the read.
    fn read_indexed<'db>(
        &self,
        db: &'db DB,
        keys: &[String],
        options: &ReadOptions,
        buffer: &mut Vec<u8>,
        mut found: impl FnMut(usize, Found<'_, 'db>),
    ) -> Result<(), BackendError> {
        let mut unreadable = Vec::new();
        let mut lost = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            let (size, in_file) = {
                let idx = self.index.lock();
                match idx.sizes.get(k) {
                    Some(&size) => (size, idx.in_files.contains(k)),
                    None => continue,
                }
            };
            if in_file {
                match self.files.read(k, size, buffer).map_err(io_error)? {
                    FileRead::Read => {
                        self.index.lock().order.on_access(k);
                        found(i, Found::InBuffer(buffer));
                    }
                    FileRead::Lost => lost.push((k.clone(), size)),
                }
                continue;
            }
            match db.get_pinned_opt(k.as_bytes(), options) {
                Ok(Some(value)) => {
                    self.index.lock().order.on_access(k);
                    found(i, Found::Pinned(value));
                }
                Ok(None) => {}
                Err(e) if e.kind() == ErrorKind::Corruption => {
                    warn!(key = %k, error = %e, "RocksDB reports corruption; dropping the entry");
                    unreadable.push(k.clone());
                }
                Err(e) => return Err(db_error(e)),
            }
        }
        if !unreadable.is_empty() {
            self.delete_entries(&unreadable)?;
        }
        if !lost.is_empty() {
            self.drop_lost_files(&lost)?;
        }
        Ok(())
    }

    /// Drops the entries of `lost` (key, indexed size) whose value file is still gone or of
    /// another length once no write can run: a read that raced a put of the same key (a new
    /// file renamed in, or the value moved into RocksDB) must not delete the new value.
    pub(super) fn drop_lost_files(&self, lost: &[(String, u64)]) -> Result<(), BackendError> {
        self.serialized(|db| {
            let indexed: Vec<&(String, u64)> = {
                let idx = self.index.lock();
                lost.iter()
                    .filter(|(k, size)| idx.in_files.contains(k) && idx.sizes.get(k) == Some(size))
                    .collect()
            };
            // Outside the index's lock (a file system call); the write lock keeps files still.
            let still_lost: Vec<String> = indexed
                .into_iter()
                .filter(|(k, size)| !self.files.holds(k, *size))
                .map(|(k, _)| k.clone())
                .collect();
            for k in &still_lost {
                warn!(key = %k, "a value file is gone or of the wrong length; dropping the entry");
            }
            self.delete_serialized(db, &still_lost).map(drop)
        })
    }

    /// [`DiskInner::read_entries`], one value at a time: each handed to `visit` and let go
    /// before the next is read, none put in the block cache, value files read into this
    /// thread's [`READ_BUFFER`].
    pub(super) fn read_each(
        &self,
        keys: &[String],
        visit: &(dyn Fn(usize, &[u8]) + Send + Sync),
    ) -> Result<(), BackendError> {
        let db = self.db()?;
        READ_BUFFER.with_borrow_mut(|buffer| {
            let read = self.read_indexed(
                &db,
                keys,
                &self.streaming_read_options,
                buffer,
                |i, value| visit(i, value.bytes()),
            );
            if buffer.capacity() > KEPT_READ_BUFFER_BYTES {
                *buffer = Vec::new();
            }
            read
        })
    }

    pub(super) fn read_entries(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        let db = self.db()?;
        let mut out = vec![None; keys.len()];
        let mut buffer = Vec::new();
        self.read_indexed(&db, keys, &self.read_options, &mut buffer, |i, value| {
            out[i] = Some(match value {
                Found::Pinned(slice) => Bytes::from_owner(PinnedValue::new(slice, &db)),
                Found::InBuffer(buffer) => Bytes::from(std::mem::take(buffer)),
            });
        })?;
        Ok(out)
    }
    /// Reads `keys` on the caller's thread when every one of them is answered from memory
    /// (memtable or block cache) or is not indexed; `None` when one needs a file read (or
    /// RocksDB reports anything unusual, or the database is being reopened): then the whole
    /// batch goes to the blocking pool, where a read that blocks can be cut short by the tier
    /// timeout. Handing a call to that pool costs tens of microseconds, more than a cached
    /// 1 MiB read.
    pub(super) fn read_cached(&self, keys: &[String]) -> Option<Vec<Option<Bytes>>> {
        if self.broken_since.lock().is_some() {
            return None;
        }
        let db = self.db().ok()?;
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            {
                let idx = self.index.lock();
                if idx.in_files.contains(k) {
                    return None; // a file read
                }
                if !idx.sizes.contains_key(k) {
                    out.push(None);
                    continue;
                }
            }
            match db.get_pinned_opt(k.as_bytes(), &self.cached_read_options) {
                Ok(Some(v)) => out.push(Some(Bytes::from_owner(PinnedValue::new(v, &db)))),
                // Indexed but gone, or needs I/O (`Incomplete`), or an error: let the
                // blocking read decide (it also drops corrupt entries).
                Ok(None) | Err(_) => return None,
            }
        }
        let mut idx = self.index.lock();
        for (k, v) in keys.iter().zip(&out) {
            if v.is_some() {
                idx.order.on_access(k);
            }
        }
        Some(out)
    }
}
