//! Routes of the snapshot store (issue 6), operator only: list, inspect, verify, collect,
//! totals. They read and collect every tenant's snapshots, so a tenant token gets 403.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::Deserialize;
use torpor_control::snapshots::{
    GcResult, SnapshotDetail, SnapshotStats, SnapshotSummary, VerifyResult,
};
use torpor_core::TenantId;

use crate::server::{ApiError, ApiState};

type ApiResult<T> = Result<T, ApiError>;

/// The snapshot routes, to be nested under /v1 inside authentication.
pub fn routes() -> Router<Arc<ApiState>> {
    Router::new()
        .route("/snapshots", get(list))
        .route("/snapshots/stats", get(stats))
        .route("/snapshots/gc", post(gc))
        .route("/snapshots/verify", post(verify_all))
        .route("/snapshots/{id}", get(inspect))
        .route("/snapshots/{id}/verify", post(verify_one))
}

fn operator(tenant: &TenantId) -> ApiResult<()> {
    if *tenant == TenantId::admin() {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "only the operator's (admin) token manages the snapshot store",
        ))
    }
}

async fn list(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
) -> ApiResult<Json<Vec<SnapshotSummary>>> {
    operator(&tenant)?;
    Ok(Json(state.engine.list_snapshots().await?))
}

async fn inspect(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
) -> ApiResult<Json<SnapshotDetail>> {
    operator(&tenant)?;
    Ok(Json(state.engine.inspect_snapshot(&id).await?))
}

async fn verify_one(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
) -> ApiResult<Json<VerifyResult>> {
    operator(&tenant)?;
    Ok(Json(state.engine.verify_snapshots(Some(&id)).await?))
}

async fn verify_all(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
) -> ApiResult<Json<VerifyResult>> {
    operator(&tenant)?;
    Ok(Json(state.engine.verify_snapshots(None).await?))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GcQuery {
    #[serde(default)]
    dry_run: bool,
}

async fn gc(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    query: Result<Query<GcQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<GcResult>> {
    operator(&tenant)?;
    let Query(q) = query.map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            format!("query: {}", e.body_text()),
        )
    })?;
    Ok(Json(state.engine.gc_snapshots(q.dry_run).await?))
}

async fn stats(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
) -> ApiResult<Json<SnapshotStats>> {
    operator(&tenant)?;
    Ok(Json(state.engine.snapshot_stats().await?))
}
