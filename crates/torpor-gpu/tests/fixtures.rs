//! Every declared inventory in fixtures/gpu must load, with the facts it declares.

use std::path::PathBuf;

use torpor_gpu::ids::GpuIndex;
use torpor_gpu::inventory::Inventory;
use torpor_gpu::mig::MigModel;
use torpor_gpu::topology::Link;

fn fixtures_dir() -> PathBuf {
    // The fixtures are the repository's `fixtures/gpu` (copied from the shared reference data).
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|d| d.join("fixtures/gpu"))
        .find(|d| d.is_dir())
        .expect("fixtures/gpu of the repository above the crate")
}

fn load(name: &str) -> Inventory {
    let path = fixtures_dir().join(name);
    Inventory::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn every_fixture_loads() {
    let mut seen = 0;
    for entry in std::fs::read_dir(fixtures_dir()).expect("fixtures directory") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let inv = Inventory::load(&path).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(inv.topology().size(), inv.gpus().len());
            seen += 1;
        }
    }
    assert!(seen >= 3, "found only {seen} fixtures");
}

#[test]
fn hgx_h200_is_eight_nvlinked_h200s_on_two_numa_nodes() {
    let inv = load("hgx-h200-8.toml");
    assert_eq!(inv.node.as_str(), "hgx-h200-01");
    assert_eq!(inv.gpus().len(), 8);
    for g in inv.gpus() {
        assert_eq!(g.mig_model, Some(MigModel::H200Gb141));
        assert_eq!(g.memory_mib, 143771);
        assert_eq!(g.numa_node, Some(g.index.0 / 4));
    }
    assert_eq!(inv.link(GpuIndex(0), GpuIndex(7)), Some(Link::NvLink(18)));
    assert!(inv.pair_score(GpuIndex(0), GpuIndex(1)) > inv.pair_score(GpuIndex(0), GpuIndex(4)));
}

#[test]
fn pcie_a100_has_nvlink_pairs() {
    let inv = load("pcie-a100-4.toml");
    assert!(inv
        .gpus()
        .iter()
        .all(|g| g.mig_model == Some(MigModel::A100Gb80)));
    assert!(inv.nvlinked(GpuIndex(0), GpuIndex(1)));
    assert!(inv.nvlinked(GpuIndex(2), GpuIndex(3)));
    assert!(!inv.nvlinked(GpuIndex(1), GpuIndex(2)));
    assert_eq!(inv.pair_score(GpuIndex(0), GpuIndex(1)), 1220);
    assert_eq!(inv.pair_score(GpuIndex(0), GpuIndex(2)), 10);
}

#[test]
fn l4_has_no_mig() {
    let inv = load("l4-2.toml");
    assert!(inv
        .gpus()
        .iter()
        .all(|g| !g.mig_capable && g.mig_model.is_none()));
    assert_eq!(inv.link(GpuIndex(0), GpuIndex(1)), Some(Link::Phb));
}
