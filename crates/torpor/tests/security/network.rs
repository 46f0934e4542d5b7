//! The network boundary: what a sandbox can reach and what reaches a sandbox. Real daemon, real
//! runsc network stacks, real traffic.
//!
//! Non-host destinations come from a fake "internet": a network namespace joined to the root
//! namespace by a veth pair, with TEST-NET-2 addresses (198.51.100.0/24). Reaching it from a
//! sandbox needs the root namespace to forward between the sandbox's uplink and that veth,
//! which the test switches on for those two interfaces only (`net.ipv4.conf.<if>.forwarding`),
//! not host-wide.

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use torpor_api::types::{CreateSandboxBody, CreateTenantBody, ExecBody};
use torpor_api::ClientError;
use torpor_core::NetworkPolicy;

use crate::common::*;

fn run(args: &[&str]) -> String {
    let out = std::process::Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The fake internet: a namespace `ns` whose address `peer` the root namespace routes to over
/// `host_if`. Removed on drop.
struct Internet {
    ns: String,
    host_if: String,
    peer: Ipv4Addr,
}

impl Internet {
    fn new(n: u8) -> Internet {
        let id = std::process::id() % 100_000;
        let ns = format!("tpsec-inet-{id}-{n}");
        let host_if = format!("tpi{id}x{n}");
        let base = 4 * n;
        let (host_a, peer) = (
            Ipv4Addr::new(198, 51, 100, base + 1),
            Ipv4Addr::new(198, 51, 100, base + 2),
        );
        let _ = std::process::Command::new("ip")
            .args(["netns", "delete", &ns])
            .output();
        run(&["ip", "netns", "add", &ns]);
        run(&[
            "ip", "link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{host_a}/30"),
            "dev",
            &host_if,
        ]);
        run(&["ip", "link", "set", &host_if, "up"]);
        run(&[
            "ip",
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{peer}/30"),
            "dev",
            "eth0",
        ]);
        run(&["ip", "-n", &ns, "link", "set", "eth0", "up"]);
        run(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
        run(&[
            "ip",
            "-n",
            &ns,
            "route",
            "add",
            "default",
            "via",
            &host_a.to_string(),
        ]);
        forward(&host_if);
        Internet { ns, host_if, peer }
    }

    /// Runs `f` on a thread inside the namespace (sockets made there stay in it).
    fn inside<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        std::thread::scope(|s| {
            s.spawn(|| {
                let file = std::fs::File::open(format!("/run/netns/{}", self.ns)).unwrap();
                // SAFETY: setns on this short-lived thread only.
                assert_eq!(
                    unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) },
                    0
                );
                f()
            })
            .join()
            .unwrap()
        })
    }

    /// An HTTP server in the namespace answering `body`, closing first; returns its port.
    fn http_server(&self, body: &'static str) -> u16 {
        let l = self.inside(|| std::net::TcpListener::bind("0.0.0.0:0").unwrap());
        l.set_nonblocking(true).unwrap();
        let port = l.local_addr().unwrap().port();
        let l = tokio::net::TcpListener::from_std(l).unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = s.read(&mut buf).await;
                    let resp = format!("HTTP/1.0 200 OK\r\n\r\n{body}");
                    let _ = s.write_all(resp.as_bytes()).await;
                    let _ = s.shutdown().await;
                });
            }
        });
        port
    }

    /// A server in the namespace that accepts and holds connections; returns its port and the
    /// number of connections open now.
    fn holding_server(&self) -> (u16, Arc<AtomicUsize>) {
        let l = self.inside(|| std::net::TcpListener::bind("0.0.0.0:0").unwrap());
        l.set_nonblocking(true).unwrap();
        let port = l.local_addr().unwrap().port();
        let l = tokio::net::TcpListener::from_std(l).unwrap();
        let open = Arc::new(AtomicUsize::new(0));
        let count = open.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let count = count.clone();
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
                    count.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        (port, open)
    }

    /// A UDP socket in the namespace counting the bytes it receives.
    fn udp_sink(&self) -> (u16, Arc<AtomicU64>) {
        udp_sink_on(self.inside(|| std::net::UdpSocket::bind("0.0.0.0:0").unwrap()))
    }
}

impl Drop for Internet {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "delete", &self.ns])
            .output();
        let _ = std::process::Command::new("ip")
            .args(["link", "delete", &self.host_if])
            .output();
    }
}

fn udp_sink_on(sock: std::net::UdpSocket) -> (u16, Arc<AtomicU64>) {
    sock.set_nonblocking(true).unwrap();
    let port = sock.local_addr().unwrap().port();
    let sock = tokio::net::UdpSocket::from_std(sock).unwrap();
    let got = Arc::new(AtomicU64::new(0));
    let counter = got.clone();
    tokio::spawn(async move {
        let mut buf = [0u8; 2048];
        while let Ok(n) = sock.recv(&mut buf).await {
            counter.fetch_add(n as u64, Ordering::SeqCst);
        }
    });
    (port, got)
}

/// Lets the root namespace forward packets that enter through `dev` (this interface only).
fn forward(dev: &str) {
    run(&[
        "sysctl",
        "-qw",
        &format!("net.ipv4.conf.{dev}.forwarding=1"),
    ]);
}

/// The root namespace's end of the uplink of the worker `id` is resident on (its address is
/// the router's, given by GET /network, minus one), switched to forward.
async fn forward_for(d: &Daemon, id: &str) {
    let net = network_of(d, &d.token(), id).await;
    let router: Ipv4Addr = net["address"].as_str().expect("resident").parse().unwrap();
    let host_end = Ipv4Addr::from(u32::from(router) - 1);
    let out = run(&[
        "ip",
        "-o",
        "-4",
        "addr",
        "show",
        "to",
        &format!("{host_end}/32"),
    ]);
    let dev = out
        .split_whitespace()
        .nth(1)
        .expect("the uplink's host end")
        .trim_end_matches(':')
        .to_string();
    forward(&dev);
}

async fn network_of(d: &Daemon, token: &str, id: &str) -> serde_json::Value {
    reqwest::Client::new()
        .get(format!("{}/v1/sandboxes/{id}/network", d.url()))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The operator's template with `policy`, for sandboxes to be made from.
async fn net_template(c: &torpor_api::Client, name: &str, policy: serde_json::Value) {
    let mut tpl = agent_template(name, no_idle());
    tpl.command = Vec::new();
    tpl.warmup_ms = 0;
    tpl.network = Some(serde_json::from_value(policy).unwrap());
    c.create_template(&tpl).await.unwrap();
}

async fn create_in(
    c: &torpor_api::Client,
    template: &str,
    policy: Option<serde_json::Value>,
) -> Result<String, ClientError> {
    c.create_sandbox(&CreateSandboxBody {
        template: template.into(),
        network: policy.map(|p| serde_json::from_value::<NetworkPolicy>(p).unwrap()),
        ..Default::default()
    })
    .await
    .map(|s| s.id)
}

/// Runs a Python snippet in the sandbox; its stdout.
async fn py(c: &torpor_api::Client, id: &str, code: &str) -> String {
    let r = c
        .exec(
            id,
            &ExecBody {
                cmd: vec!["python3".into(), "-c".into(), code.into()],
                timeout_ms: Some(120_000),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    r.stdout.trim().to_string()
}

/// What a TCP connection from the sandbox to `addr:port` gets: `ok <first bytes>` when it
/// connects and is answered, else `fail`. (Through the relay a refused destination shows as a
/// reset on the first read; a dropped one as a timeout.)
async fn tcp_from(c: &torpor_api::Client, id: &str, addr: &str, port: u16) -> String {
    py(
        c,
        id,
        &format!(
            "import socket\n\
             s=socket.socket(); s.settimeout(3)\n\
             try:\n  s.connect(('{addr}',{port})); s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n'); d=s.recv(64)\n  print('ok', d.decode(errors='replace').split()[-1] if d else 'fail-empty')\n\
             except Exception as e:\n  print('fail', type(e).__name__)\n"
        ),
    )
    .await
}

fn api_error(e: ClientError) -> (u16, String, String) {
    match e {
        ClientError::Api {
            status,
            code,
            message,
            ..
        } => (status, code, message),
        other => panic!("{other}"),
    }
}

/// The host (any local process) connects to the sandbox's router address and port, which
/// used to be DNATed onto the sandbox, skipping the proxy's token check. Refused; the sandbox's
/// server sees only the proxy's connections; the proxy still works.
#[tokio::test(flavor = "multi_thread")]
async fn the_host_cannot_reach_a_sandboxs_ports_around_the_proxy() {
    let d = Daemon::start().await;
    let c = d.client();
    // Ingress only: what the `host` template (no network of its own) allows.
    let id = create_in(&c, "host", Some(json!({"allow": []})))
        .await
        .unwrap();
    let server = "import socket\n\
                  l=socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
                  l.bind(('0.0.0.0', 8000)); l.listen(16)\n\
                  while True:\n  c,a=l.accept(); open('/tmp/hits','a').write(a[0]+'\\n'); c.recv(4096)\n  c.sendall(b'HTTP/1.0 200 OK\\r\\n\\r\\nsandbox-ok'); c.close()\n";
    c.exec(
        &id,
        &ExecBody {
            cmd: vec!["python3".into(), "-c".into(), server.into()],
            detach: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let proxied = || async {
        reqwest::Client::new()
            .get(format!("{}/v1/sandboxes/{id}/ports/8000/", d.url()))
            .bearer_auth(d.token())
            .send()
            .await
            .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut served = 0;
    loop {
        let r = proxied().await;
        served += 1;
        if r.status() == 200 {
            assert_eq!(r.text().await.unwrap(), "sandbox-ok");
            break;
        }
        assert!(Instant::now() < deadline, "the server never answered");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Without a token the proxy refuses.
    let r = reqwest::get(format!("{}/v1/sandboxes/{id}/ports/8000/", d.url()))
        .await
        .unwrap();
    assert_eq!(r.status(), 401);

    let net = network_of(&d, &d.token(), &id).await;
    let router = net["address"].as_str().expect("resident").to_string();
    // Straight at the router's address: refused (a reset), not forwarded to the sandbox.
    let err = tokio::net::TcpStream::connect((router.as_str(), 8000))
        .await
        .expect_err("the host reached the sandbox's port around the proxy");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
    // Nor any other port of the router (the relay's included).
    for port in [22, 8000, 15001] {
        assert!(tokio::net::TcpStream::connect((router.as_str(), port))
            .await
            .is_err());
    }

    // The proxy still works, and every connection the server saw came from the proxy's path
    // (the router namespace's sandbox-side address), one per proxied request that got there.
    let r = proxied().await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "sandbox-ok");
    let hits = String::from_utf8(c.read_file(&id, "/tmp/hits").await.unwrap()).unwrap();
    let hits: Vec<&str> = hits.lines().collect();
    assert!(!hits.is_empty() && hits.len() <= served + 1, "{hits:?}");
    assert!(hits.iter().all(|a| *a == "169.254.0.1"), "{hits:?}");
    c.delete_sandbox(&id).await.unwrap();
}

/// A sandbox whose policy is `full` tries the host: a server on the host's primary address,
/// the daemon's own listener (on every address), UDP to the host, and the operator-listed
/// exception. Only the listed host port and the non-host peer are reached.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_sandbox_cannot_reach_the_host_or_the_daemon() {
    let host = host_addr();
    // Servers on every host address (the primary one and loopback included).
    let open_host = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let listed_host = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let (open_port, listed_port) = (
        open_host.local_addr().unwrap().port(),
        listed_host.local_addr().unwrap().port(),
    );
    let host_hits = Arc::new(AtomicUsize::new(0));
    for (l, body) in [(open_host, "host-open"), (listed_host, "host-listed")] {
        let hits = host_hits.clone();
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
    let (udp_port, udp_host) = udp_sink_on(std::net::UdpSocket::bind("0.0.0.0:0").unwrap());
    // The daemon's own listener on every address: metrics, served without a token there.
    let metrics = torpor_runtime::ports::loopback_port().expect("a free loopback port");
    let d = Daemon::start_with(&[
        "--metrics-listen",
        &format!("0.0.0.0:{metrics}"),
        "--sandbox-reach-host",
        &format!("{host}:{listed_port}"),
    ])
    .await;
    // From the host itself, the listener answers on the host's address (so a refusal below
    // is the boundary, not an absent server).
    let r = reqwest::get(format!("http://{host}:{metrics}/metrics"))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    let inet = Internet::new(1);
    let peer = inet.peer.to_string();
    let peer_port = inet.http_server("internet-ok");
    let (peer_udp, udp_peer) = inet.udp_sink();

    let c = d.client();
    net_template(&c, "wide", json!("full")).await;
    let id = create_in(&c, "wide", None).await.unwrap();
    forward_for(&d, &id).await;

    // The non-host peer: reached.
    assert_eq!(tcp_from(&c, &id, &peer, peer_port).await, "ok internet-ok");
    // The listed host port: reached; the rest of the host: not.
    assert_eq!(
        tcp_from(&c, &id, &host, listed_port).await,
        "ok host-listed"
    );
    for (addr, port) in [
        (host.as_str(), open_port),
        (host.as_str(), metrics),
        (host.as_str(), d.port),
        ("127.0.0.1", open_port),
        ("127.0.0.1", metrics),
        ("169.254.169.254", 80),
        ("169.254.0.1", 15001),
    ] {
        let got = tcp_from(&c, &id, addr, port).await;
        assert!(got.starts_with("fail"), "{addr}:{port}: {got}");
    }
    // The uplink's host end is a host address too.
    let router: Ipv4Addr = network_of(&d, &d.token(), &id).await["address"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let host_end = Ipv4Addr::from(u32::from(router) - 1).to_string();
    for port in [open_port, metrics] {
        let got = tcp_from(&c, &id, &host_end, port).await;
        assert!(got.starts_with("fail"), "{host_end}:{port}: {got}");
    }
    assert_eq!(
        host_hits.load(Ordering::SeqCst),
        0,
        "a connection reached the host"
    );

    // UDP through the router's NAT: the peer gets it, the host does not.
    py(
        &c,
        &id,
        &format!(
            "import socket\ns=socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
             for i in range(20):\n  s.sendto(b'x'*100, ('{peer}', {peer_udp})); s.sendto(b'x'*100, ('{host}', {udp_port})); s.sendto(b'x'*100, ('{host_end}', {udp_port}))\n"
        ),
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while udp_peer.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "UDP never reached the peer");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(udp_host.load(Ordering::SeqCst), 0, "UDP reached the host");

    // Still refused after a sleep and a wake (the rules are made again on the worker it wakes on).
    c.suspend(&id, Some(torpor_core::Tier::Parked))
        .await
        .unwrap();
    c.resume(&id).await.unwrap();
    let got = tcp_from(&c, &id, &host, open_port).await;
    assert!(got.starts_with("fail"), "after a wake: {got}");
    assert_eq!(host_hits.load(Ordering::SeqCst), 0);
    c.delete_sandbox(&id).await.unwrap();
}

/// A tenant asks for a wider policy than the template's (the operator's ceiling), at create
/// and by PATCH: `400 invalid_request` naming the template; the stored policy is unchanged;
/// narrower policies are accepted.
#[tokio::test(flavor = "multi_thread")]
async fn a_sandboxs_policy_cannot_widen_its_templates() {
    let d = Daemon::start().await;
    let admin = d.client();
    net_template(
        &admin,
        "web-only",
        json!({"allow": [{"cidr": "198.51.100.0/24", "ports": [80, 443]}], "hosts": ["*.example.com"]}),
    )
    .await;
    let created = admin
        .create_tenant(&CreateTenantBody {
            name: "net-a".into(),
            quotas: None,
        })
        .await
        .unwrap();
    let c = torpor_api::Client::new(&d.url(), &created.token);

    for wider in [
        json!("full"),
        json!({"allow": [{"cidr": "198.51.100.0/24"}]}),
        json!({"allow": [{"cidr": "198.51.0.0/16", "ports": [80]}]}),
        json!({"hosts": ["example.com"]}),
        json!({"hosts": ["evil.org"]}),
        json!({"default": "allow", "deny": [{"cidr": "10.0.0.0/8"}]}),
    ] {
        let (status, code, message) = api_error(
            create_in(&c, "web-only", Some(wider.clone()))
                .await
                .unwrap_err(),
        );
        assert_eq!((status, code.as_str()), (400, "invalid_request"), "{wider}");
        assert!(message.contains("web-only"), "{message}");
    }
    // The `host` template has no network: ingress only is its ceiling.
    let (status, code, message) = api_error(
        create_in(&c, "host", Some(json!("full")))
            .await
            .unwrap_err(),
    );
    assert_eq!((status, code.as_str()), (400, "invalid_request"));
    assert!(message.contains("\"host\""), "{message}");
    assert!(
        c.sandboxes(None).await.unwrap().is_empty(),
        "nothing was created"
    );

    // Narrower: accepted.
    let narrow =
        json!({"allow": [{"cidr": "198.51.100.7", "ports": [443]}], "hosts": ["api.example.com"]});
    let id = create_in(&c, "web-only", Some(narrow.clone()))
        .await
        .unwrap();
    let ingress = create_in(&c, "host", Some(json!({"allow": []})))
        .await
        .unwrap();

    // PATCH wider: refused, nothing changed.
    for (sandbox, wider, template) in [
        (&id, json!("full"), "web-only"),
        (
            &id,
            json!({"allow": [{"cidr": "0.0.0.0/0", "ports": [443]}]}),
            "web-only",
        ),
        (
            &ingress,
            json!({"allow": [{"cidr": "198.51.100.7"}]}),
            "host",
        ),
    ] {
        let r = reqwest::Client::new()
            .patch(format!("{}/v1/sandboxes/{sandbox}", d.url()))
            .bearer_auth(&created.token)
            .json(&json!({ "network": wider }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "invalid_request", "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains(template),
            "{body}"
        );
    }
    assert_eq!(
        network_of(&d, &created.token, &id).await["network"],
        json!({"allow": [{"cidr": "198.51.100.7", "ports": [443]}], "hosts": ["api.example.com"]})
    );
    assert_eq!(
        network_of(&d, &created.token, &ingress).await["network"],
        json!({"allow": [], "hosts": []})
    );
    // PATCH narrower: accepted.
    let r = reqwest::Client::new()
        .patch(format!("{}/v1/sandboxes/{id}", d.url()))
        .bearer_auth(&created.token)
        .json(&json!({ "network": {"allow": []} }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    for s in [&id, &ingress] {
        c.delete_sandbox(s).await.unwrap();
    }
}

fn open_fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// A sandbox opens 2000 TCP connections at once to an allowed peer, each relayed by the daemon
/// (two descriptors each): past `--max-sandbox-connections` new ones are reset, the daemon's
/// descriptors stay bounded, and another sandbox's connection still works.
#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_opening_thousands_of_connections_cannot_exhaust_the_daemons_descriptors() {
    const CAP: usize = 64;
    let d = Daemon::start_with(&["--max-sandbox-connections", &CAP.to_string()]).await;
    let c = d.client();
    let inet = Internet::new(2);
    let peer = inet.peer.to_string();
    let (hold_port, held) = inet.holding_server();
    let http_port = inet.http_server("neighbour-ok");
    net_template(&c, "wide", json!("full")).await;
    let hog = create_in(&c, "wide", None).await.unwrap();
    let neighbour = create_in(&c, "wide", None).await.unwrap();
    forward_for(&d, &hog).await;
    forward_for(&d, &neighbour).await;
    assert_eq!(
        tcp_from(&c, &neighbour, &peer, http_port).await,
        "ok neighbour-ok"
    );
    let before = open_fds(d.pid());

    // Opens the connections and keeps them (the process stays); writes how many it opened.
    let hog_code = format!(
        "import resource, socket, time\n\
         soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n\
         want = 2000 if hard == resource.RLIM_INFINITY else min(2000, hard - 64)\n\
         resource.setrlimit(resource.RLIMIT_NOFILE, (want + 64, hard))\n\
         held = []\n\
         for i in range(want):\n\
         \x20 s = socket.socket(); s.settimeout(5)\n\
         \x20 try:\n\
         \x20   s.connect(('{peer}', {hold_port})); held.append(s)\n\
         \x20 except Exception:\n\
         \x20   s.close()\n\
         open('/tmp/opened', 'w').write(str(len(held)))\n\
         time.sleep(600)\n"
    );
    c.exec(
        &hog,
        &ExecBody {
            cmd: vec!["python3".into(), "-c".into(), hog_code],
            detach: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(240);
    let opened: usize = loop {
        if let Ok(b) = c.read_file(&hog, "/tmp/opened").await {
            break String::from_utf8(b).unwrap().trim().parse().unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "the hog never finished connecting"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(opened > 8 * CAP, "the sandbox opened only {opened}");

    // The peer holds at most CAP of them; the daemon holds at most two descriptors for each
    // (plus a little for its own work meanwhile).
    let at_peer = held.load(Ordering::SeqCst);
    assert!(at_peer <= CAP, "{at_peer} relayed connections open at once");
    assert!(at_peer > 0, "none relayed at all");
    let after = open_fds(d.pid());
    eprintln!("opened {opened}, relayed at once {at_peer}, daemon fds {before} -> {after}");
    assert!(
        after <= before + 2 * CAP + 32,
        "daemon descriptors: {before} before, {after} with {opened} connections"
    );
    // The neighbour still connects.
    assert_eq!(
        tcp_from(&c, &neighbour, &peer, http_port).await,
        "ok neighbour-ok"
    );
    // The API still answers.
    assert!(c.sandbox(&hog).await.is_ok());
    for s in [&hog, &neighbour] {
        c.delete_sandbox(s).await.unwrap();
    }
}
