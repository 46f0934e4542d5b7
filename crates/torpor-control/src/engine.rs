//! The engine: owns every sandbox's lifecycle on this node.
//!
//! Each sandbox has a [`Slot`]: a read-write lock over its live container (if resident) and its
//! last-activity clock. Calls that use a running sandbox (exec, files) hold the read lock, so
//! many run at once; transitions (wake, freeze, checkpoint, delete) hold the write lock, so they
//! wait for calls in flight to finish and never checkpoint under a running request. Concurrent
//! calls to one sleeping sandbox queue on the write lock: the first wakes it, the rest find it
//! running.
//!
//! Every transition writes its transitional state to the store before the side effect and its
//! stable state after; [`Engine::start`] reconciles what a crash left behind. Workers are a
//! semaphore: a resident sandbox holds one permit.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock, Semaphore};
use torpor_core::{
    now_millis, validate_env, Limits, LimitsPatch, SandboxId, SandboxState, TemplateName,
    TemplateSource, TemplateSpec, TenantId, Tier,
};
use torpor_runtime::proto::{self, AgentErrorCode, DirEntry, ExecRequest, Reply, Request};
use torpor_runtime::{
    rootfs, ContainerSpec, Launch, Node, NodeEvent, NodeInfo, Resident, RunscNode, RunscNodeConfig,
};

use crate::error::{ControlError, Result};

mod net;
mod quota;
mod sources;
pub mod usage_probe;

use crate::lot::{LotError, Parked, WorkerPermit, WorkerPool};
use crate::metrics::Metrics;
use crate::store::{
    ImageRef, Quotas, SandboxRecord, Store, TemplateRecord, TemplateStatus, TenantRecord,
};
pub use net::{count_proxied, sandbox_handshake, sandbox_http, ProxyTarget, SandboxConn};
use quota::Charge;
pub use quota::{UploadAllowance, TENANT_MAX_PIDS};
pub use sources::{UploadKind, UPLOADED};

/// Everything the engine needs to know at start.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub data_dir: PathBuf,
    /// How many sandboxes may be resident (Running or Frozen) at once.
    pub workers: usize,
    pub runsc_binary: Option<PathBuf>,
    pub runsc_platform: Option<String>,
    /// The binary copied into every sandbox as its agent (normally the running `torpor`).
    pub agent_binary: PathBuf,
    /// How long a call waits (parked) for a free worker before it is refused.
    pub worker_wait: Duration,
    /// How many calls may wait for a worker at once.
    pub lot_capacity: usize,
    /// Resident sandboxes are parked, least recently active first, to stay under this.
    pub memory_budget: Option<u64>,
    /// How often the idle policy runs.
    pub tick: Duration,
    /// Free workers kept prepared (cgroups, bundle directory) so a wake does only the restore.
    pub warm_pool: usize,
    /// How long an explicit suspend waits for calls in flight (execs, proxied requests, open
    /// WebSockets) to finish before it answers 409 `sandbox_busy`; nothing in flight is cut.
    pub drain_timeout: Duration,
    /// Snapshot store, chunk cache, retention, scheduled GC, encryption.
    pub snapshots: crate::snapshots::SnapshotConfig,
    /// The only host directory a tenant's template source may name (`--import-dir`); `None`:
    /// tenants may not name host paths at all (they upload images). The admin may name any.
    pub import_dir: Option<PathBuf>,
}

const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a delete waits for calls in flight before it destroys the container under them.
const DELETE_GRACE: Duration = Duration::from_secs(2);
/// How long a delete then waits for those calls to notice.
const DELETE_CUT_WAIT: Duration = Duration::from_secs(30);
/// How long shutdown waits for one sandbox's calls in flight before it leaves it.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
const MAX_METADATA_ENTRIES: usize = 64;
/// Forks made by one call.
pub const MAX_FORKS: usize = 64;
const MAX_METADATA_LEN: usize = 1024;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    pub template: TemplateName,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub limits: LimitsPatch,
    /// A GPU request (`torpor-gpu`'s request object); overrides the template's.
    #[serde(default)]
    pub gpu: Option<serde_json::Value>,
    /// Egress policy; absent or `none`: no network interface.
    #[serde(default)]
    pub network: Option<torpor_core::NetworkPolicy>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct WorkerStats {
    pub memory_budget_bytes: Option<u64>,
    pub resident_memory_bytes: u64,
    pub total: usize,
    pub busy: usize,
    pub free: usize,
    pub parked_calls: usize,
    pub lot_capacity: usize,
    pub park_budget_ms: u64,
    /// Prepared workers the warm pool keeps.
    pub warm_pool_size: usize,
    /// Prepared workers ready now.
    pub warm_ready: usize,
    /// Wakes that found a prepared worker / that prepared one inline.
    pub warm_takes: u64,
    pub cold_takes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ExecResult {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub oom_killed: bool,
    pub duration_ms: f64,
}

/// One event of a streamed exec.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ExecEvent {
    Stdout { data: String },
    Stderr { data: String },
    Exit(ExecResult),
    Error { code: String, message: String },
}

struct Live {
    /// The container on the node; its worker goes back to the node with it.
    resident: Box<dyn Resident>,
    _permit: WorkerPermit,
    frozen: bool,
}

#[derive(Default)]
struct SlotState {
    live: Option<Live>,
}

struct Slot {
    state: Arc<RwLock<SlotState>>,
    last_active: AtomicI64,
}

impl Slot {
    fn touch(&self) {
        self.last_active.fetch_max(now_millis(), Ordering::Relaxed);
    }
}

/// A running sandbox borrowed for one call; it cannot be checkpointed while this lives.
pub struct InUse {
    guard: OwnedRwLockReadGuard<SlotState>,
    slot: Arc<Slot>,
    id: SandboxId,
    evictor: Arc<Evictor>,
}

/// Frees workers for calls waiting in the lot, as soon as a resident sandbox is idle: woken
/// when a call starts waiting and when a call ends, it parks least recently active idle
/// sandboxes, one per waiting call, several at once (the checkpoint semaphore bounds them).
#[derive(Default)]
struct Evictor {
    wake: tokio::sync::Notify,
    /// Calls that want a worker and have none yet.
    wanting: std::sync::atomic::AtomicUsize,
    /// Evictions started for them and not finished.
    in_flight: std::sync::atomic::AtomicUsize,
}

impl Evictor {
    fn needed(&self) -> bool {
        self.wanting.load(Ordering::SeqCst) > self.in_flight.load(Ordering::SeqCst)
    }

    /// Wakes the eviction task if some call waits for a worker.
    fn poke(&self) {
        if self.needed() {
            self.wake.notify_one();
        }
    }
}

impl InUse {
    /// Where the proxy reaches the sandbox's ports (networked sandboxes only).
    pub fn ingress_addr(&self) -> Option<std::net::Ipv4Addr> {
        self.guard.live.as_ref()?.resident.ingress_addr()
    }

    fn resident(&self) -> &dyn Resident {
        &*self
            .guard
            .live
            .as_ref()
            .expect("in-use sandbox is live")
            .resident
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        self.slot.touch();
        // The sandbox is idle now unless another call holds it: a waiting call may take its worker.
        self.evictor.poke();
    }
}

pub struct Engine {
    /// The engine itself, for tasks (crash watches) that must call back into it.
    me: std::sync::Weak<Engine>,
    cfg: EngineConfig,
    pub(crate) store: Store,
    /// The machine the sandboxes run on.
    node: Arc<dyn Node>,
    node_info: NodeInfo,
    slots: Mutex<HashMap<SandboxId, Arc<Slot>>>,
    workers: Arc<WorkerPool>,
    evictor: Arc<Evictor>,
    /// At most this many checkpoints run at once (each is CPU- and disk-heavy).
    checkpoints: Arc<Semaphore>,
    pub metrics: Metrics,
    shutting_down: AtomicBool,
    /// The snapshot store: Suspended sandboxes' checkpoints, chunked, deduplicated, verified.
    pub(crate) snapshots: Arc<crate::snapshots::Snapshots>,
    /// Serialises quota checks with the state change that consumes the quota, so two calls at
    /// the last unit cannot both pass.
    quota_lock: tokio::sync::Mutex<()>,
    /// Disk taken by each built template (for disk quotas).
    template_sizes: quota::TemplateSizes,
    /// The node's GPU shares, when it has GPUs (attached by the daemon after start).
    gpus: std::sync::OnceLock<crate::gpu::NodeGpus>,
}

/// Paths under the data directory.
impl Engine {
    fn templates_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("templates")
    }
    /// Where a template's files live: the operator's under `templates/<name>`, a tenant's under
    /// `templates/@<tenant>/<name>` (`@` is in no name, so the two never meet).
    fn template_dir(&self, owner: &TenantId, name: &TemplateName) -> PathBuf {
        if *owner == TenantId::admin() {
            self.templates_dir().join(name.as_str())
        } else {
            self.templates_dir()
                .join(format!("@{owner}"))
                .join(name.as_str())
        }
    }
    fn sandbox_dir(&self, id: &SandboxId) -> PathBuf {
        self.cfg.data_dir.join("sandboxes").join(id.as_str())
    }
}

impl Engine {
    /// Starts the engine on this machine's node (runsc, the warm pool, cgroups): see
    /// [`Engine::start_on`].
    pub async fn start(cfg: EngineConfig) -> Result<Arc<Engine>> {
        create_data_dirs(&cfg.data_dir)?;
        let node = RunscNode::start(RunscNodeConfig {
            data_dir: cfg.data_dir.clone(),
            runsc_binary: cfg.runsc_binary.clone(),
            runsc_platform: cfg.runsc_platform.clone(),
            agent_binary: cfg.agent_binary.clone(),
            warm_pool: cfg.warm_pool,
        })?;
        Engine::start_on(cfg, Arc::new(node)).await
    }

    /// Opens the store, reconciles what a previous run left behind (on `node` and in the
    /// store) and makes sure the built-in `host` template exists. Then starts the idle policy,
    /// the evictor and the node's event watch.
    pub async fn start_on(cfg: EngineConfig, node: Arc<dyn Node>) -> Result<Arc<Engine>> {
        create_data_dirs(&cfg.data_dir)?;
        let store = Store::open(&cfg.data_dir.join("torpor.db"))?;
        let node_info = node.info();
        let events = node.take_events();
        let metrics = Metrics::new();
        let snapshots = Arc::new(crate::snapshots::Snapshots::open(
            &cfg.data_dir,
            &cfg.snapshots,
            &metrics,
        )?);
        metrics.workers_total.set(cfg.workers as i64);
        let engine = Arc::new_cyclic(|me| Engine {
            me: me.clone(),
            evictor: Arc::default(),
            workers: WorkerPool::new(cfg.workers, cfg.lot_capacity),
            checkpoints: Arc::new(Semaphore::new(2)),
            cfg,
            store,
            node,
            node_info,
            slots: Mutex::default(),
            metrics,
            shutting_down: AtomicBool::new(false),
            quota_lock: tokio::sync::Mutex::new(()),
            template_sizes: Default::default(),
            snapshots,
            gpus: std::sync::OnceLock::new(),
        });
        engine.reconcile().await?;
        if engine
            .store
            .template(&TenantId::admin(), &TemplateName::host())?
            .is_none()
        {
            tracing::info!("building the built-in host template (first start)");
            engine
                .register_template(
                    &TenantId::admin(),
                    TemplateSpec {
                        name: TemplateName::host(),
                        source: TemplateSource::Host,
                        command: Vec::new(),
                        env: BTreeMap::new(),
                        cwd: None,
                        limits: Limits::default(),
                        idle: Default::default(),
                        warmup_ms: 0,
                        gpu: None,
                        network: None,
                    },
                    &|_| {},
                )
                .await?;
        }
        let ticker = engine.clone();
        tokio::spawn(async move { ticker.run_policy().await });
        let evictor = engine.clone();
        tokio::spawn(async move { evictor.run_evictor().await });
        if let Some(events) = events {
            let watcher = engine.clone();
            tokio::spawn(async move { watcher.watch_node(events).await });
        }
        engine.spawn_snapshot_gc();
        Ok(engine)
    }

    /// What the node runs (runtime version, platform, GPU pass-through).
    pub fn node_info(&self) -> &NodeInfo {
        &self.node_info
    }

    pub fn workers(&self) -> usize {
        self.cfg.workers
    }

    /// Resolves every transitional state a crashed daemon left and removes stray containers.
    async fn reconcile(&self) -> Result<()> {
        // The agent channel of any container still running died with the previous daemon; such
        // a container cannot be talked to again, so its sandbox goes back to its last snapshot.
        // Containers the previous run froze cannot die until thawed.
        let ours: std::collections::HashSet<String> = self
            .store
            .sandboxes()?
            .into_iter()
            .map(|s| s.id.to_string())
            .collect();
        self.node
            .reconcile(&|cid: &str| sandbox_of(cid).is_some_and(|id| ours.contains(id)))
            .await;
        for t in self.store.templates()? {
            if t.status == TemplateStatus::Building {
                tracing::warn!(template = %t.name, "dropping a template whose build was interrupted");
                let _ = std::fs::remove_dir_all(t.rootfs.parent().unwrap_or(&t.rootfs));
                self.store.delete_template(&t.tenant, &t.name)?;
            }
        }
        for mut s in self.store.sandboxes()? {
            use torpor_core::Recovery;
            match s.state.recovery() {
                Recovery::Keep => {}
                Recovery::BackToSnapshot => {
                    tracing::warn!(sandbox = %s.id, state = %s.state, "back to its last snapshot after a restart");
                    s.state = s.image.sleeping_state();
                    s.tier = s.image.sleeping_tier();
                    if s.state != SandboxState::Suspended && matches!(s.image, ImageRef::Store(_)) {
                        s.state = SandboxState::Suspended;
                    }
                    self.store.update_sandbox(&s)?;
                }
                Recovery::DropCreation => {
                    tracing::warn!(sandbox = %s.id, "dropping a creation that never finished");
                    self.remove_sandbox_files(&s.id);
                    self.store.delete_sandbox(&s.id)?;
                }
                Recovery::FinishDelete => {
                    self.remove_sandbox_files(&s.id);
                    self.store.delete_sandbox(&s.id)?;
                }
            }
            // Checkpoints that never committed, and committed ones the record never came to
            // point at (a crash between the rename and the record's update).
            let images = self.sandbox_dir(&s.id).join("images");
            remove_tmp_entries(&images);
            if let Some(ImageRef::Local(current)) = self.store.sandbox(&s.id)?.map(|r| r.image) {
                remove_other_entries(&images, &current);
            }
        }
        Ok(())
    }

    fn remove_sandbox_files(&self, id: &SandboxId) {
        let _ = std::fs::remove_dir_all(self.sandbox_dir(id));
    }

    fn slot(&self, id: &SandboxId) -> Arc<Slot> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots
            .entry(id.clone())
            .or_insert_with(|| {
                Arc::new(Slot {
                    state: Arc::new(RwLock::new(SlotState::default())),
                    last_active: AtomicI64::new(0),
                })
            })
            .clone()
    }

    pub(crate) fn check_running(&self) -> Result<()> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(ControlError::ShuttingDown);
        }
        Ok(())
    }

    // ---------------------------------------------------------------- tenants

    /// Creates a tenant and returns it with its bearer token (shown once; only a hash is kept).
    pub fn create_tenant(&self, id: TenantId, quotas: Quotas) -> Result<(TenantRecord, String)> {
        if id == TenantId::admin() {
            return Err(ControlError::AlreadyExists {
                kind: "tenant",
                id: id.to_string(),
            });
        }
        let secret: String = (0..32)
            .map(|_| format!("{:02x}", rand::random::<u8>()))
            .collect();
        let token = format!("tpr_{id}_{secret}");
        let rec = TenantRecord {
            id: id.clone(),
            created_at: now_millis(),
            quotas,
        };
        if !self.store.insert_tenant(&rec, &token_hash(&token))? {
            return Err(ControlError::AlreadyExists {
                kind: "tenant",
                id: id.to_string(),
            });
        }
        Ok((rec, token))
    }

    pub fn tenants(&self) -> Result<Vec<TenantRecord>> {
        Ok(self.store.tenants()?)
    }

    /// Deletes a tenant that owns nothing any more.
    pub fn delete_tenant(&self, id: &TenantId) -> Result<()> {
        let usage = self.store.usage(id)?;
        if usage.sandboxes > 0 {
            return Err(ControlError::TenantInUse(
                id.to_string(),
                format!("{} sandboxes", usage.sandboxes),
            ));
        }
        let templates = self
            .store
            .templates()?
            .into_iter()
            .filter(|t| t.tenant == *id)
            .count();
        if templates > 0 {
            return Err(ControlError::TenantInUse(
                id.to_string(),
                format!("{templates} templates"),
            ));
        }
        let pools = self.store.count_pools(id)?;
        if pools > 0 {
            return Err(ControlError::TenantInUse(
                id.to_string(),
                format!("{pools} pools"),
            ));
        }
        if !self.store.delete_tenant(id)? {
            return Err(ControlError::NotFound {
                kind: "tenant",
                id: id.to_string(),
            });
        }
        Ok(())
    }

    /// The tenant a (non-admin) bearer token belongs to.
    pub fn tenant_for_token(&self, token: &str) -> Result<Option<TenantId>> {
        Ok(self.store.tenant_by_token_hash(&token_hash(token))?)
    }

    // ---------------------------------------------------------------- templates

    /// Templates the tenant may use: its own and the operator's.
    pub fn templates(&self, tenant: &TenantId) -> Result<Vec<TemplateRecord>> {
        Ok(self
            .store
            .templates()?
            .into_iter()
            .filter(|t| visible(tenant, &t.tenant))
            .collect())
    }

    /// The template `name` means for `tenant`: its own, else the operator's. The admin also
    /// reaches a tenant's template when no operator template has that name and exactly one
    /// tenant does.
    pub fn template(&self, tenant: &TenantId, name: &TemplateName) -> Result<TemplateRecord> {
        let found = match self.store.template_for(tenant, name)? {
            Some(t) => Some(t),
            None if *tenant == TenantId::admin() => {
                let mut all: Vec<_> = self
                    .store
                    .templates()?
                    .into_iter()
                    .filter(|t| t.name == *name)
                    .collect();
                if all.len() == 1 {
                    all.pop()
                } else {
                    None
                }
            }
            None => None,
        };
        match found {
            Some(t) if visible(tenant, &t.tenant) => Ok(t),
            _ => Err(ControlError::NotFound {
                kind: "template",
                id: name.to_string(),
            }),
        }
    }

    /// Builds a template: lays out its root filesystem, boots it once and checkpoints it as its
    /// golden snapshot. `progress` hears each step. A tenant may name host paths only inside
    /// the operator's import directory ([`sources`]).
    pub async fn register_template(
        &self,
        tenant: &TenantId,
        mut spec: TemplateSpec,
        progress: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<TemplateRecord> {
        spec.source = self.check_source(tenant, &spec.source)?;
        let read_from = spec.source.clone();
        self.register_template_checked(tenant, spec, read_from, progress)
            .await
    }

    /// [`Engine::register_template`] once the source is known to be the caller's to read:
    /// `read_from` is what is imported (it differs from `spec.source` for an upload, whose
    /// path on the host is not recorded).
    async fn register_template_checked(
        &self,
        tenant: &TenantId,
        spec: TemplateSpec,
        read_from: TemplateSource,
        progress: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<TemplateRecord> {
        self.check_running()?;
        spec.validate()
            .map_err(|e| ControlError::Invalid(e.to_string()))?;
        self.check_limits_fit(tenant, &spec.limits)?;
        if let Some(gpu) = &spec.gpu {
            crate::gpu::NodeGpus::parse_request(self.gpus.get(), gpu, tenant)?;
        }
        let dir = self.template_dir(tenant, &spec.name);
        let mut rec = TemplateRecord {
            name: spec.name.clone(),
            tenant: tenant.clone(),
            spec,
            status: TemplateStatus::Building,
            rootfs: dir.join("rootfs"),
            mounts: Vec::new(),
            agent_dir: self.node_info.agent_dir.clone(),
            golden_dir: dir.join("golden"),
            golden_bytes: 0,
            created_at: now_millis(),
        };
        // A tenant's template may not shadow an operator's (which every tenant sees, so this
        // tells nothing new): sandboxes name their template by name.
        if *tenant != TenantId::admin()
            && self
                .store
                .template(&TenantId::admin(), &rec.name)?
                .is_some()
        {
            return Err(ControlError::AlreadyExists {
                kind: "template",
                id: rec.name.to_string(),
            });
        }
        {
            // The build takes a worker with the template's limits: charged like a resident
            // sandbox until the record leaves `building`.
            let _quota = self.quota_lock.lock().await;
            self.check_quota(tenant, Charge::template(rec.spec.limits))?;
            if !self.store.insert_template(&rec)? {
                return Err(ControlError::AlreadyExists {
                    kind: "template",
                    id: rec.name.to_string(),
                });
            }
        }
        match self.build_template(&mut rec, read_from, progress).await {
            Ok(()) => Ok(rec),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                self.store.delete_template(&rec.tenant, &rec.name)?;
                Err(e)
            }
        }
    }

    async fn build_template(
        &self,
        rec: &mut TemplateRecord,
        read_from: TemplateSource,
        progress: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<()> {
        let dir = rec
            .rootfs
            .parent()
            .expect("rootfs has a parent")
            .to_path_buf();
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&rec.rootfs)
            .map_err(ControlError::io("cannot create", &rec.rootfs))?;
        match read_from {
            TemplateSource::Host => {
                progress("preparing the host root filesystem");
                rec.mounts = rootfs::prepare_host_rootfs(&rec.rootfs)
                    .map_err(|e| ControlError::Unsupported(e.to_string()))?;
            }
            TemplateSource::Rootfs { path } => {
                if Path::new(&path).is_file() {
                    progress("unpacking the root filesystem archive");
                    let limits = self.unpack_options(&rec.tenant)?.limits;
                    unpack_rootfs_tar(Path::new(&path), &rec.rootfs, limits).await?;
                } else {
                    progress(&format!("copying root filesystem {path}"));
                    copy_tree(Path::new(&path), &rec.rootfs).await?;
                }
                let root = rec.rootfs.clone();
                let stripped =
                    tokio::task::spawn_blocking(move || sources::strip_privileged(&root))
                        .await
                        .map_err(|e| {
                            ControlError::Unsupported(format!("rootfs check failed: {e}"))
                        })?
                        .map_err(ControlError::io("cannot check", &rec.rootfs))?;
                if stripped > 0 {
                    tracing::info!(template = %rec.name, stripped, "setuid/setgid bits and device nodes removed");
                }
                let agent_mount = rec.rootfs.join(".torpor");
                std::fs::create_dir_all(&agent_mount)
                    .map_err(ControlError::io("cannot create", &agent_mount))?;
            }
            TemplateSource::Image { path, reference } => {
                progress(&format!("importing image {path}"));
                let rootfs = rec.rootfs.clone();
                let name = rec.name.to_string();
                let options = self.unpack_options(&rec.tenant)?;
                let config = tokio::task::spawn_blocking(move || {
                    let _ = std::fs::remove_dir(&rootfs);
                    let src = torpor_image::detect(Path::new(&path))?;
                    torpor_image::unpack_with(
                        &src,
                        reference.as_deref(),
                        &rootfs,
                        &options,
                        &mut |p| {
                            tracing::info!(template = %name, progress = ?p, "image import");
                        },
                    )
                })
                .await
                .map_err(|e| {
                    ControlError::Unsupported(format!("image import task failed: {e}"))
                })??;
                apply_image_config(&mut rec.spec, &config);
                let agent_mount = rec.rootfs.join(".torpor");
                std::fs::create_dir_all(&agent_mount)
                    .map_err(ControlError::io("cannot create", &agent_mount))?;
            }
        }
        progress("booting the template");
        let permit = self
            .acquire_worker(&rec.tenant, rec.spec.limits.memory_bytes())
            .await?;
        let launch = Launch {
            container_id: format!("tpl-{}-{:04x}", rec.name, rand::random::<u16>()),
            spec: container_spec(rec, &rec.spec.limits, &rec.spec.env),
            network: None,
            ready_timeout: READY_TIMEOUT,
        };
        let container = self.node.boot(launch).await?;
        if rec.spec.warmup_ms > 0 {
            progress(&format!("warming up for {} ms", rec.spec.warmup_ms));
            tokio::time::sleep(Duration::from_millis(rec.spec.warmup_ms)).await;
        }
        if let Ok((
            Reply::Main {
                running: false,
                exit_code,
                ..
            },
            _,
        )) = container.call(&Request::MainStatus, &[]).await
        {
            if !rec.spec.command.is_empty() {
                container.destroy().await;
                return Err(ControlError::Invalid(format!(
                    "the template's command exited during boot (exit code {exit_code:?})"
                )));
            }
        }
        progress("checkpointing the golden snapshot");
        let tmp = dir.join(".golden.tmp");
        let t = Instant::now();
        let result = container.checkpoint(&tmp).await;
        drop(permit);
        result?;
        commit_image(&tmp, &rec.golden_dir).await?;
        rec.golden_bytes = dir_size(&rec.golden_dir);
        self.metrics
            .checkpoint_seconds
            .with_label_values(&["golden"])
            .observe(t.elapsed().as_secs_f64());
        self.metrics
            .checkpoint_bytes
            .with_label_values(&["golden"])
            .inc_by(rec.golden_bytes);
        rec.status = TemplateStatus::Ready;
        self.store.update_template(rec)?;
        progress("ready");
        Ok(())
    }

    pub async fn delete_template(&self, tenant: &TenantId, name: &TemplateName) -> Result<()> {
        let t = self.template(tenant, name)?;
        if t.tenant != *tenant && *tenant != TenantId::admin() {
            return Err(ControlError::NotFound {
                kind: "template",
                id: name.to_string(),
            });
        }
        let n = self.store.count_sandboxes_of_template(&t.tenant, name)?;
        if n > 0 {
            return Err(ControlError::TemplateInUse(name.to_string(), n));
        }
        self.store.delete_template(&t.tenant, name)?;
        self.template_sizes.forget(&t.tenant, name);
        let _ = std::fs::remove_dir_all(t.rootfs.parent().unwrap_or(&t.rootfs));
        Ok(())
    }

    // ---------------------------------------------------------------- sandboxes

    pub fn sandboxes(&self, tenant: &TenantId) -> Result<Vec<SandboxRecord>> {
        // Only what the caller owns: the operator's sandboxes are not a tenant's to see.
        let mut all = self.store.sandboxes()?;
        all.retain(|s| owns(tenant, &s.tenant));
        for s in &mut all {
            self.fresh_activity(s);
        }
        Ok(all)
    }

    /// A sandbox the tenant owns; another tenant's answers NotFound, so existence is not leaked.
    pub fn sandbox(&self, tenant: &TenantId, id: &SandboxId) -> Result<SandboxRecord> {
        match self.store.sandbox(id)? {
            Some(mut s) if owns(tenant, &s.tenant) => {
                self.fresh_activity(&mut s);
                Ok(s)
            }
            _ => Err(not_found(id)),
        }
    }

    fn fresh_activity(&self, s: &mut SandboxRecord) {
        let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = slots.get(&s.id) {
            s.last_active_at = s
                .last_active_at
                .max(slot.last_active.load(Ordering::Relaxed));
        }
    }

    pub async fn create_sandbox(
        &self,
        tenant: &TenantId,
        req: CreateSandbox,
    ) -> Result<SandboxRecord> {
        self.check_running()?;
        let tpl = self.template(tenant, &req.template)?;
        if tpl.status != TemplateStatus::Ready {
            return Err(ControlError::TemplateNotReady(tpl.name.to_string()));
        }
        let limits = tpl
            .spec
            .limits
            .patched(&req.limits)
            .map_err(|e| ControlError::Invalid(e.to_string()))?;
        self.check_limits_fit(tenant, &limits)?;
        validate_env(&req.env).map_err(|e| ControlError::Invalid(e.to_string()))?;
        check_metadata(&req.metadata)?;
        let gpu_request = match req.gpu.as_ref().or(tpl.spec.gpu.as_ref()) {
            Some(gpu) => Some(crate::gpu::NodeGpus::parse_request(
                self.gpus.get(),
                gpu,
                tenant,
            )?),
            None => None,
        };
        // The sandbox's own policy, else its template's.
        let network = net::check_policy(req.network.as_ref(), &tpl)?;
        let now = now_millis();
        let mut rec = SandboxRecord {
            id: SandboxId::generate(),
            tenant: tenant.clone(),
            template: tpl.name.clone(),
            state: SandboxState::Creating,
            tier: Tier::Running,
            limits,
            env: req.env,
            metadata: req.metadata,
            created_at: now,
            last_active_at: now,
            generation: 1,
            image: ImageRef::Golden,
            last_error: None,
            oom_killed: false,
        };
        {
            let _quota = self.quota_lock.lock().await;
            self.check_quota(tenant, Charge::sandbox(rec.limits))?;
            self.store.insert_sandbox(&rec)?;
            if let Some(policy) = &network {
                self.store.set_network(&rec.id, policy)?;
            }
        }
        let permit = match self.acquire_worker(tenant, rec.limits.memory_bytes()).await {
            Ok(p) => p,
            Err(e) => {
                self.store.delete_sandbox(&rec.id)?;
                return Err(e);
            }
        };
        if let Err(e) = self.acquire_gpu(&rec.id, gpu_request.as_ref()).await {
            self.forget_gpu(&rec.id);
            self.store.delete_sandbox(&rec.id)?;
            return Err(e);
        }
        let slot = self.slot(&rec.id);
        let mut guard = slot.state.clone().write_owned().await;
        let t = Instant::now();
        match self
            .restore_container(&rec, &tpl, &tpl.golden_dir, true)
            .await
        {
            Ok(container) => {
                rec.state = SandboxState::Running;
                self.store.update_sandbox(&rec)?;
                self.install_live(&mut guard, &rec, container, permit);
                slot.touch();
                self.metrics
                    .wake_seconds
                    .with_label_values(&["golden"])
                    .observe(t.elapsed().as_secs_f64());
                Ok(rec)
            }
            Err(e) => {
                self.forget_gpu(&rec.id);
                self.store.delete_sandbox(&rec.id)?;
                self.remove_sandbox_files(&rec.id);
                self.slots
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&rec.id);
                Err(e)
            }
        }
    }

    /// Restores a container for `rec` from `image` on a warm worker and waits until its agent
    /// answers.
    async fn restore_container(
        &self,
        rec: &SandboxRecord,
        tpl: &TemplateRecord,
        image: &Path,
        configure: bool,
    ) -> Result<Box<dyn Resident>> {
        let gpu = self.gpu_runtime(&rec.id)?;
        let mut spec = container_spec(tpl, &rec.limits, &tpl.spec.env);
        spec.devices = gpu.devices;
        spec.mounts.extend(gpu.mounts);
        let networked = self.store.network(&rec.id)?;
        let launch = Launch {
            container_id: rec.container_id(),
            spec,
            network: networked.clone(),
            ready_timeout: READY_TIMEOUT,
        };
        let container = self.node.restore(launch, image).await?;
        self.metrics
            .warm_takes
            .with_label_values(&[if container.was_warm() { "warm" } else { "cold" }])
            .inc();
        let ready = async {
            self.gpu_cuda_resume(&rec.id, &*container).await?;
            if configure {
                container
                    .call(
                        &Request::Configure {
                            env: rec.env.clone(),
                        },
                        &[],
                    )
                    .await?;
                if networked.is_some() {
                    net::write_resolv_conf(&*container).await?;
                }
            }
            Ok::<_, ControlError>(())
        }
        .await;
        if let Err(e) = ready {
            container.destroy().await;
            return Err(e);
        }
        Ok(container)
    }

    fn install_live(
        &self,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
        rec: &SandboxRecord,
        resident: Box<dyn Resident>,
        permit: WorkerPermit,
    ) {
        tracing::debug!(sandbox = %rec.id, container = resident.id(), worker = resident.worker(), "resident");
        guard.live = Some(Live {
            resident,
            _permit: permit,
            frozen: false,
        });
        self.metrics.workers_busy.set(self.workers.busy() as i64);
    }

    /// Sends a sandbox back to its last snapshot when the node reports that its container
    /// died on its own.
    async fn watch_node(self: Arc<Self>, mut events: mpsc::UnboundedReceiver<NodeEvent>) {
        while let Some(event) = events.recv().await {
            let NodeEvent::Exited {
                container_id,
                info,
                expected,
            } = event;
            if expected {
                continue;
            }
            let Some(id) = sandbox_of(&container_id).and_then(|s| SandboxId::new(s).ok()) else {
                continue; // a template build's container: its build reports the failure
            };
            let engine = self.clone();
            tokio::spawn(async move {
                engine
                    .on_crash(&id, &container_id, &crash_reason(&info), info.oom_killed)
                    .await;
            });
        }
    }

    async fn on_crash(&self, id: &SandboxId, cid: &str, reason: &str, oom: bool) {
        let slot = self.slot(id);
        let mut guard = slot.state.clone().write_owned().await;
        let same = guard.live.as_ref().is_some_and(|l| l.resident.id() == cid);
        if !same {
            return;
        }
        let live = guard.live.take().expect("checked above");
        tracing::warn!(sandbox = %id, container = %cid, reason, log = %self.node.log_tail(cid), "sandbox crashed; back to its last snapshot");
        live.resident.destroy().await;
        self.release_gpu(id);
        self.metrics
            .crashes
            .with_label_values(&[if oom { "oom_killed" } else { "exited" }])
            .inc();
        self.metrics.workers_busy.set(self.workers.busy() as i64);
        if let Ok(Some(mut rec)) = self.store.sandbox(id) {
            rec.state = rec.image.sleeping_state();
            rec.tier = rec.image.sleeping_tier();
            rec.last_error = Some(format!("{reason}; restored to its last snapshot"));
            rec.oom_killed = oom;
            if let Err(e) = self.store.update_sandbox(&rec) {
                tracing::error!(sandbox = %id, error = %e, "cannot record a crash");
            }
        }
    }

    /// A worker for `tenant`'s sandbox. When none is free, the least recently active idle
    /// sandbox is parked to free one, and the call waits in the lot (fair across tenants) up to
    /// the configured budget.
    async fn acquire_worker(&self, tenant: &TenantId, memory: u64) -> Result<WorkerPermit> {
        self.make_room(memory).await;
        if let Some(p) = self.workers.try_acquire() {
            return Ok(p);
        }
        self.metrics.lot_parked.inc();
        self.evictor.wanting.fetch_add(1, Ordering::SeqCst);
        self.evictor.poke();
        let result = self.workers.acquire(tenant, self.cfg.worker_wait).await;
        self.evictor.wanting.fetch_sub(1, Ordering::SeqCst);
        self.metrics.lot_parked.dec();
        match result {
            Ok((permit, parked)) => {
                if let Parked::Waited(d) = parked {
                    self.metrics
                        .lot_wait_seconds
                        .with_label_values(&["worker"])
                        .observe(d.as_secs_f64());
                }
                Ok(permit)
            }
            Err(LotError::Full) => {
                self.metrics
                    .lot_rejections
                    .with_label_values(&["lot_full"])
                    .inc();
                Err(ControlError::LotFull(self.workers.capacity()))
            }
            Err(LotError::Timeout) => {
                self.metrics
                    .lot_rejections
                    .with_label_values(&["no_worker_available"])
                    .inc();
                self.metrics
                    .lot_wait_seconds
                    .with_label_values(&["timeout"])
                    .observe(self.cfg.worker_wait.as_secs_f64());
                Err(ControlError::NoWorker(
                    self.cfg.worker_wait.as_millis() as u64
                ))
            }
        }
    }

    /// Bytes charged to the memory cgroups of every resident sandbox.
    pub fn resident_memory(&self) -> u64 {
        let slots: Vec<Arc<Slot>> = {
            let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            slots.values().cloned().collect()
        };
        slots
            .iter()
            .filter_map(|slot| {
                let guard = slot.state.try_read().ok()?;
                guard.live.as_ref()?.resident.memory()
            })
            .sum()
    }

    /// Parks least recently active sandboxes (Frozen first, then idle Running) until resident
    /// memory plus `incoming` bytes fits the node's memory budget. A burst never overcommits
    /// the node: a wake makes room before it restores.
    async fn make_room(&self, incoming: u64) {
        let Some(budget) = self.cfg.memory_budget else {
            return;
        };
        for _ in 0..self.cfg.workers {
            if self.resident_memory() + incoming <= budget {
                return;
            }
            if !self.evict_one("memory_pressure").await {
                return;
            }
        }
    }

    /// Workers: how many, how many hold a sandbox, how many calls wait.
    pub fn worker_stats(&self) -> WorkerStats {
        let warm = self.node.warm_stats();
        WorkerStats {
            memory_budget_bytes: self.cfg.memory_budget,
            resident_memory_bytes: self.resident_memory(),
            total: self.workers.total(),
            busy: self.workers.busy(),
            free: self.workers.free(),
            parked_calls: self.workers.parked(),
            lot_capacity: self.workers.capacity(),
            park_budget_ms: self.cfg.worker_wait.as_millis() as u64,
            warm_pool_size: warm.target,
            warm_ready: warm.ready,
            warm_takes: warm.warm_takes,
            cold_takes: warm.cold_takes,
        }
    }

    /// Parks the least recently active resident sandbox that no call is using. Frozen ones go
    /// first, then idle running ones.
    async fn evict_one(&self, reason: &str) -> bool {
        let Some((id, mut guard)) = self.pick_victim() else {
            return false;
        };
        self.evict(&id, &mut guard, reason).await
    }

    async fn evict(
        &self,
        id: &SandboxId,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
        reason: &str,
    ) -> bool {
        tracing::info!(sandbox = %id, reason, "parking to make room");
        match self.park_locked(guard, id, "evicted").await {
            Ok(()) => {
                self.metrics.evictions.with_label_values(&[reason]).inc();
                true
            }
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "eviction failed");
                false
            }
        }
    }

    /// The least recently active resident sandbox that no call is using, locked: Frozen ones
    /// first, then idle running ones.
    fn pick_victim(&self) -> Option<(SandboxId, OwnedRwLockWriteGuard<SlotState>)> {
        let candidates: Vec<(SandboxId, Arc<Slot>)> = {
            let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            slots.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        let mut best: Option<(bool, i64, SandboxId, OwnedRwLockWriteGuard<SlotState>)> = None;
        for (id, slot) in candidates {
            let Ok(guard) = slot.state.clone().try_write_owned() else {
                continue;
            };
            let Some(live) = &guard.live else { continue };
            let key = (!live.frozen, slot.last_active.load(Ordering::Relaxed));
            if best.as_ref().is_none_or(|b| key < (b.0, b.1)) {
                best = Some((key.0, key.1, id, guard));
            }
        }
        best.map(|(_, _, id, guard)| (id, guard))
    }

    /// The eviction task (see [`Evictor`]).
    async fn run_evictor(self: Arc<Self>) {
        loop {
            self.evictor.wake.notified().await;
            if self.shutting_down.load(Ordering::SeqCst) {
                return;
            }
            while self.evictor.needed() {
                let Some((id, mut guard)) = self.pick_victim() else {
                    break; // every resident sandbox is in a call: the next call's end pokes us
                };
                self.evictor.in_flight.fetch_add(1, Ordering::SeqCst);
                let engine = self.clone();
                tokio::spawn(async move {
                    engine.evict(&id, &mut guard, "parked_calls").await;
                    drop(guard);
                    engine.evictor.in_flight.fetch_sub(1, Ordering::SeqCst);
                    engine.evictor.wake.notify_one();
                });
            }
        }
    }

    /// Borrows a running sandbox for one call, waking it first if it sleeps.
    pub async fn use_sandbox(&self, tenant: &TenantId, id: &SandboxId) -> Result<InUse> {
        self.sandbox(tenant, id)?;
        let slot = self.slot(id);
        loop {
            {
                let guard = slot.state.clone().read_owned().await;
                if let Some(live) = &guard.live {
                    if !live.frozen && live.resident.alive() {
                        slot.touch();
                        return Ok(InUse {
                            guard,
                            slot: slot.clone(),
                            id: id.clone(),
                            evictor: self.evictor.clone(),
                        });
                    }
                }
            }
            self.check_running()?;
            let mut guard = slot.state.clone().write_owned().await;
            let Some(mut rec) = self.store.sandbox(id)? else {
                return Err(not_found(id));
            };
            let live_state = guard.live.as_ref().map(|l| (l.frozen, !l.resident.alive()));
            match live_state {
                Some((_, true)) => {
                    // Its container died; the crash watch is about to record it. Let it.
                    drop(guard);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                Some((true, false)) => {
                    let t = Instant::now();
                    let live = guard.live.as_mut().expect("checked");
                    live.resident.set_frozen(false).await?;
                    live.frozen = false;
                    rec.state = SandboxState::Running;
                    rec.tier = Tier::Running;
                    self.store.update_sandbox(&rec)?;
                    self.metrics
                        .wake_seconds
                        .with_label_values(&["frozen"])
                        .observe(t.elapsed().as_secs_f64());
                }
                Some((false, false)) => {}
                None => self.wake_locked(&mut guard, rec).await?,
            }
            slot.touch();
            return Ok(InUse {
                guard: guard.downgrade(),
                slot: slot.clone(),
                id: id.clone(),
                evictor: self.evictor.clone(),
            });
        }
    }

    async fn wake_locked(
        &self,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
        mut rec: SandboxRecord,
    ) -> Result<()> {
        let from = rec.tier;
        rec.state
            .check_transition(SandboxState::Resuming)
            .map_err(|e| ControlError::InvalidTransition {
                from: e.from,
                to: Tier::Running,
            })?;
        let t = Instant::now();
        let tpl = self
            .store
            .template_for(&rec.tenant, &rec.template)?
            .ok_or_else(|| ControlError::NotFound {
                kind: "template",
                id: rec.template.to_string(),
            })?;
        let previous = rec.state;
        {
            let _quota = self.quota_lock.lock().await;
            self.check_quota(&rec.tenant, Charge::wake(rec.limits))?;
            rec.state = SandboxState::Resuming;
            rec.generation += 1;
            self.store.update_sandbox(&rec)?;
        }
        let permit = match self
            .acquire_worker(&rec.tenant, rec.limits.memory_bytes())
            .await
        {
            Ok(p) => p,
            Err(e) => {
                rec.state = previous;
                self.store.update_sandbox(&rec)?;
                return Err(e);
            }
        };
        if let Err(e) = self.acquire_gpu(&rec.id, None).await {
            rec.state = previous;
            rec.last_error = Some(format!("wake failed: {e}"));
            self.store.update_sandbox(&rec)?;
            return Err(e);
        }
        // A Suspended checkpoint is fetched (every chunk verified) next to the parked ones.
        let fetched = self
            .sandbox_dir(&rec.id)
            .join("images")
            .join(format!(".tmp-fetch-{}", rec.generation));
        let image = match &rec.image {
            ImageRef::Golden => tpl.golden_dir.clone(),
            ImageRef::Local(p) => p.clone(),
            ImageRef::Store(snapshot) => {
                let _ = std::fs::remove_dir_all(&fetched);
                if let Err(e) = self.snapshots.fetch(&rec.tenant, snapshot, &fetched).await {
                    self.release_gpu(&rec.id);
                    rec.state = previous;
                    rec.last_error = Some(format!("wake failed: {e}"));
                    self.store.update_sandbox(&rec)?;
                    return Err(e);
                }
                fetched.clone()
            }
        };
        let golden = rec.image == ImageRef::Golden;
        let restored = self.restore_container(&rec, &tpl, &image, golden).await;
        // The restore has read the image; the store keeps the committed copy.
        let _ = std::fs::remove_dir_all(&fetched);
        match restored {
            Ok(container) => {
                rec.state = SandboxState::Running;
                rec.tier = Tier::Running;
                self.store.update_sandbox(&rec)?;
                self.install_live(guard, &rec, container, permit);
                self.metrics
                    .wake_seconds
                    .with_label_values(&[from.as_str()])
                    .observe(t.elapsed().as_secs_f64());
                Ok(())
            }
            Err(e) => {
                self.release_gpu(&rec.id);
                rec.state = previous;
                rec.last_error = Some(format!("wake failed: {e}"));
                self.store.update_sandbox(&rec)?;
                Err(e)
            }
        }
    }

    /// Freezes a running sandbox (cgroup freezer): its memory stays, its CPU use drops to 0.
    async fn freeze_locked(
        &self,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
        id: &SandboxId,
        cause: &str,
    ) -> Result<()> {
        let Some(live) = guard.live.as_mut() else {
            return Ok(());
        };
        if live.frozen {
            return Ok(());
        }
        live.resident.set_frozen(true).await?;
        live.frozen = true;
        if let Some(mut rec) = self.store.sandbox(id)? {
            rec.state = SandboxState::Frozen;
            rec.tier = Tier::Frozen;
            self.store.update_sandbox(&rec)?;
        }
        self.metrics
            .transitions
            .with_label_values(&["frozen", cause])
            .inc();
        Ok(())
    }

    /// Checkpoints a resident sandbox to this node's disk and releases its worker.
    async fn park_locked(
        &self,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
        id: &SandboxId,
        cause: &str,
    ) -> Result<()> {
        let mut cuda_toggled = None;
        if let Some(live) = guard.live.as_ref() {
            let cuda_tool = self.gpu_checkpoint_gate(id, live.resident.id())?;
            if let (Some(tool), Some(gpus)) = (cuda_tool, self.gpus.get()) {
                cuda_toggled = Some(gpus.cuda_suspend(&*live.resident, tool).await?);
            }
        }
        let Some(live) = guard.live.take() else {
            return Ok(());
        };
        let Some(mut rec) = self.store.sandbox(id)? else {
            return Err(not_found(id));
        };
        let _slot = self.checkpoints.clone().acquire_owned().await;
        rec.state = SandboxState::Checkpointing;
        self.store.update_sandbox(&rec)?;
        let images = self.sandbox_dir(id).join("images");
        let tmp = images.join(format!(".tmp-{}", rec.generation));
        let dest = images.join(rec.generation.to_string());
        let _ = std::fs::remove_dir_all(&tmp);
        let t = Instant::now();
        let Live {
            resident, _permit, ..
        } = live;
        resident.settle_connections().await;
        let result = resident.checkpoint(&tmp).await;
        self.gpu_after_checkpoint(id, cuda_toggled, result.is_ok());
        drop(_permit);
        self.release_gpu(id);
        self.metrics.workers_busy.set(self.workers.busy() as i64);
        match result {
            Ok(()) => {
                // Durable before the record points at it; the old image goes only after.
                if let Err(e) = commit_image(&tmp, &dest).await {
                    rec.state = rec.image.sleeping_state();
                    rec.tier = rec.image.sleeping_tier();
                    rec.last_error = Some(
                        "checkpoint could not be stored durably; back to its last snapshot".into(),
                    );
                    self.store.update_sandbox(&rec)?;
                    return Err(e);
                }
                let old = std::mem::replace(&mut rec.image, ImageRef::Local(dest.clone()));
                rec.state = SandboxState::Parked;
                rec.tier = Tier::Parked;
                self.store.update_sandbox(&rec)?;
                self.remove_image(&rec.tenant, &old).await;
                let bytes = dir_size(&dest);
                self.metrics
                    .checkpoint_seconds
                    .with_label_values(&["ok"])
                    .observe(t.elapsed().as_secs_f64());
                self.metrics
                    .checkpoint_bytes
                    .with_label_values(&["sandbox"])
                    .inc_by(bytes);
                self.metrics
                    .transitions
                    .with_label_values(&["parked", cause])
                    .inc();
                Ok(())
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp);
                self.metrics
                    .checkpoint_seconds
                    .with_label_values(&["failed"])
                    .observe(t.elapsed().as_secs_f64());
                rec.state = rec.image.sleeping_state();
                rec.tier = rec.image.sleeping_tier();
                rec.last_error = Some(format!("checkpoint failed, back to its last snapshot: {e}"));
                self.store.update_sandbox(&rec)?;
                Err(e.into())
            }
        }
    }

    /// Moves a parked sandbox's checkpoint into the snapshot store.
    async fn upload_locked(&self, id: &SandboxId, cause: &str) -> Result<()> {
        let Some(mut rec) = self.store.sandbox(id)? else {
            return Err(not_found(id));
        };
        if rec.state == SandboxState::Suspended {
            return Ok(());
        }
        rec.state
            .check_transition(SandboxState::Uploading)
            .map_err(|e| ControlError::InvalidTransition {
                from: e.from,
                to: Tier::Suspended,
            })?;
        rec.state = SandboxState::Uploading;
        self.store.update_sandbox(&rec)?;
        let source = match &rec.image {
            ImageRef::Local(p) => p.clone(),
            ImageRef::Golden => {
                self.store
                    .template_for(&rec.tenant, &rec.template)?
                    .ok_or_else(|| ControlError::NotFound {
                        kind: "template",
                        id: rec.template.to_string(),
                    })?
                    .golden_dir
            }
            ImageRef::Store(_) => {
                // Already in the store (a sandbox that fell back to its stored snapshot).
                rec.state = SandboxState::Suspended;
                rec.tier = Tier::Suspended;
                self.store.update_sandbox(&rec)?;
                return Ok(());
            }
        };
        let t = Instant::now();
        // The manifest is the commit marker: until put_dir returns, the store holds no
        // snapshot for this checkpoint, and the local image stays the sandbox's.
        // The store's futures run in their own task: their internal borrows stay out of the
        // API handlers' futures (which must be Send for any lifetime).
        let labels = vec![(
            torpor_snapshot::store::LABEL_SANDBOX.to_string(),
            id.to_string(),
        )];
        match self.snapshots.put(&rec.tenant, labels, source).await {
            Ok(report) => {
                self.store
                    .set_snapshot_bytes(report.id.as_str(), report.stats.input_bytes)?;
                let old = std::mem::replace(&mut rec.image, ImageRef::Store(report.id.to_string()));
                rec.state = SandboxState::Suspended;
                rec.tier = Tier::Suspended;
                self.store.update_sandbox(&rec)?;
                self.remove_image(&rec.tenant, &old).await;
                self.metrics
                    .checkpoint_bytes
                    .with_label_values(&["store_new"])
                    .inc_by(report.stats.bytes_written);
                self.metrics
                    .transitions
                    .with_label_values(&["suspended", cause])
                    .inc();
                tracing::info!(sandbox = %id, snapshot = %report.id, ms = t.elapsed().as_millis() as u64,
                    written = report.stats.bytes_written, "checkpoint in the snapshot store");
                Ok(())
            }
            Err(e) => {
                rec.state = SandboxState::Parked;
                rec.last_error = Some(format!("upload failed, still parked on this node: {e}"));
                self.store.update_sandbox(&rec)?;
                Err(e)
            }
        }
    }

    /// Removes a superseded checkpoint: a local image directory, or a snapshot in the store.
    async fn remove_image(&self, tenant: &TenantId, image: &ImageRef) {
        match image {
            ImageRef::Golden => {}
            ImageRef::Local(p) => {
                let _ = std::fs::remove_dir_all(p);
            }
            ImageRef::Store(snapshot) => {
                if let Err(e) = self.store.forget_snapshot_bytes(snapshot) {
                    tracing::warn!(snapshot, error = %e, "cannot forget a snapshot's size");
                }
                self.snapshots.retire(tenant, snapshot).await
            }
        }
    }

    /// Puts a sandbox to sleep down to `tier` (explicit suspend).
    pub async fn suspend(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        tier: Tier,
    ) -> Result<SandboxRecord> {
        self.sandbox(tenant, id)?;
        let slot = self.slot(id);
        let mut guard =
            tokio::time::timeout(self.cfg.drain_timeout, slot.state.clone().write_owned())
                .await
                .map_err(|_| {
                    ControlError::Busy(format!(
                        "sandbox {id} still has calls in flight (execs, proxied requests or an \
                         open WebSocket) after {} ms; nothing was cut, retry later",
                        self.cfg.drain_timeout.as_millis()
                    ))
                })?;
        let current = self.store.sandbox(id)?.ok_or_else(|| not_found(id))?;
        let refused = || ControlError::InvalidTransition {
            from: current.state,
            to: tier,
        };
        if current.tier > tier {
            return Err(refused());
        }
        match tier {
            Tier::Running => return Err(refused()),
            Tier::Frozen => self.freeze_locked(&mut guard, id, "api").await?,
            Tier::Parked => self.park_locked(&mut guard, id, "api").await?,
            Tier::Suspended => {
                self.park_locked(&mut guard, id, "api").await?;
                self.upload_locked(id, "api").await?;
            }
        }
        drop(guard);
        self.sandbox(tenant, id)
    }

    /// Makes `count` new sandboxes from `id`'s latest snapshot, without copying: the snapshot
    /// goes into the store (deduplicated), and each fork is a manifest sharing its chunks. A
    /// resident source is parked first. The forks are Suspended; their first call wakes them.
    pub async fn fork(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        count: usize,
    ) -> Result<Vec<SandboxRecord>> {
        self.check_running()?;
        if !(1..=MAX_FORKS).contains(&count) {
            return Err(ControlError::Invalid(format!(
                "count must be between 1 and {MAX_FORKS}"
            )));
        }
        self.sandbox(tenant, id)?;
        let slot = self.slot(id);
        let mut guard = slot.state.clone().write_owned().await;
        if guard.live.is_some() {
            self.park_locked(&mut guard, id, "fork").await?;
        }
        let source = self.store.sandbox(id)?.ok_or_else(|| not_found(id))?;
        let snapshot = match &source.image {
            ImageRef::Store(s) => torpor_snapshot::SnapshotId::new(s.as_str())
                .map_err(|e| ControlError::Snapshot(format!("snapshot id {s:?}: {e}")))?,
            ImageRef::Local(dir) => self.put_snapshot(&source.tenant, id, dir.clone()).await?,
            ImageRef::Golden => {
                let tpl = self
                    .store
                    .template_for(&source.tenant, &source.template)?
                    .ok_or_else(|| ControlError::NotFound {
                        kind: "template",
                        id: source.template.to_string(),
                    })?;
                let golden = self
                    .snapshots
                    .golden(
                        &source.tenant,
                        tpl.name.as_str(),
                        tpl.created_at,
                        tpl.golden_dir,
                    )
                    .await?;
                self.store
                    .set_snapshot_bytes(golden.as_str(), tpl.golden_bytes)?;
                golden
            }
        };
        // Each fork is charged what its source's snapshot holds (quotas count before
        // deduplication).
        let snapshot_bytes = self.store.snapshot_bytes(snapshot.as_str())?;
        drop(guard);
        let ids = self.snapshots.fork(&source.tenant, snapshot, count).await?;
        let mut forks = Vec::with_capacity(count);
        for snap in ids {
            let now = now_millis();
            let mut metadata = source.metadata.clone();
            metadata.insert("forked_from".into(), source.id.to_string());
            let rec = SandboxRecord {
                id: SandboxId::generate(),
                tenant: source.tenant.clone(),
                template: source.template.clone(),
                state: SandboxState::Suspended,
                tier: Tier::Suspended,
                limits: source.limits,
                env: source.env.clone(),
                metadata,
                created_at: now,
                last_active_at: now,
                generation: source.generation,
                image: ImageRef::Store(snap.to_string()),
                last_error: None,
                oom_killed: false,
            };
            self.store
                .set_snapshot_bytes(snap.as_str(), snapshot_bytes)?;
            let inserted = {
                let _quota = self.quota_lock.lock().await;
                self.check_quota(
                    &rec.tenant,
                    Charge {
                        sandboxes: 1,
                        ..Charge::default()
                    },
                )
                .and_then(|()| Ok(self.store.insert_sandbox(&rec)?))
            };
            if let Err(e) = inserted {
                // Forks made so far stay; the rest of the snapshots are dropped.
                self.remove_image(&rec.tenant, &rec.image).await;
                if forks.is_empty() {
                    return Err(e);
                }
                tracing::warn!(sandbox = %id, made = forks.len(), error = %e, "fork stopped early");
                break;
            }
            self.copy_gpu_request(id, &rec.id);
            // A fork of a networked sandbox is networked, with the same policy.
            if let Some(policy) = self.store.network(id)? {
                self.store.set_network(&rec.id, &policy)?;
            }
            forks.push(rec);
        }
        Ok(forks)
    }

    /// Puts a checkpoint directory into the snapshot store.
    async fn put_snapshot(
        &self,
        tenant: &TenantId,
        sandbox: &SandboxId,
        dir: PathBuf,
    ) -> Result<torpor_snapshot::SnapshotId> {
        let labels = vec![(
            torpor_snapshot::store::LABEL_SANDBOX.to_string(),
            sandbox.to_string(),
        )];
        let report = self.snapshots.put(tenant, labels, dir).await?;
        self.store
            .set_snapshot_bytes(report.id.as_str(), report.stats.input_bytes)?;
        self.metrics
            .checkpoint_bytes
            .with_label_values(&["store_new"])
            .inc_by(report.stats.bytes_written);
        Ok(report.id)
    }

    /// Wakes a sandbox to Running without running anything in it.
    pub async fn resume(&self, tenant: &TenantId, id: &SandboxId) -> Result<SandboxRecord> {
        drop(self.use_sandbox(tenant, id).await?);
        self.sandbox(tenant, id)
    }

    /// Sets (`Some`) or removes (`None`) metadata keys of a sandbox; answers the new record.
    pub fn patch_sandbox_metadata(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        patch: &BTreeMap<String, Option<String>>,
    ) -> Result<SandboxRecord> {
        let mut rec = self.sandbox(tenant, id)?;
        for (k, v) in patch {
            match v {
                Some(v) => rec.metadata.insert(k.clone(), v.clone()),
                None => rec.metadata.remove(k),
            };
        }
        self.store.set_sandbox_metadata(id, &rec.metadata)?;
        Ok(rec)
    }

    pub async fn delete_sandbox(&self, tenant: &TenantId, id: &SandboxId) -> Result<()> {
        let seen = self.sandbox(tenant, id)?;
        let slot = self.slot(id);
        // Calls in flight hold the sandbox (a command that never ends, an open WebSocket).
        // A delete does not wait on them without bound: after a short grace it destroys the
        // container, which ends those calls, and then takes the sandbox.
        let mut guard = match tokio::time::timeout(DELETE_GRACE, slot.state.clone().write_owned())
            .await
        {
            Ok(g) => g,
            Err(_) => {
                tracing::info!(sandbox = %id, "delete cuts the calls still in flight");
                self.node.kill(&seen.container_id()).await;
                tokio::time::timeout(DELETE_CUT_WAIT, slot.state.clone().write_owned())
                    .await
                    .map_err(|_| {
                        ControlError::Busy(
                            "the sandbox's calls did not end after its container was destroyed; retry the delete"
                                .into(),
                        )
                    })?
            }
        };
        let Some(mut rec) = self.store.sandbox(id)? else {
            return Err(not_found(id));
        };
        rec.state = SandboxState::Deleting;
        self.store.update_sandbox(&rec)?;
        if let Some(live) = guard.live.take() {
            live.resident.destroy().await;
        }
        self.forget_gpu(id);
        self.remove_image(&rec.tenant, &rec.image).await;
        self.snapshots
            .forget_sandbox(&rec.tenant, id.as_str())
            .await;
        self.remove_sandbox_files(id);
        self.store.delete_sandbox(id)?;
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        self.metrics.workers_busy.set(self.workers.busy() as i64);
        Ok(())
    }

    // ---------------------------------------------------------------- exec and files

    pub async fn exec(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        req: ExecRequest,
        stdin: Vec<u8>,
    ) -> Result<ExecResult> {
        check_exec(&req)?;
        let in_use = self.use_sandbox(tenant, id).await?;
        let t = Instant::now();
        let timeout_ms = req.timeout_ms;
        let detach = req.detach;
        let mut rx = in_use
            .resident()
            .send(
                &Request::Exec(ExecRequest {
                    stream: false,
                    env: self.gpu_env(id, req.env.clone()),
                    ..req
                }),
                &stdin,
            )
            .await
            .map_err(torpor_runtime::RuntimeError::from)?;
        let reply = rx.recv().await;
        let result = match reply {
            Some((reply, body)) => exec_reply(reply, body, timeout_ms, detach),
            None => Err(self.died_during_call(in_use).await),
        };
        self.metrics
            .exec_seconds
            .with_label_values(&[if result.is_ok() { "ok" } else { "error" }])
            .observe(t.elapsed().as_secs_f64());
        match result {
            // A program that cannot be started answers like a shell would.
            Err(ControlError::Agent {
                code: code @ (AgentErrorCode::NotFound | AgentErrorCode::PermissionDenied),
                message,
            }) => Ok(ExecResult {
                exit_code: Some(if code == AgentErrorCode::NotFound {
                    127
                } else {
                    126
                }),
                signal: None,
                stdout: String::new(),
                stderr: format!("{message}\n"),
                oom_killed: false,
                duration_ms: t.elapsed().as_secs_f64() * 1000.0,
            }),
            Err(ControlError::SandboxCrashed { reason }) if reason == "oom_killed" => {
                Ok(ExecResult {
                    exit_code: Some(137),
                    signal: Some(9),
                    stdout: String::new(),
                    stderr: String::new(),
                    oom_killed: true,
                    duration_ms: t.elapsed().as_secs_f64() * 1000.0,
                })
            }
            other => other,
        }
    }

    /// Runs a command and streams its output as events; the last event is Exit or Error.
    pub async fn exec_stream(
        self: &Arc<Self>,
        tenant: &TenantId,
        id: &SandboxId,
        req: ExecRequest,
        stdin: Vec<u8>,
    ) -> Result<mpsc::Receiver<ExecEvent>> {
        check_exec(&req)?;
        if req.detach {
            return Err(ControlError::Invalid(
                "detach and stream do not go together".into(),
            ));
        }
        let in_use = self.use_sandbox(tenant, id).await?;
        let timeout_ms = req.timeout_ms;
        let mut rx = in_use
            .resident()
            .send(
                &Request::Exec(ExecRequest {
                    stream: true,
                    env: self.gpu_env(id, req.env.clone()),
                    ..req
                }),
                &stdin,
            )
            .await
            .map_err(torpor_runtime::RuntimeError::from)?;
        let (tx, out) = mpsc::channel(64);
        let engine = self.clone();
        // Each chunk is handed on as it comes and not kept: a slow reader holds the channel
        // full, which holds the agent connection's reader, which holds the command's pipe.
        tokio::spawn(async move {
            loop {
                let event = match rx.recv().await {
                    Some((Reply::Output { fd }, body)) => {
                        let data = String::from_utf8_lossy(&body).into_owned();
                        if fd == 1 {
                            ExecEvent::Stdout { data }
                        } else {
                            ExecEvent::Stderr { data }
                        }
                    }
                    Some((reply, body)) => {
                        let ev = match exec_reply(reply, body, timeout_ms, false) {
                            Ok(r) => ExecEvent::Exit(r),
                            Err(e) => ExecEvent::Error {
                                code: e.code().into(),
                                message: e.to_string(),
                            },
                        };
                        let _ = tx.send(ev).await;
                        break;
                    }
                    None => {
                        let e = engine.died_during_call(in_use).await;
                        let ev = match &e {
                            ControlError::SandboxCrashed { reason } if reason == "oom_killed" => {
                                ExecEvent::Exit(ExecResult {
                                    exit_code: Some(137),
                                    signal: Some(9),
                                    stdout: String::new(),
                                    stderr: String::new(),
                                    oom_killed: true,
                                    duration_ms: 0.0,
                                })
                            }
                            _ => ExecEvent::Error {
                                code: e.code().into(),
                                message: e.to_string(),
                            },
                        };
                        let _ = tx.send(ev).await;
                        break;
                    }
                };
                if tx.send(event).await.is_err() {
                    // The client went away; the command runs to its end (or its timeout).
                    break;
                }
            }
        });
        Ok(out)
    }

    /// The agent channel closed under a call: wait for the container's exit and record the
    /// crash (so the sandbox's status says so before the caller hears back), then name the cause.
    async fn died_during_call(&self, in_use: InUse) -> ControlError {
        let exit = in_use.resident().exit_handle();
        let cid = in_use.resident().id().to_string();
        let id = in_use.id.clone();
        // The crash is recorded under the write lock: release our read lock first.
        drop(in_use);
        match tokio::time::timeout(Duration::from_secs(5), exit.exited()).await {
            Ok(info) => {
                let reason = crash_reason(&info);
                // No transition can run while a call holds the sandbox, so this exit is a crash.
                // The crash watch may be recording it already; on_crash waits for it, and
                // records it itself otherwise.
                self.on_crash(&id, &cid, &reason, info.oom_killed).await;
                ControlError::SandboxCrashed { reason }
            }
            Err(_) => ControlError::SandboxCrashed {
                reason: "agent channel closed".into(),
            },
        }
    }

    pub async fn agent_call(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        req: Request,
        body: &[u8],
    ) -> Result<(Reply, Vec<u8>)> {
        let in_use = self.use_sandbox(tenant, id).await?;
        let reply = in_use.resident().call(&req, body).await;
        match reply {
            Ok((Reply::Error { code, message }, _)) => Err(ControlError::Agent { code, message }),
            Ok(r) => Ok(r),
            Err(_) => Err(self.died_during_call(in_use).await),
        }
    }

    pub async fn read_file(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        path: &str,
        max_bytes: u64,
    ) -> Result<Vec<u8>> {
        let (_, body) = self
            .agent_call(
                tenant,
                id,
                Request::ReadFile {
                    path: path.into(),
                    max_bytes,
                },
                &[],
            )
            .await?;
        Ok(body)
    }

    /// Up to `max_bytes` of a file from `offset`, and whether more follows. An agent that
    /// predates ranged reads (its hello said an older version: restored from an older
    /// snapshot) is asked for the whole file, which is then cut here.
    pub async fn read_file_range(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        path: &str,
        offset: u64,
        max_bytes: u64,
    ) -> Result<(Vec<u8>, bool)> {
        let ranged = {
            let in_use = self.use_sandbox(tenant, id).await?;
            in_use.resident().agent_version() >= proto::READ_RANGE_SINCE
        };
        if !ranged {
            let whole = self
                .read_file(tenant, id, path, proto::MAX_BODY as u64)
                .await?;
            let start = (offset as usize).min(whole.len());
            let end = start.saturating_add(max_bytes as usize).min(whole.len());
            return Ok((whole[start..end].to_vec(), end < whole.len()));
        }
        let ranged = self
            .agent_call(
                tenant,
                id,
                Request::ReadRange {
                    path: path.into(),
                    offset,
                    max_bytes,
                },
                &[],
            )
            .await;
        match ranged {
            Ok((Reply::Data { truncated }, body)) => Ok((body, truncated)),
            Ok((other, _)) => Err(ControlError::Agent {
                code: AgentErrorCode::Io,
                message: format!("unexpected reply to a ranged read: {other:?}"),
            }),
            Err(e) => Err(e),
        }
    }

    pub async fn write_file(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        path: &str,
        mode: Option<u32>,
        data: &[u8],
    ) -> Result<()> {
        self.agent_call(
            tenant,
            id,
            Request::WriteFile {
                path: path.into(),
                mode,
            },
            data,
        )
        .await
        .map(|_| ())
    }

    pub async fn list_files(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        path: &str,
    ) -> Result<Vec<DirEntry>> {
        match self
            .agent_call(tenant, id, Request::List { path: path.into() }, &[])
            .await?
        {
            (Reply::Entries { entries }, _) => Ok(entries),
            (other, _) => Err(ControlError::Invalid(format!(
                "unexpected agent reply {other:?}"
            ))),
        }
    }

    /// Lists `path` once its (name, size) set differs from `known`, or after `timeout_ms`
    /// (see [`Request::ListChanged`]), holding the sandbox for at most that long. Never wakes
    /// it: `Ok(None)` when the sandbox is not resident and running (asleep, frozen, or in a
    /// transition), so a follower can stop instead of keeping it awake.
    pub async fn list_files_changed(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        path: &str,
        known: BTreeMap<String, u64>,
        timeout_ms: u64,
    ) -> Result<Option<Vec<DirEntry>>> {
        self.sandbox(tenant, id)?;
        let slot = self.slot(id);
        let guard = slot.state.clone().read_owned().await;
        match &guard.live {
            Some(live) if !live.frozen && live.resident.alive() => {}
            _ => return Ok(None),
        }
        let in_use = InUse {
            guard,
            slot: slot.clone(),
            id: id.clone(),
            evictor: self.evictor.clone(),
        };
        let req = Request::ListChanged {
            path: path.into(),
            known,
            timeout_ms,
        };
        match in_use.resident().call(&req, &[]).await {
            Ok((Reply::Entries { entries }, _)) => Ok(Some(entries)),
            Ok((Reply::Error { code, message }, _)) => Err(ControlError::Agent { code, message }),
            Ok((other, _)) => Err(ControlError::Invalid(format!(
                "unexpected agent reply {other:?}"
            ))),
            Err(_) => Err(self.died_during_call(in_use).await),
        }
    }

    pub async fn remove_file(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        path: &str,
        recursive: bool,
    ) -> Result<()> {
        self.agent_call(
            tenant,
            id,
            Request::Remove {
                path: path.into(),
                recursive,
            },
            &[],
        )
        .await
        .map(|_| ())
    }

    // ---------------------------------------------------------------- policy

    async fn run_policy(self: Arc<Self>) {
        let mut interval = tokio::time::interval(self.cfg.tick);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            if self.shutting_down.load(Ordering::SeqCst) {
                return;
            }
            if let Err(e) = self.policy_tick().await {
                tracing::warn!(error = %e, "idle policy tick failed");
            }
        }
    }

    /// Moves idle sandboxes down the ladder and persists activity clocks.
    pub async fn policy_tick(self: &Arc<Self>) -> Result<()> {
        let templates: HashMap<TemplateName, TemplateRecord> = self
            .store
            .templates()?
            .into_iter()
            .map(|t| (t.name.clone(), t))
            .collect();
        let now = now_millis();
        let mut touched = Vec::new();
        let mut counts: HashMap<(SandboxState, Tier), i64> = HashMap::new();
        for mut rec in self.store.sandboxes()? {
            *counts.entry((rec.state, rec.tier)).or_default() += 1;
            let slot = self
                .slots
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&rec.id)
                .cloned();
            if let Some(slot) = &slot {
                let active = slot.last_active.load(Ordering::Relaxed);
                if active > rec.last_active_at {
                    rec.last_active_at = active;
                    touched.push((rec.id.clone(), active));
                }
            }
            let Some(tpl) = templates.get(&rec.template) else {
                continue;
            };
            let idle_s = (now - rec.last_active_at) as f64 / 1000.0;
            let due = |after: Option<f64>| after.is_some_and(|a| idle_s >= a);
            let idle = tpl.spec.idle;
            let next = match rec.state {
                SandboxState::Running if due(idle.freeze_after_s) => Some(Tier::Frozen),
                SandboxState::Running | SandboxState::Frozen if due(idle.park_after_s) => {
                    Some(Tier::Parked)
                }
                SandboxState::Parked if due(idle.suspend_after_s) => Some(Tier::Suspended),
                _ => None,
            };
            let (Some(next), Some(slot)) = (next, slot.or_else(|| Some(self.slot(&rec.id)))) else {
                continue;
            };
            let Ok(mut guard) = slot.state.clone().try_write_owned() else {
                continue; // in use right now: not idle after all
            };
            let engine = self.clone();
            let id = rec.id.clone();
            match next {
                Tier::Frozen => {
                    if let Err(e) = self.freeze_locked(&mut guard, &id, "idle").await {
                        tracing::warn!(sandbox = %id, error = %e, "idle freeze failed");
                    }
                }
                Tier::Parked => {
                    tokio::spawn(async move {
                        if let Err(e) = engine.park_locked(&mut guard, &id, "idle").await {
                            tracing::warn!(sandbox = %id, error = %e, "idle park failed");
                        }
                    });
                }
                Tier::Suspended => {
                    tokio::spawn(async move {
                        if let Err(e) = engine.upload_locked(&id, "idle").await {
                            tracing::warn!(sandbox = %id, error = %e, "idle suspend failed");
                        }
                        drop(guard);
                    });
                }
                Tier::Running => {}
            }
        }
        self.store.touch_sandboxes(&touched)?;
        self.set_sandbox_gauges(counts);
        self.make_room(0).await;
        // Calls wait in the lot: a sandbox may have gone idle without a call ending (a freeze).
        self.evictor.poke();
        Ok(())
    }

    fn set_sandbox_gauges(&self, counts: HashMap<(SandboxState, Tier), i64>) {
        self.metrics.sandboxes.reset();
        for ((state, tier), n) in counts {
            self.metrics
                .sandboxes
                .with_label_values(&[state.as_str(), tier.as_str()])
                .set(n);
        }
        self.metrics.workers_busy.set(self.workers.busy() as i64);
    }

    /// Refreshes the fleet gauges (for a scrape between ticks).
    pub fn policy_tick_gauges(&self) -> Result<()> {
        let mut counts: HashMap<(SandboxState, Tier), i64> = HashMap::new();
        for rec in self.store.sandboxes()? {
            *counts.entry((rec.state, rec.tier)).or_default() += 1;
        }
        self.set_sandbox_gauges(counts);
        self.metrics
            .warm_ready
            .set(self.node.warm_stats().ready as i64);
        Ok(())
    }

    /// Checkpoints every resident sandbox (SIGTERM): nothing is lost, the next start resumes.
    pub async fn shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        let slots: Vec<(SandboxId, Arc<Slot>)> = {
            let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            slots.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        let mut touched = Vec::new();
        for (id, slot) in slots {
            touched.push((id.clone(), slot.last_active.load(Ordering::Relaxed)));
            // A call that never ends (an exec of `sleep infinity`, an open WebSocket) must
            // not hold the shutdown: after the grace, that one sandbox is left to the next
            // start's reconcile (back to its last snapshot), and the others are checkpointed.
            let Ok(mut guard) =
                tokio::time::timeout(SHUTDOWN_GRACE, slot.state.clone().write_owned()).await
            else {
                tracing::error!(sandbox = %id, "calls still in flight at shutdown; not checkpointed, it restarts from its last snapshot");
                continue;
            };
            if guard.live.is_some() {
                tracing::info!(sandbox = %id, "checkpointing for shutdown");
                if let Err(e) = self.park_locked(&mut guard, &id, "shutdown").await {
                    tracing::error!(sandbox = %id, error = %e, "checkpoint at shutdown failed");
                }
            }
        }
        if let Err(e) = self.store.touch_sandboxes(&touched) {
            tracing::warn!(error = %e, "cannot persist activity clocks");
        }
        self.node.shutdown().await;
    }
}

// ---------------------------------------------------------------- GPU shares (crate::gpu)

impl Engine {
    /// Gives the engine the node's GPUs; once, right after start.
    pub fn attach_gpus(&self, mut gpus: crate::gpu::NodeGpus) {
        gpus.set_nvproxy(self.node_info.nvproxy);
        // Stored shares against the states reconcile left: awake holders keep theirs.
        match self.store.sandboxes() {
            Ok(all) => {
                let states: HashMap<SandboxId, SandboxState> =
                    all.into_iter().map(|s| (s.id, s.state)).collect();
                gpus.reconcile(|id| states.get(id).map(|s| s.may_have_container()));
            }
            Err(e) => tracing::error!(error = %e, "cannot read sandboxes to reconcile GPU shares"),
        }
        if self.gpus.set(gpus).is_err() {
            tracing::warn!("GPUs attached twice; the first stays");
        }
    }

    pub fn gpus(&self) -> Option<&crate::gpu::NodeGpus> {
        self.gpus.get()
    }

    /// Gets a sandbox its GPU share before a restore (`request` is saved first on create).
    /// Borrowed shares reclaimed for it are parked in the background.
    async fn acquire_gpu(
        &self,
        id: &SandboxId,
        request: Option<&torpor_gpu::request::GpuRequest>,
    ) -> Result<()> {
        let Some(gpus) = self.gpus.get() else {
            return Ok(());
        };
        if let Some(request) = request {
            gpus.save_request(id, request).map_err(ControlError::io(
                "cannot save the GPU request of",
                Path::new(id.as_str()),
            ))?;
        }
        for victim in gpus.acquire(id)? {
            let Some(engine) = self.me.upgrade() else {
                break;
            };
            tokio::spawn(async move {
                let slot = engine.slot(&victim);
                let mut guard = slot.state.clone().write_owned().await;
                if let Err(e) = engine
                    .park_locked(&mut guard, &victim, "gpu_reclaimed")
                    .await
                {
                    tracing::warn!(sandbox = %victim, error = %e, "cannot park a sandbox whose GPU share was reclaimed");
                }
            });
        }
        Ok(())
    }

    fn release_gpu(&self, id: &SandboxId) {
        if let Some(gpus) = self.gpus.get() {
            gpus.release(id);
        }
    }

    fn forget_gpu(&self, id: &SandboxId) {
        if let Some(gpus) = self.gpus.get() {
            gpus.forget(id);
        }
    }

    fn copy_gpu_request(&self, from: &SandboxId, to: &SandboxId) {
        if let Some(gpus) = self.gpus.get() {
            if let Some(request) = gpus.request_of(from) {
                if let Err(e) = gpus.save_request(to, &request) {
                    tracing::warn!(sandbox = %to, error = %e, "cannot copy the GPU request to a fork");
                }
            }
        }
    }

    /// The exec environment: the GPU share's variables, then the caller's on top.
    fn gpu_env(&self, id: &SandboxId, env: BTreeMap<String, String>) -> BTreeMap<String, String> {
        match self.gpus.get() {
            Some(gpus) => {
                let mut all = gpus.env(id);
                all.extend(env);
                all
            }
            None => env,
        }
    }

    fn gpu_runtime(&self, id: &SandboxId) -> Result<crate::gpu::GpuRuntime> {
        match self.gpus.get() {
            Some(gpus) => Ok(gpus.runtime(id)?),
            None => Ok(crate::gpu::GpuRuntime::default()),
        }
    }

    fn gpu_checkpoint_gate(
        &self,
        id: &SandboxId,
        container_id: &str,
    ) -> Result<Option<torpor_gpu::cuda_checkpoint::Tool>> {
        let Some(gpus) = self.gpus.get().filter(|g| g.holds(id)) else {
            return Ok(None);
        };
        // The template's rootfs and bind mounts: where a sandbox's own cuda-checkpoint lives.
        let tpl = match self.store.sandbox(id)? {
            Some(rec) => self.store.template_for(&rec.tenant, &rec.template)?,
            None => None,
        };
        let (rootfs, mounts) = match &tpl {
            Some(t) => (
                t.rootfs.clone(),
                t.mounts
                    .iter()
                    .map(|m| (PathBuf::from(&m.source), m.destination.clone()))
                    .collect::<Vec<_>>(),
            ),
            None => (PathBuf::new(), Vec::new()),
        };
        Ok(gpus.checkpoint_gate(id, container_id, &rootfs, &mounts)?)
    }

    /// After a checkpoint taken with cuda-checkpoint: remembered for the restore. A failed
    /// checkpoint stops the container (runsc), so there is nothing to toggle back: the sandbox
    /// goes back to its previous image, taken before this toggle.
    fn gpu_after_checkpoint(
        &self,
        id: &SandboxId,
        toggled: Option<torpor_gpu::cuda_checkpoint::Toggled>,
        ok: bool,
    ) {
        let (Some(gpus), Some(toggled)) = (self.gpus.get(), toggled) else {
            return;
        };
        if ok {
            if let Err(e) = gpus.save_toggled(id, &toggled) {
                tracing::error!(sandbox = %id, error = %e, "cannot record the cuda-checkpoint toggle");
            }
        } else {
            tracing::warn!(sandbox = %id, "checkpoint failed after cuda-checkpoint; the container is gone and the sandbox goes back to its previous image");
        }
    }

    /// After a restore: brings GPU state that cuda-checkpoint moved to host memory back.
    async fn gpu_cuda_resume(&self, id: &SandboxId, container: &dyn Resident) -> Result<()> {
        let Some(gpus) = self.gpus.get() else {
            return Ok(());
        };
        if let Some(toggled) = gpus.toggled(id) {
            gpus.cuda_resume(container, &toggled).await?;
            gpus.clear_toggled(id);
        }
        Ok(())
    }
}

fn create_data_dirs(data_dir: &Path) -> Result<()> {
    for sub in ["", "templates", "sandboxes", "store", "run", "agent"] {
        let p = data_dir.join(sub);
        std::fs::create_dir_all(&p).map_err(ControlError::io("cannot create", &p))?;
    }
    Ok(())
}

/// The sandbox id in a container id (`<sandbox id>-g<generation>`).
fn sandbox_of(container_id: &str) -> Option<&str> {
    container_id.rsplit_once("-g").map(|(id, _)| id)
}

/// Tokens are kept only as hashes.
fn token_hash(token: &str) -> String {
    blake3::hash(token.as_bytes()).to_hex().to_string()
}

fn crash_reason(info: &torpor_runtime::ExitInfo) -> String {
    if info.oom_killed {
        "oom_killed".to_string()
    } else {
        format!("exited (code {:?}, signal {:?})", info.code, info.signal)
    }
}

fn visible(tenant: &TenantId, owner: &TenantId) -> bool {
    tenant == owner || *owner == TenantId::admin() || *tenant == TenantId::admin()
}

fn owns(tenant: &TenantId, owner: &TenantId) -> bool {
    tenant == owner || *tenant == TenantId::admin()
}

fn not_found(id: &SandboxId) -> ControlError {
    ControlError::NotFound {
        kind: "sandbox",
        id: id.to_string(),
    }
}

fn check_metadata(m: &BTreeMap<String, String>) -> Result<()> {
    if m.len() > MAX_METADATA_ENTRIES {
        return Err(ControlError::Invalid(format!(
            "metadata may hold at most {MAX_METADATA_ENTRIES} entries"
        )));
    }
    if m.iter()
        .any(|(k, v)| k.is_empty() || k.len() > MAX_METADATA_LEN || v.len() > MAX_METADATA_LEN)
    {
        return Err(ControlError::Invalid(format!(
            "metadata keys must be non-empty and keys and values at most {MAX_METADATA_LEN} bytes"
        )));
    }
    Ok(())
}

fn check_exec(req: &ExecRequest) -> Result<()> {
    if req.cmd.is_empty() || req.cmd[0].is_empty() {
        return Err(ControlError::Invalid("cmd must name a program".into()));
    }
    if req.cmd.iter().any(|a| a.contains('\0')) {
        return Err(ControlError::Invalid(
            "cmd arguments must not hold NUL bytes".into(),
        ));
    }
    validate_env(&req.env).map_err(|e| ControlError::Invalid(e.to_string()))?;
    if req.timeout_ms == Some(0) {
        return Err(ControlError::Invalid("timeout_ms must be above 0".into()));
    }
    if let Some(cwd) = &req.cwd {
        if !cwd.starts_with('/') {
            return Err(ControlError::Invalid("cwd must be an absolute path".into()));
        }
    }
    Ok(())
}

fn exec_reply(
    reply: Reply,
    body: Vec<u8>,
    timeout_ms: Option<u64>,
    detach: bool,
) -> Result<ExecResult> {
    match reply {
        Reply::Exit {
            exit_code,
            signal,
            timed_out,
            duration_us,
            stdout_len,
        } => {
            let split = (stdout_len as usize).min(body.len());
            let stdout = String::from_utf8_lossy(&body[..split]).into_owned();
            let stderr = String::from_utf8_lossy(&body[split..]).into_owned();
            if timed_out {
                return Err(ControlError::ExecTimeout {
                    timeout_ms: timeout_ms.unwrap_or(0),
                    stdout,
                    stderr,
                });
            }
            Ok(ExecResult {
                exit_code,
                signal,
                stdout,
                stderr,
                oom_killed: false,
                duration_ms: duration_us as f64 / 1000.0,
            })
        }
        Reply::Started { pid } if detach => Ok(ExecResult {
            exit_code: None,
            signal: None,
            stdout: format!("{pid}"),
            stderr: String::new(),
            oom_killed: false,
            duration_ms: 0.0,
        }),
        Reply::Error { code, message } => Err(ControlError::Agent { code, message }),
        other => Err(ControlError::Invalid(format!(
            "unexpected agent reply {other:?}"
        ))),
    }
}

fn container_spec(
    tpl: &TemplateRecord,
    limits: &Limits,
    env: &BTreeMap<String, String>,
) -> ContainerSpec {
    ContainerSpec {
        rootfs: tpl.rootfs.clone(),
        mounts: tpl.mounts.clone(),
        agent_dir: tpl.agent_dir.clone(),
        argv: rootfs::agent_argv(&tpl.spec.command),
        env: env.clone(),
        cwd: tpl.spec.cwd.clone().unwrap_or_else(|| "/".into()),
        limits: *limits,
        hostname: "sandbox".into(),
        netns: None,
        devices: Vec::new(),
    }
}

/// An image's entrypoint, cmd, env and working directory fill what the template left unset.
fn apply_image_config(spec: &mut TemplateSpec, config: &torpor_image::ImageConfig) {
    if spec.command.is_empty() {
        spec.command = config
            .entrypoint
            .iter()
            .chain(config.cmd.iter())
            .cloned()
            .collect();
    }
    for kv in &config.env {
        if let Some((k, v)) = kv.split_once('=') {
            spec.env
                .entry(k.to_string())
                .or_insert_with(|| v.to_string());
        }
    }
    if spec.cwd.is_none() {
        spec.cwd = config.working_dir.clone().filter(|d| d.starts_with('/'));
    }
}

/// Removes every entry of `dir` but `keep` (compared by name; nothing is removed when `keep`
/// does not lie in `dir` or does not exist).
fn remove_other_entries(dir: &Path, keep: &Path) {
    let (Some(name), Some(parent)) = (keep.file_name(), keep.parent()) else {
        return;
    };
    if parent.file_name() != dir.file_name() || !keep.exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name() != name {
            tracing::info!(path = %e.path().display(), "removing a checkpoint no record points at");
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

fn remove_tmp_entries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(".tmp-") {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

pub(crate) fn dir_size(p: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(p) else {
        return std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(ft) if ft.is_dir() => dir_size(&e.path()),
            _ => e.metadata().map(|m| m.len()).unwrap_or(0),
        })
        .sum()
}

/// Copies a directory tree with `cp -a` (keeps modes, owners, links and special files).
/// Makes a checkpoint image that runsc wrote at `tmp` durable (every file, then the
/// directories) and publishes it at `dest` with a durable rename, replacing what was there. A
/// record may point at `dest` once this returns: a power loss cannot leave it half written.
async fn commit_image(tmp: &Path, dest: &Path) -> Result<()> {
    let (tmp, dest) = (tmp.to_path_buf(), dest.to_path_buf());
    tokio::task::spawn_blocking(move || {
        use torpor_snapshot::durable;
        durable::fsync_tree(&tmp)?;
        let _ = std::fs::remove_dir_all(&dest);
        durable::rename_durably(&tmp, &dest)
    })
    .await
    .map_err(|e| ControlError::Unsupported(format!("image commit task failed: {e}")))?
    .map_err(|e| ControlError::Io {
        what: "cannot commit the image",
        path: e.path.clone(),
        source: e.source,
    })
}

/// Unpacks a root-filesystem tarball (plain, gzip or zstd) into `dest`, refusing entries that
/// would land outside it.
async fn unpack_rootfs_tar(
    archive: &Path,
    dest: &Path,
    limits: torpor_image::Limits,
) -> Result<()> {
    let (archive, dest) = (archive.to_path_buf(), dest.to_path_buf());
    tokio::task::spawn_blocking(move || {
        // The destination must be missing or empty; the build made it empty.
        let _ = std::fs::remove_dir(&dest);
        torpor_image::unpack_rootfs_tar_with(&archive, &dest, &limits)
    })
    .await
    .map_err(|e| ControlError::Unsupported(format!("rootfs unpack task failed: {e}")))??;
    Ok(())
}

async fn copy_tree(src: &Path, dest: &Path) -> Result<()> {
    if !src.is_dir() {
        return Err(ControlError::Invalid(format!(
            "{} is not a directory",
            src.display()
        )));
    }
    std::fs::create_dir_all(dest).map_err(ControlError::io("cannot create", dest))?;
    let out = tokio::process::Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", src.display()))
        .arg(dest)
        .output()
        .await
        .map_err(ControlError::io("cannot run cp for", src))?;
    if !out.status.success() {
        return Err(ControlError::Io {
            what: "cannot copy",
            path: src.to_path_buf(),
            source: std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_string()),
        });
    }
    Ok(())
}

pub use proto::DirEntry as FileEntry;
