//! envd's `process.Process` service and `/health`, on torpor's exec and file machinery.
//!
//! Every E2B process is a detached torpor exec of a small supervisor shell ([`SUPERVISOR`])
//! that keeps the process's state in the sandbox, under `/run/e2b/proc/k<key>/`: its output
//! (`out`, `err`), its stdin (a FIFO `in`, held open by a `holder` until CloseStdin), its config
//! and, once it ended, an empty `exit-<status>` marker. State in the sandbox's own filesystem is part of every
//! checkpoint, so a process and everything about it survives pause and connect. Streams follow
//! those files with the agent's `ListChanged` (a wait inside the sandbox that answers as soon as
//! a file grows or appears); a stream never wakes a sandbox nor keeps it from sleeping for more
//! than one wait, and it ends with `unavailable` when the sandbox goes to sleep under it.

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
    AgentErrorCode, DirEntry, ExecRequest, FileKind, PtySize, Reply, Request, SpawnRequest,
};

use super::connect::{self, Code, Framing, Item, RpcError};
use super::{E2b, E2bError};
use crate::server::constant_time_eq;

/// Where process state lives inside the sandbox.
pub const PROC_DIR: &str = "/run/e2b/proc";
/// E2B's default user home: commands start there, relative paths resolve against it.
pub const HOME: &str = "/home/user";

/// The supervisor: `sh -c SUPERVISOR sh KEY STDIN CWD CMD ARGS...`, run as a detached exec
/// (its own process group, whose id is its pid: the E2B pid). Its directory
/// `/run/e2b/proc/k<KEY>/` is made (with `config`) by the adapter beforehand, so that it needs
/// no spawn of its own besides the command (and, for stdin, `mkfifo` and the FIFO's holder):
/// everything else is shell builtins. `/run/e2b/proc/<pid>` names the key of a pid. The
/// supervisor ignores TERM once the command runs, so it outlives a TERM to the group and
/// records the status; a KILL takes it too, and the signalling helper records that.
pub const SUPERVISOR: &str = r#"d=/run/e2b/proc/k$1
printf '%s' "$1" > "/run/e2b/proc/$$"
: > "$d/out"; : > "$d/err"
if [ "$2" = 1 ]; then
  mkfifo "$d/in" || exit 111
  sleep 2147483647 > "$d/in" &
  echo $! > "$d/holder"
  exec 3< "$d/in"
else
  exec 3< /dev/null
fi
cwd=$3; shift 3
[ -n "$cwd" ] || cd /home/user 2>/dev/null || cd /
if [ -n "$cwd" ] && ! cd "$cwd" 2>> "$d/err"; then
  rc=1
else
  "$@" <&3 3<&- > "$d/out" 2> "$d/err" &
  c=$!
  exec 3<&-
  trap '' TERM HUP
  echo $c > "$d/pid"
  wait $c
  rc=$?
fi
if [ -f "$d/holder" ]; then read h < "$d/holder"; kill "$h" 2>/dev/null; fi
: > "$d/exit-$rc"
"#;

/// A call's sandbox, from `E2b-Sandbox-Id`, authorised by `X-Access-Token`.
pub struct Ctx {
    pub tenant: TenantId,
    pub id: SandboxId,
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

/// The sandbox a call acts on, its access token checked, and a token of its owner's rate for
/// `class` taken.
pub fn ctx(
    st: &E2b,
    headers: &HeaderMap,
    class: crate::ratelimit::RouteClass,
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
        Ok(rec) => rec,
        Err(torpor_control::ControlError::NotFound { .. }) => {
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
    let tenant = rec.tenant.clone();
    crate::request_id::set_caller(&tenant);
    crate::ratelimit::check(&st.api, &tenant, class)
        .map_err(|e| CtxError::RateLimited(e.message().to_string()))?;
    // Paused through E2B: refused as E2B refuses it, or (auto-resume) woken by this call,
    // which the engine does; E2B's view changes first so is_running answers true again.
    if rec.metadata.contains_key(super::META_PAUSED) {
        if !super::auto_resumes(&rec) {
            return Err(CtxError::Paused(raw.to_string()));
        }
        super::mark_resumed(&st.api.engine, &rec, None)
            .map_err(|e| CtxError::Internal(E2bError::from(e).message))?;
        tracing::info!(sandbox = %id, "e2b auto-resume");
    }
    Ok(Ctx { tenant, id })
}

/// The start of every Connect-RPC call: its framing (content type) and its sandbox (the
/// `E2b-Sandbox-Id` and `X-Access-Token` headers), or the error answer in the right framing.
pub fn rpc_call(
    st: &E2b,
    headers: &HeaderMap,
    class: crate::ratelimit::RouteClass,
) -> Result<(connect::Framing, Ctx), Box<Response>> {
    let framing = connect::framing(headers).map_err(|e| Box::new(connect::unary_err(&e)))?;
    let c = ctx(st, headers, class)
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

/// Makes E2B's home directory; best effort (a template without a shell still works).
pub async fn ensure_home(st: &E2b, tenant: &TenantId, id: &SandboxId) {
    let req = ExecRequest {
        cmd: vec!["mkdir".into(), "-p".into(), HOME.into(), PROC_DIR.into()],
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
pub async fn run(
    st: &E2b,
    c: &Ctx,
    cmd: &[&str],
    stdin: Vec<u8>,
) -> Result<(i32, String, String), RpcError> {
    let req = ExecRequest {
        cmd: cmd.iter().map(|s| s.to_string()).collect(),
        env: BTreeMap::new(),
        cwd: None,
        timeout_ms: Some(30_000),
        detach: false,
        stream: false,
    };
    let r = st.api.engine.exec(&c.tenant, &c.id, req, stdin).await?;
    Ok((r.exit_code.unwrap_or(-1), r.stdout, r.stderr))
}

// ------------------------------------------------------------------ messages

#[derive(Debug, Default, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct ProcessConfig {
    pub cmd: String,
    pub args: Vec<String>,
    pub envs: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StartRequest {
    process: Option<ProcessConfig>,
    pty: Option<PtyRequest>,
    tag: Option<String>,
    stdin: Option<bool>,
}

/// `{"size": {"cols": 80, "rows": 24}}`
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct PtyRequest {
    size: Option<PtySizeJson>,
}

#[derive(Debug, Default, Clone, Copy, Serialize, Deserialize)]
#[serde(default)]
struct PtySizeJson {
    cols: u32,
    rows: u32,
}

impl PtyRequest {
    fn size(&self) -> Result<PtySize, RpcError> {
        let s = self.size.unwrap_or(PtySizeJson { cols: 80, rows: 24 });
        let ok = |n: u32| (1..=u16::MAX as u32).contains(&n);
        if !ok(s.cols) || !ok(s.rows) {
            return Err(RpcError::new(
                Code::InvalidArgument,
                format!(
                    "pty.size: cols and rows must be 1-65535, got {}x{}",
                    s.cols, s.rows
                ),
            ));
        }
        Ok(PtySize {
            cols: s.cols as u16,
            rows: s.rows as u16,
        })
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct UpdateRequest {
    process: Option<Selector>,
    pty: Option<PtyRequest>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Selector {
    pid: Option<u32>,
    tag: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SelectorRequest {
    process: Option<Selector>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SendInputRequest {
    process: Option<Selector>,
    input: Option<ProcessInput>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ProcessInput {
    stdin: Option<String>,
    pty: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SendSignalRequest {
    process: Option<Selector>,
    signal: Option<serde_json::Value>,
}

/// What the supervisor records about a process (its `config` file).
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct Recorded {
    config: ProcessConfig,
    #[serde(skip_serializing_if = "Option::is_none")]
    tag: Option<String>,
    /// Run on a terminal (its output is `pty` data).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pty: bool,
}

pub fn event_start(pid: u32) -> serde_json::Value {
    json!({"event": {"start": {"pid": pid}}})
}

/// A data event: fd 1 stdout, 2 stderr, [`PTY_FD`] a terminal's output.
pub fn event_data(fd: u8, bytes: &[u8]) -> serde_json::Value {
    let b = base64::engine::general_purpose::STANDARD.encode(bytes);
    match fd {
        1 => json!({"event": {"data": {"stdout": b}}}),
        PTY_FD => json!({"event": {"data": {"pty": b}}}),
        _ => json!({"event": {"data": {"stderr": b}}}),
    }
}

/// The pseudo-fd of a terminal's output in [`event_data`].
pub const PTY_FD: u8 = 3;

/// The end event, as Go's envd words it.
pub fn event_end(status: &ExitStatus) -> serde_json::Value {
    match status {
        ExitStatus::Code(c) => json!({"event": {"end": {
            "exitCode": c, "exited": true, "status": format!("exit status {c}")
        }}}),
        ExitStatus::Signal(name) => json!({"event": {"end": {
            "exitCode": -1, "exited": false, "status": format!("signal: {name}")
        }}}),
    }
}

pub fn event_keepalive() -> serde_json::Value {
    json!({"event": {"keepalive": {}}})
}

#[derive(Debug, Clone, PartialEq)]
pub enum ExitStatus {
    Code(i32),
    Signal(String),
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
    let (framing, c) = match rpc_call(&st, &headers, crate::ratelimit::RouteClass::Exec) {
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
        "Start" => start(st, c, &body, keepalive, deadline).await,
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

/// A `Start` request checked: the request, its pty size (if a pty is asked for) and the
/// process, which must name a command. The fuzz entry point runs this too.
fn parse_start(body: &[u8]) -> Result<(StartRequest, Option<PtySize>, ProcessConfig), RpcError> {
    let mut req: StartRequest = connect::parse_request(Framing::Stream, body)?;
    let pty = req.pty.as_ref().map(PtyRequest::size).transpose()?;
    let config = req
        .process
        .take()
        .ok_or_else(|| RpcError::new(Code::InvalidArgument, "process is required"))?;
    if config.cmd.is_empty() {
        return Err(RpcError::new(
            Code::InvalidArgument,
            "process.cmd is required",
        ));
    }
    Ok((req, pty, config))
}

async fn start(
    st: Arc<E2b>,
    c: Ctx,
    body: &[u8],
    keepalive: Duration,
    deadline: Option<Instant>,
) -> Result<Response, RpcError> {
    let (req, pty, config) = parse_start(body)?;
    let cwd = match &config.cwd {
        Some(d) if !d.is_empty() => super::fs::resolve(d, None)?,
        // The home, or `/` when there is none.
        _ => String::new(),
    };
    let recorded = serde_json::to_vec(&Recorded {
        config: config.clone(),
        tag: req.tag.clone(),
        pty: pty.is_some(),
    })
    .expect("json");
    let key = new_key();
    let dir = key_dir(&key);
    let mut env = config.envs.clone();
    env.entry("HOME".into()).or_insert_with(|| HOME.into());
    let mut cmd = vec![config.cmd.clone()];
    cmd.extend(config.args.iter().cloned());
    let stdin = req.stdin.unwrap_or(false);
    let spawn = SpawnRequest {
        cmd,
        env,
        cwd: Some(cwd),
        dir: dir.clone(),
        index_dir: PROC_DIR.into(),
        key,
        stdin,
        pty,
    };
    let pid = match spawn_in_agent(&st, &c, spawn.clone(), &recorded).await? {
        Some(pid) => pid,
        None if pty.is_some() => return Err(RpcError::new(Code::Unimplemented, NO_TERMINALS)),
        None => spawn_supervised(&st, &c, spawn, &recorded).await?,
    };
    // What the agent's `Spawn` leaves: the first wait then answers only on a change (output or
    // the exit), not at once. (Anything else, such as a supervisor's files, answers at once.)
    // (Sending that wait beside the `Spawn` instead of after it was tried: under gVisor's
    // ptrace platform its polling slowed the spawn more than the round trip it saved.)
    let known = [
        ("config", recorded.len() as u64),
        ("out", 0),
        ("err", 0),
        ("pid", pid.to_string().len() as u64),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let fd_out = if pty.is_some() { PTY_FD } else { 1 };
    let f = Follow {
        pid,
        dir,
        fd_out,
        keepalive,
        deadline,
        known,
    };
    Ok(f.stream(st, c, (0, 0)))
}

const NO_TERMINALS: &str = "this sandbox's agent predates terminals: PTY processes need a \
                            sandbox made by this torpor";

/// Starts a process through the agent's `Spawn` (one spawn, its state in its directory):
/// `Ok(None)` when the sandbox's agent predates `Spawn` (restored from an older snapshot).
async fn spawn_in_agent(
    st: &E2b,
    c: &Ctx,
    mut spawn: SpawnRequest,
    recorded: &[u8],
) -> Result<Option<u32>, RpcError> {
    if is_legacy(st, c) {
        return Ok(None);
    }
    let default_cwd = spawn.cwd.as_deref() == Some("");
    if default_cwd {
        spawn.cwd = Some(HOME.into());
    }
    loop {
        let call =
            st.api
                .engine
                .agent_call(&c.tenant, &c.id, Request::Spawn(spawn.clone()), recorded);
        match tokio::time::timeout(LEGACY_GRACE, call).await {
            Ok(Ok((Reply::Started { pid }, _))) => return Ok(Some(pid)),
            Ok(Ok((other, _))) => {
                return Err(RpcError::new(
                    Code::Internal,
                    format!("unexpected agent reply {other:?}"),
                ))
            }
            Ok(Err(torpor_control::ControlError::Agent {
                code: AgentErrorCode::NotFound,
                message,
            })) if message.starts_with("cwd ") => {
                if default_cwd && spawn.cwd.as_deref() == Some(HOME) {
                    // No home in this sandbox: start in `/`.
                    spawn.cwd = Some("/".into());
                    continue;
                }
                return Err(RpcError::new(
                    Code::InvalidArgument,
                    format!(
                        "cwd '{}' does not exist",
                        spawn.cwd.as_deref().unwrap_or_default()
                    ),
                ));
            }
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => {
                tracing::info!(sandbox = %c.id, "agent without Spawn; using the supervisor shell");
                mark_legacy(st, c);
                return Ok(None);
            }
        }
    }
}

fn is_legacy(st: &E2b, c: &Ctx) -> bool {
    st.legacy_agents
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains(&c.id)
}

fn mark_legacy(st: &E2b, c: &Ctx) {
    st.legacy_agents
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(c.id.clone());
}

/// Starts a process under [`SUPERVISOR`] (agents without `Spawn`): a detached exec of a shell
/// that runs the command and records its state.
async fn spawn_supervised(
    st: &E2b,
    c: &Ctx,
    spawn: SpawnRequest,
    recorded: &[u8],
) -> Result<u32, RpcError> {
    // Makes the directory too: the supervisor then needs no `mkdir`.
    st.api
        .engine
        .write_file(
            &c.tenant,
            &c.id,
            &format!("{}/config", spawn.dir),
            None,
            recorded,
        )
        .await?;
    let mut cmd = vec![
        "/bin/sh".to_string(),
        "-c".into(),
        SUPERVISOR.into(),
        "sh".into(),
        spawn.key,
        if spawn.stdin { "1" } else { "0" }.into(),
        spawn.cwd.unwrap_or_default(),
    ];
    cmd.extend(spawn.cmd);
    let exec = ExecRequest {
        cmd,
        env: spawn.env,
        cwd: None,
        timeout_ms: None,
        detach: true,
        stream: false,
    };
    let r = st
        .api
        .engine
        .exec(&c.tenant, &c.id, exec, Vec::new())
        .await?;
    let pid: u32 = r.stdout.trim().parse().map_err(|_| {
        RpcError::new(
            Code::Internal,
            format!("the process could not be started: {}", r.stderr.trim()),
        )
    })?;
    // Answer once the supervisor has set the process up, so that whatever the client does with
    // the pid next (list it, write to its stdin, signal it) finds it.
    wait_ready(st, c, pid, &spawn.dir).await?;
    Ok(pid)
}

/// A fresh process key (lowercase letters and digits).
fn new_key() -> String {
    torpor_core::SandboxId::generate()
        .as_str()
        .chars()
        .filter(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        .collect()
}

fn key_dir(key: &str) -> String {
    format!("{PROC_DIR}/k{key}")
}

/// The directory of process `pid`, from its index file; not_found when there is none.
async fn dir_of(st: &E2b, c: &Ctx, pid: u32) -> Result<String, RpcError> {
    let raw = read(st, c, &format!("{PROC_DIR}/{pid}"))
        .await
        .map_err(no_such_process(pid))?;
    let key = String::from_utf8_lossy(&raw).trim().to_string();
    if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric()) {
        return Err(RpcError::new(
            Code::NotFound,
            format!("process with pid {pid} not found"),
        ));
    }
    Ok(key_dir(&key))
}

/// Waits until the supervisor of `pid` has started the process (or recorded that it could not).
async fn wait_ready(st: &E2b, c: &Ctx, pid: u32, dir: &str) -> Result<(), RpcError> {
    let t = Instant::now();
    let mut known = BTreeMap::new();
    loop {
        match changed(st, c, dir, &known, WAIT).await {
            Ok(entries) => {
                if proc_state(&entries).started {
                    return Ok(());
                }
                known = sizes(&entries);
            }
            Err(e) if e.code == Code::NotFound => {}
            Err(e) => return Err(e),
        }
        if t.elapsed() > Duration::from_secs(10) {
            return Err(RpcError::new(
                Code::Internal,
                format!("process {pid} did not start within 10 s"),
            ));
        }
    }
}

/// How long one wait for a change inside the sandbox may hold it.
const WAIT: Duration = Duration::from_millis(500);

fn sizes(entries: &[DirEntry]) -> BTreeMap<String, u64> {
    entries.iter().map(|e| (e.name.clone(), e.size)).collect()
}

/// The listing of `dir` once it differs from `known` (at once when `known` is stale), or after
/// `wait`. A sandbox that is not running (it went to sleep) is `unavailable`: following never
/// wakes one.
async fn changed(
    st: &E2b,
    c: &Ctx,
    dir: &str,
    known: &BTreeMap<String, u64>,
    wait: Duration,
) -> Result<Vec<DirEntry>, RpcError> {
    let legacy = st
        .legacy_agents
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains(&c.id);
    if !legacy {
        let call = st.api.engine.list_files_changed(
            &c.tenant,
            &c.id,
            dir,
            known.clone(),
            wait.as_millis() as u64,
        );
        match tokio::time::timeout(wait + LEGACY_GRACE, call).await {
            Ok(Ok(Some(entries))) => return Ok(entries),
            Ok(Ok(None)) => return Err(RpcError::new(Code::Unavailable, "the sandbox was paused")),
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => {
                // An agent older than `ListChanged` (a sandbox restored from a snapshot taken
                // before it existed) never answers it: poll that sandbox instead.
                tracing::info!(sandbox = %c.id, "agent without ListChanged; polling its files");
                st.legacy_agents
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(c.id.clone());
            }
        }
    }
    match st.api.engine.sandbox(&c.tenant, &c.id) {
        Ok(rec) if rec.state == torpor_core::SandboxState::Running => {}
        Ok(_) => return Err(RpcError::new(Code::Unavailable, "the sandbox was paused")),
        Err(e) => return Err(e.into()),
    }
    if !known.is_empty() {
        tokio::time::sleep(wait.min(Duration::from_millis(20))).await;
    }
    Ok(st.api.engine.list_files(&c.tenant, &c.id, dir).await?)
}

/// How much longer than its wait a `ListChanged` may take before the agent is taken to be one
/// that does not know it.
const LEGACY_GRACE: Duration = Duration::from_secs(3);

async fn attach(
    st: Arc<E2b>,
    c: Ctx,
    body: &[u8],
    keepalive: Duration,
    deadline: Option<Instant>,
) -> Result<Response, RpcError> {
    let req: SelectorRequest = connect::parse_request(Framing::Stream, body)?;
    let pid = select(&st, &c, req.process).await?;
    let dir = dir_of(&st, &c, pid).await?;
    let state = poll(&st, &c, pid, &dir).await?;
    if state.exit.is_some() || !state.started {
        return Err(RpcError::new(
            Code::NotFound,
            format!("process with pid {pid} not found"),
        ));
    }
    // Output from now on, as envd does.
    let (out, err) = (state.out_len, state.err_len);
    let pty = recorded(&st, &c, &dir).await.is_some_and(|r| r.pty);
    let f = Follow {
        pid,
        dir,
        fd_out: if pty { PTY_FD } else { 1 },
        keepalive,
        deadline,
        known: BTreeMap::new(),
    };
    Ok(f.stream(st, c, (out, err)))
}

/// What was recorded about the process in `dir` (its `config`), if it can be read.
async fn recorded(st: &E2b, c: &Ctx, dir: &str) -> Option<Recorded> {
    read(st, c, &format!("{dir}/config"))
        .await
        .ok()
        .and_then(|b| serde_json::from_slice::<Recorded>(&b).ok())
}

/// A process's output stream: its start event, then [`follow`].
struct Follow {
    pid: u32,
    dir: String,
    /// The event of `out`'s bytes: 1 (stdout) or [`PTY_FD`].
    fd_out: u8,
    keepalive: Duration,
    deadline: Option<Instant>,
    /// The listing of `dir` taken to be current (empty: the first wait answers at once).
    known: BTreeMap<String, u64>,
}

impl Follow {
    fn stream(self, st: Arc<E2b>, c: Ctx, offsets: (u64, u64)) -> Response {
        connect::stream_response(move |tx| async move {
            if tx
                .send(Item::Message(connect::message_frame(&event_start(
                    self.pid,
                ))))
                .await
                .is_err()
            {
                return;
            }
            follow(st, c, self, offsets, tx).await;
        })
    }
}

/// What a process's directory says.
#[derive(Debug, PartialEq)]
pub struct ProcState {
    pub started: bool,
    pub out_len: u64,
    pub err_len: u64,
    pub exit: Option<ExitStatus>,
}

pub fn proc_state(entries: &[DirEntry]) -> ProcState {
    let size = |n: &str| {
        entries
            .iter()
            .find(|e| e.name == n && e.kind == FileKind::File)
            .map_or(0, |e| e.size)
    };
    let code = entries
        .iter()
        .find_map(|e| e.name.strip_prefix("exit-"))
        .map(|c| c.parse::<i32>().unwrap_or(-1));
    let signaled = entries.iter().any(|e| e.name == "signaled");
    ProcState {
        started: code.is_some() || entries.iter().any(|e| e.name == "pid"),
        out_len: size("out"),
        err_len: size("err"),
        exit: code.map(|code| {
            if signaled && code > 128 {
                ExitStatus::Signal(signal_name(code - 128).into())
            } else {
                ExitStatus::Code(code)
            }
        }),
    }
}

fn no_such_process(pid: u32) -> impl Fn(RpcError) -> RpcError {
    move |e| {
        if e.code == Code::NotFound {
            RpcError::new(Code::NotFound, format!("process with pid {pid} not found"))
        } else {
            e
        }
    }
}

async fn poll(st: &E2b, c: &Ctx, pid: u32, dir: &str) -> Result<ProcState, RpcError> {
    let entries = st
        .api
        .engine
        .list_files(&c.tenant, &c.id, dir)
        .await
        .map_err(|e| no_such_process(pid)(e.into()))?;
    Ok(proc_state(&entries))
}

async fn read(st: &E2b, c: &Ctx, path: &str) -> Result<Vec<u8>, RpcError> {
    Ok(st
        .api
        .engine
        .read_file(&c.tenant, &c.id, path, crate::server::MAX_FILE_BODY as u64)
        .await?)
}

fn signal_name(n: i32) -> &'static str {
    match n {
        9 => "killed",
        15 => "terminated",
        2 => "interrupt",
        1 => "hangup",
        _ => "unknown signal",
    }
}

/// How much of a process's output file one read takes while following it.
const FOLLOW_WINDOW: u64 = 1 << 20;

/// Streams a process's output from the given offsets until it ends, the client goes, the
/// deadline passes or the sandbox goes to sleep.
async fn follow(
    st: Arc<E2b>,
    c: Ctx,
    f: Follow,
    (mut out_off, mut err_off): (u64, u64),
    tx: mpsc::Sender<Item>,
) {
    let Follow {
        pid,
        dir,
        fd_out,
        keepalive,
        deadline,
        mut known,
    } = f;
    let mut last_sent = Instant::now();
    loop {
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            let _ = tx
                .send(Item::End(Some(RpcError::new(
                    Code::DeadlineExceeded,
                    "the stream's deadline passed",
                ))))
                .await;
            return;
        }
        let mut wait = WAIT.min(keepalive.saturating_sub(last_sent.elapsed()));
        if let Some(d) = deadline {
            wait = wait.min(d - now);
        }
        let entries = match changed(&st, &c, &dir, &known, wait).await {
            Ok(e) => e,
            Err(e) => {
                let _ = tx.send(Item::End(Some(no_such_process(pid)(e)))).await;
                return;
            }
        };
        let state = proc_state(&entries);
        known = sizes(&entries);
        // The listing is taken after the exit marker exists, so then the sizes are final.
        for (fd, name, len, off) in [
            (fd_out, "out", state.out_len, &mut out_off),
            (2u8, "err", state.err_len, &mut err_off),
        ] {
            // What was added since the last look, a window at a time: memory per stream is
            // one window, whatever the process writes (the channel's backpressure paces it).
            let path = format!("{dir}/{name}");
            while len > *off {
                let window = FOLLOW_WINDOW.min(len - *off);
                let (data, _) = match st
                    .api
                    .engine
                    .read_file_range(&c.tenant, &c.id, &path, *off, window)
                    .await
                {
                    Ok(d) => d,
                    Err(e) => {
                        let _ = tx.send(Item::End(Some(e.into()))).await;
                        return;
                    }
                };
                if data.is_empty() {
                    break;
                }
                for part in data.chunks(64 << 10) {
                    let msg = connect::message_frame(&event_data(fd, part));
                    if tx.send(Item::Message(msg)).await.is_err() {
                        return;
                    }
                }
                *off += data.len() as u64;
                last_sent = Instant::now();
            }
        }
        if let Some(exit) = state.exit {
            let _ = tx
                .send(Item::Message(connect::message_frame(&event_end(&exit))))
                .await;
            let _ = tx.send(Item::End(None)).await;
            return;
        }
        if last_sent.elapsed() >= keepalive {
            if tx
                .send(Item::Message(connect::message_frame(&event_keepalive())))
                .await
                .is_err()
            {
                return;
            }
            last_sent = Instant::now();
        }
        if tx.is_closed() {
            return;
        }
    }
}

/// The pid a selector names (a tag is looked up among the running processes).
async fn select(st: &E2b, c: &Ctx, sel: Option<Selector>) -> Result<u32, RpcError> {
    let sel =
        sel.ok_or_else(|| RpcError::new(Code::InvalidArgument, "process selector is required"))?;
    if let Some(pid) = sel.pid {
        return Ok(pid);
    }
    let Some(tag) = sel.tag else {
        return Err(RpcError::new(
            Code::InvalidArgument,
            "process selector needs pid or tag",
        ));
    };
    for (pid, rec) in running(st, c).await? {
        if rec.tag.as_deref() == Some(tag.as_str()) {
            return Ok(pid);
        }
    }
    Err(RpcError::new(
        Code::NotFound,
        format!("process with tag {tag:?} not found"),
    ))
}

/// Processes that have not ended, with what was recorded about them.
async fn running(st: &E2b, c: &Ctx) -> Result<Vec<(u32, Recorded)>, RpcError> {
    let dirs = match st.api.engine.list_files(&c.tenant, &c.id, PROC_DIR).await {
        Ok(d) => d,
        Err(e) => match RpcError::from(e) {
            e if e.code == Code::NotFound => return Ok(Vec::new()),
            e => return Err(e),
        },
    };
    let mut out = Vec::new();
    for d in dirs {
        let Ok(pid) = d.name.parse::<u32>() else {
            continue;
        };
        let Ok(dir) = dir_of(st, c, pid).await else {
            continue;
        };
        let Ok(files) = st.api.engine.list_files(&c.tenant, &c.id, &dir).await else {
            continue;
        };
        let state = proc_state(&files);
        if state.exit.is_some() || !state.started {
            continue;
        }
        let rec = recorded(st, c, &dir).await.unwrap_or_default();
        out.push((pid, rec));
    }
    out.sort_by_key(|(pid, _)| *pid);
    Ok(out)
}

async fn list(st: &E2b, c: &Ctx) -> Result<Response, RpcError> {
    let procs: Vec<serde_json::Value> = running(st, c)
        .await?
        .into_iter()
        .map(|(pid, rec)| {
            let mut v = json!({"pid": pid, "config": rec.config});
            if let Some(t) = rec.tag {
                v["tag"] = json!(t);
            }
            v
        })
        .collect();
    Ok(connect::unary_ok(&json!({"processes": procs})))
}

/// Shell prelude of the helpers acting on a running process (`$1` is its directory): exits 4
/// when the process does not exist or has ended. (Start answers only once the supervisor has
/// set the process up, so a process a client knows of has its `pid` file.)
const LIVE: &str = r#"[ -e "$1/pid" ] || exit 4
for f in "$1"/exit-*; do [ -e "$f" ] && exit 4; done
"#;

/// Runs `script` (after [`LIVE`]) on process `pid`, mapping exit 4 to not_found.
async fn on_live(
    st: &E2b,
    c: &Ctx,
    pid: u32,
    script: &str,
    args: &[&str],
    stdin: Vec<u8>,
) -> Result<(i32, String), RpcError> {
    let full = format!("{LIVE}{script}");
    let dir = dir_of(st, c, pid).await?;
    let pid_s = pid.to_string();
    // `$1` the directory, `$2` the pid, then `args`.
    let mut cmd = vec!["/bin/sh", "-c", &full, "sh", &dir, &pid_s];
    cmd.extend_from_slice(args);
    let (code, _, err) = run(st, c, &cmd, stdin).await?;
    if code == 4 {
        return Err(RpcError::new(
            Code::NotFound,
            format!("process with pid {pid} not found"),
        ));
    }
    Ok((code, err))
}

/// Sends a request about a process started by the agent's `Spawn`: `Ok(None)` when the agent
/// does not know the process (started by the supervisor shell, or ended) or predates `Spawn`.
async fn agent_proc_call(
    st: &E2b,
    c: &Ctx,
    req: Request,
    body: &[u8],
) -> Result<Option<()>, RpcError> {
    if is_legacy(st, c) {
        return Ok(None);
    }
    let call = st.api.engine.agent_call(&c.tenant, &c.id, req, body);
    match tokio::time::timeout(LEGACY_GRACE, call).await {
        Ok(Ok(_)) => Ok(Some(())),
        Ok(Err(torpor_control::ControlError::Agent {
            code: AgentErrorCode::NotFound,
            ..
        })) => Ok(None),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => {
            mark_legacy(st, c);
            Ok(None)
        }
    }
}

/// Writes input to a process: through the agent, else (a supervised process) its FIFO.
async fn write_input(st: &E2b, c: &Ctx, pid: u32, input: ProcessInput) -> Result<(), RpcError> {
    let (raw, field, pty) = match (input.stdin, input.pty) {
        (_, Some(p)) => (p, "input.pty", true),
        (s, None) => (s.unwrap_or_default(), "input.stdin", false),
    };
    let data = base64::engine::general_purpose::STANDARD
        .decode(raw)
        .map_err(|e| RpcError::new(Code::InvalidArgument, format!("{field}: {e}")))?;
    if agent_proc_call(st, c, Request::ProcInput { pid }, &data)
        .await?
        .is_some()
    {
        return Ok(());
    }
    if pty {
        // Not a live terminal process: tell a missing process from one without a terminal.
        on_live(st, c, pid, "exit 3", &[], Vec::new()).await?;
        return Err(RpcError::new(
            Code::FailedPrecondition,
            format!("process {pid} has no terminal (start it with pty)"),
        ));
    }
    // A process started without stdin has no FIFO: refuse rather than create a plain file.
    let (code, _) = on_live(
        st,
        c,
        pid,
        r#"[ -p "$1/in" ] || exit 3; cat >> "$1/in""#,
        &[],
        data,
    )
    .await?;
    match code {
        0 => Ok(()),
        3 => Err(RpcError::new(
            Code::FailedPrecondition,
            format!("process {pid} was started without stdin (stdin=True) or its stdin is closed"),
        )),
        _ => Err(RpcError::new(
            Code::Internal,
            format!("cannot write to the stdin of process {pid}"),
        )),
    }
}

async fn send_input(st: &E2b, c: &Ctx, body: &[u8]) -> Result<Response, RpcError> {
    let req: SendInputRequest = connect::parse_request(Framing::Unary, body)?;
    let pid = select(st, c, req.process).await?;
    write_input(st, c, pid, req.input.unwrap_or_default()).await?;
    Ok(connect::unary_ok(&json!({})))
}

/// `StreamInput` (client streaming): a `start` naming the process, then `data` and `keepalive`
/// messages. The body is read as it arrives and each input is written to the process as soon
/// as its envelope is complete (the next envelope is read once it is written: input keeps its
/// order, and a slow process holds the client back). The stream ends with the body or an
/// end-of-stream envelope; the answer is then one empty message and the end of the stream.
/// An error (bad envelope or message, unknown process, deadline) ends it at once: the inputs
/// before it have been written.
async fn stream_input(
    st: &E2b,
    c: &Ctx,
    body: Body,
    deadline: Option<Instant>,
) -> Result<Response, RpcError> {
    let inputs = write_stream_input(st, c, body);
    match deadline {
        None => inputs.await?,
        Some(d) => tokio::time::timeout_at(d.into(), inputs)
            .await
            .map_err(|_| RpcError::new(Code::DeadlineExceeded, "the stream's deadline passed"))??,
    }
    Ok(connect::stream_response(|tx| async move {
        let _ = tx
            .send(Item::Message(connect::message_frame(&json!({}))))
            .await;
    }))
}

/// Reads [`stream_input`]'s envelopes from `body` and writes each input once it is complete.
async fn write_stream_input(st: &E2b, c: &Ctx, body: Body) -> Result<(), RpcError> {
    #[derive(Debug, Default, Deserialize)]
    #[serde(default)]
    struct StreamInputRequest {
        start: Option<SelectorRequest>,
        data: Option<SendInputRequest>,
        keepalive: Option<serde_json::Value>,
    }
    let mut chunks = body.into_data_stream();
    let mut decoder = connect::EnvelopeDecoder::default();
    let mut pid = None;
    loop {
        let msg = match decoder.next_envelope()? {
            Some(connect::Envelope::Message(m)) => m,
            Some(connect::Envelope::End(_)) => break,
            None => match chunks.next().await {
                Some(Ok(chunk)) => {
                    decoder.push(&chunk);
                    continue;
                }
                Some(Err(e)) => {
                    return Err(RpcError::new(
                        Code::Canceled,
                        format!("reading the request: {e}"),
                    ))
                }
                None => {
                    decoder.finish()?;
                    break;
                }
            },
        };
        let msg = if msg.is_empty() { &b"{}"[..] } else { &msg[..] };
        let m: StreamInputRequest = serde_json::from_slice(msg)
            .map_err(|e| RpcError::new(Code::InvalidArgument, format!("request message: {e}")))?;
        if let Some(start) = m.start {
            let p = select(st, c, start.process).await?;
            let state = poll(st, c, p, &dir_of(st, c, p).await?).await?;
            if state.exit.is_some() || !state.started {
                return Err(RpcError::new(
                    Code::NotFound,
                    format!("process with pid {p} not found"),
                ));
            }
            pid = Some(p);
        } else if let Some(data) = m.data {
            let pid = pid.ok_or_else(|| {
                RpcError::new(
                    Code::InvalidArgument,
                    "the first StreamInput message must be start",
                )
            })?;
            write_input(st, c, pid, data.input.unwrap_or_default()).await?;
        } else if m.keepalive.is_none() {
            return Err(RpcError::new(
                Code::InvalidArgument,
                "a StreamInput message needs start, data or keepalive",
            ));
        }
    }
    if pid.is_none() {
        return Err(RpcError::new(
            Code::InvalidArgument,
            "StreamInput needs a start message naming the process",
        ));
    }
    Ok(())
}

/// `Update`: resizes a terminal process.
async fn update(st: &E2b, c: &Ctx, body: &[u8]) -> Result<Response, RpcError> {
    let req: UpdateRequest = connect::parse_request(Framing::Unary, body)?;
    let pid = select(st, c, req.process).await?;
    let Some(pty) = req.pty else {
        return Ok(connect::unary_ok(&json!({})));
    };
    let size = pty.size()?;
    let resize = Request::ProcResize {
        pid,
        cols: size.cols,
        rows: size.rows,
    };
    if agent_proc_call(st, c, resize, &[]).await?.is_none() {
        on_live(st, c, pid, "exit 3", &[], Vec::new()).await?;
        return Err(RpcError::new(
            Code::FailedPrecondition,
            format!("process {pid} has no terminal (start it with pty)"),
        ));
    }
    Ok(connect::unary_ok(&json!({})))
}

async fn close_stdin(st: &E2b, c: &Ctx, body: &[u8]) -> Result<Response, RpcError> {
    let req: SelectorRequest = connect::parse_request(Framing::Unary, body)?;
    let pid = select(st, c, req.process).await?;
    if agent_proc_call(st, c, Request::ProcCloseInput { pid }, &[])
        .await?
        .is_some()
    {
        return Ok(connect::unary_ok(&json!({})));
    }
    on_live(
        st,
        c,
        pid,
        r#"[ -f "$1/holder" ] && kill "$(cat "$1/holder")" 2>/dev/null; rm -f "$1/holder" "$1/in"; exit 0"#,
        &[],
        Vec::new(),
    )
    .await?;
    Ok(connect::unary_ok(&json!({})))
}

/// The signal of a SendSignal request (the enum by name or number).
fn parse_signal(v: Option<&serde_json::Value>) -> Result<i32, RpcError> {
    let n = match v {
        Some(serde_json::Value::String(s)) => match s.as_str() {
            "SIGNAL_SIGKILL" => 9,
            "SIGNAL_SIGTERM" => 15,
            _ => 0,
        },
        Some(serde_json::Value::Number(n)) => n.as_i64().unwrap_or(0) as i32,
        _ => 0,
    };
    if n == 9 || n == 15 {
        Ok(n)
    } else {
        Err(RpcError::new(
            Code::InvalidArgument,
            "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM",
        ))
    }
}

async fn send_signal(st: &E2b, c: &Ctx, body: &[u8]) -> Result<Response, RpcError> {
    let req: SendSignalRequest = connect::parse_request(Framing::Unary, body)?;
    let sig = parse_signal(req.signal.as_ref())?;
    let pid = select(st, c, req.process).await?;
    // The process is a session (and group) leader: signal everything it started.
    let (code, err) = on_live(
        st,
        c,
        pid,
        // The supervisor's group holds everything the command started. A KILL takes the
        // supervisor too, so the status is recorded here.
        r#": > "$1/signaled"; kill -s "$3" -- "-$2" || exit 5
[ "$3" = KILL ] && : > "$1/exit-137"
exit 0"#,
        &[if sig == 9 { "KILL" } else { "TERM" }],
        Vec::new(),
    )
    .await?;
    match code {
        0 => Ok(connect::unary_ok(&json!({}))),
        _ => Err(RpcError::new(
            Code::Internal,
            format!("cannot signal process {pid}: {}", err.trim()),
        )),
    }
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
