//! One model of space (README.md, "Capacity"): every command that shows the pool's
//! space shows the same figure under the same name. A pool with a thick volume that
//! reserves most of it and a thin one, holding deduplicated and compressed data:
//! `stats --json`, `pool info --json`, `volume list --json`, plain `stats` and the
//! Proxmox plugin's `status` (run in perl against the served pool, as the plugin's
//! own tests run it) agree; Used + Available = Size; Available is what a thin write
//! can take, far less than the free device; and the plugin's avail is what a new
//! disk (thick, as the plugin makes them) can reserve: one block more is refused,
//! exactly that much is granted.
//!
//! Needs qemu-img, perl and libjson-perl (as `proxmox.rs`); a missing one is a failure.

mod common;

use common::data::mixed_image;
use common::*;
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

const MIB: u64 = 1 << 20;

/// The space figures `pool info --json` and `stats --json` both carry.
const SPACE_KEYS: [&str; 14] = [
    "size_bytes",
    "used_bytes",
    "available_bytes",
    "data_bytes",
    "stored_bytes",
    "metadata_bytes",
    "metadata_in_data_bytes",
    "freeing_bytes",
    "reserved_bytes",
    "reserved_unused_bytes",
    "kept_bytes",
    "metadata_kept_bytes",
    "reservable_bytes",
    "promised_bytes",
];

/// The plugin, loaded as pve-storage loads it (with the tests' stand-ins for the PVE
/// modules), on the served pool: `status` prints Proxmox's (total, avail, used,
/// active); `alloc KIB` allocates a disk of KIB KiB for VM 100, as Proxmox's "add
/// disk" does, and prints its name or the error.
const PLUGIN_PL: &str = r#"
use strict;
use warnings;
use JSON;
use PVE::Storage;
use PVE::Storage::Custom::FewerbytesPlugin;
my ($bin, $pool, $socket, $action, $kib) = @ARGV;
$PVE::Storage::Custom::FewerbytesPlugin::FEWERBYTES = $bin;
my $scfg = {
    type => 'fewerbytes',
    content => { images => 1 },
    'fewerbytes-pool' => $pool,
    'fewerbytes-socket' => $socket,
    'fewerbytes-control-socket' => "$pool.ctl",
};
my $plugin = 'PVE::Storage::Custom::FewerbytesPlugin';
if ($action eq 'status') {
    my ($total, $avail, $used, $active) = $plugin->status('fb', $scfg, {});
    print encode_json({ total => 0 + $total, avail => 0 + $avail, used => 0 + $used,
        active => 0 + $active });
} else {
    my $name = eval { $plugin->alloc_image('fb', $scfg, 100, 'raw', undef, $kib) };
    print encode_json({ name => $name, error => $@ });
}
"#;

fn plugin(server: &Server, args: &[&str]) -> Value {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../packaging/proxmox");
    let mut cmd = Command::new(require_tool("perl"));
    cmd.arg("-I")
        .arg(&dir)
        .arg("-I")
        .arg(dir.join("t/lib"))
        .arg("-e")
        .arg(PLUGIN_PL)
        .arg(fewerbytes_bin())
        .arg(&server.pool)
        .arg(&server.socket)
        .args(args);
    let ran = run_ok(&mut cmd);
    serde_json::from_str(&ran.stdout)
        .unwrap_or_else(|e| panic!("the plugin printed no JSON ({e}):\n{}", ran.report()))
}

fn json(ran: &Ran) -> Value {
    serde_json::from_str(&ran.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", ran.report()))
}

fn number(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no number {key} in {v:#}"))
}

/// Everything each command says of the pool's space, taken while nothing writes.
struct Figures {
    stats: Value,
    info: Value,
    list: Vec<Value>,
    table: Vec<u64>,
    status: Value,
}

fn space(v: &Value) -> Vec<u64> {
    SPACE_KEYS.iter().map(|k| number(v, k)).collect()
}

/// The figures of every command, taken between two `stats` that agree (a checkpoint
/// of the server's own in between, which moves blocks from Freeing to free and
/// writes pages, is taken again).
fn figures(server: &Server) -> Figures {
    for _ in 0..5 {
        let stats = server.stats();
        let info = json(&server.cli_ok(&["pool", "info", "--json"]));
        let list = json(&server.cli_ok(&["volume", "list", "--json"]))
            .as_array()
            .expect("volume list --json is an array")
            .clone();
        let row = server.cli_ok(&["stats", "--bytes", "--no-header"]).stdout;
        // Device, Size, Used, Available.
        let table = row
            .split_whitespace()
            .skip(1)
            .take(3)
            .map(|c| {
                c.parse()
                    .unwrap_or_else(|_| panic!("{c:?} of {row:?} is not a byte count"))
            })
            .collect();
        let status = plugin(server, &["status"]);
        if space(&server.stats()) == space(&stats) {
            return Figures {
                stats,
                info,
                list,
                table,
                status,
            };
        }
    }
    panic!("the pool's space kept changing while nothing wrote");
}

#[test]
fn stats_pool_info_volume_list_and_the_proxmox_plugin_show_one_model_of_space() {
    let dir = TempDir::new("capacity");
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "1G"]);
    // Thick: holds most of the pool back. Thin: reserves nothing.
    fewerbytes_ok(&pool, &["volume", "create", "thick", "--size", "800M"]);
    fewerbytes_ok(
        &pool,
        &["volume", "create", "thin", "--size", "256M", "--thin"],
    );
    let server = Server::start(dir.path(), &pool, &[]);

    // Zeros, repeated blocks, compressible text and random data; the same image in
    // both volumes, so the thin volume's copy is deduplicated.
    let image = dir.join("mixed.img");
    std::fs::write(&image, mixed_image(16 * MIB / 4096, 7)).expect("write the image");
    let image_arg = image.to_str().expect("utf-8 path");
    for volume in ["thick", "thin"] {
        run_ok(tool("qemu-img").args([
            "convert",
            "-n",
            "-f",
            "raw",
            "-O",
            "raw",
            image_arg,
            &server.unix_uri(volume),
        ]));
    }

    let f = figures(&server);
    // The same figure under the same name in `stats --json` and `pool info --json`.
    for key in SPACE_KEYS {
        assert_eq!(
            number(&f.stats, key),
            number(&f.info, key),
            "stats --json and pool info --json differ on {key}:\nstats {:#}\npool info {:#}",
            f.stats,
            f.info
        );
    }
    let (size, used, available) = (
        number(&f.stats, "size_bytes"),
        number(&f.stats, "used_bytes"),
        number(&f.stats, "available_bytes"),
    );
    assert_eq!(
        used + available,
        size,
        "Used + Available != Size: {:#}",
        f.stats
    );
    // Used is made of its parts, but for the blocks packers hold open, which count in
    // Stored and in Available (at most a run and a fragment block per zone).
    let parts = number(&f.stats, "stored_bytes")
        + number(&f.stats, "metadata_bytes")
        + number(&f.stats, "reserved_unused_bytes")
        + number(&f.stats, "kept_bytes");
    let open_max =
        (u64::from(fewerbytes_engine::RUN_BLOCKS) + 1) * number(&f.stats, "threads") * 4096;
    assert!(
        parts >= used && parts - used <= open_max,
        "stored + metadata + reserved unused + kept free ({parts}) is not Used ({used}): {:#}",
        f.stats
    );
    // Size is the data region and the metadata regions.
    assert_eq!(
        number(&f.info, "data_bytes") + number(&f.info, "metadata_regions_bytes"),
        size,
        "{:#}",
        f.info
    );
    // Plain stats shows the same three numbers.
    assert_eq!(
        f.table,
        vec![size, used, available],
        "plain stats (Size, Used, Available) differs from stats --json"
    );

    // The figures differ from one another: dedup and compression store less than
    // was written, and the thick volume holds back most of the pool, which thin
    // writes cannot take though the device is mostly free.
    let logical: u64 = f.list.iter().map(|v| number(v, "logical_used_bytes")).sum();
    let stored = number(&f.stats, "stored_bytes");
    assert!(
        stored > 0 && stored * 2 < logical,
        "dedup and compression should store less than half of {logical} bytes: {stored}"
    );
    let reserved_unused = number(&f.stats, "reserved_unused_bytes");
    assert!(reserved_unused > 700 * MIB, "{:#}", f.stats);
    assert!(
        available < size / 4 && available > 0,
        "the thick volume holds back most of the pool: {:#}",
        f.stats
    );

    // Volumes: their reservations add up to the pool's, under the same names, and
    // stats --json's volumes say the same as volume list --json.
    let sum = |key: &str| -> u64 { f.list.iter().map(|v| number(v, key)).sum() };
    assert_eq!(sum("reserved_bytes"), number(&f.stats, "reserved_bytes"));
    assert_eq!(sum("reserved_unused_bytes"), reserved_unused);
    assert_eq!(sum("size_bytes"), number(&f.stats, "promised_bytes"));
    let stats_volumes = f.stats["volumes"].as_array().expect("stats volumes");
    for v in &f.list {
        let name = v["name"].as_str().expect("name");
        let s = stats_volumes
            .iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("{name} is not in stats --json"));
        for key in [
            "size_bytes",
            "logical_used_bytes",
            "reserved_bytes",
            "reserved_unused_bytes",
        ] {
            assert_eq!(number(s, key), number(v, key), "{name}: {key}");
        }
    }

    // The Proxmox plugin: total is Size; avail is what a new (thick) disk can
    // reserve; used is the rest, as Proxmox adds them.
    let reservable = number(&f.stats, "reservable_bytes");
    assert_eq!(number(&f.status, "active"), 1, "{}", f.status);
    assert_eq!(number(&f.status, "total"), size, "{}", f.status);
    assert_eq!(number(&f.status, "avail"), reservable, "{}", f.status);
    assert_eq!(number(&f.status, "used"), size - reservable, "{}", f.status);
    assert!(reservable <= available, "{:#}", f.stats);

    // What avail promises holds: a disk one block larger is refused with the
    // numbers, a disk of exactly avail is made.
    let avail_kib = reservable / 1024;
    let refused = plugin(&server, &["alloc", &(avail_kib + 4).to_string()]);
    let why = refused["error"].as_str().unwrap_or_default();
    assert!(
        refused["name"].is_null() && why.contains("free for reservations"),
        "a disk larger than avail was not refused: {refused}"
    );
    let made = plugin(&server, &["alloc", &avail_kib.to_string()]);
    assert_eq!(
        made["name"], "vm-100-disk-0",
        "a disk of avail could not be made: {made}"
    );
    let after = figures(&server);
    assert!(
        number(&after.status, "avail") < 4 * MIB,
        "nothing is left to reserve once avail is taken: {}",
        after.status
    );
}
