//! The Kubernetes operator against a real `torpor up` (real templates booted on runsc, real
//! tenants, pools and tokens) and an in-memory Kubernetes API server (kube-rs' tower-test
//! pattern, `torpor_k8s::testing`): no API server runs on this machine, so the tests call the
//! reconcile functions the way the controller would after each change, and check both sides.

mod common;

use std::sync::Arc;

use common::Daemon;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use torpor_api::types::CreateSandboxBody;
use torpor_api::Client;
use torpor_k8s::crd::{SandboxTemplate, TenantQuota, WorkerPool, FINALIZER};
use torpor_k8s::reconcile::{reconcile_pool, reconcile_template, reconcile_tenant, Context};
use torpor_k8s::testing::{paths, FakeApiServer};

const NS: &str = "torpor";

struct Cluster {
    fake: FakeApiServer,
    ctx: Arc<Context>,
}

impl Cluster {
    fn new(d: &Daemon) -> Cluster {
        let (kube, fake) = FakeApiServer::start();
        Cluster {
            fake,
            ctx: Arc::new(Context::new(kube, &d.url(), &d.token(), NS)),
        }
    }

    fn obj<K: DeserializeOwned>(&self, path: &str) -> Option<Arc<K>> {
        self.fake
            .get(path)
            .map(|v| Arc::new(serde_json::from_value(v).unwrap()))
    }

    /// Runs the controller's reconcile for the object at `path` (if it still exists); an error
    /// is what the controller would log and retry.
    async fn template(&self, name: &str) -> Result<(), String> {
        match self.obj::<SandboxTemplate>(&paths::template(name)) {
            Some(o) => reconcile_template(o, self.ctx.clone())
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            None => Ok(()),
        }
    }

    async fn tenant(&self, name: &str) -> Result<(), String> {
        match self.obj::<TenantQuota>(&paths::tenant(name)) {
            Some(o) => reconcile_tenant(o, self.ctx.clone())
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            None => Ok(()),
        }
    }

    async fn pool(&self, name: &str) -> Result<(), String> {
        match self.obj::<WorkerPool>(&paths::pool(name)) {
            Some(o) => reconcile_pool(o, self.ctx.clone())
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            None => Ok(()),
        }
    }

    /// `[status, reason, message]` of the object's Ready condition.
    fn ready(&self, path: &str) -> [String; 3] {
        let obj = self.fake.get(path).unwrap();
        let c = obj["status"]["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
            .unwrap_or_else(|| panic!("no Ready condition: {obj}"))
            .clone();
        ["status", "reason", "message"].map(|k| c[k].as_str().unwrap().to_string())
    }

    fn token(&self, tenant: &str) -> Option<String> {
        let s = self
            .fake
            .get(&paths::secret(NS, &format!("torpor-tenant-{tenant}")))?;
        let b64 = s["data"]["token"].as_str().unwrap();
        use base64::Engine;
        Some(
            String::from_utf8(
                base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .unwrap(),
            )
            .unwrap(),
        )
    }
}

fn cr(kind: &str, name: &str, spec: Value) -> Value {
    json!({"apiVersion": "torpor.dev/v1alpha1", "kind": kind, "metadata": {"name": name}, "spec": spec})
}

#[tokio::test]
async fn a_tenant_quota_its_template_and_its_pool_are_made_changed_and_deleted_in_torpor() {
    let d = Daemon::start_with(&["--broker-allow", "127.0.0.1:6379"]).await;
    let admin = d.client();
    let k = Cluster::new(&d);

    // TenantQuota: the tenant is created with its quotas, its token kept in a Secret.
    k.fake.insert(
        &paths::tenant("team-a"),
        cr(
            "TenantQuota",
            "team-a",
            json!({"maxTemplates": 2, "maxPools": 1, "maxSandboxes": 5}),
        ),
    );
    k.tenant("team-a").await.unwrap();
    assert_eq!(
        k.fake.get(&paths::tenant("team-a")).unwrap()["metadata"]["finalizers"],
        json!([FINALIZER])
    );
    k.tenant("team-a").await.unwrap();
    assert_eq!(
        k.ready(&paths::tenant("team-a")),
        ["True", "Reconciled", "tenant team-a exists"]
    );
    let t = admin.tenants().await.unwrap();
    let t = t.iter().find(|t| t.name == "team-a").expect("tenant made");
    assert_eq!(t.quotas.max_templates, Some(2));
    assert_eq!(t.quotas.max_sandboxes, Some(5));
    let token = k.token("team-a").expect("token Secret written");
    let team_a = Client::new(&d.url(), &token);
    assert!(team_a.templates().await.is_ok(), "the kept token works");
    let secret = k
        .fake
        .get(&paths::secret(NS, "torpor-tenant-team-a"))
        .unwrap();
    assert_eq!(
        secret["metadata"]["ownerReferences"][0]["kind"],
        "TenantQuota"
    );

    // SandboxTemplate of that tenant: registered with the tenant's token.
    k.fake.insert(
        &paths::template("agent"),
        cr(
            "SandboxTemplate",
            "agent",
            json!({"tenant": "team-a", "source": {"kind": "host"}, "limits": {"memoryMib": 256},
                   "idle": {"parkAfterS": 600}}),
        ),
    );
    k.template("agent").await.unwrap();
    k.template("agent").await.unwrap();
    assert_eq!(k.ready(&paths::template("agent"))[0], "True");
    let st = &k.fake.get(&paths::template("agent")).unwrap()["status"];
    assert_eq!(st["managed"], true);
    assert_eq!(st["state"], "ready");
    let tpl = team_a.template("agent").await.unwrap();
    assert_eq!(tpl.tenant, "team-a");
    assert_eq!(tpl.limits.memory_mib, 256);
    assert_eq!(tpl.idle.park_after_s, Some(600.0));
    assert_eq!(tpl.idle.freeze_after_s, None, "left out: disabled");

    // WorkerPool of that tenant.
    k.fake.insert(
        &paths::pool("jobs"),
        cr(
            "WorkerPool",
            "jobs",
            json!({"tenant": "team-a", "template": "agent", "max": 2, "push": false,
                   "triggers": [{"type": "redis-list", "url": "redis://127.0.0.1:6379", "key": "jobs"}]}),
        ),
    );
    k.pool("jobs").await.unwrap();
    k.pool("jobs").await.unwrap();
    assert_eq!(k.ready(&paths::pool("jobs"))[0], "True");
    let p = team_a.pool("jobs").await.unwrap();
    assert_eq!(p.spec.max, 2);
    assert_eq!(p.tenant.as_str(), "team-a");
    assert_eq!(
        k.fake.get(&paths::pool("jobs")).unwrap()["status"]["desired"],
        0
    );

    // A second pool is over the tenant's max_pools: torpor's code on the condition.
    k.fake.insert(
        &paths::pool("more"),
        cr(
            "WorkerPool",
            "more",
            json!({"tenant": "team-a", "template": "agent", "max": 1,
                   "triggers": [{"type": "redis-list", "url": "redis://127.0.0.1:6379", "key": "more"}]}),
        ),
    );
    k.pool("more").await.unwrap();
    k.pool("more").await.unwrap();
    let [status, reason, _] = k.ready(&paths::pool("more"));
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "quota_exceeded")
    );
    assert_eq!(
        k.fake.get(&paths::pool("more")).unwrap()["status"]["managed"],
        false
    );

    // A changed template spec while a sandbox uses it: torpor refuses the replacement, the
    // condition says so, the old template stays.
    let sb = team_a
        .create_sandbox(&CreateSandboxBody {
            template: "agent".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    k.fake.set_spec(
        &paths::template("agent"),
        json!({"tenant": "team-a", "source": {"kind": "host"}, "limits": {"memoryMib": 384},
               "idle": {"parkAfterS": 600}}),
    );
    k.template("agent").await.unwrap();
    let [status, reason, message] = k.ready(&paths::template("agent"));
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "template_in_use")
    );
    assert!(message.starts_with("replacing template agent"), "{message}");
    assert_eq!(
        team_a.template("agent").await.unwrap().limits.memory_mib,
        256
    );
    // Once the sandbox is gone the replacement goes through.
    team_a.delete_sandbox(&sb.id).await.unwrap();
    k.template("agent").await.unwrap();
    assert_eq!(k.ready(&paths::template("agent"))[0], "True");
    assert_eq!(
        team_a.template("agent").await.unwrap().limits.memory_mib,
        384
    );
    assert_eq!(
        k.fake.get(&paths::template("agent")).unwrap()["status"]["observedGeneration"],
        2
    );

    // Deleting the TenantQuota while the tenant owns a template and a pool: torpor refuses,
    // the finalizer holds the object, the token stays.
    k.fake.delete(&paths::tenant("team-a"));
    assert!(k.tenant("team-a").await.is_err());
    let [status, reason, _] = k.ready(&paths::tenant("team-a"));
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "tenant_in_use")
    );
    assert!(k.fake.get(&paths::tenant("team-a")).is_some());
    assert!(k.token("team-a").is_some());

    // Pool and template deleted: gone from torpor, then their objects go.
    k.fake.delete(&paths::pool("more"));
    k.pool("more").await.unwrap();
    assert!(k.fake.get(&paths::pool("more")).is_none());
    k.fake.delete(&paths::pool("jobs"));
    k.pool("jobs").await.unwrap();
    assert!(k.fake.get(&paths::pool("jobs")).is_none());
    assert_eq!(
        team_a.pool("jobs").await.unwrap_err().code(),
        Some("not_found")
    );
    k.fake.delete(&paths::template("agent"));
    k.template("agent").await.unwrap();
    assert!(k.fake.get(&paths::template("agent")).is_none());
    assert_eq!(
        team_a.template("agent").await.unwrap_err().code(),
        Some("not_found")
    );

    // Now the tenant goes, and its token Secret with it.
    k.tenant("team-a").await.unwrap();
    assert!(k.fake.get(&paths::tenant("team-a")).is_none());
    assert!(k.token("team-a").is_none());
    assert!(admin
        .tenants()
        .await
        .unwrap()
        .iter()
        .all(|t| t.name != "team-a"));
    assert_eq!(
        team_a.templates().await.unwrap_err().code(),
        Some("unauthorized")
    );
}

#[tokio::test]
async fn an_object_leaves_alone_what_it_did_not_make_and_remakes_what_it_did() {
    let d = Daemon::start().await;
    let admin = d.client();
    let k = Cluster::new(&d);

    // The operator's own template made by hand, then claimed by an object with another spec.
    let mut spec = torpor_k8s::body::template_body(
        "mine",
        &serde_json::from_value(json!({"source": {"kind": "host"}})).unwrap(),
    )
    .unwrap();
    spec.limits.memory_mib = 300;
    admin.create_template(&spec).await.unwrap();
    k.fake.insert(
        &paths::template("mine"),
        cr(
            "SandboxTemplate",
            "mine",
            json!({"source": {"kind": "host"}}),
        ),
    );
    k.template("mine").await.unwrap();
    k.template("mine").await.unwrap();
    let [status, reason, _] = k.ready(&paths::template("mine"));
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "already_exists")
    );
    // Deleting the object does not delete what it did not make.
    k.fake.delete(&paths::template("mine"));
    k.template("mine").await.unwrap();
    assert!(k.fake.get(&paths::template("mine")).is_none());
    assert_eq!(admin.template("mine").await.unwrap().limits.memory_mib, 300);

    // A template it made, deleted in torpor behind its back, is registered again.
    k.fake.insert(
        &paths::template("again"),
        cr(
            "SandboxTemplate",
            "again",
            json!({"source": {"kind": "host"}}),
        ),
    );
    k.template("again").await.unwrap();
    k.template("again").await.unwrap();
    assert_eq!(k.ready(&paths::template("again"))[0], "True");
    admin.delete_template("again").await.unwrap();
    k.template("again").await.unwrap();
    assert_eq!(k.ready(&paths::template("again"))[0], "True");
    assert_eq!(admin.template("again").await.unwrap().status, "ready");

    // A tenant that exists without this object's knowledge is not adopted (its token is
    // unknown), and is not deleted with the object.
    let team_b = admin
        .create_tenant(&torpor_api::types::CreateTenantBody {
            name: "team-b".into(),
            quotas: None,
        })
        .await
        .unwrap();
    let team_b = Client::new(&d.url(), &team_b.token);
    k.fake.insert(
        &paths::tenant("team-b"),
        cr("TenantQuota", "team-b", json!({})),
    );
    k.tenant("team-b").await.unwrap();
    k.tenant("team-b").await.unwrap();
    assert_eq!(k.ready(&paths::tenant("team-b"))[1], "already_exists");
    assert!(k.token("team-b").is_none());
    k.fake.delete(&paths::tenant("team-b"));
    k.tenant("team-b").await.unwrap();
    assert!(admin
        .tenants()
        .await
        .unwrap()
        .iter()
        .any(|t| t.name == "team-b"));

    // The operator's template of a name a tenant also uses is the operator's own: made beside
    // the tenant's, and deleting it leaves the tenant's alone (torpor's admin lookup of a name
    // the admin lacks answers with the tenant's).
    let mut shared = spec.clone();
    shared.name = torpor_core::TemplateName::new("shared").unwrap();
    team_b.create_template(&shared).await.unwrap();
    k.fake.insert(
        &paths::template("shared"),
        cr(
            "SandboxTemplate",
            "shared",
            json!({"source": {"kind": "host"}}),
        ),
    );
    k.template("shared").await.unwrap();
    k.template("shared").await.unwrap();
    assert_eq!(k.ready(&paths::template("shared"))[0], "True");
    let owners = |all: Vec<torpor_api::types::Template>| {
        let mut o: Vec<String> = all
            .into_iter()
            .filter(|t| t.name == "shared")
            .map(|t| t.tenant)
            .collect();
        o.sort();
        o
    };
    assert_eq!(
        owners(admin.templates().await.unwrap()),
        ["admin", "team-b"]
    );
    k.fake.delete(&paths::template("shared"));
    k.template("shared").await.unwrap();
    assert_eq!(owners(admin.templates().await.unwrap()), ["team-b"]);
    // A cleanup that runs again once the operator's is gone must not reach the tenant's.
    k.fake.insert(
        &paths::template("shared"),
        cr(
            "SandboxTemplate",
            "shared",
            json!({"source": {"kind": "host"}}),
        ),
    );
    let mut obj = k.fake.get(&paths::template("shared")).unwrap();
    obj["metadata"]["finalizers"] = json!([FINALIZER]);
    obj["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:01Z");
    obj["status"] = json!({"managed": true});
    k.fake.insert(&paths::template("shared"), obj);
    k.template("shared").await.unwrap();
    assert!(k.fake.get(&paths::template("shared")).is_none());
    assert_eq!(owners(admin.templates().await.unwrap()), ["team-b"]);
}

#[test]
fn torpor_k8s_crds_prints_the_checked_in_crds() {
    let out = std::process::Command::new(common::BIN)
        .args(["k8s", "crds"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let checked_in = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/k8s/base/crds.yaml"
    ))
    .unwrap();
    assert!(
        String::from_utf8(out.stdout).unwrap() == checked_in,
        "deploy/k8s/base/crds.yaml is stale: torpor k8s crds > deploy/k8s/base/crds.yaml"
    );
}
