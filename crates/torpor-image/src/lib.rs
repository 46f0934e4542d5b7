//! Container images on local disk into root filesystem directories.
//!
//! torpor templates can start from an image that is already on the machine: an OCI image
//! layout directory, the same layout in a tarball (oci-archive), or a `docker save` tarball.
//! [`detect`] tells which one a path is; [`unpack`] applies the image's layers in order into
//! an empty directory and returns the runtime config (entrypoint, command, env, ...).
//!
//! The image is untrusted input. This crate owns reading it and writing the destination
//! directory, and must not touch anything else on the host:
//! - every blob is checked against its digest and size (manifests and configs before they
//!   are parsed, layers while they stream),
//! - no layer entry can write outside the destination or through a symbolic link in it
//!   (every path is walked with `openat(O_NOFOLLOW)` from a descriptor of the root),
//! - JSON documents, the total unpacked size and the entry count have limits ([`Limits`]),
//! - set-user-id and set-group-id bits are stripped and device nodes left out, so a root
//!   filesystem on the host's disk gives no local user more than the image's files,
//! - malformed input is an [`ImageError`] with a stable [`code`](ImageError::code), never a
//!   panic.
//!
//! A plain root filesystem tarball (what `tar -C rootfs -c .` writes, plain, gzip or zstd)
//! is unpacked with [`unpack_rootfs_tar`], under the same rules.
//!
//! Errors name paths on the host for the operator's log; [`ImageError::client_message`] is
//! what an API client may be told.
//!
//! Everything is synchronous; callers on an async runtime run it on a blocking thread.
//!
//! ```no_run
//! use std::path::Path;
//! use torpor_image::{detect, unpack, Progress};
//!
//! let source = detect(Path::new("alpine.tar"))?;
//! let rootfs = Path::new("/var/lib/torpor/templates/alpine/rootfs");
//! let config = unpack(&source, Some("alpine:3.19"), rootfs, &mut |progress| {
//!     if let Progress::LayerFinished { index, count, unpacked_bytes, .. } = progress {
//!         eprintln!("layer {}/{count}: {unpacked_bytes} bytes", index + 1);
//!     }
//! })?;
//! println!("{:?} {:?} from {}", config.entrypoint, config.cmd, config.digest);
//! # Ok::<(), torpor_image::ImageError>(())
//! ```

mod digest;
mod error;
#[doc(hidden)]
pub mod fuzzing;
mod plan;
mod rootfs;
mod store;
mod tar_guard;

use std::fs;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use serde::Serialize;

pub use crate::digest::Digest;
use crate::digest::{is_limit_exceeded, HashingReader};
pub use crate::error::{EscapeReason, ImageError};
use crate::plan::{LayerPlan, Plan};
use crate::rootfs::Rootfs;
use crate::store::{Compression, Store};
use crate::tar_guard::TarGuard;

/// An image on local disk, as [`detect`] recognises it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageSource {
    /// A directory with an `oci-layout` file, `index.json` and `blobs/`.
    OciLayout(PathBuf),
    /// A tarball (plain, gzip or zstd) of an OCI image layout.
    OciArchive(PathBuf),
    /// A tarball (plain, gzip or zstd) written by `docker save`, with `manifest.json`.
    DockerArchive(PathBuf),
}

impl ImageSource {
    pub fn path(&self) -> &Path {
        match self {
            ImageSource::OciLayout(path)
            | ImageSource::OciArchive(path)
            | ImageSource::DockerArchive(path) => path,
        }
    }
}

/// What a container started from the image runs, and which manifest it came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ImageConfig {
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub user: Option<String>,
    /// Digest of the manifest; for a classic `docker save` archive, which has no manifest,
    /// the digest of the config (the image id).
    #[serde(serialize_with = "serialize_digest")]
    pub digest: Digest,
}

fn serialize_digest<S: serde::Serializer>(digest: &Digest, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(digest.as_str())
}

/// Reported while [`unpack`] applies layers.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Progress {
    LayerStarted {
        /// Position of the layer, from 0, of `count`.
        index: usize,
        count: usize,
        digest: Digest,
        /// Size of the blob as stored (compressed, when it is).
        compressed_bytes: u64,
    },
    LayerFinished {
        index: usize,
        count: usize,
        digest: Digest,
        compressed_bytes: u64,
        /// Size of the uncompressed tar stream.
        unpacked_bytes: u64,
    },
}

/// Size limits for untrusted images.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// Largest `index.json`, manifest, config or `manifest.json`.
    pub max_json_bytes: u64,
    /// Largest total of uncompressed layer streams, and separately of bytes written to
    /// files; also bounds a compressed archive once decompressed.
    pub max_unpacked_bytes: u64,
    /// Most tar entries in all layers together, and in an archive's own index; bounds the
    /// bookkeeping kept per path.
    pub max_entries: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_json_bytes: 4 << 20,
            max_unpacked_bytes: 32 << 30,
            max_entries: 4 << 20,
        }
    }
}

/// The platform chosen when an index lists several.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Platform {
    pub os: String,
    pub architecture: String,
}

impl Default for Platform {
    fn default() -> Self {
        Platform {
            os: "linux".to_owned(),
            architecture: "amd64".to_owned(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct UnpackOptions {
    pub limits: Limits,
    pub platform: Platform,
}

/// Tells what kind of image `path` holds: a directory with an `oci-layout` file, or a
/// tarball (plain, gzip or zstd) holding `oci-layout` and `index.json` (an OCI layout, which
/// recent `docker save` also writes) or else `manifest.json` (classic `docker save`).
pub fn detect(path: &Path) -> Result<ImageSource, ImageError> {
    let metadata = fs::metadata(path).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound => ImageError::NotFound {
            path: path.to_owned(),
        },
        _ => ImageError::Read {
            path: path.to_owned(),
            source,
        },
    })?;
    if metadata.is_dir() {
        return if path.join("oci-layout").is_file() {
            Ok(ImageSource::OciLayout(path.to_owned()))
        } else {
            Err(ImageError::Unrecognized {
                path: path.to_owned(),
            })
        };
    }
    let seen = store::scan_archive_kind(path)?;
    if seen.oci_layout && seen.index_json {
        Ok(ImageSource::OciArchive(path.to_owned()))
    } else if seen.manifest_json {
        Ok(ImageSource::DockerArchive(path.to_owned()))
    } else {
        Err(ImageError::Unrecognized {
            path: path.to_owned(),
        })
    }
}

/// [`unpack_with`] with the default limits and linux/amd64.
pub fn unpack(
    src: &ImageSource,
    reference: Option<&str>,
    dest_rootfs: &Path,
    progress: &mut dyn FnMut(Progress),
) -> Result<ImageConfig, ImageError> {
    unpack_with(
        src,
        reference,
        dest_rootfs,
        &UnpackOptions::default(),
        progress,
    )
}

/// Unpacks the image `reference` names (an `org.opencontainers.image.ref.name` annotation,
/// a bare tag of it, or a docker `RepoTags` entry; `None` when the source holds one image)
/// into `dest_rootfs`, which must be missing or empty.
///
/// On error, what was written is removed (and `dest_rootfs` too, if this call created it).
pub fn unpack_with(
    src: &ImageSource,
    reference: Option<&str>,
    dest_rootfs: &Path,
    options: &UnpackOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<ImageConfig, ImageError> {
    let span = tracing::info_span!(
        "image_unpack",
        source = %src.path().display(),
        reference,
        dest = %dest_rootfs.display(),
    );
    let _entered = span.enter();
    let store = match src {
        ImageSource::OciLayout(path) => {
            if !path.is_dir() {
                return Err(ImageError::NotFound { path: path.clone() });
            }
            Store::dir(path)
        }
        ImageSource::OciArchive(path) | ImageSource::DockerArchive(path) => {
            Store::archive(path, &options.limits)?
        }
    };
    let plan = match src {
        ImageSource::OciLayout(_) => plan::resolve_oci(&store, reference, options)?,
        // Docker 25 and later write an OCI layout plus `manifest.json`; a reference its
        // index does not name may still be one of the `RepoTags` there.
        ImageSource::OciArchive(_) => match plan::resolve_oci(&store, reference, options) {
            Err(err @ ImageError::ReferenceNotFound { .. }) => plan::resolve_docker(
                &store, reference, options,
            )
            .map_err(|fallback| match fallback {
                ImageError::NotFound { .. } | ImageError::ReferenceNotFound { .. } => err,
                other => other,
            })?,
            other => other?,
        },
        ImageSource::DockerArchive(_) => plan::resolve_docker(&store, reference, options)?,
    };
    let (rootfs, created) = Rootfs::create(dest_rootfs, &options.limits)?;
    let result = apply_plan(&store, &plan, rootfs, options, progress);
    match &result {
        Ok(()) => tracing::info!(
            digest = %plan.config.digest,
            layers = plan.layers.len(),
            "image unpacked"
        ),
        Err(err) => {
            tracing::warn!(code = err.code(), error = %err, "image unpack failed; discarding");
            discard(dest_rootfs, created);
        }
    }
    result.map(|()| plan.config)
}

/// [`unpack_rootfs_tar_with`] with the default limits.
pub fn unpack_rootfs_tar(archive: &Path, dest_rootfs: &Path) -> Result<u64, ImageError> {
    unpack_rootfs_tar_with(archive, dest_rootfs, &Limits::default())
}

/// Unpacks a root filesystem tarball (plain, gzip or zstd; told from its first bytes) into
/// `dest_rootfs`, which must be missing or empty, under the same rules as an image layer:
/// no entry leaves the destination or writes through a link, set-id bits are stripped,
/// device nodes are left out, and `limits` bound the unpacked bytes and the entries.
/// Returns the size of the uncompressed tar stream.
///
/// On error, what was written is removed (and `dest_rootfs` too, if this call created it).
pub fn unpack_rootfs_tar_with(
    archive: &Path,
    dest_rootfs: &Path,
    limits: &Limits,
) -> Result<u64, ImageError> {
    let span = tracing::info_span!(
        "rootfs_unpack",
        source = %archive.display(),
        dest = %dest_rootfs.display(),
    );
    let _entered = span.enter();
    let file = fs::File::open(archive).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound => ImageError::NotFound {
            path: archive.to_owned(),
        },
        _ => ImageError::Read {
            path: archive.to_owned(),
            source,
        },
    })?;
    let is_file = file
        .metadata()
        .map_err(|source| ImageError::Read {
            path: archive.to_owned(),
            source,
        })?
        .is_file();
    if !is_file {
        return Err(ImageError::Unrecognized {
            path: archive.to_owned(),
        });
    }
    let options = UnpackOptions {
        limits: limits.clone(),
        platform: Platform::default(),
    };
    let layer = LayerPlan {
        member: String::new(),
        compression: None,
        blob: None,
        diff_id: None,
    };
    let (mut rootfs, created) = Rootfs::create(dest_rootfs, limits)?;
    rootfs.begin_layer();
    let result = apply_layer(
        Box::new(BufReader::new(file)),
        &layer,
        archive,
        &mut rootfs,
        limits.max_unpacked_bytes,
        &options,
    )
    .and_then(|unpacked_bytes| rootfs.finish().map(|()| unpacked_bytes));
    match &result {
        Ok(unpacked_bytes) => tracing::info!(unpacked_bytes, "root filesystem unpacked"),
        Err(err) => {
            tracing::warn!(code = err.code(), error = %err, "root filesystem unpack failed; discarding");
            discard(dest_rootfs, created);
        }
    }
    result
}

/// Best effort: the error that led here is the one worth reporting.
fn discard(dest: &Path, created: bool) {
    if created {
        let _ = fs::remove_dir_all(dest);
        return;
    }
    if let Ok(listing) = fs::read_dir(dest) {
        for item in listing.flatten() {
            let path = item.path();
            let _ = match item.file_type() {
                Ok(kind) if kind.is_dir() => fs::remove_dir_all(&path),
                _ => fs::remove_file(&path),
            };
        }
    }
}

fn apply_plan(
    store: &Store,
    plan: &Plan,
    mut rootfs: Rootfs,
    options: &UnpackOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<(), ImageError> {
    let count = plan.layers.len();
    let mut budget = options.limits.max_unpacked_bytes;
    for (index, layer) in plan.layers.iter().enumerate() {
        let path = store.display(&layer.member);
        let digest = layer
            .name()
            .cloned()
            .ok_or_else(|| ImageError::corrupt(&path, "the layer has no digest"))?;
        let (reader, compressed_bytes) = store.open(&layer.member)?;
        if let Some((_, size)) = &layer.blob {
            if *size != compressed_bytes {
                return Err(ImageError::SizeMismatch {
                    path,
                    expected: *size,
                    actual: compressed_bytes,
                });
            }
        }
        progress(Progress::LayerStarted {
            index,
            count,
            digest: digest.clone(),
            compressed_bytes,
        });
        rootfs.begin_layer();
        let unpacked_bytes = apply_layer(reader, layer, &path, &mut rootfs, budget, options)?;
        budget -= unpacked_bytes;
        tracing::debug!(
            index,
            digest = %digest,
            compressed_bytes,
            unpacked_bytes,
            "layer applied"
        );
        progress(Progress::LayerFinished {
            index,
            count,
            digest,
            compressed_bytes,
            unpacked_bytes,
        });
    }
    rootfs.finish()
}

/// Streams one layer blob through its decoder into `rootfs`, hashing the blob and the
/// uncompressed stream on the way; returns the uncompressed size.
fn apply_layer(
    reader: Box<dyn Read + '_>,
    layer: &LayerPlan,
    path: &Path,
    rootfs: &mut Rootfs,
    budget: u64,
    options: &UnpackOptions,
) -> Result<u64, ImageError> {
    let read_error = |err: io::Error| {
        if is_limit_exceeded(&err) {
            ImageError::TooLarge {
                path: path.to_owned(),
                what: "the unpacked layers",
                limit: options.limits.max_unpacked_bytes,
            }
        } else if tar_guard::is_metadata_too_large(&err) {
            ImageError::TooLarge {
                path: path.to_owned(),
                what: "one long name or PAX record",
                limit: tar_guard::MAX_METADATA_BYTES,
            }
        } else {
            ImageError::corrupt(path, format!("bad layer: {err}"))
        }
    };
    let mut blob = BufReader::new(HashingReader::new(reader, u64::MAX));
    let compression = match layer.compression {
        Some(known) => known,
        None => Compression::sniff(blob.fill_buf().map_err(read_error)?),
    };
    let (diff_id, unpacked_bytes) = {
        let decoder = compression.decoder(&mut blob).map_err(read_error)?;
        let mut stream = HashingReader::new(decoder, budget);
        {
            let mut archive = tar::Archive::new(TarGuard::new(&mut stream));
            for entry in archive.entries().map_err(read_error)? {
                let mut entry = entry.map_err(read_error)?;
                rootfs.apply_entry(&mut entry, path)?;
            }
        }
        stream.drain().map_err(read_error)?;
        stream.finish()
    };
    io::copy(&mut blob, &mut io::sink()).map_err(read_error)?;
    let (blob_digest, _) = blob.into_inner().finish();
    if let Some((expected, _)) = &layer.blob {
        expected.verify(&blob_digest, path)?;
    }
    if let Some(expected) = &layer.diff_id {
        expected.verify(&diff_id, path)?;
    }
    Ok(unpacked_bytes)
}
