//! Identities owned by the snapshot store: [`SnapshotId`] (a name chosen by the store or the
//! caller) and [`ChunkId`] (the BLAKE3 hash of a chunk's plaintext).
//!
//! `SnapshotId` lives here until `torpor-core` exists; it will move there unchanged.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Longest snapshot id accepted, in bytes.
pub const MAX_SNAPSHOT_ID_LEN: usize = 128;

/// Why a string is not a valid identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("snapshot id is empty")]
    Empty,
    #[error("snapshot id is longer than {MAX_SNAPSHOT_ID_LEN} bytes")]
    TooLong,
    #[error("snapshot id holds a character outside [A-Za-z0-9._-] or starts with '.'")]
    BadCharacter,
    #[error("chunk id is not 64 lowercase hex digits")]
    BadChunkId,
}

impl IdError {
    /// Stable, machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            IdError::Empty => "snapshot_id_empty",
            IdError::TooLong => "snapshot_id_too_long",
            IdError::BadCharacter => "snapshot_id_bad_character",
            IdError::BadChunkId => "chunk_id_invalid",
        }
    }
}

/// Name of one snapshot. Safe to use as an object key or file name: `[A-Za-z0-9._-]`, not
/// starting with `.`, 1..=128 bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SnapshotId(String);

impl SnapshotId {
    /// Validates `s` as a snapshot id.
    pub fn new(s: impl Into<String>) -> Result<Self, IdError> {
        let s = s.into();
        if s.is_empty() {
            return Err(IdError::Empty);
        }
        if s.len() > MAX_SNAPSHOT_ID_LEN {
            return Err(IdError::TooLong);
        }
        let ok = s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
        if !ok || s.starts_with('.') {
            return Err(IdError::BadCharacter);
        }
        Ok(SnapshotId(s))
    }

    /// A fresh id, unique across processes and machines with overwhelming probability:
    /// `snap-` and 32 hex digits of BLAKE3 over time, process id, a counter and a stack address.
    pub fn generate() -> Self {
        SnapshotId(format!("snap-{}", unique_hex(16)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for SnapshotId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SnapshotId::new(s)
    }
}

/// BLAKE3 hash of a chunk's plaintext (keyed with the tenant key when encryption is on).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(pub [u8; 32]);

impl ChunkId {
    /// Hash of `data` with plain BLAKE3.
    pub fn of(data: &[u8]) -> Self {
        ChunkId(*blake3::hash(data).as_bytes())
    }

    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 0x0f)]));
        }
        s
    }

    pub fn from_hex(s: &str) -> Result<Self, IdError> {
        let bytes = s.as_bytes();
        if bytes.len() != 64 {
            return Err(IdError::BadChunkId);
        }
        let mut out = [0u8; 32];
        for (i, pair) in bytes.chunks_exact(2).enumerate() {
            let hi = hex_val(pair[0]).ok_or(IdError::BadChunkId)?;
            let lo = hex_val(pair[1]).ok_or(IdError::BadChunkId)?;
            out[i] = (hi << 4) | lo;
        }
        Ok(ChunkId(out))
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

impl fmt::Debug for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkId({})", self.to_hex())
    }
}

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// `n` bytes of unpredictable-enough hex for temporary names and generated ids. Not a secret.
pub(crate) fn unique_hex(n: usize) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let local = 0u8;
    let mut h = blake3::Hasher::new();
    h.update(&nanos.to_le_bytes());
    h.update(&std::process::id().to_le_bytes());
    h.update(&COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    h.update(&(std::ptr::addr_of!(local) as usize).to_le_bytes());
    let hex = ChunkId(*h.finalize().as_bytes()).to_hex();
    hex[..(2 * n).min(64)].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_id_validation() {
        assert!(SnapshotId::new("snap-01_a.b").is_ok());
        assert_eq!(SnapshotId::new(""), Err(IdError::Empty));
        assert_eq!(SnapshotId::new("../x"), Err(IdError::BadCharacter));
        assert_eq!(SnapshotId::new(".hidden"), Err(IdError::BadCharacter));
        assert_eq!(SnapshotId::new("a/b"), Err(IdError::BadCharacter));
        assert_eq!(SnapshotId::new("x".repeat(129)), Err(IdError::TooLong));
    }

    #[test]
    fn generated_ids_are_valid_and_distinct() {
        let a = SnapshotId::generate();
        let b = SnapshotId::generate();
        assert_ne!(a, b);
        assert_eq!(SnapshotId::new(a.as_str()), Ok(a));
    }

    #[test]
    fn chunk_id_hex_round_trip() {
        let id = ChunkId::of(b"hello");
        assert_eq!(ChunkId::from_hex(&id.to_hex()), Ok(id));
        assert_eq!(ChunkId::from_hex("zz"), Err(IdError::BadChunkId));
        assert_eq!(
            ChunkId::from_hex(&"A".repeat(64)),
            Err(IdError::BadChunkId),
            "uppercase is rejected so one chunk has one key"
        );
    }
}
