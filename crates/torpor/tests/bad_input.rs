//! Bad input gets a clear error with a stable code, in the one error shape; nothing panics.

mod common;

use common::*;
use serde_json::Value;
use torpor_api::types::ExecBody;
use torpor_core::Tier;

async fn raw(
    d: &Daemon,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Vec<u8>,
) -> (u16, Value, Option<String>) {
    let http = reqwest::Client::new();
    let mut rb = http.request(method.parse().unwrap(), format!("{}{path}", d.url()));
    if let Some(t) = token {
        rb = rb.bearer_auth(t);
    }
    let resp = rb.body(body).send().await.unwrap();
    let status = resp.status().as_u16();
    let retry = resp
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    let text = resp.text().await.unwrap();
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, v, retry)
}

/// A POST of `len` bytes, read as a client that keeps reading while it writes: the daemon may
/// answer and close before the body is all sent (then the rest of the write fails, which is
/// not the answer). Returns (status, JSON body).
async fn oversized_post(d: &Daemon, path: &str, token: &str, len: usize) -> (u16, Value) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", d.port))
        .await
        .unwrap();
    let (mut rd, mut wr) = stream.into_split();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
    );
    let writer = tokio::spawn(async move {
        if wr.write_all(head.as_bytes()).await.is_ok() {
            let _ = wr.write_all(&vec![b' '; len]).await;
        }
    });
    let mut resp = Vec::new();
    let _ = rd.read_to_end(&mut resp).await;
    writer.abort();
    let text = String::from_utf8_lossy(&resp);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("");
    // A chunked answer: the JSON sits between the chunk-size lines.
    let json = body
        .find('{')
        .zip(body.rfind('}'))
        .map_or("", |(a, b)| &body[a..=b]);
    (status, serde_json::from_str(json).unwrap_or(Value::Null))
}

fn code(v: &Value) -> &str {
    v["error"]["code"]
        .as_str()
        .unwrap_or_else(|| panic!("no error shape: {v}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn every_bad_request_gets_a_stable_code() {
    let d = Daemon::start().await;
    let t = d.token();
    let tok = Some(t.as_str());
    let c = d.client();
    let id = create(&c, "host").await;

    // (method, path, token, body, expected status, expected code)
    type Case<'a> = (&'a str, String, Option<&'a str>, Vec<u8>, u16, &'a str);
    let cases: Vec<Case> = vec![
        (
            "GET",
            "/v1/sandboxes".into(),
            None,
            vec![],
            401,
            "unauthorized",
        ),
        (
            "GET",
            "/v1/sandboxes".into(),
            Some("garbage"),
            vec![],
            401,
            "unauthorized",
        ),
        (
            "POST",
            "/v1/sandboxes".into(),
            tok,
            b"{\"template\":".to_vec(),
            400,
            "invalid_json",
        ),
        (
            "POST",
            "/v1/sandboxes".into(),
            tok,
            b"{\"template\":\"host\",\"x\":1}".to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/sandboxes".into(),
            tok,
            b"{\"template\":\"nope\"}".to_vec(),
            404,
            "not_found",
        ),
        (
            "POST",
            "/v1/sandboxes".into(),
            tok,
            b"{\"template\":\"host\",\"limits\":{\"memory_mib\":1}}".to_vec(),
            400,
            "invalid_request",
        ),
        (
            "GET",
            "/v1/sandboxes/sb-doesnotexist0000".into(),
            tok,
            vec![],
            404,
            "not_found",
        ),
        (
            "GET",
            "/v1/sandboxes/..%2F..%2Fetc".into(),
            tok,
            vec![],
            404,
            "not_found",
        ),
        (
            "GET",
            "/v1/templates/nope".into(),
            tok,
            vec![],
            404,
            "not_found",
        ),
        (
            "POST",
            "/v1/templates".into(),
            tok,
            b"{\"name\":\"host\",\"source\":{\"kind\":\"host\"}}".to_vec(),
            409,
            "already_exists",
        ),
        (
            "POST",
            "/v1/templates".into(),
            tok,
            b"{\"name\":\"Bad Name\",\"source\":{\"kind\":\"host\"}}".to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/v1/templates".into(),
            tok,
            b"{\"name\":\"r\",\"source\":{\"kind\":\"rootfs\",\"path\":\"/nonexistent\"}}".to_vec(),
            400,
            "invalid_request",
        ),
        (
            "DELETE",
            "/v1/templates/host".into(),
            tok,
            vec![],
            409,
            "template_in_use",
        ),
        (
            "POST",
            format!("/v1/sandboxes/{id}/exec"),
            tok,
            b"{\"cmd\":[]}".to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            format!("/v1/sandboxes/{id}/exec"),
            tok,
            b"{\"cmd\":[\"sleep\",\"5\"],\"timeout_ms\":200}".to_vec(),
            504,
            "exec_timeout",
        ),
        (
            "GET",
            format!("/v1/sandboxes/{id}/files?path=/a/../../etc/passwd"),
            tok,
            vec![],
            400,
            "invalid_path",
        ),
        (
            "GET",
            format!("/v1/sandboxes/{id}/files?path=/no/such/file"),
            tok,
            vec![],
            404,
            "file_not_found",
        ),
        (
            "GET",
            format!("/v1/sandboxes/{id}/files?path=/tmp"),
            tok,
            vec![],
            400,
            "is_a_directory",
        ),
        (
            "GET",
            format!("/v1/sandboxes/{id}/files"),
            tok,
            vec![],
            400,
            "invalid_request",
        ),
        (
            "PUT",
            format!("/v1/sandboxes/{id}/files?path=/x&mode=999"),
            tok,
            b"x".to_vec(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            format!("/v1/sandboxes/{id}/suspend"),
            tok,
            b"{\"tier\":\"lukewarm\"}".to_vec(),
            400,
            "invalid_request",
        ),
        (
            "DELETE",
            "/v1/sandboxes".into(),
            tok,
            vec![],
            405,
            "method_not_allowed",
        ),
        ("GET", "/v2/nothing".into(), tok, vec![], 404, "not_found"),
    ];
    let (status, v) = oversized_post(&d, "/v1/sandboxes", &d.token(), 2 << 20).await;
    assert_eq!((status, code(&v)), (413, "body_too_large"), "{v}");
    for (method, path, token, body, status, want) in cases {
        let (got, v, _) = raw(&d, method, &path, token, body).await;
        assert_eq!((got, code(&v)), (status, want), "{method} {path}: {v}");
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }

    // Invalid transition: a parked sandbox cannot be frozen.
    c.suspend(&id, Some(Tier::Parked)).await.unwrap();
    let (status, v, _) = raw(
        &d,
        "POST",
        &format!("/v1/sandboxes/{id}/suspend"),
        tok,
        b"{\"tier\":\"frozen\"}".to_vec(),
    )
    .await;
    assert_eq!((status, code(&v)), (409, "invalid_transition"), "{v}");

    // A missing program answers like a shell: exit 127, not an error.
    let r = c
        .exec(
            &id,
            &ExecBody {
                cmd: vec!["no-such-program".into()],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(127), "{r:?}");

    // A sandbox whose main process exits keeps answering.
    let r = c.exec(&id, &sh("exit 0")).await.unwrap();
    assert_eq!(r.exit_code, Some(0));

    // The OpenAPI document is served and names every route.
    let (status, v, _) = raw(&d, "GET", "/v1/openapi.json", None, vec![]).await;
    assert_eq!(status, 200);
    for p in [
        "/v1/sandboxes/{id}/exec",
        "/v1/sandboxes/{id}/files",
        "/v1/templates/{name}",
        "/v1/sandboxes/{id}/suspend",
    ] {
        assert!(v["paths"].get(p).is_some(), "openapi lacks {p}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn no_free_worker_answers_503_with_retry_after() {
    let d = Daemon::start_with(&["--worker-wait-ms", "300"]).await;
    let c = d.client();
    // Four workers, all busy with long execs: nothing idle to evict.
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(create(&c, "host").await);
    }
    let mut busy = Vec::new();
    for id in &ids {
        let c = c.clone();
        let id = id.clone();
        busy.push(tokio::spawn(async move {
            c.exec(&id, &sh("touch /tmp/started; sleep 3")).await
        }));
    }
    // Wait until every call is running (a slow machine may take a while to start them).
    for id in &ids {
        for _ in 0..150 {
            if c.read_file(id, "/tmp/started").await.is_ok() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
    let t = d.token();
    let (status, v, retry) = raw(
        &d,
        "POST",
        "/v1/sandboxes",
        Some(&t),
        b"{\"template\":\"host\"}".to_vec(),
    )
    .await;
    assert_eq!((status, code(&v)), (503, "no_worker_available"), "{v}");
    assert_eq!(retry.as_deref(), Some("1"));
    for b in busy {
        assert_eq!(b.await.unwrap().unwrap().exit_code, Some(0));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn startup_errors_are_clear() {
    let out = std::process::Command::new(BIN)
        .args([
            "up",
            "--listen",
            "127.0.0.1:0",
            "--runsc",
            "/nonexistent/runsc",
        ])
        .arg("--data-dir")
        .arg(tempfile::tempdir().unwrap().path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("apt-get install runsc") && err.contains("runsc_missing"),
        "{err}"
    );

    let out = std::process::Command::new(BIN)
        .args([
            "up",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            "/proc/torpor-cannot-be-here",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("data directory"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    // Keeping every worker back would let a tenant that holds one never take another.
    for (workers, reserved, says) in [
        (
            "2",
            "2",
            "--reserved-workers 2 must be less than --workers 2",
        ),
        ("2", "some", "neither `auto` nor a number"),
    ] {
        let out = std::process::Command::new(BIN)
            .args(["up", "--listen", "127.0.0.1:0", "--workers", workers])
            .args(["--reserved-workers", reserved])
            .arg("--data-dir")
            .arg(tempfile::tempdir().unwrap().path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(err.contains(says), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}
