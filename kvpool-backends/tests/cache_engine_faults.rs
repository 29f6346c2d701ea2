//! The cache engine when things go wrong: a panicking, dead or slow lower tier, corrupt or
//! misshapen chunks, wrong layouts and slot mappings. Each is a miss or a clear error.

mod common;

use std::sync::atomic::Ordering;

use common::tiered::*;
use common::{filled_cache, row_is_zero};
use kvpool_core::storage::manager::StorageManagerConfig;
use kvpool_core::{ChunkCodec, Dtype, HostPagedKvCache, KvKind, KvLayout, StorageBackend};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_write_behind_neither_hangs_flush_nor_sticks_its_keys() {
    let s = setup();
    s.remote
        .switches()
        .panic_on_put
        .store(true, Ordering::SeqCst);
    let key = s
        .engine
        .token_database()
        .process_tokens(&tokens(CHUNK, 9), None)
        .unwrap()[0]
        .key
        .clone();
    let chunk = || kvpool_core::Chunk {
        meta: kvpool_core::ChunkMeta {
            layout_fingerprint: layout().fingerprint(),
            dtype: layout().dtype,
            token_count: CHUNK as u32,
        },
        data: kvpool_core::MemoryObjMut::heap(layout().chunk_bytes(CHUNK)).freeze(),
    };
    let storage = s.engine.storage();
    storage.put(vec![(key.clone(), chunk())]).await.unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), storage.flush())
        .await
        .expect("flush returns although the write-behind task panicked")
        .unwrap();
    // The key is not left "in flight": once the backend behaves, it is written.
    s.remote
        .switches()
        .panic_on_put
        .store(false, Ordering::SeqCst);
    storage.put(vec![(key.clone(), chunk())]).await.unwrap();
    storage.flush().await.unwrap();
    assert_eq!(s.remote.inner().len(), 1);
}

#[tokio::test]
async fn corrupt_lower_tier_chunks_are_misses_and_get_deleted() {
    for offset in [10isize, 30, -1] {
        let s = setup_with(None, false, StorageManagerConfig::default());
        let n = 2 * CHUNK;
        let toks = tokens(n, 15);
        let (src_slots, dst_slots) = slots(n);
        let src = filled_cache(layout(), 100, 16);
        s.engine.store(&toks, None, &src, &src_slots).await.unwrap();
        s.engine.storage().flush().await.unwrap();
        common::corrupt_all(s.remote.inner(), offset);
        let mut dst = HostPagedKvCache::new(layout(), 100);
        let mask = s
            .engine
            .retrieve(&toks, None, &mut dst, &dst_slots)
            .await
            .unwrap();
        assert!(
            mask.iter().all(|m| !*m),
            "corrupt bytes must never be loaded (offset {offset})"
        );
        assert!(dst_slots.iter().all(|&slot| row_is_zero(&dst, slot)));
        assert_eq!(s.remote.inner().len(), 0, "corrupt values are deleted");
        assert_eq!(s.engine.storage().stats().tiers[0].backend.corrupt, 2);
    }
}

#[tokio::test]
async fn a_dead_lower_tier_turns_into_misses_not_errors() {
    let s = setup_with(None, false, StorageManagerConfig::default());
    let n = 2 * CHUNK;
    let Stored {
        toks,
        src_slots,
        dst_slots,
        src,
    } = s.store_and_flush(n, 17).await;
    s.remote.switches().down.store(true, Ordering::SeqCst);
    assert_eq!(s.engine.lookup(&toks).await.unwrap(), 0);
    let (mask, dst) = s.retrieve_all(&toks, &dst_slots).await;
    assert!(mask.iter().all(|m| !*m));
    assert!(dst_slots.iter().all(|&slot| row_is_zero(&dst, slot)));
    // Stores still succeed from the caller's view; the failed write-behind is counted.
    s.engine
        .store(&tokens(n, 99), None, &src, &src_slots)
        .await
        .unwrap();
    s.engine.storage().flush().await.unwrap();
    assert!(s.engine.storage().stats().tiers[0].errors >= 2);
    s.remote.switches().down.store(false, Ordering::SeqCst);
    assert_eq!(
        s.engine.lookup(&toks).await.unwrap(),
        n,
        "back up: hits again"
    );
}

#[tokio::test]
async fn write_behind_sheds_load_beyond_its_quota_and_deduplicates() {
    let chunk_bytes = layout().chunk_bytes(CHUNK);
    let config = StorageManagerConfig {
        write_behind_quota_bytes: 2 * chunk_bytes,
        promote_on_hit: true,
    };
    let s = setup_with(Some(64), false, config);
    s.remote
        .switches()
        .put_delay_ms
        .store(200, Ordering::SeqCst);
    let n = 5 * CHUNK;
    let toks = tokens(n, 19);
    let (src_slots, _) = slots(n);
    let src = filled_cache(layout(), 100, 20);
    let r = s.engine.store(&toks, None, &src, &src_slots).await.unwrap();
    assert_eq!(
        r.stored_chunks, 5,
        "L1 took everything; the caller never waited"
    );
    let entries: Vec<_> = {
        let spans = s
            .engine
            .token_database()
            .process_tokens(&toks, None)
            .unwrap();
        let keys: Vec<_> = spans.iter().map(|s| s.key.clone()).collect();
        s.l1.as_ref()
            .unwrap()
            .get(&keys)
            .await
            .unwrap()
            .into_iter()
            .zip(keys)
            .map(|(c, k)| (k, c.unwrap()))
            .collect()
    };
    // Same keys again while the first two are still in flight: deduplicated, others dropped.
    s.engine.storage().put(entries).await.unwrap();
    s.engine.storage().flush().await.unwrap();
    let t = &s.engine.storage().stats().tiers[1];
    assert_eq!(t.deduplicated_writes, 2);
    assert_eq!(t.dropped_writes, 6);
    assert_eq!(s.remote.inner().len(), 2);
}

#[tokio::test]
async fn wrong_layout_and_bad_slot_mapping_are_errors() {
    let s = setup();
    let toks = tokens(CHUNK, 25);
    let (src_slots, _) = slots(CHUNK);
    let other = KvLayout::new(2, 2, 8, Dtype::F32, KvKind::KeyValue, 4).unwrap();
    let wrong = HostPagedKvCache::new(other, 100);
    assert!(
        s.engine
            .store(&toks, None, &wrong, &src_slots)
            .await
            .is_err()
    );
    let src = filled_cache(layout(), 100, 26);
    assert!(
        s.engine
            .store(&toks, None, &src, &src_slots[1..])
            .await
            .is_err()
    );
    let mut bad = src_slots.clone();
    bad[3] = -1;
    assert!(s.engine.store(&toks, None, &src, &bad).await.is_err());
}

#[tokio::test]
async fn well_formed_chunks_of_the_wrong_shape_are_rejected_by_the_engine() {
    let layout = layout();
    let n = CHUNK;
    let toks = tokens(n, 29);
    let right = layout.chunk_bytes(CHUNK);
    // Valid checksums and the right fingerprint, but a wrong size, token count or dtype.
    let forged = [
        (Dtype::F16, CHUNK as u32, right - 2),
        (Dtype::F16, CHUNK as u32 - 1, right),
        (Dtype::Bf16, CHUNK as u32, right),
    ];
    for (dtype, token_count, len) in forged {
        let s = setup_with(None, false, StorageManagerConfig::default());
        let key = s
            .engine
            .token_database()
            .process_tokens(&toks, None)
            .unwrap()[0]
            .key
            .clone();
        let meta = kvpool_core::ChunkMeta {
            layout_fingerprint: layout.fingerprint(),
            dtype,
            token_count,
        };
        let binding = kvpool_core::format::chunk_format::KeyBinding::of(&key);
        let value = ChunkCodec::default().encode(&meta, &binding, &vec![7u8; len]);
        s.remote
            .inner()
            .insert_raw(&key.to_string(), bytes::Bytes::from(value));
        assert_eq!(s.engine.lookup(&toks).await.unwrap(), CHUNK, "present");
        let (_, dst_slots) = slots(n);
        let (mask, dst) = s.retrieve_all(&toks, &dst_slots).await;
        assert!(mask.iter().all(|m| !*m), "{dtype:?} {token_count} {len}");
        assert!(dst_slots.iter().all(|&slot| row_is_zero(&dst, slot)));
        assert_eq!(s.engine.stats().rejected_chunks, 1);
        assert_eq!(s.remote.inner().len(), 0, "the bad chunk is removed");
    }
}
