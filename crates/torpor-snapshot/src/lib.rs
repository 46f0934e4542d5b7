//! torpor-snapshot: a content-addressed, deduplicated, verified store for sandbox checkpoints.
//!
//! A checkpoint directory is cut into content-defined chunks (FastCDC), each named by its
//! BLAKE3 hash, compressed with zstd where that pays and uploaded only when the store lacks it;
//! a versioned, checksummed manifest listing every file as chunks is written last and is the
//! commit marker. gVisor checkpoint images are stored as their inflated stream so that
//! snapshots of related sandboxes deduplicate. See README.md for the formats.
//!
//! ```no_run
//! # async fn demo() -> Result<(), torpor_snapshot::StoreError> {
//! use torpor_snapshot::Store;
//! let store = Store::local("/var/lib/torpor/snapshots")?;
//! let put = store.put_dir("/run/ckpt/sb-1".as_ref(), None).await?;
//! store.get_dir(&put.id, "/run/restore/sb-1".as_ref()).await?;
//! # Ok(()) }
//! ```

pub mod backend;
pub mod cache;
pub mod chunk;
pub mod durable;
pub mod error;
pub mod fuzzing;
pub mod gc;
pub mod gvisor;
pub mod id;
pub mod lock;
pub mod manifest;
pub mod metrics;
pub mod pack;
pub mod reencode;
mod repack;
pub mod store;

#[cfg(test)]
mod crash_model;

pub use backend::{Backend, BackendError, LocalBackend, S3Backend, S3Config};
pub use cache::{CacheUsage, ChunkCache};
pub use chunk::{ChunkCodec, ChunkError, TenantKey};
pub use durable::DurableError;
pub use error::StoreError;
pub use gc::{GcOptions, GcReport};
pub use id::{ChunkId, IdError, SnapshotId};
pub use manifest::{Manifest, ManifestError};
pub use pack::{PackCatalog, PackId, PackLoc};
pub use store::{
    pack_bytes_for, GetStats, PutOptions, PutReport, PutStats, Store, StoreConfig, StoreStats,
    VerifyReport, DEFAULT_PACK_BYTES, MAX_PACK_TARGET, MIN_PACK_TARGET,
};
