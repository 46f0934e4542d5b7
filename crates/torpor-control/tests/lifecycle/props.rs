//! Random interleavings of operations and node failures; the invariants are checked after
//! every step (see `Rig::check_invariants`), plus:
//! - a quota is never exceeded (the tenant never holds more sandboxes than `max_sandboxes`,
//!   never more resident than `max_running`);
//! - every call is answered, with a result or one of the documented codes;
//! - memory state is never invented and never lost beyond the last committed image: a
//!   sandbox's counter after `count` lies between (last known committed value + 1) and
//!   (last seen value + 1), and is exactly the latter when no failure touched it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use torpor_control::Quotas;
use torpor_core::{SandboxId, SandboxState, Tier};
use torpor_runtime::node::fake::{Fault, Op};

use super::{rig, Rig};

const MAX_SANDBOXES: u64 = 5;
const MAX_RUNNING: u64 = 3;

#[derive(Debug, Clone)]
enum Action {
    Create,
    Count(usize),
    Suspend(usize, Tier),
    Delete(usize),
    Fork(usize),
    /// The container of sandbox i dies on its own (if it has one).
    Crash(usize, bool),
    /// The next `op` goes wrong.
    Inject(Op, Fault),
    Tick,
}

fn action() -> impl Strategy<Value = Action> {
    let i = 0usize..6;
    prop_oneof![
        3 => Just(Action::Create),
        6 => i.clone().prop_map(Action::Count),
        4 => (i.clone(), prop_oneof![Just(Tier::Frozen), Just(Tier::Parked), Just(Tier::Suspended)])
            .prop_map(|(i, t)| Action::Suspend(i, t)),
        1 => i.clone().prop_map(Action::Delete),
        1 => i.clone().prop_map(Action::Fork),
        1 => (i, any::<bool>()).prop_map(|(i, oom)| Action::Crash(i, oom)),
        2 => (
            prop_oneof![Just(Op::Restore), Just(Op::Checkpoint), Just(Op::Freeze), Just(Op::Thaw), Just(Op::Call)],
            prop_oneof![
                Just(Fault::Fail),
                Just(Fault::FailHalfway),
                Just(Fault::Crash { oom: false }),
                Just(Fault::Delay(Duration::from_millis(30)))
            ],
        )
            .prop_map(|(op, f)| Action::Inject(op, f)),
        1 => Just(Action::Tick),
    ]
}

/// Codes an operation may answer with here (anything else is a bug).
const DOCUMENTED: &[&str] = &[
    "invalid_transition",
    "quota_exceeded",
    "runtime_error",
    "sandbox_crashed",
    "no_worker_available",
    "lot_full",
    "not_found",
    "io_error",
    "sandbox_busy",
    "sandbox_unavailable",
];

#[derive(Default)]
struct Model {
    /// Sandboxes by creation order (deleted ones stay, so indices are stable).
    ids: Vec<SandboxId>,
    /// Last counter value seen, and the lowest value its committed image may hold.
    seen: HashMap<SandboxId, (u64, u64)>,
    /// Faults consumed since the sandbox's last count (it may have been rolled back).
    disturbed: HashMap<SandboxId, bool>,
}

async fn step(r: &Arc<Rig>, m: &mut Model, a: &Action) {
    let pick = |i: &usize| m.ids.get(i % m.ids.len().max(1)).cloned();
    let faults_before = r.node.pending_faults();
    let outcome: Result<(), &'static str> = match a {
        Action::Create => match r.create().await {
            Ok(rec) => {
                m.seen.insert(rec.id.clone(), (0, 0));
                m.ids.push(rec.id);
                Ok(())
            }
            Err(e) => Err(e.code()),
        },
        Action::Count(i) => match pick(i) {
            None => Ok(()),
            Some(id) => match r.count(&id).await {
                Ok(v) => {
                    let (last, floor) = m.seen[&id];
                    let disturbed = m.disturbed.remove(&id).unwrap_or(false)
                        || r.node.pending_faults() != faults_before;
                    if disturbed {
                        assert!(
                            v > floor && v <= last + 1,
                            "{id}: counter {v} outside ({floor}, {}]",
                            last + 1
                        );
                    } else {
                        assert_eq!(v, last + 1, "{id}: state lost without a failure");
                    }
                    m.seen.insert(id, (v, floor.min(v)));
                    Ok(())
                }
                Err(e) => Err(e.code()),
            },
        },
        Action::Suspend(i, tier) => match pick(i) {
            None => Ok(()),
            Some(id) => match r.engine.suspend(&r.tenant, &id, *tier).await {
                Ok(rec) => {
                    let undisturbed = !m.disturbed.get(&id).copied().unwrap_or(false)
                        && r.node.pending_faults() == faults_before;
                    if *tier != Tier::Frozen && undisturbed {
                        // Committed now: the image holds the last value seen (unless a
                        // failure rolled it back before, which `disturbed` tracks).
                        if let Some(e) = m.seen.get_mut(&id) {
                            e.1 = e.0;
                        }
                    }
                    assert!(rec.tier >= *tier || rec.state == SandboxState::Running);
                    Ok(())
                }
                Err(e) => Err(e.code()),
            },
        },
        Action::Delete(i) => match pick(i) {
            None => Ok(()),
            Some(id) => r
                .engine
                .delete_sandbox(&r.tenant, &id)
                .await
                .map_err(|e| e.code()),
        },
        Action::Fork(i) => match pick(i) {
            None => Ok(()),
            Some(id) => match r.engine.fork(&r.tenant, &id, 1).await {
                Ok(forks) => {
                    let committed = m.seen.get(&id).map_or(0, |e| e.0);
                    for f in forks {
                        // The source was parked first: the fork holds at least its last
                        // committed value.
                        let floor = m.seen.get(&id).map_or(0, |e| e.1);
                        m.seen.insert(f.id.clone(), (committed, floor));
                        m.disturbed.insert(f.id.clone(), true);
                        m.ids.push(f.id);
                    }
                    Ok(())
                }
                Err(e) => Err(e.code()),
            },
        },
        Action::Crash(i, oom) => {
            if let Some(id) = pick(i) {
                if let Ok(rec) = r.engine.sandbox(&r.tenant, &id) {
                    if r.node.crash(&rec.container_id(), *oom) {
                        m.disturbed.insert(id.clone(), true);
                        // The crash is recorded by the node's event watch.
                        super::eventually("the crash is recorded", || {
                            r.engine
                                .sandbox(&r.tenant, &id)
                                .map(|s| {
                                    !matches!(s.state, SandboxState::Running | SandboxState::Frozen)
                                })
                                .unwrap_or(true)
                        })
                        .await;
                    }
                }
            }
            Ok(())
        }
        Action::Inject(op, fault) => {
            r.node.inject(*op, fault.clone());
            for id in &m.ids {
                m.disturbed.insert(id.clone(), true);
            }
            Ok(())
        }
        Action::Tick => r.engine.policy_tick().await.map_err(|e| e.code()),
    };
    if let Err(code) = outcome {
        assert!(DOCUMENTED.contains(&code), "{a:?} answered {code}");
    }
    if r.node.pending_faults() != faults_before {
        for id in &m.ids {
            m.disturbed.insert(id.clone(), true);
        }
    }
    // Background transitions (idle parks) land before the invariants are read.
    for _ in 0..200 {
        let busy = m.ids.iter().any(|id| {
            r.engine
                .sandbox(&r.tenant, id)
                .is_ok_and(|s| s.state.is_transitional())
        });
        if !busy {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    r.check_invariants(&m.ids);
    let live: Vec<_> = m
        .ids
        .iter()
        .filter_map(|id| r.engine.sandbox(&r.tenant, id).ok())
        .collect();
    assert!(live.len() as u64 <= MAX_SANDBOXES, "sandbox quota exceeded");
    let resident = live
        .iter()
        .filter(|s| matches!(s.state, SandboxState::Running | SandboxState::Frozen))
        .count() as u64;
    assert!(resident <= MAX_RUNNING, "running quota exceeded");
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 24,
        max_shrink_iters: 200,
        .. ProptestConfig::default()
    })]

    #[test]
    fn random_operations_and_failures_keep_every_invariant(
        actions in proptest::collection::vec(action(), 1..28)
    ) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let r = Arc::new(
                rig(
                    Quotas {
                        max_sandboxes: Some(MAX_SANDBOXES),
                        max_running: Some(MAX_RUNNING),
                        ..Quotas::default()
                    },
                    |c| {
                        c.workers = 2;
                        c.worker_wait = Duration::from_millis(200);
                    },
                )
                .await,
            );
            let mut m = Model::default();
            for a in &actions {
                step(&r, &mut m, a).await;
            }
        });
    }
}
