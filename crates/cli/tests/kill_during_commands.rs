//! SIGKILL of `serve` while a volume command it runs for the CLI (through the control
//! socket) is under way: `volume clone`, `volume delete` and `volume resize --shrink`
//! each happened wholly or not at all once the pool is opened again, `check` finds
//! nothing wrong, and a command the CLI reported done is never undone.
//!
//! Each case kills at a different delay after the CLI starts, on a volume large
//! enough that its blocks take a while to reference or release.

mod common;

use common::data::mixed_image;
use common::{
    create_pool, fewerbytes, fewerbytes_bin, fewerbytes_ok, volume_names, Server, TempDir,
};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// 64 MiB of mixed data: 16,384 blocks to reference (clone) or release (delete, shrink).
const IMAGE_BLOCKS: u64 = 16 << 10;
const SHRUNK_BYTES: usize = 16 << 20;
/// From "before the request arrives" to "well after the answer".
const KILL_DELAYS_MS: [u64; 8] = [0, 1, 5, 20, 30, 40, 50, 200];
/// How long the CLI may take to notice its server is gone.
const CLI_LIMIT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug)]
enum Op {
    Clone,
    Delete,
    Shrink,
}

impl Op {
    fn args(self) -> Vec<String> {
        let shrunk = SHRUNK_BYTES.to_string();
        let args: &[&str] = match self {
            Op::Clone => &["volume", "clone", "src", "dst"],
            Op::Delete => &["volume", "delete", "src"],
            Op::Shrink => &["volume", "resize", "src", "--size", &shrunk, "--shrink"],
        };
        args.iter().map(|a| a.to_string()).collect()
    }
}

/// `volume export NAME` to a file, read back; `None` if there is no such volume.
fn export(pool: &Path, dir: &Path, name: &str) -> Option<Vec<u8>> {
    let names = volume_names(pool);
    if !names.iter().any(|n| n == name) {
        return None;
    }
    let out = dir.join(format!("{name}.export"));
    let _ = std::fs::remove_file(&out);
    let out_str = out.to_str().expect("utf-8 temp path");
    fewerbytes_ok(pool, &["volume", "export", name, out_str]);
    Some(std::fs::read(&out).expect("read export"))
}

/// Runs `op` through a served pool, kills the server `delay_ms` after starting the
/// CLI, and checks what the reopened pool holds. Returns whether the op happened and
/// whether the CLI said it succeeded. (A CLI that finds its server already gone opens
/// the pool itself, so early kills may see the op done by the CLI alone.)
fn kill_during(op: Op, delay_ms: u64) -> (bool, bool) {
    let dir = TempDir::new(&format!("kill-{op:?}-{delay_ms}ms").to_lowercase());
    let pool = create_pool(dir.path(), &[]);
    let image = mixed_image(IMAGE_BLOCKS, 11);
    let image_path = dir.join("src.img");
    std::fs::write(&image_path, &image).expect("write image");
    let image_str = image_path.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["volume", "import", "src", image_str]);
    std::fs::remove_file(&image_path).expect("remove image");

    let mut server = Server::start(dir.path(), &pool, &[]);
    let mut cli = Command::new(fewerbytes_bin())
        .arg("--pool")
        .arg(&pool)
        .args(op.args())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the CLI");
    std::thread::sleep(Duration::from_millis(delay_ms));
    server.kill9();
    let started = Instant::now();
    let cli_status = loop {
        if let Some(status) = cli.try_wait().expect("poll the CLI") {
            break status;
        }
        if started.elapsed() > CLI_LIMIT {
            let _ = cli.kill();
            let _ = cli.wait();
            panic!("{op:?} after {delay_ms} ms: the CLI did not end within {CLI_LIMIT:?} of its server's death");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let case = format!("{op:?} killed after {delay_ms} ms (CLI {cli_status})");

    // Reopened (the journal replayed): the audit finds nothing wrong...
    let check = fewerbytes(&pool, &["check"]);
    assert!(check.status.success(), "{case}: check\n{}", check.report());
    // ...and the op happened wholly or not at all.
    let src = export(&pool, dir.path(), "src");
    let happened = match op {
        Op::Clone => {
            assert!(
                src.as_deref() == Some(&image[..]),
                "{case}: the source changed"
            );
            match export(&pool, dir.path(), "dst") {
                Some(dst) => {
                    assert!(dst == image, "{case}: the clone differs from its source");
                    true
                }
                None => false,
            }
        }
        Op::Delete => match src {
            Some(src) => {
                assert!(
                    src == image,
                    "{case}: the volume is not deleted, but changed"
                );
                false
            }
            None => true,
        },
        Op::Shrink => {
            let src = src.unwrap_or_else(|| panic!("{case}: the volume is gone"));
            if src.len() == image.len() {
                assert!(src == image, "{case}: not shrunk, but changed");
                false
            } else {
                assert_eq!(src.len(), SHRUNK_BYTES, "{case}: neither size");
                assert!(
                    src[..] == image[..SHRUNK_BYTES],
                    "{case}: shrunk, but the part kept changed"
                );
                true
            }
        }
    };
    if cli_status.success() {
        assert!(
            happened,
            "{case}: the CLI said done, but the reopened pool has not"
        );
    }
    (happened, cli_status.success())
}

fn kill_at_every_delay(op: Op) {
    let outcomes: Vec<(u64, (bool, bool))> = KILL_DELAYS_MS
        .iter()
        .map(|&delay_ms| (delay_ms, kill_during(op, delay_ms)))
        .collect();
    // Not an assertion (timing varies), but a run that never kills mid-way proves
    // little: say which cases the op survived.
    eprintln!("{op:?}: (kill delay ms, (happened, CLI said done)) {outcomes:?}");
}

#[test]
fn a_clone_killed_midway_happened_wholly_or_not_at_all() {
    kill_at_every_delay(Op::Clone);
}

#[test]
fn a_delete_killed_midway_happened_wholly_or_not_at_all() {
    kill_at_every_delay(Op::Delete);
}

#[test]
fn a_shrink_killed_midway_happened_wholly_or_not_at_all() {
    kill_at_every_delay(Op::Shrink);
}
