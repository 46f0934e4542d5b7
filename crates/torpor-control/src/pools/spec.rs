//! What `POST /v1/pools` takes: [`PoolSpec`] with its dispatch settings, their defaults and
//! [`PoolSpec::validate`], which names the field that is wrong. Pure data: no I/O.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use torpor_core::{PoolName, TemplateName};
use torpor_triggers::consume;
use torpor_triggers::rule::{Fallback, ScalePolicy};
use torpor_triggers::{TriggerError, TriggerSpec};

use crate::error::{ControlError, Result};

const MAX_TRIGGERS: usize = 8;
const MAX_AGENTS: u32 = 1000;

fn default_target() -> u64 {
    1
}
fn default_cooldown() -> u64 {
    30
}
fn default_poll() -> u64 {
    1000
}
fn default_true() -> bool {
    true
}
fn default_timeout() -> u64 {
    300
}
fn default_attempts() -> u32 {
    3
}
fn default_backoff() -> u64 {
    200
}
fn default_grace() -> u64 {
    10
}

/// What `POST /v1/pools` takes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    pub name: PoolName,
    pub template: TemplateName,
    #[serde(default)]
    pub min: u32,
    pub max: u32,
    /// Work (messages) per agent.
    #[serde(default = "default_target")]
    pub target: u64,
    /// The pool is active only while depth is strictly above this.
    #[serde(default)]
    pub activation: u64,
    /// How long the pool keeps an agent after its last active reading before going to `min`.
    #[serde(default = "default_cooldown")]
    pub cooldown_s: u64,
    /// How often depth is read when no push arrives.
    #[serde(default = "default_poll")]
    pub poll_interval_ms: u64,
    /// Watch the broker for new work (where it allows it) instead of only polling.
    #[serde(default = "default_true")]
    pub push: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<Fallback>,
    /// Self-consume mode: how long an agent has between its drain notice and its suspension.
    #[serde(default = "default_grace")]
    pub drain_grace_s: u64,
    pub triggers: Vec<TriggerSpec>,
    /// Dispatch mode when present: torpor takes each message from `triggers[0]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch: Option<DispatchSpec>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DispatchSpec {
    /// Run in an agent of the pool with the message on stdin; exit 0 acknowledges it.
    /// Exactly one of `command` and `http`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    /// POST the message body to a port of the agent (woken first when it sleeps); a 2xx answer
    /// acknowledges it. The pool's template needs a network (ingress).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpDispatch>,
    /// `command` only: extra environment of the command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default = "default_timeout")]
    pub timeout_s: u64,
    /// Attempts per message before it goes to the dead-letter destination.
    #[serde(default = "default_attempts")]
    pub max_attempts: u32,
    #[serde(default = "default_backoff")]
    pub retry_backoff_ms: u64,
    /// Dead-letter list, stream, subject or queue; a default per trigger when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<String>,
}

fn default_http_path() -> String {
    "/".into()
}

/// `dispatch.http`: where in the agent each message is POSTed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpDispatch {
    pub port: u16,
    /// Absolute path, query string allowed; default `/`.
    #[serde(default = "default_http_path")]
    pub path: String,
    /// Extra request headers (e.g. `content-type`; default `application/octet-stream`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
}

impl HttpDispatch {
    fn validate(&self) -> Result<()> {
        if self.port == 0 {
            return Err(invalid("dispatch.http.port", "must be between 1 and 65535"));
        }
        let p = &self.path;
        if !p.starts_with('/') || p.len() > 2048 || p.chars().any(|c| c.is_control() || c == ' ') {
            return Err(invalid(
                "dispatch.http.path",
                format!("{p:?} must start with '/', be at most 2048 bytes and hold no spaces or control characters"),
            ));
        }
        if p.split(['/', '?']).any(|s| s == ".." || s == ".") {
            return Err(invalid(
                "dispatch.http.path",
                format!("{p:?} may not contain '.' or '..' segments"),
            ));
        }
        if self.headers.len() > 32 {
            return Err(invalid("dispatch.http.headers", "at most 32 headers"));
        }
        for (k, v) in &self.headers {
            let name = hyper::header::HeaderName::from_bytes(k.as_bytes()).map_err(|_| {
                invalid(
                    "dispatch.http.headers",
                    format!("{k:?} is not a header name"),
                )
            })?;
            if matches!(
                name.as_str(),
                "host" | "content-length" | "transfer-encoding" | "connection" | "upgrade"
            ) {
                return Err(invalid(
                    "dispatch.http.headers",
                    format!("{k:?} is set by torpor"),
                ));
            }
            hyper::header::HeaderValue::from_str(v).map_err(|_| {
                invalid(
                    "dispatch.http.headers",
                    format!("the value of {k:?} is not a valid header value"),
                )
            })?;
        }
        Ok(())
    }
}

pub(super) fn invalid(field: &str, reason: impl std::fmt::Display) -> ControlError {
    ControlError::Invalid(format!("{field}: {reason}"))
}

impl PoolSpec {
    /// Checks every setting, naming the field that is wrong.
    pub fn validate(&self) -> Result<()> {
        if self.max == 0 || self.max > MAX_AGENTS {
            return Err(invalid(
                "max",
                format!("must be between 1 and {MAX_AGENTS}"),
            ));
        }
        if self.min > self.max {
            return Err(invalid(
                "min",
                format!("{} is above max {}", self.min, self.max),
            ));
        }
        if self.target == 0 {
            return Err(invalid("target", "must be at least 1"));
        }
        if self.cooldown_s > 86_400 {
            return Err(invalid("cooldown_s", "must be at most 86400"));
        }
        if !(50..=3_600_000).contains(&self.poll_interval_ms) {
            return Err(invalid(
                "poll_interval_ms",
                "must be between 50 and 3600000",
            ));
        }
        if self.drain_grace_s > 3600 {
            return Err(invalid("drain_grace_s", "must be at most 3600"));
        }
        if let Some(fb) = &self.fallback {
            if fb.failure_threshold == 0 {
                return Err(invalid("fallback.failure_threshold", "must be at least 1"));
            }
            if fb.replicas > self.max {
                return Err(invalid(
                    "fallback.replicas",
                    format!("{} is above max {}", fb.replicas, self.max),
                ));
            }
        }
        if self.triggers.is_empty() || self.triggers.len() > MAX_TRIGGERS {
            return Err(invalid(
                "triggers",
                format!("needs between 1 and {MAX_TRIGGERS} triggers"),
            ));
        }
        for (i, t) in self.triggers.iter().enumerate() {
            t.validate(&format!("triggers[{i}]")).map_err(|e| match e {
                TriggerError::FeatureDisabled { .. } => {
                    ControlError::FeatureDisabled(e.to_string())
                }
                e => ControlError::Invalid(e.to_string()),
            })?;
        }
        if let Some(d) = &self.dispatch {
            match (&d.command, &d.http) {
                (Some(cmd), None) => {
                    if cmd.is_empty() || cmd[0].is_empty() {
                        return Err(invalid("dispatch.command", "must name a program"));
                    }
                    if cmd.iter().any(|a| a.contains('\0')) {
                        return Err(invalid("dispatch.command", "contains a NUL byte"));
                    }
                }
                (None, Some(h)) => {
                    h.validate()?;
                    if !d.env.is_empty() {
                        return Err(invalid(
                            "dispatch.env",
                            "applies to `command` only; an HTTP agent has its template's env",
                        ));
                    }
                }
                _ => {
                    return Err(invalid(
                        "dispatch",
                        "needs exactly one of `command` and `http`",
                    ))
                }
            }
            torpor_core::validate_env(&d.env)
                .map_err(|e| invalid("dispatch.env", e.to_string()))?;
            if !(1..=86_400).contains(&d.timeout_s) {
                return Err(invalid("dispatch.timeout_s", "must be between 1 and 86400"));
            }
            if !(1..=100).contains(&d.max_attempts) {
                return Err(invalid(
                    "dispatch.max_attempts",
                    "must be between 1 and 100",
                ));
            }
            if d.retry_backoff_ms > 60_000 {
                return Err(invalid(
                    "dispatch.retry_backoff_ms",
                    "must be at most 60000",
                ));
            }
            if let Some(dl) = &d.dead_letter {
                if dl.is_empty() || dl.len() > 256 || dl.chars().any(char::is_control) {
                    return Err(invalid(
                        "dispatch.dead_letter",
                        "must be 1 to 256 printable characters",
                    ));
                }
            }
            if !consume::can_dispatch(&self.triggers[0]) {
                return Err(invalid(
                    "dispatch",
                    format!(
                        "torpor cannot dispatch from a {} trigger (triggers[0]); leave dispatch out",
                        self.triggers[0].kind()
                    ),
                ));
            }
        }
        Ok(())
    }

    pub(super) fn policy(&self) -> ScalePolicy {
        ScalePolicy {
            min: self.min,
            max: self.max,
            target: self.target,
            activation: self.activation,
            cooldown_ms: self.cooldown_s * 1000,
            fallback: self.fallback,
        }
    }

    pub(super) fn dead_letter(&self) -> String {
        self.dispatch
            .as_ref()
            .and_then(|d| d.dead_letter.clone())
            .unwrap_or_else(|| consume::default_dead_letter(&self.triggers[0], self.name.as_str()))
    }
}
