//! Property tests on untrusted input: random bytes as archives, damaged archives, and layers
//! made of random hostile entries. None may panic, and none may change anything outside the
//! destination.

mod common;

use std::fs;
use std::path::Path;
use std::sync::LazyLock;

use common::*;
use proptest::prelude::*;
use tempfile::TempDir;
use torpor_image::{detect, unpack, unpack_rootfs_tar, ImageSource};

const SENTINEL: &str = "do not touch";

// Decided once per test, before the first case: the whole property runs in the
// unprivileged child (see `body_runs_here`).
static RUNS_HERE_DAMAGED: LazyLock<bool> =
    LazyLock::new(|| body_runs_here("damaged_archives_fail_cleanly"));
static RUNS_HERE_HOSTILE: LazyLock<bool> =
    LazyLock::new(|| body_runs_here("hostile_layers_never_write_outside"));
static RUNS_HERE_ROOTFS: LazyLock<bool> = LazyLock::new(|| {
    body_runs_here("hostile_rootfs_tarballs_never_write_outside_or_keep_set_id_bits_or_devices")
});

/// Every path under `dir` (relative), with the content of regular files.
fn snapshot(dir: &Path) -> Vec<(String, Option<Vec<u8>>)> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(current) = pending.pop() {
        for item in fs::read_dir(&current).unwrap() {
            let item = item.unwrap();
            let path = item.path();
            let relative = path.strip_prefix(dir).unwrap().display().to_string();
            let kind = item.file_type().unwrap();
            if kind.is_dir() {
                pending.push(path);
                found.push((relative, None));
            } else if kind.is_file() {
                found.push((relative, Some(fs::read(&path).unwrap())));
            } else {
                found.push((relative, None));
            }
        }
    }
    found.sort();
    found
}

fn valid_archive() -> Vec<u8> {
    let dir = TempDir::new().unwrap();
    let layout = OciLayout::new(dir.path());
    let layer = Layer::new()
        .dir("etc", 0o755)
        .file("etc/hostname", b"sandbox\n", 0o644)
        .symlink("etc/link", "hostname")
        .hardlink("etc/hard", "etc/hostname")
        .tar();
    let manifest = layout.image(&[BlobLayer::gzip(layer.clone()), BlobLayer::plain(layer)]);
    layout.index(&[manifest]);
    tar_dir(dir.path())
}

#[derive(Debug, Clone)]
enum Entry {
    File(String),
    Dir(String),
    Symlink(String, String),
    Hardlink(String, String),
    /// Any entry type (devices, fifos, ...) with any mode (set-id bits included).
    Special(String, u8, u32),
}

fn component() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("a".to_owned()),
        Just("b".to_owned()),
        Just("..".to_owned()),
        Just(".".to_owned()),
        Just("".to_owned()),
        Just(".wh.a".to_owned()),
        Just(".wh..wh..opq".to_owned()),
        Just("outside".to_owned()),
    ]
}

fn entry_path() -> impl Strategy<Value = String> {
    (any::<bool>(), prop::collection::vec(component(), 1..4)).prop_map(|(absolute, parts)| {
        let joined = parts.join("/");
        if absolute {
            format!("/{joined}")
        } else {
            joined
        }
    })
}

/// Targets that would lead out of the destination if followed, but only into this test's
/// own temporary directory: never `/` or a host path, so that a regression cannot reach
/// beyond it even before the unprivileged child's permissions stop it.
fn link_target() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("..".to_owned()),
        Just("../outside".to_owned()),
        Just("../outside/b".to_owned()),
        Just("OUTSIDE".to_owned()),
        Just("OUTSIDE/b".to_owned()),
        Just("a".to_owned()),
        Just("a/b".to_owned()),
        Just(".".to_owned()),
        Just(".wh.a".to_owned()),
    ]
}

fn hostile_entry() -> impl Strategy<Value = Entry> {
    prop_oneof![
        entry_path().prop_map(Entry::File),
        entry_path().prop_map(Entry::Dir),
        (entry_path(), link_target()).prop_map(|(p, t)| Entry::Symlink(p, t)),
        (entry_path(), link_target()).prop_map(|(p, t)| Entry::Hardlink(p, t)),
    ]
}

fn special_entry() -> impl Strategy<Value = Entry> {
    let kinds = prop_oneof![
        Just(b'0'),
        Just(b'3'),
        Just(b'4'),
        Just(b'5'),
        Just(b'6'),
        Just(b'7'),
        any::<u8>(),
    ];
    let modes = prop_oneof![
        Just(0o4755u32),
        Just(0o2755),
        Just(0o6777),
        Just(0o1777),
        0..0o10000u32
    ];
    (entry_path(), kinds, modes).prop_map(|(p, k, m)| Entry::Special(p, k, m))
}

/// Every path under `dir` that has a set-id bit or is a device node or socket.
fn dangerous_nodes(dir: &Path) -> Vec<String> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let mut found = Vec::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(current) = pending.pop() {
        // The image's directory modes may lock its owner out (0o000): open them up to look
        // (and so that the temporary directory can be removed).
        fs::set_permissions(&current, fs::Permissions::from_mode(0o700)).unwrap();
        for item in fs::read_dir(&current).unwrap() {
            let path = item.unwrap().path();
            let meta = fs::symlink_metadata(&path).unwrap();
            let kind = meta.file_type();
            if meta.permissions().mode() & 0o6000 != 0
                || kind.is_block_device()
                || kind.is_char_device()
                || kind.is_socket()
            {
                found.push(path.display().to_string());
            }
            if kind.is_dir() {
                pending.push(path);
            }
        }
    }
    found
}

fn hostile_layer(entries: &[Entry], outside: &str) -> Vec<u8> {
    let mut layer = Layer::new();
    for entry in entries {
        layer = match entry {
            Entry::File(path) => layer.file(path, b"hostile", 0o644),
            Entry::Dir(path) => layer.dir(path, 0o755),
            Entry::Symlink(path, target) => {
                layer.symlink(path, &target.replace("OUTSIDE", outside))
            }
            Entry::Hardlink(path, target) => {
                layer.hardlink(path, &target.replace("OUTSIDE", outside))
            }
            Entry::Special(path, kind, mode) => {
                layer.raw(path, tar::EntryType::new(*kind), *mode, b"")
            }
        };
    }
    layer.tar()
}

/// A case the rootfs fuzz found (2026-12-04): a GNU long-link header (`K`) with no body, then
/// a symlink, whose target it makes empty. Refused as a corrupt image, not a failed write.
#[test]
fn a_link_whose_long_name_header_is_empty_is_a_corrupt_image() {
    let dir = TempDir::new().unwrap();
    let entries = [
        Entry::Special("a".into(), b'K', 2541),
        Entry::Symlink("a".into(), "..".into()),
    ];
    let archive = dir.path().join("upload.tar");
    fs::write(&archive, hostile_layer(&entries, "/nowhere")).unwrap();
    let rootfs = dir.path().join("rootfs");
    let err = unpack_rootfs_tar(&archive, &rootfs).unwrap_err();
    assert_eq!(err.code(), "image_corrupt", "{err}");
    assert!(!rootfs.exists());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn random_bytes_are_never_an_image(bytes in prop::collection::vec(any::<u8>(), 0..4096)) {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("random.tar");
        fs::write(&path, &bytes).unwrap();
        prop_assert!(detect(&path).is_err());
        for source in [ImageSource::OciArchive(path.clone()), ImageSource::DockerArchive(path.clone())] {
            let rootfs = dir.path().join("rootfs");
            let result = unpack(&source, None, &rootfs, &mut |_| {});
            prop_assert!(result.is_err());
            prop_assert!(!rootfs.exists());
        }
    }

    #[test]
    fn damaged_archives_fail_cleanly(
        cuts in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        truncate in any::<Option<prop::sample::Index>>(),
    ) {
        if !*RUNS_HERE_DAMAGED {
            return Ok(());
        }
        let mut archive = valid_archive();
        for (index, value) in &cuts {
            let position = index.index(archive.len());
            archive[position] = *value;
        }
        if let Some(index) = truncate {
            archive.truncate(index.index(archive.len()));
        }
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("image.tar");
        fs::write(&path, &archive).unwrap();
        let rootfs = dir.path().join("rootfs");
        let result = unpack(&ImageSource::OciArchive(path), None, &rootfs, &mut |_| {});
        // Damage to padding or unused header fields may go unnoticed; damage to anything
        // that is read must not.
        if result.is_ok() {
            prop_assert_eq!(fs::read(rootfs.join("etc/hostname")).unwrap(), b"sandbox\n");
        } else {
            prop_assert!(!rootfs.exists());
        }
    }

    #[test]
    fn hostile_layers_never_write_outside(
        lower in prop::collection::vec(hostile_entry(), 0..12),
        upper in prop::collection::vec(hostile_entry(), 0..12),
    ) {
        if !*RUNS_HERE_HOSTILE {
            return Ok(());
        }
        let dir = TempDir::new().unwrap();
        let outside = dir.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("a"), SENTINEL).unwrap();
        fs::create_dir(outside.join("b")).unwrap();
        let outside_name = outside.to_str().unwrap().to_owned();
        let before = snapshot(&outside);

        let layout = OciLayout::new(&dir.path().join("layout"));
        let manifest = layout.image(&[
            BlobLayer::plain(hostile_layer(&lower, &outside_name)),
            BlobLayer::gzip(hostile_layer(&upper, &outside_name)),
        ]);
        layout.index(&[manifest]);
        let rootfs = dir.path().join("rootfs");
        let source = ImageSource::OciLayout(layout.dir.clone());
        let result = unpack(&source, None, &rootfs, &mut |_| {});

        prop_assert_eq!(snapshot(&outside), before);
        let mut top: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .map(|item| item.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        top.sort();
        let expected: &[&str] = if result.is_ok() {
            &["layout", "outside", "rootfs"]
        } else {
            &["layout", "outside"]
        };
        prop_assert_eq!(top, expected);
        if let Err(err) = &result {
            let code = err.code();
            prop_assert!(
                ["path_escape", "image_corrupt"].contains(&code),
                "unexpected {}: {}", code, err
            );
        }
    }

    #[test]
    fn the_fuzz_entry_point_accepts_what_unpack_must(
        cuts in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
    ) {
        // The cargo-fuzz target's own checks, on a valid archive (lightly damaged) and a
        // rootfs tarball full of set-id files and devices.
        let mut archive = valid_archive();
        for (index, value) in &cuts {
            let position = index.index(archive.len());
            archive[position] = *value;
        }
        torpor_image::fuzzing::unpack_untrusted(&archive);
        let privileged = Layer::new()
            .file("su", b"x", 0o4755)
            .char_device("mem", 1, 1)
            .dir("shared", 0o2775)
            .tar();
        torpor_image::fuzzing::unpack_untrusted(&privileged);
    }

    #[test]
    fn random_bytes_never_panic_as_a_rootfs_tarball(bytes in prop::collection::vec(any::<u8>(), 0..4096)) {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("random.tar");
        fs::write(&path, &bytes).unwrap();
        let rootfs = dir.path().join("rootfs");
        match unpack_rootfs_tar(&path, &rootfs) {
            Ok(_) => prop_assert!(dangerous_nodes(&rootfs).is_empty()),
            Err(err) => {
                prop_assert!(!rootfs.exists());
                prop_assert!(!err.client_message().contains(dir.path().to_str().unwrap()));
            }
        }
    }

    #[test]
    fn hostile_rootfs_tarballs_never_write_outside_or_keep_set_id_bits_or_devices(
        entries in prop::collection::vec(prop_oneof![hostile_entry(), special_entry()], 0..16),
        compression in 0..3u8,
    ) {
        if !*RUNS_HERE_ROOTFS {
            return Ok(());
        }
        let dir = TempDir::new().unwrap();
        let outside = dir.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("a"), SENTINEL).unwrap();
        fs::create_dir(outside.join("b")).unwrap();
        let outside_name = outside.to_str().unwrap().to_owned();
        let before = snapshot(&outside);

        let tar = hostile_layer(&entries, &outside_name);
        let bytes = match compression {
            0 => tar,
            1 => gzip(&tar),
            _ => zstd(&tar),
        };
        let archive = dir.path().join("upload.tar");
        fs::write(&archive, bytes).unwrap();
        let rootfs = dir.path().join("rootfs");
        let result = unpack_rootfs_tar(&archive, &rootfs);

        prop_assert_eq!(snapshot(&outside), before);
        match &result {
            Ok(_) => prop_assert_eq!(dangerous_nodes(&rootfs), Vec::<String>::new()),
            Err(err) => {
                prop_assert!(!rootfs.exists());
                prop_assert!(
                    ["path_escape", "image_corrupt"].contains(&err.code()),
                    "unexpected {}: {}", err.code(), err
                );
                // The archive may name host paths itself (link targets); the message may
                // repeat those, never where the archive or the root filesystem are.
                let message = err.client_message();
                prop_assert!(!message.contains(archive.to_str().unwrap()), "{}", message);
                prop_assert!(!message.contains(rootfs.to_str().unwrap()), "{}", message);
            }
        }
    }
}
