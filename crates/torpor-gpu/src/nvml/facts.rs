//! The pure half's input: what NVML says about each GPU ([`DeviceFacts`]) and each pair
//! ([`PairFacts`]), and [`inventory_from_facts`], which builds the node's inventory and
//! topology from them. Tested without a GPU.

use std::sync::Arc;

use super::profiles::{driver_geometry, placements_match_table, DriverProfile};
use super::SOURCE;
use crate::ids::{GpuIndex, GpuUuid, NodeName};
use crate::inventory::{
    Gpu, Inventory, InventoryError, DEFAULT_MPS_MAX_CLIENTS, DEFAULT_TIMESLICE_REPLICAS,
};
use crate::mig::MigModel;
use crate::partition::PartitionMode;
use crate::topology::{Link, TopologyMatrix};

/// What NVML says about one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFacts {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_total_bytes: u64,
    /// `None` when MIG is not supported; `Some(enabled)` otherwise.
    pub mig_enabled: Option<bool>,
    pub numa_node: Option<u32>,
    pub pci_bus_id: String,
    pub minor: u32,
    /// MIG profiles and placements the driver lists, when MIG is enabled.
    pub mig_placements: Option<Vec<DriverProfile>>,
}

/// NVML's common-ancestor levels (`nvmlGpuTopologyLevel_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ancestor {
    Internal,
    Single,
    Multiple,
    HostBridge,
    Node,
    System,
}

/// What NVML says about a pair of GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PairFacts {
    /// NVLinks between the two (direct bridges, or all of a GPU's links behind NVSwitch).
    pub nvlinks: u16,
    pub ancestor: Ancestor,
}

/// The `nvidia-smi topo -m` cell for a pair.
pub fn link_of(pair: PairFacts) -> Link {
    if pair.nvlinks > 0 {
        return Link::NvLink(pair.nvlinks);
    }
    match pair.ancestor {
        // Two GPUs on one board sit behind one switch: no closer PCIe relation exists.
        Ancestor::Internal | Ancestor::Single => Link::Pix,
        Ancestor::Multiple => Link::Pxb,
        Ancestor::HostBridge => Link::Phb,
        Ancestor::Node => Link::Node,
        Ancestor::System => Link::Sys,
    }
}

/// Builds an inventory from NVML facts; `pair(a, b)` is asked for `a < b` only.
pub fn inventory_from_facts(
    node: NodeName,
    devices: Vec<DeviceFacts>,
    mut pair: impl FnMut(usize, usize) -> PairFacts,
) -> Result<Inventory, InventoryError> {
    let mut gpus = Vec::with_capacity(devices.len());
    for (i, d) in devices.iter().enumerate() {
        let uuid = GpuUuid::new(d.uuid.clone()).map_err(|source| InventoryError::BadId {
            file: SOURCE.to_owned(),
            field: format!("gpu[{i}].uuid"),
            source,
        })?;
        let memory_mib = d.memory_total_bytes / (1024 * 1024);
        let mig_capable = d.mig_enabled.is_some();
        // Placements come from the driver; the table is the fallback, and is used (with its
        // profile names) where the driver agrees with it or lists nothing.
        let detected = if mig_capable {
            MigModel::detect(&d.name, memory_mib)
        } else {
            None
        };
        let (mig_model, mig_geometry) = match (detected, &d.mig_placements) {
            (Some(model), None) => (Some(model), Some(model.geometry())),
            (Some(model), Some(driver)) if placements_match_table(model, driver).is_empty() => {
                (Some(model), Some(model.geometry()))
            }
            (_, Some(driver)) if mig_capable => {
                (None, driver_geometry(&d.name, driver).ok().map(Arc::new))
            }
            _ => (None, None),
        };
        // The hardware's mode, even without usable geometry: leaving MIG is then a mode change
        // the plan reports, and MIG shares are refused.
        let initial_mode = match d.mig_enabled {
            Some(true) => PartitionMode::Mig,
            _ => PartitionMode::Whole,
        };
        gpus.push(Gpu {
            index: GpuIndex(d.index),
            uuid,
            model: d.name.clone(),
            memory_mib,
            mig_capable,
            mig_model,
            mig_geometry,
            numa_node: d.numa_node,
            pci_bus_id: d.pci_bus_id.clone(),
            minor: d.minor,
            initial_mode,
            mps_max_clients: DEFAULT_MPS_MAX_CLIENTS,
            timeslice_replicas: DEFAULT_TIMESLICE_REPLICAS,
        });
    }
    let topology = TopologyMatrix::from_fn(devices.len(), |a, b| link_of(pair(a, b)));
    Inventory::new(node, gpus, Some(topology), SOURCE)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::nvml::profiles::tests::dp;

    pub(in crate::nvml) fn facts(
        index: u32,
        name: &str,
        mib: u64,
        mig: Option<bool>,
        numa: u32,
    ) -> DeviceFacts {
        DeviceFacts {
            index,
            uuid: format!("GPU-{index:04}"),
            name: name.to_owned(),
            memory_total_bytes: mib * 1024 * 1024,
            mig_enabled: mig,
            numa_node: Some(numa),
            pci_bus_id: format!("00000000:{:02x}:00.0", 0x17 + index),
            minor: index,
            mig_placements: None,
        }
    }

    #[test]
    fn facts_make_the_pcie_a100_inventory() {
        let devices = (0..4)
            .map(|i| facts(i, "NVIDIA A100 80GB PCIe", 81920, Some(i == 3), i / 2))
            .collect();
        let inv = inventory_from_facts(NodeName::new("n").unwrap(), devices, |a, b| PairFacts {
            nvlinks: if a / 2 == b / 2 { 12 } else { 0 },
            ancestor: Ancestor::System,
        })
        .unwrap();
        // Compiled in: the repository carries the fixture, and the test reads no file.
        let fixture = Inventory::from_toml(
            include_str!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../fixtures/gpu/pcie-a100-4.toml"
            )),
            "pcie-a100-4.toml",
        )
        .unwrap();
        assert_eq!(inv.topology(), fixture.topology());
        assert_eq!(inv.link(GpuIndex(0), GpuIndex(1)), Some(Link::NvLink(12)));
        assert_eq!(inv.gpus()[0].mig_model, Some(MigModel::A100Gb80));
        assert_eq!(inv.gpus()[0].initial_mode, PartitionMode::Whole);
        assert_eq!(inv.gpus()[3].initial_mode, PartitionMode::Mig);
    }

    #[test]
    fn driver_placements_win_over_the_table() {
        let mut good = facts(0, "NVIDIA H100 80GB HBM3", 81559, Some(true), 0);
        good.mig_placements = Some(vec![dp(9, &[0, 4], 4, 3), dp(0, &[0], 8, 7)]);
        let mut odd = facts(1, "NVIDIA H100 80GB HBM3", 81559, Some(true), 0);
        odd.mig_placements = Some(vec![dp(9, &[0], 4, 3), dp(19, &[0, 1, 2, 3], 1, 1)]);
        let mut a30 = facts(2, "NVIDIA A30", 24576, Some(true), 0);
        a30.mig_placements = Some(vec![
            dp(14, &[0, 1, 2, 3], 1, 1),
            dp(5, &[0, 2], 2, 2),
            dp(0, &[0], 4, 4),
        ]);
        let mut broken = facts(3, "NVIDIA A30", 24576, Some(true), 0);
        broken.mig_placements = Some(vec![dp(0, &[6], 4, 4)]);
        let inv = inventory_from_facts(
            NodeName::new("n").unwrap(),
            vec![good, odd, a30, broken],
            |_, _| PairFacts {
                nvlinks: 0,
                ancestor: Ancestor::System,
            },
        )
        .unwrap();
        let g = inv.gpus();
        assert_eq!(g[0].mig_model, Some(MigModel::H100Gb80));
        assert_eq!(g[0].mig_geometry.as_deref().unwrap().label(), "H100-80GB");
        assert_eq!(
            g[1].mig_model, None,
            "the driver disagrees: its placements are used"
        );
        let odd_geometry = g[1].mig_geometry.as_deref().unwrap();
        assert_eq!(odd_geometry.profile("9").unwrap().allowed_starts, [0]);
        assert_eq!(odd_geometry.profile("9").unwrap().name, "3g.24gb");
        assert_eq!(g[2].mig_geometry.as_deref().unwrap().label(), "NVIDIA A30");
        assert!(
            g[3].mig_geometry.is_none(),
            "an invalid driver geometry gives no MIG"
        );
        assert_eq!(g[3].initial_mode, PartitionMode::Mig, "the hardware's mode");

        let mut ledger = crate::ledger::Ledger::new(&inv);
        let policy = crate::planner::Policy::default();
        let quotas = crate::quota::QuotaBook::unlimited();
        // On GPU1 the driver allows the 3g at 0 only, where the table would also allow 4.
        let three = crate::request::GpuRequest {
            model: Some("NVIDIA H100 80GB HBM3".into()),
            ..crate::request::GpuRequest::mig("9")
        };
        for expected in [(0, 4), (0, 0), (1, 0)] {
            let p = crate::planner::plan(&inv, &ledger, &three, &policy, &quotas).unwrap();
            let s = *p.shares().next().unwrap();
            let crate::ledger::ShareKind::Mig { instance } = s.kind else {
                panic!("{s:?}")
            };
            assert_eq!((s.gpu.0, instance.start), expected);
            crate::planner::commit(&inv, &mut ledger, &p, &policy).unwrap();
        }
        // The A30 takes profiles by the driver's ids and synthesised names.
        let two = crate::request::GpuRequest::mig("2g.12gb");
        let p = crate::planner::plan(&inv, &ledger, &two, &policy, &quotas).unwrap();
        assert_eq!(p.shares().next().unwrap().gpu, GpuIndex(2));
        let charge = crate::quota::share_charge(&g[2], &p.shares().next().unwrap().kind);
        assert_eq!(charge.compute, 350, "2 of the A30's 4 SM slices");
        assert_eq!(charge.memory_mib, 12032, "the driver's memory");
        ledger.check(&inv).unwrap();
        // GPU3 (MIG on, geometry unusable) can still leave MIG when asked for whole.
        let whole = crate::request::GpuRequest {
            model: Some("NVIDIA A30".into()),
            ..crate::request::GpuRequest::whole(2)
        };
        let p = crate::planner::plan(&inv, &ledger, &whole, &policy, &quotas).unwrap();
        let changed: Vec<u32> = p.mode_changes.iter().map(|c| c.gpu.0).collect();
        assert_eq!(changed, [2, 3]);
    }

    #[test]
    fn ancestors_map_to_topo_cells() {
        let cell = |ancestor| {
            link_of(PairFacts {
                nvlinks: 0,
                ancestor,
            })
        };
        assert_eq!(cell(Ancestor::Single), Link::Pix);
        assert_eq!(cell(Ancestor::Multiple), Link::Pxb);
        assert_eq!(cell(Ancestor::HostBridge), Link::Phb);
        assert_eq!(cell(Ancestor::Node), Link::Node);
        assert_eq!(cell(Ancestor::System), Link::Sys);
        let l4 = vec![
            facts(0, "NVIDIA L4", 23034, None, 0),
            facts(1, "NVIDIA L4", 23034, None, 0),
        ];
        let inv = inventory_from_facts(NodeName::new("n").unwrap(), l4, |_, _| PairFacts {
            nvlinks: 0,
            ancestor: Ancestor::HostBridge,
        })
        .unwrap();
        assert!(!inv.gpus()[0].mig_capable);
        assert_eq!(inv.link(GpuIndex(1), GpuIndex(0)), Some(Link::Phb));
    }

    #[test]
    fn bad_nvml_uuids_are_refused() {
        let mut d = facts(0, "NVIDIA L4", 23034, None, 0);
        d.uuid = "garbage".into();
        let err = inventory_from_facts(NodeName::new("n").unwrap(), vec![d], |_, _| PairFacts {
            nvlinks: 0,
            ancestor: Ancestor::System,
        })
        .unwrap_err();
        assert_eq!(err.code(), "inventory_bad_id");
        assert!(err.to_string().starts_with("nvml: gpu[0].uuid"));
    }
}
