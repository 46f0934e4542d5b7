//! Chunk objects: how one chunk's bytes are identified, compressed, optionally encrypted and
//! verified. Owns the chunk blob format; knows nothing about files, manifests or backends.
//!
//! Blob layout (all integers little-endian):
//!
//! ```text
//! "TCK" | version u8 (=1) | flags u8 (bit0 zstd, bit1 encrypted) | raw_len u32 | payload
//! payload = zstd frame or raw bytes; when encrypted: ChaCha20-Poly1305(payload) with the tag
//!           appended, nonce = first 12 bytes of keyed BLAKE3(chunk id), AAD = the 9 header bytes
//! ```
//!
//! The nonce is derived from the chunk id, which is itself a keyed hash of the plaintext, so one
//! nonce only ever encrypts one plaintext under one key; identical chunks of one tenant encrypt
//! to identical blobs, which is what lets them deduplicate within the tenant and nowhere else.

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};

use crate::id::ChunkId;

/// Largest chunk (plaintext) the store writes or accepts when reading.
pub const MAX_CHUNK_LEN: u32 = 16 * 1024 * 1024;

const MAGIC: &[u8; 3] = b"TCK";
const VERSION: u8 = 1;
const FLAG_ZSTD: u8 = 1;
const FLAG_ENCRYPTED: u8 = 2;
const HEADER_LEN: usize = 9;
const TAG_LEN: usize = 16;

/// Why a chunk blob could not be turned back into the chunk it claims to be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    #[error("chunk blob is too short ({len} bytes)")]
    Truncated { len: usize },
    #[error("chunk blob has wrong magic or unsupported version {version}")]
    BadHeader { version: u8 },
    #[error("chunk blob declares {raw_len} bytes, more than the cap of {MAX_CHUNK_LEN}")]
    TooLarge { raw_len: u32 },
    #[error("chunk blob is encrypted but the store has no key, or the reverse")]
    KeyMismatch,
    #[error("chunk blob failed authentication (wrong key or tampered)")]
    Decrypt,
    #[error("chunk blob does not decompress")]
    Decompress,
    #[error("chunk blob decodes to {actual} bytes, header says {expected}")]
    LengthMismatch { expected: u32, actual: usize },
    #[error("chunk content hashes to {actual}, not to its id")]
    HashMismatch { actual: ChunkId },
}

impl ChunkError {
    pub fn code(&self) -> &'static str {
        match self {
            ChunkError::Truncated { .. } => "chunk_truncated",
            ChunkError::BadHeader { .. } => "chunk_bad_header",
            ChunkError::TooLarge { .. } => "chunk_too_large",
            ChunkError::KeyMismatch => "chunk_key_mismatch",
            ChunkError::Decrypt => "chunk_decrypt_failed",
            ChunkError::Decompress => "chunk_decompress_failed",
            ChunkError::LengthMismatch { .. } => "chunk_length_mismatch",
            ChunkError::HashMismatch { .. } => "chunk_hash_mismatch",
        }
    }
}

/// A tenant's 256-bit secret. Chunk ids, chunk encryption and manifest encryption each use a
/// key derived from it, never the key itself.
#[derive(Clone)]
pub struct TenantKey([u8; 32]);

impl TenantKey {
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        TenantKey(bytes)
    }

    /// The key's bytes (to hand to a worker that reads or writes this tenant's snapshots).
    pub fn to_bytes(&self) -> [u8; 32] {
        self.0
    }
}

impl std::fmt::Debug for TenantKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TenantKey(..)")
    }
}

/// Turns plaintext chunks into ids and blobs and back. Cheap to clone.
#[derive(Clone)]
pub struct ChunkCodec {
    zstd_level: i32,
    keys: Option<DerivedKeys>,
}

#[derive(Clone)]
struct DerivedKeys {
    id_key: [u8; 32],
    nonce_key: [u8; 32],
    aead: ChaCha20Poly1305,
    manifest_aead: ChaCha20Poly1305,
}

impl ChunkCodec {
    pub fn new(zstd_level: i32, key: Option<&TenantKey>) -> Self {
        let keys = key.map(|k| DerivedKeys {
            id_key: blake3::derive_key("torpor-snapshot v1 chunk id", &k.0),
            nonce_key: blake3::derive_key("torpor-snapshot v1 chunk nonce", &k.0),
            aead: ChaCha20Poly1305::new(Key::from_slice(&blake3::derive_key(
                "torpor-snapshot v1 chunk encryption",
                &k.0,
            ))),
            manifest_aead: ChaCha20Poly1305::new(Key::from_slice(&blake3::derive_key(
                "torpor-snapshot v1 manifest encryption",
                &k.0,
            ))),
        });
        ChunkCodec { zstd_level, keys }
    }

    pub fn is_encrypted(&self) -> bool {
        self.keys.is_some()
    }

    /// The id of a plaintext chunk: BLAKE3, keyed with the tenant's id key when encrypting.
    pub fn id_of(&self, data: &[u8]) -> ChunkId {
        match &self.keys {
            Some(k) => ChunkId(*blake3::keyed_hash(&k.id_key, data).as_bytes()),
            None => ChunkId::of(data),
        }
    }

    /// Encodes one chunk: zstd when it saves at least 1/32 of the bytes, then encryption.
    /// Returns the blob and whether it was compressed.
    pub fn encode(&self, id: &ChunkId, data: &[u8]) -> Result<(Vec<u8>, bool), ChunkError> {
        let raw_len = u32::try_from(data.len())
            .ok()
            .filter(|&l| l <= MAX_CHUNK_LEN)
            .ok_or(ChunkError::TooLarge { raw_len: u32::MAX })?;
        let compressed = compress_reusing_context(data, self.zstd_level)
            .ok()
            .filter(|c| c.len() + data.len() / 32 < data.len());
        let mut flags = 0u8;
        if compressed.is_some() {
            flags |= FLAG_ZSTD;
        }
        if self.keys.is_some() {
            flags |= FLAG_ENCRYPTED;
        }
        let mut header = [0u8; HEADER_LEN];
        header[..3].copy_from_slice(MAGIC);
        header[3] = VERSION;
        header[4] = flags;
        header[5..9].copy_from_slice(&raw_len.to_le_bytes());
        let payload: &[u8] = compressed.as_deref().unwrap_or(data);
        let mut blob = Vec::with_capacity(HEADER_LEN + payload.len() + TAG_LEN);
        blob.extend_from_slice(&header);
        match &self.keys {
            Some(k) => {
                let nonce = chunk_nonce(&k.nonce_key, id);
                let sealed = k
                    .aead
                    .encrypt(
                        Nonce::from_slice(&nonce),
                        Payload {
                            msg: payload,
                            aad: &header,
                        },
                    )
                    .map_err(|_| ChunkError::Decrypt)?;
                blob.extend_from_slice(&sealed);
            }
            None => blob.extend_from_slice(payload),
        }
        Ok((blob, compressed.is_some()))
    }

    /// Decodes and verifies a blob fetched under `id`.
    pub fn decode(&self, id: &ChunkId, blob: &[u8]) -> Result<Vec<u8>, ChunkError> {
        if blob.len() < HEADER_LEN {
            return Err(ChunkError::Truncated { len: blob.len() });
        }
        let (header, body) = blob.split_at(HEADER_LEN);
        if &header[..3] != MAGIC
            || header[3] != VERSION
            || header[4] & !(FLAG_ZSTD | FLAG_ENCRYPTED) != 0
        {
            return Err(ChunkError::BadHeader { version: header[3] });
        }
        let flags = header[4];
        let raw_len = u32::from_le_bytes([header[5], header[6], header[7], header[8]]);
        if raw_len > MAX_CHUNK_LEN {
            return Err(ChunkError::TooLarge { raw_len });
        }
        let plain_payload;
        let payload: &[u8] = match (&self.keys, flags & FLAG_ENCRYPTED != 0) {
            (Some(k), true) => {
                let nonce = chunk_nonce(&k.nonce_key, id);
                plain_payload = k
                    .aead
                    .decrypt(
                        Nonce::from_slice(&nonce),
                        Payload {
                            msg: body,
                            aad: header,
                        },
                    )
                    .map_err(|_| ChunkError::Decrypt)?;
                &plain_payload
            }
            (None, false) => body,
            _ => return Err(ChunkError::KeyMismatch),
        };
        let data = if flags & FLAG_ZSTD != 0 {
            // The capacity is the declared length, itself capped: a zstd bomb cannot grow past it.
            decompress_reusing_context(payload, raw_len as usize)
                .map_err(|_| ChunkError::Decompress)?
        } else {
            payload.to_vec()
        };
        if data.len() != raw_len as usize {
            return Err(ChunkError::LengthMismatch {
                expected: raw_len,
                actual: data.len(),
            });
        }
        let actual = self.id_of(&data);
        if actual != *id {
            return Err(ChunkError::HashMismatch { actual });
        }
        Ok(data)
    }

    /// Seals a whole manifest when a key is set (nonce from the manifest's own hash).
    pub(crate) fn seal_manifest(&self, plain: Vec<u8>) -> Result<Vec<u8>, ChunkError> {
        let Some(k) = &self.keys else {
            return Ok(plain);
        };
        let nonce_full = blake3::keyed_hash(&k.nonce_key, &plain);
        let nonce = &nonce_full.as_bytes()[..12];
        let sealed = k
            .manifest_aead
            .encrypt(Nonce::from_slice(nonce), plain.as_slice())
            .map_err(|_| ChunkError::Decrypt)?;
        let mut out = Vec::with_capacity(ENVELOPE_MAGIC.len() + 12 + sealed.len());
        out.extend_from_slice(ENVELOPE_MAGIC);
        out.extend_from_slice(nonce);
        out.extend_from_slice(&sealed);
        Ok(out)
    }

    /// Opens a sealed manifest; plain manifests pass through only when no key is set.
    pub(crate) fn open_manifest(&self, bytes: &[u8]) -> Result<Vec<u8>, ChunkError> {
        let sealed = bytes.starts_with(ENVELOPE_MAGIC);
        match (&self.keys, sealed) {
            (None, false) => Ok(bytes.to_vec()),
            (Some(k), true) => {
                let rest = &bytes[ENVELOPE_MAGIC.len()..];
                if rest.len() < 12 + TAG_LEN {
                    return Err(ChunkError::Truncated { len: bytes.len() });
                }
                let (nonce, ct) = rest.split_at(12);
                k.manifest_aead
                    .decrypt(Nonce::from_slice(nonce), ct)
                    .map_err(|_| ChunkError::Decrypt)
            }
            _ => Err(ChunkError::KeyMismatch),
        }
    }
}

const ENVELOPE_MAGIC: &[u8; 8] = b"TORPSNAE";

thread_local! {
    // zstd contexts are costly to create (hundreds of KiB each); chunks are small and many,
    // so each worker thread keeps one of each.
    static COMPRESSOR: std::cell::RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> =
        const { std::cell::RefCell::new(None) };
    static DECOMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

fn compress_reusing_context(data: &[u8], level: i32) -> std::io::Result<Vec<u8>> {
    COMPRESSOR.with(|slot| {
        let mut slot = slot.borrow_mut();
        if !matches!(&*slot, Some((l, _)) if *l == level) {
            *slot = Some((level, zstd::bulk::Compressor::new(level)?));
        }
        match slot.as_mut() {
            Some((_, c)) => c.compress(data),
            None => zstd::bulk::compress(data, level),
        }
    })
}

fn decompress_reusing_context(data: &[u8], capacity: usize) -> std::io::Result<Vec<u8>> {
    DECOMPRESSOR.with(|slot| {
        let mut slot = slot.borrow_mut();
        if slot.is_none() {
            *slot = Some(zstd::bulk::Decompressor::new()?);
        }
        match slot.as_mut() {
            Some(d) => d.decompress(data, capacity),
            None => zstd::bulk::decompress(data, capacity),
        }
    })
}

fn chunk_nonce(nonce_key: &[u8; 32], id: &ChunkId) -> [u8; 12] {
    let h = blake3::keyed_hash(nonce_key, &id.0);
    let mut n = [0u8; 12];
    n.copy_from_slice(&h.as_bytes()[..12]);
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compressible() -> Vec<u8> {
        (0..100_000u32).map(|i| (i % 7) as u8).collect()
    }

    fn incompressible() -> Vec<u8> {
        let mut out = Vec::new();
        let mut h = blake3::Hasher::new().finalize_xof();
        out.resize(50_000, 0);
        h.fill(&mut out);
        out
    }

    #[test]
    fn round_trip_plain_and_compressed() {
        let codec = ChunkCodec::new(3, None);
        for (data, expect_zstd) in [(compressible(), true), (incompressible(), false)] {
            let id = codec.id_of(&data);
            let (blob, zstd) = codec.encode(&id, &data).unwrap();
            assert_eq!(zstd, expect_zstd);
            assert_eq!(codec.decode(&id, &blob).unwrap(), data);
        }
    }

    #[test]
    fn corruption_is_detected() {
        let codec = ChunkCodec::new(3, None);
        let data = incompressible();
        let id = codec.id_of(&data);
        let (mut blob, _) = codec.encode(&id, &data).unwrap();
        blob[100] ^= 1;
        assert!(matches!(
            codec.decode(&id, &blob),
            Err(ChunkError::HashMismatch { .. })
        ));
        let other = ChunkId::of(b"other");
        let (blob, _) = codec.encode(&id, &data).unwrap();
        assert!(matches!(
            codec.decode(&other, &blob),
            Err(ChunkError::HashMismatch { .. })
        ));
        assert!(matches!(
            codec.decode(&id, &blob[..5]),
            Err(ChunkError::Truncated { .. })
        ));
    }

    #[test]
    fn declared_length_is_capped() {
        let codec = ChunkCodec::new(3, None);
        let mut blob = b"TCK\x01\x01".to_vec();
        blob.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            codec.decode(&ChunkId([0; 32]), &blob),
            Err(ChunkError::TooLarge { .. })
        ));
    }

    #[test]
    fn encryption_separates_tenants() {
        let a = ChunkCodec::new(3, Some(&TenantKey::from_bytes([1; 32])));
        let b = ChunkCodec::new(3, Some(&TenantKey::from_bytes([2; 32])));
        let data = compressible();
        let (ida, idb) = (a.id_of(&data), b.id_of(&data));
        assert_ne!(
            ida, idb,
            "ids differ across tenants, so nothing deduplicates across them"
        );
        let (blob, _) = a.encode(&ida, &data).unwrap();
        assert!(
            !blob.windows(16).any(|w| w == &data[..16]),
            "plaintext not visible"
        );
        assert_eq!(a.decode(&ida, &blob).unwrap(), data);
        assert_eq!(b.decode(&ida, &blob), Err(ChunkError::Decrypt));
        let plain = ChunkCodec::new(3, None);
        assert_eq!(plain.decode(&ida, &blob), Err(ChunkError::KeyMismatch));
        let (again, _) = a.encode(&ida, &data).unwrap();
        assert_eq!(
            again, blob,
            "deterministic, so a tenant's identical chunks deduplicate"
        );
    }

    #[test]
    fn manifest_envelope() {
        let a = ChunkCodec::new(3, Some(&TenantKey::from_bytes([1; 32])));
        let sealed = a.seal_manifest(b"manifest bytes".to_vec()).unwrap();
        assert_eq!(a.open_manifest(&sealed).unwrap(), b"manifest bytes");
        let mut bad = sealed.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert_eq!(a.open_manifest(&bad), Err(ChunkError::Decrypt));
        assert_eq!(
            ChunkCodec::new(3, None).open_manifest(&sealed),
            Err(ChunkError::KeyMismatch)
        );
    }
}
