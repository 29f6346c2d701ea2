//! `kvpool serve`: the node's pool daemon, until SIGTERM or SIGINT.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvpool_backends::daemon::{
    DEFAULT_TENANT, DaemonOptions, DaemonServer, NamespacedConnector, PoolDaemon, SocketAccess,
};
use kvpool_backends::registry::open_connectors;
use kvpool_core::storage::remote::RemoteConnector;
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

/// `daemon` with the writes to its disk tiers on the process's low-priority runtime, under
/// `[write_behind] low_priority` (on by default): the daemon shares its host with the engines,
/// whose compute must not wait for encoding and writing values to disk. Its tiers are
/// `cfg.tiers`, in order (a tenant's views of them too).
fn writing_disk_tiers_at_low_priority(
    mut daemon: PoolDaemon,
    cfg: &PoolConfig,
    rt: &Runtime,
) -> PoolDaemon {
    for (i, tier) in cfg.tiers.iter().enumerate() {
        if let Some(runtime) =
            kvpool_backends::background::write_behind_runtime_for(cfg, tier, rt.handle())
        {
            daemon = daemon.write_tier_behind_on(i, runtime);
        }
    }
    daemon
}

/// Where a daemon's settings come from, for its errors: the option sizing its arena and how
/// to choose another socket.
struct SettingsFrom {
    arena: &'static str,
    socket: &'static str,
}

/// A daemon with `options` over `tiers` (the lower tiers, or a tenant's views of them), its
/// disk tiers written at low priority, and its socket bound at `socket` for the engines that
/// may attach (the owner, and `group`'s members when given).
fn start_daemon(
    options: DaemonOptions,
    tiers: Vec<Arc<dyn RemoteConnector>>,
    cfg: &PoolConfig,
    rt: &Runtime,
    socket: &std::path::Path,
    group: Option<&str>,
    from: SettingsFrom,
) -> anyhow::Result<(Arc<PoolDaemon>, DaemonServer)> {
    let arena = ByteSize(options.capacity as u64).human();
    let daemon = PoolDaemon::with_tiers(options, tiers, rt.handle().clone())
        .with_context(|| format!("cannot create a shared arena of {arena} ({})", from.arena))?;
    let daemon = Arc::new(writing_disk_tiers_at_low_priority(daemon, cfg, rt));
    let access = match group {
        Some(g) => SocketAccess::group(g)?,
        None => SocketAccess::default(),
    };
    let server = DaemonServer::bind(daemon.clone(), socket, access)
        .with_context(|| format!("cannot listen on {} ({})", socket.display(), from.socket))?;
    Ok((daemon, server))
}

/// One tenant's daemon and its socket.
struct Served {
    name: String,
    daemon: Arc<PoolDaemon>,
    server: DaemonServer,
}

/// Runs the daemon until SIGTERM or SIGINT, then stops accepting, drains the writes to the
/// lower tiers and closes them. With `[[tenant]]`s, one daemon per tenant (its own socket and
/// arena, its keys under its own prefix in the shared lower tiers); without, one for everyone
/// who can attach to `--socket`.
pub fn run(args: ServeArgs, rt: &Runtime) -> anyhow::Result<()> {
    let cfg = args.load()?;
    if let Some(addr) = cfg.metrics.listen_addr()? {
        if kvpool_backends::serve_metrics(addr)? {
            eprintln!("kvpool serve: Prometheus metrics on http://{addr}/metrics");
        } else {
            eprintln!("kvpool serve: WARNING: no Prometheus metrics: cannot listen on {addr}");
        }
    }
    let base = DaemonOptions::from_config(&cfg)?;
    let largest = cfg
        .tenants
        .iter()
        .map(|t| t.memory.0)
        .max()
        .unwrap_or(base.capacity as u64);
    let tiers = rt
        .block_on(open_connectors(&cfg.tiers, largest))
        .context("cannot open the lower tiers")?;
    let tier_names: Vec<String> = cfg
        .tiers
        .iter()
        .map(|t| kvpool_core::redact_url(&t.url))
        .collect();
    // Caught from here on, before the first socket exists: a SIGTERM sent as soon as a
    // socket appears (a supervisor's, a test's) drains and removes the sockets instead of
    // killing the process with them left behind. (Before this point, while the lower tiers
    // open, a signal still stops the process at once.)
    let (mut term, mut int) = {
        let _in_runtime = rt.enter();
        (
            signal(SignalKind::terminate()).context("cannot catch SIGTERM")?,
            signal(SignalKind::interrupt()).context("cannot catch SIGINT")?,
        )
    };
    let mut served = Vec::new();
    if cfg.tenants.is_empty() {
        let (daemon, server) = start_daemon(
            base,
            tiers.clone(),
            &cfg,
            rt,
            &args.socket,
            args.group.as_deref(),
            SettingsFrom {
                arena: "[local_cpu] max_size",
                socket: "choose another path with --socket",
            },
        )?;
        eprintln!(
            "kvpool serve: {} of shared memory ({:?} eviction), lower tiers [{}], listening on {} \
             (one trust domain: every engine that can attach)",
            cfg.local_cpu.max_size.human(),
            cfg.local_cpu.eviction,
            tier_names.join(", "),
            args.socket.display()
        );
        served.push(Served {
            name: DEFAULT_TENANT.into(),
            daemon,
            server,
        });
    } else {
        if args.group.is_some() || args.socket != std::path::Path::new(DEFAULT_SOCKET) {
            anyhow::bail!(
                "with [[tenant]]s each tenant's socket and group come from its table: drop \
                 --socket and --group"
            );
        }
        for tenant in &cfg.tenants {
            let options = base.for_tenant(&tenant.name, tenant.memory.as_usize());
            let mac_key = tenant.mac_key()?;
            let namespaced: Vec<Arc<dyn RemoteConnector>> = tiers
                .iter()
                .map(|t| {
                    let view = NamespacedConnector::new(t.clone(), tenant.namespace());
                    let view = match &mac_key {
                        Some(key) => view.with_mac_key(key.clone()),
                        None => view,
                    };
                    Arc::new(view) as Arc<dyn RemoteConnector>
                })
                .collect();
            let (daemon, server) = start_daemon(
                options,
                namespaced,
                &cfg,
                rt,
                &tenant.socket,
                tenant.group.as_deref(),
                SettingsFrom {
                    arena: "the tenant's memory",
                    socket: "choose another path with the tenant's socket",
                },
            )
            .with_context(|| format!("tenant `{}`", tenant.name))?;
            eprintln!(
                "kvpool serve: tenant `{}`: {} of shared memory, lower tiers [{}] under `{}`, \
                 listening on {}{}{}",
                tenant.name,
                tenant.memory.human(),
                tier_names.join(", "),
                tenant.namespace(),
                tenant.socket.display(),
                tenant
                    .group
                    .as_ref()
                    .map(|g| format!(" (group {g})"))
                    .unwrap_or_default(),
                if mac_key.is_some() {
                    ", values below tagged with the tenant's MAC"
                } else {
                    ""
                }
            );
            served.push(Served {
                name: tenant.name.clone(),
                daemon,
                server,
            });
        }
    }
    let signal_name = rt.block_on(async {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = term.recv() => return "SIGTERM",
                _ = int.recv() => return "SIGINT",
                _ = tick.tick() => {
                    for s in &served {
                        s.daemon.record_metrics();
                    }
                }
            }
        }
    });
    eprintln!("kvpool serve: {signal_name}; draining writes to the lower tiers");
    let tenants = !cfg.tenants.is_empty();
    for s in served {
        s.server.shutdown();
        rt.block_on(s.daemon.close(DRAIN_LIMIT));
        let st = s.daemon.stats();
        eprintln!(
            "kvpool serve: {} stopped ({} values, {} commits, {} gets from memory, {} from lower tiers, {} misses)",
            s.name, st.entries, st.commits, st.memory_hits, st.tier_hits, st.misses
        );
    }
    if tenants {
        // The tenants' views do not close the shared tiers: closed once, here.
        for tier in &tiers {
            if let Err(e) = rt.block_on(tier.close()) {
                eprintln!("kvpool serve: closing {} failed: {e}", tier.name());
            }
        }
    }
    Ok(())
}
