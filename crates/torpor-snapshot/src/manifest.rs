//! Snapshot manifests: the versioned, checksummed description of one checkpoint directory as
//! chunk lists. Owns the manifest byte format and its hostile-input decoder; does no I/O.
//!
//! Layout (integers little-endian, strings as u32 length + UTF-8):
//!
//! ```text
//! header   "TORPSNAP" | version u16 (1, or 2 with packs) | reserved u16 (=0) | body_len u64
//! body     id str | has_parent u8 [parent str] | created_unix_ms u64
//!          | chunk_min u32 | chunk_avg u32 | chunk_max u32
//!          | label_count u16 { key str | value str }
//!          | file_count u32 { path str | mode u32 | kind u8 | kind-specific }
//!            kind 0 dir:      -
//!            kind 1 symlink:  target str
//!            kind 2 regular:  size u64 | extents
//!            kind 3 gVisor:   header bytes(u32 len) | frame_size u32 | original_size u64
//!                             | inflated_size u64 | extents
//!          extents = count u32 { offset u64 | len u64 | kind u8 (0 zero run, 1 chunk) [id 32] }
//!          version 2 only (a packed store, see `pack`):
//!          | pack_count u32 { pack id 32 }    strictly ascending, each one used
//!          | loc_count u32 { chunk id 32 | pack u32 (index above) | offset u64 | len u32 }
//!                                             strictly ascending by chunk id, each chunk one of
//!                                             the extents'; a chunk without one is its own object
//! trailer  BLAKE3(header | body), 32 bytes
//! ```
//!
//! The decoder checks the checksum before parsing, caps every length by both a constant and
//! the bytes that remain, never preallocates from a declared count, and requires extents to be
//! contiguous from offset 0 and to add up to the file's size.

use std::collections::{BTreeMap, HashSet};

use crate::chunk::MAX_CHUNK_LEN;
use crate::id::{ChunkId, IdError, SnapshotId};
use crate::pack::{PackId, PackLoc};

pub const MAGIC: &[u8; 8] = b"TORPSNAP";
/// The version written when no chunk is packed (readable by builds that predate packs).
pub const VERSION: u16 = 1;
/// The version written when chunks are packed.
pub const VERSION_PACKED: u16 = 2;
/// Largest manifest accepted, encoded.
pub const MAX_MANIFEST_BYTES: usize = 256 * 1024 * 1024;
pub const MAX_FILES: u32 = 1_000_000;
pub const MAX_PATH_LEN: usize = 4096;
pub const MAX_LABELS: u16 = 64;
pub const MAX_LABEL_LEN: usize = 1024;
/// Largest gVisor image header (magic, metadata JSON, MAC, frame size) kept inline.
pub const MAX_IMAGE_HEADER: usize = 16 * 1024 * 1024;
/// Largest file described, logical bytes (1 TiB).
pub const MAX_FILE_SIZE: u64 = 1 << 40;

const HEADER_LEN: usize = 8 + 2 + 2 + 8;
const CHECKSUM_LEN: usize = 32;

/// Why bytes are not a valid manifest. Every variant is a rejection of the input, never a panic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error("manifest is {len} bytes, outside the accepted range")]
    Size { len: usize },
    #[error("not a torpor snapshot manifest (wrong magic)")]
    BadMagic,
    #[error("manifest version {found} is not supported (this build reads {VERSION} and {VERSION_PACKED})")]
    UnsupportedVersion { found: u16 },
    #[error("manifest checksum does not match its content")]
    Checksum,
    #[error("manifest ends early while reading {what}")]
    Truncated { what: &'static str },
    #[error("manifest field {what} is out of range")]
    OutOfRange { what: &'static str },
    #[error("manifest holds {0} unexpected trailing bytes in its body")]
    TrailingBytes(usize),
    #[error("manifest string {what} is not UTF-8")]
    NotUtf8 { what: &'static str },
    #[error("manifest path {path:?} is not a clean relative path")]
    BadPath { path: String },
    #[error("manifest lists {path:?} twice")]
    DuplicatePath { path: String },
    #[error("manifest path {path:?} lies under a symlink or a file")]
    PathThroughNonDirectory { path: String },
    #[error("extents of {path:?} are not contiguous or do not add up to its size")]
    BadExtents { path: String },
    #[error("manifest id is invalid")]
    BadId(#[source] IdError),
}

impl ManifestError {
    pub fn code(&self) -> &'static str {
        match self {
            ManifestError::Size { .. } => "manifest_size",
            ManifestError::BadMagic => "manifest_bad_magic",
            ManifestError::UnsupportedVersion { .. } => "manifest_unsupported_version",
            ManifestError::Checksum => "manifest_checksum",
            ManifestError::Truncated { .. } => "manifest_truncated",
            ManifestError::OutOfRange { .. } => "manifest_out_of_range",
            ManifestError::TrailingBytes(_) => "manifest_trailing_bytes",
            ManifestError::NotUtf8 { .. } => "manifest_not_utf8",
            ManifestError::BadPath { .. } => "manifest_bad_path",
            ManifestError::DuplicatePath { .. } => "manifest_duplicate_path",
            ManifestError::PathThroughNonDirectory { .. } => "manifest_path_through_non_directory",
            ManifestError::BadExtents { .. } => "manifest_bad_extents",
            ManifestError::BadId(_) => "manifest_bad_id",
        }
    }
}

/// FastCDC parameters a snapshot was cut with (recorded so stats and tools can explain ratios).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkParams {
    pub min: u32,
    pub avg: u32,
    pub max: u32,
}

/// One contiguous range of a file's logical content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
    pub data: ExtentData,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtentData {
    /// A run of zero bytes (or a hole): nothing stored.
    Zero,
    /// A stored chunk; `len` equals the chunk's plaintext length.
    Chunk(ChunkId),
}

/// A gVisor checkpoint image stored as its inflated stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageInfo {
    /// Bytes from the magic up to and including the frame size, verbatim.
    pub header: Vec<u8>,
    pub frame_size: u32,
    /// Size of the image as runsc wrote it (compressed frames).
    pub original_size: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileKind {
    Dir,
    Symlink {
        target: String,
    },
    /// Logical content = the file's bytes (regular) or the inflated stream (gVisor image).
    Content {
        size: u64,
        image: Option<ImageInfo>,
        extents: Vec<Extent>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileEntry {
    /// Relative, `/`-separated, no `.`/`..`/empty components.
    pub path: String,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    pub kind: FileKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub id: SnapshotId,
    pub parent: Option<SnapshotId>,
    pub created_unix_ms: u64,
    pub chunking: ChunkParams,
    /// Free-form labels (`sandbox`, `tenant`, `template`...) used by retention and tools.
    pub labels: Vec<(String, String)>,
    pub files: Vec<FileEntry>,
    /// Where packed chunks lie; a chunk not here is stored as its own object.
    pub packs: BTreeMap<ChunkId, PackLoc>,
}

impl Manifest {
    /// Every chunk id referenced, with repeats.
    pub fn chunk_refs(&self) -> impl Iterator<Item = (&ChunkId, u64)> {
        self.files.iter().flat_map(|f| {
            match &f.kind {
                FileKind::Content { extents, .. } => extents.as_slice(),
                _ => &[],
            }
            .iter()
            .filter_map(|e| match &e.data {
                ExtentData::Chunk(id) => Some((id, e.len)),
                ExtentData::Zero => None,
            })
        })
    }

    /// Sum of the logical sizes of all files.
    pub fn logical_bytes(&self) -> u64 {
        self.files
            .iter()
            .map(|f| match &f.kind {
                FileKind::Content { size, .. } => *size,
                _ => 0,
            })
            .sum()
    }

    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(256 + 64 * self.files.len());
        put_str(&mut body, self.id.as_str());
        match &self.parent {
            Some(p) => {
                body.push(1);
                put_str(&mut body, p.as_str());
            }
            None => body.push(0),
        }
        body.extend_from_slice(&self.created_unix_ms.to_le_bytes());
        body.extend_from_slice(&self.chunking.min.to_le_bytes());
        body.extend_from_slice(&self.chunking.avg.to_le_bytes());
        body.extend_from_slice(&self.chunking.max.to_le_bytes());
        body.extend_from_slice(&(self.labels.len() as u16).to_le_bytes());
        for (k, v) in &self.labels {
            put_str(&mut body, k);
            put_str(&mut body, v);
        }
        body.extend_from_slice(&(self.files.len() as u32).to_le_bytes());
        for f in &self.files {
            put_str(&mut body, &f.path);
            body.extend_from_slice(&f.mode.to_le_bytes());
            match &f.kind {
                FileKind::Dir => body.push(0),
                FileKind::Symlink { target } => {
                    body.push(1);
                    put_str(&mut body, target);
                }
                FileKind::Content {
                    size,
                    image,
                    extents,
                } => {
                    match image {
                        None => {
                            body.push(2);
                            body.extend_from_slice(&size.to_le_bytes());
                        }
                        Some(img) => {
                            body.push(3);
                            body.extend_from_slice(&(img.header.len() as u32).to_le_bytes());
                            body.extend_from_slice(&img.header);
                            body.extend_from_slice(&img.frame_size.to_le_bytes());
                            body.extend_from_slice(&img.original_size.to_le_bytes());
                            body.extend_from_slice(&size.to_le_bytes());
                        }
                    }
                    body.extend_from_slice(&(extents.len() as u32).to_le_bytes());
                    for e in extents {
                        body.extend_from_slice(&e.offset.to_le_bytes());
                        body.extend_from_slice(&e.len.to_le_bytes());
                        match &e.data {
                            ExtentData::Zero => body.push(0),
                            ExtentData::Chunk(id) => {
                                body.push(1);
                                body.extend_from_slice(&id.0);
                            }
                        }
                    }
                }
            }
        }
        let version = if self.packs.is_empty() {
            VERSION
        } else {
            let ids: std::collections::BTreeSet<PackId> =
                self.packs.values().map(|l| l.pack).collect();
            body.extend_from_slice(&(ids.len() as u32).to_le_bytes());
            for id in &ids {
                body.extend_from_slice(&id.0);
            }
            let index: BTreeMap<PackId, u32> = ids
                .iter()
                .enumerate()
                .map(|(i, p)| (*p, i as u32))
                .collect();
            body.extend_from_slice(&(self.packs.len() as u32).to_le_bytes());
            for (chunk, loc) in &self.packs {
                body.extend_from_slice(&chunk.0);
                body.extend_from_slice(&index[&loc.pack].to_le_bytes());
                body.extend_from_slice(&loc.offset.to_le_bytes());
                body.extend_from_slice(&loc.len.to_le_bytes());
            }
            VERSION_PACKED
        };
        let mut out = Vec::with_capacity(HEADER_LEN + body.len() + CHECKSUM_LEN);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&version.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        out.extend_from_slice(&body);
        let sum = blake3::hash(&out);
        out.extend_from_slice(sum.as_bytes());
        out
    }

    /// Decodes untrusted bytes. See the module docs for what is checked.
    pub fn decode(bytes: &[u8]) -> Result<Manifest, ManifestError> {
        if bytes.len() < HEADER_LEN + CHECKSUM_LEN || bytes.len() > MAX_MANIFEST_BYTES {
            return Err(ManifestError::Size { len: bytes.len() });
        }
        if &bytes[..8] != MAGIC {
            return Err(ManifestError::BadMagic);
        }
        let version = u16::from_le_bytes([bytes[8], bytes[9]]);
        if version != VERSION && version != VERSION_PACKED {
            return Err(ManifestError::UnsupportedVersion { found: version });
        }
        let (covered, sum) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
        if blake3::hash(covered).as_bytes() != sum {
            return Err(ManifestError::Checksum);
        }
        let mut hdr = Reader::new(&covered[10..HEADER_LEN]);
        if hdr.u16("reserved")? != 0 {
            return Err(ManifestError::OutOfRange { what: "reserved" });
        }
        let body_len = hdr.u64("body length")?;
        let body = &covered[HEADER_LEN..];
        if body_len != body.len() as u64 {
            return Err(ManifestError::OutOfRange {
                what: "body length",
            });
        }
        let mut r = Reader::new(body);
        let id = SnapshotId::new(r.string("id", 256)?).map_err(ManifestError::BadId)?;
        let parent = match r.u8("parent flag")? {
            0 => None,
            1 => Some(SnapshotId::new(r.string("parent", 256)?).map_err(ManifestError::BadId)?),
            _ => {
                return Err(ManifestError::OutOfRange {
                    what: "parent flag",
                })
            }
        };
        let created_unix_ms = r.u64("created")?;
        let chunking = ChunkParams {
            min: r.u32("chunk min")?,
            avg: r.u32("chunk avg")?,
            max: r.u32("chunk max")?,
        };
        if chunking.max > MAX_CHUNK_LEN
            || chunking.min > chunking.avg
            || chunking.avg > chunking.max
        {
            return Err(ManifestError::OutOfRange { what: "chunking" });
        }
        let label_count = r.u16("label count")?;
        if label_count > MAX_LABELS {
            return Err(ManifestError::OutOfRange {
                what: "label count",
            });
        }
        let mut labels = Vec::new();
        for _ in 0..label_count {
            let k = r.string("label key", MAX_LABEL_LEN)?;
            let v = r.string("label value", MAX_LABEL_LEN)?;
            labels.push((k, v));
        }
        let file_count = r.u32("file count")?;
        if file_count > MAX_FILES {
            return Err(ManifestError::OutOfRange { what: "file count" });
        }
        let mut files = Vec::new();
        let mut seen = HashSet::new();
        for _ in 0..file_count {
            let path = r.string("path", MAX_PATH_LEN)?;
            if !is_clean_relative(&path) {
                return Err(ManifestError::BadPath { path });
            }
            if !seen.insert(path.clone()) {
                return Err(ManifestError::DuplicatePath { path });
            }
            let mode = r.u32("mode")?;
            if mode > 0o7777 {
                return Err(ManifestError::OutOfRange { what: "mode" });
            }
            let kind = match r.u8("file kind")? {
                0 => FileKind::Dir,
                1 => FileKind::Symlink {
                    target: r.string("symlink target", MAX_PATH_LEN)?,
                },
                k @ (2 | 3) => {
                    let (size, image) = if k == 2 {
                        (r.u64("size")?, None)
                    } else {
                        let hlen = r.u32("image header length")? as usize;
                        if hlen > MAX_IMAGE_HEADER {
                            return Err(ManifestError::OutOfRange {
                                what: "image header length",
                            });
                        }
                        let header = r.bytes(hlen, "image header")?.to_vec();
                        let frame_size = r.u32("frame size")?;
                        if frame_size == 0 || frame_size > crate::gvisor::MAX_FRAME_SIZE {
                            return Err(ManifestError::OutOfRange { what: "frame size" });
                        }
                        let original_size = r.u64("original size")?;
                        let size = r.u64("inflated size")?;
                        (
                            size,
                            Some(ImageInfo {
                                header,
                                frame_size,
                                original_size,
                            }),
                        )
                    };
                    if size > MAX_FILE_SIZE {
                        return Err(ManifestError::OutOfRange { what: "size" });
                    }
                    let extents = read_extents(&mut r, size, &path)?;
                    FileKind::Content {
                        size,
                        image,
                        extents,
                    }
                }
                _ => return Err(ManifestError::OutOfRange { what: "file kind" }),
            };
            files.push(FileEntry { path, mode, kind });
        }
        let packs = if version == VERSION_PACKED {
            read_packs(&mut r, &files)?
        } else {
            BTreeMap::new()
        };
        if r.remaining() != 0 {
            return Err(ManifestError::TrailingBytes(r.remaining()));
        }
        // A restore joins paths onto its directory: no entry may sit below a symlink (which
        // could point anywhere) or below a file.
        let non_dirs: HashSet<&str> = files
            .iter()
            .filter(|f| !matches!(f.kind, FileKind::Dir))
            .map(|f| f.path.as_str())
            .collect();
        for f in &files {
            for (i, c) in f.path.char_indices() {
                if c == '/' && non_dirs.contains(&f.path[..i]) {
                    return Err(ManifestError::PathThroughNonDirectory {
                        path: f.path.clone(),
                    });
                }
            }
        }
        Ok(Manifest {
            id,
            parent,
            created_unix_ms,
            chunking,
            labels,
            files,
            packs,
        })
    }
}

/// The version 2 section: canonical (ascending, no unused pack, no location of a chunk the
/// files do not name, at least one location), every location within the caps.
fn read_packs(
    r: &mut Reader<'_>,
    files: &[FileEntry],
) -> Result<BTreeMap<ChunkId, PackLoc>, ManifestError> {
    let bad = |what| ManifestError::OutOfRange { what };
    let pack_count = r.u32("pack count")? as usize;
    if pack_count > r.remaining() / 32 {
        return Err(ManifestError::Truncated { what: "packs" });
    }
    let mut ids: Vec<PackId> = Vec::new();
    for _ in 0..pack_count {
        let id = PackId(r.array::<32>("pack id")?);
        if ids.last().is_some_and(|last| *last >= id) {
            return Err(bad("pack order"));
        }
        ids.push(id);
    }
    let loc_count = r.u32("location count")? as usize;
    if loc_count == 0 || loc_count > r.remaining() / (32 + 4 + 8 + 4) {
        return Err(ManifestError::Truncated { what: "locations" });
    }
    let named: HashSet<ChunkId> = files
        .iter()
        .flat_map(|f| match &f.kind {
            FileKind::Content { extents, .. } => extents.as_slice(),
            _ => &[],
        })
        .filter_map(|e| match e.data {
            ExtentData::Chunk(id) => Some(id),
            ExtentData::Zero => None,
        })
        .collect();
    let mut used = vec![false; ids.len()];
    let mut packs = BTreeMap::new();
    let mut last: Option<ChunkId> = None;
    for _ in 0..loc_count {
        let chunk = ChunkId(r.array::<32>("located chunk")?);
        let pack = r.u32("location pack")? as usize;
        let loc = PackLoc {
            pack: *ids.get(pack).ok_or(bad("location pack"))?,
            offset: r.u64("location offset")?,
            len: r.u32("location length")?,
        };
        if last.is_some_and(|l| l >= chunk) {
            return Err(bad("location order"));
        }
        if !named.contains(&chunk) {
            return Err(bad("located chunk"));
        }
        if !loc.in_range() {
            return Err(bad("location"));
        }
        used[pack] = true;
        last = Some(chunk);
        packs.insert(chunk, loc);
    }
    if used.contains(&false) {
        return Err(bad("unused pack"));
    }
    Ok(packs)
}

fn read_extents(r: &mut Reader<'_>, size: u64, path: &str) -> Result<Vec<Extent>, ManifestError> {
    const MIN_EXTENT_BYTES: usize = 8 + 8 + 1;
    let count = r.u32("extent count")? as usize;
    if count > r.remaining() / MIN_EXTENT_BYTES {
        return Err(ManifestError::Truncated { what: "extents" });
    }
    let bad = || ManifestError::BadExtents {
        path: path.to_string(),
    };
    let mut extents = Vec::with_capacity(count);
    let mut next = 0u64;
    for _ in 0..count {
        let offset = r.u64("extent offset")?;
        let len = r.u64("extent length")?;
        let data = match r.u8("extent kind")? {
            0 => ExtentData::Zero,
            1 => {
                let mut id = [0u8; 32];
                id.copy_from_slice(r.bytes(32, "chunk id")?);
                if len > u64::from(MAX_CHUNK_LEN) {
                    return Err(ManifestError::OutOfRange {
                        what: "chunk length",
                    });
                }
                ExtentData::Chunk(ChunkId(id))
            }
            _ => {
                return Err(ManifestError::OutOfRange {
                    what: "extent kind",
                })
            }
        };
        if offset != next || len == 0 {
            return Err(bad());
        }
        next = next.checked_add(len).ok_or_else(bad)?;
        extents.push(Extent { offset, len, data });
    }
    if next != size {
        return Err(bad());
    }
    Ok(extents)
}

/// True for `a/b/c`: relative, no empty, `.` or `..` components, no NUL or backslash.
pub fn is_clean_relative(path: &str) -> bool {
    !path.is_empty()
        && !path.starts_with('/')
        && !path.contains('\0')
        && !path.contains('\\')
        && path
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }

    fn remaining(&self) -> usize {
        self.buf.len()
    }

    fn bytes(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], ManifestError> {
        if n > self.buf.len() {
            return Err(ManifestError::Truncated { what });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], ManifestError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.bytes(N, what)?);
        Ok(a)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, ManifestError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, ManifestError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, ManifestError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, ManifestError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &'static str, cap: usize) -> Result<String, ManifestError> {
        let len = self.u32(what)? as usize;
        if len > cap {
            return Err(ManifestError::OutOfRange { what });
        }
        let b = self.bytes(len, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| ManifestError::NotUtf8 { what })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample() -> Manifest {
        let a = ChunkId::of(b"a");
        let b = ChunkId::of(b"b");
        Manifest {
            id: SnapshotId::new("snap-1").unwrap(),
            parent: Some(SnapshotId::new("snap-0").unwrap()),
            created_unix_ms: 1_700_000_000_000,
            chunking: ChunkParams {
                min: 16384,
                avg: 65536,
                max: 262144,
            },
            labels: vec![("sandbox".into(), "sb-1".into())],
            files: vec![
                FileEntry {
                    path: "d".into(),
                    mode: 0o755,
                    kind: FileKind::Dir,
                },
                FileEntry {
                    path: "d/link".into(),
                    mode: 0o777,
                    kind: FileKind::Symlink {
                        target: "../f".into(),
                    },
                },
                FileEntry {
                    path: "f".into(),
                    mode: 0o644,
                    kind: FileKind::Content {
                        size: 300,
                        image: None,
                        extents: vec![
                            Extent {
                                offset: 0,
                                len: 100,
                                data: ExtentData::Chunk(a),
                            },
                            Extent {
                                offset: 100,
                                len: 150,
                                data: ExtentData::Zero,
                            },
                            Extent {
                                offset: 250,
                                len: 50,
                                data: ExtentData::Chunk(b),
                            },
                        ],
                    },
                },
                FileEntry {
                    path: "checkpoint.img".into(),
                    mode: 0o644,
                    kind: FileKind::Content {
                        size: 10,
                        image: Some(ImageInfo {
                            header: b"gVisorSF....".to_vec(),
                            frame_size: 1 << 20,
                            original_size: 42,
                        }),
                        extents: vec![Extent {
                            offset: 0,
                            len: 10,
                            data: ExtentData::Chunk(a),
                        }],
                    },
                },
            ],
            packs: BTreeMap::new(),
        }
    }

    /// `sample()` with `a` and `b` packed (version 2).
    pub(crate) fn packed_sample() -> Manifest {
        let mut m = sample();
        let (p, q) = (PackId::of(b"p"), PackId::of(b"q"));
        m.packs.insert(
            ChunkId::of(b"a"),
            PackLoc {
                pack: q,
                offset: 0,
                len: 120,
            },
        );
        m.packs.insert(
            ChunkId::of(b"b"),
            PackLoc {
                pack: p,
                offset: 4096,
                len: 70,
            },
        );
        m
    }

    #[test]
    fn packed_round_trip_and_hostile_pack_sections() {
        let m = packed_sample();
        let bytes = m.encode();
        assert_eq!(u16::from_le_bytes([bytes[8], bytes[9]]), VERSION_PACKED);
        assert_eq!(Manifest::decode(&bytes).unwrap(), m);
        // Without locations the manifest stays version 1, byte for byte.
        assert_eq!(
            u16::from_le_bytes([sample().encode()[8], sample().encode()[9]]),
            VERSION
        );

        let reject = |m: &Manifest| Manifest::decode(&m.encode()).unwrap_err();
        // A location of a chunk no file names.
        let mut stray = packed_sample();
        stray.packs.insert(
            ChunkId::of(b"stray"),
            PackLoc {
                pack: PackId::of(b"p"),
                offset: 0,
                len: 1,
            },
        );
        assert_eq!(
            reject(&stray),
            ManifestError::OutOfRange {
                what: "located chunk"
            }
        );
        // Past the caps.
        let mut huge = packed_sample();
        huge.packs.values_mut().next().unwrap().offset = crate::pack::MAX_PACK_BYTES;
        assert_eq!(
            reject(&huge),
            ManifestError::OutOfRange { what: "location" }
        );
        let mut empty = packed_sample();
        empty.packs.values_mut().next().unwrap().len = 0;
        assert_eq!(
            reject(&empty),
            ManifestError::OutOfRange { what: "location" }
        );

        // Hand-made sections: body = v1 body + section; re-checksummed.
        let v1 = sample().encode();
        let body_v1 = &v1[HEADER_LEN..v1.len() - CHECKSUM_LEN];
        let with_section = |section: &[u8]| {
            let mut body = body_v1.to_vec();
            body.extend_from_slice(section);
            let mut out = Vec::new();
            out.extend_from_slice(MAGIC);
            out.extend_from_slice(&VERSION_PACKED.to_le_bytes());
            out.extend_from_slice(&0u16.to_le_bytes());
            out.extend_from_slice(&(body.len() as u64).to_le_bytes());
            out.extend_from_slice(&body);
            reseal(out.into_iter().chain([0u8; 32]).collect())
        };
        let loc = |chunk: &[u8], pack: u32| {
            let mut v = ChunkId::of(chunk).0.to_vec();
            v.extend_from_slice(&pack.to_le_bytes());
            v.extend_from_slice(&0u64.to_le_bytes());
            v.extend_from_slice(&10u32.to_le_bytes());
            v
        };
        let (lo, hi) = {
            let (a, b) = (PackId::of(b"p"), PackId::of(b"q"));
            (a.min(b), a.max(b))
        };
        let section = |packs: &[PackId], locs: &[Vec<u8>]| {
            let mut s = (packs.len() as u32).to_le_bytes().to_vec();
            for p in packs {
                s.extend_from_slice(&p.0);
            }
            s.extend_from_slice(&(locs.len() as u32).to_le_bytes());
            for l in locs {
                s.extend_from_slice(l);
            }
            s
        };
        let (mut a_b, ca, cb) = (Vec::new(), ChunkId::of(b"a"), ChunkId::of(b"b"));
        a_b.push(if ca < cb { loc(b"a", 0) } else { loc(b"b", 0) });
        a_b.push(if ca < cb { loc(b"b", 0) } else { loc(b"a", 0) });
        assert!(Manifest::decode(&with_section(&section(&[lo], &a_b))).is_ok());
        let b_a: Vec<Vec<u8>> = a_b.iter().rev().cloned().collect();
        for (bytes, what) in [
            (section(&[lo], &b_a), "location order"),
            (section(&[hi, lo], &a_b), "pack order"),
            (section(&[lo, hi], &a_b), "unused pack"),
            (section(&[lo], &[loc(b"a", 1)]), "location pack"),
        ] {
            assert_eq!(
                Manifest::decode(&with_section(&bytes)).unwrap_err(),
                ManifestError::OutOfRange { what },
                "{what}"
            );
        }
        // Version 2 with no location at all is not canonical; counts past the bytes fail fast.
        for bytes in [section(&[], &[]), {
            let mut s = section(&[lo], &a_b);
            s[..4].copy_from_slice(&u32::MAX.to_le_bytes());
            s
        }] {
            assert!(matches!(
                Manifest::decode(&with_section(&bytes)).unwrap_err(),
                ManifestError::Truncated { .. }
            ));
        }
    }

    #[test]
    fn round_trip() {
        let m = sample();
        let bytes = m.encode();
        assert_eq!(Manifest::decode(&bytes).unwrap(), m);
        assert_eq!(m.logical_bytes(), 310);
        assert_eq!(m.chunk_refs().count(), 3);
        assert_eq!(m.label("sandbox"), Some("sb-1"));
    }

    #[test]
    fn rejects_wrong_magic_version_and_checksum() {
        let bytes = sample().encode();
        let mut b = bytes.clone();
        b[0] = b'X';
        assert_eq!(Manifest::decode(&b), Err(ManifestError::BadMagic));
        let mut b = bytes.clone();
        b[8] = 9;
        assert_eq!(
            Manifest::decode(&b),
            Err(ManifestError::UnsupportedVersion { found: 9 })
        );
        let mut b = bytes.clone();
        b[40] ^= 0x80;
        assert_eq!(Manifest::decode(&b), Err(ManifestError::Checksum));
        assert!(matches!(
            Manifest::decode(&bytes[..bytes.len() - 1]),
            Err(ManifestError::Checksum)
        ));
        assert!(matches!(
            Manifest::decode(&bytes[..10]),
            Err(ManifestError::Size { .. })
        ));
    }

    /// Re-seals a body so the checksum passes and the structural checks are what reject it.
    pub(crate) fn reseal(mut bytes: Vec<u8>) -> Vec<u8> {
        let n = bytes.len() - CHECKSUM_LEN;
        bytes.truncate(n);
        let sum = blake3::hash(&bytes);
        bytes.extend_from_slice(sum.as_bytes());
        bytes
    }

    #[test]
    fn rejects_hostile_structure_with_valid_checksum() {
        let mut m = sample();
        m.files[0].path = "../etc".into();
        assert!(matches!(
            Manifest::decode(&m.encode()),
            Err(ManifestError::BadPath { .. })
        ));

        let mut m = sample();
        m.files[1].path = "d".into();
        assert!(matches!(
            Manifest::decode(&m.encode()),
            Err(ManifestError::DuplicatePath { .. })
        ));

        let mut m = sample();
        if let FileKind::Content { size, .. } = &mut m.files[2].kind {
            *size = 301;
        }
        assert!(matches!(
            Manifest::decode(&m.encode()),
            Err(ManifestError::BadExtents { .. })
        ));

        // A file count of u32::MAX with a tiny body must fail fast without allocating.
        let m = Manifest {
            files: vec![],
            ..sample()
        };
        let mut bytes = m.encode();
        let pos = bytes.len() - CHECKSUM_LEN - 4;
        bytes[pos..pos + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Manifest::decode(&reseal(bytes)),
            Err(ManifestError::OutOfRange { .. })
        ));
    }

    #[test]
    fn rejects_paths_below_symlinks_or_files() {
        let mut m = sample();
        m.files.push(FileEntry {
            path: "d/link/passwd".into(),
            mode: 0o644,
            kind: FileKind::Dir,
        });
        assert!(matches!(
            Manifest::decode(&m.encode()),
            Err(ManifestError::PathThroughNonDirectory { .. })
        ));
        let mut m = sample();
        m.files.push(FileEntry {
            path: "f/x".into(),
            mode: 0o644,
            kind: FileKind::Dir,
        });
        assert!(matches!(
            Manifest::decode(&m.encode()),
            Err(ManifestError::PathThroughNonDirectory { .. })
        ));
    }

    #[test]
    fn clean_paths() {
        for ok in ["a", "a/b", "checkpoint.img", "a..b"] {
            assert!(is_clean_relative(ok), "{ok}");
        }
        for bad in ["", "/a", "a//b", "./a", "a/..", "a\\b", "a/"] {
            assert!(!is_clean_relative(bad), "{bad}");
        }
    }
}
