//! The control plane's errors. Each variant has a stable `code()` that clients can match on
//! and a [`kind()`](ControlError::kind) (what sort of failure it is); the API derives both the
//! HTTP status and the Connect code from the kind in one place (`torpor_api::errors`).

use torpor_core::{SandboxState, Tier};
use torpor_runtime::proto::AgentErrorCode;
use torpor_runtime::RuntimeError;

use crate::store::StoreError;

/// What sort of failure an error is: the one thing the API needs to choose an HTTP status and
/// a Connect code (`torpor_api::errors::wire`). A kind is never matched on to tell errors
/// apart for anything else; that is what `code()` is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The request is malformed or names something impossible (bad id, bad body, bad path).
    InvalidArgument,
    /// Well formed, but this build or node does not do it (a feature, a tier, a GPU inventory).
    Unsupported,
    /// No or a wrong credential (the API edge's).
    Unauthenticated,
    /// The caller may not do this.
    Forbidden,
    /// The named thing does not exist (or the caller may not see it).
    NotFound,
    /// The route exists, not with this method (the API edge's).
    MethodNotAllowed,
    /// Something of that name exists already.
    AlreadyExists,
    /// The target is in the wrong state for this (in use, not built yet, wrong tier).
    FailedPrecondition,
    /// Another operation holds the target right now; retrying later may work.
    Busy,
    /// The request body or a file is over its limit.
    PayloadTooLarge,
    /// A tenant's quota would be exceeded.
    QuotaExceeded,
    /// Over the tenant's request rate (the API edge's).
    RateLimited,
    /// A bug or a host-side failure: the client hears the code and the request id only.
    Internal,
    /// This node's runtime cannot do what was asked (a GPU runtime).
    NotImplemented,
    /// The sandbox (its agent or a server in it) failed while answering.
    BadGateway,
    /// No capacity now: no worker free in time, the parking lot full, no GPU share.
    NoCapacity,
    /// Not serving now (shutting down, an agent or a store backend unreachable); retryable.
    Unavailable,
    /// The operation ran past its deadline.
    DeadlineExceeded,
    /// The disk of a store is full: the operator's to fix.
    InsufficientStorage,
}

impl ErrorKind {
    /// Every kind, for tables and tests.
    pub const ALL: [ErrorKind; 19] = [
        ErrorKind::InvalidArgument,
        ErrorKind::Unsupported,
        ErrorKind::Unauthenticated,
        ErrorKind::Forbidden,
        ErrorKind::NotFound,
        ErrorKind::MethodNotAllowed,
        ErrorKind::AlreadyExists,
        ErrorKind::FailedPrecondition,
        ErrorKind::Busy,
        ErrorKind::PayloadTooLarge,
        ErrorKind::QuotaExceeded,
        ErrorKind::RateLimited,
        ErrorKind::Internal,
        ErrorKind::NotImplemented,
        ErrorKind::BadGateway,
        ErrorKind::NoCapacity,
        ErrorKind::Unavailable,
        ErrorKind::DeadlineExceeded,
        ErrorKind::InsufficientStorage,
    ];
}

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
    /// No worker within the call's budget: it waited `budget_ms` in vain, or (`expected_ms`)
    /// the lot's measured service rate said it would wait that long, and it was refused at once.
    #[error("{}", no_worker_message(*budget_ms, *expected_ms))]
    NoWorker {
        budget_ms: u64,
        expected_ms: Option<u64>,
    },
    #[error("{0}")]
    Busy(String),
    /// Cluster mode: another controller holds the sandbox (it won the race to wake it, or
    /// holds it already); the API forwards the call there (`at`, when it is alive).
    #[error("sandbox is held by controller {controller}; retry")]
    HeldElsewhere {
        controller: String,
        at: Option<crate::store::LiveController>,
    },
    #[error("torpor is shutting down")]
    ShuttingDown,
    /// Cluster mode: another live process holds this controller's name (its certificate's).
    #[error("controller name {name} is held by another live controller (at {holder}); give each controller a certificate of its own name")]
    IdentityInUse { name: String, holder: String },
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
    /// A blocking task of the engine panicked or was cancelled (an image import, a rootfs
    /// check): an internal failure, whose text clients never see.
    #[error("{what}: {source}")]
    TaskFailed {
        what: &'static str,
        source: tokio::task::JoinError,
    },
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
            ControlError::NoWorker { .. } => "no_worker_available",
            ControlError::LotFull(_) => "lot_full",
            ControlError::QuotaExceeded { .. } => "quota_exceeded",
            ControlError::TenantInUse(..) => "tenant_in_use",
            ControlError::ShuttingDown => "shutting_down",
            ControlError::IdentityInUse { .. } => "controller_identity_in_use",
            ControlError::Busy(_) => "sandbox_busy",
            ControlError::HeldElsewhere { .. } => "sandbox_elsewhere",
            ControlError::Unsupported(_) => "unsupported",
            ControlError::FeatureDisabled(_) => "feature_disabled",
            ControlError::ExecTimeout { .. } => "exec_timeout",
            ControlError::SandboxCrashed { .. } => "sandbox_crashed",
            ControlError::Agent { code, .. } => match code {
                AgentErrorCode::NotFound | AgentErrorCode::NoSuchCwd => "file_not_found",
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
            ControlError::Runtime(RuntimeError::NoCapacity(_)) => "no_worker",
            ControlError::Runtime(_) => "runtime_error",
            ControlError::Conn(_) => "sandbox_unavailable",
            ControlError::Image(e) => e.code(),
            ControlError::Snapshot(_) => "snapshot_store_error",
            ControlError::SnapshotStore { code, .. } => code,
            ControlError::Store(_) => "state_store_error",
            ControlError::Io { .. } => "io_error",
            ControlError::TaskFailed { .. } => "task_failed",
            ControlError::Gpu(e) => e.code(),
        }
    }

    /// What sort of failure this is (the API's status and Connect code come from it).
    pub fn kind(&self) -> ErrorKind {
        use crate::gpu::GpuError as G;
        use ErrorKind as K;
        match self {
            ControlError::NotFound { .. } => K::NotFound,
            ControlError::AlreadyExists { .. } => K::AlreadyExists,
            ControlError::Invalid(_) => K::InvalidArgument,
            ControlError::Forbidden(_) => K::Forbidden,
            ControlError::InvalidTransition { .. }
            | ControlError::TemplateInUse(..)
            | ControlError::TemplateNotReady(_)
            | ControlError::TenantInUse(..)
            | ControlError::IdentityInUse { .. } => K::FailedPrecondition,
            ControlError::QuotaExceeded { .. } => K::QuotaExceeded,
            ControlError::LotFull(_)
            | ControlError::NoWorker { .. }
            | ControlError::Runtime(RuntimeError::NoCapacity(_)) => K::NoCapacity,
            ControlError::Busy(_) | ControlError::HeldElsewhere { .. } => K::Busy,
            ControlError::ShuttingDown | ControlError::Conn(_) => K::Unavailable,
            ControlError::Unsupported(_) | ControlError::FeatureDisabled(_) => K::Unsupported,
            ControlError::ExecTimeout { .. } => K::DeadlineExceeded,
            ControlError::SandboxCrashed { .. } => K::BadGateway,
            ControlError::Agent { code, .. } => match code {
                AgentErrorCode::NotFound | AgentErrorCode::NoSuchCwd => K::NotFound,
                AgentErrorCode::PermissionDenied => K::Forbidden,
                AgentErrorCode::TooLarge => K::PayloadTooLarge,
                AgentErrorCode::Io => K::Internal,
                AgentErrorCode::NotADirectory
                | AgentErrorCode::IsADirectory
                | AgentErrorCode::InvalidPath
                | AgentErrorCode::SpawnFailed
                | AgentErrorCode::BadRequest => K::InvalidArgument,
            },
            // A tenant's image at fault (its text is made safe by `client_message`).
            ControlError::Image(_) => K::InvalidArgument,
            ControlError::Gpu(g) => match g {
                G::NotConfigured => K::Unsupported,
                G::BadRequest { .. } => K::InvalidArgument,
                G::Unavailable { .. } => K::NoCapacity,
                G::Quota { .. } => K::QuotaExceeded,
                G::Checkpoint(_) => K::FailedPrecondition,
                G::Driver(_) => K::Internal,
                G::RuntimeUnsupported(_) => K::NotImplemented,
            },
            // The store's stable code says which: its backend unreachable or locked is
            // retryable; a full disk is the operator's to fix.
            ControlError::SnapshotStore { code, .. } => match *code {
                "backend_remote" | "backend_io" | "store_locked" | "store_lock_lost" => {
                    K::Unavailable
                }
                "backend_no_space" | "output_no_space" => K::InsufficientStorage,
                _ => K::Internal,
            },
            // The database unreachable (a restart, a failover, a partition) or locked: the
            // call may be retried; a record it cannot parse is the operator's to fix.
            ControlError::Store(e) if e.kind() == crate::store::StoreErrorKind::Unavailable => {
                K::Unavailable
            }
            ControlError::Runtime(_)
            | ControlError::Store(_)
            | ControlError::Snapshot(_)
            | ControlError::TaskFailed { .. }
            | ControlError::Io { .. } => K::Internal,
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

fn no_worker_message(budget_ms: u64, expected_ms: Option<u64>) -> String {
    match expected_ms {
        None => format!("no worker became free within {budget_ms} ms"),
        Some(wait) => format!(
            "no worker would be free within {budget_ms} ms: at this node's current rate the wait \
             is about {wait} ms; retry later"
        ),
    }
}

impl ControlError {
    /// When the client may usefully retry, in seconds (`Retry-After`), if the error knows.
    pub fn retry_after_s(&self) -> Option<u64> {
        match self {
            ControlError::NoWorker {
                expected_ms: Some(ms),
                ..
            } => Some(ms.div_ceil(1000).max(1)),
            ControlError::HeldElsewhere { .. } => Some(1),
            _ => None,
        }
    }
}

pub type Result<T, E = ControlError> = std::result::Result<T, E>;
