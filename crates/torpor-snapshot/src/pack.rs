//! Packs: many chunk blobs in one object, so that a restore asks for a few large byte ranges
//! instead of one request per chunk, and a put writes a few objects instead of one per chunk
//! (a 64 MiB image is ~3,400 chunks of 16 KiB: that many `GET`s, or `PUT`s, on S3).
//!
//! A packed store (`StoreConfig::pack_bytes`) writes a put's new chunk blobs, in the order it
//! cuts them, into pack objects of about that size, `packs/<2 hex>/<64 hex>`, named by the
//! BLAKE3 of their bytes, each followed by an index object, `packidx/<2 hex>/<64 hex>`, that
//! lists its chunks. The manifest records each packed chunk's pack, offset and length (version
//! 2, see `manifest`), so a restore needs nothing but the manifest; the indexes serve only
//! deduplication, through the store's [`PackCatalog`].
//!
//! Index object (little-endian):
//!
//! ```text
//! "TPIX" | version u16 = 1 | count u32 | count x (chunk id 32 | offset u64 | len u32) | BLAKE3 32
//! ```
//!
//! Lifetimes. A pack lives while any manifest locates a chunk in it; the collector deletes
//! every other pack (its index first, then the pack), including those of puts that failed
//! before their manifest. Packs are never rewritten: a pack that one live snapshot still uses a
//! little of stays whole (`GcReport::pack_bytes_live` against what its snapshots use).
//!
//! The catalog. A put looks a new chunk up in what this process knows of packs: those it
//! wrote, the locations of every packed manifest it restored (a sandbox's next park shares
//! most of its chunks with the snapshot it woke from, and a sandbox's first park with its
//! template's golden snapshot), and the indexes it has read (listed at most every
//! [`CATALOG_REFRESH`], newest first, at most [`INDEX_READS`] new ones a time, so a process
//! joining a store of 10^5 packs reads them over minutes, not before its first upload). A pack
//! found there is checked to still exist (one existence check per pack per put) before a
//! chunk is counted as stored, because another process's collector may have removed it since.
//! Chunks the catalog does not know are stored again (a duplicate the collector keeps while a
//! manifest uses it), never lost.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::chunk::MAX_CHUNK_LEN;
use crate::id::{ChunkId, IdError};

/// Index objects are listed again after this long.
pub const CATALOG_REFRESH: Duration = Duration::from_secs(60);
/// New index objects read per listing at most (the newest first).
pub const INDEX_READS: usize = 256;
/// Chunks the catalog holds at most (~100 MiB of memory): beyond it the packs it learnt of
/// first are forgotten (their chunks, if met again, are stored again), and no more indexes
/// are read while it is over half full. A worker in a store of 10^7 chunks must not hold
/// them all.
pub const MAX_CATALOG_CHUNKS: usize = 1 << 20;
/// Largest blob a pack may hold (a chunk at its cap, plus header and tag).
pub const MAX_PACKED_BLOB: u32 = MAX_CHUNK_LEN + 64;
/// Largest pack accepted in a location or index (1 GiB).
pub const MAX_PACK_BYTES: u64 = 1 << 30;

const INDEX_MAGIC: &[u8; 4] = b"TPIX";
const INDEX_VERSION: u16 = 1;
const INDEX_HEADER: usize = 4 + 2 + 4;
const INDEX_ENTRY: usize = 32 + 8 + 4;
const INDEX_SUM: usize = 32;

/// Name of one pack: the BLAKE3 of its bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PackId(pub [u8; 32]);

impl PackId {
    pub fn of(bytes: &[u8]) -> Self {
        PackId(*blake3::hash(bytes).as_bytes())
    }

    pub fn to_hex(&self) -> String {
        ChunkId(self.0).to_hex()
    }

    pub fn from_hex(s: &str) -> Result<Self, IdError> {
        ChunkId::from_hex(s).map(|c| PackId(c.0))
    }
}

impl std::fmt::Debug for PackId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackId({})", self.to_hex())
    }
}

impl std::fmt::Display for PackId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Where a packed chunk's blob lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PackLoc {
    pub pack: PackId,
    pub offset: u64,
    pub len: u32,
}

impl PackLoc {
    /// Whether the location is within the caps (a decoder's check).
    pub fn in_range(&self) -> bool {
        self.len > 0
            && self.len <= MAX_PACKED_BLOB
            && self
                .offset
                .checked_add(u64::from(self.len))
                .is_some_and(|end| end <= MAX_PACK_BYTES)
    }

    pub fn range(&self) -> std::ops::Range<u64> {
        self.offset..self.offset + u64::from(self.len)
    }
}

/// Why bytes are not a valid pack index.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PackIndexError {
    #[error("pack index is {len} bytes, not a whole number of entries")]
    Size { len: usize },
    #[error("not a torpor pack index (wrong magic or version)")]
    BadMagic,
    #[error("pack index checksum does not match its content")]
    Checksum,
    #[error("pack index entry {index} is out of range")]
    OutOfRange { index: usize },
}

/// A filled pack: id, bytes, index object, each chunk's location.
pub(crate) type FinishedPack = (PackId, Vec<u8>, Vec<u8>, Vec<(ChunkId, PackLoc)>);

/// One pack being filled by a put.
#[derive(Debug, Default)]
pub(crate) struct PackBuilder {
    pub bytes: Vec<u8>,
    pub entries: Vec<(ChunkId, u64, u32)>,
}

impl PackBuilder {
    pub fn push(&mut self, id: ChunkId, blob: &[u8]) {
        let offset = self.bytes.len() as u64;
        self.bytes.extend_from_slice(blob);
        self.entries.push((id, offset, blob.len() as u32));
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The pack's id, its bytes and its index object, and where each chunk lies.
    pub fn finish(self) -> FinishedPack {
        let id = PackId::of(&self.bytes);
        let index = encode_index(&self.entries);
        let locs = self
            .entries
            .into_iter()
            .map(|(chunk, offset, len)| {
                (
                    chunk,
                    PackLoc {
                        pack: id,
                        offset,
                        len,
                    },
                )
            })
            .collect();
        (id, self.bytes, index, locs)
    }
}

pub fn encode_index(entries: &[(ChunkId, u64, u32)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(INDEX_HEADER + entries.len() * INDEX_ENTRY + INDEX_SUM);
    out.extend_from_slice(INDEX_MAGIC);
    out.extend_from_slice(&INDEX_VERSION.to_le_bytes());
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for (id, offset, len) in entries {
        out.extend_from_slice(&id.0);
        out.extend_from_slice(&offset.to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
    }
    let sum = blake3::hash(&out);
    out.extend_from_slice(sum.as_bytes());
    out
}

/// Decodes an untrusted index object: (chunk id, offset, length) per entry.
pub fn decode_index(bytes: &[u8]) -> Result<Vec<(ChunkId, u64, u32)>, PackIndexError> {
    let size = PackIndexError::Size { len: bytes.len() };
    if bytes.len() < INDEX_HEADER + INDEX_SUM
        || !(bytes.len() - INDEX_HEADER - INDEX_SUM).is_multiple_of(INDEX_ENTRY)
    {
        return Err(size);
    }
    if &bytes[..4] != INDEX_MAGIC || bytes[4..6] != INDEX_VERSION.to_le_bytes() {
        return Err(PackIndexError::BadMagic);
    }
    let (covered, sum) = bytes.split_at(bytes.len() - INDEX_SUM);
    if blake3::hash(covered).as_bytes() != sum {
        return Err(PackIndexError::Checksum);
    }
    let count = u32::from_le_bytes([bytes[6], bytes[7], bytes[8], bytes[9]]) as usize;
    let body = &covered[INDEX_HEADER..];
    if body.len() != count.saturating_mul(INDEX_ENTRY) {
        return Err(size);
    }
    body.chunks_exact(INDEX_ENTRY)
        .enumerate()
        .map(|(index, e)| {
            let mut id = [0u8; 32];
            id.copy_from_slice(&e[..32]);
            let offset = u64::from_le_bytes(e[32..40].try_into().unwrap_or([0; 8]));
            let len = u32::from_le_bytes(e[40..44].try_into().unwrap_or([0; 4]));
            let loc = PackLoc {
                pack: PackId([0; 32]),
                offset,
                len,
            };
            if !loc.in_range() {
                return Err(PackIndexError::OutOfRange { index });
            }
            Ok((ChunkId(id), offset, len))
        })
        .collect()
}

/// Chunks an index object of `size` bytes lists (from a listing, without reading it).
pub fn index_entries(size: u64) -> u64 {
    size.saturating_sub((INDEX_HEADER + INDEX_SUM) as u64) / INDEX_ENTRY as u64
}

/// The packed chunks this process knows of, for deduplication (see the module doc).
#[derive(Debug)]
pub struct PackCatalog {
    state: Mutex<CatalogState>,
    /// Chunks held at most ([`MAX_CATALOG_CHUNKS`]).
    cap: usize,
}

impl Default for PackCatalog {
    fn default() -> Self {
        PackCatalog::with_cap(MAX_CATALOG_CHUNKS)
    }
}

#[derive(Debug, Default)]
struct CatalogState {
    chunks: HashMap<ChunkId, PackLoc>,
    packs: HashMap<PackId, Known>,
    /// Packs in the order they became known (the first to go past the cap); a pack dropped
    /// meanwhile is skipped when reached.
    order: std::collections::VecDeque<PackId>,
    listed_at: Option<Instant>,
}

/// What the catalog knows of one pack.
#[derive(Debug, Default)]
struct Known {
    chunks: Vec<ChunkId>,
    /// Its index was read (or this process wrote it): nothing more to learn from it.
    indexed: bool,
}

impl PackCatalog {
    /// A catalog holding at most `cap` chunks.
    pub fn with_cap(cap: usize) -> Self {
        PackCatalog {
            state: Mutex::default(),
            cap,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, CatalogState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the index objects should be listed again.
    pub fn stale(&self) -> bool {
        self.state()
            .listed_at
            .is_none_or(|at| at.elapsed() >= CATALOG_REFRESH)
    }

    /// The packs whose index is known (read, or written here): the others' are worth reading.
    pub fn indexed(&self) -> HashSet<PackId> {
        self.state()
            .packs
            .iter()
            .filter(|(_, k)| k.indexed)
            .map(|(p, _)| *p)
            .collect()
    }

    /// A listing was taken: packs not in `listed` are gone.
    pub fn listed(&self, listed: &HashSet<PackId>) {
        let mut st = self.state();
        let gone: Vec<PackId> = st
            .packs
            .keys()
            .filter(|p| !listed.contains(p))
            .copied()
            .collect();
        for p in gone {
            Self::drop_pack(&mut st, &p);
        }
        let CatalogState { order, packs, .. } = &mut *st;
        order.retain(|p| packs.contains_key(p));
        st.listed_at = Some(Instant::now());
    }

    /// A pack and all its chunks (one this process wrote, or an index it read).
    pub fn add(&self, pack: PackId, entries: &[(ChunkId, u64, u32)]) {
        let mut st = self.state();
        if st.packs.get(&pack).is_some_and(|k| k.indexed) {
            return;
        }
        for &(chunk, offset, len) in entries {
            Self::insert(&mut st, chunk, PackLoc { pack, offset, len });
        }
        Self::known_pack(&mut st, pack).indexed = true;
        Self::trim(&mut st, self.cap);
    }

    /// Whether reading more indexes is worth it (the catalog is under half its cap).
    pub fn has_room(&self) -> bool {
        self.state().chunks.len() < self.cap / 2
    }

    /// The packed chunks a manifest locates (one this process read to restore it).
    pub fn learn(&self, m: &crate::manifest::Manifest) {
        let mut st = self.state();
        for (chunk, loc) in &m.packs {
            Self::insert(&mut st, *chunk, *loc);
        }
        Self::trim(&mut st, self.cap);
    }

    fn insert(st: &mut CatalogState, chunk: ChunkId, loc: PackLoc) {
        if st.chunks.contains_key(&chunk) {
            return;
        }
        st.chunks.insert(chunk, loc);
        Self::known_pack(st, loc.pack).chunks.push(chunk);
    }

    fn known_pack(st: &mut CatalogState, pack: PackId) -> &mut Known {
        if !st.packs.contains_key(&pack) {
            st.order.push_back(pack);
        }
        st.packs.entry(pack).or_default()
    }

    /// Forgets the packs known longest until the chunks are within the cap.
    fn trim(st: &mut CatalogState, cap: usize) {
        while st.chunks.len() > cap {
            let Some(oldest) = st.order.pop_front() else {
                return;
            };
            Self::drop_pack(st, &oldest);
        }
    }

    /// A pack found missing.
    pub fn forget(&self, pack: &PackId) {
        Self::drop_pack(&mut self.state(), pack);
    }

    pub fn lookup(&self, chunk: &ChunkId) -> Option<PackLoc> {
        self.state().chunks.get(chunk).copied()
    }

    fn drop_pack(st: &mut CatalogState, pack: &PackId) {
        for c in st.packs.remove(pack).unwrap_or_default().chunks {
            if st.chunks.get(&c).is_some_and(|l| l.pack == *pack) {
                st.chunks.remove(&c);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_round_trip_and_hostile_input() {
        let entries = vec![(ChunkId::of(b"a"), 0, 100), (ChunkId::of(b"b"), 100, 4000)];
        let bytes = encode_index(&entries);
        assert_eq!(decode_index(&bytes).unwrap(), entries);
        assert_eq!(index_entries(bytes.len() as u64), 2);
        assert_eq!(decode_index(&encode_index(&[])).unwrap(), vec![]);

        let mut flipped = bytes.clone();
        flipped[20] ^= 1;
        assert_eq!(decode_index(&flipped), Err(PackIndexError::Checksum));
        assert!(matches!(
            decode_index(&bytes[..bytes.len() - 1]),
            Err(PackIndexError::Size { .. })
        ));
        let mut magic = bytes.clone();
        magic[0] = b'X';
        assert_eq!(decode_index(&magic), Err(PackIndexError::BadMagic));
        // A declared count that disagrees with the body, re-checksummed.
        let mut count = bytes[..bytes.len() - 32].to_vec();
        count[6] = 3;
        let sum = blake3::hash(&count);
        count.extend_from_slice(sum.as_bytes());
        assert!(matches!(
            decode_index(&count),
            Err(PackIndexError::Size { .. })
        ));
        // An entry past the caps, re-checksummed.
        let huge = encode_index(&[(ChunkId::of(b"c"), MAX_PACK_BYTES, 10)]);
        assert_eq!(
            decode_index(&huge),
            Err(PackIndexError::OutOfRange { index: 0 })
        );
        let empty_blob = encode_index(&[(ChunkId::of(b"c"), 0, 0)]);
        assert_eq!(
            decode_index(&empty_blob),
            Err(PackIndexError::OutOfRange { index: 0 })
        );
    }

    #[test]
    fn the_catalog_forgets_packs_that_are_gone() {
        let cat = PackCatalog::default();
        assert!(cat.stale());
        let (a, b) = (PackId::of(b"pack a"), PackId::of(b"pack b"));
        let shared = ChunkId::of(b"shared");
        cat.add(a, &[(shared, 0, 10), (ChunkId::of(b"only a"), 10, 10)]);
        cat.add(b, &[(shared, 0, 10)]);
        assert_eq!(cat.lookup(&shared).unwrap().pack, a);
        cat.listed(&HashSet::from([b]));
        assert!(!cat.stale());
        // `shared` was located in a, which is gone; b's copy was not recorded (first wins), so
        // the chunk is unknown until b's index is read again: stored again, never lost.
        assert_eq!(cat.lookup(&shared), None);
        assert_eq!(cat.lookup(&ChunkId::of(b"only a")), None);
        assert_eq!(cat.indexed(), HashSet::from([b]));
        cat.forget(&b);
        assert!(cat.indexed().is_empty());
    }

    #[test]
    fn the_catalog_forgets_the_packs_it_knew_first_past_its_cap() {
        let cat = PackCatalog::with_cap(4);
        let pack = |n: u8| PackId::of(&[n]);
        let chunks = |n: u8| -> Vec<(ChunkId, u64, u32)> {
            (0..2u8)
                .map(|i| (ChunkId::of(&[n, i]), u64::from(i), 1))
                .collect()
        };
        for n in 0..3 {
            cat.add(pack(n), &chunks(n));
        }
        // Six chunks over a cap of four: the first pack is forgotten, the others kept.
        assert_eq!(cat.lookup(&ChunkId::of(&[0, 0])), None);
        assert!(cat.lookup(&ChunkId::of(&[2, 1])).is_some());
        assert_eq!(cat.indexed(), HashSet::from([pack(1), pack(2)]));
        // At or over half full, no more indexes are worth reading.
        assert!(!cat.has_room());
        assert!(PackCatalog::default().has_room());
    }

    #[test]
    fn the_catalog_learns_from_manifests_and_still_reads_their_packs_indexes() {
        let cat = PackCatalog::default();
        let m = crate::manifest::tests::packed_sample();
        cat.learn(&m);
        for (chunk, loc) in &m.packs {
            assert_eq!(cat.lookup(chunk), Some(*loc));
        }
        // Learnt from a manifest: the packs' indexes are still worth reading.
        assert!(cat.indexed().is_empty());
        let (a, loc) = m.packs.iter().next().map(|(c, l)| (*c, *l)).unwrap();
        let other = ChunkId::of(b"only in the index");
        cat.add(loc.pack, &[(a, loc.offset, loc.len), (other, 500, 7)]);
        assert_eq!(cat.indexed(), HashSet::from([loc.pack]));
        assert_eq!(cat.lookup(&other).unwrap().offset, 500);
        // Listed without that pack: everything located in it goes.
        cat.listed(&HashSet::new());
        assert_eq!(cat.lookup(&a), None);
        assert_eq!(cat.lookup(&other), None);
    }

    #[test]
    fn a_builder_locates_each_blob() {
        let mut b = PackBuilder::default();
        assert!(b.is_empty());
        b.push(ChunkId::of(b"x"), b"blob-x");
        b.push(ChunkId::of(b"y"), b"blob-yy");
        assert_eq!(b.len(), 13);
        let (id, bytes, index, locs) = b.finish();
        assert_eq!(id, PackId::of(&bytes));
        assert_eq!(decode_index(&index).unwrap().len(), 2);
        let (_, y) = locs[1];
        assert_eq!(
            &bytes[y.offset as usize..y.range().end as usize],
            b"blob-yy"
        );
    }
}
