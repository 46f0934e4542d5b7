//! The node's GPU shares in the daemon: which sandbox holds what, and what it must be given.
//!
//! Owns the node's inventory (declared file or NVML), the ledger of allocations, tenant GPU
//! quotas, the MIG devices handed out and each sandbox's GPU request (kept in the state store,
//! so a request survives a restart).
//! It decides with `torpor-gpu`'s pure planner and does no container work: the engine calls
//! [`NodeGpus::acquire`] before a restore (create, wake), [`NodeGpus::release`] when the
//! sandbox's container goes away (park, suspend, crash, delete), [`NodeGpus::env`] on every exec,
//! and [`NodeGpus::checkpoint_gate`] before a checkpoint.
//!
//! ```text
//!   create/wake ──acquire──> held (allocation, injection env)
//!   park/suspend/crash ──release──> sleeping (ticket: the shares it had)
//!   wake ──acquire──> the same shares when free, else any GPU of the same model, else
//!                     gpu_unavailable (the sandbox stays asleep)
//!   delete ──forget──> nothing
//! ```
//!
//! Allocations are kept in the state store ([`crate::store::ShareRecord`]): every
//! acquire and release writes the sandbox's row, and [`NodeGpus::open`] reads them back, so a
//! restart keeps every share. [`NodeGpus::reconcile`] then matches them with the sandboxes'
//! states: an awake holder keeps its share, a sleeping one holds none (its share becomes a
//! ticket for the same devices on wake), a sandbox that is gone holds nothing.
//!
//! This file holds the node's state and the share lifecycle (open, acquire, release, forget,
//! the runtime's devices) and the GPU side of a checkpoint (`cuda-checkpoint` in the
//! container). Beside it, by concern: `errors` ([`GpuError`], [`GpuSetupError`]), `requests`
//! (each sandbox's request file), `shares` (the stored rows, restore and reconcile), `report`
//! (`GET /v1/gpus` and `/metrics`) and `mig_drivers` (stand-in MIG devices).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use torpor_core::SandboxId;
use torpor_gpu::ids::AllocationId;
use torpor_gpu::inject::{injection, InjectConfig, MigHandles};
use torpor_gpu::inventory::Inventory;
use torpor_gpu::ledger::Ledger;
use torpor_gpu::ledger::ShareKind;
use torpor_gpu::nvml::GpuSample;
use torpor_gpu::planner::{commit, describe, Plan, Policy, Refusal};
use torpor_gpu::quota::QuotaBook;
use torpor_gpu::realize::{realize, unrealize, MigDriver, RealizeError};
use torpor_gpu::sleep::{
    checkpoint_method, find_cuda_checkpoint, plan_wake, release_for_sleep, SleepTicket,
};

mod errors;
pub mod fleet;
mod mig_drivers;
mod report;
mod requests;
mod shares;

pub use errors::{GpuError, GpuSetupError};
pub use fleet::FleetGpus;
pub use report::{label_samples, GpuStatus, SandboxShare};

use errors::chain;
use mig_drivers::{DeclaredMigDriver, NoMigDriver};
use shares::restore;

/// Reads the GPUs' telemetry (NVML, in the binary that links the driver loader). An error
/// leaves the DCGM families out of one scrape.
pub type Sampler = Box<dyn Fn() -> Result<Vec<GpuSample>, String> + Send + Sync>;

/// Device minors of MIG capabilities, written by the NVIDIA driver.
const MIG_MINORS: &str = "/proc/driver/nvidia-caps/mig-minors";

/// What `torpor up` says about GPUs.
#[derive(Debug, Clone, Default)]
pub struct GpuConfig {
    /// A declared inventory; without it NVML is asked, and without a driver the node has none.
    pub inventory: Option<PathBuf>,
    /// Tenant GPU quotas (TOML); without it none is enforced.
    pub quotas: Option<PathBuf>,
    /// The inventory read from NVML by the binary (which links the driver loader), if any.
    pub nvml_inventory: Option<Inventory>,
    /// A host `cuda-checkpoint` to use (`--cuda-checkpoint`, `TORPOR_CUDA_CHECKPOINT`);
    /// without it the sandbox's rootfs and then the host `PATH` are searched.
    pub cuda_checkpoint: Option<PathBuf>,
}

struct Held {
    allocation: AllocationId,
    env: BTreeMap<String, String>,
    /// Host device nodes and directories the container gets (NVML nodes only).
    devices: Vec<PathBuf>,
    mounts: Vec<PathBuf>,
}

/// What the runtime must give a GPU sandbox's container besides its environment.
#[derive(Debug, Clone, Default)]
pub struct GpuRuntime {
    pub devices: Vec<torpor_runtime::gpu::DeviceNode>,
    pub mounts: Vec<torpor_runtime::Mount>,
}

struct Inner {
    ledger: Ledger,
    handles: MigHandles,
    held: HashMap<SandboxId, Held>,
    tickets: HashMap<SandboxId, SleepTicket>,
}

/// What [`NodeGpus::acquire_or_name_victims`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquired {
    /// The sandbox holds its share; these sandboxes' borrowed shares were reclaimed for it
    /// (only when evictions were allowed).
    Held(Vec<SandboxId>),
    /// Nothing was taken: the share is free only once these sandboxes (borrowers above their
    /// guarantee, newest first) have given theirs back.
    ReclaimFirst(Vec<SandboxId>),
}

/// The node's GPUs as the daemon sees them.
pub struct NodeGpus {
    inventory: Inventory,
    source: String,
    quotas: QuotaBook,
    policy: Policy,
    inject: InjectConfig,
    declared: bool,
    /// The host `cuda-checkpoint` (configured, else found on `PATH` at start).
    cuda_checkpoint: Option<PathBuf>,
    /// The configured one only (a sandbox's own rootfs copy is preferred to `PATH`'s).
    cuda_configured: Option<PathBuf>,
    sampler: Option<Sampler>,
    store: Option<crate::store::Store>,
    /// Whether runsc can pass devices through (nvproxy); set by the engine at attach.
    nvproxy: bool,
    /// Creates MIG instances on real GPUs (NVML, from the binary); declared inventories use
    /// stand-in devices.
    mig_driver: Option<Mutex<Box<dyn MigDriver + Send>>>,
    inner: Mutex<Inner>,
}

impl NodeGpus {
    /// The node's GPUs, or `None` when it has none (no file, no driver).
    pub fn open(cfg: GpuConfig, data_dir: &Path) -> Result<Option<NodeGpus>, GpuSetupError> {
        let (inventory, source, declared) = match (&cfg.inventory, cfg.nvml_inventory) {
            (Some(path), _) => (
                Inventory::load(path).map_err(|e| GpuSetupError::Inventory {
                    code: e.code(),
                    message: chain(&e),
                })?,
                path.display().to_string(),
                true,
            ),
            (None, Some(inv)) => (inv, torpor_gpu::nvml::SOURCE.to_owned(), false),
            (None, None) => return Ok(None),
        };
        let quotas = match &cfg.quotas {
            None => QuotaBook::unlimited(),
            Some(p) => QuotaBook::load(p).map_err(|e| GpuSetupError::Quotas {
                code: e.code(),
                message: chain(&e),
            })?,
        };
        let cuda_configured = cfg.cuda_checkpoint.clone();
        if let Some(p) = &cuda_configured {
            if !p.is_file() {
                return Err(GpuSetupError::Inventory {
                    code: "cuda_checkpoint_missing",
                    message: format!("--cuda-checkpoint {}: no such file", p.display()),
                });
            }
        }
        let cuda_checkpoint = cuda_configured
            .clone()
            .or_else(|| std::env::var_os("PATH").and_then(|p| find_cuda_checkpoint(&p)));
        tracing::info!(node = %inventory.node, %source, gpus = inventory.gpus().len(),
            quotas = quotas.enforced(), cuda_checkpoint = ?cuda_checkpoint, "GPU inventory");
        let db = data_dir.join("torpor.db");
        let store = crate::store::Store::open(&db).map_err(|e| GpuSetupError::Inventory {
            code: "store_error",
            message: format!("{}: {e}", db.display()),
        })?;
        let stored = store.gpu_shares().map_err(|e| GpuSetupError::Inventory {
            code: "store_error",
            message: format!("{}: GPU shares: {e}", db.display()),
        })?;
        let mut inject = InjectConfig::default();
        if !declared {
            // MIG capability device minors, so MIG sandboxes get their nvidia-cap nodes.
            if let Ok(text) = std::fs::read_to_string(MIG_MINORS) {
                match torpor_gpu::inject::MigMinors::parse(&text) {
                    Ok(m) => inject.mig_minors = Some(m),
                    Err(e) => tracing::warn!(error = %e, "cannot parse {MIG_MINORS}"),
                }
            }
        }
        let inner = restore(&inventory, &inject, &store, stored);
        Ok(Some(NodeGpus {
            inner: Mutex::new(inner),
            inventory,
            source,
            quotas,
            policy: Policy::default(),
            inject,
            declared,
            cuda_checkpoint,
            cuda_configured,
            sampler: None,
            store: Some(store),
            nvproxy: false,
            mig_driver: None,
        }))
    }

    /// Tells whether runsc can give a container devices (`--nvproxy`). Without it a node
    /// whose GPUs are real (NVML) refuses GPU requests with `gpu_runtime_unsupported`; a
    /// declared inventory has no device nodes to give and works either way.
    pub fn set_nvproxy(&mut self, nvproxy: bool) {
        self.nvproxy = nvproxy;
    }

    /// Gives a node with real GPUs its MIG driver (NVML), so MIG requests can be placed.
    pub fn set_mig_driver(&mut self, driver: Box<dyn MigDriver + Send>) {
        self.mig_driver = Some(Mutex::new(driver));
    }

    /// Runs `f` with the MIG driver of this node: stand-in devices for a declared inventory,
    /// the NVML driver otherwise (none: MIG is refused at parse time).
    fn with_mig_driver<T>(
        &self,
        f: impl FnOnce(&mut dyn MigDriver) -> Result<T, RealizeError>,
    ) -> Result<T, RealizeError> {
        if self.declared {
            return f(&mut DeclaredMigDriver);
        }
        match &self.mig_driver {
            Some(d) => {
                let mut d = d.lock().unwrap_or_else(|p| p.into_inner());
                f(d.as_mut())
            }
            None => f(&mut NoMigDriver),
        }
    }

    fn runtime_check(&self) -> Result<(), GpuError> {
        if self.declared {
            return Ok(());
        }
        torpor_runtime::gpu::runsc_gpu_flags(true, self.nvproxy)
            .map(drop)
            .map_err(|e| GpuError::RuntimeUnsupported(e.to_string()))
    }

    /// The device nodes (with their numbers read from the host) and mounts `id`'s container
    /// needs: none on a declared inventory or for a sandbox without a share.
    pub fn runtime(&self, id: &SandboxId) -> Result<GpuRuntime, GpuError> {
        let (devices, mounts) = match self.lock().held.get(id) {
            Some(h) if !self.declared => (h.devices.clone(), h.mounts.clone()),
            _ => return Ok(GpuRuntime::default()),
        };
        self.runtime_check()?;
        let devices = torpor_runtime::gpu::device_nodes(&devices)
            .map_err(|e| GpuError::Driver(format!("{}: {e}", e.code())))?;
        let mounts = mounts
            .iter()
            .map(|p| {
                let p = p.to_string_lossy();
                torpor_runtime::Mount {
                    destination: p.to_string(),
                    kind: "bind".into(),
                    source: p.to_string(),
                    options: vec!["rbind".into(), "rw".into()],
                }
            })
            .collect::<Vec<_>>();
        let mut mounts = mounts;
        if let Some(host) = &self.cuda_checkpoint {
            mounts.push(torpor_runtime::Mount::bind_ro(
                &host.to_string_lossy(),
                torpor_gpu::cuda_checkpoint::MOUNTED_TOOL,
            ));
        }
        Ok(GpuRuntime { devices, mounts })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Every method computes on copies and commits at its end; a poisoned lock still holds
        // a consistent ledger.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Gets `id` its share (create or wake): the same shares it had before sleeping when they
    /// are free, else any GPU of the same model, else a refusal. Returns the sandboxes whose
    /// borrowed shares were reclaimed for it (the engine must park them).
    pub fn acquire(&self, id: &SandboxId) -> Result<Vec<SandboxId>, GpuError> {
        self.acquire_under(id, &self.quotas)
    }

    /// [`NodeGpus::acquire`] under `quotas` instead of the node's own book: a cluster worker
    /// places each start under the quota its controller sends with it (the tenant's quota
    /// less what it holds on other workers).
    pub fn acquire_under(
        &self,
        id: &SandboxId,
        quotas: &QuotaBook,
    ) -> Result<Vec<SandboxId>, GpuError> {
        match self.acquire_planned(id, quotas, true)? {
            Acquired::Held(victims) => Ok(victims),
            // With evictions allowed the plan commits them.
            Acquired::ReclaimFirst(_) => Ok(Vec::new()),
        }
    }

    /// [`NodeGpus::acquire_under`] that evicts nobody: a plan that needs borrowed shares back
    /// commits nothing and names their sandboxes instead (a cluster worker: the controllers
    /// park them, which gives the shares back, then start again).
    pub fn acquire_or_name_victims(
        &self,
        id: &SandboxId,
        quotas: &QuotaBook,
    ) -> Result<Acquired, GpuError> {
        self.acquire_planned(id, quotas, false)
    }

    fn acquire_planned(
        &self,
        id: &SandboxId,
        quotas: &QuotaBook,
        evict: bool,
    ) -> Result<Acquired, GpuError> {
        let Some(request) = self.request_of(id) else {
            return Ok(Acquired::Held(Vec::new()));
        };
        let mut inner = self.lock();
        if inner.held.contains_key(id) {
            return Ok(Acquired::Held(Vec::new()));
        }
        let planned: Result<Plan, Refusal> = match inner.tickets.get(id) {
            Some(ticket) => plan_wake(
                &self.inventory,
                &inner.ledger,
                ticket,
                &self.policy,
                quotas,
                true,
            ),
            None => torpor_gpu::planner::plan(
                &self.inventory,
                &inner.ledger,
                &request,
                &self.policy,
                quotas,
            ),
        };
        let planned = planned.map_err(|r| GpuError::from_refusal(&r))?;
        // Sandboxes whose allocations the plan reclaims (borrowers above their guarantee).
        let victims: Vec<SandboxId> = planned
            .evictions
            .iter()
            .filter_map(|a| {
                inner
                    .held
                    .iter()
                    .find(|(_, h)| h.allocation == *a)
                    .map(|(s, _)| s.clone())
            })
            .collect();
        if !evict && !planned.evictions.is_empty() {
            // A borrower's allocation that no sandbox holds cannot be asked back: refused as
            // any start without room is.
            if victims.len() != planned.evictions.len() {
                return Err(GpuError::Unavailable {
                    code: "no_free_share",
                    message:
                        "the shares this start needs are borrowed by allocations no sandbox holds"
                            .into(),
                });
            }
            return Ok(Acquired::ReclaimFirst(victims));
        }
        let mut ledger = inner.ledger.clone();
        let ids = commit(&self.inventory, &mut ledger, &planned, &self.policy).map_err(|e| {
            GpuError::Unavailable {
                code: e.code(),
                message: e.to_string(),
            }
        })?;
        let allocation_id = *ids.first().ok_or_else(|| GpuError::Unavailable {
            code: "commit_failed",
            message: "the plan committed no allocation".into(),
        })?;
        let allocation =
            ledger
                .allocation(allocation_id)
                .cloned()
                .ok_or_else(|| GpuError::Unavailable {
                    code: "commit_failed",
                    message: "the committed allocation is missing".into(),
                })?;
        let mut handles = inner.handles.clone();
        self.with_mig_driver(|driver| realize(&self.inventory, &allocation, driver, &mut handles))
            .map_err(|e| GpuError::Driver(format!("{}: {e}", e.code())))?;
        let inj = injection(&self.inventory, &allocation, &handles, &self.inject)
            .map_err(|e| GpuError::Driver(format!("{}: {e}", e.code())))?;
        // Committed: the victims' shares are gone from the ledger; forget them as held.
        for victim in &victims {
            if let Some(h) = inner.held.remove(victim) {
                tracing::info!(sandbox = %victim, allocation = %h.allocation, "GPU share reclaimed by its owner's guarantee");
            }
        }
        inner.ledger = ledger;
        inner.handles = handles;
        inner.tickets.remove(id);
        tracing::info!(sandbox = %id, allocation = %allocation_id,
            devices = ?allocation.shares.iter().map(|s| describe(&self.inventory, s)).collect::<Vec<_>>(),
            "GPU share acquired");
        inner.held.insert(
            id.clone(),
            Held {
                allocation: allocation_id,
                env: inj.env,
                devices: inj.devices,
                mounts: inj.mounts,
            },
        );
        self.persist(&inner, id);
        for victim in &victims {
            self.persist(&inner, victim);
        }
        Ok(Acquired::Held(victims))
    }

    /// Gives `id`'s share back (its container is gone: parked, suspended, crashed); the
    /// sandbox keeps a ticket to ask for the same shares on wake.
    pub fn release(&self, id: &SandboxId) {
        let mut inner = self.lock();
        let Some(held) = inner.held.remove(id) else {
            return;
        };
        let Inner {
            ledger, handles, ..
        } = &mut *inner;
        if let Some(allocation) = ledger.allocation(held.allocation).cloned() {
            let has_mig = allocation
                .shares
                .iter()
                .any(|s| matches!(s.kind, ShareKind::Mig { .. }));
            if has_mig {
                if let Err(e) = self.with_mig_driver(|driver| {
                    unrealize(&self.inventory, &allocation, driver, handles)
                }) {
                    tracing::warn!(sandbox = %id, error = %e, "cannot destroy MIG devices");
                }
            }
        }
        match release_for_sleep(&self.inventory, ledger, held.allocation) {
            Ok(ticket) => {
                tracing::info!(sandbox = %id, allocation = %held.allocation, "GPU share released");
                inner.tickets.insert(id.clone(), ticket);
            }
            Err(e) => tracing::error!(sandbox = %id, error = %e, "cannot release a GPU share"),
        }
        self.persist(&inner, id);
    }

    /// Forgets a deleted sandbox entirely.
    pub fn forget(&self, id: &SandboxId) {
        self.release(id);
        let mut inner = self.lock();
        inner.tickets.remove(id);
        self.persist(&inner, id);
        drop(inner);
        self.drop_request(id);
        self.clear_toggled(id);
    }

    /// Drops what this node keeps of `id`, a cluster worker's sandbox that was deleted or woke
    /// on another worker: its wake ticket and its saved GPU request, unless it holds a share
    /// here now (it came back meanwhile). True when something was dropped. Neither holds
    /// capacity: the ticket says where the next wake here would go first, and the controller
    /// sends the request again with every start (the worker saves it then).
    pub fn forget_elsewhere(&self, id: &SandboxId) -> bool {
        let mut inner = self.lock();
        if inner.held.contains_key(id) {
            return false;
        }
        let ticket = inner.tickets.remove(id).is_some();
        if ticket {
            self.persist(&inner, id);
        }
        drop(inner);
        let request = self.drop_request(id);
        ticket || request
    }

    /// After a refused start of `id` here (a cluster worker's): drops the GPU request the start
    /// saved, unless the sandbox holds a share or a wake ticket here (then it is this node's
    /// sandbox and keeps it). The controller tries another worker; nothing here would drop it.
    pub fn forget_refused(&self, id: &SandboxId) {
        let inner = self.lock();
        if inner.held.contains_key(id) || inner.tickets.contains_key(id) {
            return;
        }
        drop(inner);
        self.drop_request(id);
    }

    /// Deletes `id`'s saved GPU request; whether there was one (a store error is logged).
    fn drop_request(&self, id: &SandboxId) -> bool {
        let Some(store) = &self.store else {
            return false;
        };
        store.delete_gpu_request(id).unwrap_or_else(|e| {
            tracing::error!(sandbox = %id, error = %e, "cannot forget the GPU request");
            false
        })
    }

    /// What each tenant holds of this node's GPUs now (quota units), by tenant name.
    pub fn tenant_usage(&self) -> BTreeMap<String, torpor_gpu::quota::Amount> {
        let inner = self.lock();
        QuotaBook::usage(&self.inventory, &inner.ledger)
            .into_iter()
            .map(|(t, a)| (t.as_str().to_owned(), a))
            .collect()
    }

    /// The model of each GPU (one entry per GPU), as a cluster worker announces them.
    pub fn gpu_models(&self) -> Vec<String> {
        self.inventory
            .gpus()
            .iter()
            .map(|g| g.model.clone())
            .collect()
    }

    /// The environment every exec in `id` gets (empty when it holds no share).
    pub fn env(&self, id: &SandboxId) -> BTreeMap<String, String> {
        self.lock()
            .held
            .get(id)
            .map(|h| h.env.clone())
            .unwrap_or_default()
    }

    /// Whether `id` holds a share now.
    pub fn holds(&self, id: &SandboxId) -> bool {
        self.lock().held.contains_key(id)
    }

    /// Decides how `id` is checkpointed: `None` when no process of its container holds a
    /// live GPU context (an open `/dev/nvidia*` file; with gVisor's nvproxy the sentry holds
    /// them), the `cuda-checkpoint` to run inside it when one is found (configured, in its
    /// rootfs `rootfs` with the template's `mounts`, or on the host `PATH`), else the refusal
    /// `checkpoint_gpu_context`.
    pub fn checkpoint_gate(
        &self,
        id: &SandboxId,
        container_id: &str,
        rootfs: &Path,
        mounts: &[(PathBuf, String)],
    ) -> Result<Option<torpor_gpu::cuda_checkpoint::Tool>, GpuError> {
        if !self.holds(id) {
            return Ok(None);
        }
        let pids = cgroup_pids(container_id);
        let holding = !pids_holding_files(&pids, Path::new("/dev"), "nvidia").is_empty();
        let tool = if holding {
            torpor_gpu::cuda_checkpoint::locate(
                self.cuda_configured.as_deref(),
                rootfs,
                mounts,
                std::env::var_os("PATH").as_deref(),
            )
        } else {
            None
        };
        checkpoint_method(holding, tool.as_ref().map(|t| Path::new(&t.in_sandbox)))?;
        Ok(tool)
    }

    /// Runs `cuda-checkpoint --toggle` inside the container for every process holding a GPU
    /// context (before the gVisor checkpoint). All or nothing: on a failure the processes
    /// already toggled are toggled back.
    pub async fn cuda_suspend(
        &self,
        container: &dyn torpor_runtime::Resident,
        tool: torpor_gpu::cuda_checkpoint::Tool,
    ) -> Result<torpor_gpu::cuda_checkpoint::Toggled, GpuError> {
        let pids = cuda_holders(container).await?;
        cuda_toggle(container, tool, pids).await
    }

    /// Brings the GPU state of toggled processes back onto the GPU (after a restore).
    pub async fn cuda_resume(
        &self,
        container: &dyn torpor_runtime::Resident,
        toggled: &torpor_gpu::cuda_checkpoint::Toggled,
    ) -> Result<(), GpuError> {
        cuda_resume_in(container, toggled).await
    }

    /// Remembers that `id`'s checkpoint holds toggled GPU state.
    pub fn save_toggled(
        &self,
        id: &SandboxId,
        toggled: &torpor_gpu::cuda_checkpoint::Toggled,
    ) -> std::io::Result<()> {
        self.state_store()?
            .put_gpu_toggled(id, toggled)
            .map_err(std::io::Error::other)
    }

    /// What `id`'s last checkpoint toggled, if anything.
    pub fn toggled(&self, id: &SandboxId) -> Option<torpor_gpu::cuda_checkpoint::Toggled> {
        self.store
            .as_ref()?
            .gpu_toggled(id)
            .map_err(
                |e| tracing::error!(sandbox = %id, error = %e, "unreadable cuda-checkpoint record"),
            )
            .ok()
            .flatten()
    }

    /// Forgets `id`'s toggled state (its GPU state is back, or a new checkpoint replaces it).
    pub fn clear_toggled(&self, id: &SandboxId) {
        if let Some(store) = &self.store {
            if let Err(e) = store.delete_gpu_toggled(id) {
                tracing::error!(sandbox = %id, error = %e, "cannot forget the cuda-checkpoint record");
            }
        }
    }

    /// The state store, which every node opened by [`NodeGpus::open`] has.
    fn state_store(&self) -> std::io::Result<&crate::store::Store> {
        self.store
            .as_ref()
            .ok_or_else(|| std::io::Error::other("no state store"))
    }
}

/// The processes of `container` holding a GPU context (an open `/dev/nvidia*`), as the
/// sandbox's own `/proc` shows them.
pub async fn cuda_holders(container: &dyn torpor_runtime::Resident) -> Result<Vec<u32>, GpuError> {
    use torpor_gpu::cuda_checkpoint::{holders_command, parse_holders};
    let out = run_in(container, holders_command(), 30_000).await?;
    parse_holders(&out).map_err(|e| GpuError::Driver(format!("cuda-checkpoint: {e}")))
}

/// The `cuda-checkpoint` `container` can run, looked for inside it (a cluster worker's
/// sandbox: its files are out of the controller's reach).
pub async fn cuda_tool_in(
    container: &dyn torpor_runtime::Resident,
) -> Result<Option<torpor_gpu::cuda_checkpoint::Tool>, GpuError> {
    use torpor_gpu::cuda_checkpoint::{locate_command, parse_located};
    Ok(parse_located(
        &run_in(container, locate_command(), 30_000).await?,
    ))
}

/// `cuda-checkpoint --toggle` for each of `pids` inside `container`: their GPU state moves to
/// host memory. All or nothing: on a failure the ones already toggled are toggled back.
pub async fn cuda_toggle(
    container: &dyn torpor_runtime::Resident,
    tool: torpor_gpu::cuda_checkpoint::Tool,
    pids: Vec<u32>,
) -> Result<torpor_gpu::cuda_checkpoint::Toggled, GpuError> {
    use torpor_gpu::cuda_checkpoint::{toggle_command, Toggled, TOGGLE_TIMEOUT_MS};
    let mut done = Vec::new();
    for pid in &pids {
        if let Err(e) = run_in(container, toggle_command(&tool, *pid), TOGGLE_TIMEOUT_MS).await {
            let undo = Toggled {
                tool: tool.clone(),
                pids: done,
            };
            if let Err(again) = cuda_resume_in(container, &undo).await {
                tracing::error!(error = %again, "cannot toggle GPU state back after a failed cuda-checkpoint");
            }
            return Err(e);
        }
        done.push(*pid);
    }
    tracing::info!(pids = ?pids, tool = %tool.in_sandbox, "GPU contexts moved to host memory by cuda-checkpoint");
    Ok(Toggled { tool, pids })
}

/// Brings the GPU state of toggled processes back onto the GPU (after a restore).
pub async fn cuda_resume_in(
    container: &dyn torpor_runtime::Resident,
    toggled: &torpor_gpu::cuda_checkpoint::Toggled,
) -> Result<(), GpuError> {
    for cmd in toggled.resume_commands() {
        run_in(
            container,
            cmd,
            torpor_gpu::cuda_checkpoint::TOGGLE_TIMEOUT_MS,
        )
        .await?;
    }
    Ok(())
}

/// Runs `cmd` inside the container through its agent; its stdout, or an error naming the
/// command when it does not exit 0.
async fn run_in(
    container: &dyn torpor_runtime::Resident,
    cmd: Vec<String>,
    timeout_ms: u64,
) -> Result<String, GpuError> {
    use torpor_runtime::proto::{ExecRequest, Reply, Request};
    let shown = cmd.join(" ");
    let (reply, body) = container
        .call(
            &Request::Exec(ExecRequest {
                cmd,
                env: BTreeMap::new(),
                cwd: None,
                timeout_ms: Some(timeout_ms),
                detach: false,
                stream: false,
            }),
            &[],
        )
        .await
        .map_err(|e| GpuError::Driver(format!("`{shown}`: {e}")))?;
    match reply {
        Reply::Exit {
            exit_code: Some(0),
            timed_out: false,
            stdout_len,
            ..
        } => {
            let split = (stdout_len as usize).min(body.len());
            Ok(String::from_utf8_lossy(&body[..split]).into_owned())
        }
        Reply::Exit {
            exit_code,
            timed_out,
            stdout_len,
            ..
        } => {
            let split = (stdout_len as usize).min(body.len());
            let stderr = String::from_utf8_lossy(&body[split..]);
            Err(GpuError::Driver(format!(
                "`{shown}` failed (exit {exit_code:?}{}): {}",
                if timed_out { ", timed out" } else { "" },
                stderr.trim()
            )))
        }
        other => Err(GpuError::Driver(format!(
            "`{shown}`: unexpected reply {other:?}"
        ))),
    }
}

/// Processes of a container torpor started (its memory cgroup, where runsc puts the sandbox).
fn cgroup_pids(container_id: &str) -> Vec<u32> {
    let dir = Path::new(torpor_runtime::cgroup::CGROUP_ROOT)
        .join("memory")
        .join(torpor_runtime::cgroup::PARENT)
        .join(container_id);
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// The pids among `pids` that hold open a file in `dir` whose name starts with `prefix`.
fn pids_holding_files(pids: &[u32], dir: &Path, prefix: &str) -> Vec<u32> {
    pids.iter()
        .copied()
        .filter(|pid| {
            let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
                return false;
            };
            fds.flatten().any(|fd| {
                std::fs::read_link(fd.path()).is_ok_and(|target| {
                    target.parent() == Some(dir)
                        && target
                            .file_name()
                            .and_then(|n| n.to_str())
                            .is_some_and(|n| n.starts_with(prefix))
                })
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use torpor_core::TenantId;
    use torpor_gpu::ids::MigUuid;
    use torpor_gpu::inject::MigDevice;
    use torpor_gpu::inventory::Gpu;
    use torpor_gpu::mig::MigInstance;
    use torpor_gpu::quota::{Amount, TenantQuota};

    #[test]
    fn finds_a_process_holding_a_device_like_file() {
        let dir = tempfile::tempdir().unwrap();
        let me = std::process::id();
        assert!(pids_holding_files(&[me], dir.path(), "nvidia").is_empty());
        let _open = std::fs::File::create(dir.path().join("nvidia0")).unwrap();
        assert_eq!(pids_holding_files(&[me], dir.path(), "nvidia"), vec![me]);
        assert!(pids_holding_files(&[me], dir.path(), "nvidiactl-").is_empty());
        // A pid that does not exist holds nothing.
        assert!(pids_holding_files(&[u32::MAX - 1], dir.path(), "nvidia").is_empty());
    }

    /// A node with one declared L4 (`GPU-a`), with its state directory.
    fn one_l4_node() -> (tempfile::TempDir, NodeGpus) {
        let dir = tempfile::tempdir().unwrap();
        let inv = dir.path().join("inv.toml");
        std::fs::write(
            &inv,
            "node = \"n\"\n[[gpu]]\nindex = 0\nuuid = \"GPU-a\"\nmodel = \"NVIDIA L4\"\nmemory_mib = 23034\nmig_capable = false\npci_bus_id = \"0000:01:00.0\"\n",
        )
        .unwrap();
        let gpus = NodeGpus::open(
            GpuConfig {
                inventory: Some(inv),
                ..GpuConfig::default()
            },
            dir.path(),
        )
        .unwrap()
        .unwrap();
        (dir, gpus)
    }

    #[test]
    fn acquire_release_wake_and_refusal_codes() {
        let (_dir, gpus) = one_l4_node();
        let tenant = TenantId::admin();
        let mig = serde_json::json!({"mode": "mig", "profile": "1g.10gb"});
        let err = NodeGpus::parse_request(Some(&gpus), &mig, &tenant).unwrap_err();
        assert_eq!(err.code(), "gpu_request_invalid");
        assert!(err.to_string().contains("no_mig_gpu"));
        let err = NodeGpus::parse_request(None, &mig, &tenant).unwrap_err();
        assert_eq!(err.code(), "gpu_not_configured");
        let whole = serde_json::json!({"mode": "whole"});
        let request = NodeGpus::parse_request(Some(&gpus), &whole, &tenant).unwrap();
        let (a, b) = (SandboxId::generate(), SandboxId::generate());
        gpus.save_request(&a, &request).unwrap();
        gpus.save_request(&b, &request).unwrap();
        assert!(gpus.acquire(&a).unwrap().is_empty());
        assert_eq!(gpus.env(&a)["NVIDIA_VISIBLE_DEVICES"], "GPU-a");
        let err = gpus.acquire(&b).unwrap_err();
        assert_eq!(err.code(), "gpu_unavailable");
        gpus.release(&a);
        assert!(gpus.env(&a).is_empty());
        assert_eq!(gpus.status(&tenant).sleeping, vec![a.to_string()]);
        gpus.acquire(&b).unwrap();
        assert_eq!(gpus.acquire(&a).unwrap_err().code(), "gpu_unavailable");
        gpus.forget(&b);
        gpus.acquire(&a).unwrap();
        assert_eq!(gpus.status(&tenant).allocations.len(), 1);
        assert!(gpus.metrics().contains("torpor_gpu_shares{"));
        // A ticket and the saved request are dropped on request (the sandbox went or woke on
        // another worker), but not while the sandbox holds its share here.
        assert!(
            !gpus.forget_elsewhere(&a),
            "a held share's sandbox lost its ticket"
        );
        assert!(gpus.request_of(&a).is_some());
        gpus.release(&a);
        assert_eq!(gpus.status(&tenant).sleeping, vec![a.to_string()]);
        assert!(gpus.forget_elsewhere(&a));
        assert!(gpus.status(&tenant).sleeping.is_empty());
        assert!(gpus.request_of(&a).is_none(), "its request kept");
        assert!(!gpus.forget_elsewhere(&a), "dropped twice");
        // A later start of it here brings its request again (a worker saves it at each start)
        // and is planned afresh.
        gpus.save_request(&a, &request).unwrap();
        gpus.acquire(&a).unwrap();
        // A refused start leaves nothing of a sandbox that is not this node's, and keeps the
        // request of one that holds a share here.
        gpus.save_request(&b, &request).unwrap();
        assert_eq!(gpus.acquire(&b).unwrap_err().code(), "gpu_unavailable");
        gpus.forget_refused(&b);
        assert!(
            gpus.request_of(&b).is_none(),
            "a refused start's request kept"
        );
        gpus.forget_refused(&a);
        assert!(gpus.request_of(&a).is_some(), "a holder's request dropped");
    }

    #[test]
    fn a_borrowed_share_is_reclaimed_at_once_or_named_for_the_caller_to_park() {
        let (_dir, gpus) = one_l4_node();
        let (lender, borrower) = (
            "lender".parse::<TenantId>().unwrap(),
            "borrower".parse::<TenantId>().unwrap(),
        );
        let l4 = Amount {
            memory_mib: 23034,
            compute: 700,
        };
        let id_of = |t: &TenantId| torpor_gpu::ids::TenantId::new(t.as_str()).unwrap();
        let quotas = QuotaBook::unlimited()
            .with(
                id_of(&lender),
                TenantQuota {
                    guaranteed: l4,
                    borrow_limit: None,
                },
            )
            .with(
                id_of(&borrower),
                TenantQuota {
                    guaranteed: Amount::default(),
                    borrow_limit: Some(l4),
                },
            );
        let whole = serde_json::json!({"mode": "whole"});
        let ask = |tenant: &TenantId| {
            let id = SandboxId::generate();
            let r = NodeGpus::parse_request(Some(&gpus), &whole, tenant).unwrap();
            gpus.save_request(&id, &r).unwrap();
            id
        };
        let (b1, l1, b2) = (ask(&borrower), ask(&lender), ask(&borrower));
        assert_eq!(
            gpus.acquire_or_name_victims(&b1, &quotas).unwrap(),
            Acquired::Held(Vec::new())
        );
        // The lender, within its guarantee, needs the borrowed L4: named, nothing taken.
        assert_eq!(
            gpus.acquire_or_name_victims(&l1, &quotas).unwrap(),
            Acquired::ReclaimFirst(vec![b1.clone()])
        );
        assert!(gpus.holds(&b1), "naming a victim took its share");
        assert!(!gpus.holds(&l1));
        // A borrower never reclaims from another.
        assert_eq!(
            gpus.acquire_or_name_victims(&b2, &quotas)
                .unwrap_err()
                .code(),
            "gpu_unavailable"
        );
        // Once the victim's share is given back (its container checkpointed), the start passes.
        gpus.release(&b1);
        assert_eq!(
            gpus.acquire_or_name_victims(&l1, &quotas).unwrap(),
            Acquired::Held(Vec::new())
        );
        gpus.forget(&l1);
        // A single machine's start reclaims at once and hands the victims to the engine.
        let l2 = ask(&lender);
        gpus.acquire_under(&b1, &quotas).unwrap();
        assert_eq!(gpus.acquire_under(&l2, &quotas).unwrap(), vec![b1.clone()]);
        assert!(gpus.holds(&l2) && !gpus.holds(&b1));
    }

    /// A node whose (declared) inventory stands in for NVML's, with its state directory.
    fn nvml_node(toml: &str) -> (tempfile::TempDir, NodeGpus) {
        let dir = tempfile::tempdir().unwrap();
        let inv = Inventory::from_toml(toml, "t").unwrap();
        let gpus = NodeGpus::open(
            GpuConfig {
                nvml_inventory: Some(inv),
                ..GpuConfig::default()
            },
            dir.path(),
        )
        .unwrap()
        .unwrap();
        (dir, gpus)
    }

    #[test]
    fn nvml_nodes_need_nvproxy_and_real_device_nodes() {
        let (_dir, mut gpus) = nvml_node("node = \"n\"\n[[gpu]]\nindex = 0\nuuid = \"GPU-a\"\nmodel = \"NVIDIA L4\"\nmemory_mib = 23034\nmig_capable = false\npci_bus_id = \"0000:01:00.0\"\nminor = 7\n");
        let whole = serde_json::json!({"mode": "whole"});
        let admin = TenantId::admin();
        // runsc without nvproxy: refused up front, with a stable code.
        let err = NodeGpus::parse_request(Some(&gpus), &whole, &admin).unwrap_err();
        assert_eq!(err.code(), "gpu_runtime_unsupported");
        assert!(err.to_string().contains("--nvproxy"), "{err}");
        gpus.set_nvproxy(true);
        let request = NodeGpus::parse_request(Some(&gpus), &whole, &admin).unwrap();
        let id = SandboxId::generate();
        // No share yet: nothing to give.
        assert!(gpus.runtime(&id).unwrap().devices.is_empty());
        gpus.save_request(&id, &request).unwrap();
        gpus.acquire(&id).unwrap();
        // The share names the control nodes and /dev/nvidia7; without a driver they are
        // missing, and the container is not started without them.
        let err = gpus.runtime(&id).unwrap_err();
        assert_eq!(err.code(), "gpu_driver_error");
        assert!(err.to_string().contains("gpu_device_missing"), "{err}");
        assert!(err.to_string().contains("/dev/nvidiactl"), "{err}");
        let held = gpus.lock().held.get(&id).unwrap().devices.clone();
        assert_eq!(
            held,
            [
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools",
                "/dev/nvidia7"
            ]
            .map(PathBuf::from)
        );
        // Declared inventories have no device nodes: nothing is passed through.
        drop(gpus);
    }

    /// A MIG driver that logs its calls where the test can read them.
    struct LoggingDriver(std::sync::Arc<Mutex<Vec<String>>>);

    impl MigDriver for LoggingDriver {
        fn create(&mut self, gpu: &Gpu, instance: MigInstance) -> Result<MigDevice, RealizeError> {
            self.0.lock().unwrap().push(format!(
                "create {} {} {}",
                gpu.index, instance.profile_id, instance.start
            ));
            Ok(MigDevice {
                uuid: MigUuid::new("MIG-11111111-2222-3333-4444-555555555555").unwrap(),
                gpu_instance_id: 2,
                compute_instance_id: 0,
            })
        }

        fn destroy(&mut self, gpu: &Gpu, device: &MigDevice) -> Result<(), RealizeError> {
            self.0
                .lock()
                .unwrap()
                .push(format!("destroy {} {}", gpu.index, device.gpu_instance_id));
            Ok(())
        }
    }

    #[test]
    fn nvml_nodes_create_mig_instances_through_their_driver() {
        let (_dir, mut gpus) = nvml_node("node = \"n\"\n[[gpu]]\nindex = 0\nuuid = \"GPU-a\"\nmodel = \"NVIDIA H100 80GB HBM3\"\nmemory_mib = 81559\nmig_capable = true\npci_bus_id = \"0000:01:00.0\"\n");
        gpus.set_nvproxy(true);
        let admin = TenantId::admin();
        let mig = serde_json::json!({"mode": "mig", "profile": "3g.40gb"});
        // Without an NVML MIG driver (no driver loaded): a clear refusal.
        let err = NodeGpus::parse_request(Some(&gpus), &mig, &admin).unwrap_err();
        assert_eq!(err.code(), "gpu_driver_error");
        let log = std::sync::Arc::new(Mutex::new(Vec::new()));
        gpus.set_mig_driver(Box::new(LoggingDriver(log.clone())));
        let request = NodeGpus::parse_request(Some(&gpus), &mig, &admin).unwrap();
        let id = SandboxId::generate();
        gpus.save_request(&id, &request).unwrap();
        gpus.acquire(&id).unwrap();
        assert_eq!(
            gpus.env(&id)["NVIDIA_VISIBLE_DEVICES"],
            "MIG-11111111-2222-3333-4444-555555555555"
        );
        gpus.release(&id);
        let calls = log.lock().unwrap().clone();
        assert_eq!(calls.len(), 2, "{calls:?}");
        assert!(calls[0].starts_with("create GPU0 9 "), "{calls:?}");
        assert_eq!(calls[1], "destroy GPU0 2");
    }
}
