//! The repository's Markdown links to its own files resolve: a guide moved
//! or renamed leaves no link behind it.

use std::path::{Path, PathBuf};

/// The Markdown files of the repository (not its build output).
fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                if !name.starts_with('.') && name != "target" && name != "node_modules" {
                    dirs.push(path);
                }
            } else if name.ends_with(".md") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The targets of the inline links `[text](target)` of a Markdown text,
/// outside code blocks.
fn link_targets(text: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            targets.push(after[..end].to_owned());
            rest = &after[end..];
        }
    }
    targets
}

#[test]
fn every_relative_link_names_a_file_that_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let files = markdown_files(&root);
    assert!(files.len() >= 15, "{files:?}");
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).expect("a Markdown file");
        for target in link_targets(&text) {
            if target.contains("://") || target.starts_with('#') || target.starts_with("mailto:") {
                continue;
            }
            let path = target.split('#').next().unwrap_or_default();
            let resolved = file.parent().expect("a folder").join(path);
            checked += 1;
            if !resolved.exists() {
                broken.push(format!("{}: {target}", file.display()));
            }
        }
    }
    assert!(checked >= 30, "only {checked} links checked");
    assert!(
        broken.is_empty(),
        "links to nothing:\n{}",
        broken.join("\n")
    );
}

/// The repository's Markdown and Rust sources (where rustdoc links live).
fn sources(root: &Path) -> Vec<PathBuf> {
    let mut found = markdown_files(root);
    let mut dirs = vec![
        root.join("crates"),
        root.join("examples"),
        root.join("tests"),
    ];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                found.push(path);
            }
        }
    }
    found
}

/// A link out of the docs resolves before the crates are published: none
/// names a docs.rs page of an idem crate (there is none yet), and one into
/// the repository's tree names a file or folder that exists.
#[test]
fn links_out_resolve_before_the_crates_are_published() {
    const TREE: [&str; 2] = [
        "https://github.com/idem-rs/idem/tree/main/",
        "https://github.com/idem-rs/idem/blob/main/",
    ];
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in sources(&root) {
        if file.ends_with("doc_links.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("a source file");
        for (at, _) in text.match_indices("docs.rs/idem") {
            let line = text[..at].lines().count();
            broken.push(format!(
                "{}:{line}: a docs.rs page of an idem crate",
                file.display()
            ));
        }
        for prefix in TREE {
            for (at, _) in text.match_indices(prefix) {
                let rest = &text[at + prefix.len()..];
                let end = rest
                    .find(|c: char| {
                        c == ')' || c == '>' || c == '#' || c.is_whitespace() || c == '"'
                    })
                    .unwrap_or(rest.len());
                checked += 1;
                if !root.join(&rest[..end]).exists() {
                    broken.push(format!("{}: {prefix}{}", file.display(), &rest[..end]));
                }
            }
        }
    }
    assert!(checked >= 5, "only {checked} links into the tree checked");
    assert!(
        broken.is_empty(),
        "links that do not resolve:\n{}",
        broken.join("\n")
    );
}

#[test]
fn link_targets_are_read_outside_code() {
    let text = "see [a](a.md) and [b](../b.md#part)\n```\n[c](c.md)\n```\n";
    assert_eq!(link_targets(text), ["a.md", "../b.md#part"]);
}
