//! The cgroup v1 files torpor reads and writes for a sandbox's group
//! `<controller>/torpor/<name>`: the freezer (Running ↔ Frozen in milliseconds), memory usage
//! (for eviction) and OOM notification (so a memory bomb is reported as `oom_killed`). The name
//! is a warm-pool worker's (groups made ahead of time, see [`crate::warm`]) or, for a template's
//! first boot, the container id (groups runsc makes and removes).

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

pub fn cgroups_path(name: &str) -> String {
    format!("/{PARENT}/{name}")
}

fn controller_dir(controller: &str, name: &str) -> PathBuf {
    PathBuf::from(CGROUP_ROOT)
        .join(controller)
        .join(PARENT)
        .join(name)
}

#[derive(Debug, thiserror::Error)]
#[error("cgroup {path}")]
pub struct CgroupError {
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

/// Freezes (`true`) or thaws the whole container and waits until the kernel says it is done.
pub fn set_frozen(name: &str, frozen: bool) -> Result<(), CgroupError> {
    let path = controller_dir("freezer", name).join("freezer.state");
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

/// The memory a sandbox holds: anonymous memory plus shared memory (gVisor keeps guest memory
/// in a memfd), from the group's `memory.stat`; None when it has no group (not running). Page
/// cache of files it read (its checkpoint image, while restoring) is left out: the kernel
/// reclaims it under pressure, so it neither threatens the node nor says how big the agent is.
pub fn memory_usage(name: &str) -> Option<u64> {
    let stat = fs::read_to_string(controller_dir("memory", name).join("memory.stat")).ok()?;
    Some(resident_from_stat(&stat))
}

fn resident_from_stat(stat: &str) -> u64 {
    stat.lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(k, _)| matches!(*k, "total_rss" | "total_shmem"))
        .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
        .sum()
}

/// Watches a container's memory cgroup for OOM kills. The flag turns true when the kernel's OOM
/// killer acts inside the group; the watch ends by itself when the group is removed.
pub fn watch_oom(name: &str) -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let out = flag.clone();
    spawn_oom_watch(name, move || {
        out.store(true, Ordering::SeqCst);
        false
    });
    flag
}

/// Starts a thread that calls `on_oom` (after killing every process in the group) each time the
/// group `name` runs out of memory, for as long as `on_oom` returns true and the group exists.
pub(crate) fn spawn_oom_watch(name: &str, on_oom: impl FnMut() -> bool + Send + 'static) {
    let dir = controller_dir("memory", name);
    let spawned = std::thread::Builder::new()
        .name("oom-watch".into())
        .spawn(move || {
            if let Err(e) = watch_oom_blocking(&dir, on_oom) {
                tracing::debug!(dir = %dir.display(), error = %e, "oom watch ended");
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start an oom watch thread");
    }
}

fn watch_oom_blocking(dir: &std::path::Path, mut on_oom: impl FnMut() -> bool) -> io::Result<()> {
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
            kill_all(dir);
            if !on_oom() {
                return Ok(());
            }
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

/// Removes the group `name` under every controller (runsc leaks them when killed).
pub fn remove_all(name: &str) {
    let Ok(controllers) = fs::read_dir(CGROUP_ROOT) else {
        return;
    };
    for c in controllers.flatten() {
        let dir = c.path().join(PARENT).join(name);
        if dir.exists() {
            let _ = fs::remove_dir(&dir);
        }
    }
}

/// The cgroup v1 hierarchies mounted here (one directory per hierarchy; the cgroup2 mount
/// `unified` excluded), resolved so that co-mounted controllers count once.
fn hierarchies() -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(CGROUP_ROOT) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = Vec::new();
    for e in entries.flatten() {
        if e.file_name() == "unified" {
            continue;
        }
        let Ok(real) = fs::canonicalize(e.path()) else {
            continue;
        };
        if real.is_dir() && real.join("cgroup.procs").exists() && !out.contains(&real) {
            out.push(real);
        }
    }
    out.sort();
    out
}

fn make_dir(dir: &std::path::Path) -> Result<(), CgroupError> {
    match fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(CgroupError {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

fn write(path: PathBuf, value: &str) -> Result<(), CgroupError> {
    fs::write(&path, value).map_err(|source| CgroupError { path, source })
}

/// Makes the group `name` in every hierarchy ahead of a sandbox. runsc uses groups it finds
/// as they are (it sets no limits in them and leaves them behind), so the caller applies the
/// sandbox's limits with [`apply_limits`]. A cpuset group starts with no CPUs: it inherits its
/// parent's.
pub fn create_group(name: &str) -> Result<(), CgroupError> {
    for h in hierarchies() {
        let parent = h.join(PARENT);
        make_dir(&parent)?;
        let dir = parent.join(name);
        make_dir(&dir)?;
        if h.join("cpuset.cpus").exists() {
            for file in ["cpuset.cpus", "cpuset.mems"] {
                for (from, to) in [(&h, &parent), (&parent, &dir)] {
                    let value = fs::read_to_string(from.join(file)).unwrap_or_default();
                    let current = fs::read_to_string(to.join(file)).unwrap_or_default();
                    if current.trim().is_empty() {
                        write(to.join(file), value.trim())?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Sets a sandbox's limits on a group made by [`create_group`]: what runsc itself would write
/// into a group it made (memory limit, CPU quota, pids).
pub fn apply_limits(
    name: &str,
    memory_bytes: u64,
    cpu_quota_us: i64,
    cpu_period_us: u64,
    pids: u64,
) -> Result<(), CgroupError> {
    let memory = controller_dir("memory", name);
    write(
        memory.join("memory.limit_in_bytes"),
        &memory_bytes.to_string(),
    )?;
    let cpu = controller_dir("cpu", name);
    if cpu.exists() {
        write(cpu.join("cpu.cfs_period_us"), &cpu_period_us.to_string())?;
        let quota = if cpu_quota_us > 0 { cpu_quota_us } else { -1 };
        write(cpu.join("cpu.cfs_quota_us"), &quota.to_string())?;
    }
    let pids_dir = controller_dir("pids", name);
    if pids_dir.exists() {
        write(pids_dir.join("pids.max"), &pids.to_string())?;
    }
    Ok(())
}

/// Makes a group that a sandbox has left fit for the next one: thawed, every leftover process
/// killed, the memory still charged to it (page cache of the images it read) dropped. Fails
/// when processes will not leave within `timeout`.
pub fn reset_group(name: &str, timeout: Duration) -> Result<(), CgroupError> {
    let _ = set_frozen(name, false);
    let memory = controller_dir("memory", name);
    let deadline = Instant::now() + timeout;
    loop {
        let procs =
            fs::read_to_string(memory.join("cgroup.procs")).map_err(|source| CgroupError {
                path: memory.clone(),
                source,
            })?;
        if procs.trim().is_empty() {
            break;
        }
        if Instant::now() > deadline {
            return Err(CgroupError {
                path: memory,
                source: io::Error::new(io::ErrorKind::TimedOut, "processes left in the group"),
            });
        }
        kill_all(&memory);
        std::thread::sleep(Duration::from_millis(5));
    }
    // Best effort: a charge that cannot be dropped now is dropped by the kernel under pressure.
    let _ = fs::write(memory.join("memory.force_empty"), "0");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resident_memory_is_rss_plus_shmem_without_page_cache() {
        let stat = "cache 900\nrss 5\nshmem 3\ntotal_cache 1000000\ntotal_rss 54000\n\
                    total_shmem 10000\ntotal_mapped_file 7\n";
        assert_eq!(resident_from_stat(stat), 64000);
        assert_eq!(resident_from_stat(""), 0);
    }
}
