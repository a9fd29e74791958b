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
/// the file that defines it, never in an `impl` block elsewhere.
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

/// The files the repository holds: `git ls-files` where the tree is a git checkout, else
/// every file under the root but build output (`target/`) and `.git/`.
fn repository_files() -> Vec<PathBuf> {
    let root = repo_root();
    let listed = std::process::Command::new("git")
        .arg("-C")
        .arg(&root)
        .args(["ls-files", "-z"])
        .output();
    if let Ok(out) = listed {
        if out.status.success() {
            return String::from_utf8_lossy(&out.stdout)
                .split('\0')
                .filter(|name| !name.is_empty())
                .map(|name| root.join(name))
                .collect();
        }
    }
    let mut files = Vec::new();
    let mut dirs = vec![root];
    while let Some(dir) = dirs.pop() {
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry
                .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
                .path();
            let name = path.file_name().unwrap_or_default();
            if path.is_dir() {
                if name != "target" && name != ".git" {
                    dirs.push(path);
                }
            } else {
                files.push(path);
            }
        }
    }
    files
}

/// Why a line points outside the repository, if it does: it names a steering document
/// the repository does not hold, or a numbered item of a tracker users cannot see
/// (`next` is the line after, for a number wrapped onto it).
fn outside_pointer(line: &str, next: Option<&str>) -> Option<&'static str> {
    let outside_docs = [concat!("DESIGN", ".md"), concat!("STYLE", ".md")];
    if outside_docs.iter().any(|doc| line.contains(doc)) {
        return Some("names a document outside the repository");
    }
    let word = concat!("ssue", " ");
    let numbered = line.match_indices(word).any(|(at, _)| {
        let before = line[..at].chars().next_back();
        let after = line[at + word.len()..].chars().next();
        matches!(before, Some('i' | 'I')) && after.is_some_and(|c| c.is_ascii_digit())
    });
    // A number wrapped onto the next line: "... (i" + "ssue" at the end, "14) ..." after.
    let wrapped = line
        .trim_end()
        .to_lowercase()
        .ends_with(concat!("i", "ssue"))
        && next.is_some_and(|n| {
            let n = n.trim_start().trim_start_matches(['/', '!', '#', ' ']);
            n.starts_with(|c: char| c.is_ascii_digit())
        });
    (numbered || wrapped).then_some("cites a numbered item of an outside tracker")
}

/// The repository stands alone: no file in it sends a reader to a document it does not
/// hold or to a tracker a user cannot see; each says the thing itself.
#[test]
fn no_file_points_outside_the_repository() {
    let files = repository_files();
    assert!(
        files.iter().any(|f| f.ends_with("ARCHITECTURE.md")),
        "the walk of the repository found ARCHITECTURE.md"
    );
    let mut found = Vec::new();
    for file in &files {
        // Binary files (and files gone from the work tree) hold no prose to check.
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            if let Some(why) = outside_pointer(line, lines.get(i + 1).copied()) {
                let shown = file.strip_prefix(repo_root()).unwrap_or(file);
                found.push(format!("{}:{}: {why}: {line}", shown.display(), i + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "files point outside the repository:\n{}",
        found.join("\n")
    );
}

/// The body of the one `fn name` that `source` defines: from its first `{` to the
/// matching `}` (braces in strings and comments are rare enough in these functions
/// that a mismatch would show as a missing call, never as a false pass).
fn function_body<'s>(source: &'s str, name: &str) -> Result<&'s str, String> {
    let starts: Vec<usize> = [format!("fn {name}("), format!("fn {name}<")]
        .iter()
        .flat_map(|d| source.match_indices(d.as_str()).map(|(i, _)| i))
        .collect();
    let [start] = starts[..] else {
        return Err(format!("{} definitions of `fn {name}`", starts.len()));
    };
    let open = source[start..]
        .find('{')
        .map(|i| start + i)
        .ok_or_else(|| format!("`fn {name}` has no body"))?;
    let mut depth = 0usize;
    for (i, c) in source[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Ok(&source[open..=open + i]);
                }
            }
            _ => {}
        }
    }
    Err(format!("`fn {name}`'s body does not end"))
}

/// Whether `body` calls `name` (as a function, a method or a path: `name(`, with no
/// identifier character just before it).
fn calls(body: &str, name: &str) -> bool {
    body.match_indices(&format!("{name}(")).any(|(i, _)| {
        !body[..i]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_')
    })
}

#[test]
fn the_call_chain_of_a_write_reaches_the_storage_crate_link_by_link() {
    let doc = architecture();
    let chain_text = doc
        .split("The call chain of a whole 4 KiB block")
        .nth(1)
        .and_then(|rest| rest.split("\n\n").next())
        .expect("ARCHITECTURE.md states the call chain of a write");
    let chain = named_functions(chain_text);
    assert!(
        chain.first().is_some_and(|(p, _)| p.starts_with("nbd/"))
            && chain.last().is_some_and(|(p, _)| p.starts_with("storage/")),
        "the chain runs from the NBD socket to the storage crate: {chain:?}"
    );
    let mut broken = Vec::new();
    for pair in chain.windows(2) {
        let [(path, caller), (_, callee)] = pair else {
            continue;
        };
        let file = repo_root().join("crates").join(path);
        let source =
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        match function_body(&source, caller) {
            Ok(body) if calls(body, callee) => {}
            Ok(_) => broken.push(format!("{path}: `{caller}` does not call `{callee}`")),
            Err(e) => broken.push(format!("{path}: {e}")),
        }
    }
    assert!(
        broken.is_empty(),
        "ARCHITECTURE.md's call chain of a write does not match the code:\n{}",
        broken.join("\n")
    );
}
