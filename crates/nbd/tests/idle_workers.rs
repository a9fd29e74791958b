//! Reads at queue depth 1 of bytes at hand need no worker thread; worker threads of
//! an idle connection retire after `WORKER_IDLE_TIMEOUT`, and come back when requests
//! do. Alone in its binary: it counts this process's threads.

mod common;

use common::*;
use fewerbytes_nbd::protocol::*;
use fewerbytes_nbd::WORKER_IDLE_TIMEOUT;
use std::time::Duration;

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .count()
}

#[test]
fn idle_workers_retire_and_return() {
    let t = TestServer::start();
    let mut c = t.connect();
    c.handshake();
    c.go("a", &[]).expect("GO");
    let before_burst = threads();
    // Reads one at a time, of bytes at hand, are answered by the reader itself.
    for i in 0..50u64 {
        c.send_request(0, CMD_READ, i, (i % 8) * 4096, 4096, &[]);
        assert_eq!(c.simple_reply(), (0, i));
        c.read_bytes(4096);
    }
    assert_eq!(
        threads(),
        before_burst,
        "queue-depth-1 reads of memory started worker threads"
    );
    // A pipelined burst starts workers. FUA writes are never run on the reader
    // thread (plain small writes may be, when they arrive one at a time).
    for round in 0..2u64 {
        for i in 0..32u64 {
            c.send_request(
                CMD_FLAG_FUA,
                CMD_WRITE,
                i,
                i * 4096,
                4096,
                &[round as u8 + 1; 4096],
            );
        }
        for _ in 0..32 {
            assert_eq!(c.simple_reply().0, 0);
        }
        assert!(threads() > before_burst, "no worker started");
        std::thread::sleep(WORKER_IDLE_TIMEOUT + Duration::from_secs(1));
        // Every worker retired; the connection keeps only its reader.
        let mut settled = false;
        for _ in 0..200 {
            if threads() <= before_burst {
                settled = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            settled,
            "{} threads, {before_burst} before the burst",
            threads()
        );
    }
    // And the connection still works.
    c.send_request(0, CMD_READ, 99, 0, 4096, &[]);
    assert_eq!(c.simple_reply(), (0, 99));
    assert_eq!(c.read_bytes(4096), vec![2; 4096]);
    c.disconnect();
}
