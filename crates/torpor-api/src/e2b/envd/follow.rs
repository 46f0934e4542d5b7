//! Following a process: its directory's state, the output stream (`Start`, `Connect`), and
//! the running processes (`List`, selectors).

use super::*;

/// How long one wait for a change inside the sandbox may hold it.
pub(super) const WAIT: Duration = Duration::from_millis(500);

pub(super) fn sizes(entries: &[DirEntry]) -> BTreeMap<String, u64> {
    entries.iter().map(|e| (e.name.clone(), e.size)).collect()
}

/// The listing of `dir` once it differs from `known` (at once when `known` is stale), or after
/// `wait`. A sandbox that is not running (it went to sleep) is `unavailable`: following never
/// wakes one.
pub(super) async fn changed(
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
pub(super) const LEGACY_GRACE: Duration = Duration::from_secs(3);

pub(super) async fn attach(
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
        progress: None,
    };
    Ok(f.stream(st, c, (out, err)))
}

/// What was recorded about the process in `dir` (its `config`), if it can be read.
pub(super) async fn recorded(st: &E2b, c: &Ctx, dir: &str) -> Option<Recorded> {
    read(st, c, &format!("{dir}/config"))
        .await
        .ok()
        .and_then(|b| serde_json::from_slice::<Recorded>(&b).ok())
}

/// A process's output stream: its start event, then [`follow`].
pub(super) struct Follow {
    pub(super) pid: u32,
    pub(super) dir: String,
    /// The event of `out`'s bytes: 1 (stdout) or [`PTY_FD`].
    pub(super) fd_out: u8,
    pub(super) keepalive: Duration,
    pub(super) deadline: Option<Instant>,
    /// The listing of `dir` taken to be current (empty: the first wait answers at once).
    pub(super) known: BTreeMap<String, u64>,
    /// The agent's follow of a process it just started (come already, or to come): taken
    /// before the first wait.
    pub(super) progress: Option<SpawnProgress>,
}

impl Follow {
    pub(super) fn stream(self, st: Arc<E2b>, c: Ctx, offsets: (u64, u64)) -> Response {
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
        exit: code.map(|code| exit_status(code, signaled)),
    }
}

/// What an exit marker's status says (`signaled`: the process was killed by a signal, whose
/// number is the status less 128).
fn exit_status(code: i32, signaled: bool) -> ExitStatus {
    if signaled && code > 128 {
        ExitStatus::Signal(signal_name(code - 128).into())
    } else {
        ExitStatus::Code(code)
    }
}

/// `data` as output events of `fd`, 64 KiB per event.
pub(super) fn data_frames(fd: u8, data: &[u8]) -> impl Iterator<Item = Bytes> + '_ {
    data.chunks(64 << 10)
        .map(move |part| connect::message_frame(&event_data(fd, part)))
}

/// Sends `data` as output events of `fd` ([`data_frames`]); false once the client has gone.
async fn send_data(tx: &mpsc::Sender<Item>, fd: u8, data: &[u8]) -> bool {
    for msg in data_frames(fd, data) {
        if tx.send(Item::Message(msg)).await.is_err() {
            return false;
        }
    }
    true
}

/// Sends a process's end event and ends the stream.
async fn send_end(tx: &mpsc::Sender<Item>, exit: &ExitStatus) {
    let _ = tx
        .send(Item::Message(connect::message_frame(&event_end(exit))))
        .await;
    let _ = tx.send(Item::End(None)).await;
}

pub(super) fn no_such_process(pid: u32) -> impl Fn(RpcError) -> RpcError {
    move |e| {
        if e.code == Code::NotFound {
            RpcError::new(Code::NotFound, format!("process with pid {pid} not found"))
        } else {
            e
        }
    }
}

pub(super) async fn poll(st: &E2b, c: &Ctx, pid: u32, dir: &str) -> Result<ProcState, RpcError> {
    let entries = st
        .api
        .engine
        .list_files(&c.tenant, &c.id, dir)
        .await
        .map_err(|e| no_such_process(pid)(e.into()))?;
    Ok(proc_state(&entries))
}

pub(super) async fn read(st: &E2b, c: &Ctx, path: &str) -> Result<Vec<u8>, RpcError> {
    Ok(st
        .api
        .engine
        .read_file(&c.tenant, &c.id, path, crate::body::MAX_FILE_BODY as u64)
        .await?)
}

pub(super) fn signal_name(n: i32) -> &'static str {
    match n {
        9 => "killed",
        15 => "terminated",
        2 => "interrupt",
        1 => "hangup",
        _ => "unknown signal",
    }
}

/// How much of a process's output file one read takes while following it.
pub(super) const FOLLOW_WINDOW: u64 = 1 << 20;

/// After a followed spawn's `Progress`, whose output a follower has sent (its offsets now
/// `out_off`, `err_off`, from the start of each file): the process's end when that was all of
/// it, else `None` with `known` (the listing taken to be current) brought up to date, emptied
/// when the files hold more than came (the next wait then answers at once).
pub(super) fn after_progress(
    p: &Progress,
    (out_off, err_off): (u64, u64),
    known: &mut BTreeMap<String, u64>,
) -> Option<ExitStatus> {
    let all_came = out_off == p.out_len && err_off == p.err_len;
    match p.exit {
        Some(code) if all_came => return Some(exit_status(code, p.signaled)),
        // The rest is in the files (and the exit marker in the listing).
        Some(_) => known.clear(),
        None => {
            known.insert("out".into(), out_off);
            known.insert("err".into(), err_off);
        }
    }
    None
}

/// Streams a process's output from the given offsets until it ends, the client goes, the
/// deadline passes or the sandbox goes to sleep.
pub(super) async fn follow(
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
        progress,
    } = f;
    let mut last_sent = Instant::now();
    if let Some(p) = progress {
        match p.progress().await {
            Some(p) => {
                for (fd, data, off) in [(fd_out, &p.out, &mut out_off), (2u8, &p.err, &mut err_off)]
                {
                    if !send_data(&tx, fd, data).await {
                        return;
                    }
                    *off += data.len() as u64;
                }
                if !(p.out.is_empty() && p.err.is_empty()) {
                    last_sent = Instant::now();
                }
                if let Some(exit) = after_progress(&p, (out_off, err_off), &mut known) {
                    send_end(&tx, &exit).await;
                    return;
                }
            }
            // Whatever happened is in the files: look at once.
            None => known.clear(),
        }
    }
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
                if !send_data(&tx, fd, &data).await {
                    return;
                }
                *off += data.len() as u64;
                last_sent = Instant::now();
            }
        }
        if let Some(exit) = state.exit {
            send_end(&tx, &exit).await;
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
pub(super) async fn select(st: &E2b, c: &Ctx, sel: Option<Selector>) -> Result<u32, RpcError> {
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
pub(super) async fn running(st: &E2b, c: &Ctx) -> Result<Vec<(u32, Recorded)>, RpcError> {
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

pub(super) async fn list(st: &E2b, c: &Ctx) -> Result<Response, RpcError> {
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
