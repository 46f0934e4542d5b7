//! The control plane of one node: the state store, every sandbox's lifecycle on the sleep
//! ladder, templates and their golden snapshots, workers, the idle policy and metrics.
//! It drives `torpor-runtime` and is driven by `torpor-api`; it knows nothing about HTTP.

pub mod engine;
pub mod error;
pub mod gpu;
pub mod lot;
pub mod metrics;
pub mod pools;
pub mod secrets;
pub mod snapshots;
pub mod store;
pub mod usage;

pub use engine::{
    CreateSandbox, Engine, EngineConfig, ExecEvent, ExecResult, FileEntry, InUse, Progress,
    Reserve, SpawnProgress, UploadAllowance, UploadKind, WorkerStats, TENANT_MAX_PIDS, UPLOADED,
};
pub use error::{ControlError, Result};
pub use snapshots::{SnapshotConfig, StoreLocation};
pub use store::{ImageRef, Quotas, SandboxRecord, TemplateRecord, TemplateStatus, TenantRecord};
