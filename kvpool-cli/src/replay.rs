//! `kvpool replay`: replays a Mooncake trace against a pool of a given capacity and policy.

use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use kvpool_backends::build_pool;
use kvpool_core::{ByteSize, EvictionKind, EvictionPolicy, HostPagedKvCache, PoolConfig};

use crate::report::Table;
use crate::trace::{TRACE_BLOCK_TOKENS, TraceRequest};

/// Options of a replay.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// Pool capacity in tokens.
    pub capacity_tokens: u64,
    /// Eviction policy.
    pub policy: EvictionKind,
    /// Only simulate the index (no bytes moved).
    pub simulate: bool,
    /// KV layout used when moving real bytes.
    pub layout: kvpool_core::KvLayout,
    /// Show a progress bar.
    pub progress: bool,
}

/// Replay results.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    /// Requests replayed.
    pub requests: usize,
    /// Lines skipped as malformed.
    pub bad_lines: usize,
    /// Prompt tokens in all requests.
    pub input_tokens: u64,
    /// Prompt tokens served from the pool.
    pub hit_tokens: u64,
    /// hit_tokens / input_tokens.
    pub token_hit_rate: f64,
    /// Capacity in tokens.
    pub capacity_tokens: u64,
    /// Capacity in 512-token blocks.
    pub capacity_blocks: u64,
    /// Policy name.
    pub policy: String,
    /// `simulate` or `bytes`.
    pub mode: &'static str,
    /// Hit tokens per tier.
    pub hits_per_tier: Vec<(String, u64)>,
    /// Bytes moved (stored + loaded) when not simulating.
    pub bytes_moved: u64,
    /// Wall time of the replay.
    pub elapsed_seconds: f64,
}

impl ReplayReport {
    /// Human-readable table.
    pub fn render(&self) -> String {
        let mut t = Table::new(&["metric", "value"]);
        let rows: Vec<(&str, String)> = vec![
            ("mode", self.mode.to_string()),
            ("policy", self.policy.clone()),
            (
                "capacity",
                format!(
                    "{} tokens ({} blocks)",
                    self.capacity_tokens, self.capacity_blocks
                ),
            ),
            ("requests", self.requests.to_string()),
            ("bad lines skipped", self.bad_lines.to_string()),
            ("input tokens", self.input_tokens.to_string()),
            ("hit tokens", self.hit_tokens.to_string()),
            (
                "token hit rate",
                format!("{:.2}%", self.token_hit_rate * 100.0),
            ),
            ("bytes moved", ByteSize(self.bytes_moved).human()),
            ("elapsed", format!("{:.3} s", self.elapsed_seconds)),
        ];
        for (k, v) in rows {
            t.row(vec![k.into(), v]);
        }
        for (tier, hits) in &self.hits_per_tier {
            t.row(vec![format!("hit tokens in {tier}"), hits.to_string()]);
        }
        t.render()
    }
}

/// A request's prefix hit: consecutive leading blocks present, capped at its input length.
fn hit_tokens(leading_blocks: usize, r: &TraceRequest) -> u64 {
    (leading_blocks * TRACE_BLOCK_TOKENS).min(r.input_length) as u64
}

fn progress(total: usize, show: bool) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total as u64);
    pb.set_style(
        ProgressStyle::with_template(
            "{spinner} replay [{bar:40}] {pos}/{len} requests {per_sec} ETA {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    pb
}

/// Index-only replay: which blocks would be present, under the policy and capacity.
pub fn replay_simulated(
    requests: &[TraceRequest],
    opts: &ReplayOptions,
) -> (u64, Vec<(String, u64)>, u64) {
    let capacity_blocks = (opts.capacity_tokens / TRACE_BLOCK_TOKENS as u64) as usize;
    let block_bytes = TRACE_BLOCK_TOKENS;
    let mut policy: Box<dyn EvictionPolicy<u64>> = opts.policy.build(capacity_blocks * block_bytes);
    let mut present = std::collections::HashSet::<u64>::with_capacity(capacity_blocks.min(1 << 24));
    let pb = progress(requests.len(), opts.progress);
    let mut hits = 0u64;
    for r in requests {
        let leading = r
            .hash_ids
            .iter()
            .take_while(|h| present.contains(h))
            .count();
        hits += hit_tokens(leading, r);
        for h in &r.hash_ids {
            if present.contains(h) {
                policy.on_access(h);
                continue;
            }
            if capacity_blocks == 0 {
                continue;
            }
            while present.len() >= capacity_blocks {
                match policy.pop_victim(&mut |_| true) {
                    Some(v) => {
                        present.remove(&v);
                    }
                    None => break,
                }
            }
            present.insert(*h);
            policy.on_insert(*h, block_bytes);
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    (hits, vec![("cpu".to_string(), hits)], 0)
}

/// Replay that stores and loads real (synthetic) KV bytes through the cache engine.
pub async fn replay_with_bytes(
    requests: &[TraceRequest],
    opts: &ReplayOptions,
) -> anyhow::Result<(u64, Vec<(String, u64)>, u64)> {
    let layout = opts.layout;
    layout.validate()?;
    let block_bytes = layout.chunk_bytes(TRACE_BLOCK_TOKENS) as u64;
    let mut config = PoolConfig {
        layout: opts.layout,
        ..PoolConfig::default()
    };
    config.chunking.chunk_size = TRACE_BLOCK_TOKENS;
    config.local_cpu.eviction = opts.policy;
    config.local_cpu.max_size =
        ByteSize(opts.capacity_tokens / TRACE_BLOCK_TOKENS as u64 * block_bytes);
    config.write_behind.quota = ByteSize(block_bytes.max(config.write_behind.quota.0));
    let pool = build_pool(&config).await?;
    let engine = &pool.engine;
    let db = engine.token_database();
    let max_blocks = requests.iter().map(|r| r.hash_ids.len()).max().unwrap_or(0);
    let slots_needed = max_blocks * TRACE_BLOCK_TOKENS;
    let mut kv = HostPagedKvCache::new(layout, slots_needed.div_ceil(layout.block_size).max(1));
    let slots: Vec<i64> = (0..slots_needed as i64).collect();
    let pb = progress(requests.len(), opts.progress);
    let (mut hits, mut moved) = (0u64, 0u64);
    for r in requests {
        let ids: Vec<[u8; 8]> = r.hash_ids.iter().map(|h| h.to_le_bytes()).collect();
        let spans = db.process_block_hashes(&ids, TRACE_BLOCK_TOKENS, 0)?;
        let n = spans.len() * TRACE_BLOCK_TOKENS;
        let mut plan = engine
            .begin_retrieve_spans(&spans, 0, n, &slots[..n])
            .await?;
        let loaded = plan.loaded_tokens();
        plan.load_all(&mut kv)?;
        drop(plan); // release the loaded chunks so they can be evicted again
        hits += hit_tokens(loaded / TRACE_BLOCK_TOKENS, r);
        moved += (loaded * layout.bytes_per_token()) as u64;
        let mut store = engine.begin_store_spans(spans, n, &slots[..n]).await?;
        for layer in 0..layout.num_layers {
            store.save_layer(layer, &kv)?;
        }
        let report = store.finish().await?;
        moved += (report.stored_tokens * layout.bytes_per_token()) as u64;
        pb.inc(1);
    }
    pb.finish_and_clear();
    let stats = engine.storage().stats();
    let per_tier = stats
        .tiers
        .iter()
        .map(|t| (t.name.clone(), t.hit_tokens))
        .collect();
    engine.storage().close().await?;
    Ok((hits, per_tier, moved))
}

/// Runs a replay and builds its report.
pub async fn run(
    requests: &[TraceRequest],
    bad_lines: usize,
    opts: &ReplayOptions,
) -> anyhow::Result<ReplayReport> {
    let started = Instant::now();
    let (hit_tokens, hits_per_tier, bytes_moved) = if opts.simulate {
        replay_simulated(requests, opts)
    } else {
        replay_with_bytes(requests, opts).await?
    };
    let input_tokens: u64 = requests.iter().map(|r| r.input_length as u64).sum();
    Ok(ReplayReport {
        requests: requests.len(),
        bad_lines,
        input_tokens,
        hit_tokens,
        token_hit_rate: if input_tokens > 0 {
            hit_tokens as f64 / input_tokens as f64
        } else {
            0.0
        },
        capacity_tokens: opts.capacity_tokens,
        capacity_blocks: opts.capacity_tokens / TRACE_BLOCK_TOKENS as u64,
        policy: format!("{:?}", opts.policy).to_lowercase(),
        mode: if opts.simulate { "simulate" } else { "bytes" },
        hits_per_tier,
        bytes_moved,
        elapsed_seconds: started.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ids: &[u64], input_length: usize) -> TraceRequest {
        TraceRequest {
            timestamp: 0,
            input_length,
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    fn opts(capacity_blocks: u64, policy: EvictionKind, simulate: bool) -> ReplayOptions {
        ReplayOptions {
            capacity_tokens: capacity_blocks * TRACE_BLOCK_TOKENS as u64,
            policy,
            simulate,
            layout: kvpool_core::KvLayout {
                num_layers: 1,
                num_kv_heads: 1,
                head_size: 4,
                ..Default::default()
            },
            progress: false,
        }
    }

    fn trace() -> Vec<TraceRequest> {
        vec![
            req(&[1, 2, 3], 1500),
            req(&[1, 2, 4], 1200), // hits blocks 1,2 -> 1024
            req(&[1, 5], 600),     // hits 1 -> 512
            req(&[1, 2, 3], 1300), // capacity 4: LRU evicted 3 -> hits 1,2 -> 1024
            req(&[1, 2, 3], 1100), // all three present; capped at input 1100
        ]
    }

    #[test]
    fn simulated_hits_follow_prefix_and_capacity_rules() {
        let (hits, _, _) = replay_simulated(&trace(), &opts(4, EvictionKind::Lru, true));
        assert_eq!(hits, 1024 + 512 + 1024 + 1100);
    }

    #[tokio::test]
    async fn real_bytes_replay_agrees_with_the_simulation() {
        for policy in [EvictionKind::Lru, EvictionKind::Fifo, EvictionKind::S3fifo] {
            let (sim, _, _) = replay_simulated(&trace(), &opts(4, policy, true));
            let (real, tiers, moved) = replay_with_bytes(&trace(), &opts(4, policy, false))
                .await
                .unwrap();
            assert_eq!(sim, real, "{policy:?}");
            assert!(moved > 0 && tiers[0].0 == "cpu");
        }
    }
}
