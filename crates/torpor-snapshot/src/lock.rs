//! Store-wide locks kept as objects, so puts on many nodes and one garbage collector can
//! coordinate through nothing but the backend.
//!
//! Puts and forks take a *shared* lock, garbage collection an *exclusive* one. Each side writes
//! its own lock object first and lists the others second; with read-after-write listing (local
//! disk, S3) two racing parties always see each other, and the side that sees a conflict
//! removes its object and retries with backoff. So an in-flight put's chunks are never swept.
//! Holders rewrite their object every `ttl / 4`; an object older than `ttl` belongs to a dead
//! process and is ignored (and removed by the next collector).
//!
//! A holder that could not rewrite its object for `ttl / 2` (the store unreachable, the
//! process stalled) may have been taken for dead: a put checks [`LockGuard::check_fresh`]
//! before it commits its manifest and fails instead (its chunks are then orphans the next
//! collector removes), so a collector that ignored its lock can never have swept a chunk a
//! committed snapshot names. That is what lets the ttl be short (a minute by default): a
//! worker killed in the middle of an upload holds the collectors back for that long, not
//! longer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;

use crate::backend::{Backend, BackendError, ObjectKey};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockKind {
    Shared,
    Exclusive,
}

impl LockKind {
    fn tag(self) -> &'static str {
        match self {
            LockKind::Shared => "shared",
            LockKind::Exclusive => "exclusive",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("store is locked by {holder} (waited {waited_ms} ms)")]
    Busy { holder: String, waited_ms: u64 },
    /// This holder's lock was last written too long ago: a collector may have taken it for a
    /// dead holder's, so what was written under it cannot be committed.
    #[error("lost the store lock: last renewed {since_ms} ms ago (ttl {ttl_ms} ms)")]
    Expired { since_ms: u64, ttl_ms: u64 },
    #[error("lock object I/O")]
    Backend(#[from] BackendError),
}

#[derive(Debug, Clone)]
pub(crate) struct LockManager {
    backend: Arc<dyn Backend>,
    prefix: String,
    pub(crate) ttl: Duration,
    wait: Duration,
}

pub(crate) struct LockGuard {
    key: ObjectKey,
    backend: Arc<dyn Backend>,
    refresher: Option<tokio::task::JoinHandle<()>>,
    released: bool,
    /// When the lock object was last written, in ms since `since`.
    renewed: Arc<AtomicU64>,
    since: Instant,
    ttl: Duration,
}

impl LockManager {
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        prefix: String,
        ttl: Duration,
        wait: Duration,
    ) -> Self {
        LockManager {
            backend,
            prefix,
            ttl,
            wait,
        }
    }

    /// Holders of live locks, as `(key, kind)`; stale ones are returned separately.
    async fn live_and_stale(
        &self,
    ) -> Result<(Vec<(ObjectKey, LockKind)>, Vec<ObjectKey>), BackendError> {
        let now = SystemTime::now();
        let mut live = Vec::new();
        let mut stale = Vec::new();
        for o in self.backend.list(&self.prefix).await? {
            let kind = if o.key.name().starts_with("exclusive-") {
                LockKind::Exclusive
            } else {
                LockKind::Shared
            };
            let age = o
                .modified
                .and_then(|m| now.duration_since(m).ok())
                .unwrap_or(Duration::ZERO);
            if age > self.ttl {
                stale.push(o.key);
            } else {
                live.push((o.key, kind));
            }
        }
        Ok((live, stale))
    }

    pub(crate) async fn acquire(&self, kind: LockKind) -> Result<LockGuard, LockError> {
        let start = Instant::now();
        let mut backoff = Duration::from_millis(20);
        let key = ObjectKey::new(format!(
            "{}/{}-{}",
            self.prefix,
            kind.tag(),
            crate::id::unique_hex(12)
        ))?;
        let body = Bytes::from(format!("pid={}\n", std::process::id()));
        loop {
            // Taken before the write: the object is no older than this.
            let wrote = Instant::now();
            self.backend.put(&key, body.clone()).await?;
            let (live, stale) = self.live_and_stale().await?;
            let conflict = live.iter().find(|(k, other)| {
                *k != key
                    && match kind {
                        LockKind::Shared => *other == LockKind::Exclusive,
                        LockKind::Exclusive => true,
                    }
            });
            match conflict {
                None => {
                    if kind == LockKind::Exclusive {
                        for s in stale {
                            self.backend.delete(&s).await?;
                        }
                    }
                    let since = wrote;
                    let renewed = Arc::new(AtomicU64::new(0));
                    let refresher = {
                        let backend = Arc::clone(&self.backend);
                        let key = key.clone();
                        let body = body.clone();
                        let every = self.ttl / 4;
                        let renewed = Arc::clone(&renewed);
                        tokio::spawn(async move {
                            loop {
                                tokio::time::sleep(every).await;
                                let at = since.elapsed().as_millis() as u64;
                                match backend.put(&key, body.clone()).await {
                                    // Counted from before the write: the object is no older.
                                    Ok(()) => renewed.store(at, Ordering::SeqCst),
                                    Err(e) => {
                                        tracing::warn!(lock = %key, error = %e, "lock refresh failed")
                                    }
                                }
                            }
                        })
                    };
                    return Ok(LockGuard {
                        key,
                        backend: Arc::clone(&self.backend),
                        refresher: Some(refresher),
                        released: false,
                        renewed,
                        since,
                        ttl: self.ttl,
                    });
                }
                Some((holder, _)) => {
                    let holder = holder.to_string();
                    self.backend.delete(&key).await?;
                    if start.elapsed() >= self.wait {
                        return Err(LockError::Busy {
                            holder,
                            waited_ms: start.elapsed().as_millis() as u64,
                        });
                    }
                    // Jitter from the key so two racing parties do not retry in lockstep.
                    let jitter = Duration::from_millis(u64::from(
                        key.name().as_bytes()[key.name().len() - 1] % 17,
                    ));
                    tokio::time::sleep(backoff + jitter).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
    }
}

impl LockGuard {
    /// `Err(Expired)` when the lock object was last written `ttl / 2` ago or longer: a
    /// collector (whose clock may run ahead of ours, and which reads the object's age from the
    /// store) may take it for a dead holder's within the rest of the ttl. A put calls it right
    /// before committing its manifest.
    pub(crate) fn check_fresh(&self) -> Result<(), LockError> {
        let since_ms = (self.since.elapsed().as_millis() as u64)
            .saturating_sub(self.renewed.load(Ordering::SeqCst));
        let ttl_ms = self.ttl.as_millis() as u64;
        if since_ms >= ttl_ms / 2 {
            return Err(LockError::Expired { since_ms, ttl_ms });
        }
        Ok(())
    }

    pub(crate) async fn release(mut self) {
        if let Some(r) = self.refresher.take() {
            r.abort();
        }
        self.released = true;
        if let Err(e) = self.backend.delete(&self.key).await {
            tracing::warn!(lock = %self.key, error = %e, "lock release failed; it expires after its ttl");
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if let Some(r) = self.refresher.take() {
            r.abort();
        }
        if !self.released {
            // Cancelled holder: remove the lock in the background if a runtime is still there.
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                let backend = Arc::clone(&self.backend);
                let key = self.key.clone();
                handle.spawn(async move {
                    let _ = backend.delete(&key).await;
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::LocalBackend;

    fn manager(dir: &std::path::Path, wait_ms: u64) -> LockManager {
        let b: Arc<dyn Backend> = Arc::new(LocalBackend::open(dir).unwrap());
        LockManager::new(
            b,
            "locks".into(),
            Duration::from_secs(60),
            Duration::from_millis(wait_ms),
        )
    }

    #[tokio::test]
    async fn shared_locks_coexist_and_exclude_the_collector() {
        let dir = tempfile::tempdir().unwrap();
        let m = manager(dir.path(), 100);
        let a = m.acquire(LockKind::Shared).await.unwrap();
        let b = m.acquire(LockKind::Shared).await.unwrap();
        assert!(matches!(
            m.acquire(LockKind::Exclusive).await,
            Err(LockError::Busy { .. })
        ));
        a.release().await;
        assert!(matches!(
            m.acquire(LockKind::Exclusive).await,
            Err(LockError::Busy { .. })
        ));
        b.release().await;
        let x = m.acquire(LockKind::Exclusive).await.unwrap();
        assert!(matches!(
            m.acquire(LockKind::Shared).await,
            Err(LockError::Busy { .. })
        ));
        x.release().await;
        m.acquire(LockKind::Shared).await.unwrap().release().await;
        assert!(m.backend.list("locks").await.unwrap().is_empty());
    }

    /// A directory whose lock objects can no longer be written once `broken` is set.
    #[derive(Debug)]
    struct Breaking {
        inner: LocalBackend,
        broken: std::sync::atomic::AtomicBool,
    }

    #[async_trait::async_trait]
    impl Backend for Breaking {
        async fn put(&self, key: &ObjectKey, data: Bytes) -> Result<(), BackendError> {
            if self.broken.load(Ordering::SeqCst) {
                return Err(BackendError::Io {
                    path: key.as_str().into(),
                    source: std::io::Error::other("unreachable"),
                });
            }
            self.inner.put(key, data).await
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
        async fn list(
            &self,
            prefix: &str,
        ) -> Result<Vec<crate::backend::ObjectInfo>, BackendError> {
            self.inner.list(prefix).await
        }
    }

    #[tokio::test]
    async fn a_holder_that_cannot_renew_its_lock_for_half_the_ttl_is_told_so() {
        let dir = tempfile::tempdir().unwrap();
        let b = Arc::new(Breaking {
            inner: LocalBackend::open(dir.path()).unwrap(),
            broken: false.into(),
        });
        // Renewed every second, expired from 2 s without a renewal: a loaded machine delays a
        // renewal by far less.
        let ttl = Duration::from_secs(4);
        let m = LockManager::new(b.clone(), "locks".into(), ttl, Duration::from_secs(1));
        let held = m.acquire(LockKind::Shared).await.unwrap();
        for _ in 0..6 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            held.check_fresh().unwrap();
        }
        // The store goes away: the renewals fail, and from half the ttl on the holder knows.
        b.broken.store(true, Ordering::SeqCst);
        tokio::time::sleep(ttl / 2 + Duration::from_millis(100)).await;
        match held.check_fresh() {
            Err(LockError::Expired { since_ms, ttl_ms }) => {
                assert!(since_ms >= 2000 && ttl_ms == 4000, "{since_ms} {ttl_ms}")
            }
            other => panic!("{other:?}"),
        }
        b.broken.store(false, Ordering::SeqCst);
        held.release().await;
    }

    #[tokio::test]
    async fn waiting_put_gets_the_lock_when_the_collector_finishes() {
        let dir = tempfile::tempdir().unwrap();
        let m = manager(dir.path(), 5_000);
        let x = m.acquire(LockKind::Exclusive).await.unwrap();
        let m2 = m.clone();
        let waiter = tokio::spawn(async move { m2.acquire(LockKind::Shared).await.map(|_| ()) });
        tokio::time::sleep(Duration::from_millis(100)).await;
        x.release().await;
        waiter.await.unwrap().unwrap();
    }
}
