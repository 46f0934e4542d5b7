//! Attacks through pools and the GPU extender (docs/SECURITY.md): a tenant's broker URL makes the
//! daemon connect from the host network, so it is held to the operator's `--broker-allow`; what
//! a tenant sees of an unreachable broker is no port scanner; pool names are per tenant with no
//! existence oracle; the extender's routes need the scheduler's token and its names never
//! rewrite an API server URL. Real daemon, real Redis, real `torpor gpu extender`.

#[path = "../common/brokers.rs"]
mod brokers;

use std::process::Command;
use std::time::Duration;

use brokers::{free_port, wait_pool, Redis};
use serde_json::{json, Value};
use torpor_api::types::CreateTenantBody;
use torpor_api::{Client, ClientError};
use torpor_control::Quotas;

use crate::common::{gpu_fixture, Daemon, ExtenderProcess, BIN};

async fn tenant(d: &Daemon, name: &str, quotas: Option<Quotas>) -> Client {
    let t = d
        .client()
        .create_tenant(&CreateTenantBody {
            name: name.into(),
            quotas,
        })
        .await
        .unwrap();
    Client::new(&d.url(), &t.token)
}

fn api_err(e: ClientError) -> (u16, String, String, Option<Value>) {
    match e {
        ClientError::Api {
            status,
            code,
            message,
            details,
        } => (status, code, message, details),
        other => panic!("not an API error: {other}"),
    }
}

fn redis_pool(name: &str, url: &str, key: &str) -> Value {
    json!({
        "name": name, "template": "host", "max": 1, "poll_interval_ms": 200,
        "triggers": [{"type": "redis-list", "url": url, "key": key}],
    })
}

async fn llen(redis: &Redis, key: &str) -> i64 {
    let mut con = redis.conn().await;
    redis::cmd("LLEN")
        .arg(key)
        .query_async(&mut con)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_pool_cannot_point_the_daemon_at_a_broker_outside_the_allow_list() {
    // The operator's own Redis, with the operator's work in it.
    let redis = Redis::start();
    let mut con = redis.conn().await;
    let _: i64 = redis::cmd("LPUSH")
        .arg("operator-jobs")
        .arg("secret-1")
        .query_async(&mut con)
        .await
        .unwrap();
    let elsewhere = format!("--broker-allow=127.0.0.1:{}", free_port());
    let mut d = Daemon::start_with(&[&elsewhere]).await;
    let a = tenant(&d, "team-a", None).await;
    let b = tenant(&d, "team-b", None).await;

    let refused = [
        redis_pool("steal", &redis.url(), "operator-jobs"),
        // Another spelling of the listed host is not the listed host.
        redis_pool(
            "steal",
            &elsewhere.replace("--broker-allow=127.0.0.1", "redis://localhost"),
            "operator-jobs",
        ),
        // A RabbitMQ management URL would have the daemon GET any URL.
        json!({"name": "fetch", "template": "host", "max": 1,
               "triggers": [{"type": "rabbitmq", "url": elsewhere.replace("--broker-allow=", "amqp://"),
                             "management_url": "http://169.254.169.254/latest/meta-data/", "queue": "q"}]}),
    ];
    for (body, field) in refused.iter().zip([
        "triggers[0].url",
        "triggers[0].url",
        "triggers[0].management_url",
    ]) {
        let (status, code, message, _) = api_err(a.create_pool(body).await.unwrap_err());
        assert_eq!(
            (status, code.as_str()),
            (400, "invalid_request"),
            "{message}"
        );
        assert!(message.contains(&format!("{field}: broker")), "{message}");
        assert!(message.contains("--broker-allow"), "{message}");
    }
    assert!(a.pools().await.unwrap().is_empty(), "nothing was made");
    // The operator's own pools may name any broker.
    d.client()
        .create_pool(&redis_pool("ops", &redis.url(), "ops-jobs"))
        .await
        .unwrap();
    assert!(b.pools().await.unwrap().is_empty());

    // Once the operator lists it, the tenant's pool works.
    d.stop();
    let listed = format!("--broker-allow=127.0.0.1:{}", redis.port);
    d.extra_args = vec![listed];
    d.spawn().await;
    let _: i64 = redis::cmd("LPUSH")
        .arg("a-jobs")
        .arg("m-1")
        .query_async(&mut con)
        .await
        .unwrap();
    a.create_pool(&redis_pool("jobs", &redis.url(), "a-jobs"))
        .await
        .unwrap();
    wait_pool(&a, "jobs", "a reading", Duration::from_secs(20), |p| {
        p.depth == Some(1)
    })
    .await;
    a.delete_pool("jobs").await.unwrap();

    // A pool made while the broker was listed is not run after the list narrows.
    a.create_pool(&redis_pool("later", &redis.url(), "a-jobs"))
        .await
        .unwrap();
    d.stop();
    d.extra_args = vec![elsewhere.clone()];
    d.spawn().await;
    let p = a.pool("later").await.unwrap();
    assert!(
        p.last_error
            .as_deref()
            .unwrap_or("")
            .contains("--broker-allow"),
        "{p:?}"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let p = a.pool("later").await.unwrap();
    assert_eq!(
        (p.depth, p.triggers[0].error.as_ref()),
        (None, None),
        "never read: {p:?}"
    );
    a.delete_pool("later").await.unwrap();
    // Nothing of the operator's was taken, and the other tenant still works.
    assert_eq!(llen(&redis, "operator-jobs").await, 1);
    assert!(b.pools().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_cannot_port_scan_through_pool_status() {
    // Any port of 127.0.0.1 is allowed: a closed port and one that never answers (as a
    // filtered one) must read the same in the tenant's status.
    let d = Daemon::start_with(&["--broker-allow", "127.0.0.1"]).await;
    let a = tenant(&d, "team-a", None).await;
    let closed = free_port();
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    a.create_pool(&redis_pool(
        "closed",
        &format!("redis://127.0.0.1:{closed}"),
        "k",
    ))
    .await
    .unwrap();
    a.create_pool(&redis_pool(
        "silent",
        &format!("redis://127.0.0.1:{silent_port}"),
        "k",
    ))
    .await
    .unwrap();
    let errored = |p: &torpor_control::pools::PoolStatus| p.triggers[0].error.is_some();
    let pc = wait_pool(&a, "closed", "an error", Duration::from_secs(30), errored).await;
    let ps = wait_pool(&a, "silent", "an error", Duration::from_secs(30), errored).await;
    let (ec, es) = (
        pc.triggers[0].error.clone().unwrap(),
        ps.triggers[0].error.clone().unwrap(),
    );
    assert_eq!(ec, es, "the two causes read the same");
    assert_eq!(ec.code, "broker_unreachable");
    for port in [closed, silent_port] {
        assert!(!ec.message.contains(&port.to_string()), "{ec:?}");
    }
    // The details are the operator's, in the log.
    assert!(
        d.log().contains(&closed.to_string()),
        "the log has the details"
    );
    // The operator's own pool shows the cause.
    d.client()
        .create_pool(&redis_pool(
            "ops-closed",
            &format!("redis://127.0.0.1:{closed}"),
            "k",
        ))
        .await
        .unwrap();
    let po = wait_pool(
        &d.client(),
        "ops-closed",
        "an error",
        Duration::from_secs(30),
        errored,
    )
    .await;
    assert_eq!(po.triggers[0].error.as_ref().unwrap().code, "broker_error");
    drop(silent);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_cannot_see_or_delete_another_tenants_pool_or_exceed_max_pools() {
    let redis = Redis::start();
    let keda_port = free_port();
    let d = Daemon::start_with(&[
        "--broker-allow",
        &format!("127.0.0.1:{}", redis.port),
        "--keda-listen",
        &format!("127.0.0.1:{keda_port}"),
    ])
    .await;
    let a = tenant(&d, "team-a", None).await;
    let b = tenant(
        &d,
        "team-b",
        Some(Quotas {
            max_pools: Some(2),
            ..Quotas::default()
        }),
    )
    .await;
    // Both may have a pool "jobs".
    let pa = a
        .create_pool(&redis_pool("jobs", &redis.url(), "a"))
        .await
        .unwrap();
    let pb = b
        .create_pool(&redis_pool("jobs", &redis.url(), "b"))
        .await
        .unwrap();
    assert_eq!(
        (pa.tenant.as_str(), pb.tenant.as_str()),
        ("team-a", "team-b")
    );
    b.create_pool(&redis_pool("b-only", &redis.url(), "b"))
        .await
        .unwrap();

    // "Not yours" and "no such pool" answer alike, whichever way it is asked.
    let (ghost_status, ghost_code, ghost_msg, _) = api_err(a.pool("ghost").await.unwrap_err());
    assert_eq!((ghost_status, ghost_code.as_str()), (404, "not_found"));
    for probe in ["b-only", "b-only?tenant=team-b", "jobs?tenant=team-b"] {
        let (status, code, message, _) = api_err(a.pool(probe).await.unwrap_err());
        let name = probe.split('?').next().unwrap();
        assert_eq!((status, code.as_str()), (404, "not_found"), "{probe}");
        assert_eq!(message, ghost_msg.replace("ghost", name), "{probe}");
        let (status, code, ..) = api_err(a.delete_pool(probe).await.unwrap_err());
        assert_eq!((status, code.as_str()), (404, "not_found"), "{probe}");
    }
    // Lists: one's own; the admin sees every tenant's and addresses one with ?tenant=.
    let names = |v: Vec<torpor_control::pools::PoolStatus>| {
        let mut v: Vec<_> = v
            .into_iter()
            .map(|p| format!("{}/{}", p.tenant, p.name))
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(a.pools().await.unwrap()), ["team-a/jobs"]);
    assert_eq!(
        names(b.pools().await.unwrap()),
        ["team-b/b-only", "team-b/jobs"]
    );
    let admin = d.client();
    assert_eq!(admin.pools().await.unwrap().len(), 3);
    assert_eq!(
        admin
            .pool("jobs?tenant=team-b")
            .await
            .unwrap()
            .tenant
            .as_str(),
        "team-b"
    );
    // KEDA (the operator's listener) names the tenant; without it, the operator's pool.
    {
        use torpor_triggers::externalscaler::external_scaler_client::ExternalScalerClient;
        use torpor_triggers::externalscaler::ScaledObjectRef;
        let mut g = ExternalScalerClient::connect(format!("http://127.0.0.1:{keda_port}"))
            .await
            .unwrap();
        let obj = |meta: &[(&str, &str)]| ScaledObjectRef {
            name: "workers".into(),
            namespace: "default".into(),
            scaler_metadata: meta
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        let spec = g
            .get_metric_spec(obj(&[("pool", "b-only"), ("tenant", "team-b")]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(spec.metric_specs[0].metric_name, "b-only");
        for meta in [
            &[("pool", "b-only")][..],
            &[("pool", "b-only"), ("tenant", "team-a")],
        ] {
            let e = g.get_metric_spec(obj(meta)).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::NotFound, "{meta:?}");
        }
    }
    // A's delete of its "jobs" leaves B's.
    a.delete_pool("jobs").await.unwrap();
    assert_eq!(b.pool("jobs").await.unwrap().tenant.as_str(), "team-b");

    // max_pools: 2, and B has 2.
    let (status, code, message, details) = api_err(
        b.create_pool(&redis_pool("third", &redis.url(), "b"))
            .await
            .unwrap_err(),
    );
    assert_eq!(
        (status, code.as_str()),
        (429, "quota_exceeded"),
        "{message}"
    );
    assert_eq!(
        details,
        Some(json!({"quota": "pools", "limit": 2, "used": 2}))
    );
    b.delete_pool("b-only").await.unwrap();
    b.create_pool(&redis_pool("third", &redis.url(), "b"))
        .await
        .unwrap();
}

fn whole_gpu_pod(uid: &str) -> Value {
    json!({
        "metadata": {"name": uid, "namespace": "ns1", "uid": uid},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
    })
}

const TOKEN: &str = "scheduler-token-0123456789";

#[tokio::test]
async fn an_unauthenticated_caller_cannot_bind_pods_through_the_gpu_extender() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let ext = ExtenderProcess::start_with(
        &[gpu_fixture("l4-2.toml")],
        &["--extender-token-file", token_file.to_str().unwrap()],
    );
    let http = reqwest::Client::new();
    let filter = json!({"Pod": whole_gpu_pod("p1"), "NodeNames": ["l4-01"]});
    let bind = json!({"PodName": "p1", "PodNamespace": "ns1", "PodUID": "p1", "Node": "l4-01"});
    // No header, a wrong token, the right token without the `Bearer` scheme.
    for auth in [None, Some("Bearer wrong-token-0123456789"), Some(TOKEN)] {
        for (path, body) in [("/filter", &filter), ("/bind", &bind), ("/nope", &bind)] {
            let mut req = http.post(format!("{}{path}", ext.url)).json(body);
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), 401, "{path} with {auth:?}");
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["code"], "unauthorized");
        }
    }
    // Nothing was committed: the scheduler's own calls find both GPUs free.
    let call = |path: &str, body: &Value| {
        http.post(format!("{}{path}", ext.url))
            .bearer_auth(TOKEN)
            .json(body)
            .send()
    };
    let v: Value = call("/filter", &filter)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["NodeNames"], json!(["l4-01"]));
    let v: Value = call("/bind", &bind).await.unwrap().json().await.unwrap();
    assert_eq!(v, json!({"Error": ""}));
    // No silent open door: without a token file the operator must say --no-auth.
    let out = Command::new(BIN)
        .args(["gpu", "extender", "--listen", "127.0.0.1:0", "--inventory"])
        .arg(gpu_fixture("l4-2.toml"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("error[extender_auth_missing]"));
}

#[tokio::test]
async fn a_crafted_pod_name_in_a_bind_cannot_reach_another_api_server_path() {
    use axum::extract::{Request, State};
    type Seen = std::sync::Arc<std::sync::Mutex<Vec<String>>>;
    // A stand-in API server that records every request it gets, whatever the path.
    async fn record(State(seen): State<Seen>, req: Request) -> axum::http::StatusCode {
        seen.lock()
            .unwrap()
            .push(format!("{} {}", req.method(), req.uri()));
        axum::http::StatusCode::CREATED
    }
    let seen: Seen = Default::default();
    let app = axum::Router::new()
        .fallback(record)
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let ext = ExtenderProcess::start_with(&[gpu_fixture("l4-2.toml")], &["--kube-api", &api]);
    let http = reqwest::Client::new();
    let post = |path: &str, body: Value| http.post(format!("{}{path}", ext.url)).json(&body).send();
    post(
        "/filter",
        json!({"Pod": whole_gpu_pod("p1"), "NodeNames": ["l4-01"]}),
    )
    .await
    .unwrap();
    for (ns, name) in [
        ("ns1", "p1/binding"),
        ("ns1", "x?dryRun=All"),
        ("ns1", ".."),
        ("..", "p1"),
        ("kube-system/secrets/x", "p1"),
        ("ns1", "p1%2F..%2F..%2Fsecrets"),
        ("ns1", "p1#"),
    ] {
        let r = post(
            "/bind",
            json!({"PodName": name, "PodNamespace": ns, "PodUID": "p1", "Node": "l4-01"}),
        )
        .await
        .unwrap();
        assert_eq!(r.status(), 400, "{ns}/{name}");
        let v: Value = r.json().await.unwrap();
        assert!(
            v["Error"]
                .as_str()
                .unwrap()
                .starts_with("extender_bad_name"),
            "{v}"
        );
    }
    // The API server saw none of them (the pod watch only lists and watches pods).
    let binds = || -> Vec<String> {
        seen.lock()
            .unwrap()
            .iter()
            .filter(|r| !r.starts_with("GET /api/v1/pods?"))
            .cloned()
            .collect()
    };
    assert_eq!(binds(), Vec::<String>::new());
    // The real pod binds, at exactly its own path.
    let v: Value = post(
        "/bind",
        json!({"PodName": "p1", "PodNamespace": "ns1", "PodUID": "p1", "Node": "l4-01"}),
    )
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    assert_eq!(v, json!({"Error": ""}));
    assert_eq!(
        binds(),
        vec!["POST /api/v1/namespaces/ns1/pods/p1/binding".to_string()]
    );
}
