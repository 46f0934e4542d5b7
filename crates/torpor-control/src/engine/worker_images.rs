//! Cluster mode's images: checkpoints live on the disk of the worker that wrote them and, once
//! uploaded, in the shared snapshot store; a worker's disk is a cache of the store (the
//! worker's side: `torpor_cluster::images`).
//!
//! ```text
//!   park:   checkpoint on worker W ─▶ W's own disk (durable) ─▶ record: Worker{W, dir, fallback}
//!           (W's slot is free now)      │ in the background
//!                                       ▼
//!   upload: W puts it into the store (only chunks the store lacks) ─▶ record: Store(snapshot)
//!           the fallback snapshot is retired; W keeps its copy for a wake there
//!   wake:   Worker{W,..}: restore on W (W gone: back to the fallback, said in last_error)
//!           Store(s):     any worker (the last one first: it may hold a copy), fetching s
//!           Golden:       any worker; the golden snapshot is fetched once per worker and kept
//!   templates: the root filesystem and the golden image are pinned snapshots with fixed ids
//!           (`rootfs-<template>-<build>`, `golden-<template>-<build>`)
//! ```
//!
//! On a single machine (no [`ImageHost`]) none of this applies: images are the engine's own
//! paths (`transitions.rs`).

use super::*;

use torpor_runtime::node::{ImageHost, PutImage, StoredFiles, Uploaded};

/// The fixed snapshot ids of a template's build.
pub(super) fn rootfs_snapshot(tpl: &TemplateRecord) -> String {
    format!("rootfs-{}-{}", tpl.name, tpl.created_at)
}

pub(super) fn golden_snapshot(tpl: &TemplateRecord) -> String {
    format!("golden-{}-{}", tpl.name, tpl.created_at)
}

/// Whether a start failed because its image was only on a worker that is gone.
pub(super) fn image_lost(e: &ControlError) -> bool {
    matches!(
        e,
        ControlError::Runtime(torpor_runtime::RuntimeError::ImageLost(_))
    )
}

impl Engine {
    /// The cluster's image host: `Some` when sandboxes run on workers with disks of their own.
    pub(super) fn image_host(&self) -> Option<&dyn ImageHost> {
        self.node.image_host()
    }

    /// What a start of a sandbox of `tpl` from `image` names (cluster mode): the image path on
    /// a worker (relative: its own image area; empty: none, fetch the snapshot) and the
    /// snapshots a worker without that path fetches.
    pub(super) fn worker_start(
        &self,
        tenant: &TenantId,
        tpl: &TemplateRecord,
        image: &ImageRef,
    ) -> Result<(PathBuf, StoredFiles)> {
        let mut stored = StoredFiles {
            rootfs: Some(rootfs_snapshot(tpl)),
            access: self.snapshots.access_for(tenant)?,
            ..StoredFiles::default()
        };
        let path = match image {
            ImageRef::Golden => {
                stored.image = Some(golden_snapshot(tpl));
                stored.keep_image = true;
                PathBuf::new()
            }
            ImageRef::Store(s) => {
                stored.image = Some(s.clone());
                PathBuf::new()
            }
            ImageRef::Worker { node, dir, .. } => {
                stored.image_on = Some(node.clone());
                PathBuf::from(dir)
            }
            // A record from before images moved through the store: a path every machine sees.
            ImageRef::Local(p) => p.clone(),
        };
        Ok((path, stored))
    }

    /// Cluster mode: what a sandbox whose worker-held image is lost goes back to, and why.
    pub(super) fn fall_back_from_lost(&self, rec: &mut SandboxRecord, e: &ControlError) {
        let ImageRef::Worker { node, taken_at, .. } = &rec.image else {
            return;
        };
        let lost_s = (now_millis() - taken_at).max(0) / 1000;
        let back = rec.image.fallback();
        let to = match &back {
            ImageRef::Store(_) => "its last snapshot in the store",
            _ => "its template's fresh state (it had no snapshot in the store yet)",
        };
        rec.last_error = Some(format!(
            "worker {node} was lost before the checkpoint taken at {} reached the snapshot \
             store; restored to {to} (the last {lost_s} s of work are lost)",
            format_millis(*taken_at)
        ));
        tracing::warn!(sandbox = %rec.id, worker = %node, error = %e, "image lost with its worker; falling back");
        rec.image = back;
    }

    /// What an upload of `rec`'s image puts: the tenant's store access, the sandbox's labels and
    /// its previous snapshot.
    fn put_of(&self, rec: &SandboxRecord) -> Result<PutImage> {
        Ok(PutImage {
            access: self.snapshots.access_for(&rec.tenant)?,
            labels: crate::snapshots::Snapshots::labels_for(
                &rec.tenant,
                vec![(
                    torpor_snapshot::store::LABEL_SANDBOX.to_string(),
                    rec.id.to_string(),
                )],
            ),
            id: None,
            pin: false,
            // The snapshot this image supersedes: the store holds most of its chunks already.
            parent: match &rec.image {
                ImageRef::Worker { fallback, .. } => fallback.clone(),
                _ => None,
            },
        })
    }

    /// Puts a sandbox's worker-held image into the store from its worker, under the sandbox's
    /// lock (the API's suspend, a fork, the idle policy): `rec` is Uploading and moves to
    /// Suspended on the new snapshot, or back to Parked.
    pub(super) async fn upload_from_worker(
        &self,
        rec: &mut SandboxRecord,
        host: &dyn ImageHost,
        cause: &str,
    ) -> Result<()> {
        let ImageRef::Worker { node, dir, .. } = rec.image.clone() else {
            return Ok(());
        };
        let t = Instant::now();
        match host.upload(&node, &dir, &self.put_of(rec)?).await {
            Ok(up) => self.record_upload(rec, up, cause, t).await,
            Err(e) => {
                rec.last_error = Some(format!("upload failed, still parked on worker {node}: {e}"));
                self.move_to(rec, SandboxState::Parked, "upload_failed")?;
                Err(e.into())
            }
        }
    }

    /// Moves `rec` (read under its lock, still on the uploaded worker image) onto the snapshot:
    /// Suspended if it was asleep (Uploading); a sandbox woken from that image meanwhile keeps
    /// its state and has the snapshot as its fallback. The snapshot it superseded is retired;
    /// the worker keeps its copy (a wake there reads it without a fetch).
    async fn record_upload(
        &self,
        rec: &mut SandboxRecord,
        up: Uploaded,
        cause: &str,
        t: Instant,
    ) -> Result<()> {
        self.store
            .set_snapshot_bytes(&up.snapshot, up.input_bytes)?;
        let old = std::mem::replace(&mut rec.image, ImageRef::Store(up.snapshot.clone()));
        let to = match rec.state {
            SandboxState::Uploading => SandboxState::Suspended,
            other => other,
        };
        self.move_to(rec, to, cause)?;
        // The superseded snapshot goes in the background: the caller holds the sandbox, and
        // a retire (and the worker's copy) is network work nothing waits for.
        if let (
            ImageRef::Worker {
                fallback: Some(f), ..
            },
            Some(engine),
        ) = (&old, self.me.upgrade())
        {
            let (tenant, f) = (rec.tenant.clone(), f.clone());
            tokio::spawn(async move {
                engine.remove_image(&tenant, &ImageRef::Store(f)).await;
            });
        }
        self.metrics
            .checkpoint_bytes
            .with_label_values(&["store_new"])
            .inc_by(up.bytes_written);
        if to == SandboxState::Suspended {
            self.metrics
                .transitions
                .with_label_values(&["suspended", cause])
                .inc();
        }
        if let ImageRef::Worker { node, .. } = &old {
            tracing::info!(sandbox = %rec.id, worker = %node, snapshot = %up.snapshot, state = %rec.state,
                ms = t.elapsed().as_millis() as u64, written = up.bytes_written,
                "checkpoint uploaded from its worker");
        }
        Ok(())
    }

    /// Right after a park: uploads the sandbox's image from its worker **without holding the
    /// sandbox** (a call meanwhile wakes it from the worker's copy, as if no upload ran), then
    /// records the snapshot under the sandbox's lock if the record still stands on that image
    /// (asleep: Suspended; woken from it: the snapshot becomes its fallback). A snapshot
    /// nothing stands on any more (re-parked, deleted, held by another controller) is retired.
    pub(super) fn upload_soon(&self, id: &SandboxId, node: &str) {
        if !self.image_host().is_some_and(|h| h.ready(node)) {
            return self.upload_holding(id);
        }
        let Some(engine) = self.me.upgrade() else {
            return;
        };
        let id = id.clone();
        tokio::spawn(async move {
            if let Err(e) = engine.upload_unlocked(&id).await {
                tracing::warn!(sandbox = %id, error = %e, "background upload failed");
            }
        });
    }

    /// Cluster mode, after a restart: the sandboxes parked on workers whose upload never
    /// finished (a controller stopped during it) are uploaded as their workers come back,
    /// instead of waiting for the idle policy's Suspended step. Those whose worker does not
    /// return within `within` (at least a minute: nothing is held meanwhile) are left as they
    /// are (a wake falls back if the worker is lost).
    pub(super) async fn upload_after_restart(
        self: Arc<Self>,
        mut parked: Vec<(SandboxId, String)>,
        within: Duration,
    ) {
        let deadline = tokio::time::Instant::now() + within.max(Duration::from_secs(60));
        while !parked.is_empty() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let Some(host) = self.image_host() else {
                return;
            };
            parked.retain(|(id, node)| {
                if !host.ready(node) {
                    return true;
                }
                let still = self.store.sandbox(id).ok().flatten().is_some_and(|r| {
                    r.state == SandboxState::Parked
                        && matches!(&r.image, ImageRef::Worker { node: n, .. } if n == node)
                });
                if still {
                    tracing::info!(sandbox = %id, worker = %node, "uploading a checkpoint whose upload a restart interrupted");
                    self.upload_soon(id, node);
                }
                false
            });
        }
    }

    /// [`Engine::upload_soon`] for a worker that takes no new sandboxes (draining): the upload
    /// holds the sandbox, so a call waits for it and then wakes the sandbox elsewhere from the
    /// store rather than on the draining worker.
    fn upload_holding(&self, id: &SandboxId) {
        let Some(engine) = self.me.upgrade() else {
            return;
        };
        let id = id.clone();
        tokio::spawn(async move {
            let slot = engine.slot(&id);
            let _guard = slot.state.clone().write_owned().await;
            let Ok(Some(rec)) = engine.store.sandbox(&id) else {
                return;
            };
            if rec.state != SandboxState::Parked || !matches!(rec.image, ImageRef::Worker { .. }) {
                return; // woken, deleted or uploaded meanwhile
            }
            if let Err(e) = engine.upload_locked(&id, "stored").await {
                tracing::warn!(sandbox = %id, error = %e, "background upload failed");
            }
        });
    }

    async fn upload_unlocked(&self, id: &SandboxId) -> Result<()> {
        let Some(rec) = self.store.sandbox(id)? else {
            return Ok(());
        };
        let (ImageRef::Worker { node, dir, .. }, SandboxState::Parked, Some(host)) =
            (rec.image.clone(), rec.state, self.image_host())
        else {
            return Ok(()); // woken, deleted or uploaded meanwhile
        };
        let t = Instant::now();
        let uploaded = host.upload(&node, &dir, &self.put_of(&rec)?).await;
        let slot = self.slot(id);
        let _guard = slot.state.clone().write_owned().await;
        let current = self.store.sandbox(id)?.filter(|r| {
            matches!(&r.image, ImageRef::Worker { node: n, dir: d, .. } if *n == node && *d == dir)
        });
        match (uploaded, current) {
            (Ok(up), Some(mut rec))
                if rec.controller.is_none()
                    || rec.controller.as_deref() == self.controller_name() =>
            {
                if rec.state == SandboxState::Parked {
                    self.move_to(&mut rec, SandboxState::Uploading, "stored")?;
                }
                self.record_upload(&mut rec, up, "stored", t).await
            }
            (Ok(up), _) => {
                self.snapshots.retire(&rec.tenant, &up.snapshot).await;
                Ok(())
            }
            (Err(e), Some(mut rec)) if rec.state == SandboxState::Parked => {
                rec.last_error = Some(format!("upload failed, still parked on worker {node}: {e}"));
                self.move_to(&mut rec, SandboxState::Parked, "upload_failed")?;
                Err(e.into())
            }
            (Err(e), _) => Err(e.into()),
        }
    }

    /// Cluster mode, after a template's root filesystem is ready on this controller's disk:
    /// puts it into the store (pinned, fixed id) for the workers.
    pub(super) async fn publish_rootfs(&self, tpl: &TemplateRecord) -> Result<()> {
        let labels = vec![(
            crate::snapshots::LABEL_ROOTFS.to_string(),
            tpl.name.to_string(),
        )];
        self.snapshots
            .put_pinned(
                &tpl.tenant,
                &rootfs_snapshot(tpl),
                labels,
                tpl.rootfs.clone(),
            )
            .await?;
        Ok(())
    }

    /// Cluster mode: a template's golden checkpoint, written on worker `node` as `dir`, into
    /// the store (pinned, fixed id). Returns its size.
    pub(super) async fn publish_golden(
        &self,
        tpl: &TemplateRecord,
        host: &dyn ImageHost,
        node: &str,
        dir: &str,
    ) -> Result<u64> {
        let put = PutImage {
            access: self.snapshots.access_for(&tpl.tenant)?,
            labels: crate::snapshots::Snapshots::labels_for(
                &tpl.tenant,
                vec![(
                    crate::snapshots::LABEL_GOLDEN.to_string(),
                    tpl.name.to_string(),
                )],
            ),
            id: Some(golden_snapshot(tpl)),
            pin: true,
            parent: None,
        };
        let up = host.upload(node, dir, &put).await?;
        Ok(up.input_bytes)
    }
}

/// A time for an error message (UTC, to the second).
pub(super) fn format_millis(ms: i64) -> String {
    let at = std::time::UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_seconds(at).to_string()
}

impl Engine {
    /// Looks at the workers' images every `orphan_image_grace` and removes the leftovers
    /// ([`Engine::sweep_worker_images`]) until shutdown (cluster mode).
    pub(super) async fn run_image_sweep(self: Arc<Self>) {
        let Some(grace) = self.cfg.controller.as_ref().map(|c| c.orphan_image_grace) else {
            return;
        };
        let mut interval = tokio::time::interval(grace.max(Duration::from_secs(1)));
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        interval.tick().await;
        loop {
            interval.tick().await;
            if self.shutting_down.load(Ordering::SeqCst) {
                return;
            }
            self.sweep_worker_images(grace).await;
        }
    }

    /// Removes the checkpoints on workers that were never uploaded, are older than `grace`
    /// and that no sandbox refers to: a sandbox's checkpoint whose worker was lost (the sandbox
    /// went back to its last snapshot) and came back, or whose sandbox was deleted while its
    /// worker was away. Uploaded copies are the workers' bounded cache, left to them; what is
    /// not a sandbox's checkpoint (a template build's) and what cannot be checked now (a store
    /// error) stays. Answers how many went.
    pub(super) async fn sweep_worker_images(&self, grace: Duration) -> usize {
        let Some(host) = self.image_host() else {
            return 0;
        };
        let mut removed = 0;
        for (node, images) in host.images().await {
            for image in images {
                if image.uploaded || image.age < grace {
                    continue;
                }
                let Some(id) = torpor_runtime::node::sandbox_of(&image.dir)
                    .and_then(|s| s.parse::<SandboxId>().ok())
                else {
                    continue;
                };
                let referred = match self.store.sandbox(&id) {
                    Ok(Some(rec)) => matches!(
                        &rec.image,
                        ImageRef::Worker { node: n, dir, .. } if *n == node && *dir == image.dir
                    ),
                    Ok(None) => false,
                    Err(e) => {
                        tracing::warn!(sandbox = %id, error = %e, "cannot check a worker's image; kept");
                        continue;
                    }
                };
                if referred {
                    continue;
                }
                tracing::info!(worker = %node, image = %image.dir, age_s = image.age.as_secs(),
                    "removing a checkpoint no sandbox refers to (never uploaded)");
                host.remove(&node, &image.dir).await;
                removed += 1;
            }
        }
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_in_errors_are_utc_dates() {
        assert_eq!(format_millis(0), "1970-01-01T00:00:00Z");
        assert_eq!(
            format_millis(951_782_400_000 + 3_723_000),
            "2000-02-29T01:02:03Z"
        );
    }
}
