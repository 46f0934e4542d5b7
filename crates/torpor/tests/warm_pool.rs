//! The warm pool sizes its stock of prepared networks from the rate networked sandboxes are
//! taken (crates/torpor-runtime/src/warm.rs, warm/sizing.rs), through the real daemon, real
//! runsc sandboxes and real namespaces. Inline preparations are counted from the daemon's own
//! stats (`cold_takes` of `GET /v1/workers`, `torpor_warm_pool_takes_total{kind="cold"}`), the
//! pool's stock from the host (each ready networked worker has a router namespace and an
//! empty group), never from timings.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::json;
use torpor_api::types::CreateSandboxBody;

const TEMPLATE: &str = "rate";

async fn template(c: &torpor_api::Client) {
    common::host_copy_without_idle(c, TEMPLATE).await;
}

async fn create_networked(c: &torpor_api::Client) -> String {
    c.create_sandbox(&CreateSandboxBody {
        template: TEMPLATE.into(),
        network: Some(serde_json::from_value(json!({"allow": []})).unwrap()),
        ..Default::default()
    })
    .await
    .unwrap()
    .id
}

/// Ready workers that have a network: a bundle directory of the daemon's, a router namespace,
/// and no process in the group.
fn ready_networked(data: &Path) -> usize {
    std::fs::read_dir(data.join("workers"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|w| Path::new(&format!("/run/netns/{w}-r")).exists())
                .filter(|w| {
                    std::fs::read_to_string(format!(
                        "/sys/fs/cgroup/memory/torpor/{w}/cgroup.procs"
                    ))
                    .is_ok_and(|p| p.trim().is_empty())
                })
                .count()
        })
        .unwrap_or(0)
}

/// The value of the counter line `name` in a metrics page.
fn metric(page: &str, name: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_burst_of_networked_creates_is_served_from_networks_the_pool_prepared_after_adapting() {
    // A floor of one ready worker: a pool of fixed size would hold one network.
    let d = Daemon::start_with(&["--workers", "32", "--warm-pool", "1"]).await;
    let c = d.client();
    template(&c).await;
    let mut held = Vec::new();

    // The first networked sandbox: before it, the pool prepares no network.
    held.push(create_networked(&c).await);
    let w0 = c.workers().await.unwrap();
    assert!(
        w0.cold_takes >= 1,
        "the first network is made inline: {w0:?}"
    );

    // Demand: networked creates back to back. The pool's target rises above its floor.
    for _ in 0..8 {
        held.push(create_networked(&c).await);
    }
    let w1 = c.workers().await.unwrap();
    assert!(
        w1.warm_pool_size >= 2,
        "after networked takes the target exceeds the floor of 1: {w1:?}"
    );

    // Adapted: the preparers fill the stock the rate called for; wait until it stops moving.
    let deadline = Instant::now() + Duration::from_secs(25);
    let mut last = usize::MAX;
    let stock = loop {
        let n = ready_networked(&d.dir);
        if n == last && n >= 2 {
            break n;
        }
        assert!(
            Instant::now() < deadline,
            "the pool never held two prepared networks: {n} ({:?})",
            c.workers().await
        );
        last = n;
        tokio::time::sleep(Duration::from_millis(500)).await;
    };

    // A burst as large as the stock: every create is served from a prepared network.
    let before = c.workers().await.unwrap();
    for _ in 0..stock {
        held.push(create_networked(&c).await);
    }
    let after = c.workers().await.unwrap();
    assert_eq!(
        after.cold_takes, before.cold_takes,
        "a burst of {stock} networked creates prepared inline: {before:?} -> {after:?}"
    );
    assert_eq!(
        after.warm_takes,
        before.warm_takes + stock as u64,
        "{before:?} -> {after:?}"
    );
    let m = c.metrics().await.unwrap();
    assert_eq!(
        metric(&m, "torpor_warm_pool_takes_total{kind=\"cold\"}"),
        after.cold_takes as f64,
        "the metric counts the same inline preparations"
    );

    // Every one of them is networked and works: the sandbox has its address.
    let r = c
        .exec(
            held.last().unwrap(),
            &common::sh("ip -4 -o addr show eth0 || cat /proc/net/fib_trie"),
        )
        .await
        .unwrap();
    assert!(r.stdout.contains("169.254.0.2"), "{r:?}");
    for id in held {
        c.delete_sandbox(&id).await.unwrap();
    }
}
