//! What the build needs from the machine: Debian packages, and which RocksDB to link.

use std::env;
use std::process::Command;

use crate::{run, run_with_env};

/// Debian packages the full build and its tests need: RocksDB to link the `disk` feature
/// against, libclang for its bindings, Prometheus,
/// which a test runs to scrape kvpool's metrics endpoint (and whose `promtool` checks the alert
/// rules), and systemd, whose `systemd-analyze` checks the daemon's unit.
pub(crate) const SYSTEM_PACKAGES: &[&str] = &[
    "librocksdb-dev",
    "libclang-dev",
    "pkg-config",
    "prometheus",
    "systemd",
];

fn dpkg_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Installs missing [`SYSTEM_PACKAGES`] with apt-get (as root), or says what to install.
pub(crate) fn ensure_system_packages(packages: &[&str]) -> Result<(), String> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| !dpkg_installed(p))
        .collect();
    if missing.is_empty() {
        use_system_rocksdb_if_compatible();
        return Ok(());
    }
    if !is_root() {
        return Err(format!(
            "missing Debian packages: {0}; install them with `sudo apt-get install -y {0}`",
            missing.join(" ")
        ));
    }
    run("apt-get", &["update", "-qq"])?;
    let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
    args.extend(&missing);
    run_with_env("apt-get", &args, &[("DEBIAN_FRONTEND", "noninteractive")])?;
    use_system_rocksdb_if_compatible();
    Ok(())
}

/// RocksDB's major version the pinned `librocksdb-sys` (0.10, bindings of RocksDB 7.9) links
/// against; a system library of another major version may lack symbols the bindings use.
const ROCKSDB_MAJOR: &str = "7";

/// Points `librocksdb-sys` at the system's librocksdb (through `ROCKSDB_LIB_DIR`, inherited
/// by every cargo this process runs) when one of a compatible version is installed, so that
/// the `disk` feature links it instead of compiling RocksDB from C++ (about 10 minutes per
/// profile on 2 cores). Leaves a `ROCKSDB_LIB_DIR` set by the user alone; without a system
/// library the bundled RocksDB is built.
pub(crate) fn use_system_rocksdb_if_compatible() {
    if env::var_os("ROCKSDB_LIB_DIR").is_some() {
        return;
    }
    let pkg_config = |arg: &str| {
        Command::new("pkg-config")
            .args([arg, "rocksdb"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let (Some(version), Some(lib_dir)) =
        (pkg_config("--modversion"), pkg_config("--variable=libdir"))
    else {
        eprintln!(
            "xtask: no system librocksdb found (pkg-config); the disk feature builds RocksDB from source"
        );
        return;
    };
    if version.split('.').next() != Some(ROCKSDB_MAJOR) {
        eprintln!(
            "xtask: system librocksdb {version} is not RocksDB {ROCKSDB_MAJOR}.x; the disk feature builds RocksDB from source"
        );
        return;
    }
    eprintln!("xtask: linking the system librocksdb {version} from {lib_dir}");
    // SAFETY: xtask runs its steps on its main thread; no other thread of this process reads
    // or writes the environment.
    unsafe { env::set_var("ROCKSDB_LIB_DIR", lib_dir) };
}
