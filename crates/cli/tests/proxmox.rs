//! The Proxmox VE storage plugin (`packaging/proxmox`): its Perl tests, run with
//! `prove` against this build of `fewerbytes`, each starting its own server. They
//! drive every method Proxmox calls — allocation, listing, status, the NBD path opened
//! by qemu-img, `qm disk import`'s convert, resize, templates, linked clones,
//! snapshots, deletion and what is refused — and check what Proxmox would see.
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
