//! Scheduler-side rules, checked on a real pool.

use std::sync::Arc;

use kvpool_connector::{
    BlockUpdate, ConnectorConfig, ConnectorOutput, ConnectorScheduler, EngineRequest,
    ScheduledRequest,
};
use kvpool_core::{ByteSize, HostPagedKvCache, PoolConfig};

struct Setup {
    runtime: Arc<tokio::runtime::Runtime>,
    engine: Arc<kvpool_core::CacheEngine>,
}

fn setup() -> Setup {
    let runtime = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
    );
    let mut config = PoolConfig::default();
    config.local_cpu.max_size = ByteSize::mib(256);
    config.chunking.chunk_size = 16;
    let engine = runtime
        .block_on(kvpool_backends::build_pool(&config))
        .unwrap()
        .engine;
    Setup { runtime, engine }
}

fn scheduler(s: &Setup, save_decode_tokens: bool) -> ConnectorScheduler {
    let config = ConnectorConfig {
        block_size: 16,
        save_unfull_chunk: false,
        save_decode_tokens,
        offload: Default::default(),
    };
    ConnectorScheduler::new(s.engine.clone(), s.runtime.clone(), config)
}

fn request(id: &str, n: u32, skip_save: bool) -> EngineRequest {
    EngineRequest {
        req_id: id.into(),
        prompt_token_ids: (0..n).collect(),
        skip_save,
        extra_keys: Vec::new(),
    }
}

fn step(id: &str, computed: usize, new_tokens: Vec<u32>) -> ScheduledRequest {
    ScheduledRequest {
        req_id: id.into(),
        new_token_ids: new_tokens,
        blocks: BlockUpdate::Unchanged,
        num_computed_tokens_after_step: computed,
    }
}

/// Stores `n` tokens of the 0..n sequence in the pool.
fn store(s: &Setup, n: usize) {
    let kv = HostPagedKvCache::new(*s.engine.layout(), 64);
    let tokens: Vec<u32> = (0..n as u32).collect();
    let slots: Vec<i64> = (0..n as i64).collect();
    s.runtime
        .block_on(s.engine.store(&tokens, None, &kv, &slots))
        .unwrap();
}

#[test]
fn the_final_token_is_never_loaded_and_gpu_tokens_are_not_reloaded() {
    let s = setup();
    store(&s, 64);
    let mut sched = scheduler(&s, false);
    // 64 tokens all in the pool: at most 48 (three chunks) are offered, so one is computed.
    assert_eq!(
        sched.get_num_new_matched_tokens(&request("a", 64, false), 0),
        (48, false)
    );
    // The GPU already has 32: only 16 more.
    assert_eq!(
        sched.get_num_new_matched_tokens(&request("b", 64, false), 32),
        (16, false)
    );
    assert_eq!(
        sched.get_num_new_matched_tokens(&request("c", 64, false), 48),
        (0, false)
    );
    sched.update_state_after_alloc("b", &[0, 1, 2, 3], 16);
    let meta = sched.build_connector_meta(&[step("b", 64, vec![])]);
    let load = meta.requests[0].load.unwrap();
    assert_eq!((load.gpu_cached_tokens, load.load_until), (32, 48));
    // The slot mapping follows the blocks: slot = block * 16 + offset.
    assert_eq!(meta.requests[0].slot_mapping[17], 17);
}

#[test]
fn saves_skip_what_was_saved_cover_complete_chunks_and_honour_skip_save() {
    let s = setup();
    let mut sched = scheduler(&s, false);
    sched.get_num_new_matched_tokens(&request("a", 40, false), 0);
    sched.update_state_after_alloc("a", &[0, 1, 2], 0);
    let m1 = sched.build_connector_meta(&[step("a", 40, vec![])]);
    let save = m1.requests[0].save.unwrap();
    assert_eq!(
        (save.save_from, save.save_until),
        (0, 32),
        "complete chunks only"
    );
    // Decode tokens are not saved unless configured.
    let m2 = sched.build_connector_meta(&[step("a", 48, vec![7; 8])]);
    assert!(m2.requests.is_empty(), "nothing new to save: {m2:?}");
    let mut with_decode = scheduler(&s, true);
    with_decode.get_num_new_matched_tokens(&request("d", 40, false), 0);
    with_decode.update_state_after_alloc("d", &[0, 1, 2], 0);
    with_decode.build_connector_meta(&[step("d", 40, vec![])]);
    let m3 = with_decode.build_connector_meta(&[step("d", 48, vec![7; 8])]);
    let save = m3.requests[0].save.unwrap();
    assert_eq!(
        (save.save_from, save.save_until),
        (32, 48),
        "saves continue where they stopped"
    );

    sched.get_num_new_matched_tokens(&request("private", 40, true), 0);
    sched.update_state_after_alloc("private", &[4, 5, 6], 0);
    assert!(
        sched
            .build_connector_meta(&[step("private", 40, vec![])])
            .requests
            .is_empty()
    );
}

#[test]
fn request_finished_frees_at_once_and_failed_loads_rewind_saves() {
    let s = setup();
    let mut sched = scheduler(&s, false);
    sched.get_num_new_matched_tokens(&request("a", 64, false), 0);
    sched.update_state_after_alloc("a", &[10, 11, 12, 13], 0);
    sched.build_connector_meta(&[step("a", 64, vec![])]);
    // Saves complete inside the step, so the engine may free the blocks at once, and the
    // request's state is gone (no `release` call that vLLM would never make).
    assert_eq!(
        sched.request_finished("a", &[10, 11, 12, 13]),
        (false, None)
    );
    assert_eq!(sched.tracked_requests(), 0);

    // A failed load in block 12 (tokens 32..48) rewinds the save point to token 32.
    sched.get_num_new_matched_tokens(&request("b", 64, false), 0);
    sched.update_state_after_alloc("b", &[10, 11, 12, 13], 0);
    sched.build_connector_meta(&[step("b", 64, vec![])]);
    assert_eq!(sched.tracker("b").unwrap().saved_tokens, 64);
    sched.update_connector_output(&ConnectorOutput {
        failed_block_ids: vec![12],
        ..Default::default()
    });
    assert_eq!(sched.tracker("b").unwrap().saved_tokens, 32);
    let again = sched.build_connector_meta(&[step("b", 64, vec![])]);
    let save = again.requests[0].save.unwrap();
    assert_eq!((save.save_from, save.save_until), (32, 64));

    // Preemption forgets the GPU blocks and save progress.
    sched.request_preempted("b");
    let t = sched.tracker("b").unwrap();
    assert!(t.block_ids.is_empty() && t.saved_tokens == 0 && t.load.is_none());
}
