//! The scheduler extender, driven with the JSON kube-scheduler sends.

mod common;

use serde_json::json;
use torpor_gpu::extender::{
    Extender, ExtenderArgs, ExtenderBindingArgs, ExtenderFilterResult, HostPriority,
};
use torpor_gpu::planner::Policy;
use torpor_gpu::quota::QuotaBook;

fn extender() -> Extender {
    Extender::new(
        vec![common::h200(), common::l4()],
        Policy::default(),
        QuotaBook::unlimited(),
    )
}

fn mig_pod(uid: &str) -> serde_json::Value {
    json!({
        "metadata": {"name": "agent-1", "namespace": "agents", "uid": uid,
                     "annotations": {"torpor.dev/gpu-mode": "mig", "torpor.dev/gpu-profile": "3g.71gb"},
                     "labels": {"app": "agent"}},
        "spec": {"containers": [{"name": "agent", "image": "agent:1",
                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                 "schedulerName": "default-scheduler"},
        "status": {"phase": "Pending"}
    })
}

#[test]
fn filter_with_node_names_splits_nodes_by_fit() {
    let mut ext = extender();
    let args: ExtenderArgs = serde_json::from_value(json!({
        "Pod": mig_pod("u1"),
        "NodeNames": ["hgx-h200-01", "l4-01", "cpu-only-7"]
    }))
    .unwrap();
    let result = ext.filter(&args);
    assert_eq!(
        result.node_names.as_deref(),
        Some(&["hgx-h200-01".to_owned()][..])
    );
    assert!(
        result.failed_nodes["l4-01"].starts_with("no_mig_gpu"),
        "{:?}",
        result.failed_nodes
    );
    assert!(result
        .failed_and_unresolvable_nodes
        .contains_key("cpu-only-7"));
    assert_eq!(result.error, "");
    let wire = serde_json::to_value(&result).unwrap();
    for key in [
        "Nodes",
        "NodeNames",
        "FailedNodes",
        "FailedAndUnresolvableNodes",
        "Error",
    ] {
        assert!(wire.get(key).is_some(), "missing {key} in {wire}");
    }
    let back: ExtenderFilterResult = serde_json::from_value(wire).unwrap();
    assert_eq!(back, result);
}

#[test]
fn filter_with_node_list_returns_full_node_objects() {
    let mut ext = extender();
    let args: ExtenderArgs = serde_json::from_value(json!({
        "Pod": mig_pod("u2"),
        "Nodes": {"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": [
            {"metadata": {"name": "hgx-h200-01", "labels": {"zone": "a"}}, "status": {"capacity": {"nvidia.com/gpu": "8"}}},
            {"metadata": {"name": "l4-01"}}
        ]}
    }))
    .unwrap();
    let result = ext.filter(&args);
    let nodes = serde_json::to_value(result.nodes.unwrap()).unwrap();
    assert_eq!(nodes["kind"], "NodeList");
    assert_eq!(nodes["items"].as_array().unwrap().len(), 1);
    assert_eq!(
        nodes["items"][0]["metadata"]["labels"]["zone"], "a",
        "unknown fields survive"
    );
    assert_eq!(
        nodes["items"][0]["status"]["capacity"]["nvidia.com/gpu"],
        "8"
    );
}

#[test]
fn prioritize_and_bind_commit_shares() {
    let mut ext = extender();
    let args: ExtenderArgs = serde_json::from_value(json!({
        "Pod": mig_pod("u3"),
        "NodeNames": ["hgx-h200-01", "l4-01"]
    }))
    .unwrap();
    ext.filter(&args);
    let scores = ext.prioritize(&args);
    assert_eq!(
        serde_json::to_value(&scores).unwrap(),
        json!([{"Host": "hgx-h200-01", "Score": 0}, {"Host": "l4-01", "Score": 0}])
    );
    let bind: ExtenderBindingArgs = serde_json::from_value(json!({
        "PodName": "agent-1", "PodNamespace": "agents", "PodUID": "u3", "Node": "hgx-h200-01"
    }))
    .unwrap();
    assert_eq!(ext.bind(&bind).error, "");
    assert_eq!(ext.ledger("hgx-h200-01").unwrap().allocations().count(), 1);
    assert!(
        ext.bind(&bind).error.contains("not filtered"),
        "a pod binds once"
    );
    assert!(ext.release_pod("u3"));
    assert_eq!(ext.ledger("hgx-h200-01").unwrap().allocations().count(), 0);
    let unknown = ExtenderBindingArgs {
        pod_uid: "nope".into(),
        ..bind
    };
    assert!(!ext.bind(&unknown).error.is_empty());
}

#[test]
fn binpack_prefers_the_fuller_node() {
    let mut ext = Extender::new(
        vec![common::h200(), common::a100()],
        Policy::default(),
        QuotaBook::unlimited(),
    );
    let whole = |uid: &str| json!({"metadata": {"name": uid, "uid": uid}, "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "4"}}}]}});
    let args: ExtenderArgs =
        serde_json::from_value(json!({"Pod": whole("w1"), "NodeNames": ["pcie-a100-01"]})).unwrap();
    ext.filter(&args);
    let bind = ExtenderBindingArgs {
        pod_name: "w1".into(),
        pod_namespace: "d".into(),
        pod_uid: "w1".into(),
        node: "hgx-h200-01".into(),
    };
    assert_eq!(ext.bind(&bind).error, "");
    let probe: ExtenderArgs = serde_json::from_value(
        json!({"Pod": whole("w2"), "NodeNames": ["hgx-h200-01", "pcie-a100-01"]}),
    )
    .unwrap();
    let scores = ext.prioritize(&probe);
    assert_eq!(
        scores,
        vec![
            HostPriority {
                host: "hgx-h200-01".into(),
                score: 5
            },
            HostPriority {
                host: "pcie-a100-01".into(),
                score: 0
            },
        ]
    );
}

#[test]
fn missing_pod_is_an_error_not_a_panic() {
    let mut ext = extender();
    let args: ExtenderArgs = serde_json::from_value(json!({"NodeNames": ["l4-01"]})).unwrap();
    assert!(!ext.filter(&args).error.is_empty());
}

fn bind_args(namespace: &str, name: &str) -> ExtenderBindingArgs {
    ExtenderBindingArgs {
        pod_name: name.into(),
        pod_namespace: namespace.into(),
        pod_uid: "u-attack".into(),
        node: "hgx-h200-01".into(),
    }
}

#[test]
fn a_bind_with_a_pod_name_that_would_rewrite_the_api_url_is_refused_and_commits_nothing() {
    let mut ext = extender();
    let args: ExtenderArgs = serde_json::from_value(json!({
        "Pod": mig_pod("u-attack"),
        "NodeNames": ["hgx-h200-01"]
    }))
    .unwrap();
    ext.filter(&args);
    for (ns, name) in [
        ("agents", "x/binding"),
        ("agents", "x?dryRun=All"),
        ("agents", ".."),
        ("..", "x"),
        ("kube-system/pods/victim", "x"),
        ("agents", "x%2Fy"),
        ("agents", "Agent"),
        ("agents", ""),
        ("", "x"),
        ("agents", "x#frag"),
        ("agents", &"a".repeat(254)),
        (&"n".repeat(64), "x"),
    ] {
        let a = bind_args(ns, name);
        let e = a.validate().unwrap_err();
        assert_eq!(e.code(), "extender_bad_name");
        assert!(a.binding_path().is_err(), "{ns}/{name}");
        let r = ext.bind(&a);
        assert!(
            r.error.starts_with("extender_bad_name"),
            "{ns}/{name}: {r:?}"
        );
        assert_eq!(
            ext.ledger("hgx-h200-01").unwrap().allocations().count(),
            0,
            "nothing committed for {ns}/{name}"
        );
    }
    // The real names still bind, into a path with exactly the expected segments.
    let ok = bind_args("agents", "agent-1.v2");
    assert_eq!(
        ok.binding_path().unwrap(),
        "/api/v1/namespaces/agents/pods/agent-1.v2/binding"
    );
    assert_eq!(ext.bind(&ok).error, "");
}

#[test]
fn path_segments_are_percent_encoded() {
    use torpor_gpu::extender::encode_path_segment;
    assert_eq!(encode_path_segment("a/b?c#d e%"), "a%2Fb%3Fc%23d%20e%25");
    assert_eq!(encode_path_segment("agent-1.x_y~z"), "agent-1.x_y~z");
    assert_eq!(
        torpor_gpu::pod_watch::list_path("n&watch=1"),
        "/api/v1/pods?fieldSelector=spec.nodeName%3Dn%26watch%3D1"
    );
}
