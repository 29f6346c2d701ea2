//! `cargo xtask bench`, `bench-backends` and `bench-mooncake`: the criterion benchmarks and the
//! remote tiers against their own clients, each in one run.

use std::env;
use std::process::Command;

use crate::{matrix, run, run_with_env, servers, workspace_root};

/// `cargo xtask bench`: the criterion benchmarks of kvpool-core, kvpool-backends and
/// kvpool-connector, then `kvpool bench` under `/usr/bin/time -v` (peak memory) and
/// `kvpool replay --simulate` on a generated trace.
pub(crate) fn bench() -> Result<(), String> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run(
        &cargo,
        &[
            "bench",
            "-p",
            "kvpool-core",
            "-p",
            "kvpool-backends",
            "-p",
            "kvpool-connector",
        ],
    )?;
    run(&cargo, &["build", "--release", "-p", "kvpool-cli"])?;
    let kvpool = workspace_root().join("target/release/kvpool");
    let kvpool = kvpool.to_str().ok_or("non-UTF-8 path")?;
    let trace = env::temp_dir().join("kvpool-bench-trace.jsonl");
    let trace = trace.to_str().ok_or("non-UTF-8 path")?;
    run(
        "/usr/bin/time",
        &["-v", kvpool, "bench", "--cpu-size", "2GiB"],
    )?;
    run(
        kvpool,
        &["gen-trace", "--out", trace, "--requests", "12000"],
    )?;
    run(
        kvpool,
        &[
            "replay",
            "--trace",
            trace,
            "--simulate",
            "--capacity-tokens",
            "20000000",
        ],
    )?;
    Ok(())
}

/// The remote-tier benchmarks with their baselines in one run: `redis-benchmark` and the
/// criterion `remote` bench against the same Redis, plus moto and RocksDB.
pub(crate) fn bench_backends() -> Result<(), String> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let prepared = servers::prepare()?;
    run(
        &cargo,
        &[
            "bench",
            "-p",
            "kvpool-backends",
            "--all-features",
            "--bench",
            "remote",
            "--no-run",
        ],
    )?;
    let dir = servers::scratch_dir("bench")?;
    let servers = servers::start_servers(&dir, &prepared.moto_server)?;
    let get = |k: &str| {
        servers
            .env
            .iter()
            .find(|(name, _)| name == k)
            .map(|(_, v)| v.clone())
            .ok_or(format!("{k} missing"))
    };
    let redis_url = get("KVPOOL_TEST_REDIS_URL")?;
    let port = redis_url.rsplit(':').next().unwrap_or_default().to_string();
    for (clients, requests) in [("1", "300"), ("8", "1000")] {
        run(
            "redis-benchmark",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-a",
                "kvpool-test",
                "-t",
                "set,get",
                "-d",
                "1048576",
                "-n",
                requests,
                "-c",
                clients,
                "--csv",
            ],
        )?;
    }
    let mut envs: Vec<(String, String)> = servers.env.clone();
    envs.push(("KVPOOL_BENCH_REDIS_URL".into(), redis_url));
    envs.push(("KVPOOL_BENCH_S3_URL".into(), get("KVPOOL_TEST_S3_URL")?));
    envs.push((
        "KVPOOL_BENCH_S3_ENDPOINT".into(),
        get("KVPOOL_TEST_S3_ENDPOINT")?,
    ));
    let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    run_with_env(
        &cargo,
        &[
            "bench",
            "-p",
            "kvpool-backends",
            "--all-features",
            "--bench",
            "remote",
        ],
        &envs,
    )
}

/// The median estimate (ns) criterion recorded for `group/function`.
fn criterion_median_ns(group: &str, function: &str) -> Result<f64, String> {
    let path = workspace_root()
        .join("target/criterion")
        .join(group)
        .join(function)
        .join("new/estimates.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let median = text.find("\"median\"").ok_or("no median in estimates")?;
    json_number_after(&text[median..], "\"point_estimate\":")
}

/// The number following `label` in a flat JSON text.
fn json_number_after(text: &str, label: &str) -> Result<f64, String> {
    let at = text.find(label).ok_or(format!("no {label} in {text}"))? + label.len();
    let digits: String = text[at..]
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '-' | '+'))
        .collect();
    digits
        .parse()
        .map_err(|e| format!("bad number after {label}: {e}"))
}

/// `cargo xtask bench-mooncake`: kvpool's Mooncake tier against Mooncake's own Python client,
/// 1 MiB put/get, in one run on one master and segment holder (in a loopback-only network
/// namespace where possible).
pub(crate) fn bench_mooncake(inside_namespace: bool) -> Result<(), String> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let prepared = servers::prepare()?;
    if !inside_namespace {
        run(
            &cargo,
            &[
                "bench",
                "-p",
                "kvpool-backends",
                "--features",
                "mooncake",
                "--bench",
                "mooncake",
                "--no-run",
            ],
        )?;
        if matrix::can_isolate_network() {
            let exe = env::current_exe().map_err(|e| e.to_string())?;
            let exe = exe.to_str().ok_or("non-UTF-8 path")?;
            return run(
                "unshare",
                &[
                    "--net",
                    "--",
                    "sh",
                    "-c",
                    r#"ip link set lo up && exec "$0" "$@""#,
                    exe,
                    "bench-mooncake",
                    "--in-namespace",
                ],
            );
        }
        eprintln!("warning: no network namespace (needs root); Mooncake listens on all interfaces");
    }
    let dir = servers::scratch_dir("bench-mooncake")?;
    let cluster = servers::start_mooncake(&dir, &prepared.mooncake_venv)?;
    let master = cluster.master_address();
    let python = prepared.mooncake_venv.join("bin/python");
    let script = workspace_root().join("kvpool-backends/benches/mooncake_direct.py");
    let site = std::fs::read_dir(prepared.mooncake_venv.join("lib"))
        .map_err(|e| e.to_string())?
        .filter_map(Result::ok)
        .map(|e| e.path().join("site-packages"))
        .find(|p| p.is_dir())
        .ok_or("no site-packages in the Mooncake venv")?;
    let site = site.display().to_string();
    const PAIRS: [(&str, &str); 6] = [
        ("client_put", "upsert_from"),
        ("client_get", "get_into"),
        ("connector_put", "upsert_from"),
        ("connector_get", "get_into"),
        ("backend_put", "upsert_from"),
        ("backend_get", "get_into"),
    ];
    // The two sides alternate, several rounds, so that drift on this busy machine (master,
    // segment holder and client share its cores) hits both alike; each ratio is a median.
    const ROUNDS: usize = 3;
    let mut rows: Vec<Vec<(f64, f64)>> = vec![Vec::new(); PAIRS.len()];
    for round in 1..=ROUNDS {
        eprintln!(
            "\n==> round {round}/{ROUNDS}, direct: {} {master}",
            script.display()
        );
        let out = Command::new(&python)
            .arg(&script)
            .arg(&master)
            .env("MC_LOG_LEVEL", "WARNING")
            .stderr(std::process::Stdio::inherit())
            .output()
            .map_err(|e| format!("cannot run the direct benchmark: {e}"))?;
        if !out.status.success() {
            return Err("the direct Mooncake benchmark failed".into());
        }
        let direct = String::from_utf8_lossy(&out.stdout).to_string();
        println!("direct Python client, median µs per op: {}", direct.trim());
        run_with_env(
            &cargo,
            &[
                "bench",
                "--offline",
                "-p",
                "kvpool-backends",
                "--features",
                "mooncake",
                "--bench",
                "mooncake",
                "--",
                "--warm-up-time",
                "1",
                "--measurement-time",
                "3",
            ],
            &[
                ("KVPOOL_BENCH_MOONCAKE_MASTER", master.as_str()),
                ("KVPOOL_BENCH_MOONCAKE_SITE", site.as_str()),
                ("MC_LOG_LEVEL", "WARNING"),
            ],
        )?;
        for (row, (function, baseline)) in rows.iter_mut().zip(PAIRS) {
            let ours = criterion_median_ns("mooncake_1MiB", function)? / 1000.0;
            let theirs = json_number_after(&direct, &format!("\"{baseline}\":"))?;
            row.push((ours, theirs));
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "\n== Mooncake 1 MiB: kvpool vs the direct Python client ({ROUNDS} alternating rounds, one master) =="
    );
    println!(
        "{:<14} {:>24} {:>24} {:>22} {:>8}",
        "kvpool op", "kvpool µs per round", "direct µs per round", "ratio per round", "median"
    );
    for (row, (function, baseline)) in rows.iter().zip(PAIRS) {
        let fmt = |v: Vec<String>| v.join(" ");
        let ratios: Vec<f64> = row.iter().map(|(ours, theirs)| theirs / ours).collect();
        println!(
            "{function:<14} {:>24} {:>24} {:>22} {:>7.2}x",
            fmt(row.iter().map(|(o, _)| format!("{o:.0}")).collect()),
            format!(
                "{baseline} {}",
                fmt(row.iter().map(|(_, t)| format!("{t:.0}")).collect())
            ),
            fmt(ratios.iter().map(|r| format!("{r:.2}")).collect()),
            median(ratios.clone())
        );
    }
    println!("(ratio = direct time / kvpool time; above 1 means kvpool is faster)");
    Ok(())
}
