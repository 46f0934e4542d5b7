//! Cluster mode: a call for a sandbox that another controller holds is forwarded to that
//! controller, whole (method, path, headers, body streamed both ways), so every controller
//! answers for every sandbox. Which controller holds a sandbox, and taking over those of a dead
//! controller, is the engine's (`torpor_control::engine` cluster module, [`Engine::route`]).
//!
//! - The sandbox a request names is found the way the routes name it: `/v1/sandboxes/{id}…`,
//!   E2B's `/sandboxes/{id}…` and `/v2/sandboxes/{id}…`, the `E2b-Sandbox-Id` header (envd
//!   routes) and host names `{port}-{id}.<proxy domain>`.
//! - One hop: a forwarded request carries [`FORWARDED_BY`], and a controller never forwards
//!   such a request again (it serves it, and a wake that lost a race answers
//!   `409 sandbox_elsewhere`, retryable). The caller's own credentials travel with it and are
//!   checked by the holder as they would be here: forwarding adds no authority.
//! - The wire: HTTP/2 over mutual TLS to the holder's peer listener ([`PeerClients`], in
//!   cluster mode torpor_cluster's `peer`), whose certificate must name that holder, so the
//!   caller's token reaches that controller or nobody. A holder that advertises no peer
//!   listener (built before it: a rolling upgrade) is reached over plain HTTP at its API
//!   address, as before, with a warning in the log.
//! - Two controllers may try to wake one sleeping sandbox at once; the engine lets one win
//!   and the other hears `sandbox_elsewhere` naming the winner. A request whose body was small
//!   enough to keep ([`REPLAY_LIMIT`]) is then forwarded to the winner; a larger one answers
//!   `409 sandbox_elsewhere` with `Retry-After`, and its retry is forwarded up front.
//! - A holder whose listener refuses the connection (nothing was sent) may have just stopped
//!   and handed its sandboxes off (`torpor controller --on-stop hand-off`) or died: a kept
//!   request is routed again with the live controllers read afresh, and served here (taking
//!   the sandbox over) once the holder is gone; while it is still counted alive the call
//!   answers `503 controller_unavailable` with `Retry-After`.
//! - A read of a sandbox's record (`GET /v1/sandboxes/{id}`, E2B's `GET /sandboxes/{id}`)
//!   whose takeover cannot be settled yet (the dead holder's container runs on a worker that
//!   has not joined this controller: `sandbox_busy`) is answered here from the store: the
//!   record needs no container. Every other call waits for the takeover.
//! - Upgrades (WebSockets to a sandbox port) are not forwarded: they answer
//!   `409 sandbox_elsewhere` unless they reach the holder (a load balancer with affinity, or
//!   the holder's own address).
//!
//! [`Engine::route`]: torpor_control::Engine::route

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::TryStreamExt;
use torpor_control::engine::Route;
use torpor_control::error::ErrorKind;
use torpor_control::store::LiveController;
use torpor_core::SandboxId;

use crate::errors::ApiError;
use crate::state::ApiState;

/// Set on a forwarded request: the forwarding controller's name.
pub const FORWARDED_BY: &str = "x-torpor-forwarded-by";
/// Set (a response extension, never sent) on an answer whose sandbox another controller won:
/// that controller.
#[derive(Debug, Clone)]
pub(crate) struct HeldAt(pub LiveController);

/// Clients to the other controllers' peer listeners (cluster mode).
pub trait PeerClients: Send + Sync {
    /// An HTTPS client that reaches the controller `name` and no other (its certificate is
    /// checked for that identity); the error says why none can be built.
    fn client_for(&self, name: &str) -> Result<reqwest::Client, String>;
}
/// Largest request body kept to be sent again to the controller that won a wake race.
pub const REPLAY_LIMIT: usize = 1 << 20;
/// How long a forwarded request may take to get its answer's head.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(300);

/// Headers that belong to one connection, not to the request (RFC 9110 §7.6.1).
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    HeaderName::from_static("keep-alive"),
];

/// The plain HTTP client, for a holder built before the peer listener.
fn plain_client() -> &'static reqwest::Client {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(5))
            // Below the other controller's idle close (crate::client::POOL_IDLE says why).
            .pool_idle_timeout(crate::client::POOL_IDLE)
            .build()
            .expect("a plain HTTP client builds")
    })
}

/// The forwarding layer (outermost of the API router in cluster mode).
pub async fn forward(State(state): State<Arc<ApiState>>, req: Request, next: Next) -> Response {
    let Some(me) = state.engine.controller_name().map(str::to_string) else {
        return next.run(req).await;
    };
    let Some(id) = sandbox_in(&req) else {
        return next.run(req).await;
    };
    if req.headers().contains_key(FORWARDED_BY) {
        return next.run(req).await;
    }
    match state.engine.route(&id).await {
        Ok(Route::Local) => {}
        Ok(Route::Forward(holder)) => {
            tracing::debug!(sandbox = %id, controller = %holder.name, "forwarding a call to the sandbox's controller");
            return forward_to(&state, &me, &id, holder, req, next).await;
        }
        Err(e) if e.kind() == ErrorKind::Busy && reads_the_record(&req) => {
            tracing::debug!(sandbox = %id, error = %e, "the record read here while its takeover waits");
        }
        Err(e) => return ApiError::from(e).into_response(),
    }
    // Served here; keep a small body in case a concurrent wake on another controller wins.
    let (parts, body) = req.into_parts();
    if !replayable(&parts) {
        let resp = next.run(Request::from_parts(parts, body)).await;
        return without_held_at(resp);
    }
    let kept = match Kept::take(parts, body).await {
        Ok(k) => k,
        Err(resp) => return resp,
    };
    let resp = next.run(kept.request()).await;
    let Some(HeldAt(holder)) = resp.extensions().get::<HeldAt>().cloned() else {
        return resp;
    };
    tracing::debug!(sandbox = %id, controller = %holder.name, "another controller won the wake; forwarding");
    send(&state, &me, &holder, kept.request())
        .await
        .unwrap_or_else(|unsent| unsent.0)
}

/// Forwards a call to `holder`. When nothing could be sent (its listener refuses the
/// connection: it has just stopped, handing its sandboxes off, or died) and the request was
/// kept, the route is read again with fresh liveness: a holder that is gone is taken over and
/// the call served here, one that moved is forwarded there; a holder still counted alive
/// answers `503 controller_unavailable` as before.
async fn forward_to(
    state: &ApiState,
    me: &str,
    id: &SandboxId,
    holder: LiveController,
    req: Request,
    next: Next,
) -> Response {
    let (parts, body) = req.into_parts();
    if !replayable(&parts) {
        return send(state, me, &holder, Request::from_parts(parts, body))
            .await
            .unwrap_or_else(|unsent| unsent.0);
    }
    let kept = match Kept::take(parts, body).await {
        Ok(k) => k,
        Err(resp) => return resp,
    };
    let unsent = match send(state, me, &holder, kept.request()).await {
        Ok(resp) => return resp,
        Err(unsent) => unsent,
    };
    match state.engine.route_afresh(id).await {
        Ok(Route::Local) => {
            tracing::info!(sandbox = %id, controller = %holder.name, "the sandbox's controller is gone; served here");
            without_held_at(next.run(kept.request()).await)
        }
        Ok(Route::Forward(now)) if now != holder => send(state, me, &now, kept.request())
            .await
            .unwrap_or_else(|unsent| unsent.0),
        Ok(Route::Forward(_)) => unsent.0,
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// Whether a request is kept whole to be sent again (a small body, no upgrade).
fn replayable(parts: &axum::http::request::Parts) -> bool {
    let small = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(
            matches!(parts.method, Method::GET | Method::HEAD | Method::DELETE),
            |n| n <= REPLAY_LIMIT,
        );
    small && !parts.headers.contains_key(header::UPGRADE)
}

/// A request kept to be sent again ([`REPLAY_LIMIT`]).
struct Kept {
    parts: axum::http::request::Parts,
    body: bytes::Bytes,
}

impl Kept {
    async fn take(parts: axum::http::request::Parts, body: Body) -> Result<Kept, Response> {
        let body = axum::body::to_bytes(body, REPLAY_LIMIT)
            .await
            .map_err(|_| {
                ApiError::new(
                    ErrorKind::PayloadTooLarge,
                    "payload_too_large",
                    "the request body is larger than its Content-Length said",
                )
                .into_response()
            })?;
        Ok(Kept { parts, body })
    }

    fn request(&self) -> Request {
        Request::from_parts(self.parts.clone(), Body::from(self.body.clone()))
    }
}

fn without_held_at(mut resp: Response) -> Response {
    resp.extensions_mut().remove::<HeldAt>();
    resp
}

/// The sandbox a request is about, if it names one.
/// `GET /v1/sandboxes/{id}` or E2B's `GET /sandboxes/{id}`: the record, nothing more.
fn reads_the_record(req: &Request) -> bool {
    if req.method() != Method::GET {
        return false;
    }
    let path = req.uri().path().trim_end_matches('/');
    ["/v1/sandboxes/", "/sandboxes/"]
        .iter()
        .filter_map(|prefix| path.strip_prefix(prefix))
        .any(|id| !id.is_empty() && !id.contains('/'))
}

fn sandbox_in(req: &Request) -> Option<SandboxId> {
    let path = req.uri().path();
    let from_path = ["/v1/sandboxes/", "/v2/sandboxes/", "/sandboxes/"]
        .iter()
        .find_map(|prefix| path.strip_prefix(prefix))
        .map(|rest| rest.split('/').next().unwrap_or_default())
        .filter(|id| !id.is_empty() && *id != "metrics");
    if let Some(id) = from_path {
        return SandboxId::new(id).ok();
    }
    if let Some(id) = req
        .headers()
        .get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
    {
        return SandboxId::new(id).ok();
    }
    let host = req.headers().get(header::HOST)?.to_str().ok()?;
    let name = host.rsplit_once(':').map_or(host, |(n, _)| n);
    let label = name
        .to_ascii_lowercase()
        .strip_suffix(crate::domain::proxy_domain())?
        .strip_suffix('.')?
        .to_string();
    let (_port, id) = label.split_once('-')?;
    SandboxId::new(id).ok()
}

/// An answer for a request that was never sent (no connection to the holder could be made).
struct Unsent(Response);

/// Sends `req` to the controller `holder` and streams its answer back; [`Unsent`] when no
/// connection could be made, so nothing of it reached the holder.
async fn send(
    state: &ApiState,
    me: &str,
    holder: &LiveController,
    req: Request,
) -> Result<Response, Unsent> {
    let (parts, body) = req.into_parts();
    if parts.headers.contains_key(header::UPGRADE) {
        return Ok(ApiError::new(
            ErrorKind::Busy,
            "sandbox_elsewhere",
            "this sandbox is served by another controller; upgrades are not forwarded, retry \
             through the controller that holds it",
        )
        .with_retry_after(1)
        .into_response());
    }
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let unavailable = || {
        ApiError::new(
            ErrorKind::Unavailable,
            "controller_unavailable",
            "the controller that holds this sandbox does not answer; retry (it is taken \
             over once its lease expires)",
        )
        .with_retry_after(1)
        .into_response()
    };
    let (client, url) = match (&holder.peer_addr, &state.peers) {
        (Some(peer), Some(peers)) => match peers.client_for(&holder.name) {
            Ok(c) => (c, format!("https://{peer}{path}")),
            Err(e) => {
                tracing::error!(controller = %holder.name, error = %e, "no client for the controller's peer listener");
                return Err(Unsent(unavailable()));
            }
        },
        _ => {
            tracing::warn!(controller = %holder.name, api_addr = %holder.api_addr,
                "forwarding over plain HTTP: the controller advertises no peer listener \
                 (built before it; upgrade it)");
            (
                plain_client().clone(),
                format!("http://{}{path}", holder.api_addr),
            )
        }
    };
    let mut headers = HeaderMap::new();
    for (name, value) in &parts.headers {
        if !HOP_BY_HOP.contains(name) && name != header::CONTENT_LENGTH {
            headers.append(name.clone(), value.clone());
        }
    }
    if let Ok(v) = HeaderValue::from_str(me) {
        headers.insert(FORWARDED_BY, v);
    }
    let stream = body.into_data_stream();
    let sent = client
        .request(parts.method, &url)
        .headers(headers)
        .timeout(FORWARD_TIMEOUT)
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await;
    let upstream = match sent {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(controller = %holder.name, %url, error = %e, "cannot forward a call to the sandbox's controller");
            return if e.is_connect() {
                Err(Unsent(unavailable()))
            } else {
                Ok(unavailable())
            };
        }
    };
    let mut resp = Response::builder().status(upstream.status());
    for (name, value) in upstream.headers() {
        if !HOP_BY_HOP.contains(name) {
            resp = resp.header(name, value);
        }
    }
    let body = Body::from_stream(upstream.bytes_stream().map_err(std::io::Error::other));
    Ok(resp.body(body).unwrap_or_else(|_| {
        ApiError::new(
            ErrorKind::Internal,
            "internal",
            "the forwarded answer could not be relayed",
        )
        .into_response()
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(path: &str, headers: &[(&str, &str)]) -> Request {
        let mut b = Request::builder().uri(path);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(Body::empty()).unwrap()
    }

    #[test]
    fn the_sandbox_is_found_where_each_route_names_it() {
        let id = SandboxId::generate();
        let s = id.as_str();
        for path in [
            format!("/v1/sandboxes/{s}"),
            format!("/v1/sandboxes/{s}/exec"),
            format!("/sandboxes/{s}/pause"),
            format!("/v2/sandboxes/{s}/connect"),
        ] {
            assert_eq!(sandbox_in(&req(&path, &[])), Some(id.clone()), "{path}");
        }
        assert_eq!(
            sandbox_in(&req("/process.Process/Start", &[("e2b-sandbox-id", s)])),
            Some(id.clone())
        );
        let host = format!("8080-{s}.{}", crate::domain::proxy_domain());
        assert_eq!(sandbox_in(&req("/x", &[("host", &host)])), Some(id.clone()));
        for other in [
            "/v1/sandboxes",
            "/v1/sandboxes/",
            "/sandboxes/metrics",
            "/v1/templates/x",
            "/healthz",
        ] {
            assert_eq!(sandbox_in(&req(other, &[])), None, "{other}");
        }
        assert_eq!(sandbox_in(&req("/v1/sandboxes/..%2f", &[])), None);
    }

    #[test]
    fn only_a_get_of_the_record_itself_reads_the_record() {
        let s = SandboxId::generate();
        let with = |method: Method, path: String| {
            let mut r = req(&path, &[]);
            *r.method_mut() = method;
            r
        };
        for path in [format!("/v1/sandboxes/{s}"), format!("/sandboxes/{s}")] {
            assert!(reads_the_record(&with(Method::GET, path.clone())), "{path}");
            assert!(
                !reads_the_record(&with(Method::DELETE, path.clone())),
                "{path}"
            );
        }
        for path in [
            format!("/v1/sandboxes/{s}/files?path=/etc/hostname"),
            format!("/v1/sandboxes/{s}/exec"),
            format!("/sandboxes/{s}/metrics"),
            format!("/v2/sandboxes/{s}/connect"),
            "/v1/sandboxes/".to_string(),
        ] {
            assert!(
                !reads_the_record(&with(Method::GET, path.clone())),
                "{path}"
            );
        }
    }
}
