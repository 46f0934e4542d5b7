//! `torpor worker`: this machine's node (runsc, warm pool, cgroups) served to the cluster's
//! controllers over gRPC with mutual TLS (`torpor_cluster`). It keeps no state of its own:
//! controllers say what to run and where the images are.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::Args;
use torpor_cluster::{
    NodeService, OpenBackend, Side, TlsFiles, TlsMetrics, TlsSource, WorkerImages,
};
use torpor_control::snapshots::{StoreLocation, DEFAULT_REMOTE_CACHE};
use torpor_runtime::node::{Node, RunscNode, RunscNodeConfig};

use crate::common::ENV_DATA_DIR;
use crate::datadir;

#[derive(Args)]
pub struct WorkerArgs {
    /// Controllers to join, `host:port` of their --cluster-listen (comma-separated or
    /// repeated); without any, the worker only serves controllers that dial it.
    #[arg(long, value_delimiter = ',')]
    controller: Vec<String>,
    /// Where controllers call this worker (gRPC over mutual TLS). The default, port 0 on
    /// every interface, picks a free port and tells the controllers which.
    #[arg(long, default_value = "0.0.0.0:0")]
    listen: SocketAddr,
    /// The address controllers reach --listen at, when it is not the one they see this
    /// worker's registrations come from (NAT, a Service).
    #[arg(long)]
    advertise: Option<SocketAddr>,
    /// Sandboxes this worker runs at once (default: from the machine's memory).
    #[arg(long)]
    workers: Option<usize>,
    /// Memory its sandboxes may hold together, e.g. 12G (default: 70% of RAM).
    #[arg(long, value_parser = crate::daemon::parse_size)]
    memory_budget: Option<u64>,
    /// Labels placement can ask for, KEY=VALUE (repeatable).
    #[arg(long = "label", value_parser = crate::cli::parse_kv)]
    labels: Vec<(String, String)>,
    /// cert.pem, key.pem and ca.pem of this worker (`torpor ca issue --role worker --out DIR`);
    /// re-read when they change.
    #[arg(long)]
    tls_dir: PathBuf,
    /// runsc's state, the agent, bundles and logs of this worker's sandboxes.
    #[arg(long, env = ENV_DATA_DIR)]
    data_dir: PathBuf,
    /// The worker's name; must be the one its certificate names (default: that one).
    #[arg(long)]
    name: Option<String>,
    /// Path of the runsc binary (default: found on PATH).
    #[arg(long)]
    runsc: Option<PathBuf>,
    /// gVisor platform (default: systrap if this runsc has it, else ptrace).
    #[arg(long)]
    platform: Option<String>,
    /// Free workers kept prepared so that a wake does only the restore (default: as many
    /// as --workers, at most 4).
    #[arg(long)]
    warm_pool: Option<usize>,
    /// Run each sandbox under a shim, so that sandboxes survive a crash, a SIGKILL or an
    /// upgrade (SIGQUIT) of the worker process and are taken back, as they were, for the
    /// controllers that hold them when it registers again. `false`: they end with it.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    live_restore: bool,
    /// Rewrite this worker's local copy of each uploaded image with stored frames in the
    /// background, which a wake here restores without inflating: faster for compressible
    /// state, at the cost of disk (a copy as large as the memory it holds; skipped while less
    /// than 10% or 1 GiB of the data directory's disk would be left). `false`: copies stay as
    /// runsc writes them. Images fetched from the store are written with stored frames anyway.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    reencode_images: bool,
    /// CPU priority (nice, 0–19) of the background uploads of parked images to the snapshot
    /// store: above 0, a busy worker runs the checkpoints and restores on calls' paths first
    /// and the uploads with what CPU is left (a sandbox is wakeable on another worker only
    /// once its upload ends). 0: normal priority.
    #[arg(long, default_value_t = torpor_cluster::images::UPLOAD_NICE, value_parser = clap::value_parser!(i32).range(0..=19))]
    upload_nice: i32,
    /// Under live restore, how long sandboxes run on with no worker process (milliseconds):
    /// a worker that is not back by then has its sandboxes ended by their shims. Keep it
    /// below the controllers' --worker-lost-after-ms, after which they resume the sandboxes
    /// elsewhere: no sandbox then ever runs twice.
    #[arg(long, default_value_t = 5000)]
    live_restore_window_ms: u64,
    /// Fencing: how long the worker runs a controller's sandboxes without word from that
    /// controller (a partition, a hung controller) before it ends them (milliseconds; 0:
    /// never). Keep it below the controllers' --worker-lost-after-ms, after which they resume
    /// the sandboxes elsewhere: no sandbox then ever runs twice.
    #[arg(long, default_value_t = 5000)]
    fence_after_ms: u64,
    /// Whether heartbeats say how much of this machine's CPU is idle (controllers place new
    /// and waking sandboxes on the idlest worker first). Turn it off where several workers
    /// share one machine: they would all report that machine, and its noise would choose
    /// between them (free slots decide then).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    report_cpu: bool,
    /// Bytes of chunks kept for wakes from the snapshot store (DATA/chunk-cache), e.g. 2G; 0
    /// turns it off (default 1G).
    #[arg(long, value_parser = crate::snapshot::parse_cache_size)]
    chunk_cache: Option<u64>,
    /// Pack the chunks this worker uploads into objects of about this size, e.g. 4M; 0 stores
    /// each chunk as its own object (default: 4M when the store is s3://, else 0).
    #[arg(long, value_parser = crate::snapshot::parse_pack_size)]
    pack_size: Option<u64>,
    /// Serve GET /metrics (TLS refusals; with GPUs, the GPU families with their holders'
    /// tenants and sandboxes) without a token on this address: keep it private.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// Declared GPU inventory (TOML); without it NVML is asked when a driver loads. The
    /// worker announces its GPUs and places each GPU sandbox's share from them.
    #[arg(long)]
    gpu_inventory: Option<PathBuf>,
    /// cuda-checkpoint to run inside GPU sandboxes (else searched in the sandbox's rootfs,
    /// then on PATH).
    #[arg(long, env = "TORPOR_CUDA_CHECKPOINT")]
    cuda_checkpoint: Option<PathBuf>,
}

pub async fn run(args: WorkerArgs) -> anyhow::Result<()> {
    datadir::set_private_umask();
    std::fs::create_dir_all(&args.data_dir).with_context(|| {
        format!(
            "cannot create the data directory {}",
            args.data_dir.display()
        )
    })?;
    // One process per directory: a second would reconcile (kill) the first one's sandboxes.
    let _lock = datadir::lock(&args.data_dir)?;
    datadir::make_private(&args.data_dir)?;
    for sub in ["run", "agent", "logs", "runsc"] {
        let p = args.data_dir.join(sub);
        std::fs::create_dir_all(&p).with_context(|| format!("cannot create {}", p.display()))?;
    }

    let metrics = TlsMetrics::new();
    let tls = TlsSource::load(
        TlsFiles::in_dir(&args.tls_dir),
        Side::Worker,
        metrics.clone(),
    )
    .context("cannot load the worker's TLS files")?;
    let identity = tls.identity();
    if let Some(name) = &args.name {
        if name != identity.name.as_str() {
            bail!("--name {name} but the certificate names {identity}");
        }
    }

    let slots = args.workers.unwrap_or_else(crate::daemon::default_workers);
    if slots == 0 {
        bail!("--workers must be at least 1");
    }
    let memory_budget = args
        .memory_budget
        .unwrap_or_else(crate::daemon::default_memory_budget);
    let node = RunscNode::start(RunscNodeConfig {
        data_dir: args.data_dir.clone(),
        runsc_binary: args.runsc,
        runsc_platform: args.platform,
        agent_binary: std::env::current_exe().context("cannot find the torpor binary")?,
        warm_pool: args.warm_pool.unwrap_or(slots.min(4)),
        // Containers outlive this process under shims, for at most the window: one whose
        // worker does not come back ends before the controllers resume it elsewhere.
        live_restore: args.live_restore,
        live_restore_window: Some(std::time::Duration::from_millis(
            args.live_restore_window_ms.max(1),
        )),
    })?;
    let node: Arc<dyn Node> = Arc::new(node);
    // GPUs: quotas come with each start from the controllers (cluster-wide), none here.
    let gpus = crate::gpu::daemon_gpus(
        args.gpu_inventory.clone(),
        None,
        args.cuda_checkpoint.clone(),
        &args.data_dir,
    )?;
    let (node, gpu_node): (Arc<dyn Node>, _) = match gpus {
        Some(gpus) => {
            let g = crate::worker_gpu::GpuNode::new(node, gpus);
            (g.clone(), Some(g))
        }
        None => (node, None),
    };

    // Images: this worker's own checkpoints and its copies of the store the controllers
    // announce (opened with this process's own AWS_* credentials).
    let open: OpenBackend = Arc::new(|location: &str| {
        let location: StoreLocation = location.parse()?;
        torpor_control::snapshots::open_backend(&location, None)
            .map(|(backend, _)| backend)
            .map_err(|e| e.to_string())
    });
    let images = WorkerImages::open(
        &args.data_dir,
        open,
        args.chunk_cache.unwrap_or(DEFAULT_REMOTE_CACHE),
    )
    .context("cannot prepare the worker's image directories")?
    .with_reencoding(args.reencode_images)
    .with_upload_nice(args.upload_nice)
    .with_pack_size(args.pack_size);
    if let Some(addr) = args.metrics_listen {
        let registry = prometheus::Registry::new();
        metrics.register(&registry)?;
        images.register(&registry)?;
        let gpu_metrics = gpu_node.clone();
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let registry = registry.clone();
                let gpus = gpu_metrics.clone();
                async move {
                    let mut out = Vec::new();
                    let _ = prometheus::Encoder::encode(
                        &prometheus::TextEncoder::new(),
                        &registry.gather(),
                        &mut out,
                    );
                    let mut text = String::from_utf8_lossy(&out).into_owned();
                    // This worker's GPUs, as `torpor up` serves them.
                    if let Some(g) = gpus {
                        text.push_str(&g.metrics());
                    }
                    text
                }
            }),
        );
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::warn!(error = %e, "worker metrics listener stopped");
            }
        });
    }

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let bound = listener
        .local_addr()
        .context("the listener has no address")?;
    tracing::info!(%identity, listen = %bound, data_dir = %args.data_dir.display(), slots, memory_budget, "worker serving controllers");
    eprintln!("torpor worker {} on {bound}", identity.name);
    let service = NodeService::new(node.clone(), identity.name.to_string());
    service.limit_slots(slots);
    // One start and one checkpoint per core, whichever controllers ask.
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get().max(2));
    service.limit_heavy(cores);
    if let Some(g) = &gpu_node {
        service.set_gpus(g.clone());
    }
    // Live restore: the containers a previous run left under their shims come back for the
    // controllers that held them (they say so when this worker registers); the rest goes.
    let back = if args.live_restore {
        service
            .take_back(args.data_dir.join("held"))
            .await
            .context("cannot read the worker's held containers")?
    } else {
        0
    };
    if let Some(g) = &gpu_node {
        // The shares of containers taken back stay; the rest go back.
        g.reconcile(&service.holding());
    }
    let removed = node.reconcile(&[]).await;
    if removed > 0 || back > 0 {
        tracing::warn!(
            removed,
            taken_back = back,
            "containers a previous run of this worker left: taken back or removed"
        );
    }
    service.set_images(Arc::new(images));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let joining = (!args.controller.is_empty()).then(|| {
        let cfg = torpor_cluster::JoinConfig {
            controllers: args.controller.clone(),
            node_addr: args.advertise.unwrap_or(bound).to_string(),
            slots: slots as u32,
            memory_budget,
            cores: cores as u32,
            gpu_models: gpu_node
                .as_ref()
                .map(|g| g.gpu_models())
                .unwrap_or_default(),
            labels: args.labels.iter().cloned().collect(),
            run_id: run_id(),
            deadline: std::time::Duration::from_secs(5),
            fence_after: (args.fence_after_ms > 0)
                .then(|| std::time::Duration::from_millis(args.fence_after_ms)),
            report_cpu: args.report_cpu,
        };
        tokio::spawn(torpor_cluster::join(
            cfg,
            tls.clone(),
            service.clone(),
            stop_rx,
        ))
    });
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let live_restore = args.live_restore;
    let signal = async move {
        let leave = shutdown_signal(live_restore).await;
        let _ = stop.send(leave);
    };
    torpor_cluster::serve(service.clone(), listener, tls, signal).await?;
    let _ = stop_tx.send(true);
    if stopped.await.unwrap_or(false) {
        // SIGQUIT under live restore (an upgrade): the sandboxes run on, under their shims,
        // for the next run to take back within the window.
        tracing::info!(
            containers = service.holding().len(),
            "leaving the sandboxes running"
        );
    } else {
        service.destroy_all().await;
    }
    if let Some(j) = joining {
        let _ = j.await;
    }
    tracing::info!("worker stopping");
    node.shutdown().await;
    Ok(())
}

/// A fresh id for this run of the worker (controllers tell a restart from a reconnect by it).
fn run_id() -> String {
    let bytes: [u8; 8] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Waits for SIGTERM or SIGINT (stop: sandboxes end) or SIGQUIT (with live restore: leave
/// them running for the next run; answers `true`).
async fn shutdown_signal(live_restore: bool) -> bool {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut quit)) =
        (signal(SignalKind::terminate()), signal(SignalKind::quit()))
    else {
        let _ = tokio::signal::ctrl_c().await;
        return false;
    };
    tokio::select! {
        _ = term.recv() => false,
        _ = tokio::signal::ctrl_c() => false,
        _ = quit.recv() => live_restore,
    }
}
