//! The allocations on one node and the per-GPU usage they add up to.
//!
//! The ledger is the state the planner reads (as a snapshot) and the only thing that
//! changes when a plan is committed or an allocation released. Every change re-checks the
//! share against its GPU, so a ledger built only through [`Ledger::commit`] and
//! [`Ledger::release`] never holds overlapping or invalid shares; [`Ledger::check`] proves it
//! from scratch for tests and for state read back from storage.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ids::{AllocationId, GpuIndex, TenantId};
use crate::inventory::{Gpu, Inventory};
use std::sync::Arc;

use crate::mig::{MigGeometry, MigInstance, MigLayout, MigPlacementError, MigProfile};
use crate::partition::{ModeChangeError, PartitionMode};
use crate::request::GpuRequest;

/// What one device of an allocation holds on its GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "lowercase")]
pub enum ShareKind {
    Whole,
    Mig {
        #[serde(flatten)]
        instance: MigInstance,
    },
    Mps {
        compute_pct: u32,
        memory_mib: u64,
    },
    Timeslice,
}

impl ShareKind {
    pub fn mode(&self) -> PartitionMode {
        match self {
            ShareKind::Whole => PartitionMode::Whole,
            ShareKind::Mig { .. } => PartitionMode::Mig,
            ShareKind::Mps { .. } => PartitionMode::Mps,
            ShareKind::Timeslice => PartitionMode::Timeslice,
        }
    }
}

/// One device of an allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Share {
    pub gpu: GpuIndex,
    pub kind: ShareKind,
}

/// Shares granted to one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    pub id: AllocationId,
    pub tenant: Option<TenantId>,
    /// The request it answers, kept so that a sandbox can re-acquire after sleeping.
    pub request: GpuRequest,
    pub shares: Vec<Share>,
}

/// Why a share does not fit a GPU as it is now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuReason {
    #[error("no such GPU")]
    UnknownGpu,
    #[error("GPU model {found:?} is not the requested {wanted:?}")]
    ModelMismatch { wanted: String, found: String },
    #[error("GPU is in mode {current} with {shares} share(s); a {wanted} share needs an empty GPU to switch")]
    ModeBusy {
        current: PartitionMode,
        wanted: PartitionMode,
        shares: u32,
    },
    #[error("GPU is in mode {current}; the policy forbids switching it to {wanted}")]
    ModeChangeDisabled {
        current: PartitionMode,
        wanted: PartitionMode,
    },
    #[error("GPU has no MIG or its MIG geometry is unknown")]
    NoMig,
    #[error("profile {profile:?} is unknown for {geometry}")]
    UnknownProfile { profile: String, geometry: String },
    #[error("no MIG profile of {geometry} has {memory_mib} MiB")]
    NoProfileForMemory { memory_mib: u64, geometry: String },
    #[error("no free placement for profile {profile}")]
    MigNoPlacement { profile: String },
    #[error(transparent)]
    MigInvalid(#[from] MigPlacementError),
    #[error("GPU is already held whole")]
    WholeTaken,
    #[error("MPS compute is {used}% used; {wanted}% more does not fit")]
    MpsComputeFull { used: u32, wanted: u32 },
    #[error("MPS pinned memory is {used} of {total} MiB; {wanted} MiB more does not fit")]
    MpsMemoryFull { used: u64, total: u64, wanted: u64 },
    #[error("GPU already has its {max} MPS clients")]
    MpsClientsFull { max: u32 },
    #[error("GPU already has its {max} time-slice replicas")]
    TimesliceFull { max: u32 },
    #[error("GPU has {total} MiB, less than the {wanted} MiB asked")]
    MemoryTooLarge { total: u64, wanted: u64 },
}

impl GpuReason {
    pub fn code(&self) -> &'static str {
        match self {
            GpuReason::UnknownGpu => "gpu_unknown",
            GpuReason::ModelMismatch { .. } => "gpu_model_mismatch",
            GpuReason::ModeBusy { .. } => "gpu_mode_busy",
            GpuReason::ModeChangeDisabled { .. } => "gpu_mode_change_disabled",
            GpuReason::NoMig => "gpu_no_mig",
            GpuReason::UnknownProfile { .. } => "gpu_unknown_profile",
            GpuReason::NoProfileForMemory { .. } => "gpu_no_profile_for_memory",
            GpuReason::MigNoPlacement { .. } => "gpu_mig_no_placement",
            GpuReason::MigInvalid(e) => e.code(),
            GpuReason::WholeTaken => "gpu_whole_taken",
            GpuReason::MpsComputeFull { .. } => "gpu_mps_compute_full",
            GpuReason::MpsMemoryFull { .. } => "gpu_mps_memory_full",
            GpuReason::MpsClientsFull { .. } => "gpu_mps_clients_full",
            GpuReason::TimesliceFull { .. } => "gpu_timeslice_full",
            GpuReason::MemoryTooLarge { .. } => "gpu_memory_too_large",
        }
    }
}

/// What the shares on one GPU add up to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuUsage {
    pub mode: PartitionMode,
    pub shares: u32,
    /// Present while the GPU is in MIG mode.
    pub mig: Option<MigLayout>,
    pub mps_compute_pct: u32,
    pub mps_memory_mib: u64,
}

impl GpuUsage {
    pub fn new(gpu: &Gpu) -> Self {
        let mut usage = GpuUsage {
            mode: PartitionMode::Whole,
            shares: 0,
            mig: None,
            mps_compute_pct: 0,
            mps_memory_mib: 0,
        };
        usage.switch_mode(gpu, gpu.initial_mode);
        usage
    }

    pub fn is_empty(&self) -> bool {
        self.shares == 0
    }

    fn switch_mode(&mut self, gpu: &Gpu, mode: PartitionMode) {
        self.mode = mode;
        self.mig = match (mode, &gpu.mig_geometry) {
            (PartitionMode::Mig, Some(geometry)) => Some(MigLayout::empty(Arc::clone(geometry))),
            _ => None,
        };
    }

    /// Whether `mode` could be used on this GPU now, switching it if it is empty.
    pub fn check_mode(
        &self,
        gpu: &Gpu,
        mode: PartitionMode,
        allow_change: bool,
    ) -> Result<(), GpuReason> {
        if mode == PartitionMode::Mig && !gpu.mig_ready() {
            return Err(GpuReason::NoMig);
        }
        if self.mode == mode {
            return Ok(());
        }
        if !allow_change {
            return Err(GpuReason::ModeChangeDisabled {
                current: self.mode,
                wanted: mode,
            });
        }
        match self
            .mode
            .can_change_to(mode, self.shares as usize, gpu.mig_ready())
        {
            Ok(()) => Ok(()),
            Err(ModeChangeError::MigUnavailable) => Err(GpuReason::NoMig),
            Err(ModeChangeError::NotEmpty { shares, .. }) => Err(GpuReason::ModeBusy {
                current: self.mode,
                wanted: mode,
                shares: shares as u32,
            }),
        }
    }

    /// The MIG layout this GPU would have in MIG mode (empty when it is not in MIG mode).
    pub fn mig_layout(&self, gpu: &Gpu) -> Option<MigLayout> {
        match &self.mig {
            Some(layout) => Some(layout.clone()),
            None => gpu.mig_geometry.clone().map(MigLayout::empty),
        }
    }

    /// Checks that `kind` fits, assuming the mode check passed (an empty GPU in another mode
    /// is treated as empty in the share's mode).
    pub fn check_share(&self, gpu: &Gpu, kind: &ShareKind) -> Result<(), GpuReason> {
        let same_mode = self.mode == kind.mode();
        let shares = if same_mode { self.shares } else { 0 };
        match kind {
            ShareKind::Whole => {
                if shares > 0 {
                    return Err(GpuReason::WholeTaken);
                }
            }
            ShareKind::Mig { instance } => match (same_mode, &self.mig, &gpu.mig_geometry) {
                (true, Some(layout), _) => layout.check(*instance)?,
                (_, _, Some(geometry)) => {
                    MigLayout::empty(Arc::clone(geometry)).check(*instance)?
                }
                _ => return Err(GpuReason::NoMig),
            },
            ShareKind::Mps {
                compute_pct,
                memory_mib,
            } => {
                let (used_pct, used_mem) = if same_mode {
                    (self.mps_compute_pct, self.mps_memory_mib)
                } else {
                    (0, 0)
                };
                if shares >= gpu.mps_max_clients {
                    return Err(GpuReason::MpsClientsFull {
                        max: gpu.mps_max_clients,
                    });
                }
                if used_pct + compute_pct > 100 {
                    return Err(GpuReason::MpsComputeFull {
                        used: used_pct,
                        wanted: *compute_pct,
                    });
                }
                if used_mem + memory_mib > gpu.memory_mib {
                    return Err(GpuReason::MpsMemoryFull {
                        used: used_mem,
                        total: gpu.memory_mib,
                        wanted: *memory_mib,
                    });
                }
            }
            ShareKind::Timeslice => {
                if shares >= gpu.timeslice_replicas {
                    return Err(GpuReason::TimesliceFull {
                        max: gpu.timeslice_replicas,
                    });
                }
            }
        }
        Ok(())
    }

    /// Adds a share after checking it; switches the mode of an empty GPU when `allow_change`.
    pub fn add(
        &mut self,
        gpu: &Gpu,
        kind: &ShareKind,
        allow_change: bool,
    ) -> Result<(), GpuReason> {
        self.check_mode(gpu, kind.mode(), allow_change)?;
        self.check_share(gpu, kind)?;
        if self.mode != kind.mode() {
            self.switch_mode(gpu, kind.mode());
        }
        match kind {
            ShareKind::Mig { instance } => {
                self.mig
                    .as_mut()
                    .ok_or(GpuReason::NoMig)?
                    .place(*instance)?;
            }
            ShareKind::Mps {
                compute_pct,
                memory_mib,
            } => {
                self.mps_compute_pct += compute_pct;
                self.mps_memory_mib += memory_mib;
            }
            ShareKind::Whole | ShareKind::Timeslice => {}
        }
        self.shares += 1;
        Ok(())
    }

    /// Removes a share that [`GpuUsage::add`] accepted; `false` when it is not there.
    pub fn remove(&mut self, kind: &ShareKind) -> bool {
        if self.mode != kind.mode() || self.shares == 0 {
            return false;
        }
        match kind {
            ShareKind::Mig { instance } => {
                if !self.mig.as_mut().is_some_and(|l| l.remove(*instance)) {
                    return false;
                }
            }
            ShareKind::Mps {
                compute_pct,
                memory_mib,
            } => {
                if self.mps_compute_pct < *compute_pct || self.mps_memory_mib < *memory_mib {
                    return false;
                }
                self.mps_compute_pct -= compute_pct;
                self.mps_memory_mib -= memory_mib;
            }
            ShareKind::Whole | ShareKind::Timeslice => {}
        }
        self.shares -= 1;
        true
    }

    /// How full the GPU is, in thousandths: the planner's binpack and spread key.
    pub fn fill_permille(&self, gpu: &Gpu) -> u32 {
        match self.mode {
            PartitionMode::Whole => 1000 * self.shares.min(1),
            PartitionMode::Mig => self.mig.as_ref().map_or(0, |l| {
                u32::from(crate::mig::MEMORY_SLICES - l.free_memory_slices()) * 1000
                    / u32::from(crate::mig::MEMORY_SLICES)
            }),
            PartitionMode::Mps => {
                let compute = self.mps_compute_pct * 10;
                let memory = (self.mps_memory_mib * 1000 / gpu.memory_mib.max(1)) as u32;
                compute.max(memory)
            }
            PartitionMode::Timeslice => self.shares * 1000 / gpu.timeslice_replicas.max(1),
        }
    }
}

/// Resolves a MIG profile of a geometry: by name or id, or the smallest with `memory_mib`.
pub fn resolve_profile<'g>(
    geometry: &'g MigGeometry,
    profile: Option<&str>,
    memory_mib: Option<u64>,
    gpu_memory_mib: u64,
) -> Result<&'g MigProfile, GpuReason> {
    match (profile, memory_mib) {
        (Some(name), _) => geometry
            .profile(name)
            .ok_or_else(|| GpuReason::UnknownProfile {
                profile: name.to_owned(),
                geometry: geometry.label().to_owned(),
            }),
        (None, wanted) => geometry
            .profiles()
            .iter()
            .filter(|p| {
                !p.media_extensions() && p.memory_mib(gpu_memory_mib) >= wanted.unwrap_or(0)
            })
            .min_by_key(|p| (p.memory_slices, p.sm_slices, p.id))
            .ok_or_else(|| GpuReason::NoProfileForMemory {
                memory_mib: wanted.unwrap_or(0),
                geometry: geometry.label().to_owned(),
            }),
    }
}

/// Why the ledger refused a change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    #[error("no allocation {id}")]
    UnknownAllocation { id: AllocationId },
    #[error("{gpu}: {reason}")]
    Share { gpu: GpuIndex, reason: GpuReason },
    #[error("{gpu}: {source}")]
    ModeChange {
        gpu: GpuIndex,
        #[source]
        source: ModeChangeError,
    },
    #[error("allocation {id}: share on {gpu} is not recorded there")]
    Inconsistent { id: AllocationId, gpu: GpuIndex },
    #[error("{gpu}: recorded usage differs from the sum of its allocations")]
    UsageMismatch { gpu: GpuIndex },
}

impl LedgerError {
    pub fn code(&self) -> &'static str {
        match self {
            LedgerError::UnknownAllocation { .. } => "ledger_unknown_allocation",
            LedgerError::Share { reason, .. } => reason.code(),
            LedgerError::ModeChange { source, .. } => source.code(),
            LedgerError::Inconsistent { .. } => "ledger_inconsistent",
            LedgerError::UsageMismatch { .. } => "ledger_usage_mismatch",
        }
    }
}

/// Allocations and per-GPU usage of one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ledger {
    next_id: u64,
    allocations: BTreeMap<AllocationId, Allocation>,
    usage: Vec<GpuUsage>,
}

impl Ledger {
    /// An empty ledger for `inventory`, each GPU in its initial mode.
    pub fn new(inventory: &Inventory) -> Self {
        Ledger {
            next_id: 1,
            allocations: BTreeMap::new(),
            usage: inventory.gpus().iter().map(GpuUsage::new).collect(),
        }
    }

    pub fn usage(&self) -> &[GpuUsage] {
        &self.usage
    }

    pub fn allocations(&self) -> impl Iterator<Item = &Allocation> {
        self.allocations.values()
    }

    pub fn allocation(&self, id: AllocationId) -> Option<&Allocation> {
        self.allocations.get(&id)
    }

    /// Switches an empty GPU's mode (what an operator does with `nvidia-smi -mig 1`).
    pub fn set_mode(
        &mut self,
        inventory: &Inventory,
        gpu: GpuIndex,
        mode: PartitionMode,
    ) -> Result<(), LedgerError> {
        let (Some(g), Some(usage)) = (inventory.gpu(gpu), self.usage.get_mut(gpu.0 as usize))
        else {
            return Err(LedgerError::Share {
                gpu,
                reason: GpuReason::UnknownGpu,
            });
        };
        usage
            .mode
            .can_change_to(mode, usage.shares as usize, g.mig_ready())
            .map_err(|source| LedgerError::ModeChange { gpu, source })?;
        if usage.mode != mode {
            usage.switch_mode(g, mode);
        }
        Ok(())
    }

    /// Records an allocation of `shares` for `request`, checking every share; all or nothing.
    pub fn insert(
        &mut self,
        inventory: &Inventory,
        request: GpuRequest,
        shares: Vec<Share>,
        allow_mode_change: bool,
    ) -> Result<AllocationId, LedgerError> {
        let mut usage = self.usage.clone();
        for share in &shares {
            let gpu = inventory.gpu(share.gpu).ok_or(LedgerError::Share {
                gpu: share.gpu,
                reason: GpuReason::UnknownGpu,
            })?;
            usage
                .get_mut(share.gpu.0 as usize)
                .ok_or(LedgerError::Share {
                    gpu: share.gpu,
                    reason: GpuReason::UnknownGpu,
                })?
                .add(gpu, &share.kind, allow_mode_change)
                .map_err(|reason| LedgerError::Share {
                    gpu: share.gpu,
                    reason,
                })?;
        }
        self.usage = usage;
        let id = AllocationId(self.next_id);
        self.next_id += 1;
        self.allocations.insert(
            id,
            Allocation {
                id,
                tenant: request.tenant.clone(),
                request,
                shares,
            },
        );
        Ok(id)
    }

    /// Releases an allocation and gives its capacity back. The GPU keeps its mode.
    pub fn release(&mut self, id: AllocationId) -> Result<Allocation, LedgerError> {
        let allocation = self
            .allocations
            .get(&id)
            .ok_or(LedgerError::UnknownAllocation { id })?;
        let mut usage = self.usage.clone();
        for share in &allocation.shares {
            let ok = usage
                .get_mut(share.gpu.0 as usize)
                .is_some_and(|u| u.remove(&share.kind));
            if !ok {
                return Err(LedgerError::Inconsistent { id, gpu: share.gpu });
            }
        }
        self.usage = usage;
        self.allocations
            .remove(&id)
            .ok_or(LedgerError::UnknownAllocation { id })
    }

    /// Rebuilds usage from the allocations alone and compares: proves that no share overlaps
    /// another and that every share is valid for its GPU's geometry and limits.
    pub fn check(&self, inventory: &Inventory) -> Result<(), LedgerError> {
        let mut rebuilt: Vec<GpuUsage> = inventory.gpus().iter().map(GpuUsage::new).collect();
        for (usage, now) in rebuilt.iter_mut().zip(&self.usage) {
            if now.is_empty() {
                usage.mode = now.mode;
                usage.mig = now.mig.clone();
            }
        }
        for allocation in self.allocations.values() {
            for share in &allocation.shares {
                let gpu = inventory.gpu(share.gpu).ok_or(LedgerError::Share {
                    gpu: share.gpu,
                    reason: GpuReason::UnknownGpu,
                })?;
                rebuilt[share.gpu.0 as usize]
                    .add(gpu, &share.kind, true)
                    .map_err(|reason| LedgerError::Share {
                        gpu: share.gpu,
                        reason,
                    })?;
            }
        }
        for (i, (rebuilt, now)) in rebuilt.iter().zip(&self.usage).enumerate() {
            if rebuilt != now {
                return Err(LedgerError::UsageMismatch {
                    gpu: GpuIndex(i as u32),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::Inventory;

    fn h200() -> Inventory {
        Inventory::from_toml(
            r#"
node = "n"
[[gpu]]
index = 0
uuid = "GPU-0"
model = "NVIDIA H200"
memory_mib = 143771
mig_capable = true
pci_bus_id = "0000:19:00.0"
"#,
            "t.toml",
        )
        .unwrap()
    }

    fn mig(profile_id: u32, start: u8) -> Share {
        Share {
            gpu: GpuIndex(0),
            kind: ShareKind::Mig {
                instance: MigInstance { profile_id, start },
            },
        }
    }

    #[test]
    fn insert_checks_and_release_restores() {
        let inv = h200();
        let mut ledger = Ledger::new(&inv);
        let empty = ledger.clone();
        let a = ledger
            .insert(&inv, GpuRequest::mig("3g.71gb"), vec![mig(9, 4)], true)
            .unwrap();
        assert_eq!(ledger.usage()[0].mode, PartitionMode::Mig);
        let err = ledger
            .insert(
                &inv,
                GpuRequest::mig("4g.71gb"),
                vec![mig(5, 0), mig(9, 4)],
                true,
            )
            .unwrap_err();
        assert_eq!(err.code(), "mig_overlap");
        // the failed insert changed nothing
        assert_eq!(ledger.allocations().count(), 1);
        let busy = ledger
            .insert(
                &inv,
                GpuRequest::whole(1),
                vec![Share {
                    gpu: GpuIndex(0),
                    kind: ShareKind::Whole,
                }],
                true,
            )
            .unwrap_err();
        assert_eq!(busy.code(), "gpu_mode_busy");
        ledger.check(&inv).unwrap();
        ledger.release(a).unwrap();
        assert_eq!(ledger.usage()[0].shares, 0);
        assert_eq!(ledger.usage()[0].mig.as_ref().unwrap().occupied(), 0);
        assert_ne!(
            ledger.usage()[0].mode,
            empty.usage()[0].mode,
            "mode is kept"
        );
        assert_eq!(
            ledger.release(a).unwrap_err().code(),
            "ledger_unknown_allocation"
        );
    }

    #[test]
    fn mps_limits_compute_memory_and_clients() {
        let inv = h200();
        let mut ledger = Ledger::new(&inv);
        let share = |pct, mem| Share {
            gpu: GpuIndex(0),
            kind: ShareKind::Mps {
                compute_pct: pct,
                memory_mib: mem,
            },
        };
        ledger
            .insert(
                &inv,
                GpuRequest::mps(60, None),
                vec![share(60, 100_000)],
                true,
            )
            .unwrap();
        let e = ledger
            .insert(&inv, GpuRequest::mps(50, None), vec![share(50, 1)], true)
            .unwrap_err();
        assert_eq!(e.code(), "gpu_mps_compute_full");
        let e = ledger
            .insert(
                &inv,
                GpuRequest::mps(10, None),
                vec![share(10, 50_000)],
                true,
            )
            .unwrap_err();
        assert_eq!(e.code(), "gpu_mps_memory_full");
        ledger.check(&inv).unwrap();
    }

    #[test]
    fn set_mode_only_when_empty() {
        let inv = h200();
        let mut ledger = Ledger::new(&inv);
        ledger
            .set_mode(&inv, GpuIndex(0), PartitionMode::Timeslice)
            .unwrap();
        let id = ledger
            .insert(
                &inv,
                GpuRequest::timeslice(),
                vec![Share {
                    gpu: GpuIndex(0),
                    kind: ShareKind::Timeslice,
                }],
                false,
            )
            .unwrap();
        let e = ledger
            .set_mode(&inv, GpuIndex(0), PartitionMode::Mig)
            .unwrap_err();
        assert_eq!(e.code(), "mode_change_not_empty");
        ledger.release(id).unwrap();
        ledger
            .set_mode(&inv, GpuIndex(0), PartitionMode::Mig)
            .unwrap();
        assert_eq!(
            ledger
                .set_mode(&inv, GpuIndex(3), PartitionMode::Mig)
                .unwrap_err()
                .code(),
            "gpu_unknown"
        );
    }

    #[test]
    fn resolves_profiles_by_memory() {
        let m = &*crate::mig::MigModel::H200Gb141.geometry();
        assert_eq!(
            resolve_profile(m, None, Some(17_000), 143771).unwrap().name,
            "1g.18gb"
        );
        assert_eq!(
            resolve_profile(m, None, Some(20_000), 143771).unwrap().name,
            "1g.35gb"
        );
        assert_eq!(
            resolve_profile(m, None, Some(60_000), 143771).unwrap().name,
            "3g.71gb"
        );
        assert_eq!(
            resolve_profile(m, None, Some(200_000), 143771)
                .unwrap_err()
                .code(),
            "gpu_no_profile_for_memory"
        );
        assert_eq!(
            resolve_profile(m, Some("3g.40gb"), None, 143771)
                .unwrap_err()
                .code(),
            "gpu_unknown_profile"
        );
    }
}
