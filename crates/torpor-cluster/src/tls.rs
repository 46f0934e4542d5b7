//! Mutual TLS between controllers and workers (rustls on ring, TLS 1.3 only).
//!
//! Each side holds a [`TlsSource`]: its own certificate and key and the CA it trusts, read from
//! a `--tls-dir` (`cert.pem`, `key.pem`, `ca.pem`, as `torpor ca issue` writes them). A peer is
//! accepted only if its certificate chains to that CA, is within its validity period, and names
//! exactly one SPIFFE identity of the same trust domain with the role this side expects: a
//! worker accepts only controllers, a controller only workers. Host names play no part; the
//! identity is the name (as SPIFFE's X.509-SVID verification prescribes).
//!
//! Revocation: when a `crl.pem` lies beside them (`torpor ca revoke` writes it in the CA
//! directory; the operator copies it to each member), a peer whose certificate's serial it
//! lists is refused (reason `revoked`), on both sides. Only the peer's own certificate is
//! looked up (not the CA's), the file must hold one CRL for each CA of `ca.pem`, each signed by
//! it (otherwise it is not taken), and a CRL past its `nextUpdate` is still used. Without the
//! file nothing is checked for revocation (short lifetimes are the other defence).
//!
//! Rotation: the source re-reads the files when the size, modification time or inode of any
//! of them changes (checked at most once a second, on the next handshake), so a certificate
//! renewed by `torpor ca issue` or cert-manager, or a new CRL, is used for new connections
//! without a restart. Files that do not parse are not taken; the previous material stays in
//! use and the error is logged.
//!
//! Open connections ([`open`]): every verified connection is watched. When the material
//! changes (a new CRL, CA or own certificate), every open peer is verified again against it;
//! every second, peers whose certificate has expired are. A peer that no longer passes has its
//! connection closed (a revoked worker loses its heartbeat channel and the controller's
//! channel to it, so the controller counts it lost after the usual silence).
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
use rustls::pki_types::{
    CertificateDer, CertificateRevocationListDer, PrivateKeyDer, ServerName, UnixTime,
};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ParsedCertificate, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore,
    ServerConfig, SignatureScheme,
};
use rustls_pki_types::pem::PemObject;

use crate::ca::{Identity, Role, TrustDomain, CA_CERT, CERT, CRL, KEY};

mod open;
pub use open::{Direction, OpenRefusal, Revocable, SWEEP_EVERY};

/// Why a peer was refused (the `reason` label).
pub const REFUSAL_REASONS: [&str; 7] = [
    "no_certificate",
    "unknown_ca",
    "expired",
    "revoked",
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

/// Where a side's certificate, key, trusted CA and (optional) revocation list are.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
    /// Read when it exists; its absence means no revocation check.
    pub crl: PathBuf,
}

impl TlsFiles {
    /// `DIR/cert.pem`, `DIR/key.pem`, `DIR/ca.pem` (`torpor ca issue --out DIR`) and
    /// `DIR/crl.pem` when the operator put one there.
    pub fn in_dir(dir: &Path) -> TlsFiles {
        TlsFiles {
            cert: dir.join(CERT),
            key: dir.join(KEY),
            ca: dir.join(CA_CERT),
            crl: dir.join(CRL),
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

/// Whom a connection's peer must be: a role, and for a dialled controller its exact name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    pub role: Role,
    /// The peer's name, when one peer and no other will do (a controller forwarding a call
    /// to the controller that holds the sandbox: `spiffe://<domain>/controller/<name>`).
    pub name: Option<String>,
}

impl Expected {
    /// Any peer of `role` (of this side's trust domain).
    pub fn any(role: Role) -> Expected {
        Expected { role, name: None }
    }

    /// Exactly the peer of `role` named `name`.
    pub fn named(role: Role, name: &str) -> Expected {
        Expected {
            role,
            name: Some(name.to_string()),
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
    rustls_reason(err)
}

/// What a verification error says about the peer.
fn rustls_reason(err: &rustls::Error) -> &'static str {
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
            CertificateError::Revoked => "revoked",
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
            [&files.cert, &files.key, &files.ca, &files.crl]
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
    /// The CA's revocation lists (empty without `crl.pem`).
    crls: Vec<webpki::CertRevocationList<'static>>,
    /// The server side's chain checker over `roots` and `crls` (client-auth usage).
    client_verifier: Arc<dyn ClientCertVerifier>,
}

struct Loaded {
    material: Arc<Material>,
    /// Counts the loads: open peers are verified again when it moves.
    generation: u64,
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
    /// Verified connections open now, checked again as the material changes.
    open: Mutex<open::OpenPeers>,
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
                generation: 0,
                stamp: Stamp::of(&files),
                checked: Instant::now(),
            }),
            files,
            side,
            provider,
            metrics,
            open: Mutex::default(),
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
        self.current_generation().0
    }

    /// The material in use (re-read first if its files changed) and its generation.
    fn current_generation(&self) -> (Arc<Material>, u64) {
        let mut l = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        if l.checked.elapsed() >= RELOAD_CHECK {
            l.checked = Instant::now();
            let stamp = Stamp::of(&self.files);
            if stamp != l.stamp {
                match load_material(&self.files, &self.provider, self.side) {
                    Ok(m) => {
                        tracing::info!(identity = %m.identity, "cluster TLS material changed on disk; reloaded");
                        l.material = Arc::new(m);
                        l.generation += 1;
                        l.stamp = stamp;
                    }
                    // Possibly caught between the writes of a rotation: kept for the next look.
                    Err(e) => {
                        tracing::warn!(error = %e, "cluster TLS files changed but do not load; keeping the previous ones")
                    }
                }
            }
        }
        (l.material.clone(), l.generation)
    }

    /// A client certificate (the peer of a connection this side accepted) checked against `m`.
    fn verify_client_with(
        &self,
        m: &Material,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
        expected: &Expected,
    ) -> Result<(), rustls::Error> {
        m.client_verifier
            .verify_client_cert(end_entity, intermediates, now)?;
        self.check_identity(&m.identity.trust_domain, end_entity, expected)?;
        Ok(())
    }

    /// A server certificate (the peer of a connection this side dialled) checked against `m`.
    fn verify_server_with(
        &self,
        m: &Material,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
        expected: &Expected,
    ) -> Result<(), rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &m.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        check_server_revocation(m, &self.provider, end_entity, intermediates, now)?;
        self.check_identity(&m.identity.trust_domain, end_entity, expected)?;
        Ok(())
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
        expected: &Expected,
    ) -> Result<Identity, rustls::Error> {
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
        if id.role != expected.role {
            return Err(refuse(format!(
                "{id} presents where a {} is expected",
                expected.role
            )));
        }
        if let Some(name) = expected.name.as_deref().filter(|n| *n != id.name.as_str()) {
            return Err(refuse(format!(
                "{id} presents where the {} {name} is expected",
                expected.role
            )));
        }
        Ok(id)
    }

    /// What this side accepts from the peers of its cluster connections.
    pub(crate) fn expected_peer(&self) -> Expected {
        Expected::any(self.side.peer_role())
    }

    /// The server configuration of the cluster listener (a worker's, or a controller's for
    /// workers' heartbeats): client certificates of the other role required and checked.
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<ServerConfig>, TlsError> {
        self.server_config_expecting(self.expected_peer())
    }

    /// The controller's client configuration towards workers: its certificate presented, the
    /// worker's checked.
    pub fn client_config(self: &Arc<Self>) -> Result<Arc<ClientConfig>, TlsError> {
        self.client_config_expecting(self.expected_peer())
            .map(Arc::new)
    }

    /// The server configuration of a controller's peer listener: client certificates of
    /// controllers (of this trust domain) only.
    pub fn peer_server_config(self: &Arc<Self>) -> Result<Arc<ServerConfig>, TlsError> {
        self.check_controller()?;
        self.server_config_expecting(Expected::any(Role::Controller))
    }

    /// A controller's client configuration towards the controller `name`'s peer listener:
    /// the server must present exactly `spiffe://<domain>/controller/<name>`, so a call (and
    /// the caller's token in it) goes to that controller or nowhere, whoever answers at its
    /// address (a reused pod IP, a spoofed address).
    pub fn peer_client_config(self: &Arc<Self>, name: &str) -> Result<ClientConfig, TlsError> {
        self.check_controller()?;
        self.client_config_expecting(Expected::named(Role::Controller, name))
    }

    fn check_controller(&self) -> Result<(), TlsError> {
        match self.side {
            Side::Controller => Ok(()),
            Side::Worker => Err(TlsError::Material {
                path: self.files.cert.clone(),
                reason: "only a controller talks to other controllers".into(),
            }),
        }
    }

    fn server_config_expecting(
        self: &Arc<Self>,
        expected: Expected,
    ) -> Result<Arc<ServerConfig>, TlsError> {
        let mut cfg = ServerConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(Arc::new(PeerVerifier {
                src: self.clone(),
                expected,
            }))
            .with_cert_resolver(Arc::new(OwnCert(self.clone())));
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        // No session resumption: a resumed TLS 1.3 session skips the peer's certificate, so a
        // peer revoked (or expired) since its first connection would get back in unchecked.
        cfg.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        cfg.send_tls13_tickets = 0;
        Ok(Arc::new(cfg))
    }

    fn client_config_expecting(
        self: &Arc<Self>,
        expected: Expected,
    ) -> Result<ClientConfig, TlsError> {
        let mut cfg = ClientConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PeerVerifier {
                src: self.clone(),
                expected,
            }))
            .with_client_cert_resolver(Arc::new(OwnCert(self.clone())));
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        // Every connection verifies the peer's certificate afresh (see `server_config`).
        cfg.resumption = rustls::client::Resumption::disabled();
        Ok(cfg)
    }

    /// The generation of the material in use: it moves when the files change (a new CRL,
    /// CA or own certificate), so long-lived clients know to build new connections.
    pub fn generation(&self) -> u64 {
        self.current_generation().1
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
    let crl_ders = load_crls(&files.crl, &ca_bytes)?;
    let crls = crl_ders
        .iter()
        .map(|der| {
            webpki::OwnedCertRevocationList::from_der(der)
                .map(webpki::CertRevocationList::from)
                .map_err(|e| TlsError::Material {
                    path: files.crl.clone(),
                    reason: format!("{e:?}"),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let roots = Arc::new(roots);
    let mut builder = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone());
    if !crl_ders.is_empty() {
        // The peer's own certificate only (as for a server, below); a certificate whose issuer
        // has no CRL here is refused rather than let through unchecked.
        builder = builder
            .with_crls(crl_ders)
            .only_check_end_entity_revocation();
    }
    let client_verifier = builder.build().map_err(|e| TlsError::Material {
        path: files.ca.clone(),
        reason: e.to_string(),
    })?;
    Ok(Material {
        identity,
        key: Arc::new(key),
        roots,
        crls,
        client_verifier,
    })
}

/// The CRLs in `path`, when it exists: one per CA certificate of `ca_pem`, each issued and
/// signed by it. Anything else is refused here rather than at every handshake.
fn load_crls(
    path: &Path,
    ca_pem: &[u8],
) -> Result<Vec<CertificateRevocationListDer<'static>>, TlsError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(TlsError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let bad = |reason: String| TlsError::Material {
        path: path.to_path_buf(),
        reason,
    };
    let crls: Vec<CertificateRevocationListDer<'static>> =
        CertificateRevocationListDer::pem_slice_iter(&bytes)
            .collect::<Result<_, _>>()
            .map_err(pem_err(path))?;
    if crls.is_empty() {
        return Err(bad("no CRL in the file".into()));
    }
    let cas: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(ca_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| bad(format!("ca.pem: {e}")))?;
    let mut covered = vec![false; cas.len()];
    for der in &crls {
        let (_, crl) =
            x509_parser::parse_x509_crl(der).map_err(|e| bad(format!("unreadable CRL: {e}")))?;
        let mut signed_by_a_ca = false;
        for (i, ca) in cas.iter().enumerate() {
            let Ok((_, ca)) = x509_parser::parse_x509_certificate(ca) else {
                continue;
            };
            if ca.subject().as_raw() == crl.issuer().as_raw()
                && crl.verify_signature(ca.public_key()).is_ok()
            {
                signed_by_a_ca = true;
                covered[i] = true;
            }
        }
        if !signed_by_a_ca {
            return Err(bad(format!(
                "the CRL of {} is not signed by a CA of ca.pem",
                crl.issuer()
            )));
        }
    }
    if let Some(i) = covered.iter().position(|c| !c) {
        let subject = x509_parser::parse_x509_certificate(&cas[i])
            .map(|(_, c)| c.subject().to_string())
            .unwrap_or_default();
        return Err(bad(format!(
            "no CRL for the CA {subject:?} of ca.pem (one per CA, or its members would all be refused)"
        )));
    }
    Ok(crls)
}

/// Whether the server certificate `end_entity` is revoked by `m`'s CRLs (its chain is checked
/// already; this builds it again with the revocation lookup, which rustls' server-side helper
/// does not offer without also matching a DNS name).
fn check_server_revocation(
    m: &Material,
    provider: &CryptoProvider,
    end_entity: &CertificateDer<'_>,
    intermediates: &[CertificateDer<'_>],
    now: UnixTime,
) -> Result<(), rustls::Error> {
    let refs: Vec<&webpki::CertRevocationList<'_>> = m.crls.iter().collect();
    let Ok(builder) = webpki::RevocationOptionsBuilder::new(&refs) else {
        return Ok(()); // No CRL: nothing to look up.
    };
    let revocation = builder
        .with_depth(webpki::RevocationCheckDepth::EndEntity)
        .with_status_policy(webpki::UnknownStatusPolicy::Deny)
        .with_expiration_policy(webpki::ExpirationPolicy::Ignore)
        .build();
    let cert = webpki::EndEntityCert::try_from(end_entity)
        .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
    cert.verify_for_usage(
        provider.signature_verification_algorithms.all,
        &m.roots.roots,
        intermediates,
        now,
        webpki::KeyUsage::server_auth(),
        Some(revocation),
        None,
    )
    .map(|_| ())
    .map_err(|e| {
        rustls::Error::InvalidCertificate(match e {
            webpki::Error::CertRevoked => CertificateError::Revoked,
            webpki::Error::UnknownRevocationStatus => CertificateError::UnknownRevocationStatus,
            other => CertificateError::Other(rustls::OtherError(Arc::new(other))),
        })
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
struct PeerVerifier {
    src: Arc<TlsSource>,
    expected: Expected,
}

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
        self.src.verify_client_with(
            &self.src.current(),
            end_entity,
            intermediates,
            now,
            &self.expected,
        )?;
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
            &self.src.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.src
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
        self.src.verify_server_with(
            &self.src.current(),
            end_entity,
            intermediates,
            now,
            &self.expected,
        )?;
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::ca::{Ca, MemberName, DEFAULT_CA_TTL, DEFAULT_LEAF_TTL};

    /// A CA in `tmp/ca` and identities `c1` (controller), `w1` and `w2` (workers).
    pub(crate) struct Pki {
        tmp: tempfile::TempDir,
        ca: Ca,
    }

    impl Pki {
        pub(crate) fn new() -> Pki {
            let tmp = tempfile::tempdir().unwrap();
            let td = TrustDomain::new("unit.test").unwrap();
            let ca = Ca::init(&tmp.path().join("ca"), &td, DEFAULT_CA_TTL).unwrap();
            let pki = Pki { tmp, ca };
            pki.issue(Role::Controller, "c1");
            pki.issue(Role::Worker, "w1");
            pki.issue(Role::Worker, "w2");
            pki
        }

        fn dir(&self, name: &str) -> PathBuf {
            self.tmp.path().join(name)
        }

        pub(crate) fn issue(&self, role: Role, name: &str) {
            self.ca
                .issue(role, &MemberName::new(name).unwrap(), DEFAULT_LEAF_TTL)
                .unwrap()
                .write_to(&self.dir(name))
                .unwrap();
        }

        pub(crate) fn source(&self, name: &str, side: Side) -> Arc<TlsSource> {
            TlsSource::load(TlsFiles::in_dir(&self.dir(name)), side, TlsMetrics::new()).unwrap()
        }

        fn revoke(&self, name: &str) {
            self.ca
                .revoke_certificate(&self.dir(name).join(CERT))
                .unwrap();
        }

        /// The operator's copy of the CA's CRL into a member's directory.
        fn copy_crl_to(&self, name: &str) {
            std::fs::copy(self.dir("ca").join(CRL), self.dir(name).join(CRL)).unwrap();
        }
    }

    /// Makes the next handshake look at the files (instead of waiting for the interval).
    fn look_now(src: &TlsSource) {
        let mut l = src.loaded.lock().unwrap();
        l.checked = Instant::now()
            .checked_sub(RELOAD_CHECK)
            .expect("the clock is past the reload interval");
    }

    #[derive(Debug)]
    enum Refused {
        ByServer(rustls::Error),
        ByClient(rustls::Error),
    }

    /// A TLS handshake in memory between `client` dialling and `server` accepting.
    fn handshake(client: &Arc<TlsSource>, server: &Arc<TlsSource>) -> Result<(), Refused> {
        handshake_with(
            client.client_config().unwrap(),
            server.server_config().unwrap(),
        )
        .map(drop)
    }

    /// A handshake with these configurations (kept across handshakes, as a long-lived
    /// connector and acceptor keep theirs); answers whether the session was resumed.
    fn handshake_with(
        client: Arc<ClientConfig>,
        server: Arc<ServerConfig>,
    ) -> Result<bool, Refused> {
        let name = ServerName::try_from("torpor-peer").unwrap();
        let mut c = rustls::ClientConnection::new(client, name).unwrap();
        let mut s = rustls::ServerConnection::new(server).unwrap();
        for _ in 0..10 {
            let mut buf = Vec::new();
            while c.wants_write() {
                c.write_tls(&mut buf).unwrap();
            }
            let mut rd = &buf[..];
            while !rd.is_empty() {
                s.read_tls(&mut rd).unwrap();
            }
            s.process_new_packets().map_err(Refused::ByServer)?;
            let mut buf = Vec::new();
            while s.wants_write() {
                s.write_tls(&mut buf).unwrap();
            }
            let mut rd = &buf[..];
            while !rd.is_empty() {
                c.read_tls(&mut rd).unwrap();
            }
            c.process_new_packets().map_err(Refused::ByClient)?;
            if !c.is_handshaking() && !s.is_handshaking() {
                // Let the client read the server's last flight (session tickets, if any).
                let mut buf = Vec::new();
                while s.wants_write() {
                    s.write_tls(&mut buf).unwrap();
                }
                let mut rd = &buf[..];
                while !rd.is_empty() {
                    c.read_tls(&mut rd).unwrap();
                }
                c.process_new_packets().map_err(Refused::ByClient)?;
                return Ok(c.handshake_kind() == Some(rustls::HandshakeKind::Resumed));
            }
        }
        panic!("the handshake did not finish");
    }

    fn reason_of(e: rustls::Error) -> &'static str {
        refusal_reason(&std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }

    #[test]
    fn a_revoked_worker_is_refused_by_a_running_controller_once_the_crl_is_there() {
        let pki = Pki::new();
        let controller = pki.source("c1", Side::Controller);
        let w1 = pki.source("w1", Side::Worker);
        let w2 = pki.source("w2", Side::Worker);
        handshake(&w1, &controller).unwrap();

        pki.revoke("w1");
        // Until the controller has the CRL, nothing changes.
        handshake(&w1, &controller).unwrap();
        pki.copy_crl_to("c1");
        look_now(&controller);
        match handshake(&w1, &controller) {
            Err(Refused::ByServer(e)) => assert_eq!(reason_of(e), "revoked"),
            other => panic!("a revoked worker was not refused: {other:?}"),
        }
        // The other worker, and the controller dialling it, are unaffected.
        handshake(&w2, &controller).unwrap();
        handshake(&controller, &pki.source("w2", Side::Worker)).unwrap();
        // The controller dialling the revoked worker's Node service refuses it too.
        match handshake(&controller, &w1) {
            Err(Refused::ByClient(e)) => assert_eq!(reason_of(e), "revoked"),
            other => panic!("a revoked worker's server was not refused: {other:?}"),
        }
    }

    #[test]
    fn a_peer_that_connected_before_its_revocation_cannot_resume_its_session() {
        let pki = Pki::new();
        let controller = pki.source("c1", Side::Controller);
        let w1 = pki.source("w1", Side::Worker);
        // One connector and one acceptor for every connection, as the processes keep them.
        let (dial, accept) = (
            w1.client_config().unwrap(),
            controller.server_config().unwrap(),
        );
        let (back, serve) = (
            controller.client_config().unwrap(),
            w1.server_config().unwrap(),
        );
        assert!(!handshake_with(dial.clone(), accept.clone()).unwrap());
        assert!(!handshake_with(back.clone(), serve.clone()).unwrap());
        assert!(
            !handshake_with(dial.clone(), accept.clone()).unwrap(),
            "a reconnection is a full handshake (no resumption that skips the certificate)"
        );
        pki.revoke("w1");
        pki.copy_crl_to("c1");
        look_now(&controller);
        assert!(matches!(
            handshake_with(dial, accept),
            Err(Refused::ByServer(_))
        ));
        assert!(matches!(
            handshake_with(back, serve),
            Err(Refused::ByClient(_))
        ));
    }

    #[test]
    fn a_worker_refuses_a_revoked_controller_both_ways() {
        let pki = Pki::new();
        pki.issue(Role::Controller, "c2");
        pki.revoke("c1");
        pki.copy_crl_to("w1");
        let w1 = pki.source("w1", Side::Worker);
        let c1 = pki.source("c1", Side::Controller);
        match handshake(&c1, &w1) {
            Err(Refused::ByServer(e)) => assert_eq!(reason_of(e), "revoked"),
            other => panic!("a revoked controller dialled a worker: {other:?}"),
        }
        match handshake(&w1, &c1) {
            Err(Refused::ByClient(e)) => assert_eq!(reason_of(e), "revoked"),
            other => panic!("a worker joined a revoked controller: {other:?}"),
        }
        let c2 = pki.source("c2", Side::Controller);
        handshake(&c2, &w1).unwrap();
        handshake(&w1, &c2).unwrap();
    }

    #[test]
    fn a_crl_of_another_ca_is_not_taken_and_the_previous_one_stays() {
        let pki = Pki::new();
        pki.revoke("w1");
        pki.copy_crl_to("c1");
        let controller = pki.source("c1", Side::Controller);
        let w1 = pki.source("w1", Side::Worker);
        assert!(handshake(&w1, &controller).is_err());

        // Another CA (same trust domain name) revokes something: its CRL is not ours.
        let rogue_dir = pki.dir("rogue");
        let rogue = Ca::init(
            &rogue_dir,
            &TrustDomain::new("unit.test").unwrap(),
            DEFAULT_CA_TTL,
        )
        .unwrap();
        rogue
            .issue(
                Role::Worker,
                &MemberName::new("x").unwrap(),
                DEFAULT_LEAF_TTL,
            )
            .unwrap()
            .write_to(&pki.dir("x"))
            .unwrap();
        rogue.revoke_certificate(&pki.dir("x").join(CERT)).unwrap();
        std::fs::copy(rogue_dir.join(CRL), pki.dir("c1").join(CRL)).unwrap();
        let err = TlsSource::load(
            TlsFiles::in_dir(&pki.dir("c1")),
            Side::Controller,
            TlsMetrics::new(),
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("not signed by a CA of ca.pem"),
            "{err}"
        );
        // A running side keeps its previous CRL: w1 stays refused.
        look_now(&controller);
        assert!(matches!(
            handshake(&w1, &controller),
            Err(Refused::ByServer(_))
        ));
        // A file that is no CRL at all is not taken either.
        std::fs::write(pki.dir("c1").join(CRL), "not a crl").unwrap();
        assert!(TlsSource::load(
            TlsFiles::in_dir(&pki.dir("c1")),
            Side::Controller,
            TlsMetrics::new()
        )
        .is_err());
    }

    /// The chain `name` presents (its `cert.pem`).
    fn chain_of(pki: &Pki, name: &str) -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_file_iter(pki.dir(name).join(CERT))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    #[test]
    fn a_controller_forwards_only_to_the_controller_it_names_and_the_peer_listener_takes_only_controllers(
    ) {
        let pki = Pki::new();
        pki.issue(Role::Controller, "c2");
        pki.issue(Role::Controller, "c3");
        let c1 = pki.source("c1", Side::Controller);
        let c2 = pki.source("c2", Side::Controller);
        let c3 = pki.source("c3", Side::Controller);
        let w1 = pki.source("w1", Side::Worker);
        let to_c1 = || Arc::new(c2.peer_client_config("c1").unwrap());
        handshake_with(to_c1(), c1.peer_server_config().unwrap()).unwrap();

        // Another controller of the domain answering at c1's address (a reused pod IP): c2
        // hangs up before sending anything.
        match handshake_with(to_c1(), c3.peer_server_config().unwrap()) {
            Err(Refused::ByClient(e)) => assert_eq!(reason_of(e), "wrong_identity"),
            other => panic!("c2 talked to c3 as c1: {other:?}"),
        }
        // A worker's certificate at c1's address, likewise.
        match handshake_with(to_c1(), w1.server_config().unwrap()) {
            Err(Refused::ByClient(e)) => assert_eq!(reason_of(e), "wrong_identity"),
            other => panic!("c2 talked to a worker as c1: {other:?}"),
        }
        // The peer listener refuses a worker's certificate (and a worker builds no peer
        // configuration at all); the workers' listener refuses a controller as a worker.
        match handshake_with(
            w1.client_config().unwrap(),
            c1.peer_server_config().unwrap(),
        ) {
            Err(Refused::ByServer(e)) => assert_eq!(reason_of(e), "wrong_identity"),
            other => panic!("a worker reached the peer listener: {other:?}"),
        }
        assert!(w1.peer_server_config().is_err());
        assert!(w1.peer_client_config("c1").is_err());
        match handshake_with(to_c1(), c1.server_config().unwrap()) {
            Err(Refused::ByServer(e)) => assert_eq!(reason_of(e), "wrong_identity"),
            other => panic!("a controller joined as a worker: {other:?}"),
        }

        // c2 revoked: refused at the handshake once c1 has the CRL, and its open
        // connection to c1's peer listener is cut.
        let open = c1.watch_expecting(
            (),
            Direction::Accepted,
            None,
            chain_of(&pki, "c2"),
            Expected::any(Role::Controller),
        );
        let generation = c1.generation();
        pki.revoke("c2");
        pki.copy_crl_to("c1");
        look_now(&c1);
        assert!(c1.generation() > generation, "the CRL moves the material");
        match handshake_with(to_c1(), c1.peer_server_config().unwrap()) {
            Err(Refused::ByServer(e)) => assert_eq!(reason_of(e), "revoked"),
            other => panic!("a revoked controller was served: {other:?}"),
        }
        let refused = c1.sweep(UnixTime::now());
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].reason, "revoked");
        assert!(open.is_cut());
        handshake_with(
            Arc::new(c3.peer_client_config("c1").unwrap()),
            c1.peer_server_config().unwrap(),
        )
        .unwrap();
    }

    #[test]
    fn open_connections_of_a_revoked_worker_are_cut_once_the_crl_is_there() {
        let pki = Pki::new();
        let controller = pki.source("c1", Side::Controller);
        // The worker's heartbeat channel (accepted) and the controller's channel to its Node
        // service (dialled), and another worker's.
        let heartbeat = controller.watch((), Direction::Accepted, None, chain_of(&pki, "w1"));
        let node = controller.watch((), Direction::Dialled, None, chain_of(&pki, "w1"));
        let other = controller.watch((), Direction::Accepted, None, chain_of(&pki, "w2"));
        assert_eq!(controller.open_connections(), 3);
        assert!(controller.sweep(UnixTime::now()).is_empty());

        pki.revoke("w1");
        // Without the CRL in its directory, nothing changes.
        look_now(&controller);
        assert!(controller.sweep(UnixTime::now()).is_empty());
        assert!(!heartbeat.is_cut());

        pki.copy_crl_to("c1");
        look_now(&controller);
        let refused = controller.sweep(UnixTime::now());
        assert_eq!(refused.len(), 2, "{refused:?}");
        for r in &refused {
            assert_eq!(r.reason, "revoked");
            assert_eq!(r.identity, "spiffe://unit.test/worker/w1");
        }
        assert!(heartbeat.is_cut() && node.is_cut());
        assert!(!other.is_cut(), "another worker keeps its connection");
        assert_eq!(controller.metrics().refused(Side::Controller, "revoked"), 2);
        // Refused once: a later sweep does not count it again.
        look_now(&controller);
        assert!(controller.sweep(UnixTime::now()).is_empty());
        assert_eq!(controller.metrics().refused(Side::Controller, "revoked"), 2);
        // A connection that ends leaves the table.
        drop(heartbeat);
        assert_eq!(controller.open_connections(), 2);
    }

    #[test]
    fn a_worker_cuts_a_revoked_controllers_open_connections_both_ways() {
        let pki = Pki::new();
        let w1 = pki.source("w1", Side::Worker);
        let calls = w1.watch((), Direction::Accepted, None, chain_of(&pki, "c1"));
        let heartbeat = w1.watch((), Direction::Dialled, None, chain_of(&pki, "c1"));
        pki.revoke("c1");
        pki.copy_crl_to("w1");
        look_now(&w1);
        let refused = w1.sweep(UnixTime::now());
        assert_eq!(refused.len(), 2, "{refused:?}");
        assert!(calls.is_cut() && heartbeat.is_cut());
        assert_eq!(w1.metrics().refused(Side::Worker, "revoked"), 2);
    }

    #[test]
    fn a_peer_whose_certificate_expires_while_connected_is_cut() {
        let pki = Pki::new();
        let controller = pki.source("c1", Side::Controller);
        let conn = controller.watch((), Direction::Accepted, None, chain_of(&pki, "w1"));
        assert!(controller.sweep(UnixTime::now()).is_empty());
        // No file changed; the clock passes the certificate's notAfter.
        let later = UnixTime::since_unix_epoch(
            Duration::from_secs(UnixTime::now().as_secs())
                + DEFAULT_LEAF_TTL
                + Duration::from_secs(60),
        );
        let refused = controller.sweep(later);
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].reason, "expired");
        assert!(conn.is_cut());
        assert_eq!(controller.metrics().refused(Side::Controller, "expired"), 1);
    }

    #[tokio::test]
    async fn a_cut_connection_fails_the_read_waiting_on_it() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let pki = Pki::new();
        let controller = pki.source("c1", Side::Controller);
        let (ours, mut theirs) = tokio::io::duplex(64);
        let mut conn = controller.watch(ours, Direction::Accepted, None, chain_of(&pki, "w1"));
        theirs.write_all(b"x").await.unwrap();
        let mut b = [0u8; 1];
        conn.read_exact(&mut b).await.unwrap();
        // A read waits for the peer; the revocation ends it.
        let waiting = tokio::spawn(async move {
            let mut b = [0u8; 1];
            let r = conn.read(&mut b).await;
            (r.map_err(|e| e.kind()), conn)
        });
        pki.revoke("w1");
        pki.copy_crl_to("c1");
        look_now(&controller);
        assert_eq!(controller.sweep(UnixTime::now()).len(), 1);
        let (read, mut conn) = waiting.await.unwrap();
        assert_eq!(read, Err(std::io::ErrorKind::ConnectionAborted));
        assert!(conn.write_all(b"y").await.is_err(), "writes fail too");
    }

    #[test]
    fn reasons_name_revocation() {
        assert!(REFUSAL_REASONS.contains(&"revoked"));
        assert_eq!(
            reason_of(rustls::Error::InvalidCertificate(CertificateError::Revoked)),
            "revoked"
        );
        let m = TlsMetrics::new();
        assert_eq!(m.refused(Side::Controller, "revoked"), 0);
    }
}
