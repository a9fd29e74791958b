//! How `fewerbytes` is installed and run as a systemd service, checked without a running
//! systemd: the unit through `systemd-analyze verify`; its `ExecStart=` with the example
//! config's environment; `scripts/install.sh` into a DESTDIR; and the unit's sandbox
//! approximated (read-only file system, no capability). Under a real systemd:
//! `scripts/check-service-in-guest.sh` (docs/service.md).

mod common;

use common::service::{
    assert_pool_reopens_clean, lines_at, nbd_greets_on_tcp, nbd_greets_on_unix, Manager, Serve,
    READY_LIMIT, STOP_LIMIT,
};
use common::{create_pool, free_port, qemu_io, run_with_limit, TempDir};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// What the unit's sandbox takes away, approximated without systemd: a mount namespace
/// where everything but the test's directory (pool and sockets) is read-only, like
/// `ProtectSystem=strict` with the state and runtime directories writable, and no
/// capability at all with no_new_privs, like `CapabilityBoundingSet=` (empty) and
/// `NoNewPrivileges=yes`. The server must serve, take volume commands and stop clean.
#[test]
fn serve_needs_no_capability_and_writes_only_its_own_directory() {
    let dir = TempDir::new("sandbox");
    let pool = create_pool(dir.path(), &[("vm1", "16M")]);
    let unshare = common::require_tool("unshare");
    let setpriv = common::require_tool("setpriv");
    let script = format!(
        r#"set -e
mount --bind "$0" "$0"
mount -o remount,bind,ro /
parent=$(findmnt -n -o TARGET --target "$(dirname "$0")")
[ "$parent" = / ] || mount -o remount,bind,ro "$parent"
if touch "$(dirname "$0")/fb-sandbox-probe" 2>/dev/null; then
    echo "the sandbox leaves $(dirname "$0") writable" >&2; exit 97
fi
exec {setpriv} --bounding-set=-all --inh-caps=-all --no-new-privs -- "$@""#,
        setpriv = setpriv.display()
    );
    let dir_text = dir.path().to_str().expect("utf-8").to_string();
    let wrapper = [
        unshare.to_str().expect("utf-8"),
        "--mount",
        "sh",
        "-c",
        &script,
        &dir_text,
    ];
    let mut serve = Serve::spawn_under(&wrapper, dir.path(), &pool, free_port(), &[], &[], "serve");
    serve.wait_listening();
    let caps = std::fs::read_to_string(format!("/proc/{}/status", serve.pid())).expect("status");
    assert!(
        caps.lines().any(|l| l == "CapEff:\t0000000000000000"),
        "the server runs without capabilities:\n{caps}"
    );
    qemu_io(&serve.unix_uri("vm1"), &["write -P 0x66 0 4M".into()]);
    let cloned = serve.cli(&["volume", "clone", "vm1", "vm2"]);
    assert!(
        cloned.status.success(),
        "{}\n{}",
        cloned.report(),
        serve.logs()
    );
    serve.signal(libc::SIGTERM);
    let exit = serve.wait_exit(STOP_LIMIT, "SIGTERM");
    assert_eq!(exit.code(), Some(0), "{}", serve.logs());
    assert_pool_reopens_clean(&pool);
    let mut again = Serve::spawn(dir.path(), &pool, free_port(), &[], &[], "again");
    again.wait_listening();
    qemu_io(&again.unix_uri("vm2"), &["read -P 0x66 0 4M".into()]);
}

/// `KEY=value` lines of an EnvironmentFile, comments and blank lines left out.
fn environment_file(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .filter_map(|line| line.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The unit's `ExecStart=` as systemd expands it for instance `vms`: `%i` replaced,
/// `$VAR` (unbraced) split into words, with `/run/fewerbytes` moved to `run_dir` and the
/// binary to the one under test.
fn exec_start(unit_text: &str, run_dir: &Path, env: &[(String, String)]) -> Vec<String> {
    let line = unit_text
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("the unit has ExecStart=");
    let bin = common::fewerbytes_bin();
    let line = line
        .replace("%i", "vms")
        .replace("/run/fewerbytes", run_dir.to_str().expect("utf-8"))
        .replace("/usr/local/bin/fewerbytes", bin.to_str().expect("utf-8"));
    let mut words = Vec::new();
    for word in line.split_whitespace() {
        match word.strip_prefix('$') {
            Some(name) => {
                let value = env
                    .iter()
                    .rev()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
                    .unwrap_or_default();
                words.extend(value.split_whitespace().map(str::to_string));
            }
            None => words.push(word.to_string()),
        }
    }
    words
}

/// The unit's command line and the example config, as systemd would combine them
/// (EXAMPLE.conf with its pool, address and extra options filled in): ready, serving,
/// reachable by the commands through the control socket, stopped clean.
#[test]
fn the_units_command_line_with_the_example_config_serves_the_pool() {
    let dir = TempDir::new("unitrun");
    let pool = create_pool(dir.path(), &[("vm1", "16M"), ("vm2", "16M")]);
    let run_dir = dir.join("run");
    std::fs::create_dir(&run_dir).expect("mkdir run");
    let unit_text =
        std::fs::read_to_string(repo_root().join("packaging/systemd/fewerbytes@.service"))
            .expect("read the unit");
    let example = std::fs::read_to_string(repo_root().join("packaging/systemd/EXAMPLE.conf"))
        .expect("read the example config");
    let port = free_port();
    // Environment= of the unit first, then the file, which overrides it.
    let mut env: Vec<(String, String)> = unit_text
        .lines()
        .filter_map(|l| l.strip_prefix("Environment="))
        .flat_map(|l| l.split_whitespace())
        .filter_map(|a| a.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    for (key, value) in environment_file(&example) {
        let value = match key.as_str() {
            "FEWERBYTES_POOL" => pool.to_str().expect("utf-8").to_string(),
            "FEWERBYTES_LISTEN" => format!("127.0.0.1:{port}"),
            "FEWERBYTES_SERVE_ARGS" => "--default-volume vm2 --log-level debug".to_string(),
            _ => value,
        };
        env.push((key, value));
    }
    for key in [
        "FEWERBYTES_POOL",
        "FEWERBYTES_LISTEN",
        "FEWERBYTES_SERVE_ARGS",
    ] {
        assert!(env.iter().any(|(k, _)| k == key), "EXAMPLE.conf sets {key}");
    }
    let words = exec_start(&unit_text, &run_dir, &env);
    let manager = Manager::at_path(dir.path());
    let stdout = dir.join("unit.out");
    let stderr = dir.join("unit.err");
    let child = Command::new(&words[0])
        .args(&words[1..])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env("NOTIFY_SOCKET", &manager.address)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&stdout).expect("create"))
        .stderr(std::fs::File::create(&stderr).expect("create"))
        .spawn()
        .expect("start the unit's command");
    let mut serve = Serve {
        pool: pool.clone(),
        socket: run_dir.join("vms.sock"),
        control: run_dir.join("vms.ctl"),
        port,
        stdout,
        stderr,
        child: Some(child),
    };
    let ready = manager.receive(READY_LIMIT, &mut serve, "READY=1");
    assert!(ready.contains("READY=1"), "got {ready:?}");
    assert!(
        nbd_greets_on_unix(&serve.socket) && nbd_greets_on_tcp(port),
        "the unit's sockets: {} and 127.0.0.1:{port}\n{}",
        serve.socket.display(),
        serve.logs()
    );
    // The empty export name is the --default-volume from FEWERBYTES_SERVE_ARGS.
    qemu_io(
        &format!("nbd+unix:///?socket={}", serve.socket.display()),
        &["write -P 0x21 0 1M".into()],
    );
    qemu_io(&serve.tcp_uri("vm2"), &["read -P 0x21 0 1M".into()]);
    let listed = serve.cli(&["volume", "list"]);
    assert!(
        listed.status.success() && listed.stdout.contains("vm2"),
        "{}",
        listed.report()
    );
    assert!(
        lines_at(&serve.stderr_text(), "DEBUG") > 0,
        "--log-level debug from FEWERBYTES_SERVE_ARGS:\n{}",
        serve.logs()
    );
    serve.signal(libc::SIGTERM);
    manager.receive(STOP_LIMIT, &mut serve, "STOPPING=1");
    let exit = serve.wait_exit(STOP_LIMIT, "SIGTERM");
    assert_eq!(exit.code(), Some(0), "{}", serve.logs());
    assert!(
        !serve.socket.exists() && !serve.control.exists(),
        "the clean stop removed /run/fewerbytes/vms.sock and vms.ctl"
    );
}

/// The unit as shipped, checked by systemd's own parser.
#[test]
fn the_systemd_unit_passes_systemd_analyze_verify() {
    let analyze = common::require_tool("systemd-analyze");
    let unit_src = repo_root().join("packaging/systemd/fewerbytes@.service");
    let unit_text = std::fs::read_to_string(&unit_src).expect("read the unit");
    let dir = TempDir::new("unit");
    // verify checks that ExecStart's binary exists: point it at the one under test.
    let bin = common::fewerbytes_bin();
    let unit = dir.join("fewerbytes@.service");
    std::fs::write(
        &unit,
        unit_text.replace("/usr/local/bin/fewerbytes", bin.to_str().expect("utf-8")),
    )
    .expect("write the unit");
    // An instance of the template, as `systemctl start fewerbytes@vms` makes.
    let instance = dir.join("fewerbytes@vms.service");
    std::os::unix::fs::symlink(&unit, &instance).expect("symlink the instance");
    let mut cmd = Command::new(analyze);
    cmd.env("SYSTEMD_LOG_LEVEL", "notice")
        .arg("verify")
        .arg("--man=no")
        .arg(&instance);
    let ran = run_with_limit(&mut cmd, common::CLIENT_LIMIT);
    assert!(ran.status.success(), "{}", ran.report());
    let output = ran.all_output();
    let complaints: Vec<&str> = output
        .lines()
        .filter(|l| l.contains("fewerbytes@"))
        .collect();
    assert!(
        complaints.is_empty(),
        "systemd-analyze has something to say about the unit:\n{}",
        ran.report()
    );
    for required in [
        "Type=notify",
        "KillSignal=SIGTERM",
        "Restart=on-failure",
        "RuntimeDirectory=fewerbytes",
        "ProtectSystem=strict",
        "PrivateTmp=yes",
        "DevicePolicy=closed",
        "--socket /run/fewerbytes/%i.sock",
        "--control-socket /run/fewerbytes/%i.ctl",
        "EnvironmentFile=/etc/fewerbytes/%i.conf",
    ] {
        assert!(
            unit_text.lines().any(|l| l.contains(required)),
            "the unit lacks {required}"
        );
    }
}

#[test]
fn install_sh_puts_binary_unit_and_example_in_a_destdir_and_can_run_twice() {
    let dir = TempDir::new("install");
    let destdir = dir.join("root");
    let run_install = || {
        let mut cmd = Command::new("sh");
        cmd.arg(repo_root().join("scripts/install.sh"))
            .env("DESTDIR", &destdir)
            .env("FEWERBYTES_BIN", common::fewerbytes_bin());
        let ran = run_with_limit(&mut cmd, common::CLIENT_LIMIT);
        assert!(ran.status.success(), "{}", ran.report());
        ran
    };
    run_install();
    let bin = destdir.join("usr/local/bin/fewerbytes");
    let unit = destdir.join("etc/systemd/system/fewerbytes@.service");
    let example = destdir.join("etc/fewerbytes/EXAMPLE.conf");
    let man = destdir.join("usr/local/share/man/man1/fewerbytes-volume-rename.1");
    let completion = destdir.join("usr/local/share/bash-completion/completions/fewerbytes");
    for path in [&bin, &unit, &example, &man, &completion] {
        assert!(
            path.is_file(),
            "install.sh did not install {}",
            path.display()
        );
    }
    assert_eq!(std::fs::metadata(&bin).expect("stat").mode() & 0o777, 0o755);
    let version = run_with_limit(Command::new(&bin).arg("--version"), common::CLIENT_LIMIT);
    assert!(
        version.stdout.starts_with("fewerbytes "),
        "{}",
        version.report()
    );
    let unit_text = std::fs::read_to_string(&unit).expect("read unit");
    assert!(
        unit_text.contains("ExecStart=/usr/local/bin/fewerbytes serve"),
        "{unit_text}"
    );
    let example_text = std::fs::read_to_string(&example).expect("read example");
    assert!(example_text.contains("FEWERBYTES_POOL="), "{example_text}");

    // An admin's own config survives a second run, which changes nothing else.
    let own = destdir.join("etc/fewerbytes/vms.conf");
    std::fs::write(&own, "FEWERBYTES_POOL=/var/lib/fewerbytes/vms.pool\n").expect("write");
    let before = std::fs::read(&unit).expect("read");
    run_install();
    assert_eq!(std::fs::read(&unit).expect("read"), before);
    assert_eq!(
        std::fs::read_to_string(&own).expect("read"),
        "FEWERBYTES_POOL=/var/lib/fewerbytes/vms.pool\n"
    );
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("repository root")
}
