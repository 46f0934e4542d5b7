//! Kubernetes scheduler-extender wire types and the decisions behind them.
//!
//! The types are those of `k8s.io/kube-scheduler/extender/v1`, whose Go structs have no JSON
//! tags, so the Go field names are the JSON keys (`Pod`, `Nodes`, `NodeNames`, `FailedNodes`,
//! `FailedAndUnresolvableNodes`, `Error`, `Host`, `Score`, `PodName`, ...). The embedded
//! `v1.Pod` and `v1.NodeList` are Kubernetes objects: only the fields the extender reads are
//! typed, everything else is carried through untouched, so unknown fields are accepted there
//! (they are the API server's, not ours).
//!
//! A pod's GPU request is its `nvidia.com/gpu` limit (the larger of the containers' sum and
//! any init container's) plus these annotations for fractional modes:
//!
//! | annotation | meaning |
//! |---|---|
//! | `torpor.dev/gpu-mode` | `whole` (default), `mig`, `mps`, `timeslice` |
//! | `torpor.dev/gpu-profile` | MIG profile name or id, e.g. `3g.71gb` |
//! | `torpor.dev/gpu-compute-pct` | MPS active-thread percentage |
//! | `torpor.dev/gpu-memory-mib` | MPS pinned memory, or MIG memory when no profile is named |
//! | `torpor.dev/gpu-same-nvlink-domain` | `true`: all devices pairwise NVLinked |
//! | `torpor.dev/gpu-numa-local` | `true`: all devices on one NUMA node |
//! | `torpor.dev/tenant` | the tenant whose quota is charged |
//!
//! A fractional pod without an `nvidia.com/gpu` limit asks for one device. This module serves
//! no HTTP and talks to no API server: it maps requests to answers with the same planner.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::ids::{AllocationId, TenantId};
use crate::inventory::Inventory;
use crate::ledger::Ledger;
use crate::partition::PartitionMode;
use crate::planner::{commit, plan, Policy, Strategy};
use crate::quota::QuotaBook;
use crate::request::GpuRequest;

/// Resource name of NVIDIA's device plugin.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
pub const ANNOTATION_MODE: &str = "torpor.dev/gpu-mode";
pub const ANNOTATION_PROFILE: &str = "torpor.dev/gpu-profile";
pub const ANNOTATION_COMPUTE_PCT: &str = "torpor.dev/gpu-compute-pct";
pub const ANNOTATION_MEMORY_MIB: &str = "torpor.dev/gpu-memory-mib";
pub const ANNOTATION_SAME_NVLINK_DOMAIN: &str = "torpor.dev/gpu-same-nvlink-domain";
pub const ANNOTATION_NUMA_LOCAL: &str = "torpor.dev/gpu-numa-local";
pub const ANNOTATION_TENANT: &str = "torpor.dev/tenant";
/// Highest score an extender may give (`extenderv1.MaxExtenderPriority`).
pub const MAX_EXTENDER_PRIORITY: i64 = 10;
/// Pods remembered between filter and bind.
pub const MAX_PENDING_PODS: usize = 10_000;

/// `ObjectMeta`, the fields the extender reads.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uid: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    #[serde(flatten)]
    pub rest: BTreeMap<String, serde_json::Value>,
}

/// A resource quantity: Kubernetes writes `"2"`, some clients write `2`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Quantity {
    Text(String),
    Number(i64),
}

impl Quantity {
    /// Whole devices; `None` for anything that is not a non-negative integer.
    pub fn devices(&self) -> Option<u32> {
        match self {
            Quantity::Text(s) => s.trim().parse().ok(),
            Quantity::Number(n) => u32::try_from(*n).ok(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResourceRequirements {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, Quantity>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub requests: BTreeMap<String, Quantity>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Container {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub resources: ResourceRequirements,
    #[serde(flatten)]
    pub rest: BTreeMap<String, serde_json::Value>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    #[serde(default)]
    pub containers: Vec<Container>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub init_containers: Vec<Container>,
    #[serde(flatten)]
    pub rest: BTreeMap<String, serde_json::Value>,
}

/// `v1.Pod`, the fields the extender reads.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Pod {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: PodSpec,
    #[serde(flatten)]
    pub rest: BTreeMap<String, serde_json::Value>,
}

/// `v1.Node`, the fields the extender reads.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Node {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(flatten)]
    pub rest: BTreeMap<String, serde_json::Value>,
}

/// `v1.NodeList`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeList {
    #[serde(default)]
    pub items: Vec<Node>,
    #[serde(flatten)]
    pub rest: BTreeMap<String, serde_json::Value>,
}

/// Body of `POST /filter` and `POST /prioritize`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ExtenderArgs {
    #[serde(rename = "Pod")]
    pub pod: Option<Pod>,
    #[serde(rename = "Nodes", default)]
    pub nodes: Option<NodeList>,
    #[serde(rename = "NodeNames", default)]
    pub node_names: Option<Vec<String>>,
}

/// Answer to `POST /filter`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ExtenderFilterResult {
    #[serde(rename = "Nodes")]
    pub nodes: Option<NodeList>,
    #[serde(rename = "NodeNames")]
    pub node_names: Option<Vec<String>>,
    #[serde(rename = "FailedNodes")]
    pub failed_nodes: BTreeMap<String, String>,
    #[serde(rename = "FailedAndUnresolvableNodes")]
    pub failed_and_unresolvable_nodes: BTreeMap<String, String>,
    #[serde(rename = "Error")]
    pub error: String,
}

/// One entry of the answer to `POST /prioritize`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPriority {
    #[serde(rename = "Host")]
    pub host: String,
    #[serde(rename = "Score")]
    pub score: i64,
}

/// Body of `POST /bind`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtenderBindingArgs {
    #[serde(rename = "PodName")]
    pub pod_name: String,
    #[serde(rename = "PodNamespace")]
    pub pod_namespace: String,
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    #[serde(rename = "Node")]
    pub node: String,
}

/// Why `POST /bind` arguments cannot be used: the names go into a Kubernetes API URL, so they
/// must be what Kubernetes allows (a namespace is a DNS-1123 label, a pod and a node a DNS-1123
/// subdomain) before anything else is done with them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {value:?} is not a valid Kubernetes name: {rule}")]
pub struct BindArgsError {
    pub field: &'static str,
    pub value: String,
    pub rule: &'static str,
}

impl BindArgsError {
    pub fn code(&self) -> &'static str {
        "extender_bad_name"
    }
}

const LABEL_RULE: &str =
    "at most 63 lowercase letters, digits and '-', starting and ending with a letter or digit";
const SUBDOMAIN_RULE: &str = "at most 253 characters: dot-separated DNS-1123 labels (lowercase letters, digits and '-', each starting and ending with a letter or digit)";

/// A DNS-1123 label (`[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63).
pub fn is_dns1123_label(v: &str) -> bool {
    let b = v.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// A DNS-1123 subdomain: labels joined by `.`, at most 253 (so never `.`, `..`, `/` or `?`).
pub fn is_dns1123_subdomain(v: &str) -> bool {
    !v.is_empty() && v.len() <= 253 && v.split('.').all(is_dns1123_label)
}

/// Percent-encodes one URL path segment: everything but RFC 3986's unreserved characters.
/// (Dot segments cannot be made safe by encoding, since URL parsers read `%2e` as `.`: names
/// are validated first, see [`ExtenderBindingArgs::validate`].)
pub fn encode_path_segment(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl ExtenderBindingArgs {
    /// Refuses names Kubernetes would not have made: they are put into API URLs.
    pub fn validate(&self) -> Result<(), BindArgsError> {
        let bad = |field, value: &str, rule| BindArgsError {
            field,
            value: value.chars().take(300).collect(),
            rule,
        };
        if !is_dns1123_label(&self.pod_namespace) {
            return Err(bad("PodNamespace", &self.pod_namespace, LABEL_RULE));
        }
        if !is_dns1123_subdomain(&self.pod_name) {
            return Err(bad("PodName", &self.pod_name, SUBDOMAIN_RULE));
        }
        if !is_dns1123_subdomain(&self.node) {
            return Err(bad("Node", &self.node, SUBDOMAIN_RULE));
        }
        if self.pod_uid.is_empty()
            || self.pod_uid.len() > 128
            || self.pod_uid.chars().any(|c| c.is_control())
        {
            return Err(bad(
                "PodUID",
                &self.pod_uid,
                "1 to 128 characters, no control characters",
            ));
        }
        Ok(())
    }

    /// `/api/v1/namespaces/{ns}/pods/{name}/binding`, each name validated and percent-encoded.
    pub fn binding_path(&self) -> Result<String, BindArgsError> {
        self.validate()?;
        Ok(format!(
            "/api/v1/namespaces/{}/pods/{}/binding",
            encode_path_segment(&self.pod_namespace),
            encode_path_segment(&self.pod_name)
        ))
    }
}

/// Answer to `POST /bind`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtenderBindingResult {
    #[serde(rename = "Error")]
    pub error: String,
}

/// Why a pod's GPU request could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PodRequestError {
    #[error("the request has no Pod")]
    NoPod,
    #[error("{field}: {value:?} is not valid")]
    BadValue { field: String, value: String },
}

impl PodRequestError {
    pub fn code(&self) -> &'static str {
        match self {
            PodRequestError::NoPod => "extender_no_pod",
            PodRequestError::BadValue { .. } => "extender_bad_value",
        }
    }
}

fn parse_field<T: std::str::FromStr>(field: &str, value: &str) -> Result<T, PodRequestError> {
    value.trim().parse().map_err(|_| PodRequestError::BadValue {
        field: field.to_owned(),
        value: value.to_owned(),
    })
}

fn container_gpus(containers: &[Container]) -> Result<Vec<u32>, PodRequestError> {
    containers
        .iter()
        .map(|c| match c.resources.limits.get(GPU_RESOURCE) {
            None => Ok(0),
            Some(q) => q.devices().ok_or_else(|| PodRequestError::BadValue {
                field: format!("container {} limits {GPU_RESOURCE}", c.name),
                value: format!("{q:?}"),
            }),
        })
        .collect()
}

/// The GPU request of a pod; `None` when it asks for no GPU.
pub fn pod_request(pod: &Pod) -> Result<Option<GpuRequest>, PodRequestError> {
    let annotations = &pod.metadata.annotations;
    let sum: u32 = container_gpus(&pod.spec.containers)?.iter().sum();
    let init = container_gpus(&pod.spec.init_containers)?
        .into_iter()
        .max()
        .unwrap_or(0);
    let mut count = sum.max(init);
    let mode = match annotations.get(ANNOTATION_MODE) {
        None => PartitionMode::Whole,
        Some(value) => serde_json::from_value(serde_json::Value::String(value.trim().to_owned()))
            .map_err(|_| PodRequestError::BadValue {
            field: ANNOTATION_MODE.to_owned(),
            value: value.clone(),
        })?,
    };
    if count == 0 {
        if mode == PartitionMode::Whole {
            return Ok(None);
        }
        count = 1;
    }
    let flag = |name: &str| -> Result<bool, PodRequestError> {
        annotations
            .get(name)
            .map_or(Ok(false), |v| parse_field(name, v))
    };
    let request = GpuRequest {
        count,
        mode,
        profile: annotations.get(ANNOTATION_PROFILE).cloned(),
        compute_pct: annotations
            .get(ANNOTATION_COMPUTE_PCT)
            .map(|v| parse_field(ANNOTATION_COMPUTE_PCT, v))
            .transpose()?,
        memory_mib: annotations
            .get(ANNOTATION_MEMORY_MIB)
            .map(|v| parse_field(ANNOTATION_MEMORY_MIB, v))
            .transpose()?,
        same_nvlink_domain: flag(ANNOTATION_SAME_NVLINK_DOMAIN)?,
        numa_local: flag(ANNOTATION_NUMA_LOCAL)?,
        tenant: annotations
            .get(ANNOTATION_TENANT)
            .map(|v| {
                TenantId::new(v.trim()).map_err(|_| PodRequestError::BadValue {
                    field: ANNOTATION_TENANT.to_owned(),
                    value: v.clone(),
                })
            })
            .transpose()?,
        model: None,
    };
    Ok(Some(request))
}

/// The extender's view of the cluster: one declared inventory and ledger per node.
#[derive(Debug, Clone)]
pub struct Extender {
    nodes: BTreeMap<String, (Inventory, Ledger)>,
    policy: Policy,
    quotas: QuotaBook,
    pending: BTreeMap<String, GpuRequest>,
    pending_order: VecDeque<String>,
    bound: BTreeMap<String, (String, Vec<AllocationId>)>,
    /// Sequence number of each bound pod's bind (see [`crate::pod_watch`]).
    bound_seq: BTreeMap<String, u64>,
    seq: u64,
}

impl Extender {
    pub fn new(inventories: Vec<Inventory>, policy: Policy, quotas: QuotaBook) -> Self {
        let nodes = inventories
            .into_iter()
            .map(|inv| {
                let ledger = Ledger::new(&inv);
                (inv.node.to_string(), (inv, ledger))
            })
            .collect();
        Extender {
            nodes,
            policy,
            quotas,
            pending: BTreeMap::new(),
            pending_order: VecDeque::new(),
            bound: BTreeMap::new(),
            bound_seq: BTreeMap::new(),
            seq: 0,
        }
    }

    /// Names of the nodes served.
    pub fn node_names(&self) -> Vec<String> {
        self.nodes.keys().cloned().collect()
    }

    /// Starts a pod list: returns its sequence number. The list judges only pods whose bind
    /// (or [`Extender::touch_bound`]) came before, so a pod the API server may not yet show
    /// on its node is not released by mistake.
    pub fn begin_list(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// Marks a bound pod as bound now (after its Binding was posted to the API server).
    pub fn touch_bound(&mut self, pod_uid: &str) {
        if let Some(seq) = self.bound_seq.get_mut(pod_uid) {
            *seq = self.seq;
        }
    }

    /// Pods holding shares on `node`, with the sequence number of their bind.
    pub fn bound_on(&self, node: &str) -> BTreeMap<String, u64> {
        self.bound
            .iter()
            .filter(|(_, (n, _))| n == node)
            .map(|(uid, _)| (uid.clone(), self.bound_seq.get(uid).copied().unwrap_or(0)))
            .collect()
    }

    /// The ledger of a node, for inspection.
    pub fn ledger(&self, node: &str) -> Option<&Ledger> {
        self.nodes.get(node).map(|(_, l)| l)
    }

    fn candidates(args: &ExtenderArgs) -> Vec<String> {
        match (&args.node_names, &args.nodes) {
            (Some(names), _) => names.clone(),
            (None, Some(list)) => list.items.iter().map(|n| n.metadata.name.clone()).collect(),
            (None, None) => Vec::new(),
        }
    }

    fn remember(&mut self, uid: &str, request: &GpuRequest) {
        if uid.is_empty() {
            return;
        }
        if self
            .pending
            .insert(uid.to_owned(), request.clone())
            .is_none()
        {
            self.pending_order.push_back(uid.to_owned());
        }
        while self.pending_order.len() > MAX_PENDING_PODS {
            if let Some(old) = self.pending_order.pop_front() {
                self.pending.remove(&old);
            }
        }
    }

    /// `POST /filter`: nodes that can take the pod's request now.
    pub fn filter(&mut self, args: &ExtenderArgs) -> ExtenderFilterResult {
        let mut result = ExtenderFilterResult::default();
        let Some(pod) = &args.pod else {
            result.error = PodRequestError::NoPod.to_string();
            return result;
        };
        let request = match pod_request(pod) {
            Ok(r) => r,
            Err(e) => {
                result.error = e.to_string();
                return result;
            }
        };
        let mut passed = Vec::new();
        for name in Self::candidates(args) {
            let Some(request) = &request else {
                passed.push(name);
                continue;
            };
            match self.nodes.get(&name) {
                None => {
                    result.failed_and_unresolvable_nodes.insert(
                        name.clone(),
                        format!("node {name} has no torpor GPU inventory"),
                    );
                }
                Some((inv, ledger)) => {
                    match plan(inv, ledger, request, &self.policy, &self.quotas) {
                        Ok(_) => passed.push(name),
                        Err(refusal) => {
                            result
                                .failed_nodes
                                .insert(name, format!("{}: {refusal}", refusal.code()));
                        }
                    }
                }
            }
        }
        if let Some(request) = &request {
            self.remember(&pod.metadata.uid, request);
        }
        if args.node_names.is_some() {
            result.node_names = Some(passed);
        } else if let Some(list) = &args.nodes {
            result.nodes = Some(NodeList {
                items: list
                    .items
                    .iter()
                    .filter(|n| passed.contains(&n.metadata.name))
                    .cloned()
                    .collect(),
                rest: list.rest.clone(),
            });
        }
        result
    }

    /// `POST /prioritize`: 0..=10 per node; binpack favours fuller nodes, spread emptier ones.
    pub fn prioritize(&self, args: &ExtenderArgs) -> Vec<HostPriority> {
        let request = args
            .pod
            .as_ref()
            .and_then(|pod| pod_request(pod).ok())
            .flatten();
        Self::candidates(args)
            .into_iter()
            .map(|host| {
                let score = match (&request, self.nodes.get(&host)) {
                    (Some(request), Some((inv, ledger))) => {
                        match plan(inv, ledger, request, &self.policy, &self.quotas) {
                            Ok(_) => {
                                let fill: u64 = ledger
                                    .usage()
                                    .iter()
                                    .zip(inv.gpus())
                                    .map(|(u, g)| u64::from(u.fill_permille(g)))
                                    .sum();
                                let max = 1000 * inv.gpus().len() as u64;
                                let fill = (fill * MAX_EXTENDER_PRIORITY as u64 + max / 2) / max;
                                match self.policy.strategy {
                                    Strategy::Binpack => fill as i64,
                                    Strategy::Spread => MAX_EXTENDER_PRIORITY - fill as i64,
                                }
                            }
                            Err(_) => 0,
                        }
                    }
                    _ => 0,
                };
                HostPriority { host, score }
            })
            .collect()
    }

    /// `POST /bind`: commits the pod's GPU shares on the chosen node. Posting the Binding to
    /// the API server is the caller's job once this succeeds.
    pub fn bind(&mut self, args: &ExtenderBindingArgs) -> ExtenderBindingResult {
        let fail = |error: String| ExtenderBindingResult { error };
        if let Err(e) = args.validate() {
            return fail(format!("{}: {e}", e.code()));
        }
        let Some(request) = self.pending.get(&args.pod_uid).cloned() else {
            return fail(format!(
                "pod {}/{} ({}) was not filtered by this extender",
                args.pod_namespace, args.pod_name, args.pod_uid
            ));
        };
        if self.bound.contains_key(&args.pod_uid) {
            return fail(format!("pod {} is already bound", args.pod_uid));
        }
        let Some((inv, ledger)) = self.nodes.get_mut(&args.node) else {
            return fail(format!("node {} has no torpor GPU inventory", args.node));
        };
        let planned = match plan(inv, ledger, &request, &self.policy, &self.quotas) {
            Ok(p) => p,
            Err(refusal) => return fail(format!("{}: {refusal}", refusal.code())),
        };
        match commit(inv, ledger, &planned, &self.policy) {
            Ok(ids) => {
                self.pending.remove(&args.pod_uid);
                self.pending_order.retain(|u| u != &args.pod_uid);
                self.bound
                    .insert(args.pod_uid.clone(), (args.node.clone(), ids));
                self.bound_seq.insert(args.pod_uid.clone(), self.seq);
                ExtenderBindingResult::default()
            }
            Err(e) => fail(format!("{}: {e}", e.code())),
        }
    }

    /// Gives back the shares of a pod that ended.
    pub fn release_pod(&mut self, pod_uid: &str) -> bool {
        let Some((node, ids)) = self.bound.remove(pod_uid) else {
            return false;
        };
        self.bound_seq.remove(pod_uid);
        if let Some((_, ledger)) = self.nodes.get_mut(&node) {
            for id in ids {
                let _released = ledger.release(id).is_ok();
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_accept_strings_and_numbers() {
        assert_eq!(Quantity::Text("2".into()).devices(), Some(2));
        assert_eq!(Quantity::Number(1).devices(), Some(1));
        assert_eq!(Quantity::Text("500m".into()).devices(), None);
        assert_eq!(Quantity::Number(-1).devices(), None);
    }

    #[test]
    fn pod_request_reads_limits_and_annotations() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "annotations": {
                "torpor.dev/gpu-mode": "mig",
                "torpor.dev/gpu-profile": "3g.71gb",
                "torpor.dev/tenant": "team-a",
                "torpor.dev/gpu-same-nvlink-domain": "true"
            }},
            "spec": {"containers": [
                {"name": "a", "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "2"}}},
                {"name": "b", "resources": {"limits": {"nvidia.com/gpu": 1}}}
            ], "initContainers": [
                {"name": "i", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
            ]}
        }))
        .unwrap();
        let r = pod_request(&pod).unwrap().unwrap();
        assert_eq!(r.count, 2);
        assert_eq!(r.mode, PartitionMode::Mig);
        assert_eq!(r.profile.as_deref(), Some("3g.71gb"));
        assert!(r.same_nvlink_domain);
        assert_eq!(r.tenant.unwrap().as_str(), "team-a");
    }

    #[test]
    fn pods_without_gpus_ask_for_nothing_and_bad_annotations_are_named() {
        let none: Pod =
            serde_json::from_value(serde_json::json!({"spec": {"containers": [{"name": "c"}]}}))
                .unwrap();
        assert_eq!(pod_request(&none).unwrap(), None);
        let mut mps = none.clone();
        mps.metadata
            .annotations
            .insert(ANNOTATION_MODE.into(), "mps".into());
        mps.metadata
            .annotations
            .insert(ANNOTATION_COMPUTE_PCT.into(), "lots".into());
        let err = pod_request(&mps).unwrap_err();
        assert_eq!(err.code(), "extender_bad_value");
        assert!(err.to_string().contains(ANNOTATION_COMPUTE_PCT));
        mps.metadata
            .annotations
            .insert(ANNOTATION_COMPUTE_PCT.into(), "20".into());
        assert_eq!(pod_request(&mps).unwrap().unwrap().count, 1);
    }
}
