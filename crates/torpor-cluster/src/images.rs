//! A worker's disk as a cache of the cluster's snapshot store: what makes "wake on any
//! worker" true.
//!
//! ```text
//!   DATA/images/<name>           checkpoints this worker wrote (a relative image directory in
//!                                the protocol), durable before the call answers
//!   DATA/images/<name>.snapshot  the snapshot id it was uploaded as (a local copy of it)
//!   DATA/cache/<snapshot>        snapshots kept once fetched: root filesystems, golden images
//!   DATA/fetch/<container>       an image fetched for one restore, removed after it
//! ```
//!
//! - **Park.** A checkpoint to a relative directory lands in `images/` (written to a temporary
//!   name, fsynced, renamed): the controller records the image as on this worker and frees the
//!   slot at once. It then asks this worker to upload it (`Upload`): the store receives only
//!   the chunks it lacks, and the directory stays here as a local copy of the snapshot.
//! - **Wake.** A restore names the image (a relative directory on the worker that holds it)
//!   and/or its snapshot. The worker restores from its own copy when it has one, else fetches
//!   the snapshot (every chunk verified, through the chunk cache) into `fetch/` and removes it
//!   after the restore. Root filesystems and golden images are kept in `cache/` once fetched.
//! - **Which store.** The controllers announce it at registration; the worker opens it with its
//!   own credentials (the `AWS_*` variables for S3). Each call names the tenant's namespace and
//!   key (for encrypted stores), which the worker keeps only for that call.
//! - **Re-encoded copies.** runsc writes a checkpoint's frames deflate-compressed, and a restore
//!   inflates them all; an image fetched from the store is written with stored frames, which
//!   restore faster. So [`REENCODE_AFTER`] after an upload, the local copy is rewritten with
//!   stored frames in the background (`torpor_snapshot::reencode`: one at a time per process,
//!   nice 10, a disk floor), and put in place only while it is still the copy of that snapshot
//!   and no restore reads it; a wake on this worker then restores it without inflating. Only
//!   uploaded copies are touched (the store holds the image either way). `--reencode-images
//!   false` turns it off; `torpor_parked_reencodes_total{result}` counts the outcomes.
//! - **Disk.** Non-uploaded images are never evicted (they may be the only copy). Local copies
//!   of uploaded images are removed after a restore from them, when the controller removes
//!   them, and beyond [`MAX_LOCAL_COPIES`] (oldest first).

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::{IntCounterVec, Opts, Registry};
use tonic::Status;
use torpor_runtime::node::{PutImage, StoreAccess, StoredFiles, Uploaded};
use torpor_snapshot::{
    Backend, ChunkCache, PackCatalog, PutOptions, SnapshotId, Store, StoreConfig, StoreError,
    TenantKey,
};

use crate::convert::bad;

/// Local copies of uploaded images a worker keeps at most.
pub const MAX_LOCAL_COPIES: usize = 64;
/// How long after its upload a local copy's re-encoding starts: a wake sooner removes the copy
/// (the sandbox's next park makes another), and costs no re-encoding.
pub const REENCODE_AFTER: Duration = Duration::from_secs(2);

/// Opens the store a controller announced (`s3://bucket/prefix` or a directory).
pub type OpenBackend = Arc<dyn Fn(&str) -> Result<Arc<dyn Backend>, String> + Send + Sync>;

/// The worker's images and its view of the snapshot store.
pub struct WorkerImages {
    images: PathBuf,
    cache_dir: PathBuf,
    fetch_dir: PathBuf,
    open: OpenBackend,
    chunk_cache: Option<Arc<ChunkCache>>,
    backend: Mutex<Option<(String, Arc<dyn Backend>)>>,
    /// `--pack-size` (`None`: packs on S3, none on a directory; see `pack_bytes_for`).
    pack_size: Option<u64>,
    /// What this worker learnt of each namespace's packs (a store is opened per call).
    catalogs: Mutex<HashMap<Option<String>, Arc<PackCatalog>>>,
    /// Snapshot id -> the local copy in `images/`.
    copies: Arc<Mutex<HashMap<String, PathBuf>>>,
    /// Images restores read now (a count per directory): never re-encoded under them.
    restoring: Arc<Mutex<HashMap<PathBuf, usize>>>,
    /// Local copies re-encoded after their upload (see the module doc).
    reencode: bool,
    /// The CPU priority (nice) of uploads ([`uploads_runtime`]).
    upload_nice: i32,
    reencodes: IntCounterVec,
    /// One fetch at a time per kept snapshot.
    fetching: tokio::sync::Mutex<()>,
}

/// A restore reading an image: while it lives, the image is not re-encoded.
pub struct Reading {
    restoring: Arc<Mutex<HashMap<PathBuf, usize>>>,
    dir: PathBuf,
}

impl Drop for Reading {
    fn drop(&mut self) {
        let mut r = self.restoring.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = r.get_mut(&self.dir) {
            *n -= 1;
            if *n == 0 {
                r.remove(&self.dir);
            }
        }
    }
}

fn internal(what: &str, e: impl std::fmt::Display) -> Status {
    Status::internal(format!("{what}: {e}"))
}

fn store_status(e: StoreError) -> Status {
    match e {
        StoreError::SnapshotNotFound { .. } => Status::not_found(format!("snapshot store: {e}")),
        e => Status::unavailable(format!("snapshot store: {e}")),
    }
}

impl WorkerImages {
    /// Lays out `data_dir`'s image directories, clears what an interrupted run left (temporary
    /// checkpoints and fetches) and indexes the local copies.
    pub fn open(
        data_dir: &Path,
        open: OpenBackend,
        chunk_cache_bytes: u64,
    ) -> std::io::Result<WorkerImages> {
        let images = data_dir.join("images");
        let cache_dir = data_dir.join("cache");
        let fetch_dir = data_dir.join("fetch");
        let _ = std::fs::remove_dir_all(&fetch_dir);
        for d in [&images, &cache_dir, &fetch_dir] {
            std::fs::create_dir_all(d)?;
        }
        for dir in [&images, &cache_dir] {
            for e in std::fs::read_dir(dir)?.flatten() {
                if e.file_name().to_string_lossy().starts_with(".tmp-") {
                    // Checkpoints and fetches being written (directories), re-encodings (files).
                    let _ = match e.file_type() {
                        Ok(t) if t.is_dir() => std::fs::remove_dir_all(e.path()),
                        _ => std::fs::remove_file(e.path()),
                    };
                }
            }
        }
        let mut copies = HashMap::new();
        for e in std::fs::read_dir(&images)?.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "snapshot") {
                let dir = p.with_extension("");
                match std::fs::read_to_string(&p) {
                    Ok(id) if dir.is_dir() => {
                        copies.insert(id.trim().to_string(), dir);
                    }
                    _ => {
                        let _ = std::fs::remove_file(&p);
                    }
                }
            }
        }
        let chunk_cache = if chunk_cache_bytes > 0 {
            Some(Arc::new(
                ChunkCache::open(data_dir.join("chunk-cache"), chunk_cache_bytes)
                    .map_err(std::io::Error::other)?,
            ))
        } else {
            None
        };
        Ok(WorkerImages {
            images,
            cache_dir,
            fetch_dir,
            open,
            chunk_cache,
            backend: Mutex::new(None),
            pack_size: None,
            catalogs: Mutex::default(),
            copies: Arc::new(Mutex::new(copies)),
            restoring: Arc::default(),
            reencode: true,
            upload_nice: UPLOAD_NICE,
            reencodes: IntCounterVec::new(
                Opts::new(
                    "torpor_parked_reencodes_total",
                    "Local copies of uploaded images rewritten with stored frames, by result",
                ),
                &["result"],
            )
            .expect("a valid metric"),
            fetching: tokio::sync::Mutex::new(()),
        })
    }

    /// Whether local copies are re-encoded after their upload (default: yes).
    pub fn with_reencoding(mut self, on: bool) -> Self {
        self.reencode = on;
        self
    }

    /// The nice value of the threads that upload (default [`UPLOAD_NICE`]; 0: normal priority).
    /// The first upload of the process fixes it.
    /// Bytes per pack of this worker's uploads (`Some(0)`: none; `None`: by the store).
    pub fn with_pack_size(mut self, pack_size: Option<u64>) -> Self {
        self.pack_size = pack_size;
        self
    }

    pub fn with_upload_nice(mut self, nice: i32) -> Self {
        self.upload_nice = nice.clamp(0, 19);
        self
    }

    /// Bytes this worker holds in memory for its images outside any sandbox: chunks fetched or
    /// uploaded, queued for the chunk cache's writer (at most 128 MiB, for a second or so
    /// after a fetch).
    pub fn memory_held(&self) -> u64 {
        self.chunk_cache
            .as_ref()
            .map_or(0, |c| c.usage().queued_bytes)
    }

    #[cfg(test)]
    pub(crate) fn chunk_cache(&self) -> Option<&Arc<ChunkCache>> {
        self.chunk_cache.as_ref()
    }

    /// Registers the chunk cache's gauges and the re-encoding counter on the worker's metrics.
    pub fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        if let Some(c) = &self.chunk_cache {
            registry.register(Box::new(torpor_snapshot::metrics::CacheMetrics::new(
                c.clone(),
            )))?;
        }
        registry.register(Box::new(self.reencodes.clone()))
    }

    /// Re-encodings so far that ended with `result` (`done`, `nothing_to_gain`, `superseded`,
    /// `low_disk`, `failed`).
    pub fn reencoded(&self, result: &str) -> u64 {
        self.reencodes.with_label_values(&[result]).get()
    }

    /// Marks `image` as read by a restore until the guard drops.
    pub fn reading(&self, image: &Path) -> Reading {
        *self
            .restoring
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(image.to_path_buf())
            .or_default() += 1;
        Reading {
            restoring: self.restoring.clone(),
            dir: image.to_path_buf(),
        }
    }

    /// Re-encodes the local copy `dir` of `snapshot` after [`REENCODE_AFTER`], in the
    /// background.
    fn reencode_soon(&self, snapshot: String, dir: PathBuf) {
        if !self.reencode {
            return;
        }
        let copy = CopyOf {
            copies: self.copies.clone(),
            restoring: self.restoring.clone(),
            snapshot,
            dir,
        };
        let counter = self.reencodes.clone();
        tokio::spawn(async move {
            tokio::time::sleep(REENCODE_AFTER).await;
            let result = copy.reencode().await;
            counter.with_label_values(&[result]).inc();
        });
    }

    /// The store a controller announced. The first one opens; another controller announcing
    /// a different one is logged and ignored (one cluster, one store).
    pub fn set_store(&self, location: &str) {
        if location.is_empty() {
            return;
        }
        let mut b = self.backend.lock().unwrap_or_else(|p| p.into_inner());
        match &*b {
            Some((at, _)) if at == location => {}
            Some((at, _)) => {
                tracing::warn!(announced = location, using = %at,
                    "a controller announced another snapshot store; keeping the first");
            }
            None => match (self.open)(location) {
                Ok(backend) => {
                    tracing::info!(store = location, "snapshot store opened");
                    *b = Some((location.to_string(), backend));
                }
                Err(e) => {
                    tracing::error!(store = location, error = %e, "cannot open the snapshot store");
                }
            },
        }
    }

    fn store(&self, access: &StoreAccess) -> Result<Arc<Store>, Status> {
        let (location, backend) = self
            .backend
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| {
                Status::failed_precondition(
                    "this worker has no snapshot store (no controller announced one, or it \
                     could not be opened: see the worker's log)",
                )
            })?;
        let cfg = StoreConfig {
            key: access.key.map(TenantKey::from_bytes),
            namespace: access.namespace.clone(),
            pack_bytes: torpor_snapshot::pack_bytes_for(
                self.pack_size,
                location.starts_with("s3://"),
            ),
            ..StoreConfig::default()
        };
        let catalog = self
            .catalogs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(access.namespace.clone())
            .or_default()
            .clone();
        let mut store = Store::new(backend, cfg)
            .map_err(store_status)?
            .with_catalog(catalog);
        if let Some(c) = &self.chunk_cache {
            store = store.with_cache(c.clone());
        }
        Ok(Arc::new(store))
    }

    /// An image directory the controller names: a relative name is in this worker's own image
    /// area (one plain component); an absolute path is taken as it is (a directory every
    /// machine shares, or a single machine).
    pub fn resolve(&self, dir: &str) -> Result<PathBuf, Status> {
        let p = Path::new(dir);
        if p.is_absolute() {
            return Ok(p.to_path_buf());
        }
        Ok(self.images.join(own_name(dir)?))
    }

    /// Where a checkpoint to `dir` is written first, when it is one of this worker's own
    /// (`None`: an absolute path, written in place).
    pub fn staging(&self, dir: &str) -> Result<Option<(PathBuf, PathBuf)>, Status> {
        if Path::new(dir).is_absolute() {
            return Ok(None);
        }
        let name = own_name(dir)?;
        Ok(Some((
            self.images.join(format!(".tmp-{name}")),
            self.images.join(name),
        )))
    }

    /// Makes a checkpoint written to `tmp` durable as `dest`.
    pub async fn commit(&self, tmp: PathBuf, dest: PathBuf) -> Result<(), Status> {
        tokio::task::spawn_blocking(move || {
            torpor_snapshot::durable::fsync_tree(&tmp)?;
            let _ = std::fs::remove_dir_all(&dest);
            torpor_snapshot::durable::rename_durably(&tmp, &dest)
        })
        .await
        .map_err(|e| internal("commit task", e))?
        .map_err(|e| internal("cannot store the checkpoint durably", e))
    }

    /// Points `launch`'s root filesystem at this worker's copy of its snapshot (fetched once).
    pub async fn rootfs(&self, stored: &StoredFiles) -> Result<Option<PathBuf>, Status> {
        let Some(snapshot) = &stored.rootfs else {
            return Ok(None);
        };
        self.kept(snapshot, &stored.access).await.map(Some)
    }

    /// The image to restore `container` from: `(path, remove after the restore)`.
    pub async fn image(
        &self,
        container: &str,
        named: &str,
        stored: &StoredFiles,
    ) -> Result<(PathBuf, bool), Status> {
        if !named.is_empty() {
            let p = self.resolve(named)?;
            if p.is_dir() {
                return Ok((p, false));
            }
            if stored.image.is_none() {
                return Err(image_lost(&format!(
                    "image {named} is not on this worker and not in the store"
                )));
            }
        }
        let Some(snapshot) = &stored.image else {
            return Err(bad("restore", "no image and no snapshot"));
        };
        if let Some(copy) = self.copy_of(snapshot) {
            tracing::debug!(%container, %snapshot, "restoring from this worker's copy");
            return Ok((copy, false));
        }
        if stored.keep_image {
            return Ok((self.kept(snapshot, &stored.access).await?, false));
        }
        let dest = self.fetch_dir.join(own_name(container)?);
        let _ = std::fs::remove_dir_all(&dest);
        self.fetch(snapshot, &stored.access, &dest).await?;
        Ok((dest, true))
    }

    /// After a restore from `image`: a fetched image goes; so does a local copy of an uploaded
    /// one (the store holds it; the sandbox's next checkpoint supersedes it).
    /// A kept image (`keep`: a golden one) stays.
    pub fn after_restore(&self, image: &Path, fetched: bool, keep: bool) {
        if fetched {
            let _ = std::fs::remove_dir_all(image);
            return;
        }
        if keep {
            return;
        }
        let mut copies = self.copies.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(snapshot) = copies
            .iter()
            .find(|(_, p)| p.as_path() == image)
            .map(|(s, _)| s.clone())
        {
            copies.remove(&snapshot);
            drop(copies);
            remove_copy(image);
        }
    }

    fn copy_of(&self, snapshot: &str) -> Option<PathBuf> {
        let mut copies = self.copies.lock().unwrap_or_else(|p| p.into_inner());
        match copies.get(snapshot) {
            Some(p) if p.is_dir() => Some(p.clone()),
            Some(_) => {
                copies.remove(snapshot);
                None
            }
            None => None,
        }
    }

    /// A snapshot kept in `cache/` (fetched on first use).
    async fn kept(&self, snapshot: &str, access: &StoreAccess) -> Result<PathBuf, Status> {
        let name = own_name(snapshot)?;
        let dest = self.cache_dir.join(name);
        if dest.is_dir() {
            return Ok(dest);
        }
        let _one = self.fetching.lock().await;
        if dest.is_dir() {
            return Ok(dest);
        }
        let tmp = self.cache_dir.join(format!(".tmp-{name}"));
        let _ = std::fs::remove_dir_all(&tmp);
        self.fetch(snapshot, access, &tmp).await?;
        std::fs::rename(&tmp, &dest).map_err(|e| internal("cannot keep a fetched snapshot", e))?;
        Ok(dest)
    }

    async fn fetch(&self, snapshot: &str, access: &StoreAccess, dest: &Path) -> Result<(), Status> {
        let id = SnapshotId::new(snapshot).map_err(|e| bad("snapshot id", e))?;
        let store = self.store(access)?;
        let dest = dest.to_path_buf();
        let t = std::time::Instant::now();
        // The store's futures run in their own task (they are not all Send-for-any-lifetime).
        let stats = tokio::spawn(async move { store.get_dir(&id, &dest).await })
            .await
            .map_err(|e| internal("fetch task", e))?
            .map_err(|e| match e {
                StoreError::SnapshotNotFound { .. } => {
                    image_lost(&format!("snapshot {snapshot} is not in the snapshot store"))
                }
                e => store_status(e),
            })?;
        tracing::info!(%snapshot, ms = t.elapsed().as_millis() as u64,
            chunks = stats.chunks_fetched, cache_hits = stats.cache_hits, "snapshot fetched");
        Ok(())
    }

    /// Puts one of this worker's own images into the store as `put` says and keeps it as a
    /// local copy. `put.parent` (the sandbox's previous snapshot) gone meanwhile (retention, a
    /// delete) is not an error: the put goes on without it.
    pub async fn upload(&self, dir: &str, put: &PutImage) -> Result<Uploaded, Status> {
        if Path::new(dir).is_absolute() {
            return Err(bad("upload", "only images of the worker's own image area"));
        }
        let src = self.resolve(dir)?;
        if !src.is_dir() {
            return Err(image_lost(&format!("image {dir} is not on this worker")));
        }
        let store = self.store(&put.access)?;
        let id = (put.id.as_deref())
            .map(|i| SnapshotId::new(i).map_err(|e| bad("snapshot id", e)))
            .transpose()?;
        // A fixed id is a golden snapshot or a root filesystem: no sandbox's previous one.
        let parent = (put.parent.as_deref())
            .filter(|_| id.is_none())
            .map(|p| SnapshotId::new(p).map_err(|e| bad("parent snapshot id", e)))
            .transpose()?;
        let (labels, pin) = (put.labels.clone(), put.pin);
        let source = src.clone();
        // On the uploads' own runtime (its threads niced): a park's checkpoint, on its caller's
        // path, goes before the uploads of the parks before it.
        let put = uploads_runtime(self.upload_nice)
            .spawn(async move {
                if let Some(want) = &id {
                    // A fixed id already stored (a golden snapshot uploaded by another worker).
                    if let Ok(m) = store.load_manifest(want).await {
                        return Ok((want.clone(), m.logical_bytes(), 0));
                    }
                }
                let put = |parent: Option<SnapshotId>| PutOptions {
                    id: id.clone(),
                    labels: labels.clone(),
                    parent,
                };
                let report = match store.put_dir_with(&source, put(parent.clone())).await {
                    Err(StoreError::ParentNotFound { id: gone }) => {
                        tracing::debug!(parent = %gone,
                            "the previous snapshot is gone: uploading without it");
                        store.put_dir_with(&source, put(None)).await?
                    }
                    put => put?,
                };
                if pin {
                    store.pin(&report.id).await?;
                }
                Ok::<_, StoreError>((
                    report.id,
                    report.stats.input_bytes,
                    report.stats.bytes_written,
                ))
            })
            .await
            .map_err(|e| internal("upload task", e))?
            .map_err(store_status)?;
        let (snapshot, input_bytes, bytes_written) = put;
        let uploaded = Uploaded {
            snapshot: snapshot.to_string(),
            input_bytes,
            bytes_written,
        };
        // Under the copies' lock, which `remove` holds while it removes: either the image is
        // still here and becomes a recorded copy, or it was removed while it uploaded (its
        // sandbox woke from it, or went) and nothing is recorded (a marker written after the
        // removal would outlive it).
        let evict = {
            let mut copies = self.copies.lock().unwrap_or_else(|p| p.into_inner());
            if !src.is_dir() {
                tracing::debug!(%snapshot, image = %src.display(),
                    "image removed while it uploaded: no local copy kept");
                return Ok(uploaded);
            }
            let marker = src.with_extension("snapshot");
            std::fs::write(&marker, snapshot.as_str())
                .map_err(|e| internal("cannot record the upload", e))?;
            copies.insert(snapshot.to_string(), src.clone());
            oldest_beyond(&mut copies, MAX_LOCAL_COPIES)
        };
        for p in evict {
            remove_copy(&p);
        }
        self.reencode_soon(snapshot.to_string(), src);
        Ok(uploaded)
    }

    /// Drops every copy of `snapshot` this worker keeps (the store no longer has it): the
    /// local copy of an upload, and a kept fetch (a deleted template's root filesystem or
    /// golden image). Waits for a fetch in progress. Returns whether there was one.
    pub async fn forget(&self, snapshot: &str) -> Result<bool, Status> {
        let snapshot = own_name(snapshot)?;
        let _one = self.fetching.lock().await;
        let copy = self
            .copies
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(snapshot);
        let had_copy = copy.is_some();
        if let Some(c) = copy {
            remove_copy(&c);
        }
        let kept = self.cache_dir.join(snapshot);
        let had_kept = kept.exists();
        if had_kept {
            std::fs::remove_dir_all(&kept).map_err(|e| internal("remove a kept snapshot", e))?;
        }
        if had_copy || had_kept {
            tracing::info!(%snapshot, "dropped a copy of a snapshot the store no longer has");
        }
        Ok(had_copy || had_kept)
    }

    /// The checkpoints in this worker's image area (not those being written), oldest first.
    pub fn list(&self) -> Vec<torpor_runtime::node::WorkerImage> {
        let Ok(entries) = std::fs::read_dir(&self.images) else {
            return Vec::new();
        };
        let now = std::time::SystemTime::now();
        let mut out: Vec<torpor_runtime::node::WorkerImage> = entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_str()?.to_string();
                let meta = e.metadata().ok()?;
                if name.starts_with('.') || !meta.is_dir() {
                    return None; // being written, or an upload record
                }
                let age = meta
                    .modified()
                    .ok()
                    .and_then(|m| now.duration_since(m).ok())
                    .unwrap_or_default();
                let uploaded = self.images.join(format!("{name}.snapshot")).exists();
                Some(torpor_runtime::node::WorkerImage {
                    dir: name,
                    age,
                    uploaded,
                })
            })
            .collect();
        out.sort_by_key(|i| std::cmp::Reverse(i.age));
        out
    }

    /// Removes one of this worker's own images (and its upload record).
    pub fn remove(&self, dir: &str) -> Result<(), Status> {
        if Path::new(dir).is_absolute() {
            return Err(bad("remove", "only images of the worker's own image area"));
        }
        let p = self.resolve(dir)?;
        // The lock is held while the files go: an upload of this image finishing meanwhile
        // records its copy before (and it goes here) or finds it gone (see `upload`).
        let mut copies = self.copies.lock().unwrap_or_else(|p| p.into_inner());
        copies.retain(|_, c| *c != p);
        remove_copy(&p);
        Ok(())
    }
}

/// The nice value of upload threads by default: below checkpoints and restores, which are on
/// calls' paths, as re-encodes are.
pub const UPLOAD_NICE: i32 = 10;

/// The runtime uploads run on, made once per process on a thread at `nice`: its worker and
/// blocking threads (reading, inflating, chunking, hashing, compressing) inherit that priority,
/// so on a busy worker the checkpoints of the next parks and the restores of wakes go first
/// and the uploads take what CPU is left. Never dropped (a static).
fn uploads_runtime(nice: i32) -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        std::thread::Builder::new()
            .name("uploads-init".into())
            .spawn(move || {
                // SAFETY: setpriority on this thread only (a thread id is a process id to it);
                // the runtime's threads, created from it, inherit it.
                unsafe {
                    let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                    libc::setpriority(libc::PRIO_PROCESS, tid, nice);
                }
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("upload")
                    .enable_all()
                    .build()
                    .expect("the uploads' runtime starts")
            })
            .expect("a thread for the uploads' runtime")
            .join()
            .expect("the uploads' runtime starts")
    })
}

/// A local copy of an uploaded snapshot, to re-encode.
struct CopyOf {
    copies: Arc<Mutex<HashMap<String, PathBuf>>>,
    restoring: Arc<Mutex<HashMap<PathBuf, usize>>>,
    snapshot: String,
    dir: PathBuf,
}

impl CopyOf {
    /// Still this worker's copy of the snapshot (not removed, restored or superseded).
    fn current(&self) -> bool {
        self.copies
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&self.snapshot)
            .is_some_and(|p| *p == self.dir)
            && self.dir.is_dir()
    }

    /// Rewrites every image file of the copy; answers the outcome's label.
    async fn reencode(&self) -> &'static str {
        use torpor_snapshot::reencode::{one_at_a_time, reencode_dir};
        let _turn = one_at_a_time().acquire().await;
        if !self.current() {
            return "superseded";
        }
        reencode_dir(&self.dir, "local copy", &self.snapshot, |src, tmp, was| {
            std::future::ready(self.put_in_place(&src, &tmp, &was))
        })
        .await
    }

    /// Renames the rewritten `tmp` over `src` while no restore reads the copy, it is still the
    /// snapshot's copy, and `src` is the file that was read (`was`); false (nothing renamed)
    /// otherwise. A restore that starts afterwards reads the new file: the same image.
    fn put_in_place(
        &self,
        src: &Path,
        tmp: &Path,
        was: &torpor_snapshot::reencode::FileStamp,
    ) -> bool {
        // Both held across the rename: a restore cannot start reading, nor a removal take the
        // copy out (removals take it out of `copies` before they delete its directory).
        let restoring = self.restoring.lock().unwrap_or_else(|p| p.into_inner());
        let copies = self.copies.lock().unwrap_or_else(|p| p.into_inner());
        if restoring.contains_key(&self.dir)
            || copies.get(&self.snapshot) != Some(&self.dir)
            || torpor_snapshot::reencode::FileStamp::of(src).as_ref() != Some(was)
        {
            return false;
        }
        let renamed = std::fs::rename(tmp, src).is_ok();
        drop((copies, restoring));
        if renamed {
            if let Ok(d) = std::fs::File::open(&self.dir) {
                let _ = d.sync_all();
            }
        }
        renamed
    }
}

/// One plain path component (no `/`, `.`, `..`, nothing hidden).
fn own_name(name: &str) -> Result<&str, Status> {
    let mut parts = Path::new(name).components();
    match (parts.next(), parts.next()) {
        (Some(Component::Normal(_)), None) if !name.starts_with('.') && !name.contains('/') => {
            Ok(name)
        }
        _ => Err(bad("image name", format!("{name:?} is not a plain name"))),
    }
}

fn image_lost(msg: &str) -> Status {
    crate::convert::status_of(&torpor_runtime::RuntimeError::ImageLost(msg.to_string()))
}

fn remove_copy(dir: &Path) {
    let _ = std::fs::remove_file(dir.with_extension("snapshot"));
    let _ = std::fs::remove_dir_all(dir);
}

/// Takes the oldest local copies out of `copies` until at most `max` remain.
fn oldest_beyond(copies: &mut HashMap<String, PathBuf>, max: usize) -> Vec<PathBuf> {
    if copies.len() <= max {
        return Vec::new();
    }
    let mut by_age: Vec<(std::time::SystemTime, String)> = copies
        .iter()
        .map(|(s, p)| {
            let at = std::fs::metadata(p.with_extension("snapshot"))
                .and_then(|m| m.modified())
                .unwrap_or(std::time::UNIX_EPOCH);
            (at, s.clone())
        })
        .collect();
    by_age.sort();
    let excess = copies.len() - max;
    by_age
        .into_iter()
        .take(excess)
        .filter_map(|(_, s)| copies.remove(&s))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker with data directory `dir` whose store is the directory `store`.
    fn images(dir: &Path, store: &Path) -> WorkerImages {
        let store = store.to_path_buf();
        let open: OpenBackend = Arc::new(move |_loc: &str| {
            torpor_snapshot::LocalBackend::open(&store)
                .map(|b| Arc::new(b) as Arc<dyn Backend>)
                .map_err(|e| e.to_string())
        });
        let w = WorkerImages::open(dir, open, 0).unwrap();
        w.set_store("shared");
        w
    }

    /// A checkpoint `name` holding `bytes` on `w`: staged, committed, uploaded.
    async fn checkpoint_uploaded(
        w: &WorkerImages,
        name: &str,
        bytes: &[u8],
    ) -> (PathBuf, Uploaded) {
        let (tmp_dir, dest) = w.staging(name).unwrap().unwrap();
        std::fs::create_dir_all(&tmp_dir).unwrap();
        std::fs::write(tmp_dir.join("checkpoint.img"), bytes).unwrap();
        w.commit(tmp_dir, dest.clone()).await.unwrap();
        let up = w.upload(name, &PutImage::default()).await.unwrap();
        (dest, up)
    }

    /// A compressible image as runsc writes it (deflate frames).
    fn compressible_image(seed: u8) -> Vec<u8> {
        let stream: Vec<u8> = (0..600_000u32).map(|i| (i / 4096) as u8 ^ seed).collect();
        torpor_snapshot::gvisor::encode_compressed_image(b"{\"k\":1}", &stream, 65_536)
    }

    /// Waits until `w` has finished `n` re-encodings (any outcome).
    async fn reencodings(w: &WorkerImages, n: u64) {
        let total = || {
            [
                "done",
                "nothing_to_gain",
                "superseded",
                "low_disk",
                "failed",
            ]
            .iter()
            .map(|r| w.reencoded(r))
            .sum::<u64>()
        };
        for _ in 0..200 {
            if total() >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{n} re-encodings did not end");
    }

    #[tokio::test]
    async fn an_uploaded_copy_is_reencoded_as_a_fetch_would_write_it() {
        let tmp = tempfile::tempdir().unwrap();
        let store = tmp.path().join("store");
        let a = images(&tmp.path().join("a"), &store);
        let b = images(&tmp.path().join("b"), &store);
        let runsc_wrote = compressible_image(1);
        let (dest, up) = checkpoint_uploaded(&a, "sb-1-g1", &runsc_wrote).await;
        let img = dest.join("checkpoint.img");
        assert_eq!(
            std::fs::read(&img).unwrap(),
            runsc_wrote,
            "not before its time"
        );
        reencodings(&a, 1).await;
        assert_eq!(a.reencoded("done"), 1);
        let reencoded = std::fs::read(&img).unwrap();
        assert!(reencoded.len() > runsc_wrote.len(), "stored frames");
        assert!(!a.images.join(".tmp-reencode-sb-1-g1").exists());
        // What another worker fetches from the store is the same file, byte for byte.
        let stored = StoredFiles {
            image: Some(up.snapshot.clone()),
            ..StoredFiles::default()
        };
        let (p, fetched) = b.image("sb-1-g2", "", &stored).await.unwrap();
        assert!(fetched);
        assert_eq!(std::fs::read(p.join("checkpoint.img")).unwrap(), reencoded);
        // And a restores from its copy as before.
        let (p, fetched) = a.image("sb-1-g2", "sb-1-g1", &stored).await.unwrap();
        assert_eq!((p, fetched), (dest, false));
    }

    #[tokio::test]
    async fn a_copy_being_restored_or_gone_is_not_replaced_and_off_means_off() {
        let tmp = tempfile::tempdir().unwrap();
        let store = tmp.path().join("store");
        let a = images(&tmp.path().join("a"), &store);
        // Read by a restore for the whole time: left as it is.
        let (dest, _) = checkpoint_uploaded(&a, "sb-1-g1", &compressible_image(1)).await;
        let reading = a.reading(&dest);
        // Restored (and so removed) before its time.
        let (gone, up) = checkpoint_uploaded(&a, "sb-2-g1", &compressible_image(2)).await;
        let stored = StoredFiles {
            image: Some(up.snapshot.clone()),
            ..StoredFiles::default()
        };
        let (p, fetched) = a.image("sb-2-g2", "sb-2-g1", &stored).await.unwrap();
        a.after_restore(&p, fetched, false);
        assert!(!gone.exists());
        reencodings(&a, 2).await;
        assert_eq!((a.reencoded("superseded"), a.reencoded("done")), (2, 0));
        assert_eq!(
            std::fs::read(dest.join("checkpoint.img")).unwrap(),
            compressible_image(1)
        );
        assert!(!gone.exists(), "nothing written back into a removed copy");
        drop(reading);
        // Turned off: nothing is queued at all.
        let c = images(&tmp.path().join("c"), &store).with_reencoding(false);
        let (dest, _) = checkpoint_uploaded(&c, "sb-3-g1", &compressible_image(3)).await;
        tokio::time::sleep(REENCODE_AFTER + Duration::from_millis(500)).await;
        assert_eq!(c.reencoded("done") + c.reencoded("superseded"), 0);
        assert_eq!(
            std::fs::read(dest.join("checkpoint.img")).unwrap(),
            compressible_image(3)
        );
    }

    /// Content that chunks into many pieces (noise: no two chunks alike), changed in one
    /// place by `change`.
    fn noise(change: u8) -> Vec<u8> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut v: Vec<u8> = (0..4 << 20)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        v[1 << 20] = change;
        v
    }

    #[tokio::test]
    async fn an_upload_naming_its_previous_snapshot_looks_up_only_what_changed() {
        let tmp = tempfile::tempdir().unwrap();
        let backend = Arc::new(Gated::open(&tmp.path().join("store")));
        let b = backend.clone();
        let open: OpenBackend = Arc::new(move |_loc: &str| Ok(b.clone() as Arc<dyn Backend>));
        let w = WorkerImages::open(&tmp.path().join("w"), open, 0).unwrap();
        w.set_store("shared");
        let naming = |p: &str| PutImage {
            parent: Some(p.to_string()),
            ..PutImage::default()
        };
        let mut n = 0;
        let mut park = |change: u8| {
            n += 1;
            let (w, name) = (&w, format!("sb-1-g{n}"));
            async move {
                let (tmp_dir, dest) = w.staging(&name).unwrap().unwrap();
                std::fs::create_dir_all(&tmp_dir).unwrap();
                std::fs::write(tmp_dir.join("checkpoint.img"), noise(change)).unwrap();
                w.commit(tmp_dir, dest).await.unwrap();
                name
            }
        };
        let looked_up = || {
            backend
                .looked_up
                .swap(0, std::sync::atomic::Ordering::SeqCst)
        };
        let first = park(1).await;
        let first = w.upload(&first, &PutImage::default()).await.unwrap();
        let whole = looked_up();
        assert!(whole >= 16, "4 MiB of noise in {whole} chunks");
        // Parked again with one byte changed, naming the first: only the changed chunk is
        // looked up (and written).
        let second = park(2).await;
        let second = w.upload(&second, &naming(&first.snapshot)).await.unwrap();
        let with_parent = looked_up();
        assert!(with_parent <= 2, "{with_parent} lookups of {whole} chunks");
        assert!(second.bytes_written < first.bytes_written / 4, "{second:?}");
        // Without naming it: every chunk is looked up again (the store finds them there).
        let third = park(3).await;
        w.upload(&third, &PutImage::default()).await.unwrap();
        // (The changed byte may cut its chunk in two: one more, or fewer.)
        let close_to_whole = |n: usize| n.abs_diff(whole) <= 2;
        let without = looked_up();
        assert!(close_to_whole(without), "{without} vs {whole}");
        // A previous snapshot gone meanwhile (retention, a delete) is not an error.
        let fourth = park(4).await;
        let up = w.upload(&fourth, &naming("gone-1")).await.unwrap();
        let gone = looked_up();
        assert!(close_to_whole(gone), "{gone} vs {whole}");
        assert!(w.copy_of(&up.snapshot).is_some());
        // A fixed id (a golden snapshot) names no previous one: the parent is not used.
        let golden = park(5).await;
        let put = PutImage {
            id: Some("golden-x-1".into()),
            pin: true,
            ..naming(&second.snapshot)
        };
        w.upload(&golden, &put).await.unwrap();
        let golden = looked_up();
        assert!(close_to_whole(golden), "{golden} vs {whole}");
    }

    #[test]
    fn own_names_are_one_plain_component() {
        for ok in ["sb-1-g3", "golden-host-17"] {
            assert!(own_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".", "..", "../x", "a/b", ".tmp-x", "/abs"] {
            assert!(own_name(bad).is_err(), "{bad}");
        }
    }

    /// A directory store whose manifest writes wait for the test's go (a put held at its
    /// commit), saying when one is held, and that counts the chunk and pack lookups puts make.
    #[derive(Debug)]
    struct Gated {
        inner: torpor_snapshot::LocalBackend,
        held: Arc<tokio::sync::Notify>,
        go: Arc<tokio::sync::Semaphore>,
        looked_up: std::sync::atomic::AtomicUsize,
    }

    impl Gated {
        /// Every write goes through at once.
        fn open(dir: &Path) -> Gated {
            Gated {
                inner: torpor_snapshot::LocalBackend::open(dir).unwrap(),
                held: Arc::new(tokio::sync::Notify::new()),
                go: Arc::new(tokio::sync::Semaphore::new(
                    tokio::sync::Semaphore::MAX_PERMITS,
                )),
                looked_up: 0.into(),
            }
        }
    }

    #[async_trait::async_trait]
    impl Backend for Gated {
        async fn put(
            &self,
            key: &torpor_snapshot::backend::ObjectKey,
            data: bytes::Bytes,
        ) -> Result<(), torpor_snapshot::BackendError> {
            if key.as_str().contains("manifests/") {
                self.held.notify_one();
                self.go.acquire().await.expect("gate open").forget();
            }
            self.inner.put(key, data).await
        }
        async fn get(
            &self,
            key: &torpor_snapshot::backend::ObjectKey,
        ) -> Result<Option<bytes::Bytes>, torpor_snapshot::BackendError> {
            self.inner.get(key).await
        }
        async fn exists_many(
            &self,
            keys: &[torpor_snapshot::backend::ObjectKey],
        ) -> Result<Vec<bool>, torpor_snapshot::BackendError> {
            self.looked_up
                .fetch_add(keys.len(), std::sync::atomic::Ordering::SeqCst);
            self.inner.exists_many(keys).await
        }
        async fn delete(
            &self,
            key: &torpor_snapshot::backend::ObjectKey,
        ) -> Result<(), torpor_snapshot::BackendError> {
            self.inner.delete(key).await
        }
        async fn list(
            &self,
            prefix: &str,
        ) -> Result<Vec<torpor_snapshot::backend::ObjectInfo>, torpor_snapshot::BackendError>
        {
            self.inner.list(prefix).await
        }
    }

    #[tokio::test]
    async fn an_image_removed_while_it_uploads_leaves_no_record_behind() {
        let tmp = tempfile::tempdir().unwrap();
        let store = tmp.path().join("store");
        let (held, go) = (
            Arc::new(tokio::sync::Notify::new()),
            Arc::new(tokio::sync::Semaphore::new(0)),
        );
        let gated = Arc::new(Gated {
            held: held.clone(),
            go: go.clone(),
            ..Gated::open(&store)
        });
        let open: OpenBackend = Arc::new(move |_loc: &str| Ok(gated.clone() as Arc<dyn Backend>));
        let w = Arc::new(WorkerImages::open(&tmp.path().join("w"), open, 0).unwrap());
        w.set_store("shared");
        let (tmp_dir, dest) = w.staging("sb-1-g1").unwrap().unwrap();
        std::fs::create_dir_all(&tmp_dir).unwrap();
        std::fs::write(tmp_dir.join("checkpoint.img"), b"memory").unwrap();
        w.commit(tmp_dir, dest.clone()).await.unwrap();
        // The upload is held at its commit; meanwhile the image goes (its sandbox woke from
        // it), as the controller asks.
        let upload = {
            let w = w.clone();
            tokio::spawn(async move { w.upload("sb-1-g1", &PutImage::default()).await })
        };
        held.notified().await;
        w.remove("sb-1-g1").unwrap();
        go.add_permits(1);
        let up = upload.await.unwrap().unwrap();
        assert!(!dest.exists());
        assert!(
            !dest.with_extension("snapshot").exists(),
            "an upload record outlived its image"
        );
        assert!(w.copy_of(&up.snapshot).is_none());
        // The other order: uploaded first, then removed: both go.
        let (dest, up) = {
            let (tmp_dir, dest) = w.staging("sb-1-g2").unwrap().unwrap();
            std::fs::create_dir_all(&tmp_dir).unwrap();
            std::fs::write(tmp_dir.join("checkpoint.img"), b"memory 2").unwrap();
            w.commit(tmp_dir, dest.clone()).await.unwrap();
            go.add_permits(1);
            let up = w.upload("sb-1-g2", &PutImage::default()).await.unwrap();
            (dest, up)
        };
        assert!(dest.with_extension("snapshot").exists());
        w.remove("sb-1-g2").unwrap();
        assert!(!dest.exists() && !dest.with_extension("snapshot").exists());
        assert!(w.copy_of(&up.snapshot).is_none());
    }

    #[tokio::test]
    async fn an_upload_is_a_local_copy_then_a_fetch_elsewhere() {
        let tmp = tempfile::tempdir().unwrap();
        let store = tmp.path().join("store");
        let a = images(&tmp.path().join("a"), &store);
        let b = images(&tmp.path().join("b"), &store);

        // A checkpoint on a: staged, committed, uploaded.
        let (dest, up) = checkpoint_uploaded(&a, "sb-1-g1", b"memory").await;
        let access = StoreAccess::default();
        assert_eq!(up.input_bytes, 6);
        let stored = StoredFiles {
            image: Some(up.snapshot.clone()),
            access: access.clone(),
            ..StoredFiles::default()
        };
        // a restores from its own copy (and drops it after); b fetches.
        let (p, fetched) = a.image("sb-1-g2", "", &stored).await.unwrap();
        assert_eq!((p.clone(), fetched), (dest.clone(), false));
        a.after_restore(&p, fetched, false);
        assert!(
            !dest.exists(),
            "the copy of an uploaded image goes after a restore"
        );
        let (p, fetched) = b.image("sb-1-g2", "", &stored).await.unwrap();
        assert!(fetched);
        assert_eq!(std::fs::read(p.join("checkpoint.img")).unwrap(), b"memory");
        b.after_restore(&p, fetched, false);
        assert!(!p.exists());

        // An image only on a worker that is asked elsewhere: lost, said so.
        let none = StoredFiles::default();
        let err = b.image("sb-1-g3", "sb-1-g1", &none).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
        // Outside the image area: refused.
        assert!(a
            .upload(
                "/etc",
                &PutImage {
                    access: access.clone(),
                    ..PutImage::default()
                }
            )
            .await
            .is_err());
        assert!(a.resolve("../x").is_err());
    }

    #[tokio::test]
    async fn a_snapshot_gone_from_the_store_leaves_no_copy_on_any_worker() {
        let tmp = tempfile::tempdir().unwrap();
        let store = tmp.path().join("store");
        let a = images(&tmp.path().join("a"), &store);
        let b = images(&tmp.path().join("b"), &store);
        let (dest, up) = checkpoint_uploaded(&a, "sb-1-g1", b"files").await;
        let access = StoreAccess::default();
        // b fetches it as a kept snapshot (a template's root filesystem).
        let stored = StoredFiles {
            rootfs: Some(up.snapshot.clone()),
            access,
            ..StoredFiles::default()
        };
        let kept = b.rootfs(&stored).await.unwrap().unwrap();
        assert!(kept.exists() && dest.exists());

        assert!(a.forget(&up.snapshot).await.unwrap());
        assert!(!dest.exists() && !dest.with_extension("snapshot").exists());
        assert!(a.copy_of(&up.snapshot).is_none());
        assert!(b.forget(&up.snapshot).await.unwrap());
        assert!(!kept.exists());
        // Again: nothing left; names outside the worker's areas are refused.
        assert!(!b.forget(&up.snapshot).await.unwrap());
        for bad in ["../images", "", "a/b"] {
            assert!(b.forget(bad).await.is_err(), "{bad}");
        }
    }

    #[test]
    fn local_copies_beyond_the_limit_go_oldest_first() {
        let tmp = tempfile::tempdir().unwrap();
        let mut copies = HashMap::new();
        for i in 0..4 {
            let p = tmp.path().join(format!("c{i}"));
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.with_extension("snapshot"), format!("s{i}")).unwrap();
            let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1000 + i);
            let f = std::fs::File::options()
                .write(true)
                .open(p.with_extension("snapshot"))
                .unwrap();
            f.set_modified(t).unwrap();
            copies.insert(format!("s{i}"), p);
        }
        let gone = oldest_beyond(&mut copies, 2);
        assert_eq!(
            gone,
            vec![tmp.path().join("c0"), tmp.path().join("c1")],
            "oldest first"
        );
        assert_eq!(copies.len(), 2);
    }
}
