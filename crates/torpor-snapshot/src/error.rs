//! The store's error type: one enum for every store operation, each variant with a stable code.

use std::path::PathBuf;

use crate::backend::BackendError;
use crate::chunk::ChunkError;
use crate::id::{ChunkId, SnapshotId};
use crate::lock::LockError;
use crate::manifest::ManifestError;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("snapshot store backend")]
    Backend(#[from] BackendError),
    #[error("snapshot store lock")]
    Lock(#[from] LockError),
    #[error("reading checkpoint file {path}")]
    ReadInput {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint path {path} is not a directory")]
    NotADirectory { path: PathBuf },
    #[error("checkpoint entry {path} is not a regular file, directory or symlink")]
    UnsupportedFileType { path: PathBuf },
    #[error("checkpoint entry {path} has a name that is not UTF-8 or not storable")]
    UnstorableName { path: PathBuf },
    #[error("writing restored file {path}")]
    WriteOutput {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("disk full writing restored file {path}")]
    NoSpace { path: PathBuf },
    #[error("restore destination {path} already exists and is not an empty directory")]
    DestinationExists { path: PathBuf },
    #[error("snapshot {id} not found")]
    SnapshotNotFound { id: SnapshotId },
    #[error("snapshot {id} already exists")]
    SnapshotExists { id: SnapshotId },
    #[error("parent snapshot {id} not found")]
    ParentNotFound { id: SnapshotId },
    #[error("snapshot {id} is pinned")]
    SnapshotPinned { id: SnapshotId },
    #[error("manifest of snapshot {id} is invalid")]
    ManifestInvalid {
        id: SnapshotId,
        #[source]
        source: ManifestError,
    },
    #[error("manifest of snapshot {id} cannot be opened")]
    ManifestSealed {
        id: SnapshotId,
        #[source]
        source: ChunkError,
    },
    #[error("manifest stored as {requested} names itself {found}")]
    ManifestIdMismatch {
        requested: SnapshotId,
        found: SnapshotId,
    },
    #[error("snapshot {snapshot}: chunk {chunk} of {path} is missing from the store")]
    ChunkMissing {
        snapshot: SnapshotId,
        chunk: ChunkId,
        path: String,
    },
    #[error("snapshot {snapshot}: chunk {chunk} of {path} is corrupt")]
    ChunkCorrupt {
        snapshot: SnapshotId,
        chunk: ChunkId,
        path: String,
        #[source]
        source: ChunkError,
    },
    #[error("chunk could not be encoded")]
    Encode(#[source] ChunkError),
    #[error("background task failed")]
    Join(#[from] tokio::task::JoinError),
}

impl StoreError {
    /// Stable, machine-readable code for APIs and logs.
    pub fn code(&self) -> &'static str {
        match self {
            StoreError::Backend(e) => e.code(),
            StoreError::Lock(LockError::Busy { .. }) => "store_locked",
            StoreError::Lock(LockError::Expired { .. }) => "store_lock_lost",
            StoreError::Lock(LockError::Backend(e)) => e.code(),
            StoreError::ReadInput { .. } => "input_read",
            StoreError::NotADirectory { .. } => "input_not_directory",
            StoreError::UnsupportedFileType { .. } => "input_unsupported_file_type",
            StoreError::UnstorableName { .. } => "input_unstorable_name",
            StoreError::WriteOutput { .. } => "output_write",
            StoreError::NoSpace { .. } => "output_no_space",
            StoreError::DestinationExists { .. } => "output_exists",
            StoreError::SnapshotNotFound { .. } => "snapshot_not_found",
            StoreError::SnapshotExists { .. } => "snapshot_exists",
            StoreError::ParentNotFound { .. } => "parent_not_found",
            StoreError::SnapshotPinned { .. } => "snapshot_pinned",
            StoreError::ManifestInvalid { .. } => "manifest_invalid",
            StoreError::ManifestSealed { .. } => "manifest_sealed",
            StoreError::ManifestIdMismatch { .. } => "manifest_id_mismatch",
            StoreError::ChunkMissing { .. } => "chunk_missing",
            StoreError::ChunkCorrupt { .. } => "chunk_corrupt",
            StoreError::Encode(_) => "chunk_encode",
            StoreError::Join(_) => "internal_task",
        }
    }

    pub(crate) fn write(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        match source.raw_os_error() {
            Some(28) | Some(122) => StoreError::NoSpace { path },
            _ => StoreError::WriteOutput { path, source },
        }
    }
}
