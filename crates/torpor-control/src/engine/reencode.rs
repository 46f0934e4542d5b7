//! Parked images made faster to wake. runsc writes a checkpoint's frames deflate-compressed,
//! and a restore inflates every one of them (a Python agent's 17.9 MB of state: 353 ms to
//! restore as runsc wrote it, 233 ms with stored frames, measured). After a park commits an
//! image on this machine (embedded mode), a background job rewrites it with stored (level-0)
//! frames ([`torpor_snapshot::gvisor::reencode_stored`]: the same inflated stream, the header
//! verbatim) and puts it in place of runsc's, so that the next wake restores it without
//! inflating. Nothing of it is on a call's path:
//! - started [`REENCODE_AFTER`] after the park (a sandbox woken sooner costs nothing), one job
//!   at a time, on a thread of its own at a lower CPU priority (nice 10), so that on a busy
//!   machine restores and checkpoints go first;
//! - written beside the image directory (`images/.tmp-reencode-<generation>`, which a start
//!   after a crash removes with the other `.tmp-*` leftovers), synced, and renamed
//!   over the image's file only while the sandbox is still Parked on that very image, under
//!   its slot's read lock taken without waiting (a wake or any transition under way wins: the
//!   job is dropped, `superseded`);
//! - skipped when the frames barely compress (incompressible memory: a restore has nothing to
//!   inflate, `nothing_to_gain`), and when the data directory's disk would be left with less
//!   than [`MIN_FREE_FRACTION`] or [`MIN_FREE_BYTES`] free (`low_disk`: a stored image is as
//!   large as the memory it holds);
//! - a crash in the middle loses nothing: the rename is atomic and either file restores the
//!   same sandbox.
//!
//! A template's golden snapshot is re-encoded the same way before it is committed (no sandbox
//! restores it yet, so in place, [`Engine::reencode_uncommitted`]): every create from it
//! restores without inflating. Its recorded size stays what runsc wrote (quotas and sizes
//! count that).
//!
//! Cluster workers' images are not re-encoded yet (their images are uploaded as they are).

use tokio::sync::Semaphore;
use torpor_snapshot::gvisor::{self, Reencoded};

use super::*;

/// Free space a re-encode leaves at least on the data directory's disk, as a fraction of it.
pub const MIN_FREE_FRACTION: f64 = 0.10;
/// Free space a re-encode leaves at least, in bytes.
pub const MIN_FREE_BYTES: u64 = 1 << 30;
/// The nice value of the re-encoding thread.
const NICE: i32 = 10;
/// How long an image stays parked before its re-encoding starts: a sandbox woken sooner (a
/// parking storm's churn) costs no re-encoding at all.
pub const REENCODE_AFTER: Duration = Duration::from_secs(2);

/// One re-encode at a time on this machine.
fn one_at_a_time() -> &'static Semaphore {
    static ONE: Semaphore = Semaphore::const_new(1);
    &ONE
}

impl Engine {
    /// Queues the re-encoding of the image a park just committed at `dir` for sandbox `id`.
    pub(super) fn reencode_soon(&self, id: &SandboxId, dir: &Path) {
        if !self.cfg.reencode_images {
            return;
        }
        let Some(engine) = self.me.upgrade() else {
            return;
        };
        let (id, dir) = (id.clone(), dir.to_path_buf());
        tokio::spawn(async move {
            tokio::time::sleep(REENCODE_AFTER).await;
            let result = engine.reencode(&id, &dir).await;
            engine.metrics.reencodes.with_label_values(&[result]).inc();
        });
    }

    /// Re-encodes, in place, the image files of `dir`: a checkpoint that nothing restores yet
    /// (a golden snapshot before its commit). Nothing to gain, too little disk or a failure
    /// leave a file as runsc wrote it.
    pub(super) async fn reencode_uncommitted(&self, dir: &Path) {
        if !self.cfg.reencode_images {
            return;
        }
        let _turn = one_at_a_time().acquire().await;
        let Some(files) = image_files(dir) else {
            return;
        };
        for src in files {
            let name = src.file_name().unwrap_or_default().to_string_lossy();
            let tmp = dir.join(format!(".{name}.stored"));
            let t = Instant::now();
            match rewrite_off_thread(src.clone(), tmp.clone()).await {
                Ok(Job::Done {
                    original, written, ..
                }) if std::fs::rename(&tmp, &src).is_ok() => {
                    tracing::info!(image = %src.display(), original, written,
                        ms = t.elapsed().as_millis() as u64, "golden image re-encoded with stored frames");
                }
                Ok(Job::LowDisk { needed, free }) => {
                    tracing::info!(image = %src.display(), needed, free, "golden image not re-encoded: the disk would be left too full");
                }
                Ok(_) => {
                    let _ = std::fs::remove_file(&tmp);
                }
                Err(e) => {
                    let _ = std::fs::remove_file(&tmp);
                    tracing::warn!(image = %src.display(), error = %e, "golden image not re-encoded");
                }
            }
        }
    }

    /// Whether sandbox `id` is Parked on the image at `dir`.
    fn parked_on(&self, id: &SandboxId, dir: &Path) -> bool {
        self.store.sandbox(id).ok().flatten().is_some_and(|r| {
            r.state == SandboxState::Parked
                && matches!(&r.image, ImageRef::Local(d) if d.as_path() == dir)
        })
    }

    /// Re-encodes every image file in `dir`; answers the result's label.
    async fn reencode(&self, id: &SandboxId, dir: &Path) -> &'static str {
        let _turn = one_at_a_time().acquire().await;
        if !self.parked_on(id, dir) {
            return "superseded";
        }
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
                    if !self.put_in_place(id, dir, &src, &tmp, &was).await {
                        let _ = std::fs::remove_file(&tmp);
                        return "superseded";
                    }
                    tracing::info!(sandbox = %id, image = %src.display(), original, written,
                        ms = t.elapsed().as_millis() as u64, "parked image re-encoded with stored frames");
                    result = "done";
                }
                Ok(Job::Left) => {}
                Ok(Job::LowDisk { needed, free }) => {
                    tracing::info!(sandbox = %id, needed, free, "parked image not re-encoded: the disk would be left too full");
                    return "low_disk";
                }
                Err(e) => {
                    let _ = std::fs::remove_file(&tmp);
                    tracing::warn!(sandbox = %id, image = %src.display(), error = %e, "parked image not re-encoded");
                    return "failed";
                }
            }
        }
        result
    }

    /// Renames the re-encoded `tmp` over `src` if the sandbox is still Parked on `dir` and
    /// `src` is the file that was read (`was`), holding the sandbox's slot (no transition)
    /// meanwhile; false (nothing renamed) otherwise.
    async fn put_in_place(
        &self,
        id: &SandboxId,
        dir: &Path,
        src: &Path,
        tmp: &Path,
        was: &FileStamp,
    ) -> bool {
        // Looked at first without the slot: a sandbox deleted meanwhile gets no slot back.
        if !self.parked_on(id, dir) {
            return false;
        }
        let slot = self.slot(id);
        let Ok(guard) = slot.state.clone().try_read_owned() else {
            return false;
        };
        if guard.live.is_some()
            || !self.parked_on(id, dir)
            || FileStamp::of(src).as_ref() != Some(was)
        {
            return false;
        }
        let renamed = std::fs::rename(tmp, src).is_ok();
        if renamed {
            // The rename itself made durable (either file restores the same sandbox).
            if let Ok(d) = std::fs::File::open(dir) {
                let _ = d.sync_all();
            }
        }
        drop(guard);
        renamed
    }
}

/// The files of the image directory `dir` (runsc's `checkpoint.img`, and whatever else it
/// wrote); `None` when it cannot be read.
fn image_files(dir: &Path) -> Option<Vec<PathBuf>> {
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
fn reencode_tmp(dir: &Path) -> PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    dir.with_file_name(format!(".tmp-reencode-{name}"))
}

/// What a file looked like when it was read: rewritten only if it still does.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileStamp {
    len: u64,
    modified: Option<std::time::SystemTime>,
    ino: u64,
}

impl FileStamp {
    fn of(path: &Path) -> Option<FileStamp> {
        use std::os::unix::fs::MetadataExt as _;
        let m = std::fs::metadata(path).ok()?;
        Some(FileStamp {
            len: m.len(),
            modified: m.modified().ok(),
            ino: m.ino(),
        })
    }
}

enum Job {
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
async fn rewrite_off_thread(src: PathBuf, tmp: PathBuf) -> std::io::Result<Job> {
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
