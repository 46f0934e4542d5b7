//! Writing files so that a power loss cannot leave a name pointing at incomplete data.
//!
//! The rule every function here follows: data is fsynced before the name that publishes it
//! appears (a rename), and the directory holding that name is fsynced before the function
//! returns. A new directory is fsynced into its parent the same way. After a crash a reader
//! therefore sees either the old state or the complete new one, and once a function has
//! returned its result survives the crash.
//!
//! What the kernel and disk do with an fsync is outside this module: a drive that
//! acknowledges a flush it has not done (a volatile write cache without power-loss
//! protection) breaks the guarantee, as it breaks every database's.
//!
//! Everything goes through the crate-private [`Fs`] trait so that tests can record the order
//! of operations and replay any prefix of them under a crash model (`crash_model` tests).
//! Files are created 0600 and directories 0700: what this crate stores is sandbox memory.
//!
//! For a directory written by another program (a runsc checkpoint image), publish it with
//! [`fsync_tree`] on the temporary directory, then [`rename_durably`] into place.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Mode of every file this crate creates.
pub const FILE_MODE: u32 = 0o600;
/// Mode of every directory this crate creates.
pub const DIR_MODE: u32 = 0o700;

/// A failed durable write: which step, on which path.
#[derive(Debug, thiserror::Error)]
#[error("cannot {what} {path}")]
pub struct DurableError {
    pub what: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

impl DurableError {
    fn new<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> DurableError + 'a {
        move |source| DurableError {
            what,
            path: path.to_path_buf(),
            source,
        }
    }

    /// ENOSPC or EDQUOT: the disk (or the quota) is full.
    pub fn is_no_space(&self) -> bool {
        matches!(self.source.raw_os_error(), Some(28) | Some(122))
    }
}

/// The file-system operations a durable write is made of. The real implementation is
/// [`RealFs`]; tests record the sequence.
pub(crate) trait Fs: Send + Sync + std::fmt::Debug {
    /// Creates a directory (mode 0700); an existing one is not an error.
    fn create_dir(&self, path: &Path) -> io::Result<()>;
    /// Creates a new file (mode 0600, must not exist) holding `data`; with `sync`, fsyncs it
    /// through the same descriptor before closing.
    fn write_new(&self, path: &Path, data: &[u8], sync: bool) -> io::Result<()>;
    /// fsyncs an existing regular file.
    fn sync_file(&self, path: &Path) -> io::Result<()>;
    /// fsyncs a directory, making the names in it durable.
    fn sync_dir(&self, path: &Path) -> io::Result<()>;
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    fn remove_file(&self, path: &Path) -> io::Result<()>;
}

/// The file system itself.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct RealFs;

impl Fs for RealFs {
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        match DirBuilder::new().mode(DIR_MODE).create(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && path.is_dir() => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn write_new(&self, path: &Path, data: &[u8], sync: bool) -> io::Result<()> {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(FILE_MODE)
            .open(path)?;
        file.write_all(data)?;
        if sync {
            file.sync_all()?;
        }
        Ok(())
    }

    fn sync_file(&self, path: &Path) -> io::Result<()> {
        File::open(path)?.sync_all()
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        File::open(path)?.sync_all()
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
}

/// The directory holding `path` (`.` for a bare name).
fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Writes `data` to `path` so that after a crash `path` holds either its previous content
/// (or nothing) or all of `data`: a temporary file in the same directory (0600) is written
/// and fsynced, renamed over `path`, and the directory fsynced, all before this returns.
pub fn write_file_durably(path: &Path, data: &[u8]) -> Result<(), DurableError> {
    write_file_durably_with(&RealFs, path, data)
}

pub(crate) fn write_file_durably_with(
    fs: &dyn Fs,
    path: &Path,
    data: &[u8],
) -> Result<(), DurableError> {
    let dir = parent_of(path);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", crate::id::unique_hex(8)));
    publish_with(fs, &tmp, path, data)
}

/// Writes `data` to `tmp` (fsynced), renames it to `dest` and fsyncs `dest`'s directory.
/// `tmp` must be on the same file system as `dest`; it is removed on failure.
pub(crate) fn publish_with(
    fs: &dyn Fs,
    tmp: &Path,
    dest: &Path,
    data: &[u8],
) -> Result<(), DurableError> {
    if let Err(e) = fs.write_new(tmp, data, true) {
        let _ = fs.remove_file(tmp);
        return Err(DurableError::new("write", tmp)(e));
    }
    if let Err(e) = fs.rename(tmp, dest) {
        let _ = fs.remove_file(tmp);
        return Err(DurableError::new("rename into", dest)(e));
    }
    let dir = parent_of(dest);
    fs.sync_dir(dir).map_err(DurableError::new("fsync", dir))
}

/// fsyncs one regular file.
pub fn fsync_file(path: &Path) -> Result<(), DurableError> {
    RealFs
        .sync_file(path)
        .map_err(DurableError::new("fsync", path))
}

/// fsyncs a directory, making the names in it (new files, renames, removals) durable.
pub fn fsync_dir(path: &Path) -> Result<(), DurableError> {
    RealFs
        .sync_dir(path)
        .map_err(DurableError::new("fsync", path))
}

/// fsyncs every regular file under `root`, then every directory deepest first, `root`
/// last. Symbolic links are not followed (their targets live in their directory's entry);
/// other file types (fifos, sockets) are skipped. Use it on a directory another program
/// wrote (a checkpoint image) before [`rename_durably`] publishes it.
pub fn fsync_tree(root: &Path) -> Result<(), DurableError> {
    fsync_tree_with(&RealFs, root)
}

pub(crate) fn fsync_tree_with(fs: &dyn Fs, root: &Path) -> Result<(), DurableError> {
    let mut dirs = vec![root.to_path_buf()];
    let mut next = 0;
    while next < dirs.len() {
        let dir = dirs[next].clone();
        next += 1;
        let listing = std::fs::read_dir(&dir).map_err(DurableError::new("list", &dir))?;
        for entry in listing {
            let entry = entry.map_err(DurableError::new("list", &dir))?;
            let path = entry.path();
            let kind = entry
                .file_type()
                .map_err(DurableError::new("inspect", &path))?;
            if kind.is_dir() {
                dirs.push(path);
            } else if kind.is_file() {
                fs.sync_file(&path)
                    .map_err(DurableError::new("fsync", &path))?;
            }
        }
    }
    // Breadth-first order reversed: every directory after all of its subdirectories.
    for dir in dirs.iter().rev() {
        fs.sync_dir(dir).map_err(DurableError::new("fsync", dir))?;
    }
    Ok(())
}

/// Renames `from` to `to` (a file or a directory) and fsyncs the directory of `to`, and the
/// directory of `from` when it is another one, before returning. What `from` holds must
/// already be durable ([`fsync_tree`], [`fsync_file`]).
pub fn rename_durably(from: &Path, to: &Path) -> Result<(), DurableError> {
    rename_durably_with(&RealFs, from, to)
}

pub(crate) fn rename_durably_with(fs: &dyn Fs, from: &Path, to: &Path) -> Result<(), DurableError> {
    fs.rename(from, to)
        .map_err(DurableError::new("rename into", to))?;
    let to_dir = parent_of(to);
    fs.sync_dir(to_dir)
        .map_err(DurableError::new("fsync", to_dir))?;
    let from_dir = parent_of(from);
    if from_dir != to_dir {
        fs.sync_dir(from_dir)
            .map_err(DurableError::new("fsync", from_dir))?;
    }
    Ok(())
}

/// Creates `path` and any missing parents (each 0700), fsyncing the parent of every
/// directory it creates, so the new directories survive a crash once this returns.
/// Directories that already exist keep their mode.
pub fn create_dir_all_durably(path: &Path) -> Result<(), DurableError> {
    create_dir_all_durably_with(&RealFs, path)
}

pub(crate) fn create_dir_all_durably_with(fs: &dyn Fs, path: &Path) -> Result<(), DurableError> {
    let mut missing = Vec::new();
    let mut current = path;
    loop {
        match std::fs::symlink_metadata(current) {
            Ok(meta) if meta.is_dir() => break,
            Ok(_) => {
                return Err(DurableError {
                    what: "create directory",
                    path: current.to_path_buf(),
                    source: io::Error::from(io::ErrorKind::AlreadyExists),
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                missing.push(current.to_path_buf());
                match current.parent() {
                    Some(p) if !p.as_os_str().is_empty() => current = p,
                    _ => break,
                }
            }
            Err(e) => return Err(DurableError::new("inspect", current)(e)),
        }
    }
    for dir in missing.iter().rev() {
        fs.create_dir(dir)
            .map_err(DurableError::new("create directory", dir))?;
        let parent = parent_of(dir);
        fs.sync_dir(parent)
            .map_err(DurableError::new("fsync", parent))?;
    }
    Ok(())
}

/// Takes group and other permissions off an existing directory (a store created before
/// stores were private).
pub(crate) fn restrict_dir(path: &Path) -> io::Result<()> {
    let meta = std::fs::metadata(path)?;
    if meta.permissions().mode() & 0o077 != 0 {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(DIR_MODE))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn durable_files_are_private_and_replace_atomically() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("a/b/record");
        create_dir_all_durably(path.parent().unwrap()).unwrap();
        write_file_durably(&path, b"one").unwrap();
        write_file_durably(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, FILE_MODE);
        for dir in [t.path().join("a"), t.path().join("a/b")] {
            assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, DIR_MODE);
        }
        // Only the record is left: no temporary file.
        let names: Vec<_> = std::fs::read_dir(t.path().join("a/b"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("record")]);
    }

    #[test]
    fn fsync_tree_and_rename_publish_a_directory() {
        let t = tempfile::tempdir().unwrap();
        let tmp = t.path().join(".image.tmp");
        std::fs::create_dir_all(tmp.join("sub/deeper")).unwrap();
        std::fs::write(tmp.join("checkpoint.img"), b"memory").unwrap();
        std::fs::write(tmp.join("sub/deeper/pages"), b"pages").unwrap();
        std::os::unix::fs::symlink("/nonexistent", tmp.join("dangling")).unwrap();
        fsync_tree(&tmp).unwrap();
        let dest = t.path().join("image");
        rename_durably(&tmp, &dest).unwrap();
        assert_eq!(
            std::fs::read(dest.join("sub/deeper/pages")).unwrap(),
            b"pages"
        );
        let err = fsync_tree(&t.path().join("missing")).unwrap_err();
        assert_eq!(err.what, "list");
    }

    #[test]
    fn a_file_in_the_way_of_a_directory_is_an_error() {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("f"), b"").unwrap();
        let err = create_dir_all_durably(&t.path().join("f/g")).unwrap_err();
        assert_eq!(err.path, t.path().join("f/g"));
        let err = create_dir_all_durably(&t.path().join("f")).unwrap_err();
        assert_eq!(err.what, "create directory");
    }
}
