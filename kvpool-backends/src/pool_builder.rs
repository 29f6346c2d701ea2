//! Builds a ready cache engine (tiers, storage manager, token database) from a `PoolConfig`.

use std::sync::Arc;
use std::time::Duration;

use kvpool_core::storage::manager::StorageManagerConfig;
use kvpool_core::{
    CacheEngine, ChunkedTokenDatabase, ConfigError, HeapAllocator, HostAllocator, PoolConfig,
    StorageManager,
};

use crate::cpu::LocalCpuBackend;

/// A built pool: the engine and direct handles to its tiers.
#[derive(Debug)]
pub struct Pool {
    /// The cache engine.
    pub engine: Arc<CacheEngine>,
    /// The L1 tier, when enabled.
    pub l1: Option<Arc<LocalCpuBackend>>,
}

/// Builds a pool from `config` with heap memory for L1: opens every `[[tier]]` (connecting to
/// servers, so a wrong address or password fails here), then wires the storage manager and
/// the engine. Must run inside a tokio runtime.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let mut config = kvpool_core::PoolConfig::default();
/// config.local_cpu.max_size = kvpool_core::ByteSize::mib(64);
/// config.tiers.push(kvpool_core::TierConfig::new("memory://"));
/// let pool = kvpool_backends::build_pool(&config).await.unwrap();
/// assert_eq!(pool.engine.storage().tier_names(), ["cpu", "memory"]);
/// # }
/// ```
pub async fn build_pool(config: &PoolConfig) -> Result<Pool, ConfigError> {
    build_pool_with_allocator(config, &HeapAllocator).await
}

/// Builds a pool whose L1 arena comes from `allocator` (e.g. pinned or shared memory).
pub async fn build_pool_with_allocator(
    config: &PoolConfig,
    allocator: &dyn HostAllocator,
) -> Result<Pool, ConfigError> {
    config.validate()?;
    if !config.tenants.is_empty() {
        return Err(ConfigError::Invalid {
            field: "tenant",
            reason: "`[[tenant]]` configures the node daemon (`kvpool serve`); an engine's pool \
                     takes none: point the engine at its tenant's socket instead"
                .into(),
        });
    }
    if let Some(addr) = config.metrics.listen_addr()? {
        crate::metrics_endpoint::serve_metrics(addr)?;
    }
    if config.allocator.release_free_pages_secs > 0 {
        crate::allocator_trim::start_periodic_release(Duration::from_secs(
            config.allocator.release_free_pages_secs,
        ))
        .map_err(|e| ConfigError::Invalid {
            field: "allocator.release_free_pages_secs",
            reason: format!("cannot start the thread that releases free pages: {e}"),
        })?;
    }
    let layout = config.layout()?;
    let db = ChunkedTokenDatabase::new(config.chunking, config.key_scope()?)?;
    let mut builder = StorageManager::builder().config(StorageManagerConfig {
        write_behind_quota_bytes: config.write_behind.quota.as_usize(),
        promote_on_hit: config.write_behind.promote_on_hit,
    });
    let l1 = if config.local_cpu.enabled {
        let cpu = LocalCpuBackend::with_allocator(
            config.local_cpu.max_size.as_usize(),
            allocator,
            config.local_cpu.eviction,
        )
        .map_err(|e| ConfigError::Invalid {
            field: "local_cpu.max_size",
            reason: e.to_string(),
        })?;
        let cpu = Arc::new(cpu);
        builder = builder.l1(cpu.clone(), cpu.clone());
        Some(cpu)
    } else {
        None
    };
    let max_chunk_bytes = layout.chunk_bytes(config.chunking.chunk_size) as u64;
    // Lower tiers decode loaded chunks straight into L1 memory.
    let allocator = l1
        .clone()
        .map(|cpu| cpu as Arc<dyn kvpool_core::ChunkAllocator>);
    for tier in &config.tiers {
        let backend = crate::registry::open_tier_with_allocator(
            tier,
            config.codec,
            max_chunk_bytes,
            allocator.clone(),
        )
        .await?;
        let pool_runtime = tokio::runtime::Handle::current();
        builder = match crate::background::write_behind_runtime_for(config, tier, &pool_runtime) {
            Some(runtime) => builder.lower_written_behind_on(backend, runtime),
            None => builder.lower(backend),
        };
    }
    let manager = Arc::new(builder.build()?);
    let engine = Arc::new(CacheEngine::new(layout, db, manager)?);
    Ok(Pool { engine, l1 })
}
