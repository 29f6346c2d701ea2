//! The disk tier's settings and its `[[tier]]` options (`file:///path`).

use std::path::PathBuf;

use async_trait::async_trait;

use kvpool_core::{ConfigError, RemoteConnector};

use super::DiskConnector;
use crate::backend_factory::{BackendFactory, TierRequest};

/// The URL schemes the disk tier opens.
pub const SCHEMES: &[&str] = &["file"];

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
    /// Values of at least this many bytes live in files of their own beside RocksDB (read
    /// with one copy; RocksDB copies a value it reads from a file twice); smaller ones in
    /// RocksDB. `u64::MAX` keeps every value in RocksDB.
    pub value_file_min_bytes: u64,
}

impl DiskConfig {
    /// Defaults: 64 GiB, no admission filter, a 256 MiB block cache, 16 MiB memtables,
    /// 64 MiB kept free on the filesystem, and values from 64 KiB up in files of their own.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        DiskConfig {
            path: path.into(),
            capacity_bytes: 64 << 30,
            admit_on_second_put: false,
            admission_memory: 1 << 20,
            block_cache_bytes: 256 << 20,
            write_buffer_bytes: 16 << 20,
            min_free_bytes: 64 << 20,
            value_file_min_bytes: 64 << 10,
        }
    }
}

impl DiskConnector {
    /// Opens the tier at `file:///absolute/path` with its `[[tier]]` options: `capacity`,
    /// `admit_on_second_put`, `block_cache`, `write_buffer`, `value_file_min` (sizes such as
    /// `"64GiB"`), and
    /// `shares`: how many processes split `capacity` (each its own directory), which the vLLM
    /// connector sets to the tensor-parallel size (default 1).
    pub fn from_tier(tier: &TierRequest<'_>) -> Result<Self, ConfigError> {
        let url = tier.url();
        let path = url.strip_prefix("file://").unwrap_or(url);
        if !path.starts_with('/') {
            return Err(ConfigError::Invalid {
                field: "tier.url",
                reason: format!("`{url}` needs an absolute path: file:///var/cache/kvpool"),
            });
        }
        let mut config = DiskConfig::new(path);
        let mut options = tier.options();
        if let Some(capacity) = options.bytes("capacity")? {
            config.capacity_bytes = capacity.0;
        }
        if let Some(admit) = options.bool("admit_on_second_put")? {
            config.admit_on_second_put = admit;
        }
        if let Some(bytes) = options.bytes("block_cache")? {
            config.block_cache_bytes = bytes.as_usize();
        }
        if let Some(bytes) = options.bytes("write_buffer")? {
            config.write_buffer_bytes = bytes.as_usize();
        }
        if let Some(bytes) = options.bytes("value_file_min")? {
            config.value_file_min_bytes = bytes.0;
        }
        if let Some(shares) = options.u64("shares")? {
            if shares == 0 {
                return Err(options.invalid("shares", "must be at least 1"));
            }
            config.capacity_bytes /= shares;
        }
        options.finish()?;
        DiskConnector::open(config).map_err(|e| ConfigError::Invalid {
            field: "tier.url",
            reason: e.to_string(),
        })
    }
}

/// Registers [`SCHEMES`] with the scheme registry.
pub struct DiskFactory;

#[async_trait]
impl BackendFactory for DiskFactory {
    fn example(&self) -> String {
        "url = \"file:///var/cache/kvpool\"  # RocksDB; capacity = \"64GiB\", admit_on_second_put = false, block_cache = \"256MiB\", write_buffer = \"16MiB\", value_file_min = \"64KiB\"".into()
    }

    async fn open(&self, tier: &TierRequest<'_>) -> Result<Box<dyn RemoteConnector>, ConfigError> {
        Ok(Box::new(DiskConnector::from_tier(tier)?))
    }
}

#[cfg(test)]
mod tests {
    use kvpool_core::{ByteSize, TierConfig};

    use super::*;

    fn open(tier: TierConfig) -> Result<DiskConnector, ConfigError> {
        DiskConnector::from_tier(&TierRequest {
            tier: &tier,
            max_chunk_bytes: 1 << 20,
        })
    }

    #[test]
    fn relative_file_paths_are_rejected() {
        let err = open(TierConfig::new("file://relative/dir")).err().unwrap();
        assert!(err.to_string().contains("absolute path"), "{err}");
    }

    #[test]
    fn options_reach_the_disk_config_and_typos_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}", dir.path().display());
        let disk = open(
            TierConfig::new(&url)
                .with_option("capacity", ByteSize::mib(64))
                .with_option("admit_on_second_put", true)
                .with_option("block_cache", "8MiB")
                .with_option("write_buffer", 4i64 << 20),
        )
        .unwrap();
        assert_eq!(disk.config().capacity_bytes, 64 << 20);
        assert!(disk.config().admit_on_second_put);
        assert_eq!(disk.config().block_cache_bytes, 8 << 20);
        assert_eq!(disk.config().write_buffer_bytes, 4 << 20);
        drop(disk);
        let err = open(TierConfig::new(&url).with_option("capacty", "1GiB"))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("`capacty`") && err.contains("capacity"),
            "{err}"
        );
        let err = open(TierConfig::new(&url).with_option("admit_on_second_put", "yes"))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("true or false"), "{err}");
    }

    #[test]
    fn shares_split_the_capacity_default_or_given() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}", dir.path().display());
        let disk = open(TierConfig::new(&url).with_option("shares", 2u64)).unwrap();
        assert_eq!(disk.config().capacity_bytes, 32 << 30);
        drop(disk);
        let disk = open(
            TierConfig::new(&url)
                .with_option("capacity", ByteSize::gib(8))
                .with_option("shares", 4u64),
        )
        .unwrap();
        assert_eq!(disk.config().capacity_bytes, 2 << 30);
        drop(disk);
        let err = open(TierConfig::new(&url).with_option("shares", 0u64))
            .err()
            .unwrap();
        assert!(err.to_string().contains("at least 1"), "{err}");
    }
}
