//! What the benchmarks share: a real `torpor up` in a temporary directory, and percentiles.

#![allow(dead_code)] // each bench uses a part

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use torpor_api::Client;

pub const BIN: &str = env!("CARGO_BIN_EXE_torpor");

/// A daemon started for one benchmark; SIGTERM and wait on drop.
pub struct Daemon {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub client: Client,
    pub url: String,
}

impl Daemon {
    /// `torpor up` on a free loopback port with a fresh data directory and `args`.
    pub async fn start(args: &[&str]) -> Daemon {
        let dir = tempfile::Builder::new()
            .prefix("torpor-bench-")
            .tempdir()
            .expect("temp dir");
        let data = dir.path().join("data");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("free port")
            .local_addr()
            .expect("addr")
            .port();
        let child = Command::new(BIN)
            .args(["up", "--listen", &format!("127.0.0.1:{port}")])
            .args(args)
            .arg("--data-dir")
            .arg(&data)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("daemon.log")).expect("log file"))
            .spawn()
            .expect("torpor starts");
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(180);
        let client = loop {
            if let Ok(t) = std::fs::read_to_string(data.join("admin-token")) {
                let c = Client::new(&url, t.trim());
                if c.is_up().await {
                    break c;
                }
            }
            assert!(Instant::now() < deadline, "the daemon did not come up");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        Daemon {
            child,
            dir,
            client,
            url,
        }
    }

    pub fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// The p-th percentile (nearest rank) of `v`; NaN when empty.
pub fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[((p / 100.0) * (v.len() - 1) as f64).round() as usize]
}

/// Bytes used by a directory tree (allocated blocks).
pub fn disk_usage(p: &Path) -> u64 {
    let out = Command::new("du").arg("-sb").arg(p).output();
    out.ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}
