//! The driver's MIG profiles ([`DriverProfile`]): the geometry they make, how they compare
//! with the built-in table, the profile of a MIG device from its NVML name, and the codes of
//! NVML's return values and compute-instance profiles. Pure: tested without a GPU.

use crate::mig::{GeometryError, MigGeometry, MigModel, MigProfile};

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

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(in crate::nvml) fn dp(id: u32, starts: &[u8], size: u8, sm: u8) -> DriverProfile {
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
}
