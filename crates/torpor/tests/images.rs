//! Image templates: an OCI archive made here (a shell, its libraries and a file) becomes a
//! template through the API; its env, working directory and files are what a sandbox sees.

mod common;

use common::*;
use torpor_api::types::ExecBody;
use torpor_core::{TemplateName, TemplateSource, TemplateSpec};

/// Builds an oci-archive from a tiny root filesystem: /bin/sh (the host's dash) with the
/// libraries it loads, and /app/hello.txt. Config: env GREETING, working dir /app.
const MAKE_IMAGE: &str = r#"
import hashlib, io, json, os, subprocess, sys, tarfile
out = sys.argv[1]
def add_file(tar, host, inside):
    tar.add(os.path.realpath(host), arcname=inside.lstrip("/"))
layer = io.BytesIO()
with tarfile.open(fileobj=layer, mode="w") as t:
    add_file(t, "/bin/dash", "/bin/sh")
    for line in subprocess.run(["ldd", "/bin/dash"], capture_output=True, text=True).stdout.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if path.startswith("/"):
            add_file(t, path, path)
    data = b"hi from image\n"
    info = tarfile.TarInfo("app/hello.txt"); info.size = len(data); t.addfile(info, io.BytesIO(data))
layer = layer.getvalue()
def blob(b): return "sha256:" + hashlib.sha256(b).hexdigest()
config = json.dumps({"architecture": "amd64", "os": "linux",
    "config": {"Env": ["GREETING=from-image", "PATH=/bin"], "WorkingDir": "/app"},
    "rootfs": {"type": "layers", "diff_ids": [blob(layer)]}}).encode()
manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
    "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": blob(config), "size": len(config)},
    "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": blob(layer), "size": len(layer)}]}).encode()
index = json.dumps({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
    "digest": blob(manifest), "size": len(manifest), "annotations": {"org.opencontainers.image.ref.name": "tiny"}}]}).encode()
with tarfile.open(out, "w") as t:
    def put(name, b):
        info = tarfile.TarInfo(name); info.size = len(b); t.addfile(info, io.BytesIO(b))
    put("oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
    put("index.json", index)
    for b in (layer, config, manifest):
        put("blobs/sha256/" + blob(b)[7:], b)
"#;

#[tokio::test(flavor = "multi_thread")]
async fn an_oci_archive_becomes_a_template() {
    let d = Daemon::start().await;
    let c = d.client();
    let image = d.dir.join("tiny.tar");
    let st = std::process::Command::new("python3")
        .args(["-c", MAKE_IMAGE])
        .arg(&image)
        .status()
        .unwrap();
    assert!(st.success());
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
