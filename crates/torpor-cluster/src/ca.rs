//! The trust domain's certificate authority (`torpor ca init`, `torpor ca issue`) and the
//! identities it vouches for.
//!
//! Every controller and worker of a cluster holds a certificate whose one URI subject
//! alternative name is its SPIFFE-style identity, `spiffe://<trust domain>/<role>/<name>`
//! with role `controller` or `worker`. The CA's own certificate carries `spiffe://<trust
//! domain>`, so `issue` learns the domain from `ca.pem`. Leaf certificates are short-lived
//! (24 h unless told otherwise) and allowed for both TLS client and server use: the role is
//! decided by the identity, not by the key usage, so the connection's direction may change
//! without new certificates. Keys are ECDSA P-256; every file holding a key is written 0600.
//!
//! An operator's own CA (cert-manager, Vault) works as well, as long as it issues certificates
//! with these URIs: nothing but `ca.pem` (and `crl.pem`, when there is one) of this module is
//! read by the TLS side.
//!
//! Revocation (`torpor ca revoke`): the CA directory keeps the list of revoked serial numbers
//! in `revoked.json` (versioned) and, after each revocation, a CRL signed by the CA in
//! `crl.pem`, listing every serial ever revoked with a CRL number one higher than the last.
//! The operator copies `crl.pem` next to each member's identity (`OUT/crl.pem`); `torpor ca
//! issue` does it for the identities it writes. The TLS side reloads it like the certificates.

use std::fmt;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyIdMethod, KeyPair, KeyUsagePurpose,
    RevokedCertParams, SanType, SerialNumber,
};
use time::OffsetDateTime;

/// The trust domain used when `torpor ca init` is given none.
pub const DEFAULT_TRUST_DOMAIN: &str = "torpor.local";
/// How long an issued certificate is valid unless told otherwise.
pub const DEFAULT_LEAF_TTL: Duration = Duration::from_secs(24 * 3600);
/// How long a new CA is valid unless told otherwise.
pub const DEFAULT_CA_TTL: Duration = Duration::from_secs(365 * 24 * 3600);
/// Issued certificates start this long before "now", for clocks a little behind.
const BACKDATE: Duration = Duration::from_secs(300);

/// The files of a CA directory and of an issued identity directory.
pub const CA_CERT: &str = "ca.pem";
pub const CA_KEY: &str = "ca.key";
pub const CERT: &str = "cert.pem";
pub const KEY: &str = "key.pem";
/// The CA's certificate revocation list, in the CA directory and next to an identity.
pub const CRL: &str = "crl.pem";
/// The CA directory's record of revoked serial numbers (what `crl.pem` is made from).
pub const REVOKED: &str = "revoked.json";
/// How long a CRL says it is current (its `nextUpdate`). torpor itself keeps using a CRL past
/// it (a stale list still names what is revoked); other tools may not.
pub const CRL_VALIDITY: Duration = Duration::from_secs(30 * 24 * 3600);
/// The version of `revoked.json`'s format.
const REVOKED_FORMAT: u32 = 1;
/// Reading `revoked.json` stops here (about 100,000 revocations).
const REVOKED_MAX_BYTES: u64 = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("invalid trust domain {0:?}: lowercase letters, digits, '.', '-' and '_', 1 to 255 characters")]
    TrustDomain(String),
    #[error("invalid name {0:?}: lowercase letters, digits, '.', '-' and '_', 1 to 63 characters")]
    Name(String),
    #[error("invalid role {0:?}: controller or worker")]
    Role(String),
    #[error("not a torpor identity: {0}")]
    Identity(String),
    #[error("{path} already exists; a CA is never overwritten (remove it first to start over)")]
    Exists { path: PathBuf },
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a CA made by `torpor ca init`: {reason}")]
    NotOurCa { path: PathBuf, reason: String },
    #[error("certificate generation")]
    Generate(#[from] rcgen::Error),
    #[error("lifetime {0:?} is out of range")]
    Lifetime(Duration),
    #[error("the system's random number generator failed")]
    Random,
    #[error("invalid serial number {0:?}: hexadecimal digits, optionally separated by ':'")]
    Serial(String),
    #[error("{path}: not a certificate issued by this CA: {reason}")]
    NotIssuedHere { path: PathBuf, reason: String },
    #[error("{path}: unreadable revocation record: {reason}")]
    Record { path: PathBuf, reason: String },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CaError + '_ {
    move |source| CaError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A SPIFFE trust domain: the cluster whose CA vouches for an identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TrustDomain(String);

impl TrustDomain {
    pub fn new(s: &str) -> Result<TrustDomain, CaError> {
        let ok = !s.is_empty()
            && s.len() <= 255
            && s.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_')
            });
        if ok {
            Ok(TrustDomain(s.to_string()))
        } else {
            Err(CaError::TrustDomain(s.to_string()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `spiffe://<domain>`: the CA's own identity.
    pub fn uri(&self) -> String {
        format!("spiffe://{}", self.0)
    }
}

impl fmt::Display for TrustDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a cluster member is, which decides what it may ask of whom.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Serves the API and drives workers.
    Controller,
    /// Runs sandboxes on its machine for controllers.
    Worker,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Controller => "controller",
            Role::Worker => "worker",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = CaError;
    fn from_str(s: &str) -> Result<Role, CaError> {
        match s {
            "controller" => Ok(Role::Controller),
            "worker" => Ok(Role::Worker),
            other => Err(CaError::Role(other.to_string())),
        }
    }
}

/// A member's name within its role (`--name`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MemberName(String);

impl MemberName {
    pub fn new(s: &str) -> Result<MemberName, CaError> {
        let ok = !s.is_empty()
            && s.len() <= 63
            && s.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_')
            });
        if ok {
            Ok(MemberName(s.to_string()))
        } else {
            Err(CaError::Name(s.to_string()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for MemberName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// `spiffe://<trust domain>/<role>/<name>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    pub trust_domain: TrustDomain,
    pub role: Role,
    pub name: MemberName,
}

impl Identity {
    pub fn uri(&self) -> String {
        format!("spiffe://{}/{}/{}", self.trust_domain, self.role, self.name)
    }

    /// Parses a member's SPIFFE URI (not the CA's, which has no path).
    pub fn parse(uri: &str) -> Result<Identity, CaError> {
        let bad = || CaError::Identity(format!("{uri:?} is not spiffe://<domain>/<role>/<name>"));
        let rest = uri.strip_prefix("spiffe://").ok_or_else(bad)?;
        let mut parts = rest.split('/');
        let (Some(domain), Some(role), Some(name), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        Ok(Identity {
            trust_domain: TrustDomain::new(domain)?,
            role: role.parse()?,
            name: MemberName::new(name)?,
        })
    }

    /// The one SPIFFE identity a DER certificate names in its URI SANs. A certificate with
    /// none, or with more than one, is not a torpor identity.
    pub fn of_certificate(der: &[u8]) -> Result<Identity, CaError> {
        let uris = spiffe_uris(der)?;
        match uris.as_slice() {
            [one] => Identity::parse(one),
            [] => Err(CaError::Identity(
                "the certificate names no spiffe:// URI".into(),
            )),
            _ => Err(CaError::Identity(
                "the certificate names more than one spiffe:// URI".into(),
            )),
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.uri())
    }
}

/// The `spiffe://` URIs among a DER certificate's subject alternative names.
fn spiffe_uris(der: &[u8]) -> Result<Vec<String>, CaError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| CaError::Identity(format!("unreadable certificate: {e}")))?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| CaError::Identity(format!("unreadable subject alternative names: {e}")))?;
    let mut out = Vec::new();
    if let Some(san) = san {
        for name in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::URI(u) = name {
                if u.starts_with("spiffe://") {
                    out.push(u.to_string());
                }
            }
        }
    }
    Ok(out)
}

/// A certificate and its key, PEM-encoded, with the CA certificate that signed it.
pub struct Issued {
    pub identity: Identity,
    pub cert_pem: String,
    pub key_pem: String,
    pub ca_pem: String,
    /// The CA's current CRL, when it has revoked anything.
    pub crl_pem: Option<String>,
    pub not_after: OffsetDateTime,
}

impl Issued {
    /// Writes `DIR/cert.pem`, `DIR/key.pem` and `DIR/ca.pem` (each 0600; the directory 0700
    /// when made here), and `DIR/crl.pem` when the CA has one. Files are replaced by a rename,
    /// so a reader never sees half a file: a running worker or controller picks the new ones
    /// up (rotation without restart).
    pub fn write_to(&self, dir: &Path) -> Result<(), CaError> {
        make_private_dir(dir)?;
        if let Some(crl) = &self.crl_pem {
            write_private(&dir.join(CRL), crl.as_bytes())?;
        }
        write_private(&dir.join(CA_CERT), self.ca_pem.as_bytes())?;
        write_private(&dir.join(KEY), self.key_pem.as_bytes())?;
        write_private(&dir.join(CERT), self.cert_pem.as_bytes())?;
        Ok(())
    }
}

/// A CA directory: `ca.pem` (the certificate every member trusts) and `ca.key`.
pub struct Ca {
    dir: PathBuf,
    trust_domain: TrustDomain,
    cert_pem: String,
    key: KeyPair,
}

impl Ca {
    /// Makes a new CA for `trust_domain` in `dir`. Refuses to overwrite an existing one.
    pub fn init(dir: &Path, trust_domain: &TrustDomain, ttl: Duration) -> Result<Ca, CaError> {
        let key_path = dir.join(CA_KEY);
        for p in [&key_path, &dir.join(CA_CERT)] {
            if p.exists() {
                return Err(CaError::Exists { path: p.clone() });
            }
        }
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "torpor");
        dn.push(
            DnType::CommonName,
            format!("torpor CA {}", trust_domain.as_str()),
        );
        params.distinguished_name = dn;
        params.subject_alt_names = vec![SanType::URI(trust_domain.uri().try_into()?)];
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.serial_number = Some(random_serial()?);
        let now = OffsetDateTime::now_utc();
        params.not_before = now - BACKDATE;
        params.not_after = now + to_time(ttl)?;
        let cert = params.self_signed(&key)?;
        make_private_dir(dir)?;
        write_private(&key_path, key.serialize_pem().as_bytes())?;
        write_private(&dir.join(CA_CERT), cert.pem().as_bytes())?;
        Ok(Ca {
            dir: dir.to_path_buf(),
            trust_domain: trust_domain.clone(),
            cert_pem: cert.pem(),
            key,
        })
    }

    /// Opens the CA in `dir` (made by [`Ca::init`]).
    pub fn load(dir: &Path) -> Result<Ca, CaError> {
        let cert_path = dir.join(CA_CERT);
        let cert_pem = fs::read_to_string(&cert_path).map_err(io_err(&cert_path))?;
        let key_path = dir.join(CA_KEY);
        let key_pem = fs::read_to_string(&key_path).map_err(io_err(&key_path))?;
        let not_ours = |reason: String| CaError::NotOurCa {
            path: cert_path.clone(),
            reason,
        };
        let key = KeyPair::from_pem(&key_pem).map_err(|e| not_ours(format!("ca.key: {e}")))?;
        let der = rustls_pki_types::pem::PemObject::from_pem_slice(cert_pem.as_bytes())
            .map(|d: rustls_pki_types::CertificateDer<'static>| d)
            .map_err(|e| not_ours(format!("ca.pem: {e}")))?;
        let uris = spiffe_uris(&der)?;
        let domain = match uris.as_slice() {
            [one] => one
                .strip_prefix("spiffe://")
                .filter(|d| !d.contains('/'))
                .ok_or_else(|| not_ours(format!("{one} is not a trust domain URI")))?,
            _ => return Err(not_ours("no spiffe:// trust domain URI".into())),
        };
        Ok(Ca {
            dir: dir.to_path_buf(),
            trust_domain: TrustDomain::new(domain)?,
            cert_pem,
            key,
        })
    }

    pub fn trust_domain(&self) -> &TrustDomain {
        &self.trust_domain
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Issues a certificate for `role`/`name`, valid from now for `ttl`.
    pub fn issue(&self, role: Role, name: &MemberName, ttl: Duration) -> Result<Issued, CaError> {
        let now = OffsetDateTime::now_utc();
        self.issue_at(role, name, now - BACKDATE, now + to_time(ttl)?)
    }

    /// Issues a certificate valid between two instants (tests use one already expired).
    pub fn issue_between(
        &self,
        role: Role,
        name: &MemberName,
        not_before: std::time::SystemTime,
        not_after: std::time::SystemTime,
    ) -> Result<Issued, CaError> {
        self.issue_at(role, name, not_before.into(), not_after.into())
    }

    fn issue_at(
        &self,
        role: Role,
        name: &MemberName,
        not_before: OffsetDateTime,
        not_after: OffsetDateTime,
    ) -> Result<Issued, CaError> {
        let identity = Identity {
            trust_domain: self.trust_domain.clone(),
            role,
            name: name.clone(),
        };
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "torpor");
        dn.push(DnType::CommonName, format!("{role} {name}"));
        params.distinguished_name = dn;
        params.subject_alt_names = vec![SanType::URI(identity.uri().try_into()?)];
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        params.serial_number = Some(random_serial()?);
        params.not_before = not_before;
        params.not_after = not_after;
        let issuer = Issuer::from_ca_cert_pem(&self.cert_pem, &self.key)?;
        let cert = params.signed_by(&key, &issuer)?;
        let crl_path = self.dir.join(CRL);
        let crl_pem = match fs::read_to_string(&crl_path) {
            Ok(pem) => Some(pem),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(io_err(&crl_path)(e)),
        };
        Ok(Issued {
            identity,
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            ca_pem: self.cert_pem.clone(),
            crl_pem,
            not_after,
        })
    }

    /// Revokes the certificate in the PEM file `cert_path`, which must be one this CA signed.
    pub fn revoke_certificate(&self, cert_path: &Path) -> Result<Revocation, CaError> {
        let not_here = |reason: String| CaError::NotIssuedHere {
            path: cert_path.to_path_buf(),
            reason,
        };
        let pem = fs::read(cert_path).map_err(io_err(cert_path))?;
        let der: rustls_pki_types::CertificateDer<'static> =
            rustls_pki_types::pem::PemObject::from_pem_slice(&pem)
                .map_err(|e| not_here(e.to_string()))?;
        let (_, cert) =
            x509_parser::parse_x509_certificate(&der).map_err(|e| not_here(e.to_string()))?;
        let ca_der: rustls_pki_types::CertificateDer<'static> =
            rustls_pki_types::pem::PemObject::from_pem_slice(self.cert_pem.as_bytes())
                .map_err(|e| not_here(format!("ca.pem: {e}")))?;
        let (_, ca_cert) =
            x509_parser::parse_x509_certificate(&ca_der).map_err(|e| not_here(e.to_string()))?;
        if cert.issuer().as_raw() != ca_cert.subject().as_raw()
            || cert.verify_signature(Some(ca_cert.public_key())).is_err()
        {
            return Err(not_here("it is not signed by this CA's key".into()));
        }
        let identity = Identity::of_certificate(&der).ok().map(|i| i.uri());
        self.revoke(Serial::from_bytes(cert.raw_serial()), identity)
    }

    /// Revokes a certificate by its serial number (for one whose file is gone).
    pub fn revoke_serial(&self, serial: Serial) -> Result<Revocation, CaError> {
        self.revoke(serial, None)
    }

    /// Records `serial` in `revoked.json` and writes a new `crl.pem` listing every revoked
    /// serial. Revoking a serial twice keeps its first record and still writes the CRL.
    fn revoke(&self, serial: Serial, identity: Option<String>) -> Result<Revocation, CaError> {
        let record_path = self.dir.join(REVOKED);
        let mut record = RevocationRecord::read(&record_path)?;
        let now = OffsetDateTime::now_utc();
        let newly = !record.revoked.iter().any(|r| r.serial == serial.hex());
        if newly {
            record.revoked.push(RevokedEntry {
                serial: serial.hex(),
                identity: identity.clone(),
                revoked_at: now.unix_timestamp(),
            });
        }
        record.crl_number += 1;
        let crl_pem = self.sign_crl(&record, now)?;
        let json = serde_json::to_vec_pretty(&record).map_err(|e| CaError::Record {
            path: record_path.clone(),
            reason: e.to_string(),
        })?;
        // The record first: a CRL is always made from a record that is on disk.
        write_private(&record_path, &json)?;
        let crl_path = self.dir.join(CRL);
        write_private(&crl_path, crl_pem.as_bytes())?;
        Ok(Revocation {
            serial,
            identity,
            newly,
            listed: record.revoked.len(),
            crl_number: record.crl_number,
            crl_path,
        })
    }

    fn sign_crl(&self, record: &RevocationRecord, now: OffsetDateTime) -> Result<String, CaError> {
        let mut revoked_certs = Vec::with_capacity(record.revoked.len());
        for r in &record.revoked {
            revoked_certs.push(RevokedCertParams {
                serial_number: SerialNumber::from_slice(&Serial::parse(&r.serial)?.0),
                revocation_time: OffsetDateTime::from_unix_timestamp(r.revoked_at).map_err(
                    |e| CaError::Record {
                        path: self.dir.join(REVOKED),
                        reason: e.to_string(),
                    },
                )?,
                reason_code: None,
                invalidity_date: None,
            });
        }
        let params = CertificateRevocationListParams {
            this_update: now,
            next_update: now + to_time(CRL_VALIDITY)?,
            crl_number: SerialNumber::from(record.crl_number),
            issuing_distribution_point: None,
            revoked_certs,
            key_identifier_method: KeyIdMethod::Sha256,
        };
        let issuer = Issuer::from_ca_cert_pem(&self.cert_pem, &self.key)?;
        Ok(params.signed_by(&issuer)?.pem()?)
    }
}

/// A certificate's serial number: its magnitude, without leading zero bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Serial(Vec<u8>);

impl Serial {
    /// From the bytes of a DER INTEGER (a leading 0x00 of a positive number is dropped).
    pub fn from_bytes(bytes: &[u8]) -> Serial {
        let start = bytes
            .iter()
            .position(|&b| b != 0)
            .unwrap_or(bytes.len().saturating_sub(1));
        Serial(bytes[start..].to_vec())
    }

    /// Hexadecimal, with or without ':' between bytes (`openssl x509 -serial` prints
    /// `serial=3A5F…`; `-text` prints `3a:5f:…`).
    pub fn parse(s: &str) -> Result<Serial, CaError> {
        let bad = || CaError::Serial(s.to_string());
        let digits: String = s.trim().chars().filter(|c| *c != ':').collect();
        if digits.is_empty() || digits.len() > 64 || !digits.bytes().all(|b| b.is_ascii_hexdigit())
        {
            return Err(bad());
        }
        let padded = if digits.len() % 2 == 1 {
            format!("0{digits}")
        } else {
            digits
        };
        let bytes = (0..padded.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&padded[i..i + 2], 16).map_err(|_| bad()))
            .collect::<Result<Vec<u8>, _>>()?;
        Ok(Serial::from_bytes(&bytes))
    }

    /// Lowercase hexadecimal without separators.
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Display for Serial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

/// What `torpor ca revoke` did.
#[derive(Debug)]
pub struct Revocation {
    pub serial: Serial,
    /// The revoked certificate's identity, when revoked by its file.
    pub identity: Option<String>,
    /// False when the serial was revoked already.
    pub newly: bool,
    /// How many serials the new CRL lists.
    pub listed: usize,
    pub crl_number: u64,
    pub crl_path: PathBuf,
}

/// `revoked.json`.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RevocationRecord {
    version: u32,
    /// The number of the last CRL written.
    crl_number: u64,
    revoked: Vec<RevokedEntry>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RevokedEntry {
    /// Lowercase hexadecimal.
    serial: String,
    identity: Option<String>,
    /// Unix seconds.
    revoked_at: i64,
}

impl RevocationRecord {
    fn read(path: &Path) -> Result<RevocationRecord, CaError> {
        let bad = |reason: String| CaError::Record {
            path: path.to_path_buf(),
            reason,
        };
        let f = match fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(RevocationRecord {
                    version: REVOKED_FORMAT,
                    ..RevocationRecord::default()
                })
            }
            Err(e) => return Err(io_err(path)(e)),
        };
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(
            &mut std::io::Read::take(f, REVOKED_MAX_BYTES + 1),
            &mut bytes,
        )
        .map_err(io_err(path))?;
        if bytes.len() as u64 > REVOKED_MAX_BYTES {
            return Err(bad(format!("larger than {REVOKED_MAX_BYTES} bytes")));
        }
        let record: RevocationRecord =
            serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
        if record.version != REVOKED_FORMAT {
            return Err(bad(format!(
                "format version {} (this torpor reads {REVOKED_FORMAT})",
                record.version
            )));
        }
        for r in &record.revoked {
            Serial::parse(&r.serial).map_err(|e| bad(e.to_string()))?;
        }
        Ok(record)
    }
}

fn to_time(d: Duration) -> Result<time::Duration, CaError> {
    if d.is_zero() || d > Duration::from_secs(100 * 365 * 24 * 3600) {
        return Err(CaError::Lifetime(d));
    }
    time::Duration::try_from(d).map_err(|_| CaError::Lifetime(d))
}

fn random_serial() -> Result<SerialNumber, CaError> {
    let mut bytes = [0u8; 16];
    ring_fill(&mut bytes)?;
    // A positive INTEGER: clear the top bit.
    bytes[0] &= 0x7f;
    Ok(SerialNumber::from_slice(&bytes))
}

fn ring_fill(buf: &mut [u8]) -> Result<(), CaError> {
    use rustls::crypto::ring::default_provider;
    default_provider()
        .secure_random
        .fill(buf)
        .map_err(|_| CaError::Random)
}

fn make_private_dir(dir: &Path) -> Result<(), CaError> {
    if dir.is_dir() {
        return Ok(());
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io_err(dir))
}

/// Writes `path` with mode 0600 through a temporary file and a rename.
fn write_private(path: &Path, bytes: &[u8]) -> Result<(), CaError> {
    let tmp = path.with_extension("tmp");
    let _ = fs::remove_file(&tmp);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io_err(&tmp))?;
    f.write_all(bytes).map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    fs::rename(&tmp, path).map_err(io_err(path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn der_of(pem: &str) -> Vec<u8> {
        let d: rustls_pki_types::CertificateDer<'static> =
            rustls_pki_types::pem::PemObject::from_pem_slice(pem.as_bytes()).unwrap();
        d.to_vec()
    }

    fn mode(p: &Path) -> u32 {
        fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn init_writes_a_ca_for_its_trust_domain_with_private_files() {
        let dir = tempfile::tempdir().unwrap();
        let ca_dir = dir.path().join("ca");
        let td = TrustDomain::new("prod.example").unwrap();
        Ca::init(&ca_dir, &td, DEFAULT_CA_TTL).unwrap();
        assert_eq!(mode(&ca_dir.join(CA_KEY)), 0o600);
        assert_eq!(mode(&ca_dir.join(CA_CERT)), 0o600);
        assert_eq!(mode(&ca_dir), 0o700);
        let ca = Ca::load(&ca_dir).unwrap();
        assert_eq!(ca.trust_domain(), &td);
        // Never overwritten.
        assert!(matches!(
            Ca::init(&ca_dir, &td, DEFAULT_CA_TTL),
            Err(CaError::Exists { .. })
        ));
    }

    #[test]
    fn issued_certificates_carry_their_spiffe_identity_and_lifetime() {
        let dir = tempfile::tempdir().unwrap();
        let td = TrustDomain::new("prod.example").unwrap();
        let ca = Ca::init(dir.path(), &td, DEFAULT_CA_TTL).unwrap();
        let name = MemberName::new("w-1").unwrap();
        let issued = ca
            .issue(Role::Worker, &name, Duration::from_secs(3600))
            .unwrap();
        let der = der_of(&issued.cert_pem);
        let id = Identity::of_certificate(&der).unwrap();
        assert_eq!(id.uri(), "spiffe://prod.example/worker/w-1");
        assert_eq!(id.role, Role::Worker);
        let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
        let life = cert.validity().not_after.timestamp() - cert.validity().not_before.timestamp();
        // One hour plus the backdating.
        assert_eq!(life, 3600 + BACKDATE.as_secs() as i64);
        assert!(!cert.is_ca());
        // Signed by the CA.
        let ca_der = der_of(ca.cert_pem());
        let (_, ca_cert) = x509_parser::parse_x509_certificate(&ca_der).unwrap();
        cert.verify_signature(Some(ca_cert.public_key())).unwrap();
        assert!(ca_cert.is_ca());

        let out = dir.path().join("out");
        issued.write_to(&out).unwrap();
        for f in [CERT, KEY, CA_CERT] {
            assert_eq!(mode(&out.join(f)), 0o600, "{f}");
        }
        let c = ca.issue(Role::Controller, &name, DEFAULT_LEAF_TTL).unwrap();
        assert_eq!(
            Identity::of_certificate(&der_of(&c.cert_pem)).unwrap().role,
            Role::Controller
        );
    }

    #[test]
    fn identities_parse_strictly() {
        let id = Identity::parse("spiffe://td/controller/c1").unwrap();
        assert_eq!(id.role, Role::Controller);
        for bad in [
            "spiffe://td",
            "spiffe://td/admin/c1",
            "spiffe://td/worker/c1/x",
            "spiffe://TD/worker/c1",
            "https://td/worker/c1",
            "spiffe://td/worker/",
            "spiffe://td/worker/a b",
        ] {
            assert!(Identity::parse(bad).is_err(), "{bad}");
        }
        assert!(TrustDomain::new("").is_err());
        assert!(MemberName::new(&"a".repeat(64)).is_err());
        assert!("admin".parse::<Role>().is_err());
    }

    /// The serials a PEM CRL lists, after checking it is signed by `ca_pem`'s key.
    fn crl_serials(crl_pem: &str, ca_pem: &str) -> (Vec<String>, u64) {
        let der: rustls_pki_types::CertificateRevocationListDer<'static> =
            rustls_pki_types::pem::PemObject::from_pem_slice(crl_pem.as_bytes()).unwrap();
        let (_, crl) = x509_parser::parse_x509_crl(&der).unwrap();
        let ca_der = der_of(ca_pem);
        let (_, ca_cert) = x509_parser::parse_x509_certificate(&ca_der).unwrap();
        crl.verify_signature(ca_cert.public_key()).unwrap();
        assert_eq!(crl.issuer().as_raw(), ca_cert.subject().as_raw());
        let number = crl.crl_number().unwrap().to_u64_digits()[0];
        let serials = crl
            .iter_revoked_certificates()
            .map(|r| Serial::from_bytes(r.raw_serial()).hex())
            .collect();
        (serials, number)
    }

    fn serial_of(pem: &str) -> String {
        let der = der_of(pem);
        let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
        Serial::from_bytes(cert.raw_serial()).hex()
    }

    #[test]
    fn revoking_records_the_serial_and_signs_a_crl_listing_every_revocation() {
        let dir = tempfile::tempdir().unwrap();
        let ca_dir = dir.path().join("ca");
        let ca = Ca::init(&ca_dir, &TrustDomain::new("td").unwrap(), DEFAULT_CA_TTL).unwrap();
        let mut serials = Vec::new();
        for name in ["w1", "w2"] {
            let issued = ca
                .issue(
                    Role::Worker,
                    &MemberName::new(name).unwrap(),
                    DEFAULT_LEAF_TTL,
                )
                .unwrap();
            assert!(issued.crl_pem.is_none(), "no CRL before any revocation");
            issued.write_to(&dir.path().join(name)).unwrap();
            assert!(!dir.path().join(name).join(CRL).exists());
            serials.push(serial_of(&issued.cert_pem));
        }

        let r = ca
            .revoke_certificate(&dir.path().join("w1").join(CERT))
            .unwrap();
        assert!(r.newly);
        assert_eq!(r.serial.hex(), serials[0]);
        assert_eq!(r.identity.as_deref(), Some("spiffe://td/worker/w1"));
        assert_eq!((r.listed, r.crl_number), (1, 1));
        assert_eq!(r.crl_path, ca_dir.join(CRL));
        assert_eq!(mode(&ca_dir.join(CRL)), 0o600);
        assert_eq!(mode(&ca_dir.join(REVOKED)), 0o600);
        let crl = fs::read_to_string(ca_dir.join(CRL)).unwrap();
        assert_eq!(
            crl_serials(&crl, ca.cert_pem()),
            (vec![serials[0].clone()], 1)
        );

        // Again: kept once, a newer CRL. Then by serial (as openssl prints it), from a
        // reloaded CA: both listed.
        let again = ca
            .revoke_certificate(&dir.path().join("w1").join(CERT))
            .unwrap();
        assert!(!again.newly);
        assert_eq!((again.listed, again.crl_number), (1, 2));
        let ca = Ca::load(&ca_dir).unwrap();
        let by_serial = ca
            .revoke_serial(Serial::parse(&serials[1].to_uppercase()).unwrap())
            .unwrap();
        assert!(by_serial.newly && by_serial.identity.is_none());
        let crl = fs::read_to_string(ca_dir.join(CRL)).unwrap();
        assert_eq!(crl_serials(&crl, ca.cert_pem()), (serials.clone(), 3));

        // An identity issued from now on carries the CRL.
        let issued = ca
            .issue(
                Role::Worker,
                &MemberName::new("w3").unwrap(),
                DEFAULT_LEAF_TTL,
            )
            .unwrap();
        issued.write_to(&dir.path().join("w3")).unwrap();
        assert_eq!(
            fs::read_to_string(dir.path().join("w3").join(CRL)).unwrap(),
            crl
        );
    }

    #[test]
    fn a_certificate_of_another_ca_cannot_be_revoked_here() {
        let dir = tempfile::tempdir().unwrap();
        let td = TrustDomain::new("td").unwrap();
        let ca = Ca::init(&dir.path().join("ca"), &td, DEFAULT_CA_TTL).unwrap();
        let other = Ca::init(&dir.path().join("other"), &td, DEFAULT_CA_TTL).unwrap();
        other
            .issue(
                Role::Worker,
                &MemberName::new("w1").unwrap(),
                DEFAULT_LEAF_TTL,
            )
            .unwrap()
            .write_to(&dir.path().join("x"))
            .unwrap();
        assert!(matches!(
            ca.revoke_certificate(&dir.path().join("x").join(CERT)),
            Err(CaError::NotIssuedHere { .. })
        ));
        assert!(!dir.path().join("ca").join(CRL).exists());
        assert!(!dir.path().join("ca").join(REVOKED).exists());
    }

    #[test]
    fn serials_parse_as_openssl_prints_them() {
        assert_eq!(Serial::parse("3A:5f:00").unwrap().hex(), "3a5f00");
        assert!(Serial::parse("0x1").is_err());
        assert_eq!(Serial::parse("00ff").unwrap().hex(), "ff");
        assert_eq!(Serial::parse("abc").unwrap().hex(), "0abc");
        assert_eq!(Serial::parse("0").unwrap().hex(), "00");
        assert_eq!(Serial::from_bytes(&[0, 0x80, 1]).hex(), "8001");
        for bad in ["", ":", "xyz", &"a".repeat(65)] {
            assert!(Serial::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_tampered_revocation_record_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ca_dir = dir.path().join("ca");
        let ca = Ca::init(&ca_dir, &TrustDomain::new("td").unwrap(), DEFAULT_CA_TTL).unwrap();
        for body in [
            r#"{"version":2,"crl_number":1,"revoked":[]}"#,
            r#"{"version":1,"crl_number":1,"revoked":[{"serial":"zz","identity":null,"revoked_at":0}]}"#,
            r#"{"version":1,"crl_number":1,"revoked":[],"extra":1}"#,
            "[",
        ] {
            fs::write(ca_dir.join(REVOKED), body).unwrap();
            assert!(
                matches!(
                    ca.revoke_serial(Serial::parse("01").unwrap()),
                    Err(CaError::Record { .. })
                ),
                "{body}"
            );
            assert!(!ca_dir.join(CRL).exists());
        }
    }

    #[test]
    fn lifetimes_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let td = TrustDomain::new("td").unwrap();
        let ca = Ca::init(dir.path(), &td, DEFAULT_CA_TTL).unwrap();
        let name = MemberName::new("x").unwrap();
        assert!(matches!(
            ca.issue(Role::Worker, &name, Duration::ZERO),
            Err(CaError::Lifetime(_))
        ));
    }
}
