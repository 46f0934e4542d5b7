//! Cluster mode: the GPUs are the workers'. A controller keeps each sandbox's request in the
//! state store and sends it with every start ([`torpor_runtime::LaunchGpu`]); the worker that
//! takes the start places the share from its own ledger (refusing when it cannot), injects its
//! variables into every exec, and gives it back when the container goes. The controller's
//! fleet adds the tenant's cluster-wide quota to each start. This module is the engine's view
//! of that: which workers have GPUs (to check a request at create) and the request's wire form.

use torpor_core::TenantId;
use torpor_gpu::request::GpuRequest;

use super::GpuError;

/// The workers' GPUs as a controller sees them (the binary implements it over its fleet).
pub trait FleetGpus: Send + Sync {
    /// Every ready worker with GPUs, by name, with its GPU models (one entry per GPU).
    fn gpu_workers(&self) -> Vec<(String, Vec<String>)>;
    /// Sandbox `id` is gone: the workers drop the wake ticket they keep for it (in the
    /// background; a worker that misses it keeps a ticket that holds no capacity).
    fn forget_tickets(&self, id: &torpor_core::SandboxId);
}

/// Parses and checks a GPU request for `tenant`'s sandbox in cluster mode: its shape, and that
/// some ready worker has the GPUs it names (their count, of its model if it names one). What
/// only a worker's planner can tell (a MIG profile, memory) is checked by the worker at start.
pub fn parse_fleet_request(
    fleet: &dyn FleetGpus,
    value: &serde_json::Value,
    tenant: &TenantId,
) -> Result<GpuRequest, GpuError> {
    let request = super::requests::owned_request(value, tenant)?;
    request.validate().map_err(|e| GpuError::BadRequest {
        code: e.code(),
        message: e.to_string(),
    })?;
    let workers = fleet.gpu_workers();
    if workers.is_empty() {
        return Err(GpuError::NotConfigured);
    }
    let fits = |models: &Vec<String>| {
        let n = models
            .iter()
            .filter(|m| request.model.as_ref().is_none_or(|want| want == *m))
            .count();
        n >= request.count as usize
    };
    if !workers.iter().any(|(_, models)| fits(models)) {
        let most = workers
            .iter()
            .map(|(name, models)| format!("{name}: {}", models.join(", ")))
            .collect::<Vec<_>>()
            .join("; ");
        return Err(GpuError::BadRequest {
            code: "no_worker_fits",
            message: format!(
                "no ready worker has {} GPU(s){}; the workers' GPUs: {most}",
                request.count,
                request
                    .model
                    .as_ref()
                    .map(|m| format!(" of model {m}"))
                    .unwrap_or_default()
            ),
        });
    }
    Ok(request)
}

/// A GPU request as a start carries it.
pub fn launch_gpu(request: &GpuRequest) -> Result<torpor_runtime::LaunchGpu, GpuError> {
    Ok(torpor_runtime::LaunchGpu {
        request: serde_json::to_string(request).map_err(|e| GpuError::BadRequest {
            code: "request_malformed",
            message: format!("gpu: {e}"),
        })?,
        quota: None,
    })
}

/// A worker's GPU refusal (its stable code travels with it) as the error the API maps; other
/// errors pass through.
pub fn from_worker(code: &str, message: String) -> GpuError {
    match code {
        "gpu_quota_exceeded" => GpuError::Quota {
            code: "quota_exceeded",
            message,
        },
        "gpu_request_invalid" => GpuError::BadRequest {
            code: "request_invalid",
            message,
        },
        "gpu_driver_error" => GpuError::Driver(message),
        "gpu_runtime_unsupported" => GpuError::RuntimeUnsupported(message),
        "gpu_not_configured" => GpuError::NotConfigured,
        _ => GpuError::Unavailable {
            code: "no_free_share",
            message,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    struct Workers(Vec<(String, Vec<String>)>);

    impl FleetGpus for Workers {
        fn gpu_workers(&self) -> Vec<(String, Vec<String>)> {
            self.0.clone()
        }
        fn forget_tickets(&self, _: &torpor_core::SandboxId) {}
    }

    fn two_l4s_and_an_h200() -> Workers {
        Workers(vec![
            ("a".into(), vec!["NVIDIA L4".into(), "NVIDIA L4".into()]),
            ("b".into(), vec!["NVIDIA H200".into()]),
        ])
    }

    fn tenant(name: &str) -> TenantId {
        name.parse().unwrap()
    }

    #[test]
    fn a_request_is_charged_to_the_sandboxs_owner_whatever_it_names() {
        // Attack: a tenant names another tenant in its request to spend that one's quota.
        let r = parse_fleet_request(
            &two_l4s_and_an_h200(),
            &json!({"mode": "whole", "tenant": "victim"}),
            &tenant("mallory"),
        )
        .unwrap();
        assert_eq!(r.tenant.unwrap().as_str(), "mallory");
    }

    #[test]
    fn a_request_no_worker_could_hold_is_refused_at_create() {
        let fleet = two_l4s_and_an_h200();
        let t = tenant("acme");
        assert!(parse_fleet_request(&fleet, &json!({"mode": "whole", "count": 2}), &t).is_ok());
        let err = parse_fleet_request(
            &fleet,
            &json!({"mode": "whole", "count": 2, "model": "NVIDIA H200"}),
            &t,
        )
        .unwrap_err();
        assert_eq!(err.code(), "gpu_request_invalid");
        assert!(err.to_string().contains("b: NVIDIA H200"), "{err}");
        let err =
            parse_fleet_request(&fleet, &json!({"mode": "whole", "count": 0}), &t).unwrap_err();
        assert_eq!(err.code(), "gpu_request_invalid");
        let err = parse_fleet_request(&fleet, &json!({"mode": "warp"}), &t).unwrap_err();
        assert_eq!(err.code(), "gpu_request_invalid");
        let none = Workers(Vec::new());
        let err = parse_fleet_request(&none, &json!({"mode": "whole"}), &t).unwrap_err();
        assert_eq!(err.code(), "gpu_not_configured");
    }

    #[test]
    fn a_workers_refusal_keeps_its_kind() {
        assert_eq!(
            from_worker("gpu_quota_exceeded", "x".into()).code(),
            "gpu_quota_exceeded"
        );
        assert_eq!(
            from_worker("gpu_unavailable", "x".into()).code(),
            "gpu_unavailable"
        );
        assert_eq!(
            from_worker("gpu_request_invalid", "x".into()).code(),
            "gpu_request_invalid"
        );
        assert_eq!(
            from_worker("something_new", "x".into()).code(),
            "gpu_unavailable"
        );
    }
}
