//! Revocation reaches open connections: a worker that joined, and holds a sandbox, has its
//! certificate revoked (`torpor ca revoke`) while it is connected; once the CRL is in the
//! controller's `--tls-dir`, the controller closes the connections it already had with that
//! worker, refuses its new ones, marks it lost, and the sandbox answers again from its
//! snapshot on the other worker.
//!
//! Real processes throughout (as `cluster_mode.rs`): PostgreSQL, `torpor controller`, two
//! `torpor worker`s with real runsc. Run as root with `RUST_TEST_THREADS=1`.

#[path = "common/cluster.rs"]
mod cluster;
#[path = "common/cluster_procs.rs"]
mod procs;

use std::time::{Duration, Instant};

use serde_json::json;

use procs::{setup, state_of, Controller, Worker, PATIENCE};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_revoked_while_connected_is_cut_off_and_its_sandbox_resumes_elsewhere() {
    let Some((database, tmp)) = setup("torpor-cluster-revoke-", &["c1"], &["w1", "w2"]).await
    else {
        return;
    };
    let dir = tmp.path();
    let controller = Controller::start(dir, &database).await;
    let _workers: Vec<Worker> = ["w1", "w2"]
        .iter()
        .map(|w| Worker::start(dir, w, w, &controller.cluster))
        .collect();
    controller
        .wait_nodes("two ready workers", |n| {
            ["w1", "w2"].iter().all(|w| state_of(n, w) == Some("ready"))
        })
        .await;
    controller.wait_host_template().await;

    // A sandbox with a committed snapshot (parked once, woken again), then changed.
    let sb = controller
        .ok(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "host"})),
        )
        .await;
    let id = sb["id"].as_str().unwrap().to_string();
    controller.exec(&id, "echo disk-1 > /tmp/state").await;
    controller.park(&id).await;
    assert_eq!(controller.exec(&id, "cat /tmp/state").await, "disk-1\n");
    controller.exec(&id, "echo disk-2 > /tmp/state").await;
    let holder = controller.sandbox(&id).await["node"]
        .as_str()
        .expect("a resident sandbox names its node")
        .to_string();
    let other = if holder == "w1" { "w2" } else { "w1" };

    // The operator revokes the holder's certificate while it is connected, and hands the CRL
    // to every member. Nothing new connects meanwhile: only open connections can be cut.
    let before = controller.refusals("revoked").await;
    let ca = dir.join("ca");
    cluster::torpor(&[
        "ca",
        "revoke",
        "--dir",
        ca.to_str().unwrap(),
        "--cert",
        dir.join(&holder).join("cert.pem").to_str().unwrap(),
    ]);
    for member in ["c1", "w1", "w2"] {
        // Written aside and renamed: a reader never sees half a file.
        let part = dir.join(member).join("crl.pem.part");
        std::fs::copy(ca.join("crl.pem"), &part).unwrap();
        std::fs::rename(&part, dir.join(member).join("crl.pem")).unwrap();
    }

    // The controller closes the worker's open connections (counted, logged with its SPIFFE
    // id), refuses its reconnections, and after the usual silence counts it lost.
    controller
        .wait_nodes("the revoked worker is lost", |n| {
            state_of(n, &holder) == Some("lost")
        })
        .await;
    let deadline = Instant::now() + PATIENCE;
    loop {
        let log = controller.log();
        let spiffe = format!("spiffe://e2e.cluster/worker/{holder}");
        if controller.refusals("revoked").await > before
            && log.contains("its open connection is closed")
            && log.contains(&spiffe)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the open connections were not refused ({before} revoked refusals before):\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The sandbox answers again, from its snapshot, on the other worker, and says why.
    assert_eq!(
        controller.exec(&id, "cat /tmp/state").await,
        "disk-1\n",
        "back to the snapshot (disk-2 came after it)"
    );
    let back = controller.sandbox(&id).await;
    assert_eq!(
        back["node"], other,
        "resumed on the worker still trusted: {back}"
    );
    let err = back["last_error"].as_str().unwrap_or_default();
    assert!(
        err.contains(&format!("worker {holder} was lost")),
        "last_error says what happened: {back}"
    );

    // The revoked worker stays out: its heartbeats keep being refused while the other one
    // serves. (It has been retrying at every beat since it was cut.)
    let nodes = controller.nodes().await;
    assert_eq!(state_of(&nodes, &holder), Some("lost"), "{nodes:?}");
    assert_eq!(state_of(&nodes, other), Some("ready"), "{nodes:?}");
    controller
        .ok(
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{id}"),
            None,
        )
        .await;
}
