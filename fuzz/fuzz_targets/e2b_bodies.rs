//! The E2B control plane's JSON bodies (create, connect, timeout, network) under each kind of
//! template policy, its list queries, and envd's `/files` upload (query, Basic user, multipart
//! body) on arbitrary bytes: no panic; no body widens a template's network policy.
//!   cargo +nightly fuzz run e2b_bodies
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    torpor_api::fuzzing::e2b_bodies(data);
});
