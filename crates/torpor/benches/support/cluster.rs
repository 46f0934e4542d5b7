//! The cluster bench's processes: certificates from the real `torpor ca`, `torpor controller`s
//! on one PostgreSQL (each its own identity and data directory, one admin token, `c1`'s env key
//! copied to the others, as crates/torpor/tests/cluster_mode.rs starts them) and `torpor
//! worker`s that join every controller. Used by benches/cluster.rs only.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;
use torpor_api::Client;

use crate::support::BIN;

pub const TOKEN: &str = "tpr_admin_cluster_bench_0123456789";

static PINNED: OnceLock<PathBuf> = OnceLock::new();

/// Pins the `torpor` binary the cluster's processes run: a hard link to it (else a copy) in
/// `dir`, taken at the start. Others build in the same target directory; without this a worker
/// started later in the run (the loss row starts some) could be another build than the
/// controllers.
/// `TORPOR_BIN=PATH` pins another build (the same bench against an older commit's binary).
pub fn pin_binary(dir: &Path) {
    let to = dir.join("torpor");
    let from = std::env::var_os("TORPOR_BIN").map_or(PathBuf::from(BIN), PathBuf::from);
    if std::fs::hard_link(&from, &to).is_err() {
        std::fs::copy(&from, &to).expect("copy the torpor binary");
    }
    let _ = PINNED.set(to);
}

/// On a panic, prints the last lines of every process log in `dir` (the temporary directory,
/// and the logs with it, is gone once the panic unwinds).
pub fn logs_on_panic(dir: &Path) {
    let dir = dir.to_path_buf();
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        let mut logs: Vec<PathBuf> = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        logs.sort();
        for log in logs {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            eprintln!("--- {} (last 40 lines)", log.display());
            for l in &lines[lines.len().saturating_sub(40)..] {
                eprintln!("{l}");
            }
        }
    }));
}

fn bin() -> &'static Path {
    PINNED.get().map_or(Path::new(BIN), PathBuf::as_path)
}

/// A loopback port for a child process to listen on (outside the ephemeral range: see
/// `torpor_runtime::ports`).
pub fn free_port() -> u16 {
    torpor_runtime::ports::loopback_port().expect("a free loopback port")
}

/// Runs `torpor ARGS` to completion; panics with its output unless it succeeds.
pub fn torpor(args: &[&str]) {
    let out = Command::new(bin())
        .args(args)
        .output()
        .expect("torpor runs");
    assert!(
        out.status.success(),
        "torpor {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn ca_issue(ca: &Path, role: &str, name: &str, out: &Path) {
    torpor(&[
        "ca",
        "issue",
        "--dir",
        ca.to_str().unwrap(),
        "--role",
        role,
        "--name",
        name,
        "--out",
        out.to_str().unwrap(),
        "--ttl",
        "2h",
    ]);
}

pub struct Controller {
    pub name: String,
    pub client: Client,
    http: reqwest::Client,
    api: String,
    pub cluster: String,
    log: PathBuf,
    child: Child,
}

impl Controller {
    /// Controller `name`: its identity from `torpor ca issue` in `tmp/<name>` (made here), its
    /// data in `tmp/controller-<name>` (with `c1`'s env key copied in for the others), the
    /// shared admin token, PostgreSQL `database`, snapshots in `tmp/store`.
    pub async fn start_as(tmp: &Path, ca: &Path, database: &str, name: &str) -> Controller {
        Controller::start_at(tmp, ca, database, name, fresh_addrs(), &[]).await
    }

    /// [`Controller::start_as`] at `(api, cluster)` addresses (the same again for a restart:
    /// workers join a fixed list), with `extra` arguments.
    pub async fn start_at(
        tmp: &Path,
        ca: &Path,
        database: &str,
        name: &str,
        (api, cluster): (String, String),
        extra: &[&str],
    ) -> Controller {
        if !tmp.join(name).join("cert.pem").exists() {
            ca_issue(ca, "controller", name, &tmp.join(name));
        }
        let token = tmp.join("admin-token");
        std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
        let data = tmp.join(format!("controller-{name}"));
        std::fs::create_dir_all(&data).unwrap();
        let first_key = tmp.join("controller-c1").join("env.key");
        if name != "c1" && first_key.exists() {
            std::fs::copy(&first_key, data.join("env.key")).unwrap();
        }
        let log = tmp.join(format!("controller-{name}.log"));
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        // `extra` may name another store (`--store s3://…`, its `AWS_*` variables set in
        // this process's environment, which every process inherits).
        let store = tmp.join("store");
        let default_store = ["--store", store.to_str().unwrap()];
        let child = Command::new(bin())
            .args(["controller", "--database", database])
            .args(default_store.iter().filter(|_| !extra.contains(&"--store")))
            .args(["--listen", &api, "--cluster-listen", &cluster])
            .args(["--peer-listen", "127.0.0.1:0"])
            .args(["--tls-dir", tmp.join(name).to_str().unwrap()])
            .args(["--admin-token-file", token.to_str().unwrap()])
            .args(["--data-dir", data.to_str().unwrap()])
            .args(["--heartbeat-ms", "200", "--worker-lost-after-ms", "2000"])
            .args(["--tick-ms", "100"])
            .args(extra)
            .env("TORPOR_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("torpor controller starts");
        let mut c = Controller {
            name: name.to_string(),
            client: Client::new(&format!("http://{api}"), TOKEN),
            http: reqwest::Client::new(),
            api,
            cluster,
            log,
            child,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !c.client.is_up().await {
            if let Some(status) = c.child.try_wait().unwrap() {
                panic!("controller {name} exited with {status}:\n{}", c.log());
            }
            assert!(
                Instant::now() < deadline,
                "controller {name} not up:\n{}",
                c.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        c
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Its API and cluster addresses (to start it again at the same ones).
    #[allow(dead_code)]
    pub fn addrs(&self) -> (String, String) {
        (self.api.clone(), self.cluster.clone())
    }

    /// SIGTERM; waits for the exit (within `within`) and answers how long it took, in ms.
    #[allow(dead_code)]
    pub fn stop(&mut self, within: Duration) -> f64 {
        let started = Instant::now();
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(
                    status.success(),
                    "{} exited {status}:\n{}",
                    self.name,
                    self.log()
                );
                return started.elapsed().as_secs_f64() * 1000.0;
            }
            assert!(
                started.elapsed() < within,
                "{} did not stop:\n{}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub async fn nodes(&self) -> Vec<Value> {
        let r = self
            .http
            .get(format!("http://{}/v1/nodes", self.api))
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("GET /v1/nodes");
        r.json::<Vec<Value>>().await.expect("nodes JSON")
    }

    /// Waits until every name in `names` is in `state`.
    pub async fn wait_state(&self, names: &[&str], state: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let nodes = self.nodes().await;
            if names.iter().all(|n| state_of(&nodes, n) == Some(state)) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{}: {names:?} not {state}: {nodes:?}\n{}",
                self.name,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `method path` with the admin token and no body: the status and the JSON answered
    /// (`null` when the body is not JSON).
    #[allow(dead_code)]
    pub async fn call(&self, method: reqwest::Method, path: &str) -> (u16, Value) {
        let r = self
            .http
            .request(method, format!("http://{}{path}", self.api))
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("API call");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// `method path` with `body` (none when `null`), which must succeed.
    #[allow(dead_code)]
    pub async fn call_ok(&self, method: reqwest::Method, path: &str, body: Value) {
        let mut req = self
            .http
            .request(method, format!("http://{}{path}", self.api))
            .bearer_auth(TOKEN);
        if !body.is_null() {
            req = req.json(&body);
        }
        let r = req.send().await.expect("API call");
        let status = r.status();
        assert!(
            status.is_success(),
            "{path}: {status} {}",
            r.text().await.unwrap_or_default()
        );
    }

    /// The sum of every series of metric `name` (all label sets) on its `/metrics`.
    #[allow(dead_code)]
    pub async fn metric_sum(&self, name: &str) -> u64 {
        let text = self
            .http
            .get(format!("http://{}/metrics", self.api))
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .unwrap_or_default();
        text.lines()
            .filter(|l| l.split(['{', ' ']).next() == Some(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }

    pub async fn drain(&self, name: &str) {
        let r = self
            .http
            .post(format!("http://{}/v1/nodes/{name}/drain", self.api))
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("drain");
        assert!(r.status().is_success(), "drain {name}: {}", r.status());
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Free `(api, cluster)` addresses on loopback for a controller.
pub fn fresh_addrs() -> (String, String) {
    (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    )
}

pub fn state_of<'a>(nodes: &'a [Value], name: &str) -> Option<&'a str> {
    nodes
        .iter()
        .find(|n| n["name"] == name)
        .and_then(|n| n["state"].as_str())
}

pub struct Worker {
    pub name: String,
    pub data: PathBuf,
    child: Option<Child>,
}

impl Worker {
    /// Worker `name` (identity from `torpor ca issue`), joining every controller in
    /// `controllers` (`ADDR[,ADDR…]`).
    pub fn start(tmp: &Path, ca: &Path, name: &str, controllers: &str) -> Worker {
        ca_issue(ca, "worker", name, &tmp.join(name));
        let data = tmp.join(format!("data-{name}"));
        std::fs::create_dir_all(&data).unwrap();
        let child = Command::new(bin())
            .args(["worker", "--controller", controllers])
            .args(["--tls-dir", tmp.join(name).to_str().unwrap()])
            .args(["--data-dir", data.to_str().unwrap()])
            .args(["--listen", "127.0.0.1:0", "--workers", "12"])
            .args(["--warm-pool", "1", "--memory-budget", "8G"])
            // Every worker is this one machine: free slots decide where sandboxes go.
            .args(["--report-cpu", "false"])
            // `TORPOR_BENCH_WORKER_ARGS="--upload-nice 0"`: more flags for every worker.
            .args(
                std::env::var("TORPOR_BENCH_WORKER_ARGS")
                    .unwrap_or_default()
                    .split_whitespace(),
            )
            .env("TORPOR_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(tmp.join(format!("{name}.log"))).unwrap())
            .spawn()
            .expect("torpor worker starts");
        Worker {
            name: name.to_string(),
            data,
            child: Some(child),
        }
    }

    pub fn alive(&self) -> bool {
        self.child.is_some()
    }

    pub fn sigkill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().expect("SIGKILL");
            c.wait().expect("reaped");
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(20);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        // What a SIGKILLed worker left: its runsc containers, maybe frozen (a frozen process
        // cannot die): thaw its groups (named like its bundle directories), then delete.
        for group in std::fs::read_dir(self.data.join("workers"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let state = Path::new("/sys/fs/cgroup/freezer/torpor")
                .join(group.file_name())
                .join("freezer.state");
            let _ = std::fs::write(state, "THAWED");
        }
        for id in runsc_list(&self.data.join("runsc")) {
            let _ = Command::new("runsc")
                .arg("--root")
                .arg(self.data.join("runsc"))
                .args(["delete", "-force", &id])
                .output();
        }
    }
}

pub fn runsc_list(root: &Path) -> Vec<String> {
    Command::new("runsc")
        .arg("--root")
        .arg(root)
        .args(["list", "-quiet"])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}
