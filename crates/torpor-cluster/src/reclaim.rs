//! Borrowed GPU shares given back across the cluster.
//!
//! Under GPU quotas a tenant may borrow idle GPU capacity above its guarantee; a tenant within
//! its guarantee that finds no free share takes the borrowed capacity back (on a single machine
//! the engine does it: `NodeGpus::acquire` names the victims and the engine parks them).
//!
//! In a cluster the worker places shares, but only a controller may park a sandbox (the one that
//! holds it). So:
//!
//! 1. The controller sends a GPU start with the quota book as the requester's quota less what it
//!    holds on other workers ([`crate::fleet`]), and, for every other tenant holding a share on
//!    that worker, its guarantee less what it holds elsewhere: a tenant above its guarantee
//!    cluster-wide is a borrower on that worker even when its shares there alone are within it.
//! 2. The worker plans the start. When the plan needs borrowed shares back it takes nothing
//!    and refuses with [`RECLAIM_CODE`], naming the victims (its newest borrowers first, as the
//!    planner orders them): [`reclaim_refusal`].
//! 3. The controller parks the victims through [`GpuReclaim`] (its own API, as the admin: the
//!    call reaches whichever controller holds each one, is audited there, and their checkpoints
//!    give the shares back), then starts again on the same worker, at most [`MAX_ROUNDS`] times.
//!    The victims' ids never reach the requester: when the reclaim fails the start is refused
//!    `gpu_unavailable` without them. A worker is not trusted with other workers' sandboxes:
//!    only a sandbox that runs on the naming worker, of another tenant, is parked ([`vet`]).

use async_trait::async_trait;
use torpor_core::SandboxId;
use torpor_runtime::RuntimeError;

/// The code of a worker's "park these sandboxes first" refusal.
pub const RECLAIM_CODE: &str = "gpu_reclaim_needed";
/// How many times one start has victims parked before it gives up.
pub const MAX_ROUNDS: usize = 2;
/// Where the victims' list starts in the refusal's message.
const MARKER: &str = "park first:";

/// Parks sandboxes whose borrowed GPU shares a start needs back (implemented by the
/// controller's binary over its own API).
#[async_trait]
pub trait GpuReclaim: Send + Sync {
    /// Parks `sandbox`, which `worker` named for a start of tenant `requester`, with the cause
    /// `gpu_reclaimed` once [`vet`] passes it; `Ok` once its share is given back (or it was
    /// asleep already, or is gone).
    async fn park(
        &self,
        sandbox: &SandboxId,
        worker: &str,
        requester: Option<&str>,
    ) -> Result<(), String>;
}

/// What a controller knows of a sandbox a worker named as a victim.
#[derive(Debug, Clone, Copy)]
pub struct Named<'a> {
    /// The worker it runs on now (`None` while asleep).
    pub node: Option<&'a str>,
    pub tenant: &'a str,
    /// Parked or Suspended: its share is given back already.
    pub asleep: bool,
}

/// Whether a victim `worker` named must be parked (`Ok(true)`), is asleep already
/// (`Ok(false)`), or is refused: a worker is trusted with its own ledger, not with other
/// workers' sandboxes or with the requester's own, so it may get parked only a sandbox that
/// runs on it, of another tenant.
pub fn vet(named: &Named<'_>, worker: &str, requester: Option<&str>) -> Result<bool, String> {
    if named.asleep {
        return Ok(false);
    }
    if named.node != Some(worker) {
        return Err(format!(
            "worker {worker} named a sandbox that does not run on it (it is on {})",
            named.node.unwrap_or("no worker")
        ));
    }
    if Some(named.tenant) == requester {
        return Err(format!(
            "worker {worker} named a sandbox of the requesting tenant itself"
        ));
    }
    Ok(true)
}

/// The worker's refusal naming `victims`.
pub fn reclaim_refusal(victims: &[SandboxId]) -> RuntimeError {
    let names: Vec<&str> = victims.iter().map(SandboxId::as_str).collect();
    RuntimeError::Gpu {
        code: RECLAIM_CODE.into(),
        message: format!(
            "the GPU share is borrowed by other tenants' sandboxes; {MARKER} {}",
            names.join(" ")
        ),
    }
}

/// The victims a worker's refusal names (`None`: not a reclaim refusal, or one that names
/// nothing it could parse).
pub fn reclaim_victims(e: &RuntimeError) -> Option<Vec<SandboxId>> {
    let RuntimeError::Gpu { code, message } = e else {
        return None;
    };
    if code != RECLAIM_CODE {
        return None;
    }
    let (_, list) = message.rsplit_once(MARKER)?;
    let victims: Vec<SandboxId> = list
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    (!victims.is_empty()).then_some(victims)
}

/// What the requester hears when the borrowed shares could not be given back: no free share,
/// without the other tenants' sandboxes.
pub fn unavailable(worker: &str, why: &str) -> RuntimeError {
    RuntimeError::Gpu {
        code: "gpu_unavailable".into(),
        message: format!(
            "worker {worker}: no free GPU share; borrowed shares could not be taken back ({why})"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_names_its_victims_through_the_wire_prefix() {
        let victims = vec![SandboxId::generate(), SandboxId::generate()];
        let RuntimeError::Gpu { code, message } = reclaim_refusal(&victims) else {
            panic!("not a GPU refusal");
        };
        // The controller hears the worker's message behind its name (convert.rs).
        let heard = RuntimeError::Gpu {
            code,
            message: format!("worker w1: {message}"),
        };
        assert_eq!(reclaim_victims(&heard), Some(victims));
        let other = RuntimeError::Gpu {
            code: "gpu_unavailable".into(),
            message: format!("{MARKER} sb-x"),
        };
        assert_eq!(reclaim_victims(&other), None);
        let garbled = RuntimeError::Gpu {
            code: RECLAIM_CODE.into(),
            message: format!("{MARKER} not/an/id"),
        };
        assert_eq!(reclaim_victims(&garbled), None);
        let RuntimeError::Gpu { code, message } = unavailable("w1", "timed out") else {
            panic!()
        };
        assert_eq!(code, "gpu_unavailable");
        assert!(!message.contains(MARKER));
    }

    #[test]
    fn a_worker_gets_parked_only_other_tenants_sandboxes_running_on_it() {
        let on = |node, tenant, asleep| Named {
            node,
            tenant,
            asleep,
        };
        let team = Some("team");
        assert_eq!(vet(&on(Some("w1"), "acme", false), "w1", team), Ok(true));
        assert_eq!(vet(&on(None, "acme", true), "w1", team), Ok(false));
        // Attack: a worker (a stolen certificate, a bug) names a sandbox on another worker, one
        // of the requester's own, or one that is not running anywhere.
        let err = vet(&on(Some("w2"), "acme", false), "w1", team).unwrap_err();
        assert!(err.contains("does not run on it"), "{err}");
        assert!(vet(&on(None, "acme", false), "w1", team).is_err());
        let err = vet(&on(Some("w1"), "team", false), "w1", team).unwrap_err();
        assert!(err.contains("requesting tenant"), "{err}");
    }
}
