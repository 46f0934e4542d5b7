//! `GET /v1/nodes`, `POST` and `DELETE /v1/nodes/{name}/drain` (admin only): the machines sandboxes run
//! on. In cluster mode these are the workers registered with this controller (the
//! [`NodeDirectory`] the controller gives the API); on a single machine, the machine itself
//! (`local`, always `ready`), which cannot be drained.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};
use torpor_control::error::ErrorKind;
use torpor_core::{now_millis, TenantId};

use crate::auth::operator_only;
use crate::errors::{ApiError, ApiResult};
use crate::state::ApiState;
use crate::types::rfc3339;

const MANAGES: &str = "manages nodes";

/// One node as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeView {
    pub name: String,
    /// `ready`, `draining` or `lost`.
    pub state: String,
    /// Sandboxes it runs at once, and runs now.
    pub workers: u32,
    pub busy: u32,
    pub memory_budget_bytes: u64,
    pub resident_memory_bytes: u64,
    /// Its last heartbeat (RFC 3339).
    pub last_seen_at: String,
    /// Cluster mode, once this controller counts it out of reach (its probes failed for
    /// `--worker-lost-after-ms`: it takes no new sandboxes, its heartbeats are refused, and it
    /// is `lost` the same time later): when its probes began to fail (RFC 3339). Kept once it
    /// is lost, to say why; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unreachable_since: Option<String>,
    /// Where controllers reach it (cluster mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr: Option<String>,
    /// Starts and checkpoints it runs at once: its cores (cluster mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cores: Option<u32>,
    /// Thousandths of a core idle on its machine as placement counts it: its last heartbeat's
    /// figure, less half a core for each sandbox placed on it since (cluster mode; absent when
    /// it reported none). Placement prefers the worker with the most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_idle_millicores: Option<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_models: Vec<String>,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
    /// What each tenant holds of its GPUs (cluster mode: as its last heartbeat said).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub gpu_usage: std::collections::BTreeMap<String, GpuHeld>,
}

/// GPU memory and compute held (700 compute units a whole GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GpuHeld {
    pub memory_mib: u64,
    pub compute: u64,
}

/// One worker's answer to `GET /v1/gpus` (its JSON), or why it gave none.
pub type WorkerGpus = (String, Result<serde_json::Value, String>);

/// The cluster's workers, as a controller knows them.
pub trait NodeDirectory: Send + Sync {
    fn nodes(&self) -> Vec<NodeView>;
    /// Drains a known worker (`drain`) or lifts its drain, for every controller; `Ok(None)`
    /// when there is none by that name, `Err` when the change could not be kept for the other
    /// controllers (nothing changed).
    fn set_drain(&self, name: &str, drain: bool) -> Result<Option<NodeView>, String>;
    /// `GET /v1/gpus` of every worker with GPUs that is not lost, as `viewer` may see it.
    fn gpus<'a>(&'a self, viewer: &'a str) -> futures::future::BoxFuture<'a, Vec<WorkerGpus>>;
}

pub(crate) async fn list(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
) -> ApiResult<Json<Vec<NodeView>>> {
    operator_only(&tenant, MANAGES)?;
    if let Some(dir) = &state.nodes {
        return Ok(Json(dir.nodes()));
    }
    let w = state.engine.worker_stats();
    Ok(Json(vec![NodeView {
        name: "local".into(),
        state: "ready".into(),
        workers: w.total as u32,
        busy: w.busy as u32,
        memory_budget_bytes: w.memory_budget_bytes.unwrap_or(0),
        resident_memory_bytes: w.resident_memory_bytes,
        last_seen_at: rfc3339(now_millis()),
        unreachable_since: None,
        addr: None,
        cores: None,
        cpu_idle_millicores: None,
        gpu_models: Vec::new(),
        labels: Default::default(),
        gpu_usage: Default::default(),
    }]))
}

pub(crate) async fn drain(
    state: State<Arc<ApiState>>,
    tenant: Extension<TenantId>,
    name: Path<String>,
) -> ApiResult<Json<NodeView>> {
    set_drain(state, tenant, name, true).await
}

/// `DELETE /v1/nodes/{name}/drain`: the worker takes new sandboxes again.
pub(crate) async fn undrain(
    state: State<Arc<ApiState>>,
    tenant: Extension<TenantId>,
    name: Path<String>,
) -> ApiResult<Json<NodeView>> {
    set_drain(state, tenant, name, false).await
}

async fn set_drain(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(name): Path<String>,
    drain: bool,
) -> ApiResult<Json<NodeView>> {
    operator_only(&tenant, MANAGES)?;
    let Some(dir) = &state.nodes else {
        return Err(ApiError::new(
            ErrorKind::FailedPrecondition,
            "not_clustered",
            "this daemon runs sandboxes on its own machine (embedded mode): there is no worker to drain",
        ));
    };
    match dir.set_drain(&name, drain) {
        Ok(Some(node)) => Ok(Json(node)),
        Ok(None) => Err(ApiError::new(
            ErrorKind::NotFound,
            "node_not_found",
            format!("no worker named {name:?} has registered with this controller"),
        )),
        Err(e) => Err(ApiError::new(
            ErrorKind::Unavailable,
            "state_store_error",
            e,
        )),
    }
}
