//! A deterministic in-memory [`Node`] for tests that need neither root nor runsc.
//!
//! Each fake container holds a small [`Machine`] (files, environment, a counter that stands for
//! memory state) that its checkpoint writes to `fake-checkpoint.json` in the image directory
//! and a restore reads back: state survives a checkpoint exactly when the control plane kept
//! the right image, and a restore from a missing or half-written image fails as runsc's does.
//!
//! The fake agent answers the agent protocol. Exec understands a few programs: `true`,
//! `false`, `echo ARGS`, `cat PATH`, `env`, `count` (increments the counter and prints it),
//! `sleep SECONDS`, `exit N`, `crash` and `oom` (the container dies, the second as the OOM
//! killer's victim); anything else is "not found" (exit 127 through the engine).
//!
//! Failures are injected per operation ([`FakeNode::inject`]): an error, a checkpoint that
//! writes part of its image and then fails, a delay, or a crash of the container. Every
//! operation is recorded ([`FakeNode::calls`]), and calls that a real node could not serve
//! (talking to a frozen or a gone container) are collected as [`FakeNode::violations`].

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use torpor_core::NetworkPolicy;

use super::{Launch, Node, NodeEvent, NodeInfo, Resident};
use crate::conn::ConnError;
use crate::net::NetStats;
use crate::proto::{self, AgentErrorCode, DirEntry, FileKind, Reply, Request};
use crate::runsc::{ExitHandle, ExitInfo, RuntimeError};
use crate::warm::WarmStats;

/// The file a fake checkpoint writes.
pub const IMAGE_FILE: &str = "fake-checkpoint.json";

/// An operation a fault can be attached to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Boot,
    Restore,
    Checkpoint,
    Freeze,
    Thaw,
    /// A destroy (only `Delay` applies: a destroy cannot fail).
    Destroy,
    /// Any agent request.
    Call,
}

/// What goes wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// The operation fails (a checkpoint's container is gone afterwards, as with runsc).
    Fail,
    /// A checkpoint writes part of its image, then fails.
    FailHalfway,
    /// The operation takes this long, then goes on.
    Delay(Duration),
    /// The container dies during the operation (`oom`: killed by the OOM killer).
    Crash { oom: bool },
}

/// One recorded operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Reconcile,
    Boot {
        container: String,
    },
    Restore {
        container: String,
        image: PathBuf,
    },
    Checkpoint {
        container: String,
        dir: PathBuf,
    },
    Freeze {
        container: String,
    },
    Thaw {
        container: String,
    },
    Destroy {
        container: String,
    },
    Kill {
        container: String,
    },
    /// An agent request, by its kind (`exec`, `read_file`, ...).
    Agent {
        container: String,
        request: String,
    },
}

/// The state inside a fake sandbox: what its checkpoint keeps.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Machine {
    pub files: BTreeMap<String, Vec<u8>>,
    pub env: BTreeMap<String, String>,
    /// Stands for memory state: kept by a checkpoint, lost by a fresh boot.
    pub counter: u64,
}

struct Rule {
    op: Op,
    /// Only containers whose id starts with this.
    prefix: Option<String>,
    fault: Fault,
}

#[derive(Default)]
struct State {
    rules: Vec<Rule>,
    calls: Vec<Call>,
    violations: Vec<String>,
    live: HashMap<String, Arc<Box_>>,
    next_worker: u64,
}

/// The in-memory node.
pub struct FakeNode {
    state: Arc<Mutex<State>>,
    memory: AtomicU64,
    /// Node operations delayed by a [`Fault::Delay`] now, and the most at once so far.
    delayed: (AtomicU64, AtomicU64),
    events: mpsc::UnboundedSender<NodeEvent>,
    events_rx: Mutex<Option<mpsc::UnboundedReceiver<NodeEvent>>>,
    agent_dir: PathBuf,
}

impl Default for FakeNode {
    fn default() -> Self {
        FakeNode::new()
    }
}

impl FakeNode {
    pub fn new() -> FakeNode {
        let (events, rx) = mpsc::unbounded_channel();
        FakeNode {
            state: Arc::default(),
            memory: AtomicU64::new(64 << 20),
            delayed: (AtomicU64::new(0), AtomicU64::new(0)),
            events,
            events_rx: Mutex::new(Some(rx)),
            agent_dir: PathBuf::from("/nonexistent/fake-agent"),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The most node operations (boot, restore, checkpoint, ...) that a [`Fault::Delay`] held
    /// at once so far: how many the node was asked to run side by side.
    pub fn max_delayed_at_once(&self) -> u64 {
        self.delayed.1.load(Ordering::SeqCst)
    }

    /// Makes the next `op` (on any container) go wrong with `fault`. Faults are used once, in
    /// the order injected.
    pub fn inject(&self, op: Op, fault: Fault) {
        self.lock().rules.push(Rule {
            op,
            prefix: None,
            fault,
        });
    }

    /// Like [`FakeNode::inject`], for containers whose id starts with `prefix` only (a sandbox
    /// id picks that sandbox's containers).
    pub fn inject_for(&self, op: Op, prefix: &str, fault: Fault) {
        self.lock().rules.push(Rule {
            op,
            prefix: Some(prefix.to_string()),
            fault,
        });
    }

    /// Faults injected and not yet used.
    pub fn pending_faults(&self) -> usize {
        self.lock().rules.len()
    }

    /// The resident memory each fake container reports.
    pub fn set_memory_per_sandbox(&self, bytes: u64) {
        self.memory.store(bytes, Ordering::SeqCst);
    }

    /// Every operation asked of this node so far.
    pub fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    /// Operations a real node could not have served (a call to a frozen or gone container).
    pub fn violations(&self) -> Vec<String> {
        self.lock().violations.clone()
    }

    /// Ids of the containers running now.
    pub fn running(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.lock().live.keys().cloned().collect();
        ids.sort();
        ids
    }

    /// Whether `container` is frozen now.
    pub fn is_frozen(&self, container: &str) -> bool {
        self.lock()
            .live
            .get(container)
            .is_some_and(|c| c.frozen.load(Ordering::SeqCst))
    }

    /// Kills a running container from outside (a crash; `oom`: by the OOM killer).
    pub fn crash(&self, container: &str, oom: bool) -> bool {
        let c = self.lock().live.get(container).cloned();
        match c {
            Some(c) => {
                self.end(&c, exit_of(oom), false);
                true
            }
            None => false,
        }
    }

    fn record(&self, call: Call) {
        self.lock().calls.push(call);
    }

    /// The first fault injected for `op` on `container`, taken.
    fn fault(&self, op: Op, container: &str) -> Option<Fault> {
        let mut st = self.lock();
        let i = st.rules.iter().position(|r| {
            r.op == op && r.prefix.as_deref().is_none_or(|p| container.starts_with(p))
        })?;
        Some(st.rules.remove(i).fault)
    }

    /// Ends a container: no more calls, its exit reported once.
    fn end(&self, c: &Arc<Box_>, info: ExitInfo, expected: bool) {
        if expected {
            c.expected.store(true, Ordering::SeqCst);
        }
        let removed = self.lock().live.remove(&c.id).is_some();
        c.alive.send_replace(false);
        if c.exit.send_replace(Some(info)).is_none() && removed {
            let _ = self.events.send(NodeEvent::Exited {
                container_id: c.id.clone(),
                info,
                expected: c.expected.load(Ordering::SeqCst),
            });
        }
    }

    fn start(self: &Arc<Self>, launch: &Launch, machine: Machine) -> Box<dyn Resident> {
        let (exit, _) = watch::channel(None);
        let (alive, _) = watch::channel(true);
        let worker = {
            let mut st = self.lock();
            st.next_worker += 1;
            format!("fake-w{}", st.next_worker)
        };
        let c = Arc::new(Box_ {
            id: launch.container_id.clone(),
            worker,
            machine: Mutex::new(machine),
            frozen: AtomicBool::new(false),
            expected: Arc::new(AtomicBool::new(false)),
            exit,
            alive,
            networked: launch.network.is_some(),
        });
        self.lock().live.insert(c.id.clone(), c.clone());
        Box::new(FakeResident {
            node: self.clone(),
            c,
        })
    }

    async fn apply(&self, op: Op, container: &str) -> Result<Option<Fault>, RuntimeError> {
        match self.fault(op, container) {
            Some(Fault::Delay(d)) => {
                let now = self.delayed.0.fetch_add(1, Ordering::SeqCst) + 1;
                self.delayed.1.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(d).await;
                self.delayed.0.fetch_sub(1, Ordering::SeqCst);
                Ok(None)
            }
            Some(Fault::Fail) => Err(injected(op)),
            other => Ok(other),
        }
    }
}

fn injected(op: Op) -> RuntimeError {
    RuntimeError::RunscFailed {
        command: format!("{op:?}").to_lowercase(),
        status: "exit status: 128".into(),
        stderr: "injected failure (fake node)".into(),
    }
}

fn exit_of(oom: bool) -> ExitInfo {
    ExitInfo {
        code: None,
        signal: Some(9),
        oom_killed: oom,
    }
}

/// A fake container (named so that `Arc<Box_>` reads as "the box").
struct Box_ {
    id: String,
    worker: String,
    machine: Mutex<Machine>,
    frozen: AtomicBool,
    expected: Arc<AtomicBool>,
    exit: watch::Sender<Option<ExitInfo>>,
    alive: watch::Sender<bool>,
    networked: bool,
}

/// The node as the fake's `Node` implementation sees it: shared, so residents can reach it.
#[async_trait]
impl Node for Arc<FakeNode> {
    fn info(&self) -> NodeInfo {
        NodeInfo {
            runtime_version: "fake".into(),
            platform: "fake".into(),
            nvproxy: false,
            agent_dir: self.agent_dir.clone(),
        }
    }

    fn take_events(&self) -> Option<mpsc::UnboundedReceiver<NodeEvent>> {
        self.events_rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    async fn reconcile(&self, _known_sandboxes: &[String]) -> usize {
        self.record(Call::Reconcile);
        0
    }

    async fn boot(&self, launch: Launch) -> Result<Box<dyn Resident>, RuntimeError> {
        self.record(Call::Boot {
            container: launch.container_id.clone(),
        });
        if let Some(Fault::Crash { .. } | Fault::FailHalfway) =
            self.apply(Op::Boot, &launch.container_id).await?
        {
            return Err(RuntimeError::ExitedEarly("injected crash at boot".into()));
        }
        let machine = Machine {
            env: launch.spec.env.clone(),
            ..Machine::default()
        };
        Ok(self.start(&launch, machine))
    }

    async fn restore(
        &self,
        launch: Launch,
        image: &Path,
    ) -> Result<Box<dyn Resident>, RuntimeError> {
        self.record(Call::Restore {
            container: launch.container_id.clone(),
            image: image.to_path_buf(),
        });
        if let Some(Fault::Crash { .. } | Fault::FailHalfway) =
            self.apply(Op::Restore, &launch.container_id).await?
        {
            return Err(RuntimeError::ExitedEarly(
                "injected crash at restore".into(),
            ));
        }
        let path = image.join(IMAGE_FILE);
        let bytes = std::fs::read(&path).map_err(|source| RuntimeError::Io {
            path: path.clone(),
            source,
        })?;
        let machine: Machine =
            serde_json::from_slice(&bytes).map_err(|e| RuntimeError::RunscFailed {
                command: "restore".into(),
                status: "exit status: 128".into(),
                stderr: format!("corrupt image {}: {e}", path.display()),
            })?;
        Ok(self.start(&launch, machine))
    }

    async fn kill(&self, container_id: &str) {
        self.record(Call::Kill {
            container: container_id.to_string(),
        });
        let c = self.lock().live.get(container_id).cloned();
        if let Some(c) = c {
            self.end(&c, exit_of(false), false);
        }
    }

    fn log_tail(&self, container_id: &str) -> String {
        format!("(fake node: no log for {container_id})")
    }

    fn warm_stats(&self) -> WarmStats {
        WarmStats::default()
    }

    async fn shutdown(&self) {}
}

struct FakeResident {
    node: Arc<FakeNode>,
    c: Arc<Box_>,
}

impl FakeResident {
    fn check_usable(&self, what: &str) {
        if self.c.frozen.load(Ordering::SeqCst) {
            self.node
                .lock()
                .violations
                .push(format!("{what} to frozen container {}", self.c.id));
        }
    }
}

#[async_trait]
impl Resident for FakeResident {
    fn id(&self) -> &str {
        &self.c.id
    }

    fn worker(&self) -> &str {
        &self.c.worker
    }

    fn was_warm(&self) -> bool {
        true
    }

    async fn send(
        &self,
        req: &Request,
        body: &[u8],
    ) -> Result<mpsc::Receiver<(Reply, Vec<u8>)>, ConnError> {
        if !*self.c.alive.borrow() {
            return Err(ConnError::Closed);
        }
        self.check_usable("agent request");
        self.node.record(Call::Agent {
            container: self.c.id.clone(),
            request: request_kind(req).into(),
        });
        let (tx, rx) = mpsc::channel(64);
        let node = self.node.clone();
        let c = self.c.clone();
        let (req, body) = (req.clone(), body.to_vec());
        tokio::spawn(async move {
            let fault = match node.fault(Op::Call, &c.id) {
                Some(Fault::Delay(d)) => {
                    tokio::time::sleep(d).await;
                    None
                }
                other => other,
            };
            match fault {
                Some(Fault::Crash { oom }) => node.end(&c, exit_of(oom), false),
                Some(_) => {
                    let _ = tx
                        .send((
                            Reply::Error {
                                code: AgentErrorCode::Io,
                                message: "injected failure (fake node)".into(),
                            },
                            Vec::new(),
                        ))
                        .await;
                }
                None => serve(&node, &c, req, body, tx).await,
            }
        });
        Ok(rx)
    }

    fn agent_version(&self) -> u32 {
        proto::VERSION
    }

    fn alive(&self) -> bool {
        *self.c.alive.borrow()
    }

    fn exit_handle(&self) -> ExitHandle {
        ExitHandle::from_parts(self.c.exit.subscribe(), self.c.expected.clone())
    }

    async fn set_frozen(&self, frozen: bool) -> Result<(), RuntimeError> {
        let (op, call) = if frozen {
            (
                Op::Freeze,
                Call::Freeze {
                    container: self.c.id.clone(),
                },
            )
        } else {
            (
                Op::Thaw,
                Call::Thaw {
                    container: self.c.id.clone(),
                },
            )
        };
        self.node.record(call);
        self.node.apply(op, &self.c.id).await?;
        self.c.frozen.store(frozen, Ordering::SeqCst);
        Ok(())
    }

    fn memory(&self) -> Option<u64> {
        Some(self.node.memory.load(Ordering::SeqCst))
    }

    async fn checkpoint(self: Box<Self>, image_dir: &Path) -> Result<(), RuntimeError> {
        self.node.record(Call::Checkpoint {
            container: self.c.id.clone(),
            dir: image_dir.to_path_buf(),
        });
        if !*self.c.alive.borrow() {
            self.node
                .lock()
                .violations
                .push(format!("checkpoint of gone container {}", self.c.id));
        }
        let io = |source| RuntimeError::Io {
            path: image_dir.to_path_buf(),
            source,
        };
        // runsc thaws a frozen container itself before it checkpoints.
        self.c.frozen.store(false, Ordering::SeqCst);
        let fault = self.node.apply(Op::Checkpoint, &self.c.id).await;
        let result = match fault {
            Err(e) => Err(e),
            Ok(Some(Fault::FailHalfway)) => {
                std::fs::create_dir_all(image_dir).map_err(io)?;
                std::fs::write(image_dir.join("pages.partial"), b"half").map_err(io)?;
                Err(injected(Op::Checkpoint))
            }
            Ok(Some(Fault::Crash { oom })) => {
                self.node.end(&self.c, exit_of(oom), false);
                return Err(RuntimeError::ExitedEarly(
                    "the container died during its checkpoint (fake node)".into(),
                ));
            }
            Ok(_) => {
                let machine = self
                    .c
                    .machine
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone();
                std::fs::create_dir_all(image_dir).map_err(io)?;
                std::fs::write(
                    image_dir.join(IMAGE_FILE),
                    serde_json::to_vec(&machine).expect("machine serialises"),
                )
                .map_err(io)?;
                Ok(())
            }
        };
        // Gone afterwards, success or not (runsc stops it either way).
        self.node.end(&self.c, exit_of(false), true);
        result
    }

    async fn destroy(self: Box<Self>) {
        self.node.record(Call::Destroy {
            container: self.c.id.clone(),
        });
        let _ = self.node.apply(Op::Destroy, &self.c.id).await;
        self.node.end(&self.c, exit_of(false), true);
    }

    fn ingress_addr(&self) -> Option<Ipv4Addr> {
        self.c.networked.then_some(Ipv4Addr::new(127, 0, 0, 1))
    }

    async fn apply_policy(&self, _policy: &NetworkPolicy) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn net_stats(&self) -> Option<NetStats> {
        self.c.networked.then(NetStats::default)
    }

    async fn settle_connections(&self) {}
}

fn request_kind(req: &Request) -> &'static str {
    match req {
        Request::Hello => "hello",
        Request::Configure { .. } => "configure",
        Request::Exec(_) => "exec",
        Request::ReadFile { .. } => "read_file",
        Request::ReadRange { .. } => "read_range",
        Request::WriteFile { .. } => "write_file",
        Request::List { .. } => "list",
        Request::ListChanged { .. } => "list_changed",
        Request::Remove { .. } => "remove",
        Request::SetMetadata { .. } => "set_metadata",
        Request::ListWithMetadata { .. } => "list_with_metadata",
        Request::MainStatus => "main_status",
        Request::Spawn(_) => "spawn",
        Request::ProcInput { .. } => "proc_input",
        Request::ProcCloseInput { .. } => "proc_close_input",
        Request::ProcResize { .. } => "proc_resize",
        Request::Reboot => "reboot",
        Request::WatchStart { .. } | Request::WatchEvents { .. } | Request::WatchStop { .. } => {
            "watch"
        }
    }
}

fn not_found(path: &str) -> Reply {
    Reply::Error {
        code: AgentErrorCode::NotFound,
        message: format!("{path}: no such file or directory"),
    }
}

/// The fake agent: answers one request against the container's machine.
async fn serve(
    node: &FakeNode,
    c: &Arc<Box_>,
    req: Request,
    body: Vec<u8>,
    tx: mpsc::Sender<(Reply, Vec<u8>)>,
) {
    let machine = || c.machine.lock().unwrap_or_else(|p| p.into_inner());
    let reply = match req {
        Request::Hello => (
            Reply::Hello {
                version: proto::VERSION,
                pid: 1,
            },
            Vec::new(),
        ),
        Request::Configure { env } => {
            machine().env.extend(env);
            (Reply::Ok, Vec::new())
        }
        Request::MainStatus => (
            Reply::Main {
                pid: Some(1),
                running: true,
                exit_code: None,
                signal: None,
            },
            Vec::new(),
        ),
        Request::WriteFile { path, .. } => {
            machine().files.insert(path, body);
            (Reply::Ok, Vec::new())
        }
        Request::ReadFile { path, max_bytes } => match machine().files.get(&path) {
            Some(data) => {
                let n = data.len().min(max_bytes as usize);
                (
                    Reply::Data {
                        truncated: n < data.len(),
                    },
                    data[..n].to_vec(),
                )
            }
            None => (not_found(&path), Vec::new()),
        },
        Request::ReadRange {
            path,
            offset,
            max_bytes,
        } => match machine().files.get(&path) {
            Some(data) => {
                let start = (offset as usize).min(data.len());
                let end = start.saturating_add(max_bytes as usize).min(data.len());
                (
                    Reply::Data {
                        truncated: end < data.len(),
                    },
                    data[start..end].to_vec(),
                )
            }
            None => (not_found(&path), Vec::new()),
        },
        Request::Remove { path, .. } => {
            let prefix = format!("{}/", path.trim_end_matches('/'));
            let mut m = machine();
            let before = m.files.len();
            m.files.retain(|k, _| *k != path && !k.starts_with(&prefix));
            if m.files.len() == before {
                (not_found(&path), Vec::new())
            } else {
                (Reply::Ok, Vec::new())
            }
        }
        Request::List { path } | Request::ListChanged { path, .. } => {
            let prefix = format!("{}/", path.trim_end_matches('/'));
            let entries = machine()
                .files
                .iter()
                .filter_map(|(k, v)| {
                    let name = k.strip_prefix(&prefix)?;
                    (!name.contains('/')).then(|| DirEntry {
                        name: name.to_string(),
                        kind: FileKind::File,
                        size: v.len() as u64,
                        mode: 0o644,
                        modified_ms: 0,
                        uid: 0,
                        gid: 0,
                    })
                })
                .collect();
            (Reply::Entries { entries }, Vec::new())
        }
        Request::Exec(exec) => {
            let timeout = exec.timeout_ms.map(Duration::from_millis);
            match run(node, c, &exec.cmd, timeout).await {
                Ran::Exited {
                    code,
                    out,
                    timed_out,
                } => {
                    if exec.stream && !out.is_empty() {
                        let _ = tx.send((Reply::Output { fd: 1 }, out.clone())).await;
                    }
                    let stdout_len = if exec.stream { 0 } else { out.len() as u64 };
                    (
                        Reply::Exit {
                            exit_code: (!timed_out).then_some(code),
                            signal: timed_out.then_some(9),
                            timed_out,
                            duration_us: 1,
                            stdout_len,
                        },
                        if exec.stream { Vec::new() } else { out },
                    )
                }
                Ran::NotFound(program) => (
                    Reply::Error {
                        code: AgentErrorCode::NotFound,
                        message: format!("{program}: not found"),
                    },
                    Vec::new(),
                ),
                Ran::Died => return,
            }
        }
        other => (
            Reply::Error {
                code: AgentErrorCode::BadRequest,
                message: format!("the fake agent does not do {}", request_kind(&other)),
            },
            Vec::new(),
        ),
    };
    let _ = tx.send(reply).await;
}

enum Ran {
    Exited {
        code: i32,
        out: Vec<u8>,
        timed_out: bool,
    },
    NotFound(String),
    /// The container died (its channel ends without a reply).
    Died,
}

async fn run(node: &FakeNode, c: &Arc<Box_>, cmd: &[String], timeout: Option<Duration>) -> Ran {
    let machine = || c.machine.lock().unwrap_or_else(|p| p.into_inner());
    let args = &cmd[1..];
    let ok = |out: String| Ran::Exited {
        code: 0,
        out: out.into_bytes(),
        timed_out: false,
    };
    match cmd.first().map(String::as_str).unwrap_or("") {
        "true" => ok(String::new()),
        "false" => Ran::Exited {
            code: 1,
            out: Vec::new(),
            timed_out: false,
        },
        "echo" => ok(format!("{}\n", args.join(" "))),
        "env" => ok(machine()
            .env
            .iter()
            .map(|(k, v)| format!("{k}={v}\n"))
            .collect()),
        "count" => {
            let mut m = machine();
            m.counter += 1;
            ok(format!("{}\n", m.counter))
        }
        "cat" => {
            let path = args.first().cloned().unwrap_or_default();
            match machine().files.get(&path) {
                Some(data) => Ran::Exited {
                    code: 0,
                    out: data.clone(),
                    timed_out: false,
                },
                None => Ran::Exited {
                    code: 1,
                    out: Vec::new(),
                    timed_out: false,
                },
            }
        }
        "exit" => Ran::Exited {
            code: args.first().and_then(|a| a.parse().ok()).unwrap_or(0),
            out: Vec::new(),
            timed_out: false,
        },
        "sleep" => {
            let want =
                Duration::from_secs_f64(args.first().and_then(|a| a.parse().ok()).unwrap_or(0.0));
            let mut alive = c.alive.subscribe();
            let wait = timeout.map_or(want, |t| t.min(want));
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = alive.wait_for(|a| !*a) => return Ran::Died,
            }
            Ran::Exited {
                code: 0,
                out: Vec::new(),
                timed_out: wait < want,
            }
        }
        "crash" | "oom" => {
            node.end(c, exit_of(cmd[0] == "oom"), false);
            Ran::Died
        }
        other => Ran::NotFound(other.to_string()),
    }
}
