//! The edge: unauthenticated callers and HTTP resource exhaustion, rate limits, request ids and
//! error texts, metrics, and what lists and host routing show a tenant. See main.rs and
//! docs/SECURITY.md.
//!
//! Memory is read from the daemon's `/proc/PID/status` (VmRSS); the bounds asserted are far
//! from both what the attack took before its fix (the body, or the stream, in the daemon's
//! memory: hundreds of MiB) and the daemon's own noise (a few MiB).

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use torpor_api::types::{CreateSandboxBody, CreateTenantBody, Quotas};
use torpor_api::Client;

use crate::common::{self, Daemon};

const MIB: u64 = 1 << 20;

/// The daemon's resident memory, in bytes.
fn rss(d: &Daemon) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", d.pid())).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/PID/status");
    kib * 1024
}

async fn tenant(d: &Daemon, name: &str, quotas: Option<Quotas>) -> String {
    d.client()
        .create_tenant(&CreateTenantBody {
            name: name.into(),
            quotas,
        })
        .await
        .unwrap()
        .token
}

fn rate(n: u64) -> Option<Quotas> {
    Some(Quotas {
        requests_per_s: Some(n),
        ..Default::default()
    })
}

async fn sandbox(d: &Daemon, token: &str) -> String {
    Client::new(&d.url(), token)
        .create_sandbox(&CreateSandboxBody {
            template: "host".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .id
}

/// Sends a request head on a fresh connection.
async fn send_head(d: &Daemon, head: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", d.port)).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s
}

/// Reads one response head (status line and headers) from `r`: (status, lower-cased head).
async fn read_head(r: &mut (impl AsyncReadExt + Unpin)) -> (u16, String) {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        match r.read(&mut byte).await {
            Ok(1) => buf.push(byte[0]),
            _ => break,
        }
    }
    let head = String::from_utf8_lossy(&buf).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no response head: {head:?}"));
    (status, head)
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")))
        .map(str::trim)
}

/// Streams a chunked body of `total` bytes after `head` while watching for the answer; stops
/// sending as soon as the answer came. Returns (status, head, bytes sent).
async fn chunked_upload(d: &Daemon, head: &str, total: u64) -> (u16, String, u64) {
    let s = send_head(d, head).await;
    let (mut r, mut w) = s.into_split();
    let mut answer = tokio::spawn(async move { read_head(&mut r).await });
    let chunk = vec![b'x'; MIB as usize];
    let mut sent = 0u64;
    let mut frame = format!("{:x}\r\n", chunk.len()).into_bytes();
    frame.extend_from_slice(&chunk);
    frame.extend_from_slice(b"\r\n");
    while sent < total {
        tokio::select! {
            res = &mut answer => {
                let (status, head) = res.unwrap();
                return (status, head, sent);
            }
            res = w.write_all(&frame) => {
                if res.is_err() {
                    break;
                }
                sent += MIB;
            }
        }
    }
    let _ = w.write_all(b"0\r\n\r\n").await;
    let (status, head) = answer.await.unwrap();
    (status, head, sent)
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unauthenticated_200_mib_upload_is_refused_before_its_body_is_read() {
    let d = Daemon::start().await;
    let admin = d.client();
    let id = common::create(&admin, "host").await;
    let total = 200 * MIB;
    let before = rss(&d);
    // E2B's envd upload, naming a real sandbox without its access token.
    let (status, head, sent) = chunked_upload(
        &d,
        &format!(
            "POST /files?path=/tmp/x HTTP/1.1\r\nHost: 127.0.0.1\r\nE2b-Sandbox-Id: {id}\r\n\
             Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        ),
        total,
    )
    .await;
    assert_eq!(status, 401, "{head}");
    assert!(sent < total, "the whole body was taken before the refusal");
    // E2B's control plane, without an API key.
    let (status, head, sent) = chunked_upload(
        &d,
        "POST /v2/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\n\r\n",
        total,
    )
    .await;
    assert_eq!(status, 401, "{head}");
    assert!(sent < total, "the whole body was taken before the refusal");
    // Process service, without a token: refused before the message is read.
    let (status, head, sent) = chunked_upload(
        &d,
        &format!(
            "POST /process.Process/List HTTP/1.1\r\nHost: 127.0.0.1\r\nE2b-Sandbox-Id: {id}\r\n\
             Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        ),
        total,
    )
    .await;
    assert_eq!(status, 401, "{head}");
    assert!(sent < total);
    let grown = rss(&d).saturating_sub(before);
    assert!(grown < 16 * MIB, "the daemon grew by {} MiB", grown / MIB);
    // An authenticated JSON route does not take more than a JSON body either.
    let (status, head, sent) = chunked_upload(
        &d,
        &format!(
            "POST /v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {}\r\n\
             Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
            d.token()
        ),
        total,
    )
    .await;
    assert_eq!(status, 413, "{head}");
    assert!(sent < total);
    // The daemon still serves.
    let r = admin.exec(&id, &common::sh("echo ok")).await.unwrap();
    assert_eq!(r.stdout, "ok\n");
}

#[tokio::test(flavor = "multi_thread")]
async fn one_tenant_cannot_hold_many_large_uploads_at_once() {
    let d = Daemon::start().await;
    let a = tenant(&d, "up-a", None).await;
    let b = tenant(&d, "up-b", None).await;
    let sa = sandbox(&d, &a).await;
    let sb = sandbox(&d, &b).await;
    let big = 200 * MIB;
    let put = |id: &str, token: &str| {
        format!(
            "PUT /v1/sandboxes/{id}/files?path=/tmp/big HTTP/1.1\r\nHost: 127.0.0.1\r\n\
             Authorization: Bearer {token}\r\nContent-Length: {big}\r\nExpect: 100-continue\r\n\r\n"
        )
    };
    // The first upload holds its share: the server asks for its body (100 Continue) only once
    // its budget is taken.
    let mut first = send_head(&d, &put(&sa, &a)).await;
    let (status, head) = tokio::time::timeout(Duration::from_secs(60), read_head(&mut first))
        .await
        .expect("100 Continue");
    assert_eq!(status, 100, "{head}");
    // A second one of the same tenant is refused before any of its body is read.
    let mut second = send_head(&d, &put(&sa, &a)).await;
    let (status, head) = read_head(&mut second).await;
    assert_eq!(status, 429, "{head}");
    assert!(head.contains("rate_limited") || header(&head, "retry-after").is_some());
    let retry: u64 = header(&head, "retry-after").unwrap().parse().unwrap();
    assert!(retry >= 1);
    let mut body = vec![0u8; 512];
    let n = second.read(&mut body).await.unwrap();
    assert!(
        String::from_utf8_lossy(&body[..n]).contains("\"rate_limited\""),
        "{}",
        String::from_utf8_lossy(&body[..n])
    );
    // Another tenant still uploads.
    Client::new(&d.url(), &b)
        .write_file(&sb, "/tmp/small", b"hello".to_vec(), None)
        .await
        .unwrap();
    // Once the first upload is gone, the tenant uploads again.
    drop(first);
    let ca = Client::new(&d.url(), &a);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match ca.write_file(&sa, "/tmp/small", b"x".to_vec(), None).await {
            Ok(()) => break,
            Err(e) if e.code() == Some("rate_limited") && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_of_endless_output_does_not_grow_the_daemon() {
    let d = Daemon::start().await;
    let a = tenant(&d, "stream-a", None).await;
    let b = tenant(&d, "stream-b", None).await;
    let sa = sandbox(&d, &a).await;
    let sb = sandbox(&d, &b).await;
    let before = rss(&d);
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/sandboxes/{sa}/exec", d.url()))
        .bearer_auth(&a)
        .json(&json!({"cmd": ["yes"], "stream": true, "timeout_ms": 60_000}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    // The attacker reads as fast as it can for 10 s; its output is not kept by the daemon.
    let reader = tokio::spawn(async move {
        use futures::StreamExt;
        let mut stream = resp.bytes_stream();
        let mut read = 0u64;
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            match tokio::time::timeout(Duration::from_secs(1), stream.next()).await {
                Ok(Some(Ok(b))) => read += b.len() as u64,
                Ok(_) => break,
                Err(_) => {}
            }
        }
        read
    });
    let mut peak = 0;
    let cb = Client::new(&d.url(), &b);
    while !reader.is_finished() {
        peak = peak.max(rss(&d));
        // Another tenant's calls still answer meanwhile.
        let r = cb.exec(&sb, &common::sh("echo b")).await.unwrap();
        assert_eq!(r.stdout, "b\n");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let read = reader.await.unwrap();
    assert!(read > 10 * MIB, "the stream carried {read} bytes");
    let grown = peak.saturating_sub(before);
    assert!(
        grown < 100 * MIB,
        "the daemon grew by {} MiB while streaming {} MiB",
        grown / MIB,
        read / MIB
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_over_its_rate_is_refused_and_another_tenant_is_not() {
    let d = Daemon::start().await;
    let a = tenant(&d, "rate-a", rate(1)).await;
    let b = tenant(&d, "rate-b", None).await;
    let http = reqwest::Client::new();
    let list = |token: &str| {
        http.get(format!("{}/v1/sandboxes", d.url()))
            .bearer_auth(token)
            .header("x-request-id", "attack-rate-1")
    };
    // Tenant A at ~20x its rate (1/s, burst 2).
    let mut refused = Vec::new();
    let mut allowed = 0;
    for _ in 0..40 {
        let r = list(&a).send().await.unwrap();
        for h in ["ratelimit-limit", "ratelimit-remaining", "ratelimit-reset"] {
            assert!(
                r.headers().contains_key(h),
                "{h} missing: {:?}",
                r.headers()
            );
        }
        assert_eq!(r.headers()["ratelimit-limit"], "2");
        if r.status() == StatusCode::TOO_MANY_REQUESTS {
            refused.push(r);
        } else {
            assert_eq!(r.status(), StatusCode::OK);
            allowed += 1;
        }
    }
    assert!(allowed >= 2, "the burst is let through");
    assert!(refused.len() >= 20, "only {} of 40 refused", refused.len());
    let r = refused.pop().unwrap();
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1);
    assert_eq!(r.headers()["ratelimit-remaining"], "0");
    assert_eq!(r.headers()["x-request-id"], "attack-rate-1");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "rate_limited", "{v}");
    // The same tenant on E2B's control plane, over the same rate.
    let mut e2b_refused = 0;
    for _ in 0..10 {
        let r = http
            .get(format!("{}/v2/sandboxes", d.url()))
            .header("x-api-key", &a)
            .send()
            .await
            .unwrap();
        if r.status() == StatusCode::TOO_MANY_REQUESTS {
            assert!(r.headers().contains_key("retry-after"));
            e2b_refused += 1;
        }
    }
    assert!(e2b_refused > 0);
    // Tenant B, meanwhile: every call answers, and so does the operator (never limited).
    for _ in 0..40 {
        let r = list(&b).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let r = list(&d.token()).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        assert!(!r.headers().contains_key("ratelimit-limit"));
    }
    // The refusal is logged under the request's id.
    assert!(
        d.log().contains("attack-rate-1"),
        "request id not in the log"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn every_response_carries_a_request_id_and_errors_keep_internals_out() {
    let d = Daemon::start().await;
    let a = tenant(&d, "rid-a", None).await;
    let http = reqwest::Client::new();
    let url = d.url();
    let id_of = |r: &reqwest::Response| {
        r.headers()
            .get("x-request-id")
            .unwrap_or_else(|| panic!("no x-request-id on {} {:?}", r.status(), r.url()))
            .to_str()
            .unwrap()
            .to_string()
    };
    let well_formed = |id: &str| {
        !id.is_empty()
            && id.len() <= 64
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    };
    let requests = vec![
        http.get(format!("{url}/healthz")),
        http.get(format!("{url}/v1/sandboxes")).bearer_auth(&a),
        http.get(format!("{url}/v1/sandboxes")),
        http.get(format!("{url}/no/such/route")),
        http.delete(format!("{url}/healthz")),
        http.get(format!("{url}/v1/sandboxes/sb-nothere/files?path=/x"))
            .bearer_auth(&a),
        http.get(format!("{url}/v2/sandboxes")),
        http.get(format!("{url}/health")),
        http.post(format!("{url}/process.Process/List"))
            .header("content-type", "application/json")
            .body("{}"),
        http.get(format!("{url}/metrics")),
        // Host routing, to a sandbox that does not exist.
        http.get(format!("{url}/x"))
            .header("host", "8000-sb-aaaaaaaaaaaaaaaa.localhost"),
        http.get(format!(
            "{url}/v1/sandboxes/sb-aaaaaaaaaaaaaaaa/ports/8000/"
        ))
        .bearer_auth(&a),
    ];
    let mut seen = std::collections::HashSet::new();
    for req in requests {
        let r = req.send().await.unwrap();
        let id = id_of(&r);
        assert!(well_formed(&id), "{id:?}");
        assert!(seen.insert(id), "ids repeat");
    }
    // A client's well-formed id is kept; a malformed one is replaced.
    let r = http
        .get(format!("{url}/healthz"))
        .header("x-request-id", "client.id-42_x")
        .send()
        .await
        .unwrap();
    assert_eq!(id_of(&r), "client.id-42_x");
    for bad in ["x".repeat(65), "a b".into(), "a/b".into()] {
        let r = http
            .get(format!("{url}/healthz"))
            .header("x-request-id", bad.as_str())
            .send()
            .await
            .unwrap();
        let id = id_of(&r);
        assert_ne!(id, bad);
        assert!(well_formed(&id));
    }
    // Errors carry no host path: a tenant's failing calls name neither the data directory nor
    // runsc.
    let sa = sandbox(&d, &a).await;
    let dir = d.dir.display().to_string();
    for req in [
        http.get(format!(
            "{url}/v1/sandboxes/{sa}/files?path=/nonexistent/file"
        ))
        .bearer_auth(&a),
        http.get(format!("{url}/v1/sandboxes/{sa}/files?path=/proc"))
            .bearer_auth(&a),
        http.post(format!("{url}/v1/sandboxes/{sa}/suspend"))
            .bearer_auth(&a)
            .json(&json!({"tier": "bogus"})),
    ] {
        let r = req.send().await.unwrap();
        assert!(r.status().is_client_error(), "{}", r.status());
        id_of(&r);
        let text = r.text().await.unwrap();
        assert!(!text.contains(&dir), "{text}");
        assert!(!text.contains("runsc"), "{text}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_need_the_admin_or_the_metrics_token() {
    let d = Daemon::start().await;
    let a = tenant(&d, "metrics-a", None).await;
    let http = reqwest::Client::new();
    let get = |token: Option<&str>| {
        let r = http.get(format!("{}/metrics", d.url()));
        match token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    };
    for token in [None, Some(a.as_str()), Some("tpr_metrics_wrong")] {
        let r = get(token).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "unauthorized");
        assert!(!v.to_string().contains("torpor_"), "{v}");
    }
    let r = get(Some(&d.token())).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert!(r.text().await.unwrap().contains("torpor_"));
    let metrics_token = std::fs::read_to_string(d.dir.join("metrics-token")).unwrap();
    let r = get(Some(metrics_token.trim())).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
}

/// E2B's JSON call, answering (status, body).
async fn e2b(
    d: &Daemon,
    key: &str,
    method: reqwest::Method,
    path: &str,
    body: Value,
) -> (u16, Value) {
    let r = reqwest::Client::new()
        .request(method, format!("{}{path}", d.url()))
        .header("x-api-key", key)
        .json(&body)
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_neither_lists_nor_reaches_the_operators_sandboxes() {
    let d = Daemon::start().await;
    let a = tenant(&d, "list-a", None).await;
    let admin = d.token();
    let v1 = common::create(&d.client(), "host").await;
    let (s, sbx) = e2b(
        &d,
        &admin,
        reqwest::Method::POST,
        "/v2/sandboxes",
        json!({"templateID": "base", "network": {"allowPublicTraffic": false}}),
    )
    .await;
    assert_eq!(s, 201, "{sbx}");
    let private = sbx["sandboxID"].as_str().unwrap().to_string();
    let token = sbx["envdAccessToken"].as_str().unwrap().to_string();
    // A server on a port of the operator's private sandbox.
    common::e2b_start_process(
        &d,
        &private,
        &token,
        "python3",
        &["-m", "http.server", "8000", "--directory", "/etc"],
    )
    .await;
    // The operator sees both; the tenant neither, on every list.
    let (_, all) = e2b(
        &d,
        &admin,
        reqwest::Method::GET,
        "/v2/sandboxes",
        Value::Null,
    )
    .await;
    assert_eq!(all.as_array().unwrap().len(), 2, "{all}");
    for path in ["/v2/sandboxes", "/sandboxes"] {
        let (s, v) = e2b(&d, &a, reqwest::Method::GET, path, Value::Null).await;
        assert_eq!(s, 200);
        assert_eq!(v, json!([]), "{path} shows {v}");
    }
    let listed = Client::new(&d.url(), &a).sandboxes(None).await.unwrap();
    assert!(listed.is_empty(), "{listed:?}");
    for id in [&v1, &private] {
        let (s, _) = e2b(
            &d,
            &a,
            reqwest::Method::GET,
            &format!("/sandboxes/{id}"),
            Value::Null,
        )
        .await;
        assert_eq!(s, 404);
    }
    // Host routing to the private port: without the traffic token, refused whether the caller
    // shows no credentials or a tenant's.
    let host = format!("8000-{private}.localhost");
    let http = reqwest::Client::new();
    let r = http
        .get(format!("{}/passwd", d.url()))
        .header("host", &host)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let text = r.text().await.unwrap();
    assert!(!text.contains("root:"), "{text}");
    let r = http
        .get(format!("{}/passwd", d.url()))
        .header("host", &host)
        .bearer_auth(&a)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let text = r.text().await.unwrap();
    assert!(!text.contains("root:"), "{text}");
    assert!(text.contains("not_found"), "{text}");
    let r = http
        .get(format!("{}/passwd", d.url()))
        .header("host", &host)
        .header("e2b-traffic-access-token", "0".repeat(64))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_cannot_pile_up_filesystem_watchers() {
    let d = Daemon::start().await;
    let a = tenant(&d, "watch-a", None).await;
    let (s, sbx) = e2b(
        &d,
        &a,
        reqwest::Method::POST,
        "/v2/sandboxes",
        json!({"templateID": "base"}),
    )
    .await;
    assert_eq!(s, 201, "{sbx}");
    let id = sbx["sandboxID"].as_str().unwrap().to_string();
    let token = sbx["envdAccessToken"].as_str().unwrap().to_string();
    let http = reqwest::Client::new();
    let call = |method: &str, body: Value| {
        http.post(format!("{}/filesystem.Filesystem/{method}", d.url()))
            .header("content-type", "application/json")
            .header("e2b-sandbox-id", &id)
            .header("x-access-token", &token)
            .json(&body)
    };
    let mut ids = Vec::new();
    for _ in 0..64 {
        let r = call("CreateWatcher", json!({"path": "/tmp"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let v: Value = r.json().await.unwrap();
        ids.push(v["watcherId"].as_str().unwrap().to_string());
    }
    let r = call("CreateWatcher", json!({"path": "/tmp"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["code"], "resource_exhausted", "{v}");
    // Removing one makes room for one.
    let r = call("RemoveWatcher", json!({"watcherId": ids[0]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = call("CreateWatcher", json!({"path": "/tmp"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    // The others still answer.
    let r = call("GetWatcherEvents", json!({"watcherId": ids[1]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
}
