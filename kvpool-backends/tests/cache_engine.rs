//! End to end through the cache engine: L1 (CPU) + a lower tier behind the chunk-format adapter.

mod common;

use common::tiered::*;
use common::{assert_rows_equal, filled_cache, row_is_zero};
use kvpool_core::storage::manager::StorageManagerConfig;
use kvpool_core::{HostPagedKvCache, KvTransfer, StorageBackend};

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
        via_windows.scatter(*w).unwrap();
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

/// A retrieve plan says which tier served its tokens (the per-request trace's breakdown):
/// L1 when it holds the chunks, the lower tier once L1 is gone.
#[tokio::test]
async fn a_retrieve_plan_counts_its_tokens_per_serving_tier() {
    let s = setup();
    let stored = s.store_and_flush(4 * CHUNK, 7).await;
    let plan = s
        .engine
        .begin_retrieve_layerwise(&stored.toks, None, &stored.dst_slots)
        .await
        .unwrap();
    assert_eq!(plan.tier_tokens(), [("cpu".to_string(), 4 * CHUNK)]);
    drop(plan);

    let lower_only = setup_with(None, false, StorageManagerConfig::default());
    let stored = lower_only.store_and_flush(4 * CHUNK, 7).await;
    let plan = lower_only
        .engine
        .begin_retrieve_layerwise(&stored.toks, None, &stored.dst_slots)
        .await
        .unwrap();
    assert_eq!(plan.tier_tokens(), [("memory".to_string(), 4 * CHUNK)]);
}
