//! `cargo xtask bench-vllm`, `bench-async`, `bench-disagg` and `bench-serve`: kvpool inside
//! real vLLM (its CPU build) against named baselines, each driver a script in
//! `kvpool-py/bench/` run with the vLLM virtualenv and the release wheel.

use std::process::Command;

use crate::python_env::{
    ensure_tools, install_wheel, path_str, python312, target_dir, uv_pip_install,
};
use crate::vllm::{PACKAGES, ensure_vllm_venv};
use crate::{ensure_system_packages, run, run_with_env};

/// `cargo xtask bench-vllm`: TTFT and throughput on a repeated 8K-token prefix, with and
/// without kvpool and against vLLM's ExampleConnector, each in a fresh process (release wheel).
pub(crate) fn bench_vllm(args: &[String]) -> Result<(), String> {
    let (_, venv_python) = release_venv()?;
    // `--daemon` measures `kvpool serve`: a release build of the command.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    crate::run(&cargo, &["build", "--release", "-p", "kvpool-cli"])?;
    let kvpool = target_dir().join("release/kvpool");
    let out = run_bench_script(
        &venv_python,
        "bench_vllm.py",
        "bench-vllm.json",
        args.iter().cloned(),
        &[("KVPOOL_BIN", path_str(&kvpool)?)],
    )?;
    eprintln!("results in {}", out.display());
    Ok(())
}

/// `cargo xtask bench-disagg`: disaggregated prefill through the pool (a `kv_producer` and a
/// `kv_consumer` `vllm serve`, one core each, over the node's pool daemon, behind
/// `kvpool.disagg_proxy`) against one `vllm serve` on both cores, TTFT and ITL from
/// `vllm bench serve`, rounds interleaved (release wheel; its `kvpool` command as the daemon).
pub(crate) fn bench_disagg(args: &[String]) -> Result<(), String> {
    let (_, venv_python) = release_venv()?;
    let kvpool = venv_python.with_file_name("kvpool");
    let out = run_bench_script(
        &venv_python,
        "bench_disagg.py",
        "bench-disagg.json",
        args.iter().cloned(),
        &[("KVPOOL_BIN", path_str(&kvpool)?)],
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
    let (_, venv_python) = release_venv()?;
    let (port, _redis) = loopback_redis()?;
    let redis = ["--redis-port".to_string(), port.to_string()];
    let out = run_bench_script(
        &venv_python,
        "bench_async.py",
        "bench-async.json",
        redis.into_iter().chain(args.iter().cloned()),
        &[],
    )?;
    eprintln!("results in {}", out.display());
    Ok(())
}

/// `cargo xtask bench-serve`: `vllm serve` driven by vLLM's own client (`vllm bench serve`), one
/// fresh server per configuration (no connector, kvpool L1, disk, disk with write-behind at
/// normal priority, Redis, the pool daemon over disk, vLLM's prefix cache),
/// on no reuse, shared prefixes and a Mooncake-format trace (`kvpool gen-trace` unless
/// `--trace PATH` is given); a table, `target/bench-serve.json` and `target/bench-serve.png`
/// (release wheel; a loopback Redis started and stopped here).
pub(crate) fn bench_serve(args: &[String]) -> Result<(), String> {
    ensure_system_packages(PACKAGES)?;
    let (tools, venv_python) = release_venv()?;
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
    let chart = target_dir().join("bench-serve.png");
    let before = [
        "--chart".to_string(),
        path_str(&chart)?.to_string(),
        "--redis-port".into(),
        port.to_string(),
    ];
    // The `kvpool daemon disk` configuration's `kvpool serve`: the wheel's command.
    let kvpool = venv_python.with_file_name("kvpool");
    let out = run_bench_script(
        &venv_python,
        "bench_serve.py",
        "bench-serve.json",
        before.into_iter().chain(args),
        &[("KVPOOL_BIN", path_str(&kvpool)?)],
    )?;
    eprintln!("results in {} and {}", out.display(), chart.display());
    Ok(())
}

/// Runs the benchmark script `script` (under `kvpool-py/bench/`) with `venv_python`, its
/// results written to `target/<out>`, then `args`; `env` besides `HF_HUB_OFFLINE=1`.
fn run_bench_script(
    venv_python: &std::path::Path,
    script: &str,
    out: &str,
    args: impl IntoIterator<Item = String>,
    env: &[(&str, &str)],
) -> Result<std::path::PathBuf, String> {
    let out = target_dir().join(out);
    let mut cmd = vec![
        format!("kvpool-py/bench/{script}"),
        "--out".into(),
        path_str(&out)?.to_string(),
    ];
    cmd.extend(args);
    let cmd: Vec<&str> = cmd.iter().map(String::as_str).collect();
    run_with_env(
        path_str(venv_python)?,
        &cmd,
        &[&[("HF_HUB_OFFLINE", "1")], env].concat(),
    )?;
    Ok(out)
}

/// The vLLM virtualenv with the release wheel installed, as every benchmark runs: the tool
/// virtualenv's `bin` and the benchmark's python.
fn release_venv() -> Result<(std::path::PathBuf, std::path::PathBuf), String> {
    let python = python312()?;
    let tools = ensure_tools(&python)?;
    let venv_python = ensure_vllm_venv(&python, &tools)?;
    install_wheel(&tools, &venv_python, "release")?;
    Ok((tools, venv_python))
}
