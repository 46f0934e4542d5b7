//! What a sandbox must be given to use its GPU share: device nodes, environment, mounts.
//!
//! This module turns an allocation into an [`Injection`] for the runtime; it creates nothing.
//! MIG instances get their UUIDs (and GPU/compute-instance ids) from the driver when they are
//! created, so the caller passes them in as [`MigHandles`]; the device minors of MIG
//! capabilities come from `/proc/driver/nvidia-caps/mig-minors`, parsed by [`MigMinors`].

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::ids::{GpuIndex, MigUuid};
use crate::inventory::Inventory;
use crate::ledger::{Allocation, ShareKind};
use crate::mig::MigInstance;

/// GPUs the NVIDIA container stack exposes.
pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
/// Driver capabilities the NVIDIA container stack mounts.
pub const NVIDIA_DRIVER_CAPABILITIES: &str = "NVIDIA_DRIVER_CAPABILITIES";
/// Devices CUDA enumerates, in order.
pub const CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
/// MPS: share of SMs a client may use.
pub const CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
/// MPS: device memory a client may pin, per device ordinal.
pub const CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
/// MPS: where the control daemon's pipes are.
pub const CUDA_MPS_PIPE_DIRECTORY: &str = "CUDA_MPS_PIPE_DIRECTORY";
/// MPS: where the control daemon logs.
pub const CUDA_MPS_LOG_DIRECTORY: &str = "CUDA_MPS_LOG_DIRECTORY";

/// Device nodes every GPU sandbox needs.
pub const CONTROL_DEVICES: [&str; 3] =
    ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"];

/// A MIG instance as the driver created it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigDevice {
    pub uuid: MigUuid,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
}

/// MIG devices that exist, by GPU and placement.
pub type MigHandles = BTreeMap<(GpuIndex, MigInstance), MigDevice>;

/// Device minors of MIG capabilities (`/proc/driver/nvidia-caps/mig-minors`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigMinors {
    minors: BTreeMap<String, u32>,
}

/// Why `mig-minors` could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigMinorsError {
    #[error("mig-minors line {line}: expected `<path> <minor>`, found {text:?}")]
    BadLine { line: usize, text: String },
}

impl MigMinorsError {
    pub fn code(&self) -> &'static str {
        match self {
            MigMinorsError::BadLine { .. } => "mig_minors_bad_line",
        }
    }
}

impl MigMinors {
    /// Parses lines such as `gpu0/gi1/access 12` and `gpu0/gi1/ci0/access 13`.
    pub fn parse(text: &str) -> Result<Self, MigMinorsError> {
        let mut minors = BTreeMap::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() {
                continue;
            }
            let mut parts = line.split_whitespace();
            let parsed = match (parts.next(), parts.next(), parts.next()) {
                (Some(path), Some(minor), None) => minor.parse::<u32>().ok().map(|m| (path, m)),
                _ => None,
            };
            let (path, minor) = parsed.ok_or_else(|| MigMinorsError::BadLine {
                line: i + 1,
                text: raw.to_owned(),
            })?;
            minors.insert(path.to_owned(), minor);
        }
        Ok(MigMinors { minors })
    }

    fn get(&self, path: &str) -> Option<u32> {
        self.minors.get(path).copied()
    }
}

/// Where MPS lives on the host, and what is known about MIG device minors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InjectConfig {
    pub mps_pipe_directory: PathBuf,
    pub mps_log_directory: PathBuf,
    /// `None` where the driver's mig-minors file was not read: MIG capability devices are
    /// then left to the container runtime.
    pub mig_minors: Option<MigMinors>,
}

impl Default for InjectConfig {
    fn default() -> Self {
        InjectConfig {
            mps_pipe_directory: PathBuf::from("/tmp/nvidia-mps"),
            mps_log_directory: PathBuf::from("/var/log/nvidia-mps"),
            mig_minors: None,
        }
    }
}

/// What the runtime gives a sandbox.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Injection {
    pub devices: Vec<PathBuf>,
    pub env: BTreeMap<String, String>,
    /// Host directories to bind into the sandbox at the same path (MPS pipes).
    pub mounts: Vec<PathBuf>,
}

/// Why an injection could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InjectError {
    #[error("allocation {allocation}: {gpu} is not in the inventory")]
    UnknownGpu { allocation: String, gpu: GpuIndex },
    #[error("allocation {allocation}: the MIG instance (profile {profile_id} at slice {start}) on {gpu} has not been created")]
    MigNotRealized {
        allocation: String,
        gpu: GpuIndex,
        profile_id: u32,
        start: u8,
    },
    #[error("mig-minors has no entry {path}")]
    MigMinorMissing { path: String },
}

impl InjectError {
    pub fn code(&self) -> &'static str {
        match self {
            InjectError::UnknownGpu { .. } => "inject_unknown_gpu",
            InjectError::MigNotRealized { .. } => "inject_mig_not_realized",
            InjectError::MigMinorMissing { .. } => "inject_mig_minor_missing",
        }
    }
}

fn push_unique(devices: &mut Vec<PathBuf>, path: PathBuf) {
    if !devices.contains(&path) {
        devices.push(path);
    }
}

/// Builds the injection for one allocation. An allocation without shares needs nothing.
pub fn injection(
    inventory: &Inventory,
    allocation: &Allocation,
    mig: &MigHandles,
    config: &InjectConfig,
) -> Result<Injection, InjectError> {
    let mut out = Injection::default();
    if allocation.shares.is_empty() {
        return Ok(out);
    }
    out.devices
        .extend(CONTROL_DEVICES.iter().map(PathBuf::from));
    let mut visible = Vec::with_capacity(allocation.shares.len());
    let mut pinned = Vec::new();
    let mut thread_pct = None;
    for (ordinal, share) in allocation.shares.iter().enumerate() {
        let gpu = inventory.gpu(share.gpu).ok_or(InjectError::UnknownGpu {
            allocation: allocation.id.to_string(),
            gpu: share.gpu,
        })?;
        push_unique(
            &mut out.devices,
            PathBuf::from(format!("/dev/nvidia{}", gpu.minor)),
        );
        match share.kind {
            ShareKind::Whole | ShareKind::Timeslice => visible.push(gpu.uuid.to_string()),
            ShareKind::Mps {
                compute_pct,
                memory_mib,
            } => {
                visible.push(gpu.uuid.to_string());
                thread_pct = Some(compute_pct);
                pinned.push(format!("{ordinal}={memory_mib}M"));
            }
            ShareKind::Mig { instance } => {
                let device =
                    mig.get(&(share.gpu, instance))
                        .ok_or(InjectError::MigNotRealized {
                            allocation: allocation.id.to_string(),
                            gpu: share.gpu,
                            profile_id: instance.profile_id,
                            start: instance.start,
                        })?;
                visible.push(device.uuid.to_string());
                if let Some(minors) = &config.mig_minors {
                    let gi = format!("gpu{}/gi{}/access", gpu.minor, device.gpu_instance_id);
                    let ci = format!(
                        "gpu{}/gi{}/ci{}/access",
                        gpu.minor, device.gpu_instance_id, device.compute_instance_id
                    );
                    for path in [gi, ci] {
                        let minor = minors
                            .get(&path)
                            .ok_or(InjectError::MigMinorMissing { path })?;
                        push_unique(
                            &mut out.devices,
                            PathBuf::from(format!("/dev/nvidia-caps/nvidia-cap{minor}")),
                        );
                    }
                }
            }
        }
    }
    let list = visible.join(",");
    out.env
        .insert(NVIDIA_VISIBLE_DEVICES.to_owned(), list.clone());
    out.env.insert(CUDA_VISIBLE_DEVICES.to_owned(), list);
    out.env.insert(
        NVIDIA_DRIVER_CAPABILITIES.to_owned(),
        "compute,utility".to_owned(),
    );
    if let Some(pct) = thread_pct {
        out.env.insert(
            CUDA_MPS_ACTIVE_THREAD_PERCENTAGE.to_owned(),
            pct.to_string(),
        );
        out.env.insert(
            CUDA_MPS_PINNED_DEVICE_MEM_LIMIT.to_owned(),
            pinned.join(","),
        );
        out.env.insert(
            CUDA_MPS_PIPE_DIRECTORY.to_owned(),
            config.mps_pipe_directory.display().to_string(),
        );
        out.env.insert(
            CUDA_MPS_LOG_DIRECTORY.to_owned(),
            config.mps_log_directory.display().to_string(),
        );
        out.mounts.push(config.mps_pipe_directory.clone());
    }
    Ok(out)
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
uuid = "GPU-aaaa"
model = "NVIDIA A100 80GB PCIe"
memory_mib = 81920
mig_capable = true
pci_bus_id = "0000:17:00.0"
minor = 3
[[gpu]]
index = 1
uuid = "GPU-bbbb"
model = "NVIDIA A100 80GB PCIe"
memory_mib = 81920
mig_capable = true
pci_bus_id = "0000:31:00.0"
topology = "GPU0 GPU1\nGPU0 X NV12\nGPU1 NV12 X"
"#,
            "t.toml",
        )
        .unwrap()
    }

    fn alloc(shares: Vec<Share>) -> Allocation {
        Allocation {
            id: AllocationId(4),
            tenant: None,
            request: GpuRequest::whole(1),
            shares,
        }
    }

    #[test]
    fn whole_gpus_get_uuids_and_device_nodes() {
        let a = alloc(vec![
            Share {
                gpu: GpuIndex(0),
                kind: ShareKind::Whole,
            },
            Share {
                gpu: GpuIndex(1),
                kind: ShareKind::Whole,
            },
        ]);
        let i = injection(&inv(), &a, &MigHandles::new(), &InjectConfig::default()).unwrap();
        assert_eq!(i.env[NVIDIA_VISIBLE_DEVICES], "GPU-aaaa,GPU-bbbb");
        assert_eq!(i.env[CUDA_VISIBLE_DEVICES], "GPU-aaaa,GPU-bbbb");
        assert!(i.devices.contains(&PathBuf::from("/dev/nvidia3")));
        assert!(i.devices.contains(&PathBuf::from("/dev/nvidia1")));
        assert!(i.devices.contains(&PathBuf::from("/dev/nvidiactl")));
        assert!(!i.env.contains_key(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE));
        assert!(i.mounts.is_empty());
    }

    #[test]
    fn mps_shares_get_thread_percentage_and_pinned_memory() {
        let a = alloc(vec![Share {
            gpu: GpuIndex(1),
            kind: ShareKind::Mps {
                compute_pct: 25,
                memory_mib: 8192,
            },
        }]);
        let i = injection(&inv(), &a, &MigHandles::new(), &InjectConfig::default()).unwrap();
        assert_eq!(i.env[CUDA_MPS_ACTIVE_THREAD_PERCENTAGE], "25");
        assert_eq!(i.env[CUDA_MPS_PINNED_DEVICE_MEM_LIMIT], "0=8192M");
        assert_eq!(i.env[CUDA_MPS_PIPE_DIRECTORY], "/tmp/nvidia-mps");
        assert_eq!(i.mounts, [PathBuf::from("/tmp/nvidia-mps")]);
    }

    #[test]
    fn mig_shares_get_mig_uuids_and_capability_devices() {
        let instance = MigInstance {
            profile_id: 9,
            start: 4,
        };
        let a = alloc(vec![Share {
            gpu: GpuIndex(0),
            kind: ShareKind::Mig { instance },
        }]);
        let err = injection(&inv(), &a, &MigHandles::new(), &InjectConfig::default()).unwrap_err();
        assert_eq!(err.code(), "inject_mig_not_realized");
        let mut handles = MigHandles::new();
        handles.insert(
            (GpuIndex(0), instance),
            MigDevice {
                uuid: MigUuid::new("MIG-1234").unwrap(),
                gpu_instance_id: 2,
                compute_instance_id: 0,
            },
        );
        let config = InjectConfig {
            mig_minors: Some(
                MigMinors::parse(
                    "config 1\nmonitor 2\ngpu3/gi2/access 57\ngpu3/gi2/ci0/access 58\n",
                )
                .unwrap(),
            ),
            ..InjectConfig::default()
        };
        let i = injection(&inv(), &a, &handles, &config).unwrap();
        assert_eq!(i.env[NVIDIA_VISIBLE_DEVICES], "MIG-1234");
        assert_eq!(i.env[CUDA_VISIBLE_DEVICES], "MIG-1234");
        assert!(i
            .devices
            .contains(&PathBuf::from("/dev/nvidia-caps/nvidia-cap57")));
        assert!(i
            .devices
            .contains(&PathBuf::from("/dev/nvidia-caps/nvidia-cap58")));
        let sparse = InjectConfig {
            mig_minors: Some(MigMinors::parse("gpu3/gi2/access 57").unwrap()),
            ..InjectConfig::default()
        };
        assert_eq!(
            injection(&inv(), &a, &handles, &sparse).unwrap_err().code(),
            "inject_mig_minor_missing"
        );
    }

    #[test]
    fn mig_minors_rejects_garbage() {
        assert_eq!(
            MigMinors::parse("gpu0/gi1/access twelve").unwrap_err(),
            MigMinorsError::BadLine {
                line: 1,
                text: "gpu0/gi1/access twelve".into()
            }
        );
    }

    #[test]
    fn empty_allocations_need_nothing() {
        let i = injection(
            &inv(),
            &alloc(vec![]),
            &MigHandles::new(),
            &InjectConfig::default(),
        )
        .unwrap();
        assert_eq!(i, Injection::default());
    }
}
