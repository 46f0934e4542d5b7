//! What the node's GPUs look like from outside: `GET /v1/gpus` ([`GpuStatus`]) and the
//! `/metrics` families (allocations, and DCGM exporter's with a sampler, labelled by holder).

use std::collections::BTreeMap;

use serde::Serialize;
use torpor_core::TenantId;
use torpor_gpu::ledger::ShareKind;
use torpor_gpu::nvml::{dcgm_metrics, GpuSample};
use torpor_gpu::planner::{describe, PlacedDevice};
use torpor_gpu::report::{allocation_metrics, gpu_rows, GpuRow};

use super::{Inner, NodeGpus, Sampler};

/// One sandbox's share as `GET /v1/gpus` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct SandboxShare {
    pub sandbox: String,
    pub tenant: Option<String>,
    pub devices: Vec<PlacedDevice>,
    pub env: BTreeMap<String, String>,
}

/// `GET /v1/gpus`.
#[derive(Debug, Clone, Serialize)]
pub struct GpuStatus {
    pub node: String,
    /// `nvml` or the declared file's path.
    pub source: String,
    pub gpus: Vec<GpuRow>,
    /// Shares held by running or frozen sandboxes (a tenant sees its own).
    pub allocations: Vec<SandboxShare>,
    /// Sandboxes asleep that will ask for their share again on wake.
    pub sleeping: Vec<String>,
    /// Whether `cuda-checkpoint` was found (a GPU context can then be checkpointed).
    pub cuda_checkpoint: bool,
}

impl NodeGpus {
    /// `GET /v1/gpus`; a tenant other than the admin sees only its own sandboxes' shares.
    pub fn status(&self, viewer: &TenantId) -> GpuStatus {
        let inner = self.lock();
        let mut allocations: Vec<SandboxShare> = inner
            .held
            .iter()
            .filter_map(|(sandbox, held)| {
                let allocation = inner.ledger.allocation(held.allocation)?;
                let tenant = allocation.tenant.as_ref().map(|t| t.to_string());
                let visible =
                    *viewer == TenantId::admin() || tenant.as_deref() == Some(viewer.as_str());
                visible.then(|| SandboxShare {
                    sandbox: sandbox.to_string(),
                    tenant,
                    devices: allocation
                        .shares
                        .iter()
                        .map(|s| describe(&self.inventory, s))
                        .collect(),
                    env: held.env.clone(),
                })
            })
            .collect();
        allocations.sort_by(|a, b| a.sandbox.cmp(&b.sandbox));
        let mut sleeping: Vec<String> = inner
            .tickets
            .iter()
            .filter(|(_, t)| {
                *viewer == TenantId::admin()
                    || t.request.tenant.as_ref().map(|x| x.as_str()) == Some(viewer.as_str())
            })
            .map(|(s, _)| s.to_string())
            .collect();
        sleeping.sort();
        GpuStatus {
            node: self.inventory.node.to_string(),
            source: self.source.clone(),
            gpus: gpu_rows(&self.inventory, &inner.ledger),
            allocations,
            sleeping,
            cuda_checkpoint: self.cuda_checkpoint.is_some(),
        }
    }

    /// Samples telemetry on every scrape: DCGM exporter's metric families are added to
    /// `/metrics`, labelled with the tenant and sandbox that hold each device.
    pub fn set_sampler(&mut self, sampler: Sampler) {
        self.sampler = Some(sampler);
    }

    /// Who holds each device (GPU UUID, or MIG UUID for a MIG instance): `(tenant, sandbox)`.
    fn holders(&self, inner: &Inner) -> BTreeMap<String, Vec<(Option<String>, String)>> {
        let mut out: BTreeMap<String, Vec<(Option<String>, String)>> = BTreeMap::new();
        for (sandbox, held) in &inner.held {
            let Some(allocation) = inner.ledger.allocation(held.allocation) else {
                continue;
            };
            let tenant = allocation.tenant.as_ref().map(|t| t.to_string());
            for share in &allocation.shares {
                let uuid = match share.kind {
                    ShareKind::Mig { instance } => inner
                        .handles
                        .get(&(share.gpu, instance))
                        .map(|d| d.uuid.to_string()),
                    _ => self.inventory.gpu(share.gpu).map(|g| g.uuid.to_string()),
                };
                if let Some(uuid) = uuid {
                    out.entry(uuid)
                        .or_default()
                        .push((tenant.clone(), sandbox.to_string()));
                }
            }
        }
        out
    }

    /// Allocation metrics (shares used and free by GPU and mode, quota use), always; with a
    /// sampler (NVML) also DCGM exporter's families.
    pub fn metrics(&self) -> String {
        let (mut text, holders) = {
            let inner = self.lock();
            (
                allocation_metrics(&self.inventory, &inner.ledger, &self.quotas),
                self.holders(&inner),
            )
        };
        if let Some(sampler) = &self.sampler {
            match sampler() {
                Ok(mut samples) => {
                    label_samples(&mut samples, &holders);
                    text.push_str(&dcgm_metrics(self.inventory.node.as_str(), &samples));
                }
                Err(e) => tracing::warn!(error = %e, "cannot sample GPU telemetry"),
            }
        }
        text
    }
}

/// Adds `tenant` and `sandbox` labels to the samples of devices that exactly one sandbox holds
/// (a whole GPU, a MIG instance, or a shared GPU with a single client).
pub fn label_samples(
    samples: &mut [GpuSample],
    holders: &BTreeMap<String, Vec<(Option<String>, String)>>,
) {
    for sample in samples {
        if let Some([(tenant, sandbox)]) = holders.get(&sample.uuid).map(Vec::as_slice) {
            sample.tenant = tenant.clone();
            sample.sandbox = Some(sandbox.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::GpuConfig;
    use torpor_core::SandboxId;

    fn sample(uuid: &str, mig: Option<(&str, u32)>) -> GpuSample {
        GpuSample {
            gpu: 0,
            uuid: uuid.to_owned(),
            model_name: "NVIDIA H200".to_owned(),
            mig: mig.map(|(p, i)| (p.to_owned(), i)),
            tenant: None,
            sandbox: None,
            util_pct: Some(30),
            fb_used_mib: Some(1024),
            temp_c: None,
            power_w: None,
            tensor_active: None,
            xid_last: None,
            ecc_dbe_volatile: None,
        }
    }

    #[test]
    fn dcgm_samples_get_tenant_and_sandbox_of_a_single_holder() {
        let mut samples = vec![
            sample("GPU-0", None),
            sample("MIG-a", Some(("3g.71gb", 2))),
            sample("GPU-1", None),
        ];
        let holders = BTreeMap::from([
            (
                "MIG-a".to_owned(),
                vec![(Some("team-a".to_owned()), "sb-1".to_owned())],
            ),
            (
                "GPU-1".to_owned(),
                vec![(None, "sb-2".to_owned()), (None, "sb-3".to_owned())],
            ),
        ]);
        label_samples(&mut samples, &holders);
        assert_eq!(samples[0].sandbox, None);
        assert_eq!(samples[1].tenant.as_deref(), Some("team-a"));
        assert_eq!(samples[1].sandbox.as_deref(), Some("sb-1"));
        assert_eq!(samples[2].sandbox, None, "two MPS clients: no single owner");
        let text = dcgm_metrics("node-1", &samples);
        assert!(text.contains("DCGM_FI_DEV_FB_USED{gpu=\"0\",UUID=\"MIG-a\",device=\"nvidia0\",modelName=\"NVIDIA H200\",Hostname=\"node-1\",GPU_I_PROFILE=\"3g.71gb\",GPU_I_ID=\"2\",tenant=\"team-a\",sandbox=\"sb-1\"} 1024"), "{text}");
        assert!(text.contains("DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"GPU-0\""));
    }

    #[test]
    fn metrics_with_a_sampler_carry_dcgm_families_labelled_by_holder() {
        let dir = tempfile::tempdir().unwrap();
        let inv = dir.path().join("inv.toml");
        std::fs::write(
            &inv,
            "node = \"n\"\n[[gpu]]\nindex = 0\nuuid = \"GPU-a\"\nmodel = \"NVIDIA L4\"\nmemory_mib = 23034\nmig_capable = false\npci_bus_id = \"0000:01:00.0\"\n",
        )
        .unwrap();
        let mut gpus = NodeGpus::open(
            GpuConfig {
                inventory: Some(inv),
                ..GpuConfig::default()
            },
            dir.path(),
        )
        .unwrap()
        .unwrap();
        gpus.set_sampler(Box::new(|| Ok(vec![sample("GPU-a", None)])));
        let id = SandboxId::generate();
        let request = NodeGpus::parse_request(
            Some(&gpus),
            &serde_json::json!({"mode": "whole"}),
            &TenantId::admin(),
        )
        .unwrap();
        gpus.save_request(&id, &request).unwrap();
        gpus.acquire(&id).unwrap();
        let text = gpus.metrics();
        assert!(
            text.contains(
                "torpor_gpu_shares{node=\"n\",gpu=\"0\",UUID=\"GPU-a\",mode=\"whole\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains(&format!("tenant=\"admin\",sandbox=\"{id}\"}} 30")),
            "{text}"
        );
    }
}
