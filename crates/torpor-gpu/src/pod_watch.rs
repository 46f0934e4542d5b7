//! Which bound pods ended, from the Kubernetes API server's view of a node's pods.
//!
//! The extender lists the pods of each node it serves
//! (`GET /api/v1/pods?fieldSelector=spec.nodeName=NODE`, a `v1.PodList`), then watches them
//! from the list's `resourceVersion` (`&watch=1`, a stream of `metav1.WatchEvent` objects,
//! one JSON object a line). A bound pod's GPU shares are given back when the pod is
//! `Succeeded` or `Failed`, when a watch says it was `DELETED`, or when a list that started
//! after its bind no longer has it. Pods bound after a list began are left alone by that list
//! (the API server may not have seen their Binding yet). This module is pure: the HTTP lives
//! in the binary.

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;

/// The path (and query) listing a node's pods.
pub fn list_path(node: &str) -> String {
    let node = crate::extender::encode_path_segment(node);
    format!("/api/v1/pods?fieldSelector=spec.nodeName%3D{node}")
}

/// The path watching a node's pods from `resource_version`, ending after `timeout_secs`.
pub fn watch_path(node: &str, resource_version: &str, timeout_secs: u64) -> String {
    let node = crate::extender::encode_path_segment(node);
    let resource_version = crate::extender::encode_path_segment(resource_version);
    format!(
        "/api/v1/pods?fieldSelector=spec.nodeName%3D{node}&watch=1&resourceVersion={resource_version}&allowWatchBookmarks=true&timeoutSeconds={timeout_secs}"
    )
}

/// `metav1.ListMeta`, the field read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListMeta {
    #[serde(default)]
    pub resource_version: String,
}

/// `metav1.ObjectMeta`, the fields read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodMeta {
    #[serde(default)]
    pub uid: String,
    #[serde(default)]
    pub resource_version: String,
}

/// `v1.PodStatus`, the field read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct PodStatus {
    #[serde(default)]
    pub phase: String,
}

/// A `v1.Pod` as the API server returns it (the fields read; everything else is ignored).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct PodView {
    #[serde(default)]
    pub metadata: PodMeta,
    #[serde(default)]
    pub status: PodStatus,
}

impl PodView {
    /// `Succeeded` or `Failed`: its containers are gone and will not restart.
    pub fn ended(&self) -> bool {
        matches!(self.status.phase.as_str(), "Succeeded" | "Failed")
    }
}

/// A `v1.PodList`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct PodList {
    #[serde(default)]
    pub metadata: ListMeta,
    #[serde(default)]
    pub items: Vec<PodView>,
}

/// One line of a watch stream (`metav1.WatchEvent`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct WatchEvent {
    #[serde(rename = "type")]
    pub kind: String,
    pub object: serde_json::Value,
}

/// What a watch event means for the extender.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchAction {
    /// Give the pod's shares back.
    Release {
        uid: String,
        resource_version: String,
    },
    /// Nothing to do; continue from this resource version (empty: unchanged).
    Continue { resource_version: String },
    /// The watch cannot go on (`ERROR`, e.g. 410 Gone): list again.
    Relist { reason: String },
}

/// The pods bound on a node that a list shows ended or gone: `bound` maps each bound pod's
/// uid to the sequence number of its bind; `list_started` is the sequence number when the
/// list request was sent (pods bound later are not judged by it).
pub fn ended_in_list(
    bound: &BTreeMap<String, u64>,
    list: &PodList,
    list_started: u64,
) -> Vec<String> {
    let present: BTreeMap<&str, &PodView> = list
        .items
        .iter()
        .map(|p| (p.metadata.uid.as_str(), p))
        .collect();
    bound
        .iter()
        .filter(|(uid, seq)| match present.get(uid.as_str()) {
            Some(pod) => pod.ended(),
            None => **seq < list_started,
        })
        .map(|(uid, _)| uid.clone())
        .collect()
}

/// The action for one watch event about the node's pods (`bound`: the uids holding shares).
pub fn watch_action(event: &WatchEvent, bound: &BTreeSet<String>) -> WatchAction {
    if event.kind == "ERROR" {
        let reason = event
            .object
            .get("message")
            .and_then(|m| m.as_str())
            .unwrap_or("watch error")
            .to_owned();
        return WatchAction::Relist { reason };
    }
    let pod: PodView = match serde_json::from_value(event.object.clone()) {
        Ok(p) => p,
        Err(e) => {
            return WatchAction::Relist {
                reason: format!("unreadable watch object: {e}"),
            }
        }
    };
    let resource_version = pod.metadata.resource_version.clone();
    let ends = match event.kind.as_str() {
        "DELETED" => true,
        "ADDED" | "MODIFIED" => pod.ended(),
        _ => false, // BOOKMARK
    };
    if ends && bound.contains(&pod.metadata.uid) {
        WatchAction::Release {
            uid: pod.metadata.uid,
            resource_version,
        }
    } else {
        WatchAction::Continue { resource_version }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A `v1.PodList` in the shape the API server returns (trimmed pod objects).
    fn list() -> PodList {
        serde_json::from_value(json!({
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": "4711"},
            "items": [
                {"metadata": {"name": "a", "namespace": "default", "uid": "uid-a", "resourceVersion": "4700"},
                 "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x"}]},
                 "status": {"phase": "Running"}},
                {"metadata": {"name": "b", "namespace": "default", "uid": "uid-b", "resourceVersion": "4701",
                              "deletionTimestamp": "2026-11-30T15:00:00Z"},
                 "spec": {"nodeName": "n1"},
                 "status": {"phase": "Succeeded"}},
                {"metadata": {"name": "c", "namespace": "default", "uid": "uid-c"},
                 "spec": {"nodeName": "n1"},
                 "status": {"phase": "Failed"}}
            ]
        }))
        .unwrap()
    }

    #[test]
    fn paths_are_the_api_servers() {
        assert_eq!(
            list_path("gpu-node-1"),
            "/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-node-1"
        );
        assert_eq!(
            watch_path("n", "42", 30),
            "/api/v1/pods?fieldSelector=spec.nodeName%3Dn&watch=1&resourceVersion=42&allowWatchBookmarks=true&timeoutSeconds=30"
        );
    }

    #[test]
    fn a_list_releases_ended_and_vanished_pods_bound_before_it() {
        let l = list();
        assert_eq!(l.metadata.resource_version, "4711");
        let bound = BTreeMap::from([
            ("uid-a".to_owned(), 1),    // running: kept
            ("uid-b".to_owned(), 2),    // succeeded: released
            ("uid-c".to_owned(), 3),    // failed: released
            ("uid-gone".to_owned(), 4), // absent, bound before the list: released
            ("uid-new".to_owned(), 9),  // absent, bound after the list began: kept
        ]);
        assert_eq!(
            ended_in_list(&bound, &l, 5),
            vec![
                "uid-b".to_owned(),
                "uid-c".to_owned(),
                "uid-gone".to_owned()
            ]
        );
        assert!(ended_in_list(&BTreeMap::new(), &l, 5).is_empty());
    }

    #[test]
    fn watch_events_release_deleted_and_finished_pods() {
        let bound = BTreeSet::from(["uid-a".to_owned()]);
        let event = |kind: &str, phase: &str| WatchEvent {
            kind: kind.to_owned(),
            object: json!({"kind": "Pod", "apiVersion": "v1",
                "metadata": {"name": "a", "uid": "uid-a", "resourceVersion": "5000"},
                "status": {"phase": phase}}),
        };
        assert_eq!(
            watch_action(&event("MODIFIED", "Running"), &bound),
            WatchAction::Continue {
                resource_version: "5000".into()
            }
        );
        assert_eq!(
            watch_action(&event("MODIFIED", "Succeeded"), &bound),
            WatchAction::Release {
                uid: "uid-a".into(),
                resource_version: "5000".into()
            }
        );
        assert!(matches!(
            watch_action(&event("DELETED", "Running"), &bound),
            WatchAction::Release { .. }
        ));
        // Not ours: nothing to release.
        assert!(matches!(
            watch_action(&event("DELETED", "Running"), &BTreeSet::new()),
            WatchAction::Continue { .. }
        ));
        let bookmark: WatchEvent = serde_json::from_str(
            r#"{"type":"BOOKMARK","object":{"kind":"Pod","apiVersion":"v1","metadata":{"resourceVersion":"6000"}}}"#,
        )
        .unwrap();
        assert_eq!(
            watch_action(&bookmark, &bound),
            WatchAction::Continue {
                resource_version: "6000".into()
            }
        );
        let gone: WatchEvent = serde_json::from_str(
            r#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","status":"Failure","message":"too old resource version: 1 (4711)","reason":"Expired","code":410}}"#,
        )
        .unwrap();
        assert_eq!(
            watch_action(&gone, &bound),
            WatchAction::Relist {
                reason: "too old resource version: 1 (4711)".into()
            }
        );
    }
}
