//! Real NBD clients against `fewerbytes serve`: nbdinfo, qemu-io, qemu-img, fio,
//! nbdsh (libnbd's Python bindings), nbdfuse with a loop device and ext4, and
//! nbd-client's kernel-style handshake.
//!
//! Each test starts its own server on its own pool, unix socket and TCP port in its
//! own temporary directory, and stops it at the end. A missing client is a failure
//! that names the package to install (`scripts/test.sh` installs them all).
//! `FEWERBYTES_SOAK=1` makes the fio workloads larger.

mod common;

use common::data::*;
use common::fuse_loop::FuseLoopStack;
use common::libnbd::*;
use common::nbdinfo::*;
use common::*;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * 1024;

#[test]
fn nbdinfo_sees_negotiated_export_and_lists_every_volume() {
    let dir = TempDir::new("info");
    let server = Server::start_new(
        dir.path(),
        &[("alpha", "64M"), ("beta", "96M"), ("gamma", "1G")],
        &["--default-volume", "beta"],
    );

    for uri in [server.unix_uri("alpha"), server.tcp_uri("alpha")] {
        let info = nbdinfo_json(&uri);
        assert_eq!(info["protocol"], "newstyle-fixed", "{info}");
        let e = first_export(&info);
        assert_eq!(e["export-name"], "alpha", "{info}");
        assert_eq!(e["export-size"].as_u64(), Some(64 * MIB), "{info}");
        // Any byte offset and length is served, as qemu-nbd does on a raw file.
        assert_eq!(e["block_size_minimum"].as_u64(), Some(1), "{info}");
        assert_eq!(e["block_size_preferred"].as_u64(), Some(4096), "{info}");
        assert_eq!(e["block_size_maximum"].as_u64(), Some(32 * MIB), "{info}");
        for flag in [
            "can_multi_conn",
            "can_trim",
            "can_zero",
            "can_fua",
            "can_flush",
        ] {
            assert_eq!(e[flag], true, "{flag} not advertised: {info}");
        }
        assert_eq!(e["is_read_only"], false, "{info}");
        let contexts = e["contexts"]
            .as_array()
            .unwrap_or_else(|| panic!("no meta contexts: {info}"));
        assert!(
            contexts.iter().any(|c| c == "base:allocation"),
            "base:allocation missing: {info}"
        );
    }

    // The empty export name is the default volume.
    let default = nbdinfo_json(&server.unix_uri(""));
    assert_eq!(
        first_export(&default)["export-size"].as_u64(),
        Some(96 * MIB),
        "{default}"
    );

    // Every volume is listed, over both transports, with its size.
    for uri in [server.unix_uri(""), server.tcp_uri("")] {
        let exports = listed_exports(&uri);
        for (name, size) in [
            ("alpha", 64 * MIB),
            ("beta", 96 * MIB),
            ("gamma", 1024 * MIB),
        ] {
            let e = exports
                .get(name)
                .unwrap_or_else(|| panic!("`nbdinfo --list` on {uri} lacks {name}: {exports:?}"));
            assert_eq!(e["export-size"].as_u64(), Some(size), "{name}: {e}");
        }
    }

    // An unknown export is refused, not served.
    let ran = run_with_limit(
        tool("nbdinfo").arg(server.unix_uri("no-such-volume")),
        CLIENT_LIMIT,
    );
    assert!(
        !ran.status.success(),
        "nbdinfo connected to a volume that does not exist:\n{}",
        ran.report()
    );
}

/// (pattern byte, offset, length): odd offsets and sizes from 512 B to 8 MiB,
/// including writes that overlap earlier ones.
const PATTERN_WRITES: [(u8, u64, u64); 12] = [
    (0x11, 0, 512),
    (0x22, 512, 3 * 512),
    (0x33, 7 * 512, 4096),
    (0x44, 13 * 4096 + 1536, 8 * MIB),
    (0x55, 40 * MIB + 512, 65 * KIB + 512),
    (0x66, 41 * MIB - 512, 1536),
    (0x77, 50 * MIB + 3 * 512, MIB + 3 * 512),
    // Overlaps: inside 0x44's range, straddling its end, straddling 0x77's start.
    (0x88, 2 * MIB + 512, 5 * 512),
    (0x99, 13 * 4096 + 1536 + 8 * MIB - 2048, 4 * 4096 + 512),
    (0xaa, 50 * MIB - 4096 + 512, 8192),
    (0xbb, 0, 3 * 512),
    (0xcc, 63 * MIB + 512, MIB - 512),
];

/// What the writes above leave at each byte, as runs of (offset, length, byte).
fn expected_pattern_runs() -> Vec<(u64, u64, u8)> {
    let mut boundaries: Vec<u64> = vec![0, 64 * MIB];
    for (_, off, len) in PATTERN_WRITES {
        boundaries.push(off);
        boundaries.push(off + len);
    }
    boundaries.sort_unstable();
    boundaries.dedup();
    let mut runs = Vec::new();
    for pair in boundaries.windows(2) {
        let (start, end) = (pair[0], pair[1]);
        let byte = PATTERN_WRITES
            .iter()
            .rev()
            .find(|(_, off, len)| *off <= start && start < off + len)
            .map_or(0, |(p, _, _)| *p);
        runs.push((start, end - start, byte));
    }
    runs
}

#[test]
fn qemu_io_patterns_at_odd_offsets_read_back() {
    let dir = TempDir::new("qio");
    let server = Server::start_new(dir.path(), &[("vol", "64M")], &[]);
    let uri = server.unix_uri("vol");

    let writes: Vec<String> = PATTERN_WRITES
        .iter()
        .map(|(p, off, len)| format!("write -P {p:#x} {off} {len}"))
        .collect();
    qemu_io(&uri, &writes);
    let reads: Vec<String> = expected_pattern_runs()
        .iter()
        .flat_map(|(off, len, p)| {
            // Whole run, plus its first and last 512 bytes on their own.
            let mut v = vec![format!("read -P {p:#x} {off} {len}")];
            if *len > 1024 {
                v.push(format!("read -P {p:#x} {off} 512"));
                v.push(format!("read -P {p:#x} {} 512", off + len - 512));
            }
            v
        })
        .collect();
    // Read back on a new connection, over TCP as well as the unix socket.
    qemu_io(&uri, &reads);
    qemu_io(&server.tcp_uri("vol"), &reads);

    // Byte-unaligned requests: with a minimum block size of 1, qemu sends them as
    // they are and the server does the read-modify-write.
    qemu_io(
        &uri,
        &[
            "write -P 0xde 1000 3333".into(),
            "read -P 0xde 1000 3333".into(),
            "read -P 0xbb 0 1000".into(),
        ],
    );

    // Requests at and past the 32 MiB maximum (the client splits the longer one).
    qemu_io(
        &uri,
        &[
            "write -P 0xe1 16M 32M".into(),
            "read -P 0xe1 16M 32M".into(),
            "write -P 0xe2 4M 40M".into(),
            "read -P 0xe2 4M 40M".into(),
            "read -P 0xe1 44M 4M".into(),
        ],
    );

    // QEMU 10 negotiates extended headers (64-bit lengths) when the server offers
    // them; the issue asks for them, and qemu-io is the only client here that uses them.
    let log = server.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("NBD transmission") && l.contains("extended: true")),
        "no qemu-io connection negotiated extended headers; server log:\n{log}"
    );
    // An admin reading the log at the default level sees each client come and go.
    for event in ["NBD client attached", "NBD client detached"] {
        assert!(
            log.lines()
                .any(|l| l.contains(" INFO ") && l.contains(event) && l.contains("export=")),
            "no INFO line '{event}' naming the export; server log:\n{log}"
        );
    }
}

/// A seeded random mix of writes (pattern and zero), trims and write-zeroes over a
/// 64 MiB volume, checked against a model of what each 512-byte sector holds.
/// `FEWERBYTES_TEST_SEED=N` replays a run; the seed is printed on failure.
#[test]
fn qemu_io_random_operations_match_a_model() {
    const SECTOR: u64 = 512;
    const VOLUME: u64 = 64 * MIB;
    let seed = std::env::var("FEWERBYTES_TEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    eprintln!("qemu_io_random_operations_match_a_model: FEWERBYTES_TEST_SEED={seed}");
    let rounds = if soak() { 10 } else { 3 };
    let ops_per_round = 150;

    let dir = TempDir::new("model");
    let mut server = Server::start_new(dir.path(), &[("vol", "64M")], &[]);
    let uri = server.unix_uri("vol");
    let mut rng = Rng::new(seed);
    // The byte every sector holds (all bytes of a sector are equal in this test).
    let mut model = vec![0u8; usize::try_from(VOLUME / SECTOR).expect("small")];

    for round in 0..rounds {
        let mut commands = Vec::new();
        for _ in 0..ops_per_round {
            // Lengths from one sector to 8 MiB, mostly small.
            let max_sectors = match rng.below(10) {
                0 => 8 * MIB / SECTOR,
                1..=3 => 256,
                _ => 16,
            };
            let len_sectors = 1 + rng.below(max_sectors);
            let start_sector = rng.below(VOLUME / SECTOR - len_sectors + 1);
            let (off, len) = (start_sector * SECTOR, len_sectors * SECTOR);
            let range = usize::try_from(start_sector).expect("small")
                ..usize::try_from(start_sector + len_sectors).expect("small");
            match rng.below(10) {
                0 => {
                    commands.push(format!("discard {off} {len}"));
                    model[range].fill(0);
                }
                1 => {
                    commands.push(format!("write -z -u {off} {len}"));
                    model[range].fill(0);
                }
                2 => {
                    commands.push(format!("write -z {off} {len}"));
                    model[range].fill(0);
                }
                3 => {
                    // A FUA write.
                    let byte = 1 + u8::try_from(rng.below(255)).expect("byte");
                    commands.push(format!("write -f -P {byte:#x} {off} {len}"));
                    model[range].fill(byte);
                }
                _ => {
                    // Few distinct patterns: plenty of duplicate blocks for dedup.
                    let byte = 1 + u8::try_from(rng.below(12)).expect("byte");
                    commands.push(format!("write -P {byte:#x} {off} {len}"));
                    model[range].fill(byte);
                }
            }
        }
        commands.push("flush".into());
        qemu_io(&uri, &commands);

        // Read the whole volume back, run by run of equal sectors.
        let mut reads = Vec::new();
        let mut start = 0usize;
        while start < model.len() {
            let mut end = start + 1;
            while end < model.len() && model[end] == model[start] && end - start < 16 * 1024 {
                end += 1;
            }
            reads.push(format!(
                "read -P {:#x} {} {}",
                model[start],
                start as u64 * SECTOR,
                (end - start) as u64 * SECTOR
            ));
            start = end;
        }
        let ran = run_with_limit(
            tool("qemu-io")
                .args(["-f", "raw"])
                .args(reads.iter().flat_map(|r| ["-c", r.as_str()]))
                .arg(&uri),
            CLIENT_LIMIT,
        );
        let out = ran.all_output();
        let failed_lines: Vec<&str> = out
            .lines()
            .filter(|l| l.contains("failed"))
            .take(20)
            .collect();
        assert!(
            failed_lines.is_empty(),
            "round {round}: volume differs from the model (replay with FEWERBYTES_TEST_SEED={seed}):\n{}",
            failed_lines.join("\n")
        );
        assert!(
            ran.status.success(),
            "round {round}: qemu-io failed reading back (FEWERBYTES_TEST_SEED={seed}):\n{}",
            ran.report()
        );
        // Every other round, a crash: flushed data must survive it.
        if round % 2 == 1 {
            server.kill9();
            server.spawn();
        }
    }
    server.stop();
    let ran = fewerbytes(&server.pool, &["check"]);
    assert!(
        ran.status.success(),
        "`fewerbytes check` after the random run (FEWERBYTES_TEST_SEED={seed}) failed:\n{}",
        ran.report()
    );
}

/// Bytes each fio job writes (its own region of the volume).
fn fio_job_bytes() -> u64 {
    if soak() {
        512 * MIB
    } else {
        64 * MIB
    }
}

/// fio jobs, each a connection of its own.
const FIO_JOBS: u64 = 4;

/// fio's data mix from the seed: 75% of blocks duplicates, the rest half compressible
/// in 512-byte chunks.
const SEED_MIX: [&str; 3] = [
    "--dedupe_percentage=75",
    "--buffer_compress_percentage=50",
    "--buffer_compress_chunk=512",
];

/// fio's nbd engine, 4 KiB random writes at queue depth 32, `FIO_JOBS` writers each on
/// its own region; run in `dir`, where fio leaves its verify state files.
fn fio_job(dir: &Path, uri: &str, name: &str, verify: bool, extra: &[&str]) -> Ran {
    let size = format!("{}M", fio_job_bytes() / MIB);
    let mut cmd = tool("fio");
    cmd.current_dir(dir)
        .arg(format!("--name={name}"))
        .arg("--ioengine=nbd")
        .arg(format!("--uri={uri}"))
        .args(["--rw=randwrite", "--bs=4k", "--iodepth=32", "--direct=1"])
        .arg(format!("--numjobs={FIO_JOBS}"))
        .arg(format!("--size={size}"))
        .arg(format!("--offset_increment={size}"))
        .args(["--group_reporting", "--output-format=normal"])
        .args(extra);
    if verify {
        cmd.args([
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_backlog=0",
        ]);
    }
    let ran = run_with_limit(
        &mut cmd,
        Duration::from_secs(if soak() { 1800 } else { 600 }),
    );
    assert!(ran.status.success(), "fio failed:\n{}", ran.report());
    assert!(
        !ran.all_output().contains("verify: bad"),
        "fio verify failed:\n{}",
        ran.report()
    );
    assert!(
        ran.all_output().contains("err= 0"),
        "fio reported errors:\n{}",
        ran.report()
    );
    ran
}

fn stored_bytes(server: &Server) -> u64 {
    let stats = server.stats();
    stats["stored_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("stats --json has no stored_bytes: {stats}"))
}

fn volume_size() -> String {
    format!("{}M", FIO_JOBS * fio_job_bytes() / MIB)
}

#[test]
fn fio_randwrite_verifies_over_seed_mix() {
    let dir = TempDir::new("fiomix");
    let size = volume_size();
    let server = Server::start_new(dir.path(), &[("plain", &size), ("vol", &size)], &[]);

    // Without verify headers (which make every block unique), the seed's mix is what
    // fewerbytes exists for: at most 15% of the guest's bytes stored as data.
    let before = stored_bytes(&server);
    fio_job(
        dir.path(),
        &server.unix_uri("plain"),
        "seedmix",
        false,
        &SEED_MIX,
    );
    let stored = stored_bytes(&server) - before;
    let written = FIO_JOBS * fio_job_bytes();
    assert!(
        stored * 100 <= written * 15,
        "fio's 75% duplicate / 50% compressible mix stored {stored} data bytes for {written} written \
         ({:.1}%, the target is at most 15%)",
        stored as f64 * 100.0 / written as f64
    );

    let mut args = SEED_MIX.to_vec();
    fio_job(dir.path(), &server.unix_uri("vol"), "seedmix", true, &args);
    // The same data read back on fresh connections (over TCP) after the writers left.
    args.push("--verify_only");
    fio_job(dir.path(), &server.tcp_uri("vol"), "seedmix", true, &args);
}

#[test]
fn fio_randwrite_verifies_over_random_data() {
    let dir = TempDir::new("fiorand");
    let size = volume_size();
    let server = Server::start_new(dir.path(), &[("plain", &size), ("vol", &size)], &[]);

    // Random data does not shrink, and must not grow much either.
    let before = stored_bytes(&server);
    fio_job(
        dir.path(),
        &server.tcp_uri("plain"),
        "random",
        false,
        &["--refill_buffers"],
    );
    let stored = stored_bytes(&server) - before;
    let written = FIO_JOBS * fio_job_bytes();
    assert!(
        stored * 100 <= written * 102,
        "random data stored {stored} data bytes for {written} written (over 102%)"
    );

    fio_job(
        dir.path(),
        &server.tcp_uri("vol"),
        "random",
        true,
        &["--refill_buffers"],
    );
    fio_job(
        dir.path(),
        &server.unix_uri("vol"),
        "random",
        true,
        &["--refill_buffers", "--verify_only"],
    );
}

#[test]
fn qemu_img_convert_round_trips_and_second_copy_dedups() {
    let dir = TempDir::new("conv");
    const BLOCKS: u64 = 16 * 1024; // 64 MiB
    let image = mixed_image(BLOCKS, 0xC0FFEE);
    let image_path = dir.join("mixed.img");
    std::fs::write(&image_path, &image).expect("write image");
    let image_bytes = BLOCKS * 4096;

    let server = Server::start_new(
        dir.path(),
        &[("first", "64M"), ("second", "64M"), ("third", "64M")],
        &[],
    );
    let image_arg = image_path.to_str().expect("utf-8 path");

    run_ok(tool("qemu-img").args([
        "convert",
        "-n",
        "-f",
        "raw",
        "-O",
        "raw",
        image_arg,
        &server.unix_uri("first"),
    ]));
    let out_path = dir.join("out.img");
    run_ok(tool("qemu-img").args([
        "convert",
        "-f",
        "raw",
        "-O",
        "raw",
        &server.unix_uri("first"),
        out_path.to_str().expect("utf-8"),
    ]));
    run_ok(tool("qemu-img").args([
        "compare",
        "-f",
        "raw",
        "-F",
        "raw",
        image_arg,
        out_path.to_str().expect("utf-8"),
    ]));
    // And straight from the export, without the intermediate file.
    run_ok(tool("qemu-img").args([
        "compare",
        "-f",
        "raw",
        "-F",
        "raw",
        image_arg,
        &server.tcp_uri("first"),
    ]));

    let before = server.stats();
    let used_before = before["stored_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("stats has no stored_bytes: {before}"));
    run_ok(tool("qemu-img").args([
        "convert",
        "-n",
        "-f",
        "raw",
        "-O",
        "raw",
        image_arg,
        &server.unix_uri("second"),
    ]));
    run_ok(tool("qemu-img").args([
        "compare",
        "-f",
        "raw",
        "-F",
        "raw",
        image_arg,
        &server.unix_uri("second"),
    ]));
    let after = server.stats();
    let used_after = after["stored_bytes"].as_u64().expect("stored_bytes");
    let growth = used_after.saturating_sub(used_before);
    assert!(
        growth * 100 < image_bytes,
        "the second copy of a {image_bytes}-byte image added {growth} data bytes (before {used_before}, after {used_after}); \
         expected under 1%.\nstats after: {after}"
    );
    // The first copy stored something (the image is not all zeros or duplicates).
    assert!(used_before > 0, "the first import stored no data: {before}");

    // nbdcopy (several connections at once when the server allows multi-conn) in and out.
    run_ok(tool("nbdcopy").args([image_arg, &server.unix_uri("third")]));
    let copied_path = dir.join("copied.img");
    run_ok(tool("nbdcopy").args([
        &server.tcp_uri("third"),
        copied_path.to_str().expect("utf-8"),
    ]));
    let copied = std::fs::read(&copied_path).expect("read nbdcopy output");
    assert!(
        copied == image,
        "nbdcopy round trip through volume `third` changed the image"
    );
}

#[test]
fn block_status_shows_holes_after_trim_and_write_zeroes() {
    let dir = TempDir::new("map");
    let server = Server::start_new(dir.path(), &[("vol", "16M")], &[]);
    let uri = server.unix_uri("vol");

    qemu_io(&uri, &["write -P 0x5c 0 12M".into()]);
    let extents = map_extents(&uri);
    assert_map(&extents, 0, 12 * MIB, "written data", |t| t == 0);
    assert_map(&extents, 12 * MIB, 4 * MIB, "never written", |t| t & 1 == 1);

    qemu_io(
        &uri,
        &[
            "discard 1M 2M".into(),     // NBD_CMD_TRIM
            "write -z -u 4M 2M".into(), // WRITE_ZEROES, hole allowed
            "write -z 7M 1M".into(),    // WRITE_ZEROES with NO_HOLE
            "discard 9M 4096".into(),   // one block
        ],
    );
    let extents = map_extents(&uri);
    assert_map(&extents, 0, MIB, "untouched data", |t| t == 0);
    assert_map(&extents, MIB, 2 * MIB, "trimmed range", |t| t == 3);
    assert_map(&extents, 3 * MIB, MIB, "untouched data", |t| t == 0);
    assert_map(
        &extents,
        4 * MIB,
        2 * MIB,
        "write-zeroes (may unmap) range",
        |t| t == 3,
    );
    assert_map(&extents, 6 * MIB, MIB, "untouched data", |t| t == 0);
    assert_map(
        &extents,
        7 * MIB,
        MIB,
        "write-zeroes (no hole) range",
        |t| t & 2 == 2,
    );
    assert_map(&extents, 9 * MIB, 4096, "trimmed block", |t| t == 3);
    assert_map(
        &extents,
        9 * MIB + 4096,
        3 * MIB - 4096,
        "untouched data",
        |t| t == 0,
    );

    qemu_io(
        &uri,
        &[
            "read -P 0x5c 0 1M".into(),
            "read -P 0 1M 2M".into(),
            "read -P 0 4M 2M".into(),
            "read -P 0 7M 1M".into(),
            "read -P 0 9M 4096".into(),
            "read -P 0x5c 8M 1M".into(),
        ],
    );
    // qemu-img map (REQ_ONE on every block-status request) agrees.
    let ran = run_ok(tool("qemu-img").args(["map", "--output=json", "-f", "raw", &uri]));
    let map = json(&ran);
    let trimmed = map
        .as_array()
        .expect("qemu-img map list")
        .iter()
        .find(|e| e["start"].as_u64() == Some(MIB))
        .unwrap_or_else(|| {
            panic!(
                "qemu-img map has no extent starting at 1 MiB:\n{}",
                ran.report()
            )
        });
    assert_eq!(trimmed["zero"], true, "{trimmed}");
    assert_eq!(trimmed["data"], false, "{trimmed}");
}

#[test]
fn ext4_over_nbdfuse_and_loop_survives_fstrim_fsck_and_remount() {
    let dir = TempDir::new("ext4");
    let server = Server::start_new(dir.path(), &[("fsvol", "512M")], &[]);
    for t in [
        "nbdfuse",
        "losetup",
        "mkfs.ext4",
        "fsck.ext4",
        "fstrim",
        "mount",
        "umount",
    ] {
        require_tool(t);
    }
    assert!(
        Path::new("/dev/fuse").exists(),
        "/dev/fuse is missing: nbdfuse needs FUSE"
    );

    let mut stack = FuseLoopStack::start(dir.path(), "fsvol", &server.unix_uri("fsvol"), false);
    assert_eq!(
        stack.exposed_bytes(),
        512 * MIB,
        "nbdfuse exposes the volume's size"
    );
    let dev = stack.dev();
    let mount_dir = stack.mount_dir.clone();

    run_ok(tool("mkfs.ext4").args(["-q", "-F", "-L", "fewerbytes", &dev]));
    run_ok(tool("mount").arg(&dev).arg(&mount_dir));
    stack.mounted = true;
    let files = generated_tree(&mount_dir);
    // Files deleted before fstrim: their blocks are what trim gives back.
    let scratch = mount_dir.join("scratch");
    std::fs::create_dir_all(&scratch).expect("mkdir scratch");
    let mut rng = Rng::new(42);
    for i in 0..20 {
        let mut v = vec![0u8; 1024 * 1024];
        rng.fill(&mut v);
        std::fs::write(scratch.join(format!("junk{i}")), &v).expect("write junk");
    }
    run_ok(tool("sync").arg("-f").arg(&mount_dir));
    std::fs::remove_dir_all(&scratch).expect("rm scratch");
    assert_tree(&mount_dir, &files, "before fstrim");
    let ran = run_ok(tool("fstrim").arg("-v").arg(&mount_dir));
    assert!(
        ran.stdout.contains("trimmed"),
        "fstrim said nothing trimmed:\n{}",
        ran.report()
    );
    stack.umount_fs();

    let ran = run_with_limit(tool("fsck.ext4").args(["-n", "-f", &dev]), CLIENT_LIMIT);
    assert!(
        ran.status.success(),
        "fsck.ext4 -n found problems after fstrim and umount:\n{}",
        ran.report()
    );

    run_ok(tool("mount").arg(&dev).arg(&mount_dir));
    stack.mounted = true;
    assert_tree(&mount_dir, &files, "after remount");
    drop(stack);
    assert!(
        !mount_dir.join("d0").exists(),
        "file system still mounted after cleanup"
    );
}

#[test]
fn nbd_client_completes_kernel_style_handshake() {
    let dir = TempDir::new("nbdc");
    let server = Server::start_new(dir.path(), &[("kvol", "64M")], &[]);
    require_tool("nbd-client");
    // No /dev/nbd0 here (no kernel NBD driver): nbd-client negotiates first, then fails
    // to hand the socket to the kernel. What matters is that negotiation succeeded.
    let ran = run_with_limit(
        tool("nbd-client").args([
            "-N",
            "kvol",
            "127.0.0.1",
            &server.port.to_string(),
            "/dev/nbd0",
        ]),
        Duration::from_secs(60),
    );
    let out = ran.all_output();
    assert!(
        out.contains("Negotiation: ..size = 64MB"),
        "nbd-client did not complete negotiation:\n{}",
        ran.report()
    );
    for bad in [
        "Server said",
        "not supported",
        "Received invalid",
        "closed connection",
        "Unknown error",
    ] {
        assert!(
            !out.contains(bad),
            "nbd-client reported a negotiation problem ({bad}):\n{}",
            ran.report()
        );
    }
    // An unknown name is refused during negotiation, with the server's error.
    let ran = run_with_limit(
        tool("nbd-client").args([
            "-N",
            "nope",
            "127.0.0.1",
            &server.port.to_string(),
            "/dev/nbd0",
        ]),
        Duration::from_secs(60),
    );
    assert!(
        !ran.all_output().contains("size ="),
        "nbd-client negotiated an unknown export:\n{}",
        ran.report()
    );
    // Where a kernel NBD driver does exist, nbd-client has attached the device: detach it.
    if Path::new("/dev/nbd0").exists() {
        let _ = run_with_limit(
            tool("nbd-client").args(["-d", "/dev/nbd0"]),
            Duration::from_secs(60),
        );
    }
    // The server saw the negotiation through to transmission on `kvol`.
    let log = server.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("NBD transmission") && l.contains("kvol")),
        "the server log shows no connection to kvol reaching transmission:\n{log}"
    );
    // The server survived both and still serves.
    nbdinfo_json(&server.tcp_uri("kvol"));
}

#[test]
fn nbdsh_bad_requests_get_errors_and_connection_survives() {
    let dir = TempDir::new("bad");
    // Without polling between requests (every other test serves with the default).
    let server = Server::start_new(dir.path(), &[("vol", "64M")], &["--poll-us", "0"]);
    let ran = python_nbd(BAD_REQUESTS_PY, &[&server.unix_uri("vol")]);
    assert!(
        ran.stdout.contains("all refused as expected"),
        "{}",
        ran.report()
    );
    // A good client afterwards.
    qemu_io(
        &server.tcp_uri("vol"),
        &[
            "read -P 0xa5 0 4096".into(),
            "write -P 0x12 8192 4096".into(),
            "read -P 0x12 8192 4096".into(),
        ],
    );
}

#[test]
fn read_only_serve_refuses_writes_with_eperm() {
    let dir = TempDir::new("ro");
    let mut server = Server::start_new(dir.path(), &[("vol", "16M")], &[]);
    qemu_io(
        &server.unix_uri("vol"),
        &["write -P 0x3c 0 1M".into(), "flush".into()],
    );
    let status = server.stop();
    assert!(
        status.success(),
        "server exited with {status} after SIGTERM"
    );
    drop(server);
    let pool = dir.join("test.pool");
    let server = Server::start(dir.path(), &pool, &["--read-only"]);
    let info = nbdinfo_json(&server.unix_uri("vol"));
    assert_eq!(first_export(&info)["is_read_only"], true, "{info}");
    let ran = python_nbd(READ_ONLY_PY, &[&server.unix_uri("vol")]);
    assert!(ran.stdout.contains("read-only ok"), "{}", ran.report());
}

#[test]
fn flushed_data_survives_sigterm_and_sigkill() {
    let dir = TempDir::new("persist");
    let mut server = Server::start_new(dir.path(), &[("vol", "64M")], &[]);
    let uri = server.unix_uri("vol");

    qemu_io(
        &uri,
        &[
            "write -P 0x61 0 4M".into(),
            "write -P 0x62 10M 1536".into(),
            "write -z 1M 512K".into(),
            "flush".into(),
        ],
    );
    let status = server.stop();
    assert!(
        status.success(),
        "server exited with {status} after SIGTERM\n{}",
        server.log_text()
    );
    server.spawn();
    // Ctrl-C (SIGINT) is a clean stop too.
    qemu_io(&uri, &["write -P 0x66 12M 64K".into()]);
    let status = server.stop_with(libc::SIGINT);
    assert!(
        status.success(),
        "server exited with {status} after SIGINT\n{}",
        server.log_text()
    );
    server.spawn();
    qemu_io(&uri, &["read -P 0x66 12M 64K".into()]);
    qemu_io(
        &uri,
        &[
            "read -P 0x61 0 1M".into(),
            "read -P 0 1M 512K".into(),
            "read -P 0x61 1536K 2560K".into(),
            "read -P 0x62 10M 1536".into(),
        ],
    );

    // Flushed writes survive a SIGKILL; so does an acknowledged FUA write.
    qemu_io(
        &uri,
        &[
            "write -P 0x63 20M 8M".into(),
            "write -P 0x64 5M 4096".into(),
            "flush".into(),
            "write -f -P 0x65 40M 64K".into(),
        ],
    );
    server.kill9();
    server.spawn();
    qemu_io(
        &uri,
        &[
            "read -P 0x63 20M 8M".into(),
            "read -P 0x64 5M 4096".into(),
            "read -P 0x65 40M 64K".into(),
            "read -P 0x61 0 1M".into(),
            "read -P 0x62 10M 1536".into(),
        ],
    );
    // The recovered pool is consistent.
    let status = server.stop();
    assert!(
        status.success(),
        "server exited with {status} after SIGTERM"
    );
    let ran = fewerbytes(&server.pool, &["check"]);
    assert!(
        ran.status.success(),
        "`fewerbytes check` after a SIGKILL and recovery failed:\n{}",
        ran.report()
    );
}

/// libnbd (structured replies, strict mode off) writes, zeroes and trims at odd byte
/// offsets and lengths; the bytes read back the same after a clean stop and after
/// a SIGKILL that follows a flush.
#[test]
fn libnbd_bytes_at_any_offset_survive_sigterm_and_sigkill() {
    let dir = TempDir::new("bytes");
    let mut server = Server::start_new(dir.path(), &[("vol", "64M")], &[]);
    let uri = server.unix_uri("vol");
    let bytes_ok = |mode: &str, seeds: &str| {
        let ran = python_nbd(BYTES_PY, &[&uri, mode, seeds]);
        assert!(ran.stdout.contains("bytes ok"), "{}", ran.report());
    };
    bytes_ok("write", "1");
    let status = server.stop();
    assert!(
        status.success(),
        "server exited with {status} after SIGTERM\n{}",
        server.log_text()
    );
    server.spawn();
    bytes_ok("verify", "1");
    // The script flushes after its writes; then the server is killed.
    bytes_ok("write", "1,2");
    server.kill9();
    server.spawn();
    bytes_ok("verify", "1,2");
    let status = server.stop();
    assert!(
        status.success(),
        "server exited with {status} after SIGTERM"
    );
    let ran = fewerbytes(&server.pool, &["check"]);
    assert!(
        ran.status.success(),
        "`fewerbytes check` after byte-granular writes and a SIGKILL failed:\n{}",
        ran.report()
    );
}

#[test]
fn flush_on_one_connection_makes_every_connections_writes_durable() {
    let dir = TempDir::new("mconn");
    let mut server = Server::start_new(dir.path(), &[("vol", "16M")], &[]);
    let uri = server.unix_uri("vol");
    let clients = HeldConnection::run(MULTI_CONN_PY, &uri);
    // Crash with the clients still connected.
    server.kill9();
    drop(clients);
    server.spawn();
    qemu_io(
        &uri,
        &[
            "read -P 0x71 0 64K".into(),
            "read -P 0x72 1M 4096".into(),
            "read -P 0x73 3M 4096".into(),
        ],
    );
}

#[test]
fn volumes_created_cloned_deleted_while_serving_with_clients_connected() {
    let dir = TempDir::new("live");
    let mut server = Server::start_new(dir.path(), &[("base", "64M")], &[]);
    qemu_io(&server.unix_uri("base"), &["write -P 0x42 0 2M".into()]);
    let held = HeldConnection::open(&server.unix_uri("base"));

    server.cli_ok(&["volume", "create", "fresh", "--size", "32M"]);
    assert!(
        listed_exports(&server.unix_uri("")).contains_key("fresh"),
        "new volume not exported without a restart"
    );
    qemu_io(
        &server.tcp_uri("fresh"),
        &[
            "write -P 0x43 4096 1M".into(),
            "read -P 0x43 4096 1M".into(),
            "read -P 0 0 4096".into(),
        ],
    );

    server.cli_ok(&["volume", "clone", "base", "copy"]);
    qemu_io(
        &server.unix_uri("copy"),
        &["read -P 0x42 0 2M".into(), "write -P 0x44 0 4096".into()],
    );
    // Writing to the clone leaves its source alone.
    qemu_io(&server.unix_uri("base"), &["read -P 0x42 0 2M".into()]);

    let listed = server.cli_ok(&["volume", "list"]);
    for name in ["base", "fresh", "copy"] {
        assert!(
            listed.stdout.contains(name),
            "`volume list` lacks {name}:\n{}",
            listed.report()
        );
    }

    // A volume with a connected client is not deleted without --force.
    let refused = server.cli(&["volume", "delete", "base"]);
    assert!(
        !refused.status.success(),
        "deleted a volume with a connected client without --force:\n{}",
        refused.report()
    );
    assert!(
        listed_exports(&server.unix_uri("")).contains_key("base"),
        "refused delete removed the volume anyway"
    );
    qemu_io(&server.unix_uri("base"), &["read -P 0x42 0 2M".into()]);

    // Without clients, delete works and the export disappears.
    server.cli_ok(&["volume", "delete", "copy"]);
    let exports = listed_exports(&server.unix_uri(""));
    assert!(
        !exports.contains_key("copy"),
        "deleted volume still exported: {exports:?}"
    );
    let ran = run_with_limit(tool("nbdinfo").arg(server.unix_uri("copy")), CLIENT_LIMIT);
    assert!(
        !ran.status.success(),
        "connected to a deleted volume:\n{}",
        ran.report()
    );

    // --force deletes it with the client still connected; the server carries on.
    server.cli_ok(&["volume", "delete", "base", "--force"]);
    drop(held);
    assert!(
        !listed_exports(&server.unix_uri("")).contains_key("base"),
        "force-deleted volume still exported"
    );
    qemu_io(&server.unix_uri("fresh"), &["read -P 0x43 4096 1M".into()]);

    // Grow a volume while served: new connections see the new size, old data stays.
    server.cli_ok(&["volume", "resize", "fresh", "--size", "48M"]);
    let info = nbdinfo_json(&server.unix_uri("fresh"));
    assert_eq!(
        first_export(&info)["export-size"].as_u64(),
        Some(48 * MIB),
        "resize while serving: {info}"
    );
    qemu_io(
        &server.unix_uri("fresh"),
        &[
            "read -P 0x43 4096 1M".into(),
            "write -P 0x45 40M 1M".into(),
            "read -P 0x45 40M 1M".into(),
        ],
    );

    // What the control socket did is durable once the command returns: after a crash
    // the created and resized volume is still there, with its flushed data.
    server.cli_ok(&["volume", "clone", "fresh", "later"]);
    server.kill9();
    server.spawn();
    let exports = listed_exports(&server.unix_uri(""));
    for made in ["fresh", "later"] {
        assert!(
            exports.contains_key(made),
            "volume {made}, made while serving, is gone after a crash: {exports:?}"
        );
    }
    for deleted in ["base", "copy"] {
        assert!(
            !exports.contains_key(deleted),
            "volume {deleted}, deleted while serving, came back after a crash: {exports:?}"
        );
    }
    assert_eq!(
        exports["fresh"]["export-size"].as_u64(),
        Some(48 * MIB),
        "resize lost in the crash: {exports:?}"
    );
    for vol in ["fresh", "later"] {
        qemu_io(
            &server.unix_uri(vol),
            &["read -P 0x43 4096 1M".into(), "read -P 0x45 40M 1M".into()],
        );
    }
}

#[test]
fn default_serve_creates_pool_and_serves_disk0() {
    let dir = TempDir::new("dflt");
    let port = free_port();
    let log_path = dir.join("serve.log");
    let log = std::fs::File::create(&log_path).expect("log");
    let mut child = Command::new(fewerbytes_bin())
        .current_dir(dir.path())
        .env_remove("FEWERBYTES_POOL")
        .arg("serve")
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("start fewerbytes serve");
    struct Reap<'a>(&'a mut Child);
    impl Drop for Reap<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let socket = dir.join("fewerbytes.pool.sock");
    let mut waited = 0;
    while !(socket.exists()
        && std::net::TcpStream::connect(("127.0.0.1", port))
            .is_ok_and(|s| greet_and_abort(s).is_ok()))
    {
        waited += 1;
        if let Some(status) = child.try_wait().expect("poll") {
            panic!(
                "default serve exited with {status}:\n{}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
        }
        assert!(
            waited < 1200,
            "default serve did not listen within 60 s:\n{}",
            std::fs::read_to_string(&log_path).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let reap = Reap(&mut child);
    assert!(
        dir.join("fewerbytes.pool").exists(),
        "no ./fewerbytes.pool created"
    );

    // disk0 takes all the 16 GiB pool can address (less its metadata).
    let info = nbdinfo_json(&format!("nbd://127.0.0.1:{port}/disk0"));
    let size = first_export(&info)["export-size"].as_u64().unwrap_or(0);
    assert!(size > 14 * 1024 * MIB, "disk0 is only {size} bytes: {info}");
    assert!(
        size <= 16 * 1024 * MIB,
        "disk0 is {size} bytes, more than the 16 GiB pool: {info}"
    );
    let default = nbdinfo_json(&format!("nbd+unix:///?socket={}", socket.display()));
    assert_eq!(
        first_export(&default)["export-size"].as_u64(),
        Some(size),
        "the empty export name is not disk0: {default}"
    );
    qemu_io(
        &format!("nbd://127.0.0.1:{port}/disk0"),
        &["write -P 0x77 1G 1M".into(), "read -P 0x77 1G 1M".into()],
    );

    let printed = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        printed.contains("nbd://") || printed.contains("nbd+unix://"),
        "serve printed no NBD URI for the user:\n{printed}"
    );

    // SIGTERM: flush and exit 0.
    let pid = libc::pid_t::try_from(reap.0.id()).expect("pid");
    // SAFETY: kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let mut status = None;
    for _ in 0..1200 {
        if let Some(s) = reap.0.try_wait().expect("poll") {
            status = Some(s);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let status =
        status.unwrap_or_else(|| panic!("default serve did not exit within 60 s of SIGTERM"));
    assert!(
        status.success(),
        "default serve exited with {status} after SIGTERM:\n{}",
        std::fs::read_to_string(&log_path).unwrap_or_default()
    );
    drop(reap);

    // Serving again reuses the pool and its data.
    let pool = dir.join("fewerbytes.pool");
    let server = Server::start(dir.path(), &pool, &[]);
    qemu_io(&server.unix_uri("disk0"), &["read -P 0x77 1G 1M".into()]);
}

// Regression test: `volume list` counted every NBD connection as a user, so
// one nbdcopy with four connections (multi-conn) showed 4 users where there is 1 client.
#[test]
fn users_count_clients_not_their_connections() {
    require_tool("nbdkit");
    let dir = TempDir::new("users");
    let server = Server::start_new(dir.path(), &[("vol", "64M")], &[]);
    let users = || {
        let volumes = json(&server.cli_ok(&["volume", "list", "--json"]));
        let vol = volumes
            .as_array()
            .and_then(|all| all.iter().find(|v| v["name"] == "vol"))
            .cloned()
            .expect("volume `vol` listed");
        vol["users"].as_u64().expect("users is a number")
    };
    assert_eq!(users(), 0);
    // The source answers each read after 30 s, so nbdcopy holds its four connections
    // to `vol` while the test looks (`--no-extents`: it must read, not skip holes). It
    // listens on its own socket: nbdcopy opens one connection to a `[ CMD ]` source,
    // and uses multi-conn only when both ends offer it.
    let source_socket = dir.join("slow-source.sock");
    let mut source = tool("nbdkit")
        .args(["-f", "--exit-with-parent", "-U"])
        .arg(&source_socket)
        .args(["--filter=delay", "memory", "64M", "rdelay=30"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("start nbdkit");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !source_socket.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "nbdkit did not listen within 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let source_uri = format!("nbd+unix:///?socket={}", source_socket.display());
    let mut copy = tool("nbdcopy")
        // nbdcopy opens at most one connection per thread (by default, one per CPU).
        .args(["--connections", "4", "--threads", "4", "--no-extents", "--"])
        .args([source_uri.as_str(), server.unix_uri("vol").as_str()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("start nbdcopy");
    let attached = |log: &str| {
        log.lines()
            .filter(|l| l.contains("NBD client attached") && l.contains("export=vol"))
            .count()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while attached(&server.log_text()) < 4 {
        assert!(
            std::time::Instant::now() < deadline,
            "nbdcopy did not open 4 connections to `vol` within 60 s:\n{}",
            server.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let with_copy = users();
    // A second client, with one connection: two clients.
    let held = HeldConnection::open(&server.unix_uri("vol"));
    let with_both = users();
    drop(held);
    for child in [&mut copy, &mut source] {
        let _ = child.kill();
        let _ = child.wait();
    }
    assert_eq!(with_copy, 1, "one nbdcopy with 4 connections is one user");
    assert_eq!(with_both, 2, "nbdcopy and a second client are two users");
}
