//! Python for the suites and benchmarks: interpreters (3.12 for vLLM and SGLang, others for
//! the wheel's smoke tests), the tool virtualenv (uv, maturin), pinned virtualenvs under
//! `target/`, and the kvpool wheel they install (a dev build, or the release wheel CI tested).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{run, run_with_env, workspace_root};

/// The installer and the wheel builder, in their own small virtualenv.
const TOOL_REQUIREMENTS: &[&str] = &["uv==0.13.9", "maturin==1.16.0"];

/// The cargo target directory (`CARGO_TARGET_DIR`, or the workspace's `target/`): the
/// virtualenvs, wheels and benchmark results live there.
pub(crate) fn target_dir() -> PathBuf {
    std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| workspace_root().join("target"))
}

/// `p` as UTF-8, for a command line; an error naming it otherwise.
pub(crate) fn path_str(p: &Path) -> Result<&str, String> {
    p.to_str()
        .ok_or_else(|| format!("non-UTF-8 path {}", p.display()))
}

/// A Python 3.12 interpreter: `KVPOOL_PYTHON`, `python3.12` on PATH, or pyenv's.
pub(crate) fn python312() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("KVPOOL_PYTHON") {
        return Ok(PathBuf::from(p));
    }
    python_version("3.12")
        .map_err(|_| "vLLM's CPU build needs Python 3.12: install it (e.g. `pyenv install 3.12`) or set KVPOOL_PYTHON".into())
}

/// A Python interpreter of `version` (`3.10`): `python3.10` on PATH, or pyenv's newest.
pub(crate) fn python_version(version: &str) -> Result<PathBuf, String> {
    let (major, minor) = version
        .split_once('.')
        .ok_or_else(|| format!("not a Python version: {version}"))?;
    let check = format!("import sys; assert sys.version_info[:2] == ({major}, {minor})");
    let works = |p: &Path| {
        Command::new(p)
            .args(["-c", &check])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let binary = format!("python{version}");
    let mut candidates = vec![PathBuf::from(&binary)];
    let pyenv_root = std::env::var("PYENV_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".pyenv")
        });
    if let Ok(entries) = std::fs::read_dir(pyenv_root.join("versions")) {
        let mut versions: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&format!("{version}.")))
            })
            .map(|p| p.join("bin").join(&binary))
            .collect();
        versions.sort();
        candidates.extend(versions.into_iter().rev());
    }
    candidates
        .into_iter()
        .find(|p| works(p))
        .ok_or_else(|| format!("no Python {version}: install it (e.g. `pyenv install {version}`)"))
}

/// The tool virtualenv (uv, maturin); returns its `bin` directory.
pub(crate) fn ensure_tools(python: &Path) -> Result<PathBuf, String> {
    let venv = target_dir().join("uv-venv");
    let bin = venv.join("bin");
    let marker = venv.join(".kvpool-tools");
    let wanted = TOOL_REQUIREMENTS.join("\n");
    if std::fs::read_to_string(&marker).ok().as_deref() != Some(wanted.as_str()) {
        run(path_str(python)?, &["-m", "venv", path_str(&venv)?])?;
        let mut args = vec!["install", "--quiet", "--disable-pip-version-check"];
        args.extend(TOOL_REQUIREMENTS);
        run(path_str(&bin.join("pip"))?, &args)?;
        std::fs::write(&marker, wanted).map_err(|e| e.to_string())?;
    }
    Ok(bin)
}

/// The virtualenv `target/<name>`, (re)created when its pins change: the requirements file
/// `requirements` (relative to the workspace root), then `no_deps` installed without its
/// dependencies (they come from the file). Returns its python.
pub(crate) fn ensure_venv(
    python: &Path,
    tools: &Path,
    name: &str,
    requirements: &str,
    no_deps: &str,
) -> Result<PathBuf, String> {
    let venv = target_dir().join(name);
    let requirements = workspace_root().join(requirements);
    let pins = std::fs::read_to_string(&requirements)
        .map_err(|e| format!("cannot read {}: {e}", requirements.display()))?;
    let wanted = format!("{pins}\n{no_deps}\n");
    let marker = venv.join(".kvpool-pins");
    let venv_python = venv.join("bin/python");
    if std::fs::read_to_string(&marker).ok().as_deref() == Some(wanted.as_str()) {
        return Ok(venv_python);
    }
    let uv = path_str(&tools.join("uv"))?.to_string();
    let venv_s = path_str(&venv)?.to_string();
    let env = [("VIRTUAL_ENV", venv_s.as_str())];
    run(
        &uv,
        &["venv", "--clear", "--python", path_str(python)?, &venv_s],
    )?;
    run_with_env(
        &uv,
        &["pip", "install", "-r", path_str(&requirements)?],
        &env,
    )?;
    run_with_env(&uv, &["pip", "install", "--no-deps", no_deps], &env)?;
    std::fs::write(&marker, wanted).map_err(|e| e.to_string())?;
    Ok(venv_python)
}

/// Builds the kvpool wheel in `profile` into `out` (emptied first) for `python`, with
/// `extra` maturin arguments; returns its path.
pub(crate) fn build_wheel(
    tools: &Path,
    python: &Path,
    profile: &str,
    out: &Path,
    extra: &[&str],
) -> Result<PathBuf, String> {
    let _ = std::fs::remove_dir_all(out);
    let mut args = vec![
        "build",
        "--profile",
        profile,
        "-m",
        "kvpool-py/Cargo.toml",
        "-o",
        path_str(out)?,
        "-i",
        path_str(python)?,
    ];
    args.extend(extra);
    run(path_str(&tools.join("maturin"))?, &args)?;
    std::fs::read_dir(out)
        .map_err(|e| e.to_string())?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| "maturin built no wheel".to_string())
}

/// Builds the kvpool wheel in `profile` (`dev` for tests: it shares the test build's
/// artifacts; `release` for benchmarks) and installs it into the virtualenv of `venv_python`.
///
/// The wheel is abi3, so it is built for the interpreter the virtualenvs are made from
/// ([`python312`]), not for each one's own: the vLLM and SGLang wheels and the GPU bundle then
/// share one cargo build instead of rebuilding PyO3 and everything above it for each path.
pub(crate) fn install_wheel(tools: &Path, venv_python: &Path, profile: &str) -> Result<(), String> {
    let given = std::env::var_os("KVPOOL_TEST_WHEEL").map(PathBuf::from);
    let wheel = match TESTED_WHEEL.get().cloned().or(given) {
        Some(released) => released,
        None => build_wheel(
            tools,
            &python312()?,
            profile,
            &target_dir().join("wheels"),
            &[],
        )?,
    };
    uv_pip_install(
        tools,
        venv_python,
        &["--force-reinstall", "--no-deps", path_str(&wheel)?],
    )
}

/// `uv pip install <args>` into the virtualenv of `venv_python`.
pub(crate) fn uv_pip_install(
    tools: &Path,
    venv_python: &Path,
    args: &[&str],
) -> Result<(), String> {
    let venv = venv_python
        .parent()
        .and_then(Path::parent)
        .ok_or("bad venv path")?;
    let mut all = vec!["pip", "install"];
    all.extend_from_slice(args);
    run_with_env(
        path_str(&tools.join("uv"))?,
        &all,
        &[("VIRTUAL_ENV", path_str(venv)?)],
    )
}

/// Set by `cargo xtask ci` once `cargo xtask wheel` built and checked the release wheel: the
/// vLLM and SGLang suites and the GPU bundle's dry run then take that wheel, what an operator
/// installs, instead of building a dev wheel of their own.
static TESTED_WHEEL: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// From now on, the suites install `wheel` (see [`TESTED_WHEEL`]). Outside CI,
/// `KVPOOL_TEST_WHEEL=<path to a wheel>` does the same for one `cargo xtask vllm` or `sglang`.
pub(crate) fn test_the_release_wheel(wheel: PathBuf) {
    let _ = TESTED_WHEEL.set(wheel);
}

/// The release wheel [`test_the_release_wheel`] named, if any.
pub(crate) fn tested_wheel() -> Option<&'static PathBuf> {
    TESTED_WHEEL.get()
}

/// Whether the suites test the release wheel ([`test_the_release_wheel`], or
/// `KVPOOL_TEST_WHEEL`) rather than a dev build.
pub(crate) fn testing_the_release_wheel() -> bool {
    TESTED_WHEEL.get().is_some() || std::env::var_os("KVPOOL_TEST_WHEEL").is_some()
}
