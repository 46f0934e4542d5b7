//! torpor's vocabulary, shared by every other crate: identities, templates, sandboxes, resource
//! limits and the sleep-ladder state machine. This crate does no I/O; everything here is plain
//! data and pure functions, so it is cheap to test and safe to depend on from anywhere.

pub mod ids;
pub mod limits;
pub mod network;
pub mod state;
pub mod template;

pub use ids::{InvalidId, PoolName, SandboxId, TemplateName, TenantId};
pub use limits::{Limits, LimitsError, LimitsPatch};
pub use network::{NetworkPolicy, NetworkPolicyError};
pub use state::{Recovery, SandboxState, Tier, TransitionError};
pub use template::{validate_env, IdlePolicy, TemplateSource, TemplateSpec, TemplateSpecError};

/// Milliseconds since the Unix epoch; the one clock representation stored and sent.
pub type UnixMillis = i64;

/// The current wall-clock time in [`UnixMillis`].
pub fn now_millis() -> UnixMillis {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
