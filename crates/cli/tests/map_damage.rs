//! One flipped byte in a block-map page both super block copies share loses only the
//! 504 blocks (2 MiB) that page maps: volume "b" exports whole (`volume export` and
//! `qemu-img convert` over NBD, compared byte for byte), volume "a" serves its other
//! blocks, the damaged range fails with EIO over NBD for reads and writes, `volume
//! export a` fails naming the range, `check` exits 4 naming it (volume, bytes, the
//! page's block), `stats` and `pool info` count it; `check --repair` clears it (the
//! range reads as zeros) and `check` is clean again.
//!
//! Before this, the pool did not open at all ("corrupt block map page …"): no volume
//! could be exported, served or checked.

mod common;
use common::*;
use fewerbytes_format::page::{decode_page, PageKind};
use fewerbytes_format::superblock::SuperBlock;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

const BLOCK: u64 = 4096;
const VOLUME_BYTES: u64 = 8 << 20;
/// Map page 1 of "a": blocks 504..1008.
const FIRST: u64 = 504 * BLOCK;
const END: u64 = 1008 * BLOCK;

fn read_block(path: &Path, block: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK as usize];
    File::open(path)
        .unwrap()
        .read_exact_at(&mut buf, block * BLOCK)
        .unwrap();
    buf
}

/// The block of the newest copy of map page `index` of volume `owner` in the pool file.
fn map_page_block(pool: &Path, owner: u64, index: u64) -> u64 {
    let sb = [0, 1]
        .iter()
        .filter_map(|c| SuperBlock::decode(&read_block(pool, *c)).ok())
        .max_by_key(|sb| sb.generation)
        .unwrap();
    let file = File::open(pool).unwrap();
    let mut buf = vec![0u8; BLOCK as usize];
    let mut best: Option<(u64, u64)> = None;
    for slot in 1..sb.page_slots.min(1 << 16) {
        let block = sb.pages_start_block + slot;
        file.read_exact_at(&mut buf, block * BLOCK).unwrap();
        if let Ok((h, _)) = decode_page(&buf, PageKind::Map, sb.nonce, slot) {
            if h.owner == owner && h.index == index && best.is_none_or(|(g, _)| h.generation > g) {
                best = Some((h.generation, block));
            }
        }
    }
    best.expect("the map page is in the page store").1
}

fn volume_id(pool: &Path, name: &str) -> u64 {
    let ran = fewerbytes_ok(pool, &["volume", "list", "--json"]);
    let list: serde_json::Value = serde_json::from_str(&ran.stdout).unwrap();
    list.as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap()["id"]
        .as_u64()
        .unwrap()
}

/// What "a" and "b" hold, as written.
fn expected_a(repaired: bool) -> Vec<u8> {
    let mut a = vec![0x11u8; VOLUME_BYTES as usize];
    if repaired {
        a[FIRST as usize..END as usize].fill(0);
    }
    a
}

fn expected_b() -> Vec<u8> {
    let mut b = vec![0x22u8; VOLUME_BYTES as usize];
    b[(4 << 20)..].fill(0x33);
    b
}

fn export_equals(pool: &Path, dir: &TempDir, volume: &str, want: &[u8]) {
    let out = dir.join(&format!("{volume}.raw"));
    let _ = std::fs::remove_file(&out);
    fewerbytes_ok(pool, &["volume", "export", volume, out.to_str().unwrap()]);
    assert!(
        std::fs::read(&out).unwrap() == want,
        "volume export of '{volume}' differs from what was written"
    );
}

/// qemu-io's output for `commands` (it may exit 0 with a failed command).
fn qemu_io_output(uri: &str, commands: &[&str]) -> String {
    let mut cmd = tool("qemu-io");
    cmd.args(["-f", "raw"]);
    for c in commands {
        cmd.arg("-c").arg(c);
    }
    cmd.arg(uri);
    run_with_limit(&mut cmd, CLIENT_LIMIT).all_output()
}

#[test]
fn a_bad_map_page_loses_only_its_range_and_check_repair_clears_it() {
    let dir = TempDir::new("map-damage");
    let mut server = Server::start_new(dir.path(), &[("a", "8M"), ("b", "8M")], &[]);
    qemu_io(
        &server.unix_uri("a"),
        &["write -P 17 0 8388608".into(), "flush".into()],
    );
    qemu_io(
        &server.unix_uri("b"),
        &[
            "write -P 34 0 4194304".into(),
            "write -P 51 4194304 4194304".into(),
            "flush".into(),
        ],
    );
    server.stop();
    let pool = server.pool.clone();
    // Checkpoints that do not touch the page: both super block copies reach it.
    fewerbytes_ok(&pool, &["volume", "create", "t", "--size", "4M"]);
    fewerbytes_ok(&pool, &["volume", "delete", "t"]);
    let id = volume_id(&pool, "a");
    let block = map_page_block(&pool, id, 1);
    let mut page = read_block(&pool, block);
    page[1000] ^= 0x40;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&pool)
        .unwrap()
        .write_all_at(&page, block * BLOCK)
        .unwrap();
    let named = format!("volume 'a' bytes {FIRST}..{}", END - 1);

    // Not served: "b" exports whole, "a" fails naming the range, check exits 4.
    export_equals(&pool, &dir, "b", &expected_b());
    let out = dir.join("a.raw");
    let export = fewerbytes(&pool, &["volume", "export", "a", out.to_str().unwrap()]);
    assert!(!export.status.success(), "{}", export.report());
    assert!(export.all_output().contains(&named), "{}", export.report());
    assert!(!out.exists(), "a refused export left a file");
    // `--skip-damaged`: zeros in the range, named, exit 4; everything else whole.
    let skipped = fewerbytes(
        &pool,
        &[
            "volume",
            "export",
            "a",
            out.to_str().unwrap(),
            "--skip-damaged",
        ],
    );
    assert_eq!(skipped.status.code(), Some(4), "{}", skipped.report());
    assert!(
        skipped.all_output().contains(&named),
        "{}",
        skipped.report()
    );
    assert!(
        std::fs::read(&out).unwrap() == expected_a(true),
        "the export with --skip-damaged is not the volume with zeros in the range"
    );
    std::fs::remove_file(&out).unwrap();
    let check = fewerbytes(&pool, &["check"]);
    assert_eq!(check.status.code(), Some(4), "{}", check.report());
    assert!(
        check.stdout.contains(&named) && check.stdout.contains(&format!("block {block} ")),
        "check names the range and the page's block:\n{}",
        check.report()
    );
    let info = fewerbytes_ok(&pool, &["pool", "info"]);
    assert!(
        info.stdout.contains("Damaged ranges")
            && info
                .stdout
                .contains("1 (volume ranges whose block-map page failed"),
        "{}",
        info.report()
    );

    let info = fewerbytes_ok(&pool, &["pool", "info", "--json"]);
    let info: serde_json::Value = serde_json::from_str(&info.stdout).unwrap();
    assert_eq!(info["damaged_range_count"], 1, "{info}");

    // Served: "b" whole over NBD, "a" outside the range, EIO inside it.
    server.spawn();
    let stats = server.stats();
    let ranges = stats["damaged_ranges"].as_array().unwrap();
    assert_eq!(ranges.len(), 1, "{stats}");
    assert_eq!(ranges[0]["offset_bytes"], FIRST);
    assert_eq!(ranges[0]["len_bytes"], END - FIRST);
    assert_eq!(ranges[0]["block"], block);
    let copied = dir.join("b.nbd.raw");
    run_ok(tool("qemu-img").args([
        "convert",
        "-f",
        "raw",
        "-O",
        "raw",
        &server.unix_uri("b"),
        copied.to_str().unwrap(),
    ]));
    assert!(std::fs::read(&copied).unwrap() == expected_b());
    qemu_io(
        &server.unix_uri("a"),
        &[
            format!("read -P 17 0 {FIRST}"),
            format!("read -P 17 {END} {}", VOLUME_BYTES - END),
        ],
    );
    for command in [
        format!("read {FIRST} 4096"),
        format!("read {} 8192", FIRST - 4096),
        format!("write -P 1 {} 4096", FIRST + 40960),
        format!("write -z {FIRST} 4096"),
        format!("discard {FIRST} 4096"),
    ] {
        let said = qemu_io_output(&server.unix_uri("a"), &[&command]);
        assert!(
            said.contains("Input/output error"),
            "`{command}` in the damaged range did not fail with EIO:\n{said}"
        );
    }
    // Writes elsewhere in "a" work.
    qemu_io(
        &server.unix_uri("a"),
        &["write -P 17 0 4096".into(), "flush".into()],
    );
    server.stop();

    // `check --repair` clears the range (lost, now zeros) and check is clean.
    let repair = fewerbytes(&pool, &["check", "--repair"]);
    assert_eq!(repair.status.code(), Some(1), "{}", repair.report());
    assert!(
        repair.stdout.contains(&named) && repair.stdout.contains("now reads as zeros"),
        "{}",
        repair.report()
    );
    assert_check_clean(&pool);
    export_equals(&pool, &dir, "a", &expected_a(true));
    export_equals(&pool, &dir, "b", &expected_b());
}

/// A bad map page a snapshot shares with its volume is one copy: `check` names the
/// range of both (the snapshot as `VOLUME@SNAPSHOT`, as every command takes it),
/// the export of each fails naming it, and `check --repair` clears both.
#[test]
fn a_bad_map_page_a_snapshot_shares_is_named_for_both() {
    let dir = TempDir::new("map-damage-shared");
    let mut server = Server::start_new(dir.path(), &[("sv", "8M")], &[]);
    qemu_io(
        &server.unix_uri("sv"),
        &["write -P 17 0 8388608".into(), "flush".into()],
    );
    server.stop();
    let pool = server.pool.clone();
    fewerbytes_ok(&pool, &["volume", "snapshot", "sv", "s"]);
    // Checkpoints that do not touch the page: both super block copies reach it.
    fewerbytes_ok(&pool, &["volume", "create", "t", "--size", "4M"]);
    fewerbytes_ok(&pool, &["volume", "delete", "t"]);
    let block = map_page_block(&pool, volume_id(&pool, "sv"), 1);
    let mut page = read_block(&pool, block);
    page[1000] ^= 0x40;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&pool)
        .unwrap()
        .write_all_at(&page, block * BLOCK)
        .unwrap();
    let named = |volume: &str| format!("volume '{volume}' bytes {FIRST}..{}", END - 1);

    let check = fewerbytes(&pool, &["check"]);
    assert_eq!(check.status.code(), Some(4), "{}", check.report());
    for volume in ["sv", "sv@s"] {
        assert!(
            check.stdout.contains(&named(volume)),
            "check names {volume}:\n{}",
            check.report()
        );
    }
    for volume in ["sv", "sv@s"] {
        let out = dir.join(&format!("{volume}.raw"));
        let export = fewerbytes(&pool, &["volume", "export", volume, out.to_str().unwrap()]);
        assert!(!export.status.success(), "{}", export.report());
        assert!(
            export.all_output().contains(&named(volume)),
            "the export of {volume} names its range:\n{}",
            export.report()
        );
    }
    let repair = fewerbytes(&pool, &["check", "--repair"]);
    assert_eq!(repair.status.code(), Some(1), "{}", repair.report());
    for volume in ["sv", "sv@s"] {
        assert!(
            repair.stdout.contains(&named(volume)),
            "the repair names {volume}:\n{}",
            repair.report()
        );
    }
    assert_check_clean(&pool);
}
