//! `torpor controller`: the public API (v1, E2B, ingress proxy, KEDA scaler, metrics) over the
//! cluster's workers. State lives in PostgreSQL (`--database`), snapshots in the shared store
//! (`--store`); workers join it on `--cluster-listen` (gRPC, mutual TLS) and it drives them as
//! one fleet (`torpor_cluster::Fleet`). See docs/CLUSTER.md.
//!
//! Several controllers may serve one database: each sandbox is held by one controller at a
//! time, calls for it through another are forwarded (crate torpor_api::forward), and a dead
//! controller's sandboxes and pools are taken over (torpor_control::engine, cluster module).
//!
//! What this slice does not do yet (docs/CLUSTER.md, "Not yet"): moving images between
//! machines (workers read templates and checkpoints at the paths the controller names: one
//! machine, or a data directory shared at the same path).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use torpor_cluster::{Fleet, FleetConfig, Side, TlsFiles, TlsMetrics, TlsSource};
use torpor_control::snapshots::StoreLocation;

use crate::common::ENV_DATA_DIR;
use crate::daemon::{self, ClusterRole};

#[derive(Args)]
pub struct ControllerArgs {
    /// The state store: postgres://user:password@host:port/database (the password may come
    /// from PGPASSWORD instead).
    #[arg(long)]
    database: String,
    #[command(flatten)]
    store: crate::snapshot::StoreArgs,
    /// The public API.
    #[arg(long, default_value = crate::common::DEFAULT_LISTEN)]
    listen: SocketAddr,
    /// Where workers join (gRPC over mutual TLS), e.g. 0.0.0.0:7443.
    #[arg(long)]
    cluster_listen: SocketAddr,
    /// cert.pem, key.pem and ca.pem of this controller (`torpor ca issue --role controller`);
    /// re-read when they change.
    #[arg(long)]
    tls_dir: PathBuf,
    /// The admin token (one line), the same file for every controller.
    #[arg(long)]
    admin_token_file: PathBuf,
    /// Local files of this controller: the env-key file (the same for every controller of one
    /// database), the audit log, uploads and template builds.
    #[arg(long, env = ENV_DATA_DIR)]
    data_dir: Option<PathBuf>,
    /// How often workers heartbeat.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..))]
    heartbeat_ms: u64,
    /// Where this controller's API is reached by the other controllers of this database
    /// (`host:port`; controllers built before the peer listener forward there); default:
    /// `--listen`, with an unspecified host (0.0.0.0) replaced by this machine's first
    /// non-loopback IPv4 address (on Kubernetes: `--advertise $(POD_IP):7077`). Its host is
    /// also the default host of `--advertise-peer`.
    #[arg(long)]
    advertise: Option<SocketAddr>,
    /// Where the other controllers forward calls for the sandboxes this one holds: HTTP/2
    /// over mutual TLS, only for clients with a controller certificate of the trust domain
    /// (port 0: any free port).
    #[arg(long, default_value = "0.0.0.0:7445")]
    peer_listen: SocketAddr,
    /// Where the other controllers reach `--peer-listen` (`host:port`); default: its address,
    /// or, when its host is unspecified, `--advertise`'s host with its port.
    #[arg(long)]
    advertise_peer: Option<SocketAddr>,
    /// What SIGTERM (or SIGINT, SIGQUIT) does with the sandboxes this controller holds once
    /// calls in flight have finished: `hand-off` leaves them running on their workers and
    /// gives up its row at once, and the other controllers adopt each as it is at its next
    /// call (a rolling upgrade touches no sandbox); with no other controller alive it
    /// checkpoints them instead (the workers would end them before anyone adopted them).
    /// `park` always checkpoints each first (every resident sandbox must wake again).
    #[arg(long, value_enum, default_value_t = crate::daemon::OnStop::HandOff)]
    on_stop: crate::daemon::OnStop,
    /// What a pool this controller hands over (another controller joined and it holds more
    /// than its share) does with its running agents: `pass` gives each agent's hold to the
    /// controller taking the pool as it runs (its lane finishes its message first; no
    /// checkpoint, no wake); `drain` puts each to sleep as in a scale-in, for the new holder
    /// to wake (a checkpoint and a restore per agent).
    #[arg(long, value_enum, default_value_t = PoolHandOver::Pass)]
    pool_hand_over: PoolHandOver,
    /// Whether this controller evens out its load with the others': over its share of the
    /// calls a second the cluster's sandboxes take (each controller says its own at its
    /// heartbeat), it passes its busiest sandboxes to the least loaded controller while that
    /// narrows the gap; holding at least two running sandboxes more than its share of all, it
    /// passes idle ones. A few each heartbeat, as they run; none in use, no pool agent, and
    /// only to a controller alive for longer than --worker-lost-after-ms. While a controller
    /// says no rate (an older build, or one with `false`), busy sandboxes (a call within
    /// --controller-lost-after-ms) are counted instead. So the holders' work spreads out
    /// again after a rolling upgrade or a scale-out.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    balance_sandboxes: bool,
    /// Silence after which the other controllers count this one lost and take its sandboxes
    /// over (back to their last snapshots) and its pools.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1000..))]
    controller_lost_after_ms: u64,
    /// Silence after which a worker is lost and its sandboxes resume elsewhere.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(500..))]
    worker_lost_after_ms: u64,
    /// Silence after which a lost worker is forgotten: no longer listed by GET /v1/nodes or
    /// counted in torpor_nodes (a machine scaled away); one that comes back later
    /// registers as new.
    #[arg(long, default_value_t = 3_600_000, value_parser = clap::value_parser!(u64).range(1000..))]
    worker_forgotten_after_ms: u64,
    /// A checkpoint on a worker that was never uploaded and that no sandbox refers to any more
    /// (its worker was lost with it and came back; a delete could not reach it) is removed
    /// once this old; the workers' images are looked at this often.
    #[arg(long, default_value_t = 600_000, value_parser = clap::value_parser!(u64).range(1000..))]
    orphan_image_grace_ms: u64,
    /// How long a call waits (parked) for a free worker before 503 no_worker_available.
    #[arg(long, default_value_t = 5000)]
    worker_wait_ms: u64,
    /// How long an explicit suspend waits for calls in flight before 409 sandbox_busy.
    #[arg(long, default_value_t = 30_000)]
    drain_timeout_ms: u64,
    /// How many calls may wait for a worker at once; beyond it, 503 lot_full.
    #[arg(long, default_value_t = 1024)]
    lot_size: usize,
    /// Free workers kept for tenants that hold none while another tenant's calls wait, so
    /// that a tenant calling now and then is not queued behind another's flood: `auto` (one
    /// when the ready workers have 4 slots or more, none below) or a number (0: keep none).
    #[arg(long, default_value = "auto")]
    reserved_workers: torpor_control::Reserve,
    /// How often the idle policy runs.
    #[arg(long, default_value_t = 500)]
    tick_ms: u64,
    /// Serve KEDA's external scaler (gRPC) on this address.
    #[arg(long)]
    keda_listen: Option<SocketAddr>,
    /// The only host directory a tenant's template source may name.
    #[arg(long)]
    import_dir: Option<PathBuf>,
    /// Brokers event-driven pools may name, as HOST[:PORT].
    #[arg(long, value_delimiter = ',')]
    broker_allow: Vec<String>,
    /// Serve GET /metrics without a token on this separate address.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// Tenant GPU quotas (TOML, as `torpor up --gpu-quotas`), enforced across the cluster:
    /// each GPU start carries the tenant's quota less what it holds on other workers, and the
    /// worker's ledger enforces the rest. Without it no GPU quota is enforced.
    #[arg(long)]
    gpu_quotas: Option<PathBuf>,
    /// API requests per second for tenants created without `requests_per_s`.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
    default_requests_per_s: u64,
    /// The least time between two batches of the audit log made durable (as `torpor up`).
    #[arg(long, default_value_t = torpor_api::audit::COMMIT_EVERY.as_millis() as u64, value_parser = clap::value_parser!(u64).range(0..=10_000))]
    audit_commit_ms: u64,
    #[command(flatten)]
    pub telemetry: crate::telemetry::TelemetryArgs,
}

pub async fn run(args: ControllerArgs) -> anyhow::Result<()> {
    if !(args.database.starts_with("postgres://") || args.database.starts_with("postgresql://")) {
        bail!("--database must be a postgres:// URL (cluster state lives in PostgreSQL)");
    }
    let admin_token = std::fs::read_to_string(&args.admin_token_file)
        .with_context(|| {
            format!(
                "cannot read the admin token file {}",
                args.admin_token_file.display()
            )
        })?
        .trim()
        .to_string();
    if admin_token.len() < 16 || admin_token.chars().any(char::is_whitespace) {
        bail!(
            "{}: the admin token must be one word of at least 16 characters",
            args.admin_token_file.display()
        );
    }
    let advertise = match args.advertise {
        Some(a) => a,
        None if args.listen.ip().is_unspecified() => {
            let ip = first_ipv4().unwrap_or(std::net::Ipv4Addr::LOCALHOST);
            tracing::info!(%ip, "advertising this machine's first non-loopback address to other controllers (--advertise to choose)");
            SocketAddr::new(ip.into(), args.listen.port())
        }
        None => args.listen,
    };
    if advertise.ip().is_unspecified() || advertise.port() == 0 {
        bail!("--advertise {advertise}: other controllers must reach this one's API there; give a host and a port");
    }
    let metrics = TlsMetrics::new();
    let tls = TlsSource::load(
        TlsFiles::in_dir(&args.tls_dir),
        Side::Controller,
        metrics.clone(),
    )
    .context("cannot load the controller's TLS files")?;
    let listener = tokio::net::TcpListener::bind(args.cluster_listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {} (--cluster-listen)",
                args.cluster_listen
            )
        })?;
    let peer_listener = tokio::net::TcpListener::bind(args.peer_listen)
        .await
        .with_context(|| format!("cannot listen on {} (--peer-listen)", args.peer_listen))?;
    let peer_bound = peer_listener
        .local_addr()
        .context("the peer listener's address")?;
    let advertise_peer = args
        .advertise_peer
        .unwrap_or(if peer_bound.ip().is_unspecified() {
            SocketAddr::new(advertise.ip(), peer_bound.port())
        } else {
            peer_bound
        });
    if advertise_peer.ip().is_unspecified() || advertise_peer.port() == 0 {
        bail!("--advertise-peer {advertise_peer}: other controllers must reach this one's peer listener there; give a host and a port");
    }
    let peer_acceptor = torpor_cluster::PeerAcceptor::new(tls.clone())
        .context("cannot set up the peer listener's TLS")?;
    let data_dir = args.data_dir.unwrap_or_else(daemon::default_data_dir);
    // Workers read and write images in the same store (a default DATA/store is a directory of
    // this machine: only workers that mount it at that path can use it).
    let store = args
        .store
        .store
        .clone()
        .unwrap_or_else(|| StoreLocation::Local(data_dir.join("store")));
    let store = match store {
        StoreLocation::Local(dir) => StoreLocation::Local(
            std::path::absolute(&dir)
                .with_context(|| format!("cannot resolve the store {}", dir.display()))?,
        ),
        s3 => s3,
    };
    let gpu_quotas = match &args.gpu_quotas {
        None => torpor_gpu::quota::QuotaBook::unlimited(),
        Some(p) => torpor_gpu::quota::QuotaBook::load(p)
            .map_err(|e| anyhow::anyhow!("--gpu-quotas: {e} ({})", e.code()))?,
    };
    let fleet = Fleet::new(
        tls.clone(),
        FleetConfig {
            heartbeat: Duration::from_millis(args.heartbeat_ms),
            lost_after: Duration::from_millis(args.worker_lost_after_ms),
            forget_lost_after: Duration::from_millis(args.worker_forgotten_after_ms),
            store: Some(store.to_string()),
            gpu_quotas,
            ..FleetConfig::default()
        },
    );
    tracing::info!(identity = %tls.identity(), cluster_listen = %args.cluster_listen, %advertise, %advertise_peer, "controller");
    let identity = torpor_control::engine::ControllerIdentity {
        name: tls.identity().name.to_string(),
        api_addr: advertise.to_string(),
        peer_addr: Some(advertise_peer.to_string()),
        run: format!("{:032x}", rand::random::<u128>()),
        lost_after: Duration::from_millis(args.controller_lost_after_ms),
        take_back_within: Duration::from_millis(args.worker_lost_after_ms),
        orphan_image_grace: Duration::from_millis(args.orphan_image_grace_ms),
        pass_pool_agents: args.pool_hand_over == PoolHandOver::Pass,
        balance_sandboxes: args.balance_sandboxes,
    };
    daemon::up(daemon::UpConfig {
        listen: args.listen,
        data_dir,
        workers: None,
        runsc: None,
        platform: None,
        worker_wait: Duration::from_millis(args.worker_wait_ms),
        drain_timeout: Duration::from_millis(args.drain_timeout_ms),
        lot_capacity: args.lot_size.max(1),
        reserved_workers: args.reserved_workers,
        memory_budget: None,
        tick: Duration::from_millis(args.tick_ms.max(50)),
        warm_pool: Some(0),
        live_restore: false, // no sandbox runs here
        reencode_images: false,
        gpu_inventory: None,
        gpu_quotas: None,
        cuda_checkpoint: None,
        snapshots: args.store.config(),
        keda_listen: args.keda_listen,
        import_dir: args.import_dir,
        broker_allow: args.broker_allow,
        metrics_listen: args.metrics_listen,
        default_requests_per_s: args.default_requests_per_s,
        max_connections: None,
        header_read_timeout: Duration::from_millis(crate::serve::DEFAULT_HEADER_READ_TIMEOUT_MS),
        audit_commit: Duration::from_millis(args.audit_commit_ms),
        max_sandbox_connections: None,
        cluster: Some(ClusterRole {
            fleet,
            database: args.database,
            admin_token,
            listener,
            peer_listener,
            peer_acceptor,
            tls,
            tls_metrics: metrics,
            identity,
            on_stop: args.on_stop,
        }),
    })
    .await
}

/// `torpor controller --pool-hand-over`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum PoolHandOver {
    /// Running agents go to the new holder as they run.
    Pass,
    /// Running agents sleep first; the new holder wakes them.
    Drain,
}

/// This machine's first non-loopback IPv4 address, if it has one.
fn first_ipv4() -> Option<std::net::Ipv4Addr> {
    let mut addrs: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `addrs` with a list freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut addrs) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = addrs;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr points at a sockaddr; its family says which one.
            let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
            if family == libc::AF_INET {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                if !ip.is_loopback() && !ip.is_unspecified() {
                    found = Some(ip);
                    break;
                }
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: frees the list getifaddrs allocated, once.
    unsafe { libc::freeifaddrs(addrs) };
    found
}

/// Fence orders kept in the controllers' database (`torpor_cluster::fence`).
pub struct StoreFences(pub torpor_control::store::Store);

impl torpor_cluster::FenceBook for StoreFences {
    fn order(&self, worker: &str, owner: &str, containers: &[String]) -> Result<(), String> {
        self.0
            .put_fence_orders(worker, owner, containers)
            .map_err(|e| e.to_string())
    }

    fn open(&self) -> Result<Vec<torpor_cluster::FenceOrder>, String> {
        Ok(self
            .0
            .fence_orders()
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|o| torpor_cluster::FenceOrder {
                worker: o.worker,
                container: o.container,
                owner: o.owner,
                relayed: o.relayed,
            })
            .collect())
    }

    fn relayed(&self, worker: &str, containers: &[String]) -> Result<(), String> {
        self.0
            .fence_orders_relayed(worker, containers)
            .map_err(|e| e.to_string())
    }

    fn done(&self, worker: &str, containers: &[String]) -> Result<(), String> {
        self.0
            .fence_orders_done(worker, containers)
            .map_err(|e| e.to_string())
    }

    fn others_alive(&self, me: &str) -> Result<bool, String> {
        Ok(self
            .0
            .live_controllers()
            .map_err(|e| e.to_string())?
            .iter()
            .any(|c| c.name != me))
    }
}

/// The other controllers' peer listeners, for the API's forwarding layer.
pub struct Peers(pub Arc<torpor_cluster::PeerClients>);

impl torpor_api::forward::PeerClients for Peers {
    fn client_for(&self, name: &str) -> Result<reqwest::Client, String> {
        self.0.client_for(name).map_err(|e| e.to_string())
    }
}

/// Drained workers, in the state store (`worker_drains`; see `torpor_cluster::drains`).
pub struct StoreDrains(pub torpor_control::store::Store);

impl torpor_cluster::DrainBook for StoreDrains {
    fn set(&self, worker: &str, drain: bool) -> Result<(), String> {
        self.0
            .set_worker_drain(worker, drain)
            .map_err(|e| e.to_string())
    }

    fn drained(&self) -> Result<Vec<String>, String> {
        self.0.worker_drains().map_err(|e| e.to_string())
    }
}

/// Wake tickets workers missed, in the state store (`gpu_ticket_forgets`; see
/// `torpor_cluster::tickets`).
pub struct StoreTickets(pub torpor_control::store::Store);

impl torpor_cluster::TicketBook for StoreTickets {
    fn keep(&self, worker: &str, sandbox: &str) -> Result<(), String> {
        self.0
            .put_ticket_forget(worker, sandbox)
            .map_err(|e| e.to_string())
    }

    fn pending(&self, limit: usize) -> Result<Vec<(String, String, Duration)>, String> {
        Ok(self
            .0
            .ticket_forgets(limit)
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|(w, s, ms)| (w, s, Duration::from_millis(ms)))
            .collect())
    }

    fn done(&self, worker: &str, sandbox: &str) -> Result<(), String> {
        self.0
            .ticket_forget_done(worker, sandbox)
            .map_err(|e| e.to_string())
    }
}

/// A tenant's GPU turns and the holdings its starts reported, in the state store (a lease per
/// tenant and the `gpu_holdings` table; see `torpor_cluster::gpu_turn`).
pub struct StoreGpuTurns(pub torpor_control::store::Store);

/// The lease that holds `tenant`'s GPU turn.
fn gpu_turn_lease(tenant: &str) -> String {
    format!("gpu-start:{tenant}")
}

impl torpor_cluster::GpuTurnBook for StoreGpuTurns {
    fn take(&self, tenant: &str, holder: &str, ttl: Duration) -> Result<bool, String> {
        self.0
            .try_lease(&gpu_turn_lease(tenant), holder, ttl)
            .map_err(|e| e.to_string())
    }

    fn give(&self, tenant: &str, holder: &str) -> Result<(), String> {
        self.0
            .release_lease(&gpu_turn_lease(tenant), holder)
            .map_err(|e| e.to_string())
    }

    fn holdings(
        &self,
        tenant: &str,
    ) -> Result<Vec<(String, u64, torpor_gpu::quota::Amount)>, String> {
        self.0.gpu_holdings(tenant).map_err(|e| e.to_string())
    }

    fn record(
        &self,
        tenant: &str,
        worker: &str,
        seq: u64,
        held: torpor_gpu::quota::Amount,
    ) -> Result<(), String> {
        self.0
            .put_gpu_holding(tenant, worker, seq, held)
            .map_err(|e| e.to_string())
    }
}

/// The fleet's GPUs as the engine sees them (each worker places shares from its own).
pub struct FleetGpus(pub Arc<Fleet>);

impl torpor_control::gpu::FleetGpus for FleetGpus {
    fn gpu_workers(&self) -> Vec<(String, Vec<String>)> {
        self.0.gpu_workers()
    }

    fn forget_tickets(&self, id: &torpor_core::SandboxId) {
        self.0.forget_gpu_tickets(id.as_str());
    }
}

/// The fleet as the API's node directory.
pub struct FleetNodes(pub Arc<Fleet>);

impl torpor_api::nodes::NodeDirectory for FleetNodes {
    fn nodes(&self) -> Vec<torpor_api::nodes::NodeView> {
        self.0.nodes().into_iter().map(view).collect()
    }

    fn set_drain(
        &self,
        name: &str,
        drain: bool,
    ) -> Result<Option<torpor_api::nodes::NodeView>, String> {
        match self.0.set_drain(name, drain) {
            Ok(node) => Ok(Some(view(node))),
            Err(torpor_cluster::FleetError::UnknownWorker(_)) => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    }

    fn gpus<'a>(
        &'a self,
        viewer: &'a str,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Vec<torpor_api::nodes::WorkerGpus>> + Send + 'a>,
    > {
        Box::pin(self.0.gpu_status(viewer))
    }
}

fn view(n: torpor_cluster::NodeStatus) -> torpor_api::nodes::NodeView {
    torpor_api::nodes::NodeView {
        name: n.name,
        state: n.state.to_string(),
        workers: n.workers,
        busy: n.busy,
        memory_budget_bytes: n.memory_budget_bytes,
        resident_memory_bytes: n.resident_memory_bytes,
        last_seen_at: torpor_api::types::rfc3339(n.last_seen_at as i64),
        unreachable_since: n
            .unreachable_since
            .map(|t| torpor_api::types::rfc3339(t as i64)),
        addr: Some(n.addr),
        cores: Some(n.cores),
        cpu_idle_millicores: n.cpu_idle_milli,
        gpu_models: n.gpu_models,
        labels: n.labels,
        gpu_usage: n
            .gpu_usage
            .into_iter()
            .map(|(t, a)| {
                (
                    t,
                    torpor_api::nodes::GpuHeld {
                        memory_mib: a.memory_mib,
                        compute: a.compute,
                    },
                )
            })
            .collect(),
    }
}

/// Parks the borrowers of GPU shares that a start within its guarantee needs back
/// (`torpor_cluster::reclaim`): a suspend through this controller's own API as the admin, so the
/// call reaches whichever controller holds the sandbox (forwarded), runs its transition there
/// and is audited like any other.
pub struct ApiReclaim {
    /// This controller's own API (`--listen`; loopback when that is every address).
    pub api_addr: String,
    pub admin_token: String,
    pub client: reqwest::Client,
}

#[async_trait::async_trait]
impl torpor_cluster::reclaim::GpuReclaim for ApiReclaim {
    async fn park(
        &self,
        sandbox: &torpor_core::SandboxId,
        worker: &str,
        requester: Option<&str>,
    ) -> Result<(), String> {
        let url = format!("http://{}/v1/sandboxes/{sandbox}", self.api_addr);
        // Where it runs and whose it is, from its holder (the call is forwarded there).
        let resp = self
            .client
            .get(&url)
            .bearer_auth(&self.admin_token)
            .send()
            .await
            .map_err(|e| format!("cannot look at {sandbox}: {e}"))?;
        if resp.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(()); // gone: its share went with it
        }
        if !resp.status().is_success() {
            return Err(format!("looking at {sandbox} answered {}", resp.status()));
        }
        let seen: serde_json::Value = resp
            .json()
            .await
            .map_err(|e| format!("cannot read {sandbox}: {e}"))?;
        let named = torpor_cluster::reclaim::Named {
            node: seen["node"].as_str(),
            tenant: seen["tenant"].as_str().unwrap_or_default(),
            asleep: matches!(seen["state"].as_str(), Some("parked" | "suspended")),
        };
        if !torpor_cluster::reclaim::vet(&named, worker, requester)? {
            return Ok(());
        }
        let resp = self
            .client
            .post(format!("{url}/suspend"))
            .bearer_auth(&self.admin_token)
            .json(&serde_json::json!({"tier": "parked", "cause": "gpu_reclaimed"}))
            .send()
            .await
            .map_err(|e| format!("cannot ask for the park of {sandbox}: {e}"))?;
        let status = resp.status();
        if status.is_success() {
            tracing::info!(%sandbox, "parked: its GPU share was reclaimed");
            return Ok(());
        }
        let body: serde_json::Value = resp.json().await.unwrap_or_default();
        match body["error"]["code"].as_str() {
            // Gone, or asleep deeper already: its share is back either way.
            Some("not_found") | Some("invalid_transition") => Ok(()),
            code => Err(format!(
                "the park of {sandbox} answered {status} ({})",
                code.unwrap_or("no code")
            )),
        }
    }
}
