//! The form of the code: within each crate, no two modules import each
//! other, directly or around a loop (a module that uses another's items is
//! above it; the request path reads downwards). Read from the sources'
//! `crate::` paths, with the names `lib.rs` re-exports traced to the
//! module that defines them; unit-test modules are left out. And no
//! source file holds more than [`FILE_LINES`] lines of code, no function
//! more than [`FUNCTION_LINES`] (the conformance suite aside: a list of
//! scenes).

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

/// The most lines of code a source file holds (non-blank, non-comment,
/// before its unit tests).
const FILE_LINES: usize = 400;

/// The most lines of code a function holds.
const FUNCTION_LINES: usize = 80;

/// Every source file of the workspace's crates and examples, with its
/// path, the conformance suite aside.
fn source_files() -> Vec<(PathBuf, String)> {
    let mut files = Vec::new();
    let mut dirs = source_dirs();
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("source dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs")
                && !path.ends_with("idem-core/src/conformance.rs")
            {
                let text = std::fs::read_to_string(&path).expect("source");
                files.push((path, text));
            }
        }
    }
    files.sort();
    files
}

/// Whether a line counts as code: not blank, not a comment.
fn is_code(line: &str) -> bool {
    let line = line.trim();
    !line.is_empty() && !line.starts_with("//")
}

/// The lines of code of a file, before its unit tests.
fn code_lines(text: &str) -> usize {
    let text = text
        .find("#[cfg(test)]\nmod tests")
        .map_or(text, |at| &text[..at]);
    text.lines().filter(|line| is_code(line)).count()
}

/// Each function of `text` (before its unit tests) with its lines of
/// code: from its `fn` line to the closing brace at its indentation (a
/// function without a body, a trait's declaration, is none).
fn functions(text: &str) -> Vec<(String, usize)> {
    let text = text
        .find("#[cfg(test)]\nmod tests")
        .map_or(text, |at| &text[..at]);
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (at, line) in lines.iter().enumerate() {
        let indent = line.len() - line.trim_start().len();
        let mut rest = line.trim_start();
        for prefix in [
            "pub(crate) ",
            "pub(super) ",
            "pub ",
            "const ",
            "async ",
            "unsafe ",
        ] {
            rest = rest.strip_prefix(prefix).unwrap_or(rest);
        }
        let Some(name) = rest.strip_prefix("fn ") else {
            continue;
        };
        let name: String = name
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // The signature ends at a line ending with `{` (a body) or `;`
        // (none); a body on the `fn` line alone ends there too.
        let Some(opens) = (at..lines.len()).find(|&i| {
            let end = lines[i].trim_end();
            end.ends_with('{') || end.ends_with(';') || end.ends_with('}')
        }) else {
            continue;
        };
        let opening = lines[opens].trim_end();
        if opening.ends_with(';') {
            continue;
        }
        let closes = if opening.ends_with('}') {
            opens
        } else {
            let closing = format!("{}}}", " ".repeat(indent));
            // `}` alone at the `fn`'s indentation, or closing a call (`})`).
            let Some(closes) = (opens + 1..lines.len()).find(|&i| {
                lines[i]
                    .strip_prefix(&closing)
                    .is_some_and(|rest| rest.trim_end().is_empty() || rest.starts_with(')'))
            }) else {
                continue;
            };
            closes
        };
        let length = lines[at..=closes]
            .iter()
            .filter(|line| is_code(line))
            .count();
        found.push((name, length));
    }
    found
}

#[test]
fn no_file_or_function_is_longer_than_its_bound() {
    let files = source_files();
    assert!(files.len() > 100, "found only {} files", files.len());
    let mut over = Vec::new();
    for (path, text) in &files {
        let lines = code_lines(text);
        if lines > FILE_LINES {
            over.push(format!("{}: {lines} lines of code", path.display()));
        }
        for (name, length) in functions(text) {
            if length > FUNCTION_LINES {
                over.push(format!("{}: fn {name}: {length} lines", path.display()));
            }
        }
    }
    assert!(
        over.is_empty(),
        "over the bounds ({FILE_LINES} lines a file, {FUNCTION_LINES} a function):\n{}",
        over.join("\n")
    );
}

/// The measure counts what it is for: code lines, not blank ones or
/// comments; a function to its closing brace; no body, no function.
#[test]
fn the_measure_counts_code() {
    let text = "//! A module.\n\nfn one() -> u8 { 1 }\n\n/// Two.\npub(crate) async fn two(\n    a: u8,\n) -> u8 {\n    // a comment\n\n    a + 1\n}\n\ntrait T {\n    fn three(&self);\n}\n\n#[cfg(test)]\nmod tests {\n    fn four() {}\n}\n";
    assert_eq!(code_lines(text), 9);
    assert_eq!(
        functions(text),
        [("one".to_owned(), 1), ("two".to_owned(), 5)]
    );
    // A function one line over the bound is found over it.
    let body: String = (0..FUNCTION_LINES - 1)
        .map(|n| format!("    let _x{n} = {n};\n"))
        .collect();
    let long = format!("impl S {{\n    fn long() {{\n{body}    }}\n}}\n");
    assert_eq!(functions(&long), [("long".to_owned(), FUNCTION_LINES + 1)]);
}
