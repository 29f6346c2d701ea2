//! `cargo xtask wheel`: the portable release wheel an operator installs with `pip` and no Rust
//! toolchain, checked and tried the way such an operator gets it.
//!
//! - Built with maturin's zig linker for `manylinux_2_28` (glibc 2.28: Ubuntu 20.04+, RHEL 8+,
//!   Debian 11+), abi3 for CPython 3.10 and later, with RocksDB compiled from the `rocksdb`
//!   crate's bundled source and linked statically (never the build machine's librocksdb), TLS
//!   through rustls (no libssl), and the `kvpool` command (`kvpool serve`) as its entry point.
//! - `auditwheel show` must find it consistent with `manylinux_2_28_x86_64`: not assumed.
//! - Installed into fresh virtualenvs of Python 3.10 and 3.12 whose `PATH` has no `cargo` or
//!   `rustc`, then `kvpool-py/tests/test_installed_command.py` run there: the import, and
//!   `kvpool serve` started from the install with a disk tier and driven by its `kvpool bench`.
//!
//! Its own target directory (`target/wheel-release`): the zig linker, the release profile and
//! the bundled RocksDB share nothing with the workspace's debug builds.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::python_env::{ensure_tools, path_str, python312, target_dir};
use crate::workspace_root;

/// The manylinux policy the wheel must meet.
pub(crate) const POLICY: &str = "manylinux_2_28";

/// Tools the build and the check need besides uv and maturin, in the tool virtualenv.
const WHEEL_TOOLS: &[&str] = &["ziglang==0.13.0", "auditwheel==6.8.2"];

/// `cargo xtask wheel [--skip-smoke]`: builds, checks and tries the wheel; returns its path.
pub(crate) fn wheel(args: &[String]) -> Result<PathBuf, String> {
    let skip_smoke = args.iter().any(|a| a == "--skip-smoke");
    let python = python312()?;
    let tools = ensure_tools(&python)?;
    ensure_wheel_tools(&tools)?;
    let wheel = build(&tools, &python)?;
    check_policy(&tools, &wheel)?;
    if !skip_smoke {
        for version in ["3.10", "3.12"] {
            smoke_test(&tools, &wheel, version)?;
        }
    }
    println!(
        "wheel: {} ({POLICY}, checked by auditwheel)",
        wheel.display()
    );
    Ok(wheel)
}

fn ensure_wheel_tools(tools: &Path) -> Result<(), String> {
    let marker = tools.join("../.kvpool-wheel-tools");
    let wanted = WHEEL_TOOLS.join("\n");
    if std::fs::read_to_string(&marker).ok().as_deref() == Some(wanted.as_str()) {
        return Ok(());
    }
    let mut args = vec!["install", "--quiet", "--disable-pip-version-check"];
    args.extend(WHEEL_TOOLS);
    crate::run(path_str(&tools.join("pip"))?, &args)?;
    std::fs::write(&marker, wanted).map_err(|e| e.to_string())
}

/// The include directory of libclang's own headers (`stdarg.h`, …), which bindgen does not
/// find by itself when it generates RocksDB's bindings for a cross target.
fn clang_builtin_includes() -> Result<PathBuf, String> {
    let mut found: Vec<PathBuf> = glob_dirs("/usr/lib", "llvm-")
        .into_iter()
        .flat_map(|llvm| glob_dirs(&llvm.join("lib/clang").to_string_lossy(), ""))
        .map(|version| version.join("include"))
        .filter(|include| include.join("stdarg.h").exists())
        .collect();
    found.sort();
    found.pop().ok_or_else(|| {
        "no libclang headers (stdarg.h) under /usr/lib/llvm-*: apt-get install libclang-dev".into()
    })
}

/// Subdirectories of `dir` whose names start with `prefix`.
fn glob_dirs(dir: &str, prefix: &str) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default()
}

fn build(tools: &Path, python: &Path) -> Result<PathBuf, String> {
    let out = target_dir().join("wheel-dist");
    let _ = std::fs::remove_dir_all(&out);
    let includes = clang_builtin_includes()?;
    let mut command = Command::new(tools.join("maturin"));
    command
        .args(["build", "--release", "--zig", "--compatibility", POLICY])
        .args([
            "--target",
            "x86_64-unknown-linux-gnu",
            "-m",
            "kvpool-py/Cargo.toml",
        ])
        .arg("-i")
        .arg(python)
        .arg("-o")
        .arg(&out)
        .current_dir(workspace_root())
        // The bundled RocksDB, linked statically: never the build machine's library.
        .env_remove("ROCKSDB_LIB_DIR")
        .env_remove("ROCKSDB_STATIC")
        .env("CARGO_TARGET_DIR", target_dir().join("wheel-release"))
        .env(
            "BINDGEN_EXTRA_CLANG_ARGS",
            format!("-I{}", path_str(&includes)?),
        )
        // maturin runs `python -m ziglang` from the tool virtualenv.
        .env("PATH", prepend_path(tools)?);
    run_timed("maturin build (release, zig, manylinux_2_28)", command)?;
    std::fs::read_dir(&out)
        .map_err(|e| e.to_string())?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| "maturin built no wheel".to_string())
}

fn prepend_path(dir: &Path) -> Result<String, String> {
    Ok(format!(
        "{}:{}",
        path_str(dir)?,
        std::env::var("PATH").unwrap_or_default()
    ))
}

/// `auditwheel show`: the wheel must be consistent with [`POLICY`] (no shared library beyond
/// what the policy allows, no symbol newer than glibc 2.28).
fn check_policy(tools: &Path, wheel: &Path) -> Result<(), String> {
    let out = Command::new(tools.join("auditwheel"))
        .arg("show")
        .arg(wheel)
        .output()
        .map_err(|e| format!("cannot run auditwheel: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{text}{}", String::from_utf8_lossy(&out.stderr));
    let tag = format!("{POLICY}_x86_64");
    if !out.status.success() || !text.contains(&tag) {
        return Err(format!(
            "auditwheel does not find {} consistent with {tag}",
            wheel.display()
        ));
    }
    Ok(())
}

/// Installs the wheel into a fresh virtualenv of Python `version` and tries it with a `PATH`
/// that has no Rust toolchain on it: `kvpool-py/tests/test_installed_command.py` (the
/// import, `kvpool serve` over a disk tier, which is RocksDB inside the wheel, and the same
/// install's `kvpool bench` through that daemon), run by that virtualenv's pytest.
fn smoke_test(tools: &Path, wheel: &Path, version: &str) -> Result<(), String> {
    let interpreter = crate::python_env::python_version(version)?;
    let venv = target_dir().join(format!("wheel-smoke-{version}"));
    let uv = tools.join("uv");
    crate::run(
        path_str(&uv)?,
        &[
            "venv",
            "--clear",
            "--python",
            path_str(&interpreter)?,
            path_str(&venv)?,
        ],
    )?;
    let requirement = format!("kvpool[test] @ file://{}", path_str(wheel)?);
    crate::run_with_env(
        path_str(&uv)?,
        &["pip", "install", &requirement],
        &[("VIRTUAL_ENV", path_str(&venv)?)],
    )?;
    let bin = venv.join("bin");
    // A user's PATH: the venv and the system, no ~/.cargo/bin.
    let user_path = format!("{}:/usr/local/bin:/usr/bin:/bin", path_str(&bin)?);
    let user = |program: &Path| {
        let mut c = Command::new(program);
        c.env_clear()
            .env("PATH", &user_path)
            .env("HOME", std::env::var("HOME").unwrap_or_default())
            .current_dir(workspace_root());
        c
    };
    for tool in ["cargo", "rustc"] {
        let found = user(Path::new("/bin/sh"))
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if found {
            return Err(format!("`{tool}` is on the smoke test's PATH {user_path}"));
        }
    }
    let mut test = user(&bin.join("python"));
    test.args([
        "-m",
        "pytest",
        "-v",
        "-p",
        "no:cacheprovider",
        "--noconftest",
    ])
    .arg("kvpool-py/tests/test_installed_command.py");
    run_timed(
        &format!("the installed wheel's tests (Python {version})"),
        test,
    )
}

fn run_timed(what: &str, mut command: Command) -> Result<(), String> {
    eprintln!("\n==> {what}");
    let started = Instant::now();
    let status = command
        .status()
        .map_err(|e| format!("cannot start {what}: {e}"))?;
    eprintln!("<== {what} ({}s, {status})", started.elapsed().as_secs());
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed with {status}"))
    }
}
