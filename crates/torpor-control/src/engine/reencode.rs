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
//!   than `torpor_snapshot::reencode`'s `MIN_FREE_FRACTION` or `MIN_FREE_BYTES` free (`low_disk`: a stored image is as
//!   large as the memory it holds);
//! - a crash in the middle loses nothing: the rename is atomic and either file restores the
//!   same sandbox.
//!
//! A template's golden snapshot is re-encoded the same way before it is committed (no sandbox
//! restores it yet, so in place, [`Engine::reencode_uncommitted`]): every create from it
//! restores without inflating. Its recorded size stays what runsc wrote (quotas and sizes
//! count that).
//!
//! Cluster workers re-encode their local copies of uploaded images the same way
//! (`torpor-cluster`'s `images.rs`); the machinery is `torpor_snapshot::reencode`.

use torpor_snapshot::reencode::{
    image_files, one_at_a_time, reencode_dir, rewrite_off_thread, FileStamp, Job,
};

use super::*;

/// How long an image stays parked before its re-encoding starts: a sandbox woken sooner (a
/// parking storm's churn) costs no re-encoding at all.
pub const REENCODE_AFTER: Duration = Duration::from_secs(2);

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
        reencode_dir(
            dir,
            "parked image",
            id.as_str(),
            |src, tmp, was| async move { self.put_in_place(id, dir, &src, &tmp, &was).await },
        )
        .await
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
