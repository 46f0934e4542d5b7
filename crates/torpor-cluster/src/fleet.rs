//! The controller's workers: [`Fleet`], a [`Node`] made of every worker that registered with
//! this controller, so that `Engine::start_on(cfg, fleet)` runs sandboxes across machines.
//!
//! ```text
//!   worker ──Register/Heartbeat (mTLS, worker identity)──▶ Cluster service ──▶ Fleet
//!   worker ◀──────── Node calls (mTLS, controller identity) ── RemoteNode ◀──── Fleet.boot/restore
//! ```
//!
//! - **Joining.** A worker calls [`pb::cluster_server::Cluster::register`] with where its Node
//!   service listens and what it can run; its name is its certificate's, never a field. The
//!   controller dials it back (a [`RemoteNode`]), checks that the worker it reached carries the
//!   same name, and makes it `ready`. Registering again with another run id means the worker
//!   restarted: what it ran is gone and is reported so.
//! - **Health.** A worker heartbeats every [`FleetConfig::heartbeat`] with its load. One that is
//!   silent for [`FleetConfig::lost_after`] is `lost`: it gets nothing new and every container
//!   it held is reported on the event stream as [`NodeEvent::Lost`], which sends its sandbox
//!   back to its last snapshot (it resumes on another worker at its next call). A lost worker
//!   that comes back must register again, and its leftovers are removed first.
//! - **Reach.** Heartbeats show only that the worker can call the controller. The controller
//!   probes it back (an `Info` call every [`Fleet::probe_every`]); one its probes have not
//!   reached for [`FleetConfig::lost_after`] (a one-way partition, a firewall on its Node
//!   port) gets no new sandboxes and its heartbeats are answered "unknown", so that it is
//!   `lost` the same time later, as if silent: it fences its containers itself, or through
//!   another controller that still reaches it, before they resume elsewhere. It comes back by
//!   registering again, whose dial-back is the proof that it can be called.
//! - **Draining.** [`Fleet::drain`] keeps a worker's sandboxes where they are but sends it no
//!   new ones; it survives the worker's re-registration.
//! - **Placement.** Starts go through [`Placement`] (an index by free capacity): the worker that
//!   last ran the sandbox when it is ready and has room (its image is warm there), else the
//!   least loaded worker that fits. A start refused by a worker (no slot, unreachable) is tried
//!   once more elsewhere.
//!
//! Lock discipline: one `std` mutex over the members, never held across an await.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use tokio::sync::{mpsc, watch};
use tonic::{Request, Response, Status};
use torpor_core::NetworkPolicy;
use torpor_gpu::quota::{Amount, QuotaBook, TenantQuota};
use torpor_gpu::request::GpuRequest;
use torpor_runtime::conn::ConnError;
use torpor_runtime::net::NetStats;
use torpor_runtime::node::{
    sandbox_of, ImageHost, Launch, Node, NodeEvent, NodeInfo, PutImage, Resident, Uploaded,
};
use torpor_runtime::proto::{Reply, Request as AgentRequest};
use torpor_runtime::runsc::{ExitHandle, RuntimeError};
use torpor_runtime::warm::WarmStats;

use crate::ca::Role;
use crate::client::{Deadlines, RemoteConfig, RemoteNode};
use crate::drains::DrainBook;
use crate::fence::{FenceBook, Fenced, Fencer};
use crate::gpu_turn::{GpuTurnBook, Turn};
use crate::pb;
use crate::pb::cluster_server::{Cluster as ClusterRpc, ClusterServer};
use crate::placement::{Capacity, Load, Need, Placement, WorkerState, ANY_GPU};
use crate::reclaim::GpuReclaim;
use crate::server::{accept_verified, check_version, ServeError};
use crate::tickets::TicketBook;
use crate::tls::{PeerInfo, TlsSource};
use crate::MAX_MESSAGE;

/// How long a registration may take to reach the worker back (TCP, TLS, its info).
const DIAL_BACK: Duration = Duration::from_secs(5);

/// How a controller keeps its workers.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// How often workers heartbeat.
    pub heartbeat: Duration,
    /// Silence after which a worker is lost.
    pub lost_after: Duration,
    /// Silence after which a lost worker is forgotten: dropped from [`Fleet::nodes`] and the
    /// gauges, its connection closed (a machine scaled away). One that comes back later
    /// registers as a new worker.
    pub forget_lost_after: Duration,
    /// Deadlines of the calls to workers.
    pub deadlines: Deadlines,
    /// The snapshot store announced to workers at registration (`s3://…` or a directory
    /// every machine mounts at that path); `None`: images stay where controllers name them.
    pub store: Option<String>,
    /// Tenant GPU quotas, cluster-wide (`--gpu-quotas`); empty: none enforced.
    pub gpu_quotas: QuotaBook,
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            heartbeat: Duration::from_secs(1),
            lost_after: Duration::from_secs(10),
            forget_lost_after: Duration::from_secs(3600),
            deadlines: Deadlines::default(),
            store: None,
            gpu_quotas: QuotaBook::unlimited(),
        }
    }
}

/// One worker as `GET /v1/nodes` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NodeStatus {
    pub name: String,
    pub state: WorkerState,
    /// Where its Node service listens.
    pub addr: String,
    /// Sandboxes it runs at once.
    pub workers: u32,
    /// Sandboxes it runs now.
    pub busy: u32,
    pub memory_budget_bytes: u64,
    pub resident_memory_bytes: u64,
    /// Starts and checkpoints it runs at once: its cores.
    pub cores: u32,
    /// Thousandths of a core idle as placement counts it: its last report, less what was
    /// placed on it since (`None`: it reported none).
    pub cpu_idle_milli: Option<u32>,
    pub gpu_models: Vec<String>,
    pub labels: std::collections::BTreeMap<String, String>,
    /// What each tenant holds of its GPUs, as it last said.
    pub gpu_usage: crate::server::GpuUsage,
    /// Unix milliseconds of its last heartbeat.
    pub last_seen_at: u64,
    /// Once this controller counts it out of reach (its probes failed for
    /// [`FleetConfig::lost_after`]: it takes no new sandboxes, its heartbeats are refused),
    /// the unix milliseconds of the first failed probe; kept once it is lost, to say why;
    /// `None` otherwise.
    pub unreachable_since: Option<u64>,
}

/// What the ready workers offer together (the engine sizes its lot from it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FleetCapacity {
    pub slots: usize,
    pub memory_budget: u64,
    /// Starts and checkpoints the ready workers run at once together (their cores).
    pub cores: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("no worker named {0}")]
    UnknownWorker(String),
    /// The drain book (the controllers' database) could not keep the change.
    #[error("the drain could not be kept for the other controllers: {0}")]
    Book(String),
}

struct Member {
    addr: String,
    run_id: String,
    remote: Arc<RemoteNode>,
    last_seen: Instant,
    last_seen_at: SystemTime,
    /// The operator drains it (kept across re-registrations).
    drain: bool,
    lost: bool,
    /// Containers started on it through the fleet and not yet ended.
    held: std::collections::HashSet<String>,
    /// Containers it runs for other controllers of the database (its last heartbeat's count
    /// less this controller's): slots this controller's lot does not count.
    others: u32,
    /// Whether this controller can call it ([`Fleet::probe_workers`]).
    reach: Reach,
}

impl Member {
    /// Where placement keeps it: lost; draining (the operator's drain, or out of this
    /// controller's reach: no new sandboxes); else ready.
    fn placement_state(&self) -> WorkerState {
        if self.lost {
            WorkerState::Lost
        } else if self.drain || self.reach.unreachable {
            WorkerState::Draining
        } else {
            WorkerState::Ready
        }
    }

    /// What `GET /v1/nodes` says: a worker out of reach stays `ready` (or `draining`) until
    /// it is counted lost; `unreachable_since` says the rest.
    fn shown_state(&self) -> WorkerState {
        if self.lost {
            WorkerState::Lost
        } else if self.drain {
            WorkerState::Draining
        } else {
            WorkerState::Ready
        }
    }
}

/// This controller's probes of one worker.
#[derive(Debug, Default)]
struct Reach {
    /// A probe is out.
    probing: bool,
    /// When the last probe was sent.
    last_probe: Option<Instant>,
    /// When the first probe that failed since the last one answered was sent (and as wall
    /// time, for `GET /v1/nodes`).
    failing_since: Option<(Instant, SystemTime)>,
    /// Probes failed for [`FleetConfig::lost_after`]: its heartbeats are refused until it
    /// registers again.
    unreachable: bool,
}

#[derive(Default)]
struct Members {
    placement: Placement,
    workers: HashMap<String, Member>,
    /// Every container started through the fleet and not yet ended: its worker and the memory
    /// placement reserved for it.
    containers: HashMap<String, (String, u64)>,
    /// The worker that last ran each sandbox (its image is warm there).
    last_worker: HashMap<String, String>,
    /// Drains asked for workers that have not registered (yet).
    drains: std::collections::HashSet<String>,
    /// Snapshots uploaded through this controller and the worker that keeps a local copy of
    /// each (at most [`crate::images::MAX_LOCAL_COPIES`] per worker, as the worker keeps).
    copies: HashMap<String, String>,
    copies_by_worker: HashMap<String, std::collections::VecDeque<String>>,
    /// After this controller's restart: containers its records say were resident, with the
    /// worker the records put each on and whether that worker announced it since; kept when
    /// that worker comes back, until the engine adopts or kills them ([`Node::expect_back`]).
    expected: HashMap<String, (String, bool)>,
}

impl Members {
    /// Worker `name` and its connection, unless it is lost (or unknown): as a list to ask.
    fn live_worker(&self, name: &str) -> Vec<(String, Arc<RemoteNode>)> {
        self.workers
            .get(name)
            .filter(|w| !w.lost)
            .map(|w| (name.to_string(), w.remote.clone()))
            .into_iter()
            .collect()
    }

    /// The workers with GPUs that are not lost, but `except`.
    fn gpu_workers_but(&self, except: &str) -> Vec<(String, Arc<RemoteNode>)> {
        self.workers
            .iter()
            .filter(|(name, w)| {
                !w.lost
                    && name.as_str() != except
                    && self
                        .placement
                        .get(name)
                        .is_some_and(|(cap, _, _)| !cap.gpu_models.is_empty())
            })
            .map(|(name, w)| (name.clone(), w.remote.clone()))
            .collect()
    }
}

pub struct Fleet {
    me: Weak<Fleet>,
    tls: Arc<TlsSource>,
    cfg: FleetConfig,
    members: Mutex<Members>,
    events: mpsc::UnboundedSender<NodeEvent>,
    events_rx: Mutex<Option<mpsc::UnboundedReceiver<NodeEvent>>>,
    capacity: watch::Sender<FleetCapacity>,
    /// Serialises each worker's registrations (each dials the worker back), so one worker's
    /// two registrations never interleave while workers join side by side: one announcing
    /// an address that never answers holds up only itself.
    joining: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// One GPU start at a time per tenant under quotas, so that each sees the one before it
    /// in the usage its worker answered with.
    gpu_turns: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Fencing through the other controllers of the database ([`Fleet::attach_fencer`]);
    /// unset, a lost worker's containers are reported lost at once.
    fencer: std::sync::OnceLock<Arc<Fencer>>,
    /// A tenant's GPU starts take turns across the controllers of the database, with the
    /// holdings their starts reported ([`Fleet::attach_gpu_book`], [`crate::gpu_turn`]); unset,
    /// only this controller's own starts take turns.
    gpu_book: std::sync::OnceLock<(Arc<dyn GpuTurnBook>, String)>,
    /// Parks the sandboxes whose borrowed GPU shares a start needs back
    /// ([`Fleet::attach_reclaim`], [`crate::reclaim`]); unset, such a start is refused.
    reclaim: std::sync::OnceLock<Arc<dyn GpuReclaim>>,
    /// Tickets workers missed, kept for every controller ([`Fleet::attach_ticket_book`]).
    tickets: std::sync::OnceLock<Arc<dyn TicketBook>>,
    /// Drains kept for every controller ([`Fleet::attach_drain_book`]); unset, a drain holds
    /// on this controller only.
    drain_book: std::sync::OnceLock<Arc<dyn DrainBook>>,
    /// Bumped (under the members' lock) by each drain taken or lifted here, so a read of the
    /// book that began before it is not applied after it.
    drain_changes: std::sync::atomic::AtomicU64,
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Members {
    /// Forgets every container `worker` held (it is lost or restarted) and returns their ids.
    fn take_held(&mut self, worker: &str) -> Vec<String> {
        let held = self
            .workers
            .get_mut(worker)
            .map(|w| std::mem::take(&mut w.held))
            .unwrap_or_default();
        for c in &held {
            self.containers.remove(c);
        }
        held.into_iter().collect()
    }
}

/// The most cores a worker counts for (a registration saying more is taken as this many):
/// what it adds to the controllers' concurrent checkpoints and restores stays bounded.
pub const MAX_WORKER_CORES: u32 = 1024;

/// A start's GPU request, as the engine stored it.
fn gpu_request(g: &torpor_runtime::node::LaunchGpu) -> Result<GpuRequest, RuntimeError> {
    serde_json::from_str(&g.request).map_err(|e| RuntimeError::Gpu {
        code: "gpu_request_invalid".into(),
        message: format!("gpu: {e}"),
    })
}

/// Asks `worker` to drop its wake ticket of `sandbox`, in the background.
/// How long a worker's wake ticket is asked for again after a `ForgetGpuTickets` that did not
/// reach it (the worker unreachable, lost or restarting meanwhile).
const FORGET_RETRY_FOR: Duration = Duration::from_secs(3600);
/// The first pause before asking again; each next one doubles, up to [`FORGET_RETRY_MAX`].
const FORGET_RETRY_FIRST: Duration = Duration::from_secs(1);
const FORGET_RETRY_MAX: Duration = Duration::from_secs(60);

/// Asks worker `worker` to drop its wake ticket of `sandbox`, in the background, again and
/// again while the call fails, for [`FORGET_RETRY_FOR`]: each time through the worker's
/// connection as this fleet knows it then (a worker that restarted is dialled again); while it
/// is lost nothing is sent. Pending retries live in this controller's memory only.
fn spawn_forget_ticket(
    fleet: Weak<Fleet>,
    worker: String,
    remote: Arc<RemoteNode>,
    sandbox: String,
) {
    tokio::spawn(async move {
        let mut first = Some(remote);
        let ask = || {
            let remote = first
                .take()
                .or_else(|| fleet.upgrade()?.remote_named(&worker));
            let sandbox = sandbox.clone();
            async move {
                match remote {
                    Some(r) => r.forget_gpu_ticket(&sandbox).await,
                    None => Err("the worker is lost or gone".to_string()),
                }
            }
        };
        let retry = Retry {
            first: FORGET_RETRY_FIRST,
            max: FORGET_RETRY_MAX,
            for_: FORGET_RETRY_FOR,
        };
        let mut ask = ask;
        if ask().await.is_ok() {
            return;
        }
        // Missed: kept in the controllers' book too, so that a restart of this controller
        // within the hour does not leave the ticket behind (crate::tickets).
        let book = fleet.upgrade().and_then(|f| f.tickets.get().cloned());
        if book.is_some() {
            tracing::info!(%worker, %sandbox, "a worker missed a wake ticket's drop; kept for every controller to ask again");
        }
        on_book(&book, &worker, &sandbox, |b, w, s| b.keep(w, s)).await;
        tokio::time::sleep(FORGET_RETRY_FIRST).await;
        if let Err(error) = retry.run(ask).await {
            tracing::warn!(%worker, %sandbox, %error,
                "a worker kept a wake ticket it was asked to drop (gave up asking)");
        }
        on_book(&book, &worker, &sandbox, |b, w, s| b.done(w, s)).await;
    });
}

/// Runs a (blocking) call of the ticket book off the runtime's threads; a failure is logged.
async fn on_book(
    book: &Option<Arc<dyn TicketBook>>,
    worker: &str,
    sandbox: &str,
    call: fn(&dyn TicketBook, &str, &str) -> Result<(), String>,
) {
    let Some(book) = book.clone() else {
        return;
    };
    let (w, s) = (worker.to_string(), sandbox.to_string());
    let done = tokio::task::spawn_blocking(move || call(book.as_ref(), &w, &s)).await;
    if let Ok(Err(error)) | Err(error) = done.map_err(|e| e.to_string()) {
        tracing::warn!(%worker, %sandbox, %error, "cannot keep a ticket to drop in the book");
    }
}

/// Exponential backoff for a call that may fail for a while.
#[derive(Debug, Clone, Copy)]
struct Retry {
    first: Duration,
    max: Duration,
    /// Give up once this long has passed since the first attempt.
    for_: Duration,
}

impl Retry {
    /// Runs `attempt` until it succeeds or the time is up (its last error).
    async fn run<F, Fut>(self, mut attempt: F) -> Result<(), String>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<(), String>>,
    {
        let started = tokio::time::Instant::now();
        let mut pause = self.first;
        loop {
            let error = match attempt().await {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if started.elapsed() + pause > self.for_ {
                return Err(error);
            }
            tracing::debug!(%error, retry_in_ms = pause.as_millis() as u64, "asking again later");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(self.max);
        }
    }
}

/// What each of `tenants` (and every tenant `report` names) holds in `report` (nothing: zero),
/// by tenant.
fn holdings_to_record(
    tenants: &[String],
    report: &crate::server::GpuUsage,
) -> Vec<(String, Amount)> {
    let mut all: Vec<&String> = tenants.iter().chain(report.keys()).collect();
    all.sort();
    all.dedup();
    all.into_iter()
        .map(|t| (t.clone(), report.get(t).copied().unwrap_or_default()))
        .collect()
}

/// Parks `victims` side by side, each within [`RECLAIM_WAIT`].
async fn park_all(
    reclaim: &dyn GpuReclaim,
    victims: &[torpor_core::SandboxId],
    worker: &str,
    requester: Option<&str>,
) -> Result<(), String> {
    let parked = futures::future::join_all(victims.iter().map(|v| async move {
        match tokio::time::timeout(RECLAIM_WAIT, reclaim.park(v, worker, requester)).await {
            Ok(r) => r,
            Err(_) => Err(format!(
                "a borrower's park took over {} s",
                RECLAIM_WAIT.as_secs()
            )),
        }
    }))
    .await;
    parked.into_iter().collect()
}

/// How long a start waits for one borrower to be parked.
const RECLAIM_WAIT: Duration = Duration::from_secs(60);

fn quota_refusal(message: String) -> RuntimeError {
    RuntimeError::Gpu {
        code: "gpu_quota_exceeded".into(),
        message,
    }
}

impl Fleet {
    /// `GET /v1/gpus` of every worker with GPUs that is not lost (ready or draining), asked
    /// side by side, by name: its JSON as `viewer` may see it, or why it did not answer.
    pub async fn gpu_status(
        &self,
        viewer: &str,
    ) -> Vec<(String, Result<serde_json::Value, String>)> {
        let asked: Vec<(String, Arc<RemoteNode>)> = {
            let m = self.lock();
            m.placement
                .iter()
                .filter(|(_, cap, _, state)| {
                    *state != WorkerState::Lost && !cap.gpu_models.is_empty()
                })
                .filter_map(|(name, _, _, _)| {
                    let w = m.workers.get(name).filter(|w| !w.lost)?;
                    Some((name.to_string(), w.remote.clone()))
                })
                .collect()
        };
        let mut out: Vec<(String, Result<serde_json::Value, String>)> =
            futures::future::join_all(asked.into_iter().map(|(name, remote)| async move {
                let status = match remote.gpu_status(viewer).await {
                    Ok(Some(v)) => Ok(v),
                    Ok(None) => Err("the worker reports no GPUs".to_string()),
                    Err(e) => Err(e),
                };
                (name, status)
            }))
            .await;
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// The GPU models of every ready worker that has GPUs (one entry per GPU), by name.
    pub fn gpu_workers(&self) -> Vec<(String, Vec<String>)> {
        let m = self.lock();
        let mut out: Vec<(String, Vec<String>)> = m
            .placement
            .iter()
            .filter(|(_, cap, _, state)| *state == WorkerState::Ready && !cap.gpu_models.is_empty())
            .map(|(name, cap, _, _)| (name.to_string(), cap.gpu_models.clone()))
            .collect();
        out.sort();
        out
    }

    /// What `tenant` holds of the GPUs of every worker but `except` (`""`: of every worker), as
    /// the workers last said (a lost worker's sandboxes are gone with it), or as `stored` says
    /// where it holds a newer report (another controller's start; [`crate::gpu_turn`]).
    fn gpu_held_elsewhere(
        &self,
        tenant: &str,
        except: &str,
        stored: &[(String, u64, Amount)],
    ) -> Amount {
        let reports: Vec<(String, u64, crate::server::GpuUsage)> = {
            let m = self.lock();
            m.workers
                .iter()
                .filter(|(_, w)| !w.lost)
                .map(|(name, w)| {
                    let (seq, usage) = w.remote.gpu_usage_report();
                    (name.clone(), seq, usage)
                })
                .collect()
        };
        crate::gpu_turn::held_elsewhere(
            tenant,
            except,
            reports.iter().map(|(n, s, u)| (n.as_str(), *s, u)),
            stored,
        )
    }

    /// A worker's "no free GPU share" answered as the quota refusal it also is when the
    /// tenant already holds all its cluster-wide quota allows (every share costs compute):
    /// freeing a GPU would not let the start through. Holdings are the workers' last reports.
    fn quota_first(
        &self,
        e: RuntimeError,
        request: Option<&GpuRequest>,
        stored: &[(String, u64, Amount)],
    ) -> RuntimeError {
        let unavailable = matches!(&e, RuntimeError::Gpu { code, .. } if code == "gpu_unavailable");
        if !unavailable || !self.cfg.gpu_quotas.enforced() {
            return e;
        }
        let Some((tenant, quota)) = request
            .and_then(|r| r.tenant.as_ref())
            .and_then(|t| Some((t, self.cfg.gpu_quotas.tenants.get(t)?)))
        else {
            return e;
        };
        let (held, ceiling) = (
            self.gpu_held_elsewhere(tenant.as_str(), "", stored),
            quota.ceiling(),
        );
        if held.compute < ceiling.compute {
            return e;
        }
        quota_refusal(format!(
            "tenant {tenant} holds {} MiB and {} compute units of GPUs across the cluster, all its quota allows ({} MiB, {} compute units)",
            held.memory_mib, held.compute, ceiling.memory_mib, ceiling.compute
        ))
    }

    /// The quota book a GPU start on `worker` carries: the tenant's quota less what it holds on
    /// the other workers (returned beside it), so that the worker's own ledger enforces the
    /// cluster-wide limit. `None` when no quota is enforced; a refusal when the tenant may hold
    /// no GPU at all.
    fn gpu_quota_on(
        &self,
        request: &GpuRequest,
        worker: &str,
        stored: &[(String, u64, Amount)],
    ) -> Result<Option<(String, Amount)>, RuntimeError> {
        let book = &self.cfg.gpu_quotas;
        if !book.enforced() {
            return Ok(None);
        }
        let Some(tenant) = &request.tenant else {
            return Err(quota_refusal(
                "quotas are configured, so the request must name a tenant".into(),
            ));
        };
        let Some(quota) = book.tenants.get(tenant) else {
            return Err(quota_refusal(format!("tenant {tenant} has no GPU quota")));
        };
        let elsewhere = self.gpu_held_elsewhere(tenant.as_str(), worker, stored);
        let guaranteed = quota.guaranteed.saturating_sub(elsewhere);
        let ceiling = quota.ceiling().saturating_sub(elsewhere);
        let left = TenantQuota {
            guaranteed,
            borrow_limit: Some(ceiling.saturating_sub(guaranteed)),
        };
        let mut book = QuotaBook::unlimited().with(tenant.clone(), left);
        // Every other tenant holding a share on that worker, with its guarantee less what it
        // holds on the others: above its guarantee cluster-wide, its newest shares there are
        // borrowed, and a requester within its own may have them back (crate::reclaim).
        let here = self
            .remote_named(worker)
            .map(|r| r.gpu_usage_report().1)
            .unwrap_or_default();
        for other in here.keys().filter(|t| *t != tenant.as_str()) {
            let Ok(id) = torpor_gpu::ids::TenantId::new(other.as_str()) else {
                continue;
            };
            let Some(quota) = self.cfg.gpu_quotas.tenants.get(&id) else {
                continue;
            };
            let elsewhere = self.gpu_held_elsewhere(other, worker, &[]);
            let guaranteed = quota.guaranteed.saturating_sub(elsewhere);
            let ceiling = quota.ceiling().saturating_sub(elsewhere);
            book = book.with(
                id,
                TenantQuota {
                    guaranteed,
                    borrow_limit: Some(ceiling.saturating_sub(guaranteed)),
                },
            );
        }
        serde_json::to_string(&book)
            .map(|b| Some((b, elsewhere)))
            .map_err(|e| quota_refusal(format!("the quota does not encode: {e}")))
    }

    /// An empty fleet dialling workers as `tls`'s controller identity; starts the loss watch.
    pub fn new(tls: Arc<TlsSource>, cfg: FleetConfig) -> Arc<Fleet> {
        let (events, rx) = mpsc::unbounded_channel();
        let fleet = Arc::new_cyclic(|me| Fleet {
            me: me.clone(),
            tls,
            cfg,
            members: Mutex::default(),
            events,
            events_rx: Mutex::new(Some(rx)),
            capacity: watch::channel(FleetCapacity::default()).0,
            joining: Mutex::default(),
            gpu_turns: Mutex::default(),
            fencer: std::sync::OnceLock::new(),
            gpu_book: std::sync::OnceLock::new(),
            reclaim: std::sync::OnceLock::new(),
            tickets: std::sync::OnceLock::new(),
            drain_book: std::sync::OnceLock::new(),
            drain_changes: std::sync::atomic::AtomicU64::new(0),
        });
        let watch = Arc::downgrade(&fleet);
        let period = (fleet.cfg.heartbeat / 2).max(Duration::from_millis(50));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            loop {
                tick.tick().await;
                let Some(fleet) = watch.upgrade() else { return };
                fleet.mark_lost();
                fleet.forget_lost();
                fleet.probe_workers();
            }
        });
        fleet
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Members> {
        self.members.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fences workers this controller loses through the other controllers of `book` (the
    /// database they share), as controller `me`, and relays their orders to the workers this
    /// one hears ([`crate::fence`]). Once; later calls change nothing.
    pub fn attach_fencer(&self, book: Arc<dyn FenceBook>, me: String) {
        let fencer = Fencer::new(book, me, self.cfg.heartbeat);
        if self.fencer.set(fencer.clone()).is_ok() {
            fencer.spawn_sync();
        }
    }

    /// Makes a tenant's GPU starts under quotas take turns with the other controllers of
    /// `book` (this one named `me`), so that its quota holds across them (see
    /// [`crate::gpu_turn`]). Once.
    pub fn attach_gpu_book(&self, book: Arc<dyn GpuTurnBook>, me: String) {
        let _ = self.gpu_book.set((book, me));
    }

    /// Lets GPU starts of tenants within their guarantee have borrowers parked
    /// ([`crate::reclaim`]); once, at start.
    pub fn attach_reclaim(&self, reclaim: Arc<dyn GpuReclaim>) {
        let _ = self.reclaim.set(reclaim);
    }

    /// Keeps the wake tickets workers missed in `book` and sweeps it soon after the start and
    /// every [`crate::tickets::SWEEP_EVERY`] ([`crate::tickets`]); once, at start.
    pub fn attach_ticket_book(&self, book: Arc<dyn TicketBook>) {
        if self.tickets.set(book.clone()).is_err() {
            return;
        }
        let fleet = self.me.clone();
        tokio::spawn(async move {
            // The first sweep once the workers had time to register again after a restart.
            let mut every = tokio::time::interval_at(
                tokio::time::Instant::now() + crate::tickets::FIRST_SWEEP_AFTER,
                crate::tickets::SWEEP_EVERY,
            );
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(f) = fleet.upgrade() else {
                    return;
                };
                let swept = crate::tickets::sweep_once(book.as_ref(), |worker, sandbox| {
                    let remote = f.remote_named(&worker)?;
                    Some(async move { remote.forget_gpu_ticket(&sandbox).await })
                })
                .await;
                match swept {
                    Ok(s) if s.dropped + s.given_up > 0 => {
                        tracing::info!(
                            dropped = s.dropped,
                            given_up = s.given_up,
                            left = s.left,
                            "swept the wake tickets workers missed"
                        );
                    }
                    Ok(_) => {}
                    Err(error) => tracing::warn!(%error, "cannot sweep the wake tickets to drop"),
                }
            }
        });
    }

    /// A container whose tenant this controller does not know (one it adopted from a lost
    /// controller) left `worker`: what every tenant under a GPU quota holds there, as the
    /// release's answer reported, goes in the book, as [`Fleet::note_release`] writes the known
    /// tenant's. (Rows are kept only when newer, so writing the unchanged ones is harmless; a
    /// worker without GPUs writes nothing.)
    async fn note_release_of_unknown(&self, worker: &str) {
        let Some((book, _)) = self.gpu_book.get() else {
            return;
        };
        let remote = {
            let m = self.lock();
            let has_gpus = m
                .placement
                .get(worker)
                .is_some_and(|(cap, _, _)| !cap.gpu_models.is_empty());
            m.workers
                .get(worker)
                .filter(|w| has_gpus && !w.lost)
                .map(|w| w.remote.clone())
        };
        let Some(remote) = remote else {
            return;
        };
        let (seq, after) = remote.gpu_usage_report();
        let quota_tenants: Vec<String> = self
            .cfg
            .gpu_quotas
            .tenants
            .keys()
            .map(|t| t.as_str().to_string())
            .collect();
        for (tenant, held) in holdings_to_record(&quota_tenants, &after) {
            crate::gpu_turn::record(book.clone(), &tenant, worker, seq, held).await;
        }
    }

    /// A GPU sandbox of `tenant` gave its share on `worker` back (a checkpoint or destroy,
    /// whose answer carried the worker's usage after it): that report goes in the book, so
    /// that the next GPU start of `tenant`, on any controller, counts the share as gone.
    async fn note_release(&self, worker: &str, tenant: &str) {
        let Some((book, _)) = self.gpu_book.get() else {
            return;
        };
        let remote = self.lock().workers.get(worker).map(|w| w.remote.clone());
        let Some(remote) = remote else {
            return;
        };
        let (seq, usage) = remote.gpu_usage_report();
        let held = usage.get(tenant).copied().unwrap_or_default();
        crate::gpu_turn::record(book.clone(), tenant, worker, seq, held).await;
    }

    /// Sandbox `sandbox` is gone: the worker it last ran on (as this controller saw; else
    /// every GPU worker that is not lost) drops its wake ticket, in the background.
    pub fn forget_gpu_tickets(&self, sandbox: &str) {
        let asked: Vec<(String, Arc<RemoteNode>)> = {
            let mut m = self.lock();
            match m.last_worker.remove(sandbox) {
                Some(last) => m.live_worker(&last),
                None => m.gpu_workers_but(""),
            }
        };
        for (name, remote) in asked {
            spawn_forget_ticket(self.me.clone(), name, remote, sandbox.to_string());
        }
    }

    /// What the ready workers offer, as it changes.
    pub fn capacity(&self) -> watch::Receiver<FleetCapacity> {
        self.capacity.subscribe()
    }

    /// The lot's size: the ready workers' slots, less those other controllers of the database
    /// use (as the workers' heartbeats report them), so that two controllers do not both count
    /// one free slot.
    fn publish_capacity(&self, m: &Members) {
        let mut c = FleetCapacity::default();
        for (name, cap, _, state) in m.placement.iter() {
            if state == WorkerState::Ready {
                let others = m.workers.get(name).map_or(0, |w| w.others);
                c.slots += cap.slots.saturating_sub(others) as usize;
                c.memory_budget += cap.memory_budget;
                c.cores += cap.cores.max(1) as usize;
            }
        }
        self.capacity.send_if_modified(|old| {
            let changed = *old != c;
            *old = c;
            changed
        });
    }

    /// Every worker this controller knows, by name.
    pub fn nodes(&self) -> Vec<NodeStatus> {
        let m = self.lock();
        let mut out: Vec<NodeStatus> = m
            .workers
            .iter()
            .filter_map(|(name, w)| {
                let (cap, load, _) = m.placement.get(name)?;
                Some(NodeStatus {
                    name: name.clone(),
                    state: w.shown_state(),
                    addr: w.addr.clone(),
                    workers: cap.slots,
                    busy: load.busy,
                    memory_budget_bytes: cap.memory_budget,
                    resident_memory_bytes: load.reserved_memory,
                    cores: cap.cores,
                    cpu_idle_milli: load.cpu_idle_milli,
                    gpu_models: cap.gpu_models,
                    labels: cap.labels,
                    gpu_usage: w.remote.gpu_usage(),
                    last_seen_at: unix_ms(w.last_seen_at),
                    unreachable_since: w
                        .reach
                        .failing_since
                        .filter(|_| w.reach.unreachable)
                        .map(|(_, at)| unix_ms(at)),
                })
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Sends a worker no new sandboxes (`drain`), those it holds staying, or lifts that. Known
    /// workers only. With a drain book ([`Fleet::attach_drain_book`]) the change is kept there
    /// first, for every controller; a book that cannot keep it fails the call and changes
    /// nothing.
    pub fn set_drain(&self, name: &str, drain: bool) -> Result<NodeStatus, FleetError> {
        if !self.lock().workers.contains_key(name) {
            return Err(FleetError::UnknownWorker(name.to_string()));
        }
        if let Some(book) = self.drain_book.get() {
            book.set(name, drain).map_err(FleetError::Book)?;
        }
        {
            let mut m = self.lock();
            self.drain_changes.fetch_add(1, Ordering::SeqCst);
            if drain {
                m.drains.insert(name.to_string());
            } else {
                m.drains.remove(name);
            }
            self.apply_drain(&mut m, name);
        }
        if drain {
            tracing::info!(worker = name, "worker draining: no new sandboxes");
        } else {
            tracing::info!(
                worker = name,
                "worker's drain lifted: ready for new sandboxes"
            );
        }
        self.nodes()
            .into_iter()
            .find(|n| n.name == name)
            .ok_or_else(|| FleetError::UnknownWorker(name.to_string()))
    }

    /// Sends a worker no new sandboxes ([`Fleet::set_drain`]).
    pub fn drain(&self, name: &str) -> Result<NodeStatus, FleetError> {
        self.set_drain(name, true)
    }

    /// Puts a registered worker's state in line with `m.drains` (a lost one stays lost).
    fn apply_drain(&self, m: &mut Members, name: &str) {
        let drain = m.drains.contains(name);
        let Some(w) = m.workers.get_mut(name) else {
            return;
        };
        if w.drain == drain {
            return;
        }
        w.drain = drain;
        let state = w.placement_state();
        m.placement.set_state(name, state);
        self.publish_capacity(m);
    }

    /// Takes the drains in `book` as the fleet's: read now, then every
    /// [`crate::drains::SYNC_EVERY`], so a drain taken or lifted through another controller of
    /// the book holds here too ([`crate::drains`]). Once, at start; a book that cannot be read
    /// is tried again at the next tick (the drains as last read stay meanwhile).
    pub fn attach_drain_book(&self, book: Arc<dyn DrainBook>) {
        if self.drain_book.set(book.clone()).is_err() {
            return;
        }
        let before = self.drain_changes.load(Ordering::SeqCst);
        match book.drained() {
            Ok(drained) => self.set_drains(drained.into_iter().collect(), before),
            Err(error) => tracing::warn!(%error, "cannot read the drained workers"),
        }
        let fleet = self.me.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(crate::drains::SYNC_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut failing = false;
            loop {
                every.tick().await;
                let Some(f) = fleet.upgrade() else {
                    return;
                };
                let before = f.drain_changes.load(Ordering::SeqCst);
                let book = book.clone();
                // The book's calls block (a database round trip).
                let read = tokio::task::spawn_blocking(move || book.drained()).await;
                match read.map_err(|e| e.to_string()).and_then(|r| r) {
                    Ok(drained) => {
                        f.set_drains(drained.into_iter().collect(), before);
                        failing = false;
                    }
                    Err(error) if !failing => {
                        tracing::warn!(%error, "cannot read the drained workers");
                        failing = true;
                    }
                    Err(_) => {}
                }
            }
        });
    }

    /// Makes `drained`, read from the book when [`Fleet::drain_changes`] was `before`, the
    /// fleet's drains, applying each change; a read older than a drain taken here meanwhile
    /// is dropped (the next one sees it).
    fn set_drains(&self, drained: std::collections::HashSet<String>, before: u64) {
        let mut m = self.lock();
        if m.drains == drained || self.drain_changes.load(Ordering::SeqCst) != before {
            return;
        }
        let changed: Vec<String> = m.drains.symmetric_difference(&drained).cloned().collect();
        m.drains = drained;
        for name in changed {
            let drain = m.drains.contains(&name);
            if m.workers.contains_key(&name) {
                tracing::info!(worker = %name, drain, "drain changed through another controller");
            }
            self.apply_drain(&mut m, &name);
        }
    }

    /// Marks workers silent past the limit lost and reports their containers.
    fn mark_lost(&self) {
        let mut lost = Vec::new();
        {
            let mut m = self.lock();
            let now = Instant::now();
            let silent: Vec<(String, Duration)> = m
                .workers
                .iter()
                .filter(|(_, w)| !w.lost && now.duration_since(w.last_seen) >= self.cfg.lost_after)
                .map(|(n, w)| (n.clone(), now.duration_since(w.last_seen)))
                .collect();
            for (name, silent_for) in silent {
                if let Some(w) = m.workers.get_mut(&name) {
                    w.lost = true;
                }
                m.placement.set_state(&name, WorkerState::Lost);
                let held = m.take_held(&name);
                m.placement.report(&name, Load::default());
                lost.push((name, silent_for, held));
            }
            if !lost.is_empty() {
                self.publish_capacity(&m);
            }
        }
        for (worker, silent_for, held) in lost {
            tracing::warn!(%worker, silent_ms = silent_for.as_millis() as u64, containers = held.len(),
                "worker lost: its sandboxes go back to their last snapshots");
            let Some(fencer) = self.fencer.get().cloned() else {
                self.report_lost(&worker, silent_for, held);
                continue;
            };
            // Another controller may still hear it: the containers end through that one
            // before their sandboxes resume elsewhere.
            let me = self.me.clone();
            tokio::spawn(async move {
                let outcome = fencer.fence(&worker, &held).await;
                match &outcome {
                    Fenced::Confirmed => tracing::info!(%worker, containers = held.len(),
                        "the lost worker's containers were ended through another controller"),
                    Fenced::Nothing | Fenced::NoOneHearsIt => {}
                    Fenced::Unconfirmed => tracing::warn!(%worker, containers = held.len(),
                        "another controller handed the lost worker its fence orders, and it did not confirm them in time"),
                    Fenced::Failed(e) => tracing::warn!(%worker, error = %e,
                        "cannot order the lost worker's containers fenced"),
                }
                if let Some(fleet) = me.upgrade() {
                    fleet.report_lost(&worker, silent_for, held);
                }
            });
        }
    }

    /// How often each worker is probed: four times within [`FleetConfig::lost_after`] (2.5 s
    /// by default; an `Info` call on the connection other calls take, fewer calls than the
    /// heartbeats), one probe out at a time, each with half of `lost_after` to answer (a worker
    /// slow to answer is not taken for one out of reach, as a late heartbeat is not).
    pub fn probe_every(&self) -> Duration {
        (self.cfg.lost_after / 4).max(Duration::from_millis(50))
    }

    /// Probes the workers whose last probe is older than [`Fleet::probe_every`] (but those
    /// lost or already out of reach: their registration is the next probe).
    fn probe_workers(&self) {
        let every = self.probe_every();
        let now = Instant::now();
        let due: Vec<(String, Arc<RemoteNode>)> = {
            let mut m = self.lock();
            m.workers
                .iter_mut()
                .filter(|(_, w)| {
                    !w.lost
                        && !w.reach.unreachable
                        && !w.reach.probing
                        && w.reach
                            .last_probe
                            .is_none_or(|t| now.duration_since(t) >= every)
                })
                .map(|(name, w)| {
                    w.reach.probing = true;
                    w.reach.last_probe = Some(now);
                    (name.clone(), w.remote.clone())
                })
                .collect()
        };
        let deadline = (self.cfg.lost_after / 2)
            .max(every)
            .min(self.cfg.deadlines.quick);
        for (name, remote) in due {
            let fleet = self.me.clone();
            tokio::spawn(async move {
                let answer = remote.probe(deadline).await;
                if let Some(fleet) = fleet.upgrade() {
                    fleet.probed(&name, &remote, now, answer);
                }
            });
        }
    }

    /// A probe sent at `sent` to `remote` (worker `name`) came back with `answer`.
    fn probed(
        &self,
        name: &str,
        remote: &Arc<RemoteNode>,
        sent: Instant,
        answer: Result<(), Status>,
    ) {
        let mut m = self.lock();
        let m = &mut *m;
        // Unless the worker registered again meanwhile (a new connection, probed afresh).
        let Some(w) = m
            .workers
            .get_mut(name)
            .filter(|w| Arc::ptr_eq(&w.remote, remote))
        else {
            return;
        };
        w.reach.probing = false;
        let error = match answer {
            Ok(()) => {
                if w.reach.failing_since.take().is_some() && !w.reach.unreachable {
                    tracing::info!(worker = %name, "the worker answers this controller's probes again");
                }
                return;
            }
            Err(st) => st,
        };
        let since = w
            .reach
            .failing_since
            .get_or_insert_with(|| (sent, SystemTime::now() - sent.elapsed()))
            .0;
        if w.lost || w.reach.unreachable || since.elapsed() < self.cfg.lost_after {
            tracing::debug!(worker = %name, error = %error.message(), "a probe of the worker failed");
            return;
        }
        w.reach.unreachable = true;
        let state = w.placement_state();
        tracing::warn!(worker = %name, failing_ms = since.elapsed().as_millis() as u64,
            error = %error.message(),
            "this controller cannot call the worker that heartbeats to it: no new sandboxes there, its heartbeats refused until it can be called (lost after the same time again)");
        m.placement.set_state(name, state);
        self.publish_capacity(m);
    }

    /// Drops the workers lost for [`FleetConfig::forget_lost_after`]: what this controller
    /// keeps about each (its place in the index, where sandboxes last ran, its local copies)
    /// and its connection, which otherwise keeps trying to follow its events.
    fn forget_lost(&self) {
        let after = self.cfg.forget_lost_after;
        let mut m = self.lock();
        let m = &mut *m;
        let gone: Vec<String> = m
            .workers
            .iter()
            .filter(|(_, w)| w.lost && w.last_seen.elapsed() >= after)
            .map(|(name, _)| name.clone())
            .collect();
        for name in &gone {
            let Some(w) = m.workers.remove(name) else {
                continue;
            };
            let silent_s = w.last_seen.elapsed().as_secs();
            tokio::spawn(async move { w.remote.shutdown().await });
            m.placement.remove(name);
            m.last_worker.retain(|_, on| on != name);
            for snapshot in m.copies_by_worker.remove(name).unwrap_or_default() {
                if m.copies.get(&snapshot) == Some(name) {
                    m.copies.remove(&snapshot);
                }
            }
            tracing::info!(worker = %name, silent_s, "forgot a worker lost this long (it registers as new if it comes back)");
        }
        if !gone.is_empty() {
            self.publish_capacity(m);
        }
    }

    /// Tells the engine that `held`, on `worker`, are gone.
    fn report_lost(&self, worker: &str, silent_for: Duration, held: Vec<String>) {
        for container_id in held {
            let _ = self.events.send(NodeEvent::Lost {
                container_id,
                worker: worker.to_string(),
                silent_for,
            });
        }
    }

    fn is_lost(&self, worker: &str) -> bool {
        self.lock().workers.get(worker).is_none_or(|w| w.lost)
    }

    /// A registration: dials the worker back, checks it is who called, makes it ready.
    async fn register(
        &self,
        caller: &PeerInfo,
        req: pb::RegisterRequest,
    ) -> Result<pb::RegisterReply, Status> {
        let name = caller.identity.name.to_string();
        let addr = node_addr(&req.node_addr, caller.addr)?;
        let turn = {
            let mut j = self.joining.lock().unwrap_or_else(|p| p.into_inner());
            j.retain(|_, m| Arc::strong_count(m) > 1);
            j.entry(name.clone()).or_default().clone()
        };
        let _one = turn.lock().await;
        let same = {
            let m = self.lock();
            m.workers.get(&name).is_some_and(|w| {
                w.run_id == req.run_id && w.addr == addr && !w.lost && !w.reach.unreachable
            })
        };
        if !same {
            let dial = RemoteNode::connect(
                RemoteConfig {
                    deadlines: self.cfg.deadlines.clone(),
                    ..RemoteConfig::new(addr.clone())
                },
                self.tls.clone(),
            );
            let remote = tokio::time::timeout(DIAL_BACK, dial)
                .await
                .map_err(|_| {
                    Status::unavailable(format!(
                        "the worker did not answer at {addr} within {DIAL_BACK:?}"
                    ))
                })?
                .map_err(|e| {
                    Status::unavailable(format!("cannot reach the worker back at {addr}: {e}"))
                })?;
            if remote.worker_name() != name {
                tracing::warn!(caller = %name, reached = remote.worker_name(), %addr,
                    "a worker registered another worker's address; refused");
                return Err(Status::permission_denied(
                    "the worker at that address is not the caller",
                ));
            }
            // Live restore: containers this controller still holds that outlived the worker's
            // restart stay, reached through the node that already serves their residents; so
            // do those its engine expects back after the controller's own restart (for the
            // engine to adopt).
            let (kept, claimed) = {
                let mut m = self.lock();
                let mut claimed = Vec::new();
                for c in &req.containers {
                    // Only where the records put it: no worker claims another's container.
                    if let Some((on, announced)) = m.expected.get_mut(c) {
                        if *on == name {
                            *announced = true;
                            claimed.push(c.clone());
                        }
                    }
                }
                let kept: (Option<Arc<RemoteNode>>, Vec<String>) = match m.workers.get(&name) {
                    Some(w) if !w.lost && !req.containers.is_empty() => (
                        Some(w.remote.clone()),
                        req.containers
                            .iter()
                            .filter(|c| w.held.contains(*c))
                            .cloned()
                            .collect(),
                    ),
                    _ => (None, Vec::new()),
                };
                (kept, claimed)
            };
            let (remote, kept) = match kept {
                (Some(previous), kept) if !kept.is_empty() => {
                    previous.retarget(&remote);
                    (previous, kept)
                }
                _ => {
                    if let Some(events) = remote.take_events() {
                        let fleet = self.me.clone();
                        tokio::spawn(forward_events(fleet, events));
                    }
                    (Arc::new(remote), Vec::new())
                }
            };
            // Anything else it still runs was started for a run this controller no longer
            // tracks (a restart, or containers already reported lost): remove it.
            let keep: Vec<String> = kept.iter().chain(&claimed).cloned().collect();
            let removed = remote.reconcile_keeping(&[], &keep).await;
            let gone: Vec<String>;
            {
                let mut m = self.lock();
                let held: Vec<String> = m
                    .workers
                    .get_mut(&name)
                    .map(|w| std::mem::take(&mut w.held))
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|c| !kept.contains(c))
                    .collect();
                for c in &held {
                    m.containers.remove(c);
                }
                gone = held;
                let drain = m.drains.contains(&name);
                let previous = m.workers.insert(
                    name.clone(),
                    Member {
                        addr: addr.clone(),
                        run_id: req.run_id.clone(),
                        remote: remote.clone(),
                        last_seen: Instant::now(),
                        last_seen_at: SystemTime::now(),
                        drain,
                        lost: false,
                        held: kept.iter().cloned().collect(),
                        others: 0,
                        reach: Reach::default(),
                    },
                );
                if let Some(p) = previous.filter(|p| !Arc::ptr_eq(&p.remote, &remote)) {
                    let old = p.remote.clone();
                    tokio::spawn(async move { old.shutdown().await });
                }
                m.placement.upsert(
                    &name,
                    Capacity {
                        slots: req.slots,
                        memory_budget: req.memory_budget,
                        cores: req.cores.min(MAX_WORKER_CORES),
                        gpu_models: req.gpu_models.clone(),
                        labels: req.labels.clone().into_iter().collect(),
                    },
                );
                m.placement.report(&name, Load::default());
                m.placement.set_state(
                    &name,
                    if drain {
                        WorkerState::Draining
                    } else {
                        WorkerState::Ready
                    },
                );
                // The kept containers hold their slots again.
                for c in &kept {
                    if let Some(&(_, memory)) = m.containers.get(c) {
                        m.placement.reserve(&name, memory);
                    }
                }
                self.publish_capacity(&m);
            }
            self.report_lost(&name, Duration::ZERO, gone);
            tracing::info!(worker = %name, %addr, slots = req.slots, memory_budget = req.memory_budget,
                removed, kept = kept.len(), expected_back = claimed.len(), "worker registered");
        }
        Ok(pb::RegisterReply {
            controller: self.tls.identity().name.to_string(),
            heartbeat_ms: self.cfg.heartbeat.as_millis() as u64,
            store: self.cfg.store.clone().unwrap_or_default(),
        })
    }

    fn heartbeat(&self, caller: &PeerInfo, req: pb::HeartbeatRequest) -> pb::HeartbeatReply {
        let name = caller.identity.name.as_str();
        let mut m = self.lock();
        let Some(w) = m.workers.get_mut(name) else {
            return pb::HeartbeatReply::default();
        };
        let reserved = w.held.len() as u32;
        // One this controller cannot call is not heard either: it registers again (whose
        // dial-back shows whether it can be called) or is counted lost.
        if w.run_id != req.run_id || w.lost || w.reach.unreachable {
            return pb::HeartbeatReply::default();
        }
        w.last_seen = Instant::now();
        w.last_seen_at = SystemTime::now();
        w.remote.set_gpu_usage(
            req.gpu_usage_seq,
            crate::server::gpu_usage_from_pb(req.gpu_usage),
        );
        let draining = w.drain;
        let others = req.busy.saturating_sub(reserved);
        let others_changed = std::mem::replace(&mut w.others, others) != others;
        // Starts in flight count before the worker reports them.
        m.placement.report(
            name,
            Load {
                busy: req.busy.max(reserved),
                reserved_memory: req.resident_memory,
                cpu_idle_milli: req.cpu_idle_milli,
            },
        );
        if others_changed {
            self.publish_capacity(&m);
        }
        drop(m);
        let fence = match self.fencer.get() {
            Some(f) => f.on_heartbeat(name, req.fenced),
            None => Vec::new(),
        };
        pb::HeartbeatReply {
            known: true,
            draining,
            fence,
        }
    }

    /// Starts a container on the best worker; a worker that refuses or cannot be reached is
    /// skipped once for another.
    async fn start(
        &self,
        launch: Launch,
        image: Option<&Path>,
    ) -> Result<Box<dyn Resident>, RuntimeError> {
        let gpu = launch.gpu.as_ref().map(gpu_request).transpose()?;
        let need = Need {
            memory: launch.spec.limits.memory_bytes(),
            gpu_model: gpu
                .as_ref()
                .map(|r| r.model.clone().unwrap_or_else(|| ANY_GPU.to_owned())),
            ..Need::default()
        };
        // Under quotas a tenant's GPU starts go one at a time (see `gpu_turns`), and one
        // controller at a time (see `gpu_book`).
        let quota_tenant = gpu
            .as_ref()
            .and_then(|r| r.tenant.as_ref())
            .filter(|_| self.cfg.gpu_quotas.enforced());
        let _gpu_turn = match quota_tenant {
            Some(tenant) => {
                let turn = self
                    .gpu_turns
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(tenant.to_string())
                    .or_default()
                    .clone();
                Some(turn.lock_owned().await)
            }
            None => None,
        };
        let cluster_turn = match (quota_tenant, self.gpu_book.get()) {
            (Some(tenant), Some((book, me))) => {
                Some(Turn::take(book.clone(), tenant.as_str(), me).await.map_err(|e| {
                    RuntimeError::NoCapacity(format!(
                        "the GPU quota of tenant {tenant} cannot be checked across the controllers: {e}"
                    ))
                })?)
            }
            _ => None,
        };
        let stored: &[(String, u64, Amount)] =
            cluster_turn.as_ref().map_or(&[], |t| t.stored.as_slice());
        let sandbox = sandbox_of(&launch.container_id).map(str::to_string);
        // An image not yet in the store is on one worker's disk: there or nowhere.
        let pinned = launch.stored.image_on.clone();
        // A sandbox's own checkpoint, not a template's golden snapshot (a create).
        let waking = image.is_some() && !launch.stored.keep_image;
        let mut refused: Option<String> = None;
        // A GPU refusal from the first worker is the answer when no other worker can try.
        let mut gpu_refusal: Option<RuntimeError> = None;
        // The worker whose borrowed shares were just taken back for this start: tried again.
        let mut again_on: Option<String> = None;
        let mut reclaims = 0;
        for _attempt in 0..2 + crate::reclaim::MAX_ROUNDS {
            let (worker, remote) = {
                let mut m = self.lock();
                let again = again_on.take().filter(|w| {
                    pinned.is_none()
                        && m.workers.get(w).is_some_and(|w| !w.lost)
                        && m.placement.reserve(w, need.memory)
                });
                // The worker to start on, with its slot and memory reserved.
                let chosen = if let Some(again) = again {
                    again
                } else if let Some(pin) = &pinned {
                    if m.workers.get(pin).is_none_or(|w| w.lost) {
                        return Err(RuntimeError::ImageLost(format!(
                            "its checkpoint is on worker {pin}, which is gone"
                        )));
                    }
                    if !m.placement.reserve(pin, need.memory) {
                        return Err(RuntimeError::NoCapacity(format!(
                            "worker {pin}, which holds its checkpoint, is full or draining (its upload to the store will free it)"
                        )));
                    }
                    pin.clone()
                } else {
                    let prefer = sandbox
                        .as_ref()
                        .and_then(|s| m.last_worker.get(s))
                        .filter(|w| Some(*w) != refused.as_ref())
                        .cloned();
                    // The refusing worker sits out this start.
                    let skipped = refused.as_ref().and_then(|r| {
                        let (_, _, state) = m.placement.get(r)?;
                        (state == WorkerState::Ready).then(|| {
                            m.placement.set_state(r, WorkerState::Draining);
                            r.clone()
                        })
                    });
                    let choice = m.placement.place(&need, prefer.as_deref());
                    if let Some(r) = skipped {
                        m.placement.set_state(&r, WorkerState::Ready);
                    }
                    let Some(choice) = choice else {
                        if let Some(e) = gpu_refusal {
                            drop(m); // quota_first reads the members
                            return Err(self.quota_first(e, gpu.as_ref(), stored));
                        }
                        let ready = m
                            .placement
                            .iter()
                            .filter(|(_, _, _, s)| *s == WorkerState::Ready)
                            .count();
                        return Err(RuntimeError::NoCapacity(if ready == 0 {
                            "no worker is ready in the cluster".to_string()
                        } else {
                            format!(
                                "none of the {ready} ready workers has a free slot and the memory"
                            )
                        }));
                    };
                    choice.worker
                };
                let Some(w) = m.workers.get_mut(&chosen) else {
                    m.placement.release(&chosen, need.memory);
                    return Err(RuntimeError::NoCapacity(
                        "placement chose a gone worker".into(),
                    ));
                };
                w.held.insert(launch.container_id.clone());
                let remote = w.remote.clone();
                m.containers
                    .insert(launch.container_id.clone(), (chosen.clone(), need.memory));
                (chosen, remote)
            };
            let mut this = launch.clone();
            let mut elsewhere = None;
            if let (Some(request), Some(g)) = (&gpu, this.gpu.as_mut()) {
                match self.gpu_quota_on(request, &worker, stored) {
                    Ok(quota) => {
                        g.quota = quota.as_ref().map(|(book, _)| book.clone());
                        elsewhere = quota.map(|(_, held)| held);
                    }
                    Err(e) => {
                        self.forget(&launch.container_id);
                        return Err(e);
                    }
                }
            }
            let started = match image {
                Some(image) => remote.restore(this, image).await,
                None => remote.boot(this).await,
            };
            // The worker saw the tenant's quota less what it holds elsewhere: say so.
            let started = match (started, elsewhere) {
                (Err(RuntimeError::Gpu { code, message }), Some(held))
                    if code == "gpu_quota_exceeded" && held != Amount::default() =>
                {
                    Err(RuntimeError::Gpu {
                        message: format!(
                            "{message} (the limit is what its cluster-wide quota leaves: it holds {} MiB and {} compute units on other workers)",
                            held.memory_mib, held.compute
                        ),
                        code,
                    })
                }
                (started, _) => started,
            };
            match started {
                Ok(inner) => {
                    // The next turn, on any controller, counts what this start holds.
                    if let (Some(turn), Some(tenant)) = (&cluster_turn, quota_tenant) {
                        let (seq, usage) = remote.gpu_usage_report();
                        let held = usage.get(tenant.as_str()).copied().unwrap_or_default();
                        turn.record(&worker, seq, held).await;
                    }
                    let mut m = self.lock();
                    if let Some(s) = &sandbox {
                        let left = m.last_worker.insert(s.clone(), worker.clone());
                        // Woken on another worker: the one it left drops its wake ticket.
                        // Where it last ran is not known here when this controller did not
                        // start it last (it restarted since, or another one did): a wake
                        // then asks every other GPU worker (a create has no ticket anywhere).
                        let asked = match left {
                            _ if gpu.is_none() => Vec::new(),
                            Some(left) if left == worker => Vec::new(),
                            Some(left) => m.live_worker(&left),
                            None if waking => m.gpu_workers_but(&worker),
                            None => Vec::new(),
                        };
                        for (name, remote) in asked {
                            spawn_forget_ticket(self.me.clone(), name, remote, s.clone());
                        }
                    }
                    let slot = format!("{worker}/{}", inner.worker());
                    tracing::debug!(container = %launch.container_id, %worker, "started on worker");
                    return Ok(Box::new(FleetResident {
                        inner,
                        fleet: self.me.clone(),
                        node: worker,
                        slot,
                        quota_tenant: quota_tenant.map(|t| t.to_string()),
                        adopted: false,
                    }));
                }
                Err(e) => {
                    self.forget(&launch.container_id);
                    if let Some(victims) = crate::reclaim::reclaim_victims(&e) {
                        let Some(reclaim) = self
                            .reclaim
                            .get()
                            .filter(|_| reclaims < crate::reclaim::MAX_ROUNDS)
                        else {
                            return Err(crate::reclaim::unavailable(
                                &worker,
                                "taken back twice already, or nothing here parks sandboxes",
                            ));
                        };
                        reclaims += 1;
                        tracing::info!(%worker, container = %launch.container_id, ?victims,
                            "parking borrowers of GPU shares for a start within its guarantee");
                        let requester = gpu
                            .as_ref()
                            .and_then(|r| r.tenant.as_ref())
                            .map(|t| t.as_str());
                        park_all(reclaim.as_ref(), &victims, &worker, requester)
                            .await
                            .map_err(|why| crate::reclaim::unavailable(&worker, &why))?;
                        again_on = Some(worker);
                        continue;
                    }
                    // A worker whose GPUs are taken may not be the only one with that model.
                    let retry = matches!(e, RuntimeError::NoCapacity(_) | RuntimeError::Conn(_))
                        || matches!(&e, RuntimeError::Unsupported(m) if m.contains("did not answer"))
                        || matches!(&e, RuntimeError::Gpu { code, .. } if code == "gpu_unavailable");
                    if !retry || refused.is_some() || pinned.is_some() {
                        return Err(self.quota_first(e, gpu.as_ref(), stored));
                    }
                    tracing::warn!(%worker, error = %e, "worker refused a start; trying another");
                    if matches!(e, RuntimeError::Gpu { .. }) {
                        gpu_refusal = Some(e);
                    }
                    refused = Some(worker);
                }
            }
        }
        Err(RuntimeError::NoCapacity("no worker took it".into()))
    }

    /// A container ended: its slot and memory go back to its worker.
    fn forget(&self, container_id: &str) {
        let mut m = self.lock();
        if let Some((worker, memory)) = m.containers.remove(container_id) {
            if let Some(w) = m.workers.get_mut(&worker) {
                w.held.remove(container_id);
            }
            m.placement.release(&worker, memory);
        }
    }

    fn remote_of(&self, container_id: &str) -> Option<Arc<RemoteNode>> {
        let m = self.lock();
        let (worker, _) = m.containers.get(container_id)?;
        Some(m.workers.get(worker)?.remote.clone())
    }

    /// The connection to worker `name` while it is not lost.
    fn remote_named(&self, name: &str) -> Option<Arc<RemoteNode>> {
        let m = self.lock();
        m.workers
            .get(name)
            .filter(|w| !w.lost)
            .map(|w| w.remote.clone())
    }

    fn remotes(&self) -> Vec<Arc<RemoteNode>> {
        self.lock()
            .workers
            .values()
            .filter(|w| !w.lost)
            .map(|w| w.remote.clone())
            .collect()
    }
}

#[async_trait]
impl ImageHost for Fleet {
    async fn upload(
        &self,
        node: &str,
        dir: &str,
        put: &PutImage,
    ) -> Result<Uploaded, RuntimeError> {
        let remote = self.remote_named(node).ok_or_else(|| {
            RuntimeError::ImageLost(format!("its checkpoint is on worker {node}, which is gone"))
        })?;
        let up = remote.upload(dir, put).await?;
        let mut m = self.lock();
        let order = m.copies_by_worker.entry(node.to_string()).or_default();
        order.push_back(up.snapshot.clone());
        let aged = if order.len() > crate::images::MAX_LOCAL_COPIES {
            order.pop_front()
        } else {
            None
        };
        if let Some(old) = aged {
            m.copies.remove(&old);
        }
        m.copies.insert(up.snapshot.clone(), node.to_string());
        Ok(up)
    }

    async fn images(&self) -> Vec<(String, Vec<torpor_runtime::node::WorkerImage>)> {
        let remotes: Vec<(String, Arc<RemoteNode>)> =
            self.lock().workers.iter().filter_map(live_member).collect();
        let mut out = Vec::with_capacity(remotes.len());
        for (name, remote) in remotes {
            match remote.list_images().await {
                Ok(images) => out.push((name, images)),
                Err(e) => {
                    tracing::debug!(worker = %name, error = %e, "cannot list a worker's images")
                }
            }
        }
        out
    }

    async fn remove(&self, node: &str, dir: &str) {
        let Some(remote) = self.remote_named(node) else {
            return; // gone: its disk is its operator's (a restarted worker keeps its images)
        };
        if let Err(e) = remote.remove_image(dir).await {
            tracing::warn!(worker = %node, image = dir, error = %e, "cannot remove an image on a worker");
        }
    }

    async fn forget(&self, snapshot: &str, everywhere: bool) {
        let remotes: Vec<(String, Arc<RemoteNode>)> = {
            let mut m = self.lock();
            let copy = m.copies.remove(snapshot);
            if let Some(w) = &copy {
                if let Some(order) = m.copies_by_worker.get_mut(w) {
                    order.retain(|s| s != snapshot);
                }
            }
            if everywhere {
                m.workers.iter().filter_map(live_member).collect()
            } else {
                // Only the worker that uploaded it keeps a copy. One this controller did not
                // upload (another did, or it restarted since) ages out on its worker.
                copy.and_then(|w| m.workers.get_key_value(&w).and_then(live_member))
                    .into_iter()
                    .collect()
            }
        };
        for (name, remote) in remotes {
            if let Err(e) = remote.forget_snapshot(snapshot).await {
                tracing::warn!(worker = %name, snapshot, error = %e, "cannot drop a worker's copy of a snapshot");
            }
        }
    }

    fn reachable(&self, node: &str) -> bool {
        self.remote_named(node).is_some()
    }

    fn ready(&self, node: &str) -> bool {
        let m = self.lock();
        m.workers.get(node).is_some_and(|w| !w.lost)
            && m.placement
                .get(node)
                .is_some_and(|(_, _, state)| state == WorkerState::Ready)
    }
}

/// A worker's name and node if it is not lost (for `filter_map` over `Members.workers`).
fn live_member((name, w): (&String, &Member)) -> Option<(String, Arc<RemoteNode>)> {
    (!w.lost).then(|| (name.clone(), w.remote.clone()))
}

/// Passes a worker's events on (exits: the container is forgotten first).
async fn forward_events(fleet: Weak<Fleet>, mut events: mpsc::UnboundedReceiver<NodeEvent>) {
    while let Some(ev) = events.recv().await {
        let Some(fleet) = fleet.upgrade() else { return };
        if let NodeEvent::Exited {
            container_id,
            expected: false,
            ..
        } = &ev
        {
            fleet.forget(container_id);
        }
        if fleet.events.send(ev).is_err() {
            return;
        }
    }
}

/// Where to reach a worker's Node service: its announced address, with an unspecified host
/// replaced by the address its registration came from.
fn node_addr(announced: &str, peer: SocketAddr) -> Result<String, Status> {
    let addr: SocketAddr = announced.parse().map_err(|_| {
        Status::invalid_argument("node_addr must be an IP address and a port, e.g. 10.0.0.7:7443")
    })?;
    if addr.port() == 0 {
        return Err(Status::invalid_argument("node_addr needs a port"));
    }
    let ip = if addr.ip().is_unspecified() {
        peer.ip()
    } else {
        addr.ip()
    };
    Ok(SocketAddr::new(ip, addr.port()).to_string())
}

#[async_trait]
impl Node for Fleet {
    fn info(&self) -> NodeInfo {
        NodeInfo {
            runtime_version: "cluster".into(),
            platform: "remote".into(),
            nvproxy: false,
            agent_dir: Default::default(),
        }
    }

    fn take_events(&self) -> Option<mpsc::UnboundedReceiver<NodeEvent>> {
        self.events_rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    async fn reconcile(&self, known_sandboxes: &[String]) -> usize {
        let mut removed = 0;
        for r in self.remotes() {
            removed += r.reconcile(known_sandboxes).await;
        }
        removed
    }

    async fn boot(&self, launch: Launch) -> Result<Box<dyn Resident>, RuntimeError> {
        self.start(launch, None).await
    }

    async fn restore(
        &self,
        launch: Launch,
        image: &Path,
    ) -> Result<Box<dyn Resident>, RuntimeError> {
        self.start(launch, Some(image)).await
    }

    fn image_host(&self) -> Option<&dyn ImageHost> {
        Some(self)
    }

    async fn adopt(&self, container_id: &str, memory: u64) -> Option<Box<dyn Resident>> {
        let candidates: Vec<(String, Arc<RemoteNode>)> = {
            let m = self.lock();
            match m.expected.get(container_id) {
                // Expected back after this controller's restart: only from its worker.
                Some((worker, true)) => m
                    .workers
                    .get_key_value(worker)
                    .and_then(live_member)
                    .into_iter()
                    .collect(),
                Some((_, false)) => return None, // its worker has not come back (yet)
                None => m.workers.iter().filter_map(live_member).collect(),
            }
        };
        for (worker, remote) in candidates {
            let Ok(inner) = remote.adopt(container_id).await else {
                continue; // not there
            };
            let mut m = self.lock();
            m.expected.remove(container_id);
            // It holds its worker's slot already: counted here from now on.
            let charged = if m.placement.reserve(&worker, memory) {
                memory
            } else {
                0
            };
            m.containers
                .insert(container_id.to_string(), (worker.clone(), charged));
            if let Some(w) = m.workers.get_mut(&worker) {
                w.held.insert(container_id.to_string());
            }
            if let Some(s) = sandbox_of(container_id) {
                m.last_worker.insert(s.to_string(), worker.clone());
            }
            let slot = format!("{worker}/{}", inner.worker());
            tracing::info!(container = %container_id, %worker, "adopted a container");
            return Some(Box::new(FleetResident {
                inner,
                fleet: self.me.clone(),
                node: worker,
                slot,
                // Not known here: its share, when it goes back, reaches the other
                // controllers with the worker's next heartbeat (this one's at once).
                quota_tenant: None,
                adopted: true,
            }));
        }
        None
    }

    fn reaches_worker(&self, worker: &str) -> bool {
        !self.is_lost(worker)
    }

    fn has_ready_worker(&self) -> bool {
        self.lock()
            .placement
            .iter()
            .any(|(_, _, _, state)| state == WorkerState::Ready)
    }

    fn expect_back(&self, expected: &[(String, String)]) {
        let mut m = self.lock();
        for (container, worker) in expected {
            m.expected
                .insert(container.clone(), (worker.clone(), false));
        }
    }

    async fn kill(&self, container_id: &str) {
        // Expected back and not taken: the engine gave up on it. Nothing here holds it, so
        // it is taken over from its worker to be destroyed there.
        let expected = self.lock().expected.remove(container_id);
        if let Some((worker, true)) = expected {
            let remote = self.lock().workers.get(&worker).map(|w| w.remote.clone());
            if let Some(r) = remote {
                if let Ok(resident) = r.adopt(container_id).await {
                    resident.destroy().await;
                }
            }
            return;
        }
        match self.remote_of(container_id) {
            Some(r) => r.kill(container_id).await,
            // Not one this controller started (a lost controller's, taken over): whichever
            // worker runs it removes it.
            None => {
                for r in self.remotes() {
                    r.kill(container_id).await;
                }
            }
        }
    }

    fn log_tail(&self, container_id: &str) -> String {
        self.remote_of(container_id)
            .map(|r| r.log_tail(container_id))
            .unwrap_or_default()
    }

    fn warm_stats(&self) -> WarmStats {
        let mut total = WarmStats::default();
        for r in self.remotes() {
            let s = r.warm_stats();
            total.target += s.target;
            total.ready += s.ready;
            total.warm_takes += s.warm_takes;
            total.cold_takes += s.cold_takes;
            total.discarded += s.discarded;
        }
        total
    }

    async fn shutdown(&self) {
        for r in self.remotes() {
            r.shutdown().await;
        }
    }
}

/// A container on one of the fleet's workers.
struct FleetResident {
    inner: Box<dyn Resident>,
    fleet: Weak<Fleet>,
    /// The worker's name.
    node: String,
    /// `<worker>/<its slot>`.
    slot: String,
    /// The tenant whose cluster-wide GPU quota its share counts against (a GPU sandbox under
    /// quotas), told when the share goes back ([`Fleet::note_release`]).
    quota_tenant: Option<String>,
    /// Taken over from a lost controller: its tenant is not known here, so a share it gives
    /// back is written for every tenant ([`Fleet::note_release_of_unknown`]).
    adopted: bool,
}

impl FleetResident {
    fn forget(&self) {
        if let Some(f) = self.fleet.upgrade() {
            f.forget(self.inner.id());
        }
    }

    fn worker_lost(&self) -> bool {
        self.fleet.upgrade().is_none_or(|f| f.is_lost(&self.node))
    }
}

#[async_trait]
impl Resident for FleetResident {
    fn id(&self) -> &str {
        self.inner.id()
    }
    fn worker(&self) -> &str {
        &self.slot
    }
    fn node(&self) -> Option<&str> {
        Some(&self.node)
    }
    fn was_warm(&self) -> bool {
        self.inner.was_warm()
    }
    async fn send(
        &self,
        req: &AgentRequest,
        body: &[u8],
    ) -> Result<mpsc::Receiver<(Reply, Vec<u8>)>, ConnError> {
        self.inner.send(req, body).await
    }
    fn agent_version(&self) -> u32 {
        self.inner.agent_version()
    }
    fn alive(&self) -> bool {
        self.inner.alive() && !self.worker_lost()
    }
    fn exit_handle(&self) -> ExitHandle {
        self.inner.exit_handle()
    }
    async fn set_frozen(&self, frozen: bool) -> Result<(), RuntimeError> {
        self.inner.set_frozen(frozen).await
    }
    fn memory(&self) -> Option<u64> {
        self.inner.memory()
    }
    async fn checkpoint(self: Box<Self>, image_dir: &Path) -> Result<(), RuntimeError> {
        let FleetResident {
            inner,
            fleet,
            node,
            quota_tenant,
            adopted,
            ..
        } = *self;
        let id = inner.id().to_string();
        let result = inner.checkpoint(image_dir).await;
        if let Some(f) = fleet.upgrade() {
            f.forget(&id);
            tracing::debug!(container = %id, worker = %node, ok = result.is_ok(), "checkpointed on worker");
            match quota_tenant {
                Some(tenant) => f.note_release(&node, &tenant).await,
                None if adopted => f.note_release_of_unknown(&node).await,
                None => {}
            }
        }
        result
    }
    async fn destroy(self: Box<Self>) {
        if self.worker_lost() {
            // Nothing to call: the worker removes it when it registers again.
            self.forget();
            return;
        }
        self.forget();
        let FleetResident {
            inner,
            fleet,
            node,
            quota_tenant,
            adopted,
            ..
        } = *self;
        inner.destroy().await;
        if let Some(f) = fleet.upgrade() {
            match quota_tenant {
                Some(tenant) => f.note_release(&node, &tenant).await,
                None if adopted => f.note_release_of_unknown(&node).await,
                None => {}
            }
        }
    }
    async fn release(self: Box<Self>) {
        // Its slot and memory leave this controller's view of the worker; the controller that
        // adopts it counts them (its GPU share stays with the running container).
        self.forget();
        let FleetResident { inner, node, .. } = *self;
        tracing::debug!(container = %inner.id(), worker = %node, "let go on worker");
        inner.release().await;
    }
    fn ingress_addr(&self) -> Option<std::net::Ipv4Addr> {
        self.inner.ingress_addr()
    }
    async fn apply_policy(&self, policy: &NetworkPolicy) -> Result<(), RuntimeError> {
        self.inner.apply_policy(policy).await
    }
    fn net_stats(&self) -> Option<NetStats> {
        self.inner.net_stats()
    }
    async fn settle_connections(&self) {
        self.inner.settle_connections().await
    }
    async fn connect_port(
        &self,
        port: u16,
    ) -> Result<torpor_runtime::node::PortStream, RuntimeError> {
        self.inner.connect_port(port).await
    }
}

/// The controller's Cluster service: registrations and heartbeats of workers.
struct ClusterService(Arc<Fleet>);

fn caller(req: &Request<impl Sized>) -> Result<PeerInfo, Status> {
    match req.extensions().get::<PeerInfo>() {
        Some(p) if p.identity.role == Role::Worker => Ok(p.clone()),
        _ => Err(Status::permission_denied("only workers may join a cluster")),
    }
}

#[tonic::async_trait]
impl ClusterRpc for ClusterService {
    async fn register(
        &self,
        req: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterReply>, Status> {
        let peer = caller(&req)?;
        self.0
            .register(&peer, req.into_inner())
            .await
            .map(Response::new)
    }

    async fn heartbeat(
        &self,
        req: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatReply>, Status> {
        let peer = caller(&req)?;
        Ok(Response::new(self.0.heartbeat(&peer, req.into_inner())))
    }
}

/// Refuses calls of another protocol version.
fn check_controller_call(req: Request<()>) -> Result<Request<()>, Status> {
    check_version(&req, "controller")?;
    Ok(req)
}

/// Serves the Cluster service on `listener` to workers that pass `tls` (a controller's
/// identity: it accepts workers), until `shutdown` resolves.
pub async fn serve_cluster(
    fleet: Arc<Fleet>,
    listener: tokio::net::TcpListener,
    tls: Arc<TlsSource>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let (incoming, accept_loop) = accept_verified(listener, tls)?;
    let result = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .add_service(tonic::service::interceptor::InterceptedService::new(
            ClusterServer::new(ClusterService(fleet))
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
            check_controller_call,
        ))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    accept_loop.abort();
    Ok(result?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An attempt that fails `fails` times, then succeeds; records when each attempt came.
    fn flaky(
        fails: usize,
        at: Arc<Mutex<Vec<Duration>>>,
    ) -> impl FnMut() -> std::future::Ready<Result<(), String>> {
        let start = tokio::time::Instant::now();
        let mut n = 0;
        move || {
            at.lock().unwrap().push(start.elapsed());
            n += 1;
            std::future::ready(if n > fails {
                Ok(())
            } else {
                Err(format!("unreachable ({n})"))
            })
        }
    }

    #[test]
    fn a_release_of_an_unknown_tenant_writes_what_every_quota_tenant_holds() {
        let l4 = Amount {
            memory_mib: 23034,
            compute: 700,
        };
        // `a`'s share went back (gone from the report), `b` holds one, `c` has no quota but
        // holds one too.
        let report: crate::server::GpuUsage = [("b".to_string(), l4), ("c".to_string(), l4)]
            .into_iter()
            .collect();
        assert_eq!(
            holdings_to_record(&["a".to_string(), "b".to_string()], &report),
            vec![
                ("a".to_string(), Amount::default()),
                ("b".to_string(), l4),
                ("c".to_string(), l4)
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_forget_that_failed_is_asked_again_with_backoff_and_given_up_in_time() {
        let retry = Retry {
            first: FORGET_RETRY_FIRST,
            max: FORGET_RETRY_MAX,
            for_: FORGET_RETRY_FOR,
        };
        // Unreachable for a while (a restart, a partition): asked again until it answers.
        let at = Arc::new(Mutex::new(Vec::new()));
        assert_eq!(retry.run(flaky(8, at.clone())).await, Ok(()));
        let at = at.lock().unwrap().clone();
        let secs: Vec<u64> = at.iter().map(|d| d.as_secs()).collect();
        assert_eq!(
            secs,
            [0, 1, 3, 7, 15, 31, 63, 123, 183],
            "doubling, capped at a minute"
        );
        // Never reachable: given up after the hour, not before, with the last error.
        let at = Arc::new(Mutex::new(Vec::new()));
        let err = retry.run(flaky(usize::MAX, at.clone())).await.unwrap_err();
        assert!(err.starts_with("unreachable"), "{err}");
        let last = *at.lock().unwrap().last().unwrap();
        assert!(
            last <= FORGET_RETRY_FOR && last + FORGET_RETRY_MAX > FORGET_RETRY_FOR,
            "{last:?}"
        );
        // Reachable at once: asked once.
        let at = Arc::new(Mutex::new(Vec::new()));
        assert_eq!(retry.run(flaky(0, at.clone())).await, Ok(()));
        assert_eq!(at.lock().unwrap().len(), 1);
    }

    #[test]
    fn an_unspecified_host_is_the_callers_and_a_bad_address_is_refused() {
        let peer: SocketAddr = "10.1.2.3:55555".parse().unwrap();
        assert_eq!(node_addr("0.0.0.0:7443", peer).unwrap(), "10.1.2.3:7443");
        assert_eq!(node_addr("10.9.9.9:7443", peer).unwrap(), "10.9.9.9:7443");
        assert_eq!(
            node_addr("[::]:7443", "[fd00::1]:4000".parse().unwrap()).unwrap(),
            "[fd00::1]:7443"
        );
        assert_eq!(
            node_addr("worker-1:7443", peer).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        assert_eq!(
            node_addr("0.0.0.0:0", peer).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
    }
}
