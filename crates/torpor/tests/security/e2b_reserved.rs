//! E2B's own metadata (`torpor.e2b.*`: a sandbox's deadline, what its timeout does, its pause
//! mark, auto-resume, its traffic token, a snapshot's holder): only the E2B adapter writes it.
//! A tenant that could set it through torpor's own API would forge E2B's state of its
//! sandboxes: a deadline already past with `on_timeout=kill` (deleted by the timeout sweep), a
//! paused mark (E2B's calls refused), a snapshot holder (hidden from E2B as a sandbox). Real
//! daemon, real runsc sandboxes.

use serde_json::{json, Value};
use torpor_api::types::CreateTenantBody;

use crate::common::*;

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_cannot_forge_e2bs_state_through_torpors_api() {
    let d = Daemon::start().await;
    let admin = d.client();
    admin
        .create_template(&agent_template("e2r", no_idle()))
        .await
        .unwrap();
    let key = admin
        .create_tenant(&CreateTenantBody {
            name: "e2r-forger".into(),
            quotas: None,
        })
        .await
        .unwrap()
        .token;
    let c = torpor_api::Client::new(&d.url(), &key);
    let http = reqwest::Client::new();
    let forged = [
        ("torpor.e2b.end_at", "1"),
        ("torpor.e2b.on_timeout", "kill"),
        ("torpor.e2b.paused", "pause"),
        ("torpor.e2b.auto_resume", "1"),
        ("torpor.e2b.timeout", "86400"),
        ("torpor.e2b.traffic", "public"),
        ("torpor.e2b.snapshot_of", "sb-aaaaaaaaaaaaaaaa"),
    ];
    for (k, v) in forged {
        let r = http
            .post(format!("{}/v1/sandboxes", d.url()))
            .bearer_auth(&key)
            .json(&json!({"template": "e2r", "metadata": {"app": "x", k: v}}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{k}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "invalid_request", "{k}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(k) && message.contains("reserved"),
            "{body}"
        );
    }
    assert!(c.sandboxes(None).await.unwrap().is_empty(), "nothing made");

    // E2B's own create still gives its sandboxes their lifecycle, unseen through torpor's API.
    let sbx = e2b_created(
        &d,
        &key,
        json!({"templateID": "e2r", "timeout": 600, "metadata": {"app": "x"}}),
    )
    .await;
    let id = sbx["sandboxID"].as_str().unwrap().to_string();
    let own = c.sandbox(&id).await.unwrap();
    assert_eq!(
        own.metadata,
        [("app".to_string(), "x".to_string())].into(),
        "{own:?}"
    );
    let detail = |id: String| {
        let (http, url, key) = (http.clone(), d.url(), key.clone());
        async move {
            let r = http
                .get(format!("{url}/sandboxes/{id}"))
                .header("X-API-KEY", &key)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.json::<Value>().await.unwrap()
        }
    };
    let info = detail(id.clone()).await;
    assert_eq!(info["state"], "running", "{info}");
    assert_eq!(info["metadata"], json!({"app": "x"}), "{info}");
    let end_at = humantime::parse_rfc3339_weak(info["endAt"].as_str().unwrap()).unwrap();
    let left = end_at
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default()
        .as_secs();
    assert!((500..=600).contains(&left), "its own deadline: {info}");
    // Its pause is E2B's, and still unseen through torpor's API.
    let r = http
        .post(format!("{}/sandboxes/{id}/pause", d.url()))
        .header("X-API-KEY", &key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(detail(id.clone()).await["state"], "paused");
    let own = c.sandbox(&id).await.unwrap();
    assert_eq!(own.tier, "parked", "{own:?}");
    assert!(
        !own.metadata.keys().any(|k| k.starts_with("torpor.")),
        "{own:?}"
    );
}

/// A private E2B sandbox's traffic token opens its ports to whoever holds it. A fork made
/// through torpor's own API is another sandbox: the source's token must not open the fork's
/// ports (the fork's traffic then needs its tenant's token).
#[tokio::test(flavor = "multi_thread")]
async fn a_sources_traffic_token_does_not_open_a_v1_forks_ports() {
    let d = Daemon::start().await;
    let admin = d.token();
    let http = reqwest::Client::new();
    let (status, sbx) = e2b_post_sandbox(
        &d,
        &admin,
        "/v2/sandboxes",
        json!({"templateID": "base", "network": {"allowPublicTraffic": false}}),
    )
    .await;
    assert_eq!(status, 201, "{sbx}");
    let id = sbx["sandboxID"].as_str().unwrap().to_string();
    let envd = sbx["envdAccessToken"].as_str().unwrap().to_string();
    let traffic = sbx["trafficAccessToken"].as_str().unwrap().to_string();
    e2b_start_process(
        &d,
        &id,
        &envd,
        "python3",
        &["-m", "http.server", "8000", "--directory", "/etc"],
    )
    .await;
    // (status, body) of GET /passwd on port 8000 of `sandbox` by host routing, as `auth`.
    let get = |sandbox: String, auth: (&'static str, String)| {
        let (http, url) = (http.clone(), d.url());
        async move {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            loop {
                let r = http
                    .get(format!("{url}/passwd"))
                    .header("host", format!("8000-{sandbox}.localhost"))
                    .header(auth.0, &auth.1)
                    .send()
                    .await
                    .unwrap();
                let status = r.status().as_u16();
                let text = r.text().await.unwrap();
                // The server may still be starting (the proxy answers 502 until it listens).
                if status != 502 || std::time::Instant::now() > deadline {
                    return (status, text);
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
    };
    let token = |t: &str| ("e2b-traffic-access-token", t.to_string());
    let (status, text) = get(id.clone(), token(&traffic)).await;
    assert_eq!(status, 200, "the source's own token opens it: {text}");
    assert!(text.contains("root:"), "{text}");

    let fork = d.client().fork(&id, 1).await.unwrap().remove(0).id;
    let (status, text) = get(fork.to_string(), token(&traffic)).await;
    assert_eq!(status, 401, "the source's token opened the fork: {text}");
    assert!(!text.contains("root:"), "{text}");
    // The fork's server runs (forked from memory): its tenant's token reaches it.
    let (status, text) = get(
        fork.to_string(),
        ("authorization", format!("Bearer {admin}")),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("root:"), "{text}");
    // And the source keeps its token.
    assert_eq!(get(id.clone(), token(&traffic)).await.0, 200);
}
