//! Image templates: an OCI archive made here (a shell, its libraries and a file) becomes a
//! template through the API; its env, working directory and files are what a sandbox sees.

mod common;

use common::*;
use torpor_api::types::ExecBody;
use torpor_core::{TemplateName, TemplateSource, TemplateSpec};

#[tokio::test(flavor = "multi_thread")]
async fn an_oci_archive_becomes_a_template() {
    let d = Daemon::start().await;
    let c = d.client();
    let image = d.dir.join("tiny.tar");
    make_image(&image, &[]);
    let spec = |name: &str, reference: Option<&str>| TemplateSpec {
        name: TemplateName::new(name).unwrap(),
        source: TemplateSource::Image {
            path: image.to_string_lossy().into_owned(),
            reference: reference.map(String::from),
        },
        command: vec![],
        env: Default::default(),
        cwd: None,
        limits: Default::default(),
        idle: no_idle(),
        warmup_ms: 0,
        gpu: None,
        network: None,
    };
    let t = c
        .create_template(&spec("tiny", Some("tiny")))
        .await
        .unwrap();
    assert_eq!(t.status, "ready");
    let id = create(&c, "tiny").await;
    let r = c
        .exec(
            &id,
            &ExecBody {
                cmd: vec![
                    "/bin/sh".into(),
                    "-c".into(),
                    "echo $GREETING; pwd; read l < /app/hello.txt; echo $l".into(),
                ],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(r.stdout, "from-image\n/app\nhi from image\n", "{r:?}");
    // The image's own files, not the host's: there is no python here.
    let r = c
        .exec(
            &id,
            &ExecBody {
                cmd: vec!["/usr/bin/python3".into()],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(127));

    // Bad images answer with the image error's code.
    let err = c
        .create_template(&spec("nope", Some("no-such-ref")))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("image_not_found"), "{err}");
    std::fs::write(d.dir.join("garbage.tar"), b"not a tarball at all").unwrap();
    let mut bad = spec("garbage", None);
    bad.source = TemplateSource::Image {
        path: d.dir.join("garbage.tar").to_string_lossy().into_owned(),
        reference: None,
    };
    let err = c.create_template(&bad).await.unwrap_err();
    assert!(err.code().is_some_and(|c| c.starts_with("image_")), "{err}");
    assert!(c
        .templates()
        .await
        .unwrap()
        .iter()
        .all(|t| t.name != "garbage"));
}

/// Every path under `root` that has a set-id bit or is a device node.
fn set_id_files_and_devices(root: &std::path::Path) -> Vec<String> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let mut found = Vec::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for item in std::fs::read_dir(&dir).unwrap() {
            let path = item.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let kind = meta.file_type();
            if meta.permissions().mode() & 0o6000 != 0
                || kind.is_block_device()
                || kind.is_char_device()
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

#[tokio::test(flavor = "multi_thread")]
async fn an_image_cannot_plant_set_id_binaries_or_device_nodes_on_the_host() {
    let d = Daemon::start().await;
    let c = d.client();
    let image = d.dir.join("hostile.tar");
    make_image(&image, &["hostile"]);
    let spec = TemplateSpec {
        name: TemplateName::new("hostile").unwrap(),
        source: TemplateSource::Image {
            path: image.to_string_lossy().into_owned(),
            reference: None,
        },
        command: vec![],
        env: Default::default(),
        cwd: None,
        limits: Default::default(),
        idle: no_idle(),
        warmup_ms: 0,
        gpu: None,
        network: None,
    };
    let t = c.create_template(&spec).await.unwrap();
    assert_eq!(t.status, "ready");

    // On the host: the template's root filesystem holds the binaries, without their
    // set-id bits, and no device node.
    let rootfs = d.dir.join("templates/hostile/rootfs");
    assert!(rootfs.join("bin/su").is_file(), "{}", rootfs.display());
    assert_eq!(set_id_files_and_devices(&rootfs), Vec::<String>::new());

    // In the sandbox: the same files, still runnable, not set-id.
    let id = create(&c, "hostile").await;
    let r = c
        .exec(
            &id,
            &ExecBody {
                cmd: vec![
                    "/bin/sh".into(),
                    "-c".into(),
                    "test -u /bin/su && echo setuid; test -g /bin/wall && echo setgid; \
                     /bin/su -c 'echo runs'"
                        .into(),
                ],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(r.stdout, "runs\n", "{r:?}");
}
