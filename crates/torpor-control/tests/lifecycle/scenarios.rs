//! One test per lifecycle rule, each against the fake node.

use std::sync::Arc;
use std::time::Duration;

use torpor_control::store::Store;
use torpor_control::{ControlError, Engine, ImageRef, Quotas};
use torpor_core::{LimitsPatch, SandboxId, SandboxState, Tier};
use torpor_runtime::node::fake::{Call, FakeNode, Fault, Op};

use super::{config, eventually, quotas, rig, Rig};

#[tokio::test]
async fn the_ladder_keeps_state_at_every_tier_and_delete_leaves_nothing() {
    let r = rig(quotas(), |_| {}).await;
    let id = r.create().await.unwrap().id;
    assert_eq!(r.record(&id).state, SandboxState::Running);
    assert_eq!(r.count(&id).await.unwrap(), 1);
    for (tier, state, next) in [
        (Tier::Frozen, SandboxState::Frozen, 2),
        (Tier::Parked, SandboxState::Parked, 3),
        (Tier::Suspended, SandboxState::Suspended, 4),
    ] {
        let rec = r.engine.suspend(&r.tenant, &id, tier).await.unwrap();
        assert_eq!(rec.state, state);
        r.check_invariants(std::slice::from_ref(&id));
        assert_eq!(
            r.count(&id).await.unwrap(),
            next,
            "state kept through {state}"
        );
        assert_eq!(r.record(&id).state, SandboxState::Running);
        r.check_invariants(std::slice::from_ref(&id));
    }
    assert!(matches!(r.record(&id).image, ImageRef::Store(_)));
    r.engine.delete_sandbox(&r.tenant, &id).await.unwrap();
    let gone = r.engine.sandbox(&r.tenant, &id).unwrap_err();
    assert_eq!(gone.code(), "not_found");
    assert!(r.node.running().is_empty());
    assert!(!r.dir.path().join("sandboxes").join(id.as_str()).exists());
}

/// Creates a sandbox, counts to `n`, and parks it (its image holds `n`).
async fn parked_at(r: &Rig, n: u64) -> SandboxId {
    let id = r.create().await.unwrap().id;
    for _ in 0..n {
        r.count(&id).await.unwrap();
    }
    r.engine
        .suspend(&r.tenant, &id, Tier::Parked)
        .await
        .unwrap();
    id
}

#[tokio::test]
async fn a_wake_whose_restore_fails_leaves_the_sandbox_asleep_on_its_image() {
    let r = rig(quotas(), |_| {}).await;
    let id = parked_at(&r, 1).await;
    for fault in [Fault::Fail, Fault::Crash { oom: false }] {
        r.node.inject(Op::Restore, fault.clone());
        let err = r.count(&id).await.unwrap_err();
        assert_eq!(err.code(), "runtime_error", "{fault:?}: {err}");
        let rec = r.record(&id);
        assert_eq!(rec.state, SandboxState::Parked, "{fault:?}");
        assert!(rec.last_error.is_some_and(|e| e.contains("wake failed")));
        r.check_invariants(std::slice::from_ref(&id));
    }
    // A slow restore is only slow.
    r.node
        .inject(Op::Restore, Fault::Delay(Duration::from_millis(200)));
    assert_eq!(r.count(&id).await.unwrap(), 2);
    r.check_invariants(std::slice::from_ref(&id));
}

#[tokio::test]
async fn a_checkpoint_that_fails_goes_back_to_the_last_committed_image() {
    for fault in [Fault::Fail, Fault::FailHalfway, Fault::Crash { oom: false }] {
        let r = rig(quotas(), |_| {}).await;
        let id = parked_at(&r, 1).await;
        assert_eq!(r.count(&id).await.unwrap(), 2);
        r.node.inject(Op::Checkpoint, fault.clone());
        let err = r
            .engine
            .suspend(&r.tenant, &id, Tier::Parked)
            .await
            .unwrap_err();
        assert_eq!(err.code(), "runtime_error", "{fault:?}: {err}");
        let rec = r.record(&id);
        assert_eq!(rec.state, SandboxState::Parked, "{fault:?}");
        r.check_invariants(std::slice::from_ref(&id));
        // No half-written image is left beside the committed one.
        let images = r
            .dir
            .path()
            .join("sandboxes")
            .join(id.as_str())
            .join("images");
        let left: Vec<_> = std::fs::read_dir(&images)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left.len(), 1, "{fault:?}: images left {left:?}");
        // What ran after the last checkpoint is lost, what it committed is not.
        assert_eq!(r.count(&id).await.unwrap(), 2, "{fault:?}");
    }
}

#[tokio::test]
async fn a_freeze_or_thaw_that_fails_is_reported_and_nothing_sticks() {
    let r = rig(quotas(), |_| {}).await;
    let id = r.create().await.unwrap().id;
    r.node.inject(Op::Freeze, Fault::Fail);
    let err = r
        .engine
        .suspend(&r.tenant, &id, Tier::Frozen)
        .await
        .unwrap_err();
    assert_eq!(err.code(), "runtime_error");
    assert_eq!(r.record(&id).state, SandboxState::Running);
    r.check_invariants(std::slice::from_ref(&id));
    assert_eq!(r.count(&id).await.unwrap(), 1);

    r.engine
        .suspend(&r.tenant, &id, Tier::Frozen)
        .await
        .unwrap();
    r.node.inject(Op::Thaw, Fault::Fail);
    assert_eq!(r.count(&id).await.unwrap_err().code(), "runtime_error");
    assert_eq!(r.record(&id).state, SandboxState::Frozen);
    r.check_invariants(std::slice::from_ref(&id));
    assert_eq!(r.count(&id).await.unwrap(), 2);
}

#[tokio::test]
async fn a_crash_during_a_call_sends_the_sandbox_back_to_its_snapshot() {
    let r = rig(quotas(), |_| {}).await;
    let id = parked_at(&r, 1).await;
    assert_eq!(r.count(&id).await.unwrap(), 2);
    let oom = r.run(&id, &["oom"]).await.unwrap();
    assert!(oom.oom_killed);
    assert_eq!(oom.exit_code, Some(137));
    let rec = r.record(&id);
    assert_eq!(rec.state, SandboxState::Parked);
    assert!(rec.oom_killed);
    r.check_invariants(std::slice::from_ref(&id));
    assert_eq!(
        r.count(&id).await.unwrap(),
        2,
        "back to the image that held 1"
    );

    let crashed = r.run(&id, &["crash"]).await.unwrap_err();
    assert_eq!(crashed.code(), "sandbox_crashed");
    assert_eq!(r.record(&id).state, SandboxState::Parked);
    r.check_invariants(std::slice::from_ref(&id));

    // A fault injected into the agent channel: the same.
    r.node.inject(Op::Call, Fault::Crash { oom: false });
    assert_eq!(r.count(&id).await.unwrap_err().code(), "sandbox_crashed");
    r.check_invariants(std::slice::from_ref(&id));
}

#[tokio::test]
async fn a_container_that_dies_on_its_own_is_noticed_and_its_worker_freed() {
    let r = rig(quotas(), |c| c.workers = 1).await;
    let id = r.create().await.unwrap().id;
    let container = r.record(&id).container_id();
    assert!(r.node.crash(&container, true));
    eventually("the crash is recorded", || {
        r.record(&id).state == SandboxState::Parked
    })
    .await;
    assert!(r.record(&id).oom_killed);
    assert_eq!(r.engine.worker_stats().busy, 0);
    r.check_invariants(std::slice::from_ref(&id));
    // Its only worker is free again: a new sandbox needs no eviction.
    let other = r.create().await.unwrap().id;
    r.check_invariants(&[id, other]);
}

#[tokio::test]
async fn eviction_parks_frozen_sandboxes_first_then_the_least_recently_active() {
    let r = rig(quotas(), |c| c.workers = 2).await;
    let a = r.create().await.unwrap().id;
    let b = r.create().await.unwrap().id;
    r.count(&a).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    r.count(&b).await.unwrap();
    // b is the most recently active, but frozen: it goes first.
    r.engine.suspend(&r.tenant, &b, Tier::Frozen).await.unwrap();
    let c = r.create().await.unwrap().id;
    // The worker is handed on as soon as the checkpoint is written; the record follows.
    wait_state(&r, &b, SandboxState::Parked).await;
    assert_eq!(r.record(&a).state, SandboxState::Running);
    r.check_invariants(&[a.clone(), b.clone(), c.clone()]);
    // Then the least recently active running one: a (c was created after a's last call).
    assert_eq!(r.count(&b).await.unwrap(), 2);
    wait_state(&r, &a, SandboxState::Parked).await;
    assert_eq!(r.record(&c).state, SandboxState::Running);
    r.check_invariants(&[a, b, c]);
}

#[tokio::test]
async fn the_memory_budget_is_never_exceeded() {
    const MIB: u64 = 1 << 20;
    let r = rig(quotas(), |c| {
        c.workers = 8;
        c.memory_budget = Some(3 * 64 * MIB);
    })
    .await;
    r.node.set_memory_per_sandbox(64 * MIB);
    let mut ids = Vec::new();
    for _ in 0..6 {
        let rec = r
            .engine
            .create_sandbox(
                &r.tenant,
                torpor_control::CreateSandbox {
                    template: torpor_core::TemplateName::host(),
                    env: Default::default(),
                    metadata: Default::default(),
                    limits: LimitsPatch {
                        memory_mib: Some(64),
                        ..Default::default()
                    },
                    gpu: None,
                    layer_metadata: Default::default(),
                    network: None,
                },
            )
            .await
            .unwrap();
        ids.push(rec.id);
        let resident = r.engine.resident_memory();
        assert!(resident <= 3 * 64 * MIB, "resident {resident} over budget");
        assert!(r.node.running().len() <= 3);
        r.check_invariants(&ids);
    }
    for id in &ids {
        r.count(id).await.unwrap();
        assert!(r.engine.resident_memory() <= 3 * 64 * MIB);
    }
    r.check_invariants(&ids);
}

#[tokio::test]
async fn the_parking_lot_is_bounded_shared_fairly_and_every_waiting_call_is_answered() {
    let r = Arc::new(
        rig(quotas(), |c| {
            c.workers = 1;
            c.lot_capacity = 4;
            c.worker_wait = Duration::from_millis(300);
        })
        .await,
    );
    let t2 = torpor_core::TenantId::new("t2").unwrap();
    r.engine
        .create_tenant(t2.clone(), Quotas::default())
        .unwrap();
    let busy = r.create().await.unwrap().id;
    // The only worker is in a call for a while: nothing can be evicted.
    let holder = {
        let r = r.clone();
        let busy = busy.clone();
        tokio::spawn(async move { r.run(&busy, &["sleep", "1.5"]).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // t1 floods; t2 comes after. One tenant holds at most half of the lot's places.
    let mut calls = Vec::new();
    for tenant in [&r.tenant, &r.tenant, &r.tenant, &r.tenant, &t2, &t2] {
        let (r, tenant) = (r.clone(), tenant.clone());
        calls.push((
            tenant.clone(),
            tokio::spawn(async move { super::create_on(&r.engine, &tenant).await }),
        ));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut codes: Vec<(String, &str)> = Vec::new();
    for (tenant, c) in calls {
        codes.push((tenant.to_string(), c.await.unwrap().unwrap_err().code()));
    }
    codes.sort();
    let want = |t: &str, c: &'static str| (t.to_string(), c);
    assert_eq!(
        codes,
        vec![
            want("t1", "lot_full"),
            want("t1", "lot_full"),
            want("t1", "no_worker_available"),
            want("t1", "no_worker_available"),
            want("t2", "no_worker_available"),
            want("t2", "no_worker_available"),
        ]
    );
    assert_eq!(holder.await.unwrap().unwrap().exit_code, Some(0));
    // Refused creations left nothing behind; the worker serves again.
    let ok = r.create().await.unwrap().id;
    wait_state(&r, &busy, SandboxState::Parked).await;
    r.check_invariants(&[busy, ok]);
    assert_eq!(r.engine.worker_stats().parked_calls, 0);
    assert!(r.engine.sandboxes(&t2).unwrap().is_empty());
}

#[tokio::test]
async fn two_creates_at_the_last_unit_of_quota_never_both_pass() {
    let r = Arc::new(
        rig(
            Quotas {
                max_sandboxes: Some(3),
                ..Quotas::default()
            },
            |c| c.workers = 16,
        )
        .await,
    );
    let all: Vec<_> = (0..8)
        .map(|_| {
            let r = r.clone();
            tokio::spawn(async move { r.create().await })
        })
        .collect();
    let mut made = Vec::new();
    let mut refused = 0;
    for c in all {
        match c.await.unwrap() {
            Ok(rec) => made.push(rec.id),
            Err(e) => {
                assert_eq!(e.code(), "quota_exceeded", "{e}");
                refused += 1;
            }
        }
    }
    assert_eq!((made.len(), refused), (3, 5));
    r.check_invariants(&made);
}

#[tokio::test]
async fn two_wakes_at_the_last_running_unit_never_both_pass() {
    let r = Arc::new(
        rig(
            Quotas {
                max_running: Some(1),
                ..Quotas::default()
            },
            |_| {},
        )
        .await,
    );
    let a = parked_at(&r, 1).await;
    let b = parked_at(&r, 1).await;
    let wakes: Vec<_> = [a.clone(), b.clone()]
        .into_iter()
        .map(|id| {
            let r = r.clone();
            tokio::spawn(async move { r.count(&id).await })
        })
        .collect();
    let mut results = Vec::new();
    for w in wakes {
        results.push(w.await.unwrap().map_err(|e| e.code()));
    }
    results.sort();
    assert_eq!(results, vec![Ok(2), Err("quota_exceeded")]);
    r.check_invariants(&[a, b]);
}

#[tokio::test]
async fn exec_suspend_and_delete_at_once_on_one_sandbox_all_end_and_leave_nothing() {
    let r = Arc::new(rig(quotas(), |_| {}).await);
    let id = r.create().await.unwrap().id;
    let exec = {
        let (r, id) = (r.clone(), id.clone());
        tokio::spawn(async move { r.run(&id, &["sleep", "0.3"]).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let suspend = {
        let (r, id) = (r.clone(), id.clone());
        tokio::spawn(async move { r.engine.suspend(&r.tenant, &id, Tier::Parked).await })
    };
    let delete = {
        let (r, id) = (r.clone(), id.clone());
        tokio::spawn(async move { r.engine.delete_sandbox(&r.tenant, &id).await })
    };
    // Each ends: the exec with its result (or the delete's cut), the others in some order.
    let exec = exec.await.unwrap();
    let _ = suspend.await.unwrap();
    delete.await.unwrap().unwrap();
    if let Ok(e) = exec {
        assert_eq!(e.exit_code, Some(0));
    }
    assert_eq!(
        r.engine.sandbox(&r.tenant, &id).unwrap_err().code(),
        "not_found"
    );
    assert!(r.node.running().is_empty());
    assert!(r.node.violations().is_empty());
}

#[tokio::test]
async fn forks_share_the_source_state_and_diverge() {
    let r = rig(quotas(), |_| {}).await;
    let id = r.create().await.unwrap().id;
    r.count(&id).await.unwrap();
    r.count(&id).await.unwrap();
    let forks = r.engine.fork(&r.tenant, &id, 2).await.unwrap();
    assert_eq!(forks.len(), 2);
    for f in &forks {
        assert_eq!(f.state, SandboxState::Suspended);
        assert_eq!(r.count(&f.id).await.unwrap(), 3);
    }
    assert_eq!(r.count(&forks[0].id).await.unwrap(), 4);
    assert_eq!(r.count(&id).await.unwrap(), 3);
    let mut ids: Vec<SandboxId> = forks.into_iter().map(|f| f.id).collect();
    ids.push(id);
    r.check_invariants(&ids);
}

// ---------------------------------------------------------------- daemon crashes

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// A daemon crash while a sandbox is in a transitional state: the first engine runs on its own
/// runtime, which is dropped mid-transition (every task gone at once, as in a SIGKILL); a new
/// engine on a new node then starts on the same data directory.
#[derive(Debug, Clone, Copy)]
enum Crash {
    Creating,
    Resuming,
    Checkpointing,
    Deleting,
}

#[test]
fn a_daemon_crash_in_every_transitional_state_resolves_at_restart() {
    for case in [
        Crash::Creating,
        Crash::Resuming,
        Crash::Checkpointing,
        Crash::Deleting,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let tenant = torpor_core::TenantId::new("t1").unwrap();
        let first = runtime();
        let id = first.block_on(async {
            let node = Arc::new(FakeNode::new());
            let engine = Engine::start_on(config(dir.path()), Arc::new(node.clone()))
                .await
                .unwrap();
            engine
                .create_tenant(tenant.clone(), Quotas::default())
                .unwrap();
            let r = Rig {
                engine,
                node,
                dir: tempfile::tempdir().unwrap(),
                tenant: tenant.clone(),
            };
            let hold = Fault::Delay(Duration::from_secs(600));
            let (id, want) = match case {
                Crash::Creating => {
                    r.node.inject(Op::Restore, hold);
                    let e = r.engine.clone();
                    let t = tenant.clone();
                    tokio::spawn(async move { super::create_on(&e, &t).await });
                    let mut found = None;
                    for _ in 0..500 {
                        if let Some(s) = r.engine.sandboxes(&tenant).unwrap().first() {
                            found = Some(s.id.clone());
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    (found.expect("creation under way"), SandboxState::Creating)
                }
                Crash::Resuming => {
                    let id = parked_at(&r, 1).await;
                    r.node.inject(Op::Restore, hold);
                    let (r2, id2) = (Arc::new(r), id.clone());
                    let r3 = r2.clone();
                    tokio::spawn(async move { r3.count(&id2).await });
                    wait_state(&r2, &id, SandboxState::Resuming).await;
                    return id;
                }
                Crash::Checkpointing => {
                    let id = parked_at(&r, 1).await;
                    r.count(&id).await.unwrap();
                    r.node.inject(Op::Checkpoint, hold);
                    let (r2, id2) = (Arc::new(r), id.clone());
                    let r3 = r2.clone();
                    tokio::spawn(
                        async move { r3.engine.suspend(&r3.tenant, &id2, Tier::Parked).await },
                    );
                    wait_state(&r2, &id, SandboxState::Checkpointing).await;
                    return id;
                }
                Crash::Deleting => {
                    let id = r.create().await.unwrap().id;
                    r.node.inject(Op::Destroy, hold);
                    let (r2, id2) = (Arc::new(r), id.clone());
                    let r3 = r2.clone();
                    tokio::spawn(async move { r3.engine.delete_sandbox(&r3.tenant, &id2).await });
                    wait_state(&r2, &id, SandboxState::Deleting).await;
                    return id;
                }
            };
            assert_eq!(r.record(&id).state, want);
            id
        });
        first.shutdown_background();

        let second = runtime();
        second.block_on(async {
            let node = Arc::new(FakeNode::new());
            let engine = Engine::start_on(config(dir.path()), Arc::new(node.clone()))
                .await
                .unwrap();
            assert!(node.calls().contains(&Call::Reconcile));
            let r = Rig {
                engine,
                node,
                dir: tempfile::tempdir().unwrap(),
                tenant: tenant.clone(),
            };
            match case {
                Crash::Creating | Crash::Deleting => {
                    assert_eq!(
                        r.engine.sandbox(&tenant, &id).unwrap_err().code(),
                        "not_found",
                        "{case:?}"
                    );
                    assert!(!dir.path().join("sandboxes").join(id.as_str()).exists());
                }
                Crash::Resuming | Crash::Checkpointing => {
                    assert_eq!(r.record(&id).state, SandboxState::Parked, "{case:?}");
                    r.check_invariants(std::slice::from_ref(&id));
                    // Back to the image that held 1: nothing committed is lost.
                    assert_eq!(r.count(&id).await.unwrap(), 2, "{case:?}");
                }
            }
            r.check_invariants(std::slice::from_ref(&id));
        });
    }
}

async fn wait_state(r: &Rig, id: &SandboxId, state: SandboxState) {
    eventually(&format!("{id} in {state}"), || r.record(id).state == state).await;
}

/// The store says Uploading (a crash while the checkpoint went into the snapshot store): the
/// restart keeps the sandbox on its local image, Parked.
#[test]
fn a_daemon_crash_while_uploading_keeps_the_local_image() {
    let dir = tempfile::tempdir().unwrap();
    let tenant = torpor_core::TenantId::new("t1").unwrap();
    let first = runtime();
    let id = first.block_on(async {
        let node = Arc::new(FakeNode::new());
        let engine = Engine::start_on(config(dir.path()), Arc::new(node.clone()))
            .await
            .unwrap();
        engine
            .create_tenant(tenant.clone(), Quotas::default())
            .unwrap();
        let r = Rig {
            engine,
            node,
            dir: tempfile::tempdir().unwrap(),
            tenant: tenant.clone(),
        };
        let id = parked_at(&r, 1).await;
        r.engine.shutdown().await;
        id
    });
    first.shutdown_background();
    let store = Store::open(&dir.path().join("torpor.db")).unwrap();
    let mut rec = store.sandbox(&id).unwrap().unwrap();
    assert!(matches!(rec.image, ImageRef::Local(_)));
    rec.state = SandboxState::Uploading;
    store.update_sandbox(&rec).unwrap();
    drop(store);
    runtime().block_on(async {
        let node = Arc::new(FakeNode::new());
        let engine = Engine::start_on(config(dir.path()), Arc::new(node.clone()))
            .await
            .unwrap();
        let r = Rig {
            engine,
            node,
            dir: tempfile::tempdir().unwrap(),
            tenant,
        };
        assert_eq!(r.record(&id).state, SandboxState::Parked);
        r.check_invariants(std::slice::from_ref(&id));
        assert_eq!(r.count(&id).await.unwrap(), 2);
    });
}

#[tokio::test]
async fn a_refused_create_leaves_no_record_and_no_container() {
    let r = rig(quotas(), |_| {}).await;
    r.node.inject(Op::Restore, Fault::Fail);
    let err: ControlError = r.create().await.unwrap_err();
    assert_eq!(err.code(), "runtime_error");
    assert!(r.engine.sandboxes(&r.tenant).unwrap().is_empty());
    assert!(r.node.running().is_empty());
    assert_eq!(r.engine.worker_stats().busy, 0);
}
