//! The super block and the data-device label, from one 4 KiB block.
//!
//! Input: a flags byte, then the block. Flag bit 0 re-seals the crc first, so the
//! fuzzer reaches the geometry checks behind it. A block that decodes must encode
//! back to something that decodes to the same value.
#![no_main]

use fewerbytes_format::superblock::{DataLabel, SuperBlock};
use fewerbytes_format::BLOCK_BYTES;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let mut block = rest.to_vec();
    if flags & 1 != 0 && block.len() == BLOCK_BYTES {
        let mut b = [0u8; BLOCK_BYTES];
        b.copy_from_slice(&block);
        fewerbytes_fuzz::reseal_block(&mut b);
        block = b.to_vec();
    }
    if let Ok(sb) = SuperBlock::decode(&block) {
        let mut again = [0u8; BLOCK_BYTES];
        sb.encode(&mut again);
        assert_eq!(
            SuperBlock::decode(&again).as_ref(),
            Ok(&sb),
            "super block round trip"
        );
    }
    if let Ok(label) = DataLabel::decode(&block) {
        let mut again = [0u8; BLOCK_BYTES];
        label.encode(&mut again);
        assert_eq!(
            DataLabel::decode(&again).as_ref(),
            Ok(&label),
            "data label round trip"
        );
    }
});
