//! Inventory and telemetry from NVML.
//!
//! Split in two so that everything but the driver calls is tested on machines without a GPU:
//! the pure half (always compiled) turns plain facts into an [`Inventory`] and samples into
//! DCGM-exporter-compatible metrics; the driver half (feature `nvml`, module `driver`) only
//! gathers those facts with `nvml-wrapper`, which loads `libnvidia-ml.so` at run time, so a
//! binary built with the feature still starts, and reports a clear error, without a driver.

use std::fmt::Write as _;

use crate::ids::{GpuIndex, GpuUuid, NodeName};
use crate::inventory::{
    Gpu, Inventory, InventoryError, DEFAULT_MPS_MAX_CLIENTS, DEFAULT_TIMESLICE_REPLICAS,
};
use std::sync::Arc;

use crate::mig::{GeometryError, MigGeometry, MigModel, MigProfile};
use crate::partition::PartitionMode;
use crate::topology::{Link, TopologyMatrix};

/// Label used as the "file" of inventory errors from NVML.
pub const SOURCE: &str = "nvml";

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

/// One GPU-instance profile as the driver lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverProfile {
    /// `GpuInstanceProfileInfo.id`.
    pub id: u32,
    /// Starts from `nvmlDeviceGetGpuInstancePossiblePlacements_v2`.
    pub starts: Vec<u8>,
    /// Placement size in memory slices.
    pub memory_slices: u8,
    /// `sliceCount`: SM slices.
    pub sm_slices: u8,
    /// `instanceCount`: most instances per GPU.
    pub max_instances: u8,
    /// `memorySizeMB`.
    pub memory_mib: u64,
}

/// A geometry from the driver's profiles. Names are synthesised as `<sm>g.<GiB>gb` (what
/// `nvidia-smi` prints for most profiles); requests can always use the profile id.
pub fn driver_geometry(
    label: &str,
    profiles: &[DriverProfile],
) -> Result<MigGeometry, GeometryError> {
    let mut out: Vec<MigProfile> = Vec::with_capacity(profiles.len());
    for p in profiles {
        let mut name = format!("{}g.{}gb", p.sm_slices, (p.memory_mib + 512) / 1024);
        if out.iter().any(|q| q.name == name) {
            name = format!("{name}+{}", p.id);
        }
        out.push(MigProfile {
            id: p.id,
            name,
            memory_slices: p.memory_slices,
            sm_slices: p.sm_slices,
            max_per_gpu: p.max_instances,
            allowed_starts: p.starts.clone(),
            driver_memory_mib: Some(p.memory_mib),
        });
    }
    MigGeometry::from_driver(label, out)
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

/// One GPU's (or MIG instance's) readings, for [`dcgm_metrics`].
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSample {
    pub gpu: u32,
    pub uuid: String,
    pub model_name: String,
    /// `(GPU_I_PROFILE, GPU_I_ID)` for a MIG instance.
    pub mig: Option<(String, u32)>,
    pub tenant: Option<String>,
    pub sandbox: Option<String>,
    pub util_pct: Option<u32>,
    pub fb_used_mib: Option<u64>,
    pub temp_c: Option<u32>,
    pub power_w: Option<f64>,
    pub tensor_active: Option<f64>,
    pub xid_last: Option<u64>,
    pub ecc_dbe_volatile: Option<u64>,
}

fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Metrics under DCGM exporter's names and labels, so existing dashboards work.
pub fn dcgm_metrics(hostname: &str, samples: &[GpuSample]) -> String {
    type Reading = fn(&GpuSample) -> Option<String>;
    let families: [(&str, &str, &str, Reading); 7] = [
        (
            "DCGM_FI_DEV_GPU_UTIL",
            "gauge",
            "GPU utilization (in %).",
            |s| s.util_pct.map(|v| v.to_string()),
        ),
        (
            "DCGM_FI_DEV_FB_USED",
            "gauge",
            "Framebuffer memory used (in MiB).",
            |s| s.fb_used_mib.map(|v| v.to_string()),
        ),
        (
            "DCGM_FI_DEV_GPU_TEMP",
            "gauge",
            "GPU temperature (in C).",
            |s| s.temp_c.map(|v| v.to_string()),
        ),
        (
            "DCGM_FI_DEV_POWER_USAGE",
            "gauge",
            "Power draw (in W).",
            |s| s.power_w.map(|v| format!("{v:.3}")),
        ),
        (
            "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
            "gauge",
            "Ratio of cycles the tensor (HMMA) pipe is active.",
            |s| s.tensor_active.map(|v| format!("{v:.6}")),
        ),
        (
            "DCGM_FI_DEV_XID_ERRORS",
            "gauge",
            "Value of the last XID error encountered.",
            |s| s.xid_last.map(|v| v.to_string()),
        ),
        (
            "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
            "counter",
            "Total number of double-bit volatile ECC errors.",
            |s| s.ecc_dbe_volatile.map(|v| v.to_string()),
        ),
    ];
    let mut out = String::new();
    for (name, kind, help, read) in families {
        let values: Vec<(&GpuSample, String)> = samples
            .iter()
            .filter_map(|s| read(s).map(|v| (s, v)))
            .collect();
        if values.is_empty() {
            continue;
        }
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (s, value) in values {
            let mut labels = format!(
                "gpu=\"{}\",UUID=\"{}\",device=\"nvidia{}\",modelName=\"{}\",Hostname=\"{}\"",
                s.gpu,
                escape(&s.uuid),
                s.gpu,
                escape(&s.model_name),
                escape(hostname)
            );
            if let Some((profile, id)) = &s.mig {
                let _ = write!(
                    labels,
                    ",GPU_I_PROFILE=\"{}\",GPU_I_ID=\"{id}\"",
                    escape(profile)
                );
            }
            if let Some(t) = &s.tenant {
                let _ = write!(labels, ",tenant=\"{}\"", escape(t));
            }
            if let Some(sb) = &s.sandbox {
                let _ = write!(labels, ",sandbox=\"{}\"", escape(sb));
            }
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    }
    out
}

/// The compute-instance profile that covers a whole GPU instance of `gi_slices` slices:
/// among `(profile id, slice count)` the driver offers, the one with the same slice count.
pub fn full_compute_profile(gi_slices: u32, ci_profiles: &[(u32, u32)]) -> Option<u32> {
    ci_profiles
        .iter()
        .find(|(_, slices)| *slices == gi_slices)
        .map(|(id, _)| *id)
}

/// A stable code for an NVML return code (`nvmlReturn_t`).
pub fn nvml_return_code(rc: u32) -> &'static str {
    match rc {
        0 => "nvml_success",
        1 => "nvml_uninitialized",
        2 => "nvml_invalid_argument",
        3 => "nvml_not_supported",
        4 => "nvml_no_permission",
        6 => "nvml_not_found",
        7 => "nvml_insufficient_size",
        15 => "nvml_gpu_is_lost",
        19 => "nvml_in_use",
        23 => "nvml_insufficient_resources",
        _ => "nvml_error",
    }
}

/// DCGM's `DCGM_FI_PROF_PIPE_TENSOR_ACTIVE` is a ratio (0..1); NVML's GPM gives a percentage.
pub fn tensor_ratio(percent: f64) -> f64 {
    if percent.is_finite() {
        (percent / 100.0).clamp(0.0, 1.0)
    } else {
        0.0
    }
}

/// The MIG profile of a MIG device from its NVML name, e.g. `NVIDIA H100 80GB HBM3 MIG 3g.40gb`
/// gives `3g.40gb` (the `GPU_I_PROFILE` label of DCGM exporter).
pub fn mig_profile_from_name(name: &str) -> Option<String> {
    let (_, profile) = name.rsplit_once(" MIG ")?;
    let profile = profile.trim();
    let valid =
        profile.contains('g') && profile.contains('.') && !profile.contains(char::is_whitespace);
    valid.then(|| profile.to_owned())
}

/// Profiles whose driver placements differ from the table: `(profile id, what differs)`.
/// Profiles the table does not know are reported too; an empty list means they agree.
pub fn placements_match_table(model: MigModel, driver: &[DriverProfile]) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for d in driver {
        match model.profile_by_id(d.id) {
            None => out.push((d.id, "not in the table".to_owned())),
            Some(p) => {
                if p.allowed_starts != d.starts || p.memory_slices != d.memory_slices {
                    out.push((
                        d.id,
                        format!(
                            "driver starts {:?} size {}, table starts {:?} size {}",
                            d.starts, d.memory_slices, p.allowed_starts, p.memory_slices
                        ),
                    ));
                }
            }
        }
    }
    out
}

/// The driver half: gathers facts and samples through NVML.
#[cfg(feature = "nvml")]
pub mod driver {
    use nvml_wrapper::enum_wrappers::device::{
        P2pCapabilitiesIndex, P2pStatus, TemperatureSensor, TopologyLevel,
    };
    use nvml_wrapper::error::NvmlError;
    pub use nvml_wrapper::Nvml;

    use super::{
        inventory_from_facts, mig_profile_from_name, Ancestor, DeviceFacts, DriverProfile,
        GpuSample, PairFacts,
    };
    use crate::ids::NodeName;
    use crate::inventory::{Inventory, InventoryError};

    /// NVLinks a device can have (`NVML_NVLINK_MAX_LINKS`).
    const MAX_NVLINKS: u32 = 18;

    /// Why NVML could not be used.
    #[derive(Debug, thiserror::Error)]
    pub enum NvmlInventoryError {
        #[error("NVML is not available (no NVIDIA driver, or libnvidia-ml.so cannot be loaded)")]
        Unavailable(#[source] NvmlError),
        #[error("NVML call {call} failed for GPU {index}")]
        Call {
            call: &'static str,
            index: u32,
            #[source]
            source: NvmlError,
        },
        #[error(transparent)]
        Inventory(#[from] InventoryError),
    }

    impl NvmlInventoryError {
        pub fn code(&self) -> &'static str {
            match self {
                NvmlInventoryError::Unavailable(_) => "nvml_unavailable",
                NvmlInventoryError::Call { .. } => "nvml_call",
                NvmlInventoryError::Inventory(e) => e.code(),
            }
        }
    }

    fn call<T>(
        call: &'static str,
        index: u32,
        result: Result<T, NvmlError>,
    ) -> Result<T, NvmlInventoryError> {
        result.map_err(|source| NvmlInventoryError::Call {
            call,
            index,
            source,
        })
    }

    /// Loads NVML; fails cleanly where there is no driver.
    pub fn open() -> Result<Nvml, NvmlInventoryError> {
        Nvml::init().map_err(NvmlInventoryError::Unavailable)
    }

    /// Reads the node's GPUs and their topology.
    pub fn read_inventory(nvml: &Nvml, node: NodeName) -> Result<Inventory, NvmlInventoryError> {
        let count = call("device_count", 0, nvml.device_count())?;
        let mut devices = Vec::with_capacity(count as usize);
        let mut facts = Vec::with_capacity(count as usize);
        for index in 0..count {
            let d = call("device_by_index", index, nvml.device_by_index(index))?;
            let pci = call("pci_info", index, d.pci_info())?;
            facts.push(DeviceFacts {
                index,
                uuid: call("uuid", index, d.uuid())?,
                name: call("name", index, d.name())?,
                memory_total_bytes: call("memory_info", index, d.memory_info())?.total,
                mig_enabled: d.mig_mode().ok().map(|m| m.current == 1),
                numa_node: d.numa_node_id().ok(),
                pci_bus_id: pci.bus_id,
                minor: call("minor_number", index, d.minor_number())?,
                mig_placements: None,
            });
            devices.push(d);
        }
        for f in &mut facts {
            if f.mig_enabled == Some(true) {
                f.mig_placements = mig_placements(nvml, f.index).ok();
            }
        }
        let mut failure = None;
        let inventory = inventory_from_facts(node, facts.clone(), |a, b| {
            let (da, db) = (&devices[a], &devices[b]);
            let mut direct = 0u16;
            let mut active = 0u16;
            for link in 0..MAX_NVLINKS {
                let wrapper = da.link_wrapper_for(link);
                if wrapper.is_active().unwrap_or(false) {
                    active += 1;
                    if wrapper
                        .remote_pci_info()
                        .is_ok_and(|r| r.bus_id.eq_ignore_ascii_case(&facts[b].pci_bus_id))
                    {
                        direct += 1;
                    }
                }
            }
            // Behind NVSwitch the remote end is the switch: count all links when P2P over
            // NVLink works between the two.
            let nvlinks = if direct > 0 {
                direct
            } else if matches!(
                da.p2p_status(db, P2pCapabilitiesIndex::NvLink),
                Ok(P2pStatus::Ok)
            ) {
                active
            } else {
                0
            };
            // The call takes the other device by value and handles are not Clone.
            let other = nvml.device_by_index(b as u32);
            let ancestor = match other.and_then(|o| da.topology_common_ancestor(o)) {
                Ok(TopologyLevel::Internal) => Ancestor::Internal,
                Ok(TopologyLevel::Single) => Ancestor::Single,
                Ok(TopologyLevel::Multiple) => Ancestor::Multiple,
                Ok(TopologyLevel::HostBridge) => Ancestor::HostBridge,
                Ok(TopologyLevel::Node) => Ancestor::Node,
                Ok(TopologyLevel::System) => Ancestor::System,
                Err(e) => {
                    failure.get_or_insert(NvmlInventoryError::Call {
                        call: "topology_common_ancestor",
                        index: a as u32,
                        source: e,
                    });
                    Ancestor::System
                }
            };
            PairFacts { nvlinks, ancestor }
        })?;
        match failure {
            Some(e) => Err(e),
            None => Ok(inventory),
        }
    }

    /// MIG placements the driver reports for one GPU: `(profile id, allowed starts, size)`
    /// for every GPU-instance profile it supports, read with
    /// `nvmlDeviceGetGpuInstancePossiblePlacements_v2`. The table in [`crate::mig`] is the
    /// fallback; [`placements_match_table`] compares the two.
    pub fn mig_placements(
        nvml: &Nvml,
        index: u32,
    ) -> Result<Vec<DriverProfile>, NvmlInventoryError> {
        use nvml_wrapper_sys::bindings::{
            nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_t, nvmlReturn_enum_NVML_SUCCESS,
            NVML_GPU_INSTANCE_PROFILE_COUNT,
        };
        let device = call("device_by_index", index, nvml.device_by_index(index))?;
        let lib = nvml.lib();
        let (Ok(get_info), Ok(get_placements)) = (
            lib.nvmlDeviceGetGpuInstanceProfileInfo.as_ref(),
            lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2.as_ref(),
        ) else {
            return Err(NvmlInventoryError::Call {
                call: "nvmlDeviceGetGpuInstancePossiblePlacements_v2 (symbol missing)",
                index,
                source: NvmlError::FunctionNotFound,
            });
        };
        let mut out = Vec::new();
        for profile_index in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
            // SAFETY: the handle comes from this live `Nvml`; `info` is a zeroed plain C
            // struct of the type the function writes.
            let (rc, info) = unsafe {
                let mut info: nvmlGpuInstanceProfileInfo_t = std::mem::zeroed();
                let rc = get_info(device.handle(), profile_index, &mut info);
                (rc, info)
            };
            if rc != nvmlReturn_enum_NVML_SUCCESS {
                // Profiles the GPU lacks answer NOT_SUPPORTED or INVALID_ARGUMENT.
                continue;
            }
            let mut placements = [nvmlGpuInstancePlacement_t { start: 0, size: 0 }; 8];
            let mut count = placements.len() as std::os::raw::c_uint;
            // SAFETY: `placements` has room for `count` entries and the driver writes at most
            // `count`, updating it to the number written.
            let rc = unsafe {
                get_placements(
                    device.handle(),
                    info.id,
                    placements.as_mut_ptr(),
                    &mut count,
                )
            };
            if rc != nvmlReturn_enum_NVML_SUCCESS {
                continue;
            }
            let written = (count as usize).min(placements.len());
            let starts: Vec<u8> = placements[..written]
                .iter()
                .filter_map(|p| u8::try_from(p.start).ok())
                .collect();
            let size = placements[..written]
                .first()
                .and_then(|p| u8::try_from(p.size).ok())
                .unwrap_or(0);
            out.push(DriverProfile {
                id: info.id,
                starts,
                memory_slices: size,
                sm_slices: u8::try_from(info.sliceCount).unwrap_or(u8::MAX),
                max_instances: u8::try_from(info.instanceCount).unwrap_or(u8::MAX),
                memory_mib: info.memorySizeMB,
            });
        }
        Ok(out)
    }

    /// The last critical XID of every GPU whose XID events NVML delivers (a background
    /// thread waits on an NVML event set). A GPU listed with `None` is watched and has had
    /// no XID since the watch began (DCGM exporter then reports 0); a GPU that is not listed
    /// cannot be watched, and its `DCGM_FI_DEV_XID_ERRORS` is left out.
    #[derive(Debug, Default)]
    pub struct XidLog {
        last: std::sync::Mutex<std::collections::BTreeMap<String, Option<u64>>>,
    }

    impl XidLog {
        /// The XID reading for a GPU: `None` when it is not watched.
        pub fn reading(&self, uuid: &str) -> Option<u64> {
            let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
            last.get(uuid).map(|x| x.unwrap_or(0))
        }

        pub fn record(&self, uuid: &str, xid: u64) {
            let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
            last.insert(uuid.to_owned(), Some(xid));
        }

        fn watch(&self, uuid: String) {
            let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
            last.entry(uuid).or_insert(None);
        }
    }

    /// Starts the XID watcher: one thread per GPU registers it for critical-XID events on its
    /// own NVML event set and waits on it for the life of the process (hence the `'static`
    /// NVML handle). A GPU whose registration fails is not watched (its metric is absent).
    pub fn watch_xids(nvml: &'static Nvml) -> std::sync::Arc<XidLog> {
        use nvml_wrapper::bitmasks::event::EventTypes;
        use nvml_wrapper::enums::event::XidError;
        let log = std::sync::Arc::new(XidLog::default());
        for index in 0..nvml.device_count().unwrap_or(0) {
            let registered = nvml
                .create_event_set()
                .map_err(|e| e.to_string())
                .and_then(|set| {
                    let d = nvml.device_by_index(index).map_err(|e| e.to_string())?;
                    let uuid = d.uuid().map_err(|e| e.to_string())?;
                    d.register_events(EventTypes::CRITICAL_XID_ERROR, set)
                        .map(|set| (uuid, set))
                        .map_err(|e| e.error.to_string())
                });
            let (uuid, set) = match registered {
                Ok(r) => r,
                Err(e) => {
                    tracing::info!(gpu = index, error = %e, "XID events not available: DCGM_FI_DEV_XID_ERRORS left out");
                    continue;
                }
            };
            log.watch(uuid);
            let shared = std::sync::Arc::clone(&log);
            let started = std::thread::Builder::new()
                .name(format!("nvml-xid-{index}"))
                .spawn(move || loop {
                    match set.wait(10_000) {
                        Ok(event) => {
                            if let (Some(XidError::Value(xid)), Ok(uuid)) =
                                (event.event_data, event.device.uuid())
                            {
                                tracing::warn!(gpu = %uuid, xid, "GPU XID error");
                                shared.record(&uuid, xid);
                            }
                        }
                        Err(NvmlError::Timeout) => {}
                        Err(e) => {
                            tracing::warn!(gpu = index, error = %e, "waiting for NVML events failed");
                            std::thread::sleep(std::time::Duration::from_secs(10));
                        }
                    }
                });
            if let Err(e) = started {
                tracing::warn!(error = %e, "cannot start the XID watcher");
            }
        }
        log
    }

    /// Tensor-pipe activity of every GPU that has GPM (Hopper and newer), as DCGM's
    /// `DCGM_FI_PROF_PIPE_TENSOR_ACTIVE` ratio over a `window` between two GPM samples.
    /// GPUs without GPM are absent.
    pub fn tensor_active(
        nvml: &Nvml,
        window: std::time::Duration,
    ) -> std::collections::BTreeMap<u32, f64> {
        use nvml_wrapper::enums::gpm::GpmMetricId;
        let count = nvml.device_count().unwrap_or(0);
        let mut first = Vec::new();
        for index in 0..count {
            let Ok(d) = nvml.device_by_index(index) else {
                continue;
            };
            if !matches!(d.gpm_support(), Ok(true)) {
                continue;
            }
            if let Ok(sample) = d.gpm_sample() {
                first.push((index, sample));
            }
        }
        let mut out = std::collections::BTreeMap::new();
        if first.is_empty() {
            return out;
        }
        std::thread::sleep(window);
        for (index, s1) in first {
            let Ok(d) = nvml.device_by_index(index) else {
                continue;
            };
            let Ok(s2) = d.gpm_sample() else { continue };
            if let Ok(results) =
                nvml_wrapper::gpm::gpm_metrics_get(nvml, &s1, &s2, &[GpmMetricId::AnyTensorUtil])
            {
                if let Some(Ok(r)) = results.into_iter().next() {
                    out.insert(index, super::tensor_ratio(r.value));
                }
            }
        }
        out
    }

    /// Samples every GPU for [`super::dcgm_metrics`]; readings a GPU does not support are
    /// left out rather than failing the scrape. `xids` comes from [`watch_xids`];
    /// `tensor` from [`tensor_active`].
    pub fn sample(nvml: &Nvml) -> Result<Vec<GpuSample>, NvmlInventoryError> {
        sample_with(nvml, None, &std::collections::BTreeMap::new())
    }

    /// [`sample`] with XID and tensor readings.
    pub fn sample_with(
        nvml: &Nvml,
        xids: Option<&XidLog>,
        tensor: &std::collections::BTreeMap<u32, f64>,
    ) -> Result<Vec<GpuSample>, NvmlInventoryError> {
        let count = call("device_count", 0, nvml.device_count())?;
        let mut out = Vec::with_capacity(count as usize);
        for index in 0..count {
            let d = call("device_by_index", index, nvml.device_by_index(index))?;
            let model_name = d.name().unwrap_or_default();
            let uuid = call("uuid", index, d.uuid())?;
            out.push(GpuSample {
                gpu: index,
                uuid: uuid.clone(),
                model_name: model_name.clone(),
                mig: None,
                tenant: None,
                sandbox: None,
                util_pct: d.utilization_rates().ok().map(|u| u.gpu),
                fb_used_mib: d.memory_info().ok().map(|m| m.used / (1024 * 1024)),
                temp_c: d.temperature(TemperatureSensor::Gpu).ok(),
                power_w: d.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
                // GPM's any-tensor utilisation (Hopper and newer); absent elsewhere.
                tensor_active: tensor.get(&index).copied(),
                // The XID watcher's last critical XID; absent where events are unsupported.
                xid_last: xids.and_then(|x| x.reading(&uuid)),
                ecc_dbe_volatile: d
                    .total_ecc_errors(
                        nvml_wrapper::enum_wrappers::device::MemoryError::Uncorrected,
                        nvml_wrapper::enum_wrappers::device::EccCounter::Volatile,
                    )
                    .ok(),
            });
            // MIG instances: their memory use, labelled with profile and GPU instance id.
            let instances = d.mig_device_count().unwrap_or(0);
            for m in 0..instances {
                let Ok(mig) = d.mig_device_by_index(m) else {
                    continue;
                };
                let Some(profile) = mig.name().ok().and_then(|n| mig_profile_from_name(&n)) else {
                    continue;
                };
                let gpu_instance_id = gpu_instance_id(nvml, &mig).unwrap_or(m);
                out.push(GpuSample {
                    gpu: index,
                    uuid: mig.uuid().unwrap_or_default(),
                    model_name: model_name.clone(),
                    mig: Some((profile, gpu_instance_id)),
                    tenant: None,
                    sandbox: None,
                    util_pct: None,
                    fb_used_mib: mig.memory_info().ok().map(|m| m.used / (1024 * 1024)),
                    temp_c: None,
                    power_w: None,
                    tensor_active: None,
                    xid_last: None,
                    ecc_dbe_volatile: None,
                });
            }
        }
        Ok(out)
    }

    /// Creates and destroys MIG GPU instances (each with one compute instance covering it)
    /// through NVML, for placements the planner made. Needs root and the GPU in MIG mode;
    /// a GPU with MIG mode off is refused with `nvml_mig_mode_off`.
    pub struct NvmlMigDriver {
        nvml: &'static Nvml,
    }

    impl NvmlMigDriver {
        pub fn new(nvml: &'static Nvml) -> Self {
            NvmlMigDriver { nvml }
        }
    }

    type Raw = nvml_wrapper_sys::bindings::nvmlReturn_t;

    fn ok(rc: Raw) -> Result<(), (&'static str, String)> {
        if rc == nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_SUCCESS {
            Ok(())
        } else {
            Err((
                super::nvml_return_code(rc),
                format!("NVML return code {rc}"),
            ))
        }
    }

    fn missing(name: &str) -> (&'static str, String) {
        (
            "nvml_function_missing",
            format!("{name} is not in this driver's NVML"),
        )
    }

    impl NvmlMigDriver {
        fn try_create(
            &self,
            gpu: &crate::inventory::Gpu,
            instance: crate::mig::MigInstance,
        ) -> Result<crate::inject::MigDevice, (&'static str, String)> {
            use nvml_wrapper_sys::bindings::*;
            let lib = self.nvml.lib();
            let device = self
                .nvml
                .device_by_index(gpu.index.0)
                .map_err(|e| ("nvml_call", e.to_string()))?;
            match device.mig_mode() {
                Ok(m) if m.current == 1 => {}
                Ok(_) => {
                    return Err((
                        "nvml_mig_mode_off",
                        format!(
                            "MIG mode is off on GPU {} (enable it with `nvidia-smi -i {} -mig 1`)",
                            gpu.index, gpu.index
                        ),
                    ))
                }
                Err(e) => return Err(("nvml_mig_mode_off", format!("MIG mode unreadable: {e}"))),
            }
            let get_gi_info = lib
                .nvmlDeviceGetGpuInstanceProfileInfo
                .as_ref()
                .map_err(|_| missing("nvmlDeviceGetGpuInstanceProfileInfo"))?;
            let create_gi = lib
                .nvmlDeviceCreateGpuInstanceWithPlacement
                .as_ref()
                .map_err(|_| missing("nvmlDeviceCreateGpuInstanceWithPlacement"))?;
            let gi_info_of = lib
                .nvmlGpuInstanceGetInfo
                .as_ref()
                .map_err(|_| missing("nvmlGpuInstanceGetInfo"))?;
            let get_ci_info = lib
                .nvmlGpuInstanceGetComputeInstanceProfileInfo
                .as_ref()
                .map_err(|_| missing("nvmlGpuInstanceGetComputeInstanceProfileInfo"))?;
            let create_ci = lib
                .nvmlGpuInstanceCreateComputeInstance
                .as_ref()
                .map_err(|_| missing("nvmlGpuInstanceCreateComputeInstance"))?;
            let ci_info_of = lib
                .nvmlComputeInstanceGetInfo_v2
                .as_ref()
                .map_err(|_| missing("nvmlComputeInstanceGetInfo_v2"))?;
            let destroy_gi = lib
                .nvmlGpuInstanceDestroy
                .as_ref()
                .map_err(|_| missing("nvmlGpuInstanceDestroy"))?;
            // The GPU-instance profile with the planner's id, and its slice count.
            let mut gi_profile = None;
            for index in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
                // SAFETY: a live device handle and a zeroed plain C struct the call fills.
                let (rc, info) = unsafe {
                    let mut info: nvmlGpuInstanceProfileInfo_t = std::mem::zeroed();
                    (get_gi_info(device.handle(), index, &mut info), info)
                };
                if rc == nvmlReturn_enum_NVML_SUCCESS && info.id == instance.profile_id {
                    gi_profile = Some(info);
                    break;
                }
            }
            let gi_profile = gi_profile.ok_or((
                "nvml_unknown_profile",
                format!(
                    "the driver has no GPU-instance profile {}",
                    instance.profile_id
                ),
            ))?;
            let placement = nvmlGpuInstancePlacement_t {
                start: u32::from(instance.start),
                size: gi_profile.sliceCount,
            };
            let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
            // SAFETY: live handle, a valid placement, and an out-pointer the call writes.
            ok(unsafe { create_gi(device.handle(), gi_profile.id, &placement, &mut gi) })?;
            let made = (|| {
                // SAFETY: `gi` was just created by the driver; the structs are plain C.
                let gi_info = unsafe {
                    let mut info: nvmlGpuInstanceInfo_t = std::mem::zeroed();
                    ok(gi_info_of(gi, &mut info))?;
                    info
                };
                let mut ci_profiles = Vec::new();
                for index in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
                    // SAFETY: as above.
                    let (rc, info) = unsafe {
                        let mut info: nvmlComputeInstanceProfileInfo_t = std::mem::zeroed();
                        (
                            get_ci_info(
                                gi,
                                index,
                                NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                                &mut info,
                            ),
                            info,
                        )
                    };
                    if rc == nvmlReturn_enum_NVML_SUCCESS {
                        ci_profiles.push((info.id, info.sliceCount));
                    }
                }
                let ci_profile = super::full_compute_profile(gi_profile.sliceCount, &ci_profiles)
                    .ok_or((
                    "nvml_no_compute_profile",
                    "no compute-instance profile covers the GPU instance".to_owned(),
                ))?;
                let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
                // SAFETY: as above.
                let ci_info = unsafe {
                    ok(create_ci(gi, ci_profile, &mut ci))?;
                    let mut info: nvmlComputeInstanceInfo_t = std::mem::zeroed();
                    ok(ci_info_of(ci, &mut info))?;
                    info
                };
                let uuid = self.mig_uuid(&device, gi_info.id, ci_info.id)?;
                Ok(crate::inject::MigDevice {
                    uuid: crate::ids::MigUuid::new(uuid.clone())
                        .map_err(|_| ("nvml_bad_uuid", format!("driver gave MIG UUID {uuid:?}")))?,
                    gpu_instance_id: gi_info.id,
                    compute_instance_id: ci_info.id,
                })
            })();
            if made.is_err() {
                // SAFETY: `gi` is a live instance this call created (destroying it also
                // destroys a compute instance made inside it only if none remain: best effort).
                let _ = unsafe { destroy_gi(gi) };
            }
            made
        }

        /// The UUID of the MIG device for a GPU and compute instance.
        fn mig_uuid(
            &self,
            device: &nvml_wrapper::Device,
            gi: u32,
            ci: u32,
        ) -> Result<String, (&'static str, String)> {
            use nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_SUCCESS;
            let get_ci = self
                .nvml
                .lib()
                .nvmlDeviceGetComputeInstanceId
                .as_ref()
                .map_err(|_| missing("nvmlDeviceGetComputeInstanceId"))?;
            let max = device.mig_device_count().unwrap_or(0);
            for index in 0..max {
                let Ok(mig) = device.mig_device_by_index(index) else {
                    continue;
                };
                let mut id: std::os::raw::c_uint = 0;
                // SAFETY: a live MIG device handle and an integer out-pointer.
                let rc = unsafe { get_ci(mig.handle(), &mut id) };
                if gpu_instance_id(self.nvml, &mig) == Some(gi)
                    && rc == nvmlReturn_enum_NVML_SUCCESS
                    && id == ci
                {
                    return mig.uuid().map_err(|e| ("nvml_call", e.to_string()));
                }
            }
            Err((
                "nvml_mig_device_missing",
                format!("no MIG device for GPU instance {gi}, compute instance {ci}"),
            ))
        }

        fn try_destroy(
            &self,
            gpu: &crate::inventory::Gpu,
            dev: &crate::inject::MigDevice,
        ) -> Result<(), (&'static str, String)> {
            use nvml_wrapper_sys::bindings::*;
            let lib = self.nvml.lib();
            let device = self
                .nvml
                .device_by_index(gpu.index.0)
                .map_err(|e| ("nvml_call", e.to_string()))?;
            let gi_by_id = lib
                .nvmlDeviceGetGpuInstanceById
                .as_ref()
                .map_err(|_| missing("nvmlDeviceGetGpuInstanceById"))?;
            let ci_by_id = lib
                .nvmlGpuInstanceGetComputeInstanceById
                .as_ref()
                .map_err(|_| missing("nvmlGpuInstanceGetComputeInstanceById"))?;
            let destroy_ci = lib
                .nvmlComputeInstanceDestroy
                .as_ref()
                .map_err(|_| missing("nvmlComputeInstanceDestroy"))?;
            let destroy_gi = lib
                .nvmlGpuInstanceDestroy
                .as_ref()
                .map_err(|_| missing("nvmlGpuInstanceDestroy"))?;
            let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
            let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
            // SAFETY: live handles from this NVML; out-pointers the calls write.
            unsafe {
                ok(gi_by_id(device.handle(), dev.gpu_instance_id, &mut gi))?;
                if ci_by_id(gi, dev.compute_instance_id, &mut ci) == nvmlReturn_enum_NVML_SUCCESS {
                    ok(destroy_ci(ci))?;
                }
                ok(destroy_gi(gi))
            }
        }
    }

    impl crate::realize::MigDriver for NvmlMigDriver {
        fn create(
            &mut self,
            gpu: &crate::inventory::Gpu,
            instance: crate::mig::MigInstance,
        ) -> Result<crate::inject::MigDevice, crate::realize::RealizeError> {
            self.try_create(gpu, instance)
                .map_err(
                    |(driver_code, driver_message)| crate::realize::RealizeError::Create {
                        gpu: gpu.index,
                        profile_id: instance.profile_id,
                        start: instance.start,
                        driver_code,
                        driver_message,
                    },
                )
        }

        fn destroy(
            &mut self,
            gpu: &crate::inventory::Gpu,
            device: &crate::inject::MigDevice,
        ) -> Result<(), crate::realize::RealizeError> {
            self.try_destroy(gpu, device)
                .map_err(
                    |(driver_code, driver_message)| crate::realize::RealizeError::Destroy {
                        gpu: gpu.index,
                        uuid: device.uuid.clone(),
                        driver_code,
                        driver_message,
                    },
                )
        }
    }

    /// `nvmlDeviceGetGpuInstanceId` of a MIG device handle (not wrapped by nvml-wrapper).
    fn gpu_instance_id(nvml: &Nvml, mig: &nvml_wrapper::Device) -> Option<u32> {
        use nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_SUCCESS;
        let get = nvml.lib().nvmlDeviceGetGpuInstanceId.as_ref().ok()?;
        let mut id: std::os::raw::c_uint = 0;
        // SAFETY: the handle comes from this live `Nvml` and `id` is a plain integer the
        // driver writes.
        let rc = unsafe { get(mig.handle(), &mut id) };
        (rc == nvmlReturn_enum_NVML_SUCCESS).then_some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(index: u32, name: &str, mib: u64, mig: Option<bool>, numa: u32) -> DeviceFacts {
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
        let fixture = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fixtures/gpu/pcie-a100-4.toml"
        ))
        .ok()
        .and_then(|t| Inventory::from_toml(&t, "pcie-a100-4.toml").ok());
        if let Some(fixture) = fixture {
            assert_eq!(inv.topology(), fixture.topology());
        }
        assert_eq!(inv.link(GpuIndex(0), GpuIndex(1)), Some(Link::NvLink(12)));
        assert_eq!(inv.gpus()[0].mig_model, Some(MigModel::A100Gb80));
        assert_eq!(inv.gpus()[0].initial_mode, PartitionMode::Whole);
        assert_eq!(inv.gpus()[3].initial_mode, PartitionMode::Mig);
    }

    fn dp(id: u32, starts: &[u8], size: u8, sm: u8) -> DriverProfile {
        DriverProfile {
            id,
            starts: starts.to_vec(),
            memory_slices: size,
            sm_slices: sm,
            max_instances: 8 / size,
            memory_mib: 6016 * u64::from(size),
        }
    }

    #[test]
    fn driver_placements_are_compared_with_the_table() {
        let lgipp = vec![
            dp(19, &[0, 1, 2, 3, 4, 5, 6], 1, 1),
            dp(20, &[0, 1, 2, 3, 4, 5, 6], 1, 1),
            dp(15, &[0, 2, 4, 6], 2, 1),
            dp(14, &[0, 2, 4], 2, 2),
            dp(9, &[0, 4], 4, 3),
            dp(5, &[0], 4, 4),
            dp(0, &[0], 8, 7),
        ];
        assert!(placements_match_table(MigModel::H100Gb80, &lgipp).is_empty());
        let mut odd = lgipp.clone();
        odd[4].starts = vec![0, 2, 4];
        odd.push(dp(21, &[0], 1, 1));
        let diff = placements_match_table(MigModel::H100Gb80, &odd);
        assert_eq!(diff.iter().map(|d| d.0).collect::<Vec<_>>(), [9, 21]);
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

    #[test]
    fn compute_profile_and_return_codes() {
        // (id, slices) as an H100 3g GPU instance offers them.
        let offered = [(0, 1), (1, 2), (2, 3)];
        assert_eq!(full_compute_profile(3, &offered), Some(2));
        assert_eq!(full_compute_profile(7, &offered), None);
        assert_eq!(nvml_return_code(23), "nvml_insufficient_resources");
        assert_eq!(nvml_return_code(4), "nvml_no_permission");
        assert_eq!(nvml_return_code(999), "nvml_error");
    }

    #[test]
    fn tensor_percent_becomes_dcgm_ratio() {
        assert_eq!(tensor_ratio(25.0), 0.25);
        assert_eq!(tensor_ratio(0.0), 0.0);
        assert_eq!(tensor_ratio(100.4), 1.0);
        assert_eq!(tensor_ratio(f64::NAN), 0.0);
    }

    #[cfg(feature = "nvml")]
    #[test]
    fn xid_log_reports_only_watched_gpus() {
        let log = driver::XidLog::default();
        assert_eq!(log.reading("GPU-a"), None, "not watched: absent");
        log.record("GPU-a", 79);
        assert_eq!(log.reading("GPU-a"), Some(79));
    }

    #[test]
    fn mig_profile_from_nvml_names() {
        assert_eq!(
            mig_profile_from_name("NVIDIA H100 80GB HBM3 MIG 3g.40gb").as_deref(),
            Some("3g.40gb")
        );
        assert_eq!(
            mig_profile_from_name("NVIDIA A100-SXM4-40GB MIG 1g.5gb+me").as_deref(),
            Some("1g.5gb+me")
        );
        assert_eq!(mig_profile_from_name("NVIDIA H200"), None);
        assert_eq!(mig_profile_from_name("NVIDIA H200 MIG "), None);
    }

    #[test]
    fn dcgm_metrics_use_exporter_names_and_labels() {
        let text = dcgm_metrics(
            "node-1",
            &[
                GpuSample {
                    gpu: 0,
                    uuid: "GPU-0".into(),
                    model_name: "NVIDIA H200".into(),
                    mig: None,
                    tenant: None,
                    sandbox: None,
                    util_pct: Some(42),
                    fb_used_mib: Some(1024),
                    temp_c: Some(51),
                    power_w: Some(312.5),
                    tensor_active: None,
                    xid_last: None,
                    ecc_dbe_volatile: Some(0),
                },
                GpuSample {
                    gpu: 1,
                    uuid: "GPU-1".into(),
                    model_name: "NVIDIA H200".into(),
                    mig: Some(("3g.71gb".into(), 2)),
                    tenant: Some("team-a".into()),
                    sandbox: Some("sb-1".into()),
                    util_pct: Some(7),
                    fb_used_mib: None,
                    temp_c: None,
                    power_w: None,
                    tensor_active: Some(0.25),
                    xid_last: None,
                    ecc_dbe_volatile: None,
                },
            ],
        );
        assert!(text.contains("# TYPE DCGM_FI_DEV_GPU_UTIL gauge"));
        assert!(text.contains("DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"GPU-0\",device=\"nvidia0\",modelName=\"NVIDIA H200\",Hostname=\"node-1\"} 42"), "{text}");
        assert!(
            text.contains(
                "GPU_I_PROFILE=\"3g.71gb\",GPU_I_ID=\"2\",tenant=\"team-a\",sandbox=\"sb-1\"} 7"
            ),
            "{text}"
        );
        assert!(text.contains("DCGM_FI_DEV_POWER_USAGE{gpu=\"0\""), "{text}");
        assert!(
            text.contains("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{gpu=\"1\""),
            "{text}"
        );
        assert!(
            !text.contains("DCGM_FI_DEV_XID_ERRORS"),
            "families without readings are left out"
        );
    }
}
