//! The NVML path. Without a driver NVML must fail cleanly; with one (run the ignored test
//! through scripts/gpu-check.sh) the inventory, MIG placements and metrics are checked.
#![cfg(feature = "nvml")]

use torpor_gpu::ids::NodeName;
use torpor_gpu::ledger::Ledger;
use torpor_gpu::mig::MigModel;
use torpor_gpu::nvml::driver::{mig_placements, open, read_inventory, sample};
use torpor_gpu::nvml::{dcgm_metrics, placements_match_table};
use torpor_gpu::partition::PartitionMode;
use torpor_gpu::report::inventory_table;

#[test]
fn nvml_without_a_driver_is_an_error_not_a_crash() {
    if let Err(e) = open() {
        assert_eq!(e.code(), "nvml_unavailable");
        assert!(e.to_string().contains("NVML is not available"));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU and driver"]
fn nvml_inventory_mig_placements_and_metrics() {
    let nvml = open().expect("NVML");
    let inv = read_inventory(&nvml, NodeName::new("gpu-check").unwrap()).expect("inventory");
    assert!(!inv.gpus().is_empty());
    println!("{}", inventory_table(&inv, &Ledger::new(&inv)));
    println!("{}", inv.topology().render());
    for gpu in inv.gpus() {
        assert!(gpu.memory_mib > 0);
        let table = MigModel::detect(&gpu.model, gpu.memory_mib);
        match (table, gpu.initial_mode) {
            (Some(model), PartitionMode::Mig) => {
                let placements = mig_placements(&nvml, gpu.index.0).expect("placements");
                println!("{}: {model}: {placements:?}", gpu.index);
                assert!(
                    !placements.is_empty(),
                    "MIG is on, the driver lists profiles"
                );
                let diff = placements_match_table(model, &placements);
                assert!(
                    diff.is_empty(),
                    "{}: driver and table differ: {diff:?}",
                    gpu.index
                );
                assert_eq!(
                    gpu.mig_model,
                    Some(model),
                    "the table is used where it agrees"
                );
            }
            (Some(model), _) => println!("{}: {model}, MIG off: placements not checked", gpu.index),
            (None, _) => println!(
                "{}: {} has no MIG table; geometry from the driver: {:?}",
                gpu.index,
                gpu.model,
                gpu.mig_geometry.as_deref().map(|g| g.profiles().len())
            ),
        }
    }
    let text = dcgm_metrics("gpu-check", &sample(&nvml).expect("samples"));
    println!("{text}");
    assert!(text.contains("DCGM_FI_DEV_FB_USED{gpu=\"0\""), "{text}");
}

#[test]
#[ignore = "needs an NVIDIA GPU and driver"]
fn nvml_xid_watch_and_tensor_active() {
    use torpor_gpu::nvml::driver::{sample_with, tensor_active, watch_xids};
    let nvml: &'static torpor_gpu::nvml::driver::Nvml = Box::leak(Box::new(open().expect("NVML")));
    let xids = watch_xids(nvml);
    let tensor = tensor_active(nvml, std::time::Duration::from_millis(200));
    let samples = sample_with(nvml, Some(&xids), &tensor).expect("samples");
    for s in samples.iter().filter(|s| s.mig.is_none()) {
        println!(
            "GPU {} {}: xid {:?}, tensor active {:?}",
            s.gpu, s.model_name, s.xid_last, s.tensor_active
        );
        if let Some(t) = s.tensor_active {
            assert!((0.0..=1.0).contains(&t), "{t}");
        }
        // Hopper and newer have GPM: the tensor metric must be there.
        if ["H100", "H200", "H20", "GH200", "B200"]
            .iter()
            .any(|m| s.model_name.contains(m))
        {
            assert!(s.tensor_active.is_some(), "{} has GPM", s.model_name);
        }
    }
    let text = dcgm_metrics("gpu-check", &samples);
    if samples.iter().any(|s| s.xid_last.is_some()) {
        assert!(text.contains("DCGM_FI_DEV_XID_ERRORS{gpu=\"0\""), "{text}");
    }
}

/// Creates a MIG instance through NVML on the first GPU in MIG mode (root needed), checks its
/// UUID against NVML's MIG devices, destroys it; on a GPU with MIG mode off the driver must
/// refuse with `nvml_mig_mode_off`.
#[test]
#[ignore = "needs an NVIDIA GPU, its driver and root"]
fn nvml_mig_instances_are_created_and_destroyed() {
    use torpor_gpu::mig::MigInstance;
    use torpor_gpu::nvml::driver::NvmlMigDriver;
    use torpor_gpu::realize::MigDriver;
    let nvml: &'static torpor_gpu::nvml::driver::Nvml = Box::leak(Box::new(open().expect("NVML")));
    let inv = read_inventory(nvml, NodeName::new("gpu-check").unwrap()).expect("inventory");
    let mut driver = NvmlMigDriver::new(nvml);
    let mut checked = false;
    for gpu in inv.gpus() {
        let Some(geometry) = gpu.mig_geometry.as_deref() else {
            continue;
        };
        // The smallest profile at its last allowed start (least likely to be in use).
        let profile = geometry
            .profiles()
            .iter()
            .min_by_key(|p| (p.memory_slices, p.id))
            .expect("profiles");
        let instance = MigInstance {
            profile_id: profile.id,
            start: *profile.allowed_starts.last().unwrap(),
        };
        match (gpu.initial_mode, driver.create(gpu, instance)) {
            (PartitionMode::Mig, Ok(device)) => {
                println!("{}: created {} {device:?}", gpu.index, profile.name);
                assert!(device.uuid.as_str().starts_with("MIG-"));
                let listed = sample(nvml).expect("samples");
                assert!(
                    listed.iter().any(|s| s.uuid == device.uuid.as_str()),
                    "NVML lists the new MIG device"
                );
                driver.destroy(gpu, &device).expect("destroy");
                let listed = sample(nvml).expect("samples");
                assert!(!listed.iter().any(|s| s.uuid == device.uuid.as_str()));
                checked = true;
            }
            (PartitionMode::Mig, Err(e)) => {
                println!(
                    "{}: cannot create {} at {}: {e}",
                    gpu.index, profile.name, instance.start
                );
                assert!(
                    format!("{e:?}").contains("nvml_insufficient_resources")
                        || format!("{e:?}").contains("nvml_in_use"),
                    "{e:?}"
                );
            }
            (_, Err(e)) => {
                println!("{}: MIG off: {e}", gpu.index);
                assert!(format!("{e:?}").contains("nvml_mig_mode_off"), "{e:?}");
                checked = true;
            }
            (_, Ok(device)) => panic!("created {device:?} on a GPU with MIG mode off"),
        }
    }
    assert!(checked || inv.gpus().iter().all(|g| g.mig_geometry.is_none()));
}
