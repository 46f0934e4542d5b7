//! The worker's side: its machine's [`Node`] served over the protocol to controllers, behind
//! mutual TLS.
//!
//! The worker keeps the [`Resident`]s it started in a table by container id; the controller
//! names a container in each call. A resident's checkpoint and destroy take it out of the table
//! (they consume it), under the entry's write lock, so no call is in flight on it then.
//! Operations that start or end containers (boot, restore, checkpoint, destroy, kill) run in
//! their own task: a controller whose deadline passes, or which goes away, does not cut them
//! half-way; a container started for a caller that is gone is destroyed at once.
//!
//! Several controllers may drive one worker (one database, several controller replicas): each
//! container belongs to the controller that started it, a controller's `Reconcile` removes only
//! its own, and every controller's event stream hears every exit (a controller ignores exits
//! of containers it does not hold).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, RwLock};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;
use tonic::{Request, Response, Status};
use torpor_runtime::node::{Launch, Node, NodeEvent, PutImage, Resident};
use torpor_runtime::proto::Request as AgentRequest;

use crate::ca::Role;
use crate::convert::{self, bad, status_of};
use crate::images::WorkerImages;
use crate::pb;
use crate::pb::node_server::{Node as NodeRpc, NodeServer};
use crate::tls::{refusal_reason, Direction, PeerInfo, Revocable, TlsSource};
use crate::{MAX_MESSAGE, PROTOCOL_HEADER, PROTOCOL_VERSION};

/// How long a connection may take to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Fewest milliseconds between two usage reports on the event stream.
const MIN_USAGE_INTERVAL_MS: u64 = 100;

/// One container the worker holds for a controller.
struct Held {
    /// The controller that started it (its certificate's name), or adopted it.
    owner: Mutex<String>,
    resident: RwLock<Option<Box<dyn Resident>>>,
}

impl Held {
    fn owner(&self) -> String {
        self.owner.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Exits kept for an event stream that falls behind; past it, the stream skips ahead.
const EVENT_BACKLOG: usize = 4096;

pub struct NodeService {
    node: Arc<dyn Node>,
    name: String,
    /// Containers this worker runs at once (`torpor worker --workers`); 0: no limit.
    slots: std::sync::atomic::AtomicUsize,
    residents: Mutex<HashMap<String, Arc<Held>>>,
    /// The node's events, for every controller's stream.
    events: tokio::sync::broadcast::Sender<NodeEvent>,
    /// Starts hold it shared; a reconcile that finds the worker holding nothing takes it
    /// alone to clear what no controller holds (no start can be under way then).
    sweep_gate: tokio::sync::RwLock<()>,
    /// The worker's images and the shared store (`None`: images only where the controller
    /// names them, as absolute paths).
    images: std::sync::OnceLock<Arc<WorkerImages>>,
    /// Live restore: one file per container held (`<dir>/<container>` holding its owner), so
    /// that a restarted worker takes its containers back for the controllers that hold them.
    held_dir: std::sync::OnceLock<PathBuf>,
    /// This worker's GPU layer (none without GPUs).
    gpus: std::sync::OnceLock<Arc<dyn WorkerGpus>>,
    /// Numbers each read of the GPU usage, so that controllers keep the newest report.
    gpu_usage_seq: std::sync::atomic::AtomicU64,
    /// Starts (boot, restore) and checkpoints running at once, whichever controller asks: one
    /// of each per core ([`NodeService::limit_heavy`]); more only slow each other down.
    starts: Arc<tokio::sync::Semaphore>,
    checkpoints: Arc<tokio::sync::Semaphore>,
}

/// The most sandboxes one `ForgetGpuTickets` call names.
pub const MAX_FORGOTTEN_TICKETS: usize = 1024;

/// What each tenant's sandboxes hold of a worker's GPUs, tenant → amount.
pub type GpuUsage = std::collections::BTreeMap<String, torpor_gpu::quota::Amount>;

/// A worker's GPU layer, as the service needs it.
pub trait WorkerGpus: Send + Sync {
    /// What each tenant holds of this worker's GPUs now.
    fn usage(&self) -> GpuUsage;
    /// `GET /v1/gpus`'s JSON of this worker's GPUs, as `viewer` (a tenant name) may see it.
    fn status_json(&self, viewer: &str) -> String;
    /// Drops the wake tickets of `sandboxes` (deleted, or woken on another worker), except
    /// that of a sandbox whose share this worker holds now.
    fn forget_tickets(&self, sandboxes: &[String]);
}

/// [`GpuUsage`] on the wire.
pub fn gpu_usage_to_pb(usage: &GpuUsage) -> HashMap<String, pb::GpuAmount> {
    usage
        .iter()
        .map(|(t, a)| {
            (
                t.clone(),
                pb::GpuAmount {
                    memory_mib: a.memory_mib,
                    compute: a.compute,
                },
            )
        })
        .collect()
}

/// Most tenants one worker's GPU usage report may name; the rest of a larger one is dropped
/// (a worker has at most one tenant per GPU share, far fewer than this).
pub const MAX_GPU_USAGE_TENANTS: usize = 4096;

/// [`GpuUsage`] off the wire, at most [`MAX_GPU_USAGE_TENANTS`] of it.
pub fn gpu_usage_from_pb(usage: HashMap<String, pb::GpuAmount>) -> GpuUsage {
    if usage.len() > MAX_GPU_USAGE_TENANTS {
        tracing::warn!(
            tenants = usage.len(),
            kept = MAX_GPU_USAGE_TENANTS,
            "a worker's GPU usage report names too many tenants; the rest is dropped"
        );
    }
    usage
        .into_iter()
        .take(MAX_GPU_USAGE_TENANTS)
        .map(|(t, a)| {
            (
                t,
                torpor_gpu::quota::Amount {
                    memory_mib: a.memory_mib,
                    compute: a.compute,
                },
            )
        })
        .collect()
}

impl NodeService {
    /// Serves `node`, whose event stream it takes. `name`: the worker's name (its identity's).
    pub fn new(node: Arc<dyn Node>, name: String) -> Arc<NodeService> {
        let mut node_events = node.take_events().unwrap_or_else(|| {
            // Someone took the stream already: this worker reports no exits on its own.
            tracing::warn!("the node's event stream was taken; exits are not reported");
            mpsc::unbounded_channel().1
        });
        let (events, _) = tokio::sync::broadcast::channel(EVENT_BACKLOG);
        let fan_out = events.clone();
        tokio::spawn(async move {
            while let Some(ev) = node_events.recv().await {
                // No stream open: no controller to tell (one that connects later reconciles).
                let _ = fan_out.send(ev);
            }
        });
        Arc::new(NodeService {
            node,
            name,
            slots: std::sync::atomic::AtomicUsize::new(0),
            residents: Mutex::default(),
            events,
            sweep_gate: tokio::sync::RwLock::new(()),
            images: std::sync::OnceLock::new(),
            held_dir: std::sync::OnceLock::new(),
            gpus: std::sync::OnceLock::new(),
            // From the boot time, so that a restarted worker's reports number after its
            // earlier ones (controllers keep the newest; see `crate::gpu_turn`).
            gpu_usage_seq: std::sync::atomic::AtomicU64::new(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_micros() as u64),
            ),
            starts: Arc::new(tokio::sync::Semaphore::new(
                tokio::sync::Semaphore::MAX_PERMITS,
            )),
            checkpoints: Arc::new(tokio::sync::Semaphore::new(
                tokio::sync::Semaphore::MAX_PERMITS,
            )),
        })
    }

    /// Live restore: records who holds each container in `dir` and, at start, takes back the
    /// containers a previous run left running under their shims ([`Node::adopt`]) for the
    /// controllers that held them. Returns how many came back; the caller then reconciles
    /// the node (what was not taken back is removed).
    pub async fn take_back(&self, dir: PathBuf) -> std::io::Result<usize> {
        std::fs::create_dir_all(&dir)?;
        let mut back = 0;
        for e in std::fs::read_dir(&dir)?.flatten() {
            let id = e.file_name().to_string_lossy().into_owned();
            let owner = std::fs::read_to_string(e.path()).unwrap_or_default();
            let resident = match owner.trim() {
                "" => None,
                _ => self.node.adopt(&id, 0).await,
            };
            match resident {
                Some(r) => {
                    tracing::info!(container = %id, owner = owner.trim(), "took back a container that outlived the worker's previous run");
                    self.table().insert(
                        id,
                        Arc::new(Held {
                            owner: Mutex::new(owner.trim().to_string()),
                            resident: RwLock::new(Some(r)),
                        }),
                    );
                    back += 1;
                }
                None => {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let _ = self.held_dir.set(dir);
        Ok(back)
    }

    /// The containers this worker holds now (announced at registration).
    pub fn holding(&self) -> Vec<String> {
        self.table().keys().cloned().collect()
    }

    /// Records (`Some(owner)`) or forgets (`None`) who holds `container`.
    fn note_held(&self, container: &str, owner: Option<&str>) {
        let Some(dir) = self.held_dir.get() else {
            return;
        };
        let path = dir.join(container);
        let _ = match owner {
            Some(o) => std::fs::write(&path, o),
            None => std::fs::remove_file(&path),
        };
    }

    /// Gives the worker its image area and store (see [`crate::images`]).
    pub fn set_images(&self, images: Arc<WorkerImages>) {
        let _ = self.images.set(images);
    }

    /// The worker's images, for calls that need them.
    pub fn images(&self) -> Result<&Arc<WorkerImages>, Status> {
        self.images
            .get()
            .ok_or_else(|| Status::failed_precondition("this worker keeps no images of its own"))
    }

    /// A launch's root filesystem from the store when it names one (this worker's copy).
    async fn stored_rootfs(&self, launch: &mut Launch) -> Result<(), Status> {
        if launch.stored.rootfs.is_some() {
            if let Some(dir) = self.images()?.rootfs(&launch.stored).await? {
                launch.spec.rootfs = dir;
            }
        }
        Ok(())
    }

    /// Refuses starts beyond `slots` containers at once (a controller's placement keeps under
    /// it; this holds when two controllers' views race).
    /// Gives the service its GPU layer (once): heartbeats and start replies carry its usage,
    /// `GpuStatus` answers with its status, `ForgetGpuTickets` reaches it.
    pub fn set_gpus(&self, gpus: Arc<dyn WorkerGpus>) {
        let _ = self.gpus.set(gpus);
    }

    /// What each tenant holds of this worker's GPUs now, numbered after every earlier read.
    pub fn gpu_usage(&self) -> (u64, GpuUsage) {
        let seq = self.gpu_usage_seq.fetch_add(1, Ordering::SeqCst) + 1;
        (seq, self.gpus.get().map(|g| g.usage()).unwrap_or_default())
    }

    /// Runs at most `n` starts and `n` checkpoints at once (the worker's cores); call once,
    /// before serving.
    pub fn limit_heavy(&self, n: usize) {
        let n = n.max(1);
        for sem in [&self.starts, &self.checkpoints] {
            let extra = sem.available_permits().saturating_sub(n);
            sem.forget_permits(extra);
        }
    }

    pub fn limit_slots(&self, slots: usize) {
        self.slots.store(slots, Ordering::SeqCst);
    }

    /// Containers held, and the bytes charged to their memory with those the worker holds for
    /// its images (the chunk cache's queue): what its heartbeat says is resident, so that
    /// placement counts the worker's memory that the queue takes for a moment.
    pub fn load(&self) -> (u32, u64) {
        let usage = self.usage();
        let memory: u64 = usage.containers.iter().filter_map(|c| c.memory).sum();
        let images = self.images.get().map_or(0, |i| i.memory_held());
        (self.table().len() as u32, memory + images)
    }

    /// Destroys every container held (the worker is stopping: its controllers count them
    /// lost, and a frozen one left behind could not even be killed).
    pub async fn destroy_all(&self) {
        let held: Vec<(String, Arc<Held>)> = self.table().drain().collect();
        for (id, h) in held {
            self.note_held(&id, None);
            if let Some(r) = h.resident.write().await.take() {
                tracing::info!(container = %id, "destroying a container of a stopping worker");
                // A frozen process cannot die.
                let _ = r.set_frozen(false).await;
                r.destroy().await;
            }
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Held>>> {
        self.residents.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn held(&self, id: &str) -> Result<Arc<Held>, Status> {
        self.table().get(id).cloned().ok_or_else(|| gone(id))
    }

    /// Ends every container `owner` holds here but those in `keep` (a reconcile, a fence);
    /// returns how many were removed. `sweep`: when the worker then holds nothing for anyone,
    /// also clear whatever else runs (a reconcile).
    async fn end_owned(
        self: &Arc<Self>,
        owner: &str,
        keep: &[String],
        sweep: bool,
    ) -> Result<usize, Status> {
        let held = self.take_where(|id, h| h.owner() == owner && !keep.iter().any(|k| k == id));
        self.end(held, sweep).await
    }

    /// Takes the containers `pick` chooses out of the table (no call reaches them after).
    fn take_where(&self, pick: impl Fn(&str, &Held) -> bool) -> Vec<Arc<Held>> {
        let mut table = self.table();
        let picked: Vec<String> = table
            .iter()
            .filter(|(id, h)| pick(id, h))
            .map(|(id, _)| id.clone())
            .collect();
        for id in &picked {
            self.note_held(id, None);
        }
        picked.iter().filter_map(|id| table.remove(id)).collect()
    }

    /// Ends `held` (taken out of the table) in a task of its own, so that a caller that goes
    /// away does not cut it half-way; returns how many ended. `sweep`: see
    /// [`NodeService::end_owned`].
    async fn end(self: &Arc<Self>, held: Vec<Arc<Held>>, sweep: bool) -> Result<usize, Status> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut removed = 0;
            // Holding nothing for anyone, with no start under way: whatever runs here is no
            // controller's (left by a controller's earlier run on this worker), so clear it.
            if let (true, Ok(_alone)) = (sweep, me.sweep_gate.try_write()) {
                if me.table().is_empty() {
                    removed += me.node.reconcile(&[]).await;
                }
            }
            for h in held {
                if let Some(r) = h.resident.write().await.take() {
                    // A frozen process cannot die.
                    let _ = r.set_frozen(false).await;
                    r.destroy().await;
                    removed += 1;
                }
            }
            removed
        })
        .await
        .map_err(|e| Status::internal(format!("reconcile task failed: {e}")))
    }

    /// Fence orders a controller relayed (another controller counted this worker lost and
    /// cannot hear it): each `(container, owner)` ends while `owner` still holds it here; one
    /// adopted since by another controller stays. Returns every order's container: each is
    /// carried out, or there was nothing to end.
    pub async fn end_ordered(self: &Arc<Self>, orders: &[(String, String)]) -> Vec<String> {
        let held = self.take_where(|id, h| {
            orders
                .iter()
                .any(|(container, owner)| container == id && *owner == h.owner())
        });
        let ending = held.len();
        match self.end(held, false).await {
            Ok(ended) if ending > 0 => tracing::warn!(
                containers = ended,
                "fence orders: containers a controller that cannot hear this worker held are ended (their sandboxes resume elsewhere)"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "cannot carry out fence orders"),
        }
        orders.iter().map(|(c, _)| c.clone()).collect()
    }

    /// Fencing: no controller was heard from for longer than the worker may run sandboxes
    /// unseen (they may count it lost and resume them elsewhere), so every container it holds
    /// ends. Returns how many.
    pub async fn fence(self: &Arc<Self>) -> usize {
        let owners: std::collections::BTreeSet<String> =
            self.table().values().map(|h| h.owner()).collect();
        let mut ended = 0;
        for owner in owners {
            match self.end_owned(&owner, &[], false).await {
                Ok(n) => ended += n,
                Err(e) => {
                    tracing::warn!(controller = %owner, error = %e, "cannot fence a controller's containers")
                }
            }
        }
        ended
    }

    fn usage(&self) -> pb::Usage {
        let held: Vec<(String, Arc<Held>)> = self
            .table()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut containers = Vec::with_capacity(held.len());
        for (id, h) in held {
            // A checkpoint or destroy holds the write lock: that container is going anyway.
            let Ok(guard) = h.resident.try_read() else {
                continue;
            };
            let Some(r) = guard.as_ref() else { continue };
            containers.push(pb::ContainerUsage {
                container_id: id,
                memory: r.memory(),
                net: r.net_stats().as_ref().map(convert::net_to_pb),
            });
        }
        pb::Usage {
            containers,
            warm: Some(convert::warm_to_pb(&self.node.warm_stats())),
        }
    }

    /// A launch made this worker's: its own agent directory (the controller's is another
    /// machine's), within its slots.
    fn local_launch(&self, mut launch: Launch) -> Result<Launch, Status> {
        let slots = self.slots.load(Ordering::SeqCst);
        if slots > 0 && self.table().len() >= slots {
            return Err(status_of(&torpor_runtime::RuntimeError::NoCapacity(
                format!("worker {} runs {slots} sandboxes already", self.name),
            )));
        }
        launch.spec.agent_dir = self.node.info().agent_dir;
        Ok(launch)
    }

    /// Runs a start (boot or restore) in its own task; a container started for a caller that
    /// went away is destroyed.
    async fn start(
        self: &Arc<Self>,
        owner: String,
        container_id: String,
        op: impl std::future::Future<Output = Result<Box<dyn Resident>, torpor_runtime::RuntimeError>>
            + Send
            + 'static,
    ) -> Result<Response<pb::ResidentReply>, Status> {
        let cancelled = Arc::new(AtomicBool::new(false));
        let _guard = CancelOnDrop(cancelled.clone());
        let me = self.clone();
        let task = tokio::spawn(async move {
            let _starting = me.sweep_gate.read().await;
            let _turn = me.starts.clone().acquire_owned().await;
            let resident = op.await.map_err(|e| status_of(&e))?;
            if cancelled.load(Ordering::SeqCst) {
                tracing::warn!(container = %container_id, "the controller went away during the start; destroying the container");
                resident.destroy().await;
                return Err(Status::cancelled("the caller went away"));
            }
            let (gpu_usage_seq, usage) = me.gpu_usage();
            let reply = pb::ResidentReply {
                container_id: resident.id().to_string(),
                worker: resident.worker().to_string(),
                was_warm: resident.was_warm(),
                agent_version: resident.agent_version(),
                memory: resident.memory(),
                gpu_usage: gpu_usage_to_pb(&usage),
                gpu_usage_seq,
            };
            me.note_held(&container_id, Some(&owner));
            me.table().insert(
                container_id,
                Arc::new(Held {
                    owner: Mutex::new(owner),
                    resident: RwLock::new(Some(resident)),
                }),
            );
            Ok(reply)
        });
        match task.await {
            Ok(r) => r.map(Response::new),
            Err(e) => Err(Status::internal(format!("start task failed: {e}"))),
        }
    }

    /// Takes a container out of the table for `op` (checkpoint, destroy), in its own task.
    async fn finish(
        self: &Arc<Self>,
        id: String,
        op: impl FnOnce(
                Box<dyn Resident>,
            )
                -> Pin<Box<dyn std::future::Future<Output = Result<(), Status>> + Send>>
            + Send
            + 'static,
    ) -> Result<Response<pb::ReleasedReply>, Status> {
        let held = self.held(&id)?;
        let me = self.clone();
        let task = tokio::spawn(async move {
            let resident = held.resident.write().await.take();
            me.table().remove(&id);
            me.note_held(&id, None);
            match resident {
                Some(r) => op(r).await,
                None => Err(gone(&id)),
            }
        });
        match task.await {
            // Read after the op: its GPU share (if any) went back with the container.
            Ok(r) => r.map(|()| {
                let (gpu_usage_seq, usage) = self.gpu_usage();
                Response::new(pb::ReleasedReply {
                    gpu_usage: gpu_usage_to_pb(&usage),
                    gpu_usage_seq,
                })
            }),
            Err(e) => Err(Status::internal(format!("task failed: {e}"))),
        }
    }
}

struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

fn gone(id: &str) -> Status {
    let mut st = Status::not_found(format!("no container {id} on this worker"));
    st.metadata_mut().insert(
        convert::ERROR_KIND,
        tonic::metadata::MetadataValue::from_static("conn_closed"),
    );
    st
}

type Stream<T> = ReceiverStream<Result<T, Status>>;

#[tonic::async_trait]
impl NodeRpc for Arc<NodeService> {
    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::InfoReply>, Status> {
        let i = self.node.info();
        Ok(Response::new(pb::InfoReply {
            protocol_version: PROTOCOL_VERSION,
            runtime_version: i.runtime_version,
            platform: i.platform,
            nvproxy: i.nvproxy,
            agent_dir: i.agent_dir.to_string_lossy().into_owned(),
            worker_name: self.name.clone(),
        }))
    }

    async fn reconcile(
        &self,
        req: Request<pb::ReconcileRequest>,
    ) -> Result<Response<pb::ReconcileReply>, Status> {
        // A controller that reconciles starts from what it knows: the containers it started
        // here earlier (before its restart, or before it counted this worker lost) are
        // removed; other controllers' are theirs. Leftovers of an earlier run of the worker
        // itself were removed when it started.
        let caller = caller(&req);
        let keep = req.into_inner().keep;
        let removed = self.end_owned(&caller, &keep, true).await?;
        Ok(Response::new(pb::ReconcileReply {
            removed: removed as u64,
        }))
    }

    async fn boot(
        &self,
        req: Request<pb::LaunchRequest>,
    ) -> Result<Response<pb::ResidentReply>, Status> {
        let owner = caller(&req);
        let mut launch = self.local_launch(convert::launch_from_pb(req.into_inner())?)?;
        self.stored_rootfs(&mut launch).await?;
        let node = self.node.clone();
        let id = launch.container_id.clone();
        self.start(owner, id, async move { node.boot(launch).await })
            .await
    }

    async fn restore(
        &self,
        req: Request<pb::RestoreRequest>,
    ) -> Result<Response<pb::ResidentReply>, Status> {
        let owner = caller(&req);
        let req = req.into_inner();
        let mut launch = self.local_launch(convert::launch_from_pb(
            req.launch.ok_or_else(|| bad("restore", "no launch"))?,
        )?)?;
        self.stored_rootfs(&mut launch).await?;
        let id = launch.container_id.clone();
        // A relative image or a snapshot: this worker's own copy, or a fetch from the store.
        let uses_images = launch.stored.image.is_some() || Path::new(&req.image).is_relative();
        let (image, fetched, images) = if uses_images {
            let images = self.images()?.clone();
            let (image, fetched) = images.image(&id, &req.image, &launch.stored).await?;
            (image, fetched, Some(images))
        } else {
            (PathBuf::from(req.image), false, None)
        };
        // No re-encoding of the image replaces it while runsc reads it.
        let _reading = images.as_ref().map(|i| i.reading(&image));
        let keep = launch.stored.keep_image;
        let node = self.node.clone();
        let restored = self
            .start(owner, id, {
                let image = image.clone();
                async move { node.restore(launch, &image).await }
            })
            .await;
        if let Some(images) = images {
            // Restored or not, a fetched image is not kept; a local copy goes only once it
            // served (it is in the store).
            if restored.is_ok() || fetched {
                images.after_restore(&image, fetched, keep);
            }
        }
        restored
    }

    async fn kill(&self, req: Request<pb::ContainerRef>) -> Result<Response<pb::Empty>, Status> {
        let caller = caller(&req);
        let id = req.into_inner().container_id;
        // Another controller's container: that controller is gone (the caller took its
        // sandbox over), so nobody will destroy it: the worker does, and frees its slot.
        let orphan = {
            let mut table = self.table();
            match table.get(&id) {
                Some(h) if h.owner() != caller => {
                    self.note_held(&id, None);
                    table.remove(&id)
                }
                _ => None,
            }
        };
        let node = self.node.clone();
        tokio::spawn(async move {
            match orphan {
                Some(h) => {
                    if let Some(r) = h.resident.write().await.take() {
                        tracing::info!(container = %id, %caller, "destroying a container of a lost controller");
                        let _ = r.set_frozen(false).await;
                        r.destroy().await;
                    }
                }
                None => node.kill(&id).await,
            }
        })
        .await
        .map_err(|e| Status::internal(format!("kill task failed: {e}")))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn adopt(
        &self,
        req: Request<pb::ContainerRef>,
    ) -> Result<Response<pb::ResidentReply>, Status> {
        let caller = caller(&req);
        let id = req.into_inner().container_id;
        let held = self.held(&id)?;
        let guard = held.resident.read().await;
        let r = guard.as_ref().ok_or_else(|| gone(&id))?;
        let before = std::mem::replace(
            &mut *held.owner.lock().unwrap_or_else(|p| p.into_inner()),
            caller.clone(),
        );
        self.note_held(&id, Some(&caller));
        tracing::info!(container = %id, from = %before, to = %caller, "a controller adopted a container");
        let (gpu_usage_seq, usage) = self.gpu_usage();
        Ok(Response::new(pb::ResidentReply {
            container_id: r.id().to_string(),
            worker: r.worker().to_string(),
            was_warm: r.was_warm(),
            agent_version: r.agent_version(),
            memory: r.memory(),
            gpu_usage: gpu_usage_to_pb(&usage),
            gpu_usage_seq,
        }))
    }

    type TunnelStream = Stream<pb::TunnelFrame>;

    async fn tunnel(
        &self,
        req: Request<tonic::Streaming<pb::TunnelFrame>>,
    ) -> Result<Response<Self::TunnelStream>, Status> {
        let mut inbound = req.into_inner();
        let first = inbound
            .message()
            .await?
            .ok_or_else(|| bad("tunnel", "no first frame"))?;
        let port = u16::try_from(first.port)
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| bad("tunnel", "port must be 1-65535"))?;
        let held = self.held(&first.container_id)?;
        // The connection is opened under the container's read lock (no checkpoint or destroy
        // meanwhile), then lives on its own: the controller holds the sandbox borrowed while
        // it uses it.
        let io = {
            let guard = held.resident.read().await;
            let r = guard.as_ref().ok_or_else(|| gone(&first.container_id))?;
            r.connect_port(port).await.map_err(|e| status_of(&e))?
        };
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(crate::tunnel::worker_end(io, first.data, inbound, tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    type SendStream = Stream<pb::AgentFrame>;

    async fn send(
        &self,
        req: Request<pb::AgentRequest>,
    ) -> Result<Response<Self::SendStream>, Status> {
        let req = req.into_inner();
        let agent_req: AgentRequest =
            serde_json::from_str(&req.request_json).map_err(|e| bad("agent request", e))?;
        let held = self.held(&req.container_id)?;
        let mut replies = {
            let guard = held.resident.read().await;
            let r = guard.as_ref().ok_or_else(|| gone(&req.container_id))?;
            r.send(&agent_req, &req.body)
                .await
                .map_err(|e| status_of(&e.into()))?
        };
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    next = replies.recv() => {
                        let Some((reply, body)) = next else { break };
                        let frame = match serde_json::to_string(&reply) {
                            Ok(reply_json) => Ok(pb::AgentFrame { reply_json, body }),
                            Err(e) => Err(Status::internal(format!("reply encoding: {e}"))),
                        };
                        if tx.send(frame).await.is_err() {
                            break;
                        }
                    }
                    // The controller went away: stop reading (the agent's replies are dropped).
                    _ = tx.closed() => break,
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn set_frozen(
        &self,
        req: Request<pb::SetFrozenRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        let req = req.into_inner();
        let held = self.held(&req.container_id)?;
        let guard = held.resident.read().await;
        let r = guard.as_ref().ok_or_else(|| gone(&req.container_id))?;
        r.set_frozen(req.frozen).await.map_err(|e| status_of(&e))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn memory(
        &self,
        req: Request<pb::ContainerRef>,
    ) -> Result<Response<pb::MemoryReply>, Status> {
        let id = req.into_inner().container_id;
        let held = self.held(&id)?;
        let guard = held.resident.read().await;
        let r = guard.as_ref().ok_or_else(|| gone(&id))?;
        Ok(Response::new(pb::MemoryReply { bytes: r.memory() }))
    }

    async fn checkpoint(
        &self,
        req: Request<pb::CheckpointRequest>,
    ) -> Result<Response<pb::ReleasedReply>, Status> {
        let req = req.into_inner();
        // A relative directory is the worker's own: written aside, made durable, renamed.
        let staged = match Path::new(&req.image_dir).is_relative() {
            true => {
                let images = self.images()?.clone();
                let (tmp, dest) = images
                    .staging(&req.image_dir)?
                    .expect("a relative directory is staged");
                Some((images, tmp, dest))
            }
            false => None,
        };
        let dir = match &staged {
            Some((_, tmp, _)) => tmp.clone(),
            None => PathBuf::from(&req.image_dir),
        };
        if let Some((_, tmp, _)) = &staged {
            let _ = std::fs::remove_dir_all(tmp);
        }
        let turns = self.checkpoints.clone();
        self.finish(req.container_id, move |r| {
            Box::pin(async move {
                let _turn = turns.acquire_owned().await;
                let written = r.checkpoint(&dir).await.map_err(|e| status_of(&e));
                match (written, staged) {
                    (Ok(()), Some((images, tmp, dest))) => images.commit(tmp, dest).await,
                    (Err(e), Some((_, tmp, _))) => {
                        let _ = std::fs::remove_dir_all(&tmp);
                        Err(e)
                    }
                    (written, None) => written,
                }
            })
        })
        .await
    }

    async fn upload(
        &self,
        req: Request<pb::UploadRequest>,
    ) -> Result<Response<pb::UploadReply>, Status> {
        let req = req.into_inner();
        let images = self.images()?.clone();
        let put = PutImage {
            access: convert::access_from_pb(req.access)?,
            labels: req.labels.into_iter().collect(),
            id: (!req.id.is_empty()).then_some(req.id),
            pin: req.pin,
            parent: (!req.parent.is_empty()).then_some(req.parent),
        };
        // In its own task: a controller whose deadline passes does not cut an upload half-way
        // (the manifest, written last, is the commit marker either way).
        let up = tokio::spawn(async move { images.upload(&req.image_dir, &put).await })
            .await
            .map_err(|e| Status::internal(format!("upload task failed: {e}")))??;
        Ok(Response::new(pb::UploadReply {
            snapshot: up.snapshot,
            input_bytes: up.input_bytes,
            bytes_written: up.bytes_written,
        }))
    }

    async fn remove_image(
        &self,
        req: Request<pb::RemoveImageRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        let req = req.into_inner();
        if req.snapshot.is_empty() {
            self.images()?.remove(&req.image_dir)?;
        } else {
            self.images()?.forget(&req.snapshot).await?;
        }
        Ok(Response::new(pb::Empty {}))
    }

    async fn list_images(
        &self,
        _req: Request<pb::Empty>,
    ) -> Result<Response<pb::ImagesReply>, Status> {
        let images = self
            .images()?
            .list()
            .into_iter()
            .map(|i| pb::WorkerImage {
                dir: i.dir,
                age_ms: i.age.as_millis() as u64,
                uploaded: i.uploaded,
            })
            .collect();
        Ok(Response::new(pb::ImagesReply { images }))
    }

    async fn gpu_status(
        &self,
        req: Request<pb::GpuStatusRequest>,
    ) -> Result<Response<pb::GpuStatusReply>, Status> {
        let viewer = req.into_inner().viewer;
        let json = self
            .gpus
            .get()
            .map(|g| g.status_json(&viewer))
            .unwrap_or_default();
        Ok(Response::new(pb::GpuStatusReply { json }))
    }

    async fn forget_gpu_tickets(
        &self,
        req: Request<pb::ForgetGpuTicketsRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        let sandboxes = req.into_inner().sandboxes;
        if sandboxes.len() > MAX_FORGOTTEN_TICKETS {
            return Err(Status::invalid_argument(format!(
                "at most {MAX_FORGOTTEN_TICKETS} sandboxes per call"
            )));
        }
        if let Some(g) = self.gpus.get() {
            g.forget_tickets(&sandboxes);
        }
        Ok(Response::new(pb::Empty {}))
    }

    async fn destroy(
        &self,
        req: Request<pb::ContainerRef>,
    ) -> Result<Response<pb::ReleasedReply>, Status> {
        let id = req.into_inner().container_id;
        self.finish(id, |r| {
            Box::pin(async move {
                r.destroy().await;
                Ok(())
            })
        })
        .await
    }

    async fn apply_policy(
        &self,
        req: Request<pb::PolicyRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        let req = req.into_inner();
        let policy = serde_json::from_str(&req.policy_json).map_err(|e| bad("policy", e))?;
        let held = self.held(&req.container_id)?;
        let guard = held.resident.read().await;
        let r = guard.as_ref().ok_or_else(|| gone(&req.container_id))?;
        r.apply_policy(&policy).await.map_err(|e| status_of(&e))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn net_stats(
        &self,
        req: Request<pb::ContainerRef>,
    ) -> Result<Response<pb::NetStatsReply>, Status> {
        let id = req.into_inner().container_id;
        let held = self.held(&id)?;
        let guard = held.resident.read().await;
        let r = guard.as_ref().ok_or_else(|| gone(&id))?;
        Ok(Response::new(pb::NetStatsReply {
            stats: r.net_stats().as_ref().map(convert::net_to_pb),
        }))
    }

    async fn settle_connections(
        &self,
        req: Request<pb::ContainerRef>,
    ) -> Result<Response<pb::Empty>, Status> {
        let id = req.into_inner().container_id;
        let held = self.held(&id)?;
        let guard = held.resident.read().await;
        let r = guard.as_ref().ok_or_else(|| gone(&id))?;
        r.settle_connections().await;
        Ok(Response::new(pb::Empty {}))
    }

    async fn warm_stats(
        &self,
        _: Request<pb::Empty>,
    ) -> Result<Response<pb::WarmStatsReply>, Status> {
        Ok(Response::new(convert::warm_to_pb(&self.node.warm_stats())))
    }

    async fn log_tail(
        &self,
        req: Request<pb::ContainerRef>,
    ) -> Result<Response<pb::LogTailReply>, Status> {
        let id = req.into_inner().container_id;
        Ok(Response::new(pb::LogTailReply {
            tail: self.node.log_tail(&id),
        }))
    }

    type EventsStream = Stream<pb::Event>;

    async fn events(
        &self,
        req: Request<pb::EventsRequest>,
    ) -> Result<Response<Self::EventsStream>, Status> {
        let interval = Duration::from_millis(
            req.into_inner()
                .usage_interval_ms
                .max(MIN_USAGE_INTERVAL_MS),
        );
        let (tx, rx) = mpsc::channel(64);
        let me = self.clone();
        let mut events = self.events.subscribe();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                let event = tokio::select! {
                    ev = events.recv() => match ev {
                        Ok(NodeEvent::Exited { container_id, info, expected }) => {
                            let log_tail = if expected { String::new() } else { me.node.log_tail(&container_id) };
                            pb::event::Kind::Exited(pb::Exited {
                                container_id,
                                info: Some(convert::exit_to_pb(&info)),
                                expected,
                                log_tail,
                            })
                        }
                        // Only a fleet of workers reports losses, never one worker's node.
                        Ok(NodeEvent::Lost { .. }) => continue,
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                            tracing::warn!(skipped = n, "a controller's event stream fell behind; exits skipped");
                            continue;
                        }
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                    },
                    _ = tick.tick() => pb::event::Kind::Usage(me.usage()),
                    _ = tx.closed() => break,
                };
                if tx.send(Ok(pb::Event { kind: Some(event) })).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Refuses a call of another protocol version; `me` names this side in the message.
pub(crate) fn check_version(req: &Request<()>, me: &str) -> Result<(), Status> {
    let version = req
        .metadata()
        .get(PROTOCOL_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u32>().ok());
    if version != Some(PROTOCOL_VERSION) {
        return Err(Status::failed_precondition(format!(
            "this {me} speaks protocol {PROTOCOL_VERSION}, the caller {version:?}"
        )));
    }
    Ok(())
}

/// The calling controller's name (its certificate's); empty where no TLS layer ran (tests
/// that serve the protocol in memory).
fn caller<T>(req: &Request<T>) -> String {
    req.extensions()
        .get::<PeerInfo>()
        .map(|p| p.identity.name.to_string())
        .unwrap_or_default()
}

/// Refuses calls of another protocol version and callers that are not controllers (the TLS
/// layer refused them already; this holds if that layer is ever configured otherwise).
fn check_call(req: Request<()>) -> Result<Request<()>, Status> {
    check_version(&req, "worker")?;
    match req.extensions().get::<PeerInfo>() {
        Some(p) if p.identity.role == Role::Controller => Ok(req),
        _ => Err(Status::permission_denied(
            "only controllers may call a worker",
        )),
    }
}

/// A TLS connection whose peer has been verified (and is verified again as the trust
/// material changes or its certificate expires: see [`crate::tls`]).
pub struct PeerConn {
    io: Revocable<tokio_rustls::server::TlsStream<TcpStream>>,
    info: PeerInfo,
}

impl Connected for PeerConn {
    type ConnectInfo = PeerInfo;
    fn connect_info(&self) -> PeerInfo {
        self.info.clone()
    }
}

impl AsyncRead for PeerConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for PeerConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    #[error("gRPC server")]
    Transport(#[from] tonic::transport::Error),
}

/// Verified connections, as a tonic server's incoming stream.
pub(crate) type Verified = ReceiverStream<Result<PeerConn, std::io::Error>>;

/// Accepts TLS connections on `listener` whose peers `tls` verifies, in a task of its own
/// (aborted with the returned handle), as a stream for a tonic server.
pub(crate) fn accept_verified(
    listener: TcpListener,
    tls: Arc<TlsSource>,
) -> Result<(Verified, tokio::task::JoinHandle<()>), ServeError> {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.server_config()?);
    let (conns, incoming) = mpsc::channel::<Result<PeerConn, std::io::Error>>(64);
    let accept_loop = tokio::spawn(async move {
        loop {
            let (tcp, addr) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a cluster connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let acceptor = acceptor.clone();
            let conns = conns.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let _ = tcp.set_nodelay(true);
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(io)) => {
                        let chain: Vec<_> = io
                            .get_ref()
                            .1
                            .peer_certificates()
                            .map(|c| c.iter().map(|c| c.clone().into_owned()).collect())
                            .unwrap_or_default();
                        let identity = crate::tls::peer_identity(Some(chain.as_slice()));
                        let Some(identity) = identity else {
                            tls.refused(
                                Some(addr),
                                "wrong_identity",
                                &"no identity after the handshake",
                            );
                            return;
                        };
                        tracing::debug!(peer = %addr, %identity, "cluster peer connected");
                        let io = tls.watch(io, Direction::Accepted, Some(addr), chain);
                        let _ = conns
                            .send(Ok(PeerConn {
                                io,
                                info: PeerInfo { addr, identity },
                            }))
                            .await;
                    }
                    Ok(Err(e)) => tls.refused(Some(addr), refusal_reason(&e), &e),
                    Err(_) => tls.refused(Some(addr), "timeout", &"no TLS handshake in time"),
                }
            });
        }
    });
    Ok((ReceiverStream::new(incoming), accept_loop))
}

/// Serves `service` on `listener` to controllers that pass `tls`, until `shutdown` resolves.
pub async fn serve(
    service: Arc<NodeService>,
    listener: TcpListener,
    tls: Arc<TlsSource>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let (incoming, accept_loop) = accept_verified(listener, tls)?;
    let result = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .add_service(tonic::service::interceptor::InterceptedService::new(
            NodeServer::new(service)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
            check_call,
        ))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    accept_loop.abort();
    Ok(result?)
}

/// The address a listener is bound to (for logs).
pub fn local_addr(l: &TcpListener) -> Option<SocketAddr> {
    l.local_addr().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use torpor_runtime::node::fake::FakeNode;
    use torpor_runtime::node::StoredFiles;
    use torpor_runtime::spec::ContainerSpec;

    fn launch(container_id: &str) -> Launch {
        Launch {
            container_id: container_id.into(),
            spec: ContainerSpec {
                rootfs: "/nonexistent".into(),
                mounts: vec![],
                agent_dir: "/nonexistent".into(),
                argv: vec!["sleep".into(), "1".into()],
                env: Default::default(),
                cwd: "/".into(),
                limits: Default::default(),
                hostname: "h".into(),
                netns: None,
                devices: vec![],
            },
            network: None,
            ready_timeout: Duration::from_secs(1),
            stored: StoredFiles::default(),
            gpu: None,
        }
    }

    #[tokio::test]
    async fn the_chunk_cache_queue_counts_in_what_the_worker_says_is_resident() {
        let dir = tempfile::tempdir().unwrap();
        let open: crate::images::OpenBackend = Arc::new(|_: &str| Err("no store here".into()));
        let images = Arc::new(WorkerImages::open(dir.path(), open, 64 << 20).unwrap());
        let node: Arc<dyn Node> = Arc::new(Arc::new(FakeNode::new()));
        let svc = NodeService::new(node, "w1".into());
        svc.set_images(images.clone());
        assert_eq!(svc.load(), (0, 0));
        // A fetch's chunks wait in memory for the cache's writer: the heartbeat counts them.
        let blob = bytes::Bytes::from(vec![7u8; 1 << 20]);
        let cache = images.chunk_cache().expect("a chunk cache").clone();
        cache.insert_in_background(torpor_snapshot::ChunkId::of(&blob), blob);
        assert_eq!(svc.load(), (0, 1 << 20));
        // Written (after a quiet second, at most ten), they no longer do.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while svc.load().1 > 0 {
            assert!(std::time::Instant::now() < deadline, "never written");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(cache.usage().bytes, 1 << 20, "on disk now");
    }

    #[tokio::test]
    async fn fence_orders_end_only_what_the_ordering_controller_still_holds() {
        let node: Arc<dyn Node> = Arc::new(Arc::new(FakeNode::new()));
        let svc = NodeService::new(node.clone(), "w1".into());
        for (id, owner) in [("a-g1", "c1"), ("b-g1", "c1"), ("c-g1", "c2")] {
            let l = launch(id);
            let n = node.clone();
            svc.start(owner.into(), id.into(), async move { n.boot(l).await })
                .await
                .unwrap();
        }
        // Attack: c1 orders c2's container (adopted by c2 since c1 lost the worker) and one
        // the worker never held; only c1's own a-g1 ends, and every order is confirmed.
        let orders: Vec<(String, String)> = [("a-g1", "c1"), ("c-g1", "c1"), ("z-g1", "c1")]
            .iter()
            .map(|(c, o)| (c.to_string(), o.to_string()))
            .collect();
        let done = svc.end_ordered(&orders).await;
        assert_eq!(done, ["a-g1", "c-g1", "z-g1"]);
        let mut left: Vec<String> = svc.table().keys().cloned().collect();
        left.sort();
        assert_eq!(left, ["b-g1", "c-g1"]);
    }

    #[tokio::test]
    async fn forget_gpu_tickets_reaches_the_gpu_layer_within_its_bound() {
        use crate::pb::node_server::Node as _;
        #[derive(Default)]
        struct Gpus(std::sync::Mutex<Vec<String>>);
        impl WorkerGpus for Gpus {
            fn usage(&self) -> GpuUsage {
                GpuUsage::new()
            }
            fn status_json(&self, _: &str) -> String {
                String::new()
            }
            fn forget_tickets(&self, sandboxes: &[String]) {
                self.0.lock().unwrap().extend_from_slice(sandboxes);
            }
        }
        let node: Arc<dyn Node> = Arc::new(Arc::new(FakeNode::new()));
        let svc = NodeService::new(node, "w1".into());
        let ask = |n: usize| {
            Request::new(pb::ForgetGpuTicketsRequest {
                sandboxes: (0..n).map(|i| format!("sb-{i}")).collect(),
            })
        };
        // A worker without GPUs has no tickets: nothing to do, no error.
        svc.forget_gpu_tickets(ask(2)).await.unwrap();
        let gpus = Arc::new(Gpus::default());
        svc.set_gpus(gpus.clone());
        svc.forget_gpu_tickets(ask(2)).await.unwrap();
        assert_eq!(*gpus.0.lock().unwrap(), ["sb-0", "sb-1"]);
        // Attack: a flood in one call is refused whole.
        let err = svc
            .forget_gpu_tickets(ask(MAX_FORGOTTEN_TICKETS + 1))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert_eq!(gpus.0.lock().unwrap().len(), 2);
    }

    /// A checkpoint's and a destroy's answers carry the worker's GPU usage read after the
    /// container's share went back, numbered after every earlier report: the controller's
    /// quota stops counting the share at once, not at the worker's next heartbeat.
    #[tokio::test]
    async fn a_checkpoint_or_destroy_answers_the_gpu_usage_after_the_share_went_back() {
        use crate::pb::node_server::Node as _;
        /// One share of `acme` per container the node runs.
        struct Gpus(Arc<FakeNode>);
        impl WorkerGpus for Gpus {
            fn usage(&self) -> GpuUsage {
                let n = self.0.running().len() as u64;
                if n == 0 {
                    return GpuUsage::new();
                }
                GpuUsage::from([(
                    "acme".to_string(),
                    torpor_gpu::quota::Amount {
                        memory_mib: 1024 * n,
                        compute: 100 * n,
                    },
                )])
            }
            fn status_json(&self, _: &str) -> String {
                String::new()
            }
            fn forget_tickets(&self, _: &[String]) {}
        }
        let fake = Arc::new(FakeNode::new());
        let node: Arc<dyn Node> = Arc::new(fake.clone());
        let svc = NodeService::new(node.clone(), "w1".into());
        svc.set_gpus(Arc::new(Gpus(fake.clone())));
        for id in ["a-g1", "b-g1"] {
            let (l, n) = (launch(id), node.clone());
            svc.start("c1".into(), id.into(), async move { n.boot(l).await })
                .await
                .unwrap();
        }
        let (before, held) = svc.gpu_usage();
        assert_eq!(held["acme"].compute, 200);

        let cref = |id: &str| {
            Request::new(pb::ContainerRef {
                container_id: id.into(),
            })
        };
        let destroyed = svc.destroy(cref("a-g1")).await.unwrap().into_inner();
        assert!(destroyed.gpu_usage_seq > before);
        assert_eq!(destroyed.gpu_usage["acme"].compute, 100, "{destroyed:?}");

        let dir = tempfile::tempdir().unwrap();
        let checkpointed = svc
            .checkpoint(Request::new(pb::CheckpointRequest {
                container_id: "b-g1".into(),
                image_dir: dir.path().join("img").to_string_lossy().into_owned(),
            }))
            .await
            .unwrap()
            .into_inner();
        assert!(checkpointed.gpu_usage_seq > destroyed.gpu_usage_seq);
        assert!(checkpointed.gpu_usage.is_empty(), "{checkpointed:?}");
        // A container the worker does not hold: refused, no report.
        assert_eq!(
            svc.destroy(cref("a-g1")).await.unwrap_err().code(),
            tonic::Code::NotFound
        );
    }

    #[test]
    fn a_workers_gpu_usage_report_is_bounded() {
        // Attack: a worker (compromised, or buggy) floods its heartbeat with tenants.
        let flood: HashMap<String, pb::GpuAmount> = (0..MAX_GPU_USAGE_TENANTS + 100)
            .map(|i| {
                (
                    format!("t{i}"),
                    pb::GpuAmount {
                        memory_mib: 1,
                        compute: 7,
                    },
                )
            })
            .collect();
        assert_eq!(gpu_usage_from_pb(flood).len(), MAX_GPU_USAGE_TENANTS);
        let one = GpuUsage::from([(
            "acme".to_string(),
            torpor_gpu::quota::Amount {
                memory_mib: 23034,
                compute: 700,
            },
        )]);
        assert_eq!(gpu_usage_from_pb(gpu_usage_to_pb(&one)), one);
    }
}
