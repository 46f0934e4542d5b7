//! Tenant ↔ host and tenant ↔ tenant: host paths, uploads, lists, quotas, secrets at rest.

use std::os::unix::fs::PermissionsExt;

use serde_json::{json, Value};
use torpor_api::client::UploadKind;
use torpor_api::types::{CreateSandboxBody, CreateTenantBody, Quotas};
use torpor_api::{Client, ClientError};

use crate::common::*;

/// Makes a tenant and its client.
async fn tenant(d: &Daemon, name: &str, quotas: Quotas) -> Client {
    tenant_with_token(d, name, quotas).await.0
}

async fn tenant_with_token(d: &Daemon, name: &str, quotas: Quotas) -> (Client, String) {
    let t = d
        .client()
        .create_tenant(&CreateTenantBody {
            name: name.into(),
            quotas: Some(quotas),
        })
        .await
        .unwrap();
    (Client::new(&d.url(), &t.token), t.token)
}

/// Nothing is left in the upload directory (or it was never made).
fn no_uploads_kept(d: &Daemon) -> bool {
    std::fs::read_dir(d.dir.join("uploads")).map_or(true, |mut rd| rd.next().is_none())
}

/// Status, code and message of a refused call.
fn refusal(e: ClientError) -> (u16, String, String) {
    match e {
        ClientError::Api {
            status,
            code,
            message,
            ..
        } => (status, code, message),
        other => panic!("not an API refusal: {other}"),
    }
}

async fn post_template(token: &str, d: &Daemon, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{}/v1/templates", d.url()))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_cannot_name_host_paths_and_learns_nothing_of_them() {
    let d = Daemon::start().await;
    let (a, token) = tenant_with_token(&d, "team-a", Quotas::default()).await;
    let data_dir = d.dir.to_string_lossy().into_owned();
    let mut bodies = Vec::new();
    for (kind, path) in [
        ("rootfs", "/etc"),
        ("rootfs", data_dir.as_str()),
        ("rootfs", "/no/such/dir"),
        ("image", "/etc/shadow"),
        ("image", "/no/such/file.tar"),
        ("image", "etc"),
    ] {
        let (status, body) = post_template(
            &token,
            &d,
            json!({"name": "x", "source": {"kind": kind, "path": path}}),
        )
        .await;
        assert_eq!(status, 403, "{kind} {path}: {body}");
        assert_eq!(body["error"]["code"], "forbidden", "{body}");
        let message = body["error"]["message"].as_str().unwrap().to_string();
        assert!(
            !message.contains(path),
            "the refusal names the path: {message}"
        );
        bodies.push(message);
    }
    // The same answer whether the path exists or not: no oracle of the host's files.
    assert!(bodies.windows(2).all(|w| w[0] == w[1]), "{bodies:?}");
    // Nothing was registered, and the operator may still name host paths.
    assert!(a.templates().await.unwrap().iter().all(|t| t.name != "x"));
    let (status, body) = post_template(
        &d.token(),
        &d,
        json!({"name": "op", "source": {"kind": "image", "path": "/no/such/file.tar"}}),
    )
    .await;
    assert_ne!(status, 403, "{body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_may_name_only_paths_inside_the_import_dir() {
    let imports = tempfile::tempdir().unwrap();
    std::fs::create_dir(imports.path().join("sub")).unwrap();
    std::fs::write(imports.path().join("sub/not-an-image.tar"), b"junk").unwrap();
    std::os::unix::fs::symlink("/etc", imports.path().join("escape")).unwrap();
    let dir = imports.path().to_string_lossy().into_owned();
    let d = Daemon::start_with(&["--import-dir", &dir]).await;
    let (_, token) = tenant_with_token(&d, "team-a", Quotas::default()).await;
    for path in [
        format!("{dir}/../../etc"),
        format!("{dir}/escape"),
        "escape/shadow".to_string(),
        "../etc".to_string(),
        "/etc/shadow".to_string(),
    ] {
        let (status, body) = post_template(
            &token,
            &d,
            json!({"name": "x", "source": {"kind": "image", "path": path}}),
        )
        .await;
        assert_eq!(status, 403, "{path}: {body}");
        assert_eq!(body["error"]["code"], "forbidden");
    }
    // Inside the import directory the check passes: the archive itself is then refused for
    // what it is (not an image), absolute or relative.
    for path in [
        format!("{dir}/sub/not-an-image.tar"),
        "sub/not-an-image.tar".into(),
    ] {
        let (status, body) = post_template(
            &token,
            &d,
            json!({"name": "y", "source": {"kind": "image", "path": path}}),
        )
        .await;
        assert_eq!(status, 400, "{body}");
        assert_ne!(body["error"]["code"], "forbidden");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_uploads_its_image_and_setuid_bits_and_devices_do_not_survive() {
    let d = Daemon::start().await;
    let a = tenant(&d, "team-a", Quotas::default()).await;
    let b = tenant(&d, "team-b", Quotas::default()).await;
    let image = tempfile::NamedTempFile::new().unwrap();
    make_image(image.path(), &["hostile"]);
    let tpl = a
        .upload_template_image(
            "mine",
            &json!({"command": [], "limits": {"memory_mib": 128, "cpus": 1.0, "pids": 256}}),
            image.path(),
            UploadKind::Image,
            None,
        )
        .await
        .unwrap();
    assert_eq!(tpl.status, "ready");
    // The upload's place on the host is not shown.
    let shown = serde_json::to_string(&tpl.source).unwrap();
    assert!(!shown.contains(d.dir.to_str().unwrap()), "{shown}");
    assert!(no_uploads_kept(&d));
    // It runs, with its files.
    let id = create(&a, "mine").await;
    let out = a
        .exec(&id, &sh("read l < /app/hello.txt; echo \"$l\""))
        .await
        .unwrap();
    assert_eq!(out.stdout, "hi from image\n", "{out:?}");
    // On the host, the template's root filesystem has no setuid file and no device node.
    // A tenant's templates live under templates/@<tenant>/.
    let rootfs = std::fs::read_dir(d.dir.join("templates/@team-a"))
        .unwrap()
        .flatten()
        .map(|e| e.path().join("rootfs"))
        .find(|p| p.join("bin/su").exists())
        .expect("the template's rootfs");
    let mode = std::fs::metadata(rootfs.join("bin/su"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o6000, 0, "setuid kept: {mode:o}");
    assert!(!rootfs.join("dev/mem").exists() && !rootfs.join("dev/sda").exists());
    // Another tenant neither sees nor uses it.
    assert!(b
        .templates()
        .await
        .unwrap()
        .iter()
        .all(|t| t.name != "mine"));
    let e = b
        .create_sandbox(&CreateSandboxBody {
            template: "mine".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(refusal(e).0, 404);
    // A corrupt upload is refused for what it is, and its error names no host path.
    let junk = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(junk.path(), b"not an archive at all").unwrap();
    let (status, code, message) = refusal(
        a.upload_template_image("junk", &json!({}), junk.path(), UploadKind::Image, None)
            .await
            .unwrap_err(),
    );
    assert_eq!(status, 400, "{code}: {message}");
    assert!(!message.contains(d.dir.to_str().unwrap()), "{message}");
    assert!(no_uploads_kept(&d));
}

#[tokio::test(flavor = "multi_thread")]
async fn uploads_and_builds_count_against_quotas() {
    let d = Daemon::start().await;
    let (a, token) = tenant_with_token(
        &d,
        "small",
        Quotas {
            max_templates: Some(1),
            max_disk_mib: Some(1),
            ..Default::default()
        },
    )
    .await;
    // Over the disk quota while it arrives: refused, nothing kept.
    let big = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(big.path(), vec![7u8; 3 << 20]).unwrap();
    let (status, code, _) = refusal(
        a.upload_template_image("big", &json!({}), big.path(), UploadKind::Image, None)
            .await
            .unwrap_err(),
    );
    assert_eq!((status, code.as_str()), (429, "quota_exceeded"));
    assert!(no_uploads_kept(&d));
    // One template is allowed; the second is refused before it is built.
    let one = json!({"name": "one", "source": {"kind": "host"}, "limits": {"memory_mib": 64, "cpus": 1.0, "pids": 64}});
    let (status, body) = post_template(&token, &d, one).await;
    assert_eq!(status, 201, "{body}");
    let two = json!({"name": "two", "source": {"kind": "host"}});
    let (status, body) = post_template(&token, &d, two).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "quota_exceeded");
    assert_eq!(body["error"]["details"]["quota"], "templates");
}

#[tokio::test(flavor = "multi_thread")]
async fn limits_beyond_the_node_or_the_tenants_cpus_are_refused() {
    let d = Daemon::start().await;
    let a = tenant(
        &d,
        "cpu",
        Quotas {
            max_cpus: Some(1),
            ..Default::default()
        },
    )
    .await;
    let try_create = |limits: Value| {
        let a = a.clone();
        async move {
            let body: CreateSandboxBody =
                serde_json::from_value(json!({"template": "host", "limits": limits})).unwrap();
            a.create_sandbox(&body).await
        }
    };
    for (limits, what) in [
        (json!({"memory_mib": 1u64 << 20}), "memory"),
        (json!({"pids": 4_000_000}), "pids"),
        (json!({"cpus": 1024.0}), "cpus"),
    ] {
        let (status, code, message) = refusal(try_create(limits).await.unwrap_err());
        assert_eq!(
            (status, code.as_str()),
            (400, "invalid_request"),
            "{what}: {message}"
        );
    }
    let id = try_create(json!({"cpus": 1.0})).await.unwrap().id;
    let e = try_create(json!({"cpus": 0.5})).await.unwrap_err();
    match e {
        ClientError::Api {
            status, details, ..
        } => {
            assert_eq!(status, 429);
            assert_eq!(details.unwrap()["quota"], "cpus");
        }
        other => panic!("{other}"),
    }
    a.delete_sandbox(&id).await.unwrap();
    try_create(json!({"cpus": 0.5})).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_does_not_see_the_operators_or_another_tenants_sandboxes() {
    let d = Daemon::start().await;
    let admin = d.client();
    let a = tenant(&d, "team-a", Quotas::default()).await;
    let b = tenant(&d, "team-b", Quotas::default()).await;
    let op = admin
        .create_sandbox(&CreateSandboxBody {
            template: "host".into(),
            metadata: [("owner".to_string(), "operator".to_string())].into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let mine = create(&a, "host").await;
    let listed: Vec<String> = a
        .sandboxes(None)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(listed, vec![mine.clone()]);
    assert!(b.sandboxes(None).await.unwrap().is_empty());
    for (client, id) in [(&a, &op.id), (&b, &op.id), (&b, &mine)] {
        let (status, code, _) = refusal(client.sandbox(id).await.unwrap_err());
        assert_eq!((status, code.as_str()), (404, "not_found"));
        let (status, _, _) = refusal(client.exec(id, &sh("true")).await.unwrap_err());
        assert_eq!(status, 404);
    }
    // The admin sees both.
    let all = admin.sandboxes(None).await.unwrap();
    assert!(all.iter().any(|s| s.id == op.id) && all.iter().any(|s| s.id == mine));
}

#[tokio::test(flavor = "multi_thread")]
async fn sandbox_env_is_not_kept_in_plain_text_in_the_state_store() {
    let d = Daemon::start().await;
    let a = tenant(&d, "team-a", Quotas::default()).await;
    let secret = "sk-live-0123456789-do-not-leak";
    let body: CreateSandboxBody =
        serde_json::from_value(json!({"template": "host", "env": {"OPENAI_API_KEY": secret}}))
            .unwrap();
    let id = a.create_sandbox(&body).await.unwrap().id;
    let out = a.exec(&id, &sh("echo $OPENAI_API_KEY")).await.unwrap();
    assert_eq!(out.stdout.trim(), secret);
    for f in std::fs::read_dir(&d.dir).unwrap().flatten() {
        let name = f.file_name().to_string_lossy().into_owned();
        if name.starts_with("torpor.db") {
            let bytes = std::fs::read(f.path()).unwrap();
            assert!(
                !String::from_utf8_lossy(&bytes).contains(secret),
                "{name} holds the env in plain text"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_never_ending_call_does_not_block_delete_or_shutdown() {
    let mut d = Daemon::start().await;
    let a = tenant(&d, "team-a", Quotas::default()).await;
    let stuck = create(&a, "host").await;
    let other = create(&a, "host").await;
    let forever = |id: String| {
        let a = a.clone();
        tokio::spawn(async move {
            a.exec(
                &id,
                &torpor_api::types::ExecBody {
                    cmd: vec!["sleep".into(), "100000".into()],
                    ..Default::default()
                },
            )
            .await
        })
    };
    let call = forever(stuck.clone());
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let t = std::time::Instant::now();
    a.delete_sandbox(&stuck).await.unwrap();
    // The cut call ends with an error rather than hanging (bounded by the test's timeout).
    let ended = tokio::time::timeout(std::time::Duration::from_secs(60), call)
        .await
        .expect("the call in flight ended")
        .unwrap();
    assert!(ended.is_err() || ended.unwrap().exit_code != Some(0));
    assert_eq!(refusal(a.sandbox(&stuck).await.unwrap_err()).0, 404);
    eprintln!("delete under a never-ending call took {:?}", t.elapsed());
    // Shutdown is not held either: the other sandbox with a never-ending call is left running
    // under its shim, and the daemon exits.
    let _call = forever(other.clone());
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let pid = d.pid();
    let t = std::time::Instant::now();
    // SAFETY: kill(2) on the daemon this test started.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let mut exited = false;
    for _ in 0..1200 {
        // SAFETY: waitpid on our own child, without blocking.
        let r = unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
        if r == pid {
            exited = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(exited, "the daemon did not exit under a never-ending call");
    eprintln!("shutdown under a never-ending call took {:?}", t.elapsed());
    // The next start takes it back as it was (live restore): nothing was lost.
    d.kill();
    d.spawn().await;
    let s = d.client().sandbox(&other).await.unwrap();
    // (Resident: running, or frozen by the idle policy since.)
    assert!(
        ["running", "frozen"].contains(&s.state.as_str()) && s.last_error.is_none(),
        "{s:?}"
    );
    let r = d
        .client()
        .exec(
            &other,
            &sh("pgrep -x sleep >/dev/null && echo still-sleeping"),
        )
        .await
        .unwrap();
    assert_eq!(r.stdout.trim(), "still-sleeping", "{r:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn template_names_are_per_tenant_and_tell_nothing_of_others() {
    let d = Daemon::start().await;
    let (a, ta) = tenant_with_token(&d, "team-a", Quotas::default()).await;
    let (b, tb) = tenant_with_token(&d, "team-b", Quotas::default()).await;
    let spec = json!({"name": "app", "source": {"kind": "host"},
        "limits": {"memory_mib": 64, "cpus": 1.0, "pids": 64}});
    // Both may have an `app`: B's create does not learn that A has one.
    let (status, body) = post_template(&ta, &d, spec.clone()).await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = post_template(&tb, &d, spec.clone()).await;
    assert_eq!(status, 201, "{body}");
    // Each uses its own; deleting one leaves the other.
    let sa = create(&a, "app").await;
    assert_eq!(a.sandbox(&sa).await.unwrap().template, "app");
    b.delete_template("app").await.unwrap();
    assert_eq!(refusal(b.template("app").await.unwrap_err()).0, 404);
    assert_eq!(a.template("app").await.unwrap().tenant, "team-a");
    let (status, code, _) = refusal(a.delete_template("app").await.unwrap_err());
    assert_eq!((status, code.as_str()), (409, "template_in_use"));
    // An operator template (which every tenant sees) cannot be shadowed.
    let (status, body) =
        post_template(&ta, &d, json!({"name": "host", "source": {"kind": "host"}})).await;
    assert_eq!(status, 409, "{body}");
    // A's sandbox still wakes from its own template after being parked.
    a.suspend(&sa, None).await.unwrap();
    let out = a.exec(&sa, &sh("echo ok")).await.unwrap();
    assert_eq!(out.stdout, "ok\n");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rootfs_tarball_upload_cannot_write_outside_its_root() {
    let d = Daemon::start().await;
    let a = tenant(&d, "team-a", Quotas::default()).await;
    let good = tempfile::NamedTempFile::new().unwrap();
    make_image(good.path(), &["rootfs"]);
    let limits = json!({"limits": {"memory_mib": 128, "cpus": 1.0, "pids": 64}});
    a.upload_template_image("fs", &limits, good.path(), UploadKind::Rootfs, None)
        .await
        .unwrap();
    let id = create(&a, "fs").await;
    let out = a
        .exec(&id, &sh("read l < /app/hello.txt; echo \"$l\""))
        .await
        .unwrap();
    assert_eq!(out.stdout, "hi from image\n", "{out:?}");
    let _ = std::fs::remove_file("/tmp/torpor-evil-marker");
    let _ = std::fs::remove_file("/tmp/torpor-evil-marker2");
    let evil = tempfile::NamedTempFile::new().unwrap();
    make_image(evil.path(), &["rootfs", "escape"]);
    let (status, _, message) = refusal(
        a.upload_template_image("evil", &limits, evil.path(), UploadKind::Rootfs, None)
            .await
            .unwrap_err(),
    );
    assert_eq!(status, 400, "{message}");
    assert!(!message.contains(d.dir.to_str().unwrap()), "{message}");
    assert!(!std::path::Path::new("/tmp/torpor-evil-marker").exists());
    assert!(!std::path::Path::new("/tmp/torpor-evil-marker2").exists());
    assert!(a
        .templates()
        .await
        .unwrap()
        .iter()
        .all(|t| t.name != "evil"));
}

#[tokio::test(flavor = "multi_thread")]
async fn checkpoints_in_the_snapshot_store_count_against_the_disk_quota() {
    let d = Daemon::start().await;
    let a = tenant(
        &d,
        "disk",
        Quotas {
            // A host sandbox's stored checkpoint is about half a MiB: counted, it fills this.
            max_disk_mib: Some(1),
            ..Default::default()
        },
    )
    .await;
    let id = create(&a, "host").await;
    // Asleep in the snapshot store: no local image left, the stored checkpoint is charged.
    let s = a
        .suspend(&id, Some(torpor_core::Tier::Suspended))
        .await
        .unwrap();
    assert_eq!(s.tier, "suspended");
    assert!(
        !d.dir.join("sandboxes").join(&id).join("images").exists()
            || std::fs::read_dir(d.dir.join("sandboxes").join(&id).join("images"))
                .unwrap()
                .next()
                .is_none()
    );
    let e = a
        .create_sandbox(&CreateSandboxBody {
            template: "host".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    match e {
        ClientError::Api {
            status, details, ..
        } => {
            assert_eq!(status, 429);
            assert_eq!(details.unwrap()["quota"], "disk_mib");
        }
        other => panic!("{other}"),
    }
    // Its own wake is not refused (nothing new is stored), and deleting it gives the room back.
    assert_eq!(a.exec(&id, &sh("echo up")).await.unwrap().stdout, "up\n");
    a.delete_sandbox(&id).await.unwrap();
    create(&a, "host").await;
}
