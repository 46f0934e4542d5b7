//! `torpor demo`: a fleet of agents driven through sleep and wake, with every agent's state
//! checked after every wake.
//!
//! Each agent is a Python process (the template's main process) that holds a counter and a
//! buffer of random bytes in memory and appends every call to a file. A call goes through a FIFO
//! pair inside the sandbox, so it reaches that very process: if its memory or files were lost in
//! a checkpoint, the counter, the buffer's checksum or the file's line count would be wrong.
//! Between bursts the fleet idles; the idle policy freezes and parks agents, and some are sent to
//! the snapshot store explicitly, so wakes come from every tier.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use torpor_api::types::{CreateSandboxBody, ExecBody};
use torpor_api::Client;
use torpor_core::{IdlePolicy, Limits, TemplateName, TemplateSource, TemplateSpec, Tier};

use crate::report::{Report, Sample, TierRow};

#[derive(Args)]
pub struct DemoArgs {
    /// Use a running daemon instead of starting one in a temporary directory.
    #[arg(long)]
    url: Option<String>,
    #[arg(long, env = crate::daemon::ENV_TOKEN, hide_env_values = true)]
    token: Option<String>,
    /// Number of agents.
    #[arg(long, default_value_t = 8)]
    agents: usize,
    /// Bursts of calls, separated by idle gaps.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Seconds of idleness between bursts.
    #[arg(long, default_value_t = 4.0)]
    idle_s: f64,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
    /// Also write the summary as an HTML page with charts.
    #[arg(long, value_name = "FILE.html")]
    report: Option<PathBuf>,
}

const AGENT: &str = r#"
import os, hashlib, random
os.makedirs("/data", exist_ok=True)
for p in ("/tmp/in", "/tmp/out"):
    if not os.path.exists(p): os.mkfifo(p)
state = bytearray(random.randbytes(8 << 20))
digest = hashlib.sha256(state).hexdigest()
n = 0
while True:
    with open("/tmp/in") as f: cmd = f.read().strip()
    n += 1
    state[n % len(state)] ^= 1
    digest = hashlib.sha256(state).hexdigest()
    with open("/data/calls.log", "a") as log: log.write(f"{n} {cmd}\n")
    with open("/tmp/out", "w") as f: f.write(f"{n} {digest}\n")
"#;

struct Daemon {
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

async fn start_daemon() -> anyhow::Result<(Daemon, Client)> {
    let dir = tempfile::Builder::new().prefix("torpor-demo-").tempdir()?;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.port()
    };
    let exe = std::env::current_exe()?;
    let log = std::fs::File::create(dir.path().join("daemon.log"))?;
    let child = std::process::Command::new(exe)
        .args([
            "up",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--workers",
            "4",
        ])
        .arg("--data-dir")
        .arg(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("cannot start the daemon")?;
    let daemon = Daemon { child, _dir: dir };
    let token_path: PathBuf = daemon._dir.path().join(crate::daemon::TOKEN_FILE);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(token) = std::fs::read_to_string(&token_path) {
            let c = Client::new(&format!("http://127.0.0.1:{port}"), token.trim());
            if c.is_up().await {
                return Ok((daemon, c));
            }
        }
        if Instant::now() > deadline {
            let log =
                std::fs::read_to_string(daemon._dir.path().join("daemon.log")).unwrap_or_default();
            bail!("the daemon did not come up within 120 s:\n{log}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn tier_row(tier: &str, mut v: Vec<f64>) -> TierRow {
    v.sort_by(f64::total_cmp);
    TierRow {
        tier: tier.to_string(),
        calls: v.len(),
        p50_ms: percentile(&v, 50.0),
        p95_ms: percentile(&v, 95.0),
        p99_ms: percentile(&v, 99.0),
    }
}

/// Polls the daemon every 250 ms: resident memory, workers, parked calls, and how many of the
/// demo's agents are resident or asleep.
fn start_sampler(
    c: Client,
    template: String,
    t0: Instant,
) -> (Arc<Mutex<Vec<Sample>>>, tokio::task::JoinHandle<()>) {
    let samples = Arc::new(Mutex::new(Vec::new()));
    let out = samples.clone();
    let task = tokio::spawn(async move {
        loop {
            if let (Ok(w), Ok(list)) = (c.workers().await, c.sandboxes(None).await) {
                let mine = list.iter().filter(|s| s.template == template);
                let (mut resident, mut asleep) = (0, 0);
                for s in mine {
                    if s.tier == "running" || s.tier == "frozen" {
                        resident += 1;
                    } else {
                        asleep += 1;
                    }
                }
                out.lock().unwrap_or_else(|p| p.into_inner()).push(Sample {
                    t_s: t0.elapsed().as_secs_f64(),
                    resident_bytes: w.resident_memory_bytes,
                    busy_workers: w.busy,
                    resident,
                    asleep,
                    parked_calls: w.parked_calls,
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });
    (samples, task)
}

/// Sums a Prometheus counter's samples by one label's value.
fn counter_by_label(metrics: &str, name: &str, label: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let prefix = format!("{name}{{");
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix(&prefix) else {
            continue;
        };
        let Some((labels, value)) = rest.split_once('}') else {
            continue;
        };
        let key = labels.split(',').find_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            (k.trim() == label).then(|| v.trim().trim_matches('"').to_string())
        });
        if let (Some(key), Ok(v)) = (key, value.trim().parse::<f64>()) {
            *out.entry(key).or_insert(0.0) += v;
        }
    }
    out
}

/// One call to an agent: pokes its main process through the FIFOs and reads back its counter
/// and its log's line count. Returns (tier it was in, latency ms, counter, log lines, error).
async fn call_agent(c: &Client, id: &str, round: usize) -> anyhow::Result<(String, f64, u64, u64)> {
    let tier = c.sandbox(id).await?.tier;
    let t = Instant::now();
    let r = c
        .exec(
            id,
            &ExecBody {
                cmd: vec![
                    "sh".into(),
                    "-c".into(),
                    format!(
                        "echo round{round} > /tmp/in && cat /tmp/out && wc -l < /data/calls.log"
                    ),
                ],
                timeout_ms: Some(30_000),
                ..Default::default()
            },
        )
        .await?;
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    if r.exit_code != Some(0) {
        bail!("exit {:?}: {}", r.exit_code, r.stderr.trim());
    }
    let mut lines = r.stdout.lines();
    let counter: u64 = lines
        .next()
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let logged: u64 = lines
        .next()
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or(0);
    Ok((tier, ms, counter, logged))
}

pub async fn run(args: DemoArgs) -> anyhow::Result<i32> {
    let (_daemon, c) = match &args.url {
        Some(url) => {
            let token = match &args.token {
                Some(t) => t.clone(),
                None => std::fs::read_to_string(
                    crate::daemon::default_data_dir().join(crate::daemon::TOKEN_FILE),
                )
                .context("no token: pass --token or set TORPOR_TOKEN")?
                .trim()
                .to_string(),
            };
            (None, Client::new(url, &token))
        }
        None => {
            eprintln!("demo: starting a daemon in a temporary directory ...");
            let (d, c) = start_daemon().await?;
            (Some(d), c)
        }
    };
    if args.agents == 0 || args.rounds == 0 {
        bail!("--agents and --rounds must be at least 1");
    }
    let metrics_before = c.metrics().await.unwrap_or_default();
    let tpl_name = format!("demo-agent-{:04x}", rand::random::<u16>());
    eprintln!("demo: building template {tpl_name} (boot + golden snapshot) ...");
    let t = Instant::now();
    c.create_template(&TemplateSpec {
        name: TemplateName::new(&tpl_name)?,
        source: TemplateSource::Host,
        command: vec!["python3".into(), "-u".into(), "-c".into(), AGENT.into()],
        env: BTreeMap::new(),
        cwd: None,
        limits: Limits {
            memory_mib: 256,
            cpus: 1.0,
            pids: 64,
        },
        idle: IdlePolicy {
            freeze_after_s: Some(1.0),
            park_after_s: Some(args.idle_s * 0.6),
            suspend_after_s: None,
        },
        warmup_ms: 300,
        gpu: None,
        network: None,
    })
    .await?;
    let template_s = t.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let (samples, sampler) = start_sampler(c.clone(), tpl_name.clone(), t0);

    let mut ids = Vec::new();
    let mut create_ms = Vec::new();
    for _ in 0..args.agents {
        let t = Instant::now();
        let s = c
            .create_sandbox(&CreateSandboxBody {
                template: tpl_name.clone(),
                ..Default::default()
            })
            .await?;
        create_ms.push(t.elapsed().as_secs_f64() * 1000.0);
        ids.push(s.id);
    }
    eprintln!(
        "demo: {} agents created; running {} bursts (every agent called at once)",
        ids.len(),
        args.rounds
    );

    let mut calls = vec![0u64; ids.len()];
    let mut wakes: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut failures = 0u64;
    for round in 0..args.rounds {
        if round > 0 {
            // Send every third agent to the snapshot store, so wakes come from each tier.
            for (i, id) in ids.iter().enumerate() {
                if i % 3 == 2 {
                    c.suspend(id, Some(Tier::Suspended)).await?;
                }
            }
        }
        // A burst: every agent at once, more than there are workers, so some calls park.
        let mut burst = tokio::task::JoinSet::new();
        for (i, id) in ids.iter().enumerate() {
            let (c, id) = (c.clone(), id.clone());
            burst.spawn(async move { (i, id.clone(), call_agent(&c, &id, round).await) });
        }
        while let Some(joined) = burst.join_next().await {
            let (i, id, result) = joined.context("a demo call panicked")?;
            calls[i] += 1;
            match result {
                Ok((tier, ms, counter, logged)) if counter == calls[i] && logged == calls[i] => {
                    wakes.entry(tier).or_default().push(ms);
                }
                Ok((_, _, counter, logged)) => {
                    failures += 1;
                    eprintln!(
                        "demo: agent {id} lost state: counter {counter}, log lines {logged}, expected {}",
                        calls[i]
                    );
                }
                Err(e) => {
                    failures += 1;
                    eprintln!("demo: call to agent {id} failed: {e}");
                }
            }
        }
        if round + 1 < args.rounds {
            eprintln!(
                "demo: burst {} done; idling {:.0} s so the ladder puts agents to sleep",
                round + 1,
                args.idle_s
            );
            tokio::time::sleep(Duration::from_secs_f64(args.idle_s)).await;
        }
    }
    // One last sample after the run.
    tokio::time::sleep(Duration::from_millis(300)).await;
    sampler.abort();
    let samples = std::mem::take(&mut *samples.lock().unwrap_or_else(|p| p.into_inner()));

    let all = c.sandboxes(None).await?;
    let mine: Vec<_> = all.iter().filter(|s| s.template == tpl_name).collect();
    let resident = mine
        .iter()
        .filter(|s| s.tier == "running" || s.tier == "frozen")
        .count();
    let metrics_after = c.metrics().await.unwrap_or_default();
    let delta = |name: &str, label: &str| {
        let before = counter_by_label(&metrics_before, name, label);
        let mut after = counter_by_label(&metrics_after, name, label);
        for (k, v) in after.iter_mut() {
            *v -= before.get(k).copied().unwrap_or(0.0);
        }
        after.retain(|_, v| *v > 0.0);
        after
    };
    let parked = delta("torpor_lot_wait_seconds_count", "outcome");
    let rejections = delta("torpor_lot_rejections_total", "reason");
    let evictions = delta("torpor_evictions_total", "reason");

    let mut tiers = vec![tier_row("golden (create)", create_ms.clone())];
    tiers.extend(wakes.into_iter().map(|(t, v)| tier_row(&t, v)));
    let report = Report::new(
        ids.len(),
        args.rounds,
        calls.iter().sum::<u64>(),
        failures,
        template_s,
        tiers,
        resident,
        samples,
        parked.values().sum::<f64>() as u64,
        rejections.into_iter().map(|(k, v)| (k, v as u64)).collect(),
        evictions.into_iter().map(|(k, v)| (k, v as u64)).collect(),
    );
    report.print_table();
    let summary = report.json();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        println!("{summary}");
    }
    if let Some(path) = &args.report {
        std::fs::write(path, report.html())
            .with_context(|| format!("cannot write the report to {}", path.display()))?;
        eprintln!("demo: report written to {}", path.display());
    }
    for id in &ids {
        let _ = c.delete_sandbox(id).await;
    }
    let _ = c.delete_template(&tpl_name).await;
    // Close the client's connections before the daemon is asked to stop.
    drop(c);
    drop(_daemon);
    Ok(if failures == 0 { 0 } else { 2 })
}
