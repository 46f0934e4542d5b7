//! Resource limits of a sandbox: memory, CPU and process count. A template sets defaults; a
//! sandbox may override each field at creation.

use serde::{Deserialize, Serialize};

pub const MIN_MEMORY_MIB: u64 = 32;
pub const MAX_MEMORY_MIB: u64 = 1024 * 1024;
pub const MAX_CPUS: f64 = 1024.0;
pub const MAX_PIDS: u64 = 1 << 22;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Memory limit in MiB (the sandbox's whole footprint: sentry, gofer and guest memory).
    pub memory_mib: u64,
    /// CPU limit in cores (fractions allowed), enforced as a CFS quota.
    pub cpus: f64,
    /// Maximum number of processes and threads inside the sandbox.
    pub pids: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory_mib: 512,
            cpus: 1.0,
            pids: 256,
        }
    }
}

/// A partial [`Limits`]: what a sandbox overrides of its template's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsPatch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LimitsError {
    #[error("limits.memory_mib must be between {MIN_MEMORY_MIB} and {MAX_MEMORY_MIB}, got {0}")]
    Memory(u64),
    #[error("limits.cpus must be above 0 and at most {MAX_CPUS}, got {0}")]
    Cpus(f64),
    #[error("limits.pids must be between 1 and {MAX_PIDS}, got {0}")]
    Pids(u64),
}

impl Limits {
    pub fn validate(&self) -> Result<(), LimitsError> {
        if !(MIN_MEMORY_MIB..=MAX_MEMORY_MIB).contains(&self.memory_mib) {
            return Err(LimitsError::Memory(self.memory_mib));
        }
        if !(self.cpus > 0.0 && self.cpus <= MAX_CPUS) {
            return Err(LimitsError::Cpus(self.cpus));
        }
        if !(1..=MAX_PIDS).contains(&self.pids) {
            return Err(LimitsError::Pids(self.pids));
        }
        Ok(())
    }

    /// These limits with `patch` applied, validated.
    pub fn patched(&self, patch: &LimitsPatch) -> Result<Limits, LimitsError> {
        let out = Limits {
            memory_mib: patch.memory_mib.unwrap_or(self.memory_mib),
            cpus: patch.cpus.unwrap_or(self.cpus),
            pids: patch.pids.unwrap_or(self.pids),
        };
        out.validate()?;
        Ok(out)
    }

    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib * 1024 * 1024
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patch_overrides_and_validates() {
        let base = Limits::default();
        let p = LimitsPatch {
            memory_mib: Some(128),
            ..Default::default()
        };
        assert_eq!(base.patched(&p).unwrap().memory_mib, 128);
        let bad = LimitsPatch {
            cpus: Some(0.0),
            ..Default::default()
        };
        assert_eq!(base.patched(&bad), Err(LimitsError::Cpus(0.0)));
        let nan = LimitsPatch {
            cpus: Some(f64::NAN),
            ..Default::default()
        };
        assert!(base.patched(&nan).is_err());
    }
}
