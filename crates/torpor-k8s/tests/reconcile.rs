//! The reconcile functions against the in-memory Kubernetes API server (`testing`, kube-rs'
//! tower-test pattern), for what needs no torpor: the finalizer, specs refused before any call,
//! torpor unreachable, a tenant without a token; and the checked-in CRDs being the generated
//! ones. What torpor answers is tested against the real daemon in crates/torpor/tests/k8s.rs.

use std::sync::Arc;

use kube::runtime::controller::Action;
use serde_json::{json, Value};
use torpor_k8s::crd::{SandboxTemplate, TenantQuota, WorkerPool, FINALIZER};
use torpor_k8s::reconcile::{reconcile_pool, reconcile_template, reconcile_tenant, Context};
use torpor_k8s::testing::{paths, FakeApiServer};

/// A torpor URL nothing listens on: any call to it fails to connect.
fn closed_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    format!("http://127.0.0.1:{port}")
}

fn setup() -> (FakeApiServer, Arc<Context>) {
    let (kube, fake) = FakeApiServer::start();
    let ctx = Arc::new(Context::new(kube, &closed_url(), "admin-token", "torpor"));
    (fake, ctx)
}

fn template(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "torpor.dev/v1alpha1", "kind": "SandboxTemplate",
           "metadata": {"name": name}, "spec": spec})
}

fn ready(obj: &Value) -> (String, String, String) {
    let c = obj["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
        .unwrap_or_else(|| panic!("no Ready condition in {obj}"));
    (
        c["status"].as_str().unwrap().to_string(),
        c["reason"].as_str().unwrap().to_string(),
        c["message"].as_str().unwrap().to_string(),
    )
}

async fn reconcile_t(fake: &FakeApiServer, ctx: &Arc<Context>, name: &str) -> Action {
    let obj: SandboxTemplate =
        serde_json::from_value(fake.get(&paths::template(name)).unwrap()).unwrap();
    reconcile_template(Arc::new(obj), ctx.clone())
        .await
        .unwrap()
}

#[tokio::test]
async fn the_first_reconcile_adds_the_finalizer_and_nothing_else() {
    let (fake, ctx) = setup();
    fake.insert(
        &paths::template("py"),
        template("py", json!({"source": {"kind": "host"}})),
    );
    reconcile_t(&fake, &ctx, "py").await;
    let obj = fake.get(&paths::template("py")).unwrap();
    assert_eq!(obj["metadata"]["finalizers"], json!([FINALIZER]));
    assert!(obj.get("status").is_none(), "{obj}");
    assert_eq!(
        fake.requests(),
        vec!["PATCH /apis/torpor.dev/v1alpha1/sandboxtemplates/py"]
    );
}

#[tokio::test]
async fn a_spec_torpor_would_refuse_is_reported_without_calling_torpor() {
    let (fake, ctx) = setup();
    fake.insert(
        &paths::template("py"),
        template(
            "py",
            json!({"source": {"kind": "rootfs"}, "limits": {"cpus": 0.5}}),
        ),
    );
    reconcile_t(&fake, &ctx, "py").await;
    let action = reconcile_t(&fake, &ctx, "py").await;
    let obj = fake.get(&paths::template("py")).unwrap();
    let (status, reason, message) = ready(&obj);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "invalid_spec")
    );
    assert_eq!(message, "spec.source.path: is required for this kind");
    assert_eq!(obj["status"]["observedGeneration"], 1);
    // Not retried on a timer: only a change of the object helps.
    assert_eq!(action, Action::await_change());
    // torpor (a closed port) was never needed: the condition is not torpor_unreachable.
}

#[tokio::test]
async fn torpor_unreachable_is_a_condition_and_a_retry_not_a_crash() {
    let (fake, ctx) = setup();
    fake.insert(
        &paths::template("py"),
        template("py", json!({"source": {"kind": "host"}})),
    );
    reconcile_t(&fake, &ctx, "py").await;
    let action = reconcile_t(&fake, &ctx, "py").await;
    let obj = fake.get(&paths::template("py")).unwrap();
    let (status, reason, message) = ready(&obj);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "torpor_unreachable")
    );
    assert!(
        message.starts_with("reading template py: cannot reach torpor at http://127.0.0.1:"),
        "{message}"
    );
    assert_eq!(action, Action::requeue(std::time::Duration::from_secs(15)));
    assert_eq!(obj["status"]["managed"], false);
}

#[tokio::test]
async fn a_tenant_object_without_the_tenants_token_waits_for_its_tenant_quota() {
    let (fake, ctx) = setup();
    fake.insert(
        &paths::pool("jobs"),
        json!({"apiVersion": "torpor.dev/v1alpha1", "kind": "WorkerPool", "metadata": {"name": "jobs"},
               "spec": {"tenant": "team-a", "template": "agent", "max": 2,
                        "triggers": [{"type": "redis-list", "url": "redis://redis:6379", "key": "jobs"}]}}),
    );
    for _ in 0..2 {
        let obj: WorkerPool =
            serde_json::from_value(fake.get(&paths::pool("jobs")).unwrap()).unwrap();
        reconcile_pool(Arc::new(obj), ctx.clone()).await.unwrap();
    }
    let (status, reason, message) = ready(&fake.get(&paths::pool("jobs")).unwrap());
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "tenant_token_missing")
    );
    assert!(message.contains("torpor/torpor-tenant-team-a"), "{message}");
    // It looked for the Secret in the operator's namespace.
    assert!(fake
        .requests()
        .contains(&"GET /api/v1/namespaces/torpor/secrets/torpor-tenant-team-a".to_string()));
}

#[tokio::test]
async fn deleting_an_object_that_made_nothing_in_torpor_only_drops_the_finalizer() {
    let (fake, ctx) = setup();
    fake.insert(
        &paths::tenant("team-a"),
        json!({"apiVersion": "torpor.dev/v1alpha1", "kind": "TenantQuota", "metadata": {"name": "team-a"},
               "spec": {"maxSandboxes": 10}}),
    );
    let obj: TenantQuota =
        serde_json::from_value(fake.get(&paths::tenant("team-a")).unwrap()).unwrap();
    reconcile_tenant(Arc::new(obj), ctx.clone()).await.unwrap();
    fake.delete(&paths::tenant("team-a"));
    let obj = fake
        .get(&paths::tenant("team-a"))
        .expect("held by the finalizer");
    assert!(obj["metadata"]["deletionTimestamp"].is_string());
    let obj: TenantQuota = serde_json::from_value(obj).unwrap();
    reconcile_tenant(Arc::new(obj), ctx.clone()).await.unwrap();
    assert!(fake.get(&paths::tenant("team-a")).is_none());
}

#[test]
fn the_checked_in_crds_are_the_generated_ones() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/k8s/base/crds.yaml"
    );
    let checked_in = std::fs::read_to_string(path).unwrap_or_default();
    let generated = torpor_k8s::crd::crds_yaml().unwrap();
    assert!(
        checked_in == generated,
        "deploy/k8s/base/crds.yaml is not what `torpor k8s crds` prints: run\n  cargo run -p torpor -- k8s crds > deploy/k8s/base/crds.yaml"
    );
}

#[test]
fn the_crds_are_cluster_scoped_with_a_status_subresource() {
    let crds = torpor_k8s::crd::crds();
    let names: Vec<_> = crds
        .iter()
        .map(|c| c.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "sandboxtemplates.torpor.dev",
            "tenantquotas.torpor.dev",
            "workerpools.torpor.dev"
        ]
    );
    for c in &crds {
        assert_eq!(c.spec.scope, "Cluster");
        let v = &c.spec.versions[0];
        assert_eq!(v.name, "v1alpha1");
        assert!(v.subresources.as_ref().unwrap().status.is_some());
    }
}
