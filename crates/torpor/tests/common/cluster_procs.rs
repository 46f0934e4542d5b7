//! The processes of a cluster under test, shared by the cluster end-to-end tests: a real
//! `torpor controller` on a real PostgreSQL, real `torpor worker`s, identities from `torpor ca`.
//! Include with `#[path = "common/cluster_procs.rs"] mod procs;` beside
//! `#[path = "common/cluster.rs"] mod cluster;` (and `brokers`, which `setup` does not need).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use torpor_control::store::pg_testing;

use super::cluster;

/// How long a wait for something that must happen may take before the test gives up: a hang
/// guard, never a measure (two controllers, two or three workers and PostgreSQL share two
/// cores, with other tests beside them).
pub const PATIENCE: Duration = Duration::from_secs(180);

pub const TOKEN: &str = "tpr_admin_cluster_e2e_0123456789";
/// State in a file, in memory (tmpfs) and a process, for a sandbox to carry across moves.
pub const STATE: &str =
    "echo disk-1 > /tmp/state; mkdir -p /dev/shm && echo mem-1 > /dev/shm/state; \
     (setsid sleep 100000 </dev/null >/dev/null 2>&1 &); sleep 0.2; pgrep -x sleep > /tmp/pid";
/// What [`STATE`] reads back: `disk-1\nmem-1\nprocess-alive\n` while all of it is there.
/// `sh -c` script: mounts an empty tmpfs (mode 000) over each of the first `$1` paths, then
/// each of the next `$n` paths read-only over itself, then runs the rest of its arguments in
/// its place.
const HIDE_THEN_EXEC: &str = "n=$1; shift; while [ \"$n\" -gt 0 ]; do \
     mount -t tmpfs -o size=64k,mode=000 torpor-hidden \"$1\" || exit 97; shift; n=$((n-1)); \
     done; \
     n=$1; shift; while [ \"$n\" -gt 0 ]; do \
     mount --bind \"$1\" \"$1\" && mount -o remount,bind,ro \"$1\" || exit 98; \
     shift; n=$((n-1)); done; exec \"$@\"";
pub const CHECK: &str =
    "cat /tmp/state /dev/shm/state; kill -0 $(cat /tmp/pid) && echo process-alive";

/// Makes every controller and worker started in `tmp` from now on use an S3 store (`url`,
/// `s3://bucket/prefix`) with `env` (its `AWS_*` variables) instead of the directory
/// `tmp/store`. Kept in files beside the cluster, so it holds for that test's cluster only.
pub fn use_s3(tmp: &Path, url: &str, env: &[(&str, &str)]) {
    std::fs::write(tmp.join("store.url"), url).unwrap();
    let lines: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    std::fs::write(tmp.join("store.env"), lines.join("\n")).unwrap();
}

/// The store the processes in `tmp` use and the variables they need for it ([`use_s3`]).
fn store_of(tmp: &Path) -> (String, Vec<(String, String)>) {
    match std::fs::read_to_string(tmp.join("store.url")) {
        Ok(url) => {
            let env = std::fs::read_to_string(tmp.join("store.env"))
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            (url, env)
        }
        Err(_) => (tmp.join("store").to_str().unwrap().to_string(), Vec::new()),
    }
}

pub struct Controller {
    pub api: String,
    pub cluster: String,
    /// `--peer-listen`: where the other controllers forward (mutual TLS).
    #[allow(dead_code)]
    pub peer: String,
    pub log: PathBuf,
    pub child: Child,
    args: Vec<std::ffi::OsString>,
    /// Its store's variables ([`use_s3`]), kept across restarts.
    env: Vec<(String, String)>,
    /// The cgroup v2 group it runs in ([`Partition::group`]), kept across restarts.
    group: Option<PathBuf>,
}

impl Controller {
    pub async fn start(tmp: &Path, database: &str) -> Controller {
        Controller::start_as(tmp, database, "c1").await
    }

    /// Controller `name` (its identity in `tmp/<name>`, its data in `tmp/controller-<name>`).
    /// Every controller of one database shares the env key: `c1`'s is copied to the others.
    pub async fn start_as(tmp: &Path, database: &str, name: &str) -> Controller {
        Controller::start_with(tmp, database, name, 2000).await
    }

    /// [`Controller::start_as`] counting a worker lost after `worker_lost_after_ms` of silence.
    pub async fn start_with(
        tmp: &Path,
        database: &str,
        name: &str,
        worker_lost_after_ms: u64,
    ) -> Controller {
        Controller::start_args(tmp, database, name, worker_lost_after_ms, &[]).await
    }

    /// [`Controller::start_with`] with `extra` arguments.
    #[allow(dead_code)]
    pub async fn start_args(
        tmp: &Path,
        database: &str,
        name: &str,
        worker_lost_after_ms: u64,
        extra: &[&str],
    ) -> Controller {
        Controller::start_in(tmp, database, name, worker_lost_after_ms, extra, None).await
    }

    /// [`Controller::start_args`], the process in cgroup v2 group `group` (a [`Partition`]
    /// can cut its traffic).
    pub async fn start_in(
        tmp: &Path,
        database: &str,
        name: &str,
        worker_lost_after_ms: u64,
        extra: &[&str],
        group: Option<&Path>,
    ) -> Controller {
        let token = tmp.join("admin-token");
        std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
        let api = format!("127.0.0.1:{}", cluster::free_port());
        let cluster_addr = format!("127.0.0.1:{}", cluster::free_port());
        let peer = format!("127.0.0.1:{}", cluster::free_port());
        let data = tmp.join(format!("controller-{name}"));
        std::fs::create_dir_all(&data).unwrap();
        let first_key = tmp.join("controller-c1").join("env.key");
        if name != "c1" && first_key.exists() {
            std::fs::copy(&first_key, data.join("env.key")).unwrap();
        }
        let log = tmp.join(format!("controller-{name}.log"));
        let (store, env) = store_of(tmp);
        let args: Vec<std::ffi::OsString> = [
            "controller",
            "--database",
            database,
            "--store",
            &store,
            "--listen",
            &api,
            "--cluster-listen",
            &cluster_addr,
            "--peer-listen",
            &peer,
            "--tls-dir",
            tmp.join(name).to_str().unwrap(),
            "--controller-lost-after-ms",
            "2000",
            "--admin-token-file",
            token.to_str().unwrap(),
            "--data-dir",
            data.to_str().unwrap(),
            "--worker-lost-after-ms",
            &worker_lost_after_ms.to_string(),
            "--tick-ms",
            "100",
        ]
        .into_iter()
        // 200 ms heartbeats unless the test says otherwise.
        .chain(
            ["--heartbeat-ms", "200"]
                .into_iter()
                .filter(|_| !extra.contains(&"--heartbeat-ms")),
        )
        .chain(extra.iter().copied())
        .map(Into::into)
        .collect();
        let group = group.map(Path::to_path_buf);
        let child = Controller::spawn(&args, &env, std::fs::File::create(&log).unwrap(), &group);
        let mut c = Controller {
            api,
            cluster: cluster_addr,
            peer,
            log,
            child,
            args,
            env,
            group,
        };
        c.wait_up().await;
        c
    }

    fn spawn(
        args: &[std::ffi::OsString],
        env: &[(String, String)],
        log: std::fs::File,
        group: &Option<PathBuf>,
    ) -> Child {
        let mut cmd = Command::new(cluster::BIN);
        cmd.args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("TORPOR_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(g) = group {
            join_group(&mut cmd, g);
        }
        cmd.spawn().unwrap()
    }

    async fn wait_up(&mut self) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if reqwest::get(format!("http://{}/healthz", self.api))
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                return;
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("controller exited with {status}:\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "controller not up:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Sends the controller `signal` (SIGSTOP: it hangs, answering nothing; SIGCONT).
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// SIGTERM, then waits for the process to exit (a hang guard: [`PATIENCE`]).
    pub async fn terminate(&mut self) -> std::process::ExitStatus {
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "did not stop:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILLs the controller and starts it again as it was (same addresses, data and
    /// identity; its log goes on in the same file).
    pub async fn kill_and_restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.log)
            .unwrap();
        self.child = Controller::spawn(&self.args, &self.env, log, &self.group);
        self.wait_up().await;
    }

    /// [`Controller::kill_and_restart`] with `extra` arguments added for good.
    pub async fn kill_and_restart_with(&mut self, extra: &[&str]) {
        self.args.extend(extra.iter().map(std::ffi::OsString::from));
        self.kill_and_restart().await;
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        self.call_as(TOKEN, method, path, body).await
    }

    pub async fn call_as(
        &self,
        token: &str,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let client = reqwest::Client::new();
        let mut req = client
            .request(method, format!("http://{}{path}", self.api))
            .bearer_auth(token)
            .timeout(Duration::from_secs(120));
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    pub async fn ok(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let (status, v) = self.call(method, path, body).await;
        assert!(
            (200..300).contains(&status),
            "{path}: {status} {v}\n{}",
            self.log()
        );
        v
    }

    /// Parks sandbox `id` (`POST /v1/sandboxes/{id}/suspend`, tier parked).
    pub async fn park(&self, id: &str) -> Value {
        self.ok(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/suspend"),
            Some(serde_json::json!({"tier": "parked"})),
        )
        .await
    }

    pub async fn nodes(&self) -> Vec<Value> {
        self.ok(reqwest::Method::GET, "/v1/nodes", None)
            .await
            .as_array()
            .unwrap()
            .clone()
    }

    /// Waits until `/v1/nodes` says `want(name -> state)`.
    pub async fn wait_nodes(&self, what: &str, want: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let nodes = self.nodes().await;
            if want(&nodes) {
                return nodes;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: nodes {nodes:?}\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the built-in `host` template is ready (built on a worker once one joined).
    pub async fn wait_host_template(&self) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let (status, t) = self
                .call(reqwest::Method::GET, "/v1/templates/host", None)
                .await;
            if status == 200 && t["status"] == "ready" {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "host template: {status} {t}\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// A sandbox of the built-in template carrying [`STATE`]; its id.
    pub async fn create_with_state(&self) -> String {
        let sb = self
            .ok(
                reqwest::Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": "host"})),
            )
            .await;
        let id = sb["id"].as_str().unwrap().to_string();
        self.exec(&id, STATE).await;
        id
    }

    pub async fn exec(&self, id: &str, script: &str) -> String {
        let v = self
            .ok(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{id}/exec"),
                Some(json!({"cmd": ["sh", "-c", script]})),
            )
            .await;
        assert_eq!(v["exit_code"], 0, "{script}: {v}");
        v["stdout"].as_str().unwrap().to_string()
    }

    pub async fn sandbox(&self, id: &str) -> Value {
        self.ok(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await
    }

    /// `torpor_cluster_tls_refusals_total{side="controller",reason}` from /metrics.
    pub async fn refusals(&self, reason: &str) -> u64 {
        self.metric(&format!(
            "torpor_cluster_tls_refusals_total{{reason=\"{reason}\",side=\"controller\"}}"
        ))
        .await
    }

    /// One series' value from /metrics (0 when absent).
    pub async fn metric(&self, series: &str) -> u64 {
        self.metric_value(series).await as u64
    }

    /// The value of `series` on the controller's `/metrics` (0 when absent).
    pub async fn metric_value(&self, series: &str) -> f64 {
        let text = reqwest::Client::new()
            .get(format!("http://{}/metrics", self.api))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(series))
            .map_or(0.0, |v| v.trim().parse().unwrap())
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Worker {
    pub name: String,
    pub data: PathBuf,
    pub log: PathBuf,
    pub child: Option<Child>,
}

impl Worker {
    /// Worker `name` in a mount namespace of its own in which every controller's data
    /// directory that exists now is an empty, closed tmpfs: as on separate machines, what it
    /// runs reaches it only through the protocol and the snapshot store (`tmp/store`, or the
    /// S3 store of [`use_s3`]).
    pub fn start(tmp: &Path, tls: &str, name: &str, controller: &str) -> Worker {
        Worker::start_with(tmp, tls, name, controller, &[])
    }

    /// [`Worker::start`], with `read_only` paths mounted read-only in its namespace (the
    /// snapshot store, to make its uploads fail).
    pub fn start_with(
        tmp: &Path,
        tls: &str,
        name: &str,
        controller: &str,
        read_only: &[PathBuf],
    ) -> Worker {
        Worker::start_args(tmp, tls, name, controller, read_only, &[])
    }

    /// [`Worker::start_with`] with `extra` arguments.
    pub fn start_args(
        tmp: &Path,
        tls: &str,
        name: &str,
        controller: &str,
        read_only: &[PathBuf],
        extra: &[&str],
    ) -> Worker {
        Worker::start_in(tmp, tls, name, controller, read_only, extra, None)
    }

    /// [`Worker::start_args`], the process (and what it starts) in cgroup v2 group `group`
    /// (a [`Partition`] can cut its traffic).
    pub fn start_in(
        tmp: &Path,
        tls: &str,
        name: &str,
        controller: &str,
        read_only: &[PathBuf],
        extra: &[&str],
        group: Option<&Path>,
    ) -> Worker {
        let data = tmp.join(format!("data-{name}"));
        std::fs::create_dir_all(&data).unwrap();
        let log = tmp.join(format!("{name}.log"));
        let hidden: Vec<PathBuf> = std::fs::read_dir(tmp)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("controller-"))
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect();
        let mut cmd = Command::new("unshare");
        if let Some(g) = group {
            join_group(&mut cmd, g);
        }
        let child = cmd
            .args([
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                HIDE_THEN_EXEC,
            ])
            .arg("sh")
            .arg(hidden.len().to_string())
            .args(&hidden)
            .arg(read_only.len().to_string())
            .args(read_only)
            .arg(cluster::BIN)
            .args(["worker", "--controller", controller])
            .args(["--tls-dir", tmp.join(tls).to_str().unwrap()])
            .args(["--data-dir", data.to_str().unwrap()])
            .args([
                "--listen",
                "127.0.0.1:0",
                "--workers",
                "2",
                "--warm-pool",
                "1",
            ])
            .args(["--memory-budget", "2G"])
            // Every worker here is this one machine: free slots decide where sandboxes go,
            // unless a test asks for the CPU figures.
            .args(
                ["--report-cpu", "false"]
                    .into_iter()
                    .filter(|_| !extra.contains(&"--report-cpu")),
            )
            .args(extra)
            .envs(store_of(tmp).1)
            .env("TORPOR_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            // Appended to: a restarted worker's log follows its previous run's.
            .stderr(
                std::fs::File::options()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .unwrap(),
            )
            .spawn()
            .unwrap();
        Worker {
            name: name.to_string(),
            data,
            log,
            child: Some(child),
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The containers runsc runs for this worker now (whoever started them).
    pub fn containers(&self) -> Vec<String> {
        cluster::runsc_containers(&self.data)
    }

    pub fn sigkill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
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
        let _ = Command::new("runsc")
            .arg("--root")
            .arg(self.data.join("runsc"))
            .args(["list", "-quiet"])
            .output()
            .map(|out| {
                for id in String::from_utf8_lossy(&out.stdout).lines() {
                    let _ = Command::new("runsc")
                        .arg("--root")
                        .arg(self.data.join("runsc"))
                        .args(["delete", "-force", id])
                        .output();
                }
            });
    }
}

/// Makes `cmd`'s process join cgroup v2 group `group` before it runs (what it starts
/// follows it).
fn join_group(cmd: &mut Command, group: &Path) {
    use std::os::unix::process::CommandExt;
    let procs = std::ffi::CString::new(
        group
            .join("cgroup.procs")
            .into_os_string()
            .into_encoded_bytes(),
    )
    .unwrap();
    // SAFETY: between fork and exec only async-signal-safe calls (open, write, close) on
    // memory prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // "0": the writing process itself.
            let ok = libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
            let err = std::io::Error::last_os_error();
            libc::close(fd);
            if ok {
                Ok(())
            } else {
                Err(err)
            }
        });
    }
}

/// A network partition between processes of one machine, as between machines: TCP packets
/// that processes of a cgroup v2 group send to a port are dropped (nftables matching the
/// sending socket's group). Everything it made is removed on drop.
pub struct Partition {
    table: String,
    groups: Vec<PathBuf>,
}

/// Where the cgroup v2 hierarchy is mounted on these machines (v1 holds /sys/fs/cgroup).
const CGROUP2: &str = "/sys/fs/cgroup/unified";

impl Partition {
    /// A partition named `name` (unique to the test), cutting nothing yet.
    pub fn new(name: &str) -> Partition {
        let table = format!("{name}_{}", std::process::id());
        nft(&[
            &format!("add table inet {table}"),
            &format!("add chain inet {table} out {{ type filter hook output priority 0; }}"),
        ]);
        Partition {
            table,
            groups: Vec::new(),
        }
    }

    /// A new cgroup v2 group to start processes in (`Controller::start_in`, `Worker::start_in`).
    pub fn group(&mut self, name: &str) -> PathBuf {
        let dir = Path::new(CGROUP2).join(format!("{}-{name}", self.table));
        std::fs::create_dir_all(&dir).unwrap();
        self.groups.push(dir.clone());
        dir
    }

    /// Drops the TCP packets processes of `group` send to `port` (connections they open
    /// there fail; ones open stall).
    pub fn cut(&self, group: &Path, port: u16) {
        self.rule(group, port, "drop")
    }

    /// Answers the TCP packets processes of `group` send to `port` with a reset, as a server
    /// that restarts does (connections open there break; new ones are refused at once).
    pub fn refuse(&self, group: &Path, port: u16) {
        self.rule(group, port, "reject with tcp reset")
    }

    fn rule(&self, group: &Path, port: u16, verdict: &str) {
        let name = group.file_name().unwrap().to_str().unwrap();
        // nft resolves the group's path under /sys/fs/cgroup, where v1 is mounted here: in
        // a mount namespace of its own, the v2 hierarchy is bound there.
        let rule = format!(
            "add rule inet {} out socket cgroupv2 level 1 \\\"{name}\\\" tcp dport {port} {verdict}",
            self.table
        );
        let out = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(format!(
                "mount --bind {CGROUP2} /sys/fs/cgroup && nft \"{rule}\""
            ))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "nft {rule}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Removes every cut (the groups stay until the partition is dropped).
    pub fn heal(&self) {
        nft(&[&format!("flush chain inet {} out", self.table)]);
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", &self.table])
            .output();
        for g in &self.groups {
            // Only empty groups go: the processes in it are gone by now (dropped before).
            let _ = std::fs::remove_dir(g);
        }
    }
}

fn nft(commands: &[&str]) {
    for c in commands {
        let out = Command::new("nft").args(c.split(' ')).output().unwrap();
        assert!(
            out.status.success(),
            "nft {c}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A fresh database on the test's PostgreSQL (`None`: no PostgreSQL binaries here) and a
/// directory with a CA (`ca/`) and an identity for each controller and worker named.
pub async fn setup(
    prefix: &str,
    controllers: &[&str],
    workers: &[&str],
) -> Option<(String, tempfile::TempDir)> {
    // The PostgreSQL harness is synchronous (its own runtime): off this one's threads.
    let database = tokio::task::spawn_blocking(|| {
        pg_testing::server().map(|pg| pg.url(&pg_testing::new_database(pg)))
    })
    .await
    .unwrap()?;
    let tmp = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
    let dir = tmp.path();
    let ca = dir.join("ca");
    cluster::ca_init(&ca, "e2e.cluster");
    for (role, names) in [("controller", controllers), ("worker", workers)] {
        for n in names {
            cluster::ca_issue(&ca, role, n, &dir.join(n), "1h");
        }
    }
    Some((database, tmp))
}

pub fn state_of<'a>(nodes: &'a [Value], name: &str) -> Option<&'a str> {
    nodes
        .iter()
        .find(|n| n["name"] == name)
        .and_then(|n| n["state"].as_str())
}
