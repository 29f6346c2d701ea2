//! The pool configuration (TOML): model scope, layout, chunking, tiers, codec, write-behind;
//! sizes such as `"2GiB"` ([`byte_size`]) and a tier's backend-owned options ([`tier_options`]).

pub mod byte_size;
pub mod tenant;
pub mod tier_options;

use std::fmt;

use serde::{Deserialize, Serialize};

pub use crate::config::byte_size::ByteSize;
pub use crate::config::tenant::TenantConfig;
pub use crate::config::tier_options::redact_url;
use crate::config::tier_options::{TierOptionValue, TierOptions, TierOptionsReader};
use crate::error::ConfigError;
use crate::format::chunk_format::ChunkCodec;
use crate::keys::cache_key::KeyScope;
use crate::keys::token_database::ChunkingConfig;
use crate::layout::KvLayout;
use crate::memory::eviction::EvictionKind;

/// Who is caching: model and parallel ranks (part of every key).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Model name.
    pub name: String,
    /// Tensor-parallel world size.
    pub world_size: u32,
    /// Tensor-parallel rank.
    pub rank: u32,
    /// Pipeline-parallel rank.
    pub pp_rank: u32,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            name: "default-model".into(),
            world_size: 1,
            rank: 0,
            pp_rank: 0,
        }
    }
}

/// The local CPU tier (L1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LocalCpuConfig {
    /// Whether L1 is used.
    pub enabled: bool,
    /// Pool size; never exceeded.
    pub max_size: ByteSize,
    /// Eviction policy.
    pub eviction: EvictionKind,
}

impl Default for LocalCpuConfig {
    fn default() -> Self {
        LocalCpuConfig {
            enabled: true,
            max_size: ByteSize::gib(2),
            eviction: EvictionKind::Lru,
        }
    }
}

/// The C allocator of the process the pool runs in (glibc's malloc, which RocksDB and other
/// C libraries use too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct AllocatorConfig {
    /// Every this many seconds, hand the pages that malloc holds free back to the operating
    /// system (`malloc_trim`; glibc only); 0, the default, never. glibc keeps freed memory in
    /// its arenas, so resident memory creeps up over hours of churn although nothing leaks
    /// (docs/reliability.md, chaos soak). A trim holds the allocator's locks while it runs
    /// (well under a millisecond for a heap of tens of MiB, longer for gigabytes), which is why
    /// it is off unless asked for. Process-wide: the first pool that asks starts it.
    pub release_free_pages_secs: u64,
}

/// Write-behind to lower tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WriteBehindConfig {
    /// Bytes in flight per lower tier before writes are dropped.
    pub quota: ByteSize,
    /// Whether chunks found in lower tiers are copied into L1.
    pub promote_on_hit: bool,
    /// Whether write-behind to a disk tier (`file://`) runs on threads of the lowest CPU
    /// priority (one runtime per process), so that on a host whose cores run the engine's
    /// compute it takes what the compute leaves; `false`: on the pool's own runtime. Network
    /// and node-memory tiers are written from the pool's own runtime either way. `kvpool
    /// serve` also pauses that work while other processes wait for a CPU, as a nice value does
    /// not hold across scheduling groups (a systemd service, another session).
    pub low_priority: bool,
}

impl Default for WriteBehindConfig {
    fn default() -> Self {
        WriteBehindConfig {
            quota: ByteSize::gib(1),
            promote_on_hit: true,
            low_priority: true,
        }
    }
}

/// The Prometheus endpoint (`[metrics]`); off unless `listen` is set.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Address to serve Prometheus metrics on, e.g. `"127.0.0.1:9464"` (every path answers
    /// with the text exposition format). One per process: a second pool in the same process
    /// may name the same address or none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
}

impl MetricsConfig {
    /// The listen address, parsed.
    pub fn listen_addr(&self) -> Result<Option<std::net::SocketAddr>, ConfigError> {
        self.listen
            .as_deref()
            .map(|a| {
                a.parse().map_err(|e| ConfigError::Invalid {
                    field: "metrics.listen",
                    reason: format!("`{a}` is not an address like 127.0.0.1:9464: {e}"),
                })
            })
            .transpose()
    }
}

/// A lower tier (disk, Redis, …), chosen by URL scheme.
///
/// Core knows no backend: `url` picks the backend registered for its scheme (see
/// `kvpool_backends::registry`), and every other key of the `[[tier]]` table lands in
/// [`TierConfig::options`] for that backend to read (and to reject when it does not know it).
///
/// ```
/// let cfg = kvpool_core::PoolConfig::from_toml(
///     "[[tier]]\nurl = \"file:///var/cache/kvpool\"\ncapacity = \"8GiB\"\ntimeout_ms = 500",
/// ).unwrap();
/// assert_eq!(cfg.tiers[0].timeout_ms, 500);
/// assert!(cfg.tiers[0].options.get("capacity").is_some());
/// ```
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct TierConfig {
    /// Where the tier lives; its scheme selects the backend.
    pub url: String,
    /// Bound on connecting and on every call, in milliseconds.
    #[serde(default = "TierConfig::default_timeout_ms")]
    pub timeout_ms: u64,
    /// The backend's own options (every other key of the table).
    #[serde(flatten)]
    pub options: TierOptions,
}

/// Secrets (the URL's password, secret options) print as `***`.
impl fmt::Debug for TierConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TierConfig")
            .field("url", &redact_url(&self.url))
            .field("timeout_ms", &self.timeout_ms)
            .field("options", &self.options)
            .finish()
    }
}

impl TierConfig {
    fn default_timeout_ms() -> u64 {
        2000
    }

    /// A tier at `url` with default options.
    pub fn new(url: impl Into<String>) -> Self {
        TierConfig {
            url: url.into(),
            timeout_ms: Self::default_timeout_ms(),
            options: TierOptions::default(),
        }
    }

    /// Sets the backend option `key`; chainable.
    pub fn with_option(
        mut self,
        key: impl Into<String>,
        value: impl Into<TierOptionValue>,
    ) -> Self {
        self.options.set(key, value);
        self
    }

    /// A reader of this tier's options for the backend opening it.
    pub fn options_reader(&self) -> TierOptionsReader<'_> {
        self.options.reader(&self.url)
    }
}

/// The whole pool configuration.
///
/// ```
/// let cfg: kvpool_core::PoolConfig = toml::from_str(r#"
///     [model]
///     name = "llama-3-8b"
///     [layout]
///     num_layers = 32
///     [local_cpu]
///     max_size = "4GiB"
///     eviction = "s3fifo"
/// "#).unwrap();
/// cfg.validate().unwrap();
/// assert_eq!(cfg.local_cpu.max_size.0, 4 << 30);
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct PoolConfig {
    /// Model scope.
    pub model: ModelConfig,
    /// KV layout (`[layout]`: `num_layers`, `num_kv_heads`, `head_size`, `dtype`, `kind`,
    /// `block_size`), checked by [`PoolConfig::validate`].
    pub layout: KvLayout,
    /// Chunking and hashing.
    pub chunking: ChunkingConfig,
    /// L1 CPU tier.
    pub local_cpu: LocalCpuConfig,
    /// Write-behind.
    pub write_behind: WriteBehindConfig,
    /// Stored chunk encoding for lower tiers.
    pub codec: ChunkCodec,
    /// The Prometheus endpoint.
    pub metrics: MetricsConfig,
    /// Giving the C allocator's free pages back to the operating system.
    pub allocator: AllocatorConfig,
    /// Lower tiers, looked up in this order after L1 (`[[tier]]` tables).
    #[serde(rename = "tier", default, skip_serializing_if = "Vec::is_empty")]
    pub tiers: Vec<TierConfig>,
    /// The node daemon's tenants (`[[tenant]]` tables; `kvpool serve` only, an engine's pool
    /// refuses them): see [`TenantConfig`].
    #[serde(rename = "tenant", default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantConfig>,
}

impl PoolConfig {
    /// Parses TOML and validates it.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let cfg = Self::parse_toml(text)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses TOML without validating: for callers that fit the config to an engine (layout,
    /// chunking) and validate the result.
    pub fn parse_toml(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))
    }

    /// Reads, parses and validates a TOML file.
    pub fn from_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml(&text)
    }

    /// The default configuration as commented TOML.
    pub fn default_toml() -> String {
        let body =
            toml::to_string_pretty(&PoolConfig::default()).expect("default config serialises");
        format!(
            "# kvpool configuration. Sizes accept B/KiB/MiB/GiB (or KB/MB/GB) or plain bytes.\n\
             # eviction: lru | fifo | s3fifo; hash_algorithm: xxh3_128 | sha256;\n\
             # codec.checksum: xxh3 | crc32c; codec.compression: {{ kind = \"none\" }} | {{ kind = \"zstd\", level = 3 }}\n\
             # Lower tiers, looked up in order after L1: [[tier]] tables with a url whose scheme picks\n\
             # the backend, timeout_ms (default 2000) and the backend's own options\n\
             # (`kvpool config --schemes` lists the schemes this build knows, with examples).\n\
             # Prometheus metrics (off by default; see docs/metrics.md):\n\
             #   [metrics]\n\
             #   listen = \"127.0.0.1:9464\"\n\n{body}"
        )
    }

    /// The layout, validated (no zero dimension).
    pub fn layout(&self) -> Result<KvLayout, ConfigError> {
        self.layout.validate()?;
        Ok(self.layout)
    }

    /// Bytes of one full chunk.
    pub fn chunk_bytes(&self) -> Result<usize, ConfigError> {
        Ok(self.layout()?.chunk_bytes(self.chunking.chunk_size))
    }

    /// The key scope for this model, rank and layout.
    pub fn key_scope(&self) -> Result<KeyScope, ConfigError> {
        let layout = self.layout()?;
        Ok(KeyScope::new(
            self.model.name.clone(),
            self.model.world_size,
            self.model.rank,
            self.model.pp_rank,
            layout.fingerprint(),
        )?)
    }

    /// Checks values and their combinations, with messages that say what to change.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.key_scope()?;
        tenant::validate_tenants(&self.tenants)?;
        self.metrics.listen_addr()?;
        if self.chunking.chunk_size == 0 {
            return Err(ConfigError::Invalid {
                field: "chunking.chunk_size",
                reason: "must be at least 1 token (256 is typical)".into(),
            });
        }
        if let crate::format::chunk_format::Compression::Zstd { level } = self.codec.compression
            && !(1..=22).contains(&level)
        {
            return Err(ConfigError::Invalid {
                field: "codec.compression.level",
                reason: format!("zstd level {level} is outside 1..=22"),
            });
        }
        let chunk = self.chunk_bytes()? as u64;
        if self.local_cpu.enabled && self.local_cpu.max_size.0 < chunk {
            return Err(ConfigError::Invalid {
                field: "local_cpu.max_size",
                reason: format!(
                    "{} cannot hold one chunk of {} ({} tokens x {} bytes/token); raise it or lower chunking.chunk_size",
                    self.local_cpu.max_size,
                    ByteSize(chunk),
                    self.chunking.chunk_size,
                    self.layout()?.bytes_per_token()
                ),
            });
        }
        if self.write_behind.quota.0 < chunk {
            return Err(ConfigError::Invalid {
                field: "write_behind.quota",
                reason: format!(
                    "{} is below one chunk ({}); every write-behind would be dropped",
                    self.write_behind.quota,
                    ByteSize(chunk)
                ),
            });
        }
        if !self.local_cpu.enabled && self.tiers.is_empty() {
            return Err(ConfigError::Invalid {
                field: "local_cpu.enabled",
                reason: "no storage tier is configured: enable local_cpu or add a [[tier]]".into(),
            });
        }
        for t in &self.tiers {
            if !t.url.contains("://") {
                return Err(ConfigError::Invalid {
                    field: "tier.url",
                    reason: format!(
                        "`{}` is not a URL: use e.g. file:///var/cache/kvpool or redis://host:6379",
                        t.url
                    ),
                });
            }
            if t.timeout_ms == 0 {
                return Err(ConfigError::Invalid {
                    field: "tier.timeout_ms",
                    reason: "must be above zero".into(),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/configuration.md names every key of the config (`section.key`, a `[[tier]]`'s and
    /// a `[[tenant]]`'s), so the reference cannot drift from the structs.
    #[test]
    fn every_config_key_is_documented() {
        fn walk(prefix: &str, value: &toml::Value, out: &mut Vec<String>) {
            match value {
                toml::Value::Table(t) => {
                    for (k, v) in t {
                        let path = if prefix.is_empty() {
                            k.clone()
                        } else {
                            format!("{prefix}.{k}")
                        };
                        // A table that is a value of its own (`{ kind = "zstd" }`) is one key;
                        // other tables are sections, their keys documented one by one.
                        if path == "codec.compression" || !v.is_table() && !v.is_array() {
                            out.push(path);
                        } else {
                            walk(&path, v, out);
                        }
                    }
                }
                toml::Value::Array(items) => {
                    for item in items {
                        walk(prefix, item, out);
                    }
                }
                _ => {}
            }
        }
        let mut config = PoolConfig::default();
        config.metrics.listen = Some("127.0.0.1:9464".into());
        config.tiers.push(TierConfig::new("file:///x"));
        config.tenants.push(TenantConfig {
            name: "a".into(),
            socket: "/run/a.sock".into(),
            group: Some("g".into()),
            memory: ByteSize::gib(1),
            mac_key_file: Some("/k".into()),
        });
        let value = toml::Value::try_from(&config).unwrap();
        let mut keys = Vec::new();
        walk("", &value, &mut keys);
        let doc = include_str!("../../../docs/configuration.md");
        let missing: Vec<&String> = keys
            .iter()
            .filter(|k| {
                // A tier's own keys are documented in its table (`url`, `timeout_ms`).
                let bare = k.strip_prefix("tier.").unwrap_or(k);
                !doc.contains(&format!("`{k}`")) && !doc.contains(&format!("`{bare}`"))
            })
            .collect();
        assert!(
            missing.is_empty(),
            "docs/configuration.md lacks {missing:?}"
        );
    }

    #[test]
    fn default_config_round_trips_through_its_toml() {
        let text = PoolConfig::default_toml();
        assert_eq!(PoolConfig::from_toml(&text).unwrap(), PoolConfig::default());
    }

    #[test]
    fn capacity_below_one_chunk_is_a_clear_error() {
        let mut cfg = PoolConfig::default();
        cfg.local_cpu.max_size = ByteSize::mib(1);
        let err = cfg.validate().unwrap_err().to_string();
        assert!(
            err.contains("local_cpu.max_size") && err.contains("cannot hold one chunk"),
            "{err}"
        );
    }

    #[test]
    fn unknown_fields_and_bad_values_are_rejected() {
        assert!(PoolConfig::from_toml("[local_cpu]\nmax_sise = 1").is_err());
        assert!(PoolConfig::from_toml("[layout]\ndtype = \"int3\"").is_err());
        assert!(PoolConfig::from_toml("[model]\nworld_size = 2\nrank = 2").is_err());
        assert!(PoolConfig::from_toml("[layout]\nnum_layers = 0").is_err());
        assert!(PoolConfig::from_toml("[[tier]]\nurl = \"localhost:6379\"").is_err());
        assert!(PoolConfig::from_toml("[local_cpu]\nenabled = false").is_err());
    }

    #[test]
    fn tiers_parse_with_options() {
        let cfg = PoolConfig::from_toml(
            "[[tier]]\nurl = \"file:///tmp/x\"\ncapacity = \"8GiB\"\n[[tier]]\nurl = \"redis://h:1\"\nttl_seconds = 60",
        )
        .unwrap();
        assert_eq!(cfg.tiers.len(), 2);
        let mut disk = cfg.tiers[0].options_reader();
        assert_eq!(disk.bytes("capacity").unwrap(), Some(ByteSize::gib(8)));
        disk.finish().unwrap();
        let mut redis = cfg.tiers[1].options_reader();
        assert_eq!(redis.u64("ttl_seconds").unwrap(), Some(60));
        redis.finish().unwrap();
        assert_eq!(cfg.tiers[1].timeout_ms, 2000);
    }
}
