//! Fitting a pool to a vLLM engine: the facts vLLM gives the connector (model, parallel ranks,
//! the KV tensors' shape and dtype) override the config's model and layout sections.

use std::path::{Path, PathBuf};

use kvpool_core::keys::{EngineInterface, engine_scope_model};
use kvpool_core::{ConfigError, Dtype, KvKind, PoolConfig};

/// What the Python connector learns from vLLM about the engine it runs in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VllmEngineFacts {
    /// vLLM's model (served name or path); used when the config does not name one.
    pub model: String,
    /// A digest of the weights the engine loaded (see docs/keys.md): always part of the key
    /// scope, whatever the model's name, so two checkpoints never share a chunk.
    pub weights: String,
    /// Tensor-parallel world size.
    pub tp_size: u32,
    /// This worker's tensor-parallel rank.
    pub tp_rank: u32,
    /// Pipeline-parallel rank.
    pub pp_rank: u32,
    /// vLLM's block size in tokens.
    pub block_size: usize,
    /// Attention layers with a KV cache (one registered tensor each).
    pub num_layers: usize,
    /// KV heads per layer on this rank.
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_size: usize,
    /// The KV cache's element type.
    pub dtype: Dtype,
    /// K and V per token, or one latent vector (MLA).
    pub kind: KvKind,
    /// The KV is the same on every tensor-parallel rank (MLA's latent): the key scope leaves
    /// the rank out, so every rank names a chunk alike and a shared tier holds it once.
    pub replicated: bool,
    /// A description of how the engine lays out bytes inside a block (attention backend,
    /// instruction set, tensor shape and strides). Blocks are moved as opaque bytes, so two
    /// engines with different tags must never share chunks: the tag is part of every key.
    pub kv_format: String,
}

/// The config name that means "not set by the user" (see `ModelConfig::default`).
const DEFAULT_MODEL_NAME: &str = "default-model";

/// The pool config for a vLLM worker: `base` (the user's TOML or JSON) with its `[model]` and
/// `[layout]` taken from the engine. The key scope's model is `<name>@w=<weights
/// digest>|kv=<digest of kv_format>`, so chunks written by other weights or under another
/// block format are never found. With `[metrics] listen`, TP rank `r` serves on the
/// configured port plus `r`.
pub fn pool_config_for_vllm(
    base: &PoolConfig,
    facts: &VllmEngineFacts,
) -> Result<PoolConfig, ConfigError> {
    let mut config = base.clone();
    let name = if base.model.name == DEFAULT_MODEL_NAME {
        facts.model.clone()
    } else {
        base.model.name.clone()
    };
    config.model.name = engine_scope_model(
        EngineInterface::VllmConnector,
        &name,
        &facts.weights,
        &facts.kv_format,
    );
    (config.model.world_size, config.model.rank) = if facts.replicated {
        (1, 0)
    } else {
        (facts.tp_size, facts.tp_rank)
    };
    config.model.pp_rank = facts.pp_rank;
    config.layout.num_layers = facts.num_layers;
    config.layout.num_kv_heads = facts.num_kv_heads;
    config.layout.head_size = facts.head_size;
    config.layout.dtype = facts.dtype;
    config.layout.kind = facts.kind;
    config.layout.block_size = facts.block_size;
    if !config.chunking.chunk_size.is_multiple_of(facts.block_size) {
        return Err(ConfigError::Invalid {
            field: "chunking.chunk_size",
            reason: format!(
                "{} is not a multiple of vLLM's block size {}: chunks are made of whole blocks",
                config.chunking.chunk_size, facts.block_size
            ),
        });
    }
    if config.chunking.save_unfull_chunk {
        tracing::warn!(
            "chunking.save_unfull_chunk is ignored with vLLM: chunks are moved as whole blocks"
        );
        config.chunking.save_unfull_chunk = false;
    }
    // Each worker process serves its own metrics: TP rank r on the configured port + r.
    if let Some(mut addr) = base.metrics.listen_addr()? {
        let port = u32::from(addr.port()) + facts.tp_rank;
        addr.set_port(u16::try_from(port).map_err(|_| ConfigError::Invalid {
            field: "metrics.listen",
            reason: format!(
                "port {} + TP rank {} is past 65535",
                addr.port(),
                facts.tp_rank
            ),
        })?);
        config.metrics.listen = Some(addr.to_string());
    }
    if facts.tp_size > 1 {
        shard_disk_tiers(&mut config, facts.tp_size, facts.tp_rank);
    }
    config.validate()?;
    Ok(config)
}

/// A disk tier (`file://`) is one RocksDB database that a process opens exclusively: with
/// tensor parallelism each rank keeps its own under the configured directory
/// (`<dir>/tp<size>-rank<rank>`) with its share of the tier's capacity (the `shares` option),
/// so the ranks never contend for one lock, and a fresh engine with the same parallel layout
/// finds what each of its ranks stored. (Keys already carry the rank; MLA's replicated latent
/// is then stored once per rank on disk.)
fn shard_disk_tiers(config: &mut PoolConfig, tp_size: u32, tp_rank: u32) {
    for tier in &mut config.tiers {
        if let Some(dir) = tier.url.strip_prefix("file://") {
            tier.url = format!(
                "file://{}/tp{tp_size}-rank{tp_rank}",
                dir.trim_end_matches('/')
            );
            // An operator's own `shares` stands.
            if tier.options.get("shares").is_none() {
                tier.options.set("shares", u64::from(tp_size));
            }
        }
    }
}

/// The lookup socket of one worker rank of one vLLM engine (`engine_id` is vLLM's
/// `kv_transfer_config.engine_id`, the same in every process of the engine).
pub fn lookup_socket_path(dir: &Path, engine_id: &str, tp_rank: u32) -> PathBuf {
    let safe: String = engine_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    dir.join(format!("kvpool-{safe}-tp{tp_rank}.sock"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> VllmEngineFacts {
        VllmEngineFacts {
            model: "/models/tiny".into(),
            weights: "0123abcd".into(),
            tp_size: 2,
            tp_rank: 1,
            pp_rank: 0,
            block_size: 32,
            num_layers: 2,
            num_kv_heads: 2,
            head_size: 64,
            dtype: Dtype::F32,
            kind: KvKind::KeyValue,
            replicated: false,
            kv_format: "cpu|avx512|[32768,2,32,128]".into(),
        }
    }

    #[test]
    fn engine_facts_override_model_and_layout() {
        let c = pool_config_for_vllm(&PoolConfig::default(), &facts()).unwrap();
        assert!(c.model.name.starts_with("/models/tiny@w=0123abcd|kv="));
        assert_eq!((c.model.world_size, c.model.rank), (2, 1));
        assert_eq!(c.layout.num_layers, 2);
        assert_eq!(c.layout.block_size, 32);
        let mut other = facts();
        other.kv_format = "cpu|avx2|[32768,2,32,128]".into();
        let c2 = pool_config_for_vllm(&PoolConfig::default(), &other).unwrap();
        assert_ne!(
            c.model.name, c2.model.name,
            "block formats never share keys"
        );
        let mut named = PoolConfig::default();
        named.model.name = "llama".into();
        assert!(
            pool_config_for_vllm(&named, &facts())
                .unwrap()
                .model
                .name
                .starts_with("llama@w=0123abcd|kv="),
            "a configured name never unbinds the weights"
        );
        let mut retrained = facts();
        retrained.weights = "ffff0000".into();
        assert_ne!(
            pool_config_for_vllm(&named, &retrained).unwrap().model.name,
            pool_config_for_vllm(&named, &facts()).unwrap().model.name,
            "other weights never share keys"
        );
    }

    #[test]
    fn replicated_kv_leaves_the_rank_out_of_the_scope() {
        let mut mla = facts();
        mla.kind = KvKind::MlaLatent;
        mla.replicated = true;
        let c = pool_config_for_vllm(&PoolConfig::default(), &mla).unwrap();
        assert_eq!((c.model.world_size, c.model.rank), (1, 0));
    }

    #[test]
    fn chunk_size_must_be_whole_blocks() {
        let mut base = PoolConfig::default();
        base.chunking.chunk_size = 48;
        let err = pool_config_for_vllm(&base, &facts()).unwrap_err();
        assert!(err.to_string().contains("multiple of vLLM's block size 32"));
    }

    #[test]
    fn each_tp_rank_serves_metrics_on_its_own_port() {
        let mut base = PoolConfig::default();
        base.metrics.listen = Some("127.0.0.1:9464".into());
        let c = pool_config_for_vllm(&base, &facts()).unwrap();
        assert_eq!(
            c.metrics.listen.as_deref(),
            Some("127.0.0.1:9465"),
            "rank 1"
        );
        base.metrics.listen = Some("127.0.0.1:65535".into());
        assert!(pool_config_for_vllm(&base, &facts()).is_err());
        let c = pool_config_for_vllm(&PoolConfig::default(), &facts()).unwrap();
        assert_eq!(c.metrics.listen, None, "off unless asked for");
    }

    #[test]
    fn each_tp_rank_keeps_its_own_disk_directory_with_its_share_of_the_capacity() {
        let base = PoolConfig {
            tiers: vec![
                kvpool_core::TierConfig::new("file:///var/cache/kvpool/"),
                kvpool_core::TierConfig::new("redis://127.0.0.1:6379"),
            ],
            ..PoolConfig::default()
        };
        // facts(): TP rank 1 of 2.
        let c = pool_config_for_vllm(&base, &facts()).unwrap();
        assert_eq!(c.tiers[0].url, "file:///var/cache/kvpool/tp2-rank1");
        assert!(c.tiers[0].options.get("shares").is_some());
        assert_eq!(
            c.tiers[1].url, "redis://127.0.0.1:6379",
            "shared tiers stay shared"
        );
        assert!(c.tiers[1].options.get("shares").is_none());
        let mut one = facts();
        (one.tp_size, one.tp_rank) = (1, 0);
        let c = pool_config_for_vllm(&base, &one).unwrap();
        assert_eq!(
            c.tiers[0].url, "file:///var/cache/kvpool/",
            "TP=1: as configured"
        );
        // MLA's replicated latent leaves the rank out of its keys, not its directory: two
        // ranks never open one database.
        let mut mla = facts();
        mla.kind = KvKind::MlaLatent;
        mla.replicated = true;
        let c = pool_config_for_vllm(&base, &mla).unwrap();
        assert_eq!(c.tiers[0].url, "file:///var/cache/kvpool/tp2-rank1");
    }

    #[test]
    fn socket_paths_are_per_engine_and_rank() {
        let a = lookup_socket_path(Path::new("/tmp"), "e/1", 0);
        assert_eq!(a, Path::new("/tmp/kvpool-e_1-tp0.sock"));
        assert_ne!(a, lookup_socket_path(Path::new("/tmp"), "e/1", 1));
    }
}
