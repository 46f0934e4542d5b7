//! What the state store holds, as the control plane sees it: one type per record kind, typed
//! ids throughout. Nothing here knows how a backend lays the records out.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use torpor_core::{
    Limits, PoolName, SandboxId, SandboxState, TemplateName, TemplateSpec, TenantId, Tier,
    UnixMillis,
};
use torpor_gpu::ids::GpuIndex;
use torpor_gpu::inject::MigDevice;
use torpor_gpu::ledger::Allocation;
use torpor_gpu::mig::MigInstance;
use torpor_gpu::sleep::SleepTicket;
use torpor_runtime::Mount;

/// Where the checkpoint a sandbox would wake from lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "path", rename_all = "snake_case")]
pub enum ImageRef {
    /// Its template's golden snapshot (a sandbox that has never been checkpointed).
    Golden,
    /// A checkpoint on this node's disk (Parked).
    Local(PathBuf),
    /// A checkpoint in the snapshot store (Suspended), by snapshot id.
    Store(String),
    /// Cluster mode: a checkpoint on the disk of the worker that wrote it (Parked), on its way
    /// to the store. Until it gets there, `fallback` (the snapshot it supersedes; `None`: the
    /// template's golden image) is kept: where the sandbox goes back to if that worker is lost.
    Worker {
        node: String,
        /// A name in the worker's own image area.
        dir: String,
        taken_at: UnixMillis,
        fallback: Option<String>,
    },
}

impl ImageRef {
    /// The tier a sandbox asleep on this image is in.
    pub fn sleeping_tier(&self) -> Tier {
        match self {
            ImageRef::Golden | ImageRef::Local(_) | ImageRef::Worker { .. } => Tier::Parked,
            ImageRef::Store(_) => Tier::Suspended,
        }
    }

    /// Where a sandbox goes back to when this image's worker is lost before its upload.
    pub fn fallback(&self) -> ImageRef {
        match self {
            ImageRef::Worker { fallback, .. } => {
                fallback.clone().map_or(ImageRef::Golden, ImageRef::Store)
            }
            other => other.clone(),
        }
    }

    pub fn sleeping_state(&self) -> SandboxState {
        match self.sleeping_tier() {
            Tier::Suspended => SandboxState::Suspended,
            _ => SandboxState::Parked,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TemplateStatus {
    Building,
    Ready,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TemplateRecord {
    pub name: TemplateName,
    pub tenant: TenantId,
    pub spec: TemplateSpec,
    pub status: TemplateStatus,
    pub rootfs: PathBuf,
    pub mounts: Vec<Mount>,
    pub agent_dir: PathBuf,
    pub golden_dir: PathBuf,
    pub golden_bytes: u64,
    pub created_at: UnixMillis,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRecord {
    pub id: SandboxId,
    pub tenant: TenantId,
    pub template: TemplateName,
    pub state: SandboxState,
    pub tier: Tier,
    pub limits: Limits,
    pub env: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    pub created_at: UnixMillis,
    pub last_active_at: UnixMillis,
    /// Bumped on every boot or restore; the runsc container id is `<id>-g<generation>`.
    pub generation: u32,
    pub image: ImageRef,
    pub last_error: Option<String>,
    pub oom_killed: bool,
    /// Cluster mode: the controller that holds the sandbox (runs its transitions and its
    /// container's calls); `None` while it sleeps, and always in embedded mode (the SQLite
    /// store does not keep it). Written with the state, by compare-and-set.
    pub controller: Option<String>,
    /// The row's version when this record was read (0 for a record not yet inserted); the
    /// engine writes states by compare-and-set over it.
    pub version: Version,
}

impl SandboxRecord {
    pub fn container_id(&self) -> String {
        format!("{}-g{}", self.id, self.generation)
    }
}

/// The version of a stored sandbox row: bumped by every write of the row, so a
/// compare-and-set ([`super::StateStore::compare_and_set_sandbox`]) sees any write made since
/// its read. Metadata and activity writes do not bump it: they cannot undo a state change.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version(pub u64);

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "v{}", self.0)
    }
}

/// Limits on what one tenant may hold. `None`: unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quotas {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sandboxes: Option<u64>,
    /// Resident (Running or Frozen) sandboxes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_running: Option<u64>,
    /// Memory limits of resident sandboxes, summed, in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_memory_mib: Option<u64>,
    /// CPU limits of resident sandboxes (template builds included), summed, in CPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cpus: Option<u64>,
    /// Templates the tenant owns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_templates: Option<u64>,
    /// Event-driven pools the tenant owns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pools: Option<u64>,
    /// Disk the tenant's checkpoints, golden snapshots and uploads take, in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_disk_mib: Option<u64>,
    /// API requests per second (token bucket; bursts up to twice this). `None`: the daemon's
    /// `--default-requests-per-s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_s: Option<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TenantRecord {
    pub id: TenantId,
    pub created_at: UnixMillis,
    pub quotas: Quotas,
}

/// What a tenant holds now, for quota checks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub sandboxes: u64,
    pub resident: u64,
    pub resident_memory_mib: u64,
    /// CPU limits of resident sandboxes, summed, in thousandths of a CPU.
    pub resident_millicpus: u64,
}

/// A pool as stored: its owner and its spec as JSON (the control plane's `pools` module owns the
/// spec's type; the store keeps it opaque).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRow {
    pub name: PoolName,
    pub tenant: TenantId,
    pub spec_json: String,
    pub created_at: UnixMillis,
}

/// A MIG device created for a held share.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigRecord {
    pub gpu: GpuIndex,
    pub instance: MigInstance,
    pub device: MigDevice,
}

/// What a sandbox has on this node's GPUs: `held` (its allocation and the MIG devices created
/// for it) or `sleeping` (a ticket to get it back). [`crate::gpu::NodeGpus`] writes one on
/// every acquire and release and reads them back at start, so a restart keeps every share.
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
    pub fn state(&self) -> &'static str {
        match self {
            ShareRecord::Held { .. } => "held",
            ShareRecord::Sleeping { .. } => "sleeping",
        }
    }
}

/// One usage interval row: what `sandbox` of `tenant` consumed of `measure` (in dimension
/// `dim`) in the interval starting at `start_s` (Unix seconds). [`crate::usage`] owns what the
/// measures are and their units; the store keeps their names. A row outlives its sandbox and
/// tenant.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageInterval {
    pub start_s: i64,
    pub tenant: TenantId,
    pub sandbox: SandboxId,
    pub measure: String,
    pub dim: String,
    pub value: f64,
}
