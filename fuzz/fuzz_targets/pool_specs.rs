//! A tenant's pool spec (`POST /v1/pools`) and trigger settings, and the operator's
//! `--broker-allow` list, on arbitrary bytes: no panic; every valid trigger has the broker
//! addresses the allow-list checks, a list naming exactly them lets it through and the empty
//! list refuses it.
//!   cargo +nightly fuzz run pool_specs
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = torpor_api::fuzzing::pool_spec(data);
    let _ = torpor_triggers::fuzzing::trigger_spec(data);
    let _ = torpor_triggers::fuzzing::broker_allow(&String::from_utf8_lossy(data));
});
