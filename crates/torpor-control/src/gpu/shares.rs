//! The stored shares (`gpu_shares` in the state store): each sandbox's row written as the
//! ledger has it, read back at start ([`restore`]) and matched with the sandboxes' states
//! ([`NodeGpus::reconcile`]).

use std::collections::HashMap;

use torpor_core::SandboxId;
use torpor_gpu::inject::{injection, InjectConfig, MigHandles};
use torpor_gpu::inventory::Inventory;
use torpor_gpu::ledger::{Ledger, ShareKind};
use torpor_gpu::sleep::SleepTicket;

use super::{Held, Inner, NodeGpus};
use crate::store::{MigRecord, ShareRecord};

impl NodeGpus {
    /// Matches the stored shares with the sandboxes' states after a restart: `awake(id)` is
    /// `Some(true)` for a sandbox whose container runs, `Some(false)` for one asleep and `None`
    /// for one that no longer exists. Awake holders keep their share; sleeping ones give it
    /// back (keeping a ticket for the same devices); gone ones lose share and ticket.
    pub fn reconcile(&self, awake: impl Fn(&SandboxId) -> Option<bool>) {
        let (held, ticketed): (Vec<SandboxId>, Vec<SandboxId>) = {
            let inner = self.lock();
            (
                inner.held.keys().cloned().collect(),
                inner.tickets.keys().cloned().collect(),
            )
        };
        for id in held {
            match awake(&id) {
                Some(true) => {}
                Some(false) => {
                    tracing::info!(sandbox = %id, "asleep after the restart: its GPU share is released");
                    self.release(&id);
                }
                None => {
                    tracing::info!(sandbox = %id, "gone after the restart: its GPU share is dropped");
                    self.forget(&id);
                }
            }
        }
        for id in ticketed {
            if awake(&id).is_none() {
                self.forget(&id);
            }
        }
    }

    /// Writes `id`'s row as `inner` has it now (a held share, a ticket, or nothing).
    pub(super) fn persist(&self, inner: &Inner, id: &SandboxId) {
        let Some(store) = &self.store else {
            return;
        };
        let record = share_record(inner, id);
        let result = match &record {
            Some(r) => store.put_gpu_share(id, r),
            None => store.delete_gpu_share(id),
        };
        if let Err(e) = result {
            tracing::error!(sandbox = %id, error = %e, "cannot store the GPU share");
        }
    }
}

/// The row of `id` as `inner` has it.
fn share_record(inner: &Inner, id: &SandboxId) -> Option<ShareRecord> {
    if let Some(held) = inner.held.get(id) {
        let allocation = inner.ledger.allocation(held.allocation)?.clone();
        let mig = allocation
            .shares
            .iter()
            .filter_map(|s| match s.kind {
                ShareKind::Mig { instance } => {
                    inner
                        .handles
                        .get(&(s.gpu, instance))
                        .map(|device| MigRecord {
                            gpu: s.gpu,
                            instance,
                            device: device.clone(),
                        })
                }
                _ => None,
            })
            .collect();
        return Some(ShareRecord::Held { allocation, mig });
    }
    inner.tickets.get(id).map(|ticket| ShareRecord::Sleeping {
        ticket: ticket.clone(),
    })
}

/// Rebuilds the ledger, MIG devices, holders and tickets from the stored rows. A held share
/// that no longer fits the inventory (it changed) becomes a ticket: the sandbox plans again
/// on wake.
pub(super) fn restore(
    inventory: &Inventory,
    inject: &InjectConfig,
    store: &crate::store::Store,
    stored: Vec<(SandboxId, ShareRecord)>,
) -> Inner {
    let mut inner = Inner {
        ledger: Ledger::new(inventory),
        handles: MigHandles::new(),
        held: HashMap::new(),
        tickets: HashMap::new(),
    };
    for (id, record) in stored {
        match record {
            ShareRecord::Sleeping { ticket } => {
                inner.tickets.insert(id, ticket);
            }
            ShareRecord::Held { allocation, mig } => {
                let mut ledger = inner.ledger.clone();
                let mut handles = inner.handles.clone();
                for m in &mig {
                    handles.insert((m.gpu, m.instance), m.device.clone());
                }
                let restored = ledger
                    .insert(
                        inventory,
                        allocation.request.clone(),
                        allocation.shares.clone(),
                        true,
                    )
                    .map_err(|e| e.to_string())
                    .and_then(|aid| {
                        let a = ledger.allocation(aid).cloned().ok_or("lost")?;
                        injection(inventory, &a, &handles, inject)
                            .map(|inj| (aid, inj))
                            .map_err(|e| e.to_string())
                    });
                match restored {
                    Ok((aid, inj)) => {
                        inner.ledger = ledger;
                        inner.handles = handles;
                        inner.held.insert(
                            id,
                            Held {
                                allocation: aid,
                                env: inj.env,
                                devices: inj.devices,
                                mounts: inj.mounts,
                            },
                        );
                    }
                    Err(e) => {
                        tracing::warn!(sandbox = %id, error = %e, "a stored GPU share no longer fits this inventory; it is asked for again on wake");
                        let ticket = SleepTicket {
                            node: inventory.node.clone(),
                            request: allocation.request,
                            shares: allocation.shares,
                            model: None,
                        };
                        let record = ShareRecord::Sleeping {
                            ticket: ticket.clone(),
                        };
                        if let Err(e) = store.put_gpu_share(&id, &record) {
                            tracing::error!(sandbox = %id, error = %e, "cannot store the GPU share");
                        }
                        inner.tickets.insert(id, ticket);
                    }
                }
            }
        }
    }
    inner
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::GpuConfig;
    use torpor_core::TenantId;

    #[test]
    fn stored_shares_come_back_and_reconcile_by_state() {
        let dir = tempfile::tempdir().unwrap();
        let inv = dir.path().join("inv.toml");
        std::fs::write(
            &inv,
            "node = \"n\"\n[[gpu]]\nindex = 0\nuuid = \"GPU-a\"\nmodel = \"NVIDIA H100 80GB HBM3\"\nmemory_mib = 81559\nmig_capable = true\npci_bus_id = \"0000:01:00.0\"\n",
        )
        .unwrap();
        let open = || {
            NodeGpus::open(
                GpuConfig {
                    inventory: Some(inv.clone()),
                    ..GpuConfig::default()
                },
                dir.path(),
            )
            .unwrap()
            .unwrap()
        };
        let admin = TenantId::admin();
        let gpus = open();
        let request = NodeGpus::parse_request(
            Some(&gpus),
            &serde_json::json!({"mode": "mig", "profile": "3g.40gb"}),
            &admin,
        )
        .unwrap();
        let (awake, asleep, gone) = (
            SandboxId::generate(),
            SandboxId::generate(),
            SandboxId::generate(),
        );
        for id in [&awake, &asleep, &gone] {
            gpus.save_request(id, &request).unwrap();
        }
        gpus.acquire(&awake).unwrap();
        gpus.acquire(&asleep).unwrap();
        gpus.release(&asleep);
        let before = serde_json::to_value(gpus.status(&admin)).unwrap();
        drop(gpus);

        // Read back as it was written, before any reconcile.
        let gpus = open();
        assert_eq!(serde_json::to_value(gpus.status(&admin)).unwrap(), before);
        gpus.reconcile(|id| (*id != gone).then_some(*id == awake));
        let status = gpus.status(&admin);
        assert_eq!(status.allocations.len(), 1);
        assert_eq!(status.allocations[0].sandbox, awake.to_string());
        assert_eq!(status.sleeping, vec![asleep.to_string()]);
        // The awake holder's share is still counted once: a second acquire is a no-op, and
        // the sleeping one wakes on its own placement next to it.
        gpus.acquire(&awake).unwrap();
        gpus.acquire(&asleep).unwrap();
        assert_eq!(gpus.status(&admin).gpus[0].shares, 2);
        // The awake holder went to sleep with the daemon down: released at the next start.
        drop(gpus);
        let gpus = open();
        gpus.reconcile(|_| Some(false));
        let status = gpus.status(&admin);
        assert!(status.allocations.is_empty());
        assert_eq!(status.sleeping.len(), 2);
        assert_eq!(status.gpus[0].shares, 0);
    }
}
