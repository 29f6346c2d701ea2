//! `cargo xtask gpu-bundle`: what a lent GPU machine (no Rust toolchain, no vLLM) needs to
//! check kvpool's GPU path, built here; CI dry-runs it on CPU tensors inside the vLLM suite.

use std::path::PathBuf;

use crate::python_env::{build_wheel, ensure_tools, path_str, python312, target_dir, tested_wheel};
use crate::{run, workspace_root};

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
    let wheel = match (&wheel_kind, tested_wheel()) {
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
