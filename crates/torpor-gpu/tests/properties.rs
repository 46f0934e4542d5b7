//! Property tests of the planner: no overlap, every placement valid for its GPU's geometry,
//! quotas never exceeded, a release restores capacity exactly, gangs get the best set.

mod common;

use proptest::prelude::*;
use torpor_gpu::ids::{GpuIndex, TenantId};
use torpor_gpu::inventory::Inventory;
use torpor_gpu::ledger::resolve_profile;
use torpor_gpu::ledger::{GpuUsage, Ledger, Share, ShareKind};
use torpor_gpu::mig::{MigInstance, MigLayout, MEMORY_SLICES};
use torpor_gpu::partition::PartitionMode;
use torpor_gpu::planner::{commit, plan, plan_gang, MigPacking, Policy, Strategy as Placement};
use torpor_gpu::quota::{Amount, QuotaBook, TenantQuota};
use torpor_gpu::request::{GangRequest, GpuRequest};

const PROFILE_IDS: [&str; 7] = ["19", "20", "15", "14", "9", "5", "0"];
const TENANTS: [&str; 3] = ["a", "b", "c"];

fn inventory(which: usize) -> Inventory {
    match which {
        0 => common::h200(),
        1 => common::a100(),
        _ => common::l4(),
    }
}

fn request() -> impl Strategy<Value = GpuRequest> {
    (
        0usize..4,
        0usize..7,
        1u32..=100,
        prop::option::of(1u64..60_000),
        1u32..=3,
        prop::option::of(0usize..3),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(mode, profile, pct, memory, count, tenant, nvlink, numa)| {
                let mut r = match mode {
                    0 => GpuRequest::whole(1),
                    1 => GpuRequest::mig(PROFILE_IDS[profile]),
                    2 => GpuRequest::mps(pct, memory),
                    _ => GpuRequest::timeslice(),
                };
                r.count = if count == 3 { 2 } else { 1 };
                r.tenant = tenant.map(|t| TenantId::new(TENANTS[t]).unwrap());
                r.same_nvlink_domain = nvlink && count == 3;
                r.numa_local = numa && count == 3;
                r
            },
        )
}

#[derive(Debug, Clone)]
enum Op {
    Place(GpuRequest),
    Gang(Vec<GpuRequest>),
    Release(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => request().prop_map(Op::Place),
        1 => prop::collection::vec(request(), 1..4).prop_map(Op::Gang),
        3 => any::<usize>().prop_map(Op::Release),
    ]
}

fn policy() -> impl Strategy<Value = Policy> {
    (any::<bool>(), any::<bool>(), any::<bool>()).prop_map(|(spread, first_fit, change)| Policy {
        strategy: if spread {
            Placement::Spread
        } else {
            Placement::Binpack
        },
        mig_packing: if first_fit {
            MigPacking::FirstFit
        } else {
            MigPacking::FragmentationAware
        },
        allow_mode_change: change,
        search_budget: 20_000,
    })
}

fn quotas() -> impl Strategy<Value = QuotaBook> {
    prop::option::of(prop::collection::vec(
        (
            (0u64..300_000),
            (0u64..4_000),
            prop::option::of(((0u64..150_000), (0u64..2_000))),
        ),
        3,
    ))
    .prop_map(|tenants| match tenants {
        None => QuotaBook::unlimited(),
        Some(list) => list.into_iter().enumerate().fold(
            QuotaBook::unlimited(),
            |book, (i, (m, c, borrow))| {
                book.with(
                    TenantId::new(TENANTS[i]).unwrap(),
                    TenantQuota {
                        guaranteed: Amount {
                            memory_mib: m,
                            compute: c,
                        },
                        borrow_limit: borrow.map(|(m, c)| Amount {
                            memory_mib: m,
                            compute: c,
                        }),
                    },
                )
            },
        ),
    })
}

/// Checks the invariants directly from the allocations, independently of the ledger's own
/// bookkeeping.
fn assert_invariants(
    inv: &Inventory,
    ledger: &Ledger,
    quotas: &QuotaBook,
) -> Result<(), TestCaseError> {
    ledger
        .check(inv)
        .map_err(|e| TestCaseError::fail(format!("ledger check: {e}")))?;
    let n = inv.gpus().len();
    let mut slices = vec![0u8; n];
    let mut modes: Vec<Option<PartitionMode>> = vec![None; n];
    let mut counts = vec![0u32; n];
    let mut mps = vec![(0u32, 0u64); n];
    for a in ledger.allocations() {
        let mut gpus: Vec<GpuIndex> = a.shares.iter().map(|s| s.gpu).collect();
        gpus.sort_unstable();
        gpus.dedup();
        prop_assert_eq!(
            gpus.len(),
            a.shares.len(),
            "devices of one allocation are distinct GPUs"
        );
        for s in &a.shares {
            let i = s.gpu.0 as usize;
            let gpu = inv.gpu(s.gpu).unwrap();
            let mode = s.kind.mode();
            prop_assert!(modes[i].is_none_or(|m| m == mode), "one mode per GPU");
            modes[i] = Some(mode);
            counts[i] += 1;
            match s.kind {
                ShareKind::Whole => prop_assert_eq!(counts[i], 1),
                ShareKind::Mig { instance } => {
                    let geometry = gpu.mig_geometry.as_deref().expect("MIG only on MIG GPUs");
                    let p = geometry.profile_by_id(instance.profile_id).unwrap();
                    prop_assert!(p.allowed_starts.contains(&instance.start));
                    prop_assert!(instance.start + p.memory_slices <= MEMORY_SLICES);
                    let mask = p.mask(instance.start);
                    prop_assert_eq!(slices[i] & mask, 0, "MIG overlap on {}", s.gpu);
                    slices[i] |= mask;
                }
                ShareKind::Mps {
                    compute_pct,
                    memory_mib,
                } => {
                    mps[i].0 += compute_pct;
                    mps[i].1 += memory_mib;
                    prop_assert!(mps[i].0 <= 100 && mps[i].1 <= gpu.memory_mib);
                    prop_assert!(counts[i] <= gpu.mps_max_clients);
                }
                ShareKind::Timeslice => prop_assert!(counts[i] <= gpu.timeslice_replicas),
            }
        }
    }
    for (i, g) in inv.gpus().iter().enumerate() {
        if let (Some(PartitionMode::Mig), Some(geometry)) = (modes[i], g.mig_geometry.as_deref()) {
            for p in geometry.profiles() {
                let on_gpu = ledger
                    .allocations()
                    .flat_map(|a| a.shares.iter())
                    .filter(|s| s.gpu == g.index && matches!(s.kind, ShareKind::Mig { instance } if instance.profile_id == p.id))
                    .count();
                prop_assert!(on_gpu <= usize::from(p.max_per_gpu), "{} limit", p.name);
            }
        }
    }
    if quotas.enforced() {
        for (tenant, holds) in QuotaBook::usage(inv, ledger) {
            let quota = quotas
                .tenants
                .get(&tenant)
                .expect("only tenants with quotas hold shares");
            prop_assert!(
                holds.within(quota.ceiling()),
                "{tenant} holds {holds:?} above {:?}",
                quota.ceiling()
            );
        }
    }
    Ok(())
}

/// Usage equal, except that an empty GPU may have been left in another mode.
fn same_capacity(before: &[GpuUsage], after: &[GpuUsage]) -> bool {
    before.iter().zip(after).all(|(b, a)| {
        if b.mode == a.mode {
            b == a
        } else {
            b.is_empty() && a.is_empty()
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn random_streams_keep_every_invariant(
        which in 0usize..3,
        policy in policy(),
        quotas in quotas(),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        let inv = inventory(which);
        let mut ledger = Ledger::new(&inv);
        for op in ops {
            match op {
                Op::Place(request) => {
                    let before = ledger.clone();
                    match plan(&inv, &ledger, &request, &policy, &quotas) {
                        Ok(p) => {
                            prop_assert_eq!(&plan(&inv, &ledger, &request, &policy, &quotas).unwrap(), &p, "deterministic");
                            let ids = commit(&inv, &mut ledger, &p, &policy).map_err(|e| TestCaseError::fail(e.to_string()))?;
                            prop_assert_eq!(ids.len(), 1);
                            prop_assert_eq!(ledger.allocation(ids[0]).unwrap().shares.len(), request.count as usize);
                            if p.evictions.is_empty() {
                                let mut undone = ledger.clone();
                                undone.release(ids[0]).unwrap();
                                prop_assert!(same_capacity(before.usage(), undone.usage()), "release restores capacity");
                            }
                        }
                        Err(refusal) => {
                            prop_assert!(!refusal.code().is_empty());
                            prop_assert!(!refusal.to_string().is_empty());
                        }
                    }
                }
                Op::Gang(members) => {
                    let gang = GangRequest { members };
                    if let Ok(p) = plan_gang(&inv, &ledger, &gang, &policy, &quotas) {
                        let ids = commit(&inv, &mut ledger, &p, &policy).map_err(|e| TestCaseError::fail(e.to_string()))?;
                        prop_assert_eq!(ids.len(), gang.members.len(), "all members land");
                    }
                }
                Op::Release(pick) => {
                    let ids: Vec<_> = ledger.allocations().map(|a| a.id).collect();
                    if !ids.is_empty() {
                        ledger.release(ids[pick % ids.len()]).unwrap();
                    }
                }
            }
            assert_invariants(&inv, &ledger, &quotas)?;
        }
        // Releasing everything gives every GPU back empty.
        let ids: Vec<_> = ledger.allocations().map(|a| a.id).collect();
        for id in ids {
            ledger.release(id).unwrap();
        }
        prop_assert!(ledger.usage().iter().all(|u| u.is_empty() && u.mps_compute_pct == 0 && u.mps_memory_mib == 0));
    }

    #[test]
    fn whole_gpu_gangs_get_the_best_pairwise_score(
        which in 0usize..2,
        busy in prop::collection::vec(any::<bool>(), 8),
        size in 1usize..=8,
        spread in any::<bool>(),
    ) {
        let inv = inventory(which);
        let mut ledger = Ledger::new(&inv);
        for g in inv.gpus() {
            if busy[g.index.0 as usize] {
                ledger.insert(&inv, GpuRequest::whole(1), vec![Share { gpu: g.index, kind: ShareKind::Whole }], true).unwrap();
            }
        }
        let free: Vec<GpuIndex> = inv.gpus().iter().map(|g| g.index).filter(|i| !busy[i.0 as usize]).collect();
        let policy = if spread { Policy::spread() } else { Policy::default() };
        let gang = GangRequest { members: vec![GpuRequest::whole(1); size] };
        let result = plan_gang(&inv, &ledger, &gang, &policy, &QuotaBook::unlimited());
        if free.len() < size {
            prop_assert!(result.is_err());
            return Ok(());
        }
        let p = result.map_err(|e| TestCaseError::fail(e.to_string()))?;
        let chosen: Vec<GpuIndex> = p.shares().map(|s| s.gpu).collect();
        let mut best = 0u64;
        for mask in 0u32..(1 << free.len()) {
            if mask.count_ones() as usize != size {
                continue;
            }
            let set: Vec<GpuIndex> = (0..free.len()).filter(|i| mask & (1 << i) != 0).map(|i| free[i]).collect();
            best = best.max(inv.set_score(&set));
        }
        prop_assert_eq!(inv.set_score(&chosen), best);
        prop_assert_eq!(p.topology_score, best);
    }

    #[test]
    fn fractional_gangs_get_the_best_pairwise_score(
        which in 0usize..2,
        occupy in prop::collection::vec(0usize..5, 0..6),
        profile in 0usize..5,
        size in 1usize..=5,
    ) {
        let inv = inventory(which);
        let policy = Policy::default();
        let mut ledger = Ledger::new(&inv);
        for p in occupy {
            let r = GpuRequest::mig(PROFILE_IDS[[0, 2, 3, 4, 5][p]]);
            if let Ok(found) = plan(&inv, &ledger, &r, &policy, &QuotaBook::unlimited()) {
                commit(&inv, &mut ledger, &found, &policy).unwrap();
            }
        }
        let member = GpuRequest::mig(PROFILE_IDS[[0, 2, 3, 4, 5][profile]]);
        let gang = GangRequest { members: vec![member.clone(); size] };
        let best = brute_force_gang(&inv, &ledger, &member, size);
        match plan_gang(&inv, &ledger, &gang, &policy, &QuotaBook::unlimited()) {
            Ok(p) => prop_assert_eq!(p.topology_score, best.expect("brute force finds a placement too")),
            Err(e) => prop_assert!(best.is_none(), "refused ({}) but brute force placed it", e),
        }
    }
}

/// Best pairwise score over every multiset of GPUs that can hold one MIG share per member.
fn brute_force_gang(
    inv: &Inventory,
    ledger: &Ledger,
    member: &GpuRequest,
    size: usize,
) -> Option<u64> {
    fn go(
        inv: &Inventory,
        ledger: &Ledger,
        member: &GpuRequest,
        size: usize,
        from: u32,
        chosen: &mut Vec<GpuIndex>,
        best: &mut Option<u64>,
    ) {
        if chosen.len() == size {
            let score = inv.set_score(chosen);
            *best = Some(best.map_or(score, |b| b.max(score)));
            return;
        }
        for g in from..inv.gpus().len() as u32 {
            let gpu = &inv.gpus()[g as usize];
            let usage = ledger.usage()[g as usize].clone();
            let Some(geometry) = gpu.mig_geometry.clone() else {
                continue;
            };
            let Ok(p) = resolve_profile(&geometry, member.profile.as_deref(), None, gpu.memory_mib)
            else {
                continue;
            };
            let layout = match (usage.mode, usage.mig.clone()) {
                (PartitionMode::Mig, Some(layout)) => layout,
                _ => MigLayout::empty(geometry.clone()),
            };
            // Any valid start will do for feasibility; the score depends on GPUs only.
            let Some(start) = layout.first_fit_start(p) else {
                continue;
            };
            let kind = ShareKind::Mig {
                instance: MigInstance {
                    profile_id: p.id,
                    start,
                },
            };
            let mut next = ledger.clone();
            if next
                .insert(
                    inv,
                    member.clone(),
                    vec![Share {
                        gpu: GpuIndex(g),
                        kind,
                    }],
                    true,
                )
                .is_err()
            {
                continue;
            }
            chosen.push(GpuIndex(g));
            go(inv, &next, member, size, g, chosen, best);
            chosen.pop();
        }
    }
    let mut best = None;
    go(inv, ledger, member, size, 0, &mut Vec::new(), &mut best);
    best
}
