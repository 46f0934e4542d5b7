//! Fleet benchmark: density, parking and fairness, each beside its baseline in the same run.
//!
//!   cargo bench -p torpor --bench fleet                       (as root, runsc installed)
//!   TORPOR_FLEET=parking cargo bench -p torpor --bench fleet  (one scenario)
//!   TORPOR_DENSITY_AGENTS=200 TORPOR_DENSITY_ROUNDS=3 ...      (smaller)
//!
//! - density: N agents (default 1000) forked from one, 5% active at a time (called at once, every
//!   call's state verified), the idle policy parking them between rounds. Baseline: one
//!   resident sandbox per agent, at the memory per resident agent measured in the same run.
//!   Figure: agents served / resident sandboxes that fit in torpor's peak memory (goal ≥ 20x).
//! - parking: 10 workers, 200 concurrent calls to 200 distinct Parked sandboxes with a 30 s
//!   parking budget: failures, call latency, parked wait (from the daemon's histogram) and
//!   wakes per second. Baseline: the same wake with free workers and nothing else running.
//! - fairness: 4 workers; tenant A floods with 10x capacity (40 concurrent callers on 40
//!   Parked sandboxes) while tenant B wakes one of its Parked sandboxes every ~0.3 s.
//!   Baseline: B's wakes with A idle. Figure: B's wake p95 loaded / unloaded (goal ≤ 2x).
//!
//! - warm: wake from Parked + exec on a prepared worker (`--warm-pool 4`) vs a worker prepared
//!   at wake time (`--warm-pool 0`), the two daemons' runs interleaved.
//!
//! Prints a table per scenario and one JSON line (`{"bench":"fleet",...}`).

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use support::{disk_usage, pct, Daemon};
use torpor_api::types::{CreateSandboxBody, CreateTenantBody, ExecBody};
use torpor_api::Client;
use torpor_core::{IdlePolicy, Limits, TemplateName, TemplateSource, TemplateSpec, Tier};

/// An agent: its main process keeps a call counter and a rolling hash of every token it was
/// sent, in memory, and logs each token to a file. A call pokes it through a FIFO pair.
const AGENT: &str = r#"
import os
os.makedirs("/data", exist_ok=True)
for p in ("/tmp/in", "/tmp/out"):
    if not os.path.exists(p): os.mkfifo(p)
n = 0
h = 0
while True:
    with open("/tmp/in") as f: tok = int(f.read().strip())
    n += 1
    h = (h * 31 + tok) % 2305843009213693951
    with open("/data/calls.log", "a") as log: log.write(f"{tok}\n")
    with open("/tmp/out", "w") as f: f.write(f"{n} {h}\n")
"#;

const MOD: u128 = 2_305_843_009_213_693_951;

/// What the bench expects an agent to hold.
#[derive(Clone, Copy, Default)]
struct Expect {
    n: u64,
    h: u64,
}

impl Expect {
    fn next(self, tok: u64) -> Expect {
        Expect {
            n: self.n + 1,
            h: ((self.h as u128 * 31 + tok as u128) % MOD) as u64,
        }
    }
}

fn template(name: &str, idle: IdlePolicy) -> TemplateSpec {
    TemplateSpec {
        name: TemplateName::new(name).expect("valid name"),
        source: TemplateSource::Host,
        command: vec!["python3".into(), "-u".into(), "-c".into(), AGENT.into()],
        env: BTreeMap::new(),
        cwd: None,
        limits: Limits {
            memory_mib: 128,
            cpus: 1.0,
            pids: 32,
        },
        idle,
        warmup_ms: 300,
        gpu: None,
        network: None,
    }
}

const NO_IDLE: IdlePolicy = IdlePolicy {
    freeze_after_s: None,
    park_after_s: None,
    suspend_after_s: None,
};

/// One verified call. Ok((tier before, ms)) or Err(why).
async fn call(c: &Client, id: &str, before: Expect, tok: u64) -> Result<(String, f64), String> {
    let tier = c.sandbox(id).await.map_err(|e| e.to_string())?.tier;
    let t = Instant::now();
    let r = c
        .exec(
            id,
            &ExecBody {
                cmd: vec![
                    "sh".into(),
                    "-c".into(),
                    format!("echo {tok} > /tmp/in && cat /tmp/out && wc -l < /data/calls.log"),
                ],
                timeout_ms: Some(60_000),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| e.to_string())?;
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    let want = before.next(tok);
    let got: Vec<u64> = r
        .stdout
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    if r.exit_code != Some(0) || got != [want.n, want.h, want.n] {
        return Err(format!(
            "state check failed: got {:?}, want [{}, {}, {}] (exit {:?}, {})",
            got,
            want.n,
            want.h,
            want.n,
            r.exit_code,
            r.stderr.trim()
        ));
    }
    Ok((tier, ms))
}

fn token() -> u64 {
    rand::random::<u32>() as u64
}

/// Quantile from a Prometheus histogram's cumulative buckets (linear within a bucket).
fn histogram_quantile(metrics: &str, name: &str, filter: &str, q: f64) -> f64 {
    let mut buckets: Vec<(f64, f64)> = metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}_bucket{{")) && l.contains(filter))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            let v: f64 = l.rsplit(' ').next()?.parse().ok()?;
            Some((le, v))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last().map(|b| b.1).unwrap_or(0.0);
    if total == 0.0 {
        return f64::NAN;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for (le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return f64::INFINITY; // beyond the last bucket: unknown, not its bound
            }
            let span = count - prev.1;
            let frac = if span > 0.0 {
                (rank - prev.1) / span
            } else {
                0.0
            };
            return prev.0 + (le - prev.0) * frac;
        }
        prev = (le, count);
    }
    prev.0
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Creates `n` Parked sandboxes of `tpl` through `c`, a few at a time.
async fn make_parked(c: &Client, tpl: &str, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for chunk in 0..n.div_ceil(4) {
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..4.min(n - chunk * 4) {
            let (c, tpl) = (c.clone(), tpl.to_string());
            set.spawn(async move {
                let s = c
                    .create_sandbox(&CreateSandboxBody {
                        template: tpl,
                        ..Default::default()
                    })
                    .await
                    .expect("create");
                c.suspend(&s.id, Some(Tier::Parked)).await.expect("park");
                s.id
            });
        }
        while let Some(id) = set.join_next().await {
            ids.push(id.expect("task"));
        }
    }
    ids
}

async fn density() -> serde_json::Value {
    let agents = env_usize("TORPOR_DENSITY_AGENTS", 1000);
    let rounds = env_usize("TORPOR_DENSITY_ROUNDS", 6);
    let active = (agents / 20).max(1);
    let d = Daemon::start(&["--workers", "64", "--tick-ms", "200"]).await;
    let c = d.client.clone();
    c.create_template(&template(
        "density",
        IdlePolicy {
            freeze_after_s: Some(0.3),
            park_after_s: Some(1.0),
            suspend_after_s: None,
        },
    ))
    .await
    .expect("template");
    let source = c
        .create_sandbox(&CreateSandboxBody {
            template: "density".into(),
            ..Default::default()
        })
        .await
        .expect("create")
        .id;
    c.suspend(&source, Some(Tier::Suspended))
        .await
        .expect("suspend");
    let t = Instant::now();
    let mut ids = Vec::new();
    while ids.len() < agents {
        let n = (agents - ids.len()).min(64);
        ids.extend(
            c.fork(&source, n)
                .await
                .expect("fork")
                .into_iter()
                .map(|s| s.id),
        );
    }
    let fork_s = t.elapsed().as_secs_f64();
    eprintln!("density: {agents} agents forked in {fork_s:.1} s");

    // Resident memory, sampled all along.
    let peak = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (c, peak, stop) = (c.clone(), peak.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(w) = c.workers().await {
                    peak.fetch_max(w.resident_memory_bytes, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let mut expect = vec![Expect::default(); agents];
    let mut wakes: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut per_agent = Vec::new();
    let mut failures = 0usize;
    let mut calls = 0usize;
    let mut max_busy = 0usize;
    for round in 0..rounds {
        // A fresh 5% each round (a random sample).
        let mut pick: Vec<usize> = (0..agents).collect();
        for i in 0..active {
            let j = i + rand::random::<usize>() % (agents - i);
            pick.swap(i, j);
        }
        pick.truncate(active);
        let mut set = tokio::task::JoinSet::new();
        for &i in &pick {
            let (c, id, before, tok) = (c.clone(), ids[i].clone(), expect[i], token());
            set.spawn(async move { (i, tok, call(&c, &id, before, tok).await) });
        }
        while let Some(r) = set.join_next().await {
            let (i, tok, r) = r.expect("task");
            calls += 1;
            match r {
                Ok((tier, ms)) => {
                    expect[i] = expect[i].next(tok);
                    wakes.entry(tier).or_default().push(ms);
                }
                Err(e) => {
                    failures += 1;
                    eprintln!("density: agent {}: {e}", ids[i]);
                }
            }
        }
        if let Ok(w) = c.workers().await {
            if w.busy > 0 {
                per_agent.push(w.resident_memory_bytes as f64 / w.busy as f64);
                max_busy = max_busy.max(w.busy);
            }
        }
        // Idle: wait for the policy to park the round's agents.
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if c.workers().await.map(|w| w.busy == 0).unwrap_or(false) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        eprintln!("density: round {} of {rounds} done", round + 1);
    }
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.await;
    let per_agent_bytes = pct(&mut per_agent, 50.0);
    let peak_bytes = peak.load(Ordering::Relaxed) as f64;
    let resident_equivalent = peak_bytes / per_agent_bytes;
    let ratio = agents as f64 / resident_equivalent;
    let budget = c
        .workers()
        .await
        .ok()
        .and_then(|w| w.memory_budget_bytes)
        .unwrap_or(0) as f64;
    let disk = disk_usage(&d.data());
    let mut tiers = serde_json::Map::new();
    println!("\n## density: {agents} agents, {active} active at a time, {rounds} rounds, {calls} verified calls, {failures} failures");
    println!(
        "{:<12} {:>6} {:>10} {:>10}",
        "woken from", "calls", "p50 ms", "p95 ms"
    );
    for (tier, v) in &mut wakes {
        let (p50, p95) = (pct(v, 50.0), pct(v, 95.0));
        println!("{:<12} {:>6} {:>10.1} {:>10.1}", tier, v.len(), p50, p95);
        tiers.insert(
            tier.clone(),
            json!({"calls": v.len(), "p50_ms": p50, "p95_ms": p95}),
        );
    }
    let mib = |b: f64| b / (1024.0 * 1024.0);
    println!(
        "memory per resident agent (median over rounds): {:.1} MiB",
        mib(per_agent_bytes)
    );
    println!(
        "torpor peak resident memory: {:.0} MiB = {:.1} resident agents' worth (most busy workers seen: {max_busy})",
        mib(peak_bytes),
        resident_equivalent
    );
    println!(
        "baseline, one resident sandbox per agent: {:.0} MiB for {agents} agents; in torpor's peak memory {:.1} fit",
        mib(per_agent_bytes * agents as f64),
        resident_equivalent
    );
    println!(
        "density: {ratio:.1}x more agents than resident sandboxes in the same memory (goal >= 20x)"
    );
    println!(
        "node budget {:.0} MiB holds {:.0} resident agents; disk used by {agents} sleeping agents: {:.0} MiB",
        mib(budget),
        budget / per_agent_bytes,
        mib(disk as f64)
    );
    json!({
        "agents": agents, "active": active, "rounds": rounds, "calls": calls,
        "failures": failures, "fork_s": fork_s, "wake_by_tier": tiers,
        "per_agent_bytes": per_agent_bytes, "peak_resident_bytes": peak_bytes,
        "density_x": ratio, "baseline_resident_bytes": per_agent_bytes * agents as f64,
        "disk_bytes": disk,
    })
}

async fn parking() -> serde_json::Value {
    let n = env_usize("TORPOR_PARKING_CALLS", 200);
    let workers = env_usize("TORPOR_PARKING_WORKERS", 10);
    let d = Daemon::start(&[
        "--workers",
        &workers.to_string(),
        "--worker-wait-ms",
        "30000",
    ])
    .await;
    let c = d.client.clone();
    c.create_template(&template("parking", NO_IDLE))
        .await
        .expect("template");
    let t = Instant::now();
    let ids = make_parked(&c, "parking", n).await;
    eprintln!(
        "parking: {n} parked sandboxes made in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    // Baseline: one wake at a time, workers free.
    let mut alone = Vec::new();
    for id in ids.iter().take(10) {
        let (_, ms) = call(&c, id, Expect::default(), 7).await.expect("wake");
        alone.push(ms);
        c.suspend(id, Some(Tier::Parked)).await.expect("park");
    }
    let before = c.metrics().await.unwrap_or_default();
    let t = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for (i, id) in ids.iter().enumerate() {
        let (c, id) = (c.clone(), id.clone());
        let prior = if i < 10 {
            Expect::default().next(7)
        } else {
            Expect::default()
        };
        set.spawn(async move {
            let t = Instant::now();
            let r = call(&c, &id, prior, 11).await;
            (r, t.elapsed().as_secs_f64() * 1000.0)
        });
    }
    let mut lat = Vec::new();
    // no_worker_available, told at once (the lot's expected wait passed the budget) or after
    // waiting the budget out; how long each took to be told.
    let (mut refused_ms, mut timed_out_ms) = (Vec::new(), Vec::new());
    let mut failures = BTreeMap::<String, usize>::new();
    while let Some(r) = set.join_next().await {
        match r.expect("task") {
            (Ok((_, ms)), _) => lat.push(ms),
            (Err(e), ms) if e.contains("no worker would be free") => refused_ms.push(ms),
            (Err(e), ms) if e.contains("no worker became free") => timed_out_ms.push(ms),
            (Err(e), _) => {
                let key: String = e.chars().take(60).collect();
                *failures.entry(key).or_default() += 1;
            }
        }
    }
    let (refused, timed_out) = (refused_ms.len(), timed_out_ms.len());
    let (r50, r99) = (pct(&mut refused_ms, 50.0), pct(&mut refused_ms, 99.0));
    let elapsed = t.elapsed().as_secs_f64();
    let after = c.metrics().await.unwrap_or_default();
    let waited = |m: &str| {
        m.lines()
            .find(|l| l.starts_with("torpor_lot_wait_seconds_count{outcome=\"worker\"}"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let parked_calls = waited(&after) - waited(&before);
    let q = |q: f64| {
        histogram_quantile(&after, "torpor_lot_wait_seconds", "outcome=\"worker\"", q) * 1000.0
    };
    let (w50, w99) = (q(0.5), q(0.99));
    let failed: usize = failures.values().sum::<usize>() + refused + timed_out;
    let wakes_per_s = lat.len() as f64 / elapsed;
    let (a50, l50, l99) = (
        pct(&mut alone, 50.0),
        pct(&mut lat, 50.0),
        pct(&mut lat, 99.0),
    );
    println!("\n## parking: {workers} workers, {n} concurrent calls to {n} parked sandboxes, 30 s budget");
    println!("{:<44} {:>10} {:>10}", "", "p50 ms", "p99 ms");
    println!(
        "{:<44} {:>10.0} {:>10.0}",
        "call (wake + exec), all at once", l50, l99
    );
    println!(
        "{:<44} {:>10.0} {:>10}",
        "baseline: the same wake, workers free", a50, ""
    );
    println!(
        "{:<44} {:>10.0} {:>10.0}",
        "parked wait for a worker (daemon histogram)", w50, w99
    );
    println!(
        "{:<44} {:>10.0} {:>10.0}",
        "refused at once (no_worker_available)", r50, r99
    );
    println!(
        "served {} of {n}; refused at once {refused}; timed out after the budget {timed_out}; other failures {failures:?}; parked calls {parked_calls:.0}; {wakes_per_s:.1} wakes/s sustained over {elapsed:.1} s",
        lat.len()
    );
    json!({
        "workers": workers, "calls": n, "failures": failed, "elapsed_s": elapsed,
        "served": lat.len(), "refused_at_once": refused, "timed_out": timed_out,
        "refused_p50_ms": r50, "refused_p99_ms": r99,
        "call_p50_ms": l50, "call_p99_ms": l99, "baseline_wake_p50_ms": a50,
        "parked_wait_p50_ms": w50, "parked_wait_p99_ms": w99, "parked_calls": parked_calls,
        "wakes_per_s": wakes_per_s,
    })
}

async fn fairness() -> serde_json::Value {
    let workers = 4;
    let flood = workers * 10;
    let trickle = env_usize("TORPOR_FAIRNESS_CALLS", 20);
    let d = Daemon::start(&[
        "--workers",
        &workers.to_string(),
        "--worker-wait-ms",
        "60000",
    ])
    .await;
    let admin = d.client.clone();
    admin
        .create_template(&template("fair", NO_IDLE))
        .await
        .expect("template");
    let tenant = |name: &'static str| {
        let admin = admin.clone();
        let url = d.url.clone();
        async move {
            let t = admin
                .create_tenant(&CreateTenantBody {
                    name: name.into(),
                    quotas: None,
                })
                .await
                .expect("tenant");
            Client::new(&url, &t.token)
        }
    };
    let a = tenant("flood").await;
    let b = tenant("trickle").await;
    let a_ids = make_parked(&a, "fair", flood).await;
    let b_ids = make_parked(&b, "fair", 8).await;
    eprintln!("fairness: {flood} + 8 parked sandboxes made");
    let mut b_expect = vec![Expect::default(); b_ids.len()];
    // B wakes one parked sandbox, then parks it again; `n` times.
    async fn run_b(
        b: &Client,
        ids: &[String],
        expect: &mut [Expect],
        n: usize,
    ) -> (Vec<f64>, usize) {
        let mut lat = Vec::new();
        let mut failures = 0;
        for k in 0..n {
            let i = k % ids.len();
            let tok = token();
            match call(b, &ids[i], expect[i], tok).await {
                Ok((_, ms)) => {
                    expect[i] = expect[i].next(tok);
                    lat.push(ms);
                }
                Err(e) => {
                    failures += 1;
                    eprintln!("fairness: B: {e}");
                }
            }
            let _ = b.suspend(&ids[i], Some(Tier::Parked)).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        (lat, failures)
    }
    let (mut unloaded, f1) = run_b(&b, &b_ids, &mut b_expect, trickle).await;
    let stop = Arc::new(AtomicBool::new(false));
    let a_calls = Arc::new(AtomicU64::new(0));
    let a_failures = Arc::new(AtomicU64::new(0));
    let mut flooders = Vec::new();
    for id in a_ids.clone() {
        let (a, stop, a_calls, a_failures) =
            (a.clone(), stop.clone(), a_calls.clone(), a_failures.clone());
        flooders.push(tokio::spawn(async move {
            let mut e = Expect::default();
            while !stop.load(Ordering::Relaxed) {
                let tok = token();
                match call(&a, &id, e, tok).await {
                    Ok(_) => {
                        e = e.next(tok);
                        a_calls.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        if a_failures.fetch_add(1, Ordering::Relaxed) < 3 {
                            eprintln!("fairness: A: {e}");
                        }
                        return;
                    }
                }
            }
        }));
    }
    // Let the flood fill the lot before B starts.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let t = Instant::now();
    let (mut loaded, f2) = run_b(&b, &b_ids, &mut b_expect, trickle).await;
    let flood_s = t.elapsed().as_secs_f64();
    let parked_now = admin.workers().await.map(|w| w.parked_calls).unwrap_or(0);
    stop.store(true, Ordering::Relaxed);
    for f in flooders {
        let _ = f.await;
    }
    let (u50, u95) = (pct(&mut unloaded, 50.0), pct(&mut unloaded, 95.0));
    let (l50, l95) = (pct(&mut loaded, 50.0), pct(&mut loaded, 95.0));
    let ratio = l95 / u95;
    let a_rate = a_calls.load(Ordering::Relaxed) as f64 / flood_s;
    println!("\n## fairness: {workers} workers; tenant A floods with {flood} concurrent callers, tenant B trickles");
    println!(
        "{:<36} {:>10} {:>10}",
        "B's wake + exec", "p50 ms", "p95 ms"
    );
    println!("{:<36} {:>10.0} {:>10.0}", "baseline: A idle", u50, u95);
    println!("{:<36} {:>10.0} {:>10.0}", "A flooding", l50, l95);
    println!(
        "B p95 loaded / unloaded: {ratio:.2}x (goal <= 2x); B failures {}; A {:.1} calls/s, {} A failures, ~{parked_now} calls parked during the flood",
        f1 + f2,
        a_rate,
        a_failures.load(Ordering::Relaxed)
    );
    json!({
        "workers": workers, "flood_callers": flood, "b_calls": trickle,
        "b_unloaded_p50_ms": u50, "b_unloaded_p95_ms": u95,
        "b_loaded_p50_ms": l50, "b_loaded_p95_ms": l95, "b_p95_ratio": ratio,
        "b_failures": f1 + f2, "a_calls_per_s": a_rate,
        "a_failures": a_failures.load(Ordering::Relaxed),
    })
}

/// Wake from Parked + exec, `n` times, on a daemon started with `--warm-pool pool`.
async fn wakes_with_pool(pool: usize, n: usize) -> Vec<f64> {
    let d = Daemon::start(&["--workers", "4", "--warm-pool", &pool.to_string()]).await;
    let c = d.client.clone();
    c.create_template(&template("warm", NO_IDLE))
        .await
        .expect("template");
    let id = make_parked(&c, "warm", 1).await.remove(0);
    let mut e = Expect::default();
    let mut lat = Vec::new();
    for _ in 0..n {
        // Give the pool's thread time to reset the returned worker.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let tok = token();
        let (_, ms) = call(&c, &id, e, tok).await.expect("wake");
        e = e.next(tok);
        lat.push(ms);
        c.suspend(&id, Some(Tier::Parked)).await.expect("park");
    }
    lat
}

async fn warm() -> serde_json::Value {
    let n = env_usize("TORPOR_WARM_N", 30);
    // Interleave the two daemons' runs in halves, so drift in machine load hits both.
    let mut with = wakes_with_pool(4, n / 2).await;
    let mut without = wakes_with_pool(0, n / 2).await;
    with.extend(wakes_with_pool(4, n - n / 2).await);
    without.extend(wakes_with_pool(0, n - n / 2).await);
    let (w50, w95) = (pct(&mut with, 50.0), pct(&mut with, 95.0));
    let (c50, c95) = (pct(&mut without, 50.0), pct(&mut without, 95.0));
    println!("\n## warm pool: wake from Parked + exec, {n} each");
    println!("{:<40} {:>10} {:>10}", "", "p50 ms", "p95 ms");
    println!(
        "{:<40} {:>10.1} {:>10.1}",
        "prepared worker (--warm-pool 4)", w50, w95
    );
    println!(
        "{:<40} {:>10.1} {:>10.1}",
        "baseline: prepared at wake (--warm-pool 0)", c50, c95
    );
    json!({"n": n, "warm_p50_ms": w50, "warm_p95_ms": w95, "cold_p50_ms": c50, "cold_p95_ms": c95,
           "saved_p50_ms": c50 - w50})
}

#[tokio::main]
async fn main() {
    let which =
        std::env::var("TORPOR_FLEET").unwrap_or_else(|_| "warm,parking,fairness,density".into());
    let mut out = serde_json::Map::new();
    out.insert("bench".into(), json!("fleet"));
    for s in which.split(',').map(str::trim) {
        let v = match s {
            "density" => density().await,
            "parking" => parking().await,
            "fairness" => fairness().await,
            "warm" => warm().await,
            "" => continue,
            other => panic!("unknown scenario {other:?} (warm, density, parking, fairness)"),
        };
        out.insert(s.into(), v);
    }
    println!("{}", serde_json::Value::Object(out));
}
