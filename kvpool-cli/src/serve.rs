//! `kvpool serve`: the node's pool daemon, until SIGTERM or SIGINT.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvpool_backends::daemon::{DaemonOptions, DaemonServer, PoolDaemon, SocketAccess};
use kvpool_backends::registry::open_connectors;
use kvpool_core::{ByteSize, EvictionKind, PoolConfig};
use tokio::runtime::Runtime;
use tokio::signal::unix::{SignalKind, signal};

/// Where the daemon listens unless told otherwise.
pub const DEFAULT_SOCKET: &str = "/run/kvpool/kvpool.sock";

/// How long a shutdown waits for writes to the lower tiers.
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// TOML configuration: `[local_cpu] max_size` is the node's shared memory, `[[tier]]`s
    /// the lower tiers, `[metrics] listen` the Prometheus endpoint.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The Unix socket engines attach to (`"pool": "unix://<this path>"` in vLLM's
    /// kv_connector_extra_config). Created owner-only (0600).
    #[arg(long, default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Also let this group attach (the socket becomes 0660, owned by the group).
    #[arg(long)]
    group: Option<String>,
    /// Shared memory for KV (e.g. 64GiB); overrides the config.
    #[arg(long)]
    cpu_size: Option<ByteSize>,
    /// Eviction policy: lru, fifo or s3fifo; overrides the config.
    #[arg(long)]
    policy: Option<EvictionKind>,
    /// Adds a lower tier by URL (repeatable), after those in the config.
    #[arg(long = "tier", value_name = "URL")]
    tiers: Vec<String>,
}

impl ServeArgs {
    /// The config with the command line's overrides, as every pool command reads it.
    fn load(&self) -> anyhow::Result<PoolConfig> {
        crate::PoolArgs {
            config: self.config.clone(),
            cpu_size: self.cpu_size,
            policy: self.policy,
            chunk_size: None,
            tiers: self.tiers.clone(),
        }
        .load()
    }
}

/// Runs the daemon until SIGTERM or SIGINT, then stops accepting, drains the writes to the
/// lower tiers and closes them.
pub fn run(args: ServeArgs, rt: &Runtime) -> anyhow::Result<()> {
    let cfg = args.load()?;
    if let Some(addr) = cfg.metrics.listen_addr()? {
        kvpool_backends::serve_metrics(addr)?;
        eprintln!("kvpool serve: Prometheus metrics on http://{addr}/metrics");
    }
    let options = DaemonOptions::from_config(&cfg)?;
    let tiers = rt
        .block_on(open_connectors(&cfg.tiers, options.capacity as u64))
        .context("cannot open the lower tiers")?;
    let daemon = Arc::new(
        PoolDaemon::with_tiers(options, tiers, rt.handle().clone())
            .context("cannot create the shared arena ([local_cpu] max_size)")?,
    );
    let access = match &args.group {
        Some(g) => SocketAccess::group(g)?,
        None => SocketAccess::default(),
    };
    let server = DaemonServer::bind(daemon.clone(), &args.socket, access).with_context(|| {
        format!(
            "cannot listen on {} (choose another path with --socket)",
            args.socket.display()
        )
    })?;
    let tiers: Vec<String> = cfg
        .tiers
        .iter()
        .map(|t| kvpool_core::redact_url(&t.url))
        .collect();
    eprintln!(
        "kvpool serve: {} of shared memory ({:?} eviction), lower tiers [{}], listening on {}",
        cfg.local_cpu.max_size.human(),
        cfg.local_cpu.eviction,
        tiers.join(", "),
        args.socket.display()
    );
    let signal_name = rt.block_on(async {
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = term.recv() => return Ok::<_, std::io::Error>("SIGTERM"),
                _ = int.recv() => return Ok("SIGINT"),
                _ = tick.tick() => daemon.record_metrics(),
            }
        }
    })?;
    eprintln!("kvpool serve: {signal_name}; draining writes to the lower tiers");
    server.shutdown();
    rt.block_on(daemon.close(DRAIN_LIMIT));
    let s = daemon.stats();
    eprintln!(
        "kvpool serve: stopped ({} values, {} commits, {} gets from memory, {} from lower tiers, {} misses)",
        s.entries, s.commits, s.memory_hits, s.tier_hits, s.misses
    );
    Ok(())
}
