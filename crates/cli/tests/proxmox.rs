//! The Proxmox VE storage plugin (`packaging/proxmox`): its Perl tests, run with
//! `prove` against this build of `fewerbytes`, each starting its own server. They
//! drive every method Proxmox calls — allocation, listing, status, the NBD path opened
//! by qemu-img, `qm disk import`'s convert, resize, templates, linked clones,
//! snapshots, deletion, export, import and migration between two served pools through
//! `storage_migrate` (with snapshots), and what is refused — and check what Proxmox
//! would see.
//!
//! Needs perl's `prove`, `libtest-mockmodule-perl`, `libjson-perl` and qemu-utils
//! (`scripts/test.sh` and `.ci/run` install them); a missing one is a failure.

mod common;

use common::{fewerbytes_bin, require_tool, run_with_limit, CLIENT_LIMIT};
use std::path::PathBuf;
use std::process::Command;

#[test]
fn the_proxmox_plugin_tests_pass_against_a_real_server() {
    let prove = require_tool("prove");
    let plugin_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../packaging/proxmox");
    let mut cmd = Command::new(prove);
    cmd.current_dir(&plugin_dir)
        .env("FEWERBYTES_BIN", fewerbytes_bin())
        .args(["-v", "-I", ".", "-I", "t/lib", "t"]);
    let ran = run_with_limit(&mut cmd, CLIENT_LIMIT);
    assert!(
        ran.status.success(),
        "the Proxmox plugin's tests failed:\n{}",
        ran.report()
    );
    assert!(
        ran.stdout.contains("All tests successful."),
        "prove did not report success:\n{}",
        ran.report()
    );
}

#[test]
fn install_sh_puts_the_plugin_where_pve_storage_loads_it() {
    let dir = common::TempDir::new("pve-install");
    let destdir = dir.join("root");
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut cmd = Command::new("sh");
    cmd.arg(repo.join("packaging/proxmox/install.sh"))
        .env("DESTDIR", &destdir)
        .env("PREFIX", "/opt/fb")
        .env("FEWERBYTES_BIN", fewerbytes_bin());
    let ran = run_with_limit(&mut cmd, CLIENT_LIMIT);
    assert!(ran.status.success(), "{}", ran.report());

    let plugin = destdir.join("usr/share/perl5/PVE/Storage/Custom/FewerbytesPlugin.pm");
    for path in [
        plugin.clone(),
        destdir.join("opt/fb/bin/fewerbytes"),
        destdir.join("etc/systemd/system/fewerbytes@.service"),
        destdir.join("opt/fb/share/doc/fewerbytes/proxmox.md"),
    ] {
        assert!(path.is_file(), "not installed: {}", path.display());
    }
    // The plugin runs the binary where it was installed, and compiles as pve-storage
    // would load it (here against the tests' stand-ins for the PVE modules).
    let text = std::fs::read_to_string(&plugin).expect("read the plugin");
    assert!(
        text.contains("our $FEWERBYTES = '/opt/fb/bin/fewerbytes';"),
        "the installed plugin does not name the installed binary"
    );
    let mut check = Command::new(require_tool("perl"));
    check
        .arg("-I")
        .arg(repo.join("packaging/proxmox/t/lib"))
        .arg("-c")
        .arg(&plugin);
    let ran = run_with_limit(&mut check, CLIENT_LIMIT);
    assert!(ran.status.success(), "{}", ran.report());
    assert!(ran.stderr.contains("syntax OK"), "{}", ran.report());
}
