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

#[cfg(test)]
mod tests {
    use crate::workspace_root;

    /// Every `unsafe` block and `unsafe impl` in kvpool's crates says why it is sound: a
    /// `SAFETY:` comment within the six lines above it.
    #[test]
    fn every_unsafe_block_has_a_safety_comment() {
        let mut missing = Vec::new();
        let root = workspace_root();
        let mut stack: Vec<std::path::PathBuf> = std::fs::read_dir(&root)
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("kvpool-"))
            })
            .map(|p| p.join("src"))
            .collect();
        while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                if path.extension().is_none_or(|e| e != "rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                let lines: Vec<&str> = text.lines().collect();
                for (i, line) in lines.iter().enumerate() {
                    let code = line.split("//").next().unwrap_or("");
                    let is_unsafe =
                        code.contains("unsafe {") || code.trim_start().starts_with("unsafe impl");
                    if is_unsafe
                        && !lines[i.saturating_sub(6)..=i]
                            .iter()
                            .any(|l| l.contains("SAFETY"))
                    {
                        missing.push(format!("{}:{}: {}", path.display(), i + 1, line.trim()));
                    }
                }
            }
        }
        assert!(
            missing.is_empty(),
            "unsafe without a SAFETY comment:\n{}",
            missing.join("\n")
        );
    }
}
