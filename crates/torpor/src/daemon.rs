//! `torpor up`: the all-in-one daemon. Opens the data directory, starts the engine and serves
//! the API until SIGTERM or SIGINT, then checkpoints every resident sandbox before exiting
//! (SIGQUIT with live restore: exits at once and leaves them running for the next start).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use torpor_api::ApiState;
use torpor_control::{Engine, EngineConfig};

// Where the daemon is and its files are: shared with the client commands (`common`), and
// named here too for the callers that start or inspect a daemon.
pub use crate::common::{default_data_dir, ENV_DATA_DIR, ENV_TOKEN, TOKEN_FILE};
use crate::{datadir, nofile, serve};

/// How long calls in flight may take to finish after SIGTERM.
const GRACE: Duration = Duration::from_secs(10);
/// Connections the `--metrics-listen` listener serves at once (scrapers, not tenants).
const METRICS_MAX_CONNECTIONS: usize = 64;

pub struct UpConfig {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    pub workers: Option<usize>,
    pub runsc: Option<PathBuf>,
    pub platform: Option<String>,
    pub worker_wait: Duration,
    pub drain_timeout: Duration,
    pub lot_capacity: usize,
    pub reserved_workers: torpor_control::Reserve,
    pub memory_budget: Option<u64>,
    pub tick: Duration,
    pub warm_pool: Option<usize>,
    /// Sandboxes outlive the daemon under their shims (`--live-restore`).
    pub live_restore: bool,
    /// Parked images rewritten with stored frames (`--reencode-images`).
    pub reencode_images: bool,
    pub gpu_inventory: Option<PathBuf>,
    pub gpu_quotas: Option<PathBuf>,
    pub cuda_checkpoint: Option<PathBuf>,
    pub snapshots: torpor_control::SnapshotConfig,
    /// Where to serve KEDA's external scaler (gRPC), if anywhere.
    pub keda_listen: Option<SocketAddr>,
    /// The only host directory tenants' template sources may name (`--import-dir`).
    pub import_dir: Option<PathBuf>,
    /// Brokers (HOST[:PORT]) tenants' pools may name (`--broker-allow`).
    pub broker_allow: Vec<String>,
    /// A separate, unauthenticated listener for /metrics (`--metrics-listen`).
    pub metrics_listen: Option<SocketAddr>,
    /// Requests per second for tenants without their own `requests_per_s`.
    pub default_requests_per_s: u64,
    /// API connections open at once (`--max-connections`); `None`: the default, lowered to fit
    /// RLIMIT_NOFILE.
    pub max_connections: Option<usize>,
    /// How long a request head may take and a connection may idle (`--header-read-timeout-ms`).
    pub header_read_timeout: Duration,
    /// The least time between audit batches made durable (`--audit-commit-ms`).
    pub audit_commit: Duration,
    /// Relayed TCP connections per sandbox (`--max-sandbox-connections`), counted in the
    /// descriptor headroom.
    pub max_sandbox_connections: Option<usize>,
    /// `torpor controller`: sandboxes run on the cluster's workers, state in PostgreSQL.
    pub cluster: Option<ClusterRole>,
}

/// What makes `up` a controller (crate::controller).
pub struct ClusterRole {
    pub fleet: Arc<torpor_cluster::Fleet>,
    /// postgres:// URL of the state store.
    pub database: String,
    pub admin_token: String,
    /// `--cluster-listen`, bound.
    pub listener: tokio::net::TcpListener,
    /// `--peer-listen`, bound, and its handshake (controllers only).
    pub peer_listener: tokio::net::TcpListener,
    pub peer_acceptor: torpor_cluster::PeerAcceptor,
    pub tls: Arc<torpor_cluster::TlsSource>,
    pub tls_metrics: torpor_cluster::TlsMetrics,
    /// This controller among the controllers of one database.
    pub identity: torpor_control::engine::ControllerIdentity,
    /// What a stop does with the sandboxes this controller holds (`--on-stop`).
    pub on_stop: OnStop,
}

/// `torpor controller --on-stop`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnStop {
    /// Leave them running on their workers for the other controllers to adopt.
    HandOff,
    /// Checkpoint each first.
    Park,
}

/// Default memory budget: 70% of the machine's RAM.
pub fn default_memory_budget() -> u64 {
    let mem_kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .unwrap_or(4 << 20);
    mem_kib * 1024 / 10 * 7
}

/// Parses `512M`, `12G`, `1.5G`, `1048576` (bytes) into bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let unit = s[i..].to_ascii_lowercase();
            let mult: u64 = match unit.trim_end_matches("ib").trim_end_matches('b') {
                "" => 1,
                "k" => 1 << 10,
                "m" => 1 << 20,
                "g" => 1 << 30,
                "t" => 1 << 40,
                _ => return Err(format!("unknown size unit in {s:?} (use K, M, G or T)")),
            };
            (&s[..i], mult)
        }
        None => (s, 1),
    };
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a size, e.g. 512M or 12G"))?;
    if !(n.is_finite() && n > 0.0) {
        return Err(format!("{s:?} must be above zero"));
    }
    Ok((n * mult as f64) as u64)
}

/// Workers from the machine: one per 512 MiB of RAM, between 2 and 256.
pub fn default_workers() -> usize {
    let mem_kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .unwrap_or(4 << 20);
    ((mem_kib / 1024 / 512) as usize).clamp(2, 256)
}

/// Reads the admin token, creating it (mode 0600) on first start.
pub fn ensure_admin_token(data_dir: &Path) -> anyhow::Result<String> {
    Ok(datadir::ensure_token(data_dir, TOKEN_FILE, "tpr_admin_")?)
}

/// Reads the metrics token (`GET /metrics` accepts it besides the admin token), creating it
/// (mode 0600) on first start.
pub fn ensure_metrics_token(data_dir: &Path) -> anyhow::Result<String> {
    Ok(datadir::ensure_token(
        data_dir,
        datadir::METRICS_TOKEN_FILE,
        "tpr_metrics_",
    )?)
}

/// Raises RLIMIT_NOFILE and picks the relayed-connection cap per sandbox (the operator's, or
/// the default lowered to fit) and the connection cap that fit under it.
fn descriptor_headroom(
    max_connections: Option<usize>,
    workers: usize,
    max_sandbox_connections: Option<usize>,
) -> anyhow::Result<usize> {
    let limit = nofile::raise()?;
    let relayed = match max_sandbox_connections {
        Some(n) => n,
        None => {
            let fit = nofile::default_relayed(limit, workers);
            if fit < nofile::DEFAULT_RELAYED_PER_SANDBOX {
                eprintln!(
                    "torpor: warning: RLIMIT_NOFILE is {limit}; --max-sandbox-connections lowered from {} to {fit} to fit beside {workers} workers",
                    nofile::DEFAULT_RELAYED_PER_SANDBOX
                );
            }
            fit
        }
    };
    torpor_runtime::relay::set_max_connections(relayed);
    let load = nofile::Load {
        workers,
        relayed_per_sandbox: relayed,
    };
    let cap = nofile::connection_cap(limit, max_connections, load)?;
    if max_connections.is_none() && cap < nofile::DEFAULT_MAX_CONNECTIONS {
        tracing::warn!(
            limit,
            max_connections = cap,
            workers = load.workers,
            "RLIMIT_NOFILE is low: the connection cap is lowered to fit (raise the limit or set --max-connections)"
        );
        eprintln!(
            "torpor: warning: RLIMIT_NOFILE is {limit}; --max-connections lowered from {} to {cap} to fit beside {} workers",
            nofile::DEFAULT_MAX_CONNECTIONS,
            load.workers
        );
    }
    tracing::info!(limit, max_connections = cap, "descriptor headroom checked");
    Ok(cap)
}

pub async fn up(cfg: UpConfig) -> anyhow::Result<()> {
    // Before anything is created: the data directory, its files and runsc's are private.
    datadir::set_private_umask();
    std::fs::create_dir_all(&cfg.data_dir).with_context(|| {
        format!(
            "cannot create the data directory {} (use --data-dir or {ENV_DATA_DIR})",
            cfg.data_dir.display()
        )
    })?;
    let probe = cfg.data_dir.join(".write-test");
    if let Err(e) = std::fs::write(&probe, b"") {
        bail!(
            "the data directory {} is not writable: {e} (use --data-dir or {ENV_DATA_DIR})",
            cfg.data_dir.display()
        );
    }
    let _ = std::fs::remove_file(&probe);
    // One daemon per directory: a second would reconcile (kill) the first one's sandboxes.
    let _lock = datadir::lock(&cfg.data_dir)?;
    datadir::make_private(&cfg.data_dir)?;
    let on_stop = cfg.cluster.as_ref().map(|c| c.on_stop);
    let token = match &cfg.cluster {
        Some(c) => c.admin_token.clone(),
        None => ensure_admin_token(&cfg.data_dir)?,
    };
    let metrics_token = ensure_metrics_token(&cfg.data_dir)?;
    // A controller's workers are the cluster's (the lot grows as they join).
    let workers = match &cfg.cluster {
        Some(_) => 0,
        None => cfg.workers.unwrap_or_else(default_workers),
    };
    if workers == 0 && cfg.cluster.is_none() {
        bail!("--workers must be at least 1");
    }
    if let torpor_control::Reserve::Workers(n) = cfg.reserved_workers {
        if n > 0 && n >= workers && cfg.cluster.is_none() {
            bail!("--reserved-workers {n} must be less than --workers {workers}: a tenant that holds a worker could never take another");
        }
    }
    let max_connections = descriptor_headroom(
        cfg.max_connections,
        workers.max(1),
        cfg.max_sandbox_connections,
    )?;
    let serve_cfg = serve::ServeConfig {
        max_connections,
        header_read_timeout: cfg.header_read_timeout,
    };
    let gpus = match &cfg.cluster {
        // A controller's GPUs are its workers' (attached below), never this machine's.
        Some(_) => None,
        None => crate::gpu::daemon_gpus(
            cfg.gpu_inventory,
            cfg.gpu_quotas,
            cfg.cuda_checkpoint,
            &cfg.data_dir,
        )?,
    };
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    let engine_cfg = EngineConfig {
        data_dir: cfg.data_dir.clone(),
        workers,
        runsc_binary: cfg.runsc,
        runsc_platform: cfg.platform,
        agent_binary: std::env::current_exe().context("cannot find the torpor binary")?,
        worker_wait: cfg.worker_wait,
        drain_timeout: cfg.drain_timeout,
        lot_capacity: cfg.lot_capacity,
        reserved_workers: cfg.reserved_workers,
        memory_budget: match &cfg.cluster {
            // Each worker keeps its own budget; placement never overcommits one.
            Some(_) => None,
            None => Some(cfg.memory_budget.unwrap_or_else(default_memory_budget)),
        },
        tick: cfg.tick,
        warm_pool: cfg.warm_pool.unwrap_or(workers),
        live_restore: cfg.live_restore,
        reencode_images: cfg.reencode_images,
        snapshots: cfg.snapshots,
        import_dir: cfg.import_dir.clone(),
        database: cfg.cluster.as_ref().map(|c| c.database.clone()),
        controller: cfg.cluster.as_ref().map(|c| c.identity.clone()),
    };
    let engine = match &cfg.cluster {
        None => Engine::start(engine_cfg).await,
        Some(c) => Engine::start_on(engine_cfg, c.fleet.clone()).await,
    }
    .map_err(|e| anyhow::anyhow!("{e} ({})", e.code()))?;
    let mut cluster_server = None;
    let mut peer_server = None;
    // This process's API over loopback when it listens on every address (its own calls, e.g.
    // a reclaim's parks, then never leave the machine before they are forwarded).
    let own_api = match listener.local_addr() {
        Ok(a) if a.ip().is_unspecified() => SocketAddr::new([127, 0, 0, 1].into(), a.port()),
        Ok(a) => a,
        Err(_) => cfg.listen,
    };
    if let Some(c) = cfg.cluster {
        engine.attach_fleet_gpus(Arc::new(crate::controller::FleetGpus(c.fleet.clone())));
        // A worker this controller loses is fenced through the others before its sandboxes
        // resume elsewhere.
        c.fleet.attach_fencer(
            Arc::new(crate::controller::StoreFences(engine.state_store())),
            c.identity.name.clone(),
        );
        // A tenant's GPU quota holds across the controllers: its GPU starts take turns.
        c.fleet.attach_gpu_book(
            Arc::new(crate::controller::StoreGpuTurns(engine.state_store())),
            c.identity.name.clone(),
        );
        // A wake ticket a worker missed is asked for again by any controller, after restarts.
        c.fleet
            .attach_ticket_book(Arc::new(crate::controller::StoreTickets(
                engine.state_store(),
            )));
        // A drain through any controller holds on all of them, and across their restarts.
        c.fleet
            .attach_drain_book(Arc::new(crate::controller::StoreDrains(
                engine.state_store(),
            )));
        // A GPU start within its tenant's guarantee has borrowers parked for it.
        c.fleet
            .attach_reclaim(Arc::new(crate::controller::ApiReclaim {
                api_addr: own_api.to_string(),
                admin_token: c.admin_token.clone(),
                // Straight to this process: the admin token never goes through a proxy.
                client: reqwest::Client::builder()
                    .no_proxy()
                    .connect_timeout(Duration::from_secs(5))
                    .build()
                    .map_err(|e| anyhow::anyhow!("cannot build an HTTP client: {e}"))?,
            }));
        // The lot follows the ready workers' slots.
        let mut capacity = c.fleet.capacity();
        let sized = engine.clone();
        tokio::spawn(async move {
            loop {
                let now = *capacity.borrow_and_update();
                sized.set_workers(now.slots);
                // One checkpoint and one restore per core of the ready workers.
                sized.set_parallel(now.cores);
                if capacity.changed().await.is_err() {
                    return;
                }
            }
        });
        engine
            .metrics
            .register(Box::new(c.tls_metrics.refusals.clone()));
        engine
            .metrics
            .register(Box::new(torpor_cluster::FleetMetrics::new(&c.fleet)));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let addr = c.listener.local_addr().ok();
        eprintln!(
            "torpor: workers join on {} (mutual TLS)",
            addr.map(|a| a.to_string()).unwrap_or_default()
        );
        let task = tokio::spawn(torpor_cluster::serve_cluster(
            c.fleet.clone(),
            c.listener,
            c.tls.clone(),
            async {
                let _ = stopped.await;
            },
        ));
        cluster_server = Some((stop, task, c.fleet));
        let addr = c.peer_listener.local_addr().ok();
        eprintln!(
            "torpor: controllers forward on {} (mutual TLS)",
            addr.map(|a| a.to_string()).unwrap_or_default()
        );
        peer_server = Some((
            c.peer_listener,
            c.peer_acceptor,
            Arc::new(torpor_cluster::PeerClients::new(c.tls.clone())),
        ));
    } else {
        // The same node gauges as a controller's, for this machine's one node.
        engine
            .metrics
            .register(Box::new(torpor_cluster::FleetMetrics::single()));
    }
    if let Some(gpus) = gpus {
        engine.attach_gpus(gpus);
    }
    let pools_config = torpor_control::pools::PoolsConfig {
        broker_allow: cfg.broker_allow.clone(),
    };
    let pools = torpor_control::pools::Pools::start(engine.clone(), &cfg.data_dir, pools_config)
        .await
        .map_err(|e| anyhow::anyhow!("{e} ({})", e.code()))?;
    let _usage = torpor_control::usage::Sampler::spawn(engine.clone(), Some(pools.clone()))?;
    let (keda_stop, keda_stop_rx) = tokio::sync::oneshot::channel::<()>();
    let keda = match cfg.keda_listen {
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr} (--keda-listen)"))?;
            eprintln!("torpor: KEDA external scaler on {addr}");
            let demand: Arc<dyn torpor_triggers::keda::Demand> = pools.clone();
            Some(tokio::spawn(torpor_triggers::keda::serve(
                l,
                demand,
                async {
                    let _ = keda_stop_rx.await;
                },
            )))
        }
        None => None,
    };
    let audit = torpor_api::audit::AuditLog::open(
        &cfg.data_dir,
        torpor_api::audit::AuditConfig {
            commit_every: cfg.audit_commit,
            ..Default::default()
        },
        Some(&engine.metrics),
    )?;
    let state = Arc::new(ApiState {
        audit: audit.clone(),
        engine: engine.clone(),
        metrics_token,
        admin_token: token,
        pools: pools.clone(),
        default_requests_per_s: cfg.default_requests_per_s,
        limits: Default::default(),
        nodes: cluster_server.as_ref().map(|(_, _, fleet)| {
            Arc::new(crate::controller::FleetNodes(fleet.clone()))
                as Arc<dyn torpor_api::nodes::NodeDirectory>
        }),
        peers: peer_server.as_ref().map(|(_, _, clients)| {
            Arc::new(crate::controller::Peers(clients.clone()))
                as Arc<dyn torpor_api::forward::PeerClients>
        }),
    });
    // A tenant's rate holds across the controllers of one database (torpor_api::rate_share).
    if let Some(me) = state.engine.controller_name().map(str::to_string) {
        tokio::spawn(torpor_api::rate_share::run(state.clone(), me));
    }
    let metrics_listener = match cfg.metrics_listen {
        Some(addr) => Some((
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr} (--metrics-listen)"))?,
            torpor_api::server::metrics_router(state.clone()),
        )),
        None => None,
    };
    let app = torpor_api::router(state);
    // The peer listener (cluster mode) serves the same router to the other controllers.
    let peer_app = app.clone();
    tracing::info!(listen = %cfg.listen, data_dir = %cfg.data_dir.display(), workers, "torpor is up");
    eprintln!(
        "torpor is up on http://{} (data {}, {} workers)",
        cfg.listen,
        cfg.data_dir.display(),
        workers
    );
    // On SIGTERM: stop accepting, give calls in flight up to GRACE to finish (idle keep-alive
    // connections would otherwise hold the shutdown forever), then checkpoint.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let server = tokio::spawn(serve::serve_api(
        listener,
        app,
        serve_cfg,
        stopped(stop_rx.clone()),
    ));
    let metrics_server = metrics_listener.map(|(l, router)| {
        eprintln!(
            "torpor: metrics on http://{} (no token)",
            cfg.metrics_listen.expect("bound")
        );
        tokio::spawn(serve::serve(
            l,
            router,
            serve::ServeConfig {
                max_connections: METRICS_MAX_CONNECTIONS,
                header_read_timeout: cfg.header_read_timeout,
            },
            stopped(stop_rx.clone()),
        ))
    });
    let peers = peer_server.map(|(l, acceptor, _)| {
        tokio::spawn(serve::serve_peers(
            l,
            acceptor,
            peer_app,
            serve_cfg,
            stopped(stop_rx.clone()),
        ))
    });
    let stop = tokio::select! {
        stop = shutdown_signal(cfg.live_restore) => stop,
        () = engine.identity_lost() => {
            // Another process acts under this controller's name: touching anything now (a
            // clean stop parks sandboxes) would act for it. Leave at once.
            eprintln!("torpor: another live controller holds this controller's name (controller_identity_in_use); stopping");
            std::process::exit(1);
        }
    };
    let _ = stop_tx.send(true);
    let servers = async {
        let api = server.await;
        if let Some(m) = metrics_server {
            let _ = m.await;
        }
        if let Some(p) = peers {
            let _ = p.await;
        }
        api
    };
    match tokio::time::timeout(GRACE, servers).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => bail!("the API server task failed: {e}"),
        Err(_) => eprintln!("torpor: calls still open after {GRACE:?}; going on with shutdown"),
    }
    let _ = keda_stop.send(());
    if let Some(k) = keda {
        let _ = k.await;
    }
    // Handed off only to a live controller: with none, the workers would fence the sandboxes
    // (after their --fence-after-ms) before any controller came to adopt them.
    let hand_off = on_stop == Some(OnStop::HandOff) && engine.others_alive().unwrap_or(false);
    if on_stop == Some(OnStop::HandOff) && !hand_off {
        eprintln!("torpor: no other controller is alive to hand the sandboxes to; checkpointing them instead");
    }
    if hand_off {
        // Cluster mode: the sandboxes run on the workers, and the other controllers adopt
        // them as they are once this one's row is gone. Exit holding every sandbox's lock
        // (nothing may act for a controller that has let go), before anything is dropped.
        eprintln!("torpor: handing resident sandboxes over to the other controllers (--on-stop hand-off); pools finish in-flight messages");
        pools.shutdown().await;
        let held = engine.hand_off().await;
        audit.close().await;
        eprintln!(
            "torpor: stopped; the other controllers take this one's sandboxes over as they are"
        );
        std::mem::forget(held);
        std::process::exit(0);
    }
    if stop == Stop::Leave {
        // An upgrade or a restart: the sandboxes go on under their shims and the next start
        // takes them back. Exit before anything is dropped: a dropped worker handle would
        // reset its group under a running sandbox.
        eprintln!("torpor: leaving resident sandboxes running under their shims (SIGQUIT); pools finish in-flight messages");
        pools.shutdown().await;
        audit.close().await;
        eprintln!("torpor: stopped; the next start takes the running sandboxes back");
        std::process::exit(0);
    }
    eprintln!("torpor: shutting down; pools finish in-flight messages, then checkpointing resident sandboxes");
    pools.shutdown().await;
    engine.shutdown().await;
    if let Some((stop, task, _)) = cluster_server {
        let _ = stop.send(());
        let _ = task.await;
    }
    audit.close().await;
    eprintln!("torpor: stopped");
    Ok(())
}

/// How the daemon stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// SIGTERM, SIGINT: every resident sandbox is checkpointed first (nothing lost, whatever
    /// happens to the machine next).
    Park,
    /// SIGQUIT with live restore: exit at once and leave resident sandboxes running under
    /// their shims; the next start takes them back (an upgrade, a restart of the daemon alone).
    Leave,
}

async fn shutdown_signal(live_restore: bool) -> Stop {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler installs");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler installs");
    let mut quit = signal(SignalKind::quit()).expect("SIGQUIT handler installs");
    tokio::select! {
        _ = term.recv() => Stop::Park,
        _ = int.recv() => Stop::Park,
        _ = quit.recv() => if live_restore { Stop::Leave } else { Stop::Park },
    }
}
