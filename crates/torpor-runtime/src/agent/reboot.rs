//! The sandbox's boot: its boot id ([`proto::BOOT_ID_PATH`]) and `Reboot` (E2B's
//! filesystem-only pause): every process but the agent killed, the main process started again,
//! a new boot id. Files are not touched.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use super::{Agent, Answer, MainState};
use crate::proto::{self, AgentErrorCode, Reply};

/// How long a reboot waits for the killed processes to be gone (reaped) before it says so.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// A random (version 4) UUID in Linux's boot_id form: lowercase, hyphenated.
pub(super) fn new_uuid() -> io::Result<String> {
    let mut b = [0u8; 16];
    let mut got = 0;
    while got < b.len() {
        // SAFETY: getrandom writes at most `len` bytes into the buffer it is given.
        let n = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), b.len() - got, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        got += n as usize;
    }
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    ))
}

/// Writes a new boot id to `path` (read-only for everyone, as Linux's). A sandbox whose spec
/// predates the boot-id mount (restored from an older torpor's snapshot) has no such
/// directory: the error is the caller's to ignore.
pub(super) fn write_boot_id(path: &Path) -> io::Result<String> {
    let id = new_uuid()?;
    let tmp = path.with_file_name(".boot_id.torpor-tmp");
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o444)
        .open(&tmp)?;
    f.write_all(format!("{id}\n").as_bytes())?;
    f.set_permissions(fs::Permissions::from_mode(0o444))?;
    drop(f);
    fs::rename(&tmp, path)?;
    Ok(id)
}

/// A new boot id at [`proto::BOOT_ID_PATH`]; where it cannot be written (no boot-id mount),
/// nothing: the sandbox has no boot id, as before.
pub(super) fn new_boot() {
    if let Err(e) = write_boot_id(Path::new(proto::BOOT_ID_PATH)) {
        if e.kind() != io::ErrorKind::NotFound {
            eprintln!("torpor-agent: cannot write the boot id: {e}");
        }
    }
}

/// The pids of every other process in the sandbox (from /proc), with whether each has exited
/// and waits to be reaped (a zombie: killing it again does nothing).
fn others(own: u32) -> io::Result<Vec<(i32, bool)>> {
    let mut out = Vec::new();
    for entry in fs::read_dir("/proc")? {
        let Ok(entry) = entry else { continue };
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        if pid as u32 == own || pid <= 0 {
            continue;
        }
        // The state is the field after the command's closing parenthesis.
        let zombie = fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .and_then(|(_, rest)| rest.trim_start().chars().next())
            })
            .is_some_and(|c| c == 'Z' || c == 'X');
        out.push((pid, zombie));
    }
    Ok(out)
}

/// Kills (SIGKILL) every process of the sandbox but this one, again and again (a process may
/// fork while it dies), until none is left or [`KILL_WAIT`] has passed. The agent is PID 1: the
/// killed are reaped by its reaper, which tells their waiters (execs, E2B processes) as for any
/// exit. Answers how many processes were killed, or those still there at the deadline.
fn kill_others(own: u32) -> Result<usize, usize> {
    let deadline = Instant::now() + KILL_WAIT;
    let mut killed = std::collections::HashSet::new();
    loop {
        let left = others(own).unwrap_or_default();
        if left.is_empty() {
            return Ok(killed.len());
        }
        if Instant::now() >= deadline {
            return Err(left.len());
        }
        for (pid, zombie) in left {
            if !zombie {
                // SAFETY: kill(2) with a pid read from /proc; no memory is touched.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                killed.insert(pid);
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

impl Agent {
    /// [`proto::Request::Reboot`].
    pub(super) fn reboot(&self) -> Answer {
        // The main process is gone with the rest: forget it before anything can ask.
        *self.main.lock().unwrap_or_else(|p| p.into_inner()) = MainState::default();
        match kill_others(std::process::id()) {
            Ok(n) => eprintln!("torpor-agent: reboot: {n} processes killed"),
            Err(left) => {
                return Err(Reply::Error {
                    code: AgentErrorCode::Io,
                    message: format!(
                        "reboot: {left} processes still there {} s after SIGKILL",
                        KILL_WAIT.as_secs()
                    ),
                })
            }
        }
        if !self.main_cmd.is_empty() {
            self.start_main(&self.main_cmd);
        }
        new_boot();
        Ok((self.main_status(), Vec::new()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_ids_are_fresh_uuids_in_linuxs_form() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("boot_id");
        let a = write_boot_id(&path).unwrap();
        let on_disk = fs::read_to_string(&path).unwrap();
        assert_eq!(on_disk, format!("{a}\n"));
        let parts: Vec<&str> = a.split('-').collect();
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            [8, 4, 4, 4, 12]
        );
        assert!(a
            .chars()
            .all(|c| c == '-' || c.is_ascii_digit() || ('a'..='f').contains(&c)));
        assert_eq!(&parts[2][..1], "4", "version 4");
        assert!("89ab".contains(&parts[3][..1]), "RFC 4122 variant");
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o444
        );
        let b = write_boot_id(&path).unwrap();
        assert_ne!(a, b);
        assert_eq!(fs::read_to_string(&path).unwrap(), format!("{b}\n"));
        assert!(write_boot_id(&dir.path().join("missing/boot_id")).is_err());
    }
}
