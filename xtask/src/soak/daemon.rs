//! `cargo xtask soak --daemon`: the chaos soak of the node's pool daemon. Two `kvpool sim`
//! engines attach to one `kvpool serve` (shared memory over a disk tier) and check every KV
//! row against recomputation, while this process kills the daemon (SIGKILL) and restarts it,
//! and kills and restarts a third engine attached to it. Beside them, in a tenant of its own
//! over the same disk tier, a hostile engine (`kvpool hostile-engine`) attacks the daemon the
//! whole time: garbage frames, duplicate-key storms, forged commits, holes punched into its
//! arena. At the end the honest engines must have seen no wrong KV and no refusal, the
//! hostile one must have been refused, the daemon must hold no lease of any engine, its
//! resident memory must have stayed within its budget, and SIGTERM must stop it cleanly.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use super::engines::{print_sim_report, sim_command};
use super::{CALM_SECS, Dice, SoakArgs};
use crate::servers;

/// The honest tenant's shared memory: small, so the engines' chunks are evicted to its disk
/// tier.
const ARENA_MIB: u64 = 64;
/// The hostile tenant's shared memory.
const HOSTILE_ARENA_MIB: u64 = 16;
/// Anonymous memory the daemon may use besides its arena (RocksDB's caches, frames, threads).
const DAEMON_ANON_LIMIT_MIB: u64 = 160;

/// `kvpool serve` with two tenants, restartable.
struct Daemon {
    kvpool: PathBuf,
    config: PathBuf,
    /// The honest tenant's socket (the config names every tenant's).
    socket: PathBuf,
    dir: PathBuf,
    metrics_port: u16,
    child: Option<Child>,
    starts: u32,
}

impl Daemon {
    fn start(&mut self) -> Result<(), String> {
        self.starts += 1;
        let log = self.dir.join(format!("daemon-{}.log", self.starts));
        let child = Command::new(&self.kvpool)
            .arg("serve")
            .arg("--config")
            .arg(&self.config)
            .stdout(std::fs::File::create(&log).map_err(|e| e.to_string())?)
            .stderr(std::fs::File::create(log.with_extension("err")).map_err(|e| e.to_string())?)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.kvpool.display()))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if UnixStream::connect(&self.socket).is_ok() && self.scrape().is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!(
            "kvpool serve did not start (logs in {})",
            self.dir.display()
        ))
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM; whether it exited cleanly within 45 s.
    fn terminate(&mut self) -> Result<bool, String> {
        let Some(mut c) = self.child.take() else {
            return Ok(false);
        };
        let pid = c.id().to_string();
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .map_err(|e| e.to_string())?;
        let deadline = Instant::now() + Duration::from_secs(45);
        while Instant::now() < deadline {
            if let Some(status) = c.try_wait().map_err(|e| e.to_string())? {
                return Ok(status.success());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = c.kill();
        let _ = c.wait();
        Ok(false)
    }

    /// The daemon's Prometheus page.
    fn scrape(&self) -> Result<String, String> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.metrics_port))
            .map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .map_err(|e| e.to_string())?;
        let mut page = String::new();
        s.read_to_string(&mut page).map_err(|e| e.to_string())?;
        Ok(page)
    }

    /// A series of the daemon's page, summed over its labels (the daemon's series carry a
    /// `tenant` label).
    fn series(&self, name: &str) -> Result<f64, String> {
        self.series_of(name, "")
    }

    /// [`Self::series`] over the lines whose labels contain `labels` (e.g.
    /// `tenant="honest"`; empty: every line).
    fn series_of(&self, name: &str, labels: &str) -> Result<f64, String> {
        let page = self.scrape()?;
        let values: Vec<f64> = page
            .lines()
            .filter_map(|l| {
                let rest = l.strip_prefix(name)?;
                let rest = match rest.strip_prefix('{') {
                    Some(labelled) => {
                        let end = labelled.find('}')?;
                        if !labelled[..end].contains(labels) {
                            return None;
                        }
                        &labelled[end + 1..]
                    }
                    None if labels.is_empty() => rest,
                    None => return None,
                };
                rest.strip_prefix(' ')?.trim().parse().ok()
            })
            .collect();
        if values.is_empty() {
            return Err(format!("{name} missing from the daemon's metrics"));
        }
        Ok(values.iter().sum())
    }

    /// (anonymous, shared) resident bytes of the daemon now.
    fn resident(&self) -> Option<(u64, u64)> {
        let pid = self.child.as_ref()?.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let kib = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .map(|k| k * 1024)
        };
        Some((kib("RssAnon:")?, kib("RssShmem:")?))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs the daemon soak; see the module's docs.
pub(crate) fn soak_daemon(args: &SoakArgs) -> Result<(), String> {
    crate::ensure_system_packages(crate::system::SYSTEM_PACKAGES)?;
    let kvpool = crate::vllm::build_kvpool_cli()?;
    let dir = servers::scratch_dir("soak-daemon")?;
    let result = run(&dir, &kvpool, args);
    if result.is_ok() {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!("soak files kept in {}", dir.display());
    }
    result
}

fn run(dir: &Path, kvpool: &Path, args: &SoakArgs) -> Result<(), String> {
    let socket = dir.join("kvpool.sock");
    let hostile_socket = dir.join("hostile.sock");
    let metrics_port = servers::free_port()?;
    let daemon_config = dir.join("daemon.toml");
    std::fs::write(
        &daemon_config,
        format!(
            r#"# The soak's pool daemon: two tenants, each small shared memory, over a disk tier.
[metrics]
listen = "127.0.0.1:{metrics_port}"

[[tenant]]
name = "honest"
socket = "{socket}"
memory = "{ARENA_MIB}MiB"

[[tenant]]
name = "hostile"
socket = "{hostile_socket}"
memory = "{HOSTILE_ARENA_MIB}MiB"

[[tier]]
url = "file://{disk}"
capacity = "512MiB"
block_cache = "4MiB"
write_buffer = "2MiB"
timeout_ms = 1000
"#,
            disk = dir.join("disk").display(),
            socket = socket.display(),
            hostile_socket = hostile_socket.display(),
        ),
    )
    .map_err(|e| e.to_string())?;
    let engine_config = dir.join("engine.toml");
    std::fs::write(
        &engine_config,
        format!(
            r#"# An engine of the daemon soak: its own small L1, then the daemon.
[allocator]
release_free_pages_secs = 10

[[tier]]
url = "kvpool+unix://{socket}"
timeout_ms = 1000
"#,
            socket = socket.display()
        ),
    )
    .map_err(|e| e.to_string())?;
    let mut daemon = Daemon {
        kvpool: kvpool.to_path_buf(),
        config: daemon_config,
        socket,
        dir: dir.to_path_buf(),
        metrics_port,
        child: None,
        starts: 0,
    };
    daemon.start()?;

    let checked: Vec<(PathBuf, PathBuf)> = ["a", "b"]
        .iter()
        .map(|n| {
            (
                dir.join(format!("sim-{n}.json")),
                dir.join(format!("sim-{n}.log")),
            )
        })
        .collect();
    let mut engines = Vec::new();
    // One seed for every engine: they ask for the same prefixes, so each loads chunks the
    // others computed, and every row is still checked against recomputation.
    for (out, log) in &checked {
        let seed = args.seed;
        engines.push(
            sim_command(kvpool, &engine_config, args, seed, out, log)?
                .spawn()
                .map_err(|e| format!("cannot start {}: {e}", kvpool.display()))?,
        );
    }
    // The engine that is killed and restarted: it runs far longer than the soak, unchecked.
    let victim_args = SoakArgs {
        minutes: args.minutes * 4.0,
        ..*args
    };
    let spawn_victim = |n: u32| -> Result<Child, String> {
        sim_command(
            kvpool,
            &engine_config,
            &victim_args,
            args.seed,
            &dir.join(format!("victim-{n}.json")),
            &dir.join(format!("victim-{n}.log")),
        )?
        .spawn()
        .map_err(|e| e.to_string())
    };
    let mut victim_starts = 1;
    let mut victim = spawn_victim(victim_starts)?;
    // The hostile engine, in its own tenant: it outlives the soak and is killed at its end.
    let hostile_out = dir.join("hostile.json");
    let mut hostile = Command::new(kvpool)
        .arg("hostile-engine")
        .arg("--socket")
        .arg(&hostile_socket)
        .args(["--seconds", &format!("{}", args.minutes * 60.0 * 4.0)])
        .args(["--seed", &args.seed.to_string()])
        .stdout(std::fs::File::create(&hostile_out).map_err(|e| e.to_string())?)
        .stderr(std::fs::File::create(dir.join("hostile.log")).map_err(|e| e.to_string())?)
        .spawn()
        .map_err(|e| format!("cannot start the hostile engine: {e}"))?;
    eprintln!(
        "==> soak --daemon: {} min, two engines checked and one killed and restarted, attached to one kvpool serve (shared memory over disk), a hostile engine in another tenant; faults until {CALM_SECS} s before the end",
        args.minutes
    );

    let mut dice = Dice(args.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let (mut daemon_kills, mut engine_kills) = (0u32, 0u32);
    let (mut peak_anon, mut peak_shared) = (0u64, 0u64);
    let started = Instant::now();
    let faults_until = Duration::from_secs_f64(args.minutes * 60.0 - CALM_SECS as f64);
    let mut sample = |daemon: &Daemon| {
        if let Some((anon, shared)) = daemon.resident() {
            peak_anon = peak_anon.max(anon);
            peak_shared = peak_shared.max(shared);
        }
    };
    while !args.no_faults && started.elapsed() < faults_until {
        std::thread::sleep(dice.millis(1000, 4000));
        sample(&daemon);
        if engines
            .iter_mut()
            .any(|e| matches!(e.try_wait(), Ok(Some(_))))
        {
            break;
        }
        let what = if dice.below(2) == 0 {
            daemon.kill();
            daemon.start()?;
            daemon_kills += 1;
            "kvpool serve killed (SIGKILL) and restarted".to_string()
        } else {
            let _ = victim.kill();
            let _ = victim.wait();
            victim_starts += 1;
            victim = spawn_victim(victim_starts)?;
            engine_kills += 1;
            "an engine killed (SIGKILL) and restarted".to_string()
        };
        eprintln!("    {:>5.1} s: {what}", started.elapsed().as_secs_f64());
    }
    let mut failed = Vec::new();
    let mut reports = Vec::new();
    for (engine, (out, log)) in engines.iter_mut().zip(&checked) {
        while matches!(engine.try_wait(), Ok(None)) {
            sample(&daemon);
            std::thread::sleep(Duration::from_millis(500));
        }
        let status = engine.wait().map_err(|e| e.to_string())?;
        reports.push(std::fs::read_to_string(out).unwrap_or_default());
        if !status.success() {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            failed.push(format!(
                "engine {} ({status}): {}",
                out.display(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            ));
        }
    }
    let _ = victim.kill();
    let _ = victim.wait();
    // What the hostile engine cost: counted before it leaves (a restart zeroes the counters:
    // this covers the last daemon's run, at least the calm period's seconds).
    let hostile_refused = daemon.series_of(
        "kvpool_daemon_requests_refused_total",
        r#"tenant="hostile""#,
    )?;
    let hostile_alive = matches!(hostile.try_wait(), Ok(None));
    let _ = hostile.kill();
    let _ = hostile.wait();
    // Every engine is gone: the daemon must have reclaimed whatever they held.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut leases = f64::NAN;
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1100));
        if daemon.series("kvpool_daemon_sessions")? == 0.0 {
            leases = daemon.series("kvpool_daemon_leases")?;
            break;
        }
    }
    // The honest engines only die or time out, never send garbage: nothing of theirs is a
    // refusal, whatever the hostile tenant does.
    let refused = daemon.series_of("kvpool_daemon_requests_refused_total", r#"tenant="honest""#)?;
    sample(&daemon);
    let clean_stop = daemon.terminate()?;

    println!(
        "\n== chaos soak of the pool daemon: {} min, seed {} ==",
        args.minutes, args.seed
    );
    println!(
        "{:<40} {daemon_kills:>8}",
        "kvpool serve killed and restarted"
    );
    println!("{:<40} {engine_kills:>8}", "engines killed and restarted");
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "{:<40} {:>8.1}",
        "daemon peak anonymous RSS (MiB)",
        mib(peak_anon)
    );
    println!(
        "{:<40} {:>8.1}",
        "daemon peak shared RSS (MiB)",
        mib(peak_shared)
    );
    println!("{:<40} {leases:>8}", "leases held after every engine left");
    println!("{:<40} {refused:>8}", "honest requests refused (must be 0)");
    println!(
        "{:<40} {hostile_refused:>8}",
        "hostile requests refused (last daemon)"
    );
    println!(
        "-- hostile engine's attacks: {}",
        std::fs::read_to_string(&hostile_out)
            .unwrap_or_default()
            .lines()
            .last()
            .unwrap_or("(none reported)")
    );
    println!("{:<40} {clean_stop:>8}", "SIGTERM stopped it cleanly");
    for (name, report) in ["engine a", "engine b"].iter().zip(&reports) {
        println!("-- {name}");
        print_sim_report(report);
    }
    if leases != 0.0 {
        failed.push(format!(
            "the daemon held {leases} leases after every engine left"
        ));
    }
    if refused != 0.0 {
        failed.push(format!(
            "the daemon refused {refused} requests of engines that sent no garbage (its log says why)"
        ));
    }
    if !hostile_alive {
        failed.push(format!(
            "the hostile engine stopped early (its log: {})",
            dir.join("hostile.log").display()
        ));
    }
    if hostile_refused == 0.0 {
        failed.push("the daemon refused nothing of the hostile engine: did it run?".into());
    }
    if peak_anon > DAEMON_ANON_LIMIT_MIB << 20 {
        failed.push(format!(
            "the daemon's anonymous RSS reached {:.1} MiB (limit {DAEMON_ANON_LIMIT_MIB})",
            mib(peak_anon)
        ));
    }
    // The arenas are the only shared memory the daemon maps (1 MiB of slack for rounding).
    let arenas = ARENA_MIB + HOSTILE_ARENA_MIB;
    if peak_shared > (arenas + 1) << 20 {
        failed.push(format!(
            "the daemon's shared RSS reached {:.1} MiB, above its {arenas} MiB of arenas",
            mib(peak_shared)
        ));
    }
    if !clean_stop {
        failed.push("SIGTERM did not stop the daemon cleanly".into());
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("the daemon soak failed:\n{}", failed.join("\n")))
    }
}
