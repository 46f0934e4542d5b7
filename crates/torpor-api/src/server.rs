//! The HTTP server: the one routes table of the API (v1 and the node's own routes; E2B's come
//! from crate::e2b::router) and the layers every request goes through: the audit log, the
//! request context and its span (crate::request_id), the body cap, host-based proxying, and
//! authentication with rate limits under `/v1`.
//!
//! Handlers live in their modules (crate::tenants, crate::templates, crate::sandboxes,
//! crate::exec, crate::files, crate::health, crate::snapshots, crate::pools, crate::uploads,
//! crate::proxy) and import the shared pieces from leaf modules (crate::state, crate::errors,
//! crate::body, crate::params, crate::auth), never from here.

use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::middleware;
use axum::routing::{any, delete, get, post};
use axum::Router;
use torpor_control::error::ErrorKind;

use crate::{
    auth, exec, files, health, pools, proxy, request_id, sandboxes, snapshots, templates, tenants,
    uploads,
};

// The paths crate::e2b, crate::audit, crate::fuzzing and the fuzz targets import; new code
// imports the leaf modules (crate::errors, crate::body, crate::state, crate::auth) instead.
pub use crate::body::{
    decode_all_bodies, parse_json, read_body_capped, BodyError, MAX_FILE_BODY, MAX_JSON_BODY,
};
pub use crate::errors::ApiError;
pub use crate::health::OPENAPI;
pub use crate::state::ApiState;

pub fn router(state: Arc<ApiState>) -> Router {
    let v1 = Router::new()
        .route(
            "/tenants",
            post(tenants::create_tenant).get(tenants::list_tenants),
        )
        .route("/tenants/{name}", delete(tenants::delete_tenant))
        .route("/workers", get(health::workers))
        .route("/nodes", get(crate::nodes::list))
        .route(
            "/nodes/{name}/drain",
            post(crate::nodes::drain).delete(crate::nodes::undrain),
        )
        .route("/gpus", get(health::gpus))
        .route(
            "/templates",
            post(templates::create_template).get(templates::list_templates),
        )
        .route(
            "/templates/{name}",
            get(templates::get_template).delete(templates::delete_template),
        )
        .route(
            "/templates/{name}/image",
            post(uploads::upload_template_image),
        )
        .route(
            "/sandboxes",
            post(sandboxes::create_sandbox).get(sandboxes::list_sandboxes),
        )
        .route(
            "/sandboxes/{id}",
            get(sandboxes::get_sandbox)
                .delete(sandboxes::delete_sandbox)
                .patch(proxy::patch_sandbox),
        )
        .route("/sandboxes/{id}/network", get(proxy::get_network))
        .route("/sandboxes/{id}/ports/{port}", any(proxy::proxy))
        .route("/sandboxes/{id}/ports/{port}/", any(proxy::proxy))
        .route("/sandboxes/{id}/ports/{port}/{*path}", any(proxy::proxy))
        .route("/sandboxes/{id}/exec", post(exec::exec))
        .route(
            "/sandboxes/{id}/files",
            get(files::read_files)
                .put(files::write_file)
                .delete(files::delete_file),
        )
        .route("/sandboxes/{id}/suspend", post(sandboxes::suspend))
        .route("/sandboxes/{id}/resume", post(sandboxes::resume))
        .route("/sandboxes/{id}/fork", post(sandboxes::fork))
        .route("/snapshots", get(snapshots::list))
        .route("/snapshots/stats", get(snapshots::stats))
        .route("/snapshots/gc", post(snapshots::gc))
        .route("/snapshots/verify", post(snapshots::verify_all))
        .route("/snapshots/{id}", get(snapshots::inspect))
        .route("/snapshots/{id}/verify", post(snapshots::verify_one))
        .route("/pools", post(pools::create).get(pools::list))
        .route("/pools/{name}", get(pools::status).delete(pools::delete))
        .route("/usage", get(crate::usage::usage))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            auth::authenticate,
        ))
        .route("/openapi.json", get(health::openapi));
    Router::new()
        .nest("/v1", v1)
        .merge(crate::e2b::router(state.clone()))
        .route("/healthz", get(health::healthz))
        .route("/metrics", get(health::metrics_with_token))
        .fallback(not_found_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            proxy::host_route,
        ))
        .layer(DefaultBodyLimit::max(MAX_FILE_BODY))
        .layer(middleware::from_fn(request_id::request_context))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            crate::audit::record_calls,
        ))
        // Cluster mode: a call for a sandbox another controller holds goes there whole.
        .layer(middleware::from_fn_with_state(
            state.clone(),
            crate::forward::forward,
        ))
        .with_state(state)
}

/// `GET /metrics` without a token, for the operator's own listener (`--metrics-listen`): bind
/// it where only the scraper reaches. Everything else there answers 404.
pub fn metrics_router(state: Arc<ApiState>) -> Router {
    Router::new()
        .route("/metrics", get(health::metrics))
        .fallback(not_found_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn(request_id::request_context))
        .with_state(state)
}

async fn not_found_route() -> ApiError {
    ApiError::new(ErrorKind::NotFound, "not_found", "no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        ErrorKind::MethodNotAllowed,
        "method_not_allowed",
        "method not allowed on this route",
    )
}
