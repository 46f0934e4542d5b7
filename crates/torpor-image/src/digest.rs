//! Content digests: parsing the `sha256:HEX` strings an image carries, and hashing streams
//! while they are read so that every blob is checked without a second pass.

use std::fmt;
use std::io::{self, Read};
use std::path::Path;

use sha2::{Digest as _, Sha256};

use crate::ImageError;

/// A validated `sha256:` digest: 64 lowercase hex digits, so it is also safe to use as a
/// file name under `blobs/sha256/`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(String);

impl Digest {
    /// Parses a digest found in `path`; anything but a well-formed sha256 digest is refused.
    pub(crate) fn parse(value: &str, path: &Path) -> Result<Digest, ImageError> {
        match value.strip_prefix("sha256:") {
            Some(hex) if is_sha256_hex(hex) => Ok(Digest(value.to_owned())),
            _ => Err(ImageError::UnsupportedDigest {
                path: path.to_owned(),
                digest: value.to_owned(),
            }),
        }
    }

    pub(crate) fn from_hex(hex: &str) -> Option<Digest> {
        is_sha256_hex(hex).then(|| Digest(format!("sha256:{hex}")))
    }

    fn from_hasher(hasher: Sha256) -> Digest {
        let bytes = hasher.finalize();
        let mut text = String::with_capacity(7 + 64);
        text.push_str("sha256:");
        for byte in bytes {
            text.push_str(&format!("{byte:02x}"));
        }
        Digest(text)
    }

    pub fn of_bytes(bytes: &[u8]) -> Digest {
        Digest::from_hasher(Sha256::new_with_prefix(bytes))
    }

    /// The full form, `sha256:HEX`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The 64 hex digits, without the algorithm.
    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }

    /// Fails with `DigestMismatch` naming `path` unless `actual` is this digest.
    pub(crate) fn verify(&self, actual: &Digest, path: &Path) -> Result<(), ImageError> {
        if self == actual {
            Ok(())
        } else {
            Err(ImageError::DigestMismatch {
                path: path.to_owned(),
                expected: self.0.clone(),
                actual: actual.0.clone(),
            })
        }
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn is_sha256_hex(hex: &str) -> bool {
    hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The error a [`HashingReader`] returns once more than its limit has been read; callers
/// turn it back into [`ImageError::TooLarge`] with [`is_limit_exceeded`].
#[derive(Debug)]
struct LimitExceeded;

impl fmt::Display for LimitExceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("size limit exceeded")
    }
}

impl std::error::Error for LimitExceeded {}

pub(crate) fn is_limit_exceeded(err: &io::Error) -> bool {
    err.get_ref()
        .is_some_and(|inner| inner.is::<LimitExceeded>())
}

/// Hashes and counts what passes through it, and fails once more than `limit` bytes went by.
pub(crate) struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
    bytes: u64,
    limit: u64,
}

impl<R: Read> HashingReader<R> {
    pub(crate) fn new(inner: R, limit: u64) -> Self {
        HashingReader {
            inner,
            hasher: Sha256::new(),
            bytes: 0,
            limit,
        }
    }

    /// Reads whatever is left, so that the digest covers the whole stream.
    pub(crate) fn drain(&mut self) -> io::Result<()> {
        io::copy(self, &mut io::sink()).map(drop)
    }

    pub(crate) fn finish(self) -> (Digest, u64) {
        (Digest::from_hasher(self.hasher), self.bytes)
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        if self.bytes > self.limit {
            return Err(io::Error::other(LimitExceeded));
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_accepts_only_lowercase_sha256() {
        let path = Path::new("index.json");
        let good = format!("sha256:{}", "a".repeat(64));
        assert_eq!(Digest::parse(&good, path).unwrap().hex(), "a".repeat(64));
        for bad in [
            "sha256:../../etc/passwd".to_owned(),
            format!("sha256:{}", "A".repeat(64)),
            format!("sha512:{}", "a".repeat(128)),
            format!("sha256:{}", "a".repeat(63)),
            "a".repeat(64),
        ] {
            let err = Digest::parse(&bad, path).unwrap_err();
            assert_eq!(err.code(), "unsupported_digest", "{bad}");
        }
    }

    #[test]
    fn hashing_reader_matches_one_shot_digest_and_enforces_limit() {
        let data = b"hello world".repeat(100);
        let mut reader = HashingReader::new(&data[..], u64::MAX);
        reader.drain().unwrap();
        let (digest, bytes) = reader.finish();
        assert_eq!(digest, Digest::of_bytes(&data));
        assert_eq!(bytes, data.len() as u64);

        let mut limited = HashingReader::new(&data[..], 10);
        let err = limited.drain().unwrap_err();
        assert!(is_limit_exceeded(&err));
    }
}
