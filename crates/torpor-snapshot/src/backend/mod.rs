//! Where objects live. A backend is a flat key → bytes store with listing; the store decides
//! the layout (`chunks/`, `manifests/`, `locks/`, `pins/`). Backends know nothing of chunks or
//! manifests.

use std::ops::Range;
use std::time::SystemTime;

use async_trait::async_trait;
use bytes::Bytes;

mod local;
mod s3;

pub use local::LocalBackend;
pub use s3::{S3Backend, S3Config};

/// A relative object key: `/`-separated clean components of `[A-Za-z0-9._-]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey(String);

impl ObjectKey {
    pub fn new(s: impl Into<String>) -> Result<Self, BackendError> {
        let s = s.into();
        let ok = !s.is_empty()
            && s.split('/').all(|c| {
                !c.is_empty()
                    && !c.starts_with('.')
                    && c.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
            });
        if ok {
            Ok(ObjectKey(s))
        } else {
            Err(BackendError::BadKey { key: s })
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The last component.
    pub fn name(&self) -> &str {
        self.0.rsplit('/').next().unwrap_or(&self.0)
    }
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// One listed object.
#[derive(Debug, Clone)]
pub struct ObjectInfo {
    pub key: ObjectKey,
    pub size: u64,
    pub modified: Option<SystemTime>,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("object key {key:?} is not a clean relative key")]
    BadKey { key: String },
    #[error("local store I/O on {path}")]
    Io {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("local store is out of space writing {path}")]
    NoSpace { path: std::path::PathBuf },
    #[error("object store request for {key} failed after retries")]
    Remote {
        key: String,
        #[source]
        source: object_store::Error,
    },
    #[error("object store configuration is invalid")]
    Config(#[source] object_store::Error),
    #[error("background task failed")]
    Join(#[source] tokio::task::JoinError),
}

impl BackendError {
    pub fn code(&self) -> &'static str {
        match self {
            BackendError::BadKey { .. } => "backend_bad_key",
            BackendError::Io { .. } => "backend_io",
            BackendError::NoSpace { .. } => "backend_no_space",
            BackendError::Remote { .. } => "backend_remote",
            BackendError::Config(_) => "backend_config",
            BackendError::Join(_) => "backend_task",
        }
    }

    pub(crate) fn io(path: impl Into<std::path::PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        // ENOSPC (28) and EDQUOT (122) are the "disk full" an operator must see as such.
        match source.raw_os_error() {
            Some(28) | Some(122) => BackendError::NoSpace { path },
            _ => BackendError::Io { path, source },
        }
    }
}

/// Object storage used by the snapshot store. Implementations must be safe to call from many
/// tasks at once; `put` must be atomic (a reader sees all of an object or none of it).
#[async_trait]
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Stores `data` under `key`, replacing any object there.
    async fn put(&self, key: &ObjectKey, data: Bytes) -> Result<(), BackendError>;
    /// Stores a run of objects (a put's new chunks): remote backends with parallel requests
    /// (the default), a local one in one blocking call. Each object is as durable as after
    /// `put` once this returns; on error some may be stored, as after failed `put`s.
    async fn put_many(&self, objects: Vec<(ObjectKey, Bytes)>) -> Result<(), BackendError> {
        futures::future::try_join_all(
            objects
                .into_iter()
                .map(|(k, d)| async move { self.put(&k, d).await }),
        )
        .await
        .map(|_| ())
    }
    /// The object, or `None` when absent.
    async fn get(&self, key: &ObjectKey) -> Result<Option<Bytes>, BackendError>;
    /// Each object (`None` when absent), in the order of `keys`. A restore asks for a run of
    /// chunks at once: remote backends answer with parallel requests (the default), a local
    /// one with one blocking read of them all instead of a thread hand-off per chunk.
    async fn get_many(&self, keys: &[ObjectKey]) -> Result<Vec<Option<Bytes>>, BackendError> {
        futures::future::try_join_all(keys.iter().map(|k| self.get(k))).await
    }
    /// Byte ranges of one object, in the order asked; `None` when the object is absent. A
    /// range past the object's end comes back short (callers verify what they read). A
    /// restore reads a run of packed chunks this way: remote backends may merge nearby ranges
    /// into one request; the default reads the whole object.
    async fn get_ranges(
        &self,
        key: &ObjectKey,
        ranges: &[Range<u64>],
    ) -> Result<Option<Vec<Bytes>>, BackendError> {
        Ok(self
            .get(key)
            .await?
            .map(|all| ranges.iter().map(|r| slice_clamped(&all, r)).collect()))
    }
    /// For each key, whether it exists. One call per batch, so remote backends can answer a
    /// batch with parallel requests or one listing.
    async fn exists_many(&self, keys: &[ObjectKey]) -> Result<Vec<bool>, BackendError>;
    /// Removes `key`; absent keys are not an error. The removal may be undone by a crash (an
    /// object that comes back is one nothing points at, which a later delete removes again).
    async fn delete(&self, key: &ObjectKey) -> Result<(), BackendError>;
    /// Removes `key` so that a crash after this returns cannot bring it back: a manifest's
    /// removal (a snapshot that came back would name chunks the collector has removed since).
    /// A remote store's delete is durable once acknowledged: the default is `delete`.
    async fn delete_durably(&self, key: &ObjectKey) -> Result<(), BackendError> {
        self.delete(key).await
    }
    /// Every object whose key starts with `prefix/`.
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackendError>;
}

/// `r` of `all`, cut at its end.
pub(crate) fn slice_clamped(all: &Bytes, r: &Range<u64>) -> Bytes {
    let len = all.len() as u64;
    let (start, end) = (r.start.min(len), r.end.min(len).max(r.start.min(len)));
    all.slice(start as usize..end as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_validated() {
        assert!(ObjectKey::new("chunks/ab/abcdef").is_ok());
        assert!(ObjectKey::new("../x").is_err());
        assert!(ObjectKey::new("a//b").is_err());
        assert!(ObjectKey::new("/a").is_err());
        assert!(ObjectKey::new("a/.tmp").is_err());
        assert_eq!(ObjectKey::new("a/b/c").unwrap().name(), "c");
    }

    #[test]
    fn ranges_are_cut_at_the_end() {
        let all = Bytes::from_static(b"0123456789");
        assert_eq!(&slice_clamped(&all, &(2..5))[..], b"234");
        assert_eq!(&slice_clamped(&all, &(8..20))[..], b"89");
        assert!(slice_clamped(&all, &(12..20)).is_empty());
    }
}
