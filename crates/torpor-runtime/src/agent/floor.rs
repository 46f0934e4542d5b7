//! The spawn floor: what starting a command costs inside this sandbox with nothing of torpor on
//! the path (`torpor sandbox-agent -- --torpor-spawn-floor N [--uid UID:GID] CMD ARGS...`).
//!
//! The runtime benchmark runs it inside a sandbox (itself started by one exec) and compares an
//! exec through the API with it: the difference is what torpor adds. It starts `CMD` `N` times
//! one after another, built as the agent builds an `Exec` ([`super::exec_command`]: the same
//! environment, its own process group, stdin from `/dev/null`, stdout and stderr piped; with
//! `--uid`, as the agent builds a `Spawn` for that user), reads both pipes to their end, waits
//! for the exit, and prints one JSON line: `{"spawn_us":[...]}`, one figure per start, from just
//! before the spawn to the reaped exit (after one start not counted, as a warm-up).
//!
//! Nothing here is reachable from a request: it is a command line a caller of exec could run
//! anyway (the agent binary is in every sandbox), and it runs with that caller's rights.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::time::Instant;

use crate::proto::RunAs;

/// First argument that makes `sandbox-agent` the spawn floor.
pub const FLAG: &str = "--torpor-spawn-floor";

/// Runs the floor for `args` (after [`FLAG`]); the process's exit status.
pub fn run(args: &[String]) -> i32 {
    let usage = || {
        eprintln!("usage: {FLAG} N [--uid UID:GID] CMD [ARGS...]");
        2
    };
    let Some(n) = args.first().and_then(|n| n.parse::<usize>().ok()) else {
        return usage();
    };
    let mut rest = &args[1..];
    let mut user = None;
    if rest.first().map(String::as_str) == Some("--uid") {
        let Some(owner) = rest.get(1).and_then(|v| super::parse_owner(v)) else {
            return usage();
        };
        user = Some(owner);
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

fn spawn_once(
    cmd: &[String],
    env: &BTreeMap<String, String>,
    user: Option<RunAs>,
) -> std::io::Result<u64> {
    let t = Instant::now();
    let mut command = super::exec_command(cmd, env.iter(), &BTreeMap::new(), None);
    if let Some(u) = user {
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
