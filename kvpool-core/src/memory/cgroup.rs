//! How much more memory this process's cgroup (and every cgroup above it) lets it take:
//! cgroup v2 (`memory.max` − `memory.current`) or v1 (`memory.limit_in_bytes` −
//! `memory.usage_in_bytes`), read from `/proc/self/cgroup` and `/sys/fs/cgroup`.

use std::path::{Path, PathBuf};

/// Bytes this process may still take before its tightest cgroup memory limit, or `None` when
/// no limit applies (no cgroup, no memory controller, or every limit is "max").
pub fn memory_headroom() -> Option<u64> {
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    headroom_in(Path::new("/sys/fs/cgroup"), &membership)
}

/// [`memory_headroom`] for a `/proc/self/cgroup` text under a cgroup mount at `root`.
fn headroom_in(root: &Path, membership: &str) -> Option<u64> {
    let mut tightest: Option<u64> = None;
    for line in membership.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let (base, limit_file, usage_file) = if id == "0" && controllers.is_empty() {
            (root.to_path_buf(), "memory.max", "memory.current")
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                root.join("memory"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        } else {
            continue;
        };
        for dir in ancestors(&base, path) {
            let (Some(limit), Some(usage)) = (
                read_bytes(&dir.join(limit_file)),
                read_bytes(&dir.join(usage_file)),
            ) else {
                continue;
            };
            // v1 writes "no limit" as a page-rounded i64::MAX.
            if limit >= i64::MAX as u64 / 2 {
                continue;
            }
            let room = limit.saturating_sub(usage);
            tightest = Some(tightest.map_or(room, |t| t.min(room)));
        }
    }
    tightest
}

/// `base` joined with `path` and each of its parents, deepest first.
fn ancestors(base: &Path, path: &str) -> Vec<PathBuf> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    (0..=parts.len())
        .rev()
        .map(|n| {
            parts[..n]
                .iter()
                .fold(base.to_path_buf(), |dir, p| dir.join(p))
        })
        .collect()
}

/// A cgroup memory file's number; `None` when absent or "max".
fn read_bytes(file: &Path) -> Option<u64> {
    std::fs::read_to_string(file).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(name), text).unwrap();
    }

    #[test]
    fn the_tightest_limit_of_the_cgroup_and_its_parents_wins_in_v1_and_v2() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        // v2: the service's own limit is loose, its parent's is tight.
        write(&r.join("system.slice"), "memory.max", "1000\n");
        write(&r.join("system.slice"), "memory.current", "900\n");
        write(
            &r.join("system.slice/kvpool.service"),
            "memory.max",
            "max\n",
        );
        write(
            &r.join("system.slice/kvpool.service"),
            "memory.current",
            "10\n",
        );
        assert_eq!(
            headroom_in(r, "0::/system.slice/kvpool.service\n"),
            Some(100)
        );
        // v1: the memory controller's own hierarchy; "unlimited" is a huge number.
        write(&r.join("memory/kv"), "memory.limit_in_bytes", "4096\n");
        write(&r.join("memory/kv"), "memory.usage_in_bytes", "1024\n");
        write(
            &r.join("memory"),
            "memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        write(&r.join("memory"), "memory.usage_in_bytes", "5\n");
        assert_eq!(headroom_in(r, "4:memory:/kv\n3:cpuset:/\n"), Some(3072));
        assert_eq!(headroom_in(r, "3:cpuset:/\n"), None);
        // Usage over the limit (reclaim pending): no room, not an underflow.
        write(&r.join("memory/over"), "memory.limit_in_bytes", "10\n");
        write(&r.join("memory/over"), "memory.usage_in_bytes", "20\n");
        assert_eq!(headroom_in(r, "4:memory:/over\n"), Some(0));
    }
}
