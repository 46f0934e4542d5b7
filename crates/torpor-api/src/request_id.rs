//! The request context: every response carries `x-request-id`, every request runs in a tracing
//! span holding it, and what the edge decides on the way (who the caller is, its rate-limit
//! state) is put on the response here, in one place.
//!
//! The id is the client's own `x-request-id` when it is well formed (1–64 characters of
//! `[A-Za-z0-9._-]`), else a fresh one. Handlers reach the context through a task-local
//! ([`current_id`], [`set_caller`], [`set_rate`]): it lives as long as the handler's future, so a
//! task the handler spawns does not see it (nothing needs it there).

use std::sync::{Arc, Mutex};

use axum::extract::Request;
use axum::http::{HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use torpor_core::TenantId;
use tracing::Instrument;

use crate::ratelimit::Decision;

pub const HEADER: HeaderName = HeaderName::from_static("x-request-id");
/// The longest client-supplied id kept.
pub const MAX_LEN: usize = 64;

/// What the edge learnt about the request while serving it.
#[derive(Default)]
struct Learnt {
    caller: Option<TenantId>,
    rate: Option<Decision>,
}

#[derive(Clone)]
struct Ctx {
    id: Arc<str>,
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

/// Records who the caller is (its bearer or API key resolved).
pub fn set_caller(tenant: &TenantId) {
    let _ = CTX.try_with(|c| {
        c.learnt.lock().unwrap_or_else(|p| p.into_inner()).caller = Some(tenant.clone())
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

/// Records the rate-limit state of the request: its `RateLimit-*` headers (and `Retry-After`
/// when refused) go on the response.
pub fn set_rate(d: Decision) {
    let _ = CTX.try_with(|c| c.learnt.lock().unwrap_or_else(|p| p.into_inner()).rate = Some(d));
}

/// The outermost layer: the id, the span, and the headers of what was learnt.
pub async fn request_context(mut req: Request, next: Next) -> Response {
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
    let span = tracing::info_span!(
        "request",
        request_id = %id,
        method = %req.method(),
        path = %req.uri().path(),
    );
    let ctx = Ctx {
        id: id.as_str().into(),
        learnt: Arc::default(),
    };
    let learnt = ctx.learnt.clone();
    let mut resp = CTX.scope(ctx, next.run(req).instrument(span.clone())).await;
    let status = resp.status();
    if status.is_server_error() {
        span.in_scope(|| tracing::warn!(request_id = %id, status = status.as_u16(), "request answered with a server error"));
    }
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&id) {
        h.insert(HEADER, v);
    }
    let rate = learnt.lock().unwrap_or_else(|p| p.into_inner()).rate.take();
    if let Some(d) = rate {
        d.write_headers(h);
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

    #[tokio::test]
    async fn the_context_is_seen_inside_the_scope_only() {
        assert_eq!(current_id(), "-");
        let ctx = Ctx {
            id: "r1".into(),
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
