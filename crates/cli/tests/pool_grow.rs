//! `pool grow`: a pool file extended with `truncate -s` takes the new space while
//! served, under fio writing to a volume (fio verifies what it wrote), and offline;
//! the pool checks clean, stats show the larger size, and a volume the old size
//! could not hold is written and verified in the new space. The same on a loop
//! device whose file grew and which `losetup -c` resized.

mod common;

use common::data::Rng;
use common::loop_device::LoopDevice;
use common::*;
use std::process::Stdio;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

/// fio's nbd engine writing `size` of 4 KiB random blocks (verify headers make each
/// one unique) and verifying them; `rate_iops` paces it (0: as fast as it goes).
fn fio(
    dir: &std::path::Path,
    uri: &str,
    name: &str,
    size: &str,
    rate_iops: u32,
) -> std::process::Command {
    let mut cmd = tool("fio");
    cmd.current_dir(dir)
        .arg(format!("--name={name}"))
        .arg("--ioengine=nbd")
        .arg(format!("--uri={uri}"))
        .args(["--rw=randwrite", "--bs=4k", "--iodepth=8", "--direct=1"])
        .arg(format!("--size={size}"))
        .args([
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_backlog=0",
        ]);
    if rate_iops > 0 {
        cmd.arg(format!("--rate_iops={rate_iops}"));
    }
    cmd
}

fn assert_fio_ok(ran: &Ran) {
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
}

fn data_bytes(stats: &serde_json::Value) -> u64 {
    stats["data_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("stats --json has no data_bytes: {stats}"))
}

fn written(stats: &serde_json::Value) -> u64 {
    stats["counters"]["guest_bytes_written"]
        .as_u64()
        .unwrap_or(0)
}

#[test]
fn pool_grow_takes_a_grown_file_while_fio_writes_and_offline() {
    let dir = TempDir::new("grow");
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(
        &pool,
        &[
            "pool",
            "create",
            pool_str,
            "--size",
            "64M",
            "--max-size",
            "512M",
        ],
    );
    fewerbytes_ok(&pool, &["volume", "create", "busy", "--size", "32M"]);
    let mut server = Server::start(dir.path(), &pool, &[]);
    let before = server.stats();
    // A volume the pool cannot hold yet.
    assert!(!server
        .cli(&["volume", "create", "big", "--size", "160M"])
        .status
        .success());

    // fio writes and verifies 24 MiB, paced so that it runs for several seconds;
    // once it has written something, the file grows and `pool grow` runs.
    let fio_log = dir.join("fio-busy.log");
    let log = std::fs::File::create(&fio_log).expect("fio log");
    let mut child = fio(dir.path(), &server.unix_uri("busy"), "busy", "24M", 1500)
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("start fio");
    let deadline = Instant::now() + Duration::from_secs(300);
    while written(&server.stats()) <= written(&before) {
        assert!(Instant::now() < deadline, "fio wrote nothing");
        assert!(
            child.try_wait().expect("poll fio").is_none(),
            "fio ended before writing"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    run_ok(tool("truncate").args(["-s", "256M", pool_str]));
    let grown = server.cli_ok(&["pool", "grow"]);
    assert!(grown.stdout.contains("grown"), "{}", grown.report());
    let overlapped = child.try_wait().expect("poll fio").is_none();
    let status = child.wait().expect("wait fio");
    let out = std::fs::read_to_string(&fio_log).unwrap_or_default();
    eprintln!("fio was still writing when the grow returned: {overlapped}");
    assert!(status.success(), "fio failed:\n{out}");
    assert!(
        !out.contains("verify: bad") && out.contains("err= 0"),
        "fio:\n{out}"
    );

    // Stats show the larger pool, and a volume only the new space holds is written
    // and verified.
    let after = server.stats();
    assert!(
        data_bytes(&after) > data_bytes(&before) + 150 * MIB,
        "data region {} before, {} after",
        data_bytes(&before),
        data_bytes(&after)
    );
    server.cli_ok(&["volume", "create", "big", "--size", "160M"]);
    let ran = run_with_limit(
        fio(dir.path(), &server.unix_uri("big"), "big", "120M", 0).stdin(Stdio::null()),
        Duration::from_secs(600),
    );
    assert_fio_ok(&ran);
    assert!(server.stop().success(), "{}", server.log_text());
    drop(server);
    assert_check_clean(&pool);

    // Offline: the file grows again, and `pool grow` opens the pool itself.
    run_ok(tool("truncate").args(["-s", "512M", pool_str]));
    let grown = fewerbytes_ok(&pool, &["pool", "grow", "--json"]);
    let report: serde_json::Value = serde_json::from_str(&grown.stdout).expect("JSON");
    assert_eq!(report["old_data_bytes"], data_bytes(&after), "{report}");
    assert!(report["data_bytes"].as_u64().unwrap_or(0) > data_bytes(&after) + 200 * MIB);
    assert_eq!(report["untaken_bytes"], 0, "{report}");
    let stats: serde_json::Value =
        serde_json::from_str(&fewerbytes_ok(&pool, &["stats", "--json"]).stdout).expect("JSON");
    assert_eq!(stats["data_bytes"], report["data_bytes"]);
    assert_check_clean(&pool);
}

#[test]
fn pool_grow_takes_a_loop_device_resized_with_losetup_c_while_served() {
    let dir = TempDir::new("growloop");
    let backing = dir.join("backing.img");
    run_ok(tool("truncate").args(["-s", "64M"]).arg(&backing));
    let Some(device) = LoopDevice::attach_or_skip(&backing) else {
        return;
    };
    let dev = device.path.clone();
    let dev_str = device.path_str();
    fewerbytes_ok(&dev, &["pool", "create", dev_str]);
    fewerbytes_ok(&dev, &["volume", "create", "vm", "--size", "16M"]);
    fewerbytes_ok(&dev, &["volume", "create", "busy", "--size", "16M"]);
    let mut server = Server::start(dir.path(), &dev, &[]);
    let before = server.stats();

    // Data written before the grow: random bytes the old region stores.
    let early = dir.join("early.bin");
    let mut bytes = vec![0u8; (8 * MIB) as usize];
    Rng::new(41).fill(&mut bytes);
    std::fs::write(&early, &bytes).expect("write early.bin");
    qemu_io(
        &server.unix_uri("vm"),
        &[format!("write -s {} 0 8M", early.display()), "flush".into()],
    );
    // A volume only the grown device can hold.
    assert!(!server
        .cli(&["volume", "create", "big", "--size", "96M"])
        .status
        .success());

    // fio writes (and verifies) through the grow; the file grows, the loop device
    // learns its new size, and `pool grow` takes it.
    let fio_log = dir.join("fio-busy.log");
    let log = std::fs::File::create(&fio_log).expect("fio log");
    let mut child = fio(dir.path(), &server.unix_uri("busy"), "busy", "12M", 1500)
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("start fio");
    let deadline = Instant::now() + Duration::from_secs(300);
    while written(&server.stats()) <= written(&before) + 8 * MIB {
        assert!(Instant::now() < deadline, "fio wrote nothing");
        assert!(
            child.try_wait().expect("poll fio").is_none(),
            "fio ended before writing"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    run_ok(tool("truncate").args(["-s", "256M"]).arg(&backing));
    run_ok(tool("losetup").args(["-c", dev_str]));
    assert_eq!(
        device.size_bytes(),
        256 * MIB,
        "losetup -c resized the device"
    );
    let grown = server.cli_ok(&["pool", "grow"]);
    assert!(grown.stdout.contains("grown"), "{}", grown.report());
    let overlapped = child.try_wait().expect("poll fio").is_none();
    let status = child.wait().expect("wait fio");
    let out = std::fs::read_to_string(&fio_log).unwrap_or_default();
    eprintln!("fio was still writing when the grow returned: {overlapped}");
    assert!(status.success(), "fio failed:\n{out}");
    assert!(
        !out.contains("verify: bad") && out.contains("err= 0"),
        "fio:\n{out}"
    );

    // Stats show the larger pool; the new space takes a volume the old could not
    // hold, and 80 MiB of random bytes more than the old region had free.
    let after = server.stats();
    assert!(
        data_bytes(&after) > data_bytes(&before) + 150 * MIB,
        "data region {} before, {} after",
        data_bytes(&before),
        data_bytes(&after)
    );
    server.cli_ok(&["volume", "create", "big", "--size", "96M"]);
    let late = dir.join("late.bin");
    let mut bytes = vec![0u8; (80 * MIB) as usize];
    Rng::new(43).fill(&mut bytes);
    std::fs::write(&late, &bytes).expect("write late.bin");
    qemu_io(
        &server.unix_uri("big"),
        &[format!("write -s {} 0 80M", late.display()), "flush".into()],
    );
    assert!(server.stop().success(), "{}", server.log_text());
    drop(server);
    assert_check_clean(&dev);

    // What was written before and after the grow reads back, from the pool reopened.
    for (volume, file, len) in [("vm", &early, 8 * MIB), ("big", &late, 80 * MIB)] {
        let out = dir.join(&format!("{volume}.out"));
        fewerbytes_ok(
            &dev,
            &["volume", "export", volume, out.to_str().expect("utf-8")],
        );
        let exported = std::fs::read(&out).expect("read the export");
        let want = std::fs::read(file).expect("read what was written");
        assert!(
            exported.get(..len as usize) == Some(&want[..]),
            "volume {volume} does not read back what was written"
        );
        let _ = std::fs::remove_file(&out);
    }
    let stats: serde_json::Value =
        serde_json::from_str(&fewerbytes_ok(&dev, &["stats", "--json"]).stdout).expect("JSON");
    assert_eq!(
        stats["data_bytes"], after["data_bytes"],
        "the grown size stays"
    );
}
