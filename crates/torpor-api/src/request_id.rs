//! The request context: every response carries `x-request-id`, every request runs in one
//! tracing span holding it, and what the edge decides on the way (who the caller is, headers
//! for the response such as the rate-limit state) is put on the response here, in one place.
//!
//! The span (`request`) carries `request_id`, `method`, `route` (the matched route template,
//! e.g. `/v1/sandboxes/{id}/exec`, never the raw path) and `tenant` (recorded once the caller
//! is known, [`set_caller`]); everything logged while the request is handled is inside it, and
//! its last line is one event with the status and the duration (`warn` for a server error,
//! `info` otherwise), so `TORPOR_LOG=info` shows one line per request.
//!
//! The id is the client's own `x-request-id` when it is well formed (1–64 characters of
//! `[A-Za-z0-9._-]`), else a fresh one. Handlers reach the context through a task-local
//! ([`current_id`], [`set_caller`], [`add_response_headers`]): it lives as long as the
//! handler's future, so a task the handler spawns does not see it (nothing needs it there).
//!
//! A leaf: it knows nothing of the API's other modules.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use torpor_core::TenantId;
use tracing::Instrument;

pub const HEADER: HeaderName = HeaderName::from_static("x-request-id");
/// The longest client-supplied id kept.
pub const MAX_LEN: usize = 64;
/// The `route` of a request no route matched.
pub const NO_ROUTE: &str = "-";

/// What the edge learnt about the request while serving it.
#[derive(Default)]
struct Learnt {
    caller: Option<TenantId>,
    /// Headers the response gets (`RateLimit-*`, ...), whatever answers it.
    headers: HeaderMap,
}

#[derive(Clone)]
struct Ctx {
    id: Arc<str>,
    span: tracing::Span,
    learnt: Arc<Mutex<Learnt>>,
}

tokio::task_local! {
    static CTX: Ctx;
}

/// Whether a client's id is kept as it is.
pub fn well_formed(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A fresh id: `req-` and 16 random characters (80 bits, torpor's id generator).
pub fn generate() -> String {
    let raw = torpor_core::SandboxId::generate();
    format!("req-{}", raw.as_str().trim_start_matches("sb-"))
}

/// The id of the request being served (`-` outside one, e.g. in a unit test).
pub fn current_id() -> String {
    CTX.try_with(|c| c.id.to_string())
        .unwrap_or_else(|_| "-".into())
}

/// Records who the caller is (its bearer or API key resolved), also as the span's `tenant`.
pub fn set_caller(tenant: &TenantId) {
    let _ = CTX.try_with(|c| {
        c.span.record("tenant", tracing::field::display(tenant));
        c.learnt.lock().unwrap_or_else(|p| p.into_inner()).caller = Some(tenant.clone());
    });
}

/// The caller recorded by [`set_caller`], if any.
pub fn caller() -> Option<TenantId> {
    CTX.try_with(|c| {
        c.learnt
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .caller
            .clone()
    })
    .ok()
    .flatten()
}

/// Names the route of a request no route table matched (host-based proxying): the span's
/// `route`, a template, never the raw host or path.
pub fn set_route(template: &'static str) {
    let _ = CTX.try_with(|c| {
        c.span.record("route", tracing::field::display(template));
    });
}

/// Headers the response gets whatever answers it (the rate-limit state: `RateLimit-*`, and
/// `Retry-After` when refused). Later ones replace earlier ones of the same name.
pub fn add_response_headers(headers: HeaderMap) {
    let _ = CTX.try_with(|c| {
        let mut l = c.learnt.lock().unwrap_or_else(|p| p.into_inner());
        for (name, value) in headers {
            if let Some(name) = name {
                l.headers.insert(name, value);
            }
        }
    });
}

/// The caller [`set_caller`] recorded, on the response (for the audit layer outside this one,
/// which would otherwise resolve the credentials again: a store read on every audited call).
#[derive(Debug, Clone)]
pub struct Caller(pub TenantId);

/// The outermost layer: the id, the span, the closing log line and the headers of what was
/// learnt. Added with `Router::layer`, it runs once the route is matched (`MatchedPath`).
pub async fn request_context(mut req: Request, next: Next) -> Response {
    let started = Instant::now();
    let id = req
        .headers()
        .get(&HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| well_formed(v))
        .map(str::to_string)
        .unwrap_or_else(generate);
    // Handlers downstream (and the proxy, which forwards it) see the id that was chosen.
    if let Ok(v) = HeaderValue::from_str(&id) {
        req.headers_mut().insert(HEADER, v);
    }
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or(NO_ROUTE, |m| m.as_str())
        .to_string();
    let span = tracing::info_span!(
        "request",
        request_id = %id,
        method = %req.method(),
        route = %route,
        tenant = tracing::field::Empty,
        // A W3C trace context (55 characters): the trace exporter continues the client's trace.
        traceparent = req.headers().get("traceparent").and_then(|v| v.to_str().ok()).filter(|v| v.len() == 55),
    );
    let ctx = Ctx {
        id: id.as_str().into(),
        span: span.clone(),
        learnt: Arc::default(),
    };
    let learnt = ctx.learnt.clone();
    let mut resp = CTX.scope(ctx, next.run(req).instrument(span.clone())).await;
    let status = resp.status().as_u16();
    let duration_ms = started.elapsed().as_secs_f64() * 1000.0;
    span.in_scope(|| {
        if resp.status().is_server_error() {
            tracing::warn!(status, duration_ms, "request answered with a server error");
        } else {
            tracing::info!(status, duration_ms, "request answered");
        }
    });
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&id) {
        h.insert(HEADER, v);
    }
    let (learnt, caller) = {
        let mut l = learnt.lock().unwrap_or_else(|p| p.into_inner());
        (std::mem::take(&mut l.headers), l.caller.take())
    };
    for (name, value) in learnt {
        if let Some(name) = name {
            h.insert(name, value);
        }
    }
    if let Some(tenant) = caller {
        resp.extensions_mut().insert(Caller(tenant));
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_ids_are_kept_only_when_well_formed() {
        assert!(well_formed("abc-DEF_1.2"));
        assert!(well_formed(&"x".repeat(64)));
        assert!(!well_formed(&"x".repeat(65)));
        assert!(!well_formed(""));
        assert!(!well_formed("a b"));
        assert!(!well_formed("a\nb"));
        assert!(!well_formed("é"));
        let g = generate();
        assert!(well_formed(&g), "{g}");
        assert_ne!(generate(), g);
    }

    /// A writer the test's subscriber logs into.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    async fn serve_one(app: axum::Router) -> reqwest::Response {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        reqwest::Client::new()
            .get(format!("http://{addr}/things/raw-thing-42?q=1"))
            .header("x-request-id", "req-test-1")
            .send()
            .await
            .unwrap()
    }

    #[test]
    fn each_request_logs_in_one_span_with_its_route_template_tenant_and_a_closing_line() {
        use axum::extract::Path;
        async fn handler(Path(_id): Path<String>) -> &'static str {
            set_caller(&TenantId::new("t1").unwrap());
            let mut h = HeaderMap::new();
            h.insert("ratelimit-remaining", HeaderValue::from(7));
            add_response_headers(h);
            tracing::info!("handling the thing");
            "ok"
        }
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish();
        let resp = tracing::subscriber::with_default(subscriber, || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let app = axum::Router::new()
                    .route("/things/{id}", axum::routing::get(handler))
                    .layer(axum::middleware::from_fn(request_context));
                let resp = serve_one(app).await;
                (
                    resp.status().as_u16(),
                    resp.headers().get("x-request-id").cloned(),
                    resp.headers().get("ratelimit-remaining").cloned(),
                )
            })
        });
        assert_eq!(resp.0, 200);
        assert_eq!(resp.1.unwrap(), "req-test-1");
        assert_eq!(resp.2.unwrap(), "7");
        let log = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = log.lines().filter(|l| l.contains("req-test-1")).collect();
        let span = "request{request_id=req-test-1 method=GET route=/things/{id} tenant=t1}";
        let handling = lines.iter().find(|l| l.contains("handling the thing"));
        assert!(handling.is_some_and(|l| l.contains(span)), "{log}");
        let closing: Vec<_> = lines
            .iter()
            .filter(|l| l.contains("request answered"))
            .collect();
        assert_eq!(closing.len(), 1, "{log}");
        assert!(closing[0].contains(span), "{log}");
        assert!(closing[0].contains("status=200"), "{log}");
        assert!(closing[0].contains("duration_ms="), "{log}");
        // The route is the template: the raw path (an id, a query) is not in the span.
        assert!(!log.contains("raw-thing-42"), "{log}");
    }

    #[tokio::test]
    async fn the_context_is_seen_inside_the_scope_only() {
        assert_eq!(current_id(), "-");
        let ctx = Ctx {
            id: "r1".into(),
            span: tracing::Span::none(),
            learnt: Arc::default(),
        };
        CTX.scope(ctx, async {
            assert_eq!(current_id(), "r1");
            set_caller(&TenantId::admin());
            assert_eq!(caller(), Some(TenantId::admin()));
        })
        .await;
        assert_eq!(caller(), None);
    }
}
