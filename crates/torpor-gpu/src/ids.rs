//! Identity newtypes used by the GPU engine.
//!
//! These belong in `torpor-core` once that crate exists; they live here so that `torpor-gpu`
//! stands alone until then. Every identity is validated when it is built (and when it is
//! deserialized), so the rest of the crate never sees a malformed one.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Why a string was refused as an identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("{kind} must not be empty")]
    Empty { kind: &'static str },
    #[error("{kind} {value:?} must start with {prefix:?}")]
    MissingPrefix {
        kind: &'static str,
        value: String,
        prefix: &'static str,
    },
    #[error("{kind} {value:?} is longer than {max} characters")]
    TooLong {
        kind: &'static str,
        value: String,
        max: usize,
    },
    #[error(
        "{kind} {value:?} contains {found:?}; allowed are ASCII letters, digits, '-', '_' and '.'"
    )]
    BadCharacter {
        kind: &'static str,
        value: String,
        found: char,
    },
}

impl IdError {
    /// Stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            IdError::Empty { .. } => "id_empty",
            IdError::MissingPrefix { .. } => "id_missing_prefix",
            IdError::TooLong { .. } => "id_too_long",
            IdError::BadCharacter { .. } => "id_bad_character",
        }
    }
}

const MAX_ID_LEN: usize = 128;

fn check_token(kind: &'static str, value: &str) -> Result<(), IdError> {
    if value.is_empty() {
        return Err(IdError::Empty { kind });
    }
    if value.len() > MAX_ID_LEN {
        return Err(IdError::TooLong {
            kind,
            value: value.to_owned(),
            max: MAX_ID_LEN,
        });
    }
    if let Some(found) = value
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(IdError::BadCharacter {
            kind,
            value: value.to_owned(),
            found,
        });
    }
    Ok(())
}

fn check_prefixed(kind: &'static str, prefix: &'static str, value: &str) -> Result<(), IdError> {
    check_token(kind, value)?;
    if !value.starts_with(prefix) || value.len() == prefix.len() {
        return Err(IdError::MissingPrefix {
            kind,
            value: value.to_owned(),
            prefix,
        });
    }
    Ok(())
}

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident, $kind:literal, $check:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// Validates and wraps `value`.
            pub fn new(value: impl Into<String>) -> Result<Self, IdError> {
                let value = value.into();
                let check: fn(&str) -> Result<(), IdError> = $check;
                check(&value)?;
                Ok(Self(value))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(value: String) -> Result<Self, IdError> {
                Self::new(value)
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

string_id!(
    /// A physical GPU's UUID as NVML reports it (`GPU-…`).
    GpuUuid,
    "GPU UUID",
    |v| check_prefixed("GPU UUID", "GPU-", v)
);
string_id!(
    /// A MIG device's UUID as NVML reports it (`MIG-…`); known only once the instance exists.
    MigUuid,
    "MIG UUID",
    |v| check_prefixed("MIG UUID", "MIG-", v)
);
string_id!(
    /// The tenant that owns a sandbox and holds quotas.
    TenantId,
    "tenant id",
    |v| check_token("tenant id", v)
);
string_id!(
    /// A node (machine) name, as in the inventory and in Kubernetes.
    NodeName,
    "node name",
    |v| check_token("node name", v)
);

/// A GPU's index on its node (NVML index, `GPU<n>` in `nvidia-smi topo -m`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
#[serde(transparent)]
pub struct GpuIndex(pub u32);

impl fmt::Display for GpuIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GPU{}", self.0)
    }
}

/// One allocation made by the planner; assigned by the [`crate::ledger::Ledger`] in
/// increasing order, so a larger id is a newer allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct AllocationId(pub u64);

impl fmt::Display for AllocationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "alloc-{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_uuid_requires_prefix() {
        assert!(GpuUuid::new("GPU-3b9e1a70-0c1d").is_ok());
        assert_eq!(
            GpuUuid::new("3b9e1a70").unwrap_err().code(),
            "id_missing_prefix"
        );
        assert_eq!(
            GpuUuid::new("GPU-").unwrap_err().code(),
            "id_missing_prefix"
        );
        assert_eq!(GpuUuid::new("").unwrap_err().code(), "id_empty");
    }

    #[test]
    fn tenant_rejects_bad_characters_and_length() {
        assert!(TenantId::new("team-a.prod_1").is_ok());
        assert_eq!(
            TenantId::new("team a").unwrap_err(),
            IdError::BadCharacter {
                kind: "tenant id",
                value: "team a".into(),
                found: ' '
            }
        );
        assert_eq!(
            TenantId::new("x".repeat(129)).unwrap_err().code(),
            "id_too_long"
        );
    }

    #[test]
    fn ids_round_trip_through_serde() {
        let id: MigUuid = serde_json::from_str("\"MIG-abc\"").unwrap();
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"MIG-abc\"");
        assert!(serde_json::from_str::<MigUuid>("\"GPU-abc\"").is_err());
        assert_eq!(serde_json::to_string(&AllocationId(7)).unwrap(), "7");
    }
}
