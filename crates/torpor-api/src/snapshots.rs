//! Routes of the snapshot store (issue 6), operator only: list, inspect, verify, collect,
//! totals. They read and collect every tenant's snapshots, so a tenant token gets 403.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::{Extension, Json};
use serde::Deserialize;
use torpor_control::error::ErrorKind;
use torpor_control::snapshots::{
    GcResult, SnapshotDetail, SnapshotStats, SnapshotSummary, VerifyResult,
};
use torpor_core::TenantId;

use crate::errors::{ApiError, ApiResult};
use crate::state::ApiState;

fn operator(tenant: &TenantId) -> ApiResult<()> {
    crate::auth::operator_only(tenant, "manages the snapshot store")
}

pub(crate) async fn list(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
) -> ApiResult<Json<Vec<SnapshotSummary>>> {
    operator(&tenant)?;
    Ok(Json(state.engine.list_snapshots().await?))
}

pub(crate) async fn inspect(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
) -> ApiResult<Json<SnapshotDetail>> {
    operator(&tenant)?;
    Ok(Json(state.engine.inspect_snapshot(&id).await?))
}

pub(crate) async fn verify_one(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
) -> ApiResult<Json<VerifyResult>> {
    operator(&tenant)?;
    Ok(Json(state.engine.verify_snapshots(Some(&id)).await?))
}

pub(crate) async fn verify_all(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
) -> ApiResult<Json<VerifyResult>> {
    operator(&tenant)?;
    Ok(Json(state.engine.verify_snapshots(None).await?))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct GcQuery {
    #[serde(default)]
    dry_run: bool,
}

pub(crate) async fn gc(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    query: Result<Query<GcQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<GcResult>> {
    operator(&tenant)?;
    let Query(q) = query.map_err(|e| {
        ApiError::new(
            ErrorKind::InvalidArgument,
            "invalid_request",
            format!("query: {}", e.body_text()),
        )
    })?;
    Ok(Json(state.engine.gc_snapshots(q.dry_run).await?))
}

pub(crate) async fn stats(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
) -> ApiResult<Json<SnapshotStats>> {
    operator(&tenant)?;
    Ok(Json(state.engine.snapshot_stats().await?))
}
