//! The NBD server fed raw client bytes from the first byte on: the handshake, and
//! whatever follows if the bytes get through it.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    fewerbytes_fuzz::nbd::converse(data);
});
