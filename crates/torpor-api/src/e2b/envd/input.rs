//! Acting on a running process: `SendInput`, `StreamInput`, `CloseStdin`, `Update` (resize)
//! and `SendSignal`.

use super::*;

/// Shell prelude of the helpers acting on a running process (`$1` is its directory): exits 4
/// when the process does not exist or has ended. (Start answers only once the supervisor has
/// set the process up, so a process a client knows of has its `pid` file.)
pub(super) const LIVE: &str = r#"[ -e "$1/pid" ] || exit 4
for f in "$1"/exit-*; do [ -e "$f" ] && exit 4; done
"#;

/// Runs `script` (after [`LIVE`]) on process `pid`, mapping exit 4 to not_found.
pub(super) async fn on_live(
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
pub(super) async fn agent_proc_call(
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
pub(super) async fn write_input(
    st: &E2b,
    c: &Ctx,
    pid: u32,
    input: ProcessInput,
) -> Result<(), RpcError> {
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

pub(super) async fn send_input(st: &E2b, c: &Ctx, body: &[u8]) -> Result<Response, RpcError> {
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
pub(super) async fn stream_input(
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
pub(super) async fn write_stream_input(st: &E2b, c: &Ctx, body: Body) -> Result<(), RpcError> {
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
pub(super) async fn update(st: &E2b, c: &Ctx, body: &[u8]) -> Result<Response, RpcError> {
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

pub(super) async fn close_stdin(st: &E2b, c: &Ctx, body: &[u8]) -> Result<Response, RpcError> {
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
pub(super) fn parse_signal(v: Option<&serde_json::Value>) -> Result<i32, RpcError> {
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

pub(super) async fn send_signal(st: &E2b, c: &Ctx, body: &[u8]) -> Result<Response, RpcError> {
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
