//! Routes of `/v1/pools`: event-driven pools (see `torpor_control::pools`).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use torpor_control::pools::{PoolSpec, PoolStatus};
use torpor_core::{PoolName, TenantId};

use crate::server::{parse_json, ApiError, ApiResult, ApiState, RawBody};

fn pool_name(raw: &str) -> ApiResult<PoolName> {
    PoolName::new(raw).map_err(|_| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("pool {raw:?} not found"),
        )
    })
}

pub(crate) async fn create(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    RawBody(body): RawBody,
) -> ApiResult<(StatusCode, Json<PoolStatus>)> {
    let spec: PoolSpec = parse_json(&body)?;
    let status = state.pools.create(&tenant, spec).await?;
    Ok((StatusCode::CREATED, Json(status)))
}

pub(crate) async fn list(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
) -> Json<Vec<PoolStatus>> {
    Json(state.pools.list(&tenant))
}

pub(crate) async fn status(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(name): Path<String>,
) -> ApiResult<Json<PoolStatus>> {
    Ok(Json(state.pools.status(&tenant, &pool_name(&name)?)?))
}

pub(crate) async fn delete(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    state.pools.delete(&tenant, &pool_name(&name)?).await?;
    Ok(StatusCode::NO_CONTENT)
}
