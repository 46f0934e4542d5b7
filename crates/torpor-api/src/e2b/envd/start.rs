//! `Start`: a process through the agent's `Spawn`, or under the supervisor shell for agents
//! that predate it.

use super::*;

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

/// A `Start` request checked: the request, its pty size (if a pty is asked for) and the
/// process, which must name a command. The fuzz entry point runs this too.
pub(super) fn parse_start(
    body: &[u8],
) -> Result<(StartRequest, Option<PtySize>, ProcessConfig), RpcError> {
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

pub(super) async fn start(
    st: Arc<E2b>,
    c: Ctx,
    body: &[u8],
    who: super::super::base::Identity,
    keepalive: Duration,
    deadline: Option<Instant>,
) -> Result<Response, RpcError> {
    let (req, pty, config) = parse_start(body)?;
    let cwd = match &config.cwd {
        Some(d) if !d.is_empty() => super::super::paths::resolve(d, None)?,
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
    env.entry("HOME".into()).or_insert_with(|| who.home.into());
    if who.run_as.is_some() {
        for k in ["USER", "LOGNAME"] {
            env.entry(k.into()).or_insert_with(|| who.name.into());
        }
    }
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
        user: who.run_as,
        follow_ms: 0,
        spawned_within_ms: 0,
    };
    // The agent follows the process as its first wait would (see `follow`), so that a short
    // command's output and exit come back on the request that started it.
    let mut first_wait = WAIT.min(keepalive);
    if let Some(d) = deadline {
        first_wait = first_wait.min(d.saturating_duration_since(Instant::now()));
    }
    let follow_ms = first_wait.as_millis() as u64;
    let whole_within = WHOLE_WITHIN.min(first_wait).as_millis() as u64;
    let (pid, progress) = match spawn_in_agent(
        &st,
        &c,
        spawn.clone(),
        &recorded,
        who.home,
        (follow_ms, whole_within),
    )
    .await?
    {
        Some(started) => started,
        None if pty.is_some() => return Err(RpcError::new(Code::Unimplemented, NO_TERMINALS)),
        None => (spawn_supervised(&st, &c, spawn, &recorded).await?, None),
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
    // A command that ended within [`WHOLE_WITHIN`] (its start was held back that long) is
    // answered whole: its start, output and end in one body, as a native exec answers, instead
    // of a start event while it runs and the rest when it ends (a write and a wake of the
    // client more, on the CPUs it runs on).
    if let Some(SpawnProgress::Came(Some(done))) = &progress {
        let all = (done.out.len() as u64, done.err.len() as u64);
        if let Some(exit) = after_progress(done, all, &mut BTreeMap::new()) {
            let mut frames = vec![connect::message_frame(&event_start(pid))];
            frames.extend(data_frames(fd_out, &done.out));
            frames.extend(data_frames(2, &done.err));
            frames.push(connect::message_frame(&event_end(&exit)));
            frames.push(connect::end_frame(None));
            return Ok(connect::stream_response_from(frames));
        }
    }
    let f = Follow {
        pid,
        dir,
        fd_out,
        keepalive,
        deadline,
        known,
        progress,
    };
    Ok(f.stream(st, c, (0, 0)))
}

/// How long `Start` holds a followed process's start event back for it to end (see
/// [`start`]): a command that runs on (a background one) hears its start this much later.
pub(super) const WHOLE_WITHIN: Duration = Duration::from_millis(50);

pub(super) const NO_TERMINALS: &str =
    "this sandbox's agent predates terminals: PTY processes need a \
                            sandbox made by this torpor";

/// Starts a process through the agent's `Spawn` (one spawn, its state in its directory),
/// followed for `follow_ms` where the agent can, its answer held back `whole_within_ms` at
/// most (see [`torpor_control::Engine::spawn_process`]): its pid and the follow's progress.
/// `Ok(None)` when the sandbox's agent predates `Spawn` (restored from an older snapshot).
pub(super) async fn spawn_in_agent(
    st: &E2b,
    c: &Ctx,
    mut spawn: SpawnRequest,
    recorded: &[u8],
    home: &str,
    (follow_ms, whole_within_ms): (u64, u64),
) -> Result<Option<(u32, Option<SpawnProgress>)>, RpcError> {
    if is_legacy(st, c) {
        return Ok(None);
    }
    let default_cwd = spawn.cwd.as_deref() == Some("");
    if default_cwd {
        spawn.cwd = Some(home.into());
    }
    loop {
        let call = st.api.engine.spawn_process(
            &c.tenant,
            &c.id,
            spawn.clone(),
            recorded,
            follow_ms,
            whole_within_ms,
        );
        match tokio::time::timeout(LEGACY_GRACE, call).await {
            Ok(Ok(started)) => return Ok(Some(started)),
            Ok(Err(torpor_control::ControlError::Agent {
                code: AgentErrorCode::NoSuchCwd,
                ..
            })) => {
                if default_cwd && spawn.cwd.as_deref() == Some(home) {
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

pub(super) fn is_legacy(st: &E2b, c: &Ctx) -> bool {
    st.legacy_agents
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains(&c.id)
}

pub(super) fn mark_legacy(st: &E2b, c: &Ctx) {
    st.legacy_agents
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(c.id.clone());
}

/// Starts a process under [`SUPERVISOR`] (agents without `Spawn`): a detached exec of a shell
/// that runs the command and records its state.
pub(super) async fn spawn_supervised(
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
pub(super) fn new_key() -> String {
    torpor_core::SandboxId::generate()
        .as_str()
        .chars()
        .filter(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        .collect()
}

pub(super) fn key_dir(key: &str) -> String {
    format!("{PROC_DIR}/k{key}")
}

/// The directory of process `pid`, from its index file; not_found when there is none.
pub(super) async fn dir_of(st: &E2b, c: &Ctx, pid: u32) -> Result<String, RpcError> {
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
pub(super) async fn wait_ready(st: &E2b, c: &Ctx, pid: u32, dir: &str) -> Result<(), RpcError> {
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
