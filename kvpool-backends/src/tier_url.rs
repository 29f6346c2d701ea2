//! Opens a lower tier from its URL: the one place that maps schemes to backends.

use std::sync::Arc;
use std::time::Duration;

#[cfg(any(feature = "redis", feature = "s3"))]
use kvpool_core::chunk_format::max_stored_len;
use kvpool_core::{
    ChunkAllocator, ChunkCodec, ConfigError, RemoteBackend, RemoteConnector, StorageBackend,
    TierConfig,
};

use crate::memory::InMemoryConnector;
use crate::timeout::TimeoutConnector;

/// The schemes this crate knows, whether or not their feature is compiled in.
pub const SCHEMES: &[&str] = &[
    "file",
    "redis",
    "rediss",
    "redis+cluster",
    "rediss+cluster",
    "memory",
    "mooncakestore",
];

fn invalid(reason: String) -> ConfigError {
    ConfigError::Invalid {
        field: "tier.url",
        reason,
    }
}

/// The scheme of `url` (text before `://`).
pub fn scheme_of(url: &str) -> Result<&str, ConfigError> {
    url.split_once("://").map(|(s, _)| s).ok_or_else(|| {
        invalid(format!(
            "`{}` is not a URL: use e.g. file:///var/cache/kvpool or redis://host:6379",
            kvpool_core::redact_url(url)
        ))
    })
}

fn wrap<C: RemoteConnector>(
    connector: C,
    tier: &TierConfig,
    codec: ChunkCodec,
    max_chunk_bytes: u64,
    allocator: Option<Arc<dyn ChunkAllocator>>,
) -> Arc<dyn StorageBackend> {
    let bounded = TimeoutConnector::new(connector, Duration::from_millis(tier.timeout_ms));
    let backend = RemoteBackend::new(bounded, codec, max_chunk_bytes);
    Arc::new(match allocator {
        Some(allocator) => backend.with_allocator(allocator),
        None => backend,
    })
}

#[allow(dead_code)] // unused when every backend feature is on
fn not_compiled(scheme: &str, feature: &str) -> ConfigError {
    invalid(format!(
        "`{scheme}://` needs the `{feature}` feature of kvpool-backends, which this build lacks (rebuild with `--features {feature}`)"
    ))
}

/// Opens the tier described by `tier`: connects (bounded by its timeout) and wraps it with the
/// chunk format and per-call timeouts. Fails with a message naming what to fix.
pub async fn open_tier(
    tier: &TierConfig,
    codec: ChunkCodec,
    max_chunk_bytes: u64,
) -> Result<Arc<dyn StorageBackend>, ConfigError> {
    open_tier_with_allocator(tier, codec, max_chunk_bytes, None).await
}

/// [`open_tier`], decoding loaded chunks into buffers from `allocator` (the L1 pool, so that
/// a promoted chunk needs no second copy); the heap when `None` or when it is full.
pub async fn open_tier_with_allocator(
    tier: &TierConfig,
    codec: ChunkCodec,
    max_chunk_bytes: u64,
    allocator: Option<Arc<dyn ChunkAllocator>>,
) -> Result<Arc<dyn StorageBackend>, ConfigError> {
    let scheme = scheme_of(&tier.url)?;
    match scheme {
        "memory" => Ok(wrap(
            InMemoryConnector::new(),
            tier,
            codec,
            max_chunk_bytes,
            allocator,
        )),
        "file" => {
            #[cfg(feature = "disk")]
            {
                let path = tier.url.trim_start_matches("file://");
                if path.is_empty() || !path.starts_with('/') {
                    return Err(invalid(format!(
                        "`{}` needs an absolute path: file:///var/cache/kvpool",
                        tier.url
                    )));
                }
                let mut config = crate::disk::DiskConfig::new(path);
                if let Some(c) = tier.capacity {
                    config.capacity_bytes = c.0;
                }
                config.admit_on_second_put = tier.admit_on_second_put;
                if let Some(b) = tier.block_cache {
                    config.block_cache_bytes = usize::try_from(b.0).unwrap_or(usize::MAX);
                }
                if let Some(b) = tier.write_buffer {
                    config.write_buffer_bytes = usize::try_from(b.0).unwrap_or(usize::MAX);
                }
                let disk =
                    crate::disk::DiskConnector::open(config).map_err(|e| invalid(e.to_string()))?;
                Ok(wrap(disk, tier, codec, max_chunk_bytes, allocator))
            }
            #[cfg(not(feature = "disk"))]
            Err(not_compiled(scheme, "disk"))
        }
        "redis" | "rediss" | "redis+cluster" | "rediss+cluster" => {
            #[cfg(feature = "redis")]
            {
                let mut config = crate::redis::RedisConfig::new(tier.url.clone());
                config.ttl = tier.ttl_seconds.map(Duration::from_secs);
                config.timeout = Duration::from_millis(tier.timeout_ms);
                config.max_value_bytes = Some(max_stored_len(max_chunk_bytes));
                let redis = crate::redis::RedisConnector::connect(&config)
                    .await
                    .map_err(|e| invalid(e.to_string()))?;
                Ok(wrap(redis, tier, codec, max_chunk_bytes, allocator))
            }
            #[cfg(not(feature = "redis"))]
            Err(not_compiled(scheme, "redis"))
        }
        "s3" => {
            #[cfg(feature = "s3")]
            {
                let mut config = crate::s3::S3Config::new(tier.url.clone());
                config.endpoint = tier.endpoint.clone();
                config.region = tier.region.clone();
                if let (Some(key), Some(secret)) = (&tier.access_key_id, &tier.secret_access_key) {
                    config.credentials = Some((key.clone(), secret.clone()));
                }
                config.timeout = Duration::from_millis(tier.timeout_ms);
                config.max_value_bytes = Some(max_stored_len(max_chunk_bytes));
                let s3 = crate::s3::S3Connector::connect(&config)
                    .await
                    .map_err(|e| invalid(e.to_string()))?;
                Ok(wrap(s3, tier, codec, max_chunk_bytes, allocator))
            }
            #[cfg(not(feature = "s3"))]
            Err(not_compiled(scheme, "s3"))
        }
        "mooncakestore" => {
            #[cfg(feature = "mooncake")]
            {
                let mut config = crate::mooncake::MooncakeConfig::from_url(&tier.url)?;
                // Room for a few values of the largest chunk the pool stores.
                let needed = (max_chunk_bytes + 4096).saturating_mul(4);
                config.staging_bytes = config.staging_bytes.max(needed);
                let mooncake = crate::mooncake::MooncakeConnector::connect(&config)
                    .await
                    .map_err(|e| invalid(e.to_string()))?;
                Ok(wrap(mooncake, tier, codec, max_chunk_bytes, allocator))
            }
            #[cfg(not(feature = "mooncake"))]
            Err(not_compiled(scheme, "mooncake"))
        }
        other => Err(invalid(format!(
            "unknown scheme `{other}://`: expected one of {}",
            SCHEMES.join(", ")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn unknown_schemes_and_non_urls_are_clear_errors() {
        let err = open_tier(
            &TierConfig::new("ftp://h/x"),
            ChunkCodec::default(),
            1 << 20,
        )
        .await
        .err()
        .unwrap();
        assert!(err.to_string().contains("unknown scheme `ftp://`"), "{err}");
        let err = open_tier(
            &TierConfig::new("localhost:6379"),
            ChunkCodec::default(),
            1 << 20,
        )
        .await
        .err()
        .unwrap();
        assert!(err.to_string().contains("is not a URL"), "{err}");
        assert!(
            open_tier(
                &TierConfig::new("memory://"),
                ChunkCodec::default(),
                1 << 20
            )
            .await
            .is_ok()
        );
    }

    #[cfg(feature = "disk")]
    #[tokio::test]
    async fn relative_file_paths_are_rejected() {
        let err = open_tier(
            &TierConfig::new("file://relative/dir"),
            ChunkCodec::default(),
            1 << 20,
        )
        .await
        .err()
        .unwrap();
        assert!(err.to_string().contains("absolute path"), "{err}");
    }
}
