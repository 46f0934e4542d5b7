//! Live restore: one small supervisor ("shim") per container, so that sandboxes outlive the
//! daemon.
//!
//! ```text
//!   daemon ──unix socket (agent frames)──▶ torpor shim ──pipes (stdin/stdout)──▶ runsc run|restore ─▶ agent
//! ```
//!
//! The container's stdio is the agent channel: the one channel that survives checkpoint and
//! restore here (see [`crate::runsc`]). A pipe breaks when the process holding its other end
//! dies, so the daemon does not hold it: `torpor shim`, a process in a session of its own started
//! for each container by [`command`], does. It relays whole frames between the daemon's
//! connection and the container's stdio and outlives the daemon. A daemon that restarts (a crash,
//! a SIGKILL, an upgrade) finds the shims of its data directory ([`scan`]), connects to each
//! ([`connect`]) and has its containers back with their memory, processes and work in flight.
//!
//! What keeps the channel sound across a daemon's death:
//! - Only whole frames cross: what a dead daemon half-wrote is dropped, never half-delivered.
//! - Each connection starts with the first request id it will use (8 bytes, little endian);
//!   replies to lower ids (requests of an earlier daemon) are dropped. Ids start from the wall
//!   clock in nanoseconds ([`first_request_id`]), so a later daemon's are higher.
//! - When the container's runsc process exits, the shim writes its status to `exit.json`, then
//!   closes the connection and exits: the daemon reads the status after the end of the stream, or
//!   finds it in the directory when it restarts. A shim that is gone without one was killed; its
//!   container went with it (the agent's stdin closed).
//! - It listens on an abstract Unix socket (no path-length limit, nothing left on disk) and
//!   accepts only processes of its own user (SO_PEERCRED): a sandbox cannot reach it (gVisor's
//!   network stack is its own), and another local user cannot talk to an agent through it.
//!
//! Files, under `<data dir>/shims/<container id>/`: `pid` (the shim's, written first),
//! `meta.json` (what the daemon needs to take the container back; written once its agent
//! answered) and `exit.json`.

use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::proto;
use crate::runsc::ExitInfo;

const PID: &str = "pid";
const META: &str = "meta.json";
const EXIT: &str = "exit.json";
/// The descriptor of the daemon's first connection in a freshly started shim.
const INHERITED_FD: i32 = 3;
/// Milliseconds a shim lets its container run with no daemon attached ([`Shims::fence`]).
pub const ENV_FENCE_MS: &str = "TORPOR_SHIM_FENCE_MS";

/// What a daemon needs to take a running container back from its shim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimMeta {
    pub container_id: String,
    /// The container's cgroup: its warm worker's, or its own id (a template build).
    pub cgroup: String,
    /// The warm worker it runs on; `None` for a template build (its own bundle).
    pub worker: Option<String>,
    /// Whether it runs with a network (`--network=sandbox`).
    pub networked: bool,
    /// Its worker's network (namespaces named after the worker), when it has one.
    #[serde(default)]
    pub net: Option<ShimNet>,
    /// Whether it was given devices (GPUs).
    pub devices: bool,
    /// The protocol version its agent said hello with.
    pub agent_version: u32,
    pub shim_pid: u32,
    /// The shim's abstract socket name.
    pub socket: String,
}

/// A worker network's names and addresses, as [`crate::net::WorkerNet::adopt`] needs them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimNet {
    pub host_link: String,
    pub host_addr: std::net::Ipv4Addr,
    pub router_addr: std::net::Ipv4Addr,
}

#[derive(Serialize, Deserialize)]
struct ExitRecord {
    code: Option<i32>,
    signal: Option<i32>,
}

/// Where a daemon keeps its shims' directories, and how it names their sockets.
#[derive(Debug, Clone)]
pub struct Shims {
    /// `torpor-shim`, or the `torpor` binary (`torpor shim` is a hidden subcommand): both
    /// take the same arguments.
    pub binary: PathBuf,
    pub dir: PathBuf,
    /// Unique to the directory, so daemons on one host never share a socket name.
    tag: String,
    /// How long a container may run with no daemon attached before its shim ends it
    /// (`None`: for ever). A cluster worker sets it below the controllers' loss limit, so a
    /// container whose worker is gone ends before its sandbox resumes elsewhere.
    pub fence: Option<Duration>,
}

impl Shims {
    pub fn new(binary: PathBuf, dir: PathBuf) -> io::Result<Shims> {
        std::fs::create_dir_all(&dir)?;
        let abs = std::fs::canonicalize(&dir).unwrap_or_else(|_| dir.clone());
        let mut h: u64 = 0xcbf2_9ce4_8422_2325; // FNV-1a: stable across runs and builds
        for b in abs.as_os_str().as_encoded_bytes() {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        Ok(Shims {
            binary,
            dir,
            tag: format!("{h:016x}"),
            fence: None,
        })
    }

    pub fn dir_of(&self, container_id: &str) -> PathBuf {
        self.dir.join(container_id)
    }

    pub fn socket_of(&self, container_id: &str) -> String {
        format!("torpor-shim/{}/{container_id}", self.tag)
    }

    /// The command that starts a shim for one container: `runsc` with `runsc_args` under it.
    /// The caller adds the connection ([`pass_connection`]) and its stdio (stderr: the
    /// container's log).
    pub fn command(
        &self,
        container_id: &str,
        runsc: &Path,
        runsc_args: &[String],
    ) -> io::Result<tokio::process::Command> {
        let dir = self.dir_of(container_id);
        // A container id is fresh for every start; whatever is here is from a failed start.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let mut cmd = tokio::process::Command::new(&self.binary);
        cmd.arg("shim")
            .arg("--dir")
            .arg(&dir)
            .arg("--socket")
            .arg(self.socket_of(container_id))
            .arg("--")
            .arg(runsc)
            .args(runsc_args);
        if let Some(f) = self.fence {
            cmd.env(ENV_FENCE_MS, f.as_millis().to_string());
        }
        Ok(cmd)
    }

    /// Records what a later daemon needs to take the container back.
    pub fn write_meta(&self, meta: &ShimMeta) -> io::Result<()> {
        let dir = self.dir_of(&meta.container_id);
        write_atomic(
            &dir.join(META),
            &serde_json::to_vec(meta).expect("meta serialises"),
        )
    }

    /// How the container's runsc process ended, if its shim recorded it; the directory is
    /// removed once read.
    pub fn take_exit(&self, container_id: &str) -> Option<ExitInfo> {
        let dir = self.dir_of(container_id);
        let rec: ExitRecord = serde_json::from_slice(&std::fs::read(dir.join(EXIT)).ok()?).ok()?;
        let _ = std::fs::remove_dir_all(&dir);
        Some(ExitInfo {
            code: rec.code,
            signal: rec.signal,
            oom_killed: false,
        })
    }

    /// The shims a previous run of this daemon left: those alive with a recorded container
    /// (`survivors`) and the pids of the others still alive (`strays`: started but never
    /// recorded, so their container was still starting). Directories of dead shims are removed.
    pub fn scan(&self) -> Scan {
        let mut scan = Scan::default();
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return scan;
        };
        for e in entries.flatten() {
            let dir = e.path();
            let pid = std::fs::read_to_string(dir.join(PID))
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok())
                .filter(|pid| is_shim_of(*pid, &dir));
            let meta = std::fs::read(dir.join(META))
                .ok()
                .and_then(|b| serde_json::from_slice::<ShimMeta>(&b).ok());
            match (pid, meta) {
                (Some(pid), Some(meta)) if meta.shim_pid == pid => scan.survivors.push(meta),
                (Some(pid), meta) => {
                    tracing::info!(shim = %dir.display(), pid, recorded = meta.is_some(),
                        "a shim of the previous run has no matching record (its container was still starting, or its record is unreadable); it is ended");
                    scan.strays.push(pid)
                }
                (None, meta) => {
                    if meta.is_some() {
                        tracing::warn!(shim = %dir.display(),
                            "a shim of the previous run is gone, and its container with it");
                    }
                    let _ = std::fs::remove_dir_all(&dir);
                }
            }
        }
        scan
    }
}

/// What [`Shims::scan`] found.
#[derive(Debug, Default)]
pub struct Scan {
    pub survivors: Vec<ShimMeta>,
    pub strays: Vec<u32>,
}

/// Whether `pid` is a live shim working in `dir` (a recycled pid is not).
fn is_shim_of(pid: u32, dir: &Path) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    args.contains(&b"shim".as_slice()) && args.contains(&dir.as_os_str().as_encoded_bytes())
}

/// Kills a shim and what runs under it in its session (its runsc process).
pub fn kill(pid: u32) {
    // SAFETY: kill(2) with a pid (and its process group: a shim leads its own session) that
    // scan() checked is a shim; no memory is passed.
    unsafe {
        libc::kill(-(pid as i32), libc::SIGKILL);
        libc::kill(pid as i32, libc::SIGKILL);
    }
}

/// The first request id for a connection made now: the wall clock in nanoseconds, so that every
/// later connection's ids are higher than an earlier one's.
pub fn first_request_id() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
        .max(1)
}

/// A connection to a container's shim, given the first request id it will use.
pub fn connect(socket: &str, first_id: u64) -> io::Result<UnixStream> {
    let mut s = UnixStream::connect_addr(&SocketAddr::from_abstract_name(socket.as_bytes())?)?;
    announce(&mut s, first_id)?;
    Ok(s)
}

/// Makes `theirs` the started shim's first connection (its descriptor 3) and puts the shim in a
/// session of its own, so that signals for the daemon's group (a terminal's Ctrl-C, a service
/// manager's stop) do not reach it. The daemon keeps the other end and [`announce`]s on it.
pub fn pass_connection(cmd: &mut tokio::process::Command, theirs: &UnixStream) {
    let fd = theirs.as_raw_fd();
    // SAFETY: between fork and exec only async-signal-safe calls run (dup2, fcntl, setsid) on a
    // descriptor this process owns; no allocation, no locks.
    unsafe {
        cmd.pre_exec(move || {
            if fd == INHERITED_FD {
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
            } else if libc::dup2(fd, INHERITED_FD) != INHERITED_FD {
                return Err(io::Error::last_os_error());
            }
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Tells the shim at the other end of `ours` the first request id this connection will use.
pub fn announce(ours: &mut UnixStream, first_id: u64) -> io::Result<()> {
    ours.write_all(&first_id.to_le_bytes())
}

fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// `torpor shim`: runs `command` (runsc) and relays its stdio until it exits. Returns the
/// shim's exit code.
pub fn run(dir: PathBuf, socket: String, command: Vec<OsString>) -> io::Result<i32> {
    // One malloc arena for all threads: a shim's threads each move a frame at a time, and an
    // arena per thread would be memory per resident sandbox for nothing.
    // SAFETY: mallopt only sets an allocator parameter; called before any other thread exists.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
    // SAFETY: the daemon passed the first connection as descriptor 3 (pass_connection); nothing
    // else in this process owns it.
    let first = unsafe { UnixStream::from_raw_fd(INHERITED_FD) };
    // SAFETY: fcntl on the descriptor just taken over; children must not inherit it.
    unsafe { libc::fcntl(INHERITED_FD, libc::F_SETFD, libc::FD_CLOEXEC) };
    write_atomic(&dir.join(PID), std::process::id().to_string().as_bytes())?;
    let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(socket.as_bytes())?)?;
    let (program, args) = command
        .split_first()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no command to supervise"))?;
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let stdin = child.stdin.take().expect("piped stdin");
    let stdout = child.stdout.take().expect("piped stdout");
    let relay = Arc::new(Relay {
        stdin: Mutex::new(stdin),
        generation: AtomicU64::new(0),
        current: Mutex::new(None),
    });
    relay.attach(first);
    if let Some(fence) = std::env::var(ENV_FENCE_MS)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_millis)
    {
        let watched = relay.clone();
        std::thread::spawn(move || watched.fence(fence));
    }
    let accepting = relay.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            if same_user(&conn) {
                accepting.attach(conn);
            }
        }
    });
    let (pumped, done) = mpsc::channel();
    let replies = relay.clone();
    std::thread::spawn(move || {
        replies.pump_replies(stdout);
        let _ = pumped.send(());
    });
    let status = child.wait()?;
    // The agent's last replies are on their way out; do not cut them off.
    let _ = done.recv_timeout(Duration::from_millis(500));
    use std::os::unix::process::ExitStatusExt;
    let record = ExitRecord {
        code: status.code(),
        signal: status.signal(),
    };
    write_atomic(
        &dir.join(EXIT),
        &serde_json::to_vec(&record).expect("exit record serialises"),
    )?;
    relay.close();
    Ok(0)
}

/// The daemon connection now served, and the first request id it announced.
struct Attached {
    generation: u64,
    out: UnixStream,
    first_id: u64,
}

struct Relay {
    stdin: Mutex<std::process::ChildStdin>,
    /// Bumped by every new connection; an older connection's requests stop at the next frame.
    generation: AtomicU64,
    current: Mutex<Option<Attached>>,
}

impl Relay {
    fn lock_current(&self) -> std::sync::MutexGuard<'_, Option<Attached>> {
        self.current.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Serves `conn` from now on (a daemon that came back); the previous one is closed.
    fn attach(self: &Arc<Self>, mut conn: UnixStream) {
        let mut first = [0u8; 8];
        if conn.read_exact(&mut first).is_err() {
            return;
        }
        let Ok(out) = conn.try_clone() else {
            return;
        };
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(old) = self.lock_current().replace(Attached {
            generation,
            out,
            first_id: u64::from_le_bytes(first),
        }) {
            let _ = old.out.shutdown(std::net::Shutdown::Both);
        }
        let me = self.clone();
        std::thread::spawn(move || me.pump_requests(conn, generation));
    }

    /// Daemon → agent, whole frames, while `generation` is the current connection.
    fn pump_requests(&self, mut conn: UnixStream, generation: u64) {
        while let Ok(frame) = read_frame(&mut conn) {
            if self.generation.load(Ordering::SeqCst) != generation {
                break;
            }
            let mut stdin = self.stdin.lock().unwrap_or_else(|p| p.into_inner());
            if stdin.write_all(&frame.bytes).is_err() {
                break; // the container is gone; the exit closes the connection
            }
        }
        let mut current = self.lock_current();
        if current.as_ref().is_some_and(|a| a.generation == generation) {
            *current = None;
        }
    }

    /// Agent → daemon: every frame is read (so the agent never blocks on a daemon that is
    /// away); those for the current connection's requests are passed on.
    fn pump_replies(&self, mut stdout: std::process::ChildStdout) {
        while let Ok(frame) = read_frame(&mut stdout) {
            let mut current = self.lock_current();
            let Some(attached) = current.as_mut() else {
                continue;
            };
            if frame.id.is_some_and(|id| id >= attached.first_id)
                && attached.out.write_all(&frame.bytes).is_err()
            {
                *current = None;
            }
        }
    }

    /// Ends the shim, and with it the container (the agent's stdin closes, so the agent and
    /// the container exit), once no daemon has been attached for `fence`: a container whose
    /// daemon is gone for good must not keep running while its sandbox resumes elsewhere.
    fn fence(&self, fence: Duration) -> ! {
        let tick = (fence / 10).clamp(Duration::from_millis(20), Duration::from_millis(250));
        let mut alone_since: Option<std::time::Instant> = None;
        loop {
            std::thread::sleep(tick);
            if self.lock_current().is_some() {
                alone_since = None;
                continue;
            }
            let since = *alone_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() >= fence {
                eprintln!(
                    "torpor shim: no daemon attached for {} ms; ending the container",
                    fence.as_millis()
                );
                std::process::exit(3);
            }
        }
    }

    fn close(&self) {
        if let Some(mut a) = self.lock_current().take() {
            let _ = a.out.flush();
            let _ = a.out.shutdown(std::net::Shutdown::Both);
        }
    }
}

struct RawFrame {
    bytes: Vec<u8>,
    /// The request id in its header; `None` when the header has none (it is not passed on).
    id: Option<u64>,
}

#[derive(Deserialize)]
struct IdOnly {
    id: u64,
}

fn read_frame(r: &mut impl Read) -> Result<RawFrame, proto::FrameError> {
    let mut prefix = [0u8; 8];
    r.read_exact(&mut prefix)?;
    let (hlen, blen) = proto::parse_prefix(prefix)?;
    let mut bytes = vec![0u8; 8 + hlen + blen];
    bytes[..8].copy_from_slice(&prefix);
    r.read_exact(&mut bytes[8..])?;
    let id = serde_json::from_slice::<IdOnly>(&bytes[8..8 + hlen])
        .ok()
        .map(|h| h.id);
    Ok(RawFrame { bytes, id })
}

/// Whether the peer runs as this process's user (SO_PEERCRED).
fn same_user(conn: &UnixStream) -> bool {
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: u32::MAX,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, a ucred on our stack.
    let rc = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    // SAFETY: geteuid has no failure mode.
    rc == 0 && cred.uid == unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(id: u64, body: &[u8]) -> Vec<u8> {
        proto::encode(id, &serde_json::json!({"type": "x"}), body).unwrap()
    }

    #[test]
    fn frames_keep_their_bytes_and_ids() {
        let mut bytes = frame(42, b"body");
        bytes.extend(frame(7, b""));
        let mut r = io::Cursor::new(bytes.clone());
        let a = read_frame(&mut r).unwrap();
        let b = read_frame(&mut r).unwrap();
        assert_eq!((a.id, b.id), (Some(42), Some(7)));
        assert_eq!([a.bytes, b.bytes].concat(), bytes);
        assert!(read_frame(&mut r).is_err());
    }

    #[test]
    fn a_half_written_frame_is_not_a_frame() {
        let bytes = frame(1, b"0123456789");
        let mut r = io::Cursor::new(bytes[..bytes.len() - 3].to_vec());
        assert!(read_frame(&mut r).is_err());
    }

    #[test]
    fn first_ids_grow_across_connections() {
        let a = first_request_id();
        std::thread::sleep(Duration::from_millis(2));
        assert!(first_request_id() > a);
    }
}
