//! `torpor k8s operator`: three controllers (kube-runtime) watching SandboxTemplates,
//! TenantQuotas and WorkerPools cluster-wide and reconciling each into torpor's API
//! (`crate::reconcile`), plus `/healthz` for the kubelet's probes.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use futures::StreamExt;
use kube::runtime::controller::Controller;
use kube::runtime::watcher;
use kube::Api;

use crate::crd::{SandboxTemplate, TenantQuota, WorkerPool};
use crate::reconcile::{
    error_policy, reconcile_pool, reconcile_template, reconcile_tenant, Context, DisplayChain,
};

/// What `torpor k8s operator` is given.
#[derive(Debug, Clone)]
pub struct OperatorConfig {
    /// torpor's public API, e.g. `http://torpor-api.torpor.svc:7077`.
    pub torpor_url: String,
    /// The admin token file (the one the controllers read).
    pub admin_token_file: PathBuf,
    /// The operator's namespace: where tenants' token Secrets are kept.
    pub namespace: String,
    /// Where `/healthz` is served.
    pub health_listen: SocketAddr,
}

#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("cannot read the admin token file {path}")]
    TokenFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the admin token file {0} is empty")]
    EmptyToken(PathBuf),
    #[error("cannot reach the Kubernetes API (in-cluster config or kubeconfig)")]
    KubeConfig(#[source] kube::Error),
    #[error("cannot listen on {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Runs until a controller stream ends (it does not, short of a panic) or the health listener
/// fails.
pub async fn run(cfg: OperatorConfig) -> Result<(), OperatorError> {
    let token = std::fs::read_to_string(&cfg.admin_token_file).map_err(|source| {
        OperatorError::TokenFile {
            path: cfg.admin_token_file.clone(),
            source,
        }
    })?;
    let token = token.trim();
    if token.is_empty() {
        return Err(OperatorError::EmptyToken(cfg.admin_token_file));
    }
    let kube = kube::Client::try_default()
        .await
        .map_err(OperatorError::KubeConfig)?;
    let listener = tokio::net::TcpListener::bind(cfg.health_listen)
        .await
        .map_err(|source| OperatorError::Listen {
            addr: cfg.health_listen,
            source,
        })?;
    tracing::info!(torpor = %cfg.torpor_url, namespace = %cfg.namespace, health = %cfg.health_listen, "operator starting");
    let ctx = Arc::new(Context::new(
        kube.clone(),
        &cfg.torpor_url,
        token,
        &cfg.namespace,
    ));
    let templates = Controller::new(
        Api::<SandboxTemplate>::all(kube.clone()),
        watcher::Config::default(),
    )
    .shutdown_on_signal()
    .run(reconcile_template, error_policy, ctx.clone())
    .for_each(|r| log_result("SandboxTemplate", r));
    let tenants = Controller::new(
        Api::<TenantQuota>::all(kube.clone()),
        watcher::Config::default(),
    )
    .shutdown_on_signal()
    .run(reconcile_tenant, error_policy, ctx.clone())
    .for_each(|r| log_result("TenantQuota", r));
    let pools = Controller::new(
        Api::<WorkerPool>::all(kube.clone()),
        watcher::Config::default(),
    )
    .shutdown_on_signal()
    .run(reconcile_pool, error_policy, ctx.clone())
    .for_each(|r| log_result("WorkerPool", r));
    let health = axum::Router::new().route("/healthz", axum::routing::get(|| async { "ok\n" }));
    let serve = axum::serve(listener, health);
    tokio::select! {
        _ = futures::future::join3(templates, tenants, pools) => Ok(()),
        r = serve => r.map_err(|source| OperatorError::Listen { addr: cfg.health_listen, source }),
    }
}

async fn log_result<T: std::fmt::Debug, E: std::error::Error + 'static>(
    kind: &'static str,
    r: Result<T, E>,
) {
    match r {
        Ok(obj) => tracing::debug!(kind, object = ?obj, "reconciled"),
        Err(e) => tracing::warn!(kind, error = %DisplayChain(&e), "reconcile error"),
    }
}
