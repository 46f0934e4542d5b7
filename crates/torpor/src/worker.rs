//! `torpor worker`: this machine's node (runsc, warm pool, cgroups) served to the cluster's
//! controllers over gRPC with mutual TLS (`torpor_cluster`). It keeps no state of its own:
//! controllers say what to run and where the images are.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::Args;
use torpor_cluster::{NodeService, Side, TlsFiles, TlsMetrics, TlsSource};
use torpor_runtime::node::{Node, RunscNode, RunscNodeConfig};

use crate::common::ENV_DATA_DIR;
use crate::datadir;

#[derive(Args)]
pub struct WorkerArgs {
    /// Where controllers call this worker (gRPC over mutual TLS), e.g. 0.0.0.0:7443.
    #[arg(long)]
    listen: SocketAddr,
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
    /// Free workers kept prepared so that a wake does only the restore.
    #[arg(long, default_value_t = 4)]
    warm_pool: usize,
    /// Serve GET /metrics (TLS refusals) without a token on this address.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
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

    let node = RunscNode::start(RunscNodeConfig {
        data_dir: args.data_dir.clone(),
        runsc_binary: args.runsc,
        runsc_platform: args.platform,
        agent_binary: std::env::current_exe().context("cannot find the torpor binary")?,
        warm_pool: args.warm_pool,
    })?;
    let node: Arc<dyn Node> = Arc::new(node);
    // Every container here is a previous run's: none is kept. (Sandbox containers run in the
    // warm pool's groups, which the pool thawed and emptied at start.)
    let removed = node.reconcile(&[]).await;
    if removed > 0 {
        tracing::warn!(
            removed,
            "removed containers a previous run of this worker left"
        );
    }

    if let Some(addr) = args.metrics_listen {
        let registry = prometheus::Registry::new();
        metrics.register(&registry)?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let registry = registry.clone();
                async move {
                    let mut out = Vec::new();
                    let _ = prometheus::Encoder::encode(
                        &prometheus::TextEncoder::new(),
                        &registry.gather(),
                        &mut out,
                    );
                    String::from_utf8_lossy(&out).into_owned()
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
    tracing::info!(%identity, listen = %args.listen, data_dir = %args.data_dir.display(), "worker serving controllers");
    let service = NodeService::new(node.clone(), identity.name.to_string());
    torpor_cluster::serve(service, listener, tls, shutdown_signal()).await?;
    tracing::info!("worker stopping");
    node.shutdown().await;
    Ok(())
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
