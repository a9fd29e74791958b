//! `Volume::changed_since` and `Volume::block_sources` (what `volume send` is made
//! of): a clone and its source differ exactly where one was written since; zeros
//! written over a hole are no change; a grown volume's new blocks differ only where
//! written; the answer survives a reopen (the maps as loaded compare the same).

mod common;
use common::*;

#[test]
fn a_clone_differs_from_its_source_only_where_written_since() {
    let mut t = create(64 << 20, None);
    let pool = t.pool().clone();
    pool.create_volume("vm", 8 << 20).unwrap();
    let vm = pool.open_volume("vm").unwrap();
    for i in 0..1000u64 {
        vm.write(i * BLOCK as u64, &random_block(i % 700), false)
            .unwrap();
    }
    pool.clone_volume("vm", "base").unwrap();
    let base = pool.open_volume("base").unwrap();
    assert_eq!(vm.changed_since(&base).unwrap(), vec![]);

    // A new block, the same bytes rewritten (dedup: the same object), zeros over
    // data, zeros over a hole, and a block past everything written.
    vm.write(10 * BLOCK as u64, &random_block(5000), false)
        .unwrap();
    vm.write(20 * BLOCK as u64, &random_block(20), false)
        .unwrap();
    vm.write_zeroes(30 * BLOCK as u64, 3 * BLOCK as u64, false)
        .unwrap();
    vm.write_zeroes(1500 * BLOCK as u64, 8 * BLOCK as u64, false)
        .unwrap();
    vm.write(2000 * BLOCK as u64, &random_block(6000), false)
        .unwrap();
    let expected = vec![10..11, 30..33, 2000..2001];
    assert_eq!(vm.changed_since(&base).unwrap(), expected);

    let mut sources = vec![fewerbytes_engine::BlockSource::Zero; 4];
    vm.block_sources(9, &mut sources).unwrap();
    assert!(matches!(
        sources[0],
        fewerbytes_engine::BlockSource::Stored(_)
    ));
    assert!(matches!(
        sources[1],
        fewerbytes_engine::BlockSource::Stored(_)
    ));
    assert_ne!(sources[0], sources[1]);
    let mut at_base = vec![fewerbytes_engine::BlockSource::Zero; 4];
    base.block_sources(9, &mut at_base).unwrap();
    assert_eq!(
        sources[0], at_base[0],
        "an unchanged block names the base's object"
    );
    vm.block_sources(30, &mut sources).unwrap();
    assert_eq!(
        &sources[..3],
        &[fewerbytes_engine::BlockSource::Zero; 3],
        "zeros written read as zeros"
    );

    // Grown: the new blocks differ only where written.
    drop(vm);
    pool.resize_volume("vm", 16 << 20, false).unwrap();
    let vm = pool.open_volume("vm").unwrap();
    vm.write(3000 * BLOCK as u64, &random_block(7000), false)
        .unwrap();
    let mut grown = expected.clone();
    grown.push(3000..3001);
    assert_eq!(vm.changed_since(&base).unwrap(), grown);
    vm.flush().unwrap();
    drop((vm, base));

    t.reopen();
    let pool = t.pool().clone();
    let vm = pool.open_volume("vm").unwrap();
    let base = pool.open_volume("base").unwrap();
    assert_eq!(vm.changed_since(&base).unwrap(), grown);
    // Against itself, nothing.
    assert_eq!(vm.changed_since(&vm).unwrap(), vec![]);
}
