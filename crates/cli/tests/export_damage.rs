//! `volume export` of a volume with a damaged data block (bytes changed in the pool
//! file under a stored block, so it fails its fingerprint): refused before anything
//! is written, to a file or a pipe, naming the block by its volume bytes and pool
//! block; with `--skip-damaged`, the image is the volume's bytes with zeros at that
//! block, and the block is named. `check --verify-data` names it the same way.

mod common;

use common::data::Rng;
use common::*;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Stdio};

const BLOCK: usize = 4096;
/// The damaged block of the volume (block 100: bytes 409600..413695).
const DAMAGED: usize = 100;

/// A pool with volume `vm` holding 2 MiB of noise whose block [`DAMAGED`] is damaged in
/// the pool file; the image imported, and the damaged block's pool block.
fn pool_with_a_damaged_block(dir: &Path) -> (std::path::PathBuf, Vec<u8>, usize) {
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "256M"]);
    fewerbytes_ok(&pool, &["volume", "create", "vm", "--size", "8M"]);
    let mut image = vec![0u8; 2 << 20];
    Rng::new(7).fill(&mut image);
    let path = dir.join("vm.raw");
    std::fs::write(&path, &image).expect("write the image");
    fewerbytes_ok(
        &pool,
        &["volume", "import", "vm", path.to_str().expect("utf-8")],
    );
    // Noise is stored whole: the block is found by its bytes.
    let bytes = std::fs::read(&pool).expect("read the pool file");
    let wanted = &image[DAMAGED * BLOCK..(DAMAGED + 1) * BLOCK];
    let pool_block = bytes
        .chunks(BLOCK)
        .position(|c| c == wanted)
        .expect("the block stored whole");
    drop(bytes);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&pool)
        .expect("open the pool file");
    file.write_all_at(&[0x5a; 16], (pool_block * BLOCK + 100) as u64)
        .expect("damage the data block");
    file.sync_all().expect("sync");
    (pool, image, pool_block)
}

/// How every message names the damaged block.
fn named(pool_block: usize) -> String {
    format!("volume 'vm' bytes 409600..413695 (pool block {pool_block})")
}

/// The directory's file names, sorted.
fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

// Regression: export stopped at the damaged block with exit status 1, leaving a
// partial image at the destination, and its error named the block three ways (device
// block, data block, volume offset).
#[test]
fn export_of_a_damaged_volume_writes_nothing_and_names_the_block() {
    let dir = TempDir::new("export-damaged");
    let (pool, _, pool_block) = pool_with_a_damaged_block(dir.path());
    let out_dir = dir.join("out");
    std::fs::create_dir_all(&out_dir).expect("out dir");
    let out = out_dir.join("vm.img");

    let ran = fewerbytes(&pool, &["volume", "export", "vm", out.to_str().unwrap()]);
    assert_eq!(ran.status.code(), Some(4), "{}", ran.report());
    assert!(
        names_in(&out_dir).is_empty(),
        "a refused export left {:?} at the destination:\n{}",
        names_in(&out_dir),
        ran.report()
    );
    assert!(
        ran.stderr.contains(&named(pool_block)),
        "the refusal does not name the block as `{}`:\n{}",
        named(pool_block),
        ran.report()
    );
    assert!(
        ran.stderr.contains("--skip-damaged") && ran.stderr.contains("discard 409600 4096"),
        "the refusal does not say what gets past it or clears it:\n{}",
        ran.report()
    );

    // A file that was there (exported before, say) stays as it was.
    std::fs::write(&out, b"an older image").expect("older image");
    let ran = fewerbytes(
        &pool,
        &["volume", "export", "vm", out.to_str().unwrap(), "--force"],
    );
    assert_eq!(ran.status.code(), Some(4), "{}", ran.report());
    assert_eq!(std::fs::read(&out).expect("image"), b"an older image");
    assert_eq!(names_in(&out_dir), ["vm.img"], "{}", ran.report());

    // A pipe cannot be taken back: nothing reaches it.
    let piped = Command::new(fewerbytes_bin())
        .args([
            "--pool",
            pool.to_str().unwrap(),
            "volume",
            "export",
            "vm",
            "-",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("run export to a pipe");
    assert_eq!(piped.status.code(), Some(4));
    assert!(
        piped.stdout.is_empty(),
        "{} bytes reached the pipe before the refusal",
        piped.stdout.len()
    );
    assert!(String::from_utf8_lossy(&piped.stderr).contains(&named(pool_block)));

    // check names the block the same way.
    let checked = fewerbytes(&pool, &["check", "--verify-data"]);
    assert_eq!(checked.status.code(), Some(4), "{}", checked.report());
    assert!(
        checked
            .stdout
            .contains(&format!("damage: {}: ", named(pool_block))),
        "{}",
        checked.report()
    );
}

#[test]
fn export_with_skip_damaged_writes_zeros_for_the_damaged_block_and_names_it() {
    let dir = TempDir::new("export-skip");
    let (pool, image, pool_block) = pool_with_a_damaged_block(dir.path());
    let out = dir.join("vm.img");
    let ran = fewerbytes(
        &pool,
        &[
            "volume",
            "export",
            "vm",
            out.to_str().unwrap(),
            "--skip-damaged",
        ],
    );
    assert_eq!(ran.status.code(), Some(4), "{}", ran.report());
    assert!(ran.stderr.contains(&named(pool_block)), "{}", ran.report());
    let mut expected = image;
    expected[DAMAGED * BLOCK..(DAMAGED + 1) * BLOCK].fill(0);
    expected.resize(8 << 20, 0);
    let exported = std::fs::read(&out).expect("exported image");
    assert_eq!(exported.len(), expected.len());
    let differing: Vec<usize> = (0..expected.len() / BLOCK)
        .filter(|b| exported[b * BLOCK..(b + 1) * BLOCK] != expected[b * BLOCK..(b + 1) * BLOCK])
        .collect();
    assert!(
        differing.is_empty(),
        "blocks {differing:?} differ from the volume with zeros at block {DAMAGED}"
    );
}
