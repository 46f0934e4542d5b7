//! `torpor gpu …` through the real binary on the declared fixtures: plan output against
//! expected placements, refusal reasons, bad input (codes, exit codes, line and column), and
//! the scheduler extender over real HTTP with a real client.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_torpor");

mod common;
use common::{gpu_fixture as fixture, ExtenderProcess};

fn local(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/gpu")
        .join(name)
}

fn torpor(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("TORPOR_URL")
        .output()
        .expect("run torpor")
}

fn json_lines(out: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}")))
        .collect()
}

fn write_temp(dir: &tempfile::TempDir, name: &str, text: &str) -> String {
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

fn plan(inventory: &str, requests: &str, extra: &[&str]) -> (Output, Vec<Value>) {
    let dir = tempfile::tempdir().unwrap();
    let req = write_temp(&dir, "requests.jsonl", requests);
    let mut args = vec![
        "gpu",
        "plan",
        "--inventory",
        inventory,
        "--requests",
        &req,
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = torpor(&args);
    let lines = json_lines(&out);
    (out, lines)
}

/// MIG geometry of the fixtures' MIG-GEOMETRY.md, restated here so the test checks the
/// binary against the table and not against itself: (size in memory slices, allowed starts).
fn mig_table(profile: &str) -> (u8, Vec<u8>) {
    let prefix = profile.split('.').next().unwrap();
    let one_g_big = matches!(profile, "1g.35gb" | "1g.20gb" | "1g.10gb");
    match prefix {
        "1g" if one_g_big => (2, vec![0, 2, 4, 6]),
        "1g" => (1, vec![0, 1, 2, 3, 4, 5, 6]),
        "2g" => (2, vec![0, 2, 4]),
        "3g" => (4, vec![0, 4]),
        "4g" => (4, vec![0]),
        "7g" => (8, vec![0]),
        other => panic!("profile {other} not in the table"),
    }
}

/// No two MIG instances on a GPU overlap, each starts where the table allows, and no GPU mixes
/// modes.
fn check_valid(lines: &[Value]) {
    let mut slices: BTreeMap<u64, u8> = BTreeMap::new();
    let mut modes: BTreeMap<u64, String> = BTreeMap::new();
    for line in lines.iter().filter(|l| l["placed"] == true) {
        for d in line["devices"].as_array().unwrap() {
            let gpu = d["gpu_index"].as_u64().unwrap();
            let mode = d["mode"].as_str().unwrap().to_owned();
            let previous = modes.entry(gpu).or_insert_with(|| mode.clone());
            assert_eq!(*previous, mode, "GPU {gpu} in two modes: {line}");
            if mode == "mig" {
                let (size, starts) = mig_table(d["profile"].as_str().unwrap());
                let start = d["start"].as_u64().unwrap() as u8;
                assert!(starts.contains(&start), "start not allowed: {d}");
                let mask = (((1u16 << size) - 1) << start) as u8;
                let used = slices.entry(gpu).or_default();
                assert_eq!(*used & mask, 0, "overlap on GPU {gpu}: {d}");
                *used |= mask;
            }
        }
    }
}

#[test]
fn plan_matches_expected_placements_on_h200() {
    let inv = fixture("hgx-h200-8.toml");
    let requests = std::fs::read_to_string(local("h200-mixed.jsonl")).unwrap();
    let (out, lines) = plan(inv.to_str().unwrap(), &requests, &[]);
    assert!(out.status.success(), "{out:?}");
    let expected: Vec<Value> = std::fs::read_to_string(local("h200-mixed.expected.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines, expected);
    check_valid(&lines);
    // Hand-checked against the MIG table: 3g goes high (slice 4) to keep 4g@0 possible, which
    // the next request then takes: GPU 0 is full with 4g@0 + 3g@4.
    assert_eq!(
        lines[0]["devices"][0],
        json!({"gpu_index": 0, "gpu_uuid": "GPU-3b9e1a70-0c1d-4a52-9b11-5e0a8f6c0000",
               "mode": "mig", "profile": "3g.71gb", "start": 4})
    );
    assert_eq!(lines[1]["devices"][0]["start"], 0);
    assert_eq!(lines[1]["devices"][0]["gpu_index"], 0);
    // Binpack: the two 50% MPS shares share one GPU.
    assert_eq!(
        lines[6]["devices"][0]["gpu_index"],
        lines[7]["devices"][0]["gpu_index"]
    );
    // The NVLink pair lands on two different GPUs.
    let pair = lines[10]["devices"].as_array().unwrap();
    assert_eq!(pair.len(), 2);
    assert_ne!(pair[0]["gpu_index"], pair[1]["gpu_index"]);
    // Every line numbers its request, in order.
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["request"], i);
    }
    // The last requests cannot fit: every GPU is taken.
    assert_eq!(lines[12]["placed"], false);
    assert_eq!(lines[12]["reason"]["code"], "no_capacity");
    assert!(lines[12].get("devices").is_none());
}

#[test]
fn spread_and_binpack_differ() {
    let inv = fixture("l4-2.toml");
    let two = "{\"mode\":\"mps\",\"compute_pct\":20,\"memory_mib\":4000}\n".repeat(2);
    let (_, packed) = plan(inv.to_str().unwrap(), &two, &["--policy", "binpack"]);
    let (_, spread) = plan(inv.to_str().unwrap(), &two, &["--policy", "spread"]);
    assert_eq!(
        packed[0]["devices"][0]["gpu_index"],
        packed[1]["devices"][0]["gpu_index"]
    );
    assert_ne!(
        spread[0]["devices"][0]["gpu_index"],
        spread[1]["devices"][0]["gpu_index"]
    );
    let out = torpor(&[
        "gpu",
        "plan",
        "--inventory",
        inv.to_str().unwrap(),
        "--requests",
        "/dev/null",
        "--policy",
        "densest",
    ]);
    assert_eq!(out.status.code(), Some(2), "clap usage error");
}

#[test]
fn refusal_reasons_have_stable_codes() {
    let l4 = fixture("l4-2.toml");
    let a100 = fixture("pcie-a100-4.toml");
    let requests = [
        r#"{"mode": "mig", "profile": "1g.10gb"}"#,
        r#"{"mode": "mps", "compute_pct": 10, "memory_mib": 900000}"#,
        r#"{"count": 3, "mode": "whole"}"#,
        r#"{"mode": "mps", "compute_pct": 0}"#,
        r#"{"mode": "whole", "colour": "red"}"#,
        r#"{"mode": "timeslice"}"#,
    ]
    .join("\n");
    let (out, lines) = plan(l4.to_str().unwrap(), &requests, &[]);
    assert!(out.status.success());
    let codes: Vec<&str> = lines
        .iter()
        .map(|l| l["reason"]["code"].as_str().unwrap_or("placed"))
        .collect();
    assert_eq!(
        codes,
        [
            "no_mig_gpu",
            "larger_than_any_gpu",
            "not_enough_gpus",
            "request_compute_pct_out_of_range",
            "request_malformed",
            "placed"
        ],
        "{lines:#?}"
    );
    for line in &lines[..5] {
        assert!(!line["reason"]["message"].as_str().unwrap().is_empty());
    }
    // A profile the A100's geometry does not have.
    let (_, lines) = plan(
        a100.to_str().unwrap(),
        r#"{"mode": "mig", "profile": "3g.71gb"}"#,
        &[],
    );
    assert_eq!(lines[0]["reason"]["code"], "unknown_profile");
    assert!(lines[0]["reason"]["message"]
        .as_str()
        .unwrap()
        .contains("A100-80GB"));
}

#[test]
fn malformed_inventory_gives_line_column_code_and_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write_temp(
        &dir,
        "bad.toml",
        "node = \"x\"\n\n[[gpu]]\nindex = 0\nuuid = \"GPU-1\"\nmemory_mib = \"lots\"\n",
    );
    let req = write_temp(&dir, "r.jsonl", "{\"mode\":\"whole\"}\n");
    let out = torpor(&[
        "gpu",
        "plan",
        "--inventory",
        &bad,
        "--requests",
        &req,
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(3));
    assert!(out.stdout.is_empty());
    let err: Value = serde_json::from_slice(&out.stderr).expect("one JSON error line");
    assert_eq!(err["error"]["code"], "inventory_parse");
    let message = err["error"]["message"].as_str().unwrap();
    assert!(message.contains("bad.toml:6:14"), "{message}");

    let out = torpor(&["gpu", "ls", "--inventory", &bad]);
    assert_eq!(out.status.code(), Some(3));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(text.starts_with("error[inventory_parse]: "), "{text}");
    assert!(!text.contains("panicked"));

    // A topology matrix for 3 GPUs on a 2-GPU node.
    let l4 = std::fs::read_to_string(fixture("l4-2.toml")).unwrap();
    let start = l4.find("topology").unwrap();
    let wrong = format!(
        "{}topology = \"\"\"\n      GPU0 GPU1 GPU2\nGPU0  X  PHB PHB\nGPU1 PHB  X  PHB\nGPU2 PHB PHB  X\n\"\"\"\n",
        &l4[..start]
    );
    let wrong = write_temp(&dir, "wrong.toml", &wrong);
    let out = torpor(&["gpu", "ls", "--inventory", &wrong, "--json"]);
    assert_eq!(out.status.code(), Some(3));
    let err: Value = serde_json::from_slice(&out.stderr).unwrap();
    assert_eq!(err["error"]["code"], "inventory_topology_size");

    let out = torpor(&["gpu", "ls", "--inventory", "/nonexistent/inv.toml"]);
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("error[inventory_read]"));

    let out = torpor(&[
        "gpu",
        "plan",
        "--inventory",
        fixture("l4-2.toml").to_str().unwrap(),
        "--requests",
        "/nonexistent/r.jsonl",
    ]);
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("error[requests_read]"));
}

#[test]
fn ls_prints_table_and_json() {
    let inv = fixture("hgx-h200-8.toml");
    let out = torpor(&["gpu", "ls", "--inventory", inv.to_str().unwrap()]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("hgx-h200-01"));
    assert_eq!(
        text.lines().filter(|l| l.contains("NVIDIA H200")).count(),
        8
    );
    assert!(text.lines().nth(1).unwrap().starts_with("GPU"));
    let out = torpor(&["gpu", "ls", "--inventory", inv.to_str().unwrap(), "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["node"], "hgx-h200-01");
    assert_eq!(v["gpus"].as_array().unwrap().len(), 8);
    assert_eq!(v["gpus"][7]["mig"], "H200-141GB");
    assert_eq!(v["gpus"][7]["free"]["whole_gpus"], 1);
}

#[test]
fn ls_without_inventory_or_driver_says_so() {
    let has_driver = [
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "/usr/lib64/libnvidia-ml.so.1",
    ]
    .iter()
    .any(|p| std::path::Path::new(p).exists());
    if has_driver {
        eprintln!("an NVIDIA driver is installed: the NVML path is tested by the ignored test");
        return;
    }
    let out = torpor(&["gpu", "ls", "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let err: Value = serde_json::from_slice(&out.stderr).unwrap();
    assert_eq!(err["error"]["code"], "gpu_no_inventory");
}

fn pod(uid: &str, annotations: Value, gpus: u32) -> Value {
    json!({
        "metadata": {"name": uid, "namespace": "default", "uid": uid, "annotations": annotations},
        "spec": {"containers": [{"name": "agent", "image": "cuda",
            "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}}]}
    })
}

#[tokio::test]
async fn extender_filters_prioritizes_and_binds_over_http() {
    let ext = ExtenderProcess::start(&[fixture("hgx-h200-8.toml"), fixture("l4-2.toml")]);
    let http = reqwest::Client::new();
    let post = |path: &str, body: Value| {
        let req = http.post(format!("{}{path}", ext.url)).json(&body);
        async move { req.send().await.unwrap() }
    };

    // A MIG 7g pod: the L4 node cannot (no MIG), the unknown node is unresolvable.
    let mig = pod(
        "uid-1",
        json!({"torpor.dev/gpu-mode": "mig", "torpor.dev/gpu-profile": "7g.141gb"}),
        1,
    );
    let names = json!(["hgx-h200-01", "l4-01", "no-such-node"]);
    let r = post("/filter", json!({"Pod": mig, "NodeNames": names})).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["NodeNames"], json!(["hgx-h200-01"]));
    assert!(v["FailedNodes"]["l4-01"]
        .as_str()
        .unwrap()
        .starts_with("no_mig_gpu"));
    assert!(v["FailedAndUnresolvableNodes"]["no-such-node"]
        .as_str()
        .unwrap()
        .contains("no torpor GPU inventory"));
    assert_eq!(v["Error"], "");

    // The same with whole Node objects instead of names: the Nodes come back filtered.
    let nodes = json!({"items": [
        {"metadata": {"name": "hgx-h200-01", "labels": {"a": "b"}}},
        {"metadata": {"name": "l4-01"}}
    ]});
    let v: Value = post("/filter", json!({"Pod": mig, "Nodes": nodes}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["Nodes"]["items"].as_array().unwrap().len(), 1);
    assert_eq!(v["Nodes"]["items"][0]["metadata"]["labels"]["a"], "b");

    let v: Value = post("/prioritize", json!({"Pod": mig, "NodeNames": names}))
        .await
        .json()
        .await
        .unwrap();
    let scores = v.as_array().unwrap();
    assert_eq!(scores.len(), 3);
    for s in scores {
        let score = s["Score"].as_i64().unwrap();
        assert!((0..=10).contains(&score), "{s}");
        assert!(s["Host"].is_string());
    }
    assert_eq!(scores[1], json!({"Host": "l4-01", "Score": 0}));

    // Bind commits the shares: eight 7g pods fill the node, the ninth is filtered out.
    for i in 1..=8 {
        let uid = format!("uid-{i}");
        let p = pod(
            &uid,
            json!({"torpor.dev/gpu-mode": "mig", "torpor.dev/gpu-profile": "7g.141gb"}),
            1,
        );
        let v: Value = post("/filter", json!({"Pod": p, "NodeNames": ["hgx-h200-01"]}))
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(v["NodeNames"], json!(["hgx-h200-01"]), "pod {i}: {v}");
        let v: Value = post(
            "/bind",
            json!({"PodName": uid, "PodNamespace": "default", "PodUID": uid, "Node": "hgx-h200-01"}),
        )
        .await
        .json()
        .await
        .unwrap();
        assert_eq!(v, json!({"Error": ""}), "pod {i}");
    }
    let ninth = pod(
        "uid-9",
        json!({"torpor.dev/gpu-mode": "mig", "torpor.dev/gpu-profile": "7g.141gb"}),
        1,
    );
    let v: Value = post(
        "/filter",
        json!({"Pod": ninth, "NodeNames": ["hgx-h200-01"]}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(v["NodeNames"], json!([]));
    assert!(v["FailedNodes"]["hgx-h200-01"]
        .as_str()
        .unwrap()
        .starts_with("no_capacity"));

    // Binding a pod twice, to an unknown node, or one never filtered is an error in the body.
    let v: Value = post(
        "/bind",
        json!({"PodName": "uid-1", "PodNamespace": "default", "PodUID": "uid-1", "Node": "hgx-h200-01"}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert!(!v["Error"].as_str().unwrap().is_empty());
    let v: Value = post(
        "/bind",
        json!({"PodName": "x", "PodNamespace": "default", "PodUID": "never", "Node": "no-such-node"}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert!(v["Error"].as_str().unwrap().contains("not filtered"));

    // An MPS pod still fits the L4 node: fractional modes come from annotations only.
    let mps = pod(
        "uid-mps",
        json!({"torpor.dev/gpu-mode": "mps", "torpor.dev/gpu-compute-pct": "25",
               "torpor.dev/gpu-memory-mib": "4096"}),
        0,
    );
    let v: Value = post(
        "/filter",
        json!({"Pod": mps, "NodeNames": ["l4-01", "hgx-h200-01"]}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(v["NodeNames"], json!(["l4-01"]), "{v}");

    // A bad annotation and a body that is not JSON.
    let bad = pod(
        "uid-bad",
        json!({"torpor.dev/gpu-compute-pct": "lots", "torpor.dev/gpu-mode": "mps"}),
        0,
    );
    let v: Value = post("/filter", json!({"Pod": bad, "NodeNames": ["l4-01"]}))
        .await
        .json()
        .await
        .unwrap();
    assert!(
        v["Error"].as_str().unwrap().contains("gpu-compute-pct"),
        "{v}"
    );
    let r = http
        .post(format!("{}/filter", ext.url))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(v["Error"]
        .as_str()
        .unwrap()
        .starts_with("extender_bad_request"));
    let r = http
        .post(format!("{}/prioritize", ext.url))
        .body("[]")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["code"], "extender_bad_request");
}

#[test]
fn extender_refuses_a_bad_inventory_and_a_duplicate_node() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write_temp(&dir, "bad.toml", "node = \n");
    let out = torpor(&[
        "gpu",
        "extender",
        "--no-auth",
        "--listen",
        "127.0.0.1:0",
        "--inventory",
        &bad,
    ]);
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("error[inventory_parse]"));
    let l4 = fixture("l4-2.toml");
    let out = torpor(&[
        "gpu",
        "extender",
        "--no-auth",
        "--listen",
        "127.0.0.1:0",
        "--inventory",
        l4.to_str().unwrap(),
        l4.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("error[inventory_duplicate_node]"));
}

/// A stand-in for the Kubernetes API server's binding endpoint (no API server runs here): it
/// records each Binding and answers 201, or 409 for pods named `taken-*`.
async fn binding_endpoint() -> (
    String,
    std::sync::Arc<std::sync::Mutex<Vec<(String, Value)>>>,
) {
    use axum::extract::{Path, State};
    use axum::http::StatusCode;
    type Seen = std::sync::Arc<std::sync::Mutex<Vec<(String, Value)>>>;
    async fn bind(
        State(seen): State<Seen>,
        Path((ns, pod)): Path<(String, String)>,
        headers: axum::http::HeaderMap,
        axum::Json(body): axum::Json<Value>,
    ) -> StatusCode {
        let auth = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        seen.lock()
            .unwrap()
            .push((format!("{ns}/{pod} {auth}"), body));
        if pod.starts_with("taken-") {
            StatusCode::CONFLICT
        } else {
            StatusCode::CREATED
        }
    }
    let seen: Seen = Default::default();
    let app = axum::Router::new()
        .route(
            "/api/v1/namespaces/{ns}/pods/{pod}/binding",
            axum::routing::post(bind),
        )
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, seen)
}

#[tokio::test]
async fn extender_posts_the_binding_and_gives_shares_back_when_it_is_refused() {
    let (api, seen) = binding_endpoint().await;
    let dir = tempfile::tempdir().unwrap();
    let token = write_temp(&dir, "token", "sa-token\n");
    let ext = ExtenderProcess::start_with(
        &[fixture("l4-2.toml")],
        &["--kube-api", &api, "--kube-token-file", &token],
    );
    let http = reqwest::Client::new();
    let call = |path: &str, body: Value| {
        let req = http.post(format!("{}{path}", ext.url)).json(&body);
        async move { req.send().await.unwrap().json::<Value>().await.unwrap() }
    };
    // Two whole-GPU pods fill the two L4s; the API server accepts the first binding.
    let a = pod("agent-a", json!({}), 2);
    let v = call("/filter", json!({"Pod": a, "NodeNames": ["l4-01"]})).await;
    assert_eq!(v["NodeNames"], json!(["l4-01"]));
    let v = call(
        "/bind",
        json!({"PodName": "agent-a", "PodNamespace": "ns1", "PodUID": "agent-a", "Node": "l4-01"}),
    )
    .await;
    assert_eq!(v, json!({"Error": ""}));
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].0, "ns1/agent-a Bearer sa-token");
        assert_eq!(
            seen[0].1,
            json!({"apiVersion": "v1", "kind": "Binding",
                   "metadata": {"name": "agent-a", "namespace": "ns1", "uid": "agent-a"},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": "l4-01"}})
        );
    }
    // The node is full now.
    let b = pod("taken-b", json!({}), 1);
    let v = call("/filter", json!({"Pod": b, "NodeNames": ["l4-01"]})).await;
    assert_eq!(v["NodeNames"], json!([]));
    // A refused binding: the error comes back and the shares are given back.
    let ext2 = ExtenderProcess::start_with(&[fixture("l4-2.toml")], &["--kube-api", &api]);
    let call2 = |path: &str, body: Value| {
        let req = http.post(format!("{}{path}", ext2.url)).json(&body);
        async move { req.send().await.unwrap().json::<Value>().await.unwrap() }
    };
    let taken = pod("taken-c", json!({}), 2);
    call2("/filter", json!({"Pod": taken, "NodeNames": ["l4-01"]})).await;
    let v = call2(
        "/bind",
        json!({"PodName": "taken-c", "PodNamespace": "ns1", "PodUID": "taken-c", "Node": "l4-01"}),
    )
    .await;
    assert!(
        v["Error"]
            .as_str()
            .unwrap()
            .starts_with("kube_api_binding_refused"),
        "{v}"
    );
    let again = pod("agent-d", json!({}), 2);
    let v = call2("/filter", json!({"Pod": again, "NodeNames": ["l4-01"]})).await;
    assert_eq!(v["NodeNames"], json!(["l4-01"]), "capacity came back: {v}");
    // Only http:// is accepted.
    let out = torpor(&[
        "gpu",
        "extender",
        "--no-auth",
        "--listen",
        "127.0.0.1:0",
        "--kube-api",
        "https://kubernetes.default.svc",
        "--inventory",
        fixture("l4-2.toml").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("error[kube_api_not_http]"));
}

/// A stand-in for the Kubernetes API server (none runs here), speaking its exact JSON shapes
/// for what the extender uses: `POST .../pods/{pod}/binding` sets the pod's `spec.nodeName`;
/// `GET /api/v1/pods?fieldSelector=spec.nodeName=N` answers a `v1.PodList`, and with
/// `watch=1` a stream of `metav1.WatchEvent` lines (`{"type": ..., "object": <Pod>}`) until
/// `timeoutSeconds`. Tests change pods through [`FakeApi`]; a change sends a watch event
/// unless it is made silently.
#[derive(Clone, Default)]
struct FakeApi {
    pods: std::sync::Arc<std::sync::Mutex<(u64, Vec<Value>)>>,
    events: std::sync::Arc<std::sync::Mutex<Option<tokio::sync::broadcast::Sender<Value>>>>,
    lists: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl FakeApi {
    fn sender(&self) -> tokio::sync::broadcast::Sender<Value> {
        self.events
            .lock()
            .unwrap()
            .get_or_insert_with(|| tokio::sync::broadcast::channel(64).0)
            .clone()
    }

    fn add(&self, uid: &str) {
        let mut pods = self.pods.lock().unwrap();
        pods.0 += 1;
        let rv = pods.0.to_string();
        pods.1.push(json!({
            "kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": uid, "namespace": "default", "uid": uid, "resourceVersion": rv},
            "spec": {"containers": [{"name": "agent", "image": "cuda"}]},
            "status": {"phase": "Pending"}
        }));
    }

    /// Changes a pod; `event` (`MODIFIED`/`DELETED`) is sent to watchers unless `None`.
    fn change(&self, uid: &str, f: impl FnOnce(&mut Value) -> bool, event: Option<&str>) {
        let mut pods = self.pods.lock().unwrap();
        pods.0 += 1;
        let rv = pods.0.to_string();
        let i = pods
            .1
            .iter()
            .position(|p| p["metadata"]["uid"] == uid)
            .unwrap();
        let mut pod = pods.1[i].clone();
        pod["metadata"]["resourceVersion"] = json!(rv);
        if f(&mut pod) {
            pods.1[i] = pod.clone();
        } else {
            pods.1.remove(i);
        }
        drop(pods);
        if let Some(kind) = event {
            let _ = self.sender().send(json!({"type": kind, "object": pod}));
        }
    }

    async fn serve(&self) -> String {
        use axum::extract::{Path, Query, State};
        use axum::http::StatusCode;
        async fn bind(
            State(api): State<FakeApi>,
            Path((_ns, pod)): Path<(String, String)>,
            axum::Json(body): axum::Json<Value>,
        ) -> (StatusCode, axum::Json<Value>) {
            let node = body["target"]["name"].clone();
            api.change(
                &pod,
                |p| {
                    p["spec"]["nodeName"] = node;
                    p["status"]["phase"] = json!("Running");
                    true
                },
                Some("MODIFIED"),
            );
            (
                StatusCode::CREATED,
                axum::Json(
                    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}),
                ),
            )
        }
        async fn pods(
            State(api): State<FakeApi>,
            Query(q): Query<BTreeMap<String, String>>,
        ) -> axum::response::Response {
            use axum::response::IntoResponse;
            let node = q
                .get("fieldSelector")
                .and_then(|s| s.strip_prefix("spec.nodeName="))
                .expect("the extender lists by node")
                .to_owned();
            let on_node = |p: &Value| p["spec"]["nodeName"] == node.as_str();
            if q.get("watch").map(String::as_str) != Some("1") {
                api.lists.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let pods = api.pods.lock().unwrap();
                let items: Vec<Value> = pods.1.iter().filter(|p| on_node(p)).cloned().collect();
                return axum::Json(json!({"kind": "PodList", "apiVersion": "v1",
                    "metadata": {"resourceVersion": pods.0.to_string()}, "items": items}))
                .into_response();
            }
            let secs: u64 = q["timeoutSeconds"].parse().unwrap();
            let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
            let rx = api.sender().subscribe();
            let stream = futures::stream::unfold(rx, move |mut rx| {
                let node = node.clone();
                async move {
                    loop {
                        match tokio::time::timeout_at(deadline, rx.recv()).await {
                            Ok(Ok(event)) => {
                                let obj = &event["object"];
                                // DELETED carries the last state, with its nodeName.
                                if obj["spec"]["nodeName"] == node.as_str() {
                                    let mut line = serde_json::to_vec(&event).unwrap();
                                    line.push(b'\n');
                                    return Some((Ok::<_, std::io::Error>(line), rx));
                                }
                            }
                            _ => return None,
                        }
                    }
                }
            });
            axum::body::Body::from_stream(stream).into_response()
        }
        let app = axum::Router::new()
            .route(
                "/api/v1/namespaces/{ns}/pods/{pod}/binding",
                axum::routing::post(bind),
            )
            .route("/api/v1/pods", axum::routing::get(pods))
            .with_state(self.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    }
}

#[tokio::test]
async fn extender_releases_pods_that_end_or_vanish() {
    let api = FakeApi::default();
    let url = api.serve().await;
    let ext = ExtenderProcess::start_with(
        &[fixture("l4-2.toml")],
        &["--kube-api", &url, "--kube-resync-secs", "2"],
    );
    let http = reqwest::Client::new();
    let call = |path: &str, body: Value| {
        let req = http.post(format!("{}{path}", ext.url)).json(&body);
        async move { req.send().await.unwrap().json::<Value>().await.unwrap() }
    };
    let bind = |uid: &str| {
        call(
            "/bind",
            json!({"PodName": uid, "PodNamespace": "default", "PodUID": uid, "Node": "l4-01"}),
        )
    };
    // Whether a pod asking for `gpus` whole L4s fits now (filter only; never bound).
    let fits = |uid: String, gpus: u32| {
        let f = call(
            "/filter",
            json!({"Pod": pod(&uid, json!({}), gpus), "NodeNames": ["l4-01"]}),
        );
        async move { f.await["NodeNames"] == json!(["l4-01"]) }
    };
    let mut probe = 0;
    let mut wait_fits = async |gpus: u32, want: bool| {
        for _ in 0..150 {
            probe += 1;
            if fits(format!("probe-{probe}"), gpus).await == want {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        panic!("a {gpus}-GPU pod never came to fit={want}");
    };

    // A pod holding both L4s ends (Succeeded, told by the watch): its shares come back.
    api.add("job-a");
    call(
        "/filter",
        json!({"Pod": pod("job-a", json!({}), 2), "NodeNames": ["l4-01"]}),
    )
    .await;
    assert_eq!(bind("job-a").await, json!({"Error": ""}));
    assert!(!fits("probe-full".into(), 1).await);
    // Still running through a few list cycles: kept.
    let lists = api.lists.load(std::sync::atomic::Ordering::SeqCst);
    for _ in 0..50 {
        if api.lists.load(std::sync::atomic::Ordering::SeqCst) >= lists + 2 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(
        api.lists.load(std::sync::atomic::Ordering::SeqCst) >= lists + 2,
        "the extender lists pods"
    );
    assert!(
        !fits("probe-running".into(), 1).await,
        "a running pod keeps its GPUs"
    );
    api.change(
        "job-a",
        |p| {
            p["status"]["phase"] = json!("Succeeded");
            true
        },
        Some("MODIFIED"),
    );
    wait_fits(2, true).await;

    // Two pods take one L4 each; one is deleted without any watch event (the next list sees
    // it gone), the other keeps running and keeps its L4.
    for uid in ["job-b", "job-c"] {
        api.add(uid);
        call(
            "/filter",
            json!({"Pod": pod(uid, json!({}), 1), "NodeNames": ["l4-01"]}),
        )
        .await;
        assert_eq!(bind(uid).await, json!({"Error": ""}));
    }
    wait_fits(1, false).await;
    api.change("job-b", |_| false, None);
    wait_fits(1, true).await;
    assert!(
        !fits("probe-two".into(), 2).await,
        "job-c still holds its L4"
    );
    // A DELETED event releases at once too.
    api.change("job-c", |_| false, Some("DELETED"));
    wait_fits(2, true).await;
}
