//! Images written by a real tool rather than by these tests' own builders: umoci makes an OCI
//! layout from directories, with gzip layers, its own whiteouts and its own annotations.
//! Run with `scripts/test-real-images.sh`, which installs umoci when it is missing.

use std::fs;
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

use tempfile::TempDir;
use torpor_image::{detect, unpack, ImageSource, Progress};

fn umoci(args: &[&str]) {
    let mut command = Command::new("umoci");
    command.args(args);
    let output = command.output().expect("umoci runs");
    assert!(
        output.status.success(),
        "umoci {args:?} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

fn rootless() -> Vec<&'static str> {
    if rustix::process::geteuid().is_root() {
        Vec::new()
    } else {
        vec!["--rootless"]
    }
}

/// Unpacks `image` with umoci into `bundle`, lets `change` edit its root filesystem, and
/// commits the difference as a new layer.
fn add_layer(image: &str, bundle: &Path, change: impl FnOnce(&Path)) {
    let bundle_name = bundle.to_str().unwrap();
    let mut args = vec!["unpack"];
    args.extend(rootless());
    args.extend(["--image", image, bundle_name]);
    umoci(&args);
    change(&bundle.join("rootfs"));
    umoci(&["repack", "--image", image, bundle_name]);
}

#[test]
#[ignore = "needs umoci; run scripts/test-real-images.sh"]
fn umoci_layout_with_whiteouts_and_config() {
    let dir = TempDir::new().unwrap();
    let layout = dir.path().join("layout");
    let layout_name = layout.to_str().unwrap();
    let image = format!("{layout_name}:agent");
    umoci(&["init", "--layout", layout_name]);
    umoci(&["new", "--image", &image]);

    add_layer(&image, &dir.path().join("bundle1"), |rootfs| {
        fs::create_dir_all(rootfs.join("bin")).unwrap();
        fs::write(rootfs.join("bin/agent"), "#!/bin/sh\necho agent\n").unwrap();
        fs::set_permissions(rootfs.join("bin/agent"), fs::Permissions::from_mode(0o755)).unwrap();
        fs::hard_link(rootfs.join("bin/agent"), rootfs.join("bin/agent-hard")).unwrap();
        symlink("agent", rootfs.join("bin/agent-link")).unwrap();
        fs::create_dir_all(rootfs.join("etc/conf.d")).unwrap();
        fs::write(rootfs.join("etc/conf.d/old"), "old").unwrap();
        fs::write(rootfs.join("etc/gone"), "gone").unwrap();
    });
    add_layer(&image, &dir.path().join("bundle2"), |rootfs| {
        fs::remove_file(rootfs.join("etc/gone")).unwrap();
        fs::remove_dir_all(rootfs.join("etc/conf.d")).unwrap();
        fs::create_dir(rootfs.join("etc/conf.d")).unwrap();
        fs::write(rootfs.join("etc/conf.d/new"), "new").unwrap();
    });
    umoci(&[
        "config",
        "--image",
        &image,
        "--config.entrypoint",
        "/bin/agent",
        "--config.cmd",
        "--serve",
        "--config.env",
        "MODE=real",
        "--config.workingdir",
        "/srv",
    ]);

    let source = detect(&layout).unwrap();
    assert_eq!(source, ImageSource::OciLayout(layout.clone()));
    let rootfs = dir.path().join("rootfs");
    let mut finished = 0;
    let config = unpack(&source, Some("agent"), &rootfs, &mut |event| {
        if let Progress::LayerFinished { .. } = event {
            finished += 1;
        }
    })
    .unwrap();

    assert_eq!(finished, 2);
    assert_eq!(config.entrypoint, ["/bin/agent"]);
    assert_eq!(config.cmd, ["--serve"]);
    assert!(
        config.env.contains(&"MODE=real".to_owned()),
        "{:?}",
        config.env
    );
    assert_eq!(config.working_dir.as_deref(), Some("/srv"));
    assert!(config.digest.as_str().starts_with("sha256:"));

    let agent = fs::metadata(rootfs.join("bin/agent")).unwrap();
    assert_eq!(agent.permissions().mode() & 0o777, 0o755);
    assert_eq!(
        fs::metadata(rootfs.join("bin/agent-hard")).unwrap().ino(),
        agent.ino()
    );
    assert_eq!(
        fs::read_link(rootfs.join("bin/agent-link")).unwrap(),
        Path::new("agent")
    );
    assert!(!rootfs.join("etc/gone").exists());
    assert!(!rootfs.join("etc/conf.d/old").exists());
    assert_eq!(
        fs::read_to_string(rootfs.join("etc/conf.d/new")).unwrap(),
        "new"
    );

    // The same layout as an oci-archive.
    let archive = dir.path().join("agent.tar");
    let status = Command::new("tar")
        .args(["-cf", archive.to_str().unwrap(), "-C", layout_name, "."])
        .status()
        .unwrap();
    assert!(status.success());
    let source = detect(&archive).unwrap();
    assert_eq!(source, ImageSource::OciArchive(archive.clone()));
    let from_archive = dir.path().join("rootfs-archive");
    let again = unpack(&source, Some("agent"), &from_archive, &mut |_| {}).unwrap();
    assert_eq!(again, config);
    assert_eq!(
        fs::read_to_string(from_archive.join("etc/conf.d/new")).unwrap(),
        "new"
    );
}
