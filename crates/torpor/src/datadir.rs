//! The data directory on the local machine: one daemon at a time (a lock holding its pid), no
//! access for other local users (mode 0700, files 0600), and the tokens kept in it.
//!
//! This module owns what `torpor up` does to the directory before the engine opens it; it does
//! not touch what the engine keeps inside (database, templates, checkpoints, the store).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// The lock file: `flock`ed by the running daemon, holding its pid.
pub const LOCK_FILE: &str = "torpor.lock";
/// The admin token (every tenant, the operator's routes).
pub const ADMIN_TOKEN_FILE: &str = "admin-token";
/// The token `GET /metrics` accepts besides the admin token.
pub const METRICS_TOKEN_FILE: &str = "metrics-token";
/// What the daemon creates: files 0600, directories 0700.
pub const PRIVATE_UMASK: libc::mode_t = 0o077;

#[derive(Debug, thiserror::Error)]
pub enum DataDirError {
    #[error(
        "the data directory {dir} is in use by another torpor daemon (pid {pid}); stop it first \
         or give this one another --data-dir"
    )]
    InUse { dir: PathBuf, pid: String },
    #[error("cannot lock the data directory ({path})")]
    Lock {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot make the data directory {dir} private (mode 0700)")]
    Permissions {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write the token file {path}")]
    Token {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Held for the daemon's whole life. The lock is the open file description's: it goes with the
/// process however it ends (a SIGKILLed daemon does not block the next start), and the file is
/// opened close-on-exec, so runsc and the sandboxes it leaves running never inherit it.
#[derive(Debug)]
pub struct DataDirLock {
    _file: File,
}

/// Takes the data directory's lock without waiting and writes this process's pid into it; if
/// another daemon holds it, fails at once naming that daemon's pid.
pub fn lock(dir: &Path) -> Result<DataDirLock, DataDirError> {
    let path = dir.join(LOCK_FILE);
    let lock_err = |source| DataDirError::Lock {
        path: path.clone(),
        source,
    };
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(lock_err)?;
    // SAFETY: flock on a descriptor this function owns; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let mut pid = String::new();
            let _ = file.read_to_string(&mut pid);
            let pid = pid.trim();
            return Err(DataDirError::InUse {
                dir: dir.to_path_buf(),
                pid: if pid.is_empty() {
                    "unknown".into()
                } else {
                    pid.into()
                },
            });
        }
        return Err(lock_err(e));
    }
    file.set_len(0).map_err(lock_err)?;
    file.seek(SeekFrom::Start(0)).map_err(lock_err)?;
    writeln!(file, "{}", std::process::id()).map_err(lock_err)?;
    Ok(DataDirLock { _file: file })
}

/// Sets this process's umask so that what the daemon and its children (runsc) create is private:
/// files 0600, directories 0700.
pub fn set_private_umask() {
    // SAFETY: umask(2) only swaps the process's file mode creation mask.
    unsafe { libc::umask(PRIVATE_UMASK) };
}

/// Makes the data directory 0700 and its direct entries private (files 0600, directories 0700),
/// so a directory made by an older torpor (0755 with 0644 files, the database holding every
/// sandbox's environment among them) is closed to other local users from this start on. Deeper
/// entries are out of other users' reach once the top is 0700; walking them all (checkpoints,
/// store chunks) would cost a start time proportional to the store.
pub fn make_private(dir: &Path) -> Result<(), DataDirError> {
    let perm_err = |source| DataDirError::Permissions {
        dir: dir.to_path_buf(),
        source,
    };
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(perm_err)?;
    for entry in std::fs::read_dir(dir).map_err(perm_err)? {
        let Ok(entry) = entry else { continue };
        // symlink_metadata: a link is left alone (chmod would follow it out of the directory).
        let Ok(meta) = entry.path().symlink_metadata() else {
            continue;
        };
        let mode = meta.permissions().mode() & 0o7777;
        let private = if meta.is_dir() {
            mode & !0o077 | 0o700
        } else if meta.is_file() {
            mode & !0o077
        } else {
            continue;
        };
        if private != mode {
            let _ =
                std::fs::set_permissions(entry.path(), std::fs::Permissions::from_mode(private));
        }
    }
    Ok(())
}

/// Reads a token file, creating it (mode 0600) with a fresh random token `{prefix}{64 hex}` when
/// it is missing or empty.
pub fn ensure_token(dir: &Path, file: &str, prefix: &str) -> Result<String, DataDirError> {
    let path = dir.join(file);
    if let Ok(t) = std::fs::read_to_string(&path) {
        let t = t.trim().to_string();
        if !t.is_empty() {
            return Ok(t);
        }
    }
    let token: String = (0..32)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect();
    let token = format!("{prefix}{token}");
    let token_err = |source| DataDirError::Token {
        path: path.clone(),
        source,
    };
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .map_err(token_err)?;
    f.write_all(token.as_bytes()).map_err(token_err)?;
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_the_same_directory_names_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let held = lock(dir.path()).unwrap();
        // flock locks belong to open file descriptions, so a second open in this very process
        // conflicts as another daemon's would.
        match lock(dir.path()) {
            Err(DataDirError::InUse { dir: d, pid }) => {
                assert_eq!(d, dir.path());
                assert_eq!(pid, std::process::id().to_string());
            }
            other => panic!("expected InUse, got {other:?}"),
        }
        drop(held);
        lock(dir.path()).expect("the lock is free once its holder is gone");
    }

    #[test]
    fn an_old_world_readable_directory_is_made_private() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("data");
        std::fs::create_dir(&dir).unwrap();
        std::fs::create_dir(dir.join("templates")).unwrap();
        std::fs::write(dir.join("torpor.db"), b"x").unwrap();
        std::fs::write(dir.join("script"), b"x").unwrap();
        for (p, m) in [
            (dir.clone(), 0o755),
            (dir.join("templates"), 0o755),
            (dir.join("torpor.db"), 0o644),
            (dir.join("script"), 0o755),
        ] {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(m)).unwrap();
        }
        make_private(&dir).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("templates")), 0o700);
        assert_eq!(mode(&dir.join("torpor.db")), 0o600);
        assert_eq!(mode(&dir.join("script")), 0o700);
    }

    #[test]
    fn a_token_is_created_private_once_and_then_kept() {
        let dir = tempfile::tempdir().unwrap();
        let t = ensure_token(dir.path(), METRICS_TOKEN_FILE, "tpr_metrics_").unwrap();
        assert!(t.starts_with("tpr_metrics_") && t.len() == "tpr_metrics_".len() + 64);
        let meta = std::fs::metadata(dir.path().join(METRICS_TOKEN_FILE)).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(
            ensure_token(dir.path(), METRICS_TOKEN_FILE, "tpr_metrics_").unwrap(),
            t
        );
    }
}
