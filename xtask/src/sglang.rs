//! `cargo xtask sglang`: kvpool as SGLang's HiCache L3 storage backend, tested against SGLang's
//! own classes.
//!
//! Creates (once) a Python 3.12 virtualenv under `target/sglang-venv` with the pinned SGLang
//! wheel installed without its GPU-only dependencies (pins in
//! `kvpool-py/tests_sglang/requirements-sglang.txt`, installed with `uv`; torch is the same
//! version as the vLLM venv's, so uv's cache serves it), installs the `kvpool` wheel there and
//! runs `kvpool-py/tests_sglang`: SGLang's real host memory pools on CPU driving
//! `kvpool.sglang.KvpoolStorage`. The tests start their own loopback Redis and stop it by PID.

use std::path::PathBuf;
use std::time::Instant;

use crate::python_env::{
    ensure_tools, ensure_venv, install_wheel, path_str, python312, target_dir,
};
use crate::vllm::run_pytest;
use crate::{ensure_system_packages, run_with_env};

/// The SGLang release whose storage interface kvpool supports; installed with `--no-deps`.
const SGLANG_REQUIREMENT: &str = "sglang==0.5.23";

/// The SGLang virtualenv with the kvpool wheel of `profile` installed; returns its python.
fn ready_venv(profile: &str) -> Result<PathBuf, String> {
    let python = python312()?;
    let tools = ensure_tools(&python)?;
    let venv_python = ensure_venv(
        &python,
        &tools,
        "sglang-venv",
        "kvpool-py/tests_sglang/requirements-sglang.txt",
        SGLANG_REQUIREMENT,
    )?;
    install_wheel(&tools, &venv_python, profile)?;
    Ok(venv_python)
}

/// `cargo xtask sglang [pytest args...]`.
pub(crate) fn sglang(pytest_args: &[String]) -> Result<(), String> {
    let started = Instant::now();
    // The same as the vLLM tests': the wheel's build, and Redis for the shared-tier test.
    ensure_system_packages(crate::vllm::PACKAGES)?;
    let venv_python = ready_venv("dev")?;
    let suite = crate::vllm::suite_env(&venv_python)?;
    let suite: Vec<(&str, &str)> = suite.iter().map(|(k, v)| (*k, v.as_str())).collect();
    eprintln!("SGLang environment ready in {:.0?}", started.elapsed());
    run_pytest(
        "cargo xtask sglang",
        &venv_python,
        "kvpool-py/tests_sglang",
        pytest_args,
        &suite,
        started,
    )
}

/// `cargo xtask bench-sglang [args...]`: kvpool's disk and memory tiers as SGLang's storage
/// backend against SGLang's own `file` backend and a plain copy, on SGLang's host pool (release
/// wheel; see `kvpool-py/bench/bench_sglang.py`).
pub(crate) fn bench_sglang(args: &[String]) -> Result<(), String> {
    let venv_python = ready_venv("release")?;
    let out = target_dir().join("bench-sglang.json");
    let mut cmd = vec![
        "kvpool-py/bench/bench_sglang.py".to_string(),
        "--out".into(),
        path_str(&out)?.to_string(),
    ];
    cmd.extend(args.iter().cloned());
    let cmd: Vec<&str> = cmd.iter().map(String::as_str).collect();
    run_with_env(path_str(&venv_python)?, &cmd, &[])?;
    eprintln!("results in {}", out.display());
    Ok(())
}
