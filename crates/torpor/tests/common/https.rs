//! HTTPS for the tests of `--tls-listen`: a throwaway CA and a wildcard certificate it signs
//! (rcgen), a daemon serving them, and a raw HTTP/1.1 client over rustls that connects to the
//! daemon's HTTPS port whatever the host name (the names under the test domain resolve nowhere:
//! this is the resolution override) and verifies the certificate against the name it asks for.
//! Not declared by common/mod.rs: included with `#[path]` by the tests that use it.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::Daemon;

/// A CA and a certificate for `*.{domain}` (and `{domain}`) it signed, written as PEM files.
pub struct TestCerts {
    pub dir: tempfile::TempDir,
    pub ca_der: CertificateDer<'static>,
    pub ca_pem: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCerts {
    pub fn wildcard(domain: &str) -> TestCerts {
        let dir = tempfile::Builder::new()
            .prefix("torpor-tls-")
            .tempdir()
            .unwrap();
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "torpor test CA");
        ca_params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
        let leaf_key = rcgen::KeyPair::generate().unwrap();
        let mut leaf =
            rcgen::CertificateParams::new(vec![format!("*.{domain}"), domain.into()]).unwrap();
        leaf.distinguished_name
            .push(rcgen::DnType::CommonName, format!("*.{domain}"));
        leaf.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let leaf_cert = leaf.signed_by(&leaf_key, &ca).unwrap();
        let write = |name: &str, body: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, body).unwrap();
            p
        };
        let ca_pem = write("ca.pem", &ca.pem());
        // The chain as operators install it: leaf, then the CA.
        let cert = write("cert.pem", &format!("{}{}", leaf_cert.pem(), ca.pem()));
        let key = write("key.pem", &leaf_key.serialize_pem());
        TestCerts {
            ca_der: ca.der().clone(),
            dir,
            ca_pem,
            cert,
            key,
        }
    }

    /// `torpor up`'s flags for an HTTPS listener on a free loopback port with these files.
    pub fn flags(&self, domain: &str) -> Vec<String> {
        [
            "--proxy-domain",
            domain,
            "--tls-listen",
            "127.0.0.1:0",
            "--tls-cert",
            path_str(&self.cert),
            "--tls-key",
            path_str(&self.key),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The port of the daemon's HTTPS listener, from its log (`torpor: HTTPS on ADDR`).
pub async fn https_port(d: &Daemon) -> u16 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = d.log();
        if let Some(line) = log.lines().find(|l| l.starts_with("torpor: HTTPS on ")) {
            let addr = line
                .trim_start_matches("torpor: HTTPS on ")
                .split_whitespace()
                .next()
                .unwrap();
            return addr.rsplit_once(':').unwrap().1.parse().unwrap();
        }
        assert!(Instant::now() < deadline, "no HTTPS listener:\n{log}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An answer: status, headers (names lowercase) and the body, de-chunked.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|_| panic!("not JSON ({}): {}", self.status, self.text()))
    }
}

/// A client trusting one CA that sends everything to `127.0.0.1:port`.
#[derive(Clone)]
pub struct Https {
    pub port: u16,
    config: Arc<rustls::ClientConfig>,
}

impl Https {
    pub fn new(port: u16, ca: &CertificateDer<'static>) -> Https {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.clone()).unwrap();
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        Https {
            port,
            config: Arc::new(config),
        }
    }

    /// A request to `https://{host}{path}`: TLS with SNI `host` (verified against the CA), the
    /// same `Host` header.
    pub async fn request(
        &self,
        method: &str,
        host: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Answer {
        self.request_as(host, method, host, path, headers, body)
            .await
            .unwrap_or_else(|e| panic!("https://{host}{path}: {e}"))
    }

    /// As [`Https::request`], with TLS for `sni` and the `Host` header `host` (they may
    /// differ: a forged host on a verified connection). Err: the TLS or connection failure.
    pub async fn request_as(
        &self,
        sni: &str,
        method: &str,
        host: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Answer, String> {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .map_err(|e| e.to_string())?;
        let name = ServerName::try_from(sni.to_string()).map_err(|e| e.to_string())?;
        let mut tls = tokio_rustls::TlsConnector::from(self.config.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS: {e}"))?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        tls.write_all(head.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        tls.write_all(body).await.map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(120), tls.read_to_end(&mut out))
            .await
            .map_err(|_| "no answer within 120 s".to_string())?;
        // A peer closing without close_notify after a whole answer is still an answer.
        if let Err(e) = read {
            if out.is_empty() {
                return Err(e.to_string());
            }
        }
        parse(&out)
    }
}

fn parse(raw: &[u8]) -> Result<Answer, String> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| format!("no head in {:?}", String::from_utf8_lossy(raw)))?;
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line in {head:?}"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    if chunked {
        body = dechunk(&body)?;
    }
    Ok(Answer {
        status,
        headers,
        body,
    })
}

fn dechunk(mut raw: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let eol = raw
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("truncated chunk size")?;
        let size_line = String::from_utf8_lossy(&raw[..eol]).into_owned();
        let size = usize::from_str_radix(size_line.split(';').next().unwrap().trim(), 16)
            .map_err(|_| format!("bad chunk size {size_line:?}"))?;
        raw = &raw[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if raw.len() < size + 2 {
            return Err("truncated chunk".into());
        }
        out.extend_from_slice(&raw[..size]);
        raw = &raw[size + 2..];
    }
}
