//! E2B's file metadata inside the sandbox: `user.e2b.*` extended attributes
//! ([`crate::proto::METADATA_XATTR_PREFIX`]), set by `SetMetadata` and read back by
//! `ListWithMetadata`.
//!
//! The agent builds every attribute name itself, as the fixed prefix followed by a key that
//! [`proto::validate_metadata`] accepted, so a request can reach no namespace but `user.e2b.`
//! (`trusted.`, `security.` and `system.` included). Reading is bounded: names and values are
//! looked at only up to [`proto::MAX_METADATA_READ_ENTRY`] per entry and
//! [`proto::MAX_METADATA_READ_REPLY`] per reply, whatever a process in the sandbox stored.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::{bad_request, dir_entry, io_error, resolve, Answer};
use crate::proto::{self, AgentErrorCode, MetaEntry, Reply};

/// The longest attribute-name list read for one file (Linux's own limit is 64 KiB; a larger
/// list is not read at all).
const MAX_NAME_LIST: usize = 1 << 20;

fn c_path(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// The attribute names of `p` (`follow`: of what a symlink points to); an error when its
/// filesystem keeps none, or `E2BIG` when the list is over [`MAX_NAME_LIST`].
fn names(p: &CString, follow: bool) -> io::Result<Vec<Vec<u8>>> {
    let list = |buf: *mut libc::c_char, len: usize| {
        // SAFETY: `p` is a NUL-terminated path; `buf` is either null with `len` 0 (a size
        // query) or points to `len` writable bytes.
        unsafe {
            if follow {
                libc::listxattr(p.as_ptr(), buf, len)
            } else {
                libc::llistxattr(p.as_ptr(), buf, len)
            }
        }
    };
    // The list may grow between the size query and the read: try again a few times.
    for _ in 0..3 {
        let size = list(std::ptr::null_mut(), 0);
        if size < 0 {
            return Err(io::Error::last_os_error());
        }
        let size = size as usize;
        if size == 0 {
            return Ok(Vec::new());
        }
        if size > MAX_NAME_LIST {
            return Err(io::Error::from_raw_os_error(libc::E2BIG));
        }
        let mut buf = vec![0u8; size];
        let n = list(buf.as_mut_ptr().cast(), buf.len());
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ERANGE) {
                continue;
            }
            return Err(e);
        }
        buf.truncate(n as usize);
        return Ok(buf
            .split(|b| *b == 0)
            .filter(|n| !n.is_empty())
            .map(<[u8]>::to_vec)
            .collect());
    }
    Err(io::Error::from_raw_os_error(libc::ERANGE))
}

/// The value of attribute `name` of `p` if it is at most `max` bytes (`Ok(None)` when larger,
/// or gone meanwhile).
fn value(p: &CString, name: &CString, follow: bool, max: usize) -> io::Result<Option<Vec<u8>>> {
    let get = |buf: *mut libc::c_void, len: usize| {
        // SAFETY: `p` and `name` are NUL-terminated; `buf` is null with `len` 0 (a size query)
        // or points to `len` writable bytes.
        unsafe {
            if follow {
                libc::getxattr(p.as_ptr(), name.as_ptr(), buf, len)
            } else {
                libc::lgetxattr(p.as_ptr(), name.as_ptr(), buf, len)
            }
        }
    };
    let size = get(std::ptr::null_mut(), 0);
    if size < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENODATA) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    if size as usize > max {
        return Ok(None);
    }
    let mut buf = vec![0u8; size as usize];
    let n = get(buf.as_mut_ptr().cast(), buf.len());
    if n < 0 {
        let e = io::Error::last_os_error();
        // Removed, or grown past what was asked: not surfaced.
        return match e.raw_os_error() {
            Some(libc::ENODATA) | Some(libc::ERANGE) => Ok(None),
            _ => Err(e),
        };
    }
    buf.truncate(n as usize);
    Ok(Some(buf))
}

/// The user metadata of `p` (`follow`: of a symlink's target, as envd reads it), within
/// `budget` bytes (counted by [`proto::read_metadata_budget`]), in key order; attributes that
/// are not UTF-8 (set inside the sandbox by other means) or do not fit are left out. Empty
/// where the file has none, is gone, or its filesystem keeps no extended attributes.
pub(super) fn read(p: &Path, follow: bool, budget: usize) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Ok(cp) = c_path(p) else { return out };
    let Ok(mut all) = names(&cp, follow) else {
        return out;
    };
    all.sort();
    let mut left = budget;
    for raw in all {
        let Some(key) = raw.strip_prefix(proto::METADATA_XATTR_PREFIX.as_bytes()) else {
            continue;
        };
        let Ok(key) = std::str::from_utf8(key) else {
            continue;
        };
        let cost = proto::read_metadata_budget(key, "");
        if key.is_empty() || cost > left {
            continue;
        }
        let Ok(name) = CString::new(raw.clone()) else {
            continue;
        };
        let Ok(Some(v)) = value(&cp, &name, follow, left - cost) else {
            continue;
        };
        let Ok(v) = String::from_utf8(v) else {
            continue;
        };
        left -= cost + v.len();
        out.insert(key.to_string(), v);
    }
    out
}

/// Whether an error says the filesystem keeps no extended attributes (of this kind).
fn unsupported(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOTSUP))
}

/// `SetMetadata`: replaces the `user.e2b.*` set of `path` (not followed) with `metadata`, then
/// answers what the file holds. As envd: a filesystem without extended attributes is not an
/// error (the answer is then empty), running out of space is.
pub(super) fn set(path: &str, metadata: &BTreeMap<String, String>) -> Answer {
    proto::validate_metadata(metadata)
        .map_err(|e| bad_request(format!("invalid metadata: {e}")))?;
    let p = resolve(path)?;
    let cp = c_path(&p).map_err(|e| io_error(&p, e))?;
    let meta = fs::symlink_metadata(&p).map_err(|e| io_error(&p, e))?;
    if meta.file_type().is_symlink() {
        return Err(bad_request(format!(
            "{}: metadata is not kept on a symlink",
            p.display()
        )));
    }
    let result = (|| -> io::Result<()> {
        for raw in names(&cp, false)? {
            let Some(key) = raw.strip_prefix(proto::METADATA_XATTR_PREFIX.as_bytes()) else {
                continue;
            };
            if std::str::from_utf8(key).is_ok_and(|k| metadata.contains_key(k)) {
                continue;
            }
            let name = CString::new(raw.clone())
                .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
            // SAFETY: both are NUL-terminated strings that outlive the call.
            if unsafe { libc::lremovexattr(cp.as_ptr(), name.as_ptr()) } < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::ENODATA) {
                    return Err(e);
                }
            }
        }
        for (k, v) in metadata {
            // The name is always the fixed prefix and a validated key (printable ASCII, no
            // NUL): nothing outside `user.e2b.` can be named.
            let name = CString::new(format!("{}{k}", proto::METADATA_XATTR_PREFIX))
                .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
            // SAFETY: `cp` and `name` are NUL-terminated; `v` points to `v.len()` bytes.
            let rc = unsafe {
                libc::lsetxattr(cp.as_ptr(), name.as_ptr(), v.as_ptr().cast(), v.len(), 0)
            };
            if rc < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    })();
    match result {
        Ok(()) => {}
        Err(e) if unsupported(&e) => {}
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)) => {
            return Err(Reply::Error {
                code: AgentErrorCode::TooLarge,
                message: format!("{}: not enough space for file metadata", p.display()),
            })
        }
        Err(e) => return Err(io_error(&p, e)),
    }
    let metadata = read(&p, false, proto::MAX_METADATA_READ_ENTRY);
    Ok((Reply::Metadata { metadata }, Vec::new()))
}

/// `ListWithMetadata`: the entries of `path` (only `name` when given) with their metadata.
pub(super) fn list(path: &str, name: Option<&str>) -> Answer {
    list_within(path, name, proto::MAX_METADATA_READ_REPLY)
}

/// [`list`] with at most `budget` bytes of metadata in all (`too_large` past it).
fn list_within(path: &str, name: Option<&str>, budget: usize) -> Answer {
    let p = resolve(path)?;
    let mut found: Vec<(String, fs::Metadata)> = Vec::new();
    match name {
        Some(n) => {
            if n.is_empty() || n.contains('/') || n == "." || n == ".." || n.contains('\0') {
                return Err(Reply::Error {
                    code: AgentErrorCode::InvalidPath,
                    message: format!("invalid entry name {n:?}"),
                });
            }
            let dir = fs::metadata(&p).map_err(|e| io_error(&p, e))?;
            if !dir.is_dir() {
                return Err(io_error(&p, io::Error::from(io::ErrorKind::NotADirectory)));
            }
            match fs::symlink_metadata(p.join(n)) {
                Ok(m) => found.push((n.to_string(), m)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_error(&p.join(n), e)),
            }
        }
        None => {
            for entry in fs::read_dir(&p).map_err(|e| io_error(&p, e))? {
                let entry = entry.map_err(|e| io_error(&p, e))?;
                let Ok(meta) = entry.metadata() else { continue };
                found.push((entry.file_name().to_string_lossy().into_owned(), meta));
            }
        }
    }
    found.sort_by(|a, b| a.0.cmp(&b.0));
    let mut left = budget;
    let mut entries = Vec::with_capacity(found.len());
    for (n, meta) in found {
        let metadata = read(&p.join(&n), true, proto::MAX_METADATA_READ_ENTRY);
        let used: usize = metadata
            .iter()
            .map(|(k, v)| proto::read_metadata_budget(k, v))
            .sum();
        if used > left {
            return Err(Reply::Error {
                code: AgentErrorCode::TooLarge,
                message: format!(
                    "{}: the entries' metadata is over {budget} bytes in all",
                    p.display(),
                ),
            });
        }
        left -= used;
        entries.push(MetaEntry {
            entry: dir_entry(n, &meta),
            metadata,
        });
    }
    let body = serde_json::to_vec(&entries).map_err(|e| Reply::Error {
        code: AgentErrorCode::Io,
        message: format!("cannot encode the entries: {e}"),
    })?;
    let count = u32::try_from(entries.len()).unwrap_or(u32::MAX);
    Ok((Reply::MetaEntries { count }, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set_raw(p: &Path, name: &str, v: &[u8]) -> io::Result<()> {
        let cp = c_path(p)?;
        let name = CString::new(name).unwrap();
        // SAFETY: NUL-terminated strings and a live buffer of `v.len()` bytes.
        let rc =
            unsafe { libc::lsetxattr(cp.as_ptr(), name.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// A temp dir on a filesystem that keeps user attributes (tmpfs before Linux 6.6 does not;
    /// the build directory's usually does), or `None` to skip.
    fn xattr_dir() -> Option<tempfile::TempDir> {
        let base = std::env::var_os("CARGO_TARGET_TMPDIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")));
        let dir = tempfile::tempdir_in(base).ok()?;
        let probe = dir.path().join("probe");
        fs::write(&probe, b"").ok()?;
        match set_raw(&probe, "user.torpor-probe", b"1") {
            Ok(()) => Some(dir),
            Err(e) if unsupported(&e) => None,
            Err(e) => panic!("setting a user attribute: {e}"),
        }
    }

    /// The entries of a `MetaEntries` answer (its body).
    fn entries_of(answer: Answer) -> Vec<MetaEntry> {
        let (reply, body) = answer.unwrap();
        let entries: Vec<MetaEntry> = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            reply,
            Reply::MetaEntries {
                count: entries.len() as u32
            }
        );
        entries
    }

    #[test]
    fn metadata_is_replaced_whole_and_read_back_without_its_prefix() {
        let Some(dir) = xattr_dir() else {
            eprintln!("skipped: no user xattrs on this filesystem");
            return;
        };
        let f = dir.path().join("f");
        fs::write(&f, b"x").unwrap();
        let fp = f.to_str().unwrap();
        set_raw(&f, "user.foreign", b"kept").unwrap();
        let first: BTreeMap<String, String> = [
            ("author".into(), "mish".into()),
            ("purpose".into(), "upload".into()),
        ]
        .into();
        let (reply, _) = set(fp, &first).unwrap();
        assert_eq!(reply, Reply::Metadata { metadata: first });
        let second: BTreeMap<String, String> = [("author".into(), "alice".into())].into();
        let (reply, _) = set(fp, &second).unwrap();
        assert_eq!(
            reply,
            Reply::Metadata {
                metadata: second.clone()
            },
            "purpose dropped"
        );
        // Attributes outside `user.e2b.` are neither shown nor removed.
        assert_eq!(read(&f, true, proto::MAX_METADATA_READ_ENTRY), second);
        let cp = c_path(&f).unwrap();
        let all = names(&cp, false).unwrap();
        assert!(all.contains(&b"user.foreign".to_vec()), "{all:?}");
        // Renamed: the attributes go with the inode.
        let g = dir.path().join("g");
        fs::rename(&f, &g).unwrap();
        let entries = entries_of(list(dir.path().to_str().unwrap(), Some("g")));
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].metadata, second);
        // Empty clears.
        set(g.to_str().unwrap(), &BTreeMap::new()).unwrap();
        assert!(read(&g, true, proto::MAX_METADATA_READ_ENTRY).is_empty());
    }

    #[test]
    fn reading_skips_what_is_not_utf8_and_stays_within_its_budget() {
        let Some(dir) = xattr_dir() else {
            eprintln!("skipped: no user xattrs on this filesystem");
            return;
        };
        let f = dir.path().join("f");
        fs::write(&f, b"x").unwrap();
        set_raw(&f, "user.e2b.bad", &[0xff, 0xfe]).unwrap();
        set_raw(&f, "user.e2b.a", b"1").unwrap();
        set_raw(&f, "user.e2b.big", &[b'v'; 3000]).unwrap();
        let all = read(&f, true, proto::MAX_METADATA_READ_ENTRY);
        assert_eq!(all.keys().collect::<Vec<_>>(), ["a", "big"]);
        // A budget that fits only the first (in name order) leaves the rest out.
        let small = read(&f, true, 100);
        assert_eq!(small.keys().collect::<Vec<_>>(), ["a"]);
        // A missing entry by name: none, not an error.
        assert!(entries_of(list(dir.path().to_str().unwrap(), Some("nope"))).is_empty());
        assert!(list(dir.path().to_str().unwrap(), Some("../etc")).is_err());
        // A whole listing within its budget answers; past it, too_large.
        let g = dir.path().join("g");
        fs::write(&g, b"y").unwrap();
        set_raw(&g, "user.e2b.c", &[b'w'; 2000]).unwrap();
        let d = dir.path().to_str().unwrap();
        let entries = entries_of(list(d, None));
        let names: Vec<&str> = entries.iter().map(|e| e.entry.name.as_str()).collect();
        assert_eq!(names, ["f", "g", "probe"]);
        assert_eq!(entries[1].metadata["c"].len(), 2000);
        assert!(matches!(
            list_within(d, None, 4000),
            Err(Reply::Error {
                code: AgentErrorCode::TooLarge,
                ..
            })
        ));
    }

    #[test]
    fn invalid_sets_are_refused_before_touching_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        fs::write(&f, b"x").unwrap();
        let fp = f.to_str().unwrap();
        for bad in [
            BTreeMap::from([(String::new(), "v".to_string())]),
            BTreeMap::from([("k".to_string(), "caf\u{e9}".to_string())]),
            BTreeMap::from([("k\n".to_string(), "v".to_string())]),
            BTreeMap::from([("k".repeat(300), "v".to_string())]),
            BTreeMap::from([("k".to_string(), "v".repeat(5000))]),
        ] {
            let e = set(fp, &bad).unwrap_err();
            assert!(
                matches!(
                    e,
                    Reply::Error {
                        code: AgentErrorCode::BadRequest,
                        ..
                    }
                ),
                "{e:?}"
            );
        }
    }
}
