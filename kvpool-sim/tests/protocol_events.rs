//! What the worker keeps between vLLM's calls: per-request traces until vLLM says a request
//! finished, and save events only when asked for, bounded.

mod protocol_fixture;

use kvpool_connector::BlockUpdate;
use protocol_fixture::*;

/// The worker's per-request trace: what it loaded and stored for a request, forgotten (and
/// logged) when vLLM says the request finished.
#[test]
fn each_request_is_traced_until_vllm_says_it_finished() {
    let mut s = setup();
    let p = prompt(3 * CHUNK + 1, 12);
    s.seed_pool(&p[..2 * CHUNK]);
    let blocks: Vec<u32> = (0..7).collect();
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request("t", &p), 0),
        (2 * CHUNK, false)
    );
    s.sched.update_state_after_alloc("t", &blocks, 2 * CHUNK);
    let meta = s.sched.build_connector_meta(&[scheduled(
        "t",
        BlockUpdate::Replace(blocks.clone()),
        p.len(),
    )]);
    let pt = p.clone();
    s.worker_step(&meta.encode(), &[(&pt, &blocks, 2 * CHUNK..p.len())]);
    let trace = s.worker.request_trace("t").expect("traced").clone();
    assert_eq!(trace.load_requested_tokens, 2 * CHUNK as u64);
    assert_eq!(trace.loaded_tokens, 2 * CHUNK as u64);
    assert_eq!(
        trace.loaded_tokens_by_tier,
        [("cpu".to_string(), 2 * CHUNK as u64)],
        "the seeded chunks came from L1"
    );
    assert_eq!(trace.failed_tokens, 0);
    assert_eq!(trace.stored_tokens, CHUNK as u64, "the third chunk");
    assert_eq!(s.worker.traced_requests(), (1, 0));
    s.worker.get_finished(&["t".to_string()]);
    assert!(s.worker.request_trace("t").is_none());
    assert_eq!(s.worker.traced_requests(), (0, 0));
}

/// Found by the chaos soak: the worker recorded one event per save for an engine that never
/// drained them (vLLM's CPU path never asked), so its memory grew for ever. Now nothing is
/// recorded unless asked for, and at most `MAX_PENDING_KV_EVENTS` wait for a drain.
#[test]
fn save_events_are_kept_only_when_asked_for_and_bounded() {
    let mut s = setup();
    let step = |s: &mut Setup, i: usize| {
        let id = format!("e{i}");
        let p = prompt(CHUNK, 1000 + i as u32);
        let blocks: Vec<u32> = (0..(CHUNK / BLOCK) as u32).collect();
        s.sched.get_num_new_matched_tokens(&request(&id, &p), 0);
        s.sched.update_state_after_alloc(&id, &blocks, 0);
        let meta = s.sched.build_connector_meta(&[scheduled(
            &id,
            BlockUpdate::Replace(blocks.clone()),
            p.len(),
        )]);
        s.worker_step(&meta.encode(), &[(&p, &blocks, 0..p.len())]);
        s.sched.request_finished(&id, &blocks);
    };
    step(&mut s, 0);
    assert!(
        s.worker.take_kv_events().is_empty(),
        "recorded without being asked"
    );
    s.worker.enable_kv_events();
    let n = kvpool_connector::worker::MAX_PENDING_KV_EVENTS + 3;
    for i in 1..=n {
        step(&mut s, i);
    }
    let events = s.worker.take_kv_events();
    assert_eq!(
        events.len(),
        kvpool_connector::worker::MAX_PENDING_KV_EVENTS
    );
    let kvpool_connector::KvEvent::ChunksStored { req_id, .. } = events.last().unwrap();
    assert_eq!(req_id, &format!("e{n}"));
    assert!(s.worker.take_kv_events().is_empty());
}
