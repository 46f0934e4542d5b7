//! The controller's fleet over real mutual TLS on loopback, with fake nodes on the worker side
//! (no root, no runsc): workers join through `join` (Register, Heartbeat), the fleet places
//! starts across them, honours drains, and reports the containers of a worker that falls
//! silent as lost, or that it cannot call while its heartbeats arrive (fenced first, then
//! forgotten). The same with real workers and the real binary:
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
    /// What stands between the controllers and its Node service, when it was started behind
    /// one ([`start_worker_behind`]).
    relay: Option<Relay>,
}

async fn start_worker(files: TlsFiles, controller: &str, slots: u32) -> FakeWorker {
    start_worker_behind(files, controller, slots, false, None).await
}

/// A TCP relay in front of a worker's Node service that the test can cut in one direction:
/// cut, the connections through it are dropped and new ones are accepted and never answered
/// (the controller's packets go nowhere), while the worker still calls the controller.
struct Relay {
    addr: std::net::SocketAddr,
    cut: tokio::sync::watch::Sender<bool>,
}

async fn relay(to: std::net::SocketAddr) -> Relay {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (cut, is_cut) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut inbound, _)) = listener.accept().await {
            if *is_cut.borrow() {
                held.push(inbound);
                continue;
            }
            let mut is_cut = is_cut.clone();
            tokio::spawn(async move {
                let Ok(mut outbound) = tokio::net::TcpStream::connect(to).await else {
                    return;
                };
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                    _ = is_cut.wait_for(|c| *c) => {}
                }
            });
        }
    });
    Relay { addr, cut }
}

/// A fake worker; `behind_relay`: it announces a [`Relay`] in front of its Node service;
/// `fence_after`: it ends its containers after that long without word from a controller.
async fn start_worker_behind(
    files: TlsFiles,
    controller: &str,
    slots: u32,
    behind_relay: bool,
    fence_after: Option<Duration>,
) -> FakeWorker {
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
    let relay = match behind_relay {
        true => Some(relay(addr).await),
        false => None,
    };
    let port = relay.as_ref().map_or(addr.port(), |r| r.addr.port());
    let (stop_join, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(torpor_cluster::join(
        JoinConfig {
            controllers: vec![controller.to_string()],
            // The controller fills in the host it sees the registration come from.
            node_addr: format!("0.0.0.0:{port}"),
            slots,
            memory_budget: 1 << 30,
            cores: 2,
            gpu_models: Vec::new(),
            labels: BTreeMap::new(),
            run_id: format!("run-{}", addr.port()),
            fence_after,
            deadline: Duration::from_secs(5),
            // Every fake worker is this one machine: free slots decide, as these tests expect.
            report_cpu: false,
        },
        tls,
        service,
        stopped,
    ));
    FakeWorker {
        node,
        stop_join,
        relay,
    }
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

/// A controller's fleet serving the cluster protocol on loopback (heartbeats 100 ms apart, a
/// worker lost after 800 ms of silence), its CA, and the address workers join.
async fn start_fleet(dir: &Path) -> (Arc<Fleet>, Ca, String) {
    start_fleet_with(dir, Duration::from_secs(3600)).await
}

/// [`start_fleet`] forgetting lost workers after `forget_lost_after` of silence.
async fn start_fleet_with(dir: &Path, forget_lost_after: Duration) -> (Arc<Fleet>, Ca, String) {
    let ca = Ca::init(
        &dir.join("ca"),
        &TrustDomain::new("fleet.test").unwrap(),
        Duration::from_secs(3600),
    )
    .unwrap();
    let c1 = issue(&ca, Role::Controller, "c1", &dir.join("c1"));
    let tls = TlsSource::load(c1, Side::Controller, TlsMetrics::new()).unwrap();
    let fleet = Fleet::new(
        tls.clone(),
        FleetConfig {
            heartbeat: Duration::from_millis(100),
            lost_after: Duration::from_millis(800),
            forget_lost_after,
            ..FleetConfig::default()
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let controller = listener.local_addr().unwrap().to_string();
    tokio::spawn(torpor_cluster::serve_cluster(
        fleet.clone(),
        listener,
        tls,
        std::future::pending(),
    ));
    (fleet, ca, controller)
}

/// Workers `names` with `slots` each, joined to `controller`.
async fn start_workers(
    dir: &Path,
    ca: &Ca,
    controller: &str,
    names: &[&'static str],
    slots: u32,
) -> BTreeMap<&'static str, FakeWorker> {
    let mut workers = BTreeMap::new();
    for &name in names {
        let files = issue(ca, Role::Worker, name, &dir.join(name));
        workers.insert(name, start_worker(files, controller, slots).await);
    }
    workers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_join_starts_spread_drains_hold_and_a_silent_worker_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let (fleet, ca, controller) = start_fleet(dir.path()).await;
    let mut events = fleet.take_events().unwrap();
    let mut capacity = fleet.capacity();
    let workers = start_workers(dir.path(), &ca, &controller, &["w1", "w2", "w3"], 2).await;
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

/// The drains the controllers share, in memory; `failing` makes every call fail (a database
/// that cannot be reached).
#[derive(Default)]
struct Book {
    drained: std::sync::Mutex<std::collections::BTreeSet<String>>,
    failing: std::sync::atomic::AtomicBool,
}

impl torpor_cluster::DrainBook for Book {
    fn set(&self, worker: &str, drain: bool) -> Result<(), String> {
        if self.failing.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("the database is away".into());
        }
        let mut d = self.drained.lock().unwrap();
        if drain {
            d.insert(worker.to_string());
        } else {
            d.remove(worker);
        }
        Ok(())
    }

    fn drained(&self) -> Result<Vec<String>, String> {
        if self.failing.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("the database is away".into());
        }
        Ok(self.drained.lock().unwrap().iter().cloned().collect())
    }
}

fn state(fleet: &Fleet, name: &str) -> Option<WorkerState> {
    fleet
        .nodes()
        .into_iter()
        .find(|n| n.name == name)
        .map(|n| n.state)
}

/// A drain kept in the book by another controller holds here, from the worker's registration
/// on and until lifted there; one taken here is kept in the book first, and a book that cannot
/// keep it fails the drain and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drains_in_the_shared_book_hold_on_every_controller_until_lifted() {
    let dir = tempfile::tempdir().unwrap();
    let (fleet, ca, controller) = start_fleet(dir.path()).await;
    let book = Arc::new(Book::default());
    // Another controller drained w2 before this one started.
    torpor_cluster::DrainBook::set(book.as_ref(), "w2", true).unwrap();
    fleet.attach_drain_book(book.clone());
    let _workers = start_workers(dir.path(), &ca, &controller, &["w1", "w2"], 1).await;
    wait_for("w1 ready, w2 draining from its registration", || {
        state(&fleet, "w1") == Some(WorkerState::Ready)
            && state(&fleet, "w2") == Some(WorkerState::Draining)
    })
    .await;
    let first = fleet.boot(launch("sb-1-g1")).await.unwrap();
    assert_eq!(first.node(), Some("w1"), "the drained worker takes nothing");

    // The database away: the drain fails, and nothing changed here or in the book.
    book.failing
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let err = fleet.set_drain("w1", true).unwrap_err();
    assert!(matches!(err, torpor_cluster::FleetError::Book(_)), "{err}");
    assert_eq!(state(&fleet, "w1"), Some(WorkerState::Ready));
    book.failing
        .store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(!book.drained.lock().unwrap().contains("w1"));

    // Drained here: kept in the book, for the others.
    assert_eq!(
        fleet.set_drain("w1", true).unwrap().state,
        WorkerState::Draining
    );
    assert!(book.drained.lock().unwrap().contains("w1"));
    // Lifted through another controller (the book alone): ready here within a sync.
    torpor_cluster::DrainBook::set(book.as_ref(), "w2", false).unwrap();
    let lifted_at = Instant::now();
    wait_for("w2's drain lifted through the book", || {
        state(&fleet, "w2") == Some(WorkerState::Ready)
    })
    .await;
    assert!(
        lifted_at.elapsed() < torpor_cluster::drains::SYNC_EVERY * 3,
        "within a sync or two: {:?}",
        lifted_at.elapsed()
    );
    let second = fleet.boot(launch("sb-2-g1")).await.unwrap();
    assert_eq!(second.node(), Some("w2"));
    // Lifted here: both ready; an unknown worker is refused and the book untouched.
    assert_eq!(
        fleet.set_drain("w1", false).unwrap().state,
        WorkerState::Ready
    );
    assert!(matches!(
        fleet.set_drain("nobody", true),
        Err(torpor_cluster::FleetError::UnknownWorker(_))
    ));
    assert!(book.drained.lock().unwrap().is_empty());
}

/// A worker whose heartbeats reach the controller while the controller's calls no longer
/// reach it (a one-way partition): the controller's probes find it out of reach, it gets no
/// new sandboxes, its heartbeats are refused, so it fences its containers itself before the
/// controller counts it lost and reports them. Lost long enough, it is forgotten; once it can
/// be called again it registers as new and is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_the_controller_cannot_call_is_fenced_and_lost_though_its_heartbeats_arrive() {
    let dir = tempfile::tempdir().unwrap();
    let (fleet, ca, controller) = start_fleet_with(dir.path(), Duration::from_millis(2500)).await;
    let mut events = fleet.take_events().unwrap();
    let files = issue(&ca, Role::Worker, "w1", &dir.path().join("w1"));
    let metrics = torpor_cluster::FleetMetrics::new(&fleet);
    let fence_after = Some(Duration::from_millis(400));
    let w1 = start_worker_behind(files, &controller, 2, true, fence_after).await;
    let w2 = start_workers(dir.path(), &ca, &controller, &["w2"], 2).await;
    wait_for("two ready workers", || {
        let nodes = fleet.nodes();
        nodes.len() == 2 && nodes.iter().all(|n| n.state == WorkerState::Ready)
    })
    .await;
    // On w1 (w2 drained meanwhile).
    fleet.drain("w2").unwrap();
    let on_w1 = fleet.boot(launch("sb-1-g1")).await.unwrap();
    fleet.set_drain("w2", false).unwrap();
    assert_eq!(on_w1.node(), Some("w1"));
    assert_eq!(w1.node.running(), ["sb-1-g1"]);
    assert!(fleet.nodes().iter().all(|n| n.unreachable_since.is_none()));
    assert_eq!(
        (
            gauge(&metrics, "torpor_nodes", Some("ready")),
            gauge(&metrics, "torpor_nodes_unreachable", None)
        ),
        (2, 0)
    );

    w1.relay.as_ref().unwrap().cut.send(true).unwrap();
    wait_for("w1's probes failing", || {
        fleet
            .nodes()
            .iter()
            .any(|n| n.name == "w1" && n.unreachable_since.is_some())
            && gauge(&metrics, "torpor_nodes_unreachable", None) == 1
    })
    .await;
    // Reported lost, and by then the worker had ended the container: it ran once.
    let lost = loop {
        let ev = tokio::time::timeout(Duration::from_secs(30), events.recv())
            .await
            .expect("w1's container reported lost")
            .unwrap();
        if let NodeEvent::Lost {
            container_id,
            worker,
            ..
        } = ev
        {
            assert!(
                w1.node.running().is_empty(),
                "reported lost while it still runs on w1"
            );
            break (container_id, worker);
        }
    };
    assert_eq!(lost, ("sb-1-g1".to_string(), "w1".to_string()));
    assert_eq!(state(&fleet, "w1"), Some(WorkerState::Lost));
    assert_eq!(
        (
            gauge(&metrics, "torpor_nodes", Some("lost")),
            gauge(&metrics, "torpor_nodes", Some("ready")),
            gauge(&metrics, "torpor_nodes_unreachable", None)
        ),
        (1, 1, 0)
    );
    assert!(!on_w1.alive());
    // New sandboxes go to the worker that can be called.
    let next = fleet.boot(launch("sb-2-g1")).await.unwrap();
    assert_eq!(next.node(), Some("w2"));
    next.destroy().await;
    assert!(w2["w2"].node.running().is_empty());
    // Lost for 2.5 s: forgotten (no longer listed nor counted).
    wait_for("w1 forgotten", || {
        fleet.nodes().iter().all(|n| n.name != "w1")
            && gauge(&metrics, "torpor_nodes", Some("lost")) == 0
    })
    .await;
    assert_eq!(state(&fleet, "w2"), Some(WorkerState::Ready));

    // Healed: w1 registers again (its dial-back gets through) and is ready, reached.
    w1.relay.as_ref().unwrap().cut.send(false).unwrap();
    wait_for("w1 back", || {
        fleet.nodes().iter().any(|n| {
            n.name == "w1" && n.state == WorkerState::Ready && n.unreachable_since.is_none()
        })
    })
    .await;
    drop(on_w1);
}

/// The value of gauge `name` (its series labelled `state` when given) as `metrics` collects it.
fn gauge(metrics: &torpor_cluster::FleetMetrics, name: &str, state: Option<&str>) -> i64 {
    use prometheus::core::Collector;
    metrics
        .collect()
        .iter()
        .filter(|f| f.get_name() == name)
        .flat_map(|f| f.get_metric())
        .filter(|m| state.is_none_or(|s| m.get_label().iter().any(|l| l.get_value() == s)))
        .map(|m| m.get_gauge().get_value() as i64)
        .sum()
}
