//! Cluster harness: certificates made with the real `torpor ca`, a real `torpor worker` process
//! (real runsc) on a free loopback port, and controllers as in-test `RemoteNode`s.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use torpor_cluster::{
    RemoteConfig, RemoteError, RemoteNode, Side, TlsFiles, TlsMetrics, TlsSource,
};

pub const BIN: &str = env!("CARGO_BIN_EXE_torpor");

/// A loopback port for a child process to listen on (outside the ephemeral range: see
/// `torpor_runtime::ports`).
pub fn free_port() -> u16 {
    torpor_runtime::ports::loopback_port().expect("a free loopback port")
}

/// Runs `torpor ARGS` to completion; panics with its output unless it succeeds.
pub fn torpor(args: &[&str]) -> String {
    let out = Command::new(BIN).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "torpor {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `torpor ca init --dir DIR --trust-domain DOMAIN`.
pub fn ca_init(dir: &Path, domain: &str) {
    torpor(&["ca", "init", "--dir", p(dir), "--trust-domain", domain]);
}

/// `torpor ca issue` into `out`.
pub fn ca_issue(ca: &Path, role: &str, name: &str, out: &Path, ttl: &str) {
    torpor(&[
        "ca",
        "issue",
        "--dir",
        p(ca),
        "--role",
        role,
        "--name",
        name,
        "--out",
        p(out),
        "--ttl",
        ttl,
    ]);
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// A running `torpor worker`.
pub struct WorkerProc {
    pub addr: String,
    pub metrics_port: u16,
    pub data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl WorkerProc {
    /// Starts a worker with the identity in `tls_dir` and waits until it accepts connections.
    pub async fn start(tls_dir: &Path, data_dir: &Path) -> WorkerProc {
        std::fs::create_dir_all(data_dir).unwrap();
        let port = free_port();
        let metrics_port = free_port();
        let log = data_dir.join("worker.log");
        let child = Command::new(BIN)
            .args(["worker", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--tls-dir", p(tls_dir), "--data-dir", p(data_dir)])
            .args(["--warm-pool", "1"])
            .args(["--metrics-listen", &format!("127.0.0.1:{metrics_port}")])
            .env("TORPOR_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut w = WorkerProc {
            addr: format!("127.0.0.1:{port}"),
            metrics_port,
            data_dir: data_dir.to_path_buf(),
            log,
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if w.log().contains("worker serving controllers")
                && tokio::net::TcpStream::connect(&w.addr).await.is_ok()
            {
                return w;
            }
            if let Some(status) = w.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("worker exited with {status}:\n{}", w.log());
            }
            assert!(Instant::now() < deadline, "worker not up:\n{}", w.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `torpor_cluster_tls_refusals_total{side="worker",reason}` from the worker's /metrics.
    pub async fn refusals(&self, reason: &str) -> u64 {
        let text = reqwest::get(format!("http://127.0.0.1:{}/metrics", self.metrics_port))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let series =
            format!("torpor_cluster_tls_refusals_total{{reason=\"{reason}\",side=\"worker\"}}");
        text.lines()
            .find_map(|l| l.strip_prefix(&series))
            .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
            .trim()
            .parse()
            .unwrap()
    }

    /// Waits until the worker has counted `want` refusals for `reason` (it counts after the
    /// alert is on its way to the client).
    pub async fn wait_refusals(&self, reason: &str, want: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let n = self.refusals(reason).await;
            if n >= want {
                // A revoked peer's connections still open when the CRL arrives are cut and
                // counted too (`tls/open.rs`): as many as the peer had open then.
                if reason != "revoked" {
                    assert_eq!(n, want, "{reason} counted once");
                }
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{reason} refusal never counted:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Container ids runsc knows on this worker.
    pub fn containers(&self) -> Vec<String> {
        runsc_containers(&self.data_dir)
    }

    /// SIGTERM and wait.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let status = c.wait().unwrap();
            assert!(status.success(), "worker exit {status}:\n{}", self.log());
        }
    }
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A controller with the identity in `tls_dir` connecting to `addr`.
pub async fn connect(addr: &str, tls_dir: &Path) -> Result<RemoteNode, RemoteError> {
    let tls = TlsSource::load(
        TlsFiles::in_dir(tls_dir),
        Side::Controller,
        TlsMetrics::new(),
    )
    .expect("controller TLS files load");
    RemoteNode::connect(RemoteConfig::new(addr), tls).await
}

/// A TLS 1.3 client presenting the certificate in `identity` (any role), or none, that trusts
/// any server; it sends HTTP/2's preface and reads. Returns whether the worker answered.
pub async fn raw_client(addr: &str, identity: Option<&Path>) -> bool {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer));
    let cfg = match identity {
        Some(dir) => {
            let certs: Vec<CertificateDer<'static>> =
                CertificateDer::pem_file_iter(dir.join("cert.pem"))
                    .unwrap()
                    .collect::<Result<_, _>>()
                    .unwrap();
            let key = PrivateKeyDer::from_pem_file(dir.join("key.pem")).unwrap();
            builder.with_client_auth_cert(certs, key).unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let Ok(mut tls) = connector
        .connect(ServerName::try_from("torpor-worker").unwrap(), tcp)
        .await
    else {
        return false;
    };
    // TLS 1.3: the client finishes first; a refusal arrives as an alert on the next read.
    let _ = tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(Duration::from_secs(10), tls.read(&mut buf)).await,
        Ok(Ok(n)) if n > 0
    )
}

#[derive(Debug)]
struct AnyServer;

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }
    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Container ids runsc knows under a worker's data directory (whoever started them).
pub fn runsc_containers(data_dir: &Path) -> Vec<String> {
    let out = Command::new("runsc")
        .arg("--root")
        .arg(data_dir.join("runsc"))
        .args(["list", "-quiet"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .filter(|l| !l.is_empty())
        .collect()
}
