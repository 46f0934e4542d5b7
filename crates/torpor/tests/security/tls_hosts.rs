//! Host names over HTTPS (`--tls-listen`, a wildcard certificate): `49983-{id}.<domain>` is
//! a sandbox's envd and `{port}-{id}.<domain>` one of its ports, as E2B's SDKs build them. A
//! tenant naming another tenant's sandbox in the host must be refused exactly as the path and
//! header forms are (same status, same code), whatever it sends beside (its own sandbox's
//! access token, its own API key, a header naming its own sandbox, a TLS name of its own), and
//! the HTTPS listener must not hold connections that never speak TLS. Real daemon, real runsc
//! sandboxes, TLS verified against the test CA; E2B's wire spoken raw.

#[path = "../common/https.rs"]
mod https;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use torpor_api::types::CreateTenantBody;

use crate::common::*;
use https::{Answer, Https, TestCerts};

const DOMAIN: &str = "tls-hosts.test";

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

/// A daemon with the HTTPS listener, and a client of it.
async fn tls_daemon(extra: &[&str]) -> (Daemon, Https, TestCerts) {
    let certs = TestCerts::wildcard(DOMAIN);
    let mut flags = certs.flags(DOMAIN);
    flags.extend(extra.iter().map(|s| s.to_string()));
    let d = Daemon::start_with(&flags.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let port = https::https_port(&d).await;
    let client = Https::new(port, &certs.ca_der);
    (d, client, certs)
}

/// An E2B sandbox of `key`'s tenant (E2B's `base`), created on the plain listener:
/// (sandbox id, envd access token, traffic access token when private).
async fn e2b_sandbox(d: &Daemon, key: &str, public: bool) -> (String, String, Option<String>) {
    let v = e2b_created(
        d,
        key,
        json!({"templateID": "base", "timeout": 600, "network": {"allowPublicTraffic": public}}),
    )
    .await;
    (
        v["sandboxID"].as_str().unwrap().to_string(),
        v["envdAccessToken"].as_str().unwrap().to_string(),
        v["trafficAccessToken"].as_str().map(str::to_string),
    )
}

/// The same request on the plain listener, as written: (status, body).
async fn plain(
    d: &Daemon,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", d.port))
        .await
        .unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let status = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The error code of an answer body: torpor's `{"error": {"code"}}`, E2B's and Connect's
/// `{"code"}`, as a string.
fn code_of(body: &str) -> String {
    let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
    let code = if v["error"]["code"].is_null() {
        &v["code"]
    } else {
        &v["error"]["code"]
    };
    match code {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn refused_like(a: &Answer, path_form: &(u16, String), what: &str, secret: &str) {
    assert_eq!(
        (a.status, code_of(&a.text())),
        (path_form.0, code_of(&path_form.1)),
        "{what}: refused as the path form is ({}), got {}",
        path_form.1,
        a.text()
    );
    assert!(
        matches!(a.status, 401 | 403 | 404),
        "{what}: a refusal, got {} {}",
        a.status,
        a.text()
    );
    assert!(!a.text().contains(secret), "{what}: leaked {}", a.text());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_cannot_reach_another_tenants_envd_through_its_host_name_over_tls() {
    let (d, tls, _certs) = tls_daemon(&[]).await;
    let key_a = tenant(&d, "tlsh-a").await;
    let key_b = tenant(&d, "tlsh-b").await;
    let (sa, ta, _) = e2b_sandbox(&d, &key_a, true).await;
    let (sb, tb, _) = e2b_sandbox(&d, &key_b, true).await;
    let host_a = format!("49983-{sa}.{DOMAIN}");
    let host_b = format!("49983-{sb}.{DOMAIN}");
    let json_ct = ("Content-Type", "application/json");
    let secret = "secret-of-tenant-b";

    // B writes a secret through its own envd host; A reaches its own sandbox the same way.
    let w = tls
        .request(
            "POST",
            &host_b,
            "/files?path=/home/user/secret.txt",
            &[
                ("X-Access-Token", &tb),
                ("Content-Type", "application/octet-stream"),
            ],
            secret.as_bytes(),
        )
        .await;
    assert_eq!(w.status, 200, "B writes through its host: {}", w.text());
    let own = tls
        .request(
            "POST",
            &host_a,
            "/process.Process/List",
            &[("X-Access-Token", &ta), json_ct],
            b"{}",
        )
        .await;
    assert_eq!(own.status, 200, "A's own envd host: {}", own.text());

    // By host name over TLS: A's token, A's token with a header naming A's sandbox (the host
    // names the sandbox), A's API key in every header E2B and torpor read, nothing. Each is
    // refused as its header form (E2B_SANDBOX_URL, `E2b-Sandbox-Id` of B) is.
    let read_path = "/files?path=/home/user/secret.txt";
    let bearer_a = format!("Bearer {key_a}");
    let attempts: Vec<(&str, Vec<(&str, &str)>)> = vec![
        ("A's access token", vec![("X-Access-Token", &ta)]),
        (
            "A's token and E2b-Sandbox-Id of A",
            vec![("X-Access-Token", &ta), ("E2b-Sandbox-Id", &sa)],
        ),
        (
            "A's API key",
            vec![("X-API-KEY", &key_a), ("Authorization", &bearer_a)],
        ),
        ("no credentials", vec![]),
    ];
    let mut read_form = None;
    for (what, headers) in &attempts {
        let mut header_form: Vec<(&str, &str)> = headers
            .iter()
            .filter(|(k, _)| *k != "E2b-Sandbox-Id")
            .copied()
            .collect();
        header_form.push(("E2b-Sandbox-Id", &sb));
        let list_ref = plain(
            &d,
            "POST",
            "/process.Process/List",
            &[header_form.as_slice(), &[json_ct]].concat(),
            "{}",
        )
        .await;
        let read_ref = plain(&d, "GET", read_path, &header_form, "").await;
        assert_eq!(list_ref.0, 401, "{what}: {}", list_ref.1);
        assert_eq!(read_ref.0, 401, "{what}: {}", read_ref.1);
        let a = tls
            .request(
                "POST",
                &host_b,
                "/process.Process/List",
                &[headers.as_slice(), &[json_ct]].concat(),
                b"{}",
            )
            .await;
        refused_like(&a, &list_ref, &format!("List, {what}"), secret);
        let a = tls.request("GET", &host_b, read_path, headers, b"").await;
        refused_like(&a, &read_ref, &format!("read, {what}"), secret);
        read_form.get_or_insert(read_ref);
    }
    let read_form = read_form.unwrap();

    // A TLS session for A's own name carrying B's host: the host decides, and is refused.
    let a = tls
        .request_as(
            &host_a,
            "GET",
            &host_b,
            read_path,
            &[("X-Access-Token", &ta)],
            b"",
        )
        .await
        .unwrap();
    refused_like(&a, &read_form, "SNI of A, Host of B", secret);

    // An envd host serves envd's routes only: not the API under B's name.
    let a = tls
        .request(
            "GET",
            &host_b,
            &format!("/v1/sandboxes/{sb}"),
            &[("Authorization", &bearer_a)],
            b"",
        )
        .await;
    assert_eq!(
        (a.status, code_of(&a.text())),
        (404, "not_found".into()),
        "{}",
        a.text()
    );

    // Nothing changed for B: its secret is there, read through its own host.
    let r = tls
        .request("GET", &host_b, read_path, &[("X-Access-Token", &tb)], b"")
        .await;
    assert_eq!((r.status, r.text().as_str()), (200, secret));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_cannot_reach_another_tenants_private_port_through_its_host_name_over_tls() {
    let (d, tls, _certs) = tls_daemon(&[]).await;
    let key_a = tenant(&d, "tlsp-a").await;
    let key_b = tenant(&d, "tlsp-b").await;
    let (sa, _, traffic_a) = e2b_sandbox(&d, &key_a, false).await;
    let (sb, _, traffic_b) = e2b_sandbox(&d, &key_b, false).await;
    let traffic_a = traffic_a.expect("a private sandbox has a traffic token");
    let traffic_b = traffic_b.expect("a private sandbox has a traffic token");
    let secret = "port-secret-of-b";
    // B serves a secret on port 8080 (torpor's own exec, detached).
    let r = reqwest::Client::new()
        .post(format!("{}/v1/sandboxes/{sb}/exec", d.url()))
        .bearer_auth(&key_b)
        .json(&json!({"cmd": ["sh", "-c", format!(
            "mkdir -p /tmp/www && echo {secret} > /tmp/www/s.txt && cd /tmp/www && \
             exec python3 -m http.server -p HTTP/1.1 8080")],
            "detach": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap());
    let host_b = format!("8080-{sb}.{DOMAIN}");
    let host_a = format!("8080-{sa}.{DOMAIN}");
    let bearer_a = format!("Bearer {key_a}");
    let bearer_b = format!("Bearer {key_b}");
    // B reaches it by host over TLS, with its token and with the traffic token.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let a = tls
            .request(
                "GET",
                &host_b,
                "/s.txt",
                &[("Authorization", &bearer_b)],
                b"",
            )
            .await;
        if a.status == 200 {
            assert_eq!(a.text().trim(), secret);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never served: {} {}",
            a.status,
            a.text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The path form refuses A: the reference for each attempt.
    let path = format!("/v1/sandboxes/{sb}/ports/8080/s.txt");
    let with_a = plain(&d, "GET", &path, &[("Authorization", &bearer_a)], "").await;
    let anonymous = plain(&d, "GET", &path, &[], "").await;
    assert_ne!(with_a.0, 200, "{}", with_a.1);
    assert_eq!(anonymous.0, 401, "{}", anonymous.1);

    let a = tls
        .request(
            "GET",
            &host_b,
            "/s.txt",
            &[("Authorization", &bearer_a)],
            b"",
        )
        .await;
    refused_like(&a, &with_a, "A's bearer token", secret);
    let a = tls.request("GET", &host_b, "/s.txt", &[], b"").await;
    refused_like(&a, &anonymous, "no credentials", secret);
    // A's own sandbox's traffic token is not B's.
    let a = tls
        .request(
            "GET",
            &host_b,
            "/s.txt",
            &[("e2b-traffic-access-token", &traffic_a)],
            b"",
        )
        .await;
    refused_like(&a, &anonymous, "A's traffic token", secret);
    // A verified TLS session for A's own name, B's host inside.
    let a = tls
        .request_as(
            &host_a,
            "GET",
            &host_b,
            "/s.txt",
            &[("Authorization", &bearer_a)],
            b"",
        )
        .await
        .unwrap();
    refused_like(&a, &with_a, "SNI of A, Host of B", secret);

    // B's traffic token still opens it; B is unaffected.
    let a = tls
        .request(
            "GET",
            &host_b,
            "/s.txt",
            &[("e2b-traffic-access-token", &traffic_b)],
            b"",
        )
        .await;
    assert_eq!((a.status, a.text().trim()), (200, secret));
}

#[tokio::test(flavor = "multi_thread")]
async fn silent_and_plaintext_clients_on_the_https_listener_are_dropped() {
    let (d, tls, _certs) = tls_daemon(&["--header-read-timeout-ms", "300"]).await;
    // A connection that never sends a ClientHello is closed (no slot held forever).
    let mut silent = tokio::net::TcpStream::connect(("127.0.0.1", tls.port))
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(60), silent.read(&mut buf))
        .await
        .expect("the server closes a silent connection");
    assert!(matches!(n, Ok(0) | Err(_)), "closed, not answered: {n:?}");
    // Plain HTTP on the HTTPS port gets no HTTP answer.
    let mut plain_conn = tokio::net::TcpStream::connect(("127.0.0.1", tls.port))
        .await
        .unwrap();
    plain_conn
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(60), plain_conn.read_to_end(&mut out))
        .await
        .expect("the server ends a plaintext connection");
    assert!(
        !String::from_utf8_lossy(&out).contains("HTTP/1.1 200"),
        "no plaintext answer: {out:?}"
    );
    // A certificate for another name is refused by a verifying client: TLS fails.
    let err = tls
        .request_as(
            "api.elsewhere.test",
            "GET",
            "api.elsewhere.test",
            "/healthz",
            &[],
            b"",
        )
        .await
        .expect_err("the certificate does not cover another domain");
    assert!(err.starts_with("TLS"), "{err}");
    // The listener still serves, over TLS and in plain on --listen.
    let ok = tls
        .request("GET", &format!("api.{DOMAIN}"), "/healthz", &[], b"")
        .await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert!(d.client().is_up().await);
}
