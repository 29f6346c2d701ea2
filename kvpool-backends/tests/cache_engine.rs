//! End to end through the cache engine: L1 (CPU) + a lower tier behind the chunk-format adapter.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use common::{MapConnector, assert_rows_equal, filled_cache, row_is_zero};
use kvpool_backends::LocalCpuBackend;
use kvpool_core::storage_manager::StorageManagerConfig;
use kvpool_core::{
    CacheEngine, ChunkCodec, ChunkedTokenDatabase, ChunkingConfig, Compression, Dtype,
    EvictionKind, HostPagedKvCache, KeyScope, KvKind, KvLayout, KvTransfer, RemoteBackend,
    StorageBackend, StorageManager,
};

const CHUNK: usize = 16;

fn layout() -> KvLayout {
    KvLayout::new(2, 2, 8, Dtype::F16, KvKind::KeyValue, 4).unwrap()
}

struct Setup {
    engine: CacheEngine,
    l1: Option<Arc<LocalCpuBackend>>,
    remote: MapConnector,
}

fn setup_with(
    l1_chunks: Option<usize>,
    save_unfull_chunk: bool,
    config: StorageManagerConfig,
) -> Setup {
    let layout = layout();
    let scope = KeyScope::new("test-model", 1, 0, 0, layout.fingerprint()).unwrap();
    let db = ChunkedTokenDatabase::new(
        ChunkingConfig {
            chunk_size: CHUNK,
            save_unfull_chunk,
            ..Default::default()
        },
        scope,
    )
    .unwrap();
    let remote = MapConnector::default();
    let codec = ChunkCodec {
        compression: Compression::Zstd { level: 1 },
        ..Default::default()
    };
    let lower = Arc::new(RemoteBackend::new(remote.clone(), codec, 1 << 20));
    let mut b = StorageManager::builder().config(config);
    let l1 = l1_chunks.map(|n| {
        let cpu = Arc::new(
            LocalCpuBackend::new(n * layout.chunk_bytes(CHUNK), EvictionKind::Lru).unwrap(),
        );
        b = std::mem::replace(&mut b, StorageManager::builder()).primary(cpu.clone(), cpu.clone());
        cpu
    });
    let manager = Arc::new(b.lower(lower).build().unwrap());
    Setup {
        engine: CacheEngine::new(layout, db, manager).unwrap(),
        l1,
        remote,
    }
}

/// A stored token sequence and where its KV came from / goes to.
struct Stored {
    toks: Vec<u32>,
    src_slots: Vec<i64>,
    dst_slots: Vec<i64>,
    src: HostPagedKvCache,
}

impl Setup {
    /// Stores `n` tokens (sequence `seed`) from a filled cache and waits for write-behind.
    async fn store_and_flush(&self, n: usize, seed: u32) -> Stored {
        let toks = tokens(n, seed);
        let (src_slots, dst_slots) = slots(n);
        let src = filled_cache(layout(), 100, seed + 1);
        self.engine
            .store(&toks, None, &src, &src_slots)
            .await
            .unwrap();
        self.engine.storage().flush().await.unwrap();
        Stored {
            toks,
            src_slots,
            dst_slots,
            src,
        }
    }

    /// Retrieves `toks` into a fresh cache; returns the loaded mask and the cache.
    async fn retrieve_all(&self, toks: &[u32], dst_slots: &[i64]) -> (Vec<bool>, HostPagedKvCache) {
        let mut dst = HostPagedKvCache::new(layout(), 100);
        let mask = self
            .engine
            .retrieve(toks, None, &mut dst, dst_slots)
            .await
            .unwrap();
        (mask, dst)
    }
}

fn setup() -> Setup {
    setup_with(Some(64), false, StorageManagerConfig::default())
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(7).wrapping_add(seed))
        .collect()
}

/// Slots 0..n in the source cache; the same count, reversed, in a disjoint range of the destination.
fn slots(n: usize) -> (Vec<i64>, Vec<i64>) {
    let src: Vec<i64> = (0..n as i64).collect();
    let dst: Vec<i64> = (0..n as i64).map(|i| 200 + (n as i64 - 1 - i)).collect();
    (src, dst)
}

#[tokio::test]
async fn store_then_retrieve_round_trips_bytes_exactly() {
    let s = setup();
    let n = 4 * CHUNK + 5; // partial tail not stored (save_unfull_chunk = false)
    let toks = tokens(n, 1);
    let (src_slots, dst_slots) = slots(n);
    let src = filled_cache(layout(), 100, 3);
    let report = s.engine.store(&toks, None, &src, &src_slots).await.unwrap();
    assert_eq!((report.stored_chunks, report.stored_tokens), (4, 4 * CHUNK));
    assert_eq!(s.engine.lookup(&toks).await.unwrap(), 4 * CHUNK);

    let (mask, dst) = s.retrieve_all(&toks, &dst_slots).await;
    let expect: Vec<bool> = (0..n).map(|i| i < 4 * CHUNK).collect();
    assert_eq!(mask, expect);
    assert_rows_equal(&src, &src_slots, &dst, &dst_slots, &mask);
    for (i, &slot) in dst_slots.iter().enumerate().skip(4 * CHUNK) {
        assert!(
            row_is_zero(&dst, slot),
            "tail token {i} must not be written"
        );
    }
    // Storing again finds everything present.
    let again = s.engine.store(&toks, None, &src, &src_slots).await.unwrap();
    assert_eq!((again.stored_chunks, again.already_present), (0, 4));
}

#[tokio::test]
async fn partial_chunk_is_stored_and_loaded_with_save_unfull_chunk() {
    let s = setup_with(Some(64), true, StorageManagerConfig::default());
    let n = 2 * CHUNK + 5;
    let toks = tokens(n, 2);
    let (src_slots, dst_slots) = slots(n);
    let src = filled_cache(layout(), 100, 4);
    s.engine.store(&toks, None, &src, &src_slots).await.unwrap();
    assert_eq!(s.engine.lookup(&toks).await.unwrap(), n);
    let (mask, dst) = s.retrieve_all(&toks, &dst_slots).await;
    assert!(mask.iter().all(|m| *m));
    assert_rows_equal(&src, &src_slots, &dst, &dst_slots, &mask);
    // A longer prompt shares the full chunks but not the partial one.
    let longer = tokens(3 * CHUNK, 2);
    assert_eq!(s.engine.lookup(&longer).await.unwrap(), 2 * CHUNK);
}

#[tokio::test]
async fn masked_prefix_is_neither_reported_nor_written() {
    let s = setup();
    let n = 4 * CHUNK;
    let toks = tokens(n, 5);
    let (src_slots, dst_slots) = slots(n);
    let src = filled_cache(layout(), 100, 6);
    s.engine.store(&toks, None, &src, &src_slots).await.unwrap();
    let skip = CHUNK + 3; // the GPU already has these tokens
    let mask_in: Vec<bool> = (0..n).map(|i| i >= skip).collect();
    let mut dst = HostPagedKvCache::new(layout(), 100);
    let loaded = s
        .engine
        .retrieve(&toks, Some(&mask_in), &mut dst, &dst_slots)
        .await
        .unwrap();
    assert_eq!(loaded, mask_in);
    assert_rows_equal(&src, &src_slots, &dst, &dst_slots, &loaded);
    for (i, &slot) in dst_slots.iter().enumerate().take(skip) {
        assert!(row_is_zero(&dst, slot), "masked token {i} was overwritten");
    }
    // A store with a mask skips chunks fully inside the masked prefix.
    let s2 = setup();
    let r = s2
        .engine
        .store(&toks, Some(&mask_in), &src, &src_slots)
        .await
        .unwrap();
    assert_eq!(r.stored_chunks, 3);
    assert_eq!(
        s2.engine.lookup(&toks).await.unwrap(),
        0,
        "chunk 0 was never stored"
    );
}

#[tokio::test]
async fn a_skip_beyond_whole_spans_writes_nothing_before_it_and_does_not_panic() {
    let s = setup();
    let n = 3 * CHUNK;
    let stored = s.store_and_flush(n, 8).await;
    let spans = s
        .engine
        .token_database()
        .process_tokens(&stored.toks, None)
        .unwrap();
    // Skip past the whole first span and into the second.
    let skip = CHUNK + 3;
    let mut plan = s
        .engine
        .begin_retrieve_spans(&spans, skip, n, &stored.dst_slots)
        .await
        .unwrap();
    let mut dst = HostPagedKvCache::new(layout(), 100);
    plan.load_all(&mut dst).unwrap();
    let mask = plan.into_mask();
    let expect: Vec<bool> = (0..n).map(|i| i >= skip).collect();
    assert_eq!(mask, expect);
    assert_rows_equal(
        &stored.src,
        &stored.src_slots,
        &dst,
        &stored.dst_slots,
        &mask,
    );
    for &slot in &stored.dst_slots[..skip] {
        assert!(row_is_zero(&dst, slot));
    }
}

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
async fn lookup_and_retrieve_stop_at_the_first_missing_chunk() {
    let s = setup_with(Some(64), false, StorageManagerConfig::default());
    let n = 4 * CHUNK;
    let Stored {
        toks,
        src_slots,
        dst_slots,
        src,
    } = s.store_and_flush(n, 8).await;
    let spans = s
        .engine
        .token_database()
        .process_tokens(&toks, None)
        .unwrap();
    // Remove chunk 1 everywhere: chunks 2 and 3 are present but unusable.
    assert_eq!(s.engine.storage().remove(&[spans[1].key.clone()]).await, 2);
    assert_eq!(s.engine.lookup(&toks).await.unwrap(), CHUNK);
    let (mask, dst) = s.retrieve_all(&toks, &dst_slots).await;
    assert_eq!(mask.iter().filter(|m| **m).count(), CHUNK);
    assert!(mask[..CHUNK].iter().all(|m| *m));
    assert_rows_equal(&src, &src_slots, &dst, &dst_slots, &mask);
    assert!(
        dst_slots[CHUNK..]
            .iter()
            .all(|&slot| row_is_zero(&dst, slot))
    );
}

#[tokio::test]
async fn a_closed_l1_still_lets_lower_tier_hits_through() {
    let s = setup();
    let n = 3 * CHUNK;
    let Stored {
        toks,
        src_slots,
        dst_slots,
        src,
    } = s.store_and_flush(n, 11).await;
    assert_eq!(
        s.remote.inner().len(),
        3,
        "write-behind reached the lower tier"
    );
    let l1 = s.l1.as_ref().unwrap();
    l1.close().await.unwrap(); // empties L1 and refuses puts
    assert_eq!(l1.stats().entries, 0);

    let (mask, dst) = s.retrieve_all(&toks, &dst_slots).await;
    assert!(mask.iter().all(|m| *m));
    assert_rows_equal(&src, &src_slots, &dst, &dst_slots, &mask);
    let stats = s.engine.storage().stats();
    assert_eq!(stats.tiers[1].hit_chunks, 3);
    assert_eq!(stats.promotions, 0, "a closed L1 refuses promotion");
}

#[tokio::test]
async fn promotion_copies_lower_tier_hits_into_l1() {
    let s = setup();
    let n = 2 * CHUNK;
    let Stored {
        toks, dst_slots, ..
    } = s.store_and_flush(n, 13).await;
    let spans = s
        .engine
        .token_database()
        .process_tokens(&toks, None)
        .unwrap();
    let keys: Vec<_> = spans.iter().map(|s| s.key.clone()).collect();
    let l1 = s.l1.as_ref().unwrap();
    assert_eq!(l1.remove(&keys).await.unwrap(), 2);
    let mut dst = HostPagedKvCache::new(layout(), 100);
    s.engine
        .retrieve(&toks, None, &mut dst, &dst_slots)
        .await
        .unwrap();
    assert_eq!(s.engine.storage().stats().promotions, 2);
    assert_eq!(l1.contains(&keys).await.unwrap(), vec![true, true]);
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

/// `LayerwiseRetrieve::windows` (what a GPU engine queues all at once) writes exactly what
/// `load_layer` writes, partial first chunk included.
#[tokio::test]
async fn retrieve_windows_write_what_load_layer_writes() {
    let s = setup();
    let n = 3 * CHUNK;
    let stored = s.store_and_flush(n, 31).await;
    // The engine already holds the first CHUNK + 5 tokens: those are not written.
    let skip = CHUNK + 5;
    let mask: Vec<bool> = (0..n).map(|i| i >= skip).collect();
    let mut plan = s
        .engine
        .begin_retrieve_layerwise(&stored.toks, Some(&mask), &stored.dst_slots)
        .await
        .unwrap();
    let windows = plan.windows();
    assert_eq!(windows.len(), 2, "the partly held chunk and the last one");
    assert_eq!(
        (
            windows[0].chunk_tokens,
            windows[0].token_offset,
            windows[0].slots.len()
        ),
        (CHUNK, 5, CHUNK - 5)
    );
    assert_eq!(windows[0].slots, &stored.dst_slots[skip..2 * CHUNK]);
    let mut via_windows = HostPagedKvCache::new(layout(), 100);
    for w in &windows {
        via_windows
            .scatter(w.data, w.chunk_tokens, w.token_offset, w.slots)
            .unwrap();
    }
    let mut via_layers = HostPagedKvCache::new(layout(), 100);
    plan.load_all(&mut via_layers).unwrap();
    for l in 0..layout().num_layers {
        assert!(via_windows.layer(l) == via_layers.layer(l), "layer {l}");
    }
    let loaded = plan.into_mask();
    assert_eq!(loaded, mask);
    assert_rows_equal(
        &stored.src,
        &stored.src_slots,
        &via_windows,
        &stored.dst_slots,
        &loaded,
    );
}

#[tokio::test]
async fn layerwise_store_and_retrieve_match_whole_transfers() {
    let s = setup();
    let n = 3 * CHUNK;
    let toks = tokens(n, 21);
    let (src_slots, dst_slots) = slots(n);
    let src = filled_cache(layout(), 100, 22);
    let mut store = s
        .engine
        .begin_store_layerwise(&toks, None, &src_slots)
        .await
        .unwrap();
    assert!(store.save_layer(1, &src).is_err(), "layers go in order");
    store.save_layer(0, &src).unwrap();
    store.save_layer(1, &src).unwrap();
    assert_eq!(store.finish().await.unwrap().stored_chunks, 3);

    let mut plan = s
        .engine
        .begin_retrieve_layerwise(&toks, None, &dst_slots)
        .await
        .unwrap();
    assert_eq!(plan.loaded_tokens(), n);
    let mut dst = HostPagedKvCache::new(layout(), 100);
    plan.load_layer(0, &mut dst).unwrap();
    // After layer 0 only layer 0 is present.
    assert_eq!(src.row(0, 1, 5), dst.row(0, 1, dst_slots[5] as usize));
    assert!(dst.row(1, 0, dst_slots[5] as usize).iter().all(|&b| b == 0));
    plan.load_layer(1, &mut dst).unwrap();
    let mask = plan.into_mask();
    assert_rows_equal(&src, &src_slots, &dst, &dst_slots, &mask);
}

#[tokio::test]
async fn an_unfinished_layerwise_store_stores_nothing() {
    let s = setup();
    let toks = tokens(CHUNK, 23);
    let (src_slots, _) = slots(CHUNK);
    let src = filled_cache(layout(), 100, 24);
    let mut store = s
        .engine
        .begin_store_layerwise(&toks, None, &src_slots)
        .await
        .unwrap();
    store.save_layer(0, &src).unwrap();
    assert!(store.finish().await.is_err());
    assert_eq!(s.engine.lookup(&toks).await.unwrap(), 0);
    assert_eq!(
        s.l1.as_ref().unwrap().pool().stats().used,
        0,
        "buffers returned"
    );
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
async fn engine_block_hashes_give_the_same_hits_as_their_tokens_would() {
    let s = setup();
    let db = s.engine.token_database();
    let blocks: Vec<[u8; 32]> = (0..8u8).map(|i| [i; 32]).collect(); // 8 blocks of 4 tokens
    let spans = db.process_block_hashes(&blocks, 4, 0).unwrap();
    assert_eq!(spans.len(), 2);
    let src = filled_cache(layout(), 100, 27);
    let slots: Vec<i64> = (0..32).collect();
    let mut store = s
        .engine
        .begin_store_spans(spans.clone(), 32, &slots)
        .await
        .unwrap();
    for l in 0..2 {
        store.save_layer(l, &src).unwrap();
    }
    store.finish().await.unwrap();
    assert_eq!(s.engine.lookup_spans(&spans).await, 32);
    let mut changed = blocks.clone();
    changed[5] = [99; 32];
    let spans2 = db.process_block_hashes(&changed, 4, 0).unwrap();
    assert_eq!(s.engine.lookup_spans(&spans2).await, 16);
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
        let binding = kvpool_core::chunk_format::KeyBinding::of(&key);
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
