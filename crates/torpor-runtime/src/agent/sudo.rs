//! `sudo` for templates whose commands run as a non-root user (E2B's `base`: `user`, uid
//! 1000), without a setuid binary.
//!
//! gVisor does not honour set-user-id bits (a setuid file execs with the caller's uid), and
//! torpor strips them from imported images anyway. So `sudo` is a request to a broker:
//!
//! - the broker ([`serve`], `torpor sandbox-agent -- --torpor-sudo-server USER`) is the
//!   template's main process, started as root by the agent. It lays out what the template
//!   needs (USER's home owned by USER, [`TOOLS_DIR`] with `sudo` and a `python` link to
//!   `python3` when the image has no `python`), then listens on [`SOCKET`];
//! - `sudo` ([`TOOLS_DIR`]`/sudo`) is a two-line script that runs this binary as the client
//!   ([`client`]): it sends the command, its environment and working directory, and its own
//!   stdin, stdout and stderr (`SCM_RIGHTS`) to the broker, forwards INT, TERM, HUP and QUIT,
//!   and exits with the command's status;
//! - the broker checks the caller's uid from the `SCM_CREDENTIALS` the client sends with
//!   its request, which the kernel (gVisor's sentry) checks against the sender (only USER
//!   and root are let in, as E2B's sudoers lets `user` in; gVisor's `SO_PEERCRED` names the
//!   socket's creator, not the peer, so it is not used), starts the command as the target user (root unless `-u`) with
//!   the caller's descriptors, in a process group of its own, and answers its exit status. If
//!   the client goes away first (killed), the command's group is killed.
//!
//! This is a boundary inside the sandbox only: USER may become root there, exactly as on E2B.
//! Root inside the sandbox is gVisor's root in its own user namespace, what every other torpor
//! sandbox runs as; nothing outside the sandbox is reachable through it.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// First argument that makes `sandbox-agent` the broker.
pub const SERVER_FLAG: &str = "--torpor-sudo-server";
/// First argument that makes `sandbox-agent` the `sudo` client.
pub const CLIENT_FLAG: &str = "--torpor-sudo";
/// The broker's socket inside the sandbox.
pub const SOCKET: &str = "/run/torpor/sudo.sock";
/// Where `sudo` (and `python`, when the image has none) are put; first on the template's PATH.
pub const TOOLS_DIR: &str = "/opt/torpor/bin";
/// The PATH commands run by `sudo` get (sudo's `secure_path`, with [`TOOLS_DIR`] first).
pub const SECURE_PATH: &str =
    "/opt/torpor/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The longest request (command line and environment) the broker reads.
const MAX_REQUEST: usize = 256 << 10;

/// What the client asks for.
#[derive(Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct SudoRequest {
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: String,
    /// Target user (name or `#uid`); root when absent.
    pub user: Option<String>,
    /// `-E`: keep the caller's environment.
    pub preserve_env: bool,
    /// `-i`: the target's login shell, in its home.
    pub login: bool,
    /// `-s`: the target's shell.
    pub shell: bool,
}

/// The broker's answer: the exit status (128 + signal for a signal), or why it refused.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum SudoReply {
    Exit(i32),
    Error(String),
}

/// One `/etc/passwd` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct PasswdEntry {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
    pub shell: String,
}

/// Looks a user up by name, or by `#uid`, in `passwd` (the file's text).
pub fn lookup(passwd: &str, who: &str) -> Option<PasswdEntry> {
    let by_uid = who.strip_prefix('#').and_then(|u| u.parse::<u32>().ok());
    passwd.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 7 {
            return None;
        }
        let e = PasswdEntry {
            name: f[0].to_string(),
            uid: f[2].parse().ok()?,
            gid: f[3].parse().ok()?,
            home: f[5].to_string(),
            shell: f[6].to_string(),
        };
        let hit = match by_uid {
            Some(u) => e.uid == u,
            None => e.name == who,
        };
        hit.then_some(e)
    })
}

fn passwd() -> String {
    fs::read_to_string("/etc/passwd").unwrap_or_default()
}

// ------------------------------------------------------------------ broker

/// The broker: lays out the template for `args[0]` (the user allowed to sudo) and serves
/// [`SOCKET`] until the sandbox ends.
pub fn serve(args: &[String]) -> io::Result<()> {
    let name = args
        .first()
        .ok_or_else(|| io::Error::other("usage: --torpor-sudo-server USER"))?;
    let user = lookup(&passwd(), name)
        .ok_or_else(|| io::Error::other(format!("no user {name:?} in /etc/passwd")))?;
    lay_out(&user)?;
    let dir = Path::new(SOCKET).parent().expect("socket has a parent");
    fs::create_dir_all(dir)?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755))?;
    let _ = fs::remove_file(SOCKET);
    let listener = UnixListener::bind(SOCKET)?;
    // Anyone may connect; who is let in is checked per request (SCM_CREDENTIALS).
    fs::set_permissions(SOCKET, fs::Permissions::from_mode(0o666))?;
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let allowed = user.uid;
        let _ = std::thread::Builder::new()
            .name("sudo".into())
            .spawn(move || serve_one(conn, allowed));
    }
    Ok(())
}

/// The user's home (owned by them), [`TOOLS_DIR`] with `sudo`, and `python` → `python3`
/// when the image has no `python`.
fn lay_out(user: &PasswdEntry) -> io::Result<()> {
    let home = Path::new(&user.home);
    fs::create_dir_all(home)?;
    std::os::unix::fs::chown(home, Some(user.uid), Some(user.gid))?;
    fs::set_permissions(home, fs::Permissions::from_mode(0o755))?;
    fs::create_dir_all(TOOLS_DIR)?;
    fs::set_permissions(TOOLS_DIR, fs::Permissions::from_mode(0o755))?;
    let argv = crate::rootfs::agent_argv(&[CLIENT_FLAG.to_string()]);
    let script = format!("#!/bin/sh\nexec {} \"$@\"\n", argv.join(" "));
    let sudo = Path::new(TOOLS_DIR).join("sudo");
    fs::write(&sudo, script)?;
    fs::set_permissions(&sudo, fs::Permissions::from_mode(0o755))?;
    let has_python = ["/usr/local/bin/python", "/usr/bin/python", "/bin/python"]
        .iter()
        .any(|p| Path::new(p).exists());
    let link = Path::new(TOOLS_DIR).join("python");
    if !has_python && Path::new("/usr/bin/python3").exists() && !link.exists() {
        std::os::unix::fs::symlink("/usr/bin/python3", &link)?;
    }
    Ok(())
}

/// Asks the kernel to attach the sender's credentials to what this socket receives.
fn pass_credentials(fd: RawFd) -> io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: setsockopt reads one c_int from a valid local.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PASSCRED,
            &on as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn answer(mut s: &UnixStream, reply: &SudoReply) {
    let mut line = serde_json::to_vec(reply).expect("json");
    line.push(b'\n');
    let _ = s.write_all(&line);
}

/// Who the broker serves: root and the template's user, as E2B's sudoers does.
fn may_sudo(caller: u32, allowed: u32) -> bool {
    caller == 0 || caller == allowed
}

fn serve_one(conn: UnixStream, allowed: u32) {
    if pass_credentials(conn.as_raw_fd()).is_err() {
        return answer(&conn, &SudoReply::Error("cannot tell who is asking".into()));
    }
    let (req, fds, uid) = match read_request(&conn) {
        Ok(r) => r,
        Err(e) => return answer(&conn, &SudoReply::Error(format!("bad request: {e}"))),
    };
    if !may_sudo(uid, allowed) {
        let who = lookup(&passwd(), &format!("#{uid}")).map_or(uid.to_string(), |e| e.name);
        return answer(
            &conn,
            &SudoReply::Error(format!("{who} is not in the sudoers file")),
        );
    }
    match run_request(&conn, req, fds, uid) {
        Ok(code) => answer(&conn, &SudoReply::Exit(code)),
        Err(m) => answer(&conn, &SudoReply::Error(m)),
    }
}

/// Reads `u32 LE length | JSON`, the three descriptors sent with it and the sender's uid
/// (its credentials, checked by the kernel).
fn read_request(conn: &UnixStream) -> io::Result<(SudoRequest, Vec<OwnedFd>, u32)> {
    let mut buf = vec![0u8; 64 << 10];
    let (n, fds, uid) = recv_with_fds(conn.as_raw_fd(), &mut buf)?;
    let uid = uid.ok_or_else(|| io::Error::other("the request carries no credentials"))?;
    if n < 4 {
        return Err(io::Error::other("short request"));
    }
    let len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
    if len > MAX_REQUEST {
        return Err(io::Error::other("request too large"));
    }
    let mut body = buf[4..n].to_vec();
    if body.len() < len {
        let mut rest = vec![0u8; len - body.len()];
        (&*conn).read_exact(&mut rest)?;
        body.extend_from_slice(&rest);
    }
    body.truncate(len);
    let req = serde_json::from_slice(&body).map_err(io::Error::other)?;
    if fds.len() != 3 {
        return Err(io::Error::other("stdin, stdout and stderr must be sent"));
    }
    Ok((req, fds, uid))
}

/// Space for the control messages of three descriptors and one set of credentials.
const CMSG_SPACE: usize = 128;

/// One recvmsg: the bytes read, the descriptors and the sender's uid that came with them.
fn recv_with_fds(fd: RawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>, Option<u32>)> {
    let mut cmsg = [0u8; CMSG_SPACE];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; every pointer set below is valid for its length for the
    // duration of recvmsg.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = cmsg.len() as _;
    // SAFETY: see above; MSG_CMSG_CLOEXEC keeps the received descriptors from leaking.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    let mut uid = None;
    // SAFETY: the CMSG_* macros walk the control buffer recvmsg filled, within its length.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_CREDENTIALS {
                let cred: libc::ucred =
                    std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::ucred);
                uid = Some(cred.uid);
            }
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::other("control data truncated"));
    }
    Ok((n as usize, fds, uid))
}

/// Quotes an argument for `shell -c` as sudo does: every character but letters, digits,
/// `_`, `-` and `$` escaped with a backslash.
fn shell_escape(arg: &str) -> String {
    let mut out = String::with_capacity(arg.len());
    for ch in arg.chars() {
        if !(ch.is_alphanumeric() || matches!(ch, '_' | '-' | '$')) {
            out.push('\\');
        }
        out.push(ch);
    }
    out
}

/// What the broker runs for a request.
#[derive(Debug, PartialEq)]
pub struct SudoPlan {
    pub target: PasswdEntry,
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: String,
}

/// The command line, environment and directory of a request, for `caller` (uid).
pub fn plan(req: &SudoRequest, passwd: &str, caller: u32) -> Result<SudoPlan, String> {
    let who = req.user.clone().unwrap_or_else(|| "root".into());
    let target = lookup(passwd, &who).ok_or_else(|| format!("unknown user {who}"))?;
    let by = lookup(passwd, &format!("#{caller}"));
    let shell = if target.shell.is_empty() {
        "/bin/sh".to_string()
    } else {
        target.shell.clone()
    };
    let argv: Vec<String> = if req.login || req.shell {
        let mut v = vec![shell.clone()];
        if req.login {
            v.push("-l".into());
        }
        if !req.argv.is_empty() {
            v.push("-c".into());
            let line: Vec<String> = req.argv.iter().map(|a| shell_escape(a)).collect();
            v.push(line.join(" "));
        }
        v
    } else if req.argv.is_empty() {
        return Err("a command is required (usage: sudo [-E] [-i|-s] [-u user] command)".into());
    } else {
        req.argv.clone()
    };
    let mut env = BTreeMap::new();
    for (k, v) in &req.env {
        let kept = req.preserve_env
            || matches!(
                k.as_str(),
                "TERM" | "COLORTERM" | "DISPLAY" | "LANG" | "LANGUAGE"
            )
            || k.starts_with("LC_");
        if kept {
            env.insert(k.clone(), v.clone());
        }
    }
    let mut set = |k: &str, v: String| {
        env.insert(k.to_string(), v);
    };
    set("PATH", SECURE_PATH.into());
    set("HOME", target.home.clone());
    set("USER", target.name.clone());
    set("LOGNAME", target.name.clone());
    set("SHELL", shell);
    set(
        "SUDO_USER",
        by.as_ref().map_or(caller.to_string(), |b| b.name.clone()),
    );
    set("SUDO_UID", caller.to_string());
    set(
        "SUDO_GID",
        by.as_ref()
            .map_or(caller.to_string(), |b| b.gid.to_string()),
    );
    set("SUDO_COMMAND", req.argv.join(" "));
    let cwd = if req.login {
        target.home.clone()
    } else {
        req.cwd.clone()
    };
    Ok(SudoPlan {
        target,
        argv,
        env,
        cwd,
    })
}

fn run_request(
    conn: &UnixStream,
    req: SudoRequest,
    fds: Vec<OwnedFd>,
    caller: u32,
) -> Result<i32, String> {
    let SudoPlan {
        target,
        argv,
        env,
        cwd,
    } = plan(&req, &passwd(), caller)?;
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..]).env_clear().envs(&env);
    if Path::new(&cwd).is_dir() {
        cmd.current_dir(&cwd);
    } else {
        cmd.current_dir("/");
    }
    if target.uid != 0 {
        cmd.uid(target.uid).gid(target.gid);
    }
    let mut fds = fds.into_iter();
    let (i, o, e) = (
        fds.next().expect("3 fds"),
        fds.next().expect("3 fds"),
        fds.next().expect("3 fds"),
    );
    cmd.stdin(Stdio::from(i))
        .stdout(Stdio::from(o))
        .stderr(Stdio::from(e))
        .process_group(0);
    let mut child = cmd.spawn().map_err(|e| format!("{}: {e}", argv[0]))?;
    drop(cmd);
    let pgid = child.id() as i32;
    let done = Arc::new(AtomicBool::new(false));
    // Signals the client forwards (one byte each); its going away kills the command.
    if let Ok(reader) = conn.try_clone() {
        let done = done.clone();
        let _ = std::thread::Builder::new()
            .name("sudo-signals".into())
            .spawn(move || {
                let mut byte = [0u8; 1];
                loop {
                    let n = (&reader).read(&mut byte).unwrap_or(0);
                    if done.load(Ordering::SeqCst) {
                        return;
                    }
                    let sig = if n == 0 {
                        libc::SIGKILL
                    } else {
                        byte[0] as i32
                    };
                    if matches!(
                        sig,
                        libc::SIGINT | libc::SIGTERM | libc::SIGHUP | libc::SIGQUIT | libc::SIGKILL
                    ) {
                        // SAFETY: kill(2) on the command's own process group.
                        unsafe { libc::kill(-pgid, sig) };
                    }
                    if n == 0 {
                        return;
                    }
                }
            });
    }
    let status = child.wait().map_err(|e| format!("waiting: {e}"))?;
    done.store(true, Ordering::SeqCst);
    use std::os::unix::process::ExitStatusExt;
    Ok(status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)))
}

// ------------------------------------------------------------------ client

/// The client's parsed command line.
pub fn parse_args(args: &[String]) -> Result<SudoRequest, String> {
    let mut req = SudoRequest::default();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        if a == "--" {
            i += 1;
            break;
        }
        if !a.starts_with('-') || a == "-" {
            break;
        }
        if let Some(long) = a.strip_prefix("--") {
            match long.split_once('=').map_or(long, |(k, _)| k) {
                "user" => match long.split_once('=') {
                    Some((_, v)) => req.user = Some(v.to_string()),
                    None => {
                        i += 1;
                        req.user = Some(args.get(i).ok_or("--user needs a user")?.clone());
                    }
                },
                "preserve-env" => req.preserve_env = true,
                "login" => req.login = true,
                "shell" => req.shell = true,
                "non-interactive" | "set-home" | "reset-timestamp" | "stdin" => {}
                other => return Err(format!("unrecognized option '--{other}'")),
            }
            i += 1;
            continue;
        }
        let flags: Vec<char> = a[1..].chars().collect();
        let mut j = 0;
        while j < flags.len() {
            match flags[j] {
                'u' => {
                    let rest: String = flags[j + 1..].iter().collect();
                    req.user = Some(if rest.is_empty() {
                        i += 1;
                        args.get(i)
                            .ok_or("option requires an argument -- 'u'")?
                            .clone()
                    } else {
                        rest
                    });
                    j = flags.len();
                    continue;
                }
                'E' => req.preserve_env = true,
                'i' => req.login = true,
                's' => req.shell = true,
                'n' | 'H' | 'k' | 'S' | 'P' | 'A' | 'b' => {}
                c => return Err(format!("invalid option -- '{c}'")),
            }
            j += 1;
        }
        i += 1;
    }
    req.argv = args[i..].to_vec();
    Ok(req)
}

/// The connection to the broker, for the signal handler.
static CONN_FD: AtomicI32 = AtomicI32::new(-1);

extern "C" fn forward_signal(sig: libc::c_int) {
    let fd = CONN_FD.load(Ordering::SeqCst);
    if fd >= 0 {
        let b = sig as u8;
        // SAFETY: write(2) is async-signal-safe; one byte from a valid local.
        unsafe { libc::write(fd, &b as *const u8 as *const libc::c_void, 1) };
    }
}

/// `sudo ARGS…`: asks the broker to run the command; answers the exit status.
pub fn client(args: &[String]) -> i32 {
    let first = args.first().map(String::as_str);
    match first {
        Some("-V") | Some("--version") => {
            println!("Sudo version 1.9 (torpor's sandbox sudo)");
            return 0;
        }
        Some("-l") | Some("--list") => {
            println!("User may run the following commands:\n    (ALL : ALL) NOPASSWD: ALL");
            return 0;
        }
        Some("-v") | Some("--validate") | Some("-K") => return 0,
        _ => {}
    }
    let mut req = match parse_args(args) {
        Ok(r) => r,
        Err(m) => {
            eprintln!("sudo: {m}");
            return 1;
        }
    };
    req.env = std::env::vars_os()
        .map(|(k, v)| {
            (
                k.to_string_lossy().into_owned(),
                v.to_string_lossy().into_owned(),
            )
        })
        .collect();
    req.cwd = std::env::current_dir()
        .map(|d| d.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "/".into());
    let conn = match UnixStream::connect(SOCKET) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("sudo: the sandbox's sudo service is not reachable ({SOCKET}: {e})");
            return 1;
        }
    };
    let body = serde_json::to_vec(&req).expect("json");
    let mut msg = (body.len() as u32).to_le_bytes().to_vec();
    msg.extend_from_slice(&body);
    if let Err(e) = send_with_fds(&conn, &msg) {
        eprintln!("sudo: cannot reach the sudo service: {e}");
        return 1;
    }
    CONN_FD.store(conn.as_raw_fd(), Ordering::SeqCst);
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
        // SAFETY: installs a handler that only calls write(2).
        unsafe { libc::signal(sig, forward_signal as *const () as libc::sighandler_t) };
    }
    let mut line = String::new();
    let mut reader = BufReader::new(&conn);
    loop {
        match reader.read_line(&mut line) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            _ => break,
        }
    }
    match serde_json::from_str::<SudoReply>(line.trim()) {
        Ok(SudoReply::Exit(code)) => code,
        Ok(SudoReply::Error(m)) => {
            eprintln!("sudo: {m}");
            1
        }
        Err(_) => {
            eprintln!("sudo: the sudo service ended without an answer");
            1
        }
    }
}

/// Sends `msg` with this process's stdin, stdout and stderr attached (the first chunk
/// carries them), then the rest of `msg`.
fn send_with_fds(conn: &UnixStream, msg: &[u8]) -> io::Result<()> {
    let fds: [RawFd; 3] = [0, 1, 2];
    let mut cmsg = [0u8; CMSG_SPACE];
    let mut iov = libc::iovec {
        iov_base: msg.as_ptr() as *mut libc::c_void,
        iov_len: msg.len(),
    };
    // SAFETY: msghdr is plain data; the pointers set below are valid for their lengths for the
    // duration of sendmsg, and the control message is built within `cmsg` by the CMSG macros.
    let sent = unsafe {
        let mut m: libc::msghdr = std::mem::zeroed();
        m.msg_iov = &mut iov;
        m.msg_iovlen = 1;
        m.msg_control = cmsg.as_mut_ptr() as *mut libc::c_void;
        let payload = std::mem::size_of_val(&fds) as u32;
        let cred_len = std::mem::size_of::<libc::ucred>() as u32;
        m.msg_controllen = (libc::CMSG_SPACE(payload) + libc::CMSG_SPACE(cred_len)) as _;
        let c = libc::CMSG_FIRSTHDR(&m);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(payload) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c) as *mut RawFd, 3);
        // Who is asking, as the kernel lets the sender say it (its own ids only).
        let c = libc::CMSG_NXTHDR(&m, c);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_CREDENTIALS;
        (*c).cmsg_len = libc::CMSG_LEN(cred_len) as _;
        let cred = libc::ucred {
            pid: libc::getpid(),
            uid: libc::getuid(),
            gid: libc::getgid(),
        };
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut libc::ucred, cred);
        libc::sendmsg(conn.as_raw_fd(), &m, 0)
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    (&*conn).write_all(&msg[sent as usize..])
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str =
        "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n";

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn the_command_line_parses_as_sudo_reads_it() {
        let r = parse_args(&s(&["apt-get", "install", "-y", "x"])).unwrap();
        assert_eq!(r.argv, s(&["apt-get", "install", "-y", "x"]));
        assert_eq!(r.user, None);
        let r = parse_args(&s(&["-E", "-u", "user", "--", "id", "-u"])).unwrap();
        assert!(r.preserve_env);
        assert_eq!(r.user.as_deref(), Some("user"));
        assert_eq!(r.argv, s(&["id", "-u"]));
        let r = parse_args(&s(&["-Euuser", "whoami"])).unwrap();
        assert_eq!((r.user.as_deref(), r.argv), (Some("user"), s(&["whoami"])));
        let r = parse_args(&s(&["--user=#0", "-i"])).unwrap();
        assert!(r.login && r.argv.is_empty());
        assert!(parse_args(&s(&["-Z", "x"])).is_err());
        assert!(parse_args(&s(&["-u"])).is_err());
    }

    #[test]
    fn a_request_becomes_the_target_users_command_with_a_reset_environment() {
        let req = SudoRequest {
            argv: s(&["id", "-u"]),
            env: [
                ("SECRET".to_string(), "x".to_string()),
                ("TERM".to_string(), "xterm".to_string()),
            ]
            .into(),
            cwd: "/home/user".into(),
            ..Default::default()
        };
        let SudoPlan {
            target,
            argv,
            env,
            cwd,
        } = plan(&req, PASSWD, 1000).unwrap();
        assert_eq!(
            (target.uid, argv, cwd.as_str()),
            (0, s(&["id", "-u"]), "/home/user")
        );
        assert_eq!(env["HOME"], "/root");
        assert_eq!(env["SUDO_USER"], "user");
        assert_eq!(env["TERM"], "xterm");
        assert!(!env.contains_key("SECRET"), "env_reset drops the rest");
        let req = SudoRequest {
            argv: s(&["echo", "a b"]),
            login: true,
            preserve_env: true,
            env: [("SECRET".to_string(), "x".to_string())].into(),
            ..Default::default()
        };
        let SudoPlan { argv, env, cwd, .. } = plan(&req, PASSWD, 1000).unwrap();
        assert_eq!(argv, s(&["/bin/sh", "-l", "-c", "echo a\\ b"]));
        assert_eq!((env["SECRET"].as_str(), cwd.as_str()), ("x", "/root"));
        let req = SudoRequest {
            argv: s(&["x"]),
            user: Some("nobody-here".into()),
            ..Default::default()
        };
        assert!(plan(&req, PASSWD, 1000).is_err());
        assert!(plan(&SudoRequest::default(), PASSWD, 1000).is_err());
    }

    #[test]
    fn only_root_and_the_templates_user_may_sudo() {
        assert!(may_sudo(0, 1000) && may_sudo(1000, 1000));
        assert!(!may_sudo(1001, 1000) && !may_sudo(65534, 1000));
    }

    #[test]
    fn passwd_lookups_by_name_and_uid() {
        assert_eq!(lookup(PASSWD, "user").unwrap().uid, 1000);
        assert_eq!(lookup(PASSWD, "#0").unwrap().name, "root");
        assert!(lookup(PASSWD, "#7").is_none());
    }

    #[test]
    fn a_caller_outside_the_allowed_user_is_refused_by_the_broker() {
        // Over a real socket pair, the caller's uid as the kernel vouches for it.
        let body = serde_json::to_vec(&SudoRequest {
            argv: s(&["true"]),
            ..Default::default()
        })
        .unwrap();
        let mut msg = (body.len() as u32).to_le_bytes().to_vec();
        msg.extend_from_slice(&body);
        let refused = |reply: &[u8]| reply.windows(7).any(|w| w == b"sudoers");
        // SAFETY: getuid has no preconditions.
        let me = unsafe { libc::getuid() };
        if me != 0 {
            // Not root: this process is the outsider.
            let (a, b) = UnixStream::pair().unwrap();
            let t = std::thread::spawn(move || serve_one(b, me + 1));
            send_with_fds(&a, &msg).unwrap();
            let mut line = String::new();
            BufReader::new(&a).read_line(&mut line).unwrap();
            t.join().unwrap();
            assert!(refused(line.as_bytes()), "{line}");
            return;
        }
        // Root (how the suite runs): a child that drops to uid 4242 asks; then root asks.
        let (a, b) = UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || serve_one(b, 1000));
        // SAFETY: the child only makes syscalls on memory prepared before the fork (no
        // allocation, no lock) and leaves with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            unsafe {
                if libc::setgid(4242) != 0 || libc::setuid(4242) != 0 {
                    libc::_exit(3);
                }
                if send_with_fds(&a, &msg).is_err() {
                    libc::_exit(4);
                }
                let mut buf = [0u8; 512];
                let mut n = 0usize;
                while n < buf.len() && !buf[..n].contains(&b'\n') {
                    let r = libc::read(
                        a.as_raw_fd(),
                        buf.as_mut_ptr().add(n) as *mut libc::c_void,
                        buf.len() - n,
                    );
                    if r <= 0 {
                        break;
                    }
                    n += r as usize;
                }
                libc::_exit(if refused(&buf[..n]) { 0 } else { 5 });
            }
        }
        let mut status = 0;
        // SAFETY: waitpid on our own child with a valid pointer.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        t.join().unwrap();
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "uid 4242 was not refused (child status {status})"
        );
        let (a, b) = UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || serve_one(b, 1000));
        send_with_fds(&a, &msg).unwrap();
        let mut line = String::new();
        BufReader::new(&a).read_line(&mut line).unwrap();
        t.join().unwrap();
        let reply: SudoReply = serde_json::from_str(line.trim()).unwrap();
        assert_eq!(reply, SudoReply::Exit(0), "root may always");
    }
}
