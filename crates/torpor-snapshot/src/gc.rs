//! Garbage collection: retention (keep the last N snapshots per sandbox, never a pinned one),
//! then repacking of sparse packs (see `repack`, when `GcOptions::repack_below` is set), then
//! mark chunks from every remaining manifest and sweep the rest. A pack is live while a
//! remaining manifest locates a chunk in it; every other pack goes (its index first), those
//! of failed puts and those just repacked included.
//!
//! Safety: the collector holds the store's exclusive lock (see `lock`), so no put or fork is in
//! flight while it marks and sweeps, and none starts until it is done. Any manifest that cannot
//! be read or decoded aborts the run before anything is deleted: an unreadable manifest's
//! chunks cannot be told apart from garbage. Manifests are deleted before chunks, so a crash
//! mid-run leaves only orphan chunks, which the next run removes.

use std::collections::{HashMap, HashSet};

use futures::{StreamExt, TryStreamExt};

use crate::error::StoreError;
use crate::id::{ChunkId, SnapshotId};
use crate::lock::LockKind;
use crate::manifest::Manifest;
use crate::pack::PackId;
use crate::store::{Store, DEFAULT_PACK_BYTES, LABEL_SANDBOX};

#[derive(Debug, Clone, Default)]
pub struct GcOptions {
    /// Keep this many newest snapshots per `sandbox` label; `None` keeps all. Snapshots without
    /// the label and pinned snapshots are always kept.
    pub keep_last_per_sandbox: Option<usize>,
    /// Report what would be removed without removing it.
    pub dry_run: bool,
    /// Snapshots retention never removes, besides pinned ones: those a sandbox currently
    /// depends on (the daemon passes them; they are not pins because they change often).
    pub protect: HashSet<SnapshotId>,
    /// Rewrite the live packs of which the remaining snapshots use less than this fraction of
    /// the bytes (see `repack`); `None` keeps every live pack whole, however little is used.
    pub repack_below: Option<f64>,
    /// Also merge the small live packs (under a quarter of the store's pack size: most are
    /// the last pack of a put that changed little) into full ones, when two or more are (or
    /// one, beside sparse packs being rewritten anyway), within the same run's budget.
    pub merge_small: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    pub snapshots_kept: u64,
    pub snapshots_removed: Vec<SnapshotId>,
    pub chunks_live: u64,
    pub chunks_removed: u64,
    /// Packs removed (each with its index); their bytes are in `bytes_freed`.
    pub packs_removed: u64,
    pub packs_live: u64,
    /// Bytes of the live packs, and of the chunks in them that remaining snapshots use.
    pub pack_bytes_live: u64,
    pub pack_bytes_used: u64,
    /// Bytes of every object removed (snapshots' manifests aside): chunks, packs, indexes.
    pub bytes_freed: u64,
    /// Sparse packs rewritten (their used chunks copied, then removed with the unreferenced
    /// ones: they are in `packs_removed` too), the packs written for them and their bytes
    /// (indexes included: the space reclaimed is `bytes_freed - repack_bytes_written`), and the
    /// manifests rewritten to the new locations. A dry run counts the sparse packs and their
    /// used bytes.
    pub packs_repacked: u64,
    pub repack_packs_written: u64,
    pub repack_bytes_written: u64,
    pub manifests_rewritten: u64,
}

impl Store {
    pub async fn gc(&self, opts: &GcOptions) -> Result<GcReport, StoreError> {
        let guard = self.lock(LockKind::Exclusive).await?;
        let result = self.gc_locked(opts, &guard).await;
        guard.release().await;
        result
    }

    /// Checks that the exclusive lock is still fresh before each step that writes or removes
    /// (see `lock`: a collector that could not renew it may have been taken for dead, and a put
    /// may be under way).
    async fn gc_locked(
        &self,
        opts: &GcOptions,
        guard: &crate::lock::LockGuard,
    ) -> Result<GcReport, StoreError> {
        let ids = self.list_snapshots().await?;
        let pinned = self.pinned().await?;
        let mut manifests = Vec::with_capacity(ids.len());
        for id in &ids {
            manifests.push(self.load_manifest(id).await?);
        }

        let mut remove: HashSet<SnapshotId> = HashSet::new();
        if let Some(keep) = opts.keep_last_per_sandbox {
            let mut by_sandbox: HashMap<&str, Vec<(u64, &SnapshotId)>> = HashMap::new();
            for m in &manifests {
                if let Some(sb) = m.label(LABEL_SANDBOX) {
                    by_sandbox
                        .entry(sb)
                        .or_default()
                        .push((m.created_unix_ms, &m.id));
                }
            }
            for (_, mut snaps) in by_sandbox {
                snaps.sort_by(|a, b| b.cmp(a));
                for (_, id) in snaps.into_iter().skip(keep) {
                    if !pinned.contains(id) && !opts.protect.contains(id) {
                        remove.insert(id.clone());
                    }
                }
            }
        }

        let mut kept: Vec<Manifest> = manifests
            .into_iter()
            .filter(|m| !remove.contains(&m.id))
            .collect();
        let packs = self.backend().list(&self.area("packs")).await?;
        let mut repacked = crate::repack::Repacked::default();
        let below = opts.repack_below.filter(|b| *b > 0.0);
        if below.is_some() || opts.merge_small {
            let sizes = packs
                .iter()
                .filter_map(|o| Some((PackId::from_hex(o.key.name()).ok()?, o.size)))
                .collect();
            let small_under = opts.merge_small.then(|| {
                self.config().pack_bytes.unwrap_or(DEFAULT_PACK_BYTES) as u64
                    / crate::repack::SMALL_PACK_DIVISOR
            });
            let chosen = crate::repack::packs_to_repack(
                &live_locations(&kept),
                &sizes,
                below.unwrap_or(0.0),
                small_under,
            );
            guard.check_fresh()?;
            repacked = self.repack(&mut kept, &chosen, opts.dry_run).await?;
        }
        // Loose chunks are marked by id, packed ones by their pack (and location, for the
        // used bytes).
        let mut live: HashSet<ChunkId> = HashSet::new();
        for m in &kept {
            live.extend(
                m.chunk_refs()
                    .map(|(c, _)| *c)
                    .filter(|c| !m.packs.contains_key(c)),
            );
        }
        let live_locs = live_locations(&kept);
        let live_packs: HashSet<PackId> = live_locs.iter().map(|l| l.pack).collect();
        let mut report = GcReport {
            snapshots_kept: kept.len() as u64,
            chunks_live: (live.len() + live_locs.len()) as u64,
            pack_bytes_used: live_locs.iter().map(|l| u64::from(l.len)).sum(),
            packs_repacked: repacked.packs,
            repack_packs_written: repacked.packs_written,
            repack_bytes_written: repacked.bytes_written,
            manifests_rewritten: repacked.manifests_rewritten,
            ..GcReport::default()
        };
        let mut removed: Vec<SnapshotId> = remove.into_iter().collect();
        removed.sort();
        if !opts.dry_run {
            guard.check_fresh()?;
            for id in &removed {
                self.backend()
                    .delete_durably(&self.manifest_key(id))
                    .await?;
            }
        }
        report.snapshots_removed = removed;

        let mut garbage = Vec::new();
        for o in self.backend().list(&self.area("chunks")).await? {
            match ChunkId::from_hex(o.key.name()) {
                Ok(id) if live.contains(&id) => {}
                // Unreferenced chunks and stray objects under chunks/ alike.
                _ => garbage.push(o),
            }
        }
        report.chunks_removed = garbage.len() as u64;
        report.bytes_freed = garbage.iter().map(|o| o.size).sum();
        // Indexes before packs: a pack never outlives its index unnoticed (the next run
        // removes an index-less pack as it removes any unreferenced one).
        let unreferenced = |o: &crate::backend::ObjectInfo| {
            PackId::from_hex(o.key.name()).map_or(true, |p| !live_packs.contains(&p))
        };
        for o in self.backend().list(&self.area("packidx")).await? {
            if unreferenced(&o) {
                report.bytes_freed += o.size;
                garbage.push(o);
            }
        }
        // Listed again after a repack: the packs it wrote are live.
        let packs = if repacked.packs_written > 0 {
            self.backend().list(&self.area("packs")).await?
        } else {
            packs
        };
        for o in packs {
            if unreferenced(&o) {
                report.packs_removed += 1;
                report.bytes_freed += o.size;
                garbage.push(o);
            } else {
                report.packs_live += 1;
                report.pack_bytes_live += o.size;
            }
        }
        if !opts.dry_run {
            guard.check_fresh()?;
            let backend = self.backend().clone();
            let (packs, rest): (Vec<_>, Vec<_>) = garbage
                .into_iter()
                .partition(|o| o.key.as_str().starts_with(&self.area("packs/")));
            for batch in [rest, packs] {
                futures::stream::iter(batch.into_iter().map(|o| {
                    let backend = backend.clone();
                    async move { backend.delete(&o.key).await }
                }))
                .buffer_unordered(self.config().parallelism.max(1))
                .try_collect::<Vec<()>>()
                .await?;
            }
        }
        tracing::info!(
            removed_snapshots = report.snapshots_removed.len(),
            removed_chunks = report.chunks_removed,
            removed_packs = report.packs_removed,
            repacked_packs = report.packs_repacked,
            freed = report.bytes_freed,
            dry_run = opts.dry_run,
            "garbage collection done"
        );
        Ok(report)
    }
}

/// Every distinct location the manifests give a packed chunk.
fn live_locations(manifests: &[Manifest]) -> HashSet<crate::pack::PackLoc> {
    manifests
        .iter()
        .flat_map(|m| m.packs.values().copied())
        .collect()
}
