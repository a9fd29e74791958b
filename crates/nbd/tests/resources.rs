//! File descriptors and threads return to their baseline after clients leave,
//! including clients that vanish mid-request. Alone in its own test binary so
//! that no other test opens descriptors or threads at the same time.

mod common;

use common::*;
use fewerbytes_nbd::protocol::*;
use std::time::Duration;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .count()
}

/// Wait (bounded) for a count to come back down to `want`.
fn settles_to(what: &str, want: usize, count: fn() -> usize) {
    for _ in 0..500 {
        if count() <= want {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("{what}: {} now, {want} before", count());
}

#[test]
fn fds_and_threads_return_to_baseline() {
    let fds_before = open_fds();
    let threads_before = threads();
    let t = TestServer::start();
    let fds_serving = open_fds();
    let threads_serving = threads();
    for round in 0..3u64 {
        let mut clients = Vec::new();
        for i in 0..40u64 {
            let mut c = t.connect();
            c.handshake();
            match i % 4 {
                // A normal session.
                0 => {
                    c.go("a", &[]).expect("GO");
                    for j in 0..16u64 {
                        c.send_request(0, CMD_WRITE, j, j * 4096, 4096, &[round as u8 + 1; 4096]);
                    }
                    for _ in 0..16 {
                        assert_eq!(c.simple_reply().0, 0);
                    }
                    clients.push(c);
                }
                // Gone in the middle of a write payload.
                1 => {
                    c.go("a", &[]).expect("GO");
                    c.send_request(0, CMD_WRITE, 1, 0, 1 << 20, &[7; 1000]);
                }
                // Gone during negotiation.
                2 => c.send_option(OPT_GO, &[0, 0]),
                // Gone with reads in flight, replies unread.
                _ => {
                    c.option_ack(OPT_STRUCTURED_REPLY);
                    c.go("b", &[]).expect("GO");
                    for j in 0..32u64 {
                        c.send_request(0, CMD_READ, j, 0, 1 << 20, &[]);
                    }
                }
            }
        }
        for mut c in clients {
            c.disconnect();
        }
        t.wait_idle();
        settles_to("fds while serving", fds_serving, open_fds);
        settles_to("threads while serving", threads_serving, threads);
        t.assert_healthy();
        t.wait_idle();
    }
    t.server.shutdown();
    drop(t);
    settles_to("fds after shutdown", fds_before, open_fds);
    settles_to("threads after shutdown", threads_before, threads);
}
