//! `torpor demo`: a fleet of agents driven through sleep and wake, with every agent's state
//! checked after every wake.
//!
//! Each agent is a Python process (the template's main process) that holds a counter and a
//! buffer of random bytes in memory and appends every call to a file. A call goes through a FIFO
//! pair inside the sandbox, so it reaches that very process: if its memory or files were lost in
//! a checkpoint, the counter, the buffer's checksum or the file's line count would be wrong.
//! Between bursts the fleet idles; the idle policy freezes and parks agents, and some are sent to
//! the snapshot store explicitly, so wakes come from every tier.
//!
//! The defaults come from the machine, so that every latency the summary shows is the cost of
//! its tier and not of a queue: two workers per core (as memory allows), a burst calls as many
//! agents as there are workers (the other half of the fleet sleeps), one call in flight per core
//! (a restore is CPU-bound: more at once only queue on the cores), and a burst starts once the
//! idle policy has freed the workers of the last one. Each burst wakes its agents, calls them
//! again while they run, and once more after a pause long enough for them to freeze. The summary
//! ends with the machine's limits it measured: cores, memory per sandbox, sandboxes per worker
//! and wakes per second.

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
    /// Number of agents (default: twice the agents a burst calls, so half the fleet sleeps).
    #[arg(long)]
    agents: Option<usize>,
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
    /// Workers of the daemon the demo starts: sandboxes resident at once (default: two per
    /// core, as memory allows). With --url, the daemon's own.
    #[arg(long)]
    workers: Option<usize>,
    /// Agents called in each burst (default: the workers, at most two per core). More than the
    /// workers makes calls wait for a worker (parked calls) and puts checkpoints on the path.
    #[arg(long)]
    burst: Option<usize>,
    /// Calls in flight at once during a burst (default: one per core; more only queue restores
    /// on the cores and the latencies show the queue).
    #[arg(long)]
    in_flight: Option<usize>,
}

/// Seconds without a call before an agent freezes (the template's idle policy).
const FREEZE_AFTER_S: f64 = 1.0;
/// The pause before a burst's last calls: past the freeze, with a tick or two to spare.
const PAUSE_S: f64 = 2.0;
/// The template's memory limit, and what the default workers are sized by.
const AGENT_LIMIT_MIB: u64 = 256;

/// What the demo knows of the machine it runs on.
struct Machine {
    cores: usize,
    memory_bytes: Option<u64>,
}

impl Machine {
    fn detect() -> Machine {
        let memory_bytes = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
                .map(|kib| kib * 1024)
        });
        Machine {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            memory_bytes,
        }
    }

    /// Workers for the demo's own daemon: two per core (one sandbox waking while another
    /// serves), no more than 70% of memory holds at the agent's limit; at least 2.
    fn default_workers(&self) -> usize {
        let by_memory = self.memory_bytes.map_or(usize::MAX, |m| {
            (m / 10 * 7 / (AGENT_LIMIT_MIB << 20)) as usize
        });
        (2 * self.cores).min(by_memory).max(2)
    }
}

/// The run's shape: what the defaults came to.
#[derive(Clone, Copy)]
struct Plan {
    workers: usize,
    agents: usize,
    burst: usize,
    in_flight: usize,
}

impl Plan {
    fn new(args: &DemoArgs, m: &Machine, workers: usize) -> anyhow::Result<Plan> {
        let burst = args.burst.unwrap_or(workers.min(2 * m.cores).max(1));
        let agents = args.agents.unwrap_or(2 * burst);
        let in_flight = args.in_flight.unwrap_or(m.cores);
        // Zero sizes given as flags are refused before a daemon starts; a daemon without
        // workers is what is left.
        if workers == 0 || agents == 0 || burst == 0 || in_flight == 0 {
            bail!("the daemon has no workers (or a size is 0)");
        }
        Ok(Plan {
            workers,
            agents,
            burst: burst.min(agents),
            in_flight,
        })
    }

    /// The agents burst `round` calls: `burst` of them, the next ones each round; the first
    /// burst calls the last agents created (still resident).
    fn burst_agents(&self, round: usize) -> Vec<usize> {
        let start = (self.agents - self.burst) + round * self.burst;
        (0..self.burst).map(|j| (start + j) % self.agents).collect()
    }
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

async fn start_daemon(workers: usize) -> anyhow::Result<(Daemon, Client)> {
    let dir = tempfile::Builder::new().prefix("torpor-demo-").tempdir()?;
    let port = torpor_runtime::ports::loopback_port()?;
    let exe = std::env::current_exe()?;
    let log = std::fs::File::create(dir.path().join("daemon.log"))?;
    let child = std::process::Command::new(exe)
        .args([
            "up",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--workers",
            &workers.to_string(),
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
                    // Shell builtins only: one spawn per call (each spawn costs a few ms of
                    // syscalls through gVisor, and the call would measure them, not the tier).
                    format!(
                        "echo round{round} > /tmp/in && read -r out < /tmp/out && n=0 && \
                         while read -r l; do n=$((n+1)); done < /data/calls.log && \
                         echo \"$out\" && echo $n"
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

/// One call of a burst, as the burst saw it.
struct Outcome {
    agent: usize,
    result: anyhow::Result<(String, f64, u64, u64)>,
}

/// Calls each of `agents`, at most `in_flight` at once. Returns the outcomes and the seconds
/// the burst took.
async fn burst(
    c: &Client,
    ids: &[String],
    agents: &[usize],
    in_flight: usize,
    round: usize,
) -> anyhow::Result<(Vec<Outcome>, f64)> {
    let gate = Arc::new(tokio::sync::Semaphore::new(in_flight));
    let t = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for &i in agents {
        let (c, id, gate) = (c.clone(), ids[i].clone(), gate.clone());
        set.spawn(async move {
            let _permit = gate.acquire_owned().await;
            Outcome {
                agent: i,
                result: call_agent(&c, &id, round).await,
            }
        });
    }
    let mut out = Vec::new();
    while let Some(joined) = set.join_next().await {
        out.push(joined.context("a demo call panicked")?);
    }
    Ok((out, t.elapsed().as_secs_f64()))
}

/// Waits (at most `limit`) until `want` workers are free: the idle policy parking the last
/// burst's agents. Returns the seconds waited, and whether they came free.
async fn wait_for_free_workers(c: &Client, want: usize, limit: Duration) -> (f64, bool) {
    let t = Instant::now();
    loop {
        if let Ok(w) = c.workers().await {
            if w.free >= want.min(w.total) {
                return (t.elapsed().as_secs_f64(), true);
            }
        }
        if t.elapsed() > limit {
            return (t.elapsed().as_secs_f64(), false);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Memory of one resident agent: the median over samples of resident bytes per busy worker
/// (as the report computes it).
fn per_sandbox_bytes(samples: &[Sample]) -> u64 {
    let mut per: Vec<u64> = samples
        .iter()
        .filter(|s| s.busy_workers > 0 && s.resident_bytes > 0)
        .map(|s| s.resident_bytes / s.busy_workers as u64)
        .collect();
    per.sort_unstable();
    per.get(per.len() / 2).copied().unwrap_or(0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(&v, 50.0)
}

/// The machine's limits as this run measured or derived them.
struct MachineLimits {
    cores: usize,
    memory_bytes: Option<u64>,
    memory_budget_bytes: Option<u64>,
    per_sandbox_bytes: u64,
    plan: Plan,
    /// Wakes from Parked/Suspended per second, with free workers, `in_flight` at once.
    wakes_per_s: f64,
    sleeping_wakes: usize,
    /// Median wake (+ call) from Parked/Suspended, and median explicit park (a checkpoint).
    wake_p50_ms: f64,
    park_p50_ms: f64,
    /// Seconds the bursts waited for the idle policy to free workers; bursts that started
    /// without all the workers they needed.
    waited_s: f64,
    short_bursts: usize,
}

impl MachineLimits {
    /// Resident sandboxes the daemon's memory budget holds at the measured size.
    fn resident_fit(&self) -> Option<u64> {
        (self.per_sandbox_bytes > 0)
            .then_some(())
            .and(self.memory_budget_bytes)
            .map(|b| b / self.per_sandbox_bytes)
    }

    /// Wakes per second when each wake must first park another agent for its worker: the
    /// cores spend a checkpoint and a restore on it (derived).
    fn evicting_wakes_per_s(&self) -> f64 {
        let pair_s = (self.wake_p50_ms + self.park_p50_ms) / 1000.0;
        if pair_s.is_finite() && pair_s > 0.0 {
            self.plan.in_flight.min(self.cores) as f64 / pair_s
        } else {
            f64::NAN
        }
    }

    fn sandboxes_per_worker(&self) -> f64 {
        self.plan.agents as f64 / self.plan.workers as f64
    }

    fn lines(&self) -> Vec<String> {
        let gib = |b: u64| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64);
        let mib = |b: u64| format!("{:.0} MiB", b as f64 / (1u64 << 20) as f64);
        let p = &self.plan;
        let mut out = vec![format!(
            "cores: {} (calls in flight per burst: {}{})",
            self.cores,
            p.in_flight,
            if p.in_flight == self.cores {
                ", one per core"
            } else {
                ""
            }
        )];
        let mut mem = format!(
            "memory: {}; one resident sandbox {}",
            self.memory_bytes.map_or("unknown".into(), gib),
            mib(self.per_sandbox_bytes)
        );
        if let (Some(b), Some(n)) = (self.memory_budget_bytes, self.resident_fit()) {
            mem.push_str(&format!(
                "; the daemon's budget {} holds ~{n} resident",
                gib(b)
            ));
        }
        out.push(mem);
        out.push(format!(
            "sandboxes per worker: {:.1} ({} agents on {} workers; a burst calls {}, the rest sleep on disk)",
            self.sandboxes_per_worker(),
            p.agents,
            p.workers,
            p.burst
        ));
        out.push(format!(
            "wakes/s: {:.1} measured ({} wakes from Parked/Suspended, free workers, wake + call p50 {:.0} ms); ~{:.1} derived when each wake must first park another agent (park p50 {:.0} ms)",
            self.wakes_per_s,
            self.sleeping_wakes,
            self.wake_p50_ms,
            self.evicting_wakes_per_s(),
            self.park_p50_ms
        ));
        if p.burst > p.workers {
            out.push(format!(
                "note: a burst of {} on {} workers: calls wait for a worker, and the latencies include checkpoints",
                p.burst, p.workers
            ));
        }
        if self.short_bursts > 0 {
            out.push(format!(
                "note: {} burst(s) started before the idle policy had freed their workers (waited {:.0} s in all)",
                self.short_bursts, self.waited_s
            ));
        }
        out
    }

    fn json(&self) -> serde_json::Value {
        let finite = |v: f64| v.is_finite().then_some(v);
        serde_json::json!({
            "cores": self.cores,
            "memory_bytes": self.memory_bytes,
            "memory_budget_bytes": self.memory_budget_bytes,
            "per_sandbox_bytes": self.per_sandbox_bytes,
            "resident_sandboxes_fit": self.resident_fit(),
            "workers": self.plan.workers,
            "agents": self.plan.agents,
            "burst": self.plan.burst,
            "in_flight": self.plan.in_flight,
            "sandboxes_per_worker": self.sandboxes_per_worker(),
            "wakes_per_s": finite(self.wakes_per_s),
            "sleeping_wakes": self.sleeping_wakes,
            "wake_p50_ms": finite(self.wake_p50_ms),
            "park_p50_ms": finite(self.park_p50_ms),
            "wakes_per_s_evicting": finite(self.evicting_wakes_per_s()),
            "waited_for_workers_s": self.waited_s,
            "short_bursts": self.short_bursts,
        })
    }

    fn html(&self) -> String {
        let mut h = String::from("<h2>This machine's limits</h2><ul>");
        for l in self.lines() {
            h.push_str("<li>");
            for ch in l.chars() {
                match ch {
                    '<' => h.push_str("&lt;"),
                    '>' => h.push_str("&gt;"),
                    '&' => h.push_str("&amp;"),
                    c => h.push(c),
                }
            }
            h.push_str("</li>");
        }
        h.push_str("</ul>");
        h
    }
}

pub async fn run(args: DemoArgs) -> anyhow::Result<i32> {
    if args.agents == Some(0) || args.rounds == 0 {
        bail!("--agents and --rounds must be at least 1");
    }
    if [args.workers, args.burst, args.in_flight].contains(&Some(0)) {
        bail!("--workers, --burst and --in-flight must be at least 1");
    }
    let machine = Machine::detect();
    let (_daemon, c, workers) = match &args.url {
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
            let c = Client::new(url, &token);
            let total = c.workers().await?.total;
            if args.workers.is_some_and(|w| w != total) {
                eprintln!(
                    "demo: --workers applies to the daemon the demo starts; {url} has {total}"
                );
            }
            (None, c, total)
        }
        None => {
            let workers = args.workers.unwrap_or_else(|| machine.default_workers());
            eprintln!(
                "demo: starting a daemon with {workers} workers in a temporary directory ..."
            );
            let (d, c) = start_daemon(workers).await?;
            (Some(d), c, workers)
        }
    };
    let plan = Plan::new(&args, &machine, workers)?;
    eprintln!(
        "demo: {} cores, {} workers: {} agents, bursts of {}, {} calls in flight",
        machine.cores, plan.workers, plan.agents, plan.burst, plan.in_flight
    );
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
            memory_mib: AGENT_LIMIT_MIB,
            cpus: 1.0,
            pids: 64,
        },
        idle: IdlePolicy {
            freeze_after_s: Some(FREEZE_AFTER_S),
            // Past the pause before a burst's last calls, so those find their agent frozen.
            park_after_s: Some((args.idle_s * 0.6).max(PAUSE_S + 1.0)),
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

    // The fleet: the agents the first burst calls are created last and stay resident; the
    // others are parked as soon as they are made, so no create waits for a worker.
    let first = plan.burst_agents(0);
    let mut ids = Vec::new();
    let mut create_ms = Vec::new();
    let mut park_ms = Vec::new();
    for i in 0..plan.agents {
        let t = Instant::now();
        let s = c
            .create_sandbox(&CreateSandboxBody {
                template: tpl_name.clone(),
                ..Default::default()
            })
            .await?;
        create_ms.push(t.elapsed().as_secs_f64() * 1000.0);
        if !first.contains(&i) {
            let t = Instant::now();
            c.suspend(&s.id, Some(Tier::Parked)).await?;
            park_ms.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        ids.push(s.id);
    }
    eprintln!(
        "demo: {} agents created; running {} bursts of {} agents (each woken, called again, and called once more after {PAUSE_S:.0} s)",
        ids.len(),
        args.rounds,
        plan.burst
    );

    let mut calls = vec![0u64; ids.len()];
    let mut wakes: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut failures = 0u64;
    let (mut sleeping_wakes, mut sleeping_s) = (0usize, 0.0f64);
    let (mut waited_s, mut short_bursts) = (0.0f64, 0usize);
    for round in 0..args.rounds {
        let agents = plan.burst_agents(round);
        if round > 0 {
            // Send every third agent of this burst to the snapshot store, so wakes come from
            // each tier.
            for (j, &i) in agents.iter().enumerate() {
                if j % 3 == 2 {
                    c.suspend(&ids[i], Some(Tier::Suspended)).await?;
                }
            }
            // Start once the idle policy has parked the last burst's agents: a wake that has
            // to park another agent first pays for its checkpoint too.
            let need = agents.len().min(plan.workers);
            let (s, freed) = wait_for_free_workers(&c, need, Duration::from_secs(60)).await;
            waited_s += s;
            if !freed {
                short_bursts += 1;
            }
        }
        // The burst: wake each agent, call it again while it runs, and once more after a pause
        // (frozen by then).
        for step in 0..3 {
            if step == 2 {
                tokio::time::sleep(Duration::from_secs_f64(PAUSE_S)).await;
            }
            let (outcomes, secs) = burst(&c, &ids, &agents, plan.in_flight, round).await?;
            let mut asleep = 0;
            for Outcome { agent: i, result } in outcomes {
                let id = &ids[i];
                calls[i] += 1;
                match result {
                    Ok((tier, ms, counter, logged))
                        if counter == calls[i] && logged == calls[i] =>
                    {
                        if tier == "parked" || tier == "suspended" {
                            asleep += 1;
                        }
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
            if asleep > 0 {
                sleeping_wakes += asleep;
                sleeping_s += secs;
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
    let memory_budget_bytes = c.workers().await.ok().and_then(|w| w.memory_budget_bytes);

    let asleep_ms: Vec<f64> = ["parked", "suspended"]
        .iter()
        .filter_map(|t| wakes.get(*t))
        .flatten()
        .copied()
        .collect();
    let limits = MachineLimits {
        cores: machine.cores,
        memory_bytes: machine.memory_bytes,
        memory_budget_bytes,
        per_sandbox_bytes: per_sandbox_bytes(&samples),
        plan,
        wakes_per_s: if sleeping_s > 0.0 {
            sleeping_wakes as f64 / sleeping_s
        } else {
            f64::NAN
        },
        sleeping_wakes,
        wake_p50_ms: median(asleep_ms),
        park_p50_ms: median(park_ms),
        waited_s,
        short_bursts,
    };

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
    println!("this machine's limits, as this run measured them:");
    for l in limits.lines() {
        println!("  {l}");
    }
    let mut summary = report.json();
    if let Some(o) = summary.as_object_mut() {
        o.insert("machine".into(), limits.json());
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        println!("{summary}");
    }
    if let Some(path) = &args.report {
        let html = report.html().replacen(
            "<h2>Raw summary</h2>",
            &format!("{}<h2>Raw summary</h2>", limits.html()),
            1,
        );
        std::fs::write(path, html)
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        demo: DemoArgs,
    }

    fn args(flags: &[&str]) -> DemoArgs {
        Cli::parse_from(std::iter::once("demo").chain(flags.iter().copied())).demo
    }

    const GIB: u64 = 1 << 30;

    #[test]
    fn default_workers_are_two_per_core_as_memory_allows() {
        let m = |cores, gib| Machine {
            cores,
            memory_bytes: Some(gib * GIB),
        };
        assert_eq!(m(2, 23).default_workers(), 4);
        assert_eq!(m(16, 64).default_workers(), 32);
        // 70% of 2 GiB holds 5 agents at their 256 MiB limit.
        assert_eq!(m(16, 2).default_workers(), 5);
        assert_eq!(m(1, 1).default_workers(), 2, "never under 2");
        let unknown = Machine {
            cores: 3,
            memory_bytes: None,
        };
        assert_eq!(unknown.default_workers(), 6);
    }

    #[test]
    fn the_plan_on_a_two_core_machine() {
        let m = Machine {
            cores: 2,
            memory_bytes: Some(23 * GIB),
        };
        let p = Plan::new(&args(&[]), &m, m.default_workers()).unwrap();
        assert_eq!(
            (p.workers, p.agents, p.burst, p.in_flight),
            (4, 8, 4, 2),
            "4 workers, 8 agents, bursts of 4, one call in flight per core"
        );
        // A daemon of 64 workers (--url): bursts stay at two per core.
        let p = Plan::new(&args(&[]), &m, 64).unwrap();
        assert_eq!((p.workers, p.agents, p.burst, p.in_flight), (64, 8, 4, 2));
        // Flags win; a burst is never larger than the fleet.
        let p = Plan::new(
            &args(&["--agents", "3", "--burst", "5", "--in-flight", "7"]),
            &m,
            4,
        )
        .unwrap();
        assert_eq!((p.workers, p.agents, p.burst, p.in_flight), (4, 3, 3, 7));
        assert!(Plan::new(&args(&[]), &m, 0).is_err(), "no workers");
    }

    #[test]
    fn bursts_start_with_the_last_agents_created_and_rotate() {
        let p = |agents, burst| Plan {
            workers: 4,
            agents,
            burst,
            in_flight: 2,
        };
        let eight = p(8, 4);
        assert_eq!(eight.burst_agents(0), [4, 5, 6, 7]);
        assert_eq!(eight.burst_agents(1), [0, 1, 2, 3]);
        assert_eq!(eight.burst_agents(2), [4, 5, 6, 7]);
        let four = p(4, 3);
        assert_eq!(four.burst_agents(0), [1, 2, 3]);
        assert_eq!(four.burst_agents(1), [0, 1, 2]);
        assert_eq!(four.burst_agents(2), [3, 0, 1]);
        assert_eq!(p(2, 2).burst_agents(5), [0, 1]);
    }
}
