//! Ports of E2B sandboxes: `sandbox.get_host(port)` names `{port}-{sandboxID}.{domain}`, which
//! torpor's host-based routing (crate::proxy) serves on its own listener, waking a sleeping
//! sandbox first.
//!
//! Every E2B sandbox is created with a network interface so that its ports are reachable: the
//! template's policy when it has one, else ingress only (`{"allow": []}`: no egress at all).
//! As on E2B, a sandbox's ports are public by default: a host-routed request without torpor
//! credentials is let through. `network: {"allowPublicTraffic": false}` at create makes them
//! private: a request then needs `e2b-traffic-access-token` (the `trafficAccessToken` of the
//! create answer) or torpor's bearer token of the owning tenant.

use axum::http::HeaderMap;
use torpor_core::network::AllowList;
use torpor_core::{NetworkPolicy, SandboxId, TenantId};

use super::E2b;
use crate::auth::constant_time_eq;
use crate::errors::ApiError;
use crate::state::ApiState;

/// Metadata key: `public`, or the traffic access token a request must carry.
pub const META_TRAFFIC: &str = torpor_control::Engine::E2B_TRAFFIC_KEY;
/// The header E2B's SDKs and docs use for private sandbox traffic.
pub const TRAFFIC_HEADER: &str = "e2b-traffic-access-token";

/// The network of an E2B sandbox: the template's policy if it has an interface, else ingress
/// only (an interface with no egress).
pub fn ingress_policy(template: Option<&NetworkPolicy>) -> NetworkPolicy {
    match template {
        Some(p) if !p.is_none() => p.clone(),
        _ => NetworkPolicy::Allow(AllowList::default()),
    }
}

/// A new traffic access token for a private sandbox (160 random bits from torpor's id
/// generator, hashed with the adapter's key), kept in the sandbox's metadata.
pub fn new_traffic_token(st: &E2b) -> String {
    let key = blake3::derive_key("torpor e2b traffic access token v1", &st.token_key);
    let seed = format!("{}{}", SandboxId::generate(), SandboxId::generate());
    blake3::keyed_hash(&key, seed.as_bytes())
        .to_hex()
        .to_string()
}

/// Metadata key: E2B's `maskRequestHost`, the Host the sandbox's server sees (`${PORT}` is
/// replaced by the port).
pub const META_MASK_HOST: &str = "torpor.e2b.mask_host";

/// Who a host-routed request acts as, and the Host header the sandbox is sent (E2B's
/// `maskRequestHost`; `None`: the sandbox's own address).
pub(crate) struct HostRoute {
    pub tenant: TenantId,
    pub host: Option<String>,
}

/// Checks a `maskRequestHost`: a host name, optionally with `${PORT}` and a `:port`.
pub fn check_mask_host(mask: &str) -> Result<(), String> {
    let bad = || format!("network.maskRequestHost: {mask:?} is not a host name");
    let probe = mask.replace("${PORT}", "80");
    let name = match probe.rsplit_once(':') {
        Some((name, port)) if port.parse::<u16>().is_ok() => name,
        Some(_) => return Err(bad()),
        None => probe.as_str(),
    };
    torpor_core::network::check_host(name).map_err(|_| bad())
}

/// The tenant a host-routed request to sandbox `id` acts as. An E2B sandbox whose traffic is
/// public, or a request carrying its traffic access token, goes through as the admin (who owns
/// every sandbox); otherwise torpor's bearer check applies. The answer never tells a missing
/// sandbox from a refused request.
pub(crate) fn host_route_tenant(
    state: &ApiState,
    id: &str,
    port: u16,
    headers: &HeaderMap,
) -> Result<HostRoute, ApiError> {
    let admin = TenantId::admin();
    let rec = SandboxId::new(id)
        .ok()
        .and_then(|id| state.engine.sandbox(&admin, &id).ok())
        // A named snapshot's holder is no E2B sandbox: no public traffic wakes it.
        .filter(|r| !super::is_snapshot(r));
    let host = rec
        .as_ref()
        .and_then(|r| r.metadata.get(META_MASK_HOST))
        .map(|m| m.replace("${PORT}", &port.to_string()));
    // Traffic the caller may send wakes a sandbox paused through E2B (as before E2B's pause
    // existed here): it is running again to E2B, with a new deadline.
    let paused = rec
        .as_ref()
        .filter(|r| r.metadata.contains_key(super::META_PAUSED))
        .cloned();
    let mark_resumed = || {
        if let Some(r) = &paused {
            if let Err(e) = super::mark_resumed(&state.engine, r, None) {
                tracing::warn!(sandbox = %r.id, error = %e, "cannot mark an e2b sandbox resumed");
            }
        }
    };
    let owner = rec.as_ref().map(|r| r.tenant.clone());
    let traffic = rec.and_then(|rec| rec.metadata.get(META_TRAFFIC).cloned());
    let allowed = match traffic.as_deref() {
        Some("public") => true,
        Some(token) => headers
            .get(TRAFFIC_HEADER)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| constant_time_eq(v.trim().as_bytes(), token.as_bytes())),
        None => false,
    };
    let proxy = crate::ratelimit::RouteClass::Proxy;
    if allowed {
        // Public traffic counts against the rate of the sandbox's owner.
        if let Some(owner) = &owner {
            crate::ratelimit::check(state, owner, proxy)?;
        }
        mark_resumed();
        return Ok(HostRoute {
            tenant: admin,
            host,
        });
    }
    if headers.contains_key(axum::http::header::AUTHORIZATION) {
        let tenant = crate::auth::tenant_of(state, headers)?;
        crate::ratelimit::check(state, &tenant, proxy)?;
        if tenant == TenantId::admin() || owner.as_ref() == Some(&tenant) {
            mark_resumed();
        }
        return Ok(HostRoute { tenant, host });
    }
    Err(ApiError::new(
        torpor_control::error::ErrorKind::Unauthenticated,
        "unauthorized",
        format!(
            "missing `Authorization: Bearer TOKEN` header (or `{TRAFFIC_HEADER}` for a private \
             E2B sandbox)"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2b_sandboxes_always_get_an_interface() {
        let ingress = NetworkPolicy::Allow(AllowList::default());
        assert_eq!(ingress_policy(None), ingress);
        assert_eq!(ingress_policy(Some(&NetworkPolicy::none())), ingress);
        assert_eq!(ingress_policy(Some(&NetworkPolicy::Unset)), ingress);
        assert_eq!(
            ingress_policy(Some(&NetworkPolicy::full())),
            NetworkPolicy::full()
        );
    }

    #[test]
    fn mask_hosts() {
        assert!(check_mask_host("${PORT}-myapp.example.com").is_ok());
        assert!(check_mask_host("app.internal:8080").is_ok());
        assert!(check_mask_host("a b").is_err());
        assert!(check_mask_host("x:y").is_err());
    }
}
