//! Builds and tests `examples/opendal-tier`, a backend crate outside the workspace, the way its
//! own author would: its own lock file, formatting, clippy and tests.

use std::env;

use crate::{run_with_env, workspace_root};

/// The example third-party backend's manifest, relative to the workspace root.
const MANIFEST: &str = "examples/opendal-tier/Cargo.toml";

/// Formatting, clippy (warnings are errors) and tests of the example third-party backend. It
/// shares the workspace's target directory, so kvpool's own crates are not built twice.
pub(crate) fn example_backend() -> Result<(), String> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target_dir = env::var("CARGO_TARGET_DIR")
        .unwrap_or_else(|_| workspace_root().join("target").display().to_string());
    let envs = [("CARGO_TARGET_DIR", target_dir.as_str())];
    let manifest = ["--manifest-path", MANIFEST];
    run_with_env(
        &cargo,
        &[&["fmt"][..], &manifest, &["--", "--check"]].concat(),
        &envs,
    )?;
    run_with_env(
        &cargo,
        &[
            &["clippy", "--locked", "--all-targets"][..],
            &manifest,
            &["--", "-D", "warnings"],
        ]
        .concat(),
        &envs,
    )?;
    run_with_env(
        &cargo,
        &[&["test", "--locked"][..], &manifest].concat(),
        &envs,
    )
}
