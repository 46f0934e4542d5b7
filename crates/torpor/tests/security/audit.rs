//! The audit log (`DATA_DIR/audit`): mutating and refused calls are recorded with who made
//! them, secrets never are, and `torpor audit verify` names an edited or removed record while
//! an untouched log verifies across a restart.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use torpor_api::types::{CreateSandboxBody, CreateTenantBody, ExecBody};
use torpor_api::Client;

use crate::common::{self, Daemon, BIN};

/// `torpor audit tail --json` over the daemon's data directory.
fn tail(d: &Daemon) -> Vec<Value> {
    let out = Command::new(BIN)
        .args(["audit", "tail", "-n", "10000", "--json", "--data-dir"])
        .arg(&d.dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Waits until the writer has made `want` durable (it writes in the background).
async fn tail_until(d: &Daemon, want: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let recs = tail(d);
        if want(&recs) {
            return recs;
        }
        assert!(
            Instant::now() < deadline,
            "audit records never came: {recs:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `torpor audit verify --data-dir`: exit code and stdout.
fn verify(dir: &Path) -> (i32, String) {
    let out = Command::new(BIN)
        .args(["audit", "verify", "--data-dir"])
        .arg(dir)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// The call records with this method and route.
fn calls<'a>(recs: &'a [Value], method: &str, route: &str) -> Vec<&'a Value> {
    recs.iter()
        .filter(|r| r["kind"] == "call" && r["method"] == method && r["route"] == route)
        .collect()
}

/// The one call record by `actor` with this method, route and status.
fn one<'a>(recs: &'a [Value], actor: &str, method: &str, route: &str, status: u16) -> &'a Value {
    let found: Vec<_> = calls(recs, method, route)
        .into_iter()
        .filter(|r| r["status"] == status && r["actor"] == actor)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "{actor} {method} {route} {status} in {recs:#?}"
    );
    found[0]
}

/// Every byte the daemon wrote under the audit directory, and its log.
fn everything_written(d: &Daemon) -> String {
    let mut all = d.log();
    for e in std::fs::read_dir(d.dir.join("audit")).unwrap() {
        let p = e.unwrap().path();
        all.push_str(&String::from_utf8_lossy(&std::fs::read(&p).unwrap()));
    }
    all
}

fn random_word() -> String {
    (0..24).map(|_| (b'a' + rand_byte() % 26) as char).collect()
}

fn rand_byte() -> u8 {
    let mut b = [0u8; 1];
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut b)
        .unwrap();
    b[0]
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenants_calls_and_refusals_are_audited_without_its_token_or_env_values() {
    let d = Daemon::start().await;
    let admin = d.client();
    let a = admin
        .create_tenant(&CreateTenantBody {
            name: "audit-a".into(),
            quotas: None,
        })
        .await
        .unwrap();
    let ca = Client::new(&d.url(), &a.token);
    let env_secret = format!("envsecret{}", random_word());
    let exec_secret = format!("execsecret{}", random_word());
    let sa = ca
        .create_sandbox(&CreateSandboxBody {
            template: "host".into(),
            env: BTreeMap::from([("SECRET".to_string(), env_secret.clone())]),
            ..Default::default()
        })
        .await
        .unwrap()
        .id;
    let out = ca
        .exec(
            &sa,
            &ExecBody {
                cmd: vec!["sh".into(), "-c".into(), "echo $SECRET $OTHER".into()],
                env: BTreeMap::from([("OTHER".to_string(), exec_secret.clone())]),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(out.stdout.trim(), format!("{env_secret} {exec_secret}"));
    let s_admin = common::create(&admin, "host").await;

    // Refusals: another tenant's sandbox, a bad token, a bad E2B key, an operator-only route.
    let err = ca.sandbox(&s_admin).await.unwrap_err();
    assert_eq!(err.code(), Some("not_found"));
    let err = Client::new(&d.url(), "tpr_audit-a_not-the-token")
        .sandboxes(None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("unauthorized"));
    let http = reqwest::Client::new();
    let e2b = http
        .post(format!("{}/sandboxes", d.url()))
        .header("x-api-key", "wrong-key")
        .json(&serde_json::json!({"templateID": "base"}))
        .send()
        .await
        .unwrap();
    assert_eq!(e2b.status(), 401);
    assert_eq!(ca.tenants().await.unwrap_err().code(), Some("forbidden"));
    // E2B: a sandbox made with the tenant's key, its envd called with and without its token.
    let sbx = common::e2b_created(&d, &a.token, serde_json::json!({"templateID": "base"})).await;
    let e2b_id = sbx["sandboxID"].as_str().expect("created").to_string();
    let envd_token = sbx["envdAccessToken"].as_str().unwrap().to_string();
    for (token, want) in [(envd_token.as_str(), 200), ("wrong", 401)] {
        let resp = http
            .post(format!("{}/process.Process/List", d.url()))
            .header("E2b-Sandbox-Id", &e2b_id)
            .header("X-Access-Token", token)
            .header("Content-Type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), want);
    }
    // A read that is allowed is not audited.
    assert_eq!(ca.sandboxes(None).await.unwrap().len(), 2);
    // The request id the client got is the record's.
    let del = http
        .delete(format!("{}/v1/sandboxes/{sa}", d.url()))
        .bearer_auth(&a.token)
        .send()
        .await
        .unwrap();
    assert!(del.status().is_success(), "{}", del.status());
    let del_id = del
        .headers()
        .get("x-request-id")
        .expect("every response carries x-request-id")
        .to_str()
        .unwrap()
        .to_string();

    let recs = tail_until(&d, |r| !calls(r, "DELETE", "/v1/sandboxes/{id}").is_empty()).await;

    one(&recs, "admin", "POST", "/v1/tenants", 201);
    one(&recs, "audit-a", "POST", "/v1/sandboxes", 201);
    let r = one(&recs, "audit-a", "POST", "/v1/sandboxes/{id}/exec", 200);
    assert_eq!(
        r["object"],
        serde_json::json!({"kind": "sandbox", "name": sa})
    );
    let r = one(&recs, "audit-a", "GET", "/v1/sandboxes/{id}", 404);
    assert_eq!(r["code"], "not_found");
    assert_eq!(r["object"]["name"], s_admin.as_str());
    let r = one(&recs, "anonymous", "GET", "/v1/sandboxes", 401);
    assert_eq!(r["code"], "unauthorized");
    one(&recs, "anonymous", "POST", "/sandboxes", 401);
    let r = one(&recs, "audit-a", "GET", "/v1/tenants", 403);
    assert_eq!(r["code"], "forbidden");
    one(&recs, "audit-a", "POST", "/sandboxes", 201);
    let r = one(&recs, "audit-a", "POST", "/process.Process/List", 200);
    assert_eq!(r["object"]["name"], e2b_id.as_str());
    let r = one(&recs, "anonymous", "POST", "/process.Process/List", 401);
    assert_eq!(r["code"], "unauthenticated");
    let r = one(&recs, "audit-a", "DELETE", "/v1/sandboxes/{id}", 204);
    assert_eq!(r["request_id"], del_id.as_str());
    assert!(
        !recs
            .iter()
            .any(|r| r["method"] == "GET" && r["status"] == 200),
        "allowed reads are not audited: {recs:#?}"
    );
    for r in &recs {
        let route = r["route"].as_str().unwrap_or("");
        assert!(!route.contains('?'), "no query string: {r}");
    }
    // `tail --tenant` shows that tenant's calls only.
    let out = Command::new(BIN)
        .args(["audit", "tail", "--tenant", "audit-a", "--data-dir"])
        .arg(&d.dir)
        .output()
        .unwrap();
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.lines().count() >= 6, "{table}");
    assert!(
        table.lines().skip(1).all(|l| l.contains("audit-a")),
        "{table}"
    );

    // Nothing secret anywhere the daemon wrote its audit log or its own log.
    let written = everything_written(&d);
    for secret in [&a.token, &env_secret, &exec_secret, &envd_token, &d.token()] {
        assert!(!written.contains(secret.as_str()), "{secret} leaked");
    }
    let (code, text) = verify(&d.dir);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("records checked"), "{text}");
    // The writer's counters are scraped with the rest.
    let metrics = admin.metrics().await.unwrap();
    let written: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("torpor_audit_records_total "))
        .expect("torpor_audit_records_total is served")
        .parse()
        .unwrap();
    assert!(written >= recs.len() as u64, "{written} < {}", recs.len());
    assert!(
        metrics.contains("torpor_audit_dropped_total 0"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_edited_or_removed_audit_record_is_named_by_verify_and_an_untouched_log_survives_a_restart(
) {
    let mut d = Daemon::start().await;
    let admin = d.client();
    for name in ["audit-b", "audit-c", "audit-d"] {
        admin
            .create_tenant(&CreateTenantBody {
                name: name.into(),
                quotas: None,
            })
            .await
            .unwrap();
    }
    tail_until(&d, |r| calls(r, "POST", "/v1/tenants").len() == 3).await;
    d.stop();
    // A clean stop ends the log with a signed checkpoint.
    let before = tail(&d);
    assert_eq!(before.last().unwrap()["kind"], "checkpoint", "{before:#?}");
    let (code, text) = verify(&d.dir);
    assert_eq!(code, 0, "{text}");
    assert!(
        !text.contains("after the signed head"),
        "all signed: {text}"
    );
    assert!(!text.contains("does not end with a checkpoint"), "{text}");

    // After a restart the chain goes on from the checkpoint, and verifies.
    d.spawn().await;
    d.client().delete_tenant("audit-d").await.unwrap();
    let after = tail_until(&d, |r| !calls(r, "DELETE", "/v1/tenants/{name}").is_empty()).await;
    let first_new = &after[before.len()];
    assert_eq!(first_new["prev"], before.last().unwrap()["hash"]);
    assert_eq!(
        first_new["seq"].as_u64().unwrap(),
        before.last().unwrap()["seq"].as_u64().unwrap() + 1
    );
    let (code, text) = verify(&d.dir);
    assert_eq!(code, 0, "{text}");
    // A crash (SIGKILL, no final checkpoint): the next start goes on from what is on disk.
    d.kill();
    d.spawn().await;
    d.client().delete_tenant("audit-c").await.unwrap();
    tail_until(&d, |r| calls(r, "DELETE", "/v1/tenants/{name}").len() == 2).await;
    let (code, text) = verify(&d.dir);
    assert_eq!(code, 0, "{text}");
    d.stop();

    // One record edited (a refusal turned into a success): verify names the file and line.
    let file = d.dir.join("audit").join("audit-000001.jsonl");
    let original = std::fs::read_to_string(&file).unwrap();
    let lines: Vec<&str> = original.lines().collect();
    let (idx, line) = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.contains("\"method\":\"POST\",\"route\":\"/v1/tenants\""))
        .nth(1)
        .expect("the second tenant's create is recorded");
    let mut edited: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    edited[idx] = line.replace("\"status\":201", "\"status\":409");
    assert_ne!(edited[idx], *line);
    std::fs::write(&file, edited.join("\n") + "\n").unwrap();
    let (code, text) = verify(&d.dir);
    assert_ne!(code, 0, "{text}");
    assert!(
        text.contains(&format!("audit-000001.jsonl line {}", idx + 1)),
        "{text}"
    );
    assert!(text.contains("hash mismatch"), "{text}");

    // The same record removed instead.
    let mut removed: Vec<&str> = lines.clone();
    removed.remove(idx);
    std::fs::write(&file, removed.join("\n") + "\n").unwrap();
    let (code, text) = verify(&d.dir);
    assert_ne!(code, 0, "{text}");
    assert!(
        text.contains(&format!("audit-000001.jsonl line {}", idx + 1)) && text.contains("removed"),
        "{text}"
    );

    // Put back as it was: intact again.
    std::fs::write(&file, &original).unwrap();
    let (code, text) = verify(&d.dir);
    assert_eq!(code, 0, "{text}");
}
