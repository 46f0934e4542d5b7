//! Templates: the immutable recipe a sandbox is made from.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ids::TemplateName;
use crate::limits::{Limits, LimitsError};

/// Where a template's root filesystem comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TemplateSource {
    /// The host's /usr, /bin, /lib* read-only, with an /etc that torpor writes.
    Host,
    /// A root-filesystem directory on the daemon's machine; torpor copies it.
    Rootfs { path: String },
    /// An OCI image layout directory, an oci-archive or a `docker save` tarball on the daemon's
    /// machine; `reference` picks one image when the archive holds several.
    Image {
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reference: Option<String>,
    },
}

/// How long a sandbox may stay idle (no API call) on each rung before it is moved down.
/// `None` disables that step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdlePolicy {
    #[serde(default)]
    pub freeze_after_s: Option<f64>,
    #[serde(default)]
    pub park_after_s: Option<f64>,
    #[serde(default)]
    pub suspend_after_s: Option<f64>,
}

impl Default for IdlePolicy {
    fn default() -> Self {
        Self {
            freeze_after_s: Some(5.0),
            park_after_s: Some(120.0),
            suspend_after_s: Some(3600.0),
        }
    }
}

/// What a client asks for when registering a template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateSpec {
    pub name: TemplateName,
    pub source: TemplateSource,
    /// The agent's main process, started once at boot and captured in the golden snapshot.
    /// Empty: no main process (exec-only sandbox). For images, defaults to entrypoint + cmd.
    #[serde(default)]
    pub command: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub idle: IdlePolicy,
    /// Milliseconds to let the main process warm up before the golden snapshot is taken.
    #[serde(default)]
    pub warmup_ms: u64,
    /// The GPU share every sandbox of this template asks for: `torpor-gpu`'s request object
    /// (`{count, mode, profile?, compute_pct?, memory_mib?, ...}`), checked by the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<serde_json::Value>,
    /// Default egress policy of its sandboxes (each may override it at create); absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::NetworkPolicy>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TemplateSpecError {
    #[error(transparent)]
    Limits(#[from] LimitsError),
    #[error("idle.{field} must be a finite number of seconds >= 0")]
    Idle { field: &'static str },
    #[error("env name {0:?} is not valid (empty, or holds '=' or NUL)")]
    EnvName(String),
    #[error("env value of {0:?} holds a NUL byte")]
    EnvValue(String),
    #[error(transparent)]
    Network(#[from] crate::NetworkPolicyError),
    #[error("command argument {0} holds a NUL byte")]
    CommandArg(usize),
    #[error("cwd must be an absolute path")]
    Cwd,
    #[error("source.path must name a path")]
    SourcePath,
    #[error("warmup_ms must be at most 600000")]
    Warmup,
}

pub fn validate_env(env: &BTreeMap<String, String>) -> Result<(), TemplateSpecError> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(TemplateSpecError::EnvName(k.clone()));
        }
        if v.contains('\0') {
            return Err(TemplateSpecError::EnvValue(k.clone()));
        }
    }
    Ok(())
}

impl TemplateSpec {
    pub fn validate(&self) -> Result<(), TemplateSpecError> {
        self.limits.validate()?;
        for (field, v) in [
            ("freeze_after_s", self.idle.freeze_after_s),
            ("park_after_s", self.idle.park_after_s),
            ("suspend_after_s", self.idle.suspend_after_s),
        ] {
            if let Some(v) = v {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(TemplateSpecError::Idle { field });
                }
            }
        }
        validate_env(&self.env)?;
        if let Some(n) = &self.network {
            n.validate()?;
        }
        if let Some(i) = self.command.iter().position(|a| a.contains('\0')) {
            return Err(TemplateSpecError::CommandArg(i));
        }
        if let Some(cwd) = &self.cwd {
            if !cwd.starts_with('/') {
                return Err(TemplateSpecError::Cwd);
            }
        }
        match &self.source {
            TemplateSource::Host => {}
            TemplateSource::Rootfs { path } | TemplateSource::Image { path, .. } => {
                // Absolute, or relative to the operator's import directory (the daemon decides
                // which a caller may name).
                if path.is_empty() || path.contains('\0') {
                    return Err(TemplateSpecError::SourcePath);
                }
            }
        }
        if self.warmup_ms > 600_000 {
            return Err(TemplateSpecError::Warmup);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_spec_parses_with_defaults() {
        let s: TemplateSpec =
            serde_json::from_str(r#"{"name":"py","source":{"kind":"host"}}"#).unwrap();
        assert_eq!(s.limits, Limits::default());
        assert!(s.validate().is_ok());
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = serde_json::from_str::<TemplateSpec>(
            r#"{"name":"py","source":{"kind":"host"},"colour":"red"}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("colour"), "{e}");
    }

    #[test]
    fn bad_values_are_refused() {
        let mut s: TemplateSpec =
            serde_json::from_str(r#"{"name":"py","source":{"kind":"rootfs","path":""}}"#).unwrap();
        assert_eq!(s.validate(), Err(TemplateSpecError::SourcePath));
        s.source = TemplateSource::Host;
        s.env.insert("A=B".into(), "x".into());
        assert!(matches!(s.validate(), Err(TemplateSpecError::EnvName(_))));
    }
}
