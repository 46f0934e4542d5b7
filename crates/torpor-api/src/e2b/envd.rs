//! envd's `process.Process` service and `/health`: E2B processes on torpor's agent.
//!
//! Every E2B process is started by the agent's `Spawn` (one spawn, [`start`]); a sandbox whose
//! agent predates it (restored from an older snapshot) runs it under a supervisor shell
//! instead. Either way the process's state lives in the sandbox, under
//! `/run/e2b/proc/k<key>/`: its output (`out`, `err`), its config and, once it ended, an empty
//! `exit-<status>` marker, so a process and everything about it survives pause and connect.
//! Streams follow those files with the agent's `ListChanged` ([`follow`]); a stream never
//! wakes a sandbox nor keeps it from sleeping for more than one wait, and it ends with
//! `unavailable` when the sandbox goes to sleep under it. Input, signals and resizes are in
//! [`input`], the wire messages and events in [`messages`].
//!
//! This module owns the call's context (sandbox, token, rate, E2B pause), `/health`, the
//! helper exec and the method dispatch.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request as HttpRequest, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use futures::StreamExt as _;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::mpsc;
use torpor_core::{SandboxId, TenantId};
use torpor_runtime::proto::{
    AgentErrorCode, DirEntry, ExecRequest, FileKind, PtySize, Request, SpawnRequest,
};

use super::connect::{self, Code, Framing, Item, RpcError};
use super::{E2b, E2bError};
use crate::auth::constant_time_eq;
use torpor_control::{Progress, SpawnProgress};

/// Where process state lives inside the sandbox.
pub const PROC_DIR: &str = "/run/e2b/proc";
pub use super::paths::HOME;

mod follow;
mod input;
mod messages;
mod start;

use follow::*;
use input::*;
pub use messages::*;
use start::*;

/// A call's sandbox, from `E2b-Sandbox-Id`, authorised by `X-Access-Token`.
pub struct Ctx {
    pub tenant: TenantId,
    pub id: SandboxId,
    /// A sandbox of E2B's `base`: calls act as `user` unless they name `root`.
    pub base: bool,
}

/// Why a call cannot reach a sandbox.
pub enum CtxError {
    Missing(&'static str),
    Unauthenticated,
    UnknownSandbox(String),
    /// Paused through E2B, without auto-resume: not running until `connect`.
    Paused(String),
    /// Over the owner's rate (its status and message).
    RateLimited(String),
    Internal(String),
}

impl CtxError {
    pub fn rpc(&self) -> RpcError {
        match self {
            CtxError::Missing(h) => {
                RpcError::new(Code::InvalidArgument, format!("missing {h} header"))
            }
            CtxError::Unauthenticated => RpcError::new(
                Code::Unauthenticated,
                "invalid X-Access-Token for this sandbox",
            ),
            CtxError::UnknownSandbox(id) => {
                RpcError::new(Code::NotFound, format!("sandbox {id:?} not found"))
            }
            CtxError::Paused(id) => RpcError::new(
                Code::Unavailable,
                format!("sandbox {id:?} is paused; connect to it to resume it"),
            ),
            CtxError::RateLimited(m) => RpcError::new(Code::ResourceExhausted, m.clone()),
            CtxError::Internal(m) => RpcError::new(Code::Internal, m.clone()),
        }
    }

    /// The envd HTTP shape. An unknown sandbox is answered as E2B's edge does: 502.
    pub fn http(&self) -> E2bError {
        match self {
            CtxError::Missing(_) => E2bError::bad_request(self.rpc().message),
            CtxError::Unauthenticated => {
                E2bError::new(StatusCode::UNAUTHORIZED, self.rpc().message)
            }
            CtxError::UnknownSandbox(id) => E2bError::new(
                StatusCode::BAD_GATEWAY,
                format!("The sandbox {id} was not found"),
            ),
            // As E2B's edge answers for a paused sandbox (the SDK's is_running reads 502 as
            // not running).
            CtxError::Paused(id) => E2bError::new(
                StatusCode::BAD_GATEWAY,
                format!("The sandbox {id} is paused"),
            ),
            CtxError::RateLimited(m) => E2bError::new(StatusCode::TOO_MANY_REQUESTS, m.clone()),
            CtxError::Internal(m) => E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, m.clone()),
        }
    }
}

/// Whether a call wakes a sandbox paused through E2B with auto-resume, as every call to it
/// does on E2B's edge, or leaves it asleep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AutoResume {
    Wake,
    /// A watcher's poll (`GetWatcherEvents`): nothing changes in a sleeping sandbox's files,
    /// so it is answered from what is buffered, and the sandbox stays paused to E2B.
    Leave,
}

/// The sandbox a call acts on, its access token checked, and a token of its owner's rate for
/// `class` taken.
pub fn ctx(
    st: &E2b,
    headers: &HeaderMap,
    class: crate::ratelimit::RouteClass,
) -> Result<Ctx, CtxError> {
    ctx_with(st, headers, class, AutoResume::Wake)
}

fn ctx_with(
    st: &E2b,
    headers: &HeaderMap,
    class: crate::ratelimit::RouteClass,
    resume: AutoResume,
) -> Result<Ctx, CtxError> {
    let raw = headers
        .get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .ok_or(CtxError::Missing("E2b-Sandbox-Id"))?;
    let id = SandboxId::new(raw).map_err(|_| CtxError::UnknownSandbox(raw.to_string()))?;
    // As E2B's edge: an unknown sandbox is told before the token is looked at.
    let rec = match st.api.engine.sandbox(&TenantId::admin(), &id) {
        Ok(rec) if !super::is_snapshot(&rec) => rec,
        Ok(_) | Err(torpor_control::ControlError::NotFound { .. }) => {
            return Err(CtxError::UnknownSandbox(raw.to_string()))
        }
        Err(e) => return Err(CtxError::Internal(E2bError::from(e).message)),
    };
    let token = headers
        .get("x-access-token")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .ok_or(CtxError::Unauthenticated)?;
    if !constant_time_eq(token.as_bytes(), st.access_token(&id).as_bytes()) {
        return Err(CtxError::Unauthenticated);
    }
    ctx_for_with(st, rec, raw, class, resume)
}

/// The rest of [`ctx`] once the caller is authorised for sandbox `rec` (by its token, or a
/// signed URL's signature): the owner's rate, and E2B's pause.
pub fn ctx_for(
    st: &E2b,
    rec: torpor_control::SandboxRecord,
    raw: &str,
    class: crate::ratelimit::RouteClass,
) -> Result<Ctx, CtxError> {
    ctx_for_with(st, rec, raw, class, AutoResume::Wake)
}

fn ctx_for_with(
    st: &E2b,
    rec: torpor_control::SandboxRecord,
    raw: &str,
    class: crate::ratelimit::RouteClass,
    resume: AutoResume,
) -> Result<Ctx, CtxError> {
    let id = rec.id.clone();
    let tenant = rec.tenant.clone();
    crate::request_id::set_caller(&tenant);
    crate::ratelimit::check(&st.api, &tenant, class)
        .map_err(|e| CtxError::RateLimited(e.message().to_string()))?;
    // Paused through E2B: refused as E2B refuses it, or (auto-resume) woken by this call,
    // which the engine does; E2B's view changes first so is_running answers true again. A
    // call that leaves it asleep changes nothing.
    if rec.metadata.contains_key(super::META_PAUSED) {
        if !super::auto_resumes(&rec) {
            return Err(CtxError::Paused(raw.to_string()));
        }
        if resume == AutoResume::Wake {
            super::mark_resumed(&st.api.engine, &rec, None)
                .map_err(|e| CtxError::Internal(E2bError::from(e).message))?;
            tracing::info!(sandbox = %id, "e2b auto-resume");
        }
    }
    Ok(Ctx {
        tenant,
        id,
        base: rec.template.as_str() == super::base::BASE,
    })
}

/// The start of every Connect-RPC call: its framing (content type) and its sandbox (the
/// `E2b-Sandbox-Id` and `X-Access-Token` headers), or the error answer in the right framing.
pub fn rpc_call(
    st: &E2b,
    headers: &HeaderMap,
    class: crate::ratelimit::RouteClass,
    resume: AutoResume,
) -> Result<(connect::Framing, Ctx), Box<Response>> {
    let framing = connect::framing(headers).map_err(|e| Box::new(connect::unary_err(&e)))?;
    let c = ctx_with(st, headers, class, resume)
        .map_err(|e| Box::new(connect::error_response(framing, &e.rpc())))?;
    Ok((framing, c))
}

/// GET /health → 204, waking the sandbox if torpor's idle policy put it to sleep (E2B sees it
/// running) or if it auto-resumes; 502 if it is paused through E2B (see [`ctx`]).
pub async fn health(State(st): State<Arc<E2b>>, headers: HeaderMap) -> Response {
    let c = match ctx(&st, &headers, crate::ratelimit::RouteClass::Lifecycle) {
        Ok(c) => c,
        Err(e) => return e.http().into_response(),
    };
    match st.api.engine.resume(&c.tenant, &c.id).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => E2bError::from(e).into_response(),
    }
}

/// Makes E2B's home directory; best effort (a template without a shell still works). Asks
/// the agent first (one call): `base`'s broker has made it already, and a process spawn inside
/// gVisor costs tens of milliseconds of every create. [`PROC_DIR`] is made by the first
/// process start (the agent's `Spawn`, or the supervisor's config write).
pub async fn ensure_home(st: &E2b, tenant: &TenantId, id: &SandboxId) {
    if st.api.engine.list_files(tenant, id, HOME).await.is_ok() {
        return;
    }
    let req = ExecRequest {
        cmd: vec!["mkdir".into(), "-p".into(), HOME.into()],
        env: BTreeMap::new(),
        cwd: None,
        timeout_ms: Some(10_000),
        detach: false,
        stream: false,
    };
    if let Err(e) = st.api.engine.exec(tenant, id, req, Vec::new()).await {
        tracing::debug!(sandbox = %id, error = %e, "cannot make the e2b home");
    }
}

/// Runs a short helper command in the sandbox; answers (exit code, stdout, stderr).
pub async fn run<S: AsRef<str>>(
    st: &E2b,
    c: &Ctx,
    cmd: &[S],
    stdin: Vec<u8>,
) -> Result<(i32, String, String), RpcError> {
    let req = ExecRequest {
        cmd: cmd.iter().map(|s| s.as_ref().to_string()).collect(),
        env: BTreeMap::new(),
        cwd: None,
        timeout_ms: Some(30_000),
        detach: false,
        stream: false,
    };
    let r = st.api.engine.exec(&c.tenant, &c.id, req, stdin).await?;
    Ok((r.exit_code.unwrap_or(-1), r.stdout, r.stderr))
}

// ------------------------------------------------------------------ the service

/// POST /process.Process/{method}. Nothing of the body is read before the call is
/// authorised. The client stream `StreamInput` then reads its body as it arrives; every other
/// method reads its one message whole (at most an envelope of [`connect::MAX_MESSAGE`]).
pub async fn process_rpc(
    State(st): State<Arc<E2b>>,
    Path(method): Path<String>,
    req: HttpRequest,
) -> Response {
    let headers = req.headers().clone();
    let (framing, c) = match rpc_call(
        &st,
        &headers,
        crate::ratelimit::RouteClass::Exec,
        AutoResume::Wake,
    ) {
        Ok(fc) => fc,
        Err(resp) => return *resp,
    };
    let (body, input) = if method == "StreamInput" {
        (Bytes::new(), Some(req.into_body()))
    } else {
        match connect::read_message_body(&headers, req.into_body()).await {
            Ok(b) => (b, None),
            Err(e) => return connect::error_response(framing, &e),
        }
    };
    let streaming = matches!(method.as_str(), "Start" | "Connect" | "StreamInput");
    let known = streaming
        || matches!(
            method.as_str(),
            "List" | "SendInput" | "SendSignal" | "CloseStdin" | "Update"
        );
    if let Err(e) = connect::check_method("process.Process", &method, known, streaming, framing) {
        return connect::error_response(framing, &e);
    }
    let keepalive = headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map_or(Duration::from_secs(30), Duration::from_secs);
    let deadline = connect::timeout(&headers).map(|t| Instant::now() + t);
    let result = match method.as_str() {
        "Start" => {
            let who = super::base::identity(c.base, super::paths::basic_user(&headers).as_deref());
            start(st, c, &body, who, keepalive, deadline).await
        }
        "Connect" => attach(st, c, &body, keepalive, deadline).await,
        "List" => list(&st, &c).await,
        "SendInput" => send_input(&st, &c, &body).await,
        "SendSignal" => send_signal(&st, &c, &body).await,
        "CloseStdin" => close_stdin(&st, &c, &body).await,
        "Update" => update(&st, &c, &body).await,
        "StreamInput" => stream_input(&st, &c, input.unwrap_or_default(), deadline).await,
        _ => unreachable!("checked above"),
    };
    result.unwrap_or_else(|e| connect::error_response(framing, &e))
}

#[doc(hidden)]
pub mod fuzzing;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_have_envd_json_shapes() {
        assert_eq!(event_start(7), json!({"event": {"start": {"pid": 7}}}));
        assert_eq!(
            event_data(1, b"hi"),
            json!({"event": {"data": {"stdout": "aGk="}}})
        );
        assert_eq!(
            event_data(2, b"hi"),
            json!({"event": {"data": {"stderr": "aGk="}}})
        );
        assert_eq!(
            event_end(&ExitStatus::Code(3)),
            json!({"event": {"end": {"exitCode": 3, "exited": true, "status": "exit status 3"}}})
        );
        assert_eq!(
            event_end(&ExitStatus::Signal("killed".into()))["event"]["end"]["status"],
            "signal: killed"
        );
        assert_eq!(parse_signal(Some(&json!("SIGNAL_SIGKILL"))).unwrap(), 9);
        assert_eq!(parse_signal(Some(&json!(15))).unwrap(), 15);
        assert!(parse_signal(Some(&json!("SIGNAL_UNSPECIFIED"))).is_err());
        assert!(parse_signal(None).is_err());
    }

    #[test]
    fn process_state_comes_from_the_supervisor_files() {
        let e = |name: &str, size| DirEntry {
            name: name.into(),
            kind: FileKind::File,
            size,
            mode: 0o644,
            modified_ms: 0,
            uid: 0,
            gid: 0,
        };
        let s = proc_state(&[e("config", 9), e("out", 0), e("err", 0)]);
        assert!(!s.started && s.exit.is_none());
        let s = proc_state(&[e("pid", 3), e("out", 5), e("err", 2)]);
        assert_eq!(
            (s.started, s.out_len, s.err_len, s.exit),
            (true, 5, 2, None)
        );
        let s = proc_state(&[e("pid", 3), e("exit-3", 0)]);
        assert_eq!(s.exit, Some(ExitStatus::Code(3)));
        let s = proc_state(&[e("pid", 3), e("signaled", 0), e("exit-137", 0)]);
        assert_eq!(s.exit, Some(ExitStatus::Signal("killed".into())));
        // A shell's own `exit 137` is not a signal.
        let s = proc_state(&[e("pid", 3), e("exit-137", 0)]);
        assert_eq!(s.exit, Some(ExitStatus::Code(137)));
    }

    #[test]
    fn a_followed_spawns_progress_ends_the_stream_only_when_all_its_output_came() {
        let p = |exit, signaled, out_len, err_len| Progress {
            exit,
            signaled,
            out_len,
            err_len,
            out: Vec::new(),
            err: Vec::new(),
        };
        let started: BTreeMap<String, u64> = [("config", 9), ("out", 0), ("err", 0), ("pid", 3)]
            .map(|(k, v)| (k.to_string(), v))
            .into();
        // Ended, and all of it came.
        let mut known = started.clone();
        let end = after_progress(&p(Some(3), false, 4, 2), (4, 2), &mut known);
        assert_eq!(end, Some(ExitStatus::Code(3)));
        let end = after_progress(&p(Some(137), true, 0, 0), (0, 0), &mut known);
        assert_eq!(end, Some(ExitStatus::Signal("killed".into())));
        // Ended with more output than the reply carried: follow on, looking at once.
        let mut known = started.clone();
        let end = after_progress(&p(Some(0), false, 3 << 20, 0), (1 << 20, 0), &mut known);
        assert_eq!(end, None);
        assert!(known.is_empty(), "{known:?}");
        let mut known = started.clone();
        let end = after_progress(&p(Some(0), false, 0, 5 << 20), (0, 1 << 20), &mut known);
        assert_eq!(end, None);
        assert!(known.is_empty(), "{known:?}");
        // Running: follow on from the listing with what came.
        let mut known = started.clone();
        let end = after_progress(&p(None, false, 6, 0), (6, 0), &mut known);
        assert_eq!(end, None);
        assert_eq!(known["out"], 6);
        assert_eq!(known["err"], 0);
        assert_eq!(known["pid"], 3, "the rest of the listing stays");
    }

    #[test]
    fn start_requests_parse_like_the_sdk_sends_them() {
        let body = br#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"}},"stdin":false}"#;
        let framed = connect::envelope(0, body);
        let r: StartRequest = connect::parse_request(Framing::Stream, &framed).unwrap();
        let p = r.process.unwrap();
        assert_eq!(p.cmd, "/bin/bash");
        assert_eq!(p.args, ["-l", "-c", "echo hi"]);
        assert_eq!(p.envs["A"], "1");
        assert_eq!(r.stdin, Some(false));
    }
}
