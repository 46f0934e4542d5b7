//! Tenant isolation under load: tenant B's exec latency while tenant A floods at 20x its rate
//! limit, against B's unloaded latency measured in the same run (before and after the flood).
//!
//!   cargo bench -p torpor --bench tenants                 (as root, runsc installed)
//!   TORPOR_TENANTS_N=200 TORPOR_TENANTS_RATE=10 cargo bench -p torpor --bench tenants
//!
//! A has `requests_per_s = RATE` and sends 20 x RATE calls per second from 16 tasks; B sends
//! one exec at a time, paced at RATE / 2 per second, so B alone never hits its own limit. The
//! goal (issue 14): B's p95 under the flood within 2x of its unloaded p95.
//!
//! Prints a table and one JSON line (`{"bench":"tenants",...}`).

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use support::{env_u64, host_sandbox, pct, Daemon};
use torpor_api::types::{CreateTenantBody, ExecBody, Quotas};
use torpor_api::Client;

fn true_cmd() -> ExecBody {
    ExecBody {
        cmd: vec!["true".into()],
        ..Default::default()
    }
}

/// `n` execs by `c` on `id`, one at a time, one every `gap`; milliseconds each.
async fn paced_execs(c: &Client, id: &str, n: u64, gap: Duration) -> Vec<f64> {
    let mut out = Vec::new();
    let mut next = Instant::now();
    for _ in 0..n {
        tokio::time::sleep_until(next.into()).await;
        next += gap;
        let t = Instant::now();
        let r = c.exec(id, &true_cmd()).await.expect("B's exec is served");
        assert_eq!(r.exit_code, Some(0));
        out.push(t.elapsed().as_secs_f64() * 1e3);
    }
    out
}

async fn tenant(d: &Daemon, name: &str, rate: u64) -> (Client, String) {
    let t = d
        .client
        .create_tenant(&CreateTenantBody {
            name: name.into(),
            quotas: Some(Quotas {
                requests_per_s: Some(rate),
                ..Default::default()
            }),
        })
        .await
        .expect("tenant");
    let c = Client::new(&d.url, &t.token);
    let id = host_sandbox(&c).await;
    (c, id)
}

fn row(name: &str, v: &mut [f64]) -> serde_json::Value {
    let (p50, p95, p99) = (pct(v, 50.0), pct(v, 95.0), pct(v, 99.0));
    println!("{name:<28} {p50:>9.2} {p95:>9.2} {p99:>9.2} {:>6}", v.len());
    json!({"p50_ms": p50, "p95_ms": p95, "p99_ms": p99, "n": v.len()})
}

#[tokio::main]
async fn main() {
    let n = env_u64("TORPOR_TENANTS_N", 120);
    let rate = env_u64("TORPOR_TENANTS_RATE", 10).max(1);
    let d = Daemon::start(&["--workers", "4"]).await;
    let (a, a_id) = tenant(&d, "flooder", rate).await;
    let (b, b_id) = tenant(&d, "victim", rate).await;
    let gap = Duration::from_secs_f64(2.0 / rate as f64);
    // Warm both sandboxes (first calls pay for page-ins).
    paced_execs(&b, &b_id, 5, Duration::ZERO).await;
    paced_execs(&a, &a_id, 2, Duration::ZERO).await;
    tokio::time::sleep(Duration::from_secs(3)).await; // buckets refill

    let mut before = paced_execs(&b, &b_id, n / 2, gap).await;

    // A floods at 20x its rate from 16 tasks, for as long as B's loaded run lasts.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (sent, served, limited) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let tasks = 16u64;
    let flood_gap = Duration::from_secs_f64(tasks as f64 / (20.0 * rate as f64));
    let mut flood = Vec::new();
    for _ in 0..tasks {
        let (a, a_id, stop) = (a.clone(), a_id.clone(), stop.clone());
        let (sent, served, limited) = (sent.clone(), served.clone(), limited.clone());
        flood.push(tokio::spawn(async move {
            let mut next = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep_until(next.into()).await;
                next += flood_gap;
                sent.fetch_add(1, Ordering::Relaxed);
                match a.exec(&a_id, &true_cmd()).await {
                    Ok(_) => served.fetch_add(1, Ordering::Relaxed),
                    Err(e) if e.code() == Some("rate_limited") => {
                        limited.fetch_add(1, Ordering::Relaxed)
                    }
                    Err(e) => panic!("the flooder got an unexpected error: {e}"),
                };
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let flood_started = Instant::now();
    let mut during = paced_execs(&b, &b_id, n, gap).await;
    let flood_secs = flood_started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in flood {
        t.await.expect("flood task");
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut after = paced_execs(&b, &b_id, n / 2, gap).await;

    println!(
        "tenant B exec `true` while tenant A floods at 20x its {rate} req/s (ms; n={n}, 2 cores)"
    );
    println!(
        "{:<28} {:>9} {:>9} {:>9} {:>6}",
        "", "p50", "p95", "p99", "n"
    );
    let mut unloaded: Vec<f64> = before.iter().chain(after.iter()).copied().collect();
    let r_before = row("B unloaded (before)", &mut before);
    let r_after = row("B unloaded (after)", &mut after);
    let r_unloaded = row("B unloaded (both)", &mut unloaded);
    let r_during = row("B during A's flood", &mut during);
    let ratio = pct(&mut during, 95.0) / pct(&mut unloaded, 95.0);
    let (sent, served, limited) = (
        sent.load(Ordering::Relaxed),
        served.load(Ordering::Relaxed),
        limited.load(Ordering::Relaxed),
    );
    println!(
        "A sent {sent} ({:.0}/s), served {served} ({:.1}/s), refused 429 {limited}",
        sent as f64 / flood_secs,
        served as f64 / flood_secs
    );
    println!("B p95 during / unloaded: {ratio:.2}x (goal <= 2x)");
    println!(
        "{}",
        json!({
            "bench": "tenants",
            "rate_per_s": rate,
            "b_unloaded_before": r_before,
            "b_unloaded_after": r_after,
            "b_unloaded": r_unloaded,
            "b_during_flood": r_during,
            "p95_ratio": ratio,
            "a_sent": sent,
            "a_served": served,
            "a_rate_limited": limited,
            "a_sent_per_s": sent as f64 / flood_secs,
            "a_served_per_s": served as f64 / flood_secs,
        })
    );
}
