//! A backend on a local directory: one file per object, written durably: a temporary file
//! (0600) in `.tmp/` is written and fsynced, renamed into place, and the object's directory
//! fsynced before `put` returns. Readers never see a partial object, and an object whose
//! `put` returned survives a power loss (see [`crate::durable`]). Directories are 0700: the
//! objects are sandbox memory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

use super::{Backend, BackendError, ObjectInfo, ObjectKey};
use crate::durable::{self, DurableError, Fs, RealFs};

const TMP_DIR: &str = ".tmp";

#[derive(Debug, Clone)]
pub struct LocalBackend {
    root: PathBuf,
    fs: Arc<dyn Fs>,
}

impl LocalBackend {
    /// Opens (creating if needed) a store rooted at `root`. A root that other users can
    /// read (a store made by an older torpor) is restricted to 0700.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, BackendError> {
        Self::open_with(root.into(), Arc::new(RealFs))
    }

    pub(crate) fn open_with(root: PathBuf, fs: Arc<dyn Fs>) -> Result<Self, BackendError> {
        durable::create_dir_all_durably_with(fs.as_ref(), &root.join(TMP_DIR))
            .map_err(BackendError::from)?;
        durable::restrict_dir(&root).map_err(|e| BackendError::io(&root, e))?;
        Ok(LocalBackend { root, fs })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn path(&self, key: &ObjectKey) -> PathBuf {
        self.root.join(key.as_str())
    }
}

impl From<DurableError> for BackendError {
    fn from(e: DurableError) -> Self {
        BackendError::io(e.path, e.source)
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, BackendError> + Send + 'static,
) -> Result<T, BackendError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(BackendError::Join)?
}

#[async_trait]
impl Backend for LocalBackend {
    async fn put(&self, key: &ObjectKey, data: Bytes) -> Result<(), BackendError> {
        let dest = self.path(key);
        let tmp =
            self.root
                .join(TMP_DIR)
                .join(format!("{}.{}", key.name(), crate::id::unique_hex(8)));
        let fs = Arc::clone(&self.fs);
        blocking(move || {
            if let Some(parent) = dest.parent() {
                durable::create_dir_all_durably_with(fs.as_ref(), parent)?;
            }
            durable::publish_with(fs.as_ref(), &tmp, &dest, &data)?;
            Ok(())
        })
        .await
    }

    async fn put_many(&self, objects: Vec<(ObjectKey, Bytes)>) -> Result<(), BackendError> {
        let writes: Vec<(PathBuf, PathBuf, Bytes)> = objects
            .into_iter()
            .map(|(key, data)| {
                let tmp = self.root.join(TMP_DIR).join(format!(
                    "{}.{}",
                    key.name(),
                    crate::id::unique_hex(8)
                ));
                (tmp, self.path(&key), data)
            })
            .collect();
        let fs = Arc::clone(&self.fs);
        blocking(move || {
            for (tmp, dest, data) in &writes {
                if let Some(parent) = dest.parent() {
                    durable::create_dir_all_durably_with(fs.as_ref(), parent)?;
                }
                durable::publish_with(fs.as_ref(), tmp, dest, data)?;
            }
            Ok(())
        })
        .await
    }

    async fn get(&self, key: &ObjectKey) -> Result<Option<Bytes>, BackendError> {
        let path = self.path(key);
        blocking(move || match std::fs::read(&path) {
            Ok(b) => Ok(Some(Bytes::from(b))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(BackendError::io(&path, e)),
        })
        .await
    }

    async fn get_many(&self, keys: &[ObjectKey]) -> Result<Vec<Option<Bytes>>, BackendError> {
        let paths: Vec<PathBuf> = keys.iter().map(|k| self.path(k)).collect();
        blocking(move || {
            paths
                .iter()
                .map(|p| match std::fs::read(p) {
                    Ok(b) => Ok(Some(Bytes::from(b))),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(BackendError::io(p, e)),
                })
                .collect()
        })
        .await
    }

    async fn get_ranges(
        &self,
        key: &ObjectKey,
        ranges: &[std::ops::Range<u64>],
    ) -> Result<Option<Vec<Bytes>>, BackendError> {
        use std::os::unix::fs::FileExt;
        let path = self.path(key);
        let ranges = ranges.to_vec();
        blocking(move || {
            let file = match std::fs::File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(BackendError::io(&path, e)),
            };
            let size = file
                .metadata()
                .map_err(|e| BackendError::io(&path, e))?
                .len();
            ranges
                .iter()
                .map(|r| {
                    let (start, end) = (r.start.min(size), r.end.min(size));
                    let mut buf = vec![0u8; end.saturating_sub(start) as usize];
                    file.read_exact_at(&mut buf, start)
                        .map_err(|e| BackendError::io(&path, e))?;
                    Ok(Bytes::from(buf))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some)
        })
        .await
    }

    async fn exists_many(&self, keys: &[ObjectKey]) -> Result<Vec<bool>, BackendError> {
        let paths: Vec<PathBuf> = keys.iter().map(|k| self.path(k)).collect();
        blocking(move || {
            paths
                .iter()
                .map(|p| match std::fs::symlink_metadata(p) {
                    Ok(m) => Ok(m.is_file()),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
                    Err(e) => Err(BackendError::io(p, e)),
                })
                .collect()
        })
        .await
    }

    async fn delete(&self, key: &ObjectKey) -> Result<(), BackendError> {
        let path = self.path(key);
        let fs = Arc::clone(&self.fs);
        // Not fsynced: an object that comes back after a crash is one a later delete or the
        // collector removes again; nothing points at it.
        blocking(move || match fs.remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(BackendError::io(&path, e)),
        })
        .await
    }

    async fn delete_durably(&self, key: &ObjectKey) -> Result<(), BackendError> {
        let path = self.path(key);
        let fs = Arc::clone(&self.fs);
        blocking(move || {
            match fs.remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(BackendError::io(&path, e)),
            }
            // Absent or removed: either way the name must be gone for good.
            let dir = path.parent().unwrap_or(Path::new("."));
            fs.sync_dir(dir).map_err(|e| BackendError::io(dir, e))
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackendError> {
        let prefix_key = ObjectKey::new(prefix)?;
        let base = self.path(&prefix_key);
        let prefix = prefix_key.as_str().to_string();
        blocking(move || {
            let mut out = Vec::new();
            let mut stack = vec![(base, prefix)];
            while let Some((dir, key)) = stack.pop() {
                let entries = match std::fs::read_dir(&dir) {
                    Ok(e) => e,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(BackendError::io(&dir, e)),
                };
                for entry in entries {
                    let entry = entry.map_err(|e| BackendError::io(&dir, e))?;
                    let name = entry.file_name().to_string_lossy().into_owned();
                    let child_key = format!("{key}/{name}");
                    let meta = entry
                        .metadata()
                        .map_err(|e| BackendError::io(entry.path(), e))?;
                    if meta.is_dir() {
                        stack.push((entry.path(), child_key));
                    } else if meta.is_file() {
                        // Names we did not write (editor droppings...) are skipped, not fatal.
                        if let Ok(key) = ObjectKey::new(child_key) {
                            out.push(ObjectInfo {
                                key,
                                size: meta.len(),
                                modified: meta.modified().ok(),
                            });
                        }
                    }
                }
            }
            out.sort_by(|a, b| a.key.cmp(&b.key));
            Ok(out)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn put_get_list_delete() {
        let dir = tempfile::tempdir().unwrap();
        let b = LocalBackend::open(dir.path()).unwrap();
        let k1 = ObjectKey::new("chunks/ab/ab01").unwrap();
        let k2 = ObjectKey::new("manifests/m1").unwrap();
        assert_eq!(b.get(&k1).await.unwrap(), None);
        b.put(&k1, Bytes::from_static(b"one")).await.unwrap();
        b.put(&k2, Bytes::from_static(b"two")).await.unwrap();
        assert_eq!(
            b.get(&k1).await.unwrap().unwrap(),
            Bytes::from_static(b"one")
        );
        assert_eq!(
            b.exists_many(&[k1.clone(), ObjectKey::new("chunks/zz").unwrap()])
                .await
                .unwrap(),
            vec![true, false]
        );
        let listed = b.list("chunks").await.unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].key, k1);
        assert_eq!(listed[0].size, 3);
        // A run of objects written in one call, then read in one, in the order asked,
        // absent ones as `None`.
        let k3 = ObjectKey::new("chunks/cd/cd01").unwrap();
        b.put_many(vec![
            (k3.clone(), Bytes::from_static(b"three")),
            (k2.clone(), Bytes::from_static(b"two")),
        ])
        .await
        .unwrap();
        assert_eq!(
            b.get(&k3).await.unwrap(),
            Some(Bytes::from_static(b"three"))
        );
        b.delete(&k3).await.unwrap();
        let absent = ObjectKey::new("chunks/zz/zz01").unwrap();
        assert_eq!(
            b.get_many(&[k2.clone(), absent.clone(), k1.clone()])
                .await
                .unwrap(),
            vec![
                Some(Bytes::from_static(b"two")),
                None,
                Some(Bytes::from_static(b"one"))
            ]
        );
        assert!(b.get_many(&[]).await.unwrap().is_empty());
        b.delete(&k1).await.unwrap();
        b.delete(&k1).await.unwrap();
        assert!(b.list("chunks").await.unwrap().is_empty());
        assert!(std::fs::read_dir(dir.path().join(TMP_DIR))
            .unwrap()
            .next()
            .is_none());
    }
}
