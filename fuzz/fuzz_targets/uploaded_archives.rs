//! A tenant's uploaded archive (OCI archive, docker save, or a root filesystem tarball) on
//! arbitrary bytes: no panic, no set-id bit or device node left, nothing left after a
//! failure, no host path in the client's message.
//!   cargo +nightly fuzz run uploaded_archives
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    torpor_image::fuzzing::unpack_untrusted(data);
});
