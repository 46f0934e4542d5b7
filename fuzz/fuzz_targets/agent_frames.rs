//! The agent protocol's frame decoder on arbitrary bytes (both directions).
//!   cargo +nightly fuzz run agent_frames
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut r = data;
    while let Ok((_, _)) = torpor_runtime::proto::read_frame::<torpor_runtime::proto::Request>(&mut r) {}
    let mut r = data;
    while let Ok((_, _)) = torpor_runtime::proto::read_frame::<torpor_runtime::proto::Reply>(&mut r) {}
});
