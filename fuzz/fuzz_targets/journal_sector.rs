//! A journal sector and the records in it.
//!
//! Input: a flags byte, then the 512-byte sector. Flag bit 0 re-seals the crc; bit 1
//! expects the nonce the sector names. A sector that decodes must re-encode to the
//! same records.
#![no_main]

use fewerbytes_format::journal::{decode_sector, encode_sector, Record, SECTOR_MAGIC};
use fewerbytes_format::{seal_checksum, Writer, SECTOR_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let mut sector = rest.to_vec();
    if flags & 1 != 0
        && sector.len() == SECTOR_BYTES
        && fewerbytes_fuzz::u32_at(&sector, 0) == SECTOR_MAGIC
    {
        seal_checksum(&mut sector, 4);
    }
    let nonce = if flags & 2 != 0 {
        fewerbytes_fuzz::u64_at(&sector, 8)
    } else {
        0
    };
    let Ok((header, records)) = decode_sector(&sector, nonce) else {
        return;
    };
    let bytes: usize = records.iter().map(Record::encoded_len).sum();
    assert_eq!(
        bytes,
        usize::from(header.used),
        "records fill what the sector says it used"
    );
    let mut payload = vec![0u8; bytes];
    let mut w = Writer::new(&mut payload);
    for r in &records {
        r.encode(&mut w);
    }
    let mut again = [0u8; SECTOR_BYTES];
    encode_sector(&header, &payload, &mut again);
    let (h2, r2) = decode_sector(&again, nonce).expect("a re-encoded sector decodes");
    assert_eq!(h2, header);
    assert_eq!(r2, records);
});
