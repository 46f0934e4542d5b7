//! The E2B-compatible API, end to end on the real binary and real runsc sandboxes:
//! - the official, unmodified `e2b` Python SDK (installed by scripts/deps.sh) runs
//!   tests/e2b_sdk/sdk_flow.py against torpor with the three environment variables, and the
//!   JavaScript SDK (npm, installed into tests/e2b_sdk/js) the same flow in sdk_flow.mjs;
//! - the wire contract (status codes, error shapes, Connect framing, bad input) checked raw.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use torpor_api::types::CreateTenantBody;

const SDK_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b_sdk/sdk_flow.py");
const JS_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b_sdk/sdk_flow.mjs");
const PORTS_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b_sdk/ports.py");
const NETWORK_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b_sdk/network.py");
const PTY_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b_sdk/pty.py");
const LEGACY_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b_sdk/legacy.py");
const PARITY_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b_sdk/parity.py");
const BASE_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b_sdk/base.py");
const FILES_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b_sdk/files.py");
const SNAPSHOTS_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b_sdk/snapshots.py");
const METADATA_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b_sdk/metadata.py");
const JS_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b_sdk/js");

async fn tenant(d: &Daemon, name: &str) -> String {
    d.client()
        .create_tenant(&CreateTenantBody {
            name: name.into(),
            quotas: None,
        })
        .await
        .unwrap()
        .token
}

#[tokio::test(flavor = "multi_thread")]
async fn the_official_python_sdk_runs_against_torpor() {
    let probe = Command::new("python3")
        .args([
            "-c",
            "import e2b, importlib.metadata as m; print(m.version('e2b'))",
        ])
        .output()
        .expect("python3 must be installed (scripts/deps.sh)");
    assert!(
        probe.status.success(),
        "the e2b Python SDK is not installed: run `bash scripts/deps.sh` (it pip-installs e2b)\n{}",
        String::from_utf8_lossy(&probe.stderr)
    );
    eprintln!("e2b SDK {}", String::from_utf8_lossy(&probe.stdout).trim());
    let d = Daemon::start().await;
    let key = tenant(&d, "sdk-a").await;
    let other = tenant(&d, "sdk-b").await;
    run_sdk(&d, "python3", SDK_SCRIPT, &key, &[("OTHER_KEY", other)]).await;
}

/// Runs `script` of tests/e2b_sdk with `program` (python3 or node) and the official SDK pointed
/// at the daemon by E2B's three variables (plus `extra`); asserts that it printed ALL OK.
async fn run_sdk(d: &Daemon, program: &str, script: &str, key: &str, extra: &[(&str, String)]) {
    let mut cmd = Command::new(program);
    cmd.arg(script)
        .env("E2B_API_KEY", key)
        .env("E2B_API_URL", d.url())
        .env("E2B_SANDBOX_URL", d.url())
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN");
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{program} must be installed (scripts/deps.sh): {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("ALL OK"),
        "SDK script {script} failed ({}):\n{stdout}\n{}\n--- daemon log ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        d.log()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_official_javascript_sdk_runs_against_torpor() {
    let sdk = std::path::Path::new(JS_DIR).join("node_modules/e2b/package.json");
    let version = std::fs::read_to_string(&sdk).unwrap_or_else(|_| {
        panic!(
            "the e2b JavaScript SDK is not installed in {JS_DIR}: run `bash scripts/deps.sh` \
             (it runs `npm install` there)"
        )
    });
    let v: Value = serde_json::from_str(&version).unwrap();
    eprintln!("e2b JS SDK {}", v["version"]);
    let d = Daemon::start().await;
    let key = tenant(&d, "js-a").await;
    let other = tenant(&d, "js-b").await;
    run_sdk(
        &d,
        "node",
        JS_SCRIPT,
        &key,
        &[("OTHER_KEY", other), ("E2B_JS_DIR", JS_DIR.to_string())],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_python_sdk_reaches_ports_and_sets_egress() {
    // The egress script's server is on a host address: closed to sandboxes unless listed.
    let host_ip = common::host_addr();
    let d = Daemon::start_with(&[
        "--proxy-domain",
        "e2b.test",
        "--sandbox-reach-host",
        &host_ip,
    ])
    .await;
    let key = tenant(&d, "ports-a").await;
    let addr = format!("127.0.0.1:{}", d.port);
    let extra = [("TORPOR_ADDR", addr), ("EXPECT_DOMAIN", "e2b.test".into())];
    run_sdk(&d, "python3", PORTS_SCRIPT, &key, &extra).await;
    // Egress options (same daemon): they need a template whose network is `full`.
    let mut full = common::agent_template("net-full", common::no_idle());
    full.command = Vec::new();
    full.warmup_ms = 0;
    full.network = Some(torpor_core::NetworkPolicy::full());
    torpor_api::Client::new(&d.url(), &key)
        .create_template(&full)
        .await
        .unwrap();
    let mut extra = extra.to_vec();
    extra.push(("HOST_IP", common::host_addr()));
    extra.push(("FULL_TEMPLATE", "net-full".into()));
    run_sdk(&d, "python3", NETWORK_SCRIPT, &key, &extra).await;
}

/// Issue 19: what E2B's users rely on beyond the happy path (gzip, list order and depth,
/// symlinks, is_running after pause and timeout, auto-resume, list order and filters, fork,
/// metrics, E2B-shaped errors), as the SDK sees it.
#[tokio::test(flavor = "multi_thread")]
async fn the_python_sdk_sees_e2b_semantics_beyond_the_happy_path() {
    let d = Daemon::start().await;
    let key = tenant(&d, "parity-a").await;
    run_sdk(&d, "python3", PARITY_SCRIPT, &key, &[]).await;
}

/// Issue 19: E2B's `base` (user `user`, sudo, python, files owned by `user`), as the SDK sees it.
#[tokio::test(flavor = "multi_thread")]
async fn the_python_sdk_finds_e2bs_base_template() {
    let d = Daemon::start().await;
    let key = tenant(&d, "base-a").await;
    run_sdk(&d, "python3", BASE_SCRIPT, &key, &[]).await;
}

/// Issue 19: E2B's filesystem beyond the happy path (entries' owners, writes as envd makes
/// them, signed URLs with expiry and tampering, recursive watches with entry info and events in
/// order), as the SDK sees it.
#[tokio::test(flavor = "multi_thread")]
async fn the_python_sdk_sees_e2bs_filesystem_owners_signed_urls_and_watches() {
    let d = Daemon::start().await;
    let key = tenant(&d, "files-a").await;
    run_sdk(&d, "python3", FILES_SCRIPT, &key, &[]).await;
}

/// Issue 19: E2B's file metadata (user xattrs set on upload, surfaced by get_info and list,
/// kept across rename, cleared on overwrite, refused as envd refuses it), as the SDK sees it;
/// and a sandbox whose agent predates it (the template's env sets the agent's test switch, so
/// it says protocol 2 and cannot parse the metadata requests), which is never sent them.
#[tokio::test(flavor = "multi_thread")]
async fn the_python_sdk_keeps_file_metadata_as_envd_does() {
    let d = Daemon::start().await;
    let mut spec = agent_template("agent-v2", no_idle());
    spec.command = Vec::new();
    spec.warmup_ms = 0;
    spec.env = [(
        torpor_runtime::agent::TEST_AGENT_VERSION.to_string(),
        "2".to_string(),
    )]
    .into();
    d.client().create_template(&spec).await.unwrap();
    let key = tenant(&d, "metadata-a").await;
    let extra = [("OLD_AGENT_TEMPLATE", "agent-v2".to_string())];
    // Were the older agent sent a metadata request, it would never answer it: the script's
    // call would time out and fail.
    run_sdk(&d, "python3", METADATA_SCRIPT, &key, &extra).await;
}

/// Issue 19: E2B's named snapshots (create, list, create from, delete; another tenant's
/// unreachable), as the SDK sees them.
#[tokio::test(flavor = "multi_thread")]
async fn the_python_sdk_takes_and_uses_named_snapshots() {
    let d = Daemon::start().await;
    let key = tenant(&d, "snap-a").await;
    let other = tenant(&d, "snap-b").await;
    run_sdk(
        &d,
        "python3",
        SNAPSHOTS_SCRIPT,
        &key,
        &[("OTHER_KEY", other)],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_python_sdk_drives_terminals_and_streamed_input() {
    let d = Daemon::start().await;
    let key = tenant(&d, "pty-a").await;
    run_sdk(&d, "python3", PTY_SCRIPT, &key, &[]).await;
}

/// A sandbox whose agent predates `Spawn` (as one restored from an older torpor's snapshot):
/// E2B processes run under the adapter's supervisor shell. The template's env sets the agent's
/// test switch, so its agent answers `Spawn` (and the ops that came with it) as an older one.
#[tokio::test(flavor = "multi_thread")]
async fn the_python_sdk_runs_commands_through_the_supervisor_fallback() {
    let d = Daemon::start().await;
    let mut spec = agent_template("legacy-agent", no_idle());
    spec.command = Vec::new();
    spec.warmup_ms = 0;
    spec.env = [(
        torpor_runtime::agent::TEST_WITHOUT_SPAWN.to_string(),
        "1".to_string(),
    )]
    .into();
    d.client().create_template(&spec).await.unwrap();
    let key = tenant(&d, "legacy-a").await;
    let extra = [("TEMPLATE", "legacy-agent".to_string())];
    run_sdk(&d, "python3", LEGACY_SCRIPT, &key, &extra).await;
    let log = d.log();
    assert!(
        log.contains("agent without Spawn; using the supervisor shell"),
        "the adapter fell back to the supervisor shell:\n{log}"
    );
}

struct E2b {
    http: reqwest::Client,
    url: String,
    key: String,
}

impl E2b {
    /// The E2B API of daemon `d` with API key `key`.
    fn of(d: &Daemon, key: String) -> E2b {
        E2b {
            http: reqwest::Client::new(),
            url: d.url(),
            key,
        }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.url))
            .header("X-API-KEY", &self.key);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        let v = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("{path}: not JSON: {text:?}"))
        };
        (status, v)
    }

    fn envd(&self, path: &str, id: &str, token: &str) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{}{path}", self.url))
            .header("E2b-Sandbox-Id", id)
            .header("X-Access-Token", token)
    }

    /// `POST /v2/sandboxes` with `body`, which must succeed: (sandbox id, envd token).
    async fn create(&self, body: Value) -> (String, String) {
        let (s, sbx) = self
            .call(reqwest::Method::POST, "/v2/sandboxes", Some(body))
            .await;
        assert_eq!(s, 201, "{sbx}");
        (
            sbx["sandboxID"].as_str().unwrap().to_string(),
            sbx["envdAccessToken"].as_str().unwrap().to_string(),
        )
    }

    /// A unary envd `filesystem.Filesystem/<method>` call in JSON, which must answer 200.
    async fn filesystem(&self, id: &str, token: &str, method: &str, body: Value) -> Value {
        let resp = self
            .envd(&format!("/filesystem.Filesystem/{method}"), id, token)
            .header("Content-Type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200, "{method}");
        resp.json::<Value>().await.unwrap()
    }
}

fn assert_error(status: u16, v: &Value, want: u16) {
    assert_eq!(status, want, "{v}");
    assert_eq!(
        v["code"], want,
        "error body carries the status as an int: {v}"
    );
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
}

/// Splits a Connect stream body into (flags, JSON) frames.
fn frames(body: &[u8]) -> Vec<(u8, Value)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < body.len() {
        let len = u32::from_be_bytes(body[i + 1..i + 5].try_into().unwrap()) as usize;
        out.push((
            body[i],
            serde_json::from_slice(&body[i + 5..i + 5 + len]).unwrap(),
        ));
        i += 5 + len;
    }
    out
}

fn envelope(flags: u8, json: &[u8]) -> Vec<u8> {
    let mut v = vec![flags];
    v.extend_from_slice(&(json.len() as u32).to_be_bytes());
    v.extend_from_slice(json);
    v
}

#[tokio::test(flavor = "multi_thread")]
async fn wire_contract_statuses_shapes_and_bad_input() {
    let d = Daemon::start().await;
    let key = tenant(&d, "wire-a").await;
    let other = tenant(&d, "wire-b").await;
    let http = reqwest::Client::new();
    let api = E2b {
        http: http.clone(),
        url: d.url(),
        key: key.clone(),
    };
    use reqwest::Method as M;

    // Authentication.
    let noauth = E2b {
        key: "tpr_nobody_0000".into(),
        ..E2b {
            http: http.clone(),
            url: d.url(),
            key: String::new(),
        }
    };
    let (s, v) = noauth.call(M::POST, "/v2/sandboxes", Some(json!({}))).await;
    assert_error(s, &v, 401);
    let resp = http
        .get(format!("{}/v2/sandboxes", d.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);

    // Create: exactly 201, with every field the SDK reads.
    let (s, v) = api
        .call(
            M::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "nope"})),
        )
        .await;
    assert_error(s, &v, 404);
    let (s, sbx) = api
        .call(
            M::POST,
            "/sandboxes",
            Some(json!({"templateID": "base", "metadata": {"g": "one"}, "timeout": 600, "extra": [1]})),
        )
        .await;
    assert_eq!(s, 201, "{sbx}");
    for f in [
        "templateID",
        "sandboxID",
        "clientID",
        "envdVersion",
        "envdAccessToken",
        "domain",
    ] {
        assert!(sbx[f].is_string(), "{f} missing: {sbx}");
    }
    assert_eq!(sbx["envdVersion"], "0.6.4");
    assert_eq!(sbx["templateID"], "base");
    // The default proxy domain; public ports carry no traffic token.
    assert_eq!(sbx["domain"], "localhost");
    assert!(sbx.get("trafficAccessToken").is_none(), "{sbx}");
    let id = sbx["sandboxID"].as_str().unwrap().to_string();
    let token = sbx["envdAccessToken"].as_str().unwrap().to_string();

    // Get, connect (running: 200), pause (204, then 409), connect (woken: 201).
    let (s, det) = api.call(M::GET, &format!("/sandboxes/{id}"), None).await;
    assert_eq!(s, 200);
    for f in [
        "startedAt",
        "endAt",
        "cpuCount",
        "memoryMB",
        "diskSizeMB",
        "metadata",
    ] {
        assert!(!det[f].is_null(), "{f} missing: {det}");
    }
    assert_eq!(det["state"], "running");
    assert_eq!(
        det["metadata"],
        json!({"g": "one"}),
        "internal keys stay hidden"
    );
    let (s, _) = api
        .call(
            M::POST,
            &format!("/v2/sandboxes/{id}/connect"),
            Some(json!({"timeout": 600})),
        )
        .await;
    assert_eq!(s, 200);
    let (s, _) = api
        .call(M::POST, &format!("/sandboxes/{id}/pause"), None)
        .await;
    assert_eq!(s, 204);
    let (s, v) = api
        .call(M::POST, &format!("/sandboxes/{id}/pause"), None)
        .await;
    assert_error(s, &v, 409);
    let (_, det) = api.call(M::GET, &format!("/sandboxes/{id}"), None).await;
    assert_eq!(det["state"], "paused");
    let (s, v) = api
        .call(
            M::POST,
            &format!("/sandboxes/{id}/connect"),
            Some(json!({"timeout": 600})),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(
        v["envdAccessToken"],
        token.as_str(),
        "the access token is stable"
    );
    let (s, _) = api
        .call(
            M::POST,
            &format!("/sandboxes/{id}/timeout"),
            Some(json!({"timeout": 900})),
        )
        .await;
    assert_eq!(s, 204);
    let (s, v) = api
        .call(
            M::POST,
            &format!("/sandboxes/{id}/timeout"),
            Some(json!({"timeout": -1})),
        )
        .await;
    assert_error(s, &v, 400);
    let (s, v) = api
        .call(
            M::POST,
            &format!("/sandboxes/{id}/timeout"),
            Some(json!("{")),
        )
        .await;
    assert_error(s, &v, 400);

    // Unknown ids and another tenant's sandbox: 404.
    for path in ["/sandboxes/sb-unknown000000000", "/sandboxes/..%2f"] {
        let (s, v) = api.call(M::GET, path, None).await;
        assert_error(s, &v, 404);
    }
    let (s, v) = api
        .call(
            M::POST,
            "/v2/sandboxes/sb-unknown000000000/connect",
            Some(json!({})),
        )
        .await;
    assert_error(s, &v, 404);
    let (s, v) = api
        .call(M::DELETE, "/sandboxes/sb-unknown000000000", None)
        .await;
    assert_error(s, &v, 404);
    let foreign = E2b {
        http: http.clone(),
        url: d.url(),
        key: other.clone(),
    };
    let (s, v) = foreign
        .call(M::GET, &format!("/sandboxes/{id}"), None)
        .await;
    assert_error(s, &v, 404);
    let (s, v) = foreign
        .call(M::POST, &format!("/sandboxes/{id}/pause"), None)
        .await;
    assert_error(s, &v, 404);
    // Egress options: another tenant's sandbox, a bad entry, widening the `base` template
    // (no network: ingress only), each with E2B's error shape; narrowing it is accepted.
    let net = format!("/sandboxes/{id}/network");
    let (s, v) = foreign
        .call(M::PUT, &net, Some(json!({"denyOut": ["0.0.0.0/0"]})))
        .await;
    assert_error(s, &v, 404);
    let (s, v) = api
        .call(M::PUT, &net, Some(json!({"denyOut": ["example.com"]})))
        .await;
    assert_error(s, &v, 400);
    assert!(v["message"].as_str().unwrap().contains("denyOut[0]"), "{v}");
    let (s, v) = api
        .call(
            M::PUT,
            &net,
            Some(json!({"allowOut": ["1.1.1.1"], "denyOut": ["0.0.0.0/0"]})),
        )
        .await;
    assert_error(s, &v, 400);
    assert!(
        v["message"].as_str().unwrap().contains("limits egress"),
        "{v}"
    );
    let (s, v) = api
        .call(M::PUT, &net, Some(json!({"allow_internet_access": false})))
        .await;
    assert_eq!(s, 204, "{v}");
    let (_, det) = api.call(M::GET, &format!("/sandboxes/{id}"), None).await;
    assert_eq!(det["allowInternetAccess"], false, "{det}");
    assert_eq!(det["network"]["allowPublicTraffic"], true, "{det}");

    // List: metadata filter and x-next-token paging (two more in group "two").
    for _ in 0..2 {
        let (s, _) = api
            .call(
                M::POST,
                "/v2/sandboxes",
                Some(json!({"metadata": {"g": "two"}})),
            )
            .await;
        assert_eq!(s, 201);
    }
    let (s, v) = api
        .call(M::GET, "/v2/sandboxes?metadata=g%3Dtwo", None)
        .await;
    assert_eq!(s, 200);
    assert_eq!(v.as_array().unwrap().len(), 2, "{v}");
    let resp = http
        .get(format!("{}/v2/sandboxes?limit=2", d.url()))
        .header("X-API-KEY", &key)
        .send()
        .await
        .unwrap();
    let next = resp.headers()["x-next-token"].to_str().unwrap().to_string();
    let page1: Value = resp.json().await.unwrap();
    assert_eq!(page1.as_array().unwrap().len(), 2);
    let resp = http
        .get(format!("{}/v2/sandboxes?limit=2&nextToken={next}", d.url()))
        .header("X-API-KEY", &key)
        .send()
        .await
        .unwrap();
    assert!(resp.headers().get("x-next-token").is_none());
    let page2: Value = resp.json().await.unwrap();
    assert_eq!(page2.as_array().unwrap().len(), 1);
    let mut all: Vec<_> = page1
        .as_array()
        .unwrap()
        .iter()
        .chain(page2.as_array().unwrap())
        .map(|s| s["sandboxID"].clone())
        .collect();
    all.dedup();
    assert_eq!(all.len(), 3);
    let (s, v) = api.call(M::GET, "/v2/sandboxes?state=zombie", None).await;
    assert_error(s, &v, 400);
    let (_, v) = foreign.call(M::GET, "/v2/sandboxes", None).await;
    assert_eq!(v, json!([]), "tenants see only their own");

    // envd: header checks.
    let resp = http
        .get(format!("{}/health", d.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let resp = http
        .get(format!("{}/health", d.url()))
        .header("E2b-Sandbox-Id", &id)
        .header("X-Access-Token", "wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    let resp = http
        .get(format!("{}/health", d.url()))
        .header("E2b-Sandbox-Id", "sb-unknown000000000")
        .header("X-Access-Token", &token)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 502);
    let resp = http
        .get(format!("{}/health", d.url()))
        .header("E2b-Sandbox-Id", &id)
        .header("X-Access-Token", &token)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 204);

    // Connect-RPC: unary errors.
    let unary = |path: &str, body: &str| {
        api.envd(path, &id, &token)
            .header("Content-Type", "application/json")
            .body(body.to_string())
    };
    let resp = unary("/process.Process/Frobnicate", "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 501);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["code"], "unimplemented");
    let resp = unary("/filesystem.Filesystem/Stat", r#"{"path":"../../../etc"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    assert_eq!(
        resp.json::<Value>().await.unwrap()["code"],
        "invalid_argument"
    );
    let resp = unary("/filesystem.Filesystem/Stat", r#"{"path":"/nope/x"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 404);
    assert_eq!(resp.json::<Value>().await.unwrap()["code"], "not_found");
    let resp = unary("/filesystem.Filesystem/Stat", "{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let resp = api
        .envd("/process.Process/List", &id, "wrong")
        .header("Content-Type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    assert_eq!(
        resp.json::<Value>().await.unwrap()["code"],
        "unauthenticated"
    );
    let resp = api
        .envd("/process.Process/List", &id, &token)
        .header("Content-Type", "application/proto")
        .body("")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);

    // Connect-RPC: a server stream, framed and typed exactly.
    let start = |body: Vec<u8>| {
        api.envd("/process.Process/Start", &id, &token)
            .header("Content-Type", "application/connect+json")
            .body(body)
    };
    let req =
        json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo out; echo err >&2; exit 7"]}});
    let resp = start(envelope(0, req.to_string().as_bytes()))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(resp.headers()["content-type"], "application/connect+json");
    let f = frames(&resp.bytes().await.unwrap());
    assert!(
        f[0].1["event"]["start"]["pid"].as_u64().unwrap() > 0,
        "{f:?}"
    );
    let (mut out, mut err) = (String::new(), String::new());
    use base64::Engine as _;
    let b64 = |v: &Value| {
        String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(v.as_str().unwrap())
                .unwrap(),
        )
        .unwrap()
    };
    for (_, m) in &f[1..f.len() - 2] {
        let data = &m["event"]["data"];
        if !data["stdout"].is_null() {
            out += &b64(&data["stdout"]);
        }
        if !data["stderr"].is_null() {
            err += &b64(&data["stderr"]);
        }
    }
    assert_eq!((out.as_str(), err.as_str()), ("out\n", "err\n"));
    let end = &f[f.len() - 2].1["event"]["end"];
    assert_eq!(end["exitCode"], 7);
    assert_eq!(end["exited"], true);
    assert_eq!(f[f.len() - 1], (2, json!({})), "end-of-stream frame");

    // Malformed envelopes: an error in the end-of-stream frame, never a 500.
    let good = req.to_string().into_bytes();
    let mut wrong_len = envelope(0, &good);
    wrong_len[4] ^= 1;
    let oversized = [0u8, 0x7f, 0xff, 0xff, 0xff];
    for (body, code) in [
        (wrong_len, "invalid_argument"),
        (oversized.to_vec(), "resource_exhausted"),
        (envelope(0x40, &good), "invalid_argument"),
        (envelope(0x01, &good), "unimplemented"),
        (vec![0u8, 0], "invalid_argument"),
        (envelope(0, b"[1,2]"), "invalid_argument"),
    ] {
        let resp = start(body).send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let f = frames(&resp.bytes().await.unwrap());
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].0, 2);
        assert_eq!(f[0].1["error"]["code"], code, "{f:?}");
    }

    // StreamInput (client streaming): the first message must be `start`; a pid that does not
    // run is not_found; a terminal call on a process without one is failed_precondition.
    let stream_input = |body: Vec<u8>| {
        api.envd("/process.Process/StreamInput", &id, &token)
            .header("Content-Type", "application/connect+json")
            .body(body)
    };
    let data = envelope(0, br#"{"data":{"input":{"stdin":"aGk="}}}"#);
    let unknown = envelope(0, br#"{"start":{"process":{"pid":999999}}}"#);
    // Its body is decoded as it arrives, with the same framing errors as a whole one; an
    // end-of-stream envelope (flag 2) ends it (here with no start: invalid_argument).
    let only_end = envelope(2, b"{}");
    let mut truncated = envelope(0, br#"{"keepalive":{}}"#);
    truncated.pop();
    for (body, code, words) in [
        (data, "invalid_argument", "must be start"),
        (unknown, "not_found", "999999"),
        (only_end, "invalid_argument", "needs a start"),
        (
            truncated,
            "invalid_argument",
            "announces 16 bytes but carries 15",
        ),
        (oversized.to_vec(), "resource_exhausted", "exceeds"),
        (envelope(0x40, b"{}"), "invalid_argument", "flags"),
        (envelope(0x01, b"{}"), "unimplemented", "compressed"),
        (envelope(0, b"[1]"), "invalid_argument", "request message"),
    ] {
        let resp = stream_input(body.to_vec()).send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        assert_eq!(resp.headers()["content-type"], "application/connect+json");
        let f = frames(&resp.bytes().await.unwrap());
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].0, 2, "{f:?}");
        assert_eq!(f[0].1["error"]["code"], code, "{f:?}");
        let message = f[0].1["error"]["message"].as_str().unwrap();
        assert!(message.contains(words), "{f:?}");
    }
    // A whole stream to `cat`: start, data, the end-of-stream envelope (what follows it is
    // not read) → one empty message and the end-of-stream frame; cat echoes the input.
    let mut cat = start(envelope(0, br#"{"process":{"cmd":"cat"},"stdin":true}"#))
        .send()
        .await
        .unwrap();
    let first = cat.chunk().await.unwrap().unwrap();
    let cat_pid = frames(&first)[0].1["event"]["start"]["pid"]
        .as_u64()
        .unwrap();
    let body = [
        envelope(
            0,
            json!({"start": {"process": {"pid": cat_pid}}})
                .to_string()
                .as_bytes(),
        ),
        envelope(0, br#"{"keepalive":{}}"#),
        envelope(0, br#"{"data":{"input":{"stdin":"aGkK"}}}"#),
        envelope(2, b"{}"),
        vec![0xff],
    ]
    .concat();
    let resp = stream_input(body).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let f = frames(&resp.bytes().await.unwrap());
    assert_eq!(f, vec![(0, json!({})), (2, json!({}))]);
    let (mut buf, mut echoed) = (Vec::new(), String::new());
    while echoed != "hi\n" {
        let chunk = tokio::time::timeout(Duration::from_secs(30), cat.chunk())
            .await
            .expect("cat echoes the streamed input")
            .unwrap()
            .expect("cat's stream stays open");
        buf.extend_from_slice(&chunk);
        let mut i = 0;
        while buf.len() - i >= 5 {
            let len = u32::from_be_bytes(buf[i + 1..i + 5].try_into().unwrap()) as usize;
            if buf.len() - i - 5 < len {
                break;
            }
            let m: Value = serde_json::from_slice(&buf[i + 5..i + 5 + len]).unwrap();
            if !m["event"]["data"]["stdout"].is_null() {
                echoed += &b64(&m["event"]["data"]["stdout"]);
            }
            i += 5 + len;
        }
        buf.drain(..i);
    }
    drop(cat);
    let mut sleeper = start(envelope(0, br#"{"process":{"cmd":"sleep","args":["30"]}}"#))
        .send()
        .await
        .unwrap();
    let first = sleeper.chunk().await.unwrap().unwrap();
    let pid = frames(&first)[0].1["event"]["start"]["pid"]
        .as_u64()
        .unwrap();
    let resp = api
        .envd("/process.Process/Update", &id, &token)
        .header("Content-Type", "application/json")
        .body(
            json!({"process": {"pid": pid}, "pty": {"size": {"cols": 10, "rows": 5}}}).to_string(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["code"], "failed_precondition", "{v}");
    drop(sleeper);

    // /files: octet-stream upload, raw download, path escape refused, missing file 404.
    let resp = http
        .post(format!("{}/files?path=up/x.bin", d.url()))
        .header("E2b-Sandbox-Id", &id)
        .header("X-Access-Token", &token)
        .header("Content-Type", "application/octet-stream")
        .body(vec![0u8, 1, 2, 255])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(
        v,
        json!([{"name": "x.bin", "type": "file", "path": "/home/user/up/x.bin"}])
    );
    let get = |path: &str| {
        http.get(format!("{}/files", d.url()))
            .query(&[("path", path)])
            .header("E2b-Sandbox-Id", &id)
            .header("X-Access-Token", &token)
    };
    let resp = get("/home/user/up/x.bin").send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(&resp.bytes().await.unwrap()[..], &[0u8, 1, 2, 255]);
    let resp = get("../../../../etc/passwd").send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["code"], 400);
    let resp = get("/home/user/none").send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 404);

    // Kill: 204 then 404.
    let (s, _) = api.call(M::DELETE, &format!("/sandboxes/{id}"), None).await;
    assert_eq!(s, 204);
    let (s, v) = api.call(M::DELETE, &format!("/sandboxes/{id}"), None).await;
    assert_error(s, &v, 404);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_timed_out_sandbox_sleeps_and_wakes_with_its_state() {
    let d = Daemon::start().await;
    let key = tenant(&d, "ttl").await;
    let api = E2b::of(&d, key);
    use reqwest::Method as M;
    // The sleeper's deadline is set to 1 s only once its file is written: a call after its
    // timeout would wake it again.
    let (s, sleeper) = api
        .call(M::POST, "/v2/sandboxes", Some(json!({"timeout": 600})))
        .await;
    assert_eq!(s, 201);
    let (s, killed) = api
        .call(
            M::POST,
            "/v2/sandboxes",
            Some(json!({"timeout": 1, "autoPause": false})),
        )
        .await;
    assert_eq!(s, 201);
    let sid = sleeper["sandboxID"].as_str().unwrap();
    let kid = killed["sandboxID"].as_str().unwrap();
    let token = sleeper["envdAccessToken"].as_str().unwrap();
    // Something in the sleeper's filesystem that must survive.
    let resp = api
        .http
        .post(format!("{}/files?path=/home/user/kept.txt", d.url()))
        .header("E2b-Sandbox-Id", sid)
        .header("X-Access-Token", token)
        .header("Content-Type", "application/octet-stream")
        .body("kept")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let (s, _) = api
        .call(
            M::POST,
            &format!("/sandboxes/{sid}/timeout"),
            Some(json!({"timeout": 1})),
        )
        .await;
    assert_eq!(s, 204);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, s) = api.call(M::GET, &format!("/sandboxes/{sid}"), None).await;
        let (k, _) = api.call(M::GET, &format!("/sandboxes/{kid}"), None).await;
        if s["state"] == "paused" && k == 404 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "timeouts not applied: {s} / {k}\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (s, _) = api
        .call(
            M::POST,
            &format!("/sandboxes/{sid}/connect"),
            Some(json!({"timeout": 600})),
        )
        .await;
    assert_eq!(s, 201, "a timed-out sandbox is asleep, not lost");
    let resp = api
        .http
        .get(format!("{}/files?path=/home/user/kept.txt", d.url()))
        .header("E2b-Sandbox-Id", sid)
        .header("X-Access-Token", token)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.text().await.unwrap(), "kept");
}

/// Runs `cmd` in sandbox `id` through torpor's own exec (as root) as uid 1000, the way a
/// `base` command runs: its stdout, trimmed.
async fn as_user(d: &Daemon, key: &str, id: &str, cmd: &[&str]) -> String {
    let argv: Vec<String> = [
        "setpriv",
        "--reuid=1000",
        "--regid=1000",
        "--clear-groups",
        "--",
    ]
    .iter()
    .chain(cmd)
    .map(|s| s.to_string())
    .collect();
    let r = torpor_api::Client::new(&d.url(), key)
        .exec(
            id,
            &torpor_api::types::ExecBody {
                cmd: argv,
                timeout_ms: Some(60_000),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    r.stdout.trim().to_string()
}

/// E2B's `base` across daemon restarts: its sandboxes keep `user`'s sudo (broker and agent
/// directory restored), and a changed `--e2b-egress-ceiling` is applied once no sandbox uses
/// the `base` built under the former one.
#[tokio::test(flavor = "multi_thread")]
async fn e2bs_base_survives_restarts_and_takes_a_new_ceiling_once_free() {
    let mut d = Daemon::start().await;
    let key = tenant(&d, "restart-a").await;
    let e = E2b::of(&d, key.clone());
    let (status, v) = e
        .call(reqwest::Method::POST, "/sandboxes", Some(json!({})))
        .await;
    assert_eq!(status, 201, "{v}");
    let id = v["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(as_user(&d, &key, &id, &["sudo", "whoami"]).await, "root");
    let wide = json!({"network": {"allowOut": ["0.0.0.0/0"]}});

    // A restart with a full ceiling: the sandbox still sudoes; base is in use, so it keeps
    // its former ceiling (ingress only) and a wide request is still refused.
    d.stop();
    d.extra_args = vec!["--e2b-egress-ceiling".into(), "full".into()];
    d.spawn().await;
    assert_eq!(as_user(&d, &key, &id, &["sudo", "whoami"]).await, "root");
    let (status, v) = e
        .call(reqwest::Method::POST, "/sandboxes", Some(wide.clone()))
        .await;
    assert_error(status, &v, 400);
    assert!(
        d.log().contains("keeps its former egress ceiling"),
        "{}",
        d.log()
    );

    // Once its sandboxes are gone, the next create rebuilds base under the new ceiling.
    let (status, v) = e
        .call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!(status, 204, "{v}");
    let (status, v) = e
        .call(reqwest::Method::POST, "/sandboxes", Some(wide))
        .await;
    assert_eq!(status, 201, "{v}");
    let id = v["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(as_user(&d, &key, &id, &["sudo", "whoami"]).await, "root");
    assert!(
        d.log()
            .contains("rebuilding E2B's base template under the new egress ceiling"),
        "{}",
        d.log()
    );
}

/// E2B's metrics are sampled every 5 s in the background, by a call that is not activity: a
/// sandbox whose template freezes it after 8 idle seconds still freezes (a sampler that
/// counted as activity would keep it running forever), its background samples are kept, and
/// a frozen or sleeping sandbox is not sampled.
#[tokio::test(flavor = "multi_thread")]
async fn background_metrics_samples_do_not_keep_a_sandbox_awake() {
    let d = Daemon::start().await;
    let c = d.client();
    let idle = torpor_core::IdlePolicy {
        freeze_after_s: Some(8.0),
        park_after_s: None,
        suspend_after_s: None,
    };
    c.create_template(&agent_template("mx", idle))
        .await
        .unwrap();
    let api = E2b::of(&d, d.token());
    use reqwest::Method as M;
    let (s, sbx) = api
        .call(
            M::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "mx", "timeout": 600})),
        )
        .await;
    assert_eq!(s, 201, "{sbx}");
    let id = sbx["sandboxID"].as_str().unwrap().to_string();
    // Nothing calls it from now on: only the sampler looks at it.
    let start = Instant::now();
    loop {
        let tier = c.sandbox(&id).await.unwrap().tier;
        if tier == "frozen" {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "still {tier} after 90 s: the sampler keeps it awake"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Asked while it is frozen (no sample is taken then): the series holds what the sampler
    // took while it ran, and nothing since it froze.
    let (s, m) = api
        .call(M::GET, &format!("/sandboxes/{id}/metrics"), None)
        .await;
    assert_eq!(s, 200, "{m}");
    let n = m.as_array().unwrap().len();
    assert!(n >= 1, "background samples before the freeze: {m}");
    tokio::time::sleep(Duration::from_secs(11)).await;
    let (_, again) = api
        .call(M::GET, &format!("/sandboxes/{id}/metrics"), None)
        .await;
    assert_eq!(
        again.as_array().unwrap().len(),
        n,
        "a frozen sandbox is not sampled: {again}"
    );
    assert_eq!(c.sandbox(&id).await.unwrap().tier, "frozen");
}

/// Metrics samples are kept in the state store: a restart of the daemon keeps the series, and
/// `start`/`end` select within it.
#[tokio::test(flavor = "multi_thread")]
async fn metrics_samples_survive_a_daemon_restart() {
    let mut d = Daemon::start().await;
    let c = d.client();
    c.create_template(&agent_template("ms", no_idle()))
        .await
        .unwrap();
    let api = |d: &Daemon| E2b::of(d, d.token());
    use reqwest::Method as M;
    let (s, sbx) = api(&d)
        .call(
            M::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "ms", "timeout": 600})),
        )
        .await;
    assert_eq!(s, 201, "{sbx}");
    let id = sbx["sandboxID"].as_str().unwrap().to_string();
    // Asked while it runs: a sample is taken then.
    let (s, m) = api(&d)
        .call(M::GET, &format!("/sandboxes/{id}/metrics"), None)
        .await;
    assert_eq!(s, 200, "{m}");
    let first = m.as_array().unwrap().last().cloned().expect("a sample");
    let t = first["timestampUnix"].as_i64().unwrap();
    assert!(first["memTotal"].as_u64().unwrap() > 0, "{first}");
    d.stop();
    d.spawn().await;
    let (s, m) = api(&d)
        .call(
            M::GET,
            &format!("/sandboxes/{id}/metrics?start={t}&end={t}"),
            None,
        )
        .await;
    assert_eq!(s, 200, "{m}");
    let kept = m.as_array().unwrap();
    assert!(
        kept.contains(&first),
        "the sample from before the restart: {m}"
    );
    assert!(kept.iter().all(|x| x["timestampUnix"] == t), "{m}");
    let (s, m) = api(&d)
        .call(
            M::GET,
            &format!("/sandboxes/{id}/metrics?end={}", t - 1),
            None,
        )
        .await;
    assert_eq!((s, m.as_array().map(Vec::len)), (200, Some(0)), "{m}");
}

/// A sandbox whose agent predates inotify watches (protocol 4: restored from an older torpor's
/// snapshot) is never sent a watch request it could not parse: its watches are polled
/// snapshots as before (a rename is a create of the new name, no chmod events).
#[tokio::test(flavor = "multi_thread")]
async fn an_agent_that_predates_inotify_watches_is_polled_as_before() {
    let d = Daemon::start().await;
    let c = d.client();
    c.create_template(&older_agent_template("wv4", no_idle(), 4))
        .await
        .unwrap();
    let api = E2b::of(&d, d.token());
    let (id, token) = api
        .create(json!({"templateID": "wv4", "timeout": 600}))
        .await;
    c.exec(&id, &sh("mkdir -p /tmp/wv")).await.unwrap();
    let unary = |method: &'static str, body: Value| api.filesystem(&id, &token, method, body);
    let w = unary("CreateWatcher", json!({"path": "/tmp/wv"})).await;
    let watcher = w["watcherId"].as_str().unwrap().to_string();
    c.exec(
        &id,
        &sh("touch /tmp/wv/a && sleep 0.5 && chmod 600 /tmp/wv/a && mv /tmp/wv/a /tmp/wv/b"),
    )
    .await
    .unwrap();
    let mut events: Vec<(String, String)> = Vec::new();
    let start = Instant::now();
    while !events.iter().any(|(_, n)| n == "b") && start.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let got = unary("GetWatcherEvents", json!({"watcherId": watcher})).await;
        for e in got["events"].as_array().unwrap() {
            events.push((
                e["type"].as_str().unwrap().to_string(),
                e["name"].as_str().unwrap().to_string(),
            ));
        }
    }
    let has = |t: &str, n: &str| events.iter().any(|e| e.0 == t && e.1 == n);
    assert!(has("EVENT_TYPE_CREATE", "a"), "{events:?}");
    assert!(has("EVENT_TYPE_CREATE", "b"), "{events:?}");
    assert!(
        has("EVENT_TYPE_REMOVE", "a"),
        "polled: a rename is a remove and a create {events:?}"
    );
    assert!(
        !events
            .iter()
            .any(|e| e.0 == "EVENT_TYPE_RENAME" || e.0 == "EVENT_TYPE_CHMOD"),
        "{events:?}"
    );
}

/// Protocol 6: an E2B process's first wait rides on its `Spawn` where the agent can follow it;
/// protocol 7: the agent holds its `Spawned` back for a command that may end soon (protocol 6's
/// is held by the engine). An agent that predates either (a sandbox restored from an older
/// snapshot) is never sent a `Spawn` it could not parse (it would not answer, and the adapter
/// would fall back to the supervisor shell after 3 s): all run a process with its output, exit
/// and stream framing the same, a short one answered whole where the agent follows it, and a
/// long one's start event comes while it runs.
#[tokio::test(flavor = "multi_thread")]
async fn e2b_processes_run_alike_on_agents_with_and_without_followed_spawns() {
    let d = Daemon::start().await;
    let c = d.client();
    c.create_template(&older_agent_template("sv5", no_idle(), 5))
        .await
        .unwrap();
    c.create_template(&older_agent_template("sv6", no_idle(), 6))
        .await
        .unwrap();
    c.create_template(&agent_template("sv7", no_idle()))
        .await
        .unwrap();
    let api = E2b::of(&d, d.token());
    use base64::Engine as _;
    let b64 = |v: &Value| {
        base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap())
            .unwrap()
    };
    for template in ["sv5", "sv6", "sv7"] {
        let (id, token) = api
            .create(json!({"templateID": template, "timeout": 600}))
            .await;
        let start = |script: &str| {
            let req = json!({"process": {"cmd": "/bin/sh", "args": ["-c", script]}});
            api.envd("/process.Process/Start", &id, &token)
                .header("Content-Type", "application/connect+json")
                .body(envelope(0, req.to_string().as_bytes()))
                .send()
        };
        // Short, with output on both streams; then more output than a `Progress` carries.
        let big = torpor_runtime::proto::SPAWN_FOLLOW_OUTPUT as usize * 2 + 7;
        let runs = [
            (
                "echo out; echo err >&2; exit 7".to_string(),
                7,
                b"out\n".to_vec(),
            ),
            (
                format!("head -c {big} /dev/zero; exit 0"),
                0,
                vec![0u8; big],
            ),
        ];
        for (script, code, want_out) in runs {
            let t = Instant::now();
            let resp = start(&script).await.unwrap();
            assert_eq!(resp.status().as_u16(), 200, "{template}");
            let f = frames(&resp.bytes().await.unwrap());
            assert!(
                f[0].1["event"]["start"]["pid"].as_u64().unwrap() > 0,
                "{template}"
            );
            let (mut out, mut err) = (Vec::new(), Vec::new());
            for (_, m) in &f[1..f.len() - 2] {
                let data = &m["event"]["data"];
                if !data["stdout"].is_null() {
                    out.extend(b64(&data["stdout"]));
                }
                if !data["stderr"].is_null() {
                    err.extend(b64(&data["stderr"]));
                }
            }
            assert!(out == want_out, "{template}: {} bytes of stdout", out.len());
            if code == 7 {
                assert_eq!(err, b"err\n", "{template}");
            }
            assert_eq!(
                f[f.len() - 2].1["event"]["end"]["exitCode"],
                code,
                "{template}"
            );
            assert_eq!(
                f[f.len() - 1],
                (2, json!({})),
                "{template}: end-of-stream frame"
            );
            eprintln!("{template}: {} ms", t.elapsed().as_millis());
        }
        // A command that ends at once is answered whole (one body with its length, as a native
        // exec) where the agent follows it; a few tries, as one may outlast the hold on a
        // loaded machine. Streamed for an agent that does not follow.
        let mut whole = false;
        for _ in 0..5 {
            let resp = start("exit 0").await.unwrap();
            whole = resp.content_length().is_some();
            let f = frames(&resp.bytes().await.unwrap());
            assert_eq!(f[1].1["event"]["end"]["exitCode"], 0, "{template}: {f:?}");
            if whole {
                break;
            }
        }
        assert_eq!(whole, template != "sv5", "{template}: answered whole");
        // A command that runs on: its start event comes while it runs (it ends only once the
        // test has seen the event), its output and end after.
        let mut resp = start("while [ ! -e /tmp/go ]; do sleep 0.02; done; echo late")
            .await
            .unwrap();
        let mut seen = tokio::time::timeout(Duration::from_secs(30), resp.chunk())
            .await
            .expect("the start event while the command runs")
            .unwrap()
            .unwrap()
            .to_vec();
        assert!(
            frames(&seen)[0].1["event"]["start"]["pid"]
                .as_u64()
                .is_some(),
            "{template}"
        );
        c.exec(&id, &sh("touch /tmp/go")).await.unwrap();
        seen.extend(resp.bytes().await.unwrap());
        let f = frames(&seen);
        assert_eq!(
            b64(&f[1].1["event"]["data"]["stdout"]),
            b"late\n",
            "{template}: {f:?}"
        );
        assert_eq!(f[2].1["event"]["end"]["exitCode"], 0, "{template}: {f:?}");
    }
    let log = d.log();
    assert!(
        !log.contains("agent without Spawn"),
        "an agent was sent a request it could not parse and the adapter fell back:\n{log}"
    );
}

/// Polling a watcher (`GetWatcherEvents`) never wakes a sleeping sandbox: nothing changes in
/// its files while it sleeps, so the poll answers what is buffered (nothing here) and the
/// sandbox stays asleep, whether torpor put it to sleep or E2B paused it with auto-resume
/// (which any other call still resumes). What the agent queued before the sleep comes at the
/// first poll once it runs again.
#[tokio::test(flavor = "multi_thread")]
async fn polling_a_watcher_leaves_a_sleeping_sandbox_asleep() {
    polled_watcher_leaves_the_sandbox_asleep(None).await;
}

/// The same with an agent that predates inotify watches (protocol 4): its watcher is polled
/// snapshots, by a background poller that runs only while the sandbox does, and the client's
/// polls of a sleeping sandbox neither wake it nor reach its agent.
#[tokio::test(flavor = "multi_thread")]
async fn polling_an_older_agents_watcher_leaves_its_sleeping_sandbox_asleep() {
    polled_watcher_leaves_the_sandbox_asleep(Some("4")).await;
}

async fn polled_watcher_leaves_the_sandbox_asleep(agent_version: Option<&str>) {
    let d = Daemon::start().await;
    let c = d.client();
    let mut spec = agent_template("wp", no_idle());
    if let Some(v) = agent_version {
        spec.env = [(
            torpor_runtime::agent::TEST_AGENT_VERSION.to_string(),
            v.to_string(),
        )]
        .into();
    }
    c.create_template(&spec).await.unwrap();
    let api = E2b::of(&d, d.token());
    let (id, token) = api
        .create(json!({"templateID": "wp", "timeout": 600, "autoResume": {"enabled": true}}))
        .await;
    c.exec(&id, &sh("mkdir -p /tmp/wp")).await.unwrap();
    let unary = |method: &'static str, body: Value| api.filesystem(&id, &token, method, body);
    let w = unary("CreateWatcher", json!({"path": "/tmp/wp"})).await;
    let watcher = json!({"watcherId": w["watcherId"]});
    // A change the client has not asked for yet when the sandbox goes to sleep.
    c.exec(&id, &sh("touch /tmp/wp/before")).await.unwrap();
    let names = |v: &Value| -> Vec<String> {
        v["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap().to_string())
            .collect()
    };

    // A polled watcher (older agent) buffers what its poller saw here, in the daemon: that
    // may be handed out while the sandbox sleeps. An inotify watch's events wait in the agent.
    let polled = agent_version.is_some();
    if polled {
        // Its poller's next look (every WATCH_POLL while the sandbox runs) sees the change.
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    let mut before = Vec::new();

    // Put to sleep by torpor (parked): polled, still parked, nothing new to hand out.
    c.suspend(&id, Some(torpor_core::Tier::Parked))
        .await
        .unwrap();
    for _ in 0..3 {
        let got = unary("GetWatcherEvents", watcher.clone()).await;
        if polled {
            before.extend(names(&got));
        } else {
            assert_eq!(got["events"], json!([]), "{got}");
        }
        assert_eq!(c.sandbox(&id).await.unwrap().tier, "parked");
    }
    // Woken by another call: the change made before the sleep comes now (if not already).
    c.resume(&id).await.unwrap();
    let got = unary("GetWatcherEvents", watcher.clone()).await;
    before.extend(names(&got));
    assert!(
        !before.is_empty() && before.iter().all(|n| n == "before"),
        "{before:?}"
    );

    // Paused through E2B, with auto-resume: the poll does not resume it.
    let (s, v) = api
        .call(
            reqwest::Method::POST,
            &format!("/sandboxes/{id}/pause"),
            None,
        )
        .await;
    assert_eq!(s, 204, "{v}");
    for _ in 0..3 {
        let got = unary("GetWatcherEvents", watcher.clone()).await;
        assert_eq!(got["events"], json!([]), "{got}");
        assert_eq!(c.sandbox(&id).await.unwrap().tier, "parked");
        let (_, info) = api
            .call(reqwest::Method::GET, &format!("/sandboxes/{id}"), None)
            .await;
        assert_eq!(info["state"], "paused", "{info}");
    }
    // Any other envd call resumes it, as on E2B; the watch goes on.
    unary("Stat", json!({"path": "/tmp/wp"})).await;
    assert_eq!(c.sandbox(&id).await.unwrap().tier, "running");
    c.exec(&id, &sh("touch /tmp/wp/after")).await.unwrap();
    // (A polled watcher sees it at its next look, within a poll interval.)
    let mut seen = Vec::new();
    let start = Instant::now();
    while !seen.contains(&"after".to_string()) && start.elapsed() < Duration::from_secs(10) {
        let got = unary("GetWatcherEvents", watcher.clone()).await;
        seen.extend(names(&got));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(seen.contains(&"after".to_string()), "{seen:?}");
}
