//! The control plane's errors. Each variant has a stable `code()` that clients can match on;
//! the API maps variants to HTTP statuses in one place (`torpor-api`).

use torpor_core::{SandboxState, Tier};
use torpor_runtime::proto::AgentErrorCode;
use torpor_runtime::RuntimeError;

use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("{kind} {id:?} not found")]
    NotFound { kind: &'static str, id: String },
    #[error("{kind} {id:?} already exists")]
    AlreadyExists { kind: &'static str, id: String },
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The caller may not do this (a tenant naming a host path, ...); the message says what,
    /// never what exists on the host.
    #[error("{0}")]
    Forbidden(String),
    #[error("sandbox is {from}; cannot move it to {to}")]
    InvalidTransition { from: SandboxState, to: Tier },
    #[error("template {0:?} still has {1} sandboxes; delete them first")]
    TemplateInUse(String, u64),
    #[error("template {0:?} is still being built")]
    TemplateNotReady(String),
    #[error("quota exceeded: {what} (limit {limit}, in use {used})")]
    QuotaExceeded {
        what: &'static str,
        limit: u64,
        used: u64,
    },
    #[error("tenant {0:?} still owns {1}; delete them first")]
    TenantInUse(String, String),
    #[error("the parking lot is full ({0} calls wait for a worker); retry later")]
    LotFull(usize),
    #[error("no worker became free within {0} ms")]
    NoWorker(u64),
    #[error("{0}")]
    Busy(String),
    #[error("torpor is shutting down")]
    ShuttingDown,
    #[error("{0}")]
    Unsupported(String),
    /// Needs a cargo feature this build was made without (the message names it).
    #[error("{0}")]
    FeatureDisabled(String),
    #[error("exec did not finish within {timeout_ms} ms; its processes were killed")]
    ExecTimeout {
        timeout_ms: u64,
        stdout: String,
        stderr: String,
    },
    #[error("the sandbox crashed ({reason}); it went back to its last snapshot")]
    SandboxCrashed { reason: String },
    #[error("{message}")]
    Agent {
        code: AgentErrorCode,
        message: String,
    },
    #[error("sandbox runtime: {0}")]
    Runtime(#[from] RuntimeError),
    #[error("snapshot store: {0}")]
    Snapshot(String),
    /// A snapshot store error with the store's own stable code (`chunk_corrupt`, ...).
    #[error("snapshot store: {message}")]
    SnapshotStore { code: &'static str, message: String },
    #[error("image: {0}")]
    Image(#[from] torpor_image::ImageError),
    #[error("sandbox agent: {0}")]
    Conn(#[from] torpor_runtime::conn::ConnError),
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error(transparent)]
    Gpu(#[from] crate::gpu::GpuError),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

impl ControlError {
    /// The stable, machine-readable code of this error.
    pub fn code(&self) -> &'static str {
        match self {
            ControlError::NotFound { .. } => "not_found",
            ControlError::AlreadyExists { .. } => "already_exists",
            ControlError::Invalid(_) => "invalid_request",
            ControlError::Forbidden(_) => "forbidden",
            ControlError::InvalidTransition { .. } => "invalid_transition",
            ControlError::TemplateInUse(..) => "template_in_use",
            ControlError::TemplateNotReady(_) => "template_not_ready",
            ControlError::NoWorker(_) => "no_worker_available",
            ControlError::LotFull(_) => "lot_full",
            ControlError::QuotaExceeded { .. } => "quota_exceeded",
            ControlError::TenantInUse(..) => "tenant_in_use",
            ControlError::ShuttingDown => "shutting_down",
            ControlError::Busy(_) => "sandbox_busy",
            ControlError::Unsupported(_) => "unsupported",
            ControlError::FeatureDisabled(_) => "feature_disabled",
            ControlError::ExecTimeout { .. } => "exec_timeout",
            ControlError::SandboxCrashed { .. } => "sandbox_crashed",
            ControlError::Agent { code, .. } => match code {
                AgentErrorCode::NotFound => "file_not_found",
                AgentErrorCode::NotADirectory => "not_a_directory",
                AgentErrorCode::IsADirectory => "is_a_directory",
                AgentErrorCode::PermissionDenied => "permission_denied",
                AgentErrorCode::InvalidPath => "invalid_path",
                AgentErrorCode::SpawnFailed => "spawn_failed",
                AgentErrorCode::TooLarge => "too_large",
                AgentErrorCode::Io => "io_error",
                AgentErrorCode::BadRequest => "invalid_request",
            },
            ControlError::Runtime(RuntimeError::RunscMissing { .. }) => "runsc_missing",
            ControlError::Runtime(_) => "runtime_error",
            ControlError::Conn(_) => "sandbox_unavailable",
            ControlError::Image(e) => e.code(),
            ControlError::Snapshot(_) => "snapshot_store_error",
            ControlError::SnapshotStore { code, .. } => code,
            ControlError::Store(_) => "state_store_error",
            ControlError::Io { .. } => "io_error",
            ControlError::Gpu(e) => e.code(),
        }
    }

    pub(crate) fn io<'a>(
        what: &'static str,
        path: &'a std::path::Path,
    ) -> impl FnOnce(std::io::Error) -> Self + 'a {
        move |source| ControlError::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    }
}

pub type Result<T, E = ControlError> = std::result::Result<T, E>;
