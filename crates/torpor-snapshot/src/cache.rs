//! A bounded local cache of chunk blobs (as stored, so encrypted chunks stay encrypted on
//! disk), evicting least-recently-used entries past a byte budget. Wakes on the same node read
//! chunks from here instead of the backend. Entries are verified on every use by the caller;
//! a bad entry is removed and refetched. The cache survives restarts: entries found on disk at
//! open are ordered by modification time.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::{Mutex, Notify};

use crate::backend::BackendError;
use crate::id::ChunkId;

#[derive(Debug)]
pub struct ChunkCache {
    dir: PathBuf,
    capacity: u64,
    state: Mutex<LruState>,
    pending: AtomicUsize,
    idle: Notify,
}

#[derive(Debug, Default)]
struct LruState {
    tick: u64,
    used: u64,
    entries: HashMap<ChunkId, (u64, u64)>, // id -> (size, tick)
    order: BTreeMap<u64, ChunkId>,         // tick -> id
}

impl LruState {
    fn touch(&mut self, id: &ChunkId) -> bool {
        let Some((_, t)) = self.entries.get_mut(id) else {
            return false;
        };
        self.order.remove(t);
        self.tick += 1;
        *t = self.tick;
        self.order.insert(self.tick, *id);
        true
    }

    fn add(&mut self, id: ChunkId, size: u64) {
        if self.touch(&id) {
            return;
        }
        self.tick += 1;
        self.entries.insert(id, (size, self.tick));
        self.order.insert(self.tick, id);
        self.used += size;
    }

    fn drop_entry(&mut self, id: &ChunkId) -> bool {
        match self.entries.remove(id) {
            Some((size, t)) => {
                self.order.remove(&t);
                self.used -= size;
                true
            }
            None => false,
        }
    }

    fn pop_oldest(&mut self) -> Option<ChunkId> {
        let (_, id) = self.order.pop_first()?;
        if let Some((size, _)) = self.entries.remove(&id) {
            self.used -= size;
        }
        Some(id)
    }
}

impl ChunkCache {
    /// Opens (creating) a cache in `dir` holding at most `capacity` bytes.
    pub fn open(dir: impl Into<PathBuf>, capacity: u64) -> Result<Self, BackendError> {
        let dir = dir.into();
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(crate::durable::DIR_MODE)
                .create(&dir)
                .map_err(|e| BackendError::io(&dir, e))?;
        }
        crate::durable::restrict_dir(&dir).map_err(|e| BackendError::io(&dir, e))?;
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&dir).map_err(|e| BackendError::io(&dir, e))? {
            let entry = entry.map_err(|e| BackendError::io(&dir, e))?;
            let name = entry.file_name();
            let Some(id) = name.to_str().and_then(|n| ChunkId::from_hex(n).ok()) else {
                // Leftover temporary files from a crash.
                let _ = std::fs::remove_file(entry.path());
                continue;
            };
            if let Ok(meta) = entry.metadata() {
                found.push((meta.modified().ok(), id, meta.len()));
            }
        }
        found.sort();
        let mut state = LruState::default();
        for (_, id, size) in found {
            state.add(id, size);
        }
        let cache = ChunkCache {
            dir,
            capacity,
            state: Mutex::new(state),
            pending: AtomicUsize::new(0),
            idle: Notify::new(),
        };
        Ok(cache)
    }

    fn path(&self, id: &ChunkId) -> PathBuf {
        self.dir.join(id.to_hex())
    }

    pub async fn get(&self, id: &ChunkId) -> Option<Bytes> {
        if !self.state.lock().await.touch(id) {
            return None;
        }
        match tokio::fs::read(self.path(id)).await {
            Ok(b) => Some(Bytes::from(b)),
            Err(_) => {
                self.state.lock().await.drop_entry(id);
                None
            }
        }
    }

    /// Adds a blob, evicting the least recently used entries to stay within the budget.
    /// Failures only cost a future refetch, so they are logged, not returned.
    pub async fn insert(&self, id: &ChunkId, blob: Bytes) {
        let size = blob.len() as u64;
        if size > self.capacity {
            return;
        }
        let tmp = self.dir.join(format!(".{}.tmp", crate::id::unique_hex(8)));
        let dest = self.path(id);
        let write = async {
            // Not fsynced: a torn entry after a crash fails its hash check on read and is
            // refetched. Private like the store: chunks are sandbox memory.
            let mut file = tokio::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(crate::durable::FILE_MODE)
                .open(&tmp)
                .await?;
            tokio::io::AsyncWriteExt::write_all(&mut file, &blob).await?;
            drop(file);
            tokio::fs::rename(&tmp, &dest).await
        };
        if let Err(e) = write.await {
            let _ = tokio::fs::remove_file(&tmp).await;
            tracing::warn!(chunk = %id, error = %e, "chunk cache write failed");
            return;
        }
        let evicted = {
            let mut st = self.state.lock().await;
            st.add(*id, size);
            let mut evicted = Vec::new();
            while st.used > self.capacity {
                match st.pop_oldest() {
                    Some(old) => evicted.push(old),
                    None => break,
                }
            }
            evicted
        };
        for old in evicted {
            let _ = tokio::fs::remove_file(self.path(&old)).await;
        }
    }

    /// Inserts on a background task, so a restore does not wait for the cache write.
    pub fn insert_in_background(self: &Arc<Self>, id: ChunkId, blob: Bytes) {
        self.pending.fetch_add(1, Ordering::SeqCst);
        let cache = Arc::clone(self);
        tokio::spawn(async move {
            cache.insert(&id, blob).await;
            if cache.pending.fetch_sub(1, Ordering::SeqCst) == 1 {
                cache.idle.notify_waiters();
            }
        });
    }

    /// Waits until background inserts have finished.
    pub async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            if self.pending.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }

    pub async fn remove(&self, id: &ChunkId) {
        self.state.lock().await.drop_entry(id);
        let _ = tokio::fs::remove_file(self.path(id)).await;
    }

    /// Bytes currently held.
    pub async fn used(&self) -> u64 {
        self.state.lock().await.used
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn evicts_least_recently_used_within_budget() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ChunkCache::open(dir.path(), 250).unwrap();
        let ids: Vec<ChunkId> = (0..3u8).map(|i| ChunkId::of(&[i])).collect();
        for id in &ids {
            cache.insert(id, Bytes::from(vec![1u8; 100])).await;
            if *id == ids[1] {
                // Touch the first so the second is now the oldest.
                assert!(cache.get(&ids[0]).await.is_some());
            }
        }
        assert!(cache.used().await <= 250);
        assert!(cache.get(&ids[0]).await.is_some());
        assert!(
            cache.get(&ids[1]).await.is_none(),
            "least recently used is evicted"
        );
        assert!(cache.get(&ids[2]).await.is_some());
        drop(cache);
        let reopened = ChunkCache::open(dir.path(), 250).unwrap();
        assert_eq!(reopened.used().await, 200);
        assert!(reopened.get(&ids[2]).await.is_some());
    }
}
