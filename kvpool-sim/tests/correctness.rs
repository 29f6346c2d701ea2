//! Never wrong KV across ranks and steps (issue 24, defects 1 and 2): a step's saves become
//! visible only after every rank ran it with no failed load touching them, and a failure cuts
//! the saves of the steps already built on top of it.
//!
//! Both scenarios failed on the connector before the staged-commit rewrite (the same
//! scenarios against the old API, in the commit that introduced this file: rank 0 kept chunks
//! 2 and 3 computed on rank 1's failed load; the pool kept chunk 3 computed in the step built
//! before the failure was known). The failure here is a synchronous load whose lookup lease
//! expired before the load, with the chunk gone: the one way a synchronous load can still fail.

mod protocol_fixture;

use std::time::Duration;

use kvpool_connector::{BlockUpdate, ConnectorConfig, ConnectorMetadata};
use protocol_fixture::*;

fn short_leases(ranks: usize, async_scheduling: bool) -> Setup {
    let config = ConnectorConfig {
        async_scheduling,
        ..ConnectorConfig::new(BLOCK)
    };
    setup_full(ranks, config, Duration::from_millis(50))
}

#[test]
fn tp2_one_ranks_failed_load_never_leaves_wrong_kv_in_another_ranks_pool() {
    let mut s = short_leases(2, false);
    let p = prompt(4 * CHUNK, 1);
    s.seed_pool(&p[..2 * CHUNK]);
    let blocks: Vec<u32> = (0..8).collect();
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request("a", &p), 0),
        (2 * CHUNK, false),
        "both ranks lease both chunks: a synchronous load"
    );
    // The leases lapse and rank 1 loses chunk 1 before the load.
    std::thread::sleep(Duration::from_millis(120));
    s.lose_chunk(1, &p, 1);
    s.sched.update_state_after_alloc("a", &blocks, 2 * CHUNK);
    let meta = s.sched.build_connector_meta(&[scheduled(
        "a",
        BlockUpdate::Replace(blocks.clone()),
        p.len(),
    )]);
    // After the all-reduce every rank computes garbage past the failed chunk.
    let bad = poisoned(&p);
    let failed = s.worker_step(&meta, &[(&bad, &blocks, 2 * CHUNK..p.len())]);
    assert_eq!(failed, [2, 3], "rank 1's chunk 1");
    // vLLM recomputes from the failed block, correctly this time.
    let meta = s
        .sched
        .build_connector_meta(&[scheduled("a", BlockUpdate::Unchanged, p.len())]);
    s.worker_step(&meta, &[(&p, &blocks, CHUNK..p.len())]);
    s.settle();
    assert_eq!(
        s.wrong_chunks(&p),
        [],
        "a rank holds KV computed on a failed load"
    );
    assert_eq!(s.pool_hit(&p), p.len(), "the recomputed chunks were stored");
    assert!(s.w.worker.stats().saves_discarded >= 2);
}

#[test]
fn async_scheduling_the_step_built_before_a_failure_is_known_is_never_stored() {
    // Asynchronous scheduling, yet a synchronous load (the connector makes every load
    // asynchronous then: this is the defence behind that one).
    let mut s = short_leases(1, true);
    let p = prompt(4 * CHUNK, 2);
    s.seed_pool(&p[..2 * CHUNK]);
    let blocks: Vec<u32> = (0..8).collect();
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request("a", &p), 0),
        (2 * CHUNK, false)
    );
    std::thread::sleep(Duration::from_millis(120));
    s.lose_chunk(0, &p, 1);
    s.sched.update_state_after_alloc("a", &blocks, 2 * CHUNK);
    // Step N+1 is built before step N's output (its failed blocks) is known.
    let meta_n = s.sched.build_connector_meta(&[scheduled(
        "a",
        BlockUpdate::Replace(blocks.clone()),
        3 * CHUNK,
    )]);
    let meta_n1 =
        s.sched
            .build_connector_meta(&[scheduled("a", BlockUpdate::Unchanged, 4 * CHUNK)]);
    let bad = poisoned(&p);
    let out_n = s.run_step(&meta_n, &[(&bad, &blocks, 2 * CHUNK..3 * CHUNK)]);
    let out_n1 = s.run_step(&meta_n1, &[(&bad, &blocks, 3 * CHUNK..4 * CHUNK)]);
    assert_eq!(s.report(&out_n), [2, 3]);
    s.report(&out_n1);
    let meta = s
        .sched
        .build_connector_meta(&[scheduled("a", BlockUpdate::Unchanged, p.len())]);
    s.worker_step(&meta, &[(&p, &blocks, CHUNK..p.len())]);
    s.settle();
    assert_eq!(
        s.wrong_chunks(&p),
        [],
        "the pool holds KV computed on a failed load"
    );
    assert_eq!(s.pool_hit(&p), p.len());
}

/// With vLLM's asynchronous scheduling the connector makes every load asynchronous: the
/// request is not scheduled until its load ended (failed blocks included), so nothing is
/// ever computed on top of a failed load.
#[test]
fn with_always_async_a_failed_load_is_known_before_anything_is_computed_on_it() {
    let mut s = setup_with(
        2,
        ConnectorConfig {
            load_timing: kvpool_connector::LoadTiming::Always,
            async_scheduling: true,
            ..ConnectorConfig::new(BLOCK)
        },
    );
    let p = prompt(4 * CHUNK, 3);
    s.seed_pool(&p[..2 * CHUNK]);
    let blocks: Vec<u32> = (0..8).collect();
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request("a", &p), 0),
        (2 * CHUNK, true)
    );
    // Rank 1 loses chunk 1 (leases hold memory, not tiers: drop its lease too).
    s.others[0].worker.leases().release("a");
    s.lose_chunk(1, &p, 1);
    s.sched.update_state_after_alloc("a", &blocks, 2 * CHUNK);
    // The load ships unscheduled; the request waits for it.
    let meta = s.sched.build_connector_meta(&[]);
    assert!(meta.requests[0].load.unwrap().asynchronous);
    let failed = steps_until_load_ended(&mut s, "a", &meta);
    assert_eq!(failed, [2, 3], "rank 1's chunk 1, before the request ran");
}

/// vLLM asks the connector for a waiting request's hit, then cannot allocate its blocks (the
/// KV cache is full): it leaves the request waiting, calls no `update_state_after_alloc`, and
/// builds the step's metadata anyway; in a later step it asks again. That lookup promised
/// nothing: no load ships, nothing is reported failed or counted as a broken promise, and
/// the next lookup and allocation load normally.
#[test]
fn a_hit_the_engine_found_no_blocks_for_is_looked_up_again_not_a_broken_promise() {
    let mut s = setup_with(
        1,
        ConnectorConfig {
            load_timing: kvpool_connector::LoadTiming::Always,
            ..ConnectorConfig::new(BLOCK)
        },
    );
    let p = prompt(2 * CHUNK + 1, 21);
    s.seed_pool(&p[..2 * CHUNK]);
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request("a", &p), 0),
        (2 * CHUNK, true)
    );
    // No blocks: the request stays waiting.
    let meta = s.sched.build_connector_meta(&[]);
    assert!(meta.requests.is_empty(), "{:?}", meta.requests);
    assert!(meta.unloadable_blocks.is_empty());
    assert_eq!(s.worker_step(&meta, &[]), Vec::<u32>::new());
    assert_eq!(s.sched.broken_promises(), 0);
    assert!(
        s.sched.tracker("a").unwrap().load.is_none(),
        "the hit was dropped"
    );
    // The next step has room.
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request("a", &p), 0),
        (2 * CHUNK, true)
    );
    let blocks: Vec<u32> = (0..5).collect();
    s.sched.update_state_after_alloc("a", &blocks, 2 * CHUNK);
    let meta = s.sched.build_connector_meta(&[]);
    assert_eq!(meta.requests.len(), 1);
    assert!(meta.requests[0].load.unwrap().asynchronous);
    let failed = steps_until_load_ended(&mut s, "a", &meta);
    assert_eq!(failed, Vec::<u32>::new());
    assert_eq!(s.sched.broken_promises(), 0);
    assert_eq!(
        kvpool_sim::kv_model::model_mismatches(&s.w.kv, &p[..2 * CHUNK], &blocks[..4]),
        0,
        "the blocks hold the stored KV"
    );
}

/// Runs the step carrying `meta` (with `req`'s asynchronous load), then idle steps until the
/// load ended; returns the blocks reported failed on the way.
fn steps_until_load_ended(s: &mut Setup, req: &str, meta: &ConnectorMetadata) -> Vec<u32> {
    let mut failed = s.worker_step(meta, &[]);
    let mut steps = 0;
    while s.sched.tracker(req).is_none_or(|t| t.load_in_flight) || steps == 0 {
        let meta = s.sched.build_connector_meta(&[]);
        failed.extend(s.worker_step(&meta, &[]));
        steps += 1;
        // The fetch runs on kvpool's runtime: give it time, as vLLM's idle steps do (1 ms).
        std::thread::sleep(Duration::from_millis(1));
        assert!(steps < 5000, "the load never ended");
    }
    failed
}
