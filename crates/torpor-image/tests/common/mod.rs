//! Builders for test images: tar layers (including entries no well-behaved tool would
//! write), OCI layouts, oci-archives and docker save archives, all in a temporary directory.

#![allow(dead_code)]

use std::fs;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};

pub const MEDIA_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
pub const MEDIA_TAR_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const MEDIA_TAR_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
pub const MEDIA_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const MEDIA_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const MEDIA_CONFIG: &str = "application/vnd.oci.image.config.v1+json";

/// Set in the environment of a test re-run as an unprivileged user.
const UNPRIVILEGED_CHILD: &str = "TORPOR_IMAGE_TEST_UNPRIVILEGED";
/// `nobody`/`nogroup` on Debian. (`Command::uid` as root also drops supplementary groups.)
const NOBODY: u32 = 65534;

/// Tests that try to escape the destination run their body as an unprivileged user when
/// the test process is root. Should a regression ever let an entry out of the destination,
/// the test then fails on a permission error instead of rewriting the host's files (a
/// symbolic link to `/` plus an opaque marker would otherwise empty `/`).
///
/// Returns whether the caller should run the body itself: it is that unprivileged child,
/// or it was not root to begin with. Otherwise the body has run in the child, and this
/// asserts that it passed.
///
/// The child does not run from the build tree: a clone under a directory only root may
/// enter (`/root`, mode 0700) would leave `nobody` unable to execute it. See
/// [`UnprivilegedRun`].
pub fn body_runs_here(test: &str) -> bool {
    if std::env::var_os(UNPRIVILEGED_CHILD).is_some() || !rustix::process::geteuid().is_root() {
        return true;
    }
    let run = UnprivilegedRun::prepare();
    let mut tries = 0;
    let output = loop {
        let out = Command::new(&run.exe)
            .args(["--exact", test, "--test-threads=1"])
            .env(UNPRIVILEGED_CHILD, "1")
            .env("TMPDIR", &run.tmp)
            .env("HOME", &run.tmp)
            .current_dir(&run.tmp)
            .uid(NOBODY)
            .gid(NOBODY)
            .output();
        match out {
            // The copy was just written: a process another test thread forked in the
            // meantime may still hold it open for writing until it execs (ETXTBSY).
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 50 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            out => break out.unwrap(),
        }
    };
    assert!(
        output.status.success(),
        "{test} failed as an unprivileged user:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    // A renamed test would otherwise match nothing and "pass".
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("running 1 test") && stdout.contains("1 passed"),
        "{test} did not run in the unprivileged child:\n{stdout}"
    );
    false
}

/// What the unprivileged child needs, where it can reach it: a fresh directory under
/// `/tmp` (mode 0755) holding a copy of this test binary (0755) and a private scratch
/// directory owned by the child (its `TMPDIR`, `HOME` and working directory). The tests
/// build their inputs at run time, so the binary is all they read. Removed on drop.
struct UnprivilegedRun {
    _dir: tempfile::TempDir,
    exe: PathBuf,
    tmp: PathBuf,
}

impl UnprivilegedRun {
    fn prepare() -> UnprivilegedRun {
        use std::os::unix::fs::PermissionsExt;
        // `/tmp` itself, not `TMPDIR`: that may point under a directory `nobody` cannot enter.
        let dir = tempfile::Builder::new()
            .prefix("torpor-image-unprivileged-")
            .tempdir_in("/tmp")
            .unwrap();
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let exe = dir.path().join("test");
        fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
        fs::set_permissions(&exe, fs::Permissions::from_mode(0o755)).unwrap();
        let tmp = dir.path().join("tmp");
        fs::create_dir(&tmp).unwrap();
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&tmp, Some(NOBODY), Some(NOBODY)).unwrap();
        UnprivilegedRun {
            _dir: dir,
            exe,
            tmp,
        }
    }
}

pub fn sha256(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

pub fn hex(digest: &str) -> &str {
    digest.strip_prefix("sha256:").unwrap()
}

/// A layer tarball, entry by entry. Paths are written raw into the header, so that `..`
/// and absolute names reach the code under test.
pub struct Layer {
    builder: tar::Builder<Vec<u8>>,
}

impl Default for Layer {
    fn default() -> Self {
        Layer::new()
    }
}

impl Layer {
    pub fn new() -> Layer {
        Layer {
            builder: tar::Builder::new(Vec::new()),
        }
    }

    fn header(path: &str, kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut header = tar::Header::new_gnu();
        let name = &mut header.as_old_mut().name;
        assert!(path.len() < name.len(), "test paths stay short");
        name[..path.len()].copy_from_slice(path.as_bytes());
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_size(size);
        header.set_mtime(1_700_000_000);
        header.set_uid(0);
        header.set_gid(0);
        header
    }

    fn link_header(path: &str, kind: tar::EntryType, target: &str) -> tar::Header {
        let mut header = Layer::header(path, kind, 0o777, 0);
        let link = &mut header.as_old_mut().linkname;
        link[..target.len()].copy_from_slice(target.as_bytes());
        header
    }

    fn push(mut self, mut header: tar::Header, data: &[u8]) -> Layer {
        header.set_cksum();
        self.builder.append(&header, data).unwrap();
        self
    }

    pub fn dir(self, path: &str, mode: u32) -> Layer {
        let header = Layer::header(path, tar::EntryType::Directory, mode, 0);
        self.push(header, &[])
    }

    pub fn file(self, path: &str, contents: &[u8], mode: u32) -> Layer {
        let header = Layer::header(path, tar::EntryType::Regular, mode, contents.len() as u64);
        self.push(header, contents)
    }

    pub fn owned_file(self, path: &str, contents: &[u8], uid: u64, gid: u64) -> Layer {
        let mut header = Layer::header(path, tar::EntryType::Regular, 0o644, contents.len() as u64);
        header.set_uid(uid);
        header.set_gid(gid);
        self.push(header, contents)
    }

    pub fn symlink(self, path: &str, target: &str) -> Layer {
        let header = Layer::link_header(path, tar::EntryType::Symlink, target);
        self.push(header, &[])
    }

    pub fn hardlink(self, path: &str, target: &str) -> Layer {
        let header = Layer::link_header(path, tar::EntryType::Link, target);
        self.push(header, &[])
    }

    pub fn fifo(self, path: &str) -> Layer {
        let header = Layer::header(path, tar::EntryType::Fifo, 0o600, 0);
        self.push(header, &[])
    }

    pub fn char_device(self, path: &str, major: u32, minor: u32) -> Layer {
        let mut header = Layer::header(path, tar::EntryType::Char, 0o666, 0);
        header.set_device_major(major).unwrap();
        header.set_device_minor(minor).unwrap();
        self.push(header, &[])
    }

    pub fn block_device(self, path: &str, major: u32, minor: u32) -> Layer {
        let mut header = Layer::header(path, tar::EntryType::Block, 0o666, 0);
        header.set_device_major(major).unwrap();
        header.set_device_minor(minor).unwrap();
        self.push(header, &[])
    }

    /// An entry of any type and mode, with `data` as its content.
    pub fn raw(self, path: &str, kind: tar::EntryType, mode: u32, data: &[u8]) -> Layer {
        let header = Layer::header(path, kind, mode, data.len() as u64);
        self.push(header, data)
    }

    /// A file whose path may be longer than a header holds (a GNU long-name record).
    pub fn long_file(mut self, path: &str, contents: &[u8]) -> Layer {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_mode(0o644);
        header.set_size(contents.len() as u64);
        self.builder
            .append_data(&mut header, path, contents)
            .unwrap();
        self
    }

    /// A whiteout for `path` (`dir/.wh.name`).
    pub fn whiteout(self, dir: &str, name: &str) -> Layer {
        let path = if dir.is_empty() {
            format!(".wh.{name}")
        } else {
            format!("{dir}/.wh.{name}")
        };
        self.file(&path, b"", 0o644)
    }

    pub fn opaque(self, dir: &str) -> Layer {
        self.file(&format!("{dir}/.wh..wh..opq"), b"", 0o644)
    }

    pub fn tar(self) -> Vec<u8> {
        self.builder.into_inner().unwrap()
    }
}

pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(bytes).unwrap();
    encoder.finish().unwrap()
}

pub fn zstd(bytes: &[u8]) -> Vec<u8> {
    zstd::encode_all(bytes, 1).unwrap()
}

/// A layer as it goes into an image: the blob as stored, its media type, and its
/// uncompressed tar (for the diff id).
pub struct BlobLayer {
    pub blob: Vec<u8>,
    pub media_type: &'static str,
    pub diff_id: String,
}

impl BlobLayer {
    pub fn plain(tar: Vec<u8>) -> BlobLayer {
        BlobLayer {
            diff_id: sha256(&tar),
            blob: tar,
            media_type: MEDIA_TAR,
        }
    }

    pub fn gzip(tar: Vec<u8>) -> BlobLayer {
        BlobLayer {
            diff_id: sha256(&tar),
            blob: gzip(&tar),
            media_type: MEDIA_TAR_GZIP,
        }
    }

    pub fn zstd(tar: Vec<u8>) -> BlobLayer {
        BlobLayer {
            diff_id: sha256(&tar),
            blob: zstd(&tar),
            media_type: MEDIA_TAR_ZSTD,
        }
    }
}

pub fn config_json(diff_ids: &[String]) -> Value {
    json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": ["/bin/agent"],
            "Cmd": ["--serve"],
            "Env": ["PATH=/usr/bin:/bin", "MODE=test"],
            "WorkingDir": "/work",
            "User": "1000:1000"
        },
        "rootfs": {"type": "layers", "diff_ids": diff_ids}
    })
}

/// An OCI image layout being written in a directory.
pub struct OciLayout {
    pub dir: PathBuf,
}

impl OciLayout {
    pub fn new(dir: &Path) -> OciLayout {
        fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
        fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        OciLayout {
            dir: dir.to_owned(),
        }
    }

    /// Stores `bytes` under their digest; returns a descriptor for them.
    pub fn blob(&self, bytes: &[u8], media_type: &str) -> Value {
        let digest = sha256(bytes);
        fs::write(self.dir.join("blobs/sha256").join(hex(&digest)), bytes).unwrap();
        json!({"mediaType": media_type, "digest": digest, "size": bytes.len()})
    }

    pub fn json_blob(&self, value: &Value, media_type: &str) -> Value {
        self.blob(&serde_json::to_vec(value).unwrap(), media_type)
    }

    /// Writes config and manifest for `layers`; returns the manifest descriptor.
    pub fn image(&self, layers: &[BlobLayer]) -> Value {
        let diff_ids: Vec<String> = layers.iter().map(|l| l.diff_id.clone()).collect();
        self.image_with_config(layers, &config_json(&diff_ids))
    }

    pub fn image_with_config(&self, layers: &[BlobLayer], config: &Value) -> Value {
        let config = self.json_blob(config, MEDIA_CONFIG);
        let layer_descriptors: Vec<Value> = layers
            .iter()
            .map(|l| self.blob(&l.blob, l.media_type))
            .collect();
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": config,
            "layers": layer_descriptors,
        });
        self.json_blob(&manifest, MEDIA_MANIFEST)
    }

    pub fn index(&self, manifests: &[Value]) {
        let index = json!({"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": manifests});
        fs::write(
            self.dir.join("index.json"),
            serde_json::to_vec(&index).unwrap(),
        )
        .unwrap();
    }
}

pub fn with_ref_name(mut descriptor: Value, name: &str) -> Value {
    descriptor["annotations"] = json!({"org.opencontainers.image.ref.name": name});
    descriptor
}

pub fn with_platform(mut descriptor: Value, os: &str, architecture: &str) -> Value {
    descriptor["platform"] = json!({"os": os, "architecture": architecture});
    descriptor
}

/// A tarball of every file under `dir`, with names relative to it.
pub fn tar_dir(dir: &Path) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    builder.follow_symlinks(false);
    builder.append_dir_all(".", dir).unwrap();
    builder.into_inner().unwrap()
}

/// Member files of a `docker save` archive in the classic format.
pub struct DockerArchive {
    builder: tar::Builder<Vec<u8>>,
    entries: Vec<Value>,
}

impl Default for DockerArchive {
    fn default() -> Self {
        DockerArchive::new()
    }
}

impl DockerArchive {
    pub fn new() -> DockerArchive {
        DockerArchive {
            builder: tar::Builder::new(Vec::new()),
            entries: Vec::new(),
        }
    }

    pub fn member(&mut self, path: &str, bytes: &[u8]) {
        let mut header = tar::Header::new_gnu();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        header.set_entry_type(tar::EntryType::Regular);
        self.builder.append_data(&mut header, path, bytes).unwrap();
    }

    pub fn symlink_member(&mut self, path: &str, target: &str) {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Symlink);
        header.set_size(0);
        self.builder.append_link(&mut header, path, target).unwrap();
    }

    /// Adds an image whose layers are the given uncompressed (or compressed) tarballs;
    /// returns the config digest (the image id).
    pub fn image(&mut self, tags: &[&str], layers: &[(Vec<u8>, String)]) -> String {
        let diff_ids: Vec<String> = layers.iter().map(|(_, id)| id.clone()).collect();
        let config = serde_json::to_vec(&config_json(&diff_ids)).unwrap();
        let config_digest = sha256(&config);
        let config_name = format!("{}.json", hex(&config_digest));
        self.member(&config_name, &config);
        let mut layer_names = Vec::new();
        for (blob, diff_id) in layers {
            let name = format!("{}/layer.tar", &hex(diff_id)[..16]);
            self.member(&name, blob);
            layer_names.push(name);
        }
        self.entries.push(json!({
            "Config": config_name,
            "RepoTags": tags,
            "Layers": layer_names,
        }));
        config_digest
    }

    pub fn push_entry(&mut self, entry: Value) {
        self.entries.push(entry);
    }

    pub fn finish(mut self) -> Vec<u8> {
        let manifest = serde_json::to_vec(&self.entries).unwrap();
        self.member("manifest.json", &manifest);
        self.builder.into_inner().unwrap()
    }
}
