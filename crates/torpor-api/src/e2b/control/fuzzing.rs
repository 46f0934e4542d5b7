//! Fuzz entry points for the E2B control plane's request bodies (create, connect and timeout,
//! network) and list queries, decoded and checked the way the handlers in [`super`] do before
//! the engine is called. Reached through `crate::fuzzing`; not part of the API.

use torpor_core::NetworkPolicy;

use super::*;
use axum::extract::Query;
use std::collections::HashMap;

/// An empty body is the default, anything else JSON, as [`super::parse_body`] reads it.
fn body_of<T: for<'de> Deserialize<'de> + Default>(body: &[u8]) -> E2bResult<T> {
    if body.is_empty() {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| E2bError::bad_request(format!("request body: {e}")))
}

/// [`super::egress::policy`] with its promise checked: under a template whose policy is not
/// `full`, the sandbox gets the template's policy or ingress only, never more.
fn egress_policy(
    tpl: &str,
    template: Option<&NetworkPolicy>,
    egress: &Egress,
) -> E2bResult<NetworkPolicy> {
    let p = super::super::egress::policy(tpl, template, egress)?;
    if !matches!(template, Some(t) if *t == NetworkPolicy::full()) {
        let base = super::super::ports::ingress_policy(template);
        let ingress_only = NetworkPolicy::Allow(Default::default());
        assert!(
            p == base || p == ingress_only || super::super::egress::within(&p, &base),
            "{egress:?} widened template policy {template:?} to {p:?}"
        );
    }
    Ok(p)
}

/// `POST /sandboxes`'s body, under a template whose network policy is `template`: the
/// handler's own [`plan_create`], then the engine's env check.
pub fn create_body(body: &[u8], template: Option<&NetworkPolicy>) -> E2bResult<()> {
    let body: NewSandbox = body_of(body)?;
    let tpl = body.template_id.as_deref().unwrap_or("base").to_string();
    let plan = plan_create(body, |_| Ok(template.cloned()), || "token".into())?;
    // Its promise: under a template that is not `full`, never wider than the template.
    if !matches!(template, Some(t) if *t == NetworkPolicy::full()) {
        let base = super::super::ports::ingress_policy(template);
        let ingress_only = NetworkPolicy::Allow(Default::default());
        assert!(
            plan.network == base
                || plan.network == ingress_only
                || super::super::egress::within(&plan.network, &base),
            "template {tpl:?}: policy {template:?} widened to {:?}",
            plan.network
        );
    }
    // What is kept in the sandbox's metadata reads back as what was asked.
    if let Some(kept) = plan.metadata.get(META_EGRESS) {
        let egress: Egress = serde_json::from_str(kept).expect("kept egress reads back");
        assert_eq!(
            serde_json::to_string(&egress).ok().as_deref(),
            Some(kept.as_str())
        );
    }
    torpor_core::validate_env(&plan.env).map_err(|e| E2bError::bad_request(e.to_string()))?;
    Ok(())
}

/// `POST /sandboxes/{id}/connect` (`required: false`) and `POST /sandboxes/{id}/timeout`
/// (`required: true`)'s body.
pub fn timeout_body(body: &[u8], required: bool) -> E2bResult<u64> {
    let body: TimeoutBody = body_of(body)?;
    if required && body.timeout.is_none() {
        return Err(E2bError::bad_request("timeout is required"));
    }
    let t = timeout_seconds(body.timeout)?;
    assert!(t <= MAX_TIMEOUT_S, "timeout {t} passed the ceiling");
    Ok(t)
}

/// `PUT /sandboxes/{id}/network`'s body, under a template whose network policy is `template`.
pub fn network_body(body: &[u8], template: Option<&NetworkPolicy>) -> E2bResult<()> {
    let body: NetworkUpdate = body_of(body)?;
    super::super::egress::refuse_unsupported(
        body.egress_proxy.as_ref(),
        body.rules.as_ref(),
        None,
    )?;
    let egress = Egress {
        allow_out: body.allow_out,
        deny_out: body.deny_out,
        dns_servers: body.dns_servers,
        allow_internet_access: body.allow_internet_access,
    };
    egress_policy("base", template, &egress)?;
    Ok(())
}

/// A list's query string (`GET /v2/sandboxes?...` when `v2`, else `GET /sandboxes?...`),
/// parsed as the router parses it, then paged over no sandboxes.
pub fn list_query(query: &str, v2: bool) -> E2bResult<ListFilter> {
    let uri: axum::http::Uri = format!("/sandboxes?{query}")
        .parse()
        .map_err(|_| E2bError::bad_request("not a URI"))?;
    let Query(q) = Query::<HashMap<String, String>>::try_from_uri(&uri)
        .map_err(|e| E2bError::bad_request(e.body_text()))?;
    if q.get("metadata").is_some_and(|m| m.contains(META_PREFIX)) {
        return Err(E2bError::bad_request("reserved metadata key"));
    }
    let f = parse_list_query(&q, v2)?;
    assert!(
        (1..=MAX_PAGE).contains(&f.limit),
        "limit {} passed",
        f.limit
    );
    let (items, next) = page(&[], &f)?;
    assert!(items.is_empty() && next.is_none());
    Ok(f)
}
