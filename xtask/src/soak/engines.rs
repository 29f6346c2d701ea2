//! The simulated engines every soak runs (`kvpool sim` soaking against a pool) and how their
//! JSON reports are read and printed.

use std::path::Path;
use std::process::Command;

use super::{CALM_SECS, SoakArgs};

/// `kvpool sim` soaking for `args.minutes` against the pool `config` describes, its JSON
/// report to `out` and its log to `log`; it checks its own outcome (wrong tokens, acknowledged
/// writes, resident memory) and exits non-zero when one fails.
pub(crate) fn sim_command(
    kvpool: &Path,
    config: &Path,
    args: &SoakArgs,
    seed: u64,
    out: &Path,
    log: &Path,
) -> Result<Command, String> {
    let mut sim = Command::new(kvpool);
    sim.arg("sim")
        .arg("--config")
        .arg(config)
        .args(["--soak-minutes", &args.minutes.to_string()])
        .args(["--calm-wait-secs", &CALM_SECS.to_string()])
        .args([
            "--cpu-size",
            "2MiB",
            "--prefixes",
            "64",
            "--gpu-blocks",
            "512",
            // Real faults make loads fail; the simulator's own removals between lookup and
            // load can be undone by a write-behind still in flight to a lower tier.
            "--load-failure-rate",
            "0",
        ])
        .args(["--seed", &seed.to_string(), "--json"])
        .args(["--max-rss-growth", &args.max_rss_growth.to_string()])
        .args(["--rss-slack", &format!("{}MiB", args.rss_slack_mib)])
        .env("KVPOOL_LOG", "error")
        .env("MALLOC_ARENA_MAX", "2")
        // glibc's per-thread caches keep freed small blocks (up to 7 of each size class per
        // thread), which glibc counts as in use and which fill slowly as rare sizes come by:
        // an engine attached to the daemon gained 0.7 MiB of "heap in use" over 8 minutes
        // from them, while heaptrack saw its live bytes flat (docs/reliability.md). Off, the
        // memory check sees the program's memory, not the allocator's caches.
        .env("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")
        .stdout(std::fs::File::create(out).map_err(|e| e.to_string())?)
        .stderr(std::fs::File::create(log).map_err(|e| e.to_string())?);
    Ok(sim)
}

/// Prints what a simulator's JSON report says about correctness and memory.
pub(crate) fn print_sim_report(report: &str) {
    let field = |name: &str| {
        report
            .split(&format!("\"{name}\":"))
            .nth(1)
            .and_then(|rest| rest.split([',', '\n', '}']).next())
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|| "?".into())
    };
    for (what, name) in [
        ("requests served", "requests"),
        ("tokens loaded from kvpool", "pool_hit_tokens"),
        ("blocks reported as failed loads", "reported_failed_blocks"),
        ("wrong tokens (must be 0)", "wrong_tokens"),
        (
            "lost blocks not reported (must be 0)",
            "unreported_failed_blocks",
        ),
        (
            "anonymous RSS after warm-up (bytes)",
            "rss_after_warm_up_bytes",
        ),
        ("anonymous RSS at the end (bytes)", "rss_end_bytes"),
    ] {
        println!("{what:<40} {:>8}", field(name));
    }
    let lost: Vec<String> = report
        .split("\"lost_chunks\":")
        .skip(1)
        .filter_map(|rest| rest.split([',', '\n', '}']).next())
        .map(|v| v.trim().to_string())
        .collect();
    println!(
        "{:<40} {:>8}",
        "lost acknowledged writes per tier",
        lost.join(" / ")
    );
    print_rss_timeline(report);
}

/// The simulator's memory timeline from its JSON report (`rss_timeline`: seconds, RSS,
/// anonymous RSS and heap in use, in bytes), pretty-printed or not.
fn rss_timeline(report: &str) -> Vec<[u64; 4]> {
    let Some(rest) = report.split("\"rss_timeline\":").nth(1) else {
        return Vec::new();
    };
    // The array ends where its brackets balance.
    let mut depth = 0;
    let mut end = 0;
    for (i, c) in rest.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            _ => continue,
        }
        if depth == 0 {
            end = i + 1;
            break;
        }
    }
    let numbers: Vec<u64> = rest[..end]
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect();
    numbers
        .chunks_exact(4)
        .map(|s| [s[0], s[1], s[2], s[3]])
        .collect()
}

/// Prints the memory timeline, one sample per line, so a run's growth can be read without its
/// scratch directory.
fn print_rss_timeline(report: &str) {
    let timeline = rss_timeline(report);
    if timeline.is_empty() {
        return;
    }
    println!("memory timeline (s: RSS / anonymous RSS / heap in use, MiB)");
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    for [second, rss, anon, heap] in timeline {
        println!(
            "    {second:>6} s: {:>7.1} / {:>7.1} / {:>7.1}",
            mib(rss),
            mib(anon),
            mib(heap)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timeline_is_read_from_compact_and_pretty_reports() {
        let compact =
            r#"{"rss_end_bytes":5,"rss_timeline":[[10,1,2,3],[20,4,5,6]],"x":[[7,7,7,7]]}"#;
        assert_eq!(rss_timeline(compact), [[10, 1, 2, 3], [20, 4, 5, 6]]);
        let pretty = "{\n  \"rss_timeline\": [\n    [\n      10,\n      1,\n      2,\n      3\n    ]\n  ],\n  \"y\": [[9, 9, 9, 9]]\n}";
        assert_eq!(rss_timeline(pretty), [[10, 1, 2, 3]]);
        assert!(rss_timeline("{}").is_empty());
    }
}
