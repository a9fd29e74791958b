//! Virtual machines on volumes: a Debian guest boots from a fewerbytes volume under
//! QEMU, writes files of known content, prints their checksums on its serial console,
//! runs `fstrim` and powers off; then a template cloned seven times boots seven guests
//! at once against one server (the boot storm).
//!
//! The guest and the private `qemu-system-x86_64` come from `scripts/guest/`
//! (`build-image.sh` builds and caches them under `/var/cache/fewerbytes-test`; the
//! first run on a machine takes a few minutes for debootstrap). QEMU runs under TCG
//! unless KVM runs the guest's kernel here. After each guest powers off, the server is
//! stopped, `fewerbytes check` audits the pool, and the volume is read back through a
//! read-only server, nbdfuse and a read-only loop device: `fsck.ext4 -n` must be clean
//! and every file the guest reported must have the checksum it printed. A guest whose
//! second disk is on a pool that fills pauses (QEMU's `werror=enospc`), and resumes
//! with `cont` over QMP once a volume is deleted.

mod common;

use common::fuse_loop::FuseLoopStack;
use common::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const MIB: u64 = 1024 * 1024;

/// One guest test at a time: each wants every core of a 2-core machine.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Guests in the boot storm.
const STORM_GUESTS: usize = 7;
/// MiB of pseudo-random data (and as much text) each guest's unit writes.
const GUEST_DATA_MIB: u64 = 8;
/// How long the first run may take to build the guest (debootstrap, ~770 MiB).
const BUILD_LIMIT: Duration = Duration::from_secs(40 * 60);
/// How long one guest may take from power-on to power-off under TCG on a loaded
/// 2-core machine (measured ~1 min alone, ~3 min for seven at once).
const GUEST_LIMIT: Duration = Duration::from_secs(20 * 60);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// What `scripts/guest/build-image.sh` built.
struct GuestImage {
    image: PathBuf,
    size: String,
}

/// Builds (or finds cached) the guest image and the private QEMU.
fn guest_image() -> GuestImage {
    for t in ["debootstrap", "mkfs.ext4", "apt-get", "dpkg-deb"] {
        require_guest_tool(t);
    }
    let ran = run_with_limit(
        Command::new(repo_root().join("scripts/guest/build-image.sh")).current_dir(repo_root()),
        BUILD_LIMIT,
    );
    assert!(
        ran.status.success(),
        "scripts/guest/build-image.sh failed:\n{}",
        ran.report()
    );
    let vars: BTreeMap<&str, &str> = ran
        .stdout
        .lines()
        .filter_map(|l| l.split_once('='))
        .collect();
    let get = |k: &str| {
        vars.get(k)
            .unwrap_or_else(|| panic!("build-image.sh printed no {k}=:\n{}", ran.report()))
            .to_string()
    };
    GuestImage {
        image: PathBuf::from(get("IMAGE")),
        size: get("SIZE"),
    }
}

/// Like `require_tool`, for the tools only the guest tests use.
fn require_guest_tool(name: &str) {
    let package = match name {
        "debootstrap" => "debootstrap",
        "apt-get" => "apt",
        "dpkg-deb" => "dpkg",
        "perl" => "perl-base",
        "sha256sum" => "coreutils",
        _ => {
            require_tool(name);
            return;
        }
    };
    let found = ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
        .iter()
        .any(|d| Path::new(d).join(name).is_file());
    assert!(
        found,
        "required tool `{name}` was not found (Debian package `{package}`); .ci/run installs it"
    );
}

/// A pool holding `template` (the guest image) and served, with room for clones.
fn serve_guest_pool(dir: &Path, image: &GuestImage) -> Server {
    let pool = dir.join("vm.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    // Thin clones: seven clones of a 3 GiB disk promise more than the pool holds,
    // though they store little more than the template.
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "8G"]);
    fewerbytes_ok(
        &pool,
        &["volume", "create", "template", "--size", &image.size],
    );
    let image_str = image.image.to_str().expect("utf-8 image path");
    fewerbytes_ok(&pool, &["volume", "import", "template", image_str]);
    Server::start(dir, &pool, &[])
}

/// A guest running: `scripts/guest/boot.sh` with the volume over the unix socket.
struct Guest {
    name: String,
    seed: u64,
    console: PathBuf,
    output: PathBuf,
    child: Option<Child>,
}

impl Guest {
    fn boot(server: &Server, dir: &Path, volume: &str, seed: u64) -> Guest {
        let args = [
            "fb.job=basic".to_string(),
            format!("fb.seed={seed}"),
            format!("fb.mib={GUEST_DATA_MIB}"),
        ];
        Guest::boot_job(server, dir, volume, seed, &args, "")
    }

    /// Boots `volume` with `kernel_args` and more QEMU arguments (`qemu_args`, split
    /// on spaces by boot.sh).
    fn boot_job(
        server: &Server,
        dir: &Path,
        volume: &str,
        seed: u64,
        kernel_args: &[String],
        qemu_args: &str,
    ) -> Guest {
        let console = dir.join(format!("{volume}.console"));
        let output = dir.join(format!("{volume}.qemu"));
        let out = std::fs::File::create(&output).expect("qemu output file");
        let child = Command::new(repo_root().join("scripts/guest/boot.sh"))
            .arg(server.unix_uri(volume))
            .arg(&console)
            .args(kernel_args)
            .env("GUEST_TIMEOUT", GUEST_LIMIT.as_secs().to_string())
            .env("GUEST_QEMU_ARGS", qemu_args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("clone"))
            .stderr(out)
            .spawn()
            .expect("start scripts/guest/boot.sh");
        Guest {
            name: volume.to_string(),
            seed,
            console,
            output,
            child: Some(child),
        }
    }

    /// Whether QEMU has exited.
    fn exited(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => child.try_wait().ok().flatten().is_some(),
            None => true,
        }
    }

    /// The serial console so far.
    fn console_text(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.console).unwrap_or_default()).into_owned()
    }

    /// Waits for QEMU to exit (the guest powered off); fails past `deadline`.
    fn wait(&mut self, deadline: Instant) -> Console {
        let child = self.child.as_mut().expect("guest running");
        let status = loop {
            if let Some(status) = child.try_wait().expect("poll qemu") {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "guest {} did not power off in time.\n{}",
                self.name,
                self.describe()
            );
            std::thread::sleep(Duration::from_millis(200));
        };
        self.child = None;
        assert!(
            status.success(),
            "QEMU for guest {} exited with {status}.\n{}",
            self.name,
            self.describe()
        );
        let console = Console::parse(&std::fs::read(&self.console).unwrap_or_default());
        assert!(
            console.started,
            "guest {} never ran its test unit.\n{}",
            self.name,
            self.describe()
        );
        assert!(
            console.done && !console.failed,
            "guest {}'s test unit did not finish cleanly.\n{}",
            self.name,
            self.describe()
        );
        console
    }

    /// QEMU's own output and the end of the serial console, for a failure message.
    fn describe(&self) -> String {
        let qemu = std::fs::read_to_string(&self.output).unwrap_or_default();
        let console =
            String::from_utf8_lossy(&std::fs::read(&self.console).unwrap_or_default()).into_owned();
        let tail: Vec<&str> = console.lines().rev().take(60).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        format!(
            "--- QEMU ({}) ---\n{qemu}\n--- console ({}), last 60 lines ---\n{}",
            self.output.display(),
            self.console.display(),
            tail.join("\n")
        )
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // boot.sh execs `timeout`, which passes SIGTERM on to QEMU (a SIGKILL would
            // leave QEMU running without it).
            if let Ok(pid) = libc::pid_t::try_from(child.id()) {
                // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
            for _ in 0..100 {
                if child.try_wait().ok().flatten().is_some() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// What the guest's unit printed on the console.
#[derive(Debug, Default)]
struct Console {
    started: bool,
    done: bool,
    failed: bool,
    /// (path in the guest, sha256) of each file it wrote.
    sums: Vec<(String, String)>,
    /// Bytes `fstrim -v /` reported.
    trimmed_bytes: Option<u64>,
}

impl Console {
    fn parse(raw: &[u8]) -> Console {
        let text = String::from_utf8_lossy(raw);
        let mut c = Console::default();
        for line in text.lines() {
            // The console may put terminal resets ahead of a line: read from the marker.
            let Some(at) = line.find("FEWERBYTES-") else {
                continue;
            };
            let line = line[at..].trim_end_matches('\r');
            if let Some(rest) = line.strip_prefix("FEWERBYTES-GUEST ") {
                c.started |= rest.starts_with("start");
                c.done |= rest.starts_with("done");
                c.failed |= rest.starts_with("FAILED");
            } else if let Some(rest) = line.strip_prefix("FEWERBYTES-SHA256 ") {
                if let Some((sum, path)) = rest.split_once(' ') {
                    c.sums.push((path.to_string(), sum.to_string()));
                }
            } else if let Some(rest) = line.strip_prefix("FEWERBYTES-FSTRIM ") {
                // "/: 1.2 GiB (1288490188 bytes) trimmed on /dev/vda"
                c.trimmed_bytes = rest
                    .split_once('(')
                    .and_then(|(_, r)| r.split_once(" bytes)"))
                    .and_then(|(n, _)| n.parse().ok());
            }
        }
        c
    }
}

/// sha256 of what `sh -c SCRIPT` prints.
fn sha256_of_output(script: &str) -> String {
    let ran = run_ok(
        Command::new("/bin/sh")
            .arg("-c")
            .arg(format!("({script}) | sha256sum")),
    );
    ran.stdout
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// The checksums the guest's files must have, computed here the way the guest's
/// unit made them (scripts/guest/rootfs/fewerbytes-guest-test).
fn expected_sums(seed: u64) -> BTreeMap<&'static str, String> {
    require_guest_tool("perl");
    let prng = format!(
        "perl -e 'srand($ARGV[0]); my $words = $ARGV[1] * 262144; my $buf = \"\";
            for (1 .. $words) {{ $buf .= pack(\"V\", int(rand(4294967296)));
                if (length($buf) >= 1048576) {{ print $buf; $buf = \"\"; }} }} print $buf;' {seed} {GUEST_DATA_MIB}"
    );
    let text = format!(
        "yes 'fewerbytes guest seed {seed}' | head -c {}",
        GUEST_DATA_MIB * MIB
    );
    BTreeMap::from([
        ("/fewerbytes-test/random.bin", sha256_of_output(&prng)),
        ("/fewerbytes-test/text.txt", sha256_of_output(&text)),
    ])
}

/// Checks what the guest printed against what it should have written.
fn check_console(guest: &Guest, console: &Console) {
    let expected = expected_sums(guest.seed);
    for (path, sum) in &expected {
        let printed = console.sums.iter().find(|(p, _)| p == path);
        assert_eq!(
            printed.map(|(_, s)| s.as_str()),
            Some(sum.as_str()),
            "guest {}: checksum of {path} on the console differs from the expected one.\n{}",
            guest.name,
            guest.describe()
        );
    }
    assert!(
        console.sums.iter().any(|(p, _)| p.ends_with(".sums")),
        "guest {}: no checksum list of the copied files on the console.\n{}",
        guest.name,
        guest.describe()
    );
    let trimmed = console.trimmed_bytes.unwrap_or(0);
    assert!(
        trimmed > 0,
        "guest {}: fstrim trimmed nothing (or printed no FEWERBYTES-FSTRIM line).\n{}",
        guest.name,
        guest.describe()
    );
}

/// Reads `volume` back through a read-only server + nbdfuse + read-only loop device:
/// `fsck.ext4 -n` must be clean and every file the guest reported must have the
/// checksum it printed (for a `.sums` list, every file in it).
fn verify_volume_offline(server: &Server, dir: &Path, volume: &str, console: &Console) {
    for t in [
        "nbdfuse",
        "losetup",
        "fsck.ext4",
        "mount",
        "umount",
        "sha256sum",
    ] {
        require_guest_tool(t);
    }
    assert!(
        Path::new("/dev/fuse").exists(),
        "/dev/fuse is missing: nbdfuse needs FUSE"
    );
    let mut stack = FuseLoopStack::start(dir, volume, &server.unix_uri(volume), true);
    let dev = stack.dev();
    let mount_dir = stack.mount_dir.clone();

    let fsck = run_with_limit(tool("fsck.ext4").args(["-n", "-f", &dev]), CLIENT_LIMIT);
    assert!(
        fsck.status.success(),
        "volume {volume}: fsck.ext4 -n found problems after the guest powered off:\n{}",
        fsck.report()
    );

    run_ok(
        tool("mount")
            .args(["-o", "ro,noload"])
            .arg(&dev)
            .arg(&mount_dir),
    );
    stack.mounted = true;
    for (path, sum) in &console.sums {
        let host_path = mount_dir.join(path.trim_start_matches('/'));
        let ran = run_ok(tool("sha256sum").arg(&host_path));
        let got = ran.stdout.split_whitespace().next().unwrap_or_default();
        assert_eq!(
            got, sum,
            "volume {volume}: {path} read back after poweroff differs from what the guest wrote"
        );
        if let Some(copy) = path.strip_suffix(".sums") {
            // The guest's copy of a directory: every file in it, by its list.
            let ran = run_with_limit(
                tool("sha256sum")
                    .args(["-c", "--quiet"])
                    .arg(&host_path)
                    .current_dir(mount_dir.join(copy.trim_start_matches('/'))),
                CLIENT_LIMIT,
            );
            assert!(
                ran.status.success(),
                "volume {volume}: files of {copy} read back after poweroff differ:\n{}",
                ran.report()
            );
        }
    }
    drop(stack);
}

fn counter(stats: &serde_json::Value, name: &str) -> u64 {
    stats["counters"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("stats --json has no counters.{name}: {stats}"))
}

fn stored_bytes(stats: &serde_json::Value) -> u64 {
    stats["stored_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("stats --json has no stored_bytes: {stats}"))
}

/// Stops the server, audits the pool, and serves it again read-only.
fn check_and_serve_read_only(server: &mut Server, dir: &Path) -> Server {
    let status = server.stop();
    assert!(
        status.success(),
        "server exited with {status} after SIGTERM\n{}",
        server.log_text()
    );
    let ran = fewerbytes(&server.pool, &["check"]);
    assert!(
        ran.status.success(),
        "`fewerbytes check` after the guests powered off failed:\n{}",
        ran.report()
    );
    let ro_dir = dir.join("ro");
    std::fs::create_dir_all(&ro_dir).expect("mkdir ro");
    Server::start(&ro_dir, &server.pool, &["--read-only"])
}

#[test]
fn guest_boots_from_a_volume_writes_trims_and_powers_off() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let image = guest_image();
    let dir = TempDir::new("guest");
    let mut server = serve_guest_pool(dir.path(), &image);
    server.cli_ok(&["volume", "clone", "template", "vm1", "--thin"]);
    let before = server.stats();

    let mut guest = Guest::boot(&server, dir.path(), "vm1", 1);
    let console = guest.wait(Instant::now() + GUEST_LIMIT);
    check_console(&guest, &console);

    // What reached the server: the unit's files (two of GUEST_DATA_MIB and a copy of
    // /usr/bin) as writes, and the fstrim of the deleted scratch file and free space.
    let after = server.stats();
    let written = counter(&after, "guest_bytes_written") - counter(&before, "guest_bytes_written");
    let trimmed = counter(&after, "trimmed_bytes") - counter(&before, "trimmed_bytes");
    assert!(
        written >= 2 * GUEST_DATA_MIB * MIB,
        "the server counted {written} bytes written by the guest, less than its files"
    );
    assert!(
        trimmed >= 32 * MIB,
        "the server counted {trimmed} bytes trimmed; the guest deleted a 32 MiB file and ran fstrim"
    );

    let ro = check_and_serve_read_only(&mut server, dir.path());
    verify_volume_offline(&ro, dir.path(), "vm1", &console);
}

#[test]
fn boot_storm_seven_clones_of_a_template_boot_at_once() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let image = guest_image();
    let dir = TempDir::new("storm");
    let mut server = serve_guest_pool(dir.path(), &image);
    let names: Vec<String> = (1..=STORM_GUESTS).map(|i| format!("vm{i}")).collect();
    for name in &names {
        server.cli_ok(&["volume", "clone", "template", name, "--thin"]);
    }
    let before = server.stats();
    let template_bytes = stored_bytes(&before);

    let mut guests: Vec<Guest> = names
        .iter()
        .zip(1u64..)
        .map(|(name, seed)| Guest::boot(&server, dir.path(), name, seed))
        .collect();
    let deadline = Instant::now() + GUEST_LIMIT;
    let consoles: Vec<Console> = guests.iter_mut().map(|g| g.wait(deadline)).collect();
    for (guest, console) in guests.iter().zip(&consoles) {
        check_console(guest, console);
    }

    // The clones share the template: seven guests booting and writing their files
    // add what they wrote that is new (the pseudo-random file, logs), far less than
    // one more copy of the template.
    let after = server.stats();
    let added = stored_bytes(&after).saturating_sub(template_bytes);
    let written = counter(&after, "guest_bytes_written") - counter(&before, "guest_bytes_written");
    eprintln!(
        "boot storm: template {template_bytes} data bytes; {STORM_GUESTS} guests wrote {written} bytes; \
         data grew by {added} bytes"
    );
    assert!(
        added < template_bytes,
        "{STORM_GUESTS} clones added {added} data bytes, more than the template's {template_bytes}"
    );
    assert!(
        added < written,
        "{STORM_GUESTS} guests wrote {written} bytes and the pool's data grew by {added}: no dedup"
    );

    let ro = check_and_serve_read_only(&mut server, dir.path());
    for (name, console) in names.iter().zip(&consoles) {
        verify_volume_offline(&ro, dir.path(), name, console);
    }
}

/// A QMP client on QEMU's monitor socket: commands and their answers, and the
/// events that arrive between them.
struct Qmp {
    reader: std::io::BufReader<std::os::unix::net::UnixStream>,
    writer: std::os::unix::net::UnixStream,
    events: Vec<serde_json::Value>,
}

impl Qmp {
    /// Connects once QEMU listens (it makes the socket as it starts), and leaves
    /// capabilities negotiation mode.
    fn connect(path: &Path, guest: &mut Guest, deadline: Instant) -> Qmp {
        let stream = loop {
            if let Ok(stream) = std::os::unix::net::UnixStream::connect(path) {
                break stream;
            }
            assert!(
                !guest.exited() && Instant::now() < deadline,
                "QEMU's QMP socket {} never answered.\n{}",
                path.display(),
                guest.describe()
            );
            std::thread::sleep(Duration::from_millis(200));
        };
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .expect("QMP read timeout");
        let mut qmp = Qmp {
            reader: std::io::BufReader::new(stream.try_clone().expect("clone QMP stream")),
            writer: stream,
            events: Vec::new(),
        };
        let greeting = qmp.read_line().expect("QMP greeting");
        assert!(
            greeting.get("QMP").is_some(),
            "not a QMP greeting: {greeting}"
        );
        qmp.execute("qmp_capabilities").expect("qmp_capabilities");
        qmp
    }

    fn read_line(&mut self) -> Option<serde_json::Value> {
        use std::io::BufRead;
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(n) if n > 0 => serde_json::from_str(&line).ok(),
            _ => None,
        }
    }

    /// Runs `command`; its `return` value, or `None` once QEMU is gone.
    fn execute(&mut self, command: &str) -> Option<serde_json::Value> {
        use std::io::Write;
        let request = format!("{{\"execute\": \"{command}\"}}\n");
        self.writer.write_all(request.as_bytes()).ok()?;
        loop {
            let answer = self.read_line()?;
            if answer.get("event").is_some() {
                self.events.push(answer);
                continue;
            }
            if let Some(value) = answer.get("return") {
                return Some(value.clone());
            }
            panic!("QMP {command} failed: {answer}");
        }
    }

    /// `query-status`'s status ("running", "io-error", ...), or `None` once QEMU is gone.
    fn status(&mut self) -> Option<String> {
        let status = self.execute("query-status")?;
        Some(status["status"].as_str().unwrap_or_default().to_string())
    }
}

/// Writes `argv[2]` MiB of random bytes to the export at `argv[1]` and flushes.
const RANDOM_WRITE_PY: &str = r#"
import os, sys, nbd
h = nbd.NBD()
h.connect_uri(sys.argv[1])
for i in range(int(sys.argv[2])):
    h.pwrite(os.urandom(1 << 20), i << 20)
h.flush()
"#;

/// MiB of random data the guest writes to its disk on the small pool: more than is
/// free while `filler` holds its data, less than is free once it is deleted.
const ENOSPC_GUEST_MIB: u64 = 48;
/// MiB of random data `filler` holds.
const FILLER_MIB: u64 = 48;

#[test]
fn a_guest_on_a_full_pool_pauses_on_enospc_and_resumes_after_a_delete() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let image = guest_image();
    let dir = TempDir::new("enospc");
    let server = serve_guest_pool(dir.path(), &image);
    server.cli_ok(&["volume", "clone", "template", "vm1", "--thin"]);

    // The guest's second disk is on a small pool (96 MiB, 85 MiB of it for data)
    // that `filler` already half fills with random data.
    let small_dir = dir.join("small");
    std::fs::create_dir_all(&small_dir).expect("mkdir small");
    let small = small_dir.join("small.pool");
    let small_str = small.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&small, &["pool", "create", small_str, "--size", "96M"]);
    fewerbytes_ok(
        &small,
        &["volume", "create", "data", "--size", "256M", "--thin"],
    );
    fewerbytes_ok(
        &small,
        &["volume", "create", "filler", "--size", "64M", "--thin"],
    );
    let mut small_server = Server::start(&small_dir, &small, &[]);
    common::libnbd::python_nbd(
        RANDOM_WRITE_PY,
        &[&small_server.unix_uri("filler"), &FILLER_MIB.to_string()],
    );

    // QEMU's defaults spelled out: a write that fails with ENOSPC stops the VM
    // (werror=enospc), any other error goes to the guest.
    let qmp_path = dir.join("qmp.sock");
    let qemu_args = format!(
        "-drive file={},format=raw,if=virtio,cache=none,werror=enospc \
         -qmp unix:{},server=on,wait=off",
        small_server.unix_uri("data"),
        qmp_path.display()
    );
    let kernel_args = [
        "fb.job=enospc".to_string(),
        format!("fb.mib={ENOSPC_GUEST_MIB}"),
    ];
    let mut guest = Guest::boot_job(&server, dir.path(), "vm1", 1, &kernel_args, &qemu_args);
    let deadline = Instant::now() + GUEST_LIMIT;
    let mut qmp = Qmp::connect(&qmp_path, &mut guest, deadline);

    // The pool fills under the guest's write: QEMU pauses it.
    loop {
        let status = qmp.status();
        if status.as_deref() == Some("io-error") {
            break;
        }
        assert!(
            status.is_some() && !guest.exited() && Instant::now() < deadline,
            "the guest did not pause on the full pool (status {status:?}).\n{}",
            guest.describe()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let nospace = qmp.events.iter().find(|e| e["event"] == "BLOCK_IO_ERROR");
    eprintln!("paused on the full pool: {nospace:?}");
    assert!(
        nospace.is_some_and(|e| e["data"]["nospace"] == true && e["data"]["action"] == "stop"),
        "QEMU paused without a BLOCK_IO_ERROR event for ENOSPC: {:?}",
        qmp.events
    );
    let console = guest.console_text();
    assert!(
        console.contains("FEWERBYTES-GUEST filling") && !console.contains("FEWERBYTES-GUEST done"),
        "paused, the guest should be in the middle of its write:\n{}",
        guest.describe()
    );
    assert_eq!(
        small_server.stats()["mode"],
        "normal",
        "a full pool is not latched:\n{}",
        small_server.log_text()
    );

    // Space comes back: a volume deleted through the CLI. `cont` resumes the guest,
    // whose write completes; it must not pause again.
    small_server.cli_ok(&["volume", "delete", "filler"]);
    qmp.execute("cont").expect("cont");
    while !guest.exited() {
        let status = qmp.status();
        assert_ne!(
            status.as_deref(),
            Some("io-error"),
            "the guest paused again after the delete freed {FILLER_MIB} MiB.\n{}",
            guest.describe()
        );
        if status.is_none() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the guest did not finish.\n{}",
            guest.describe()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let console = guest.wait(deadline);
    assert!(
        console.sums.iter().any(|(path, _)| path == "/random.bin"),
        "the guest printed no checksum of its file.\n{}",
        guest.describe()
    );

    // Afterwards, on the host: the pool audits clean, the disk's file system is
    // clean and the file reads back as the guest wrote it.
    let ro = check_and_serve_read_only(&mut small_server, &small_dir);
    verify_volume_offline(&ro, &small_dir, "data", &console);
}
