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
    let r = reqwest::Client::new()
        .post(format!("{}/sandboxes", d.url()))
        .header("X-API-KEY", key)
        .json(&json!({"templateID": "base", "network": network}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
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
