//! Why the GPU part of the daemon failed: [`GpuError`] for an operation (each variant with a
//! stable code the API maps to a status) and [`GpuSetupError`] for start-up.

use std::path::PathBuf;

use torpor_gpu::planner::Refusal;
use torpor_gpu::sleep::CheckpointError;

/// Why a GPU operation failed. Each variant has a stable code; the API maps them to statuses.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no GPU inventory: start `torpor up` (in a cluster: a `torpor worker`) with --gpu-inventory FILE, or on a machine with an NVIDIA driver")]
    NotConfigured,
    #[error("invalid GPU request ({code}): {message}")]
    BadRequest { code: &'static str, message: String },
    #[error("no GPU share for this sandbox now ({code}): {message}")]
    Unavailable { code: &'static str, message: String },
    #[error("GPU quota ({code}): {message}")]
    Quota { code: &'static str, message: String },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("GPU driver: {0}")]
    Driver(String),
    #[error("GPU runtime: {0}")]
    RuntimeUnsupported(String),
}

impl GpuError {
    pub fn code(&self) -> &'static str {
        match self {
            GpuError::NotConfigured => "gpu_not_configured",
            GpuError::BadRequest { .. } => "gpu_request_invalid",
            GpuError::Unavailable { .. } => "gpu_unavailable",
            GpuError::Quota { .. } => "gpu_quota_exceeded",
            GpuError::Checkpoint(e) => e.code(),
            GpuError::Driver(_) => "gpu_driver_error",
            GpuError::RuntimeUnsupported(_) => "gpu_runtime_unsupported",
        }
    }

    pub(super) fn from_refusal(refusal: &Refusal) -> GpuError {
        let code = refusal.code();
        let message = refusal.to_string();
        match refusal {
            Refusal::Request(_)
            | Refusal::NoMigGpu
            | Refusal::UnknownProfile { .. }
            | Refusal::LargerThanAnyGpu { .. }
            | Refusal::NotEnoughGpus { .. } => GpuError::BadRequest { code, message },
            Refusal::Quota(_) => GpuError::Quota { code, message },
            _ => GpuError::Unavailable { code, message },
        }
    }
}

/// Why the GPU part of the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum GpuSetupError {
    #[error("{message}")]
    Inventory { code: &'static str, message: String },
    #[error("{message}")]
    Quotas { code: &'static str, message: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl GpuSetupError {
    pub fn code(&self) -> &'static str {
        match self {
            GpuSetupError::Inventory { code, .. } | GpuSetupError::Quotas { code, .. } => code,
            GpuSetupError::Io { .. } => "io_error",
        }
    }
}

pub(super) fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let text = inner.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        source = inner.source();
    }
    s
}
