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

use torpor_runtime::node::{ImageHost, PutImage, StoredFiles};

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

    /// Puts a sandbox's worker-held image into the store from its worker. The record moves to
    /// Suspended on the new snapshot; the one it superseded is retired; the worker keeps its
    /// copy (a wake there reads it without a fetch).
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
        let put = PutImage {
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
        };
        match host.upload(&node, &dir, &put).await {
            Ok(up) => {
                self.store
                    .set_snapshot_bytes(&up.snapshot, up.input_bytes)?;
                let old = std::mem::replace(&mut rec.image, ImageRef::Store(up.snapshot.clone()));
                self.move_to(rec, SandboxState::Suspended, cause)?;
                if let ImageRef::Worker {
                    fallback: Some(f), ..
                } = old
                {
                    self.remove_image(&rec.tenant, &ImageRef::Store(f)).await;
                }
                self.metrics
                    .checkpoint_bytes
                    .with_label_values(&["store_new"])
                    .inc_by(up.bytes_written);
                self.metrics
                    .transitions
                    .with_label_values(&["suspended", cause])
                    .inc();
                tracing::info!(sandbox = %rec.id, worker = %node, snapshot = %up.snapshot,
                    ms = t.elapsed().as_millis() as u64, written = up.bytes_written,
                    "checkpoint uploaded from its worker");
                Ok(())
            }
            Err(e) => {
                rec.last_error = Some(format!("upload failed, still parked on worker {node}: {e}"));
                self.move_to(rec, SandboxState::Parked, "upload_failed")?;
                Err(e.into())
            }
        }
    }

    /// Uploads a sandbox parked on a worker as soon as its lock is free (right after the park
    /// that released it), so that it can wake on any worker and survive its worker's loss.
    pub(super) fn upload_soon(&self, id: &SandboxId) {
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
            if engine.holder_in(SandboxState::Uploading) != rec.controller
                && rec.controller.is_some()
            {
                return;
            }
            if let Err(e) = engine.upload_locked(&id, "stored").await {
                tracing::warn!(sandbox = %id, error = %e, "background upload failed");
            }
        });
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
