//! Directory watches with inotify (`WatchStart`, `WatchEvents`, `WatchStop`): what E2B's envd
//! does with fsnotify, inside the sandbox. gVisor implements inotify for its own filesystems
//! (the rootfs overlay, tmpfs), so every change a process or the agent makes is seen, in
//! order, however quickly it is undone; watches are part of the agent's memory and so of
//! every checkpoint.
//!
//! Each watch has its own inotify instance and a reader thread that turns the kernel's events
//! into envd's ([`WatchOp`]) under names relative to the watched directory, and queues them
//! (at most [`proto::MAX_WATCH_EVENTS`]). A recursive watch adds a watch for every directory
//! made (or moved in) under it, and reports what such a directory already holds when its
//! watch is added (what was made in it before) as creates. The agent's own temporary files of
//! `WriteFile` (`.NAME.torpor-tmp`, renamed over `NAME`) are hidden: their rename gives `NAME`
//! a create and a write, as envd's in-place write gives.

use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::proto::{self, AgentErrorCode, Reply, WatchEvent, WatchOp};

const MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_ATTRIB
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_ONLYDIR;
/// Directories below the watched one a recursive watch follows.
const MAX_DEPTH: usize = 32;

struct Queue {
    events: VecDeque<WatchEvent>,
    overflowed: bool,
}

struct Watch {
    queue: Arc<Mutex<Queue>>,
    stop: Arc<AtomicBool>,
}

#[derive(Default)]
struct Watches {
    by_id: HashMap<u64, Watch>,
    order: VecDeque<u64>,
}

fn watches() -> &'static Mutex<Watches> {
    static W: OnceLock<Mutex<Watches>> = OnceLock::new();
    W.get_or_init(Default::default)
}

fn err(code: AgentErrorCode, message: String) -> Reply {
    Reply::Error { code, message }
}

type Answer = Result<(Reply, Vec<u8>), Reply>;

pub(super) fn start(path: &str, recursive: bool) -> Answer {
    let meta =
        std::fs::metadata(path).map_err(|e| super::io_error(std::path::Path::new(path), e))?;
    if !meta.is_dir() {
        return Err(err(
            AgentErrorCode::BadRequest,
            format!("{path} is not a directory"),
        ));
    }
    let fd = inotify().map_err(|e| err(AgentErrorCode::Io, format!("inotify: {e}")))?;
    let mut reader = Reader {
        fd,
        root: path.trim_end_matches('/').to_string(),
        recursive,
        dirs: HashMap::new(),
        queue: Arc::new(Mutex::new(Queue {
            events: VecDeque::new(),
            overflowed: false,
        })),
        moved_tmp: None,
    };
    reader
        .add_dir("", 0, false)
        .map_err(|e| super::io_error(std::path::Path::new(path), e))?;
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    let stop = Arc::new(AtomicBool::new(false));
    let queue = reader.queue.clone();
    {
        let mut all = watches().lock().unwrap_or_else(|p| p.into_inner());
        while all.order.len() >= proto::MAX_WATCHES {
            if let Some(old) = all.order.pop_front() {
                if let Some(w) = all.by_id.remove(&old) {
                    w.stop.store(true, Ordering::Relaxed);
                }
            }
        }
        all.by_id.insert(
            id,
            Watch {
                queue,
                stop: stop.clone(),
            },
        );
        all.order.push_back(id);
    }
    std::thread::spawn(move || reader.run(&stop));
    Ok((Reply::Watch { watch: id }, Vec::new()))
}

pub(super) fn events(watch: u64) -> Answer {
    let all = watches().lock().unwrap_or_else(|p| p.into_inner());
    let Some(w) = all.by_id.get(&watch) else {
        return Err(err(
            AgentErrorCode::NotFound,
            format!("watch {watch} not found"),
        ));
    };
    let mut q = w.queue.lock().unwrap_or_else(|p| p.into_inner());
    let events = q.events.drain(..).collect();
    let overflowed = std::mem::take(&mut q.overflowed);
    Ok((Reply::WatchEvents { events, overflowed }, Vec::new()))
}

pub(super) fn stop(watch: u64) -> Answer {
    let mut all = watches().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(w) = all.by_id.remove(&watch) {
        w.stop.store(true, Ordering::Relaxed);
        all.order.retain(|id| *id != watch);
    }
    Ok((Reply::Ok, Vec::new()))
}

struct Reader {
    fd: OwnedFd,
    root: String,
    recursive: bool,
    /// Watch descriptor → directory relative to the root ("" for the root).
    dirs: HashMap<i32, String>,
    queue: Arc<Mutex<Queue>>,
    /// The cookie of the last rename away from one of `WriteFile`'s temporary files.
    moved_tmp: Option<u32>,
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

/// `WriteFile`'s temporary name for a file (see `write_file`).
fn is_tmp(name: &str) -> bool {
    let base = name.rsplit('/').next().unwrap_or(name);
    base.starts_with('.') && base.ends_with(".torpor-tmp")
}

impl Reader {
    fn push(&self, name: String, op: WatchOp) {
        if is_tmp(&name) {
            return;
        }
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if q.events.len() >= proto::MAX_WATCH_EVENTS {
            q.events.pop_front();
            q.overflowed = true;
        }
        q.events.push_back(WatchEvent { name, op });
    }

    /// Watches directory `rel` (relative to the root); with `report`, what it already holds
    /// is reported as created (it was made, or moved in, after the watch began). Recursive:
    /// its subdirectories too.
    fn add_dir(&mut self, rel: &str, depth: usize, report: bool) -> std::io::Result<()> {
        let full = if rel.is_empty() {
            self.root.clone()
        } else {
            format!("{}/{rel}", self.root)
        };
        let c = CString::new(full.clone())
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: a valid descriptor and a NUL-terminated path.
        let wd = unsafe { libc::inotify_add_watch(self.fd.as_raw_fd(), c.as_ptr(), MASK) };
        if wd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        self.dirs.insert(wd, rel.to_string());
        if !(self.recursive || report) {
            return Ok(());
        }
        let Ok(rd) = std::fs::read_dir(&full) else {
            return Ok(());
        };
        let mut entries: Vec<(String, bool)> = rd
            .flatten()
            .map(|e| {
                let dir = e.file_type().map(|t| t.is_dir()).unwrap_or(false);
                (e.file_name().to_string_lossy().into_owned(), dir)
            })
            .collect();
        entries.sort();
        for (name, is_dir) in entries {
            let child = join(rel, &name);
            if report {
                self.push(child.clone(), WatchOp::Create);
            }
            if is_dir && self.recursive && depth < MAX_DEPTH {
                // A directory that goes away meanwhile is simply not watched.
                let _ = self.add_dir(&child, depth + 1, report);
            }
        }
        Ok(())
    }

    /// Stops following the directories at and under `rel` (moved away).
    fn forget_dir(&mut self, rel: &str) {
        let prefix = format!("{rel}/");
        let gone: Vec<i32> = self
            .dirs
            .iter()
            .filter(|(_, d)| *d == rel || d.starts_with(&prefix))
            .map(|(wd, _)| *wd)
            .collect();
        for wd in gone {
            self.dirs.remove(&wd);
            // SAFETY: a valid descriptor; a watch already gone answers an error, ignored.
            unsafe { libc::inotify_rm_watch(self.fd.as_raw_fd(), wd) };
        }
    }

    fn run(mut self, stop: &AtomicBool) {
        let mut buf = vec![0u8; 64 * 1024];
        // The descriptor stays open as long as `self` (the events need `self` mutably).
        let fd = self.fd.as_raw_fd();
        while !stop.load(Ordering::Relaxed) {
            read_events(fd, &mut buf, 250, None, |wd, mask, cookie, name| {
                self.event(wd, mask, cookie, name)
            });
        }
    }

    fn event(&mut self, wd: i32, mask: u32, cookie: u32, name: &str) {
        if mask & libc::IN_Q_OVERFLOW != 0 {
            self.queue
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .overflowed = true;
            return;
        }
        if mask & libc::IN_IGNORED != 0 {
            self.dirs.remove(&wd);
            return;
        }
        let Some(dir) = self.dirs.get(&wd).cloned() else {
            return;
        };
        if name.is_empty() {
            return; // about the directory itself
        }
        let rel = join(&dir, name);
        let is_dir = mask & libc::IN_ISDIR != 0;
        let depth = rel.matches('/').count();
        if mask & libc::IN_CREATE != 0 {
            self.push(rel.clone(), WatchOp::Create);
            if is_dir && self.recursive && depth < MAX_DEPTH {
                let _ = self.add_dir(&rel, depth + 1, true);
            }
        }
        if mask & libc::IN_MOVED_TO != 0 {
            self.push(rel.clone(), WatchOp::Create);
            if self.moved_tmp.take() == Some(cookie) && cookie != 0 {
                self.push(rel.clone(), WatchOp::Write);
            }
            if is_dir && self.recursive && depth < MAX_DEPTH {
                let _ = self.add_dir(&rel, depth + 1, true);
            }
        }
        if mask & libc::IN_MODIFY != 0 {
            self.push(rel.clone(), WatchOp::Write);
        }
        if mask & libc::IN_ATTRIB != 0 {
            self.push(rel.clone(), WatchOp::Chmod);
        }
        if mask & libc::IN_MOVED_FROM != 0 {
            if is_tmp(&rel) {
                self.moved_tmp = Some(cookie);
            } else {
                self.push(rel.clone(), WatchOp::Rename);
            }
            if is_dir {
                self.forget_dir(&rel);
            }
        }
        if mask & libc::IN_DELETE != 0 {
            self.push(rel, WatchOp::Remove);
        }
    }
}

/// A new inotify instance (non-blocking, close-on-exec).
pub(super) fn inotify() -> std::io::Result<OwnedFd> {
    // SAFETY: inotify_init1 takes flags only; the fd it answers is owned here.
    let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `raw` is a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Waits up to `timeout_ms` for events on the inotify instance `fd` and hands each one read to
/// `each` (watch descriptor, mask, cookie, name); false when none came. The held channel, if
/// any, is watched in the same poll and given back when a request is on it.
pub(super) fn read_events(
    fd: std::os::fd::RawFd,
    buf: &mut [u8],
    timeout_ms: i32,
    held: Option<&dyn super::HeldInput>,
    each: impl FnMut(i32, u32, u32, &str),
) -> bool {
    let pollfd = |fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // A negative fd is skipped by poll.
    let mut pfds = [
        pollfd(fd),
        pollfd(held.and_then(|h| h.watched()).unwrap_or(-1)),
    ];
    // SAFETY: two valid pollfds.
    if unsafe { libc::poll(pfds.as_mut_ptr(), 2, timeout_ms) } <= 0 {
        return false;
    }
    if pfds[1].revents != 0 {
        if let Some(h) = held {
            h.release();
        }
    }
    if pfds[0].revents == 0 {
        return false;
    }
    read_queued(fd, buf, each)
}

/// Hands each event queued on the inotify instance `fd` (non-blocking) to `each`, as
/// [`read_events`] does after its poll; false when none was queued. One system call where a
/// poll that would answer at once costs two.
pub(super) fn read_queued(
    fd: std::os::fd::RawFd,
    buf: &mut [u8],
    mut each: impl FnMut(i32, u32, u32, &str),
) -> bool {
    // SAFETY: reads into `buf`, at most its length.
    let len = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    if len <= 0 {
        return false;
    }
    let len = len as usize;
    let mut i = 0usize;
    const HDR: usize = std::mem::size_of::<libc::inotify_event>();
    while i + HDR <= len {
        // SAFETY: the kernel wrote a whole event header at `i` (checked above); read unaligned.
        let ev: libc::inotify_event =
            unsafe { std::ptr::read_unaligned(buf[i..].as_ptr() as *const libc::inotify_event) };
        let name_len = ev.len as usize;
        let end = (i + HDR + name_len).min(len);
        let raw = &buf[i + HDR..end];
        let name = String::from_utf8_lossy(raw.split(|b| *b == 0).next().unwrap_or(&[]));
        each(ev.wd, ev.mask, ev.cookie, &name);
        i += HDR + name_len;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(id: u64) -> Vec<(String, WatchOp)> {
        match events(id) {
            Ok((Reply::WatchEvents { events, .. }, _)) => {
                events.into_iter().map(|e| (e.name, e.op)).collect()
            }
            other => panic!("{other:?}"),
        }
    }

    fn wait_for(id: u64, n: usize) -> Vec<(String, WatchOp)> {
        let mut got = Vec::new();
        for _ in 0..200 {
            got.extend(drain(id));
            if got.len() >= n {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        got
    }

    #[test]
    fn a_recursive_watch_sees_every_change_in_order_and_hides_the_agents_temporary_files() {
        let dir = std::env::temp_dir().join(format!("torpor-watch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let root = dir.to_str().unwrap();
        let id = match start(root, true) {
            Ok((Reply::Watch { watch }, _)) => watch,
            other => panic!("{other:?}"),
        };
        use WatchOp::*;
        std::fs::write(dir.join("a"), b"x").unwrap();
        std::fs::set_permissions(
            dir.join("a"),
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .unwrap();
        std::fs::rename(dir.join("a"), dir.join("b")).unwrap();
        std::fs::remove_file(dir.join("b")).unwrap();
        std::fs::create_dir(dir.join("d")).unwrap();
        let want = [
            ("a", Create),
            ("a", Write),
            ("a", Chmod),
            ("a", Rename),
            ("b", Create),
            ("b", Remove),
            ("d", Create),
        ];
        let got = wait_for(id, want.len());
        let want: Vec<(String, WatchOp)> = want.iter().map(|(n, o)| (n.to_string(), *o)).collect();
        assert_eq!(got, want);
        // A folder made after the watch began is watched; an upload (temporary file renamed
        // into place) is a create and a write of its own name.
        std::fs::write(dir.join("d/.f.torpor-tmp"), b"y").unwrap();
        std::fs::rename(dir.join("d/.f.torpor-tmp"), dir.join("d/f")).unwrap();
        let got = wait_for(id, 2);
        assert_eq!(
            got,
            [("d/f".to_string(), Create), ("d/f".to_string(), Write)]
        );
        stop(id).unwrap();
        assert!(events(id).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
