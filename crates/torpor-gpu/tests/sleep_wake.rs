//! A sandbox's share is released when it sleeps and re-acquired on wake.

mod common;

use torpor_gpu::ids::GpuIndex;
use torpor_gpu::inject::{
    injection, InjectConfig, MigHandles, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, NVIDIA_VISIBLE_DEVICES,
};
use torpor_gpu::ledger::Ledger;
use torpor_gpu::planner::{commit, plan, Policy};
use torpor_gpu::quota::QuotaBook;
use torpor_gpu::request::GpuRequest;
use torpor_gpu::sleep::{plan_wake, release_for_sleep};

#[test]
fn sleeping_frees_the_share_and_waking_takes_the_same_one_back() {
    let inv = common::h200();
    let mut ledger = Ledger::new(&inv);
    let policy = Policy::default();
    let quotas = QuotaBook::unlimited();
    let p = plan(&inv, &ledger, &GpuRequest::mig("3g.71gb"), &policy, &quotas).unwrap();
    let id = commit(&inv, &mut ledger, &p, &policy).unwrap()[0];
    let held = ledger.allocation(id).unwrap().shares.clone();
    let before_sleep_usage = ledger.usage()[0].clone();
    let ticket = release_for_sleep(&inv, &mut ledger, id).unwrap();
    assert_eq!(ticket.model.as_deref(), Some("NVIDIA H200"));
    assert!(ledger.usage()[0].is_empty(), "the share is given back");
    let wake = plan_wake(&inv, &ledger, &ticket, &policy, &quotas, true).unwrap();
    assert_eq!(
        wake.members[0].shares, held,
        "same GPU and placement when free"
    );
    commit(&inv, &mut ledger, &wake, &policy).unwrap();
    assert_eq!(ledger.usage()[0], before_sleep_usage);
}

#[test]
fn waking_moves_to_another_gpu_of_the_same_model_when_taken() {
    let inv = common::a100();
    let mut ledger = Ledger::new(&inv);
    let policy = Policy::default();
    let quotas = QuotaBook::unlimited();
    let p = plan(&inv, &ledger, &GpuRequest::whole(1), &policy, &quotas).unwrap();
    let id = commit(&inv, &mut ledger, &p, &policy).unwrap()[0];
    let ticket = release_for_sleep(&inv, &mut ledger, id).unwrap();
    // Someone else takes GPU0 while it sleeps.
    let other = plan(&inv, &ledger, &GpuRequest::whole(1), &policy, &quotas).unwrap();
    commit(&inv, &mut ledger, &other, &policy).unwrap();
    let wake = plan_wake(&inv, &ledger, &ticket, &policy, &quotas, true).unwrap();
    assert_eq!(wake.members[0].shares[0].gpu, GpuIndex(1));
    assert_eq!(
        wake.members[0].request.model.as_deref(),
        Some("NVIDIA A100 80GB PCIe")
    );
    // On a node with no GPU of that model, the wake is refused with a reason.
    let l4 = common::l4();
    let refusal = plan_wake(&l4, &Ledger::new(&l4), &ticket, &policy, &quotas, true).unwrap_err();
    assert_eq!(refusal.code(), "model_not_present");
    assert!(plan_wake(&l4, &Ledger::new(&l4), &ticket, &policy, &quotas, false).is_ok());
}

#[test]
fn a_planned_mps_share_injects_its_limits() {
    let inv = common::l4();
    let mut ledger = Ledger::new(&inv);
    let policy = Policy::default();
    let p = plan(
        &inv,
        &ledger,
        &GpuRequest::mps(30, Some(6000)),
        &policy,
        &QuotaBook::unlimited(),
    )
    .unwrap();
    let id = commit(&inv, &mut ledger, &p, &policy).unwrap()[0];
    let i = injection(
        &inv,
        ledger.allocation(id).unwrap(),
        &MigHandles::new(),
        &InjectConfig::default(),
    )
    .unwrap();
    assert_eq!(
        i.env[NVIDIA_VISIBLE_DEVICES],
        "GPU-14000000-0000-4000-8000-000000000000"
    );
    assert_eq!(i.env[CUDA_MPS_ACTIVE_THREAD_PERCENTAGE], "30");
}

#[test]
fn mig_devices_follow_the_share_through_sleep_and_wake() {
    use torpor_gpu::realize::{realize, unrealize, RecordingMigDriver};
    let inv = common::h200();
    let mut ledger = Ledger::new(&inv);
    let policy = Policy::default();
    let quotas = QuotaBook::unlimited();
    let mut driver = RecordingMigDriver::default();
    let mut handles = MigHandles::new();

    let p = plan(&inv, &ledger, &GpuRequest::mig("1g.18gb"), &policy, &quotas).unwrap();
    let id = commit(&inv, &mut ledger, &p, &policy).unwrap()[0];
    let allocation = ledger.allocation(id).unwrap().clone();
    realize(&inv, &allocation, &mut driver, &mut handles).unwrap();
    let injected = injection(&inv, &allocation, &handles, &InjectConfig::default()).unwrap();
    assert!(injected.env[NVIDIA_VISIBLE_DEVICES].starts_with("MIG-fake-0-"));

    // Sleep: the MIG device is destroyed and the share released.
    unrealize(&inv, &allocation, &mut driver, &mut handles).unwrap();
    let ticket = release_for_sleep(&inv, &mut ledger, id).unwrap();
    assert!(handles.is_empty());

    // Wake: the same placement is planned again and a fresh device created for it.
    let wake = plan_wake(&inv, &ledger, &ticket, &policy, &quotas, true).unwrap();
    let id = commit(&inv, &mut ledger, &wake, &policy).unwrap()[0];
    let allocation = ledger.allocation(id).unwrap().clone();
    realize(&inv, &allocation, &mut driver, &mut handles).unwrap();
    let injected = injection(&inv, &allocation, &handles, &InjectConfig::default()).unwrap();
    assert_eq!(injected.env[NVIDIA_VISIBLE_DEVICES], "MIG-fake-0-1");
    assert_eq!(driver.calls.len(), 3, "create, destroy, create");
}
