//! Sandbox env at rest: sealed with ChaCha20-Poly1305 under a key kept beside the database.
//!
//! A sandbox's env often carries API keys. The state store keeps it sealed, so a copy of
//! `torpor.db` (a backup, a support bundle, a file another local user could once read) does not
//! give them away; the key is `env.key` next to the database (0600, created on first open) and
//! is not in any backup of the database alone. Whoever can read the data directory as root can
//! read both: this protects copies of the database, not a compromised host.
//!
//! Format of a sealed value: `enc1:` + base64(nonce (12 bytes) || ciphertext+tag). The sandbox
//! id is the associated data, so a sealed env cannot be moved to another sandbox's row. A value
//! without the prefix is a plain JSON env written by an older torpor; [`EnvSeal::open`] reads
//! it, and the store re-seals such rows when it opens.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use base64::Engine as _;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};

const PREFIX: &str = "enc1:";

#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error("cannot read or create the env key {path}: {source}")]
    Key {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("the env key {0} is not 32 bytes")]
    BadKey(std::path::PathBuf),
    #[error("a sealed env does not open (wrong key or edited)")]
    Open,
}

pub struct EnvSeal {
    cipher: ChaCha20Poly1305,
}

impl std::fmt::Debug for EnvSeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EnvSeal")
    }
}

impl EnvSeal {
    /// Loads the key at `path`, creating it (0600) when missing.
    pub fn load_or_create(path: &Path) -> Result<EnvSeal, SealError> {
        let key_err = |source| SealError::Key {
            path: path.to_path_buf(),
            source,
        };
        let key = match std::fs::read(path) {
            Ok(k) => k,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let k: [u8; 32] = rand::random();
                let created = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(path);
                match created {
                    Ok(mut f) => {
                        f.write_all(&k).map_err(key_err)?;
                        f.sync_all().map_err(key_err)?;
                        k.to_vec()
                    }
                    // Another opener made it first: use theirs.
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                        std::fs::read(path).map_err(key_err)?
                    }
                    Err(e) => return Err(key_err(e)),
                }
            }
            Err(e) => return Err(key_err(e)),
        };
        if key.len() != 32 {
            return Err(SealError::BadKey(path.to_path_buf()));
        }
        Ok(EnvSeal {
            cipher: ChaCha20Poly1305::new(Key::from_slice(&key)),
        })
    }

    #[cfg(test)]
    pub fn with_key(key: [u8; 32]) -> EnvSeal {
        EnvSeal {
            cipher: ChaCha20Poly1305::new(Key::from_slice(&key)),
        }
    }

    /// Seals `plain` (an env as JSON) for the row of `sandbox`.
    pub fn seal(&self, sandbox: &str, plain: &str) -> String {
        let nonce: [u8; 12] = rand::random();
        let sealed = self
            .cipher
            .encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: plain.as_bytes(),
                    aad: sandbox.as_bytes(),
                },
            )
            .expect("ChaCha20-Poly1305 encrypts any message under 256 GiB");
        let mut out = nonce.to_vec();
        out.extend_from_slice(&sealed);
        format!(
            "{PREFIX}{}",
            base64::engine::general_purpose::STANDARD.encode(out)
        )
    }

    /// The JSON env of a stored value: sealed, or plain from an older torpor.
    pub fn open(&self, sandbox: &str, stored: &str) -> Result<String, SealError> {
        let Some(b64) = stored.strip_prefix(PREFIX) else {
            return Ok(stored.to_string());
        };
        let raw = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|_| SealError::Open)?;
        if raw.len() < 12 + 16 {
            return Err(SealError::Open);
        }
        let (nonce, sealed) = raw.split_at(12);
        let plain = self
            .cipher
            .decrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: sealed,
                    aad: sandbox.as_bytes(),
                },
            )
            .map_err(|_| SealError::Open)?;
        String::from_utf8(plain).map_err(|_| SealError::Open)
    }

    pub fn is_sealed(stored: &str) -> bool {
        stored.starts_with(PREFIX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_env_opens_only_with_its_key_and_row() {
        let s = EnvSeal::with_key([7; 32]);
        let sealed = s.seal("sb-1", r#"{"API_KEY":"sk-secret"}"#);
        assert!(EnvSeal::is_sealed(&sealed));
        assert!(!sealed.contains("sk-secret"));
        assert_eq!(
            s.open("sb-1", &sealed).unwrap(),
            r#"{"API_KEY":"sk-secret"}"#
        );
        assert!(s.open("sb-2", &sealed).is_err(), "moved to another row");
        assert!(EnvSeal::with_key([8; 32]).open("sb-1", &sealed).is_err());
        let mut edited = sealed.clone();
        edited.replace_range(10..11, if &sealed[10..11] == "A" { "B" } else { "A" });
        assert!(s.open("sb-1", &edited).is_err());
        // A plain value from an older torpor still reads.
        assert_eq!(s.open("sb-1", "{}").unwrap(), "{}");
    }

    #[test]
    fn the_key_is_made_once_and_private() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("env.key");
        let a = EnvSeal::load_or_create(&p).unwrap();
        let b = EnvSeal::load_or_create(&p).unwrap();
        let sealed = a.seal("x", "{}");
        assert_eq!(b.open("x", &sealed).unwrap(), "{}");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        std::fs::write(&p, b"short").unwrap();
        assert!(matches!(
            EnvSeal::load_or_create(&p),
            Err(SealError::BadKey(_))
        ));
    }
}
