//! `cargo xtask fuzz [--seconds N]`: runs every cargo-fuzz target in `fuzz/` for N seconds
//! (default 30) with libFuzzer on the nightly toolchain (`--sanitizer none`: the toolchain has
//! no rust-src for sanitizer builds), starting from the seeds in `fuzz/seeds/<target>`. New
//! inputs go to `target/fuzz-corpus/<target>`, never into the repository. Any crash, hang
//! (10 s per input) or OOM (2 GiB) fails the run and names the reproducer.

use std::process::{Command, Stdio};

use crate::workspace_root;

/// Every target in fuzz/Cargo.toml.
const TARGETS: &[&str] = &[
    "chunk_decode",
    "connector_metadata",
    "pool_config_toml",
    "tier_url",
    "cache_key_text",
    "trace_lines",
    "daemon_request",
    "lookup_frames",
    "copy_check",
    "host_ranges",
];

/// The cargo-fuzz release installed when it is missing.
const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// `cargo` on the nightly toolchain, run in `fuzz/`, with nothing of the stable toolchain
/// the calling `cargo xtask` put in the environment.
fn nightly_cargo() -> Command {
    let mut c = Command::new("rustup");
    c.args(["run", "nightly", "cargo"])
        .current_dir(workspace_root().join("fuzz"))
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("CARGO")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_TARGET_DIR");
    c
}

fn has_cargo_fuzz() -> bool {
    nightly_cargo()
        .args(["fuzz", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn check(mut c: Command, what: &str) -> Result<(), String> {
    let status = c.status().map_err(|e| format!("cannot run {what}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed with {status}"))
    }
}

/// The executions libFuzzer reports at the end of a run (`-print_final_stats=1`).
fn executions(log: &str) -> Option<u64> {
    log.lines()
        .find_map(|l| l.strip_prefix("stat::number_of_executed_units:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Runs the fuzz targets; see the module docs.
pub fn fuzz(args: &[String]) -> Result<(), String> {
    let seconds: u64 = match args {
        [] => 30,
        [flag, n] if flag == "--seconds" => n
            .parse()
            .map_err(|_| format!("--seconds wants a number, not `{n}`"))?,
        _ => return Err("usage: cargo xtask fuzz [--seconds N]".into()),
    };
    let toolchain = Command::new("rustup")
        .args(["run", "nightly", "rustc", "--version"])
        .env_remove("RUSTUP_TOOLCHAIN")
        .output();
    match toolchain {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            return Err(format!(
                "fuzzing needs the nightly toolchain (rustup toolchain install nightly); \
                 `rustup run nightly rustc --version` exited with {}: {}",
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            ));
        }
        Err(e) => {
            return Err(format!(
                "fuzzing needs rustup and the nightly toolchain: {e}"
            ));
        }
    }
    if !has_cargo_fuzz() {
        eprintln!("\n==> cargo install cargo-fuzz {CARGO_FUZZ_VERSION}");
        let mut c = Command::new("cargo");
        c.args([
            "install",
            "cargo-fuzz",
            "--locked",
            "--version",
            CARGO_FUZZ_VERSION,
        ]);
        check(c, "cargo install cargo-fuzz")?;
    }
    eprintln!("\n==> cargo +nightly fuzz build --sanitizer none -O");
    let mut build = nightly_cargo();
    build.args(["fuzz", "build", "--sanitizer", "none", "-O"]);
    check(build, "building the fuzz targets")?;
    let root = workspace_root();
    let mut rows = Vec::new();
    let mut failed = Vec::new();
    for target in TARGETS {
        let corpus = root.join("target/fuzz-corpus").join(target);
        std::fs::create_dir_all(&corpus)
            .map_err(|e| format!("cannot create {}: {e}", corpus.display()))?;
        let seeds = root.join("fuzz/seeds").join(target);
        eprintln!("\n==> fuzz {target} for {seconds} s");
        let mut run = nightly_cargo();
        run.args(["fuzz", "run", "--sanitizer", "none", "-O", target])
            .arg(&corpus);
        if seeds.is_dir() {
            run.arg(&seeds);
        }
        let out = run
            .args([
                "--",
                &format!("-max_total_time={seconds}"),
                "-timeout=10",
                "-rss_limit_mb=2048",
                "-print_final_stats=1",
            ])
            .stdout(Stdio::inherit())
            .output()
            .map_err(|e| format!("cannot run the {target} fuzzer: {e}"))?;
        let log = String::from_utf8_lossy(&out.stderr);
        let runs = executions(&log);
        if !out.status.success() {
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
            failed.push(target.to_string());
        }
        rows.push((
            target.to_string(),
            runs,
            if out.status.success() { "ok" } else { "CRASH" },
        ));
    }
    println!("\n== fuzzing, {seconds} s per target ==");
    println!("{:<20} {:>14}  result", "target", "executions");
    for (target, runs, result) in &rows {
        let runs = runs.map_or("?".to_string(), |r| r.to_string());
        println!("{target:<20} {runs:>14}  {result}");
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "fuzz targets failed: {} (reproducers under fuzz/artifacts/)",
            failed.join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::executions;

    #[test]
    fn final_stats_give_the_executions() {
        let log = "#1024 DONE cov: 10\nstat::number_of_executed_units: 2253209\nstat::average_exec_per_sec: 140825\n";
        assert_eq!(executions(log), Some(2_253_209));
        assert_eq!(executions("crashed"), None);
    }

    #[test]
    fn every_target_is_declared_in_the_fuzz_crate() {
        let manifest =
            std::fs::read_to_string(crate::workspace_root().join("fuzz/Cargo.toml")).unwrap();
        for t in super::TARGETS {
            assert!(manifest.contains(&format!("name = \"{t}\"")), "{t}");
        }
        assert_eq!(manifest.matches("[[bin]]").count(), super::TARGETS.len());
    }
}
