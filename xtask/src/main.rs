//! `cargo xtask`: project automation (CI gate and benchmarks) in plain Rust.
//!
//! - `cargo xtask ci`: installs missing Debian packages (as root), then formatting, clippy
//!   (warnings are errors), doc tests, every other test (nextest when installed, else
//!   `cargo test`), all with every feature, the example third-party backend
//!   (`examples/opendal-tier`, built as an outside crate), then `matrix`, `wheel`, the GPU
//!   bundle (carrying that wheel, dry-run on CPU tensors by the vLLM suite), `vllm` and
//!   `sglang`, both against the release wheel: exactly what CI runs; it ends with each stage's time. Every task links the system's librocksdb when a compatible one is installed
//!   (`system.rs`), else the `disk` feature builds RocksDB from source.
//! - `cargo xtask module-cycles`: fails on an import cycle between the modules of a crate.
//! - `cargo xtask diagrams`: renders `docs/diagrams/*.dot` (Graphviz) to the SVGs beside them.
//! - `cargo xtask fuzz [--seconds N]`: every cargo-fuzz target (decoders, config, URLs, keys,
//!   trace lines) for N seconds each on nightly libFuzzer; CI runs 6 s per target.
//! - `cargo xtask soak [--minutes N]`: a chaos soak: `kvpool sim` through L1 + disk + Redis +
//!   S3 while servers are killed, the disk fills and values are corrupted (CI: 2 minutes);
//!   `--daemon`: engines attached to one `kvpool serve`, the daemon and an engine killed and
//!   restarted (CI: 1.5 minutes).
//! - `cargo xtask sanitize`: kvpool-core's unit tests under AddressSanitizer (nightly).
//! - `cargo xtask wheel [--skip-smoke]`: the portable release wheel (manylinux_2_28 through
//!   maturin's zig linker, RocksDB built in statically, the `kvpool` command as its entry
//!   point) in `target/wheel-dist/`, checked by `auditwheel show` and tried in fresh Python
//!   3.10 and 3.12 virtualenvs with no Rust on `PATH`.
//! - `cargo xtask vllm [pytest args]`: builds the `kvpool` Python package and runs its
//!   end-to-end tests inside real vLLM (CPU build, installed under `target/vllm-venv`).
//! - `cargo xtask sglang [pytest args]`: the same package as SGLang's HiCache L3 storage
//!   backend, driven through SGLang's own host memory pools on CPU (`target/sglang-venv`).
//! - `cargo xtask bench-sglang`: kvpool as SGLang's storage backend (disk, memory) against
//!   SGLang's own `file` backend and a plain copy, GB/s of backups and prefetches.
//! - `cargo xtask bench-vllm`: TTFT on a repeated 8K-token prefix, recompute vs kvpool vs
//!   vLLM's ExampleConnector (see docs/benchmarks.md).
//! - `cargo xtask bench-async`: synchronous vs asynchronous loads inside vLLM: TTFT from L1,
//!   disk and Redis, and a decoding request's token gaps while another loads, against the
//!   same run with vLLM's own prefix cache serving it (paired rounds).
//! - `cargo xtask bench-disagg`: a `kv_producer` and a `kv_consumer` `vllm serve` (one core
//!   each) over the node's pool daemon behind kvpool's proxy, against one `vllm serve` on both
//!   cores: TTFT and ITL from `vllm bench serve`, rounds interleaved (docs/benchmarks.md).
//! - `cargo xtask bench-serve`: `vllm serve` driven by `vllm bench serve`, a fresh server per
//!   configuration (no connector, kvpool L1 / disk / Redis, vLLM's prefix cache), on no reuse,
//!   shared prefixes and a Mooncake-format trace; a table and a chart (docs/benchmarks.md).
//! - `cargo xtask matrix`: starts Redis (standalone with a password, a 3-node cluster, TLS)
//!   and moto (S3) on 127.0.0.1, runs every backend's tests and the conformance kit against them, prints a
//!   backend x check table, and stops the servers by PID.
//! - `cargo xtask bench-backends`: the same servers, then `redis-benchmark` and the criterion
//!   `remote` bench (Redis, S3, RocksDB vs their baselines) in one run.
//! - `cargo xtask bench`: the criterion benchmarks, then `kvpool bench` under `/usr/bin/time -v`
//!   (peak memory) and `kvpool replay --simulate` on a generated 12,000-request trace.
//! - `cargo xtask gpu-bundle [--profile dev|release]`: what a lent GPU machine (torch, no Rust,
//!   no vLLM) needs to check kvpool's GPU path, in `target/gpu-bundle/` (release by default).

mod diagrams;
mod fuzz;
mod matrix;
mod module_cycles;
mod sanitize;
mod servers;
mod sglang;
mod soak;
mod system;
mod third_party;
mod vllm;
mod wheel;

pub(crate) use system::ensure_system_packages;

use std::env;
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::Instant;

pub(crate) fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// Runs a command in the workspace root, echoing it; Err if it fails to start or exits non-zero.
/// `cargo xtask soak [--daemon] ...`: the chaos soak of the tiers, or of the pool daemon.
fn soak_command(args: &[String]) -> Result<(), String> {
    let args = soak::parse_args(args)?;
    if args.daemon {
        soak::daemon::soak_daemon(&args)
    } else {
        soak::soak(&args)
    }
}

pub(crate) fn run(program: &str, args: &[&str]) -> Result<(), String> {
    run_with_env(program, args, &[])
}

/// [`run`] with extra environment variables for the child.
pub(crate) fn run_with_env(
    program: &str,
    args: &[&str],
    envs: &[(&str, &str)],
) -> Result<(), String> {
    eprintln!("\n==> {program} {}", args.join(" "));
    let started = Instant::now();
    let status = Command::new(program)
        .args(args)
        .envs(envs.iter().copied())
        .current_dir(workspace_root())
        .status()
        .map_err(|e| format!("cannot start `{program}`: {e}"))?;
    eprintln!(
        "<== {program} {} ({:.0?}, {status})",
        args.join(" "),
        started.elapsed()
    );
    if status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{program} {}` failed with {status}",
            args.join(" ")
        ))
    }
}

/// What CI's workspace tests build (`cargo test` without nextest): the build whose `kvpool` the
/// soak and the vLLM tests then take (`vllm::build_kvpool_cli`), so the two must name the same
/// targets and features.
pub(crate) const WORKSPACE_TEST_TARGETS: &[&str] = &[
    "--workspace",
    "--all-features",
    "--lib",
    "--bins",
    "--tests",
];

fn has_nextest() -> bool {
    Command::new("cargo")
        .args(["nextest", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The stages of `cargo xtask ci` with how long each took, printed when the run ends, passed or
/// failed, so a slow CI run says where its minutes went.
struct CiClock {
    started: Instant,
    stages: Vec<(&'static str, std::time::Duration, bool)>,
}

impl CiClock {
    fn new() -> Self {
        Self {
            started: Instant::now(),
            stages: Vec::new(),
        }
    }

    /// Runs one stage and records its time and outcome.
    fn stage(
        &mut self,
        name: &'static str,
        work: impl FnOnce() -> Result<(), String>,
    ) -> Result<(), String> {
        self.stage_value(name, work)
    }

    /// [`CiClock::stage`] for a stage that returns a value.
    fn stage_value<T>(
        &mut self,
        name: &'static str,
        work: impl FnOnce() -> Result<T, String>,
    ) -> Result<T, String> {
        let started = Instant::now();
        let result = work();
        self.stages.push((name, started.elapsed(), result.is_ok()));
        result
    }
}

impl Drop for CiClock {
    fn drop(&mut self) {
        eprintln!("\ncargo xtask ci, by stage:");
        for (name, took, ok) in &self.stages {
            let outcome = if *ok { "ok" } else { "FAILED" };
            eprintln!("  {name:<24} {:>6.0}s  {outcome}", took.as_secs_f64());
        }
        eprintln!(
            "  {:<24} {:>6.0}s",
            "total",
            self.started.elapsed().as_secs_f64()
        );
    }
}

fn ci() -> Result<(), String> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let cargo = cargo.as_str();
    let mut clock = CiClock::new();
    clock.stage("system packages", || {
        ensure_system_packages(system::SYSTEM_PACKAGES)
    })?;
    clock.stage("fmt", || run(cargo, &["fmt", "--all", "--", "--check"]))?;
    clock.stage("clippy", || {
        run(
            cargo,
            &[
                "clippy",
                "--workspace",
                "--all-targets",
                "--all-features",
                "--",
                "-D",
                "warnings",
            ],
        )
    })?;
    clock.stage("module cycles", module_cycles::module_cycles)?;
    // Doc tests first, so the run closes on a real test runner's summary.
    clock.stage("doc tests", || {
        run(cargo, &["test", "--workspace", "--all-features", "--doc"])
    })?;
    // The Prometheus test must run here, not skip: the package was installed above. So must
    // the daemon's restart under a memory cgroup (CI runs as root, as it installs packages).
    let require = [
        ("KVPOOL_REQUIRE_PROMETHEUS", "1"),
        ("KVPOOL_REQUIRE_CGROUP", "1"),
    ];
    clock.stage("workspace tests", || {
        if has_nextest() {
            run_with_env(
                cargo,
                &[
                    "nextest",
                    "run",
                    "--workspace",
                    "--all-features",
                    "--no-fail-fast",
                ],
                &require,
            )
        } else {
            eprintln!("cargo-nextest not found; using cargo test");
            run_with_env(
                cargo,
                &[&["test"], WORKSPACE_TEST_TARGETS].concat(),
                &require,
            )
        }
    })?;
    // The soak and the vLLM tests run the `kvpool` the workspace tests built.
    vllm::take_kvpool_cli_from_workspace_tests();
    // A bounded fuzzing pass and the sanitizer run, then every backend against real
    // servers, and last kvpool inside real vLLM and SGLang.
    // 6 s per target (10 until 2026-11-29: CI's 75-minute budget; `cargo xtask fuzz` runs
    // longer passes by hand).
    clock.stage("fuzz", || fuzz::fuzz(&["--seconds".into(), "6".into()]))?;
    clock.stage("sanitize", sanitize::sanitize)?;
    // Anonymous RSS still drifts up by about 0.2 MiB a minute after the warm-up (medians of
    // the first and last windows; docs/reliability.md); until that is explained, 2 minutes may
    // grow it by 15 %, plus 4 MiB: glibc's retained free pages swing by a few MiB on this
    // ~20 MiB process (a 2-minute run read +18.8 %, 3.3 MiB, with 0 wrong tokens).
    clock.stage("soak", || {
        soak_command(&[
            "--minutes".into(),
            "2".into(),
            "--max-rss-growth".into(),
            "0.15".into(),
            "--rss-slack-mib".into(),
            "4".into(),
        ])
    })?;
    // The pool daemon's soak: engines and the daemon killed and restarted.
    clock.stage("soak (daemon)", || {
        soak_command(&[
            "--daemon".into(),
            "--minutes".into(),
            "1.5".into(),
            "--max-rss-growth".into(),
            "0.15".into(),
            "--rss-slack-mib".into(),
            "4".into(),
        ])
    })?;
    clock.stage("example backend", third_party::example_backend)?;
    clock.stage("matrix", matrix::matrix)?;
    // The portable release wheel (manylinux_2_28, RocksDB inside, the `kvpool` command),
    // checked by auditwheel and tried in fresh virtualenvs without Rust; the vLLM and SGLang
    // suites below then run against that wheel, as an operator installs it.
    let wheel = clock.stage_value("wheel", || wheel::wheel(&[]))?;
    vllm::test_the_release_wheel(wheel);
    // The GPU bundle, as a lent GPU machine gets it but carrying the wheel the vLLM suite
    // installs (the release wheel), is dry-run on CPU tensors by the vLLM suite's
    // `test_gpu_check.py`.
    let bundle = clock.stage_value("gpu bundle", || {
        vllm::build_gpu_bundle("dev", vllm::BundleWheel::AsTested)
    })?;
    let bundle = vllm::path_str(&bundle)?.to_string();
    clock.stage("vllm", || {
        vllm::vllm_with_env(&[], &[("KVPOOL_GPU_BUNDLE", bundle.as_str())])
    })?;
    clock.stage("sglang", || sglang::sglang(&[]))
}

fn bench() -> Result<(), String> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run(
        &cargo,
        &[
            "bench",
            "-p",
            "kvpool-core",
            "-p",
            "kvpool-backends",
            "-p",
            "kvpool-connector",
        ],
    )?;
    run(&cargo, &["build", "--release", "-p", "kvpool-cli"])?;
    let kvpool = workspace_root().join("target/release/kvpool");
    let kvpool = kvpool.to_str().ok_or("non-UTF-8 path")?;
    let trace = env::temp_dir().join("kvpool-bench-trace.jsonl");
    let trace = trace.to_str().ok_or("non-UTF-8 path")?;
    run(
        "/usr/bin/time",
        &["-v", kvpool, "bench", "--cpu-size", "2GiB"],
    )?;
    run(
        kvpool,
        &["gen-trace", "--out", trace, "--requests", "12000"],
    )?;
    run(
        kvpool,
        &[
            "replay",
            "--trace",
            trace,
            "--simulate",
            "--capacity-tokens",
            "20000000",
        ],
    )?;
    Ok(())
}

/// The remote-tier benchmarks with their baselines in one run: `redis-benchmark` and the
/// criterion `remote` bench against the same Redis, plus moto and RocksDB.
fn bench_backends() -> Result<(), String> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let prepared = servers::prepare()?;
    run(
        &cargo,
        &[
            "bench",
            "-p",
            "kvpool-backends",
            "--all-features",
            "--bench",
            "remote",
            "--no-run",
        ],
    )?;
    let dir = servers::scratch_dir("bench")?;
    let servers = servers::start_servers(&dir, &prepared.moto_server)?;
    let get = |k: &str| {
        servers
            .env
            .iter()
            .find(|(name, _)| name == k)
            .map(|(_, v)| v.clone())
            .ok_or(format!("{k} missing"))
    };
    let redis_url = get("KVPOOL_TEST_REDIS_URL")?;
    let port = redis_url.rsplit(':').next().unwrap_or_default().to_string();
    for (clients, requests) in [("1", "300"), ("8", "1000")] {
        run(
            "redis-benchmark",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-a",
                "kvpool-test",
                "-t",
                "set,get",
                "-d",
                "1048576",
                "-n",
                requests,
                "-c",
                clients,
                "--csv",
            ],
        )?;
    }
    let mut envs: Vec<(String, String)> = servers.env.clone();
    envs.push(("KVPOOL_BENCH_REDIS_URL".into(), redis_url));
    envs.push(("KVPOOL_BENCH_S3_URL".into(), get("KVPOOL_TEST_S3_URL")?));
    envs.push((
        "KVPOOL_BENCH_S3_ENDPOINT".into(),
        get("KVPOOL_TEST_S3_ENDPOINT")?,
    ));
    let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    run_with_env(
        &cargo,
        &[
            "bench",
            "-p",
            "kvpool-backends",
            "--all-features",
            "--bench",
            "remote",
        ],
        &envs,
    )
}

/// The median estimate (ns) criterion recorded for `group/function`.
fn criterion_median_ns(group: &str, function: &str) -> Result<f64, String> {
    let path = workspace_root()
        .join("target/criterion")
        .join(group)
        .join(function)
        .join("new/estimates.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let median = text.find("\"median\"").ok_or("no median in estimates")?;
    json_number_after(&text[median..], "\"point_estimate\":")
}

/// The number following `label` in a flat JSON text.
fn json_number_after(text: &str, label: &str) -> Result<f64, String> {
    let at = text.find(label).ok_or(format!("no {label} in {text}"))? + label.len();
    let digits: String = text[at..]
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '-' | '+'))
        .collect();
    digits
        .parse()
        .map_err(|e| format!("bad number after {label}: {e}"))
}

/// `cargo xtask bench-mooncake`: kvpool's Mooncake tier against Mooncake's own Python client,
/// 1 MiB put/get, in one run on one master and segment holder (in a loopback-only network
/// namespace where possible).
fn bench_mooncake(inside_namespace: bool) -> Result<(), String> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let prepared = servers::prepare()?;
    if !inside_namespace {
        run(
            &cargo,
            &[
                "bench",
                "-p",
                "kvpool-backends",
                "--features",
                "mooncake",
                "--bench",
                "mooncake",
                "--no-run",
            ],
        )?;
        if matrix::can_isolate_network() {
            let exe = env::current_exe().map_err(|e| e.to_string())?;
            let exe = exe.to_str().ok_or("non-UTF-8 path")?;
            return run(
                "unshare",
                &[
                    "--net",
                    "--",
                    "sh",
                    "-c",
                    r#"ip link set lo up && exec "$0" "$@""#,
                    exe,
                    "bench-mooncake",
                    "--in-namespace",
                ],
            );
        }
        eprintln!("warning: no network namespace (needs root); Mooncake listens on all interfaces");
    }
    let dir = servers::scratch_dir("bench-mooncake")?;
    let cluster = servers::start_mooncake(&dir, &prepared.mooncake_venv)?;
    let master = cluster.master_address();
    let python = prepared.mooncake_venv.join("bin/python");
    let script = workspace_root().join("kvpool-backends/benches/mooncake_direct.py");
    let site = std::fs::read_dir(prepared.mooncake_venv.join("lib"))
        .map_err(|e| e.to_string())?
        .filter_map(Result::ok)
        .map(|e| e.path().join("site-packages"))
        .find(|p| p.is_dir())
        .ok_or("no site-packages in the Mooncake venv")?;
    let site = site.display().to_string();
    const PAIRS: [(&str, &str); 6] = [
        ("client_put", "upsert_from"),
        ("client_get", "get_into"),
        ("connector_put", "upsert_from"),
        ("connector_get", "get_into"),
        ("backend_put", "upsert_from"),
        ("backend_get", "get_into"),
    ];
    // The two sides alternate, several rounds, so that drift on this busy machine (master,
    // segment holder and client share its cores) hits both alike; each ratio is a median.
    const ROUNDS: usize = 3;
    let mut rows: Vec<Vec<(f64, f64)>> = vec![Vec::new(); PAIRS.len()];
    for round in 1..=ROUNDS {
        eprintln!(
            "\n==> round {round}/{ROUNDS}, direct: {} {master}",
            script.display()
        );
        let out = Command::new(&python)
            .arg(&script)
            .arg(&master)
            .env("MC_LOG_LEVEL", "WARNING")
            .stderr(std::process::Stdio::inherit())
            .output()
            .map_err(|e| format!("cannot run the direct benchmark: {e}"))?;
        if !out.status.success() {
            return Err("the direct Mooncake benchmark failed".into());
        }
        let direct = String::from_utf8_lossy(&out.stdout).to_string();
        println!("direct Python client, median µs per op: {}", direct.trim());
        run_with_env(
            &cargo,
            &[
                "bench",
                "--offline",
                "-p",
                "kvpool-backends",
                "--features",
                "mooncake",
                "--bench",
                "mooncake",
                "--",
                "--warm-up-time",
                "1",
                "--measurement-time",
                "3",
            ],
            &[
                ("KVPOOL_BENCH_MOONCAKE_MASTER", master.as_str()),
                ("KVPOOL_BENCH_MOONCAKE_SITE", site.as_str()),
                ("MC_LOG_LEVEL", "WARNING"),
            ],
        )?;
        for (row, (function, baseline)) in rows.iter_mut().zip(PAIRS) {
            let ours = criterion_median_ns("mooncake_1MiB", function)? / 1000.0;
            let theirs = json_number_after(&direct, &format!("\"{baseline}\":"))?;
            row.push((ours, theirs));
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "\n== Mooncake 1 MiB: kvpool vs the direct Python client ({ROUNDS} alternating rounds, one master) =="
    );
    println!(
        "{:<14} {:>24} {:>24} {:>22} {:>8}",
        "kvpool op", "kvpool µs per round", "direct µs per round", "ratio per round", "median"
    );
    for (row, (function, baseline)) in rows.iter().zip(PAIRS) {
        let fmt = |v: Vec<String>| v.join(" ");
        let ratios: Vec<f64> = row.iter().map(|(ours, theirs)| theirs / ours).collect();
        println!(
            "{function:<14} {:>24} {:>24} {:>22} {:>7.2}x",
            fmt(row.iter().map(|(o, _)| format!("{o:.0}")).collect()),
            format!(
                "{baseline} {}",
                fmt(row.iter().map(|(_, t)| format!("{t:.0}")).collect())
            ),
            fmt(ratios.iter().map(|r| format!("{r:.2}")).collect()),
            median(ratios.clone())
        );
    }
    println!("(ratio = direct time / kvpool time; above 1 means kvpool is faster)");
    Ok(())
}

fn main() -> ExitCode {
    system::use_system_rocksdb_if_compatible();
    let task = env::args().nth(1);
    let result = match task.as_deref() {
        Some("ci") => ci(),
        Some("bench") => bench(),
        Some("matrix") => matrix::matrix(),
        Some("bench-backends") => bench_backends(),
        Some("bench-mooncake") => {
            bench_mooncake(env::args().nth(2).as_deref() == Some("--in-namespace"))
        }
        Some("gpu-bundle") => {
            vllm::gpu_bundle(&env::args().skip(2).collect::<Vec<_>>()).map(|_| ())
        }
        Some("sanitize") => sanitize::sanitize(),
        Some("module-cycles") => module_cycles::module_cycles(),
        Some("diagrams") => diagrams::diagrams(),
        Some("soak") => soak_command(&env::args().skip(2).collect::<Vec<_>>()),
        Some("fuzz") => fuzz::fuzz(&env::args().skip(2).collect::<Vec<_>>()),
        Some("vllm") => vllm::vllm(&env::args().skip(2).collect::<Vec<_>>()),
        Some("sglang") => sglang::sglang(&env::args().skip(2).collect::<Vec<_>>()),
        Some("bench-sglang") => sglang::bench_sglang(&env::args().skip(2).collect::<Vec<_>>()),
        Some("bench-vllm") => vllm::bench_vllm(&env::args().skip(2).collect::<Vec<_>>()),
        Some("bench-async") => vllm::bench_async(&env::args().skip(2).collect::<Vec<_>>()),
        Some("bench-disagg") => vllm::bench_disagg(&env::args().skip(2).collect::<Vec<_>>()),
        Some("bench-serve") => vllm::bench_serve(&env::args().skip(2).collect::<Vec<_>>()),
        Some("wheel") => wheel::wheel(&env::args().skip(2).collect::<Vec<_>>()).map(|_| ()),
        Some("fmt") => run("cargo", &["fmt", "--all"]),
        _ => {
            eprintln!(
                "usage: cargo xtask <ci | module-cycles | diagrams | matrix | soak | fuzz | sanitize | vllm | sglang | bench | bench-vllm | bench-async | bench-disagg | bench-serve | bench-sglang | bench-backends | bench-mooncake | gpu-bundle | wheel | fmt>"
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask failed: {e}");
            ExitCode::FAILURE
        }
    }
}
