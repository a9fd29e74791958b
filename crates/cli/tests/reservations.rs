//! Thick and thin volumes, as a user meets them: `volume create` reserves a volume's
//! whole size unless told `--thin` or `--reserve S`, and is refused with the numbers
//! when the pool cannot hold that aside; `volume clone` takes the same options;
//! `volume set` changes it later, also on a served pool; a thin volume's writes get
//! ENOSPC while a thick volume still writes every block it reserved; and a 32 GiB
//! device holds a 20 GiB template with seven thin clones, all attached at once.

mod common;

use common::data::{mixed_image, Rng};
use common::libnbd::python_nbd;
use common::*;
use serde_json::Value;
use std::path::Path;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn json(ran: &Ran) -> Value {
    serde_json::from_str(&ran.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", ran.report()))
}

fn pool_info(pool: &Path) -> Value {
    json(&fewerbytes_ok(pool, &["pool", "info", "--json"]))
}

fn number(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no number {key} in {v:#}"))
}

/// (reservation bytes, thin) of volume `name`, from `volume info --json`.
fn reservation(pool: &Path, name: &str) -> (u64, bool) {
    let v = json(&fewerbytes_ok(pool, &["volume", "info", name, "--json"]));
    (
        number(&v, "reserved_bytes"),
        v["thin"].as_bool().expect("thin"),
    )
}

/// The one `fewerbytes: error:` sentence of a command that must fail.
fn refused(pool: &Path, args: &[&str]) -> String {
    let ran = fewerbytes(pool, args);
    assert!(
        !ran.status.success(),
        "should be refused:\n{}",
        ran.report()
    );
    ran.stderr
        .lines()
        .find(|l| l.starts_with("fewerbytes: error: "))
        .unwrap_or_else(|| panic!("no error sentence:\n{}", ran.report()))
        .to_string()
}

#[test]
fn volumes_are_thick_by_default_and_thin_or_partly_reserved_by_choice() {
    let dir = TempDir::new("reserve");
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "1G"]);
    let data = number(&pool_info(&pool), "data_bytes");
    assert!(data < GIB, "data region {data}");

    // Thick by default: 2 GiB cannot be held aside in a 1 GiB pool.
    let why = refused(&pool, &["volume", "create", "huge", "--size", "2G"]);
    assert!(why.contains("would reserve 2.00 GiB"), "{why}");
    assert!(why.contains("free for reservations"), "{why}");
    assert!(why.contains("--thin"), "{why}");
    assert!(volume_names(&pool).is_empty());
    // Thin, it is never refused for space.
    let made = fewerbytes_ok(
        &pool,
        &["volume", "create", "huge", "--size", "2G", "--thin"],
    );
    assert!(
        made.stdout.contains("thin, reserves nothing"),
        "{}",
        made.report()
    );
    assert_eq!(reservation(&pool, "huge"), (0, true));

    let made = fewerbytes_ok(&pool, &["volume", "create", "db", "--size", "512M"]);
    assert!(
        made.stdout.contains("thick, reserves 512.00 MiB"),
        "{}",
        made.report()
    );
    assert_eq!(reservation(&pool, "db"), (512 * MIB, false));
    let why = refused(&pool, &["volume", "create", "web", "--size", "512M"]);
    assert!(why.contains("would reserve 512.00 MiB"), "{why}");
    assert!(
        why.contains("512.00 MiB that other volumes' reservations hold back"),
        "{why}"
    );
    fewerbytes_ok(
        &pool,
        &[
            "volume",
            "create",
            "web",
            "--size",
            "512M",
            "--reserve",
            "128M",
        ],
    );
    assert_eq!(reservation(&pool, "web"), (128 * MIB, true));

    let info = pool_info(&pool);
    assert_eq!(number(&info, "reserved_bytes"), 640 * MIB, "{info:#}");
    assert_eq!(
        number(&info, "reserved_unused_bytes"),
        640 * MIB,
        "{info:#}"
    );
    assert_eq!(number(&info, "promised_bytes"), 3 * GIB, "{info:#}");
    let text = fewerbytes_ok(&pool, &["pool", "info"]).stdout;
    assert!(text.contains("3.00 GiB (volume sizes added up)"), "{text}");
    assert!(
        text.contains("640.00 MiB (640.00 MiB not yet used"),
        "{text}"
    );
    // What is kept for the pages of reserved data: shown, and the same in stats. A
    // new 1 GiB pool's page store holds the pages of 640 MiB of reservations.
    assert!(text.contains("Kept for metadata:"), "{text}");
    let stats = json(&fewerbytes_ok(&pool, &["stats", "--json"]));
    assert_eq!(
        number(&stats, "metadata_kept_bytes"),
        number(&info, "metadata_kept_bytes"),
        "{stats:#}"
    );
    assert_eq!(number(&info, "metadata_kept_bytes"), 0, "{info:#}");

    // `volume set`, both ways, refused when it cannot be honoured.
    let why = refused(&pool, &["volume", "set", "web", "--thick"]);
    assert!(
        why.contains("volume 'web' would reserve 512.00 MiB"),
        "{why}"
    );
    assert_eq!(reservation(&pool, "web"), (128 * MIB, true));
    let set = fewerbytes_ok(&pool, &["volume", "set", "db", "--thin"]);
    assert!(
        set.stdout.contains("Volume 'db' is now thin"),
        "{}",
        set.report()
    );
    fewerbytes_ok(&pool, &["volume", "set", "web", "--thick"]);
    assert_eq!(reservation(&pool, "web"), (512 * MIB, false));
    fewerbytes_ok(&pool, &["volume", "set", "db", "--reserve", "64M"]);
    assert_eq!(reservation(&pool, "db"), (64 * MIB, true));
    let both = fewerbytes(&pool, &["volume", "set", "db", "--thin", "--thick"]);
    assert!(!both.status.success(), "{}", both.report());
    let neither = fewerbytes(&pool, &["volume", "set", "db"]);
    assert!(!neither.status.success(), "{}", neither.report());

    // Clones: thick by default, and the same options.
    let why = refused(&pool, &["volume", "clone", "web", "web2"]);
    assert!(
        why.contains("clone 'web2' of 512.00 MiB would reserve"),
        "{why}"
    );
    assert!(!volume_names(&pool).contains(&"web2".to_string()));
    fewerbytes_ok(&pool, &["volume", "clone", "web", "web2", "--thin"]);
    fewerbytes_ok(&pool, &["volume", "clone", "db", "db2", "--reserve", "32M"]);
    assert_eq!(reservation(&pool, "web2"), (0, true));
    assert_eq!(reservation(&pool, "db2"), (32 * MIB, true));

    // The list shows each volume's kind and reservation, in columns scripts can read.
    let rows = fewerbytes_ok(&pool, &["volume", "list", "--bytes", "--no-header"]).stdout;
    let row = |name: &str| -> Vec<String> {
        rows.lines()
            .map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
            .find(|cells| cells.first().map(String::as_str) == Some(name))
            .unwrap_or_else(|| panic!("no row {name}: {rows}"))
    };
    assert_eq!(
        row("web")[6..],
        ["thick", "536870912", "536870912"],
        "{rows}"
    );
    assert_eq!(row("huge")[6..], ["thin", "0", "0"], "{rows}");
    assert_eq!(
        row("db2")[6..],
        ["reserve", "33554432", "33554432"],
        "{rows}"
    );
    // And stats: reserved and promised beside the space figures.
    let header = fewerbytes_ok(&pool, &["stats"]).stdout;
    assert!(header.contains("Reserved"), "{header}");
    assert!(header.contains("Promised"), "{header}");
    let row = fewerbytes_ok(&pool, &["stats", "--bytes", "--no-header"]).stdout;
    let cells: Vec<&str> = row.split_whitespace().collect();
    let reserved = (512 + 64 + 32) * MIB;
    let promised = 2 * GIB + 512 * MIB * 4;
    // Device, Size, Used, Available, Use%, Space saving%, Reserved, Promised.
    assert_eq!(
        cells[6..8],
        [reserved.to_string(), promised.to_string()],
        "{row}"
    );
}

/// Fill the export with random bytes until a write fails; it must fail with ENOSPC.
const FILL_PY: &str = r#"
import errno, os, sys, nbd
h = nbd.NBD()
h.connect_uri(sys.argv[1])
size = h.get_size()
chunk = 1 << 20
for off in range(0, size, chunk):
    try:
        h.pwrite(os.urandom(chunk), off)
    except nbd.Error as e:
        if e.errno not in (errno.ENOSPC, "ENOSPC"):
            sys.exit(f"the write at {off} failed with errno {e.errno}, not ENOSPC: {e}")
        print(f"ENOSPC after {off >> 20} MiB")
        break
else:
    sys.exit(f"{size} bytes of random data fit in a pool that should be full")
h.flush()
"#;

#[test]
fn thin_writes_get_enospc_while_a_thick_volume_writes_its_reservation() {
    let dir = TempDir::new("thinfull");
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "128M"]);
    fewerbytes_ok(&pool, &["volume", "create", "db", "--size", "32M"]);
    fewerbytes_ok(
        &pool,
        &["volume", "create", "scratch", "--size", "256M", "--thin"],
    );
    let mut server = Server::start(dir.path(), &pool, &[]);
    let filled = python_nbd(FILL_PY, &[&server.unix_uri("scratch")]);
    assert!(
        filled.stdout.contains("ENOSPC after"),
        "{}",
        filled.report()
    );

    // Every byte of the thick volume takes new, incompressible data.
    let random = dir.join("random.img");
    let mut bytes = vec![0u8; 32 * MIB as usize];
    Rng::new(13).fill(&mut bytes);
    std::fs::write(&random, &bytes).expect("write the random image");
    let random_str = random.to_str().expect("utf-8 temp path");
    qemu_io(
        &server.unix_uri("db"),
        &[format!("write -s {random_str} 0 32M"), "flush".to_string()],
    );
    run_ok(tool("qemu-img").args([
        "compare",
        "-f",
        "raw",
        "-F",
        "raw",
        random_str,
        &server.unix_uri("db"),
    ]));

    // A served pool changes reservations through its control socket.
    let set = server.cli_ok(&["volume", "set", "db", "--thin"]);
    assert!(
        set.stdout.contains("Volume 'db' is now thin"),
        "{}",
        set.report()
    );
    let info = json(&server.cli_ok(&["pool", "info", "--json"]));
    assert_eq!(number(&info, "reserved_bytes"), 0, "{info:#}");
    server.cli_ok(&["volume", "set", "db", "--thick"]);
    let info = json(&server.cli_ok(&["pool", "info", "--json"]));
    assert_eq!(number(&info, "reserved_bytes"), 32 * MIB, "{info:#}");
    // Written whole, it holds nothing back any more.
    assert_eq!(number(&info, "reserved_unused_bytes"), 0, "{info:#}");
    // The thin volume maps what it wrote before the pool filled; more than that
    // cannot be held aside now.
    let refused_set = server.cli(&["volume", "set", "scratch", "--reserve", "200M"]);
    assert!(!refused_set.status.success(), "{}", refused_set.report());
    assert!(
        refused_set.stderr.contains("free for reservations"),
        "{}",
        refused_set.report()
    );
    assert!(
        server.log_text().contains("make volume 'db' thin"),
        "{}",
        server.log_text()
    );
    assert_eq!(server.stats()["mode"], "normal");
    let status = server.stop();
    assert!(status.success(), "{}", server.log_text());
    drop(server);
    assert_check_clean(&pool);
}

/// Attach every clone at once, read the template's data through each, write new data
/// into one clone and read it back, and check neither another clone nor the template
/// changed.
const CLONES_PY: &str = r#"
import os, sys, nbd
socket, image_path = sys.argv[1], sys.argv[2]
image = open(image_path, "rb").read()
names = [f"vm{i}" for i in range(1, 8)]
handles = {}
for name in names:
    h = nbd.NBD()
    h.connect_uri(f"nbd+unix:///{name}?socket={socket}")
    handles[name] = h
for name, h in handles.items():
    if h.get_size() != 20 << 30:
        sys.exit(f"{name} is {h.get_size()} bytes, not 20 GiB")
    for off in (0, len(image) // 2, len(image) - (1 << 20)):
        if h.pread(1 << 20, off) != image[off:off + (1 << 20)]:
            sys.exit(f"{name} reads other bytes than the template at {off}")
    if h.pread(1 << 20, 19 << 30) != bytes(1 << 20):
        sys.exit(f"{name} is not zero past the template's data")
new = os.urandom(16 << 20)
h = handles["vm3"]
h.pwrite(new, 8 << 20)
h.flush()
if h.pread(16 << 20, 8 << 20) != new:
    sys.exit("vm3 reads back other bytes than it wrote")
if handles["vm4"].pread(16 << 20, 8 << 20) != image[8 << 20:24 << 20]:
    sys.exit("a write to vm3 changed vm4")
t = nbd.NBD()
t.connect_uri(f"nbd+unix:///template?socket={socket}")
if t.pread(16 << 20, 8 << 20) != image[8 << 20:24 << 20]:
    sys.exit("a write to vm3 changed the template")
print(f"{len(handles)} clones attached at once")
"#;

/// What thin volumes may promise has no bound but the format's: a 64 MiB
/// pool makes three thin volumes of 4 PiB, takes an image into one of them and checks
/// clean; a volume of 5 PiB is refused with the limit.
#[test]
fn a_64m_pool_promises_thin_4p_volumes_and_refuses_5p() {
    let dir = TempDir::new("petabytes");
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "64M"]);
    for name in ["vm1", "vm2", "vm3"] {
        fewerbytes_ok(&pool, &["volume", "create", name, "--size", "4P", "--thin"]);
    }
    assert_eq!(number(&pool_info(&pool), "promised_bytes"), 12 << 50);
    let why = refused(
        &pool,
        &["volume", "create", "vm4", "--size", "5P", "--thin"],
    );
    assert!(why.contains("a volume is at most 4.00 PiB"), "{why}");

    let image = dir.join("disk.img");
    std::fs::write(&image, mixed_image(64, 13)).expect("write the image");
    let image_str = image.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["volume", "import", "vm2", image_str]);
    let info = json(&fewerbytes_ok(&pool, &["volume", "info", "vm2", "--json"]));
    assert_eq!(number(&info, "size_bytes"), 4 << 50, "{info:#}");
    // The image's 64 blocks lie in one map page: the only one in memory.
    assert_eq!(number(&info, "map_pages"), 1, "{info:#}");
    assert_check_clean(&pool);
}

#[test]
fn a_32g_device_holds_a_20g_template_and_seven_thin_clones() {
    let dir = TempDir::new("clones32");
    let pool = dir.join("vm.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "32G"]);
    fewerbytes_ok(&pool, &["volume", "create", "template", "--size", "20G"]);
    let mut server = Server::start(dir.path(), &pool, &[]);

    // A few hundred MiB of the seed's kind of data in the template.
    let image = dir.join("template.img");
    std::fs::write(&image, mixed_image(256 * MIB / 4096, 5)).expect("write the image");
    let image_str = image.to_str().expect("utf-8 temp path");
    run_ok(tool("nbdcopy").args([image_str, &server.unix_uri("template")]));

    for i in 1..=7 {
        let name = format!("vm{i}");
        let cloned = server.cli_ok(&["volume", "clone", "template", &name, "--thin"]);
        assert!(
            cloned.stdout.contains("thin, reserves nothing"),
            "{}",
            cloned.report()
        );
    }
    // An eighth clone, thick, cannot be held aside: the template's reservation and
    // the data take too much of the 32 GiB.
    let thick = server.cli(&["volume", "clone", "template", "vm8"]);
    assert!(!thick.status.success(), "{}", thick.report());
    assert!(
        thick.stderr.contains("free for reservations"),
        "{}",
        thick.report()
    );

    let info = json(&server.cli_ok(&["pool", "info", "--json"]));
    assert_eq!(number(&info, "promised_bytes"), 160 * GIB, "{info:#}");
    assert_eq!(number(&info, "reserved_bytes"), 20 * GIB, "{info:#}");
    assert!(number(&info, "data_bytes") < 32 * GIB, "{info:#}");
    let text = server.cli_ok(&["pool", "info"]).stdout;
    assert!(
        text.contains("160.00 GiB (volume sizes added up)"),
        "{text}"
    );
    assert!(
        text.contains("Reserved") && text.contains("20.00 GiB ("),
        "{text}"
    );
    let volumes = json(&server.cli_ok(&["volume", "list", "--json"]));
    for v in volumes.as_array().expect("array") {
        let thin = v["thin"].as_bool().expect("thin");
        assert_eq!(thin, v["name"] != "template", "{v:#}");
    }

    let ran = python_nbd(
        CLONES_PY,
        &[
            server.socket.to_str().expect("utf-8 socket path"),
            image_str,
        ],
    );
    assert!(
        ran.stdout.contains("7 clones attached at once"),
        "{}",
        ran.report()
    );
    let stats = server.stats();
    assert_eq!(stats["mode"], "normal");
    assert_eq!(number(&stats, "promised_bytes"), 160 * GIB);
    let status = server.stop();
    assert!(status.success(), "{}", server.log_text());
}
