//! `/v1/sandboxes/{id}/files`: read a file or list a directory, write a file (its body
//! counted against the upload budgets before it is read), delete a path.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use torpor_control::error::ErrorKind;
use torpor_core::TenantId;

use crate::body::{content_length, read_capped, MAX_FILE_BODY};
use crate::errors::{ApiError, ApiResult};
use crate::params::{bad_query, sandbox_id};
use crate::state::ApiState;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileQuery {
    path: String,
    #[serde(default)]
    list: bool,
    #[serde(default)]
    recursive: bool,
    /// Octal permission bits for a written file, e.g. `755`.
    mode: Option<String>,
}

fn file_query(q: Result<Query<FileQuery>, QueryRejection>) -> ApiResult<FileQuery> {
    q.map(|Query(q)| q).map_err(bad_query)
}

pub(crate) async fn read_files(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
    q: Result<Query<FileQuery>, QueryRejection>,
) -> ApiResult<Response> {
    let q = file_query(q)?;
    let id = sandbox_id(&id)?;
    if q.list {
        let entries = state.engine.list_files(&tenant, &id, &q.path).await?;
        return Ok(Json(entries).into_response());
    }
    let data = state
        .engine
        .read_file(&tenant, &id, &q.path, MAX_FILE_BODY as u64)
        .await?;
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Body::from(data),
    )
        .into_response())
}

pub(crate) async fn write_file(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
    q: Result<Query<FileQuery>, QueryRejection>,
    req: Request,
) -> ApiResult<StatusCode> {
    let q = file_query(q)?;
    let id = sandbox_id(&id)?;
    // Nothing of the body is read for a sandbox the caller cannot see, nor past the budgets.
    state.engine.sandbox(&tenant, &id)?;
    let _slot = upload_slot(&state, &tenant, req.headers())?;
    let body = read_capped(req, MAX_FILE_BODY).await?;
    let mode = match &q.mode {
        None => None,
        Some(m) => Some(
            u32::from_str_radix(m, 8)
                .ok()
                .filter(|m| *m <= 0o7777)
                .ok_or_else(|| {
                    ApiError::new(
                        ErrorKind::InvalidArgument,
                        "invalid_request",
                        "mode must be octal, e.g. 644",
                    )
                })?,
        ),
    };
    state
        .engine
        .write_file(&tenant, &id, &q.path, mode, &body)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A file upload's hold on the upload budgets (crate::ratelimit::UploadSlots), taken before its
/// body is read: `429 rate_limited` while the tenant's own uploads hold its share, `503
/// server_busy` while all uploads together hold the daemon's; both with `Retry-After`.
pub fn upload_slot(
    state: &ApiState,
    tenant: &TenantId,
    headers: &HeaderMap,
) -> ApiResult<crate::ratelimit::UploadSlot> {
    use crate::ratelimit::{UploadRefused, UploadSlots};
    let weight = UploadSlots::weight(content_length(headers), MAX_FILE_BODY as u64);
    state
        .limits
        .uploads
        .try_take(tenant, weight)
        .map_err(|why| {
            tracing::info!(tenant = %tenant, weight, ?why, "upload refused: budget in use");
            match why {
                UploadRefused::Tenant => ApiError::new(
                    ErrorKind::RateLimited,
                    "rate_limited",
                    "too many uploads in flight for this tenant; retry when one has finished",
                ),
                UploadRefused::Global => ApiError::new(
                    ErrorKind::Unavailable,
                    "server_busy",
                    "too many uploads in flight; retry shortly",
                ),
            }
            .with_retry_after(1)
        })
}

pub(crate) async fn delete_file(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
    q: Result<Query<FileQuery>, QueryRejection>,
) -> ApiResult<StatusCode> {
    let q = file_query(q)?;
    state
        .engine
        .remove_file(&tenant, &sandbox_id(&id)?, &q.path, q.recursive)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}
