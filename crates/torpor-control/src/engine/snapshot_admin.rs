//! Snapshot administration as the operator and tenants see it: list, inspect, pin, delete and
//! collect snapshots across the per-tenant stores (the store itself is `crate::snapshots`).

use std::collections::HashSet;

use torpor_snapshot::manifest::{ExtentData, FileKind};
use torpor_snapshot::{GcOptions, Manifest, SnapshotId, Store, StoreError};

use super::*;
use crate::snapshots::*;

impl Engine {
    fn snapshot_tenants(&self) -> Result<Vec<TenantId>> {
        let mut all = vec![TenantId::admin()];
        all.extend(
            self.tenants()?
                .into_iter()
                .map(|t| t.id)
                .filter(|t| *t != TenantId::admin()),
        );
        Ok(all)
    }

    /// Snapshot id -> sandboxes whose current image it is.
    fn snapshot_users(&self) -> Result<HashMap<String, Vec<String>>> {
        let mut users: HashMap<String, Vec<String>> = HashMap::new();
        for s in self.store.sandboxes()? {
            // A worker-held image's fallback is in use until the upload supersedes it.
            let stored = match &s.image {
                ImageRef::Store(snap) => Some(snap),
                ImageRef::Worker { fallback, .. } => fallback.as_ref(),
                _ => None,
            };
            if let Some(snap) = stored {
                users
                    .entry(snap.clone())
                    .or_default()
                    .push(s.id.to_string());
            }
        }
        Ok(users)
    }

    /// Finds the store holding `id` (tenants' stores are searched when encrypted).
    async fn locate_snapshot(&self, id: &str) -> Result<(Arc<Store>, Manifest)> {
        let sid = snapshot_id(id).map_err(|_| snapshot_not_found(id))?;
        for (_, store) in self.snapshots.stores_of(&self.snapshot_tenants()?)? {
            let s = store.clone();
            let want = sid.clone();
            match tokio::spawn(async move { s.load_manifest(&want).await })
                .await
                .map_err(|e| ControlError::Snapshot(format!("task failed: {e}")))?
            {
                Ok(m) => return Ok((store, m)),
                Err(StoreError::SnapshotNotFound { .. }) => continue,
                Err(e) => return Err(store_error(e)),
            }
        }
        Err(snapshot_not_found(id))
    }

    pub async fn list_snapshots(&self) -> Result<Vec<SnapshotSummary>> {
        let users = self.snapshot_users()?;
        let mut out = Vec::new();
        for (_, store) in self.snapshots.stores_of(&self.snapshot_tenants()?)? {
            let found = tokio::spawn(async move {
                let pinned = store.pinned().await?;
                let mut ms = Vec::new();
                for id in store.list_snapshots().await? {
                    match store.load_manifest(&id).await {
                        Ok(m) => ms.push((pinned.contains(&id), m)),
                        // Deleted between the listing and the read.
                        Err(StoreError::SnapshotNotFound { .. }) => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(ms)
            })
            .await
            .map_err(|e| ControlError::Snapshot(format!("task failed: {e}")))?
            .map_err(store_error)?;
            for (pinned, m) in found {
                let used = users.get(m.id.as_str()).cloned().unwrap_or_default();
                out.push(summary(&m, pinned, used));
            }
        }
        out.sort_by(|a, b| (a.created_unix_ms, &a.id).cmp(&(b.created_unix_ms, &b.id)));
        Ok(out)
    }

    pub async fn inspect_snapshot(&self, id: &str) -> Result<SnapshotDetail> {
        let (store, m) = self.locate_snapshot(id).await?;
        let pinned = tokio::spawn(async move { store.pinned().await })
            .await
            .map_err(|e| ControlError::Snapshot(format!("task failed: {e}")))?
            .map_err(store_error)?
            .contains(&m.id);
        let used = self
            .snapshot_users()?
            .remove(m.id.as_str())
            .unwrap_or_default();
        let unique: HashSet<_> = m.chunk_refs().map(|(c, _)| *c).collect();
        let file_list = m
            .files
            .iter()
            .map(|f| {
                let (kind, size, chunks, zero) = match &f.kind {
                    FileKind::Dir => ("dir", 0, 0, 0),
                    FileKind::Symlink { target } => ("symlink", target.len() as u64, 0, 0),
                    FileKind::Content {
                        size,
                        image,
                        extents,
                    } => (
                        if image.is_some() {
                            "gvisor_image"
                        } else {
                            "file"
                        },
                        *size,
                        extents
                            .iter()
                            .filter(|e| matches!(e.data, ExtentData::Chunk(_)))
                            .count() as u64,
                        extents
                            .iter()
                            .filter(|e| matches!(e.data, ExtentData::Zero))
                            .map(|e| e.len)
                            .sum(),
                    ),
                };
                SnapshotFile {
                    path: f.path.clone(),
                    kind: kind.into(),
                    mode: f.mode,
                    size,
                    chunks,
                    zero_bytes: zero,
                }
            })
            .collect();
        Ok(SnapshotDetail {
            summary: summary(&m, pinned, used),
            labels: m.labels.iter().cloned().collect(),
            chunking: [
                ("min".to_string(), m.chunking.min),
                ("avg".to_string(), m.chunking.avg),
                ("max".to_string(), m.chunking.max),
            ]
            .into_iter()
            .collect(),
            unique_chunks: unique.len() as u64,
            file_list,
        })
    }

    /// Verifies one snapshot, or every snapshot when `id` is `None`. Bad chunks are reported,
    /// never deleted.
    pub async fn verify_snapshots(&self, id: Option<&str>) -> Result<VerifyResult> {
        let mut targets: Vec<(Arc<Store>, SnapshotId)> = Vec::new();
        match id {
            Some(id) => {
                let (store, m) = self.locate_snapshot(id).await?;
                targets.push((store, m.id));
            }
            None => {
                for (_, store) in self.snapshots.stores_of(&self.snapshot_tenants()?)? {
                    let s = store.clone();
                    let ids = tokio::spawn(async move { s.list_snapshots().await })
                        .await
                        .map_err(|e| ControlError::Snapshot(format!("task failed: {e}")))?
                        .map_err(store_error)?;
                    targets.extend(ids.into_iter().map(|i| (store.clone(), i)));
                }
            }
        }
        let mut result = VerifyResult {
            snapshots_checked: 0,
            chunks_checked: 0,
            ok: true,
            problems: Vec::new(),
        };
        for (store, sid) in targets {
            let report = tokio::spawn(async move { store.verify(&sid).await })
                .await
                .map_err(|e| ControlError::Snapshot(format!("task failed: {e}")))?;
            let report = match report {
                Ok(r) => r,
                // Deleted while we walked the list.
                Err(StoreError::SnapshotNotFound { .. }) if id.is_none() => continue,
                Err(e) => return Err(store_error(e)),
            };
            result.snapshots_checked += 1;
            result.chunks_checked += report.chunks_checked;
            for p in report.problems {
                let message = error_chain(&p);
                let code = p.code().to_string();
                if let StoreError::ChunkMissing {
                    snapshot,
                    chunk,
                    path,
                }
                | StoreError::ChunkCorrupt {
                    snapshot,
                    chunk,
                    path,
                    ..
                } = p
                {
                    result.problems.push(VerifyProblem {
                        code,
                        snapshot: snapshot.to_string(),
                        chunk: chunk.to_hex(),
                        path,
                        message,
                    });
                }
            }
        }
        result.ok = result.problems.is_empty();
        if !result.ok {
            tracing::error!(
                problems = result.problems.len(),
                "snapshot verify found bad chunks"
            );
        }
        Ok(result)
    }

    pub async fn snapshot_stats(&self) -> Result<SnapshotStats> {
        let mut total = SnapshotStats::default();
        for (_, store) in self.snapshots.stores_of(&self.snapshot_tenants()?)? {
            let s = tokio::spawn(async move { store.stats().await })
                .await
                .map_err(|e| ControlError::Snapshot(format!("task failed: {e}")))?
                .map_err(store_error)?;
            total.logical_bytes += s.logical_bytes;
            total.stored_bytes += s.stored_bytes;
            total.chunks += s.chunks;
            total.snapshots += s.snapshots;
        }
        Ok(total)
    }

    /// Garbage collection: retention (newest N per sandbox; pinned snapshots, golden ones and
    /// those a sandbox depends on are kept), then mark and sweep. Safe against concurrent puts:
    /// the store's exclusive lock waits for puts in flight and holds new ones back.
    pub async fn gc_snapshots(&self, dry_run: bool) -> Result<GcResult> {
        let protect: HashSet<SnapshotId> = self
            .snapshot_users()?
            .into_keys()
            .filter_map(|s| SnapshotId::new(s).ok())
            .collect();
        let mut total = GcResult {
            dry_run,
            ..GcResult::default()
        };
        for (tenant, store) in self.snapshots.stores_of(&self.snapshot_tenants()?)? {
            let opts = GcOptions {
                keep_last_per_sandbox: self.snapshots.keep,
                dry_run,
                protect: protect.clone(),
                repack_below: self.snapshots.repack_below,
                // Small packs are merged whenever sparse ones are rewritten (`--repack-below`).
                merge_small: self.snapshots.repack_below.is_some_and(|b| b > 0.0),
            };
            let r = tokio::spawn(async move { store.gc(&opts).await })
                .await
                .map_err(|e| ControlError::Snapshot(format!("gc task failed: {e}")))?;
            let r = match r {
                Ok(r) => r,
                Err(e) => {
                    self.snapshots.gc_runs.with_label_values(&["failed"]).inc();
                    tracing::warn!(tenant = ?tenant, error = %error_chain(&e), "snapshot gc failed");
                    return Err(store_error(e));
                }
            };
            total.snapshots_kept += r.snapshots_kept;
            total
                .snapshots_removed
                .extend(r.snapshots_removed.iter().map(|s| s.to_string()));
            total.chunks_live += r.chunks_live;
            total.chunks_removed += r.chunks_removed;
            total.bytes_freed += r.bytes_freed;
            total.packs_removed += r.packs_removed;
            total.pack_bytes_live += r.pack_bytes_live;
            total.pack_bytes_used += r.pack_bytes_used;
            total.packs_repacked += r.packs_repacked;
            total.repack_packs_written += r.repack_packs_written;
            total.repack_bytes_written += r.repack_bytes_written;
            total.manifests_rewritten += r.manifests_rewritten;
        }
        self.snapshots.gc_runs.with_label_values(&["ok"]).inc();
        if !dry_run {
            let m = &self.snapshots.gc_removed;
            m.with_label_values(&["snapshots"])
                .inc_by(total.snapshots_removed.len() as u64);
            m.with_label_values(&["chunks"])
                .inc_by(total.chunks_removed);
            m.with_label_values(&["packs"]).inc_by(total.packs_removed);
            m.with_label_values(&["bytes"]).inc_by(total.bytes_freed);
            let r = &self.snapshots.gc_repacked;
            r.with_label_values(&["packs"]).inc_by(total.packs_repacked);
            r.with_label_values(&["packs_written"])
                .inc_by(total.repack_packs_written);
            r.with_label_values(&["bytes"])
                .inc_by(total.repack_bytes_written);
            r.with_label_values(&["manifests"])
                .inc_by(total.manifests_rewritten);
        }
        Ok(total)
    }

    /// Runs the collector every `--gc-interval` until shutdown.
    pub(crate) fn spawn_snapshot_gc(self: &Arc<Self>) {
        let Some(every) = self.snapshots.gc_interval else {
            return;
        };
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await; // the first tick is immediate
            loop {
                tick.tick().await;
                let Some(engine) = me.upgrade() else { return };
                if engine.check_running().is_err() {
                    return;
                }
                match engine.gc_snapshots(false).await {
                    Ok(r) => tracing::info!(
                        removed_snapshots = r.snapshots_removed.len(),
                        removed_chunks = r.chunks_removed,
                        freed = r.bytes_freed,
                        repacked = r.packs_repacked,
                        "scheduled snapshot gc"
                    ),
                    Err(e) => {
                        tracing::warn!(error = %e, code = e.code(), "scheduled snapshot gc failed")
                    }
                }
            }
        });
    }
}
