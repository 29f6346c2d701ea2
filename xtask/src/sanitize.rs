//! `cargo xtask sanitize`: kvpool-core's unit tests (memory pool and arena, transfers, block
//! copies over raw pointers, eviction, the storage manager) built with AddressSanitizer on
//! the nightly toolchain. Only kvpool's own code is instrumented (the toolchain has no
//! rust-src to rebuild std with it), which is where its `unsafe` blocks are.

use std::process::Command;

use crate::workspace_root;

/// Runs the sanitized tests; any report or failure fails the run.
pub fn sanitize() -> Result<(), String> {
    let target = "x86_64-unknown-linux-gnu";
    let args = [
        "run",
        "nightly",
        "cargo",
        "test",
        "-p",
        "kvpool-core",
        "--lib",
        "--target",
        target,
    ];
    eprintln!(
        "\n==> RUSTFLAGS=-Zsanitizer=address rustup {}",
        args.join(" ")
    );
    let status = Command::new("rustup")
        .args(args)
        .current_dir(workspace_root())
        // `--target` keeps the flag off build scripts and proc macros.
        .env("RUSTFLAGS", "-Zsanitizer=address")
        .env("RUSTDOCFLAGS", "-Zsanitizer=address")
        .env("CARGO_TARGET_DIR", workspace_root().join("target/asan"))
        .env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=1")
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("CARGO")
        .status()
        .map_err(|e| format!("cannot run rustup: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("AddressSanitizer run failed with {status}"))
    }
}
