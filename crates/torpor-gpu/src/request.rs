//! What a sandbox asks for: a GPU request, and a gang of them that must land together.
//!
//! The JSON shape (one object per line in `torpor gpu plan --requests`) is
//! `{count, mode: whole|mig|mps|timeslice, profile?, compute_pct?, memory_mib?,
//! same_nvlink_domain?, numa_local?, tenant?, model?}`. Unknown keys are refused. This module
//! checks the request's shape only; whether it fits a node is the planner's business.

use serde::{Deserialize, Serialize};

use crate::ids::TenantId;
use crate::partition::PartitionMode;

fn one() -> u32 {
    1
}

fn is_false(value: &bool) -> bool {
    !*value
}

/// Largest number of devices one request may name.
pub const MAX_COUNT: u32 = 64;
/// Largest gang.
pub const MAX_GANG: usize = 64;

/// A request for GPU shares on one node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuRequest {
    /// Number of devices, each on a different GPU.
    #[serde(default = "one")]
    pub count: u32,
    pub mode: PartitionMode,
    /// MIG profile by name for the GPU's model (`3g.71gb`) or by id (`9`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// MPS active-thread percentage (1..=100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_pct: Option<u32>,
    /// MPS pinned memory limit, or for MIG without a profile the memory the smallest fitting
    /// profile must have.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// All devices (and, in a gang, all the gang's devices) pairwise joined by NVLink.
    #[serde(default, skip_serializing_if = "is_false")]
    pub same_nvlink_domain: bool,
    /// All devices (and, in a gang, all the gang's devices) on one NUMA node.
    #[serde(default, skip_serializing_if = "is_false")]
    pub numa_local: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<TenantId>,
    /// Only GPUs whose product name is exactly this (used when waking on the same model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

impl GpuRequest {
    /// A request for `count` devices in `mode` with every option unset.
    pub fn new(mode: PartitionMode, count: u32) -> Self {
        GpuRequest {
            count,
            mode,
            profile: None,
            compute_pct: None,
            memory_mib: None,
            same_nvlink_domain: false,
            numa_local: false,
            tenant: None,
            model: None,
        }
    }

    pub fn whole(count: u32) -> Self {
        Self::new(PartitionMode::Whole, count)
    }

    pub fn mig(profile: &str) -> Self {
        GpuRequest {
            profile: Some(profile.to_owned()),
            ..Self::new(PartitionMode::Mig, 1)
        }
    }

    pub fn mps(compute_pct: u32, memory_mib: Option<u64>) -> Self {
        GpuRequest {
            compute_pct: Some(compute_pct),
            memory_mib,
            ..Self::new(PartitionMode::Mps, 1)
        }
    }

    pub fn timeslice() -> Self {
        Self::new(PartitionMode::Timeslice, 1)
    }

    pub fn for_tenant(mut self, tenant: TenantId) -> Self {
        self.tenant = Some(tenant);
        self
    }

    /// Checks the request's shape, independent of any node.
    pub fn validate(&self) -> Result<(), RequestError> {
        let mode = self.mode;
        if self.count == 0 || self.count > MAX_COUNT {
            return Err(RequestError::BadCount {
                count: self.count,
                max: MAX_COUNT,
            });
        }
        let not_for = |field: &'static str| RequestError::FieldNotForMode { field, mode };
        match mode {
            PartitionMode::Whole => {
                if self.profile.is_some() {
                    return Err(not_for("profile"));
                }
                if self.compute_pct.is_some() {
                    return Err(not_for("compute_pct"));
                }
                if self.memory_mib.is_some() {
                    return Err(not_for("memory_mib"));
                }
            }
            PartitionMode::Mig => {
                if self.compute_pct.is_some() {
                    return Err(not_for("compute_pct"));
                }
                if self.profile.is_none() && self.memory_mib.is_none() {
                    return Err(RequestError::MigNeedsProfile);
                }
            }
            PartitionMode::Mps => {
                if self.profile.is_some() {
                    return Err(not_for("profile"));
                }
                match self.compute_pct {
                    None => return Err(RequestError::MpsNeedsComputePct),
                    Some(pct) if pct == 0 || pct > 100 => {
                        return Err(RequestError::ComputePctOutOfRange { value: pct })
                    }
                    Some(_) => {}
                }
            }
            PartitionMode::Timeslice => {
                if self.profile.is_some() {
                    return Err(not_for("profile"));
                }
                for (field, set) in [
                    ("compute_pct", self.compute_pct.is_some()),
                    ("memory_mib", self.memory_mib.is_some()),
                ] {
                    if set {
                        return Err(RequestError::TimesliceNoIsolation { field });
                    }
                }
            }
        }
        if self.memory_mib == Some(0) {
            return Err(RequestError::ZeroMemory);
        }
        Ok(())
    }
}

/// Agents that must all land, on GPUs with the best pairwise topology score, or none do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GangRequest {
    pub members: Vec<GpuRequest>,
}

impl GangRequest {
    pub fn validate(&self) -> Result<(), RequestError> {
        if self.members.is_empty() || self.members.len() > MAX_GANG {
            return Err(RequestError::BadGangSize {
                size: self.members.len(),
                max: MAX_GANG,
            });
        }
        for (member, request) in self.members.iter().enumerate() {
            request.validate().map_err(|source| RequestError::Member {
                member,
                source: Box::new(source),
            })?;
        }
        Ok(())
    }
}

/// Why a request's shape was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("count {count} must be between 1 and {max}")]
    BadCount { count: u32, max: u32 },
    #[error("{field} does not apply to mode {mode}")]
    FieldNotForMode {
        field: &'static str,
        mode: PartitionMode,
    },
    #[error("a MIG request needs a profile or memory_mib")]
    MigNeedsProfile,
    #[error("an MPS request needs compute_pct")]
    MpsNeedsComputePct,
    #[error("compute_pct {value} must be between 1 and 100")]
    ComputePctOutOfRange { value: u32 },
    #[error(
        "time-slice shares have no memory or compute isolation; remove {field} or use mps or mig"
    )]
    TimesliceNoIsolation { field: &'static str },
    #[error("memory_mib must be greater than zero")]
    ZeroMemory,
    #[error("a gang has {size} members; it must have between 1 and {max}")]
    BadGangSize { size: usize, max: usize },
    #[error("gang member {member}: {source}")]
    Member {
        member: usize,
        source: Box<RequestError>,
    },
}

impl RequestError {
    pub fn code(&self) -> &'static str {
        match self {
            RequestError::BadCount { .. } => "request_bad_count",
            RequestError::FieldNotForMode { .. } => "request_field_not_for_mode",
            RequestError::MigNeedsProfile => "request_mig_needs_profile",
            RequestError::MpsNeedsComputePct => "request_mps_needs_compute_pct",
            RequestError::ComputePctOutOfRange { .. } => "request_compute_pct_out_of_range",
            RequestError::TimesliceNoIsolation { .. } => "request_timeslice_no_isolation",
            RequestError::ZeroMemory => "request_zero_memory",
            RequestError::BadGangSize { .. } => "request_bad_gang_size",
            RequestError::Member { source, .. } => source.code(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_json_shape() {
        let r: GpuRequest = serde_json::from_str(
            r#"{"count":2,"mode":"mig","profile":"3g.71gb","same_nvlink_domain":true,"tenant":"team-a"}"#,
        )
        .unwrap();
        assert_eq!(r.count, 2);
        assert_eq!(r.profile.as_deref(), Some("3g.71gb"));
        assert!(r.same_nvlink_domain && !r.numa_local);
        assert!(r.validate().is_ok());
        let d: GpuRequest = serde_json::from_str(r#"{"mode":"timeslice"}"#).unwrap();
        assert_eq!(d, GpuRequest::timeslice());
        assert!(serde_json::from_str::<GpuRequest>(r#"{"mode":"mps","gpus":1}"#).is_err());
        assert!(serde_json::from_str::<GpuRequest>(r#"{"mode":"mig","tenant":"a b"}"#).is_err());
    }

    #[test]
    fn round_trips_without_unset_fields() {
        let r = GpuRequest::mps(25, Some(4096));
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(
            json,
            r#"{"count":1,"mode":"mps","compute_pct":25,"memory_mib":4096}"#
        );
        assert_eq!(serde_json::from_str::<GpuRequest>(&json).unwrap(), r);
    }

    #[test]
    fn shape_errors_have_codes() {
        let cases = [
            (GpuRequest::whole(0), "request_bad_count"),
            (GpuRequest::whole(65), "request_bad_count"),
            (
                GpuRequest {
                    profile: Some("1g.10gb".into()),
                    ..GpuRequest::whole(1)
                },
                "request_field_not_for_mode",
            ),
            (
                GpuRequest::new(PartitionMode::Mig, 1),
                "request_mig_needs_profile",
            ),
            (
                GpuRequest::new(PartitionMode::Mps, 1),
                "request_mps_needs_compute_pct",
            ),
            (GpuRequest::mps(0, None), "request_compute_pct_out_of_range"),
            (
                GpuRequest::mps(101, None),
                "request_compute_pct_out_of_range",
            ),
            (GpuRequest::mps(10, Some(0)), "request_zero_memory"),
            (
                GpuRequest {
                    memory_mib: Some(1024),
                    ..GpuRequest::timeslice()
                },
                "request_timeslice_no_isolation",
            ),
        ];
        for (request, code) in cases {
            assert_eq!(request.validate().unwrap_err().code(), code, "{request:?}");
        }
    }

    #[test]
    fn gang_validation_names_the_member() {
        let gang = GangRequest {
            members: vec![GpuRequest::whole(1), GpuRequest::mps(200, None)],
        };
        let err = gang.validate().unwrap_err();
        assert_eq!(err.code(), "request_compute_pct_out_of_range");
        assert!(err.to_string().starts_with("gang member 1: "));
        assert_eq!(
            GangRequest { members: vec![] }
                .validate()
                .unwrap_err()
                .code(),
            "request_bad_gang_size"
        );
    }
}
