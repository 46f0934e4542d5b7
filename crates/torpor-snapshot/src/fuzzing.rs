//! Entry points for the fuzz targets (`fuzz/fuzz_targets/snapshot_*.rs`) and the property tests
//! that run the same code on stable: every decoder of untrusted snapshot bytes on one input.
//! None may panic; an accepted manifest must re-encode to exactly the bytes it came from.

use std::io::{Cursor, Read};

use crate::chunk::{ChunkCodec, TenantKey};
use crate::gvisor::{self, InflatingReader};
use crate::id::ChunkId;
use crate::manifest::Manifest;

/// Runs the manifest decoder (plain and sealed with a fixed key), the chunk blob decoder (plain
/// and keyed) and the gVisor image probe and inflater on `data`. Returns how many accepted it.
pub fn decode_untrusted(data: &[u8]) -> usize {
    let mut accepted = 0;
    if let Ok(m) = Manifest::decode(data) {
        assert_eq!(m.encode(), data, "an accepted manifest is canonical");
        accepted += 1;
    }
    let keyed = ChunkCodec::new(1, Some(&TenantKey::from_bytes([7; 32])));
    if let Ok(plain) = keyed.open_manifest(data) {
        accepted += usize::from(Manifest::decode(&plain).is_ok());
    }
    // Chunk blobs: the id is taken from the input's head so matching ids are reachable.
    let mut id = [0u8; 32];
    let n = data.len().min(32);
    id[..n].copy_from_slice(&data[..n]);
    let body = &data[n..];
    for codec in [ChunkCodec::new(1, None), keyed] {
        accepted += usize::from(codec.decode(&ChunkId(id), body).is_ok());
        accepted += usize::from(codec.decode(&ChunkId::of(body), body).is_ok());
    }
    if let Ok(Some(layout)) = gvisor::probe(Cursor::new(data)) {
        accepted += 1;
        let start = layout.header.len().min(data.len());
        let mut sink = [0u8; 64 * 1024];
        let mut r = InflatingReader::new(&data[start..], layout.frame_size);
        // Bounded: a frame never inflates past the frame size.
        let mut total = 0usize;
        while let Ok(k) = r.read(&mut sink) {
            if k == 0 || total > 256 << 20 {
                break;
            }
            total += k;
        }
    }
    accepted
}
