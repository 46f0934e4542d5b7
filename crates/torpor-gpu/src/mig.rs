//! MIG geometry: profiles, allowed start slices, per-GPU limits, and placement on one GPU.
//!
//! The facts are those of `fixtures/gpu/MIG-GEOMETRY.md`: a MIG-capable GPU has 8 memory
//! slices and 7 SM slices; an instance occupies memory slices `[start, start + size)`; a
//! placement is valid when its start is allowed for the profile, it overlaps no other instance,
//! and the profile's per-GPU limit holds. On real hardware the placements come from NVML and
//! this table is the fallback: a [`MigGeometry`] is either the table's row set for a known
//! model or what the driver lists. This module owns geometries and single-GPU placement;
//! choosing between GPUs is the planner's job.

use std::fmt;
use std::sync::{Arc, OnceLock};

use serde::{Deserialize, Serialize};

/// Memory slices of a MIG-capable GPU.
pub const MEMORY_SLICES: u8 = 8;
/// SM (compute) slices of a MIG-capable GPU.
pub const SM_SLICES: u8 = 7;

/// The GPU models whose MIG geometry the table knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum MigModel {
    #[serde(rename = "A100-40GB")]
    A100Gb40,
    #[serde(rename = "A100-80GB")]
    A100Gb80,
    #[serde(rename = "H100-80GB")]
    H100Gb80,
    #[serde(rename = "H200-141GB")]
    H200Gb141,
}

/// Most profiles one geometry may hold.
pub const MAX_PROFILES: usize = 16;

/// One MIG GPU-instance profile of one geometry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MigProfile {
    /// NVML `GpuInstanceProfileInfo.id` / `nvidia-smi mig -lgip` id.
    pub id: u32,
    /// Name, e.g. `3g.71gb` (synthesised from slices and memory for driver geometries).
    pub name: String,
    pub memory_slices: u8,
    pub sm_slices: u8,
    pub max_per_gpu: u8,
    pub allowed_starts: Vec<u8>,
    /// Exact memory reported by the driver; `None` for the table (see [`MigProfile::memory_mib`]).
    pub driver_memory_mib: Option<u64>,
}

struct Row {
    id: u32,
    names: [&'static str; 4],
    memory_slices: u8,
    sm_slices: u8,
    max_per_gpu: u8,
    allowed_starts: &'static [u8],
}

const TABLE: [Row; 7] = [
    Row {
        id: 19,
        names: ["1g.5gb", "1g.10gb", "1g.10gb", "1g.18gb"],
        memory_slices: 1,
        sm_slices: 1,
        max_per_gpu: 7,
        allowed_starts: &[0, 1, 2, 3, 4, 5, 6],
    },
    Row {
        id: 20,
        names: ["1g.5gb+me", "1g.10gb+me", "1g.10gb+me", "1g.18gb+me"],
        memory_slices: 1,
        sm_slices: 1,
        max_per_gpu: 1,
        allowed_starts: &[0, 1, 2, 3, 4, 5, 6],
    },
    Row {
        id: 15,
        names: ["1g.10gb", "1g.20gb", "1g.20gb", "1g.35gb"],
        memory_slices: 2,
        sm_slices: 1,
        max_per_gpu: 4,
        allowed_starts: &[0, 2, 4, 6],
    },
    Row {
        id: 14,
        names: ["2g.10gb", "2g.20gb", "2g.20gb", "2g.35gb"],
        memory_slices: 2,
        sm_slices: 2,
        max_per_gpu: 3,
        allowed_starts: &[0, 2, 4],
    },
    Row {
        id: 9,
        names: ["3g.20gb", "3g.40gb", "3g.40gb", "3g.71gb"],
        memory_slices: 4,
        sm_slices: 3,
        max_per_gpu: 2,
        allowed_starts: &[0, 4],
    },
    Row {
        id: 5,
        names: ["4g.20gb", "4g.40gb", "4g.40gb", "4g.71gb"],
        memory_slices: 4,
        sm_slices: 4,
        max_per_gpu: 1,
        allowed_starts: &[0],
    },
    Row {
        id: 0,
        names: ["7g.40gb", "7g.80gb", "7g.80gb", "7g.141gb"],
        memory_slices: 8,
        sm_slices: 7,
        max_per_gpu: 1,
        allowed_starts: &[0],
    },
];

impl MigModel {
    pub const ALL: [MigModel; 4] = [
        MigModel::A100Gb40,
        MigModel::A100Gb80,
        MigModel::H100Gb80,
        MigModel::H200Gb141,
    ];

    fn column(self) -> usize {
        match self {
            MigModel::A100Gb40 => 0,
            MigModel::A100Gb80 => 1,
            MigModel::H100Gb80 => 2,
            MigModel::H200Gb141 => 3,
        }
    }

    /// The table's label, e.g. `H200-141GB`.
    pub fn label(self) -> &'static str {
        match self {
            MigModel::A100Gb40 => "A100-40GB",
            MigModel::A100Gb80 => "A100-80GB",
            MigModel::H100Gb80 => "H100-80GB",
            MigModel::H200Gb141 => "H200-141GB",
        }
    }

    /// Parses a table label such as `A100-80GB`.
    pub fn from_label(label: &str) -> Option<MigModel> {
        MigModel::ALL.into_iter().find(|m| m.label() == label)
    }

    /// Recognises a model from NVML's product name and total memory. Models the table does
    /// not know (H100 NVL, H100 94GB, A30, ...) give `None`: they need placements from NVML.
    pub fn detect(product_name: &str, memory_mib: u64) -> Option<MigModel> {
        let name = product_name.to_ascii_uppercase();
        const GIB: u64 = 1024;
        if name.contains("A100") {
            return match memory_mib {
                m if m <= 48 * GIB => Some(MigModel::A100Gb40),
                m if m <= 88 * GIB => Some(MigModel::A100Gb80),
                _ => None,
            };
        }
        if name.contains("H200") {
            return (memory_mib > 128 * GIB && memory_mib <= 150 * GIB)
                .then_some(MigModel::H200Gb141);
        }
        if name.contains("H100") && !name.contains("NVL") {
            return (memory_mib > 72 * GIB && memory_mib <= 88 * GIB).then_some(MigModel::H100Gb80);
        }
        None
    }

    /// The table's geometry for this model (built once, shared).
    pub fn geometry(self) -> Arc<MigGeometry> {
        static GEOMETRIES: OnceLock<[Arc<MigGeometry>; 4]> = OnceLock::new();
        let all = GEOMETRIES.get_or_init(|| {
            MigModel::ALL.map(|model| {
                Arc::new(MigGeometry::build(
                    model.label(),
                    Some(model),
                    TABLE
                        .iter()
                        .map(|row| MigProfile {
                            id: row.id,
                            name: row.names[model.column()].to_owned(),
                            memory_slices: row.memory_slices,
                            sm_slices: row.sm_slices,
                            max_per_gpu: row.max_per_gpu,
                            allowed_starts: row.allowed_starts.to_vec(),
                            driver_memory_mib: None,
                        })
                        .collect(),
                ))
            })
        });
        Arc::clone(&all[self.column()])
    }

    /// All profiles of this model, in table order (smallest first).
    pub fn profiles(self) -> Vec<MigProfile> {
        self.geometry().profiles().to_vec()
    }

    /// Looks a profile up by its name for this model (`3g.71gb`) or by its id (`9`).
    pub fn profile(self, name_or_id: &str) -> Option<MigProfile> {
        self.geometry().profile(name_or_id).cloned()
    }

    pub fn profile_by_id(self, id: u32) -> Option<MigProfile> {
        self.geometry().profile_by_id(id).cloned()
    }
}

impl fmt::Display for MigModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// Why a driver-listed geometry was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    #[error("the geometry lists no profile")]
    Empty,
    #[error("the geometry lists {count} profiles; at most {max} are supported")]
    TooManyProfiles { count: usize, max: usize },
    #[error("profile id {id} appears twice")]
    DuplicateProfile { id: u32 },
    #[error("profile id {id}: size {size} at start {start} does not fit {slices} memory slices")]
    OutOfRange {
        id: u32,
        start: u8,
        size: u8,
        slices: u8,
    },
    #[error("profile id {id}: sizes, SM slices and the instance limit must be at least 1")]
    Zero { id: u32 },
}

impl GeometryError {
    pub fn code(&self) -> &'static str {
        match self {
            GeometryError::Empty => "mig_geometry_empty",
            GeometryError::TooManyProfiles { .. } => "mig_geometry_too_many_profiles",
            GeometryError::DuplicateProfile { .. } => "mig_geometry_duplicate_profile",
            GeometryError::OutOfRange { .. } => "mig_geometry_out_of_range",
            GeometryError::Zero { .. } => "mig_geometry_zero",
        }
    }
}

/// The MIG profiles of one kind of GPU: the table's for a known model, or the driver's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MigGeometry {
    label: String,
    model: Option<MigModel>,
    profiles: Vec<MigProfile>,
    /// Profile positions from the largest to the smallest (memory, then SM slices).
    largest_first: Vec<usize>,
}

impl MigGeometry {
    /// A geometry listed by the driver (profiles in any order; checked here).
    pub fn from_driver(label: &str, profiles: Vec<MigProfile>) -> Result<Self, GeometryError> {
        if profiles.is_empty() {
            return Err(GeometryError::Empty);
        }
        if profiles.len() > MAX_PROFILES {
            return Err(GeometryError::TooManyProfiles {
                count: profiles.len(),
                max: MAX_PROFILES,
            });
        }
        for (i, p) in profiles.iter().enumerate() {
            if profiles[..i].iter().any(|q| q.id == p.id) {
                return Err(GeometryError::DuplicateProfile { id: p.id });
            }
            if p.memory_slices == 0 || p.sm_slices == 0 || p.max_per_gpu == 0 {
                return Err(GeometryError::Zero { id: p.id });
            }
            for &start in &p.allowed_starts {
                if u16::from(start) + u16::from(p.memory_slices) > u16::from(MEMORY_SLICES) {
                    return Err(GeometryError::OutOfRange {
                        id: p.id,
                        start,
                        size: p.memory_slices,
                        slices: MEMORY_SLICES,
                    });
                }
            }
        }
        Ok(MigGeometry::build(label, None, profiles))
    }

    fn build(label: &str, model: Option<MigModel>, profiles: Vec<MigProfile>) -> Self {
        let mut largest_first: Vec<usize> = (0..profiles.len()).collect();
        largest_first.sort_by_key(|&i| {
            std::cmp::Reverse((profiles[i].memory_slices, profiles[i].sm_slices))
        });
        MigGeometry {
            label: label.to_owned(),
            model,
            profiles,
            largest_first,
        }
    }

    /// Whether profile `index` fits at `start` on `slots`; allocation-free, for hot paths.
    fn fits(&self, slots: &Slots, index: usize, start: u8) -> bool {
        let profile = &self.profiles[index];
        profile.allowed_starts.contains(&start)
            && slots.occupied & profile.mask(start) == 0
            && slots.counts[index] < profile.max_per_gpu
    }

    fn capability_of(&self, slots: &Slots) -> [u8; MAX_PROFILES] {
        let mut out = [0u8; MAX_PROFILES];
        for (slot, &index) in self.largest_first.iter().enumerate() {
            let profile = &self.profiles[index];
            out[slot] = profile
                .allowed_starts
                .iter()
                .filter(|&&start| self.fits(slots, index, start))
                .count() as u8;
        }
        out
    }

    /// `H200-141GB` for the table, the product name for a driver geometry.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The table model, when this is the table's geometry.
    pub fn model(&self) -> Option<MigModel> {
        self.model
    }

    pub fn profiles(&self) -> &[MigProfile] {
        &self.profiles
    }

    /// Looks a profile up by name or by id.
    pub fn profile(&self, name_or_id: &str) -> Option<&MigProfile> {
        if let Ok(id) = name_or_id.parse::<u32>() {
            return self.profile_by_id(id);
        }
        self.profiles.iter().find(|p| p.name == name_or_id)
    }

    pub fn profile_by_id(&self, id: u32) -> Option<&MigProfile> {
        self.profiles.iter().find(|p| p.id == id)
    }

    fn position(&self, id: u32) -> Option<usize> {
        self.profiles.iter().position(|p| p.id == id)
    }

    /// SM slices of the whole GPU (those of its largest profile).
    pub fn sm_slices(&self) -> u8 {
        self.profiles.iter().map(|p| p.sm_slices).max().unwrap_or(0)
    }
}

impl fmt::Display for MigGeometry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label)
    }
}

impl MigProfile {
    /// Memory slices `[start, start + size)` as a bit mask.
    pub fn mask(&self, start: u8) -> u8 {
        let bits = ((1u16 << self.memory_slices.min(MEMORY_SLICES)) - 1) as u8;
        bits.checked_shl(u32::from(start)).unwrap_or(0)
    }

    /// Memory accounted to one instance on a GPU with `gpu_memory_mib` in total: the driver's
    /// figure when known, else the instance's share of the memory slices, rounded down. Real
    /// instances show slightly less than the name says (an H100 `1g.10gb` shows 9.75 GiB).
    pub fn memory_mib(&self, gpu_memory_mib: u64) -> u64 {
        self.driver_memory_mib
            .unwrap_or(gpu_memory_mib * u64::from(self.memory_slices) / u64::from(MEMORY_SLICES))
    }

    /// Whether this is a media-extensions (`+me`) profile.
    pub fn media_extensions(&self) -> bool {
        self.name.ends_with("+me")
    }
}

/// One GPU instance on a GPU: a profile at a start slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MigInstance {
    pub profile_id: u32,
    pub start: u8,
}

/// Why a MIG placement is invalid on a GPU.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigPlacementError {
    #[error("profile id {profile_id} is not in the {geometry} geometry")]
    UnknownProfile { geometry: String, profile_id: u32 },
    #[error("profile {profile} cannot start at slice {start}; allowed starts are {allowed:?}")]
    StartNotAllowed {
        profile: String,
        start: u8,
        allowed: Vec<u8>,
    },
    #[error("profile {profile} at slice {start} overlaps memory slices {overlap:#010b}")]
    Overlap {
        profile: String,
        start: u8,
        overlap: u8,
    },
    #[error("profile {profile} allows at most {max} instances per GPU")]
    LimitReached { profile: String, max: u8 },
}

impl MigPlacementError {
    pub fn code(&self) -> &'static str {
        match self {
            MigPlacementError::UnknownProfile { .. } => "mig_unknown_profile",
            MigPlacementError::StartNotAllowed { .. } => "mig_start_not_allowed",
            MigPlacementError::Overlap { .. } => "mig_overlap",
            MigPlacementError::LimitReached { .. } => "mig_limit_reached",
        }
    }
}

/// Occupied memory slices and per-profile instance counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Slots {
    occupied: u8,
    counts: [u8; MAX_PROFILES],
}

/// The MIG instances on one GPU: occupancy and per-profile counts, against its geometry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigLayout {
    geometry: Arc<MigGeometry>,
    slots: Slots,
}

impl MigLayout {
    pub fn empty(geometry: Arc<MigGeometry>) -> Self {
        MigLayout {
            geometry,
            slots: Slots::default(),
        }
    }

    /// Builds the layout of existing instances, checking each against the others.
    pub fn from_instances(
        geometry: Arc<MigGeometry>,
        instances: impl IntoIterator<Item = MigInstance>,
    ) -> Result<Self, MigPlacementError> {
        let mut layout = MigLayout::empty(geometry);
        for instance in instances {
            layout.place(instance)?;
        }
        Ok(layout)
    }

    pub fn geometry(&self) -> &Arc<MigGeometry> {
        &self.geometry
    }

    /// Occupied memory slices as a bit mask (bit `i` is slice `i`).
    pub fn occupied(&self) -> u8 {
        self.slots.occupied
    }

    pub fn free_memory_slices(&self) -> u8 {
        MEMORY_SLICES - self.slots.occupied.count_ones() as u8
    }

    pub fn is_empty(&self) -> bool {
        self.slots.occupied == 0
    }

    /// SM slices used by the instances.
    pub fn used_sm_slices(&self) -> u8 {
        self.geometry
            .profiles
            .iter()
            .zip(self.slots.counts)
            .map(|(p, n)| p.sm_slices.saturating_mul(n))
            .fold(0u8, u8::saturating_add)
    }

    fn index_of(&self, profile_id: u32) -> Result<usize, MigPlacementError> {
        self.geometry
            .position(profile_id)
            .ok_or_else(|| MigPlacementError::UnknownProfile {
                geometry: self.geometry.label.clone(),
                profile_id,
            })
    }

    /// Checks that `instance` could be added.
    pub fn check(&self, instance: MigInstance) -> Result<(), MigPlacementError> {
        let index = self.index_of(instance.profile_id)?;
        if self.geometry.fits(&self.slots, index, instance.start) {
            return Ok(());
        }
        let profile = &self.geometry.profiles[index];
        if !profile.allowed_starts.contains(&instance.start) {
            return Err(MigPlacementError::StartNotAllowed {
                profile: profile.name.clone(),
                start: instance.start,
                allowed: profile.allowed_starts.clone(),
            });
        }
        let overlap = self.slots.occupied & profile.mask(instance.start);
        if overlap != 0 {
            return Err(MigPlacementError::Overlap {
                profile: profile.name.clone(),
                start: instance.start,
                overlap,
            });
        }
        Err(MigPlacementError::LimitReached {
            profile: profile.name.clone(),
            max: profile.max_per_gpu,
        })
    }

    /// Adds `instance` after checking it.
    pub fn place(&mut self, instance: MigInstance) -> Result<(), MigPlacementError> {
        self.check(instance)?;
        let index = self.index_of(instance.profile_id)?;
        let mask = self.geometry.profiles[index].mask(instance.start);
        self.slots.occupied |= mask;
        self.slots.counts[index] += 1;
        Ok(())
    }

    /// Removes `instance`; it must be one that [`MigLayout::place`] accepted.
    pub fn remove(&mut self, instance: MigInstance) -> bool {
        let Ok(index) = self.index_of(instance.profile_id) else {
            return false;
        };
        let mask = self.geometry.profiles[index].mask(instance.start);
        if self.slots.occupied & mask != mask || self.slots.counts[index] == 0 {
            return false;
        }
        self.slots.occupied &= !mask;
        self.slots.counts[index] -= 1;
        true
    }

    /// Start slices at which `profile` could be placed now, lowest first.
    pub fn valid_starts(&self, profile: &MigProfile) -> Vec<u8> {
        match self.geometry.position(profile.id) {
            Some(index) => profile
                .allowed_starts
                .iter()
                .copied()
                .filter(|&start| self.geometry.fits(&self.slots, index, start))
                .collect(),
            None => Vec::new(),
        }
    }

    /// How much the layout can still take: for each profile from the largest to the smallest
    /// (memory slices, then SM slices), the number of starts where it could be placed.
    /// Compared lexicographically, a larger value keeps larger placements possible.
    pub fn capability(&self) -> [u8; MAX_PROFILES] {
        self.geometry.capability_of(&self.slots)
    }

    /// [`MigLayout::capability`] after adding `instance`; `None` when it does not fit.
    pub fn capability_after(&self, instance: MigInstance) -> Option<[u8; MAX_PROFILES]> {
        let index = self.geometry.position(instance.profile_id)?;
        if !self.geometry.fits(&self.slots, index, instance.start) {
            return None;
        }
        let mut after = self.slots;
        after.occupied |= self.geometry.profiles[index].mask(instance.start);
        after.counts[index] += 1;
        Some(self.geometry.capability_of(&after))
    }

    /// The start the fragmentation-aware packer picks for `profile`: the one that leaves the
    /// best [`MigLayout::capability`], ties broken as MIG-GEOMETRY.md suggests (highest start
    /// for 1g and 3g profiles, lowest for the others). `None` when it does not fit.
    pub fn best_start(&self, profile: &MigProfile) -> Option<u8> {
        let prefer_high = profile.sm_slices == 1 || profile.sm_slices == 3;
        let mut best: Option<(u8, [u8; MAX_PROFILES])> = None;
        for &start in &profile.allowed_starts {
            let Some(cap) = self.capability_after(MigInstance {
                profile_id: profile.id,
                start,
            }) else {
                continue;
            };
            let better = match &best {
                None => true,
                Some((best_start, best_cap)) => {
                    cap > *best_cap || (cap == *best_cap && prefer_high && start > *best_start)
                }
            };
            if better {
                best = Some((start, cap));
            }
        }
        best.map(|(start, _)| start)
    }

    /// The first allowed start, lowest first: the naive baseline for density comparisons.
    pub fn first_fit_start(&self, profile: &MigProfile) -> Option<u8> {
        let index = self.geometry.position(profile.id)?;
        profile
            .allowed_starts
            .iter()
            .copied()
            .find(|&start| self.geometry.fits(&self.slots, index, start))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inst(model: MigModel, name: &str, start: u8) -> MigInstance {
        MigInstance {
            profile_id: model.profile(name).unwrap().id,
            start,
        }
    }

    #[test]
    fn table_matches_the_geometry_reference() {
        let h200: Vec<_> = MigModel::H200Gb141
            .profiles()
            .into_iter()
            .map(|p| p.name)
            .collect();
        assert_eq!(
            h200,
            [
                "1g.18gb",
                "1g.18gb+me",
                "1g.35gb",
                "2g.35gb",
                "3g.71gb",
                "4g.71gb",
                "7g.141gb"
            ]
        );
        let p = MigModel::A100Gb80.profile("3g.40gb").unwrap();
        assert_eq!(
            (
                p.id,
                p.memory_slices,
                p.sm_slices,
                p.max_per_gpu,
                p.allowed_starts.as_slice()
            ),
            (9, 4, 3, 2, &[0u8, 4][..])
        );
        // `1g.10gb` is profile 15 on the A100-40GB and profile 19 on the 80GB cards.
        assert_eq!(MigModel::A100Gb40.profile("1g.10gb").unwrap().id, 15);
        assert_eq!(MigModel::A100Gb80.profile("1g.10gb").unwrap().id, 19);
        assert_eq!(MigModel::H100Gb80.profile("0").unwrap().name, "7g.80gb");
        assert!(MigModel::H200Gb141.profile("3g.40gb").is_none());
        assert!(MigModel::H200Gb141.profile("42").is_none());
        assert!(MigModel::H200Gb141
            .profile("1g.18gb+me")
            .unwrap()
            .media_extensions());
    }

    #[test]
    fn starts_match_lgipp() {
        // 19:{0..6}:1 20:{0..6}:1 15:{0,2,4,6}:2 14:{0,2,4}:2 9:{0,4}:4 5:{0}:4 0:{0}:8
        let expected: [(u32, &[u8], u8); 7] = [
            (19, &[0, 1, 2, 3, 4, 5, 6], 1),
            (20, &[0, 1, 2, 3, 4, 5, 6], 1),
            (15, &[0, 2, 4, 6], 2),
            (14, &[0, 2, 4], 2),
            (9, &[0, 4], 4),
            (5, &[0], 4),
            (0, &[0], 8),
        ];
        for model in MigModel::ALL {
            for (id, starts, size) in expected {
                let p = model.profile_by_id(id).unwrap();
                assert_eq!(
                    (p.allowed_starts.as_slice(), p.memory_slices),
                    (starts, size)
                );
                assert!(starts.iter().all(|s| s + size <= MEMORY_SLICES));
            }
        }
    }

    #[test]
    fn detects_models_from_product_names() {
        assert_eq!(
            MigModel::detect("NVIDIA A100 80GB PCIe", 81920),
            Some(MigModel::A100Gb80)
        );
        assert_eq!(
            MigModel::detect("NVIDIA A100-SXM4-40GB", 40960),
            Some(MigModel::A100Gb40)
        );
        assert_eq!(
            MigModel::detect("NVIDIA H100 80GB HBM3", 81559),
            Some(MigModel::H100Gb80)
        );
        assert_eq!(
            MigModel::detect("NVIDIA H200", 143771),
            Some(MigModel::H200Gb141)
        );
        assert_eq!(MigModel::detect("NVIDIA H100 NVL", 95830), None);
        assert_eq!(MigModel::detect("NVIDIA L4", 23034), None);
    }

    #[test]
    fn full_layouts_from_the_reference_fill_all_slices() {
        let m = MigModel::H100Gb80;
        let layouts: [&[(&str, u8)]; 3] = [
            &[("4g.40gb", 0), ("3g.40gb", 4)],
            &[("2g.20gb", 0), ("2g.20gb", 2), ("3g.40gb", 4)],
            &[
                ("1g.10gb", 0),
                ("1g.10gb", 1),
                ("2g.20gb", 2),
                ("3g.40gb", 4),
            ],
        ];
        for layout in layouts {
            let l =
                MigLayout::from_instances(m.geometry(), layout.iter().map(|(n, s)| inst(m, n, *s)))
                    .unwrap();
            assert_eq!(l.occupied(), 0xff);
            assert_eq!(l.free_memory_slices(), 0);
            assert!(l.used_sm_slices() <= SM_SLICES);
        }
    }

    #[test]
    fn invalid_placements_are_refused_with_reasons() {
        let m = MigModel::H200Gb141;
        let mut l = MigLayout::empty(m.geometry());
        assert_eq!(
            l.check(inst(m, "3g.71gb", 2)).unwrap_err().code(),
            "mig_start_not_allowed"
        );
        assert_eq!(
            l.check(inst(m, "1g.18gb", 7)).unwrap_err().code(),
            "mig_start_not_allowed"
        );
        l.place(inst(m, "1g.18gb+me", 0)).unwrap();
        assert_eq!(
            l.check(inst(m, "1g.18gb+me", 3)).unwrap_err().code(),
            "mig_limit_reached"
        );
        assert_eq!(
            l.check(inst(m, "4g.71gb", 0)).unwrap_err().code(),
            "mig_overlap"
        );
        assert_eq!(
            l.check(MigInstance {
                profile_id: 3,
                start: 0
            })
            .unwrap_err()
            .code(),
            "mig_unknown_profile"
        );
    }

    #[test]
    fn at_most_seven_1g_instances() {
        let m = MigModel::A100Gb40;
        let p = m.profile("1g.5gb").unwrap();
        let mut l = MigLayout::empty(m.geometry());
        let mut placed = 0;
        while let Some(start) = l.best_start(&p) {
            l.place(MigInstance {
                profile_id: p.id,
                start,
            })
            .unwrap();
            placed += 1;
        }
        assert_eq!(placed, 7);
        assert_eq!(l.occupied(), 0x7f);
    }

    #[test]
    fn packer_keeps_large_holes_free() {
        let m = MigModel::H200Gb141;
        let empty = MigLayout::empty(m.geometry());
        assert_eq!(empty.best_start(&m.profile("1g.18gb").unwrap()), Some(6));
        assert_eq!(empty.best_start(&m.profile("3g.71gb").unwrap()), Some(4));
        assert_eq!(empty.best_start(&m.profile("4g.71gb").unwrap()), Some(0));
        assert_eq!(empty.best_start(&m.profile("1g.35gb").unwrap()), Some(6));
        // After one 1g the 4g must still fit.
        let mut l = empty.clone();
        l.place(inst(m, "1g.18gb", 6)).unwrap();
        assert_eq!(l.best_start(&m.profile("4g.71gb").unwrap()), Some(0));
        // A 2g placed on an empty GPU leaves the 4g (the larger profile) placeable.
        let start = empty.best_start(&m.profile("2g.35gb").unwrap()).unwrap();
        let mut l = empty.clone();
        l.place(inst(m, "2g.35gb", start)).unwrap();
        assert_eq!(l.valid_starts(&m.profile("4g.71gb").unwrap()).len(), 1);
        assert_eq!(
            empty.first_fit_start(&m.profile("1g.18gb").unwrap()),
            Some(0)
        );
    }

    #[test]
    fn remove_restores_the_layout() {
        let m = MigModel::A100Gb80;
        let mut l = MigLayout::empty(m.geometry());
        let a = inst(m, "2g.20gb", 2);
        l.place(a).unwrap();
        let before = l.clone();
        let b = inst(m, "3g.40gb", 4);
        l.place(b).unwrap();
        assert!(l.remove(b));
        assert_eq!(l, before);
        assert!(!l.remove(b));
    }

    #[test]
    fn memory_is_proportional_to_slices() {
        let p = MigModel::H200Gb141.profile("1g.18gb").unwrap();
        assert_eq!(p.memory_mib(143771), 17971);
        let full = MigModel::H200Gb141.profile("7g.141gb").unwrap();
        assert_eq!(full.memory_mib(143771), 143771);
    }
}

#[cfg(test)]
mod geometry_tests {
    use super::*;

    fn profile(id: u32, name: &str, size: u8, sm: u8, max: u8, starts: &[u8]) -> MigProfile {
        MigProfile {
            id,
            name: name.into(),
            memory_slices: size,
            sm_slices: sm,
            max_per_gpu: max,
            allowed_starts: starts.to_vec(),
            driver_memory_mib: Some(6000 * u64::from(size)),
        }
    }

    #[test]
    fn driver_geometries_place_like_the_table() {
        // An A30-like card: 4 memory slices used as 1g/2g/4g.
        let g = Arc::new(
            MigGeometry::from_driver(
                "NVIDIA A30",
                vec![
                    profile(14, "1g.6gb", 1, 1, 4, &[0, 1, 2, 3]),
                    profile(5, "2g.12gb", 2, 2, 2, &[0, 2]),
                    profile(0, "4g.24gb", 4, 4, 1, &[0]),
                ],
            )
            .unwrap(),
        );
        let mut l = MigLayout::empty(Arc::clone(&g));
        let one = g.profile("1g.6gb").unwrap().clone();
        let start = l.best_start(&one).unwrap();
        assert_eq!(start, 3, "keeps 2g@0 and 2g@2's first half free");
        l.place(MigInstance {
            profile_id: 14,
            start,
        })
        .unwrap();
        assert_eq!(l.valid_starts(g.profile("2g.12gb").unwrap()), [0]);
        assert_eq!(one.memory_mib(24000), 6000, "the driver's memory wins");
        assert_eq!(g.sm_slices(), 4);
        assert_eq!(g.model(), None);
        assert_eq!(
            l.check(MigInstance {
                profile_id: 9,
                start: 0
            })
            .unwrap_err()
            .code(),
            "mig_unknown_profile"
        );
    }

    #[test]
    fn bad_driver_geometries_are_refused() {
        let ok = profile(1, "1g", 1, 1, 1, &[0]);
        let cases = [
            (vec![], "mig_geometry_empty"),
            (
                vec![ok.clone(), ok.clone()],
                "mig_geometry_duplicate_profile",
            ),
            (
                vec![profile(2, "4g", 4, 4, 1, &[6])],
                "mig_geometry_out_of_range",
            ),
            (vec![profile(3, "0g", 0, 1, 1, &[0])], "mig_geometry_zero"),
            (
                (0..17).map(|i| profile(i, "x", 1, 1, 1, &[0])).collect(),
                "mig_geometry_too_many_profiles",
            ),
        ];
        for (profiles, code) in cases {
            assert_eq!(
                MigGeometry::from_driver("x", profiles).unwrap_err().code(),
                code
            );
        }
    }

    #[test]
    fn table_geometries_are_shared() {
        let a = MigModel::H100Gb80.geometry();
        let b = MigModel::H100Gb80.geometry();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(a.model(), Some(MigModel::H100Gb80));
        assert_eq!(a.sm_slices(), SM_SLICES);
    }
}
