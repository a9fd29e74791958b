//! The `fewerbytes` binary as a user drives it: pools, volumes, imports and exports,
//! `stats`, `list-metadata`, `check`, and management of a served pool through its
//! control socket. Each test asserts what a person at the terminal would notice.
//!
//! Images are generated from a seed (printed on failure), and every pool is a sparse
//! file in its own temporary directory.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const FEWERBYTES: &str = env!("CARGO_BIN_EXE_fewerbytes");
const MIB: u64 = 1 << 20;
const BLOCK: usize = 4096;
/// How long a server may take to start listening or to stop after SIGTERM.
const SERVER_LIMIT: Duration = Duration::from_secs(60);
/// Seed of every generated image.
const SEED: u64 = 0x00fe_b17e_5eed;

// ---------------------------------------------------------------------------------
// Harness

/// A directory removed when dropped (kept, and named, if the test panicked).
struct TempDir(PathBuf);

impl TempDir {
    fn new(label: &str) -> TempDir {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        // Short: a unix socket path must fit in 108 bytes.
        let path = std::env::temp_dir().join(format!("fbcli-{label}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }

    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept {} for inspection", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// One finished command.
struct Ran {
    command: String,
    output: Output,
}

impl Ran {
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.output.stdout).into_owned()
    }
    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.output.stderr).into_owned()
    }
    fn code(&self) -> Option<i32> {
        self.output.status.code()
    }
    fn report(&self) -> String {
        format!(
            "`{}` exited with {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.command,
            self.code(),
            self.stdout(),
            self.stderr()
        )
    }
    /// Panics unless the command succeeded.
    fn ok(self) -> Ran {
        assert!(self.output.status.success(), "{}", self.report());
        self
    }
    /// Panics unless the command failed with exit code 1 and one `fewerbytes: error:`
    /// sentence; returns the sentence.
    fn error(self) -> String {
        assert_eq!(self.code(), Some(1), "{}", self.report());
        let stderr = self.stderr();
        let line = stderr
            .lines()
            .find(|l| l.starts_with("fewerbytes: error: "))
            .unwrap_or_else(|| panic!("no `fewerbytes: error:` line\n{}", self.report()));
        line.to_string()
    }
    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout())
            .unwrap_or_else(|e| panic!("not JSON ({e})\n{}", self.report()))
    }
}

fn command(pool: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(FEWERBYTES);
    cmd.env_remove("FEWERBYTES_POOL")
        .env_remove("FEWERBYTES_LOG")
        .arg("--pool")
        .arg(pool)
        .args(args)
        .stdin(Stdio::null());
    cmd
}

/// Run `fewerbytes --pool POOL ARGS…`.
fn fb(pool: &Path, args: &[&str]) -> Ran {
    run(command(pool, args))
}

fn run(mut cmd: Command) -> Ran {
    let described = format!("{cmd:?}");
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {described}: {e}"));
    Ran {
        command: described,
        output,
    }
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("utf-8 temp path")
}

/// `pool create` on `dir/pool` with `args` added; returns the pool path.
fn create_pool(dir: &TempDir, args: &[&str]) -> PathBuf {
    let pool = dir.join("pool");
    let mut all = vec!["pool", "create", path_str(&pool)];
    all.extend_from_slice(args);
    fb(&pool, &all).ok();
    pool
}

fn stats_json(pool: &Path) -> serde_json::Value {
    fb(pool, &["stats", "--json"]).ok().json()
}

fn u64_at(value: &serde_json::Value, key: &str) -> u64 {
    value[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no number `{key}` in {value:#}"))
}

/// A `fewerbytes serve` process on a pool, unix socket only.
struct Server {
    child: Option<Child>,
    pool: PathBuf,
    socket: PathBuf,
    log: PathBuf,
}

impl Server {
    fn start(dir: &TempDir, pool: &Path, extra: &[&str]) -> Server {
        let socket = dir.join("nbd.sock");
        let log = dir.join("serve.log");
        let log_file = File::create(&log).expect("create server log");
        let mut cmd = command(pool, &["serve", "--no-tcp", "--socket", path_str(&socket)]);
        cmd.args(extra)
            .stdout(log_file.try_clone().expect("clone log"))
            .stderr(log_file);
        let child = cmd.spawn().expect("start fewerbytes serve");
        let mut server = Server {
            child: Some(child),
            pool: pool.to_path_buf(),
            socket,
            log,
        };
        server.wait_ready();
        server
    }

    fn control_socket(&self) -> PathBuf {
        let mut name = self.pool.clone().into_os_string();
        name.push(".ctl");
        PathBuf::from(name)
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn wait_ready(&mut self) {
        let started = Instant::now();
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().expect("poll"))
            {
                self.child = None;
                panic!(
                    "serve exited with {status} before listening:\n{}",
                    self.log_text()
                );
            }
            if UnixStream::connect(&self.socket).is_ok()
                && UnixStream::connect(self.control_socket()).is_ok()
            {
                return;
            }
            assert!(
                started.elapsed() < SERVER_LIMIT,
                "serve did not listen within {SERVER_LIMIT:?}:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn pid(&self) -> libc::pid_t {
        let child = self.child.as_ref().expect("server running");
        libc::pid_t::try_from(child.id()).expect("pid fits")
    }

    fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.pid(), signal) };
        assert_eq!(rc, 0, "kill failed");
    }

    /// SIGTERM and wait; returns the exit code.
    fn stop(&mut self) -> Option<i32> {
        self.signal(libc::SIGTERM);
        let started = Instant::now();
        let mut child = self.child.take().expect("server running");
        loop {
            if let Some(status) = child.try_wait().expect("poll") {
                return status.code();
            }
            if started.elapsed() > SERVER_LIMIT {
                let _ = child.kill();
                let _ = child.wait();
                panic!("serve did not stop after SIGTERM:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL: a crash, as far as the pool can tell.
    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.is_some() {
            if std::thread::panicking() {
                eprintln!("--- server log ---\n{}", self.log_text());
            }
            self.kill9();
        }
    }
}

/// splitmix64: a seeded generator so a failing image can be made again.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let bytes = self.next().to_le_bytes();
            chunk.copy_from_slice(&bytes[..chunk.len()]);
        }
    }
}

/// A raw image of `bytes` (a multiple of 4 KiB): per block, a quarter each of random,
/// duplicates of an earlier block, compressible text-like data, and zeros.
fn write_mixed_image(path: &Path, bytes: u64, seed: u64) {
    let mut rng = Rng(seed);
    let mut out = BufWriter::with_capacity(MIB as usize, File::create(path).expect("create image"));
    let mut history: Vec<[u8; BLOCK]> = Vec::new();
    let mut block = [0u8; BLOCK];
    for _ in 0..bytes / BLOCK as u64 {
        match rng.next() % 4 {
            0 => rng.fill(&mut block),
            1 if !history.is_empty() => {
                let pick = (rng.next() % history.len() as u64) as usize;
                block = history[pick];
            }
            1 | 2 => {
                // Half random words from a small alphabet, half zero: compresses well.
                rng.fill(&mut block[..BLOCK / 2]);
                for byte in &mut block[..BLOCK / 2] {
                    *byte = b'a' + *byte % 8;
                }
                block[BLOCK / 2..].fill(0);
            }
            _ => block.fill(0),
        }
        if block.iter().any(|&b| b != 0) && history.len() < 1024 {
            history.push(block);
        }
        out.write_all(&block).expect("write image");
    }
    out.flush().expect("flush image");
}

/// Panics unless the two files hold the same bytes, naming the first differing MiB.
fn assert_same_bytes(expected: &Path, actual: &Path) {
    let expected_len = std::fs::metadata(expected).expect("stat").len();
    let actual_len = std::fs::metadata(actual).expect("stat").len();
    assert_eq!(
        actual_len,
        expected_len,
        "{} has the wrong size",
        actual.display()
    );
    let mut a = File::open(expected).expect("open");
    let mut b = File::open(actual).expect("open");
    let mut buf_a = vec![0u8; MIB as usize];
    let mut buf_b = vec![0u8; MIB as usize];
    let mut offset = 0u64;
    while offset < expected_len {
        let len = MIB.min(expected_len - offset) as usize;
        a.read_exact(&mut buf_a[..len]).expect("read");
        b.read_exact(&mut buf_b[..len]).expect("read");
        assert!(
            buf_a[..len] == buf_b[..len],
            "{} differs from {} in the MiB at offset {offset}",
            actual.display(),
            expected.display()
        );
        offset += len as u64;
    }
}

fn volume_names(pool: &Path) -> Vec<String> {
    let list = fb(pool, &["volume", "list", "--json"]).ok().json();
    list.as_array()
        .expect("volume list --json is an array")
        .iter()
        .map(|v| v["name"].as_str().expect("name").to_string())
        .collect()
}

// ---------------------------------------------------------------------------------
// Pools

#[test]
fn pool_create_says_what_it_can_address_and_refuses_to_overwrite() {
    let dir = TempDir::new("create");
    let pool = dir.join("pool");
    let created = fb(&pool, &["pool", "create", path_str(&pool), "--size", "1G"]).ok();
    let said = created.stdout();
    assert!(said.contains("created"), "{}", created.report());
    assert!(said.contains("can address"), "{}", created.report());
    assert!(
        said.contains("GiB") || said.contains("MiB"),
        "{}",
        created.report()
    );

    let info = fb(&pool, &["pool", "info", "--json"]).ok().json();
    let addressable = u64_at(&info, "addressable_bytes");
    assert!(addressable > 0, "{info:#}");
    assert!(addressable <= 1 << 30, "{info:#}");
    let text = fb(&pool, &["pool", "info"]).ok().stdout();
    for line in [
        "Promised",
        "Reserved",
        "Reservable",
        "Available",
        "Used",
        "Size",
    ] {
        assert!(text.contains(line), "{text}");
    }

    let again = fb(&pool, &["pool", "create", path_str(&pool), "--size", "1G"]).error();
    assert!(
        again.contains("force"),
        "the refusal should say how to overwrite: {again}"
    );

    fb(
        &pool,
        &["pool", "create", path_str(&pool), "--size", "1G", "--force"],
    )
    .ok();
    fb(&pool, &["check"]).ok();
}

// Regression: `pool create` left the pool file (and a metadata file it made) 0644
// under umask 022: any local user could copy it and `volume export` every volume.
#[test]
fn pool_create_makes_files_only_their_owner_can_read_and_says_so() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let dir = TempDir::new("create-mode");
    let pool = dir.join("pool");
    let meta = dir.join("pool.meta");
    let mut cmd = command(
        &pool,
        &[
            "pool",
            "create",
            path_str(&pool),
            "--size",
            "1G",
            "--metadata-device",
            path_str(&meta),
            "--metadata-size",
            "64M",
        ],
    );
    // SAFETY: umask is async-signal-safe and touches nothing of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::umask(0o022);
            Ok(())
        });
    }
    let created = run(cmd).ok();
    for file in [&pool, &meta] {
        let mode = std::fs::metadata(file)
            .expect("pool file")
            .permissions()
            .mode();
        assert_eq!(
            mode & 0o777,
            0o600,
            "{} is readable by others: {:o}",
            file.display(),
            mode & 0o777
        );
    }
    assert!(
        created.stdout().contains("0600"),
        "pool create did not say the file is its owner's only:\n{}",
        created.report()
    );
    // A file made beforehand, readable by all, is made its owner's only.
    let made = dir.join("made");
    std::fs::write(&made, b"").expect("file");
    std::fs::set_permissions(&made, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    fb(&made, &["pool", "create", path_str(&made), "--size", "1G"]).ok();
    let mode = std::fs::metadata(&made).expect("pool").permissions().mode();
    assert_eq!(
        mode & 0o777,
        0o600,
        "an existing file kept mode {:o}",
        mode & 0o777
    );
}

// A new pool used to set aside 5.6% of an 8 GiB device for metadata (a page store
// sized for every block the volumes could address); the page store now holds what
// fits in 2% and further pages go to data blocks as they are needed.
#[test]
fn a_new_pool_takes_at_most_two_percent_of_its_device_for_metadata() {
    for size in ["1G", "8G", "16G"] {
        let dir = TempDir::new("meta-share");
        let pool = create_pool(&dir, &["--size", size]);
        let info = fb(&pool, &["pool", "info", "--json"]).ok().json();
        let device = u64_at(&info, "data_device_bytes");
        // Everything before the data region: super blocks, journal, page store, padding.
        let not_data = device - u64_at(&info, "data_bytes");
        assert!(
            u64_at(&info, "metadata_regions_bytes") <= not_data,
            "{info:#}"
        );
        assert!(
            not_data * 100 <= device * 2,
            "a {size} pool sets aside {not_data} of {device} bytes: {info:#}"
        );
        let stats = stats_json(&pool);
        assert!(
            u64_at(&stats, "metadata_bytes") * 100 <= device * 2,
            "{stats:#}"
        );
        assert_eq!(u64_at(&stats, "metadata_in_data_bytes"), 0, "{stats:#}");
    }
}

#[test]
fn pool_create_refuses_a_size_too_small_and_names_the_minimum() {
    let dir = TempDir::new("small");
    let pool = dir.join("pool");
    let refused = fb(&pool, &["pool", "create", path_str(&pool), "--size", "64K"]).error();
    assert!(
        refused.to_lowercase().contains("minimum") || refused.to_lowercase().contains("at least"),
        "the refusal should name the minimum: {refused}"
    );
}

#[test]
fn usage_errors_exit_2_and_runtime_errors_exit_1_with_one_sentence() {
    let dir = TempDir::new("usage");
    let pool = dir.join("none");
    let no_size = fb(&pool, &["volume", "create", "vm1"]);
    assert_eq!(no_size.code(), Some(2), "{}", no_size.report());
    let bad_size = fb(&pool, &["volume", "create", "vm1", "--size", "10X"]);
    assert_eq!(bad_size.code(), Some(2), "{}", bad_size.report());
    assert!(
        bad_size.stderr().contains("unknown unit"),
        "{}",
        bad_size.report()
    );

    let missing = fb(&pool, &["volume", "list"]).error();
    assert!(missing.contains("no pool at"), "{missing}");
    assert!(missing.contains(path_str(&pool)), "{missing}");

    // The OS's reason is given once, after what could not be done.
    let nested = dir.join("no-such-folder").join("pool");
    let no_folder = fb(
        &pool,
        &["pool", "create", path_str(&nested), "--size", "1G"],
    )
    .error();
    assert!(no_folder.contains("could not open"), "{no_folder}");
    assert_eq!(
        no_folder.matches("No such file or directory").count(),
        1,
        "{no_folder}"
    );
}

// ---------------------------------------------------------------------------------
// Volumes

#[test]
fn volumes_are_thick_unless_made_thin() {
    let dir = TempDir::new("vols");
    let pool = create_pool(&dir, &["--size", "1G"]);
    let too_big = fb(&pool, &["volume", "create", "huge", "--size", "2G"]).error();
    assert!(
        too_big.chars().any(|c| c.is_ascii_digit()),
        "the refusal should carry the numbers: {too_big}"
    );

    fb(&pool, &["volume", "create", "vm1", "--size", "64M"]).ok();
    fb(&pool, &["volume", "resize", "vm1", "--size", "128M"]).ok();
    let shrink = fb(&pool, &["volume", "resize", "vm1", "--size", "32M"]).error();
    assert!(shrink.contains("shrink"), "{shrink}");
    fb(
        &pool,
        &["volume", "resize", "vm1", "--size", "96M", "--shrink"],
    )
    .ok();
    fb(&pool, &["volume", "clone", "vm1", "vm2"]).ok();
    let list = fb(&pool, &["volume", "list", "--json"]).ok().json();
    let sizes: Vec<(String, u64)> = list
        .as_array()
        .expect("array")
        .iter()
        .map(|v| {
            (
                v["name"].as_str().unwrap().to_string(),
                v["size_bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    assert!(sizes.contains(&("vm1".into(), 96 * MIB)), "{list:#}");
    assert!(sizes.contains(&("vm2".into(), 96 * MIB)), "{list:#}");

    let table = fb(&pool, &["volume", "list"]).ok().stdout();
    let header = table.lines().next().unwrap_or_default();
    for column in [
        "Name",
        "Size",
        "Logical used",
        "Zero",
        "Exclusive stored",
        "Users",
    ] {
        assert!(header.contains(column), "missing column {column}: {table}");
    }
    assert!(table.contains("vm1"), "{table}");
    assert!(table.contains("vm2"), "{table}");

    fb(&pool, &["volume", "delete", "vm2"]).ok();
    assert_eq!(volume_names(&pool), vec!["vm1".to_string()]);
    let gone = fb(&pool, &["volume", "delete", "vm2"]).error();
    assert!(gone.contains("vm2"), "{gone}");

    // --overcommit is accepted with a warning, and a thin volume may promise more
    // than the pool stores.
    let over = TempDir::new("over");
    let pool = over.join("pool");
    let created = fb(
        &pool,
        &[
            "pool",
            "create",
            path_str(&pool),
            "--size",
            "1G",
            "--overcommit",
        ],
    )
    .ok();
    assert!(
        created.stderr().contains("deprecated"),
        "{}",
        created.report()
    );
    let info = fb(&pool, &["pool", "info", "--json"]).ok().json();
    assert!(u64_at(&info, "data_bytes") < 2 << 30, "{info:#}");
    fb(&pool, &["volume", "create", "big", "--size", "2G"]).error();
    fb(
        &pool,
        &["volume", "create", "big", "--size", "2G", "--thin"],
    )
    .ok();
    assert_eq!(volume_names(&pool), vec!["big".to_string()]);
}

// ---------------------------------------------------------------------------------
// Effectiveness: dedup across volumes, zeros, and round trips

#[test]
fn seven_imports_of_one_image_store_it_once_and_export_it_unchanged() {
    let dir = TempDir::new("dedup");
    let pool = create_pool(&dir, &["--size", "4G"]);
    let image = dir.join("mixed.img");
    let image_bytes = 256 * MIB;
    write_mixed_image(&image, image_bytes, SEED);

    let before = u64_at(&stats_json(&pool), "stored_bytes");
    let imported = fb(&pool, &["volume", "import", "vol0", path_str(&image)]).ok();
    assert!(
        imported.stdout().contains("Imported"),
        "{}",
        imported.report()
    );
    let after_first = u64_at(&stats_json(&pool), "stored_bytes");
    assert!(
        after_first > before,
        "the first import stored nothing (seed {SEED:#x})"
    );
    assert!(
        after_first - before < image_bytes,
        "the first import stored {} bytes for a {image_bytes}-byte image with zeros, \
         duplicates and compressible blocks (seed {SEED:#x})",
        after_first - before
    );
    for n in 1..7 {
        fb(
            &pool,
            &["volume", "import", &format!("vol{n}"), path_str(&image)],
        )
        .ok();
    }
    let after_all = u64_at(&stats_json(&pool), "stored_bytes");
    assert!(
        after_all - after_first < image_bytes / 100,
        "six more imports of the same image added {} data bytes (limit {}; seed {SEED:#x})",
        after_all - after_first,
        image_bytes / 100
    );

    // A GiB of zeros stores nothing.
    let zeros = dir.join("zeros.img");
    File::create(&zeros)
        .expect("create")
        .set_len(1 << 30)
        .expect("size");
    fb(&pool, &["volume", "import", "zeros", path_str(&zeros)]).ok();
    let after_zeros = stats_json(&pool);
    assert_eq!(
        u64_at(&after_zeros, "stored_bytes"),
        after_all,
        "zeros were stored"
    );

    // Dedup shows in the numbers a person reads.
    assert!(
        u64_at(&after_zeros, "logical_used_bytes") >= u64_at(&after_zeros, "stored_bytes"),
        "{after_zeros:#}"
    );
    let saving = after_zeros["saving_percent"]
        .as_f64()
        .expect("saving_percent");
    assert!(
        saving > 80.0,
        "seven copies should save most of the space: {saving}%"
    );

    let table = fb(&pool, &["stats"]).ok().stdout();
    let mut lines = table.lines();
    let header = lines.next().unwrap_or_default();
    for column in [
        "Device",
        "Size",
        "Used",
        "Available",
        "Use%",
        "Space saving%",
        "Mode",
    ] {
        assert!(header.contains(column), "missing column {column}: {table}");
    }
    let row = lines.next().unwrap_or_default();
    assert!(row.contains(path_str(&pool)), "no pool row: {table}");
    // In bytes, the row adds up: Size = Used + Available.
    let row = fb(&pool, &["stats", "--bytes", "--no-header"])
        .ok()
        .stdout();
    let cells: Vec<&str> = row.split_whitespace().collect();
    let number = |i: usize| -> u64 {
        cells
            .get(i)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("cell {i} of {row:?} is not a byte count"))
    };
    assert_eq!(
        number(1),
        number(2) + number(3),
        "Size != Used + Available: {row}"
    );
    assert!(row.contains("opened read-only"), "{row}");
    let verbose = fb(&pool, &["stats", "--verbose"]).ok().stdout();
    assert!(verbose.contains("stored_bytes"), "{verbose}");
    assert!(verbose.contains("volumes[vol3]"), "{verbose}");

    for name in ["vol0", "vol6", "zeros"] {
        let exported = dir.join(&format!("{name}.out"));
        fb(&pool, &["volume", "export", name, path_str(&exported)]).ok();
        let original = if name == "zeros" { &zeros } else { &image };
        assert_same_bytes(original, &exported);
        if name == "zeros" {
            // Export is sparse: a GiB of holes takes (almost) no disk.
            let allocated_bytes = std::os::unix::fs::MetadataExt::blocks(
                &std::fs::metadata(&exported).expect("stat"),
            ) * 512;
            assert!(
                allocated_bytes < MIB,
                "exporting a volume of zeros allocated {allocated_bytes} bytes on disk"
            );
        }
        let _ = std::fs::remove_file(&exported);
    }

    let checked = fb(&pool, &["check"]).ok().stdout();
    assert!(checked.contains("No problems"), "{checked}");
}

#[test]
fn import_refuses_a_volume_smaller_than_the_image() {
    let dir = TempDir::new("small-vol");
    let pool = create_pool(&dir, &["--size", "1G"]);
    let image = dir.join("image");
    write_mixed_image(&image, 8 * MIB, SEED + 1);
    fb(&pool, &["volume", "create", "tiny", "--size", "4M"]).ok();
    let refused = fb(&pool, &["volume", "import", "tiny", path_str(&image)]).error();
    assert!(refused.contains("smaller"), "{refused}");

    // An image that is not a multiple of 4 KiB becomes a volume rounded up to 4 KiB.
    let odd = dir.join("odd");
    std::fs::write(&odd, vec![7u8; 10_000]).expect("write");
    fb(&pool, &["volume", "import", "odd", path_str(&odd)]).ok();
    let list = fb(&pool, &["volume", "list", "--json"]).ok().json();
    let odd_size = list
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "odd")
        .and_then(|v| v["size_bytes"].as_u64());
    assert_eq!(odd_size, Some(12_288), "{list:#}");
    let out = dir.join("odd.out");
    fb(&pool, &["volume", "export", "odd", path_str(&out)]).ok();
    let bytes = std::fs::read(&out).expect("read export");
    assert_eq!(bytes.len(), 12_288);
    assert!(bytes[..10_000].iter().all(|&b| b == 7));
    assert!(bytes[10_000..].iter().all(|&b| b == 0));
}

// ---------------------------------------------------------------------------------
// Metadata placement

#[test]
fn list_metadata_names_every_region_and_its_device() {
    let dir = TempDir::new("regions");
    let pool = create_pool(&dir, &["--size", "1G"]);
    let regions = fb(&pool, &["list-metadata", "--json"]).ok().json();
    let names: Vec<String> = regions
        .as_array()
        .expect("array")
        .iter()
        .map(|r| r["name"].as_str().unwrap_or_default().to_lowercase())
        .collect();
    for wanted in ["super", "journal", "page store"] {
        assert!(
            names.iter().any(|n| n.contains(wanted)),
            "no {wanted} region: {names:?}"
        );
    }
    let table = fb(&pool, &["list-metadata"]).ok().stdout();
    let header = table.lines().next().unwrap_or_default();
    for column in ["Region", "Device", "Path", "Blocks", "Size"] {
        assert!(header.contains(column), "missing column {column}: {table}");
    }
    assert!(table.contains(path_str(&pool)), "{table}");
}

#[test]
fn with_a_metadata_device_the_data_device_holds_only_data() {
    let dir = TempDir::new("metadev");
    let meta = dir.join("meta");
    let pool = create_pool(
        &dir,
        &[
            "--size",
            "2G",
            "--metadata-device",
            path_str(&meta),
            "--metadata-size",
            "256M",
        ],
    );
    let regions = fb(&pool, &["list-metadata", "--json"]).ok().json();
    let regions = regions.as_array().expect("array").clone();
    for region in &regions {
        let name = region["name"].as_str().unwrap_or_default().to_lowercase();
        if region["device"] == "data" {
            assert!(
                name.contains("label") || name.contains("data"),
                "metadata region '{name}' is on the data device: {regions:#?}"
            );
        } else {
            assert_eq!(region["path"].as_str(), Some(path_str(&meta)), "{region:#}");
        }
    }
    for wanted in ["super", "journal", "page"] {
        assert!(
            regions.iter().any(|r| r["device"] == "metadata"
                && r["name"].as_str().unwrap_or_default().contains(wanted)),
            "no {wanted} region on the metadata device: {regions:#?}"
        );
    }

    let image = dir.join("image");
    let image_bytes = 64 * MIB;
    write_mixed_image(&image, image_bytes, SEED + 2);
    fb(&pool, &["volume", "import", "a", path_str(&image)]).ok();
    fb(&pool, &["volume", "import", "b", path_str(&image)]).ok();
    let exported = dir.join("b.out");
    fb(&pool, &["volume", "export", "b", path_str(&exported)]).ok();
    assert_same_bytes(&image, &exported);
    fb(&pool, &["check"]).ok();

    // Device counters are per open, so write through a server and read its stats.
    let mut server = Server::start(&dir, &pool, &[]);
    let uri = format!("nbd+unix:///c?socket={}", server.socket.display());
    fb(
        &pool,
        &["volume", "create", "c", "--size", &image_bytes.to_string()],
    )
    .ok();
    let mut convert = Command::new("qemu-img");
    convert.args([
        "convert",
        "-n",
        "-f",
        "raw",
        "-O",
        "raw",
        path_str(&image),
        &uri,
    ]);
    run(convert).ok();
    let stats = stats_json(&pool);
    let data_written = u64_at(&stats["data_device"], "write_bytes");
    let metadata_written = u64_at(&stats["metadata_device"], "write_bytes");
    let data_used = u64_at(&stats, "stored_bytes");
    assert!(metadata_written > 0, "no metadata written: {stats:#}");
    assert!(
        data_written <= data_used + data_used / 10 + MIB,
        "the data device received {data_written} bytes for {data_used} bytes of data: {stats:#}"
    );
    // Every metadata byte the engine wrote, by region, reached the metadata device.
    let by_region: u64 = stats["metadata_written_by_region"]
        .as_array()
        .expect("metadata_written_by_region")
        .iter()
        .map(|pair| pair[1].as_u64().unwrap_or(0))
        .sum();
    assert!(by_region > 0, "no metadata region was written: {stats:#}");
    assert!(
        metadata_written >= by_region,
        "the metadata device received {metadata_written} bytes but the regions wrote {by_region}: {stats:#}"
    );
    assert_eq!(server.stop(), Some(0), "{}", server.log_text());
}

// ---------------------------------------------------------------------------------
// A served pool: control socket, lock, signals

#[test]
fn a_served_pool_is_managed_through_its_control_socket() {
    let dir = TempDir::new("ctl");
    let pool = create_pool(&dir, &["--size", "1G"]);
    fb(&pool, &["volume", "create", "base", "--size", "64M"]).ok();
    let mut server = Server::start(&dir, &pool, &[]);
    let control = server.control_socket();
    let mode = std::fs::metadata(&control)
        .expect("control socket")
        .permissions();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
        0o600,
        "the control socket must be owner-only"
    );

    fb(&pool, &["volume", "create", "live", "--size", "32M"]).ok();
    fb(&pool, &["volume", "clone", "base", "copy"]).ok();
    fb(&pool, &["volume", "resize", "live", "--size", "48M"]).ok();
    let mut names = volume_names(&pool);
    names.sort();
    assert_eq!(names, vec!["base", "copy", "live"]);

    // The server sees them at once.
    let uri = format!("nbd+unix:///?socket={}", server.socket.display());
    let listed = run({
        let mut cmd = Command::new("nbdinfo");
        cmd.args(["--list", "--json", &uri]);
        cmd
    })
    .ok()
    .json();
    let exports: Vec<&str> = listed["exports"]
        .as_array()
        .expect("exports")
        .iter()
        .filter_map(|e| e["export-name"].as_str())
        .collect();
    for name in ["base", "copy", "live"] {
        assert!(
            exports.contains(&name),
            "nbdinfo does not list {name}: {listed:#}"
        );
    }

    fb(&pool, &["volume", "delete", "copy"]).ok();
    let missing = fb(&pool, &["volume", "delete", "copy"]).error();
    assert!(missing.contains("copy"), "{missing}");
    let stats = stats_json(&pool);
    assert_eq!(
        stats["volumes"].as_array().map(Vec::len),
        Some(2),
        "{stats:#}"
    );
    // Served, the stats carry the NBD server's gauges and named limits too.
    assert!(stats["nbd_server"]["connections"].is_u64(), "{stats:#}");
    let limits = stats["nbd_server"]["limits"]
        .as_array()
        .expect("nbd_server.limits");
    assert!(!limits.is_empty(), "{stats:#}");
    let verbose = fb(&pool, &["stats", "--verbose"]).ok().stdout();
    assert!(verbose.contains("nbd_server.limits."), "{verbose}");
    fb(&pool, &["list-metadata"]).ok();
    fb(&pool, &["check"]).ok();
    fb(&pool, &["pool", "info"]).ok();

    // Import and export belong to NBD while served.
    let image = dir.join("image");
    std::fs::write(&image, vec![1u8; 8192]).expect("write");
    let refused = fb(&pool, &["volume", "import", "base", path_str(&image)]).error();
    assert!(refused.contains("served"), "{refused}");
    assert!(
        refused.contains("qemu-img"),
        "the refusal says what to use: {refused}"
    );

    assert_eq!(server.stop(), Some(0), "{}", server.log_text());
    assert!(!control.exists(), "the control socket outlived the server");
    assert!(
        !server.socket.exists(),
        "the NBD socket outlived the server"
    );
    let mut names = volume_names(&pool);
    names.sort();
    assert_eq!(
        names,
        vec!["base", "live"],
        "changes made while serving were lost"
    );
}

#[test]
fn a_second_opener_is_told_who_holds_the_pool_and_a_stale_socket_is_ignored() {
    let dir = TempDir::new("lock");
    let pool = create_pool(&dir, &["--size", "1G"]);
    fb(&pool, &["volume", "create", "vm", "--size", "16M"]).ok();
    let mut server = Server::start(&dir, &pool, &[]);
    // Without its control socket the server still holds the pool's lock.
    std::fs::remove_file(server.control_socket()).expect("remove control socket");
    let refused = fb(&pool, &["volume", "list"]).error();
    let pid = server.pid().to_string();
    assert!(
        refused.contains(&pid)
            || refused.to_lowercase().contains("held")
            || refused.contains("lock"),
        "the error should name the holder (pid {pid}): {refused}"
    );

    // A killed server leaves a stale control socket: commands remove it and go on.
    server.kill9();
    std::os::unix::net::UnixListener::bind(server.control_socket()).expect("fake stale socket");
    assert_eq!(volume_names(&pool), vec!["vm".to_string()]);
    assert!(
        !server.control_socket().exists(),
        "the stale control socket was kept"
    );
    fb(&pool, &["check"]).ok();
}

#[test]
fn serve_without_a_pool_creates_a_default_one_and_serves_disk0() {
    let dir = TempDir::new("default");
    let log = dir.join("serve.log");
    let log_file = File::create(&log).expect("log");
    let mut cmd = Command::new(FEWERBYTES);
    cmd.current_dir(&dir.0)
        .env_remove("FEWERBYTES_POOL")
        .env_remove("FEWERBYTES_LOG")
        .args(["serve", "--no-tcp"])
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().expect("clone"))
        .stderr(log_file);
    let child = cmd.spawn().expect("start serve");
    let mut server = Server {
        child: Some(child),
        pool: dir.join("fewerbytes.pool"),
        socket: dir.join("fewerbytes.pool.sock"),
        log,
    };
    server.wait_ready();
    let banner = server.log_text();
    assert!(banner.contains("disk0"), "{banner}");
    assert!(banner.contains("nbd+unix:///disk0?socket="), "{banner}");
    assert!(banner.contains("qemu-img info"), "{banner}");

    let uri = format!("nbd+unix:///?socket={}", server.socket.display());
    let info = run({
        let mut cmd = Command::new("nbdinfo");
        cmd.args(["--json", &uri]);
        cmd
    })
    .ok()
    .json();
    let size = info["exports"][0]["export-size"]
        .as_u64()
        .expect("export-size");
    assert!(
        size > 8 << 30,
        "disk0 should fill the 16 GiB pool: {info:#}"
    );
    assert!(size.is_multiple_of(MIB), "disk0 is whole MiB: {info:#}");
    let sparse_bytes = std::fs::metadata(&server.pool).expect("pool");
    assert_eq!(
        sparse_bytes.len(),
        16 << 30,
        "the default pool is a 16 GiB file"
    );

    server.signal(libc::SIGINT);
    let started = Instant::now();
    let mut child = server.child.take().expect("running");
    let status = loop {
        if let Some(status) = child.try_wait().expect("poll") {
            break status;
        }
        assert!(started.elapsed() < SERVER_LIMIT, "serve ignored SIGINT");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{}", server.log_text());
}

#[test]
fn the_pool_can_be_named_by_environment() {
    let dir = TempDir::new("env");
    let pool = create_pool(&dir, &["--size", "256M"]);
    fb(&pool, &["volume", "create", "envvol", "--size", "8M"]).ok();
    let mut cmd = Command::new(FEWERBYTES);
    cmd.env("FEWERBYTES_POOL", &pool)
        .env_remove("FEWERBYTES_LOG")
        .current_dir(&dir.0)
        .args(["volume", "list"])
        .stdin(Stdio::null());
    let listed = run(cmd).ok();
    assert!(listed.stdout().contains("envvol"), "{}", listed.report());
}

/// The committed version-1 pool image of the engine's fixture test, expanded to a
/// 64 MiB pool file (the fixture holds (offset, block) records of its nonzero blocks).
fn v1_pool_file(dir: &TempDir) -> PathBuf {
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../engine/tests/fixtures/pool-v1.blocks"
    );
    let raw = std::fs::read(fixture).expect("v1 fixture present");
    let mut image = vec![0u8; 64 << 20];
    for rec in raw.chunks(8 + BLOCK) {
        let at = u64::from_le_bytes(rec[..8].try_into().expect("8 bytes")) as usize;
        image[at..at + BLOCK].copy_from_slice(&rec[8..]);
    }
    let pool = dir.join("pool");
    std::fs::write(&pool, &image).expect("write pool file");
    pool
}

fn format_version(pool: &Path) -> u64 {
    u64_at(
        &fb(pool, &["pool", "info", "--json"]).ok().json(),
        "format_version",
    )
}

#[test]
fn inspecting_a_v1_pool_leaves_it_unchanged_and_a_write_upgrades_it() {
    let dir = TempDir::new("v1");
    let pool = v1_pool_file(&dir);
    let before = std::fs::read(&pool).expect("read pool");
    assert_eq!(format_version(&pool), 1);
    let listed = fb(&pool, &["volume", "list"]).ok().stdout();
    assert!(
        listed.contains("base") && listed.contains("clone"),
        "{listed}"
    );
    fb(&pool, &["stats"]).ok();
    fb(&pool, &["check"]).ok();
    fb(&pool, &["list-metadata"]).ok();
    let info = fb(&pool, &["pool", "info"]).ok().stdout();
    assert!(info.contains("Format version:"), "{info}");
    assert!(
        std::fs::read(&pool).expect("read pool") == before,
        "an inspection wrote to the pool"
    );
    assert_eq!(format_version(&pool), 1);

    fb(&pool, &["volume", "create", "new", "--size", "4M"]).ok();
    assert_eq!(
        format_version(&pool),
        2,
        "a volume change upgrades the pool"
    );
    assert_eq!(volume_names(&pool), ["base", "clone", "new"]);
    fb(&pool, &["check"]).ok();
}

#[test]
fn serving_a_v1_pool_upgrades_it_and_pool_info_names_who_holds_it() {
    let dir = TempDir::new("v1serve");
    let pool = v1_pool_file(&dir);
    let mut server = Server::start(&dir, &pool, &[]);
    let pid = server.pid().to_string();
    let info = fb(&pool, &["pool", "info"]).ok().stdout();
    assert!(
        info.contains("held by host") && info.contains(&format!("pid {pid} ")),
        "{info}"
    );
    // The time is one people read: ISO 8601 in UTC, and --json keeps the number
    // beside the same instant written so. On main: "since 1796225834 (unix time)".
    let since = iso8601_after(&info, " since ");
    let json = fb(&pool, &["pool", "info", "--json"]).ok().stdout();
    let json: serde_json::Value = serde_json::from_str(&json).expect("pool info --json");
    let marker = &json["open_marker"];
    assert!(marker["since_unix"].as_u64().is_some(), "{json}");
    assert_eq!(marker["since_iso"].as_str(), Some(since.as_str()), "{json}");
    assert_eq!(format_version(&pool), 2, "serving upgrades the pool");
    // A server killed leaves its marker: the next look says so.
    server.kill9();
    let info = fb(&pool, &["pool", "info"]).ok().stdout();
    assert!(
        info.contains("last opened by host") && info.contains("not closed cleanly"),
        "{info}"
    );
    assert!(info.contains(&format!("pid {pid} ")), "{info}");
    assert_eq!(iso8601_after(&info, " at "), since, "{info}");
    fb(&pool, &["check"]).ok();
    assert_eq!(format_version(&pool), 2);
}

/// The time written after `word` on the `Open by:` line of `text`, checked to be ISO 8601 in UTC
/// (`2026-12-02T19:45:00Z`) and not a count of seconds.
fn iso8601_after(text: &str, word: &str) -> String {
    let line = text
        .lines()
        .find(|line| line.starts_with("Open by:"))
        .unwrap_or_else(|| panic!("no 'Open by:' line in:\n{text}"));
    let at = line
        .find(word)
        .unwrap_or_else(|| panic!("no '{word}' in:\n{line}"))
        + word.len();
    let time: String = line[at..].chars().take(20).collect();
    let shape_ok = time.len() == 20
        && time.char_indices().all(|(i, c)| match i {
            4 | 7 => c == '-',
            10 => c == 'T',
            13 | 16 => c == ':',
            19 => c == 'Z',
            _ => c.is_ascii_digit(),
        });
    assert!(
        shape_ok,
        "not ISO 8601 after '{word}': {time:?} in:\n{text}"
    );
    assert!(!text.contains("unix time"), "{text}");
    time
}

/// `stats --verbose` counts a device once: with no metadata device of its own, the
/// pool's one device shows under `data_device` and `metadata_device` says so, rather
/// than repeating the same counters (as main did); with a separate metadata device,
/// each has its own.
#[test]
fn stats_verbose_counts_each_device_once() {
    let dir = TempDir::new("onedevice");
    let pool = dir.join("pool");
    fb(&pool, &["pool", "create", path_str(&pool), "--size", "64M"]).ok();
    let verbose = fb(&pool, &["stats", "--verbose"]).ok().stdout();
    let lines_of =
        |text: &str, prefix: &str| text.lines().filter(|line| line.starts_with(prefix)).count();
    assert_eq!(
        lines_of(&verbose, "data_device.read_bytes "),
        1,
        "{verbose}"
    );
    assert_eq!(lines_of(&verbose, "metadata_device."), 0, "{verbose}");
    let said = verbose
        .lines()
        .find(|line| line.starts_with("metadata_device "))
        .unwrap_or_else(|| panic!("no metadata_device line:\n{verbose}"));
    assert!(said.contains("the data device"), "{said}");

    let split = dir.join("split");
    let meta = dir.join("split.meta");
    fb(
        &split,
        &[
            "pool",
            "create",
            path_str(&split),
            "--size",
            "1G",
            "--metadata-device",
            path_str(&meta),
            "--metadata-size",
            "64M",
        ],
    )
    .ok();
    let verbose = fb(&split, &["stats", "--verbose"]).ok().stdout();
    assert_eq!(
        lines_of(&verbose, "data_device.read_bytes "),
        1,
        "{verbose}"
    );
    assert_eq!(
        lines_of(&verbose, "metadata_device.read_bytes "),
        1,
        "{verbose}"
    );
}
