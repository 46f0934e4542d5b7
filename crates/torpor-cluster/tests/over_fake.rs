//! The protocol end to end over real mutual TLS on loopback, with the fake node on the worker
//! side (no root, no runsc): the whole engine drives a worker through `RemoteNode`; peers with
//! the wrong certificates are refused and counted; a worker's certificate is re-read when its
//! files change. The same over runsc: crates/torpor/tests/cluster.rs.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use torpor_cluster::{
    Ca, MemberName, NodeService, RemoteConfig, RemoteError, RemoteNode, Role, Side, TlsFiles,
    TlsMetrics, TlsSource, TrustDomain,
};
use torpor_control::{CreateSandbox, Engine, EngineConfig, Quotas};
use torpor_core::{SandboxState, TemplateName, TenantId, Tier};
use torpor_runtime::node::fake::{Call, FakeNode, Fault, Op};
use torpor_runtime::proto::ExecRequest;

fn new_ca(dir: &Path, domain: &str) -> Ca {
    Ca::init(
        dir,
        &TrustDomain::new(domain).unwrap(),
        Duration::from_secs(3600),
    )
    .unwrap()
}

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

struct Worker {
    addr: String,
    node: Arc<FakeNode>,
    service: Arc<NodeService>,
    metrics: TlsMetrics,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn start_worker(files: TlsFiles) -> Worker {
    let metrics = TlsMetrics::new();
    let tls = TlsSource::load(files, Side::Worker, metrics.clone()).unwrap();
    let node = Arc::new(FakeNode::new());
    let service = NodeService::new(Arc::new(node.clone()), tls.identity().name.to_string());
    let served = service.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        torpor_cluster::serve(served, listener, tls, async {
            let _ = stopped.await;
        })
        .await
        .unwrap();
    });
    Worker {
        addr,
        node,
        service,
        metrics,
        _stop: stop,
    }
}

async fn connect(addr: &str, files: TlsFiles) -> (Result<RemoteNode, RemoteError>, TlsMetrics) {
    let metrics = TlsMetrics::new();
    let tls = TlsSource::load(files, Side::Controller, metrics.clone()).unwrap();
    (
        RemoteNode::connect(RemoteConfig::new(addr), tls).await,
        metrics,
    )
}

fn engine_config(dir: &Path) -> EngineConfig {
    EngineConfig {
        data_dir: dir.to_path_buf(),
        workers: 2,
        runsc_binary: None,
        runsc_platform: None,
        agent_binary: "/nonexistent/torpor".into(),
        worker_wait: Duration::from_millis(400),
        lot_capacity: 16,
        reserved_workers: torpor_control::Reserve::Auto,
        memory_budget: None,
        tick: Duration::from_secs(3600),
        warm_pool: 0,
        live_restore: false,
        reencode_images: true,
        drain_timeout: Duration::from_secs(2),
        snapshots: Default::default(),
        import_dir: None,
        database: None,
        controller: None,
    }
}

fn exec(cmd: &[&str]) -> ExecRequest {
    ExecRequest {
        cmd: cmd.iter().map(|s| s.to_string()).collect(),
        env: BTreeMap::new(),
        cwd: None,
        timeout_ms: None,
        detach: false,
        stream: false,
    }
}

/// A worker `w1` on the fake node (its CA and certificates under `dir`), and an engine of
/// controller `c1` driving it, with tenant `t1`.
async fn engine_on_a_worker(dir: &Path) -> (Worker, Arc<Engine>, TenantId) {
    let ca = new_ca(&dir.join("ca"), "test.cluster");
    let worker = start_worker(issue(&ca, Role::Worker, "w1", &dir.join("w1"))).await;
    let (remote, _) = connect(
        &worker.addr,
        issue(&ca, Role::Controller, "c1", &dir.join("c1")),
    )
    .await;
    let remote = remote.expect("controller connects");
    assert_eq!(remote.worker_name(), "w1");
    let engine = Engine::start_on(engine_config(&dir.join("controller")), Arc::new(remote))
        .await
        .expect("engine starts on the remote node");
    let tenant = TenantId::new("t1").unwrap();
    engine
        .create_tenant(tenant.clone(), Quotas::default())
        .unwrap();
    (worker, engine, tenant)
}

fn host_sandbox() -> CreateSandbox {
    CreateSandbox {
        template: TemplateName::host(),
        env: BTreeMap::new(),
        metadata: BTreeMap::new(),
        limits: Default::default(),
        gpu: None,
        layer_metadata: Default::default(),
        network: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_drives_a_remote_worker_through_the_whole_ladder() {
    let tmp = tempfile::tempdir().unwrap();
    let (worker, engine, tenant) = engine_on_a_worker(tmp.path()).await;
    let rec = engine
        .create_sandbox(&tenant, host_sandbox())
        .await
        .unwrap();
    let id = rec.id;
    let count = |n: u64| {
        let engine = engine.clone();
        let tenant = tenant.clone();
        let id = id.clone();
        async move {
            let r = engine
                .exec(&tenant, &id, exec(&["count"]), Vec::new())
                .await
                .unwrap();
            assert_eq!(r.exit_code, Some(0), "{r:?}");
            assert_eq!(r.stdout.trim(), n.to_string());
        }
    };
    count(1).await;
    for (tier, state, next) in [
        (Tier::Frozen, SandboxState::Frozen, 2),
        (Tier::Parked, SandboxState::Parked, 3),
    ] {
        let rec = engine.suspend(&tenant, &id, tier).await.unwrap();
        assert_eq!(rec.state, state);
        count(next).await;
    }
    // A streamed exec's frames arrive through the server stream.
    let mut req = exec(&["echo", "hello"]);
    req.stream = true;
    let r = engine.exec(&tenant, &id, req, Vec::new()).await;
    assert!(r.is_ok(), "{r:?}");
    // A crash inside the sandbox reaches the engine as the worker's event.
    let crashed = engine
        .exec(&tenant, &id, exec(&["crash"]), Vec::new())
        .await;
    assert_eq!(crashed.unwrap_err().code(), "sandbox_crashed");
    // Back to its last committed image (the park): the counter it held then.
    count(3).await;
    engine.delete_sandbox(&tenant, &id).await.unwrap();
    assert!(
        worker.node.running().is_empty(),
        "{:?}",
        worker.node.running()
    );
    let calls = worker.node.calls();
    assert!(calls.iter().any(|c| matches!(c, Call::Checkpoint { .. })));
    assert!(calls.iter().any(|c| matches!(c, Call::Restore { .. })));
    assert!(
        worker.node.violations().is_empty(),
        "{:?}",
        worker.node.violations()
    );
    // Nothing was refused on the way.
    assert_eq!(worker.metrics.refused(Side::Worker, "unknown_ca"), 0);
}

/// A worker runs one start and one checkpoint per core (`limit_heavy`), whatever its
/// controllers ask: two parks and two wakes asked at once reach its node one at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_runs_no_more_starts_or_checkpoints_at_once_than_its_cores() {
    let tmp = tempfile::tempdir().unwrap();
    let (worker, engine, tenant) = engine_on_a_worker(tmp.path()).await;
    worker.service.limit_heavy(1);
    let mut ids = Vec::new();
    for _ in 0..2 {
        ids.push(
            engine
                .create_sandbox(&tenant, host_sandbox())
                .await
                .unwrap()
                .id,
        );
    }
    // The controller's own turns allow two of each at once (one per core, two at least).
    for op in [Op::Checkpoint, Op::Checkpoint, Op::Restore, Op::Restore] {
        worker
            .node
            .inject(op, Fault::Delay(Duration::from_millis(1500)));
    }
    let park = |id| engine.suspend(&tenant, id, Tier::Parked);
    let (a, b) = tokio::join!(park(&ids[0]), park(&ids[1]));
    a.unwrap();
    b.unwrap();
    let wake = |id| engine.exec(&tenant, id, exec(&["count"]), Vec::new());
    let (a, b) = tokio::join!(wake(&ids[0]), wake(&ids[1]));
    assert_eq!(a.unwrap().exit_code, Some(0));
    assert_eq!(b.unwrap().exit_code, Some(0));
    assert_eq!(worker.node.pending_faults(), 0, "every delay was used");
    assert_eq!(
        worker.node.max_delayed_at_once(),
        1,
        "one checkpoint or restore at a time on a one-core worker"
    );
    for id in &ids {
        engine.delete_sandbox(&tenant, id).await.unwrap();
    }
}

/// A worker that ended a sandbox's container on its own (a fence: it heard no controller for
/// too long) holds it no more. The next call, whether or not the controller heard that exit,
/// finds out, records it, and is served by the sandbox restored from its last snapshot; it
/// neither fails on the dead agent nor waits forever for a crash report that never comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_after_the_worker_ended_the_container_on_its_own_is_served_from_the_snapshot() {
    let tmp = tempfile::tempdir().unwrap();
    let (worker, engine, tenant) = engine_on_a_worker(tmp.path()).await;
    for round in 0..4 {
        let id = engine
            .create_sandbox(&tenant, host_sandbox())
            .await
            .unwrap()
            .id;
        let count = || async {
            let r = tokio::time::timeout(
                Duration::from_secs(10),
                engine.exec(&tenant, &id, exec(&["count"]), Vec::new()),
            )
            .await
            .expect("the call is answered")
            .expect("the call is served");
            r.stdout.trim().parse::<u64>().unwrap()
        };
        assert_eq!(count().await, 1);
        assert_eq!(count().await, 2);
        assert_eq!(worker.service.fence().await, 1, "round {round}");
        // Odd rounds let the worker's report of the exit arrive first; even ones call at once.
        if round % 2 == 1 {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        assert_eq!(count().await, 1, "round {round}: back to its snapshot");
        let rec = engine.sandbox(&tenant, &id).unwrap();
        assert!(
            rec.last_error
                .as_deref()
                .is_some_and(|e| e.contains("restored to its last snapshot")),
            "round {round}: {rec:?}"
        );
        assert_eq!(rec.state, SandboxState::Running);
        engine.delete_sandbox(&tenant, &id).await.unwrap();
    }
    assert!(
        worker.node.violations().is_empty(),
        "{:?}",
        worker.node.violations()
    );
}

/// Asserts that the controller with `files` is refused by `worker` for `reason`, and that the
/// worker's node was asked nothing.
async fn assert_refused(worker: &Worker, files: TlsFiles, reason: &str) {
    let before = worker.metrics.refused(Side::Worker, reason);
    let calls_before = worker.node.calls().len();
    let (r, _) = connect(&worker.addr, files).await;
    let err = r.err().expect("refused");
    assert!(matches!(err, RemoteError::Call { .. }), "{err}");
    wait_refused(&worker.metrics, Side::Worker, reason, before + 1).await;
    assert_eq!(
        worker.node.calls().len(),
        calls_before,
        "nothing reached the node"
    );
}

#[tokio::test]
async fn a_worker_refuses_other_cas_expired_certificates_and_workers_posing_as_controllers() {
    let tmp = tempfile::tempdir().unwrap();
    let ca = new_ca(&tmp.path().join("ca"), "test.cluster");
    let worker = start_worker(issue(&ca, Role::Worker, "w1", &tmp.path().join("w1"))).await;

    // Another CA of the same trust domain name.
    let other = new_ca(&tmp.path().join("other"), "test.cluster");
    let mut files = issue(&other, Role::Controller, "c1", &tmp.path().join("x1"));
    // It trusts our CA (so that only its own certificate is at fault).
    files.ca = tmp.path().join("ca").join("ca.pem");
    assert_refused(&worker, files, "unknown_ca").await;

    // Expired an hour ago.
    let now = SystemTime::now();
    ca.issue_between(
        Role::Controller,
        &MemberName::new("c1").unwrap(),
        now - Duration::from_secs(3 * 3600),
        now - Duration::from_secs(3600),
    )
    .unwrap()
    .write_to(&tmp.path().join("x2"))
    .unwrap();
    assert_refused(&worker, TlsFiles::in_dir(&tmp.path().join("x2")), "expired").await;

    // A worker's certificate presented by a controller. TlsSource refuses to load it for a
    // controller, so it is presented through a raw TLS client.
    issue(&ca, Role::Worker, "w2", &tmp.path().join("x3"));
    let before = worker.metrics.refused(Side::Worker, "wrong_identity");
    raw_handshake(
        &worker.addr,
        Some(&tmp.path().join("x3")),
        &tmp.path().join("ca"),
    )
    .await;
    wait_refused(&worker.metrics, Side::Worker, "wrong_identity", before + 1).await;

    // No certificate at all.
    let before = worker.metrics.refused(Side::Worker, "no_certificate");
    raw_handshake(&worker.addr, None, &tmp.path().join("ca")).await;
    wait_refused(&worker.metrics, Side::Worker, "no_certificate", before + 1).await;
    assert!(worker.node.calls().is_empty(), "{:?}", worker.node.calls());

    // The right controller still gets in.
    let (ok, _) = connect(
        &worker.addr,
        issue(&ca, Role::Controller, "c1", &tmp.path().join("c1")),
    )
    .await;
    ok.expect("a controller of our CA connects");
}

/// A TLS 1.3 client presenting `identity` (a `torpor ca issue` directory) or no certificate,
/// trusting any server; it writes a byte so the server's verdict arrives.
async fn raw_handshake(addr: &str, identity: Option<&Path>, _ca: &Path) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer));
    let cfg = match identity {
        Some(dir) => {
            let certs: Vec<CertificateDer<'static>> =
                CertificateDer::pem_file_iter(dir.join("cert.pem"))
                    .unwrap()
                    .collect::<Result<_, _>>()
                    .unwrap();
            let key = PrivateKeyDer::from_pem_file(dir.join("key.pem")).unwrap();
            builder.with_client_auth_cert(certs, key).unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let name = ServerName::try_from("torpor-worker").unwrap();
    // TLS 1.3: the client finishes first; the server's refusal comes as an alert on read.
    if let Ok(mut tls) = connector.connect(name, tcp).await {
        let _ = tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
        let mut buf = [0u8; 64];
        let r = tokio::time::timeout(Duration::from_secs(10), tls.read(&mut buf)).await;
        assert!(
            !matches!(r, Ok(Ok(n)) if n > 0),
            "the worker answered a client it should refuse"
        );
    }
}

/// Waits until the worker has counted `want` refusals for `reason` (its accept task counts
/// after the alert is on its way to the client).
async fn wait_refused(metrics: &TlsMetrics, side: Side, reason: &str, want: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while metrics.refused(side, reason) < want {
        assert!(Instant::now() < deadline, "{reason} refusal never counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        metrics.refused(side, reason),
        want,
        "counted once as {reason}"
    );
}

#[derive(Debug)]
struct AnyServer;

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }
    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[tokio::test]
async fn a_controller_refuses_a_worker_of_another_ca_and_the_worker_rotates_without_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let ca = new_ca(&tmp.path().join("ca"), "test.cluster");
    let rogue = new_ca(&tmp.path().join("rogue"), "test.cluster");
    let wdir = tmp.path().join("w1");
    let worker = start_worker(issue(&ca, Role::Worker, "w1", &wdir)).await;
    let controller = issue(&ca, Role::Controller, "c1", &tmp.path().join("c1"));
    let (ok, _) = connect(&worker.addr, controller.clone()).await;
    ok.expect("connects before the rotation");

    // The worker's files are replaced by a certificate of another CA: the running worker
    // presents it from its next handshake on, and our controller refuses it.
    rogue
        .issue(
            Role::Worker,
            &MemberName::new("w1").unwrap(),
            Duration::from_secs(3600),
        )
        .unwrap()
        .write_to(&wdir)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (r, metrics) = connect(&worker.addr, controller.clone()).await;
        if r.is_err() && metrics.refused(Side::Controller, "unknown_ca") == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the worker never presented its new certificate"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // And back to a certificate of our CA: accepted again, no restart.
    issue(&ca, Role::Worker, "w1", &wdir);
    loop {
        let (r, _) = connect(&worker.addr, controller.clone()).await;
        if r.is_ok() {
            break;
        }
        assert!(Instant::now() < deadline, "the worker never rotated back");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
