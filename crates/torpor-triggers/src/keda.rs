//! KEDA's external scaler (`proto/externalscaler.proto`, package `externalscaler`), served over
//! gRPC so that a real KEDA can scale a Kubernetes Deployment of torpor workers from torpor's
//! view of demand.
//!
//! The ScaledObject's trigger metadata key `pool` names the torpor pool, and `tenant` its owner
//! (pool names are per tenant; without `tenant`, the operator's own pool); the metric name is the
//! pool's name; the metric value is the pool's demand (queued plus in-flight work) and the
//! target size is the pool's `target`. Active means demand strictly above the pool's
//! activation threshold.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tonic::{Request, Response, Status};

use crate::externalscaler::external_scaler_server::{ExternalScaler, ExternalScalerServer};
use crate::externalscaler::{
    GetMetricSpecResponse, GetMetricsRequest, GetMetricsResponse, IsActiveResponse, MetricSpec,
    MetricValue, ScaledObjectRef,
};

/// The metadata key naming the pool.
pub const POOL_KEY: &str = "pool";
/// The metadata key naming the pool's tenant (absent: the operator's pool).
pub const TENANT_KEY: &str = "tenant";
/// How often `StreamIsActive` looks at the pool (it sends only changes).
const STREAM_EVERY: Duration = Duration::from_millis(500);

/// A pool's demand as torpor sees it now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolDemand {
    pub depth: u64,
    pub target: u64,
    pub active: bool,
}

/// Where the scaler reads demand from (the control plane's pools).
pub trait Demand: Send + Sync + 'static {
    /// `None` when there is no such pool. `tenant`: the owner (`None`: the operator).
    fn demand(&self, tenant: Option<&str>, pool: &str) -> Option<PoolDemand>;
}

#[derive(Clone)]
pub struct Scaler {
    demand: Arc<dyn Demand>,
}

impl Scaler {
    pub fn new(demand: Arc<dyn Demand>) -> Self {
        Scaler { demand }
    }

    // tonic's handlers answer `Status` by value; boxing it here would only be unboxed again.
    #[allow(clippy::result_large_err)]
    fn lookup(
        &self,
        meta: &HashMap<String, String>,
    ) -> Result<(Option<String>, String, PoolDemand), Status> {
        let pool = meta
            .get(POOL_KEY)
            .filter(|p| !p.is_empty())
            .ok_or_else(|| {
                Status::invalid_argument("scalerMetadata.pool is required: the torpor pool's name")
            })?;
        let tenant = meta.get(TENANT_KEY).filter(|t| !t.is_empty()).cloned();
        let d = self
            .demand
            .demand(tenant.as_deref(), pool)
            .ok_or_else(|| Status::not_found(format!("no pool named {pool:?}")))?;
        Ok((tenant, pool.clone(), d))
    }
}

type ActiveStream = Pin<Box<dyn Stream<Item = Result<IsActiveResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalScaler for Scaler {
    async fn is_active(
        &self,
        req: Request<ScaledObjectRef>,
    ) -> Result<Response<IsActiveResponse>, Status> {
        let (_, _, d) = self.lookup(&req.get_ref().scaler_metadata)?;
        Ok(Response::new(IsActiveResponse { result: d.active }))
    }

    type StreamIsActiveStream = ActiveStream;

    async fn stream_is_active(
        &self,
        req: Request<ScaledObjectRef>,
    ) -> Result<Response<Self::StreamIsActiveStream>, Status> {
        let (tenant, pool, first) = self.lookup(&req.get_ref().scaler_metadata)?;
        let demand = self.demand.clone();
        // Send the current state, then every change.
        let stream = futures::stream::unfold(
            (None::<bool>, Some(first.active)),
            move |(mut last, mut pending)| {
                let demand = demand.clone();
                let pool = pool.clone();
                let tenant = tenant.clone();
                async move {
                    loop {
                        let now = match pending.take() {
                            Some(a) => Some(a),
                            None => {
                                tokio::time::sleep(STREAM_EVERY).await;
                                demand.demand(tenant.as_deref(), &pool).map(|d| d.active)
                            }
                        };
                        let Some(active) = now else {
                            let status = Status::not_found(format!("pool {pool:?} was deleted"));
                            return Some((Err(status), (last, None)));
                        };
                        if last != Some(active) {
                            last = Some(active);
                            return Some((Ok(IsActiveResponse { result: active }), (last, None)));
                        }
                    }
                }
            },
        );
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_metric_spec(
        &self,
        req: Request<ScaledObjectRef>,
    ) -> Result<Response<GetMetricSpecResponse>, Status> {
        let (_, pool, d) = self.lookup(&req.get_ref().scaler_metadata)?;
        Ok(Response::new(GetMetricSpecResponse {
            metric_specs: vec![MetricSpec {
                metric_name: pool,
                target_size: d.target as i64,
                target_size_float: d.target as f64,
            }],
        }))
    }

    async fn get_metrics(
        &self,
        req: Request<GetMetricsRequest>,
    ) -> Result<Response<GetMetricsResponse>, Status> {
        let r = req.get_ref();
        let meta = r
            .scaled_object_ref
            .as_ref()
            .map(|o| o.scaler_metadata.clone())
            .unwrap_or_default();
        let (_, pool, d) = self.lookup(&meta)?;
        if !r.metric_name.is_empty() && r.metric_name != pool {
            return Err(Status::not_found(format!(
                "pool {pool:?} has one metric, named {pool:?}, not {:?}",
                r.metric_name
            )));
        }
        Ok(Response::new(GetMetricsResponse {
            metric_values: vec![MetricValue {
                metric_name: pool,
                metric_value: d.depth as i64,
                metric_value_float: d.depth as f64,
            }],
        }))
    }
}

/// Serves the scaler on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    demand: Arc<dyn Demand>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let addr: Option<SocketAddr> = listener.local_addr().ok();
    tracing::info!(?addr, "KEDA external scaler is up");
    tonic::transport::Server::builder()
        .add_service(ExternalScalerServer::new(Scaler::new(demand)))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await
}
