//! Where a template's root filesystem may come from, by who asks: the boundary between tenants
//! and the host's files.
//!
//! - The operator (admin token) may name any host path (`rootfs`, `image`).
//! - A tenant may name a host path only inside the operator's `--import-dir`, after symlinks
//!   are resolved; without `--import-dir` not at all. Every refusal reads the same whether or
//!   not the path exists, so the refusal is no oracle of the host's files.
//! - Tenants bring their own images by uploading them ([`Engine::register_template_upload`]):
//!   the archive is streamed by the API into [`Engine::upload_dir`] and imported from there.
//!
//! Whatever the source, what lands in a template's root filesystem has its setuid and setgid
//! bits cleared and no device nodes ([`strip_privileged`]): a template rootfs under the data
//! directory must give no local user a way to root.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use torpor_core::{TemplateSource, TemplateSpec, TenantId};

use super::Engine;
use crate::error::{ControlError, Result};
use crate::store::TemplateRecord;

/// What a tenant's upload holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UploadKind {
    /// An OCI layout archive, an oci-archive or a `docker save` tarball.
    Image,
    /// A tarball of a root filesystem (plain, gzip or zstd).
    Rootfs,
}

/// What an uploaded source is shown as in the template's spec (never the upload's path).
pub const UPLOADED: &str = "(uploaded)";

impl Engine {
    /// Where the API streams uploads before they are imported (mode 0700, in the data dir).
    pub fn upload_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("uploads")
    }

    /// Refuses a template source that names a host path the caller may not read. Returns the
    /// source to import from: for a tenant, the path with its symlinks resolved, so what was
    /// checked is what is read.
    pub(super) fn check_source(
        &self,
        tenant: &TenantId,
        source: &TemplateSource,
    ) -> Result<TemplateSource> {
        let path = match source {
            TemplateSource::Host => return Ok(source.clone()),
            TemplateSource::Rootfs { path } | TemplateSource::Image { path, .. } => path,
        };
        if *tenant == TenantId::admin() {
            if Path::new(path).is_absolute() {
                return Ok(source.clone());
            }
            if self.cfg.import_dir.is_none() {
                return Err(ControlError::Invalid(
                    "source.path must be absolute (no --import-dir to resolve it in)".into(),
                ));
            }
        }
        let Some(import_dir) = &self.cfg.import_dir else {
            return Err(ControlError::Forbidden(
                "tenants may not name host paths; upload the image with \
                 POST /v1/templates/{name}/image (CLI: torpor template add NAME --image FILE)"
                    .into(),
            ));
        };
        // The operator's relative paths resolve in the import directory too, without its check.
        let admin = *tenant == TenantId::admin();
        let refused = || {
            ControlError::Forbidden(
                "the path is not inside the operator's import directory (--import-dir); name a \
                 path relative to it or upload the image"
                    .into(),
            )
        };
        // A relative path is taken inside the import directory.
        let asked = Path::new(path);
        let joined = if asked.is_absolute() {
            asked.to_path_buf()
        } else {
            import_dir.join(asked)
        };
        let root = import_dir.canonicalize().map_err(|_| refused())?;
        let real = joined.canonicalize().map_err(|_| refused())?;
        if !admin && !real.starts_with(&root) {
            return Err(refused());
        }
        let real = real.to_string_lossy().into_owned();
        Ok(match source {
            TemplateSource::Rootfs { .. } => TemplateSource::Rootfs { path: real },
            TemplateSource::Image { reference, .. } => TemplateSource::Image {
                path: real,
                reference: reference.clone(),
            },
            TemplateSource::Host => unreachable!("returned above"),
        })
    }

    /// Registers a template from an archive the caller uploaded into [`Engine::upload_dir`].
    /// The archive is removed whatever happens; its path on the host is not recorded.
    pub async fn register_template_upload(
        &self,
        tenant: &TenantId,
        mut spec: TemplateSpec,
        archive: &Path,
        kind: UploadKind,
        progress: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<TemplateRecord> {
        struct RemoveOnDrop<'a>(&'a Path);
        impl Drop for RemoveOnDrop<'_> {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(self.0);
            }
        }
        let _cleanup = RemoveOnDrop(archive);
        let reference = match &spec.source {
            TemplateSource::Image { reference, .. } => reference.clone(),
            _ => None,
        };
        let source = |path: &str| match kind {
            UploadKind::Image => TemplateSource::Image {
                path: path.into(),
                reference: reference.clone(),
            },
            UploadKind::Rootfs => TemplateSource::Rootfs { path: path.into() },
        };
        spec.source = source(UPLOADED);
        let read_from = source(&archive.to_string_lossy());
        // Image errors reach a tenant through ImageError::client_message (no host paths).
        self.register_template_checked(tenant, spec, read_from, progress)
            .await
    }
}

/// Clears setuid and setgid bits and removes device nodes under `root` (symlinks are not
/// followed). Returns how many entries were changed.
pub(crate) fn strip_privileged(root: &Path) -> std::io::Result<u64> {
    let mut changed = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let path = entry.path();
            let meta = std::fs::symlink_metadata(&path)?;
            let ft = meta.file_type();
            if ft.is_symlink() {
                continue;
            }
            if ft.is_block_device() || ft.is_char_device() {
                std::fs::remove_file(&path)?;
                changed += 1;
                continue;
            }
            let mode = meta.permissions().mode();
            if mode & 0o6000 != 0 {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode & !0o6000))?;
                changed += 1;
            }
            if ft.is_dir() {
                stack.push(path);
            }
        }
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setuid_bits_and_devices_are_stripped() {
        let tmp = tempfile::tempdir().unwrap();
        let bin = tmp.path().join("usr/bin");
        std::fs::create_dir_all(&bin).unwrap();
        let su = bin.join("su");
        std::fs::write(&su, b"#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&su, std::fs::Permissions::from_mode(0o4755)).unwrap();
        let sg = bin.join("wall");
        std::fs::write(&sg, b"").unwrap();
        std::fs::set_permissions(&sg, std::fs::Permissions::from_mode(0o2755)).unwrap();
        let plain = bin.join("ls");
        std::fs::write(&plain, b"").unwrap();
        std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o755)).unwrap();
        // A device node (needs root; skipped otherwise).
        let dev = tmp.path().join("null");
        let c = std::ffi::CString::new(dev.to_str().unwrap()).unwrap();
        // SAFETY: mknod on a path we own, with a valid C string.
        let made = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
        let n = strip_privileged(tmp.path()).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&su), 0o755);
        assert_eq!(mode(&sg), 0o755);
        assert_eq!(mode(&plain), 0o755);
        if made == 0 {
            assert!(!dev.exists());
            assert_eq!(n, 3);
        } else {
            assert_eq!(n, 2);
        }
    }
}
