//! Every API request body decoder on arbitrary bytes: an error in the API's shape, never a panic.
//!   cargo +nightly fuzz run api_bodies
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    torpor_api::server::decode_all_bodies(data);
});
