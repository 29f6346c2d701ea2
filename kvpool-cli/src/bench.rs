//! `kvpool bench`: a synthetic serving workload through the cache engine, with a summary.

use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use serde::Serialize;

use kvpool_backends::build_pool;
use kvpool_core::{ByteSize, HostPagedKvCache, PoolConfig};

use crate::report::{Latency, Table, gbps};
use crate::workload::{Workload, WorkloadSpec};

/// One data-moving operation's totals.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct OpReport {
    /// Bytes moved.
    pub bytes: u64,
    /// Time spent in the calls.
    pub seconds: f64,
    /// bytes / seconds, in GB/s.
    pub gbps: f64,
    /// Per-request latency.
    pub latency: Latency,
}

/// One tier's activity.
#[derive(Debug, Clone, Serialize)]
pub struct TierReport {
    /// Tier name.
    pub name: String,
    /// Chunks served.
    pub hit_chunks: u64,
    /// Tokens served.
    pub hit_tokens: u64,
    /// Retrieve throughput of the chunks this tier served (GB/s): bytes over the wall time of
    /// the retrieve calls, each call's time split between tiers by the tokens they served.
    pub retrieve_gbps: f64,
    /// Store throughput into this tier (GB/s): for L1, stored bytes over store-call wall time
    /// (gather from the paged cache included); for write-behind tiers, bytes over the time
    /// spent in their background put calls.
    pub store_gbps: f64,
    /// Entries evicted.
    pub evictions: u64,
    /// Bytes held at the end.
    pub bytes_held: u64,
    /// Capacity, if bounded.
    pub capacity: Option<u64>,
    /// Write-behind entries dropped.
    pub dropped_writes: u64,
}

/// The bench summary (`--json` prints this).
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Workload shape.
    pub workload: WorkloadSpec,
    /// Layout description.
    pub layout: String,
    /// Bytes per token.
    pub bytes_per_token: usize,
    /// L1 size.
    pub cpu_pool_bytes: u64,
    /// Requests run.
    pub requests: usize,
    /// Prompt tokens across requests.
    pub prompt_tokens: u64,
    /// Tokens the lookups reported as cached.
    pub hit_tokens: u64,
    /// hit_tokens / prompt_tokens.
    pub token_hit_rate: f64,
    /// Tokens loaded instead of recomputed.
    pub prefill_tokens_saved: u64,
    /// Tokens stored.
    pub stored_tokens: u64,
    /// Lookup latency.
    pub lookup: Latency,
    /// Store totals.
    pub store: OpReport,
    /// Retrieve totals.
    pub retrieve: OpReport,
    /// Per-tier activity.
    pub tiers: Vec<TierReport>,
    /// Wall time.
    pub elapsed_seconds: f64,
}

impl BenchReport {
    /// Human-readable tables.
    pub fn render(&self) -> String {
        let mut s = Table::new(&["summary", "value"]);
        for (k, v) in [
            ("layout", self.layout.clone()),
            ("cpu pool", ByteSize(self.cpu_pool_bytes).human()),
            ("requests", self.requests.to_string()),
            ("prompt tokens", self.prompt_tokens.to_string()),
            (
                "token hit rate",
                format!("{:.2}%", self.token_hit_rate * 100.0),
            ),
            (
                "prefill tokens saved",
                self.prefill_tokens_saved.to_string(),
            ),
            ("tokens stored", self.stored_tokens.to_string()),
            ("elapsed", format!("{:.2} s", self.elapsed_seconds)),
        ] {
            s.row(vec![k.into(), v]);
        }
        let mut ops = Table::new(&["operation", "GB/s", "p50 (us)", "p99 (us)", "calls"]);
        let lat = |l: &Latency| {
            (
                format!("{:.0}", l.p50_us),
                format!("{:.0}", l.p99_us),
                l.count.to_string(),
            )
        };
        let (p50, p99, n) = lat(&self.lookup);
        ops.row(vec!["lookup".into(), "-".into(), p50, p99, n]);
        for (name, op) in [("store", &self.store), ("retrieve", &self.retrieve)] {
            let (p50, p99, n) = lat(&op.latency);
            ops.row(vec![name.into(), format!("{:.2}", op.gbps), p50, p99, n]);
        }
        let mut tiers = Table::new(&[
            "tier",
            "hit tokens",
            "retrieve GB/s",
            "store GB/s",
            "evictions",
            "held",
            "capacity",
        ]);
        for t in &self.tiers {
            tiers.row(vec![
                t.name.clone(),
                t.hit_tokens.to_string(),
                format!("{:.2}", t.retrieve_gbps),
                format!("{:.2}", t.store_gbps),
                t.evictions.to_string(),
                ByteSize(t.bytes_held).human(),
                t.capacity.map_or("-".into(), |c| ByteSize(c).human()),
            ]);
        }
        format!("{}\n\n{}\n\n{}", s.render(), ops.render(), tiers.render())
    }
}

/// A random block table: the engine's pages for one request, in shuffled order.
fn slot_mapping(
    tokens: usize,
    block_size: usize,
    num_blocks: usize,
    rng: &mut SmallRng,
) -> Vec<i64> {
    let mut blocks: Vec<usize> = (0..num_blocks).collect();
    blocks.shuffle(rng);
    (0..tokens)
        .map(|i| (blocks[i / block_size] * block_size + i % block_size) as i64)
        .collect()
}

/// Runs the workload against a pool built from `config`.
pub async fn run(
    config: &PoolConfig,
    spec: WorkloadSpec,
    show_progress: bool,
) -> anyhow::Result<BenchReport> {
    let pool = build_pool(config).await?;
    let engine = pool.engine.clone();
    let layout = *engine.layout();
    let bpt = layout.bytes_per_token();
    let num_blocks = spec.max_prompt_tokens().div_ceil(layout.block_size);
    let mut kv = HostPagedKvCache::new(layout, num_blocks);
    let mut rng = SmallRng::seed_from_u64(spec.seed ^ 0x5eed);
    let pb = if show_progress {
        let pb = ProgressBar::new(spec.requests() as u64);
        pb.set_style(
            ProgressStyle::with_template(
                "{spinner} bench [{bar:40}] {pos}/{len} requests {per_sec} ETA {eta} {msg}",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        pb
    } else {
        ProgressBar::hidden()
    };
    let (mut lookup_lat, mut store_lat, mut retrieve_lat) = (Vec::new(), Vec::new(), Vec::new());
    let (mut store_secs, mut retrieve_secs) = (0.0, 0.0);
    let (mut prompt_tokens, mut hit_tokens, mut saved, mut stored) = (0u64, 0u64, 0u64, 0u64);
    let tier_count = engine.storage().tier_count();
    let mut tier_retrieve_secs = vec![0.0f64; tier_count];
    let mut tier_tokens_before: Vec<u64> = vec![0; tier_count];
    let started = Instant::now();
    for (i, tokens) in Workload::new(spec).enumerate() {
        // A new round of turns: users read and type between turns, so the previous round's
        // write-behind has landed in the lower tiers before the next begins.
        if i > 0 && i % spec.sessions == 0 {
            engine.storage().flush().await?;
        }
        let slots = slot_mapping(tokens.len(), layout.block_size, num_blocks, &mut rng);
        prompt_tokens += tokens.len() as u64;

        let t = Instant::now();
        let hit = engine.lookup(&tokens).await?;
        lookup_lat.push(t.elapsed().as_secs_f64());
        hit_tokens += hit as u64;

        if hit > 0 {
            let t = Instant::now();
            let loaded = engine.retrieve(&tokens, None, &mut kv, &slots).await?;
            let secs = t.elapsed().as_secs_f64();
            retrieve_lat.push(secs);
            retrieve_secs += secs;
            let loaded_tokens = loaded.iter().filter(|m| **m).count() as u64;
            saved += loaded_tokens;
            // Split this call's time between the tiers by the tokens each served.
            let now: Vec<u64> = engine
                .storage()
                .stats()
                .tiers
                .iter()
                .map(|t| t.hit_tokens)
                .collect();
            for (t, (after, before)) in now.iter().zip(&mut tier_tokens_before).enumerate() {
                if loaded_tokens > 0 {
                    tier_retrieve_secs[t] += secs * (after - *before) as f64 / loaded_tokens as f64;
                }
                *before = *after;
            }
        }
        // The engine would now prefill the remaining tokens into `kv`; kvpool stores them.
        let t = Instant::now();
        let report = engine.store(&tokens, None, &kv, &slots).await?;
        let secs = t.elapsed().as_secs_f64();
        store_lat.push(secs);
        store_secs += secs;
        stored += report.stored_tokens as u64;
        pb.set_message(format!(
            "hit rate {:.1}%",
            100.0 * hit_tokens as f64 / prompt_tokens as f64
        ));
        pb.inc(1);
    }
    engine.storage().flush().await?;
    let elapsed = started.elapsed().as_secs_f64();
    pb.finish_and_clear();
    let stats = engine.storage().stats();
    engine.storage().close().await?;
    let op = |bytes: u64, seconds: f64, lat: &mut Vec<f64>| OpReport {
        bytes,
        seconds,
        gbps: gbps(bytes, seconds),
        latency: Latency::from_seconds(lat),
    };
    Ok(BenchReport {
        workload: spec,
        layout: format!(
            "{} layers x {} kv heads x {} dims, {}, {:?}",
            layout.num_layers, layout.num_kv_heads, layout.head_size, layout.dtype, layout.kind
        ),
        bytes_per_token: bpt,
        cpu_pool_bytes: config.local_cpu.max_size.0,
        requests: spec.requests(),
        prompt_tokens,
        hit_tokens,
        token_hit_rate: if prompt_tokens > 0 {
            hit_tokens as f64 / prompt_tokens as f64
        } else {
            0.0
        },
        prefill_tokens_saved: saved,
        stored_tokens: stored,
        lookup: Latency::from_seconds(&mut lookup_lat),
        store: op(stored * bpt as u64, store_secs, &mut store_lat),
        retrieve: op(saved * bpt as u64, retrieve_secs, &mut retrieve_lat),
        tiers: stats
            .tiers
            .iter()
            .enumerate()
            .map(|(i, t)| TierReport {
                name: t.name.clone(),
                hit_chunks: t.hit_chunks,
                hit_tokens: t.hit_tokens,
                retrieve_gbps: gbps(t.hit_tokens * bpt as u64, tier_retrieve_secs[i]),
                store_gbps: if i == 0 && pool.l1.is_some() {
                    gbps(stored * bpt as u64, store_secs)
                } else {
                    gbps(t.bytes_written, t.write_seconds)
                },
                evictions: t.backend.evictions,
                bytes_held: t.backend.bytes,
                capacity: t.backend.capacity_bytes,
                dropped_writes: t.dropped_writes,
            })
            .collect(),
        elapsed_seconds: elapsed,
    })
}
