//! The planner on the fixture inventories: placements, refusals, gangs, quotas, reclaim.

mod common;

use common::{a100, h200, l4};
use torpor_gpu::ids::{GpuIndex, TenantId};
use torpor_gpu::inventory::Inventory;
use torpor_gpu::ledger::{Ledger, ShareKind};
use torpor_gpu::partition::PartitionMode;
use torpor_gpu::planner::{commit, describe, plan, plan_gang, Policy, Refusal};
use torpor_gpu::quota::{Amount, QuotaBook, Standing, TenantQuota};
use torpor_gpu::request::{GangRequest, GpuRequest};

fn place(
    inv: &Inventory,
    ledger: &mut Ledger,
    request: &GpuRequest,
    policy: &Policy,
) -> Vec<(u32, ShareKind)> {
    let p = plan(inv, ledger, request, policy, &QuotaBook::unlimited())
        .unwrap_or_else(|r| panic!("{request:?}: {r}"));
    commit(inv, ledger, &p, policy).unwrap();
    ledger.check(inv).unwrap();
    p.shares().map(|s| (s.gpu.0, s.kind)).collect()
}

fn refuse(inv: &Inventory, ledger: &Ledger, request: &GpuRequest, policy: &Policy) -> Refusal {
    plan(inv, ledger, request, policy, &QuotaBook::unlimited()).unwrap_err()
}

fn mig_start(kind: ShareKind) -> u8 {
    match kind {
        ShareKind::Mig { instance } => instance.start,
        other => panic!("not MIG: {other:?}"),
    }
}

#[test]
fn whole_gpus_run_out_with_reasons() {
    let inv = l4();
    let mut ledger = Ledger::new(&inv);
    let policy = Policy::default();
    assert_eq!(
        place(&inv, &mut ledger, &GpuRequest::whole(1), &policy),
        [(0, ShareKind::Whole)]
    );
    assert_eq!(
        place(&inv, &mut ledger, &GpuRequest::whole(1), &policy),
        [(1, ShareKind::Whole)]
    );
    let r = refuse(&inv, &ledger, &GpuRequest::whole(1), &policy);
    let Refusal::NoCapacity { fit, gpus, .. } = &r else {
        panic!("{r:?}")
    };
    assert_eq!(*fit, 0);
    assert!(gpus.iter().all(|g| g.code == "gpu_whole_taken"), "{gpus:?}");
    assert_eq!(r.code(), "no_capacity");
}

#[test]
fn mig_binpacks_with_fragmentation_aware_starts() {
    let inv = h200();
    let mut ledger = Ledger::new(&inv);
    let policy = Policy::default();
    let req = GpuRequest::mig("3g.71gb");
    let a = place(&inv, &mut ledger, &req, &policy);
    let b = place(&inv, &mut ledger, &req, &policy);
    let c = place(&inv, &mut ledger, &req, &policy);
    assert_eq!((a[0].0, mig_start(a[0].1)), (0, 4));
    assert_eq!((b[0].0, mig_start(b[0].1)), (0, 0));
    assert_eq!((c[0].0, mig_start(c[0].1)), (1, 4));
    // 1g goes to the partly used GPU 1, at the start that keeps the 3g@0 hole... taken by none
    let d = place(&inv, &mut ledger, &GpuRequest::mig("1g.18gb"), &policy);
    assert_eq!(d[0].0, 1);
    assert!(mig_start(d[0].1) < 4);
    assert_eq!(ledger.usage()[0].mode, PartitionMode::Mig);
    assert_eq!(
        ledger.usage()[2].mode,
        PartitionMode::Whole,
        "untouched GPUs keep their mode"
    );
}

#[test]
fn spread_uses_the_emptiest_gpu() {
    let inv = h200();
    let mut ledger = Ledger::new(&inv);
    let policy = Policy::spread();
    let gpus: Vec<u32> = (0..8)
        .map(|_| place(&inv, &mut ledger, &GpuRequest::mig("1g.18gb"), &policy)[0].0)
        .collect();
    assert_eq!(gpus, [0, 1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(
        place(&inv, &mut ledger, &GpuRequest::mig("1g.18gb"), &policy)[0].0,
        0
    );
}

#[test]
fn mig_memory_picks_the_smallest_profile() {
    let inv = a100();
    let mut ledger = Ledger::new(&inv);
    let req = GpuRequest {
        memory_mib: Some(15_000),
        ..GpuRequest::new(PartitionMode::Mig, 1)
    };
    let s = place(&inv, &mut ledger, &req, &Policy::default());
    let ShareKind::Mig { instance } = s[0].1 else {
        panic!()
    };
    assert_eq!(
        instance.profile_id, 15,
        "1g.20gb is the smallest with 15000 MiB"
    );
}

#[test]
fn impossible_requests_are_refused_up_front() {
    let policy = Policy::default();
    let l4 = l4();
    let ledger = Ledger::new(&l4);
    assert_eq!(
        refuse(&l4, &ledger, &GpuRequest::mig("1g.10gb"), &policy).code(),
        "no_mig_gpu"
    );
    assert_eq!(
        refuse(&l4, &ledger, &GpuRequest::whole(3), &policy).code(),
        "not_enough_gpus"
    );
    assert_eq!(
        refuse(&l4, &ledger, &GpuRequest::mps(10, Some(1 << 20)), &policy).code(),
        "larger_than_any_gpu"
    );
    let model = GpuRequest {
        model: Some("NVIDIA H200".into()),
        ..GpuRequest::whole(1)
    };
    assert_eq!(
        refuse(&l4, &ledger, &model, &policy).code(),
        "model_not_present"
    );
    let h = h200();
    let ledger = Ledger::new(&h);
    let r = refuse(&h, &ledger, &GpuRequest::mig("3g.40gb"), &policy);
    assert_eq!(r.code(), "unknown_profile");
    assert!(r.to_string().contains("H200-141GB"), "{r}");
    let big = GpuRequest {
        memory_mib: Some(200_000),
        ..GpuRequest::new(PartitionMode::Mig, 1)
    };
    assert_eq!(
        refuse(&h, &ledger, &big, &policy).code(),
        "larger_than_any_gpu"
    );
    assert_eq!(
        refuse(&h, &ledger, &GpuRequest::whole(0), &policy).code(),
        "request_bad_count"
    );
}

#[test]
fn multi_gpu_requests_pick_the_closest_set() {
    let inv = a100();
    let mut ledger = Ledger::new(&inv);
    let policy = Policy::default();
    let pair = place(&inv, &mut ledger, &GpuRequest::whole(2), &policy);
    assert_eq!(pair.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 1]);
    let pair = place(&inv, &mut ledger, &GpuRequest::whole(2), &policy);
    assert_eq!(pair.iter().map(|p| p.0).collect::<Vec<_>>(), [2, 3]);
}

#[test]
fn nvlink_and_numa_constraints_are_enforced() {
    let inv = a100();
    let mut ledger = Ledger::new(&inv);
    let policy = Policy::default();
    place(&inv, &mut ledger, &GpuRequest::whole(1), &policy); // GPU0
    place(&inv, &mut ledger, &GpuRequest::whole(2), &policy); // GPU2 and GPU3
    let linked = GpuRequest {
        same_nvlink_domain: true,
        ..GpuRequest::whole(1)
    };
    assert_eq!(
        place(&inv, &mut ledger, &linked, &policy)[0].0,
        1,
        "one GPU is its own domain"
    );
    let mut ledger = Ledger::new(&inv);
    let shares: Vec<_> = vec![torpor_gpu::ledger::Share {
        gpu: GpuIndex(0),
        kind: ShareKind::Whole,
    }];
    ledger
        .insert(&inv, GpuRequest::whole(1), shares, true)
        .unwrap();
    let shares: Vec<_> = vec![torpor_gpu::ledger::Share {
        gpu: GpuIndex(2),
        kind: ShareKind::Whole,
    }];
    ledger
        .insert(&inv, GpuRequest::whole(1), shares, true)
        .unwrap();
    let pair = GpuRequest {
        same_nvlink_domain: true,
        ..GpuRequest::whole(2)
    };
    let r = refuse(&inv, &ledger, &pair, &policy);
    assert_eq!(r.code(), "topology_unsatisfiable", "{r}");
    let numa = GpuRequest {
        numa_local: true,
        ..GpuRequest::whole(2)
    };
    assert_eq!(
        refuse(&inv, &ledger, &numa, &policy).code(),
        "topology_unsatisfiable"
    );
    let any = GpuRequest::whole(2);
    assert!(plan(&inv, &ledger, &any, &policy, &QuotaBook::unlimited()).is_ok());
}

#[test]
fn modes_change_only_on_empty_gpus() {
    let inv = l4();
    let mut ledger = Ledger::new(&inv);
    let policy = Policy::default();
    assert_eq!(
        place(&inv, &mut ledger, &GpuRequest::mps(50, None), &policy)[0].0,
        0
    );
    assert_eq!(ledger.usage()[0].mode, PartitionMode::Mps);
    assert_eq!(
        place(&inv, &mut ledger, &GpuRequest::timeslice(), &policy)[0].0,
        1
    );
    let r = refuse(&inv, &ledger, &GpuRequest::whole(1), &policy);
    let Refusal::NoCapacity { gpus, .. } = &r else {
        panic!("{r:?}")
    };
    assert!(gpus.iter().all(|g| g.code == "gpu_mode_busy"), "{gpus:?}");
    let fixed = Policy {
        allow_mode_change: false,
        ..Policy::default()
    };
    let fresh = Ledger::new(&inv);
    let r = refuse(&inv, &fresh, &GpuRequest::mps(10, None), &fixed);
    let Refusal::NoCapacity { gpus, .. } = &r else {
        panic!("{r:?}")
    };
    assert!(
        gpus.iter().all(|g| g.code == "gpu_mode_change_disabled"),
        "{gpus:?}"
    );
}

#[test]
fn plans_report_mode_changes() {
    let inv = h200();
    let ledger = Ledger::new(&inv);
    let p = plan(
        &inv,
        &ledger,
        &GpuRequest::mig("1g.18gb"),
        &Policy::default(),
        &QuotaBook::unlimited(),
    )
    .unwrap();
    assert_eq!(p.mode_changes.len(), 1);
    assert_eq!(
        (p.mode_changes[0].from, p.mode_changes[0].to),
        (PartitionMode::Whole, PartitionMode::Mig)
    );
}

#[test]
fn mps_shares_fill_compute_then_move_on() {
    let inv = l4();
    let mut ledger = Ledger::new(&inv);
    let policy = Policy::default();
    let req = GpuRequest::mps(40, Some(4096));
    let gpus: Vec<u32> = (0..4)
        .map(|_| place(&inv, &mut ledger, &req, &policy)[0].0)
        .collect();
    assert_eq!(gpus, [0, 0, 1, 1], "binpack fills GPU0 before GPU1");
    let r = refuse(&inv, &ledger, &req, &policy);
    let Refusal::NoCapacity { gpus, .. } = &r else {
        panic!("{r:?}")
    };
    assert!(
        gpus.iter().all(|g| g.code == "gpu_mps_compute_full"),
        "{gpus:?}"
    );
    // 20% still fits on each.
    assert_eq!(
        place(&inv, &mut ledger, &GpuRequest::mps(20, Some(1024)), &policy)[0].0,
        0
    );
}

#[test]
fn gangs_land_together_or_not_at_all() {
    let inv = h200();
    let ledger = Ledger::new(&inv);
    let policy = Policy::default();
    let gang = GangRequest {
        members: vec![GpuRequest::whole(1); 8],
    };
    let p = plan_gang(&inv, &ledger, &gang, &policy, &QuotaBook::unlimited()).unwrap();
    let mut gpus: Vec<u32> = p.shares().map(|s| s.gpu.0).collect();
    gpus.sort_unstable();
    assert_eq!(gpus, [0, 1, 2, 3, 4, 5, 6, 7]);
    let nine = GangRequest {
        members: vec![GpuRequest::whole(1); 9],
    };
    let r = plan_gang(&inv, &ledger, &nine, &policy, &QuotaBook::unlimited()).unwrap_err();
    assert_eq!(r.code(), "gang_unplaceable");
    let Refusal::Gang {
        placed, members, ..
    } = r
    else {
        unreachable!()
    };
    assert_eq!((placed, members), (8, 9));
}

#[test]
fn gang_of_four_stays_on_one_numa_node() {
    let inv = h200();
    let ledger = Ledger::new(&inv);
    let gang = GangRequest {
        members: vec![GpuRequest::whole(1); 4],
    };
    let p = plan_gang(
        &inv,
        &ledger,
        &gang,
        &Policy::default(),
        &QuotaBook::unlimited(),
    )
    .unwrap();
    let numa: Vec<Option<u32>> = p
        .shares()
        .map(|s| inv.gpu(s.gpu).unwrap().numa_node)
        .collect();
    assert!(numa.iter().all(|n| *n == numa[0]), "{numa:?}");
}

#[test]
fn gang_of_two_on_a100_takes_an_nvlink_pair() {
    let inv = a100();
    let mut ledger = Ledger::new(&inv);
    let policy = Policy::default();
    ledger
        .insert(
            &inv,
            GpuRequest::whole(1),
            vec![torpor_gpu::ledger::Share {
                gpu: GpuIndex(0),
                kind: ShareKind::Whole,
            }],
            true,
        )
        .unwrap();
    let gang = GangRequest {
        members: vec![GpuRequest::whole(1); 2],
    };
    let p = plan_gang(&inv, &ledger, &gang, &policy, &QuotaBook::unlimited()).unwrap();
    let mut gpus: Vec<u32> = p.shares().map(|s| s.gpu.0).collect();
    gpus.sort_unstable();
    assert_eq!(gpus, [2, 3]);
    let ids = commit(&inv, &mut ledger, &p, &policy).unwrap();
    assert_eq!(ids.len(), 2, "one allocation per member");
}

#[test]
fn fractional_gang_members_share_a_gpu() {
    let inv = h200();
    let ledger = Ledger::new(&inv);
    let gang = GangRequest {
        members: vec![GpuRequest::mig("1g.18gb"); 3],
    };
    let p = plan_gang(
        &inv,
        &ledger,
        &gang,
        &Policy::default(),
        &QuotaBook::unlimited(),
    )
    .unwrap();
    assert!(p.shares().all(|s| s.gpu == GpuIndex(0)));
}

fn tenant(name: &str) -> TenantId {
    TenantId::new(name).unwrap()
}

fn one_l4_gpu(borrow: bool) -> TenantQuota {
    TenantQuota {
        guaranteed: Amount {
            memory_mib: 23034,
            compute: 700,
        },
        borrow_limit: borrow.then_some(Amount {
            memory_mib: 23034,
            compute: 700,
        }),
    }
}

#[test]
fn quotas_cap_tenants_and_allow_borrowing() {
    let inv = l4();
    let mut ledger = Ledger::new(&inv);
    let policy = Policy::default();
    let quotas = QuotaBook::unlimited()
        .with(tenant("a"), one_l4_gpu(false))
        .with(tenant("b"), one_l4_gpu(true));
    let a = GpuRequest::whole(1).for_tenant(tenant("a"));
    let p = plan(&inv, &ledger, &a, &policy, &quotas).unwrap();
    assert_eq!(p.members[0].standing, Standing::Guaranteed);
    commit(&inv, &mut ledger, &p, &policy).unwrap();
    let r = plan(&inv, &ledger, &a, &policy, &quotas).unwrap_err();
    assert_eq!(r.code(), "quota_exceeded", "{r}");
    assert_eq!(
        plan(&inv, &ledger, &GpuRequest::whole(1), &policy, &quotas)
            .unwrap_err()
            .code(),
        "quota_tenant_required"
    );
    let c = GpuRequest::whole(1).for_tenant(tenant("c"));
    assert_eq!(
        plan(&inv, &ledger, &c, &policy, &quotas)
            .unwrap_err()
            .code(),
        "quota_none"
    );
}

#[test]
fn owners_reclaim_borrowed_capacity() {
    let inv = l4();
    let mut ledger = Ledger::new(&inv);
    let policy = Policy::default();
    let quotas = QuotaBook::unlimited()
        .with(tenant("a"), one_l4_gpu(false))
        .with(tenant("b"), one_l4_gpu(true));
    let b = GpuRequest::whole(1).for_tenant(tenant("b"));
    let first = plan(&inv, &ledger, &b, &policy, &quotas).unwrap();
    assert_eq!(first.members[0].standing, Standing::Guaranteed);
    let first_id = commit(&inv, &mut ledger, &first, &policy).unwrap()[0];
    let second = plan(&inv, &ledger, &b, &policy, &quotas).unwrap();
    assert_eq!(second.members[0].standing, Standing::Borrowing);
    let borrowed_id = commit(&inv, &mut ledger, &second, &policy).unwrap()[0];
    // b is over its guarantee; a, within its own, takes the borrowed GPU back.
    let a = GpuRequest::whole(1).for_tenant(tenant("a"));
    let p = plan(&inv, &ledger, &a, &policy, &quotas).unwrap();
    assert_eq!(p.evictions, [borrowed_id]);
    commit(&inv, &mut ledger, &p, &policy).unwrap();
    assert!(
        ledger.allocation(first_id).is_some(),
        "the guaranteed share stays"
    );
    assert!(ledger.allocation(borrowed_id).is_none());
    ledger.check(&inv).unwrap();
    // b, now at its guarantee, may not evict anyone.
    assert_eq!(
        plan(&inv, &ledger, &b, &policy, &quotas)
            .unwrap_err()
            .code(),
        "no_capacity"
    );
}

#[test]
fn plans_are_deterministic() {
    let inv = h200();
    let mut ledger = Ledger::new(&inv);
    let policy = Policy::default();
    for profile in ["1g.18gb", "3g.71gb", "2g.35gb", "1g.35gb"] {
        place(&inv, &mut ledger, &GpuRequest::mig(profile), &policy);
    }
    let gang = GangRequest {
        members: vec![
            GpuRequest::mig("2g.35gb"),
            GpuRequest::whole(2),
            GpuRequest::mps(30, None),
        ],
    };
    let a = plan_gang(&inv, &ledger, &gang, &policy, &QuotaBook::unlimited()).unwrap();
    let b = plan_gang(
        &inv,
        &ledger.clone(),
        &gang,
        &policy,
        &QuotaBook::unlimited(),
    )
    .unwrap();
    assert_eq!(a, b);
}

#[test]
fn devices_describe_as_the_cli_prints_them() {
    let inv = h200();
    let ledger = Ledger::new(&inv);
    let p = plan(
        &inv,
        &ledger,
        &GpuRequest::mig("3g.71gb"),
        &Policy::default(),
        &QuotaBook::unlimited(),
    )
    .unwrap();
    let d = describe(&inv, p.shares().next().unwrap());
    assert_eq!(
        serde_json::to_string(&d).unwrap(),
        r#"{"gpu_index":0,"gpu_uuid":"GPU-3b9e1a70-0c1d-4a52-9b11-5e0a8f6c0000","mode":"mig","profile":"3g.71gb","start":4}"#
    );
}

#[test]
fn a_ledger_from_another_node_is_refused_not_a_panic() {
    let (h, l) = (h200(), l4());
    let other = Ledger::new(&l);
    let r = refuse(&h, &other, &GpuRequest::whole(1), &Policy::default());
    assert_eq!(r.code(), "ledger_mismatch");
    let mut small = Ledger::new(&l);
    let share = torpor_gpu::ledger::Share {
        gpu: GpuIndex(5),
        kind: ShareKind::Whole,
    };
    let e = small
        .insert(&h, GpuRequest::whole(1), vec![share], true)
        .unwrap_err();
    assert_eq!(e.code(), "gpu_unknown");
}

#[test]
fn reclaim_evicts_only_what_the_owner_needs() {
    let inv = l4();
    let mut ledger = Ledger::new(&inv);
    let policy = Policy::default();
    let half_gpu = TenantQuota {
        guaranteed: Amount {
            memory_mib: 11517,
            compute: 350,
        },
        borrow_limit: Some(Amount {
            memory_mib: 46068,
            compute: 1400,
        }),
    };
    let quotas = QuotaBook::unlimited()
        .with(tenant("a"), half_gpu)
        .with(tenant("b"), half_gpu);
    // b fills both GPUs with four 50% MPS shares: one guaranteed, three borrowed.
    let b = GpuRequest::mps(50, Some(11517)).for_tenant(tenant("b"));
    let mut ids = Vec::new();
    for _ in 0..4 {
        let p = plan(&inv, &ledger, &b, &policy, &quotas).unwrap();
        ids.push(commit(&inv, &mut ledger, &p, &policy).unwrap()[0]);
    }
    // Within b's ceiling but nothing is free, and a borrower may not evict.
    let r = plan(&inv, &ledger, &b, &policy, &quotas).unwrap_err();
    assert_eq!(r.code(), "no_capacity");
    // a needs 50% of one GPU: one eviction, the newest borrowed share.
    let a = GpuRequest::mps(50, Some(11517)).for_tenant(tenant("a"));
    let p = plan(&inv, &ledger, &a, &policy, &quotas).unwrap();
    assert_eq!(p.evictions, [ids[3]]);
    commit(&inv, &mut ledger, &p, &policy).unwrap();
    // a asks again, now borrowing: it may not evict anyone.
    let r = plan(&inv, &ledger, &a, &policy, &quotas).unwrap_err();
    assert_eq!(r.code(), "no_capacity");
    // a whole GPU for a is above a's guarantee even with nothing else held: refused.
    let whole = GpuRequest::whole(1).for_tenant(tenant("a"));
    assert_ne!(
        plan(&inv, &ledger, &whole, &policy, &quotas).map(|_| ()),
        Ok(())
    );
    ledger.check(&inv).unwrap();
}

#[test]
fn numa_local_gangs_stay_on_one_socket_or_are_refused() {
    let inv = h200();
    let ledger = Ledger::new(&inv);
    let local = GpuRequest {
        numa_local: true,
        ..GpuRequest::whole(1)
    };
    let four = GangRequest {
        members: vec![local.clone(); 4],
    };
    let p = plan_gang(
        &inv,
        &ledger,
        &four,
        &Policy::spread(),
        &QuotaBook::unlimited(),
    )
    .unwrap();
    let numa: Vec<Option<u32>> = p
        .shares()
        .map(|s| inv.gpu(s.gpu).unwrap().numa_node)
        .collect();
    assert!(numa.iter().all(|n| *n == numa[0]), "{numa:?}");
    let five = GangRequest {
        members: vec![local; 5],
    };
    let r = plan_gang(
        &inv,
        &ledger,
        &five,
        &Policy::default(),
        &QuotaBook::unlimited(),
    )
    .unwrap_err();
    let Refusal::Gang {
        placed, blocking, ..
    } = &r
    else {
        panic!("{r:?}")
    };
    assert_eq!(*placed, 4);
    assert_eq!(blocking.code(), "topology_unsatisfiable", "{r}");
}

#[test]
fn timeslice_replicas_are_counted() {
    let inv = l4();
    let mut ledger = Ledger::new(&inv);
    let policy = Policy::default();
    let gpus: Vec<u32> = (0..8)
        .map(|_| place(&inv, &mut ledger, &GpuRequest::timeslice(), &policy)[0].0)
        .collect();
    assert_eq!(
        gpus,
        [0, 0, 0, 0, 1, 1, 1, 1],
        "4 replicas per GPU by default"
    );
    let r = refuse(&inv, &ledger, &GpuRequest::timeslice(), &policy);
    let Refusal::NoCapacity { gpus, .. } = &r else {
        panic!("{r:?}")
    };
    assert!(gpus.iter().all(|g| g.code == "gpu_timeslice_full"));
}

#[test]
fn declared_initial_modes_are_respected() {
    let text = std::fs::read_to_string(common::fixtures_dir().join("l4-2.toml"))
        .unwrap()
        .replacen(
            "mig_capable = false\n",
            "mig_capable = false\nmode = \"mps\"\n",
            1,
        );
    let inv = Inventory::from_toml(&text, "l4-mps.toml").unwrap();
    let ledger = Ledger::new(&inv);
    assert_eq!(ledger.usage()[0].mode, PartitionMode::Mps);
    let fixed = Policy {
        allow_mode_change: false,
        ..Policy::default()
    };
    let p = plan(
        &inv,
        &ledger,
        &GpuRequest::mps(10, None),
        &fixed,
        &QuotaBook::unlimited(),
    )
    .unwrap();
    assert_eq!(p.shares().next().unwrap().gpu, GpuIndex(0));
    assert!(p.mode_changes.is_empty());
    let w = plan(
        &inv,
        &ledger,
        &GpuRequest::whole(1),
        &fixed,
        &QuotaBook::unlimited(),
    )
    .unwrap();
    assert_eq!(w.shares().next().unwrap().gpu, GpuIndex(1));
}
