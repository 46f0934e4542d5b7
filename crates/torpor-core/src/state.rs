//! The sleep ladder as a state machine.
//!
//! ```text
//!              create (restore golden snapshot)
//!   Creating ------------------------------------> Running <----------------------+
//!                                                  |   ^                          |
//!                                         freeze   v   | thaw                     |
//!                                                Frozen                          |
//!                                                  |                              |
//!           Running | Frozen --checkpoint--> Checkpointing --> Parked            |
//!                                                               |   \            |
//!                                                        upload v    \ wake      |
//!                                                  Uploading --> Suspended      |
//!                                                               |  wake          |
//!                                          Parked | Suspended --+--> Resuming --+
//!
//!   any stable state --delete--> Deleting --> (row removed)
//! ```
//!
//! Transitional states (Creating, Checkpointing, Uploading, Resuming, Deleting) are written to the
//! state store *before* their side effect and replaced by a stable state *after* it. A daemon that
//! dies in between finds them on start and resolves each one ([`SandboxState::recovery`]).
//!
//! A sandbox that crashes (its process tree dies, or the memory limit kills it) goes back to its
//! last committed snapshot: Running/Frozen → Parked (or Suspended), with the reason recorded.

use serde::{Deserialize, Serialize};

/// Where a sandbox's state lives, from hottest to coldest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// In a worker, processes scheduled.
    Running,
    /// In a worker, processes stopped by the cgroup freezer; memory kept, no CPU.
    Frozen,
    /// Checkpoint image on this node's disk; worker and memory released.
    Parked,
    /// Checkpoint in the snapshot store; any node can wake it.
    Suspended,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Running, Tier::Frozen, Tier::Parked, Tier::Suspended];

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Running => "running",
            Tier::Frozen => "frozen",
            Tier::Parked => "parked",
            Tier::Suspended => "suspended",
        }
    }

    /// Whether this tier holds a worker (and the memory of a resident sandbox).
    pub fn is_resident(self) -> bool {
        matches!(self, Tier::Running | Tier::Frozen)
    }

    pub fn parse(s: &str) -> Option<Tier> {
        Tier::ALL.into_iter().find(|t| t.as_str() == s)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    Creating,
    Running,
    Frozen,
    Checkpointing,
    Parked,
    Uploading,
    Suspended,
    Resuming,
    Deleting,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot go from {from} to {to}")]
pub struct TransitionError {
    pub from: SandboxState,
    pub to: SandboxState,
}

/// What the daemon does at start with a sandbox found in a given state: every transitional
/// state resolves to a stable one, and no sandbox stays stuck.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// Stable and not resident: nothing to do.
    Keep,
    /// It was (or was becoming) resident, and its runsc container died with the daemon: go back
    /// to the last committed snapshot.
    BackToSnapshot,
    /// Creation never committed: remove the row and whatever was made for it.
    DropCreation,
    /// Deletion was under way: finish it.
    FinishDelete,
}

impl SandboxState {
    pub const ALL: [SandboxState; 9] = [
        SandboxState::Creating,
        SandboxState::Running,
        SandboxState::Frozen,
        SandboxState::Checkpointing,
        SandboxState::Parked,
        SandboxState::Uploading,
        SandboxState::Suspended,
        SandboxState::Resuming,
        SandboxState::Deleting,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Creating => "creating",
            SandboxState::Running => "running",
            SandboxState::Frozen => "frozen",
            SandboxState::Checkpointing => "checkpointing",
            SandboxState::Parked => "parked",
            SandboxState::Uploading => "uploading",
            SandboxState::Suspended => "suspended",
            SandboxState::Resuming => "resuming",
            SandboxState::Deleting => "deleting",
        }
    }

    pub fn parse(s: &str) -> Option<SandboxState> {
        SandboxState::ALL.into_iter().find(|st| st.as_str() == s)
    }

    pub fn is_transitional(self) -> bool {
        matches!(
            self,
            SandboxState::Creating
                | SandboxState::Checkpointing
                | SandboxState::Uploading
                | SandboxState::Resuming
                | SandboxState::Deleting
        )
    }

    /// Whether a runsc container may exist for a sandbox in this state.
    pub fn may_have_container(self) -> bool {
        matches!(
            self,
            SandboxState::Creating
                | SandboxState::Running
                | SandboxState::Frozen
                | SandboxState::Checkpointing
                | SandboxState::Resuming
        )
    }

    /// The transition table. Everything not listed is refused.
    pub fn can_transition_to(self, to: SandboxState) -> bool {
        use SandboxState::*;
        matches!(
            (self, to),
            (Creating, Running)
                | (Running, Frozen)
                | (Frozen, Running)
                | (Running | Frozen, Checkpointing)
                | (Checkpointing, Parked | Suspended)
                | (Parked, Uploading)
                | (Uploading, Suspended | Parked)
                | (Parked | Suspended, Resuming)
                | (Resuming, Running | Parked | Suspended)
                // A crash sends a resident sandbox back to its last snapshot.
                | (Running | Frozen, Parked | Suspended)
                | (Creating | Running | Frozen | Parked | Suspended, Deleting)
        )
    }

    pub fn check_transition(self, to: SandboxState) -> Result<(), TransitionError> {
        if self.can_transition_to(to) {
            Ok(())
        } else {
            Err(TransitionError { from: self, to })
        }
    }

    pub fn recovery(self) -> Recovery {
        use SandboxState::*;
        match self {
            Parked | Suspended => Recovery::Keep,
            Running | Frozen | Checkpointing | Resuming | Uploading => Recovery::BackToSnapshot,
            Creating => Recovery::DropCreation,
            Deleting => Recovery::FinishDelete,
        }
    }
}

impl std::fmt::Display for SandboxState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_transitional_state_recovers_to_something() {
        for s in SandboxState::ALL {
            if s.is_transitional() {
                assert_ne!(s.recovery(), Recovery::Keep, "{s} would stay stuck");
            }
        }
    }

    #[test]
    fn ladder_order_is_enforced() {
        use SandboxState::*;
        assert!(Running.can_transition_to(Frozen));
        assert!(!Parked.can_transition_to(Frozen));
        assert!(!Suspended.can_transition_to(Running));
        assert!(!Deleting.can_transition_to(Running));
        assert_eq!(
            Parked.check_transition(Frozen),
            Err(TransitionError {
                from: Parked,
                to: Frozen
            })
        );
    }

    #[test]
    fn names_round_trip() {
        for s in SandboxState::ALL {
            assert_eq!(SandboxState::parse(s.as_str()), Some(s));
            assert_eq!(
                serde_json::to_string(&s).unwrap(),
                format!("\"{}\"", s.as_str())
            );
        }
        for t in Tier::ALL {
            assert_eq!(Tier::parse(t.as_str()), Some(t));
        }
    }
}
