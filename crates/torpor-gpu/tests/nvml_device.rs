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
