//! Mutual TLS between controllers and workers (rustls on ring, TLS 1.3 only).
//!
//! Each side holds a [`TlsSource`]: its own certificate and key and the CA it trusts, read from
//! a `--tls-dir` (`cert.pem`, `key.pem`, `ca.pem`, as `torpor ca issue` writes them). A peer is
//! accepted only if its certificate chains to that CA, is within its validity period, and names
//! exactly one SPIFFE identity of the same trust domain with the role this side expects: a
//! worker accepts only controllers, a controller only workers. Host names play no part; the
//! identity is the name (as SPIFFE's X.509-SVID verification prescribes).
//!
//! Rotation: the source re-reads the three files when their size, modification time or inode
//! changes (checked at most once a second, on the next handshake), so a certificate renewed
//! by `torpor ca issue` or cert-manager is used for new connections without a restart. Files
//! that do not parse are not taken; the previous material stays in use and the error is logged.
//!
//! Refusals are logged (peer address, reason) and counted in
//! `torpor_cluster_tls_refusals_total{side, reason}`.

use std::fmt;
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use prometheus::{IntCounterVec, Opts, Registry};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::ResolvesClientCert;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ParsedCertificate, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore,
    ServerConfig, SignatureScheme,
};
use rustls_pki_types::pem::PemObject;

use crate::ca::{Identity, Role, TrustDomain, CA_CERT, CERT, KEY};

/// Why a peer was refused (the `reason` label).
pub const REFUSAL_REASONS: [&str; 6] = [
    "no_certificate",
    "unknown_ca",
    "expired",
    "wrong_identity",
    "handshake",
    "timeout",
];

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Pem { path: PathBuf, reason: String },
    #[error("{path}: {reason}")]
    Material { path: PathBuf, reason: String },
    #[error("TLS configuration")]
    Config(#[from] rustls::Error),
}

/// Where a side's certificate, key and trusted CA are.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

impl TlsFiles {
    /// `DIR/cert.pem`, `DIR/key.pem`, `DIR/ca.pem` (`torpor ca issue --out DIR`).
    pub fn in_dir(dir: &Path) -> TlsFiles {
        TlsFiles {
            cert: dir.join(CERT),
            key: dir.join(KEY),
            ca: dir.join(CA_CERT),
        }
    }
}

/// Which end of a connection counts a refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The worker refusing a caller.
    Worker,
    /// The controller refusing a worker it dialled.
    Controller,
}

impl Side {
    fn as_str(self) -> &'static str {
        match self {
            Side::Worker => "worker",
            Side::Controller => "controller",
        }
    }

    /// The role this side accepts from its peers.
    pub fn peer_role(self) -> Role {
        match self {
            Side::Worker => Role::Controller,
            Side::Controller => Role::Worker,
        }
    }
}

/// `torpor_cluster_tls_refusals_total{side, reason}`.
#[derive(Clone)]
pub struct TlsMetrics {
    pub refusals: IntCounterVec,
}

impl Default for TlsMetrics {
    fn default() -> Self {
        TlsMetrics::new()
    }
}

impl TlsMetrics {
    pub fn new() -> TlsMetrics {
        let refusals = IntCounterVec::new(
            Opts::new(
                "torpor_cluster_tls_refusals_total",
                "Cluster connections refused at the TLS handshake, by the side that refused and why.",
            ),
            &["side", "reason"],
        )
        .expect("static metric definition");
        for side in ["worker", "controller"] {
            for reason in REFUSAL_REASONS {
                refusals.with_label_values(&[side, reason]);
            }
        }
        TlsMetrics { refusals }
    }

    pub fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.refusals.clone()))
    }

    /// How many refusals `side` counted for `reason`.
    pub fn refused(&self, side: Side, reason: &str) -> u64 {
        self.refusals
            .with_label_values(&[side.as_str(), reason])
            .get()
    }
}

/// What a handshake failure says about the peer.
pub fn refusal_reason(e: &std::io::Error) -> &'static str {
    let Some(err) = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    else {
        return "handshake";
    };
    match err {
        rustls::Error::NoCertificatesPresented => "no_certificate",
        rustls::Error::InvalidCertificate(c) => match c {
            CertificateError::Expired
            | CertificateError::ExpiredContext { .. }
            | CertificateError::NotValidYet
            | CertificateError::NotValidYetContext { .. } => "expired",
            CertificateError::UnknownIssuer
            | CertificateError::BadSignature
            | CertificateError::UnhandledCriticalExtension => "unknown_ca",
            CertificateError::ApplicationVerificationFailure => "wrong_identity",
            _ => "handshake",
        },
        _ => "handshake",
    }
}

/// Files' identity: a change of any of them means new material.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp(Vec<(u64, u64, Option<SystemTime>)>);

impl Stamp {
    fn of(files: &TlsFiles) -> Stamp {
        Stamp(
            [&files.cert, &files.key, &files.ca]
                .iter()
                .map(|p| match std::fs::metadata(p) {
                    Ok(m) => (m.ino(), m.len(), m.modified().ok()),
                    Err(_) => (0, 0, None),
                })
                .collect(),
        )
    }
}

/// One load of the files.
struct Material {
    identity: Identity,
    key: Arc<CertifiedKey>,
    roots: Arc<RootCertStore>,
    /// The server side's chain checker over `roots` (client-auth usage).
    client_verifier: Arc<dyn ClientCertVerifier>,
}

struct Loaded {
    material: Arc<Material>,
    stamp: Stamp,
    checked: Instant,
}

/// A side's TLS material, re-read when its files change.
pub struct TlsSource {
    files: TlsFiles,
    side: Side,
    provider: Arc<CryptoProvider>,
    loaded: Mutex<Loaded>,
    metrics: TlsMetrics,
}

impl fmt::Debug for TlsSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsSource")
            .field("files", &self.files)
            .field("side", &self.side)
            .finish()
    }
}

/// How often the files are looked at for a change.
const RELOAD_CHECK: Duration = Duration::from_secs(1);

impl TlsSource {
    /// Loads `files` for `side`. The certificate must name an identity of the role this side
    /// plays (a worker's files must hold a worker certificate).
    pub fn load(
        files: TlsFiles,
        side: Side,
        metrics: TlsMetrics,
    ) -> Result<Arc<TlsSource>, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let material = load_material(&files, &provider, side)?;
        tracing::info!(identity = %material.identity, "cluster TLS identity loaded");
        Ok(Arc::new(TlsSource {
            loaded: Mutex::new(Loaded {
                material: Arc::new(material),
                stamp: Stamp::of(&files),
                checked: Instant::now(),
            }),
            files,
            side,
            provider,
            metrics,
        }))
    }

    /// This side's own identity (from its certificate).
    pub fn identity(&self) -> Identity {
        self.current().identity.clone()
    }

    pub fn metrics(&self) -> &TlsMetrics {
        &self.metrics
    }

    fn current(&self) -> Arc<Material> {
        let mut l = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        if l.checked.elapsed() >= RELOAD_CHECK {
            l.checked = Instant::now();
            let stamp = Stamp::of(&self.files);
            if stamp != l.stamp {
                match load_material(&self.files, &self.provider, self.side) {
                    Ok(m) => {
                        tracing::info!(identity = %m.identity, "cluster TLS material changed on disk; reloaded");
                        l.material = Arc::new(m);
                        l.stamp = stamp;
                    }
                    // Possibly caught between the writes of a rotation: kept for the next look.
                    Err(e) => {
                        tracing::warn!(error = %e, "cluster TLS files changed but do not load; keeping the previous ones")
                    }
                }
            }
        }
        l.material.clone()
    }

    /// Counts and logs a refused peer.
    pub fn refused(&self, peer: Option<SocketAddr>, reason: &str, error: &dyn fmt::Display) {
        self.metrics
            .refusals
            .with_label_values(&[self.side.as_str(), reason])
            .inc();
        tracing::warn!(side = self.side.as_str(), peer = ?peer, reason, error = %error, "cluster peer refused");
    }

    /// Checks a peer's identity (its chain is checked already).
    fn check_identity(
        &self,
        trust_domain: &TrustDomain,
        der: &[u8],
    ) -> Result<Identity, rustls::Error> {
        let expected = self.side.peer_role();
        let refuse = |why: String| {
            tracing::warn!(side = self.side.as_str(), %why, "cluster peer's identity refused");
            rustls::Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure)
        };
        let id = Identity::of_certificate(der).map_err(|e| refuse(e.to_string()))?;
        if &id.trust_domain != trust_domain {
            return Err(refuse(format!(
                "{id} is of another trust domain than {trust_domain}"
            )));
        }
        if id.role != expected {
            return Err(refuse(format!(
                "{id} presents where a {expected} is expected"
            )));
        }
        Ok(id)
    }

    /// The worker's server configuration: client certificates required and checked.
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<ServerConfig>, TlsError> {
        let mut cfg = ServerConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(Arc::new(PeerVerifier(self.clone())))
            .with_cert_resolver(Arc::new(OwnCert(self.clone())));
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(cfg))
    }

    /// The controller's client configuration: its certificate presented, the worker's checked.
    pub fn client_config(self: &Arc<Self>) -> Result<Arc<ClientConfig>, TlsError> {
        let mut cfg = ClientConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PeerVerifier(self.clone())))
            .with_client_cert_resolver(Arc::new(OwnCert(self.clone())));
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(cfg))
    }
}

fn pem_err(path: &Path) -> impl FnOnce(rustls_pki_types::pem::Error) -> TlsError + '_ {
    move |e| TlsError::Pem {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

fn load_material(
    files: &TlsFiles,
    provider: &Arc<CryptoProvider>,
    side: Side,
) -> Result<Material, TlsError> {
    let read = |p: &Path| {
        std::fs::read(p).map_err(|source| TlsError::Io {
            path: p.to_path_buf(),
            source,
        })
    };
    let cert_bytes = read(&files.cert)?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_bytes)
        .collect::<Result<_, _>>()
        .map_err(pem_err(&files.cert))?;
    let Some(leaf) = chain.first() else {
        return Err(TlsError::Material {
            path: files.cert.clone(),
            reason: "no certificate in the file".into(),
        });
    };
    let identity = Identity::of_certificate(leaf).map_err(|e| TlsError::Material {
        path: files.cert.clone(),
        reason: e.to_string(),
    })?;
    let own_role = side.own_role();
    if identity.role != own_role {
        return Err(TlsError::Material {
            path: files.cert.clone(),
            reason: format!("{identity} is not a {own_role} certificate"),
        });
    }
    let key_bytes = read(&files.key)?;
    let key = PrivateKeyDer::from_pem_slice(&key_bytes).map_err(pem_err(&files.key))?;
    let key = CertifiedKey::from_der(chain, key, provider).map_err(|e| TlsError::Material {
        path: files.key.clone(),
        reason: format!("the key does not fit the certificate: {e}"),
    })?;
    let ca_bytes = read(&files.ca)?;
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&ca_bytes) {
        let c = c.map_err(pem_err(&files.ca))?;
        roots.add(c).map_err(|e| TlsError::Material {
            path: files.ca.clone(),
            reason: e.to_string(),
        })?;
    }
    if roots.is_empty() {
        return Err(TlsError::Material {
            path: files.ca.clone(),
            reason: "no CA certificate in the file".into(),
        });
    }
    let roots = Arc::new(roots);
    let client_verifier =
        WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| TlsError::Material {
                path: files.ca.clone(),
                reason: e.to_string(),
            })?;
    Ok(Material {
        identity,
        key: Arc::new(key),
        roots,
        client_verifier,
    })
}

impl Side {
    fn own_role(self) -> Role {
        match self {
            Side::Worker => Role::Worker,
            Side::Controller => Role::Controller,
        }
    }
}

/// Presents this side's current certificate.
#[derive(Debug)]
struct OwnCert(Arc<TlsSource>);

impl ResolvesServerCert for OwnCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current().key.clone())
    }
}

impl ResolvesClientCert for OwnCert {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current().key.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// Checks the peer: its chain against the current CA, then its identity.
#[derive(Debug)]
struct PeerVerifier(Arc<TlsSource>);

impl ClientCertVerifier for PeerVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // Hints are optional; the CA may change under a long-lived configuration.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let m = self.0.current();
        m.client_verifier
            .verify_client_cert(end_entity, intermediates, now)?;
        self.0
            .check_identity(&m.identity.trust_domain, end_entity)?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::PeerIncompatible(
            rustls::PeerIncompatible::Tls13RequiredForQuic,
        ))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0
            .provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

impl ServerCertVerifier for PeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let m = self.0.current();
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &m.roots,
            intermediates,
            now,
            self.0.provider.signature_verification_algorithms.all,
        )?;
        self.0
            .check_identity(&m.identity.trust_domain, end_entity)?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        ClientCertVerifier::verify_tls12_signature(self, message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        ClientCertVerifier::verify_tls13_signature(self, message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        ClientCertVerifier::supported_verify_schemes(self)
    }
}

/// The identity of the peer of an accepted connection (in each request's extensions).
#[derive(Debug, Clone)]
pub struct PeerInfo {
    pub addr: SocketAddr,
    pub identity: Identity,
}

/// The identity a verified connection's peer presented.
pub fn peer_identity(certs: Option<&[CertificateDer<'_>]>) -> Option<Identity> {
    Identity::of_certificate(certs?.first()?).ok()
}
