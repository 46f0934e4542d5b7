//! The custom resources (`torpor.dev/v1alpha1`): [`SandboxTemplate`], [`TenantQuota`] and
//! [`WorkerPool`]. Each spec says what torpor's API takes for that object, in Kubernetes' own
//! spelling (camelCase); `crate::body` turns a spec into the API's body. All three are
//! cluster-scoped: torpor's tenants are global, and whoever may create these objects acts for
//! any tenant (and as the operator for objects without a tenant), so creating them is a
//! cluster administrator's right, never a namespace's.
//!
//! Every object has a status subresource with `conditions` (one of type `Ready`: `True` once
//! torpor holds what the spec says; `False` with torpor's error code as `reason` and its
//! message), `observedGeneration`, and whether this object created (and so deletes) the
//! object in torpor (`managed`).

// clippy reads the repeated `type_ = ...` of several `printcolumn(...)` as one attribute given
// twice; they are separate columns.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The API group of every torpor resource.
pub const GROUP: &str = "torpor.dev";
/// The finalizer that makes the operator delete the object in torpor first.
pub const FINALIZER: &str = "torpor.dev/cleanup";

// ---------------------------------------------------------------------------------------------
// SandboxTemplate

/// A template: what `POST /v1/templates` takes. Registering it boots it once and takes its
/// golden snapshot; torpor has no update of a template, so a changed spec deletes and
/// registers it again (refused with `template_in_use` while it has sandboxes).
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "torpor.dev",
    version = "v1alpha1",
    kind = "SandboxTemplate",
    status = "SandboxTemplateStatus",
    shortname = "stpl",
    category = "torpor",
    doc = "A torpor template (POST /v1/templates): the recipe a sandbox is restored from.",
    printcolumn(name = "Tenant", type_ = "string", json_path = ".spec.tenant"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxTemplateSpec {
    /// The template's name in torpor (default: the object's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The tenant that owns it (its TenantQuota must exist); absent: the operator's own
    /// template, which every tenant may use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    pub source: TemplateSourceSpec,
    /// The agent's main process, started once at boot and captured in the golden snapshot.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<LimitsSpec>,
    /// Idle seconds before each step down the sleep ladder. Absent: torpor's defaults (5, 120,
    /// 3600); present, a field left out disables that step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle: Option<IdleSpec>,
    /// Milliseconds the main process warms up before the golden snapshot (at most 600000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuSpec>,
    /// The default egress policy of its sandboxes; absent: no network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkSpec>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum SourceKind {
    /// The host's /usr, /bin, /lib* read-only, with an /etc that torpor writes.
    Host,
    /// A root-filesystem directory on the controller's machine (`path`).
    Rootfs,
    /// An OCI layout, oci-archive or `docker save` tarball on the controller's machine.
    Image,
}

/// Where the root filesystem comes from. Paths are on torpor's side: the admin's anywhere, a
/// tenant's only inside the daemon's `--import-dir` (else `forbidden`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TemplateSourceSpec {
    pub kind: SourceKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// `image` only: which image of the archive (tag or ref name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
}

/// Resource limits of each sandbox; a field left out takes torpor's default (512 MiB, 1 CPU,
/// 256 pids).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LimitsSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u64>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IdleSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freeze_after_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub park_after_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspend_after_s: Option<f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum GpuMode {
    Whole,
    Mig,
    Mps,
    Timeslice,
}

/// The GPU share every sandbox of the template asks for (docs/GPU.md).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
    pub mode: GpuMode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_pct: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub same_nvlink_domain: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_local: Option<bool>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NetworkModeSpec {
    /// No network interface at all.
    None,
    /// Any destination.
    Full,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum VerdictSpec {
    Deny,
    Allow,
}

/// Either `mode` alone, or rules (docs/NETWORKING.md): a destination in `allow` (or an address
/// one of `hosts` resolved to) passes; else one in `deny` is refused; else `default` decides.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NetworkSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<NetworkModeSpec>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<AllowRuleSpec>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<AllowRuleSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<VerdictSpec>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AllowRuleSpec {
    pub cidr: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxTemplateStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// This object registered the template in torpor, and deleting it deletes the template.
    #[serde(default)]
    pub managed: bool,
    /// A digest of the body last registered (a changed spec is registered again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_digest: Option<String>,
    /// torpor's status of the template (`ready`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub golden_snapshot_bytes: Option<u64>,
}

// ---------------------------------------------------------------------------------------------
// TenantQuota

/// A tenant and its quotas: what `POST /v1/tenants` takes. The object's name is the tenant's.
/// The tenant's token (shown once by torpor) is kept in the Secret `torpor-tenant-<name>`
/// (key `token`) in the operator's namespace. torpor has no update of a tenant's quotas: a
/// changed spec deletes and creates the tenant again (a new token), which torpor refuses
/// with `tenant_in_use` while the tenant owns sandboxes, templates or pools.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "torpor.dev",
    version = "v1alpha1",
    kind = "TenantQuota",
    status = "TenantQuotaStatus",
    shortname = "tq",
    category = "torpor",
    doc = "A torpor tenant and its quotas (POST /v1/tenants); the object's name is the tenant's.",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Token", type_ = "string", json_path = ".status.tokenSecret"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TenantQuotaSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sandboxes: Option<u64>,
    /// Resident (Running or Frozen) sandboxes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_running: Option<u64>,
    /// Memory limits of resident sandboxes, summed, in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_memory_mib: Option<u64>,
    /// CPU limits of resident sandboxes, summed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cpus: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_templates: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pools: Option<u64>,
    /// Disk its checkpoints, golden snapshots and uploads take, in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_disk_mib: Option<u64>,
    /// API requests per second (default: the controller's --default-requests-per-s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_s: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantQuotaStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default)]
    pub managed: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_digest: Option<String>,
    /// The Secret (in the operator's namespace) holding the tenant's token under `token`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// WorkerPool

/// An event-driven pool: what `POST /v1/pools` takes (docs/OPERATIONS.md, "Event-driven
/// pools"). A changed spec deletes and creates the pool again.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "torpor.dev",
    version = "v1alpha1",
    kind = "WorkerPool",
    status = "WorkerPoolStatus",
    shortname = "wpool",
    category = "torpor",
    doc = "A torpor event-driven pool (POST /v1/pools): agents of a template scaled from queue depth.",
    printcolumn(name = "Tenant", type_ = "string", json_path = ".spec.tenant"),
    printcolumn(name = "Template", type_ = "string", json_path = ".spec.template"),
    printcolumn(name = "Desired", type_ = "integer", json_path = ".status.desired"),
    printcolumn(name = "Running", type_ = "integer", json_path = ".status.running"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkerPoolSpec {
    /// The pool's name in torpor (default: the object's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The tenant that owns it (its TenantQuota must exist); absent: the operator's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The template its agents are made from (the tenant's own or the operator's).
    pub template: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<u32>,
    pub max: u32,
    /// Messages per agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cooldown_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub poll_interval_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub push: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<FallbackSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_grace_s: Option<u64>,
    /// 1 to 8 triggers; several combine by maximum.
    pub triggers: Vec<TriggerSpec>,
    /// Dispatch mode when present; without it the agents consume the broker themselves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch: Option<DispatchSpec>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FallbackSpec {
    pub failure_threshold: u32,
    pub replicas: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum TriggerType {
    RedisList,
    RedisStream,
    NatsJetstream,
    Rabbitmq,
    Kafka,
}

/// One trigger; which fields it needs depends on `type` (docs/OPERATIONS.md): `redis-list`
/// url, key; `redis-stream` url, stream, group; `nats-jetstream` url, stream, consumer;
/// `rabbitmq` url, queue, managementUrl?; `kafka` brokers, topic, group, offsetReset?.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TriggerSpec {
    #[serde(rename = "type")]
    pub type_: TriggerType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumer: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub management_url: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub brokers: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset_reset: Option<String>,
}

/// Dispatch mode: exactly one of `command` and `http`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DispatchSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpDispatchSpec>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_backoff_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpDispatchSpec {
    pub port: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkerPoolStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default)]
    pub managed: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_digest: Option<String>,
    /// Agents torpor wants now, and those active (from the pool's status in torpor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<u32>,
    /// Demand: the deepest trigger's depth; absent while no trigger answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub depth: Option<u64>,
}

// ---------------------------------------------------------------------------------------------
// Conditions

/// A status condition, shaped like `metav1.Condition`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// `Ready`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// `Reconciled`, or torpor's error code (`template_in_use`, `quota_exceeded`, ...), or one
    /// of the operator's own (`invalid_spec`, `tenant_token_missing`, `torpor_unreachable`,
    /// `already_exists`).
    pub reason: String,
    pub message: String,
    /// RFC 3339.
    pub last_transition_time: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The condition type every object has.
pub const READY: &str = "Ready";

/// All three CRDs, in the order `torpor k8s crds` prints them.
pub fn crds(
) -> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>
{
    use kube::CustomResourceExt;
    vec![
        SandboxTemplate::crd(),
        TenantQuota::crd(),
        WorkerPool::crd(),
    ]
}

#[derive(Debug, thiserror::Error)]
#[error("cannot write the CRDs as YAML: {0}")]
pub struct CrdYamlError(String);

/// The CRDs as one multi-document YAML stream (what deploy/k8s/base/crds.yaml holds).
pub fn crds_yaml() -> Result<String, CrdYamlError> {
    let mut out = String::from(
        "# Generated by `torpor k8s crds` from crates/torpor-k8s/src/crd.rs: do not edit.\n",
    );
    for crd in crds() {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(&crd).map_err(|e| CrdYamlError(e.to_string()))?);
        if !out.ends_with('\n') {
            out.push('\n');
        }
    }
    Ok(out)
}
