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
