//! What `GET /v1/pools/{name}` answers ([`PoolStatus`]), a pool's status before its first
//! reading, and what a tenant's pool shows of a broker error (one generic text for an
//! unreachable broker; the details go to the log).

use serde::{Deserialize, Serialize};
use torpor_core::{PoolName, SandboxId, TemplateName, TenantId};
use torpor_triggers::TriggerError;

use super::spec::PoolSpec;

/// What a tenant's pool status says of a broker it cannot reach, whatever the cause.
pub const BROKER_UNREACHABLE_CODE: &str = "broker_unreachable";
const BROKER_UNREACHABLE_MESSAGE: &str =
    "the broker did not answer or refused the connection (details are in the daemon's log)";

/// One trigger's last reading.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TriggerStatus {
    #[serde(rename = "type")]
    pub kind: String,
    pub depth: Option<u64>,
    /// The last error's stable code and message, while the trigger fails.
    pub error: Option<TriggerErrorStatus>,
    pub consecutive_errors: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TriggerErrorStatus {
    pub code: String,
    pub message: String,
}

/// What `GET /v1/pools/{name}` answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolStatus {
    pub name: PoolName,
    pub tenant: TenantId,
    pub template: TemplateName,
    /// `dispatch` or `self-consume`.
    pub mode: String,
    pub desired: u32,
    /// Active agents (awake and, in dispatch mode, taking work).
    pub running: u32,
    /// Agents being created or woken.
    pub starting: u32,
    /// Agents finishing their in-flight work before suspension.
    pub draining: u32,
    /// Demand: the maximum depth over the triggers (plus in-flight messages where the broker
    /// does not count them); `null` while no trigger answers.
    pub depth: Option<u64>,
    pub active: bool,
    pub fallback: bool,
    pub in_flight: u64,
    pub processed: u64,
    pub failed_attempts: u64,
    pub dead_lettered: u64,
    /// Every sandbox of the pool, awake or asleep.
    pub sandboxes: Vec<SandboxId>,
    pub triggers: Vec<TriggerStatus>,
    /// The last scaling error (creating, waking or suspending an agent), if any.
    pub last_error: Option<String>,
    /// Cluster mode: the controller that scales the pool (holds its lease), as of the
    /// answering controller's last heartbeat; absent on a single machine or while nobody does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller: Option<String>,
    pub spec: PoolSpec,
}

pub(super) fn initial_status(tenant: &TenantId, spec: &PoolSpec) -> PoolStatus {
    PoolStatus {
        name: spec.name.clone(),
        tenant: tenant.clone(),
        template: spec.template.clone(),
        mode: if spec.dispatch.is_some() {
            "dispatch"
        } else {
            "self-consume"
        }
        .into(),
        desired: 0,
        running: 0,
        starting: 0,
        draining: 0,
        depth: None,
        active: false,
        fallback: false,
        in_flight: 0,
        processed: 0,
        failed_attempts: 0,
        dead_lettered: 0,
        sandboxes: Vec::new(),
        triggers: spec
            .triggers
            .iter()
            .map(|t| TriggerStatus {
                kind: t.kind().into(),
                depth: None,
                error: None,
                consecutive_errors: 0,
            })
            .collect(),
        last_error: None,
        controller: None,
        spec: spec.clone(),
    }
}

/// A trigger's error as its pool's status shows it: for a tenant's pool (`generic`), a broker
/// that cannot be reached reads the same whatever the cause; the details are logged.
pub(super) fn err_status(e: &TriggerError, generic: bool) -> TriggerErrorStatus {
    if generic && e.is_unreachable() {
        return TriggerErrorStatus {
            code: BROKER_UNREACHABLE_CODE.into(),
            message: BROKER_UNREACHABLE_MESSAGE.into(),
        };
    }
    TriggerErrorStatus {
        code: e.code().into(),
        message: e.to_string(),
    }
}
