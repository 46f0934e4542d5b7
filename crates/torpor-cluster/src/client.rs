//! The controller's side: [`RemoteNode`], a [`Node`] whose machine is a worker across the
//! network, so that `Engine::start_on(cfg, Arc::new(remote))` drives it unchanged.
//!
//! Every call has a deadline. The node seam's synchronous reads are answered from what the
//! worker reports on its event stream: a container's memory and traffic counters and the warm
//! pool's counters arrive every `usage_interval` (so they are at most that old); a container's
//! exit arrives as it happens and resolves its [`ExitHandle`]. The event stream reconnects by
//! itself; while it is down, those reads keep their last values.
//!
//! What a remote node cannot do here, and says so:
//! - `ingress_addr` is `None`: the address is inside the worker's network namespaces, which a
//!   controller cannot reach (ingress over the protocol is for a later slice);
//! - `apply_policy` needs the multi-threaded runtime (it blocks on the call, the seam being
//!   synchronous there); on a current-thread runtime it is refused;
//! - `shutdown` does not stop the worker (its own operator does): it stops the event stream.

use std::collections::HashMap;
use std::future::Future;
use std::net::Ipv4Addr;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Request, Status};
use torpor_core::NetworkPolicy;
use torpor_runtime::conn::ConnError;
use torpor_runtime::net::NetStats;
use torpor_runtime::node::{Launch, Node, NodeEvent, NodeInfo, PutImage, Resident, Uploaded};
use torpor_runtime::proto::{Reply, Request as AgentRequest};
use torpor_runtime::runsc::{ExitHandle, ExitInfo, RuntimeError};
use torpor_runtime::warm::WarmStats;

use crate::convert;
use crate::pb;
use crate::pb::node_client::NodeClient;
use crate::tls::{refusal_reason, Direction, Revocable, TlsSource};
use crate::{MAX_MESSAGE, PROTOCOL_HEADER, PROTOCOL_VERSION};

/// Deadlines of the calls to a worker.
#[derive(Debug, Clone)]
pub struct Deadlines {
    /// Connecting (TCP and TLS).
    pub connect: Duration,
    /// Quick calls: info, freeze, memory, policy, stats, kill.
    pub quick: Duration,
    /// Added to a launch's `ready_timeout` for a boot or a restore (reading the image).
    pub start_margin: Duration,
    /// A checkpoint (writing the whole memory).
    pub checkpoint: Duration,
    /// A destroy and a reconcile.
    pub teardown: Duration,
    /// One agent request with all its replies (a streamed exec runs at most this long).
    pub agent_call: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            connect: Duration::from_secs(10),
            quick: Duration::from_secs(15),
            start_margin: Duration::from_secs(120),
            checkpoint: Duration::from_secs(600),
            teardown: Duration::from_secs(120),
            agent_call: Duration::from_secs(24 * 3600),
        }
    }
}

/// How to reach one worker.
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    /// `host:port` of the worker's `--listen`.
    pub addr: String,
    pub deadlines: Deadlines,
    /// How often the worker reports memory, traffic and warm-pool counters.
    pub usage_interval: Duration,
}

impl RemoteConfig {
    pub fn new(addr: impl Into<String>) -> RemoteConfig {
        RemoteConfig {
            addr: addr.into(),
            deadlines: Deadlines::default(),
            usage_interval: Duration::from_secs(1),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("worker address {0:?} is not host:port")]
    Addr(String),
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    #[error("worker {addr} did not answer")]
    Call {
        addr: String,
        #[source]
        source: Status,
    },
    #[error("worker {addr} speaks protocol {theirs}, this controller {PROTOCOL_VERSION}")]
    Version { addr: String, theirs: u32 },
}

/// What one container's exit and usage look like from here.
struct Tracked {
    exit: watch::Sender<Option<ExitInfo>>,
    expected: Arc<AtomicBool>,
    memory: Option<u64>,
    net: Option<NetStats>,
}

#[derive(Default)]
struct Shared {
    containers: HashMap<String, Tracked>,
    /// Log tails of containers that exited on their own (reported with the exit).
    tails: HashMap<String, String>,
    warm: WarmStats,
    /// What each tenant holds of the worker's GPUs, as of its newest heartbeat or start reply
    /// (by the worker's numbering of its reports).
    gpu_usage: (u64, crate::server::GpuUsage),
}

/// Keeps the report numbered `seq` unless `slot` holds a newer one (reports can arrive out of
/// order: a heartbeat sent before a start's reply may be read after it).
fn keep_newest(
    slot: &mut (u64, crate::server::GpuUsage),
    seq: u64,
    usage: crate::server::GpuUsage,
) {
    if seq >= slot.0 {
        *slot = (seq, usage);
    }
}

struct Inner {
    /// Swapped when the worker restarts elsewhere with containers this side still holds
    /// ([`RemoteNode::retarget`]).
    client: Mutex<NodeClient<Channel>>,
    cfg: RemoteConfig,
    name: String,
    shared: Mutex<Shared>,
    events: mpsc::UnboundedSender<NodeEvent>,
    events_rx: Mutex<Option<mpsc::UnboundedReceiver<NodeEvent>>>,
    stop: watch::Sender<bool>,
}

/// A worker across the network, as a [`Node`].
#[derive(Clone)]
pub struct RemoteNode {
    inner: Arc<Inner>,
    info: NodeInfo,
}

pub(crate) fn call<T>(msg: T, deadline: Duration) -> Request<T> {
    let mut r = Request::new(msg);
    r.set_timeout(deadline);
    r.metadata_mut()
        .insert(PROTOCOL_HEADER, MetadataValue::from(PROTOCOL_VERSION));
    r
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A checkpoint's or destroy's answer: the worker's GPU usage once the container's share
    /// went back, kept unless a newer report came first (a worker built before the reply had
    /// fields answers seq 0: nothing changes).
    fn released(&self, reply: pb::ReleasedReply) {
        let usage = crate::server::gpu_usage_from_pb(reply.gpu_usage);
        keep_newest(&mut self.lock().gpu_usage, reply.gpu_usage_seq, usage);
    }

    fn client(&self) -> NodeClient<Channel> {
        self.client
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn err(&self, st: &Status, ready_timeout: Duration) -> RuntimeError {
        convert::runtime_error_of(st, &self.name, ready_timeout)
    }

    fn track(&self, id: &str) -> (watch::Receiver<Option<ExitInfo>>, Arc<AtomicBool>) {
        let mut s = self.lock();
        let t = s
            .containers
            .entry(id.to_string())
            .or_insert_with(|| Tracked {
                exit: watch::channel(None).0,
                expected: Arc::new(AtomicBool::new(false)),
                memory: None,
                net: None,
            });
        (t.exit.subscribe(), t.expected.clone())
    }

    fn untrack(&self, id: &str) {
        self.lock().containers.remove(id);
    }

    /// The worker answered that it holds no container `id`: it ended it while no controller
    /// reached it (a fence, or a restart that outlasted the live-restore window) and the exit
    /// was never heard here. Reports that exit, once, so the sandbox goes back to its
    /// snapshot instead of answering every call with a dead agent.
    fn vanished(&self, id: &str) {
        let info = ExitInfo {
            code: None,
            signal: None,
            oom_killed: false,
        };
        let expected = {
            let mut s = self.lock();
            let Some(t) = s.containers.get(id) else {
                return;
            };
            if t.exit.borrow().is_some() {
                return;
            }
            t.exit.send_replace(Some(info));
            let expected = t.expected.load(Ordering::SeqCst);
            s.tails.insert(
                id.to_string(),
                format!("worker {} no longer holds this container", self.name),
            );
            expected
        };
        tracing::warn!(worker = %self.name, container = %id, "the worker no longer holds a container this controller runs; it ended while out of reach");
        let _ = self.events.send(NodeEvent::Exited {
            container_id: id.to_string(),
            info,
            expected,
        });
    }

    fn on_event(&self, ev: pb::Event) {
        match ev.kind {
            Some(pb::event::Kind::Exited(e)) => {
                let info = convert::exit_from_pb(e.info);
                {
                    let mut s = self.lock();
                    if let Some(t) = s.containers.get(&e.container_id) {
                        if e.expected {
                            t.expected.store(true, Ordering::SeqCst);
                        }
                        t.exit.send_replace(Some(info));
                    }
                    if !e.log_tail.is_empty() {
                        if s.tails.len() > 256 {
                            s.tails.clear();
                        }
                        s.tails.insert(e.container_id.clone(), e.log_tail);
                    }
                }
                let _ = self.events.send(NodeEvent::Exited {
                    container_id: e.container_id,
                    info,
                    expected: e.expected,
                });
            }
            Some(pb::event::Kind::Usage(u)) => {
                let mut s = self.lock();
                for c in u.containers {
                    if let Some(t) = s.containers.get_mut(&c.container_id) {
                        t.memory = c.memory;
                        t.net = c.net.map(convert::net_from_pb);
                    }
                }
                if let Some(w) = &u.warm {
                    s.warm = convert::warm_from_pb(w);
                }
            }
            None => {}
        }
    }

    /// Follows the worker's event stream, reconnecting until stopped.
    async fn follow_events(self: Arc<Self>) {
        let mut stop = self.stop.subscribe();
        let mut backoff = Duration::from_millis(100);
        loop {
            let mut req = Request::new(pb::EventsRequest {
                usage_interval_ms: self.cfg.usage_interval.as_millis() as u64,
            });
            req.metadata_mut()
                .insert(PROTOCOL_HEADER, MetadataValue::from(PROTOCOL_VERSION));
            let mut client = self.client();
            let opened = tokio::select! {
                r = client.events(req) => r,
                _ = stop.changed() => return,
            };
            match opened {
                Ok(resp) => {
                    backoff = Duration::from_millis(100);
                    let mut stream = resp.into_inner();
                    loop {
                        let next = tokio::select! {
                            m = stream.message() => m,
                            _ = stop.changed() => return,
                        };
                        match next {
                            Ok(Some(ev)) => self.on_event(ev),
                            Ok(None) => break,
                            Err(st) => {
                                tracing::warn!(worker = %self.name, error = %st, "worker event stream broke; reconnecting");
                                break;
                            }
                        }
                    }
                }
                Err(st) => {
                    tracing::warn!(worker = %self.name, error = %st, "cannot follow the worker's events; retrying");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = stop.changed() => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
}

/// Dials the worker and wraps the connection in TLS with this controller's identity; refusals
/// of the worker are counted and logged by `tls`.
#[derive(Clone)]
pub(crate) struct TlsConnector {
    tls: Arc<TlsSource>,
    connector: tokio_rustls::TlsConnector,
    addr: String,
}

impl tower::Service<Uri> for TlsConnector {
    type Response = TokioIo<Revocable<tokio_rustls::client::TlsStream<TcpStream>>>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: Uri) -> Self::Future {
        let me = self.clone();
        Box::pin(async move {
            let tcp = TcpStream::connect(&me.addr).await?;
            let _ = tcp.set_nodelay(true);
            let peer = tcp.peer_addr().ok();
            // The worker's identity is checked by the verifier, not its host name.
            let name = rustls::pki_types::ServerName::try_from("torpor-worker")
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
            match me.connector.connect(name, tcp).await {
                Ok(io) => {
                    let chain = io
                        .get_ref()
                        .1
                        .peer_certificates()
                        .map(|c| c.iter().map(|c| c.clone().into_owned()).collect())
                        .unwrap_or_default();
                    Ok(TokioIo::new(me.tls.watch(
                        io,
                        Direction::Dialled,
                        peer,
                        chain,
                    )))
                }
                Err(e) => {
                    me.tls.refused(peer, refusal_reason(&e), &e);
                    Err(e)
                }
            }
        })
    }
}

impl TlsConnector {
    /// A lazily connecting channel to `addr` over TLS as `tls`'s identity (the peer checked
    /// for the role `tls`'s side accepts).
    pub(crate) fn channel(
        addr: &str,
        tls: Arc<TlsSource>,
        connect_timeout: Duration,
    ) -> Result<Channel, RemoteError> {
        if !addr.contains(':') {
            return Err(RemoteError::Addr(addr.to_string()));
        }
        let connector = TlsConnector {
            connector: tokio_rustls::TlsConnector::from(tls.client_config()?),
            tls,
            addr: addr.to_string(),
        };
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|_| RemoteError::Addr(addr.to_string()))?
            .connect_timeout(connect_timeout)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(20))
            .keep_alive_while_idle(true);
        Ok(endpoint.connect_with_connector_lazy(connector))
    }
}

impl RemoteNode {
    /// What each tenant holds of the worker's GPUs, as of its last heartbeat or GPU start.
    pub fn gpu_usage(&self) -> crate::server::GpuUsage {
        self.inner.lock().gpu_usage.1.clone()
    }

    /// [`RemoteNode::gpu_usage`] with the number the worker gave that report.
    pub fn gpu_usage_report(&self) -> (u64, crate::server::GpuUsage) {
        self.inner.lock().gpu_usage.clone()
    }

    /// Records the usage a heartbeat reported (numbered `seq` by the worker), unless a newer
    /// report came first.
    pub fn set_gpu_usage(&self, seq: u64, usage: crate::server::GpuUsage) {
        keep_newest(&mut self.inner.lock().gpu_usage, seq, usage);
    }

    /// Connects to the worker at `cfg.addr` as the controller `tls` names, checks its protocol
    /// version and starts following its events.
    pub async fn connect(
        cfg: RemoteConfig,
        tls: Arc<TlsSource>,
    ) -> Result<RemoteNode, RemoteError> {
        let channel = TlsConnector::channel(&cfg.addr, tls, cfg.deadlines.connect)?;
        let client = NodeClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        let info = client
            .clone()
            .info(call(pb::InfoRequest {}, cfg.deadlines.quick))
            .await
            .map_err(|source| RemoteError::Call {
                addr: cfg.addr.clone(),
                source,
            })?
            .into_inner();
        if info.protocol_version != PROTOCOL_VERSION {
            return Err(RemoteError::Version {
                addr: cfg.addr.clone(),
                theirs: info.protocol_version,
            });
        }
        let (events, rx) = mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            client: Mutex::new(client),
            name: info.worker_name.clone(),
            cfg,
            shared: Mutex::default(),
            events,
            events_rx: Mutex::new(Some(rx)),
            stop: watch::channel(false).0,
        });
        tokio::spawn(inner.clone().follow_events());
        tracing::info!(worker = %info.worker_name, addr = %inner.cfg.addr, runtime = %info.runtime_version, "connected to worker");
        Ok(RemoteNode {
            inner,
            info: NodeInfo {
                runtime_version: info.runtime_version,
                platform: info.platform,
                nvproxy: info.nvproxy,
                agent_dir: info.agent_dir.into(),
            },
        })
    }

    /// Whether the worker answers a call within `deadline` (its `Info`, on the connection
    /// calls take): the controller's side of reachability, which heartbeats do not show.
    pub async fn probe(&self, deadline: Duration) -> Result<(), Status> {
        self.inner
            .client()
            .info(call(pb::InfoRequest {}, deadline))
            .await
            .map(|_| ())
    }

    /// The worker's name (from its certificate).
    pub fn worker_name(&self) -> &str {
        &self.inner.name
    }

    /// Takes over a container another controller started on this worker (that controller
    /// was lost): it keeps running and becomes this controller's.
    pub async fn adopt(&self, container_id: &str) -> Result<Box<dyn Resident>, RuntimeError> {
        let inner = &self.inner;
        let (exit, expected) = inner.track(container_id);
        let reply = match inner
            .client()
            .adopt(call(
                pb::ContainerRef {
                    container_id: container_id.to_string(),
                },
                inner.cfg.deadlines.quick,
            ))
            .await
        {
            Ok(r) => r.into_inner(),
            Err(st) => {
                inner.untrack(container_id);
                return Err(inner.err(&st, inner.cfg.deadlines.quick));
            }
        };
        if let Some(t) = inner.lock().containers.get_mut(container_id) {
            t.memory = reply.memory;
        }
        Ok(Box::new(RemoteResident {
            node: inner.clone(),
            id: container_id.to_string(),
            worker: reply.worker,
            was_warm: reply.was_warm,
            agent_version: AtomicU32::new(reply.agent_version),
            exit,
            expected,
        }))
    }

    /// Removes this controller's containers on the worker except `keep` (ones it still holds,
    /// which outlived a restart of the worker). Returns how many went.
    pub async fn reconcile_keeping(&self, known_sandboxes: &[String], keep: &[String]) -> usize {
        let inner = &self.inner;
        match inner
            .client()
            .reconcile(call(
                pb::ReconcileRequest {
                    known_sandboxes: known_sandboxes.to_vec(),
                    keep: keep.to_vec(),
                },
                inner.cfg.deadlines.teardown,
            ))
            .await
        {
            Ok(r) => r.into_inner().removed as usize,
            Err(st) => {
                tracing::warn!(worker = %inner.name, error = %st, "reconciling the worker failed");
                0
            }
        }
    }

    /// The same worker, restarted (live restore) and reached anew as `fresh`: this node's
    /// calls and event stream go to it from now on, so the residents held through this node
    /// keep working. `fresh` must name the same worker; its own event stream stops.
    pub fn retarget(&self, fresh: &RemoteNode) {
        debug_assert_eq!(fresh.worker_name(), self.worker_name());
        *self.inner.client.lock().unwrap_or_else(|p| p.into_inner()) = fresh.inner.client();
        let _ = fresh.inner.stop.send(true);
        tracing::info!(worker = %self.inner.name, addr = %fresh.inner.cfg.addr,
            "worker restarted with containers still running; following it there");
    }

    /// Puts image `dir` of the worker's own image area into the store.
    pub async fn upload(&self, dir: &str, put: &PutImage) -> Result<Uploaded, RuntimeError> {
        let inner = &self.inner;
        let req = pb::UploadRequest {
            image_dir: dir.to_string(),
            access: Some(convert::access_to_pb(&put.access)),
            labels: put.labels.iter().cloned().collect(),
            id: put.id.clone().unwrap_or_default(),
            parent: put.parent.clone().unwrap_or_default(),
            pin: put.pin,
        };
        let reply = inner
            .client()
            .upload(call(req, inner.cfg.deadlines.checkpoint))
            .await
            .map_err(|st| inner.err(&st, Duration::ZERO))?
            .into_inner();
        Ok(Uploaded {
            snapshot: reply.snapshot,
            input_bytes: reply.input_bytes,
            bytes_written: reply.bytes_written,
        })
    }

    /// Removes image `dir` from the worker's own image area.
    pub async fn remove_image(&self, dir: &str) -> Result<(), RuntimeError> {
        let inner = &self.inner;
        inner
            .client()
            .remove_image(call(
                pb::RemoveImageRequest {
                    image_dir: dir.to_string(),
                    snapshot: String::new(),
                },
                inner.cfg.deadlines.quick,
            ))
            .await
            .map(|_| ())
            .map_err(|st| inner.err(&st, Duration::ZERO))
    }

    /// The checkpoints in the worker's own image area.
    pub async fn list_images(
        &self,
    ) -> Result<Vec<torpor_runtime::node::WorkerImage>, RuntimeError> {
        let inner = &self.inner;
        let reply = inner
            .client()
            .list_images(call(pb::Empty {}, inner.cfg.deadlines.quick))
            .await
            .map_err(|st| inner.err(&st, Duration::ZERO))?
            .into_inner();
        Ok(reply
            .images
            .into_iter()
            .map(|i| torpor_runtime::node::WorkerImage {
                dir: i.dir,
                age: Duration::from_millis(i.age_ms),
                uploaded: i.uploaded,
            })
            .collect())
    }

    /// The worker's GPUs as `viewer` may see them (`GET /v1/gpus`'s JSON); `None` when it has
    /// none.
    pub async fn gpu_status(&self, viewer: &str) -> Result<Option<serde_json::Value>, String> {
        let inner = &self.inner;
        let reply = inner
            .client()
            .gpu_status(call(
                pb::GpuStatusRequest {
                    viewer: viewer.to_string(),
                },
                inner.cfg.deadlines.quick,
            ))
            .await
            .map_err(|st| inner.err(&st, Duration::ZERO).to_string())?
            .into_inner();
        if reply.json.is_empty() {
            return Ok(None);
        }
        serde_json::from_str(&reply.json)
            .map(Some)
            .map_err(|e| format!("the worker's GPU status does not parse: {e}"))
    }

    /// Asks the worker to drop its wake ticket of `sandbox`.
    pub async fn forget_gpu_ticket(&self, sandbox: &str) -> Result<(), String> {
        let inner = &self.inner;
        let msg = pb::ForgetGpuTicketsRequest {
            sandboxes: vec![sandbox.to_string()],
        };
        inner
            .client()
            .forget_gpu_tickets(call(msg, inner.cfg.deadlines.quick))
            .await
            .map(drop)
            .map_err(|st| inner.err(&st, Duration::ZERO).to_string())
    }

    /// Drops the worker's copies of `snapshot` (deleted from the store).
    pub async fn forget_snapshot(&self, snapshot: &str) -> Result<(), RuntimeError> {
        let inner = &self.inner;
        inner
            .client()
            .remove_image(call(
                pb::RemoveImageRequest {
                    image_dir: String::new(),
                    snapshot: snapshot.to_string(),
                },
                inner.cfg.deadlines.quick,
            ))
            .await
            .map(|_| ())
            .map_err(|st| inner.err(&st, Duration::ZERO))
    }

    async fn start(
        &self,
        launch: Launch,
        image: Option<&Path>,
    ) -> Result<Box<dyn Resident>, RuntimeError> {
        let inner = &self.inner;
        let ready = launch.ready_timeout;
        let deadline = ready + inner.cfg.deadlines.start_margin;
        let id = launch.container_id.clone();
        // Tracked before the call, so an exit reported before the reply is not missed.
        let (exit, expected) = inner.track(&id);
        let msg = convert::launch_to_pb(&launch);
        let reply = match image {
            Some(image) => {
                inner
                    .client()
                    .restore(call(
                        pb::RestoreRequest {
                            launch: Some(msg),
                            image: image.to_string_lossy().into_owned(),
                        },
                        deadline,
                    ))
                    .await
            }
            None => inner.client().boot(call(msg, deadline)).await,
        };
        let reply = match reply {
            Ok(r) => r.into_inner(),
            Err(st) => {
                inner.untrack(&id);
                return Err(inner.err(&st, ready));
            }
        };
        {
            let mut shared = inner.lock();
            if let Some(t) = shared.containers.get_mut(&id) {
                t.memory = reply.memory;
            }
            if launch.gpu.is_some() {
                let usage = crate::server::gpu_usage_from_pb(reply.gpu_usage);
                keep_newest(&mut shared.gpu_usage, reply.gpu_usage_seq, usage);
            }
        }
        Ok(Box::new(RemoteResident {
            node: inner.clone(),
            id,
            worker: reply.worker,
            was_warm: reply.was_warm,
            agent_version: AtomicU32::new(reply.agent_version),
            exit,
            expected,
        }))
    }
}

#[async_trait]
impl Node for RemoteNode {
    fn info(&self) -> NodeInfo {
        self.info.clone()
    }

    fn take_events(&self) -> Option<mpsc::UnboundedReceiver<NodeEvent>> {
        self.inner
            .events_rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// A worker belongs to its cluster: every container on it is treated as this controller's
    /// (`_ours` is not consulted), thawed, killed and removed.
    async fn reconcile(&self, known_sandboxes: &[String]) -> usize {
        self.reconcile_keeping(known_sandboxes, &[]).await
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

    async fn kill(&self, container_id: &str) {
        let inner = &self.inner;
        if let Some(t) = inner.lock().containers.get(container_id) {
            t.expected.store(true, Ordering::SeqCst);
        }
        if let Err(st) = inner
            .client()
            .kill(call(
                pb::ContainerRef {
                    container_id: container_id.to_string(),
                },
                inner.cfg.deadlines.teardown,
            ))
            .await
        {
            tracing::warn!(worker = %inner.name, container = %container_id, error = %st, "kill on the worker failed");
        }
    }

    fn log_tail(&self, container_id: &str) -> String {
        self.inner
            .lock()
            .tails
            .get(container_id)
            .cloned()
            .unwrap_or_else(|| format!("(in the log of worker {})", self.inner.name))
    }

    fn warm_stats(&self) -> WarmStats {
        self.inner.lock().warm
    }

    async fn shutdown(&self) {
        let _ = self.inner.stop.send(true);
    }
}

/// A container on a remote worker.
struct RemoteResident {
    node: Arc<Inner>,
    id: String,
    worker: String,
    was_warm: bool,
    agent_version: AtomicU32,
    exit: watch::Receiver<Option<ExitInfo>>,
    expected: Arc<AtomicBool>,
}

impl RemoteResident {
    fn cref(&self) -> pb::ContainerRef {
        pb::ContainerRef {
            container_id: self.id.clone(),
        }
    }

    fn quick(&self) -> Duration {
        self.node.cfg.deadlines.quick
    }
}

impl Drop for RemoteResident {
    fn drop(&mut self) {
        self.node.untrack(&self.id);
    }
}

#[async_trait]
impl Resident for RemoteResident {
    fn id(&self) -> &str {
        &self.id
    }

    fn worker(&self) -> &str {
        &self.worker
    }

    fn was_warm(&self) -> bool {
        self.was_warm
    }

    async fn send(
        &self,
        req: &AgentRequest,
        body: &[u8],
    ) -> Result<mpsc::Receiver<(Reply, Vec<u8>)>, ConnError> {
        let request_json = serde_json::to_string(req).map_err(|e| {
            tracing::warn!(error = %e, "agent request does not encode");
            ConnError::Closed
        })?;
        let msg = pb::AgentRequest {
            container_id: self.id.clone(),
            request_json,
            body: body.to_vec(),
        };
        let mut stream = match self
            .node
            .client()
            .send(call(msg, self.node.cfg.deadlines.agent_call))
            .await
        {
            Ok(s) => s.into_inner(),
            Err(st) => {
                tracing::warn!(worker = %self.node.name, container = %self.id, code = ?st.code(), error = %st, "agent call refused by the worker");
                if st.code() == tonic::Code::NotFound {
                    self.node.vanished(&self.id);
                }
                return Err(ConnError::Closed);
            }
        };
        let (tx, rx) = mpsc::channel(16);
        let worker = self.node.name.clone();
        tokio::spawn(async move {
            loop {
                let frame = tokio::select! {
                    f = stream.message() => f,
                    _ = tx.closed() => break,
                };
                match frame {
                    Ok(Some(f)) => match serde_json::from_str::<Reply>(&f.reply_json) {
                        Ok(reply) => {
                            if tx.send((reply, f.body)).await.is_err() {
                                break;
                            }
                        }
                        Err(e) => {
                            tracing::warn!(%worker, error = %e, "agent reply from the worker does not decode");
                            break;
                        }
                    },
                    Ok(None) => break,
                    Err(st) => {
                        tracing::debug!(%worker, error = %st, "agent reply stream ended");
                        break;
                    }
                }
            }
        });
        Ok(rx)
    }

    fn agent_version(&self) -> u32 {
        self.agent_version.load(Ordering::Relaxed)
    }

    fn alive(&self) -> bool {
        self.exit.borrow().is_none()
    }

    fn exit_handle(&self) -> ExitHandle {
        ExitHandle::from_parts(self.exit.clone(), self.expected.clone())
    }

    async fn set_frozen(&self, frozen: bool) -> Result<(), RuntimeError> {
        self.node
            .client()
            .set_frozen(call(
                pb::SetFrozenRequest {
                    container_id: self.id.clone(),
                    frozen,
                },
                self.quick(),
            ))
            .await
            .map(|_| ())
            .map_err(|st| self.node.err(&st, Duration::ZERO))
    }

    fn memory(&self) -> Option<u64> {
        self.node.lock().containers.get(&self.id)?.memory
    }

    async fn checkpoint(self: Box<Self>, image_dir: &Path) -> Result<(), RuntimeError> {
        self.expected.store(true, Ordering::SeqCst);
        self.node
            .client()
            .checkpoint(call(
                pb::CheckpointRequest {
                    container_id: self.id.clone(),
                    image_dir: image_dir.to_string_lossy().into_owned(),
                },
                self.node.cfg.deadlines.checkpoint,
            ))
            .await
            .map(|reply| self.node.released(reply.into_inner()))
            .map_err(|st| self.node.err(&st, Duration::ZERO))
    }

    async fn destroy(self: Box<Self>) {
        self.expected.store(true, Ordering::SeqCst);
        match self
            .node
            .client()
            .destroy(call(self.cref(), self.node.cfg.deadlines.teardown))
            .await
        {
            Ok(reply) => self.node.released(reply.into_inner()),
            Err(st) => {
                tracing::warn!(worker = %self.node.name, container = %self.id, error = %st, "destroy on the worker failed")
            }
        }
    }

    async fn release(self: Box<Self>) {
        // Nothing to tell the worker: the controller that adopts the container becomes its
        // owner there. Dropped, it is no longer tracked here.
    }

    fn ingress_addr(&self) -> Option<Ipv4Addr> {
        None
    }

    async fn apply_policy(&self, policy: &NetworkPolicy) -> Result<(), RuntimeError> {
        let policy_json = serde_json::to_string(policy)
            .map_err(|e| RuntimeError::Unsupported(format!("policy does not encode: {e}")))?;
        let msg = call(
            pb::PolicyRequest {
                container_id: self.id.clone(),
                policy_json,
            },
            self.quick(),
        );
        self.node
            .client()
            .apply_policy(msg)
            .await
            .map(|_| ())
            .map_err(|st| self.node.err(&st, Duration::ZERO))
    }

    fn net_stats(&self) -> Option<NetStats> {
        self.node.lock().containers.get(&self.id)?.net.clone()
    }

    async fn settle_connections(&self) {
        if let Err(st) = self
            .node
            .client()
            .settle_connections(call(self.cref(), self.quick()))
            .await
        {
            tracing::warn!(worker = %self.node.name, container = %self.id, error = %st, "settling connections on the worker failed");
        }
    }

    /// Through the worker (crate::tunnel): its router namespace reaches the sandbox's ports.
    async fn connect_port(
        &self,
        port: u16,
    ) -> Result<torpor_runtime::node::PortStream, RuntimeError> {
        let (up, frames) = crate::tunnel::outbound(&self.id, port);
        let mut req = Request::new(frames);
        req.metadata_mut()
            .insert(PROTOCOL_HEADER, MetadataValue::from(PROTOCOL_VERSION));
        let down = tokio::time::timeout(self.quick(), self.node.client().tunnel(req))
            .await
            .map_err(|_| {
                RuntimeError::Unsupported(format!(
                    "worker {} did not open the connection to port {port} in time",
                    self.node.name
                ))
            })?
            .map_err(|st| self.node.err(&st, self.quick()))?
            .into_inner();
        Ok(crate::tunnel::controller_end(up, down))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_usage_report_older_than_the_one_kept_is_ignored() {
        let held = |compute: u64| {
            crate::server::GpuUsage::from([(
                "acme".to_string(),
                torpor_gpu::quota::Amount {
                    memory_mib: 1,
                    compute,
                },
            )])
        };
        let mut slot = (0, crate::server::GpuUsage::new());
        // A start's reply (report 7) says the tenant holds a GPU...
        keep_newest(&mut slot, 7, held(700));
        // ...and a heartbeat read before that start (report 6) arrives after it.
        keep_newest(&mut slot, 6, crate::server::GpuUsage::new());
        assert_eq!(slot, (7, held(700)));
        keep_newest(&mut slot, 8, held(0));
        assert_eq!(slot, (8, held(0)));
    }
}
