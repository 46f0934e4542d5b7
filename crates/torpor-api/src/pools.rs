//! Routes of `/v1/pools`: event-driven pools (see `torpor_control::pools`).
//!
//! Pool names are per tenant. A tenant addresses its own pools; the admin addresses its own, or
//! a tenant's with `?tenant=NAME`. A pool the caller may not see answers the same 404 as one that
//! does not exist (a tenant's `?tenant=` naming anyone else included).

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use serde::Deserialize;
use torpor_control::error::ErrorKind;
use torpor_control::pools::{PoolSpec, PoolStatus};
use torpor_core::{PoolName, TenantId};

use crate::body::{parse_json, RawBody};
use crate::errors::{ApiError, ApiResult};
use crate::params::bad_query;
use crate::state::ApiState;

fn not_found(raw: &str) -> ApiError {
    ApiError::new(
        ErrorKind::NotFound,
        "not_found",
        format!("pool {raw:?} not found"),
    )
}

fn pool_name(raw: &str) -> ApiResult<PoolName> {
    PoolName::new(raw).map_err(|_| not_found(raw))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Owner {
    tenant: Option<String>,
}

type OwnerQuery = Result<Query<Owner>, axum::extract::rejection::QueryRejection>;

fn owner_of(query: OwnerQuery, name: &str) -> ApiResult<Option<TenantId>> {
    let Query(owner) = query.map_err(bad_query)?;
    owner.tenant(name)
}

impl Owner {
    /// An owner that is no tenant name cannot own the pool: the same 404.
    fn tenant(&self, name: &str) -> ApiResult<Option<TenantId>> {
        self.tenant
            .as_deref()
            .map(|t| TenantId::new(t).map_err(|_| not_found(name)))
            .transpose()
    }
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
    owner: OwnerQuery,
) -> ApiResult<Json<PoolStatus>> {
    let owner = owner_of(owner, &name)?;
    Ok(Json(state.pools.status(
        &tenant,
        owner.as_ref(),
        &pool_name(&name)?,
    )?))
}

pub(crate) async fn delete(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(name): Path<String>,
    owner: OwnerQuery,
) -> ApiResult<StatusCode> {
    let owner = owner_of(owner, &name)?;
    state
        .pools
        .delete(&tenant, owner.as_ref(), &pool_name(&name)?)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}
