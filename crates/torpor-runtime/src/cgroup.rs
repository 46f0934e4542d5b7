//! The cgroup v1 files torpor reads and writes for a container that runsc placed at
//! `<controller>/torpor/<container id>`: the freezer (Running ↔ Frozen in milliseconds), memory
//! usage (for eviction) and OOM notification (so a memory bomb is reported as `oom_killed`).

use std::fs;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// The parent group of every container torpor starts.
pub const PARENT: &str = "torpor";

pub fn cgroups_path(container_id: &str) -> String {
    format!("/{PARENT}/{container_id}")
}

fn controller_dir(controller: &str, container_id: &str) -> PathBuf {
    PathBuf::from(CGROUP_ROOT)
        .join(controller)
        .join(PARENT)
        .join(container_id)
}

#[derive(Debug, thiserror::Error)]
#[error("cgroup {path}")]
pub struct CgroupError {
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

/// Freezes (`true`) or thaws the whole container and waits until the kernel says it is done.
pub fn set_frozen(container_id: &str, frozen: bool) -> Result<(), CgroupError> {
    let path = controller_dir("freezer", container_id).join("freezer.state");
    let err = |source| CgroupError {
        path: path.clone(),
        source,
    };
    let want = if frozen { "FROZEN" } else { "THAWED" };
    fs::write(&path, want).map_err(err)?;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = fs::read_to_string(&path).map_err(err)?;
        if now.trim() == want {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("still {} after 5 s", now.trim()),
            )));
        }
        std::thread::sleep(Duration::from_micros(500));
    }
}

/// Thaws every container group under torpor's freezer parent whose id `ours` accepts (after a
/// crash, a frozen container's processes cannot be killed until thawed).
pub fn thaw_matching(ours: impl Fn(&str) -> bool) {
    let Ok(entries) = fs::read_dir(PathBuf::from(CGROUP_ROOT).join("freezer").join(PARENT)) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if e.path().is_dir() && ours(&name) {
            let _ = set_frozen(&name, false);
        }
    }
}

/// Bytes charged to the container's memory cgroup, or None when it has none (not running).
pub fn memory_usage(container_id: &str) -> Option<u64> {
    fs::read_to_string(controller_dir("memory", container_id).join("memory.usage_in_bytes"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Watches a container's memory cgroup for OOM kills. The flag turns true when the kernel's OOM
/// killer acts inside the group; the watch ends by itself when the group is removed.
pub fn watch_oom(container_id: &str) -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let dir = controller_dir("memory", container_id);
    let out = flag.clone();
    let spawned = std::thread::Builder::new()
        .name("oom-watch".into())
        .spawn(move || {
            if let Err(e) = watch_oom_blocking(&dir, &out) {
                tracing::debug!(dir = %dir.display(), error = %e, "oom watch ended");
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start an oom watch thread");
    }
    flag
}

fn watch_oom_blocking(dir: &std::path::Path, flag: &AtomicBool) -> io::Result<()> {
    // runsc makes the group while it starts; wait for it briefly.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !dir.join("memory.oom_control").exists() {
        if Instant::now() > deadline {
            return Err(io::Error::new(io::ErrorKind::NotFound, "no memory cgroup"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // With the kernel's OOM killer off for this group, a sandbox that hits its limit stalls
    // instead of dying at a random moment; the event below then tells us for certain that it
    // was memory, and we kill it ourselves. (With the killer on, the group is often gone by the
    // time we could read why.)
    let _ = fs::write(dir.join("memory.oom_control"), "1");
    let control = fs::File::open(dir.join("memory.oom_control"))?;
    // SAFETY: eventfd(2) with valid flags; the returned fd is owned below.
    let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if efd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: efd is a fresh, valid fd that nothing else owns.
    let efd = unsafe { OwnedFd::from_raw_fd(efd) };
    fs::write(
        dir.join("cgroup.event_control"),
        format!("{} {}", efd.as_raw_fd(), control.as_raw_fd()),
    )?;
    let mut events = fs::File::from(efd);
    let mut buf = [0u8; 8];
    loop {
        // Fires on an OOM event and also when the group is removed; the file tells which.
        events.read_exact(&mut buf)?;
        let Ok(text) = fs::read_to_string(dir.join("memory.oom_control")) else {
            return Ok(()); // the group is gone: the container ended
        };
        let under = text.lines().any(|l| l.trim() == "under_oom 1");
        let killed = text
            .lines()
            .filter_map(|l| l.strip_prefix("oom_kill "))
            .any(|n| n.trim() != "0");
        if under || killed {
            flag.store(true, Ordering::SeqCst);
            kill_all(dir);
            return Ok(());
        }
    }
}

/// SIGKILLs every process in a cgroup.
fn kill_all(dir: &std::path::Path) {
    let Ok(procs) = fs::read_to_string(dir.join("cgroup.procs")) else {
        return;
    };
    for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
        // SAFETY: kill(2) with a pid read from the group; no memory is passed.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// Removes the container's groups under every controller (runsc leaks them when killed).
pub fn remove_all(container_id: &str) {
    let Ok(controllers) = fs::read_dir(CGROUP_ROOT) else {
        return;
    };
    for c in controllers.flatten() {
        let dir = c.path().join(PARENT).join(container_id);
        if dir.exists() {
            let _ = fs::remove_dir(&dir);
        }
    }
}
