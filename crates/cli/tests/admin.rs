//! The admin tools with the real binary: `volume rename`, `volume rollback`, `volume
//! info`, `--require-server` (what the Proxmox plugin stands on), `volume import`'s
//! format detection, `--force` and sparse reads, `volume export`'s `--force`, script
//! output, JSON log lines, and `serve`'s socket clean-up and warnings.

mod common;

use common::{create_pool, fewerbytes, fewerbytes_ok, qemu_io, Server, TempDir};

fn json(ran: &common::Ran) -> serde_json::Value {
    serde_json::from_str(&ran.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", ran.report()))
}

#[test]
fn rename_keeps_the_data_under_the_new_export_name() {
    let dir = TempDir::new("rename");
    let mut server = Server::start_new(dir.path(), &[("vm-100-disk-0", "16M")], &[]);
    let uri = |name: &str| format!("nbd+unix:///{name}?socket={}", server.socket.display());
    qemu_io(&uri("vm-100-disk-0"), &["write -P 0x5a 0 4M".into()]);
    let stored_before = json(&fewerbytes_ok(&server.pool, &["stats", "--json"]))["stored_bytes"]
        .as_u64()
        .expect("stored_bytes");

    let ran = fewerbytes_ok(
        &server.pool,
        &["volume", "rename", "vm-100-disk-0", "base-100-disk-0"],
    );
    assert_eq!(
        ran.stdout.trim(),
        "Volume 'vm-100-disk-0' renamed to 'base-100-disk-0'."
    );
    let list = json(&fewerbytes_ok(&server.pool, &["volume", "list", "--json"]));
    let names: Vec<&str> = list
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(names, ["base-100-disk-0"], "only the new name is left");
    qemu_io(&uri("base-100-disk-0"), &["read -P 0x5a 0 4M".into()]);
    let stored_after = json(&fewerbytes_ok(&server.pool, &["stats", "--json"]))["stored_bytes"]
        .as_u64()
        .expect("stored_bytes");
    assert_eq!(stored_after, stored_before, "a rename stores nothing more");

    // Refused while a client has the volume open; nothing changes.
    let mut holder = std::process::Command::new(common::require_tool("qemu-io"))
        .args(["-f", "raw", "-c", "sleep 3000", &uri("base-100-disk-0")])
        .spawn()
        .expect("start qemu-io");
    std::thread::sleep(std::time::Duration::from_millis(800));
    let refused = fewerbytes(
        &server.pool,
        &["volume", "rename", "base-100-disk-0", "vm-100-disk-1"],
    );
    holder.wait().expect("qemu-io exits");
    assert!(!refused.status.success(), "{}", refused.report());
    assert!(
        refused.stderr.contains("base-100-disk-0"),
        "the refusal names the volume:\n{}",
        refused.report()
    );
    let list = json(&fewerbytes_ok(&server.pool, &["volume", "list", "--json"]));
    assert_eq!(
        list.as_array().map(Vec::len),
        Some(1),
        "no clone left behind"
    );

    // The server's log says what was asked and how it ended, in words; queries such as
    // `volume list` stay at DEBUG, below the INFO the server logs at here.
    let log = server.log_text();
    assert!(
        log.contains("control: rename volume 'vm-100-disk-0' to 'base-100-disk-0': done"),
        "{log}"
    );
    assert!(
        log.contains("control: rename volume 'base-100-disk-0' to 'vm-100-disk-1': refused:"),
        "{log}"
    );
    assert!(!log.contains("control: volume list"), "{log}");

    // A name that is taken, or invalid, is refused by the pool.
    fewerbytes_ok(&server.pool, &["volume", "create", "other", "--size", "4M"]);
    let taken = fewerbytes(
        &server.pool,
        &["volume", "rename", "other", "base-100-disk-0"],
    );
    assert!(!taken.status.success(), "{}", taken.report());
    server.stop();

    // The same on a pool that is not served.
    fewerbytes_ok(&server.pool, &["volume", "rename", "other", "renamed"]);
    let info = json(&fewerbytes_ok(
        &server.pool,
        &["volume", "info", "renamed", "--json"],
    ));
    assert_eq!(info["size_bytes"], 4 << 20);
}

#[test]
fn rollback_returns_a_served_volume_to_its_snapshot_in_one_step() {
    let dir = TempDir::new("rollback");
    let mut server = Server::start_new(dir.path(), &[("vm-100-disk-0", "16M")], &[]);
    let uri = |name: &str| format!("nbd+unix:///{name}?socket={}", server.socket.display());
    let disk = uri("vm-100-disk-0");
    qemu_io(&disk, &["write -P 0x11 0 8M".into()]);
    fewerbytes_ok(
        &server.pool,
        &[
            "volume",
            "clone",
            "vm-100-disk-0",
            "snap:before:vm-100-disk-0",
            "--thin",
        ],
    );
    let objects = || {
        json(&fewerbytes_ok(&server.pool, &["stats", "--json"]))["objects"]
            .as_u64()
            .expect("objects")
    };
    // One object: the 8 MiB of one pattern are one block stored once.
    assert_eq!(objects(), 1);
    // After the snapshot: new data over half of it, and past it.
    qemu_io(
        &disk,
        &["write -P 0x22 0 4M".into(), "write -P 0x33 12M 4M".into()],
    );

    // Refused while a client has the volume open; nothing changes.
    let mut holder = std::process::Command::new(common::require_tool("qemu-io"))
        .args(["-f", "raw", "-c", "sleep 3000", &disk])
        .spawn()
        .expect("start qemu-io");
    std::thread::sleep(std::time::Duration::from_millis(800));
    let refused = fewerbytes(
        &server.pool,
        &[
            "volume",
            "rollback",
            "vm-100-disk-0",
            "snap:before:vm-100-disk-0",
        ],
    );
    holder.wait().expect("qemu-io exits");
    assert!(!refused.status.success(), "{}", refused.report());
    assert!(
        refused
            .stderr
            .contains("volume 'vm-100-disk-0' is open by 1 client(s)"),
        "the refusal names the volume:\n{}",
        refused.report()
    );
    qemu_io(&disk, &["read -P 0x22 0 4M".into()]);

    let ran = fewerbytes_ok(
        &server.pool,
        &[
            "volume",
            "rollback",
            "vm-100-disk-0",
            "snap:before:vm-100-disk-0",
        ],
    );
    assert!(
        ran.stdout.starts_with(
            "Volume 'vm-100-disk-0' rolled back to 'snap:before:vm-100-disk-0': 16.00 MiB"
        ),
        "{}",
        ran.report()
    );
    qemu_io(
        &disk,
        &["read -P 0x11 0 8M".into(), "read -P 0 8M 8M".into()],
    );
    assert_eq!(objects(), 1, "what only the later writes held is freed");
    let log = server.log_text();
    assert!(
        log.contains(
            "control: roll volume 'vm-100-disk-0' back to 'snap:before:vm-100-disk-0': done"
        ),
        "{log}"
    );
    // The pool's own check agrees, and the rollback survived the server's stop.
    server.stop();
    fewerbytes_ok(&server.pool, &["check"]);
    let missing = fewerbytes(
        &server.pool,
        &[
            "volume",
            "rollback",
            "vm-100-disk-0",
            "snap:after:vm-100-disk-0",
        ],
    );
    assert!(!missing.status.success(), "{}", missing.report());
    assert!(
        missing.stderr.contains("snap:after:vm-100-disk-0"),
        "{}",
        missing.report()
    );
}

#[test]
fn volume_info_shows_one_volume_and_names_a_missing_one() {
    let dir = TempDir::new("info");
    let pool = create_pool(dir.path(), &[("disk0", "8M"), ("disk1", "4M")]);
    let info = json(&fewerbytes_ok(
        &pool,
        &["volume", "info", "disk1", "--json"],
    ));
    assert_eq!(info["name"], "disk1");
    assert_eq!(info["size_bytes"], 4 << 20);
    assert_eq!(info["users"], 0);
    let table = fewerbytes_ok(&pool, &["volume", "info", "disk0"]);
    assert!(table.stdout.contains("disk0"), "{}", table.report());
    assert!(table.stdout.contains("8.00 MiB"), "{}", table.report());
    assert!(!table.stdout.contains("disk1"), "{}", table.report());
    // For shell scripts: exact bytes, no header, columns split by spaces.
    let rows = fewerbytes_ok(&pool, &["volume", "list", "--bytes", "--no-header"]);
    let columns: Vec<Vec<&str>> = rows
        .stdout
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        columns,
        [
            ["disk0", "8388608", "0", "0", "0", "0", "thick", "8388608", "8388608"],
            ["disk1", "4194304", "0", "0", "0", "0", "thick", "4194304", "4194304"]
        ],
        "{}",
        rows.report()
    );
    let one = fewerbytes_ok(&pool, &["volume", "info", "disk1", "--bytes"]);
    assert!(one.stdout.starts_with("Name "), "{}", one.report());
    assert!(one.stdout.contains(" 4194304 "), "{}", one.report());
    let missing = fewerbytes(&pool, &["volume", "info", "disk9"]);
    assert!(!missing.status.success());
    assert!(
        missing.stderr.contains("no volume named 'disk9'"),
        "{}",
        missing.report()
    );
}

#[test]
fn require_server_never_opens_the_pool_itself() {
    let dir = TempDir::new("reqsrv");
    let pool = create_pool(dir.path(), &[("disk0", "8M")]);
    let refused = fewerbytes(
        &pool,
        &["--require-server", "volume", "create", "x", "--size", "4M"],
    );
    assert!(!refused.status.success(), "{}", refused.report());
    assert!(
        refused
            .stderr
            .contains("no fewerbytes server answers for pool"),
        "the refusal says why:\n{}",
        refused.report()
    );
    assert!(
        refused.stderr.contains("--require-server"),
        "the refusal names the flag:\n{}",
        refused.report()
    );
    let list = json(&fewerbytes_ok(&pool, &["volume", "list", "--json"]));
    assert_eq!(
        list.as_array().map(Vec::len),
        Some(1),
        "nothing was created"
    );

    let mut server = Server::start(dir.path(), &pool, &[]);
    fewerbytes_ok(
        &pool,
        &["--require-server", "volume", "create", "x", "--size", "4M"],
    );
    let list = json(&fewerbytes_ok(
        &pool,
        &["--require-server", "volume", "list", "--json"],
    ));
    assert_eq!(
        list.as_array().map(Vec::len),
        Some(2),
        "created through the server"
    );
    server.stop();
}

#[test]
fn import_refuses_image_formats_other_than_raw_naming_each() {
    let dir = TempDir::new("formats");
    let pool = create_pool(dir.path(), &[]);
    // (qemu-img format, its options, what the refusal calls it)
    let cases = [
        ("qcow2", "", "a qcow2 image"),
        ("vmdk", "", "a VMDK image"),
        ("vhdx", "", "a VHDX image"),
        ("vpc", "", "a VHD image"),
        ("vpc", "subformat=fixed", "a VHD image"),
        ("vdi", "", "a VDI image"),
    ];
    for (format, options, called) in cases {
        let image = dir.join(&format!("disk-{format}-{}.img", options.len()));
        let mut create = common::tool("qemu-img");
        create.args(["create", "-q", "-f", format]);
        if !options.is_empty() {
            create.args(["-o", options]);
        }
        create.arg(&image).arg("8M");
        common::run_ok(&mut create);
        let path = image.to_str().expect("utf-8 path");
        let refused = fewerbytes(&pool, &["volume", "import", "disk", path]);
        assert!(!refused.status.success(), "{}", refused.report());
        assert!(
            refused
                .stderr
                .contains(&format!("is {called}, not a raw disk image")),
            "the refusal names the format:\n{}",
            refused.report()
        );
        assert!(
            refused
                .stderr
                .contains(&format!("qemu-img convert -f {format} -O raw")),
            "the refusal gives the command that converts it:\n{}",
            refused.report()
        );
    }
    let list = json(&fewerbytes_ok(&pool, &["volume", "list", "--json"]));
    assert_eq!(
        list.as_array().map(Vec::len),
        Some(0),
        "no volume was created"
    );
}

#[test]
fn import_and_export_overwrite_data_only_when_forced() {
    let dir = TempDir::new("force");
    let pool = create_pool(dir.path(), &[]);
    let first = dir.join("first.raw");
    let second = dir.join("second.raw");
    std::fs::write(&first, vec![0x11u8; 1 << 20]).expect("write image");
    std::fs::write(&second, vec![0x22u8; 1 << 20]).expect("write image");
    let path = |p: &std::path::Path| p.to_str().expect("utf-8 path").to_string();

    fewerbytes_ok(&pool, &["volume", "import", "vm", &path(&first)]);
    let refused = fewerbytes(&pool, &["volume", "import", "vm", &path(&second)]);
    assert!(!refused.status.success(), "{}", refused.report());
    assert!(
        refused
            .stderr
            .contains("volume 'vm' already holds 1.00 MiB of data"),
        "{}",
        refused.report()
    );
    let out = dir.join("out.raw");
    fewerbytes_ok(&pool, &["volume", "export", "vm", &path(&out)]);
    assert_eq!(
        std::fs::read(&out).expect("read export"),
        vec![0x11u8; 1 << 20],
        "the refused import changed nothing"
    );

    let replaced = fewerbytes(&pool, &["volume", "export", "vm", &path(&second)]);
    assert!(!replaced.status.success(), "{}", replaced.report());
    assert!(
        replaced
            .stderr
            .contains("exists (1.00 MiB); pass --force to replace it"),
        "{}",
        replaced.report()
    );
    assert_eq!(
        std::fs::read(&second).expect("read"),
        vec![0x22u8; 1 << 20],
        "the file was left alone"
    );

    fewerbytes_ok(
        &pool,
        &["volume", "import", "--force", "vm", &path(&second)],
    );
    fewerbytes_ok(&pool, &["volume", "export", "--force", "vm", &path(&out)]);
    assert_eq!(
        std::fs::read(&out).expect("read export"),
        vec![0x22u8; 1 << 20]
    );

    // An empty file, as mktemp makes, is a target made for the export.
    let empty = dir.join("empty.raw");
    std::fs::write(&empty, b"").expect("create");
    fewerbytes_ok(&pool, &["volume", "export", "vm", &path(&empty)]);
    assert_eq!(std::fs::metadata(&empty).expect("stat").len(), 1 << 20);
}

#[test]
fn a_sparse_image_is_imported_by_its_data_and_its_holes_read_as_zeros() {
    let dir = TempDir::new("sparse");
    let pool = create_pool(dir.path(), &[]);
    let mib = 1u64 << 20;
    // A 1 GiB image holding 4 KiB of data in each of three 1 MiB chunks; the rest holes.
    let image = dir.join("sparse.raw");
    {
        use std::os::unix::fs::FileExt;
        let file = std::fs::File::create(&image).expect("create image");
        file.set_len(1024 * mib).expect("size image");
        for (n, offset) in [0, 300 * mib + 8192, 1024 * mib - 4096]
            .into_iter()
            .enumerate()
        {
            file.write_all_at(&[0x40 + n as u8; 4096], offset)
                .expect("write image");
        }
    }
    let path = |p: &std::path::Path| p.to_str().expect("utf-8 path").to_string();
    // Data where the image has holes: a forced import must zero it.
    let old = dir.join("old.raw");
    std::fs::write(&old, vec![0x77u8; 4 * mib as usize]).expect("write old image");
    fewerbytes_ok(&pool, &["volume", "create", "vm", "--size", "1G"]);
    fewerbytes_ok(&pool, &["volume", "import", "vm", &path(&old)]);

    let ran = fewerbytes_ok(&pool, &["volume", "import", "--force", "vm", &path(&image)]);
    assert!(
        ran.stdout
            .contains("(a 1.00 GiB image, 1021.00 MiB of it holes): 3.00 MiB in"),
        "the summary counts the data read, not the holes:\n{}",
        ran.report()
    );
    let out = dir.join("out.raw");
    let exported = fewerbytes_ok(&pool, &["volume", "export", "vm", &path(&out)]);
    assert!(
        exported.stdout.contains("(1.00 GiB) to "),
        "the export's summary names the volume's size:\n{}",
        exported.report()
    );
    assert!(
        exported
            .stdout
            .contains("(12.00 KiB of data, the rest holes): 12.00 KiB in"),
        "the export's summary counts the data written:\n{}",
        exported.report()
    );
    assert!(
        std::fs::read(&out).expect("read export") == std::fs::read(&image).expect("read image"),
        "the volume reads back as the sparse image (the old data zeroed)"
    );
    let info = json(&fewerbytes_ok(&pool, &["volume", "info", "vm", "--json"]));
    assert_eq!(
        info["logical_used_bytes"],
        3 * 4096,
        "only the image's data is mapped"
    );
}

#[test]
fn serve_removes_its_socket_when_the_tcp_bind_fails_and_warns_beyond_loopback() {
    let dir = TempDir::new("bind");
    let pool = create_pool(dir.path(), &[("disk0", "8M")]);
    let socket = dir.join("nbd.sock");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port");
    let port = taken.local_addr().expect("local addr").port();
    let failed = fewerbytes(
        &pool,
        &[
            "serve",
            "--socket",
            socket.to_str().expect("utf-8 path"),
            "--listen",
            &format!("127.0.0.1:{port}"),
        ],
    );
    assert!(!failed.status.success(), "{}", failed.report());
    assert!(
        failed
            .stderr
            .contains(&format!("could not listen on 127.0.0.1:{port}")),
        "{}",
        failed.report()
    );
    assert!(
        !socket.exists(),
        "the unix socket file was left behind:\n{}",
        failed.report()
    );
    drop(taken);

    // Beyond loopback without credentials: refused, since TLS is required there by
    // default, naming the ways on.
    let port = common::free_port();
    let refused = fewerbytes(
        &pool,
        &[
            "serve",
            "--socket",
            socket.to_str().expect("utf-8 path"),
            "--listen",
            &format!("0.0.0.0:{port}"),
        ],
    );
    assert!(!refused.status.success(), "{}", refused.report());
    for hint in ["--tls-certificates", "--tls-psk", "--tls off"] {
        assert!(refused.stderr.contains(hint), "{}", refused.report());
    }

    // Beyond loopback with --tls off: served, with a warning that there is no TLS;
    // the log as JSON lines here, as a log collector reads them.
    let mut server = std::process::Command::new(common::fewerbytes_bin())
        .args(["--log-format", "json", "serve", "--pool"])
        .arg(&pool)
        .arg("--socket")
        .arg(&socket)
        .args(["--listen", &format!("0.0.0.0:{port}"), "--tls", "off"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start serve");
    let stderr = server.stderr.take().expect("stderr");
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stderr));
    let line = lines
        .find_map(|line| line.ok().filter(|l| l.contains("without TLS")))
        .expect("a warning about TLS before stderr closed");
    let warning: serde_json::Value = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("a log line that is not JSON ({e}): {line}"));
    assert_eq!(warning["level"], "warn", "{line}");
    assert_eq!(warning["target"], "fewerbytes::serve", "{line}");
    let message = warning["message"].as_str().expect("a message");
    assert!(message.contains(&format!("0.0.0.0:{port}")), "{line}");
    assert!(message.contains("--no-tcp"), "{line}");
    // SAFETY: signalling a child this test started and has not reaped.
    unsafe {
        libc::kill(server.id() as libc::pid_t, libc::SIGTERM);
    }
    let status = server.wait().expect("serve exits");
    assert!(status.success(), "serve exited with {status} after SIGTERM");
}

#[test]
fn metadata_size_without_a_metadata_device_is_refused_rather_than_ignored() {
    let dir = TempDir::new("mdsize");
    let pool = dir.join("p.pool");
    let path = pool.to_str().expect("utf-8 path");
    let refused = fewerbytes(
        &pool,
        &[
            "pool",
            "create",
            path,
            "--size",
            "1G",
            "--metadata-size",
            "64M",
        ],
    );
    assert_eq!(refused.status.code(), Some(2), "{}", refused.report());
    assert!(
        refused.stderr.contains("--metadata-device"),
        "the refusal names what is missing:\n{}",
        refused.report()
    );
    assert!(!pool.exists(), "no pool was made");
}

#[test]
fn completions_and_man_pages_come_from_the_command_line() {
    let dir = TempDir::new("gen");
    let pool = dir.join("none.pool");
    let bash = fewerbytes_ok(&pool, &["completions", "bash"]);
    assert!(
        bash.stdout.contains("complete -F _fewerbytes"),
        "{}",
        bash.report()
    );
    assert!(bash.stdout.contains("rename"), "{}", bash.report());
    let man_dir = dir.join("man1");
    fewerbytes_ok(&pool, &["man", man_dir.to_str().expect("utf-8 path")]);
    let page = std::fs::read_to_string(man_dir.join("fewerbytes-volume-import.1"))
        .expect("a page for volume import");
    assert!(page.contains(".TH fewerbytes-volume-import 1"), "{page}");
    assert!(page.contains("\\-\\-force"), "{page}");
    assert!(man_dir.join("fewerbytes.1").is_file());
    // Every page says how the command exits and shows it in use; check's codes are
    // fsck's.
    for entry in std::fs::read_dir(&man_dir).expect("man dir") {
        let path = entry.expect("man page").path();
        let page = std::fs::read_to_string(&path).expect("read a man page");
        for section in [".SH \"EXIT STATUS\"", ".SH EXAMPLES"] {
            assert!(
                page.contains(section),
                "{} has no {section}:\n{page}",
                path.display()
            );
        }
        assert!(
            page.contains("fewerbytes"),
            "{}: no example",
            path.display()
        );
    }
    let check = std::fs::read_to_string(man_dir.join("fewerbytes-check.1")).expect("check page");
    let exit_status = &check[check.find("EXIT STATUS").expect("EXIT STATUS")..];
    for code in ["\n0\n", "\n1\n", "\n4\n", "\n8\n"] {
        assert!(
            exit_status.contains(code),
            "check's page lacks exit code {code:?}:\n{check}"
        );
    }
}

// A subcommand's --help lists its own options first, and the options every command
// takes once, after them, under their own heading (they came interleaved before).
#[test]
fn a_subcommand_help_shows_its_own_options_before_the_global_ones() {
    let dir = TempDir::new("help");
    let pool = dir.join("none.pool");
    let help = fewerbytes_ok(&pool, &["volume", "create", "--help"]).stdout;
    let own = help.find("--size").expect("--size in the help");
    let heading = help
        .find("Global options")
        .unwrap_or_else(|| panic!("no Global options heading:\n{help}"));
    assert!(own < heading, "own options come first:\n{help}");
    // An option's own line starts with it (its help text may name others).
    let option_lines = |name: &str| -> Vec<usize> {
        let mut at = 0;
        let mut found = Vec::new();
        for line in help.split_inclusive('\n') {
            let option = line.trim_start();
            if option.starts_with(name) && option[name.len()..].starts_with([' ', '\n']) {
                found.push(at);
            }
            at += line.len();
        }
        found
    };
    for global in [
        "--pool",
        "--control-socket",
        "--log-level",
        "--require-server",
    ] {
        let lines = option_lines(global);
        assert_eq!(
            lines.len(),
            1,
            "{global} listed {} times:\n{help}",
            lines.len()
        );
        assert!(
            lines[0] > heading,
            "{global} listed before the heading:\n{help}"
        );
    }
}

// Regression: a pool file truncated under a running server went unnoticed (writes past
// the new end grew it back with holes), and `serve` ended with exit 0, "closed
// cleanly", on a pool that had lost its tail.
#[test]
fn a_pool_file_truncated_while_served_ends_the_server_with_an_error_naming_it() {
    let dir = TempDir::new("truncated");
    let mut server = Server::start_new(dir.path(), &[("vm", "16M")], &[]);
    let uri = format!("nbd+unix:///vm?socket={}", server.socket.display());
    qemu_io(&uri, &["write -P 0x5a 0 4M".into()]);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&server.pool)
        .expect("open the pool file");
    file.set_len(1 << 20).expect("truncate the pool file");
    // A write and a flush: what a guest does next.
    let mut cmd = common::tool("qemu-io");
    cmd.args(["-f", "raw", "-c", "write -P 0x66 0 4M", "-c", "flush", &uri]);
    let _ = common::run_with_limit(&mut cmd, std::time::Duration::from_secs(60));
    let status = server.stop();
    let log = server.log_text();
    assert!(
        !status.success(),
        "serve exited with {status} on a truncated pool:\n{log}"
    );
    assert!(
        log.contains("truncated"),
        "the log does not say why:\n{log}"
    );
}
