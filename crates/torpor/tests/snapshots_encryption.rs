//! End-to-end: `torpor up --snapshot-keys DIR` encrypts snapshots at rest with one key per
//! tenant. Two tenants' sandboxes from the same golden snapshot (near-identical memory) share
//! no chunk; a wrong key fails the wake cleanly (stable code, nothing deleted) and the right
//! key restores it.

mod common;

use std::collections::HashSet;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::*;
use torpor_api::types::CreateTenantBody;
use torpor_api::Client;
use torpor_core::Tier;

fn chunk_ids(ns: &Path) -> HashSet<String> {
    let mut out = HashSet::new();
    let Ok(dirs) = std::fs::read_dir(ns.join("chunks")) else {
        return out;
    };
    for d in dirs {
        for f in std::fs::read_dir(d.unwrap().path()).unwrap() {
            out.insert(f.unwrap().file_name().to_string_lossy().into_owned());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn tenants_never_share_chunks_and_a_wrong_key_fails_cleanly() {
    let keys = tempfile::tempdir().unwrap();
    let keys_dir = keys.path().join("keys");
    let mut d = Daemon::start_with(&["--snapshot-keys", keys_dir.to_str().unwrap()]).await;
    let admin = d.client();
    admin
        .create_template(&agent_template("enc", no_idle()))
        .await
        .unwrap();
    let mut sandboxes = Vec::new();
    for name in ["alpha", "beta"] {
        let t = admin
            .create_tenant(&CreateTenantBody {
                name: name.into(),
                quotas: None,
            })
            .await
            .unwrap();
        let c = Client::new(&d.url(), &t.token);
        let id = create(&c, "enc").await;
        assert_eq!(call_agent(&c, &id, "x").await, (1, 1));
        assert_eq!(
            c.suspend(&id, Some(Tier::Suspended)).await.unwrap().state,
            "suspended"
        );
        sandboxes.push((name, c, id));
    }

    // One key per tenant, private; each tenant's objects under its own namespace.
    for name in ["alpha", "beta"] {
        let key = keys_dir.join(format!("{name}.key"));
        let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", key.display());
    }
    let ns = d.dir.join("store").join("tenants");
    let a = chunk_ids(&ns.join("alpha"));
    let b = chunk_ids(&ns.join("beta"));
    assert!(a.len() > 100 && b.len() > 100, "{} {}", a.len(), b.len());
    assert!(
        a.is_disjoint(&b),
        "two tenants restored from one golden snapshot share no chunk id"
    );
    assert!(
        !d.dir.join("store").join("chunks").exists(),
        "nothing outside the tenants' namespaces"
    );
    let (code, out, _) = {
        let o = std::process::Command::new(BIN)
            .args(["snapshot", "stats", "--json"])
            .env("TORPOR_URL", d.url())
            .env("TORPOR_TOKEN", d.token())
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            o.stderr,
        )
    };
    assert_eq!(code, Some(0));
    let stats: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(stats["snapshots"], 2, "{out}");
    assert_eq!(stats["chunks"], (a.len() + b.len()) as u64);

    // A wrong key for alpha: its wake fails with a clear, stable error; nothing is deleted;
    // beta is unaffected.
    let alpha_key = keys_dir.join("alpha.key");
    let good = std::fs::read_to_string(&alpha_key).unwrap();
    d.stop();
    std::fs::write(&alpha_key, "ab".repeat(32)).unwrap();
    d.spawn().await;
    // The daemon restarts on the same port: the clients stay valid.
    let (_, alpha, alpha_id) = &sandboxes[0];
    let e = alpha.resume(alpha_id).await.unwrap_err();
    assert_eq!(e.code(), Some("manifest_sealed"), "{e}");
    assert_eq!(alpha.sandbox(alpha_id).await.unwrap().state, "suspended");
    assert_eq!(chunk_ids(&ns.join("alpha")), a, "nothing deleted");
    let (_, beta, beta_id) = &sandboxes[1];
    assert_eq!(call_agent(beta, beta_id, "y").await, (2, 2));

    // The right key back: alpha wakes with its state.
    d.stop();
    std::fs::write(&alpha_key, good).unwrap();
    d.spawn().await;
    assert_eq!(call_agent(alpha, alpha_id, "z").await, (2, 2));
}
