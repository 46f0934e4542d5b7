//! Starting a command without copying the agent: `clone(CLONE_VM | CLONE_VFORK)`, the child
//! sets itself up with raw syscalls (dropping to another user when asked), then `execve`.
//!
//! Why: under gVisor's ptrace platform every system call is a round trip to gVisor's kernel
//! (~60 µs on the machines measured), so a spawn costs what its system calls number. The
//! standard library starts a command with glibc's `posix_spawn`, whose child walks every signal
//! (64 `rt_sigaction` reads, and a write for each handled one) and whose parent checks each
//! file action against `RLIMIT_NOFILE` and maps a stack per call: ~80 system calls before the
//! `execve`, where this child makes 7. For a command with a user it falls back to `fork`: a copy
//! of the agent's address space that gVisor makes expensive. glibc's `posix_spawn` has no "as
//! this user" attribute, so this is the same technique, with the credentials step added.
//!
//! What the child does is what `std::process::Command` does for a command with `process_group(0)`
//! (and `uid`, `gid` when a user is given), in its order: signal mask emptied and `SIGPIPE` back
//! to its default (at the end, so nothing is delivered before the `execve`; handlers the agent
//! set are reset by the `execve` itself, and `SIGPIPE` is the only signal the agent ignores), its
//! own process group, the supplementary groups dropped (the agent is root), the group then the
//! user set, the working directory, the three standard descriptors, `execve` (with `execvp`'s
//! search of `PATH` for a program named without a `/`, and `/bin/sh` for a script without `#!`).
//! Every step in the child is a raw syscall: it runs on the agent's memory (parent suspended), so
//! it must not take a lock, allocate, or call glibc's `setuid`, which in a threaded process
//! signals every thread of the agent to change theirs.
//!
use std::collections::BTreeMap;
use std::ffi::{CString, OsString};
use std::io;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicI32, Ordering};

use crate::proto::RunAs;

const SH: &std::ffi::CStr = c"/bin/sh";

/// The kernel's `struct sigaction` on x86_64 and aarch64 (not glibc's, whose mask is 128 bytes).
#[repr(C)]
struct KernelSigaction {
    handler: usize,
    flags: u64,
    restorer: usize,
    mask: u64,
}

/// A command ready to start: everything the child needs is built here, before the clone.
pub(super) struct Prepared {
    /// NUL-terminated arrays of pointers into `_argv` / `_envp`.
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    /// Per candidate, `/bin/sh CANDIDATE ARGS...`: what `execvp` runs when the program is not
    /// an executable format (a script without `#!`), as the standard library's spawn does
    /// through it. Built here: the child must not allocate.
    sh_argv: Vec<Vec<*const libc::c_char>>,
    _argv: Vec<CString>,
    _envp: Vec<CString>,
    /// Where `execve` is tried, in order: the program itself when it holds a `/`, else each
    /// directory of the command's `PATH` joined with it.
    candidates: Vec<CString>,
    cwd: Option<CString>,
    user: Option<RunAs>,
    drop_groups: bool,
    process_group: bool,
}

/// Whether the agent runs as root (asked once: it never changes).
fn agent_is_root() -> bool {
    static ROOT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // SAFETY: geteuid has no preconditions.
    *ROOT.get_or_init(|| unsafe { libc::geteuid() } == 0)
}

/// glibc's `execvp` default when the command has no `PATH`.
const DEFAULT_PATH: &str = "/bin:/usr/bin";

/// The descriptors the child gets as 0, 1 and 2.
#[derive(Clone, Copy)]
pub(super) struct Stdio3 {
    pub stdin: RawFd,
    pub stdout: RawFd,
    pub stderr: RawFd,
}

/// Shared between the parent and the child (same memory until `execve`).
struct ChildArgs<'a> {
    p: &'a Prepared,
    stdio: Stdio3,
    /// The errno of the step that failed, 0 when the child reached `execve`.
    error: AtomicI32,
}

impl Prepared {
    /// `cmd` with the agent's own environment, then `configured`, then `env` over it (later
    /// wins, as `Command::env` does), as `user` (the agent's own when `None`). A program named
    /// without a `/` is searched in that environment's `PATH`, as `Command` does. `None` when it
    /// cannot be started this way (an empty program, or a NUL byte in what it is given).
    pub(super) fn new<'a>(
        cmd: &[String],
        configured: impl Iterator<Item = (&'a String, &'a String)>,
        env: &'a BTreeMap<String, String>,
        cwd: Option<&str>,
        user: Option<RunAs>,
        process_group: bool,
    ) -> Option<Prepared> {
        let program = cmd.first().filter(|p| !p.is_empty())?;
        let mut vars: BTreeMap<OsString, OsString> = std::env::vars_os().collect();
        for (k, v) in configured.chain(env.iter()) {
            vars.insert(k.into(), v.into());
        }
        let argv_c: Vec<CString> = cmd
            .iter()
            .map(|a| CString::new(a.as_bytes()).ok())
            .collect::<Option<_>>()?;
        let envp_c: Vec<CString> = vars
            .iter()
            .map(|(k, v)| {
                let mut kv = k.as_bytes().to_vec();
                kv.push(b'=');
                kv.extend_from_slice(v.as_bytes());
                CString::new(kv).ok()
            })
            .collect::<Option<_>>()?;
        let cwd = match cwd {
            Some(d) => Some(CString::new(d).ok()?),
            None => None,
        };
        let candidates = if program.contains('/') {
            vec![CString::new(program.as_bytes()).ok()?]
        } else {
            let path = vars.get(std::ffi::OsStr::new("PATH"));
            let path = path.map_or(DEFAULT_PATH.as_bytes(), |p| p.as_bytes());
            path.split(|b| *b == b':')
                .map(|dir| {
                    // An empty entry is the working directory, as for execvp.
                    let mut full = dir.to_vec();
                    if !full.is_empty() {
                        full.push(b'/');
                    }
                    full.extend_from_slice(program.as_bytes());
                    CString::new(full).ok()
                })
                .collect::<Option<Vec<_>>>()?
        };
        let ptrs = |v: &[CString]| {
            v.iter()
                .map(|c| c.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect::<Vec<_>>()
        };
        let argv = ptrs(&argv_c);
        let sh_argv = candidates
            .iter()
            .map(|c| {
                let mut v = vec![SH.as_ptr(), c.as_ptr()];
                v.extend_from_slice(&argv[1..]);
                v
            })
            .collect();
        Some(Prepared {
            argv,
            sh_argv,
            envp: ptrs(&envp_c),
            _argv: argv_c,
            _envp: envp_c,
            candidates,
            cwd,
            user,
            drop_groups: user.is_some() && agent_is_root(),
            process_group,
        })
    }

    /// Starts it with `stdio`; its pid. The caller reaps it (the agent's reaper does).
    pub(super) fn spawn(&self, stdio: Stdio3) -> io::Result<u32> {
        const STACK: usize = 64 << 10;
        let mut stack = vec![0u8; STACK];
        let args = ChildArgs {
            p: self,
            stdio,
            error: AtomicI32::new(0),
        };
        // No signal is blocked across the clone: the agent installs no handler that could run in
        // the child on the agent's memory (the standard library's guard for a stack overflow
        // only answers a fault, and the child makes none), and an asynchronous signal meets the
        // child's own dispositions, the defaults and the agent's ignored `SIGPIPE`. Blocking
        // them, as `posix_spawn` does, would cost this thread two system calls per spawn. An
        // agent that installs a handler must block signals here again.
        // SAFETY: the stack is ours and outlives the child's use of it: with CLONE_VFORK this
        // thread is suspended until the child has called execve or exited, and `args` lives
        // on this frame until then. The top is 16-byte aligned as the ABI wants.
        let pid = unsafe {
            let top = stack.as_mut_ptr().add(STACK) as usize & !15;
            libc::clone(
                child_main,
                top as *mut libc::c_void,
                libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                &args as *const ChildArgs as *mut libc::c_void,
            )
        };
        let clone_err = io::Error::last_os_error();
        drop(stack);
        if pid < 0 {
            return Err(clone_err);
        }
        let errno = args.error.load(Ordering::SeqCst);
        if errno != 0 {
            // It exited without running the command: reap it here (the agent's reaper may win
            // the race; then this finds nothing, which is fine).
            let mut status = 0;
            // SAFETY: waitpid on our own child with a valid pointer.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            return Err(io::Error::from_raw_os_error(errno));
        }
        Ok(pid as u32)
    }
}

/// The child, on its own stack in the agent's memory: raw syscalls only.
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ChildArgs` the parent keeps alive while suspended (CLONE_VFORK).
    let args = unsafe { &*(arg as *const ChildArgs) };
    let p = args.p;
    let fail = |errno: i32| -> libc::c_int {
        args.error.store(errno.max(1), Ordering::SeqCst);
        // SAFETY: ends this child only (it is its own thread group).
        unsafe { libc::syscall(libc::SYS_exit_group, 127) };
        127
    };
    // SAFETY: each call is a raw system call on values prepared by the parent; none touches
    // memory other than what it is given, and none takes a lock.
    unsafe {
        let errno = || *libc::__errno_location();
        if p.process_group && libc::syscall(libc::SYS_setpgid, 0, 0) < 0 {
            return fail(errno());
        }
        if let Some(user) = p.user {
            if p.drop_groups
                && libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) < 0
            {
                return fail(errno());
            }
            if libc::syscall(libc::SYS_setgid, user.gid) < 0 {
                return fail(errno());
            }
            if libc::syscall(libc::SYS_setuid, user.uid) < 0 {
                return fail(errno());
            }
        }
        if let Some(cwd) = &p.cwd {
            if libc::syscall(libc::SYS_chdir, cwd.as_ptr()) < 0 {
                return fail(errno());
            }
        }
        let s = args.stdio;
        for (src, dst) in [(s.stdin, 0), (s.stdout, 1), (s.stderr, 2)] {
            let rc = if src == dst {
                // dup2 onto itself keeps close-on-exec: clear it instead.
                libc::syscall(libc::SYS_fcntl, src, libc::F_SETFD, 0)
            } else {
                libc::syscall(libc::SYS_dup3, src, dst, 0)
            };
            if rc < 0 {
                return fail(errno());
            }
        }
        let dfl = KernelSigaction {
            handler: libc::SIG_DFL,
            flags: 0,
            restorer: 0,
            mask: 0,
        };
        libc::syscall(
            libc::SYS_rt_sigaction,
            libc::SIGPIPE,
            &dfl as *const KernelSigaction,
            std::ptr::null_mut::<KernelSigaction>(),
            8usize,
        );
        let empty: u64 = 0;
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK,
            &empty as *const u64,
            std::ptr::null_mut::<u64>(),
            8usize,
        );
        // As execvp: the first candidate that runs wins; a missing or unusable one lets the
        // search go on (EACCES is remembered and wins over "not found"), any other error ends it.
        let mut denied = false;
        let mut last = libc::ENOENT;
        for (i, program) in p.candidates.iter().enumerate() {
            libc::syscall(
                libc::SYS_execve,
                program.as_ptr(),
                p.argv.as_ptr(),
                p.envp.as_ptr(),
            );
            let e = errno();
            match e {
                libc::ENOEXEC => {
                    // A script without `#!`: the shell runs it. The error, if that fails too, is
                    // the program's, not the shell's.
                    libc::syscall(
                        libc::SYS_execve,
                        SH.as_ptr(),
                        p.sh_argv[i].as_ptr(),
                        p.envp.as_ptr(),
                    );
                    return fail(e);
                }
                libc::EACCES => denied = true,
                libc::ENOENT | libc::ESTALE | libc::ENOTDIR | libc::ENODEV | libc::ETIMEDOUT => {}
                _ => return fail(e),
            }
            last = e;
        }
        fail(if denied { libc::EACCES } else { last })
    }
}

/// `/dev/null` as all three descriptors (keep the file while the child starts).
#[cfg(test)]
pub(super) fn null_stdio() -> (std::fs::File, Stdio3) {
    use std::os::fd::AsRawFd;
    let null = std::fs::File::open("/dev/null").unwrap();
    let fd = null.as_raw_fd();
    let stdio = Stdio3 {
        stdin: fd,
        stdout: fd,
        stderr: fd,
    };
    (null, stdio)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::{Read, Write};
    use std::os::fd::{AsRawFd, FromRawFd};
    use std::os::unix::fs::PermissionsExt;

    fn wait(pid: u32) -> i32 {
        let mut status = 0;
        // SAFETY: waitpid on our own child with a valid pointer.
        let rc = unsafe { libc::waitpid(pid as i32, &mut status, 0) };
        assert_eq!(rc, pid as i32);
        libc::WEXITSTATUS(status)
    }

    /// Another user when the tests run as root (the agent's case), else our own.
    fn someone() -> RunAs {
        // SAFETY: getuid/getgid have no preconditions.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        if uid == 0 {
            RunAs {
                uid: 4321,
                gid: 4322,
            }
        } else {
            RunAs { uid, gid }
        }
    }

    #[test]
    fn a_command_starts_as_the_user_with_its_environment_directory_group_and_stdio() {
        let dir = tempfile::tempdir().unwrap();
        let out_path = dir.path().join("out");
        let out = File::create(&out_path).unwrap();
        let (stdin_r, stdin_w) = {
            let mut fds = [0; 2];
            // SAFETY: pipe2 fills the array with two new descriptors we then own.
            unsafe {
                assert_eq!(libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC), 0);
                (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1]))
            }
        };
        let user = someone();
        let script = "id -u; id -g; id -G; pwd; echo \"$FROM_CONFIG $FROM_REQUEST\"; \
                      read pid comm state ppid pgrp rest < /proc/$$/stat; echo $((pid == pgrp)); \
                      read line; echo \"stdin: $line\"; echo oops >&2; \
                      while read k r e s f; do case $k in Uid:|Gid:) echo \"$k $r $e $s\";; esac; \
                      done < /proc/$$/status; exit 3";
        let cmd = ["/bin/sh".to_string(), "-c".into(), script.into()];
        let configured: BTreeMap<String, String> = [
            ("FROM_CONFIG".to_string(), "configured".to_string()),
            ("FROM_REQUEST".to_string(), "overridden".to_string()),
        ]
        .into();
        let env: BTreeMap<String, String> = [("FROM_REQUEST".into(), "request".into())].into();
        let p = Prepared::new(
            &cmd,
            configured.iter(),
            &env,
            Some("/usr"),
            Some(user),
            true,
        )
        .unwrap();
        let pid = p
            .spawn(Stdio3 {
                stdin: stdin_r.as_raw_fd(),
                stdout: out.as_raw_fd(),
                stderr: out.as_raw_fd(),
            })
            .unwrap();
        drop(stdin_r);
        let mut stdin_w = stdin_w;
        stdin_w.write_all(b"hello\n").unwrap();
        drop(stdin_w);
        assert_eq!(wait(pid), 3);
        let mut text = String::new();
        File::open(&out_path)
            .unwrap()
            .read_to_string(&mut text)
            .unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], user.uid.to_string(), "{text}");
        assert_eq!(lines[1], user.gid.to_string(), "{text}");
        assert_eq!(
            lines[2],
            user.gid.to_string(),
            "no supplementary groups: {text}"
        );
        assert_eq!(lines[3], "/usr");
        assert_eq!(lines[4], "configured request");
        assert_eq!(lines[5], "1", "a process group of its own: {text}");
        assert_eq!(lines[6], "stdin: hello");
        assert_eq!(lines[7], "oops");
        // Real, effective and saved ids: nothing of root's left to go back to.
        let ids = |id: u32| format!("{id} {id} {id}");
        assert_eq!(lines[8], format!("Uid: {}", ids(user.uid)), "{text}");
        assert_eq!(lines[9], format!("Gid: {}", ids(user.gid)), "{text}");
    }

    #[test]
    fn a_missing_program_is_not_found_and_a_script_without_shebang_runs_under_sh() {
        let user = someone();
        let (_null, stdio) = null_stdio();
        let none = BTreeMap::new();
        let missing = ["/nonexistent/torpor-test".to_string()];
        let err = Prepared::new(&missing, none.iter(), &none, None, Some(user), true)
            .unwrap()
            .spawn(stdio)
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        // A working directory it cannot enter: refused before the command runs.
        let err = Prepared::new(
            &["/bin/true".to_string()],
            none.iter(),
            &none,
            Some("/nonexistent/dir"),
            Some(user),
            true,
        )
        .unwrap()
        .spawn(stdio)
        .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        // Nothing to start, or a NUL byte: not startable this way.
        assert!(Prepared::new(&[String::new()], none.iter(), &none, None, None, true).is_none());
        let nul = ["/bin/echo".to_string(), "a\0b".into()];
        assert!(Prepared::new(&nul, none.iter(), &none, None, None, true).is_none());

        let dir = tempfile::Builder::new().tempdir_in("/tmp").unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let script = dir.path().join("noshebang");
        std::fs::write(&script, "exit 7\n").unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let cmd = [script.to_str().unwrap().to_string()];
        let pid = Prepared::new(&cmd, none.iter(), &none, None, Some(user), true)
            .unwrap()
            .spawn(stdio)
            .unwrap();
        assert_eq!(wait(pid), 7);
    }

    #[test]
    fn a_program_without_a_slash_is_searched_in_the_commands_path_as_execvp_does() {
        let (_null, stdio) = null_stdio();
        let dir = tempfile::Builder::new().tempdir_in("/tmp").unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let (denied, found, script) = (
            dir.path().join("denied"),
            dir.path().join("found"),
            dir.path().join("found/torpor-noshebang"),
        );
        std::fs::create_dir_all(&denied).unwrap();
        std::fs::create_dir_all(&found).unwrap();
        // Not executable in `denied`, a script without `#!` in `found`.
        std::fs::write(denied.join("torpor-noshebang"), "exit 1\n").unwrap();
        std::fs::write(&script, "exit 9\n").unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let run = |cmd: &[&str], path: &str| {
            let cmd: Vec<String> = cmd.iter().map(|s| s.to_string()).collect();
            let env: BTreeMap<String, String> = [("PATH".to_string(), path.to_string())].into();
            let none = BTreeMap::new();
            Prepared::new(&cmd, none.iter(), &env, None, None, true)
                .unwrap()
                .spawn(stdio)
                .map(wait)
        };
        // The request's PATH is searched, in order, past directories that do not exist.
        assert_eq!(
            run(&["sh", "-c", "exit 5"], "/nonexistent:/bin:/usr/bin").unwrap(),
            5
        );
        // An entry that holds the name but cannot run it does not end the search...
        let both = format!("{}:{}", denied.display(), found.display());
        assert_eq!(
            run(&["torpor-noshebang"], &both).unwrap(),
            9,
            "found after denied"
        );
        // ...but says why when nothing else runs it.
        let err = run(&["torpor-noshebang"], denied.to_str().unwrap()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        let err = run(&["torpor-no-such-program"], "/bin:/usr/bin").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }
}
