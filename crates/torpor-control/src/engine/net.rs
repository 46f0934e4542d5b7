//! The engine's side of sandbox networking: policies in the store, the worker's network made
//! ready before each restore, live policy changes, and the target of proxied requests.
//!
//! A sandbox is *networked* when it was created with a policy other than `none`: it then runs
//! with runsc's own network stack on its worker's namespaces (torpor_runtime::net) on every
//! wake, and its policy (`none`, `full` or an allowlist) can change at any time. A sandbox
//! created without a network never gets one (its checkpoints have no interface).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::OnceLock;

use rusqlite::params;
use torpor_core::{NetworkPolicy, SandboxId, TenantId};
use torpor_runtime::Worker;

use super::{not_found, Engine, InUse};
use crate::error::{ControlError, Result};
use crate::store::{SandboxRecord, Store, StoreError};

/// A running sandbox borrowed for one proxied request, and where to connect. While this lives
/// the sandbox cannot be checkpointed: the sleep ladder waits for proxied requests to finish.
pub struct ProxyTarget {
    pub in_use: InUse,
    pub addr: SocketAddr,
}

/// Validates a requested policy; `None` when the sandbox gets no network.
pub(super) fn check_policy(p: Option<&NetworkPolicy>) -> Result<Option<NetworkPolicy>> {
    let Some(p) = p else { return Ok(None) };
    p.validate()
        .map_err(|e| ControlError::Invalid(e.to_string()))?;
    if p.is_none() {
        return Ok(None);
    }
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    if !*AVAILABLE.get_or_init(torpor_runtime::net::available) {
        return Err(ControlError::Unsupported(
            "sandbox networking needs `ip` and `nft` on the host (scripts/deps.sh installs them)"
                .into(),
        ));
    }
    Ok(Some(p.clone()))
}

/// Makes `worker`'s network ready for a sandbox under `policy`: namespaces (first use),
/// the sandbox's address (runsc took it from the previous one), the egress rules. Returns the
/// namespace path for the spec.
pub(super) fn prepare_worker_net(worker: &mut Worker, policy: &NetworkPolicy) -> Result<PathBuf> {
    let net = worker.ensure_net().map_err(net_err)?;
    net.set_sandbox_addr().map_err(net_err)?;
    net.apply_policy(policy).map_err(net_err)?;
    Ok(net.sandbox_ns_path())
}

/// Points the sandbox's resolver at its gateway (torpor's DNS responder, through the router).
/// Written once, at create: the address is the same on every worker.
pub(super) async fn write_resolv_conf(c: &torpor_runtime::Container) -> Result<()> {
    c.conn
        .call(
            &torpor_runtime::proto::Request::WriteFile {
                path: "/etc/resolv.conf".into(),
                mode: Some(0o644),
            },
            format!(
                "# written by torpor: names on the sandbox's allowlist resolve here\nnameserver {}\n",
                torpor_runtime::net::GATEWAY_ADDR
            )
            .as_bytes(),
        )
        .await?;
    Ok(())
}

fn net_err(e: torpor_runtime::net::NetError) -> ControlError {
    ControlError::Runtime(torpor_runtime::RuntimeError::ExitedEarly(e.to_string()))
}

impl Store {
    pub fn set_network(&self, id: &SandboxId, policy: &NetworkPolicy) -> Result<(), StoreError> {
        let json = serde_json::to_string(policy).expect("policy serialises");
        self.with(|c| {
            c.execute(
                "INSERT INTO sandbox_network (id, policy) VALUES (?1, ?2)
                 ON CONFLICT(id) DO UPDATE SET policy=excluded.policy",
                params![id.as_str(), json],
            )
            .map(|_| ())
        })
    }

    /// The policy of a networked sandbox; `None` for one without network.
    pub fn network(&self, id: &SandboxId) -> Result<Option<NetworkPolicy>, StoreError> {
        let raw: Option<String> = self.with(|c| {
            let mut st = c.prepare("SELECT policy FROM sandbox_network WHERE id=?1")?;
            let mut rows = st.query(params![id.as_str()])?;
            match rows.next()? {
                Some(r) => Ok(Some(r.get(0)?)),
                None => Ok(None),
            }
        })?;
        Ok(raw.and_then(|s| serde_json::from_str(&s).ok()))
    }
}

impl Engine {
    /// The sandbox's network policy (`none` for a sandbox without network).
    pub fn network_policy(&self, tenant: &TenantId, id: &SandboxId) -> Result<NetworkPolicy> {
        self.sandbox(tenant, id)?;
        Ok(self.store.network(id)?.unwrap_or_else(NetworkPolicy::none))
    }

    /// Changes a networked sandbox's egress policy; a running sandbox gets it at once (new
    /// connections follow it; established ones stay), a sleeping one on its next wake.
    pub async fn set_network(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        policy: NetworkPolicy,
    ) -> Result<SandboxRecord> {
        let rec = self.sandbox(tenant, id)?;
        policy
            .validate()
            .map_err(|e| ControlError::Invalid(e.to_string()))?;
        if self.store.network(id)?.is_none() {
            if policy.is_none() {
                return Ok(rec);
            }
            return Err(ControlError::Invalid(format!(
                "network: sandbox {id} was created without a network; create it with a `network` policy"
            )));
        }
        let slot = self.slot(id);
        // The read lock: a wake or checkpoint (write lock) does not run meanwhile, so the
        // stored policy and the live rules agree.
        let guard = slot.state.clone().read_owned().await;
        self.store.set_network(id, &policy)?;
        if let Some(net) = guard.live.as_ref().and_then(|l| l._worker.net()) {
            net.apply_policy(&policy).map_err(net_err)?;
        }
        Ok(rec)
    }

    /// Borrows the sandbox for one proxied request to `port`, waking it (parked when no worker
    /// is free) if it sleeps.
    pub async fn proxy_target(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        port: u16,
    ) -> Result<ProxyTarget> {
        self.sandbox(tenant, id)?;
        if self.store.network(id)?.is_none() {
            return Err(ControlError::Invalid(format!(
                "sandbox {id} has no network; create it with a `network` policy to reach its ports"
            )));
        }
        let in_use = self.use_sandbox(tenant, id).await?;
        let addr = in_use.ingress_addr().ok_or_else(|| not_found(id))?;
        Ok(ProxyTarget {
            in_use,
            addr: SocketAddr::from((addr, port)),
        })
    }
}
