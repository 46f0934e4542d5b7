//! Cluster mode end to end: a real `torpor controller` (state in a real PostgreSQL) and three
//! real `torpor worker` processes (real runsc, each its own data directory and cgroup prefix)
//! that join it over mutual TLS with certificates from the real `torpor ca`. Everything goes
//! through the public API, as an operator and an agent developer would drive it.
//!
//! Run as root, like the other end-to-end tests (`RUST_TEST_THREADS=1`); PostgreSQL comes
//! from Debian's package (scripts/deps.sh), started by the test (`store::pg_testing`). The
//! first test's snapshot store is S3 (`moto_server`, as the snapshot tests use); the others
//! share a directory as their store.

#[path = "common/brokers.rs"]
mod brokers;
#[path = "common/cluster.rs"]
mod cluster;
#[path = "../../torpor-snapshot/tests/support/moto.rs"]
mod moto;
#[path = "common/cluster_procs.rs"]
mod procs;

use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};
use torpor_cluster::{Ca, MemberName, Role};

use procs::{
    setup, state_of, use_s3, Controller, Partition, Worker, CHECK, PATIENCE, STATE, TOKEN,
};
use torpor_snapshot::backend::{Backend, S3Backend, S3Config};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sandbox_moves_between_workers_survives_a_lost_worker_and_strangers_cannot_join() {
    let Some((database, tmp)) =
        setup("torpor-cluster-mode-", &["c1"], &["w1", "w2", "w3", "w4"]).await
    else {
        return;
    };
    let dir = tmp.path();
    let ca = dir.join("ca");
    // The snapshot store is S3: every worker uploads to it and fetches from it.
    let moto = moto::Moto::start();
    moto.create_bucket("torpor-cluster");
    let endpoint = moto.endpoint();
    use_s3(
        dir,
        "s3://torpor-cluster/e2e",
        &[
            ("AWS_ENDPOINT_URL", &endpoint),
            ("AWS_ACCESS_KEY_ID", "test"),
            ("AWS_SECRET_ACCESS_KEY", "test"),
            ("AWS_REGION", "us-east-1"),
        ],
    );
    let s3 = S3Backend::new(&S3Config {
        endpoint: Some(endpoint.clone()),
        access_key_id: "test".into(),
        secret_access_key: "test".into(),
        allow_http: true,
        prefix: Some("e2e".into()),
        ..S3Config::new("torpor-cluster")
    })
    .unwrap();
    let controller = Controller::start(dir, &database).await;
    let mut workers: Vec<Worker> = ["w1", "w2", "w3"]
        .iter()
        .map(|w| Worker::start(dir, w, w, &controller.cluster))
        .collect();

    // Registration: every worker is ready with what it declared.
    let nodes = controller
        .wait_nodes("three ready workers", |n| {
            ["w1", "w2", "w3"]
                .iter()
                .all(|w| state_of(n, w) == Some("ready"))
        })
        .await;
    for n in &nodes {
        assert_eq!(n["workers"], 2, "{n}");
        assert_eq!(n["memory_budget_bytes"], 2u64 << 30, "{n}");
        assert!(n["last_seen_at"].as_str().unwrap().ends_with('Z'), "{n}");
    }

    // The built-in template is built on a worker once one joined.
    controller.wait_host_template().await;

    // A sandbox with state in files, memory (tmpfs) and a process.
    let id = controller.create_with_state().await;
    let first = controller.sandbox(&id).await;
    let first_node = first["node"]
        .as_str()
        .expect("a resident sandbox names its node")
        .to_string();
    assert!(
        first["worker"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{first_node}/")),
        "{first}"
    );

    // Drained, its worker keeps it but takes nothing new; parked, it wakes elsewhere.
    let drained = controller
        .ok(
            reqwest::Method::POST,
            &format!("/v1/nodes/{first_node}/drain"),
            None,
        )
        .await;
    assert_eq!(drained["state"], "draining");
    controller.park(&id).await;
    let parked = controller.sandbox(&id).await;
    assert_eq!(parked["node"], Value::Null, "asleep: no node: {parked}");
    assert_eq!(
        controller.exec(&id, CHECK).await,
        "disk-1\nmem-1\nprocess-alive\n"
    );
    let second = controller.sandbox(&id).await;
    let second_node = second["node"].as_str().unwrap().to_string();
    assert_ne!(second_node, first_node, "woke on another worker: {second}");
    assert_ne!(second["worker"], first["worker"]);

    // Committed (parked) again, then changed, then its worker dies: it comes back from the
    // last snapshot on a third worker, and says what it lost.
    controller.park(&id).await;
    controller.exec(&id, "echo disk-2 > /tmp/state").await;
    let holding = controller.sandbox(&id).await["node"]
        .as_str()
        .unwrap()
        .to_string();
    let victim = workers.iter_mut().find(|w| w.name == holding).unwrap();
    victim.sigkill();
    controller
        .wait_nodes("the killed worker is lost", |n| {
            state_of(n, &holding) == Some("lost")
        })
        .await;
    let after = controller.exec(&id, CHECK).await;
    assert_eq!(
        after, "disk-1\nmem-1\nprocess-alive\n",
        "back to the last snapshot (disk-2 came after it)"
    );
    let back = controller.sandbox(&id).await;
    let third_node = back["node"].as_str().unwrap();
    assert!(
        third_node != holding && third_node != first_node,
        "resumed on the worker neither lost nor drained: {back}"
    );
    let err = back["last_error"].as_str().unwrap_or_default();
    assert!(
        err.contains(&format!("worker {holding} was lost")) && err.contains("taken at"),
        "last_error says what happened: {back}"
    );

    // Parked again and uploaded: the snapshot store holds it, so its worker's death loses
    // nothing. (Workers see no controller's disk: the wake on a fresh worker fetched it.)
    controller
        .exec(&id, "echo disk-3 > /tmp/state; echo mem-3 > /dev/shm/state")
        .await;
    let wrote_it = controller.sandbox(&id).await["node"]
        .as_str()
        .unwrap()
        .to_string();
    controller.park(&id).await;
    let stored = wait_uploaded(&controller, &id).await;
    let error_before = stored["last_error"].clone();
    let w4 = Worker::start(dir, "w4", "w4", &controller.cluster);
    workers
        .iter_mut()
        .find(|w| w.name == wrote_it)
        .unwrap()
        .sigkill();
    controller
        .wait_nodes("the writer is lost, w4 is ready", |n| {
            state_of(n, &wrote_it) == Some("lost") && state_of(n, "w4") == Some("ready")
        })
        .await;
    assert_eq!(
        controller.exec(&id, CHECK).await,
        "disk-3\nmem-3\nprocess-alive\n",
        "an uploaded checkpoint loses nothing with its worker"
    );
    let fourth = controller.sandbox(&id).await;
    assert_eq!(fourth["node"], "w4", "{fourth}");
    assert_eq!(
        fourth["last_error"], error_before,
        "no loss reported: {fourth}"
    );
    assert!(
        w4.log().contains("snapshot fetched"),
        "w4 fetched it from the store:\n{}",
        w4.log()
    );
    workers.push(w4);

    // Memory that changed a lot between two uploads: the first snapshot (superseded, so
    // retired) leaves its packs in S3 half used; the controller's collector repacks them
    // (the default `--repack-below 0.5`) and the snapshot the sandbox depends on verifies.
    controller
        .exec(&id, "head -c 8388608 /dev/urandom > /dev/shm/blob")
        .await;
    controller.park(&id).await;
    wait_uploaded(&controller, &id).await;
    let before = current_snapshot(&controller, &id).await;
    controller
        .exec(
            &id,
            "python3 -c \"import os; f = open('/dev/shm/blob', 'r+b'); \
             [(f.seek(i * 65536), f.write(os.urandom(65536))) for i in range(1, 128, 2)]; f.close()\"",
        )
        .await;
    controller.park(&id).await;
    wait_uploaded(&controller, &id).await;
    // The worker's put named the snapshot it supersedes (only what changed is looked up).
    let after = current_snapshot(&controller, &id).await;
    assert_ne!(after["id"], before["id"], "{after}");
    assert_eq!(after["parent"], before["id"], "{after}\n{before}");
    let deadline = Instant::now() + PATIENCE;
    let gc = loop {
        // The superseded snapshot is retired in the background after the upload.
        let (status, gc) = controller
            .call(reqwest::Method::POST, "/v1/snapshots/gc", None)
            .await;
        // The worker killed above may have died in the middle of an upload (the park before
        // it uploads in the background): its lock holds collections back for the lock's ttl
        // (a minute), then is ignored.
        if status == 503 && gc["error"]["code"] == "store_locked" {
            assert!(Instant::now() < deadline, "{gc}");
            continue;
        }
        assert_eq!(status, 200, "{gc}\n{}", controller.log());
        if gc["packs_repacked"].as_u64() >= Some(1) {
            break gc;
        }
        assert!(Instant::now() < deadline, "nothing repacked: {gc}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(gc["manifests_rewritten"].as_u64() >= Some(1), "{gc}");
    assert!(
        gc["bytes_freed"].as_u64() > gc["repack_bytes_written"].as_u64(),
        "{gc}"
    );
    let verified = controller
        .ok(reqwest::Method::POST, "/v1/snapshots/verify", None)
        .await;
    assert_eq!(verified["ok"], true, "{verified}");

    // Strangers: a worker certificate from another CA, and an expired one, cannot join.
    let other = dir.join("other-ca");
    cluster::ca_init(&other, "e2e.cluster");
    cluster::ca_issue(&other, "worker", "w9", &dir.join("w9"), "1h");
    let ca = Ca::load(&ca).unwrap();
    let now = SystemTime::now();
    ca.issue_between(
        Role::Worker,
        &MemberName::new("w8").unwrap(),
        now - Duration::from_secs(2 * 3600),
        now - Duration::from_secs(60),
    )
    .unwrap()
    .write_to(&dir.join("w8"))
    .unwrap();
    // The stranger's worker already refuses the controller's certificate (another CA), so
    // the controller sees the handshake fail; the expired one is refused by the controller.
    let before = (
        controller.refusals("handshake").await + controller.refusals("unknown_ca").await,
        controller.refusals("expired").await,
    );
    let stranger = Worker::start(dir, "w9", "w9", &controller.cluster);
    let expired = Worker::start(dir, "w8", "w8", &controller.cluster);
    let deadline = Instant::now() + PATIENCE;
    loop {
        let now = (
            controller.refusals("handshake").await + controller.refusals("unknown_ca").await,
            controller.refusals("expired").await,
        );
        if now.0 > before.0 && now.1 > before.1 && stranger.log().contains("unknown_ca") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "refusals not counted ({before:?} -> {now:?}):\n{}\n{}",
            stranger.log(),
            expired.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let nodes = controller.nodes().await;
    assert!(
        state_of(&nodes, "w9").is_none() && state_of(&nodes, "w8").is_none(),
        "{nodes:?}"
    );
    assert!(controller.log().contains("cluster peer refused"));
    // The cluster still serves.
    assert_eq!(controller.exec(&id, "cat /tmp/state").await, "disk-3\n");

    // A filesystem-only pause (E2B's `pause(keep_memory=False)`) through the controller: its
    // mark is kept in PostgreSQL beside the record, and the next call, through the API, reboots
    // the sandbox on the worker it wakes on: a new boot id, its files kept, its processes gone.
    const PROBE: &str = "cat /proc/sys/kernel/random/boot_id /tmp/state; \
                         kill -0 $(cat /tmp/pid) 2>/dev/null && echo alive || echo gone";
    let before = controller.exec(&id, PROBE).await;
    let boot0 = before.lines().next().unwrap().to_string();
    assert!(before.ends_with("disk-3\nalive\n"), "{before}");
    let paused = reqwest::Client::new()
        .post(format!("http://{}/sandboxes/{id}/pause", controller.api))
        .header("X-API-KEY", TOKEN)
        .json(&json!({"memory": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(paused.status(), 204, "{}", paused.text().await.unwrap());
    let after = controller.exec(&id, PROBE).await;
    let mut lines = after.lines();
    assert_ne!(lines.next(), Some(boot0.as_str()), "not rebooted: {after}");
    assert_eq!(lines.collect::<Vec<_>>(), ["disk-3", "gone"], "{after}");
    assert!(
        controller
            .log()
            .contains("rebooted after a filesystem-only pause"),
        "{}",
        controller.log()
    );

    // Parked and uploaded once more, then deleted: the worker's copy of its snapshot goes too.
    controller.park(&id).await;
    wait_uploaded(&controller, &id).await;
    let w4_images = workers.last().unwrap().data.join("images");
    let copies_of = |dir: &std::path::Path| -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&id))
            .collect()
    };
    assert!(
        !copies_of(&w4_images).is_empty(),
        "w4 keeps a copy of the upload"
    );
    controller
        .ok(
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{id}"),
            None,
        )
        .await;
    let about = |log: String| -> String {
        log.lines()
            .filter(|l| l.contains(id.as_str()))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(
        copies_of(&w4_images),
        Vec::<String>::new(),
        "a deleted sandbox leaves no image on its worker; w4:\n{}\ncontroller:\n{}",
        about(workers.last().unwrap().log()),
        about(controller.log())
    );

    // A template of its own: built on a worker, its golden snapshot and root filesystem go to
    // the store (and a worker's copies); deleted, every one of them goes.
    controller
        .ok(
            reqwest::Method::POST,
            "/v1/templates",
            Some(json!({"name": "gone-soon", "source": {"kind": "host"}})),
        )
        .await;
    let sb = controller
        .ok(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "gone-soon"})),
        )
        .await;
    let sb = sb["id"].as_str().unwrap().to_string();
    assert_eq!(controller.exec(&sb, "echo up").await, "up\n");
    let of_template = |root: &std::path::Path| -> Vec<String> {
        let mut found = Vec::new();
        let mut dirs = vec![root.to_path_buf()];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with("golden-gone-soon-") || name.starts_with("rootfs-gone-soon-") {
                    found.push(e.path().display().to_string());
                } else if e.file_type().is_ok_and(|t| t.is_dir()) {
                    dirs.push(e.path());
                }
            }
        }
        found
    };
    // In the S3 store: its manifests (and pins) by snapshot id.
    let in_s3 = || async {
        let mut found: Vec<String> = Vec::new();
        for prefix in ["manifests", "pins"] {
            for o in s3.list(prefix).await.expect("list the bucket") {
                let name = o.key.name().to_string();
                if name.starts_with("golden-gone-soon-") || name.starts_with("rootfs-gone-soon-") {
                    found.push(o.key.as_str().to_string());
                }
            }
        }
        found
    };
    assert!(
        !in_s3().await.is_empty(),
        "the template's snapshots are in the store"
    );
    assert!(
        !dir.join("store").exists(),
        "nothing went to a directory store"
    );
    // Workers pack what they upload to S3 (the default there): packs and their indexes, no
    // object per chunk.
    let packs = s3.list("packs").await.expect("list the bucket");
    assert!(!packs.is_empty());
    assert_eq!(s3.list("packidx").await.expect("list").len(), packs.len());
    assert!(s3.list("chunks").await.expect("list").is_empty());
    controller
        .ok(
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{sb}"),
            None,
        )
        .await;
    controller
        .ok(reqwest::Method::DELETE, "/v1/templates/gone-soon", None)
        .await;
    let mut left = in_s3().await;
    for w in &workers {
        left.extend(of_template(&w.data.join("images")));
    }
    assert_eq!(
        left,
        Vec::<String>::new(),
        "the template's snapshots outlived it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_checkpoint_its_worker_could_not_upload_is_lost_with_that_worker_and_said_so() {
    let Some((database, tmp)) = setup("torpor-cluster-upload-", &["c1"], &["w1", "w2", "w3"]).await
    else {
        return;
    };
    let dir = tmp.path();
    // Checkpoints no sandbox refers to are removed from workers once a second old.
    let mut controller = Controller::start_args(
        dir,
        &database,
        "c1",
        2000,
        &["--orphan-image-grace-ms", "1000"],
    )
    .await;
    let mut w1 = Worker::start(dir, "w1", "w1", &controller.cluster);
    controller
        .wait_nodes("w1 ready", |n| state_of(n, "w1") == Some("ready"))
        .await;
    controller.wait_host_template().await;

    // A first snapshot in the store, made on w1.
    let id = controller.create_with_state().await;
    let park = json!({"tier": "parked"});
    let suspend = format!("/v1/sandboxes/{id}/suspend");
    controller
        .ok(reqwest::Method::POST, &suspend, Some(park.clone()))
        .await;
    wait_uploaded(&controller, &id).await;

    // Uploaded, w1's local copy is rewritten with stored frames; a wake there restores it,
    // everything intact, and parks again.
    let deadline = Instant::now() + PATIENCE;
    while !w1
        .log()
        .contains("local copy re-encoded with stored frames")
    {
        assert!(Instant::now() < deadline, "not re-encoded:\n{}", w1.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        controller.exec(&id, CHECK).await,
        "disk-1\nmem-1\nprocess-alive\n"
    );
    assert_eq!(controller.sandbox(&id).await["node"], "w1");
    controller
        .ok(reqwest::Method::POST, &suspend, Some(park.clone()))
        .await;
    wait_uploaded(&controller, &id).await;

    // w2 can read the store but not write it: it wakes the sandbox (w1 drains), but cannot
    // upload what it parks, which stays on its disk only.
    controller
        .ok(reqwest::Method::POST, "/v1/nodes/w1/drain", None)
        .await;
    let mut w2 = Worker::start_with(dir, "w2", "w2", &controller.cluster, &[dir.join("store")]);
    controller
        .wait_nodes("w2 ready", |n| state_of(n, "w2") == Some("ready"))
        .await;
    assert_eq!(
        controller
            .exec(&id, &format!("{CHECK}; echo disk-2 > /tmp/state"))
            .await,
        "disk-1\nmem-1\nprocess-alive\n"
    );
    assert_eq!(controller.sandbox(&id).await["node"], "w2");
    controller
        .ok(reqwest::Method::POST, &suspend, Some(park))
        .await;
    let deadline = Instant::now() + PATIENCE;
    let parked = loop {
        let s = controller.sandbox(&id).await;
        let err = s["last_error"].as_str().unwrap_or_default();
        if s["state"] == "parked" && err.contains("upload failed, still parked on worker w2") {
            break s;
        }
        assert!(Instant::now() < deadline, "{s}\n{}", controller.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(parked["node"], Value::Null, "{parked}");

    // w2 dies with the only copy of that checkpoint: the sandbox goes back to the snapshot
    // in the store (disk-2 came after it) on another worker, and says what it lost.
    w2.sigkill();
    let w3 = Worker::start(dir, "w3", "w3", &controller.cluster);
    controller
        .wait_nodes("w2 lost, w3 ready", |n| {
            state_of(n, "w2") == Some("lost") && state_of(n, "w3") == Some("ready")
        })
        .await;
    assert_eq!(
        controller.exec(&id, CHECK).await,
        "disk-1\nmem-1\nprocess-alive\n",
        "back to the stored snapshot"
    );
    let back = controller.sandbox(&id).await;
    assert_eq!(back["node"], "w3", "{back}");
    let err = back["last_error"].as_str().unwrap_or_default();
    assert!(
        err.contains("worker w2 was lost before the checkpoint taken at")
            && err.contains("restored to its last snapshot in the store"),
        "last_error says what happened: {back}"
    );

    // w2 comes back (drained: it takes nothing new) with that checkpoint on its disk. No
    // sandbox refers to it any more, so it is removed.
    let leftovers = || -> Vec<String> {
        std::fs::read_dir(dir.join("data-w2").join("images"))
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().into_string().ok())
                    .filter(|n| n.starts_with(id.as_str()) && !n.ends_with(".snapshot"))
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(
        leftovers().len(),
        1,
        "w2 kept the checkpoint it could not upload"
    );
    controller
        .ok(reqwest::Method::POST, "/v1/nodes/w2/drain", None)
        .await;
    let w2 = Worker::start_with(dir, "w2", "w2", &controller.cluster, &[dir.join("store")]);
    controller
        .wait_nodes("w2 back", |n| state_of(n, "w2") == Some("draining"))
        .await;
    let deadline = Instant::now() + PATIENCE;
    while !leftovers().is_empty() {
        assert!(
            Instant::now() < deadline,
            "{:?} still on w2\n{}",
            leftovers(),
            controller.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(controller
        .log()
        .contains("removing a checkpoint no sandbox refers to"));

    // Parked again and its controller killed at once, before it recorded the upload: started
    // again, it uploads the checkpoint as soon as w3 is back (not at the idle policy's
    // Suspended step, an hour later).
    controller
        .ok(
            reqwest::Method::POST,
            &suspend,
            Some(json!({"tier": "parked"})),
        )
        .await;
    controller.kill_and_restart().await;
    wait_uploaded(&controller, &id).await;
    assert!(
        controller
            .log()
            .contains("uploading a checkpoint whose upload a restart interrupted"),
        "the restarted controller sent it:\n{}",
        controller.log()
    );
    assert_eq!(
        controller.exec(&id, CHECK).await,
        "disk-1\nmem-1\nprocess-alive\n"
    );
    drop((w2, w3));
    w1.sigkill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_or_controller_killed_and_restarted_keeps_the_sandboxes_running_and_a_worker_gone_or_cut_off_ends_them(
) {
    let Some((database, tmp)) = setup("torpor-cluster-live-", &["c1"], &["w1", "w2"]).await else {
        return;
    };
    let dir = tmp.path();
    // Workers are lost after 10 s; their sandboxes outlive them for 5 s (the default window).
    let mut controller = Controller::start_with(dir, &database, "c1", 10_000).await;
    let mut w1 = Worker::start(dir, "w1", "w1", &controller.cluster);
    controller
        .wait_nodes("w1 ready", |n| state_of(n, "w1") == Some("ready"))
        .await;
    controller.wait_host_template().await;
    // Unsaved state: files, memory and a process counting; never checkpointed.
    let id = controller.create_with_state().await;
    controller.exec(&id, COUNTER).await;
    let before: u64 = controller
        .exec(&id, "cat /tmp/count")
        .await
        .trim()
        .parse()
        .unwrap();
    let container = controller.sandbox(&id).await["worker"].clone();

    // The worker process dies and comes back (a crash, an upgrade): its sandbox kept running.
    let registered = |w: &Worker| w.log().matches("registered with controller").count();
    let before_restart = registered(&w1);
    w1.sigkill();
    let mut w1 = Worker::start(dir, "w1", "w1", &controller.cluster);
    let deadline = Instant::now() + PATIENCE;
    while registered(&w1) == before_restart {
        assert!(
            Instant::now() < deadline,
            "{}\n{}",
            w1.log(),
            controller.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let count = kept_all(&controller, &id, &container, before, "the worker's restart").await;
    assert!(
        controller
            .log()
            .contains("worker restarted with containers still running"),
        "the controller kept it:\n{}",
        controller.log()
    );

    // The controller dies and comes back (its only one): it takes the sandbox back as the
    // worker registers again, with everything kept, instead of clearing the container.
    controller.kill_and_restart().await;
    kept_all(
        &controller,
        &id,
        &container,
        count,
        "the controller's restart",
    )
    .await;
    assert!(
        controller
            .log()
            .contains("running sandboxes taken back from their workers after a restart"),
        "the restarted controller took it back:\n{}",
        controller.log()
    );

    // Killed again and not back within the window: its shims end the sandbox (before the
    // controller resumes it elsewhere), so it never runs twice.
    w1.sigkill();
    let deadline = Instant::now() + PATIENCE;
    while w1.containers().iter().any(|c| c.starts_with(&id)) {
        assert!(
            Instant::now() < deadline,
            "still running past the window: {:?}",
            w1.containers()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let w2 = Worker::start(dir, "w2", "w2", &controller.cluster);
    controller
        .wait_nodes("w1 lost, w2 ready", |n| {
            state_of(n, "w1") == Some("lost") && state_of(n, "w2") == Some("ready")
        })
        .await;
    // Back to its last snapshot (its template's fresh state: it was never parked).
    assert_eq!(
        controller
            .exec(&id, "cat /tmp/state 2>/dev/null || echo fresh")
            .await,
        "fresh\n"
    );
    let resumed = controller.sandbox(&id).await;
    assert_eq!(resumed["node"], "w2", "{resumed}");
    assert!(
        resumed["last_error"]
            .as_str()
            .unwrap_or_default()
            .contains("worker w1 was lost"),
        "{resumed}"
    );

    // Cut off: no controller answers w2 (its only one hangs) for longer than its fence
    // (5 s): it ends its containers itself, before any controller could count it lost and
    // resume them elsewhere. When the controller answers again, w2 registers under a new run
    // and the sandbox goes back to its snapshot, saying so.
    controller.exec(&id, "echo cut-off > /tmp/state").await;
    controller.signal(libc::SIGSTOP);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !w2.log().contains("(fenced)") {
        assert!(Instant::now() < deadline, "not fenced:\n{}", w2.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        !w2.containers().iter().any(|c| c.starts_with(&id)),
        "{:?}",
        w2.containers()
    );
    controller.signal(libc::SIGCONT);
    assert_eq!(
        controller
            .exec(&id, "cat /tmp/state 2>/dev/null || echo fresh")
            .await,
        "fresh\n",
        "back to its snapshot"
    );
    // (Said as the worker being lost, or, when the call reached w2 before it registered
    // again, as its container killed: either way back to its snapshot.)
    let fenced = controller.sandbox(&id).await;
    let said = fenced["last_error"].as_str().unwrap_or_default();
    assert!(
        said.contains("worker w2 was lost") || said.contains("restored to its last snapshot"),
        "{fenced}"
    );
}

/// Prints the controllers' logs when the test fails while it lives (a failure that is not a
/// call's, whose message carries only that controller's log).
struct LogsOnFailure<'a>(&'a [&'a Controller]);

impl Drop for LogsOnFailure<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for c in self.0 {
                eprintln!("--- {} ---\n{}", c.api, c.log());
            }
        }
    }
}

/// Starts a process in a sandbox that counts in `/tmp/count` ten times a second (each count
/// written whole: a new file renamed over the old), for [`kept_all`].
const COUNTER: &str = "(setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; \
     mv /tmp/count.new /tmp/count; sleep 0.1; done' </dev/null >/dev/null 2>&1 &); sleep 0.5";

/// Checks that sandbox `id` kept everything across `what`: its state, the same container,
/// no error, and its counter went on from `before` without a reset. Returns the count.
async fn kept_all(c: &Controller, id: &str, container: &Value, before: u64, what: &str) -> u64 {
    // A sandbox thawed by this call counts again before it is read.
    let now = c
        .exec(id, &format!("{CHECK}; sleep 0.3; cat /tmp/count"))
        .await;
    let (state, count) = now.rsplit_once("process-alive\n").expect("all state kept");
    assert_eq!(state, "disk-1\nmem-1\n", "{now}");
    let count: u64 = count.trim().parse().unwrap();
    assert!(
        count > before,
        "the counter went on across {what} without a reset: {before} -> {count}"
    );
    let back = c.sandbox(id).await;
    assert_eq!(back["worker"], *container, "the same container: {back}");
    assert_eq!(back["last_error"], Value::Null, "nothing lost: {back}");
    count
}

/// Waits until a parked sandbox's checkpoint reached the store (Suspended): cluster mode
/// uploads it from its worker right after the park.
/// The snapshot `id` stands on now (the store's summary: id, parent, …).
async fn current_snapshot(c: &Controller, id: &str) -> Value {
    let all = c.ok(reqwest::Method::GET, "/v1/snapshots", None).await;
    let mine: Vec<&Value> = all
        .as_array()
        .expect("a list of snapshots")
        .iter()
        .filter(|s| {
            s["used_by"]
                .as_array()
                .is_some_and(|u| u.contains(&json!(id)))
        })
        .collect();
    assert_eq!(mine.len(), 1, "{all}");
    mine[0].clone()
}

async fn wait_uploaded(c: &Controller, id: &str) -> Value {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let s = c.sandbox(id).await;
        if s["state"] == "suspended" {
            return s;
        }
        assert!(
            ["parked", "uploading"].contains(&s["state"].as_str().unwrap_or_default()),
            "between a park and its upload: {s}"
        );
        assert!(
            Instant::now() < deadline,
            "never uploaded: {s}\n{}",
            c.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `n` execs of `script` in `id` at once, alternating between the controllers given.
async fn execs_at_once(through: &[&Controller], id: &str, script: &str, n: usize) -> Vec<String> {
    let calls = (0..n).map(|i| {
        let c = through[i % through.len()];
        async move { c.exec(id, script).await }
    });
    futures::future::join_all(calls).await
}

/// Waits until the pool `name` runs `running` agents, as `c` reports it.
async fn wait_pool_running(c: &Controller, name: &str, running: u64) {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        // 404 until the controller has read the pool made through the other one.
        let (status, p) = c
            .call(reqwest::Method::GET, &format!("/v1/pools/{name}"), None)
            .await;
        assert!(status == 200 || status == 404, "{status} {p}");
        if p["running"] == running && p["desired"] == running {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "pool {name} never ran {running}: {p}\n{}",
            c.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Retries a call while the answer is retryable (the holder is gone and not yet taken over).
async fn exec_retrying(c: &Controller, id: &str, script: &str) -> String {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (status, v) = c
            .call(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{id}/exec"),
                Some(json!({"cmd": ["sh", "-c", script]})),
            )
            .await;
        if status == 200 {
            assert_eq!(v["exit_code"], 0, "{script}: {v}");
            return v["stdout"].as_str().unwrap().to_string();
        }
        let code = v["error"]["code"].as_str().unwrap_or_default().to_string();
        assert!(
            matches!(
                code.as_str(),
                "controller_unavailable" | "sandbox_elsewhere"
            ),
            "only a retryable refusal while the holder's lease runs out: {status} {v}\n{}",
            c.log()
        );
        assert!(Instant::now() < deadline, "never taken over:\n{}", c.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Controllers c1 and c2 on a fresh database and workers w1 and w2 joining both, every
/// worker ready on each controller, and the database's URL (`None`: no PostgreSQL here).
async fn two_by_two(
    prefix: &str,
) -> Option<(
    tempfile::TempDir,
    String,
    Controller,
    Controller,
    Vec<Worker>,
)> {
    two_controllers_and(prefix, &["w1", "w2"], &[]).await
}

/// Two controllers and `workers` (two slots each, started with `extra` arguments), every
/// worker joined to both and ready.
async fn two_controllers_and(
    prefix: &str,
    workers: &[&str],
    extra: &[&str],
) -> Option<(
    tempfile::TempDir,
    String,
    Controller,
    Controller,
    Vec<Worker>,
)> {
    let (database, tmp) = setup(prefix, &["c1", "c2"], workers).await?;
    let dir = tmp.path();
    let c1 = Controller::start_as(dir, &database, "c1").await;
    let c2 = Controller::start_as(dir, &database, "c2").await;
    let both = format!("{},{}", c1.cluster, c2.cluster);
    let started: Vec<Worker> = workers
        .iter()
        .map(|w| Worker::start_args(dir, w, w, &both, &[], extra))
        .collect();
    for c in [&c1, &c2] {
        c.wait_nodes("every worker ready on each controller", |n| {
            workers.iter().all(|w| state_of(n, w) == Some("ready"))
        })
        .await;
    }
    Some((tmp, database, c1, c2, started))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_controllers_share_one_database_and_survive_the_loss_of_one() {
    let Some((tmp, _, c1, c2, _workers)) = two_by_two("torpor-two-controllers-").await else {
        return;
    };
    let dir = tmp.path();
    c2.wait_host_template().await;

    // Created through c1, driven through c2: c2 forwards to the controller that holds it.
    let sb = c1
        .ok(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "host"})),
        )
        .await;
    let id = sb["id"].as_str().unwrap().to_string();
    assert_eq!(sb["controller"], "c1", "{sb}");
    c2.exec(&id, STATE).await;
    let seen = c2.sandbox(&id).await;
    assert_eq!(seen["controller"], "c1", "{seen}");
    assert!(
        seen["node"].is_string(),
        "the holder's view, forwarded: {seen}"
    );

    // One lot per controller, one set of slots: c2 does not count the slot c1's sandbox takes
    // (two workers of 2 slots; the workers' heartbeats say what c1 uses).
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (t1, t2) = (
            c1.ok(reqwest::Method::GET, "/v1/workers", None).await["total"].clone(),
            c2.ok(reqwest::Method::GET, "/v1/workers", None).await["total"].clone(),
        );
        if t1 == 4 && t2 == 3 {
            break;
        }
        assert!(Instant::now() < deadline, "lot sizes c1 {t1}, c2 {t2}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Attacks on forwarding. A caller claiming to be a forwarding controller is served where
    // it asked, and that controller refuses to touch a sandbox another one holds (no second
    // copy, no transition); another tenant's token forwarded to the holder is refused there.
    let (status, v) = {
        let resp = reqwest::Client::new()
            .post(format!("http://{}/v1/sandboxes/{id}/exec", c2.api))
            .bearer_auth(TOKEN)
            .header("x-torpor-forwarded-by", "c1")
            .json(&json!({"cmd": ["true"]}))
            .send()
            .await
            .unwrap();
        (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
    };
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (409, Some("sandbox_elsewhere")),
        "{v}"
    );
    let stranger = tenant_token(&c1, "stranger").await;
    let (status, v) = c2
        .call_as(
            &stranger,
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"cmd": ["cat", "/tmp/state"]})),
        )
        .await;
    assert_eq!(
        status, 404,
        "another tenant's call, forwarded, is refused by the holder: {v}"
    );
    assert_eq!(c1.sandbox(&id).await["state"], "running");

    // The wire between controllers carries callers' tokens: c1's peer listener, where c2
    // forwarded the calls above, serves controllers of the trust domain and nobody else.
    let (no_cert, wrong_id) = (
        c1.refusals("no_certificate").await,
        c1.refusals("wrong_identity").await,
    );
    assert!(
        !cluster::raw_client(&c1.peer, None).await,
        "a client without a certificate is refused"
    );
    assert!(
        !cluster::raw_client(&c1.peer, Some(&dir.join("w1"))).await,
        "a worker's certificate is refused"
    );
    assert!(
        cluster::raw_client(&c1.peer, Some(&dir.join("c2"))).await,
        "another controller's certificate is served"
    );
    let plain = reqwest::Client::new()
        .get(format!("http://{}/v1/sandboxes/{id}", c1.peer))
        .bearer_auth(TOKEN)
        .send()
        .await;
    assert!(
        plain.is_err(),
        "plain HTTP gets no answer on the peer listener: {plain:?}"
    );
    assert!(
        !c2.log().contains("forwarding over plain HTTP"),
        "c2 forwarded over the peer listener:\n{}",
        c2.log()
    );
    let deadline = Instant::now() + PATIENCE;
    while c1.refusals("no_certificate").await <= no_cert
        || c1.refusals("wrong_identity").await <= wrong_id
    {
        assert!(
            Instant::now() < deadline,
            "the refusals are counted:\n{}",
            c1.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    c2.ok(
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{id}/suspend"),
        Some(json!({"tier": "parked"})),
    )
    .await;
    // Parked on its worker, then uploaded to the store in the background (Suspended).
    let parked = wait_uploaded(&c1, &id).await;
    assert!(
        parked.get("controller").is_none(),
        "asleep: held by nobody: {parked}"
    );

    // Calls for the sleeping sandbox through both controllers at once: one wake, every call
    // served with the sandbox's state.
    let wakes = "torpor_wake_seconds_count{from_tier=\"suspended\"}";
    let before = c1.metric(wakes).await + c2.metric(wakes).await;
    let outs = execs_at_once(&[&c1, &c2], &id, CHECK, 8).await;
    for out in &outs {
        assert_eq!(out, "disk-1\nmem-1\nprocess-alive\n");
    }
    let after = c1.metric(wakes).await + c2.metric(wakes).await;
    assert_eq!(
        after - before,
        1,
        "exactly one wake across both controllers"
    );

    // A tenant's quota holds across controllers: 8 creates at a 3-sandbox quota, half
    // through each controller, make exactly 3.
    let tenant = c1
        .ok(
            reqwest::Method::POST,
            "/v1/tenants",
            Some(json!({"name": "racer", "quotas": {"max_sandboxes": 3}})),
        )
        .await;
    let token = tenant["token"].as_str().unwrap().to_string();
    let creates = (0..8).map(|i| {
        let c = if i % 2 == 0 { &c1 } else { &c2 };
        let token = token.clone();
        async move {
            c.call_as(
                &token,
                reqwest::Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": "host"})),
            )
            .await
        }
    });
    let results = futures::future::join_all(creates).await;
    let made: Vec<&Value> = results
        .iter()
        .filter(|(s, _)| *s == 201 || *s == 200)
        .map(|(_, v)| v)
        .collect();
    let refused = results
        .iter()
        .filter(|(s, v)| *s == 429 && v["error"]["code"] == "quota_exceeded")
        .count();
    assert_eq!(made.len(), 3, "{results:?}");
    assert_eq!(refused, 5, "{results:?}");
    for v in made {
        let rid = v["id"].as_str().unwrap();
        let (s, v) = c2
            .call_as(
                &token,
                reqwest::Method::DELETE,
                &format!("/v1/sandboxes/{rid}"),
                None,
            )
            .await;
        assert!(s == 204 || s == 200, "{s} {v}");
    }

    // Ports: a server in a sandbox on a worker, reached through the controllers' ingress
    // proxy (the worker opens the connection from its router namespace and tunnels it), both
    // from the controller that holds the sandbox and forwarded from the other one.
    let web = c1
        .ok(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "host", "network": {"allow": []}})),
        )
        .await;
    let wid = web["id"].as_str().unwrap().to_string();
    c1.ok(
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{wid}/exec"),
        Some(json!({
            "cmd": ["sh", "-c", "echo served-from-sandbox > /tmp/hello.txt && cd /tmp && exec python3 -m http.server -p HTTP/1.1 8080"],
            "detach": true,
        })),
    )
    .await;
    for c in [&c1, &c2] {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let resp = reqwest::Client::new()
                .get(format!(
                    "http://{}/v1/sandboxes/{wid}/ports/8080/hello.txt",
                    c.api
                ))
                .bearer_auth(TOKEN)
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            let body = resp.text().await.unwrap();
            if status == 200 {
                assert_eq!(body.trim(), "served-from-sandbox");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the server never answered through {}: {status} {body}\n{}",
                c.api,
                c1.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    // Parked, then woken by a proxied request: the connection goes to wherever it woke.
    c2.ok(
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{wid}/suspend"),
        Some(json!({"tier": "parked"})),
    )
    .await;
    let resp = reqwest::Client::new()
        .get(format!(
            "http://{}/v1/sandboxes/{wid}/ports/8080/hello.txt",
            c2.api
        ))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(resp.text().await.unwrap().trim(), "served-from-sandbox");
    c1.ok(
        reqwest::Method::DELETE,
        &format!("/v1/sandboxes/{wid}"),
        None,
    )
    .await;

    // A pool made through c2 (which takes its lease: it holds none), read by both.
    let redis = brokers::Redis::start();
    let mut con = redis.conn().await;
    c2.ok(
        reqwest::Method::POST,
        "/v1/pools",
        Some(json!({
            "name": "jobs", "template": "host", "min": 0, "max": 2, "target": 1,
            "cooldown_s": 300, "poll_interval_ms": 200,
            "triggers": [{"type": "redis-list", "url": redis.url(), "key": "jobs"}],
        })),
    )
    .await;
    let _: i64 = redis::cmd("LPUSH")
        .arg("jobs")
        .arg("m1")
        .query_async(&mut con)
        .await
        .unwrap();
    wait_pool_running(&c1, "jobs", 1).await;

    // The sandbox held by c1 (parked, then woken through c1), changes after its last snapshot
    // (a file, memory), then c1 is SIGKILLed.
    c2.ok(
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{id}/suspend"),
        Some(json!({"tier": "parked"})),
    )
    .await;
    // Asleep in the store, held by nobody: the next call through c1 makes it c1's.
    wait_uploaded(&c1, &id).await;
    c1.exec(&id, "echo disk-2 > /tmp/state; echo mem-2 > /dev/shm/state")
        .await;
    let before_kill = c1.sandbox(&id).await;
    let holder = before_kill["controller"].as_str().unwrap().to_string();
    assert_eq!(holder, "c1", "{before_kill}");
    let (mut dead, alive) = (c1, c2);
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();

    // Through c2 the sandbox answers again, adopted where it runs: nothing lost.
    let out = exec_retrying(&alive, &id, CHECK).await;
    assert_eq!(
        out, "disk-2\nmem-2\nprocess-alive\n",
        "adopted: nothing since the last snapshot was lost"
    );
    let back = alive.sandbox(&id).await;
    assert_ne!(back["controller"], holder.as_str(), "{back}");
    assert_eq!(back["state"], "running", "{back}");
    assert_eq!(
        back["node"], before_kill["node"],
        "still on its worker: {back}"
    );
    assert_eq!(back["last_error"], Value::Null, "nothing to report: {back}");

    // The pool keeps scaling: its holder (c2, or c2 once c1's lease expired) follows the
    // queue.
    let _: i64 = redis::cmd("LPUSH")
        .arg("jobs")
        .arg("m2")
        .query_async(&mut con)
        .await
        .unwrap();
    wait_pool_running(&alive, "jobs", 2).await;
    alive
        .ok(reqwest::Method::DELETE, "/v1/pools/jobs", None)
        .await;

    // The survivor still creates and serves.
    let fresh = alive
        .ok(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "host"})),
        )
        .await;
    let fid = fresh["id"].as_str().unwrap();
    assert_eq!(alive.exec(fid, "echo ok").await, "ok\n");
    for s in [fid, id.as_str()] {
        alive
            .ok(reqwest::Method::DELETE, &format!("/v1/sandboxes/{s}"), None)
            .await;
    }
}

/// `echo $NVIDIA_VISIBLE_DEVICES` in `id`.
async fn visible_gpu(c: &Controller, id: &str) -> String {
    c.exec(id, "echo $NVIDIA_VISIBLE_DEVICES")
        .await
        .trim()
        .to_string()
}

/// What `worker` says the admin tenant holds of its GPUs (compute units; 0 when nothing).
fn admin_gpu_compute(nodes: &[Value], worker: &str) -> u64 {
    nodes
        .iter()
        .find(|n| n["name"] == worker)
        .and_then(|n| n["gpu_usage"]["admin"]["compute"].as_u64())
        .unwrap_or(0)
}

/// `(node, field)` of each entry of a merged `GET /v1/gpus` list, sorted.
fn pairs(list: &Value, field: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = list
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            (
                e["node"].as_str().unwrap_or_default().to_string(),
                e[field].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    out.sort();
    out
}

/// A file of `tests/gpu/` (GPU inventories and quotas), by path.
/// The two one-L4 GPU workers (`ga`, `gb`, declared inventories) joined to `controllers`
/// (comma-separated cluster addresses), once every controller of `ready_on` sees both ready
/// and has the `host` template.
async fn gpu_workers(dir: &Path, controllers: &str, ready_on: &[&Controller]) -> [Worker; 2] {
    let workers = [("ga", "worker-l4-a.toml"), ("gb", "worker-l4-b.toml")].map(|(w, inv)| {
        Worker::start_args(
            dir,
            w,
            w,
            controllers,
            &[],
            &["--gpu-inventory", &fixture(inv)],
        )
    });
    for c in ready_on {
        c.wait_nodes("both GPU workers ready on each controller", |n| {
            ["ga", "gb"].iter().all(|w| state_of(n, w) == Some("ready"))
        })
        .await;
        c.wait_host_template().await;
    }
    workers
}

/// A new tenant `name`'s token, made through `c` (as the admin).
async fn tenant_token(c: &Controller, name: &str) -> String {
    c.ok(
        reqwest::Method::POST,
        "/v1/tenants",
        Some(json!({"name": name})),
    )
    .await["token"]
        .as_str()
        .unwrap()
        .to_string()
}

fn fixture(name: &str) -> String {
    format!(
        "{}/tests/gpu/{name}",
        env!("CARGO_MANIFEST_DIR").trim_end_matches('/')
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gpu_workers_announce_their_gpus_place_shares_and_a_tenant_quota_holds_across_workers() {
    let Some((database, tmp)) = setup("torpor-cluster-gpu-", &["c1"], &["ga", "gb", "w3"]).await
    else {
        return;
    };
    let dir = tmp.path();
    // The admin tenant may hold one L4 across the whole cluster.
    let quotas = fixture("quotas-admin-one-l4.toml");
    let controller =
        Controller::start_args(dir, &database, "c1", 2000, &["--gpu-quotas", &quotas]).await;
    let (inv_a, inv_b) = (fixture("worker-l4-a.toml"), fixture("worker-l4-b.toml"));
    // Each GPU worker serves its GPU metrics on its own listener.
    let (metrics_a, metrics_b) = (cluster::free_port(), cluster::free_port());
    let metrics_of = |w: &str| {
        format!(
            "127.0.0.1:{}",
            if w == "ga" { metrics_a } else { metrics_b }
        )
    };
    let _workers = [
        Worker::start_args(
            dir,
            "ga",
            "ga",
            &controller.cluster,
            &[],
            &[
                "--gpu-inventory",
                &inv_a,
                "--metrics-listen",
                &metrics_of("ga"),
            ],
        ),
        Worker::start_args(
            dir,
            "gb",
            "gb",
            &controller.cluster,
            &[],
            &[
                "--gpu-inventory",
                &inv_b,
                "--metrics-listen",
                &metrics_of("gb"),
            ],
        ),
        Worker::start(dir, "w3", "w3", &controller.cluster),
    ];
    let nodes = controller
        .wait_nodes("three ready workers", |n| {
            ["ga", "gb", "w3"]
                .iter()
                .all(|w| state_of(n, w) == Some("ready"))
        })
        .await;
    let models = |w: &str| {
        nodes
            .iter()
            .find(|n| n["name"] == w)
            .map(|n| n["gpu_models"].clone())
            .unwrap()
    };
    assert_eq!(models("ga"), json!(["NVIDIA L4"]), "{nodes:?}");
    assert_eq!(models("gb"), json!(["NVIDIA L4"]), "{nodes:?}");
    assert_eq!(models("w3"), Value::Null, "no GPUs, none shown: {nodes:?}");
    controller.wait_host_template().await;
    let uuid_of = |worker: &str| match worker {
        "ga" => "GPU-14000000-0000-4000-8000-0000000000a1",
        "gb" => "GPU-14000000-0000-4000-8000-0000000000b2",
        other => panic!("a GPU sandbox on {other}, which has no GPU"),
    };
    let create_gpu = |gpu: Value| {
        let c = &controller;
        async move {
            c.call(
                reqwest::Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": "host", "gpu": gpu})),
            )
            .await
        }
    };

    // A whole GPU lands on a GPU worker, whose ledger gives the exec its device.
    let (status, a) = create_gpu(json!({"mode": "whole"})).await;
    assert_eq!(status, 201, "{a}");
    let a = a["id"].as_str().unwrap().to_string();
    let a_node = controller.sandbox(&a).await["node"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(visible_gpu(&controller, &a).await, uuid_of(&a_node));
    let other = if a_node == "ga" { "gb" } else { "ga" };
    let shares_line = |text: &str, worker: &str| {
        text.lines()
            .find(|l| {
                l.starts_with("torpor_gpu_shares{")
                    && l.contains(&format!("UUID=\"{}\"", uuid_of(worker)))
            })
            .map(str::to_string)
    };
    let metrics = reqwest::get(format!("http://{}/metrics", metrics_of(&a_node)))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        shares_line(&metrics, &a_node).is_some_and(|l| l.ends_with(" 1")),
        "{a_node}'s /metrics does not show A's share:\n{metrics}"
    );
    // The worker's chunk cache (default 1 GiB) is on its /metrics too.
    assert!(
        metrics.contains(&format!(
            "torpor_snapshot_cache_capacity_bytes {}",
            1u64 << 30
        )),
        "{a_node}'s /metrics does not show its chunk cache:\n{metrics}"
    );

    // The quota is the tenant's across the cluster: the other worker's free L4 is refused.
    let (status, refused) = create_gpu(json!({"mode": "whole"})).await;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (429, Some("gpu_quota_exceeded")),
        "{refused}"
    );
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("holds 23034 MiB and 700 compute units on other workers"),
        "{refused}"
    );
    // More GPUs than any one worker has: refused at once, with what the workers have.
    let (status, too_big) = create_gpu(json!({"mode": "whole", "count": 2})).await;
    assert_eq!(
        (status, too_big["error"]["code"].as_str()),
        (400, Some("gpu_request_invalid")),
        "{too_big}"
    );
    assert!(
        too_big["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("NVIDIA L4"),
        "{too_big}"
    );
    // A sandbox without a GPU is not held to it.
    let plain = controller
        .ok(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "host"})),
        )
        .await;
    let plain = plain["id"].as_str().unwrap().to_string();
    assert_eq!(visible_gpu(&controller, &plain).await, "");

    // Parked, A gives its share back (as its worker's next heartbeat says); B takes the quota.
    controller.park(&a).await;
    controller
        .wait_nodes("A's share given back", |n| {
            admin_gpu_compute(n, "ga") + admin_gpu_compute(n, "gb") == 0
        })
        .await;
    let (status, b) = create_gpu(json!({"mode": "whole"})).await;
    assert_eq!(status, 201, "{b}");
    let b = b["id"].as_str().unwrap().to_string();
    let b_node = controller.sandbox(&b).await["node"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(visible_gpu(&controller, &b).await, uuid_of(&b_node));
    controller
        .wait_nodes("B's share counted", |n| {
            admin_gpu_compute(n, &b_node) == 700
        })
        .await;
    // GET /v1/gpus answers for the cluster: A sleeps with its ticket on the worker it left.
    let all = controller.ok(reqwest::Method::GET, "/v1/gpus", None).await;
    assert_eq!(all["sleeping"], json!([a.clone()]), "{all}");
    assert_eq!(
        pairs(&all["allocations"], "sandbox"),
        [(b_node.clone(), b.clone())],
        "{all}"
    );

    // A's wake is held to the same quota: refused while B holds it, and A stays asleep.
    let (status, woke) = controller
        .call(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{a}/exec"),
            Some(json!({"cmd": ["true"]})),
        )
        .await;
    assert_eq!(
        (status, woke["error"]["code"].as_str()),
        (429, Some("gpu_quota_exceeded")),
        "{woke}"
    );
    assert_eq!(controller.sandbox(&a).await["node"], Value::Null);

    // B deleted: A wakes with its memory and a GPU of a worker that has one.
    controller
        .ok(reqwest::Method::DELETE, &format!("/v1/sandboxes/{b}"), None)
        .await;
    controller
        .wait_nodes("B's share given back", |n| {
            admin_gpu_compute(n, "ga") + admin_gpu_compute(n, "gb") == 0
        })
        .await;
    let woken = visible_gpu(&controller, &a).await;
    let now_on = controller.sandbox(&a).await["node"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        woken,
        uuid_of(&now_on),
        "woke on {now_on} (slept on {a_node}, other {other})"
    );

    // Another tenant (two L4s of quota): its GPU sandbox gets the L4 A does not hold, and one
    // more finds both held: each worker's ledger refuses it, the controller tries the other
    // worker too, then answers 503 gpu_unavailable.
    let team = tenant_token(&controller, "team").await;
    let team_gpu = || {
        controller.call_as(
            &team,
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "host", "gpu": {"mode": "whole"}})),
        )
    };
    let (status, t1) = team_gpu().await;
    assert_eq!(status, 201, "{t1}");
    let t1 = t1["id"].as_str().unwrap().to_string();
    let (status, t1_rec) = controller
        .call_as(
            &team,
            reqwest::Method::GET,
            &format!("/v1/sandboxes/{t1}"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{t1_rec}");
    let t1_node = t1_rec["node"].as_str().unwrap().to_string();
    assert_ne!(t1_node, now_on, "A holds {now_on}'s only GPU: {t1_rec}");
    // GET /v1/gpus: every GPU worker's GPUs and shares, each with the node it is on; nothing
    // asleep (A's ticket on the worker it left is not shown once A runs); a tenant sees its
    // own shares only.
    let all = controller.ok(reqwest::Method::GET, "/v1/gpus", None).await;
    assert_eq!(all["source"], "cluster", "{all}");
    assert_eq!(
        pairs(&all["gpus"], "uuid"),
        [
            ("ga".to_string(), uuid_of("ga").to_string()),
            ("gb".to_string(), uuid_of("gb").to_string())
        ],
        "{all}"
    );
    let mut want = vec![(now_on.clone(), a.clone()), (t1_node.clone(), t1.clone())];
    want.sort();
    assert_eq!(pairs(&all["allocations"], "sandbox"), want, "{all}");
    assert_eq!(all["sleeping"], json!([]), "{all}");
    assert_eq!(
        all["workers"],
        json!([
            {"node": "ga", "source": inv_a, "cuda_checkpoint": false},
            {"node": "gb", "source": inv_b, "cuda_checkpoint": false}
        ]),
        "{all}"
    );
    let (status, mine) = controller
        .call_as(&team, reqwest::Method::GET, "/v1/gpus", None)
        .await;
    assert_eq!(status, 200, "{mine}");
    assert_eq!(
        pairs(&mine["allocations"], "sandbox"),
        [(t1_node.clone(), t1.clone())],
        "another tenant's share shown: {mine}"
    );
    assert_eq!(mine["allocations"][0]["tenant"], "team", "{mine}");
    let (status, t2) = team_gpu().await;
    assert_eq!(
        (status, t2["error"]["code"].as_str()),
        (503, Some("gpu_unavailable")),
        "{t2}"
    );
    let (status, _) = controller
        .call_as(
            &team,
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{t1}"),
            None,
        )
        .await;
    assert_eq!(status, 204);
    for s in [a.as_str(), plain.as_str()] {
        controller
            .ok(reqwest::Method::DELETE, &format!("/v1/sandboxes/{s}"), None)
            .await;
    }
    // Every GPU sandbox is gone: neither worker keeps a share, a wake ticket or a saved GPU
    // request of one (A's on the worker it left, when it woke on the other; each deleted
    // one's where it last ran).
    for w in ["ga", "gb"] {
        wait_gpu_rows(
            dir,
            w,
            |rows| rows.is_empty(),
            "no share or ticket of a deleted sandbox",
        )
        .await;
        assert_eq!(
            gpu_request_rows(dir, w),
            Vec::<String>::new(),
            "{w}: no GPU request of a deleted sandbox"
        );
    }
}

/// The sandboxes worker `w` keeps a saved GPU request of (its own `DATA/torpor.db`).
fn gpu_request_rows(dir: &Path, w: &str) -> Vec<String> {
    sandboxes_in(dir, w, "gpu_requests")
}

/// The `sandbox` column of `table` in worker `w`'s `DATA/torpor.db`.
fn sandboxes_in(dir: &Path, w: &str, table: &str) -> Vec<String> {
    let db = rusqlite::Connection::open(dir.join(format!("data-{w}/torpor.db"))).unwrap();
    let mut st = db.prepare(&format!("SELECT sandbox FROM {table}")).unwrap();
    let rows = st.query_map([], |r| r.get(0)).unwrap();
    rows.map(Result::unwrap).collect()
}

/// The sandboxes worker `w` keeps a GPU share or wake ticket of (its own `DATA/torpor.db`).
fn gpu_rows(dir: &Path, w: &str) -> Vec<String> {
    sandboxes_in(dir, w, "gpu_shares")
}

/// Waits until worker `w`'s GPU rows pass `ok` (drops go in the background).
async fn wait_gpu_rows(dir: &Path, w: &str, ok: impl Fn(&[String]) -> bool, what: &str) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let rows = gpu_rows(dir, w);
        if ok(&rows) {
            return;
        }
        assert!(Instant::now() < deadline, "{w}: {what}: it keeps {rows:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A GPU share given back by a container that a controller adopted from a lost one (it does
/// not know the container's tenant) counts as gone on every other controller at once: the
/// release's report goes in the shared book for each tenant whose holding it changed, not
/// only at the worker's next heartbeat (10 s apart here).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_adopted_gpu_sandboxs_share_given_back_counts_at_once_on_every_controller() {
    let Some((database, tmp)) = setup(
        "torpor-cluster-gpu-adopt-",
        &["c1", "c2", "c3"],
        &["ga", "gb"],
    )
    .await
    else {
        return;
    };
    let dir = tmp.path();
    let quotas = fixture("quotas-admin-one-l4.toml");
    let args = ["--gpu-quotas", &quotas, "--heartbeat-ms", "10000"];
    let mut c1 = Controller::start_args(dir, &database, "c1", 60_000, &args).await;
    let c2 = Controller::start_args(dir, &database, "c2", 60_000, &args).await;
    let c3 = Controller::start_args(dir, &database, "c3", 60_000, &args).await;
    let all = format!("{},{},{}", c1.cluster, c2.cluster, c3.cluster);
    let _workers = gpu_workers(dir, &all, &[&c1, &c2, &c3]).await;
    let gpu_create = json!({"template": "host", "gpu": {"mode": "whole"}});
    let a = c1
        .ok(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(gpu_create.clone()),
        )
        .await;
    let a = a["id"].as_str().unwrap().to_string();
    let first = c1.sandbox(&a).await["node"].as_str().unwrap().to_string();
    // Its worker drained on every controller (so that the next GPU start goes to the other
    // one, where only the cluster-wide count can refuse it).
    for c in [&c1, &c2, &c3] {
        c.ok(
            reqwest::Method::POST,
            &format!("/v1/nodes/{first}/drain"),
            None,
        )
        .await;
    }
    // c1 dies; c2 or c3 adopts the sandbox where it runs (a call or the other's idle
    // policy), then parks it.
    c1.child.kill().unwrap();
    c1.child.wait().unwrap();
    exec_retrying(&c2, &a, "true").await;
    let adopter = c2.sandbox(&a).await["controller"].clone();
    let (holder, other) = match adopter.as_str() {
        Some("c2") => (&c2, &c3),
        Some("c3") => (&c3, &c2),
        _ => panic!("adopted by c2 or c3: {adopter}"),
    };
    holder.park(&a).await;
    // At once, through the other: the admin's one L4 is free again, though that controller
    // has not heard from the worker since (it would refuse 429 gpu_quota_exceeded until the
    // worker's next heartbeat).
    let (status, b) = other
        .call(reqwest::Method::POST, "/v1/sandboxes", Some(gpu_create))
        .await;
    assert_eq!(status, 201, "{b}\n{}", other.log());
    let b = b["id"].as_str().unwrap();
    assert_ne!(other.sandbox(b).await["node"], first.as_str());
}

/// One controller (`c1`, counting a worker lost after `lost_after_ms`) and two one-L4 workers
/// (`ga`, `gb`); a whole-GPU sandbox created, parked and uploaded, its wake ticket on the
/// worker it ran on. Returns them with the sandbox's id and that worker's name.
async fn parked_gpu_sandbox(
    dir: &Path,
    database: &str,
    lost_after_ms: u64,
) -> (Controller, [Worker; 2], String, String) {
    let c1 = Controller::start_with(dir, database, "c1", lost_after_ms).await;
    let workers = gpu_workers(dir, &c1.cluster, &[&c1]).await;
    let (status, s) = c1
        .call(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "host", "gpu": {"mode": "whole"}})),
        )
        .await;
    assert_eq!(status, 201, "{s}");
    let id = s["id"].as_str().unwrap().to_string();
    let first = c1.sandbox(&id).await["node"].as_str().unwrap().to_string();
    c1.park(&id).await;
    wait_uploaded(&c1, &id).await;
    wait_gpu_rows(
        dir,
        &first,
        |r| r == [id.clone()],
        "the parked sandbox's ticket",
    )
    .await;
    (c1, workers, id, first)
}

/// A wake ticket a worker could not be told to drop (it was stopped) is dropped after the
/// controller that asked restarts: the missed call was kept in PostgreSQL and the restarted
/// controller's sweep asks again once the worker is back (`torpor_cluster::tickets`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_ticket_drop_a_worker_missed_is_asked_again_after_the_controller_restarts() {
    let Some((database, tmp)) = setup("torpor-cluster-gpu-missed-", &["c1"], &["ga", "gb"]).await
    else {
        return;
    };
    let dir = tmp.path();
    let (mut c1, mut workers, id, first) = parked_gpu_sandbox(dir, &database, 60_000).await;

    // Its worker stops answering (SIGSTOP); the delete's drop of the ticket fails there.
    let worker = workers.iter_mut().find(|w| w.name == first).unwrap();
    let pid = worker.child.as_ref().unwrap().id() as i32;
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let (status, v) = c1
        .call(
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{id}"),
            None,
        )
        .await;
    assert_eq!(status, 204, "{v}");
    let deadline = Instant::now() + PATIENCE;
    while !c1.log().contains("a worker missed a wake ticket's drop") {
        assert!(
            Instant::now() < deadline,
            "the missed drop was not kept:\n{}",
            c1.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The controller that would ask again from memory dies before the worker is back.
    c1.child.kill().unwrap();
    c1.child.wait().unwrap();
    assert_eq!(
        gpu_rows(dir, &first),
        std::slice::from_ref(&id),
        "still kept"
    );
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    c1.kill_and_restart().await;
    wait_gpu_rows(
        dir,
        &first,
        |r| r.is_empty(),
        "no ticket left once the restarted controller swept the book",
    )
    .await;
    assert!(
        c1.log().contains("swept the wake tickets workers missed"),
        "{}",
        c1.log()
    );
}

/// Two controllers, one tenant allowed one L4 across the cluster, two GPU workers with one L4
/// each: GPU creates through both controllers at the same moment pass one, whatever the
/// workers' heartbeats have said yet (the tenant's GPU starts take turns across controllers
/// and the second counts what the first started). On the way, a worker drained through one
/// controller is drained on the other, across a restart, until lifted through either; and a
/// GPU sandbox's park on a worker runs cuda-checkpoint in it (refused without one), its wake
/// on another worker through the other controller runs it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenants_gpu_quota_holds_when_two_controllers_start_at_the_same_moment() {
    let Some((database, tmp)) =
        setup("torpor-cluster-gpu-race-", &["c1", "c2"], &["ga", "gb"]).await
    else {
        return;
    };
    let dir = tmp.path();
    let quotas = fixture("quotas-admin-one-l4.toml");
    // Heartbeats 3 s apart: a share given back must reach the quota checks of both
    // controllers without one (the checkpoint's and destroy's answers, the shared book).
    let args = ["--gpu-quotas", &quotas, "--heartbeat-ms", "3000"];
    let c1 = Controller::start_args(dir, &database, "c1", 10_000, &args).await;
    let mut c2 = Controller::start_args(dir, &database, "c2", 10_000, &args).await;
    let both = format!("{},{}", c1.cluster, c2.cluster);
    let _workers = gpu_workers(dir, &both, &[&c1, &c2]).await;
    async fn create(c: &Controller) -> (u16, Value) {
        c.call(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "host", "gpu": {"mode": "whole"}})),
        )
        .await
    }
    for round in 0..2 {
        let (a, b) = tokio::join!(create(&c1), create(&c2));
        let outcomes = [(&c1, a), (&c2, b)];
        let passed: Vec<_> = outcomes.iter().filter(|(_, (s, _))| *s == 201).collect();
        let refused: Vec<_> = outcomes
            .iter()
            .filter(|(_, (s, v))| *s == 429 && v["error"]["code"] == "gpu_quota_exceeded")
            .collect();
        assert_eq!(
            (passed.len(), refused.len()),
            (1, 1),
            "round {round}: one GPU create passes, the other is refused: {:?}",
            outcomes.iter().map(|(_, o)| o).collect::<Vec<_>>()
        );
        // The one that passed holds the tenant's whole quota; once it is gone, both
        // controllers see the share given back.
        let (holder, (_, sb)) = passed[0];
        let id = sb["id"].as_str().unwrap();
        holder
            .ok(
                reqwest::Method::DELETE,
                &format!("/v1/sandboxes/{id}"),
                None,
            )
            .await;
        for c in [&c1, &c2] {
            c.wait_nodes("the share given back", |n| {
                admin_gpu_compute(n, "ga") + admin_gpu_compute(n, "gb") == 0
            })
            .await;
        }
    }

    // A GPU sandbox that wakes on another worker leaves no wake ticket on the one it left
    // (that worker drained), and keeps its share where it runs.
    let (status, a) = create(&c1).await;
    assert_eq!(status, 201, "{a}");
    let a = a["id"].as_str().unwrap().to_string();
    let left = c1.sandbox(&a).await["node"].as_str().unwrap().to_string();
    // cuda-checkpoint on a worker: one of its processes holds a GPU device file (a plain file
    // named like one, on the sandbox's own /dev: there is no GPU here). Without a
    // cuda-checkpoint in the sandbox its park is refused and it keeps running where it is.
    let holder = c1
        .exec(
            &a,
            "touch /dev/nvidia0 && (exec sleep 300 </dev/nvidia0 &) && sleep 0.5 && pgrep -x sleep",
        )
        .await;
    let holder = holder.trim().to_string();
    let (status, refused) = c1
        .call(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{a}/suspend"),
            Some(json!({"tier": "parked"})),
        )
        .await;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (409, Some("checkpoint_gpu_context")),
        "{refused}"
    );
    let kept = c1.sandbox(&a).await;
    assert_eq!(
        (&kept["state"], &kept["node"]),
        (&json!("running"), &json!(left))
    );
    // With a stand-in cuda-checkpoint (it writes down its arguments), the park below moves
    // the holder's GPU state out first, and the wake on the other worker moves it back.
    c1.exec(
        &a,
        "mkdir -p /opt/nvidia/bin && printf '#!/bin/sh\\necho \"$@\" >> /tmp/toggles\\n' > /opt/nvidia/bin/cuda-checkpoint && chmod +x /opt/nvidia/bin/cuda-checkpoint",
    )
    .await;
    // Drained first, its worker uploads the checkpoint before the park answers (a wake can
    // then go anywhere).
    c1.ok(
        reqwest::Method::POST,
        &format!("/v1/nodes/{left}/drain"),
        None,
    )
    .await;
    // A drain through one controller holds on the other (kept in the database they share).
    c2.wait_nodes("the drain through c1, seen by c2", |n| {
        state_of(n, &left) == Some("draining")
    })
    .await;
    c1.park(&a).await;
    wait_gpu_rows(
        dir,
        &left,
        |r| r == [a.clone()],
        "the ticket of the parked sandbox",
    )
    .await;
    // A controller counts the tenant's holdings on other workers from their reports. The
    // checkpoint's answer is one, and c1 keeps it in the shared book: the wake at once, through
    // the other controller and onto the other worker, does not count the parked sandbox's
    // share as still held (the tenant's quota is one L4: it would be refused 429 until the
    // drained worker's next heartbeat).
    let toggles = c2
        .exec(
            &a,
            &format!("cat /tmp/toggles; kill -0 {holder} && echo alive"),
        )
        .await;
    let now_on = c1.sandbox(&a).await["node"].as_str().unwrap().to_string();
    assert_ne!(now_on, left, "woke on the worker that is not drained");
    assert_eq!(
        toggles,
        format!("--toggle --pid {holder}\n--toggle --pid {holder}\nalive\n"),
        "suspended by c1's park, resumed by c2's wake, once each"
    );
    wait_gpu_rows(
        dir,
        &left,
        |r| r.is_empty(),
        "no ticket of a sandbox that woke elsewhere",
    )
    .await;
    assert!(
        !gpu_request_rows(dir, &left).contains(&a),
        "{left}: no GPU request of a sandbox that woke elsewhere"
    );
    assert_eq!(
        gpu_rows(dir, &now_on),
        std::slice::from_ref(&a),
        "its share where it runs"
    );
    assert!(
        gpu_request_rows(dir, &now_on).contains(&a),
        "its request where it runs"
    );

    // The drain outlives a controller's restart; lifted through that one, it is lifted on the
    // other too.
    c2.kill_and_restart().await;
    c2.wait_nodes("the drain, after c2's restart", |n| {
        state_of(n, &left) == Some("draining")
    })
    .await;
    let lifted = c2
        .ok(
            reqwest::Method::DELETE,
            &format!("/v1/nodes/{left}/drain"),
            None,
        )
        .await;
    assert_eq!(lifted["state"], "ready", "{lifted}");
    c1.wait_nodes("the drain lifted through c2, seen by c1", |n| {
        state_of(n, &left) == Some("ready")
    })
    .await;
    let (status, body) = c1
        .call(reqwest::Method::DELETE, "/v1/nodes/nobody/drain", None)
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (404, Some("node_not_found"))
    );
}

/// A tenant within its guarantee takes back a GPU share that another tenant borrows, when the
/// borrowing shows only cluster-wide (each worker's share alone is within the borrower's
/// guarantee) and the borrower is held by the other controller: the start's controller has it
/// parked through the holder, then starts on the worker it freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gpu_share_borrowed_across_workers_is_taken_back_through_the_other_controller() {
    let Some((database, tmp)) =
        setup("torpor-cluster-gpu-reclaim-", &["c1", "c2"], &["ga", "gb"]).await
    else {
        return;
    };
    let dir = tmp.path();
    let quotas = fixture("quotas-reclaim-cluster.toml");
    let args = ["--gpu-quotas", &quotas];
    let c1 = Controller::start_args(dir, &database, "c1", 10_000, &args).await;
    let c2 = Controller::start_args(dir, &database, "c2", 10_000, &args).await;
    let both = format!("{},{}", c1.cluster, c2.cluster);
    let _workers = gpu_workers(dir, &both, &[&c1, &c2]).await;
    // The admin (guaranteed one L4, may borrow a second) takes both, through c1.
    let mut admin = Vec::new();
    for _ in 0..2 {
        let sb = c1
            .ok(
                reqwest::Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": "host", "gpu": {"mode": "whole"}})),
            )
            .await;
        let id = sb["id"].as_str().unwrap().to_string();
        let pid = c1
            .exec(&id, "echo kept > /tmp/state; sleep 1000 & echo $!")
            .await;
        let node = c1.sandbox(&id).await["node"].as_str().unwrap().to_string();
        admin.push((id, pid.trim().to_string(), node));
    }
    let mut nodes: Vec<&str> = admin.iter().map(|(_, _, n)| n.as_str()).collect();
    nodes.sort();
    assert_eq!(nodes, ["ga", "gb"], "one L4 each: {admin:?}");
    // c2 hears of both shares from the workers' heartbeats.
    c2.wait_nodes("the admin's two shares", |n| {
        admin_gpu_compute(n, "ga") + admin_gpu_compute(n, "gb") == 1400
    })
    .await;
    let team = tenant_token(&c1, "team").await;
    // `team` (guaranteed one L4) creates through c2: one of the admin's sandboxes is parked by
    // its holder, c1, and `team` gets that L4.
    let (status, owned) = c2
        .call_as(
            &team,
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "host", "gpu": {"mode": "whole"}})),
        )
        .await;
    assert_eq!(status, 201, "{owned}\n{}\n{}", c2.log(), c1.log());
    let owned = owned["id"].as_str().unwrap().to_string();
    let (status, s) = c2
        .call_as(
            &team,
            reqwest::Method::GET,
            &format!("/v1/sandboxes/{owned}"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{s}");
    let freed = s["node"].as_str().unwrap().to_string();
    let (victim, pid, _) = admin.iter().find(|(_, _, n)| *n == freed).unwrap().clone();
    let (kept, _, _) = admin.iter().find(|(_, _, n)| *n != freed).unwrap().clone();
    let v = c1.sandbox(&victim).await;
    assert!(
        v["state"] == "parked" || v["state"] == "suspended",
        "the borrower on {freed} is asleep: {v}"
    );
    // The other borrower keeps its share: awake (the idle policy may have frozen it on a
    // loaded machine; a frozen sandbox keeps its container and share).
    let k = c1.sandbox(&kept).await;
    assert!(k["state"] == "running" || k["state"] == "frozen", "{k}");
    assert_eq!(
        c1.metric("torpor_transitions_total{cause=\"gpu_reclaimed\",to_tier=\"parked\"}")
            .await,
        1,
        "its holder parked it for the reclaim"
    );
    // The borrower cannot wake while `team` holds its L4 (neither may take it from the other).
    let (status, err) = c2
        .call(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{victim}/exec"),
            Some(json!({"cmd": ["true"]})),
        )
        .await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (503, Some("gpu_unavailable")),
        "{err}"
    );
    assert!(
        !err.to_string().contains(&owned),
        "a refusal names no other tenant's sandbox: {err}"
    );
    // Once `team` gives it back, the borrower wakes with its files and processes.
    let (status, _) = c2
        .call_as(
            &team,
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{owned}"),
            None,
        )
        .await;
    assert_eq!(status, 204);
    let out = c2
        .exec(
            &victim,
            &format!("cat /tmp/state; kill -0 {pid} && echo alive"),
        )
        .await;
    assert_eq!(out, "kept\nalive\n");
}

/// A worker one controller cannot call while another still can (a partial partition, and a
/// one-way one: the worker's heartbeats still reach that controller, so only its probes show
/// it): the one that counts it lost ends its containers there through the other before their
/// sandboxes resume elsewhere, so no sandbox runs twice. (A worker cut off from every
/// controller fences itself: the test above; a silent one is lost as every lost-worker test
/// shows, and fenced through another controller the same way as here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_one_controller_cannot_call_has_its_containers_ended_through_another_before_they_resume(
) {
    let Some((database, tmp)) =
        setup("torpor-cluster-partial-", &["c1", "c2"], &["w1", "w2"]).await
    else {
        return;
    };
    let dir = tmp.path();
    // Declared first, dropped last: after the processes in its groups are gone.
    let mut cut = Partition::new("torpor_partial");
    let c1_group = cut.group("c1");
    let c1 = Controller::start_in(dir, &database, "c1", 3000, &[], Some(&c1_group)).await;
    let c2 = Controller::start_with(dir, &database, "c2", 3000).await;
    let both = format!("{},{}", c1.cluster, c2.cluster);
    let w1 = Worker::start(dir, "w1", "w1", &both);
    for c in [&c1, &c2] {
        c.wait_nodes("w1 ready", |n| state_of(n, "w1") == Some("ready"))
            .await;
    }
    c1.wait_host_template().await;
    // c1 holds a sandbox on w1 (the only worker yet), with state never checkpointed.
    let id = c1.create_with_state().await;
    let before = c1.sandbox(&id).await;
    assert_eq!(
        (&before["node"], &before["controller"]),
        (&json!("w1"), &json!("c1")),
        "{before}"
    );
    let _w2 = Worker::start(dir, "w2", "w2", &both);
    for c in [&c1, &c2] {
        c.wait_nodes("w2 ready", |n| state_of(n, "w2") == Some("ready"))
            .await;
    }

    // c1's calls no longer reach w1, whose heartbeats still reach c1; c2 reaches both.
    let port = |addr: &str| addr.rsplit(':').next().unwrap().parse::<u16>().unwrap();
    let w1_addr = c1
        .nodes()
        .await
        .into_iter()
        .find(|n| n["name"] == "w1")
        .unwrap()["addr"]
        .as_str()
        .unwrap()
        .to_string();
    cut.cut(&c1_group, port(&w1_addr));
    let unreached = |n: &[Value]| {
        n.iter()
            .any(|n| n["name"] == "w1" && n["unreachable_since"].is_string())
    };
    c1.wait_nodes("w1 out of c1's reach", unreached).await;
    c1.wait_nodes("w1 lost to c1", |n| state_of(n, "w1") == Some("lost"))
        .await;
    let seen_by_c2 = c2.nodes().await;
    assert_eq!(state_of(&seen_by_c2, "w1"), Some("ready"));
    assert!(!unreached(&seen_by_c2), "{seen_by_c2:?}");
    assert_eq!(c1.metric("torpor_nodes{state=\"lost\"}").await, 1);
    assert_eq!(c2.metric("torpor_nodes{state=\"ready\"}").await, 2);
    assert_eq!(c2.metric("torpor_nodes_unreachable").await, 0);
    assert!(
        c1.log()
            .contains("this controller cannot call the worker that heartbeats to it"),
        "{}",
        c1.log()
    );

    // The moment c1 sends the sandbox back to its snapshot, its container on w1 is gone
    // already (without the fence it ran on while the sandbox resumed on w2).
    let deadline = Instant::now() + PATIENCE;
    loop {
        let s = c1.sandbox(&id).await;
        if s["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("worker w1 was lost"))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never reported lost: {s}\n{}",
            c1.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !w1.containers().iter().any(|c| c.starts_with(&id)),
        "the stale copy still runs on w1: {:?}\n{}\n{}",
        w1.containers(),
        w1.log(),
        c1.log()
    );
    assert!(w1.log().contains("fence orders"), "{}", w1.log());
    assert!(
        c1.log()
            .contains("the lost worker's containers were ended through another controller"),
        "{}",
        c1.log()
    );
    // The sandbox resumes from its snapshot (its template's fresh state: never parked); through
    // c1, on w2 (w1 is lost to c1).
    assert_eq!(
        c1.exec(&id, "cat /tmp/state 2>/dev/null || echo fresh")
            .await,
        "fresh\n"
    );
    assert_eq!(c2.sandbox(&id).await["node"], "w2");
    // Healed: w1 joins c1 again, running nothing of c1's.
    cut.heal();
    c1.wait_nodes("w1 back on c1", |n| state_of(n, "w1") == Some("ready"))
        .await;
    assert!(!w1.containers().iter().any(|c| c.starts_with(&id)));
}

/// A GPU sandbox's wake ticket stays only where it can be used: after its controller
/// restarted (it no longer knows where the sandbox last ran), a wake on another worker still
/// has the worker it left drop the ticket (the controller asks every other GPU worker).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gpu_sandbox_woken_elsewhere_after_a_controller_restart_leaves_no_ticket_behind() {
    let Some((database, tmp)) = setup("torpor-cluster-gpu-ticket-", &["c1"], &["ga", "gb"]).await
    else {
        return;
    };
    let dir = tmp.path();
    // Parked and in the store: its wake can go anywhere.
    let (mut c1, _workers, id, first) = parked_gpu_sandbox(dir, &database, 10_000).await;
    let known = |n: &[Value]| {
        ["ga", "gb"]
            .iter()
            .all(|w| state_of(n, w).is_some_and(|s| s != "lost"))
    };
    let drain = format!("/v1/nodes/{first}/drain");

    c1.kill_and_restart().await;
    c1.wait_nodes("both GPU workers back", known).await;
    c1.ok(reqwest::Method::POST, &drain, None).await;
    c1.exec(&id, "true").await;
    let now_on = c1.sandbox(&id).await["node"].as_str().unwrap().to_string();
    assert_ne!(now_on, first, "woke on the worker that is not drained");
    wait_gpu_rows(
        dir,
        &first,
        |r| r.is_empty(),
        "no ticket of a sandbox that woke elsewhere after its controller restarted",
    )
    .await;
    assert_eq!(
        gpu_rows(dir, &now_on),
        std::slice::from_ref(&id),
        "its share where it runs"
    );
}

/// A tenant's `requests_per_s` holds for the cluster: its calls spread over two controllers of
/// one database pass its rate once, not once per controller (torpor_api::rate_share). Calls
/// that need no worker (lists), so no worker runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenants_rate_limit_holds_across_two_controllers() {
    let Some((database, tmp)) = setup("torpor-rates-", &["c1", "c2"], &[]).await else {
        return;
    };
    let dir = tmp.path();
    let c1 = Controller::start_as(dir, &database, "c1").await;
    let c2 = Controller::start_as(dir, &database, "c2").await;
    let (rate, burst) = (2.0, 4.0);
    let tenant = c1
        .ok(
            reqwest::Method::POST,
            "/v1/tenants",
            Some(json!({"name": "metered", "quotas": {"requests_per_s": 2}})),
        )
        .await;
    let token = tenant["token"].as_str().unwrap().to_string();

    // Four callers for 6 s, each call to the next controller in turn.
    let passed = [(); 2].map(|_| std::sync::atomic::AtomicUsize::new(0));
    let refused = std::sync::atomic::AtomicUsize::new(0);
    let started = Instant::now();
    let until = started + Duration::from_secs(6);
    let callers = (0..4).map(|k| {
        let (token, passed, refused) = (&token, &passed, &refused);
        let controllers = [&c1, &c2];
        async move {
            let mut i = k;
            while Instant::now() < until {
                let (status, v) = controllers[i % 2]
                    .call_as(token, reqwest::Method::GET, "/v1/sandboxes", None)
                    .await;
                match status {
                    200 => passed[i % 2].fetch_add(1, std::sync::atomic::Ordering::SeqCst),
                    429 => refused.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
                    _ => panic!("{status}: {v}"),
                };
                i += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    futures::future::join_all(callers).await;
    let elapsed = started.elapsed().as_secs_f64();
    let through: Vec<usize> = passed
        .iter()
        .map(|p| p.load(std::sync::atomic::Ordering::SeqCst))
        .collect();
    let (total, refused) = (
        through.iter().sum::<usize>() as f64,
        refused.load(std::sync::atomic::Ordering::SeqCst),
    );
    // One bucket for the cluster: its burst and its rate over the run, and what the other
    // controller lets through before it hears (a report every 250 ms) at the edges. One
    // bucket per controller would pass twice that (burst and rate each).
    let bound = burst + rate * elapsed + 5.0;
    eprintln!("rates across controllers: {through:?} passed, {refused} refused in {elapsed:.1} s (bound {bound:.0})");
    assert!(
        total <= bound,
        "{through:?} passed in {elapsed:.1} s (refused {refused}): over the cluster-wide bound {bound:.0}"
    );
    assert!(
        total >= rate * elapsed * 0.6,
        "{through:?} passed in {elapsed:.1} s: the tenant gets its rate"
    );
    assert!(
        through.iter().all(|n| *n > 0),
        "both controllers served: {through:?}"
    );
    assert!(refused > 0);
}

/// A controller dies while its sandboxes fill every worker slot the survivor sees: the
/// survivor adopts them all where they run (a permit over its view of the slots, paid back as
/// the workers' next heartbeats give it the dead controller's), and nothing is lost. Before,
/// adoption needed a free permit, and these sandboxes went back to their last snapshots.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_controllers_sandboxes_filling_every_slot_are_adopted_with_nothing_lost() {
    let Some((database, tmp)) = setup("torpor-adopt-full-", &["c1", "c2"], &["w1"]).await else {
        return;
    };
    let dir = tmp.path();
    let c1 = Controller::start_as(dir, &database, "c1").await;
    let c2 = Controller::start_as(dir, &database, "c2").await;
    let both = format!("{},{}", c1.cluster, c2.cluster);
    let _w1 = Worker::start(dir, "w1", "w1", &both); // 2 slots
    for c in [&c1, &c2] {
        c.wait_nodes("w1 ready on each controller", |n| {
            state_of(n, "w1") == Some("ready")
        })
        .await;
    }
    c1.wait_host_template().await;
    let ids = [c1.create_with_state().await, c1.create_with_state().await];
    // c2 sees no free slot: both are c1's (as of w1's heartbeats).
    let deadline = Instant::now() + PATIENCE;
    loop {
        let total = c2.ok(reqwest::Method::GET, "/v1/workers", None).await["total"].clone();
        if total == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "c2's lot: {total}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut c1 = c1;
    c1.child.kill().unwrap();
    c1.child.wait().unwrap();

    for id in &ids {
        let out = exec_retrying(&c2, id, CHECK).await;
        assert_eq!(
            out,
            "disk-1\nmem-1\nprocess-alive\n",
            "{id} adopted with its files, memory and process:\n{}",
            c2.log()
        );
        let back = c2.sandbox(id).await;
        assert_eq!(
            (&back["controller"], &back["state"], &back["last_error"]),
            (&json!("c2"), &json!("running"), &Value::Null),
            "{back}"
        );
    }
    // The overdraft is paid back: once w1's heartbeats count both for c2, its lot is whole
    // again (2 slots, both busy), and a third sandbox waits for one rather than overfilling.
    let deadline = Instant::now() + PATIENCE;
    loop {
        let w = c2.ok(reqwest::Method::GET, "/v1/workers", None).await;
        if w["total"] == 2 && w["busy"] == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "c2's lot: {w}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for id in &ids {
        c2.ok(
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{id}"),
            None,
        )
        .await;
    }
}

/// Two processes given one controller name (one certificate shared by two replicas) would
/// both hold every sandbox the name holds and end each other's containers on the workers:
/// the second refuses to start (`controller_identity_in_use`) while the first lives, touching
/// nothing, and the first keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_process_with_a_controllers_name_is_refused_and_the_first_keeps_serving() {
    let Some((database, tmp)) = setup("torpor-one-name-", &["c1"], &["w1"]).await else {
        return;
    };
    let dir = tmp.path();
    let c1 = Controller::start_as(dir, &database, "c1").await;
    let _w1 = Worker::start(dir, "w1", "w1", &c1.cluster);
    c1.wait_nodes("w1 ready", |n| state_of(n, "w1") == Some("ready"))
        .await;
    c1.wait_host_template().await;
    let id = c1.create_with_state().await;

    // Another process with c1's certificate, addresses and a data directory of its own.
    let twin = dir.join("controller-twin");
    std::fs::create_dir_all(&twin).unwrap();
    std::fs::copy(
        dir.join("controller-c1").join("env.key"),
        twin.join("env.key"),
    )
    .unwrap();
    let addr = || format!("127.0.0.1:{}", cluster::free_port());
    let (api, cluster_addr, peer) = (addr(), addr(), addr());
    let started = Instant::now();
    // It gives up once c1's lease would have expired (2 s here) and a second more.
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(cluster::BIN)
            .args(["controller", "--database", &database])
            .args(["--store", dir.join("store").to_str().unwrap()])
            .args(["--listen", &api, "--cluster-listen", &cluster_addr])
            .args(["--peer-listen", &peer])
            .args(["--tls-dir", dir.join("c1").to_str().unwrap()])
            .args(["--controller-lost-after-ms", "2000"])
            .args([
                "--admin-token-file",
                dir.join("admin-token").to_str().unwrap(),
            ])
            .args(["--data-dir", twin.to_str().unwrap()])
            .env("TORPOR_LOG", "info")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the twin gives up within its patience")
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the twin started:\n{stderr}");
    assert!(
        stderr.contains("held by another live controller"),
        "{stderr}"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "it waited for the name's lease before giving up: {:?}",
        started.elapsed()
    );
    assert!(
        reqwest::get(format!("http://{api}/healthz")).await.is_err(),
        "the twin never served"
    );

    // The first one keeps its name, its sandbox and everything in it.
    assert_eq!(c1.exec(&id, CHECK).await, "disk-1\nmem-1\nprocess-alive\n");
    let sb = c1.sandbox(&id).await;
    assert_eq!(
        (&sb["controller"], &sb["state"]),
        (&json!("c1"), &json!("running")),
        "{sb}"
    );
    let nodes = c1.ok(reqwest::Method::GET, "/v1/nodes", None).await;
    assert_eq!(
        state_of(nodes.as_array().unwrap(), "w1"),
        Some("ready"),
        "{nodes}"
    );
    c1.ok(
        reqwest::Method::DELETE,
        &format!("/v1/sandboxes/{id}"),
        None,
    )
    .await;
}

/// Each pool's scaler and running agents as `c` answers them.
async fn scalers(c: &Controller) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for name in ["p1", "p2"] {
        // 404 until the controller has read a pool made through the other one.
        let (status, p) = c
            .call(reqwest::Method::GET, &format!("/v1/pools/{name}"), None)
            .await;
        assert!(status == 200 || status == 404, "{status} {p}");
        let scaler = p["controller"].as_str().unwrap_or("").to_string();
        out.push((scaler, p["running"].clone()));
    }
    out
}

/// Running sandboxes spread over the controllers as they run: a controller holding more than
/// its share passes its idlest to one under its share (after a rolling upgrade every sandbox
/// ends up with the controller stopped last, and one that joins holds none); no checkpoint,
/// nothing lost, and calls through either controller keep working.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn running_sandboxes_spread_over_the_controllers_as_they_run() {
    let Some((_tmp, _, c1, mut c2, _workers)) = two_by_two("torpor-balance-").await else {
        return;
    };
    c1.wait_host_template().await;
    // c2 away: c1 holds every sandbox it makes.
    c2.terminate().await;
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(c1.create_with_state().await);
    }
    let checkpoints = "torpor_checkpoint_seconds_count{outcome=\"ok\"}";
    let before = c1.metric(checkpoints).await;
    let c2_before = c2.log().len();
    c2.kill_and_restart().await;
    let deadline = Instant::now() + PATIENCE;
    loop {
        let held = holders(&c1, &ids).await;
        let on_c2 = held.iter().filter(|h| *h == "c2").count();
        if on_c2 == 2 && held.iter().filter(|h| *h == "c1").count() == 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not spread: {held:?}\n{}",
            c1.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Everything still there, through either controller; nothing was checkpointed.
    for id in &ids {
        for c in [&c1, &c2] {
            assert_eq!(
                c.exec(id, CHECK).await,
                "disk-1\nmem-1\nprocess-alive\n",
                "{id}"
            );
        }
        let sb = c1.sandbox(id).await;
        assert!(sb["last_error"].is_null(), "nothing was lost: {sb}");
        assert!(sb["state"] == "running", "{sb}");
    }
    assert_eq!(c1.metric(checkpoints).await, before, "{}", c1.log());
    let log = c2.log();
    assert!(
        log[c2_before..].contains("took a running sandbox back; nothing was lost")
            && log[c2_before..].contains("handed_over"),
        "{}",
        &log[c2_before..]
    );
    // Balanced, it stays so: nothing moves back and forth.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let held = holders(&c1, &ids).await;
    assert_eq!(
        held.iter().filter(|h| *h == "c2").count(),
        2,
        "{held:?}\nc1: {}\nc2: {}",
        c1.log(),
        c2.log()
    );
    assert!(
        !c1.log().contains("a sandbox passed here waits"),
        "{}",
        c1.log()
    );
}

/// Balancing weighs load before numbers: with the sandboxes evenly held by number, the busy
/// ones (a call within the controller-lost silence) still spread. c1 holds six sandboxes, four
/// of them taking calls all along; when c2 joins, counting alone would pass c1's three idlest
/// (the two idle ones and one busy); weighing load, c2 takes two of the busy ones and c1 keeps
/// the idle ones: two busy on each, every state intact, nothing checkpointed, and it stays so
/// while the calls go on. c2 here says no call rate (it does not balance, as a controller built
/// before call rates would not say one), so c1 counts busy sandboxes: the rule a cluster falls
/// back on during a rolling upgrade ([`controllers_even_out_the_calls_they_serve`] weighs
/// rates).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn busy_sandboxes_spread_over_the_controllers_before_idle_ones() {
    // Three workers of two slots: room for all six at once. They say their machine's idle
    // CPU (all the same machine here: where a sandbox goes does not matter to this test).
    let Some((_tmp, _, c1, mut c2, _workers)) = two_controllers_and(
        "torpor-balance-load-",
        &["w1", "w2", "w3"],
        &["--report-cpu", "true"],
    )
    .await
    else {
        return;
    };
    // From their second heartbeat on, workers say how much of their machine's CPU is idle
    // (placement ranks them by it); never more than the cores they registered.
    let nodes = c1
        .wait_nodes("every worker's idle CPU", |n| {
            n.iter().all(|w| w["cpu_idle_millicores"].is_u64())
        })
        .await;
    for n in &nodes {
        let cores = n["cores"].as_u64().expect("cores");
        assert!(cores >= 1, "{n}");
        assert!(
            n["cpu_idle_millicores"].as_u64().unwrap() <= cores * 1000,
            "{n}"
        );
    }
    c1.wait_host_template().await;
    c2.terminate().await;
    let mut ids = Vec::new();
    for _ in 0..6 {
        ids.push(c1.create_with_state().await);
    }
    let (busy, idle) = ids.split_at(4);
    // Calls to the busy four through c1, one every 100 ms in turn, until the test ends.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let caller = tokio::spawn(keep_calling(c1.api.clone(), busy.to_vec(), stop.clone()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let checkpoints = "torpor_checkpoint_seconds_count{outcome=\"ok\"}";
    let before = c1.metric(checkpoints).await;
    c2.kill_and_restart_with(&["--balance-sandboxes", "false"])
        .await;
    let on = |held: &[String], c: &str| held.iter().filter(|h| *h == c).count();
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (b, i) = (holders(&c1, busy).await, holders(&c1, idle).await);
        if caller.is_finished() {
            let failed = caller.await.unwrap().unwrap_err();
            panic!("{failed}\nc1: {}\nc2: {}", c1.log(), c2.log());
        }
        if on(&b, "c2") == 2 && on(&b, "c1") == 2 {
            assert_eq!(
                on(&i, "c1"),
                2,
                "the idle ones stay: busy {b:?}, idle {i:?}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "busy ones not spread: busy {b:?}, idle {i:?}\n{}",
            c1.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Balanced, it stays so while the calls go on: nothing moves back and forth.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (b, i) = (holders(&c1, busy).await, holders(&c1, idle).await);
    assert_eq!(
        (on(&b, "c2"), on(&i, "c2")),
        (2, 0),
        "busy {b:?}, idle {i:?}"
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    stop_calling_and_check(&c1, &c2, caller, &ids, before).await;
}

/// Controllers even out the calls they serve, not the number of busy sandboxes: c1 holds six,
/// all taking calls, two of them four times as many as each of the others. When c2 joins,
/// counting busy sandboxes would pass c1's three least called (light ones: c1 would keep both
/// hot ones, two thirds of the calls); weighing call rates, c2 takes one of the hot ones (and
/// light ones to even out the rest), every call is answered, nothing is checkpointed, and the
/// hot ones stay split while the calls go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn controllers_even_out_the_calls_they_serve() {
    let Some((_tmp, c1, mut c2, _workers, ids)) =
        six_on_c1_alone("torpor-balance-rate-", &["w1", "w2", "w3"]).await
    else {
        return;
    };
    let (hot, light) = ids.split_at(2);
    // Each round: each hot one four times, each light one once.
    let mut rounds = Vec::new();
    for _ in 0..4 {
        rounds.extend(hot.iter().cloned());
    }
    rounds.extend(light.iter().cloned());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Two callers: enough calls a second that the hot ones are a load to move.
    let caller = tokio::spawn(keep_calling(c1.api.clone(), rounds.clone(), stop.clone()));
    let second = tokio::spawn(keep_calling(c1.api.clone(), rounds, stop.clone()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let checkpoints = "torpor_checkpoint_seconds_count{outcome=\"ok\"}";
    let before = c1.metric(checkpoints).await;
    c2.kill_and_restart().await;
    let on = |held: &[String], c: &str| held.iter().filter(|h| *h == c).count();
    let deadline = Instant::now() + PATIENCE;
    loop {
        let h = holders(&c1, hot).await;
        if caller.is_finished() {
            let failed = caller.await.unwrap().unwrap_err();
            panic!("{failed}\nc1: {}\nc2: {}", c1.log(), c2.log());
        }
        if on(&h, "c2") == 1 && on(&h, "c1") == 1 {
            break;
        }

        assert!(
            Instant::now() < deadline,
            "hot ones not split: {h:?}, light ones {:?}\n{}",
            holders(&c1, light).await,
            c1.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Split, they stay so while the calls go on.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (h, l) = (holders(&c1, hot).await, holders(&c1, light).await);
    assert_eq!(
        (on(&h, "c1"), on(&h, "c2")),
        (1, 1),
        "hot {h:?}, light {l:?}"
    );
    assert!(on(&l, "c2") < light.len(), "hot {h:?}, light {l:?}");
    // Each controller says the calls a second it serves.
    for (name, c) in [("c1", &c1), ("c2", &c2)] {
        let rate = c.metric_value("torpor_controller_calls_per_second").await;
        assert!(rate > 0.0, "{name}'s call rate: {rate}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Err(failed) = second.await.unwrap() {
        panic!("{failed}\nc1: {}\nc2: {}", c1.log(), c2.log());
    }
    stop_calling_and_check(&c1, &c2, caller, &ids, before).await;
}

/// Two controllers and `workers`; c2 is stopped, then c1 makes six sandboxes with state (so
/// c1 holds them all): both controllers (c2 stopped: restart it) and the sandboxes' ids.
async fn six_on_c1_alone(
    prefix: &str,
    workers: &[&str],
) -> Option<(
    tempfile::TempDir,
    Controller,
    Controller,
    Vec<Worker>,
    Vec<String>,
)> {
    let (tmp, _, c1, mut c2, started) = two_controllers_and(prefix, workers, &[]).await?;
    c1.wait_host_template().await;
    c2.terminate().await;
    let mut ids = Vec::new();
    for _ in 0..6 {
        ids.push(c1.create_with_state().await);
    }
    Some((tmp, c1, c2, started, ids))
}

/// Waits for `caller` ([`keep_calling`], told to stop) and checks that it made its calls all
/// along, that each of `ids` kept its memory, files and processes (read through `c2`) and lost
/// nothing, and that `c1` took no checkpoint beyond the `before` it had counted.
async fn stop_calling_and_check(
    c1: &Controller,
    c2: &Controller,
    caller: tokio::task::JoinHandle<Result<usize, String>>,
    ids: &[String],
    before: u64,
) {
    let calls = match caller.await.unwrap() {
        Ok(calls) => calls,
        Err(failed) => panic!("{failed}\nc1: {}\nc2: {}", c1.log(), c2.log()),
    };
    assert!(calls > 40, "the sandboxes took calls all along: {calls}");
    for id in ids {
        assert_eq!(
            c2.exec(id, CHECK).await,
            "disk-1\nmem-1\nprocess-alive\n",
            "{id}"
        );
        let sb = c1.sandbox(id).await;
        assert!(sb["last_error"].is_null(), "nothing was lost: {sb}");
    }
    let checkpoints = "torpor_checkpoint_seconds_count{outcome=\"ok\"}";
    assert_eq!(c1.metric(checkpoints).await, before, "{}", c1.log());
}

/// Runs `true` in each of `ids` in turn through the API at `api`, one call every 100 ms, until
/// `stop`: the calls made, or the first that failed (an id listed several times is called as
/// many times a round).
async fn keep_calling(
    api: String,
    ids: Vec<String>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Result<usize, String> {
    let client = reqwest::Client::new();
    let mut calls = 0;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let id = &ids[calls % ids.len()];
        let r = client
            .post(format!("http://{api}/v1/sandboxes/{id}/exec"))
            .bearer_auth(TOKEN)
            .json(&json!({"cmd": ["true"]}))
            .send()
            .await
            .unwrap();
        let status = r.status();
        let body = r.text().await.unwrap_or_default();
        if !status.is_success() {
            return Err(format!("call {calls} to {id}: {status} {body}"));
        }
        calls += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(calls)
}

/// The controller each of `ids` names, read through `c` (`-` for none).
async fn holders(c: &Controller, ids: &[String]) -> Vec<String> {
    let mut held = Vec::new();
    for id in ids {
        let sb = c.sandbox(id).await;
        held.push(sb["controller"].as_str().unwrap_or("-").to_string());
    }
    held
}

/// A controller that is to adopt a running sandbox whose worker has not registered with it yet
/// (it just started: workers come back within their back-off) waits for the worker, answering
/// `409 sandbox_busy`, instead of counting the container gone and sending the sandbox back to
/// its snapshot; once the worker joins, it adopts the container with nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_controller_adopting_a_sandbox_before_its_worker_joins_it_waits_for_the_worker() {
    let Some((database, tmp)) = setup("torpor-adopt-wait-", &["c1", "c2"], &["w1"]).await else {
        return;
    };
    let dir = tmp.path();
    // Declared first, dropped last: after the processes in its groups are gone.
    let mut cut = Partition::new("torpor_adopt_wait");
    let w1_group = cut.group("w1");
    let c1 = Controller::start_with(dir, &database, "c1", 90_000).await;
    let mut c2 = Controller::start_with(dir, &database, "c2", 90_000).await;
    let both = format!("{},{}", c1.cluster, c2.cluster);
    // No fencing while it hears no controller (c1 stopped, c2 cut off) for this test's length,
    // however slow the machine (10 minutes).
    let _w1 = Worker::start_in(
        dir,
        "w1",
        "w1",
        &both,
        &[],
        &["--fence-after-ms", "600000"],
        Some(&w1_group),
    );
    for c in [&c1, &c2] {
        c.wait_nodes("w1 ready", |n| state_of(n, "w1") == Some("ready"))
            .await;
    }
    c1.wait_host_template().await;
    let id = c1.create_with_state().await;

    // c2 starts again and w1 cannot register with it; c1 stops and hands the sandbox off.
    let port = |addr: &str| addr.rsplit(':').next().unwrap().parse::<u16>().unwrap();
    cut.cut(&w1_group, port(&c2.cluster));
    c2.kill_and_restart().await;
    let mut c1 = c1;
    c1.terminate().await;
    assert!(c1.log().contains("handed off"), "{}", c1.log());
    let path = format!("/v1/sandboxes/{id}/exec");
    let exec = || {
        c2.call(
            reqwest::Method::POST,
            &path,
            Some(json!({"cmd": ["sh", "-c", CHECK]})),
        )
    };
    // Before: the container was counted gone (c2 knows no w1) and the sandbox went back to
    // its snapshot, its state lost (and the container ran on, nobody's).
    let (status, out) = exec().await;
    assert_eq!(status, 409, "{out}\n{}", c2.log());
    assert_eq!(out["error"]["code"], "sandbox_busy", "{out}");
    assert!(
        out["error"]["message"].as_str().is_some_and(
            |m| m.contains("runs on worker w1, which has not joined this controller yet")
        ),
        "{out}"
    );
    assert!(
        !c2.log().contains("back to its last snapshot"),
        "{}",
        c2.log()
    );
    // Its record needs no container: read through c2 meanwhile, as it stands in the store.
    let (status, record) = c2
        .call(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(status, 200, "{record}\n{}", c2.log());
    assert_eq!(record["state"], "running", "{record}");
    assert_eq!(record["node"], "w1", "{record}");

    cut.heal();
    let deadline = Instant::now() + PATIENCE;
    let out = loop {
        let (status, out) = exec().await;
        if status == 200 {
            break out;
        }
        assert_eq!(status, 409, "{out}\n{}", c2.log());
        assert!(Instant::now() < deadline, "{out}\n{}", c2.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let sb = c2.sandbox(&id).await;
    assert_eq!(
        out["stdout"],
        "disk-1\nmem-1\nprocess-alive\n",
        "{out}\n{sb}\n{}\n{}",
        c2.log(),
        _w1.log()
    );
    assert_eq!(sb["controller"], "c2", "{sb}");
    assert!(sb["last_error"].is_null(), "nothing was lost: {sb}");
}

/// A controller stopped with SIGTERM (`--on-stop hand-off`, the default) leaves the sandboxes
/// it holds running on their workers and gives up its row: the other controller serves the
/// next call at once, adopting the container as it is (same process, memory and files), with
/// no checkpoint and nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_controller_stopped_cleanly_hands_its_running_sandboxes_over_as_they_are() {
    let Some((_tmp, _, mut c1, c2, _workers)) = two_by_two("torpor-hand-off-").await else {
        return;
    };
    c1.wait_host_template().await;
    let id = c1.create_with_state().await;
    let frozen = c1.create_with_state().await;
    c1.ok(
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{frozen}/suspend"),
        Some(json!({"tier": "frozen"})),
    )
    .await;
    let status = c1.terminate().await;
    let log = c1.log();
    assert!(status.success(), "{status}\n{log}");
    assert!(log.contains("handed off"), "{log}");
    assert!(!log.contains("checkpointing for shutdown"), "{log}");

    for id in [&id, &frozen] {
        let (status, out) = c2
            .call(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{id}/exec"),
                Some(json!({"cmd": ["sh", "-c", CHECK]})),
            )
            .await;
        assert_eq!(status, 200, "{out}\nc1:\n{log}\nc2:\n{}", c2.log());
        assert_eq!(
            out["stdout"], "disk-1\nmem-1\nprocess-alive\n",
            "{id}: {out}"
        );
        let sb = c2.sandbox(id).await;
        assert_eq!(sb["controller"], "c2", "{sb}");
        assert_eq!(sb["state"], "running", "{sb}");
        assert!(sb["last_error"].is_null(), "nothing was lost: {sb}");
    }
    assert!(
        c2.log()
            .contains("took a running sandbox back; nothing was lost"),
        "{}",
        c2.log()
    );

    // c2 is now alone: stopped, it has nobody to hand them to and checkpoints them instead;
    // c1 started again wakes them with all of it.
    let mut c2 = c2;
    c2.terminate().await;
    let log = c2.log();
    assert!(
        log.contains("no other controller is alive to hand the sandboxes to")
            && log.contains("checkpointing for shutdown"),
        "{log}"
    );
    c1.kill_and_restart().await;
    c1.wait_nodes("both workers back on c1", |n| {
        ["w1", "w2"].iter().all(|w| state_of(n, w) == Some("ready"))
    })
    .await;
    for id in [&id, &frozen] {
        assert_eq!(c1.exec(id, CHECK).await, "disk-1\nmem-1\nprocess-alive\n");
    }
}

/// Waits until each of pools p1 and p2 is scaled by one controller, one by each, with its
/// agent running, as c1 and c2 both see it; answers the pool c2 scales.
async fn spread(c1: &Controller, c2: &Controller, when: &str) -> &'static str {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (a, b) = (scalers(c1).await, scalers(c2).await);
        let names: std::collections::BTreeSet<&str> = a.iter().map(|(c, _)| c.as_str()).collect();
        if a == b && names == ["c1", "c2"].into() && a.iter().all(|(_, r)| *r == 1) {
            return ["p1", "p2"][a.iter().position(|(c, _)| c == "c2").unwrap()];
        }
        assert!(
            Instant::now() < deadline,
            "{when}: pools as c1 sees them {a:?}, as c2 does {b:?}\n{}",
            c1.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A pool agent's dispatch handler: logs each message to /tmp/done.log. The first message
/// starting with `slow` that an agent is handed takes 60 s (a controller dies while its lane
/// waits on it); the next is logged at once.
const SLOW_HANDLER: &str = "import os, sys, time\nm = sys.stdin.read()\nif m.startswith('slow') and not os.path.exists('/tmp/slow'):\n    open('/tmp/slow', 'w').close()\n    time.sleep(60)\nopen('/tmp/done.log', 'a').write(m + '\\n')\n";

async fn lpush(con: &mut redis::aio::MultiplexedConnection, key: &str, msg: &str) {
    let _: i64 = redis::cmd("LPUSH")
        .arg(key)
        .arg(msg)
        .query_async(con)
        .await
        .unwrap();
}

/// Waits until each pool's agents, read through `c`, have logged the messages sent to it
/// that start with `prefix`, each exactly once, within `within`.
async fn wait_handled(
    c: &Controller,
    sent: &std::collections::BTreeMap<&str, Vec<String>>,
    prefix: &str,
    within: Duration,
) {
    let client = torpor_api::Client::new(&format!("http://{}", c.api), TOKEN);
    let deadline = Instant::now() + within;
    for (pool, want) in sent {
        let want: Vec<String> = want
            .iter()
            .filter(|m| m.starts_with(prefix))
            .cloned()
            .collect();
        loop {
            let p = client.pool(pool).await.unwrap();
            let mut seen = brokers::handled(&client, &p).await;
            seen.retain(|m, _| m.starts_with(prefix));
            if seen.len() >= want.len() || Instant::now() > deadline {
                brokers::exactly_once(&seen, &want);
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// Pools spread over the controllers (one lease per pool, each controller taking free ones up
/// to its share); a dead controller's pools pass to the survivor with the message its lane
/// held; a controller that joins is handed its share of the running pools, each message
/// handled once throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pools_spread_over_the_controllers_pass_to_the_survivor_and_rebalance() {
    let Some((tmp, database, c1, c2, _workers)) = two_by_two("torpor-pool-leases-").await else {
        return;
    };
    let dir = tmp.path();
    c1.wait_host_template().await;
    let redis = brokers::Redis::start();
    let mut con = redis.conn().await;
    for name in ["p1", "p2"] {
        c1.ok(
            reqwest::Method::POST,
            "/v1/pools",
            Some(json!({
                "name": name, "template": "host", "min": 1, "max": 1, "target": 1,
                "poll_interval_ms": 200,
                "triggers": [{"type": "redis-list", "url": redis.url(), "key": name}],
                "dispatch": {"command": ["python3", "-c", SLOW_HANDLER], "max_attempts": 2,
                             "retry_backoff_ms": 50, "timeout_s": 60},
            })),
        )
        .await;
    }
    let mut sent: std::collections::BTreeMap<&str, Vec<String>> =
        [("p1", Vec::new()), ("p2", Vec::new())].into();
    // Each pool is scaled by one controller, one by each, as either controller sees it.
    spread(&c1, &c2, "at first").await;

    // A rolling upgrade: while a controller of an earlier version holds the one `pools` lease
    // (it scales every pool), neither scales any; once it is gone, they spread again.
    use torpor_control::store::StateStore as _;
    let older = {
        let (url, key) = (database.clone(), dir.join("controller-c1").join("env.key"));
        tokio::task::spawn_blocking(move || {
            let store = torpor_control::store::PostgresStore::connect(&url, &key).unwrap();
            assert!(store
                .try_lease("pools", "c0-older", Duration::from_secs(600))
                .unwrap());
            store
        })
        .await
        .unwrap()
    };
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (a, b) = (scalers(&c1).await, scalers(&c2).await);
        if a.iter().chain(&b).all(|(c, _)| c.is_empty()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "with an older controller's lease: {a:?} {b:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(c1
        .log()
        .contains("a controller of an earlier version runs every pool"));
    tokio::task::spawn_blocking(move || older.release_lease("pools", "c0-older").unwrap())
        .await
        .unwrap();
    let key = spread(&c1, &c2, "after the older controller").await;

    // c2 dies while its lane waits on a message: once its leases expire, c1 scales both, and
    // the message goes back to the queue for c1's lane, well before the first attempt could
    // have logged it (before, it stayed in the pool's processing list for good).
    lpush(&mut con, key, "slow-1").await;
    sent.get_mut(key).unwrap().push("slow-1".into());
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (_, p) = c2
            .call(reqwest::Method::GET, &format!("/v1/pools/{key}"), None)
            .await;
        if p["in_flight"] == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "c2's lane took no message: {p}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut c2 = c2;
    c2.child.kill().unwrap();
    c2.child.wait().unwrap();
    let deadline = Instant::now() + PATIENCE;
    loop {
        let a = scalers(&c1).await;
        if a.iter().all(|(c, r)| c == "c1" && *r == 1) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after c2's loss: {a:?}\n{}",
            c1.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    wait_handled(&c1, &sent, "slow", Duration::from_secs(40)).await;
    assert!(c1.log().contains("requeued unfinished messages"));

    // c2 comes back: c1, now over its share, hands one pool over to it with its agent as it
    // runs (its lane finishes its message, then the agent's hold passes: no checkpoint, no
    // wake). Messages sent all along are each handled once.
    let (c1_before, c2_before) = (c1.log().len(), c2.log().len());
    c2.kill_and_restart().await;
    let pusher = {
        let mut con = redis.conn().await;
        tokio::spawn(async move {
            let mut sent = Vec::new();
            for i in 0..30 {
                let (key, msg) = (["p1", "p2"][i % 2], format!("m-{i}"));
                lpush(&mut con, key, &msg).await;
                sent.push((key, msg));
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            sent
        })
    };
    let key = spread(&c1, &c2, "after c2's return").await;
    let log = c1.log();
    let log = &log[c1_before..];
    assert!(
        log.contains("passing a running agent on with its pool")
            && log.contains("passed a running sandbox's hold to another controller")
            && log.contains("handed a pool over (with its running agents)")
            && !log.contains("draining an agent"),
        "{log}"
    );
    for (k, msg) in pusher.await.unwrap() {
        sent.get_mut(k).unwrap().push(msg);
    }
    wait_handled(&c2, &sent, "m-", PATIENCE).await;
    // c2 adopted the agent on its worker and woke nothing (before: c1 suspended it, c2 woke
    // it from the store); the agent is c2's, running.
    let log = c2.log();
    let log = &log[c2_before..];
    assert!(
        log.contains("took a running sandbox back; nothing was lost")
            && log.contains("handed_over")
            && !log.contains("cannot start an agent"),
        "{log}"
    );
    for tier in ["parked", "suspended"] {
        let wakes = format!("torpor_wake_seconds_count{{from_tier=\"{tier}\"}}");
        assert_eq!(c2.metric(&wakes).await, 0, "c2 woke a {tier} sandbox");
    }
    let (_, pool) = c2
        .call(reqwest::Method::GET, &format!("/v1/pools/{key}"), None)
        .await;
    let agent = pool["sandboxes"][0].as_str().unwrap().to_string();
    let (_, sbx) = c2
        .call(
            reqwest::Method::GET,
            &format!("/v1/sandboxes/{agent}"),
            None,
        )
        .await;
    assert_eq!(sbx["controller"], "c2", "{sbx}");
    assert!(
        sbx["state"] == "running" || sbx["state"] == "frozen",
        "{sbx}"
    );
    for name in ["p1", "p2"] {
        c1.ok(reqwest::Method::DELETE, &format!("/v1/pools/{name}"), None)
            .await;
    }
}

/// Two controllers share a full fleet: six sandboxes on four slots (two workers of two), five
/// of them taking calls through both controllers at once, so sandboxes park and wake all
/// along. Each controller's lot counts the slots the other uses as of the workers' last
/// heartbeats, so within a heartbeat both may count one free slot; the second start then finds
/// no worker with room. Such a start parks an idle sandbox of its own controller's and tries
/// again instead of failing the call: every call is answered, and the states survive.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_through_both_controllers_on_a_full_fleet_are_all_answered() {
    let Some((_tmp, c1, mut c2, _workers, ids)) =
        six_on_c1_alone("torpor-full-fleet-", &["w1", "w2"]).await
    else {
        return;
    };
    // Each round: the first two three times each, the next three once (the last one idle).
    let mut rounds = Vec::new();
    for _ in 0..3 {
        rounds.extend(ids[..2].iter().cloned());
    }
    rounds.extend(ids[2..5].iter().cloned());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let through_c1 = tokio::spawn(keep_calling(c1.api.clone(), rounds.clone(), stop.clone()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    c2.kill_and_restart().await;
    let through_c2 = tokio::spawn(keep_calling(c2.api.clone(), rounds, stop.clone()));
    let until = Instant::now() + Duration::from_secs(20);
    while Instant::now() < until && !through_c1.is_finished() && !through_c2.is_finished() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for caller in [through_c1, through_c2] {
        match caller.await.unwrap() {
            // Each call may wait for a wake on the full fleet: how many fit in the 20 s is
            // the machine's speed, not the test's point (every one answered).
            Ok(calls) => assert!(calls > 0, "calls made: {calls}"),
            Err(failed) => panic!("{failed}\nc1: {}\nc2: {}", c1.log(), c2.log()),
        }
    }
    for id in &ids {
        assert_eq!(
            c1.exec(id, CHECK).await,
            "disk-1\nmem-1\nprocess-alive\n",
            "{id}"
        );
    }
}

/// A controller that stops for longer than its lease (a stalled process, a VM paused, a
/// database it could not reach to renew) is taken for dead: the other controller adopts its
/// running sandbox as it runs. When the stalled one goes on, it must leave that sandbox
/// alone: no freeze, checkpoint, crash report or kill of a container it no longer holds, and
/// calls through it are forwarded to the new holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_controller_stalled_past_its_lease_leaves_the_sandboxes_adopted_meanwhile_alone() {
    let Some((_tmp, _, c1, c2, workers)) = two_by_two("torpor-stalled-").await else {
        return;
    };
    c1.wait_host_template().await;
    let id = c1.create_with_state().await;
    c1.exec(&id, COUNTER).await;
    let held = c1.sandbox(&id).await;
    assert_eq!(held["controller"], "c1", "{held}");
    let container = held["worker"].clone();
    let mut count = kept_all(&c1, &id, &container, 0, "nothing yet").await;

    c1.signal(libc::SIGSTOP);
    // Past its lease (2 s): c2 takes the sandbox over at its next call, adopting it as it runs.
    tokio::time::sleep(Duration::from_secs(4)).await;
    count = kept_all(&c2, &id, &container, count, "the adoption by c2").await;
    assert_eq!(c2.sandbox(&id).await["controller"], "c2");
    c1.signal(libc::SIGCONT);

    // c1 goes on with what it held in memory: its policy, heartbeats and watches run a while.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for (c, what) in [(&c1, "c1 (forwarded)"), (&c2, "c2"), (&c1, "c1 again")] {
        count = kept_all(c, &id, &container, count, what).await;
        assert_eq!(c.sandbox(&id).await["controller"], "c2", "{what}");
    }
    // Parked and woken by its holder: c1 reports no crash of the container that went.
    c1.park(&id).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let woken = c1.exec(&id, CHECK).await;
    assert_eq!(woken, "disk-1\nmem-1\nprocess-alive\n", "all state kept");
    let back = c1.sandbox(&id).await;
    assert_eq!(back["last_error"], Value::Null, "nothing lost: {back}");
    for w in &workers {
        let mine: Vec<String> = w
            .containers()
            .into_iter()
            .filter(|c| c.starts_with(&id))
            .collect();
        assert!(mine.len() <= 1, "one copy at most: {mine:?}");
    }
    assert!(
        !c1.log().contains("crashed"),
        "c1 reported a crash:\n{}",
        c1.log()
    );
}

/// The database restarts (every controller's connections broken, new ones refused) for
/// longer than the controllers' leases: calls meanwhile answer a retryable `503
/// state_store_error` (not a 500), and once it is back every running sandbox answers with
/// everything it had, on its one container, through either controller, each still held by
/// its own controller. Then a partition (the database's packets vanish): the controllers'
/// health still answers while their calls wait for the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_restart_longer_than_the_leases_loses_no_running_sandbox() {
    let Some((database, tmp)) = setup("torpor-db-restart-", &["c1", "c2"], &["w1", "w2"]).await
    else {
        return;
    };
    let dir = tmp.path();
    // Declared first, dropped last: after the processes in its groups are gone.
    let mut outage = Partition::new("torpor_db_restart");
    let groups = [outage.group("c1"), outage.group("c2")];
    let c1 = Controller::start_in(dir, &database, "c1", 2000, &[], Some(&groups[0])).await;
    let c2 = Controller::start_in(dir, &database, "c2", 2000, &[], Some(&groups[1])).await;
    let both = format!("{},{}", c1.cluster, c2.cluster);
    let workers = [
        Worker::start(dir, "w1", "w1", &both),
        Worker::start(dir, "w2", "w2", &both),
    ];
    for c in [&c1, &c2] {
        c.wait_nodes("both workers ready", |n| {
            state_of(n, "w1") == Some("ready") && state_of(n, "w2") == Some("ready")
        })
        .await;
    }
    c1.wait_host_template().await;
    let _logs = LogsOnFailure(&[&c1, &c2]);
    let a = c1.create_with_state().await;
    let b = c2.create_with_state().await;
    let mut kept = Vec::new();
    for (c, id) in [(&c1, &a), (&c2, &b)] {
        c.exec(id, COUNTER).await;
        let container = c.sandbox(id).await["worker"].clone();
        let count = kept_all(c, id, &container, 0, "nothing yet").await;
        kept.push((id.clone(), container, count));
    }

    let db_port: u16 = database
        .rsplit_once(':')
        .and_then(|(_, rest)| rest.split('/').next())
        .and_then(|p| p.parse().ok())
        .expect("the database URL names its port");
    for g in &groups {
        outage.refuse(g, db_port);
    }
    let (status, v) = c1
        .call(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{a}/exec"),
            Some(json!({"cmd": ["true"]})),
        )
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (503, Some("state_store_error")),
        "a retryable refusal while the database is away: {v}"
    );
    // Past the controllers' leases (2 s): each sees the other's lease run out when it is back.
    tokio::time::sleep(Duration::from_secs(5)).await;
    outage.heal();

    // Calls are answered again (a retryable refusal at most, while the database comes back
    // and the leases are renewed).
    let deadline = Instant::now() + PATIENCE;
    for c in [&c1, &c2] {
        for id in [&a, &b] {
            loop {
                let (status, v) = c
                    .call(
                        reqwest::Method::POST,
                        &format!("/v1/sandboxes/{id}/exec"),
                        Some(json!({"cmd": ["true"]})),
                    )
                    .await;
                if status == 200 {
                    break;
                }
                let code = v["error"]["code"].as_str().unwrap_or_default();
                assert!(
                    [
                        "state_store_error",
                        "controller_unavailable",
                        "sandbox_busy",
                        "sandbox_elsewhere"
                    ]
                    .contains(&code),
                    "only a retryable refusal: {status} {v}"
                );
                assert!(Instant::now() < deadline, "never back: {v}\n{}", c.log());
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    // Each counted the outage where its alert looks (its lease renewals failed).
    for c in [&c1, &c2] {
        assert!(
            c.metric("torpor_store_errors_total{store=\"state\"}").await > 0,
            "{} counted no state store error",
            c.api
        );
    }
    // Both controllers lived through it: neither took the other's sandbox over (each had
    // seen its own lease lapse, so it waited for the other to renew before judging it).
    assert_eq!(c1.sandbox(&a).await["controller"], "c1");
    assert_eq!(c2.sandbox(&b).await["controller"], "c2");
    // The running sandboxes kept everything, one copy each.
    for round in ["c1", "c2", "c1 again"] {
        let c = if round == "c2" { &c2 } else { &c1 };
        for (id, container, count) in &mut kept {
            *count = kept_all(c, id, container, *count, round).await;
        }
    }

    // A partition instead (the database's packets vanish): calls that need it wait for it,
    // up to the store's deadline, but they do not stall the controller: its health answers,
    // and the calls end once the database is reachable again.
    for g in &groups {
        outage.cut(g, db_port);
    }
    let waiting = {
        let (api, a) = (c1.api.clone(), a.clone());
        tokio::spawn(async move {
            reqwest::Client::new()
                .post(format!("http://{api}/v1/sandboxes/{a}/exec"))
                .bearer_auth(TOKEN)
                .json(&json!({"cmd": ["true"]}))
                .send()
                .await
                .map(|r| r.status().as_u16())
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    for c in [&c1, &c2] {
        // A hang guard, not a measure: the calls above wait up to 30 s for the database.
        let health = reqwest::Client::new()
            .get(format!("http://{}/healthz", c.api))
            .timeout(Duration::from_secs(10))
            .send()
            .await;
        assert!(
            health.as_ref().is_ok_and(|r| r.status() == 200),
            "{}'s health answers while its calls wait for the database: {health:?}",
            c.api
        );
    }
    outage.heal();
    let status = waiting.await.unwrap().unwrap();
    assert!([200, 503].contains(&status), "{status}");
    for (id, _, _) in &kept {
        let copies: usize = workers
            .iter()
            .map(|w| {
                w.containers()
                    .iter()
                    .filter(|c| c.starts_with(id.as_str()))
                    .count()
            })
            .sum();
        assert_eq!(copies, 1, "one copy of {id}");
    }
}
