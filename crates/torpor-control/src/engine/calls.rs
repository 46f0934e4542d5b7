//! Calls into a running sandbox: exec (whole or streamed) and files, through its agent. A call
//! holds the sandbox's read lock, so no transition runs under it; a call that loses its agent
//! records the crash before it answers.

use super::*;

/// How long a call that finds its sandbox's agent gone (or cannot send to it) waits for the
/// container's exit to be reported (a container that died exits at once; a worker that is
/// only unreachable does not).
pub(super) const GONE_EXIT_WAIT: Duration = Duration::from_secs(1);

/// A request on its way: the sandbox held for it, its replies, and when it was sent.
struct Sent {
    in_use: InUse,
    replies: mpsc::Receiver<(Reply, Vec<u8>)>,
    at: Instant,
}

/// The rest of a followed `Spawn` ([`Engine::spawn_process`]): its `Progress`, come already
/// or to come. One to come holds the sandbox (no transition) until it is taken or dropped, at
/// most the follow's time.
pub enum SpawnProgress {
    /// It came with the process's start (the process ended, or wrote output, within the
    /// time the start was held for): `None` when it could not be read.
    Came(Option<Progress>),
    ToCome(ToCome),
}

/// A followed `Spawn`'s `Progress` still to come: the request's replies.
pub struct ToCome {
    sent: Sent,
}

/// What a followed process had done when its `Progress` came.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    /// The status its exit marker records, once it has ended (see [`Reply::Progress`]).
    pub exit: Option<i32>,
    pub signaled: bool,
    pub out_len: u64,
    pub err_len: u64,
    /// The first bytes of its `out` and of its `err`.
    pub out: Vec<u8>,
    pub err: Vec<u8>,
}

impl SpawnProgress {
    /// The `Progress`; `None` when the agent answered otherwise or its channel ended (a
    /// follower then looks at the process's files itself, which tell it the same).
    pub async fn progress(self) -> Option<Progress> {
        match self {
            SpawnProgress::Came(p) => p,
            SpawnProgress::ToCome(mut c) => progress(c.sent.replies.recv().await?),
        }
    }
}

/// What a `Progress` reply says; `None` for another reply.
fn progress(reply: (Reply, Vec<u8>)) -> Option<Progress> {
    match reply {
        (
            Reply::Progress {
                pid: _,
                exit,
                signaled,
                out_len,
                err_len,
                out_sent,
            },
            mut body,
        ) => {
            let err = body.split_off((out_sent as usize).min(body.len()));
            Some(Progress {
                exit,
                signaled,
                out_len,
                err_len,
                out: body,
                err,
            })
        }
        (other, _) => {
            tracing::warn!(reply = ?other, "unexpected reply to a followed spawn");
            None
        }
    }
}

impl Engine {
    pub async fn exec(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        mut req: ExecRequest,
        stdin: Vec<u8>,
    ) -> Result<ExecResult> {
        check_exec(&req)?;
        req.stream = false;
        let timeout_ms = req.timeout_ms;
        let detach = req.detach;
        let Sent {
            in_use,
            replies: mut rx,
            at: t,
        } = self
            .send_to_agent(tenant, id, &|_| self.exec_request(id, &req), &stdin)
            .await?;
        let reply = rx.recv().await;
        let result = match reply {
            Some((reply, body)) => exec_reply(reply, body, timeout_ms, detach),
            None => Err(self.died_during_call(in_use).await),
        };
        self.metrics
            .exec_seconds
            .with_label_values(&[if result.is_ok() { "ok" } else { "error" }])
            .observe(t.elapsed().as_secs_f64());
        match result {
            // A program that cannot be started answers like a shell would.
            Err(ControlError::Agent {
                code: code @ (AgentErrorCode::NotFound | AgentErrorCode::PermissionDenied),
                message,
            }) => Ok(ExecResult {
                exit_code: Some(if code == AgentErrorCode::NotFound {
                    127
                } else {
                    126
                }),
                signal: None,
                stdout: String::new(),
                stderr: format!("{message}\n"),
                oom_killed: false,
                duration_ms: t.elapsed().as_secs_f64() * 1000.0,
            }),
            Err(ControlError::SandboxCrashed { reason }) if reason == "oom_killed" => {
                Ok(ExecResult {
                    exit_code: Some(137),
                    signal: Some(9),
                    stdout: String::new(),
                    stderr: String::new(),
                    oom_killed: true,
                    duration_ms: t.elapsed().as_secs_f64() * 1000.0,
                })
            }
            other => other,
        }
    }

    /// Runs a command and streams its output as events; the last event is Exit or Error.
    pub async fn exec_stream(
        self: &Arc<Self>,
        tenant: &TenantId,
        id: &SandboxId,
        mut req: ExecRequest,
        stdin: Vec<u8>,
    ) -> Result<mpsc::Receiver<ExecEvent>> {
        check_exec(&req)?;
        if req.detach {
            return Err(ControlError::Invalid(
                "detach and stream do not go together".into(),
            ));
        }
        req.stream = true;
        let timeout_ms = req.timeout_ms;
        let Sent {
            in_use,
            replies: mut rx,
            ..
        } = self
            .send_to_agent(tenant, id, &|_| self.exec_request(id, &req), &stdin)
            .await?;
        let (tx, out) = mpsc::channel(64);
        let engine = self.clone();
        // Each chunk is handed on as it comes and not kept: a slow reader holds the channel
        // full, which holds the agent connection's reader, which holds the command's pipe.
        tokio::spawn(async move {
            loop {
                let event = match rx.recv().await {
                    Some((Reply::Output { fd }, body)) => {
                        let data = String::from_utf8_lossy(&body).into_owned();
                        if fd == 1 {
                            ExecEvent::Stdout { data }
                        } else {
                            ExecEvent::Stderr { data }
                        }
                    }
                    Some((reply, body)) => {
                        let ev = match exec_reply(reply, body, timeout_ms, false) {
                            Ok(r) => ExecEvent::Exit(r),
                            Err(e) => ExecEvent::Error {
                                code: e.code().into(),
                                message: e.to_string(),
                            },
                        };
                        let _ = tx.send(ev).await;
                        break;
                    }
                    None => {
                        let e = engine.died_during_call(in_use).await;
                        let ev = match &e {
                            ControlError::SandboxCrashed { reason } if reason == "oom_killed" => {
                                ExecEvent::Exit(ExecResult {
                                    exit_code: Some(137),
                                    signal: Some(9),
                                    stdout: String::new(),
                                    stderr: String::new(),
                                    oom_killed: true,
                                    duration_ms: 0.0,
                                })
                            }
                            _ => ExecEvent::Error {
                                code: e.code().into(),
                                message: e.to_string(),
                            },
                        };
                        let _ = tx.send(ev).await;
                        break;
                    }
                };
                if tx.send(event).await.is_err() {
                    // The client went away; the command runs to its end (or its timeout).
                    break;
                }
            }
        });
        Ok(out)
    }

    /// The agent's exec request for `req`, with the sandbox's GPU environment: made once the
    /// sandbox is awake (its wake places its GPU share).
    fn exec_request(&self, id: &SandboxId, req: &ExecRequest) -> Request {
        Request::Exec(ExecRequest {
            env: self.gpu_env(id, req.env.clone()),
            ..req.clone()
        })
    }

    /// Borrows the sandbox (waking it if it sleeps) and sends the request `req` makes once it
    /// is awake (a GPU environment exists only then; it is given the agent's protocol version)
    /// to its agent. A request
    /// that cannot be sent was never delivered: when its container is found gone (it died, or
    /// its worker ended it while out of reach), the crash is recorded and the request goes
    /// once more, to the sandbox woken from its last snapshot, instead of failing a call
    /// that nothing had started. Any other failure to send answers as it is.
    async fn send_to_agent(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        req: &(dyn Fn(u32) -> Request + Sync),
        body: &[u8],
    ) -> Result<Sent> {
        let mut resent = false;
        loop {
            let in_use = self.use_sandbox(tenant, id).await?;
            let at = Instant::now();
            let version = in_use.resident().agent_version();
            let e = match in_use.resident().send(&req(version), body).await {
                Ok(replies) => {
                    return Ok(Sent {
                        in_use,
                        replies,
                        at,
                    })
                }
                Err(e) => e,
            };
            match self.crashed_under(in_use, GONE_EXIT_WAIT).await {
                Some(crash) if !resent => {
                    tracing::info!(sandbox = %id, %crash, "a call found its sandbox's container gone; sent to the sandbox restored from its last snapshot");
                    resent = true;
                }
                Some(crash) => return Err(crash),
                None => return Err(torpor_runtime::RuntimeError::from(e).into()),
            }
        }
    }

    /// The agent channel closed under a call: wait for the container's exit and record the
    /// crash (so the sandbox's status says so before the caller hears back), then name the cause.
    pub(super) async fn died_during_call(&self, in_use: InUse) -> ControlError {
        self.crashed_under(in_use, Duration::from_secs(5))
            .await
            .unwrap_or_else(|| ControlError::SandboxCrashed {
                reason: "agent channel closed".into(),
            })
    }

    /// Waits up to `within` for the container of `in_use` to exit and records the crash;
    /// `None` if it did not exit in that time.
    async fn crashed_under(&self, in_use: InUse, within: Duration) -> Option<ControlError> {
        let exit = in_use.resident().exit_handle();
        let cid = in_use.resident().id().to_string();
        let id = in_use.id.clone();
        // The crash is recorded under the write lock: release our read lock first.
        drop(in_use);
        self.record_exit(&id, &cid, exit, within).await
    }

    /// Waits up to `within` for container `cid` of sandbox `id` to exit and records the crash;
    /// `None` if it did not exit in that time.
    pub(super) async fn record_exit(
        &self,
        id: &SandboxId,
        cid: &str,
        exit: torpor_runtime::ExitHandle,
        within: Duration,
    ) -> Option<ControlError> {
        let info = tokio::time::timeout(within, exit.exited()).await.ok()?;
        let reason = crash_reason(&info);
        // No transition can run while a call holds the sandbox, so this exit is a crash.
        // The crash watch may be recording it already; on_crash waits for it, and records it
        // itself otherwise.
        self.on_crash(id, cid, &reason, info.oom_killed).await;
        Some(ControlError::SandboxCrashed { reason })
    }

    pub async fn agent_call(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        req: Request,
        body: &[u8],
    ) -> Result<(Reply, Vec<u8>)> {
        let mut sent = self
            .send_to_agent(tenant, id, &|_| req.clone(), body)
            .await?;
        match sent.replies.recv().await {
            Some((Reply::Error { code, message }, _)) => Err(ControlError::Agent { code, message }),
            Some(r) => Ok(r),
            None => Err(self.died_during_call(sent.in_use).await),
        }
    }

    /// Starts a `Spawn` process (E2B's), followed for up to `follow_ms` where the agent can
    /// ([`proto::SPAWN_FOLLOW_SINCE`]; see [`proto::SpawnRequest::follow_ms`]): answers its
    /// pid and, when followed, the `Progress`, with the sandbox held until it comes. The answer
    /// is held back for up to `whole_within_ms` while the process runs: a process that ends
    /// (or writes output) sooner is answered with its `Progress` come
    /// ([`SpawnProgress::Came`]), a longer one as soon as the time is up. The agent holds its
    /// `Spawned` back itself where it can ([`proto::SpawnRequest::spawned_within_ms`]); an
    /// older agent's is held here.
    pub async fn spawn_process(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        spawn: proto::SpawnRequest,
        config: &[u8],
        follow_ms: u64,
        whole_within_ms: u64,
    ) -> Result<(u32, Option<SpawnProgress>)> {
        let held_by_agent = std::sync::atomic::AtomicBool::new(false);
        let make = |version: u32| {
            let mut spawn = spawn.clone();
            spawn.follow_ms = if version >= proto::SPAWN_FOLLOW_SINCE {
                follow_ms.min(proto::MAX_WAIT_MS)
            } else {
                0
            };
            // Set on every (re)send, for the agent it went to.
            let by_agent = version >= proto::SPAWNED_WITHIN_SINCE && spawn.follow_ms > 0;
            if by_agent {
                spawn.spawned_within_ms = whole_within_ms.min(proto::MAX_WAIT_MS);
            }
            held_by_agent.store(by_agent, std::sync::atomic::Ordering::Relaxed);
            Request::Spawn(spawn)
        };
        let mut sent = self.send_to_agent(tenant, id, &make, config).await?;
        match sent.replies.recv().await {
            Some((Reply::Started { pid }, _)) => Ok((pid, None)),
            Some((Reply::Spawned { pid }, _)) => {
                let wait = Duration::from_millis(whole_within_ms);
                if held_by_agent.load(std::sync::atomic::Ordering::Relaxed) || wait.is_zero() {
                    return Ok((pid, Some(SpawnProgress::ToCome(ToCome { sent }))));
                }
                // `recv` is cancel-safe: what did not come in time is still to come.
                match tokio::time::timeout(wait, sent.replies.recv()).await {
                    Ok(reply) => Ok((pid, Some(SpawnProgress::Came(reply.and_then(progress))))),
                    Err(_) => Ok((pid, Some(SpawnProgress::ToCome(ToCome { sent })))),
                }
            }
            Some(reply @ (Reply::Progress { pid: Some(pid), .. }, _)) => {
                Ok((pid, Some(SpawnProgress::Came(progress(reply)))))
            }
            Some((Reply::Error { code, message }, _)) => Err(ControlError::Agent { code, message }),
            Some((other, _)) => Err(ControlError::Invalid(format!(
                "unexpected agent reply {other:?}"
            ))),
            None => Err(self.died_during_call(sent.in_use).await),
        }
    }

    pub async fn read_file(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        path: &str,
        max_bytes: u64,
    ) -> Result<Vec<u8>> {
        let (_, body) = self
            .agent_call(
                tenant,
                id,
                Request::ReadFile {
                    path: path.into(),
                    max_bytes,
                },
                &[],
            )
            .await?;
        Ok(body)
    }

    /// Up to `max_bytes` of a file from `offset`, and whether more follows. An agent that
    /// predates ranged reads (its hello said an older version: restored from an older
    /// snapshot) is asked for the whole file, which is then cut here.
    pub async fn read_file_range(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        path: &str,
        offset: u64,
        max_bytes: u64,
    ) -> Result<(Vec<u8>, bool)> {
        let ranged = {
            let in_use = self.use_sandbox(tenant, id).await?;
            in_use.resident().agent_version() >= proto::READ_RANGE_SINCE
        };
        if !ranged {
            let whole = self
                .read_file(tenant, id, path, proto::MAX_BODY as u64)
                .await?;
            let start = (offset as usize).min(whole.len());
            let end = start.saturating_add(max_bytes as usize).min(whole.len());
            return Ok((whole[start..end].to_vec(), end < whole.len()));
        }
        let ranged = self
            .agent_call(
                tenant,
                id,
                Request::ReadRange {
                    path: path.into(),
                    offset,
                    max_bytes,
                },
                &[],
            )
            .await;
        match ranged {
            Ok((Reply::Data { truncated }, body)) => Ok((body, truncated)),
            Ok((other, _)) => Err(ControlError::Agent {
                code: AgentErrorCode::Io,
                message: format!("unexpected reply to a ranged read: {other:?}"),
            }),
            Err(e) => Err(e),
        }
    }

    pub async fn write_file(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        path: &str,
        mode: Option<u32>,
        data: &[u8],
    ) -> Result<()> {
        self.agent_call(
            tenant,
            id,
            Request::WriteFile {
                path: path.into(),
                mode,
            },
            data,
        )
        .await
        .map(|_| ())
    }

    pub async fn list_files(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        path: &str,
    ) -> Result<Vec<DirEntry>> {
        match self
            .agent_call(tenant, id, Request::List { path: path.into() }, &[])
            .await?
        {
            (Reply::Entries { entries }, _) => Ok(entries),
            (other, _) => Err(ControlError::Invalid(format!(
                "unexpected agent reply {other:?}"
            ))),
        }
    }

    /// Lists `path` once its (name, size) set differs from `known`, or after `timeout_ms`
    /// (see [`Request::ListChanged`]), holding the sandbox for at most that long. Never wakes
    /// it: `Ok(None)` when the sandbox is not resident and running (asleep, frozen, or in a
    /// transition), so a follower can stop instead of keeping it awake.
    pub async fn list_files_changed(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        path: &str,
        known: BTreeMap<String, u64>,
        timeout_ms: u64,
    ) -> Result<Option<Vec<DirEntry>>> {
        self.sandbox(tenant, id)?;
        let slot = self.slot(id);
        let guard = slot.state.clone().read_owned().await;
        match &guard.live {
            Some(live) if !live.frozen && live.resident.alive() => {}
            _ => return Ok(None),
        }
        let in_use = InUse {
            guard,
            slot: slot.clone(),
            id: id.clone(),
            evictor: self.evictor.clone(),
        };
        let req = Request::ListChanged {
            path: path.into(),
            known,
            timeout_ms,
        };
        match in_use.resident().call(&req, &[]).await {
            Ok((Reply::Entries { entries }, _)) => Ok(Some(entries)),
            Ok((Reply::Error { code, message }, _)) => Err(ControlError::Agent { code, message }),
            Ok((other, _)) => Err(ControlError::Invalid(format!(
                "unexpected agent reply {other:?}"
            ))),
            Err(_) => Err(self.died_during_call(in_use).await),
        }
    }

    pub async fn remove_file(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        path: &str,
        recursive: bool,
    ) -> Result<()> {
        self.agent_call(
            tenant,
            id,
            Request::Remove {
                path: path.into(),
                recursive,
            },
            &[],
        )
        .await
        .map(|_| ())
    }
}

pub(super) fn check_exec(req: &ExecRequest) -> Result<()> {
    if req.cmd.is_empty() || req.cmd[0].is_empty() {
        return Err(ControlError::Invalid("cmd must name a program".into()));
    }
    if req.cmd.iter().any(|a| a.contains('\0')) {
        return Err(ControlError::Invalid(
            "cmd arguments must not hold NUL bytes".into(),
        ));
    }
    validate_env(&req.env).map_err(|e| ControlError::Invalid(e.to_string()))?;
    if req.timeout_ms == Some(0) {
        return Err(ControlError::Invalid("timeout_ms must be above 0".into()));
    }
    if let Some(cwd) = &req.cwd {
        if !cwd.starts_with('/') {
            return Err(ControlError::Invalid("cwd must be an absolute path".into()));
        }
    }
    Ok(())
}

pub(super) fn exec_reply(
    reply: Reply,
    body: Vec<u8>,
    timeout_ms: Option<u64>,
    detach: bool,
) -> Result<ExecResult> {
    match reply {
        Reply::Exit {
            exit_code,
            signal,
            timed_out,
            duration_us,
            stdout_len,
        } => {
            let split = (stdout_len as usize).min(body.len());
            let stdout = String::from_utf8_lossy(&body[..split]).into_owned();
            let stderr = String::from_utf8_lossy(&body[split..]).into_owned();
            if timed_out {
                return Err(ControlError::ExecTimeout {
                    timeout_ms: timeout_ms.unwrap_or(0),
                    stdout,
                    stderr,
                });
            }
            Ok(ExecResult {
                exit_code,
                signal,
                stdout,
                stderr,
                oom_killed: false,
                duration_ms: duration_us as f64 / 1000.0,
            })
        }
        Reply::Started { pid } if detach => Ok(ExecResult {
            exit_code: None,
            signal: None,
            stdout: format!("{pid}"),
            stderr: String::new(),
            oom_killed: false,
            duration_ms: 0.0,
        }),
        Reply::Error { code, message } => Err(ControlError::Agent { code, message }),
        other => Err(ControlError::Invalid(format!(
            "unexpected agent reply {other:?}"
        ))),
    }
}
