//! A real Prometheus server (Debian's `prometheus`) scrapes `kvpool bench --metrics-listen`
//! while the benchmark runs and is then asked, through its HTTP API, for kvpool's hit tokens
//! and a per-tier latency histogram; `promtool` checks the alert rules in deploy/prometheus and
//! runs their unit tests.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Kills and reaps the benchmark process when dropped (the test never leaves one behind).
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    kvpool_testservers::free_port().unwrap()
}

/// `GET path` on 127.0.0.1:`port`; the body, or `None` if the server does not answer 200.
fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut response = String::new();
    s.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200")
        .then(|| body.to_string())
        .or_else(|| head.starts_with("HTTP/1.0 200").then(|| body.to_string()))
}

/// The result vector of an instant query.
fn query(port: u16, promql: &str) -> Vec<serde_json::Value> {
    let encoded: String = promql
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let Some(body) = http_get(port, &format!("/api/v1/query?query={encoded}")) else {
        return Vec::new();
    };
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    v["data"]["result"].as_array().cloned().unwrap_or_default()
}

/// `name`, a binary of Debian's `prometheus` package, which the test needs (it fails
/// without it).
fn prometheus_binary(name: &'static str) -> &'static str {
    let found = Command::new(name)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "the `{name}` binary is missing: `apt-get install prometheus` (`cargo xtask ci` installs it)"
    );
    name
}

/// deploy/prometheus/kvpool-alerts.yml is valid, and each alert fires on the series that should
/// fire it and stays quiet on healthy ones (kvpool-alerts.test.yml, promtool's unit tests).
#[test]
#[ignore = "needs Debian's prometheus; `cargo xtask ci` runs it"]
fn alert_rules_pass_promtool_check_and_their_unit_tests() {
    let promtool = prometheus_binary("promtool");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/prometheus");
    for args in [
        ["check", "rules", "kvpool-alerts.yml"],
        ["test", "rules", "kvpool-alerts.test.yml"],
    ] {
        let out = Command::new(promtool)
            .args(args)
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
#[ignore = "needs Debian's prometheus; `cargo xtask ci` runs it"]
fn prometheus_scrapes_hit_tokens_and_tier_latency_histograms_during_a_bench() {
    let prometheus = prometheus_binary("prometheus");
    let dir = tempfile::tempdir().unwrap();
    let (kvpool_port, prom_port) = (free_port(), free_port());
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: kvpool\n    \
             static_configs:\n      - targets: ['127.0.0.1:{kvpool_port}']\n"
        ),
    )
    .unwrap();
    let _server = kvpool_testservers::Server::start(
        "prometheus",
        Command::new(prometheus)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}")),
        prom_port,
        Some(&dir.path().join("prometheus.log")),
        Duration::from_secs(60),
    )
    .expect("prometheus starts");
    let started = Instant::now();
    while http_get(prom_port, "/-/ready").is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "prometheus not ready: {}",
            std::fs::read_to_string(dir.path().join("prometheus.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    let bench_log = std::fs::File::create(dir.path().join("bench.log")).unwrap();
    let mut bench = Reaped(
        Command::new(env!("CARGO_BIN_EXE_kvpool"))
            .args([
                "bench",
                "--cpu-size",
                "256MiB",
                "--sessions",
                "8",
                "--turns",
                "3",
            ])
            .args(["--system-prompts", "2", "--system-prompt-tokens", "1024"])
            .args(["--metrics-listen", &format!("127.0.0.1:{kvpool_port}")])
            .args(["--metrics-linger", "60"])
            .stdout(Stdio::null())
            .stderr(bench_log)
            .spawn()
            .expect("kvpool bench runs"),
    );

    // Ask while the bench runs and lingers; a range selector, because a scrape that finds
    // the endpoint gone marks the series stale for instant queries.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (hits, buckets) = loop {
        let hits = query(prom_port, "max_over_time(kvpool_hit_tokens_total[5m])");
        let buckets = query(
            prom_port,
            r#"max_over_time(kvpool_tier_op_seconds_bucket{tier="cpu",op="get"}[5m])"#,
        );
        let done = !hits.is_empty() && !buckets.is_empty();
        if done || Instant::now() > deadline {
            break (hits, buckets);
        }
        if let Ok(Some(status)) = bench.0.try_wait() {
            assert!(
                status.success(),
                "kvpool bench failed: {}",
                std::fs::read_to_string(dir.path().join("bench.log")).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let hit_tokens: f64 = hits
        .first()
        .and_then(|r| r["value"][1].as_str())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(hit_tokens > 0.0, "kvpool_hit_tokens_total: {hits:?}");
    assert!(
        buckets.len() > 5,
        "a per-tier latency histogram (buckets by le): {buckets:?}"
    );
    let quantile = query(
        prom_port,
        r#"histogram_quantile(0.5, sum by (le) (max_over_time(kvpool_tier_op_seconds_bucket{tier="cpu",op="get"}[5m])))"#,
    );
    assert!(
        !quantile.is_empty(),
        "Prometheus computes a median tier latency"
    );
}
