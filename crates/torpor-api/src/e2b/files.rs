//! envd's HTTP `/files`: download (`GET`) and upload (`POST`, multipart or octet-stream), each
//! optionally gzip-compressed as envd does (`Accept-Encoding: gzip` on a download,
//! `Content-Encoding: gzip` on an upload). An upload may carry file metadata in
//! `X-Metadata-*` headers ([`super::fs::metadata`]).

use std::io::{Read as _, Write as _};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use super::connect::{Code, RpcError};
use super::fs::{basic_user, not_found_as, parent_and_name, resolve};
use super::signed::{files_ctx, Operation};
use super::{E2b, E2bError};

#[derive(Debug, Deserialize)]
pub struct FilesQuery {
    pub(crate) path: Option<String>,
    pub(crate) username: Option<String>,
    /// A signed URL's signature and expiry (Unix seconds): see [`super::signed`].
    pub(crate) signature: Option<String>,
    pub(crate) signature_expiration: Option<i64>,
}

pub(crate) fn http_err(e: RpcError) -> E2bError {
    let status = match e.code {
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::ResourceExhausted => StatusCode::PAYLOAD_TOO_LARGE,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    E2bError::new(status, e.message)
}

/// The body's content coding, as far as an upload may have one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    Identity,
    Gzip,
}

/// `Content-Encoding` of an upload: none, `identity` or `gzip` (415 for anything else).
pub fn upload_coding(headers: &HeaderMap) -> Result<Coding, E2bError> {
    let Some(v) = headers.get(header::CONTENT_ENCODING) else {
        return Ok(Coding::Identity);
    };
    let v = v.to_str().unwrap_or("").trim();
    if v.is_empty() || v.eq_ignore_ascii_case("identity") {
        Ok(Coding::Identity)
    } else if v.eq_ignore_ascii_case("gzip") || v.eq_ignore_ascii_case("x-gzip") {
        Ok(Coding::Gzip)
    } else {
        Err(E2bError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("unsupported Content-Encoding {v:?} (gzip or identity)"),
        ))
    }
}

/// Whether `Accept-Encoding` accepts gzip (`gzip`, `x-gzip` or `*`, without `q=0`).
pub fn accepts_gzip(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|item| {
            let mut parts = item.split(';').map(str::trim);
            let coding = parts.next().unwrap_or("");
            let zero_q = parts.any(|p| {
                p.strip_prefix("q=")
                    .and_then(|q| q.trim().parse::<f32>().ok())
                    .is_some_and(|q| q == 0.0)
            });
            !zero_q
                && (coding.eq_ignore_ascii_case("gzip")
                    || coding.eq_ignore_ascii_case("x-gzip")
                    || coding == "*")
        })
}

/// Inflates a gzip body (one or more members) of at most `limit` bytes once inflated: a body
/// that inflates past it is refused (413) as soon as it does, so a small bomb costs nothing.
pub fn gunzip_capped(data: &[u8], limit: usize) -> Result<Vec<u8>, E2bError> {
    let mut out = Vec::new();
    let mut dec = flate2::read::MultiGzDecoder::new(data).take(limit as u64 + 1);
    dec.read_to_end(&mut out)
        .map_err(|_| E2bError::bad_request("the body is not valid gzip"))?;
    if out.len() > limit {
        return Err(E2bError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the inflated body is larger than {limit} bytes"),
        ));
    }
    Ok(out)
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(
        Vec::with_capacity(data.len() / 2 + 64),
        flate2::Compression::fast(),
    );
    enc.write_all(data).expect("writing to a Vec");
    enc.finish().expect("writing to a Vec")
}

/// GET /files?path= → the file's raw bytes (gzip-compressed when the client accepts it).
pub async fn download(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    q: Result<Query<FilesQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, E2bError> {
    let Query(q) = q.map_err(|e| E2bError::bad_request(e.body_text()))?;
    let c = files_ctx(&st, &headers, &q, Operation::Read)?;
    let user = q.username.clone().or_else(|| basic_user(&headers));
    let path = resolve(q.path.as_deref().unwrap_or(""), user.as_deref()).map_err(http_err)?;
    let data = st
        .api
        .engine
        .read_file(&c.tenant, &c.id, &path, crate::body::MAX_FILE_BODY as u64)
        .await
        .map_err(|e| http_err(not_found_as(e.into(), &path)))?;
    if accepts_gzip(&headers) {
        let packed = tokio::task::spawn_blocking(move || gzip(&data))
            .await
            .map_err(|_| E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, "compression failed"))?;
        return Ok((
            [
                (header::CONTENT_TYPE, "application/octet-stream"),
                (header::CONTENT_ENCODING, "gzip"),
                (header::VARY, "Accept-Encoding"),
            ],
            Body::from(packed),
        )
            .into_response());
    }
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream"),
            (header::VARY, "Accept-Encoding"),
        ],
        Body::from(data),
    )
        .into_response())
}

/// POST /files?path= (multipart/form-data, or application/octet-stream; either possibly
/// `Content-Encoding: gzip`) → the written entries. `X-Metadata-<key>` headers give every file
/// written that metadata (checked before anything is read or written; 400 if envd would refuse
/// it); an upload without them leaves the new file with none, as a replaced file's is gone.
pub async fn upload(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    q: Result<Query<FilesQuery>, axum::extract::rejection::QueryRejection>,
    body: Body,
) -> Result<Response, E2bError> {
    let Query(q) = q.map_err(|e| E2bError::bad_request(e.body_text()))?;
    let c = files_ctx(&st, &headers, &q, Operation::Write)?;
    let user = q.username.clone().or_else(|| basic_user(&headers));
    let metadata = super::fs::metadata::from_headers(&headers)?;
    let coding = upload_coding(&headers)?;
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    // The body is read only now (the caller is known), within the upload budgets; once
    // inflated it is held to the same cap.
    let _slot = crate::files::upload_slot(&st.api, &c.tenant, &headers)?;
    let mut body = super::read_body(&headers, body, crate::body::MAX_FILE_BODY).await?;
    if coding == Coding::Gzip {
        body = tokio::task::spawn_blocking(move || {
            gunzip_capped(&body, crate::body::MAX_FILE_BODY).map(Bytes::from)
        })
        .await
        .map_err(|_| E2bError::bad_request("the body is not valid gzip"))??;
    }
    let mut files: Vec<(String, Bytes)> = Vec::new();
    if ct.starts_with("multipart/form-data") {
        let boundary = super::multipart::boundary(&ct)
            .ok_or_else(|| E2bError::bad_request("multipart body without a boundary"))?;
        let parts = super::multipart::parse(&body, &boundary).map_err(E2bError::bad_request)?;
        let single = parts.len() == 1;
        for p in parts {
            let target = match (&q.path, p.filename.as_deref()) {
                (Some(path), _) if single => path.clone(),
                (_, Some(f)) if !f.is_empty() => f.to_string(),
                (Some(path), _) => path.clone(),
                _ => {
                    return Err(E2bError::bad_request(
                        "a part names no file and no path= was given",
                    ))
                }
            };
            files.push((target, body.slice_ref(p.data)));
        }
    } else {
        let path = q
            .path
            .clone()
            .ok_or_else(|| E2bError::bad_request("path= is required"))?;
        files.push((path, body.clone()));
    }
    let paths = files
        .iter()
        .map(|(raw, _)| resolve(raw, user.as_deref()).map_err(http_err))
        .collect::<Result<Vec<_>, _>>()?;
    if !metadata.is_empty()
        && !super::fs::metadata::agent_keeps_metadata(&st, &c)
            .await
            .map_err(http_err)?
    {
        return Err(E2bError::bad_request(super::fs::metadata::AGENT_TOO_OLD));
    }
    let mut written = Vec::new();
    for ((_, data), path) in files.into_iter().zip(paths) {
        st.api
            .engine
            .write_file(&c.tenant, &c.id, &path, None, &data)
            .await
            .map_err(|e| http_err(e.into()))?;
        // E2B's `base`: the agent makes new files `user`'s; one written as `root` is root's.
        if c.base && user.as_deref() == Some("root") {
            let _ = super::envd::run(&st, &c, &["chown", "0:0", "--", &path], Vec::new()).await;
        }
        let mut entry = json!({"name": parent_and_name(&path).1, "type": "file", "path": path});
        if !metadata.is_empty() {
            // What the file holds afterwards, as envd reads it back.
            let kept = super::fs::metadata::set(&st, &c, &path, metadata.clone())
                .await
                .map_err(|e| http_err(not_found_as(e, &path)))?;
            if !kept.is_empty() {
                entry["metadata"] = json!(kept);
            }
        }
        written.push(entry);
    }
    Ok(axum::Json(written).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn h(name: header::HeaderName, v: &str) -> HeaderMap {
        let mut m = HeaderMap::new();
        m.insert(name, HeaderValue::from_str(v).unwrap());
        m
    }

    #[test]
    fn accept_encoding_is_read_as_http_says() {
        assert!(accepts_gzip(&h(header::ACCEPT_ENCODING, "gzip")));
        assert!(accepts_gzip(&h(header::ACCEPT_ENCODING, "br, GZIP;q=0.5")));
        assert!(accepts_gzip(&h(header::ACCEPT_ENCODING, "*")));
        assert!(!accepts_gzip(&h(header::ACCEPT_ENCODING, "gzip;q=0")));
        assert!(!accepts_gzip(&h(header::ACCEPT_ENCODING, "identity, br")));
        assert!(!accepts_gzip(&HeaderMap::new()));
    }

    #[test]
    fn upload_codings_are_gzip_or_identity() {
        assert_eq!(upload_coding(&HeaderMap::new()).unwrap(), Coding::Identity);
        assert_eq!(
            upload_coding(&h(header::CONTENT_ENCODING, "gzip")).unwrap(),
            Coding::Gzip
        );
        let e = upload_coding(&h(header::CONTENT_ENCODING, "br")).unwrap_err();
        assert_eq!(e.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    }

    #[test]
    fn gzip_round_trips_and_bombs_are_refused() {
        let data = b"hello gzip".repeat(100);
        assert_eq!(gunzip_capped(&gzip(&data), data.len()).unwrap(), data);
        let e = gunzip_capped(&gzip(&data), data.len() - 1).unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        let bomb = gzip(&vec![0u8; 8 << 20]);
        assert!(bomb.len() < 64 << 10);
        assert_eq!(
            gunzip_capped(&bomb, 1 << 20).unwrap_err().status,
            StatusCode::PAYLOAD_TOO_LARGE
        );
        assert_eq!(
            gunzip_capped(b"not gzip", 100).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
    }
}
