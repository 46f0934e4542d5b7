//! What the audit log's syncs cost a call: execs against two daemons side by side, one that
//! makes every audit batch durable at once (`--audit-commit-ms 0`, the writer before group
//! commit) and one with the default group commit (`--audit-commit-ms 50`). Rounds alternate
//! between them, so both see the same machine.
//!
//!   cargo bench -p torpor --bench audit                  (as root, runsc installed)
//!   TORPOR_AUDIT_ROUNDS=6 TORPOR_AUDIT_N=200 cargo bench -p torpor --bench audit
//!
//! Per mode: exec `true` latency one call at a time; the daemon's CPU time per exec (user +
//! system of the daemon process, from /proc); and with `TORPOR_AUDIT_CALLERS` (default 8)
//! callers at once, execs per second and CPU per exec. Prints a table and one JSON line
//! (`{"bench":"audit",...}`).

mod support;

use std::time::{Duration, Instant};

use serde_json::json;
use support::{env_u64, host_sandbox, pct, Daemon};
use torpor_api::types::ExecBody;
use torpor_api::Client;

/// User + system CPU seconds of process `pid` so far.
fn cpu_s(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("daemon's stat");
    // Fields after the command's closing parenthesis: state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    // SAFETY: sysconf with a valid name.
    ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

struct Mode {
    name: &'static str,
    commit_ms: &'static str,
    daemon: Daemon,
    sandbox: String,
    seq_ms: Vec<f64>,
    seq_cpu_s: f64,
    seq_calls: u64,
    conc_calls: u64,
    conc_s: f64,
    conc_cpu_s: f64,
}

fn true_cmd() -> ExecBody {
    ExecBody {
        cmd: vec!["true".into()],
        ..Default::default()
    }
}

async fn exec(c: &Client, id: &str) {
    let r = c.exec(id, &true_cmd()).await.expect("exec is served");
    assert_eq!(r.exit_code, Some(0));
}

#[tokio::main]
async fn main() {
    let rounds = env_u64("TORPOR_AUDIT_ROUNDS", 4);
    let n = env_u64("TORPOR_AUDIT_N", 200);
    let callers = env_u64("TORPOR_AUDIT_CALLERS", 8);
    let mut modes = Vec::new();
    for (name, commit_ms) in [("every batch (0 ms)", "0"), ("group commit (50 ms)", "50")] {
        let daemon = Daemon::start(&["--audit-commit-ms", commit_ms]).await;
        let sandbox = host_sandbox(&daemon.client).await;
        for _ in 0..20 {
            exec(&daemon.client, &sandbox).await; // warm-up
        }
        modes.push(Mode {
            name,
            commit_ms,
            daemon,
            sandbox,
            seq_ms: Vec::new(),
            seq_cpu_s: 0.0,
            seq_calls: 0,
            conc_calls: 0,
            conc_s: 0.0,
            conc_cpu_s: 0.0,
        });
    }
    for round in 0..rounds {
        // Alternate which mode goes first.
        let order: Vec<usize> = if round % 2 == 0 {
            vec![0, 1]
        } else {
            vec![1, 0]
        };
        for i in order {
            let m = &mut modes[i];
            let pid = m.daemon.child.id();
            let c0 = cpu_s(pid);
            for _ in 0..n {
                let t = Instant::now();
                exec(&m.daemon.client, &m.sandbox).await;
                m.seq_ms.push(t.elapsed().as_secs_f64() * 1e3);
            }
            m.seq_cpu_s += cpu_s(pid) - c0;
            m.seq_calls += n;
            // Callers at once.
            let c0 = cpu_s(pid);
            let t = Instant::now();
            let per = n.div_ceil(callers);
            let tasks: Vec<_> = (0..callers)
                .map(|_| {
                    let (c, id) = (m.daemon.client.clone(), m.sandbox.clone());
                    tokio::spawn(async move {
                        for _ in 0..per {
                            exec(&c, &id).await;
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.expect("caller");
            }
            m.conc_s += t.elapsed().as_secs_f64();
            m.conc_cpu_s += cpu_s(pid) - c0;
            m.conc_calls += per * callers;
        }
    }
    // Let the last batches land before the daemons stop.
    tokio::time::sleep(Duration::from_millis(200)).await;

    println!(
        "{:<22} {:>10} {:>10} {:>14} {:>12} {:>14}",
        "audit commit", "p50 ms", "p95 ms", "CPU/exec ms", "execs/s", "CPU/exec ms"
    );
    println!(
        "{:<22} {:>10} {:>10} {:>14} {:>12} {:>14}",
        "",
        "(1 caller)",
        "",
        "(1 caller)",
        format!("({callers})"),
        format!("({callers})")
    );
    let mut rows = Vec::new();
    for m in &mut modes {
        let (p50, p95) = (pct(&mut m.seq_ms, 50.0), pct(&mut m.seq_ms, 95.0));
        let cpu_seq = m.seq_cpu_s * 1e3 / m.seq_calls as f64;
        let rate = m.conc_calls as f64 / m.conc_s;
        let cpu_conc = m.conc_cpu_s * 1e3 / m.conc_calls as f64;
        println!(
            "{:<22} {:>10.2} {:>10.2} {:>14.3} {:>12.1} {:>14.3}",
            m.name, p50, p95, cpu_seq, rate, cpu_conc
        );
        rows.push(json!({
            "mode": m.name,
            "audit_commit_ms": m.commit_ms.parse::<u64>().unwrap(),
            "exec_p50_ms": p50,
            "exec_p95_ms": p95,
            "daemon_cpu_per_exec_ms": cpu_seq,
            "concurrent_execs_per_s": rate,
            "concurrent_daemon_cpu_per_exec_ms": cpu_conc,
            "calls": m.seq_calls + m.conc_calls,
        }));
    }
    let ratio = |k: &str| rows[1][k].as_f64().unwrap() / rows[0][k].as_f64().unwrap();
    println!(
        "group commit / every batch: daemon CPU per exec {:.2}x (1 caller), {:.2}x ({callers} callers); exec p50 {:.2}x; execs/s {:.2}x",
        ratio("daemon_cpu_per_exec_ms"),
        ratio("concurrent_daemon_cpu_per_exec_ms"),
        ratio("exec_p50_ms"),
        ratio("concurrent_execs_per_s"),
    );
    println!(
        "{}",
        json!({
            "bench": "audit",
            "rounds": rounds,
            "n": n,
            "callers": callers,
            "rows": rows,
            "cpu_per_exec_ratio": ratio("daemon_cpu_per_exec_ms"),
            "concurrent_cpu_per_exec_ratio": ratio("concurrent_daemon_cpu_per_exec_ms"),
        })
    );
}
