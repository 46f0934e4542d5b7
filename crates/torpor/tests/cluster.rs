//! Cluster mode, first slice: a real `torpor worker` process (real runsc) driven across the
//! network by an engine in this test (`Engine::start_on` over a `RemoteNode`), both ends
//! authenticated by certificates from the real `torpor ca`. Run as root, like the other
//! end-to-end tests (`RUST_TEST_THREADS=1`).

#[path = "common/cluster.rs"]
mod cluster;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use torpor_control::{CreateSandbox, Engine, EngineConfig, Quotas};
use torpor_core::{SandboxState, TemplateName, TenantId, Tier};
use torpor_runtime::proto::ExecRequest;

fn sh(script: &str) -> ExecRequest {
    ExecRequest {
        cmd: vec!["sh".into(), "-c".into(), script.into()],
        env: BTreeMap::new(),
        cwd: None,
        timeout_ms: None,
        detach: false,
        stream: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_engine_drives_a_real_worker_over_mtls_create_exec_park_wake_delete() {
    let tmp = tempfile::Builder::new()
        .prefix("torpor-cluster-")
        .tempdir()
        .unwrap();
    let ca = tmp.path().join("ca");
    cluster::ca_init(&ca, "e2e.cluster");
    cluster::ca_issue(&ca, "worker", "w1", &tmp.path().join("w1"), "1h");
    cluster::ca_issue(&ca, "controller", "c1", &tmp.path().join("c1"), "1h");
    let mut worker =
        cluster::WorkerProc::start(&tmp.path().join("w1"), &tmp.path().join("worker")).await;

    let remote = cluster::connect(&worker.addr, &tmp.path().join("c1"))
        .await
        .expect("the controller connects");
    assert_eq!(remote.worker_name(), "w1");
    let data = tmp.path().join("controller");
    let engine = Engine::start_on(
        EngineConfig {
            data_dir: data.clone(),
            workers: 2,
            runsc_binary: None,
            runsc_platform: None,
            agent_binary: cluster::BIN.into(),
            worker_wait: Duration::from_secs(5),
            lot_capacity: 16,
            reserved_workers: torpor_control::Reserve::Auto,
            memory_budget: None,
            tick: Duration::from_secs(3600),
            warm_pool: 1,
            live_restore: false,
            reencode_images: true,
            drain_timeout: Duration::from_secs(10),
            snapshots: Default::default(),
            import_dir: None,
            database: None,
            controller: None,
        },
        Arc::new(remote),
    )
    .await
    .expect("the engine starts over the worker (and builds the host template on it)");
    let tenant = TenantId::new("t1").unwrap();
    engine
        .create_tenant(tenant.clone(), Quotas::default())
        .unwrap();
    let id = engine
        .create_sandbox(
            &tenant,
            CreateSandbox {
                template: TemplateName::host(),
                env: BTreeMap::new(),
                metadata: BTreeMap::new(),
                limits: Default::default(),
                gpu: None,
                layer_metadata: Default::default(),
                network: None,
            },
        )
        .await
        .expect("create on the worker")
        .id;
    let worker_containers = worker.containers();
    assert!(
        worker_containers.iter().any(|c| c.starts_with(id.as_str())),
        "the sandbox runs on the worker: {worker_containers:?}"
    );

    let run = |script: &'static str| {
        let engine = engine.clone();
        let tenant = tenant.clone();
        let id = id.clone();
        async move {
            let r = engine
                .exec(&tenant, &id, sh(script), Vec::new())
                .await
                .unwrap();
            assert_eq!(r.exit_code, Some(0), "{script}: {r:?}");
            r.stdout
        }
    };
    assert_eq!(
        run("echo hello from $(hostname)")
            .await
            .trim()
            .split(' ')
            .next(),
        Some("hello")
    );
    // A file, and a background process whose memory (the shell's counter) must survive.
    run("echo kept > /tmp/file").await;
    let mut bg = sh("i=0; while true; do i=$((i+1)); echo $i > /tmp/ticks; sleep 0.1; done");
    bg.detach = true;
    engine.exec(&tenant, &id, bg, Vec::new()).await.unwrap();
    let read_ticks = || async {
        // `echo` truncates the file before it writes: a read in between (or a checkpoint
        // taken there) finds it empty until the next tick.
        for _ in 0..50 {
            if let Ok(n) = run("cat /tmp/ticks").await.trim().parse::<u64>() {
                return n;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        0
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while read_ticks().await < 3 {
        assert!(
            Instant::now() < deadline,
            "the background loop never ticked"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let before_park = read_ticks().await;
    let rec = engine.suspend(&tenant, &id, Tier::Parked).await.unwrap();
    assert_eq!(rec.state, SandboxState::Parked);
    assert!(
        !worker
            .containers()
            .iter()
            .any(|c| c.starts_with(id.as_str())),
        "parked: nothing of it left running on the worker"
    );
    // The wake (a restore on the worker) keeps files, memory and processes.
    assert_eq!(run("cat /tmp/file").await.trim(), "kept");
    let after_wake = read_ticks().await;
    assert!(
        after_wake >= before_park,
        "the counter kept its memory: {after_wake} after the wake, {before_park} before the park"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while read_ticks().await <= after_wake {
        assert!(
            Instant::now() < deadline,
            "the background process did not survive the park"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        engine.sandbox(&tenant, &id).unwrap().state,
        SandboxState::Running
    );

    engine.delete_sandbox(&tenant, &id).await.unwrap();
    assert!(
        !worker
            .containers()
            .iter()
            .any(|c| c.starts_with(id.as_str())),
        "deleted: gone from the worker"
    );
    engine.shutdown().await;
    worker.stop();
}
