//! What the usage sampler ([`crate::usage`]) reads from the engine, in one place so a rewrite
//! of the engine's internals has one small file to follow. It reads, for every slot whose state
//! lock is free at that instant (a sandbox mid-transition is skipped for that sample):
//! `Live::frozen` and, through the node's [`Resident`], `worker()` (on the runsc node, the
//! worker's cgroup name under `torpor/`), `memory()` and `net_stats()`'s tx bytes. It writes
//! nothing. It also names the database file (`cfg.data_dir/torpor.db`) and a sandbox's image
//! directory (`sandbox_dir`).

use super::*;

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
