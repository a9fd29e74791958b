//! `pool create --compression` and `pool set --compression` with the real binary: the
//! pool's codec shown by `pool info` and `stats`, zstd storing fewer bytes than LZ4 on
//! text, a pool holding both codecs' blocks reading back the same bytes, and a codec
//! changed through a running server.

mod common;

use common::data::mixed_image;
use common::{assert_check_clean, fewerbytes, fewerbytes_ok, qemu_io, Server, TempDir};
use std::path::Path;

fn json(ran: &common::Ran) -> serde_json::Value {
    serde_json::from_str(&ran.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", ran.report()))
}

fn stats(pool: &Path) -> serde_json::Value {
    json(&fewerbytes_ok(pool, &["stats", "--json"]))
}

fn create(dir: &Path, name: &str, compression: &str) -> std::path::PathBuf {
    let pool = dir.join(name);
    let pool_str = pool.to_str().expect("utf-8 temp path");
    let created = fewerbytes_ok(
        &pool,
        &[
            "pool",
            "create",
            pool_str,
            "--size",
            "256M",
            "--compression",
            compression,
        ],
    );
    assert!(
        created.stdout.contains("compression"),
        "{}",
        created.report()
    );
    pool
}

#[test]
fn a_zstd_pool_stores_fewer_bytes_and_a_mixed_pool_reads_back() {
    let dir = TempDir::new("compression");
    let image = dir.path().join("mixed.img");
    std::fs::write(&image, mixed_image(4096, 14)).expect("write image");
    let image_str = image.to_str().expect("utf-8");

    let lz4 = create(dir.path(), "lz4.pool", "lz4");
    let zstd = create(dir.path(), "zstd.pool", "zstd");
    let info = fewerbytes_ok(&zstd, &["pool", "info"]).stdout;
    assert!(
        info.contains("Compression:") && info.contains("zstd:3"),
        "{info}"
    );
    assert_eq!(
        json(&fewerbytes_ok(&lz4, &["pool", "info", "--json"]))["compression"],
        "lz4"
    );
    for pool in [&lz4, &zstd] {
        fewerbytes_ok(pool, &["volume", "import", "first", image_str]);
    }
    let (lz4_stats, zstd_stats) = (stats(&lz4), stats(&zstd));
    let fragment_bytes = |s: &serde_json::Value| s["compressed_bytes"].as_u64().expect("bytes");
    assert!(
        fragment_bytes(&zstd_stats) * 10 < fragment_bytes(&lz4_stats) * 9,
        "zstd's fragments take {} bytes, LZ4's {}",
        fragment_bytes(&zstd_stats),
        fragment_bytes(&lz4_stats)
    );
    assert_eq!(zstd_stats["compression"], "zstd:3");
    assert!(zstd_stats["zstd_fragments"].as_u64() > Some(0));
    assert_eq!(lz4_stats["zstd_fragments"], 0);
    let table = fewerbytes_ok(&zstd, &["stats"]).stdout;
    assert!(
        table.contains("Compression") && table.contains("zstd:3"),
        "{table}"
    );

    // The zstd pool goes to LZ4 for new blocks; both kinds read back as imported.
    let set = fewerbytes_ok(&zstd, &["pool", "set", "--compression", "lz4"]);
    assert!(set.stdout.contains("lz4"), "{}", set.report());
    let other = dir.path().join("other.img");
    std::fs::write(&other, mixed_image(2048, 15)).expect("write image");
    fewerbytes_ok(
        &zstd,
        &["volume", "import", "second", other.to_str().expect("utf-8")],
    );
    let mixed = stats(&zstd);
    assert_eq!(mixed["compression"], "lz4");
    assert!(
        mixed["compressed_fragments"].as_u64() > mixed["zstd_fragments"].as_u64(),
        "LZ4 fragments were added: {mixed}"
    );
    for (volume, original) in [("first", &image), ("second", &other)] {
        let out = dir.path().join(format!("{volume}.out"));
        fewerbytes_ok(
            &zstd,
            &["volume", "export", volume, out.to_str().expect("utf-8")],
        );
        assert!(
            std::fs::read(&out).expect("exported") == std::fs::read(original).expect("image"),
            "volume {volume} exports other bytes than were imported"
        );
    }
    assert_check_clean(&zstd);

    let refused = fewerbytes(&zstd, &["pool", "set", "--compression", "gzip"]);
    assert!(!refused.status.success());
    assert!(
        refused.stderr.contains("lz4, zstd, zstd:LEVEL or none"),
        "{}",
        refused.report()
    );
}

#[test]
fn pool_set_reaches_a_served_pool_and_new_writes_use_the_codec() {
    let dir = TempDir::new("compression-served");
    let mut server = Server::start_new(dir.path(), &[("vol", "16M")], &[]);
    let uri = format!("nbd+unix:///vol?socket={}", server.socket.display());
    let set = fewerbytes_ok(&server.pool, &["pool", "set", "--compression", "zstd:1"]);
    assert!(set.stdout.contains("zstd:1"), "{}", set.report());
    // Text-like data written by a real client: qemu-io's pattern fill compresses.
    qemu_io(
        &uri,
        &["write -P 0x61 0 1M".into(), "write -P 0x62 1M 1M".into()],
    );
    qemu_io(
        &uri,
        &["read -P 0x61 0 1M".into(), "read -P 0x62 1M 1M".into()],
    );
    let served = stats(&server.pool);
    assert_eq!(served["compression"], "zstd:1");
    assert!(served["zstd_fragments"].as_u64() > Some(0), "{served}");
    server.stop();
    let info = json(&fewerbytes_ok(&server.pool, &["pool", "info", "--json"]));
    assert_eq!(
        info["compression"], "zstd:1",
        "the setting survives a restart"
    );
}
