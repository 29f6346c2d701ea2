//! Compiles kvpool-cuda's kernels with a real NVRTC from PyPI, without a GPU.

use std::env;
use std::path::PathBuf;

use crate::{run, run_with_env, workspace_root};

/// NVRTC from PyPI (no GPU needed), to compile kvpool-cuda's kernels in CI.
const NVRTC_REQUIREMENT: &str = "nvidia-cuda-nvrtc==13.5.37";

/// Compiles kvpool-cuda's kernel source with a real NVRTC, so that a kernel that does not
/// compile fails CI although CI has no GPU (the GPU tests themselves skip there).
pub(crate) fn nvrtc_check() -> Result<(), String> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target_dir = env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| workspace_root().join("target"));
    let venv = target_dir.join("nvrtc-venv");
    let find = || {
        std::fs::read_dir(venv.join("lib"))
            .ok()?
            .filter_map(Result::ok)
            .map(|e| e.path().join("site-packages/nvidia/cu13/lib"))
            .find(|dir| dir.join("libnvrtc.so.13").exists())
    };
    let lib_dir = match find() {
        Some(dir) => dir,
        None => {
            let venv_str = venv.display().to_string();
            run("python3", &["-m", "venv", &venv_str])?;
            let pip = venv.join("bin/pip").display().to_string();
            run(
                &pip,
                &[
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    NVRTC_REQUIREMENT,
                ],
            )?;
            find().ok_or(format!("{NVRTC_REQUIREMENT} installed no libnvrtc.so.13"))?
        }
    };
    let lib_dir = lib_dir.display().to_string();
    run_with_env(
        &cargo,
        &[
            "test",
            "-p",
            "kvpool-cuda",
            "--lib",
            "kernels::tests::the_kernels_compile_with_nvrtc_where_it_exists",
        ],
        &[
            ("LD_LIBRARY_PATH", lib_dir.as_str()),
            ("KVPOOL_REQUIRE_NVRTC", "1"),
        ],
    )
}
