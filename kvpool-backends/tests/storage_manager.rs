//! The storage manager's read path: each tier is asked at most once per chunk, and a remote
//! hit costs one round trip (no `exists` before the `get`).

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use common::{MapConnector, assert_rows_equal, engine_over, small_layout, store_prompt};
use kvpool_core::{ChunkCodec, HostPagedKvCache, RemoteBackend};

#[tokio::test]
async fn a_retrieve_asks_the_remote_tier_once_per_chunk() {
    let remote = MapConnector::default();
    let engine = engine_over(
        Arc::new(RemoteBackend::new(
            remote.clone(),
            ChunkCodec::default(),
            1 << 20,
        )),
        "asks",
    );
    // 4 chunks of 16 tokens.
    let stored = store_prompt(&engine, 64, 3).await;
    remote.asks.store(0, Ordering::SeqCst);
    let mut kv = HostPagedKvCache::new(small_layout(), 32);
    let dst: Vec<i64> = (64..128).collect();
    let mask = engine
        .retrieve(&stored.tokens, None, &mut kv, &dst)
        .await
        .unwrap();
    assert!(mask.iter().all(|&m| m));
    assert_rows_equal(&stored.kv, &stored.slots, &kv, &dst, &mask);
    assert_eq!(
        remote.asks.load(Ordering::SeqCst),
        4,
        "one get per chunk, no exists before it"
    );

    // A longer prompt sharing the first 64 tokens: its 5th chunk misses, the 4 hits are
    // loaded, and still nothing is asked twice.
    remote.asks.store(0, Ordering::SeqCst);
    let mut longer = stored.tokens.clone();
    longer.extend(1000..1016);
    let dst: Vec<i64> = (0..80).collect();
    let mut kv = HostPagedKvCache::new(small_layout(), 32);
    let mask = engine.retrieve(&longer, None, &mut kv, &dst).await.unwrap();
    assert_eq!(mask.iter().filter(|&&m| m).count(), 64);
    assert_eq!(remote.asks.load(Ordering::SeqCst), 5);
}

/// A connector whose calls never return (a hung server without a timeout).
struct Hung;

#[async_trait::async_trait]
impl kvpool_core::RemoteConnector for Hung {
    fn name(&self) -> &str {
        "hung"
    }
    async fn exists(&self, _: &str) -> Result<bool, kvpool_core::BackendError> {
        std::future::pending().await
    }
    async fn get(&self, _: &str) -> Result<Option<bytes::Bytes>, kvpool_core::BackendError> {
        std::future::pending().await
    }
    async fn put(&self, _: &str, _: bytes::Bytes) -> Result<(), kvpool_core::BackendError> {
        std::future::pending().await
    }
    async fn delete(&self, _: &str) -> Result<bool, kvpool_core::BackendError> {
        std::future::pending().await
    }
    async fn close(&self) -> Result<(), kvpool_core::BackendError> {
        Ok(())
    }
}

/// Lower tiers are asked at the same time: when one of them holds the whole prefix, a hung
/// tier listed before it does not hold the lookup up.
#[tokio::test]
async fn a_hung_lower_tier_does_not_hold_up_a_lookup_another_tier_answers() {
    let remote = MapConnector::default();
    let lower: Arc<dyn kvpool_core::StorageBackend> = Arc::new(RemoteBackend::new(
        remote.clone(),
        ChunkCodec::default(),
        1 << 20,
    ));
    let stored = store_prompt(&engine_over(lower.clone(), "hung"), 64, 4).await;

    let layout = small_layout();
    let cpu = Arc::new(
        kvpool_backends::LocalCpuBackend::new(1 << 20, kvpool_core::EvictionKind::Lru).unwrap(),
    );
    let manager = kvpool_core::StorageManager::builder()
        .primary(cpu.clone(), cpu)
        .lower(Arc::new(RemoteBackend::new(
            Hung,
            ChunkCodec::default(),
            1 << 20,
        )))
        .lower(lower)
        .build()
        .unwrap();
    let db = kvpool_core::ChunkedTokenDatabase::new(
        kvpool_core::ChunkingConfig {
            chunk_size: 16,
            ..Default::default()
        },
        kvpool_core::KeyScope::new("hung", 1, 0, 0, layout.fingerprint()).unwrap(),
    )
    .unwrap();
    let engine = kvpool_core::CacheEngine::new(layout, db, Arc::new(manager)).unwrap();
    let hit = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        engine.lookup(&stored.tokens),
    )
    .await
    .expect("the lookup finished without the hung tier")
    .unwrap();
    assert_eq!(hit, 64);
}
