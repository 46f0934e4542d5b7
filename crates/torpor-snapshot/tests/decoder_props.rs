//! Fuzz-style property tests for every decoder of untrusted bytes: manifests, chunk blobs and
//! gVisor image headers/frames. None may panic or allocate by a declared size; valid manifests
//! round-trip exactly, and any accepted manifest re-encodes to the same bytes.

use std::io::{Cursor, Read};

use proptest::prelude::*;
use torpor_snapshot::manifest::{
    ChunkParams, Extent, ExtentData, FileEntry, FileKind, ImageInfo, Manifest,
};
use torpor_snapshot::{ChunkCodec, ChunkId, PackId, PackLoc, SnapshotId};

fn id_strategy() -> impl Strategy<Value = SnapshotId> {
    "[a-z0-9][a-z0-9._-]{0,40}".prop_map(|s| SnapshotId::new(s).unwrap())
}

fn extents_strategy() -> impl Strategy<Value = (u64, Vec<Extent>)> {
    prop::collection::vec((1u64..200_000, any::<bool>(), any::<[u8; 32]>()), 0..20).prop_map(
        |parts| {
            let mut off = 0;
            let mut out = Vec::new();
            for (len, zero, id) in parts {
                out.push(Extent {
                    offset: off,
                    len,
                    data: if zero {
                        ExtentData::Zero
                    } else {
                        ExtentData::Chunk(ChunkId(id))
                    },
                });
                off += len;
            }
            (off, out)
        },
    )
}

fn file_strategy() -> impl Strategy<Value = FileEntry> {
    let path = "[a-z]{1,8}(/[a-z0-9_][a-z0-9._]{0,7}){0,3}";
    let kind = prop_oneof![
        Just(FileKind::Dir),
        "[ -~]{0,30}".prop_map(|target| FileKind::Symlink { target }),
        (
            extents_strategy(),
            prop::option::of((
                prop::collection::vec(any::<u8>(), 0..64),
                1u32..(1 << 22),
                any::<u64>()
            ))
        )
            .prop_map(|((size, extents), image)| FileKind::Content {
                size,
                image: image.map(|(header, frame_size, original_size)| ImageInfo {
                    header,
                    frame_size,
                    original_size,
                }),
                extents,
            }),
    ];
    (path, 0u32..0o7777, kind).prop_map(|(path, mode, kind)| FileEntry { path, mode, kind })
}

fn manifest_strategy() -> impl Strategy<Value = Manifest> {
    (
        id_strategy(),
        prop::option::of(id_strategy()),
        any::<u64>(),
        prop::collection::vec(("[a-z]{1,10}", "[ -~]{0,20}"), 0..4),
        prop::collection::vec(file_strategy(), 0..8),
    )
        .prop_map(|(id, parent, created_unix_ms, labels, files)| {
            // Paths must be unique.
            let mut seen = std::collections::HashSet::new();
            let files: Vec<FileEntry> = files
                .into_iter()
                .filter(|f| seen.insert(f.path.clone()))
                .collect();
            // Nothing may sit below a symlink or a file.
            let non_dirs: std::collections::HashSet<String> = files
                .iter()
                .filter(|f| !matches!(f.kind, FileKind::Dir))
                .map(|f| f.path.clone())
                .collect();
            let files = files
                .into_iter()
                .filter(|f| {
                    !f.path
                        .char_indices()
                        .any(|(i, c)| c == '/' && non_dirs.contains(&f.path[..i]))
                })
                .collect();
            Manifest {
                id,
                parent,
                created_unix_ms,
                chunking: ChunkParams {
                    min: 4096,
                    avg: 16384,
                    max: 65536,
                },
                labels,
                files,
                packs: Default::default(),
            }
        })
        // Pack no chunk, every other one, or every one (version 1 or 2), by the creation time.
        .prop_map(move |mut m| {
            let chunks: std::collections::BTreeSet<ChunkId> =
                m.chunk_refs().map(|(c, _)| *c).collect();
            for (i, c) in chunks.into_iter().enumerate() {
                if m.created_unix_ms % 3 == 0 || (m.created_unix_ms % 3 == 1 && i % 2 == 0) {
                    continue;
                }
                m.packs.insert(
                    c,
                    PackLoc {
                        pack: PackId::of(&[(i % 3) as u8]),
                        offset: i as u64 * 1000,
                        len: 1 + i as u32,
                    },
                );
            }
            m
        })
}

fn reseal(mut bytes: Vec<u8>) -> Vec<u8> {
    if bytes.len() >= 32 {
        let n = bytes.len() - 32;
        bytes.truncate(n);
        let sum = blake3::hash(&bytes);
        bytes.extend_from_slice(sum.as_bytes());
    }
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn manifests_round_trip(m in manifest_strategy()) {
        let bytes = m.encode();
        prop_assert_eq!(Manifest::decode(&bytes).unwrap(), m);
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..4096)) {
        let _ = Manifest::decode(&bytes);
        let mut with_magic = b"TORPSNAP\x01\x00\x00\x00".to_vec();
        with_magic.extend_from_slice(&bytes);
        let _ = Manifest::decode(&reseal(with_magic));
    }

    #[test]
    fn mutated_manifests_are_rejected_or_canonical(
        m in manifest_strategy(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        keep_checksum_valid in any::<bool>(),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = m.encode();
        for (at, val) in &flips {
            let i = at.index(bytes.len());
            bytes[i] = *val;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        if keep_checksum_valid {
            bytes = reseal(bytes);
        }
        if let Ok(decoded) = Manifest::decode(&bytes) {
            // Whatever is accepted is exactly what its encoding says.
            prop_assert_eq!(decoded.encode(), bytes);
        }
    }

    #[test]
    fn truncated_manifests_are_rejected(m in manifest_strategy(), cut in any::<prop::sample::Index>()) {
        let bytes = m.encode();
        let n = cut.index(bytes.len());
        prop_assert!(Manifest::decode(&bytes[..n]).is_err());
    }

    #[test]
    fn chunk_blobs_never_panic(blob in prop::collection::vec(any::<u8>(), 0..2048), id in any::<[u8; 32]>()) {
        let codec = ChunkCodec::new(1, None);
        let _ = codec.decode(&ChunkId(id), &blob);
        let mut framed = b"TCK\x01\x01".to_vec();
        framed.extend_from_slice(&blob);
        let _ = codec.decode(&ChunkId(id), &framed);
    }

    #[test]
    fn image_probe_and_inflate_never_panic(
        tail in prop::collection::vec(any::<u8>(), 0..4096),
        meta_len in 0u64..64,
        frame_size in 1u32..(1 << 16),
    ) {
        let mut img = b"gVisorSF".to_vec();
        img.extend_from_slice(&meta_len.to_be_bytes());
        img.extend(std::iter::repeat_n(b'{', meta_len as usize));
        img.extend_from_slice(&[0u8; 32]);
        img.extend_from_slice(&frame_size.to_be_bytes());
        let header_len = img.len();
        img.extend_from_slice(&tail);
        if let Ok(Some(layout)) = torpor_snapshot::gvisor::probe(Cursor::new(&img)) {
            prop_assert_eq!(layout.header.len(), header_len);
        }
        let mut r = torpor_snapshot::gvisor::InflatingReader::new(&img[header_len..], frame_size);
        let mut sink = Vec::new();
        let _ = r.read_to_end(&mut sink);
        prop_assert!(sink.len() <= tail.len().saturating_mul(1032) + frame_size as usize);
    }
}

proptest! {
    /// The fuzz targets' entry point on random and on mutated valid inputs (what
    /// `cargo fuzz run snapshot_decoders` explores at length).
    #[test]
    fn fuzz_entry_point_never_panics(
        m in manifest_strategy(),
        noise in prop::collection::vec(any::<u8>(), 0..4096),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
    ) {
        torpor_snapshot::fuzzing::decode_untrusted(&noise);
        let mut bytes = m.encode();
        prop_assert!(torpor_snapshot::fuzzing::decode_untrusted(&bytes) >= 1);
        for (i, b) in flips {
            let at = i.index(bytes.len());
            bytes[at] ^= b;
        }
        torpor_snapshot::fuzzing::decode_untrusted(&bytes);
    }
}
