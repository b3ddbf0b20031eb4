//! The form of the code: within each crate, no two modules import each
//! other, directly or around a loop (a module that uses another's items is
//! above it; the request path reads downwards). Read from the sources'
//! `crate::` paths, with the names `lib.rs` re-exports traced to the
//! module that defines them; unit-test modules are left out.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

/// Every crate's `src` directory in the workspace.
fn source_dirs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut dirs = Vec::new();
    for group in ["crates", "examples"] {
        let Ok(entries) = std::fs::read_dir(root.join(group)) else {
            continue;
        };
        for entry in entries.flatten() {
            let src = entry.path().join("src");
            if src.is_dir() {
                dirs.push(src);
            }
        }
    }
    dirs.sort();
    dirs
}

/// A file's code up to its unit tests, without comments (a doc link to
/// another module is no import).
fn code(text: &str) -> String {
    let text = text
        .find("#[cfg(test)]\nmod tests")
        .map_or(text, |at| &text[..at]);
    text.lines()
        .map(|line| line.split_once("//").map_or(line, |(code, _)| code))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The first path segments after each `crate::` (a group `crate::{a::X,
/// b}` gives `a` and `b`).
fn crate_paths(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // The group's items, split at its top-level commas.
            let (mut depth, mut item) = (0usize, String::new());
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        found.push(first_segment(&item));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                item.push(c);
            }
            found.push(first_segment(&item));
        } else {
            found.push(first_segment(rest));
        }
    }
    found.retain(|segment| !segment.is_empty());
    found
}

fn first_segment(path: &str) -> String {
    path.trim_start()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// The names `lib.rs` re-exports (`pub use module::{A, B}`), by the
/// module that defines them.
fn reexports(lib: &str) -> BTreeMap<String, String> {
    let mut names = BTreeMap::new();
    for statement in lib.split(';') {
        let Some(path) = statement.trim().strip_prefix("pub use ") else {
            continue;
        };
        let Some((module, items)) = path.split_once("::") else {
            continue;
        };
        let items = items.trim_start_matches('{').trim_end_matches('}');
        for item in items.split(',') {
            let name = item.rsplit("::").next().unwrap_or_default().trim();
            if !name.is_empty() {
                names.insert(name.to_owned(), module.trim().to_owned());
            }
        }
    }
    names
}

/// The module graph of one crate: module -> the modules it uses (a
/// directory module's files count as one module).
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let read = |path: PathBuf| std::fs::read_to_string(path).unwrap_or_default();
    let lib = read(src.join("lib.rs"));
    let names = reexports(&lib);
    let mut modules = BTreeMap::new();
    for entry in std::fs::read_dir(src).expect("src").flatten() {
        let path = entry.path();
        let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        if path.is_dir() {
            // A module of several files, nested ones included: what any
            // of them uses.
            let mut text = String::new();
            let mut dirs = vec![path.clone()];
            while let Some(dir) = dirs.pop() {
                for file in std::fs::read_dir(&dir).expect("module dir").flatten() {
                    let file = file.path();
                    if file.is_dir() {
                        dirs.push(file);
                    } else if file.extension().is_some_and(|e| e == "rs") {
                        text.push_str(&read(file));
                        text.push('\n');
                    }
                }
            }
            modules.insert(stem.to_owned(), text);
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") || stem == "lib" || stem == "main" {
            continue;
        }
        modules.insert(stem.to_owned(), read(path));
    }
    let mut edges = BTreeMap::new();
    for (module, text) in &modules {
        let used: BTreeSet<String> = crate_paths(&code(text))
            .into_iter()
            .filter_map(|segment| {
                if modules.contains_key(&segment) {
                    Some(segment)
                } else {
                    names.get(&segment).cloned()
                }
            })
            .filter(|used| used != module)
            .collect();
        edges.insert(module.clone(), used);
    }
    edges
}

/// A loop of modules in `edges`, if there is one.
fn find_loop(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        module: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|m| m == module) {
            let mut circle = path[at..].to_vec();
            circle.push(module.to_owned());
            return Some(circle);
        }
        if done.contains(module) {
            return None;
        }
        path.push(module.to_owned());
        for next in edges.get(module).into_iter().flatten() {
            if let Some(circle) = visit(next, edges, path, done) {
                return Some(circle);
            }
        }
        path.pop();
        done.insert(module.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    edges
        .keys()
        .find_map(|module| visit(module, edges, &mut Vec::new(), &mut done))
}

#[test]
fn no_module_imports_back_from_a_module_that_uses_it() {
    let dirs = source_dirs();
    assert!(dirs.len() >= 7, "found only {dirs:?}");
    let circles: Vec<String> = dirs
        .iter()
        .filter_map(|src| {
            find_loop(&graph(src))
                .map(|circle| format!("{}: {}", src.display(), circle.join(" -> ")))
        })
        .collect();
    assert!(
        circles.is_empty(),
        "modules import each other:\n{}",
        circles.join("\n")
    );
}

/// The check finds what it is for: a loop of two, and one of three.
#[test]
fn the_check_finds_a_loop() {
    let edges = |pairs: &[(&str, &str)]| {
        let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (from, to) in pairs {
            edges
                .entry((*from).to_owned())
                .or_default()
                .insert((*to).to_owned());
            edges.entry((*to).to_owned()).or_default();
        }
        edges
    };
    assert!(find_loop(&edges(&[("a", "b"), ("b", "a")])).is_some());
    assert!(find_loop(&edges(&[("a", "b"), ("b", "c"), ("c", "a")])).is_some());
    assert!(find_loop(&edges(&[("a", "b"), ("b", "c"), ("a", "c")])).is_none());
    assert_eq!(
        crate_paths("use crate::{IdempotencyLayer, attempt::{Lapse, settle}, m as x};"),
        ["IdempotencyLayer", "attempt", "m"]
    );
}
