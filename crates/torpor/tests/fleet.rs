//! Fleet behaviour: the parking lot (bounded, 503 lot_full / no_worker_available, admission
//! against the node's rate), eviction to free workers for parked calls, and the node memory
//! budget.

mod common;

use std::time::Duration;

use common::*;
use torpor_api::types::{CreateSandboxBody, CreateTenantBody, ExecBody};
use torpor_core::Tier;

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

/// A tenant that holds no worker finds one kept for it (`--reserved-workers`): another tenant's
/// calls park one of their own idle sandboxes rather than take the last free worker, and the
/// first tenant's wake takes it at once, parking nobody.
#[tokio::test(flavor = "multi_thread")]
async fn a_worker_is_kept_for_a_tenant_that_holds_none_while_another_takes_the_rest() {
    let d = Daemon::start_with(&[
        "--workers",
        "2",
        "--reserved-workers",
        "1",
        "--worker-wait-ms",
        "30000",
    ])
    .await;
    let admin = d.client();
    let url = d.url();
    let tenant = |name: &'static str| {
        let (admin, url) = (admin.clone(), url.clone());
        async move {
            let t = admin
                .create_tenant(&CreateTenantBody {
                    name: name.into(),
                    quotas: None,
                })
                .await
                .unwrap();
            torpor_api::Client::new(&url, &t.token)
        }
    };
    let (a, b) = (tenant("flood").await, tenant("trickle").await);
    // b has asked for a worker and holds none.
    let b1 = create(&b, "host").await;
    b.suspend(&b1, Some(Tier::Parked)).await.unwrap();
    let tier = |c: &torpor_api::Client, id: &str| {
        let (c, id) = (c.clone(), id.to_string());
        async move { c.sandbox(&id).await.unwrap().tier }
    };
    // a's second sandbox does not take the kept worker: a's first is parked for it.
    let a1 = create(&a, "host").await;
    let a2 = create(&a, "host").await;
    assert_eq!(tier(&a, &a1).await, "parked");
    assert_eq!(tier(&a, &a2).await, "running");
    let w = admin.workers().await.unwrap();
    assert_eq!((w.busy, w.free, w.reserved_workers), (1, 1, 1), "{w:?}");
    // b's call takes it at once: nothing of a's is parked for it.
    let evictions = |m: String| metric(&m, EVICTED);
    let before = evictions(admin.metrics().await.unwrap());
    let r = b.exec(&b1, &sh("echo woke")).await.unwrap();
    assert_eq!(r.stdout, "woke\n", "{r:?}");
    assert_eq!(tier(&a, &a2).await, "running");
    assert_eq!(evictions(admin.metrics().await.unwrap()), before);
    let w = admin.workers().await.unwrap();
    assert_eq!((w.busy, w.free), (2, 0), "{w:?}");
    // While b holds it, a holds one and b none is waiting: a's first wakes on a's own worker.
    let r = a.exec(&a1, &sh("echo back")).await.unwrap();
    assert_eq!(r.stdout, "back\n", "{r:?}");
    assert_eq!(tier(&b, &b1).await, "running");
    assert_eq!(tier(&a, &a2).await, "parked");
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

/// A create sent without the client library, to see the status and `Retry-After`.
#[derive(Debug)]
struct Answer {
    status: u16,
    code: Option<String>,
    message: String,
    retry_after: Option<u64>,
}

impl Answer {
    /// The wait the lot expected, from the refusal's message (`... the wait is about N ms`).
    fn expected_ms(&self) -> Option<u64> {
        let tail = self.message.split("the wait is about ").nth(1)?;
        tail.split(' ').next()?.parse().ok()
    }
}

async fn create_raw(d: &Daemon) -> Answer {
    create_raw_at(&d.url(), &d.token()).await
}

/// The value of a counter or gauge line (`name{labels}`), 0 when the series is not there yet.
fn metric(m: &str, series: &str) -> f64 {
    m.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

const HANDOFFS: &str = "torpor_lot_wait_seconds_count{outcome=\"worker\"}";
const TIMEOUTS: &str = "torpor_lot_wait_seconds_count{outcome=\"timeout\"}";
const WOULD_WAIT: &str = "torpor_lot_rejections_total{reason=\"would_wait\"}";
const EVICTED: &str = "torpor_evictions_total{reason=\"parked_calls\"}";
const REFUSED_LATE: &str = "a parked call can no longer be served in its budget";

async fn parked_calls(c: &torpor_api::Client) -> usize {
    c.workers().await.unwrap().parked_calls
}

/// The admission rule (issue 17) with offered load over capacity. Phase 1 holds both workers
/// with calls in flight, so no worker can change hands while calls arrive one by one: each
/// parks while the lot expects to serve it within the budget, and the first that it cannot is
/// refused without ever parking, while nothing was handed over, with a `Retry-After` that is
/// the wait behind the calls ahead (which themselves fit the budget at the same rate). Phase 2
/// sends a burst all at once against the rate the lot measured in phase 1: refusals carry the
/// expected wait, and no call waits its budget out. How fast a refusal comes (the issue's
/// 100 ms) is measured by the fleet bench, not asserted here.
#[tokio::test(flavor = "multi_thread")]
async fn over_capacity_calls_are_refused_before_any_hand_off_with_the_wait_ahead_and_none_times_out(
) {
    const BUDGET_MS: u64 = 4000;
    let budget = BUDGET_MS.to_string();
    let d = Daemon::start_with(&[
        "--workers",
        "2",
        "--lot-size",
        "500",
        "--worker-wait-ms",
        &budget,
    ])
    .await;
    let c = d.client();
    // The engine runs one checkpoint and one restore per core at once (at least 2).
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get().max(2)) as u64;
    // The node learns what a wake costs: a checkpoint (park), then a restore (wake).
    let x = create(&c, "host").await;
    c.suspend(&x, Some(torpor_core::Tier::Parked))
        .await
        .unwrap();
    let y = create(&c, "host").await;
    c.exec(&x, &sh("true")).await.unwrap();
    assert_eq!(c.workers().await.unwrap().busy, 2);

    // Phase 1: both workers held by calls in flight, so no worker can change hands. Calls
    // arrive one after the other: each parks while the lot expects to serve it within the
    // budget, and from the first that it cannot, each is refused at once.
    let mut pins = Vec::new();
    for id in [&x, &y] {
        let (c, id) = (c.clone(), id.clone());
        pins.push(tokio::spawn(async move {
            c.exec(
                &id,
                &sh("touch /tmp/started; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo released"),
            )
            .await
        }));
    }
    for id in [&x, &y] {
        let mut started = false;
        for _ in 0..500 {
            if c.read_file(id, "/tmp/started").await.is_ok() {
                started = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(started, "the pinning call never started in {id}");
    }
    let mut admitted = Vec::new();
    let refusal = loop {
        assert!(
            admitted.len() < 200,
            "200 calls admitted with a {BUDGET_MS} ms budget: the lot never refused"
        );
        let before = parked_calls(&c).await;
        let call = {
            let d_url = d.url();
            let token = d.token();
            tokio::spawn(async move { create_raw_at(&d_url, &token).await })
        };
        loop {
            if call.is_finished() {
                break;
            }
            if parked_calls(&c).await > before {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if call.is_finished() {
            break call.await.unwrap();
        }
        admitted.push(call);
    };
    let parked = admitted.len() as u64;
    assert!(parked >= 1, "not even one call admitted: {refusal:?}");
    let m = c.metrics().await.unwrap();
    // Refused before any worker changed hands: nothing was handed over, nothing evicted.
    assert_eq!(metric(&m, HANDOFFS), 0.0, "{m}");
    assert_eq!(metric(&m, EVICTED), 0.0, "{m}");
    assert_eq!(metric(&m, WOULD_WAIT), 1.0, "{m}");
    assert_eq!(
        parked_calls(&c).await as u64,
        parked,
        "the refused call never parked"
    );
    assert_eq!(refusal.status, 503, "{refusal:?}");
    assert_eq!(
        refusal.code.as_deref(),
        Some("no_worker_available"),
        "{refusal:?}"
    );
    // Its Retry-After is the wait behind the calls ahead of it, past the budget; the calls
    // ahead fit it at the same rate: hand-offs in rounds of one per core, the p-th place
    // served within (p + cores - 1) intervals.
    let expected = refusal
        .expected_ms()
        .expect("the expected wait in the message");
    assert_eq!(
        refusal.retry_after,
        Some(expected.div_ceil(1000)),
        "{refusal:?}"
    );
    assert!(expected > BUDGET_MS, "{refusal:?}");
    let last_admitted = expected as f64 * (parked + cores - 1) as f64 / (parked + cores) as f64;
    assert!(
        last_admitted <= BUDGET_MS as f64 + 1.0,
        "{parked} admitted, but the last one was expected at {last_admitted:.0} ms"
    );
    // Nothing changed: the next call is told the same.
    let again = create_raw(&d).await;
    assert_eq!(
        (again.status, again.expected_ms(), again.retry_after),
        (503, Some(expected), refusal.retry_after),
        "{again:?}"
    );
    // Let the pinning calls end: the workers change hands, the admitted calls are served
    // (or, if the node turned out slower than the lot knew, told so: never left to time out).
    for id in [&x, &y] {
        c.exec(id, &sh("touch /tmp/go")).await.unwrap();
    }
    for pin in pins {
        assert_eq!(pin.await.unwrap().unwrap().stdout, "released\n");
    }
    let mut phase1 = (0, 0);
    for call in admitted {
        let a = call.await.unwrap();
        match (a.status, a.code.as_deref()) {
            (201 | 200, _) => phase1.0 += 1,
            (503, Some("no_worker_available")) if a.expected_ms().is_some() => phase1.1 += 1,
            _ => panic!("an admitted call ended {a:?}"),
        }
    }
    eprintln!(
        "phase 1: {parked} admitted: {} served, {} told late",
        phase1.0, phase1.1
    );
    assert_eq!(metric(&c.metrics().await.unwrap(), TIMEOUTS), 0.0);

    // Phase 2: a burst over capacity, all at once, against the rate the lot measured in
    // phase 1 (kept across bursts). Every call is served, or refused with the wait the lot
    // expects in its Retry-After; none waits its budget out. (A call admitted and then told
    // late, because the node slowed down after it was admitted, is logged; on this shared
    // machine that happens, so it is counted, not asserted: the fleet bench measures it.)
    let late_before = d.log().matches(REFUSED_LATE).count();
    let burst = 2 * (parked + cores) as usize + 4;
    let answers: Vec<Answer> = {
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..burst {
            let (url, token) = (d.url(), d.token());
            set.spawn(async move { create_raw_at(&url, &token).await });
        }
        let mut v = Vec::new();
        while let Some(a) = set.join_next().await {
            v.push(a.unwrap());
        }
        v
    };
    let served = answers.iter().filter(|a| a.status < 300).count();
    let refused: Vec<&Answer> = answers.iter().filter(|a| a.status >= 300).collect();
    let late = d.log().matches(REFUSED_LATE).count() - late_before;
    eprintln!(
        "phase 2: {burst} calls: {served} served, {} refused ({late} of them after parking)",
        refused.len()
    );
    for a in &refused {
        assert_eq!(a.code.as_deref(), Some("no_worker_available"), "{a:?}");
        let expected = a.expected_ms().unwrap_or_else(|| panic!("{a:?}"));
        assert_eq!(a.retry_after, Some(expected.div_ceil(1000).max(1)), "{a:?}");
    }
    let at_once = refused
        .iter()
        .filter(|a| a.expected_ms().unwrap() > BUDGET_MS)
        .count();
    assert!(at_once >= 1 && served >= 2, "{answers:?}");
    assert_eq!(metric(&c.metrics().await.unwrap(), TIMEOUTS), 0.0);
}

async fn create_raw_at(url: &str, token: &str) -> Answer {
    let resp = reqwest::Client::new()
        .post(format!("{url}/v1/sandboxes"))
        .bearer_auth(token)
        .json(&serde_json::json!({"template": "host"}))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let v: serde_json::Value = resp.json().await.unwrap_or_default();
    Answer {
        status,
        code: v["error"]["code"].as_str().map(str::to_string),
        message: v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        retry_after,
    }
}
