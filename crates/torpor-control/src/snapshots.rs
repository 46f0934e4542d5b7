//! The node's side of the snapshot store (issue 6): which store the Suspended tier and forks use
//! (a local directory by default, or S3-compatible object storage), per-tenant encryption keys
//! and namespaces, the node's chunk cache, retention and pins, the scheduled collector and the
//! operator's view (list, inspect, verify, gc, stats).
//!
//! It owns the `torpor_snapshot::Store` handles; the engine asks it for the store of a tenant
//! and never builds one itself. It must not touch the state store's rows: the engine tells it
//! which snapshots sandboxes depend on.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::{IntCounter, IntCounterVec, Opts};
use serde::{Deserialize, Serialize};
use torpor_core::TenantId;
use torpor_snapshot::{
    Backend, ChunkCache, LocalBackend, Manifest, PutOptions, PutReport, S3Backend, S3Config,
    SnapshotId, Store, StoreConfig, StoreError, TenantKey,
};

use crate::error::{ControlError, Result};
use crate::metrics::Metrics;

/// Environment variables read for an `s3://` store (the AWS SDK's names).
pub const ENV_S3_ENDPOINT: &str = "AWS_ENDPOINT_URL";
pub const ENV_S3_REGION: &str = "AWS_REGION";
pub const ENV_S3_DEFAULT_REGION: &str = "AWS_DEFAULT_REGION";
pub const ENV_S3_ACCESS_KEY: &str = "AWS_ACCESS_KEY_ID";
pub const ENV_S3_SECRET_KEY: &str = "AWS_SECRET_ACCESS_KEY";
pub const ENV_S3_ALLOW_HTTP: &str = "AWS_ALLOW_HTTP";

/// Label on a snapshot naming its tenant, and one naming the template of a golden snapshot.
pub const LABEL_TENANT: &str = "tenant";
pub const LABEL_GOLDEN: &str = "golden";
/// Label on a template's root filesystem as a snapshot (cluster mode), naming the template.
pub const LABEL_ROOTFS: &str = "rootfs";

/// Where snapshots live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// A directory on this node (`DATA/store` by default).
    Local(PathBuf),
    /// An S3-compatible bucket, with an optional key prefix.
    S3 {
        bucket: String,
        prefix: Option<String>,
    },
}

impl FromStr for StoreLocation {
    type Err = String;

    /// `s3://bucket[/prefix]` or a local directory path.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if let Some(rest) = s.strip_prefix("s3://") {
            let (bucket, prefix) = match rest.split_once('/') {
                Some((b, p)) => (b, p.trim_matches('/')),
                None => (rest, ""),
            };
            let valid = (3..=63).contains(&bucket.len())
                && bucket.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.'
                });
            if !valid {
                return Err(format!(
                    "{s:?}: the bucket name must be 3-63 lowercase letters, digits, '-' or '.'"
                ));
            }
            let prefix = (!prefix.is_empty()).then(|| prefix.to_string());
            if let Some(p) = &prefix {
                if p.split('/').any(|c| c.is_empty() || c == "." || c == "..") {
                    return Err(format!("{s:?}: the prefix has an empty, '.' or '..' part"));
                }
            }
            return Ok(StoreLocation::S3 {
                bucket: bucket.to_string(),
                prefix,
            });
        }
        if s.contains("://") {
            return Err(format!(
                "{s:?}: only s3://bucket/prefix or a local directory is supported"
            ));
        }
        if s.is_empty() {
            return Err("the store location is empty".into());
        }
        Ok(StoreLocation::Local(PathBuf::from(s)))
    }
}

impl std::fmt::Display for StoreLocation {
    /// As `--store` takes it (what a controller announces to its workers).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreLocation::Local(dir) => write!(f, "{}", dir.display()),
            StoreLocation::S3 { bucket, prefix } => match prefix {
                Some(p) => write!(f, "s3://{bucket}/{p}"),
                None => write!(f, "s3://{bucket}"),
            },
        }
    }
}

/// Opens the store at `location` (credentials of an `s3://` store from the `AWS_*`
/// variables): the backend and a description for logs.
pub fn open_backend(
    location: &StoreLocation,
    s3_retry_timeout: Option<Duration>,
) -> Result<(Arc<dyn Backend>, String)> {
    Ok(match location {
        StoreLocation::Local(dir) => (
            Arc::new(LocalBackend::open(dir).map_err(|e| store_error(e.into()))?),
            dir.display().to_string(),
        ),
        StoreLocation::S3 { bucket, prefix } => {
            let s3 = s3_config(bucket, prefix.clone(), s3_retry_timeout)?;
            let desc = format!(
                "s3://{bucket}/{} (endpoint {})",
                prefix.as_deref().unwrap_or(""),
                s3.endpoint.as_deref().unwrap_or("AWS")
            );
            (
                Arc::new(S3Backend::new(&s3).map_err(|e| store_error(e.into()))?),
                desc,
            )
        }
    })
}

/// The daemon's snapshot settings (`torpor up --store ... --chunk-cache ... --keep-snapshots ...
/// --gc-interval ... --snapshot-keys ...`).
#[derive(Debug, Clone, Default)]
pub struct SnapshotConfig {
    /// `None`: `DATA/store`.
    pub location: Option<StoreLocation>,
    /// Byte budget of the node's chunk cache (`DATA/chunk-cache`); `None`: 1 GiB for a remote
    /// store, off for a local one; `Some(0)`: off.
    pub chunk_cache_bytes: Option<u64>,
    /// Keep this many newest snapshots per sandbox; `None`: a superseded snapshot is deleted at
    /// once (only the current one is kept).
    pub keep_snapshots: Option<usize>,
    /// Run the collector this often; `None`: only on `torpor snapshot gc`.
    pub gc_interval: Option<Duration>,
    /// Encrypt at rest with one key per tenant, kept in this directory (`<tenant>.key`).
    pub key_dir: Option<PathBuf>,
    /// Total time one S3 request may spend retrying (default 60 s).
    pub s3_retry_timeout: Option<Duration>,
    /// Pack new chunks into objects of about this many bytes (`torpor_snapshot::pack`);
    /// `None`: `torpor_snapshot::pack_bytes_for`'s default; `Some(0)`: one object per chunk.
    pub pack_bytes: Option<u64>,
    /// The collector rewrites live packs of which remaining snapshots use less than this
    /// fraction of the bytes (`torpor_snapshot::repack`); `None`: [`DEFAULT_REPACK_BELOW`];
    /// `Some(0.0)`: never (a pack is kept whole while any snapshot uses a chunk in it).
    pub repack_below: Option<f64>,
}

pub const DEFAULT_REMOTE_CACHE: u64 = 1 << 30;
/// A pack less than half used is rewritten by the collector (the space it frees is at least
/// what the rewrite writes).
pub const DEFAULT_REPACK_BELOW: f64 = 0.5;

/// The bounds of `--pack-size` (other than 0).
pub use torpor_snapshot::{MAX_PACK_TARGET, MIN_PACK_TARGET};

/// The node's snapshot stores: one shared store, or one namespaced, encrypted store per tenant.
pub struct Snapshots {
    backend: Arc<dyn Backend>,
    cache: Option<Arc<ChunkCache>>,
    shared: Option<Arc<Store>>,
    key_dir: Option<PathBuf>,
    packs: Option<usize>,
    per_tenant: Mutex<HashMap<TenantId, Arc<Store>>>,
    pub(crate) keep: Option<usize>,
    pub(crate) gc_interval: Option<Duration>,
    pub(crate) repack_below: Option<f64>,
    description: String,
    cache_hits: IntCounter,
    cache_misses: IntCounter,
    pub(crate) gc_runs: IntCounterVec,
    pub(crate) gc_removed: IntCounterVec,
    pub(crate) gc_repacked: IntCounterVec,
    /// The sandbox label of each snapshot manifest read so far, by tenant: a manifest never
    /// changes, so a deleted sandbox's snapshots are found by listing names and reading only
    /// the manifests not seen before ([`Snapshots::forget_sandbox`]).
    sandbox_of: Arc<Mutex<SandboxLabels>>,
}

/// Tenant → snapshot id → the sandbox its manifest names (`None`: none).
type SandboxLabels = HashMap<TenantId, HashMap<String, Option<String>>>;

impl Snapshots {
    pub fn open(data_dir: &Path, cfg: &SnapshotConfig, metrics: &Metrics) -> Result<Snapshots> {
        let location = cfg
            .location
            .clone()
            .unwrap_or_else(|| StoreLocation::Local(data_dir.join("store")));
        let (backend, description) = open_backend(&location, cfg.s3_retry_timeout)?;
        let remote = matches!(location, StoreLocation::S3 { .. });
        let cache_bytes =
            cfg.chunk_cache_bytes
                .unwrap_or(if remote { DEFAULT_REMOTE_CACHE } else { 0 });
        let cache = if cache_bytes > 0 {
            let dir = data_dir.join("chunk-cache");
            Some(Arc::new(
                ChunkCache::open(&dir, cache_bytes).map_err(|e| store_error(e.into()))?,
            ))
        } else {
            None
        };
        if let Some(dir) = &cfg.key_dir {
            std::fs::create_dir_all(dir).map_err(ControlError::io("cannot create", dir))?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                .map_err(ControlError::io("cannot restrict", dir))?;
        }
        if cfg.keep_snapshots == Some(0) {
            return Err(ControlError::Invalid(
                "--keep-snapshots must be at least 1 (the current snapshot is always kept)".into(),
            ));
        }
        let repack_below = match cfg.repack_below {
            None => Some(DEFAULT_REPACK_BELOW),
            Some(0.0) => None,
            Some(f) if f > 0.0 && f <= 1.0 => Some(f),
            Some(f) => {
                return Err(ControlError::Invalid(format!(
                    "--repack-below must be a fraction from 0 (never repack) to 1, not {f}"
                )))
            }
        };
        let packs = torpor_snapshot::pack_bytes_for(cfg.pack_bytes, remote);
        let shared = if cfg.key_dir.is_none() {
            let store_cfg = StoreConfig {
                pack_bytes: packs,
                ..StoreConfig::default()
            };
            let mut store = Store::new(backend.clone(), store_cfg).map_err(store_error)?;
            if let Some(c) = &cache {
                store = store.with_cache(c.clone());
            }
            Some(Arc::new(store))
        } else {
            None
        };
        let cache_hits = IntCounter::new(
            "torpor_snapshot_cache_hits_total",
            "Chunks a wake read from this node's chunk cache.",
        )
        .expect("valid metric");
        let cache_misses = IntCounter::new(
            "torpor_snapshot_cache_misses_total",
            "Chunks a wake fetched from the snapshot store (not in the chunk cache).",
        )
        .expect("valid metric");
        let gc_runs = IntCounterVec::new(
            Opts::new(
                "torpor_snapshot_gc_runs_total",
                "Garbage collections of the snapshot store, by result.",
            ),
            &["result"],
        )
        .expect("valid metric");
        let gc_removed = IntCounterVec::new(
            Opts::new(
                "torpor_snapshot_gc_removed_total",
                "What garbage collection removed: snapshots, chunks, packs, bytes.",
            ),
            &["what"],
        )
        .expect("valid metric");
        let gc_repacked = IntCounterVec::new(
            Opts::new(
                "torpor_snapshot_gc_repacked_total",
                "What garbage collection's repacking did: sparse or small packs rewritten (packs), packs \
                 written for them (packs_written), bytes written (bytes), manifests rewritten \
                 (manifests).",
            ),
            &["what"],
        )
        .expect("valid metric");
        if let Some(c) = &cache {
            metrics.register(Box::new(torpor_snapshot::metrics::CacheMetrics::new(
                c.clone(),
            )));
        }
        metrics.register(Box::new(cache_hits.clone()));
        metrics.register(Box::new(cache_misses.clone()));
        metrics.register(Box::new(gc_runs.clone()));
        metrics.register(Box::new(gc_removed.clone()));
        metrics.register(Box::new(gc_repacked.clone()));
        tracing::info!(store = %description, cache_bytes, pack_bytes = ?packs, encrypted = cfg.key_dir.is_some(),
            keep = ?cfg.keep_snapshots, gc_interval = ?cfg.gc_interval, ?repack_below, "snapshot store");
        Ok(Snapshots {
            backend,
            cache,
            shared,
            key_dir: cfg.key_dir.clone(),
            packs,
            per_tenant: Mutex::default(),
            keep: cfg.keep_snapshots,
            gc_interval: cfg.gc_interval,
            repack_below,
            description,
            cache_hits,
            cache_misses,
            gc_runs,
            gc_removed,
            gc_repacked,
            sandbox_of: Arc::default(),
        })
    }

    pub fn description(&self) -> &str {
        &self.description
    }

    pub fn encrypted(&self) -> bool {
        self.key_dir.is_some()
    }

    /// The store holding `tenant`'s snapshots.
    pub fn for_tenant(&self, tenant: &TenantId) -> Result<Arc<Store>> {
        if let Some(s) = &self.shared {
            return Ok(s.clone());
        }
        let mut map = self.per_tenant.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = map.get(tenant) {
            return Ok(s.clone());
        }
        let dir = self.key_dir.as_ref().expect("encrypted when not shared");
        let key = load_or_create_key(dir, tenant)?;
        let cfg = StoreConfig {
            key: Some(key),
            namespace: Some(tenant.as_str().to_string()),
            pack_bytes: self.packs,
            ..StoreConfig::default()
        };
        let mut store = Store::new(self.backend.clone(), cfg).map_err(store_error)?;
        if let Some(c) = &self.cache {
            store = store.with_cache(c.clone());
        }
        let store = Arc::new(store);
        map.insert(tenant.clone(), store.clone());
        Ok(store)
    }

    /// How a worker reads and writes `tenant`'s snapshots (cluster mode): the tenant's
    /// namespace and key for an encrypted store, nothing for a shared one.
    pub fn access_for(&self, tenant: &TenantId) -> Result<torpor_runtime::node::StoreAccess> {
        let Some(dir) = &self.key_dir else {
            return Ok(torpor_runtime::node::StoreAccess::default());
        };
        Ok(torpor_runtime::node::StoreAccess {
            namespace: Some(tenant.as_str().to_string()),
            key: Some(load_or_create_key(dir, tenant)?.to_bytes()),
        })
    }

    /// Labels every snapshot of `tenant` carries besides `labels`.
    pub fn labels_for(
        tenant: &TenantId,
        mut labels: Vec<(String, String)>,
    ) -> Vec<(String, String)> {
        labels.push((LABEL_TENANT.into(), tenant.to_string()));
        labels
    }

    /// Stores a sandbox's checkpoint directory, labelled with its sandbox and tenant.
    pub async fn put(
        &self,
        tenant: &TenantId,
        labels: Vec<(String, String)>,
        dir: PathBuf,
    ) -> Result<PutReport> {
        let store = self.for_tenant(tenant)?;
        let mut labels = labels;
        labels.push((LABEL_TENANT.into(), tenant.to_string()));
        // The store's futures run in their own task: their internal borrows stay out of the
        // API handlers' futures (which must be Send for any lifetime).
        tokio::spawn(async move {
            store
                .put_dir_with(
                    &dir,
                    PutOptions {
                        labels,
                        ..Default::default()
                    },
                )
                .await
        })
        .await
        .map_err(|e| ControlError::Snapshot(format!("upload task failed: {e}")))?
        .map_err(store_error)
    }

    /// Fetches a snapshot into `dest`, every chunk verified; counts cache hits and misses.
    pub async fn fetch(&self, tenant: &TenantId, snapshot: &str, dest: &Path) -> Result<()> {
        let id = snapshot_id(snapshot)?;
        let store = self.for_tenant(tenant)?;
        let dest = dest.to_path_buf();
        let stats = tokio::spawn(async move { store.get_dir(&id, &dest).await })
            .await
            .map_err(|e| ControlError::Snapshot(format!("fetch task failed: {e}")))?
            .map_err(store_error)?;
        self.cache_hits.inc_by(stats.cache_hits);
        self.cache_misses
            .inc_by(stats.chunks_fetched.saturating_sub(stats.cache_hits));
        Ok(())
    }

    /// When `snapshot` was taken (its manifest's time); `None` when it cannot be read.
    pub async fn taken_at(&self, tenant: &TenantId, snapshot: &str) -> Option<u64> {
        let id = SnapshotId::new(snapshot).ok()?;
        let store = self.for_tenant(tenant).ok()?;
        tokio::spawn(async move { store.load_manifest(&id).await })
            .await
            .ok()?
            .ok()
            .map(|m| m.created_unix_ms)
    }

    /// `count` snapshots sharing `snapshot`'s chunks.
    pub async fn fork(
        &self,
        tenant: &TenantId,
        snapshot: SnapshotId,
        count: usize,
    ) -> Result<Vec<SnapshotId>> {
        let store = self.for_tenant(tenant)?;
        tokio::spawn(async move { store.fork(&snapshot, count).await })
            .await
            .map_err(|e| ControlError::Snapshot(format!("fork task failed: {e}")))?
            .map_err(store_error)
    }

    /// Puts `dir` into the store as snapshot `id`, pinned (a golden image; a template's root
    /// filesystem in cluster mode); a snapshot already stored under `id` is kept as it is.
    pub async fn put_pinned(
        &self,
        tenant: &TenantId,
        id: &str,
        labels: Vec<(String, String)>,
        dir: PathBuf,
    ) -> Result<SnapshotId> {
        let id = snapshot_id(id)?;
        let store = self.for_tenant(tenant)?;
        let labels = Snapshots::labels_for(tenant, labels);
        let want = id.clone();
        tokio::spawn(async move {
            match store.load_manifest(&want).await {
                Ok(_) => return Ok(()),
                Err(StoreError::SnapshotNotFound { .. }) => {}
                Err(e) => return Err(e),
            }
            let put = store
                .put_dir_with(
                    &dir,
                    PutOptions {
                        id: Some(want.clone()),
                        labels,
                        ..Default::default()
                    },
                )
                .await;
            match put {
                Ok(_) | Err(StoreError::SnapshotExists { .. }) => {}
                Err(e) => return Err(e),
            }
            store.pin(&want).await
        })
        .await
        .map_err(|e| ControlError::Snapshot(format!("upload task failed: {e}")))?
        .map_err(store_error)?;
        Ok(id)
    }

    /// A template's golden checkpoint in the store, pinned so retention never removes it; put
    /// once per template build (`id` is derived from the template and its build).
    pub async fn golden(
        &self,
        tenant: &TenantId,
        template: &str,
        build: i64,
        dir: PathBuf,
    ) -> Result<SnapshotId> {
        let labels = vec![(LABEL_GOLDEN.to_string(), template.to_string())];
        self.put_pinned(tenant, &format!("golden-{template}-{build}"), labels, dir)
            .await
    }

    /// A sandbox moved off `snapshot`. Without retention it is deleted now; with retention
    /// the collector keeps the newest N per sandbox (forks' unlabelled copies go now).
    pub async fn retire(&self, tenant: &TenantId, snapshot: &str) {
        let Ok(id) = SnapshotId::new(snapshot) else {
            return;
        };
        let Ok(store) = self.for_tenant(tenant) else {
            return;
        };
        let keep = self.keep;
        let done = tokio::spawn(async move {
            if keep.is_some() {
                let m = store.load_manifest(&id).await?;
                if m.label(torpor_snapshot::store::LABEL_SANDBOX).is_some() {
                    return Ok(());
                }
            }
            match store.delete_snapshot(&id).await {
                Ok(()) | Err(StoreError::SnapshotPinned { .. }) => Ok(()),
                Err(e) => Err(e),
            }
        })
        .await;
        if !matches!(done, Ok(Ok(()))) {
            tracing::warn!(snapshot = %snapshot, "cannot retire a superseded snapshot");
        }
    }

    /// A deleted template's pinned snapshot (its golden image, its root filesystem in cluster
    /// mode) goes: unpinned, then deleted (its chunks at the next collection, unless forks
    /// share them). Missing: nothing to do.
    pub async fn drop_pinned(&self, tenant: &TenantId, snapshot: &str) {
        let Ok(id) = SnapshotId::new(snapshot) else {
            return;
        };
        let Ok(store) = self.for_tenant(tenant) else {
            return;
        };
        let done = tokio::spawn(async move {
            store.unpin(&id).await?;
            match store.delete_snapshot(&id).await {
                Ok(()) | Err(StoreError::SnapshotNotFound { .. }) => Ok(()),
                Err(e) => Err(e),
            }
        })
        .await;
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(%snapshot, error = %e, "cannot delete a template's snapshot")
            }
            Err(e) => tracing::warn!(%snapshot, error = %e, "cannot delete a template's snapshot"),
        }
    }

    /// A deleted sandbox's snapshots (kept by retention) go with it; pinned ones stay.
    pub async fn forget_sandbox(&self, tenant: &TenantId, sandbox: &str) {
        if self.keep.is_none() {
            return; // only the current one existed, and it was retired with the sandbox
        }
        let Ok(store) = self.for_tenant(tenant) else {
            return;
        };
        let (sandbox, labels, tenant) =
            (sandbox.to_string(), self.sandbox_of.clone(), tenant.clone());
        let done = tokio::spawn(async move {
            let ids = store.list_snapshots().await?;
            let listed: std::collections::HashSet<&str> = ids.iter().map(|i| i.as_str()).collect();
            // The labels known already (of snapshots still there); the other manifests are
            // read once, here.
            let known: HashMap<String, Option<String>> = {
                let mut all = labels.lock().unwrap_or_else(|p| p.into_inner());
                let mine = all.entry(tenant.clone()).or_default();
                mine.retain(|id, _| listed.contains(id.as_str()));
                mine.clone()
            };
            let mut learned = Vec::new();
            let mut ours = Vec::new();
            for id in ids {
                let label = match known.get(id.as_str()) {
                    Some(label) => label.clone(),
                    None => match store.load_manifest(&id).await {
                        Ok(m) => {
                            let label = m
                                .label(torpor_snapshot::store::LABEL_SANDBOX)
                                .map(str::to_string);
                            learned.push((id.to_string(), label.clone()));
                            label
                        }
                        Err(StoreError::SnapshotNotFound { .. }) => continue,
                        Err(e) => return Err(e),
                    },
                };
                if label.as_deref() == Some(sandbox.as_str()) {
                    ours.push(id);
                }
            }
            labels
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(tenant)
                .or_default()
                .extend(learned);
            for id in ours {
                match store.delete_snapshot(&id).await {
                    Ok(()) | Err(StoreError::SnapshotPinned { .. }) => {}
                    Err(StoreError::SnapshotNotFound { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        })
        .await;
        if !matches!(done, Ok(Ok(()))) {
            tracing::warn!("cannot remove a deleted sandbox's snapshots");
        }
    }

    pub(crate) fn stores_of(
        &self,
        tenants: &[TenantId],
    ) -> Result<Vec<(Option<TenantId>, Arc<Store>)>> {
        match &self.shared {
            Some(s) => Ok(vec![(None, s.clone())]),
            None => tenants
                .iter()
                .map(|t| Ok((Some(t.clone()), self.for_tenant(t)?)))
                .collect(),
        }
    }
}

// ------------------------------------------------------------------ the operator's view

/// One snapshot in `GET /v1/snapshots`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SnapshotSummary {
    pub id: String,
    pub tenant: Option<String>,
    pub sandbox: Option<String>,
    pub parent: Option<String>,
    pub created_unix_ms: u64,
    pub logical_bytes: u64,
    pub files: u64,
    pub chunks: u64,
    pub pinned: bool,
    /// Sandboxes whose current image this snapshot is.
    pub used_by: Vec<String>,
}

/// One file of a snapshot in `GET /v1/snapshots/{id}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SnapshotFile {
    pub path: String,
    /// `dir`, `symlink`, `file` or `gvisor_image`.
    pub kind: String,
    pub mode: u32,
    pub size: u64,
    pub chunks: u64,
    pub zero_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SnapshotDetail {
    #[serde(flatten)]
    pub summary: SnapshotSummary,
    pub labels: BTreeMap<String, String>,
    pub chunking: BTreeMap<String, u32>,
    pub unique_chunks: u64,
    pub file_list: Vec<SnapshotFile>,
}

/// One bad chunk found by verify.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VerifyProblem {
    /// `chunk_missing` or `chunk_corrupt`.
    pub code: String,
    pub snapshot: String,
    pub chunk: String,
    pub path: String,
    pub message: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VerifyResult {
    pub snapshots_checked: u64,
    pub chunks_checked: u64,
    pub ok: bool,
    pub problems: Vec<VerifyProblem>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct GcResult {
    pub dry_run: bool,
    pub snapshots_kept: u64,
    pub snapshots_removed: Vec<String>,
    pub chunks_live: u64,
    pub chunks_removed: u64,
    pub bytes_freed: u64,
    /// Packs removed (their bytes are in `bytes_freed`).
    #[serde(default)]
    pub packs_removed: u64,
    /// Bytes of the packs kept, and of their chunks that remaining snapshots use (a pack is
    /// kept whole while any snapshot uses a chunk in it).
    #[serde(default)]
    pub pack_bytes_live: u64,
    #[serde(default)]
    pub pack_bytes_used: u64,
    /// Sparse packs (`--repack-below`) and small ones (merged) rewritten: their used chunks
    /// copied into new packs, the
    /// manifests that located chunks in them rewritten, then removed (they are counted in
    /// `packs_removed` and their bytes in `bytes_freed`); the packs written for them and their
    /// bytes (the space reclaimed is `bytes_freed - repack_bytes_written`). A dry run counts
    /// the packs it would rewrite and their used bytes.
    #[serde(default)]
    pub packs_repacked: u64,
    #[serde(default)]
    pub repack_packs_written: u64,
    #[serde(default)]
    pub repack_bytes_written: u64,
    #[serde(default)]
    pub manifests_rewritten: u64,
}

/// `torpor snapshot stats --json`: these four fields, exactly.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct SnapshotStats {
    pub logical_bytes: u64,
    pub stored_bytes: u64,
    pub chunks: u64,
    pub snapshots: u64,
}

pub(crate) fn summary(m: &Manifest, pinned: bool, used_by: Vec<String>) -> SnapshotSummary {
    SnapshotSummary {
        id: m.id.to_string(),
        tenant: m.label(LABEL_TENANT).map(str::to_string),
        sandbox: m
            .label(torpor_snapshot::store::LABEL_SANDBOX)
            .map(str::to_string),
        parent: m.parent.as_ref().map(|p| p.to_string()),
        created_unix_ms: m.created_unix_ms,
        logical_bytes: m.logical_bytes(),
        files: m.files.len() as u64,
        chunks: m.chunk_refs().count() as u64,
        pinned,
        used_by,
    }
}

pub(crate) fn snapshot_not_found(id: &str) -> ControlError {
    ControlError::NotFound {
        kind: "snapshot",
        id: id.to_string(),
    }
}

pub(crate) fn snapshot_id(s: &str) -> Result<SnapshotId> {
    SnapshotId::new(s).map_err(|e| ControlError::Snapshot(format!("snapshot id {s:?}: {e}")))
}

/// The error and its sources, once each: `a: b: c`.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let m = s.to_string();
        if !out.contains(&m) {
            out.push_str(": ");
            out.push_str(&m);
        }
        src = s.source();
    }
    out
}

/// A store error as the control plane's error, keeping the store's stable code.
pub fn store_error(e: StoreError) -> ControlError {
    match e {
        StoreError::SnapshotNotFound { id } => snapshot_not_found(id.as_str()),
        e => ControlError::SnapshotStore {
            code: e.code(),
            message: error_chain(&e),
        },
    }
}

fn s3_config(
    bucket: &str,
    prefix: Option<String>,
    retry_timeout: Option<Duration>,
) -> Result<S3Config> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let mut c = S3Config::new(bucket);
    c.prefix = prefix;
    c.endpoint = env(ENV_S3_ENDPOINT);
    if let Some(r) = env(ENV_S3_REGION).or_else(|| env(ENV_S3_DEFAULT_REGION)) {
        c.region = r;
    }
    c.access_key_id = env(ENV_S3_ACCESS_KEY).unwrap_or_default();
    c.secret_access_key = env(ENV_S3_SECRET_KEY).unwrap_or_default();
    if c.access_key_id.is_empty() || c.secret_access_key.is_empty() {
        return Err(ControlError::Invalid(format!(
            "an s3:// store needs {ENV_S3_ACCESS_KEY} and {ENV_S3_SECRET_KEY}"
        )));
    }
    c.allow_http = c
        .endpoint
        .as_deref()
        .is_some_and(|e| e.starts_with("http://"))
        || env(ENV_S3_ALLOW_HTTP).is_some_and(|v| v == "true" || v == "1");
    if let Some(t) = retry_timeout {
        c.retry_timeout = t;
        c.request_timeout = c.request_timeout.min(t.max(Duration::from_secs(1)));
    }
    Ok(c)
}

/// Reads `DIR/<tenant>.key` (64 hex digits), creating it (mode 0600) on first use.
fn load_or_create_key(dir: &Path, tenant: &TenantId) -> Result<TenantKey> {
    let path = dir.join(format!("{}.key", tenant.as_str()));
    match std::fs::read_to_string(&path) {
        Ok(text) => parse_key(text.trim()).ok_or_else(|| {
            ControlError::Invalid(format!(
                "{}: a tenant key is 64 hex digits (32 bytes)",
                path.display()
            ))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let bytes: [u8; 32] = rand::random();
            let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .map_err(ControlError::io("cannot create the tenant key", &path))?;
            f.write_all(hex.as_bytes())
                .and_then(|()| f.sync_all())
                .map_err(ControlError::io("cannot write the tenant key", &path))?;
            tracing::info!(tenant = %tenant, path = %path.display(), "new snapshot encryption key");
            Ok(TenantKey::from_bytes(bytes))
        }
        Err(e) => Err(ControlError::Io {
            what: "cannot read the tenant key",
            path,
            source: e,
        }),
    }
}

fn parse_key(hex: &str) -> Option<TenantKey> {
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(TenantKey::from_bytes(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_locations_parse_strictly() {
        assert_eq!(
            "s3://my-bucket/a/b".parse::<StoreLocation>(),
            Ok(StoreLocation::S3 {
                bucket: "my-bucket".into(),
                prefix: Some("a/b".into())
            })
        );
        assert_eq!(
            "s3://my-bucket".parse::<StoreLocation>(),
            Ok(StoreLocation::S3 {
                bucket: "my-bucket".into(),
                prefix: None
            })
        );
        assert_eq!(
            "/srv/store".parse::<StoreLocation>(),
            Ok(StoreLocation::Local("/srv/store".into()))
        );
        for bad in [
            "s3://",
            "s3://B",
            "s3://ok-bucket/a//b",
            "s3://ok-bucket/../x",
            "gs://x/y",
            "",
        ] {
            assert!(bad.parse::<StoreLocation>().is_err(), "{bad}");
        }
    }

    #[test]
    fn tenant_keys_are_created_once_private_and_validated() {
        let dir = tempfile::tempdir().unwrap();
        let t = TenantId::new("acme").unwrap();
        load_or_create_key(dir.path(), &t).unwrap();
        let path = dir.path().join("acme.key");
        let first = std::fs::read_to_string(&path).unwrap();
        assert_eq!(first.len(), 64);
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        load_or_create_key(dir.path(), &t).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            first,
            "not rotated"
        );
        std::fs::write(&path, "zz").unwrap();
        assert_eq!(
            load_or_create_key(dir.path(), &t).unwrap_err().code(),
            "invalid_request"
        );
    }
}
