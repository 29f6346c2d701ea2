//! The connector driven the way vLLM 0.32 drives it: several requests per step sharing
//! prefix blocks, incremental block ids, reused request ids, failed loads. One test per
//! defect listed in the "real protocol" issue; each failed on the code before it.

mod protocol_fixture;

use kvpool_connector::BlockUpdate;
use kvpool_core::HostPagedKvCache;
use kvpool_sim::kv_model::model_mismatches;
use protocol_fixture::*;

/// Defect 1: request A's load of chunk 1 fails; request B, in the same step, shares A's blocks
/// through the prefix cache and saves them. The pool must not get B's copy of the never-loaded
/// blocks under a valid key.
#[test]
fn a_failed_load_is_never_saved_by_another_request_sharing_its_blocks() {
    let mut s = setup();
    let p = prompt(3 * CHUNK + 1, 1);
    s.seed_pool(&p[..2 * CHUNK]);
    // A: 64 tokens in the pool; blocks 0..7.
    let a_blocks: Vec<u32> = (0..7).collect();
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request("a", &p), 0),
        (2 * CHUNK, false)
    );
    s.sched.update_state_after_alloc("a", &a_blocks, 2 * CHUNK);
    // The second chunk disappears from the pool between lookup and load (the lookup's lease
    // lapsed, then the chunk was evicted or its tier went down).
    s.w.worker.leases().release("a");
    s.lose_chunk(0, &p, 1);
    // B: same prompt, shares A's blocks 0..3 (prefix cache), own blocks after.
    let b_blocks: Vec<u32> = (0..4).chain(20..23).collect();
    s.sched
        .get_num_new_matched_tokens(&request("b", &p), 2 * CHUNK);
    s.sched.update_state_after_alloc("b", &b_blocks, 0);
    let meta = s.sched.build_connector_meta(&[
        scheduled("a", BlockUpdate::Replace(a_blocks.clone()), p.len()),
        scheduled("b", BlockUpdate::Replace(b_blocks.clone()), p.len()),
    ]);
    let (pa, pb) = (p.clone(), p.clone());
    let failed = s.worker_step(
        &meta,
        &[
            (&pa, &a_blocks, 2 * CHUNK..p.len()),
            (&pb, &b_blocks, 2 * CHUNK..p.len()),
        ],
    );
    assert_eq!(failed, [2, 3], "A's second chunk is blocks 2 and 3");
    s.settle();
    assert_eq!(
        s.pool_hit(&p[..3 * CHUNK]),
        CHUNK,
        "nothing from the failed chunk on was stored, by A or by B"
    );
    // The scheduler rewound both saves; once the engine recomputed the blocks, they are saved.
    assert_eq!(s.sched.tracker("b").unwrap().saved_tokens, CHUNK);
    s.compute(&p, &a_blocks, CHUNK..2 * CHUNK);
    let meta = s.sched.build_connector_meta(&[
        scheduled("a", BlockUpdate::Unchanged, p.len()),
        scheduled("b", BlockUpdate::Unchanged, p.len()),
    ]);
    s.worker_step(&meta, &[]);
    s.settle();
    assert_eq!(s.pool_hit(&p[..3 * CHUNK]), 3 * CHUNK);
    let mut check = HostPagedKvCache::new(*s.engine.layout(), 64);
    let slots: Vec<i64> = (0..3 * CHUNK as i64).collect();
    s.runtime
        .block_on(s.engine.retrieve(&p[..3 * CHUNK], None, &mut check, &slots))
        .unwrap();
    let blocks: Vec<u32> = (0..6).collect();
    assert_eq!(model_mismatches(&check, &p[..3 * CHUNK], &blocks), 0);
}

/// Defect 2: `get_finished` must not report requests vLLM did not hand over as finished, nor a
/// finished request the engine does not hold for the connector.
#[test]
fn get_finished_reports_no_unfinished_request() {
    let mut s = setup();
    let p = prompt(2 * CHUNK + 1, 2);
    let blocks: Vec<u32> = (0..5).collect();
    s.sched.get_num_new_matched_tokens(&request("a", &p), 0);
    s.sched.update_state_after_alloc("a", &blocks, 0);
    let meta = s.sched.build_connector_meta(&[scheduled(
        "a",
        BlockUpdate::Replace(blocks.clone()),
        p.len(),
    )]);
    let pa = p.clone();
    let outs = s.run_step(&meta, &[(&pa, &blocks, 0..p.len())]);
    assert!(outs[0].finished_sending.is_empty() && outs[0].finished_recving.is_empty());
    // vLLM calls request_finished before it applies the step's output: the save may still be
    // copying, so the engine holds a's blocks until the workers report a.
    assert!(s.sched.request_finished("a", &blocks));
    s.report(&outs);
    s.finished.push("a".into());
    s.settle();
    assert_eq!(
        s.released,
        ["a"],
        "released once, after vLLM handed it over as finished"
    );
    assert_eq!(s.pool_hit(&p), 2 * CHUNK, "the save happened");
}

/// Defect 3: a finished request's state is dropped at once (vLLM never calls `release`), and a
/// reused id with another prompt never loads or saves the old prompt's KV.
#[test]
fn a_reused_request_id_starts_over() {
    let mut s = setup();
    let old = prompt(2 * CHUNK + 1, 3);
    let new = prompt(2 * CHUNK + 1, 4);
    s.seed_pool(&new[..2 * CHUNK]);
    s.sched.get_num_new_matched_tokens(&request("x", &old), 0);
    s.sched.update_state_after_alloc("x", &[0, 1, 2, 3, 4], 0);
    s.sched
        .build_connector_meta(&[scheduled("x", BlockUpdate::Unchanged, old.len())]);
    // The step that saved x never ran, so its copy may be pending: the engine holds x's blocks.
    assert!(s.sched.request_finished("x", &[0, 1, 2, 3, 4]));
    assert_eq!(s.sched.tracked_requests(), 0, "no leaked state");

    // The engine reuses "x" for another prompt before (or without) telling us it finished.
    s.sched.get_num_new_matched_tokens(&request("x", &old), 0);
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request("x", &new), 0),
        (2 * CHUNK, false)
    );
    s.sched
        .update_state_after_alloc("x", &[5, 6, 7, 8, 9], 2 * CHUNK);
    let meta = s
        .sched
        .build_connector_meta(&[scheduled("x", BlockUpdate::Unchanged, new.len())]);
    let new_keys: Vec<[u8; 16]> = s
        .engine
        .token_database()
        .process_tokens(&new[..2 * CHUNK], None)
        .unwrap()
        .iter()
        .map(|span| span.key.hash.0)
        .collect();
    assert_eq!(
        meta.requests[0].chunk_hashes, new_keys,
        "the new prompt's chunks"
    );
    assert!(s.worker_step(&meta, &[]).is_empty());
    assert_eq!(
        model_mismatches(&s.w.kv, &new[..2 * CHUNK], &[5, 6, 7, 8]),
        0
    );
}

/// Defect 4: vLLM passes only newly allocated blocks for running requests; they accumulate.
/// And a promised load the blocks cannot hold is reported as failed, never dropped silently.
#[test]
fn incremental_blocks_accumulate_and_an_uncoverable_load_is_reported() {
    let mut s = setup();
    // Chunked prefill: 3 chunks over three steps, blocks arriving two at a time.
    let p = prompt(3 * CHUNK + 1, 5);
    s.sched.get_num_new_matched_tokens(&request("a", &p), 0);
    s.sched.update_state_after_alloc("a", &[10, 11], 0);
    let pa = p.clone();
    let m1 =
        s.sched
            .build_connector_meta(&[scheduled("a", BlockUpdate::Replace(vec![10, 11]), CHUNK)]);
    s.worker_step(&m1, &[(&pa, &[10, 11], 0..CHUNK)]);
    let m2 = s.sched.build_connector_meta(&[scheduled(
        "a",
        BlockUpdate::Append(vec![12, 13]),
        2 * CHUNK,
    )]);
    assert_eq!(m2.requests[0].block_ids, [10, 11, 12, 13]);
    s.worker_step(&m2, &[(&pa, &[10, 11, 12, 13], CHUNK..2 * CHUNK)]);
    s.settle();
    assert_eq!(s.pool_hit(&p[..2 * CHUNK]), 2 * CHUNK);

    // Request b is promised 64 tokens, but the engine gives it one block.
    s.sched.get_num_new_matched_tokens(&request("b", &p), 0);
    s.sched.update_state_after_alloc("b", &[30], 2 * CHUNK);
    let meta = s
        .sched
        .build_connector_meta(&[scheduled("b", BlockUpdate::Unchanged, p.len())]);
    assert_eq!(meta.unloadable_blocks, [30]);
    assert_eq!(s.sched.broken_promises(), 1);
    assert_eq!(s.worker_step(&meta, &[]), [30]);
}

/// Defect 5: one request's failing load never hides another's result in the same step.
#[test]
fn one_failure_does_not_hide_other_requests() {
    let mut s = setup();
    let p = prompt(2 * CHUNK + 1, 6);
    s.seed_pool(&p[..2 * CHUNK]);
    // a's blocks lie beyond the 64-block cache: writing them fails; b's are fine.
    let a_blocks: Vec<u32> = (100..105).collect();
    let b_blocks: Vec<u32> = (0..5).collect();
    for (id, blocks) in [("a", &a_blocks), ("b", &b_blocks)] {
        assert_eq!(
            s.sched.get_num_new_matched_tokens(&request(id, &p), 0),
            (2 * CHUNK, false)
        );
        s.sched.update_state_after_alloc(id, blocks, 2 * CHUNK);
    }
    let meta = s.sched.build_connector_meta(&[
        scheduled("a", BlockUpdate::Unchanged, p.len()),
        scheduled("b", BlockUpdate::Unchanged, p.len()),
    ]);
    assert_eq!(
        s.worker_step(&meta, &[]),
        [100, 101, 102, 103],
        "a's blocks are reported"
    );
    assert_eq!(
        model_mismatches(&s.w.kv, &p[..2 * CHUNK], &b_blocks[..4]),
        0,
        "b was loaded"
    );
}

/// Defect 6: the same token ids under another LoRA adapter, multimodal input or cache salt
/// never share a chunk.
#[test]
fn extra_keys_separate_requests_with_the_same_tokens() {
    let mut s = setup();
    let p = prompt(2 * CHUNK + 1, 7);
    s.seed_pool(&p[..2 * CHUNK]);
    let mut lora = request("l", &p);
    lora.extra_keys = kvpool_connector::extra_keys::ExtraKeys {
        lora_name: Some("adapter-1".into()),
        ..Default::default()
    }
    .encode();
    assert_eq!(s.sched.get_num_new_matched_tokens(&lora, 0), (0, false));
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request("plain", &p), 0),
        (2 * CHUNK, false)
    );
}

/// Hash once: a 128K-token prompt's tokens are hashed exactly once between the scheduler's
/// lookup, the metadata, the worker's load and its save of the rest, but for the tail-block
/// keys of the first missing chunk (less than one chunk, hashed again in their own domain).
#[test]
fn a_long_prompt_is_hashed_once_between_scheduler_and_worker() {
    let mut s = setup();
    let n = 128 * 1024;
    let p = prompt(n + 1, 8);
    s.seed_pool(&p[..n / 2]);
    let blocks: Vec<u32> = (0..(n + 1).div_ceil(BLOCK) as u32).collect();
    s.w.kv = HostPagedKvCache::new(*s.engine.layout(), blocks.len());
    let before = kvpool_core::keys::chunk_hash::tokens_hashed_on_this_thread();
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request("long", &p), 0),
        (n / 2, false)
    );
    s.sched.update_state_after_alloc("long", &blocks, n / 2);
    let meta = s
        .sched
        .build_connector_meta(&[scheduled("long", BlockUpdate::Unchanged, n + 1)]);
    let failed = s.worker_step(&meta, &[]);
    let hashed = kvpool_core::keys::chunk_hash::tokens_hashed_on_this_thread() - before;
    assert_eq!(
        hashed,
        (n + CHUNK - BLOCK) as u64,
        "every token hashed once (the final token is in no chunk), and the first missing \
         chunk's whole blocks but its last hashed again as tail-block keys"
    );
    assert!(failed.is_empty());
    s.settle();
    assert_eq!(s.pool_hit(&p[..n]), n, "the second half was saved");
}

/// `reset_cache` (vLLM calls it after a weight update): nothing stored before is found again.
#[test]
fn after_a_reset_nothing_stored_before_is_found() {
    let mut s = setup();
    let p = prompt(2 * CHUNK + 1, 9);
    s.seed_pool(&p[..2 * CHUNK]);
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request("a", &p), 0),
        (2 * CHUNK, false)
    );
    s.sched.reset();
    assert_eq!(s.sched.tracked_requests(), 0);
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request("a", &p), 0),
        (0, false),
        "the old chunks are unreachable"
    );
}
