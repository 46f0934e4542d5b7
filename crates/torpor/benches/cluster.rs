//! Cluster benchmark: wake latency on the same worker, on another worker and after a worker
//! loss, beside bare `runsc restore` of the same image; lifecycle operations per second through
//! one controller, through two controllers of one database (calls alternating between them),
//! and through the embedded `torpor up`; the cost of a forwarded call. Everything in one run,
//! on this machine.
//!
//!   cargo bench -p torpor --bench cluster            (as root, runsc and PostgreSQL installed)
//!   TORPOR_BENCH_N=20 TORPOR_BENCH_CONC=4 cargo bench -q --profile dev -p torpor --bench cluster
//!   TORPOR_BENCH_SETTLE=1 ...   (uploads waited for between batches: see `settle`)
//!   TORPOR_CLUSTER_ROWS=reencode ... (only the re-encoded copy's rows, below; one worker)
//!   TORPOR_CLUSTER_ROWS=forwarding ... (only the forwarding rows; two controllers, one worker)
//!   TORPOR_CLUSTER_ROWS=fetch ... (only a wake on another worker, with the fetch's own time
//!     and each park's upload; TORPOR_BENCH_WORKER_ARGS="--pack-size 0" for loose chunks;
//!     TORPOR_BENCH_STORE=s3 puts the store on moto_server's S3)
//!   TORPOR_CLUSTER_ROWS=stop ... (only a controller's stop: hand-off vs park; see `stop_rows`)
//!   TORPOR_CLUSTER_ROWS=handover ... (only a pool's hand-over: pass vs drain; `handover_rows`)
//!   TORPOR_BENCH_WORKER_ARGS="--upload-nice 0" ... (more flags for every worker)
//!   TORPOR_BIN=/path/to/torpor ... (every process runs that build: an older commit's, say)
//!
//! Real processes: a PostgreSQL server (`store::pg_testing`), two `torpor controller`s on it
//! (`c1`, `c2`), three (and more, as workers are killed) `torpor worker`s joining both, with
//! certificates from `torpor ca`, and a `torpor up` for the lifecycle baseline. Sandboxes come
//! from the built-in `host` template and hold 64 MiB of random bytes in /dev/shm (memory, so in
//! every checkpoint image). The wake rows go through `c1` alone (`c2` is up and idle).
//!
//! | row | what is timed |
//! |---|---|
//! | wake, same worker | exec `true` on a sandbox parked and uploaded (Suspended), all workers ready (it goes back to its own, which kept a copy) |
//! | upload after a park | from the park call's answer until the checkpoint is in the store (the worker uploads it) |
//! | wake, another worker | the same with the worker it parked on draining (the other worker fetches it from the store) |
//! | wake after a worker loss | the first call after the worker it ran on was SIGKILLed and is `lost` |
//! | bare `runsc restore` | `runsc restore --detach` of a copy of the same image, same bundle |
//! | lifecycle | create, park, wake (exec `true`), delete of N sandboxes, C at a time: through `c1`; through `c1` and `c2` alternately (half the park and delete calls reach the controller that does not hold the sandbox, so are forwarded); through `torpor up` |
//! | forwarding | exec `true` on a running sandbox through the controller that holds it vs through the other one (forwarded), `TORPOR_BENCH_FWD_N` (200) each, interleaved |
//! | a controller's stop (`TORPOR_CLUSTER_ROWS=stop`) | SIGTERM to exit of a controller holding `TORPOR_BENCH_SANDBOXES` (8) sandboxes of 64 MiB, and the first exec `true` on each through the other controller, with `--on-stop hand-off` and, the baseline, `--on-stop park`, alternating for `TORPOR_BENCH_ROUNDS` (3) rounds each |
//! | a pool's hand-over (`TORPOR_CLUSTER_ROWS=handover`) | a controller holding two dispatch pools of `TORPOR_BENCH_SANDBOXES` (4) running agents of 64 MiB each; a second controller starts and is handed one: from its start until it scales that pool with every agent active, and the first exec `true` on each agent through it, with `--pool-hand-over pass` and, the baseline, `--pool-hand-over drain`, alternating for `TORPOR_BENCH_ROUNDS` (3) rounds each; a redis-list trigger (redis-server) |
//! | re-encoded copy (`TORPOR_CLUSTER_ROWS=reencode`) | a sandbox holding 64 MiB of compressible text: parked, uploaded, its worker's copy re-encoded (waited for), then exec `true` (wakes from that copy); baselines in the same round: bare `runsc restore` of the image as runsc wrote it (copied before its upload) and of the re-encoded copy |
//!
//! Prints three tables and one JSON line (`{"bench":"cluster",...}`).

#[path = "../tests/common/brokers.rs"]
mod brokers;
#[path = "support/cluster.rs"]
mod cluster;
#[path = "../../torpor-snapshot/tests/support/moto.rs"]
mod moto;
mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster::{fresh_addrs, runsc_list, state_of, torpor, Controller, Worker};
use serde_json::{json, Value};
use support::{pct, Daemon};
use torpor_api::types::{CreateSandboxBody, ExecBody, Sandbox};
use torpor_api::Client;
use torpor_control::store::pg_testing;
use torpor_core::Tier;

/// 64 MiB of incompressible bytes in the sandbox's memory (/dev is a tmpfs in gVisor).
const FILL_64M: &str =
    "mkdir -p /dev/shm && dd if=/dev/urandom of=/dev/shm/blob bs=1M count=64 status=none";

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

/// The newest checkpoint of a sandbox on the worker that wrote it (`DATA/images/<id>-g<N>`,
/// kept there as a copy of its snapshot until a restore from it).
fn latest_image(worker_data: &Path, id: &str) -> PathBuf {
    let dir = worker_data.join("images");
    let prefix = format!("{id}-g");
    std::fs::read_dir(&dir)
        .expect("images directory")
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| {
            let g: u64 = e
                .file_name()
                .to_str()?
                .strip_prefix(&prefix)?
                .parse()
                .ok()?;
            Some((g, e.path()))
        })
        .max()
        .expect("a committed image")
        .1
}

/// Waits until a parked sandbox's checkpoint is in the store (cluster mode uploads it from
/// its worker right after the park); returns how long that took from now.
async fn wait_uploaded(c: &Client, id: &str) -> f64 {
    let t = Instant::now();
    let deadline = t + Duration::from_secs(300);
    loop {
        let s = c.sandbox(id).await.expect("sandbox");
        if s.state == "suspended" {
            return t.elapsed().as_secs_f64() * 1000.0;
        }
        assert!(Instant::now() < deadline, "never uploaded: {s:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `TORPOR_BENCH_SETTLE=1`: every park's upload is waited for (untimed) before the next batch
/// and before the cluster's lifecycle rows, so that no batch shares the machine with uploads.
fn settle() -> bool {
    std::env::var("TORPOR_BENCH_SETTLE").as_deref() == Ok("1")
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

/// Latencies (ms) per operation, the wall time (s) of each batch, and how many of each batch's
/// calls reached a controller that did not hold the sandbox (so were forwarded to its holder).
#[derive(Default)]
struct Lifecycle {
    ms: BTreeMap<&'static str, Vec<f64>>,
    wall_s: BTreeMap<&'static str, f64>,
    forwarded: BTreeMap<&'static str, usize>,
    /// Woken sandboxes held afterwards by the controller that received the wake call.
    woken_by_receiver: usize,
}

/// Runs `op(k, item)` on every item (k: its place in `items`), `conc` at a time; returns
/// (latencies, wall seconds).
async fn batch<T, F, Fut>(items: &[T], conc: usize, op: F) -> (Vec<f64>, f64)
where
    T: Clone,
    F: Fn(usize, T) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let sem = Arc::new(tokio::sync::Semaphore::new(conc));
    let mut set = tokio::task::JoinSet::new();
    let t = Instant::now();
    for (k, item) in items.iter().enumerate() {
        let permit = sem.clone().acquire_owned().await.unwrap();
        let fut = op(k, item.clone());
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

/// The API a sandbox's calls can go to: one or more controllers of one database (by name, as
/// a sandbox's `controller` says), or the embedded daemon (no name).
struct Apis {
    clients: Vec<Client>,
    names: Vec<Option<String>>,
}

impl Apis {
    fn one(client: &Client, name: Option<&str>) -> Apis {
        Apis {
            clients: vec![client.clone()],
            names: vec![name.map(str::to_string)],
        }
    }

    /// The index of the controller holding a sandbox, as its `controller` field says.
    fn holder(&self, s: &Sandbox) -> usize {
        self.names
            .iter()
            .position(|n| *n == s.controller)
            .unwrap_or_else(|| panic!("{} held by {:?}, not one of ours", s.id, s.controller))
    }

    /// Which API the k-th call of a batch for a sandbox held by `holder` goes to: its holder on
    /// even k, the next controller on odd k (with two: half the calls forwarded).
    fn route(&self, k: usize, holder: usize) -> usize {
        (holder + k) % self.clients.len()
    }
}

async fn lifecycle(apis: &Apis, n: usize, conc: usize) -> Lifecycle {
    let mut out = Lifecycle::default();
    let len = apis.clients.len();
    // Create: N slots' worth, C at a time, the k-th through API k mod len; each sandbox is then
    // held by the controller that created it (its `controller`).
    let made = Arc::new(tokio::sync::Mutex::new(Vec::new()));
    let slots: Vec<usize> = (0..n).collect();
    let (ms, wall) = batch(&slots, conc, |k, _| {
        let (c, made) = (apis.clients[k % len].clone(), made.clone());
        async move {
            let sb = c
                .create_sandbox(&CreateSandboxBody {
                    template: "host".into(),
                    ..Default::default()
                })
                .await
                .expect("create");
            made.lock().await.push(sb);
        }
    })
    .await;
    out.ms.insert("create", ms);
    out.wall_s.insert("create", wall);
    out.forwarded.insert("create", 0);
    let held: Vec<(String, usize)> = made
        .lock()
        .await
        .iter()
        .map(|s| (s.id.clone(), apis.holder(s)))
        .collect();
    // Untimed: the 64 MiB each sandbox carries through park and wake.
    batch(&held, conc, |_, (id, h)| {
        let c = apis.clients[h].clone();
        async move { sh(&c, &id, FILL_64M).await }
    })
    .await;
    let (ms, wall) = batch(&held, conc, |k, (id, h)| {
        let c = apis.clients[apis.route(k, h)].clone();
        async move {
            c.suspend(&id, Some(Tier::Parked)).await.expect("park");
        }
    })
    .await;
    let forwarded = |held: &[(String, usize)]| {
        held.iter()
            .enumerate()
            .filter(|(k, (_, h))| apis.route(*k, *h) != *h)
            .count()
    };
    out.ms.insert("park", ms);
    out.wall_s.insert("park", wall);
    out.forwarded.insert("park", forwarded(&held));
    if settle() && apis.names[0].is_some() {
        // Untimed: every park's upload done before the next batch, so that the wakes and the
        // deletes do not share the machine with them.
        for (id, h) in &held {
            wait_uploaded(&apis.clients[*h], id).await;
        }
    }
    // Wake: a parked sandbox is held by nobody; the controller that receives the call wakes it
    // and holds it from then on (checked after the batch, untimed).
    let (ms, wall) = batch(&held, conc, |k, (id, _)| {
        let c = apis.clients[k % len].clone();
        async move {
            timed_true(&c, &id).await;
        }
    })
    .await;
    out.ms.insert("wake", ms);
    out.wall_s.insert("wake", wall);
    out.forwarded.insert("wake", 0);
    let mut woken = Vec::new();
    for (k, (id, _)) in held.iter().enumerate() {
        let s = apis.clients[0].sandbox(id).await.expect("sandbox");
        let h = apis.holder(&s);
        if h == k % len {
            out.woken_by_receiver += 1;
        }
        woken.push((id.clone(), h));
    }
    let (ms, wall) = batch(&woken, conc, |k, (id, h)| {
        let c = apis.clients[apis.route(k, h)].clone();
        async move { c.delete_sandbox(&id).await.expect("delete") }
    })
    .await;
    out.ms.insert("delete", ms);
    out.wall_s.insert("delete", wall);
    out.forwarded.insert("delete", forwarded(&woken));
    out
}

/// Exec `true` on running sandboxes through the controller that holds them and through the
/// other one (forwarded to the holder): one sandbox held by each controller, `n` calls each way,
/// interleaved (the sandbox and which way goes first alternate), after 10 untimed calls each
/// way per sandbox. Returns the two rows (holder, forwarded).
async fn forwarding(apis: &Apis, n: usize) -> (Row, Row) {
    let mut held = Vec::new();
    for h in 0..2 {
        let id = create_host(&apis.clients[h]).await;
        let s = apis.clients[1 - h].sandbox(&id).await.expect("sandbox");
        assert_eq!(
            apis.holder(&s),
            h,
            "created through {:?}, held by {:?}",
            apis.names[h],
            s.controller
        );
        held.push((id, h, s.node));
    }
    for (id, h, _) in &held {
        for _ in 0..10 {
            timed_true(&apis.clients[*h], id).await;
            timed_true(&apis.clients[1 - *h], id).await;
        }
    }
    let (mut direct, mut forwarded) = (Vec::new(), Vec::new());
    for i in 0..n {
        let (id, h, _) = &held[i % 2];
        let (holder, other) = (&apis.clients[*h], &apis.clients[1 - *h]);
        if (i / 2) % 2 == 0 {
            direct.push(timed_true(holder, id).await);
            forwarded.push(timed_true(other, id).await);
        } else {
            forwarded.push(timed_true(other, id).await);
            direct.push(timed_true(holder, id).await);
        }
    }
    // Every call stayed with the holder: same controller, same worker, still running.
    let mut kept = 0;
    for (id, h, node) in &held {
        let s = apis.clients[1 - *h].sandbox(id).await.expect("sandbox");
        if apis.holder(&s) == *h && s.node == *node && s.state == "running" {
            kept += 1;
        }
        apis.clients[*h].delete_sandbox(id).await.expect("delete");
    }
    let note = format!(
        "2 sandboxes (held by c1, by c2), alternating; {kept}/2 still running on their worker, same holder"
    );
    (
        Row {
            name: "exec true, through its holder",
            ms: direct,
            note: note.clone(),
        },
        Row {
            name: "exec true, through the other (fwd)",
            ms: forwarded,
            note,
        },
    )
}

struct Row {
    name: &'static str,
    ms: Vec<f64>,
    note: String,
}

/// 64 MiB of compressible text in the sandbox's memory (base64 of random bytes: 6 bits of
/// entropy a byte, so deflate takes it to ~3/4 and inflating it costs what real state does;
/// a repeated line would shrink 50-fold and inflate almost for free): runsc's frames shrink
/// it enough for the worker to re-encode its copy.
const FILL_64M_TEXT: &str =
    "mkdir -p /dev/shm && head -c 50331648 /dev/urandom | base64 -w0 > /dev/shm/blob";

/// `runsc restore --detach` of `image` in a copy `bundle` as container `cid`, timed, then
/// deleted.
fn bare_restore(root: &Path, image: &Path, bundle: &Path, cid: &str) -> f64 {
    let mut args = runsc_global(root);
    args.extend([
        "restore".into(),
        "--detach".into(),
        format!("--image-path={}", image.display()),
        format!("--bundle={}", bundle.display()),
        cid.to_string(),
    ]);
    let ms = timed(Command::new("runsc").args(&args).stdout(Stdio::null()));
    let mut del = runsc_global(root);
    del.extend(["delete".into(), "--force".into(), cid.to_string()]);
    let _ = Command::new("runsc").args(&del).output();
    ms
}

fn copy_dir(from: &Path, to: &Path) {
    let st = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .unwrap();
    assert!(st.success(), "cp -a {from:?} {to:?}");
}

/// `TORPOR_CLUSTER_ROWS=fetch`: what a wake on another worker costs over one from a local
/// image. One controller; `n` sandboxes holding 64 MiB of random bytes are parked (and
/// uploaded) on w1, each image copied as the baseline's; then w2 joins and w1 drains, and each
/// sandbox is woken on w2 (exec `true`: the fetch from the store, the restore, the exec). In
/// the same round: a bare `runsc restore` of the copied image (no fetch), and the worker's own
/// figure for the fetch (its log's `snapshot fetched ms=`).
async fn fetch_rows(n: usize) {
    let Some((database, tmp)) = bench_setup().await else {
        return;
    };
    let dir = tmp.path();
    let ca = dir.join("ca");
    // `TORPOR_BENCH_STORE=s3`: the store is moto_server's S3 (as the tests use), not a
    // directory: every fetch is ~3,400 GETs of a Python server on these same two cores.
    let s3 = std::env::var("TORPOR_BENCH_STORE").as_deref() == Ok("s3");
    let _moto = s3.then(|| {
        let moto = moto::Moto::start();
        moto.create_bucket("torpor-bench");
        for (k, v) in [
            ("AWS_ENDPOINT_URL", moto.endpoint()),
            ("AWS_ACCESS_KEY_ID", "test".into()),
            ("AWS_SECRET_ACCESS_KEY", "test".into()),
            ("AWS_REGION", "us-east-1".into()),
        ] {
            // Before any process starts; they inherit it.
            std::env::set_var(k, v);
        }
        moto
    });
    let store_args: &[&str] = if s3 {
        &["--store", "s3://torpor-bench/cluster"]
    } else {
        &[]
    };
    let ctl = Controller::start_at(dir, &ca, &database, "c1", fresh_addrs(), store_args).await;
    let w1 = Worker::start(dir, &ca, "w1", &ctl.cluster);
    ctl.wait_state(&["w1"], "ready").await;
    let c = ctl.client.clone();
    wait_host_template(&c).await;
    let root = w1.data.join("runsc");
    let baseline_root = dir.join("baseline-runsc");
    std::fs::create_dir_all(&baseline_root).unwrap();
    let (mut ids, mut uploads) = (Vec::new(), Vec::new());
    for i in 0..n {
        let id = create_host(&c).await;
        sh(&c, &id, FILL_64M).await;
        let live = runsc_list(&root)
            .into_iter()
            .find(|cid| cid.starts_with(&format!("{id}-g")))
            .expect("its container on its worker");
        copy_bundle(
            &root,
            &live,
            &dir.join(format!("bundle-{i}")),
            &format!("bench-{i}"),
        );
        c.suspend(&id, Some(Tier::Parked)).await.expect("park");
        uploads.push(wait_uploaded(&c, &id).await);
        copy_dir(&latest_image(&w1.data, &id), &dir.join(format!("img-{i}")));
        ids.push(id);
    }
    let _w2 = Worker::start(dir, &ca, "w2", &ctl.cluster);
    ctl.wait_state(&["w2"], "ready").await;
    ctl.drain("w1").await;
    ctl.wait_state(&["w1"], "draining").await;
    let fetched = || -> Vec<f64> {
        std::fs::read_to_string(dir.join("w2.log"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("snapshot fetched"))
            // Builds before 2026-12-04 colour their log's fields even in a file.
            .map(strip_ansi)
            .filter_map(|l| {
                l.split(" ms=")
                    .nth(1)?
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()
            })
            .collect()
    };
    let (mut wake, mut bare, mut moved) = (Vec::new(), Vec::new(), 0);
    for (i, id) in ids.iter().enumerate() {
        let (img, bundle) = (
            dir.join(format!("img-{i}")),
            dir.join(format!("bundle-{i}")),
        );
        bare.push(bare_restore(
            &baseline_root,
            &img,
            &bundle,
            &format!("bench-{i}"),
        ));
        let _ = std::fs::remove_dir_all(&img);
        wake.push(timed_true(&c, id).await);
        if node_of(&c, id).await.as_deref() == Some("w2") {
            moved += 1;
        }
        c.delete_sandbox(id).await.expect("delete");
    }
    let fetch = fetched();
    let mut rows = vec![
        Row {
            name: "wake, another worker + exec",
            ms: wake,
            note: format!("{moved}/{n} woke on w2, fetched from the store"),
        },
        Row {
            name: "fetch (the worker's figure)",
            ms: fetch,
            note: "w2's log: snapshot fetched ms=".into(),
        },
        Row {
            name: "bare runsc restore (same image)",
            ms: bare,
            note: "runsc restore --detach of a copy of the image, no fetch".into(),
        },
        Row {
            name: "upload after a park (64 MiB)",
            ms: uploads,
            note: "park answered -> suspended (w1 put it in the store)".into(),
        },
    ];
    let json_rows = print_rows("wake (64 MiB), fetched", &mut rows);
    let p50 = |k: usize| json_rows[k]["p50_ms"].as_f64().unwrap_or(f64::NAN);
    println!(
        "(p50: wake on another worker / bare restore {:.2}; fetch / bare restore {:.2})",
        p50(0) / p50(2),
        p50(1) / p50(2)
    );
    println!(
        "{}",
        json!({"bench": "cluster", "fetch": {"n": n, "rows": json_rows,
            "store": if s3 { "s3 (moto)" } else { "directory" },
            "wake_over_bare_runsc_p50": p50(0) / p50(2)}})
    );
}

/// A log line without its colour codes (`ESC [ … m`).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The re-encoded copy's rows: one controller, one worker (re-encoding on, the default).
/// A fresh database on the tests' PostgreSQL and a temporary directory with the pinned binary
/// and a CA (`DIR/ca`); `None` (said so) without PostgreSQL.
async fn bench_setup() -> Option<(String, tempfile::TempDir)> {
    let database = tokio::task::spawn_blocking(|| {
        pg_testing::server().map(|pg| pg.url(&pg_testing::new_database(pg)))
    })
    .await
    .expect("pg harness");
    let Some(database) = database else {
        println!("cluster bench: no PostgreSQL (scripts/deps.sh installs it); nothing measured");
        return None;
    };
    let tmp = tempfile::Builder::new()
        .prefix("torpor-bench-cluster-")
        .tempdir()
        .expect("temp dir");
    let dir = tmp.path();
    cluster::pin_binary(dir);
    cluster::logs_on_panic(dir);
    let ca = dir.join("ca");
    torpor(&[
        "ca",
        "init",
        "--dir",
        ca.to_str().unwrap(),
        "--trust-domain",
        "bench.cluster",
    ]);
    Some((database, tmp))
}

async fn reencode_rows(n: usize) {
    let Some((database, tmp)) = bench_setup().await else {
        return;
    };
    let dir = tmp.path();
    let ca = dir.join("ca");
    let ctl = Controller::start_as(dir, &ca, &database, "c1").await;
    let w = Worker::start(dir, &ca, "w1", &ctl.cluster);
    ctl.wait_state(&["w1"], "ready").await;
    let c = ctl.client.clone();
    wait_host_template(&c).await;
    let log = dir.join("w1.log");
    let reencoded = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .matches("local copy re-encoded with stored frames")
            .count()
    };
    let root = w.data.join("runsc");
    let baseline_root = dir.join("baseline-runsc");
    std::fs::create_dir_all(&baseline_root).unwrap();
    let id = create_host(&c).await;
    sh(&c, &id, FILL_64M_TEXT).await;
    let (mut wake, mut bare_runsc, mut bare_stored) = (Vec::new(), Vec::new(), Vec::new());
    let (mut sizes, mut same_node) = ((0u64, 0u64), 0);
    for i in 0..n {
        let live = runsc_list(&root)
            .into_iter()
            .find(|cid| cid.starts_with(&format!("{id}-g")))
            .expect("its container on its worker");
        let (ba, bb) = (dir.join(format!("ba-{i}")), dir.join(format!("bb-{i}")));
        copy_bundle(&root, &live, &ba, &format!("bench-a-{i}"));
        copy_bundle(&root, &live, &bb, &format!("bench-b-{i}"));
        let before = reencoded();
        c.suspend(&id, Some(Tier::Parked)).await.expect("park");
        // The image as runsc wrote it: committed before the park answered, re-encoded only
        // after its upload.
        let img = latest_image(&w.data, &id);
        let (orig, stored) = (
            dir.join(format!("orig-{i}")),
            dir.join(format!("stored-{i}")),
        );
        copy_dir(&img, &orig);
        wait_uploaded(&c, &id).await;
        let deadline = Instant::now() + Duration::from_secs(120);
        while reencoded() == before {
            assert!(Instant::now() < deadline, "the copy was not re-encoded");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        copy_dir(&img, &stored);
        let size = |d: &Path| std::fs::metadata(d.join("checkpoint.img")).map_or(0, |m| m.len());
        sizes = (size(&orig), size(&stored));
        // Baselines in alternating order, then the wake.
        let a = || bare_restore(&baseline_root, &orig, &ba, &format!("bench-a-{i}"));
        let b = || bare_restore(&baseline_root, &stored, &bb, &format!("bench-b-{i}"));
        if i % 2 == 0 {
            bare_runsc.push(a());
            bare_stored.push(b());
        } else {
            bare_stored.push(b());
            bare_runsc.push(a());
        }
        for d in [&orig, &stored, &ba, &bb] {
            let _ = std::fs::remove_dir_all(d);
        }
        wake.push(timed_true(&c, &id).await);
        if node_of(&c, &id).await.as_deref() == Some("w1") {
            same_node += 1;
        }
    }
    let _ = c.delete_sandbox(&id).await;
    let mut rows = vec![
        Row {
            name: "wake from the re-encoded copy + exec",
            ms: wake,
            note: format!("{same_node}/{n} on w1, each after its copy was re-encoded"),
        },
        Row {
            name: "bare runsc restore, image as runsc wrote it",
            ms: bare_runsc,
            note: format!("{} bytes", sizes.0),
        },
        Row {
            name: "bare runsc restore, re-encoded copy",
            ms: bare_stored,
            note: format!("{} bytes", sizes.1),
        },
    ];
    let json_rows = print_rows("wake (64 MiB of text)", &mut rows);
    let p50 = |k: usize| json_rows[k]["p50_ms"].as_f64().unwrap_or(f64::NAN);
    let ratio = p50(0) / p50(1);
    println!(
        "(p50: wake / bare restore of runsc's image {ratio:.2}; re-encoded / runsc's image, bare {:.2})",
        p50(2) / p50(1)
    );
    println!(
        "{}",
        json!({"bench": "cluster", "reencode": {"n": n, "rows": json_rows,
            "wake_over_bare_runsc_p50": ratio, "image_bytes": [sizes.0, sizes.1]}})
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    match std::env::var("TORPOR_CLUSTER_ROWS").as_deref() {
        Ok("reencode") => return reencode_rows(env_usize("TORPOR_BENCH_N", 10)).await,
        Ok("forwarding") => return forwarding_rows(env_usize("TORPOR_BENCH_FWD_N", 200)).await,
        Ok("fetch") => return fetch_rows(env_usize("TORPOR_BENCH_N", 10)).await,
        Ok("handover") => {
            return handover_rows(
                env_usize("TORPOR_BENCH_ROUNDS", 3),
                env_usize("TORPOR_BENCH_SANDBOXES", 4),
            )
            .await
        }
        Ok("stop") => {
            return stop_rows(
                env_usize("TORPOR_BENCH_ROUNDS", 3),
                env_usize("TORPOR_BENCH_SANDBOXES", 8),
            )
            .await
        }
        _ => {}
    }
    let n = env_usize("TORPOR_BENCH_N", 20);
    let conc = env_usize("TORPOR_BENCH_CONC", 4);
    let Some((database, tmp)) = bench_setup().await else {
        return;
    };
    let dir = tmp.path();
    let started = Instant::now();

    // --- lifecycle through the embedded daemon (same sequence, same machine, this run)
    let embedded = {
        let d = Daemon::start(&["--workers", "24", "--memory-budget", "16G"]).await;
        wait_host_template(&d.client).await;
        lifecycle(&Apis::one(&d.client, None), n, conc).await
    };
    eprintln!("embedded lifecycle done at {:.0?}", started.elapsed());

    // --- the cluster: two controllers on the database, the first worker (joining both)
    let ca = dir.join("ca");
    // Each sandbox stays with the controller that made it (the rows say which one they go
    // through): no balancing between them.
    let fixed = ["--balance-sandboxes", "false"];
    let ctl = Controller::start_at(dir, &ca, &database, "c1", fresh_addrs(), &fixed).await;
    let ctl2 = Controller::start_at(dir, &ca, &database, "c2", fresh_addrs(), &fixed).await;
    let both = format!("{},{}", ctl.cluster, ctl2.cluster);
    let c = ctl.client.clone();
    let mut workers = vec![Worker::start(dir, &ca, "w1", &both)];
    for x in [&ctl, &ctl2] {
        x.wait_state(&["w1"], "ready").await;
    }
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
    if settle() {
        for id in &moving {
            wait_uploaded(&c, id).await;
        }
    }
    for w in ["w2", "w3"] {
        workers.push(Worker::start(dir, &ca, w, &both));
    }
    for x in [&ctl, &ctl2] {
        x.wait_state(&["w1", "w2", "w3"], "ready").await;
    }
    eprintln!("cluster up at {:.0?}", started.elapsed());

    // --- lifecycle through c1 alone, then through c1 and c2 alternately; three workers ready
    let clustered = lifecycle(&Apis::one(&c, Some("c1")), n, conc).await;
    eprintln!("cluster lifecycle (c1) done at {:.0?}", started.elapsed());
    let pair = Apis {
        clients: vec![c.clone(), ctl2.client.clone()],
        names: vec![Some("c1".into()), Some("c2".into())],
    };
    let two = lifecycle(&pair, n, conc).await;
    eprintln!(
        "cluster lifecycle (c1+c2) done at {:.0?}",
        started.elapsed()
    );

    // --- forwarding: exec `true` on a running sandbox through its holder vs the other one
    let fwd_n = env_usize("TORPOR_BENCH_FWD_N", 200);
    let fwd = forwarding(&pair, fwd_n).await;
    eprintln!("forwarding rows done at {:.0?}", started.elapsed());

    let mut rows = Vec::new();

    // --- 1. wake on the same worker, beside bare runsc restore of the same image
    let baseline_root = dir.join("baseline-runsc");
    std::fs::create_dir_all(&baseline_root).unwrap();
    let id = create_host(&c).await;
    sh(&c, &id, FILL_64M).await;
    let (mut same, mut bare, mut same_node) = (Vec::new(), Vec::new(), 0);
    let mut uploads = Vec::new();
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
        uploads.push(wait_uploaded(&c, &id).await);
        // Baseline first, on a copy of the very image the controller restores next (the
        // worker's copy of what it uploaded).
        let image = dir.join(format!("img-{i}"));
        let st = Command::new("cp")
            .arg("-a")
            .arg(latest_image(&w.data, &id))
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
        name: "upload after a park (until Suspended)",
        ms: uploads,
        note: "from the park call's answer to the record in the store".into(),
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
            workers.push(Worker::start(dir, &ca, &name, &both));
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
    let json_rows = print_rows("wake (64 MiB)", &mut rows);
    let p50 = |name: &str| {
        json_rows
            .iter()
            .find(|r| r["name"] == name)
            .and_then(|r| r["p50_ms"].as_f64())
            .unwrap_or(f64::NAN)
    };
    let bare50 = p50("bare runsc restore (same image)");
    println!(
        "(p50 over bare runsc restore: same {:.2}, another {:.2}, after loss {:.2})",
        p50("wake, same worker + exec") / bare50,
        p50("wake, another worker + exec") / bare50,
        p50("wake after a worker loss + exec") / bare50,
    );
    let (json_fwd, (f50, h50), (f99, h99)) = print_forwarding(fwd);
    println!(
        "\n{:<8} | {:>9} {:>8} {:>8} | {:>9} {:>8} {:>8} {:>5} | {:>9} {:>8} {:>8} | {:>6} {:>6}",
        "op",
        "c1 ops/s",
        "p50 ms",
        "p95 ms",
        "c1+c2 o/s",
        "p50 ms",
        "p95 ms",
        "fwd",
        "up ops/s",
        "p50 ms",
        "p95 ms",
        "c1/up",
        "c12/up"
    );
    let mut json_life = Vec::new();
    for op in ["create", "park", "wake", "delete"] {
        let (cr, c50, c95, cmax) = rate(&clustered, op);
        let (tr, t50, t95, tmax) = rate(&two, op);
        let (er, e50, e95, emax) = rate(&embedded, op);
        let fwd_calls = two.forwarded[op];
        let calls = two.ms[op].len();
        println!(
            "{op:<8} | {cr:>9.2} {c50:>8.1} {c95:>8.1} | {tr:>9.2} {t50:>8.1} {t95:>8.1} {:>5} | {er:>9.2} {e50:>8.1} {e95:>8.1} | {:>6.2} {:>6.2}",
            format!("{fwd_calls}/{calls}"),
            cr / er,
            tr / er
        );
        json_life.push(json!({
            "op": op, "n": calls, "concurrency": conc,
            "controller_ops_s": cr, "controller_p50_ms": c50, "controller_p95_ms": c95,
            "controller_max_ms": cmax,
            "two_controllers_ops_s": tr, "two_controllers_p50_ms": t50,
            "two_controllers_p95_ms": t95, "two_controllers_max_ms": tmax,
            "two_controllers_forwarded": fwd_calls,
            "embedded_ops_s": er, "embedded_p50_ms": e50, "embedded_p95_ms": e95,
            "embedded_max_ms": emax,
            "ratio_ops_s": cr / er, "ratio_two_ops_s": tr / er,
        }));
    }
    println!(
        "(c1+c2: creates and wakes alternate between the controllers, {}/{} woken sandboxes held by the one that woke them; park and delete go to the holder or, every other call, to the other one)",
        two.woken_by_receiver, n
    );
    println!(
        "{}",
        json!({
            "bench": "cluster", "n": n, "workers": 3, "controllers": 2, "settled": settle(),
            "wake": json_rows,
            "lifecycle": json_life, "forwarding": json_fwd,
            "forwarding_overhead_ms": {"p50": f50 - h50, "p99": f99 - h99},
        })
    );
    drop(workers);
    drop(ctl2);
    drop(ctl);
}

/// Prints the forwarding rows and what forwarding adds; returns them as JSON with the
/// (forwarded, holder) p50 and p99.
fn print_forwarding(fwd: (Row, Row)) -> (Vec<Value>, (f64, f64), (f64, f64)) {
    let json_fwd = print_rows("running sandbox, 2 controllers", &mut [fwd.0, fwd.1]);
    let at = |i: usize, k: &str| json_fwd[i][k].as_f64().unwrap_or(f64::NAN);
    let (h50, f50, h99, f99) = (
        at(0, "p50_ms"),
        at(1, "p50_ms"),
        at(0, "p99_ms"),
        at(1, "p99_ms"),
    );
    println!(
        "(forwarding adds {:.2} ms at p50, {:.2} ms at p99)",
        f50 - h50,
        f99 - h99
    );
    (json_fwd, (f50, h50), (f99, h99))
}

/// `TORPOR_CLUSTER_ROWS=forwarding`: two controllers, one worker joining both, and only the
/// forwarding rows (exec `true` through the holder vs through the other controller).
async fn forwarding_rows(n: usize) {
    let Some((database, tmp)) = bench_setup().await else {
        return;
    };
    let dir = tmp.path();
    let ca = dir.join("ca");
    let ctl = Controller::start_as(dir, &ca, &database, "c1").await;
    let ctl2 = Controller::start_as(dir, &ca, &database, "c2").await;
    let both = format!("{},{}", ctl.cluster, ctl2.cluster);
    let worker = Worker::start(dir, &ca, "w1", &both);
    for x in [&ctl, &ctl2] {
        x.wait_state(&["w1"], "ready").await;
    }
    wait_host_template(&ctl.client).await;
    let pair = Apis {
        clients: vec![ctl.client.clone(), ctl2.client.clone()],
        names: vec![Some("c1".into()), Some("c2".into())],
    };
    let fwd = forwarding(&pair, n).await;
    let (json_fwd, (f50, h50), (f99, h99)) = print_forwarding(fwd);
    println!(
        "{}",
        json!({
            "bench": "cluster", "rows": "forwarding", "n": n, "workers": 1, "controllers": 2,
            "forwarding": json_fwd,
            "forwarding_overhead_ms": {"p50": f50 - h50, "p99": f99 - h99},
        })
    );
    drop(worker);
    drop(ctl2);
    drop(ctl);
}

/// Ops/s of a lifecycle batch (calls / its wall time), p50, p95 and max latency in ms.
fn rate(l: &Lifecycle, op: &str) -> (f64, f64, f64, f64) {
    let mut ms = l.ms[op].clone();
    let max = ms.iter().copied().fold(0.0, f64::max);
    (
        ms.len() as f64 / l.wall_s[op],
        pct(&mut ms, 50.0),
        pct(&mut ms, 95.0),
        max,
    )
}

/// Prints rows of latencies under `title`; returns them as JSON.
/// The rows of two measures, each taken in two modes (the first mode compared with the
/// second, its baseline): `names` of the four rows, measure by measure, mode by mode; the
/// first measure's notes by mode, the second's one note.
fn mode_rows(
    names: [&'static str; 4],
    modes: [&str; 2],
    (mut a, a_note): (BTreeMap<&str, Vec<f64>>, impl Fn(&str) -> String),
    (mut b, b_note): (BTreeMap<&str, Vec<f64>>, &str),
) -> Vec<Row> {
    let mut rows = Vec::new();
    for (i, mode) in modes.into_iter().enumerate() {
        rows.push(Row {
            name: names[i],
            ms: a.remove(mode).unwrap_or_default(),
            note: a_note(mode),
        });
    }
    for (i, mode) in modes.into_iter().enumerate() {
        rows.push(Row {
            name: names[2 + i],
            ms: b.remove(mode).unwrap_or_default(),
            note: b_note.to_string(),
        });
    }
    rows
}

/// [`print_rows`] of [`mode_rows`], then the first mode's p50 over the second's for each
/// measure (`what`): the rows as JSON and the two ratios.
fn print_mode_rows(
    title: &str,
    modes: [&str; 2],
    what: [&str; 2],
    rows: &mut [Row],
) -> (Vec<Value>, f64, f64) {
    let json_rows = print_rows(title, rows);
    let p50 = |i: usize| json_rows[i]["p50_ms"].as_f64().unwrap_or(f64::NAN);
    let (a, b) = (p50(0) / p50(1), p50(2) / p50(3));
    println!(
        "\n{} / {} at p50: {} {a:.3}x, {} {b:.3}x",
        modes[0], modes[1], what[0], what[1]
    );
    (json_rows, a, b)
}

fn print_rows(title: &str, rows: &mut [Row]) -> Vec<Value> {
    println!(
        "\n{:<34} {:>4} {:>9} {:>9} {:>9}  note",
        title, "n", "p50 ms", "p95 ms", "p99 ms"
    );
    let mut out = Vec::new();
    for r in rows {
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
        out.push(json!({
            "name": r.name, "n": r.ms.len(), "p50_ms": p50, "p95_ms": p95, "p99_ms": p99,
            "note": r.note,
        }));
    }
    out
}

/// `TORPOR_CLUSTER_ROWS=stop`: what a controller's stop (SIGTERM: a rolling update) costs the
/// sandboxes it holds. Two controllers and one worker joining both. Each round starts `c2`
/// again at the same addresses with `--on-stop hand-off` or, the baseline in the same run,
/// `--on-stop park` (how every stop went before), alternating; creates `k` sandboxes holding
/// 64 MiB of random bytes in memory through it; SIGTERMs it, timing until it has exited; then
/// times the first exec `true` on each through `c1` (an adoption after a hand-off, a wake from
/// the checkpoint after a park) and checks that the bytes are still there.
async fn stop_rows(rounds: usize, k: usize) {
    let Some((database, tmp)) = bench_setup().await else {
        return;
    };
    let dir = tmp.path();
    let ca = dir.join("ca");
    let c1 = Controller::start_as(dir, &ca, &database, "c1").await;
    let c2_addrs = fresh_addrs();
    let worker = Worker::start(dir, &ca, "w1", &format!("{},{}", c2_addrs.1, c1.cluster));
    c1.wait_state(&["w1"], "ready").await;
    wait_host_template(&c1.client).await;
    let modes = ["hand-off", "park"];
    let mut stop: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut first: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for r in 0..rounds * 2 {
        let mode = modes[r % 2];
        let mut c2 = Controller::start_at(
            dir,
            &ca,
            &database,
            "c2",
            c2_addrs.clone(),
            // All k sandboxes stay with c2 until its stop (none passed to c1 before).
            &["--on-stop", mode, "--balance-sandboxes", "false"],
        )
        .await;
        c2.wait_state(&["w1"], "ready").await;
        let mut ids = Vec::new();
        for _ in 0..k {
            let id = create_host(&c2.client).await;
            sh(
                &c2.client,
                &id,
                &format!("{FILL_64M}; wc -c < /dev/shm/blob > /tmp/size"),
            )
            .await;
            ids.push(id);
        }
        stop.entry(mode)
            .or_default()
            .push(c2.stop(Duration::from_secs(600)));
        for id in &ids {
            first
                .entry(mode)
                .or_default()
                .push(timed_true(&c1.client, id).await);
            sh(
                &c1.client,
                id,
                "test -s /tmp/size && test $(wc -c < /dev/shm/blob) -eq $(cat /tmp/size)",
            )
            .await;
            c1.client.delete_sandbox(id).await.expect("delete");
        }
        drop(c2);
    }
    let mut rows = mode_rows(
        [
            "stop: hand-off (SIGTERM to exit)",
            "stop: park (before)",
            "first call after: hand-off (adopt)",
            "first call after: park (wake)",
        ],
        modes,
        (stop, |mode: &str| {
            format!("{rounds} rounds of {k} sandboxes of 64 MiB, --on-stop {mode}")
        }),
        (first, "exec true through c1"),
    );
    let (json_rows, stop_ratio, first_ratio) = print_mode_rows(
        "a controller's stop",
        modes,
        ["stop", "first call after"],
        &mut rows,
    );
    println!(
        "{}",
        json!({
            "bench": "cluster", "rows": "stop", "rounds": rounds, "sandboxes": k,
            "workers": 1, "controllers": 2, "stop": json_rows,
            "ratio_p50": {"stop": stop_ratio, "first_call": first_ratio},
        })
    );
    drop(worker);
    drop(c1);
}

/// `TORPOR_CLUSTER_ROWS=handover`: what handing a pool over to a controller that joins costs
/// its running agents. One worker joining two controllers' addresses. Each round starts `c1`
/// with `--pool-hand-over pass` or, the baseline in the same run, `drain` (how every hand-over
/// went before), alternating; makes two dispatch pools of `k` agents each through it (a
/// redis-list trigger, `min` = `max` = `k`), fills each agent with 64 MiB of random bytes,
/// then starts `c2`: `c1`, over its share, hands one pool over. Timed: from `c2`'s start until
/// `c2` scales that pool with all `k` agents active (its status through `c2`), and then the
/// first exec `true` on each of its agents through `c2`; the bytes are checked, and `c1`'s
/// checkpoints during the hand-over counted.
async fn handover_rows(rounds: usize, k: usize) {
    let Some((database, tmp)) = bench_setup().await else {
        return;
    };
    let dir = tmp.path();
    let ca = dir.join("ca");
    let redis = brokers::Redis::start();
    let (c1_addrs, c2_addrs) = (fresh_addrs(), fresh_addrs());
    let worker = Worker::start(dir, &ca, "w1", &format!("{},{}", c1_addrs.1, c2_addrs.1));
    // Heartbeats every 500 ms (a third of the lease), for both modes alike.
    let lease = ["--controller-lost-after-ms", "1500"];
    let modes = ["pass", "drain"];
    let mut over: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut first: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut checkpoints: BTreeMap<&str, u64> = BTreeMap::new();
    let pool_body = |name: &str| {
        json!({
            "name": name, "template": "host", "min": k, "max": k, "target": 1,
            "poll_interval_ms": 200,
            "triggers": [{"type": "redis-list", "url": redis.url(), "key": name}],
            "dispatch": {"command": ["cat"], "timeout_s": 60},
        })
    };
    for r in 0..rounds * 2 {
        let mode = modes[r % 2];
        let mut c1 = Controller::start_at(
            dir,
            &ca,
            &database,
            "c1",
            c1_addrs.clone(),
            &[&lease[..], &["--pool-hand-over", mode]].concat(),
        )
        .await;
        c1.wait_state(&["w1"], "ready").await;
        wait_host_template(&c1.client).await;
        for name in ["h1", "h2"] {
            c1.call_ok(reqwest::Method::POST, "/v1/pools", pool_body(name))
                .await;
        }
        let mut agents = BTreeMap::new();
        for name in ["h1", "h2"] {
            let status = wait_pool(&c1, name, "c1", k).await;
            agents.insert(name, pool_agent_ids(&status));
        }
        for id in agents.values().flatten() {
            sh(
                &c1.client,
                id,
                &format!("{FILL_64M}; wc -c < /dev/shm/blob > /tmp/size"),
            )
            .await;
        }
        let before = c1.metric_sum("torpor_checkpoint_seconds_count").await;
        let t = Instant::now();
        let mut c2 =
            Controller::start_at(dir, &ca, &database, "c2", c2_addrs.clone(), &lease).await;
        let handed = loop {
            let mut found = None;
            for name in ["h1", "h2"] {
                let (_, s) = c2
                    .call(reqwest::Method::GET, &format!("/v1/pools/{name}"))
                    .await;
                if s["controller"] == "c2" && s["running"].as_u64() == Some(k as u64) {
                    found = Some(name);
                }
            }
            if let Some(name) = found {
                break name;
            }
            assert!(
                t.elapsed() < Duration::from_secs(300),
                "no pool handed over to c2:\n{}\n{}",
                c1.log(),
                c2.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        over.entry(mode)
            .or_default()
            .push(t.elapsed().as_secs_f64() * 1000.0);
        *checkpoints.entry(mode).or_default() +=
            c1.metric_sum("torpor_checkpoint_seconds_count").await - before;
        for id in &agents[handed] {
            first
                .entry(mode)
                .or_default()
                .push(timed_true(&c2.client, id).await);
            sh(
                &c2.client,
                id,
                "test -s /tmp/size && test $(wc -c < /dev/shm/blob) -eq $(cat /tmp/size)",
            )
            .await;
        }
        for name in ["h1", "h2"] {
            c1.call_ok(
                reqwest::Method::DELETE,
                &format!("/v1/pools/{name}"),
                Value::Null,
            )
            .await;
        }
        for id in agents.values().flatten() {
            let _ = c1.client.delete_sandbox(id).await; // the holder's own delete may have won
        }
        c2.stop(Duration::from_secs(120));
        c1.stop(Duration::from_secs(120));
    }
    let note = |mode: &str| {
        format!(
            "{rounds} rounds, {k} agents of 64 MiB, --pool-hand-over {mode}, {} checkpoints on c1",
            checkpoints.get(mode).copied().unwrap_or(0)
        )
    };
    let mut rows = mode_rows(
        [
            "hand-over: pass (c2 start to scaling)",
            "hand-over: drain (before)",
            "first call after: pass",
            "first call after: drain",
        ],
        modes,
        (over, note),
        (first, "exec true through c2"),
    );
    let (json_rows, over_ratio, first_ratio) = print_mode_rows(
        "a pool's hand-over",
        modes,
        ["hand-over", "first call after"],
        &mut rows,
    );
    println!(
        "{}",
        json!({
            "bench": "cluster", "rows": "handover", "rounds": rounds, "agents": k,
            "workers": 1, "controllers": 2, "handover": json_rows,
            "checkpoints_on_c1": checkpoints,
            "ratio_p50": {"handover": over_ratio, "first_call": first_ratio},
        })
    );
    drop(worker);
}

/// Waits until pool `name`, read through `c`, is scaled by `holder` with `k` agents active.
async fn wait_pool(c: &Controller, name: &str, holder: &str, k: usize) -> Value {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let (_, s) = c
            .call(reqwest::Method::GET, &format!("/v1/pools/{name}"))
            .await;
        if s["controller"] == holder && s["running"].as_u64() == Some(k as u64) {
            return s;
        }
        assert!(Instant::now() < deadline, "pool {name}: {s}\n{}", c.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn pool_agent_ids(status: &Value) -> Vec<String> {
    status["sandboxes"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}
