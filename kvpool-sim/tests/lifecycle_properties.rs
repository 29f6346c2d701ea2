//! The connector's request lifecycle under random workloads, as a property: whatever the mix
//! of requests (shared prefixes, lengths, decode steps, how many run at once), GPU pressure
//! (prefixes evicted, requests preempted and resumed), L1 pressure, chunk size, loads failing
//! between lookup and load on one rank of one or two tensor-parallel ranks, and vLLM's
//! synchronous or asynchronous scheduling, the vLLM-shaped simulator finds, against its model
//! (every token's KV recomputed from its prefix, and wrong wherever a pass read wrong KV on any
//! rank), no wrong token, no lost block left unreported and no request state, copy, staged save
//! or held block left behind. proptest shrinks a failing workload to a small one.
//!
//! The drawn workloads put the GPU under pressure (several prefixes, a few blocks to spare), so
//! that prefixes leave the GPU and come back from the pool; a workload that still never loads
//! from the pool is not counted (`prop_assume!`), so each of the cases tests the pool's path.

use kvpool_core::{ByteSize, Dtype, KvKind, KvLayout};
use kvpool_sim::vllm_shaped::{SimSettings, run};
use proptest::prelude::*;

const BLOCK: usize = 16;

prop_compose! {
    fn workloads()(
        requests in 16usize..96,
        max_running in 1usize..10,
        prefixes in 2usize..8,
        max_prefix_tokens in 64usize..400,
        max_suffix_tokens in 1usize..96,
        max_decode_tokens in 1usize..20,
        spare_blocks in 0usize..8,
        cpu_chunks in 4u64..32,
        load_failure_rate in prop_oneof![Just(0.0), 0.0f64..0.3],
        chunk_blocks in 1usize..4,
        tp_size in 1usize..=2,
        async_scheduling in any::<bool>(),
        seed in any::<u64>(),
    ) -> (SimSettings, usize) {
        let chunk = chunk_blocks * BLOCK;
        let longest = max_prefix_tokens + max_suffix_tokens + max_decode_tokens;
        let settings = SimSettings {
            requests,
            max_running,
            prefixes,
            max_prefix_tokens,
            max_suffix_tokens,
            max_decode_tokens,
            // One request of the longest kind always fits; the rest is pressure.
            gpu_blocks: longest.div_ceil(BLOCK) + 1 + spare_blocks,
            cpu_size: ByteSize(cpu_chunks * layout().chunk_bytes(chunk) as u64),
            load_failure_rate,
            tp_size,
            async_scheduling,
            seed,
            ..SimSettings::default()
        };
        (settings, chunk)
    }
}

fn layout() -> KvLayout {
    KvLayout::new(2, 2, 8, Dtype::F16, KvKind::KeyValue, BLOCK).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn every_workload_gets_only_right_tokens_and_reports_every_lost_block(
        (settings, chunk) in workloads()
    ) {
        let report = run(&settings, layout(), chunk).unwrap();
        prop_assume!(report.pool_hit_tokens > 0, "the GPU's prefix cache served everything");
        prop_assert_eq!(report.requests, settings.requests);
        prop_assert_eq!(report.wrong_tokens, 0, "{:?}", report);
        prop_assert_eq!(report.unreported_failed_blocks, 0, "{:?}", report);
        prop_assert_eq!(report.leaked_request_states, 0, "{:?}", report);
    }
}
