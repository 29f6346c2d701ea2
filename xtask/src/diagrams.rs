//! `cargo xtask diagrams`: renders every Graphviz source in `docs/diagrams/*.dot` to the SVG
//! beside it (the pictures docs/architecture.md opens with), installing Graphviz when missing.

use crate::{ensure_system_packages, run, workspace_root};

/// Renders `docs/diagrams/NAME.dot` to `docs/diagrams/NAME.svg`, for every source there.
pub(crate) fn diagrams() -> Result<(), String> {
    ensure_system_packages(&["graphviz"])?;
    let dir = workspace_root().join("docs/diagrams");
    let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut sources: Vec<_> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "dot"))
        .collect();
    sources.sort();
    if sources.is_empty() {
        return Err(format!("no .dot sources in {}", dir.display()));
    }
    for source in &sources {
        let svg = source.with_extension("svg");
        run(
            "dot",
            &[
                "-Tsvg",
                &source.to_string_lossy(),
                "-o",
                &svg.to_string_lossy(),
            ],
        )?;
        println!("diagrams: {} -> {}", source.display(), svg.display());
    }
    Ok(())
}
