//! The audit directory's files: names, listing, the signing key, the signed head, appends.

use super::*;

pub(super) fn file_name(n: u32) -> String {
    format!("audit-{n:06}.jsonl")
}

/// The log's files, by number.
pub(super) fn list_files(dir: &Path) -> Result<Vec<(u32, PathBuf)>, AuditError> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err("read", dir))? {
        let entry = entry.map_err(io_err("read", dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(n) = name
            .strip_prefix("audit-")
            .and_then(|r| r.strip_suffix(".jsonl"))
            .filter(|d| d.len() >= 6 && d.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|d| d.parse::<u32>().ok())
        else {
            continue;
        };
        files.push((n, entry.path()));
    }
    files.sort();
    Ok(files)
}

/// Complete lines of `bytes` as (start, end) without the newline, and where the torn rest
/// (bytes after the last newline) starts.
pub(super) fn split_lines(bytes: &[u8]) -> (Vec<(usize, usize)>, usize) {
    let mut lines = Vec::new();
    let mut start = 0;
    for (i, b) in bytes.iter().enumerate() {
        if *b == b'\n' {
            lines.push((start, i));
            start = i + 1;
        }
    }
    (lines, start)
}

pub(super) fn read_key(dir: &Path) -> Result<[u8; 32], AuditError> {
    let path = dir.join(KEY_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            AuditError::KeyMissing(path.clone())
        } else {
            io_err("read", &path)(e)
        }
    })?;
    let text = text.trim();
    let mut key = [0u8; 32];
    if text.len() != 64 {
        return Err(AuditError::BadKey(path));
    }
    for (i, k) in key.iter_mut().enumerate() {
        *k = u8::from_str_radix(&text[2 * i..2 * i + 2], 16)
            .map_err(|_| AuditError::BadKey(path.clone()))?;
    }
    Ok(key)
}

pub(super) fn create_key(dir: &Path) -> Result<[u8; 32], AuditError> {
    let path = dir.join(KEY_FILE);
    let mut key = [0u8; 32];
    {
        use std::io::Read;
        File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut key))
            .map_err(io_err("read", Path::new("/dev/urandom")))?;
    }
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(io_err("create", &path))?;
    f.write_all(hex.as_bytes())
        .and_then(|_| f.sync_all())
        .map_err(io_err("write", &path))?;
    sync_dir(dir);
    Ok(key)
}

pub(super) fn read_head(dir: &Path, key: &[u8; 32]) -> Option<Head> {
    let text = std::fs::read(dir.join(HEAD_FILE)).ok()?;
    let head: Head = serde_json::from_slice(&text).ok()?;
    (head.v == FORMAT_VERSION && head.sig == head_sig(key, head.seq, &head.hash)).then_some(head)
}

pub(super) fn sync_dir(dir: &Path) {
    if let Err(e) = File::open(dir).and_then(|d| d.sync_all()) {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot sync the audit directory");
    }
}

pub(super) fn open_append(path: &Path, create_new: bool) -> Result<File, AuditError> {
    let f = OpenOptions::new()
        .append(true)
        .create(true)
        .create_new(create_new)
        .mode(0o600)
        .open(path)
        .map_err(io_err("open", path))?;
    // Files made before this version (or by hand) may be wider.
    f.set_permissions(std::fs::Permissions::from_mode(0o600))
        .map_err(io_err("chmod", path))?;
    Ok(f)
}
