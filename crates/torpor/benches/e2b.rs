//! E2B-compatibility benchmark: the official `e2b` Python SDK against torpor, beside torpor's
//! own API in the same run (same daemon, same tenant, same Python process).
//!
//!   cargo bench -p torpor --bench e2b            (as root, runsc and the e2b SDK installed)
//!   TORPOR_BENCH_N=50 cargo bench -p torpor --bench e2b
//!   TORPOR_BENCH_ROWS=run cargo bench -p torpor --bench e2b    (only the `commands.run` rows)
//!
//! `TORPOR_BENCH_N` (default 30) is the rounds of the create and connect rows; the
//! `commands.run` rows take `TORPOR_BENCH_RUN_N` rounds (default the larger of N and 100: they
//! are cheap, and what they compare is a fraction of a millisecond in a spread of several).
//!
//! Rows: `commands.run("true")` vs native exec of the same `bash -l -c true`, and vs the same
//! in a sandbox whose agent answers a process's start at once (before protocol 7:
//! `TORPOR_AGENT_BENCH_SPAWNED_AT_ONCE` in its `envs`);
//! `Sandbox.connect` of a paused sandbox vs native resume of a parked one; `Sandbox.create` vs
//! native create. Beside them, in the same sandbox, the spawn floors of `bash -l -c true` with
//! torpor off the path (`torpor sandbox-agent -- --torpor-spawn-floor`): as root, as `user` the
//! way the agent's `Spawn` starts it, and as `user` through the standard library's fork
//! fallback. Prints a table and one JSON line (`{"bench":"e2b",...}`).

use std::process::{Command, Stdio};
use std::time::Duration;

use torpor_api::types::CreateTenantBody;
use torpor_api::Client;

const BIN: &str = env!("CARGO_BIN_EXE_torpor");
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b_sdk/bench.py");

#[tokio::main]
async fn main() {
    let n = std::env::var("TORPOR_BENCH_N").unwrap_or_else(|_| "30".into());
    let tmp = tempfile::Builder::new()
        .prefix("torpor-bench-e2b-")
        .tempdir()
        .unwrap();
    let data = tmp.path().join("data");
    let port = torpor_runtime::ports::loopback_port().expect("a free loopback port");
    let url = format!("http://127.0.0.1:{port}");
    let mut daemon = Command::new(BIN)
        .args([
            "up",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--workers",
            "8",
        ])
        .arg("--data-dir")
        .arg(&data)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(tmp.path().join("daemon.log")).unwrap())
        .spawn()
        .unwrap();
    let token_path = data.join("admin-token");
    let admin = loop {
        if let Ok(t) = std::fs::read_to_string(&token_path) {
            let c = Client::new(&url, t.trim());
            if c.is_up().await {
                break c;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let key = admin
        .create_tenant(&CreateTenantBody {
            name: "bench".into(),
            quotas: None,
        })
        .await
        .unwrap()
        .token;
    let status = Command::new("python3")
        .arg(SCRIPT)
        .env("E2B_API_KEY", &key)
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("TORPOR_URL", &url)
        .env("TORPOR_TOKEN", &key)
        .env("BENCH_N", &n)
        .env(
            "BENCH_RUN_N",
            std::env::var("TORPOR_BENCH_RUN_N").unwrap_or_default(),
        )
        .env(
            "BENCH_ROWS",
            std::env::var("TORPOR_BENCH_ROWS").unwrap_or_else(|_| "all".into()),
        )
        .status()
        .expect("python3 with the e2b SDK (scripts/deps.sh)");
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
    let _ = daemon.wait();
    assert!(status.success(), "bench script failed");
}
