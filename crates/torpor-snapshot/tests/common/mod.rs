//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use torpor_snapshot::backend::{Backend, BackendError, ObjectInfo, ObjectKey};

/// Deterministic pseudo-random bytes (incompressible).
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let mut h = blake3::Hasher::new();
    h.update(&seed.to_le_bytes());
    h.finalize_xof().fill(&mut out);
    out
}

/// Memory-like content: pages of noise, text and zeros.
pub fn memory_like(seed: u64, pages: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(pages * 4096);
    for p in 0..pages {
        match p % 4 {
            0 => out.extend_from_slice(&vec![0u8; 4096]),
            1 => out.extend(
                format!("page {p} of agent state {seed} ")
                    .bytes()
                    .cycle()
                    .take(4096),
            ),
            _ => out.extend_from_slice(&noise(seed * 1_000_003 + p as u64, 4096)),
        }
    }
    out
}

/// Files under `root` as (relative path, kind, content) for comparison.
pub fn tree(root: &Path) -> Vec<(String, String, Vec<u8>)> {
    let mut out = Vec::new();
    fn go(root: &Path, dir: &Path, out: &mut Vec<(String, String, Vec<u8>)>) {
        let mut names: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        names.sort();
        for p in names {
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            let m = std::fs::symlink_metadata(&p).unwrap();
            use std::os::unix::fs::PermissionsExt;
            let mode = m.permissions().mode() & 0o7777;
            if m.file_type().is_symlink() {
                let t = std::fs::read_link(&p).unwrap();
                out.push((rel, "link".into(), t.to_string_lossy().as_bytes().to_vec()));
            } else if m.is_dir() {
                out.push((rel, format!("dir {mode:o}"), vec![]));
                go(root, &p, out);
            } else {
                out.push((rel, format!("file {mode:o}"), std::fs::read(&p).unwrap()));
            }
        }
    }
    go(root, root, &mut out);
    out
}

/// A backend wrapper that can fail chunk puts after a count and slow puts down.
#[derive(Debug)]
pub struct FaultyBackend {
    pub inner: Arc<dyn Backend>,
    pub fail_chunk_puts_after: AtomicUsize,
    pub chunk_puts: AtomicUsize,
    pub put_delay: Duration,
    /// Lock objects can no longer be written (the store unreachable for the holder's renewals).
    pub fail_lock_puts: std::sync::atomic::AtomicBool,
}

impl FaultyBackend {
    pub fn new(inner: Arc<dyn Backend>) -> Self {
        FaultyBackend {
            inner,
            fail_chunk_puts_after: AtomicUsize::new(usize::MAX),
            chunk_puts: AtomicUsize::new(0),
            put_delay: Duration::ZERO,
            fail_lock_puts: false.into(),
        }
    }
}

#[async_trait]
impl Backend for FaultyBackend {
    async fn put(&self, key: &ObjectKey, data: Bytes) -> Result<(), BackendError> {
        if key.as_str().contains("locks/") && self.fail_lock_puts.load(Ordering::SeqCst) {
            return Err(BackendError::Io {
                path: key.as_str().into(),
                source: std::io::Error::other("unreachable"),
            });
        }
        if key.as_str().contains("chunks/") {
            if !self.put_delay.is_zero() {
                tokio::time::sleep(self.put_delay).await;
            }
            let n = self.chunk_puts.fetch_add(1, Ordering::SeqCst);
            if n >= self.fail_chunk_puts_after.load(Ordering::SeqCst) {
                return Err(BackendError::NoSpace {
                    path: key.as_str().into(),
                });
            }
        }
        self.inner.put(key, data).await
    }
    /// One object after another, each through [`Backend::put`]'s faults: a slow store is
    /// slow for every object of a run.
    async fn put_many(&self, objects: Vec<(ObjectKey, Bytes)>) -> Result<(), BackendError> {
        for (key, data) in objects {
            self.put(&key, data).await?;
        }
        Ok(())
    }
    async fn get(&self, key: &ObjectKey) -> Result<Option<Bytes>, BackendError> {
        self.inner.get(key).await
    }
    async fn exists_many(&self, keys: &[ObjectKey]) -> Result<Vec<bool>, BackendError> {
        self.inner.exists_many(keys).await
    }
    async fn delete(&self, key: &ObjectKey) -> Result<(), BackendError> {
        self.inner.delete(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackendError> {
        self.inner.list(prefix).await
    }
}
