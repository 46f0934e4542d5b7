//! Create-rate benchmark: networked creates (each sandbox gets its worker's network: namespaces,
//! links, rules, egress relay) at several offered rates, each beside a create without a network
//! (the native baseline) offered at the same rate and interleaved with it, in the same run.
//!
//!   cargo bench -q --profile dev -p torpor --bench create_rate     (as root, runsc and nft)
//!   TORPOR_RATE_N=10 TORPOR_RATE_RATES=1,2,5,0,inf TORPOR_RATE_MODES=adaptive,fixed \
//!     TORPOR_RATE_FLOOR=2 cargo bench -q --profile dev -p torpor --bench create_rate
//!
//! For each pool mode (`adaptive`: the warm pool sizes its stock of prepared networks from the
//! rate they are taken, crates/torpor-runtime/src/warm/sizing.rs; `fixed`: the behaviour before
//! it, a stock of `--warm-pool` workers networked one at a time, selected with
//! `TORPOR_WARM_POOL_FIXED=1` in the daemon's environment) a fresh daemon runs every rate in
//! turn: `n` networked creates and `n` creates without a network, alternating, each started at
//! its scheduled time (open loop: rate `r` starts a networked create and a plain one every
//! `1/r` s; `0` is back to back, one create at a time; `inf` is every create at once, a burst
//! limited only by the daemon's own restore concurrency). The sandboxes of a rate are kept until
//! its last create has answered (creates consume workers, as E2B sandboxes that live on do),
//! then deleted. Reported per rate: create latency p50/p95 with and without a network, the
//! overhead at p50, and the inline preparations (`cold_takes` of `GET /v1/workers`: takes
//! that prepared the worker or its network in the create's path). Prints a table and one JSON
//! line (`{"bench":"create_rate",...}`).

mod support;

use std::time::{Duration, Instant};

use serde_json::json;
use support::{pct, Daemon};
use torpor_api::types::CreateSandboxBody;

const TEMPLATE: &str = "bench-rate";

fn env_or(k: &str, d: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| d.into())
}

/// One create; its latency in ms and the sandbox's id.
async fn create(c: torpor_api::Client, networked: bool) -> (f64, String) {
    let body = CreateSandboxBody {
        template: TEMPLATE.into(),
        network: networked.then(|| serde_json::from_value(json!({"allow": []})).unwrap()),
        ..Default::default()
    };
    let t = Instant::now();
    let s = c.create_sandbox(&body).await.expect("create");
    (t.elapsed().as_secs_f64() * 1e3, s.id)
}

struct Phase {
    rate: f64,
    net_ms: Vec<f64>,
    plain_ms: Vec<f64>,
    inline: u64,
    target_after: usize,
}

async fn phase(c: &torpor_api::Client, rate: f64, n: usize) -> Phase {
    let before = c.workers().await.expect("workers");
    let mut net_ms = Vec::new();
    let mut plain_ms = Vec::new();
    let mut ids = Vec::new();
    if rate <= 0.0 {
        for _ in 0..n {
            for networked in [true, false] {
                let (ms, id) = create(c.clone(), networked).await;
                if networked {
                    &mut net_ms
                } else {
                    &mut plain_ms
                }
                .push(ms);
                ids.push(id);
            }
        }
    } else {
        let start = tokio::time::Instant::now();
        let period = Duration::from_secs_f64(1.0 / rate);
        let mut tasks = Vec::new();
        for i in 0..n {
            // The plain create half a period after the networked one: the same offered rate.
            for (networked, offset) in [(true, 0.0), (false, 0.5)] {
                let at = start + period.mul_f64(i as f64 + offset);
                let c = c.clone();
                tasks.push(tokio::spawn(async move {
                    tokio::time::sleep_until(at).await;
                    (networked, create(c, networked).await)
                }));
            }
        }
        for t in tasks {
            let (networked, (ms, id)) = t.await.expect("create task");
            if networked {
                &mut net_ms
            } else {
                &mut plain_ms
            }
            .push(ms);
            ids.push(id);
        }
    }
    let after = c.workers().await.expect("workers");
    for id in ids {
        c.delete_sandbox(&id).await.expect("delete");
    }
    // Let the returned workers be reset before the next rate.
    tokio::time::sleep(Duration::from_secs(3)).await;
    Phase {
        rate,
        net_ms,
        plain_ms,
        inline: after.cold_takes - before.cold_takes,
        target_after: after.warm_pool_size,
    }
}

async fn run_mode(mode: &str, rates: &[f64], n: usize, floor: &str) -> Vec<Phase> {
    if mode == "fixed" {
        std::env::set_var("TORPOR_WARM_POOL_FIXED", "1");
    } else {
        std::env::remove_var("TORPOR_WARM_POOL_FIXED");
    }
    let workers = (2 * n + 8).to_string();
    let d = Daemon::start(&["--workers", &workers, "--warm-pool", floor]).await;
    let c = &d.client;
    // No idle policy: a sandbox parked mid-phase would hand its worker back.
    support::host_copy_without_idle(c, TEMPLATE).await;
    // One networked create and one plain before timing: the golden snapshot is made, and the
    // pool has seen that networked sandboxes are wanted (as on a daemon in service).
    for networked in [true, false] {
        let (_, id) = create(c.clone(), networked).await;
        c.delete_sandbox(&id).await.expect("delete");
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut out = Vec::new();
    for &r in rates {
        out.push(phase(c, r, n).await);
    }
    out
}

#[tokio::main]
async fn main() {
    let n: usize = env_or("TORPOR_RATE_N", "10")
        .parse()
        .expect("TORPOR_RATE_N");
    let rates: Vec<f64> = env_or("TORPOR_RATE_RATES", "1,2,5,0,inf")
        .split(',')
        .map(|r| {
            r.trim()
                .parse()
                .expect("a rate per second, 0 = back to back, inf = all at once")
        })
        .collect();
    let floor = env_or("TORPOR_RATE_FLOOR", "2");
    let modes = env_or("TORPOR_RATE_MODES", "adaptive,fixed");
    println!(
        "\n## networked create vs create without a network, n = {n} each per rate, --warm-pool {floor}"
    );
    println!(
        "{:<9} {:<14} {:>9} {:>9} {:>11} {:>11} {:>13} {:>7} {:>7}",
        "pool",
        "offered",
        "net p50",
        "net p95",
        "plain p50",
        "plain p95",
        "overhead p50",
        "inline",
        "target"
    );
    let mut json_rows = Vec::new();
    for mode in modes.split(',').map(str::trim) {
        for mut p in run_mode(mode, &rates, n, &floor).await {
            let (n50, n95) = (pct(&mut p.net_ms, 50.0), pct(&mut p.net_ms, 95.0));
            let (b50, b95) = (pct(&mut p.plain_ms, 50.0), pct(&mut p.plain_ms, 95.0));
            let offered = if p.rate <= 0.0 {
                "back to back".to_string()
            } else if p.rate.is_infinite() {
                "all at once".to_string()
            } else {
                format!("{}/s", p.rate)
            };
            println!(
                "{mode:<9} {offered:<14} {n50:>9.1} {n95:>9.1} {b50:>11.1} {b95:>11.1} {:>+13.1} {:>7} {:>7}",
                n50 - b50,
                p.inline,
                p.target_after
            );
            json_rows.push(json!({
                "pool": mode, "offered_per_s": if p.rate.is_infinite() { json!("all at once") } else { json!(p.rate) }, "n": p.net_ms.len(),
                "net_p50_ms": n50, "net_p95_ms": n95,
                "plain_p50_ms": b50, "plain_p95_ms": b95,
                "overhead_p50_ms": n50 - b50, "inline_preparations": p.inline,
                "pool_target_after": p.target_after,
            }));
        }
    }
    println!(
        "{}",
        json!({"bench": "create_rate", "n": n, "warm_pool": floor, "rows": json_rows})
    );
}
