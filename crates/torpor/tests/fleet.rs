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
