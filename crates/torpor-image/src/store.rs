//! Where an image's files come from: a directory (OCI image layout) or a tarball (oci-archive,
//! docker save), plain or compressed.
//!
//! A tarball is indexed once (member name to offset and size) and members are then read in
//! place with positioned reads, so blobs are never copied out. A compressed tarball is first
//! decompressed into an anonymous temporary file, within the size limit. This module only
//! reads; it never writes outside that temporary file.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::digest::{is_limit_exceeded, HashingReader};
use crate::{ImageError, Limits};

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];

/// How many links one member lookup may pass through inside an archive.
const MAX_MEMBER_LINKS: usize = 8;

/// How a stream is compressed, told by its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    pub(crate) fn sniff(head: &[u8]) -> Compression {
        if head.starts_with(&GZIP_MAGIC) {
            Compression::Gzip
        } else if head.starts_with(&ZSTD_MAGIC) {
            Compression::Zstd
        } else {
            Compression::None
        }
    }

    /// Wraps `reader` in the matching decoder.
    pub(crate) fn decoder<'a, R: Read + 'a>(self, reader: R) -> io::Result<Box<dyn Read + 'a>> {
        Ok(match self {
            Compression::None => Box::new(reader),
            Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(reader)),
            Compression::Zstd => Box::new(zstd::stream::read::Decoder::new(reader)?),
        })
    }
}

/// Splits a member name or entry path into its normal components: empty and `.` components
/// are dropped, a leading `/` is ignored, and `None` is returned for any `..`.
pub(crate) fn normal_components(path: &[u8]) -> Option<Vec<&[u8]>> {
    let mut components = Vec::new();
    for component in path.split(|&b| b == b'/') {
        match component {
            b"" | b"." => {}
            b".." => return None,
            other => components.push(other),
        }
    }
    Some(components)
}

/// Normalises a member name into the key the archive index uses (`a/b/c`).
fn member_key(name: &[u8]) -> Option<String> {
    let components = normal_components(name)?;
    let joined = components.join(&b'/');
    String::from_utf8(joined).ok()
}

/// Joins `target` onto the directory of `member` lexically; `None` when it climbs above the
/// archive root.
fn resolve_relative(member: &str, target: &[u8]) -> Option<String> {
    let mut parts: Vec<&[u8]> = if target.starts_with(b"/") {
        Vec::new()
    } else {
        let mut base: Vec<&[u8]> = member.as_bytes().split(|&b| b == b'/').collect();
        base.pop();
        base
    };
    for component in target.split(|&b| b == b'/') {
        match component {
            b"" | b"." => {}
            b".." => {
                parts.pop()?;
            }
            other => parts.push(other),
        }
    }
    String::from_utf8(parts.join(&b'/')).ok()
}

#[derive(Debug, Clone)]
enum Member {
    File {
        offset: u64,
        size: u64,
    },
    /// A symbolic or hard link, already resolved to the key it names.
    Link {
        target: String,
    },
}

/// The files of an image, read-only.
pub(crate) enum Store {
    Dir(PathBuf),
    Archive(ArchiveStore),
}

pub(crate) struct ArchiveStore {
    path: PathBuf,
    file: File,
    members: HashMap<String, Member>,
}

impl Store {
    pub(crate) fn dir(path: &Path) -> Store {
        Store::Dir(path.to_owned())
    }

    /// Opens and indexes a tarball; a gzip or zstd tarball is decompressed first, within
    /// `max_unpacked_bytes`, and the index holds at most `max_entries` members.
    pub(crate) fn archive(path: &Path, limits: &Limits) -> Result<Store, ImageError> {
        let file = open_source(path)?;
        let file = decompressed(file, path, limits.max_unpacked_bytes)?;
        let members = index_members(&file, path, limits.max_entries)?;
        Ok(Store::Archive(ArchiveStore {
            path: path.to_owned(),
            file,
            members,
        }))
    }

    /// The name errors use for `member`: its path on disk, or `ARCHIVE/MEMBER`.
    pub(crate) fn display(&self, member: &str) -> PathBuf {
        match self {
            Store::Dir(root) => root.join(member),
            Store::Archive(archive) => archive.path.join(member),
        }
    }

    pub(crate) fn root(&self) -> &Path {
        match self {
            Store::Dir(root) => root,
            Store::Archive(archive) => &archive.path,
        }
    }

    /// Opens `member` for reading; returns the reader and the member's size.
    pub(crate) fn open(&self, member: &str) -> Result<(Box<dyn Read + '_>, u64), ImageError> {
        let not_found = || ImageError::NotFound {
            path: self.display(member),
        };
        match self {
            Store::Dir(root) => {
                let key = member_key(member.as_bytes()).ok_or_else(not_found)?;
                let path = root.join(key);
                let file = File::open(&path).map_err(|source| match source.kind() {
                    io::ErrorKind::NotFound => not_found(),
                    _ => ImageError::Read {
                        path: path.clone(),
                        source,
                    },
                })?;
                let metadata = file.metadata().map_err(|source| ImageError::Read {
                    path: path.clone(),
                    source,
                })?;
                if !metadata.is_file() {
                    return Err(ImageError::corrupt(path, "not a regular file"));
                }
                Ok((Box::new(BufReader::new(file)), metadata.len()))
            }
            Store::Archive(archive) => {
                let (offset, size) = archive.lookup(member).ok_or_else(not_found)?;
                let section = Section {
                    file: &archive.file,
                    position: offset,
                    end: offset + size,
                };
                Ok((Box::new(BufReader::new(section)), size))
            }
        }
    }

    /// Reads a small member whole, refusing one larger than `max_bytes`.
    pub(crate) fn read_small(
        &self,
        member: &str,
        max_bytes: u64,
        what: &'static str,
    ) -> Result<Vec<u8>, ImageError> {
        let (reader, size) = self.open(member)?;
        let too_large = || ImageError::TooLarge {
            path: self.display(member),
            what,
            limit: max_bytes,
        };
        if size > max_bytes {
            return Err(too_large());
        }
        let mut bytes = Vec::with_capacity(size as usize);
        reader
            .take(max_bytes + 1)
            .read_to_end(&mut bytes)
            .map_err(|source| ImageError::Read {
                path: self.display(member),
                source,
            })?;
        if bytes.len() as u64 > max_bytes {
            return Err(too_large());
        }
        Ok(bytes)
    }
}

impl ArchiveStore {
    fn lookup(&self, member: &str) -> Option<(u64, u64)> {
        let mut key = member_key(member.as_bytes())?;
        for _ in 0..=MAX_MEMBER_LINKS {
            match self.members.get(&key)? {
                Member::File { offset, size } => return Some((*offset, *size)),
                Member::Link { target } => key = target.clone(),
            }
        }
        None
    }
}

fn open_source(path: &Path) -> Result<File, ImageError> {
    File::open(path).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound => ImageError::NotFound {
            path: path.to_owned(),
        },
        _ => ImageError::Read {
            path: path.to_owned(),
            source,
        },
    })
}

/// Reads up to four bytes from the start of `file` and rewinds it.
pub(crate) fn sniff_file(file: &mut File, path: &Path) -> Result<Compression, ImageError> {
    let read_error = |source| ImageError::Read {
        path: path.to_owned(),
        source,
    };
    let mut head = Vec::with_capacity(4);
    (&mut *file)
        .take(4)
        .read_to_end(&mut head)
        .map_err(read_error)?;
    file.seek(SeekFrom::Start(0)).map_err(read_error)?;
    Ok(Compression::sniff(&head))
}

/// Returns `file` itself when it is a plain tarball, or an anonymous temporary file holding
/// its decompressed content.
fn decompressed(mut file: File, path: &Path, max_bytes: u64) -> Result<File, ImageError> {
    let compression = sniff_file(&mut file, path)?;
    if compression == Compression::None {
        return Ok(file);
    }
    let corrupt = |source: io::Error| {
        if is_limit_exceeded(&source) {
            ImageError::TooLarge {
                path: path.to_owned(),
                what: "the decompressed archive",
                limit: max_bytes,
            }
        } else {
            ImageError::corrupt(path, format!("cannot decompress: {source}"))
        }
    };
    let decoder = compression.decoder(BufReader::new(file)).map_err(corrupt)?;
    let mut limited = HashingReader::new(decoder, max_bytes);
    let mut plain = tempfile::tempfile().map_err(|source| ImageError::Write {
        path: std::env::temp_dir(),
        source,
    })?;
    // Reading and writing errors are told apart by copying in two steps.
    let mut buffer = vec![0u8; 1 << 16];
    loop {
        let n = match limited.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(corrupt(err)),
        };
        io::Write::write_all(&mut plain, &buffer[..n]).map_err(|source| ImageError::Write {
            path: std::env::temp_dir(),
            source,
        })?;
    }
    Ok(plain)
}

fn index_members(
    mut file: &File,
    path: &Path,
    max_entries: u64,
) -> Result<HashMap<String, Member>, ImageError> {
    let corrupt = |err: io::Error| ImageError::corrupt(path, format!("bad tar archive: {err}"));
    file.seek(SeekFrom::Start(0))
        .map_err(|source| ImageError::Read {
            path: path.to_owned(),
            source,
        })?;
    let mut archive = tar::Archive::new(file);
    let mut members = HashMap::new();
    for (count, entry) in archive.entries_with_seek().map_err(corrupt)?.enumerate() {
        if count as u64 >= max_entries {
            return Err(ImageError::TooManyEntries {
                path: path.to_owned(),
                limit: max_entries,
            });
        }
        let entry = entry.map_err(corrupt)?;
        let Some(key) = member_key(&entry.path_bytes()) else {
            continue;
        };
        let entry_type = entry.header().entry_type();
        let member = if entry_type.is_file() || entry_type.is_contiguous() {
            Member::File {
                offset: entry.raw_file_position(),
                size: entry.size(),
            }
        } else if entry_type.is_symlink() || entry_type.is_hard_link() {
            let Some(link) = entry.link_name_bytes() else {
                continue;
            };
            let target = if entry_type.is_symlink() {
                resolve_relative(&key, &link)
            } else {
                member_key(&link)
            };
            match target {
                Some(target) => Member::Link { target },
                None => continue,
            }
        } else {
            continue;
        };
        members.insert(key, member);
    }
    // The index is only trusted as far as the file really reaches.
    let length = file
        .metadata()
        .map_err(|source| ImageError::Read {
            path: path.to_owned(),
            source,
        })?
        .len();
    for (key, member) in &members {
        if let Member::File { offset, size } = member {
            if offset.checked_add(*size).is_none_or(|end| end > length) {
                return Err(ImageError::corrupt(
                    path,
                    format!("member {key} runs past the end of the archive"),
                ));
            }
        }
    }
    Ok(members)
}

/// A byte range of a file, read with positioned reads so that several can be open at once.
struct Section<'a> {
    file: &'a File,
    position: u64,
    end: u64,
}

impl Read for Section<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.end - self.position;
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        if want == 0 {
            return Ok(0);
        }
        let n = self.file.read_at(&mut buf[..want], self.position)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "archive member is truncated",
            ));
        }
        self.position += n as u64;
        Ok(n)
    }
}

/// Whether the tarball at `path` (plain, gzip or zstd) is an OCI layout or a docker save
/// archive, told by the names of its members. Reads the stream once without a temporary file.
pub(crate) fn scan_archive_kind(path: &Path) -> Result<ArchiveKind, ImageError> {
    let mut file = open_source(path)?;
    let compression = sniff_file(&mut file, path)?;
    let unrecognized = || ImageError::Unrecognized {
        path: path.to_owned(),
    };
    let decoder = compression
        .decoder(BufReader::new(file))
        .map_err(|_| unrecognized())?;
    let mut archive = tar::Archive::new(decoder);
    let mut seen = ArchiveKind::default();
    let entries = archive.entries().map_err(|_| unrecognized())?;
    for entry in entries {
        // A stream that stops being a tar archive partway is judged on what came before.
        let Ok(entry) = entry else { break };
        match member_key(&entry.path_bytes()).as_deref() {
            Some("oci-layout") => seen.oci_layout = true,
            Some("index.json") => seen.index_json = true,
            Some("manifest.json") => seen.manifest_json = true,
            _ => {}
        }
        if seen.oci_layout && seen.index_json {
            break;
        }
    }
    Ok(seen)
}

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct ArchiveKind {
    pub(crate) oci_layout: bool,
    pub(crate) index_json: bool,
    pub(crate) manifest_json: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn components_drop_dots_and_refuse_parent() {
        assert_eq!(
            normal_components(b"/./a//b/./c/").unwrap(),
            vec![&b"a"[..], b"b", b"c"]
        );
        assert!(normal_components(b"a/../b").is_none());
        assert!(normal_components(b"..").is_none());
        assert!(normal_components(b"./").unwrap().is_empty());
    }

    #[test]
    fn relative_links_resolve_inside_the_archive_only() {
        assert_eq!(
            resolve_relative("abc/layer.tar", b"../def/layer.tar").as_deref(),
            Some("def/layer.tar")
        );
        assert_eq!(
            resolve_relative("abc/layer.tar", b"/blobs/x").as_deref(),
            Some("blobs/x")
        );
        assert_eq!(resolve_relative("abc/layer.tar", b"../../x"), None);
    }
}
