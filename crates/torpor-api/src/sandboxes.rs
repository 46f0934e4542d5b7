//! Routes of `/v1/sandboxes` and their lifecycle: create, list, inspect, delete, suspend
//! (to a tier), resume and fork. Exec, files and ports are crate::exec, crate::files and
//! crate::proxy.

use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use serde::Deserialize;
use torpor_control::error::ErrorKind;
use torpor_control::CreateSandbox;
use torpor_core::{TemplateName, TenantId, Tier};

use crate::body::{parse_json, RawBody};
use crate::errors::{ApiError, ApiResult};
use crate::params::{bad_query, sandbox_id};
use crate::state::ApiState;
use crate::types::{CreateSandboxBody, ForkBody, Sandbox, SuspendBody};

pub(crate) async fn create_sandbox(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    RawBody(body): RawBody,
) -> ApiResult<(StatusCode, Json<Sandbox>)> {
    let body: CreateSandboxBody = parse_json(&body)?;
    let template = TemplateName::new(&body.template)
        .map_err(|e| ApiError::new(ErrorKind::InvalidArgument, "invalid_request", e.to_string()))?;
    let rec = state
        .engine
        .create_sandbox(
            &tenant,
            CreateSandbox {
                template,
                env: body.env,
                metadata: body.metadata,
                limits: body.limits.unwrap_or_default(),
                gpu: body.gpu,
                network: body.network,
            },
        )
        .await?;
    Ok((StatusCode::CREATED, Json(Sandbox::from(&rec))))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListQuery {
    state: Option<String>,
}

pub(crate) async fn list_sandboxes(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> ApiResult<Json<Vec<Sandbox>>> {
    let Query(q) = query.map_err(bad_query)?;
    let all = state.engine.sandboxes(&tenant)?;
    let wanted = |s: &&torpor_control::SandboxRecord| match &q.state {
        None => true,
        Some(want) => s.state.as_str() == want || s.tier.as_str() == want,
    };
    Ok(Json(all.iter().filter(wanted).map(Sandbox::from).collect()))
}

pub(crate) async fn get_sandbox(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
) -> ApiResult<Json<Sandbox>> {
    let id = sandbox_id(&id)?;
    let s = state.engine.sandbox(&tenant, &id)?;
    let mut out = Sandbox::from(&s);
    if let Some((worker, node)) = state.engine.resident_worker(&id) {
        out.worker = Some(worker);
        out.node = node;
    }
    Ok(Json(out))
}

pub(crate) async fn delete_sandbox(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    state
        .engine
        .delete_sandbox(&tenant, &sandbox_id(&id)?)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(crate) async fn suspend(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
    RawBody(body): RawBody,
) -> ApiResult<Json<Sandbox>> {
    let body: SuspendBody = if body.is_empty() {
        SuspendBody::default()
    } else {
        parse_json(&body)?
    };
    let s = state
        .engine
        .suspend(
            &tenant,
            &sandbox_id(&id)?,
            body.tier.unwrap_or(Tier::Parked),
        )
        .await?;
    Ok(Json(Sandbox::from(&s)))
}

pub(crate) async fn fork(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
    RawBody(body): RawBody,
) -> ApiResult<(StatusCode, Json<Vec<Sandbox>>)> {
    let body: ForkBody = if body.is_empty() {
        ForkBody::default()
    } else {
        parse_json(&body)?
    };
    let forks = state
        .engine
        .fork(&tenant, &sandbox_id(&id)?, body.count.unwrap_or(1))
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(forks.iter().map(Sandbox::from).collect()),
    ))
}

pub(crate) async fn resume(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
) -> ApiResult<Json<Sandbox>> {
    let s = state.engine.resume(&tenant, &sandbox_id(&id)?).await?;
    Ok(Json(Sandbox::from(&s)))
}
