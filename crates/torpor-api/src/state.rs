//! The state every handler shares ([`ApiState`]): the engine and the edge's bookkeeping. Made
//! once by the daemon; handlers take it with axum's `State`.

use std::sync::Arc;

use torpor_control::{ControlError, Engine};
use torpor_core::TenantId;

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
    /// The cluster's workers (`torpor controller`); `None` on a single machine.
    pub nodes: Option<Arc<dyn crate::nodes::NodeDirectory>>,
    /// Clients to the other controllers' peer listeners (`torpor controller`); `None` on a
    /// single machine.
    pub peers: Option<Arc<dyn crate::forward::PeerClients>>,
}

impl crate::ratelimit::Rates for ApiState {
    fn limits(&self) -> &crate::ratelimit::EdgeLimits {
        &self.limits
    }

    fn tenant_rates(&self) -> Result<Vec<(TenantId, Option<u64>)>, ControlError> {
        Ok(self
            .engine
            .tenants()?
            .into_iter()
            .map(|t| (t.id, t.quotas.requests_per_s))
            .collect())
    }

    fn default_rate(&self) -> u64 {
        self.default_requests_per_s
    }
}
