//! ARCHITECTURE.md names the engine's files and the functions of the write path; this
//! keeps those names true. Every `path.rs: function` it names (paths under `crates/`)
//! must be a file that defines `fn function`, and its code map must list every file of
//! `crates/engine/src` and no other.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn architecture() -> String {
    let path = repo_root().join("ARCHITECTURE.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `` `path.rs: name` `` span of the document.
fn named_functions(doc: &str) -> Vec<(String, String)> {
    doc.split('`')
        .skip(1)
        .step_by(2)
        .filter_map(|span| {
            let (path, name) = span.split_once(".rs: ")?;
            Some((format!("{path}.rs"), name.trim().to_string()))
        })
        .collect()
}

/// The files the code map's table lists (its first column).
fn code_map_files(doc: &str) -> BTreeSet<String> {
    let section = doc
        .split("## Code map (engine)")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("ARCHITECTURE.md has a section '## Code map (engine)'");
    section
        .lines()
        .filter_map(|line| line.strip_prefix("| `"))
        .filter_map(|rest| rest.split_once('`'))
        .map(|(file, _)| file.to_string())
        .collect()
}

#[test]
fn every_function_the_write_path_names_exists() {
    let doc = architecture();
    let named = named_functions(&doc);
    assert!(
        named.len() >= 20,
        "the write path names a function at each step; found only {named:?}"
    );
    let mut missing = Vec::new();
    for (path, name) in &named {
        let file = repo_root().join("crates").join(path);
        let Ok(source) = std::fs::read_to_string(&file) else {
            missing.push(format!("{path}: no such file"));
            continue;
        };
        let defined = [format!("fn {name}("), format!("fn {name}<")]
            .iter()
            .any(|d| source.contains(d.as_str()));
        if !defined {
            missing.push(format!("{path}: no `fn {name}`"));
        }
    }
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names functions the code does not have:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_code_map_lists_every_engine_file() {
    let doc = architecture();
    let listed = code_map_files(&doc);
    let src = repo_root().join("crates/engine/src");
    let present: BTreeSet<String> = std::fs::read_dir(&src)
        .unwrap_or_else(|e| panic!("{}: {e}", src.display()))
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".rs"))
        .collect();
    let unlisted: Vec<_> = present.difference(&listed).collect();
    let gone: Vec<_> = listed.difference(&present).collect();
    assert!(
        unlisted.is_empty(),
        "files of crates/engine/src missing from ARCHITECTURE.md's code map: {unlisted:?}"
    );
    assert!(
        gone.is_empty(),
        "ARCHITECTURE.md's code map lists files crates/engine/src does not have: {gone:?}"
    );
}
