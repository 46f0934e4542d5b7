//! Tenants: tokens, isolation (another tenant's sandbox answers 404), quotas (429 with what was
//! exceeded), and quota races (two creates at the last unit: exactly one wins).

mod common;

use common::*;
use torpor_api::types::{CreateSandboxBody, CreateTenantBody, Quotas};
use torpor_api::Client;
use torpor_core::Tier;

#[tokio::test(flavor = "multi_thread")]
async fn tenants_are_isolated_and_held_to_their_quotas() {
    let d = Daemon::start().await;
    let admin = d.client();
    let a = admin
        .create_tenant(&CreateTenantBody {
            name: "team-a".into(),
            quotas: Some(Quotas {
                max_sandboxes: Some(2),
                max_running: Some(1),
                max_memory_mib: None,
                ..Default::default()
            }),
        })
        .await
        .unwrap();
    let b = admin
        .create_tenant(&CreateTenantBody {
            name: "team-b".into(),
            quotas: None,
        })
        .await
        .unwrap();
    assert!(a.token.starts_with("tpr_team-a_"));
    let ca = Client::new(&d.url(), &a.token);
    let cb = Client::new(&d.url(), &b.token);

    // Isolation: b cannot see, touch or learn of a's sandbox.
    let sa = create(&ca, "host").await;
    for err in [
        cb.sandbox(&sa).await.unwrap_err(),
        cb.exec(&sa, &sh("true")).await.unwrap_err(),
        cb.delete_sandbox(&sa).await.unwrap_err(),
        cb.read_file(&sa, "/etc/passwd").await.unwrap_err(),
    ] {
        assert_eq!(err.code(), Some("not_found"), "{err}");
    }
    assert!(cb.sandboxes(None).await.unwrap().is_empty());
    assert_eq!(ca.sandboxes(None).await.unwrap().len(), 1);
    assert_eq!(admin.sandboxes(None).await.unwrap().len(), 1);
    // Only the operator manages tenants.
    assert_eq!(ca.tenants().await.unwrap_err().code(), Some("forbidden"));

    // Quotas: one running at a time.
    let err = ca
        .create_sandbox(&CreateSandboxBody {
            template: "host".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("quota_exceeded"), "{err}");
    assert!(err.to_string().contains("running"), "{err}");
    ca.suspend(&sa, Some(Tier::Parked)).await.unwrap();
    let sa2 = create(&ca, "host").await;
    // Waking the first while the second runs is over the running quota too.
    let err = ca.exec(&sa, &sh("true")).await.unwrap_err();
    assert_eq!(err.code(), Some("quota_exceeded"), "{err}");
    assert_eq!(
        ca.sandbox(&sa).await.unwrap().state,
        "parked",
        "a refused wake changes nothing"
    );
    ca.suspend(&sa2, Some(Tier::Parked)).await.unwrap();
    // Two sandboxes at most.
    let err = ca
        .create_sandbox(&CreateSandboxBody {
            template: "host".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("quota_exceeded"));
    assert!(err.to_string().contains("sandboxes"), "{err}");
    assert_eq!(ca.exec(&sa, &sh("echo ok")).await.unwrap().stdout, "ok\n");

    // A tenant that owns sandboxes cannot be deleted.
    assert_eq!(
        admin.delete_tenant("team-a").await.unwrap_err().code(),
        Some("tenant_in_use")
    );
    ca.delete_sandbox(&sa).await.unwrap();
    ca.delete_sandbox(&sa2).await.unwrap();
    admin.delete_tenant("team-a").await.unwrap();
    assert_eq!(
        ca.sandboxes(None).await.unwrap_err().code(),
        Some("unauthorized"),
        "a deleted tenant's token stops working"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn two_creates_at_the_last_unit_of_quota_exactly_one_wins() {
    let d = Daemon::start().await;
    let admin = d.client();
    for round in 0..3 {
        let t = admin
            .create_tenant(&CreateTenantBody {
                name: format!("race-{round}"),
                quotas: Some(Quotas {
                    max_sandboxes: Some(1),
                    ..Default::default()
                }),
            })
            .await
            .unwrap();
        let c = Client::new(&d.url(), &t.token);
        let body = CreateSandboxBody {
            template: "host".into(),
            ..Default::default()
        };
        let (x, y) = tokio::join!(c.create_sandbox(&body), c.create_sandbox(&body));
        let wins = [&x, &y].iter().filter(|r| r.is_ok()).count();
        assert_eq!(wins, 1, "round {round}: {x:?} {y:?}");
        let loser = if x.is_err() { x } else { y };
        assert_eq!(loser.unwrap_err().code(), Some("quota_exceeded"));
        assert_eq!(c.sandboxes(None).await.unwrap().len(), 1);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn cli_prints_a_new_tenant_token_once_as_json() {
    let d = Daemon::start().await;
    let out = std::process::Command::new(BIN)
        .args(["tenant", "create", "cli-team", "--json", "--url", &d.url()])
        .env("TORPOR_TOKEN", d.token())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["name"], "cli-team");
    let token = v["token"].as_str().unwrap();
    assert!(Client::new(&d.url(), token)
        .sandboxes(None)
        .await
        .unwrap()
        .is_empty());
    let listed = d.client().tenants().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert!(
        !serde_json::to_string(&listed).unwrap().contains(token),
        "tokens are never shown again"
    );
}
