//! Each sandbox's GPU request: parsed and checked for its tenant, and kept in the state store so
//! that it survives a restart.

use torpor_core::{SandboxId, TenantId};
use torpor_gpu::ledger::Ledger;
use torpor_gpu::quota::QuotaBook;
use torpor_gpu::request::GpuRequest;

use super::{GpuError, NodeGpus};

/// A request's JSON, charged to `tenant` (the sandbox's owner) whatever `tenant` it names.
pub(super) fn owned_request(
    value: &serde_json::Value,
    tenant: &TenantId,
) -> Result<GpuRequest, GpuError> {
    let mut request: GpuRequest =
        serde_json::from_value(value.clone()).map_err(|e| GpuError::BadRequest {
            code: "request_malformed",
            message: format!("gpu: {e}"),
        })?;
    request.tenant = Some(
        torpor_gpu::ids::TenantId::new(tenant.as_str()).map_err(|e| GpuError::BadRequest {
            code: e.code(),
            message: format!("tenant {tenant}: {e}"),
        })?,
    );
    Ok(request)
}

impl NodeGpus {
    /// Parses and checks a GPU request for `tenant`'s sandbox: its shape, and that this node
    /// could ever satisfy it. The tenant charged is always the sandbox's owner.
    pub fn parse_request(
        node: Option<&NodeGpus>,
        value: &serde_json::Value,
        tenant: &TenantId,
    ) -> Result<GpuRequest, GpuError> {
        let Some(node) = node else {
            return Err(GpuError::NotConfigured);
        };
        let request = owned_request(value, tenant)?;
        // What no GPU of this node could ever satisfy is refused now, not at every wake.
        let empty = Ledger::new(&node.inventory);
        if let Err(refusal) = torpor_gpu::planner::plan(
            &node.inventory,
            &empty,
            &request,
            &node.policy,
            &QuotaBook::unlimited(),
        ) {
            let error = GpuError::from_refusal(&refusal);
            if matches!(error, GpuError::BadRequest { .. }) {
                return Err(error);
            }
        }
        node.runtime_check()?;
        if request.mode == torpor_gpu::partition::PartitionMode::Mig
            && !node.declared
            && node.mig_driver.is_none()
        {
            return Err(GpuError::Driver(
                "this node has no NVML MIG driver to create MIG instances; use mps, timeslice or whole".into(),
            ));
        }
        Ok(request)
    }

    /// Remembers a sandbox's GPU request (written before its first restore).
    pub fn save_request(&self, id: &SandboxId, request: &GpuRequest) -> std::io::Result<()> {
        self.state_store()?
            .put_gpu_request(id, request)
            .map_err(std::io::Error::other)
    }

    /// The GPU request of a sandbox, if it has one.
    pub fn request_of(&self, id: &SandboxId) -> Option<GpuRequest> {
        match self.store.as_ref()?.gpu_request(id) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(sandbox = %id, error = %e, "unreadable GPU request");
                None
            }
        }
    }
}
