//! The one error type of this crate.
//!
//! Every variant names the file it is about: a path on disk, or `ARCHIVE/MEMBER` for a
//! member of a tarball. Messages never repeat their source; the caller prints the chain.

use std::io;
use std::path::PathBuf;

use thiserror::Error;

/// Why a path inside a layer was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EscapeReason {
    /// The path has a `..` component.
    ParentComponent,
    /// A component of the path is a symbolic link already in the root filesystem; torpor
    /// never writes through one.
    ThroughSymlink { component: PathBuf },
}

impl std::fmt::Display for EscapeReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EscapeReason::ParentComponent => f.write_str("it has a `..` component"),
            EscapeReason::ThroughSymlink { component } => {
                write!(f, "{} is a symbolic link", component.display())
            }
        }
    }
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ImageError {
    #[error("no image at {path}")]
    NotFound { path: PathBuf },

    #[error("{path} is neither an OCI image layout nor an OCI or docker-save archive")]
    Unrecognized { path: PathBuf },

    #[error("no image named {reference:?} in {path}")]
    ReferenceNotFound { path: PathBuf, reference: String },

    #[error("{path} holds {count} images; choose one with a reference")]
    Ambiguous { path: PathBuf, count: usize },

    #[error("{path} has no manifest for {os}/{architecture}")]
    PlatformNotFound {
        path: PathBuf,
        os: String,
        architecture: String,
    },

    #[error("{path} is corrupt: {detail}")]
    Corrupt { path: PathBuf, detail: String },

    #[error("{path} is not valid JSON for {what}")]
    InvalidJson {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },

    #[error("{path} has digest {actual}, expected {expected}")]
    DigestMismatch {
        path: PathBuf,
        expected: String,
        actual: String,
    },

    #[error("{path} is {actual} bytes, its descriptor says {expected}")]
    SizeMismatch {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },

    #[error(
        "{path} refers to digest {digest:?}, which is not `sha256:` and 64 lowercase hex digits"
    )]
    UnsupportedDigest { path: PathBuf, digest: String },

    #[error("{path} has media type {media_type:?}, which torpor cannot unpack")]
    UnsupportedMediaType { path: PathBuf, media_type: String },

    #[error("entry {entry} of {layer} would leave the root filesystem: {reason}")]
    PathEscape {
        layer: PathBuf,
        entry: PathBuf,
        reason: EscapeReason,
    },

    #[error("{path} exceeds the limit of {limit} bytes for {what}")]
    TooLarge {
        path: PathBuf,
        what: &'static str,
        limit: u64,
    },

    #[error("{path} brings the image past the limit of {limit} entries")]
    TooManyEntries { path: PathBuf, limit: u64 },

    #[error("destination {path} exists and is not an empty directory")]
    DestinationNotEmpty { path: PathBuf },

    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl ImageError {
    /// A stable, machine-readable code for this error; API clients match on it.
    pub fn code(&self) -> &'static str {
        match self {
            ImageError::NotFound { .. } | ImageError::ReferenceNotFound { .. } => "image_not_found",
            ImageError::Unrecognized { .. } => "image_unrecognized",
            ImageError::Ambiguous { .. } => "image_ambiguous",
            ImageError::PlatformNotFound { .. } => "platform_not_found",
            ImageError::Corrupt { .. } | ImageError::InvalidJson { .. } => "image_corrupt",
            ImageError::DigestMismatch { .. } | ImageError::SizeMismatch { .. } => {
                "digest_mismatch"
            }
            ImageError::UnsupportedDigest { .. } => "unsupported_digest",
            ImageError::UnsupportedMediaType { .. } => "unsupported_media_type",
            ImageError::PathEscape { .. } => "path_escape",
            ImageError::TooLarge { .. } | ImageError::TooManyEntries { .. } => "too_large",
            ImageError::DestinationNotEmpty { .. } => "destination_not_empty",
            ImageError::Read { .. } => "read_failed",
            ImageError::Write { .. } => "write_failed",
        }
    }

    /// The message for an API client: what is wrong with the image, naming entries and
    /// values inside it, never a path on the host (where the archive was stored, where it
    /// is unpacked). [`Display`](std::fmt::Display) is for the operator's log.
    pub fn client_message(&self) -> String {
        match self {
            ImageError::NotFound { .. } => {
                "the image, or a file it refers to, was not found in the archive".to_owned()
            }
            ImageError::Unrecognized { .. } => {
                "the archive is neither an OCI image archive nor a docker save archive".to_owned()
            }
            ImageError::ReferenceNotFound { reference, .. } => {
                format!("no image named {reference:?} in the archive")
            }
            ImageError::Ambiguous { count, .. } => {
                format!("the archive holds {count} images; choose one with a reference")
            }
            ImageError::PlatformNotFound {
                os, architecture, ..
            } => format!("the image has no manifest for {os}/{architecture}"),
            ImageError::Corrupt { detail, .. } => format!("the image is corrupt: {detail}"),
            ImageError::InvalidJson { what, .. } => {
                format!("the image's {what} is not valid JSON")
            }
            ImageError::DigestMismatch {
                expected, actual, ..
            } => format!("a blob of the image has digest {actual}, expected {expected}"),
            ImageError::SizeMismatch {
                expected, actual, ..
            } => format!("a blob of the image is {actual} bytes, its descriptor says {expected}"),
            ImageError::UnsupportedDigest { digest, .. } => format!(
                "the image refers to digest {digest:?}, which is not `sha256:` and 64 \
                 lowercase hex digits"
            ),
            ImageError::UnsupportedMediaType { media_type, .. } => {
                format!("the image has media type {media_type:?}, which torpor cannot unpack")
            }
            ImageError::PathEscape { entry, reason, .. } => format!(
                "entry {} would leave the root filesystem: {reason}",
                entry.display()
            ),
            ImageError::TooLarge { what, limit, .. } => {
                format!("the image exceeds the limit of {limit} bytes for {what}")
            }
            ImageError::TooManyEntries { limit, .. } => {
                format!("the image has more than {limit} entries")
            }
            ImageError::DestinationNotEmpty { .. } => {
                "the template's root filesystem could not be prepared".to_owned()
            }
            ImageError::Read { .. } => "the image could not be read".to_owned(),
            ImageError::Write { source, .. } if is_no_space(source) => {
                "the image does not fit on the server's disk".to_owned()
            }
            ImageError::Write { .. } => "the image could not be written to disk".to_owned(),
        }
    }

    pub(crate) fn corrupt(path: impl Into<PathBuf>, detail: impl Into<String>) -> Self {
        ImageError::Corrupt {
            path: path.into(),
            detail: detail.into(),
        }
    }
}

/// ENOSPC or EDQUOT.
fn is_no_space(err: &io::Error) -> bool {
    matches!(err.raw_os_error(), Some(28) | Some(122))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_send_sync_and_keep_their_source() {
        fn assert_send_sync_static<T: Send + Sync + 'static>() {}
        assert_send_sync_static::<ImageError>();
        let err = ImageError::Read {
            path: "image.tar".into(),
            source: io::Error::from(io::ErrorKind::PermissionDenied),
        };
        assert_eq!(err.code(), "read_failed");
        assert_eq!(err.to_string(), "cannot read image.tar");
        assert!(std::error::Error::source(&err).is_some());
    }
}
