//! ARCHITECTURE.md names the engine's files and the functions of the write path; this
//! keeps those names true. Every `path.rs: function` it names (paths under `crates/`)
//! must be a file that defines `fn function`, and its code map must list every file of
//! `crates/engine/src` and no other; and no `impl` block of an engine type lies outside
//! the file that defines the type.

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

/// The name a line at the top of a file defines (`struct Name`, `enum Name`), if any.
fn defined_type(line: &str) -> Option<&str> {
    let rest = line
        .trim_start_matches("pub(crate) ")
        .trim_start_matches("pub ");
    let rest = rest
        .strip_prefix("struct ")
        .or_else(|| rest.strip_prefix("enum "))?;
    rest.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .next()
}

/// The type an `impl` line at the top of a file is for (`impl<'a> Trait for Name<'a> {`).
fn impl_type(line: &str) -> Option<&str> {
    let rest = line.strip_prefix("impl")?;
    let rest = match rest.strip_prefix('<') {
        Some(generic) => generic.split_once("> ")?.1,
        None => rest.strip_prefix(' ')?,
    };
    let target = rest.split_once(" for ").map_or(rest, |(_, target)| target);
    target
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .next()
}

/// Each part owns its state in its own file: the methods of an engine type lie in
/// the file that defines it, never in an `impl` block elsewhere (issue 12).
#[test]
fn every_impl_block_lies_in_its_types_file() {
    let src = repo_root().join("crates/engine/src");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&src).unwrap_or_else(|e| panic!("{}: {e}", src.display())) {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            files.push((name, text));
        }
    }
    let mut home = std::collections::BTreeMap::new();
    for (name, text) in &files {
        for t in text.lines().filter_map(defined_type) {
            home.insert(t.to_string(), name.clone());
        }
    }
    assert!(
        home.get("Inner").is_some_and(|f| f == "inner.rs"),
        "the check reads type definitions: {home:?}"
    );
    let mut astray = Vec::new();
    let mut impls = 0;
    for (name, text) in &files {
        for t in text.lines().filter_map(impl_type) {
            impls += 1;
            if let Some(defined_in) = home.get(t) {
                if defined_in != name {
                    astray.push(format!("{name}: impl {t} (defined in {defined_in})"));
                }
            }
        }
    }
    assert!(
        impls >= 30,
        "the check reads impl blocks; found only {impls}"
    );
    assert!(
        astray.is_empty(),
        "impl blocks outside their type's file:\n{}",
        astray.join("\n")
    );
}
