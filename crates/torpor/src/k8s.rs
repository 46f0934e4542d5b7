//! `torpor k8s`: the custom resources' definitions (`crds`) and the operator that reconciles
//! them into torpor's API (`operator`); both live in `torpor_k8s`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};

#[derive(Subcommand)]
pub enum K8sCmd {
    /// Print the CustomResourceDefinitions (SandboxTemplate, TenantQuota, WorkerPool) as YAML.
    Crds,
    /// Reconcile SandboxTemplates, TenantQuotas and WorkerPools into torpor's API.
    Operator(OperatorArgs),
}

#[derive(Args)]
pub struct OperatorArgs {
    /// torpor's API, e.g. http://torpor-api.torpor.svc:7077.
    #[arg(long, env = "TORPOR_URL")]
    torpor_url: String,
    /// The admin token file (the controllers' --admin-token-file).
    #[arg(long)]
    admin_token_file: PathBuf,
    /// The operator's namespace, where tenants' token Secrets are kept.
    #[arg(long, env = "POD_NAMESPACE", default_value = "torpor")]
    namespace: String,
    /// Serve GET /healthz (the kubelet's probes) on this address.
    #[arg(long, default_value = "0.0.0.0:8081")]
    health_listen: SocketAddr,
}

pub async fn run(cmd: K8sCmd) -> anyhow::Result<()> {
    match cmd {
        K8sCmd::Crds => {
            print!("{}", torpor_k8s::crd::crds_yaml()?);
            Ok(())
        }
        K8sCmd::Operator(a) => torpor_k8s::operator::run(torpor_k8s::operator::OperatorConfig {
            torpor_url: a.torpor_url,
            admin_token_file: a.admin_token_file,
            namespace: a.namespace,
            health_listen: a.health_listen,
        })
        .await
        .context("the operator stopped"),
    }
}
