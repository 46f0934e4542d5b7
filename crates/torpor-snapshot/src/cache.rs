//! A bounded local cache of chunk blobs (as stored, so encrypted chunks stay encrypted on
//! disk), evicting least-recently-used entries past a byte budget. Wakes on the same node read
//! chunks from here instead of the backend. Entries are verified on every use by the caller;
//! a bad entry is removed and refetched. The cache survives restarts: entries found on disk at
//! open are ordered by modification time.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::Notify;

use crate::backend::BackendError;
use crate::id::ChunkId;

/// Nice value of the cache's writer thread: entries are written behind the restores that
/// fetched them, not beside them.
const WRITER_NICE: i32 = 10;
/// The writer waits until no insert has come for this long (the restore that fetched the
/// chunks has usually run by then: on a small machine it needs the cores)...
const WRITER_SETTLE: std::time::Duration = std::time::Duration::from_millis(1000);
/// ...but holds no entry longer than this.
const WRITER_MAX_DELAY: std::time::Duration = std::time::Duration::from_secs(10);
/// Bytes queued for the writer at most; an insert beyond it is dropped (a later fetch of that
/// chunk goes to the backend again).
const MAX_QUEUED_BYTES: u64 = 128 << 20;

#[derive(Debug)]
pub struct ChunkCache {
    dir: PathBuf,
    capacity: u64,
    state: Mutex<LruState>,
    pending: AtomicUsize,
    idle: Notify,
    /// The writer thread's queue, started at the first background insert.
    writer: Mutex<Option<std::sync::mpsc::Sender<Queued>>>,
    /// Blobs queued and not written yet: served from memory meanwhile (a wake right after a
    /// suspend's write-through reads them here).
    queued: Mutex<HashMap<ChunkId, Bytes>>,
    queued_bytes: AtomicU64,
    /// Background inserts dropped because the queue was full.
    dropped: AtomicU64,
    /// When the last background insert came.
    last_queued: Mutex<std::time::Instant>,
}

/// [`ChunkCache::usage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheUsage {
    /// Entries written to the cache's directory (the LRU's budget counts these).
    pub bytes: u64,
    pub capacity_bytes: u64,
    /// Blobs waiting for the writer, held in memory (at most 128 MiB), not in `bytes`.
    pub queued_bytes: u64,
    /// Background inserts not cached because the queue was full.
    pub dropped_total: u64,
}

/// A background insert: the chunk, its blob, when it was queued.
type Queued = (ChunkId, Bytes, std::time::Instant);

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
            writer: Mutex::new(None),
            queued: Mutex::new(HashMap::new()),
            queued_bytes: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            last_queued: Mutex::new(std::time::Instant::now()),
        };
        Ok(cache)
    }

    fn path(&self, id: &ChunkId) -> PathBuf {
        self.dir.join(id.to_hex())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LruState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A blob queued for writing, if any.
    fn queued(&self, id: &ChunkId) -> Option<Bytes> {
        let queued = self.queued.lock().unwrap_or_else(|p| p.into_inner());
        queued.get(id).cloned()
    }

    pub async fn get(&self, id: &ChunkId) -> Option<Bytes> {
        if let Some(blob) = self.queued(id) {
            return Some(blob);
        }
        if !self.lock().touch(id) {
            return None;
        }
        match tokio::fs::read(self.path(id)).await {
            Ok(b) => Some(Bytes::from(b)),
            Err(_) => {
                self.lock().drop_entry(id);
                None
            }
        }
    }

    /// [`ChunkCache::get`] of each id, on the calling (blocking) thread: a restore looks up a
    /// run of chunks with one thread hand-off, not one per chunk.
    pub fn get_many_blocking(&self, ids: &[ChunkId]) -> Vec<Option<Bytes>> {
        ids.iter()
            .map(|id| {
                if let Some(blob) = self.queued(id) {
                    return Some(blob);
                }
                if !self.lock().touch(id) {
                    return None;
                }
                match std::fs::read(self.path(id)) {
                    Ok(b) => Some(Bytes::from(b)),
                    Err(_) => {
                        self.lock().drop_entry(id);
                        None
                    }
                }
            })
            .collect()
    }

    /// Adds a blob, evicting the least recently used entries to stay within the budget.
    /// Failures only cost a future refetch, so they are logged, not returned.
    pub async fn insert(&self, id: &ChunkId, blob: Bytes) {
        if blob.len() as u64 > self.capacity {
            return;
        }
        let (tmp, dest) = (self.tmp_path(), self.path(id));
        let size = blob.len() as u64;
        let written = tokio::task::spawn_blocking(move || write_entry(&tmp, &dest, &blob))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)));
        if let Some(evicted) = self.added(id, size, written) {
            for old in evicted {
                let _ = tokio::fs::remove_file(self.path(&old)).await;
            }
        }
    }

    /// [`ChunkCache::insert`] on the calling (blocking) thread.
    pub fn insert_blocking(&self, id: &ChunkId, blob: &[u8]) {
        if blob.len() as u64 > self.capacity {
            return;
        }
        let written = write_entry(&self.tmp_path(), &self.path(id), blob);
        for old in self
            .added(id, blob.len() as u64, written)
            .unwrap_or_default()
        {
            let _ = std::fs::remove_file(self.path(&old));
        }
    }

    fn tmp_path(&self) -> PathBuf {
        self.dir.join(format!(".{}.tmp", crate::id::unique_hex(8)))
    }

    /// Records a written entry (or logs the failed write): the entries evicted to make room.
    fn added(&self, id: &ChunkId, size: u64, written: std::io::Result<()>) -> Option<Vec<ChunkId>> {
        if let Err(e) = written {
            tracing::warn!(chunk = %id, error = %e, "chunk cache write failed");
            return None;
        }
        let mut st = self.lock();
        st.add(*id, size);
        let mut evicted = Vec::new();
        while st.used > self.capacity {
            match st.pop_oldest() {
                Some(old) => evicted.push(old),
                None => break,
            }
        }
        Some(evicted)
    }

    /// Inserts on a background task, so a restore does not wait for the cache write.
    pub fn insert_in_background(self: &Arc<Self>, id: ChunkId, blob: Bytes) {
        self.insert_many_in_background(vec![(id, blob)]);
    }

    /// Inserts blobs in the background: one writer thread per cache, niced, writing one entry
    /// at a time once inserts have settled ([`WRITER_SETTLE`], at most [`WRITER_MAX_DELAY`]).
    /// A cold 64 MiB restore fetches ~3,400 chunks; written beside it, by many threads, the
    /// files' creation took a core from the restore that needed them. Dropped beyond
    /// [`MAX_QUEUED_BYTES`] queued.
    pub fn insert_many_in_background(self: &Arc<Self>, blobs: Vec<(ChunkId, Bytes)>) {
        let now = std::time::Instant::now();
        *self.last_queued.lock().unwrap_or_else(|p| p.into_inner()) = now;
        let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        for (id, blob) in blobs {
            let size = blob.len() as u64;
            if self.queued_bytes.load(Ordering::SeqCst) + size > MAX_QUEUED_BYTES {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(chunk = %id, "chunk cache queue full: not cached");
                continue;
            }
            if writer.is_none() {
                *writer = self.start_writer();
            }
            let Some(tx) = writer.as_ref() else {
                return;
            };
            self.pending.fetch_add(1, Ordering::SeqCst);
            self.queued_bytes.fetch_add(size, Ordering::SeqCst);
            (self.queued.lock().unwrap_or_else(|p| p.into_inner())).insert(id, blob.clone());
            if tx.send((id, blob, now)).is_err() {
                self.written(&id, size);
            }
        }
    }

    /// The writer thread: holds the cache weakly, ends when the cache (its queue's sender) goes.
    fn start_writer(self: &Arc<Self>) -> Option<std::sync::mpsc::Sender<Queued>> {
        let (tx, rx) = std::sync::mpsc::channel::<Queued>();
        let cache = Arc::downgrade(self);
        let started = std::thread::Builder::new()
            .name("chunk-cache".into())
            .spawn(move || {
                // SAFETY: setpriority on this thread only (a thread id is a process id to it).
                unsafe {
                    let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                    libc::setpriority(libc::PRIO_PROCESS, tid, WRITER_NICE);
                }
                while let Ok((id, blob, queued)) = rx.recv() {
                    let Some(cache) = cache.upgrade() else {
                        return;
                    };
                    cache.settle(queued);
                    cache.insert_blocking(&id, &blob);
                    cache.written(&id, blob.len() as u64);
                }
            });
        match started {
            Ok(_) => Some(tx),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the chunk cache's writer: not caching");
                None
            }
        }
    }

    /// Sleeps until inserts have settled, or the entry queued at `queued` is due.
    fn settle(&self, queued: std::time::Instant) {
        loop {
            let last = *self.last_queued.lock().unwrap_or_else(|p| p.into_inner());
            let now = std::time::Instant::now();
            let quiet_at = last + WRITER_SETTLE;
            let due_at = queued + WRITER_MAX_DELAY;
            let wake_at = quiet_at.min(due_at);
            if now >= wake_at {
                return;
            }
            std::thread::sleep(wake_at - now);
        }
    }

    fn written(&self, id: &ChunkId, size: u64) {
        (self.queued.lock().unwrap_or_else(|p| p.into_inner())).remove(id);
        self.queued_bytes.fetch_sub(size, Ordering::SeqCst);
        if self.pending.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.idle.notify_waiters();
        }
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
        (self.queued.lock().unwrap_or_else(|p| p.into_inner())).remove(id);
        self.lock().drop_entry(id);
        let _ = tokio::fs::remove_file(self.path(id)).await;
    }

    /// Bytes currently held.
    pub async fn used(&self) -> u64 {
        self.lock().used
    }

    /// What the cache holds now, on disk and queued in memory (for metrics).
    pub fn usage(&self) -> CacheUsage {
        CacheUsage {
            bytes: self.lock().used,
            capacity_bytes: self.capacity,
            queued_bytes: self.queued_bytes.load(Ordering::SeqCst),
            dropped_total: self.dropped.load(Ordering::Relaxed),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Writes one entry: to a temporary name, then renamed. Not fsynced: a torn entry after a
/// crash fails its hash check on read and is refetched. Private like the store: chunks are
/// sandbox memory.
fn write_entry(tmp: &Path, dest: &Path, blob: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(crate::durable::FILE_MODE)
        .open(tmp)
        .and_then(|mut f| f.write_all(blob))
        .and_then(|()| std::fs::rename(tmp, dest));
    if written.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    written
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

    #[tokio::test]
    async fn background_inserts_are_written_by_one_writer_once_settled() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Arc::new(ChunkCache::open(dir.path(), 1 << 20).unwrap());
        let ids: Vec<ChunkId> = (0..40u8).map(|i| ChunkId::of(&[i])).collect();
        let blobs: Vec<(ChunkId, Bytes)> = ids
            .iter()
            .map(|id| (*id, Bytes::from(id.to_hex().into_bytes())))
            .collect();
        cache.insert_many_in_background(blobs[..20].to_vec());
        cache.insert_many_in_background(blobs[20..].to_vec());
        // Served from the queue before they are written.
        assert_eq!(cache.get(&ids[3]).await, Some(blobs[3].1.clone()));
        cache.wait_idle().await;
        assert!(cache.queued.lock().unwrap().is_empty());
        assert_eq!(cache.queued_bytes.load(Ordering::SeqCst), 0);
        let got = cache.get_many_blocking(&ids);
        for ((id, want), got) in blobs.iter().zip(got) {
            assert_eq!(got.as_ref(), Some(want), "{id}");
        }
        assert_eq!(cache.used().await, 40 * 64);
        // No temporary files left; the writer ends with the cache.
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
        // The writer holds the cache only while it writes: it goes with its last owner.
        let weak = Arc::downgrade(&cache);
        drop(cache);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while weak.upgrade().is_some() {
            assert!(
                std::time::Instant::now() < deadline,
                "the writer keeps the cache"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}
