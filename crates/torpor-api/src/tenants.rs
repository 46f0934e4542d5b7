//! Routes of `/v1/tenants`: the operator creates, lists and deletes tenants (each with its
//! token and quotas); a tenant's token gets 403.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use torpor_control::error::ErrorKind;
use torpor_core::TenantId;

use crate::auth::operator_only;
use crate::body::{parse_json, RawBody};
use crate::errors::{ApiError, ApiResult};
use crate::params::tenant_name;
use crate::state::ApiState;
use crate::types::{CreateTenantBody, Tenant, TenantCreated};

const MANAGES: &str = "manages tenants";

pub(crate) async fn create_tenant(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    RawBody(body): RawBody,
) -> ApiResult<(StatusCode, Json<TenantCreated>)> {
    operator_only(&tenant, MANAGES)?;
    let body: CreateTenantBody = parse_json(&body)?;
    let name = TenantId::new(&body.name)
        .map_err(|e| ApiError::new(ErrorKind::InvalidArgument, "invalid_request", e.to_string()))?;
    let (rec, token) = state
        .engine
        .create_tenant(name, body.quotas.unwrap_or_default())?;
    Ok((
        StatusCode::CREATED,
        Json(TenantCreated {
            name: rec.id.to_string(),
            token,
            quotas: rec.quotas,
        }),
    ))
}

pub(crate) async fn list_tenants(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
) -> ApiResult<Json<Vec<Tenant>>> {
    operator_only(&tenant, MANAGES)?;
    Ok(Json(
        state
            .engine
            .tenants()?
            .iter()
            .map(|t| Tenant {
                name: t.id.to_string(),
                created_at: crate::types::rfc3339(t.created_at),
                quotas: t.quotas,
            })
            .collect(),
    ))
}

pub(crate) async fn delete_tenant(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    operator_only(&tenant, MANAGES)?;
    let id = tenant_name(&name)?;
    state.engine.delete_tenant(&id)?;
    Ok(StatusCode::NO_CONTENT)
}
