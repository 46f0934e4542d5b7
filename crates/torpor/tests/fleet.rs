//! Fleet behaviour: the parking lot (bounded, 503 lot_full / no_worker_available), eviction to
//! free workers for parked calls, and the node memory budget.

mod common;

use std::time::Duration;

use common::*;
use torpor_api::types::{CreateSandboxBody, ExecBody};

#[tokio::test(flavor = "multi_thread")]
async fn a_full_lot_refuses_with_lot_full_and_parked_calls_get_a_worker() {
    let d = Daemon::start_with(&[
        "--workers",
        "1",
        "--lot-size",
        "1",
        "--worker-wait-ms",
        "8000",
    ])
    .await;
    let c = d.client();
    let a = create(&c, "host").await;
    // A holds the only worker with a call in flight: it cannot be evicted.
    let busy = {
        let c = c.clone();
        let a = a.clone();
        tokio::spawn(async move {
            c.exec(&a, &sh("touch /tmp/started; sleep 2; echo done"))
                .await
        })
    };
    // Wait until that call is running (a slow machine may take a while to start it).
    for _ in 0..100 {
        if c.read_file(&a, "/tmp/started").await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let parked = {
        let c = c.clone();
        tokio::spawn(async move {
            c.create_sandbox(&CreateSandboxBody {
                template: "host".into(),
                ..Default::default()
            })
            .await
        })
    };
    let mut parked_calls = 0;
    for _ in 0..100 {
        parked_calls = c.workers().await.unwrap().parked_calls;
        if parked_calls == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(parked_calls, 1);
    let err = c
        .create_sandbox(&CreateSandboxBody {
            template: "host".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("lot_full"), "{err}");
    assert_eq!(busy.await.unwrap().unwrap().stdout, "done\n");
    // Once A is idle, the policy parks it for the waiting call, which then gets its worker.
    let b = parked.await.unwrap().unwrap();
    assert_eq!(c.sandbox(&a).await.unwrap().tier, "parked");
    assert_eq!(c.exec(&b.id, &sh("echo b")).await.unwrap().stdout, "b\n");
    let m = c.metrics().await.unwrap();
    assert!(
        m.contains("torpor_lot_rejections_total{reason=\"lot_full\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("torpor_evictions_total{reason=\"parked_calls\"}"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn memory_budget_parks_the_least_recently_active_first() {
    let d = Daemon::start_with(&["--memory-budget", "220M"]).await;
    let c = d.client();
    let mut ids = Vec::new();
    for i in 0..3 {
        let id = create(&c, "host").await;
        let r = c
            .exec(
                &id,
                &ExecBody {
                    detach: true,
                    ..sh("python3 -c 'import os,time; b=os.urandom(70<<20); time.sleep(3600)'")
                },
            )
            .await
            .unwrap();
        assert!(r.stdout.parse::<u32>().is_ok());
        tokio::time::sleep(Duration::from_millis(1500)).await;
        ids.push(id);
        let w = c.workers().await.unwrap();
        eprintln!("after {i}: resident {} MiB", w.resident_memory_bytes >> 20);
    }
    // Give the policy a few ticks (allocation inside gVisor may be slow on a busy machine).
    for _ in 0..50 {
        if c.sandbox(&ids[0]).await.unwrap().tier == "parked" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let w = c.workers().await.unwrap();
    assert!(
        w.resident_memory_bytes <= 220 << 20,
        "resident {} MiB over the 220 MiB budget",
        w.resident_memory_bytes >> 20
    );
    assert_eq!(
        c.sandbox(&ids[0]).await.unwrap().tier,
        "parked",
        "the oldest went first"
    );
    assert_eq!(c.sandbox(&ids[2]).await.unwrap().tier, "running");
    let m = c.metrics().await.unwrap();
    assert!(
        m.contains("torpor_evictions_total{reason=\"memory_pressure\"}"),
        "{m}"
    );
    // The parked one wakes with its background process still there.
    let find = "import os; print(any(b'urandom' in open(f'/proc/{p}/cmdline', 'rb').read() for p in os.listdir('/proc') if p.isdigit()))";
    let r = c
        .exec(
            &ids[0],
            &ExecBody {
                cmd: vec!["python3".into(), "-c".into(), find.into()],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(r.stdout, "True\n", "{r:?}");
}

/// The groups (cgroup names) of a daemon's warm workers: its bundle directories' names.
fn worker_groups(data: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(data.join("workers"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn group_file(name: &str, file: &str) -> String {
    std::fs::read_to_string(format!("/sys/fs/cgroup/memory/torpor/{name}/{file}"))
        .unwrap_or_default()
}

async fn wait_ready_workers(c: &torpor_api::Client, n: usize) -> torpor_control::WorkerStats {
    for _ in 0..500 {
        let w = c.workers().await.unwrap();
        if w.warm_ready == n {
            return w;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "the warm pool never reached {n} ready workers: {:?}",
        c.workers().await
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn wakes_take_prepared_workers_which_are_reset_reused_and_removed_at_stop() {
    let mut d = Daemon::start_with(&["--workers", "2", "--warm-pool", "2"]).await;
    let c = d.client();
    let w0 = wait_ready_workers(&c, 2).await;
    assert_eq!(w0.warm_pool_size, 2);

    let id = create(&c, "host").await;
    let w1 = c.workers().await.unwrap();
    assert_eq!(w1.warm_takes, w0.warm_takes + 1, "{w1:?}");
    assert_eq!(w1.cold_takes, w0.cold_takes, "{w1:?}");
    // The sandbox runs in one prepared group, with its own memory limit written there.
    let busy: Vec<String> = worker_groups(&d.dir)
        .into_iter()
        .filter(|g| !group_file(g, "cgroup.procs").trim().is_empty())
        .collect();
    assert_eq!(busy.len(), 1, "groups with processes: {busy:?}");
    let limit_mib = c.sandbox(&id).await.unwrap().limits.memory_mib;
    assert_eq!(
        group_file(&busy[0], "memory.limit_in_bytes").trim(),
        (limit_mib << 20).to_string()
    );
    assert_eq!(
        group_file(&busy[0], "memory.oom_control").lines().next(),
        Some("oom_kill_disable 1")
    );
    let r = c
        .exec(&id, &sh("echo 41 > /tmp/x; cat /tmp/x"))
        .await
        .unwrap();
    assert_eq!(r.stdout.trim(), "41");

    // Parked: the worker comes back, is emptied, and the pool is full again.
    c.suspend(&id, Some(torpor_core::Tier::Parked))
        .await
        .unwrap();
    wait_ready_workers(&c, 2).await;
    assert!(group_file(&busy[0], "cgroup.procs").trim().is_empty());

    // The next wake again takes a prepared worker, and the state is intact.
    let r = c.exec(&id, &sh("cat /tmp/x")).await.unwrap();
    assert_eq!(r.stdout.trim(), "41");
    let w2 = c.workers().await.unwrap();
    assert_eq!(w2.warm_takes, w1.warm_takes + 1, "{w2:?}");
    assert_eq!(w2.cold_takes, w0.cold_takes, "{w2:?}");

    // A stop removes every group this daemon made.
    let groups = worker_groups(&d.dir);
    assert!(groups.len() >= 2, "{groups:?}");
    d.stop();
    for g in &groups {
        assert!(
            !std::path::Path::new(&format!("/sys/fs/cgroup/memory/torpor/{g}")).exists(),
            "group {g} left behind"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_warm_pool_every_wake_prepares_its_worker() {
    let d = Daemon::start_with(&["--workers", "2", "--warm-pool", "0"]).await;
    let c = d.client();
    let id = create(&c, "host").await;
    let r = c.exec(&id, &sh("echo ok")).await.unwrap();
    assert_eq!(r.stdout.trim(), "ok");
    let w = c.workers().await.unwrap();
    assert_eq!((w.warm_pool_size, w.warm_ready), (0, 0));
    assert!(w.cold_takes >= 1 && w.warm_takes == 0, "{w:?}");
    let m = c.metrics().await.unwrap();
    assert!(
        m.contains("torpor_warm_pool_takes_total{kind=\"cold\"}"),
        "{m}"
    );
}
