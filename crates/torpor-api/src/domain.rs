//! The domain sandboxes' ports are served under: `{port}-{id}.<domain>` (host-based routing in
//! crate::proxy, and what E2B's SDKs are told for `get_host`). A leaf: set once at start.

use std::sync::OnceLock;

static DOMAIN: OnceLock<String> = OnceLock::new();

/// The domain of host-based routing when none is set: `{port}-{id}.localhost`.
pub const DEFAULT_PROXY_DOMAIN: &str = "localhost";

/// Sets the domain of host-based routing: `{port}-{id}.<domain>` reaches `port` of sandbox `id`.
pub fn set_proxy_domain(domain: &str) {
    let _ = DOMAIN.set(domain.trim_matches('.').to_ascii_lowercase());
}

/// The domain of host-based routing (and of E2B's `get_host`): the one set by
/// `--proxy-domain`, else `TORPOR_E2B_DOMAIN`, else [`DEFAULT_PROXY_DOMAIN`].
pub fn proxy_domain() -> &'static str {
    DOMAIN.get_or_init(|| {
        std::env::var("TORPOR_E2B_DOMAIN")
            .ok()
            .map(|d| d.trim_matches('.').to_ascii_lowercase())
            .filter(|d| !d.is_empty())
            .unwrap_or_else(|| DEFAULT_PROXY_DOMAIN.into())
    })
}
