//! The spawn floor: what starting a command costs inside this sandbox with nothing of torpor on
//! the path (`torpor sandbox-agent -- --torpor-spawn-floor N [--uid UID:GID] CMD ARGS...`).
//!
//! The runtime benchmark runs it inside a sandbox (itself started by one exec) and compares an
//! exec through the API with it: the difference is what torpor adds. It starts `CMD` `N` times
//! one after another, started as the agent starts an `Exec` ([`super::start_exec`]: the same
//! environment, its own process group, stdin from `/dev/null`, stdout and stderr piped, started
//! with `clone(CLONE_VM|CLONE_VFORK)` by [`super::spawn`]; with `--std`, through `std::process::Command`
//! built the same way, glibc's `posix_spawn`, as the agent started an `Exec` before; with `--uid
//! UID:GID`, as the agent starts a `Spawn` for that user, [`super::spawn`]; with `--uid-std
//! UID:GID`, through `Command` with that user, the standard library's fork fallback the agent
//! used before), reads both pipes to their end, waits for the exit, and prints one JSON line:
//! `{"spawn_us":[...]}`, one figure per start, from just before the spawn to the reaped exit
//! (after one start not counted, as a warm-up).
//!
//! Nothing here is reachable from a request: it is a command line a caller of exec could run
//! anyway (the agent binary is in every sandbox), and it runs with that caller's rights.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::time::Instant;

use crate::proto::RunAs;

/// First argument that makes `sandbox-agent` the spawn floor.
pub const FLAG: &str = "--torpor-spawn-floor";

/// Runs the floor for `args` (after [`FLAG`]); the process's exit status.
pub fn run(args: &[String]) -> i32 {
    let usage = || {
        eprintln!("usage: {FLAG} N [--std | --uid UID:GID | --uid-std UID:GID] CMD [ARGS...]");
        2
    };
    let Some(n) = args.first().and_then(|n| n.parse::<usize>().ok()) else {
        return usage();
    };
    let mut rest = &args[1..];
    let mut how = How::Exec;
    match rest.first().map(String::as_str) {
        Some("--std") => {
            how = How::ExecStd;
            rest = &rest[1..];
        }
        Some(flag @ ("--uid" | "--uid-std")) => {
            let Some(owner) = rest.get(1).and_then(|v| super::parse_owner(v)) else {
                return usage();
            };
            how = if flag == "--uid" {
                How::User(owner)
            } else {
                How::UserStd(owner)
            };
            rest = &rest[2..];
        }
        _ => {}
    }
    if rest.is_empty() {
        return usage();
    }
    // The environment the agent would give the command: this process's own (what the exec
    // that started it was given).
    let env: BTreeMap<String, String> = std::env::vars().collect();
    let mut times = Vec::with_capacity(n);
    // One start first, not counted: this process's first touches of the spawn path's code and
    // data (page faults, each a trap to gVisor's kernel) are not the floor, and the agent,
    // long running, has paid them already.
    for i in 0..=n {
        match spawn_once(rest, &env, how) {
            Ok(us) if i > 0 => times.push(us),
            Ok(_) => {}
            Err(e) => {
                eprintln!("cannot start {:?}: {e}", rest[0]);
                return 1;
            }
        }
    }
    println!("{}", serde_json::json!({ "spawn_us": times }));
    0
}

/// How the floor starts its command.
#[derive(Clone, Copy)]
enum How {
    /// As the agent starts an `Exec`.
    Exec,
    /// Through `std::process::Command` (glibc's `posix_spawn`): how the agent started an
    /// `Exec` before.
    ExecStd,
    /// As the agent starts a `Spawn` for this user.
    User(RunAs),
    /// Through `Command` with this user (the standard library's fork fallback).
    UserStd(RunAs),
}

/// One start, timed from just before it to its reaped exit.
fn spawn_once(cmd: &[String], env: &BTreeMap<String, String>, how: How) -> std::io::Result<u64> {
    let t = Instant::now();
    let none = BTreeMap::new();
    let prepared = |user| {
        super::spawn::Prepared::new(cmd, env.iter(), &none, None, user, true)
            .ok_or_else(|| std::io::Error::other("a NUL byte in the command"))
    };
    match how {
        How::Exec => {
            let p = prepared(None)?;
            let (pid, io) = super::start_exec(Vec::new(), |stdio| p.spawn(stdio))?;
            let mut sink = Vec::new();
            for mut p in [io.stdout, io.stderr].into_iter().flatten() {
                p.read_to_end(&mut sink)?;
            }
            let mut status = 0;
            // SAFETY: waitpid on our own child with a valid pointer.
            unsafe { libc::waitpid(pid as i32, &mut status, 0) };
        }
        How::User(u) => {
            let (out_r, out_w) = super::procs::pipe()?;
            let (err_r, err_w) = super::procs::pipe()?;
            let null = std::fs::File::open("/dev/null")?;
            let pid = prepared(Some(u))?.spawn(super::spawn::Stdio3 {
                stdin: null.as_raw_fd(),
                stdout: out_w.as_raw_fd(),
                stderr: err_w.as_raw_fd(),
            })?;
            drop((null, out_w, err_w));
            let mut sink = Vec::new();
            (&out_r).read_to_end(&mut sink)?;
            (&err_r).read_to_end(&mut sink)?;
            let mut status = 0;
            // SAFETY: waitpid on our own child with a valid pointer.
            unsafe { libc::waitpid(pid as i32, &mut status, 0) };
        }
        How::ExecStd | How::UserStd(_) => {
            let mut command = super::exec_command(cmd, env.iter(), &none, None);
            if let How::UserStd(u) = how {
                command.uid(u.uid).gid(u.gid);
            }
            command
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let mut child = command.spawn()?;
            let mut sink = Vec::new();
            if let Some(mut out) = child.stdout.take() {
                out.read_to_end(&mut sink)?;
            }
            if let Some(mut err) = child.stderr.take() {
                err.read_to_end(&mut sink)?;
            }
            child.wait()?;
        }
    }
    Ok(t.elapsed().as_micros() as u64)
}
