//! What an untrusted image or root filesystem tarball may leave on the host's disk: no
//! set-id bits, no device nodes, nothing outside the destination, bounded size and entry
//! count, and errors that tell a client about the archive but nothing about the host.

mod common;

use std::fs;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use common::*;
use tempfile::TempDir;
use torpor_image::{
    detect, unpack, unpack_rootfs_tar, unpack_rootfs_tar_with, ImageError, ImageSource, Limits,
};

fn mode(path: &Path) -> u32 {
    fs::symlink_metadata(path).unwrap().permissions().mode() & 0o7777
}

/// A layer with every kind of entry that could hand a host user more power.
fn privileged_layer() -> Layer {
    Layer::new()
        .dir("bin", 0o755)
        .file("bin/su", b"#!/bin/sh\nid\n", 0o4755)
        .file("bin/wall", b"#!/bin/sh\n", 0o2755)
        .file("bin/both", b"#!/bin/sh\n", 0o6711)
        .hardlink("bin/su-again", "bin/su")
        .dir("shared", 0o2775)
        .dir("tmp", 0o1777)
        .char_device("dev/mem", 1, 1)
        .block_device("dev/sda", 8, 0)
        .raw("run/pipe", tar::EntryType::Fifo, 0o4640, b"")
        .file("etc/readable", b"public\n", 0o644)
}

fn assert_made_harmless(root: &Path) {
    assert_eq!(mode(&root.join("bin/su")), 0o755);
    assert_eq!(mode(&root.join("bin/su-again")), 0o755);
    assert_eq!(mode(&root.join("bin/wall")), 0o755);
    assert_eq!(mode(&root.join("bin/both")), 0o711);
    assert_eq!(mode(&root.join("shared")), 0o775);
    // The sticky bit gives nobody anything; /tmp needs it.
    assert_eq!(mode(&root.join("tmp")), 0o1777);
    assert!(!root.join("dev/mem").exists());
    assert!(!root.join("dev/sda").exists());
    let pipe = fs::symlink_metadata(root.join("run/pipe")).unwrap();
    assert!(pipe.file_type().is_fifo());
    assert_eq!(mode(&root.join("run/pipe")), 0o640);
    // Readable by others is fine: the files are the image's.
    assert_eq!(mode(&root.join("etc/readable")), 0o644);
    // Nothing anywhere keeps a set-id bit or is a device.
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for item in fs::read_dir(&dir).unwrap() {
            let path = item.unwrap().path();
            let meta = fs::symlink_metadata(&path).unwrap();
            assert_eq!(meta.permissions().mode() & 0o6000, 0, "{}", path.display());
            let kind = meta.file_type();
            assert!(!kind.is_block_device() && !kind.is_char_device() && !kind.is_socket());
            if kind.is_dir() {
                pending.push(path);
            }
        }
    }
}

#[test]
fn image_import_strips_set_id_bits_and_leaves_device_nodes_out() {
    let dir = TempDir::new().unwrap();
    let layout = OciLayout::new(&dir.path().join("layout"));
    let manifest = layout.image(&[BlobLayer::gzip(privileged_layer().tar())]);
    layout.index(&[manifest]);
    let archive = dir.path().join("image.tar");
    fs::write(&archive, tar_dir(&layout.dir)).unwrap();
    let source = detect(&archive).unwrap();
    assert!(matches!(source, ImageSource::OciArchive(_)));
    let rootfs = dir.path().join("rootfs");
    unpack(&source, None, &rootfs, &mut |_| {}).unwrap();
    assert_made_harmless(&rootfs);
}

#[test]
fn rootfs_tarballs_unpack_plain_gzip_and_zstd_without_set_id_bits_or_devices() {
    let dir = TempDir::new().unwrap();
    let tar = privileged_layer().tar();
    for (name, bytes) in [
        ("plain.tar", tar.clone()),
        ("rootfs.tar.gz", gzip(&tar)),
        ("rootfs.tar.zst", zstd(&tar)),
    ] {
        let archive = dir.path().join(name);
        fs::write(&archive, &bytes).unwrap();
        let rootfs = dir.path().join(format!("{name}.rootfs"));
        let unpacked = unpack_rootfs_tar(&archive, &rootfs).unwrap();
        assert_eq!(unpacked, tar.len() as u64, "{name}");
        assert_eq!(
            fs::read_to_string(rootfs.join("bin/su")).unwrap(),
            "#!/bin/sh\nid\n"
        );
        assert_made_harmless(&rootfs);
    }
}

/// A directory beside the destination that no entry may change.
struct Outside {
    _dir: TempDir,
    outside: PathBuf,
    work: PathBuf,
}

impl Outside {
    fn new() -> Outside {
        let dir = TempDir::new().unwrap();
        let outside = dir.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("secret"), "host secret").unwrap();
        let work = dir.path().join("work");
        fs::create_dir(&work).unwrap();
        Outside {
            outside,
            work,
            _dir: dir,
        }
    }

    /// Unpacks `layer` as a rootfs tarball; checks the outside directory is untouched
    /// and a failed unpack leaves nothing.
    fn unpack(&self, name: &str, layer: Layer) -> Result<PathBuf, ImageError> {
        let archive = self.work.join(format!("{name}.tar"));
        fs::write(&archive, layer.tar()).unwrap();
        let rootfs = self.work.join(name);
        let result = unpack_rootfs_tar(&archive, &rootfs);
        let listing: Vec<_> = fs::read_dir(&self.outside)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(listing, ["secret"], "{name}: something was written outside");
        assert_eq!(
            fs::read_to_string(self.outside.join("secret")).unwrap(),
            "host secret"
        );
        if result.is_err() {
            assert!(!rootfs.exists(), "{name}: a failed unpack left its rootfs");
        }
        result.map(|_| rootfs)
    }
}

#[test]
fn rootfs_tarball_entries_cannot_reach_outside_the_destination() {
    let o = Outside::new();
    let outside = o.outside.to_str().unwrap().to_owned();
    let relative_outside = "../../outside";

    // `..` in a path.
    let err = o
        .unpack("dotdot", Layer::new().file("../outside/x", b"x", 0o644))
        .unwrap_err();
    assert_eq!(err.code(), "path_escape", "{err}");

    // A symlink to the outside, then a file through it.
    let err = o
        .unpack(
            "through-symlink",
            Layer::new()
                .symlink("escape", &outside)
                .file("escape/x", b"x", 0o644),
        )
        .unwrap_err();
    assert_eq!(err.code(), "path_escape", "{err}");
    let err = o
        .unpack(
            "through-relative-symlink",
            Layer::new()
                .symlink("escape", relative_outside)
                .dir("escape/sub", 0o755),
        )
        .unwrap_err();
    assert_eq!(err.code(), "path_escape", "{err}");

    // Hard links whose targets are outside: by `..`, by an absolute host path (which is
    // read as the image's own path, and is not there), and through a symlinked directory.
    let err = o
        .unpack(
            "hardlink-dotdot",
            Layer::new().hardlink("stolen", "../outside/secret"),
        )
        .unwrap_err();
    assert_eq!(err.code(), "path_escape", "{err}");
    let absolute = format!("{outside}/secret");
    let err = o
        .unpack(
            "hardlink-absolute",
            Layer::new().hardlink("stolen", &absolute),
        )
        .unwrap_err();
    assert_eq!(err.code(), "image_corrupt", "{err}");
    let err = o
        .unpack(
            "hardlink-through-symlink",
            Layer::new()
                .symlink("escape", &outside)
                .hardlink("stolen", "escape/secret"),
        )
        .unwrap_err();
    assert_eq!(err.code(), "path_escape", "{err}");

    // A symlink pointing outside is only a symlink: it is kept, never followed, and a
    // hard link to it links the symlink, not its target.
    let rootfs = o
        .unpack(
            "dangling-link",
            Layer::new()
                .symlink("escape", &absolute)
                .hardlink("escape-again", "escape"),
        )
        .unwrap();
    assert_eq!(
        fs::read_link(rootfs.join("escape")).unwrap(),
        Path::new(&absolute)
    );
    assert!(fs::symlink_metadata(rootfs.join("escape-again"))
        .unwrap()
        .file_type()
        .is_symlink());

    // Absolute entry names land inside.
    let rootfs = o
        .unpack(
            "absolute",
            Layer::new().raw(
                &format!("{outside}/planted"),
                tar::EntryType::Regular,
                0o644,
                b"in",
            ),
        )
        .unwrap();
    let inside = rootfs.join(outside.trim_start_matches('/')).join("planted");
    assert_eq!(fs::read_to_string(inside).unwrap(), "in");
}

#[test]
fn rootfs_tarball_size_entry_and_path_limits_are_enforced() {
    let dir = TempDir::new().unwrap();
    let write = |name: &str, layer: Layer| {
        let path = dir.path().join(name);
        fs::write(&path, layer.tar()).unwrap();
        path
    };
    let mut limits = Limits::default();
    limits.max_unpacked_bytes = 64 * 1024;
    let big = write(
        "big.tar",
        Layer::new().file("big", &vec![1u8; 128 * 1024], 0o644),
    );
    let rootfs = dir.path().join("big");
    let err = unpack_rootfs_tar_with(&big, &rootfs, &limits).unwrap_err();
    assert_eq!(err.code(), "too_large", "{err}");
    assert!(!rootfs.exists());

    // Directories an entry creates as parents count as entries.
    let mut limits = Limits::default();
    limits.max_entries = 4;
    let deep = write("deep.tar", Layer::new().file("a/b/c/d/e/file", b"x", 0o644));
    let err = unpack_rootfs_tar_with(&deep, &dir.path().join("deep"), &limits).unwrap_err();
    assert_eq!(err.code(), "too_large", "{err}");
    assert!(err.to_string().contains("4 entries"), "{err}");
    limits.max_entries = 6;
    unpack_rootfs_tar_with(&deep, &dir.path().join("deep-ok"), &limits).unwrap();

    // Paths longer than PATH_MAX are refused before anything is made for them.
    let long = format!("{}/file", "d/".repeat(2100));
    let long = write("long.tar", Layer::new().long_file(&long, b"x"));
    let err = unpack_rootfs_tar(&long, &dir.path().join("long")).unwrap_err();
    assert_eq!(err.code(), "too_large", "{err}");
    assert!(err.client_message().contains("path"), "{err}");
}

#[test]
fn client_messages_name_entries_but_never_host_paths() {
    let dir = TempDir::new().unwrap();
    let secret = dir.path().join("host-secret-uploads");
    fs::create_dir(&secret).unwrap();
    let write = |name: &str, bytes: &[u8]| {
        let path = secret.join(name);
        fs::write(&path, bytes).unwrap();
        path
    };
    let dest = secret.join("rootfs");
    let mut errors: Vec<(ImageError, &str)> = Vec::new();

    let escape = write(
        "escape.tar",
        &Layer::new().file("../../etc/passwd", b"x", 0o644).tar(),
    );
    errors.push((
        unpack_rootfs_tar(&escape, &dest).unwrap_err(),
        "path_escape",
    ));
    let garbage = write("garbage.tar", &[0x42; 1500]);
    errors.push((
        unpack_rootfs_tar(&garbage, &dest).unwrap_err(),
        "image_corrupt",
    ));
    errors.push((
        unpack_rootfs_tar(&secret.join("missing.tar"), &dest).unwrap_err(),
        "image_not_found",
    ));
    errors.push((detect(&garbage).unwrap_err(), "image_unrecognized"));
    let mut limits = Limits::default();
    limits.max_unpacked_bytes = 10;
    let small = write(
        "small.tar",
        &Layer::new().file("f", b"0123456789abc", 0o644).tar(),
    );
    errors.push((
        unpack_rootfs_tar_with(&small, &dest, &limits).unwrap_err(),
        "too_large",
    ));
    fs::create_dir_all(dest.join("occupied")).unwrap();
    errors.push((
        unpack_rootfs_tar(&small, &dest).unwrap_err(),
        "destination_not_empty",
    ));
    fs::remove_dir_all(&dest).unwrap();

    // An OCI archive without the image asked for.
    let layout_dir = dir.path().join("layout");
    let layout = OciLayout::new(&layout_dir);
    let manifest = layout.image(&[BlobLayer::plain(Layer::new().file("a", b"a", 0o644).tar())]);
    layout.index(&[manifest]);
    let archive = write("image.tar", &tar_dir(&layout_dir));
    errors.push((
        unpack(&detect(&archive).unwrap(), Some("nope"), &dest, &mut |_| {}).unwrap_err(),
        "image_not_found",
    ));

    for (err, code) in &errors {
        assert_eq!(err.code(), *code, "{err}");
        let message = err.client_message();
        assert!(
            !message.contains("host-secret") && !message.contains(dir.path().to_str().unwrap()),
            "{code}: {message}"
        );
        assert!(!message.is_empty());
    }
    // The operator's log keeps the path; the client is told which entry.
    let (escape_err, _) = &errors[0];
    assert!(escape_err.to_string().contains("host-secret"));
    assert!(escape_err.client_message().contains("../../etc/passwd"));
}
