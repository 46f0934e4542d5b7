//! Processes whose state lives in files (E2B's): `Spawn`, `ProcInput`, `ProcCloseInput`,
//! `ProcResize` (see [`crate::proto::Request::Spawn`]).
//!
//! One spawn per process, straight from the agent: its output goes to files in its directory
//! (a terminal's through a copier thread), a waiter thread records its exit status there. The
//! files, the threads and the pipes or terminal the agent keeps for its input are all inside
//! the sandbox, so they survive checkpoint and restore with it.
//!
//! An ended process's files are kept [`KEEP_ENDED`] (its followers read the last output and the
//! status), then removed by a later `Spawn`: a sandbox that runs many commands does not
//! accumulate their output.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{mpsc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::{bad_request, io_error, Agent, Answer, WaitStatus};
use crate::proto::{
    AgentErrorCode, PtySize, Reply, SpawnRequest, SPAWN_FOLLOW_LINGER_MS, SPAWN_FOLLOW_OUTPUT,
};

/// What the agent keeps of a running process: the writing end of its stdin (a pipe, or a
/// duplicate of its terminal's master) and its terminal's master (for resizes).
#[derive(Default)]
struct ProcIo {
    input: Option<File>,
    master: Option<File>,
}

/// How long an ended process's files stay.
pub const KEEP_ENDED: Duration = Duration::from_secs(60);

/// A process that ended: when, its directory, and its index file with the key it holds.
struct Ended {
    at: Instant,
    dir: PathBuf,
    index: PathBuf,
    key: String,
}

/// Ended processes, oldest first.
fn ended() -> &'static Mutex<VecDeque<Ended>> {
    static ENDED: OnceLock<Mutex<VecDeque<Ended>>> = OnceLock::new();
    ENDED.get_or_init(Default::default)
}

/// Removes the files of processes that ended more than [`KEEP_ENDED`] before `now`. An index
/// file that names another key now (the pid was reused) is left.
fn prune_ended(now: Instant) {
    prune(&mut ended().lock().unwrap_or_else(|p| p.into_inner()), now);
}

fn prune(q: &mut VecDeque<Ended>, now: Instant) {
    while q
        .front()
        .is_some_and(|e| now.saturating_duration_since(e.at) >= KEEP_ENDED)
    {
        let Some(e) = q.pop_front() else { break };
        let _ = fs::remove_dir_all(&e.dir);
        if fs::read_to_string(&e.index).is_ok_and(|k| k.trim() == e.key) {
            let _ = fs::remove_file(&e.index);
        }
    }
}

fn procs() -> &'static Mutex<HashMap<u32, ProcIo>> {
    static PROCS: OnceLock<Mutex<HashMap<u32, ProcIo>>> = OnceLock::new();
    PROCS.get_or_init(Default::default)
}

/// How long, after a terminal process exited, its output may still be drained (a background
/// child can hold the terminal open).
const PTY_DRAIN: Duration = Duration::from_millis(500);

impl Agent {
    /// `Spawn`, answered under `id`: once (`Started`), or with `follow_ms` twice (`Spawned`,
    /// then `Progress`: see [`Follow`]). The files it opened are closed after its last reply,
    /// which need not wait for those system calls. `held`, the channel while this thread holds
    /// it, is watched through a followed spawn's wait ([`super::Pool`]).
    pub(super) fn spawn_and_reply(
        &self,
        id: u64,
        req: SpawnRequest,
        config: &[u8],
        held: Option<&dyn super::HeldInput>,
    ) {
        let mut opened = Vec::new();
        let index = PathBuf::from(&req.index_dir);
        let spare_in = Path::new(&req.dir).parent() == Some(index.as_path());
        match self.spawn_proc(id, req, config, &mut opened, held) {
            Ok((reply, body)) => self.reply(id, &reply, &body),
            Err(e) => self.reply(id, &e, &[]),
        }
        drop(opened);
        if spare_in {
            Spare::make(&index);
        }
    }

    fn spawn_proc(
        &self,
        id: u64,
        req: SpawnRequest,
        config: &[u8],
        opened: &mut Vec<File>,
        held: Option<&dyn super::HeldInput>,
    ) -> Answer {
        if req.cmd.is_empty() {
            return Err(bad_request("cmd must not be empty".into()));
        }
        let dir = PathBuf::from(&req.dir);
        let index = Path::new(&req.index_dir);
        let at = |name: &str| dir.join(name);
        let (out, err, watch) = match Spare::take(index, &dir) {
            Some(made) => made,
            None => {
                fs::create_dir_all(&dir).map_err(|e| io_error(&dir, e))?;
                // E2B's index is the directory's parent, there now (a system call saved).
                if dir.parent() != Some(index) {
                    fs::create_dir_all(index).map_err(|e| io_error(index, e))?;
                }
                let create =
                    |name: &str| output_file(&at(name)).map_err(|e| io_error(&at(name), e));
                (create("out")?, create("err")?, None)
            }
        };
        // Watched from before the process starts, so that none of its writes and not its exit
        // is missed. Without inotify the spawn is answered once, as an unfollowed one.
        let follow = match req.follow_ms {
            0 => None,
            ms => watch
                .map_or_else(|| watch_dir(&dir), Ok)
                .ok()
                .map(|inotify| Follow {
                    inotify,
                    until: Instant::now()
                        + Duration::from_millis(ms.min(crate::proto::MAX_WAIT_MS)),
                }),
        };
        let spawn_err = |e: io::Error| match &req.cwd {
            // A missing working directory is told from a missing program only once a start
            // failed (a system call saved on every start that does not).
            Some(cwd) if !Path::new(cwd).is_dir() => Reply::Error {
                code: AgentErrorCode::NoSuchCwd,
                message: format!("cwd {cwd:?} is not a directory"),
            },
            _ => Reply::Error {
                code: match e.kind() {
                    io::ErrorKind::NotFound => AgentErrorCode::NotFound,
                    io::ErrorKind::PermissionDenied => AgentErrorCode::PermissionDenied,
                    _ => AgentErrorCode::SpawnFailed,
                },
                message: format!("cannot start {:?}: {e}", req.cmd[0]),
            },
        };
        // Without a terminal: started without copying the agent and in a few system calls
        // (see [`super::spawn`]); with one, through `Command`.
        let fast = match &req.pty {
            None => super::spawn::Prepared::new(
                &req.cmd,
                self.env.read().unwrap_or_else(|p| p.into_inner()).iter(),
                &req.env,
                req.cwd.as_deref(),
                req.user,
                true,
            ),
            Some(_) => None,
        };
        let mut master = None;
        let (pid, status_rx, stdin) = if let Some(prepared) = fast {
            let (child_in, stdin) = if req.stdin {
                let (r, w) = pipe().map_err(|e| io_error(Path::new("pipe"), e))?;
                (Some(r), Some(w))
            } else {
                (None, None)
            };
            let null = super::dev_null().map_err(|e| io_error(Path::new("/dev/null"), e))?;
            let stdio = super::spawn::Stdio3 {
                stdin: child_in.as_ref().map_or(null, |f| f.as_raw_fd()),
                stdout: out.as_raw_fd(),
                stderr: err.as_raw_fd(),
            };
            let (pid, rx) = self
                .children
                .spawn_with(true, || prepared.spawn(stdio), |pid| *pid)
                .map_err(spawn_err)?;
            // The child's copy of its stdin is its own now.
            drop(child_in);
            (pid, rx, stdin)
        } else {
            let mut command = Command::new(&req.cmd[0]);
            command.args(&req.cmd[1..]);
            for (k, v) in self.env.read().unwrap_or_else(|p| p.into_inner()).iter() {
                command.env(k, v);
            }
            if req.pty.is_some() && !req.env.contains_key("TERM") {
                command.env("TERM", "xterm-256color");
            }
            command.envs(&req.env);
            if let Some(u) = req.user {
                // std drops the supplementary groups too (setgroups before setuid).
                command.uid(u.uid).gid(u.gid);
            }
            if let Some(cwd) = &req.cwd {
                command.current_dir(cwd);
            }
            if let Some(size) = req.pty {
                let (m, slave) = open_pty(size).map_err(|e| io_error(Path::new("/dev/ptmx"), e))?;
                let dup = |f: &File| {
                    f.try_clone()
                        .map_err(|e| io_error(Path::new("/dev/pts"), e))
                };
                command
                    .stdin(Stdio::from(dup(&slave)?))
                    .stdout(Stdio::from(dup(&slave)?))
                    .stderr(Stdio::from(slave));
                // SAFETY: setsid and ioctl are async-signal-safe; the closure touches no memory
                // of the parent. A session of its own with the terminal as its controlling one.
                unsafe {
                    command.pre_exec(|| {
                        if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                            return Err(io::Error::last_os_error());
                        }
                        Ok(())
                    });
                }
                master = Some(m);
            } else {
                // Its own process group, so a signal reaches everything it started.
                command
                    .process_group(0)
                    .stdin(if req.stdin {
                        Stdio::piped()
                    } else {
                        Stdio::null()
                    })
                    .stdout(Stdio::from(
                        out.try_clone().map_err(|e| io_error(&at("out"), e))?,
                    ))
                    .stderr(Stdio::from(
                        err.try_clone().map_err(|e| io_error(&at("err"), e))?,
                    ));
            }
            let (mut child, status_rx) =
                self.children.spawn(&mut command, true).map_err(spawn_err)?;
            // The parent's copies of the terminal's slave side go with the command.
            drop(command);
            let stdin = child.stdin.take().map(|s| File::from(OwnedFd::from(s)));
            (child.id(), status_rx, stdin)
        };
        let status_rx = status_rx.expect("waited spawn has a receiver");
        let mut io = ProcIo::default();
        let mut copier = None;
        if let Some(m) = master {
            io.input = m.try_clone().ok();
            let reader = m
                .try_clone()
                .map_err(|e| io_error(Path::new("/dev/ptmx"), e))?;
            io.master = Some(m);
            let (done_tx, done_rx) = mpsc::channel::<()>();
            let into = out.try_clone().map_err(|e| io_error(&at("out"), e))?;
            let _ = std::thread::Builder::new()
                .name("pty-copier".into())
                .spawn(move || {
                    copy_terminal(reader, into);
                    let _ = done_tx.send(());
                });
            copier = Some(done_rx);
        } else {
            io.input = stdin;
        }
        procs()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(pid, io);
        // Its `config`, `pid` and index entry: written while the process starts, not before,
        // and all there before anyone hears of the pid. (The process runs now: a file that
        // cannot be written is not a failed start. Its directory and output files were just
        // made, so only a full disk fails them.) A followed spawn whose `Spawned` is held back
        // writes them only when the pid is told while the process runs (see below).
        let index_file = index.join(pid.to_string());
        let recorded = RefCell::new(Vec::new());
        let record = || {
            let mut files = recorded.borrow_mut();
            let _ = write_open(&at("config"), config, &mut files);
            let _ = write_open(&at("pid"), pid.to_string().as_bytes(), &mut files);
            let _ = write_open(&index_file, req.key.as_bytes(), &mut files);
        };
        let key = req.key.clone();
        let (exit_dir, exit_index) = (dir.clone(), index_file.clone());
        match copier {
            // Recorded by the reaper as soon as it reaps it: no thread of its own.
            None => self.children.on_exit(pid, status_rx, move |status| {
                record_exit(pid, Some(status), exit_dir, exit_index, key)
            }),
            // A terminal's output may still be draining: wait for its copier first.
            Some(done) => {
                let _ = std::thread::Builder::new()
                    .name("proc-waiter".into())
                    .spawn(move || {
                        let status = status_rx.recv().ok();
                        let _ = done.recv_timeout(PTY_DRAIN);
                        record_exit(pid, status, exit_dir, exit_index, key)
                    });
            }
        }
        let answer = match follow {
            Some(f) => {
                let spawned = || {
                    record();
                    self.reply(id, &Reply::Spawned { pid }, &[])
                };
                // Held back for a process that may end soon: then its `Progress` says both,
                // and one that ended by then needs no record (an ended process is not listed,
                // and one without an index entry is as not found as one that ended).
                let mut hold =
                    Duration::from_millis(req.spawned_within_ms.min(crate::proto::MAX_WAIT_MS));
                let env = self.env.read().unwrap_or_else(|p| p.into_inner());
                if env
                    .get(super::BENCH_SPAWNED_AT_ONCE)
                    .is_some_and(|v| v == "1")
                {
                    hold = Duration::ZERO;
                }
                drop(env);
                let mut announce = None;
                if hold.is_zero() {
                    spawned();
                } else {
                    announce = Some((Instant::now() + hold, &spawned as &dyn Fn()));
                }
                // While the process runs, not before it starts.
                prune_ended(Instant::now());
                let (mut reply, body) = f.wait(&out, &err, held, &mut announce);
                if announce.is_some() {
                    if let Reply::Progress { pid: p, exit, .. } = &mut reply {
                        if exit.is_none() {
                            record();
                        }
                        *p = Some(pid);
                    }
                }
                opened.push(File::from(f.inotify));
                (reply, body)
            }
            None => {
                record();
                prune_ended(Instant::now());
                (Reply::Started { pid }, Vec::new())
            }
        };
        opened.extend(recorded.into_inner());
        opened.extend([out, err]);
        Ok(answer)
    }

    pub(super) fn proc_input(&self, pid: u32, data: &[u8]) -> Answer {
        let mut procs = procs().lock().unwrap_or_else(|p| p.into_inner());
        let input = procs
            .get_mut(&pid)
            .and_then(|p| p.input.as_mut())
            .ok_or_else(|| no_input(pid))?;
        input
            .write_all(data)
            .map_err(|e| io_error(Path::new(&format!("stdin of {pid}")), e))?;
        Ok((Reply::Ok, Vec::new()))
    }

    pub(super) fn proc_close_input(&self, pid: u32) -> Answer {
        let mut procs = procs().lock().unwrap_or_else(|p| p.into_inner());
        let p = procs.get_mut(&pid).ok_or_else(|| no_input(pid))?;
        p.input = None;
        Ok((Reply::Ok, Vec::new()))
    }

    pub(super) fn proc_resize(&self, pid: u32, size: PtySize) -> Answer {
        let procs = procs().lock().unwrap_or_else(|p| p.into_inner());
        let master = procs
            .get(&pid)
            .and_then(|p| p.master.as_ref())
            .ok_or_else(|| Reply::Error {
                code: AgentErrorCode::NotFound,
                message: format!("process {pid} has no terminal"),
            })?;
        set_size(master, size).map_err(|e| io_error(Path::new("/dev/ptmx"), e))?;
        Ok((Reply::Ok, Vec::new()))
    }
}

/// What a `Spawn` process leaves when it ends: its exit marker (and `signaled`) in its
/// directory, its place among the ended (pruned after [`KEEP_ENDED`]), and a wake for
/// `ListChanged` waits.
fn record_exit(pid: u32, status: Option<WaitStatus>, dir: PathBuf, index: PathBuf, key: String) {
    procs()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&pid);
    let rc = status.and_then(|s| s.code).unwrap_or(-1);
    if status.is_some_and(|s| s.signal.is_some()) {
        mark(&dir.join("signaled"));
    }
    mark(&dir.join(format!("exit-{rc}")));
    ended()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push_back(Ended {
            at: Instant::now(),
            dir,
            index,
            key,
        });
    notify_exit();
}

/// Makes the empty file `path` (a marker): one `mknod` where creating it through `open` costs
/// a `close` too, on the way from a process's exit to its follower's `Progress`.
fn mark(path: &Path) {
    use std::os::unix::ffi::OsStrExt as _;
    let made = std::ffi::CString::new(path.as_os_str().as_bytes()).is_ok_and(|c| {
        // SAFETY: a NUL-terminated path; mknod touches no memory of ours.
        unsafe { libc::mknod(c.as_ptr(), libc::S_IFREG | 0o644, 0) == 0 }
    });
    if !made {
        let _ = File::create(path);
    }
}

/// A followed `Spawn` ([`crate::proto::SpawnRequest::follow_ms`]): an inotify watch of the
/// process's directory for writes to its output files and the creation of its exit marker,
/// so that the wait costs no system call until something happens (re-listing the directory,
/// as `ListChanged` does, costs a dozen per look under gVisor's ptrace platform and slows the
/// process it waits for).
pub(super) struct Follow {
    inotify: OwnedFd,
    until: Instant,
}

/// An inotify instance watching process directory `dir` for a [`Follow`]: writes to its
/// files and what is created in it. The watch goes with the directory if it is renamed.
fn watch_dir(dir: &Path) -> io::Result<OwnedFd> {
    use std::os::unix::ffi::OsStrExt as _;
    let inotify = super::watch::inotify()?;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    // SAFETY: a valid inotify descriptor and a NUL-terminated path.
    let wd = unsafe {
        libc::inotify_add_watch(
            inotify.as_raw_fd(),
            path.as_ptr(),
            libc::IN_MODIFY | libc::IN_CREATE | libc::IN_ONLYDIR,
        )
    };
    if wd < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(inotify)
}

/// A process's output file, new and empty; readable too: a followed spawn answers its head
/// ([`Follow`]).
fn output_file(path: &Path) -> io::Result<File> {
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
}

/// A process directory made ahead in an index directory (E2B's layout: the index is the
/// process directories' parent), with its empty `out` and `err` open and a watch on it. The
/// next `Spawn` there renames it into place: one system call before its process starts where
/// making it costs five (`mkdir`, two `open`s, the inotify instance and its watch). The agent
/// makes the next one after that spawn's last reply.
struct Spare {
    index: PathBuf,
    dir: PathBuf,
    out: File,
    err: File,
    watch: Option<OwnedFd>,
}

fn spare() -> &'static Mutex<Option<Spare>> {
    static SPARE: OnceLock<Mutex<Option<Spare>>> = OnceLock::new();
    SPARE.get_or_init(Default::default)
}

const SPARE_PREFIX: &str = ".spare-";

impl Spare {
    /// The spare of `index` renamed to `dir` (a new directory in it): its files and watch.
    fn take(index: &Path, dir: &Path) -> Option<(File, File, Option<OwnedFd>)> {
        if dir.parent() != Some(index) {
            return None;
        }
        let s = spare().lock().unwrap_or_else(|p| p.into_inner()).take()?;
        if s.index != index || fs::rename(&s.dir, dir).is_err() {
            let _ = fs::remove_dir_all(&s.dir);
            return None;
        }
        Some((s.out, s.err, s.watch))
    }

    /// Makes the spare of `index` unless there is one. The first in this agent's life removes
    /// what an earlier life left (an agent that rebooted with its files kept).
    fn make(index: &Path) {
        static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        if spare().lock().unwrap_or_else(|p| p.into_inner()).is_some() {
            return;
        }
        let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n == 0 {
            for e in fs::read_dir(index).into_iter().flatten().flatten() {
                if e.file_name().to_string_lossy().starts_with(SPARE_PREFIX) {
                    let _ = fs::remove_dir_all(e.path());
                }
            }
        }
        let dir = index.join(format!("{SPARE_PREFIX}{n}"));
        let made = fs::create_dir(&dir).and_then(|()| {
            Ok(Spare {
                index: index.to_path_buf(),
                out: output_file(&dir.join("out"))?,
                err: output_file(&dir.join("err"))?,
                watch: watch_dir(&dir).ok(),
                dir: dir.clone(),
            })
        });
        match made {
            Ok(s) => {
                let mut slot = spare().lock().unwrap_or_else(|p| p.into_inner());
                match slot.as_ref() {
                    // Another thread made one meanwhile.
                    Some(_) => {
                        let _ = fs::remove_dir_all(&dir);
                    }
                    None => *slot = Some(s),
                }
            }
            Err(_) => {
                let _ = fs::remove_dir_all(&dir);
            }
        }
    }
}

impl Follow {
    /// Waits until the process's exit marker appears, or until it has written output (and
    /// then [`SPAWN_FOLLOW_LINGER_MS`] more for its exit), or until the follow's time is up;
    /// answers `Progress` with what its files hold then. `announce`, a `Spawned` held back
    /// until a time, is sent then if the wait lasts that long, and taken (`None`) once sent.
    fn wait(
        &self,
        out: &File,
        err: &File,
        held: Option<&dyn super::HeldInput>,
        announce: &mut Option<(Instant, &dyn Fn())>,
    ) -> (Reply, Vec<u8>) {
        let mut buf = [0u8; 4096];
        let mut seen = Seen::default();
        let mut until = self.until;
        // What is queued already (its `config` and `pid` when they were written before the
        // wait, or its first output) without a poll that would answer at once.
        let fd = self.inotify.as_raw_fd();
        super::watch::read_queued(fd, &mut buf, |_, mask, _, name| seen.event(mask, name));
        while seen.exit.is_none() {
            if seen.out || seen.err {
                let linger = Instant::now() + Duration::from_millis(SPAWN_FOLLOW_LINGER_MS);
                until = until.min(linger);
            }
            let now = Instant::now();
            if let Some((at, spawned)) = *announce {
                if at <= now && now < until {
                    spawned();
                    *announce = None;
                }
            }
            let end = announce.map_or(until, |(at, _)| at.min(until));
            let left = end.saturating_duration_since(now);
            if left.is_zero() {
                break;
            }
            // Rounded up: a poll of 0 ms would spin until the deadline.
            let ms = left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
            super::watch::read_events(fd, &mut buf, ms, held, |_, mask, _, name| {
                seen.event(mask, name)
            });
        }
        // A file the process did not write is empty (the watch was there before it started).
        let len = |f: &File, wrote: bool| match wrote {
            true => f.metadata().map_or(0, |m| m.len()),
            false => 0,
        };
        let (out_len, err_len) = (len(out, seen.out), len(err, seen.err));
        let (exit, signaled) = (seen.exit, seen.signaled);
        let mut body = head(out, out_len);
        let out_sent = body.len() as u64;
        body.extend(head(err, err_len));
        (
            Reply::Progress {
                pid: None,
                exit,
                signaled,
                out_len,
                err_len,
                out_sent,
            },
            body,
        )
    }
}

/// What a followed process's directory watch has told: its exit marker (and `signaled`),
/// and which of `out` and `err` it wrote.
#[derive(Default)]
struct Seen {
    exit: Option<i32>,
    signaled: bool,
    out: bool,
    err: bool,
}

impl Seen {
    fn event(&mut self, mask: u32, name: &str) {
        if mask & libc::IN_Q_OVERFLOW != 0 {
            // Events were lost: the files are looked at.
            (self.out, self.err) = (true, true);
        } else if mask & libc::IN_CREATE != 0 {
            if let Some(rc) = name.strip_prefix("exit-") {
                self.exit = Some(rc.parse().unwrap_or(-1));
            } else if name == "signaled" {
                self.signaled = true;
            }
        } else if mask & libc::IN_MODIFY != 0 {
            match name {
                "out" => self.out = true,
                "err" => self.err = true,
                _ => {}
            }
        }
    }
}

/// The first `len` bytes of `f` (at most [`SPAWN_FOLLOW_OUTPUT`]); fewer if it is shorter.
fn head(f: &File, len: u64) -> Vec<u8> {
    use std::os::unix::fs::FileExt as _;
    let mut buf = vec![0u8; len.min(SPAWN_FOLLOW_OUTPUT) as usize];
    let mut n = 0;
    while n < buf.len() {
        match f.read_at(&mut buf[n..], n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    buf.truncate(n);
    buf
}

/// Counts process exits, so that `ListChanged` waits notice one at once instead of at their
/// next look.
fn exits() -> &'static (Mutex<u64>, Condvar) {
    static EXITS: OnceLock<(Mutex<u64>, Condvar)> = OnceLock::new();
    EXITS.get_or_init(Default::default)
}

fn notify_exit() {
    let (n, cv) = exits();
    *n.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    cv.notify_all();
}

/// How many `Spawn` processes have ended so far: read it before looking, then
/// [`wait_for_exit`] with it, so an exit between the look and the wait is not missed.
pub(super) fn exit_count() -> u64 {
    *exits().0.lock().unwrap_or_else(|p| p.into_inner())
}

/// Sleeps for `max`, or less when a `Spawn` process ends meanwhile: returns at once when one
/// has ended since [`exit_count`] answered `seen`.
pub(super) fn wait_for_exit(seen: u64, max: Duration) {
    let (n, cv) = exits();
    let g = n.lock().unwrap_or_else(|p| p.into_inner());
    let _ = cv
        .wait_timeout_while(g, max, |now| *now == seen)
        .unwrap_or_else(|p| p.into_inner());
}

fn no_input(pid: u32) -> Reply {
    Reply::Error {
        code: AgentErrorCode::NotFound,
        message: format!("process {pid} is not running with an open stdin"),
    }
}

/// Writes `data` to a new (or truncated) file at `path`, leaving it open in `opened`.
fn write_open(path: &Path, data: &[u8], opened: &mut Vec<File>) -> io::Result<()> {
    let mut f = File::create(path)?;
    f.write_all(data)?;
    opened.push(f);
    Ok(())
}

/// A pipe, both ends close-on-exec: (read, write).
pub(super) fn pipe() -> io::Result<(File, File)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array it is given; they are ours after.
    unsafe {
        if libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])))
    }
}

/// Copies a terminal's output into its file until the terminal closes (EIO once every slave
/// descriptor is gone).
fn copy_terminal(mut master: File, mut out: File) {
    let mut buf = vec![0u8; 32 << 10];
    loop {
        match master.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                if out.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

fn set_size(master: &File, size: PtySize) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let ws = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize from a valid pointer; the fd is open.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &ws) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A new pseudo-terminal of `size`: (master, slave).
fn open_pty(size: PtySize) -> io::Result<(File, File)> {
    // SAFETY: plain libc calls on a descriptor we own; ptsname_r writes at most `buf.len()`
    // bytes into our buffer.
    unsafe {
        let m = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC);
        if m < 0 {
            return Err(io::Error::last_os_error());
        }
        let master = File::from_raw_fd(m);
        if libc::grantpt(m) < 0 || libc::unlockpt(m) < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut buf = [0 as libc::c_char; 128];
        let rc = libc::ptsname_r(m, buf.as_mut_ptr(), buf.len());
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        let name = std::ffi::CStr::from_ptr(buf.as_ptr());
        let s = libc::open(
            name.as_ptr(),
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        );
        if s < 0 {
            return Err(io::Error::last_os_error());
        }
        let slave = File::from_raw_fd(s);
        set_size(&master, size)?;
        Ok((master, slave))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exit_before_the_wait_is_not_missed() {
        let seen = exit_count();
        notify_exit(); // between the look and the wait
        let t = Instant::now();
        wait_for_exit(seen, Duration::from_secs(5));
        assert!(t.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn ended_processes_are_pruned_after_keep_ended() {
        let tmp = tempfile::tempdir().unwrap();
        let mk = |key: &str, index_holds: &str| {
            let dir = tmp.path().join(format!("k{key}"));
            fs::create_dir(&dir).unwrap();
            fs::write(dir.join("out"), b"output").unwrap();
            let index = tmp.path().join(format!("i{key}"));
            fs::write(&index, index_holds).unwrap();
            Ended {
                at: Instant::now(),
                dir,
                index,
                key: key.into(),
            }
        };
        let t0 = Instant::now();
        let mut q: VecDeque<Ended> = [mk("a", "a"), mk("b", "other")].into();
        prune(&mut q, t0);
        assert_eq!(q.len(), 2, "kept while recent");
        assert!(tmp.path().join("ka/out").exists());
        prune(&mut q, t0 + KEEP_ENDED + Duration::from_secs(1));
        assert!(q.is_empty());
        assert!(!tmp.path().join("ka").exists() && !tmp.path().join("kb").exists());
        assert!(!tmp.path().join("ia").exists(), "its own index entry goes");
        assert!(
            tmp.path().join("ib").exists(),
            "an index entry the pid's next process rewrote stays"
        );
    }
}
