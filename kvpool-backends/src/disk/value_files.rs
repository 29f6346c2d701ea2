//! The disk tier's large values, each in a file of its own beside RocksDB, read back with one
//! `read` into a buffer the caller keeps (RocksDB 7.8-7.9 copies every value it reads from a
//! file once more, into a fresh buffer: half a large read's time, docs/benchmarks.md).
//!
//! RocksDB's `meta` column family stays the index (it says which keys live here); a file is
//! named after 128 bits of its key's SHA-256. A value is written to a temporary file first and
//! renamed into place, so a reader never sees half a value; a crash can leave a temporary
//! file or a file no index entry names, and [`ValueFiles::remove_unindexed`] deletes those
//! when the tier opens. Files are not synced: after a power loss a torn value fails the chunk
//! format's checksum and is a miss.

use std::collections::HashSet;
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Prefix of a value file still being written.
const TEMPORARY_PREFIX: &str = ".tmp-";

/// The folder of value files of one disk tier.
pub(super) struct ValueFiles {
    dir: PathBuf,
    /// Numbers temporary files, unique within the process (one process holds the tier).
    next_temporary: AtomicU64,
}

/// A value written to a temporary file, not yet visible under its key; the file is deleted
/// when this is dropped unpublished (a write refused or failed after it was written).
pub(super) struct WrittenValue {
    temporary: PathBuf,
    published: bool,
}

impl Drop for WrittenValue {
    fn drop(&mut self) {
        if !self.published {
            let _ = std::fs::remove_file(&self.temporary);
        }
    }
}

/// What reading a value file found.
pub(super) enum FileRead {
    /// The whole value, in the buffer.
    Read,
    /// No file, or one of another length than the index says: the entry is lost (a miss).
    Lost,
}

impl ValueFiles {
    /// Opens (creating if needed) the folder `values` under `root`.
    pub(super) fn open(root: &Path) -> std::io::Result<Self> {
        let dir = root.join("values");
        std::fs::create_dir_all(&dir)?;
        Ok(ValueFiles {
            dir,
            next_temporary: AtomicU64::new(0),
        })
    }

    /// The file name of `key`'s value.
    pub(super) fn file_name(key: &str) -> String {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(key.as_bytes());
        digest[..16].iter().map(|b| format!("{b:02x}")).collect()
    }

    fn path_of(&self, key: &str) -> PathBuf {
        self.dir.join(Self::file_name(key))
    }

    /// Writes `value` to a new temporary file; [`ValueFiles::publish`] puts it under its key.
    pub(super) fn write(&self, value: &[u8]) -> std::io::Result<WrittenValue> {
        let n = self.next_temporary.fetch_add(1, Ordering::Relaxed);
        let temporary = self.dir.join(format!("{TEMPORARY_PREFIX}{n}"));
        let written = WrittenValue {
            temporary,
            published: false,
        };
        File::create(&written.temporary).and_then(|mut file| file.write_all(value))?;
        Ok(written)
    }

    /// Makes `written` the value of `key` (an atomic rename over any earlier one).
    pub(super) fn publish(&self, mut written: WrittenValue, key: &str) -> std::io::Result<()> {
        std::fs::rename(&written.temporary, self.path_of(key))?;
        written.published = true;
        Ok(())
    }

    /// Deletes `key`'s file; one already gone is no error.
    pub(super) fn remove(&self, key: &str) -> std::io::Result<()> {
        match std::fs::remove_file(self.path_of(key)) {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Replaces `key`'s file in place with `bytes` (fault injection in tests).
    pub(super) fn overwrite(&self, key: &str, bytes: &[u8]) -> std::io::Result<()> {
        std::fs::write(self.path_of(key), bytes)
    }

    /// Reads `key`'s value of `size` bytes into `buffer`, which ends `size` long. Its memory
    /// is used again: a caller that keeps the buffer takes no page faults and no zeroing for
    /// the next value of the same size or smaller.
    pub(super) fn read(
        &self,
        key: &str,
        size: u64,
        buffer: &mut Vec<u8>,
    ) -> std::io::Result<FileRead> {
        let mut file = match File::open(self.path_of(key)) {
            Ok(file) => file,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(FileRead::Lost),
            Err(e) => return Err(e),
        };
        if file.metadata()?.len() != size {
            return Ok(FileRead::Lost);
        }
        let size = size as usize;
        if buffer.capacity() == 0 {
            // Fresh memory from the allocator is zero already (calloc skips the memset).
            *buffer = vec![0; size];
        } else {
            buffer.resize(size, 0);
        }
        match file.read_exact(buffer) {
            Ok(()) => Ok(FileRead::Read),
            // Cut short since the length was read: replaced or damaged meanwhile.
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => Ok(FileRead::Lost),
            Err(e) => Err(e),
        }
    }

    /// Whether `key`'s file is there and `size` bytes long.
    pub(super) fn holds(&self, key: &str, size: u64) -> bool {
        std::fs::metadata(self.path_of(key)).is_ok_and(|m| m.len() == size)
    }

    /// Deletes every file that is neither one of `indexed` (file names of indexed keys) nor
    /// anything but a value file: temporary files and values a crash left without an index
    /// entry. Returns how many were deleted.
    pub(super) fn remove_unindexed(&self, indexed: &HashSet<String>) -> std::io::Result<usize> {
        let mut removed = 0;
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let is_value = name.len() == 32 && name.bytes().all(|b| b.is_ascii_hexdigit());
            if (is_value && !indexed.contains(name)) || name.starts_with(TEMPORARY_PREFIX) {
                match std::fs::remove_file(entry.path()) {
                    Ok(()) => removed += 1,
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(removed)
    }
}
