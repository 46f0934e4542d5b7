//! Test harness: starts the real `torpor` binary (`torpor up`) in a temporary data directory on
//! a free loopback port, with real runsc sandboxes, and talks to it through the real client.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use torpor_api::types::{CreateSandboxBody, ExecBody, ExecResult, TemplateSpec};
use torpor_api::Client;
use torpor_core::{IdlePolicy, Limits, TemplateName, TemplateSource};

mod host_copy;
#[allow(unused_imports)] // not every test uses it
pub use host_copy::host_copy_without_idle;

pub const BIN: &str = env!("CARGO_BIN_EXE_torpor");

pub struct Daemon {
    pub dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    pub port: u16,
    child: Option<Child>,
    pub extra_args: Vec<String>,
    /// Environment for the daemon beyond the test's own (e.g. AWS_* for an s3:// store).
    pub extra_env: Vec<(String, String)>,
}

/// A loopback port for a child process to listen on (outside the ephemeral range: see
/// `torpor_runtime::ports`).
fn free_port() -> u16 {
    torpor_runtime::ports::loopback_port().expect("a free loopback port")
}

impl Daemon {
    pub async fn start() -> Daemon {
        Self::start_with(&[]).await
    }

    pub async fn start_with(args: &[&str]) -> Daemon {
        Self::start_with_env(args, &[]).await
    }

    pub async fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Daemon {
        let tmp = tempfile::Builder::new()
            .prefix("torpor-test-")
            .tempdir()
            .unwrap();
        let mut d = Daemon {
            dir: tmp.path().to_path_buf(),
            _tmp: Some(tmp),
            port: free_port(),
            child: None,
            extra_args: args.iter().map(|s| s.to_string()).collect(),
            extra_env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        d.spawn().await;
        d
    }

    pub async fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("daemon.log"))
            .unwrap();
        let child = Command::new(BIN)
            .args(["up", "--listen", &format!("127.0.0.1:{}", self.port)])
            .arg("--data-dir")
            .arg(&self.dir)
            .args(if self.extra_args.iter().any(|a| a == "--workers") {
                &[][..]
            } else {
                &["--workers", "4"][..]
            })
            .args(["--tick-ms", "200"])
            .args(&self.extra_args)
            .env("TORPOR_LOG", "info")
            .envs(self.extra_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(c) = self.try_client() {
                if c.is_up().await {
                    return;
                }
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("daemon exited with {status}:\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "daemon not up:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn try_client(&self) -> Option<Client> {
        let token = std::fs::read_to_string(self.dir.join("admin-token")).ok()?;
        Some(Client::new(&self.url(), token.trim()))
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn client(&self) -> Client {
        self.try_client().expect("daemon wrote its token")
    }

    pub fn token(&self) -> String {
        std::fs::read_to_string(self.dir.join("admin-token"))
            .unwrap()
            .trim()
            .to_string()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    /// SIGTERM and wait: a graceful stop that checkpoints resident sandboxes.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let status = c.wait().unwrap();
            assert!(status.success(), "daemon exit {status}:\n{}", self.log());
        }
    }

    /// SIGQUIT and wait: a stop that leaves resident sandboxes running under their shims for
    /// the next start (live restore; an upgrade).
    pub fn quit(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGQUIT) };
            let status = c.wait().unwrap();
            assert!(status.success(), "daemon exit {status}:\n{}", self.log());
        }
    }

    /// SIGKILL: a crash.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // A failed test shows what the daemon complained about (CI keeps no data dirs).
            let log = self.log();
            let warned: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("WARN") || l.contains("ERROR"))
                .collect();
            let tail = &warned[warned.len().saturating_sub(40)..];
            eprintln!(
                "--- daemon warnings ({} of {}) ---\n{}",
                tail.len(),
                warned.len(),
                tail.join("\n")
            );
        }
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        // A crash test may leave containers behind; a fresh start reconciles them, but the
        // temporary directory goes away, so clean runsc's state for it here.
        let root = self.dir.join("runsc");
        if root.exists() {
            let out = Command::new("runsc")
                .arg(format!("--root={}", root.display()))
                .args(["list", "--quiet"])
                .output();
            if let Ok(out) = out {
                for id in String::from_utf8_lossy(&out.stdout).lines() {
                    let _ = Command::new("runsc")
                        .arg(format!("--root={}", root.display()))
                        .args(["delete", "--force", id.trim()])
                        .output();
                }
            }
        }
    }
}

/// A Python agent that holds state in memory and on disk, reached through a FIFO pair, so a call
/// talks to that very process: `call(..)` returns its in-memory counter and the lines it logged.
pub const AGENT: &str = r#"
import os, hashlib
os.makedirs("/data", exist_ok=True)
for p in ("/tmp/in", "/tmp/out"):
    if not os.path.exists(p): os.mkfifo(p)
blob = bytearray(os.urandom(4 << 20))
n = 0
while True:
    with open("/tmp/in") as f: cmd = f.read().strip()
    n += 1
    blob[n] ^= 1
    with open("/data/calls.log", "a") as log: log.write(f"{n} {cmd}\n")
    with open("/tmp/out", "w") as f: f.write(f"{n}\n")
"#;

pub fn agent_template(name: &str, idle: IdlePolicy) -> TemplateSpec {
    TemplateSpec {
        name: TemplateName::new(name).unwrap(),
        source: TemplateSource::Host,
        command: vec!["python3".into(), "-u".into(), "-c".into(), AGENT.into()],
        env: Default::default(),
        cwd: None,
        limits: Limits {
            memory_mib: 256,
            cpus: 1.0,
            pids: 64,
        },
        idle,
        warmup_ms: 300,
        gpu: None,
        network: None,
    }
}

/// [`agent_template`] whose agent says protocol `version` and acts as an agent of that version
/// (as one restored from an older torpor's snapshot).
pub fn older_agent_template(name: &str, idle: IdlePolicy, version: u32) -> TemplateSpec {
    let mut spec = agent_template(name, idle);
    spec.env = [(
        torpor_runtime::agent::TEST_AGENT_VERSION.to_string(),
        version.to_string(),
    )]
    .into();
    spec
}

pub fn no_idle() -> IdlePolicy {
    IdlePolicy {
        freeze_after_s: None,
        park_after_s: None,
        suspend_after_s: None,
    }
}

pub fn sh(cmd: &str) -> ExecBody {
    ExecBody {
        cmd: vec!["sh".into(), "-c".into(), cmd.into()],
        timeout_ms: Some(60_000),
        ..Default::default()
    }
}

/// Calls the agent's main process; returns (in-memory counter, lines in its log file).
pub async fn call_agent(c: &Client, id: &str, tag: &str) -> (u64, u64) {
    let r: ExecResult = c
        .exec(
            id,
            &sh(&format!(
                "echo {tag} > /tmp/in && cat /tmp/out && wc -l < /data/calls.log"
            )),
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(0), "agent call failed: {r:?}");
    let mut lines = r.stdout.lines();
    let n = lines.next().unwrap().trim().parse().unwrap();
    let logged = lines.next().unwrap().trim().parse().unwrap();
    (n, logged)
}

pub async fn create(c: &Client, template: &str) -> String {
    c.create_sandbox(&CreateSandboxBody {
        template: template.into(),
        ..Default::default()
    })
    .await
    .unwrap()
    .id
}

/// `POST {path}` (E2B's `/sandboxes` or `/v2/sandboxes`) with `key` as `X-API-KEY` and `body`:
/// (status, JSON body, `Null` when there is none).
pub async fn e2b_post_sandbox(
    d: &Daemon,
    key: &str,
    path: &str,
    body: serde_json::Value,
) -> (u16, serde_json::Value) {
    let r = reqwest::Client::new()
        .post(format!("{}{path}", d.url()))
        .header("X-API-KEY", key)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}

/// An E2B sandbox made through `POST /sandboxes` with `body`, which must answer 201: its JSON.
pub async fn e2b_created(d: &Daemon, key: &str, body: serde_json::Value) -> serde_json::Value {
    let (status, v) = e2b_post_sandbox(d, key, "/sandboxes", body).await;
    assert_eq!(status, 201, "E2B create: {v}");
    v
}

/// Starts `cmd args` in E2B sandbox `id` through envd's `process.Process/Start` (one Connect
/// JSON frame, as the SDKs send it); the process keeps running after the answer's headers.
pub async fn e2b_start_process(d: &Daemon, id: &str, envd_token: &str, cmd: &str, args: &[&str]) {
    let m =
        serde_json::to_vec(&serde_json::json!({"process": {"cmd": cmd, "args": args}})).unwrap();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(m.len() as u32).to_be_bytes());
    frame.extend_from_slice(&m);
    let r = reqwest::Client::new()
        .post(format!("{}/process.Process/Start", d.url()))
        .header("content-type", "application/connect+json")
        .header("e2b-sandbox-id", id)
        .header("x-access-token", envd_token)
        .body(frame)
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        reqwest::StatusCode::OK,
        "starting {cmd} in {id}"
    );
}

/// A tiny HTTP server on every address of this host (a free port), for sandboxes to reach
/// (with `--sandbox-reach-host`): answers every request with `body`, closing first (the body is
/// delimited by the close). Returns its port.
pub async fn host_server(body: &'static str) -> u16 {
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let resp = format!("HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{body}");
                let _ = s.write_all(resp.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    port
}

/// Fetches `url` from inside the sandbox: Some(body) or None when it cannot connect.
pub async fn fetch(c: &torpor_api::Client, id: &str, url: &str) -> Option<String> {
    let r = c
        .exec(
            id,
            &ExecBody {
                cmd: vec![
                    "python3".into(),
                    "-c".into(),
                    "import sys,urllib.request;print(urllib.request.urlopen(sys.argv[1],timeout=3).read().decode())".into(),
                    url.into(),
                ],
                timeout_ms: Some(30_000),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    (r.exit_code == Some(0)).then(|| r.stdout.trim().to_string())
}

/// A non-loopback IPv4 address of this host (sandboxes reach it through their router).
pub fn host_addr() -> String {
    let out = std::process::Command::new("ip")
        .args(["-4", "-o", "addr", "show", "scope", "global"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| {
            let mut it = l.split_whitespace();
            it.position(|w| w == "inet")?;
            Some(it.next()?.split('/').next()?.to_string())
        })
        .expect("a global IPv4 address")
}

/// The tests' image maker (see its header): `make_image(out, &["hostile"])`,
/// `make_image(out, &["rootfs"])`, ...
pub const MAKE_IMAGE: &str = include_str!("make_image.py");

/// Writes a tiny test image to `out` (an oci-archive, or with `rootfs` a root-filesystem
/// tarball); `flags` as `make_image.py` takes them.
pub fn make_image(out: &std::path::Path, flags: &[&str]) {
    let st = Command::new("python3")
        .args(["-c", MAKE_IMAGE])
        .arg(out)
        .args(flags)
        .status()
        .unwrap();
    assert!(st.success(), "make_image.py {flags:?}");
}

/// The repository's GPU fixture `name` (`fixtures/gpu`).
pub fn gpu_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|d| d.join("fixtures/gpu"))
        .find(|d| d.is_dir())
        .expect("fixtures/gpu of the repository above the crate")
        .join(name)
}

/// A running `torpor gpu extender` on a free port, stopped when dropped. Without
/// `--extender-token-file` among `extra` it runs `--no-auth`.
pub struct ExtenderProcess {
    child: Child,
    pub url: String,
}

impl ExtenderProcess {
    pub fn start(inventories: &[PathBuf]) -> ExtenderProcess {
        Self::start_with(inventories, &[])
    }

    pub fn start_with(inventories: &[PathBuf], extra: &[&str]) -> ExtenderProcess {
        let mut cmd = Command::new(BIN);
        cmd.args(["gpu", "extender", "--listen", "127.0.0.1:0"]);
        if !extra.contains(&"--extender-token-file") {
            cmd.arg("--no-auth");
        }
        cmd.args(extra);
        cmd.arg("--inventory");
        cmd.args(inventories);
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_owned();
        ExtenderProcess {
            child,
            url: format!("http://{addr}"),
        }
    }
}

impl Drop for ExtenderProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of one sample line (`name{labels} value`), 0 when absent.
pub fn metric(text: &str, series: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .unwrap_or(0)
}
