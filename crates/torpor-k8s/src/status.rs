//! The `Ready` condition and how a failed call to torpor reads on an object's status: its
//! stable error code as `reason`, its client-facing message, and when to look again.

use std::time::{Duration, SystemTime};

use torpor_api::ClientError;

use crate::crd::{Condition, READY};

/// What one reconcile found, written to the object's `Ready` condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub ready: bool,
    /// `Reconciled`, torpor's error code, or one of the operator's own codes.
    pub reason: String,
    pub message: String,
    /// When to reconcile again without a change to the object (`None`: only when it changes).
    pub requeue: Option<Duration>,
}

/// How often a reconciled object is checked against torpor (drift: deleted behind our back).
pub const RESYNC: Duration = Duration::from_secs(300);
/// How soon a refused object is tried again (a quota may have been freed, a template made).
pub const RETRY_REFUSED: Duration = Duration::from_secs(60);
/// How soon after torpor was unreachable or failed (5xx).
pub const RETRY_UNAVAILABLE: Duration = Duration::from_secs(15);

impl Outcome {
    pub fn ready(message: impl Into<String>) -> Outcome {
        Outcome {
            ready: true,
            reason: "Reconciled".into(),
            message: message.into(),
            requeue: Some(RESYNC),
        }
    }

    /// The spec is one torpor would refuse: nothing is called until the object changes.
    pub fn invalid_spec(e: impl std::fmt::Display) -> Outcome {
        Outcome {
            ready: false,
            reason: "invalid_spec".into(),
            message: e.to_string(),
            requeue: None,
        }
    }

    pub fn refused(reason: &str, message: impl Into<String>, requeue: Duration) -> Outcome {
        Outcome {
            ready: false,
            reason: reason.into(),
            message: message.into(),
            requeue: Some(requeue),
        }
    }

    /// A call to torpor failed: its code and message, never transport internals (those go to
    /// the operator's log).
    pub fn from_torpor(what: &str, e: &ClientError) -> Outcome {
        match e {
            ClientError::Api {
                status,
                code,
                message,
                ..
            } => Outcome::refused(
                code,
                format!("{what}: {message}"),
                if *status >= 500 {
                    RETRY_UNAVAILABLE
                } else {
                    RETRY_REFUSED
                },
            ),
            ClientError::Connect { url, source } => {
                tracing::warn!(%url, error = %source, "torpor unreachable");
                Outcome::refused(
                    "torpor_unreachable",
                    format!("{what}: cannot reach torpor at {url}"),
                    RETRY_UNAVAILABLE,
                )
            }
            ClientError::Unexpected { status, body } => {
                tracing::warn!(status, body = %body, "unexpected answer from torpor");
                Outcome::refused(
                    "torpor_unexpected_answer",
                    format!("{what}: torpor answered HTTP {status} in an unknown shape"),
                    RETRY_UNAVAILABLE,
                )
            }
            ClientError::LocalFile { .. } => Outcome::refused(
                "internal",
                format!("{what}: the operator failed (see its log)"),
                RETRY_UNAVAILABLE,
            ),
        }
    }
}

/// RFC 3339 UTC, seconds.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
}

/// Sets the `Ready` condition from `outcome`, keeping `lastTransitionTime` when the status
/// (True/False) did not change.
pub fn set_ready(conditions: &mut Vec<Condition>, outcome: &Outcome, generation: Option<i64>) {
    let status = if outcome.ready { "True" } else { "False" };
    let previous = conditions.iter().find(|c| c.type_ == READY);
    let last_transition_time = match previous {
        Some(p) if p.status == status => p.last_transition_time.clone(),
        _ => now_rfc3339(),
    };
    conditions.retain(|c| c.type_ != READY);
    conditions.push(Condition {
        type_: READY.into(),
        status: status.into(),
        reason: outcome.reason.clone(),
        message: outcome.message.clone(),
        last_transition_time,
        observed_generation: generation,
    });
}

/// Whether an error is torpor's `404 not_found`.
pub fn is_not_found(e: &ClientError) -> bool {
    matches!(e, ClientError::Api { status: 404, .. })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transition_time_moves_only_when_ready_flips() {
        let mut c = Vec::new();
        set_ready(&mut c, &Outcome::ready("ok"), Some(1));
        let t0 = c[0].last_transition_time.clone();
        c[0].last_transition_time = "2000-01-01T00:00:00Z".into();
        set_ready(&mut c, &Outcome::ready("still ok"), Some(2));
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].last_transition_time, "2000-01-01T00:00:00Z");
        assert_eq!(c[0].message, "still ok");
        assert_eq!(c[0].observed_generation, Some(2));
        set_ready(
            &mut c,
            &Outcome::refused("quota_exceeded", "no", RETRY_REFUSED),
            Some(2),
        );
        assert_eq!(c[0].status, "False");
        assert_eq!(c[0].reason, "quota_exceeded");
        assert_ne!(c[0].last_transition_time, "2000-01-01T00:00:00Z");
        assert!(t0.ends_with('Z'));
    }

    #[test]
    fn a_torpor_error_reads_as_its_code_and_message() {
        let e = ClientError::Api {
            status: 409,
            code: "template_in_use".into(),
            message: "template py has 2 sandboxes".into(),
            details: None,
        };
        let o = Outcome::from_torpor("replacing template py", &e);
        assert!(!o.ready);
        assert_eq!(o.reason, "template_in_use");
        assert_eq!(
            o.message,
            "replacing template py: template py has 2 sandboxes"
        );
        assert_eq!(o.requeue, Some(RETRY_REFUSED));
        let e = ClientError::Api {
            status: 503,
            code: "shutting_down".into(),
            message: "m".into(),
            details: None,
        };
        assert_eq!(
            Outcome::from_torpor("x", &e).requeue,
            Some(RETRY_UNAVAILABLE)
        );
    }
}
