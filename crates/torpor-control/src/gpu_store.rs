//! GPU shares in the state store: one row per sandbox that holds a share (`held`: its
//! allocation and the MIG devices created for it) or sleeps with a ticket to get it back
//! (`sleeping`). [`crate::gpu::NodeGpus`] writes a row on every acquire and release and reads
//! them back at start, so a daemon restart keeps every sandbox's share.

use rusqlite::params;
use serde::{Deserialize, Serialize};
use torpor_core::SandboxId;
use torpor_gpu::ids::GpuIndex;
use torpor_gpu::inject::MigDevice;
use torpor_gpu::ledger::Allocation;
use torpor_gpu::mig::MigInstance;
use torpor_gpu::sleep::SleepTicket;

use crate::store::{Store, StoreError};

const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS gpu_shares (
    sandbox TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    data TEXT NOT NULL
);
"#;

/// A MIG device created for a held share.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigRecord {
    pub gpu: GpuIndex,
    pub instance: MigInstance,
    pub device: MigDevice,
}

/// What a sandbox has on this node's GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum ShareRecord {
    /// Its container runs with this allocation.
    Held {
        allocation: Allocation,
        mig: Vec<MigRecord>,
    },
    /// Asleep; asks for these shares again on wake.
    Sleeping { ticket: SleepTicket },
}

impl ShareRecord {
    fn state(&self) -> &'static str {
        match self {
            ShareRecord::Held { .. } => "held",
            ShareRecord::Sleeping { .. } => "sleeping",
        }
    }
}

impl Store {
    fn gpu_schema(&self) -> Result<(), StoreError> {
        self.with(|c| c.execute_batch(SCHEMA))
    }

    /// Every stored GPU share; rows that do not parse are reported, not returned.
    pub fn gpu_shares(&self) -> Result<Vec<(SandboxId, ShareRecord)>, StoreError> {
        self.gpu_schema()?;
        let rows: Vec<(String, String)> = self.with(|c| {
            let mut st = c.prepare("SELECT sandbox, data FROM gpu_shares ORDER BY sandbox")?;
            let rows = st
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })?;
        let mut out = Vec::with_capacity(rows.len());
        for (sandbox, data) in rows {
            let id = match SandboxId::new(sandbox.clone()) {
                Ok(id) => id,
                Err(e) => {
                    tracing::error!(%sandbox, error = %e, "GPU share row with a bad sandbox id; ignored");
                    continue;
                }
            };
            match serde_json::from_str::<ShareRecord>(&data) {
                Ok(r) => out.push((id, r)),
                Err(e) => {
                    tracing::error!(%sandbox, error = %e, "unreadable GPU share row; ignored")
                }
            }
        }
        Ok(out)
    }

    /// Records what `id` has now (replacing what it had).
    pub fn put_gpu_share(&self, id: &SandboxId, record: &ShareRecord) -> Result<(), StoreError> {
        self.gpu_schema()?;
        let data = serde_json::to_string(record).expect("share records serialise");
        self.with(|c| {
            c.execute(
                "INSERT INTO gpu_shares(sandbox, state, data) VALUES (?1, ?2, ?3)
                 ON CONFLICT(sandbox) DO UPDATE SET state=excluded.state, data=excluded.data",
                params![id.as_str(), record.state(), data],
            )
        })?;
        Ok(())
    }

    /// Forgets `id`'s share.
    pub fn delete_gpu_share(&self, id: &SandboxId) -> Result<(), StoreError> {
        self.gpu_schema()?;
        self.with(|c| {
            c.execute(
                "DELETE FROM gpu_shares WHERE sandbox=?1",
                params![id.as_str()],
            )
        })?;
        Ok(())
    }
}
