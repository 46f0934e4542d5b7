//! Ingress: `ANY /v1/sandboxes/{id}/ports/{port}/{path…}` proxies HTTP to a port of the
//! sandbox, waking it first when it sleeps (parked in the lot like any call when no worker is
//! free), and `PATCH /v1/sandboxes/{id}` changes its network policy.
//!
//! Each proxied request gets its own connection to the sandbox, closed by torpor once the
//! response has been read, or reset when the sandbox's server closed it first: the sandbox's
//! side never holds a TIME_WAIT endpoint, which would make its next checkpoint fail
//! (torpor_runtime::relay). The sandbox stays borrowed (it cannot be checkpointed) until
//! the response body has been streamed to the client, so the sleep ladder drains proxied
//! requests instead of cutting them.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use torpor_control::error::ErrorKind;
use torpor_core::{NetworkPolicy, SandboxId, TenantId};

use crate::body::{parse_json, RawBody};
use crate::errors::{ApiError, ApiResult};
use crate::params::sandbox_id;
use crate::state::ApiState;

/// Body of `PATCH /v1/sandboxes/{id}` and its answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxPatch {
    pub network: NetworkPolicy,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxNetwork {
    pub id: String,
    pub network: NetworkPolicy,
    /// While resident: the host-side address that forwards every port to the sandbox (what the
    /// proxy connects to). Absent while it sleeps or without a network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
}

pub(crate) async fn patch_sandbox(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
    RawBody(body): RawBody,
) -> ApiResult<Json<SandboxNetwork>> {
    let id = sandbox_id(&id)?;
    let patch: SandboxPatch = parse_json(&body)?;
    state
        .engine
        .set_network(&tenant, &id, patch.network)
        .await?;
    get_network_of(&state, &tenant, &id)
}

pub(crate) async fn get_network(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
) -> ApiResult<Json<SandboxNetwork>> {
    get_network_of(&state, &tenant, &sandbox_id(&id)?)
}

fn get_network_of(
    state: &ApiState,
    tenant: &TenantId,
    id: &SandboxId,
) -> ApiResult<Json<SandboxNetwork>> {
    let network = state.engine.network_policy(tenant, id)?;
    let address = state
        .engine
        .ingress_address(tenant, id)?
        .map(|a| a.to_string());
    Ok(Json(SandboxNetwork {
        id: id.to_string(),
        network,
        address,
    }))
}

/// Headers that belong to one hop (RFC 9110 §7.6.1), plus torpor's own credentials.
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "authorization"
    )
}

/// A `Connection: upgrade` request naming a protocol (WebSocket).
fn wants_upgrade(h: &HeaderMap) -> bool {
    let conn_upgrade = h
        .get_all(axum::http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| {
            v.split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
        });
    conn_upgrade && h.contains_key(axum::http::header::UPGRADE)
}

fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (k, v) in from {
        if !hop_by_hop(k) {
            to.append(k.clone(), v.clone());
        }
    }
}

/// Splits `[/v1]/sandboxes/{id}/ports/{port}/{rest}` (raw, still percent-encoded; the router
/// nested under /v1 sees the path without its prefix).
pub(crate) fn split_route(path: &str) -> ApiResult<(String, u16, String)> {
    let bad_port = |p: &str| {
        ApiError::new(
            ErrorKind::InvalidArgument,
            "invalid_port",
            format!("port {p:?} is not a number in 1-65535"),
        )
    };
    let rest = path
        .strip_prefix("/v1")
        .unwrap_or(path)
        .strip_prefix("/sandboxes/")
        .ok_or_else(|| ApiError::new(ErrorKind::NotFound, "not_found", "no such route"))?;
    let mut parts = rest.splitn(4, '/');
    let id = parts.next().unwrap_or_default().to_string();
    if parts.next() != Some("ports") {
        return Err(ApiError::new(
            ErrorKind::NotFound,
            "not_found",
            "no such route",
        ));
    }
    let port_raw = parts.next().unwrap_or_default();
    let port: u16 = port_raw
        .parse()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| bad_port(port_raw))?;
    let tail = parts.next().unwrap_or_default().to_string();
    check_tail(&tail)?;
    Ok((id, port, tail))
}

/// Refuses a path that would climb out of the route (`..`, `.`, encoded slashes).
fn check_tail(tail: &str) -> ApiResult<()> {
    let bad = || {
        ApiError::new(
            ErrorKind::InvalidArgument,
            "invalid_path",
            format!("path {tail:?} may not contain '.' or '..' segments, encoded slashes or NUL"),
        )
    };
    let lower = tail.to_ascii_lowercase();
    if lower.contains("%2f")
        || lower.contains("%5c")
        || lower.contains("%00")
        || tail.contains('\\')
    {
        return Err(bad());
    }
    for seg in tail.split('/') {
        let decoded = seg.replace("%2e", ".").replace("%2E", ".");
        if decoded == "." || decoded == ".." {
            return Err(bad());
        }
    }
    Ok(())
}

pub(crate) async fn proxy(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    req: Request,
) -> Response {
    let uri = req.uri().clone();
    match proxy_inner(state, tenant, uri, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn proxy_inner(
    state: Arc<ApiState>,
    tenant: TenantId,
    uri: axum::http::Uri,
    req: Request,
) -> ApiResult<Response> {
    let (id, port, tail) = split_route(uri.path())?;
    let target = Target {
        id,
        port,
        host: None,
    };
    forward(state, tenant, target, tail, uri, req).await
}

/// What a proxied request reaches: a port of a sandbox, and the Host header it is sent
/// (`None`: the sandbox's own address and port).
struct Target {
    id: String,
    port: u16,
    host: Option<String>,
}

pub use crate::domain::{proxy_domain, set_proxy_domain, DEFAULT_PROXY_DOMAIN};

/// The port E2B's SDKs reach a sandbox's envd at: `49983-{id}.<domain>` is served by E2B's
/// envd routes (crate::e2b) for sandbox `id`, not proxied to a port of the sandbox.
pub const ENVD_PORT: u16 = 49983;
/// The control plane's name under the domain: E2B's SDKs default to `https://api.<domain>`.
pub const API_LABEL: &str = "api";

/// Host-based routing, by the label in front of the domain given to [`set_proxy_domain`]:
/// - `{port}-{id}.<domain>` is proxied like `/v1/sandboxes/{id}/ports/{port}/{path}`, with the
///   same authentication (or none for a public E2B sandbox, see crate::e2b::ports);
/// - `49983-{id}.<domain>` ([`ENVD_PORT`]) reaches E2B's envd routes for sandbox `id` (see
///   [`envd_by_host`]), as E2B's SDKs build envd's URL;
/// - `api.<domain>` and every other host go on to the API.
pub(crate) async fn host_route(
    State(state): State<Arc<ApiState>>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let domain = proxy_domain();
    let host = req
        .headers()
        .get(axum::http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(|h| {
            h.rsplit_once(':')
                .map_or(h, |(name, _)| name)
                .to_ascii_lowercase()
        });
    let label = host.as_deref().and_then(|h| {
        h.strip_suffix(domain)
            .and_then(|l| l.strip_suffix('.'))
            .map(str::to_string)
    });
    let Some(label) = label.filter(|l| l != API_LABEL) else {
        return next.run(req).await;
    };
    crate::request_id::set_route("{port}-{id}.<proxy domain>/{*path}");
    let parsed = label
        .split_once('-')
        .ok_or_else(|| {
            ApiError::new(
                ErrorKind::InvalidArgument,
                "invalid_host",
                format!("host {label:?}.{domain}: expected {{port}}-{{sandbox id}}.{domain}"),
            )
        })
        .and_then(|(port_raw, id)| {
            let port = split_route(&format!("/sandboxes/{id}/ports/{port_raw}"))?.1;
            Ok((port, id.to_string()))
        });
    let (port, id) = match parsed {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    if port == ENVD_PORT {
        crate::request_id::set_route("49983-{id}.<proxy domain>/{envd route}");
        return envd_by_host(&id, req, next)
            .await
            .unwrap_or_else(|e| e.into_response());
    }
    let result = async {
        let route = crate::e2b::ports::host_route_tenant(&state, &id, port, req.headers())?;
        let uri = req.uri().clone();
        let tail = uri.path().trim_start_matches('/').to_string();
        check_tail(&tail)?;
        let target = Target {
            id,
            port,
            host: route.host,
        };
        forward(state.clone(), route.tenant, target, tail, uri, req).await
    }
    .await;
    result.unwrap_or_else(|e| e.into_response())
}

/// Whether `path` is one of envd's routes (crate::e2b::router): Connect-RPC `process` and
/// `filesystem`, HTTP `/files` and `/health`.
fn is_envd_path(path: &str) -> bool {
    path.starts_with("/process.Process/")
        || path.starts_with("/filesystem.Filesystem/")
        || matches!(path, "/files" | "/health")
}

/// `49983-{id}.<domain>`: envd of sandbox `id`. The host names the sandbox, so the request's
/// `E2b-Sandbox-Id` is set to `id` whatever it said (a request for one sandbox's host never
/// acts on another's), and envd's own checks apply unchanged: the sandbox's `X-Access-Token`
/// (or a signed URL's signature), its owner's rate, E2B's pause. Paths other than envd's are
/// not served under such a name (404).
async fn envd_by_host(
    id: &str,
    mut req: Request,
    next: axum::middleware::Next,
) -> ApiResult<Response> {
    if !is_envd_path(req.uri().path()) {
        return Err(ApiError::new(
            ErrorKind::NotFound,
            "not_found",
            "no such route (a sandbox's envd host serves envd's routes only)",
        ));
    }
    let value = axum::http::HeaderValue::from_str(id).map_err(|_| {
        ApiError::new(
            ErrorKind::InvalidArgument,
            "invalid_host",
            "the sandbox id in the host is not a header value",
        )
    })?;
    req.headers_mut()
        .insert(HeaderName::from_static("e2b-sandbox-id"), value);
    Ok(next.run(req).await)
}

/// Counts a proxied request the sandbox answered and starts the client's answer: its status and
/// end-to-end headers.
fn answer_head<B>(resp: &hyper::Response<B>, woke: bool) -> axum::http::response::Builder {
    torpor_control::engine::count_proxied(if woke { "woke" } else { "served" });
    let mut out = Response::builder().status(resp.status());
    if let Some(h) = out.headers_mut() {
        copy_headers(resp.headers(), h);
    }
    out
}

fn bad_gateway(
    id: &SandboxId,
    port: u16,
    code: &'static str,
    e: impl std::fmt::Display,
) -> ApiError {
    ApiError::new(
        ErrorKind::BadGateway,
        code,
        format!("sandbox {id} port {port}: {e}"),
    )
}

async fn forward(
    state: Arc<ApiState>,
    tenant: TenantId,
    to: Target,
    tail: String,
    uri: axum::http::Uri,
    req: Request,
) -> ApiResult<Response> {
    let id = sandbox_id(&to.id)?;
    let port = to.port;
    let target = state.engine.proxy_target(&tenant, &id, port).await?;
    let unreachable = |e: &dyn std::fmt::Display| {
        torpor_control::engine::count_proxied("upstream_error");
        bad_gateway(&id, port, "upstream_unreachable", e)
    };
    let mut path = format!("/{tail}");
    if let Some(q) = uri.query() {
        path.push('?');
        path.push_str(q);
    }
    let mut req = req;
    let upgrade = wants_upgrade(req.headers());
    let on_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    let mut out_req = hyper::Request::builder()
        .method(parts.method)
        .uri(path)
        .header(
            axum::http::header::HOST,
            to.host.unwrap_or_else(|| target.host.clone()),
        );
    if let Some(h) = out_req.headers_mut() {
        copy_headers(&parts.headers, h);
        if upgrade {
            // The upgrade is between the client and the sandbox: pass its headers through.
            for name in [axum::http::header::CONNECTION, axum::http::header::UPGRADE] {
                if let Some(v) = parts.headers.get(&name) {
                    h.insert(name, v.clone());
                }
            }
        }
    }
    // A body only when the client sent one (with its length or chunked, as it came).
    let has_body = parts
        .headers
        .contains_key(axum::http::header::CONTENT_LENGTH)
        || parts
            .headers
            .contains_key(axum::http::header::TRANSFER_ENCODING);
    let out_req = out_req
        .body(if has_body { body } else { Body::empty() })
        .map_err(|e| ApiError::new(ErrorKind::InvalidArgument, "invalid_request", e.to_string()))?;

    // One connection per request. Whoever closes, the sandbox's stack keeps no endpoint that
    // would block its checkpoint (torpor_control::engine::sandbox_http).
    let io = target.connect().await.map_err(|e| unreachable(&e))?;
    let in_use = target.in_use;
    if !upgrade {
        // The connection task holds the borrow of the sandbox: no checkpoint until the answer
        // has been streamed out (or the client went away) and the connection is closed.
        let resp = torpor_control::engine::sandbox_http(io, out_req, in_use)
            .await
            .map_err(|e| unreachable(&e))?;
        return answer_head(&resp, target.woke)
            .body(Body::new(resp.into_body()))
            .map_err(|e| bad_gateway(&id, port, "upstream_invalid", e));
    }
    let (mut sender, conn) = torpor_control::engine::sandbox_handshake::<Body>(io)
        .await
        .map_err(|e| unreachable(&e))?;
    tokio::spawn(conn.with_upgrades());
    let resp = sender
        .send_request(out_req)
        .await
        .map_err(|e| unreachable(&e))?;
    let mut out = answer_head(&resp, target.woke);
    let (Some(on_upgrade), StatusCode::SWITCHING_PROTOCOLS) = (on_upgrade, resp.status()) else {
        // No upgrade after all: stream the answer, borrowing the sandbox meanwhile.
        let stream = Body::new(resp.into_body())
            .into_data_stream()
            .map(move |chunk| {
                let _ = &in_use;
                chunk
            });
        return out
            .body(Body::from_stream(stream))
            .map_err(|e| bad_gateway(&id, port, "upstream_invalid", e));
    };
    if let Some(h) = out.headers_mut() {
        for name in [axum::http::header::CONNECTION, axum::http::header::UPGRADE] {
            if let Some(v) = resp.headers().get(&name) {
                h.insert(name, v.clone());
            }
        }
    }
    let upstream = hyper::upgrade::on(resp).await.map_err(|e| {
        bad_gateway(
            &id,
            port,
            "upstream_invalid",
            format!("upgrade failed: {e}"),
        )
    })?;
    // Bytes both ways until either side closes; the sandbox stays borrowed (no checkpoint
    // under an open WebSocket).
    tokio::spawn(async move {
        let _in_use = in_use;
        let Ok(client) = on_upgrade.await else { return };
        let mut client = hyper_util::rt::TokioIo::new(client);
        let mut upstream = hyper_util::rt::TokioIo::new(upstream);
        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
    });
    out.body(Body::empty())
        .map_err(|e| bad_gateway(&id, port, "upstream_invalid", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envd_hosts_serve_envd_routes_only() {
        for p in [
            "/process.Process/Start",
            "/filesystem.Filesystem/Stat",
            "/files",
            "/health",
        ] {
            assert!(is_envd_path(p), "{p}");
        }
        for p in [
            "/v1/sandboxes",
            "/sandboxes",
            "/files/x",
            "/healthz",
            "/",
            "/metrics",
        ] {
            assert!(!is_envd_path(p), "{p}");
        }
    }

    #[test]
    fn routes_split_and_escapes_are_refused() {
        let (id, port, tail) = split_route("/v1/sandboxes/sb-1/ports/8080/a/b.txt")
            .ok()
            .unwrap();
        assert_eq!(
            (id.as_str(), port, tail.as_str()),
            ("sb-1", 8080, "a/b.txt")
        );
        assert_eq!(split_route("/sandboxes/x/ports/1").ok().unwrap().2, "");
        for bad in ["0", "65536", "-1", "http", ""] {
            let e = split_route(&format!("/v1/sandboxes/x/ports/{bad}/"))
                .err()
                .unwrap();
            assert_eq!(e.code(), "invalid_port", "{bad}");
        }
        for bad in ["..", "a/../..", "%2e%2E/x", "a%2fb", "a\\b", ".", "x/%00"] {
            let e = split_route(&format!("/v1/sandboxes/x/ports/80/{bad}"))
                .err()
                .unwrap();
            assert_eq!(e.code(), "invalid_path", "{bad}");
        }
    }
}
