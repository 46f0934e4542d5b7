//! Tenant image uploads: `POST /v1/templates/{name}/image` streams an OCI archive, a
//! `docker save` tarball or (with `?kind=rootfs`) a root-filesystem tarball to disk under a size
//! cap, then registers the template from it. This is how tenants bring images: they may not name
//! host paths (docs/SECURITY.md).
//!
//! The body is either the archive itself, or `multipart/form-data` with a part `spec` (JSON: the
//! template's fields other than `name` and `source`, e.g. `{"command": [...], "limits": {...}}`)
//! and a part `image` (the archive). Nothing is held in memory beyond one chunk: the archive goes
//! to `DATA_DIR/uploads/<tenant>.<random>.part` (0600), counted against the caller's disk quota
//! while it arrives, and is removed once imported or refused.

use std::collections::HashMap;
use std::path::{Path as FsPath, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::{Extension, Json};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use serde::Deserialize;
use tokio::io::AsyncWriteExt;
use torpor_control::error::ErrorKind;
use torpor_control::{ControlError, UploadAllowance, UploadKind};
use torpor_core::{TemplateName, TemplateSpec, TenantId};

use crate::body::{content_length, MAX_JSON_BODY};
use crate::errors::{ApiError, ApiResult};
use crate::params::bad_query;
use crate::state::ApiState;
use crate::types::Template;

/// The largest archive one upload may carry (a tenant's disk quota may allow less).
pub const MAX_UPLOAD_BYTES: u64 = 8 << 30;
/// Uploads one tenant may stream at once.
pub const MAX_UPLOADS_PER_TENANT: usize = 2;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UploadQuery {
    /// `image` (default) or `rootfs`.
    kind: Option<String>,
    /// Which image of a multi-image archive.
    reference: Option<String>,
}

/// Uploads in flight, per tenant.
fn in_flight() -> &'static Mutex<HashMap<TenantId, usize>> {
    static IN_FLIGHT: OnceLock<Mutex<HashMap<TenantId, usize>>> = OnceLock::new();
    IN_FLIGHT.get_or_init(Default::default)
}

/// One of a tenant's upload places, given back on drop.
struct UploadSlot(TenantId);

impl UploadSlot {
    fn take(tenant: &TenantId) -> ApiResult<UploadSlot> {
        let mut map = in_flight().lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(tenant.clone()).or_default();
        if *n >= MAX_UPLOADS_PER_TENANT {
            return Err(ApiError::new(
                ErrorKind::RateLimited,
                "rate_limited",
                format!("at most {MAX_UPLOADS_PER_TENANT} uploads at once; retry when one ends"),
            )
            .with_retry_after(1));
        }
        *n += 1;
        Ok(UploadSlot(tenant.clone()))
    }
}

impl Drop for UploadSlot {
    fn drop(&mut self) {
        let mut map = in_flight().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = map.get_mut(&self.0) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.0);
            }
        }
    }
}

/// The partial file, removed unless the import took it over.
struct Partial(PathBuf);

impl Drop for Partial {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

pub async fn upload_template_image(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(name): Path<String>,
    query: Result<Query<UploadQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<(StatusCode, Json<Template>)> {
    let Query(q) = query.map_err(bad_query)?;
    let name = TemplateName::new(&name)
        .map_err(|e| ApiError::new(ErrorKind::InvalidArgument, "invalid_request", e.to_string()))?;
    let kind = match q.kind.as_deref() {
        None | Some("image") => UploadKind::Image,
        Some("rootfs") => UploadKind::Rootfs,
        Some(other) => {
            return Err(ApiError::new(
                ErrorKind::InvalidArgument,
                "invalid_request",
                format!("kind must be `image` or `rootfs`, not {other:?}"),
            ))
        }
    };
    let engine = &state.engine;
    let _slot = UploadSlot::take(&tenant)?;
    // Refuse before reading a byte when the tenant may not add a template.
    let allowance = engine.upload_allowance(&tenant, MAX_UPLOAD_BYTES).await?;
    // A stated length over what may be kept is refused before a byte is kept.
    if content_length(&headers).is_some_and(|n| n > allowance.bytes) {
        drain(
            body.into_data_stream()
                .map(|r| r.map_err(|e| e.to_string())),
        )
        .await;
        return Err(over_cap(allowance));
    }
    let dir = engine.upload_dir();
    make_private_dir(&dir)?;
    let partial = Partial(dir.join(format!("{tenant}.{:016x}.part", rand::random::<u64>())));
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mut spec_json: Option<serde_json::Value> = None;
    let mut got_archive = false;
    if let Ok(boundary) = multer::parse_boundary(content_type) {
        let mut parts = multer::Multipart::new(body.into_data_stream(), boundary);
        while let Some(field) = parts.next_field().await.map_err(multipart_error)? {
            match field.name() {
                Some("spec") => {
                    let text = read_small(field).await?;
                    spec_json = Some(serde_json::from_slice(&text).map_err(|e| {
                        ApiError::new(
                            ErrorKind::InvalidArgument,
                            "invalid_json",
                            format!("spec part: {e}"),
                        )
                    })?);
                }
                Some("image") if !got_archive => {
                    let stream = field.map(|r| r.map_err(|e| e.to_string()));
                    write_capped(stream, &partial.0, allowance).await?;
                    got_archive = true;
                }
                other => {
                    return Err(ApiError::new(
                        ErrorKind::InvalidArgument,
                        "invalid_request",
                        format!(
                            "unexpected multipart part {:?}: send `spec` (JSON) and `image` (the archive)",
                            other.unwrap_or("")
                        ),
                    ))
                }
            }
        }
    } else {
        let stream = body
            .into_data_stream()
            .map(|r| r.map_err(|e| e.to_string()));
        write_capped(stream, &partial.0, allowance).await?;
        got_archive = true;
    }
    if !got_archive {
        return Err(ApiError::new(
            ErrorKind::InvalidArgument,
            "invalid_request",
            "no archive: send it as the body, or as the multipart part `image`",
        ));
    }
    let spec = template_spec(&name, spec_json, q.reference)?;
    let rec = engine
        .register_template_upload(&tenant, spec, &partial.0, kind, &|step| {
            tracing::info!(step, "template build (upload)")
        })
        .await?;
    Ok((StatusCode::CREATED, Json(Template::from(&rec))))
}

/// The template's spec: the caller's fields, its name from the path, an uploaded source.
fn template_spec(
    name: &TemplateName,
    fields: Option<serde_json::Value>,
    reference: Option<String>,
) -> ApiResult<TemplateSpec> {
    let mut fields = match fields {
        None => serde_json::Map::new(),
        Some(serde_json::Value::Object(m)) => m,
        Some(_) => {
            return Err(ApiError::new(
                ErrorKind::InvalidArgument,
                "invalid_request",
                "the spec part must be a JSON object",
            ))
        }
    };
    for key in ["name", "source"] {
        if fields.contains_key(key) {
            return Err(ApiError::new(
                ErrorKind::InvalidArgument,
                "invalid_request",
                format!("the spec part may not set `{key}`: the path names the template and the body is its source"),
            ));
        }
    }
    fields.insert("name".into(), name.as_str().into());
    let mut source = serde_json::json!({"kind": "image", "path": torpor_control::UPLOADED});
    if let Some(r) = reference {
        source["reference"] = r.into();
    }
    fields.insert("source".into(), source);
    serde_json::from_value(serde_json::Value::Object(fields)).map_err(|e| {
        ApiError::new(
            ErrorKind::InvalidArgument,
            "invalid_request",
            format!("spec part: {e}"),
        )
    })
}

/// Streams `body` into a new file at `path` (0600), refusing it once it passes the allowance.
async fn write_capped<S>(mut body: S, path: &FsPath, allowance: UploadAllowance) -> ApiResult<u64>
where
    S: Stream<Item = Result<Bytes, String>> + Unpin,
{
    let mut file = tokio::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .await
        .map_err(|e| internal("cannot create an upload file", e))?;
    let mut written: u64 = 0;
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| {
            ApiError::new(
                ErrorKind::InvalidArgument,
                "invalid_request",
                format!("the upload was cut short: {e}"),
            )
        })?;
        written += chunk.len() as u64;
        if written > allowance.bytes {
            drop(file);
            drain(body).await;
            return Err(over_cap(allowance));
        }
        file.write_all(&chunk)
            .await
            .map_err(|e| internal("cannot write an upload", e))?;
    }
    file.flush()
        .await
        .map_err(|e| internal("cannot write an upload", e))?;
    if written == 0 {
        return Err(ApiError::new(
            ErrorKind::InvalidArgument,
            "invalid_request",
            "the archive is empty",
        ));
    }
    Ok(written)
}

/// Most of a refused upload read and dropped before the refusal is sent, and for how long.
const DRAIN_MAX_BYTES: usize = 64 << 20;
const DRAIN_MAX_TIME: std::time::Duration = std::time::Duration::from_secs(5);

/// Reads and drops what is left of a refused upload, up to [`DRAIN_MAX_BYTES`] and
/// [`DRAIN_MAX_TIME`]: a client still sending then reads the refusal instead of a connection
/// reset (closing a socket with unread data resets it). A larger body is cut.
async fn drain<S>(mut body: S)
where
    S: Stream<Item = Result<Bytes, String>> + Unpin,
{
    let _ = tokio::time::timeout(DRAIN_MAX_TIME, async {
        let mut n = 0;
        while let Some(Ok(chunk)) = body.next().await {
            n += chunk.len();
            if n > DRAIN_MAX_BYTES {
                break;
            }
        }
    })
    .await;
}

/// An upload over what it may bring: the tenant's disk quota when that is what capped it, else
/// the upload size limit.
fn over_cap(allowance: UploadAllowance) -> ApiError {
    if let Some((limit, used)) = allowance.disk_quota {
        ApiError::from(ControlError::QuotaExceeded {
            what: "disk_mib",
            limit,
            used,
        })
    } else {
        ApiError::new(
            ErrorKind::PayloadTooLarge,
            "body_too_large",
            format!("uploads are limited to {} MiB", MAX_UPLOAD_BYTES >> 20),
        )
    }
}

async fn read_small(mut field: multer::Field<'_>) -> ApiResult<Vec<u8>> {
    let mut out = Vec::new();
    while let Some(chunk) = field.chunk().await.map_err(multipart_error)? {
        out.extend_from_slice(&chunk);
        if out.len() > MAX_JSON_BODY {
            return Err(ApiError::new(
                ErrorKind::PayloadTooLarge,
                "body_too_large",
                format!("the spec part is limited to {MAX_JSON_BODY} bytes"),
            ));
        }
    }
    Ok(out)
}

fn multipart_error(e: multer::Error) -> ApiError {
    ApiError::new(
        ErrorKind::InvalidArgument,
        "invalid_request",
        format!("multipart body: {e}"),
    )
}

fn make_private_dir(dir: &FsPath) -> ApiResult<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .and_then(|()| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)))
        .map_err(|e| internal("cannot create the upload directory", e))
}

/// A daemon-side failure: logged with its detail; the client hears only the code.
fn internal(what: &str, e: std::io::Error) -> ApiError {
    tracing::error!(error = %e, "{what}");
    ApiError::new(
        ErrorKind::Internal,
        "io_error",
        "the upload could not be stored",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_part_cannot_name_a_source_or_a_name() {
        let n = TemplateName::new("app").unwrap();
        let e = template_spec(
            &n,
            Some(serde_json::json!({"source": {"kind": "host"}})),
            None,
        )
        .unwrap_err();
        assert_eq!(e.code(), "invalid_request");
        let e = template_spec(&n, Some(serde_json::json!({"name": "x"})), None).unwrap_err();
        assert_eq!(e.code(), "invalid_request");
        let s = template_spec(
            &n,
            Some(serde_json::json!({"command": ["/bin/app"]})),
            Some("app:1".into()),
        )
        .unwrap();
        assert_eq!(s.command, vec!["/bin/app".to_string()]);
        assert_eq!(
            s.source,
            torpor_core::TemplateSource::Image {
                path: torpor_control::UPLOADED.into(),
                reference: Some("app:1".into())
            }
        );
        assert!(template_spec(&n, Some(serde_json::json!({"colour": 1})), None).is_err());
        assert!(template_spec(&n, Some(serde_json::json!([1])), None).is_err());
    }

    #[tokio::test]
    async fn an_upload_over_its_cap_is_refused_and_nothing_is_kept_in_memory() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("x.part");
        let chunks = futures::stream::iter(
            (0..100).map(|_| Ok::<_, String>(Bytes::from(vec![0u8; 1 << 16]))),
        );
        let quota = UploadAllowance {
            bytes: 1 << 20,
            disk_quota: Some((1, 0)),
        };
        let e = write_capped(chunks, &path, quota).await.unwrap_err();
        assert_eq!(e.code(), "quota_exceeded");
        let ok =
            futures::stream::iter((0..4).map(|_| Ok::<_, String>(Bytes::from_static(b"abcd"))));
        let path2 = tmp.path().join("y.part");
        assert_eq!(write_capped(ok, &path2, quota).await.unwrap(), 16);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&path2).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }
}
