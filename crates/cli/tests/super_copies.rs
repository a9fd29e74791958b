//! A served pool killed (-9), then one bit of its newest super block copy flipped:
//! every volume still exports with every flushed write (`volume export`, compared by
//! `qemu-img compare` with what was written), `check` finds nothing, and a server
//! started on it serves it again.
//!
//! Regression (fails before deferred frees): a bit flipped at byte 3000 of the
//! newest copy (past every used field) made every open fall back to the older copy,
//! whose pages the newer checkpoint had retired and discarded ("corrupt catalog page
//! … bad magic 0x0"): `volume export`, `serve --read-only` and `check --repair` all
//! failed, and every volume was lost.

mod common;
use common::*;
use std::path::Path;

const BLOCK: usize = 4096;
const VOLUMES: [&str; 3] = ["a", "b", "c"];
const VOLUME_BYTES: usize = 16 << 20;

/// The generation of the super block copy in `block`, if it is valid.
fn generation(block: &[u8]) -> Option<u64> {
    fewerbytes_format::superblock::SuperBlock::decode(block)
        .ok()
        .map(|sb| sb.generation)
}

/// The reference image of a volume: what `qemu-io` wrote, pattern by pattern.
fn reference(writes: &[(u8, usize, usize)]) -> Vec<u8> {
    let mut image = vec![0u8; VOLUME_BYTES];
    for &(pattern, offset, len) in writes {
        image[offset..offset + len].fill(pattern);
    }
    image
}

/// Write `writes` (pattern, offset, length) to a served volume and flush.
fn write_all(server: &Server, volume: &str, writes: &[(u8, usize, usize)]) {
    let mut commands: Vec<String> = writes
        .iter()
        .map(|(p, o, l)| format!("write -P {p} {o} {l}"))
        .collect();
    commands.push("flush".into());
    qemu_io(&server.unix_uri(volume), &commands);
}

fn compare(dir: &Path, pool: &Path, volume: &str, expected: &[u8], when: &str) {
    let want = dir.join(format!("{volume}.want"));
    let got = dir.join(format!("{volume}.got"));
    std::fs::write(&want, expected).unwrap();
    let _ = std::fs::remove_file(&got);
    let export = fewerbytes(pool, &["volume", "export", volume, got.to_str().unwrap()]);
    assert!(
        export.status.success(),
        "{when}: volume export of '{volume}' failed:\n{}",
        export.report()
    );
    let mut cmd = tool("qemu-img");
    cmd.args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&want)
        .arg(&got);
    let ran = run_with_limit(&mut cmd, std::time::Duration::from_secs(120));
    assert!(
        ran.status.success(),
        "{when}: volume '{volume}' does not hold every flushed write:\n{}",
        ran.report()
    );
}

#[test]
fn a_flipped_bit_in_the_newest_super_block_copy_of_a_killed_pool_loses_no_volume() {
    let dir = TempDir::new("super-copies");
    let size = format!("{}M", VOLUME_BYTES >> 20);
    let volumes: Vec<(&str, &str)> = VOLUMES.iter().map(|v| (*v, size.as_str())).collect();
    let mut server = Server::start_new(dir.path(), &volumes, &[]);
    let mut writes: Vec<Vec<(u8, usize, usize)>> = vec![Vec::new(); VOLUMES.len()];
    // Three rounds, a volume operation (two checkpoints) between them, so the
    // older copy's pages were retired by the newer and the journal spans both.
    for round in 0..3usize {
        for (i, volume) in VOLUMES.iter().enumerate() {
            let pattern = (0x11 * (round + 1) + i) as u8;
            let offset = (round * 3 + i) * (1 << 20);
            let w = vec![
                (pattern, offset, 2 << 20),
                (pattern ^ 0xff, BLOCK * (round + 1), BLOCK),
            ];
            write_all(&server, volume, &w);
            writes[i].extend(w);
        }
        server.cli_ok(&["volume", "create", &format!("t{round}"), "--size", "4M"]);
        server.cli_ok(&["volume", "delete", &format!("t{round}")]);
    }
    // A flushed tail no checkpoint holds.
    let tail = vec![(0x5a, 10 << 20, 1 << 20)];
    write_all(&server, "b", &tail);
    writes[1].extend(tail);
    server.kill9();

    let mut image = std::fs::read(&server.pool).unwrap();
    let gens = [0, 1].map(|c| generation(&image[c * BLOCK..(c + 1) * BLOCK]));
    let newest = match gens {
        [Some(g0), Some(g1)] => usize::from(g1 > g0),
        other => panic!("both super block copies should be valid, found generations {other:?}"),
    };
    image[newest * BLOCK + 3000] ^= 0x08;
    std::fs::write(&server.pool, &image).unwrap();

    for (i, volume) in VOLUMES.iter().enumerate() {
        compare(
            dir.path(),
            &server.pool,
            volume,
            &reference(&writes[i]),
            "newest copy flipped",
        );
    }
    assert_check_clean(&server.pool);
    // Served again: the data is there over NBD, and the first read-write open
    // rewrote the damaged copy (counted by that open's `pool info`).
    server.spawn();
    let info = server.cli_ok(&["pool", "info", "--json"]);
    let info: serde_json::Value = serde_json::from_str(&info.stdout).unwrap();
    assert!(
        info["metadata_copies_repaired"].is_u64(),
        "pool info --json counts the copies rewritten: {info}"
    );
    qemu_io(
        &server.unix_uri("b"),
        &["read -P 90 10485760 1048576".to_string()],
    );
    server.stop();
    let image = std::fs::read(&server.pool).unwrap();
    let gens = [0, 1].map(|c| generation(&image[c * BLOCK..(c + 1) * BLOCK]));
    assert!(
        gens.iter().all(Option::is_some),
        "the damaged copy was rewritten: generations {gens:?}"
    );
}

/// Byte offsets in the pool file of the two copies of volume `name`'s top block-map
/// directory page in the newest checkpoint (format version 3 writes each directory
/// page twice).
fn map_directory_copies(pool: &Path, name: &str) -> [u64; 2] {
    use fewerbytes_format::catalog::Catalog;
    use fewerbytes_format::page::{decode_page_ref, PageKind, ADDRESS_DATA_REGION};
    use fewerbytes_format::superblock::SuperBlock;
    let image = std::fs::read(pool).unwrap();
    let sb = (0..2)
        .filter_map(|c| SuperBlock::decode(&image[c * BLOCK..(c + 1) * BLOCK]).ok())
        .max_by_key(|sb| sb.generation)
        .expect("a valid super block copy");
    let offset = |address: u64| {
        if address & ADDRESS_DATA_REGION != 0 {
            sb.data_offset_bytes + (address & !ADDRESS_DATA_REGION) * BLOCK as u64
        } else {
            (sb.pages_start_block + address) * BLOCK as u64
        }
    };
    let mut stream = Vec::new();
    for r in &sb.catalog {
        let at = offset(r.address) as usize;
        let (h, payload) =
            decode_page_ref(&image[at..at + BLOCK], PageKind::Catalog, sb.nonce, r).unwrap();
        stream.extend_from_slice(&payload[..h.count as usize]);
    }
    stream.truncate(sb.catalog_bytes as usize);
    let catalog = Catalog::decode(&stream).unwrap();
    let volume = catalog.volumes.iter().find(|v| v.name == name).unwrap();
    let top = volume.map.top[0];
    assert_ne!(top.twin, 0, "a directory page has two copies");
    [offset(top.address), offset(top.twin)]
}

/// Overwrite 64 bytes of the payload of the page at byte `at` of the pool file.
fn damage_page(pool: &Path, at: u64) {
    use std::os::unix::fs::FileExt;
    std::fs::OpenOptions::new()
        .write(true)
        .open(pool)
        .unwrap()
        .write_all_at(&[0xa5; 64], at + 1000)
        .unwrap();
}

#[test]
fn a_bad_copy_of_a_directory_page_is_read_from_the_other_and_the_scrub_rewrites_it() {
    let dir = TempDir::new("dir-copies");
    let mut server = Server::start_new(dir.path(), &[("a", "16M")], &[]);
    let writes = vec![(0x3c, 0, 4 << 20), (0xc3, 12 << 20, BLOCK)];
    write_all(&server, "a", &writes);
    server.stop();
    let pool = server.pool.clone();
    // The second copy is what an open does not read: the scrub finds it, names it and
    // rewrites the page (both copies, elsewhere).
    let [_, second] = map_directory_copies(&pool, "a");
    damage_page(&pool, second);
    let scrub = fewerbytes_ok(&pool, &["scrub", "--wait"]);
    let out = scrub.all_output();
    assert!(
        out.contains("directory (repaired)") && out.contains("its second copy"),
        "the scrub names the bad copy and repairs it:\n{out}"
    );
    let again = fewerbytes_ok(&pool, &["scrub", "--wait"]);
    assert!(
        !again.all_output().contains("second copy"),
        "rewritten:\n{}",
        again.all_output()
    );
    // The first copy bad: every open reads the second, counts it, and a read-write
    // one rewrites the page; nothing is lost.
    let [first, _] = map_directory_copies(&pool, "a");
    damage_page(&pool, first);
    let info = fewerbytes_ok(&pool, &["pool", "info", "--json"]);
    let info: serde_json::Value = serde_json::from_str(&info.stdout).unwrap();
    assert_eq!(
        info["metadata_copies_repaired"].as_u64(),
        Some(1),
        "pool info --json counts the copy read from its twin: {info}"
    );
    assert_check_clean(&pool);
    compare(
        dir.path(),
        &pool,
        "a",
        &reference(&writes),
        "first copy bad",
    );
}
