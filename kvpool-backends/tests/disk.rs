//! The RocksDB disk tier: the conformance kit, restarts, capacity, admission, corruption.
#![cfg(feature = "disk")]

mod common;
mod servers;

use std::sync::Arc;

use common::{assert_rows_equal, filled_cache};
use kvpool_backends::LocalCpuBackend;
use kvpool_backends::conformance::{self, Outcome, Subject};
use kvpool_backends::disk::{DiskConfig, DiskConnector};
use kvpool_core::RemoteConnector;
use kvpool_core::storage::manager::StorageManagerConfig;
use kvpool_core::{
    CacheEngine, CacheKey, Chunk, ChunkCodec, ChunkHash, ChunkMeta, ChunkedTokenDatabase,
    ChunkingConfig, Dtype, EvictionKind, HostPagedKvCache, KeyScope, KvKind, KvLayout, MemoryObj,
    RemoteBackend, StorageBackend, StorageManager,
};

fn backend(disk: DiskConnector) -> RemoteBackend<DiskConnector> {
    RemoteBackend::new(disk, ChunkCodec::default(), 64 << 20)
}

fn key(i: u64) -> CacheKey {
    let mut h = [0u8; 16];
    h[..8].copy_from_slice(&i.to_le_bytes());
    CacheKey::new(
        Arc::new(KeyScope::new("disk-test", 1, 0, 0, 1).unwrap()),
        ChunkHash(h),
    )
}

fn chunk(len: usize, fill: u8) -> Chunk {
    Chunk {
        meta: ChunkMeta {
            layout_fingerprint: 1,
            dtype: Dtype::F16,
            token_count: 1,
        },
        data: MemoryObj::from_vec((0..len).map(|i| (i as u8).wrapping_mul(fill)).collect()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_tier_passes_the_kit() {
    let dir = tempfile::tempdir().unwrap();
    let n = std::sync::atomic::AtomicU32::new(0);
    let results = conformance::run_all(&|| {
        let path = dir.path().join(format!(
            "db{}",
            n.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        ));
        async move {
            let disk = DiskConnector::open(DiskConfig::new(path)).unwrap();
            let raw = disk.clone();
            let copier = disk.clone();
            Subject::new(Arc::new(backend(disk)), 32 << 20)
                .with_corruptor(Arc::new(move |key| {
                    let raw = raw.clone();
                    Box::pin(async move {
                        raw.overwrite_raw(&key.to_string(), b"\x00garbage on disk")
                            .unwrap()
                    })
                }))
                .with_raw_copier(Arc::new(move |from, to| {
                    let raw = copier.clone();
                    Box::pin(async move {
                        let bytes = raw.get(&from.to_string()).await.unwrap().expect("stored");
                        raw.overwrite_raw(&to.to_string(), &bytes).unwrap()
                    })
                }))
        }
    })
    .await;
    conformance::assert_all_passed("disk", &results);
    assert!(results.iter().all(|r| r.outcome == Outcome::Passed));
}

/// On a current-thread runtime (RocksDB calls go through the blocking pool).
#[tokio::test]
async fn chunks_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let b = backend(DiskConnector::open(DiskConfig::new(dir.path())).unwrap());
        let entries = (0..5)
            .map(|i| (key(i), chunk(100_000, i as u8 + 1)))
            .collect();
        b.put(entries).await.unwrap();
        b.close().await.unwrap();
    }
    let disk = DiskConnector::open(DiskConfig::new(dir.path())).unwrap();
    assert_eq!(disk.usage().0, 5);
    let b = backend(disk);
    let keys: Vec<_> = (0..6).map(key).collect();
    let got = b.get(&keys).await.unwrap();
    for (i, value) in got.iter().take(5).enumerate() {
        assert_eq!(
            value.as_ref().unwrap().data.as_slice(),
            chunk(100_000, i as u8 + 1).data.as_slice()
        );
    }
    assert!(got[5].is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_is_kept_by_evicting_the_least_recently_used() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = DiskConfig::new(dir.path());
    config.capacity_bytes = 5 * 70_000; // five 64 KiB chunks plus headers
    let disk = DiskConnector::open(config.clone()).unwrap();
    let b = backend(disk.clone());
    for i in 0..5 {
        b.put(vec![(key(i), chunk(64 << 10, 3))]).await.unwrap();
    }
    b.get(&[key(0)]).await.unwrap(); // 0 is now the most recent
    for i in 5..8 {
        b.put(vec![(key(i), chunk(64 << 10, 3))]).await.unwrap();
        assert!(disk.usage().1 <= config.capacity_bytes);
    }
    let present = b
        .contains(&(0..8).map(key).collect::<Vec<_>>())
        .await
        .unwrap();
    assert_eq!(present, [true, false, false, false, true, true, true, true]);
    b.close().await.unwrap();
    drop((b, disk));
    // A smaller capacity at reopen evicts down to it.
    config.capacity_bytes = 2 * 70_000;
    let disk = DiskConnector::open(config).unwrap();
    assert_eq!(disk.usage().0, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_filter_writes_on_the_second_put() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = DiskConfig::new(dir.path());
    config.admit_on_second_put = true;
    let b = backend(DiskConnector::open(config).unwrap());
    b.put(vec![(key(1), chunk(1000, 1))]).await.unwrap();
    assert_eq!(
        b.contains(&[key(1)]).await.unwrap(),
        [false],
        "first sighting is not written"
    );
    b.put(vec![(key(1), chunk(1000, 1))]).await.unwrap();
    assert_eq!(b.contains(&[key(1)]).await.unwrap(), [true]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_over_l1_and_disk_recovers_from_disk_and_rejects_garbage() {
    let layout = KvLayout::new(2, 2, 8, Dtype::F16, KvKind::KeyValue, 4).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let disk = DiskConnector::open(DiskConfig::new(dir.path())).unwrap();
    let l1 = Arc::new(LocalCpuBackend::new(64 << 20, EvictionKind::Lru).unwrap());
    let manager = StorageManager::builder()
        .l1(l1.clone(), l1.clone())
        .lower(Arc::new(backend(disk.clone())))
        .config(StorageManagerConfig::default())
        .build()
        .unwrap();
    let db = ChunkedTokenDatabase::new(
        ChunkingConfig {
            chunk_size: 16,
            ..Default::default()
        },
        KeyScope::new("m", 1, 0, 0, layout.fingerprint()).unwrap(),
    )
    .unwrap();
    let engine = CacheEngine::new(layout, db, Arc::new(manager)).unwrap();
    let tokens: Vec<u32> = (0..64).collect();
    let slots: Vec<i64> = (0..64).collect();
    let src = filled_cache(layout, 32, 5);
    engine.store(&tokens, None, &src, &slots).await.unwrap();
    engine.storage().flush().await.unwrap();
    assert_eq!(disk.usage().0, 4);
    // Empty L1: the disk serves everything, bytes exact.
    let keys: Vec<_> = engine
        .token_database()
        .process_tokens(&tokens, None)
        .unwrap()
        .into_iter()
        .map(|s| s.key)
        .collect();
    l1.remove(&keys).await.unwrap();
    let mut dst = HostPagedKvCache::new(layout, 32);
    let mask = engine
        .retrieve(&tokens, None, &mut dst, &slots)
        .await
        .unwrap();
    assert!(mask.iter().all(|m| *m));
    assert_rows_equal(&src, &slots, &dst, &slots, &mask);
    // Garbage in the third chunk on disk: two chunks load, the bad entry is removed.
    l1.remove(&keys).await.unwrap();
    disk.overwrite_raw(&keys[2].to_string(), &[0xAB; 333])
        .unwrap();
    let mut dst = HostPagedKvCache::new(layout, 32);
    let mask = engine
        .retrieve(&tokens, None, &mut dst, &slots)
        .await
        .unwrap();
    assert_eq!(mask.iter().filter(|m| **m).count(), 32);
    assert_eq!(disk.usage().0, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root to mount a tmpfs; `cargo xtask matrix` runs it"]
async fn a_full_filesystem_surfaces_as_failed_writes_not_a_crash() {
    let fs = servers::tmpfs("96m");
    let layout = KvLayout::new(4, 8, 64, Dtype::F16, KvKind::KeyValue, 16).unwrap(); // 8 KiB/token
    let mut config = DiskConfig::new(fs.path.join("db")); // 64 GiB "capacity", far above the fs
    config.min_free_bytes = 32 << 20;
    let disk = DiskConnector::open(config).unwrap();
    let manager = StorageManager::builder()
        .lower(Arc::new(RemoteBackend::new(
            disk.clone(),
            ChunkCodec::default(),
            64 << 20,
        )))
        .build()
        .unwrap();
    let db = ChunkedTokenDatabase::new(
        ChunkingConfig {
            chunk_size: 64,
            ..Default::default()
        },
        KeyScope::new("full-fs", 1, 0, 0, layout.fingerprint()).unwrap(),
    )
    .unwrap();
    let engine = CacheEngine::new(layout, db, Arc::new(manager)).unwrap();
    let src = filled_cache(layout, 64, 3);
    let slots: Vec<i64> = (0..1024).collect();
    // 24 stores of 8 MiB each into a 96 MiB filesystem that keeps 32 MiB free.
    for round in 0..24u32 {
        let tokens: Vec<u32> = (0..1024).map(|t| t + round * 100_000).collect();
        engine.store(&tokens, None, &src, &slots).await.unwrap();
        engine.storage().flush().await.unwrap();
    }
    let tier = &engine.storage().stats().tiers[0];
    assert!(
        tier.failed_writes > 0,
        "writes beyond the reserve are refused: {tier:?}"
    );
    assert!(
        disk.usage().0 > 0,
        "writes before the reserve was reached went in"
    );
    // Still serving what it has: the first store is found and loads.
    let first: Vec<u32> = (0..1024).collect();
    assert_eq!(engine.lookup(&first).await.unwrap(), 1024);
}

/// RocksDB that ran out of space mid-write (another program filled the disk, past the
/// reserve) refuses every later write until it is reopened; the tier reopens it once space
/// returns, and keeps what it held. Before the fix, writes failed for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root to mount a tmpfs; `cargo xtask matrix` runs it"]
async fn rocksdb_out_of_space_heals_when_space_returns() {
    let fs = servers::tmpfs("48m");
    let mut config = DiskConfig::new(fs.path.join("db"));
    config.capacity_bytes = 8 << 20;
    config.min_free_bytes = 0; // let RocksDB itself hit the full disk
    config.write_buffer_bytes = 4 << 20;
    let disk = DiskConnector::open(config).unwrap();
    let value = |i: u8| bytes::Bytes::from(vec![i; 256 << 10]);
    for i in 0..8u8 {
        disk.put(&format!("before-{i}"), value(i)).await.unwrap();
    }
    disk.persist().unwrap();
    // Another program fills the filesystem to the last byte.
    let filler = fs.path.join("filler");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&filler).unwrap();
        let block = vec![0u8; 1 << 20];
        while f.write_all(&block).is_ok() {}
    }
    // A removal needs no room in the tier's eyes, but RocksDB's log append hits the full disk.
    assert!(
        disk.delete("before-0").await.is_err(),
        "a full disk must fail RocksDB's write"
    );
    assert!(disk.put("during", value(1)).await.is_err());
    std::fs::remove_file(&filler).unwrap();
    let mut healed = false;
    for _ in 0..100 {
        if disk.put("after", value(99)).await.is_ok() {
            healed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(healed, "writes still fail after space returned");
    assert_eq!(disk.get("after").await.unwrap(), Some(value(99)));
    for i in 1..8u8 {
        assert_eq!(
            disk.get(&format!("before-{i}")).await.unwrap(),
            Some(value(i)),
            "before-{i} lost"
        );
    }
}

/// Chunks the disk tier evicts for capacity leave it as KV events (`BlockRemoved` for routers
/// through the vLLM connector), with the evicted chunks' hashes.
#[tokio::test]
async fn capacity_evictions_are_announced_as_tier_events() {
    use kvpool_core::storage::tier_events::TierEventKind;

    let dir = tempfile::tempdir().unwrap();
    let layout = common::small_layout();
    let stored_chunk = layout.chunk_bytes(16) as u64 + 128;
    let mut config = DiskConfig::new(dir.path());
    config.capacity_bytes = 4 * stored_chunk;
    let disk = Arc::new(backend(DiskConnector::open(config).unwrap()));
    let manager = StorageManager::builder().lower(disk).build().unwrap();
    let engine = common::engine_with(manager, "disk-events");
    let log = engine.storage().tier_events().clone();
    log.enable();
    let kv = filled_cache(layout, 32, 3);
    let slots: Vec<i64> = (0..64).collect();
    let first: Vec<u32> = (0..64).collect();
    let second: Vec<u32> = (1000..1064).collect();
    for tokens in [&first, &second] {
        engine.store(tokens, None, &kv, &slots).await.unwrap();
        engine.storage().flush().await.unwrap();
    }
    let events = log.drain();
    let removed: std::collections::HashSet<ChunkHash> = events
        .iter()
        .filter(|e| e.tier == "disk" && e.kind == TierEventKind::Removed)
        .flat_map(|e| e.chunk_hashes.clone())
        .collect();
    let first_hashes: Vec<ChunkHash> = engine
        .token_database()
        .process_tokens(&first, None)
        .unwrap()
        .iter()
        .map(|s| s.key.hash)
        .collect();
    assert_eq!(first_hashes.len(), 4);
    assert!(
        first_hashes.iter().all(|h| removed.contains(h)),
        "evicted {removed:?}, first prompt {first_hashes:?}"
    );
    assert_eq!(
        engine.lookup(&first).await.unwrap(),
        0,
        "the first prompt was evicted"
    );
    assert_eq!(engine.lookup(&second).await.unwrap(), 64);
}
