//! Cluster benchmark: wake latency on the same worker, on another worker and after a worker
//! loss, beside bare `runsc restore` of the same image; lifecycle operations per second through
//! a controller beside the embedded `torpor up`. Everything in one run, on this machine.
//!
//!   cargo bench -p torpor --bench cluster            (as root, runsc and PostgreSQL installed)
//!   TORPOR_BENCH_N=20 TORPOR_BENCH_CONC=4 cargo bench -q --profile dev -p torpor --bench cluster
//!
//! Real processes: a PostgreSQL server (`store::pg_testing`), one `torpor controller`, three (and
//! more, as workers are killed) `torpor worker`s with certificates from `torpor ca`, and a
//! `torpor up` for the lifecycle baseline. Sandboxes come from the built-in `host` template and
//! hold 64 MiB of random bytes in /dev/shm (memory, so in every checkpoint image).
//!
//! | row | what is timed |
//! |---|---|
//! | wake, same worker | exec `true` on a Parked sandbox, all workers ready (it goes back to its own) |
//! | wake, another worker | the same with the worker it parked on draining |
//! | wake after a worker loss | the first call after the worker it ran on was SIGKILLed and is `lost` |
//! | bare `runsc restore` | `runsc restore --detach` of a copy of the same image, same bundle |
//! | lifecycle | create, park, wake (exec `true`), delete of N sandboxes, C at a time: controller vs `torpor up` |
//!
//! Prints two tables and one JSON line (`{"bench":"cluster",...}`).

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{pct, Daemon, BIN};
use torpor_api::types::{CreateSandboxBody, ExecBody};
use torpor_api::Client;
use torpor_control::store::pg_testing;
use torpor_core::Tier;

const TOKEN: &str = "tpr_admin_cluster_bench_0123456789";
/// 64 MiB of incompressible bytes in the sandbox's memory (/dev is a tmpfs in gVisor).
const FILL_64M: &str =
    "mkdir -p /dev/shm && dd if=/dev/urandom of=/dev/shm/blob bs=1M count=64 status=none";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("free port")
        .local_addr()
        .expect("addr")
        .port()
}

/// Runs `torpor ARGS` to completion; panics with its output unless it succeeds.
fn torpor(args: &[&str]) {
    let out = Command::new(BIN).args(args).output().expect("torpor runs");
    assert!(
        out.status.success(),
        "torpor {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn ca_issue(ca: &Path, role: &str, name: &str, out: &Path) {
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

struct Controller {
    client: Client,
    http: reqwest::Client,
    api: String,
    cluster: String,
    data: PathBuf,
    log: PathBuf,
    child: Child,
}

impl Controller {
    async fn start(tmp: &Path, database: &str) -> Controller {
        let token = tmp.join("admin-token");
        std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
        let api = format!("127.0.0.1:{}", free_port());
        let cluster = format!("127.0.0.1:{}", free_port());
        let data = tmp.join("controller");
        std::fs::create_dir_all(&data).unwrap();
        let log = tmp.join("controller.log");
        let child = Command::new(BIN)
            .args(["controller", "--database", database])
            .args(["--store", tmp.join("store").to_str().unwrap()])
            .args(["--listen", &api, "--cluster-listen", &cluster])
            .args(["--tls-dir", tmp.join("c1").to_str().unwrap()])
            .args(["--admin-token-file", token.to_str().unwrap()])
            .args(["--data-dir", data.to_str().unwrap()])
            .args(["--heartbeat-ms", "200", "--worker-lost-after-ms", "2000"])
            .args(["--tick-ms", "100"])
            .env("TORPOR_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("torpor controller starts");
        let mut c = Controller {
            client: Client::new(&format!("http://{api}"), TOKEN),
            http: reqwest::Client::new(),
            api,
            cluster,
            data,
            log,
            child,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !c.client.is_up().await {
            if let Some(status) = c.child.try_wait().unwrap() {
                panic!("controller exited with {status}:\n{}", c.log());
            }
            assert!(Instant::now() < deadline, "controller not up:\n{}", c.log());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        c
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn nodes(&self) -> Vec<Value> {
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
    async fn wait_state(&self, names: &[&str], state: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let nodes = self.nodes().await;
            if names.iter().all(|n| state_of(&nodes, n) == Some(state)) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{names:?} not {state}: {nodes:?}\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn drain(&self, name: &str) {
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

fn state_of<'a>(nodes: &'a [Value], name: &str) -> Option<&'a str> {
    nodes
        .iter()
        .find(|n| n["name"] == name)
        .and_then(|n| n["state"].as_str())
}

struct Worker {
    name: String,
    data: PathBuf,
    child: Option<Child>,
}

impl Worker {
    fn start(tmp: &Path, ca: &Path, name: &str, controller: &str) -> Worker {
        ca_issue(ca, "worker", name, &tmp.join(name));
        let data = tmp.join(format!("data-{name}"));
        std::fs::create_dir_all(&data).unwrap();
        let child = Command::new(BIN)
            .args(["worker", "--controller", controller])
            .args(["--tls-dir", tmp.join(name).to_str().unwrap()])
            .args(["--data-dir", data.to_str().unwrap()])
            .args(["--listen", "127.0.0.1:0", "--workers", "12"])
            .args(["--warm-pool", "1", "--memory-budget", "8G"])
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

    fn alive(&self) -> bool {
        self.child.is_some()
    }

    fn sigkill(&mut self) {
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

fn runsc_list(root: &Path) -> Vec<String> {
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

// --- the bare-runsc baseline, as benches/runtime.rs does it

fn runsc_global(root: &Path) -> Vec<String> {
    vec![
        format!("--root={}", root.display()),
        "--platform=ptrace".into(),
        "--network=none".into(),
        "--overlay2=root:memory".into(),
    ]
}

fn timed(cmd: &mut Command) -> f64 {
    let t = Instant::now();
    let out = cmd.stdin(Stdio::null()).output().expect("runsc runs");
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    ms
}

/// A copy of a live container's bundle (its config.json), with its own cgroup.
fn copy_bundle(root: &Path, live: &str, dest: &Path, cid: &str) {
    let mut args = runsc_global(root);
    args.extend(["state".into(), live.into()]);
    let out = Command::new("runsc").args(&args).output().expect("runsc");
    let state: Value = serde_json::from_slice(&out.stdout).expect("runsc state JSON");
    let bundle = PathBuf::from(state["bundle"].as_str().expect("a bundle path"));
    std::fs::create_dir_all(dest).unwrap();
    let mut spec: Value =
        serde_json::from_slice(&std::fs::read(bundle.join("config.json")).unwrap()).unwrap();
    spec["linux"]["cgroupsPath"] = json!(format!("/torpor-bench/{cid}"));
    std::fs::write(dest.join("config.json"), serde_json::to_vec(&spec).unwrap()).unwrap();
}

/// The newest committed image of a sandbox (the controller names the path; one machine here).
fn latest_image(controller_data: &Path, id: &str) -> PathBuf {
    let dir = controller_data.join("sandboxes").join(id).join("images");
    std::fs::read_dir(&dir)
        .expect("images directory")
        .flatten()
        .filter_map(|e| {
            let g: u64 = e.file_name().to_str()?.parse().ok()?;
            Some((g, e.path()))
        })
        .max()
        .expect("a committed image")
        .1
}

// --- helpers on the public API

fn true_cmd() -> ExecBody {
    ExecBody {
        cmd: vec!["/bin/true".into()],
        timeout_ms: Some(120_000),
        ..Default::default()
    }
}

async fn sh(c: &Client, id: &str, script: &str) {
    let r = c
        .exec(
            id,
            &ExecBody {
                cmd: vec!["sh".into(), "-c".into(), script.into()],
                timeout_ms: Some(120_000),
                ..Default::default()
            },
        )
        .await
        .expect("exec");
    assert_eq!(r.exit_code, Some(0), "{script}: {}", r.stderr);
}

/// Exec `true`, timed from the call to its result.
async fn timed_true(c: &Client, id: &str) -> f64 {
    let t = Instant::now();
    let r = c.exec(id, &true_cmd()).await.expect("exec true");
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    assert_eq!(r.exit_code, Some(0), "{}", r.stderr);
    ms
}

async fn node_of(c: &Client, id: &str) -> Option<String> {
    c.sandbox(id).await.expect("sandbox").node
}

async fn wait_host_template(c: &Client) {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if c.template("host").await.is_ok_and(|t| t.status == "ready") {
            return;
        }
        assert!(Instant::now() < deadline, "the host template is not ready");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn create_host(c: &Client) -> String {
    c.create_sandbox(&CreateSandboxBody {
        template: "host".into(),
        ..Default::default()
    })
    .await
    .expect("create")
    .id
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

// --- lifecycle: the same sequence against any API

/// Latencies (ms) per operation and the wall time (s) of each batch.
#[derive(Default)]
struct Lifecycle {
    ms: BTreeMap<&'static str, Vec<f64>>,
    wall_s: BTreeMap<&'static str, f64>,
}

/// Runs `op` on every id, `conc` at a time; returns (latencies, wall seconds).
async fn batch<F, Fut>(ids: &[String], conc: usize, op: F) -> (Vec<f64>, f64)
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let sem = Arc::new(tokio::sync::Semaphore::new(conc));
    let mut set = tokio::task::JoinSet::new();
    let t = Instant::now();
    for id in ids {
        let permit = sem.clone().acquire_owned().await.unwrap();
        let fut = op(id.clone());
        set.spawn(async move {
            let t = Instant::now();
            fut.await;
            drop(permit);
            t.elapsed().as_secs_f64() * 1000.0
        });
    }
    let mut ms = Vec::new();
    while let Some(r) = set.join_next().await {
        ms.push(r.expect("task"));
    }
    (ms, t.elapsed().as_secs_f64())
}

async fn lifecycle(c: &Client, n: usize, conc: usize) -> Lifecycle {
    let mut out = Lifecycle::default();
    // Create: N slots' worth, C at a time (ids collected from the tasks).
    let ids = Arc::new(tokio::sync::Mutex::new(Vec::new()));
    let slots: Vec<String> = (0..n).map(|i| i.to_string()).collect();
    let (ms, wall) = batch(&slots, conc, |_| {
        let (c, ids) = (c.clone(), ids.clone());
        async move {
            let id = create_host(&c).await;
            ids.lock().await.push(id);
        }
    })
    .await;
    out.ms.insert("create", ms);
    out.wall_s.insert("create", wall);
    let ids = ids.lock().await.clone();
    // Untimed: the 64 MiB each sandbox carries through park and wake.
    batch(&ids, conc, |id| {
        let c = c.clone();
        async move { sh(&c, &id, FILL_64M).await }
    })
    .await;
    let (ms, wall) = batch(&ids, conc, |id| {
        let c = c.clone();
        async move {
            c.suspend(&id, Some(Tier::Parked)).await.expect("park");
        }
    })
    .await;
    out.ms.insert("park", ms);
    out.wall_s.insert("park", wall);
    let (ms, wall) = batch(&ids, conc, |id| {
        let c = c.clone();
        async move {
            timed_true(&c, &id).await;
        }
    })
    .await;
    out.ms.insert("wake", ms);
    out.wall_s.insert("wake", wall);
    let (ms, wall) = batch(&ids, conc, |id| {
        let c = c.clone();
        async move { c.delete_sandbox(&id).await.expect("delete") }
    })
    .await;
    out.ms.insert("delete", ms);
    out.wall_s.insert("delete", wall);
    out
}

struct Row {
    name: &'static str,
    ms: Vec<f64>,
    note: String,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    let n = env_usize("TORPOR_BENCH_N", 20);
    let conc = env_usize("TORPOR_BENCH_CONC", 4);
    let database = tokio::task::spawn_blocking(|| {
        pg_testing::server().map(|pg| pg.url(&pg_testing::new_database(pg)))
    })
    .await
    .expect("pg harness");
    let Some(database) = database else {
        println!("cluster bench: no PostgreSQL (scripts/deps.sh installs it); nothing measured");
        return;
    };
    let started = Instant::now();

    // --- lifecycle through the embedded daemon (same sequence, same machine, this run)
    let embedded = {
        let d = Daemon::start(&["--workers", "24", "--memory-budget", "16G"]).await;
        wait_host_template(&d.client).await;
        lifecycle(&d.client, n, conc).await
    };
    eprintln!("embedded lifecycle done at {:.0?}", started.elapsed());

    // --- the cluster: CA, controller, the first worker
    let tmp = tempfile::Builder::new()
        .prefix("torpor-bench-cluster-")
        .tempdir()
        .expect("temp dir");
    let dir = tmp.path();
    let ca = dir.join("ca");
    torpor(&[
        "ca",
        "init",
        "--dir",
        ca.to_str().unwrap(),
        "--trust-domain",
        "bench.cluster",
    ]);
    ca_issue(&ca, "controller", "c1", &dir.join("c1"));
    let ctl = Controller::start(dir, &database).await;
    let c = ctl.client.clone();
    let mut workers = vec![Worker::start(dir, &ca, "w1", &ctl.cluster)];
    ctl.wait_state(&["w1"], "ready").await;
    wait_host_template(&c).await;

    // Sandboxes for the cross-worker and loss rows, parked while w1 is the only worker.
    let mut moving = Vec::new();
    for _ in 0..n {
        let id = create_host(&c).await;
        sh(&c, &id, FILL_64M).await;
        assert_eq!(node_of(&c, &id).await.as_deref(), Some("w1"));
        c.suspend(&id, Some(Tier::Parked)).await.expect("park");
        moving.push(id);
    }
    for w in ["w2", "w3"] {
        workers.push(Worker::start(dir, &ca, w, &ctl.cluster));
    }
    ctl.wait_state(&["w1", "w2", "w3"], "ready").await;
    eprintln!("cluster up at {:.0?}", started.elapsed());

    // --- lifecycle through the controller, three workers ready
    let clustered = lifecycle(&c, n, conc).await;
    eprintln!("cluster lifecycle done at {:.0?}", started.elapsed());

    let mut rows = Vec::new();

    // --- 1. wake on the same worker, beside bare runsc restore of the same image
    let baseline_root = dir.join("baseline-runsc");
    std::fs::create_dir_all(&baseline_root).unwrap();
    let id = create_host(&c).await;
    sh(&c, &id, FILL_64M).await;
    let (mut same, mut bare, mut same_node) = (Vec::new(), Vec::new(), 0);
    for i in 0..n {
        let node = node_of(&c, &id).await.expect("resident");
        let w = workers.iter().find(|w| w.name == node).expect("our worker");
        let root = w.data.join("runsc");
        let live = runsc_list(&root)
            .into_iter()
            .find(|cid| cid.starts_with(&format!("{id}-g")))
            .expect("its container on its worker");
        let bcid = format!("bench-restore-{i}");
        let bbundle = dir.join(&bcid);
        copy_bundle(&root, &live, &bbundle, &bcid);
        c.suspend(&id, Some(Tier::Parked)).await.expect("park");
        // Baseline first, on a copy of the very image the controller restores next.
        let image = dir.join(format!("img-{i}"));
        let st = Command::new("cp")
            .arg("-a")
            .arg(latest_image(&ctl.data, &id))
            .arg(&image)
            .status()
            .unwrap();
        assert!(st.success());
        let mut args = runsc_global(&baseline_root);
        args.extend([
            "restore".into(),
            "--detach".into(),
            format!("--image-path={}", image.display()),
            format!("--bundle={}", bbundle.display()),
            bcid.clone(),
        ]);
        bare.push(timed(
            Command::new("runsc").args(&args).stdout(Stdio::null()),
        ));
        let mut del = runsc_global(&baseline_root);
        del.extend(["delete".into(), "--force".into(), bcid.clone()]);
        let _ = Command::new("runsc").args(&del).output();
        let _ = std::fs::remove_dir_all(&image);
        let _ = std::fs::remove_dir_all(&bbundle);

        same.push(timed_true(&c, &id).await);
        if node_of(&c, &id).await.as_deref() == Some(node.as_str()) {
            same_node += 1;
        }
    }
    c.delete_sandbox(&id).await.expect("delete");
    rows.push(Row {
        name: "wake, same worker + exec",
        ms: same,
        note: format!("{same_node}/{n} woke on the worker they parked on"),
    });
    rows.push(Row {
        name: "bare runsc restore (same image)",
        ms: bare,
        note: "runsc restore --detach, copy of the image".into(),
    });
    eprintln!("same-worker row done at {:.0?}", started.elapsed());

    // --- 2. wake on another worker: w1 (where all of `moving` parked) is draining
    ctl.drain("w1").await;
    ctl.wait_state(&["w1"], "draining").await;
    let (mut other, mut moved) = (Vec::new(), 0);
    for id in &moving {
        other.push(timed_true(&c, id).await);
        if node_of(&c, id).await.is_some_and(|n| n != "w1") {
            moved += 1;
        }
        c.suspend(id, Some(Tier::Parked)).await.expect("park");
    }
    rows.push(Row {
        name: "wake, another worker + exec",
        ms: other,
        note: format!("{moved}/{n} woke off the draining worker they parked on"),
    });
    eprintln!("other-worker row done at {:.0?}", started.elapsed());

    // --- 3. after a worker loss: woken (from a park) on a worker that is then SIGKILLed
    let (mut lost, mut elsewhere, mut kills) = (Vec::new(), 0, Vec::new());
    let mut next = 4;
    let mut pending: Vec<String> = moving.clone();
    while !pending.is_empty() {
        let nodes = ctl.nodes().await;
        let ready: Vec<String> = workers
            .iter()
            .filter(|w| w.alive() && state_of(&nodes, &w.name) == Some("ready"))
            .map(|w| w.name.clone())
            .collect();
        if ready.len() < 2 {
            let name = format!("w{next}");
            next += 1;
            workers.push(Worker::start(dir, &ca, &name, &ctl.cluster));
            ctl.wait_state(&[&name], "ready").await;
            continue;
        }
        let round: Vec<String> = pending.drain(..pending.len().min(10)).collect();
        let mut on: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for id in &round {
            sh(&c, id, "true").await; // woken from its park: its image is the last checkpoint
            let node = node_of(&c, id).await.expect("resident");
            on.entry(node).or_default().push(id.clone());
        }
        let (victim, held) = on
            .into_iter()
            .max_by_key(|(_, ids)| ids.len())
            .expect("a worker holds them");
        // The ones on other workers go back to the queue, parked.
        for id in round.iter().filter(|id| !held.contains(id)) {
            c.suspend(id, Some(Tier::Parked)).await.expect("park");
            pending.push(id.clone());
        }
        workers
            .iter_mut()
            .find(|w| w.name == victim)
            .expect("our worker")
            .sigkill();
        ctl.wait_state(&[&victim], "lost").await;
        for id in &held {
            lost.push(timed_true(&c, id).await);
            let s = c.sandbox(id).await.expect("sandbox");
            if s.node.as_deref().is_some_and(|n| n != victim)
                && s.last_error.unwrap_or_default().contains("was lost")
            {
                elsewhere += 1;
            }
            c.suspend(id, Some(Tier::Parked)).await.expect("park");
        }
        kills.push(format!("{victim}:{}", held.len()));
    }
    rows.push(Row {
        name: "wake after a worker loss + exec",
        ms: lost,
        note: format!(
            "{elsewhere}/{n} resumed elsewhere with last_error set; kills {}",
            kills.join(" ")
        ),
    });
    eprintln!("loss row done at {:.0?}", started.elapsed());
    for id in &moving {
        let _ = c.delete_sandbox(id).await;
    }

    // --- report
    println!(
        "\n{:<34} {:>4} {:>9} {:>9} {:>9}  note",
        "wake (64 MiB)", "n", "p50 ms", "p95 ms", "p99 ms"
    );
    let mut json_rows = Vec::new();
    for r in &mut rows {
        let (p50, p95, p99) = (
            pct(&mut r.ms, 50.0),
            pct(&mut r.ms, 95.0),
            pct(&mut r.ms, 99.0),
        );
        println!(
            "{:<34} {:>4} {:>9.2} {:>9.2} {:>9.2}  {}",
            r.name,
            r.ms.len(),
            p50,
            p95,
            p99,
            r.note
        );
        json_rows.push(json!({
            "name": r.name, "n": r.ms.len(), "p50_ms": p50, "p95_ms": p95, "p99_ms": p99,
            "note": r.note,
        }));
    }
    let bare50 = json_rows[1]["p50_ms"].as_f64().unwrap();
    println!(
        "(p50 over bare runsc restore: same {:.2}, another {:.2}, after loss {:.2})",
        json_rows[0]["p50_ms"].as_f64().unwrap() / bare50,
        json_rows[2]["p50_ms"].as_f64().unwrap() / bare50,
        json_rows[3]["p50_ms"].as_f64().unwrap() / bare50,
    );
    println!(
        "\n{:<8} | {:>11} {:>9} {:>9} | {:>11} {:>9} {:>9} | {:>7}",
        "op", "ctl ops/s", "p50 ms", "p95 ms", "up ops/s", "p50 ms", "p95 ms", "ratio"
    );
    let mut json_life = Vec::new();
    for op in ["create", "park", "wake", "delete"] {
        let mut cm = clustered.ms[op].clone();
        let mut em = embedded.ms[op].clone();
        let cr = cm.len() as f64 / clustered.wall_s[op];
        let er = em.len() as f64 / embedded.wall_s[op];
        let (c50, c95, e50, e95) = (
            pct(&mut cm, 50.0),
            pct(&mut cm, 95.0),
            pct(&mut em, 50.0),
            pct(&mut em, 95.0),
        );
        println!(
            "{op:<8} | {cr:>11.2} {c50:>9.2} {c95:>9.2} | {er:>11.2} {e50:>9.2} {e95:>9.2} | {:>7.2}",
            cr / er
        );
        json_life.push(json!({
            "op": op, "n": cm.len(), "concurrency": conc,
            "controller_ops_s": cr, "controller_p50_ms": c50, "controller_p95_ms": c95,
            "embedded_ops_s": er, "embedded_p50_ms": e50, "embedded_p95_ms": e95,
            "ratio_ops_s": cr / er,
        }));
    }
    println!(
        "{}",
        json!({"bench": "cluster", "n": n, "workers": 3, "wake": json_rows, "lifecycle": json_life})
    );
    drop(workers);
    drop(ctl);
}
