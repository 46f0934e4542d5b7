//! Unpacking images that the tests build themselves: the three source kinds, the three
//! layer compressions, layer semantics (whiteouts, opaque directories, links), and hostile
//! or broken input.

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use common::*;
use serde_json::json;
use tempfile::TempDir;
use torpor_image::{
    detect, unpack, unpack_with, ImageConfig, ImageError, ImageSource, Limits, Progress,
    UnpackOptions,
};

struct Unpacked {
    _dir: TempDir,
    rootfs: PathBuf,
    result: Result<ImageConfig, ImageError>,
    events: Vec<Progress>,
}

fn unpack_into(
    work: &Path,
    source: &ImageSource,
    reference: Option<&str>,
) -> (PathBuf, Result<ImageConfig, ImageError>, Vec<Progress>) {
    let rootfs = work.join("rootfs");
    let mut events = Vec::new();
    let result = unpack(source, reference, &rootfs, &mut |event| events.push(event));
    (rootfs, result, events)
}

/// Builds an OCI layout from `layers` and unpacks it.
fn unpack_layers(layers: Vec<BlobLayer>) -> Unpacked {
    let dir = TempDir::new().unwrap();
    let layout = OciLayout::new(&dir.path().join("layout"));
    let manifest = layout.image(&layers);
    layout.index(&[manifest]);
    let source = ImageSource::OciLayout(layout.dir.clone());
    let (rootfs, result, events) = unpack_into(dir.path(), &source, None);
    Unpacked {
        _dir: dir,
        rootfs,
        result,
        events,
    }
}

fn plain_layers(layers: Vec<Layer>) -> Unpacked {
    unpack_layers(
        layers
            .into_iter()
            .map(|l| BlobLayer::plain(l.tar()))
            .collect(),
    )
}

fn expect_code(unpacked: &Unpacked, code: &str) -> String {
    match &unpacked.result {
        Ok(_) => panic!("expected {code}, unpack succeeded"),
        Err(err) => {
            assert_eq!(err.code(), code, "{err}");
            err.to_string()
        }
    }
}

fn read(path: impl AsRef<Path>) -> String {
    fs::read_to_string(path).unwrap()
}

fn base_layer() -> Layer {
    Layer::new()
        .dir("bin", 0o755)
        .file("bin/agent", b"#!/bin/sh\necho hi\n", 0o755)
        .dir("etc", 0o755)
        .file("etc/hostname", b"sandbox\n", 0o644)
        .symlink("etc/localtime", "/usr/share/zoneinfo/UTC")
}

#[test]
fn oci_layout_unpacks_files_modes_links_and_config() {
    let dir = TempDir::new().unwrap();
    let layout = OciLayout::new(&dir.path().join("layout"));
    let manifest = layout.image(&[BlobLayer::plain(base_layer().tar())]);
    let manifest_digest = manifest["digest"].as_str().unwrap().to_owned();
    layout.index(&[manifest]);

    let source = detect(&layout.dir).unwrap();
    assert_eq!(source, ImageSource::OciLayout(layout.dir.clone()));
    let (rootfs, result, events) = unpack_into(dir.path(), &source, None);
    let config = result.unwrap();

    assert_eq!(config.entrypoint, ["/bin/agent"]);
    assert_eq!(config.cmd, ["--serve"]);
    assert_eq!(config.env, ["PATH=/usr/bin:/bin", "MODE=test"]);
    assert_eq!(config.working_dir.as_deref(), Some("/work"));
    assert_eq!(config.user.as_deref(), Some("1000:1000"));
    assert_eq!(config.digest.as_str(), manifest_digest);

    assert_eq!(read(rootfs.join("bin/agent")), "#!/bin/sh\necho hi\n");
    let agent = fs::metadata(rootfs.join("bin/agent")).unwrap();
    assert_eq!(agent.permissions().mode() & 0o7777, 0o755);
    assert_eq!(agent.mtime(), 1_700_000_000);
    let hostname = fs::metadata(rootfs.join("etc/hostname")).unwrap();
    assert_eq!(hostname.permissions().mode() & 0o7777, 0o644);
    assert_eq!(
        fs::read_link(rootfs.join("etc/localtime")).unwrap(),
        Path::new("/usr/share/zoneinfo/UTC")
    );

    assert_eq!(events.len(), 2, "{events:?}");
    match (&events[0], &events[1]) {
        (
            Progress::LayerStarted {
                index: 0,
                count: 1,
                compressed_bytes: started,
                ..
            },
            Progress::LayerFinished {
                index: 0,
                count: 1,
                compressed_bytes,
                unpacked_bytes,
                ..
            },
        ) => {
            assert_eq!(started, compressed_bytes);
            assert_eq!(*unpacked_bytes, base_layer().tar().len() as u64);
        }
        other => panic!("unexpected progress {other:?}"),
    }
}

#[test]
fn gzip_and_zstd_layers_are_decompressed_and_verified() {
    let unpacked = unpack_layers(vec![
        BlobLayer::gzip(Layer::new().file("gz", b"from gzip", 0o644).tar()),
        BlobLayer::zstd(Layer::new().file("zst", b"from zstd", 0o644).tar()),
        BlobLayer::plain(Layer::new().file("plain", b"from tar", 0o644).tar()),
    ]);
    unpacked.result.as_ref().unwrap();
    assert_eq!(read(unpacked.rootfs.join("gz")), "from gzip");
    assert_eq!(read(unpacked.rootfs.join("zst")), "from zstd");
    assert_eq!(read(unpacked.rootfs.join("plain")), "from tar");
    assert_eq!(unpacked.events.len(), 6);
}

#[test]
fn oci_archive_plain_and_gzip_are_detected_and_unpacked() {
    let dir = TempDir::new().unwrap();
    let layout = OciLayout::new(&dir.path().join("layout"));
    let manifest = layout.image(&[BlobLayer::gzip(base_layer().tar())]);
    layout.index(&[with_ref_name(manifest, "agent:1.0")]);
    let archive = tar_dir(&layout.dir);

    for (name, bytes) in [
        ("image.tar", archive.clone()),
        ("image.tar.gz", gzip(&archive)),
    ] {
        let path = dir.path().join(name);
        fs::write(&path, bytes).unwrap();
        let source = detect(&path).unwrap();
        assert_eq!(source, ImageSource::OciArchive(path.clone()));
        let rootfs = dir.path().join(format!("rootfs-{name}"));
        let config = unpack(&source, Some("agent:1.0"), &rootfs, &mut |_| {}).unwrap();
        assert_eq!(config.cmd, ["--serve"]);
        assert_eq!(read(rootfs.join("etc/hostname")), "sandbox\n");
    }
}

#[test]
fn docker_save_archive_selects_by_repo_tag_and_verifies_diff_ids() {
    let dir = TempDir::new().unwrap();
    let first = Layer::new().file("which", b"first", 0o644).tar();
    let second = base_layer().tar();
    let mut archive = DockerArchive::new();
    archive.image(&["first:latest"], &[(first.clone(), sha256(&first))]);
    // A gzip layer in a docker archive: told by its magic bytes.
    let id = archive.image(&["agent:2"], &[(gzip(&second), sha256(&second))]);
    let path = dir.path().join("docker.tar");
    fs::write(&path, archive.finish()).unwrap();

    let source = detect(&path).unwrap();
    assert_eq!(source, ImageSource::DockerArchive(path.clone()));

    let rootfs = dir.path().join("agent");
    let config = unpack(&source, Some("agent:2"), &rootfs, &mut |_| {}).unwrap();
    assert_eq!(config.digest.as_str(), id);
    assert_eq!(read(rootfs.join("bin/agent")), "#!/bin/sh\necho hi\n");

    let rootfs = dir.path().join("first");
    unpack(&source, Some("first"), &rootfs, &mut |_| {}).unwrap();
    assert_eq!(read(rootfs.join("which")), "first");

    let err = unpack(&source, None, &dir.path().join("none"), &mut |_| {}).unwrap_err();
    assert_eq!(err.code(), "image_ambiguous");
    let err = unpack(&source, Some("other:1"), &dir.path().join("x"), &mut |_| {}).unwrap_err();
    assert_eq!(err.code(), "image_not_found");
}

#[test]
fn docker_save_layer_symlinks_are_followed_inside_the_archive() {
    let dir = TempDir::new().unwrap();
    let layer = Layer::new()
        .file("shared", b"same layer twice", 0o644)
        .tar();
    let diff_id = sha256(&layer);
    let mut archive = DockerArchive::new();
    archive.member("aaaa/layer.tar", &layer);
    archive.symlink_member("bbbb/layer.tar", "../aaaa/layer.tar");
    let config = serde_json::to_vec(&config_json(&[diff_id.clone(), diff_id])).unwrap();
    let config_name = format!("{}.json", hex(&sha256(&config)));
    archive.member(&config_name, &config);
    archive.push_entry(json!({
        "Config": config_name,
        "RepoTags": null,
        "Layers": ["aaaa/layer.tar", "bbbb/layer.tar"],
    }));
    let path = dir.path().join("docker.tar");
    fs::write(&path, archive.finish()).unwrap();
    let rootfs = dir.path().join("rootfs");
    unpack(&detect(&path).unwrap(), None, &rootfs, &mut |_| {}).unwrap();
    assert_eq!(read(rootfs.join("shared")), "same layer twice");
}

#[test]
fn docker_save_layer_not_matching_its_diff_id_is_refused() {
    let dir = TempDir::new().unwrap();
    let layer = Layer::new().file("f", b"real", 0o644).tar();
    let other = Layer::new().file("f", b"fake", 0o644).tar();
    let mut archive = DockerArchive::new();
    archive.image(&["x:1"], &[(other, sha256(&layer))]);
    let path = dir.path().join("docker.tar");
    fs::write(&path, archive.finish()).unwrap();
    let rootfs = dir.path().join("rootfs");
    let err = unpack(&detect(&path).unwrap(), None, &rootfs, &mut |_| {}).unwrap_err();
    assert_eq!(err.code(), "digest_mismatch", "{err}");
    assert!(
        !rootfs.exists(),
        "a failed unpack removes the directory it created"
    );
}

#[test]
fn whiteouts_delete_lower_files_and_directories() {
    let unpacked = plain_layers(vec![
        Layer::new()
            .dir("a", 0o755)
            .file("a/gone", b"x", 0o644)
            .file("a/kept", b"y", 0o644)
            .dir("b", 0o755)
            .file("b/inner", b"z", 0o644)
            .file("top", b"t", 0o644),
        Layer::new()
            .whiteout("a", "gone")
            .whiteout("", "b")
            .whiteout("", "never-existed"),
    ]);
    unpacked.result.as_ref().unwrap();
    let root = &unpacked.rootfs;
    assert!(!root.join("a/gone").exists());
    assert_eq!(read(root.join("a/kept")), "y");
    assert!(!root.join("b").exists());
    assert!(root.join("top").exists());
    assert!(
        !root.join("a/.wh.gone").exists(),
        "whiteouts are not written"
    );
}

#[test]
fn opaque_directory_hides_lower_content_but_keeps_its_own_layer() {
    let unpacked = plain_layers(vec![
        Layer::new()
            .dir("d", 0o755)
            .file("d/old", b"old", 0o644)
            .dir("d/sub", 0o755)
            .file("d/sub/old", b"old", 0o644)
            .file("outside", b"kept", 0o644),
        // Entries of the same layer before and after the marker both survive it.
        Layer::new()
            .dir("d", 0o755)
            .file("d/sub/new", b"new", 0o644)
            .opaque("d")
            .file("d/after", b"after", 0o644),
    ]);
    unpacked.result.as_ref().unwrap();
    let root = &unpacked.rootfs;
    assert!(!root.join("d/old").exists());
    assert!(!root.join("d/sub/old").exists());
    assert_eq!(read(root.join("d/sub/new")), "new");
    assert_eq!(read(root.join("d/after")), "after");
    assert_eq!(read(root.join("outside")), "kept");
    assert!(!root.join("d/.wh..wh..opq").exists());
}

#[test]
fn hard_links_share_an_inode_across_layers() {
    let unpacked = plain_layers(vec![
        Layer::new()
            .file("bin/busybox", b"multi-call", 0o755)
            .hardlink("bin/sh", "bin/busybox"),
        Layer::new().hardlink("bin/ls", "/bin/busybox"),
    ]);
    unpacked.result.as_ref().unwrap();
    let root = &unpacked.rootfs;
    let busybox = fs::metadata(root.join("bin/busybox")).unwrap();
    for name in ["bin/sh", "bin/ls"] {
        let linked = fs::metadata(root.join(name)).unwrap();
        assert_eq!(linked.ino(), busybox.ino(), "{name}");
    }
    assert_eq!(busybox.nlink(), 3);
}

#[test]
fn later_layers_replace_files_symlinks_and_directories() {
    let outside = TempDir::new().unwrap();
    let target = outside.path().join("target");
    fs::write(&target, "outside").unwrap();
    let target_name = target.to_str().unwrap();
    let unpacked = plain_layers(vec![
        Layer::new()
            .symlink("link", target_name)
            .dir("was-dir", 0o755)
            .file("was-dir/child", b"c", 0o644)
            .file("was-file", b"f", 0o644),
        Layer::new()
            .file("link", b"replaced", 0o644)
            .file("was-dir", b"now a file", 0o644)
            .dir("was-file", 0o750),
    ]);
    unpacked.result.as_ref().unwrap();
    let root = &unpacked.rootfs;
    assert_eq!(
        read(&target),
        "outside",
        "a file entry never writes through a link"
    );
    assert!(fs::symlink_metadata(root.join("link")).unwrap().is_file());
    assert_eq!(read(root.join("link")), "replaced");
    assert_eq!(read(root.join("was-dir")), "now a file");
    let was_file = fs::metadata(root.join("was-file")).unwrap();
    assert!(was_file.is_dir());
    assert_eq!(was_file.permissions().mode() & 0o7777, 0o750);
}

#[test]
fn symlink_to_outside_then_write_through_it_is_refused() {
    if !body_runs_here("symlink_to_outside_then_write_through_it_is_refused") {
        return;
    }
    let outside = TempDir::new().unwrap();
    let outside_name = outside.path().to_str().unwrap().to_owned();
    for target in ["/etc", outside_name.as_str(), "../../..", "."] {
        let unpacked = plain_layers(vec![Layer::new().symlink("a", target).file(
            "a/passwd",
            b"root::0:0::/:/bin/sh\n",
            0o644,
        )]);
        let message = expect_code(&unpacked, "path_escape");
        assert!(message.contains("a/passwd"), "{message}");
        assert!(!outside.path().join("passwd").exists());
    }
    // Split across layers, and for directories and hard links too.
    for second in [
        Layer::new().dir("a/newdir", 0o755),
        Layer::new().file("a/file", b"x", 0o644),
        Layer::new()
            .file("ok", b"x", 0o644)
            .hardlink("a/link", "ok"),
        Layer::new()
            .file("ok", b"x", 0o644)
            .hardlink("ok2", "a/passwd"),
        Layer::new().whiteout("a", "passwd"),
        Layer::new().opaque("a"),
    ] {
        fs::write(outside.path().join("passwd"), "host").unwrap();
        let unpacked = plain_layers(vec![Layer::new().symlink("a", &outside_name), second]);
        expect_code(&unpacked, "path_escape");
        assert_eq!(read(outside.path().join("passwd")), "host");
        assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 1);
    }
}

#[test]
fn parent_directory_entries_are_refused() {
    if !body_runs_here("parent_directory_entries_are_refused") {
        return;
    }
    let work = TempDir::new().unwrap();
    for layer in [
        Layer::new().file("../escaped", b"x", 0o644),
        Layer::new().file("ok/../../escaped", b"x", 0o644),
        Layer::new().dir("../escaped", 0o755),
        Layer::new().symlink("../escaped", "/etc"),
        Layer::new()
            .file("f", b"x", 0o644)
            .hardlink("g", "../../../etc/passwd"),
    ] {
        let unpacked = plain_layers(vec![layer]);
        expect_code(&unpacked, "path_escape");
        assert!(!unpacked.rootfs.exists());
    }
    assert!(!work.path().join("escaped").exists());
}

#[test]
fn absolute_paths_are_made_relative_and_hard_links_stay_inside() {
    if !body_runs_here("absolute_paths_are_made_relative_and_hard_links_stay_inside") {
        return;
    }
    let unpacked = plain_layers(vec![Layer::new().file("/abs/file", b"inside", 0o644).file(
        "./dot/file",
        b"dot",
        0o644,
    )]);
    unpacked.result.as_ref().unwrap();
    assert_eq!(read(unpacked.rootfs.join("abs/file")), "inside");
    assert_eq!(read(unpacked.rootfs.join("dot/file")), "dot");

    // `/etc/passwd` is the image's, which does not exist: never the host's.
    let unpacked = plain_layers(vec![Layer::new().hardlink("stolen", "/etc/passwd")]);
    let message = expect_code(&unpacked, "image_corrupt");
    assert!(message.contains("stolen"), "{message}");
}

#[test]
fn fifos_and_ownership_are_applied_and_device_nodes_left_out() {
    let unpacked = plain_layers(vec![Layer::new()
        .fifo("run/pipe")
        .char_device("dev/sda", 8, 0)
        .owned_file("home/user/file", b"mine", 1234, 5678)]);
    unpacked.result.as_ref().unwrap();
    let root = &unpacked.rootfs;
    use std::os::unix::fs::FileTypeExt;
    assert!(fs::symlink_metadata(root.join("run/pipe"))
        .unwrap()
        .file_type()
        .is_fifo());
    assert!(!root.join("dev").exists());
    let owned = fs::metadata(root.join("home/user/file")).unwrap();
    if rustix::process::geteuid().is_root() {
        assert_eq!((owned.uid(), owned.gid()), (1234, 5678));
    } else {
        assert_eq!(owned.uid(), rustix::process::geteuid().as_raw());
    }
}

#[test]
fn read_only_directories_get_their_mode_after_everything_is_written() {
    let unpacked = plain_layers(vec![
        Layer::new().dir("ro", 0o555).file("ro/a", b"a", 0o444),
        Layer::new().file("ro/b", b"b", 0o444).whiteout("ro", "a"),
    ]);
    unpacked.result.as_ref().unwrap();
    let root = &unpacked.rootfs;
    assert_eq!(read(root.join("ro/b")), "b");
    assert!(!root.join("ro/a").exists());
    let ro = fs::metadata(root.join("ro")).unwrap();
    assert_eq!(ro.permissions().mode() & 0o7777, 0o555);
    assert_eq!(ro.mtime(), 1_700_000_000);
    // Let the temporary directory be removed when not running as root.
    fs::set_permissions(root.join("ro"), fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn layer_blob_with_wrong_digest_is_refused() {
    let dir = TempDir::new().unwrap();
    let layout = OciLayout::new(&dir.path().join("layout"));
    let manifest = layout.image(&[BlobLayer::plain(base_layer().tar())]);
    layout.index(&[manifest]);
    // Overwrite the layer blob with content of the same size.
    let mut tampered = base_layer().tar();
    let digest = sha256(&tampered);
    let position = tampered.windows(7).position(|w| w == b"sandbox").unwrap();
    tampered[position..position + 7].copy_from_slice(b"hacked!");
    fs::write(
        layout.dir.join("blobs/sha256").join(hex(&digest)),
        &tampered,
    )
    .unwrap();

    let (rootfs, result, _) = unpack_into(
        dir.path(),
        &ImageSource::OciLayout(layout.dir.clone()),
        None,
    );
    let err = result.unwrap_err();
    assert_eq!(err.code(), "digest_mismatch", "{err}");
    assert!(err.to_string().contains(hex(&digest)), "{err}");
    assert!(!rootfs.exists());
}

#[test]
fn manifest_and_config_are_verified_before_use() {
    let dir = TempDir::new().unwrap();
    let layout = OciLayout::new(&dir.path().join("layout"));
    let manifest = layout.image(&[BlobLayer::plain(base_layer().tar())]);
    let manifest_path = layout
        .dir
        .join("blobs/sha256")
        .join(hex(manifest["digest"].as_str().unwrap()));
    let mut bytes = fs::read(&manifest_path).unwrap();
    bytes[0] = b' ';
    fs::write(&manifest_path, &bytes).unwrap();
    layout.index(std::slice::from_ref(&manifest));
    let (_, result, _) = unpack_into(
        dir.path(),
        &ImageSource::OciLayout(layout.dir.clone()),
        None,
    );
    assert_eq!(result.unwrap_err().code(), "digest_mismatch");

    // The descriptor's size is checked too.
    let mut wrong_size = manifest;
    wrong_size["size"] = json!(bytes.len() - 1);
    layout.index(&[wrong_size]);
    let (_, result, _) = unpack_into(
        dir.path(),
        &ImageSource::OciLayout(layout.dir.clone()),
        None,
    );
    assert_eq!(result.unwrap_err().code(), "digest_mismatch");
}

#[test]
fn truncated_layers_are_corrupt() {
    let mut content = Vec::new();
    for i in 0..4000u32 {
        content.extend_from_slice(&i.to_le_bytes());
    }
    let tar = Layer::new()
        .file("first", &content, 0o644)
        .file("second", &content, 0o644)
        .tar();
    // Cuts inside the data of `first`, and inside the padding after it.
    for (cut, named) in [(700, true), (512 + 8000, true), (512 + 16000 + 100, false)] {
        let truncated = tar[..cut].to_vec();
        // The descriptor matches the truncated blob: only the tar reader can notice.
        let unpacked = unpack_layers(vec![BlobLayer {
            diff_id: sha256(&truncated),
            blob: truncated,
            media_type: MEDIA_TAR,
        }]);
        let message = expect_code(&unpacked, "image_corrupt");
        if named {
            assert!(message.contains("entry first is truncated"), "{message}");
        }
    }
    let gz = gzip(&tar);
    let unpacked = unpack_layers(vec![BlobLayer {
        diff_id: sha256(&tar),
        blob: gz[..gz.len() / 2].to_vec(),
        media_type: MEDIA_TAR_GZIP,
    }]);
    expect_code(&unpacked, "image_corrupt");
}

#[test]
fn size_limits_are_enforced() {
    let dir = TempDir::new().unwrap();
    let layout = OciLayout::new(&dir.path().join("layout"));
    let big = vec![7u8; 64 * 1024];
    let manifest = layout.image(&[BlobLayer::gzip(Layer::new().file("big", &big, 0o644).tar())]);
    layout.index(&[manifest]);
    let source = ImageSource::OciLayout(layout.dir.clone());

    let mut options = UnpackOptions::default();
    options.limits = {
        let mut limits = Limits::default();
        limits.max_unpacked_bytes = 32 * 1024;
        limits
    };
    let rootfs = dir.path().join("small");
    let err = unpack_with(&source, None, &rootfs, &options, &mut |_| {}).unwrap_err();
    assert_eq!(err.code(), "too_large", "{err}");
    assert!(!rootfs.exists());

    options.limits = {
        let mut limits = Limits::default();
        limits.max_json_bytes = 64;
        limits
    };
    let err = unpack_with(
        &source,
        None,
        &dir.path().join("json"),
        &options,
        &mut |_| {},
    )
    .unwrap_err();
    assert_eq!(err.code(), "too_large", "{err}");

    let layout = OciLayout::new(&dir.path().join("many"));
    let manifest = layout.image(&[
        BlobLayer::plain(
            Layer::new()
                .file("a", b"", 0o644)
                .file("b", b"", 0o644)
                .tar(),
        ),
        BlobLayer::plain(
            Layer::new()
                .file("c", b"", 0o644)
                .file("d", b"", 0o644)
                .tar(),
        ),
    ]);
    layout.index(&[manifest]);
    options.limits = {
        let mut limits = Limits::default();
        limits.max_entries = 3;
        limits
    };
    let source = ImageSource::OciLayout(layout.dir.clone());
    let err = unpack_with(
        &source,
        None,
        &dir.path().join("entries"),
        &options,
        &mut |_| {},
    )
    .unwrap_err();
    assert_eq!(err.code(), "too_large", "{err}");
    assert!(err.to_string().contains("3 entries"), "{err}");
    options.limits.max_entries = 4;
    unpack_with(
        &source,
        None,
        &dir.path().join("four"),
        &options,
        &mut |_| {},
    )
    .unwrap();

    // The index of an archive's own members counts too.
    let archive = dir.path().join("many.tar");
    fs::write(&archive, tar_dir(&layout.dir)).unwrap();
    let source = ImageSource::OciArchive(archive.clone());
    let err = unpack_with(
        &source,
        None,
        &dir.path().join("members"),
        &options,
        &mut |_| {},
    )
    .unwrap_err();
    assert_eq!(err.code(), "too_large", "{err}");
    assert!(err.to_string().contains("many.tar"), "{err}");
}

#[test]
fn references_and_platforms_select_the_image() {
    let dir = TempDir::new().unwrap();
    let layout = OciLayout::new(&dir.path().join("layout"));
    let image = |content: &str| {
        layout.image(&[BlobLayer::plain(
            Layer::new().file("which", content.as_bytes(), 0o644).tar(),
        )])
    };
    let arm = with_platform(image("arm64"), "linux", "arm64");
    let amd = with_platform(image("amd64"), "linux", "amd64");
    let multi = layout.json_blob(
        &json!({"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": [arm.clone(), amd]}),
        MEDIA_INDEX,
    );
    let single = image("single");
    layout.index(&[with_ref_name(multi, "multi"), with_ref_name(single, "v1")]);
    let source = ImageSource::OciLayout(layout.dir.clone());
    let run = |reference: Option<&str>, name: &str| {
        let rootfs = dir.path().join(name);
        unpack(&source, reference, &rootfs, &mut |_| {}).map(|_| read(rootfs.join("which")))
    };

    assert_eq!(run(Some("multi"), "a").unwrap(), "amd64");
    assert_eq!(run(Some("v1"), "b").unwrap(), "single");
    assert_eq!(
        run(Some("registry.example:5000/app:v1"), "c").unwrap(),
        "single"
    );
    assert_eq!(run(None, "d").unwrap_err().code(), "image_ambiguous");
    assert_eq!(run(Some("v2"), "e").unwrap_err().code(), "image_not_found");

    let arm_only = layout.json_blob(
        &json!({"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": [arm, with_platform(image("ppc"), "linux", "ppc64le")]}),
        MEDIA_INDEX,
    );
    layout.index(&[arm_only]);
    assert_eq!(run(None, "f").unwrap_err().code(), "platform_not_found");
}

#[test]
fn unknown_layer_media_types_are_refused() {
    let unpacked = unpack_layers(vec![BlobLayer {
        blob: base_layer().tar(),
        media_type: "application/vnd.example.squashfs",
        diff_id: sha256(&base_layer().tar()),
    }]);
    let message = expect_code(&unpacked, "unsupported_media_type");
    assert!(message.contains("squashfs"), "{message}");
}

#[test]
fn destination_must_be_empty_and_is_emptied_on_failure() {
    if !body_runs_here("destination_must_be_empty_and_is_emptied_on_failure") {
        return;
    }
    let dir = TempDir::new().unwrap();
    let layout = OciLayout::new(&dir.path().join("layout"));
    let good = layout.image(&[BlobLayer::plain(base_layer().tar())]);
    layout.index(&[good]);
    let source = ImageSource::OciLayout(layout.dir.clone());

    let busy = dir.path().join("busy");
    fs::create_dir(&busy).unwrap();
    fs::write(busy.join("precious"), "keep").unwrap();
    let err = unpack(&source, None, &busy, &mut |_| {}).unwrap_err();
    assert_eq!(err.code(), "destination_not_empty");
    assert_eq!(read(busy.join("precious")), "keep");

    let outside = TempDir::new().unwrap();
    let layers = [
        BlobLayer::plain(base_layer().tar()),
        BlobLayer::plain(
            Layer::new()
                .symlink("x", outside.path().to_str().unwrap())
                .file("x/y", b"", 0o644)
                .tar(),
        ),
    ];
    let bad = layout.image(&layers);
    layout.index(&[bad]);
    let empty = dir.path().join("empty");
    fs::create_dir(&empty).unwrap();
    let err = unpack(&source, None, &empty, &mut |_| {}).unwrap_err();
    assert_eq!(err.code(), "path_escape");
    assert!(empty.is_dir(), "a directory the caller made is kept");
    assert!(!outside.path().join("y").exists());
    assert_eq!(fs::read_dir(&empty).unwrap().count(), 0);
}

#[test]
fn detect_refuses_what_is_not_an_image() {
    let dir = TempDir::new().unwrap();
    let missing = detect(&dir.path().join("missing")).unwrap_err();
    assert_eq!(missing.code(), "image_not_found");
    assert_eq!(detect(dir.path()).unwrap_err().code(), "image_unrecognized");
    let garbage = dir.path().join("garbage.tar");
    fs::write(&garbage, b"this is not a tarball at all").unwrap();
    assert_eq!(detect(&garbage).unwrap_err().code(), "image_unrecognized");
    let plain = dir.path().join("plain.tar");
    fs::write(&plain, Layer::new().file("hello", b"hi", 0o644).tar()).unwrap();
    let err = detect(&plain).unwrap_err();
    assert_eq!(err.code(), "image_unrecognized");
    assert!(err.to_string().contains("plain.tar"), "{err}");
}

#[test]
fn digests_in_descriptors_cannot_name_paths() {
    let dir = TempDir::new().unwrap();
    let layout = OciLayout::new(&dir.path().join("layout"));
    fs::write(dir.path().join("secret"), "{}").unwrap();
    layout.index(&[json!({
        "mediaType": MEDIA_MANIFEST,
        "digest": "sha256:../../../secret",
        "size": 2
    })]);
    let (_, result, _) = unpack_into(
        dir.path(),
        &ImageSource::OciLayout(layout.dir.clone()),
        None,
    );
    assert_eq!(result.unwrap_err().code(), "unsupported_digest");
}

#[test]
fn hard_link_whose_target_lies_inside_its_own_path_is_corrupt() {
    let unpacked = plain_layers(vec![Layer::new()
        .file("a/b", b"x", 0o644)
        .hardlink("a", "a/b")]);
    let message = expect_code(&unpacked, "image_corrupt");
    assert!(message.contains("hard link a"), "{message}");
}

#[test]
fn compressed_blob_is_verified_even_when_it_decompresses_to_the_right_tar() {
    let dir = TempDir::new().unwrap();
    let layout = OciLayout::new(&dir.path().join("layout"));
    let layer = BlobLayer::gzip(base_layer().tar());
    let digest = sha256(&layer.blob);
    let manifest = layout.image(&[layer]);
    layout.index(&[manifest]);
    // Same size, same uncompressed tar (so the diff id still matches), other bytes: the
    // operating-system byte of the gzip header.
    let blob_path = layout.dir.join("blobs/sha256").join(hex(&digest));
    let mut blob = fs::read(&blob_path).unwrap();
    blob[9] = blob[9].wrapping_add(1);
    fs::write(&blob_path, &blob).unwrap();

    let (rootfs, result, _) = unpack_into(
        dir.path(),
        &ImageSource::OciLayout(layout.dir.clone()),
        None,
    );
    let err = result.unwrap_err();
    assert_eq!(err.code(), "digest_mismatch", "{err}");
    assert!(err.to_string().contains(hex(&digest)), "{err}");
    assert!(!rootfs.exists());
}

#[test]
fn docker_25_archive_finds_repo_tags_its_index_does_not_name() {
    let dir = TempDir::new().unwrap();
    let layout = OciLayout::new(&dir.path().join("layout"));
    let layer = Layer::new().file("which", b"docker 25", 0o644).tar();
    let manifest = layout.image(&[BlobLayer::plain(layer.clone())]);
    let manifest_bytes = fs::read(
        layout
            .dir
            .join("blobs/sha256")
            .join(hex(manifest["digest"].as_str().unwrap())),
    )
    .unwrap();
    let manifest_json: serde_json::Value = serde_json::from_slice(&manifest_bytes).unwrap();
    let config = manifest_json["config"]["digest"]
        .as_str()
        .unwrap()
        .to_owned();
    let layer_digest = manifest_json["layers"][0]["digest"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut annotated = with_ref_name(manifest, "3.19");
    annotated["annotations"]["io.containerd.image.name"] = json!("docker.io/library/alpine:3.19");
    layout.index(&[annotated]);
    fs::write(
        layout.dir.join("manifest.json"),
        serde_json::to_vec(&json!([{
            "Config": format!("blobs/sha256/{}", hex(&config)),
            "RepoTags": ["alpine:3.19", "alpine:latest"],
            "Layers": [format!("blobs/sha256/{}", hex(&layer_digest))],
        }]))
        .unwrap(),
    )
    .unwrap();
    let archive = dir.path().join("docker25.tar");
    fs::write(&archive, tar_dir(&layout.dir)).unwrap();
    let source = detect(&archive).unwrap();
    assert_eq!(source, ImageSource::OciArchive(archive.clone()));

    for (reference, name) in [
        ("alpine:3.19", "by-tag"),
        ("docker.io/library/alpine:3.19", "by-name"),
        ("alpine", "by-repo-tags"),
    ] {
        let rootfs = dir.path().join(name);
        unpack(&source, Some(reference), &rootfs, &mut |_| {}).unwrap();
        assert_eq!(read(rootfs.join("which")), "docker 25", "{reference}");
    }
    let err = unpack(
        &source,
        Some("busybox"),
        &dir.path().join("none"),
        &mut |_| {},
    )
    .unwrap_err();
    assert_eq!(err.code(), "image_not_found");
    assert!(err.to_string().contains("busybox"), "{err}");
}

#[test]
fn oversized_long_names_are_refused_before_they_are_read() {
    let mut builder = tar::Builder::new(Vec::new());
    let long = "d/".repeat(600 * 1024) + "file";
    let mut header = tar::Header::new_gnu();
    header.set_size(1);
    header.set_mode(0o644);
    builder.append_data(&mut header, &long, &b"x"[..]).unwrap();
    let tar = builder.into_inner().unwrap();
    let unpacked = unpack_layers(vec![BlobLayer::gzip(tar)]);
    let message = expect_code(&unpacked, "too_large");
    assert!(message.contains("long name"), "{message}");

    // A long name of ordinary length is fine.
    let mut builder = tar::Builder::new(Vec::new());
    let long = "d/".repeat(200) + "file";
    let mut header = tar::Header::new_gnu();
    header.set_size(1);
    header.set_mode(0o644);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    builder.append_data(&mut header, &long, &b"x"[..]).unwrap();
    let unpacked = unpack_layers(vec![BlobLayer::plain(builder.into_inner().unwrap())]);
    unpacked.result.as_ref().unwrap();
    assert_eq!(read(unpacked.rootfs.join(long)), "x");
}
