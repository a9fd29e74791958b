//! A journal sector that rots on the drive after a crash, with the real binary: a
//! served pool takes 24 writes of 1 MiB, each flushed (qemu-io), the server is
//! killed (-9), and bytes of live journal sectors are overwritten in the pool file.
//! Replay used to stop at the first bad sector as if it were the journal's end:
//! 12 of 16 flushed writes of 256 KiB read back as their old contents and `check` said
//! "No problems found" (exit 0). Now one bad sector is rebuilt from its group's
//! parity (every write reads back), and damage parity cannot rebuild makes `check`
//! exit 4 naming the sector, and `check --repair` replay the rest, listing the loss.

mod common;

use common::*;
use std::path::{Path, PathBuf};

const BLOCK: usize = 4096;
const SECTOR: usize = 512;
// 1 MiB: a commit's new blocks fill several journal sectors (a run record holds 8).
const CHUNK: usize = 1 << 20;
const CHUNKS: usize = 24;

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

/// Byte offsets in the pool file of the live journal sectors, in order, read as
/// docs/format.md lays them out: from the newest super block's replay point, each
/// carrying its sequence number and the open generation (record sectors at bytes
/// 16 and 24, parity sectors, "FBJP", at 8 and 16).
fn live_sectors(pool: &[u8]) -> Vec<usize> {
    let sb = (0..2)
        .map(|c| &pool[c * BLOCK..(c + 1) * BLOCK])
        .max_by_key(|sb| u64_at(sb, 24))
        .expect("two copies");
    let open_gen = u32_at(sb, 32);
    let (start, sectors, replay) = (u64_at(sb, 104), u64_at(sb, 112), u64_at(sb, 136));
    let mut live = Vec::new();
    for seq in replay..replay + sectors {
        let at = start as usize * BLOCK + (seq % sectors) as usize * SECTOR;
        let s = &pool[at..at + SECTOR];
        let (seq_at, gen_at) = if &s[..4] == b"FBJP" {
            (8, 16)
        } else {
            (16, 24)
        };
        if u64_at(s, seq_at) != seq || u32_at(s, gen_at) != open_gen {
            break;
        }
        live.push(at);
    }
    live
}

/// A served pool written as the issue describes, then killed: the pool file and
/// what was written.
fn written_and_killed(dir: &TempDir) -> (PathBuf, Vec<u8>) {
    let mut server = Server::start_new(dir.path(), &[("vm", "24M")], &[]);
    let mut written = vec![0u8; CHUNK * CHUNKS];
    common::data::Rng::new(26).fill(&mut written);
    let mut commands = Vec::new();
    for (i, chunk) in written.chunks(CHUNK).enumerate() {
        let file = dir.join(&format!("chunk{i}"));
        std::fs::write(&file, chunk).expect("write a chunk file");
        let file = file.to_str().expect("utf-8").to_string();
        commands.push(format!("write -s {file} {} {CHUNK}", i * CHUNK));
        commands.push("flush".to_string());
    }
    qemu_io(&server.unix_uri("vm"), &commands);
    server.kill9();
    (server.pool.clone(), written)
}

/// Overwrite byte 200 of each sector at `sectors` with 0xff (or 0x00 if it holds 0xff).
fn rot(pool: &Path, sectors: &[usize]) {
    let mut bytes = std::fs::read(pool).expect("read the pool file");
    for &at in sectors {
        let b = &mut bytes[at + 200];
        *b = if *b == 0xff { 0 } else { 0xff };
    }
    std::fs::write(pool, bytes).expect("write the pool file");
}

fn exported(pool: &Path, dir: &TempDir) -> Vec<u8> {
    let out = dir.join("out.img");
    let out_str = out.to_str().expect("utf-8");
    fewerbytes_ok(pool, &["volume", "export", "vm", "--force", out_str]);
    std::fs::read(&out).expect("read the export")
}

fn check(pool: &Path, args: &[&str], code: i32) -> Ran {
    let mut all = vec!["check"];
    all.extend_from_slice(args);
    let ran = fewerbytes(pool, &all);
    assert_eq!(ran.status.code(), Some(code), "{}", ran.report());
    ran
}

#[test]
fn a_rotted_journal_sector_after_a_kill_is_rebuilt_and_every_flushed_write_reads_back() {
    let dir = TempDir::new("journal-rot-one");
    let (pool, written) = written_and_killed(&dir);
    let pool_bytes = std::fs::read(&pool).expect("read the pool file");
    let live = live_sectors(&pool_bytes);
    assert!(live.len() > 100, "{} live journal sectors", live.len());
    // The case: sector 40 of 160.
    rot(&pool, &[live[live.len() * 40 / 160]]);
    check(&pool, &[], 0);
    let got = exported(&pool, &dir);
    let differ: Vec<usize> = (0..CHUNKS)
        .filter(|&i| got[i * CHUNK..(i + 1) * CHUNK] != written[i * CHUNK..(i + 1) * CHUNK])
        .collect();
    assert!(differ.is_empty(), "flushed chunks {differ:?} read back old");
}

#[test]
fn two_rotted_sectors_of_one_group_are_reported_and_repair_lists_what_was_lost() {
    let dir = TempDir::new("journal-rot-two");
    let (pool, written) = written_and_killed(&dir);
    let pool_bytes = std::fs::read(&pool).expect("read the pool file");
    let live = live_sectors(&pool_bytes);
    // Two neighbouring record sectors of one parity group.
    let mut k = live.len() / 2;
    while live[k..k + 2]
        .iter()
        .any(|&at| &pool_bytes[at..at + 4] == b"FBJP")
    {
        k += 1;
    }
    rot(&pool, &[live[k], live[k + 1]]);

    let found = check(&pool, &[], 4);
    assert!(
        found.all_output().contains("journal sector") && found.all_output().contains("seq "),
        "check names the lost journal sector:\n{}",
        found.report()
    );
    let repaired = check(&pool, &["--repair"], 1);
    assert!(
        repaired.stdout.contains("repaired: journal sector seq"),
        "{}",
        repaired.report()
    );
    check(&pool, &[], 0);
    // Only what the two sectors held is lost: every block reads as written or as
    // before (zeros), and most of what came after them is there.
    let got = exported(&pool, &dir);
    let lost = (0..CHUNK * CHUNKS / BLOCK)
        .filter(|&b| got[b * BLOCK..(b + 1) * BLOCK] != written[b * BLOCK..(b + 1) * BLOCK])
        .inspect(|&b| {
            assert!(
                got[b * BLOCK..(b + 1) * BLOCK].iter().all(|&x| x == 0),
                "block {b} reads neither as written nor as before"
            )
        })
        .count();
    // Two sectors hold at most 16 run records of 8 blocks each.
    assert!(
        lost > 0 && lost <= 128,
        "{lost} blocks lost:\n{}",
        repaired.report()
    );
}
