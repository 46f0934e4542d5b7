//! Rewriting checkpoint images with stored frames off every call's path, shared by the node's
//! engine (parked images, golden snapshots) and cluster workers (their local copies of uploaded
//! images): one job at a time per process, on a thread of its own at a lower CPU priority
//! ([`NICE`]), never leaving the disk with less than [`MIN_FREE_FRACTION`] or
//! [`MIN_FREE_BYTES`] free. The rewrite goes to a temporary file; putting it in place (a rename,
//! only if the image is still the one that was read: [`FileStamp`]) is the caller's, who knows
//! whether anything still restores from it.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Instant;

use tokio::sync::Semaphore;

use crate::gvisor::{self, Reencoded};

/// Free space a re-encode leaves at least on the data directory's disk, as a fraction of it.
pub const MIN_FREE_FRACTION: f64 = 0.10;
/// Free space a re-encode leaves at least, in bytes.
pub const MIN_FREE_BYTES: u64 = 1 << 30;
/// The nice value of the re-encoding thread.
pub const NICE: i32 = 10;

/// One re-encode at a time on this machine.
pub fn one_at_a_time() -> &'static Semaphore {
    static ONE: Semaphore = Semaphore::const_new(1);
    &ONE
}

/// The files of the image directory `dir` (runsc's `checkpoint.img`, and whatever else it
/// wrote); `None` when it cannot be read.
pub fn image_files(dir: &Path) -> Option<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).ok()?;
    Some(
        entries
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
            .map(|e| e.path())
            .collect(),
    )
}

/// Where the re-encoding of the image directory `dir` is written: beside it, in the same
/// directory of images (the same filesystem, for the rename), never inside it (an upload of
/// the image directory must not take it).
pub fn reencode_tmp(dir: &Path) -> PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    dir.with_file_name(format!(".tmp-reencode-{name}"))
}

/// What a file looked like when it was read: rewritten only if it still does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileStamp {
    len: u64,
    modified: Option<std::time::SystemTime>,
    ino: u64,
}

impl FileStamp {
    pub fn of(path: &Path) -> Option<FileStamp> {
        use std::os::unix::fs::MetadataExt as _;
        let m = std::fs::metadata(path).ok()?;
        Some(FileStamp {
            len: m.len(),
            modified: m.modified().ok(),
            ino: m.ino(),
        })
    }
}

pub enum Job {
    Done {
        original: u64,
        written: u64,
        was: FileStamp,
    },
    /// Not an image, or nothing to gain.
    Left,
    LowDisk {
        needed: u64,
        free: u64,
    },
}

/// Re-encodes `src` into `tmp` on a thread of its own at [`NICE`].
pub async fn rewrite_off_thread(src: PathBuf, tmp: PathBuf) -> std::io::Result<Job> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("reencode".into())
        .spawn(move || {
            // SAFETY: setpriority on this thread only (a thread id is a process id to it).
            unsafe {
                let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                libc::setpriority(libc::PRIO_PROCESS, tid, NICE);
            }
            let _ = tx.send(rewrite(&src, &tmp));
        })?;
    rx.await
        .unwrap_or_else(|_| Err(std::io::Error::other("the re-encoding thread ended")))
}

fn rewrite(src: &Path, tmp: &Path) -> std::io::Result<Job> {
    let Some(was) = FileStamp::of(src) else {
        return Ok(Job::Left);
    };
    let mut free_now = 0;
    let room = |needed: u64| match disk_space(tmp.parent().unwrap_or(Path::new("/"))) {
        Some((free, total)) => {
            free_now = free;
            let floor = ((total as f64 * MIN_FREE_FRACTION) as u64).max(MIN_FREE_BYTES);
            free >= needed.saturating_add(floor)
        }
        None => false,
    };
    let _ = std::fs::remove_file(tmp);
    match gvisor::reencode_stored(src, tmp, room)? {
        Reencoded::Done { original, written } => Ok(Job::Done {
            original,
            written,
            was,
        }),
        Reencoded::NoRoom { needed } => Ok(Job::LowDisk {
            needed,
            free: free_now,
        }),
        Reencoded::NotAnImage | Reencoded::NothingToGain { .. } => Ok(Job::Left),
    }
}

/// (free, total) bytes of the filesystem holding `path`.
fn disk_space(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: statvfs writes into `st`, a statvfs on our stack; `c` is NUL-terminated.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    let frsize = st.f_frsize as u64;
    Some((st.f_bavail as u64 * frsize, st.f_blocks as u64 * frsize))
}

/// Re-encodes every image file of `dir` (the caller holds a turn of [`one_at_a_time`]), each
/// put in place by `place(src, tmp, was)`, which renames `tmp` over `src` only if nothing
/// restores from it and it is still what was read, and answers whether it did (false:
/// superseded, the temporary file is removed). Answers the outcome's label, as
/// `torpor_parked_reencodes_total{result}` counts them: `done`, `nothing_to_gain`,
/// `superseded`, `low_disk` or `failed`. `what` and `of` name the image in the log lines.
pub async fn reencode_dir<F, Fut>(dir: &Path, what: &str, of: &str, mut place: F) -> &'static str
where
    F: FnMut(PathBuf, PathBuf, FileStamp) -> Fut,
    Fut: Future<Output = bool>,
{
    let Some(files) = image_files(dir) else {
        return "superseded";
    };
    let mut result = "nothing_to_gain";
    for src in files {
        let tmp = reencode_tmp(dir);
        let t = Instant::now();
        match rewrite_off_thread(src.clone(), tmp.clone()).await {
            Ok(Job::Done {
                original,
                written,
                was,
            }) => {
                if !place(src.clone(), tmp.clone(), was).await {
                    let _ = std::fs::remove_file(&tmp);
                    return "superseded";
                }
                tracing::info!(of, image = %src.display(), original, written,
                    ms = t.elapsed().as_millis() as u64, "{what} re-encoded with stored frames");
                result = "done";
            }
            Ok(Job::Left) => {}
            Ok(Job::LowDisk { needed, free }) => {
                tracing::info!(
                    of,
                    needed,
                    free,
                    "{what} not re-encoded: the disk would be left too full"
                );
                return "low_disk";
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                tracing::warn!(of, image = %src.display(), error = %e, "{what} not re-encoded");
                return "failed";
            }
        }
    }
    result
}
