//! The node seam: every operation the control plane asks of a machine that runs sandboxes.
//!
//! ```text
//!   torpor-control (lifecycle, policy, store)
//!        │  Arc<dyn Node>                      Box<dyn Resident>
//!        ▼                                     ▼
//!   ┌──────────────┐  boot / restore   ┌──────────────────┐  call · freeze · memory · net
//!   │     Node     │ ───────────────▶ │ Resident (one     │  checkpoint(self) · destroy(self)
//!   │ (a machine)  │ ◀─── events ──── │ container on it)  │
//!   └──────────────┘  Exited{id,info} └──────────────────┘
//! ```
//!
//! A [`Node`] turns an image into a running container on one of its prepared workers and hands
//! back a [`Resident`]: the only way to reach that container. The resident is consumed by
//! [`Resident::checkpoint`] and [`Resident::destroy`], so a container that is gone cannot be
//! called by mistake; dropping it without either leaves the container to [`Node::kill`] or to
//! the next [`Node::reconcile`]. Containers that end on their own (crash, OOM kill) are reported
//! once on the node's event stream ([`Node::take_events`]).
//!
//! Two implementations: [`RunscNode`] (gVisor's runsc, the warm pool's cgroups and bundles,
//! network namespaces: this machine) and [`fake::FakeNode`] (in memory, deterministic, with
//! injectable failures and a record of every call, for tests that need neither root nor runsc).
//! A remote worker (cluster mode) is a third: the same calls over the controller-worker protocol.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::mpsc;
use torpor_core::NetworkPolicy;

use crate::conn::ConnError;
use crate::net::NetStats;
use crate::proto::{Reply, Request};
use crate::runsc::{ExitHandle, ExitInfo, RuntimeError};
use crate::spec::ContainerSpec;
use crate::warm::WarmStats;

pub mod fake;
mod runsc_node;

pub use runsc_node::{RunscNode, RunscNodeConfig};

/// The sandbox id in a container id (`<sandbox id>-g<generation>`); `None` for others
/// (a template build's `tpl-...`).
pub fn sandbox_of(container_id: &str) -> Option<&str> {
    container_id
        .rsplit_once("-g")
        .map(|(id, _)| id)
        .filter(|_| !container_id.starts_with("tpl-"))
}

/// What a node runs and how (shown by `GET /healthz`, used to decide GPU support).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// The sandbox runtime's version (runsc's build).
    pub runtime_version: String,
    /// The runtime's platform (ptrace, systrap, kvm).
    pub platform: String,
    /// Whether the runtime can pass GPUs through (runsc nvproxy).
    pub nvproxy: bool,
    /// Where the in-sandbox agent is installed on the node (mounted read-only into each sandbox).
    pub agent_dir: PathBuf,
}

/// One container to start.
#[derive(Debug, Clone)]
pub struct Launch {
    /// `<sandbox id>-g<generation>` for a sandbox, `tpl-<name>-<nonce>` for a template build:
    /// fresh for every start, so a container a crashed daemon left never collides.
    pub container_id: String,
    pub spec: ContainerSpec,
    /// The sandbox's egress policy; `None`: no network interface at all.
    pub network: Option<NetworkPolicy>,
    /// How long to wait for the agent's hello.
    pub ready_timeout: Duration,
    /// Cluster mode: the files of this start as snapshots in the shared store, for a node that
    /// does not hold the paths named above (empty on a single machine).
    pub stored: StoredFiles,
    /// Cluster mode: the GPU share the worker must give this container from its own GPUs
    /// (`None`: no GPU, or a single machine, where the engine places shares itself).
    pub gpu: Option<LaunchGpu>,
}

/// A GPU share a worker places from its own GPUs at start (cluster mode). Both fields are
/// `torpor-gpu` JSON, so this crate stays free of the GPU planner: the worker's GPU layer
/// parses them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchGpu {
    /// The sandbox's `GpuRequest`, its tenant set.
    pub request: String,
    /// A `QuotaBook` holding the tenant's quota less what it holds on other workers (the
    /// controller's cluster-wide view); `None`: no quota is enforced.
    pub quota: Option<String>,
}

/// How a node reads one tenant's snapshots in the shared store: its namespace and, for an
/// encrypted store, its key (sent to the worker that must read or write them, over mutual
/// TLS, for that call only; a worker already sees the sandbox's memory in clear).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct StoreAccess {
    pub namespace: Option<String>,
    pub key: Option<[u8; 32]>,
}

impl std::fmt::Debug for StoreAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreAccess")
            .field("namespace", &self.namespace)
            .field("key", &self.key.map(|_| ".."))
            .finish()
    }
}

/// A start's files in the snapshot store (cluster mode). A worker's disk is a cache of the
/// store: it uses what it holds and fetches (every chunk verified) what it lacks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoredFiles {
    /// The template's root filesystem (fetched once per worker and kept).
    pub rootfs: Option<String>,
    /// The checkpoint to restore, when the image path is not on the chosen worker.
    pub image: Option<String>,
    /// Keep a fetched `image` for later starts (a golden snapshot: every create restores it).
    pub keep_image: bool,
    /// The worker whose own disk holds the image (a checkpoint not yet in the store): the
    /// restore runs there or nowhere ([`RuntimeError::ImageLost`] when that worker is gone).
    pub image_on: Option<String>,
    pub access: StoreAccess,
}

/// A checkpoint to put into the snapshot store from the disk of the worker that wrote it.
#[derive(Debug, Clone, Default)]
pub struct PutImage {
    pub access: StoreAccess,
    pub labels: Vec<(String, String)>,
    /// A fixed snapshot id (a golden snapshot or a root filesystem); `None`: from the content.
    pub id: Option<String>,
    /// Pin it: retention never removes it.
    pub pin: bool,
    /// The sandbox's previous snapshot in the same store, if it has one: its chunks are known
    /// stored, so the put looks up and writes only what changed (one gone meanwhile is
    /// skipped, not an error).
    pub parent: Option<String>,
}

/// What an upload stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uploaded {
    pub snapshot: String,
    /// The image's size, and the bytes the store did not hold yet (deduplication).
    pub input_bytes: u64,
    pub bytes_written: u64,
}

/// Cluster mode: checkpoints stay on the disk of the worker that wrote them (a checkpoint to a
/// *relative* image directory lands in that worker's own image area, durably) until they are
/// put into the shared store from there. A single machine has no such host: its images are
/// the engine's own paths.
#[async_trait]
pub trait ImageHost: Send + Sync {
    /// Puts image `dir` (relative, in `node`'s image area) into the store.
    async fn upload(&self, node: &str, dir: &str, put: &PutImage)
        -> Result<Uploaded, RuntimeError>;
    /// Removes image `dir` from `node`'s disk (best effort: a gone worker has nothing to free).
    async fn remove(&self, node: &str, dir: &str);
    /// `snapshot` left the store: the workers drop their copies of it (best effort): the
    /// worker that uploaded it, or, `everywhere` (a template's, fetched and kept by any),
    /// every reachable worker.
    async fn forget(&self, snapshot: &str, everywhere: bool);
    /// Whether `node` is a worker that can still be asked (ready or draining, not lost).
    fn reachable(&self, node: &str) -> bool;
    /// Whether `node` takes sandboxes now (ready: not draining, not lost).
    fn ready(&self, node: &str) -> bool;
    /// The checkpoints in each reachable worker's own image area (best effort: a worker that
    /// does not answer is left out).
    async fn images(&self) -> Vec<(String, Vec<WorkerImage>)> {
        Vec::new()
    }
}

/// A checkpoint in a worker's own image area ([`ImageHost::images`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerImage {
    /// Its relative image directory (`<container id>` for a sandbox's checkpoint).
    pub dir: String,
    /// Since it was written.
    pub age: Duration,
    /// Put into the store (the worker keeps a bounded number of such copies); otherwise it may
    /// be the only copy there is.
    pub uploaded: bool,
}

/// Something the node reports on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeEvent {
    /// A container's runtime process ended. `expected`: torpor asked for it (checkpoint,
    /// destroy, kill); otherwise it is a crash (`info.oom_killed` for the OOM killer).
    Exited {
        container_id: String,
        info: ExitInfo,
        expected: bool,
    },
    /// The machine a container ran on stopped answering (cluster mode: its worker missed its
    /// heartbeats past the controller's limit). The container counts as gone: whatever it did
    /// since its last snapshot is lost.
    Lost {
        container_id: String,
        /// The worker's name.
        worker: String,
        /// How long it had been silent.
        silent_for: Duration,
    },
}

/// A connection to a port inside a sandbox ([`Resident::connect_port`]).
pub trait PortIo: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {
    /// Whether the sandbox closed before we did (then answer with a reset, not a FIN, which
    /// would leave the sandbox's socket in TIME_WAIT and block its checkpoint).
    fn peer_closed_first(&self) -> bool;
    /// Resets the connection when dropped, whoever closed.
    fn reset_on_drop(&self);
}

pub type PortStream = Box<dyn PortIo>;

impl PortIo for crate::relay::PeerCloseAware {
    fn peer_closed_first(&self) -> bool {
        crate::relay::PeerCloseAware::peer_closed_first(self)
    }
    fn reset_on_drop(&self) {
        crate::relay::PeerCloseAware::reset_on_drop(self)
    }
}

/// A machine that runs sandboxes.
#[async_trait]
pub trait Node: Send + Sync + 'static {
    fn info(&self) -> NodeInfo;

    /// The node's event stream; the first caller gets it, later callers `None`.
    fn take_events(&self) -> Option<mpsc::UnboundedReceiver<NodeEvent>>;

    /// Clears what a previous run of this node left: containers and runtime processes, after
    /// thawing the frozen groups of containers of `known_sandboxes` (a frozen process cannot
    /// die). Plain data, so a remote node can be asked the same. Returns how many leftovers
    /// were removed.
    async fn reconcile(&self, known_sandboxes: &[String]) -> usize;

    /// Boots a fresh container (a template build) and waits until its agent answers.
    async fn boot(&self, launch: Launch) -> Result<Box<dyn Resident>, RuntimeError>;

    /// Restores a container from a checkpoint image on a prepared worker (its network made
    /// ready for `launch.network`) and waits until its agent answers. On failure nothing of it
    /// is left running.
    async fn restore(
        &self,
        launch: Launch,
        image: &Path,
    ) -> Result<Box<dyn Resident>, RuntimeError>;

    /// Takes over a running container that another controller started and lost (cluster mode:
    /// that controller died; the container kept running on its worker), charging it `memory`.
    /// `None` where the node cannot (a single machine: no other controller) or no longer runs
    /// it.
    async fn adopt(&self, _container_id: &str, _memory: u64) -> Option<Box<dyn Resident>> {
        None
    }

    /// Containers a restarted controller's records say were resident before its restart, each
    /// with the worker the records put it on (cluster mode). A node that clears a returning
    /// worker's leftovers keeps these, when that very worker announces them, for
    /// [`Node::adopt`] to take back; [`Node::kill`] ends one nobody took. A single machine's
    /// node has nothing to keep: its engine adopts at start.
    fn expect_back(&self, _expected: &[(String, String)]) {}

    /// Whether worker `worker` is reachable from this node now, so that [`Node::adopt`] can
    /// tell whether a container of it still runs (cluster mode: registered with this
    /// controller and not lost). A single machine's node is its only worker.
    fn reaches_worker(&self, _worker: &str) -> bool {
        true
    }

    /// Whether any of its workers takes new sandboxes now (cluster mode: one is ready, however
    /// full; a single machine's node is its own worker).
    fn has_ready_worker(&self) -> bool {
        true
    }

    /// Kills a container by id, whoever holds its [`Resident`] (a delete cutting calls in
    /// flight): the calls end with [`ConnError::Closed`], the holder then destroys it.
    async fn kill(&self, container_id: &str);

    /// The last lines of a container's log (for the operator's log, never for clients).
    fn log_tail(&self, container_id: &str) -> String;

    /// Prepared workers: target, ready, warm and cold takes.
    fn warm_stats(&self) -> WarmStats;

    /// Cluster mode's image host ([`ImageHost`]); `None` on a single machine.
    fn image_host(&self) -> Option<&dyn ImageHost> {
        None
    }

    /// Tears down prepared workers; resident containers are the caller's to checkpoint first.
    /// (A remote node stops talking to its worker; the worker's own operator stops it.)
    async fn shutdown(&self);
}

/// One running container on a node, held by the control plane.
#[async_trait]
pub trait Resident: Send + Sync {
    /// The container id ([`Launch::container_id`]).
    fn id(&self) -> &str;

    /// The node's name for the worker it runs on (unique within the node's run).
    fn worker(&self) -> &str;

    /// The worker process the container runs on, in cluster mode (its certificate's name);
    /// `None` on a single machine.
    fn node(&self) -> Option<&str> {
        None
    }

    /// Whether the worker came prepared (a warm take) rather than made for this start.
    fn was_warm(&self) -> bool;

    /// Sends a request to the sandbox's agent; its replies (several for a streamed exec)
    /// arrive on the channel, which ends when the agent goes away.
    async fn send(
        &self,
        req: &Request,
        body: &[u8],
    ) -> Result<mpsc::Receiver<(Reply, Vec<u8>)>, ConnError>;

    /// Sends a request and waits for its one reply.
    async fn call(&self, req: &Request, body: &[u8]) -> Result<(Reply, Vec<u8>), ConnError> {
        let mut rx = self.send(req, body).await?;
        rx.recv().await.ok_or(ConnError::Closed)
    }

    /// The protocol version the agent said hello with.
    fn agent_version(&self) -> u32;

    /// Whether the agent channel is open (false once the container died).
    fn alive(&self) -> bool;

    /// How the container ends (for a call that lost its agent).
    fn exit_handle(&self) -> ExitHandle;

    /// Freezes (no CPU, memory kept) or thaws the container.
    async fn set_frozen(&self, frozen: bool) -> Result<(), RuntimeError>;

    /// Bytes charged to the container's memory.
    fn memory(&self) -> Option<u64>;

    /// Writes the container's whole state to `image_dir`. The container is gone afterwards,
    /// also when this fails (the caller falls back to its previous image).
    async fn checkpoint(self: Box<Self>, image_dir: &Path) -> Result<(), RuntimeError>;

    /// Stops the container and gives its worker back.
    async fn destroy(self: Box<Self>);

    /// Lets the container go without touching it: it keeps running on its worker for another
    /// controller to adopt (cluster mode passes a sandbox's hold between controllers). Where
    /// nobody else could adopt it (one machine), it is destroyed.
    async fn release(self: Box<Self>) {
        self.destroy().await
    }

    /// Where the ingress proxy reaches the sandbox's ports (networked sandboxes only).
    fn ingress_addr(&self) -> Option<Ipv4Addr>;

    /// Opens a connection to `port` inside the sandbox (networked sandboxes only), from where
    /// its node reaches sandbox ports: this machine's router namespace, or through the worker
    /// that runs it (cluster mode). Whoever closes, the sandbox keeps no endpoint that would
    /// block its checkpoint (see [`PortIo`]).
    async fn connect_port(&self, port: u16) -> Result<PortStream, RuntimeError> {
        let addr = self
            .ingress_addr()
            .ok_or_else(|| RuntimeError::Unsupported("the sandbox has no network".into()))?;
        let stream = crate::net::connect_ingress(addr, port)
            .await
            .map_err(|e| RuntimeError::Unsupported(format!("connect to port {port}: {e}")))?;
        let _ = stream.set_nodelay(true);
        Ok(Box::new(crate::relay::PeerCloseAware::new(stream)))
    }

    /// Replaces the sandbox's egress rules (networked sandboxes only; others: no-op).
    async fn apply_policy(&self, policy: &NetworkPolicy) -> Result<(), RuntimeError>;

    /// The sandbox's traffic counters since this start (networked sandboxes only).
    fn net_stats(&self) -> Option<NetStats>;

    /// Resets the sandbox's open TCP connections before a checkpoint (which gVisor refuses
    /// while one is open) and lets the sandbox take the resets in.
    async fn settle_connections(&self);
}
