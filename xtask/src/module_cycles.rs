//! `cargo xtask module-cycles`: fails when two modules of one crate import each other, directly
//! or through others.
//!
//! Every `crate::…`, `super::…` and `self::…` path in non-comment code (grouped `use` trees
//! included) is resolved to the deepest module of the crate it names. A reference between two
//! modules where neither contains the other becomes an edge between their ancestors that are
//! siblings (so `a::x` using `b::y` is `a → b`); a cycle among siblings is an error, printed
//! with the file and line of every edge. References to an enclosing module (a `super::Item`
//! re-exported by a parent) and from a module into its own children are structure, not
//! dependencies, and are ignored.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::workspace_root;

/// The crates checked (every workspace member with Rust sources).
const CRATES: &[&str] = &[
    "kvpool-core",
    "kvpool-backends",
    "kvpool-connector",
    "kvpool-sim",
    "kvpool-cli",
    "kvpool-py",
    "kvpool-testservers",
    "xtask",
];

/// A module path inside one crate, root = empty.
type ModPath = Vec<String>;

fn module_of(src: &Path, file: &Path) -> ModPath {
    let rel = file.strip_prefix(src).expect("file under src");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Paths in `code` starting at `crate`, `super` or `self`, with `use` groups expanded.
fn paths_in(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let starts_word = i == 0 || !is_ident(bytes[i - 1]);
        let rest: String = bytes[i..bytes.len().min(i + 7)].iter().collect();
        let is_head = ["crate::", "super::", "self::"]
            .iter()
            .any(|h| rest.starts_with(h));
        if starts_word && is_head {
            let (paths, end) = parse_tree(&bytes, i, Vec::new());
            out.extend(paths);
            i = end.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
}

/// Parses `seg::seg::{tree, tree}` at `i`; returns the full paths and the index after it.
fn parse_tree(s: &[char], mut i: usize, prefix: Vec<String>) -> (Vec<Vec<String>>, usize) {
    let mut path = prefix;
    loop {
        let start = i;
        while i < s.len() && is_ident(s[i]) {
            i += 1;
        }
        if i > start {
            path.push(s[start..i].iter().collect());
        }
        if i + 1 < s.len() && s[i] == ':' && s[i + 1] == ':' {
            i += 2;
            if i < s.len() && s[i] == '{' {
                i += 1;
                let mut all = Vec::new();
                loop {
                    while i < s.len() && (s[i].is_whitespace() || s[i] == ',') {
                        i += 1;
                    }
                    if i >= s.len() || s[i] == '}' {
                        return (all, i + 1);
                    }
                    let (paths, end) = parse_tree(s, i, path.clone());
                    all.extend(paths);
                    // Skip `as alias` and anything else up to the next item.
                    i = end;
                    while i < s.len() && s[i] != ',' && s[i] != '}' {
                        i += 1;
                    }
                }
            }
            continue;
        }
        return (vec![path], i);
    }
}

/// The deepest known module named by `path` as written in module `from`.
fn resolve(path: &[String], from: &ModPath, known: &BTreeSet<ModPath>) -> Option<ModPath> {
    let mut base: ModPath = Vec::new();
    let mut rest = path;
    match path.first().map(String::as_str) {
        Some("crate") => rest = &path[1..],
        Some("self") => {
            base = from.clone();
            rest = &path[1..];
        }
        Some("super") => {
            base = from.clone();
            while rest.first().map(String::as_str) == Some("super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        _ => return None,
    }
    for seg in rest {
        let mut next = base.clone();
        next.push(seg.clone());
        if known.contains(&next) {
            base = next;
        } else {
            break;
        }
    }
    Some(base)
}

/// Cycles among sibling modules of one crate, as readable lines; empty when there are none.
fn crate_cycles(krate: &str) -> Vec<String> {
    let src = workspace_root().join(krate).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let known: BTreeSet<ModPath> = files.iter().map(|f| module_of(&src, f)).collect();
    // (from, to) siblings -> where the edge comes from.
    let mut edges: BTreeMap<(ModPath, ModPath), String> = BTreeMap::new();
    for file in &files {
        let from = module_of(&src, file);
        let text = std::fs::read_to_string(file).unwrap_or_default();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for path in paths_in(code) {
                let Some(to) = resolve(&path, &from, &known) else {
                    continue;
                };
                let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
                if common == from.len() || common == to.len() {
                    continue; // an ancestor or a descendant
                }
                let key = (from[..=common].to_vec(), to[..=common].to_vec());
                edges.entry(key).or_insert_with(|| {
                    format!(
                        "{}:{}",
                        file.strip_prefix(workspace_root())
                            .unwrap_or(file)
                            .display(),
                        n + 1
                    )
                });
            }
        }
    }
    // Depth-first search for a back edge; report each cycle once.
    let mut graph: BTreeMap<&ModPath, Vec<&ModPath>> = BTreeMap::new();
    for (from, to) in edges.keys() {
        graph.entry(from).or_default().push(to);
    }
    let mut cycles = BTreeSet::new();
    for start in graph.keys() {
        let mut stack = vec![(*start, vec![*start])];
        while let Some((node, trail)) = stack.pop() {
            for next in graph.get(node).into_iter().flatten() {
                if *next == *start {
                    let mut cycle: Vec<&ModPath> = trail.clone();
                    let min = cycle.iter().enumerate().min_by_key(|(_, m)| **m).unwrap().0;
                    cycle.rotate_left(min);
                    cycles.insert(cycle.into_iter().cloned().collect::<Vec<ModPath>>());
                } else if !trail.contains(next) && next > start {
                    let mut t = trail.clone();
                    t.push(next);
                    stack.push((next, t));
                }
            }
        }
    }
    cycles
        .into_iter()
        .map(|cycle| {
            let mut line = format!("{krate}: cycle");
            for (i, m) in cycle.iter().enumerate() {
                let next = &cycle[(i + 1) % cycle.len()];
                let at = &edges[&(m.clone(), next.clone())];
                line += &format!("\n    {} -> {}   ({at})", m.join("::"), next.join("::"));
            }
            line
        })
        .collect()
}

/// Checks every crate; Err lists the cycles.
pub(crate) fn module_cycles() -> Result<(), String> {
    let cycles: Vec<String> = CRATES.iter().flat_map(|c| crate_cycles(c)).collect();
    if cycles.is_empty() {
        eprintln!(
            "module-cycles: no import cycle between the modules of {}",
            CRATES.join(", ")
        );
        Ok(())
    } else {
        Err(format!(
            "import cycles between modules:\n{}",
            cycles.join("\n")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(mods: &[&str]) -> BTreeSet<ModPath> {
        mods.iter()
            .map(|m| {
                m.split("::")
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect()
            })
            .collect()
    }

    #[test]
    fn use_groups_expand_and_resolve_to_the_deepest_module() {
        let paths = paths_in("use crate::{a::X, b::{c::Y, Z as W}}; let v = super::d::f();");
        let known = set(&["", "a", "b", "b::c", "m", "m::d"]);
        let from: ModPath = vec!["m".into(), "n".into()];
        let resolved: Vec<_> = paths
            .iter()
            .filter_map(|p| resolve(p, &from, &known))
            .map(|m| m.join("::"))
            .collect();
        assert_eq!(resolved, ["a", "b::c", "b", "m::d"]);
        assert!(paths_in("let x = notcrate::a;").is_empty());
    }
}
