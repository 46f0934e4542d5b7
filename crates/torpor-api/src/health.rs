//! The node's own routes: `/healthz`, `/metrics` (with or without a token, by listener), the
//! workers and GPUs it has (`/v1/workers`, `/v1/gpus`) and the OpenAPI document.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use torpor_control::error::ErrorKind;
use torpor_control::ControlError;
use torpor_core::TenantId;

use crate::auth::{bearer, constant_time_eq};
use crate::errors::{ApiError, ApiResult};
use crate::state::ApiState;
use crate::types::Health;

/// The OpenAPI document served at /v1/openapi.json.
pub const OPENAPI: &str = include_str!("../openapi.json");

pub(crate) async fn healthz(State(state): State<Arc<ApiState>>) -> Json<Health> {
    let node = state.engine.node_info();
    Json(Health {
        status: "ok".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        runsc_version: node.runtime_version.clone(),
        platform: node.platform.clone(),
        workers: state.engine.workers(),
    })
}

/// `GET /metrics` on the API listener: the bearer must be the admin token or the metrics token
/// (metrics name sandboxes and tenants).
pub(crate) async fn metrics_with_token(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
) -> Response {
    let allowed = bearer(&headers).is_some_and(|t| {
        constant_time_eq(t.as_bytes(), state.admin_token.as_bytes())
            | (!state.metrics_token.is_empty()
                && constant_time_eq(t.as_bytes(), state.metrics_token.as_bytes()))
    });
    if !allowed {
        return ApiError::new(
            ErrorKind::Unauthenticated,
            "unauthorized",
            "/metrics needs `Authorization: Bearer TOKEN` with the admin or the metrics token",
        )
        .into_response();
    }
    metrics(State(state)).await
}

pub(crate) async fn metrics(State(state): State<Arc<ApiState>>) -> Response {
    if let Err(e) = state.engine.policy_tick_gauges() {
        tracing::warn!(error = %e, "cannot refresh gauges");
    }
    let mut text = state.engine.metrics.render();
    if let Some(gpus) = state.engine.gpus() {
        text.push_str(&gpus.metrics());
    }
    text.push_str(&state.engine.network_metrics());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// The node's GPUs, their free capacity and the shares of the caller's sandboxes; in cluster
/// mode, every GPU worker's, merged ([`cluster_gpus`]).
pub(crate) async fn gpus(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
) -> ApiResult<Json<serde_json::Value>> {
    if let Some(gpus) = state.engine.gpus() {
        return Ok(Json(
            serde_json::to_value(gpus.status(&tenant)).unwrap_or_default(),
        ));
    }
    let not_configured = || ControlError::from(torpor_control::gpu::GpuError::NotConfigured);
    let Some(dir) = &state.nodes else {
        return Err(not_configured().into());
    };
    let answers = dir.gpus(tenant.as_str()).await;
    if answers.is_empty() {
        return Err(not_configured().into());
    }
    Ok(Json(cluster_gpus(&state, answers)))
}

/// The workers' `GET /v1/gpus` as one: the single machine's fields, each GPU row and share with
/// the `node` it is on; `sleeping` holds the sandboxes asleep now (a worker keeps a ticket
/// after its sandbox woke elsewhere or went); `workers` says what each worker answered.
fn cluster_gpus(state: &ApiState, answers: Vec<crate::nodes::WorkerGpus>) -> serde_json::Value {
    use serde_json::{json, Value};
    let (mut gpus, mut allocations, mut workers) = (Vec::new(), Vec::new(), Vec::new());
    let mut sleeping = std::collections::BTreeSet::new();
    let mut cuda_checkpoint = false;
    let tagged = |list: &Value, node: &str| -> Vec<Value> {
        list.as_array()
            .into_iter()
            .flatten()
            .map(|v| {
                let mut v = v.clone();
                if let Some(o) = v.as_object_mut() {
                    o.insert("node".into(), json!(node));
                }
                v
            })
            .collect()
    };
    for (node, answer) in answers {
        match answer {
            Ok(status) => {
                gpus.extend(tagged(&status["gpus"], &node));
                allocations.extend(tagged(&status["allocations"], &node));
                sleeping.extend(
                    status["sleeping"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|s| s.as_str().map(str::to_string)),
                );
                let has = status["cuda_checkpoint"].as_bool().unwrap_or(false);
                cuda_checkpoint |= has;
                workers.push(
                    json!({"node": node, "source": status["source"], "cuda_checkpoint": has}),
                );
            }
            Err(error) => workers.push(json!({"node": node, "error": error})),
        }
    }
    // One read for every ticket the workers keep (a worker keeps a sandbox's ticket after it
    // woke elsewhere or was deleted): only sandboxes asleep now are shown.
    let ids: Vec<torpor_core::SandboxId> = sleeping
        .iter()
        .filter_map(|id| torpor_core::SandboxId::new(id).ok())
        .collect();
    let asleep: std::collections::BTreeSet<String> = state
        .engine
        .state_store()
        .sandboxes_by_id(&ids)
        .unwrap_or_else(|e| {
            tracing::warn!(error = %e, "GET /v1/gpus: cannot read which sandboxes sleep");
            Vec::new()
        })
        .into_iter()
        .filter(|r| {
            matches!(
                r.state,
                torpor_core::SandboxState::Parked | torpor_core::SandboxState::Suspended
            )
        })
        .map(|r| r.id.to_string())
        .collect();
    json!({
        "node": state.engine.controller_name().unwrap_or("cluster"),
        "source": "cluster",
        "gpus": gpus,
        "allocations": allocations,
        "sleeping": asleep,
        "cuda_checkpoint": cuda_checkpoint,
        "workers": workers,
    })
}

pub(crate) async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

pub(crate) async fn workers(
    State(state): State<Arc<ApiState>>,
) -> Json<torpor_control::WorkerStats> {
    Json(state.engine.worker_stats())
}
