//! The `kvpool` command: `serve`, `bench`, `replay`, `gen-trace`, `config`, and with the `sim`
//! feature (a source build's default; not in the Python package) `sim`. A library so that the
//! same command runs from the `kvpool` binary and from the Python package's `kvpool` entry
//! point ([`run_command_line`]).

mod bench;
#[cfg(feature = "sim")]
mod hostile;
mod replay;
mod report;
mod serve;
#[cfg(feature = "sim")]
mod sim;
mod trace;
mod workload;

use std::fs::File;
use std::io::{BufReader, BufWriter, IsTerminal};
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use tracing_subscriber::EnvFilter;

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
    /// Run the node's pool daemon: shared memory and lower tiers that every engine on the node
    /// attaches to (`"pool": "unix:///run/kvpool/kvpool.sock"`), until SIGTERM or SIGINT.
    Serve(serve::ServeArgs),
    /// Run a synthetic serving workload (shared system prompts, multi-turn chats) through the pool.
    ///
    /// Sessions take turns round-robin; between rounds, write-behind to lower tiers is drained
    /// (users think between turns), so lower tiers hold what a later round asks for.
    Bench(BenchArgs),
    /// Replay a Mooncake-format trace (JSONL) against a pool of a given capacity and policy.
    Replay(ReplayArgs),
    /// Write a synthetic trace in the Mooncake format.
    GenTrace(GenTraceArgs),
    /// Drive the connector the way vLLM does (several requests a step, shared prefix blocks,
    /// preemption, reused ids, loads failing at random) and check every KV row of every request
    /// against recomputation.
    #[cfg(feature = "sim")]
    Sim(sim::SimArgs),
    /// Show or check configuration.
    Config(ConfigArgs),
    /// An engine that attacks the pool daemon (garbage frames, key storms, forged commits,
    /// holes punched into its arena): for `cargo xtask soak --daemon`, never for production.
    #[cfg(feature = "sim")]
    #[command(hide = true)]
    HostileEngine(hostile::HostileArgs),
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

/// Serving metrics while a command runs.
#[derive(Args, Debug)]
struct MetricsArgs {
    /// Serve Prometheus metrics on this address while the command runs (e.g. 127.0.0.1:9464).
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Keep serving metrics this many seconds after the command finished (for a last scrape).
    #[arg(
        long,
        default_value_t = 0,
        value_name = "SECS",
        requires = "metrics_listen"
    )]
    metrics_linger: u64,
}

impl MetricsArgs {
    fn start(&self) -> anyhow::Result<()> {
        if let Some(addr) = self.metrics_listen {
            // Asked for on the command line, a taken port stops the command (a daemon or an
            // engine warns and runs on).
            if !kvpool_backends::serve_metrics(addr)? {
                anyhow::bail!("--metrics-listen {addr}: cannot listen there (the port is taken?)");
            }
            eprintln!("serving Prometheus metrics on http://{addr}/metrics");
        }
        Ok(())
    }

    fn linger(&self) {
        if self.metrics_listen.is_some() && self.metrics_linger > 0 {
            std::thread::sleep(std::time::Duration::from_secs(self.metrics_linger));
        }
    }
}

#[derive(Args, Debug)]
struct BenchArgs {
    #[command(flatten)]
    pool: PoolArgs,
    #[command(flatten)]
    metrics: MetricsArgs,
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
    #[command(flatten)]
    metrics: MetricsArgs,
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
    /// List the tier URL schemes this build knows, each with an example `[[tier]]`.
    #[arg(long)]
    schemes: bool,
}

/// The log level of a command when `KVPOOL_LOG` does not say: a daemon (`serve`) logs who
/// attaches and what it reclaims (`info`); the one-shot commands only warnings.
pub fn default_log_level(serve: bool) -> &'static str {
    if serve { "info" } else { "warn" }
}

/// Runs the `kvpool` command line `args` (the program name first) and returns the process's
/// exit code: 0 on success, 1 on an error (printed), 2 on a usage error (clap's). Installs a
/// `tracing` subscriber on stderr (`KVPOOL_LOG`) unless the process has one already.
pub fn run_command_line<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // `--help` and `--version` are "errors" that print to stdout and succeed.
            let _ = e.print();
            return e.exit_code();
        }
    };
    let default_level = default_log_level(matches!(cli.command, Command::Serve(_)));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("KVPOOL_LOG").unwrap_or_else(|_| EnvFilter::new(default_level)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
    match run(cli) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
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

fn run(cli: Cli) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let progress = std::io::stderr().is_terminal();
    match cli.command {
        Command::Serve(a) => serve::run(a, &rt)?,
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
            a.metrics.start()?;
            let report = rt.block_on(bench::run(&cfg, spec, progress && !a.json))?;
            print_report(&report, a.json, |r| r.render())?;
            a.metrics.linger();
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
                layout: kvpool_core::KvLayout {
                    num_layers: a.layers,
                    num_kv_heads: a.kv_heads,
                    head_size: a.head_size,
                    dtype: a.dtype,
                    ..kvpool_core::KvLayout::default()
                },
                progress: progress && !a.json,
            };
            a.metrics.start()?;
            let report = rt.block_on(replay::run(&requests, bad.len(), &opts))?;
            print_report(&report, a.json, |r| r.render())?;
            a.metrics.linger();
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
        #[cfg(feature = "sim")]
        Command::Sim(a) => sim::run_sim(a)?,
        #[cfg(feature = "sim")]
        Command::HostileEngine(a) => hostile::run(a, &rt)?,
        Command::Config(a) => {
            if a.print_default {
                print!("{}", PoolConfig::default_toml());
            } else if a.schemes {
                for (scheme, example) in kvpool_backends::registry::schemes() {
                    println!("{scheme:<16} {example}");
                }
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
