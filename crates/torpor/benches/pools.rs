//! Pool benchmark: how fast an event-driven pool reacts, against real Redis and runsc agents.
//!
//!   cargo bench -p torpor --bench pools                 (as root; redis-server installed)
//!   TORPOR_BENCH_N=30 TORPOR_BENCH_AGENTS=50 cargo bench -p torpor --bench pools
//!
//! Rows:
//!
//! | row | what is timed |
//! |---|---|
//! | first message, push | LPUSH into the empty queue of a pool at zero (agents Suspended) until the handler runs in an agent; the pool polls only every 30 s, so only the push watch can wake it |
//! | first message, polling 1 s | the same with `push: false` and torpor's default 1 s polling |
//! | first message, push, HTTP dispatch | as the push row, with `dispatch.http`: torpor POSTs the message to a server in the agent (woken through the ingress path) |
//! | KEDA default, anchor | KEDA's 30 s polling interval alone: uniform wait in [0, 30 s] before any pod even starts (computed, not run: no Kubernetes here) |
//! | 0 -> N agents | LPUSH of N messages into a pool of max N at zero until N handlers run at once, each in its own new agent |
//!
//! The handler writes the time it starts (host clock, shared with gVisor) to its agent's
//! /tmp/done.log; the logs are read back after the run. Prints a table and one JSON line
//! (`{"bench":"pools",...}`).

#[path = "../tests/common/brokers.rs"]
mod brokers;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use torpor_api::Client;
use torpor_control::pools::PoolStatus;

const BIN: &str = env!("CARGO_BIN_EXE_torpor");
/// An HTTP agent (the template's main process, on 8080): logs "<message> <start time>" for each
/// POST and answers 200.
const HTTP_AGENT: &str = "import http.server, time\nclass H(http.server.BaseHTTPRequestHandler):\n    protocol_version = 'HTTP/1.1'\n    def do_POST(self):\n        t = time.time()\n        m = self.rfile.read(int(self.headers.get('Content-Length', '0'))).decode()\n        open('/tmp/done.log', 'a').write('%s %.6f\\n' % (m, t))\n        self.send_response(200)\n        self.send_header('Content-Length', '0')\n        self.end_headers()\n    def log_message(self, *a):\n        pass\nhttp.server.ThreadingHTTPServer(('0.0.0.0', 8080), H).serve_forever()\n";

/// Logs "<message> <start time>" and, for `hold:S` messages, stays busy S seconds.
const HANDLER: &str = "import sys, time\nt = time.time()\nm = sys.stdin.read()\nopen('/tmp/done.log', 'a').write('%s %.6f\\n' % (m, t))\nif m.startswith('hold:'): time.sleep(float(m.split(':')[1]))\n";

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn pct(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[((p / 100.0) * (v.len() - 1) as f64).round() as usize]
}

async fn wait_pool(c: &Client, name: &str, within: Duration, ok: impl Fn(&PoolStatus) -> bool) {
    let deadline = Instant::now() + within;
    loop {
        let p = c.pool(name).await.unwrap();
        if ok(&p) {
            return;
        }
        assert!(Instant::now() < deadline, "pool {name} stuck: {p:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// (message, start time) from every agent's log.
async fn starts(c: &Client, name: &str) -> Vec<(String, f64, String)> {
    let p = c.pool(name).await.unwrap();
    let mut out = Vec::new();
    for id in &p.sandboxes {
        if let Ok(b) = c.read_file(id.as_str(), "/tmp/done.log").await {
            for l in String::from_utf8_lossy(&b).lines() {
                if let Some((m, t)) = l.rsplit_once(' ') {
                    out.push((m.to_string(), t.parse().unwrap(), id.to_string()));
                }
            }
        }
    }
    out
}

async fn first_message_latencies(
    c: &Client,
    con: &mut redis::aio::MultiplexedConnection,
    redis_url: &str,
    name: &str,
    push: bool,
    n: usize,
    http: bool,
) -> Vec<f64> {
    let (template, dispatch) = if http {
        (
            "http-agent",
            serde_json::json!({"http": {"port": 8080, "path": "/"}}),
        )
    } else {
        (
            "host",
            serde_json::json!({"command": ["python3", "-c", HANDLER]}),
        )
    };
    c.create_pool(&serde_json::json!({
        "name": name, "template": template, "max": 1, "target": 1, "cooldown_s": 0,
        "poll_interval_ms": if push { 30_000 } else { 1_000 }, "push": push,
        "triggers": [{"type": "redis-list", "url": redis_url, "key": name}],
        "dispatch": dispatch,
    }))
    .await
    .unwrap();
    let mut sent = Vec::new();
    // One warm-up round makes the agent (create) and suspends it: every timed round is a wake
    // from Suspended, the state a pool at zero is in.
    for i in 0..=n {
        wait_pool(c, name, Duration::from_secs(120), |p| {
            p.running == 0 && p.starting == 0 && p.draining == 0
        })
        .await;
        // Let a 1 s poller's phase be random against the message.
        tokio::time::sleep(Duration::from_millis(300 + (i as u64 * 137) % 700)).await;
        let msg = format!("m{i}");
        let t = now_s();
        let _: i64 = redis::cmd("LPUSH")
            .arg(name)
            .arg(&msg)
            .query_async(con)
            .await
            .unwrap();
        sent.push((msg, t));
        wait_pool(c, name, Duration::from_secs(120), |p| {
            p.processed == i as u64 + 1
        })
        .await;
    }
    let got = starts(c, name).await;
    let mut lat = Vec::new();
    for (msg, t0) in sent.iter().skip(1) {
        let (_, t1, _) = got
            .iter()
            .find(|(m, _, _)| m == msg)
            .unwrap_or_else(|| panic!("{msg} not in any agent's log"));
        lat.push((t1 - t0) * 1000.0);
    }
    c.delete_pool(name).await.unwrap();
    lat
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::var("TORPOR_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let agents: usize = std::env::var("TORPOR_BENCH_AGENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let redis = brokers::Redis::start();
    let tmp = tempfile::Builder::new()
        .prefix("torpor-bench-pools-")
        .tempdir()
        .unwrap();
    let data = tmp.path().join("data");
    let port = brokers::free_port();
    let mut daemon = Command::new(BIN)
        .args(["up", "--listen", &format!("127.0.0.1:{port}")])
        .args([
            "--workers",
            &(agents + 4).to_string(),
            "--memory-budget",
            "64G",
        ])
        .arg("--data-dir")
        .arg(&data)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(tmp.path().join("daemon.log")).unwrap())
        .spawn()
        .unwrap();
    let token_path = data.join("admin-token");
    let c = loop {
        if let Ok(t) = std::fs::read_to_string(&token_path) {
            let c = Client::new(&format!("http://127.0.0.1:{port}"), t.trim());
            if c.is_up().await {
                break c;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut con = redis.conn().await;
    let url = redis.url();

    c.create_template(&torpor_api::types::TemplateSpec {
        name: torpor_core::TemplateName::new("http-agent").unwrap(),
        source: torpor_core::TemplateSource::Host,
        command: vec!["python3".into(), "-c".into(), HTTP_AGENT.into()],
        env: Default::default(),
        cwd: None,
        limits: torpor_core::Limits {
            memory_mib: 256,
            cpus: 1.0,
            pids: 64,
        },
        idle: torpor_core::IdlePolicy {
            freeze_after_s: None,
            park_after_s: None,
            suspend_after_s: None,
        },
        warmup_ms: 500,
        gpu: None,
        network: Some(serde_json::from_value(serde_json::json!({"allow": []})).unwrap()),
    })
    .await
    .unwrap();
    let push = first_message_latencies(&c, &mut con, &url, "push", true, n, false).await;
    let poll = first_message_latencies(&c, &mut con, &url, "poll", false, n, false).await;
    let http = first_message_latencies(&c, &mut con, &url, "httppush", true, n, true).await;
    // KEDA's anchor: a uniform wait in [0, 30 s] before it even asks for a pod.
    let keda: Vec<f64> = (0..1000)
        .map(|i| 30_000.0 * (i as f64 + 0.5) / 1000.0)
        .collect();

    // 0 -> N agents: N messages that each hold an agent long enough for all N to be busy.
    c.create_pool(&serde_json::json!({
        "name": "burst", "template": "host", "max": agents, "target": 1, "cooldown_s": 0,
        "poll_interval_ms": 1000,
        "triggers": [{"type": "redis-list", "url": url, "key": "burst"}],
        "dispatch": {"command": ["python3", "-c", HANDLER]},
    }))
    .await
    .unwrap();
    let hold = 90;
    let t0 = now_s();
    let mut cmd = redis::cmd("LPUSH");
    cmd.arg("burst");
    for i in 0..agents {
        cmd.arg(format!("hold:{hold}:{i}"));
    }
    let _: i64 = cmd.query_async(&mut con).await.unwrap();
    wait_pool(&c, "burst", Duration::from_secs(600), |p| {
        p.processed == agents as u64
    })
    .await;
    let burst = starts(&c, "burst").await;
    let distinct: std::collections::BTreeSet<_> =
        burst.iter().map(|(_, _, id)| id.clone()).collect();
    let mut burst_starts: Vec<f64> = burst.iter().map(|(_, t, _)| (t - t0) * 1000.0).collect();
    burst_starts.sort_by(f64::total_cmp);
    let all_ms = burst_starts.last().copied().unwrap_or(f64::NAN);
    let first_ms = burst_starts.first().copied().unwrap_or(f64::NAN);
    c.delete_pool("burst").await.unwrap();

    println!();
    println!("| row | n | p50 ms | p95 ms | p99 ms | max ms | vs KEDA 30 s anchor p95 |");
    println!("|---|---|---|---|---|---|---|");
    let keda_p95 = pct(&keda, 95.0);
    for (name, v) in [
        ("first message, push (wake from Suspended)", &push),
        ("first message, polling 1 s (wake from Suspended)", &poll),
        (
            "first message, push, HTTP dispatch (wake from Suspended)",
            &http,
        ),
        ("KEDA default 30 s polling, wait alone (computed)", &keda),
    ] {
        println!(
            "| {name} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.3} |",
            v.len(),
            pct(v, 50.0),
            pct(v, 95.0),
            pct(v, 99.0),
            pct(v, 100.0),
            pct(v, 95.0) / keda_p95
        );
    }
    println!(
        "| 0 -> {agents} agents: first handler running / all {agents} running | {} distinct agents | {:.0} | | | {:.0} | |",
        distinct.len(),
        first_ms,
        all_ms
    );
    println!(
        "{}",
        serde_json::json!({
            "bench": "pools",
            "n": n,
            "push_ms": {"p50": pct(&push, 50.0), "p95": pct(&push, 95.0), "p99": pct(&push, 99.0), "max": pct(&push, 100.0)},
            "polling_1s_ms": {"p50": pct(&poll, 50.0), "p95": pct(&poll, 95.0), "p99": pct(&poll, 99.0), "max": pct(&poll, 100.0)},
            "push_http_ms": {"p50": pct(&http, 50.0), "p95": pct(&http, 95.0), "p99": pct(&http, 99.0), "max": pct(&http, 100.0)},
            "keda_30s_anchor_ms": {"p50": pct(&keda, 50.0), "p95": keda_p95},
            "push_p95_over_keda_p95": pct(&push, 95.0) / keda_p95,
            "polling_p95_over_keda_p95": pct(&poll, 95.0) / keda_p95,
            "burst": {"agents": agents, "distinct_agents": distinct.len(), "first_running_ms": first_ms, "all_running_ms": all_ms},
        })
    );
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
    let _ = daemon.wait();
}
