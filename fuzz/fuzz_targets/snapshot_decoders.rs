//! Every decoder of untrusted snapshot bytes (manifests plain and sealed, chunk blobs, gVisor
//! image headers and frames) on arbitrary input; an accepted manifest must be canonical.
//!   cargo +nightly fuzz run snapshot_decoders
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    torpor_snapshot::fuzzing::decode_untrusted(data);
});
