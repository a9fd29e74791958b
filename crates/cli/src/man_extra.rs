//! The EXIT STATUS and EXAMPLES sections of each man page: what `--help` has no place
//! for. `cmd_generate` refuses to write the pages while a command lacks them.

use crate::exit_codes::INTERRUPTED_BY_SIGINT;

/// Exit codes and what each means.
type ExitCodes = &'static [(u8, &'static str)];
/// A sentence saying what an example does, and the example.
type Examples = &'static [(&'static str, &'static str)];

/// What a command's man page says beyond its options.
pub struct ManExtra {
    pub exit_status: ExitCodes,
    pub examples: Examples,
}

/// The codes of a command that does its work or fails with a message.
const PLAIN: &[(u8, &str)] = &[
    (0, "Done."),
    (
        1,
        "Failed: the reason is on stderr, as \"fewerbytes: error: ...\".",
    ),
    (
        2,
        "The command line was not understood (a usage message says why).",
    ),
];

/// What a command that stops at SIGINT or SIGTERM exits with (exit_codes.rs).
const STOPPED: &str = "Stopped by SIGINT (Ctrl-C) before its end: the pool was closed, and \
     the line \"fewerbytes: interrupted by SIGINT: ...\" says what stopped and what it left \
     (143 for SIGTERM). A second signal exits at once with the same code.";

/// A command that does its work, fails, or stops at a signal.
const STOPPABLE: &[(u8, &str)] = &[
    (0, "Done."),
    (
        1,
        "Failed: the reason is on stderr, as \"fewerbytes: error: ...\".",
    ),
    (
        2,
        "The command line was not understood (a usage message says why).",
    ),
    (INTERRUPTED_BY_SIGINT, STOPPED),
];

/// `volume export`: [`STOPPABLE`], and damage found.
const EXPORT: &[(u8, &str)] = &[
    (0, "Done."),
    (
        1,
        "Failed: the reason is on stderr, as \"fewerbytes: error: ...\".",
    ),
    (
        2,
        "The command line was not understood (a usage message says why).",
    ),
    (
        4,
        "Damaged blocks: refused (nothing written), or written as zeros with \
         --skip-damaged; each is named on stderr.",
    ),
    (INTERRUPTED_BY_SIGINT, STOPPED),
];

/// `check`'s codes, as fsck's (exit_codes.rs).
const CHECK: &[(u8, &str)] = &[
    (0, "No damage found."),
    (
        1,
        "Damage found and repaired (--repair); each change was listed.",
    ),
    (
        4,
        "Damage left: found without --repair, or metadata that does not load.",
    ),
    (
        8,
        "Not checked: no pool, the pool held by another process, --repair on a served \
         pool, or an I/O error.",
    ),
    (
        INTERRUPTED_BY_SIGINT,
        "SIGINT (Ctrl-C) during --repair or --verify-data: the repair ran to its end (it is \
         made durable in one step there), its report was printed, the pool closed (143 for \
         SIGTERM). A second signal exits at once, the pool as before the repair.",
    ),
];

const SCRUB: &[(u8, &str)] = &[
    (
        0,
        "Done: started, paused, resumed or shown; or, when it waited for the end (--wait, \
         or a pool no server holds), no damage left.",
    ),
    (
        1,
        "It waited for the end and damage was left unrepaired or the scrub stopped, or \
         the command failed: stderr says which.",
    ),
    (2, "The command line was not understood."),
    (
        INTERRUPTED_BY_SIGINT,
        "SIGINT (Ctrl-C) while it waited: a scrub of a pool no server holds stopped and \
         the pool was closed; a server's scrub goes on (143 for SIGTERM).",
    ),
];

const SERVE: &[(u8, &str)] = &[
    (
        0,
        "Stopped by SIGTERM or SIGINT (Ctrl-C) after flushing and closing the pool.",
    ),
    (
        1,
        "Could not start (no pool, a socket or port in use, bad credentials), or the \
         pool failed while serving; the reason is on stderr.",
    ),
    (2, "The command line was not understood."),
    (
        INTERRUPTED_BY_SIGINT,
        "A second SIGINT during a stop: exited at once (143 for SIGTERM). What clients \
         flushed is in the journal and replayed at the next start.",
    ),
];

/// The man page extras of `fewerbytes PATH` (`""` for `fewerbytes` itself, else the
/// words after it, e.g. `"volume create"`); `None` for a command not listed here.
pub fn for_command(path: &str) -> Option<ManExtra> {
    let (exit_status, examples): (ExitCodes, Examples) = match path {
        "" => (
            PLAIN,
            &[
                (
                    "Serve the pool in this directory (made on first run, with volume disk0), and read it from another terminal:",
                    "fewerbytes serve\nnbdinfo nbd://127.0.0.1:10809/disk0",
                ),
                ("Every command's options:", "fewerbytes COMMAND --help"),
            ],
        ),
        "pool" => (
            PLAIN,
            &[(
                "Make a 64 GiB pool file and show it:",
                "fewerbytes pool create vms.pool --size 64G\nfewerbytes --pool vms.pool pool info",
            )],
        ),
        "pool create" => (
            PLAIN,
            &[
                ("A 64 GiB sparse pool file:", "fewerbytes pool create vms.pool --size 64G"),
                (
                    "A pool on a block device, compressing with zstd:",
                    "fewerbytes pool create /dev/nvme1n1 --compression zstd",
                ),
            ],
        ),
        "pool grow" => (
            PLAIN,
            &[
                (
                    "Grow a pool file, then let the pool take the new space:",
                    "truncate -s 128G vms.pool\nfewerbytes --pool vms.pool pool grow",
                ),
                (
                    "Grow a pool's Ceph RBD image (served or not), then the pool:",
                    "rbd resize --size 200G vms/pool0\nfewerbytes --pool rbd:vms/pool0 pool grow",
                ),
            ],
        ),
        "pool set" => (
            PLAIN,
            &[(
                "Compress new blocks with zstd from now on:",
                "fewerbytes --pool vms.pool pool set --compression zstd",
            )],
        ),
        "pool info" => (
            PLAIN,
            &[(
                "Geometry, settings and space, for a script:",
                "fewerbytes --pool vms.pool pool info --json",
            )],
        ),
        "volume" => (
            PLAIN,
            &[(
                "A thick 20 GiB volume and a thin clone of it:",
                "fewerbytes --pool vms.pool volume create template --size 20G\nfewerbytes --pool vms.pool volume clone template vm1 --thin",
            )],
        ),
        "volume create" => (
            PLAIN,
            &[
                ("A thick volume (reserves its size):", "fewerbytes --pool vms.pool volume create db --size 20G"),
                ("A thin one:", "fewerbytes --pool vms.pool volume create scratch --size 100G --thin"),
            ],
        ),
        "volume allow" => (
            PLAIN,
            &[(
                "Only the TLS identities alice and bob may open vm1; then show who may:",
                "fewerbytes --pool vms.pool volume allow vm1 alice,bob\nfewerbytes --pool vms.pool volume allow vm1",
            )],
        ),
        "volume list" => (
            PLAIN,
            &[("Every volume, exact bytes, no header:", "fewerbytes --pool vms.pool volume list --bytes --no-header")],
        ),
        "volume info" => (
            PLAIN,
            &[("One volume, as JSON:", "fewerbytes --pool vms.pool volume info vm1 --json")],
        ),
        "volume resize" => (
            PLAIN,
            &[("Grow vm1 to 40 GiB:", "fewerbytes --pool vms.pool volume resize vm1 --size 40G")],
        ),
        "volume clone" => (
            PLAIN,
            &[("A linked clone of a template, reserving nothing:", "fewerbytes --pool vms.pool volume clone template vm2 --thin")],
        ),
        "volume set" => (
            PLAIN,
            &[("Make vm2 reserve 4 GiB:", "fewerbytes --pool vms.pool volume set vm2 --reserve 4G")],
        ),
        "volume rename" => (
            PLAIN,
            &[("Rename (and re-export) vm2:", "fewerbytes --pool vms.pool volume rename vm2 web1")],
        ),
        "volume snapshot" | "volume snapshot create" => (
            PLAIN,
            &[("A snapshot of vm1 before an upgrade, read over NBD as vm1@before:", "fewerbytes --pool vms.pool volume snapshot vm1 before")],
        ),
        "volume snapshot list" => (
            PLAIN,
            &[("The snapshots of vm1, as JSON:", "fewerbytes --pool vms.pool volume snapshot list vm1 --json")],
        ),
        "volume snapshot delete" => (
            PLAIN,
            &[("Delete vm1's snapshot before, freeing what only it held:", "fewerbytes --pool vms.pool volume snapshot delete vm1 before")],
        ),
        "volume rollback" => (
            PLAIN,
            &[("A snapshot before an upgrade, and back to it:", "fewerbytes --pool vms.pool volume snapshot vm1 before && fewerbytes --pool vms.pool volume rollback vm1 before")],
        ),
        "volume diff" => (
            PLAIN,
            &[("What changed in vm1 since its snapshot monday:", "fewerbytes --pool vms.pool volume diff vm1 --from monday")],
        ),
        "volume delete" => (
            PLAIN,
            &[("Delete vm2, freeing the blocks only it held:", "fewerbytes --pool vms.pool volume delete vm2")],
        ),
        "volume import" => (
            STOPPABLE,
            &[
                ("A raw image into an empty volume (pool not served):", "fewerbytes --pool vms.pool volume import vm1 disk.raw"),
                ("Continue an import Ctrl-C cut short (its volume is marked incomplete):", "fewerbytes --pool vms.pool volume import vm1 disk.raw --resume"),
            ],
        ),
        "volume export" => (
            EXPORT,
            &[("A volume out to a sparse raw file (pool not served):", "fewerbytes --pool vms.pool volume export vm1 vm1.raw")],
        ),
        "volume send" => (
            STOPPABLE,
            &[
                ("vm1 to another host's pool (neither pool served):", "fewerbytes --pool vms.pool volume send vm1 | ssh host2 fewerbytes --pool vms.pool volume receive vm1"),
                ("Only what changed since the clone vm1-base both pools hold:", "fewerbytes --pool vms.pool volume send vm1 --from vm1-base > vm1.fbs"),
                (
                    "Two-way: only the blocks host2's template does not hold:",
                    "fewerbytes --pool vms.pool volume send vm1 --to 'ssh host2 fewerbytes --pool vms.pool volume receive vm1 --negotiate-with template'",
                ),
            ],
        ),
        "volume receive" => (
            STOPPABLE,
            &[
                ("A stream saved to a file:", "fewerbytes --pool vms.pool volume receive vm1 < vm1.fbs"),
                ("Continue a receive the stream cut short:", "fewerbytes --pool vms.pool volume receive vm1 --resume < vm1.fbs"),
            ],
        ),
        "stats" => (
            PLAIN,
            &[
                ("Space used and saved:", "fewerbytes --pool vms.pool stats"),
                ("Every counter:", "fewerbytes --pool vms.pool stats --verbose"),
            ],
        ),
        "list-metadata" => (
            PLAIN,
            &[("The metadata regions:", "fewerbytes --pool vms.pool list-metadata")],
        ),
        "check" => (
            CHECK,
            &[
                ("Audit a pool, reading every block against its fingerprint:", "fewerbytes --pool vms.pool check --verify-data"),
                ("Repair what it found (pool not served):", "fewerbytes --pool vms.pool check --repair"),
            ],
        ),
        "scrub" | "scrub start" => (
            SCRUB,
            &[(
                "Verify a served pool at 32 MiB/s and wait for the report:",
                "fewerbytes --pool vms.pool scrub start --rate 32M --wait",
            )],
        ),
        "scrub pause" | "scrub resume" => (
            SCRUB,
            &[("Pause a running scrub, and resume it later:", "fewerbytes --pool vms.pool scrub pause\nfewerbytes --pool vms.pool scrub resume")],
        ),
        "scrub status" => (
            SCRUB,
            &[("Where a scrub is, for a script:", "fewerbytes --pool vms.pool scrub status --json")],
        ),
        "serve" => (
            SERVE,
            &[
                ("Serve ./fewerbytes.pool (made on first run) on 127.0.0.1:10809 and ./fewerbytes.pool.sock:", "fewerbytes serve"),
                (
                    "Serve beyond this host, over TLS with client certificates:",
                    "fewerbytes --pool vms.pool serve --listen 0.0.0.0:10809 --tls-certificates pki/server --tls-verify-peer",
                ),
            ],
        ),
        "completions" => (
            PLAIN,
            &[("Install bash completion:", "fewerbytes completions bash > /usr/share/bash-completion/completions/fewerbytes")],
        ),
        "man" => (
            PLAIN,
            &[("Install the man pages:", "fewerbytes man /usr/local/share/man/man1")],
        ),
        _ => return None,
    };
    Some(ManExtra {
        exit_status,
        examples,
    })
}
