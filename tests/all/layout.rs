//! The source tree's own shape: no crate has modules that import each other in a circle.
//!
//! A module's imports are the paths it names through `crate::`, `super::` and `self::` (in `use` items, grouped or
//! not, and inline), each resolved to the deepest module of the crate it reaches; its `#[cfg(test)] mod tests` is
//! left out (a test may use whatever it tests). Modules a circle joins can no longer be read, tested or moved one
//! at a time, which is why each rule lives in one module that the others import in one direction.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path inside its crate (`["jail", "lane"]`; empty for the crate root).
type ModPath = Vec<String>;

/// The workspace's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every `.rs` file below `dir`, skipping build outputs and the fuzz corpus.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if path.is_dir() {
            if !matches!(name.to_str(), Some("target" | "corpus" | "node_modules" | ".git")) {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// A crate's modules, by path, from its `src` directory.
fn modules(src: &Path) -> BTreeMap<ModPath, PathBuf> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut modules = BTreeMap::new();
    for file in files {
        let Ok(relative) = file.strip_prefix(src) else { continue };
        if relative.starts_with("bin") {
            continue;
        }
        let mut parts: ModPath =
            relative.with_extension("").iter().map(|part| part.to_string_lossy().into_owned()).collect();
        if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
            parts.pop();
        }
        modules.insert(parts, file);
    }
    modules
}

/// The text of a module without comments and without its unit tests.
fn code(file: &Path) -> String {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    let text = text.split("#[cfg(test)]\nmod tests").next().unwrap_or_default();
    text.lines().map(|line| line.split("//").next().unwrap_or_default()).collect::<Vec<_>>().join("\n")
}

/// The paths a module names through `crate::`, `super::` and `self::`, as (anchor, segments).
fn named_paths(code: &str) -> Vec<(&str, Vec<String>)> {
    let mut paths = Vec::new();
    let bytes = code.as_bytes();
    for anchor in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(at) = code[from..].find(anchor).map(|i| i + from) {
            from = at + anchor.len();
            if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
                continue;
            }
            let rest = &code[from..];
            if let Some(group) = rest.strip_prefix('{') {
                // `use crate::{a::X, b};`: each member's first two segments.
                let end = group.find("};").unwrap_or(group.len());
                for member in group[..end].split(',') {
                    let segments = segments_of(member.trim().trim_start_matches('{'));
                    paths.push((anchor.trim_end_matches("::"), segments));
                }
            } else {
                paths.push((anchor.trim_end_matches("::"), segments_of(rest)));
            }
        }
    }
    paths
}

/// The `::`-separated identifiers at the start of `text` (`super` included).
fn segments_of(text: &str) -> Vec<String> {
    let mut segments = Vec::new();
    let mut rest = text;
    loop {
        let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
        if end == 0 {
            break;
        }
        segments.push(rest[..end].to_owned());
        match rest[end..].strip_prefix("::") {
            Some(next) => rest = next,
            None => break,
        }
    }
    segments
}

/// The module a path named in `module` reaches: the deepest module of the crate along it.
fn resolve(
    modules: &BTreeMap<ModPath, PathBuf>,
    module: &ModPath,
    anchor: &str,
    segments: &[String],
) -> Option<ModPath> {
    let mut current: ModPath = match anchor {
        "crate" => Vec::new(),
        // Whether the module is a file (`a.rs`) or a directory (`a/mod.rs`), its `super` is its parent.
        "super" => module[..module.len().saturating_sub(1)].to_vec(),
        _ => module.clone(),
    };
    let mut segments = segments;
    while let Some(("super", rest)) = segments.split_first().map(|(first, rest)| (first.as_str(), rest)) {
        current.pop();
        segments = rest;
    }
    for segment in segments {
        let mut deeper = current.clone();
        deeper.push(segment.clone());
        if !modules.contains_key(&deeper) {
            break;
        }
        current = deeper;
    }
    modules.contains_key(&current).then_some(current)
}

/// The circles of `edges`: strongly connected sets of more than one module (Tarjan's algorithm).
fn circles(edges: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Vec<Vec<ModPath>> {
    struct State<'a> {
        edges: &'a BTreeMap<ModPath, BTreeSet<ModPath>>,
        index: BTreeMap<&'a ModPath, usize>,
        low: BTreeMap<&'a ModPath, usize>,
        stack: Vec<&'a ModPath>,
        found: Vec<Vec<ModPath>>,
    }
    fn visit<'a>(state: &mut State<'a>, node: &'a ModPath) {
        let n = state.index.len();
        state.index.insert(node, n);
        state.low.insert(node, n);
        state.stack.push(node);
        for next in state.edges.get(node).into_iter().flatten() {
            if !state.index.contains_key(next) {
                visit(state, next);
                let low = state.low[node].min(state.low[next]);
                state.low.insert(node, low);
            } else if state.stack.contains(&next) {
                let low = state.low[node].min(state.index[next]);
                state.low.insert(node, low);
            }
        }
        if state.low[node] == state.index[node] {
            let mut circle = Vec::new();
            while let Some(member) = state.stack.pop() {
                circle.push(member.clone());
                if member == node {
                    break;
                }
            }
            if circle.len() > 1 {
                state.found.push(circle);
            }
        }
    }
    let mut state = State { edges, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), found: Vec::new() };
    for node in edges.keys() {
        if !state.index.contains_key(node) {
            visit(&mut state, node);
        }
    }
    state.found
}

/// The circles of modules of the crate whose sources are in `src`.
fn crate_circles(src: &Path) -> Vec<Vec<ModPath>> {
    let modules = modules(src);
    let mut edges: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for (module, file) in &modules {
        let targets = edges.entry(module.clone()).or_default();
        for (anchor, segments) in named_paths(&code(file)) {
            if let Some(target) = resolve(&modules, module, anchor, &segments)
                && target != *module
            {
                targets.insert(target);
            }
        }
    }
    circles(&edges)
}

#[test]
fn no_crate_has_modules_that_import_each_other_in_a_circle() {
    let root = root();
    let mut sources = Vec::new();
    rust_files(&root, &mut sources);
    let crates: BTreeSet<PathBuf> = sources
        .iter()
        .filter(|file| file.ends_with("src/lib.rs") || file.ends_with("src/main.rs"))
        .filter_map(|file| file.parent().map(Path::to_path_buf))
        .collect();
    assert!(crates.len() > 10, "found only {} crates under {}", crates.len(), root.display());
    let mut found = Vec::new();
    for src in &crates {
        for circle in crate_circles(src) {
            let names: Vec<String> =
                circle.iter().map(|m| if m.is_empty() { "crate".to_owned() } else { m.join("::") }).collect();
            found.push(format!("{}: {}", src.strip_prefix(&root).unwrap_or(src).display(), names.join(" ↔ ")));
        }
    }
    assert!(found.is_empty(), "modules importing each other in a circle:\n{}", found.join("\n"));
}

#[test]
fn the_check_finds_a_circle_where_there_is_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path();
    std::fs::write(src.join("lib.rs"), "mod a;\nmod b;\nmod c;\n").expect("lib");
    std::fs::write(src.join("a.rs"), "use crate::b::B;\npub struct A;\n").expect("a");
    std::fs::write(src.join("b.rs"), "use crate::{c::C, a};\npub struct B;\n").expect("b");
    std::fs::write(src.join("c.rs"), "pub struct C;\n#[cfg(test)]\nmod tests {\n    use crate::a::A;\n}\n").expect("c");
    let circles = crate_circles(src);
    assert_eq!(circles.len(), 1, "{circles:?}");
    let mut circle = circles[0].clone();
    circle.sort();
    assert_eq!(circle, [vec!["a".to_owned()], vec!["b".to_owned()]]);
}
