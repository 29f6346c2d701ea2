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

mod bench;
mod ci;
mod diagrams;
mod fuzz;
mod gpu_bundle;
mod matrix;
mod module_cycles;
mod python_env;
mod sanitize;
mod servers;
mod sglang;
mod soak;
mod system;
mod third_party;
mod vllm;
mod vllm_bench;
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

/// `cargo xtask soak [--daemon] ...`: the chaos soak of the tiers, or of the pool daemon.
pub(crate) fn soak_command(args: &[String]) -> Result<(), String> {
    let args = soak::parse_args(args)?;
    if args.daemon {
        soak::daemon::soak_daemon(&args)
    } else {
        soak::soak(&args)
    }
}

/// Runs a command in the workspace root, echoing it; Err if it fails to start or exits non-zero.
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

fn main() -> ExitCode {
    system::use_system_rocksdb_if_compatible();
    let task = env::args().nth(1);
    let result = match task.as_deref() {
        Some("ci") => ci::ci(),
        Some("bench") => bench::bench(),
        Some("matrix") => matrix::matrix(),
        Some("bench-backends") => bench::bench_backends(),
        Some("bench-mooncake") => {
            bench::bench_mooncake(env::args().nth(2).as_deref() == Some("--in-namespace"))
        }
        Some("gpu-bundle") => {
            gpu_bundle::gpu_bundle(&env::args().skip(2).collect::<Vec<_>>()).map(|_| ())
        }
        Some("sanitize") => sanitize::sanitize(),
        Some("module-cycles") => module_cycles::module_cycles(),
        Some("diagrams") => diagrams::diagrams(),
        Some("soak") => soak_command(&env::args().skip(2).collect::<Vec<_>>()),
        Some("fuzz") => fuzz::fuzz(&env::args().skip(2).collect::<Vec<_>>()),
        Some("vllm") => vllm::vllm(&env::args().skip(2).collect::<Vec<_>>()),
        Some("sglang") => sglang::sglang(&env::args().skip(2).collect::<Vec<_>>()),
        Some("bench-sglang") => sglang::bench_sglang(&env::args().skip(2).collect::<Vec<_>>()),
        Some("bench-vllm") => vllm_bench::bench_vllm(&env::args().skip(2).collect::<Vec<_>>()),
        Some("bench-async") => vllm_bench::bench_async(&env::args().skip(2).collect::<Vec<_>>()),
        Some("bench-disagg") => vllm_bench::bench_disagg(&env::args().skip(2).collect::<Vec<_>>()),
        Some("bench-serve") => vllm_bench::bench_serve(&env::args().skip(2).collect::<Vec<_>>()),
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
