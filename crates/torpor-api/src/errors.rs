//! The API's error contract: [`ApiError`] (an [`ErrorKind`], a stable code, a message for the
//! client), and [`wire`], the one table from a kind to its HTTP status and its Connect code
//! (E2B's envd speaks Connect, <https://connectrpc.com/docs/protocol#error-codes>). API v1
//! errors, E2B's REST errors and envd's Connect errors all take their status and code from it;
//! nothing matches on an error's text.
//!
//! What a client reads of a domain error is decided by [`client_message`] alone: internal
//! failures (host paths, runsc output, store errors) go to the log with the request id, the
//! client gets the stable code and that id.
//!
//! A leaf: it uses the request context (crate::request_id) and the wire types only.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use torpor_control::error::ErrorKind;
use torpor_control::store::LiveController;
use torpor_control::ControlError;
use torpor_core::TenantId;

use crate::types::{ErrorBody, ErrorDetail};

/// Connect's error codes (all of them; envd answers with a subset).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConnectCode {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl ConnectCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ConnectCode::Canceled => "canceled",
            ConnectCode::Unknown => "unknown",
            ConnectCode::InvalidArgument => "invalid_argument",
            ConnectCode::DeadlineExceeded => "deadline_exceeded",
            ConnectCode::NotFound => "not_found",
            ConnectCode::AlreadyExists => "already_exists",
            ConnectCode::PermissionDenied => "permission_denied",
            ConnectCode::ResourceExhausted => "resource_exhausted",
            ConnectCode::FailedPrecondition => "failed_precondition",
            ConnectCode::Aborted => "aborted",
            ConnectCode::OutOfRange => "out_of_range",
            ConnectCode::Unimplemented => "unimplemented",
            ConnectCode::Internal => "internal",
            ConnectCode::Unavailable => "unavailable",
            ConnectCode::DataLoss => "data_loss",
            ConnectCode::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary Connect error with this code (Connect's own table; a
    /// streamed error is in the body of a 200).
    pub fn http_status(self) -> StatusCode {
        match self {
            ConnectCode::Canceled => StatusCode::from_u16(499).expect("499 is a valid status"),
            ConnectCode::Unknown | ConnectCode::Internal | ConnectCode::DataLoss => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            ConnectCode::InvalidArgument
            | ConnectCode::FailedPrecondition
            | ConnectCode::OutOfRange => StatusCode::BAD_REQUEST,
            ConnectCode::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            ConnectCode::NotFound => StatusCode::NOT_FOUND,
            ConnectCode::AlreadyExists | ConnectCode::Aborted => StatusCode::CONFLICT,
            ConnectCode::PermissionDenied => StatusCode::FORBIDDEN,
            ConnectCode::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            ConnectCode::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            ConnectCode::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ConnectCode::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// How an error of one kind goes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wire {
    /// The status of API v1's and E2B's REST answers.
    pub status: StatusCode,
    /// The code of envd's Connect answers.
    pub connect: ConnectCode,
}

/// The one table: an error kind's HTTP status and Connect code.
pub fn wire(kind: ErrorKind) -> Wire {
    use ConnectCode as C;
    use ErrorKind as K;
    let (status, connect) = match kind {
        K::InvalidArgument => (StatusCode::BAD_REQUEST, C::InvalidArgument),
        K::Unsupported => (StatusCode::BAD_REQUEST, C::InvalidArgument),
        K::Unauthenticated => (StatusCode::UNAUTHORIZED, C::Unauthenticated),
        K::Forbidden => (StatusCode::FORBIDDEN, C::PermissionDenied),
        K::NotFound => (StatusCode::NOT_FOUND, C::NotFound),
        K::MethodNotAllowed => (StatusCode::METHOD_NOT_ALLOWED, C::Unimplemented),
        K::AlreadyExists => (StatusCode::CONFLICT, C::AlreadyExists),
        K::FailedPrecondition => (StatusCode::CONFLICT, C::FailedPrecondition),
        K::Busy => (StatusCode::CONFLICT, C::Aborted),
        K::PayloadTooLarge => (StatusCode::PAYLOAD_TOO_LARGE, C::ResourceExhausted),
        K::QuotaExceeded => (StatusCode::TOO_MANY_REQUESTS, C::ResourceExhausted),
        K::RateLimited => (StatusCode::TOO_MANY_REQUESTS, C::ResourceExhausted),
        K::Internal => (StatusCode::INTERNAL_SERVER_ERROR, C::Internal),
        K::NotImplemented => (StatusCode::NOT_IMPLEMENTED, C::Unimplemented),
        K::BadGateway => (StatusCode::BAD_GATEWAY, C::Unavailable),
        K::NoCapacity => (StatusCode::SERVICE_UNAVAILABLE, C::ResourceExhausted),
        K::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, C::Unavailable),
        K::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, C::DeadlineExceeded),
        K::InsufficientStorage => (StatusCode::INSUFFICIENT_STORAGE, C::ResourceExhausted),
    };
    Wire { status, connect }
}

/// An API error: a kind (its status and Connect code), a stable code and a message.
#[derive(Debug)]
pub struct ApiError {
    kind: ErrorKind,
    code: String,
    message: String,
    details: Option<serde_json::Value>,
    retry_after: Option<u64>,
    /// Cluster mode: the live controller that holds the sandbox (a response extension read by
    /// the forwarding layer, crate::forward; never reaches a client).
    held_at: Option<Box<LiveController>>,
}

/// The result of a handler.
pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    /// An error the API edge decides itself (a bad body, an unknown route, a refused token).
    pub fn new(kind: ErrorKind, code: &str, message: impl Into<String>) -> Self {
        ApiError {
            kind,
            code: code.into(),
            message: message.into(),
            details: None,
            retry_after: None,
            held_at: None,
        }
    }

    /// Asks the client to retry after `seconds` (the `Retry-After` header).
    pub fn with_retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// The stable error code.
    pub fn code(&self) -> &str {
        &self.code
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The HTTP status, from [`wire`].
    pub fn status(&self) -> StatusCode {
        wire(self.kind).status
    }

    /// The Connect code, from [`wire`].
    pub fn connect_code(&self) -> ConnectCode {
        wire(self.kind).connect
    }

    /// The message for the client (never internal detail).
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code,
                message: self.message,
                details: self.details,
            },
        };
        let mut resp = (status, Json(body)).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if let Some(at) = self.held_at {
            resp.extensions_mut().insert(crate::forward::HeldAt(*at));
        }
        resp
    }
}

/// What a client is told of `e`: its own text when that is meant for clients; for an internal
/// failure (and an image error shown to a tenant, whose text names host paths) a message with
/// the stable code and the request id, the details going to the log under that id.
pub fn client_message(e: &ControlError) -> String {
    let status = wire(e.kind()).status;
    // The operator sees everything anyway: the admin's errors keep their detail (a snapshot
    // store's corrupt chunk, the path that failed) for the operator to act on.
    let admin = crate::request_id::caller().is_some_and(|c| c == TenantId::admin());
    let meant_for_clients = admin
        || match e {
            ControlError::NoWorker { .. }
            | ControlError::LotFull(_)
            | ControlError::ShuttingDown
            | ControlError::ExecTimeout { .. }
            | ControlError::SandboxCrashed { .. } => true,
            ControlError::Gpu(g) => !matches!(g, torpor_control::gpu::GpuError::Driver(_)),
            ControlError::Image(_) => false,
            ControlError::Agent { code, .. } => *code != torpor_runtime::proto::AgentErrorCode::Io,
            _ => !status.is_server_error(),
        };
    let request_id = crate::request_id::current_id();
    if meant_for_clients {
        if status.is_server_error() {
            tracing::warn!(%request_id, error = %e, code = e.code(), "request failed");
        }
        return e.to_string();
    }
    if let ControlError::Image(img) = e {
        // The tenant's own image is at fault: its text without the host paths.
        tracing::info!(%request_id, error = %e, code = e.code(), "image refused");
        return img.client_message();
    }
    tracing::error!(%request_id, error = %e, code = e.code(), "request failed");
    match e {
        ControlError::Conn(_) => {
            format!("the sandbox's agent is unavailable; retry (request id {request_id})")
        }
        ControlError::Store(_) if e.kind() == ErrorKind::Unavailable => {
            format!("the state store cannot be reached now; retry (request id {request_id})")
        }
        _ => format!("internal error ({}); request id {request_id}", e.code()),
    }
}

impl From<ControlError> for ApiError {
    fn from(e: ControlError) -> Self {
        let kind = e.kind();
        let details = match &e {
            ControlError::ExecTimeout { stdout, stderr, .. } => {
                Some(serde_json::json!({"stdout": stdout, "stderr": stderr}))
            }
            ControlError::QuotaExceeded { what, limit, used } => {
                Some(serde_json::json!({"quota": what, "limit": limit, "used": used}))
            }
            _ => None,
        };
        let retry_after = e
            .retry_after_s()
            .or((wire(kind).status == StatusCode::SERVICE_UNAVAILABLE).then_some(1));
        let held_at = match &e {
            ControlError::HeldElsewhere { at, .. } => at.clone().map(Box::new),
            _ => None,
        };
        ApiError {
            kind,
            code: e.code().into(),
            message: client_message(&e),
            details,
            retry_after,
            held_at,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use torpor_control::gpu::GpuError;
    use torpor_runtime::proto::AgentErrorCode as A;

    #[test]
    fn every_kind_has_its_status_and_connect_code() {
        use ErrorKind as K;
        let table = [
            (K::InvalidArgument, 400, "invalid_argument"),
            (K::Unsupported, 400, "invalid_argument"),
            (K::Unauthenticated, 401, "unauthenticated"),
            (K::Forbidden, 403, "permission_denied"),
            (K::NotFound, 404, "not_found"),
            (K::MethodNotAllowed, 405, "unimplemented"),
            (K::AlreadyExists, 409, "already_exists"),
            (K::FailedPrecondition, 409, "failed_precondition"),
            (K::Busy, 409, "aborted"),
            (K::PayloadTooLarge, 413, "resource_exhausted"),
            (K::QuotaExceeded, 429, "resource_exhausted"),
            (K::RateLimited, 429, "resource_exhausted"),
            (K::Internal, 500, "internal"),
            (K::NotImplemented, 501, "unimplemented"),
            (K::BadGateway, 502, "unavailable"),
            (K::NoCapacity, 503, "resource_exhausted"),
            (K::Unavailable, 503, "unavailable"),
            (K::DeadlineExceeded, 504, "deadline_exceeded"),
            (K::InsufficientStorage, 507, "resource_exhausted"),
        ];
        assert_eq!(table.len(), ErrorKind::ALL.len());
        for kind in ErrorKind::ALL {
            let (_, status, connect) = table
                .iter()
                .find(|(k, ..)| *k == kind)
                .unwrap_or_else(|| panic!("{kind:?} is not in the table"));
            let w = wire(kind);
            assert_eq!(
                (w.status.as_u16(), w.connect.as_str()),
                (*status, *connect),
                "{kind:?}"
            );
        }
    }

    #[test]
    fn connect_codes_have_connects_own_statuses() {
        use ConnectCode as C;
        let table = [
            (C::Canceled, 499, "canceled"),
            (C::Unknown, 500, "unknown"),
            (C::InvalidArgument, 400, "invalid_argument"),
            (C::DeadlineExceeded, 504, "deadline_exceeded"),
            (C::NotFound, 404, "not_found"),
            (C::AlreadyExists, 409, "already_exists"),
            (C::PermissionDenied, 403, "permission_denied"),
            (C::ResourceExhausted, 429, "resource_exhausted"),
            (C::FailedPrecondition, 400, "failed_precondition"),
            (C::Aborted, 409, "aborted"),
            (C::OutOfRange, 400, "out_of_range"),
            (C::Unimplemented, 501, "unimplemented"),
            (C::Internal, 500, "internal"),
            (C::Unavailable, 503, "unavailable"),
            (C::DataLoss, 500, "data_loss"),
            (C::Unauthenticated, 401, "unauthenticated"),
        ];
        for (code, status, name) in table {
            assert_eq!((code.http_status().as_u16(), code.as_str()), (status, name));
        }
    }

    /// The statuses and codes clients saw before errors had kinds, variant by variant: the
    /// table must keep every one of them.
    #[test]
    fn domain_errors_keep_their_statuses_and_codes() {
        let agent = |code| ControlError::Agent {
            code,
            message: "m".into(),
        };
        let store = |code| ControlError::SnapshotStore {
            code,
            message: "m".into(),
        };
        let cases: Vec<(ControlError, u16, &str)> = vec![
            (
                ControlError::NotFound {
                    kind: "sandbox",
                    id: "x".into(),
                },
                404,
                "not_found",
            ),
            (
                ControlError::AlreadyExists {
                    kind: "pool",
                    id: "p".into(),
                },
                409,
                "already_exists",
            ),
            (ControlError::Invalid("x".into()), 400, "invalid_request"),
            (ControlError::Forbidden("x".into()), 403, "forbidden"),
            (
                ControlError::InvalidTransition {
                    from: torpor_core::SandboxState::Deleting,
                    to: torpor_core::Tier::Running,
                },
                409,
                "invalid_transition",
            ),
            (
                ControlError::TemplateInUse("t".into(), 1),
                409,
                "template_in_use",
            ),
            (
                ControlError::TemplateNotReady("t".into()),
                409,
                "template_not_ready",
            ),
            (
                ControlError::QuotaExceeded {
                    what: "sandboxes",
                    limit: 1,
                    used: 1,
                },
                429,
                "quota_exceeded",
            ),
            (
                ControlError::TenantInUse("t".into(), "x".into()),
                409,
                "tenant_in_use",
            ),
            (ControlError::LotFull(3), 503, "lot_full"),
            (
                ControlError::NoWorker {
                    budget_ms: 5,
                    expected_ms: None,
                },
                503,
                "no_worker_available",
            ),
            (ControlError::Busy("x".into()), 409, "sandbox_busy"),
            (ControlError::ShuttingDown, 503, "shutting_down"),
            (ControlError::Unsupported("x".into()), 400, "unsupported"),
            (
                ControlError::FeatureDisabled("x".into()),
                400,
                "feature_disabled",
            ),
            (
                ControlError::ExecTimeout {
                    timeout_ms: 1,
                    stdout: String::new(),
                    stderr: String::new(),
                },
                504,
                "exec_timeout",
            ),
            (
                ControlError::SandboxCrashed { reason: "x".into() },
                502,
                "sandbox_crashed",
            ),
            (agent(A::NotFound), 404, "file_not_found"),
            (agent(A::PermissionDenied), 403, "permission_denied"),
            (agent(A::TooLarge), 413, "too_large"),
            (agent(A::Io), 500, "io_error"),
            (agent(A::NotADirectory), 400, "not_a_directory"),
            (agent(A::IsADirectory), 400, "is_a_directory"),
            (agent(A::InvalidPath), 400, "invalid_path"),
            (agent(A::SpawnFailed), 400, "spawn_failed"),
            (agent(A::BadRequest), 400, "invalid_request"),
            (
                ControlError::Snapshot("x".into()),
                500,
                "snapshot_store_error",
            ),
            // The database out of reach: retryable; a row it cannot parse: not.
            (
                torpor_control::store::StoreError::Unavailable {
                    op: "read sandbox",
                    source: "connection closed".into(),
                }
                .into(),
                503,
                "state_store_error",
            ),
            (
                torpor_control::store::StoreError::Corrupt {
                    what: "sandbox",
                    key: "x".into(),
                }
                .into(),
                500,
                "state_store_error",
            ),
            (store("backend_remote"), 503, "backend_remote"),
            (store("backend_io"), 503, "backend_io"),
            (store("store_locked"), 503, "store_locked"),
            (store("store_lock_lost"), 503, "store_lock_lost"),
            (store("backend_no_space"), 507, "backend_no_space"),
            (store("output_no_space"), 507, "output_no_space"),
            (store("chunk_corrupt"), 500, "chunk_corrupt"),
            (
                ControlError::Io {
                    what: "reading",
                    path: "/x".into(),
                    source: std::io::Error::other("x"),
                },
                500,
                "io_error",
            ),
            (GpuError::NotConfigured.into(), 400, "gpu_not_configured"),
            (
                GpuError::BadRequest {
                    code: "gpu_request_invalid",
                    message: "m".into(),
                }
                .into(),
                400,
                "gpu_request_invalid",
            ),
            (
                GpuError::Unavailable {
                    code: "gpu_unavailable",
                    message: "m".into(),
                }
                .into(),
                503,
                "gpu_unavailable",
            ),
            (
                GpuError::Quota {
                    code: "gpu_quota_exceeded",
                    message: "m".into(),
                }
                .into(),
                429,
                "gpu_quota_exceeded",
            ),
            (GpuError::Driver("x".into()).into(), 500, "gpu_driver_error"),
            (
                GpuError::RuntimeUnsupported("x".into()).into(),
                501,
                "gpu_runtime_unsupported",
            ),
        ];
        for (e, status, code) in cases {
            let what = format!("{e:?}");
            let api = ApiError::from(e);
            assert_eq!(
                (api.status().as_u16(), api.code()),
                (status, code),
                "{what}"
            );
        }
    }

    #[test]
    fn an_unreachable_state_store_asks_for_a_retry_and_names_no_database() {
        let e: ControlError = torpor_control::store::StoreError::Unavailable {
            op: "read sandbox",
            source: "postgres://torpor@db.internal:5432/torpor: connection refused".into(),
        }
        .into();
        let api = ApiError::from(e);
        assert_eq!(api.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(api.connect_code(), ConnectCode::Unavailable);
        assert_eq!(api.retry_after, Some(1));
        assert!(api.message().contains("retry"), "{}", api.message());
        assert!(!api.message().contains("db.internal"), "{}", api.message());
    }

    /// envd's Connect codes as they were before kinds, where they were chosen on purpose.
    #[test]
    fn domain_errors_keep_their_connect_codes() {
        let agent = |code| {
            ApiError::from(ControlError::Agent {
                code,
                message: "m".into(),
            })
            .connect_code()
        };
        use ConnectCode as C;
        assert_eq!(agent(A::NotFound), C::NotFound);
        assert_eq!(agent(A::PermissionDenied), C::PermissionDenied);
        assert_eq!(agent(A::TooLarge), C::ResourceExhausted);
        assert_eq!(agent(A::InvalidPath), C::InvalidArgument);
        assert_eq!(agent(A::Io), C::Internal);
        let of = |e: ControlError| ApiError::from(e).connect_code();
        assert_eq!(
            of(ControlError::NoWorker {
                budget_ms: 1,
                expected_ms: None
            }),
            C::ResourceExhausted
        );
        assert_eq!(of(ControlError::LotFull(1)), C::ResourceExhausted);
        assert_eq!(of(ControlError::ShuttingDown), C::Unavailable);
        assert_eq!(
            of(ControlError::SandboxCrashed { reason: "x".into() }),
            C::Unavailable
        );
        assert_eq!(of(ControlError::Invalid("x".into())), C::InvalidArgument);
        assert_eq!(
            of(ControlError::Unsupported("x".into())),
            C::InvalidArgument
        );
        assert_eq!(
            of(ControlError::ExecTimeout {
                timeout_ms: 1,
                stdout: String::new(),
                stderr: String::new()
            }),
            C::DeadlineExceeded
        );
        assert_eq!(of(ControlError::Forbidden("x".into())), C::PermissionDenied);
    }

    #[test]
    fn a_call_refused_by_admission_says_when_to_retry() {
        let api = ApiError::from(ControlError::NoWorker {
            budget_ms: 1000,
            expected_ms: Some(2500),
        });
        assert_eq!(api.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(api.code, "no_worker_available");
        assert_eq!(api.retry_after, Some(3));
        let resp = api.into_response();
        assert_eq!(resp.headers()[header::RETRY_AFTER], "3");
    }

    #[test]
    fn internal_errors_tell_clients_the_code_and_request_id_never_the_details() {
        let e = ControlError::Io {
            what: "reading",
            path: "/var/lib/torpor/sandboxes/sb-x/checkpoint".into(),
            source: std::io::Error::other("disk on fire"),
        };
        let api = ApiError::from(e);
        assert_eq!(api.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(api.code, "io_error");
        assert!(!api.message.contains("/var/lib"), "{}", api.message);
        assert!(!api.message.contains("fire"), "{}", api.message);
        assert!(api.message.contains("request id"), "{}", api.message);
        // Snapshot store text names host paths too.
        let api = ApiError::from(ControlError::Snapshot(
            "open /var/lib/torpor/snapshots/x: no such file".into(),
        ));
        assert!(!api.message.contains("/var/lib"), "{}", api.message);
        // Errors meant for clients keep their text.
        let api = ApiError::from(ControlError::NoWorker {
            budget_ms: 5,
            expected_ms: None,
        });
        assert_eq!(api.message, "no worker became free within 5 ms");
        assert_eq!(api.retry_after, Some(1));
        let api = ApiError::from(ControlError::Invalid("cmd is empty".into()));
        assert_eq!(api.message, "invalid request: cmd is empty");
        assert_eq!(api.retry_after, None);
    }

    #[tokio::test]
    async fn a_failed_engine_task_is_internal_and_its_text_stays_in_the_log() {
        let join = tokio::spawn(async { panic!("cannot read /var/lib/torpor/x") })
            .await
            .unwrap_err();
        let api = ApiError::from(ControlError::TaskFailed {
            what: "image import",
            source: join,
        });
        assert_eq!((api.status().as_u16(), api.code()), (500, "task_failed"));
        assert_eq!(api.connect_code(), ConnectCode::Internal);
        assert!(!api.message.contains("/var/lib"), "{}", api.message);
        assert!(!api.message.contains("panic"), "{}", api.message);
    }

    #[test]
    fn an_error_answers_in_the_one_shape_with_retry_after() {
        let resp = ApiError::new(ErrorKind::RateLimited, "rate_limited", "slow down")
            .with_retry_after(3)
            .into_response();
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "3");
    }
}
