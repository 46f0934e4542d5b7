//! The axum middleware that decides which calls are recorded and with what: route template,
//! object, actor, status and stable error code.

use super::*;

pub(super) const ROUTES: &[&str] = &[
    "/v1/tenants",
    "/v1/tenants/{name}",
    "/v1/workers",
    "/v1/gpus",
    "/v1/openapi.json",
    "/v1/templates",
    "/v1/templates/{name}",
    "/v1/templates/{name}/image",
    "/v1/sandboxes",
    "/v1/sandboxes/{id}",
    "/v1/sandboxes/{id}/network",
    "/v1/sandboxes/{id}/ports/{port}",
    "/v1/sandboxes/{id}/ports/{port}/{*path}",
    "/v1/sandboxes/{id}/exec",
    "/v1/sandboxes/{id}/files",
    "/v1/sandboxes/{id}/suspend",
    "/v1/sandboxes/{id}/resume",
    "/v1/sandboxes/{id}/fork",
    "/v1/snapshots",
    "/v1/snapshots/stats",
    "/v1/snapshots/gc",
    "/v1/snapshots/verify",
    "/v1/snapshots/{id}",
    "/v1/snapshots/{id}/verify",
    "/v1/pools",
    "/v1/pools/{name}",
    "/sandboxes",
    "/v2/sandboxes",
    "/sandboxes/{id}",
    "/sandboxes/{id}/connect",
    "/v2/sandboxes/{id}/connect",
    "/sandboxes/{id}/resume",
    "/sandboxes/{id}/pause",
    "/sandboxes/{id}/timeout",
    "/sandboxes/{id}/network",
    "/process.Process/{method}",
    "/filesystem.Filesystem/{method}",
    "/files",
    "/health",
    "/healthz",
    "/metrics",
];

/// What the log says of a request's path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RouteInfo {
    pub(super) template: String,
    pub(super) object: Option<Object>,
    /// The proxy: the answer is the sandbox's, its body is not read.
    pub(super) proxied: bool,
    /// envd: the sandbox is named by `E2b-Sandbox-Id`, the caller by its access token.
    pub(super) envd: bool,
}

/// A name copied from a path or header, or `(invalid)` when it is long or has characters no
/// torpor name has (so nothing a caller smuggles in lands in the log).
pub(super) fn clean_name(raw: &str) -> String {
    if !raw.is_empty()
        && raw.len() <= MAX_NAME
        && raw
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        raw.to_string()
    } else {
        "(invalid)".to_string()
    }
}

pub(super) fn object_kind(collection: &str) -> Option<&'static str> {
    Some(match collection {
        "sandboxes" => "sandbox",
        "templates" => "template",
        "tenants" => "tenant",
        "pools" => "pool",
        "snapshots" => "snapshot",
        _ => return None,
    })
}

/// Matches `path` against one template; the object is the parameter after a collection.
pub(super) fn match_template(
    template: &str,
    path: &str,
) -> Option<(Option<Object>, Option<String>)> {
    let mut pat = template.split('/').skip(1);
    let mut segs = path.split('/').skip(1);
    let mut object = None;
    let mut rpc = None;
    let mut previous = "";
    loop {
        match (pat.next(), segs.next()) {
            (None, None) => return Some((object, rpc)),
            (Some(p), _) if p.starts_with("{*") => return Some((object, rpc)),
            (Some(p), Some(s)) if p.starts_with('{') => {
                if s.is_empty() {
                    return None;
                }
                if p == "{method}" {
                    rpc = Some(s.to_string());
                } else if let Some(kind) = object_kind(previous) {
                    object = Some(Object {
                        kind: kind.into(),
                        name: clean_name(s),
                    });
                }
                previous = p;
            }
            (Some(p), Some(s)) if p == s => previous = p,
            _ => return None,
        }
    }
}

/// The route of a request: host-based routing first (as the proxy sees it), then the table.
pub(super) fn classify(
    host: Option<&str>,
    path: &str,
    envd_sandbox: Option<&str>,
) -> Option<RouteInfo> {
    let domain = crate::proxy::proxy_domain();
    let label = host
        .map(|h| {
            h.rsplit_once(':')
                .map_or(h, |(name, _)| name)
                .to_ascii_lowercase()
        })
        .and_then(|h| {
            h.strip_suffix(domain)
                .and_then(|l| l.strip_suffix('.'))
                .map(str::to_string)
        });
    if let Some(label) = label {
        return Some(RouteInfo {
            template: format!("{{port}}-{{id}}.{domain}/{{*path}}"),
            object: label.split_once('-').map(|(_, id)| Object {
                kind: "sandbox".into(),
                name: clean_name(id),
            }),
            proxied: true,
            envd: false,
        });
    }
    for template in ROUTES {
        let Some((mut object, rpc)) = match_template(template, path) else {
            continue;
        };
        let envd = template.starts_with("/process.")
            || template.starts_with("/filesystem.")
            || *template == "/files"
            || *template == "/health";
        if envd {
            object = envd_sandbox.map(|id| Object {
                kind: "sandbox".into(),
                name: clean_name(id),
            });
        }
        let template = match rpc {
            Some(m)
                if !m.is_empty() && m.len() <= 40 && m.bytes().all(|b| b.is_ascii_alphabetic()) =>
            {
                template.replace("{method}", &m)
            }
            _ => template.to_string(),
        };
        return Some(RouteInfo {
            proxied: template.contains("/ports/{port}"),
            template,
            object,
            envd,
        });
    }
    None
}

/// The credential headers of a request (cheap clones), kept to name the actor afterwards.
pub(super) struct Credentials {
    pub(super) authorization: Option<HeaderValue>,
    pub(super) api_key: Option<HeaderValue>,
    pub(super) access_token: Option<HeaderValue>,
    pub(super) envd_sandbox: Option<HeaderValue>,
    pub(super) host: Option<HeaderValue>,
}

impl Credentials {
    pub(super) fn of(h: &HeaderMap) -> Credentials {
        Credentials {
            authorization: h.get(header::AUTHORIZATION).cloned(),
            api_key: h.get("x-api-key").cloned(),
            access_token: h.get("x-access-token").cloned(),
            envd_sandbox: h.get("e2b-sandbox-id").cloned(),
            host: h.get(header::HOST).cloned(),
        }
    }
}

pub(super) fn header_str(v: &Option<HeaderValue>) -> Option<&str> {
    v.as_ref()
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

/// Who made the call: the tenant (or admin) of the token it carried, the owner of the sandbox
/// whose envd access token it carried, or `anonymous`.
pub(super) fn actor_of(state: &Arc<ApiState>, creds: &Credentials, route: &RouteInfo) -> String {
    let token = header_str(&creds.authorization)
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .or_else(|| header_str(&creds.api_key));
    if let Some(token) = token {
        if constant_time_eq(token.as_bytes(), state.admin_token.as_bytes()) {
            return TenantId::admin().as_str().to_string();
        }
        return match state.engine.tenant_for_token(token) {
            Ok(Some(t)) => t.as_str().to_string(),
            _ => ANONYMOUS.into(),
        };
    }
    if route.envd {
        let id = header_str(&creds.envd_sandbox).and_then(|id| SandboxId::new(id).ok());
        if let (Some(id), Some(token)) = (id, header_str(&creds.access_token)) {
            let expected = crate::e2b::E2b::new(state.clone()).access_token(&id);
            if constant_time_eq(token.as_bytes(), expected.as_bytes()) {
                if let Ok(rec) = state.engine.sandbox(&TenantId::admin(), &id) {
                    return rec.tenant.as_str().to_string();
                }
            }
        }
    }
    ANONYMOUS.into()
}

/// A request id fit for the log (the edge sets it; a stray header must not smuggle text in).
pub(super) fn request_id_of(resp: &Response) -> Option<String> {
    let v = resp.headers().get("x-request-id")?.to_str().ok()?;
    (!v.is_empty()
        && v.len() <= MAX_NAME
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':')))
    .then(|| v.to_string())
}

/// The stable code of an error body (`{"error":{"code":..}}`, or Connect's `{"code":..}`);
/// only codes (lowercase words), never a message.
pub(super) fn error_code_of(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let code = v
        .get("error")
        .and_then(|e| e.get("code"))
        .or_else(|| v.get("code"))?
        .as_str()?;
    (!code.is_empty()
        && code.len() <= 64
        && code
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'))
    .then(|| code.to_string())
}

/// Reads the code of a small JSON error answer and puts the body back as it was.
pub(super) async fn with_error_code(resp: Response) -> (Response, Option<String>) {
    let json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/json"));
    let small = HttpBody::size_hint(resp.body())
        .exact()
        .is_some_and(|n| n <= MAX_ERROR_BODY);
    if !(json && small) {
        return (resp, None);
    }
    let (parts, body) = resp.into_parts();
    match axum::body::to_bytes(body, MAX_ERROR_BODY as usize).await {
        Ok(bytes) => {
            let code = error_code_of(&bytes);
            (Response::from_parts(parts, Body::from(bytes)), code)
        }
        Err(_) => (Response::from_parts(parts, Body::empty()), None),
    }
}

/// Whether a call goes in the log: a mutating method on a known route, or a refusal (401, 403,
/// 429; 404 on a route that names an object).
pub(super) fn audited(method: &Method, status: u16, route: Option<&RouteInfo>) -> bool {
    let mutating = !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS);
    let denied = matches!(status, 401 | 403 | 429)
        || (status == 404 && route.is_some_and(|r| r.object.is_some()));
    (mutating && route.is_some()) || denied
}

/// The middleware: after the answer is made, queues one record for a mutating or refused call.
/// Outermost in the router, so it sees host-routed requests, rate-limit refusals and the
/// `x-request-id` the edge adds.
pub async fn record_calls(
    State(state): State<Arc<ApiState>>,
    req: Request,
    next: Next,
) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let creds = Credentials::of(req.headers());
    let remote = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.to_string());
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    let route = classify(
        header_str(&creds.host),
        &path,
        header_str(&creds.envd_sandbox),
    );
    if !audited(&method, status, route.as_ref()) {
        return resp;
    }
    let route = route.unwrap_or_else(|| RouteInfo {
        template: "(no such route)".into(),
        object: None,
        proxied: false,
        envd: false,
    });
    let (resp, code) = if status >= 400 && !route.proxied {
        with_error_code(resp).await
    } else {
        (resp, None)
    };
    // The caller the edge authenticated, else what the credentials say (a refused one).
    let actor = match resp.extensions().get::<crate::request_id::Caller>() {
        Some(c) => c.0.as_str().to_string(),
        None => actor_of(&state, &creds, &route),
    };
    state.audit.record(Call {
        request_id: request_id_of(&resp),
        actor,
        remote,
        method: method.as_str().to_string(),
        route: route.template,
        object: route.object,
        status,
        code,
    });
    resp
}
