//! The driver half (feature `nvml`): gathers facts and samples through NVML, which
//! `nvml-wrapper` loads at run time; [`NvmlMigDriver`] (module `mig`) creates and destroys MIG
//! instances.

mod mig;

pub use mig::NvmlMigDriver;

use nvml_wrapper::enum_wrappers::device::{
    P2pCapabilitiesIndex, P2pStatus, TemperatureSensor, TopologyLevel,
};
use nvml_wrapper::error::NvmlError;
pub use nvml_wrapper::Nvml;

use super::{
    inventory_from_facts, mig_profile_from_name, Ancestor, DeviceFacts, DriverProfile, GpuSample,
    PairFacts,
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
pub fn mig_placements(nvml: &Nvml, index: u32) -> Result<Vec<DriverProfile>, NvmlInventoryError> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xid_log_reports_only_watched_gpus() {
        let log = XidLog::default();
        assert_eq!(log.reading("GPU-a"), None, "not watched: absent");
        log.record("GPU-a", 79);
        assert_eq!(log.reading("GPU-a"), Some(79));
    }
}
