//! `cargo xtask matrix`: every backend's tests against real servers, and a result table.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};

use crate::run;
use crate::servers::{prepare, scratch_dir, start_servers};

/// Test binaries the matrix runs, with the backends they cover.
const SUITES: &[&str] = &["conformance", "disk", "redis", "s3", "mooncake"];

/// Suites run in a private network namespace: Mooncake's transfer engine listens on all
/// interfaces whatever it is told, and a namespace with only loopback keeps it off the network.
const ISOLATED_SUITES: &[&str] = &["mooncake"];

/// Whether this process may create network namespaces (root, or the capability).
pub(crate) fn can_isolate_network() -> bool {
    Command::new("unshare")
        .args(["--net", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// One test's result: suite, test name, libtest's verdict.
type TestRow = (String, String, String);

/// Runs each suite with the servers' environment, one test at a time; returns the test rows
/// and whether every suite passed.
fn run_suites(cargo: &str, env: &[(String, String)]) -> Result<(Vec<TestRow>, bool), String> {
    let isolate = can_isolate_network();
    if !isolate {
        eprintln!(
            "warning: cannot create a network namespace (needs root); Mooncake's test processes \
             will listen on all interfaces while the matrix runs"
        );
    }
    let mut rows = Vec::new();
    let mut all_ok = true;
    for suite in SUITES {
        // `--workspace`, not `-p kvpool-backends`: the features then unify as in the
        // workspace tests, whose build this reuses (alone, the package resolves other
        // features for its dependencies, a second build of most of the tree).
        let args = [
            "test",
            "--workspace",
            "--all-features",
            "--test",
            suite,
            "--",
            // The tests that need a server are ignored outside the matrix.
            "--include-ignored",
            "--test-threads",
            "1",
        ];
        let mut command = if ISOLATED_SUITES.contains(suite) && isolate {
            eprintln!(
                "\n==> (in a network namespace with only loopback) {cargo} {}",
                args.join(" ")
            );
            let mut c = Command::new("unshare");
            c.args([
                "--net",
                "--",
                "sh",
                "-c",
                r#"ip link set lo up && exec "$0" "$@""#,
                cargo,
            ])
            .arg("--offline")
            .args(args);
            c
        } else {
            eprintln!("\n==> {cargo} {}", args.join(" "));
            let mut c = Command::new(cargo);
            c.args(args);
            c
        };
        let out = command
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| format!("cannot run cargo: {e}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        print!("{stdout}");
        all_ok &= out.status.success();
        for line in stdout.lines() {
            if let Some(rest) = line.strip_prefix("test ")
                && let Some((name, result)) = rest.rsplit_once(" ... ")
            {
                rows.push((suite.to_string(), name.to_string(), result.to_string()));
            }
        }
    }
    Ok((rows, all_ok))
}

/// The backend x check table from the kit's report file, then one line per test.
fn render_matrix(report: &str, tests: &[TestRow]) -> String {
    let mut kit: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut backends: Vec<String> = Vec::new();
    for line in report.lines() {
        let mut parts = line.splitn(3, '\t');
        let (Some(backend), Some(check), Some(outcome)) =
            (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if !backends.iter().any(|b| b == backend) {
            backends.push(backend.to_string());
        }
        let short = match outcome {
            "pass" => "pass".to_string(),
            o if o.starts_with("skip: ") => "skip".to_string(),
            _ => "FAIL".to_string(),
        };
        kit.entry(check.to_string())
            .or_default()
            .insert(backend.to_string(), short);
    }
    let width = kit.keys().map(String::len).max().unwrap_or(5).max(5);
    let mut out = format!("{:<width$}", "conformance check");
    for b in &backends {
        out.push_str(&format!("  {b:>13}"));
    }
    out.push('\n');
    for (check, row) in &kit {
        out.push_str(&format!("{check:<width$}"));
        for b in &backends {
            out.push_str(&format!("  {:>13}", row.get(b).map_or("-", String::as_str)));
        }
        out.push('\n');
    }
    out.push_str(
        "(skip: the cpu tier keeps values in process memory, so there is nothing to corrupt)\n",
    );
    out.push_str(&format!("\n{:<80} result\n", "suite / test"));
    for (suite, name, result) in tests {
        out.push_str(&format!("{:<80} {result}\n", format!("{suite} / {name}")));
    }
    out
}

/// Starts the servers, runs the suites, prints the matrix, stops the servers.
pub fn matrix() -> Result<(), String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let prepared = prepare()?;
    // Build first, so server start-up is not raced against a long compile.
    let mut build = vec!["test", "--workspace", "--all-features", "--no-run"];
    for suite in SUITES {
        build.extend(["--test", suite]);
    }
    run(&cargo, &build)?;
    let dir = scratch_dir("matrix")?;
    let report = dir.join("conformance.tsv");
    let (tests, ok) = {
        let mut servers = start_servers(&dir, &prepared.moto_server)?;
        servers.env.push((
            "KVPOOL_TEST_MOONCAKE_VENV".into(),
            prepared.mooncake_venv.display().to_string(),
        ));
        // Mooncake logs to stderr: warnings and errors only.
        servers.env.push(("MC_LOG_LEVEL".into(), "WARNING".into()));
        servers.env.push((
            "KVPOOL_CONFORMANCE_REPORT".into(),
            report.display().to_string(),
        ));
        run_suites(&cargo, &servers.env)?
        // servers stop here, by PID
    };
    let report = std::fs::read_to_string(&report).unwrap_or_default();
    println!(
        "\n== kvpool backend matrix ==\n{}",
        render_matrix(&report, &tests)
    );
    let _ = std::fs::remove_dir_all(&dir);
    if ok {
        Ok(())
    } else {
        Err("some backend tests failed (see the matrix above)".into())
    }
}
