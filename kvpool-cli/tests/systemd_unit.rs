//! deploy/systemd/kvpool.service works as written: `systemd-analyze verify` finds nothing to
//! say about it (in a root holding the `kvpool` this build made at the path the unit's install
//! comment puts it, /usr/local/bin/kvpool), and `systemd-analyze security` rates its sandbox's
//! exposure at most 4.0 of 10 ("OK"; its `--threshold` counts tenths).

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `systemd-analyze`, which the test needs (it fails without it).
fn systemd_analyze() -> &'static str {
    let found = Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "`systemd-analyze` is missing: `apt-get install systemd` (`cargo xtask ci` installs it)"
    );
    "systemd-analyze"
}

/// A root for `systemd-analyze --root`: systemd's own units, the unit, and the binary.
fn unit_root(unit: &str) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let lib = root.path().join("usr/lib/systemd");
    std::fs::create_dir_all(&lib).unwrap();
    let copied = Command::new("cp")
        .args(["-a", "/usr/lib/systemd/system"])
        .arg(&lib)
        .status()
        .unwrap();
    assert!(copied.success(), "cannot copy systemd's units");
    let bin = root.path().join("usr/local/bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::copy(env!("CARGO_BIN_EXE_kvpool"), bin.join("kvpool")).unwrap();
    let units = root.path().join("etc/systemd/system");
    std::fs::create_dir_all(&units).unwrap();
    std::fs::write(units.join("kvpool.service"), unit).unwrap();
    root
}

fn analyze(tool: &str, root: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(tool)
        .args(args)
        .arg(format!("--root={}", root.display()))
        .arg("kvpool.service")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
#[ignore = "needs Debian's systemd; `cargo xtask ci` runs it"]
fn the_systemd_unit_verifies_cleanly_and_is_sandboxed() {
    let tool = systemd_analyze();
    let unit = std::fs::read_to_string(repo().join("deploy/systemd/kvpool.service")).unwrap();
    assert!(
        unit.contains("--root /usr/local") && unit.contains("ExecStart=/usr/local/bin/kvpool "),
        "the install comment and ExecStart name the same binary"
    );
    let root = unit_root(&unit);
    let (ok, said) = analyze(tool, root.path(), &["verify"]);
    // `verify` exits 0 after a value it ignores: anything it says is a failure here.
    assert!(
        ok && said.trim().is_empty(),
        "systemd-analyze verify: {said}"
    );
    let (ok, said) = analyze(
        tool,
        root.path(),
        &["security", "--offline=true", "--threshold=40"],
    );
    assert!(ok, "systemd-analyze security: {said}");

    // Control: a value systemd ignores is caught.
    let broken = unit.replace("ProtectSystem=strict", "ProtectSystem=everything");
    let root = unit_root(&broken);
    let (_, said) = analyze(tool, root.path(), &["verify"]);
    assert!(
        said.contains("ProtectSystem") || said.contains("protect system"),
        "{said}"
    );
}
