//! Connect's envelope decoders (whole and incremental, cut at chunk sizes the input picks) and
//! every served `process.Process/*` and `filesystem.Filesystem/*` request message, unary and
//! enveloped, on arbitrary bytes: no panic; chunking never changes what is decoded; no envd
//! path climbs out of `/`.
//!   cargo +nightly fuzz run connect_envelopes
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    torpor_api::fuzzing::connect_envelopes(data);
});
