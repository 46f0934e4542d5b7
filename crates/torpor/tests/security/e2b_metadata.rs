//! E2B's file metadata (`X-Metadata-*` on `/files` uploads, kept as `user.e2b.*` extended
//! attributes by the sandbox's agent): a tenant names only keys, never attribute namespaces;
//! what envd would refuse is refused before anything is written; and what a process inside
//! a sandbox stores by other means is read back only within bounds. Real daemon, real runsc
//! sandboxes, E2B's envd API spoken raw.

use serde_json::{json, Value};
use torpor_api::types::{CreateTenantBody, ExecBody};

use crate::common::*;

async fn tenant(d: &Daemon, name: &str) -> String {
    d.client()
        .create_tenant(&CreateTenantBody {
            name: name.into(),
            quotas: None,
        })
        .await
        .unwrap()
        .token
}

/// An E2B `base` sandbox of `key`'s: (id, envd access token).
async fn e2b_sandbox(d: &Daemon, key: &str) -> (String, String) {
    let body = e2b_created(d, key, json!({"templateID": "base"})).await;
    (
        body["sandboxID"].as_str().unwrap().to_string(),
        body["envdAccessToken"].as_str().unwrap().to_string(),
    )
}

/// `POST /files?path=` (octet-stream) with `headers` added: (status, JSON body).
async fn upload(
    d: &Daemon,
    (id, token): (&str, &str),
    path: &str,
    headers: &[Header],
) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .post(format!("{}/files", d.url()))
        .query(&[("path", path)])
        .header("E2b-Sandbox-Id", id)
        .header("X-Access-Token", token)
        .header("Content-Type", "application/octet-stream")
        .body("data");
    for (k, v) in headers {
        req = req.header(
            reqwest::header::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            reqwest::header::HeaderValue::from_bytes(v).unwrap(),
        );
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// A Connect unary call of envd's `filesystem.Filesystem`: (status, JSON body).
async fn fs_call(d: &Daemon, (id, token): (&str, &str), method: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{}/filesystem.Filesystem/{method}", d.url()))
        .header("E2b-Sandbox-Id", id)
        .header("X-Access-Token", token)
        .header("Content-Type", "application/json")
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Runs a Python program as root in the sandbox (torpor's own exec): its stdout.
async fn python(d: &Daemon, key: &str, id: &str, program: &str) -> String {
    let r = torpor_api::Client::new(&d.url(), key)
        .exec(
            id,
            &ExecBody {
                cmd: vec!["python3".into(), "-c".into(), program.into()],
                timeout_ms: Some(120_000),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    r.stdout.trim().to_string()
}

/// Every extended attribute of `path`, as root inside the sandbox sees them (name → value).
async fn all_xattrs(d: &Daemon, key: &str, id: &str, path: &str) -> Value {
    let out = python(
        d,
        key,
        id,
        &format!(
            "import os, json; p = {path:?}; \
             print(json.dumps({{n: os.getxattr(p, n).decode() for n in os.listxattr(p)}}))"
        ),
    )
    .await;
    serde_json::from_str(&out).unwrap()
}

/// A header as sent: name and raw value bytes.
type Header = (String, Vec<u8>);

fn h(k: &str, v: &str) -> Header {
    (k.to_string(), v.as_bytes().to_vec())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_cannot_set_trusted_security_or_system_xattrs_through_file_metadata() {
    let d = Daemon::start().await;
    let key_a = tenant(&d, "meta-ns-a").await;
    let key_b = tenant(&d, "meta-ns-b").await;
    let (a, token_a) = e2b_sandbox(&d, &key_a).await;
    let (b, token_b) = e2b_sandbox(&d, &key_b).await;
    let path = "/home/user/f.txt";
    let namespaced = [
        "trusted.overlay.opaque",
        "security.capability",
        "security.selinux",
        "system.posix_acl_access",
        "user.plain",
    ];
    let mut headers: Vec<_> = namespaced
        .iter()
        .map(|n| h(&format!("X-Metadata-{n}"), "y"))
        .collect();
    headers.push(h("X-Metadata-ok", "fine"));
    let (status, body) = upload(&d, (&a, &token_a), path, &headers).await;
    // As envd: a key is only a key. Each is stored under `user.e2b.`, nowhere else.
    assert_eq!(status, 200, "{body}");
    let mut want = serde_json::Map::new();
    for n in namespaced {
        want.insert(n.to_string(), json!("y"));
    }
    want.insert("ok".into(), json!("fine"));
    assert_eq!(body[0]["metadata"], Value::Object(want.clone()), "{body}");
    let stored = all_xattrs(&d, &key_a, &a, path).await;
    let mut want_stored = serde_json::Map::new();
    for (k, v) in &want {
        want_stored.insert(format!("user.e2b.{k}"), v.clone());
    }
    assert_eq!(
        stored,
        Value::Object(want_stored),
        "root inside the sandbox sees only user.e2b.* attributes"
    );
    // Stat surfaces the same keys, and nothing set outside `user.e2b.` by other means.
    python(
        &d,
        &key_a,
        &a,
        &format!("import os; os.setxattr({path:?}, 'user.other', b'not e2b')"),
    )
    .await;
    let (status, st) = fs_call(&d, (&a, &token_a), "Stat", json!({"path": path})).await;
    assert_eq!(status, 200, "{st}");
    assert_eq!(st["entry"]["metadata"], Value::Object(want));

    // Another tenant's sandbox is not reachable with A's token, metadata or not; B's own
    // metadata works and A's keys did not leak into it.
    let (status, _) = upload(&d, (&b, &token_a), path, &[h("X-Metadata-trusted.x", "y")]).await;
    assert_eq!(status, 401);
    let (status, body) = upload(&d, (&b, &token_b), path, &[h("X-Metadata-mine", "b")]).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        all_xattrs(&d, &key_b, &b, path).await,
        json!({"user.e2b.mine": "b"})
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn oversize_or_non_ascii_file_metadata_is_refused_before_anything_is_written() {
    let d = Daemon::start().await;
    let key = tenant(&d, "meta-size-a").await;
    let (id, token) = e2b_sandbox(&d, &key).await;
    let s = (id.as_str(), token.as_str());
    let path = "/home/user/refused.txt";
    let many: Vec<_> = (0..60)
        .map(|i| h(&format!("X-Metadata-{i:02}{}", "k".repeat(58)), ""))
        .collect();
    let cases: Vec<(&str, Vec<Header>, &str)> = vec![
        (
            "a value over the total",
            vec![h("X-Metadata-k", &"v".repeat(4090))],
            "invalid metadata: total metadata size 4100 exceeds 4096 bytes",
        ),
        (
            "keys whose prefixes tip the total",
            many,
            "invalid metadata: total metadata size 4140 exceeds 4096 bytes",
        ),
        (
            "a key over 246 bytes",
            vec![h(&format!("X-Metadata-{}", "k".repeat(247)), "v")],
            "exceeds 246 bytes",
        ),
        (
            "a byte outside ASCII",
            vec![("X-Metadata-k".into(), b"caf\xc3\xa9".to_vec())],
            "not printable ASCII",
        ),
        (
            "a control byte (a tab: HTTP lets it through, envd does not)",
            vec![("X-Metadata-k".into(), b"a\tb".to_vec())],
            "not printable ASCII",
        ),
    ];
    for (what, headers, why) in cases {
        let (status, body) = upload(&d, s, path, &headers).await;
        assert_eq!(status, 400, "{what}: {body}");
        assert_eq!(body["code"], 400, "{what}: E2B's error shape {body}");
        let m = body["message"].as_str().unwrap_or_default();
        assert!(m.contains(why), "{what}: {m}");
        let (status, _) = fs_call(&d, s, "Stat", json!({"path": path})).await;
        assert_eq!(status, 404, "{what}: nothing was written");
    }
    // Exactly at the limit is accepted, and all of it is kept.
    let (status, body) = upload(&d, s, path, &[h("X-Metadata-k", &"v".repeat(4086))]).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body[0]["metadata"]["k"].as_str().map(str::len), Some(4086));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_process_cannot_flood_listings_past_the_metadata_read_bounds() {
    let d = Daemon::start().await;
    let key = tenant(&d, "meta-flood-a").await;
    let other = tenant(&d, "meta-flood-b").await;
    let (id, token) = e2b_sandbox(&d, &key).await;
    let s = (id.as_str(), token.as_str());
    // A process inside sets far more than an upload may: 300 attributes of 1000 bytes on each
    // of 40 files, plus one that is not UTF-8.
    python(
        &d,
        &key,
        &id,
        "import os\n\
         os.makedirs('/home/user/flood', exist_ok=True)\n\
         for f in range(40):\n\
         \x20   p = f'/home/user/flood/f{f:02}'\n\
         \x20   open(p, 'w').close()\n\
         \x20   os.setxattr(p, 'user.e2b.bad', b'\\xff\\xfe')\n\
         \x20   for i in range(300):\n\
         \x20       os.setxattr(p, f'user.e2b.k{i:03}', b'v' * 1000)\n",
    )
    .await;
    let cost = |m: &Value| -> usize {
        m.as_object()
            .map(|o| {
                o.iter()
                    .map(|(k, v)| 9 + k.len() + v.as_str().unwrap().len())
                    .sum()
            })
            .unwrap_or(0)
    };
    // One entry: what is surfaced stays within what an upload may set, in name order, and
    // bytes that are not UTF-8 are left out.
    let (status, st) = fs_call(&d, s, "Stat", json!({"path": "/home/user/flood/f00"})).await;
    assert_eq!(status, 200, "{st}");
    let m = &st["entry"]["metadata"];
    assert!(cost(m) <= 4096, "bounded per entry: {}", cost(m));
    assert!(m.get("k000").is_some() && m.get("bad").is_none(), "{m}");
    // A listing of all 40: each bounded the same way (40 × 4 KiB is within a reply).
    let (status, list) = fs_call(
        &d,
        s,
        "ListDir",
        json!({"path": "/home/user/flood", "depth": 1}),
    )
    .await;
    assert_eq!(status, 200, "{list}");
    let entries = list["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 40);
    assert!(entries.iter().all(|e| cost(&e["metadata"]) <= 4096));
    // The daemon and another tenant are unaffected.
    let (other_id, other_token) = e2b_sandbox(&d, &other).await;
    let (status, body) = upload(
        &d,
        (&other_id, &other_token),
        "/home/user/x",
        &[h("X-Metadata-k", "v")],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body[0]["metadata"], json!({"k": "v"}));
}
