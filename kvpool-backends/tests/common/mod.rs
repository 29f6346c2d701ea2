//! Shared test fixtures: the in-memory store behind fault switches, and KV helpers.
#![allow(dead_code)]

pub mod remote_tier;
pub mod tiered;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvpool_backends::conformance::Subject;
use kvpool_backends::{ControlledFaults, InMemoryConnector};
use kvpool_core::{ChunkCodec, HostPagedKvCache, KvLayout, RemoteBackend, RemoteConnector};

/// A conformance-kit subject: `connector` behind the chunk format (chunks up to 32 MiB). Its
/// corruptor overwrites a stored value, through the raw connector, with bytes that are not a
/// chunk.
pub fn chunk_format_subject<C: RemoteConnector + Clone>(connector: C) -> Subject {
    let raw = connector.clone();
    let copier = connector.clone();
    let backend = RemoteBackend::new(connector, ChunkCodec::default(), 64 << 20);
    Subject::new(Arc::new(backend), 32 << 20)
        .with_corruptor(Arc::new(move |key| {
            let raw = raw.clone();
            Box::pin(async move {
                raw.put(&key.to_string(), Bytes::from_static(b"not a chunk"))
                    .await
                    .unwrap()
            })
        }))
        .with_raw_copier(Arc::new(move |from, to| {
            let raw = copier.clone();
            Box::pin(async move {
                let bytes = raw.get(&from.to_string()).await.unwrap().expect("stored");
                raw.put(&to.to_string(), bytes).await.unwrap()
            })
        }))
}

/// The one test store: process memory behind run-time fault switches (a dead server, slow
/// writes, a panicking put) that also count puts and asks.
pub type MapConnector = ControlledFaults<InMemoryConnector>;

/// Flips one byte of every value stored in `store` at `offset` (from the end if negative).
pub fn corrupt_all(store: &InMemoryConnector, offset: isize) {
    for key in store.keys() {
        let mut b = store.raw(&key).expect("listed").to_vec();
        let i = if offset < 0 {
            b.len() - offset.unsigned_abs()
        } else {
            offset as usize
        };
        b[i] ^= 0x40;
        assert!(store.overwrite_raw(&key, Bytes::from(b)));
    }
}

/// A paged cache whose every byte depends on (layer, position, seed).
pub fn filled_cache(layout: KvLayout, num_blocks: usize, seed: u32) -> HostPagedKvCache {
    let mut c = HostPagedKvCache::new(layout, num_blocks);
    for l in 0..layout.num_layers {
        for (i, b) in c.layer_mut(l).iter_mut().enumerate() {
            let x = (i as u32)
                .wrapping_mul(2654435761)
                .wrapping_add(seed.wrapping_mul(97))
                .wrapping_add(l as u32 * 131);
            *b = (x >> 13) as u8;
        }
    }
    c
}

/// Checks that token `src_slots[i]` of `src` equals `dst_slots[i]` of `dst` in every layer/plane,
/// for each `i` where `which[i]` is true.
pub fn assert_rows_equal(
    src: &HostPagedKvCache,
    src_slots: &[i64],
    dst: &HostPagedKvCache,
    dst_slots: &[i64],
    which: &[bool],
) {
    let layout = *kvpool_core::KvTransfer::layout(src);
    for (i, w) in which.iter().enumerate() {
        if !*w {
            continue;
        }
        for l in 0..layout.num_layers {
            for p in 0..layout.kind.planes() {
                assert_eq!(
                    src.row(l, p, src_slots[i] as usize),
                    dst.row(l, p, dst_slots[i] as usize),
                    "token {i} layer {l} plane {p}"
                );
            }
        }
    }
}

/// Whether the row of `slot` is all zero in every layer/plane.
pub fn row_is_zero(c: &HostPagedKvCache, slot: i64) -> bool {
    let layout = *kvpool_core::KvTransfer::layout(c);
    (0..layout.num_layers).all(|l| {
        (0..layout.kind.planes()).all(|p| c.row(l, p, slot as usize).iter().all(|&b| b == 0))
    })
}

/// The small layout the engine-level backend tests use: 2 layers x 2 KV heads x 8, f16.
pub fn small_layout() -> KvLayout {
    KvLayout::new(
        2,
        2,
        8,
        kvpool_core::Dtype::F16,
        kvpool_core::KvKind::KeyValue,
        4,
    )
    .unwrap()
}

/// A cache engine (16-token chunks, [`small_layout`]) over one lower tier and no L1, so every
/// lookup and load goes to that tier.
pub fn engine_over(
    lower: Arc<dyn kvpool_core::StorageBackend>,
    model: &str,
) -> kvpool_core::CacheEngine {
    let manager = kvpool_core::StorageManager::builder()
        .lower(lower)
        .build()
        .unwrap();
    engine_with(manager, model)
}

/// A cache engine (16-token chunks, [`small_layout`]) over `manager`'s tiers.
pub fn engine_with(manager: kvpool_core::StorageManager, model: &str) -> kvpool_core::CacheEngine {
    let layout = small_layout();
    let db = kvpool_core::ChunkedTokenDatabase::new(
        kvpool_core::ChunkingConfig {
            chunk_size: 16,
            ..Default::default()
        },
        kvpool_core::KeyScope::new(model, 1, 0, 0, layout.fingerprint()).unwrap(),
    )
    .unwrap();
    kvpool_core::CacheEngine::new(layout, db, Arc::new(manager)).unwrap()
}

/// A prompt stored through an engine: its tokens, their slots, and the paged KV they came from.
pub struct StoredPrompt {
    pub tokens: Vec<u32>,
    pub slots: Vec<i64>,
    pub kv: HostPagedKvCache,
}

/// Stores a `len`-token prompt (tokens and slots `0..len`, KV from [`filled_cache`] with
/// `seed`) through `engine` (over [`small_layout`]), flushes, and checks a lookup finds it all.
pub async fn store_prompt(
    engine: &kvpool_core::CacheEngine,
    len: usize,
    seed: u32,
) -> StoredPrompt {
    let tokens: Vec<u32> = (0..len as u32).collect();
    let slots: Vec<i64> = (0..len as i64).collect();
    let layout = small_layout();
    let kv = filled_cache(layout, len.div_ceil(layout.block_size).max(32), seed);
    engine.store(&tokens, None, &kv, &slots).await.unwrap();
    engine.storage().flush().await.unwrap();
    assert_eq!(
        engine.lookup(&tokens).await.unwrap(),
        len,
        "stored prompt not found"
    );
    StoredPrompt { tokens, slots, kv }
}

/// Stores `tokens` again until a lookup finds all of them; false if that never happens within
/// about ten seconds (the tier did not recover).
pub async fn recovers(
    engine: &kvpool_core::CacheEngine,
    tokens: &[u32],
    kv: &HostPagedKvCache,
    slots: &[i64],
) -> bool {
    for _ in 0..100 {
        engine.store(tokens, None, kv, slots).await.unwrap();
        engine.storage().flush().await.unwrap();
        if engine.lookup(tokens).await.unwrap() == tokens.len() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// With the engine's only tier down: `tokens` (stored before) miss and load nothing, a store of
/// `other` is counted as failed writes, and all of it finishes within `limit` (no hang).
pub async fn assert_outage_is_misses(
    engine: &kvpool_core::CacheEngine,
    tokens: &[u32],
    other: &[u32],
    kv: &HostPagedKvCache,
    slots: &[i64],
    limit: Duration,
) {
    let started = std::time::Instant::now();
    assert_eq!(
        engine.lookup(tokens).await.unwrap(),
        0,
        "a dead server is a miss"
    );
    let mut dst = HostPagedKvCache::new(
        *kvpool_core::KvTransfer::layout(kv),
        kv.num_slots() / kvpool_core::KvTransfer::layout(kv).block_size,
    );
    let mask = engine
        .retrieve(tokens, None, &mut dst, slots)
        .await
        .unwrap();
    assert!(mask.iter().all(|m| !*m), "nothing loads from a dead server");
    engine.store(other, None, kv, slots).await.unwrap();
    engine.storage().flush().await.unwrap();
    assert!(started.elapsed() < limit, "calls must time out, not hang");
    let tier = &engine.storage().stats().tiers[0];
    assert!(tier.errors >= 3, "{tier:?}");
    assert!(
        tier.failed_writes > 0,
        "writes during the outage are counted as failed: {tier:?}"
    );
}

/// `bounded` (a connector with `max_value_bytes = 1 MiB`) over the same store as `raw` (no
/// bound): an 8 MiB value comes back empty without being transferred, and through the chunk
/// format it is a miss that deletes it; values within the bound and missing keys are as usual.
pub async fn assert_oversized_values_are_not_read<C: RemoteConnector + Clone>(raw: C, bounded: C) {
    let big = Bytes::from(vec![7u8; 8 << 20]);
    raw.put("kvpool-oversized", big).await.unwrap();
    assert_eq!(
        bounded.get("kvpool-oversized").await.unwrap(),
        Some(Bytes::new()),
        "an oversized value is not read"
    );
    let small = Bytes::from(vec![1u8; 1000]);
    raw.put("kvpool-small", small.clone()).await.unwrap();
    assert_eq!(bounded.get("kvpool-small").await.unwrap(), Some(small));
    assert_eq!(bounded.get("kvpool-never-stored").await.unwrap(), None);

    let key = kvpool_core::CacheKey::new(
        Arc::new(kvpool_core::KeyScope::new("oversized", 1, 0, 0, 1).unwrap()),
        kvpool_core::ChunkHash([5; 16]),
    );
    raw.put(&key.to_string(), Bytes::from(vec![9u8; 8 << 20]))
        .await
        .unwrap();
    let backend = RemoteBackend::new(bounded, ChunkCodec::default(), 1 << 20);
    let got = kvpool_core::StorageBackend::get(&backend, std::slice::from_ref(&key))
        .await
        .unwrap();
    assert!(got[0].is_none(), "an oversized value is a miss");
    assert_eq!(
        raw.get(&key.to_string()).await.unwrap(),
        None,
        "and is deleted"
    );
    raw.delete("kvpool-oversized").await.unwrap();
    raw.delete("kvpool-small").await.unwrap();
}
