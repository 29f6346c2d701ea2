//! An OpenDAL-backed kvpool tier, written as a third party would: outside kvpool's workspace,
//! against kvpool's public API only.
//!
//! Call [`register`] once at start-up; then a `[[tier]]` with `url = "opendal+fs:///path"`
//! (or `opendal+memory://`) in any kvpool TOML config opens an [`OpendalConnector`]. kvpool
//! wraps it in its checksummed, key-bound chunk format and per-call timeouts, so this crate
//! only moves opaque bytes.
//!
//! ```no_run
//! # #[tokio::main] async fn main() {
//! kvpool_opendal_tier::register().unwrap();
//! let config = kvpool_core::PoolConfig::from_toml(
//!     "[[tier]]\nurl = \"opendal+fs:///var/cache/kvpool\"",
//! ).unwrap();
//! let pool = kvpool_backends::build_pool(&config).await.unwrap();
//! assert_eq!(pool.engine.storage().tier_names(), ["cpu", "opendal-fs"]);
//! # }
//! ```

pub mod demo;

use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use kvpool_backends::{BackendFactory, TierRequest, register_scheme};
use kvpool_core::format::chunk_format::max_stored_len;
use kvpool_core::{BackendError, ConfigError, RemoteConnector};
use opendal::{ErrorKind, Operator};

/// The schemes [`register`] adds: `opendal+<service>://`, one per OpenDAL service compiled in.
pub const SCHEMES: &[&str] = &["opendal+fs", "opendal+memory"];

/// Registers [`SCHEMES`] with kvpool's scheme registry. Call once per process.
pub fn register() -> Result<(), ConfigError> {
    for scheme in SCHEMES {
        register_scheme(scheme, OpendalFactory)?;
    }
    Ok(())
}

/// Opaque values under string keys in any OpenDAL service.
pub struct OpendalConnector {
    operator: Operator,
    name: String,
    /// Largest value a read accepts; a larger one is never read into memory.
    max_value_bytes: u64,
    closed: AtomicBool,
}

impl OpendalConnector {
    /// Wraps `operator`; reads refuse values above `max_value_bytes` (returned as an empty
    /// value, which kvpool's chunk format rejects as corrupt and deletes).
    pub fn new(operator: Operator, max_value_bytes: u64) -> Self {
        let name = format!("opendal-{}", operator.info().scheme());
        OpendalConnector {
            operator,
            name,
            max_value_bytes,
            closed: AtomicBool::new(false),
        }
    }

    /// The file of `key`: spread over 256 directories by the key's last two characters (a
    /// chunk hash's last hex digits), so no directory grows huge.
    fn path(&self, key: &str) -> Result<String, BackendError> {
        if key.is_empty() || key.contains('/') || key.starts_with('.') {
            return Err(self.error(format!("key `{key}` cannot name a file")));
        }
        let shard: String = key.chars().rev().take(2).collect();
        let shard = if shard.chars().all(|c| c.is_ascii_alphanumeric()) {
            shard
        } else {
            "00".to_string()
        };
        Ok(format!("{shard}/{key}"))
    }

    fn error(&self, reason: impl ToString) -> BackendError {
        BackendError::Unavailable {
            backend: self.name.clone(),
            reason: reason.to_string(),
        }
    }

    fn check_open(&self) -> Result<(), BackendError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(BackendError::Closed(self.name.clone()));
        }
        Ok(())
    }
}

impl OpendalConnector {
    async fn exists_one(&self, key: &str) -> Result<bool, BackendError> {
        self.check_open()?;
        let path = self.path(key)?;
        self.operator.exists(&path).await.map_err(|e| self.error(e))
    }

    async fn get_one(&self, key: &str) -> Result<Option<Bytes>, BackendError> {
        self.check_open()?;
        let path = self.path(key)?;
        let size = match self.operator.stat(&path).await {
            Ok(meta) => meta.content_length(),
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(self.error(e)),
        };
        if size > self.max_value_bytes {
            return Ok(Some(Bytes::new()));
        }
        match self.operator.read(&path).await {
            Ok(buffer) => Ok(Some(buffer.to_bytes())),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(self.error(e)),
        }
    }

    async fn put_one(&self, key: &str, value: Bytes) -> Result<(), BackendError> {
        self.check_open()?;
        let path = self.path(key)?;
        self.operator
            .write(&path, value)
            .await
            .map(|_| ())
            .map_err(|e| self.error(e))
    }

    async fn delete_one(&self, key: &str) -> Result<bool, BackendError> {
        let existed = self.exists_one(key).await?;
        if existed {
            let path = self.path(key)?;
            self.operator
                .delete(&path)
                .await
                .map_err(|e| self.error(e))?;
        }
        Ok(existed)
    }
}

/// OpenDAL has no batch reads or writes for files: a batch runs its keys concurrently, at most
/// [`CONCURRENCY`] at a time, and keeps their order.
#[async_trait]
impl RemoteConnector for OpendalConnector {
    fn name(&self) -> &str {
        &self.name
    }

    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        buffered(
            keys.iter()
                .cloned()
                .map(|k| async move { self.exists_one(&k).await }),
        )
        .await
    }

    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        buffered(
            keys.iter()
                .cloned()
                .map(|k| async move { self.get_one(&k).await }),
        )
        .await
    }

    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        buffered(
            entries
                .into_iter()
                .map(|(k, v)| async move { self.put_one(&k, v).await }),
        )
        .await?;
        Ok(())
    }

    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        let existed = buffered(
            keys.iter()
                .cloned()
                .map(|k| async move { self.delete_one(&k).await }),
        )
        .await?;
        Ok(existed.into_iter().filter(|e| *e).count())
    }

    async fn close(&self) -> Result<(), BackendError> {
        self.closed.store(true, Ordering::Release);
        Ok(())
    }
}

/// Requests of one batch in flight at once.
pub const CONCURRENCY: usize = 16;

/// Runs `calls` at most [`CONCURRENCY`] at a time; their results in order, or the first error.
async fn buffered<T, F>(calls: impl Iterator<Item = F>) -> Result<Vec<T>, BackendError>
where
    F: std::future::Future<Output = Result<T, BackendError>>,
{
    use futures::{StreamExt, TryStreamExt};
    futures::stream::iter(calls)
        .buffered(CONCURRENCY)
        .try_collect()
        .await
}

/// Opens `opendal+<service>://…` tiers.
pub struct OpendalFactory;

#[async_trait]
impl BackendFactory for OpendalFactory {
    fn example(&self) -> String {
        "url = \"opendal+fs:///var/cache/kvpool\"  # OpenDAL (third-party example); atomic_write_dir = \"/var/cache/kvpool/.tmp\"".into()
    }

    async fn open(&self, tier: &TierRequest<'_>) -> Result<Box<dyn RemoteConnector>, ConfigError> {
        let url = tier.url();
        let (scheme, rest) = url.split_once("://").unwrap_or((url, ""));
        let service = scheme.trim_start_matches("opendal+");
        let mut options = tier.options();
        let mut config: Vec<(String, String)> = Vec::new();
        match service {
            "fs" => {
                if !rest.starts_with('/') {
                    return Err(ConfigError::Invalid {
                        field: "tier.url",
                        reason: format!(
                            "`{url}` needs an absolute path: opendal+fs:///var/cache/kvpool"
                        ),
                    });
                }
                // Whole files appear at once (written aside, then renamed), so a crash never
                // leaves a half-written chunk under its key.
                let atomic_dir = options
                    .string("atomic_write_dir")?
                    .unwrap_or_else(|| format!("{}/.tmp", rest.trim_end_matches('/')));
                config.push(("root".into(), rest.into()));
                config.push(("atomic_write_dir".into(), atomic_dir));
            }
            "memory" => {}
            other => {
                return Err(ConfigError::Invalid {
                    field: "tier.url",
                    reason: format!("OpenDAL service `{other}` is not compiled into this build"),
                });
            }
        }
        options.finish()?;
        opendal::init_default_registry();
        let operator = Operator::via_iter(service, config).map_err(|e| ConfigError::Invalid {
            field: "tier.url",
            reason: format!("`{url}`: {e}"),
        })?;
        // Fail at start-up, not on the first chunk, when the root cannot be used.
        let operator_check = operator.clone();
        tokio::time::timeout(tier.timeout(), operator_check.check())
            .await
            .map_err(|_| ConfigError::Invalid {
                field: "tier.url",
                reason: format!("`{url}` did not answer within {:?}", tier.timeout()),
            })?
            .map_err(|e| ConfigError::Invalid {
                field: "tier.url",
                reason: format!("`{url}`: {e}"),
            })?;
        Ok(Box::new(OpendalConnector::new(
            operator,
            max_stored_len(tier.max_chunk_bytes),
        )))
    }
}
