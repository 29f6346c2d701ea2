//! The `kvpool` binary as a user runs it.

use std::process::{Command, Output};

fn kvpool(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvpool"))
        .args(args)
        .output()
        .expect("kvpool runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn printed_default_config_is_valid_and_checkable() {
    let out = kvpool(&["config", "--print-default"]);
    assert!(out.status.success());
    let text = stdout(&out);
    let parsed = kvpool_core::PoolConfig::from_toml(&text).unwrap();
    assert_eq!(parsed, kvpool_core::PoolConfig::default());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvpool.toml");
    std::fs::write(&path, text).unwrap();
    let check = kvpool(&["config", "--check", path.to_str().unwrap()]);
    assert!(check.status.success(), "{}", stderr(&check));
    assert!(stdout(&check).contains("ok"));
}

#[test]
fn schemes_lists_every_built_in_backend_with_an_example() {
    let out = kvpool(&["config", "--schemes"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for scheme in ["file", "memory", "mooncakestore", "redis+cluster", "s3"] {
        assert!(
            text.lines().any(|l| l.starts_with(&format!("{scheme} "))),
            "{scheme} missing: {text}"
        );
    }
    assert!(text.contains("url = \"memory://\""), "{text}");
}

#[test]
fn bench_json_reports_hits_on_a_small_workload() {
    let out = kvpool(&[
        "bench",
        "--cpu-size",
        "256MiB",
        "--system-prompts",
        "2",
        "--system-prompt-tokens",
        "512",
        "--sessions",
        "4",
        "--turns",
        "3",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(v["requests"], 12);
    // Every request after a session's first repeats at least its system prompt's two chunks.
    assert!(v["hit_tokens"].as_u64().unwrap() >= 8 * 512);
    assert_eq!(v["hit_tokens"], v["prefill_tokens_saved"]);
    assert_eq!(v["tiers"][0]["name"], "cpu");
}

#[test]
fn bench_drives_lower_tiers_given_by_url_and_rejects_unknown_schemes() {
    let out = kvpool(&[
        "bench",
        "--cpu-size",
        "64MiB",
        "--tier",
        "memory://",
        "--system-prompts",
        "1",
        "--system-prompt-tokens",
        "512",
        "--sessions",
        "8",
        "--turns",
        "2",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(v["tiers"][1]["name"], "memory");
    // 64 MiB of L1 holds only 8 chunks: the lower tier serves some hits.
    assert!(
        v["tiers"][1]["hit_tokens"].as_u64().unwrap() > 0,
        "{}",
        v["tiers"]
    );
    let bad = kvpool(&["bench", "--tier", "ftp://x/y"]);
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("unknown scheme `ftp://`"),
        "{}",
        stderr(&bad)
    );
}

#[test]
fn replay_reports_bad_lines_by_number_and_counts_hits() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.jsonl");
    std::fs::write(
        &path,
        "{\"timestamp\":0,\"input_length\":1024,\"output_length\":1,\"hash_ids\":[1,2]}\n\
         {\"timestamp\":1,\"input_length\":oops}\n\
         {\"timestamp\":2,\"input_length\":1500,\"output_length\":1,\"hash_ids\":[1,2,3]}\n",
    )
    .unwrap();
    for simulate in [true, false] {
        let mut args = vec!["replay", "--trace", path.to_str().unwrap(), "--json"];
        if simulate {
            args.push("--simulate");
        }
        let out = kvpool(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(
            stderr(&out).contains(":2: skipping bad line"),
            "{}",
            stderr(&out)
        );
        let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
        assert_eq!(v["requests"], 2);
        assert_eq!(v["bad_lines"], 1);
        assert_eq!(v["hit_tokens"], 1024);
    }
}

#[test]
fn user_errors_are_messages_not_panics() {
    let small = kvpool(&["bench", "--cpu-size", "1MiB"]);
    assert!(!small.status.success());
    assert!(
        stderr(&small).contains("cannot hold one chunk"),
        "{}",
        stderr(&small)
    );
    let missing = kvpool(&["replay", "--trace", "/nonexistent/trace.jsonl"]);
    assert!(!missing.status.success());
    assert!(stderr(&missing).contains("cannot open trace"));
    let bad_policy = kvpool(&["bench", "--policy", "random"]);
    assert!(!bad_policy.status.success());
    for o in [&small, &missing, &bad_policy] {
        assert!(!stderr(o).contains("panicked"));
    }
}

#[test]
#[cfg(feature = "sim")]
fn sim_drives_the_vllm_protocol_with_failures_and_gets_every_token_right() {
    // 4,000 requests, up to 16 a step, shared prefixes, preemption, reused ids and 5% of
    // loaded chunks lost between lookup and load.
    let out = kvpool(&[
        "sim",
        "--requests",
        "4000",
        "--gpu-blocks",
        "128",
        "--load-failure-rate",
        "0.05",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(v["requests"], 4000);
    assert_eq!(v["wrong_tokens"], 0);
    assert_eq!(v["leaked_request_states"], 0);
    assert_eq!(v["unreported_failed_blocks"], 0);
    for key in [
        "pool_hit_tokens",
        "injected_failures",
        "preemptions",
        "reused_ids",
        "saves_discarded",
    ] {
        assert!(v[key].as_u64().unwrap() > 0, "{key}: {v}");
    }
    assert!(v["max_requests_per_step"].as_u64().unwrap() >= 8, "{v}");
    // Two tensor-parallel ranks, one of them failing loads, and vLLM's asynchronous scheduling.
    let out = kvpool(&[
        "sim",
        "--requests",
        "2000",
        "--gpu-blocks",
        "128",
        "--tp",
        "2",
        "--async-scheduling",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(v["requests"], 2000);
    assert_eq!(v["wrong_tokens"], 0);
    assert_eq!(v["leaked_request_states"], 0);
    assert_eq!(v["unreported_failed_blocks"], 0);
    assert!(v["injected_failures"].as_u64().unwrap() > 0, "{v}");
    assert!(v["async_loads"].as_u64().unwrap() > 0, "{v}");
}

/// `kvpool serve` with two `[[tenant]]`s: a socket each (owner-only without a group), both
/// named in what it prints; SIGTERM stops both. And `--socket` with tenants is refused.
#[test]
fn serve_with_tenants_listens_on_one_socket_per_tenant() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
    let config = dir.path().join("tenants.toml");
    std::fs::write(
        &config,
        format!(
            "[[tenant]]\nname = \"team-a\"\nsocket = \"{}\"\nmemory = \"64MiB\"\n\
             [[tenant]]\nname = \"team-b\"\nsocket = \"{}\"\nmemory = \"32MiB\"\n",
            a.display(),
            b.display()
        ),
    )
    .unwrap();
    let refused = kvpool(&[
        "serve",
        "--config",
        config.to_str().unwrap(),
        "--socket",
        dir.path().join("x.sock").to_str().unwrap(),
    ]);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("drop --socket"),
        "{}",
        stderr(&refused)
    );
    let serve = Command::new(env!("CARGO_BIN_EXE_kvpool"))
        .args(["serve", "--config", config.to_str().unwrap()])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !(a.exists() && b.exists()) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    for socket in [&a, &b] {
        let mode = std::fs::metadata(socket).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", socket.display());
    }
    // SAFETY: signals the child this test started.
    unsafe { libc::kill(serve.id() as i32, libc::SIGTERM) };
    let out = serve.wait_with_output().unwrap();
    assert!(out.status.success());
    let err = stderr(&out);
    for name in ["tenant `team-a`", "tenant `team-b`", "tenant/team-a/"] {
        assert!(err.contains(name), "{err}");
    }
    assert!(
        !a.exists() && !b.exists(),
        "both sockets removed at shutdown"
    );
}

/// A child process killed if the test ends (or fails) before taking it back.
struct KilledOnDrop(Option<std::process::Child>);

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A SIGTERM sent the moment `kvpool serve`'s socket appears (as a supervisor or a test may)
/// stops it cleanly: the daemon catches the signal from before it binds, drains, removes its
/// socket and exits 0. (Caught only after binding, such a signal killed the process and left
/// the socket behind.)
#[test]
fn serve_stopped_as_soon_as_its_socket_appears_exits_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("small.toml");
    std::fs::write(&config, "[local_cpu]\nmax_size = \"16MiB\"\n").unwrap();
    for attempt in 0..10 {
        let socket = dir.path().join(format!("{attempt}.sock"));
        let mut serve = KilledOnDrop(Some(
            Command::new(env!("CARGO_BIN_EXE_kvpool"))
                .args(["serve", "--config", config.to_str().unwrap(), "--socket"])
                .arg(&socket)
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        ));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        // Looked for without sleeping: the signal must come right after the socket appears.
        while !socket.exists() && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert!(socket.exists(), "attempt {attempt}: no socket after 30 s");
        let serve = serve.0.take().unwrap();
        // SAFETY: signals the child this test started.
        unsafe { libc::kill(serve.id() as i32, libc::SIGTERM) };
        let out = serve.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "attempt {attempt}: {:?}\n{}",
            out.status,
            stderr(&out)
        );
        assert!(!socket.exists(), "attempt {attempt}: socket left behind");
    }
}
