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
use tokio::sync::{mpsc, OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};
use torpor_core::{
    now_millis, validate_env, Limits, LimitsPatch, SandboxId, SandboxState, TemplateName,
    TemplateSource, TemplateSpec, TenantId, Tier,
};
use torpor_runtime::node::{sandbox_of, StoredFiles};
use torpor_runtime::proto::{self, AgentErrorCode, DirEntry, ExecRequest, Reply, Request};
use torpor_runtime::{
    rootfs, ContainerSpec, Launch, Node, NodeEvent, NodeInfo, Resident, RunscNode, RunscNodeConfig,
};

use crate::error::{ControlError, Result};

mod call_rates;
mod calls;
mod cluster;
mod gpu_glue;
mod lifecycle;
mod listing;
mod net;
mod policy;
mod quiet;
mod quota;
mod reboot;
mod reencode;
mod residency;
mod snapshot_admin;
mod sources;
mod templates;
mod tenancy;
mod transitions;
mod turns;
pub mod usage_probe;
mod worker_images;

pub use crate::lot::Reserve;
use crate::lot::{Arrival, LotError, Parked, WorkerPermit, WorkerPool};
use crate::metrics::Metrics;
use crate::store::{
    ImageRef, Quotas, SandboxRecord, Store, TemplateRecord, TemplateStatus, TenantRecord,
};
pub use calls::{Progress, SpawnProgress, ToCome};
pub use cluster::{ControllerIdentity, Route, POOLS_LEASE};
pub use net::{count_proxied, sandbox_handshake, sandbox_http, ProxyTarget, SandboxConn};
use quota::Charge;
pub use quota::{UploadAllowance, TENANT_MAX_PIDS};
pub use sources::{UploadKind, UPLOADED};
use {templates::*, transitions::*};

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
    /// Free workers kept for tenants that hold none (`lot.rs`, [`Reserve`]).
    pub reserved_workers: Reserve,
    /// Resident sandboxes are parked, least recently active first, to stay under this.
    pub memory_budget: Option<u64>,
    /// How often the idle policy runs.
    pub tick: Duration,
    /// Free workers kept prepared (cgroups, bundle directory) so a wake does only the restore.
    pub warm_pool: usize,
    /// Running sandboxes outlive the engine's process under their shims and are taken back at
    /// the next start (this machine's node only).
    pub live_restore: bool,
    /// A parked image on this machine is rewritten in the background with stored frames,
    /// which a wake restores without inflating, and a template's golden snapshot before its
    /// commit (see `engine/reencode.rs`).
    pub reencode_images: bool,
    /// How long an explicit suspend waits for calls in flight (execs, proxied requests, open
    /// WebSockets) to finish before it answers 409 `sandbox_busy`; nothing in flight is cut.
    pub drain_timeout: Duration,
    /// Snapshot store, chunk cache, retention, scheduled GC, encryption.
    pub snapshots: crate::snapshots::SnapshotConfig,
    /// The only host directory a tenant's template source may name (`--import-dir`); `None`:
    /// tenants may not name host paths at all (they upload images). The admin may name any.
    pub import_dir: Option<PathBuf>,
    /// The state store: `None` for SQLite in the data directory (embedded mode), or a
    /// `postgres://` URL (cluster mode; the env key file stays in the data directory and must
    /// be the same for every controller of one database).
    pub database: Option<String>,
    /// Cluster mode: this controller's identity among the controllers of one database
    /// (`None`: the only engine on its store).
    pub controller: Option<ControllerIdentity>,
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
    /// Metadata a layer of torpor keeps under its reserved prefix (E2B's lifecycle:
    /// `torpor.e2b.*`), written with the sandbox in the same insert. Never read from a
    /// request body (a tenant cannot set reserved keys): the layer's code fills it.
    #[serde(skip)]
    pub layer_metadata: BTreeMap<String, String>,
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
    /// Free workers kept now for tenants that hold none (0: none kept).
    #[serde(default)]
    pub reserved_workers: usize,
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
    /// Its tenant, so a call for a running sandbox is authorised without a store read.
    owner: TenantId,
}

#[derive(Default)]
struct SlotState {
    live: Option<Live>,
}

struct Slot {
    state: Arc<RwLock<SlotState>>,
    last_active: AtomicI64,
    /// The last activity the idle policy wrote to the store.
    persisted: AtomicI64,
    /// Calls that borrowed it (each [`InUse`] ended): its call rate, for balancing.
    calls: std::sync::atomic::AtomicU64,
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

    pub(crate) fn resident(&self) -> &dyn Resident {
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
        self.slot.calls.fetch_add(1, Ordering::Relaxed);
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
    /// At most this many checkpoints run at once (each is CPU- and disk-heavy): one per core
    /// (cluster mode: per core of the ready workers, [`Engine::set_parallel`]).
    checkpoints: turns::Turns,
    /// At most this many restores run at once, one per core: more only slow each other down
    /// (50 parallel restores on 2 cores take each 10x longer) and the first wake waits for all.
    restores: turns::Turns,
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
    /// Cluster mode: the workers' GPUs (each worker places shares from its own).
    fleet_gpus: std::sync::OnceLock<Arc<dyn crate::gpu::FleetGpus>>,
    /// Live controllers and leases (cluster mode).
    cluster: cluster::ClusterState,
    /// When the idle policy last refreshed the fleet gauges (a scrape refreshes them itself).
    gauges_at: AtomicI64,
    /// CPU readings taken as sandboxes left their workers, for the usage sampler.
    cpu_at_release: Mutex<Vec<usage_probe::CpuAtRelease>>,
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
            live_restore: cfg.live_restore,
            live_restore_window: None,
        })?;
        Engine::start_on(cfg, Arc::new(node)).await
    }

    /// Opens the store, reconciles what a previous run left behind (on `node` and in the
    /// store) and makes sure the built-in `host` template exists. Then starts the idle policy,
    /// the evictor and the node's event watch.
    pub async fn start_on(cfg: EngineConfig, node: Arc<dyn Node>) -> Result<Arc<Engine>> {
        create_data_dirs(&cfg.data_dir)?;
        let store = match &cfg.database {
            None => Store::open(&cfg.data_dir.join("torpor.db"))?,
            Some(url) => Store::connect(url, &cfg.data_dir.join("env.key"))?,
        };
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
            workers: WorkerPool::new(cfg.workers, cfg.lot_capacity, cfg.reserved_workers),
            checkpoints: turns::Turns::new(cores()),
            restores: turns::Turns::new(cores()),
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
            fleet_gpus: std::sync::OnceLock::new(),
            cluster: Default::default(),
            gauges_at: AtomicI64::new(0),
            cpu_at_release: Mutex::new(Vec::new()),
        });
        // Alive before touching any sandbox: the others must not take ours over meanwhile.
        engine.announce().await?;
        engine.reconcile().await?;
        if engine
            .store
            .template(&TenantId::admin(), &TemplateName::host())?
            .is_none()
        {
            tracing::info!("building the built-in host template (first start)");
            match engine.build_host_template().await {
                Ok(()) => {}
                // Cluster mode before any worker joined: built as soon as one can take it.
                Err(e) if e.kind() == crate::error::ErrorKind::NoCapacity => {
                    tracing::warn!(why = %e, "the host template is built when a worker can take it");
                    let retry = engine.clone();
                    tokio::spawn(async move {
                        loop {
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            if retry.shutting_down.load(Ordering::SeqCst) {
                                return;
                            }
                            match retry.build_host_template().await {
                                Ok(()) => return,
                                // Another controller of this database built it.
                                Err(ControlError::AlreadyExists { .. }) => return,
                                Err(e) if e.kind() == crate::error::ErrorKind::NoCapacity => {
                                    continue
                                }
                                Err(e) => {
                                    tracing::error!(error = %e, "cannot build the host template");
                                    return;
                                }
                            }
                        }
                    });
                }
                Err(e) => return Err(e),
            }
        }
        let ticker = engine.clone();
        tokio::spawn(async move { ticker.run_policy().await });
        let heart = engine.clone();
        tokio::spawn(async move { heart.run_heartbeat().await });
        let sweeper = engine.clone();
        tokio::spawn(async move { sweeper.run_image_sweep().await });
        let evictor = engine.clone();
        tokio::spawn(async move { evictor.run_evictor().await });
        if let Some(events) = events {
            let watcher = engine.clone();
            tokio::spawn(async move { watcher.watch_node(events).await });
        }
        engine.spawn_snapshot_gc();
        Ok(engine)
    }

    /// Builds the built-in `host` template.
    async fn build_host_template(&self) -> Result<()> {
        self.register_template(
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
        .await
        .map(|_| ())
    }

    /// What the node runs (runtime version, platform, GPU pass-through).
    pub fn node_info(&self) -> &NodeInfo {
        &self.node_info
    }

    pub fn workers(&self) -> usize {
        self.workers.total()
    }

    /// Resizes the lot's workers (cluster mode: the slots of the ready workers, as they join,
    /// drain and are lost). Parked calls take new slots first.
    /// Resizes how many checkpoints and restores run at once (cluster mode: one of each per
    /// core of the ready workers, as they join, drain and are lost; at least one).
    pub fn set_parallel(&self, cores: usize) {
        self.checkpoints.resize(cores);
        self.restores.resize(cores);
    }

    /// Checkpoints and restores that may run at once (the lot's model of the node).
    fn parallel(&self) -> usize {
        self.restores.size()
    }

    pub fn set_workers(&self, total: usize) {
        self.workers.set_total(total);
        self.metrics.workers_total.set(total as i64);
        self.metrics.workers_busy.set(self.workers.busy() as i64);
        self.evictor.poke();
    }

    /// The engine's state store (shared with pools and the GPU ledger).
    pub fn state_store(&self) -> Store {
        self.store.clone()
    }

    /// Resolves every transitional state a crashed daemon left and removes stray containers.
    async fn reconcile(&self) -> Result<()> {
        // Running and frozen sandboxes whose containers outlived the previous run under their
        // shims (live restore) are taken back as they are. The node clears every other
        // container it finds: those sandboxes go back to their last snapshot below. A
        // controller's workers come back after it started: their containers are awaited
        // (`take_back_after_restart`), their slots locked until then.
        let mut known = Vec::new();
        let mut taken_back = 0;
        let mut awaited = Vec::new();
        let mut not_uploaded = Vec::new();
        let mut nodes = match self.controller_name() {
            Some(_) => self.store.sandbox_nodes()?,
            None => Default::default(),
        };
        for mut s in self.store.sandboxes()? {
            known.push(s.id.to_string());
            // Parked on a worker, the upload unfinished (its controller stopped): sent again
            // once that worker is back (`upload_after_restart`).
            if let (SandboxState::Parked | SandboxState::Uploading, ImageRef::Worker { node, .. }) =
                (s.state, &s.image)
            {
                not_uploaded.push((s.id.clone(), node.clone()));
            }
            // GPU sandboxes go back to their snapshots: their devices and shares were the
            // previous run's (the GPU ledger re-issues them at the next wake).
            if !matches!(s.state, SandboxState::Running | SandboxState::Frozen)
                || self.store.gpu_request(&s.id)?.is_some()
            {
                continue;
            }
            if self.controller_name().is_some() {
                // Where the records put it: a container announced elsewhere is not taken.
                if let (true, Some(node)) = (self.reconciles(&s)?, nodes.remove(&s.id)) {
                    let guard = self.slot(&s.id).state.clone().write_owned().await;
                    let expected = (s.container_id(), node);
                    awaited.push((guard, s, expected));
                }
                continue;
            }
            let mut guard = self.slot(&s.id).state.clone().write_owned().await;
            if self.adopt(&mut guard, &mut s, "restart").await? {
                taken_back += 1;
            }
        }
        if taken_back > 0 {
            tracing::info!(
                sandboxes = taken_back,
                "running sandboxes taken back after a restart"
            );
        }
        self.node.reconcile(&known).await;
        let awaited_ids: std::collections::HashSet<SandboxId> =
            awaited.iter().map(|(_, s, _)| s.id.clone()).collect();
        if let (Some(me), Some(identity)) = (self.me.upgrade(), &self.cfg.controller) {
            if !awaited.is_empty() {
                let expected: Vec<(String, String)> =
                    awaited.iter().map(|(_, _, c)| c.clone()).collect();
                self.node.expect_back(&expected);
                tracing::info!(sandboxes = awaited.len(), within_ms = identity.take_back_within.as_millis() as u64,
                    "waiting for the workers to bring back the sandboxes resident before the restart");
                let awaited = awaited.into_iter().map(|(g, s, _)| (g, s)).collect();
                tokio::spawn(
                    me.clone()
                        .take_back_after_restart(awaited, identity.take_back_within),
                );
            }
            if !not_uploaded.is_empty() {
                tokio::spawn(
                    me.clone()
                        .upload_after_restart(not_uploaded, identity.take_back_within),
                );
            }
        }
        // Another live controller may be building a template right now.
        let others = self.others_alive()?;
        for t in self.store.templates()? {
            if t.status == TemplateStatus::Building && !others {
                tracing::warn!(template = %t.name, "dropping a template whose build was interrupted");
                let _ = std::fs::remove_dir_all(t.rootfs.parent().unwrap_or(&t.rootfs));
                self.store.delete_template(&t.tenant, &t.name)?;
            }
        }
        for mut s in self.store.sandboxes()? {
            if !self.reconciles(&s)? {
                continue; // another live controller holds it
            }
            if self.is_live(&s.id) || awaited_ids.contains(&s.id) {
                continue; // taken back above, or awaited from its worker
            }
            // Under live restore a resident sandbox should have outlived the restart: say why
            // this one did not (its shim or container died meanwhile).
            let lost = (self.cfg.live_restore
                && matches!(s.state, SandboxState::Running | SandboxState::Frozen))
            .then_some("its container");
            self.resolve_interrupted(&mut s, "restart", lost)?;
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

    /// Resolves the transition a holder that stopped (this engine's previous run, or a lost
    /// controller: `lost`) left a sandbox in (`torpor_core::Recovery`): a resident or moving
    /// sandbox goes back to its last snapshot, a creation that never finished is dropped, a
    /// delete is finished. A sleeping one is left as it is.
    pub(super) fn resolve_interrupted(
        &self,
        s: &mut SandboxRecord,
        cause: &str,
        lost: Option<&str>,
    ) -> Result<()> {
        use torpor_core::Recovery;
        match s.state.recovery() {
            Recovery::Keep => {}
            Recovery::BackToSnapshot => {
                tracing::warn!(sandbox = %s.id, state = %s.state, cause, "back to its last snapshot");
                if let Some(lost) = lost {
                    s.last_error = Some(format!(
                        "{lost} was lost; restored to its last snapshot{}",
                        transitions::snapshot_age(&s.image)
                    ));
                }
                let to = s.image.sleeping_state();
                self.move_to(s, to, cause)?;
            }
            Recovery::DropCreation | Recovery::FinishDelete => {
                tracing::warn!(sandbox = %s.id, state = %s.state, cause, "finishing an interrupted create or delete");
                self.remove_sandbox_files(&s.id);
                self.store.delete_sandbox(&s.id)?;
            }
        }
        Ok(())
    }

    fn remove_sandbox_files(&self, id: &SandboxId) {
        let _ = std::fs::remove_dir_all(self.sandbox_dir(id));
    }

    /// Whether a container is installed for `id` (false while its slot is busy).
    fn is_live(&self, id: &SandboxId) -> bool {
        let slot = self
            .slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned();
        slot.is_some_and(|s| s.state.try_read().is_ok_and(|g| g.live.is_some()))
    }

    fn slot(&self, id: &SandboxId) -> Arc<Slot> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots
            .entry(id.clone())
            .or_insert_with(|| {
                Arc::new(Slot {
                    state: Arc::new(RwLock::new(SlotState::default())),
                    last_active: AtomicI64::new(0),
                    persisted: AtomicI64::new(0),
                    calls: std::sync::atomic::AtomicU64::new(0),
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
        self.retire();
        self.node.shutdown().await;
    }

    /// Cluster mode, a clean stop that leaves every resident sandbox running on its worker
    /// for the other controllers (`torpor controller --on-stop hand-off`): no checkpoint. It
    /// refuses new work, waits (up to [`SHUTDOWN_GRACE`] in all) for the transitions and calls
    /// under way to end, then gives up its row and pool leases: from then on the other
    /// controllers count it gone and take each sandbox over at its next call or in their idle
    /// policy's sweep, adopting the container as it is. The caller exits holding what this
    /// returns (every slot's lock), so nothing here moves a sandbox after it was let go.
    pub async fn hand_off(&self) -> HandedOff {
        self.shutting_down.store(true, Ordering::SeqCst);
        let slots: Vec<(SandboxId, Arc<Slot>)> = {
            let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            slots.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        let mut touched = Vec::new();
        let mut held = Vec::new();
        let mut resident = 0;
        // One deadline for all: long calls (an exec of `sleep infinity`) on many sandboxes
        // must not add up.
        let deadline = tokio::time::Instant::now() + SHUTDOWN_GRACE;
        for (id, slot) in slots {
            touched.push((id.clone(), slot.last_active.load(Ordering::Relaxed)));
            match tokio::time::timeout_at(deadline, slot.state.clone().write_owned()).await {
                Ok(guard) => {
                    resident += usize::from(guard.live.is_some());
                    held.push(guard);
                }
                // A call that never ends is cut when the process exits; its sandbox is Running
                // and is adopted as it is. One caught in a transition (a park under way) goes
                // back to its last snapshot when it is taken over.
                Err(_) => {
                    tracing::warn!(sandbox = %id, "a call or transition still under way at the hand-off is cut")
                }
            }
        }
        if let Err(e) = self.store.touch_sandboxes(&touched) {
            tracing::warn!(error = %e, "cannot persist activity clocks");
        }
        self.retire();
        tracing::info!(
            resident,
            "handed off: resident sandboxes keep running for the other controllers"
        );
        HandedOff { _slots: held }
    }
}

/// What [`Engine::hand_off`] holds: every sandbox's lock, until the process exits.
#[must_use = "exit while holding it: dropped, this controller could act on sandboxes it let go"]
pub struct HandedOff {
    _slots: Vec<OwnedRwLockWriteGuard<SlotState>>,
}

/// The node's cores (at least 2): how many restores and checkpoints run at once.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().max(2))
}

fn create_data_dirs(data_dir: &Path) -> Result<()> {
    for sub in ["", "templates", "sandboxes", "store", "run", "agent"] {
        let p = data_dir.join(sub);
        std::fs::create_dir_all(&p).map_err(ControlError::io("cannot create", &p))?;
    }
    Ok(())
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

pub use proto::DirEntry as FileEntry;
