//! What the usage sampler ([`crate::usage`]) reads from the engine, in one place so a rewrite
//! of the engine's internals has one small file to follow. It reads, for every slot whose state
//! lock is free at that instant (a sandbox mid-transition is skipped for that sample):
//! `Live::frozen` and, through the node's [`Resident`], `worker()` (on the runsc node, the
//! worker's cgroup name under `torpor/`), `memory()` and `net_stats()`'s tx bytes. It writes
//! nothing. It also names the database file (`cfg.data_dir/torpor.db`) and a sandbox's image
//! directory (`sandbox_dir`).

use super::*;
use std::collections::HashSet;

/// One resident sandbox as the sampler sees it.
#[derive(Debug, Clone)]
pub struct ResidentProbe {
    pub sandbox: SandboxId,
    pub frozen: bool,
    /// Its worker's name: on the runsc node its cgroup under `torpor/`, whose `cpuacct.usage`
    /// the sampler reads.
    pub cgroup: String,
    /// RSS and shared memory of its memory cgroup.
    pub memory_bytes: Option<u64>,
    /// Bytes it sent through its interface since its wake; `None` without a network.
    pub tx_bytes: Option<u64>,
}

impl Engine {
    /// The database file the usage records live in (the state store's).
    pub fn usage_db_path(&self) -> std::path::PathBuf {
        self.cfg.data_dir.join("torpor.db")
    }

    /// Where a sleeping sandbox's local checkpoint image lives.
    pub fn usage_image_dir(&self, id: &SandboxId) -> std::path::PathBuf {
        self.sandbox_dir(id)
    }

    /// Every resident sandbox whose state can be read without waiting.
    pub fn usage_probe(&self) -> Vec<ResidentProbe> {
        let slots: Vec<(SandboxId, Arc<Slot>)> = {
            let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            slots.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        slots
            .into_iter()
            .filter_map(|(id, slot)| {
                let guard = slot.state.try_read().ok()?;
                let live = guard.live.as_ref()?;
                Some(ResidentProbe {
                    sandbox: id,
                    frozen: live.frozen,
                    cgroup: live.resident.worker().to_string(),
                    memory_bytes: live.resident.memory(),
                    tx_bytes: live.resident.net_stats().map(|n| n.tx_bytes),
                })
            })
            .collect()
    }
}

/// A sandbox's worker group's CPU time (`cpuacct.usage`, ns) read just before the sandbox left
/// it (park, delete): the sampler counts what it used since its last sample, which would
/// otherwise go with the group or to the group's next holder.
#[derive(Debug, Clone)]
pub struct CpuAtRelease {
    pub tenant: TenantId,
    pub sandbox: SandboxId,
    pub cgroup: String,
    pub cpu_ns: u64,
}

/// Readings kept for the sampler at most (a daemon without one drops the oldest).
const CPU_AT_RELEASE_MAX: usize = 4096;

impl Engine {
    /// Notes `resident`'s CPU time as it leaves its worker (see [`CpuAtRelease`]).
    pub(super) fn note_cpu_at_release(
        &self,
        tenant: &TenantId,
        sandbox: &SandboxId,
        resident: &dyn Resident,
    ) {
        let cgroup = resident.worker().to_string();
        let Some(cpu_ns) = crate::usage::cpuacct_of(&cgroup) else {
            return;
        };
        let mut v = self
            .cpu_at_release
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if v.len() >= CPU_AT_RELEASE_MAX {
            v.remove(0);
        }
        v.push(CpuAtRelease {
            tenant: tenant.clone(),
            sandbox: sandbox.clone(),
            cgroup,
            cpu_ns,
        });
    }

    /// The readings noted since the last call, oldest first.
    pub fn take_cpu_at_release(&self) -> Vec<CpuAtRelease> {
        std::mem::take(
            &mut *self
                .cpu_at_release
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        )
    }

    /// Bytes of the snapshot store held for each sandbox whose current image is there
    /// (Suspended), deduplication-fair: every chunk its image references is counted once and
    /// split evenly among the sandboxes whose current images reference it (logical chunk
    /// length; compression is not seen). Reads the sandboxes' image refs, the tenants, and
    /// each referenced manifest through `snapshots.stores_of`.
    pub async fn usage_store_shares(&self) -> Result<HashMap<SandboxId, f64>> {
        let mut users: HashMap<String, Vec<SandboxId>> = HashMap::new();
        for s in self.store.sandboxes()? {
            if let ImageRef::Store(snap) = &s.image {
                users.entry(snap.clone()).or_default().push(s.id.clone());
            }
        }
        let mut out = HashMap::new();
        if users.is_empty() {
            return Ok(out);
        }
        let mut tenants = vec![TenantId::admin()];
        tenants.extend(
            self.tenants()?
                .into_iter()
                .map(|t| t.id)
                .filter(|t| *t != TenantId::admin()),
        );
        // Pass 1: how many sandboxes reference each chunk (once per image that has it). The
        // images' holders are disjoint (a sandbox has one current image), so counts add up
        // without comparing holders: this stays linear at 10,000 forks of one image, where a
        // holder list per chunk was quadratic and held a runtime thread for minutes.
        let mut chunks: HashMap<torpor_snapshot::ChunkId, (u64, u64)> = HashMap::new();
        let mut images = Vec::new();
        for (_, store) in self.snapshots.stores_of(&tenants)? {
            let ids = store
                .list_snapshots()
                .await
                .map_err(crate::snapshots::store_error)?;
            for id in ids {
                let Some(holders) = users.get(id.as_str()) else {
                    continue;
                };
                let Some(m) = manifest_if_there(&store, &id).await? else {
                    continue;
                };
                let mut seen = HashSet::new();
                for (chunk, len) in m.chunk_refs() {
                    if seen.insert(*chunk) {
                        chunks.entry(*chunk).or_insert((len, 0)).1 += holders.len() as u64;
                    }
                }
                images.push((store.clone(), id, holders));
                tokio::task::yield_now().await;
            }
        }
        // Pass 2: an image's share is the sum of its chunks' lengths, each split among the
        // sandboxes that reference it; every holder of the image has that share.
        for (store, id, holders) in images {
            let Some(m) = manifest_if_there(&store, &id).await? else {
                continue;
            };
            let mut seen = HashSet::new();
            let share: f64 = m
                .chunk_refs()
                .filter(|(chunk, _)| seen.insert(*chunk))
                .filter_map(|(chunk, _)| chunks.get(chunk))
                .map(|&(len, n)| len as f64 / n.max(1) as f64)
                .sum();
            for h in holders {
                out.insert(h.clone(), share);
            }
            tokio::task::yield_now().await;
        }
        Ok(out)
    }
}

/// The manifest of `id`, or `None` when it was deleted since the listing.
async fn manifest_if_there(
    store: &torpor_snapshot::Store,
    id: &torpor_snapshot::SnapshotId,
) -> Result<Option<torpor_snapshot::Manifest>> {
    match store.load_manifest(id).await {
        Ok(m) => Ok(Some(m)),
        Err(torpor_snapshot::StoreError::SnapshotNotFound { .. }) => Ok(None),
        Err(e) => Err(crate::snapshots::store_error(e)),
    }
}
