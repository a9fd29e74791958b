//! Files written beside a pool go through names no one can take beforehand: a
//! symbolic link or file planted at the name a command would have used is neither
//! followed nor in the way (`engine/src/companion.rs`).

mod common;

use common::*;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// `fewerbytes --pool POOL ARGS` as process 1 of a new pid namespace, so that a name
/// made from the process id is known before the command starts.
fn as_pid_1(pool: &Path, args: &[&str]) -> Ran {
    let mut cmd = Command::new(require_tool("unshare"));
    cmd.args(["--pid", "--fork"])
        .arg(fewerbytes_bin())
        .arg("--pool")
        .arg(pool)
        .args(args);
    run_with_limit(&mut cmd, Duration::from_secs(60))
}

// Regression: a clean close saved the dedup index through `<pool>.index.<pid>.new`:
// another user who planted a file or link at that name (the pid is easy to guess)
// made every save fail, so each open rebuilt the index.
#[test]
fn the_saved_index_goes_through_no_name_planted_beside_the_pool() {
    // SAFETY: geteuid(2) reads the caller's id and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: a new pid namespace takes root");
        return;
    }
    let dir = TempDir::new("companion-index");
    let pool = create_pool(dir.path(), &[("vm", "16M")]);
    let victim = dir.join("victim");
    std::fs::write(&victim, b"root's file\n").expect("victim");
    let planted = dir.join("test.pool.index.1.new");
    std::os::unix::fs::symlink(&victim, &planted).expect("plant the link");
    let index = dir.join("test.pool.index");

    let ran = as_pid_1(&pool, &["volume", "create", "vm2", "--size", "16M"]);
    assert!(ran.status.success(), "{}", ran.report());
    assert!(
        !ran.all_output().contains("could not save the dedup index"),
        "the planted link stopped the save:\n{}",
        ran.report()
    );
    assert!(
        index.is_file(),
        "no index saved at the close:\n{}",
        ran.report()
    );
    assert_eq!(
        std::fs::read(&victim).expect("victim"),
        b"root's file\n",
        "the save wrote through the link"
    );
    assert_eq!(
        std::fs::read_link(&planted).expect("the planted link"),
        victim,
        "the planted link was changed"
    );
}
