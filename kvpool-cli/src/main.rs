//! The `kvpool` command: `bench`, `replay`, `gen-trace` and `config`.

mod bench;
mod replay;
mod report;
mod trace;
mod workload;

use std::fs::File;
use std::io::{BufReader, BufWriter, IsTerminal};
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use kvpool_core::config::LayoutConfig;
use kvpool_core::{ByteSize, Dtype, EvictionKind, PoolConfig};

/// kvpool: a KV-cache pool for LLM inference.
#[derive(Parser, Debug)]
#[command(name = "kvpool", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a synthetic serving workload (shared system prompts, multi-turn chats) through the pool.
    Bench(BenchArgs),
    /// Replay a Mooncake-format trace (JSONL) against a pool of a given capacity and policy.
    Replay(ReplayArgs),
    /// Write a synthetic trace in the Mooncake format.
    GenTrace(GenTraceArgs),
    /// Simulate an engine (scheduler + worker over serialized connector metadata) on the pool,
    /// checking every loaded KV byte against recomputation.
    Sim(SimArgs),
    /// Show or check configuration.
    Config(ConfigArgs),
}

#[derive(Args, Debug)]
struct SimArgs {
    /// Requests.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Distinct shared prefixes.
    #[arg(long, default_value_t = 6)]
    prefixes: usize,
    /// Longest shared prefix, in tokens.
    #[arg(long, default_value_t = 512)]
    max_prefix_tokens: usize,
    /// Longest unique suffix, in tokens.
    #[arg(long, default_value_t = 128)]
    max_suffix_tokens: usize,
    /// GPU KV blocks (16 tokens each); small enough that the GPU prefix cache loses prefixes.
    #[arg(long, default_value_t = 64)]
    gpu_blocks: usize,
    /// L1 CPU pool size.
    #[arg(long, default_value = "64MiB")]
    cpu_size: ByteSize,
    /// Add a memory:// tier below L1.
    #[arg(long)]
    lower_tier: bool,
    /// With --lower-tier: fail every 3rd batch get and corrupt every 4th stored value.
    #[arg(long)]
    inject_failures: bool,
    /// Lazy offload: save chunks only when the GPU is about to reuse their blocks.
    #[arg(long)]
    lazy: bool,
    /// Random seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print one line per request.
    #[arg(long)]
    timeline: bool,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct PoolArgs {
    /// TOML configuration file (see `kvpool config --print-default`).
    #[arg(long)]
    config: Option<PathBuf>,
    /// L1 CPU pool size (e.g. 2GiB); overrides the config.
    #[arg(long)]
    cpu_size: Option<ByteSize>,
    /// Eviction policy: lru, fifo or s3fifo; overrides the config.
    #[arg(long)]
    policy: Option<EvictionKind>,
    /// Tokens per chunk; overrides the config.
    #[arg(long)]
    chunk_size: Option<usize>,
    /// Adds a lower tier by URL (repeatable), after those in the config: file:///path (build
    /// with --features disk), redis://host:port (--features redis), memory://.
    #[arg(long = "tier", value_name = "URL")]
    tiers: Vec<String>,
}

impl PoolArgs {
    fn load(&self) -> anyhow::Result<PoolConfig> {
        let mut cfg = match &self.config {
            Some(path) => PoolConfig::from_file(path)?,
            None => PoolConfig::default(),
        };
        if let Some(s) = self.cpu_size {
            cfg.local_cpu.max_size = s;
        }
        if let Some(p) = self.policy {
            cfg.local_cpu.eviction = p;
        }
        if let Some(c) = self.chunk_size {
            cfg.chunking.chunk_size = c;
        }
        cfg.tiers
            .extend(self.tiers.iter().map(kvpool_core::TierConfig::new));
        cfg.validate()?;
        Ok(cfg)
    }
}

#[derive(Args, Debug)]
struct BenchArgs {
    #[command(flatten)]
    pool: PoolArgs,
    /// Distinct system prompts.
    #[arg(long, default_value_t = 8)]
    system_prompts: usize,
    /// Tokens per system prompt.
    #[arg(long, default_value_t = 2048)]
    system_prompt_tokens: usize,
    /// Chat sessions.
    #[arg(long, default_value_t = 48)]
    sessions: usize,
    /// Turns per session.
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// New user tokens per turn.
    #[arg(long, default_value_t = 256)]
    user_tokens: usize,
    /// Output tokens per turn.
    #[arg(long, default_value_t = 256)]
    output_tokens: usize,
    /// Random seed.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct ReplayArgs {
    /// Trace file (JSONL: timestamp, input_length, output_length, hash_ids).
    #[arg(long)]
    trace: PathBuf,
    /// Pool capacity in tokens.
    #[arg(long, default_value_t = 4_000_000)]
    capacity_tokens: u64,
    /// Eviction policy: lru, fifo or s3fifo.
    #[arg(long, default_value = "lru")]
    policy: EvictionKind,
    /// Only simulate which blocks are present; move no bytes.
    #[arg(long)]
    simulate: bool,
    /// Layers of the synthetic KV when moving bytes.
    #[arg(long, default_value_t = 1)]
    layers: usize,
    /// KV heads of the synthetic KV when moving bytes.
    #[arg(long, default_value_t = 1)]
    kv_heads: usize,
    /// Head size of the synthetic KV when moving bytes.
    #[arg(long, default_value_t = 32)]
    head_size: usize,
    /// Dtype of the synthetic KV when moving bytes.
    #[arg(long, default_value = "f16")]
    dtype: Dtype,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct GenTraceArgs {
    /// Output file.
    #[arg(long)]
    out: PathBuf,
    /// Requests.
    #[arg(long, default_value_t = 12_000)]
    requests: usize,
    /// Shared documents.
    #[arg(long, default_value_t = 2_000)]
    documents: usize,
    /// Zipf exponent of document popularity.
    #[arg(long, default_value_t = 0.9)]
    zipf: f64,
    /// Random seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Args, Debug)]
#[group(required = true, multiple = false)]
struct ConfigArgs {
    /// Print the default configuration as TOML.
    #[arg(long)]
    print_default: bool,
    /// Validate a configuration file.
    #[arg(long, value_name = "FILE")]
    check: Option<PathBuf>,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("KVPOOL_LOG").unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Prints a report as pretty JSON or as its human-readable rendering.
fn print_report<R: serde::Serialize>(
    report: &R,
    json: bool,
    render: impl Fn(&R) -> String,
) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        println!("{}", render(report));
    }
    Ok(())
}

/// The `kvpool sim` summary and, optionally, its per-request timeline.
fn render_sim(r: &kvpool_connector::simulator::SimReport, timeline: bool) -> String {
    let mut t = report::Table::new(&["simulation", "value"]);
    for (k, v) in [
        ("requests", r.requests.to_string()),
        ("prompt tokens", r.prompt_tokens.to_string()),
        ("GPU prefix-cache hit tokens", r.gpu_hit_tokens.to_string()),
        (
            "prefill tokens saved (loaded from kvpool)",
            r.prefill_tokens_saved.to_string(),
        ),
        ("tokens computed", r.computed_tokens.to_string()),
        ("tokens stored to kvpool", r.stored_tokens.to_string()),
        (
            "failed-load blocks (recomputed)",
            r.failed_blocks.to_string(),
        ),
        (
            "KV rows differing from recomputation",
            r.mismatched_rows.to_string(),
        ),
        (
            "leaks (GPU blocks, requests, CPU regions)",
            format!("{:?}", r.leaks),
        ),
    ] {
        t.row(vec![k.into(), v]);
    }
    let mut out = t.render();
    if timeline {
        let mut steps = report::Table::new(&[
            "request",
            "prompt",
            "GPU hit",
            "pool hit",
            "computed",
            "failed blocks",
        ]);
        for o in &r.timeline {
            steps.row(vec![
                o.req_id.clone(),
                o.prompt_tokens.to_string(),
                o.gpu_hit_tokens.to_string(),
                o.pool_hit_tokens.to_string(),
                o.computed_tokens.to_string(),
                o.failed_blocks.to_string(),
            ]);
        }
        out.push_str("\n\n");
        out.push_str(&steps.render());
    }
    out
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let progress = std::io::stderr().is_terminal();
    match cli.command {
        Command::Bench(a) => {
            let cfg = a.pool.load()?;
            let spec = workload::WorkloadSpec {
                system_prompts: a.system_prompts,
                system_prompt_tokens: a.system_prompt_tokens,
                sessions: a.sessions,
                turns: a.turns,
                user_tokens: a.user_tokens,
                output_tokens: a.output_tokens,
                seed: a.seed,
            };
            anyhow::ensure!(
                spec.requests() > 0,
                "--sessions and --turns must be at least 1"
            );
            let report = rt.block_on(bench::run(&cfg, spec, progress && !a.json))?;
            print_report(&report, a.json, |r| r.render())?;
        }
        Command::Replay(a) => {
            let file = File::open(&a.trace)
                .with_context(|| format!("cannot open trace `{}`", a.trace.display()))?;
            let (requests, bad) = trace::read_trace(BufReader::new(file))
                .with_context(|| format!("cannot read trace `{}`", a.trace.display()))?;
            for b in bad.iter().take(20) {
                eprintln!(
                    "warning: {}:{}: skipping bad line: {}",
                    a.trace.display(),
                    b.line,
                    b.error
                );
            }
            if bad.len() > 20 {
                eprintln!("warning: {} more bad lines skipped", bad.len() - 20);
            }
            anyhow::ensure!(
                !requests.is_empty(),
                "no usable requests in `{}`",
                a.trace.display()
            );
            let opts = replay::ReplayOptions {
                capacity_tokens: a.capacity_tokens,
                policy: a.policy,
                simulate: a.simulate,
                layout: LayoutConfig {
                    num_layers: a.layers,
                    num_kv_heads: a.kv_heads,
                    head_size: a.head_size,
                    dtype: a.dtype,
                    ..LayoutConfig::default()
                },
                progress: progress && !a.json,
            };
            let report = rt.block_on(replay::run(&requests, bad.len(), &opts))?;
            print_report(&report, a.json, |r| r.render())?;
        }
        Command::GenTrace(a) => {
            let file = File::create(&a.out)
                .with_context(|| format!("cannot create `{}`", a.out.display()))?;
            let spec = trace::TraceSpec {
                requests: a.requests,
                documents: a.documents,
                zipf: a.zipf,
                seed: a.seed,
            };
            let tokens = trace::generate_trace(spec, BufWriter::new(file))?;
            println!(
                "wrote {} requests ({tokens} input tokens) to {}",
                a.requests,
                a.out.display()
            );
        }
        Command::Sim(a) => {
            let layout = kvpool_core::KvLayout::new(
                4,
                4,
                64,
                Dtype::F16,
                kvpool_core::KvKind::KeyValue,
                16,
            )?;
            let config = kvpool_connector::simulator::SimConfig {
                layout,
                chunk_size: 64,
                gpu_blocks: a.gpu_blocks,
                cpu_pool_bytes: a.cpu_size.as_usize(),
                lower_tier: a.lower_tier || a.inject_failures,
                inject_failures: a.inject_failures.then_some((3, 4)),
                offload: if a.lazy {
                    kvpool_connector::OffloadMode::Lazy
                } else {
                    kvpool_connector::OffloadMode::Eager
                },
            };
            let workload = kvpool_connector::simulator::Workload {
                requests: a.requests,
                prefixes: a.prefixes,
                max_prefix_tokens: a.max_prefix_tokens,
                max_suffix_tokens: a.max_suffix_tokens,
                seed: a.seed,
            };
            let report = kvpool_connector::simulator::run(&config, &workload)?;
            print_report(&report, a.json, |r| render_sim(r, a.timeline))?;
            anyhow::ensure!(
                report.mismatched_rows == 0,
                "{} KV rows differ from recomputation",
                report.mismatched_rows
            );
            anyhow::ensure!(
                report.leaks == (0, 0, 0),
                "leaks at the end: {:?}",
                report.leaks
            );
        }
        Command::Config(a) => {
            if a.print_default {
                print!("{}", PoolConfig::default_toml());
            } else if let Some(path) = a.check {
                let cfg = PoolConfig::from_file(&path)?;
                println!(
                    "{}: ok ({} per chunk, L1 {})",
                    path.display(),
                    ByteSize(cfg.chunk_bytes()? as u64),
                    cfg.local_cpu.max_size
                );
            }
        }
    }
    Ok(())
}
