//! The NBD transmission phase: a well-formed handshake (the first input byte picks
//! simple, structured, structured with `base:allocation`, or extended headers),
//! then the rest of the input as the request stream.
#![no_main]

use fewerbytes_fuzz::nbd::{converse, handshake, Mode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, requests)) = data.split_first() else {
        return;
    };
    let mut stream = handshake(Mode::from_byte(selector));
    stream.extend_from_slice(requests);
    converse(&stream);
});
