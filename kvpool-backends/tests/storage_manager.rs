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
    remote.switches().asks.store(0, Ordering::SeqCst);
    let mut kv = HostPagedKvCache::new(small_layout(), 32);
    let dst: Vec<i64> = (64..128).collect();
    let mask = engine
        .retrieve(&stored.tokens, None, &mut kv, &dst)
        .await
        .unwrap();
    assert!(mask.iter().all(|&m| m));
    assert_rows_equal(&stored.kv, &stored.slots, &kv, &dst, &mask);
    assert_eq!(
        remote.switches().asks.load(Ordering::SeqCst),
        4,
        "one get per chunk, no exists before it"
    );

    // A longer prompt sharing the first 64 tokens: its 5th chunk misses, the 4 hits are
    // loaded, and still nothing is asked twice.
    remote.switches().asks.store(0, Ordering::SeqCst);
    let mut longer = stored.tokens.clone();
    longer.extend(1000..1016);
    let dst: Vec<i64> = (0..80).collect();
    let mut kv = HostPagedKvCache::new(small_layout(), 32);
    let mask = engine.retrieve(&longer, None, &mut kv, &dst).await.unwrap();
    assert_eq!(mask.iter().filter(|&&m| m).count(), 64);
    assert_eq!(remote.switches().asks.load(Ordering::SeqCst), 5);
}

/// A connector whose calls never return (a hung server without a timeout).
fn hung() -> MapConnector {
    let store = MapConnector::default();
    store.switches().hang.store(true, Ordering::SeqCst);
    store
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
    let cpu = Arc::new(
        kvpool_backends::LocalCpuBackend::new(1 << 20, kvpool_core::EvictionKind::Lru).unwrap(),
    );
    let manager = kvpool_core::StorageManager::builder()
        .l1(cpu.clone(), cpu)
        .lower(Arc::new(RemoteBackend::new(
            hung(),
            ChunkCodec::default(),
            1 << 20,
        )))
        .lower(lower)
        .build()
        .unwrap();
    let engine = common::engine_with(manager, "hung");
    let hit = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        engine.lookup(&stored.tokens),
    )
    .await
    .expect("the lookup finished without the hung tier")
    .unwrap();
    assert_eq!(hit, 64);
}

/// KV events: chunks written to L1 and (after write-behind) to a lower tier are reported as
/// stored in each, evicted from L1 as removed from it, and removed from every tier as removed
/// from each; nothing is recorded before the log is enabled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tier_events_follow_chunks_into_and_out_of_each_tier() {
    use kvpool_core::storage::tier_events::TierEventKind::{Removed, Stored};

    let layout = small_layout();
    let chunk_bytes = layout.chunk_bytes(16);
    let l1 = Arc::new(
        kvpool_backends::LocalCpuBackend::new(4 * chunk_bytes, kvpool_core::EvictionKind::Lru)
            .unwrap(),
    );
    let lower = Arc::new(RemoteBackend::new(
        MapConnector::default(),
        ChunkCodec::default(),
        1 << 20,
    ));
    let manager = kvpool_core::StorageManager::builder()
        .l1(l1.clone(), l1)
        .lower(lower)
        .build()
        .unwrap();
    let engine = common::engine_with(manager, "events");
    let log = engine.storage().tier_events().clone();
    let kv = common::filled_cache(layout, 32, 1);
    let slots: Vec<i64> = (0..64).collect();
    let first: Vec<u32> = (0..64).collect();
    engine.store(&first, None, &kv, &slots).await.unwrap();
    engine.storage().flush().await.unwrap();
    assert!(log.drain().is_empty(), "recorded while disabled");

    log.enable();
    let second: Vec<u32> = (1000..1064).collect();
    let report = engine.store(&second, None, &kv, &slots).await.unwrap();
    engine.storage().flush().await.unwrap();
    let keys: Vec<_> = report.stored_keys.iter().map(|k| k.hash).collect();
    assert_eq!(keys.len(), 4);
    let events = log.drain();
    let of = |tier: &str, kind| -> Vec<_> {
        events
            .iter()
            .filter(|e| e.tier == tier && e.kind == kind)
            .flat_map(|e| e.chunk_hashes.clone())
            .collect()
    };
    assert_eq!(of("cpu", Stored), keys);
    assert_eq!(of("memory", Stored), keys);
    // L1 holds 4 chunks: the first prompt's 4 were evicted to make room.
    let first_keys: Vec<_> = engine
        .token_database()
        .process_tokens(&first, None)
        .unwrap()
        .iter()
        .map(|s| s.key.hash)
        .collect();
    let mut evicted = of("cpu", Removed);
    evicted.sort_by_key(|h| h.0);
    let mut want = first_keys.clone();
    want.sort_by_key(|h| h.0);
    assert_eq!(evicted, want);

    let spans = engine
        .token_database()
        .process_tokens(&second, None)
        .unwrap();
    let second_keys: Vec<_> = spans.iter().map(|s| s.key.clone()).collect();
    engine.storage().remove(&second_keys).await;
    let events = log.drain();
    for tier in ["cpu", "memory"] {
        let removed: Vec<_> = events
            .iter()
            .filter(|e| e.tier == tier && e.kind == Removed)
            .flat_map(|e| e.chunk_hashes.clone())
            .collect();
        assert_eq!(removed, keys, "{tier}");
    }
}

fn visit_key(i: u8) -> kvpool_core::CacheKey {
    let scope = Arc::new(kvpool_core::KeyScope::new("visits", 1, 0, 0, 7).unwrap());
    let hasher = kvpool_core::HashAlgorithm::default();
    kvpool_core::CacheKey::new(scope, hasher.chain_blocks(&hasher.root(), &[[i]]))
}

fn visit_chunk(fill: u8) -> kvpool_core::Chunk {
    let mut data = kvpool_core::MemoryObjMut::heap(4096);
    data.as_mut_slice().fill(fill);
    kvpool_core::Chunk {
        meta: kvpool_core::ChunkMeta {
            layout_fingerprint: 7,
            dtype: kvpool_core::Dtype::F16,
            token_count: 16,
        },
        data: data.freeze(),
    }
}

/// `get_each` visits each chunk of the prefix once, from whichever lower tier holds it (a
/// compressed value decoded first), with the index of its key; a value that fails its check
/// is a miss, is not visited, and is deleted from its tier; the prefix ends there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_each_visits_the_prefix_from_every_tier_and_never_a_value_that_fails_its_check() {
    let first = MapConnector::default();
    let second = MapConnector::default();
    let zstd = ChunkCodec {
        compression: kvpool_core::Compression::Zstd { level: 1 },
        ..ChunkCodec::default()
    };
    let tier_one = Arc::new(RemoteBackend::new(
        first.clone(),
        ChunkCodec::default(),
        1 << 20,
    ));
    let tier_two = Arc::new(RemoteBackend::new(second.clone(), zstd, 1 << 20));
    use kvpool_core::StorageBackend;
    // Keys 0 and 2 in the first tier, 1 (compressed) and 3 in the second, 4 in the first
    // but corrupt, 5 in the second: the prefix is 0..4, and 5 lies past it.
    tier_one
        .put(vec![
            (visit_key(0), visit_chunk(10)),
            (visit_key(2), visit_chunk(12)),
        ])
        .await
        .unwrap();
    tier_one
        .put(vec![(visit_key(4), visit_chunk(14))])
        .await
        .unwrap();
    let corrupt = visit_key(4).to_string();
    let mut bytes = first.inner().raw(&corrupt).unwrap().to_vec();
    *bytes.last_mut().unwrap() ^= 1;
    first.inner().overwrite_raw(&corrupt, bytes.into());
    tier_two
        .put(vec![
            (visit_key(1), visit_chunk(11)),
            (visit_key(3), visit_chunk(13)),
            (visit_key(5), visit_chunk(15)),
        ])
        .await
        .unwrap();
    let manager = kvpool_core::StorageManager::builder()
        .lower(tier_one)
        .lower(tier_two)
        .build()
        .unwrap();
    let keys: Vec<_> = (0..7).map(visit_key).collect();
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let visit: kvpool_core::ChunkVisit = {
        let seen = seen.clone();
        Arc::new(move |i, meta, bytes| {
            assert_eq!(meta.token_count, 16);
            assert!(bytes.len() == 4096 && bytes.iter().all(|&b| b == bytes[0]));
            seen.lock().push((i, bytes[0]));
        })
    };
    let prefix = manager.get_each(&keys, visit).await;
    assert_eq!(prefix, 4);
    let mut seen = std::mem::take(&mut *seen.lock());
    seen.sort();
    // Key 5 lies past the prefix: the second tier was asked for it with 4, and may visit it.
    seen.retain(|&(i, _)| i < prefix);
    assert_eq!(seen, vec![(0, 10), (1, 11), (2, 12), (3, 13)]);
    assert!(
        first.inner().raw(&corrupt).is_none(),
        "the corrupt value was kept"
    );
}

/// A tier call that its timeout gave up on and that visits later visits nothing through
/// `get_each`: no chunk is handed over after the call returned, and none is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_each_visits_nothing_after_it_returned() {
    let remote = MapConnector::default();
    let bounded = kvpool_backends::TimeoutConnector::new(
        remote.clone(),
        std::time::Duration::from_millis(200),
    );
    let tier = Arc::new(RemoteBackend::new(bounded, ChunkCodec::default(), 1 << 20));
    use kvpool_core::StorageBackend;
    tier.put(vec![(visit_key(0), visit_chunk(10))])
        .await
        .unwrap();
    let manager = kvpool_core::StorageManager::builder()
        .lower(tier)
        .build()
        .unwrap();
    remote.switches().late_visit_ms.store(500, Ordering::SeqCst);
    let visits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let visit: kvpool_core::ChunkVisit = {
        let visits = visits.clone();
        Arc::new(move |_, _, _| {
            visits.fetch_add(1, Ordering::SeqCst);
        })
    };
    assert_eq!(manager.get_each(&[visit_key(0)], visit.clone()).await, 0);
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    assert_eq!(
        visits.load(Ordering::SeqCst),
        0,
        "a visit came after the call returned"
    );
    // In time, the same read visits.
    remote.switches().late_visit_ms.store(20, Ordering::SeqCst);
    assert_eq!(manager.get_each(&[visit_key(0)], visit).await, 1);
    assert_eq!(visits.load(Ordering::SeqCst), 1);
}
