//! The worker boundary (cluster mode): a worker runs sandboxes only for controllers of its
//! trust domain, authenticated by mutual TLS; a controller talks only to workers of its CA.
//! Each test starts a real `torpor worker` (real runsc) and attacks it with certificates made
//! by the real `torpor ca`, asserting the refusal, its count on the worker's /metrics, that
//! nothing ran, and that the rightful controller still gets in.

#[path = "../common/cluster.rs"]
mod harness;

use std::time::{Duration, SystemTime};

use harness::{ca_init, ca_issue, connect, raw_client, WorkerProc};
use torpor_cluster::{Ca, MemberName, RemoteError, Role, Side, TlsFiles, TlsMetrics, TlsSource};

struct Rig {
    tmp: tempfile::TempDir,
    worker: WorkerProc,
}

impl Rig {
    async fn start() -> Rig {
        let tmp = tempfile::Builder::new()
            .prefix("torpor-sec-cluster-")
            .tempdir()
            .unwrap();
        ca_init(&tmp.path().join("ca"), "sec.cluster");
        ca_issue(
            &tmp.path().join("ca"),
            "worker",
            "w1",
            &tmp.path().join("w1"),
            "1h",
        );
        let worker = WorkerProc::start(&tmp.path().join("w1"), &tmp.path().join("worker")).await;
        Rig { tmp, worker }
    }

    fn path(&self, p: &str) -> std::path::PathBuf {
        self.tmp.path().join(p)
    }

    /// Nothing ran on the worker, and a controller of its CA still gets in.
    async fn assert_untouched_and_open(&self) {
        assert!(
            self.worker.containers().is_empty(),
            "{:?}",
            self.worker.containers()
        );
        ca_issue(
            &self.path("ca"),
            "controller",
            "good",
            &self.path("good"),
            "1h",
        );
        let ok = connect(&self.worker.addr, &self.path("good")).await;
        assert!(
            ok.is_ok(),
            "the rightful controller is refused: {:?}",
            ok.err()
        );
        assert_eq!(
            self.worker.refusals("unknown_ca").await
                + self.worker.refusals("expired").await
                + self.worker.refusals("wrong_identity").await
                + self.worker.refusals("no_certificate").await,
            1,
            "exactly the one attack was refused"
        );
    }
}

fn refused_call(r: Result<torpor_cluster::RemoteNode, RemoteError>) {
    match r {
        Err(RemoteError::Call { .. }) => {}
        Err(e) => panic!("refused for the wrong reason: {e}"),
        Ok(_) => panic!("the worker accepted the attacker"),
    }
}

#[tokio::test]
async fn a_controller_certificate_from_another_ca_cannot_drive_a_worker() {
    let rig = Rig::start().await;
    // Same trust domain name, another CA; the attacker trusts the real CA (only its own
    // certificate is at fault).
    ca_init(&rig.path("rogue"), "sec.cluster");
    ca_issue(&rig.path("rogue"), "controller", "c1", &rig.path("x"), "1h");
    std::fs::copy(rig.path("ca/ca.pem"), rig.path("x/ca.pem")).unwrap();
    refused_call(connect(&rig.worker.addr, &rig.path("x")).await);
    rig.worker.wait_refusals("unknown_ca", 1).await;
    assert!(rig.worker.log().contains("cluster peer refused"));
    rig.assert_untouched_and_open().await;
}

#[tokio::test]
async fn an_expired_controller_certificate_cannot_drive_a_worker() {
    let rig = Rig::start().await;
    let ca = Ca::load(&rig.path("ca")).unwrap();
    let now = SystemTime::now();
    ca.issue_between(
        Role::Controller,
        &MemberName::new("c1").unwrap(),
        now - Duration::from_secs(2 * 3600),
        now - Duration::from_secs(60),
    )
    .unwrap()
    .write_to(&rig.path("x"))
    .unwrap();
    refused_call(connect(&rig.worker.addr, &rig.path("x")).await);
    rig.worker.wait_refusals("expired", 1).await;
    rig.assert_untouched_and_open().await;
}

#[tokio::test]
async fn a_worker_certificate_cannot_act_as_a_controller() {
    let rig = Rig::start().await;
    // Another worker of the same cluster (valid chain, wrong role). torpor will not load it
    // as a controller's identity, so it is presented by a raw TLS client.
    ca_issue(&rig.path("ca"), "worker", "w2", &rig.path("x"), "1h");
    assert!(TlsSource::load(
        TlsFiles::in_dir(&rig.path("x")),
        Side::Controller,
        TlsMetrics::new()
    )
    .is_err());
    assert!(!raw_client(&rig.worker.addr, Some(&rig.path("x"))).await);
    rig.worker.wait_refusals("wrong_identity", 1).await;
    rig.assert_untouched_and_open().await;
}

#[tokio::test]
async fn a_caller_without_a_certificate_cannot_drive_a_worker() {
    let rig = Rig::start().await;
    assert!(!raw_client(&rig.worker.addr, None).await);
    rig.worker.wait_refusals("no_certificate", 1).await;
    rig.assert_untouched_and_open().await;
}

#[tokio::test]
async fn a_controller_refuses_a_worker_whose_certificate_is_from_another_ca() {
    let tmp = tempfile::tempdir().unwrap();
    let p = |s: &str| tmp.path().join(s);
    ca_init(&p("ca"), "sec.cluster");
    ca_init(&p("rogue"), "sec.cluster");
    // An impostor worker: its certificate and its CA are the rogue's.
    ca_issue(&p("rogue"), "worker", "w1", &p("w1"), "1h");
    let worker = WorkerProc::start(&p("w1"), &p("worker")).await;
    ca_issue(&p("ca"), "controller", "c1", &p("c1"), "1h");
    let metrics = TlsMetrics::new();
    let tls = TlsSource::load(
        TlsFiles::in_dir(&p("c1")),
        Side::Controller,
        metrics.clone(),
    )
    .unwrap();
    let r =
        torpor_cluster::RemoteNode::connect(torpor_cluster::RemoteConfig::new(&worker.addr), tls)
            .await;
    refused_call(r);
    assert_eq!(metrics.refused(Side::Controller, "unknown_ca"), 1);
}
