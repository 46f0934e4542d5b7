//! The E2B `base` template's boundaries: its egress ceiling is the operator's
//! (`--e2b-egress-ceiling`), and no E2B option, v1 request or network update widens it; under
//! the widest ceiling (`full`) the host still stays closed. Real daemon, real runsc sandboxes,
//! real traffic; E2B's REST API spoken raw, as the SDKs speak it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use torpor_api::types::{CreateSandboxBody, CreateTenantBody, ExecBody};
use torpor_api::ClientError;

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

/// `POST /sandboxes` through E2B's API with `network`: (status, body).
async fn e2b_create(d: &Daemon, key: &str, network: Value) -> (u16, Value) {
    e2b_post_sandbox(
        d,
        key,
        "/sandboxes",
        json!({"templateID": "base", "network": network}),
    )
    .await
}

/// `PUT /sandboxes/{id}/network`: its status.
async fn e2b_update_network(d: &Daemon, key: &str, id: &str, network: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .put(format!("{}/sandboxes/{id}/network", d.url()))
        .header("X-API-KEY", key)
        .json(&network)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn policy_of(d: &Daemon, key: &str, id: &str) -> Value {
    reqwest::Client::new()
        .get(format!("{}/v1/sandboxes/{id}/network", d.url()))
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn refused_as_wider(status: u16, body: &Value, what: &str) {
    assert_eq!(status, 400, "{what}: {body}");
    assert_eq!(body["code"], 400, "{what}: E2B's error shape {body}");
    let m = body["message"].as_str().unwrap_or_default();
    assert!(m.contains("limits egress"), "{what}: {m}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_cannot_widen_e2b_base_egress_past_the_operators_ceiling() {
    let host = host_addr();
    let d = Daemon::start_with(&["--e2b-egress-ceiling", "198.51.100.0/24"]).await;
    let key = tenant(&d, "ceil-a").await;
    // Everything (allow_out alone is E2B's "nothing denied"), a destination outside the
    // ceiling, the host's own address, a name (what it resolves to is not known): refused.
    for (what, network) in [
        ("allow all", json!({"allowOut": ["0.0.0.0/0"]})),
        (
            "outside",
            json!({"allowOut": ["8.8.8.8"], "denyOut": ["0.0.0.0/0"]}),
        ),
        (
            "the host",
            json!({"allowOut": [host.clone()], "denyOut": ["0.0.0.0/0"]}),
        ),
        (
            "a name",
            json!({"allowOut": ["example.com"], "denyOut": ["0.0.0.0/0"]}),
        ),
        (
            "a wider net",
            json!({"allowOut": ["198.51.0.0/16"], "denyOut": ["0.0.0.0/0"]}),
        ),
    ] {
        let (status, body) = e2b_create(&d, &key, network).await;
        refused_as_wider(status, &body, what);
    }
    // Inside the ceiling: made, with exactly that.
    let (status, body) = e2b_create(
        &d,
        &key,
        json!({"allowOut": ["198.51.100.7"], "denyOut": ["0.0.0.0/0"]}),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let id = body["sandboxID"].as_str().unwrap().to_string();
    let p = policy_of(&d, &key, &id).await;
    assert_eq!(
        p["network"],
        json!({"allow": [{"cidr": "198.51.100.7/32"}], "hosts": []}),
        "{p}"
    );
    // No widening afterwards either, and the refused update changed nothing.
    let (status, body) =
        e2b_update_network(&d, &key, &id, json!({"allowOut": ["0.0.0.0/0"]})).await;
    refused_as_wider(status, &body, "update to everything");
    assert_eq!(
        policy_of(&d, &key, &id).await,
        p,
        "the refused update left it"
    );
    // Nor around E2B: torpor's own API on the same template.
    let err = torpor_api::Client::new(&d.url(), &key)
        .create_sandbox(&CreateSandboxBody {
            template: "base".into(),
            network: Some(torpor_core::NetworkPolicy::full()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    match err {
        ClientError::Api { status, code, .. } => {
            assert_eq!((status, code.as_str()), (400, "invalid_request"))
        }
        other => panic!("{other}"),
    }
    // Another tenant is untouched: it gets the ceiling's own sandbox.
    let other = tenant(&d, "ceil-b").await;
    let (status, body) = e2b_create(&d, &other, json!({})).await;
    assert_eq!(status, 201, "{body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_e2b_sandbox_under_a_full_ceiling_still_cannot_reach_the_host() {
    let host = host_addr();
    let open = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let listed = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let (open_port, listed_port) = (
        open.local_addr().unwrap().port(),
        listed.local_addr().unwrap().port(),
    );
    let hits = Arc::new(AtomicUsize::new(0));
    for (l, body) in [(open, "host-open"), (listed, "host-listed")] {
        let hits = hits.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                if body == "host-open" {
                    hits.fetch_add(1, Ordering::SeqCst);
                }
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(format!("HTTP/1.0 200 OK\r\n\r\n{body}").as_bytes())
                    .await;
            }
        });
    }
    let d = Daemon::start_with(&[
        "--e2b-egress-ceiling",
        "full",
        "--sandbox-reach-host",
        &format!("{host}:{listed_port}"),
    ])
    .await;
    let key = tenant(&d, "full-a").await;
    // The tenant asks for everything, the host by name included: E2B's options apply as they
    // are under a full ceiling.
    let (status, body) = e2b_create(
        &d,
        &key,
        json!({"allowOut": [host.clone(), "0.0.0.0/0"], "denyOut": ["0.0.0.0/0"]}),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let id = body["sandboxID"].as_str().unwrap().to_string();
    let c = torpor_api::Client::new(&d.url(), &key);
    let tcp = |port: u16| {
        let c = &c;
        let id = &id;
        let host = &host;
        async move {
            let code = format!(
                "import socket\n\
                 s=socket.socket(); s.settimeout(3)\n\
                 try:\n  s.connect(('{host}',{port})); s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n'); d=s.recv(64)\n  print('ok', d.decode(errors='replace').split()[-1] if d else 'fail-empty')\n\
                 except Exception as e:\n  print('fail', type(e).__name__)\n"
            );
            let r = c
                .exec(
                    id,
                    &ExecBody {
                        cmd: vec!["python3".into(), "-c".into(), code],
                        timeout_ms: Some(60_000),
                        ..Default::default()
                    },
                )
                .await
                .unwrap();
            r.stdout.trim().to_string()
        }
    };
    // The operator's exception answers (the sandbox's network works) ...
    assert_eq!(tcp(listed_port).await, "ok host-listed");
    // ... the rest of the host does not, whatever the sandbox's policy says.
    let got = tcp(open_port).await;
    assert!(got.starts_with("fail"), "{got}");
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "the host's server saw no connection"
    );
}

/// An E2B sandbox of `key`'s (base): (id, envd access token).
async fn e2b_sandbox(d: &Daemon, key: &str) -> (String, String) {
    let (status, body) = e2b_create(d, key, json!({})).await;
    assert_eq!(status, 201, "{body}");
    (
        body["sandboxID"].as_str().unwrap().to_string(),
        body["envdAccessToken"].as_str().unwrap().to_string(),
    )
}

/// `/files` on torpor's listener: `query` as given, optional sandbox and token headers, a
/// body for POST (octet-stream). Answers (status, body text).
async fn files_call(
    d: &Daemon,
    post: Option<&str>,
    query: &[(&str, String)],
    sandbox: Option<&str>,
    token: Option<&str>,
) -> (u16, String) {
    let client = reqwest::Client::new();
    let url = format!("{}/files", d.url());
    let mut req = match post {
        Some(data) => client
            .post(url)
            .header("Content-Type", "application/octet-stream")
            .body(data.to_string()),
        None => client.get(url),
    }
    .query(query);
    if let Some(s) = sandbox {
        req = req.header("E2b-Sandbox-Id", s);
    }
    if let Some(t) = token {
        req = req.header("X-Access-Token", t);
    }
    let r = req.send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// A signed `/files` query as the SDK builds it (path, optional username, signature, expiry).
fn signed_query(
    path: &str,
    user: &str,
    sig: String,
    exp: Option<i64>,
) -> Vec<(&'static str, String)> {
    let mut q = vec![("path", path.to_string()), ("signature", sig)];
    if !user.is_empty() {
        q.push(("username", user.to_string()));
    }
    if let Some(e) = exp {
        q.push(("signature_expiration", e.to_string()));
    }
    q
}

#[tokio::test(flavor = "multi_thread")]
async fn a_signed_file_url_reaches_only_its_own_sandbox_path_user_and_operation() {
    use torpor_api::e2b::signed::{signature, Operation};
    let d = Daemon::start().await;
    let key_a = tenant(&d, "sign-a").await;
    let key_b = tenant(&d, "sign-b").await;
    let (a, token_a) = e2b_sandbox(&d, &key_a).await;
    let (b, token_b) = e2b_sandbox(&d, &key_b).await;
    for (id, token, data) in [(&a, &token_a, "a-secret"), (&b, &token_b, "b-own")] {
        for path in ["/home/user/secret.txt", "/home/user/public.txt"] {
            let q = [("path", path.to_string())];
            let (s, body) = files_call(&d, Some(data), &q, Some(id), Some(token)).await;
            assert_eq!(s, 200, "{body}");
        }
    }
    let exp = Some(unix_now() + 600);
    let read_public =
        |token: &str| signature("/home/user/public.txt", Operation::Read, "", token, exp);
    // The legitimate use works, with or without naming the sandbox.
    let q = signed_query("/home/user/public.txt", "", read_public(&token_a), exp);
    assert_eq!(
        files_call(&d, None, &q, None, None).await,
        (200, "a-secret".into())
    );
    assert_eq!(
        files_call(&d, None, &q, Some(&a), None).await,
        (200, "a-secret".into())
    );
    let invalid = (
        401,
        r#"{"code":401,"message":"invalid signature"}"#.to_string(),
    );

    // Another path than the one signed.
    let q = signed_query("/home/user/secret.txt", "", read_public(&token_a), exp);
    assert_eq!(files_call(&d, None, &q, None, None).await, invalid);
    assert_eq!(files_call(&d, None, &q, Some(&a), None).await, invalid);
    // Another user than the one signed (root reads what user cannot).
    let q = signed_query("/home/user/public.txt", "root", read_public(&token_a), exp);
    assert_eq!(files_call(&d, None, &q, None, None).await, invalid);
    // A later expiry than the one signed, or none.
    let q = signed_query(
        "/home/user/public.txt",
        "",
        read_public(&token_a),
        Some(unix_now() + 99_999),
    );
    assert_eq!(files_call(&d, None, &q, None, None).await, invalid);
    let q = signed_query("/home/user/public.txt", "", read_public(&token_a), None);
    assert_eq!(files_call(&d, None, &q, None, None).await, invalid);
    // A read signature used to write: refused, nothing written.
    let q = signed_query("/home/user/public.txt", "", read_public(&token_a), exp);
    assert_eq!(
        files_call(&d, Some("overwritten"), &q, None, None).await,
        invalid
    );
    assert_eq!(
        files_call(&d, Some("overwritten"), &q, Some(&a), None).await,
        invalid
    );
    // Another sandbox's signature: tenant B signs with its own sandbox's token and names A's
    // sandbox: refused; unaddressed, it reaches B's own sandbox only.
    let q = signed_query("/home/user/public.txt", "", read_public(&token_b), exp);
    assert_eq!(files_call(&d, None, &q, Some(&a), None).await, invalid);
    assert_eq!(
        files_call(&d, None, &q, None, None).await,
        (200, "b-own".into())
    );
    // A wrong access token beside a valid signature: the token is checked (envd's rule).
    let q = signed_query("/home/user/public.txt", "", read_public(&token_a), exp);
    let (s, _) = files_call(&d, None, &q, Some(&a), Some(&token_b)).await;
    assert_eq!(s, 401);
    // Forged and malformed signatures.
    for sig in [
        "v1_".to_string() + &"A".repeat(43),
        String::new(),
        "v2_x".into(),
        token_a.clone(),
    ] {
        let q = signed_query("/home/user/public.txt", "", sig, exp);
        assert_eq!(files_call(&d, None, &q, None, None).await, invalid);
    }
    // An expired signature, valid otherwise.
    let past = Some(unix_now() - 5);
    let sig = signature("/home/user/public.txt", Operation::Read, "", &token_a, past);
    let q = signed_query("/home/user/public.txt", "", sig, past);
    assert_eq!(
        files_call(&d, None, &q, None, None).await,
        (
            401,
            r#"{"code":401,"message":"signature is already expired"}"#.into()
        )
    );
    // Nothing leaked or changed: A's files are as written, and tenant B still works.
    for (path, want) in [
        ("/home/user/secret.txt", "a-secret"),
        ("/home/user/public.txt", "a-secret"),
    ] {
        let q = [("path", path.to_string())];
        assert_eq!(
            files_call(&d, None, &q, Some(&a), Some(&token_a)).await,
            (200, want.into())
        );
    }
    let q = [("path", "/home/user/secret.txt".to_string())];
    assert_eq!(
        files_call(&d, None, &q, Some(&b), Some(&token_b)).await,
        (200, "b-own".into())
    );
    // A write signature writes, as the signed user, only where it was signed for.
    let sig = signature("/home/user/up.txt", Operation::Write, "", &token_a, exp);
    let q = signed_query("/home/user/up.txt", "", sig, exp);
    let (s, body) = files_call(&d, Some("uploaded"), &q, None, None).await;
    assert_eq!(s, 200, "{body}");
    let q = [("path", "/home/user/up.txt".to_string())];
    assert_eq!(
        files_call(&d, None, &q, Some(&a), Some(&token_a)).await,
        (200, "uploaded".into())
    );
    let _ = key_b;
}
