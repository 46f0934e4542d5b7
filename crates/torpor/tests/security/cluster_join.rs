//! The joining boundary (cluster mode): a worker joins a controller by calling its Cluster
//! service (`Register`, `Heartbeat`) over mutual TLS; the controller dials the announced
//! address back and checks that the worker it reaches carries the caller's name.
//!
//! The controller here is the real `Fleet` behind the real `serve_cluster` on a loopback
//! listener, with an identity from the real `torpor ca`; workers that must answer the dial-back
//! are real `torpor worker` processes (real runsc). The attackers are gRPC clients presenting
//! certificates of their choosing. Each test asserts the precise refusal (gRPC code or the TLS
//! refusal counted in `torpor_cluster_tls_refusals_total{side="controller"}`) and that the
//! fleet's list did not change.
//!
//! Also here: `GET /v1/nodes` and `POST /v1/nodes/{name}/drain` are the operator's only.

// The same harness file as `cluster`'s (private there): loaded again, on purpose.
#[allow(clippy::duplicate_mod)]
#[path = "../common/cluster.rs"]
mod harness;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use harness::{ca_init, ca_issue, raw_client, WorkerProc};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Code, Request};
use torpor_api::types::CreateTenantBody;
use torpor_cluster::pb::cluster_client::ClusterClient;
use torpor_cluster::pb::{HeartbeatReply, HeartbeatRequest, RegisterRequest};
use torpor_cluster::{
    serve_cluster, Ca, Fleet, FleetConfig, MemberName, NodeStatus, Role, Side, TlsFiles,
    TlsMetrics, TlsSource, PROTOCOL_HEADER, PROTOCOL_VERSION,
};
use torpor_runtime::node::Node as _;

use crate::common::Daemon;

/// A controller's Cluster service (an in-test `Fleet`), its identity `c1` of the CA in `ca/`.
struct Controller {
    fleet: Arc<Fleet>,
    addr: String,
    metrics: TlsMetrics,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Controller {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

struct Rig {
    tmp: tempfile::TempDir,
    ctl: Controller,
}

impl Rig {
    /// A CA (`ca/`), worker certificates `w1` and `w2`, and a controller losing workers after
    /// `lost_after` of silence.
    async fn start(lost_after: Duration) -> Rig {
        let tmp = tempfile::Builder::new()
            .prefix("torpor-sec-join-")
            .tempdir()
            .unwrap();
        let p = |s: &str| tmp.path().join(s);
        ca_init(&p("ca"), "sec.join");
        ca_issue(&p("ca"), "controller", "c1", &p("c1"), "1h");
        for w in ["w1", "w2"] {
            ca_issue(&p("ca"), "worker", w, &p(w), "1h");
        }
        let metrics = TlsMetrics::new();
        let tls = TlsSource::load(
            TlsFiles::in_dir(&p("c1")),
            Side::Controller,
            metrics.clone(),
        )
        .unwrap();
        let fleet = Fleet::new(
            tls.clone(),
            FleetConfig {
                heartbeat: Duration::from_millis(500),
                lost_after,
                ..FleetConfig::default()
            },
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve_cluster(fleet.clone(), listener, tls, async move {
            let _ = stopped.await;
        }));
        Rig {
            tmp,
            ctl: Controller {
                fleet,
                addr,
                metrics,
                stop: Some(stop),
            },
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.tmp.path().join(p)
    }

    /// A Cluster client presenting the worker identity in `dir` (loaded as a worker loads it).
    fn as_worker(&self, dir: &str) -> ClusterClient<Channel> {
        worker_client(&self.ctl.addr, &self.path(dir))
    }

    /// A real `torpor worker` with the identity `name`.
    async fn worker(&self, name: &str) -> WorkerProc {
        WorkerProc::start(&self.path(name), &self.path(&format!("{name}-data"))).await
    }

    /// Waits until the controller counted `want` TLS refusals for `reason`, exactly.
    async fn wait_refusals(&self, reason: &str, want: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let n = self.ctl.metrics.refused(Side::Controller, reason);
            if n >= want {
                // A revoked peer's connections still open when the CRL arrives are cut and
                // counted too (`tls/open.rs`): as many as the peer had open then.
                if reason != "revoked" {
                    assert_eq!(n, want, "{reason} counted once");
                }
                return;
            }
            assert!(Instant::now() < deadline, "{reason} refusal never counted");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The controller still talks to a rightful worker identity (a heartbeat of an unknown
    /// worker is answered `known=false`, not refused), and lists nothing.
    async fn assert_open_and_empty(&self) {
        let r = heartbeat(&mut self.as_worker("w1"), "any").await;
        assert!(r.is_ok(), "a rightful worker is refused: {r:?}");
        assert!(!r.unwrap().known);
        assert_eq!(self.ctl.fleet.nodes(), Vec::<NodeStatus>::new());
    }
}

/// Dials `addr` over TLS with a rustls client configuration (tonic's connector).
#[derive(Clone)]
struct Dial {
    addr: String,
    tls: tokio_rustls::TlsConnector,
}

impl tower_service::Service<Uri> for Dial {
    type Response = TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: Uri) -> Self::Future {
        let me = self.clone();
        Box::pin(async move {
            let tcp = tokio::net::TcpStream::connect(&me.addr).await?;
            let name = rustls::pki_types::ServerName::try_from("torpor-controller").unwrap();
            Ok(TokioIo::new(me.tls.connect(name, tcp).await?))
        })
    }
}

/// A Cluster client to `addr` with the worker identity in `dir`: `torpor worker`'s own TLS
/// configuration (the controller's certificate checked against the CA in `dir/ca.pem`).
fn worker_client(addr: &str, dir: &Path) -> ClusterClient<Channel> {
    let tls = TlsSource::load(TlsFiles::in_dir(dir), Side::Worker, TlsMetrics::new())
        .expect("worker TLS files load");
    let dial = Dial {
        addr: addr.to_string(),
        tls: tokio_rustls::TlsConnector::from(tls.client_config().unwrap()),
    };
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(10))
        .connect_with_connector_lazy(dial);
    ClusterClient::new(channel)
}

/// A call as a worker makes it (protocol header, deadline).
fn call<T>(msg: T) -> Request<T> {
    let mut r = Request::new(msg);
    r.set_timeout(Duration::from_secs(60));
    r.metadata_mut()
        .insert(PROTOCOL_HEADER, MetadataValue::from(PROTOCOL_VERSION));
    r
}

fn announce(node_addr: &str, run_id: &str) -> RegisterRequest {
    RegisterRequest {
        node_addr: node_addr.to_string(),
        slots: 2,
        memory_budget: 1 << 30,
        cores: 2,
        gpu_models: Vec::new(),
        labels: Default::default(),
        run_id: run_id.to_string(),
        containers: Vec::new(),
    }
}

async fn register(
    c: &mut ClusterClient<Channel>,
    node_addr: &str,
    run_id: &str,
) -> Result<String, tonic::Status> {
    c.register(call(announce(node_addr, run_id)))
        .await
        .map(|r| r.into_inner().controller)
}

async fn heartbeat(
    c: &mut ClusterClient<Channel>,
    run_id: &str,
) -> Result<HeartbeatReply, tonic::Status> {
    heartbeat_saying(c, run_id, None).await
}

/// A heartbeat that says `cpu_idle_milli` of the worker's CPU is idle.
async fn heartbeat_saying(
    c: &mut ClusterClient<Channel>,
    run_id: &str,
    cpu_idle_milli: Option<u32>,
) -> Result<HeartbeatReply, tonic::Status> {
    c.heartbeat(call(HeartbeatRequest {
        run_id: run_id.to_string(),
        busy: 0,
        resident_memory: 0,
        gpu_usage: Default::default(),
        gpu_usage_seq: 0,
        fenced: Vec::new(),
        cpu_idle_milli,
    }))
    .await
    .map(|r| r.into_inner())
}

/// A call that failed in the transport (the handshake was refused), not one the service
/// answered: TLS 1.3 finishes the client's side first, so the refusal reaches the caller as a
/// broken or closed connection.
fn refused_at_tls(st: &tonic::Status) {
    assert!(
        std::error::Error::source(st).is_some()
            && matches!(
                st.code(),
                Code::Unavailable | Code::Unknown | Code::Cancelled
            ),
        "not a transport refusal: {st:?}"
    );
}

fn state_of(fleet: &Fleet, name: &str) -> Option<String> {
    fleet
        .nodes()
        .into_iter()
        .find(|n| n.name == name)
        .map(|n| n.state.to_string())
}

fn port_of(addr: &str) -> &str {
    addr.rsplit_once(':').unwrap().1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cannot_register_another_workers_node_address() {
    let rig = Rig::start(Duration::from_secs(3600)).await;
    let w2 = rig.worker("w2").await;
    let mut as_w2 = rig.as_worker("w2");
    assert_eq!(
        register(&mut as_w2, &w2.addr, "run-w2").await.unwrap(),
        "c1"
    );
    let before = rig.ctl.fleet.nodes();
    assert_eq!(before.len(), 1, "{before:?}");
    assert_eq!(
        (before[0].name.as_str(), before[0].addr.as_str()),
        ("w2", w2.addr.as_str())
    );
    assert_eq!(state_of(&rig.ctl.fleet, "w2").as_deref(), Some("ready"));

    // w1 holds a valid worker certificate and announces w2's Node service as its own: the
    // controller dials it back, meets w2, and refuses.
    let mut as_w1 = rig.as_worker("w1");
    for hijack in [w2.addr.clone(), format!("0.0.0.0:{}", port_of(&w2.addr))] {
        let st = register(&mut as_w1, &hijack, "run-w1")
            .await
            .expect_err("w1 registered w2's address");
        assert_eq!(st.code(), Code::PermissionDenied, "{hijack}: {st:?}");
        assert_eq!(st.message(), "the worker at that address is not the caller");
    }
    // Nothing listed for w1, w2's entry as it was, w1's heartbeats are not taken.
    assert_eq!(rig.ctl.fleet.nodes(), before);
    assert!(!heartbeat(&mut as_w1, "run-w1").await.unwrap().known);
    assert!(!heartbeat(&mut as_w1, "run-w2").await.unwrap().known);
    assert!(heartbeat(&mut as_w2, "run-w2").await.unwrap().known);
    // The refused registrations did not reach into w2 (no reconcile of its containers).
    assert!(!w2.log().contains("removing a container"), "{}", w2.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_announcing_a_silent_address_cannot_stall_other_workers_joining() {
    let rig = Rig::start(Duration::from_secs(3600)).await;
    let w2 = rig.worker("w2").await;
    // w1 announces an address that accepts TCP and never speaks TLS.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let (dialled, mut dialled_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((tcp, _)) = silent.accept().await {
            held.push(tcp);
            let _ = dialled.send(());
        }
    });
    let mut as_w1 = rig.as_worker("w1");
    let stall = tokio::spawn(async move { register(&mut as_w1, &silent_addr, "run-w1").await });
    // The controller is dialling w1's silent address back.
    dialled_rx.recv().await.unwrap();
    let mut as_w2 = rig.as_worker("w2");
    let honest = register(&mut as_w2, &w2.addr, "run-w2");
    tokio::select! {
        biased;
        r = honest => {
            assert_eq!(r.unwrap(), "c1");
            assert_eq!(state_of(&rig.ctl.fleet, "w2").as_deref(), Some("ready"));
        }
        r = stall => panic!("w2 joined only after w1's dial-back gave up: {r:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_certificate_cannot_join_as_a_worker() {
    let rig = Rig::start(Duration::from_secs(3600)).await;
    // A controller of the same CA and trust domain: a valid chain, the wrong role.
    ca_issue(&rig.path("ca"), "controller", "c2", &rig.path("c2"), "1h");
    assert!(
        TlsSource::load(
            TlsFiles::in_dir(&rig.path("c2")),
            Side::Worker,
            TlsMetrics::new()
        )
        .is_err(),
        "torpor loads a controller certificate as a worker's"
    );
    assert!(!raw_client(&rig.ctl.addr, Some(&rig.path("c2"))).await);
    rig.wait_refusals("wrong_identity", 1).await;
    rig.assert_open_and_empty().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_without_a_certificate_cannot_join() {
    let rig = Rig::start(Duration::from_secs(3600)).await;
    assert!(!raw_client(&rig.ctl.addr, None).await);
    rig.wait_refusals("no_certificate", 1).await;
    rig.assert_open_and_empty().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_heartbeat_with_another_run_id_does_not_keep_a_worker_alive() {
    let rig = Rig::start(Duration::from_secs(3)).await;
    let w1 = rig.worker("w1").await;
    let mut as_w1 = rig.as_worker("w1");
    register(&mut as_w1, &w1.addr, "run-1").await.unwrap();
    let seen = |rig: &Rig| rig.ctl.fleet.nodes()[0].last_seen_at;

    // The rightful heartbeat refreshes last_seen_at (so the check below can see a refresh).
    let t0 = seen(&rig);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let r = heartbeat(&mut as_w1, "run-1").await.unwrap();
    assert!(r.known && !r.draining);
    let t1 = seen(&rig);
    assert!(t1 > t0, "a rightful heartbeat does not refresh");

    // Same certificate, another run id (a previous process's, or a replay): not known, and
    // last_seen_at stays.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let r = heartbeat(&mut as_w1, "run-0").await.unwrap();
    assert_eq!(
        r,
        HeartbeatReply {
            known: false,
            draining: false,
            fence: Vec::new(),
        }
    );
    assert_eq!(seen(&rig), t1, "a foreign heartbeat refreshed the worker");

    // A stream of foreign heartbeats does not stop the worker from being lost.
    let deadline = Instant::now() + Duration::from_secs(60);
    while state_of(&rig.ctl.fleet, "w1").as_deref() != Some("lost") {
        assert!(!heartbeat(&mut as_w1, "run-0").await.unwrap().known);
        assert!(Instant::now() < deadline, "{:?}", rig.ctl.fleet.nodes());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(seen(&rig), t1);
    // Once lost, even the rightful run id is not taken back by a heartbeat: it must register.
    assert!(!heartbeat(&mut as_w1, "run-1").await.unwrap().known);
    assert_eq!(state_of(&rig.ctl.fleet, "w1").as_deref(), Some("lost"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_node_address_is_refused_before_any_dial() {
    let rig = Rig::start(Duration::from_secs(3600)).await;
    let mut as_w1 = rig.as_worker("w1");
    for bad in [
        "worker-1:7443",
        "localhost:7443",
        "127.0.0.1:0",
        "0.0.0.0:0",
        "127.0.0.1",
        "http://127.0.0.1:7443",
        "",
    ] {
        let st = register(&mut as_w1, bad, "run-1")
            .await
            .expect_err("a malformed node_addr was taken");
        assert_eq!(st.code(), Code::InvalidArgument, "{bad:?}: {st:?}");
    }
    // Another protocol version is refused before the handler.
    let mut r = Request::new(announce("127.0.0.1:7443", "run-1"));
    r.metadata_mut()
        .insert(PROTOCOL_HEADER, MetadataValue::from(PROTOCOL_VERSION + 1));
    let st = as_w1.register(r).await.expect_err("another version taken");
    assert_eq!(st.code(), Code::FailedPrecondition, "{st:?}");
    assert_eq!(rig.ctl.fleet.nodes(), Vec::<NodeStatus>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_certificate_from_another_ca_cannot_join_a_controller() {
    let rig = Rig::start(Duration::from_secs(3600)).await;
    // Same trust domain name, another CA; the impostor trusts the real CA, so only its own
    // certificate is at fault.
    ca_init(&rig.path("rogue"), "sec.join");
    ca_issue(&rig.path("rogue"), "worker", "w1", &rig.path("x"), "1h");
    std::fs::copy(rig.path("ca/ca.pem"), rig.path("x/ca.pem")).unwrap();
    let st = register(&mut rig.as_worker("x"), "127.0.0.1:7443", "run-x")
        .await
        .expect_err("an impostor registered");
    refused_at_tls(&st);
    rig.wait_refusals("unknown_ca", 1).await;
    rig.assert_open_and_empty().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_worker_certificate_cannot_join_a_controller() {
    let rig = Rig::start(Duration::from_secs(3600)).await;
    let now = SystemTime::now();
    Ca::load(&rig.path("ca"))
        .unwrap()
        .issue_between(
            Role::Worker,
            &MemberName::new("w1").unwrap(),
            now - Duration::from_secs(2 * 3600),
            now - Duration::from_secs(60),
        )
        .unwrap()
        .write_to(&rig.path("x"))
        .unwrap();
    let st = heartbeat(&mut rig.as_worker("x"), "run-x")
        .await
        .expect_err("an expired certificate was taken");
    refused_at_tls(&st);
    let st = register(&mut rig.as_worker("x"), "127.0.0.1:7443", "run-x")
        .await
        .expect_err("an expired certificate registered");
    refused_at_tls(&st);
    rig.wait_refusals("expired", 2).await;
    rig.assert_open_and_empty().await;
}

/// Starts a container directly in the worker's runsc root, as if a previous run of the worker
/// had left it (runsc with the host's root read-only, no network).
fn plant_leftover(worker: &WorkerProc, tmp: &Path, id: &str) {
    let bundle = tmp.join(format!("bundle-{id}"));
    std::fs::create_dir_all(&bundle).unwrap();
    let config = serde_json::json!({
        "ociVersion": "1.0.0",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": ["sleep", "3600"],
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "cwd": "/",
        },
        "root": {"path": "/", "readonly": true},
        "hostname": id,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
        ],
        "linux": {"namespaces": [
            {"type": "pid"}, {"type": "network"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
        ]},
    });
    std::fs::write(bundle.join("config.json"), config.to_string()).unwrap();
    // The detached sandbox keeps its stdio: files, not pipes (a pipe would never close).
    let log = tmp.join(format!("runsc-{id}.log"));
    let status = Command::new("runsc")
        .arg("--root")
        .arg(worker.data_dir.join("runsc"))
        .args(["--network=none", "run", "-detach", "--bundle"])
        .arg(&bundle)
        .arg(id)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .status()
        .unwrap();
    assert!(
        status.success(),
        "runsc run: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_worker_coming_back_is_cleaned_before_it_is_ready_again() {
    let rig = Rig::start(Duration::from_secs(2)).await;
    let w1 = rig.worker("w1").await;
    let mut as_w1 = rig.as_worker("w1");
    register(&mut as_w1, &w1.addr, "run-1").await.unwrap();
    assert_eq!(state_of(&rig.ctl.fleet, "w1").as_deref(), Some("ready"));
    // What it ran while it was part of the cluster, then silence: lost.
    plant_leftover(&w1, rig.tmp.path(), "stale-g1");
    assert_eq!(w1.containers(), vec!["stale-g1".to_string()]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while state_of(&rig.ctl.fleet, "w1").as_deref() != Some("lost") {
        assert!(Instant::now() < deadline, "{:?}", rig.ctl.fleet.nodes());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // It comes back: a heartbeat is not enough, it must register; its leftovers are gone by
    // the time the registration is answered and it is ready.
    assert!(!heartbeat(&mut as_w1, "run-1").await.unwrap().known);
    assert_eq!(w1.containers(), vec!["stale-g1".to_string()]);
    register(&mut as_w1, &w1.addr, "run-1").await.unwrap();
    assert_eq!(state_of(&rig.ctl.fleet, "w1").as_deref(), Some("ready"));
    assert_eq!(w1.containers(), Vec::<String>::new());
    assert!(w1
        .log()
        .contains("removing a container left by a previous run"));
    assert!(heartbeat(&mut as_w1, "run-1").await.unwrap().known);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_claiming_a_huge_machine_counts_for_a_bounded_one() {
    let rig = Rig::start(Duration::from_secs(30)).await;
    let w1 = rig.worker("w1").await;
    let mut as_w1 = rig.as_worker("w1");
    // A worker announcing four billion cores (to make the controllers run that many
    // checkpoints and restores at once, and admit calls for them) counts for 1024.
    let mut claim = announce(&w1.addr, "run-1");
    claim.cores = u32::MAX;
    as_w1.register(call(claim)).await.unwrap();
    assert_eq!(state_of(&rig.ctl.fleet, "w1").as_deref(), Some("ready"));
    assert_eq!(
        rig.ctl.fleet.capacity().borrow().cores,
        torpor_cluster::fleet::MAX_WORKER_CORES as usize
    );
    // Nor can it claim more idle CPU than those cores to draw every new sandbox to itself
    // (placement ranks workers by idle CPU first): the claim is held to what it registered.
    heartbeat_saying(&mut as_w1, "run-1", Some(u32::MAX))
        .await
        .unwrap();
    let w = rig
        .ctl
        .fleet
        .nodes()
        .into_iter()
        .find(|n| n.name == "w1")
        .unwrap();
    assert_eq!(
        w.cpu_idle_milli,
        Some(torpor_cluster::fleet::MAX_WORKER_CORES * 1000)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_cannot_keep_containers_its_controller_does_not_hold() {
    let rig = Rig::start(Duration::from_secs(30)).await;
    let w1 = rig.worker("w1").await;
    let mut as_w1 = rig.as_worker("w1");
    register(&mut as_w1, &w1.addr, "run-1").await.unwrap();
    // A container the controller never started there (a leftover, or one the worker made
    // up), claimed as "still running" by a registration of a new run (live restore).
    plant_leftover(&w1, rig.tmp.path(), "claimed-g1");
    assert_eq!(w1.containers(), vec!["claimed-g1".to_string()]);
    // Nor does a controller that restarted take it: its records put that container on w2.
    rig.ctl
        .fleet
        .expect_back(&[("claimed-g1".into(), "w2".into())]);
    let mut claim = announce(&w1.addr, "run-2");
    claim.containers = vec!["claimed-g1".into(), "sb-other-g1".into()];
    as_w1.register(call(claim)).await.unwrap();
    // Only containers the controller holds (or, restarted, expects back) on that very worker
    // are kept: this one is removed
    // like any leftover, and nothing was taken over.
    assert_eq!(state_of(&rig.ctl.fleet, "w1").as_deref(), Some("ready"));
    assert_eq!(w1.containers(), Vec::<String>::new());
    assert!(w1
        .log()
        .contains("removing a container left by a previous run"));
}

/// Status and error code of a raw call.
async fn raw(d: &Daemon, method: reqwest::Method, path: &str, token: &str) -> (u16, Value) {
    let r = reqwest::Client::new()
        .request(method, format!("{}{path}", d.url()))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn a_tenant_cannot_list_or_drain_nodes() {
    let d = Daemon::start().await;
    let t = d
        .client()
        .create_tenant(&CreateTenantBody {
            name: "team-a".into(),
            quotas: None,
        })
        .await
        .unwrap();
    for (method, path) in [
        (reqwest::Method::GET, "/v1/nodes"),
        (reqwest::Method::POST, "/v1/nodes/local/drain"),
        (reqwest::Method::DELETE, "/v1/nodes/local/drain"),
    ] {
        let (status, body) = raw(&d, method, path, &t.token).await;
        assert_eq!(status, 403, "{path}: {body}");
        assert_eq!(body["error"]["code"], "forbidden", "{path}: {body}");
    }
    // The operator sees this machine and is told it cannot be drained.
    let (status, body) = raw(&d, reqwest::Method::GET, "/v1/nodes", &d.token()).await;
    assert_eq!(status, 200, "{body}");
    let nodes = body.as_array().unwrap();
    assert_eq!(nodes.len(), 1, "{body}");
    assert_eq!(nodes[0]["name"], "local");
    assert_eq!(nodes[0]["state"], "ready");
    assert!(nodes[0]["workers"].as_u64().unwrap() > 0, "{body}");
    for method in [reqwest::Method::POST, reqwest::Method::DELETE] {
        let (status, body) = raw(&d, method, "/v1/nodes/local/drain", &d.token()).await;
        assert_eq!(status, 409, "{body}");
        assert_eq!(body["error"]["code"], "not_clustered", "{body}");
    }
}

/// `torpor ca revoke --dir CA --cert CERT`; its output.
fn ca_revoke(ca: &Path, cert: &Path) -> String {
    harness::torpor(&[
        "ca",
        "revoke",
        "--dir",
        ca.to_str().unwrap(),
        "--cert",
        cert.to_str().unwrap(),
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_worker_certificate_cannot_join_a_running_controller() {
    let rig = Rig::start(Duration::from_secs(3600)).await;
    // Until it is revoked, w1's certificate is taken by this controller.
    assert!(
        !heartbeat(&mut rig.as_worker("w1"), "run-w1")
            .await
            .unwrap()
            .known
    );

    let out = ca_revoke(&rig.path("ca"), &rig.path("w1/cert.pem"));
    assert!(out.contains("revoked serial"), "{out}");
    assert!(out.contains("spiffe://sec.join/worker/w1"), "{out}");
    // The operator hands the CRL to the running controller (no restart). It looks at its files
    // at most once a second, so w1 is taken until then and refused from then on.
    std::fs::copy(rig.path("ca/crl.pem"), rig.path("c1/crl.pem")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let st = loop {
        match heartbeat(&mut rig.as_worker("w1"), "run-w1").await {
            Err(st) => break st,
            Ok(r) => assert!(!r.known),
        }
        assert!(Instant::now() < deadline, "the CRL was never taken");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    refused_at_tls(&st);
    rig.wait_refusals("revoked", 1).await;

    // w1 cannot register, whatever address it announces; each refusal is counted as
    // `revoked` (not as another reason).
    let w2 = rig.worker("w2").await;
    let st = register(&mut rig.as_worker("w1"), &w2.addr, "run-w1")
        .await
        .expect_err("a revoked worker registered");
    refused_at_tls(&st);
    rig.wait_refusals("revoked", 2).await;
    for other in ["unknown_ca", "expired", "wrong_identity", "handshake"] {
        assert_eq!(
            rig.ctl.metrics.refused(Side::Controller, other),
            0,
            "{other}"
        );
    }
    assert_eq!(rig.ctl.fleet.nodes(), Vec::<NodeStatus>::new());

    // Another worker of the same CA joins the same controller as before.
    let mut as_w2 = rig.as_worker("w2");
    assert_eq!(
        register(&mut as_w2, &w2.addr, "run-w2").await.unwrap(),
        "c1"
    );
    let nodes = rig.ctl.fleet.nodes();
    assert_eq!(nodes.len(), 1, "{nodes:?}");
    assert_eq!(state_of(&rig.ctl.fleet, "w2").as_deref(), Some("ready"));
    assert!(heartbeat(&mut as_w2, "run-w2").await.unwrap().known);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_worker_refuses_a_controller_once_its_certificate_is_revoked() {
    let rig = Rig::start(Duration::from_secs(3600)).await;
    ca_issue(&rig.path("ca"), "controller", "c2", &rig.path("c2"), "1h");
    let w1 = rig.worker("w1").await;
    harness::connect(&w1.addr, &rig.path("c2"))
        .await
        .expect("c2 drives w1 before its revocation");

    ca_revoke(&rig.path("ca"), &rig.path("c2/cert.pem"));
    // The worker process is not restarted: its --tls-dir gets the CRL.
    std::fs::copy(rig.path("ca/crl.pem"), rig.path("w1/crl.pem")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while harness::connect(&w1.addr, &rig.path("c2")).await.is_ok() {
        assert!(Instant::now() < deadline, "the worker never took the CRL");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    w1.wait_refusals("revoked", 1).await;
    assert_eq!(w1.refusals("unknown_ca").await, 0);
    let log = w1.log();
    assert!(
        log.lines()
            .any(|l| l.contains("cluster peer refused") && l.contains("revoked")),
        "{log}"
    );
    // The controller that is not revoked still drives it.
    harness::connect(&w1.addr, &rig.path("c1"))
        .await
        .expect("c1 is refused");
    assert_eq!(w1.containers(), Vec::<String>::new());
}
