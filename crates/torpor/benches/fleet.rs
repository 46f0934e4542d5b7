//! Fleet benchmark: density, parking and fairness, each beside its baseline in the same run.
//!
//!   cargo bench -p torpor --bench fleet                       (as root, runsc installed)
//!   TORPOR_FLEET=parking cargo bench -p torpor --bench fleet  (one scenario)
//!   TORPOR_BENCH_REENCODE=false ...                            (density: `--reencode-images false`)
//!   TORPOR_DENSITY_AGENTS=200 TORPOR_DENSITY_ROUNDS=3 ...      (smaller)
//!   TORPOR_DENSITY_AGENTS=10000 TORPOR_DENSITY_INFLIGHT=64 ... (larger: each round's 5% is
//!                                                             offered 64 calls at a time)
//!
//! - density: N agents (default 1000) forked from one, 5% active at a time (called at once, every
//!   call's state verified), the idle policy parking them between rounds. Baseline: one
//!   resident sandbox per agent, at the memory per resident agent measured in the same run.
//!   Figure: agents served / resident sandboxes that fit in torpor's peak memory (goal ≥ 20x).
//! - parking: 10 workers, 200 concurrent calls to 200 distinct Parked sandboxes (20x
//!   oversubscription) with a 30 s parking budget: served, refused at once (how fast the 503
//!   comes), refused after parking, timed out; call latency, parked wait (the daemon's
//!   histogram) and wakes per second. Baselines: the same wake with free workers and nothing
//!   else running; and the node's capacity measured with bare runsc in the same run
//!   (checkpoint + restore pairs of copies of the same images, 1, 2 and 3 loops per core, or
//!   until throughput stops rising: one loop per core leaves a core idle while its checkpoint
//!   syncs to disk; the best is the capacity). Figure: torpor's wakes/s over that capacity
//!   (goal ≥ 0.9).
//! - fairness: 4 workers; tenant A floods with 10x capacity (40 concurrent callers on 40
//!   Parked sandboxes) while tenant B wakes one of its Parked sandboxes every ~0.3 s.
//!   Baseline: B's wakes with A idle. Figure: B's wake p95 loaded / unloaded (goal ≤ 2x). Run
//!   on a daemon without a kept worker (`--reserved-workers 0`) and on one with the default,
//!   one after the other (`TORPOR_FAIRNESS_RESERVE=0,auto`).
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

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

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
    call_timed(c, id, before, tok).await.0
}

/// [`call`], and how long its exec request took to be answered, whatever the answer (ms).
async fn call_timed(
    c: &Client,
    id: &str,
    before: Expect,
    tok: u64,
) -> (Result<(String, f64), String>, f64) {
    let tier = match c.sandbox(id).await {
        Ok(s) => s.tier,
        Err(e) => return (Err(e.to_string()), f64::NAN),
    };
    let body = ExecBody {
        cmd: vec![
            "sh".into(),
            "-c".into(),
            format!("echo {tok} > /tmp/in && cat /tmp/out && wc -l < /data/calls.log"),
        ],
        timeout_ms: Some(60_000),
        ..Default::default()
    };
    let t = Instant::now();
    let r = c.exec(id, &body).await;
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    (check(r.map(|r| (tier, r)), ms, before, tok), ms)
}

fn check(
    r: Result<(String, torpor_api::types::ExecResult), torpor_api::ClientError>,
    ms: f64,
    before: Expect,
    tok: u64,
) -> Result<(String, f64), String> {
    let (tier, r) = r.map_err(|e| e.to_string())?;
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

/// Memory of the daemon's shims (`<torpor> shim --dir <data>/shims/...`, one supervisor per
/// resident sandbox): the sum of their `Private_Dirty` (smaps_rollup), which is what each shim
/// costs beyond the binary's shared pages. Torpor's side of the density figure includes it.
fn shims_private_dirty(data: &Path) -> u64 {
    let mut needles = vec![data.join("shims")];
    if let Ok(c) = std::fs::canonicalize(data) {
        needles.push(c.join("shims"));
    }
    let mut bytes = 0;
    for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(cmdline) = std::fs::read(p.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let under = |a: &[u8]| {
            needles
                .iter()
                .any(|n| a.starts_with(n.as_os_str().as_encoded_bytes()))
        };
        if args.get(1) != Some(&b"shim".as_slice()) || !args.iter().any(|a| under(a)) {
            continue;
        }
        let rollup = std::fs::read_to_string(p.path().join("smaps_rollup")).unwrap_or_default();
        bytes += rollup
            .lines()
            .find_map(|l| l.strip_prefix("Private_Dirty:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024;
    }
    bytes
}

async fn density() -> serde_json::Value {
    let agents = env_usize("TORPOR_DENSITY_AGENTS", 1000);
    let rounds = env_usize("TORPOR_DENSITY_ROUNDS", 6);
    let active = (agents / 20).max(1);
    // Calls in flight at once within a round (default: the whole 5% at once). At 10,000
    // agents the 500 calls of a round are more than a 2-core node can wake within a call's
    // budget, so they are offered as a client with that many connections would.
    let inflight = env_usize("TORPOR_DENSITY_INFLIGHT", active).max(1);
    let gate = Arc::new(tokio::sync::Semaphore::new(inflight));
    let refusals = Arc::new(AtomicU64::new(0));
    // `TORPOR_BENCH_REENCODE=false`: parked images as runsc writes them (to compare).
    let reencode = match std::env::var("TORPOR_BENCH_REENCODE").as_deref() {
        Ok("false") => "false",
        _ => "true",
    };
    let d = Daemon::start(&[
        "--workers",
        "64",
        "--tick-ms",
        "200",
        "--reencode-images",
        reencode,
    ])
    .await;
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

    // Resident memory, sampled all along: the sandboxes' groups plus their shims.
    let peak = Arc::new(AtomicU64::new(0));
    let shim_peak = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (c, peak, shim_peak, stop) = (c.clone(), peak.clone(), shim_peak.clone(), stop.clone());
        let data = d.data();
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(w) = c.workers().await {
                    let data = data.clone();
                    let shims = tokio::task::spawn_blocking(move || shims_private_dirty(&data))
                        .await
                        .unwrap_or(0);
                    peak.fetch_max(w.resident_memory_bytes + shims, Ordering::Relaxed);
                    shim_peak.fetch_max(shims, Ordering::Relaxed);
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
            let gate = gate.clone();
            let refusals = refusals.clone();
            set.spawn(async move {
                let _turn = gate.acquire_owned().await.expect("gate");
                // As a client should: a 503 `no_worker_available` (refused at once, nothing
                // done) is retried after a pause; every call is still served and verified.
                loop {
                    let r = call(&c, &id, before, tok).await;
                    match &r {
                        Err(e) if e.contains("no_worker_available") => {
                            refusals.fetch_add(1, Ordering::Relaxed);
                            let ms = 500 + rand::random::<u64>() % 1000;
                            tokio::time::sleep(Duration::from_millis(ms)).await;
                        }
                        _ => break (i, tok, r),
                    }
                }
            });
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
    let shim_bytes_peak = shim_peak.load(Ordering::Relaxed);
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
    println!("\n## density: {agents} agents, {active} active per round ({inflight} calls in flight at most), {rounds} rounds, {calls} verified calls, {failures} failures, {} refusals retried", refusals.load(Ordering::Relaxed));
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
        "torpor peak resident memory (sandboxes + shims): {:.0} MiB = {:.1} resident agents' worth (most busy workers seen: {max_busy})",
        mib(peak_bytes),
        resident_equivalent
    );
    println!(
        "shims' memory (Private_Dirty), peak: {:.1} MiB (included above)",
        mib(shim_bytes_peak as f64)
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
        "agents": agents, "active": active, "inflight": inflight, "refusals_retried": refusals.load(Ordering::Relaxed), "rounds": rounds, "calls": calls,
        "failures": failures, "fork_s": fork_s, "wake_by_tier": tiers, "reencode_images": reencode,
        "per_agent_bytes": per_agent_bytes, "peak_resident_bytes": peak_bytes,
        "density_x": ratio, "baseline_resident_bytes": per_agent_bytes * agents as f64,
        "disk_bytes": disk, "shim_bytes_peak": shim_bytes_peak,
    })
}

// --- the bare-runsc capacity of this node, in the same run as the parking scenario

/// runsc's global flags as torpor starts its containers (platform as torpor picks it).
fn runsc_global(root: &Path, tmp: &Path) -> Vec<String> {
    let runsc = torpor_runtime::Runsc::detect(None, None, root.to_path_buf(), tmp.join("logs"))
        .expect("runsc");
    let mut args = vec![
        format!("--root={}", root.display()),
        format!("--platform={}", runsc.platform),
        "--network=none".into(),
    ];
    args.extend(runsc.overlay_flags.iter().cloned());
    args
}

/// The config.json of a live torpor container of sandbox `id` (from `runsc state`), with
/// its own cgroup for a bare container `cid`.
fn bare_spec(data: &Path, id: &str, cid: &str) -> serde_json::Value {
    let root = data.join("runsc");
    let list = Command::new("runsc")
        .arg(format!("--root={}", root.display()))
        .args(["list", "-quiet"])
        .output()
        .expect("runsc list");
    let live = String::from_utf8_lossy(&list.stdout)
        .lines()
        .find(|l| l.starts_with(id))
        .unwrap_or_else(|| panic!("no live container of {id}"))
        .to_string();
    let out = Command::new("runsc")
        .arg(format!("--root={}", root.display()))
        .args(["state", &live])
        .output()
        .expect("runsc state");
    let state: serde_json::Value = serde_json::from_slice(&out.stdout).expect("state JSON");
    let bundle = PathBuf::from(state["bundle"].as_str().expect("a bundle"));
    let mut spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(bundle.join("config.json")).expect("config"))
            .expect("config JSON");
    spec["linux"]["cgroupsPath"] = json!(format!("/torpor-bench/{cid}"));
    spec
}

/// The newest committed image of a sandbox.
fn latest_image(data: &Path, id: &str) -> PathBuf {
    std::fs::read_dir(data.join("sandboxes").join(id).join("images"))
        .expect("images")
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse::<u64>().ok()?, e.path())))
        .max()
        .expect("a committed image")
        .1
}

fn runsc_ok(global: &[String], args: &[String]) {
    let out = Command::new("runsc")
        .args(global)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .expect("runsc runs");
    assert!(
        out.status.success(),
        "runsc {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One lane: `pairs` times, restore the image (as torpor does, the agent's stdin held open)
/// and checkpoint it again to the next image, then delete the container. Returns each
/// pair's (restore ms, checkpoint + delete ms).
fn bare_lane(
    global: &[String],
    dir: &Path,
    spec: &serde_json::Value,
    pairs: usize,
) -> Vec<(f64, f64)> {
    let bundle = dir.join("bundle");
    std::fs::create_dir_all(&bundle).unwrap();
    std::fs::write(
        bundle.join("config.json"),
        serde_json::to_vec(spec).unwrap(),
    )
    .unwrap();
    let cid = spec["linux"]["cgroupsPath"]
        .as_str()
        .unwrap()
        .rsplit('/')
        .next()
        .unwrap()
        .to_string();
    let mut times = Vec::new();
    for k in 0..pairs {
        let (img, next) = (
            dir.join(format!("img-{k}")),
            dir.join(format!("img-{}", k + 1)),
        );
        let id = format!("{cid}-{k}");
        let t = Instant::now();
        let mut restore = Command::new("runsc")
            .args(global)
            .args([
                "restore".into(),
                "--detach".into(),
                format!("--image-path={}", img.display()),
                format!("--bundle={}", bundle.display()),
                id.clone(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("runsc restore");
        // The sandbox keeps this pipe as its agent's stdin: the agent lives while it is open.
        let stdin = restore.stdin.take();
        assert!(
            restore.wait().expect("restore").success(),
            "bare restore failed"
        );
        let r = t.elapsed().as_secs_f64() * 1000.0;
        let t = Instant::now();
        std::fs::create_dir_all(&next).unwrap();
        runsc_ok(
            global,
            &[
                "checkpoint".into(),
                format!("--image-path={}", next.display()),
                id.clone(),
            ],
        );
        runsc_ok(global, &["delete".into(), "--force".into(), id]);
        times.push((r, t.elapsed().as_secs_f64() * 1000.0));
        drop(stdin);
        let _ = std::fs::remove_dir_all(&img);
    }
    times
}

/// One load of the bare-runsc capacity measurement.
struct BareLevel {
    loops_per_core: usize,
    lanes: usize,
    pairs_per_s: f64,
    restore_p50_ms: f64,
    checkpoint_p50_ms: f64,
}

/// Loops per core tried for the node's bare capacity, in order; the next is tried only while
/// throughput still rises.
const LOOPS_PER_CORE: [usize; 3] = [1, 2, 3];

/// The node's bare-runsc capacity: [`bare_capacity`] at each of [`LOOPS_PER_CORE`] loops per
/// core, stopping once a load does not beat the best before it. Returns every load measured
/// and the index of the best (the capacity).
fn bare_capacity_levels(
    data: &Path,
    tmp: &Path,
    specs: &[(String, serde_json::Value)],
    cores: usize,
    pairs: usize,
) -> (Vec<BareLevel>, usize) {
    let mut levels: Vec<BareLevel> = Vec::new();
    let mut best = 0;
    for k in LOOPS_PER_CORE {
        let lanes = cores * k;
        let (rate, restore, checkpoint) =
            bare_capacity(data, tmp, specs, lanes, pairs, &format!("bare{k}"));
        eprintln!(
            "parking: bare runsc, {k} loop(s) per core ({lanes} lanes): {rate:.2} checkpoint+restore pairs/s (restore p50 {restore:.0} ms, checkpoint+delete p50 {checkpoint:.0} ms)"
        );
        let rising = levels.get(best).is_none_or(|b| rate > b.pairs_per_s);
        levels.push(BareLevel {
            loops_per_core: k,
            lanes,
            pairs_per_s: rate,
            restore_p50_ms: restore,
            checkpoint_p50_ms: checkpoint,
        });
        if !rising {
            break;
        }
        best = levels.len() - 1;
    }
    (levels, best)
}

/// What this node sustains with bare runsc: `lanes` restore + checkpoint loops at once, each
/// on a copy of one of `ids`' images, containers and cgroups named after `tag`. Returns
/// (pairs per second, restore p50 ms, checkpoint p50 ms).
fn bare_capacity(
    data: &Path,
    tmp: &Path,
    specs: &[(String, serde_json::Value)],
    lanes: usize,
    pairs: usize,
    tag: &str,
) -> (f64, f64, f64) {
    let root = tmp.join("bare-runsc");
    std::fs::create_dir_all(&root).unwrap();
    let global = runsc_global(&root, tmp);
    let mut dirs = Vec::new();
    for l in 0..lanes {
        let (id, spec) = &specs[l % specs.len()];
        let dir = tmp.join(format!("lane-{l}"));
        std::fs::create_dir_all(&dir).unwrap();
        let st = Command::new("cp")
            .arg("-a")
            .arg(latest_image(data, id))
            .arg(dir.join("img-0"))
            .status()
            .unwrap();
        assert!(st.success());
        let mut spec = spec.clone();
        spec["linux"]["cgroupsPath"] = json!(format!("/torpor-bench/{tag}-{l}"));
        dirs.push((dir, spec));
    }
    let t = Instant::now();
    let times: Vec<(f64, f64)> = std::thread::scope(|s| {
        let handles: Vec<_> = dirs
            .iter()
            .map(|(dir, spec)| {
                let global = &global;
                s.spawn(move || bare_lane(global, dir, spec, pairs))
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("lane"))
            .collect()
    });
    let rate = times.len() as f64 / t.elapsed().as_secs_f64();
    let mut r: Vec<f64> = times.iter().map(|t| t.0).collect();
    let mut c: Vec<f64> = times.iter().map(|t| t.1).collect();
    for (dir, _) in &dirs {
        let _ = std::fs::remove_dir_all(dir);
    }
    (rate, pct(&mut r, 50.0), pct(&mut c, 50.0))
}

/// The lot's log line for a parked call it refused after admitting it.
const REFUSED_LATE: &str = "a parked call can no longer be served in its budget";

async fn parking() -> serde_json::Value {
    let n = env_usize("TORPOR_PARKING_CALLS", 200);
    let workers = env_usize("TORPOR_PARKING_WORKERS", 10);
    let budget_ms = 30_000.0;
    // Bare lanes: 1, 2, 3 loops per core (the engine runs as many checkpoints and restores
    // at once as cores, but a checkpoint's disk sync leaves its core idle).
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get().max(2));
    let pairs = env_usize("TORPOR_CAPACITY_PAIRS", 10);
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
    // Baseline: one wake at a time, workers free; the bundles of the first few, for the bare
    // runsc lanes.
    let mut alone = Vec::new();
    let mut specs = Vec::new();
    for (i, id) in ids.iter().take(10).enumerate() {
        let (_, ms) = call(&c, id, Expect::default(), 7).await.expect("wake");
        alone.push(ms);
        if i < cores {
            specs.push((id.clone(), bare_spec(&d.data(), id, &format!("bare-{i}"))));
        }
        c.suspend(id, Some(Tier::Parked)).await.expect("park");
    }
    // The node's capacity with bare runsc, on copies of those images, before the burst.
    let (levels, best) = {
        let (data, tmp) = (d.data(), d.dir.path().to_path_buf());
        tokio::task::spawn_blocking(move || bare_capacity_levels(&data, &tmp, &specs, cores, pairs))
            .await
            .expect("bare lanes")
    };
    let capacity = &levels[best];
    let (bare_rate, bare_restore, bare_checkpoint) = (
        capacity.pairs_per_s,
        capacity.restore_p50_ms,
        capacity.checkpoint_p50_ms,
    );
    let before = c.metrics().await.unwrap_or_default();
    let log = d.dir.path().join("daemon.log");
    let late_before = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .matches(REFUSED_LATE)
        .count();
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
            let (r, exec_ms) = call_timed(&c, &id, prior, 11).await;
            (r, t.elapsed().as_secs_f64() * 1000.0, exec_ms)
        });
    }
    let mut lat = Vec::new();
    let mut last_served = 0.0f64;
    // no_worker_available: told by the lot (its expected wait passed the budget, on arrival or
    // later) or after waiting the budget out; how long the exec request took to be answered.
    let (mut refused_ms, mut timed_out_ms) = (Vec::new(), Vec::new());
    let mut failures = BTreeMap::<String, usize>::new();
    while let Some(r) = set.join_next().await {
        match r.expect("task") {
            (Ok((_, _)), ms, _) => {
                lat.push(ms);
                last_served = last_served.max(t.elapsed().as_secs_f64());
            }
            (Err(e), _, exec_ms) if e.contains("no worker would be free") => {
                refused_ms.push(exec_ms)
            }
            (Err(e), _, exec_ms) if e.contains("no worker became free") => {
                timed_out_ms.push(exec_ms)
            }
            (Err(e), _, _) => {
                let key: String = e.chars().take(60).collect();
                *failures.entry(key).or_default() += 1;
            }
        }
    }
    let late = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .matches(REFUSED_LATE)
        .count()
        - late_before;
    let (refused, timed_out) = (refused_ms.len(), timed_out_ms.len());
    let under_100 = refused_ms.iter().filter(|ms| **ms < 100.0).count();
    let (r50, r99) = (pct(&mut refused_ms, 50.0), pct(&mut refused_ms, 99.0));
    let r_max = refused_ms.last().copied().unwrap_or(f64::NAN);
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
    // Wakes per second at 20x: the calls served over the time to the last one served.
    let wakes_per_s = lat.len() as f64 / last_served;
    let ratio = wakes_per_s / bare_rate;
    let (a50, l50, l99) = (
        pct(&mut alone, 50.0),
        pct(&mut lat, 50.0),
        pct(&mut lat, 99.0),
    );
    // What the node could have served in the budget at the rate it sustained: the workers free
    // at once, then one call per hand-off (a victim's checkpoint giving its worker to a parked
    // call). The hand-off rate counts only the calls served after the free workers, over the
    // time to the last worker handed out: the last answer less one wake with workers free
    // (restore + exec; under load it takes longer, so this under-counts the servable calls by
    // about one). Before 2026-12-05 (evening) the rate was `wakes_per_s`, which counts the free workers'
    // calls as hand-offs too and so added ~`workers` calls the node could never serve.
    let handoff_span = (last_served - a50 / 1000.0).max(f64::EPSILON);
    let handoffs_per_s = lat.len().saturating_sub(workers) as f64 / handoff_span;
    let servable = ((workers as f64 + handoffs_per_s * budget_ms / 1000.0) as usize).min(n);
    println!("\n## parking: {workers} workers, {n} concurrent calls to {n} parked sandboxes, 30 s budget");
    println!("{:<52} {:>10} {:>10}", "", "p50 ms", "p99 ms");
    println!(
        "{:<52} {:>10.0} {:>10.0}",
        "call (wake + exec), all at once", l50, l99
    );
    println!(
        "{:<52} {:>10.0} {:>10}",
        "baseline: the same wake, workers free", a50, ""
    );
    println!(
        "{:<52} {:>10.0} {:>10.0}",
        "parked wait for a worker (daemon histogram)", w50, w99
    );
    println!(
        "{:<52} {:>10.0} {:>10.0}",
        "refused (no_worker_available): exec request to 503", r50, r99
    );
    println!(
        "served {} of {n} (the node's hand-off rate and the budget allow ~{servable}; last answer at {last_served:.1} s); refused {refused} ({under_100} in under 100 ms, slowest {r_max:.0} ms; {late} of them after parking); timed out after the budget {timed_out}; other failures {failures:?}; parked calls {parked_calls:.0}",
        lat.len()
    );
    println!("{:<52} {:>10}", "", "wakes/s");
    println!(
        "{:<52} {:>10.2}",
        format!("torpor at {}x oversubscription", n / workers.max(1)),
        wakes_per_s
    );
    println!(
        "{:<52} {:>10.2}",
        "  of them hand-offs (after the free workers)", handoffs_per_s
    );
    for (i, l) in levels.iter().enumerate() {
        println!(
            "{:<52} {:>10.2}{}",
            format!(
                "bare runsc checkpoint+restore, {} loop{}/core ({} lanes)",
                l.loops_per_core,
                if l.loops_per_core == 1 { "" } else { "s" },
                l.lanes
            ),
            l.pairs_per_s,
            if i == best { "  <- capacity" } else { "" }
        );
    }
    println!(
        "{:<52} {:>10.2}",
        "baseline: the node's bare capacity (best of the above)", bare_rate
    );
    println!("capacity ratio: {ratio:.2} (goal >= 0.9); at capacity, bare restore p50 {bare_restore:.0} ms, checkpoint+delete p50 {bare_checkpoint:.0} ms");
    let bare_levels: Vec<_> = levels
        .iter()
        .map(|l| {
            json!({"loops_per_core": l.loops_per_core, "lanes": l.lanes,
                   "pairs_per_s": l.pairs_per_s, "restore_p50_ms": l.restore_p50_ms,
                   "checkpoint_p50_ms": l.checkpoint_p50_ms})
        })
        .collect();
    json!({
        "workers": workers, "calls": n, "failures": failed, "elapsed_s": elapsed,
        "served": lat.len(), "servable_at_rate": servable, "refused": refused,
        "refused_under_100ms": under_100, "refused_after_parking": late, "timed_out": timed_out,
        "refused_p50_ms": r50, "refused_p99_ms": r99, "refused_max_ms": r_max,
        "call_p50_ms": l50, "call_p99_ms": l99, "baseline_wake_p50_ms": a50,
        "parked_wait_p50_ms": w50, "parked_wait_p99_ms": w99, "parked_calls": parked_calls,
        "wakes_per_s": wakes_per_s, "handoffs_per_s": handoffs_per_s,
        "last_served_s": last_served,
        "bare_cores": cores, "bare_lanes": capacity.lanes,
        "bare_loops_per_core": capacity.loops_per_core, "bare_levels": bare_levels,
        "bare_pairs_per_lane": pairs, "bare_pairs_per_s": bare_rate,
        "bare_restore_p50_ms": bare_restore, "bare_checkpoint_p50_ms": bare_checkpoint,
        "capacity_ratio": ratio,
    })
}

/// Fairness on daemons with each `--reserved-workers` of `TORPOR_FAIRNESS_RESERVE` (default
/// `0,auto`: the lot without a kept worker as the baseline, then the default), one after the
/// other.
async fn fairness() -> serde_json::Value {
    let reserves =
        std::env::var("TORPOR_FAIRNESS_RESERVE").unwrap_or_else(|_| "0,auto".to_string());
    let mut runs = serde_json::Map::new();
    let mut rows = Vec::new();
    for reserve in reserves.split(',').filter(|r| !r.is_empty()) {
        let v = fairness_with(reserve).await;
        rows.push((reserve.to_string(), v.clone()));
        runs.insert(format!("reserved_{reserve}"), v);
    }
    println!("\n## fairness, side by side (--reserved-workers)");
    println!(
        "{:<10} {:>12} {:>12} {:>12} {:>12} {:>9} {:>10}",
        "reserved", "alone p50", "alone p95", "flood p50", "flood p95", "p95 x", "A calls/s"
    );
    for (reserve, v) in &rows {
        let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "{:<10} {:>12.0} {:>12.0} {:>12.0} {:>12.0} {:>8.2}x {:>10.1}",
            reserve,
            f("b_unloaded_p50_ms"),
            f("b_unloaded_p95_ms"),
            f("b_loaded_p50_ms"),
            f("b_loaded_p95_ms"),
            f("b_p95_ratio"),
            f("a_calls_per_s")
        );
    }
    serde_json::Value::Object(runs)
}

async fn fairness_with(reserve: &str) -> serde_json::Value {
    let workers = 4;
    let flood = workers * 10;
    let trickle = env_usize("TORPOR_FAIRNESS_CALLS", 20);
    let d = Daemon::start(&[
        "--workers",
        &workers.to_string(),
        "--worker-wait-ms",
        "60000",
        "--reserved-workers",
        reserve,
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
    println!("\n## fairness: {workers} workers (--reserved-workers {reserve}); tenant A floods with {flood} concurrent callers, tenant B trickles");
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
        "workers": workers, "reserved_workers": reserve, "flood_callers": flood, "b_calls": trickle,
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
