//! `cargo xtask ci`: the CI gate's stages in order, each timed (`CiClock`).

use std::env;
use std::process::Command;
use std::time::Instant;

use crate::{
    WORKSPACE_TEST_TARGETS, ensure_system_packages, fuzz, gpu_bundle, matrix, module_cycles,
    python_env, run, sanitize, sglang, soak_command, system, third_party, vllm, wheel,
};

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

/// The test suites whose `#[ignore]`d tests need this machine's packages or root, not a
/// server: CI's workspace stage runs them after installing the packages.
const MACHINE_TEST_SUITES: &[&str] = &["prometheus", "systemd_unit", "daemon_restart"];

/// Runs every CI stage in order; stops at the first that fails.
pub(crate) fn ci() -> Result<(), String> {
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
    clock.stage("workspace tests", || {
        if has_nextest() {
            run(
                cargo,
                &[
                    "nextest",
                    "run",
                    "--workspace",
                    "--all-features",
                    "--no-fail-fast",
                ],
            )?;
        } else {
            eprintln!("cargo-nextest not found; using cargo test");
            run(cargo, &[&["test"], WORKSPACE_TEST_TARGETS].concat())?;
        }
        // The tests of what the system packages above installed (Prometheus, systemd) and of
        // what needs root (a memory cgroup): ignored in a plain `cargo test`, which reports
        // them so; here they run, and fail without what they need.
        run(
            cargo,
            &[
                &["test", "--workspace", "--all-features"][..],
                &MACHINE_TEST_SUITES
                    .iter()
                    .flat_map(|suite| ["--test", suite])
                    .collect::<Vec<_>>()[..],
                &["--", "--ignored"],
            ]
            .concat(),
        )
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
    python_env::test_the_release_wheel(wheel);
    // The GPU bundle, as a lent GPU machine gets it but carrying the wheel the vLLM suite
    // installs (the release wheel), is dry-run on CPU tensors by the vLLM suite's
    // `test_gpu_check.py`.
    let bundle = clock.stage_value("gpu bundle", || {
        gpu_bundle::build_gpu_bundle("dev", gpu_bundle::BundleWheel::AsTested)
    })?;
    let bundle = python_env::path_str(&bundle)?.to_string();
    clock.stage("vllm", || {
        vllm::vllm_with_env(&[], &[("KVPOOL_GPU_BUNDLE", bundle.as_str())])
    })?;
    clock.stage("sglang", || sglang::sglang(&[]))
}
