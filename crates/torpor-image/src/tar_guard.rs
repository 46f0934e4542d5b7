//! A pass-through reader that follows the tar framing ahead of the `tar` crate and refuses
//! oversized metadata records before they are read.
//!
//! The `tar` crate reads GNU long names (`L`), long link names (`K`) and PAX records (`x`)
//! into memory whole, however large their header says they are; a few megabytes of gzip can
//! declare gigabytes. This reader sees each header first and fails the stream when such a
//! record is larger than [`MAX_METADATA_BYTES`].
//!
//! It follows the crate's framing with the crate's own parsers (PAX `size` overriding the
//! next entry's size, GNU sparse extension blocks, end at the first zero block). Where a
//! header does not verify (bad checksum or size) it stops inspecting, since the `tar` crate
//! fails on that header anyway.

use std::fmt;
use std::io::{self, Read};

/// Largest long name, long link name or PAX record set accepted for one entry.
pub(crate) const MAX_METADATA_BYTES: u64 = 1 << 20;

const BLOCK: usize = 512;

/// The error a [`TarGuard`] fails with; told apart with [`is_metadata_too_large`].
#[derive(Debug)]
struct MetadataTooLarge;

impl fmt::Display for MetadataTooLarge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("tar metadata record too large")
    }
}

impl std::error::Error for MetadataTooLarge {}

pub(crate) fn is_metadata_too_large(err: &io::Error) -> bool {
    err.get_ref()
        .is_some_and(|inner| inner.is::<MetadataTooLarge>())
}

enum State {
    /// Collecting a header block.
    Header {
        block: Box<[u8; BLOCK]>,
        filled: usize,
    },
    /// Collecting a GNU sparse extension block; `data` follows the last one.
    SparseExtension {
        block: Box<[u8; BLOCK]>,
        filled: usize,
        data: u64,
    },
    /// Keeping the records of a PAX header, then skipping its padding.
    Pax {
        records: Vec<u8>,
        left: u64,
        padding: u64,
    },
    Skip {
        left: u64,
    },
    /// End of archive, or a header the `tar` crate will refuse: nothing more to check.
    Done,
}

pub(crate) struct TarGuard<R> {
    inner: R,
    state: State,
    /// Size from the pending PAX records, for the next entry that is not metadata.
    pending_pax: Option<Option<u64>>,
}

impl<R: Read> TarGuard<R> {
    pub(crate) fn new(inner: R) -> Self {
        TarGuard {
            inner,
            state: State::Header {
                block: Box::new([0; BLOCK]),
                filled: 0,
            },
            pending_pax: None,
        }
    }

    fn observe(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            match &mut self.state {
                State::Done => return Ok(()),
                State::Skip { left } => {
                    let n = (*left).min(bytes.len() as u64) as usize;
                    *left -= n as u64;
                    bytes = &bytes[n..];
                    if *left == 0 {
                        self.state = header_state();
                    }
                }
                State::Pax {
                    records,
                    left,
                    padding,
                } => {
                    let n = (*left).min(bytes.len() as u64) as usize;
                    records.extend_from_slice(&bytes[..n]);
                    *left -= n as u64;
                    bytes = &bytes[n..];
                    if *left == 0 {
                        self.pending_pax = Some(pax_size(records));
                        self.state = skip_then_header(*padding);
                    }
                }
                State::Header { block, filled } => {
                    let n = (BLOCK - *filled).min(bytes.len());
                    block[*filled..*filled + n].copy_from_slice(&bytes[..n]);
                    *filled += n;
                    bytes = &bytes[n..];
                    if *filled == BLOCK {
                        let block = **block;
                        self.state = self.next_after_header(&block)?;
                    }
                }
                State::SparseExtension {
                    block,
                    filled,
                    data,
                } => {
                    let n = (BLOCK - *filled).min(bytes.len());
                    block[*filled..*filled + n].copy_from_slice(&bytes[..n]);
                    *filled += n;
                    bytes = &bytes[n..];
                    if *filled == BLOCK {
                        let data = *data;
                        let mut extension = tar::GnuExtSparseHeader::new();
                        extension.as_mut_bytes().copy_from_slice(&block[..]);
                        self.state = if extension.is_extended() {
                            State::SparseExtension {
                                block: Box::new([0; BLOCK]),
                                filled: 0,
                                data,
                            }
                        } else {
                            skip_then_header(padded(data))
                        };
                    }
                }
            }
        }
        Ok(())
    }

    fn next_after_header(&mut self, block: &[u8; BLOCK]) -> io::Result<State> {
        if block.iter().all(|&b| b == 0) || !checksum_ok(block) {
            return Ok(State::Done);
        }
        let header = tar::Header::from_byte_slice(block);
        let Ok(mut size) = header.entry_size() else {
            return Ok(State::Done);
        };
        let kind = header.entry_type();
        let recognised = header.as_gnu().is_some() || header.as_ustar().is_some();
        let extension = kind.is_gnu_longname()
            || kind.is_gnu_longlink()
            || kind.is_pax_local_extensions()
            || kind.is_pax_global_extensions();
        if !extension {
            if let Some(Some(pax)) = self.pending_pax {
                size = pax;
            }
        }
        let metadata =
            kind.is_gnu_longname() || kind.is_gnu_longlink() || kind.is_pax_local_extensions();
        if recognised && metadata {
            if size > MAX_METADATA_BYTES {
                return Err(io::Error::other(MetadataTooLarge));
            }
            return Ok(if kind.is_pax_local_extensions() && size > 0 {
                State::Pax {
                    records: Vec::with_capacity(size as usize),
                    left: size,
                    padding: padded(size) - size,
                }
            } else {
                if kind.is_pax_local_extensions() {
                    self.pending_pax = Some(None);
                }
                skip_then_header(padded(size))
            });
        }
        self.pending_pax = None;
        if size > u64::MAX - BLOCK as u64 {
            return Ok(State::Done);
        }
        // GNU sparse: extension blocks sit between the header and the data.
        if kind.is_gnu_sparse() && header.as_gnu().is_some_and(|gnu| gnu.is_extended()) {
            return Ok(State::SparseExtension {
                block: Box::new([0; BLOCK]),
                filled: 0,
                data: size,
            });
        }
        Ok(skip_then_header(padded(size)))
    }
}

impl<R: Read> Read for TarGuard<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.observe(&buf[..n])?;
        Ok(n)
    }
}

fn header_state() -> State {
    State::Header {
        block: Box::new([0; BLOCK]),
        filled: 0,
    }
}

fn skip_then_header(bytes: u64) -> State {
    if bytes == 0 {
        header_state()
    } else {
        State::Skip { left: bytes }
    }
}

fn padded(size: u64) -> u64 {
    size.div_ceil(BLOCK as u64) * BLOCK as u64
}

/// Same check as the `tar` crate: every byte summed, the checksum field counted as spaces.
fn checksum_ok(block: &[u8; BLOCK]) -> bool {
    let sum: u32 = block[..148]
        .iter()
        .chain(&block[156..])
        .map(|&b| u32::from(b))
        .sum::<u32>()
        + 8 * 32;
    tar::Header::from_byte_slice(block).cksum().ok() == Some(sum)
}

/// The `size` record of a PAX header, read as the `tar` crate reads it: the first `size`
/// record, and nothing when a record before it is malformed.
fn pax_size(records: &[u8]) -> Option<u64> {
    for record in tar::PaxExtensions::new(records) {
        let record = record.ok()?;
        if record.key() == Ok("size") {
            return record.value().ok()?.parse().ok();
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_through(bytes: &[u8]) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        TarGuard::new(bytes).read_to_end(&mut out)?;
        Ok(out)
    }

    fn header(path: &str, kind: tar::EntryType, size: u64) -> tar::Header {
        let mut header = tar::Header::new_gnu();
        header.set_path(path).unwrap();
        header.set_entry_type(kind);
        header.set_size(size);
        header.set_mode(0o644);
        header.set_cksum();
        header
    }

    #[test]
    fn ordinary_archives_pass_through_unchanged() {
        let mut builder = tar::Builder::new(Vec::new());
        let long = format!("{}/file", "d".repeat(300));
        let mut file = header("x", tar::EntryType::Regular, 5);
        builder
            .append_data(&mut file, &long, &b"hello"[..])
            .unwrap();
        let mut link = header("y", tar::EntryType::Symlink, 0);
        builder.append_link(&mut link, "y", &long).unwrap();
        builder
            .append_pax_extensions([("path", &b"pax/name"[..]), ("uid", &b"70000"[..])])
            .unwrap();
        builder
            .append(&header("ignored", tar::EntryType::Regular, 3), &b"abc"[..])
            .unwrap();
        let bytes = builder.into_inner().unwrap();
        let mut guard = TarGuard::new(&bytes[..]);
        let mut out = Vec::new();
        guard.read_to_end(&mut out).unwrap();
        assert_eq!(out, bytes);
        assert!(matches!(guard.state, State::Done), "reached the end marker");
    }

    #[test]
    fn oversized_long_names_and_pax_records_fail_at_their_header() {
        for kind in [
            tar::EntryType::GNULongName,
            tar::EntryType::GNULongLink,
            tar::EntryType::XHeader,
        ] {
            // The header claims a gigabyte that is not even there: the guard must not
            // wait for it.
            let bytes = header("././@LongLink", kind, 1 << 30).as_bytes().to_vec();
            let err = read_through(&bytes).unwrap_err();
            assert!(is_metadata_too_large(&err), "{kind:?}: {err}");
        }
        let small = header("././@LongLink", tar::EntryType::GNULongName, 100);
        assert!(read_through(small.as_bytes()).is_ok());
    }

    #[test]
    fn pax_size_decides_where_the_next_header_is() {
        // A PAX `size` of 1024 for an entry whose ustar size says 0: its data holds what
        // would look like an oversized long-name header if the framing ignored PAX.
        let mut builder = tar::Builder::new(Vec::new());
        builder
            .append_pax_extensions([("size", &b"1024"[..])])
            .unwrap();
        let raw = builder.get_mut();
        raw.extend_from_slice(header("file", tar::EntryType::Regular, 0).as_bytes());
        let decoy = header("decoy", tar::EntryType::GNULongName, 1 << 30);
        raw.extend_from_slice(decoy.as_bytes());
        raw.extend_from_slice(&[b'x'; 512]);
        let bytes = builder.into_inner().unwrap();
        let mut guard = TarGuard::new(&bytes[..]);
        let mut out = Vec::new();
        guard.read_to_end(&mut out).unwrap();
        assert_eq!(out, bytes);
        assert!(matches!(guard.state, State::Done), "reached the end marker");

        // And the tar crate frames it the same way.
        let mut archive = tar::Archive::new(&bytes[..]);
        let sizes: Vec<u64> = archive
            .entries()
            .unwrap()
            .map(|entry| entry.unwrap().size())
            .collect();
        assert_eq!(sizes, [1024]);
    }

    #[test]
    fn pax_size_reads_the_first_size_record() {
        assert_eq!(pax_size(b"12 size=100\n9 uid=0\n"), Some(100));
        assert_eq!(pax_size(b"9 uid=0\n"), None);
        assert_eq!(pax_size(b"garbage"), None);
    }
}
