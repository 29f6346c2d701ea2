//! The scheme registry: which backend opens a `[[tier]]`, chosen by its URL's scheme.
//!
//! Every backend, built in or third-party, registers the same way: a [`BackendFactory`] under
//! one or more URL schemes. [`open_tier`] looks the scheme up, lets the factory parse its own
//! options and connect, and wraps the connector it returns in what every tier shares: the
//! checksummed, key-bound chunk format ([`RemoteBackend`]) and a timeout on every call
//! ([`TimeoutConnector`]). A third-party store therefore never handles KV bytes unchecked.
//!
//! ```
//! use async_trait::async_trait;
//! use kvpool_backends::{BackendFactory, TierRequest, register_scheme};
//! use kvpool_backends::InMemoryConnector;
//! use kvpool_core::{ConfigError, RemoteConnector};
//!
//! /// A store only this program knows (here: process memory, capped by an option).
//! struct Scratch;
//!
//! #[async_trait]
//! impl BackendFactory for Scratch {
//!     fn example(&self) -> String {
//!         "url = \"scratch://\"  # max_keys = 1000".into()
//!     }
//!     async fn open(&self, tier: &TierRequest<'_>) -> Result<Box<dyn RemoteConnector>, ConfigError> {
//!         let mut options = tier.options();
//!         let _max_keys = options.u64("max_keys")?.unwrap_or(1000);
//!         options.finish()?; // an unknown option is an error naming it
//!         Ok(Box::new(InMemoryConnector::new()))
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! register_scheme("scratch", Scratch).unwrap();
//! let config = kvpool_core::PoolConfig::from_toml(
//!     "[local_cpu]\nmax_size = \"64MiB\"\n[[tier]]\nurl = \"scratch://\"\nmax_keys = 10",
//! ).unwrap();
//! let pool = kvpool_backends::build_pool(&config).await.unwrap();
//! assert_eq!(pool.engine.storage().tier_names(), ["cpu", "memory"]);
//! # }
//! ```

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock};

use async_trait::async_trait;
use parking_lot::RwLock;

use kvpool_core::{
    ChunkAllocator, ChunkCodec, ConfigError, RemoteBackend, RemoteConnector, StorageBackend,
    TierConfig,
};

use crate::backend_factory::{BackendFactory, TierRequest};

use crate::deferred::DeferredConnector;
use crate::memory::InMemoryConnector;
use crate::timeout::TimeoutConnector;

/// `memory://`: process memory (tests, demos).
struct MemoryFactory;

#[async_trait]
impl BackendFactory for MemoryFactory {
    fn example(&self) -> String {
        "url = \"memory://\"  # process memory, for tests and demos".into()
    }

    async fn open(&self, tier: &TierRequest<'_>) -> Result<Box<dyn RemoteConnector>, ConfigError> {
        tier.options().finish()?;
        Ok(Box::new(InMemoryConnector::new()))
    }
}

/// A built-in scheme whose cargo feature this build lacks: opening it says how to rebuild.
#[allow(dead_code)] // unused when every backend feature is on
struct NotCompiled {
    feature: &'static str,
}

#[async_trait]
impl BackendFactory for NotCompiled {
    fn example(&self) -> String {
        format!(
            "(not in this build: rebuild with `--features {}`)",
            self.feature
        )
    }

    async fn open(&self, tier: &TierRequest<'_>) -> Result<Box<dyn RemoteConnector>, ConfigError> {
        let scheme = scheme_of(tier.url())?;
        Err(invalid(format!(
            "`{scheme}://` needs the `{}` feature of kvpool-backends, which this build lacks (rebuild with `--features {}`)",
            self.feature, self.feature
        )))
    }
}

type Registry = BTreeMap<String, Arc<dyn BackendFactory>>;

fn builtin_schemes() -> Registry {
    let mut registry: Registry = BTreeMap::new();
    let mut add = |schemes: &[&str], factory: Arc<dyn BackendFactory>| {
        for scheme in schemes {
            registry.insert((*scheme).to_string(), factory.clone());
        }
    };
    add(&["memory"], Arc::new(MemoryFactory));
    add(
        crate::daemon::SCHEMES,
        Arc::new(crate::daemon::DaemonFactory),
    );
    #[cfg(feature = "disk")]
    add(crate::disk::SCHEMES, Arc::new(crate::disk::DiskFactory));
    #[cfg(not(feature = "disk"))]
    add(&["file"], Arc::new(NotCompiled { feature: "disk" }));
    #[cfg(feature = "redis")]
    add(crate::redis::SCHEMES, Arc::new(crate::redis::RedisFactory));
    #[cfg(not(feature = "redis"))]
    add(
        &["redis", "rediss", "redis+cluster", "rediss+cluster"],
        Arc::new(NotCompiled { feature: "redis" }),
    );
    #[cfg(feature = "s3")]
    add(crate::s3::SCHEMES, Arc::new(crate::s3::S3Factory));
    #[cfg(not(feature = "s3"))]
    add(&["s3"], Arc::new(NotCompiled { feature: "s3" }));
    #[cfg(feature = "mooncake")]
    add(
        crate::mooncake::SCHEMES,
        Arc::new(crate::mooncake::MooncakeFactory),
    );
    #[cfg(not(feature = "mooncake"))]
    add(
        &["mooncakestore"],
        Arc::new(NotCompiled {
            feature: "mooncake",
        }),
    );
    registry
}

static REGISTRY: LazyLock<RwLock<Registry>> = LazyLock::new(|| RwLock::new(builtin_schemes()));

fn invalid(reason: String) -> ConfigError {
    ConfigError::Invalid {
        field: "tier.url",
        reason,
    }
}

/// Registers `factory` for URLs `scheme://…`, process-wide. Built-in backends register through
/// the same table. Fails when the scheme is taken (built-in or registered earlier) or is not a
/// valid URL scheme (a letter, then letters, digits, `+`, `-` or `.`).
pub fn register_scheme(scheme: &str, factory: impl BackendFactory) -> Result<(), ConfigError> {
    let valid = scheme.starts_with(|c: char| c.is_ascii_lowercase())
        && scheme
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "+-.".contains(c));
    if !valid {
        return Err(invalid(format!(
            "`{scheme}` is not a URL scheme: use lowercase letters, digits, `+`, `-`, `.`, starting with a letter"
        )));
    }
    let mut registry = REGISTRY.write();
    if registry.contains_key(scheme) {
        return Err(invalid(format!(
            "scheme `{scheme}://` is already registered"
        )));
    }
    registry.insert(scheme.to_string(), Arc::new(factory));
    Ok(())
}

/// Every registered scheme with its backend's example, in scheme order.
pub fn schemes() -> Vec<(String, String)> {
    REGISTRY
        .read()
        .iter()
        .map(|(scheme, factory)| (scheme.clone(), factory.example()))
        .collect()
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

/// Opens the store described by `tier` without the chunk format: the backend registered for
/// its scheme parses its options and connects, and every call is bounded by the tier's
/// timeout. The values it holds are opaque bytes (the pool daemon's lower tiers store the
/// engines' already encoded chunks); [`open_tier`] is the usual entry.
pub async fn open_connector(
    tier: &TierConfig,
    max_chunk_bytes: u64,
) -> Result<TimeoutConnector<Box<dyn RemoteConnector>>, ConfigError> {
    let scheme = scheme_of(&tier.url)?;
    let factory = REGISTRY.read().get(scheme).cloned();
    let Some(factory) = factory else {
        let known: Vec<String> = REGISTRY.read().keys().cloned().collect();
        return Err(invalid(format!(
            "unknown scheme `{scheme}://`: expected one of {}",
            known.join(", ")
        )));
    };
    let request = TierRequest {
        tier,
        max_chunk_bytes,
    };
    let connector: Box<dyn RemoteConnector> = match factory.open(&request).await {
        Ok(connector) => connector,
        // Configured right, down now: opened later, a miss meanwhile (never a failed start).
        Err(ConfigError::Unreachable { reason, .. }) => {
            let name = factory.name_before_open(scheme);
            Box::new(DeferredConnector::new(
                factory,
                tier.clone(),
                max_chunk_bytes,
                name,
                reason,
            ))
        }
        Err(e) => return Err(e),
    };
    Ok(TimeoutConnector::new(connector, request.timeout()))
}

/// [`open_connector`] for each of `tiers`, in order.
pub async fn open_connectors(
    tiers: &[TierConfig],
    max_chunk_bytes: u64,
) -> Result<Vec<Arc<dyn RemoteConnector>>, ConfigError> {
    let mut out: Vec<Arc<dyn RemoteConnector>> = Vec::with_capacity(tiers.len());
    for tier in tiers {
        out.push(Arc::new(open_connector(tier, max_chunk_bytes).await?));
    }
    Ok(out)
}

/// Opens the tier described by `tier`: the backend registered for its scheme parses its
/// options and connects (bounded by the tier's timeout); the result is wrapped with the chunk
/// format and per-call timeouts. Fails with a message naming what to fix.
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
    let bounded = open_connector(tier, max_chunk_bytes).await?;
    let backend = RemoteBackend::new(bounded, codec, max_chunk_bytes);
    Ok(Arc::new(match allocator {
        Some(allocator) => backend.with_allocator(allocator),
        None => backend,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn open_error(tier: TierConfig) -> String {
        open_tier(&tier, ChunkCodec::default(), 1 << 20)
            .await
            .err()
            .expect("opening should fail")
            .to_string()
    }

    #[tokio::test]
    async fn unknown_schemes_and_non_urls_are_clear_errors() {
        let err = open_error(TierConfig::new("ftp://h/x")).await;
        assert!(err.contains("unknown scheme `ftp://`"), "{err}");
        // Every built-in scheme is listed, whether or not its feature is compiled in.
        for scheme in ["file", "memory", "mooncakestore", "redis", "s3"] {
            assert!(err.contains(scheme), "{scheme} missing from: {err}");
        }
        let err = open_error(TierConfig::new("localhost:6379")).await;
        assert!(err.contains("is not a URL"), "{err}");
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

    #[tokio::test]
    async fn an_option_the_backend_does_not_take_is_an_error_naming_it() {
        let err = open_error(TierConfig::new("memory://").with_option("capacity", "1GiB")).await;
        assert!(
            err.contains("`capacity`") && err.contains("memory://"),
            "{err}"
        );
    }

    #[test]
    fn taken_and_malformed_schemes_are_refused() {
        let err = register_scheme("memory", MemoryFactory).unwrap_err();
        assert!(err.to_string().contains("already registered"), "{err}");
        let err = register_scheme("My Scheme", MemoryFactory).unwrap_err();
        assert!(err.to_string().contains("not a URL scheme"), "{err}");
    }

    #[tokio::test]
    async fn a_registered_scheme_opens_its_backend() {
        register_scheme("registry-test", MemoryFactory).unwrap();
        let tier = open_tier(
            &TierConfig::new("registry-test://"),
            ChunkCodec::default(),
            1 << 20,
        )
        .await
        .unwrap();
        assert_eq!(tier.name(), "memory");
        assert!(schemes().iter().any(|(s, _)| s == "registry-test"));
    }

    #[cfg(not(feature = "s3"))]
    #[tokio::test]
    async fn a_scheme_whose_feature_is_missing_says_which_feature() {
        let err = open_error(TierConfig::new("s3://bucket/prefix")).await;
        assert!(err.contains("--features s3"), "{err}");
    }
}
