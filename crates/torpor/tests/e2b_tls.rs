//! E2B's URLs over HTTPS, end to end: the real daemon with `--tls-listen` and a wildcard
//! certificate from a throwaway CA, and the official, unmodified `e2b` Python SDK told only
//! `E2B_DOMAIN` (tests/e2b_sdk/tls.py): the control plane at `https://api.<domain>`, envd at
//! `https://49983-{id}.<domain>` and a sandbox's server at `https://{get_host(port)}`.

mod common;
#[path = "common/https.rs"]
mod https;

use std::process::Command;

use common::*;
use torpor_api::types::CreateTenantBody;

const TLS_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b_sdk/tls.py");
const DOMAIN: &str = "e2b-tls.test";

#[tokio::test(flavor = "multi_thread")]
async fn the_python_sdk_reaches_envd_and_ports_over_https_as_it_builds_them() {
    let certs = https::TestCerts::wildcard(DOMAIN);
    let flags = certs.flags(DOMAIN);
    let d = Daemon::start_with(&flags.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let port = https::https_port(&d).await;
    let key = d
        .client()
        .create_tenant(&CreateTenantBody {
            name: "tls-a".into(),
            quotas: None,
        })
        .await
        .unwrap()
        .token;
    let mut cmd = Command::new("python3");
    cmd.arg(TLS_SCRIPT)
        .env("E2B_API_KEY", &key)
        .env("E2B_DOMAIN", DOMAIN)
        .env("SSL_CERT_FILE", &certs.ca_pem)
        .env("TORPOR_TLS_ADDR", format!("127.0.0.1:{port}"))
        .env_remove("SSL_CERT_DIR")
        .env_remove("E2B_API_URL")
        .env_remove("E2B_SANDBOX_URL")
        .env_remove("E2B_DEBUG");
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .expect("python3 must be installed (scripts/deps.sh)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("ALL OK"),
        "SDK script {TLS_SCRIPT} failed ({}):\n{stdout}\n{}\n--- daemon log ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        d.log()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_certificate_files_stop_the_daemon_with_a_stable_code() {
    let certs = https::TestCerts::wildcard(DOMAIN);
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate").unwrap();
    let other = https::TestCerts::wildcard(DOMAIN);
    let cert = certs.cert.to_str().unwrap();
    let key = certs.key.to_str().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_addr = taken.local_addr().unwrap().to_string();
    let any = "127.0.0.1:0";
    let garbage = garbage.to_str().unwrap();
    let other_key = other.key.to_str().unwrap();
    for (what, listen, cert, key, code) in [
        (
            "missing file",
            any,
            "/nonexistent/cert.pem",
            key,
            "tls_file_unreadable",
        ),
        ("no certificate", any, garbage, key, "tls_cert_invalid"),
        ("no key", any, cert, garbage, "tls_key_invalid"),
        (
            "another certificate's key",
            any,
            cert,
            other_key,
            "tls_key_mismatch",
        ),
        (
            "an address in use",
            &taken_addr,
            cert,
            key,
            "tls_listen_failed",
        ),
    ] {
        let out = Command::new(BIN)
            .args(["up", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(dir.path().join(format!("data-{code}")))
            .args(["--tls-listen", listen, "--tls-cert", cert])
            .args(["--tls-key", key])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{what}: {stderr}");
        assert!(stderr.contains(&format!("({code})")), "{what}: {stderr}");
        assert!(
            !dir.path()
                .join(format!("data-{code}"))
                .join("admin-token")
                .exists(),
            "{what}: stopped before anything started"
        );
    }
    // The flags go together.
    let out = Command::new(BIN)
        .args(["up", "--tls-listen", "127.0.0.1:0", "--tls-cert", cert])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "clap refuses --tls-listen without --tls-key"
    );
}
