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
//!
//! The floor, in the same run (first pool mode's daemon, `TORPOR_RATE_BARE=0` skips it): bare
//! `runsc restore --detach` of the template's golden image as the daemon holds it, `n` times
//! with `--network=sandbox` (in a namespace of the bench's own with a veth, the address set
//! before each, runsc in a private mount namespace as the daemon runs it) alternating with `n`
//! times `--network=none` (the same `unshare` wrapper, without the mounts): what gVisor's
//! network stack costs a restore, whoever starts it. torpor's own share of a networked
//! create's overhead is the overhead above less this difference.

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

fn sh(args: &[&str]) -> std::process::Output {
    let out = std::process::Command::new(args[0])
        .args(&args[1..])
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `n` bare restores of the golden image with a network alternating with `n` without: (ms with,
/// ms without). The bundle is a live networked sandbox's (`id`), its network namespace
/// replaced by the bench's own, its cgroup by one per container.
fn bare_restores(data: &std::path::Path, id: &str, n: usize) -> (Vec<f64>, Vec<f64>) {
    let root = data.join("runsc");
    let state = sh(&[
        "runsc",
        &format!("--root={}", root.display()),
        "state",
        &format!("{id}-g1"),
    ]);
    let state: serde_json::Value = serde_json::from_slice(&state.stdout).expect("runsc state");
    let bundle = std::path::PathBuf::from(state["bundle"].as_str().expect("bundle"));
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(bundle.join("config.json")).unwrap()).unwrap();
    let golden = data.join(format!("templates/{TEMPLATE}/golden"));
    let tmp = tempfile::tempdir().unwrap();
    let broot = tmp.path().join("root");
    let ns = format!("tpbench{}-s", std::process::id());
    let peer = format!("tpb{}p", std::process::id());
    sh(&["ip", "netns", "add", &ns]);
    sh(&[
        "ip", "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", &peer,
    ]);
    sh(&["ip", "link", "set", &peer, "up"]);
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for i in 0..2 * n {
        let networked = i % 2 == 0;
        let cid = format!("bench-bare-{}-{i}", if networked { "net" } else { "plain" });
        let dir = tmp.path().join(&cid);
        std::fs::create_dir_all(&dir).unwrap();
        let mut spec = spec.clone();
        spec["linux"]["cgroupsPath"] = json!(format!("/torpor-bench/{cid}"));
        let namespaces: Vec<serde_json::Value> = spec["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| n["type"] != "network")
            .cloned()
            .chain(
                networked.then(|| json!({"type": "network", "path": format!("/run/netns/{ns}")})),
            )
            .collect();
        spec["linux"]["namespaces"] = json!(namespaces);
        std::fs::write(dir.join("config.json"), serde_json::to_vec(&spec).unwrap()).unwrap();
        if networked {
            let mut ip = std::process::Command::new("ip")
                .args(["-n", &ns, "-batch", "-"])
                .stdin(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            use std::io::Write;
            ip.stdin
                .take()
                .unwrap()
                .write_all(b"addr flush dev eth0\naddr add 169.254.0.2/30 dev eth0\nlink set eth0 up\nroute replace default via 169.254.0.1\n")
                .unwrap();
            assert!(ip.wait().unwrap().success());
        }
        // As the daemon runs runsc for a networked sandbox: a private mount namespace with a
        // tmpfs over /proc/sys/net (docs/NETWORKING.md); the same wrapper without the mounts
        // for the other, so both pay the same process starts.
        let prelude = if networked {
            "mount --make-rprivate / && mount -t tmpfs none /proc/sys/net && exec \"$@\""
        } else {
            "exec \"$@\""
        };
        let global = |sub: &str| -> Vec<String> {
            vec![
                format!("--root={}", broot.display()),
                "--platform=ptrace".into(),
                format!("--network={}", if networked { "sandbox" } else { "none" }),
                "--overlay2=root:memory".into(),
                sub.into(),
            ]
        };
        let mut restore = global("restore");
        restore.extend([
            "--detach".into(),
            format!("--image-path={}", golden.display()),
            format!("--bundle={}", dir.display()),
            cid.clone(),
        ]);
        let t = Instant::now();
        let out = std::process::Command::new("unshare")
            .args(["-m", "sh", "-c", prelude, "sh", "runsc"])
            .args(&restore)
            .output()
            .expect("unshare runs");
        let ms = t.elapsed().as_secs_f64() * 1e3;
        assert!(
            out.status.success(),
            "bare restore: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if networked {
            with.push(ms);
        } else {
            without.push(ms);
        }
        let mut kill = global("kill");
        kill.extend(["--all".into(), cid.clone(), "KILL".into()]);
        let mut delete = global("delete");
        delete.extend(["--force".into(), cid.clone()]);
        for args in [kill, delete] {
            let _ = std::process::Command::new("unshare")
                .args(["-m", "sh", "-c", prelude, "sh", "runsc"])
                .args(&args)
                .output();
        }
    }
    let _ = std::process::Command::new("ip")
        .args(["netns", "delete", &ns])
        .status();
    (with, without)
}

/// Bare restores with and without a network (ms), when asked for.
type Bare = Option<(Vec<f64>, Vec<f64>)>;

async fn run_mode(
    mode: &str,
    rates: &[f64],
    n: usize,
    floor: &str,
    bare: bool,
) -> (Vec<Phase>, Bare) {
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
    let floor = if bare {
        // The bundle of a live networked sandbox, as the daemon wrote it.
        let (_, id) = create(c.clone(), true).await;
        let data = d.data();
        let sid = id.clone();
        let got = tokio::task::spawn_blocking(move || bare_restores(&data, &sid, n))
            .await
            .expect("bare restores");
        c.delete_sandbox(&id).await.expect("delete");
        Some(got)
    } else {
        None
    };
    (out, floor)
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
    let mut floor_row = None;
    let want_bare = env_or("TORPOR_RATE_BARE", "1") != "0";
    for (i, mode) in modes.split(',').map(str::trim).enumerate() {
        let (phases, bare) = run_mode(mode, &rates, n, &floor, want_bare && i == 0).await;
        if let Some(b) = bare {
            floor_row = Some(b);
        }
        for mut p in phases {
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
    let floor_json = floor_row.map(|(mut with, mut without)| {
        let (w50, w95) = (pct(&mut with, 50.0), pct(&mut with, 95.0));
        let (o50, o95) = (pct(&mut without, 50.0), pct(&mut without, 95.0));
        println!(
            "\n## the floor: bare runsc restore of the same golden image, n = {} each, alternating",
            with.len()
        );
        println!(
            "{:<38} {:>9} {:>9}\n{:<38} {w50:>9.1} {w95:>9.1}\n{:<38} {o50:>9.1} {o95:>9.1}\n{:<38} {:>+9.1}",
            "", "p50 ms", "p95 ms", "--network=sandbox (a veth)", "--network=none",
            "gVisor's network, at p50", w50 - o50
        );
        json!({"net_p50_ms": w50, "net_p95_ms": w95, "plain_p50_ms": o50, "plain_p95_ms": o95,
               "overhead_p50_ms": w50 - o50, "n": with.len()})
    });
    println!(
        "{}",
        json!({"bench": "create_rate", "n": n, "warm_pool": floor, "rows": json_rows, "bare_runsc_restore": floor_json})
    );
}
