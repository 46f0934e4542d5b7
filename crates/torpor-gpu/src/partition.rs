//! Partition modes of one GPU and the guard on changing them.
//!
//! ```text
//!            (only while the GPU holds no share)
//!   Whole <------------------------------------> Mig        (Mig needs a MIG-capable GPU
//!     ^  \                                      /  ^         with known geometry)
//!     |   +-------------> Mps <---------------+    |
//!     v                    ^                        v
//!   Timeslice <------------+-------------------> (any)
//! ```
//!
//! Every mode can become every other mode, but only when the GPU is empty: switching MIG on
//! or off resets the GPU, and MPS or time-slicing cannot be changed under running clients.

use std::fmt;

use serde::{Deserialize, Serialize};

/// How one GPU is shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PartitionMode {
    /// One share holds the whole GPU.
    Whole,
    /// Hardware-isolated MIG instances.
    Mig,
    /// MPS clients, each with an active-thread percentage and a pinned memory limit.
    Mps,
    /// Time-sliced replicas: N per GPU, no memory isolation.
    Timeslice,
}

impl PartitionMode {
    pub const ALL: [PartitionMode; 4] = [
        PartitionMode::Whole,
        PartitionMode::Mig,
        PartitionMode::Mps,
        PartitionMode::Timeslice,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PartitionMode::Whole => "whole",
            PartitionMode::Mig => "mig",
            PartitionMode::Mps => "mps",
            PartitionMode::Timeslice => "timeslice",
        }
    }

    /// Whether a GPU in mode `self` may switch to `to`. `shares` is the number of shares the
    /// GPU holds; `mig_ready` says whether it is MIG-capable with known geometry.
    pub fn can_change_to(
        self,
        to: PartitionMode,
        shares: usize,
        mig_ready: bool,
    ) -> Result<(), ModeChangeError> {
        if self == to {
            return Ok(());
        }
        if shares > 0 {
            return Err(ModeChangeError::NotEmpty {
                from: self,
                to,
                shares,
            });
        }
        if to == PartitionMode::Mig && !mig_ready {
            return Err(ModeChangeError::MigUnavailable);
        }
        Ok(())
    }
}

impl fmt::Display for PartitionMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a GPU may not change mode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModeChangeError {
    #[error("cannot switch from {from} to {to} while the GPU holds {shares} share(s)")]
    NotEmpty {
        from: PartitionMode,
        to: PartitionMode,
        shares: usize,
    },
    #[error("the GPU is not MIG-capable or its MIG geometry is unknown")]
    MigUnavailable,
}

impl ModeChangeError {
    pub fn code(&self) -> &'static str {
        match self {
            ModeChangeError::NotEmpty { .. } => "mode_change_not_empty",
            ModeChangeError::MigUnavailable => "mode_change_mig_unavailable",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_change_only_when_empty() {
        for from in PartitionMode::ALL {
            for to in PartitionMode::ALL {
                assert!(from.can_change_to(to, 0, true).is_ok());
                let busy = from.can_change_to(to, 2, true);
                if from == to {
                    assert!(busy.is_ok());
                } else {
                    assert_eq!(busy.unwrap_err().code(), "mode_change_not_empty");
                }
            }
        }
    }

    #[test]
    fn mig_needs_a_capable_gpu() {
        assert_eq!(
            PartitionMode::Whole.can_change_to(PartitionMode::Mig, 0, false),
            Err(ModeChangeError::MigUnavailable)
        );
        assert!(PartitionMode::Mig
            .can_change_to(PartitionMode::Whole, 0, false)
            .is_ok());
    }

    #[test]
    fn serde_uses_lowercase_names() {
        assert_eq!(
            serde_json::to_string(&PartitionMode::Timeslice).unwrap(),
            "\"timeslice\""
        );
        let m: PartitionMode = serde_json::from_str("\"mps\"").unwrap();
        assert_eq!(m, PartitionMode::Mps);
        assert!(serde_json::from_str::<PartitionMode>("\"MIG\"").is_err());
    }
}
