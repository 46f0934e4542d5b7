//! The worker's side of joining: registers with every controller it is given and heartbeats
//! each, re-registering whenever a controller does not know it (the controller restarted, or
//! marked it lost). Each controller is followed independently: one that is down does not
//! delay the others.
//!
//! A `--controller` name that resolves to several addresses (a Kubernetes headless Service in
//! front of the controller replicas) means every one of them: the worker joins each address,
//! re-resolves the name every [`RESOLVE_EVERY`], joins new addresses and leaves ones that
//! stayed out of the answers for [`FORGET_AFTER`] resolutions (a replica that went away).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::client::{call, TlsConnector};
use crate::pb;
use crate::pb::cluster_client::ClusterClient;
use crate::server::NodeService;
use crate::tls::TlsSource;
use crate::MAX_MESSAGE;

/// What a worker announces.
#[derive(Debug, Clone)]
pub struct JoinConfig {
    /// `host:port` of each controller's `--cluster-listen`.
    pub controllers: Vec<String>,
    /// Where its Node service listens (an unspecified host: the controller uses the address
    /// the registration came from).
    pub node_addr: String,
    pub slots: u32,
    pub memory_budget: u64,
    /// Starts and checkpoints it runs at once (its cores).
    pub cores: u32,
    pub gpu_models: Vec<String>,
    pub labels: BTreeMap<String, String>,
    /// Fresh for this process.
    pub run_id: String,
    /// Deadline of each call to a controller.
    pub deadline: Duration,
    /// Fencing: how long this worker runs sandboxes without word from any controller before
    /// it ends them (the controllers may have counted it lost and resumed them elsewhere).
    /// Keep it below the controllers' `--worker-lost-after-ms`. `None`: never.
    pub fence_after: Option<Duration>,
    /// Whether heartbeats say the machine's idle CPU (placement ranks workers by it). Off
    /// where several workers share one machine: they would all report the same machine, and
    /// its noise would choose between them.
    pub report_cpu: bool,
}

/// How often a controller name is resolved again.
pub const RESOLVE_EVERY: Duration = Duration::from_secs(10);
/// Resolutions an address may be missing from before the worker leaves it.
pub const FORGET_AFTER: u32 = 3;

/// Joins every controller until `stop` turns true.
pub async fn join(
    cfg: JoinConfig,
    tls: Arc<TlsSource>,
    node: Arc<NodeService>,
    stop: watch::Receiver<bool>,
) {
    // Counted from the start: containers taken back from a previous run (live restore) are
    // fenced too if no controller answers.
    let contact = Arc::new(Contact::default());
    contact.heard();
    let _fence = cfg
        .fence_after
        .map(|after| AbortOnDrop(tokio::spawn(fence(after, contact.clone(), node.clone()))));
    let mut tasks = Vec::new();
    for controller in cfg.controllers.clone() {
        let cfg = cfg.clone();
        let tls = tls.clone();
        let node = node.clone();
        let stop = stop.clone();
        let contact = contact.clone();
        tasks.push(tokio::spawn(async move {
            follow_name(controller, cfg, tls, node, contact, stop).await
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

/// One follower per address `name` resolves to, kept in step with what it resolves to.
async fn follow_name(
    name: String,
    cfg: JoinConfig,
    tls: Arc<TlsSource>,
    node: Arc<NodeService>,
    contact: Arc<Contact>,
    mut stop: watch::Receiver<bool>,
) {
    // address -> (its follower's stop, its task, resolutions it was missing from)
    let mut followers: BTreeMap<String, (watch::Sender<bool>, tokio::task::JoinHandle<()>, u32)> =
        BTreeMap::new();
    loop {
        match tokio::net::lookup_host(name.as_str()).await {
            Ok(addrs) => {
                let now: Vec<String> = addrs.map(|a| a.to_string()).collect();
                for (addr, f) in followers.iter_mut() {
                    f.2 = if now.contains(addr) { 0 } else { f.2 + 1 };
                }
                followers.retain(|addr, (leave, _, missing)| {
                    let keep = *missing < FORGET_AFTER;
                    if !keep {
                        tracing::info!(controller = %name, %addr, "leaving a controller address the name no longer resolves to");
                        let _ = leave.send(true);
                    }
                    keep
                });
                for addr in now {
                    if followers.contains_key(&addr) {
                        continue;
                    }
                    if addr != name {
                        tracing::info!(controller = %name, %addr, "joining a controller address");
                    }
                    let (leave, left) = watch::channel(false);
                    let task = tokio::spawn(follow(
                        addr.clone(),
                        cfg.clone(),
                        tls.clone(),
                        node.clone(),
                        contact.clone(),
                        left,
                    ));
                    followers.insert(addr, (leave, task, 0));
                }
            }
            Err(e) if followers.is_empty() => {
                tracing::warn!(controller = %name, error = %e, "cannot resolve the controller; retrying");
            }
            Err(e) => {
                tracing::debug!(controller = %name, error = %e, "cannot resolve the controller; keeping its known addresses");
            }
        }
        let again = if followers.is_empty() {
            Duration::from_secs(1)
        } else {
            RESOLVE_EVERY
        };
        tokio::select! {
            _ = tokio::time::sleep(again) => {}
            _ = stop.changed() => break,
        }
    }
    for (_, (leave, task, _)) in followers {
        let _ = leave.send(true);
        let _ = task.await;
    }
}

async fn follow(
    controller: String,
    cfg: JoinConfig,
    tls: Arc<TlsSource>,
    node: Arc<NodeService>,
    contact: Arc<Contact>,
    mut stop: watch::Receiver<bool>,
) {
    let channel = match TlsConnector::channel(&controller, tls, cfg.deadline) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(%controller, error = %e, "cannot join this controller");
            return;
        }
    };
    let client = ClusterClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    let mut backoff = Duration::from_millis(200);
    loop {
        // Register (again); after a fence under a new run id, so that the controller counts
        // the fenced containers gone.
        let run_id = contact.run_id(&cfg.run_id);
        let register = pb::RegisterRequest {
            node_addr: cfg.node_addr.clone(),
            slots: cfg.slots,
            memory_budget: cfg.memory_budget,
            cores: cfg.cores,
            gpu_models: cfg.gpu_models.clone(),
            labels: cfg.labels.clone().into_iter().collect(),
            run_id: run_id.clone(),
            containers: node.holding(),
        };
        let every = match client.clone().register(call(register, cfg.deadline)).await {
            Ok(r) => {
                let r = r.into_inner();
                tracing::info!(%controller, name = %r.controller, "registered with controller");
                contact.heard();
                if let Ok(images) = node.images() {
                    images.set_store(&r.store);
                }
                backoff = Duration::from_millis(200);
                Duration::from_millis(r.heartbeat_ms.clamp(100, 60_000))
            }
            Err(st) => {
                tracing::warn!(%controller, error = %st, "registration failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = stop.changed() => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        // Heartbeat until the controller forgets this worker.
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut draining = false;
        // The machine's idle CPU since the previous heartbeat to this controller (not read at
        // all when not reported).
        let mut cpu = cfg.report_cpu.then(crate::cpu::IdleCpu::new);
        if let Some(cpu) = &mut cpu {
            cpu.sample();
        }
        // Fence orders carried out, said in the heartbeats until one reaches the controller.
        let mut fenced: Vec<String> = Vec::new();
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            let (busy, resident_memory) = node.load();
            if contact.run_id(&cfg.run_id) != run_id {
                break; // fenced meanwhile: register again under the new run id
            }
            let (gpu_usage_seq, usage) = node.gpu_usage();
            let beat = pb::HeartbeatRequest {
                run_id: run_id.clone(),
                busy,
                resident_memory,
                gpu_usage: crate::server::gpu_usage_to_pb(&usage),
                gpu_usage_seq,
                fenced: fenced.clone(),
                cpu_idle_milli: cpu.as_mut().and_then(crate::cpu::IdleCpu::sample),
            };
            match client.clone().heartbeat(call(beat, cfg.deadline)).await {
                Ok(r) => {
                    let r = r.into_inner();
                    if !r.known {
                        tracing::warn!(%controller, "the controller does not know this worker; registering again");
                        break;
                    }
                    contact.heard();
                    fenced.clear();
                    if !r.fence.is_empty() {
                        let orders: Vec<(String, String)> = r
                            .fence
                            .into_iter()
                            .map(|o| (o.container, o.owner))
                            .collect();
                        tracing::info!(%controller, orders = orders.len(), "fence orders relayed by this controller");
                        fenced = node.end_ordered(&orders).await;
                    }
                    if r.draining != draining {
                        draining = r.draining;
                        tracing::info!(%controller, draining, "drain state changed");
                    }
                }
                Err(st) => {
                    tracing::warn!(%controller, error = %st, "heartbeat failed");
                }
            }
        }
    }
}

/// When the worker last heard from any controller, and how many times it fenced its
/// containers since it started (each fence gives it a new run id with every controller, so
/// that they count the fenced containers gone when it registers again).
#[derive(Default)]
struct Contact {
    inner: std::sync::Mutex<(Option<std::time::Instant>, u32)>,
}

impl Contact {
    fn lock(&self) -> std::sync::MutexGuard<'_, (Option<std::time::Instant>, u32)> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn heard(&self) {
        self.lock().0 = Some(std::time::Instant::now());
    }

    fn run_id(&self, base: &str) -> String {
        match self.lock().1 {
            0 => base.to_string(),
            n => format!("{base}-fenced-{n}"),
        }
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Ends every container here once no controller was heard from for `after` (the worker's
/// machine is cut off, or every controller hangs): they may count this worker lost and resume
/// its sandboxes elsewhere, and a sandbox must never run twice. Once per silence. While any
/// controller still hears the worker, nothing is fenced: a controller that died has its
/// containers adopted by another one.
async fn fence(after: Duration, contact: Arc<Contact>, node: Arc<NodeService>) {
    let poll = (after / 4).max(Duration::from_millis(50));
    let mut fenced_at = None;
    loop {
        tokio::time::sleep(poll).await;
        let Some(last) = contact.lock().0 else {
            continue;
        };
        if last.elapsed() < after || fenced_at == Some(last) {
            continue;
        }
        fenced_at = Some(last);
        let ended = node.fence().await;
        if ended > 0 {
            contact.lock().1 += 1;
            tracing::warn!(
                silent_ms = last.elapsed().as_millis() as u64,
                containers = ended,
                "no word from any controller: every container here is ended (fenced)"
            );
        }
    }
}
