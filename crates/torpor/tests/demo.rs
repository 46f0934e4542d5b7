//! `torpor demo` through the real binary on real runsc: every state check passes, wakes come
//! from each sleeping tier, and the summary states the machine's limits (table and JSON);
//! bad sizes are refused before a daemon starts.

use std::process::{Command, Output};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_torpor");

fn demo(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("demo")
        .args(args)
        .env_remove("TORPOR_TOKEN")
        .output()
        .expect("run torpor demo")
}

/// The pretty-printed JSON summary that follows the table on stdout.
fn summary(stdout: &str) -> Value {
    let start = stdout
        .lines()
        .scan(0usize, |off, l| {
            let at = *off;
            *off += l.len() + 1;
            Some((at, l))
        })
        .find(|(_, l)| *l == "{")
        .map(|(at, _)| at)
        .unwrap_or_else(|| panic!("no JSON summary in:\n{stdout}"));
    serde_json::from_str(&stdout[start..]).expect("the summary is JSON")
}

#[test]
fn the_demo_checks_every_agent_and_states_the_machines_limits() {
    // Four agents on four workers, bursts of three: the second burst wakes one agent parked at
    // creation and one sent to the snapshot store, after the idle policy parked the first
    // burst's agents.
    let out = demo(&[
        "--agents",
        "4",
        "--workers",
        "4",
        "--burst",
        "3",
        "--rounds",
        "2",
        "--idle-s",
        "1",
        "--json",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "demo failed:\n{stdout}\n{stderr}"
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());

    // The table: the tiers, and the limits block.
    assert!(
        stdout.contains("torpor demo: 4 agents, 2 bursts, 18 state checks, 0 failures"),
        "{stdout}"
    );
    assert!(
        stdout.contains("this machine's limits, as this run measured them:"),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!(
            "  cores: {cores} (calls in flight per burst: {cores}, one per core)"
        )),
        "{stdout}"
    );
    assert!(
        stdout.contains("  sandboxes per worker: 1.0 (4 agents on 4 workers; a burst calls 3, the rest sleep on disk)"),
        "{stdout}"
    );
    for line in ["  memory: ", "  wakes/s: "] {
        assert!(
            stdout.lines().any(|l| l.starts_with(line)),
            "no {line:?} line:\n{stdout}"
        );
    }
    assert!(
        stdout.contains("the daemon's budget"),
        "the memory line names the daemon's budget:\n{stdout}"
    );

    // The JSON: every check passed, each sleeping tier woken, the limits.
    let s = summary(&stdout);
    assert_eq!(s["agents"], 4);
    assert_eq!(s["checks"], 18);
    assert_eq!(s["failures"], 0);
    let tiers: Vec<&str> = s["wake_by_tier"]
        .as_array()
        .expect("wake_by_tier")
        .iter()
        .map(|r| r["tier"].as_str().expect("tier"))
        .collect();
    for t in ["golden (create)", "parked", "suspended"] {
        assert!(tiers.contains(&t), "no {t:?} row in {tiers:?}");
    }
    let woken: u64 = s["wake_by_tier"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["tier"] != "golden (create)")
        .map(|r| r["calls"].as_u64().unwrap())
        .sum();
    assert_eq!(woken, 18, "every checked call is in a tier row");
    let m = &s["machine"];
    assert_eq!(m["cores"], cores);
    assert_eq!(m["workers"], 4);
    assert_eq!(m["agents"], 4);
    assert_eq!(m["burst"], 3);
    assert_eq!(m["in_flight"], cores);
    assert_eq!(m["sandboxes_per_worker"], 1.0);
    assert_eq!(m["short_bursts"], 0, "the idle policy freed the workers");
    assert!(m["sleeping_wakes"].as_u64().unwrap() >= 2, "{m}");
    for k in [
        "memory_bytes",
        "memory_budget_bytes",
        "per_sandbox_bytes",
        "resident_sandboxes_fit",
    ] {
        assert!(m[k].as_u64().unwrap_or(0) > 0, "{k} in {m}");
    }
    for k in [
        "wakes_per_s",
        "wake_p50_ms",
        "park_p50_ms",
        "wakes_per_s_evicting",
    ] {
        assert!(m[k].as_f64().unwrap_or(0.0) > 0.0, "{k} in {m}");
    }
}

#[test]
fn the_demo_refuses_zero_sizes_before_starting_a_daemon() {
    for (flag, msg) in [
        ("--agents", "--agents and --rounds must be at least 1"),
        ("--rounds", "--agents and --rounds must be at least 1"),
        (
            "--workers",
            "--workers, --burst and --in-flight must be at least 1",
        ),
        (
            "--burst",
            "--workers, --burst and --in-flight must be at least 1",
        ),
        (
            "--in-flight",
            "--workers, --burst and --in-flight must be at least 1",
        ),
    ] {
        let out = demo(&[flag, "0"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{flag} 0: {stderr}");
        assert!(stderr.contains(msg), "{flag} 0: {stderr}");
        assert!(
            !stderr.contains("starting a daemon"),
            "{flag} 0 started a daemon: {stderr}"
        );
    }
}
