//! The agent: torpor's init process inside every sandbox (`torpor sandbox-agent`).
//!
//! It owns the sandbox's side of [`crate::proto`]: it reads requests from stdin, runs commands,
//! reads and writes files, and answers on stdout. It also starts the template's main process and
//! reaps every process in the sandbox (it is PID 1, so orphans come to it).
//!
//! It is plain threads and blocking I/O on purpose: under gVisor's ptrace platform every syscall
//! is expensive, and an async runtime's extra epoll and futex traffic would cost more than it
//! saves. Requests are read and run by a small pool of threads that grows when all are busy, so
//! a long exec never blocks a short one. It must never write anything but frames to stdout, and
//! no child may inherit stdin or stdout.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{self, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::proto::{
    self, AgentErrorCode, DirEntry, ExecRequest, FileKind, FrameError, Reply, Request,
};

pub mod floor;
mod metadata;
mod procs;
mod reboot;
mod spawn;
pub mod sudo;
mod watch;

/// Where the main process's output and detached execs' output go inside the sandbox.
pub const LOG_DIR: &str = "/var/log/torpor";

/// Test only: when the agent's own environment (a template's `env`) sets this to `1`, it
/// answers `Spawn`, `ProcInput`, `ProcCloseInput` and `ProcResize` as an agent that predates
/// them does (one that cannot parse the request: a `bad_request` under id 0, none under the
/// request's id), so the tests can exercise the E2B adapter's fallback to its supervisor shell
/// for sandboxes restored from older snapshots. Nothing else changes.
pub const TEST_WITHOUT_SPAWN: &str = "TORPOR_AGENT_TEST_WITHOUT_SPAWN";

/// Test only: when the agent's own environment (a template's `env`) sets this to a protocol
/// version older than [`proto::VERSION`], the agent says that version in its hello and answers
/// the requests that came after it (`SetMetadata`, `ListWithMetadata` before 3, `Reboot` before
/// 4; nor does it keep a boot id before 4) as an agent of
/// that version does (one that cannot parse them: a `bad_request` under id 0, none under the
/// request's id), so the tests can exercise the callers' version checks for sandboxes restored
/// from older snapshots. Nothing else changes.
pub const TEST_AGENT_VERSION: &str = "TORPOR_AGENT_TEST_VERSION";

/// Benchmark only: when the agent's own environment (a template's `env`) sets this to `1`, an
/// `Exec` (or a followed `Spawn`) lets go of the channel as soon as it is read, as every request did before the thread
/// running it kept it ([`Pool`]), so that the runtime benchmark measures both in one run.
pub const BENCH_EAGER_HANDOFF: &str = "TORPOR_AGENT_BENCH_EAGER_HANDOFF";

/// Benchmark only: when a sandbox's configured environment (its `env` at create, E2B's
/// `envs`) sets this to `1`, a followed `Spawn` answers `Spawned` at once whatever its
/// `spawned_within_ms` asks, as before protocol 7, so that the E2B benchmark measures both in
/// one run (it changes when the sandbox's own replies come, nothing else).
pub const BENCH_SPAWNED_AT_ONCE: &str = "TORPOR_AGENT_BENCH_SPAWNED_AT_ONCE";

/// When the agent's environment (a template's `env`) sets this to `UID:GID`, files and the
/// directories `WriteFile` creates belong to that user (E2B's `base`: files written through
/// the SDK belong to `user`) instead of root.
pub const FILE_OWNER: &str = "TORPOR_AGENT_FILE_OWNER";

/// Runs the agent until stdin closes. `main_cmd` is the template's main process (may be empty).
///
/// The same entry point runs the sandbox's sudo broker and its client ([`sudo`]) when the
/// first argument is [`sudo::SERVER_FLAG`] or [`sudo::CLIENT_FLAG`] (they are this binary,
/// mounted read-only in every sandbox, started inside it).
pub fn run(main_cmd: Vec<String>) -> io::Result<()> {
    match main_cmd.first().map(String::as_str) {
        Some(sudo::SERVER_FLAG) => return sudo::serve(&main_cmd[1..]),
        Some(sudo::CLIENT_FLAG) => std::process::exit(sudo::client(&main_cmd[1..])),
        Some(floor::FLAG) => std::process::exit(floor::run(&main_cmd[1..])),
        _ => {}
    }
    // SAFETY: fds 0 and 1 are the container's stdio, open for the agent's whole life; nothing
    // else in this process uses them through std's handles.
    let input = unsafe { File::from_raw_fd(0) };
    let output = unsafe { File::from_raw_fd(1) };
    let agent = Arc::new(Agent {
        out: Mutex::new(output),
        env: RwLock::new(BTreeMap::new()),
        children: Arc::new(ChildTable::default()),
        main: Mutex::new(MainState::default()),
        without_spawn: std::env::var_os(TEST_WITHOUT_SPAWN).is_some_and(|v| v == "1"),
        version: std::env::var(TEST_AGENT_VERSION)
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|v| *v <= proto::VERSION)
            .unwrap_or(proto::VERSION),
        file_owner: std::env::var(FILE_OWNER).ok().and_then(|v| parse_owner(&v)),
        main_cmd: main_cmd.clone(),
    });
    let _ = fs::create_dir_all(LOG_DIR);
    if agent.version >= proto::REBOOT_SINCE {
        reboot::new_boot();
    }
    {
        let children = agent.children.clone();
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || children.reap_forever())?;
    }
    if !main_cmd.is_empty() {
        agent.start_main(&main_cmd);
    }
    let pool = Arc::new(Pool {
        input: Mutex::new(BufReader::with_capacity(1 << 16, input)),
        readers: AtomicUsize::new(1),
        eager_handoff: std::env::var_os(BENCH_EAGER_HANDOFF).is_some_and(|v| v == "1"),
        agent,
    });
    pool.serve()
}

fn bad_request(message: String) -> Reply {
    Reply::Error {
        code: AgentErrorCode::BadRequest,
        message,
    }
}

struct Agent {
    out: Mutex<File>,
    env: RwLock<BTreeMap<String, String>>,
    children: Arc<ChildTable>,
    main: Mutex<MainState>,
    /// [`TEST_WITHOUT_SPAWN`] is set.
    without_spawn: bool,
    /// The protocol version it says ([`TEST_AGENT_VERSION`], else [`proto::VERSION`]).
    version: u32,
    /// [`FILE_OWNER`]: who owns what `WriteFile` creates.
    file_owner: Option<proto::RunAs>,
    /// The template's main process, started at boot and again by `Reboot` (may be empty).
    main_cmd: Vec<String>,
}

/// `UID:GID` (both numbers).
fn parse_owner(v: &str) -> Option<proto::RunAs> {
    let (u, g) = v.trim().split_once(':')?;
    Some(proto::RunAs {
        uid: u.parse().ok()?,
        gid: g.parse().ok()?,
    })
}

#[derive(Default)]
struct MainState {
    pid: Option<u32>,
    exit: Option<WaitStatus>,
}

impl Agent {
    fn reply(&self, id: u64, reply: &Reply, body: &[u8]) {
        let frame = match proto::encode(id, reply, body) {
            Ok(f) => f,
            Err(e) => proto::encode(
                id,
                &Reply::Error {
                    code: AgentErrorCode::TooLarge,
                    message: e.to_string(),
                },
                &[],
            )
            .expect("small error frame encodes"),
        };
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = out.write_all(&frame) {
            eprintln!("torpor-agent: cannot write reply: {e}");
        }
    }

    /// Runs one request and answers it. `held` is the channel's input when the calling thread
    /// still holds it ([`Pool::serve`]): an `Exec` or a followed `Spawn` keeps it while its
    /// command runs and gives it back as soon as another request comes; any other request gives
    /// it back first.
    fn handle(&self, id: u64, req: Request, body: Vec<u8>, held: Option<&dyn HeldInput>) {
        if !keeps_channel(&req) {
            if let Some(h) = held {
                h.release();
            }
        }
        if self.without_spawn
            && matches!(
                req,
                Request::Spawn(_)
                    | Request::ProcInput { .. }
                    | Request::ProcCloseInput { .. }
                    | Request::ProcResize { .. }
            )
        {
            let m = format!("malformed request: unknown op ({TEST_WITHOUT_SPAWN} is set)");
            self.reply(0, &bad_request(m), &[]);
            return;
        }
        if self.version < proto::METADATA_SINCE
            && matches!(
                req,
                Request::SetMetadata { .. } | Request::ListWithMetadata { .. }
            )
        {
            let m = format!(
                "malformed request: unknown op ({TEST_AGENT_VERSION} is {})",
                self.version
            );
            self.reply(0, &bad_request(m), &[]);
            return;
        }
        if self.version < proto::WATCH_SINCE
            && matches!(
                req,
                Request::WatchStart { .. }
                    | Request::WatchEvents { .. }
                    | Request::WatchStop { .. }
            )
        {
            let m = format!(
                "malformed request: unknown op ({TEST_AGENT_VERSION} is {})",
                self.version
            );
            self.reply(0, &bad_request(m), &[]);
            return;
        }
        if self.version < proto::SPAWN_FOLLOW_SINCE
            && matches!(&req, Request::Spawn(s) if s.follow_ms > 0)
        {
            let m = format!(
                "malformed request: unknown field `follow_ms` ({TEST_AGENT_VERSION} is {})",
                self.version
            );
            self.reply(0, &bad_request(m), &[]);
            return;
        }
        if self.version < proto::REBOOT_SINCE && matches!(req, Request::Reboot) {
            let m = format!(
                "malformed request: unknown op ({TEST_AGENT_VERSION} is {})",
                self.version
            );
            self.reply(0, &bad_request(m), &[]);
            return;
        }
        let result = match req {
            Request::Hello => Ok((
                Reply::Hello {
                    version: self.version,
                    pid: std::process::id(),
                },
                Vec::new(),
            )),
            Request::Configure { env } => {
                *self.env.write().unwrap_or_else(|p| p.into_inner()) = env;
                if self.version >= proto::REBOOT_SINCE {
                    reboot::new_boot();
                }
                Ok((Reply::Ok, Vec::new()))
            }
            Request::Exec(req) => self.exec(id, req, body, held),
            Request::ReadFile { path, max_bytes } => read_file(&path, max_bytes),
            Request::ReadRange {
                path,
                offset,
                max_bytes,
            } => read_range(&path, offset, max_bytes),
            Request::WriteFile { path, mode } => write_file(&path, mode, &body, self.file_owner),
            Request::List { path } => list(&path),
            Request::ListChanged {
                path,
                known,
                timeout_ms,
            } => list_changed(&path, &known, timeout_ms),
            Request::Remove { path, recursive } => remove(&path, recursive),
            Request::SetMetadata { path, metadata } => metadata::set(&path, &metadata),
            Request::ListWithMetadata { path, name } => metadata::list(&path, name.as_deref()),
            Request::MainStatus => Ok((self.main_status(), Vec::new())),
            Request::Spawn(req) => return self.spawn_and_reply(id, req, &body, held),
            Request::ProcInput { pid } => self.proc_input(pid, &body),
            Request::ProcCloseInput { pid } => self.proc_close_input(pid),
            Request::ProcResize { pid, cols, rows } => {
                self.proc_resize(pid, proto::PtySize { cols, rows })
            }
            Request::Reboot => self.reboot(),
            Request::WatchStart { path, recursive } => watch::start(&path, recursive),
            Request::WatchEvents { watch } => watch::events(watch),
            Request::WatchStop { watch } => watch::stop(watch),
        };
        match result {
            Ok((reply, body)) => self.reply(id, &reply, &body),
            Err(e) => self.reply(id, &e, &[]),
        }
    }

    fn main_status(&self) -> Reply {
        let main = self.main.lock().unwrap_or_else(|p| p.into_inner());
        let exit = main
            .exit
            .or_else(|| main.pid.and_then(|pid| self.children.exited(pid)));
        Reply::Main {
            pid: main.pid,
            running: main.pid.is_some() && exit.is_none(),
            exit_code: exit.and_then(|s| s.code),
            signal: exit.and_then(|s| s.signal),
        }
    }

    fn start_main(&self, cmd: &[String]) {
        let log = open_log("main.log");
        let mut command = Command::new(&cmd[0]);
        command
            .args(&cmd[1..])
            .stdin(Stdio::null())
            .stdout(log.as_ref().map_or(Stdio::null(), clone_stdio))
            .stderr(log.as_ref().map_or(Stdio::null(), clone_stdio));
        match self.children.spawn(&mut command, true) {
            Ok((child, _)) => {
                self.main.lock().unwrap_or_else(|p| p.into_inner()).pid = Some(child.id());
            }
            Err(e) => eprintln!("torpor-agent: cannot start main process {cmd:?}: {e}"),
        }
    }

    fn exec(
        &self,
        id: u64,
        req: ExecRequest,
        stdin: Vec<u8>,
        held: Option<&dyn HeldInput>,
    ) -> Result<(Reply, Vec<u8>), Reply> {
        if req.cmd.is_empty() {
            return Err(bad_request("cmd must not be empty".into()));
        }
        let spawn_err = |e: io::Error| Reply::Error {
            code: match e.kind() {
                io::ErrorKind::NotFound => AgentErrorCode::NotFound,
                io::ErrorKind::PermissionDenied => AgentErrorCode::PermissionDenied,
                _ => AgentErrorCode::SpawnFailed,
            },
            message: format!("cannot start {:?}: {e}", req.cmd[0]),
        };
        if req.detach {
            let mut command = exec_command(
                &req.cmd,
                self.env.read().unwrap_or_else(|p| p.into_inner()).iter(),
                &req.env,
                req.cwd.as_deref(),
            );
            let log = open_log("detached.log");
            command
                .stdin(Stdio::null())
                .stdout(log.as_ref().map_or(Stdio::null(), clone_stdio))
                .stderr(log.as_ref().map_or(Stdio::null(), clone_stdio));
            let (child, _) = self
                .children
                .spawn(&mut command, false)
                .map_err(spawn_err)?;
            return Ok((Reply::Started { pid: child.id() }, Vec::new()));
        }
        let started = Instant::now();
        let prepared = spawn::Prepared::new(
            &req.cmd,
            self.env.read().unwrap_or_else(|p| p.into_inner()).iter(),
            &req.env,
            req.cwd.as_deref(),
            None,
            true,
        )
        .ok_or_else(|| unstartable(&req.cmd[0]))?;
        let (mut child, mut io) = start_exec(stdin, |stdio| {
            self.children.spawn_owned(|| prepared.spawn(stdio))
        })
        .map_err(spawn_err)?;
        io.stdin_nonblocking();
        let deadline = req.timeout_ms.map(|ms| started + Duration::from_millis(ms));
        let stream = |fd: u8, chunk: &[u8]| self.reply(id, &Reply::Output { fd }, chunk);
        let outcome = io.pump(
            &mut child,
            deadline,
            DRAIN_AFTER_EXIT,
            req.stream.then_some(&stream),
            held,
        );
        let (status, timed_out) = match outcome {
            Pumped::Exited(s) => (Some(s), false),
            Pumped::TimedOut => {
                // Waiting for the kill to land must not hold the channel.
                if let Some(h) = held {
                    h.release();
                }
                // SAFETY: kill(2) on a process group we created; no memory is touched.
                unsafe { libc::kill(-(child.pid as i32), libc::SIGKILL) };
                (
                    child.wait(Some(Instant::now() + Duration::from_secs(5))),
                    true,
                )
            }
        };
        let stdout_len = io.out.len() as u64;
        let mut body = io.out;
        body.extend_from_slice(&io.err);
        Ok((
            Reply::Exit {
                exit_code: status.and_then(|s| s.code),
                signal: status.and_then(|s| s.signal),
                timed_out,
                duration_us: started.elapsed().as_micros() as u64,
                stdout_len,
            },
            body,
        ))
    }
}

/// Why a command that [`spawn::Prepared::new`] refused cannot start (as `Command` would say).
fn unstartable(program: &str) -> Reply {
    if program.is_empty() {
        return Reply::Error {
            code: AgentErrorCode::NotFound,
            message: "cannot start \"\": no program named".into(),
        };
    }
    Reply::Error {
        code: AgentErrorCode::SpawnFailed,
        message: format!(
            "cannot start {program:?}: a NUL byte in its arguments, environment or directory"
        ),
    }
}

/// The pipes of an `Exec`'s command, started by `spawn` (a [`spawn::Prepared`] built as for
/// an `Exec`: its own process group, the agent's environment under the request's): stdin from
/// `stdin` when there is some (else `/dev/null`), stdout and stderr piped (this side's ends
/// blocking: [`ChildIo::pump`] wants only stdin's non-blocking). [`floor`] starts its commands
/// here too, so that the floor it measures is this very spawn.
fn start_exec<T>(
    stdin: Vec<u8>,
    spawn: impl FnOnce(spawn::Stdio3) -> io::Result<T>,
) -> io::Result<(T, ChildIo)> {
    let (out_r, out_w) = procs::pipe()?;
    let (err_r, err_w) = procs::pipe()?;
    let (child_in, stdin_w) = if stdin.is_empty() {
        (None, None)
    } else {
        let (r, w) = procs::pipe()?;
        (Some(r), Some(w))
    };
    let started = spawn(spawn::Stdio3 {
        stdin: child_in.as_ref().map_or(dev_null()?, |f| f.as_raw_fd()),
        stdout: out_w.as_raw_fd(),
        stderr: err_w.as_raw_fd(),
    })?;
    drop((child_in, out_w, err_w));
    Ok((
        started,
        ChildIo {
            stdin: stdin_w,
            stdin_data: stdin,
            stdin_pos: 0,
            stdout: Some(out_r),
            stderr: Some(err_r),
            out: Vec::new(),
            err: Vec::new(),
        },
    ))
}

/// `/dev/null`, opened once (close-on-exec) for every exec's stdin: two system calls fewer per
/// exec than opening it each time.
fn dev_null() -> io::Result<i32> {
    static NULL: std::sync::OnceLock<File> = std::sync::OnceLock::new();
    if let Some(f) = NULL.get() {
        return Ok(f.as_raw_fd());
    }
    let f = File::open("/dev/null")?;
    Ok(NULL.get_or_init(|| f).as_raw_fd())
}

/// The command a detached `Exec` starts: `cmd` with the configured environment, then the
/// request's, in `cwd`, in a process group of its own. Its stdio is the caller's to set.
fn exec_command<'a>(
    cmd: &[String],
    configured: impl Iterator<Item = (&'a String, &'a String)>,
    env: &BTreeMap<String, String>,
    cwd: Option<&str>,
) -> Command {
    let mut command = Command::new(&cmd[0]);
    command.args(&cmd[1..]);
    command.envs(configured);
    command.envs(env);
    if let Some(cwd) = cwd {
        command.current_dir(cwd);
    }
    command.process_group(0);
    command
}

fn clone_stdio(f: &File) -> Stdio {
    f.try_clone().map_or(Stdio::null(), Stdio::from)
}

fn open_log(name: &str) -> Option<File> {
    fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o644)
        .open(Path::new(LOG_DIR).join(name))
        .ok()
}

/// Where streamed output goes: (fd, bytes).
type OutputSink<'a> = dyn Fn(u8, &[u8]) + 'a;

enum Pumped {
    Exited(WaitStatus),
    TimedOut,
}

/// The pipes of one running exec.
struct ChildIo {
    stdin: Option<File>,
    stdin_data: Vec<u8>,
    stdin_pos: usize,
    stdout: Option<File>,
    stderr: Option<File>,
    out: Vec<u8>,
    err: Vec<u8>,
}

/// After the process exits, how long to keep reading pipes still held open by something it left
/// running in the background.
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(50);

/// How often [`ChildIo::pump`] looks for the exit while output flows (a process whose pipes
/// something it left running keeps busy).
const EXIT_LOOK: Duration = Duration::from_millis(20);

impl ChildIo {
    /// Moves bytes between the pipes and the buffers until the process exits and its pipes
    /// close (or `linger` after its exit), or the deadline passes. With `stream`, output is
    /// sent as it arrives instead.
    ///
    /// Output pipes are read only when a poll says they hold something (or are at their end),
    /// one read each, so they may stay blocking: no `fcntl` per exec (every system call is a
    /// round trip through gVisor's kernel). The stdin pipe must be non-blocking
    /// ([`ChildIo::stdin_nonblocking`]): a write larger than its room would block.
    ///
    /// The exit is looked for when a poll slice passed with nothing on the pipes, at least every
    /// [`EXIT_LOOK`] while output flows (looking at an [`OwnedChild`] is a system call), and
    /// waited for once the pipes have closed.
    ///
    /// `held`, the channel's input while this thread holds it, is watched in every wait here
    /// and given back when a request arrives.
    fn pump(
        &mut self,
        exit: &mut dyn ExitWatch,
        deadline: Option<Instant>,
        linger: Duration,
        stream: Option<&OutputSink<'_>>,
        held: Option<&dyn HeldInput>,
    ) -> Pumped {
        let mut status: Option<WaitStatus> = None;
        let mut exited_at: Option<Instant> = None;
        let mut next_look = Instant::now() + EXIT_LOOK;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let open = self.stdout.is_some() || self.stderr.is_some();
            if let Some(s) = status {
                if !open || exited_at.is_some_and(|t| t.elapsed() >= linger) {
                    // Everything the process wrote before it exited is in the pipes now: read
                    // it whatever the clock says. (The first exec after a restore saw the
                    // clock step past the window before its first read, and answered with
                    // no output at all.)
                    // (Bounded: something it left running may write for ever.)
                    for _ in 0..64 {
                        if !self.poll_once(0, &mut buf, stream, held) {
                            break;
                        }
                    }
                    return Pumped::Exited(s);
                }
            } else if !open && self.stdin.is_none() {
                // Pipes closed: the exit status is on its way (a process closes them as it
                // exits, a moment before it can be reaped). Looked for while the channel is
                // watched, less and less often, until a request comes; then waited for.
                let mut nap_ms = 1;
                while let Some(fd) = held.and_then(|h| h.watched()) {
                    if let Some(s) = exit.exited() {
                        return Pumped::Exited(s);
                    }
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Pumped::TimedOut;
                    }
                    if let (true, Some(h)) = (readable(fd, nap_ms), held) {
                        h.release();
                    }
                    nap_ms = (nap_ms * 2).min(20);
                }
                return exit.wait(deadline).map_or(Pumped::TimedOut, Pumped::Exited);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Pumped::TimedOut;
            }
            // Short slices: the exit is not on an fd.
            let slice_ms = if status.is_some() { 10 } else { 20 };
            let ready = self.poll_once(slice_ms, &mut buf, stream, held);
            if status.is_none() && (!ready || Instant::now() >= next_look) {
                status = exit.exited();
                if status.is_some() {
                    exited_at = Some(Instant::now());
                }
                next_look = Instant::now() + EXIT_LOOK;
            }
        }
    }

    /// Waits up to `timeout_ms` for a pipe to be ready, then feeds stdin and reads each output
    /// pipe that is (once: a pipe said ready does not block one read). A pipe at its end, or
    /// broken, is closed. Whether any was ready. The held channel, if any, is watched too and
    /// given back when the next request is on it.
    fn poll_once(
        &mut self,
        timeout_ms: i32,
        buf: &mut [u8],
        stream: Option<&OutputSink<'_>>,
        held: Option<&dyn HeldInput>,
    ) -> bool {
        let pollfd = |p: &Option<File>, events| libc::pollfd {
            // A negative fd is skipped by poll.
            fd: p.as_ref().map_or(-1, |p| p.as_raw_fd()),
            events,
            revents: 0,
        };
        let channel = held.and_then(|h| h.watched());
        let mut fds = [
            pollfd(&self.stdin, libc::POLLOUT),
            pollfd(&self.stdout, libc::POLLIN),
            pollfd(&self.stderr, libc::POLLIN),
            libc::pollfd {
                fd: channel.unwrap_or(-1),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        if fds[..3].iter().all(|f| f.fd < 0) {
            if timeout_ms > 0 {
                std::thread::sleep(Duration::from_millis(timeout_ms as u64));
            }
            return false;
        }
        // SAFETY: fds is a valid, initialised array of pollfd of the given length.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
        if ready <= 0 {
            return false;
        }
        if fds[3].revents != 0 {
            if let Some(h) = held {
                h.release();
            }
        }
        if fds[0].revents != 0 {
            self.feed_stdin();
        }
        for (i, fd) in [(1, 1u8), (2, 2u8)] {
            if fds[i].revents == 0 {
                continue;
            }
            let (pipe, into) = if fd == 1 {
                (&mut self.stdout, &mut self.out)
            } else {
                (&mut self.stderr, &mut self.err)
            };
            if let Some(p) = pipe {
                if read_once(p, buf, into, stream.map(|s| (s, fd))) {
                    *pipe = None;
                }
            }
        }
        fds[..3].iter().any(|f| f.revents != 0)
    }

    /// Makes the stdin pipe, if any, non-blocking (see [`ChildIo::pump`]).
    fn stdin_nonblocking(&self) {
        if let Some(p) = &self.stdin {
            set_nonblocking(p.as_raw_fd());
        }
    }

    fn feed_stdin(&mut self) {
        let Some(p) = &mut self.stdin else { return };
        while self.stdin_pos < self.stdin_data.len() {
            match p.write(&self.stdin_data[self.stdin_pos..]) {
                Ok(0) => break,
                Ok(n) => self.stdin_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => break,
            }
        }
        // All written (or the reader went away): close, so the child sees EOF.
        self.stdin = None;
    }
}

/// Output of a command that is not streamed, kept per stream; beyond it the rest is read and
/// dropped (so the command does not block) and a note says so. Streamed output has no cap: it
/// is sent as it comes, at the pace the caller reads it.
pub const MAX_EXEC_OUTPUT: usize = 8 << 20;
const TRUNCATED_NOTE: &[u8] = b"\n[torpor: output truncated at 8 MiB; exec with stream for more]\n";

fn keep_capped(into: &mut Vec<u8>, chunk: &[u8]) {
    let room = MAX_EXEC_OUTPUT.saturating_sub(into.len());
    if room == 0 {
        return;
    }
    into.extend_from_slice(&chunk[..chunk.len().min(room)]);
    if chunk.len() >= room {
        into.extend_from_slice(TRUNCATED_NOTE);
    }
}

/// One read of a pipe a poll said ready; true when it is at its end (or broke).
fn read_once(
    p: &mut impl Read,
    buf: &mut [u8],
    into: &mut Vec<u8>,
    stream: Option<(&OutputSink<'_>, u8)>,
) -> bool {
    match p.read(buf) {
        Ok(0) => true,
        Ok(n) => {
            match stream {
                Some((send, fd)) => send(fd, &buf[..n]),
                None => keep_capped(into, &buf[..n]),
            }
            false
        }
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ) =>
        {
            false
        }
        Err(_) => true,
    }
}

/// Whether `fd` has something to read (or is at its end) within `timeout_ms`.
fn readable(fd: i32, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, timeout_ms) > 0 }
}

/// Makes a pipe end this agent made non-blocking. One system call: a new pipe's end has no
/// status flag but its access mode, which `F_SETFL` leaves as it is.
fn set_nonblocking(fd: i32) {
    // SAFETY: fcntl on an fd this process owns; no memory is passed.
    unsafe { libc::fcntl(fd, libc::F_SETFL, libc::O_NONBLOCK) };
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct WaitStatus {
    code: Option<i32>,
    signal: Option<i32>,
}

impl WaitStatus {
    fn from_raw(status: i32) -> Self {
        if libc::WIFEXITED(status) {
            WaitStatus {
                code: Some(libc::WEXITSTATUS(status)),
                signal: None,
            }
        } else if libc::WIFSIGNALED(status) {
            let sig = libc::WTERMSIG(status);
            WaitStatus {
                code: Some(128 + sig),
                signal: Some(sig),
            }
        } else {
            WaitStatus {
                code: None,
                signal: None,
            }
        }
    }
}

/// How [`ChildIo::pump`] learns that the process exited ([`OwnedChild`]; a test's stand-in).
trait ExitWatch {
    /// Its status once it has exited; never waits.
    fn exited(&mut self) -> Option<WaitStatus>;
    /// Waits for its exit until `deadline` (for ever without one); `None` if the deadline came
    /// first.
    fn wait(&mut self, deadline: Option<Instant>) -> Option<WaitStatus>;
}

/// A child reaped by the thread that started it ([`ChildTable::spawn_owned`]). Dropped before
/// its exit was seen, it is given back to the reaper.
struct OwnedChild {
    pid: u32,
    table: Arc<ChildTable>,
    status: Option<WaitStatus>,
}

impl OwnedChild {
    fn reap(&mut self, flags: i32) -> Option<WaitStatus> {
        if self.status.is_some() {
            return self.status;
        }
        let mut raw = 0;
        let got = loop {
            // SAFETY: waitpid on our own child with a valid pointer to an i32.
            let got = unsafe { libc::waitpid(self.pid as i32, &mut raw, flags) };
            if got >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                break got;
            }
        };
        if got == 0 {
            return None;
        }
        // Reaped (or, impossibly, not ours any more: then its status is unknown).
        self.status = Some(if got > 0 {
            WaitStatus::from_raw(raw)
        } else {
            WaitStatus {
                code: None,
                signal: None,
            }
        });
        self.table.release(self.pid);
        self.status
    }
}

impl ExitWatch for OwnedChild {
    fn exited(&mut self) -> Option<WaitStatus> {
        self.reap(libc::WNOHANG)
    }

    fn wait(&mut self, deadline: Option<Instant>) -> Option<WaitStatus> {
        let Some(deadline) = deadline else {
            return self.reap(0);
        };
        // Called once its pipes have closed, which it does as it exits: the first look almost
        // always finds it gone. One that closed them and lives on is looked at again, less and
        // less often, until the deadline.
        let mut nap = Duration::from_micros(100);
        loop {
            if let Some(s) = self.exited() {
                return Some(s);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            std::thread::sleep(nap.min(left));
            nap = (nap * 2).min(Duration::from_millis(5));
        }
    }
}

impl Drop for OwnedChild {
    fn drop(&mut self) {
        if self.status.is_none() {
            self.table.release(self.pid);
        }
    }
}

/// Every child of PID 1 is reaped here, so exit statuses go to whoever waits for them and
/// orphans never pile up as zombies. Spawning happens under the table's lock, so a child that
/// exits at once is registered before the reaper can report it.
#[derive(Default)]
struct ChildTable {
    inner: Mutex<Children>,
    spawned: Condvar,
}

/// Who is told of a child's exit: a receiver, or a callback the reaper runs.
enum Waiter {
    Send(Sender<WaitStatus>),
    Then(Box<dyn FnOnce(WaitStatus) + Send>),
}

#[derive(Default)]
struct Children {
    waiters: HashMap<i32, Waiter>,
    /// Exit statuses kept for children someone may ask about later (the main process).
    kept: HashMap<i32, WaitStatus>,
    watched: std::collections::HashSet<i32>,
    live: usize,
    /// Children started so far (the reaper sleeps only if none started since it last found
    /// it had none).
    spawns: u64,
    /// The reaper sleeps on `spawned`: a spawn wakes it. (Only then: a wake is a system call.)
    reaper_idle: bool,
    /// Children the thread that started them reaps ([`OwnedChild`]): the reaper leaves them.
    owned: std::collections::HashSet<i32>,
    /// The owned child whose exit the reaper saw and waits for its owner to reap.
    reaper_waits_for: Option<i32>,
}

impl ChildTable {
    /// Spawns `command`; with `wait`, returns a receiver for its exit status.
    fn spawn(
        &self,
        command: &mut Command,
        wait: bool,
    ) -> io::Result<(std::process::Child, Option<Receiver<WaitStatus>>)> {
        self.spawn_with(wait, || command.spawn(), std::process::Child::id)
    }

    /// Starts a process with `start` (`pid` names it); with `wait`, returns a receiver for its
    /// exit status.
    fn spawn_with<T>(
        &self,
        wait: bool,
        start: impl FnOnce() -> io::Result<T>,
        pid: impl Fn(&T) -> u32,
    ) -> io::Result<(T, Option<Receiver<WaitStatus>>)> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let child = start()?;
        let pid = pid(&child) as i32;
        inner.live += 1;
        inner.spawns += 1;
        let rx = if wait {
            let (tx, rx) = mpsc::channel();
            inner.waiters.insert(pid, Waiter::Send(tx));
            inner.watched.insert(pid);
            Some(rx)
        } else {
            None
        };
        if inner.reaper_idle {
            self.spawned.notify_all();
        }
        Ok((child, rx))
    }

    /// Starts a process with `start` that the calling thread reaps itself ([`OwnedChild`]):
    /// no hand-off from the reaper's thread to learn its exit, and no wake of a sleeping reaper
    /// to start it (each a round trip through gVisor's kernel, a thread wake-up ~0.2 ms).
    fn spawn_owned(
        self: &Arc<Self>,
        start: impl FnOnce() -> io::Result<u32>,
    ) -> io::Result<OwnedChild> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let pid = start()?;
        inner.spawns += 1;
        inner.owned.insert(pid as i32);
        Ok(OwnedChild {
            pid,
            table: self.clone(),
            status: None,
        })
    }

    /// `pid`, owned by its starter, is reaped or given to the reaper: the reaper may take it
    /// (or look past it) from now on.
    fn release(&self, pid: u32) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.owned.remove(&(pid as i32));
        if inner.reaper_waits_for == Some(pid as i32) {
            self.spawned.notify_all();
        }
    }

    /// Runs `then` with the exit status of `pid` (spawned with a receiver, `rx`) when the
    /// reaper reaps it, on the reaper's thread (at once when it already has): no thread waits.
    fn on_exit(
        &self,
        pid: u32,
        rx: Receiver<WaitStatus>,
        then: impl FnOnce(WaitStatus) + Send + 'static,
    ) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        // Under the lock the reaper either has sent the status already or will find `then`.
        if let Ok(status) = rx.try_recv() {
            drop(inner);
            then(status);
            return;
        }
        inner
            .waiters
            .insert(pid as i32, Waiter::Then(Box::new(then)));
    }

    fn exited(&self, pid: u32) -> Option<WaitStatus> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.kept.get(&(pid as i32)).copied()
    }

    fn reap_forever(&self) {
        loop {
            let spawns = self.inner.lock().unwrap_or_else(|p| p.into_inner()).spawns;
            // Which child has exited, without reaping it: one its starter reaps is left to it.
            // SAFETY: siginfo_t is plain data that waitid fills.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: waitid with a valid pointer to a siginfo_t.
            let rc =
                unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOWAIT) };
            if rc < 0 {
                if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                // No children at all: sleep until one is spawned (or an orphan may have come).
                let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
                if inner.spawns != spawns {
                    // One started since the wait found none: wait for it.
                    continue;
                }
                inner.reaper_idle = true;
                let (mut inner, _) = self
                    .spawned
                    .wait_timeout(inner, Duration::from_millis(500))
                    .unwrap_or_else(|p| p.into_inner());
                inner.reaper_idle = false;
                continue;
            }
            // SAFETY: waitid filled `info` for an exited child.
            let pid = unsafe { info.si_pid() };
            {
                let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
                if inner.owned.contains(&pid) {
                    // Its starter reaps it (at once: it waits for this exit); look again after.
                    inner.reaper_waits_for = Some(pid);
                    while inner.owned.contains(&pid) {
                        inner = self.spawned.wait(inner).unwrap_or_else(|p| p.into_inner());
                    }
                    inner.reaper_waits_for = None;
                    continue;
                }
            }
            let mut raw = 0;
            // SAFETY: waitpid on the child waitid named, with a valid pointer to an i32.
            if unsafe { libc::waitpid(pid, &mut raw, libc::WNOHANG) } != pid {
                continue;
            }
            let status = WaitStatus::from_raw(raw);
            let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            inner.live = inner.live.saturating_sub(1);
            let then = match inner.waiters.remove(&pid) {
                Some(Waiter::Send(tx)) => {
                    let _ = tx.send(status);
                    None
                }
                Some(Waiter::Then(f)) => Some(f),
                None => None,
            };
            if inner.watched.remove(&pid) {
                inner.kept.insert(pid, status);
                // Keep the table bounded: only recent statuses matter.
                if inner.kept.len() > 1024 {
                    let oldest: Vec<i32> = inner.kept.keys().copied().take(512).collect();
                    for k in oldest {
                        inner.kept.remove(&k);
                    }
                }
            }
            drop(inner);
            if let Some(f) = then {
                f(status);
            }
        }
    }
}

/// Threads that read and run requests, leader/follower style: the thread that holds `input`
/// reads the next frame, lets go of `input` (the next idle thread takes it and waits for the
/// frame after) and runs the request itself. So a request goes from the channel to its handler
/// without a hand-off between threads (under gVisor's ptrace platform, a wake of another thread
/// costs ~0.2 ms at p50 and milliseconds at p95 on a loaded machine). A new thread starts when
/// the last idle one takes a request, so a long exec never blocks a short one.
///
/// An `Exec` (and a followed `Spawn`) keeps `input` while its command runs, watching it in the
/// poll that watches the command's pipes (the process's directory), and lets go the moment a
/// request is on it (or before a wait that cannot watch it: a timed-out command's kill). A
/// command that ends before the next request comes, which is most, costs no hand-off at all
/// (the futex wake of the next reader and that reader's own read, two system calls, one on the
/// exec's path), and the thread reads the next request itself.
struct Pool {
    input: Mutex<BufReader<File>>,
    /// Threads waiting for `input` or reading from it.
    readers: AtomicUsize,
    /// [`BENCH_EAGER_HANDOFF`]: every request lets go of `input` at once.
    eager_handoff: bool,
    agent: Arc<Agent>,
}

impl Pool {
    /// Reads and runs requests until stdin closes (`Ok`) or the channel breaks.
    fn serve(self: &Arc<Self>) -> io::Result<()> {
        loop {
            let held = Held {
                input: std::cell::RefCell::new(Some(
                    self.input.lock().unwrap_or_else(|p| p.into_inner()),
                )),
                pool: self,
            };
            loop {
                let frame = {
                    let mut input = held.input.borrow_mut();
                    let Some(input) = input.as_mut() else { break };
                    // Nothing of a next request read ahead: the poll would not see it.
                    proto::read_frame::<Request>(&mut **input)
                        .map(|frame| (frame, input.buffer().is_empty()))
                };
                match frame {
                    Ok(((h, body), nothing_ahead)) => {
                        let keep = nothing_ahead && keeps_channel(&h.msg);
                        if !keep || self.eager_handoff {
                            held.release();
                        }
                        let still = held.watched().is_some();
                        self.agent.handle(
                            h.id,
                            h.msg,
                            body,
                            still.then_some(&held as &dyn HeldInput),
                        );
                    }
                    Err(FrameError::Closed) => return Ok(()),
                    Err(FrameError::Json(e)) => {
                        // The frame was read whole, so the stream is still in step: say so and
                        // go on.
                        let m = format!("malformed request: {e}");
                        self.agent.reply(0, &bad_request(m), &[]);
                    }
                    Err(e) => {
                        eprintln!("torpor-agent: channel broken: {e}");
                        return Err(io::Error::other(e.to_string()));
                    }
                }
            }
            // It let go of the input: in line for it again.
            self.readers.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn spawn_thread(self: &Arc<Self>) {
        self.readers.fetch_add(1, Ordering::SeqCst);
        let pool = self.clone();
        let spawned = std::thread::Builder::new()
            .name("request".into())
            // The agent ends when its channel does, whichever thread sees it (as `run` would).
            .spawn(move || match pool.serve() {
                Ok(()) => std::process::exit(0),
                Err(e) => {
                    eprintln!("torpor-agent: {e}");
                    std::process::exit(1)
                }
            });
        if let Err(e) = spawned {
            self.readers.fetch_sub(1, Ordering::SeqCst);
            eprintln!("torpor-agent: cannot start a request thread: {e}");
        }
    }
}

/// Whether the thread that read `req` keeps the channel while it runs it ([`Pool`]): an `Exec`,
/// and a followed `Spawn` (whose first wait rides on it): requests that wait for a process
/// and can watch the channel while they do.
fn keeps_channel(req: &Request) -> bool {
    match req {
        Request::Exec(_) => true,
        Request::Spawn(s) => s.follow_ms > 0,
        _ => false,
    }
}

/// The channel's input while the thread running a request holds it ([`Pool`]).
trait HeldInput {
    /// Its descriptor, while held.
    fn watched(&self) -> Option<i32>;
    /// Lets go of it (once; later calls do nothing): the next idle thread, or a new one when
    /// none is idle, reads the next request.
    fn release(&self);
}

/// [`HeldInput`] of a [`Pool`]'s thread.
struct Held<'a> {
    input: std::cell::RefCell<Option<std::sync::MutexGuard<'a, BufReader<File>>>>,
    pool: &'a Arc<Pool>,
}

impl HeldInput for Held<'_> {
    fn watched(&self) -> Option<i32> {
        self.input
            .borrow()
            .as_ref()
            .map(|i| i.get_ref().as_raw_fd())
    }

    fn release(&self) {
        let given_back = self.input.borrow_mut().take().is_some();
        if given_back && self.pool.readers.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.pool.spawn_thread();
        }
    }
}

/// Resolves a path given by a client to an absolute path inside the sandbox. Relative paths are
/// taken from `/`; `..` is refused rather than interpreted, so a path means what it says.
fn resolve(path: &str) -> Result<PathBuf, Reply> {
    let invalid = |why: &str| Reply::Error {
        code: AgentErrorCode::InvalidPath,
        message: format!("invalid path {path:?}: {why}"),
    };
    if path.is_empty() {
        return Err(invalid("empty"));
    }
    if path.contains('\0') {
        return Err(invalid("holds a NUL byte"));
    }
    let p = Path::new(path);
    if p.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(invalid("'..' is not allowed"));
    }
    Ok(Path::new("/").join(p))
}

fn io_error(path: &Path, e: io::Error) -> Reply {
    let code = match e.kind() {
        io::ErrorKind::NotFound => AgentErrorCode::NotFound,
        io::ErrorKind::PermissionDenied => AgentErrorCode::PermissionDenied,
        io::ErrorKind::IsADirectory => AgentErrorCode::IsADirectory,
        io::ErrorKind::NotADirectory => AgentErrorCode::NotADirectory,
        _ => AgentErrorCode::Io,
    };
    Reply::Error {
        code,
        message: format!("{}: {e}", path.display()),
    }
}

type Answer = Result<(Reply, Vec<u8>), Reply>;

fn read_file(path: &str, max_bytes: u64) -> Answer {
    let p = resolve(path)?;
    let f = File::open(&p).map_err(|e| io_error(&p, e))?;
    let meta = f.metadata().map_err(|e| io_error(&p, e))?;
    if meta.is_dir() {
        return Err(io_error(&p, io::Error::from(io::ErrorKind::IsADirectory)));
    }
    let cap = max_bytes.min(proto::MAX_BODY as u64);
    if meta.len() > cap {
        return Err(Reply::Error {
            code: AgentErrorCode::TooLarge,
            message: format!(
                "{} is {} bytes, over the {cap}-byte limit",
                p.display(),
                meta.len()
            ),
        });
    }
    let mut data = Vec::with_capacity(meta.len() as usize);
    f.take(cap + 1)
        .read_to_end(&mut data)
        .map_err(|e| io_error(&p, e))?;
    let truncated = data.len() as u64 > cap;
    data.truncate(cap as usize);
    Ok((Reply::Data { truncated }, data))
}

/// Up to `max_bytes` (at most one frame) of a file from `offset`: what a follower of a growing
/// file asks for, so that no side reads the whole file on every change.
fn read_range(path: &str, offset: u64, max_bytes: u64) -> Answer {
    use std::io::{Seek, SeekFrom};
    let p = resolve(path)?;
    let mut f = File::open(&p).map_err(|e| io_error(&p, e))?;
    let meta = f.metadata().map_err(|e| io_error(&p, e))?;
    if meta.is_dir() {
        return Err(io_error(&p, io::Error::from(io::ErrorKind::IsADirectory)));
    }
    let cap = max_bytes.min(proto::MAX_BODY as u64);
    f.seek(SeekFrom::Start(offset))
        .map_err(|e| io_error(&p, e))?;
    let mut data = Vec::with_capacity(cap.min(meta.len().saturating_sub(offset)) as usize);
    f.take(cap + 1)
        .read_to_end(&mut data)
        .map_err(|e| io_error(&p, e))?;
    let truncated = data.len() as u64 > cap;
    data.truncate(cap as usize);
    Ok((Reply::Data { truncated }, data))
}

fn write_file(path: &str, mode: Option<u32>, data: &[u8], owner: Option<proto::RunAs>) -> Answer {
    let p = resolve(path)?;
    if let Some(parent) = p.parent() {
        // The directories this write makes: from the highest missing one down to the parent.
        let made: Vec<&Path> = parent.ancestors().take_while(|a| !a.exists()).collect();
        fs::create_dir_all(parent).map_err(|e| io_error(parent, e))?;
        if let Some(o) = owner {
            for d in made {
                std::os::unix::fs::chown(d, Some(o.uid), Some(o.gid))
                    .map_err(|e| io_error(d, e))?;
            }
        }
    }
    if p.is_dir() {
        return Err(io_error(&p, io::Error::from(io::ErrorKind::IsADirectory)));
    }
    // Write beside it and rename, so a reader never sees half a file.
    let tmp = p.with_file_name(format!(
        ".{}.torpor-tmp",
        p.file_name().and_then(|n| n.to_str()).unwrap_or("file")
    ));
    let result = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode.unwrap_or(0o644))
            .open(&tmp)?;
        if let Some(o) = owner {
            std::os::unix::fs::fchown(&f, Some(o.uid), Some(o.gid))?;
        }
        f.write_all(data)?;
        if let Some(m) = mode {
            f.set_permissions(fs::Permissions::from_mode(m))?;
        }
        fs::rename(&tmp, &p)
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(io_error(&p, e));
    }
    Ok((Reply::Ok, Vec::new()))
}

fn list(path: &str) -> Answer {
    let p = resolve(path)?;
    let mut entries = Vec::new();
    for entry in fs::read_dir(&p).map_err(|e| io_error(&p, e))? {
        let entry = entry.map_err(|e| io_error(&p, e))?;
        let Ok(meta) = entry.metadata() else { continue };
        entries.push(dir_entry(
            entry.file_name().to_string_lossy().into_owned(),
            &meta,
        ));
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((Reply::Entries { entries }, Vec::new()))
}

/// An entry as `List` describes it, from its `lstat`.
fn dir_entry(name: String, meta: &fs::Metadata) -> DirEntry {
    let ft = meta.file_type();
    DirEntry {
        name,
        kind: if ft.is_dir() {
            FileKind::Dir
        } else if ft.is_file() {
            FileKind::File
        } else if ft.is_symlink() {
            FileKind::Symlink
        } else {
            FileKind::Other
        },
        size: meta.len(),
        mode: meta.permissions().mode() & 0o7777,
        modified_ms: meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() as i64),
        uid: meta.uid(),
        gid: meta.gid(),
    }
}

/// [`Request::ListChanged`]: re-lists `path` (sleeping 0.5 ms, backing off to 5 ms) until
/// its (name, size) set differs from `known` or the wait is over.
fn list_changed(path: &str, known: &BTreeMap<String, u64>, timeout_ms: u64) -> Answer {
    let deadline = Instant::now() + Duration::from_millis(timeout_ms.min(proto::MAX_WAIT_MS));
    let mut pause = Duration::from_micros(500);
    loop {
        let over = Instant::now() >= deadline;
        let exits = procs::exit_count();
        match list(path) {
            Ok((Reply::Entries { entries }, body)) => {
                let same = entries.len() == known.len()
                    && entries.iter().all(|e| known.get(&e.name) == Some(&e.size));
                if !same || over {
                    return Ok((Reply::Entries { entries }, body));
                }
            }
            Err(Reply::Error {
                code: AgentErrorCode::NotFound,
                ..
            }) if !over => {}
            other => return other,
        }
        procs::wait_for_exit(exits, pause);
        pause = (pause * 2).min(Duration::from_millis(5));
    }
}

fn remove(path: &str, recursive: bool) -> Answer {
    let p = resolve(path)?;
    if p == Path::new("/") {
        return Err(Reply::Error {
            code: AgentErrorCode::InvalidPath,
            message: "refusing to remove /".into(),
        });
    }
    let meta = fs::symlink_metadata(&p).map_err(|e| io_error(&p, e))?;
    let result = if meta.is_dir() {
        if recursive {
            fs::remove_dir_all(&p)
        } else {
            fs::remove_dir(&p)
        }
    } else {
        fs::remove_file(&p)
    };
    result.map_err(|e| io_error(&p, e))?;
    Ok((Reply::Ok, Vec::new()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_refuses_parent_components() {
        assert!(resolve("/a/../b").is_err());
        assert!(resolve("..").is_err());
        assert!(resolve("").is_err());
        assert_eq!(resolve("a/b").unwrap(), PathBuf::from("/a/b"));
        assert_eq!(resolve("/tmp/x").unwrap(), PathBuf::from("/tmp/x"));
    }

    #[test]
    fn list_changed_waits_for_a_change_or_the_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("d");
        let sub_s = sub.to_str().unwrap().to_string();
        // Nothing changes: answers after the timeout with the same listing.
        fs::create_dir(&sub).unwrap();
        fs::write(sub.join("a"), b"12").unwrap();
        let known: BTreeMap<String, u64> = [("a".to_string(), 2)].into();
        let t = Instant::now();
        let (reply, _) = list_changed(&sub_s, &known, 100).unwrap();
        assert!(t.elapsed() >= Duration::from_millis(100));
        assert!(matches!(reply, Reply::Entries { entries } if entries.len() == 1));
        // A file grows while it waits: answers at once with the new size.
        let writer = {
            let sub = sub.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                fs::write(sub.join("a"), b"12345").unwrap();
            })
        };
        let t = Instant::now();
        let (reply, _) = list_changed(&sub_s, &known, 4_000).unwrap();
        writer.join().unwrap();
        assert!(t.elapsed() < Duration::from_millis(2_000));
        let Reply::Entries { entries } = reply else {
            panic!()
        };
        assert_eq!(entries[0].size, 5);
        // A directory that does not exist yet is waited for; then it is a change.
        let later = dir.path().join("later");
        let later_s = later.to_str().unwrap().to_string();
        let maker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            fs::create_dir(&later).unwrap();
            fs::write(later.join("x"), b"").unwrap();
        });
        let (reply, _) = list_changed(&later_s, &BTreeMap::new(), 4_000).unwrap();
        maker.join().unwrap();
        assert!(matches!(reply, Reply::Entries { .. }));
        // Still missing at the deadline: not found.
        assert!(matches!(
            list_changed("/nonexistent/torpor-test", &BTreeMap::new(), 20),
            Err(Reply::Error {
                code: AgentErrorCode::NotFound,
                ..
            })
        ));
    }

    #[test]
    fn written_files_and_the_directories_made_for_them_get_the_file_owner() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: getuid/getgid have no preconditions.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        // As root (how the agent runs) another user; otherwise our own (chown to self works).
        let owner = if uid == 0 {
            proto::RunAs {
                uid: 4321,
                gid: 4322,
            }
        } else {
            proto::RunAs { uid, gid }
        };
        let path = dir.path().join("a/b/f.txt");
        write_file(path.to_str().unwrap(), None, b"x", Some(owner)).unwrap();
        for p in [dir.path().join("a"), dir.path().join("a/b"), path.clone()] {
            let m = fs::metadata(&p).unwrap();
            assert_eq!(
                (m.uid(), m.gid()),
                (owner.uid, owner.gid),
                "{}",
                p.display()
            );
        }
        let m = fs::metadata(dir.path()).unwrap();
        assert_eq!(m.uid(), uid, "an existing directory keeps its owner");
        assert_eq!(
            parse_owner("1000:1000"),
            Some(proto::RunAs {
                uid: 1000,
                gid: 1000
            })
        );
        assert_eq!(parse_owner("user"), None);
    }

    #[test]
    fn files_round_trip_in_a_temp_dir() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/f.txt");
        let path = path.to_str().unwrap();
        write_file(path, Some(0o600), b"hello", None).unwrap();
        let (reply, data) = read_file(path, 1024).unwrap();
        assert_eq!(reply, Reply::Data { truncated: false });
        assert_eq!(data, b"hello");
        assert!(matches!(
            read_file(path, 2),
            Err(Reply::Error {
                code: AgentErrorCode::TooLarge,
                ..
            })
        ));
        let (reply, _) = list(dir.path().join("sub").to_str().unwrap()).unwrap();
        let Reply::Entries { entries } = reply else {
            panic!("{reply:?}")
        };
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].mode, 0o600);
        remove(path, false).unwrap();
        assert!(matches!(
            read_file(path, 10),
            Err(Reply::Error {
                code: AgentErrorCode::NotFound,
                ..
            })
        ));
    }
}

#[cfg(test)]
mod output_cap_tests {
    use super::*;

    #[test]
    fn output_beyond_the_cap_is_dropped_with_a_note() {
        let mut out = Vec::new();
        let chunk = vec![b'y'; 1 << 20];
        for _ in 0..20 {
            keep_capped(&mut out, &chunk);
        }
        assert_eq!(out.len(), MAX_EXEC_OUTPUT + TRUNCATED_NOTE.len());
        assert!(out.ends_with(TRUNCATED_NOTE));
        let mut small = Vec::new();
        keep_capped(&mut small, b"hello");
        assert_eq!(small, b"hello");
    }

    /// The channel's input as a test holds it: a pipe, and whether it was given back.
    struct PipeHeld {
        read: File,
        released: std::cell::Cell<bool>,
    }

    impl HeldInput for PipeHeld {
        fn watched(&self) -> Option<i32> {
            (!self.released.get()).then(|| self.read.as_raw_fd())
        }

        fn release(&self) {
            self.released.set(true);
        }
    }

    /// Runs `script` as an `Exec` does, its thread holding `held`; what it wrote to stdout.
    fn exec_holding(script: &str, held: &PipeHeld) -> (Option<i32>, Vec<u8>) {
        let table = Arc::new(ChildTable::default());
        let cmd = ["/bin/sh".to_string(), "-c".into(), script.into()];
        let none = BTreeMap::new();
        let prepared = spawn::Prepared::new(&cmd, none.iter(), &none, None, None, true).unwrap();
        let (mut child, mut io) = start_exec(Vec::new(), |stdio| {
            table.spawn_owned(|| prepared.spawn(stdio))
        })
        .unwrap();
        let deadline = Some(Instant::now() + Duration::from_secs(60));
        let outcome = io.pump(&mut child, deadline, DRAIN_AFTER_EXIT, None, Some(held));
        let Pumped::Exited(status) = outcome else {
            panic!("{script}: timed out")
        };
        (status.code, io.out)
    }

    #[test]
    fn an_exec_keeps_the_channel_until_a_request_is_on_it_or_it_must_wait_elsewhere() {
        let held = || {
            let (read, write) = procs::pipe().unwrap();
            let h = PipeHeld {
                read,
                released: std::cell::Cell::new(false),
            };
            (h, write)
        };
        // Nothing comes while the command runs: its thread keeps the channel.
        let (h, _w) = held();
        assert_eq!(
            exec_holding("echo hi; exit 3", &h),
            (Some(3), b"hi\n".to_vec())
        );
        assert!(!h.released.get());
        // A request is on the channel: given back at once, the command followed to its end.
        let (h, mut w) = held();
        w.write_all(b"x").unwrap();
        assert_eq!(
            exec_holding("sleep 0.2; echo done", &h),
            (Some(0), b"done\n".to_vec())
        );
        assert!(h.released.get());
        // A command that closed its pipes and lives on: its exit looked for with the channel
        // still watched, and kept when nothing comes...
        let (h, _w) = held();
        assert_eq!(
            exec_holding("exec >&- 2>&-; sleep 0.2; exit 5", &h),
            (Some(5), Vec::new())
        );
        assert!(!h.released.get());
        // ...and given back when a request comes meanwhile (once its pipes are closed).
        let tmp = tempfile::tempdir().unwrap();
        let closed = tmp.path().join("closed");
        let (h, mut w) = held();
        let mark = closed.clone();
        let writer = std::thread::spawn(move || {
            while !mark.exists() {
                std::thread::sleep(Duration::from_millis(5));
            }
            w.write_all(b"x").unwrap();
            w
        });
        let script = format!("exec >&- 2>&-; touch {}; sleep 1; exit 6", closed.display());
        assert_eq!(exec_holding(&script, &h), (Some(6), Vec::new()));
        assert!(h.released.get());
        drop(writer.join().unwrap());
    }

    /// An exit already known (the tests' stand-in for a child's).
    impl ExitWatch for Receiver<WaitStatus> {
        fn exited(&mut self) -> Option<WaitStatus> {
            self.try_recv().ok()
        }

        fn wait(&mut self, _deadline: Option<Instant>) -> Option<WaitStatus> {
            self.recv().ok()
        }
    }

    #[test]
    fn output_written_before_the_exit_is_kept_however_short_the_window_after_it() {
        use std::os::fd::OwnedFd;
        use std::os::unix::process::ExitStatusExt;
        // The exit is already known when the pump starts and the window after it is over at
        // once (as when the clock steps past it): what the process wrote is still read.
        let mut child = Command::new("sh")
            .args(["-c", "echo out; echo err >&2"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut io = ChildIo {
            stdin: None,
            stdin_data: Vec::new(),
            stdin_pos: 0,
            stdout: child.stdout.take().map(|p| File::from(OwnedFd::from(p))),
            stderr: child.stderr.take().map(|p| File::from(OwnedFd::from(p))),
            out: Vec::new(),
            err: Vec::new(),
        };
        let status = child.wait().unwrap();
        let (tx, mut rx) = mpsc::channel();
        tx.send(WaitStatus::from_raw(status.into_raw())).unwrap();
        let outcome = io.pump(&mut rx, None, Duration::ZERO, None, None);
        assert!(matches!(outcome, Pumped::Exited(s) if s.code == Some(0)));
        assert_eq!(io.out, b"out\n");
        assert_eq!(io.err, b"err\n");
    }

    #[test]
    fn a_ranged_read_returns_the_window_and_says_whether_more_follows() {
        let tmp = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(tmp.path(), b"0123456789").unwrap();
        let p = tmp.path().to_str().unwrap();
        assert_eq!(
            read_range(p, 2, 3).unwrap(),
            (Reply::Data { truncated: true }, b"234".to_vec())
        );
        assert_eq!(
            read_range(p, 7, 3).unwrap(),
            (Reply::Data { truncated: false }, b"789".to_vec())
        );
        assert_eq!(
            read_range(p, 20, 3).unwrap(),
            (Reply::Data { truncated: false }, Vec::new())
        );
    }
}

#[cfg(test)]
mod reaper_tests {
    use super::*;

    /// Set in the copy of the test binary that runs the body (see below).
    const ISOLATED: &str = "TORPOR_TEST_REAPER_ISOLATED";

    /// The reaper waits for any child of its process: it must run where no other test's
    /// children are. The test runs itself again as a process of its own with only this test.
    fn isolated(name: &str, body: impl FnOnce()) {
        if std::env::var_os(ISOLATED).is_some() {
            body();
            return;
        }
        let out = Command::new(std::env::current_exe().unwrap())
            .args([name, "--exact", "--nocapture", "--test-threads=1"])
            .env(ISOLATED, "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && text.contains("1 passed"),
            "isolated run failed:\n{text}"
        );
    }

    fn sh(script: &str) -> spawn::Prepared {
        let cmd = ["/bin/sh".to_string(), "-c".into(), script.into()];
        let none = BTreeMap::new();
        spawn::Prepared::new(&cmd, none.iter(), &none, None, None, true).unwrap()
    }

    #[test]
    fn an_owned_child_is_reaped_by_its_starter_and_the_reaper_takes_every_other() {
        isolated(
            "agent::reaper_tests::an_owned_child_is_reaped_by_its_starter_and_the_reaper_takes_every_other",
            || {
                let table = Arc::new(ChildTable::default());
                let reaper = table.clone();
                std::thread::spawn(move || reaper.reap_forever());
                let (_null, stdio) = spawn::null_stdio();
                for round in 0..20 {
                    // A child the reaper reaps, running while the owned one exits (the reaper
                    // is then in its wait and sees the owned child's exit first).
                    let slow = sh("sleep 0.05; exit 4");
                    let (_, rx) = table
                        .spawn_with(true, || slow.spawn(stdio), |pid| *pid)
                        .unwrap();
                    let code = 10 + round;
                    let fast = sh(&format!("exit {code}"));
                    let mut owned = table.spawn_owned(|| fast.spawn(stdio)).unwrap();
                    let status = owned.wait(Some(Instant::now() + Duration::from_secs(10)));
                    assert_eq!(status.and_then(|s| s.code), Some(code), "round {round}");
                    let other = rx.unwrap().recv_timeout(Duration::from_secs(10));
                    assert_eq!(other.ok().and_then(|s| s.code), Some(4), "round {round}");
                }
                // An owned child given back without being waited for: the reaper takes it.
                let left = sh("exit 0");
                let owned = table.spawn_owned(|| left.spawn(stdio)).unwrap();
                let pid = owned.pid as i32;
                drop(owned);
                let deadline = Instant::now() + Duration::from_secs(10);
                loop {
                    // SAFETY: kill with signal 0 only checks that the process exists.
                    let gone = unsafe { libc::kill(pid, 0) } != 0;
                    if gone {
                        break;
                    }
                    assert!(Instant::now() < deadline, "the reaper never took {pid}");
                    std::thread::sleep(Duration::from_millis(10));
                }
                // Nothing left behind: no zombie, no owned entry.
                assert!(table.inner.lock().unwrap().owned.is_empty());
            },
        );
    }

    /// An agent whose replies go to a file, with its reaper running, for one isolated test.
    fn agent_writing_to(out: File) -> Arc<Agent> {
        let agent = Arc::new(Agent {
            out: Mutex::new(out),
            env: RwLock::new(BTreeMap::new()),
            children: Arc::new(ChildTable::default()),
            main: Mutex::new(MainState::default()),
            without_spawn: false,
            version: proto::VERSION,
            file_owner: None,
            main_cmd: Vec::new(),
        });
        let reaper = agent.children.clone();
        std::thread::spawn(move || reaper.reap_forever());
        agent
    }

    #[test]
    fn a_long_exec_or_followed_spawn_lets_the_next_request_through_and_short_ones_read_on() {
        isolated(
            "agent::reaper_tests::a_long_exec_or_followed_spawn_lets_the_next_request_through_and_short_ones_read_on",
            || {
                let tmp = tempfile::tempdir().unwrap();
                let (req_r, mut req_w) = procs::pipe().unwrap();
                let (mut rep_r, rep_w) = procs::pipe().unwrap();
                let pool = Arc::new(Pool {
                    input: Mutex::new(BufReader::with_capacity(1 << 16, req_r)),
                    readers: AtomicUsize::new(1),
                    eager_handoff: false,
                    agent: agent_writing_to(rep_w),
                });
                let serving = pool.clone();
                std::thread::spawn(move || serving.serve());
                let frame = |id: u64, req: Request| proto::encode(id, &req, &[]).unwrap();
                let exec = |script: &str, stream: bool| {
                    Request::Exec(ExecRequest {
                        cmd: vec!["/bin/sh".into(), "-c".into(), script.into()],
                        env: BTreeMap::new(),
                        cwd: None,
                        timeout_ms: None,
                        detach: false,
                        stream,
                    })
                };
                let mut send = |id: u64, req: Request| req_w.write_all(&frame(id, req)).unwrap();
                let mut next = || proto::read_frame::<Reply>(&mut rep_r).unwrap();

                // A long exec, known to run once its first output came back; then a short one.
                send(1, exec("echo started; sleep 1; echo ended", true));
                let (h, body) = next();
                assert_eq!((h.id, body.as_slice()), (1, b"started\n".as_slice()));
                send(2, exec("echo short", false));
                let (h, body) = next();
                assert_eq!(h.id, 2, "the short exec waited for the long one: {:?}", h.msg);
                assert!(matches!(h.msg, Reply::Exit { exit_code: Some(0), .. }));
                assert_eq!(body, b"short\n");
                let (h, body) = next();
                assert_eq!((h.id, body.as_slice()), (1, b"ended\n".as_slice()));
                assert!(matches!(next().0.msg, Reply::Exit { exit_code: Some(0), .. }));

                // Short execs one after another: each answered, in order.
                for id in 3..13 {
                    send(id, exec(&format!("echo {id}"), false));
                    let (h, body) = next();
                    assert_eq!(h.id, id);
                    assert_eq!(body, format!("{id}\n").into_bytes());
                }

                // A followed spawn of a long command, then a short exec: answered first.
                let dir = tmp.path().join("p20");
                let spawn = Request::Spawn(proto::SpawnRequest {
                    cmd: vec!["/bin/sh".into(), "-c".into(), "sleep 1".into()],
                    env: BTreeMap::new(),
                    cwd: None,
                    dir: dir.to_str().unwrap().into(),
                    index_dir: tmp.path().to_str().unwrap().into(),
                    key: "k20".into(),
                    stdin: false,
                    pty: None,
                    user: None,
                    follow_ms: 5_000,
                    spawned_within_ms: 0,
                });
                send(20, spawn);
                assert!(matches!(next(), (h, _) if h.id == 20 && matches!(h.msg, Reply::Spawned { .. })));
                send(21, exec("echo short", false));
                let (h, body) = next();
                assert_eq!(h.id, 21, "the exec waited for the followed spawn: {:?}", h.msg);
                assert_eq!(body, b"short\n");
                let (h, _) = next();
                assert_eq!(h.id, 20);
                assert!(matches!(h.msg, Reply::Progress { exit: Some(0), .. }), "{:?}", h.msg);
                // The channel stays open (its close ends the process).
                std::mem::forget(req_w);
            },
        );
    }

    #[test]
    fn a_followed_spawn_answers_started_then_its_output_and_exit_on_the_same_request() {
        isolated(
            "agent::reaper_tests::a_followed_spawn_answers_started_then_its_output_and_exit_on_the_same_request",
            || {
                let tmp = tempfile::tempdir().unwrap();
                let replies = tmp.path().join("replies");
                let agent = agent_writing_to(File::create(&replies).unwrap());
                let mut reader = File::open(&replies).unwrap();
                let spawn = |id: u64, script: &str, follow_ms: u64, spawned_within_ms: u64| {
                    let dir = tmp.path().join(format!("k{id}"));
                    let req = proto::SpawnRequest {
                        cmd: vec!["/bin/sh".into(), "-c".into(), script.into()],
                        env: BTreeMap::new(),
                        cwd: None,
                        dir: dir.to_str().unwrap().into(),
                        index_dir: tmp.path().join("index").to_str().unwrap().into(),
                        key: format!("key{id}"),
                        stdin: false,
                        pty: None,
                        user: None,
                        follow_ms,
                        spawned_within_ms,
                    };
                    agent.handle(id, Request::Spawn(req), b"{}".to_vec(), None);
                    dir
                };
                let mut next = |id: u64| {
                    let (h, body) = proto::read_frame::<Reply>(&mut reader).unwrap();
                    assert_eq!(h.id, id);
                    (h.msg, body)
                };

                // A short command: its output and exit come with the request's second reply,
                // as its files say.
                let dir = spawn(1, "echo hi; echo oops >&2; exit 3", 5_000, 0);
                let (first, _) = next(1);
                let Reply::Spawned { pid } = first else {
                    panic!("first reply {first:?}")
                };
                assert_eq!(fs::read_to_string(dir.join("pid")).unwrap(), pid.to_string());
                let (second, body) = next(1);
                assert_eq!(
                    second,
                    Reply::Progress {
                        pid: None,
                        exit: Some(3),
                        signaled: false,
                        out_len: 3,
                        err_len: 5,
                        out_sent: 3
                    }
                );
                assert_eq!(body, b"hi\noops\n");
                assert!(dir.join("exit-3").exists());

                // Killed by a signal: the marker's status and `signaled`.
                spawn(2, "kill -9 $$", 5_000, 0);
                assert!(matches!(next(2).0, Reply::Spawned { .. }));
                let (second, body) = next(2);
                assert!(
                    matches!(
                        second,
                        Reply::Progress {
                            exit: Some(137),
                            signaled: true,
                            ..
                        }
                    ),
                    "{second:?}"
                );
                assert!(body.is_empty());

                // Output, then a long run: answered at the output, before the exit (which a
                // follower then waits for in the files).
                let dir = spawn(3, "echo first; sleep 3; echo late", 5_000, 0);
                assert!(matches!(next(3).0, Reply::Spawned { .. }));
                let (second, body) = next(3);
                assert!(
                    matches!(
                        second,
                        Reply::Progress {
                            exit: None,
                            out_len: 6,
                            out_sent: 6,
                            ..
                        }
                    ),
                    "{second:?}"
                );
                assert_eq!(body, b"first\n");
                assert!(!dir.join("exit-0").exists());

                // Nothing within the follow's time: answered when it is up, with nothing.
                spawn(4, "sleep 3", 100, 0);
                assert!(matches!(next(4).0, Reply::Spawned { .. }));
                let (second, body) = next(4);
                assert_eq!(
                    second,
                    Reply::Progress {
                        pid: None,
                        exit: None,
                        signaled: false,
                        out_len: 0,
                        err_len: 0,
                        out_sent: 0
                    }
                );
                assert!(body.is_empty());

                // `Spawned` held back: a short command is answered once, its `Progress` naming
                // the pid, and leaves no record (config, pid, index entry) since it ended
                // before anyone heard of it; a longer one hears `Spawned` when the hold is up,
                // its record written before, then its `Progress`.
                let dir = spawn(10, "exit 4", 5_000, 5_000);
                let (only, body) = next(10);
                let Reply::Progress {
                    pid: Some(pid),
                    exit: Some(4),
                    out_len: 0,
                    ..
                } = only
                else {
                    panic!("one reply for a short command: {only:?}")
                };
                assert!(body.is_empty());
                assert!(dir.join("exit-4").exists());
                for no in [dir.join("pid"), dir.join("config")] {
                    assert!(!no.exists(), "{no:?}");
                }
                assert!(!tmp.path().join("index").join(pid.to_string()).exists());
                let dir = spawn(11, "sleep 3", 400, 50);
                let Reply::Spawned { pid } = next(11).0 else {
                    panic!("Spawned when the hold is up")
                };
                assert_eq!(fs::read_to_string(dir.join("pid")).unwrap(), pid.to_string());
                assert_eq!(fs::read_to_string(dir.join("config")).unwrap(), "{}");
                assert_eq!(
                    fs::read_to_string(tmp.path().join("index").join(pid.to_string())).unwrap(),
                    "key11"
                );
                let (second, _) = next(11);
                assert!(
                    matches!(second, Reply::Progress { pid: None, exit: None, .. }),
                    "{second:?}"
                );
                // A hold as long as the follow: one reply, with the pid, when it is up (the
                // process runs on: its record is there).
                let dir = spawn(12, "sleep 3", 100, 100);
                let (only, _) = next(12);
                assert!(
                    matches!(only, Reply::Progress { pid: Some(_), exit: None, .. }),
                    "{only:?}"
                );
                assert!(dir.join("pid").exists());

                // E2B's layout (the index is the process directories' parent): after a spawn
                // a spare directory waits in the index, and the next spawn takes it, renamed
                // into place with its output files and its watch.
                let e2b_index = tmp.path().join("proc");
                let spawn_in = |id: u64, script: &str| {
                    let req = proto::SpawnRequest {
                        cmd: vec!["/bin/sh".into(), "-c".into(), script.into()],
                        env: BTreeMap::new(),
                        cwd: None,
                        dir: e2b_index.join(format!("k{id}")).to_str().unwrap().into(),
                        index_dir: e2b_index.to_str().unwrap().into(),
                        key: format!("key{id}"),
                        stdin: false,
                        pty: None,
                        user: None,
                        follow_ms: 5_000,
                        spawned_within_ms: 0,
                    };
                    agent.handle(id, Request::Spawn(req), b"{}".to_vec(), None);
                };
                let spares = || {
                    let mut v: Vec<_> = fs::read_dir(&e2b_index)
                        .unwrap()
                        .flatten()
                        .filter(|e| e.file_name().to_string_lossy().starts_with(".spare-"))
                        .map(|e| e.path())
                        .collect();
                    v.sort();
                    v
                };
                spawn_in(20, "echo one");
                assert!(matches!(next(20).0, Reply::Spawned { .. }));
                let (second, body) = next(20);
                assert!(matches!(second, Reply::Progress { exit: Some(0), .. }), "{second:?}");
                assert_eq!(body, b"one\n");
                let made = spares();
                assert_eq!(made.len(), 1, "a spare after the first spawn");
                spawn_in(21, "echo two >&2; exit 5");
                assert!(matches!(next(21).0, Reply::Spawned { .. }));
                let (second, body) = next(21);
                assert!(
                    matches!(second, Reply::Progress { exit: Some(5), err_len: 4, .. }),
                    "the spare's watch followed it: {second:?}"
                );
                assert_eq!(body, b"two\n");
                assert!(!made[0].exists(), "the spare was taken");
                assert_eq!(fs::read_to_string(e2b_index.join("k21/err")).unwrap(), "two\n");
                assert!(e2b_index.join("k21/exit-5").exists());
                assert_eq!(spares().len(), 1, "the next spare");

                // Without `follow_ms`: one reply, as before.
                spawn(5, "true", 0, 0);
                assert!(matches!(next(5).0, Reply::Started { .. }));

                // More output than a reply carries: its head, and the full sizes.
                let big = proto::SPAWN_FOLLOW_OUTPUT + 10;
                spawn(6, &format!("head -c {big} /dev/zero"), 5_000, 0);
                assert!(matches!(next(6).0, Reply::Spawned { .. }));
                let (second, body) = next(6);
                let Reply::Progress {
                    out_len, out_sent, ..
                } = second
                else {
                    panic!("{second:?}")
                };
                assert_eq!(out_sent, proto::SPAWN_FOLLOW_OUTPUT);
                assert_eq!(body.len() as u64, out_sent);
                assert!(out_len >= out_sent);

                // A start that fails says why: a missing working directory, or program.
                for (n, cmd, cwd, want) in [
                    (7, "/bin/true", Some("/nonexistent-dir"), AgentErrorCode::NoSuchCwd),
                    (8, "/nonexistent-program", None, AgentErrorCode::NotFound),
                    (9, "/nonexistent-program", Some("/"), AgentErrorCode::NotFound),
                ] {
                    let req = proto::SpawnRequest {
                        cmd: vec![cmd.into()],
                        env: BTreeMap::new(),
                        cwd: cwd.map(String::from),
                        dir: tmp.path().join(format!("k{n}")).to_str().unwrap().into(),
                        index_dir: tmp.path().join("index").to_str().unwrap().into(),
                        key: format!("key{n}"),
                        stdin: false,
                        pty: None,
                        user: None,
                        follow_ms: 5_000,
                        spawned_within_ms: 0,
                    };
                    agent.handle(n, Request::Spawn(req), b"{}".to_vec(), None);
                    let (reply, _) = next(n);
                    assert!(
                        matches!(reply, Reply::Error { code, .. } if code == want),
                        "{cmd} in {cwd:?}: {reply:?}"
                    );
                }
            },
        );
    }
}
