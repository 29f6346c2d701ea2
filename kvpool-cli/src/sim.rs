//! `kvpool sim` (the `sim` feature): the vLLM-shaped simulator run from the command line, and
//! with `--soak-minutes` the soak's checks after it.

use std::path::PathBuf;

use clap::Args;

use kvpool_core::{ByteSize, Dtype, PoolConfig};

use crate::report;

#[derive(Args, Debug)]
pub(crate) struct SimArgs {
    /// Requests to run to completion.
    #[arg(long, default_value_t = 2000)]
    requests: usize,
    /// Most requests running at once (vLLM's max_num_seqs).
    #[arg(long, default_value_t = 16)]
    max_running: usize,
    /// Distinct shared prefixes.
    #[arg(long, default_value_t = 8)]
    prefixes: usize,
    /// Longest shared prefix, in tokens.
    #[arg(long, default_value_t = 1024)]
    max_prefix_tokens: usize,
    /// Longest unique suffix, in tokens.
    #[arg(long, default_value_t = 256)]
    max_suffix_tokens: usize,
    /// Most tokens generated per request.
    #[arg(long, default_value_t = 32)]
    max_decode_tokens: usize,
    /// GPU KV blocks (16 tokens each); small enough to evict prefixes and preempt requests.
    #[arg(long, default_value_t = 384)]
    gpu_blocks: usize,
    /// L1 CPU pool size.
    #[arg(long, default_value = "16MiB")]
    cpu_size: ByteSize,
    /// Fraction of the chunks a step loads that vanish from one rank between lookup and load.
    #[arg(long, default_value_t = 0.05)]
    load_failure_rate: f64,
    /// Tensor-parallel ranks, each with its own pool.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Schedule each step before the last one's outcome is known (vLLM's async_scheduling).
    #[arg(long)]
    async_scheduling: bool,
    /// Random seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// TOML configuration of the pool (lower tiers, timeouts); --cpu-size still sets L1.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Adds a lower tier by URL (repeatable), after those in the config.
    #[arg(long = "tier", value_name = "URL")]
    tiers: Vec<String>,
    /// Soak: run for this many minutes instead of --requests, then check that writes
    /// acknowledged afterwards come back intact from every lower tier, and that anonymous
    /// resident memory (RssAnon) at the end is within --max-rss-growth of its value after
    /// the warm-up.
    #[arg(long, value_name = "MINUTES")]
    soak_minutes: Option<f64>,
    /// Soak: seconds to wait before the acknowledged-writes check (time for a fault injector
    /// to stop and for servers to come back).
    #[arg(long, default_value_t = 5, requires = "soak_minutes")]
    calm_wait_secs: u64,
    /// Soak: largest allowed growth of anonymous resident memory from the warm-up to the end.
    #[arg(long, default_value_t = 0.05, requires = "soak_minutes")]
    max_rss_growth: f64,
    /// Soak: bytes of anonymous resident memory allowed on top of --max-rss-growth (glibc's
    /// retained free pages swing by a few MiB on a ~20 MiB process; docs/reliability.md).
    #[arg(long, default_value = "0B", requires = "soak_minutes")]
    rss_slack: ByteSize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// The `kvpool sim` summary.
fn render_sim(r: &kvpool_sim::vllm_shaped::SimReport) -> String {
    let mut t = report::Table::new(&["simulation", "value"]);
    for (k, v) in [
        ("requests", r.requests),
        ("engine steps", r.steps),
        ("most requests in one step", r.max_requests_per_step),
        ("prompt tokens", r.prompt_tokens),
        ("GPU prefix-cache hit tokens", r.gpu_hit_tokens),
        ("tokens loaded from kvpool", r.pool_hit_tokens),
        ("asynchronous loads", r.async_loads),
        ("requests held for their copies", r.held_requests),
        ("preemptions", r.preemptions),
        ("request ids reused", r.reused_ids),
        ("chunks lost between lookup and load", r.injected_failures),
        ("blocks reported as failed loads", r.reported_failed_blocks),
        (
            "saved chunks dropped before commit",
            r.saves_discarded as usize,
        ),
        (
            "lost blocks not reported (must be 0)",
            r.unreported_failed_blocks,
        ),
        ("wrong tokens (must be 0)", r.wrong_tokens),
        ("leaked request states (must be 0)", r.leaked_request_states),
    ] {
        t.row(vec![k.into(), v.to_string()]);
    }
    t.render()
}

/// `kvpool sim`, and with --soak-minutes the soak's checks after it.
pub(crate) fn run_sim(a: SimArgs) -> anyhow::Result<()> {
    let layout =
        kvpool_core::KvLayout::new(2, 2, 8, Dtype::F16, kvpool_core::KvKind::KeyValue, 16)?;
    let mut pool = match &a.config {
        Some(path) => PoolConfig::from_file(path)?,
        None => PoolConfig::default(),
    };
    pool.tiers
        .extend(a.tiers.iter().map(kvpool_core::TierConfig::new));
    let duration = a
        .soak_minutes
        .map(|m| std::time::Duration::from_secs_f64(m.max(0.0) * 60.0));
    let settings = kvpool_sim::vllm_shaped::SimSettings {
        requests: if duration.is_some() {
            usize::MAX
        } else {
            a.requests
        },
        max_running: a.max_running,
        prefixes: a.prefixes,
        max_prefix_tokens: a.max_prefix_tokens,
        max_suffix_tokens: a.max_suffix_tokens,
        max_decode_tokens: a.max_decode_tokens,
        gpu_blocks: a.gpu_blocks,
        cpu_size: a.cpu_size,
        load_failure_rate: a.load_failure_rate.clamp(0.0, 1.0),
        tp_size: a.tp.max(1),
        async_scheduling: a.async_scheduling,
        seed: a.seed,
        pool,
        duration,
    };
    const CHUNK_TOKENS: usize = 64;
    settings
        .pool_config(layout, CHUNK_TOKENS)
        .validate()
        .map_err(anyhow::Error::from)?;
    let report = kvpool_sim::vllm_shaped::run(&settings, layout, CHUNK_TOKENS)?;
    let durability = match duration {
        Some(_) => {
            std::thread::sleep(std::time::Duration::from_secs(a.calm_wait_secs));
            kvpool_sim::soak::check_acknowledged_writes(
                &settings.pool_config(layout, CHUNK_TOKENS),
                layout,
                32,
                4,
                a.seed,
            )?
        }
        None => Vec::new(),
    };
    if a.json {
        let mut json = serde_json::to_value(&report)?;
        json["acknowledged_writes"] = serde_json::to_value(&durability)?;
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        println!("{}", render_sim(&report));
        if duration.is_some() {
            println!("{}", render_durability(&report, &durability));
        }
    }
    anyhow::ensure!(
        report.wrong_tokens == 0,
        "{} wrong tokens",
        report.wrong_tokens
    );
    anyhow::ensure!(
        report.leaked_request_states == 0 && report.unreported_failed_blocks == 0,
        "{} leaked request states, {} unreported failed blocks",
        report.leaked_request_states,
        report.unreported_failed_blocks
    );
    for t in &durability {
        anyhow::ensure!(
            t.lost_chunks == 0 && t.wrong_rows == 0,
            "{}: {} of {} acknowledged chunks lost, {} wrong rows",
            t.tier,
            t.lost_chunks,
            t.acknowledged_chunks,
            t.wrong_rows
        );
    }
    if let (Some(warm), Some(end)) = (report.rss_after_warm_up_bytes, report.rss_end_bytes) {
        let limit = warm as f64 * (1.0 + a.max_rss_growth) + a.rss_slack.0 as f64;
        anyhow::ensure!(
            end as f64 <= limit,
            "anonymous resident memory grew from {} after the warm-up to {} at the end (limit {})",
            ByteSize(warm),
            ByteSize(end),
            ByteSize(limit as u64)
        );
    }
    Ok(())
}

fn render_durability(
    r: &kvpool_sim::vllm_shaped::SimReport,
    tiers: &[kvpool_sim::soak::TierDurability],
) -> String {
    let mut t = report::Table::new(&["soak", "value"]);
    let bytes = |b: Option<u64>| b.map_or("n/a".to_string(), |b| ByteSize(b).to_string());
    t.row(vec![
        "elapsed".into(),
        format!("{:.0} s", r.elapsed_seconds),
    ]);
    t.row(vec![
        "anonymous RSS after warm-up".into(),
        bytes(r.rss_after_warm_up_bytes),
    ]);
    t.row(vec![
        "anonymous RSS at the end".into(),
        bytes(r.rss_end_bytes),
    ]);
    for d in tiers {
        t.row(vec![
            format!("{}: acknowledged chunks lost (must be 0)", d.tier),
            format!("{} of {}", d.lost_chunks, d.acknowledged_chunks),
        ]);
        t.row(vec![
            format!("{}: wrong rows read back (must be 0)", d.tier),
            d.wrong_rows.to_string(),
        ]);
    }
    t.render()
}
