//! Routes of `/v1/sandboxes` and their lifecycle: create, list, inspect, delete, suspend
//! (to a tier), resume and fork. Exec, files and ports are crate::exec, crate::files and
//! crate::proxy.

use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::{Extension, Json};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use serde::Deserialize;
use torpor_control::error::ErrorKind;
use torpor_control::store::SandboxCursor;
use torpor_control::CreateSandbox;
use torpor_core::{SandboxId, TemplateName, TenantId, Tier};

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
                layer_metadata: Default::default(),
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
    /// Sandboxes per page: 1 to [`LIST_LIMIT_MAX`], [`LIST_LIMIT_DEFAULT`] when absent.
    limit: Option<String>,
    /// Where the page starts: an earlier page's [`NEXT_CURSOR`] header.
    cursor: Option<String>,
}

/// A page's size when the caller names none.
pub const LIST_LIMIT_DEFAULT: usize = 1000;
/// The largest page a caller may ask for.
pub const LIST_LIMIT_MAX: usize = 10_000;
/// The response header holding the next page's cursor (absent on the last page).
pub const NEXT_CURSOR: &str = "x-next-cursor";

/// The version prefix of a cursor (the rest: creation time and id of the page's last
/// sandbox). Cursors are opaque to clients: only the API reads them.
const CURSOR_V1: &str = "1:";

fn encode_cursor(c: &SandboxCursor) -> String {
    URL_SAFE_NO_PAD.encode(format!("{CURSOR_V1}{}:{}", c.created_at, c.id))
}

fn bad_cursor() -> ApiError {
    ApiError::new(
        ErrorKind::InvalidArgument,
        "invalid_cursor",
        "cursor is not one this API returned (pass the x-next-cursor header of the previous page as it was)",
    )
}

fn decode_cursor(raw: &str) -> ApiResult<SandboxCursor> {
    let bytes = URL_SAFE_NO_PAD.decode(raw).map_err(|_| bad_cursor())?;
    let text = String::from_utf8(bytes).map_err(|_| bad_cursor())?;
    let rest = text.strip_prefix(CURSOR_V1).ok_or_else(bad_cursor)?;
    let (at, id) = rest.split_once(':').ok_or_else(bad_cursor)?;
    Ok(SandboxCursor {
        created_at: at.parse().map_err(|_| bad_cursor())?,
        id: SandboxId::new(id).map_err(|_| bad_cursor())?,
    })
}

fn parse_limit(raw: Option<&str>) -> ApiResult<usize> {
    let Some(raw) = raw else {
        return Ok(LIST_LIMIT_DEFAULT);
    };
    raw.parse::<usize>()
        .ok()
        .filter(|n| (1..=LIST_LIMIT_MAX).contains(n))
        .ok_or_else(|| {
            ApiError::new(
                ErrorKind::InvalidArgument,
                "invalid_limit",
                format!("limit must be a whole number from 1 to {LIST_LIMIT_MAX}"),
            )
        })
}

/// `GET /v1/sandboxes`: one page, in creation order, as a JSON array (the body it always
/// was); `x-next-cursor` names the next page while there is one.
pub(crate) async fn list_sandboxes(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> ApiResult<(HeaderMap, Json<Vec<Sandbox>>)> {
    let Query(q) = query.map_err(bad_query)?;
    let limit = parse_limit(q.limit.as_deref())?;
    let after = q.cursor.as_deref().map(decode_cursor).transpose()?;
    // One more than the page: whether a next page exists, without a call that finds none.
    let mut page =
        state
            .engine
            .sandboxes_page(&tenant, q.state.as_deref(), after.as_ref(), limit + 1)?;
    let mut headers = HeaderMap::new();
    if page.len() > limit {
        page.truncate(limit);
        if let Some(last) = page.last() {
            let next = encode_cursor(&SandboxCursor::of(last));
            if let Ok(v) = HeaderValue::from_str(&next) {
                headers.insert(NEXT_CURSOR, v);
            }
        }
    }
    Ok((headers, Json(page.iter().map(Sandbox::from).collect())))
}

pub(crate) async fn get_sandbox(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
) -> ApiResult<Json<Sandbox>> {
    let id = sandbox_id(&id)?;
    let s = state.engine.sandbox(&tenant, &id)?;
    let mut out = Sandbox::from(&s);
    if let Some((worker, node)) = state.engine.resident_worker(&id).await {
        out.worker = Some(worker);
        out.node = node;
    } else if matches!(out.state.as_str(), "running" | "frozen") {
        // Resident but not held here (a takeover waiting for its worker): as recorded.
        out.node = state.engine.recorded_node(&id);
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
    let cause = match body.cause.as_deref() {
        None => "api",
        Some(_) if tenant != TenantId::admin() => {
            return Err(torpor_control::error::ControlError::Forbidden(
                "only the admin may give a suspend's cause".into(),
            )
            .into())
        }
        Some("gpu_reclaimed") => "gpu_reclaimed",
        Some(other) => {
            return Err(torpor_control::error::ControlError::Invalid(format!(
                "cause {other:?}: the only cause a suspend may give is \"gpu_reclaimed\""
            ))
            .into())
        }
    };
    let s = state
        .engine
        .suspend_for(
            &tenant,
            &sandbox_id(&id)?,
            body.tier.unwrap_or(Tier::Parked),
            cause,
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

#[cfg(test)]
mod paging_tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_anything_else_is_refused() {
        let c = SandboxCursor {
            created_at: 1_733_100_000_123,
            id: SandboxId::generate(),
        };
        assert_eq!(decode_cursor(&encode_cursor(&c)).unwrap(), c);
        for bad in [
            "",
            "!!",
            "MTox",                             // "1:1": no id
            &URL_SAFE_NO_PAD.encode("2:1:abc"), // another version
            &URL_SAFE_NO_PAD.encode("1:x:abc"),
            &URL_SAFE_NO_PAD.encode("1:1:../etc"),
        ] {
            let e = decode_cursor(bad).unwrap_err();
            assert_eq!(
                (e.status().as_u16(), e.code()),
                (400, "invalid_cursor"),
                "{bad}"
            );
        }
    }

    #[test]
    fn limits_default_and_stay_in_range() {
        assert_eq!(parse_limit(None).unwrap(), LIST_LIMIT_DEFAULT);
        assert_eq!(parse_limit(Some("1")).unwrap(), 1);
        assert_eq!(parse_limit(Some("10000")).unwrap(), LIST_LIMIT_MAX);
        for bad in ["0", "10001", "-1", "x", "", "1.5"] {
            let e = parse_limit(Some(bad)).unwrap_err();
            assert_eq!(
                (e.status().as_u16(), e.code()),
                (400, "invalid_limit"),
                "{bad}"
            );
        }
    }
}
