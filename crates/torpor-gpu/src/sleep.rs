//! Giving a sleeping sandbox's share back, getting one again on wake, and the checkpoint gate.
//!
//! When a sandbox goes to Parked or Suspended its allocation is released and a
//! [`SleepTicket`] is kept with the sandbox. On wake, [`plan_wake`] first tries the very same
//! shares (same node, GPU and MIG placement: nothing moves), then any GPU of the same model,
//! because a GPU context restored by `cuda-checkpoint` needs the same kind of GPU.
//!
//! A sandbox holding a live GPU context can be fully checkpointed only with `cuda-checkpoint`;
//! without it, [`checkpoint_method`] refuses with a clear error instead of wedging the sandbox.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::ids::{AllocationId, NodeName};
use crate::inventory::Inventory;
use crate::ledger::{Ledger, LedgerError, Share};
use crate::planner::{plan, MemberPlan, ModeChange, Plan, Policy, Refusal};
use crate::quota::{share_charge, Amount, QuotaBook};
use crate::request::GpuRequest;

/// What a sleeping sandbox keeps to get its GPU share back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SleepTicket {
    pub node: NodeName,
    pub request: GpuRequest,
    pub shares: Vec<Share>,
    /// Product name of the GPUs it held, when they were all the same model.
    pub model: Option<String>,
}

/// Releases an allocation for a sandbox that goes to sleep.
pub fn release_for_sleep(
    inventory: &Inventory,
    ledger: &mut Ledger,
    id: AllocationId,
) -> Result<SleepTicket, LedgerError> {
    let allocation = ledger.release(id)?;
    let mut models = allocation
        .shares
        .iter()
        .filter_map(|s| inventory.gpu(s.gpu).map(|g| g.model.clone()));
    let first = models.next();
    let model = match first {
        Some(m) if models.all(|other| other == m) => Some(m),
        _ => None,
    };
    Ok(SleepTicket {
        node: inventory.node.clone(),
        request: allocation.request,
        shares: allocation.shares,
        model,
    })
}

/// Plans the wake of a sandbox on `inventory`'s node: the same shares when they are free,
/// else a fresh placement on a GPU of the same model (when `same_model`), else a refusal.
pub fn plan_wake(
    inventory: &Inventory,
    ledger: &Ledger,
    ticket: &SleepTicket,
    policy: &Policy,
    quotas: &QuotaBook,
    same_model: bool,
) -> Result<Plan, Refusal> {
    if ticket.node == inventory.node {
        let mut trial = ledger.clone();
        if trial
            .insert(
                inventory,
                ticket.request.clone(),
                ticket.shares.clone(),
                policy.allow_mode_change,
            )
            .is_ok()
        {
            let holds = ticket
                .request
                .tenant
                .as_ref()
                .and_then(|t| QuotaBook::usage(inventory, ledger).get(t).copied())
                .unwrap_or_default();
            let charge = ticket
                .shares
                .iter()
                .filter_map(|s| inventory.gpu(s.gpu).map(|g| share_charge(g, &s.kind)))
                .fold(Amount::default(), Amount::plus);
            if let Ok(standing) = quotas.admit(ticket.request.tenant.as_ref(), holds, charge) {
                let mode_changes = ledger
                    .usage()
                    .iter()
                    .zip(trial.usage())
                    .enumerate()
                    .filter(|(_, (b, a))| b.mode != a.mode)
                    .map(|(i, (b, a))| ModeChange {
                        gpu: crate::ids::GpuIndex(i as u32),
                        from: b.mode,
                        to: a.mode,
                    })
                    .collect();
                return Ok(Plan {
                    topology_score: inventory
                        .set_score(&ticket.shares.iter().map(|s| s.gpu).collect::<Vec<_>>()),
                    members: vec![MemberPlan {
                        request: ticket.request.clone(),
                        shares: ticket.shares.clone(),
                        standing,
                    }],
                    evictions: Vec::new(),
                    mode_changes,
                });
            }
        }
    }
    let mut request = ticket.request.clone();
    if same_model {
        if let Some(model) = &ticket.model {
            request.model = Some(model.clone());
        }
    }
    plan(inventory, ledger, &request, policy, quotas)
}

/// How a sandbox is checkpointed with respect to its GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckpointMethod {
    /// No GPU context: an ordinary checkpoint.
    NoGpuContext,
    /// `cuda-checkpoint` at this path moves GPU state to host memory first.
    CudaCheckpoint(PathBuf),
}

/// Why a checkpoint is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointError {
    #[error("the sandbox holds a live GPU context and cuda-checkpoint is not installed; a full checkpoint would lose GPU state, so it is refused (install cuda-checkpoint, or keep the sandbox Frozen)")]
    GpuContextWithoutCudaCheckpoint,
}

impl CheckpointError {
    pub fn code(&self) -> &'static str {
        match self {
            CheckpointError::GpuContextWithoutCudaCheckpoint => "checkpoint_gpu_context",
        }
    }
}

/// Decides how to checkpoint a sandbox: `holds_gpu_context` from the runtime, the
/// `cuda-checkpoint` binary from [`find_cuda_checkpoint`].
pub fn checkpoint_method(
    holds_gpu_context: bool,
    cuda_checkpoint: Option<&Path>,
) -> Result<CheckpointMethod, CheckpointError> {
    match (holds_gpu_context, cuda_checkpoint) {
        (false, _) => Ok(CheckpointMethod::NoGpuContext),
        (true, Some(path)) => Ok(CheckpointMethod::CudaCheckpoint(path.to_path_buf())),
        (true, None) => Err(CheckpointError::GpuContextWithoutCudaCheckpoint),
    }
}

/// Looks for an executable `cuda-checkpoint` in a `PATH`-style list.
pub fn find_cuda_checkpoint(path_list: &OsStr) -> Option<PathBuf> {
    std::env::split_paths(path_list)
        .map(|dir| dir.join("cuda-checkpoint"))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_gate() {
        assert_eq!(
            checkpoint_method(false, None),
            Ok(CheckpointMethod::NoGpuContext)
        );
        let err = checkpoint_method(true, None).unwrap_err();
        assert_eq!(err.code(), "checkpoint_gpu_context");
        assert!(err.to_string().contains("cuda-checkpoint"));
        assert_eq!(
            checkpoint_method(true, Some(Path::new("/usr/bin/cuda-checkpoint"))),
            Ok(CheckpointMethod::CudaCheckpoint(
                "/usr/bin/cuda-checkpoint".into()
            ))
        );
    }

    #[test]
    fn finds_only_executable_cuda_checkpoint() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("torpor-gpu-cc-{}", std::process::id()));
        let bin = dir.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let tool = bin.join("cuda-checkpoint");
        std::fs::write(&tool, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o644)).unwrap();
        let list = std::env::join_paths([dir.join("none"), bin.clone()]).unwrap();
        assert_eq!(find_cuda_checkpoint(&list), None, "not executable");
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(find_cuda_checkpoint(&list), Some(tool));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
