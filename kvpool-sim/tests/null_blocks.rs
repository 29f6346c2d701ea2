//! The engine's null block (vLLM's block 0 under its hybrid KV cache manager: where a
//! sliding-window layer's request holds no block, outside its window). Its bytes are never the
//! request's, so a save stops before the first chunk with one, and a load starts past the
//! leading run of them without ever writing the null block.

mod protocol_fixture;

use kvpool_connector::BlockUpdate;
use kvpool_sim::kv_model::model_mismatches;
use protocol_fixture::*;

const NULL: u32 = 0;

/// Every row of block `block` on every layer and plane of rank 0.
fn block_rows(s: &Setup, block: u32) -> Vec<Vec<u8>> {
    let mut rows = Vec::new();
    for layer in 0..2 {
        for plane in 0..2 {
            for slot in block as usize * BLOCK..(block as usize + 1) * BLOCK {
                rows.push(s.w.kv.row(layer, plane, slot).to_vec());
            }
        }
    }
    rows
}

#[test]
fn a_save_stops_before_the_first_chunk_holding_the_null_block() {
    let mut s = setup();
    s.w.worker.set_null_block(Some(NULL));
    let p = prompt(4 * CHUNK, 21);
    // Chunk 1's first block is the null block, which another request's KV fills.
    let blocks: Vec<u32> = vec![10, 11, NULL, 13, 14, 15, 16, 17];
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request("a", &p), 0),
        (0, false)
    );
    s.sched.update_state_after_alloc("a", &blocks, 0);
    let meta = s.sched.build_connector_meta(&[scheduled(
        "a",
        BlockUpdate::Replace(blocks.clone()),
        p.len(),
    )]);
    let other = poisoned(&p);
    assert!(
        s.worker_step(
            &meta,
            &[
                (&p, &blocks, 0..p.len()),
                (&other, &blocks, CHUNK..CHUNK + BLOCK)
            ]
        )
        .is_empty()
    );
    s.settle();
    assert_eq!(
        s.pool_hit(&p),
        CHUNK,
        "only the chunk before the null block"
    );
    assert!(s.wrong_chunks(&p).is_empty(), "{:?}", s.wrong_chunks(&p));
}

#[test]
fn a_load_starts_past_the_leading_null_blocks_and_never_writes_the_null_block() {
    let mut s = setup();
    s.w.worker.set_null_block(Some(NULL));
    let n = 4 * CHUNK + 5;
    let p = prompt(n, 22);
    s.seed_pool(&p);
    // The null block holds another request's KV, which must stay as it is.
    let other = poisoned(&p);
    let filler: Vec<u32> = vec![NULL; 2];
    s.compute(&other, &filler, 0..BLOCK);
    let null_before = block_rows(&s, NULL);
    // Outside the window: the first three blocks (48 tokens) are null.
    let blocks: Vec<u32> = vec![NULL, NULL, NULL, 23, 24, 25, 26, 27, 28];
    let (hit, asynchronous) = s.sched.get_num_new_matched_tokens(&request("b", &p), 0);
    assert_eq!((hit, asynchronous), (4 * CHUNK, false));
    s.sched.update_state_after_alloc("b", &blocks, hit);
    let meta =
        s.sched
            .build_connector_meta(&[scheduled("b", BlockUpdate::Replace(blocks.clone()), n)]);
    assert!(s.worker_step(&meta, &[]).is_empty(), "no load failed");
    assert_eq!(
        block_rows(&s, NULL),
        null_before,
        "the null block was written"
    );
    // Tokens 48..128 (blocks 23..=27) hold the model's KV, compared from block 3 on.
    let loaded = 4 * CHUNK;
    let whole = model_mismatches(&s.w.kv, &p[..loaded], &blocks);
    let skipped = model_mismatches(&s.w.kv, &p[..3 * BLOCK], &blocks);
    assert_eq!(
        whole - skipped,
        0,
        "the window's blocks hold the model's KV"
    );
}
