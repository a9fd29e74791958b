//! `stats` and `list-metadata`: what the pool holds and where its metadata lives.

use anyhow::{bail, Result};
use fewerbytes_engine::{Mode, PoolStats, Region};
use serde_json::Value;
use std::path::Path;
use std::process::ExitCode;

use crate::control::{inspect_pool, Answer, Request};
use crate::low_water::WarnAt;
use crate::output::{print_json, Align, Table};
use crate::size::format_size;

/// `stats`.
#[derive(clap::Args)]
pub struct StatsArgs {
    /// Every counter: per volume, per device I/O, limits, metadata bytes by region.
    #[arg(long, short)]
    verbose: bool,
    /// Print the statistics as JSON.
    #[arg(long, conflicts_with_all = ["verbose", "bytes", "no_header"])]
    json: bool,
    /// Sizes in bytes rather than binary units (for scripts).
    #[arg(long)]
    bytes: bool,
    /// Leave out the header line (for scripts).
    #[arg(long)]
    no_header: bool,
}

/// `list-metadata`.
#[derive(clap::Args)]
pub struct ListMetadataArgs {
    /// Print the regions as JSON.
    #[arg(long)]
    json: bool,
}

/// Print the pool's statistics.
pub fn stats(args: StatsArgs, pool_path: &Path) -> Result<ExitCode> {
    let stats = inspect_pool(pool_path, |pool| match pool.call(&Request::Stats)? {
        Answer::Stats(stats) => Ok(stats),
        other => bail!("unexpected answer to stats: {other:?}"),
    })?;
    if args.json {
        print_json(&stats)?;
        return Ok(ExitCode::SUCCESS);
    }
    let table = summary_table(&stats.pool, stats.warn_at, args.bytes);
    if args.no_header {
        table.print_rows();
    } else {
        table.print();
        if stats.pool.scrub.state != fewerbytes_engine::ScrubState::Idle {
            println!("Scrub: {}", crate::cmd_scrub::summary(&stats.pool.scrub));
        }
        println!("Index: {}", stats.pool.index);
        if stats.pool.damaged_objects_known + stats.pool.damaged_objects_healed > 0 {
            println!("Damaged blocks: {}", damaged_blocks_summary(&stats.pool));
        }
        if !stats.pool.damaged_ranges.is_empty() {
            println!(
                "Damaged ranges: {}",
                damaged_summary(stats.pool.damaged_ranges.len() as u64)
            );
            for range in &stats.pool.damaged_ranges {
                println!("  {}", range.describe());
            }
        }
    }
    if args.verbose {
        println!();
        for (key, value) in verbose_lines(&stats.pool, flatten(&serde_json::to_value(&*stats)?)) {
            println!("{key:<58} : {value}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The stored blocks found damaged and healed since open, for the text summary.
fn damaged_blocks_summary(pool: &PoolStats) -> String {
    format!(
        "{} known damaged (reads of them fail; writing their good data back heals them; \
         {} of them carried over from the last open), {} healed since open",
        pool.damaged_objects_known, pool.damaged_objects_carried_over, pool.damaged_objects_healed
    )
}

/// The verbose lines: with no metadata device of its own, the pool's one device is
/// counted once (`data_device.*`), and `metadata_device` says where metadata went,
/// rather than the same counters a second time.
fn verbose_lines(pool: &PoolStats, lines: Vec<(String, String)>) -> Vec<(String, String)> {
    if pool.separate_metadata_device {
        return lines;
    }
    let mut out: Vec<(String, String)> = Vec::with_capacity(lines.len());
    for (key, value) in lines {
        match key.strip_prefix("metadata_device.") {
            Some(_) if out.iter().any(|(k, _)| k == "metadata_device") => {}
            Some(_) => out.push((
                "metadata_device".to_string(),
                "the data device (no separate metadata device): data_device counts both"
                    .to_string(),
            )),
            None => out.push((key, value)),
        }
    }
    out
}

/// The vdostats-like table: one row for the pool; sizes in bytes when `bytes`;
/// the server's `--warn-at` mark when served.
pub fn summary_table(stats: &PoolStats, warn_at: Option<WarnAt>, bytes: bool) -> Table {
    // The space figures as `pool info` names them (`Capacity`): Size is the whole
    // pool, metadata included; Available is what a write no reservation covers can
    // still take (as ZFS's AVAIL, it leaves out what reservations hold back), and Used
    // is the rest, so that Size = Used + Available and Use% says how close thin
    // volumes are to ENOSPC. Reserved (what volumes hold aside, thick ones their size)
    // and Promised (volume sizes added up) say how far the pool is committed; ENOSPC
    // counts the writes refused for want of space since open.
    let size = |n: u64| if bytes { n.to_string() } else { format_size(n) };
    let space = &stats.space;
    let saving = if stats.logical_used_bytes == 0 {
        "N/A".to_string()
    } else {
        format!("{:.0}%", stats.saving_percent)
    };
    let mut table = Table::new(&[
        ("Device", Align::Left),
        ("Size", Align::Right),
        ("Used", Align::Right),
        ("Available", Align::Right),
        ("Use%", Align::Right),
        ("Space saving%", Align::Right),
        ("Reserved", Align::Right),
        ("Promised", Align::Right),
        ("ENOSPC", Align::Right),
        ("Warn at", Align::Right),
        ("Mode", Align::Left),
        ("Compression", Align::Left),
    ]);
    table.row(vec![
        stats.path.clone(),
        size(space.size_bytes),
        size(space.used_bytes),
        size(space.available_bytes),
        format!("{}%", crate::low_water::used_percent(stats)),
        saving,
        size(space.reserved_bytes),
        size(space.promised_bytes),
        stats.no_space_refusals.to_string(),
        match warn_at {
            None => "-".to_string(),
            Some(w) if w.crossed => format!("{}% (crossed)", w.percent),
            Some(w) => format!("{}%", w.percent),
        },
        mode_words(stats.mode).to_string(),
        stats.compression.to_string(),
    ]);
    table
}

/// The pool's mode as the table says it: an open for inspection (`stats` on a pool no
/// server holds, `serve --read-only`) is not the read-only that follows an I/O error.
fn mode_words(mode: Mode) -> &'static str {
    match mode {
        Mode::Normal => "normal",
        Mode::ReadOnly => "read-only after an error",
        Mode::OpenedReadOnly => "opened read-only",
    }
}

/// Every leaf of the statistics as `path : value`, sorted by name within each level.
/// Lists of `(name, value)` pairs become `list.name`, lists of objects with a `name`
/// become `list[name].field`, and byte counts get a human-readable size beside them.
pub fn flatten(value: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    flatten_into("", value, &mut out);
    out
}

fn flatten_into(prefix: &str, value: &Value, out: &mut Vec<(String, String)>) {
    let join = |key: &str| {
        if prefix.is_empty() {
            key.to_string()
        } else {
            format!("{prefix}.{key}")
        }
    };
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                flatten_into(&join(key), child, out);
            }
        }
        Value::Array(items) => {
            for (index, item) in items.iter().enumerate() {
                match item {
                    Value::Array(pair) if pair.len() == 2 && pair[0].is_string() => {
                        let name = pair[0].as_str().unwrap_or_default();
                        flatten_into(&join(name), &pair[1], out);
                    }
                    Value::Object(map) if map.get("name").is_some_and(Value::is_string) => {
                        let name = map["name"].as_str().unwrap_or_default();
                        flatten_into(&format!("{prefix}[{name}]"), item, out);
                    }
                    other => flatten_into(&format!("{prefix}[{index}]"), other, out),
                }
            }
        }
        Value::Number(number) => {
            // Byte counts and 4 KiB block counts both show their size, so that every
            // amount of space reads in the same unit.
            let block = fewerbytes_engine::BLOCK_BYTES as u64;
            let text = match (
                number.as_u64(),
                prefix.ends_with("bytes"),
                prefix.ends_with("blocks"),
            ) {
                (Some(bytes), true, _) if bytes >= 1024 => {
                    format!("{bytes} ({})", format_size(bytes))
                }
                (Some(blocks), _, true) if blocks > 0 => {
                    format!("{blocks} ({})", format_size(blocks.saturating_mul(block)))
                }
                (Some(n), _, _) => n.to_string(),
                _ => match number.as_f64() {
                    Some(f) => format!("{f:.2}"),
                    None => number.to_string(),
                },
            };
            out.push((prefix.to_string(), text));
        }
        Value::String(text) => out.push((prefix.to_string(), text.clone())),
        Value::Bool(flag) => out.push((prefix.to_string(), flag.to_string())),
        Value::Null => out.push((prefix.to_string(), "-".to_string())),
    }
}

/// Print every metadata region.
pub fn list_metadata(args: ListMetadataArgs, pool_path: &Path) -> Result<ExitCode> {
    let regions = inspect_pool(pool_path, |pool| match pool.call(&Request::Regions)? {
        Answer::Regions(regions) => Ok(regions),
        other => bail!("unexpected answer to list-metadata: {other:?}"),
    })?;
    if args.json {
        print_json(&regions)?;
    } else {
        region_table(&regions).print();
    }
    Ok(ExitCode::SUCCESS)
}

/// The `list-metadata` table; block ranges are inclusive, in 4 KiB blocks.
pub fn region_table(regions: &[Region]) -> Table {
    let mut table = Table::new(&[
        ("Region", Align::Left),
        ("Device", Align::Left),
        ("Path", Align::Left),
        ("Blocks", Align::Right),
        ("Size", Align::Right),
    ]);
    for region in regions {
        let range = match region.blocks {
            0 => "-".to_string(),
            n => format!("{}-{}", region.start_block, region.start_block + n - 1),
        };
        table.row(vec![
            region.name.clone(),
            region.device.clone(),
            region.path.clone(),
            range,
            format_size(region.bytes),
        ]);
    }
    table
}

/// The damaged ranges in a few words: how many, and what clears them.
pub fn damaged_summary(count: u64) -> String {
    match count {
        0 => "none".to_string(),
        n => format!(
            "{n} (volume ranges whose block-map page failed its checks: refused with EIO; \
             `fewerbytes check` lists them, `fewerbytes check --repair` clears them)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flatten_names_pairs_and_volumes() {
        let value = serde_json::json!({
            "stored_bytes": 8192,
            "limits": [["journal_entries_max", 4096]],
            "volumes": [{"name": "vm1", "size_bytes": 4096}],
            "saving_percent": 87.5,
            "dedup_saved_blocks": 3,
        });
        let lines = flatten(&value);
        assert!(lines.contains(&("stored_bytes".into(), "8192 (8.00 KiB)".into())));
        assert!(lines.contains(&("limits.journal_entries_max".into(), "4096".into())));
        assert!(lines.contains(&("volumes[vm1].name".into(), "vm1".into())));
        assert!(lines.contains(&("volumes[vm1].size_bytes".into(), "4096 (4.00 KiB)".into())));
        assert!(lines.contains(&("saving_percent".into(), "87.50".into())));
        assert!(lines.contains(&("dedup_saved_blocks".into(), "3 (12.00 KiB)".into())));
    }
}
