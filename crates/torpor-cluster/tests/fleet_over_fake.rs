//! The controller's fleet over real mutual TLS on loopback, with fake nodes on the worker side
//! (no root, no runsc): workers join through `join` (Register, Heartbeat), the fleet places
//! starts across them, honours drains, and reports the containers of a worker that falls
//! silent as lost. The same with real workers and the real binary:
//! crates/torpor/tests/cluster_mode.rs.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use torpor_cluster::placement::WorkerState;
use torpor_cluster::{
    Ca, Fleet, FleetConfig, JoinConfig, MemberName, NodeService, Role, Side, TlsFiles, TlsMetrics,
    TlsSource, TrustDomain,
};
use torpor_core::Limits;
use torpor_runtime::node::fake::FakeNode;
use torpor_runtime::node::{Launch, Node, NodeEvent, Resident};
use torpor_runtime::spec::ContainerSpec;

fn issue(ca: &Ca, role: Role, name: &str, out: &Path) -> TlsFiles {
    ca.issue(
        role,
        &MemberName::new(name).unwrap(),
        Duration::from_secs(3600),
    )
    .unwrap()
    .write_to(out)
    .unwrap();
    TlsFiles::in_dir(out)
}

struct FakeWorker {
    node: Arc<FakeNode>,
    /// Stops its heartbeats (as a dead process would).
    stop_join: tokio::sync::watch::Sender<bool>,
}

async fn start_worker(files: TlsFiles, controller: &str, slots: u32) -> FakeWorker {
    let tls = TlsSource::load(files, Side::Worker, TlsMetrics::new()).unwrap();
    let node = Arc::new(FakeNode::new());
    let service = NodeService::new(Arc::new(node.clone()), tls.identity().name.to_string());
    service.limit_slots(slots as usize);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = service.clone();
    let serve_tls = tls.clone();
    tokio::spawn(async move {
        let _ = torpor_cluster::serve(served, listener, serve_tls, std::future::pending()).await;
    });
    let (stop_join, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(torpor_cluster::join(
        JoinConfig {
            controllers: vec![controller.to_string()],
            // The controller fills in the host it sees the registration come from.
            node_addr: format!("0.0.0.0:{}", addr.port()),
            slots,
            memory_budget: 1 << 30,
            cores: 2,
            gpu_models: Vec::new(),
            labels: BTreeMap::new(),
            run_id: format!("run-{}", addr.port()),
            fence_after: None,
            deadline: Duration::from_secs(5),
        },
        tls,
        service,
        stopped,
    ));
    FakeWorker { node, stop_join }
}

fn launch(id: &str) -> Launch {
    Launch {
        container_id: id.to_string(),
        spec: ContainerSpec {
            rootfs: "/nonexistent".into(),
            mounts: Vec::new(),
            agent_dir: "/nonexistent".into(),
            argv: vec!["/bin/true".into()],
            env: BTreeMap::new(),
            cwd: "/".into(),
            limits: Limits::default(),
            hostname: "fake".into(),
            netns: None,
            devices: Vec::new(),
        },
        network: None,
        ready_timeout: Duration::from_secs(10),
        stored: Default::default(),
        gpu: None,
    }
}

async fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_join_starts_spread_drains_hold_and_a_silent_worker_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::init(
        &dir.path().join("ca"),
        &TrustDomain::new("fleet.test").unwrap(),
        Duration::from_secs(3600),
    )
    .unwrap();
    let c1 = issue(&ca, Role::Controller, "c1", &dir.path().join("c1"));
    let tls = TlsSource::load(c1, Side::Controller, TlsMetrics::new()).unwrap();
    let fleet = Fleet::new(
        tls.clone(),
        FleetConfig {
            heartbeat: Duration::from_millis(100),
            lost_after: Duration::from_millis(800),
            ..FleetConfig::default()
        },
    );
    let mut events = fleet.take_events().unwrap();
    let mut capacity = fleet.capacity();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let controller = listener.local_addr().unwrap().to_string();
    tokio::spawn(torpor_cluster::serve_cluster(
        fleet.clone(),
        listener,
        tls,
        std::future::pending(),
    ));

    let mut workers = BTreeMap::new();
    for name in ["w1", "w2", "w3"] {
        let files = issue(&ca, Role::Worker, name, &dir.path().join(name));
        workers.insert(name, start_worker(files, &controller, 2).await);
    }
    wait_for("three ready workers", || {
        let nodes = fleet.nodes();
        nodes.len() == 3 && nodes.iter().all(|n| n.state == WorkerState::Ready)
    })
    .await;
    let now = *capacity.borrow_and_update();
    assert_eq!(now.slots, 6, "the lot follows");
    assert_eq!(
        now.cores, 6,
        "checkpoints and restores: one per core of each worker"
    );
    for n in fleet.nodes() {
        assert_eq!((n.workers, n.memory_budget_bytes), (2, 1 << 30));
        assert!(n.addr.starts_with("127.0.0.1:"), "{}", n.addr);
    }

    // Three starts spread over three workers.
    let mut held: Vec<Box<dyn Resident>> = Vec::new();
    for i in 0..3 {
        let r = fleet.boot(launch(&format!("sb-{i}-g1"))).await.unwrap();
        held.push(r);
    }
    let mut nodes: Vec<&str> = held.iter().map(|r| r.node().unwrap()).collect();
    nodes.sort();
    assert_eq!(nodes, ["w1", "w2", "w3"], "spread");
    for r in &held {
        assert!(r.worker().starts_with(&format!("{}/", r.node().unwrap())));
    }

    // A drained worker keeps what it runs and takes nothing new.
    let drained = fleet.drain("w1").unwrap();
    assert_eq!(drained.state, WorkerState::Draining);
    let now = *capacity.borrow_and_update();
    assert_eq!((now.slots, now.cores), (4, 4));
    assert!(fleet.drain("nobody").is_err());
    for i in 3..5 {
        let r = fleet.boot(launch(&format!("sb-{i}-g1"))).await.unwrap();
        assert_ne!(r.node(), Some("w1"));
        held.push(r);
    }
    // Every free slot is now on w1 (draining): the next start has nowhere to go.
    let full = fleet.boot(launch("sb-9-g1")).await.err().unwrap();
    assert!(
        matches!(full, torpor_runtime::RuntimeError::NoCapacity(_)),
        "{full}"
    );
    assert!(workers["w1"].node.running().iter().any(|c| c == "sb-0-g1"));

    // w2 falls silent: after the limit it is lost and each container it held is reported.
    let on_w2: Vec<String> = held
        .iter()
        .filter(|r| r.node() == Some("w2"))
        .map(|r| r.id().to_string())
        .collect();
    assert_eq!(on_w2.len(), 2);
    workers["w2"].stop_join.send(true).unwrap();
    let mut lost = Vec::new();
    while lost.len() < on_w2.len() {
        let ev = tokio::time::timeout(Duration::from_secs(30), events.recv())
            .await
            .expect("lost events")
            .unwrap();
        if let NodeEvent::Lost {
            container_id,
            worker,
            silent_for,
        } = ev
        {
            assert_eq!(worker, "w2");
            assert!(silent_for >= Duration::from_millis(800));
            lost.push(container_id);
        }
    }
    lost.sort();
    let mut want = on_w2.clone();
    want.sort();
    assert_eq!(lost, want);
    let w2 = fleet.nodes().into_iter().find(|n| n.name == "w2").unwrap();
    assert_eq!(w2.state, WorkerState::Lost);
    assert_eq!(capacity.borrow_and_update().slots, 2, "only w3 is ready");
    // Its residents are not called any more: alive is false, destroy does not reach it.
    for r in held.iter().filter(|r| r.node() == Some("w2")) {
        assert!(!r.alive());
    }
    for r in held.drain(..) {
        r.destroy().await;
    }
    assert!(workers["w3"].node.running().is_empty());

    // An image not yet in the store is pinned to the worker whose disk holds it: it restores
    // there; on a lost worker it is lost (said so, for the caller's fallback); on a draining
    // one it waits (retryable) for its upload.
    let r = fleet.boot(launch("sb-7-g1")).await.unwrap();
    assert_eq!(r.node(), Some("w3"));
    let image = dir.path().join("img-7");
    r.checkpoint(&image).await.unwrap();
    let pinned = |id: &str, on: &str| {
        let mut l = launch(id);
        l.stored.image_on = Some(on.to_string());
        l
    };
    let back = fleet
        .restore(pinned("sb-7-g2", "w3"), &image)
        .await
        .unwrap();
    assert_eq!(back.node(), Some("w3"));
    back.destroy().await;
    let lost = fleet
        .restore(pinned("sb-7-g3", "w2"), &image)
        .await
        .err()
        .unwrap();
    assert!(
        matches!(&lost, torpor_runtime::RuntimeError::ImageLost(m) if m.contains("w2")),
        "{lost}"
    );
    let waits = fleet
        .restore(pinned("sb-7-g4", "w1"), &image)
        .await
        .err()
        .unwrap();
    assert!(
        matches!(waits, torpor_runtime::RuntimeError::NoCapacity(_)),
        "{waits}"
    );
    let unknown = fleet
        .restore(pinned("sb-7-g5", "w7"), &image)
        .await
        .err()
        .unwrap();
    assert!(
        matches!(unknown, torpor_runtime::RuntimeError::ImageLost(_)),
        "{unknown}"
    );
    assert!(workers["w3"].node.running().is_empty());
}
