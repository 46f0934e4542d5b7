//! The spawn floor: what starting a command costs inside this sandbox with nothing of torpor on
//! the path (`torpor sandbox-agent -- --torpor-spawn-floor N [--uid UID:GID] CMD ARGS...`).
//!
//! The runtime benchmark runs it inside a sandbox (itself started by one exec) and compares an
//! exec through the API with it: the difference is what torpor adds. It starts `CMD` `N` times
//! one after another, built as the agent builds an `Exec` ([`super::exec_command`]: the same
//! environment, its own process group, stdin from `/dev/null`, stdout and stderr piped; with
//! `--uid UID:GID`, as the agent starts a `Spawn` for that user, [`super::spawn`]; with
//! `--uid-std UID:GID`, through `std::process::Command` with that user, the standard library's
//! fork fallback the agent used before), reads both pipes to their end, waits
//! for the exit, and prints one JSON line: `{"spawn_us":[...]}`, one figure per start, from just
//! before the spawn to the reaped exit (after one start not counted, as a warm-up).
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
        eprintln!("usage: {FLAG} N [--uid|--uid-std UID:GID] CMD [ARGS...]");
        2
    };
    let Some(n) = args.first().and_then(|n| n.parse::<usize>().ok()) else {
        return usage();
    };
    let mut rest = &args[1..];
    let mut user = None;
    if let Some(how @ ("--uid" | "--uid-std")) = rest.first().map(String::as_str) {
        let Some(owner) = rest.get(1).and_then(|v| super::parse_owner(v)) else {
            return usage();
        };
        user = Some((owner, how == "--uid-std"));
        rest = &rest[2..];
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
        match spawn_once(rest, &env, user) {
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

/// One start: as an `Exec` (no user), as a `Spawn` for `user` (`std` false: the agent's own
/// path, [`super::spawn`]), or through `Command` with `uid`/`gid` (`std` true: the standard
/// library's fork fallback, what the agent did before).
fn spawn_once(
    cmd: &[String],
    env: &BTreeMap<String, String>,
    user: Option<(RunAs, bool)>,
) -> std::io::Result<u64> {
    let t = Instant::now();
    let none = BTreeMap::new();
    if let Some((u, false)) = user {
        let p = super::spawn::Prepared::new(cmd, env.iter(), &none, None, u, true)
            .ok_or_else(|| std::io::Error::other("--uid needs a program given as a path"))?;
        let (out_r, out_w) = super::procs::pipe()?;
        let (err_r, err_w) = super::procs::pipe()?;
        let null = std::fs::File::open("/dev/null")?;
        let pid = p.spawn(super::spawn::Stdio3 {
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
        return Ok(t.elapsed().as_micros() as u64);
    }
    let mut command = super::exec_command(cmd, env.iter(), &none, None);
    if let Some((u, _)) = user {
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
    Ok(t.elapsed().as_micros() as u64)
}
