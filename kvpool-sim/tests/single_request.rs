//! The connector protocol proven end to end by the engine simulator.

use std::sync::Arc;

use kvpool_connector::{
    BlockUpdate, ConnectorConfig, ConnectorScheduler, ConnectorWorker, EngineRequest,
    ScheduledRequest,
};
use kvpool_core::{Dtype, KvKind, KvLayout};
use kvpool_sim::single_request::{self as simulator, SimConfig, Simulator, Workload};

/// The SimpleCPUOffloadConnector walk-through: A = "Hello, world!" (3 tokens) is computed and
/// its full chunk offloaded; the GPU cache is then evicted; B shares the prefix, loads it from
/// the pool into a different GPU block, and computes only the rest.
#[test]
fn walkthrough_request_b_loads_request_a_prefix_from_the_pool() {
    let config = SimConfig {
        layout: KvLayout::new(2, 2, 8, Dtype::F16, KvKind::KeyValue, 2).unwrap(),
        chunk_size: 2,
        gpu_blocks: 8,
        ..Default::default()
    };
    let mut sim = Simulator::new(&config).unwrap();
    let hello_world = [15496u32, 11, 995]; // "Hello", ",", " world"
    let a = sim.run_request(&hello_world).unwrap();
    assert_eq!(
        (a.gpu_hit_tokens, a.pool_hit_tokens, a.computed_tokens),
        (0, 0, 3)
    );
    assert_eq!(a.mismatched_rows, 0);
    // The KV event names exactly the one full chunk ("Hello", ",") that was stored.
    let expected = sim
        .engine()
        .token_database()
        .process_tokens(&hello_world[..2], None)
        .unwrap()[0]
        .key
        .hash
        .0;
    assert_eq!(
        sim.kv_events(),
        [kvpool_connector::KvEvent::ChunksStored {
            req_id: a.req_id.clone(),
            chunk_hashes: vec![expected]
        }]
    );

    sim.evict_gpu_prefix_cache();
    let b_prompt = [15496u32, 11, 1917, 0]; // "Hello", ",", " Bob", "!"
    let b = sim.run_request(&b_prompt).unwrap();
    assert_eq!(b.gpu_hit_tokens, 0, "the GPU cache was evicted");
    assert_eq!(b.pool_hit_tokens, 2, "the shared chunk comes from the pool");
    assert_eq!(b.computed_tokens, 2, "only the rest is computed");
    assert_ne!(
        b.block_ids[0], a.block_ids[0],
        "loaded into a different GPU block"
    );
    assert_eq!(
        b.mismatched_rows, 0,
        "B's KV is exactly what the model computes"
    );
    assert_eq!(sim.leaks(), (0, 0, 0));
}

fn workload(seed: u64) -> Workload {
    Workload {
        requests: 60,
        prefixes: 4,
        max_prefix_tokens: 96,
        max_suffix_tokens: 40,
        seed,
    }
}

#[test]
fn random_shared_prefix_workloads_under_gpu_pressure_stay_exact() {
    for seed in 1..=3 {
        // 40 blocks of 4 tokens: the GPU prefix cache cannot keep every prefix.
        let config = SimConfig {
            gpu_blocks: 40,
            ..Default::default()
        };
        let report = simulator::run(&config, &workload(seed)).unwrap();
        assert_eq!(report.mismatched_rows, 0, "seed {seed}");
        assert_eq!(report.leaks, (0, 0, 0), "seed {seed}");
        assert!(
            report.prefill_tokens_saved > 0,
            "seed {seed}: the pool served prefixes the GPU lost"
        );
        assert_eq!(report.failed_blocks, 0);
        assert_eq!(
            report.stored_tokens,
            report.stored_chunk_events as u64 * 16,
            "KV events announce exactly the chunks stored"
        );
        assert_eq!(
            report.gpu_hit_tokens + report.prefill_tokens_saved + report.computed_tokens,
            report.prompt_tokens,
            "every token is either cached, loaded or computed exactly once"
        );
    }
}

#[test]
fn injected_failures_become_reported_blocks_and_recomputation_with_exact_kv() {
    // Chunks are 2 KiB: a 4 KiB L1 holds two, so most hits come from the faulty lower tier.
    let config = SimConfig {
        gpu_blocks: 40,
        cpu_pool_bytes: 4 << 10,
        lower_tier: true,
        inject_failures: Some((3, 4)),
        ..Default::default()
    };
    let report = simulator::run(&config, &workload(7)).unwrap();
    assert!(
        report.failed_blocks > 0,
        "faults were injected and reported: {report:?}"
    );
    assert_eq!(
        report.mismatched_rows, 0,
        "no wrong byte survives a failed load"
    );
    assert_eq!(report.leaks, (0, 0, 0));
    assert!(report.prefill_tokens_saved > 0);
}

#[test]
fn a_worker_that_derives_other_keys_refuses_the_metadata() {
    let runtime = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
    );
    let make = |chunk_size: usize| {
        let mut config = kvpool_core::PoolConfig::default();
        config.local_cpu.max_size = kvpool_core::ByteSize::mib(64);
        config.chunking.chunk_size = chunk_size;
        runtime
            .block_on(kvpool_backends::build_pool(&config))
            .unwrap()
            .engine
    };
    let (sched_engine, worker_engine) = (make(256), make(128));
    let block_size = sched_engine.layout().block_size;
    let config = ConnectorConfig {
        block_size,
        save_unfull_chunk: false,
        save_decode_tokens: false,
        offload: Default::default(),
    };
    let mut scheduler = ConnectorScheduler::new(sched_engine.clone(), runtime.clone(), config);
    let mut worker = ConnectorWorker::new(worker_engine, runtime.clone(), block_size);
    worker.register_kv_caches(sched_engine.layout()).unwrap();
    let req = EngineRequest {
        req_id: "r".into(),
        prompt_token_ids: (0..300).collect(),
        skip_save: false,
        extra_keys: Vec::new(),
    };
    scheduler.get_num_new_matched_tokens(&req, 0);
    scheduler.update_state_after_alloc("r", &(0..19).collect::<Vec<u32>>(), 0);
    let meta = scheduler.build_connector_meta(&[ScheduledRequest {
        req_id: "r".into(),
        new_token_ids: vec![],
        blocks: BlockUpdate::Unchanged,
        num_computed_tokens_after_step: 300,
    }]);
    let err = worker
        .bind_connector_metadata(&meta.encode())
        .unwrap_err()
        .to_string();
    assert!(err.contains("disagree on key derivation"), "{err}");
    assert!(
        worker.bind_connector_metadata(&[1, 2, 3]).is_err(),
        "garbage is an error, not a panic"
    );
}

#[test]
fn a_preempted_request_resumes_from_what_the_pool_holds() {
    let mut sim = Simulator::new(&SimConfig::default()).unwrap();
    let prompt: Vec<u32> = (0..100).map(|i| i * 7 + 3).collect();
    // Step 1 computes 40 tokens: two complete 16-token chunks are saved before preemption.
    let resumed = sim.run_preempted_request(&prompt, 40).unwrap();
    assert_eq!(
        resumed.pool_hit_tokens, 32,
        "the resumed request loads the saved chunks"
    );
    assert_eq!(resumed.computed_tokens, 68, "and computes only the rest");
    assert_eq!(resumed.mismatched_rows, 0);
    assert_eq!(sim.leaks(), (0, 0, 0));
}

#[test]
fn lazy_offload_saves_only_what_the_gpu_evicts_and_stays_exact() {
    let eager = simulator::run(
        &SimConfig {
            gpu_blocks: 40,
            ..Default::default()
        },
        &workload(5),
    )
    .unwrap();
    let lazy_config = SimConfig {
        gpu_blocks: 40,
        offload: kvpool_connector::OffloadMode::Lazy,
        ..Default::default()
    };
    // A pool of 8 chunks (2 KiB each) forgets chunks, so stale GPU blocks would be re-saved
    // if the simulator handed over chunks whose blocks were already reused.
    let small_pool = SimConfig {
        cpu_pool_bytes: 16 << 10,
        ..lazy_config.clone()
    };
    for seed in 1..=4 {
        let r = simulator::run(&small_pool, &workload(seed)).unwrap();
        assert_eq!(r.mismatched_rows, 0, "seed {seed}");
        assert_eq!(r.leaks, (0, 0, 0), "seed {seed}");
    }
    let lazy = simulator::run(&lazy_config, &workload(5)).unwrap();
    assert_eq!(
        lazy.mismatched_rows, 0,
        "chunks saved at eviction hold exactly the model's bytes"
    );
    assert_eq!(lazy.leaks, (0, 0, 0));
    assert!(
        lazy.prefill_tokens_saved > 0,
        "prefixes the GPU evicted came back from the pool"
    );
    assert!(
        lazy.stored_tokens < eager.stored_tokens,
        "lazy stores less: {} vs {}",
        lazy.stored_tokens,
        eager.stored_tokens
    );
}
