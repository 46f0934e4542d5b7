//! Turning planned MIG shares into driver objects, and back.
//!
//! A committed allocation says "profile 9 at slice 4 on GPU 0"; a sandbox needs the MIG
//! device that the driver creates for it (its `MIG-…` UUID goes into `NVIDIA_VISIBLE_DEVICES`).
//! Creating and destroying instances is privileged device work, so it sits behind
//! [`MigDriver`]; [`RecordingMigDriver`] is the fake the tests use. [`realize`] creates every MIG
//! share of an allocation or none (what it created is destroyed again when one fails);
//! [`unrealize`] destroys them when the allocation is released (sleep, delete, eviction).
//! The NVML implementation is `nvml::driver::NvmlMigDriver` (feature `nvml`).

use crate::ids::{GpuIndex, MigUuid};
use crate::inject::{MigDevice, MigHandles};
use crate::inventory::{Gpu, Inventory};
use crate::ledger::{Allocation, ShareKind};
use crate::mig::MigInstance;

/// Why the driver refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RealizeError {
    #[error("{gpu}: creating MIG profile {profile_id} at slice {start} failed: {driver_message}")]
    Create {
        gpu: GpuIndex,
        profile_id: u32,
        start: u8,
        /// Stable code of the driver's error (e.g. `nvml_insufficient_resources`).
        driver_code: &'static str,
        driver_message: String,
    },
    #[error("{gpu}: destroying MIG device {uuid} failed: {driver_message}")]
    Destroy {
        gpu: GpuIndex,
        uuid: MigUuid,
        driver_code: &'static str,
        driver_message: String,
    },
    #[error("{gpu} is not in the inventory")]
    UnknownGpu { gpu: GpuIndex },
}

impl RealizeError {
    pub fn code(&self) -> &'static str {
        match self {
            RealizeError::Create { .. } => "realize_create_failed",
            RealizeError::Destroy { .. } => "realize_destroy_failed",
            RealizeError::UnknownGpu { .. } => "realize_unknown_gpu",
        }
    }
}

/// Creates and destroys MIG GPU instances (with one compute instance each).
pub trait MigDriver {
    fn create(&mut self, gpu: &Gpu, instance: MigInstance) -> Result<MigDevice, RealizeError>;
    fn destroy(&mut self, gpu: &Gpu, device: &MigDevice) -> Result<(), RealizeError>;
}

/// One call a [`RecordingMigDriver`] saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MigCall {
    Create(GpuIndex, MigInstance),
    Destroy(GpuIndex, MigUuid),
}

/// A fake driver: records calls, hands out sequential ids, fails the n-th create on request.
#[derive(Debug, Default)]
pub struct RecordingMigDriver {
    pub calls: Vec<MigCall>,
    /// Fail the create call with this 0-based number (counting creates only).
    pub fail_create: Option<usize>,
    creates: usize,
}

impl MigDriver for RecordingMigDriver {
    fn create(&mut self, gpu: &Gpu, instance: MigInstance) -> Result<MigDevice, RealizeError> {
        self.calls.push(MigCall::Create(gpu.index, instance));
        let n = self.creates;
        self.creates += 1;
        if self.fail_create == Some(n) {
            return Err(RealizeError::Create {
                gpu: gpu.index,
                profile_id: instance.profile_id,
                start: instance.start,
                driver_code: "fake_insufficient_resources",
                driver_message: "the fake driver was told to fail".to_owned(),
            });
        }
        let uuid = MigUuid::new(format!("MIG-fake-{}-{n}", gpu.index.0))
            .map_err(|_| RealizeError::UnknownGpu { gpu: gpu.index })?;
        Ok(MigDevice {
            uuid,
            gpu_instance_id: n as u32 + 1,
            compute_instance_id: 0,
        })
    }

    fn destroy(&mut self, gpu: &Gpu, device: &MigDevice) -> Result<(), RealizeError> {
        self.calls
            .push(MigCall::Destroy(gpu.index, device.uuid.clone()));
        Ok(())
    }
}

fn mig_shares(allocation: &Allocation) -> impl Iterator<Item = (GpuIndex, MigInstance)> + '_ {
    allocation.shares.iter().filter_map(|s| match s.kind {
        ShareKind::Mig { instance } => Some((s.gpu, instance)),
        _ => None,
    })
}

/// Creates the MIG devices of an allocation and records them in `handles`; all or none.
/// Shares already in `handles` are left as they are.
pub fn realize(
    inventory: &Inventory,
    allocation: &Allocation,
    driver: &mut dyn MigDriver,
    handles: &mut MigHandles,
) -> Result<(), RealizeError> {
    let mut created: Vec<(GpuIndex, MigInstance)> = Vec::new();
    for (gpu_index, instance) in mig_shares(allocation) {
        if handles.contains_key(&(gpu_index, instance)) {
            continue;
        }
        let result = inventory
            .gpu(gpu_index)
            .ok_or(RealizeError::UnknownGpu { gpu: gpu_index })
            .and_then(|gpu| driver.create(gpu, instance));
        match result {
            Ok(device) => {
                handles.insert((gpu_index, instance), device);
                created.push((gpu_index, instance));
            }
            Err(error) => {
                // Roll back what this call created; the first error is the one reported.
                for key in created.into_iter().rev() {
                    if let (Some(gpu), Some(device)) = (inventory.gpu(key.0), handles.remove(&key))
                    {
                        let _ignored = driver.destroy(gpu, &device);
                    }
                }
                return Err(error);
            }
        }
    }
    Ok(())
}

/// Destroys the MIG devices of an allocation and forgets them. Every device is tried; the
/// first failure is returned (those that failed stay in `handles`).
pub fn unrealize(
    inventory: &Inventory,
    allocation: &Allocation,
    driver: &mut dyn MigDriver,
    handles: &mut MigHandles,
) -> Result<(), RealizeError> {
    let mut first_error = None;
    for key in mig_shares(allocation) {
        let Some(device) = handles.get(&key).cloned() else {
            continue;
        };
        let result = inventory
            .gpu(key.0)
            .ok_or(RealizeError::UnknownGpu { gpu: key.0 })
            .and_then(|gpu| driver.destroy(gpu, &device));
        match result {
            Ok(()) => {
                handles.remove(&key);
            }
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::AllocationId;
    use crate::ledger::Share;
    use crate::request::GpuRequest;

    fn inv() -> Inventory {
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
[[gpu]]
index = 1
uuid = "GPU-1"
model = "NVIDIA H200"
memory_mib = 143771
mig_capable = true
pci_bus_id = "0000:3b:00.0"
topology = "GPU0 GPU1\nGPU0 X NV18\nGPU1 NV18 X"
"#,
            "t.toml",
        )
        .unwrap()
    }

    fn two_mig_shares() -> Allocation {
        let mig = |gpu, start| Share {
            gpu: GpuIndex(gpu),
            kind: ShareKind::Mig {
                instance: MigInstance {
                    profile_id: 9,
                    start,
                },
            },
        };
        Allocation {
            id: AllocationId(1),
            tenant: None,
            request: GpuRequest::mig("9"),
            shares: vec![mig(0, 4), mig(1, 4)],
        }
    }

    #[test]
    fn realize_creates_every_mig_share_and_unrealize_destroys_them() {
        let inv = inv();
        let alloc = two_mig_shares();
        let mut driver = RecordingMigDriver::default();
        let mut handles = MigHandles::new();
        realize(&inv, &alloc, &mut driver, &mut handles).unwrap();
        assert_eq!(handles.len(), 2);
        // Idempotent: a second call creates nothing.
        realize(&inv, &alloc, &mut driver, &mut handles).unwrap();
        assert_eq!(driver.calls.len(), 2);
        unrealize(&inv, &alloc, &mut driver, &mut handles).unwrap();
        assert!(handles.is_empty());
        assert!(matches!(driver.calls[2], MigCall::Destroy(GpuIndex(0), _)));
        assert_eq!(driver.calls.len(), 4);
    }

    #[test]
    fn a_failed_create_rolls_back_the_others() {
        let inv = inv();
        let alloc = two_mig_shares();
        let mut driver = RecordingMigDriver {
            fail_create: Some(1),
            ..RecordingMigDriver::default()
        };
        let mut handles = MigHandles::new();
        let err = realize(&inv, &alloc, &mut driver, &mut handles).unwrap_err();
        assert_eq!(err.code(), "realize_create_failed");
        assert!(handles.is_empty(), "nothing half-created stays");
        assert_eq!(
            driver.calls,
            vec![
                MigCall::Create(
                    GpuIndex(0),
                    MigInstance {
                        profile_id: 9,
                        start: 4
                    }
                ),
                MigCall::Create(
                    GpuIndex(1),
                    MigInstance {
                        profile_id: 9,
                        start: 4
                    }
                ),
                MigCall::Destroy(GpuIndex(0), MigUuid::new("MIG-fake-0-0").unwrap()),
            ]
        );
    }

    #[test]
    fn non_mig_allocations_need_no_driver_call() {
        let inv = inv();
        let alloc = Allocation {
            id: AllocationId(2),
            tenant: None,
            request: GpuRequest::whole(1),
            shares: vec![Share {
                gpu: GpuIndex(0),
                kind: ShareKind::Whole,
            }],
        };
        let mut driver = RecordingMigDriver::default();
        let mut handles = MigHandles::new();
        realize(&inv, &alloc, &mut driver, &mut handles).unwrap();
        unrealize(&inv, &alloc, &mut driver, &mut handles).unwrap();
        assert!(driver.calls.is_empty());
    }
}
