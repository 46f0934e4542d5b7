//! Entry point for the `uploaded_archives` cargo-fuzz target (`fuzz/`): what a tenant's
//! upload goes through, on arbitrary bytes. Not part of the API.

use std::path::Path;

use crate::{detect, unpack_rootfs_tar_with, unpack_with, Limits, UnpackOptions};

/// Runs `data` as an uploaded image archive and as a root filesystem tarball, with small
/// limits. Panics (which the fuzzer reports) when an unpack panics, leaves a set-id bit or a
/// device node, leaves its destination behind after failing, or tells the client a path of
/// the host.
pub fn unpack_untrusted(data: &[u8]) {
    let Ok(dir) = tempfile::tempdir() else { return };
    let archive = dir.path().join("upload");
    if std::fs::write(&archive, data).is_err() {
        return;
    }
    let limits = Limits {
        max_json_bytes: 1 << 20,
        max_unpacked_bytes: 64 << 20,
        max_entries: 10_000,
    };
    let host_paths = [
        archive.clone(),
        dir.path().join("image"),
        dir.path().join("rootfs"),
    ];
    let check = |dest: &Path, result: Result<(), crate::ImageError>| match result {
        Ok(()) => assert_harmless(dest),
        Err(err) => {
            assert!(!dest.exists(), "a failed unpack left {}", dest.display());
            let message = err.client_message();
            for path in &host_paths {
                assert!(
                    !message.contains(path.to_str().unwrap_or("\0")),
                    "client message names a host path: {message}"
                );
            }
        }
    };
    if let Ok(source) = detect(&archive) {
        let options = UnpackOptions {
            limits: limits.clone(),
            ..UnpackOptions::default()
        };
        let dest = dir.path().join("image");
        let result = unpack_with(&source, None, &dest, &options, &mut |_| {}).map(|_| ());
        check(&dest, result);
    }
    let dest = dir.path().join("rootfs");
    let result = unpack_rootfs_tar_with(&archive, &dest, &limits).map(|_| ());
    check(&dest, result);
}

fn assert_harmless(root: &Path) {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        // The image's own modes may lock even its owner out of a directory.
        let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
        let Ok(listing) = std::fs::read_dir(&dir) else {
            continue;
        };
        for item in listing.flatten() {
            let path = item.path();
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            let kind = meta.file_type();
            assert_eq!(
                meta.permissions().mode() & 0o6000,
                0,
                "set-id: {}",
                path.display()
            );
            assert!(
                !kind.is_block_device() && !kind.is_char_device() && !kind.is_socket(),
                "device or socket: {}",
                path.display()
            );
            if kind.is_dir() {
                pending.push(path);
            }
        }
    }
}
