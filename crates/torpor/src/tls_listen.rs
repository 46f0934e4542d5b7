//! HTTPS for the API: `torpor up --tls-listen ADDR --tls-cert FILE --tls-key FILE` serves the
//! routes of `--listen` (torpor's API, E2B's control plane at `api.<domain>` and envd at
//! `49983-{id}.<domain>`, host-based routing to sandbox ports at `{port}-{id}.<domain>`) over
//! TLS on a second listener, with the operator's certificate: a wildcard `*.<proxy domain>`
//! one, so that the `https://` URLs E2B's SDKs build from `get_host` verify. `--listen` stays
//! plain HTTP (the CLI's; bind it to loopback when TLS faces the network).
//!
//! This module owns the certificate and its listener; the connection loop (cap, timeouts,
//! graceful stop) is crate::serve's, which runs the handshake inside a connection's slot and
//! within its header-read timeout.
//!
//! Rotation, as the cluster's TLS does it (torpor_cluster's `tls`): the two files are re-read
//! when the size, modification time or inode of either changes, checked at most once a second
//! on the next handshake, so a renewed certificate (certbot, cert-manager) is served to new
//! connections without a restart. A pair that does not load is not taken: the previous one
//! stays and the error is logged. At start a pair that does not load is a startup error with a
//! stable code ([`TlsListenError::code`]).

use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::{ClientHello, ParsedCertificate, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

/// How often the files' stamps are looked at, at most (on a handshake).
const RECHECK: Duration = Duration::from_secs(1);

/// `torpor up`'s TLS flags.
#[derive(Debug, Clone, clap::Args)]
pub struct TlsArgs {
    /// Also serve the API and host-based routing over HTTPS on this address (e.g. 0.0.0.0:443),
    /// with --tls-cert and --tls-key; --listen stays plain HTTP (docs/NETWORKING.md).
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    pub tls_listen: Option<SocketAddr>,
    /// PEM certificate chain for --tls-listen, leaf first: a wildcard `*.<proxy domain>` for
    /// E2B's `get_host` URLs. Re-read when it changes.
    #[arg(long, requires = "tls_listen")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert (PKCS#8, PKCS#1 or SEC1). Re-read when it changes.
    #[arg(long, requires = "tls_listen")]
    pub tls_key: Option<PathBuf>,
}

/// Why the TLS listener cannot start (or a renewed pair is not taken).
#[derive(Debug, thiserror::Error)]
pub enum TlsListenError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: no PEM certificate in it")]
    NoCertificate { path: PathBuf },
    #[error("{path}: the certificate does not parse: {reason}")]
    BadCertificate { path: PathBuf, reason: String },
    #[error("{path}: no PEM private key in it (PKCS#8, PKCS#1 or SEC1)")]
    NoKey { path: PathBuf },
    #[error("{path}: the private key cannot be used: {reason}")]
    BadKey { path: PathBuf, reason: String },
    #[error("{key} is not the key of the certificate in {cert}")]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    #[error("cannot listen on {addr} (--tls-listen)")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

impl TlsListenError {
    /// The error with its causes and its code, as printed at start.
    pub fn report(&self) -> String {
        let mut out = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(s) = source {
            out.push_str(&format!(": {s}"));
            source = s.source();
        }
        format!("{out} ({})", self.code())
    }

    /// The stable code printed with the error at start.
    pub fn code(&self) -> &'static str {
        match self {
            TlsListenError::Read { .. } => "tls_file_unreadable",
            TlsListenError::NoCertificate { .. } | TlsListenError::BadCertificate { .. } => {
                "tls_cert_invalid"
            }
            TlsListenError::NoKey { .. } | TlsListenError::BadKey { .. } => "tls_key_invalid",
            TlsListenError::KeyMismatch { .. } => "tls_key_mismatch",
            TlsListenError::Bind { .. } => "tls_listen_failed",
        }
    }
}

/// What identifies a version of a file: a change in any of them means a new file.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: Option<SystemTime>,
    inode: u64,
}

impl Stamp {
    fn of(path: &Path) -> Option<Stamp> {
        let m = std::fs::metadata(path).ok()?;
        Some(Stamp {
            len: m.len(),
            modified: m.modified().ok(),
            inode: m.ino(),
        })
    }
}

/// The certificate served, and where it was read from.
#[derive(Debug)]
pub struct CertSource {
    cert_path: PathBuf,
    key_path: PathBuf,
    provider: Arc<CryptoProvider>,
    state: Mutex<Loaded>,
}

#[derive(Debug)]
struct Loaded {
    key: Arc<CertifiedKey>,
    stamps: (Option<Stamp>, Option<Stamp>),
    checked: Instant,
}

impl CertSource {
    /// Reads the pair; an error names the file and carries a stable code.
    pub fn load(cert: &Path, key: &Path) -> Result<CertSource, TlsListenError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let stamps = (Stamp::of(cert), Stamp::of(key));
        let certified = read_pair(cert, key, &provider)?;
        Ok(CertSource {
            cert_path: cert.to_path_buf(),
            key_path: key.to_path_buf(),
            provider,
            state: Mutex::new(Loaded {
                key: Arc::new(certified),
                stamps,
                checked: Instant::now(),
            }),
        })
    }

    /// Whether the leaf certificate is valid for `name` (a host name under the proxy domain).
    pub fn covers(&self, name: &str) -> bool {
        let key = self.current();
        let Some(leaf) = key.cert.first() else {
            return false;
        };
        let (Ok(parsed), Ok(server)) = (
            ParsedCertificate::try_from(leaf),
            ServerName::try_from(name.to_string()),
        ) else {
            return false;
        };
        rustls::client::verify_server_name(&parsed, &server).is_ok()
    }

    /// The pair to serve: re-read first when a file changed (looked at once a second at most).
    fn current(&self) -> Arc<CertifiedKey> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.checked.elapsed() < RECHECK {
            return state.key.clone();
        }
        state.checked = Instant::now();
        let stamps = (Stamp::of(&self.cert_path), Stamp::of(&self.key_path));
        if stamps == state.stamps {
            return state.key.clone();
        }
        match read_pair(&self.cert_path, &self.key_path, &self.provider) {
            Ok(k) => {
                tracing::info!(cert = %self.cert_path.display(), "TLS certificate reloaded");
                state.key = Arc::new(k);
                state.stamps = stamps;
            }
            Err(e) => {
                // Half-written renewals land here too: the next change is tried again.
                tracing::error!(error = %e, code = e.code(), "TLS certificate not reloaded; serving the previous one");
                state.stamps = stamps;
            }
        }
        state.key.clone()
    }

    /// The server configuration: TLS 1.2 and 1.3, ALPN h2 and http/1.1, no client certificates.
    pub fn server_config(self: &Arc<Self>) -> ServerConfig {
        let mut cfg = ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        cfg
    }
}

impl ResolvesServerCert for CertSource {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsListenError> {
    std::fs::read(path).map_err(|source| TlsListenError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn read_pair(
    cert: &Path,
    key: &Path,
    provider: &CryptoProvider,
) -> Result<CertifiedKey, TlsListenError> {
    let cert_pem = read(cert)?;
    let key_pem = read(key)?;
    let bad_cert = |reason: String| TlsListenError::BadCertificate {
        path: cert.to_path_buf(),
        reason,
    };
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad_cert(e.to_string()))?;
    let Some(leaf) = chain.first() else {
        return Err(TlsListenError::NoCertificate {
            path: cert.to_path_buf(),
        });
    };
    ParsedCertificate::try_from(leaf).map_err(|e| bad_cert(e.to_string()))?;
    let private = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| match e {
        rustls_pki_types::pem::Error::NoItemsFound => TlsListenError::NoKey {
            path: key.to_path_buf(),
        },
        e => TlsListenError::BadKey {
            path: key.to_path_buf(),
            reason: e.to_string(),
        },
    })?;
    let signing = provider
        .key_provider
        .load_private_key(private)
        .map_err(|e| TlsListenError::BadKey {
            path: key.to_path_buf(),
            reason: e.to_string(),
        })?;
    let certified = CertifiedKey::new(chain, signing);
    match certified.keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {
            Ok(certified)
        }
        Err(rustls::Error::InconsistentKeys(_)) => Err(TlsListenError::KeyMismatch {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
        }),
        Err(e) => Err(bad_cert(e.to_string())),
    }
}

/// The HTTPS listener, bound and with its certificate loaded, waiting for crate::serve.
pub struct TlsListen {
    pub listener: TcpListener,
    pub addr: SocketAddr,
    pub acceptor: TlsAcceptor,
}

static PREPARED: Mutex<Option<TlsListen>> = Mutex::new(None);

/// Loads the certificate and binds `--tls-listen` (before anything else starts, so bad files
/// stop the daemon at once), and keeps the listener for crate::serve::serve_api. Nothing to do
/// without `--tls-listen`.
pub async fn prepare(args: &TlsArgs, domain: &str) -> Result<(), TlsListenError> {
    let (Some(addr), Some(cert), Some(key)) = (args.tls_listen, &args.tls_cert, &args.tls_key)
    else {
        return Ok(());
    };
    let certs = Arc::new(CertSource::load(cert, key)?);
    let probe = format!("49983-probe.{domain}");
    if !certs.covers(&probe) {
        tracing::warn!(
            cert = %cert.display(),
            domain,
            "the TLS certificate does not cover *.{domain}: E2B SDKs will refuse host-routed URLs (--proxy-domain)"
        );
        eprintln!(
            "torpor: warning: {} does not cover *.{domain} (--proxy-domain); E2B's https URLs will not verify",
            cert.display()
        );
    }
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| TlsListenError::Bind { addr, source })?;
    let acceptor = TlsAcceptor::from(Arc::new(certs.server_config()));
    let addr = listener.local_addr().unwrap_or(addr);
    *PREPARED.lock().unwrap_or_else(|p| p.into_inner()) = Some(TlsListen {
        listener,
        addr,
        acceptor,
    });
    Ok(())
}

/// The listener [`prepare`] bound, once.
pub fn take_prepared() -> Option<TlsListen> {
    PREPARED.lock().unwrap_or_else(|p| p.into_inner()).take()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(names: &[&str]) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let params =
            rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap();
        let cert = params.self_signed(&key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn write(dir: &Path, name: &str, body: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        p
    }

    #[test]
    fn bad_files_are_refused_with_their_code() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = pair(&["*.sbx.test"]);
        let (_, other_key) = pair(&["*.sbx.test"]);
        let c = write(dir.path(), "c.pem", &cert);
        let k = write(dir.path(), "k.pem", &key);
        let code = |cert: &Path, key: &Path| CertSource::load(cert, key).err().unwrap().code();
        assert_eq!(
            code(&dir.path().join("none.pem"), &k),
            "tls_file_unreadable"
        );
        let empty = write(dir.path(), "empty.pem", "");
        assert_eq!(code(&empty, &k), "tls_cert_invalid");
        let garbage = write(
            dir.path(),
            "garbage.pem",
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        );
        assert_eq!(code(&garbage, &k), "tls_cert_invalid");
        assert_eq!(code(&c, &empty), "tls_key_invalid");
        // A certificate where the key should be: no key in it.
        assert_eq!(code(&c, &c), "tls_key_invalid");
        let other = write(dir.path(), "other.pem", &other_key);
        assert_eq!(code(&c, &other), "tls_key_mismatch");
        let ok = CertSource::load(&c, &k).unwrap();
        assert!(ok.covers("49983-sb-1.sbx.test"));
        assert!(!ok.covers("49983-sb-1.other.test"));
        // One label only: a wildcard does not cover deeper names.
        assert!(!ok.covers("a.49983-sb-1.sbx.test"));
    }

    #[test]
    fn a_renewed_pair_is_served_and_a_broken_one_is_not_taken() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = pair(&["*.one.test"]);
        let c = write(dir.path(), "c.pem", &cert);
        let k = write(dir.path(), "k.pem", &key);
        let src = CertSource::load(&c, &k).unwrap();
        let first = src.current();
        // A renewal: new pair, written aside and renamed over (a new inode for each).
        let (cert2, key2) = pair(&["*.two.test"]);
        write(dir.path(), "c2.pem", &cert2);
        write(dir.path(), "k2.pem", &key2);
        std::fs::rename(dir.path().join("c2.pem"), &c).unwrap();
        std::fs::rename(dir.path().join("k2.pem"), &k).unwrap();
        src.state.lock().unwrap().checked -= RECHECK;
        assert!(src.covers("443-x.two.test"), "the renewed pair is served");
        assert_ne!(src.current().cert, first.cert);
        // A broken write: the pair before it stays.
        write(dir.path(), "c3.pem", "not pem");
        std::fs::rename(dir.path().join("c3.pem"), &c).unwrap();
        src.state.lock().unwrap().checked -= RECHECK;
        assert!(src.covers("443-x.two.test"), "the previous pair stays");
    }
}
