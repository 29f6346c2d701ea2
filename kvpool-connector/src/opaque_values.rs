//! Pool configs for engines that hand kvpool fixed-size opaque values (vLLM's offloading rows,
//! SGLang's HiCache pages): one value is one chunk, scoped by the engine's own identity.

use kvpool_core::{ConfigError, Dtype, KvKind, PoolConfig};

/// Who a value belongs to: the key scope's parts besides the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValueScope<'a> {
    /// The model scope: served name bound to the weights and to everything that decides a
    /// value's bytes (the engine's layout, dtype, parallelism, interface).
    pub model: &'a str,
    /// Tensor-parallel world size the values were written under (1 when every rank shares).
    pub world_size: u32,
    /// Tensor-parallel rank (0 when every rank shares one value).
    pub rank: u32,
    /// Pipeline-parallel rank (a stage holds its own layers).
    pub pp_rank: u32,
}

/// Fits the user's pool config to values of `value_bytes`: one chunk is one value, stored as
/// an opaque layout of one plane of `value_bytes / 2` two-byte elements (so the tiers' size
/// bounds fit it exactly) under `scope`. `what` names the value in errors ("vLLM's primary
/// rows", "SGLang's pages").
pub fn pool_config_for_values(
    base: &PoolConfig,
    scope: ValueScope<'_>,
    value_bytes: usize,
    what: &str,
) -> Result<PoolConfig, ConfigError> {
    if value_bytes == 0 || !value_bytes.is_multiple_of(2) {
        return Err(ConfigError::Invalid {
            field: "value size",
            reason: format!("{what} must be a positive even number of bytes, not {value_bytes}"),
        });
    }
    let mut config = base.clone();
    config.model.name = scope.model.to_string();
    config.model.world_size = scope.world_size.max(1);
    config.model.rank = scope.rank;
    config.model.pp_rank = scope.pp_rank;
    config.layout.num_layers = 1;
    config.layout.num_kv_heads = 1;
    config.layout.head_size = value_bytes / 2;
    config.layout.dtype = Dtype::F16;
    config.layout.kind = KvKind::MlaLatent;
    config.layout.block_size = 1;
    config.chunking.chunk_size = 1;
    config.chunking.save_unfull_chunk = false;
    config.validate()?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(rank: u32) -> ValueScope<'static> {
        ValueScope {
            model: "m@w=1",
            world_size: 2,
            rank,
            pp_rank: 0,
        }
    }

    #[test]
    fn a_value_is_one_chunk_of_exactly_its_bytes_and_ranks_get_different_scopes() {
        let config =
            pool_config_for_values(&PoolConfig::default(), scope(1), 4096, "pages").unwrap();
        assert_eq!(config.chunk_bytes().unwrap(), 4096);
        let other =
            pool_config_for_values(&PoolConfig::default(), scope(0), 4096, "pages").unwrap();
        assert_ne!(
            config.key_scope().unwrap().digest(),
            other.key_scope().unwrap().digest()
        );
    }

    #[test]
    fn odd_or_empty_values_are_refused_naming_them() {
        for bytes in [0, 4097] {
            let err =
                pool_config_for_values(&PoolConfig::default(), scope(0), bytes, "SGLang's pages")
                    .unwrap_err()
                    .to_string();
            assert!(
                err.contains("SGLang's pages") && err.contains(&bytes.to_string()),
                "{err}"
            );
        }
    }
}
