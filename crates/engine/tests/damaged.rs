//! Opening a pool whose metadata was damaged but still passes its checksums (a bug
//! that wrote a bad value, or a forged image): the open fails with a corruption error
//! that names what broke, never a panic or an allocation sized by the damaged field.
//! Each test pins an input the `pool_open` fuzzer (fuzz/) found.

mod common;
use common::*;
use fewerbytes_engine::storage::{CrashMode, FaultStorage, Storage};
use fewerbytes_engine::{EngineError, OpenOptions, Pool};
use fewerbytes_format::catalog::Catalog;
use fewerbytes_format::page::{decode_page_ref, encode_page, PageKind};
use fewerbytes_format::superblock::SuperBlock;
use std::sync::Arc;

/// A closed pool with one 4 MiB volume "a", as an image.
fn closed_pool_image() -> Vec<u8> {
    let mut t = create(64 << 20, None);
    t.pool().create_volume("a", 4 << 20).unwrap();
    t.pool.take().unwrap().close().unwrap();
    t.dev.crash_image(CrashMode::KeepAll)
}

fn current_super_block(image: &[u8]) -> SuperBlock {
    (0..2)
        .filter_map(|copy| SuperBlock::decode(&image[copy * BLOCK..(copy + 1) * BLOCK]).ok())
        .max_by_key(|sb| sb.generation)
        .expect("a valid super block")
}

/// Rewrite the catalog through `change`, sealing its page again and updating the
/// super block's reference to it (a forged image: every checksum holds).
fn edit_catalog(image: &mut [u8], change: impl FnOnce(&mut Catalog)) {
    let sb = current_super_block(image);
    assert_eq!(sb.catalog.len(), 1, "a small catalog fills one page");
    let reference = sb.catalog[0];
    let at = (sb.pages_start_block + reference.address) as usize * BLOCK;
    let (header, payload) = decode_page_ref(
        &image[at..at + BLOCK],
        PageKind::Catalog,
        sb.nonce,
        &reference,
    )
    .expect("the catalog page");
    let mut catalog = Catalog::decode(&payload[..sb.catalog_bytes as usize]).unwrap();
    change(&mut catalog);
    let stream = catalog.encode();
    assert_eq!(
        stream.len(),
        sb.catalog_bytes as usize,
        "same length, same super block"
    );
    let mut page = [0u8; BLOCK];
    let crc = encode_page(&header, &stream, &mut page);
    image[at..at + BLOCK].copy_from_slice(&page);
    edit_super_block(image, |sb| sb.catalog[0].crc = crc);
}

fn open_image(image: Vec<u8>) -> Result<Arc<Pool>, EngineError> {
    let dev = Arc::new(FaultStorage::from_image("data", image));
    Pool::open_devices(
        dev as Arc<dyn Storage>,
        None,
        &OpenOptions {
            threads: Some(1),
            index_memory_bytes: None,
            no_discard: false,
            hold_index_build: false,
            take_over: None,
            saved_index: fewerbytes_engine::SavedIndex::Off,
        },
    )
}

#[test]
fn a_catalog_volume_larger_than_the_format_allows_is_corruption_not_an_allocation() {
    // Found by the pool_open fuzzer: the volume's block map was sized from the
    // catalog's volume size before anything checked it, so a damaged size asked for
    // an allocation of petabytes and the process aborted. Block maps no longer take
    // memory for their size, but a size past the format's 4 PiB is still corruption.
    let mut image = closed_pool_image();
    edit_catalog(&mut image, |c| c.volumes[0].size_bytes = 1 << 60);
    // Without the older super block copy: with it, the open would take that copy
    // (its own catalog is whole) instead of reporting this one.
    let older = 1 - (current_super_block(&image).generation % 2) as usize;
    image[older * BLOCK..(older + 1) * BLOCK].fill(0);
    match open_image(image) {
        Err(EngineError::Corrupt { region, reason, .. }) => {
            assert_eq!(region, "catalog");
            assert!(
                reason.contains("volume 'a' of 1152921504606846976 bytes"),
                "{reason}"
            );
            assert!(
                reason.contains("larger than the format's maximum"),
                "{reason}"
            );
        }
        Err(other) => panic!("expected a catalog corruption error, got {other}"),
        Ok(_) => panic!("a volume larger than the pool was accepted"),
    }
}

/// Rewrite the current super block through `change`, sealing it again.
fn edit_super_block(image: &mut [u8], change: impl FnOnce(&mut SuperBlock)) {
    let mut sb = current_super_block(image);
    change(&mut sb);
    let mut block = [0u8; BLOCK];
    sb.encode(&mut block);
    let at = (sb.generation % 2) as usize * BLOCK;
    image[at..at + BLOCK].copy_from_slice(&block);
}

/// The open fails naming the device's real length and a truncation (asserted on the
/// message a person reads, which says both whichever check catches it first).
fn assert_device_smaller_than_recorded(result: Result<Arc<Pool>, EngineError>, len_bytes: u64) {
    match result {
        Err(e) => {
            let message = e.to_string();
            assert!(
                message.contains(&format!("holds {len_bytes} bytes")),
                "{message}"
            );
            assert!(message.contains("truncated"), "{message}");
        }
        Ok(_) => panic!("a pool larger than its device was opened"),
    }
}

#[test]
fn a_super_block_recording_a_larger_device_is_corruption_not_an_allocation() {
    // Found by the pool_open fuzzer: the page store's slot map was sized from the
    // super block's page_slots, checked only against the device size the super block
    // itself records, so a consistent set of damaged sizes sized it by the gigabyte
    // (the fuzzer's input asked for 3.6 TiB); a truncated device passed too.
    let mut image = closed_pool_image();
    edit_super_block(&mut image, |sb| {
        sb.metadata_device_bytes = 1 << 52;
        sb.data_device_bytes = 1 << 52;
        sb.page_slots = 1 << 36;
        sb.data_offset_bytes = (sb.pages_start_block + sb.page_slots) * BLOCK as u64;
    });
    assert_device_smaller_than_recorded(open_image(image), 64 << 20);
}

#[test]
fn a_truncated_device_is_refused_at_open() {
    let mut image = closed_pool_image();
    image.truncate(48 << 20);
    assert_device_smaller_than_recorded(open_image(image), 48 << 20);
}
