//! From an image's JSON documents to a [`Plan`]: which layers to apply, in which order, how
//! each is compressed and how it is verified, and the runtime config.
//!
//! OCI layouts (`index.json`, possibly through nested indexes) and docker save archives
//! (`manifest.json`) are both read here. Every document but the top-level one is checked
//! against the digest and size its parent gives before it is parsed. The JSON types accept
//! unknown fields on purpose: these are foreign formats that grow new fields, unlike torpor's
//! own configuration.

use std::collections::HashMap;

use serde::Deserialize;

use crate::digest::Digest;
use crate::store::{normal_components, Compression, Store};
use crate::{ImageConfig, ImageError, UnpackOptions};

const MEDIA_OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const MEDIA_DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
const MEDIA_OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MEDIA_DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const MEDIA_OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const MEDIA_DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";

const ANNOTATION_REF_NAME: &str = "org.opencontainers.image.ref.name";
const ANNOTATION_CONTAINERD_NAME: &str = "io.containerd.image.name";
const ANNOTATION_DOCKER_REFERENCE_TYPE: &str = "vnd.docker.reference.type";

/// How deep indexes may nest before the image is judged corrupt.
const MAX_INDEX_DEPTH: usize = 4;

/// Everything `unpack` needs once the JSON documents are read and verified.
#[derive(Debug)]
pub(crate) struct Plan {
    pub(crate) config: ImageConfig,
    pub(crate) layers: Vec<LayerPlan>,
}

#[derive(Debug)]
pub(crate) struct LayerPlan {
    /// Path of the blob in the store.
    pub(crate) member: String,
    /// `None`: told from the first bytes (docker save gives no media types).
    pub(crate) compression: Option<Compression>,
    /// Digest and size of the blob as stored, when the image states them.
    pub(crate) blob: Option<(Digest, u64)>,
    /// Digest of the uncompressed tar stream, from the config's `rootfs.diff_ids`.
    pub(crate) diff_id: Option<Digest>,
}

impl LayerPlan {
    /// The digest that names this layer in progress reports.
    pub(crate) fn name(&self) -> Option<&Digest> {
        self.blob
            .as_ref()
            .map(|(digest, _)| digest)
            .or(self.diff_id.as_ref())
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LayoutFile {
    image_layout_version: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Descriptor {
    media_type: Option<String>,
    digest: String,
    size: u64,
    #[serde(default)]
    annotations: Option<HashMap<String, String>>,
    platform: Option<PlatformJson>,
}

impl Descriptor {
    fn annotation(&self, key: &str) -> Option<&str> {
        self.annotations.as_ref()?.get(key).map(String::as_str)
    }

    /// Attestations and other non-images that buildkit lists beside the real manifests.
    fn is_attestation(&self) -> bool {
        self.annotation(ANNOTATION_DOCKER_REFERENCE_TYPE).is_some()
            || self
                .platform
                .as_ref()
                .is_some_and(|p| p.os == "unknown" && p.architecture == "unknown")
    }
}

#[derive(Debug, Deserialize)]
struct PlatformJson {
    architecture: String,
    os: String,
}

/// An index or a manifest: which one is told by `mediaType`, or by its fields.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct IndexOrManifest {
    media_type: Option<String>,
    manifests: Option<Vec<Descriptor>>,
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Vec<Descriptor>,
}

#[derive(Debug, Deserialize)]
struct ConfigFile {
    config: Option<ContainerConfig>,
    rootfs: Option<RootFs>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ContainerConfig {
    entrypoint: Option<Vec<String>>,
    cmd: Option<Vec<String>>,
    env: Option<Vec<String>>,
    working_dir: Option<String>,
    user: Option<String>,
}

#[derive(Debug, Deserialize)]
struct RootFs {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    diff_ids: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerManifestEntry {
    config: String,
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

fn parse_json<T: serde::de::DeserializeOwned>(
    store: &Store,
    member: &str,
    bytes: &[u8],
    what: &'static str,
) -> Result<T, ImageError> {
    serde_json::from_slice(bytes).map_err(|source| ImageError::InvalidJson {
        path: store.display(member),
        what,
        source,
    })
}

fn blob_member(digest: &Digest) -> String {
    format!("blobs/sha256/{}", digest.hex())
}

/// Reads a JSON blob named by `descriptor`, checking size and digest before parsing.
fn read_verified<T: serde::de::DeserializeOwned>(
    store: &Store,
    parent: &str,
    descriptor: &Descriptor,
    options: &UnpackOptions,
    what: &'static str,
) -> Result<(T, Digest, String), ImageError> {
    let digest = Digest::parse(&descriptor.digest, &store.display(parent))?;
    let member = blob_member(&digest);
    let limit = options.limits.max_json_bytes;
    if descriptor.size > limit {
        return Err(ImageError::TooLarge {
            path: store.display(&member),
            what,
            limit,
        });
    }
    let bytes = store.read_small(&member, limit, what)?;
    if bytes.len() as u64 != descriptor.size {
        return Err(ImageError::SizeMismatch {
            path: store.display(&member),
            expected: descriptor.size,
            actual: bytes.len() as u64,
        });
    }
    digest.verify(&Digest::of_bytes(&bytes), &store.display(&member))?;
    let value = parse_json(store, &member, &bytes, what)?;
    Ok((value, digest, member))
}

/// Whether an index entry answers to `reference`: its full name, its tag alone (OCI layouts
/// often store only the tag), or the name containerd and docker record.
fn matches_reference(descriptor: &Descriptor, reference: &str) -> bool {
    let ref_name = descriptor.annotation(ANNOTATION_REF_NAME);
    let tag = reference_tag(reference);
    ref_name == Some(reference)
        || descriptor.annotation(ANNOTATION_CONTAINERD_NAME) == Some(reference)
        || (tag.is_some() && ref_name == tag)
}

/// The tag of `name:tag` (a `:` after the last `/`, so that `host:5000/name` has none).
fn reference_tag(reference: &str) -> Option<&str> {
    let last = reference.rsplit('/').next()?;
    last.split_once(':').map(|(_, tag)| tag)
}

/// Chooses one descriptor from an index: the only image, or the one for the wanted platform.
fn choose<'a>(
    store: &Store,
    member: &str,
    candidates: &'a [Descriptor],
    options: &UnpackOptions,
) -> Result<&'a Descriptor, ImageError> {
    let images: Vec<&Descriptor> = candidates.iter().filter(|d| !d.is_attestation()).collect();
    match images.as_slice() {
        [] => Err(ImageError::corrupt(
            store.display(member),
            "the index lists no image manifests",
        )),
        [only] => Ok(only),
        several => {
            if several.iter().all(|d| d.platform.is_none()) {
                return Err(ImageError::Ambiguous {
                    path: store.display(member),
                    count: several.len(),
                });
            }
            let wanted = &options.platform;
            several
                .iter()
                .copied()
                .find(|d| {
                    d.platform
                        .as_ref()
                        .is_some_and(|p| p.os == wanted.os && p.architecture == wanted.architecture)
                })
                .ok_or_else(|| ImageError::PlatformNotFound {
                    path: store.display(member),
                    os: wanted.os.clone(),
                    architecture: wanted.architecture.clone(),
                })
        }
    }
}

/// Resolves an OCI image layout (a directory or an oci-archive) to a plan.
pub(crate) fn resolve_oci(
    store: &Store,
    reference: Option<&str>,
    options: &UnpackOptions,
) -> Result<Plan, ImageError> {
    let limit = options.limits.max_json_bytes;
    let layout_bytes = store.read_small("oci-layout", limit, "the oci-layout file")?;
    let layout: LayoutFile = parse_json(store, "oci-layout", &layout_bytes, "the oci-layout file")?;
    if !layout.image_layout_version.starts_with("1.") {
        return Err(ImageError::UnsupportedMediaType {
            path: store.display("oci-layout"),
            media_type: format!("OCI image layout {}", layout.image_layout_version),
        });
    }

    let index_bytes = store.read_small("index.json", limit, "the image index")?;
    let index: IndexOrManifest = parse_json(store, "index.json", &index_bytes, "the image index")?;
    let top = index.manifests.unwrap_or_default();
    let named: Vec<Descriptor>;
    let candidates: &[Descriptor] = match reference {
        Some(reference) => {
            named = top
                .into_iter()
                .filter(|d| matches_reference(d, reference))
                .collect();
            if named.is_empty() {
                return Err(ImageError::ReferenceNotFound {
                    path: store.root().to_owned(),
                    reference: reference.to_owned(),
                });
            }
            &named
        }
        None => {
            named = top;
            &named
        }
    };

    let mut parent = "index.json".to_owned();
    let mut chosen = choose(store, &parent, candidates, options)?;
    let mut nested: IndexOrManifest;
    for _ in 0..MAX_INDEX_DEPTH {
        let (document, digest, member) =
            read_verified::<IndexOrManifest>(store, &parent, chosen, options, "a manifest")?;
        let media_type = chosen
            .media_type
            .clone()
            .or_else(|| document.media_type.clone());
        let is_index = match media_type.as_deref() {
            Some(MEDIA_OCI_INDEX | MEDIA_DOCKER_LIST) => true,
            Some(MEDIA_OCI_MANIFEST | MEDIA_DOCKER_MANIFEST) => false,
            None => document.manifests.is_some(),
            Some(other) => {
                return Err(ImageError::UnsupportedMediaType {
                    path: store.display(&member),
                    media_type: other.to_owned(),
                })
            }
        };
        if !is_index {
            return plan_from_manifest(store, &member, document, digest, options);
        }
        nested = document;
        parent = member;
        chosen = choose(
            store,
            &parent,
            nested.manifests.as_deref().unwrap_or_default(),
            options,
        )?;
    }
    Err(ImageError::corrupt(
        store.display(&parent),
        format!("indexes nest deeper than {MAX_INDEX_DEPTH} levels"),
    ))
}

fn layer_compression(media_type: &str) -> Option<Compression> {
    match media_type {
        "application/vnd.oci.image.layer.v1.tar"
        | "application/vnd.oci.image.layer.nondistributable.v1.tar"
        | "application/vnd.docker.image.rootfs.diff.tar" => Some(Compression::None),
        "application/vnd.oci.image.layer.v1.tar+gzip"
        | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
        | "application/vnd.docker.image.rootfs.diff.tar.gzip"
        | "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip" => Some(Compression::Gzip),
        "application/vnd.oci.image.layer.v1.tar+zstd"
        | "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd" => Some(Compression::Zstd),
        _ => None,
    }
}

fn plan_from_manifest(
    store: &Store,
    member: &str,
    manifest: IndexOrManifest,
    digest: Digest,
    options: &UnpackOptions,
) -> Result<Plan, ImageError> {
    let config_descriptor = manifest
        .config
        .ok_or_else(|| ImageError::corrupt(store.display(member), "the manifest has no config"))?;
    match config_descriptor.media_type.as_deref() {
        Some(MEDIA_OCI_CONFIG | MEDIA_DOCKER_CONFIG) | None => {}
        Some(other) => {
            return Err(ImageError::UnsupportedMediaType {
                path: store.display(member),
                media_type: other.to_owned(),
            })
        }
    }
    let (config, _, config_member) = read_verified::<ConfigFile>(
        store,
        member,
        &config_descriptor,
        options,
        "an image config",
    )?;
    let diff_ids = diff_ids(store, &config_member, &config, manifest.layers.len())?;

    let mut layers = Vec::with_capacity(manifest.layers.len());
    for (position, layer) in manifest.layers.iter().enumerate() {
        let media_type = layer.media_type.as_deref().unwrap_or_default();
        let compression =
            layer_compression(media_type).ok_or_else(|| ImageError::UnsupportedMediaType {
                path: store.display(member),
                media_type: media_type.to_owned(),
            })?;
        let blob_digest = Digest::parse(&layer.digest, &store.display(member))?;
        layers.push(LayerPlan {
            member: blob_member(&blob_digest),
            compression: Some(compression),
            blob: Some((blob_digest, layer.size)),
            diff_id: diff_ids.as_ref().map(|ids| ids[position].clone()),
        });
    }
    Ok(Plan {
        config: image_config(config, digest),
        layers,
    })
}

/// The config's `rootfs.diff_ids`, one per layer; `None` when the config has no `rootfs`.
fn diff_ids(
    store: &Store,
    config_member: &str,
    config: &ConfigFile,
    layer_count: usize,
) -> Result<Option<Vec<Digest>>, ImageError> {
    let Some(rootfs) = &config.rootfs else {
        return Ok(None);
    };
    let path = store.display(config_member);
    if rootfs.kind != "layers" {
        return Err(ImageError::corrupt(
            path,
            format!("rootfs type {:?} is not \"layers\"", rootfs.kind),
        ));
    }
    if rootfs.diff_ids.len() != layer_count {
        return Err(ImageError::corrupt(
            path,
            format!(
                "{} diff_ids for {layer_count} layers",
                rootfs.diff_ids.len()
            ),
        ));
    }
    rootfs
        .diff_ids
        .iter()
        .map(|id| Digest::parse(id, &path))
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn image_config(config: ConfigFile, digest: Digest) -> ImageConfig {
    let container = config.config.unwrap_or_default();
    ImageConfig {
        entrypoint: container.entrypoint.unwrap_or_default(),
        cmd: container.cmd.unwrap_or_default(),
        env: container.env.unwrap_or_default(),
        working_dir: container.working_dir.filter(|dir| !dir.is_empty()),
        user: container.user.filter(|user| !user.is_empty()),
        digest,
    }
}

/// The digest a docker save member name carries: `HEX.json` (the config of the classic
/// format) or `blobs/sha256/HEX` (docker 25 and later).
fn digest_in_member_name(member: &str) -> Option<Digest> {
    let name = member.rsplit('/').next()?;
    if let Some(hex) = member.strip_prefix("blobs/sha256/") {
        return Digest::from_hex(hex);
    }
    Digest::from_hex(name.strip_suffix(".json")?)
}

/// Checks a member name from `manifest.json` and returns it normalised.
fn docker_member(store: &Store, name: &str) -> Result<String, ImageError> {
    let components = normal_components(name.as_bytes()).ok_or_else(|| ImageError::PathEscape {
        layer: store.display("manifest.json"),
        entry: name.into(),
        reason: crate::EscapeReason::ParentComponent,
    })?;
    Ok(String::from_utf8_lossy(&components.join(&b'/')).into_owned())
}

/// Resolves a docker save archive (classic format, `manifest.json`) to a plan. Layers carry
/// no digests of their own there, so each is verified against the config's `diff_ids`, and
/// the config against the digest its name carries. The config digest (the image id) stands
/// in for the manifest digest, which this format does not have.
pub(crate) fn resolve_docker(
    store: &Store,
    reference: Option<&str>,
    options: &UnpackOptions,
) -> Result<Plan, ImageError> {
    let limit = options.limits.max_json_bytes;
    let bytes = store.read_small("manifest.json", limit, "the docker manifest")?;
    let entries: Vec<DockerManifestEntry> =
        parse_json(store, "manifest.json", &bytes, "the docker manifest")?;
    let entry = match reference {
        Some(reference) => {
            let with_latest = format!("{reference}:latest");
            entries
                .iter()
                .find(|entry| {
                    entry.repo_tags.iter().flatten().any(|tag| {
                        tag == reference
                            || (reference_tag(reference).is_none() && *tag == with_latest)
                    })
                })
                .ok_or_else(|| ImageError::ReferenceNotFound {
                    path: store.root().to_owned(),
                    reference: reference.to_owned(),
                })?
        }
        None => match entries.as_slice() {
            [] => {
                return Err(ImageError::corrupt(
                    store.display("manifest.json"),
                    "it lists no images",
                ))
            }
            [only] => only,
            several => {
                return Err(ImageError::Ambiguous {
                    path: store.root().to_owned(),
                    count: several.len(),
                })
            }
        },
    };

    let config_member = docker_member(store, &entry.config)?;
    let config_bytes = store.read_small(&config_member, limit, "an image config")?;
    let config_digest = Digest::of_bytes(&config_bytes);
    if let Some(expected) = digest_in_member_name(&config_member) {
        expected.verify(&config_digest, &store.display(&config_member))?;
    }
    let config: ConfigFile = parse_json(store, &config_member, &config_bytes, "an image config")?;
    let diff_ids =
        diff_ids(store, &config_member, &config, entry.layers.len())?.ok_or_else(|| {
            ImageError::corrupt(store.display(&config_member), "the config has no rootfs")
        })?;

    let mut layers = Vec::with_capacity(entry.layers.len());
    for (name, diff_id) in entry.layers.iter().zip(diff_ids) {
        let member = docker_member(store, name)?;
        let blob = match digest_in_member_name(&member) {
            Some(digest) if member.starts_with("blobs/") => {
                let (_, size) = store.open(&member)?;
                Some((digest, size))
            }
            _ => None,
        };
        layers.push(LayerPlan {
            member,
            compression: None,
            blob,
            diff_id: Some(diff_id),
        });
    }
    Ok(Plan {
        config: image_config(config, config_digest),
        layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_tag_ignores_registry_ports() {
        assert_eq!(reference_tag("alpine:3.19"), Some("3.19"));
        assert_eq!(reference_tag("localhost:5000/alpine"), None);
        assert_eq!(reference_tag("localhost:5000/alpine:edge"), Some("edge"));
    }

    #[test]
    fn member_names_carry_digests() {
        let hex = "b".repeat(64);
        assert!(digest_in_member_name(&format!("{hex}.json")).is_some());
        assert!(digest_in_member_name(&format!("blobs/sha256/{hex}")).is_some());
        assert!(digest_in_member_name(&format!("{hex}/layer.tar")).is_none());
        assert!(digest_in_member_name("config.json").is_none());
    }
}
