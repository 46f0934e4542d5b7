//! Several controllers on one database (cluster mode): which controller holds a sandbox, and
//! what a controller does with a sandbox that another one holds.
//!
//! - A sandbox is **held** by at most one controller: the one that runs its transitions and
//!   holds its container's connection (`SandboxRecord::controller`). Every state write is a
//!   compare-and-set on the row's version ([`Engine::move_to`]) and names the holder: the
//!   writer for a resident or transitional state, nobody for a sleeping one (Parked,
//!   Suspended). So any controller may wake a sleeping sandbox, and when two try at once the
//!   first compare-and-set wins; the other hears [`ControlError::HeldElsewhere`].
//! - A call that reaches a controller for a sandbox another **live** controller holds is
//!   forwarded there whole ([`Engine::route`], used by the API's forwarding layer); one that
//!   finds it held by a **dead** controller (its heartbeat expired) takes it over first
//!   ([`Engine::take_over`]): the sandbox goes back to its last snapshot, as after a restart,
//!   its stale container is killed, and `last_error` says what was lost.
//! - Liveness: each controller renews its row in the store every third of its lease
//!   (`--controller-lost-after-ms`); the store's clock decides expiry, so controllers' clocks
//!   need not agree. The idle policy sweeps sandboxes of dead controllers, so none stays in
//!   a resident state that nobody can leave.
//! - Work done once for the cluster (each pool's scaling and lanes) runs under the pool's
//!   lease ([`pool_lease`]), spread over the live controllers (each takes up to its share;
//!   one over its share hands the excess over once the pool's agents have drained); another
//!   takes a lease when it expires. Controllers built before per-pool leases run every pool
//!   under the one [`POOLS_LEASE`].
//!
//! In embedded mode (`EngineConfig::controller` is `None`) nothing here applies: the holder is
//! always `None`, every sandbox is local, and the pools lease is always held.

use super::call_rates;
use super::*;
use crate::store::LiveController;

/// The lease under which a controller built before per-pool leases runs every pool and its
/// triggers. While an older controller holds it (a rolling upgrade), this one runs no pool.
pub const POOLS_LEASE: &str = "pools";
/// Each pool's lease: `pool:{tenant}/{name}` ([`pool_lease`]).
pub const POOL_LEASE_PREFIX: &str = "pool:";

/// A mutex's data, also after a panic elsewhere while it was held.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The lease under which one controller scales pool `name` of `tenant` and runs its triggers.
pub fn pool_lease(tenant: &TenantId, name: &str) -> String {
    format!("{POOL_LEASE_PREFIX}{tenant}/{name}")
}
/// How many resident sandboxes a controller over its share passes on per heartbeat period.
const BALANCE_BATCH: usize = 4;

/// A controller's resident sandboxes, and those of them a call used lately.
#[derive(Debug, Clone, Copy, Default)]
struct Holds {
    all: usize,
    busy: usize,
}

fn is_resident(r: &SandboxRecord) -> bool {
    matches!(r.state, SandboxState::Running | SandboxState::Frozen)
}

/// The controller with the most room left (among equals the first name), its room taken by
/// one; `None` when none has room.
fn take_most_room(room: &mut std::collections::BTreeMap<&str, usize>) -> Option<String> {
    // max_by_key keeps the last maximum: iterate reversed for the first name.
    let (to, r) = room
        .iter_mut()
        .rev()
        .filter(|(_, r)| **r > 0)
        .max_by_key(|(_, r)| **r)?;
    *r -= 1;
    Some(to.to_string())
}

/// How long the list of live controllers is reused before it is read again.
const LIVE_CACHE: Duration = Duration::from_millis(250);

/// Who this controller is, in cluster mode.
#[derive(Debug, Clone)]
pub struct ControllerIdentity {
    /// Its name (its certificate's): what `SandboxRecord::controller` holds.
    pub name: String,
    /// Where other controllers reach its public API (`host:port`): controllers built before
    /// the peer listener forward calls there, over plain HTTP.
    pub api_addr: String,
    /// Where other controllers reach its peer listener (`host:port`, HTTP/2 over mutual TLS)
    /// to forward calls for the sandboxes it holds.
    pub peer_addr: Option<String>,
    /// This process's run (random): the controllers table's row of the name is this run's
    /// alone, so two processes given one name cannot both act as it.
    pub run: String,
    /// Silence after which the others count it dead and take its sandboxes over.
    pub lost_after: Duration,
    /// After a restart, how long it waits for its workers to come back with the containers
    /// its records say are resident before it sends those sandboxes back to their snapshots
    /// (the worker-lost silence: a worker away longer is lost anyway).
    pub take_back_within: Duration,
    /// How old a checkpoint on a worker must be, not uploaded and referred to by no sandbox,
    /// before it is removed (a worker lost with it came back; a delete could not reach it).
    /// Also how often the workers' images are looked at.
    pub orphan_image_grace: Duration,
    /// Whether a pool it hands over takes its running agents along as they run (their holds
    /// pass: `--pool-hand-over pass`, the default) or puts them to sleep first for the next
    /// holder to wake (`drain`).
    pub pass_pool_agents: bool,
    /// Whether it passes resident sandboxes beyond its share to controllers under theirs
    /// (`--balance-sandboxes`, [`Engine::balance_holds`]).
    pub balance_sandboxes: bool,
}

/// Where a call for a sandbox is served.
#[derive(Debug, Clone, PartialEq)]
pub enum Route {
    /// Here (or the sandbox does not exist: the handler answers that).
    Local,
    /// On the live controller that holds the sandbox.
    Forward(LiveController),
}

/// Live controllers and when they were read.
type LiveList = Option<(Instant, Vec<LiveController>)>;

#[derive(Default)]
pub(super) struct ClusterState {
    live: Mutex<LiveList>,
    /// The pool leases this controller holds now ([`pool_lease`] names).
    pool_leases: Mutex<std::collections::HashSet<String>>,
    /// Of those, the ones it is handing over (it holds more than its share), each to the
    /// live controller under its share chosen for it: the pool's controller passes its
    /// running agents' holds there ([`Engine::pass_hold`]), then [`Engine::let_go_of_pool`]
    /// passes the lease itself.
    handing_over: Mutex<HashMap<String, String>>,
    /// Who held each pool's lease at the last heartbeat (for the pools' status).
    pool_holders: Mutex<HashMap<String, String>>,
    /// An older controller holds [`POOLS_LEASE`] (it runs every pool): none runs here.
    older_runs_pools: AtomicBool,
    /// Set when another live run took this controller's name: it must stop acting.
    identity_lost: AtomicBool,
    identity_lost_now: tokio::sync::Notify,
    /// Sandboxes this controller is to adopt whose worker has not joined it yet (a controller
    /// that just started), and since when: waited for up to the worker-lost silence.
    awaiting_worker: Mutex<HashMap<SandboxId, Instant>>,
    /// When [`Engine::balance_holds`] last looked (unix ms).
    balanced_at: AtomicI64,
    /// Since when each live controller has been seen alive without a break (by this one):
    /// sandboxes are passed only to a controller alive for longer than a worker's back-off.
    alive_since: Mutex<HashMap<String, Instant>>,
    /// The call rates of the sandboxes it holds ([`Engine::balance_holds`] samples them, the
    /// heartbeat says their total).
    rates: Mutex<call_rates::CallRates>,
    /// When this controller last renewed its lease ([`Engine::note_lease_renewed`]).
    lease_renewed_at: Mutex<Option<Instant>>,
    /// Set after a gap in its renewals: until then it counts no other controller dead
    /// ([`Engine::judges_others`]).
    judge_after: Mutex<Option<Instant>>,
}

impl Engine {
    /// This controller's name in cluster mode.
    pub fn controller_name(&self) -> Option<&str> {
        self.cfg.controller.as_ref().map(|c| c.name.as_str())
    }

    /// The holder a record in state `to` names: this controller while the sandbox is
    /// resident or moving, nobody while it sleeps.
    pub(super) fn holder_in(&self, to: SandboxState) -> Option<String> {
        match to {
            SandboxState::Parked | SandboxState::Suspended => None,
            _ => self.controller_name().map(str::to_string),
        }
    }

    /// Whether this controller scales pool `name` of `tenant` now (always, in embedded mode):
    /// it holds the pool's lease and is not handing it over.
    pub fn runs_pool(&self, tenant: &TenantId, name: &str) -> bool {
        if self.cfg.controller.is_none() {
            return true;
        }
        let lease = pool_lease(tenant, name);
        lock(&self.cluster.pool_leases).contains(&lease)
            && !lock(&self.cluster.handing_over).contains_key(&lease)
    }

    /// The live controller pool `name` of `tenant` is passing to, if this controller no longer
    /// scales it: the one it hands the pool over to, or the one that took the pool's lease.
    /// The pool's running agents are passed there as they are ([`Engine::pass_hold`]).
    pub fn pool_successor(&self, tenant: &TenantId, name: &str) -> Option<String> {
        let me = self
            .cfg
            .controller
            .as_ref()
            .filter(|c| c.pass_pool_agents)?;
        let me = me.name.as_str();
        let lease = pool_lease(tenant, name);
        if let Some(to) = lock(&self.cluster.handing_over).get(&lease) {
            return Some(to.clone());
        }
        lock(&self.cluster.pool_holders)
            .get(&lease)
            .filter(|h| *h != me)
            .cloned()
    }

    /// Called by pool `name`'s controller once it no longer scales the pool here and nothing
    /// of it is in motion (its agents passed on or asleep, no start or wake under way): a
    /// lease being handed over passes to the controller chosen for it, which scales the pool
    /// from its next heartbeat. Should that one be gone, the lease is released and a
    /// controller under its share takes it.
    pub fn let_go_of_pool(&self, tenant: &TenantId, name: &str) {
        let Some(me) = &self.cfg.controller else {
            return;
        };
        let lease = pool_lease(tenant, name);
        let Some(to) = lock(&self.cluster.handing_over).get(&lease).cloned() else {
            return;
        };
        let passed = match self.live_holder(&to) {
            Ok(Some(_)) => self
                .store
                .pass_lease(&lease, &me.name, &to, me.lost_after)
                .map_err(|e| e.to_string()),
            Ok(None) => Ok(false),
            Err(e) => Err(e.to_string()),
        };
        let passed = match passed {
            Ok(true) => true,
            Ok(false) => match self.store.release_lease(&lease, &me.name) {
                Ok(()) => false,
                Err(e) => {
                    tracing::warn!(controller = %me.name, pool = %lease, error = %e, "cannot release a pool's lease; trying again");
                    return;
                }
            },
            Err(e) => {
                tracing::warn!(controller = %me.name, pool = %lease, error = %e, "cannot pass a pool's lease on; trying again");
                return;
            }
        };
        if passed {
            tracing::info!(controller = %me.name, pool = %lease, to = %to, "handed a pool over (with its running agents)");
        } else {
            tracing::info!(controller = %me.name, pool = %lease, "handed a pool over (its controller-to-be is gone: the lease is free)");
        }
        lock(&self.cluster.handing_over).remove(&lease);
        lock(&self.cluster.pool_leases).remove(&lease);
        lock(&self.cluster.pool_holders).remove(&lease);
    }

    /// The controller that scales pool `name` of `tenant`, as of this controller's last
    /// heartbeat (`None` in embedded mode, or while nobody holds it).
    pub fn pool_holder(&self, tenant: &TenantId, name: &str) -> Option<String> {
        self.cfg.controller.as_ref()?;
        lock(&self.cluster.pool_holders)
            .get(&pool_lease(tenant, name))
            .cloned()
    }

    /// A pool nobody held at the last heartbeat: taken now if this controller is under its
    /// share (a pool made through this controller scales at once, not at the next heartbeat).
    pub fn take_free_pool(&self, tenant: &TenantId, name: &str) {
        let Some(me) = &self.cfg.controller else {
            return;
        };
        let lease = pool_lease(tenant, name);
        if self.cluster.older_runs_pools.load(Ordering::SeqCst)
            || lock(&self.cluster.pool_holders).contains_key(&lease)
        {
            return;
        }
        let share = match (self.store.pool_names(), self.live_controllers()) {
            (Ok(pools), Ok(live)) => pools.len().div_ceil(live.len().max(1)),
            _ => return,
        };
        if lock(&self.cluster.pool_leases).len() >= share {
            return;
        }
        // Another controller may have taken it meanwhile: then the next heartbeat says who.
        let taken = self
            .store
            .take_leases(std::slice::from_ref(&lease), &me.name, me.lost_after);
        if taken.is_ok_and(|t| !t.is_empty()) {
            tracing::info!(controller = %me.name, pool = %lease, "took a pool's lease");
            lock(&self.cluster.pool_leases).insert(lease.clone());
            lock(&self.cluster.pool_holders).insert(lease, me.name.clone());
        }
    }

    /// The live controllers, read at most every [`LIVE_CACHE`].
    fn live_controllers(&self) -> Result<Vec<LiveController>> {
        let mut cached = self.cluster.live.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, live)) = cached.as_ref() {
            if at.elapsed() < LIVE_CACHE {
                return Ok(live.clone());
            }
        }
        let live = self.store.live_controllers()?;
        *cached = Some((Instant::now(), live.clone()));
        Ok(live)
    }

    /// The live controllers read now, not from the cache: a controller counted dead has its
    /// sandboxes taken over, so that verdict is made on a list read after the records it
    /// concerns (a cached list may predate a controller that started since and has already
    /// made a sandbox).
    fn live_controllers_now(&self) -> Result<Vec<LiveController>> {
        *self.cluster.live.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.live_controllers()
    }

    /// Where `holder` answers, if it is alive (`None` only on a fresh read).
    fn live_holder(&self, holder: &str) -> Result<Option<LiveController>> {
        let find = |live: Vec<LiveController>| live.into_iter().find(|c| c.name == holder);
        match find(self.live_controllers()?) {
            Some(c) => Ok(Some(c)),
            None => Ok(find(self.live_controllers_now()?)),
        }
    }

    /// The worker recorded for sandbox `id` (cluster mode): where a resident sandbox this
    /// controller does not hold (yet) runs, for a read of its record.
    pub fn recorded_node(&self, id: &SandboxId) -> Option<String> {
        self.controller_name()?;
        self.store.sandbox_node(id).ok().flatten()
    }

    /// [`Engine::route`] with the live controllers read again now: for a call whose holder
    /// refused the connection (it may have just stopped and given up its row).
    pub async fn route_afresh(&self, id: &SandboxId) -> Result<Route> {
        self.live_controllers_now()?;
        self.route(id).await
    }

    /// Where a call for sandbox `id` is served. A sandbox held by a dead controller is taken
    /// over first (it is then served here).
    pub async fn route(&self, id: &SandboxId) -> Result<Route> {
        let Some(me) = self.controller_name() else {
            return Ok(Route::Local);
        };
        let Some(rec) = self.store.sandbox(id)? else {
            return Ok(Route::Local);
        };
        if rec.controller.as_deref() != Some(me) {
            // A container still run here for it is no longer this controller's.
            self.let_go_of(id).await;
        }
        match rec.controller.as_deref() {
            None => Ok(Route::Local),
            Some(holder) if holder == me => Ok(Route::Local),
            Some(holder) => match self.live_holder(holder)? {
                Some(live) => Ok(Route::Forward(live)),
                None if !self.judges_others() => Err(ControlError::Busy(format!(
                    "sandbox {id} is held by controller {holder}, whose lease ran out while this \
                     controller could not renew its own; retry in a moment"
                ))),
                None => {
                    let holder = holder.to_string();
                    self.take_over(id, &holder).await?;
                    Ok(Route::Local)
                }
            },
        }
    }

    /// Refuses to act on a sandbox another controller holds (its calls are forwarded there;
    /// one of a dead controller is taken over first, by the call's route or the policy).
    pub(super) fn check_held_here(&self, rec: &SandboxRecord) -> Result<()> {
        match rec.controller.as_deref() {
            Some(holder) if Some(holder) != self.controller_name() => Err(self.lost_race(&rec.id)),
            _ => Ok(()),
        }
    }

    /// The error for a write that lost its compare-and-set on `id`: held elsewhere now, or
    /// changed under the call.
    pub(super) fn lost_race(&self, id: &SandboxId) -> ControlError {
        let holder = self
            .store
            .sandbox(id)
            .ok()
            .flatten()
            .and_then(|r| r.controller)
            .filter(|h| Some(h.as_str()) != self.controller_name());
        match holder {
            Some(controller) => {
                let at = self.live_holder(&controller).ok().flatten();
                ControlError::HeldElsewhere { controller, at }
            }
            None => ControlError::Busy(format!("sandbox {id} changed while this call ran; retry")),
        }
    }

    /// Takes over a sandbox that `dead` held when it stopped renewing its lease. A Running or
    /// Frozen one whose container still runs on its worker is adopted as it is: nothing is
    /// lost. Otherwise it goes back to its last snapshot, as the dead controller's own restart
    /// would have done, and its container, wherever it still runs, is killed. A no-op when
    /// someone else got there first.
    pub(super) async fn take_over(&self, id: &SandboxId, dead: &str) -> Result<()> {
        let slot = self.slot(id);
        let mut guard = slot.state.clone().write_owned().await;
        let Some(mut rec) = self.store.sandbox(id)? else {
            return Ok(());
        };
        if rec.controller.as_deref() != Some(dead) {
            return Ok(()); // taken over already, or moved on
        }
        if matches!(rec.state, SandboxState::Running | SandboxState::Frozen)
            && self
                .adopt_or_await(&mut guard, &mut rec, "controller_lost")
                .await?
        {
            tracing::warn!(sandbox = %id, controller = dead, "adopted a lost controller's sandbox");
            self.metrics
                .crashes
                .with_label_values(&["controller_lost"])
                .inc();
            return Ok(());
        }
        tracing::warn!(sandbox = %id, controller = dead, state = %rec.state,
            "taking over a sandbox of a lost controller");
        self.metrics
            .crashes
            .with_label_values(&["controller_lost"])
            .inc();
        self.node.kill(&rec.container_id()).await;
        if rec.state.recovery() == torpor_core::Recovery::Keep {
            // Sleeping but still naming its holder: only the holder is cleared.
            rec.controller = None;
            return self.write_claimed(&mut rec);
        }
        let lost = format!("controller {dead}");
        self.resolve_interrupted(&mut rec, "controller_lost", Some(&lost))
    }

    /// Cluster mode, after this controller's restart: takes back the resident sandboxes its
    /// records name (or name a controller that is gone) as their workers register again,
    /// which keeps them running with nothing lost. The slots stay locked meanwhile (calls for
    /// them wait); those not back `within` go back to their last snapshots and their
    /// containers, should they turn up, are ended.
    ///
    /// The records were read at start, before any call is served, and their slots stay
    /// locked: nothing else here changes them meanwhile, and another controller's write (it
    /// took one over) fails the adoption's compare-and-set.
    pub(super) async fn take_back_after_restart(
        self: Arc<Self>,
        mut awaited: Vec<(OwnedRwLockWriteGuard<SlotState>, SandboxRecord)>,
        within: Duration,
    ) {
        let deadline = tokio::time::Instant::now() + within;
        let mut taken = 0;
        loop {
            let mut left = Vec::new();
            for (mut guard, mut rec) in awaited {
                let cause = restart_cause(&rec, self.controller_name());
                match self.adopt(&mut guard, &mut rec, cause).await {
                    Ok(true) => taken += 1,
                    Ok(false) => left.push((guard, rec)),
                    Err(e) => {
                        tracing::warn!(sandbox = %rec.id, error = %e, "cannot take a sandbox back")
                    }
                }
            }
            awaited = left;
            if awaited.is_empty() || tokio::time::Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(TAKE_BACK_POLL).await;
        }
        if taken > 0 {
            tracing::info!(
                sandboxes = taken,
                "running sandboxes taken back from their workers after a restart"
            );
        }
        for (_guard, rec) in awaited {
            let id = rec.id;
            // Read again: gone, moved on, or taken over by another controller meanwhile.
            let Ok(Some(mut rec)) = self.store.sandbox(&id) else {
                continue;
            };
            if !matches!(rec.state, SandboxState::Running | SandboxState::Frozen)
                || !self.reconciles(&rec).unwrap_or(false)
            {
                continue;
            }
            tracing::warn!(sandbox = %id, waited_ms = within.as_millis() as u64,
                "its container did not come back with a worker; back to its last snapshot");
            self.node.kill(&rec.container_id()).await;
            let cause = restart_cause(&rec, self.controller_name());
            if let Err(e) = self.resolve_interrupted(&mut rec, cause, Some("its container")) {
                tracing::warn!(sandbox = %id, error = %e, "cannot send a sandbox back to its snapshot");
            }
        }
    }

    /// Adopts the container of a resident sandbox whose holder stopped (`cause`: a lost
    /// controller, or this engine's previous run under live restore), if its node still runs
    /// it: the record names this controller, the sandbox stays in its state with its memory,
    /// processes and calls' effects. Its worker permit is taken even when none is free here
    /// ([`WorkerPool::acquire_running`]: the container holds its slot already). False when it
    /// could not (the caller sends the sandbox back to its snapshot instead).
    ///
    /// [`WorkerPool::acquire_running`]: crate::lot::WorkerPool::acquire_running
    pub(super) async fn adopt(
        &self,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
        rec: &mut SandboxRecord,
        cause: &str,
    ) -> Result<bool> {
        let Some(resident) = self
            .node
            .adopt(&rec.container_id(), rec.limits.memory_bytes())
            .await
        else {
            return Ok(false);
        };
        let permit = self.workers.acquire_running(&rec.tenant);
        // Its network's rules were made again; the sandbox's own policy goes back on.
        if let Some(policy) = self.store.network(&rec.id)? {
            if let Err(e) = resident.apply_policy(&policy).await {
                tracing::warn!(sandbox = %rec.id, error = %e, "cannot apply the network policy of a sandbox taken back");
                resident.destroy().await;
                return Ok(false);
            }
        }
        let frozen = rec.state == SandboxState::Frozen;
        // As the record says: its previous holder may have frozen it (or thawed it) after its
        // lease ran out, its own record write then refused.
        if let Err(e) = resident.set_frozen(frozen).await {
            tracing::warn!(sandbox = %rec.id, error = %e, "cannot set the frozen state of a sandbox taken back");
            return Ok(false);
        }
        let state = rec.state;
        if let Err(e) = self.move_to_on(rec, state, cause, resident.node()) {
            // Someone else took it meanwhile: the container stays theirs.
            drop(resident);
            return Err(e);
        }
        tracing::info!(sandbox = %rec.id, cause, container = resident.id(),
            worker = resident.worker(), state = %state, "took a running sandbox back; nothing was lost");
        self.install_live(guard, rec, resident, permit);
        if let Some(live) = guard.live.as_mut() {
            live.frozen = frozen;
        }
        Ok(true)
    }

    /// Gives the hold of resident sandbox `id` to live controller `to` as it is: no checkpoint,
    /// its container keeps running on its worker with its memory, processes and connections.
    /// Calls in flight here finish first (up to the drain timeout); the record then names `to`
    /// (a compare-and-set) and this controller lets the container go without touching it.
    /// From then on calls for it are forwarded to `to`, which adopts the container at the
    /// first of them or at its next policy tick ([`Engine::take_passed`]). Cluster mode only;
    /// a sleeping sandbox needs no hold (any controller wakes it).
    pub async fn pass_hold(&self, tenant: &TenantId, id: &SandboxId, to: &str) -> Result<()> {
        if self.controller_name().is_none_or(|me| me == to) {
            return Err(ControlError::Invalid(format!(
                "a sandbox's hold passes only to another controller, not {to:?}"
            )));
        }
        self.sandbox(tenant, id)?;
        let mut guard = self.lock_drained(id, "its hold stays here").await?;
        self.pass_locked(&mut guard, id, to).await
    }

    /// [`Engine::pass_hold`] with the sandbox's lock held.
    async fn pass_locked(
        &self,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
        id: &SandboxId,
        to: &str,
    ) -> Result<()> {
        let mut rec = self.store.sandbox(id)?.ok_or_else(|| not_found(id))?;
        self.check_held_here(&rec)?;
        let resident = guard.live.as_ref().is_some_and(|l| l.resident.alive());
        if !resident || !matches!(rec.state, SandboxState::Running | SandboxState::Frozen) {
            return Err(ControlError::Busy(format!(
                "sandbox {id} is {} here, not running: nothing to pass",
                rec.state
            )));
        }
        if self.live_holder(to)?.is_none() {
            return Err(ControlError::Busy(format!(
                "controller {to} is not alive: sandbox {id} stays here"
            )));
        }
        rec.controller = Some(to.to_string());
        self.write_claimed(&mut rec)?;
        let container = self.let_go(guard).await.expect("checked above");
        tracing::info!(sandbox = %id, %container, to, state = %rec.state,
            "passed a running sandbox's hold to another controller (no checkpoint)");
        Ok(())
    }

    /// Drops this controller's hold of the sandbox's container without touching it (another
    /// controller holds it now, or it is gone); its worker slot goes back to the lot. Returns
    /// the container's id (`None`: there was none). The caller holds the slot's write lock.
    pub(super) async fn let_go(
        &self,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
    ) -> Option<String> {
        let live = guard.live.take()?;
        let container = live.resident.id().to_string();
        live.resident.release().await;
        self.metrics.workers_busy.set(self.workers.busy() as i64);
        Some(container)
    }

    /// Whether the container this controller runs for `rec`'s sandbox is no longer its by
    /// the record (read under the slot's write lock): another controller holds the sandbox,
    /// or it went to sleep or woke on another container since. That happens to a controller
    /// that could not renew its lease for a while (a stalled process, a database it could not
    /// reach): another one counted it dead and adopted its running sandboxes meanwhile.
    /// Never in embedded mode.
    fn holds_stale(&self, guard: &OwnedRwLockWriteGuard<SlotState>, rec: &SandboxRecord) -> bool {
        let Some(me) = self.controller_name() else {
            return false;
        };
        guard.live.as_ref().is_some_and(|live| {
            rec.controller.as_deref() != Some(me)
                || !matches!(rec.state, SandboxState::Running | SandboxState::Frozen)
                || live.resident.id() != rec.container_id()
        })
    }

    /// Lets go of the container this controller runs for `rec`'s sandbox when the record no
    /// longer gives it to this controller ([`Engine::holds_stale`]): it is left running for
    /// its holder, never frozen, checkpointed or killed from here. Returns whether it did.
    /// The caller holds the slot's write lock and read `rec` under it.
    pub(super) async fn let_go_if_stale(
        &self,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
        rec: &SandboxRecord,
    ) -> bool {
        if !self.holds_stale(guard, rec) {
            return false;
        }
        let container = self.let_go(guard).await.unwrap_or_default();
        tracing::warn!(sandbox = %rec.id, %container, holder = ?rec.controller, state = %rec.state,
            "let go of a container this controller no longer holds (another controller took the sandbox over while this one could not renew its lease)");
        true
    }

    /// [`Engine::let_go_if_stale`] for sandbox `id` if this controller runs a container for
    /// it and its slot is free now (a slot in use is looked at by whoever uses it), with the
    /// record read again under the lock.
    async fn let_go_of(&self, id: &SandboxId) {
        let Some(slot) = self
            .slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
        else {
            return;
        };
        let Ok(mut guard) = slot.state.clone().try_write_owned() else {
            return;
        };
        if guard.live.is_none() {
            return;
        }
        if let Ok(Some(rec)) = self.store.sandbox(id) {
            self.let_go_if_stale(&mut guard, &rec).await;
        }
    }

    /// Lets go of every container this controller runs for a sandbox whose record no longer
    /// gives it to this controller (from the idle policy; `records`: every awake sandbox).
    /// Those its records give it are not read again.
    pub(super) async fn let_go_of_stale_holds(&self, records: &[SandboxRecord]) {
        let Some(me) = self.controller_name() else {
            return;
        };
        let mine: std::collections::HashSet<&SandboxId> = records
            .iter()
            .filter(|r| {
                r.controller.as_deref() == Some(me)
                    && matches!(r.state, SandboxState::Running | SandboxState::Frozen)
            })
            .map(|r| &r.id)
            .collect();
        let others: Vec<SandboxId> = self
            .slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .filter(|id| !mine.contains(id))
            .cloned()
            .collect();
        for id in others {
            self.let_go_of(&id).await;
        }
    }

    /// A resident sandbox this controller holds by its record but has no container of (its
    /// hold was passed here by [`Engine::pass_hold`]): its container is adopted on its worker
    /// as it is. One whose container is gone meanwhile goes back to its last snapshot (and is
    /// woken from it by the call that found it). The caller holds the slot's write lock.
    pub(super) async fn take_passed(
        &self,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
        mut rec: SandboxRecord,
    ) -> Result<()> {
        if self.adopt_or_await(guard, &mut rec, "handed_over").await? {
            return Ok(());
        }
        tracing::warn!(sandbox = %rec.id, state = %rec.state,
            "the container of a sandbox passed to this controller is gone");
        self.node.kill(&rec.container_id()).await;
        self.resolve_interrupted(&mut rec, "handed_over", Some("its container"))
    }

    /// [`Engine::take_passed`] if `rec` (read under the slot's write lock) is one: resident,
    /// held here by its record, no container here. Anything else is left as it is.
    pub(super) async fn adopt_if_passed(
        &self,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
        rec: &SandboxRecord,
    ) -> Result<()> {
        let passed = guard.live.is_none()
            && matches!(rec.state, SandboxState::Running | SandboxState::Frozen)
            && rec.controller.is_some()
            && rec.controller.as_deref() == self.controller_name();
        if passed {
            self.take_passed(guard, rec.clone()).await?;
        }
        Ok(())
    }

    /// Spreads the resident sandboxes over the live controllers (from the idle policy, once per
    /// heartbeat period; `records`: the awake sandboxes it read), their load first, then their
    /// number. The holder relays every call of its sandboxes, so their calls are what a
    /// controller's load is: each controller measures its sandboxes' call rates here and says
    /// their total at its heartbeat ([`call_rates`]); one over its share of the cluster's
    /// calls a second passes its busiest sandboxes to the least loaded controllers while each
    /// pass narrows the gap ([`call_rates::RateBalance`]). While a live controller says no rate
    /// (built before them, or not balancing), load is counted in *busy* sandboxes instead (a
    /// call within the controller-lost silence: its record's `last_active_at`, which every
    /// holder writes at its policy ticks): one at least two over its share of them passes the
    /// surplus, the idlest of them first. Then the number: a controller holding at least two
    /// more than its share (the cluster's count over the live controllers, rounded up; one over
    /// moves nothing, so small clusters do not churn) passes its idlest (weighing rates, only
    /// idle ones) down to its share, to the controllers with the most room under theirs, as
    /// they run ([`Engine::pass_hold`]); at most [`BALANCE_BATCH`] a period in all. Left out:
    /// pool agents (they go with their pool's lease), sandboxes in use (a call, a transition,
    /// an open connection), and controllers seen alive for less than the worker-lost silence
    /// (their workers may not have registered with them yet: the sandboxes would wait for
    /// them).
    pub(super) async fn balance_holds(&self, records: &[SandboxRecord]) {
        let Some(me) = self.cfg.controller.as_ref().filter(|c| c.balance_sandboxes) else {
            return;
        };
        let now = now_millis();
        let every = (me.lost_after / 3).as_millis() as i64;
        if now - self.cluster.balanced_at.load(Ordering::Relaxed) < every {
            return;
        }
        self.cluster.balanced_at.store(now, Ordering::Relaxed);
        let busy_since = now - me.lost_after.as_millis() as i64;
        // This controller's resident sandboxes: when a call last used each (from its slot,
        // fresher than its record), and whether it may move (not a pool's agent).
        let slots: HashMap<&SandboxId, (Arc<Slot>, i64, bool)> = {
            let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            records
                .iter()
                .filter(|r| is_resident(r))
                .filter(|r| r.controller.as_deref() == Some(me.name.as_str()))
                .filter_map(|r| {
                    let slot = slots.get(&r.id)?.clone();
                    let active = r
                        .last_active_at
                        .max(slot.last_active.load(Ordering::Relaxed));
                    let movable = !r.metadata.contains_key(crate::pools::POOL_METADATA_KEY);
                    Some((&r.id, (slot, active, movable)))
                })
                .collect()
        };
        // Their call rates, sampled once a period (the heartbeat says the total).
        let window = call_rates::WINDOW.max(me.lost_after / 3 * 2);
        let settle = window + me.lost_after / 3 * call_rates::SETTLE_PERIODS;
        let (rate_of, mine_rate, in_transit) = {
            let mut rates = lock(&self.cluster.rates);
            let now = Instant::now();
            rates.sample(
                slots
                    .iter()
                    .map(|(id, (slot, _, _))| ((*id).clone(), slot.calls.load(Ordering::Relaxed))),
                window,
                now,
            );
            let rate_of: HashMap<SandboxId, f64> = slots
                .keys()
                .map(|id| ((*id).clone(), rates.rate(id)))
                .collect();
            let mine = rates.total().unwrap_or(0.0);
            self.metrics.call_rate.set(mine);
            (rate_of, mine, rates.in_transit(settle, now))
        };
        let Ok(live) = self.live_controllers() else {
            return;
        };
        let settled: std::collections::HashSet<String> = {
            let mut since = lock(&self.cluster.alive_since);
            since.retain(|name, _| live.iter().any(|c| c.name == *name));
            live.iter()
                .filter(|c| {
                    since
                        .entry(c.name.clone())
                        .or_insert_with(Instant::now)
                        .elapsed()
                        >= me.take_back_within
                })
                .map(|c| c.name.clone())
                .collect()
        };
        // Each live controller's resident and busy sandboxes (this one's activity from its
        // slots, fresher than its records).
        let mut counts: BTreeMap<&str, Holds> = live
            .iter()
            .map(|c| (c.name.as_str(), Holds::default()))
            .collect();
        for r in records.iter().filter(|r| is_resident(r)) {
            let Some(holds) = r.controller.as_deref().and_then(|c| counts.get_mut(c)) else {
                continue;
            };
            let active = slots.get(&r.id).map_or(r.last_active_at, |(_, at, _)| *at);
            holds.all += 1;
            holds.busy += usize::from(active >= busy_since);
        }
        let n = live.len().max(1);
        let share = Holds {
            all: counts.values().map(|h| h.all).sum::<usize>().div_ceil(n),
            busy: counts.values().map(|h| h.busy).sum::<usize>().div_ceil(n),
        };
        let mine = counts.get(me.name.as_str()).copied().unwrap_or_default();
        let over = |have: usize, share: usize| if have > share + 1 { have - share } else { 0 };
        // Call rates when every live controller says its own (a controller built before them
        // says none: busy sandboxes are counted instead).
        let others_rates: Option<BTreeMap<String, f64>> = live
            .iter()
            .filter(|c| c.name != me.name)
            .map(|c| {
                let said = call_rates::said(c.call_rate?);
                let load = said + in_transit.get(&c.name).copied().unwrap_or(0.0);
                Some((c.name.clone(), load))
            })
            .collect();
        let mut by_rate = others_rates.map(|others| {
            let total = mine_rate + others.values().sum::<f64>();
            let receivers = others
                .into_iter()
                .filter(|(name, _)| settled.contains(name))
                .collect();
            call_rates::RateBalance::new(mine_rate, receivers, total, n)
        });
        let busy_over = over(mine.busy, share.busy);
        let all_over = over(mine.all, share.all);
        let load_over = match &by_rate {
            Some(bal) => bal.over(),
            None => busy_over > 0,
        };
        if !load_over && all_over == 0 {
            return;
        }
        let room = |of: fn(&Holds) -> usize, share: usize| -> BTreeMap<&str, usize> {
            counts
                .iter()
                .filter(|(n, _)| **n != me.name && settled.contains(**n))
                .map(|(n, h)| (*n, share.saturating_sub(of(h))))
                .collect()
        };
        let mut all_room = room(|h| h.all, share.all);
        let mut idlest: Vec<(i64, &SandboxId, Arc<Slot>)> = slots
            .into_iter()
            .filter(|(_, (_, _, movable))| *movable)
            .map(|(id, (slot, active, _))| (active, id, slot))
            .collect();
        idlest.sort_by_key(|(at, _, _)| *at);
        let mut batch = BALANCE_BATCH;
        let mut passed = std::collections::HashSet::new();
        if let Some(bal) = &mut by_rate {
            // The busiest first, each to the least loaded controller while that narrows the gap.
            let mut busiest: Vec<(f64, &SandboxId, &Arc<Slot>)> = idlest
                .iter()
                .map(|(_, id, slot)| (rate_of.get(*id).copied().unwrap_or(0.0), *id, slot))
                .filter(|(rate, _, _)| *rate > 0.0)
                .collect();
            busiest.sort_by(|a, b| b.0.total_cmp(&a.0));
            for (rate, id, slot) in busiest {
                if batch == 0 || !bal.over() {
                    break;
                }
                let Some(to) = bal.receiver(rate).map(str::to_string) else {
                    continue;
                };
                let mut only = BTreeMap::from([(to.as_str(), 1)]);
                if self.pass_one(id, slot, &mut only).await.is_none() {
                    continue;
                }
                tracing::info!(sandbox = %id, %to, calls_per_s = rate, "passed by its call rate");
                bal.moved(&to, rate);
                lock(&self.cluster.rates).note_pass(&to, rate, Instant::now());
                batch -= 1;
                passed.insert(id);
                if let Some(r) = all_room.get_mut(to.as_str()) {
                    *r = r.saturating_sub(1);
                }
            }
        } else {
            // Busy ones first (the idlest of them: the least likely to be in a call right now).
            let mut busy_room = room(|h| h.busy, share.busy);
            let mut left = busy_over.min(batch);
            for (_, id, slot) in idlest.iter().filter(|(at, _, _)| *at >= busy_since) {
                if left == 0 {
                    break;
                }
                let Some(to) = self.pass_one(id, slot, &mut busy_room).await else {
                    continue;
                };
                left -= 1;
                batch -= 1;
                passed.insert(*id);
                // Its number moved too.
                if let Some(r) = all_room.get_mut(to.as_str()) {
                    *r = r.saturating_sub(1);
                }
            }
        }
        // Then the number: the idlest (weighing rates, only idle ones: a busy one's move is
        // the rule above's to make).
        let mut left = over(mine.all - passed.len(), share.all).min(batch);
        let weighed = by_rate.is_some();
        for (_, id, slot) in idlest
            .iter()
            .filter(|(_, id, _)| !passed.contains(id))
            .filter(|(at, _, _)| !weighed || *at < busy_since)
        {
            if left == 0 {
                break;
            }
            if self.pass_one(id, slot, &mut all_room).await.is_some() {
                left -= 1;
            }
        }
    }

    /// Passes `id` to the controller with the most `room` (its room taken by one) if it is not
    /// in use and runs here; the controller it went to.
    async fn pass_one(
        &self,
        id: &SandboxId,
        slot: &Arc<Slot>,
        room: &mut BTreeMap<&str, usize>,
    ) -> Option<String> {
        let Ok(mut guard) = slot.state.clone().try_write_owned() else {
            return None; // in use
        };
        guard.live.as_ref()?;
        let to = take_most_room(room)?;
        match self.pass_locked(&mut guard, id, &to).await {
            Ok(()) => Some(to),
            Err(e) => {
                tracing::debug!(sandbox = %id, to, error = %e, "not passed on");
                // Not passed: its room is still there.
                if let Some(r) = room.get_mut(to.as_str()) {
                    *r += 1;
                }
                None
            }
        }
    }

    /// Adopts, from the idle policy, the sandboxes whose holds were passed here and that no
    /// call has used yet (a slot in use is left to its call).
    pub(super) async fn adopt_passed(&self, records: &[SandboxRecord]) {
        let Some(me) = self.controller_name() else {
            return;
        };
        for rec in records {
            if rec.controller.as_deref() != Some(me)
                || !matches!(rec.state, SandboxState::Running | SandboxState::Frozen)
            {
                continue;
            }
            let slot = self.slot(&rec.id);
            let Ok(mut guard) = slot.state.clone().try_write_owned() else {
                continue;
            };
            if guard.live.is_some() {
                continue;
            }
            // Read again under the lock: the record above may predate a transition.
            let Ok(Some(rec)) = self.store.sandbox(&rec.id) else {
                continue;
            };
            match self.adopt_if_passed(&mut guard, &rec).await {
                Ok(()) => {}
                Err(ControlError::Busy(why)) => {
                    tracing::debug!(sandbox = %rec.id, why, "a sandbox passed here waits for its worker")
                }
                Err(e) => {
                    tracing::warn!(sandbox = %rec.id, error = %e, "cannot take a sandbox passed to this controller")
                }
            }
        }
    }

    /// [`Engine::adopt`] for a sandbox whose holder let it go or died. When its container
    /// is not found because its worker has not joined this controller yet (this controller
    /// just started; workers register again within their back-off), `Busy` (the caller
    /// tries again: the policy's next tick, the client's retry) for up to the worker-lost
    /// silence, instead of sending a running sandbox back to its snapshot. False once its
    /// worker is reachable here and runs no such container, or that silence has passed.
    async fn adopt_or_await(
        &self,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
        rec: &mut SandboxRecord,
        cause: &str,
    ) -> Result<bool> {
        if self.adopt(guard, rec, cause).await? {
            lock(&self.cluster.awaiting_worker).remove(&rec.id);
            return Ok(true);
        }
        let within = self
            .cfg
            .controller
            .as_ref()
            .map_or(Duration::ZERO, |c| c.take_back_within);
        if let Some(worker) = self.store.sandbox_node(&rec.id)? {
            if !self.node.reaches_worker(&worker) {
                let since = *lock(&self.cluster.awaiting_worker)
                    .entry(rec.id.clone())
                    .or_insert_with(Instant::now);
                if since.elapsed() < within {
                    return Err(ControlError::Busy(format!(
                        "sandbox {} runs on worker {worker}, which has not joined this \
                         controller yet; retry in a moment",
                        rec.id
                    )));
                }
            }
        }
        lock(&self.cluster.awaiting_worker).remove(&rec.id);
        Ok(false)
    }

    /// Writes `rec` as it is (holder included) by compare-and-set.
    fn write_claimed(&self, rec: &mut SandboxRecord) -> Result<()> {
        match self.store.compare_and_set_sandbox(rec, rec.version) {
            Ok(v) => {
                rec.version = v;
                Ok(())
            }
            Err(e) if e.kind() == crate::store::StoreErrorKind::Conflict => {
                Err(self.lost_race(&rec.id))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Sandboxes of controllers that are gone, taken over (from the idle policy).
    pub(super) async fn sweep_lost_controllers(&self, records: &[SandboxRecord]) {
        let Some(me) = self.controller_name() else {
            return;
        };
        let held_elsewhere: Vec<&SandboxRecord> = records
            .iter()
            .filter(|r| r.controller.as_deref().is_some_and(|c| c != me))
            .collect();
        if held_elsewhere.is_empty() || !self.judges_others() {
            return;
        }
        let Ok(mut live) = self.live_controllers() else {
            return;
        };
        let absent = |live: &[LiveController]| {
            held_elsewhere.iter().any(|r| {
                let holder = r.controller.as_deref().unwrap_or_default();
                !live.iter().any(|c| c.name == holder)
            })
        };
        if absent(&live) {
            // A holder missing from the cached list may have started since: read it again.
            let Ok(now) = self.live_controllers_now() else {
                return;
            };
            live = now;
        }
        for rec in held_elsewhere {
            let holder = rec.controller.as_deref().unwrap_or_default();
            if live.iter().any(|c| c.name == holder) {
                continue;
            }
            if let Err(e) = self.take_over(&rec.id, holder).await {
                tracing::debug!(sandbox = %rec.id, error = %e, "takeover left to another controller");
            }
        }
    }

    /// Renews this controller's liveness and its leases until shutdown; a controller that
    /// cannot renew stops running pools (another takes the lease). One whose name another
    /// live run holds now stops: [`Engine::identity_lost`] resolves.
    pub(super) async fn run_heartbeat(self: Arc<Self>) {
        let Some(me) = self.cfg.controller.clone() else {
            return;
        };
        let every = me.lost_after / 3;
        let mut interval = tokio::time::interval(every);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            if self.shutting_down.load(Ordering::SeqCst) {
                return;
            }
            match self.heartbeat_once(&me, false) {
                Ok(true) => self.note_lease_renewed(&me),
                Ok(false) => {
                    tracing::error!(controller = %me.name, "another live controller process holds this controller's name: stopping (each controller needs a certificate of its own name)");
                    lock(&self.cluster.pool_leases).clear();
                    lock(&self.cluster.handing_over).clear();
                    self.cluster.identity_lost.store(true, Ordering::SeqCst);
                    self.cluster.identity_lost_now.notify_waiters();
                    return;
                }
                Err(e) => {
                    // Counted (`torpor_store_errors_total{store="state"}`, alert
                    // TorporStoreErrors) though no call needed the database meanwhile.
                    self.metrics.store_error("state");
                    tracing::warn!(error = %e, "cannot renew this controller's lease");
                    // Another controller takes its pools once their leases expire.
                    lock(&self.cluster.pool_leases).clear();
                    lock(&self.cluster.handing_over).clear();
                }
            }
        }
    }

    /// Records a renewal of this controller's lease. One that comes more than a lease after
    /// the one before (the database was out of reach, the process stalled) means its lease
    /// may have run out meanwhile, and so may every other controller's, for the same reason:
    /// for one lease from now it counts no other controller dead, giving each the time to
    /// renew. Two controllers back from one database outage would otherwise each take the
    /// other's sandboxes over (adopting them: nothing lost, but every call meanwhile refused).
    fn note_lease_renewed(&self, me: &ControllerIdentity) {
        let now = Instant::now();
        let before = lock(&self.cluster.lease_renewed_at).replace(now);
        if before.is_some_and(|at| now.duration_since(at) > me.lost_after) {
            *lock(&self.cluster.judge_after) = Some(now + me.lost_after);
            tracing::warn!(controller = %me.name, gap_ms = before.map_or(0, |at| now.duration_since(at).as_millis() as u64),
                "this controller renewed its lease after a gap longer than the lease: it counts no other controller lost for one lease more");
        }
    }

    /// Whether this controller may count a controller whose lease expired as dead (and take
    /// its sandboxes over): only while its own lease is fresh (renewed within a lease), and
    /// not within a lease of a gap in its renewals ([`Engine::note_lease_renewed`]).
    fn judges_others(&self) -> bool {
        let Some(me) = &self.cfg.controller else {
            return true;
        };
        let fresh =
            lock(&self.cluster.lease_renewed_at).is_some_and(|at| at.elapsed() <= me.lost_after);
        fresh && lock(&self.cluster.judge_after).is_none_or(|t| Instant::now() >= t)
    }

    /// Resolves if another live process takes this controller's name while it runs (the
    /// daemon then exits at once, without touching its sandboxes). Never in embedded mode.
    pub async fn identity_lost(&self) {
        loop {
            let notified = self.cluster.identity_lost_now.notified();
            if self.cluster.identity_lost.load(Ordering::SeqCst) {
                return;
            }
            notified.await;
        }
    }

    /// Claims this controller's row (false: another live run holds the name) and, once it
    /// holds it, renews the pools lease.
    fn heartbeat_once(&self, me: &ControllerIdentity, starting: bool) -> Result<bool> {
        let row = LiveController {
            name: me.name.clone(),
            api_addr: me.api_addr.clone(),
            peer_addr: me.peer_addr.clone(),
            // Said only by a controller that measures it (one that balances; before its
            // first measure it holds nothing it has measured).
            call_rate: lock(&self.cluster.rates)
                .total()
                .or(me.balance_sandboxes.then_some(0.0)),
        };
        if !self
            .store
            .claim_controller(&row, &me.run, starting, me.lost_after)?
        {
            return Ok(false);
        }
        self.renew_pool_leases(me)?;
        Ok(true)
    }

    /// Renews the pool leases this controller holds and takes free ones up to its share (the
    /// pools over the live controllers, rounded up), so pools spread over the controllers as
    /// they are made and as controllers stop. A controller over its share (another joined)
    /// hands the excess over: the pool's agents drain and sleep first (a pool's lanes run on
    /// one controller at a time, and only a sandbox's holder drives it), then the lease is
    /// released ([`Engine::let_go_of_pool`]) and a controller under its share takes it and
    /// wakes them.
    fn renew_pool_leases(&self, me: &ControllerIdentity) -> Result<()> {
        let leases = self.store.live_leases("pool")?;
        // An older controller runs every pool under the one `pools` lease: none here meanwhile.
        match leases.iter().find(|(n, _)| n == POOLS_LEASE) {
            Some((_, holder)) if *holder != me.name => {
                if !self.cluster.older_runs_pools.swap(true, Ordering::SeqCst) {
                    tracing::warn!(controller = %me.name, older = %holder, "a controller of an earlier version runs every pool (the `pools` lease): none runs here until it is gone");
                }
                *lock(&self.cluster.pool_leases) = Default::default();
                *lock(&self.cluster.pool_holders) = Default::default();
                *lock(&self.cluster.handing_over) = Default::default();
                return Ok(());
            }
            // This controller's own, from a run before an upgrade.
            Some(_) => self.store.release_lease(POOLS_LEASE, &me.name)?,
            None => {}
        }
        self.cluster.older_runs_pools.store(false, Ordering::SeqCst);
        let mut holders: HashMap<String, String> = leases
            .into_iter()
            .filter(|(n, _)| n.starts_with(POOL_LEASE_PREFIX))
            .collect();
        let pools: Vec<String> = self
            .store
            .pool_names()?
            .iter()
            .map(|(tenant, name)| pool_lease(tenant, name.as_str()))
            .collect();
        let live = self.live_controllers()?;
        let share = pools.len().div_ceil(live.len().max(1));
        let mut ask: Vec<String> = pools
            .iter()
            .filter(|p| holders.get(*p) == Some(&me.name))
            .cloned()
            .collect();
        // Free ones in an order of this controller's own, so that controllers taking at once
        // mostly ask for different pools.
        let mut free: Vec<&String> = pools.iter().filter(|p| !holders.contains_key(*p)).collect();
        free.sort_by_key(|p| {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (&me.name, p).hash(&mut h);
            h.finish()
        });
        let room = share.saturating_sub(ask.len());
        ask.extend(free.into_iter().take(room).cloned());
        let held: std::collections::HashSet<String> = self
            .store
            .take_leases(&ask, &me.name, me.lost_after)?
            .into_iter()
            .collect();
        for lease in &held {
            holders.insert(lease.clone(), me.name.clone());
        }
        self.hand_over_excess(me, &held, &holders, &live, share);
        let mut mine = lock(&self.cluster.pool_leases);
        for gone in mine.difference(&held) {
            tracing::info!(controller = %me.name, pool = %gone, "no longer scales a pool");
        }
        for new in held.difference(&mine) {
            tracing::info!(controller = %me.name, pool = %new, "scales a pool");
        }
        *mine = held;
        drop(mine);
        *lock(&self.cluster.pool_holders) = holders;
        Ok(())
    }

    /// Marks the leases this controller holds beyond its share for hand-over, each to a live
    /// controller with room under its share (the one with the most; none when no other has
    /// room: a pool is never let go for nobody to take). Those already being handed over
    /// count first; one whose controller-to-be is gone is kept here again.
    fn hand_over_excess(
        &self,
        me: &ControllerIdentity,
        held: &std::collections::HashSet<String>,
        holders: &HashMap<String, String>,
        live: &[LiveController],
        share: usize,
    ) {
        let mut handing = lock(&self.cluster.handing_over);
        // A lease lost meanwhile (expired, taken) is no longer this controller's to hand over.
        handing.retain(|l, to| held.contains(l) && live.iter().any(|c| c.name == *to));
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for holder in holders.values() {
            *counts.entry(holder.as_str()).or_default() += 1;
        }
        for to in handing.values() {
            *counts.entry(to.as_str()).or_default() += 1;
        }
        let mut room: std::collections::BTreeMap<&str, usize> = live
            .iter()
            .filter(|c| c.name != me.name)
            .map(|c| {
                let n = c.name.as_str();
                (n, share.saturating_sub(counts.get(n).copied().unwrap_or(0)))
            })
            .collect();
        let mut excess = (held.len() - handing.len()).saturating_sub(share);
        let mut candidates: Vec<&String> =
            held.iter().filter(|l| !handing.contains_key(*l)).collect();
        candidates.sort();
        for lease in candidates.into_iter().rev() {
            if excess == 0 {
                break;
            }
            let Some(to) = take_most_room(&mut room) else {
                break;
            };
            excess -= 1;
            tracing::info!(controller = %me.name, pool = %lease, to = %to, share, "hands a pool over to a controller under its share (passing its running agents first)");
            handing.insert(lease.clone(), to.to_string());
        }
    }

    /// Registers this controller as alive before it touches any sandbox (cluster mode). A
    /// name another live run holds is waited for until that run's row expires (a previous
    /// run of this controller that did not stop cleanly, at other addresses); still held
    /// after that: [`ControlError::IdentityInUse`].
    pub(super) async fn announce(&self) -> Result<()> {
        let Some(me) = &self.cfg.controller else {
            return Ok(());
        };
        let deadline = tokio::time::Instant::now() + me.lost_after + Duration::from_secs(1);
        let mut warned = false;
        loop {
            if self.heartbeat_once(me, true)? {
                *lock(&self.cluster.lease_renewed_at) = Some(Instant::now());
                return Ok(());
            }
            let holder = self
                .store
                .live_controllers()?
                .into_iter()
                .find(|c| c.name == me.name)
                .map_or_else(|| "?".to_string(), |c| c.api_addr);
            if tokio::time::Instant::now() >= deadline {
                return Err(ControlError::IdentityInUse {
                    name: me.name.clone(),
                    holder,
                });
            }
            if !warned {
                tracing::warn!(controller = %me.name, %holder, "this controller's name is held by another live run; waiting for its lease to expire");
                warned = true;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Gives up this controller's row and leases (a clean stop): the others take its
    /// sandboxes and pools at once instead of after the lease.
    pub(super) fn retire(&self) {
        if let Some(me) = &self.cfg.controller {
            lock(&self.cluster.handing_over).clear();
            let held: Vec<String> = lock(&self.cluster.pool_leases).drain().collect();
            for lease in held {
                let _ = self.store.release_lease(&lease, &me.name);
            }
            let _ = self.store.forget_controller(&me.name, &me.run);
        }
    }

    /// Whether this controller's restart reconcile may resolve `rec`: its own, nobody's, or a
    /// dead controller's (cluster mode); every sandbox in embedded mode.
    pub(super) fn reconciles(&self, rec: &SandboxRecord) -> Result<bool> {
        let (Some(me), Some(holder)) = (self.controller_name(), rec.controller.as_deref()) else {
            return Ok(true);
        };
        Ok(holder == me || self.live_holder(holder)?.is_none())
    }

    /// Whether another live controller exists now (cluster mode; read afresh: a restart
    /// drops interrupted template builds, a stop hands its sandboxes off, on this answer).
    pub fn others_alive(&self) -> Result<bool> {
        let Some(me) = self.controller_name() else {
            return Ok(false);
        };
        Ok(self.live_controllers_now()?.iter().any(|c| c.name != me))
    }
}

/// How often a restarted controller looks for its workers' containers again.
const TAKE_BACK_POLL: Duration = Duration::from_millis(200);

/// Why a restarted controller resolves `rec`: its own restart, or the loss of the controller
/// that held it.
fn restart_cause(rec: &SandboxRecord, me: Option<&str>) -> &'static str {
    if rec.controller.is_none() || rec.controller.as_deref() == me {
        "restart"
    } else {
        "controller_lost"
    }
}

#[cfg(test)]
mod tests {
    use super::take_most_room;
    use std::collections::BTreeMap;

    #[test]
    fn the_controller_with_the_most_room_is_taken_first_and_none_once_all_are_full() {
        let mut room: BTreeMap<&str, usize> = [("c1", 1), ("c2", 2), ("c3", 2)].into();
        // Most room first; among equals the first name.
        assert_eq!(take_most_room(&mut room).as_deref(), Some("c2"));
        assert_eq!(take_most_room(&mut room).as_deref(), Some("c3"));
        assert_eq!(room, [("c1", 1), ("c2", 1), ("c3", 1)].into());
        assert_eq!(take_most_room(&mut room).as_deref(), Some("c1"));
        assert_eq!(take_most_room(&mut room).as_deref(), Some("c2"));
        assert_eq!(take_most_room(&mut room).as_deref(), Some("c3"));
        assert_eq!(take_most_room(&mut room), None, "every one full");
        assert_eq!(take_most_room(&mut BTreeMap::new()), None);
    }
}
