//! Sandbox networking end to end: real namespaces, real runsc network stacks, real traffic
//! (between the sandboxes and servers this test runs on the host's own addresses).

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use torpor_api::types::{CreateSandboxBody, CreateTenantBody, ExecBody};
use torpor_api::ClientError;
use torpor_core::{NetworkPolicy, Tier};

/// The template networked sandboxes are made from: its policy, `full`, is the widest their own
/// may be (a template's policy is the operator's ceiling; `host` has none: ingress only).
const NET: &str = "net";

async fn create_net(c: &torpor_api::Client, policy: serde_json::Value) -> String {
    if c.template(NET).await.is_err() {
        let mut tpl = agent_template(NET, no_idle());
        tpl.command = Vec::new();
        tpl.warmup_ms = 0;
        tpl.network = Some(NetworkPolicy::full());
        c.create_template(&tpl).await.unwrap();
    }
    c.create_sandbox(&CreateSandboxBody {
        template: NET.into(),
        network: Some(serde_json::from_value(policy).unwrap()),
        ..Default::default()
    })
    .await
    .unwrap()
    .id
}

async fn metrics(d: &Daemon) -> String {
    reqwest::Client::new()
        .get(format!("{}/metrics", d.url()))
        .bearer_auth(d.token())
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

async fn patch_network(d: &Daemon, id: &str, policy: serde_json::Value) -> reqwest::Response {
    reqwest::Client::new()
        .patch(format!("{}/v1/sandboxes/{id}", d.url()))
        .bearer_auth(d.token())
        .json(&json!({ "network": policy }))
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn egress_follows_the_policy_and_changes_apply_live() {
    let host = host_addr();
    // The host's addresses are closed to sandboxes unless listed: this test's servers are on one.
    let d = Daemon::start_with(&["--sandbox-reach-host", &host]).await;
    let c = d.client();
    let port = host_server("hello-from-host").await;
    let url = format!("http://{host}:{port}/");

    let allowed = create_net(
        &c,
        json!({"allow": [{"cidr": format!("{host}/32"), "ports": [port]}]}),
    )
    .await;
    let other_port = create_net(
        &c,
        json!({"allow": [{"cidr": format!("{host}/32"), "ports": [port - 1]}]}),
    )
    .await;
    let full = create_net(&c, json!("full")).await;
    let plain = create(&c, "host").await;

    assert_eq!(
        fetch(&c, &allowed, &url).await.as_deref(),
        Some("hello-from-host")
    );
    assert_eq!(
        fetch(&c, &full, &url).await.as_deref(),
        Some("hello-from-host")
    );
    assert_eq!(
        fetch(&c, &other_port, &url).await,
        None,
        "port not on the list"
    );
    assert_eq!(fetch(&c, &plain, &url).await, None, "no network at all");

    // Metrics: the denied attempt by destination, traffic of the allowed sandbox.
    let m = metrics(&d).await;
    let denied = metric(
        &m,
        &format!(
            "torpor_sandbox_egress_denied_packets{{destination=\"{host}:{port}\",sandbox=\"{other_port}\"}}"
        ),
    );
    assert!(denied >= 1, "{m}");
    assert!(
        metric(
            &m,
            &format!("torpor_sandbox_network_bytes{{direction=\"tx\",sandbox=\"{allowed}\"}}")
        ) > 0
    );
    assert!(
        metric(
            &m,
            &format!(
                "torpor_sandbox_network_connections{{direction=\"egress\",sandbox=\"{allowed}\"}}"
            )
        ) >= 1
    );

    // Live changes, no restart.
    let r = patch_network(&d, &other_port, json!("full")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        fetch(&c, &other_port, &url).await.as_deref(),
        Some("hello-from-host")
    );
    assert_eq!(
        patch_network(&d, &allowed, json!("none")).await.status(),
        200
    );
    assert_eq!(
        fetch(&c, &allowed, &url).await,
        None,
        "policy none drops egress"
    );
    let got: serde_json::Value = reqwest::Client::new()
        .get(format!("{}/v1/sandboxes/{allowed}/network", d.url()))
        .bearer_auth(d.token())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(got["network"], json!("none"));

    // A sandbox made without a network cannot be given one later.
    let r = patch_network(&d, &plain, json!("full")).await;
    assert_eq!(r.status(), 400);

    // The policy survives a sleep on another worker: egress allowed again after a wake.
    c.suspend(&full, Some(Tier::Suspended)).await.unwrap();
    assert_eq!(
        fetch(&c, &full, &url).await.as_deref(),
        Some("hello-from-host")
    );

    // Invalid policies are refused at create, naming the field.
    for (policy, field) in [
        (
            json!({"allow": [{"cidr": "10.0.0.0/33"}]}),
            "network.allow[0].cidr",
        ),
        (
            json!({"allow": [{"cidr": "nonsense"}]}),
            "network.allow[0].cidr",
        ),
        (
            json!({"allow": [{"cidr": "10.0.0.1", "ports": [0]}]}),
            "network.allow[0].ports[0]",
        ),
        (
            json!({"allow": [{"cidr": "10.0.0.1", "ports": [65536]}]}),
            "network.allow[0].ports[0]",
        ),
        (
            json!({"hosts": ["ok.example", "not a host"]}),
            "network.hosts[1]",
        ),
    ] {
        let err = c
            .create_sandbox(&CreateSandboxBody {
                template: "host".into(),
                network: Some(serde_json::from_value::<NetworkPolicy>(policy).unwrap()),
                ..Default::default()
            })
            .await
            .unwrap_err();
        match err {
            ClientError::Api {
                status, message, ..
            } => {
                assert_eq!(status, 400);
                assert!(message.contains(field), "{message} names {field}");
            }
            other => panic!("{other}"),
        }
    }
    // A template's policy is its sandboxes' default; a sandbox may override it.
    let mut tpl = agent_template("net-full", no_idle());
    tpl.command = Vec::new();
    tpl.warmup_ms = 0;
    tpl.network = Some(NetworkPolicy::full());
    c.create_template(&tpl).await.unwrap();
    let from_tpl = create(&c, "net-full").await;
    assert_eq!(
        fetch(&c, &from_tpl, &url).await.as_deref(),
        Some("hello-from-host")
    );
    let overridden = c
        .create_sandbox(&CreateSandboxBody {
            template: "net-full".into(),
            network: Some(serde_json::from_value(json!({"allow": []})).unwrap()),
            ..Default::default()
        })
        .await
        .unwrap()
        .id;
    assert_eq!(fetch(&c, &overridden, &url).await, None);
    let mut bad = agent_template("net-bad", no_idle());
    bad.network = Some(serde_json::from_value(json!({"allow": [{"cidr": "1.2.3.4/40"}]})).unwrap());
    match c.create_template(&bad).await.unwrap_err() {
        ClientError::Api {
            status, message, ..
        } => {
            assert_eq!(status, 400);
            assert!(message.contains("network.allow[0].cidr"), "{message}");
        }
        other => panic!("{other}"),
    }
    for id in [&allowed, &other_port, &full, &plain, &from_tpl, &overridden] {
        c.delete_sandbox(id).await.unwrap();
    }
}

/// A worker's network is made once and reused: the address its link needs and the `none`
/// policy are put back when a sandbox leaves it, so the next create runs neither `ip` nor `nft`
/// when its policy is `none`. Whether a sandbox lands on a fresh worker or on one an earlier
/// sandbox used (the pool decides; `torpor_runtime::net`'s tests reset one deterministically),
/// what an earlier sandbox was allowed must never carry over, and every sandbox's link must
/// have its address (a create and a wake).
#[tokio::test(flavor = "multi_thread")]
async fn a_reused_workers_network_carries_nothing_over_to_its_next_sandbox() {
    let host = host_addr();
    let d = Daemon::start_with(&[
        "--sandbox-reach-host",
        &host,
        "--workers",
        "1",
        "--warm-pool",
        "1",
    ])
    .await;
    let c = d.client();
    let port = host_server("hello-from-host").await;
    let url = format!("http://{host}:{port}/");
    let worker = |s: torpor_api::types::Sandbox| s.worker.expect("a running sandbox has a worker");

    // Sandboxes alternate between `full` and the reset's policy until each kind has landed on
    // a worker an earlier sandbox used (the pool may hand out another prepared worker first).
    let mut used = std::collections::HashSet::new();
    let (mut reused_open, mut reused_closed) = (false, false);
    let mut reopened = String::new();
    for _ in 0..6 {
        let open = create_net(&c, json!("full")).await;
        let w = worker(c.sandbox(&open).await.unwrap());
        reused_open |= used.contains(&w);
        assert_eq!(
            fetch(&c, &open, &url).await.as_deref(),
            Some("hello-from-host"),
            "a `full` sandbox on {w} (used before: {})",
            used.contains(&w)
        );
        used.insert(w);
        if reused_open && reused_closed {
            reopened = open;
            break;
        }
        c.delete_sandbox(&open).await.unwrap();

        let closed = create_net(&c, json!({"allow": []})).await;
        let w = worker(c.sandbox(&closed).await.unwrap());
        reused_closed |= used.contains(&w);
        assert_eq!(
            fetch(&c, &closed, &url).await,
            None,
            "an earlier sandbox's `full` carried over to the next on {w}"
        );
        // Its link has its address: a server in it is reached through the ingress proxy.
        let r = c
            .exec(
                &closed,
                &ExecBody {
                    detach: true,
                    ..sh("echo on-its-link > /tmp/hello.txt && cd /tmp && exec python3 -m http.server -p HTTP/1.1 8080")
                },
            )
            .await
            .unwrap();
        assert!(!r.stdout.is_empty(), "detach returns a pid: {r:?}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (status, body) = proxied(&d, &d.token(), &closed, "8080/hello.txt").await;
            if status == 200 {
                assert_eq!(body.trim(), "on-its-link");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the server on {w} never answered through its link: {status} {body}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        used.insert(w);
        c.delete_sandbox(&closed).await.unwrap();
    }
    if reopened.is_empty() {
        eprintln!("note: reused workers: full {reused_open}, none {reused_closed} ({used:?})");
        reopened = create_net(&c, json!("full")).await;
    }
    // A wake onto the worker its own park gave back (or another): its address is there.
    c.suspend(&reopened, Some(Tier::Parked)).await.unwrap();
    assert_eq!(
        fetch(&c, &reopened, &url).await.as_deref(),
        Some("hello-from-host")
    );
    c.delete_sandbox(&reopened).await.unwrap();
}

async fn proxied(d: &Daemon, token: &str, id: &str, rest: &str) -> (u16, String) {
    let r = reqwest::Client::new()
        .get(format!("{}/v1/sandboxes/{id}/ports/{rest}", d.url()))
        .bearer_auth(token)
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// Sends a request line as written (no client-side path normalisation).
async fn raw_status(d: &Daemon, path: &str) -> u16 {
    raw_get(d, "x", path).await.0
}

/// A GET with the given Host header and path, as written: (status, body).
async fn raw_get(d: &Daemon, host: &str, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", d.port))
        .await
        .unwrap();
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
        d.token()
    );
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

#[tokio::test(flavor = "multi_thread")]
async fn a_proxied_request_wakes_a_sleeping_server() {
    let d = Daemon::start_with(&["--proxy-domain", "sandboxes.test"]).await;
    let c = d.client();
    // Ingress only: a network with no egress allowed.
    let id = create_net(&c, json!({"allow": []})).await;
    let r = c
        .exec(
            &id,
            &ExecBody {
                detach: true,
                ..sh("echo served-from-sandbox > /tmp/hello.txt && cd /tmp && exec python3 -m http.server -p HTTP/1.1 8080")
            },
        )
        .await
        .unwrap();
    assert!(
        r.stdout.parse::<u32>().is_ok(),
        "detach returns a pid: {r:?}"
    );
    let token = d.token();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = proxied(&d, &token, &id, "8080/hello.txt").await;
        if status == 200 {
            assert_eq!(body.trim(), "served-from-sandbox");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "server never answered: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Query strings pass through; torpor's token does not.
    let (status, _) = proxied(&d, &token, &id, "8080/hello.txt?x=1").await;
    assert_eq!(status, 200);
    // Host-based routing: {port}-{id}.<domain>, the path as is.
    let (status, body) = raw_get(
        &d,
        &format!("8080-{id}.sandboxes.test:{}", d.port),
        "/hello.txt",
    )
    .await;
    assert_eq!((status, body.trim()), (200, "served-from-sandbox"));
    assert_eq!(
        raw_get(&d, &format!("0-{id}.sandboxes.test"), "/").await.0,
        400
    );
    assert_eq!(raw_get(&d, "8080.sandboxes.test", "/").await.0, 400);
    assert_eq!(
        raw_get(&d, &format!("8080-{id}.sandboxes.test"), "/../x")
            .await
            .0,
        400
    );
    // Other hosts still reach the API.
    assert_eq!(
        raw_get(&d, "elsewhere.test", &format!("/v1/sandboxes/{id}"))
            .await
            .0,
        200
    );

    for tier in [Tier::Parked, Tier::Suspended] {
        let before = c.sandbox(&id).await.unwrap().worker.expect("resident");
        // A prepared worker waits in the pool (on a loaded machine its refill can lag), so
        // the wake below takes it rather than the one this sandbox leaves, once reset.
        let deadline = Instant::now() + Duration::from_secs(60);
        while c.workers().await.unwrap().warm_ready == 0 {
            assert!(Instant::now() < deadline, "no prepared worker");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let s = c.suspend(&id, Some(tier)).await.unwrap();
        assert_eq!(s.state, tier.as_str());
        assert_eq!(c.sandbox(&id).await.unwrap().worker, None, "asleep");
        let (status, body) = proxied(&d, &token, &id, "8080/hello.txt").await;
        assert_eq!(
            (status, body.trim()),
            (200, "served-from-sandbox"),
            "after {tier:?}"
        );
        // The warm pool hands out a ready worker, not the one just left (it is reset and
        // torn down when the pool is full): the checkpoint moved between workers.
        let after = c.sandbox(&id).await.unwrap().worker.expect("resident");
        assert_ne!(before, after, "woken on another worker");
        assert_eq!(c.sandbox(&id).await.unwrap().state, "running");
    }

    // A server that closes first (HTTP/1.0): torpor answers its close with a RST, so no
    // TIME_WAIT is left in the sandbox and a checkpoint right after succeeds, state intact.
    c.exec(
        &id,
        &ExecBody {
            detach: true,
            ..sh("cd /tmp && exec python3 -m http.server 8081")
        },
    )
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while proxied(&d, &token, &id, "8081/hello.txt").await.0 != 200 {
        assert!(Instant::now() < deadline, "HTTP/1.0 server never answered");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let s = c.suspend(&id, Some(Tier::Parked)).await.unwrap();
    assert_eq!(s.state, "parked");
    assert!(s.last_error.is_none(), "{:?}", s.last_error);
    let (status, body) = proxied(&d, &token, &id, "8081/hello.txt").await;
    assert_eq!((status, body.trim()), (200, "served-from-sandbox"));
    // Bad input.
    for (rest, code) in [("0/x", 400), ("65536/x", 400), ("http/x", 400)] {
        assert_eq!(proxied(&d, &token, &id, rest).await.0, code, "{rest}");
    }
    for path in ["..", "a/../../x", "%2e%2e/x", "a%2fb"] {
        let status = raw_status(&d, &format!("/v1/sandboxes/{id}/ports/8080/{path}")).await;
        assert_eq!(status, 400, "{path}");
    }
    // Another tenant's sandbox does not exist for it.
    let other = c
        .create_tenant(&CreateTenantBody {
            name: "other".into(),
            quotas: None,
        })
        .await
        .unwrap();
    assert_eq!(
        proxied(&d, &other.token, &id, "8080/hello.txt").await.0,
        404
    );
    // A sandbox without network has no ports to reach.
    let plain = create(&c, "host").await;
    assert_eq!(proxied(&d, &token, &plain, "8080/").await.0, 400);
    let m = metrics(&d).await;
    assert!(
        metric(&m, "torpor_proxy_requests_total{outcome=\"woke\"}") >= 2,
        "{m}"
    );
    assert!(
        metric(&m, "torpor_proxy_requests_total{outcome=\"served\"}") >= 2,
        "{m}"
    );
    assert!(
        metric(&m, "torpor_proxy_requests_total{outcome=\"rejected\"}") >= 2,
        "{m}"
    );
    assert!(
        metric(
            &m,
            &format!(
                "torpor_sandbox_network_connections{{direction=\"ingress\",sandbox=\"{id}\"}}"
            )
        ) >= 1,
        "{m}"
    );
    c.delete_sandbox(&id).await.unwrap();
    c.delete_sandbox(&plain).await.unwrap();
}

/// Asks the sandbox's resolver (from its /etc/resolv.conf) for `name` directly, bypassing
/// /etc/hosts: "<rcode> <answers> <first address>".
const DNS_QUERY: &str = r#"
import socket, struct, sys
name = sys.argv[1]
q = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
q += b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0" + struct.pack(">HH", 1, 1)
ns = [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")][0]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(3)
s.sendto(q, (ns, 53))
r = s.recv(512)
an = struct.unpack(">H", r[6:8])[0]
print(r[3] & 15, an, ".".join(map(str, r[-4:])) if an else "-")
"#;

async fn dns(c: &torpor_api::Client, id: &str, name: &str) -> String {
    let r = c
        .exec(
            id,
            &ExecBody {
                cmd: vec!["python3".into(), "-c".into(), DNS_QUERY.into(), name.into()],
                timeout_ms: Some(30_000),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    r.stdout.trim().to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn only_names_on_the_list_resolve() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = create_net(&c, json!({"hosts": ["localhost"]})).await;
    // The host's resolver answers for an allowed name (here: its /etc/hosts entry).
    assert_eq!(dns(&c, &id, "localhost").await, "0 1 127.0.0.1");
    assert_eq!(dns(&c, &id, "LOCALHOST").await, "0 1 127.0.0.1");
    // A name not on the list is NXDOMAIN, without asking anyone.
    assert_eq!(dns(&c, &id, "example.com").await, "3 0 -");
    // getaddrinfo in the sandbox fails for it too (no hang, no leak).
    assert_eq!(fetch(&c, &id, "http://example.com/").await, None);
    // Live change: the list now names something else.
    let r = patch_network(&d, &id, json!({"hosts": ["example.com"]})).await;
    assert_eq!(r.status(), 200);
    assert_eq!(dns(&c, &id, "localhost").await, "3 0 -");
    // The resolver setting survives a sleep on another worker.
    c.suspend(&id, Some(Tier::Suspended)).await.unwrap();
    assert_eq!(dns(&c, &id, "localhost").await, "3 0 -");
    patch_network(&d, &id, json!({"hosts": ["localhost"]})).await;
    assert_eq!(dns(&c, &id, "localhost").await, "0 1 127.0.0.1");
    // A wildcard names what is below it, not itself.
    patch_network(&d, &id, json!({"hosts": ["*.localhost"]})).await;
    assert_eq!(dns(&c, &id, "localhost").await, "3 0 -");
    // A policy that lets unnamed destinations through resolves every name.
    for open in [
        json!("full"),
        json!({"default": "allow", "deny": [{"cidr": "10.0.0.0/8"}]}),
    ] {
        let r = patch_network(&d, &id, open.clone()).await;
        assert_eq!(r.status(), 200, "{open}");
        assert_eq!(dns(&c, &id, "localhost").await, "0 1 127.0.0.1", "{open}");
    }
    c.delete_sandbox(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn many_proxied_requests_to_sleeping_forks_all_succeed() {
    // 4 workers (the harness default), 20 sleeping sandboxes, 100 requests at once.
    let d = Daemon::start_with(&["--worker-wait-ms", "120000"]).await;
    let c = d.client();
    let id = create_net(&c, json!({"allow": []})).await;
    c.exec(
        &id,
        &ExecBody {
            detach: true,
            ..sh("echo $RANDOM > /tmp/v && cd /tmp && exec python3 -m http.server -p HTTP/1.1 8080")
        },
    )
    .await
    .unwrap();
    let token = d.token();
    let deadline = Instant::now() + Duration::from_secs(30);
    let expected = loop {
        let (status, body) = proxied(&d, &token, &id, "8080/v").await;
        if status == 200 {
            break body;
        }
        assert!(Instant::now() < deadline, "server never answered");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut ids: Vec<String> = c
        .fork(&id, 19)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    c.suspend(&id, Some(Tier::Parked)).await.unwrap();
    ids.push(id);
    for f in &ids {
        assert_ne!(c.sandbox(f).await.unwrap().state, "running", "{f} sleeps");
    }
    let t = Instant::now();
    let mut calls = Vec::new();
    for i in 0..100 {
        let d_url = d.url();
        let token = token.clone();
        let id = ids[i % ids.len()].clone();
        calls.push(tokio::spawn(async move {
            let r = reqwest::Client::new()
                .get(format!("{d_url}/v1/sandboxes/{id}/ports/8080/v"))
                .bearer_auth(token)
                .timeout(Duration::from_secs(300))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }));
    }
    for call in calls {
        let (status, body) = call.await.unwrap();
        assert_eq!((status, body.as_str()), (200, expected.as_str()));
    }
    eprintln!(
        "100 proxied requests to 20 sleeping forks on 4 workers: {:?}",
        t.elapsed()
    );
    let m = metrics(&d).await;
    assert!(
        metric(&m, "torpor_proxy_requests_total{outcome=\"woke\"}") >= 20,
        "{m}"
    );
}

/// A WebSocket echo server (handshake and unfragmented frames < 126 bytes), stdlib only.
const WS_ECHO: &str = r#"
import socket, hashlib, base64, threading
def recv_exact(c, n):
    b = b""
    while len(b) < n:
        x = c.recv(n - len(b))
        if not x: raise EOFError
        b += x
    return b
def handle(c):
    try:
        data = b""
        while b"\r\n\r\n" not in data: data += c.recv(4096)
        key = [l.split(b":", 1)[1].strip() for l in data.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key")][0]
        acc = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
        c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: " + acc + b"\r\n\r\n")
        while True:
            h = recv_exact(c, 2)
            n = h[1] & 127
            mask = recv_exact(c, 4)
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(recv_exact(c, n)))
            if h[0] & 15 == 8: break
            c.sendall(bytes([0x81, len(payload)]) + payload)
    except EOFError:
        pass
    c.close()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8765))
s.listen()
while True:
    c, _ = s.accept()
    threading.Thread(target=handle, args=(c,), daemon=True).start()
"#;

#[tokio::test(flavor = "multi_thread")]
async fn a_websocket_echo_survives_the_proxy() {
    let d = Daemon::start_with(&["--drain-timeout-ms", "1000"]).await;
    let c = d.client();
    let id = create_net(&c, json!({"allow": []})).await;
    c.write_file(&id, "/tmp/ws.py", WS_ECHO.as_bytes().to_vec(), None)
        .await
        .unwrap();
    c.exec(
        &id,
        &ExecBody {
            detach: true,
            ..sh("exec python3 /tmp/ws.py")
        },
    )
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut s = loop {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", d.port))
            .await
            .unwrap();
        let req = format!(
            "GET /v1/sandboxes/{id}/ports/8765/ws HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\
             Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n\
             Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
            d.token()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if s.read(&mut byte).await.unwrap() == 0 {
                break;
            }
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head).to_string();
        if head.starts_with("HTTP/1.1 101") {
            assert!(head.contains("s3pPLMBiTxaQ9kYGzzhZRbK+xOo="), "{head}");
            break s;
        }
        assert!(Instant::now() < deadline, "no upgrade: {head}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    for msg in ["hello-ws", "second message"] {
        let mask = [1u8, 2, 3, 4];
        let mut frame = vec![0x81, 0x80 | msg.len() as u8];
        frame.extend_from_slice(&mask);
        frame.extend(msg.bytes().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        s.write_all(&frame).await.unwrap();
        let mut h = [0u8; 2];
        s.read_exact(&mut h).await.unwrap();
        assert_eq!(h[0], 0x81);
        let mut payload = vec![0u8; (h[1] & 127) as usize];
        s.read_exact(&mut payload).await.unwrap();
        assert_eq!(String::from_utf8(payload).unwrap(), msg);
    }
    // An open WebSocket keeps the sandbox borrowed: a suspend waits for it (the drain
    // timeout), then answers 409 sandbox_busy; nothing is cut and the sandbox keeps running.
    match c.suspend(&id, Some(Tier::Parked)).await.unwrap_err() {
        ClientError::Api { status, code, .. } => {
            assert_eq!((status, code.as_str()), (409, "sandbox_busy"))
        }
        other => panic!("{other}"),
    }
    assert_eq!(c.sandbox(&id).await.unwrap().state, "running");
    drop(s);
    // Closed: the suspend goes through.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match c.suspend(&id, Some(Tier::Parked)).await {
            Ok(s) => {
                assert_eq!(s.state, "parked");
                break;
            }
            Err(e) => assert!(Instant::now() < deadline, "{e}"),
        }
    }
    c.delete_sandbox(&id).await.unwrap();
}

/// A host server that answers one HTTP request with `hello` (with its length) and then holds
/// the connection until the client closes it: the client closes first.
async fn keepalive_server() -> u16 {
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
                    .await;
                while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
            });
        }
    });
    port
}

/// Holds one connection to the host open across a checkpoint, then reports what the socket
/// says after the wake (`ConnectionResetError` expected: open connections are reset).
const HOLD_CONNECTION: &str = r#"
import os, socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
s.recv(4096)
def say(what):
    # Whole or not at all: a reader never sees the file truncated and not yet written.
    open("/tmp/held.new", "w").write(what)
    os.rename("/tmp/held.new", "/tmp/held")
say("open")
while not os.path.exists("/tmp/go"):
    time.sleep(0.05)
try:
    out = "eof" if s.recv(10) == b"" else "data"
except Exception as e:
    out = type(e).__name__
say(out)
"#;

/// A client inside the sandbox closes first on loopback.
const LOOPBACK_CLOSE: &str = "python3 -c \"import socket; l=socket.socket(); l.bind(('127.0.0.1',9000)); l.listen(); c=socket.create_connection(('127.0.0.1',9000)); a,_=l.accept(); c.close(); a.recv(1); a.close(); l.close()\"";

async fn read_file(c: &torpor_api::Client, id: &str, path: &str) -> String {
    let r = c
        .exec(id, &sh(&format!("cat {path} 2>/dev/null")))
        .await
        .unwrap();
    r.stdout.trim().to_string()
}

/// Outbound connections the sandbox closed first (TIME_WAIT in its stack without torpor) or
/// still holds open used to make a checkpoint fail and the sandbox fall back to its previous
/// snapshot. Through the egress relay, neither is left: the checkpoint right after succeeds,
/// the state since is kept, and the open connection is reset.
#[tokio::test(flavor = "multi_thread")]
async fn outbound_connections_never_block_a_checkpoint() {
    let host = host_addr();
    let d = Daemon::start_with(&["--sandbox-reach-host", &host]).await;
    let c = d.client();
    let port = keepalive_server().await;
    let id = create_net(&c, json!("full")).await;

    // The sandbox closes first (urllib closes once it has read the body); and a connection
    // inside the sandbox (loopback), closed by its client first, leaves its TIME_WAIT there.
    c.exec(&id, &sh("echo kept > /tmp/marker")).await.unwrap();
    let r = c.exec(&id, &sh(LOOPBACK_CLOSE)).await.unwrap();
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    assert_eq!(
        fetch(&c, &id, &format!("http://{host}:{port}/"))
            .await
            .as_deref(),
        Some("hello")
    );
    let s = c.suspend(&id, Some(Tier::Parked)).await.unwrap();
    assert_eq!(s.state, "parked", "{:?}", s.last_error);
    assert!(s.last_error.is_none(), "{:?}", s.last_error);
    assert_eq!(read_file(&c, &id, "/tmp/marker").await, "kept");

    // A connection held open across the checkpoint.
    c.exec(
        &id,
        &ExecBody {
            cmd: vec![
                "python3".into(),
                "-c".into(),
                HOLD_CONNECTION.into(),
                host.clone(),
                port.to_string(),
            ],
            detach: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while read_file(&c, &id, "/tmp/held").await != "open" {
        assert!(Instant::now() < deadline, "the connection never opened");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.exec(&id, &sh("echo second > /tmp/marker")).await.unwrap();
    let s = c.suspend(&id, Some(Tier::Suspended)).await.unwrap();
    assert_eq!(s.state, "suspended", "{:?}", s.last_error);
    assert!(s.last_error.is_none(), "{:?}", s.last_error);
    assert_eq!(read_file(&c, &id, "/tmp/marker").await, "second");
    c.exec(&id, &sh("touch /tmp/go")).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let out = loop {
        let out = read_file(&c, &id, "/tmp/held").await;
        if out != "open" {
            break out;
        }
        assert!(Instant::now() < deadline, "the holder never woke");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(out, "ConnectionResetError");
    // And the network works after the wake.
    assert_eq!(
        fetch(&c, &id, &format!("http://{host}:{port}/"))
            .await
            .as_deref(),
        Some("hello")
    );
    c.delete_sandbox(&id).await.unwrap();
}

/// Sends UDP datagrams of 1 KiB to host:port as fast as it can for 2 s; prints how many bytes.
const UDP_FLOOD: &str = r#"
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setblocking(False)
data = b"x" * 1024
sent = 0
end = time.time() + 2
while time.time() < end:
    try:
        s.sendto(data, (sys.argv[1], int(sys.argv[2])))
        sent += len(data)
    except OSError:
        pass
print(sent)
"#;

/// A sandbox flooding egress is held to its limit at its own router, and a neighbour's traffic
/// still flows.
#[tokio::test(flavor = "multi_thread")]
async fn a_flooding_sandbox_is_held_to_its_egress_limit() {
    // 2 Mbit/s = 250 KB/s: far below what the flood sends.
    let host = host_addr();
    let d = Daemon::start_with(&["--egress-mbit", "2", "--sandbox-reach-host", &host]).await;
    let c = d.client();
    let udp = tokio::net::UdpSocket::bind("0.0.0.0:0").await.unwrap();
    let udp_port = udp.local_addr().unwrap().port();
    let received = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = received.clone();
    tokio::spawn(async move {
        let mut buf = [0u8; 2048];
        while let Ok(n) = udp.recv(&mut buf).await {
            counter.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        }
    });
    let http_port = host_server("neighbour-ok").await;
    let flooder = create_net(&c, json!("full")).await;
    let neighbour = create_net(&c, json!("full")).await;

    let flood = {
        let c = c.clone();
        let (flooder, host) = (flooder.clone(), host.clone());
        tokio::spawn(async move {
            c.exec(
                &flooder,
                &ExecBody {
                    cmd: vec![
                        "python3".into(),
                        "-c".into(),
                        UDP_FLOOD.into(),
                        host,
                        udp_port.to_string(),
                    ],
                    timeout_ms: Some(60_000),
                    ..Default::default()
                },
            )
            .await
            .expect("the flood runs")
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        fetch(&c, &neighbour, &format!("http://{host}:{http_port}/"))
            .await
            .as_deref(),
        Some("neighbour-ok"),
        "the neighbour's egress flows during the flood"
    );
    let r = flood.await.unwrap();
    let sent: u64 = r.stdout.trim().parse().expect("the flood prints its count");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got = received.load(std::sync::atomic::Ordering::Relaxed);
    let m = metrics(&d).await;
    let limited = metric(
        &m,
        &format!("torpor_sandbox_egress_limited_packets{{sandbox=\"{flooder}\"}}"),
    );
    assert!(
        limited > 0,
        "the limit dropped packets: sent {sent}, got {got}\n{m}"
    );
    // 2 s at 250 KB/s plus a burst, with room for the flood's own ramp: far below what was sent.
    assert!(got < sent, "sent {sent}, got {got}");
    assert!(
        got <= 1_000_000,
        "sent {sent}, got {got} (limit 250 KB/s for ~2 s)"
    );
    for id in [&flooder, &neighbour] {
        c.delete_sandbox(id).await.unwrap();
    }
}
