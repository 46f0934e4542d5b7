//! Network benchmark: a request proxied by torpor to a sandbox's HTTP server vs the same
//! request made without the proxy, and the first proxied request to a Parked sandbox vs a
//! plain wake (`POST /resume`), interleaved in the same run.
//!
//!   cargo bench -p torpor --bench network            (as root, runsc and nft installed)
//!   TORPOR_NET_N=200 TORPOR_NET_WAKES=5 cargo bench -p torpor --bench network
//!
//! The host cannot connect to a sandbox's ports (only torpor's proxy reaches them, from inside
//! the worker's router namespace: docs/NETWORKING.md), so the baseline is made from where a
//! direct connection is still possible: a thread that has joined that router namespace
//! (the one holding the router `address` that `GET /v1/sandboxes/{id}/network` reports)
//! connects to the sandbox, 169.254.0.2:8080, and sends the same `GET /ping` over a plain
//! `std::net::TcpStream`. Before, the baseline connected from the host to the router's address
//! (through its DNAT); its JSON keys changed with it: `direct_new_connection` and
//! `direct_keep_alive` are now `router_ns_new_connection` and `router_ns_keep_alive`. The
//! proxied request and the new-connection baseline are interleaved; the keep-alive requests
//! run after them, on one connection (closed before the sandbox is parked). The sandbox is of a
//! copy of the `host` template with its idle policy off (`bench-net`): requests that bypass
//! torpor leave it idle in torpor's eyes, and the default policy would freeze it.
//!
//! Prints a table and one JSON line (`{"bench":"network",...}`).

mod support;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::json;
use support::{pct, Daemon};
use torpor_api::types::{CreateSandboxBody, ExecBody};
use torpor_core::Tier;
use torpor_runtime::net::SANDBOX_ADDR;

const PORT: u16 = 8080;
const TEMPLATE: &str = "bench-net";
const IO_TIMEOUT: Duration = Duration::from_secs(10);

fn env_usize(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

async fn timed_get(c: &reqwest::Client, url: &str, token: &str) -> f64 {
    let t = Instant::now();
    let r = c.get(url).bearer_auth(token).send().await.expect("request");
    assert_eq!(r.status(), 200, "{url}");
    let body = r.bytes().await.expect("body");
    assert_eq!(&body[..], b"pong\n");
    t.elapsed().as_secs_f64() * 1e3
}

/// The router namespace (under /run/netns) that holds `router`, the address the daemon
/// reports for the sandbox's worker.
fn router_namespace(router: Ipv4Addr) -> PathBuf {
    let needle = format!("inet {router}/");
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/run/netns").expect("/run/netns") {
        let name = entry.expect("netns entry").file_name();
        let name = name.to_string_lossy().into_owned();
        let out = std::process::Command::new("ip")
            .args(["-n", &name, "-4", "-o", "addr", "show"])
            .output()
            .expect("ip runs");
        if String::from_utf8_lossy(&out.stdout).contains(&needle) {
            found.push(name);
        }
    }
    assert_eq!(found.len(), 1, "namespaces holding {router}: {found:?}");
    Path::new("/run/netns").join(&found[0])
}

/// One request of the baseline, made on the router-namespace thread.
enum Baseline {
    /// A new connection for this request, closed after it (as the proxy does).
    NewConnection,
    /// The request on the one connection this thread keeps open.
    KeepAlive,
    /// Close the kept connection (before the sandbox is parked).
    CloseKept,
}

/// A thread that has joined a worker's router namespace; every socket it makes is made there.
/// Requests are timed on that thread, so the channel hop is not in the figures.
struct RouterClient {
    tx: mpsc::Sender<(Baseline, tokio::sync::oneshot::Sender<f64>)>,
}

impl RouterClient {
    fn start(ns: PathBuf) -> RouterClient {
        let (tx, rx) = mpsc::channel::<(Baseline, tokio::sync::oneshot::Sender<f64>)>();
        std::thread::spawn(move || {
            let file = std::fs::File::open(&ns).expect("router namespace");
            // SAFETY: setns on this thread only; it lives for the bench and makes only sockets.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                panic!(
                    "setns {}: {}",
                    ns.display(),
                    std::io::Error::last_os_error()
                );
            }
            let dst = SocketAddrV4::new(SANDBOX_ADDR, PORT);
            let mut kept: Option<TcpStream> = None;
            for (what, reply) in rx {
                let ms = match what {
                    Baseline::NewConnection => {
                        let t = Instant::now();
                        let mut s = connect(dst);
                        get_ping(&mut s);
                        let ms = t.elapsed().as_secs_f64() * 1e3;
                        close(s);
                        ms
                    }
                    Baseline::KeepAlive => {
                        let t = Instant::now();
                        let s = kept.get_or_insert_with(|| connect(dst));
                        get_ping(s);
                        t.elapsed().as_secs_f64() * 1e3
                    }
                    Baseline::CloseKept => {
                        if let Some(s) = kept.take() {
                            close(s);
                        }
                        0.0
                    }
                };
                let _ = reply.send(ms);
            }
        });
        RouterClient { tx }
    }

    async fn run(&self, what: Baseline) -> f64 {
        let (reply, ms) = tokio::sync::oneshot::channel();
        self.tx.send((what, reply)).expect("router thread");
        ms.await.expect("router thread answers")
    }
}

fn connect(dst: SocketAddrV4) -> TcpStream {
    let s = TcpStream::connect_timeout(&dst.into(), IO_TIMEOUT).expect("connect to the sandbox");
    s.set_nodelay(true).expect("nodelay");
    s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    s.set_write_timeout(Some(IO_TIMEOUT)).expect("timeout");
    s
}

/// `GET /ping` and its whole answer (status 200, `Content-Length` body `pong\n`).
fn get_ping(s: &mut TcpStream) {
    s.write_all(format!("GET /ping HTTP/1.1\r\nhost: {SANDBOX_ADDR}:{PORT}\r\n\r\n").as_bytes())
        .expect("send request");
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 512];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).expect("read answer");
        assert!(n > 0, "the server closed before its answer's head");
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    assert!(
        head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200"),
        "{head}"
    );
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .expect("content-length");
    while buf.len() < head_end + len {
        let n = s
            .read(&mut chunk)
            .unwrap_or_else(|e| panic!("read body after {head:?}: {e}"));
        assert!(n > 0, "the server closed before the body's end");
        buf.extend_from_slice(&chunk[..n]);
    }
    assert_eq!(&buf[head_end..], b"pong\n");
}

/// Closes first and waits (up to 1 s) for the server's close, as the proxy does, so the
/// sandbox keeps no connection state that would block its checkpoint.
fn close(mut s: TcpStream) {
    let _ = s.shutdown(std::net::Shutdown::Write);
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    let mut sink = [0u8; 512];
    while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
}

fn row(name: &str, v: &mut [f64]) -> serde_json::Value {
    let (p50, p99) = (pct(v, 50.0), pct(v, 99.0));
    let total: f64 = v.iter().sum();
    let rps = v.len() as f64 / (total / 1e3);
    println!("{name:<40} {p50:>9.3} {p99:>9.3} {rps:>10.1}");
    json!({"p50_ms": p50, "p99_ms": p99, "req_per_s": rps})
}

#[tokio::main]
async fn main() {
    let n = env_usize("TORPOR_NET_N", 300);
    let wakes = env_usize("TORPOR_NET_WAKES", 5);
    let d = Daemon::start(&["--workers", "2"]).await;
    let c = &d.client;
    let token = std::fs::read_to_string(d.data().join("admin-token")).expect("token");
    let token = token.trim();
    // The host template with its idle policy off: the baseline's requests do not go through
    // torpor, so to torpor the sandbox is idle while they run, and the default policy would
    // freeze it (5 s) in the middle of the keep-alive requests.
    support::host_copy_without_idle(c, TEMPLATE).await;
    let id = c
        .create_sandbox(&CreateSandboxBody {
            template: TEMPLATE.into(),
            network: Some(serde_json::from_value(json!({"allow": []})).unwrap()),
            ..Default::default()
        })
        .await
        .expect("create")
        .id;
    c.exec(
        &id,
        &ExecBody {
            cmd: vec![
                "sh".into(),
                "-c".into(),
                "echo pong > /tmp/ping && cd /tmp && exec python3 -m http.server -p HTTP/1.1 8080"
                    .into(),
            ],
            detach: true,
            ..Default::default()
        },
    )
    .await
    .expect("server");
    let keep_alive = reqwest::Client::builder().no_proxy().build().unwrap();
    let fresh = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let proxied_url = format!("{}/v1/sandboxes/{id}/ports/{PORT}/ping", d.url);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ok = keep_alive
            .get(&proxied_url)
            .bearer_auth(token)
            .send()
            .await
            .is_ok_and(|r| r.status() == 200);
        if ok {
            break;
        }
        assert!(Instant::now() < deadline, "server never answered");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let net: serde_json::Value = keep_alive
        .get(format!("{}/v1/sandboxes/{id}/network", d.url))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let router: Ipv4Addr = net["address"]
        .as_str()
        .expect("resident address")
        .parse()
        .expect("an IPv4 address");
    let ns = router_namespace(router);
    let baseline = RouterClient::start(ns.clone());

    // Warm up, then interleave the proxied request and the baseline.
    for _ in 0..20 {
        timed_get(&keep_alive, &proxied_url, token).await;
        baseline.run(Baseline::NewConnection).await;
    }
    let (mut prox, mut direct_new, mut direct_ka) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..n {
        prox.push(timed_get(&keep_alive, &proxied_url, token).await);
        direct_new.push(baseline.run(Baseline::NewConnection).await);
    }
    // Keep-alive on its own, after: a connection held open in the sandbox between requests
    // slowed the requests that followed it (~4-5 ms at p50 on the proxied row), which the
    // proxied path, one connection per request, never has.
    for _ in 0..n {
        direct_ka.push(baseline.run(Baseline::KeepAlive).await);
    }
    baseline.run(Baseline::CloseKept).await;
    drop(keep_alive);

    // Wakes: first proxied request to a Parked sandbox vs POST /resume then the same request.
    let (mut wake_proxied, mut wake_plain) = (Vec::new(), Vec::new());
    for _ in 0..wakes {
        c.suspend(&id, Some(Tier::Parked)).await.expect("park");
        wake_proxied.push(timed_get(&fresh, &proxied_url, token).await);
        c.suspend(&id, Some(Tier::Parked)).await.expect("park");
        let t = Instant::now();
        c.resume(&id).await.expect("resume");
        wake_plain.push(t.elapsed().as_secs_f64() * 1e3);
    }

    println!("\nbaseline from router namespace {}", ns.display());
    println!(
        "\n{:<40} {:>9} {:>9} {:>10}",
        format!("request (n={n})"),
        "p50 ms",
        "p99 ms",
        "req/s"
    );
    let jp = row("proxied via torpor", &mut prox);
    let jn = row("router ns to sandbox, new connection", &mut direct_new);
    let jk = row("router ns to sandbox, keep-alive", &mut direct_ka);
    println!(
        "\n{:<40} {:>9} {:>9} {:>10}",
        format!("wake from Parked (n={wakes})"),
        "p50 ms",
        "p99 ms",
        "wakes/s"
    );
    let jw = row("first proxied request", &mut wake_proxied);
    let jr = row("plain wake (POST /resume)", &mut wake_plain);
    let added_p50 = pct(&mut prox, 50.0) - pct(&mut direct_new, 50.0);
    let added_p99 = pct(&mut prox, 99.0) - pct(&mut direct_new, 99.0);
    let ratio = jp["req_per_s"].as_f64().unwrap() / jn["req_per_s"].as_f64().unwrap();
    println!("\nadded by the proxy vs the router namespace's new connection: p50 {added_p50:.3} ms, p99 {added_p99:.3} ms, throughput ratio {ratio:.2} (goal: <= 1 ms at p50)");
    println!(
        "{}",
        json!({"bench": "network", "n": n, "proxied": jp, "router_ns_new_connection": jn,
               "router_ns_keep_alive": jk, "added_p50_ms": added_p50, "added_p99_ms": added_p99,
               "throughput_ratio": ratio, "wake_first_proxied": jw, "wake_plain_resume": jr})
    );
    let _ = c.delete_sandbox(&id).await;
}
