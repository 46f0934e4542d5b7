//! The wire types of API v1: what the server sends and the client reads. One definition for
//! both sides, so they cannot drift apart. `openapi.json` (checked in next to this crate)
//! describes the same shapes for other languages.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use torpor_core::{IdlePolicy, Limits, LimitsPatch, TemplateSource, Tier, UnixMillis};

pub use torpor_control::{ExecEvent, ExecResult, FileEntry};
pub use torpor_core::TemplateSpec;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Sandbox {
    pub id: String,
    pub template: String,
    pub tenant: String,
    pub state: String,
    pub tier: String,
    pub created_at: String,
    pub last_active_at: String,
    pub limits: Limits,
    pub metadata: BTreeMap<String, String>,
    /// Why the sandbox last fell back to a snapshot (crash, OOM, failed wake), if it did.
    pub last_error: Option<String>,
    pub oom_killed: bool,
    /// The worker it is resident on (`GET /v1/sandboxes/{id}` only); absent while it sleeps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// The worker process it is resident on in cluster mode (`GET /v1/sandboxes/{id}`); `null`
    /// while it sleeps and on a single machine.
    #[serde(default)]
    pub node: Option<String>,
    /// Cluster mode: the controller that holds it (runs its transitions; calls through
    /// another controller are forwarded there); absent while it sleeps and on one machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Template {
    pub name: String,
    pub tenant: String,
    pub source: TemplateSource,
    pub command: Vec<String>,
    pub limits: Limits,
    pub idle: IdlePolicy,
    pub status: String,
    pub golden_snapshot_bytes: u64,
    pub created_at: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxBody {
    pub template: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<LimitsPatch>,
    /// A GPU request; overrides the template's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<serde_json::Value>,
    /// Egress policy: `"none"` (default), `"full"` or `{"allow": [...], "hosts": [...]}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<torpor_core::NetworkPolicy>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecBody {
    pub cmd: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Text given to the command on its standard input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Start it in the background and return at once; it keeps running, also across
    /// suspend and resume. `stdout` of the result holds its pid.
    #[serde(default)]
    pub detach: bool,
    /// Answer with a stream of server-sent events (stdout, stderr, exit) instead of one result.
    #[serde(default)]
    pub stream: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkBody {
    /// How many sandboxes to make (1 to 64; default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<usize>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SuspendBody {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<Tier>,
    /// Why, as the transition records it (admin only): `gpu_reclaimed` (a controller parking a
    /// borrower of a GPU share that a tenant within its guarantee needs back). Absent: `api`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<String>,
}

pub use torpor_control::Quotas;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateTenantBody {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quotas: Option<Quotas>,
}

/// The answer to creating a tenant: the only time its token is shown.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TenantCreated {
    pub name: String,
    pub token: String,
    pub quotas: Quotas,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Tenant {
    pub name: String,
    pub created_at: String,
    pub quotas: Quotas,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ErrorDetail {
    pub code: String,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Health {
    pub status: String,
    pub version: String,
    pub runsc_version: String,
    pub platform: String,
    pub workers: usize,
}

/// RFC 3339 with milliseconds, UTC.
pub fn rfc3339(ms: UnixMillis) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

impl From<&torpor_control::SandboxRecord> for Sandbox {
    fn from(s: &torpor_control::SandboxRecord) -> Self {
        Sandbox {
            id: s.id.to_string(),
            template: s.template.to_string(),
            tenant: s.tenant.to_string(),
            state: s.state.to_string(),
            tier: s.tier.to_string(),
            created_at: rfc3339(s.created_at),
            last_active_at: rfc3339(s.last_active_at),
            limits: s.limits,
            metadata: torpor_control::Engine::public_metadata(&s.metadata),
            last_error: s.last_error.clone(),
            oom_killed: s.oom_killed,
            worker: None,
            node: None,
            controller: s.controller.clone(),
        }
    }
}

impl From<&torpor_control::TemplateRecord> for Template {
    fn from(t: &torpor_control::TemplateRecord) -> Self {
        Template {
            name: t.name.to_string(),
            tenant: t.tenant.to_string(),
            source: t.spec.source.clone(),
            command: t.spec.command.clone(),
            limits: t.spec.limits,
            idle: t.spec.idle,
            status: match t.status {
                torpor_control::TemplateStatus::Building => "building".into(),
                torpor_control::TemplateStatus::Ready => "ready".into(),
            },
            golden_snapshot_bytes: t.golden_bytes,
            created_at: rfc3339(t.created_at),
        }
    }
}
