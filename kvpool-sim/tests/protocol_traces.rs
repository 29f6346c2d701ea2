//! What the worker keeps between vLLM's calls: per-request traces until vLLM says a request
//! finished.

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
    s.worker_step(&meta, &[(&pt, &blocks, 2 * CHUNK..p.len())]);
    s.settle();
    let trace = s.w.worker.request_trace("t").expect("traced").clone();
    assert_eq!(trace.load_requested_tokens, 2 * CHUNK as u64);
    assert_eq!(trace.loaded_tokens, 2 * CHUNK as u64);
    assert_eq!(
        trace.loaded_tokens_by_tier,
        [("cpu".to_string(), 2 * CHUNK as u64)],
        "the seeded chunks came from L1"
    );
    assert_eq!(trace.failed_tokens, 0);
    assert_eq!(trace.stored_tokens, CHUNK as u64, "the third chunk");
    assert_eq!(s.w.worker.traced_requests(), (1, 0));
    s.w.worker.transfer_results(&["t".to_string()]);
    assert!(s.w.worker.request_trace("t").is_none());
    assert_eq!(s.w.worker.traced_requests(), (0, 0));
}
