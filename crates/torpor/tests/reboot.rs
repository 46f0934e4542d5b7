//! Filesystem-only pauses (E2B's `keep_memory=False`) as torpor's own API sees them: the pause
//! is asked for through E2B's route, and the next wake by any v1 call reboots the sandbox (its
//! processes killed, the template's main process started again, a new boot id) while its files
//! are kept; memory pauses (v1 suspend) keep processes and boot id. Real daemon, real runsc.

mod common;

use common::*;
use torpor_api::ClientError;
use torpor_core::Tier;

const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

async fn boot_id(c: &torpor_api::Client, id: &str) -> String {
    let b = c.read_file(id, BOOT_ID).await.unwrap();
    let b = String::from_utf8(b).unwrap();
    assert!(b.ends_with('\n'), "{b:?}");
    let b = b.trim().to_string();
    assert_eq!(b.len(), 36, "{b:?}");
    assert_eq!(b.matches('-').count(), 4, "{b:?}");
    b
}

/// Whether `pid` is a process of the sandbox.
async fn alive(c: &torpor_api::Client, id: &str, pid: &str) -> bool {
    let r = c
        .exec(
            id,
            &sh(&format!("kill -0 {pid} && echo alive || echo gone")),
        )
        .await
        .unwrap();
    r.stdout.trim() == "alive"
}

/// E2B's `POST /sandboxes/{id}/pause` with `{"memory": false}` (what `pause(keep_memory=False)`
/// sends).
async fn pause_without_memory(d: &Daemon, id: &str) {
    let r = reqwest::Client::new()
        .post(format!("{}/sandboxes/{id}/pause", d.url()))
        .header("X-API-KEY", d.token())
        .json(&serde_json::json!({"memory": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204, "{}", r.text().await.unwrap_or_default());
}

/// E2B's `GET /sandboxes/{id}` (what `get_info` reads).
async fn e2b_detail(d: &Daemon, id: &str) -> serde_json::Value {
    let r = reqwest::Client::new()
        .get(format!("{}/sandboxes/{id}", d.url()))
        .header("X-API-KEY", d.token())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// E2B's `POST /sandboxes/{id}/connect` with `{"memory": false}` (`on_resume="reboot"`):
/// answers its status (200: it was running, 201: woken).
async fn e2b_connect(d: &Daemon, id: &str) -> u16 {
    let r = reqwest::Client::new()
        .post(format!("{}/sandboxes/{id}/connect", d.url()))
        .header("X-API-KEY", d.token())
        .json(&serde_json::json!({"timeout": 600, "memory": false}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    assert!(
        status == 200 || status == 201,
        "{status} {}",
        r.text().await.unwrap_or_default()
    );
    status
}

#[tokio::test(flavor = "multi_thread")]
async fn a_filesystem_only_pause_reboots_the_sandbox_at_its_next_v1_call() {
    let d = Daemon::start().await;
    let c = d.client();
    c.create_template(&agent_template("rb", no_idle()))
        .await
        .unwrap();
    let id = create(&c, "rb").await;
    let other = create(&c, "rb").await;
    assert_eq!(call_agent(&c, &id, "a").await, (1, 1));
    assert_eq!(call_agent(&c, &id, "b").await, (2, 2));
    let boot0 = boot_id(&c, &id).await;
    assert_eq!(boot_id(&c, &id).await, boot0, "stable while it runs");
    assert_ne!(
        boot_id(&c, &other).await,
        boot0,
        "two sandboxes made from one template snapshot are two boots"
    );
    let r = c
        .exec(
            &id,
            &sh("echo kept > /data/kept.txt && echo tmp > /tmp/kept.txt; \
                 sleep 600 >/dev/null 2>&1 & echo $!"),
        )
        .await
        .unwrap();
    let bg = r.stdout.split_whitespace().next().unwrap().to_string();
    assert!(alive(&c, &id, &bg).await);

    // A memory pause (torpor's park) keeps everything.
    c.suspend(&id, Some(Tier::Parked)).await.unwrap();
    assert_eq!(call_agent(&c, &id, "c").await, (3, 3));
    assert_eq!(boot_id(&c, &id).await, boot0);
    assert!(alive(&c, &id, &bg).await, "a memory pause keeps processes");

    // A filesystem-only pause: parked now, rebooted at the next call.
    pause_without_memory(&d, &id).await;
    let s = c.sandbox(&id).await.unwrap();
    assert_eq!(s.tier, "parked", "{s:?}");
    // E2B's detail says what the pause kept; torpor's own does not show the mark.
    let detail = e2b_detail(&d, &id).await;
    assert_eq!(
        (&detail["state"], &detail["pauseMode"]),
        (&"paused".into(), &"filesystem".into()),
        "{detail}"
    );
    assert!(
        !s.metadata.keys().any(|k| k.starts_with("torpor.wake.")),
        "{s:?}"
    );
    // The main process is a new one (its in-memory counter starts over) and finds its
    // files (its log has every line).
    assert_eq!(call_agent(&c, &id, "d").await, (1, 4));
    assert!(!alive(&c, &id, &bg).await, "the reboot killed the process");
    let boot1 = boot_id(&c, &id).await;
    assert_ne!(boot1, boot0, "a reboot is a new boot");
    assert_eq!(c.read_file(&id, "/data/kept.txt").await.unwrap(), b"kept\n");
    assert_eq!(c.read_file(&id, "/tmp/kept.txt").await.unwrap(), b"tmp\n");
    // Woken by a v1 call, it is running again to E2B (as after a connect, with a new deadline
    // of its timeout: 300 s by default), so E2B's next pause is a pause (204), not 409.
    let detail = e2b_detail(&d, &id).await;
    assert_eq!(detail["state"], "running", "{detail}");
    assert!(detail["pauseMode"].is_null(), "{detail}");
    let end_at = humantime::parse_rfc3339_weak(detail["endAt"].as_str().unwrap()).unwrap();
    let left = end_at
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default()
        .as_millis();
    assert!((200_000..=300_000).contains(&left), "{detail}");

    // The reboot was used up: a later memory pause keeps memory again.
    c.suspend(&id, Some(Tier::Parked)).await.unwrap();
    assert_eq!(call_agent(&c, &id, "e").await, (2, 5));
    assert_eq!(boot_id(&c, &id).await, boot1);
    // Through the store too (suspended: uploaded, fetched back at the wake). E2B's connect of
    // a resident sandbox wakes nothing and reboots nothing.
    assert_eq!(e2b_connect(&d, &id).await, 200);
    assert_eq!(call_agent(&c, &id, "f").await, (3, 6));
    pause_without_memory(&d, &id).await;
    c.suspend(&id, Some(Tier::Suspended)).await.unwrap();
    assert_eq!(call_agent(&c, &id, "g").await, (1, 7));
    assert_ne!(boot_id(&c, &id).await, boot1);
    // The other sandbox was never touched.
    assert_eq!(call_agent(&c, &other, "x").await, (1, 1));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_agent_that_predates_reboots_is_not_asked_and_the_caller_is_told() {
    let d = Daemon::start().await;
    let c = d.client();
    c.create_template(&older_agent_template("rb-v3", no_idle(), 3))
        .await
        .unwrap();
    let id = create(&c, "rb-v3").await;
    assert_eq!(call_agent(&c, &id, "a").await, (1, 1));
    pause_without_memory(&d, &id).await;
    // Were the agent sent the request, it would never answer it and this call would hang.
    let err = c.exec(&id, &sh("true")).await.unwrap_err();
    match &err {
        ClientError::Api {
            status,
            code,
            message,
            ..
        } => {
            assert_eq!((*status, code.as_str()), (400, "unsupported"), "{err}");
            assert!(message.contains("predates reboots"), "{message}");
            assert!(!message.contains(&d.dir.display().to_string()), "{message}");
        }
        other => panic!("{other:?}"),
    }
    // Woken with its memory: the same main process goes on.
    assert_eq!(call_agent(&c, &id, "b").await, (2, 2));
}

#[tokio::test(flavor = "multi_thread")]
async fn another_tenant_cannot_make_a_sandbox_reboot() {
    let d = Daemon::start().await;
    let admin = d.client();
    admin
        .create_template(&agent_template("rb-shared", no_idle()))
        .await
        .unwrap();
    let token = |name: &'static str| {
        let admin = d.client();
        async move {
            admin
                .create_tenant(&torpor_api::types::CreateTenantBody {
                    name: name.into(),
                    quotas: None,
                })
                .await
                .unwrap()
                .token
        }
    };
    let (a, b) = (token("rb-a").await, token("rb-b").await);
    let ca = torpor_api::Client::new(&d.url(), &a);
    let id = create(&ca, "rb-shared").await;
    assert_eq!(call_agent(&ca, &id, "a").await, (1, 1));
    let boot = boot_id(&ca, &id).await;
    // Tenant B names A's sandbox in a filesystem-only pause and a rebooting connect.
    let http = reqwest::Client::new();
    for route in ["pause", "connect"] {
        let r = http
            .post(format!("{}/sandboxes/{id}/{route}", d.url()))
            .header("X-API-KEY", &b)
            .json(&serde_json::json!({"memory": false}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "{route}");
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["code"], 404, "{route}: {body}");
    }
    // A's sandbox was not paused nor marked: a memory park and a wake keep everything.
    ca.suspend(&id, Some(Tier::Parked)).await.unwrap();
    assert_eq!(call_agent(&ca, &id, "b").await, (2, 2));
    assert_eq!(boot_id(&ca, &id).await, boot);
    // B still works on its own.
    let cb = torpor_api::Client::new(&d.url(), &b);
    let own = create(&cb, "rb-shared").await;
    assert_eq!(call_agent(&cb, &own, "x").await, (1, 1));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_cannot_forge_or_read_the_marks_of_a_wake() {
    let d = Daemon::start().await;
    let admin = d.client();
    admin
        .create_template(&agent_template("rb-forge", no_idle()))
        .await
        .unwrap();
    let a = admin
        .create_tenant(&torpor_api::types::CreateTenantBody {
            name: "rb-forger".into(),
            quotas: None,
        })
        .await
        .unwrap()
        .token;
    let ca = torpor_api::Client::new(&d.url(), &a);
    let http = reqwest::Client::new();
    // The marks a wake obeys, set by the tenant at create (torpor's API and E2B's) or looked
    // for in a list: all refused, nothing made.
    let forged = [
        "torpor.wake.reboot",
        "torpor.wake.unset.app",
        "torpor.wake.in_ms.app",
        // E2B's own state (its pause mark, its deadline): reserved as well.
        "torpor.e2b.paused",
        "torpor.e2b.end_at",
    ];
    for key in forged {
        let r = http
            .post(format!("{}/v1/sandboxes", d.url()))
            .bearer_auth(&a)
            .json(&serde_json::json!({"template": "rb-forge", "metadata": {key: "1"}}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{key}");
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "invalid_request", "{key}: {body}");
        let r = http
            .post(format!("{}/sandboxes", d.url()))
            .header("X-API-KEY", &a)
            .json(&serde_json::json!({"templateID": "rb-forge", "metadata": {key: "1"}}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{key}");
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["code"], 400, "{key}: {body}");
        let r = http
            .get(format!("{}/v2/sandboxes", d.url()))
            .query(&[("metadata", format!("{key}=1"))])
            .header("X-API-KEY", &a)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{key}");
    }
    assert!(ca.sandboxes(None).await.unwrap().is_empty());
    // A filesystem-only pause of its own sandbox marks it, unseen by the tenant in both APIs.
    let id = create(&ca, "rb-forge").await;
    assert_eq!(call_agent(&ca, &id, "a").await, (1, 1));
    let r = http
        .post(format!("{}/sandboxes/{id}/pause", d.url()))
        .header("X-API-KEY", &a)
        .json(&serde_json::json!({"memory": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let own = ca.sandbox(&id).await.unwrap();
    assert!(
        !own.metadata.keys().any(|k| k.starts_with("torpor.wake.")),
        "{own:?}"
    );
    let listed = ca.sandboxes(None).await.unwrap();
    assert!(
        listed
            .iter()
            .all(|s| !s.metadata.keys().any(|k| k.starts_with("torpor.wake."))),
        "{listed:?}"
    );
    let detail: serde_json::Value = http
        .get(format!("{}/sandboxes/{id}", d.url()))
        .header("X-API-KEY", &a)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(detail["pauseMode"], "filesystem", "{detail}");
    assert_eq!(detail["metadata"], serde_json::json!({}), "{detail}");
    // The mark does what the engine set it for: the next call reboots.
    assert_eq!(call_agent(&ca, &id, "b").await, (1, 2));
    // Another tenant is untouched.
    let other = create(&admin, "rb-forge").await;
    assert_eq!(call_agent(&admin, &other, "x").await, (1, 1));
}

/// A fork (torpor's own API) of a sandbox whose next wake reboots it starts from that
/// sandbox's memory: the pending reboot is its source's, not the fork's. Nor is the fork
/// paused to E2B (it never was): it is running to E2B, with a deadline of its own.
#[tokio::test(flavor = "multi_thread")]
async fn a_fork_does_not_inherit_its_sources_pending_reboot() {
    let d = Daemon::start().await;
    let c = d.client();
    c.create_template(&agent_template("rb-fork", no_idle()))
        .await
        .unwrap();
    let id = create(&c, "rb-fork").await;
    assert_eq!(call_agent(&c, &id, "a").await, (1, 1));
    pause_without_memory(&d, &id).await;
    let fork = c.fork(&id, 1).await.unwrap().remove(0).id;
    // The fork wakes with its source's memory: the same main process goes on.
    assert_eq!(call_agent(&c, &fork, "b").await, (2, 2));
    let detail = e2b_detail(&d, &fork).await;
    assert_eq!(detail["state"], "running", "{detail}");
    assert!(detail["pauseMode"].is_null(), "{detail}");
    assert!(detail["endAt"].as_str().is_some(), "{detail}");
    let s = c.sandbox(&fork).await.unwrap();
    assert!(
        !s.metadata.keys().any(|k| k.starts_with("torpor.")),
        "{s:?}"
    );
    // The source's own mark stands: its next call reboots it, and only it.
    assert_eq!(e2b_detail(&d, &id).await["pauseMode"], "filesystem");
    assert_eq!(call_agent(&c, &id, "c").await, (1, 2));
    assert_eq!(call_agent(&c, &fork, "d").await, (3, 3));
}
