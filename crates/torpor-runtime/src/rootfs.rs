//! Root filesystems and the agent's directory, prepared on the host before a template boots.
//!
//! - The `host` template: an almost empty directory whose /usr (and /bin, /lib*, /sbin when they
//!   are real directories) are bind-mounted read-only from the host, with an /etc written by
//!   torpor (never the host's own) so that `sh` and `python3` work with nothing downloaded.
//! - The agent directory: a copy of the running `torpor` binary with its shared libraries and
//!   dynamic loader, mounted read-only at [`AGENT_MOUNT`] in every sandbox, so the agent runs
//!   whatever libc the template's root filesystem has (or none).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::spec::Mount;
pub use crate::spec::AGENT_MOUNT;

#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    #[error("cannot prepare {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot find the shared libraries of {binary}: {detail}")]
    Ldd { binary: PathBuf, detail: String },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> RootfsError + '_ {
    move |source| RootfsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The directories of the host that the `host` template shows read-only.
const HOST_DIRS: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
];

/// Lays out the `host` template's root directory at `root` and returns the bind mounts it needs.
pub fn prepare_host_rootfs(root: &Path) -> Result<Vec<Mount>, RootfsError> {
    let mut mounts = Vec::new();
    for dir in [
        "etc", "tmp", "root", "home", "var/log", "var/tmp", "proc", "dev", "sys", "run", "opt",
        ".torpor",
    ] {
        let p = root.join(dir);
        fs::create_dir_all(&p).map_err(io_err(&p))?;
    }
    for host in HOST_DIRS {
        let hp = Path::new(host);
        let Ok(meta) = fs::symlink_metadata(hp) else {
            continue;
        };
        let inside = root.join(&host[1..]);
        if meta.file_type().is_symlink() {
            // Merged /usr: /bin -> usr/bin. Recreate the link; it resolves inside the sandbox.
            let target = fs::read_link(hp).map_err(io_err(hp))?;
            if fs::symlink_metadata(&inside).is_err() {
                std::os::unix::fs::symlink(&target, &inside).map_err(io_err(&inside))?;
            }
        } else if meta.is_dir() {
            fs::create_dir_all(&inside).map_err(io_err(&inside))?;
            mounts.push(Mount::bind_ro(host, host));
        }
    }
    write_etc(&root.join("etc"))?;
    open_layout(root)?;
    Ok(mounts)
}

/// Gives the layout the modes a root filesystem has (directories 0755, files 0644, /tmp 1777)
/// whatever the daemon's umask (077, to keep its data directory private): they are what
/// processes inside the sandbox see, and a non-root one must reach `/etc/passwd`.
fn open_layout(root: &Path) -> Result<(), RootfsError> {
    let meta = fs::symlink_metadata(root).map_err(io_err(root))?;
    let mode = if meta.is_dir() {
        if root.file_name().is_some_and(|n| n == "tmp") {
            0o1777
        } else {
            0o755
        }
    } else if meta.is_file() {
        0o644
    } else {
        return Ok(());
    };
    set_mode(root, mode)?;
    if meta.is_dir() {
        for entry in fs::read_dir(root).map_err(io_err(root))? {
            open_layout(&entry.map_err(io_err(root))?.path())?;
        }
    }
    Ok(())
}

/// Writes the minimal /etc a sandbox needs: users, hosts, resolver, CA certificates.
pub fn write_etc(etc: &Path) -> Result<(), RootfsError> {
    let files: &[(&str, &str)] = &[
        (
            "passwd",
            "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        ),
        ("group", "root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n"),
        ("hosts", "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost\n"),
        // No network by default; the networking layer rewrites this when egress is allowed.
        ("resolv.conf", "# written by torpor\n"),
        ("hostname", "sandbox\n"),
        ("nsswitch.conf", "passwd: files\ngroup: files\nhosts: files dns\n"),
    ];
    for (name, content) in files {
        let p = etc.join(name);
        fs::write(&p, content).map_err(io_err(&p))?;
    }
    let certs = Path::new("/etc/ssl/certs/ca-certificates.crt");
    if certs.exists() {
        let dir = etc.join("ssl/certs");
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let dest = dir.join("ca-certificates.crt");
        fs::copy(certs, &dest).map_err(io_err(&dest))?;
    }
    Ok(())
}

/// Copies `binary` with its shared libraries and loader into a directory under `agents_dir`
/// named after the binary's content, and returns that directory. An existing one is reused, so
/// sandboxes checkpointed by an older torpor keep restoring with the agent they were made with.
pub fn install_agent(binary: &Path, agents_dir: &Path) -> Result<PathBuf, RootfsError> {
    let key = content_key(binary).map_err(io_err(binary))?;
    let dir = agents_dir.join(&key);
    if dir.join("torpor").exists() && dir.join("ld.so").exists() {
        open_agent_dir(&dir)?;
        return Ok(dir);
    }
    let tmp = agents_dir.join(format!(".{key}.tmp"));
    let _ = fs::remove_dir_all(&tmp);
    let lib = tmp.join("lib");
    fs::create_dir_all(&lib).map_err(io_err(&lib))?;
    fs::copy(binary, tmp.join("torpor")).map_err(io_err(&tmp))?;
    set_mode(&tmp.join("torpor"), 0o755)?;
    let (libs, loader) = shared_libraries(binary)?;
    for l in libs {
        let name = l.file_name().expect("library path has a name");
        fs::copy(&l, lib.join(name)).map_err(io_err(&l))?;
    }
    fs::copy(&loader, tmp.join("ld.so")).map_err(io_err(&loader))?;
    set_mode(&tmp.join("ld.so"), 0o755)?;
    open_agent_dir(&tmp)?;
    match fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // Another daemon start raced us to the same content; theirs is as good as ours.
        Err(_) if dir.join("ld.so").exists() => {
            let _ = fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(io_err(&dir)(e)),
    }
}

/// The agent directory and its `lib` readable and searchable by every user inside the sandbox
/// (0755 whatever the daemon's umask), so a non-root process can run the agent binary as a
/// client (E2B's `base`: `sudo` for its `user`). On the host it stays under the 0700 data
/// directory.
fn open_agent_dir(dir: &Path) -> Result<(), RootfsError> {
    set_mode(dir, 0o755)?;
    set_mode(&dir.join("lib"), 0o755)?;
    for entry in fs::read_dir(dir.join("lib")).map_err(io_err(dir))? {
        let p = entry.map_err(io_err(dir))?.path();
        set_mode(&p, 0o755)?;
    }
    Ok(())
}

/// The argv that starts the agent inside a sandbox, with `main` as its main process.
pub fn agent_argv(main: &[String]) -> Vec<String> {
    let mut argv: Vec<String> = vec![
        format!("{AGENT_MOUNT}/ld.so"),
        "--library-path".into(),
        format!("{AGENT_MOUNT}/lib"),
        format!("{AGENT_MOUNT}/torpor"),
        "sandbox-agent".into(),
        "--".into(),
    ];
    argv.extend(main.iter().cloned());
    argv
}

fn set_mode(p: &Path, mode: u32) -> Result<(), RootfsError> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).map_err(io_err(p))
}

/// A short, stable name for a file's bytes (64 bits of blake3, and the length). Not a security
/// boundary: it only keeps agent builds apart.
fn content_key(path: &Path) -> io::Result<String> {
    // Read at every daemon start, before a restarted daemon takes back the containers its
    // shims kept running (they end after the live-restore window): a debug build's binary is
    // ~170 MB, so the hash is blake3 (optimised even in a debug build), streamed.
    let mut h = blake3::Hasher::new();
    let len = io::copy(&mut fs::File::open(path)?, &mut h)?;
    Ok(format!("{}-{len}", &h.finalize().to_hex()[..16]))
}

/// The shared libraries and the dynamic loader of an ELF binary, as `ldd` reports them.
fn shared_libraries(binary: &Path) -> Result<(Vec<PathBuf>, PathBuf), RootfsError> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .map_err(|e| RootfsError::Ldd {
            binary: binary.into(),
            detail: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(RootfsError::Ldd {
            binary: binary.into(),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut libs = Vec::new();
    let mut loader = None;
    for line in text.lines() {
        let line = line.trim();
        if let Some((_, rest)) = line.split_once("=> ") {
            if let Some(path) = rest.split_whitespace().next() {
                if path.starts_with('/') {
                    libs.push(PathBuf::from(path));
                }
            }
        } else if let Some(path) = line.split_whitespace().next() {
            if path.starts_with('/') && path.contains("ld-linux") {
                loader = Some(PathBuf::from(path));
            }
        }
    }
    let loader = loader.ok_or_else(|| RootfsError::Ldd {
        binary: binary.into(),
        detail: "no dynamic loader in ldd's output".into(),
    })?;
    Ok((libs, loader))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_rootfs_has_etc_and_mounts_usr() {
        let dir = tempfile::tempdir().unwrap();
        let mounts = prepare_host_rootfs(dir.path()).unwrap();
        assert!(mounts.iter().any(|m| m.destination == "/usr"));
        let passwd = fs::read_to_string(dir.path().join("etc/passwd")).unwrap();
        assert!(passwd.starts_with("root:"));
        // Never a copy of the host's own /etc.
        assert_ne!(
            passwd,
            fs::read_to_string("/etc/passwd").unwrap_or_default()
        );
    }

    #[test]
    fn host_rootfs_modes_do_not_follow_the_daemons_umask() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("rootfs");
        fs::create_dir(&root).unwrap();
        // What umask 077 makes of it: the daemon's umask is process-wide, so simulate it.
        set_mode(&root, 0o700).unwrap();
        prepare_host_rootfs(&root).unwrap();
        for p in ["etc", "var", "var/log", "etc/passwd"] {
            set_mode(&root.join(p), 0o700).unwrap();
        }
        open_layout(&root).unwrap();
        let mode = |p: &str| fs::metadata(root.join(p)).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(""), 0o755);
        assert_eq!(mode("etc"), 0o755);
        assert_eq!(mode("var/log"), 0o755);
        assert_eq!(mode("etc/passwd"), 0o644);
        assert_eq!(mode("tmp"), 0o1777);
    }

    #[test]
    fn agent_install_is_content_addressed_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let exe = std::env::current_exe().unwrap();
        let a = install_agent(&exe, dir.path()).unwrap();
        let b = install_agent(&exe, dir.path()).unwrap();
        assert_eq!(a, b);
        assert!(a.join("ld.so").exists());
        assert!(fs::read_dir(a.join("lib")).unwrap().count() >= 1);
    }
}
