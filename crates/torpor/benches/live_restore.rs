//! Live restore, what it costs and what it buys: two daemons in the same run, one with
//! `--live-restore=true` (each container under its shim) and one with `--live-restore=false`
//! (runsc the daemon's child), measured call for call, alternating between them.
//!
//!   cargo bench -q --profile dev -p torpor --bench live_restore        (root, runsc installed)
//!   TORPOR_LIVE_N=60 TORPOR_LIVE_SANDBOXES=10 cargo bench ... --bench live_restore
//!
//! Rows: exec `true` in a running sandbox (the extra hop through the shim), wake from Parked +
//! exec (the shim's start on the wake path), create + exec, the shims' memory, and a SIGKILL of
//! each daemon with K running sandboxes that hold a mark written after create: the time until
//! every one answers again and how many kept their mark (live restore: taken back; without:
//! restored from their last snapshot, the mark lost).
//!
//! Prints a table and one JSON line (`{"bench":"live_restore",...}`).

mod support;

use std::time::{Duration, Instant};

use serde_json::json;
use support::{pct, Daemon};
use torpor_api::types::{CreateSandboxBody, ExecBody};
use torpor_api::Client;
use torpor_core::Tier;

const ON: &[&str] = &["--workers", "12", "--live-restore=true"];
const OFF: &[&str] = &["--workers", "12", "--live-restore=false"];

fn env_usize(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn cmd(argv: &[&str]) -> ExecBody {
    ExecBody {
        cmd: argv.iter().map(|s| s.to_string()).collect(),
        timeout_ms: Some(60_000),
        ..Default::default()
    }
}

async fn create(c: &Client) -> String {
    c.create_sandbox(&CreateSandboxBody {
        template: "host".into(),
        ..Default::default()
    })
    .await
    .expect("create")
    .id
}

/// Milliseconds of one exec of `true`.
async fn exec_ms(c: &Client, id: &str) -> f64 {
    let t = Instant::now();
    let r = c.exec(id, &cmd(&["true"])).await.expect("exec");
    assert_eq!(r.exit_code, Some(0));
    t.elapsed().as_secs_f64() * 1e3
}

struct Row {
    name: &'static str,
    on: Vec<f64>,
    off: Vec<f64>,
}

impl Row {
    fn json(&mut self) -> serde_json::Value {
        let (on50, on95) = (pct(&mut self.on, 50.0), pct(&mut self.on, 95.0));
        let (off50, off95) = (pct(&mut self.off, 50.0), pct(&mut self.off, 95.0));
        json!({"name": self.name, "n": self.on.len(), "live_p50_ms": on50, "live_p95_ms": on95,
               "baseline_p50_ms": off50, "baseline_p95_ms": off95, "ratio_p50": on50 / off50,
               "delta_p50_ms": on50 - off50})
    }
}

/// Memory of every `torpor shim` of the daemon whose data directory is `data`: (count, resident
/// bytes, private bytes). Resident counts the binary's pages all shims share; private is what
/// each one adds.
fn shims_memory(data: &std::path::Path) -> (usize, u64, u64) {
    let needle = data.join("shims");
    let needle = needle.as_os_str().as_encoded_bytes();
    let mut n = 0;
    let (mut rss, mut private) = (0, 0);
    for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(cmdline) = std::fs::read(p.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if args.get(1) != Some(&b"shim".as_slice()) || !args.iter().any(|a| a.starts_with(needle)) {
            continue;
        }
        let rollup = std::fs::read_to_string(p.path().join("smaps_rollup")).unwrap_or_default();
        let kib = |key: &str| -> u64 {
            rollup
                .lines()
                .filter_map(|l| l.strip_prefix(key))
                .filter_map(|v| v.split_whitespace().next()?.parse::<u64>().ok())
                .sum()
        };
        n += 1;
        rss += kib("Rss:") * 1024;
        private += (kib("Private_Dirty:") + kib("Private_Clean:")) * 1024;
    }
    (n, rss, private)
}

/// SIGKILLs `d` with `ids` running (each holding `mark-<i>` in /root/mark), restarts it, and
/// returns (ms until every sandbox answered, how many still held their mark).
async fn crash(d: &mut Daemon, args: &[&str], ids: &[String]) -> (f64, usize) {
    for (i, id) in ids.iter().enumerate() {
        let r = d
            .client
            .exec(
                id,
                &cmd(&["sh", "-c", &format!("echo mark-{i} > /root/mark")]),
            )
            .await
            .expect("mark");
        assert_eq!(r.exit_code, Some(0));
    }
    let t = Instant::now();
    d.crash_and_restart(args).await;
    let calls = ids.iter().enumerate().map(|(i, id)| {
        let c = d.client.clone();
        async move {
            let r = c
                .exec(id, &cmd(&["sh", "-c", "cat /root/mark 2>/dev/null; true"]))
                .await
                .expect("a call after the restart");
            r.stdout.trim() == format!("mark-{i}")
        }
    });
    let kept = futures::future::join_all(calls)
        .await
        .into_iter()
        .filter(|k| *k)
        .count();
    (t.elapsed().as_secs_f64() * 1e3, kept)
}

#[tokio::main]
async fn main() {
    let n = env_usize("TORPOR_LIVE_N", 40);
    let k = env_usize("TORPOR_LIVE_SANDBOXES", 10);
    let (mut on, mut off) = tokio::join!(Daemon::start(ON), Daemon::start(OFF));
    let (a, b) = tokio::join!(create(&on.client), create(&off.client));

    let mut exec = Row {
        name: "exec `true`, running sandbox",
        on: vec![],
        off: vec![],
    };
    for _ in 0..3 {
        exec_ms(&on.client, &a).await;
        exec_ms(&off.client, &b).await;
    }
    for _ in 0..n * 2 {
        exec.on.push(exec_ms(&on.client, &a).await);
        exec.off.push(exec_ms(&off.client, &b).await);
    }

    let mut wake = Row {
        name: "wake from Parked + exec",
        on: vec![],
        off: vec![],
    };
    for _ in 0..n / 2 {
        for (d, id, out) in [(&on, &a, &mut wake.on), (&off, &b, &mut wake.off)] {
            d.client
                .suspend(id, Some(Tier::Parked))
                .await
                .expect("park");
            out.push(exec_ms(&d.client, id).await);
        }
    }

    let mut creates = Row {
        name: "create + exec",
        on: vec![],
        off: vec![],
    };
    for _ in 0..n / 4 {
        for (d, out) in [(&on, &mut creates.on), (&off, &mut creates.off)] {
            let t = Instant::now();
            let id = create(&d.client).await;
            exec_ms(&d.client, &id).await;
            out.push(t.elapsed().as_secs_f64() * 1e3);
            d.client.delete_sandbox(&id).await.expect("delete");
        }
    }

    // K running sandboxes on each, then a SIGKILL of each daemon.
    let mut ids_on = vec![a.clone()];
    let mut ids_off = vec![b.clone()];
    for _ in 1..k {
        ids_on.push(create(&on.client).await);
        ids_off.push(create(&off.client).await);
    }
    for id in ids_on.iter().chain(&ids_off) {
        let c = if ids_on.contains(id) {
            &on.client
        } else {
            &off.client
        };
        exec_ms(c, id).await; // running, not frozen or parked
    }
    let (shims, shim_rss, shim_private) = shims_memory(&on.data());
    let (crash_on_ms, kept_on) = crash(&mut on, ON, &ids_on).await;
    let (crash_off_ms, kept_off) = crash(&mut off, OFF, &ids_off).await;
    tokio::time::sleep(Duration::from_millis(100)).await;

    let mut rows = vec![exec.json(), wake.json(), creates.json()];
    println!("live restore vs runsc as the daemon's child (same run, calls alternating)");
    println!(
        "| row | n | live p50 ms | live p95 ms | baseline p50 ms | baseline p95 ms | p50 delta ms |"
    );
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:+.2} |",
            r["name"].as_str().unwrap_or(""),
            r["n"],
            r["live_p50_ms"].as_f64().unwrap_or(f64::NAN),
            r["live_p95_ms"].as_f64().unwrap_or(f64::NAN),
            r["baseline_p50_ms"].as_f64().unwrap_or(f64::NAN),
            r["baseline_p95_ms"].as_f64().unwrap_or(f64::NAN),
            r["delta_p50_ms"].as_f64().unwrap_or(f64::NAN),
        );
    }
    let each_kib = |bytes: u64| bytes / (shims.max(1) as u64) / 1024;
    let (rss_kib, private_kib) = (each_kib(shim_rss), each_kib(shim_private));
    println!();
    println!("| SIGKILL with {k} running sandboxes | every one answering again after | kept their unsaved mark |");
    println!("|---|---|---|");
    println!("| live restore | {crash_on_ms:.0} ms | {kept_on}/{k} |");
    println!("| without (back to their snapshots) | {crash_off_ms:.0} ms | {kept_off}/{k} |");
    println!();
    println!(
        "shims: {shims} running; each {private_kib} KiB of its own ({rss_kib} KiB resident, the rest the binary's shared pages)"
    );
    rows.push(json!({"name": "sigkill and restart", "sandboxes": k,
        "live_ms": crash_on_ms, "live_kept": kept_on,
        "baseline_ms": crash_off_ms, "baseline_kept": kept_off}));
    println!(
        "{}",
        json!({"bench": "live_restore", "n": n, "rows": rows, "shims": shims,
               "shim_rss_kib_each": rss_kib, "shim_private_kib_each": private_kib})
    );
}
