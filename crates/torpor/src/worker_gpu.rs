//! A cluster worker's GPUs: the worker places each sandbox's share from its own ledger.
//!
//! [`GpuNode`] wraps the worker's node. A start that carries a GPU request
//! ([`torpor_runtime::LaunchGpu`]) gets its share here, under the quota book its controller
//! sent (the tenant's cluster-wide quota less what it holds on other workers), before the
//! container starts: its device nodes and mounts go into the container, and every exec in it
//! gets the share's variables ([`GpuResident`]). A start the worker's GPUs cannot hold is
//! refused with the GPU layer's code (`gpu_unavailable`, `gpu_quota_exceeded`, …); the
//! controller tries another worker with that model or answers the error.
//!
//! The share goes back when its container does: checkpoint, destroy, kill or an exit the node
//! reports. Shares are keyed by sandbox, so a release names the container that held it: an
//! older container of the same sandbox ending late never releases its successor's share.
//! Shares and requests live in the worker's own `DATA/torpor.db` (as on a single machine), so a
//! worker restarted under live restore keeps the shares of the containers it takes back.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use tokio::sync::mpsc;
use torpor_cluster::reclaim::reclaim_refusal;
use torpor_control::gpu::{Acquired, GpuError, NodeGpus};
use torpor_core::{NetworkPolicy, SandboxId, TenantId};
use torpor_gpu::quota::QuotaBook;
use torpor_gpu::request::GpuRequest;
use torpor_runtime::conn::ConnError;
use torpor_runtime::net::NetStats;
use torpor_runtime::node::{sandbox_of, ImageHost, NodeEvent, NodeInfo, PortStream};
use torpor_runtime::proto::{Reply, Request};
use torpor_runtime::warm::WarmStats;
use torpor_runtime::{ExitHandle, Launch, Node, Resident, RuntimeError};

/// The worker's GPUs and which container holds each sandbox's share.
struct Shares {
    gpus: NodeGpus,
    /// Sandbox → the container that holds its share now.
    holders: Mutex<HashMap<SandboxId, String>>,
}

impl Shares {
    fn holders(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, String>> {
        self.holders.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Gives back the share `container` holds, if it is the one holding its sandbox's.
    fn release(&self, container: &str) {
        let Some(id) = sandbox_id(container) else {
            return;
        };
        let mut holders = self.holders();
        if holders.get(&id).map(String::as_str) == Some(container) {
            holders.remove(&id);
            drop(holders);
            self.gpus.release(&id);
        }
    }

    /// The share for `launch` (its request and quota), and the container's devices and mounts.
    fn acquire(&self, launch: &mut Launch) -> Result<Option<SandboxId>, RuntimeError> {
        let Some(gpu) = launch.gpu.clone() else {
            return Ok(None);
        };
        let id = sandbox_id(&launch.container_id).ok_or_else(|| {
            refusal(GpuError::BadRequest {
                code: "request_invalid",
                message: format!("container {} is no sandbox's", launch.container_id),
            })
        })?;
        let request: GpuRequest = serde_json::from_str(&gpu.request).map_err(|e| {
            refusal(GpuError::BadRequest {
                code: "request_malformed",
                message: format!("gpu: {e}"),
            })
        })?;
        let quotas = match &gpu.quota {
            None => QuotaBook::unlimited(),
            Some(q) => serde_json::from_str(q).map_err(|e| {
                refusal(GpuError::BadRequest {
                    code: "request_malformed",
                    message: format!("gpu quota: {e}"),
                })
            })?,
        };
        self.gpus.save_request(&id, &request).map_err(|e| {
            refusal(GpuError::Driver(format!(
                "cannot save the GPU request: {e}"
            )))
        })?;
        // A share borrowed by another tenant is not taken here: only a controller may park its
        // sandbox. The refusal names the borrowers; the controller parks them (their shares
        // come back with their checkpoints) and starts again (torpor_cluster::reclaim).
        let acquired = self
            .gpus
            .acquire_or_name_victims(&id, &quotas)
            .map_err(refusal);
        let refused = match acquired {
            Ok(Acquired::Held(_)) => None,
            Ok(Acquired::ReclaimFirst(victims)) => {
                tracing::info!(sandbox = %id, ?victims, "a GPU start needs borrowed shares back");
                Some(reclaim_refusal(&victims))
            }
            Err(e) => Some(e),
        };
        if let Some(e) = refused {
            // Refused here: the controller tries another worker (or this one again), and would
            // not tell this one to drop what the start saved.
            self.gpus.forget_refused(&id);
            return Err(e);
        }
        let runtime = match self.gpus.runtime(&id) {
            Ok(r) => r,
            Err(e) => {
                self.gpus.release(&id);
                return Err(refusal(e));
            }
        };
        launch.spec.devices.extend(runtime.devices);
        launch.spec.mounts.extend(runtime.mounts);
        self.holders()
            .insert(id.clone(), launch.container_id.clone());
        Ok(Some(id))
    }
}

fn sandbox_id(container: &str) -> Option<SandboxId> {
    sandbox_of(container).and_then(|s| s.parse().ok())
}

/// A GPU refusal as the runtime error that carries its stable code to the controller (whose
/// engine turns it back into the same kind of [`GpuError`], so only the inner text travels).
fn refusal(e: GpuError) -> RuntimeError {
    let message = match &e {
        GpuError::BadRequest { message, .. }
        | GpuError::Unavailable { message, .. }
        | GpuError::Quota { message, .. } => message.clone(),
        GpuError::Driver(m) | GpuError::RuntimeUnsupported(m) => m.clone(),
        other => other.to_string(),
    };
    RuntimeError::Gpu {
        code: e.code().to_owned(),
        message,
    }
}

/// The worker's node with its GPUs in front.
pub struct GpuNode {
    inner: Arc<dyn Node>,
    shares: Arc<Shares>,
    events: Mutex<Option<mpsc::UnboundedReceiver<NodeEvent>>>,
}

impl GpuNode {
    /// Wraps `inner`, whose event stream it takes (and passes on, releasing the shares of
    /// containers that exit).
    pub fn new(inner: Arc<dyn Node>, mut gpus: NodeGpus) -> Arc<GpuNode> {
        gpus.set_nvproxy(inner.info().nvproxy);
        let shares = Arc::new(Shares {
            gpus,
            holders: Mutex::default(),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        if let Some(mut from) = inner.take_events() {
            let shares = shares.clone();
            tokio::spawn(async move {
                while let Some(ev) = from.recv().await {
                    if let NodeEvent::Exited { container_id, .. } = &ev {
                        shares.release(container_id);
                    }
                    if tx.send(ev).is_err() {
                        return;
                    }
                }
            });
        }
        Arc::new(GpuNode {
            inner,
            shares,
            events: Mutex::new(Some(rx)),
        })
    }

    /// The GPU metric families of `/metrics` (shares, free capacity; DCGM's with NVML).
    pub fn metrics(&self) -> String {
        self.shares.gpus.metrics()
    }

    /// GPU models, one entry per GPU (the worker registers with them).
    pub fn gpu_models(&self) -> Vec<String> {
        self.shares.gpus.gpu_models()
    }

    /// After a restart: the containers taken back keep their shares; every other share the
    /// worker's database holds goes back (a ticket stays for a wake here).
    pub fn reconcile(&self, running: &[String]) {
        let mut running_ids: HashMap<SandboxId, String> = HashMap::new();
        for c in running {
            if let Some(id) = sandbox_id(c) {
                running_ids.insert(id, c.clone());
            }
        }
        self.shares
            .gpus
            .reconcile(|id| Some(running_ids.contains_key(id)));
        let mut holders = self.shares.holders();
        for (id, c) in running_ids {
            if self.shares.gpus.holds(&id) {
                holders.insert(id, c);
            }
        }
    }

    fn wrap(&self, r: Box<dyn Resident>, id: Option<SandboxId>) -> Box<dyn Resident> {
        match id {
            Some(sandbox) => Box::new(GpuResident {
                inner: r,
                shares: self.shares.clone(),
                sandbox,
            }),
            None => r,
        }
    }

    async fn start(
        &self,
        mut launch: Launch,
        image: Option<&Path>,
    ) -> Result<Box<dyn Resident>, RuntimeError> {
        let id = self.shares.acquire(&mut launch)?;
        let container = launch.container_id.clone();
        let started = match image {
            Some(image) => self.inner.restore(launch, image).await,
            None => self.inner.boot(launch).await,
        };
        match started {
            Ok(r) => Ok(self.wrap(r, id)),
            Err(e) => {
                self.shares.release(&container);
                Err(e)
            }
        }
    }
}

#[async_trait]
impl Node for GpuNode {
    fn info(&self) -> NodeInfo {
        self.inner.info()
    }

    fn take_events(&self) -> Option<mpsc::UnboundedReceiver<NodeEvent>> {
        self.events.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    async fn reconcile(&self, known_sandboxes: &[String]) -> usize {
        self.inner.reconcile(known_sandboxes).await
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

    async fn adopt(&self, container_id: &str, memory: u64) -> Option<Box<dyn Resident>> {
        let r = self.inner.adopt(container_id, memory).await?;
        let id = sandbox_id(container_id).filter(|id| self.shares.gpus.holds(id));
        if let Some(id) = &id {
            self.shares
                .holders()
                .insert(id.clone(), container_id.to_owned());
        }
        Some(self.wrap(r, id))
    }

    fn expect_back(&self, expected: &[(String, String)]) {
        self.inner.expect_back(expected)
    }

    async fn kill(&self, container_id: &str) {
        self.inner.kill(container_id).await;
        self.shares.release(container_id);
    }

    fn log_tail(&self, container_id: &str) -> String {
        self.inner.log_tail(container_id)
    }

    fn warm_stats(&self) -> WarmStats {
        self.inner.warm_stats()
    }

    fn image_host(&self) -> Option<&dyn ImageHost> {
        self.inner.image_host()
    }

    async fn shutdown(&self) {
        self.inner.shutdown().await
    }
}

/// A container holding a GPU share: its execs get the share's variables (the caller's win),
/// and its end gives the share back.
struct GpuResident {
    inner: Box<dyn Resident>,
    shares: Arc<Shares>,
    sandbox: SandboxId,
}

impl GpuResident {
    fn with_env(&self, req: &Request) -> Option<Request> {
        let Request::Exec(exec) = req else {
            return None;
        };
        let mut env = self.shares.gpus.env(&self.sandbox);
        env.extend(exec.env.clone());
        let mut exec = exec.clone();
        exec.env = env;
        Some(Request::Exec(exec))
    }
}

#[async_trait]
impl Resident for GpuResident {
    fn id(&self) -> &str {
        self.inner.id()
    }

    fn worker(&self) -> &str {
        self.inner.worker()
    }

    fn node(&self) -> Option<&str> {
        self.inner.node()
    }

    fn was_warm(&self) -> bool {
        self.inner.was_warm()
    }

    async fn send(
        &self,
        req: &Request,
        body: &[u8],
    ) -> Result<mpsc::Receiver<(Reply, Vec<u8>)>, ConnError> {
        match self.with_env(req) {
            Some(req) => self.inner.send(&req, body).await,
            None => self.inner.send(req, body).await,
        }
    }

    fn agent_version(&self) -> u32 {
        self.inner.agent_version()
    }

    fn alive(&self) -> bool {
        self.inner.alive()
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
        let GpuResident { inner, shares, .. } = *self;
        let container = inner.id().to_owned();
        let done = inner.checkpoint(image_dir).await;
        shares.release(&container);
        done
    }

    async fn destroy(self: Box<Self>) {
        let GpuResident { inner, shares, .. } = *self;
        let container = inner.id().to_owned();
        inner.destroy().await;
        shares.release(&container);
    }

    fn ingress_addr(&self) -> Option<Ipv4Addr> {
        self.inner.ingress_addr()
    }

    async fn connect_port(&self, port: u16) -> Result<PortStream, RuntimeError> {
        self.inner.connect_port(port).await
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
}

impl torpor_cluster::WorkerGpus for GpuNode {
    /// What each tenant holds of the worker's GPUs (heartbeats carry it).
    fn usage(&self) -> torpor_cluster::GpuUsage {
        self.shares.gpus.tenant_usage()
    }

    /// `GET /v1/gpus` of this worker as `viewer` (a tenant name) may see it, as JSON; empty
    /// for a name that cannot be a tenant's (controllers send their caller's).
    fn status_json(&self, viewer: &str) -> String {
        let Ok(viewer) = TenantId::new(viewer) else {
            return String::new();
        };
        serde_json::to_string(&self.shares.gpus.status(&viewer)).unwrap_or_default()
    }

    /// Drops the tickets and saved GPU requests of sandboxes deleted or woken elsewhere; a
    /// sandbox whose share a container here holds now (it came back meanwhile) keeps its own.
    fn forget_tickets(&self, sandboxes: &[String]) {
        let ids = sandboxes.iter().filter_map(|s| SandboxId::new(s).ok());
        let dropped = ids
            .filter(|id| self.shares.gpus.forget_elsewhere(id))
            .count();
        if dropped > 0 {
            tracing::debug!(
                dropped,
                "GPU tickets and requests of sandboxes gone or woken elsewhere dropped"
            );
        }
    }
}
