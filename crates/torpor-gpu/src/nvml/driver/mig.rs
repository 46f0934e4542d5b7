//! [`NvmlMigDriver`]: creates and destroys MIG GPU instances through NVML's raw bindings
//! (the calls `nvml-wrapper` does not wrap), for placements the planner made.

use nvml_wrapper::Nvml;

use super::gpu_instance_id;
use crate::nvml::{full_compute_profile, nvml_return_code};

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
        Err((nvml_return_code(rc), format!("NVML return code {rc}")))
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
            let ci_profile = full_compute_profile(gi_profile.sliceCount, &ci_profiles).ok_or((
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
