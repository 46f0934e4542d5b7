//! What the benchmarks share: a real `torpor up` in a temporary directory, and percentiles.

#![allow(dead_code)] // each bench uses a part

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use torpor_api::Client;

#[path = "../../tests/common/host_copy.rs"]
mod host_copy;
#[allow(unused_imports)] // not every bench uses it
pub use host_copy::host_copy_without_idle;

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
        let port = torpor_runtime::ports::loopback_port().expect("a free loopback port");
        let url = format!("http://127.0.0.1:{port}");
        let child = spawn_up(dir.path(), &url, args);
        let client = wait_up(&dir.path().join("data"), &url).await;
        Daemon {
            child,
            dir,
            client,
            url,
        }
    }

    /// SIGKILLs the daemon (a crash), then starts it again on the same data directory and
    /// port with `args`; returns once it answers.
    pub async fn crash_and_restart(&mut self, args: &[&str]) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = spawn_up(self.dir.path(), &self.url, args);
        self.client = wait_up(&self.data(), &self.url).await;
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
        // `TORPOR_BENCH_KEEP_LOG=FILE` keeps the daemon's log (run with `TORPOR_LOG=info` for
        // one line per request, with its status and duration) past the temporary directory.
        if let Some(keep) = std::env::var_os("TORPOR_BENCH_KEEP_LOG") {
            let _ = std::fs::copy(self.dir.path().join("daemon.log"), keep);
        }
    }
}

/// `torpor up` on `url`'s port with `dir/data` and `args`, logging to `dir/daemon.log`.
fn spawn_up(dir: &Path, url: &str, args: &[&str]) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("daemon.log"))
        .expect("log file");
    Command::new(BIN)
        .args(["up", "--listen", url.trim_start_matches("http://")])
        .args(args)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("torpor starts")
}

/// A client once the daemon at `url` answers (its admin token read from `data`).
async fn wait_up(data: &Path, url: &str) -> Client {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if let Ok(t) = std::fs::read_to_string(data.join("admin-token")) {
            let c = Client::new(url, t.trim());
            if c.is_up().await {
                return c;
            }
        }
        assert!(Instant::now() < deadline, "the daemon did not come up");
        tokio::time::sleep(Duration::from_millis(100)).await;
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

/// A bare HTTP/1.1 client on one kept-alive loopback connection (blocking, no library): what a
/// call costs with as little of a client as possible in the figure, beside the same call through
/// [`Client`] (reqwest on tokio).
pub struct RawHttp {
    stream: std::net::TcpStream,
    host: String,
    token: String,
}

impl RawHttp {
    pub fn connect(url: &str, token: &str) -> RawHttp {
        let host = url.trim_start_matches("http://").to_string();
        let stream = std::net::TcpStream::connect(&host).expect("the daemon listens");
        stream.set_nodelay(true).expect("nodelay");
        RawHttp {
            stream,
            host,
            token: token.to_string(),
        }
    }

    /// One request; the status and body. The server must answer with a Content-Length.
    pub fn request(&mut self, method: &str, path: &str, body: Option<&[u8]>) -> (u16, Vec<u8>) {
        use std::io::{Read, Write};
        let body = body.unwrap_or_default();
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nhost: {}\r\nauthorization: Bearer {}\r\n",
            self.host, self.token
        )
        .into_bytes();
        if !body.is_empty() {
            req.extend_from_slice(
                format!(
                    "content-type: application/json\r\ncontent-length: {}\r\n",
                    body.len()
                )
                .as_bytes(),
            );
        }
        req.extend_from_slice(b"\r\n");
        req.extend_from_slice(body);
        self.stream.write_all(&req).expect("request sent");
        let mut buf = Vec::with_capacity(4096);
        let mut chunk = [0u8; 4096];
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let n = self.stream.read(&mut chunk).expect("response read");
            assert!(n > 0, "the daemon closed the connection");
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("a status line");
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("a content-length");
        while buf.len() < head_end + len {
            let n = self.stream.read(&mut chunk).expect("response read");
            assert!(n > 0, "the daemon closed the connection");
            buf.extend_from_slice(&chunk[..n]);
        }
        (status, buf[head_end..head_end + len].to_vec())
    }
}

/// `k` from the environment as a number, else `d`.
pub fn env_u64(k: &str, d: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

/// A sandbox of the built-in `host` template, made by `c`; its id.
pub async fn host_sandbox(c: &Client) -> String {
    c.create_sandbox(&torpor_api::types::CreateSandboxBody {
        template: "host".into(),
        ..Default::default()
    })
    .await
    .expect("sandbox")
    .id
}
