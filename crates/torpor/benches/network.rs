//! Network benchmark: a request proxied by torpor to a sandbox's HTTP server vs the same
//! request made directly to the sandbox's address from the host, and the first proxied request
//! to a Parked sandbox vs a plain wake (`POST /resume`), interleaved in the same run.
//!
//!   cargo bench -p torpor --bench network            (as root, runsc and nft installed)
//!   TORPOR_NET_N=200 TORPOR_NET_WAKES=5 cargo bench -p torpor --bench network
//!
//! Prints a table and one JSON line (`{"bench":"network",...}`).

mod support;

use std::time::{Duration, Instant};

use serde_json::json;
use support::{pct, Daemon};
use torpor_api::types::{CreateSandboxBody, ExecBody};
use torpor_core::Tier;

fn env_usize(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

async fn timed_get(c: &reqwest::Client, url: &str, token: Option<&str>) -> f64 {
    let t = Instant::now();
    let mut rb = c.get(url);
    if let Some(tok) = token {
        rb = rb.bearer_auth(tok);
    }
    let r = rb.send().await.expect("request");
    assert_eq!(r.status(), 200, "{url}");
    let body = r.bytes().await.expect("body");
    assert_eq!(&body[..], b"pong\n");
    t.elapsed().as_secs_f64() * 1e3
}

fn row(name: &str, v: &mut [f64]) -> serde_json::Value {
    let (p50, p99) = (pct(v, 50.0), pct(v, 99.0));
    let total: f64 = v.iter().sum();
    let rps = v.len() as f64 / (total / 1e3);
    println!("{name:<34} {p50:>9.3} {p99:>9.3} {rps:>10.1}");
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
    let id = c
        .create_sandbox(&CreateSandboxBody {
            template: "host".into(),
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
    let proxied_url = format!("{}/v1/sandboxes/{id}/ports/8080/ping", d.url);
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
    let addr = net["address"]
        .as_str()
        .expect("resident address")
        .to_string();
    let direct_url = format!("http://{addr}:8080/ping");

    // Warm up, then interleave the three kinds.
    for _ in 0..20 {
        timed_get(&keep_alive, &proxied_url, Some(token)).await;
        timed_get(&fresh, &direct_url, None).await;
    }
    let (mut prox, mut direct_new, mut direct_ka) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..n {
        prox.push(timed_get(&keep_alive, &proxied_url, Some(token)).await);
        direct_new.push(timed_get(&fresh, &direct_url, None).await);
        direct_ka.push(timed_get(&keep_alive, &direct_url, None).await);
    }
    drop(keep_alive);
    let keep_alive = reqwest::Client::builder().no_proxy().build().unwrap();

    // Wakes: first proxied request to a Parked sandbox vs POST /resume then the same request.
    let (mut wake_proxied, mut wake_plain) = (Vec::new(), Vec::new());
    for _ in 0..wakes {
        c.suspend(&id, Some(Tier::Parked)).await.expect("park");
        wake_proxied.push(timed_get(&fresh, &proxied_url, Some(token)).await);
        c.suspend(&id, Some(Tier::Parked)).await.expect("park");
        let t = Instant::now();
        c.resume(&id).await.expect("resume");
        wake_plain.push(t.elapsed().as_secs_f64() * 1e3);
    }
    drop(keep_alive);

    println!(
        "\n{:<34} {:>9} {:>9} {:>10}",
        format!("request (n={n})"),
        "p50 ms",
        "p99 ms",
        "req/s"
    );
    let jp = row("proxied via torpor", &mut prox);
    let jn = row("direct, new connection", &mut direct_new);
    let jk = row("direct, keep-alive", &mut direct_ka);
    println!(
        "\n{:<34} {:>9} {:>9} {:>10}",
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
    println!("\nadded by the proxy vs direct (new connection): p50 {added_p50:.3} ms, p99 {added_p99:.3} ms, throughput ratio {ratio:.2} (goal: <= 1 ms at p50)");
    println!(
        "{}",
        json!({"bench": "network", "n": n, "proxied": jp, "direct_new_connection": jn,
               "direct_keep_alive": jk, "added_p50_ms": added_p50, "added_p99_ms": added_p99,
               "throughput_ratio": ratio, "wake_first_proxied": jw, "wake_plain_resume": jr})
    );
    let _ = c.delete_sandbox(&id).await;
}
