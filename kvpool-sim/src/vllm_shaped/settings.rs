//! What a `kvpool sim` run is given (`SimSettings`) and what it reports (`SimReport`).

use std::time::Duration;

use kvpool_core::{ByteSize, KvLayout, PoolConfig};
use serde::Serialize;

/// Simulation settings.
#[derive(Debug, Clone)]
pub struct SimSettings {
    /// Requests to run to completion.
    pub requests: usize,
    /// Most requests running (or waiting for their load) at once (vLLM `max_num_seqs`).
    pub max_running: usize,
    /// Distinct shared prefixes the prompts start with.
    pub prefixes: usize,
    /// Longest shared prefix, in tokens.
    pub max_prefix_tokens: usize,
    /// Longest unique suffix, in tokens.
    pub max_suffix_tokens: usize,
    /// Most tokens generated per request.
    pub max_decode_tokens: usize,
    /// Engine KV blocks (small enough to evict prefixes and preempt requests).
    pub gpu_blocks: usize,
    /// L1 size (per rank).
    pub cpu_size: ByteSize,
    /// Fraction of the chunks a step loads that vanish from one rank between lookup and load.
    pub load_failure_rate: f64,
    /// Tensor-parallel ranks, each with its own pool.
    pub tp_size: usize,
    /// Schedule step N+1 before step N's outcome is known (vLLM's `async_scheduling`).
    pub async_scheduling: bool,
    /// Random seed.
    pub seed: u64,
    /// The pool's configuration (lower tiers, timeouts, write-behind); L1 size, chunk size
    /// and layout are set from these settings and `run`'s arguments.
    pub pool: PoolConfig,
    /// Run until this much time has passed (then let the running requests finish) instead of
    /// stopping after `requests`; RSS is sampled after a warm-up and at the end.
    pub duration: Option<Duration>,
}

impl Default for SimSettings {
    fn default() -> Self {
        Self {
            requests: 2000,
            max_running: 16,
            prefixes: 8,
            max_prefix_tokens: 1024,
            max_suffix_tokens: 256,
            max_decode_tokens: 32,
            gpu_blocks: 384,
            cpu_size: ByteSize(16 << 20),
            load_failure_rate: 0.05,
            tp_size: 1,
            async_scheduling: false,
            seed: 1,
            pool: PoolConfig::default(),
            duration: None,
        }
    }
}

impl SimSettings {
    /// The pool configuration a run uses: `pool` with L1 size, chunk size and layout set.
    pub fn pool_config(&self, layout: KvLayout, chunk_size: usize) -> PoolConfig {
        let mut config = self.pool.clone();
        config.local_cpu.max_size = self.cpu_size;
        config.chunking.chunk_size = chunk_size;
        config.layout.num_layers = layout.num_layers;
        config.layout.num_kv_heads = layout.num_kv_heads;
        config.layout.head_size = layout.head_size;
        config.layout.dtype = layout.dtype;
        config.layout.block_size = layout.block_size;
        config
    }
}

/// What the simulation saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SimReport {
    /// Requests finished.
    pub requests: usize,
    /// Engine steps.
    pub steps: usize,
    /// Most requests scheduled in one step.
    pub max_requests_per_step: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens served by the engine's prefix cache.
    pub gpu_hit_tokens: usize,
    /// Tokens the pool promised and the engine accepted.
    pub pool_hit_tokens: usize,
    /// Loads the connector made asynchronous (the request waited for them).
    pub async_loads: usize,
    /// Requests whose blocks the connector held after they finished.
    pub held_requests: usize,
    /// Chunks removed from a rank's pool between lookup and load (injected failures).
    pub injected_failures: usize,
    /// Blocks whose synchronous load was sabotaged.
    pub sabotaged_blocks: usize,
    /// Blocks reported by the workers as failed loads.
    pub reported_failed_blocks: usize,
    /// Sabotaged blocks never reported: must be 0.
    pub unreported_failed_blocks: usize,
    /// Saved chunks the workers dropped before commit (computed on a failed load).
    pub saves_discarded: u64,
    /// Preemptions.
    pub preemptions: usize,
    /// Request ids used again after their request finished.
    pub reused_ids: usize,
    /// Tokens whose KV differs from recomputation when their request finished: must be 0.
    pub wrong_tokens: usize,
    /// Request states the scheduler, copies or staged saves the workers, or blocks the
    /// engine still held at the end: must be 0.
    pub leaked_request_states: usize,
    /// Seconds the run took.
    pub elapsed_seconds: f64,
    /// Anonymous resident memory (`RssAnon`) after the warm-up of a timed run (bytes): the
    /// median of the first window after it (see `RssSampler::growth_window_medians`).
    pub rss_after_warm_up_bytes: Option<u64>,
    /// Anonymous resident memory (`RssAnon`) at the end of a timed run (bytes): the median of
    /// its last window.
    pub rss_end_bytes: Option<u64>,
    /// Every 10 s of a timed run: (second, resident bytes, anonymous resident bytes, C heap
    /// bytes in use).
    pub rss_timeline: Vec<(u64, u64, u64, u64)>,
}
