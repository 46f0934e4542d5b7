//! The MIG drivers of nodes without NVML's: stand-in devices for a declared inventory, and
//! refusals for a node with real GPUs but no MIG driver.

use torpor_gpu::ids::MigUuid;
use torpor_gpu::inject::MigDevice;
use torpor_gpu::inventory::Gpu;
use torpor_gpu::mig::MigInstance;
use torpor_gpu::realize::{MigDriver, RealizeError};

/// Stand-in MIG devices for a declared inventory: there is no driver to create instances, so
/// each placement gets a deterministic `MIG-` UUID derived from its GPU, profile and start.
/// With NVML the instances must be created by the driver; that driver is not written yet.
pub(super) struct DeclaredMigDriver;

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl MigDriver for DeclaredMigDriver {
    fn create(&mut self, gpu: &Gpu, instance: MigInstance) -> Result<MigDevice, RealizeError> {
        let key = format!("{}/{}/{}", gpu.uuid, instance.profile_id, instance.start);
        let (a, b) = (fnv(key.as_bytes()), fnv(format!("{key}#").as_bytes()));
        let uuid = format!(
            "MIG-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
            a >> 32,
            (a >> 16) & 0xffff,
            a & 0xffff,
            b >> 48,
            b & 0xffff_ffff_ffff
        );
        Ok(MigDevice {
            uuid: MigUuid::new(uuid).map_err(|_| RealizeError::UnknownGpu { gpu: gpu.index })?,
            gpu_instance_id: u32::from(instance.start) + 1,
            compute_instance_id: 0,
        })
    }

    fn destroy(&mut self, _gpu: &Gpu, _device: &MigDevice) -> Result<(), RealizeError> {
        Ok(())
    }
}

/// The MIG driver of a node with real GPUs but no NVML MIG driver: every call fails (MIG
/// requests are refused before they get here).
pub(super) struct NoMigDriver;

impl MigDriver for NoMigDriver {
    fn create(&mut self, gpu: &Gpu, instance: MigInstance) -> Result<MigDevice, RealizeError> {
        Err(RealizeError::Create {
            gpu: gpu.index,
            profile_id: instance.profile_id,
            start: instance.start,
            driver_code: "nvml_mig_driver_missing",
            driver_message: "this node has no NVML MIG driver".into(),
        })
    }

    fn destroy(&mut self, gpu: &Gpu, device: &MigDevice) -> Result<(), RealizeError> {
        Err(RealizeError::Destroy {
            gpu: gpu.index,
            uuid: device.uuid.clone(),
            driver_code: "nvml_mig_driver_missing",
            driver_message: "this node has no NVML MIG driver".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_mig_uuids_are_stable_and_distinct() {
        let inv = torpor_gpu::inventory::Inventory::from_toml(
            "node = \"n\"\n[[gpu]]\nindex = 0\nuuid = \"GPU-a\"\nmodel = \"NVIDIA H100 80GB HBM3\"\nmemory_mib = 81559\nmig_capable = true\npci_bus_id = \"0000:01:00.0\"\n",
            "t",
        )
        .unwrap();
        let gpu = &inv.gpus()[0];
        let mut d = DeclaredMigDriver;
        let a = d
            .create(
                gpu,
                MigInstance {
                    profile_id: 9,
                    start: 4,
                },
            )
            .unwrap();
        let b = d
            .create(
                gpu,
                MigInstance {
                    profile_id: 9,
                    start: 0,
                },
            )
            .unwrap();
        let again = d
            .create(
                gpu,
                MigInstance {
                    profile_id: 9,
                    start: 4,
                },
            )
            .unwrap();
        assert_eq!(a.uuid, again.uuid);
        assert_ne!(a.uuid, b.uuid);
        assert!(a.uuid.as_str().starts_with("MIG-"));
        assert_eq!(a.uuid.as_str().len(), "MIG-".len() + 36);
    }
}
