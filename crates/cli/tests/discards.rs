//! Space freed in a pool reaches the host: after a volume is deleted through a
//! running server, the pool file's allocated size (`st_blocks`, what `du` shows)
//! falls by what the volume held, and `stats --verbose` counts the discards. With
//! `serve --no-discard` the file keeps its blocks. On a loop device, the device's own
//! discard counters move by what the deleted volume held.

mod common;

use common::data::Rng;
use common::loop_device::LoopDevice;
use common::*;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

const MIB: u64 = 1 << 20;

/// Bytes the file system has allocated for `path` (`du`'s number).
fn allocated_bytes(path: &Path) -> u64 {
    std::fs::metadata(path)
        .expect("stat the pool file")
        .blocks()
        * 512
}

/// A pool with volume "vm" holding 16 MiB of random bytes, served with `serve_args`;
/// returns the server and the pool file's allocated size with the data in it.
fn served_with_data(dir: &TempDir, serve_args: &[&str]) -> (Server, u64) {
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "256M"]);
    fewerbytes_ok(&pool, &["volume", "create", "vm", "--size", "64M"]);
    fewerbytes_ok(&pool, &["volume", "create", "keep", "--size", "4M"]);
    let random = dir.join("random.bin");
    let mut bytes = vec![0u8; (16 * MIB) as usize];
    Rng::new(29).fill(&mut bytes);
    std::fs::write(&random, &bytes).expect("write random.bin");
    let server = Server::start(dir.path(), &pool, serve_args);
    qemu_io(
        &server.unix_uri("vm"),
        &[
            format!("write -s {} 0 16M", random.display()),
            "flush".into(),
        ],
    );
    qemu_io(
        &server.unix_uri("keep"),
        &["write -P 0x5a 0 1M".into(), "flush".into()],
    );
    let held = allocated_bytes(&pool);
    (server, held)
}

#[test]
fn a_deleted_volume_gives_its_space_back_to_the_host_file_system() {
    let dir = TempDir::new("discards");
    let (mut server, held) = served_with_data(&dir, &[]);
    let pool = server.pool.clone();
    server.cli_ok(&["volume", "delete", "vm"]);
    let after = allocated_bytes(&pool);
    assert!(
        after + 15 * MIB <= held,
        "the pool file holds {after} bytes after deleting 16 MiB of data (it held {held})"
    );
    let verbose = server.cli_ok(&["stats", "--verbose"]).stdout;
    let discard_line = verbose
        .lines()
        .find(|l| l.contains("data_device.discard_bytes"))
        .unwrap_or_else(|| panic!("stats --verbose has no data_device.discard_bytes:\n{verbose}"));
    assert!(
        !discard_line.trim_end().ends_with(" 0"),
        "no discard counted: {discard_line}"
    );
    // Plain stats of the served pool after the delete: the row adds up in bytes
    // (Size = Used + Available) and says the mode.
    let row = server.cli_ok(&["stats", "--bytes", "--no-header"]).stdout;
    let cells: Vec<u64> = row
        .split_whitespace()
        .skip(1)
        .take(3)
        .map(|c| {
            c.parse()
                .unwrap_or_else(|_| panic!("{c:?} of {row:?} is not a byte count"))
        })
        .collect();
    assert_eq!(
        cells.first().copied(),
        Some(cells.iter().skip(1).sum::<u64>()),
        "Size != Used + Available: {row}"
    );
    assert!(row.contains("normal"), "the mode is in plain stats: {row}");
    qemu_io(&server.unix_uri("keep"), &["read -P 0x5a 0 1M".into()]);
    let status = server.stop();
    assert!(status.success(), "{}", server.log_text());
    drop(server);
    assert_check_clean(&pool);
}

#[test]
fn with_no_discard_the_pool_file_keeps_its_blocks() {
    let dir = TempDir::new("nodiscard");
    let (mut server, held) = served_with_data(&dir, &["--no-discard"]);
    let pool = server.pool.clone();
    server.cli_ok(&["volume", "delete", "vm"]);
    assert!(
        allocated_bytes(&pool) >= held,
        "serve --no-discard punched holes in the pool file"
    );
    assert_eq!(server.stats()["data_device"]["discards"], 0);
    let status = server.stop();
    assert!(status.success(), "{}", server.log_text());
}

#[test]
fn a_deleted_volume_is_discarded_on_a_loop_device() {
    let dir = TempDir::new("discardloop");
    let backing = dir.join("backing.img");
    run_ok(tool("truncate").args(["-s", "256M"]).arg(&backing));
    let Some(device) = LoopDevice::attach_or_skip(&backing) else {
        return;
    };
    let dev = device.path.clone();
    fewerbytes_ok(&dev, &["pool", "create", device.path_str()]);
    fewerbytes_ok(&dev, &["volume", "create", "vm", "--size", "64M"]);
    fewerbytes_ok(&dev, &["volume", "create", "keep", "--size", "4M"]);
    let random = dir.join("random.bin");
    let mut bytes = vec![0u8; (16 * MIB) as usize];
    Rng::new(31).fill(&mut bytes);
    std::fs::write(&random, &bytes).expect("write random.bin");
    let mut server = Server::start(dir.path(), &dev, &[]);
    qemu_io(
        &server.unix_uri("vm"),
        &[
            format!("write -s {} 0 16M", random.display()),
            "flush".into(),
        ],
    );
    qemu_io(
        &server.unix_uri("keep"),
        &["write -P 0x3c 0 1M".into(), "flush".into()],
    );
    let (requests, sectors) = device.discards();
    let held = allocated_bytes(&backing);

    server.cli_ok(&["volume", "delete", "vm"]);
    // The block device was sent BLKDISCARD for the volume's blocks (its own discard
    // counters moved by at least what the volume held), and the file under the loop
    // device gave those blocks back to its file system.
    let (requests_after, sectors_after) = device.discards();
    assert!(
        requests_after > requests,
        "no discard request reached {}",
        device.path_str()
    );
    assert!(
        (sectors_after - sectors) * 512 >= 15 * MIB,
        "{} discarded {} bytes after deleting 16 MiB of data",
        device.path_str(),
        (sectors_after - sectors) * 512
    );
    let after = allocated_bytes(&backing);
    assert!(
        after + 15 * MIB <= held,
        "the loop device's file holds {after} bytes after the delete (it held {held})"
    );
    qemu_io(&server.unix_uri("keep"), &["read -P 0x3c 0 1M".into()]);
    let status = server.stop();
    assert!(status.success(), "{}", server.log_text());
    drop(server);
    assert_check_clean(&dev);
}
