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
    let r = http
        .post(format!("{}/sandboxes", d.url()))
        .header("X-API-KEY", &key)
        .json(&json!({"templateID": "e2r", "timeout": 600, "metadata": {"app": "x"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let sbx: Value = r.json().await.unwrap();
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
