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

/// The node's GPUs, their free capacity and the shares of the caller's sandboxes.
pub(crate) async fn gpus(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
) -> ApiResult<Json<torpor_control::gpu::GpuStatus>> {
    match state.engine.gpus() {
        Some(gpus) => Ok(Json(gpus.status(&tenant))),
        None => Err(ControlError::from(torpor_control::gpu::GpuError::NotConfigured).into()),
    }
}

pub(crate) async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

pub(crate) async fn workers(
    State(state): State<Arc<ApiState>>,
) -> Json<torpor_control::WorkerStats> {
    Json(state.engine.worker_stats())
}
