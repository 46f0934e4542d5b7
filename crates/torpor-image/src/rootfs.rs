//! Writing layer entries into the destination root filesystem without ever leaving it.
//!
//! Every path is walked one component at a time from a directory descriptor of the root with
//! `openat(O_NOFOLLOW | O_DIRECTORY)`: a component that is a symbolic link stops the walk with
//! [`ImageError::PathEscape`] instead of being followed, `..` is refused before any walk, and
//! the final component is always created afresh (`O_CREAT | O_EXCL | O_NOFOLLOW`, `mkdirat`,
//! `symlinkat`, `linkat` without `AT_SYMLINK_FOLLOW`) after whatever was there is removed.
//! So no entry can write outside the root, through a link planted by an earlier entry, or
//! into another file's inode.
//!
//! The image's files may be readable by anyone inside the root filesystem (they are the
//! image's), but nothing in it may give a host user more power: set-user-id and
//! set-group-id bits are stripped from every entry, and device nodes are never created
//! (the sandbox gets its own `/dev`). Tar has no socket entries; a fifo is only ever made
//! with `S_IFIFO`, whatever its header's mode says. Skipped and stripped entries are
//! logged (the first [`LOGGED_PER_KIND`] of each kind one by one, then a count).
//!
//! Paths are at most [`MAX_PATH_BYTES`] long, and every directory an entry creates
//! implicitly counts as an entry, so the bookkeeping kept per path stays bounded by
//! [`Limits::max_entries`].
//!
//! Directories are created owner-writable while layers are applied and get their real modes
//! and times at the end ([`Rootfs::finish`]), deepest first, so that a read-only directory in
//! a lower layer does not stop an unprivileged unpack.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{self as fs, AtFlags, Dir, FileType, Mode, OFlags, Timespec, Timestamps};
use rustix::io::Errno;
use tar::{Entry, EntryType};

use crate::digest::is_limit_exceeded;
use crate::store::normal_components;
use crate::{EscapeReason, ImageError, Limits};

const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";
const WHITEOUT_PREFIX: &[u8] = b".wh.";
const GNU_VOLUME_LABEL: u8 = b'V';
const PAX_UID: &str = "uid";
const PAX_GID: &str = "gid";

/// Mode a directory has while layers are still being applied.
const WORKING_DIR_MODE: u32 = 0o700;
/// Mode of a directory no entry describes, created only as a parent.
const IMPLICIT_DIR_MODE: u32 = 0o755;
/// Set-user-id and set-group-id: never kept from an image.
const SET_ID_BITS: u32 = 0o6000;
/// Longest entry path or link target (Linux's `PATH_MAX`): nothing longer can be opened
/// by path inside the sandbox anyway, and it bounds what is kept per path.
pub(crate) const MAX_PATH_BYTES: usize = 4096;
/// How many skipped or stripped entries of one kind are logged by name.
pub(crate) const LOGGED_PER_KIND: u64 = 16;

#[derive(Debug, Clone, Copy)]
struct DirMeta {
    mode: u32,
    /// `None` for a directory created only as a parent: its time is left as it is.
    mtime: Option<i64>,
}

/// The destination of an unpack, open for writing.
pub(crate) struct Rootfs {
    root: OwnedFd,
    root_path: PathBuf,
    /// Whether ownership from the layers can be applied (the process is root).
    privileged: bool,
    /// Final mode and mtime of every directory, by path relative to the root (`a/b`).
    dirs: BTreeMap<Vec<u8>, DirMeta>,
    /// Paths the current layer created: they and their parents are what an opaque marker
    /// keeps.
    layer_paths: BTreeSet<Vec<u8>>,
    /// Entries whose set-id bits were stripped.
    set_id_stripped: u64,
    /// Device nodes left out.
    devices_skipped: u64,
    file_bytes: u64,
    max_file_bytes: u64,
    entries: u64,
    max_entries: u64,
}

/// Where a walk to a parent directory ended.
enum Walk {
    Found(OwnedFd),
    Missing,
}

/// The layer and entry an operation is about, for errors.
struct EntryContext<'a> {
    layer: &'a Path,
    entry: &'a Path,
}

impl Rootfs {
    /// Opens `dest`, creating it when missing; it must be empty. Returns whether it was
    /// created, so that a failed unpack knows what to clean up.
    pub(crate) fn create(dest: &Path, limits: &Limits) -> Result<(Rootfs, bool), ImageError> {
        let write_error = |source| ImageError::Write {
            path: dest.to_owned(),
            source,
        };
        let created = match std::fs::create_dir(dest) {
            Ok(()) => true,
            Err(err) if err.kind() == io::ErrorKind::AlreadyExists => false,
            Err(err) => return Err(write_error(err)),
        };
        if !created {
            let mut listing =
                std::fs::read_dir(dest).map_err(|_| ImageError::DestinationNotEmpty {
                    path: dest.to_owned(),
                })?;
            if listing.next().is_some() {
                return Err(ImageError::DestinationNotEmpty {
                    path: dest.to_owned(),
                });
            }
        }
        let root = fs::open(
            dest,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|errno| write_error(errno.into()))?;
        let rootfs = Rootfs {
            root,
            root_path: dest.to_owned(),
            privileged: rustix::process::geteuid().is_root(),
            dirs: BTreeMap::new(),
            layer_paths: BTreeSet::new(),
            set_id_stripped: 0,
            devices_skipped: 0,
            file_bytes: 0,
            max_file_bytes: limits.max_unpacked_bytes,
            entries: 0,
            max_entries: limits.max_entries,
        };
        Ok((rootfs, created))
    }

    /// Starts a new layer: opaque markers from now on keep only what this layer writes.
    pub(crate) fn begin_layer(&mut self) {
        self.layer_paths.clear();
    }

    /// Applies one entry of the layer at `layer` (named in errors).
    pub(crate) fn apply_entry<R: Read>(
        &mut self,
        entry: &mut Entry<'_, R>,
        layer: &Path,
    ) -> Result<(), ImageError> {
        self.entries += 1;
        if self.entries > self.max_entries {
            return Err(ImageError::TooManyEntries {
                path: layer.to_owned(),
                limit: self.max_entries,
            });
        }
        let raw_path = entry.path_bytes().into_owned();
        if raw_path.len() > MAX_PATH_BYTES {
            return Err(ImageError::TooLarge {
                path: layer.to_owned(),
                what: "one entry's path",
                limit: MAX_PATH_BYTES as u64,
            });
        }
        if let Some(target) = entry.link_name_bytes() {
            if target.len() > MAX_PATH_BYTES {
                return Err(ImageError::TooLarge {
                    path: layer.to_owned(),
                    what: "one link's target",
                    limit: MAX_PATH_BYTES as u64,
                });
            }
        }
        let entry_path = PathBuf::from(OsStr::from_bytes(&raw_path));
        let context = EntryContext {
            layer,
            entry: &entry_path,
        };
        let components = normal_components(&raw_path).ok_or_else(|| ImageError::PathEscape {
            layer: layer.to_owned(),
            entry: entry_path.clone(),
            reason: EscapeReason::ParentComponent,
        })?;
        let Some((name, parents)) = components.split_last() else {
            // The root itself (`./`): its metadata belongs to the caller, not the image.
            return Ok(());
        };
        let entry_type = entry.header().entry_type();
        // Metadata-only records that the tar crate does not fold into the next entry.
        if matches!(
            entry_type,
            EntryType::XGlobalHeader
                | EntryType::XHeader
                | EntryType::GNULongName
                | EntryType::GNULongLink
        ) || entry_type.as_byte() == GNU_VOLUME_LABEL
        {
            return Ok(());
        }
        // Device nodes are left out: the sandbox gets its own /dev, and a device node from
        // an untrusted image would sit on the host's disk, openable by any host process
        // that wanders into the root filesystem.
        if matches!(entry_type, EntryType::Char | EntryType::Block) {
            self.devices_skipped += 1;
            if self.devices_skipped <= LOGGED_PER_KIND {
                tracing::info!(entry = %entry_path.display(), kind = ?entry_type,
                    "image import: device node left out");
            }
            return Ok(());
        }

        if *name == OPAQUE_MARKER {
            if let Walk::Found(dir) = self.walk(parents, None, &context)? {
                self.clear_opaque(&dir, &parents.join(&b'/'))?;
            }
            return Ok(());
        }
        if let Some(hidden) = name.strip_prefix(WHITEOUT_PREFIX) {
            if hidden.is_empty() || hidden == b"." || hidden == b".." {
                return Err(ImageError::corrupt(
                    layer,
                    format!("whiteout {} names nothing", entry_path.display()),
                ));
            }
            if let Walk::Found(dir) = self.walk(parents, None, &context)? {
                let mut hidden_path = parents.join(&b'/');
                if !hidden_path.is_empty() {
                    hidden_path.push(b'/');
                }
                hidden_path.extend_from_slice(hidden);
                self.remove_all_at(&dir, hidden, &hidden_path)?;
            }
            return Ok(());
        }

        let relative = components.join(&b'/');
        self.layer_paths.insert(relative.clone());
        let mut created = Vec::new();
        let walked = self.walk(parents, Some(&mut created), &context)?;
        // Directories made only as parents cost what an entry costs.
        self.entries += created.len() as u64;
        if self.entries > self.max_entries {
            return Err(ImageError::TooManyEntries {
                path: layer.to_owned(),
                limit: self.max_entries,
            });
        }
        for implicit in created {
            self.dirs.insert(
                implicit,
                DirMeta {
                    mode: IMPLICIT_DIR_MODE,
                    mtime: None,
                },
            );
        }
        let Walk::Found(parent) = walked else {
            return Err(ImageError::corrupt(
                layer,
                format!("cannot make the parents of {}", entry_path.display()),
            ));
        };
        let header = entry.header();
        let mode = header
            .mode()
            .map_err(|err| self.bad_header(&context, "mode", err))?
            & 0o7777;
        let mode = if mode & SET_ID_BITS != 0 {
            self.set_id_stripped += 1;
            if self.set_id_stripped <= LOGGED_PER_KIND {
                tracing::info!(entry = %entry_path.display(), mode = format!("{mode:o}"),
                    "image import: set-user-id/set-group-id bits stripped");
            }
            mode & !SET_ID_BITS
        } else {
            mode
        };
        let mtime = header
            .mtime()
            .map_err(|err| self.bad_header(&context, "mtime", err))?;
        let mtime = i64::try_from(mtime).unwrap_or(i64::MAX);
        let owner = if self.privileged {
            Some(owner(entry, &context)?)
        } else {
            None
        };

        match entry_type {
            EntryType::Directory => {
                self.make_dir(&parent, name, &relative, owner)?;
                self.dirs.insert(
                    relative,
                    DirMeta {
                        mode,
                        mtime: Some(mtime),
                    },
                );
            }
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                self.remove_existing(&parent, name, &relative)?;
                let file = self.write_file(&parent, name, &relative, entry, &context)?;
                self.finish_node(&file, &relative, owner, mode, mtime)?;
            }
            EntryType::Symlink => {
                // An empty target (a GNU long-link header with no body names none) is no link.
                let target = entry
                    .link_name_bytes()
                    .filter(|t| !t.is_empty())
                    .ok_or_else(|| {
                        ImageError::corrupt(
                            layer,
                            format!("symbolic link {} has no target", entry_path.display()),
                        )
                    })?;
                self.remove_existing(&parent, name, &relative)?;
                fs::symlinkat(OsStr::from_bytes(&target), &parent, OsStr::from_bytes(name))
                    .map_err(|errno| self.write_error(&relative, errno))?;
                self.finish_link(&parent, name, &relative, owner, mtime)?;
            }
            EntryType::Link => {
                let target = entry
                    .link_name_bytes()
                    .filter(|t| !t.is_empty())
                    .ok_or_else(|| {
                        ImageError::corrupt(
                            layer,
                            format!("hard link {} has no target", entry_path.display()),
                        )
                    })?;
                self.hard_link(&parent, name, &relative, &target, &context)?;
            }
            EntryType::Fifo => {
                self.remove_existing(&parent, name, &relative)?;
                fs::mknodat(
                    &parent,
                    OsStr::from_bytes(name),
                    FileType::Fifo,
                    Mode::from_raw_mode(mode),
                    0,
                )
                .map_err(|errno| self.write_error(&relative, errno))?;
                self.finish_link(&parent, name, &relative, owner, mtime)?;
            }
            other => {
                return Err(ImageError::corrupt(
                    layer,
                    format!(
                        "entry {} has unsupported type {:?}",
                        entry_path.display(),
                        other
                    ),
                ))
            }
        }
        Ok(())
    }

    /// Gives every directory its final mode and modification time, deepest first.
    pub(crate) fn finish(self) -> Result<(), ImageError> {
        if self.set_id_stripped > 0 || self.devices_skipped > 0 {
            tracing::info!(
                set_id_stripped = self.set_id_stripped,
                devices_skipped = self.devices_skipped,
                "image import: entries made harmless"
            );
        }
        let context = EntryContext {
            layer: &self.root_path,
            entry: &self.root_path,
        };
        for (relative, meta) in self.dirs.iter().rev() {
            let components: Vec<&[u8]> = relative.split(|&b| b == b'/').collect();
            let Some((name, parents)) = components.split_last() else {
                continue;
            };
            let Walk::Found(parent) = self.walk(parents, None, &context)? else {
                continue;
            };
            let dir = match open_dir(&parent, name) {
                Ok(dir) => dir,
                Err(Errno::NOENT | Errno::LOOP | Errno::NOTDIR) => continue,
                Err(errno) => return Err(self.write_error(relative, errno)),
            };
            fs::fchmod(&dir, Mode::from_raw_mode(meta.mode))
                .and_then(|()| {
                    meta.mtime
                        .map_or(Ok(()), |mtime| fs::futimens(&dir, &times(mtime)))
                })
                .map_err(|errno| self.write_error(relative, errno))?;
        }
        Ok(())
    }

    /// Opens the directory `parents` names without following any symbolic link. With
    /// `created`, missing components are made and their paths pushed onto it; without, a
    /// missing component ends the walk.
    fn walk(
        &self,
        parents: &[&[u8]],
        mut created: Option<&mut Vec<Vec<u8>>>,
        context: &EntryContext<'_>,
    ) -> Result<Walk, ImageError> {
        let mut current =
            open_dir(&self.root, b".").map_err(|errno| self.write_error(b"", errno))?;
        for (depth, component) in parents.iter().enumerate() {
            let so_far = parents[..=depth].join(&b'/');
            current = match open_dir(&current, component) {
                Ok(dir) => dir,
                Err(Errno::NOENT) if created.is_some() => {
                    match fs::mkdirat(
                        &current,
                        OsStr::from_bytes(component),
                        Mode::from_raw_mode(WORKING_DIR_MODE),
                    ) {
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(errno) => return Err(self.write_error(&so_far, errno)),
                    }
                    if let Some(created) = created.as_deref_mut() {
                        created.push(so_far.clone());
                    }
                    open_dir(&current, component)
                        .map_err(|errno| self.write_error(&so_far, errno))?
                }
                Err(Errno::NOENT) => return Ok(Walk::Missing),
                Err(Errno::LOOP | Errno::NOTDIR) => {
                    let stat = fs::statat(
                        &current,
                        OsStr::from_bytes(component),
                        AtFlags::SYMLINK_NOFOLLOW,
                    )
                    .map_err(|errno| self.write_error(&so_far, errno))?;
                    if FileType::from_raw_mode(stat.st_mode) == FileType::Symlink {
                        return Err(ImageError::PathEscape {
                            layer: context.layer.to_owned(),
                            entry: context.entry.to_owned(),
                            reason: EscapeReason::ThroughSymlink {
                                component: PathBuf::from(OsStr::from_bytes(&so_far)),
                            },
                        });
                    }
                    return Err(ImageError::corrupt(
                        context.layer,
                        format!(
                            "entry {} needs {} to be a directory",
                            context.entry.display(),
                            String::from_utf8_lossy(&so_far)
                        ),
                    ));
                }
                Err(errno) => return Err(self.write_error(&so_far, errno)),
            };
        }
        Ok(Walk::Found(current))
    }

    fn make_dir(
        &mut self,
        parent: &OwnedFd,
        name: &[u8],
        relative: &[u8],
        owner: Option<(u32, u32)>,
    ) -> Result<(), ImageError> {
        match fs::statat(parent, OsStr::from_bytes(name), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) if FileType::from_raw_mode(stat.st_mode) == FileType::Directory => {}
            Ok(_) => {
                self.remove_all_at(parent, name, relative)?;
                self.mkdir(parent, name, relative)?;
            }
            Err(Errno::NOENT) => self.mkdir(parent, name, relative)?,
            Err(errno) => return Err(self.write_error(relative, errno)),
        }
        if let Some((uid, gid)) = owner {
            chown_at(parent, name, uid, gid).map_err(|errno| self.write_error(relative, errno))?;
        }
        Ok(())
    }

    fn mkdir(&self, parent: &OwnedFd, name: &[u8], relative: &[u8]) -> Result<(), ImageError> {
        fs::mkdirat(
            parent,
            OsStr::from_bytes(name),
            Mode::from_raw_mode(WORKING_DIR_MODE),
        )
        .map_err(|errno| self.write_error(relative, errno))
    }

    fn write_file<R: Read>(
        &mut self,
        parent: &OwnedFd,
        name: &[u8],
        relative: &[u8],
        entry: &mut Entry<'_, R>,
        context: &EntryContext<'_>,
    ) -> Result<File, ImageError> {
        let fd = fs::openat(
            parent,
            OsStr::from_bytes(name),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|errno| self.write_error(relative, errno))?;
        let mut file = File::from(fd);
        let expected = entry.size();
        let mut written = 0u64;
        let mut buffer = vec![0u8; 1 << 16];
        loop {
            let n = match entry.read(&mut buffer) {
                Ok(0) => break,
                Ok(n) => n,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) => return Err(self.read_error(context, err)),
            };
            written += n as u64;
            self.file_bytes += n as u64;
            if self.file_bytes > self.max_file_bytes {
                return Err(ImageError::TooLarge {
                    path: context.layer.to_owned(),
                    what: "the unpacked files",
                    limit: self.max_file_bytes,
                });
            }
            file.write_all(&buffer[..n])
                .map_err(|source| ImageError::Write {
                    path: self.root_path.join(OsStr::from_bytes(relative)),
                    source,
                })?;
        }
        if written != expected {
            return Err(ImageError::corrupt(
                context.layer,
                format!(
                    "entry {} is truncated: {written} of {expected} bytes",
                    context.entry.display()
                ),
            ));
        }
        Ok(file)
    }

    /// Owner first, then mode (a change of owner clears set-id bits), then time.
    fn finish_node(
        &self,
        file: &File,
        relative: &[u8],
        owner: Option<(u32, u32)>,
        mode: u32,
        mtime: i64,
    ) -> Result<(), ImageError> {
        let result = owner
            .map_or(Ok(()), |(uid, gid)| {
                fs::fchown(
                    file,
                    Some(rustix::fs::Uid::from_raw(uid)),
                    Some(rustix::fs::Gid::from_raw(gid)),
                )
            })
            .and_then(|()| fs::fchmod(file, Mode::from_raw_mode(mode)))
            .and_then(|()| fs::futimens(file, &times(mtime)));
        result.map_err(|errno| self.write_error(relative, errno))
    }

    /// Owner and time of a node that is not opened (symbolic link, fifo).
    fn finish_link(
        &self,
        parent: &OwnedFd,
        name: &[u8],
        relative: &[u8],
        owner: Option<(u32, u32)>,
        mtime: i64,
    ) -> Result<(), ImageError> {
        let result = owner
            .map_or(Ok(()), |(uid, gid)| chown_at(parent, name, uid, gid))
            .and_then(|()| {
                fs::utimensat(
                    parent,
                    OsStr::from_bytes(name),
                    &times(mtime),
                    AtFlags::SYMLINK_NOFOLLOW,
                )
            });
        result.map_err(|errno| self.write_error(relative, errno))
    }

    fn hard_link(
        &mut self,
        parent: &OwnedFd,
        name: &[u8],
        relative: &[u8],
        target: &[u8],
        context: &EntryContext<'_>,
    ) -> Result<(), ImageError> {
        let target_components =
            normal_components(target).ok_or_else(|| ImageError::PathEscape {
                layer: context.layer.to_owned(),
                entry: PathBuf::from(OsStr::from_bytes(target)),
                reason: EscapeReason::ParentComponent,
            })?;
        let missing = || {
            ImageError::corrupt(
                context.layer,
                format!(
                    "hard link {} points at {}, which is not a file unpacked before it",
                    context.entry.display(),
                    String::from_utf8_lossy(target)
                ),
            )
        };
        let Some((target_name, target_parents)) = target_components.split_last() else {
            return Err(missing());
        };
        let target_relative = target_components.join(&b'/');
        if target_relative == relative {
            return Ok(());
        }
        // Replacing `relative` would delete a target that lies inside it.
        if target_relative.starts_with(relative)
            && target_relative.get(relative.len()) == Some(&b'/')
        {
            return Err(missing());
        }
        let target_context = EntryContext {
            layer: context.layer,
            entry: Path::new(OsStr::from_bytes(target)),
        };
        let Walk::Found(target_parent) = self.walk(target_parents, None, &target_context)? else {
            return Err(missing());
        };
        match fs::statat(
            &target_parent,
            OsStr::from_bytes(target_name),
            AtFlags::SYMLINK_NOFOLLOW,
        ) {
            Ok(stat) if FileType::from_raw_mode(stat.st_mode) != FileType::Directory => {}
            Ok(_) | Err(Errno::NOENT) => return Err(missing()),
            Err(errno) => return Err(self.write_error(relative, errno)),
        }
        self.remove_existing(parent, name, relative)?;
        fs::linkat(
            &target_parent,
            OsStr::from_bytes(target_name),
            parent,
            OsStr::from_bytes(name),
            AtFlags::empty(),
        )
        .map_err(|errno| self.write_error(relative, errno))
    }

    /// Removes whatever is at `name` unless it is absent.
    fn remove_existing(
        &mut self,
        parent: &OwnedFd,
        name: &[u8],
        relative: &[u8],
    ) -> Result<(), ImageError> {
        self.remove_all_at(parent, name, relative)
    }

    /// Removes `name` and, for a directory, everything under it, following no link.
    fn remove_all_at(
        &mut self,
        parent: &OwnedFd,
        name: &[u8],
        relative: &[u8],
    ) -> Result<(), ImageError> {
        let stat = match fs::statat(parent, OsStr::from_bytes(name), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) => stat,
            Err(Errno::NOENT) => return Ok(()),
            Err(errno) => return Err(self.write_error(relative, errno)),
        };
        if FileType::from_raw_mode(stat.st_mode) == FileType::Directory {
            let dir = open_dir(parent, name).map_err(|errno| self.write_error(relative, errno))?;
            for child in self.list(&dir, relative)? {
                let child_relative = join(relative, &child);
                self.remove_all_at(&dir, &child, &child_relative)?;
            }
            fs::unlinkat(parent, OsStr::from_bytes(name), AtFlags::REMOVEDIR)
                .map_err(|errno| self.write_error(relative, errno))?;
            self.forget_dirs(relative);
        } else {
            fs::unlinkat(parent, OsStr::from_bytes(name), AtFlags::empty())
                .map_err(|errno| self.write_error(relative, errno))?;
        }
        Ok(())
    }

    /// Empties `dir` (at `relative`) of everything earlier layers put there, keeping what the
    /// current layer wrote.
    fn clear_opaque(&mut self, dir: &OwnedFd, relative: &[u8]) -> Result<(), ImageError> {
        for child in self.list(dir, relative)? {
            let child_relative = join(relative, &child);
            if !self.layer_keeps(&child_relative) {
                self.remove_all_at(dir, &child, &child_relative)?;
                continue;
            }
            match open_dir(dir, &child) {
                Ok(child_dir) => self.clear_opaque(&child_dir, &child_relative)?,
                Err(Errno::LOOP | Errno::NOTDIR) => {}
                Err(errno) => return Err(self.write_error(&child_relative, errno)),
            }
        }
        Ok(())
    }

    /// Whether the current layer wrote `relative` or something below it.
    fn layer_keeps(&self, relative: &[u8]) -> bool {
        if self.layer_paths.contains(relative) {
            return true;
        }
        let mut below = relative.to_vec();
        below.push(b'/');
        self.layer_paths
            .range(below.clone()..)
            .next()
            .is_some_and(|path| path.starts_with(&below))
    }

    fn list(&self, dir: &OwnedFd, relative: &[u8]) -> Result<Vec<Vec<u8>>, ImageError> {
        let listing = Dir::read_from(dir).map_err(|errno| self.write_error(relative, errno))?;
        let mut names = Vec::new();
        for item in listing {
            let item = item.map_err(|errno| self.write_error(relative, errno))?;
            let name = item.file_name().to_bytes();
            if name != b"." && name != b".." {
                names.push(name.to_vec());
            }
        }
        Ok(names)
    }

    /// Drops the recorded metadata of `relative` and every directory under it.
    fn forget_dirs(&mut self, relative: &[u8]) {
        self.dirs.remove(relative);
        let mut low = relative.to_vec();
        low.push(b'/');
        let mut high = relative.to_vec();
        high.push(b'/' + 1);
        let doomed: Vec<Vec<u8>> = self.dirs.range(low..high).map(|(k, _)| k.clone()).collect();
        for key in doomed {
            self.dirs.remove(&key);
        }
    }

    fn write_error(&self, relative: &[u8], errno: Errno) -> ImageError {
        ImageError::Write {
            path: self.root_path.join(OsStr::from_bytes(relative)),
            source: errno.into(),
        }
    }

    fn read_error(&self, context: &EntryContext<'_>, err: io::Error) -> ImageError {
        if is_limit_exceeded(&err) {
            return ImageError::TooLarge {
                path: context.layer.to_owned(),
                what: "the unpacked layers",
                limit: self.max_file_bytes,
            };
        }
        ImageError::corrupt(
            context.layer,
            format!("cannot read entry {}: {err}", context.entry.display()),
        )
    }

    fn bad_header(&self, context: &EntryContext<'_>, field: &str, err: io::Error) -> ImageError {
        ImageError::corrupt(
            context.layer,
            format!(
                "entry {} has a bad {field} field: {err}",
                context.entry.display()
            ),
        )
    }
}

fn open_dir(parent: &OwnedFd, name: &[u8]) -> Result<OwnedFd, Errno> {
    fs::openat(
        parent,
        OsStr::from_bytes(name),
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

fn chown_at(parent: &OwnedFd, name: &[u8], uid: u32, gid: u32) -> Result<(), Errno> {
    fs::chownat(
        parent,
        OsStr::from_bytes(name),
        Some(rustix::fs::Uid::from_raw(uid)),
        Some(rustix::fs::Gid::from_raw(gid)),
        AtFlags::SYMLINK_NOFOLLOW,
    )
}

fn join(parent: &[u8], name: &[u8]) -> Vec<u8> {
    let mut joined = parent.to_vec();
    if !joined.is_empty() {
        joined.push(b'/');
    }
    joined.extend_from_slice(name);
    joined
}

fn times(mtime: i64) -> Timestamps {
    let stamp = Timespec {
        tv_sec: mtime,
        tv_nsec: 0,
    };
    Timestamps {
        last_access: stamp,
        last_modification: stamp,
    }
}

/// Owner of an entry: the PAX `uid`/`gid` records when present (ids that do not fit the
/// ustar field), else the header. `u32::MAX` means "no change" to the kernel and is refused.
fn owner<R: Read>(
    entry: &mut Entry<'_, R>,
    context: &EntryContext<'_>,
) -> Result<(u32, u32), ImageError> {
    let bad = |field: &str| {
        ImageError::corrupt(
            context.layer,
            format!("entry {} has a bad {field}", context.entry.display()),
        )
    };
    let (mut uid, mut gid) = (None, None);
    if let Ok(Some(extensions)) = entry.pax_extensions() {
        for extension in extensions.flatten() {
            let value = extension.value().ok().and_then(|v| v.parse::<u64>().ok());
            match extension.key() {
                Ok(PAX_UID) => uid = Some(value.ok_or_else(|| bad("uid"))?),
                Ok(PAX_GID) => gid = Some(value.ok_or_else(|| bad("gid"))?),
                _ => {}
            }
        }
    }
    let header = entry.header();
    let uid = match uid {
        Some(uid) => uid,
        None => header.uid().map_err(|_| bad("uid"))?,
    };
    let gid = match gid {
        Some(gid) => gid,
        None => header.gid().map_err(|_| bad("gid"))?,
    };
    let fits = |id: u64| u32::try_from(id).ok().filter(|&id| id != u32::MAX);
    Ok((
        fits(uid).ok_or_else(|| bad("uid"))?,
        fits(gid).ok_or_else(|| bad("gid"))?,
    ))
}
