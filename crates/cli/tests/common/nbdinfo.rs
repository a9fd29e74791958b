//! Reading what `nbdinfo` reports: negotiated export details (`--json`), the export
//! list (`--list --json`) and the allocation map (`--map --json`).

use super::{run_ok, tool, Ran};
use serde_json::Value;
use std::collections::BTreeMap;

/// Parses a command's stdout as JSON, failing the test with the output if it is not.
pub fn json(ran: &Ran) -> Value {
    serde_json::from_str(&ran.stdout)
        .unwrap_or_else(|e| panic!("output is not JSON ({e}):\n{}", ran.report()))
}

/// `nbdinfo --json URI`: what a client negotiated with the export.
pub fn nbdinfo_json(uri: &str) -> Value {
    json(&run_ok(tool("nbdinfo").args(["--json", uri])))
}

/// The one export in `nbdinfo --json` output.
pub fn first_export(info: &Value) -> &Value {
    &info["exports"][0]
}

/// The exports `nbdinfo --list --json` reports, by name.
pub fn listed_exports(uri: &str) -> BTreeMap<String, Value> {
    let info = json(&run_ok(tool("nbdinfo").args(["--list", "--json", uri])));
    info["exports"]
        .as_array()
        .unwrap_or_else(|| panic!("nbdinfo --list --json has no exports array: {info}"))
        .iter()
        .map(|e| {
            (
                e["export-name"].as_str().unwrap_or_default().to_string(),
                e.clone(),
            )
        })
        .collect()
}

/// Extents from `nbdinfo --map --json` as (offset, length, type).
pub fn map_extents(uri: &str) -> Vec<(u64, u64, u64)> {
    let ran = run_ok(tool("nbdinfo").args(["--map", "--json", uri]));
    json(&ran)
        .as_array()
        .unwrap_or_else(|| panic!("nbdinfo --map --json is not a list:\n{}", ran.report()))
        .iter()
        .map(|e| {
            (
                e["offset"].as_u64().expect("offset"),
                e["length"].as_u64().expect("length"),
                e["type"].as_u64().expect("type"),
            )
        })
        .collect()
}

/// The base:allocation type of every 4 KiB block in `[offset, offset+len)`, checked
/// against `want(type)`.
pub fn assert_map(
    extents: &[(u64, u64, u64)],
    offset: u64,
    len: u64,
    what: &str,
    want: impl Fn(u64) -> bool,
) {
    let mut pos = offset;
    while pos < offset + len {
        let (start, length, kind) = *extents
            .iter()
            .find(|(s, l, _)| *s <= pos && pos < s + l)
            .unwrap_or_else(|| panic!("no extent covers offset {pos} ({what}); map: {extents:?}"));
        assert!(
            want(kind),
            "{what}: offset {pos} is in extent {start}+{length} of type {kind}; map: {extents:?}"
        );
        pos = start + length;
    }
}
