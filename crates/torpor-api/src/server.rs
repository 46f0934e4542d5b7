//! The HTTP server: routes of API v1 onto the engine.
//!
//! Every request under /v1 is authenticated by its bearer token; bodies are parsed here (not by
//! axum's extractors) so that every malformed input answers in the one error shape with a stable
//! code. [`status_of`] is the one place where domain errors become HTTP statuses.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::FromRequest;
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use torpor_control::{ControlError, CreateSandbox, Engine, ExecEvent};
use torpor_core::{SandboxId, TemplateName, TemplateSpec, TenantId, Tier};
use torpor_runtime::proto::{self, ExecRequest};

use crate::types::{
    CreateSandboxBody, CreateTenantBody, ErrorBody, ErrorDetail, ExecBody, ForkBody, Health,
    Sandbox, SuspendBody, Template, Tenant, TenantCreated,
};

/// The OpenAPI document served at /v1/openapi.json.
pub const OPENAPI: &str = include_str!("../openapi.json");

/// Bodies of JSON requests are small; file uploads have their own, larger cap.
pub const MAX_JSON_BODY: usize = 1 << 20;
pub const MAX_FILE_BODY: usize = proto::MAX_BODY;

pub struct ApiState {
    /// The audit log (`DATA_DIR/audit`): every mutating and every refused call.
    pub audit: Arc<crate::audit::AuditLog>,
    pub engine: Arc<Engine>,
    pub admin_token: String,
    /// Event-driven pools (`/v1/pools`).
    pub pools: Arc<torpor_control::pools::Pools>,
    /// Requests per second per tenant and route class for tenants whose quotas name none.
    pub default_requests_per_s: u64,
    /// The bearer token `GET /metrics` also accepts (besides the admin token).
    pub metrics_token: String,
    /// Rate-limit buckets and upload slots: `EdgeLimits::default()`.
    pub limits: crate::ratelimit::EdgeLimits,
}

/// An API error: a status, a stable code and a message.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: String,
    message: String,
    details: Option<serde_json::Value>,
    retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code: code.into(),
            message: message.into(),
            details: None,
            retry_after: None,
        }
    }

    /// The stable error code.
    pub fn code(&self) -> &str {
        &self.code
    }

    /// Asks the client to retry after `seconds` (the `Retry-After` header).
    pub fn with_retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        self.status
    }
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code,
                message: self.message,
                details: self.details,
            },
        };
        let mut resp = (self.status, Json(body)).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

/// The one mapping from domain errors to HTTP.
fn status_of(e: &ControlError) -> StatusCode {
    use torpor_runtime::proto::AgentErrorCode as A;
    match e {
        ControlError::NotFound { .. } => StatusCode::NOT_FOUND,
        ControlError::Forbidden(_) => StatusCode::FORBIDDEN,
        ControlError::QuotaExceeded { .. } => StatusCode::TOO_MANY_REQUESTS,
        ControlError::TenantInUse(..)
        | ControlError::AlreadyExists { .. }
        | ControlError::InvalidTransition { .. }
        | ControlError::TemplateInUse(..)
        | ControlError::TemplateNotReady(_)
        | ControlError::Busy(_) => StatusCode::CONFLICT,
        ControlError::Invalid(_)
        | ControlError::Unsupported(_)
        | ControlError::FeatureDisabled(_)
        | ControlError::Image(_) => StatusCode::BAD_REQUEST,
        ControlError::NoWorker(_)
        | ControlError::LotFull(_)
        | ControlError::ShuttingDown
        | ControlError::Conn(_) => StatusCode::SERVICE_UNAVAILABLE,
        ControlError::ExecTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
        ControlError::SandboxCrashed { .. } => StatusCode::BAD_GATEWAY,
        ControlError::Agent { code, .. } => match code {
            A::NotFound => StatusCode::NOT_FOUND,
            A::PermissionDenied => StatusCode::FORBIDDEN,
            A::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            A::Io => StatusCode::INTERNAL_SERVER_ERROR,
            A::NotADirectory
            | A::IsADirectory
            | A::InvalidPath
            | A::SpawnFailed
            | A::BadRequest => StatusCode::BAD_REQUEST,
        },
        ControlError::Gpu(e) => {
            use torpor_control::gpu::GpuError as G;
            match e {
                G::NotConfigured | G::BadRequest { .. } => StatusCode::BAD_REQUEST,
                G::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
                G::Quota { .. } => StatusCode::TOO_MANY_REQUESTS,
                G::Checkpoint(_) => StatusCode::CONFLICT,
                G::Driver(_) => StatusCode::INTERNAL_SERVER_ERROR,
                G::RuntimeUnsupported(_) => StatusCode::NOT_IMPLEMENTED,
            }
        }
        // The store's backend unreachable or locked: retryable; full: the operator's to fix.
        ControlError::SnapshotStore { code, .. } => match *code {
            "backend_remote" | "backend_io" | "store_locked" => StatusCode::SERVICE_UNAVAILABLE,
            "backend_no_space" | "output_no_space" => StatusCode::INSUFFICIENT_STORAGE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        },
        ControlError::Runtime(_)
        | ControlError::Store(_)
        | ControlError::Snapshot(_)
        | ControlError::Io { .. } => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// What a client is told of `e`: its own text when that is meant for clients; for an internal
/// failure (and an image error shown to a tenant, whose text names host paths) a message with
/// the stable code and the request id, the details going to the log under that id.
fn client_message(e: &ControlError, status: StatusCode) -> String {
    // The operator sees everything anyway: the admin's errors keep their detail (a snapshot
    // store's corrupt chunk, the path that failed) for the operator to act on.
    let admin = crate::request_id::caller().is_some_and(|c| c == TenantId::admin());
    let meant_for_clients = admin
        || match e {
            ControlError::NoWorker(_)
            | ControlError::LotFull(_)
            | ControlError::ShuttingDown
            | ControlError::ExecTimeout { .. }
            | ControlError::SandboxCrashed { .. } => true,
            ControlError::Gpu(g) => !matches!(g, torpor_control::gpu::GpuError::Driver(_)),
            ControlError::Image(_) => false,
            ControlError::Agent { code, .. } => *code != torpor_runtime::proto::AgentErrorCode::Io,
            _ => !status.is_server_error(),
        };
    let request_id = crate::request_id::current_id();
    if meant_for_clients {
        if status.is_server_error() {
            tracing::warn!(%request_id, error = %e, code = e.code(), "request failed");
        }
        return e.to_string();
    }
    if let ControlError::Image(img) = e {
        // The tenant's own image is at fault: its text without the host paths.
        tracing::info!(%request_id, error = %e, code = e.code(), "image refused");
        return img.client_message();
    }
    tracing::error!(%request_id, error = %e, code = e.code(), "request failed");
    match e {
        ControlError::Conn(_) => {
            format!("the sandbox's agent is unavailable; retry (request id {request_id})")
        }
        _ => format!("internal error ({}); request id {request_id}", e.code()),
    }
}

impl From<ControlError> for ApiError {
    fn from(e: ControlError) -> Self {
        let status = status_of(&e);
        let details = match &e {
            ControlError::ExecTimeout { stdout, stderr, .. } => {
                Some(serde_json::json!({"stdout": stdout, "stderr": stderr}))
            }
            ControlError::QuotaExceeded { what, limit, used } => {
                Some(serde_json::json!({"quota": what, "limit": limit, "used": used}))
            }
            _ => None,
        };
        let retry_after = (status == StatusCode::SERVICE_UNAVAILABLE).then_some(1);
        ApiError {
            status,
            code: e.code().into(),
            message: client_message(&e, status),
            details,
            retry_after,
        }
    }
}

pub(crate) type ApiResult<T> = Result<T, ApiError>;

/// The raw request body of a JSON route: at most [`MAX_JSON_BODY`] bytes are read (a larger
/// body is refused as soon as it is known to be larger), answered in the API's error shape.
pub(crate) struct RawBody(pub(crate) Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        read_capped(req, MAX_JSON_BODY).await.map(RawBody)
    }
}

/// The declared `Content-Length` of a request, if any.
pub(crate) fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
}

fn too_large(limit: usize) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!("this route takes bodies of at most {limit} bytes"),
    )
}

/// Reads a request's body, refusing it (`413 body_too_large`) from its `Content-Length` before
/// anything is read, or as soon as more than `limit` bytes arrived.
pub(crate) async fn read_capped(req: Request, limit: usize) -> ApiResult<Bytes> {
    let (parts, body) = req.into_parts();
    read_body_capped(&parts.headers, body, limit)
        .await
        .map_err(|e| match e {
            BodyError::TooLarge => too_large(limit),
            BodyError::Read(m) => ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                format!("cannot read the request body: {m}"),
            ),
        })
}

/// Why a body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("the body is over its route's limit")]
    TooLarge,
    #[error("cannot read the request body: {0}")]
    Read(String),
}

/// Reads a body chunk by chunk, stopping as soon as it passes `limit` bytes; a
/// `Content-Length` over the limit is refused before anything is read.
pub async fn read_body_capped(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<Bytes, BodyError> {
    use futures::StreamExt as _;
    if content_length(headers).is_some_and(|n| n > limit as u64) {
        return Err(BodyError::TooLarge);
    }
    let mut stream = body.into_data_stream();
    let mut out = bytes::BytesMut::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| BodyError::Read(e.to_string()))?;
        if out.len() + chunk.len() > limit {
            return Err(BodyError::TooLarge);
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out.freeze())
}

/// Parses a JSON body strictly, with errors in the API's shape.
pub(crate) fn parse_json<T: DeserializeOwned>(body: &Bytes) -> ApiResult<T> {
    if body.len() > MAX_JSON_BODY {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("JSON bodies are limited to {MAX_JSON_BODY} bytes"),
        ));
    }
    serde_json::from_slice(body).map_err(|e| {
        let code = if e.is_syntax() || e.is_eof() {
            "invalid_json"
        } else {
            "invalid_request"
        };
        ApiError::new(StatusCode::BAD_REQUEST, code, format!("request body: {e}"))
    })
}

/// Runs every request-body decoder of the API on `body`. The fuzz target and the property
/// test call this: any input must give a value or an [`ApiError`], never a panic.
pub fn decode_all_bodies(body: &[u8]) -> usize {
    let body = Bytes::copy_from_slice(body);
    [
        parse_json::<TemplateSpec>(&body).is_ok(),
        parse_json::<CreateSandboxBody>(&body).is_ok(),
        parse_json::<ExecBody>(&body).is_ok(),
        parse_json::<SuspendBody>(&body).is_ok(),
        parse_json::<CreateTenantBody>(&body).is_ok(),
        parse_json::<ForkBody>(&body).is_ok(),
    ]
    .into_iter()
    .filter(|ok| *ok)
    .count()
}

pub(crate) fn sandbox_id(raw: &str) -> ApiResult<SandboxId> {
    // A malformed id cannot name a sandbox: answer as for any unknown one.
    SandboxId::new(raw).map_err(|_| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("sandbox {raw:?} not found"),
        )
    })
}

fn template_name(raw: &str) -> ApiResult<TemplateName> {
    TemplateName::new(raw).map_err(|_| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("template {raw:?} not found"),
        )
    })
}

pub fn router(state: Arc<ApiState>) -> Router {
    let v1 = Router::new()
        .route("/tenants", post(create_tenant).get(list_tenants))
        .route("/tenants/{name}", axum::routing::delete(delete_tenant))
        .route("/workers", get(workers))
        .route("/gpus", get(gpus))
        .route("/templates", post(create_template).get(list_templates))
        .route(
            "/templates/{name}",
            get(get_template).delete(delete_template),
        )
        .route(
            "/templates/{name}/image",
            post(crate::uploads::upload_template_image),
        )
        .route("/sandboxes", post(create_sandbox).get(list_sandboxes))
        .route(
            "/sandboxes/{id}",
            get(get_sandbox)
                .delete(delete_sandbox)
                .patch(crate::proxy::patch_sandbox),
        )
        .route("/sandboxes/{id}/network", get(crate::proxy::get_network))
        .route(
            "/sandboxes/{id}/ports/{port}",
            axum::routing::any(crate::proxy::proxy),
        )
        .route(
            "/sandboxes/{id}/ports/{port}/",
            axum::routing::any(crate::proxy::proxy),
        )
        .route(
            "/sandboxes/{id}/ports/{port}/{*path}",
            axum::routing::any(crate::proxy::proxy),
        )
        .route("/sandboxes/{id}/exec", post(exec))
        .route(
            "/sandboxes/{id}/files",
            get(read_files).put(write_file).delete(delete_file),
        )
        .route("/sandboxes/{id}/suspend", post(suspend))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/sandboxes/{id}/fork", post(fork))
        .merge(crate::snapshots::routes())
        .route("/pools", post(crate::pools::create).get(crate::pools::list))
        .route(
            "/pools/{name}",
            get(crate::pools::status).delete(crate::pools::delete),
        )
        .layer(middleware::from_fn_with_state(state.clone(), authenticate))
        .route("/openapi.json", get(openapi));
    Router::new()
        .nest("/v1", v1)
        .merge(crate::e2b::router(state.clone()))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics_with_token))
        .fallback(not_found_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            crate::proxy::host_route,
        ))
        .layer(DefaultBodyLimit::max(MAX_FILE_BODY))
        .layer(middleware::from_fn(crate::request_id::request_context))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            crate::audit::record_calls,
        ))
        .with_state(state)
}

/// `GET /metrics` without a token, for the operator's own listener (`--metrics-listen`): bind
/// it where only the scraper reaches. Everything else there answers 404.
pub fn metrics_router(state: Arc<ApiState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .fallback(not_found_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn(crate::request_id::request_context))
        .with_state(state)
}

async fn not_found_route() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "method not allowed on this route",
    )
}

/// Resolves the bearer token to a tenant and hands it to the handler.
async fn authenticate(
    State(state): State<Arc<ApiState>>,
    mut req: Request,
    next: Next,
) -> Response {
    match tenant_of(&state, req.headers()) {
        Ok(tenant) => {
            let class = crate::ratelimit::RouteClass::of_v1_path(req.uri().path());
            if let Err(e) = crate::ratelimit::check(&state, &tenant, class) {
                return e.into_response();
            }
            req.extensions_mut().insert(tenant);
            next.run(req).await
        }
        Err(e) => e.into_response(),
    }
}

/// The tenant whose bearer token the request carries.
pub(crate) fn tenant_of(state: &ApiState, headers: &HeaderMap) -> ApiResult<TenantId> {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let tenant = match token {
        Some(t) if constant_time_eq(t.as_bytes(), state.admin_token.as_bytes()) => {
            TenantId::admin()
        }
        Some(t) => match state.engine.tenant_for_token(t) {
            Ok(Some(tenant)) => tenant,
            Ok(None) => {
                return Err(ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "unauthorized",
                    "the bearer token is not valid",
                ))
            }
            Err(e) => return Err(ApiError::from(e)),
        },
        None => {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "missing `Authorization: Bearer TOKEN` header",
            ))
        }
    };
    crate::request_id::set_caller(&tenant);
    Ok(tenant)
}

pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn healthz(State(state): State<Arc<ApiState>>) -> Json<Health> {
    let r = state.engine.runsc();
    Json(Health {
        status: "ok".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        runsc_version: r.version.clone(),
        platform: r.platform.clone(),
        workers: state.engine.workers(),
    })
}

/// `GET /metrics` on the API listener: the bearer must be the admin token or the metrics token
/// (metrics name sandboxes and tenants).
async fn metrics_with_token(State(state): State<Arc<ApiState>>, headers: HeaderMap) -> Response {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let allowed = token.is_some_and(|t| {
        constant_time_eq(t.as_bytes(), state.admin_token.as_bytes())
            | (!state.metrics_token.is_empty()
                && constant_time_eq(t.as_bytes(), state.metrics_token.as_bytes()))
    });
    if !allowed {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "/metrics needs `Authorization: Bearer TOKEN` with the admin or the metrics token",
        )
        .into_response();
    }
    metrics(State(state)).await
}

async fn metrics(State(state): State<Arc<ApiState>>) -> Response {
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
async fn gpus(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
) -> ApiResult<Json<torpor_control::gpu::GpuStatus>> {
    match state.engine.gpus() {
        Some(gpus) => Ok(Json(gpus.status(&tenant))),
        None => Err(ControlError::from(torpor_control::gpu::GpuError::NotConfigured).into()),
    }
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

async fn workers(State(state): State<Arc<ApiState>>) -> Json<torpor_control::WorkerStats> {
    Json(state.engine.worker_stats())
}

// ------------------------------------------------------------------ tenants

fn admin_only(tenant: &TenantId) -> ApiResult<()> {
    if *tenant == TenantId::admin() {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "only the operator's (admin) token manages tenants",
        ))
    }
}

async fn create_tenant(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    RawBody(body): RawBody,
) -> ApiResult<(StatusCode, Json<TenantCreated>)> {
    admin_only(&tenant)?;
    let body: CreateTenantBody = parse_json(&body)?;
    let name = TenantId::new(&body.name)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", e.to_string()))?;
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

async fn list_tenants(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
) -> ApiResult<Json<Vec<Tenant>>> {
    admin_only(&tenant)?;
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

async fn delete_tenant(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    admin_only(&tenant)?;
    let id = TenantId::new(&name).map_err(|_| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("tenant {name:?} not found"),
        )
    })?;
    state.engine.delete_tenant(&id)?;
    Ok(StatusCode::NO_CONTENT)
}

// ------------------------------------------------------------------ templates

async fn create_template(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    RawBody(body): RawBody,
) -> ApiResult<(StatusCode, Json<Template>)> {
    let spec: TemplateSpec = parse_json(&body)?;
    let rec = state
        .engine
        .register_template(&tenant, spec, &|step| {
            tracing::info!(step, "template build")
        })
        .await?;
    Ok((StatusCode::CREATED, Json(Template::from(&rec))))
}

async fn list_templates(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
) -> ApiResult<Json<Vec<Template>>> {
    let all = state.engine.templates(&tenant)?;
    Ok(Json(all.iter().map(Template::from).collect()))
}

async fn get_template(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(name): Path<String>,
) -> ApiResult<Json<Template>> {
    let t = state.engine.template(&tenant, &template_name(&name)?)?;
    Ok(Json(Template::from(&t)))
}

async fn delete_template(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    state
        .engine
        .delete_template(&tenant, &template_name(&name)?)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

// ------------------------------------------------------------------ sandboxes

async fn create_sandbox(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    RawBody(body): RawBody,
) -> ApiResult<(StatusCode, Json<Sandbox>)> {
    let body: CreateSandboxBody = parse_json(&body)?;
    let template = TemplateName::new(&body.template)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", e.to_string()))?;
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
struct ListQuery {
    state: Option<String>,
}

async fn list_sandboxes(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<Vec<Sandbox>>> {
    let Query(q) = query
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", e.body_text()))?;
    let all = state.engine.sandboxes(&tenant)?;
    let wanted = |s: &&torpor_control::SandboxRecord| match &q.state {
        None => true,
        Some(want) => s.state.as_str() == want || s.tier.as_str() == want,
    };
    Ok(Json(all.iter().filter(wanted).map(Sandbox::from).collect()))
}

async fn get_sandbox(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
) -> ApiResult<Json<Sandbox>> {
    let id = sandbox_id(&id)?;
    let s = state.engine.sandbox(&tenant, &id)?;
    let mut out = Sandbox::from(&s);
    out.worker = state.engine.resident_worker(&id);
    Ok(Json(out))
}

async fn delete_sandbox(
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

async fn suspend(
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

async fn fork(
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

async fn resume(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
) -> ApiResult<Json<Sandbox>> {
    let s = state.engine.resume(&tenant, &sandbox_id(&id)?).await?;
    Ok(Json(Sandbox::from(&s)))
}

// ------------------------------------------------------------------ exec

async fn exec(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> ApiResult<Response> {
    let id = sandbox_id(&id)?;
    let body: ExecBody = parse_json(&body)?;
    let stream = body.stream
        || headers
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("text/event-stream"));
    let stdin = body.stdin.unwrap_or_default().into_bytes();
    let req = ExecRequest {
        cmd: body.cmd,
        env: body.env,
        cwd: body.cwd,
        timeout_ms: body.timeout_ms,
        detach: body.detach,
        stream,
    };
    if !stream {
        let result = state.engine.exec(&tenant, &id, req, stdin).await?;
        return Ok(Json(result).into_response());
    }
    let mut rx = state.engine.exec_stream(&tenant, &id, req, stdin).await?;
    let events = async_stream(move |tx| async move {
        while let Some(ev) = rx.recv().await {
            let name = match &ev {
                ExecEvent::Stdout { .. } => "stdout",
                ExecEvent::Stderr { .. } => "stderr",
                ExecEvent::Exit(_) => "exit",
                ExecEvent::Error { .. } => "error",
            };
            let data = serde_json::to_string(&ev).expect("events serialise");
            if tx
                .send(Ok::<_, Infallible>(Event::default().event(name).data(data)))
                .await
                .is_err()
            {
                break;
            }
        }
    });
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// A stream fed by a task through a bounded channel.
fn async_stream<T, F, Fut>(f: F) -> impl futures::Stream<Item = T>
where
    T: Send + 'static,
    F: FnOnce(tokio::sync::mpsc::Sender<T>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(f(tx));
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

// ------------------------------------------------------------------ files

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileQuery {
    path: String,
    #[serde(default)]
    list: bool,
    #[serde(default)]
    recursive: bool,
    /// Octal permission bits for a written file, e.g. `755`.
    mode: Option<String>,
}

fn file_query(
    q: Result<Query<FileQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<FileQuery> {
    q.map(|Query(q)| q)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", e.body_text()))
}

async fn read_files(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
    q: Result<Query<FileQuery>, axum::extract::rejection::QueryRejection>,
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

async fn write_file(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
    q: Result<Query<FileQuery>, axum::extract::rejection::QueryRejection>,
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
                        StatusCode::BAD_REQUEST,
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
pub(crate) fn upload_slot(
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
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limited",
                    "too many uploads in flight for this tenant; retry when one has finished",
                ),
                UploadRefused::Global => ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_busy",
                    "too many uploads in flight; retry shortly",
                ),
            }
            .with_retry_after(1)
        })
}

async fn delete_file(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
    q: Result<Query<FileQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<StatusCode> {
    let q = file_query(q)?;
    state
        .engine
        .remove_file(&tenant, &sandbox_id(&id)?, &q.path, q.recursive)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn body_decoders_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            decode_all_bodies(&body);
        }

        #[test]
        fn json_shaped_bodies_never_panic(
            keys in proptest::collection::vec("[a-z_]{1,12}", 0..6),
            vals in proptest::collection::vec(prop_oneof![
                Just("null".to_string()), Just("[]".to_string()), Just("{}".to_string()),
                "-?[0-9]{1,20}(\\.[0-9]{1,5})?", "\"[^\"\\\\]{0,20}\"",
                Just("[\"sh\",\"-c\"]".to_string()), Just("{\"kind\":\"host\"}".to_string()),
            ], 0..6),
        ) {
            let fields: Vec<String> = keys.iter().zip(vals.iter()).map(|(k, v)| format!("\"{k}\":{v}")).collect();
            decode_all_bodies(format!("{{{}}}", fields.join(",")).as_bytes());
        }
    }

    #[test]
    fn decoders_accept_their_own_shapes() {
        assert_eq!(decode_all_bodies(br#"{"template":"host"}"#), 1);
        assert_eq!(decode_all_bodies(br#"{"cmd":["true"]}"#), 1);
        assert_eq!(decode_all_bodies(br#"{}"#), 2); // suspend (default tier), fork (count 1)
        assert_eq!(
            decode_all_bodies(br#"{"name":"t","source":{"kind":"host"}}"#),
            1
        );
    }

    #[test]
    fn internal_errors_tell_clients_the_code_and_request_id_never_the_details() {
        let e = ControlError::Io {
            what: "reading",
            path: "/var/lib/torpor/sandboxes/sb-x/checkpoint".into(),
            source: std::io::Error::other("disk on fire"),
        };
        let api = ApiError::from(e);
        assert_eq!(api.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(api.code, "io_error");
        assert!(!api.message.contains("/var/lib"), "{}", api.message);
        assert!(!api.message.contains("fire"), "{}", api.message);
        assert!(api.message.contains("request id"), "{}", api.message);
        // Errors meant for clients keep their text.
        let api = ApiError::from(ControlError::NoWorker(5));
        assert_eq!(api.message, "no worker became free within 5 ms");
        let api = ApiError::from(ControlError::Invalid("cmd is empty".into()));
        assert_eq!(api.message, "invalid request: cmd is empty");
    }

    #[test]
    fn every_error_maps_to_a_status_and_code() {
        let e = ControlError::NoWorker(5);
        let api = ApiError::from(e);
        assert_eq!(api.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(api.retry_after, Some(1));
        assert_eq!(api.code, "no_worker_available");
    }
}
