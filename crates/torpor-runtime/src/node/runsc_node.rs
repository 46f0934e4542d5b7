//! The node of this machine: gVisor's runsc on the warm pool's prepared workers.

use std::collections::{HashMap, HashSet};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use async_trait::async_trait;
use tokio::sync::mpsc;
use torpor_core::NetworkPolicy;

use super::{Launch, Node, NodeEvent, NodeInfo, Resident};
use crate::conn::ConnError;
use crate::net::{NetError, NetStats};
use crate::proto::{Reply, Request};
use crate::runsc::{Container, ExitHandle, Runsc, RuntimeError};
use crate::shim::{self, ShimMeta, Shims};
use crate::warm::{WarmPool, WarmStats, Worker};
use crate::{cgroup, rootfs};

/// Where and how the node runs sandboxes.
#[derive(Debug, Clone)]
pub struct RunscNodeConfig {
    pub data_dir: PathBuf,
    pub runsc_binary: Option<PathBuf>,
    pub runsc_platform: Option<String>,
    /// The binary copied into every sandbox as its agent (normally the running `torpor`).
    pub agent_binary: PathBuf,
    /// Free workers kept prepared (cgroups, bundle directory) so a wake does only the restore.
    pub warm_pool: usize,
    /// Runs each container under a shim (`agent_binary shim …`) so that it outlives this
    /// process, and takes back at start what a previous run left running ([`Node::adopt`]).
    pub live_restore: bool,
    /// Under live restore: how long a container may run with no process of this node attached
    /// before its shim ends it ([`crate::shim::Shims::fence`]); `None`: for ever.
    pub live_restore_window: Option<std::time::Duration>,
}

pub struct RunscNode {
    runsc: Runsc,
    warm: WarmPool,
    data_dir: PathBuf,
    agent_dir: PathBuf,
    events: mpsc::UnboundedSender<NodeEvent>,
    events_rx: Mutex<Option<mpsc::UnboundedReceiver<NodeEvent>>>,
    /// Containers a previous run left running under their shims, by container id, until
    /// adopted or cleared by [`Node::reconcile`].
    survivors: Mutex<HashMap<String, ShimMeta>>,
    /// Shims of that run whose containers never finished starting.
    stray_shims: Mutex<Vec<u32>>,
    /// Containers taken back (their shims' pids, their ids): reconcile leaves them running.
    adopted: Mutex<(HashSet<u32>, HashSet<String>)>,
}

impl RunscNode {
    /// Finds runsc, installs the agent and starts the warm pool (which also thaws and empties
    /// the groups a previous run left).
    pub fn start(cfg: RunscNodeConfig) -> Result<RunscNode, RuntimeError> {
        let runsc = Runsc::detect(
            cfg.runsc_binary.clone(),
            cfg.runsc_platform.clone(),
            cfg.data_dir.join("runsc"),
            cfg.data_dir.join("logs"),
        )?;
        tracing::info!(version = %runsc.version, platform = %runsc.platform, overlay = ?runsc.overlay_flags, "runsc detected");
        let agent_dir = rootfs::install_agent(&cfg.agent_binary, &cfg.data_dir.join("agent"))
            .map_err(|e| RuntimeError::Unsupported(e.to_string()))?;
        let mut scan = shim::Scan::default();
        let runsc = if cfg.live_restore {
            let shims_dir = cfg.data_dir.join("shims");
            // `torpor-shim` beside the binary when it is there (a few hundred KiB a copy),
            // else the binary's own `shim` subcommand (the same code, several MiB a copy).
            let small = cfg.agent_binary.with_file_name("torpor-shim");
            let binary = if small.is_file() {
                small
            } else {
                tracing::warn!(missing = %small.display(),
                    "no torpor-shim beside the torpor binary: each resident sandbox's shim runs the whole binary");
                cfg.agent_binary.clone()
            };
            let mut shims =
                Shims::new(binary, shims_dir.clone()).map_err(|source| RuntimeError::Io {
                    path: shims_dir,
                    source,
                })?;
            shims.fence = cfg.live_restore_window;
            scan = shims.scan();
            if !scan.survivors.is_empty() {
                tracing::info!(
                    containers = scan.survivors.len(),
                    "containers outlived the previous run under their shims"
                );
            }
            runsc.with_shims(shims)
        } else {
            runsc
        };
        let keep: Vec<String> = scan
            .survivors
            .iter()
            .filter_map(|m| m.worker.clone())
            .collect();
        let warm = WarmPool::start(&cfg.data_dir, cfg.warm_pool, &keep);
        let (events, rx) = mpsc::unbounded_channel();
        Ok(RunscNode {
            runsc,
            warm,
            data_dir: cfg.data_dir,
            agent_dir,
            events,
            events_rx: Mutex::new(Some(rx)),
            survivors: Mutex::new(
                scan.survivors
                    .into_iter()
                    .map(|m| (m.container_id.clone(), m))
                    .collect(),
            ),
            stray_shims: Mutex::new(scan.strays),
            adopted: Mutex::default(),
        })
    }

    fn resident(&self, container: Container, worker: Option<Worker>) -> Box<dyn Resident> {
        let exit = container.exit_handle();
        let events = self.events.clone();
        let container_id = container.id.clone();
        tokio::spawn(async move {
            let info = exit.exited().await;
            let _ = events.send(NodeEvent::Exited {
                container_id,
                info,
                expected: exit.expected(),
            });
        });
        let bundle = worker
            .is_none()
            .then(|| self.data_dir.join("run").join(&container.id));
        Box::new(RunscResident {
            runsc: self.runsc.clone(),
            container,
            worker,
            bundle,
        })
    }
}

#[async_trait]
impl Node for RunscNode {
    fn info(&self) -> NodeInfo {
        NodeInfo {
            runtime_version: self.runsc.version.clone(),
            platform: self.runsc.platform.clone(),
            nvproxy: self.runsc.nvproxy(),
            agent_dir: self.agent_dir.clone(),
        }
    }

    fn take_events(&self) -> Option<mpsc::UnboundedReceiver<NodeEvent>> {
        self.events_rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    async fn reconcile(&self, known_sandboxes: &[String]) -> usize {
        cgroup::thaw_matching(|cid: &str| {
            super::sandbox_of(cid).is_some_and(|id| known_sandboxes.iter().any(|k| k == id))
        });
        // What the previous run left under shims and nobody took back is cleared like any
        // other leftover; the adopted keep running.
        let survivors: Vec<ShimMeta> = lock(&self.survivors).drain().map(|(_, m)| m).collect();
        let mut stray_shims = std::mem::take(&mut *lock(&self.stray_shims));
        stray_shims.extend(survivors.iter().map(|m| m.shim_pid));
        for pid in &stray_shims {
            shim::kill(*pid);
        }
        let (keep, adopted) = lock(&self.adopted).clone();
        let strays = self.runsc.kill_strays(&keep) + stray_shims.len();
        if strays > 0 {
            tracing::warn!(
                processes = strays,
                "killed runsc processes left by a previous run"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let left: Vec<String> = self
            .runsc
            .list()
            .await
            .into_iter()
            .filter(|cid| !adopted.contains(cid))
            .collect();
        for cid in &left {
            tracing::warn!(container = %cid, "removing a container left by a previous run");
            self.runsc.destroy(cid).await;
        }
        // Their workers go back to the pool (reset on the way), their networks are removed.
        for m in survivors {
            if let Some(w) = m.worker {
                if let Some(n) = &m.net {
                    crate::net::remove_worker_net(&w, &n.host_link);
                }
                drop(self.warm.adopt(&w));
            }
        }
        let run = self.data_dir.join("run");
        let _ = std::fs::remove_dir_all(&run);
        let _ = std::fs::create_dir_all(&run);
        strays + left.len()
    }

    /// Takes back a container that a previous run of this daemon started and that kept
    /// running under its shim (live restore), with its worker's network (rules made again, the
    /// egress relay started again; the caller applies the sandbox's policy). Not for GPU
    /// containers yet: their devices were this process's, so they go back to their snapshot.
    async fn adopt(&self, container_id: &str, _memory: u64) -> Option<Box<dyn Resident>> {
        let meta = lock(&self.survivors).remove(container_id)?;
        let Some(worker_name) = meta.worker.clone().filter(|_| !meta.devices) else {
            lock(&self.survivors).insert(meta.container_id.clone(), meta);
            return None;
        };
        let mut worker = self.warm.adopt(&worker_name);
        if let Some(n) = &meta.net {
            if let Err(e) = worker.adopt_net(&n.host_link, n.host_addr, n.router_addr) {
                tracing::warn!(container = %container_id, error = %e,
                    "cannot take back the network of a container that outlived the previous run");
                let mut meta = meta;
                meta.worker = None; // the handle resets the group as it goes
                lock(&self.survivors).insert(meta.container_id.clone(), meta);
                return None;
            }
        }
        match self.runsc.reattach(&meta, worker.oom_flag()) {
            Ok(container) => {
                let mut adopted = lock(&self.adopted);
                adopted.0.insert(meta.shim_pid);
                adopted.1.insert(meta.container_id.clone());
                drop(adopted);
                tracing::info!(container = %container_id, worker = %worker_name,
                    "took back a container that outlived the previous run");
                Some(self.resident(container, Some(worker)))
            }
            Err(e) => {
                tracing::warn!(container = %container_id, error = %e,
                    "cannot reach the shim of a container that outlived the previous run");
                // Reconcile kills it; the worker's group is reset as this handle goes.
                let mut meta = meta;
                meta.worker = None;
                lock(&self.survivors).insert(meta.container_id.clone(), meta);
                drop(worker);
                None
            }
        }
    }

    async fn boot(&self, launch: Launch) -> Result<Box<dyn Resident>, RuntimeError> {
        let bundle = self.data_dir.join("run").join(&launch.container_id);
        match self
            .runsc
            .boot(
                &launch.container_id,
                &bundle,
                &launch.spec,
                launch.ready_timeout,
            )
            .await
        {
            Ok(c) => Ok(self.resident(c, None)),
            Err(e) => {
                self.runsc.destroy(&launch.container_id).await;
                let _ = std::fs::remove_dir_all(&bundle);
                Err(e)
            }
        }
    }

    async fn restore(
        &self,
        launch: Launch,
        image: &Path,
    ) -> Result<Box<dyn Resident>, RuntimeError> {
        let t = std::time::Instant::now();
        let mut worker = self.warm.take()?;
        let mut spec = launch.spec;
        if let Some(policy) = &launch.network {
            spec.netns = Some(prepare_worker_net(&mut worker, policy)?);
        }
        let prepared = t.elapsed();
        let container = self
            .runsc
            .restore(&launch.container_id, &worker, &spec, image)?;
        let started = t.elapsed();
        if let Err(e) = self
            .runsc
            .wait_ready(&container, launch.ready_timeout)
            .await
        {
            self.runsc.destroy_container(&container).await;
            return Err(e);
        }
        tracing::debug!(container = %launch.container_id, networked = launch.network.is_some(),
            worker_ms = prepared.as_secs_f64() * 1e3, start_ms = (started - prepared).as_secs_f64() * 1e3,
            ready_ms = (t.elapsed() - started).as_secs_f64() * 1e3, "restored");
        self.runsc
            .record(&container, Some(&worker), !spec.devices.is_empty());
        Ok(self.resident(container, Some(worker)))
    }

    async fn kill(&self, container_id: &str) {
        self.runsc.destroy(container_id).await;
    }

    fn log_tail(&self, container_id: &str) -> String {
        self.runsc.log_tail(container_id)
    }

    fn warm_stats(&self) -> WarmStats {
        self.warm.stats()
    }

    async fn shutdown(&self) {
        let warm = self.warm.clone();
        let _ = tokio::task::spawn_blocking(move || warm.shutdown()).await;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Makes `worker`'s network ready for a sandbox under `policy`: namespaces (first use),
/// the sandbox's address (runsc took it from the previous one; normally given back when the
/// worker was reset), the egress rules (none to run when the policy is the reset's). Returns
/// the namespace path for the spec.
fn prepare_worker_net(worker: &mut Worker, policy: &NetworkPolicy) -> Result<PathBuf, NetError> {
    let net = worker.ensure_net()?;
    net.ready_sandbox_addr()?;
    net.apply_policy(policy)?;
    Ok(net.sandbox_ns_path())
}

struct RunscResident {
    runsc: Runsc,
    container: Container,
    /// The prepared worker it runs on; dropped (reset and reused) once the container is gone.
    /// `None` for a template build, which runs in its own bundle.
    worker: Option<Worker>,
    /// A template build's bundle, removed once the container is gone.
    bundle: Option<PathBuf>,
}

impl Drop for RunscResident {
    fn drop(&mut self) {
        if let Some(b) = &self.bundle {
            let _ = std::fs::remove_dir_all(b);
        }
    }
}

#[async_trait]
impl Resident for RunscResident {
    fn id(&self) -> &str {
        &self.container.id
    }

    fn worker(&self) -> &str {
        self.worker
            .as_ref()
            .map_or(self.container.cgroup.as_str(), |w| w.name())
    }

    fn was_warm(&self) -> bool {
        self.worker.as_ref().is_some_and(|w| w.was_warm())
    }

    async fn send(
        &self,
        req: &Request,
        body: &[u8],
    ) -> Result<mpsc::Receiver<(Reply, Vec<u8>)>, ConnError> {
        self.container.conn.send(req, body).await
    }

    fn agent_version(&self) -> u32 {
        self.container.conn.agent_version()
    }

    fn alive(&self) -> bool {
        !self.container.conn.is_closed()
    }

    fn exit_handle(&self) -> ExitHandle {
        self.container.exit_handle()
    }

    async fn set_frozen(&self, frozen: bool) -> Result<(), RuntimeError> {
        let group = self.container.cgroup.clone();
        tokio::task::spawn_blocking(move || cgroup::set_frozen(&group, frozen))
            .await
            .map_err(|e| RuntimeError::Unsupported(format!("freezer task failed: {e}")))?
            .map_err(RuntimeError::from)
    }

    fn memory(&self) -> Option<u64> {
        cgroup::memory_usage(&self.container.cgroup)
    }

    async fn checkpoint(self: Box<Self>, image_dir: &Path) -> Result<(), RuntimeError> {
        self.runsc.checkpoint(&self.container, image_dir).await
    }

    async fn destroy(self: Box<Self>) {
        self.runsc.destroy_container(&self.container).await;
    }

    fn ingress_addr(&self) -> Option<Ipv4Addr> {
        self.worker.as_ref()?.net().map(|n| n.ingress_addr())
    }

    async fn apply_policy(&self, policy: &NetworkPolicy) -> Result<(), RuntimeError> {
        match self.worker.as_ref().and_then(|w| w.net()) {
            Some(net) => Ok(net.apply_policy(policy)?),
            None => Ok(()),
        }
    }

    fn net_stats(&self) -> Option<NetStats> {
        Some(self.worker.as_ref()?.net()?.stats())
    }

    async fn settle_connections(&self) {
        let Some(net) = self.worker.as_ref().and_then(|w| w.net()) else {
            return;
        };
        if net.reset_connections().await > 0 {
            let _ = self.set_frozen(false).await;
            tokio::time::sleep(std::time::Duration::from_millis(30)).await;
        }
    }
}
