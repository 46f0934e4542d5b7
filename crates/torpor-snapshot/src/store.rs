//! The snapshot store: puts a checkpoint directory as chunks plus a manifest, and gets it
//! back verified. Owns the object layout and the put/get pipelines; byte formats live in
//! `chunk`, `manifest` and `gvisor`, storage in `backend`. Just over 1,000 lines: the put and
//! get pipelines and the collector share the object layout's invariants, kept in one file.
//!
//! Object layout under the (optional) tenant namespace `tenants/<ns>/`:
//!
//! ```text
//! chunks/<first two hex digits>/<chunk id hex>   chunk blobs (see `chunk`)
//! packs/<2 hex>/<pack id hex>                    many chunk blobs (a packed store, see `pack`)
//! packidx/<2 hex>/<pack id hex>                  the chunks of one pack
//! manifests/<snapshot id>                        manifests; written last: the commit marker
//! pins/<snapshot id>                             retention pins (golden snapshots)
//! locks/<shared|exclusive>-<random>              put / gc coordination (see `lock`)
//! ```

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::backend::{Backend, LocalBackend, ObjectKey};
use crate::cache::ChunkCache;
use crate::chunk::{ChunkCodec, TenantKey, MAX_CHUNK_LEN};
use crate::error::StoreError;
use crate::gvisor::{self, ImageError, ImageLayout, InflatingReader, StoredFrameWriter};
use crate::id::{ChunkId, SnapshotId};
use crate::lock::{LockKind, LockManager};
use crate::manifest::{ChunkParams, Extent, ExtentData, FileEntry, FileKind, ImageInfo, Manifest};
use crate::pack::{PackBuilder, PackCatalog, PackId, PackLoc};

/// Label naming the sandbox a snapshot belongs to; retention groups by it.
pub const LABEL_SANDBOX: &str = "sandbox";
/// Label set on forks, naming the snapshot they were forked from.
pub const LABEL_FORKED_FROM: &str = "forked_from";

/// Chunks a restore fetches and decodes as one run (see `Store::fetch_run`), and a put encodes
/// and stores as one; with `StoreConfig::parallelism` runs in flight, a remote backend sees up
/// to both multiplied in requests at once.
const FETCH_RUN: usize = 16;
/// A run of a packed snapshot's chunks: about 1 MiB of a pack, read with one ranged request.
const PACKED_FETCH_RUN: usize = 64;
/// Default `StoreConfig::pack_bytes` where packing is chosen.
pub const DEFAULT_PACK_BYTES: usize = 4 << 20;
/// The bounds `StoreConfig::pack_bytes` is held to (a pack ends past its target by at most
/// one blob, and locations past 1 GiB are refused by the decoder).
pub const MIN_PACK_TARGET: usize = 64 << 10;
pub const MAX_PACK_TARGET: usize = 256 << 20;

/// Bytes per pack for a store, from an operator's setting (`Some(0)`: none) or, without one,
/// [`DEFAULT_PACK_BYTES`] on a remote store, where a request per chunk is what a wake and a
/// park would otherwise pay, and none on a local directory.
pub fn pack_bytes_for(setting: Option<u64>, remote: bool) -> Option<usize> {
    match setting {
        Some(0) => None,
        Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        None => remote.then_some(DEFAULT_PACK_BYTES),
    }
}

/// Default chunking of gVisor image streams (see `docs/BENCHMARKS.md` for the sweep).
pub const DEFAULT_IMAGE_CHUNKING: ChunkParams = ChunkParams {
    min: 4 * 1024,
    avg: 16 * 1024,
    max: 64 * 1024,
};

/// How the store cuts, compresses and moves data.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub chunking: ChunkParams,
    /// Chunking of gVisor memory images' inflated streams. Memory changes are scattered
    /// pages, so a chunk much larger than a page rewrites far more than what changed.
    pub image_chunking: ChunkParams,
    pub zstd_level: i32,
    /// Concurrent chunk uploads / downloads per file.
    pub parallelism: usize,
    /// Chunks per existence check.
    pub batch: usize,
    /// Tenant key: chunk ids are keyed, chunks and manifests encrypted.
    pub key: Option<TenantKey>,
    /// Tenant namespace: all objects under `tenants/<ns>/`. Set it whenever `key` is set, so
    /// one tenant's collector never sees another's chunks.
    pub namespace: Option<String>,
    /// A lock object not renewed for this long belongs to a dead holder (see `lock`); holders
    /// renew every quarter of it and stop committing after half of it without a renewal.
    pub lock_ttl: Duration,
    /// How long a put waits for a running collector (and a collector for running puts).
    pub lock_wait: Duration,
    /// Pack new chunks into objects of about this many bytes (`None`: one object per chunk).
    /// See `pack`: a restore then asks for ranges of a few objects, a put writes a few.
    pub pack_bytes: Option<usize>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            chunking: ChunkParams {
                min: 4 * 1024,
                avg: 16 * 1024,
                max: 64 * 1024,
            },
            image_chunking: DEFAULT_IMAGE_CHUNKING,
            zstd_level: 1,
            parallelism: 8,
            batch: 128,
            key: None,
            namespace: None,
            lock_ttl: Duration::from_secs(60),
            lock_wait: Duration::from_secs(30),
            pack_bytes: None,
        }
    }
}

/// Options of one put beyond the directory.
#[derive(Debug, Clone, Default)]
pub struct PutOptions {
    /// Previous snapshot of the same sandbox: its chunks are known present, so only new
    /// content is checked and uploaded.
    pub parent: Option<SnapshotId>,
    /// Id to use; generated when `None`.
    pub id: Option<SnapshotId>,
    pub labels: Vec<(String, String)>,
}

/// What a put did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PutStats {
    pub files: u64,
    /// Bytes of content described (inflated for gVisor images).
    pub logical_bytes: u64,
    /// Bytes of the input files as they were on disk.
    pub input_bytes: u64,
    pub zero_bytes: u64,
    pub chunks_total: u64,
    pub chunks_new: u64,
    pub chunks_reused: u64,
    /// Plaintext bytes of the new chunks.
    pub new_chunk_bytes: u64,
    /// Bytes written to the backend: new chunk blobs plus the manifest.
    pub bytes_written: u64,
    pub manifest_bytes: u64,
    pub images: u64,
    pub image_fallbacks: u64,
    pub duration_ms: u64,
}

#[derive(Debug, Clone)]
pub struct PutReport {
    pub id: SnapshotId,
    pub stats: PutStats,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GetStats {
    pub files: u64,
    pub logical_bytes: u64,
    pub bytes_written: u64,
    pub chunks_fetched: u64,
    pub bytes_fetched: u64,
    pub cache_hits: u64,
    pub duration_ms: u64,
}

/// A snapshot store over one backend.
#[derive(Debug, Clone)]
pub struct Store {
    backend: Arc<dyn Backend>,
    codec: ChunkCodec,
    cfg: StoreConfig,
    prefix: String,
    locks: LockManager,
    cache: Option<Arc<ChunkCache>>,
    catalog: Arc<PackCatalog>,
}

/// One put's progress across its files.
struct PutState {
    /// Chunks known stored (the parent's, this put's, those found in the store).
    known: HashSet<ChunkId>,
    /// Where the known packed chunks lie (the parent's locations, then this put's).
    locs: BTreeMap<ChunkId, PackLoc>,
    /// Packs this put checked exist (catalog entries are hints; see `pack`).
    checked: HashMap<PackId, bool>,
    /// New chunks waiting to be encoded in runs (a batch from the chunker is often one chunk).
    pending: Vec<(ChunkId, Vec<u8>)>,
    pack: PackBuilder,
    /// Pack uploads under way (aborted if the put is dropped).
    uploads: tokio::task::JoinSet<Result<u64, StoreError>>,
    stats: PutStats,
}

enum Piece {
    Zero(u64),
    Data(ChunkId, Vec<u8>),
}

enum ProducerError {
    Image(ImageError),
    Read(std::io::Error),
}

enum WriteOp {
    Data(Vec<u8>),
    Zero(u64),
}

impl std::fmt::Debug for ChunkCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkCodec")
            .field("encrypted", &self.is_encrypted())
            .finish()
    }
}

impl Store {
    pub fn new(backend: Arc<dyn Backend>, mut cfg: StoreConfig) -> Result<Self, StoreError> {
        cfg.pack_bytes = cfg
            .pack_bytes
            .map(|n| n.clamp(MIN_PACK_TARGET, MAX_PACK_TARGET));
        let prefix = match &cfg.namespace {
            Some(ns) => {
                let key = ObjectKey::new(format!("tenants/{ns}"))?;
                format!("{key}/")
            }
            None => String::new(),
        };
        let codec = ChunkCodec::new(cfg.zstd_level, cfg.key.as_ref());
        let locks = LockManager::new(
            Arc::clone(&backend),
            format!("{prefix}locks"),
            cfg.lock_ttl,
            cfg.lock_wait,
        );
        Ok(Store {
            backend,
            codec,
            cfg,
            prefix,
            locks,
            cache: None,
            catalog: Arc::default(),
        })
    }

    /// A store on a local directory with default settings.
    pub fn local(root: impl Into<PathBuf>) -> Result<Self, StoreError> {
        let backend = LocalBackend::open(root)?;
        Store::new(Arc::new(backend), StoreConfig::default())
    }

    /// Adds a bounded local chunk cache consulted before the backend on get.
    pub fn with_cache(mut self, cache: Arc<ChunkCache>) -> Self {
        self.cache = Some(cache);
        self
    }

    /// Shares a catalog of packed chunks with other stores on the same backend and namespace
    /// (a process that opens a store per call keeps what it learnt; see `pack`).
    pub fn with_catalog(mut self, catalog: Arc<PackCatalog>) -> Self {
        self.catalog = catalog;
        self
    }

    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub(crate) fn chunk_key(&self, id: &ChunkId) -> ObjectKey {
        let hex = id.to_hex();
        // Hex ids always make a valid key.
        ObjectKey::new(format!("{}chunks/{}/{}", self.prefix, &hex[..2], hex))
            .unwrap_or_else(|_| unreachable!("hex chunk keys are valid"))
    }

    pub(crate) fn pack_key(&self, id: &PackId) -> ObjectKey {
        self.pack_area_key("packs", id)
    }

    pub(crate) fn pack_index_key(&self, id: &PackId) -> ObjectKey {
        self.pack_area_key("packidx", id)
    }

    fn pack_area_key(&self, area: &str, id: &PackId) -> ObjectKey {
        let hex = id.to_hex();
        ObjectKey::new(format!("{}{area}/{}/{}", self.prefix, &hex[..2], hex))
            .unwrap_or_else(|_| unreachable!("hex pack keys are valid"))
    }

    pub(crate) fn manifest_key(&self, id: &SnapshotId) -> ObjectKey {
        ObjectKey::new(format!("{}manifests/{}", self.prefix, id))
            .unwrap_or_else(|_| unreachable!("snapshot ids are valid key components"))
    }

    pub(crate) fn pin_key(&self, id: &SnapshotId) -> ObjectKey {
        ObjectKey::new(format!("{}pins/{}", self.prefix, id))
            .unwrap_or_else(|_| unreachable!("snapshot ids are valid key components"))
    }

    pub(crate) fn area(&self, name: &str) -> String {
        format!("{}{}", self.prefix, name)
    }

    pub(crate) async fn lock(&self, kind: LockKind) -> Result<crate::lock::LockGuard, StoreError> {
        Ok(self.locks.acquire(kind).await?)
    }

    /// Stores a checkpoint directory. `parent` is the sandbox's previous snapshot, if any.
    pub async fn put_dir(
        &self,
        dir: &Path,
        parent: Option<&SnapshotId>,
    ) -> Result<PutReport, StoreError> {
        self.put_dir_with(
            dir,
            PutOptions {
                parent: parent.cloned(),
                ..PutOptions::default()
            },
        )
        .await
    }

    pub async fn put_dir_with(
        &self,
        dir: &Path,
        opts: PutOptions,
    ) -> Result<PutReport, StoreError> {
        let span = tracing::info_span!("snapshot_put", dir = %dir.display());
        async {
            let guard = self.lock(LockKind::Shared).await?;
            let result = self.put_locked(dir, opts, &guard).await;
            guard.release().await;
            result
        }
        .instrument(span)
        .await
    }

    async fn put_locked(
        &self,
        dir: &Path,
        opts: PutOptions,
        guard: &crate::lock::LockGuard,
    ) -> Result<PutReport, StoreError> {
        let started = Instant::now();
        let id = opts.id.unwrap_or_else(SnapshotId::generate);
        if self.backend.exists_many(&[self.manifest_key(&id)]).await?[0] {
            return Err(StoreError::SnapshotExists { id });
        }
        let mut st = PutState {
            known: HashSet::new(),
            locs: BTreeMap::new(),
            checked: HashMap::new(),
            pending: Vec::new(),
            pack: PackBuilder::default(),
            uploads: tokio::task::JoinSet::new(),
            stats: PutStats::default(),
        };
        if let Some(p) = &opts.parent {
            let pm = self.load_manifest(p).await.map_err(|e| match e {
                StoreError::SnapshotNotFound { id } => StoreError::ParentNotFound { id },
                other => other,
            })?;
            st.known.extend(pm.chunk_refs().map(|(c, _)| *c));
            st.locs = pm.packs;
        }
        if self.cfg.pack_bytes.is_some() && self.catalog.stale() {
            self.refresh_catalog().await?;
        }
        let root = dir.to_path_buf();
        let entries = tokio::task::spawn_blocking(move || walk(&root)).await??;
        let mut files = Vec::with_capacity(entries.len());
        for e in entries {
            st.stats.files += 1;
            let kind = match e.kind {
                WalkKind::Dir => FileKind::Dir,
                WalkKind::Symlink(target) => FileKind::Symlink { target },
                WalkKind::File(len) => {
                    st.stats.input_bytes += len;
                    self.put_file(&e.abs, &mut st).await?
                }
            };
            files.push(FileEntry {
                path: e.rel,
                mode: e.mode,
                kind,
            });
        }
        // Every pack before the manifest.
        if let Some(target) = self.cfg.pack_bytes {
            self.encode_pending(target, 0, &mut st).await?;
        }
        self.flush_pack(&mut st);
        while let Some(written) = st.uploads.join_next().await {
            st.stats.bytes_written += written??;
        }
        let mut manifest = Manifest {
            id: id.clone(),
            parent: opts.parent,
            created_unix_ms: now_ms(),
            chunking: self.cfg.chunking,
            labels: opts.labels,
            files,
            packs: BTreeMap::new(),
        };
        let named: HashSet<ChunkId> = manifest.chunk_refs().map(|(c, _)| *c).collect();
        manifest.packs = std::mem::take(&mut st.locs)
            .into_iter()
            .filter(|(c, _)| named.contains(c))
            .collect();
        let mut stats = st.stats;
        stats.logical_bytes = manifest.logical_bytes();
        // The manifest goes last: until it exists the snapshot does not. Only while the lock
        // is fresh: a collector that took it for dead may have swept what this put relies on.
        guard.check_fresh()?;
        let sealed_len = self.write_manifest(&manifest).await?;
        stats.manifest_bytes = sealed_len;
        stats.bytes_written += sealed_len;
        stats.duration_ms = started.elapsed().as_millis() as u64;
        tracing::info!(snapshot = %id, new = stats.chunks_new, reused = stats.chunks_reused,
            written = stats.bytes_written, "snapshot stored");
        Ok(PutReport { id, stats })
    }

    async fn put_file(&self, path: &Path, st: &mut PutState) -> Result<FileKind, StoreError> {
        let probe_path = path.to_path_buf();
        let layout = tokio::task::spawn_blocking(move || {
            std::fs::File::open(&probe_path).and_then(gvisor::probe)
        })
        .await?
        .map_err(|source| StoreError::ReadInput {
            path: path.to_path_buf(),
            source,
        })?;
        if let Some(layout) = layout {
            match self.chunk_file(path, Some(&layout), st).await? {
                Ok((size, extents)) => {
                    st.stats.images += 1;
                    return Ok(FileKind::Content {
                        size,
                        image: Some(ImageInfo {
                            header: layout.header,
                            frame_size: layout.frame_size,
                            original_size: layout.original_size,
                        }),
                        extents,
                    });
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, code = e.code(),
                        "gVisor image frames do not inflate cleanly; storing the file opaque");
                    st.stats.image_fallbacks += 1;
                }
            }
        }
        match self.chunk_file(path, None, st).await? {
            Ok((size, extents)) => Ok(FileKind::Content {
                size,
                image: None,
                extents,
            }),
            // Opaque chunking reads no frames, so this is an I/O fault, not a format question.
            Err(e) => Err(StoreError::ReadInput {
                path: path.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
            }),
        }
    }

    /// Chunks one file (its inflated stream when `image` is set) and uploads what the store
    /// lacks. The outer error is fatal; the inner one asks the caller to retry opaque.
    async fn chunk_file(
        &self,
        path: &Path,
        image: Option<&ImageLayout>,
        st: &mut PutState,
    ) -> Result<Result<(u64, Vec<Extent>), ImageError>, StoreError> {
        let (tx, mut rx) = mpsc::channel::<Piece>(self.cfg.batch * 2);
        let producer = {
            let path = path.to_path_buf();
            let codec = self.codec.clone();
            let params = if image.is_some() {
                self.cfg.image_chunking
            } else {
                self.cfg.chunking
            };
            let image = image.map(|l| (l.header.len() as u64, l.frame_size));
            tokio::task::spawn_blocking(move || produce(&path, image, params, &codec, tx))
        };
        let mut extents: Vec<Extent> = Vec::new();
        let mut offset = 0u64;
        let mut batch = Vec::with_capacity(self.cfg.batch);
        loop {
            if rx.recv_many(&mut batch, self.cfg.batch).await == 0 {
                break;
            }
            let mut to_check: Vec<(ChunkId, Vec<u8>)> = Vec::new();
            for piece in batch.drain(..) {
                match piece {
                    Piece::Zero(len) => {
                        st.stats.zero_bytes += len;
                        match extents.last_mut() {
                            Some(Extent {
                                len: l,
                                data: ExtentData::Zero,
                                ..
                            }) => *l += len,
                            _ => extents.push(Extent {
                                offset,
                                len,
                                data: ExtentData::Zero,
                            }),
                        }
                        offset += len;
                    }
                    Piece::Data(id, data) => {
                        let len = data.len() as u64;
                        extents.push(Extent {
                            offset,
                            len,
                            data: ExtentData::Chunk(id),
                        });
                        offset += len;
                        st.stats.chunks_total += 1;
                        if st.known.insert(id) {
                            to_check.push((id, data));
                        } else {
                            st.stats.chunks_reused += 1;
                        }
                    }
                }
            }
            if to_check.is_empty() {
                continue;
            }
            if let Some(target) = self.cfg.pack_bytes {
                self.pack_new_chunks(to_check, target, st).await?;
                continue;
            }
            let stats = &mut st.stats;
            let keys: Vec<ObjectKey> = to_check.iter().map(|(id, _)| self.chunk_key(id)).collect();
            let present = self.backend.exists_many(&keys).await?;
            let missing: Vec<(ChunkId, Vec<u8>)> = to_check
                .into_iter()
                .zip(present)
                .filter_map(|(chunk, present)| {
                    if present {
                        stats.chunks_reused += 1;
                        None
                    } else {
                        Some(chunk)
                    }
                })
                .collect();
            // Runs of new chunks, each encoded in one blocking call and stored with one
            // `put_many`: a thread hand-off per run, not per chunk.
            let uploads = runs_of(missing).into_iter().map(|run| {
                let codec = self.codec.clone();
                let backend = Arc::clone(&self.backend);
                let cache = self.cache.clone();
                async move {
                    let encoded = encode_run(codec, run).await?;
                    let sizes: Vec<(u64, u64)> = encoded
                        .iter()
                        .map(|(_, raw, blob)| (*raw, blob.len() as u64))
                        .collect();
                    backend
                        .put_many(
                            encoded
                                .iter()
                                .map(|(id, _, blob)| (self.chunk_key(id), blob.clone()))
                                .collect(),
                        )
                        .await?;
                    if let Some(cache) = cache {
                        // Write-through: a wake on this node after the suspend reads locally.
                        cache.insert_many_in_background(
                            encoded
                                .into_iter()
                                .map(|(id, _, blob)| (id, blob))
                                .collect(),
                        );
                    }
                    Ok::<_, StoreError>(sizes)
                }
            });
            let done: Vec<(u64, u64)> = futures::stream::iter(uploads)
                .buffer_unordered(self.cfg.parallelism.max(1))
                .try_collect::<Vec<_>>()
                .await?
                .into_iter()
                .flatten()
                .collect();
            for (raw, stored) in done {
                stats.chunks_new += 1;
                stats.new_chunk_bytes += raw;
                stats.bytes_written += stored;
            }
        }
        match producer.await? {
            Ok(total) => {
                debug_assert_eq!(total, offset);
                Ok(Ok((offset, extents)))
            }
            Err(ProducerError::Image(e)) => Ok(Err(e)),
            Err(ProducerError::Read(source)) => Err(StoreError::ReadInput {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    /// A packed put's batch of chunks not known yet: those the catalog places in a pack that
    /// still exists are reused, the rest encoded in runs (one blocking call each) and appended
    /// to the pack being filled, which is uploaded once it holds `target` bytes.
    async fn pack_new_chunks(
        &self,
        to_check: Vec<(ChunkId, Vec<u8>)>,
        target: usize,
        st: &mut PutState,
    ) -> Result<(), StoreError> {
        let found: Vec<Option<PackLoc>> = to_check
            .iter()
            .map(|(id, _)| self.catalog.lookup(id))
            .collect();
        let mut unchecked: Vec<PackId> = found
            .iter()
            .flatten()
            .map(|l| l.pack)
            .filter(|p| !st.checked.contains_key(p))
            .collect();
        unchecked.sort();
        unchecked.dedup();
        if !unchecked.is_empty() {
            let keys: Vec<ObjectKey> = unchecked.iter().map(|p| self.pack_key(p)).collect();
            for (p, present) in unchecked
                .into_iter()
                .zip(self.backend.exists_many(&keys).await?)
            {
                if !present {
                    self.catalog.forget(&p);
                }
                st.checked.insert(p, present);
            }
        }
        for ((id, data), loc) in to_check.into_iter().zip(found) {
            match loc {
                Some(loc) if st.checked.get(&loc.pack) == Some(&true) => {
                    st.stats.chunks_reused += 1;
                    st.locs.insert(id, loc);
                }
                _ => st.pending.push((id, data)),
            }
        }
        self.encode_pending(target, FETCH_RUN * self.cfg.parallelism.max(1), st)
            .await
    }

    /// Encodes the pending chunks in runs, in order, into the pack being filled, until fewer
    /// than `keep` wait (a put's end passes 0).
    async fn encode_pending(
        &self,
        target: usize,
        keep: usize,
        st: &mut PutState,
    ) -> Result<(), StoreError> {
        if st.pending.is_empty() || st.pending.len() < keep {
            return Ok(());
        }
        let encodes = runs_of(std::mem::take(&mut st.pending))
            .into_iter()
            .map(|run| encode_run(self.codec.clone(), run));
        // In order: a pack holds chunks as the file has them, so a restore reads it front to
        // back in a few ranges.
        let mut encoded = futures::stream::iter(encodes).buffered(self.cfg.parallelism.max(1));
        while let Some(run) = encoded.next().await {
            for (id, raw, blob) in run? {
                st.stats.chunks_new += 1;
                st.stats.new_chunk_bytes += raw;
                st.pack.push(id, &blob);
                if st.pack.len() >= target {
                    self.flush_pack(st);
                }
            }
            while st.uploads.len() >= self.cfg.parallelism.max(1) {
                if let Some(written) = st.uploads.join_next().await {
                    st.stats.bytes_written += written??;
                }
            }
        }
        Ok(())
    }

    /// Starts the upload of the pack being filled (the pack, then its index), recording its
    /// chunks' locations for the manifest.
    fn flush_pack(&self, st: &mut PutState) {
        if st.pack.is_empty() {
            return;
        }
        let (id, bytes, index, locs) = std::mem::take(&mut st.pack).finish();
        let entries: Vec<(ChunkId, u64, u32)> =
            locs.iter().map(|(c, l)| (*c, l.offset, l.len)).collect();
        st.locs.extend(locs.iter().copied());
        st.checked.insert(id, true);
        let (backend, catalog, cache) = (
            Arc::clone(&self.backend),
            Arc::clone(&self.catalog),
            self.cache.clone(),
        );
        let (pack_key, index_key) = (self.pack_key(&id), self.pack_index_key(&id));
        st.uploads.spawn(async move {
            let bytes = Bytes::from(bytes);
            let written = (bytes.len() + index.len()) as u64;
            backend.put(&pack_key, bytes.clone()).await?;
            backend.put(&index_key, Bytes::from(index)).await?;
            catalog.add(id, &entries);
            if let Some(cache) = cache {
                // Write-through: a wake on this node after the suspend reads locally.
                cache.insert_many_in_background(
                    entries
                        .iter()
                        .map(|(c, offset, len)| {
                            (
                                *c,
                                bytes.slice(*offset as usize..(*offset + u64::from(*len)) as usize),
                            )
                        })
                        .collect(),
                );
            }
            Ok(written)
        });
    }

    /// Lists the pack indexes, forgets packs that are gone and reads the new ones' indexes
    /// (an unreadable one is skipped: it only costs deduplication).
    async fn refresh_catalog(&self) -> Result<(), StoreError> {
        let listed: Vec<(PackId, crate::backend::ObjectInfo)> = self
            .backend
            .list(&self.area("packidx"))
            .await?
            .into_iter()
            .filter_map(|o| Some((PackId::from_hex(o.key.name()).ok()?, o)))
            .collect();
        self.catalog
            .listed(&listed.iter().map(|(p, _)| *p).collect());
        let indexed = self.catalog.indexed();
        let mut new: Vec<(PackId, crate::backend::ObjectInfo)> = listed
            .into_iter()
            .filter(|(p, _)| !indexed.contains(p))
            .collect();
        // The newest first (the likeliest to share chunks with what is put now), a bounded
        // number a time: the rest at the next listings.
        new.sort_by_key(|(_, o)| std::cmp::Reverse(o.modified));
        new.truncate(if self.catalog.has_room() {
            crate::pack::INDEX_READS
        } else {
            0
        });
        let new: Vec<(PackId, ObjectKey)> = new.into_iter().map(|(p, o)| (p, o.key)).collect();
        let backend = &self.backend;
        let read: Vec<(PackId, Option<Bytes>)> = futures::stream::iter(
            new.into_iter()
                .map(|(p, key)| async move { Ok::<_, StoreError>((p, backend.get(&key).await?)) }),
        )
        .buffer_unordered(self.cfg.parallelism.max(1))
        .try_collect()
        .await?;
        for (p, bytes) in read {
            match bytes.map(|b| crate::pack::decode_index(&b)) {
                Some(Ok(entries)) => self.catalog.add(p, &entries),
                Some(Err(e)) => {
                    tracing::warn!(pack = %p, error = %e, "pack index unreadable; its chunks are not deduplicated against")
                }
                None => {}
            }
        }
        Ok(())
    }

    /// Seals and stores `m` under its id (replacing any manifest there); its sealed size.
    pub(crate) async fn write_manifest(&self, m: &Manifest) -> Result<u64, StoreError> {
        let sealed = self
            .codec
            .seal_manifest(m.encode())
            .map_err(StoreError::Encode)?;
        let len = sealed.len() as u64;
        self.backend
            .put(&self.manifest_key(&m.id), Bytes::from(sealed))
            .await?;
        Ok(len)
    }

    pub(crate) fn codec(&self) -> &ChunkCodec {
        &self.codec
    }

    pub(crate) fn catalog(&self) -> &Arc<PackCatalog> {
        &self.catalog
    }

    /// Reads, opens and verifies a manifest.
    pub async fn load_manifest(&self, id: &SnapshotId) -> Result<Manifest, StoreError> {
        let bytes = self
            .backend
            .get(&self.manifest_key(id))
            .await?
            .ok_or_else(|| StoreError::SnapshotNotFound { id: id.clone() })?;
        let plain =
            self.codec
                .open_manifest(&bytes)
                .map_err(|source| StoreError::ManifestSealed {
                    id: id.clone(),
                    source,
                })?;
        let m = Manifest::decode(&plain).map_err(|source| StoreError::ManifestInvalid {
            id: id.clone(),
            source,
        })?;
        if m.id != *id {
            return Err(StoreError::ManifestIdMismatch {
                requested: id.clone(),
                found: m.id,
            });
        }
        Ok(m)
    }

    /// Restores snapshot `id` into `dest`, which must not exist or be an empty directory. The
    /// files appear at `dest` only when every chunk was fetched and verified; on error nothing
    /// is left behind and nothing in the store changes.
    pub async fn get_dir(&self, id: &SnapshotId, dest: &Path) -> Result<GetStats, StoreError> {
        let span = tracing::info_span!("snapshot_get", snapshot = %id, dest = %dest.display());
        self.get_dir_inner(id, dest).instrument(span).await
    }

    async fn get_dir_inner(&self, id: &SnapshotId, dest: &Path) -> Result<GetStats, StoreError> {
        let started = Instant::now();
        let manifest = self.load_manifest(id).await?;
        // What this process restores, its next put of the same sandbox will mostly share.
        self.catalog.learn(&manifest);
        match std::fs::read_dir(dest) {
            Ok(mut it) => {
                if it.next().is_some() {
                    return Err(StoreError::DestinationExists {
                        path: dest.to_path_buf(),
                    });
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(_) => {
                return Err(StoreError::DestinationExists {
                    path: dest.to_path_buf(),
                })
            }
        }
        let name = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "restore".into());
        let parent = dest
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent).map_err(|e| StoreError::write(parent, e))?;
        let tmp = parent.join(format!(".{name}.restore-{}", crate::id::unique_hex(6)));
        // Private while it fills: it holds sandbox memory. The manifest's mode is applied
        // to the directory's contents; the caller's parent decides who reaches `dest`.
        std::fs::DirBuilder::new()
            .mode(crate::durable::DIR_MODE)
            .create(&tmp)
            .map_err(|e| StoreError::write(&tmp, e))?;
        let mut result = self.restore_into(&manifest, &tmp).await;
        if matches!(result, Err(StoreError::ChunkMissing { .. })) {
            // A collector may have repacked the snapshot since its manifest was read (the old
            // pack is gone, the manifest rewritten): read it again and, if it moved, retry.
            if let Some(moved) = self.moved_since(&manifest).await {
                let _ = std::fs::remove_dir_all(&tmp);
                std::fs::DirBuilder::new()
                    .mode(crate::durable::DIR_MODE)
                    .create(&tmp)
                    .map_err(|e| StoreError::write(&tmp, e))?;
                self.catalog.learn(&moved);
                result = self.restore_into(&moved, &tmp).await;
            }
        }
        match result {
            Ok(mut stats) => {
                // An empty directory at dest is replaced; rename refuses non-empty ones.
                let _ = std::fs::remove_dir(dest);
                std::fs::rename(&tmp, dest).map_err(|e| {
                    let _ = std::fs::remove_dir_all(&tmp);
                    StoreError::write(dest, e)
                })?;
                stats.duration_ms = started.elapsed().as_millis() as u64;
                Ok(stats)
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp);
                Err(e)
            }
        }
    }

    async fn restore_into(&self, m: &Manifest, root: &Path) -> Result<GetStats, StoreError> {
        let mut stats = GetStats::default();
        let mut dir_modes = Vec::new();
        for f in &m.files {
            let path = root.join(&f.path);
            stats.files += 1;
            match &f.kind {
                FileKind::Dir => {
                    std::fs::create_dir_all(&path).map_err(|e| StoreError::write(&path, e))?;
                    dir_modes.push((path, f.mode));
                }
                FileKind::Symlink { target } => {
                    if let Some(p) = path.parent() {
                        std::fs::create_dir_all(p).map_err(|e| StoreError::write(p, e))?;
                    }
                    std::os::unix::fs::symlink(target, &path)
                        .map_err(|e| StoreError::write(&path, e))?;
                }
                FileKind::Content {
                    size,
                    image,
                    extents,
                } => {
                    if let Some(p) = path.parent() {
                        std::fs::create_dir_all(p).map_err(|e| StoreError::write(p, e))?;
                    }
                    stats.logical_bytes += size;
                    self.restore_file(m, f, &path, *size, image.as_ref(), extents, &mut stats)
                        .await?;
                }
            }
        }
        // Directory modes last, deepest first, so a read-only directory can still be filled.
        for (path, mode) in dir_modes.into_iter().rev() {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                .map_err(|e| StoreError::write(&path, e))?;
        }
        Ok(stats)
    }

    #[allow(clippy::too_many_arguments)]
    async fn restore_file(
        &self,
        m: &Manifest,
        f: &FileEntry,
        path: &Path,
        size: u64,
        image: Option<&ImageInfo>,
        extents: &[Extent],
        stats: &mut GetStats,
    ) -> Result<(), StoreError> {
        let (tx, mut rx) = mpsc::channel::<WriteOp>(self.cfg.parallelism.max(1) * 2);
        let writer = {
            let path = path.to_path_buf();
            let image = image.cloned();
            let mode = f.mode;
            tokio::task::spawn_blocking(move || -> Result<u64, StoreError> {
                let file = std::fs::File::create(&path).map_err(|e| StoreError::write(&path, e))?;
                let w = |e| StoreError::write(&path, e);
                let written = match image {
                    Some(img) => {
                        let out = std::io::BufWriter::with_capacity(1 << 20, file);
                        let mut sw =
                            StoredFrameWriter::new(out, &img.header, img.frame_size).map_err(w)?;
                        while let Some(op) = rx.blocking_recv() {
                            match op {
                                WriteOp::Data(d) => sw.write_data(&d).map_err(w)?,
                                WriteOp::Zero(n) => sw.write_zeros(n).map_err(w)?,
                            }
                        }
                        let (out, written) = sw.finish().map_err(w)?;
                        let file = out.into_inner().map_err(|e| w(e.into_error()))?;
                        file.set_permissions(std::fs::Permissions::from_mode(mode))
                            .map_err(w)?;
                        written
                    }
                    None => {
                        let mut file = file;
                        let mut written = 0u64;
                        while let Some(op) = rx.blocking_recv() {
                            match op {
                                WriteOp::Data(d) => {
                                    file.write_all(&d).map_err(w)?;
                                    written += d.len() as u64;
                                }
                                // Zero runs become holes.
                                WriteOp::Zero(n) => {
                                    file.seek(SeekFrom::Current(n as i64)).map_err(w)?;
                                }
                            }
                        }
                        file.set_len(size).map_err(w)?;
                        file.set_permissions(std::fs::Permissions::from_mode(mode))
                            .map_err(w)?;
                        written
                    }
                };
                Ok(written)
            })
        };
        // Runs of up to FETCH_RUN chunks (and the zero extents between them), each fetched
        // and decoded as one: a thread hand-off per run, not several per chunk. Owned parts:
        // a closure over a slice iterator here makes the whole future fail the `Send` check of
        // callers that spawn it (a higher-ranked lifetime).
        let run_len = if m.packs.is_empty() {
            FETCH_RUN
        } else {
            PACKED_FETCH_RUN
        };
        let mut runs: Vec<Vec<(ExtentData, u64)>> = Vec::new();
        let mut in_run = run_len;
        for e in extents {
            if matches!(e.data, ExtentData::Chunk(_)) {
                if in_run == run_len {
                    runs.push(Vec::new());
                    in_run = 0;
                }
                in_run += 1;
            }
            match runs.last_mut() {
                Some(run) => run.push((e.data, e.len)),
                None => runs.push(vec![(e.data, e.len)]),
            }
        }
        let fetches = runs.into_iter().map(|run| self.fetch_run(m, f, run));
        let mut stream = futures::stream::iter(fetches).buffered(self.cfg.parallelism.max(1));
        let mut fetch_error = None;
        'runs: while let Some(item) = stream.next().await {
            match item {
                Ok(ops) => {
                    for (op, hit, fetched) in ops {
                        if let WriteOp::Data(_) = op {
                            stats.chunks_fetched += 1;
                            stats.bytes_fetched += fetched;
                            stats.cache_hits += u64::from(hit);
                        }
                        if tx.send(op).await.is_err() {
                            break 'runs; // the writer failed; its error is reported below
                        }
                    }
                }
                Err(e) => {
                    fetch_error = Some(e);
                    break;
                }
            }
        }
        drop(tx);
        let written = writer.await?;
        if let Some(e) = fetch_error {
            return Err(e);
        }
        stats.bytes_written += written?;
        Ok(())
    }

    /// One run of a file's extents as write operations, each chunk verified, with whether the
    /// cache served it and the bytes fetched remotely: the cache looked up in one blocking
    /// call, the misses asked of the backend at once (`get_many`), every blob decoded in one
    /// blocking call, the fetched blobs cached in the background. A bad cache entry is dropped
    /// and its chunk refetched.
    async fn fetch_run(
        &self,
        m: &Manifest,
        f: &FileEntry,
        run: Vec<(ExtentData, u64)>,
    ) -> Result<Vec<(WriteOp, bool, u64)>, StoreError> {
        let ids: Vec<ChunkId> = run
            .iter()
            .filter_map(|(d, _)| match d {
                ExtentData::Chunk(id) => Some(*id),
                ExtentData::Zero => None,
            })
            .collect();
        let mut blobs: Vec<Option<Bytes>> = match &self.cache {
            Some(cache) if !ids.is_empty() => {
                let (cache, look) = (cache.clone(), ids.clone());
                tokio::task::spawn_blocking(move || cache.get_many_blocking(&look)).await?
            }
            _ => vec![None; ids.len()],
        };
        let hits: Vec<bool> = blobs.iter().map(Option::is_some).collect();
        let misses: Vec<usize> = (0..ids.len()).filter(|&i| !hits[i]).collect();
        if !misses.is_empty() {
            let got = self.get_blobs(m, &ids, &misses).await?;
            for (&i, blob) in misses.iter().zip(got) {
                blobs[i] = Some(blob.ok_or_else(|| StoreError::ChunkMissing {
                    snapshot: m.id.clone(),
                    chunk: ids[i],
                    path: f.path.clone(),
                })?);
            }
        }
        let blobs: Vec<Bytes> = blobs.into_iter().flatten().collect();
        let (codec, decode_ids) = (self.codec.clone(), ids.clone());
        let (decoded, blobs) = tokio::task::spawn_blocking(move || {
            let decoded: Vec<_> = decode_ids
                .iter()
                .zip(&blobs)
                .map(|(id, blob)| codec.decode(id, blob))
                .collect();
            (decoded, blobs)
        })
        .await?;
        let mut plain = Vec::with_capacity(ids.len());
        let mut to_cache = Vec::new();
        for (i, (data, blob)) in decoded.into_iter().zip(blobs).enumerate() {
            let id = ids[i];
            match data {
                Ok(data) if hits[i] => plain.push((data, true, 0)),
                Ok(data) => {
                    let fetched = blob.len() as u64;
                    to_cache.push((id, blob));
                    plain.push((data, false, fetched));
                }
                Err(_) if hits[i] => {
                    if let Some(cache) = &self.cache {
                        cache.remove(&id).await;
                    }
                    plain.push(self.fetch_chunk(m, &id, &f.path).await?);
                }
                Err(source) => {
                    return Err(StoreError::ChunkCorrupt {
                        snapshot: m.id.clone(),
                        chunk: id,
                        path: f.path.clone(),
                        source,
                    })
                }
            }
        }
        if let Some(cache) = &self.cache {
            // Filling the cache is off the wake's critical path.
            cache.insert_many_in_background(to_cache);
        }
        let mut plain = plain.into_iter();
        let mut ops = Vec::with_capacity(run.len());
        for (data, len) in run {
            let ExtentData::Chunk(id) = data else {
                ops.push((WriteOp::Zero(len), false, 0));
                continue;
            };
            let Some((bytes, hit, fetched)) = plain.next() else {
                break; // one per chunk extent, by construction
            };
            if bytes.len() as u64 != len {
                return Err(StoreError::ChunkCorrupt {
                    snapshot: m.id.clone(),
                    chunk: id,
                    path: f.path.clone(),
                    source: crate::chunk::ChunkError::LengthMismatch {
                        expected: len.min(u64::from(MAX_CHUNK_LEN)) as u32,
                        actual: bytes.len(),
                    },
                });
            }
            ops.push((WriteOp::Data(bytes), hit, fetched));
        }
        Ok(ops)
    }

    /// The blobs of `ids[i]` for each `i` in `which` (`None`: absent): loose chunks with one
    /// `get_many`, packed ones with one `get_ranges` per pack, all at once.
    async fn get_blobs(
        &self,
        m: &Manifest,
        ids: &[ChunkId],
        which: &[usize],
    ) -> Result<Vec<Option<Bytes>>, StoreError> {
        let mut out: Vec<Option<Bytes>> = vec![None; which.len()];
        let mut loose: Vec<usize> = Vec::new();
        let mut by_pack: BTreeMap<PackId, Vec<(usize, std::ops::Range<u64>)>> = BTreeMap::new();
        for (slot, &i) in which.iter().enumerate() {
            match m.packs.get(&ids[i]) {
                Some(loc) => by_pack
                    .entry(loc.pack)
                    .or_default()
                    .push((slot, loc.range())),
                None => loose.push(slot),
            }
        }
        let keys: Vec<ObjectKey> = loose
            .iter()
            .map(|&slot| self.chunk_key(&ids[which[slot]]))
            .collect();
        let loose_get = async {
            if keys.is_empty() {
                Ok(Vec::new())
            } else {
                self.backend.get_many(&keys).await
            }
        };
        let packed_get = futures::future::try_join_all(by_pack.iter().map(|(pack, parts)| {
            let ranges: Vec<std::ops::Range<u64>> = parts.iter().map(|(_, r)| r.clone()).collect();
            let key = self.pack_key(pack);
            async move { self.backend.get_ranges(&key, &ranges).await }
        }));
        let (loose_got, packed_got) = futures::try_join!(loose_get, packed_get)?;
        for (slot, blob) in loose.into_iter().zip(loose_got) {
            out[slot] = blob;
        }
        for ((_, parts), got) in by_pack.into_iter().zip(packed_got) {
            // A missing pack leaves its chunks `None` (reported missing by the caller).
            if let Some(got) = got {
                for ((slot, _), blob) in parts.into_iter().zip(got) {
                    out[slot] = Some(blob);
                }
            }
        }
        Ok(out)
    }

    /// One chunk's blob, wherever `m` says it lies.
    async fn get_blob(&self, m: &Manifest, id: &ChunkId) -> Result<Option<Bytes>, StoreError> {
        Ok(self
            .get_blobs(m, std::slice::from_ref(id), &[0])
            .await?
            .pop()
            .flatten())
    }

    /// One verified chunk from the backend (a cache entry that failed its check, refetched).
    /// Returns the plaintext, that the cache did not serve it, and the bytes fetched.
    async fn fetch_chunk(
        &self,
        m: &Manifest,
        id: &ChunkId,
        path: &str,
    ) -> Result<(Vec<u8>, bool, u64), StoreError> {
        let snapshot = &m.id;
        let blob = self
            .get_blob(m, id)
            .await?
            .ok_or_else(|| StoreError::ChunkMissing {
                snapshot: snapshot.clone(),
                chunk: *id,
                path: path.to_string(),
            })?;
        let fetched = blob.len() as u64;
        let codec = self.codec.clone();
        let cid = *id;
        let blob2 = blob.clone();
        let data = tokio::task::spawn_blocking(move || codec.decode(&cid, &blob2))
            .await?
            .map_err(|source| StoreError::ChunkCorrupt {
                snapshot: snapshot.clone(),
                chunk: *id,
                path: path.to_string(),
                source,
            })?;
        if let Some(cache) = &self.cache {
            cache.insert_in_background(*id, blob);
        }
        Ok((data, false, fetched))
    }

    /// `m` read again, if its chunks' locations changed since (a collector repacked them).
    async fn moved_since(&self, m: &Manifest) -> Option<Manifest> {
        if m.packs.is_empty() {
            return None;
        }
        match self.load_manifest(&m.id).await {
            Ok(again) if again.packs != m.packs => {
                tracing::info!(snapshot = %m.id, "snapshot repacked while read; reading it again");
                Some(again)
            }
            _ => None,
        }
    }

    /// Verifies that every chunk of a snapshot is present and intact, without writing files.
    /// Chunks are read in runs as a restore reads them (a packed run with one ranged read per
    /// pack).
    pub async fn verify(&self, id: &SnapshotId) -> Result<VerifyReport, StoreError> {
        let m = self.load_manifest(id).await?;
        let report = self.verify_manifest(&m).await?;
        let missing = report
            .problems
            .iter()
            .any(|p| matches!(p, StoreError::ChunkMissing { .. }));
        if !missing {
            return Ok(report);
        }
        // As a restore does: a collector may have repacked it since the manifest was read.
        match self.moved_since(&m).await {
            Some(moved) => self.verify_manifest(&moved).await,
            None => Ok(report),
        }
    }

    async fn verify_manifest(&self, m: &Manifest) -> Result<VerifyReport, StoreError> {
        let mut seen = HashSet::new();
        let mut jobs = Vec::new();
        for f in &m.files {
            if let FileKind::Content { extents, .. } = &f.kind {
                for e in extents {
                    if let ExtentData::Chunk(c) = e.data {
                        if seen.insert(c) {
                            jobs.push((c, f.path.clone()));
                        }
                    }
                }
            }
        }
        let run_len = if m.packs.is_empty() {
            FETCH_RUN
        } else {
            PACKED_FETCH_RUN
        };
        let checked = jobs.len() as u64;
        let results: Vec<Result<Vec<StoreError>, StoreError>> = futures::stream::iter(
            runs_of_len(jobs, run_len)
                .into_iter()
                .map(|run| async move {
                    let ids: Vec<ChunkId> = run.iter().map(|(c, _)| *c).collect();
                    let all: Vec<usize> = (0..ids.len()).collect();
                    let blobs = self.get_blobs(m, &ids, &all).await?;
                    let codec = self.codec.clone();
                    let checks = tokio::task::spawn_blocking(move || {
                        ids.iter()
                            .zip(blobs)
                            .map(|(c, blob)| blob.map(|b| codec.decode(c, &b).err()))
                            .collect::<Vec<_>>()
                    })
                    .await?;
                    Ok(run
                        .iter()
                        .zip(checks)
                        .filter_map(|((c, path), check)| match check {
                            None => Some(StoreError::ChunkMissing {
                                snapshot: m.id.clone(),
                                chunk: *c,
                                path: path.clone(),
                            }),
                            Some(Some(source)) => Some(StoreError::ChunkCorrupt {
                                snapshot: m.id.clone(),
                                chunk: *c,
                                path: path.clone(),
                                source,
                            }),
                            Some(None) => None,
                        })
                        .collect())
                }),
        )
        .buffer_unordered(self.cfg.parallelism.max(1))
        .collect()
        .await;
        let mut report = VerifyReport {
            id: m.id.clone(),
            chunks_checked: checked,
            problems: Vec::new(),
        };
        for r in results {
            report.problems.extend(r?);
        }
        Ok(report)
    }

    /// Creates `count` snapshots sharing `src`'s chunks (manifest copies, no chunk copies).
    pub async fn fork(
        &self,
        src: &SnapshotId,
        count: usize,
    ) -> Result<Vec<SnapshotId>, StoreError> {
        let guard = self.lock(LockKind::Shared).await?;
        let result = async {
            let m = self.load_manifest(src).await?;
            let mut ids = Vec::with_capacity(count);
            for _ in 0..count {
                let id = SnapshotId::generate();
                let mut labels: Vec<(String, String)> = m
                    .labels
                    .iter()
                    .filter(|(k, _)| k != LABEL_SANDBOX && k != LABEL_FORKED_FROM)
                    .cloned()
                    .collect();
                labels.push((LABEL_FORKED_FROM.into(), src.to_string()));
                let fork = Manifest {
                    id: id.clone(),
                    parent: Some(src.clone()),
                    created_unix_ms: now_ms(),
                    labels,
                    ..m.clone()
                };
                guard.check_fresh()?;
                self.write_manifest(&fork).await?;
                ids.push(id);
            }
            Ok(ids)
        }
        .await;
        guard.release().await;
        result
    }

    /// Ids of all committed snapshots.
    pub async fn list_snapshots(&self) -> Result<Vec<SnapshotId>, StoreError> {
        Ok(self
            .backend
            .list(&self.area("manifests"))
            .await?
            .into_iter()
            .filter_map(|o| SnapshotId::new(o.key.name()).ok())
            .collect())
    }

    /// Pins a snapshot: retention never removes it (golden snapshots).
    pub async fn pin(&self, id: &SnapshotId) -> Result<(), StoreError> {
        self.load_manifest(id).await?;
        self.backend.put(&self.pin_key(id), Bytes::new()).await?;
        Ok(())
    }

    pub async fn unpin(&self, id: &SnapshotId) -> Result<(), StoreError> {
        Ok(self.backend.delete(&self.pin_key(id)).await?)
    }

    pub async fn pinned(&self) -> Result<HashSet<SnapshotId>, StoreError> {
        Ok(self
            .backend
            .list(&self.area("pins"))
            .await?
            .into_iter()
            .filter_map(|o| SnapshotId::new(o.key.name()).ok())
            .collect())
    }

    /// Removes a snapshot's manifest (its chunks go at the next garbage collection).
    pub async fn delete_snapshot(&self, id: &SnapshotId) -> Result<(), StoreError> {
        if self.pinned().await?.contains(id) {
            return Err(StoreError::SnapshotPinned { id: id.clone() });
        }
        if !self.backend.exists_many(&[self.manifest_key(id)]).await?[0] {
            return Err(StoreError::SnapshotNotFound { id: id.clone() });
        }
        Ok(self.backend.delete_durably(&self.manifest_key(id)).await?)
    }

    /// Totals for `torpor snapshot stats`.
    pub async fn stats(&self) -> Result<StoreStats, StoreError> {
        let chunks = self.backend.list(&self.area("chunks")).await?;
        let packs = self.backend.list(&self.area("packs")).await?;
        // A pack's chunks are counted from its index's size, without reading it.
        let packed_chunks: u64 = self
            .backend
            .list(&self.area("packidx"))
            .await?
            .iter()
            .map(|o| crate::pack::index_entries(o.size))
            .sum();
        let ids = self.list_snapshots().await?;
        let mut logical = 0;
        for id in &ids {
            logical += self.load_manifest(id).await?.logical_bytes();
        }
        Ok(StoreStats {
            logical_bytes: logical,
            stored_bytes: chunks.iter().chain(&packs).map(|c| c.size).sum(),
            chunks: chunks.len() as u64 + packed_chunks,
            snapshots: ids.len() as u64,
        })
    }
}

/// Result of [`Store::verify`].
#[derive(Debug)]
pub struct VerifyReport {
    pub id: SnapshotId,
    pub chunks_checked: u64,
    /// `ChunkMissing` / `ChunkCorrupt` errors, one per bad chunk.
    pub problems: Vec<StoreError>,
}

/// Store-wide totals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreStats {
    pub logical_bytes: u64,
    pub stored_bytes: u64,
    pub chunks: u64,
    pub snapshots: u64,
}

impl StoreStats {
    pub fn to_json(&self) -> String {
        format!(
            "{{\"logical_bytes\": {}, \"stored_bytes\": {}, \"chunks\": {}, \"snapshots\": {}}}",
            self.logical_bytes, self.stored_bytes, self.chunks, self.snapshots
        )
    }
}

/// `items` in runs of [`FETCH_RUN`], in order.
fn runs_of<T>(items: Vec<T>) -> Vec<Vec<T>> {
    runs_of_len(items, FETCH_RUN)
}

/// `items` in runs of `len` (the last shorter).
fn runs_of_len<T>(items: Vec<T>, len: usize) -> Vec<Vec<T>> {
    let mut runs: Vec<Vec<T>> = Vec::new();
    for item in items {
        match runs.last_mut() {
            Some(run) if run.len() < len => run.push(item),
            _ => runs.push(vec![item]),
        }
    }
    runs
}

/// New chunks encoded in one blocking call: (id, plaintext length, blob) each.
async fn encode_run(
    codec: ChunkCodec,
    run: Vec<(ChunkId, Vec<u8>)>,
) -> Result<Vec<(ChunkId, u64, Bytes)>, StoreError> {
    tokio::task::spawn_blocking(move || {
        run.into_iter()
            .map(|(id, data)| {
                let (blob, _) = codec.encode(&id, &data)?;
                Ok((id, data.len() as u64, Bytes::from(blob)))
            })
            .collect::<Result<Vec<_>, crate::chunk::ChunkError>>()
    })
    .await?
    .map_err(StoreError::Encode)
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn is_zero(data: &[u8]) -> bool {
    let (head, body, tail) = {
        // SAFETY: u64 has no invalid bit patterns and align_to keeps the split in bounds.
        unsafe { data.align_to::<u64>() }
    };
    head.iter().all(|&b| b == 0) && body.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

/// Runs on a blocking thread: read, (inflate,) cut, hash, send.
fn produce(
    path: &Path,
    image: Option<(u64, u32)>,
    params: ChunkParams,
    codec: &ChunkCodec,
    tx: mpsc::Sender<Piece>,
) -> Result<u64, ProducerError> {
    let mut file = std::fs::File::open(path).map_err(ProducerError::Read)?;
    let reader: Box<dyn Read> = match image {
        Some((header_len, frame_size)) => {
            file.seek(SeekFrom::Start(header_len))
                .map_err(ProducerError::Read)?;
            Box::new(InflatingReader::new(
                std::io::BufReader::with_capacity(1 << 20, file),
                frame_size,
            ))
        }
        None => Box::new(file),
    };
    let cdc = fastcdc::v2020::StreamCDC::new(reader, params.min, params.avg, params.max);
    let mut total = 0u64;
    for chunk in cdc {
        let chunk = chunk.map_err(|e| match e {
            fastcdc::v2020::Error::IoError(io) => match ImageError::from_io(&io) {
                Some(img) => ProducerError::Image(img.clone()),
                None => ProducerError::Read(io),
            },
            other => ProducerError::Read(std::io::Error::other(other.to_string())),
        })?;
        total += chunk.length as u64;
        let piece = if is_zero(&chunk.data) {
            Piece::Zero(chunk.length as u64)
        } else {
            Piece::Data(codec.id_of(&chunk.data), chunk.data)
        };
        if tx.blocking_send(piece).is_err() {
            break; // the consumer failed and reports why
        }
    }
    Ok(total)
}

enum WalkKind {
    Dir,
    Symlink(String),
    File(u64),
}

struct WalkEntry {
    rel: String,
    abs: PathBuf,
    mode: u32,
    kind: WalkKind,
}

/// Lists `root` depth-first in name order (parents before children), without following links.
fn walk(root: &Path) -> Result<Vec<WalkEntry>, StoreError> {
    let meta = std::fs::metadata(root).map_err(|source| StoreError::ReadInput {
        path: root.to_path_buf(),
        source,
    })?;
    if !meta.is_dir() {
        return Err(StoreError::NotADirectory {
            path: root.to_path_buf(),
        });
    }
    let mut out = Vec::new();
    walk_into(root, "", &mut out)?;
    Ok(out)
}

fn walk_into(dir: &Path, rel: &str, out: &mut Vec<WalkEntry>) -> Result<(), StoreError> {
    let read = |source| StoreError::ReadInput {
        path: dir.to_path_buf(),
        source,
    };
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .map_err(read)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()
        .map_err(read)?;
    names.sort();
    for name in names {
        let abs = dir.join(&name);
        let Some(name) = name.to_str() else {
            return Err(StoreError::UnstorableName { path: abs });
        };
        let child = if rel.is_empty() {
            name.to_string()
        } else {
            format!("{rel}/{name}")
        };
        if !crate::manifest::is_clean_relative(&child)
            || child.len() > crate::manifest::MAX_PATH_LEN
        {
            return Err(StoreError::UnstorableName { path: abs });
        }
        let meta = std::fs::symlink_metadata(&abs).map_err(|source| StoreError::ReadInput {
            path: abs.clone(),
            source,
        })?;
        let mode = meta.mode() & 0o7777;
        let ft = meta.file_type();
        if ft.is_dir() {
            out.push(WalkEntry {
                rel: child.clone(),
                abs: abs.clone(),
                mode,
                kind: WalkKind::Dir,
            });
            walk_into(&abs, &child, out)?;
        } else if ft.is_symlink() {
            let target = std::fs::read_link(&abs).map_err(|source| StoreError::ReadInput {
                path: abs.clone(),
                source,
            })?;
            let Some(target) = target.to_str().map(str::to_string) else {
                return Err(StoreError::UnstorableName { path: abs });
            };
            out.push(WalkEntry {
                rel: child,
                abs,
                mode,
                kind: WalkKind::Symlink(target),
            });
        } else if ft.is_file() {
            out.push(WalkEntry {
                rel: child,
                abs,
                mode,
                kind: WalkKind::File(meta.len()),
            });
        } else {
            return Err(StoreError::UnsupportedFileType { path: abs });
        }
    }
    Ok(())
}
