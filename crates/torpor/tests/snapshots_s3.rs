//! End-to-end: `torpor up --store s3://bucket/prefix` against a real S3-compatible server. The
//! test starts `moto_server` (PyPI `moto[server]`; set MOTO_SERVER if it is not on PATH) on a
//! free loopback port and stops it by its pid. Real runsc sandboxes: suspend into S3, wake with
//! state intact (through the node's chunk cache), a corrupted chunk in S3 fails the wake
//! naming snapshot and chunk (nothing deleted), and the server stopped mid-upload leaves the
//! sandbox parked on its local checkpoint after bounded retries, with a clear error.

mod common;
#[path = "../../torpor-snapshot/tests/support/moto.rs"]
mod moto;

use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use moto::Moto;
use torpor_core::Tier;
use torpor_snapshot::backend::{Backend, ObjectKey, S3Backend, S3Config};

const BUCKET: &str = "torpor-e2e";
const PREFIX: &str = "node-a";

fn torpor(d: &Daemon, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .env("TORPOR_URL", d.url())
        .env("TORPOR_TOKEN", d.token())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread")]
async fn suspend_to_s3_wake_verify_corruption_and_server_loss() {
    let mut moto = Moto::start();
    moto.create_bucket(BUCKET);
    let endpoint = moto.endpoint();
    let d = Daemon::start_with_env(
        &[
            "--store",
            &format!("s3://{BUCKET}/{PREFIX}"),
            "--store-retry-timeout",
            "3",
            // Packs (the default on S3) of 256 KiB: the upload the server dies under below is
            // ~100 packs, 8 at a time, not 6 that all land at once.
            "--pack-size",
            "256K",
        ],
        &[
            ("AWS_ENDPOINT_URL", &endpoint),
            ("AWS_ACCESS_KEY_ID", "test"),
            ("AWS_SECRET_ACCESS_KEY", "test"),
            ("AWS_REGION", "us-east-1"),
        ],
    )
    .await;
    // The test's own view of the bucket, to check and to corrupt objects.
    let s3 = S3Backend::new(&S3Config {
        endpoint: Some(endpoint.clone()),
        access_key_id: "test".into(),
        secret_access_key: "test".into(),
        allow_http: true,
        prefix: Some(PREFIX.into()),
        ..S3Config::new(BUCKET)
    })
    .unwrap();
    let c = d.client();
    c.create_template(&agent_template("s3agent", no_idle()))
        .await
        .unwrap();
    let id = create(&c, "s3agent").await;
    assert_eq!(call_agent(&c, &id, "a").await, (1, 1));

    // Suspend: the checkpoint goes to S3 (manifest and packs of chunks: the default on S3, so
    // a wake reads a few ranges, not an object per chunk), not to the node's store dir.
    let s = c.suspend(&id, Some(Tier::Suspended)).await.unwrap();
    assert_eq!(s.state, "suspended");
    let manifests = s3.list("manifests").await.unwrap();
    assert_eq!(manifests.len(), 1, "{manifests:?}");
    let packs = s3.list("packs").await.unwrap();
    assert!(!packs.is_empty());
    assert_eq!(s3.list("packidx").await.unwrap().len(), packs.len());
    assert!(
        s3.list("chunks").await.unwrap().is_empty(),
        "no loose chunk"
    );
    assert!(
        !d.dir.join("store").join("manifests").exists(),
        "nothing in the local store"
    );

    // Wake: state intact; the chunks come from this node's cache (written through on put).
    assert_eq!(call_agent(&c, &id, "b").await, (2, 2));
    let m = c.metrics().await.unwrap();
    assert!(metric(&m, "torpor_snapshot_cache_hits_total") > 0.0, "{m}");

    // Suspend again, then corrupt one chunk of that snapshot in S3 (the last of a pack).
    c.suspend(&id, Some(Tier::Suspended)).await.unwrap();
    let current = s3.list("manifests").await.unwrap();
    assert_eq!(current.len(), 1, "the superseded snapshot was deleted");
    let snapshot = current[0].key.name().to_string();
    let mut corrupted = None;
    for o in s3.list("packs").await.unwrap() {
        let orig = s3.get(&o.key).await.unwrap().unwrap();
        let mut bad = orig.to_vec();
        let last = bad.len() - 1;
        bad[last] ^= 0x55;
        s3.put(&o.key, Bytes::from(bad)).await.unwrap();
        let (code, out, _) = torpor(&d, &["snapshot", "verify", &snapshot, "--json"]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        if code == 2 {
            let chunk = v["problems"][0]["chunk"].as_str().unwrap().to_string();
            corrupted = Some((o.key.clone(), orig, chunk));
            break;
        }
        assert_eq!(code, 0, "{out}");
        s3.put(&o.key, orig).await.unwrap();
    }
    let (key, orig, chunk): (ObjectKey, Bytes, String) =
        corrupted.expect("a pack of the current snapshot");
    // Another node would have no cache: empty this one so the wake reads S3. Its writer puts
    // entries on disk once inserts have been quiet for a second, holding them in memory (and
    // serving them) until then: wait until what it writes stops changing, then empty it.
    let cache_dir = d.dir.join("chunk-cache");
    let entries = || std::fs::read_dir(&cache_dir).unwrap().count();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = entries();
    loop {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let now = entries();
        if now > 0 && now == seen {
            break;
        }
        assert!(Instant::now() < deadline, "the chunk cache never settled");
        seen = now;
    }
    for e in std::fs::read_dir(&cache_dir).unwrap() {
        std::fs::remove_file(e.unwrap().path()).unwrap();
    }
    let e = c.resume(&id).await.unwrap_err();
    assert_eq!(e.code(), Some("chunk_corrupt"), "{e}");
    let msg = e.to_string();
    assert!(msg.contains(&snapshot) && msg.contains(&chunk), "{msg}");
    assert_eq!(c.sandbox(&id).await.unwrap().state, "suspended");
    assert!(s3.get(&key).await.unwrap().is_some(), "nothing deleted");
    assert_eq!(s3.list("manifests").await.unwrap().len(), 1);
    s3.put(&key, orig).await.unwrap();
    assert_eq!(call_agent(&c, &id, "c").await, (3, 3));

    // The server dies while the next suspend uploads: bounded retries, a clear error, and the
    // sandbox stays parked on its local checkpoint (its last good state).
    // 24 MiB of fresh data in the sandbox's tmpfs (part of its checkpoint) makes an upload of
    // some 1500 new chunks in ~100 packs; the server is killed once the first pack has landed.
    let r = c
        .exec(
            &id,
            &sh("head -c 25165824 /dev/urandom > /tmp/fresh && echo ok"),
        )
        .await
        .unwrap();
    assert_eq!(r.stdout.trim(), "ok", "{r:?}");
    let before = s3.list("packs").await.unwrap().len();
    let bg = c.clone();
    let sid = id.clone();
    let suspend = tokio::spawn(async move { bg.suspend(&sid, Some(Tier::Suspended)).await });
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if s3.list("packs").await.unwrap().len() > before {
            break;
        }
        let st = c.sandbox(&id).await.unwrap().state;
        assert!(
            Instant::now() < deadline && st != "suspended",
            "never saw the upload: {st}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    moto.stop();
    let t = Instant::now();
    let err = suspend.await.unwrap().unwrap_err();
    let code = err.code().unwrap_or_default().to_string();
    assert!(code.starts_with("backend_"), "{err}");
    // The store's server gone is retryable: 503, not a server fault.
    assert!(
        matches!(err, torpor_api::ClientError::Api { status: 503, .. }),
        "{err:?}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(60),
        "retries are bounded: {:?}",
        t.elapsed()
    );
    let s = c.sandbox(&id).await.unwrap();
    assert_eq!(s.state, "parked", "{s:?}");
    assert!(
        s.last_error
            .as_deref()
            .unwrap_or("")
            .contains("upload failed"),
        "{s:?}"
    );
    // It wakes from the node's disk, with everything it had.
    assert_eq!(call_agent(&c, &id, "d").await, (4, 4));
    let r = c.exec(&id, &sh("wc -c < /tmp/fresh")).await.unwrap();
    assert_eq!(r.stdout.trim(), "25165824");
    eprintln!("s3 loss: {err} after {:?}", t.elapsed());
}
