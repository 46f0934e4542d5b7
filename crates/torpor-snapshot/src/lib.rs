//! torpor-snapshot: a content-addressed, deduplicated, verified store for sandbox checkpoints.
//!
//! See README.md for the on-disk format and how the pieces fit.

pub mod chunk;
pub mod gvisor;
pub mod id;
pub mod manifest;

pub use chunk::{ChunkCodec, ChunkError, TenantKey};
pub use id::{ChunkId, IdError, SnapshotId};
pub use manifest::{Manifest, ManifestError};
